-- Reentrant acquire: add one hold of an owner to the lock, starting a reign if it is free.
-- KEYS[1] the lock's key (its record: see acquire.lua); beside it `<key>:owners`
--   {owner: count} and `<key>:holds` {owner = .., token = lease token, fence = .., <hold> =
--   the send number of the acquire that counted it (see "Send order" in prelude.lua; 1 when
--   written before send numbers) per live hold}
-- ARGV: owner, hold (an `h…` token), ttl (ms), waiters-flag ttl (ms; 0 when not waiting),
--   1 for a waiting acquire's first attempt, fence floor, minimum uptime (ms), holder label
--   ('' for none; the record's `h` while the reign holds; a client that sends no label
--   leaves none), send number (see "Send order" in prelude.lua; 0 when not sent)
-- Returns {1, fencing token, lease token, count} (counted), {0, ms left} (held by another
-- owner or a plain lock, or yielded to registered waiters; -2 when free) or {2, ms to go} (up
-- for less than the minimum uptime: see acquire.lua).
--
-- The record holds the reign's lease token (its first hold), so plain acquirers see it held.
-- The owners and holds hashes expire with the lease; a reign's holds hash names its lease
-- token, so leftovers of an older reign are never mistaken for the current one.
-- Idempotent per hold: a hold already counted is not counted again (a command re-sent
-- after a reconnect), and an abandoned hold is never counted.
local key = KEYS[1]
local owners, holds = key .. ':owners', key .. ':holds'
local owner, hold, ttl, flag, arriving =
  ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local floor, min_uptime = tonumber(ARGV[6]), tonumber(ARGV[7])
local label = ARGV[8] or ''
local n = ARGV[9] or '0'
local now_ms, clock_us = server_clock()
local wait = warming(min_uptime, now_ms)
if wait then
  return {2, wait}
end
local seen = redis.call('HMGET', key, 't', 'e', 'f', 'x', 'a', 'w', 'n', 'r', 'm')
local t, e, f, x, a, w = seen[1], seen[2], seen[3], seen[4], seen[5], seen[6]
local current = holding(t, e, now_ms)
local left = current and tonumber(e) - now_ms or -2
if barred(key, hold, a, now_ms) then
  -- A late copy of an attempt that was given up and cleaned up already.
  return {0, left}
end
if not current and stale_acquire(hold, tonumber(n), t, seen[7], seen[8], seen[9]) then
  -- A late copy of an attempt whose reign was released already.
  return {0, left}
end
if current then
  local reign = redis.call('HMGET', holds, 'token', 'owner', 'fence')
  if reign[1] == current and reign[2] == owner then
    local count
    if redis.call('HSETNX', holds, hold, n) == 1 then
      count = redis.call('HINCRBY', owners, owner, 1)
    else
      count = tonumber(redis.call('HGET', owners, owner) or '0')
      -- Counted already: its send number rises to this attempt's, never falls.
      if (tonumber(redis.call('HGET', holds, hold)) or 0) < tonumber(n) then
        redis.call('HSET', holds, hold, n)
      end
    end
    -- A re-entry never shortens the lease.
    local keep = math.max(left, ttl)
    stamp(key, 'e', now_ms + keep, x)
    redis.call('PEXPIRE', owners, keep)
    redis.call('PEXPIRE', holds, keep)
    -- The reign's token, or more if a quorum wrote a larger one back (Redlock).
    return {1, math.max(tonumber(reign[3] or '0'), num(f) or 0), current, count}
  end
  if flag ~= '0' then
    redis.call('HSET', key, 'w', int(now_ms + tonumber(flag)))
  end
  return {0, left}
end
if arriving == '1' and w and num(w) > now_ms then
  -- Free, but others wait: let them go first (see acquire.lua).
  return {0, -2}
end
-- The label of the hold that starts the reign is the reign's.
local value = grant(key, hold, ttl, label, floor, t, e, f, x, now_ms, clock_us, n, seen[7])
redis.call('DEL', owners, holds)
redis.call('HSET', holds, 'owner', owner, 'token', hold, 'fence', int(value), hold, n)
redis.call('HSET', owners, owner, 1)
redis.call('PEXPIRE', owners, ttl)
redis.call('PEXPIRE', holds, ttl)
return {1, value, hold, 1}
