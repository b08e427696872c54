-- Force release (an operator's `redlease release --force`): ends the lease whoever holds it,
-- wakes its waiters (see end_lease in prelude.lua) and deletes a reentrant reign's owners and
-- holds hashes, and the shared holds (reads, permits) with their fences and labels. The record stays (its hour), so fencing tokens keep increasing; its `t` is
-- cleared, so the holder's own release later finds nothing of its own.
-- KEYS[1] the lock's key
-- Returns 0 (nothing held), 1 (the lease was ended) or 2 (and a reentrant reign's hashes).
local key = KEYS[1]
local now_ms = server_clock()
local seen = record(key, 't', 'e', 'w', 'q')
if not seen or not holding(seen[1], seen[2], now_ms) then
  return 0
end
redis.call('HSET', key, 't', '')
local owners = redis.call('DEL', key .. ':owners')
redis.call('DEL', key .. ':holds', key .. ':shared', key .. ':sharers')
-- Waiters are woken whether or not a flag says they registered: an operator's release is
-- rare, and a waiter that missed it would wait out the holder's whole lease.
end_lease(key, int(now_ms + 1), int(now_ms + 1), now_ms, nil, int(now_ms + 1))
return 1 + owners
