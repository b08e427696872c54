-- Extend reentrant leases: each reign's lease and its owners and holds hashes run for the
-- same time, only where the record still holds that reign's token. The lease is never
-- shortened (other holders of the reign may use a longer TTL).
-- ARGV[1] minimum uptime (ms; 0 for none; see extend.lua)
-- KEYS[i] the lock's key   ARGV[2i] lease token   ARGV[2i+1] ttl
-- Returns per lease 1 (extended), 0 (not this reign's any more, or not counted), or the
-- error's text when a command of this lease failed (see prelude.lua).
local now_ms = server_clock()
local min_uptime = tonumber(ARGV[1])
local counted = true
if min_uptime > 0 then
  counted = uptime_ms(min_uptime, math.floor(now_ms / 1000)) >= min_uptime
end
local function extend(i)
  local key, token = KEYS[i], ARGV[2 * i]
  local holds = key .. ':holds'
  local seen = counted and record(key, 't', 'e', 'x')
  if seen and holding(seen[1], seen[2], now_ms) == token
      and redis.call('HGET', holds, 'token') == token then
    local keep = math.max(tonumber(seen[2]) - now_ms, tonumber(ARGV[2 * i + 1]))
    stamp(key, 'e', now_ms + keep, seen[3])
    redis.call('PEXPIRE', key .. ':owners', keep)
    redis.call('PEXPIRE', holds, keep)
    return 1
  end
  return 0
end

local out = {}
-- (Counted by ARGV: on a cluster KEYS also declares the keys beside each lock; see keys.rs.)
for i = 1, (#ARGV - 1) / 2 do
  local code, err = each(extend, i)
  -- A failed entry is its error's text, in place of its number.
  out[i] = err or code
end
return out
