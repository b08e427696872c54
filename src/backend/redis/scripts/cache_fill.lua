-- Write a computed value, fenced by the compute lease: only while the writer's token still
-- holds it, so a loader that outlived its lease never overwrites a newer value.
-- KEYS: compute lock's key (its record: see acquire.lua), value hash
-- ARGV: token, payload, compute time (us), grace (ms), lifetime (ms: ttl + grace), channel,
--       the writing round (the lease's fencing token)
-- Returns 1 if written (and waiters told on the channel), 0 if the lease is not ours.
local lease = record(KEYS[1], 't', 'e')
if not lease or holding(lease[1], lease[2], server_clock()) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'v', ARGV[2], 'd', ARGV[3], 'g', ARGV[4], 'r', ARGV[7])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
-- pcall: where the user's ACL refuses the channel, the message is dropped and the
-- script goes on (waiters then find out by their fallback re-check).
redis.pcall('PUBLISH', ARGV[6], '1')
return 1
