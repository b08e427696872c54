-- Release leases, one or many at once (group commit): compare-and-end, and wake waiters if
-- any are registered: plain waiters by a message on `<key>:released`, the fair queue's head by
-- its token on `<key>:handoff` (only that waiter acts on it). See end_lease in prelude.lua.
-- A shared hold (a read, a permit: its token starts with `s`) is taken out of the lock's
-- shared holds instead (see "Shared holds" in prelude.lua, and release_shared below).
-- Per lease i (0-based): KEYS[i+1] the lock's key; ARGV[3i+1..3i+3]:
--   token,
--   tombstone ms: > 0 when abandoning an attempt whose outcome is unknown; the token is
--   then barred from the acquire scripts for that long, so a late copy of the attempt
--   (re-sent after a reconnect) cannot take the lease after this clean-up (see bar in
--   prelude.lua); it also leaves the fair queue, and withdraws a waiting writer's preference
--   (see withdraw),
--   send number (see "Send order" in prelude.lua): the lease is ended only if the acquire
--   that granted (or last renewed) it was sent before this release; kept as the record's `n`
-- Returns per lease 1 (released, also when a re-sent release finds it released by the same
-- token, and when a step after the release failed), 0 (not ours: another token, the lease
-- ran out, no record at all there, or a late copy of a release sent before the acquire that
-- holds the lease now: it changes nothing), or the error's text when this lease's release
-- failed (see prelude.lua).
-- The common case costs TIME once per call, then HMGET and HSET per lease.
local now_ms
local function now()
  now_ms = now_ms or server_clock()
  return now_ms
