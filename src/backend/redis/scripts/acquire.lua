-- Acquire leases, one or many at once (group commit): each lock is one hash, its record
-- (fields: see keys.rs and prelude.lua). A free lock is granted with a new fencing token; a
-- re-sent attempt that finds its own token is answered "ours" again.
-- Per lease i (0-based): KEYS[i+1] the lock's key; ARGV[8i+1..8i+8]:
--   token, ttl (ms), waiters-flag ttl (ms; 0 when not waiting),
--   1 for a waiting acquire's first attempt (it yields to registered waiters),
--   fence floor (a quorum's proposed token; 0 for none),
--   minimum uptime (ms; 0 for none: see below),
--   holder label (public description, '' for none; the record's `h`),
--   send number (see "Send order" in prelude.lua; kept as the record's `n`)
-- Returns per lease a pair: {1, fencing token} granted, {0, ms left} held by another (or
-- yielded to registered waiters; -2 when free), {-1, error} when a command of this lease
-- failed (see prelude.lua; a key of another type fails the HMGET), or {2, ms to go} when
-- this server has been up for less than the minimum uptime asked (a quorum member that may
-- have restarted empty grants nothing; see warming in prelude.lua).
-- A grant costs TIME once per call, then HMGET and HSET per lease, plus a PEXPIREAT when the
-- record is new or its hour is half gone. A waiting attempt turned away costs HMGET, HSET,
-- and ZADD and PEXPIREAT of `<key>:writers` (its writer preference).
local now_ms, clock_us = server_clock()
local function attempt(i)
  local key = KEYS[i + 1]
  local token, ttl, flag, arriving = ARGV[8 * i + 1], tonumber(ARGV[8 * i + 2]), ARGV[8 * i + 3], ARGV[8 * i + 4]
  local floor, min_uptime, label = tonumber(ARGV[8 * i + 5]), tonumber(ARGV[8 * i + 6]), ARGV[8 * i + 7]
  local n = ARGV[8 * i + 8]
  local wait = warming(min_uptime, now_ms)
  if wait then
    return 2, wait
  end
  local code, left, holder, seen = arrive(key, token, ttl, now_ms, n)
  if code then
    return code, left
  end
  local w = seen[6]
  if holder then
    if flag ~= '0' then
      -- Releases publish while `w` runs (the record exists: it is held); new reads of a
      -- read-write lock wait while `v` runs (writer preference, see shared_acquire.lua).
      -- The preference is a short lease of this waiter's, in `<key>:writers`, which its
      -- next attempts renew (the engine comes back at least every second): a waiter that
      -- dies holds readers back for PREFERENCE ms at most, whatever its re-check, and one
      -- that gives up withdraws it (see withdraw in release.lua). `v` is the latest of
      -- the leases; the set lives as long.
      local pref = now_ms + math.min(tonumber(flag), PREFERENCE)
      local v = math.max(num(seen[7]) or 0, pref)
      redis.call('HSET', key, 'w', int(now_ms + tonumber(flag)), 'v', int(v))
      local writers = key .. ':writers'
      redis.call('ZADD', writers, int(pref), token)
      redis.call('PEXPIREAT', writers, int(v))
    end
    return 0, left
  end
  if arriving == '1' and w and num(w) > now_ms then
    -- Others are waiting: let them go first rather than take the lock from under them. The
    -- flag is not refreshed here: a flag left by waiters that have gone must not outlive
    -- them on newcomers' account.
    return 0, left
  end
  local fence = grant(key, token, ttl, label, floor, seen[1], seen[2], seen[3], seen[4], now_ms, clock_us, n, seen[8])
  if seen[7] and num(seen[7]) > now_ms then
    -- The writer that new reads waited behind has the lock (other writers still waiting say
    -- so again at their next attempt).
    redis.call('HSET', key, 'v', '0')
    redis.call('DEL', key .. ':writers')
  end
  return 1, fence
end

local out = {}
-- (Counted by ARGV: on a cluster KEYS also declares the keys beside each lock; see keys.rs.)
for i = 0, #ARGV / 8 - 1 do
  out[2 * i + 1], out[2 * i + 2] = each(attempt, i)
end
return out
