-- Fair (FIFO) acquire, one or many attempts at once (group commit).
-- Per attempt i (0-based): KEYS[i+1] the lock's key (its record: see acquire.lua); beside it
-- `<key>:queue` (list of waiting tokens, oldest first) and `<key>:timeouts` (sorted set:
-- token -> deadline, server ms).
-- ARGV[6i+1..6i+6]:
--   token, ttl (ms), waiter expiry (ms; 0 for a single attempt, which never joins the queue),
--   holder label ('' for none), send number (see "Send order" in prelude.lua), minimum
--   uptime (ms; 0 for none: a single server's restart quarantine, as in acquire.lua)
-- Returns per attempt a pair: {1, fencing token} granted, {-1, error} when a command of this
-- attempt failed (see prelude.lua), {2, ms to go} when this server has been up for less than
-- the minimum uptime, or {0, n} not granted, where n is
-- how long until a re-check is worth it: the holder's time left, or, when the lease is free
-- and another waiter is at the head, that waiter's time left (-1 when unknown).
--
-- The lease is the plain lock's record, so fair and plain acquirers exclude each other. It
-- is granted only when free and the queue is empty or headed by this token. Waiters whose
-- deadline passed (by the server's clock: no client clock is compared) are evicted first;
-- the cost is one ZRANGEBYSCORE when nobody died.
local now_ms, clock_us = server_clock()
local function attempt(i)
  local key = KEYS[i + 1]
  local queue, timeouts = key .. ':queue', key .. ':timeouts'
  local token, ttl, expire, label =
    ARGV[6 * i + 1], tonumber(ARGV[6 * i + 2]), tonumber(ARGV[6 * i + 3]), ARGV[6 * i + 4]
  local n, min_uptime = ARGV[6 * i + 5], tonumber(ARGV[6 * i + 6])
  local wait = warming(min_uptime, now_ms)
  if wait then
    return 2, wait
  end
  -- (A barred token is a waiter that gave up and left: it is never granted nor queued.)
  local code, left, holder, seen = arrive(key, token, ttl, now_ms, n)
  if code then
    return code, left
  end
  local t, e, f, x = seen[1], seen[2], seen[3], seen[4]
  evict_dead(queue, timeouts, now_ms)
  local head = redis.call('LINDEX', queue, 0)
  if not holder and (not head or head == token) then
    if head then
      redis.call('LPOP', queue)
      redis.call('ZREM', timeouts, token)
    end
    return 1, grant(key, token, ttl, label, 0, t, e, f, x, now_ms, clock_us, n, seen[8])
  end
  if expire > 0 then
    -- Join at the tail, or stay in place and refresh the deadline.
    if redis.call('ZADD', timeouts, now_ms + expire, token) == 1 then
      redis.call('RPUSH', queue, token)
      head = head or token
    end
    -- Both keys live as long as the latest deadline in them, so a queue whose waiters all
    -- died goes away by itself.
    local last = redis.call('ZRANGE', timeouts, -1, -1, 'WITHSCORES')
    local keep = math.max(tonumber(last[2]) - now_ms, 1) + 1000
    redis.call('PEXPIRE', queue, keep)
    redis.call('PEXPIRE', timeouts, keep)
    -- Tells releases until when to look for a queue head to wake (see end_lease). The record
    -- may be gone (never held, or its hour passed): it is then made, and given its hour.
    ours(key, x, t, f)
    stamp(key, 'q', now_ms + keep, x)
  end
  if not holder and head and head ~= token then
    -- Free, but another waiter's turn: wake it (its wake-up may have been lost, or it just
    -- became head by an eviction) and come back by its deadline at the latest. pcall: where
    -- the user's ACL refuses the channel, the message is dropped and the script goes on
    -- (waiters then find out by their fallback re-check).
    redis.pcall('PUBLISH', key .. ':handoff', head)
    local due = redis.call('ZSCORE', timeouts, head)
    return 0, due and math.max(tonumber(due) - now_ms, 0) or -1
  end
  return 0, left
end

local out = {}
-- (Counted by ARGV: on a cluster KEYS also declares the keys beside each lock; see keys.rs.)
for i = 0, #ARGV / 5 - 1 do
  out[2 * i + 1], out[2 * i + 2] = each(attempt, i)
end
return out
