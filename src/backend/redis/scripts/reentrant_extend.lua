-- Extend reentrant leases: each reign's three keys (lease, owners, holds) get the same TTL,
-- only where the lease still holds that reign's token. The TTL is never shortened (other
-- holders of the reign may use a longer one).
-- ARGV[1] minimum uptime (ms; 0 for none; see extend.lua)
-- KEYS[4i-3..4i] lease key, fence hash, owners hash, holds hash   ARGV[2i] lease token
-- ARGV[2i+1] ttl
-- Returns per lease 1 (extended), 0 (not this reign's any more, or not counted), or the
-- error's text when a command of this lease failed (see prelude.lua). The
-- fence hash is kept an hour past the lease (see acquire.lua).
local min_uptime = tonumber(ARGV[1])
local counted = true
if min_uptime > 0 then
  counted = uptime_ms(min_uptime) >= min_uptime
end
local function extend(i)
  local lease, fence, owners, holds = KEYS[4 * i - 3], KEYS[4 * i - 2], KEYS[4 * i - 1], KEYS[4 * i]
  local token = ARGV[2 * i]
  if counted and holder(lease) == token and redis.call('HGET', holds, 'token') == token then
    local keep = math.max(redis.call('PTTL', lease), tonumber(ARGV[2 * i + 1]))
    redis.call('PEXPIRE', lease, keep)
    redis.call('PEXPIRE', owners, keep)
    redis.call('PEXPIRE', holds, keep)
    redis.call('PEXPIRE', fence, keep + 3600000)
    return 1
  end
  return 0
end

local out = {}
for i = 1, #KEYS / 4 do
  local code, err = each(extend, i)
  -- A failed entry is its error's text, in place of its number.
  out[i] = err or code
end
return out
