-- Extend many leases at once: each key's TTL is set only if it still holds that token.
-- ARGV[1] minimum uptime (ms; 0 for none): a quorum member up for less than that (it may
-- have restarted empty) extends nothing. Uptime is rounded down to whole seconds, less one
-- (see uptime_ms in prelude.lua).
-- ARGV[2] n, the number of leases; per lease i (1-based): ARGV[3i], ARGV[3i+1], ARGV[3i+2]:
--   its token, its ttl (ms), and the index in KEYS of its fence hash when this extension
--   also renews the hash's hour past the lease (0 when not: the client renews it now and
--   then, well within the hour a grant gives it; see acquire.lua)
-- KEYS[1..n] the lease keys, then the fence hashes being renewed.
-- Returns per lease 1 (extended), 0 (not ours any more: another token, or no lease at all
-- there; or not counted), or the error's text when a command of this lease failed (see
-- prelude.lua).
local min_uptime = tonumber(ARGV[1])
local counted = true
if min_uptime > 0 then
  counted = uptime_ms(min_uptime) >= min_uptime
end
local function extend(i)
  -- (Strings as given: a Lua number passed to Redis is formatted as a double, which costs.)
  local lease, token, ttl, fence = KEYS[i], ARGV[3 * i], ARGV[3 * i + 1], ARGV[3 * i + 2]
  if counted and holder(lease) == token then
    redis.call('PEXPIRE', lease, ttl)
    if fence ~= '0' then
      redis.call('PEXPIRE', KEYS[tonumber(fence)], tonumber(ttl) + 3600000)
    end
    return 1
  end
  return 0
end

local out = {}
for i = 1, tonumber(ARGV[2]) do
  local code, err = each(extend, i)
  -- A failed entry is its error's text, in place of its number.
  out[i] = err or code
end
return out
