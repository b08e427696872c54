-- Release a lease: compare-and-delete, wake waiters if any are registered.
-- KEYS[1] lease key   KEYS[2] fence hash   KEYS[3] waiters flag   KEYS[4] abandoned tokens
-- ARGV[1] token   ARGV[2] release channel
-- ARGV[3] tombstone ms: > 0 when abandoning an attempt whose outcome is unknown; the token
--         is then barred from the acquire script for that long, so a late copy of the
--         attempt (re-sent after a reconnect) cannot take the lease after this clean-up.
local tombstone = tonumber(ARGV[3])
if tombstone > 0 then
  local now = redis.call('TIME')
  local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now_ms)
  redis.call('ZADD', KEYS[4], now_ms + tombstone, ARGV[1])
  redis.call('PEXPIRE', KEYS[4], tombstone)
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  -- Remember the released token, so a release re-sent after a reconnect still says "ours".
  redis.call('HSET', KEYS[2], 'r', ARGV[1])
  if redis.call('EXISTS', KEYS[3]) == 1 then
    redis.call('PUBLISH', ARGV[2], '1')
  end
  return 1
end
if redis.call('HGET', KEYS[2], 'r') == ARGV[1] then
  return 1
end
return 0
