-- Record that a compute round failed, fenced by its lease, so callers in other processes
-- that wait on that round get the error instead of running the origin again; later rounds
-- never see it (it is keyed by the round's fencing token).
-- KEYS: compute lease, failed rounds hash
-- ARGV: token, round, message, how long to keep it (ms), channel
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PUBLISH', ARGV[5], '1')
return 1
