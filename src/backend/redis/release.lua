-- Release a lease: compare-and-delete, wake waiters if any are registered.
-- KEYS[1] lease key   KEYS[2] fence hash   KEYS[3] waiters flag
-- ARGV[1] token   ARGV[2] release channel
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
