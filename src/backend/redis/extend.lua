-- Extend many leases at once: each key's TTL is set only if it still holds that token.
-- ARGV[1] minimum uptime (ms; 0 for none): a quorum member up for less than that (it may
-- have restarted empty) extends nothing. Uptime is rounded down to whole seconds, less one
-- (see acquire.lua).
-- KEYS[2i-1] lease key, KEYS[2i] its fence hash   ARGV[2i] its token   ARGV[2i+1] its ttl (ms)
-- Returns one 1 (extended) or 0 (not ours any more, or not counted) per lease. The fence hash
-- is kept an hour past the lease, as at the grant (see acquire.lua).
local min_uptime = tonumber(ARGV[1])
local counted = true
if min_uptime > 0 then
  local s = tonumber(string.match(redis.call('INFO', 'server'), 'uptime_in_seconds:(%-?%d+)'))
  counted = 1000 * math.max((s or 0) - 1, 0) >= min_uptime
end
local out = {}
for i = 1, #KEYS / 2 do
  local lease, fence = KEYS[2 * i - 1], KEYS[2 * i]
  if counted and redis.call('GET', lease) == ARGV[2 * i] then
    local ttl = tonumber(ARGV[2 * i + 1])
    redis.call('PEXPIRE', lease, ttl)
    redis.call('PEXPIRE', fence, ttl + 3600000)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
