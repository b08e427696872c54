-- Reentrant release: take one hold out of the reign; at zero, delete the lease and wake
-- waiters as release.lua does (plain waiters by the release channel, the fair queue's head by
-- the hand-off channel).
-- KEYS: lease key, fence hash, owners hash, holds hash, abandoned tokens, fair queue, fair
--   timeouts (see reentrant_acquire.lua, release.lua, fair_acquire.lua)
-- ARGV: owner, hold, the lease token as the caller knows it ('' when abandoning),
--   tombstone ms (> 0 when abandoning: the hold is barred from being counted later),
--   release channel, hand-off channel
-- Returns {1, count left} (0: the lease is gone, also when a step after the deletion failed)
-- or {0, 0} (the hold is not counted in the reign that holds the key: never counted, or its
-- reign was lost, or no lease at all is there).
--
-- Idempotent per hold: a hold is counted once and taken out once. A repeated release of a
-- hold already taken out of the same reign answers the count again; of the hold whose
-- release ended the reign, 0 (the fence hash's `r`, as release.lua).
local lease, fence, owners, holds, abandoned, queue, timeouts =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local owner, hold, known, tombstone, channel, handoff =
  ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6]
local now_ms
local function now()
  if not now_ms then
    local t = redis.call('TIME')
    now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now_ms
end
if tombstone > 0 then
  redis.call('ZREMRANGEBYSCORE', abandoned, '-inf', now())
  redis.call('ZADD', abandoned, now() + tombstone, hold)
  redis.call('PEXPIRE', abandoned, tombstone)
end
local current = holder(lease)
if current and redis.call('HGET', holds, 'token') == current
    and redis.call('HGET', holds, 'owner') == owner then
  if redis.call('HDEL', holds, hold) == 1 then
    local left = redis.call('HINCRBY', owners, owner, -1)
    if left > 0 then
      return {1, left}
    end
    redis.call('DEL', lease, owners, holds)
    -- Released, whatever fails after this (a fence hash of another type, say).
    pcall(function()
      if after_release(fence, hold, channel, now) and redis.call('LLEN', queue) > 0 then
        wake_head(queue, timeouts, handoff, now())
      end
    end)
    return {1, 0}
  end
  if known == current then
    -- Counted in this reign and taken out already: a repeated release.
    return {1, tonumber(redis.call('HGET', owners, owner) or '0')}
  end
  return {0, 0}
end
if not current and redis.call('HGET', fence, 'r') == hold then
  return {1, 0}
end
return {0, 0}
