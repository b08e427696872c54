-- Acquire a lease: SET NX PX, or report "already ours" when a replayed attempt finds our
-- own token; mint a fencing token on a new grant.
-- KEYS[1] lease key   KEYS[2] fence hash {f = last token, r = last released lease}
-- KEYS[3] waiters flag   KEYS[4] abandoned tokens (sorted set, see release.lua)
-- ARGV[1] token   ARGV[2] ttl (ms)   ARGV[3] waiters-flag ttl (ms), 0 when not waiting
-- ARGV[4] 1 for a waiting acquire's first attempt: it yields to registered waiters
if redis.call('ZSCORE', KEYS[4], ARGV[1]) then
  -- A late copy of an attempt that was given up and cleaned up already: never grant it.
  return {0, redis.call('PTTL', KEYS[1])}
end
if ARGV[4] == '1' and redis.call('EXISTS', KEYS[3]) == 1 then
  -- Others are waiting: queue behind them rather than take the lock from under them.
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[3])
  return {2, redis.call('PTTL', KEYS[1])}
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  -- The fence never goes backwards: at least last + 1, and at least the server's clock in
  -- microseconds, so a restarted server without persistence still hands out larger tokens.
  local now = redis.call('TIME')
  local floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
  local last = tonumber(redis.call('HGET', KEYS[2], 'f') or '0')
  local fence = math.max(last + 1, floor)
  redis.call('HSET', KEYS[2], 'f', string.format('%.0f', fence))
  return {1, fence}
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(redis.call('HGET', KEYS[2], 'f') or '0')}
end
if ARGV[3] ~= '0' then
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[3])
end
return {0, redis.call('PTTL', KEYS[1])}
