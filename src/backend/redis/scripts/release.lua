-- Release leases, one or many at once (group commit): compare-and-delete, and wake waiters
-- if any are registered: plain waiters by a message on the release channel, the fair
-- queue's head by its token on the hand-off channel (only that waiter acts on it).
-- Per lease i (0-based), KEYS[5i+1..5i+5]:
--   lease key, fence hash (fields: see acquire.lua), abandoned tokens, fair queue, fair
--   timeouts (see fair_acquire.lua)
-- ARGV[4i+1..4i+4]:
--   token, release channel,
--   tombstone ms: > 0 when abandoning an attempt whose outcome is unknown; the token is
--   then barred from the acquire scripts for that long, so a late copy of the attempt
--   (re-sent after a reconnect) cannot take the lease after this clean-up; it also leaves
--   the fair queue,
--   hand-off channel
-- Returns per lease 1 (released, also when a re-sent release finds it released by the same
-- token, and when a step after the deletion failed), 0 (not ours: another token, or no lease
-- at all there), or the error's text when this lease's release failed (see prelude.lua).
-- The common case costs five commands: GET, DEL, HMGET, HSET, PEXPIRE.
local now_ms
local function now()
  if not now_ms then
    local t = redis.call('TIME')
    now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now_ms
end
local function release(i)
  -- Set as soon as it is known: a later step's failure does not undo a deletion.
  local released
  local ok, e = pcall(function()
    local lease, fence, abandoned = KEYS[5 * i + 1], KEYS[5 * i + 2], KEYS[5 * i + 3]
    local queue, timeouts = KEYS[5 * i + 4], KEYS[5 * i + 5]
    local token, channel, tombstone, handoff =
      ARGV[4 * i + 1], ARGV[4 * i + 2], tonumber(ARGV[4 * i + 3]), ARGV[4 * i + 4]
    local wake = false
    if tombstone > 0 then
      local until_ms = now() + tombstone
      redis.call('ZREMRANGEBYSCORE', abandoned, '-inf', now())
      redis.call('ZADD', abandoned, until_ms, token)
      redis.call('PEXPIRE', abandoned, tombstone)
      -- The fence hash's `a` tells the acquire script to look in the sorted set.
      local barred = tonumber(redis.call('HGET', fence, 'a') or '0')
      redis.call('HSET', fence, 'a', string.format('%.0f', math.max(barred, until_ms)))
      -- A fair waiter that gave up leaves the queue at once; if it was the head, the next
      -- one is woken below rather than after the leaver's deadline.
      if redis.call('ZREM', timeouts, token) == 1 then
        wake = redis.call('LINDEX', queue, 0) == token
        redis.call('LREM', queue, 1, token)
      end
    end
    if holder(lease) == token then
      redis.call('DEL', lease)
      -- Released, whatever fails after this (a fence hash of another type, say).
      released = 1
      if after_release(fence, token, channel, now) then
        wake = true
      end
    elseif redis.call('HGET', fence, 'r') == token then
      released = 1
    else
      released = 0
    end
    if tombstone > 0 then
      -- The fence hash must keep `a` as long as the tombstone, and must expire: the HSET
      -- above made it if it was gone (an hour past the lease, if one is held, is longer).
      local left = redis.call('PTTL', fence)
      if left == -1 then
        redis.call('PEXPIRE', fence, math.max(redis.call('PTTL', lease), 0) + 3600000)
      elseif left < tombstone then
        redis.call('PEXPIRE', fence, tombstone)
      end
    end
    if wake and redis.call('LLEN', queue) > 0 and redis.call('EXISTS', lease) == 0 then
      wake_head(queue, timeouts, handoff, now())
    end
  end)
  if released then
    return released
  end
  return error_text(e)
end

local out = {}
for i = 0, #KEYS / 5 - 1 do
  out[i + 1] = release(i)
end
return out
