-- Release leases, one or many at once (group commit): compare-and-delete, and wake waiters
-- if any are registered: plain waiters by a message on the release channel, the fair
-- queue's head by its token on the hand-off channel (only that waiter acts on it).
-- Per lease i (0-based), KEYS[6i+1..6i+6]:
--   lease key, fence hash, waiters flag, abandoned tokens, fair queue, fair timeouts
--   (see fair_acquire.lua)
-- ARGV[4i+1..4i+4]:
--   token, release channel,
--   tombstone ms: > 0 when abandoning an attempt whose outcome is unknown; the token is
--   then barred from the acquire scripts for that long, so a late copy of the attempt
--   (re-sent after a reconnect) cannot take the lease after this clean-up; it also leaves
--   the fair queue,
--   hand-off channel
-- Returns per lease 1 (released, also when a re-sent release finds it released by the same
-- token) or 0 (not ours).
local now_ms
local function now()
  if not now_ms then
    local t = redis.call('TIME')
    now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now_ms
end
local out = {}
for i = 0, #KEYS / 6 - 1 do
  local lease, fence, waiters, abandoned = KEYS[6 * i + 1], KEYS[6 * i + 2], KEYS[6 * i + 3], KEYS[6 * i + 4]
  local queue, timeouts = KEYS[6 * i + 5], KEYS[6 * i + 6]
  local token, channel, tombstone, handoff =
    ARGV[4 * i + 1], ARGV[4 * i + 2], tonumber(ARGV[4 * i + 3]), ARGV[4 * i + 4]
  local wake = false
  if tombstone > 0 then
    redis.call('ZREMRANGEBYSCORE', abandoned, '-inf', now())
    redis.call('ZADD', abandoned, now() + tombstone, token)
    redis.call('PEXPIRE', abandoned, tombstone)
    -- A fair waiter that gave up leaves the queue at once; if it was the head, the next
    -- one is woken below rather than after the leaver's deadline.
    if redis.call('ZREM', timeouts, token) == 1 then
      wake = redis.call('LINDEX', queue, 0) == token
      redis.call('LREM', queue, 1, token)
    end
  end
  if redis.call('GET', lease) == token then
    redis.call('DEL', lease)
    -- Remember the released token, so a release re-sent after a reconnect still says "ours";
    -- the holder's label goes with the lease.
    redis.call('HSET', fence, 'r', token)
    redis.call('HDEL', fence, 'h')
    redis.call('PEXPIRE', fence, 3600000)
    if redis.call('EXISTS', waiters) == 1 then
      redis.call('PUBLISH', channel, '1')
    end
    wake = true
    out[i + 1] = 1
  elseif redis.call('HGET', fence, 'r') == token then
    out[i + 1] = 1
  else
    out[i + 1] = 0
  end
  if wake and redis.call('LLEN', queue) > 0 and redis.call('EXISTS', lease) == 0 then
    -- Hand the free lock to the queue's head, skipping waiters that died.
    local dead = redis.call('ZRANGEBYSCORE', timeouts, '-inf', now())
    if #dead > 0 then
      for _, d in ipairs(dead) do
        redis.call('LREM', queue, 1, d)
      end
      redis.call('ZREMRANGEBYSCORE', timeouts, '-inf', now())
    end
    local head = redis.call('LINDEX', queue, 0)
    if head then
      redis.call('PUBLISH', handoff, head)
    end
  end
end
return out
