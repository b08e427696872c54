-- Reentrant release: take one hold out of the reign; at zero, end the lease and wake waiters
-- as release.lua does (see end_lease in prelude.lua).
-- KEYS[1] the lock's key (see reentrant_acquire.lua for the keys beside it)
-- ARGV: owner, hold, the lease token as the caller knows it ('' when abandoning),
--   tombstone ms (> 0 when abandoning: the hold is barred from being counted later),
--   send number (see "Send order" in prelude.lua: a hold counted by an acquire sent after
--   this release is not taken out; 0 when not sent)
-- Returns {1, count left} (0: the lease has ended, also when a step after that failed) or
-- {0, 0} (the hold is not counted in the reign that holds the lock: never counted, or its
-- reign was lost, or no lease at all is there, or a late copy of a release sent before the
-- acquire that counts the hold now).
--
-- Idempotent per hold: a hold is counted once and taken out once. A repeated release of a
-- hold already taken out of the same reign answers the count again; of the hold whose
-- release ended the reign, 0 (see released_by in prelude.lua).
local key = KEYS[1]
local owners, holds = key .. ':owners', key .. ':holds'
local owner, hold, known, tombstone = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local n = ARGV[5] or '0'
local now_ms = server_clock()
if tombstone > 0 then
  bar(key, hold, now_ms, tombstone)
end
local seen = record(key, 't', 'e', 'r', 'w', 'q', 's')
if not seen then
  return {0, 0}
end
local current = holding(seen[1], seen[2], now_ms)
if current then
  local reign = redis.call('HMGET', holds, 'token', 'owner', hold)
  if reign[1] == current and reign[2] == owner then
    if (tonumber(reign[3]) or 0) > tonumber(n) then
      -- Counted again by an acquire sent after this release: a late copy, not this hold's.
      return {0, 0}
    end
    if redis.call('HDEL', holds, hold) == 1 then
      local left = redis.call('HINCRBY', owners, owner, -1)
      if left > 0 then
        return {1, left}
      end
      end_lease(key, seen[4], seen[5], now_ms, hold, seen[6], n)
      -- Released, whatever fails after this.
      pcall(redis.call, 'DEL', owners, holds)
      return {1, 0}
    end
    if known == current then
      -- Counted in this reign and taken out already: a repeated release.
      return {1, tonumber(redis.call('HGET', owners, owner) or '0')}
    end
  end
  return {0, 0}
end
if released_by(hold, seen[1], seen[2], seen[3]) then
  return {1, 0}
end
return {0, 0}
