-- Release leases, one or many at once (group commit): compare-and-end, and wake waiters if
-- any are registered: plain waiters by a message on `<key>:released`, the fair queue's head by
-- its token on `<key>:handoff` (only that waiter acts on it). See end_lease in prelude.lua.
-- Per lease i (0-based): KEYS[i+1] the lock's key; ARGV[2i+1..2i+2]:
--   token,
--   tombstone ms: > 0 when abandoning an attempt whose outcome is unknown; the token is
--   then barred from the acquire scripts for that long, so a late copy of the attempt
--   (re-sent after a reconnect) cannot take the lease after this clean-up (see bar in
--   prelude.lua); it also leaves the fair queue
-- Returns per lease 1 (released, also when a re-sent release finds it released by the same
-- token, and when a step after the release failed), 0 (not ours: another token, the lease
-- ran out, or no record at all there), or the error's text when this lease's release failed
-- (see prelude.lua).
-- The common case costs TIME once per call, then HMGET and HSET per lease.
local now_ms
local function now()
  now_ms = now_ms or server_clock()
  return now_ms
end
local function release(i)
  local key, token, tombstone = KEYS[i + 1], ARGV[2 * i + 1], tonumber(ARGV[2 * i + 2])
  local wake = false
  if tombstone > 0 then
    bar(key, token, now(), tombstone)
    -- A fair waiter that gave up leaves the queue at once; if it was the head, the next one
    -- is woken below rather than after the leaver's deadline.
    if redis.call('ZREM', key .. ':timeouts', token) == 1 then
      local queue = key .. ':queue'
      wake = redis.call('LINDEX', queue, 0) == token
      redis.call('LREM', queue, 1, token)
    end
  end
  local seen = record(key, 't', 'e', 'r', 'w', 'q', 's')
  if not seen then
    return 0
  end
  local t, e = seen[1], seen[2]
  if t == token and holding(t, e, now()) then
    end_lease(key, seen[4], seen[5], now(), nil, seen[6])
    return 1
  end
  if wake and not holding(t, e, now()) then
    pcall(wake_head, key, now())
  end
  if released_by(token, t, e, seen[3]) then
    return 1
  end
  return 0
end

local out = {}
-- (Counted by ARGV: on a cluster KEYS also declares the keys beside each lock; see keys.rs.)
for i = 0, #ARGV / 2 - 1 do
  local code, err = each(function(j) return release(j), nil end, i)
  out[i + 1] = err or code
end
return out