end
-- Keeps `token`'s release in `key`'s set of shared holds (a negative score: minus the time
-- of its release), so that the release, re-sent after a reconnect, is answered "released":
-- the last KEPT_MOST of them, the oldest beyond that going (newest first: the most negative
-- scores). Shared holds, and exclusive ones on a name that has shared holds in its hour
-- (a read-write lock's writes: the record keeps only one released token, `r`).
local function keep_released(key, token)
  local shared = key .. ':shared'
  redis.call('ZADD', shared, int(-now()), token)
  local gone = redis.call('ZCOUNT', shared, '-inf', '(0')
  if gone > KEPT_MOST then
    redis.call('ZREMRANGEBYRANK', shared, KEPT_MOST, gone - 1)
  end
end

-- Gives back the shared hold `token` of `key`. The release that leaves no shared hold ends
-- the lease and wakes waiters (see end_lease); one that leaves others holding permits wakes
-- one permit waiter per process while `s` says some wait (a read that others still share
-- frees nothing anyone waits for). A released hold is kept, for its re-sent release.
local function release_shared(key, token, n)
  local seen = record(key, 't', 'e', 'w', 'q', 's')
  if not seen then
    return 0
  end
  local t, e = seen[1], seen[2]
  local shared = key .. ':shared'
  local score = tonumber(redis.call('ZSCORE', shared, token))
  if not score then
    return 0
  end
  if score < 0 then
    -- Released already: a re-sent release.
    return 1
  end
  -- (pcall: a hash of another type beside the set must not keep the hold from being given
  -- back.)
  local entry = redis.pcall('HGET', key .. ':sharers', token)
  if type(entry) == 'string' and select(2, sharer(entry)) > tonumber(n) then
    -- A late copy of a release sent before the acquire that holds this hold now.
    return 0
  end
  redis.pcall('HDEL', key .. ':sharers', token)
  if score <= now() or not shared_mode(holding(t, e, now())) then
    redis.call('ZREM', shared, token)
    return 0
  end
  keep_released(key, token)
  drop_dead(key, now())
  local latest = redis.call('ZREVRANGEBYSCORE', shared, '+inf', '(' .. int(now()), 'WITHSCORES', 'LIMIT', 0, 1)
  if #latest == 0 then
    end_lease(key, seen[3], seen[4], now(), nil, seen[5])
    redis.call('PEXPIRE', shared, KEPT)
    return 1
  end
  if tonumber(latest[2]) < num(e) then
    redis.call('HSET', key, 'e', latest[2])
  end
  if t == PERMITS and (tonumber(seen[5]) or 0) > now() then
    redis.pcall('PUBLISH', key .. ':released', '1')
  end
  return 1
end

-- Withdraws the writer preference of `token`, a waiting plain claim that gave up (see
-- acquire.lua): its lease leaves `<key>:writers`, the record's `v` falls to the latest of the
-- others' (0 when none is left), and when that lets reads in sooner while readers wait (`s`)
-- and no write holds the lock, every waiter is woken ('*', as by a write's release). One
-- ZREM for any other abandoned token.
local function withdraw(key, token)
  local writers = key .. ':writers'
  if redis.call('ZREM', writers, token) == 0 then
    return
  end
  local seen = record(key, 'v', 's', 't', 'e')
  if not seen or (tonumber(seen[1]) or 0) <= now() then
    return
  end
  redis.call('ZREMRANGEBYSCORE', writers, '-inf', now())
  local latest = redis.call('ZREVRANGE', writers, 0, 0, 'WITHSCORES')
  local rest = tonumber(latest[2]) or 0
  if rest >= tonumber(seen[1]) then
    return
  end
  redis.call('HSET', key, 'v', int(rest))
  local holder = holding(seen[3], seen[4], now())
  if (tonumber(seen[2]) or 0) > now() and (not holder or holder == READ) then
    redis.pcall('PUBLISH', key .. ':released', '*')
  end
end

local function release(i)
  local key, token, tombstone = KEYS[i + 1], ARGV[3 * i + 1], tonumber(ARGV[3 * i + 2])
  local n = ARGV[3 * i + 3]
  local wake = false
  if tombstone > 0 then
    bar(key, token, now(), tombstone)
  end
  if string.sub(token, 1, 1) == 's' then
    return release_shared(key, token, n)
  end
  if tombstone > 0 then
    -- A fair waiter that gave up leaves the queue at once; if it was the head, the next one
    -- is woken below rather than after the leaver's deadline.
    if redis.call('ZREM', key .. ':timeouts', token) == 1 then
      local queue = key .. ':queue'
      wake = redis.call('LINDEX', queue, 0) == token
      redis.call('LREM', queue, 1, token)
    end
    -- A writer that gave up lets new reads in at once. (pcall: a key of another type there
    -- must not keep the claim from being given back; its preference then lapses.)
    pcall(withdraw, key, token)
  end
  local seen = record(key, 't', 'e', 'r', 'w', 'q', 's', 'z', 'n')
  if not seen then
    return 0
  end
  local t, e = seen[1], seen[2]
  -- The name has had shared holds within its hour (`z`): a read-write lock.
  local shared_too = (tonumber(seen[7]) or 0) > now()
  if t == token and holding(t, e, now()) then
    if (num(seen[8]) or 0) > tonumber(n) then
      -- A late copy of a release sent before the acquire that holds the lease now (the
      -- lease was given back and granted again under the same token): not this lease's.
      return 0
    end
    end_lease(key, seen[4], seen[5], now(), nil, seen[6], n)
    if shared_too then
      -- Released, whatever fails after this.
      pcall(keep_released, key, token)
    end
    return 1
  end
  if t == token and (num(seen[8]) or 0) < tonumber(n) then
    -- Its lease ran out: the release's number is kept all the same, so that a late copy of
    -- an acquire sent before it is not granted (see "Send order" in prelude.lua).
    redis.call('HSET', key, 'n', n)
  end
  if wake and not holding(t, e, now()) then
    pcall(wake_head, key, now())
  end
  if released_by(token, t, e, seen[3]) then
    return 1
  end
  if shared_too and (tonumber(redis.call('ZSCORE', key .. ':shared', token)) or 0) < 0 then
    -- A write's release, re-sent after other grants took `r`'s place.
    return 1
  end
  return 0
end

local out = {}
-- (Counted by ARGV: on a cluster KEYS also declares the keys beside each lock; see keys.rs.)
for i = 0, #ARGV / 3 - 1 do
  local code, err = each(function(j) return release(j), nil end, i)
  out[i + 1] = err or code
end
return out
