-- Force release (an operator's `redlease release --force`): deletes the lease whoever holds
-- it, wakes its waiters (plain ones by the release channel, the fair queue's head by the
-- hand-off channel) and deletes a reentrant reign's owners and holds hashes. The fence hash
-- stays (an hour), so fencing tokens keep increasing; the holder's label goes.
-- KEYS: lease key, fence hash, owners hash, fair queue, holds hash (see keys.rs)
-- ARGV: release channel, hand-off channel
-- Returns 0 (nothing held), 1 (the lease was deleted) or 2 (and a reentrant reign's hashes).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], 'h')
redis.call('PEXPIRE', KEYS[2], 3600000)
local owners = redis.call('DEL', KEYS[3])
redis.call('DEL', KEYS[5])
-- pcall: where the user's ACL refuses the channel, the message is dropped and the
-- script goes on (waiters then find out by their fallback re-check).
redis.pcall('PUBLISH', ARGV[1], '1')
local head = redis.call('LINDEX', KEYS[4], 0)
if head then
  redis.pcall('PUBLISH', ARGV[2], head)
end
return 1 + owners
