-- Shared acquire, one or many attempts at once (group commit): a read of a read-write lock,
-- or one of a semaphore's permits, each a lease of its own (see "Shared holds" in
-- prelude.lua). Attempts on one key run in the order given.
-- Per attempt i (0-based): KEYS[i+1] the lock's key (its record: see acquire.lua; beside it
-- `<key>:shared` and `<key>:sharers`); ARGV[8i+1..8i+8]: token (an `s…` token), ttl (ms),
-- waiters-flag ttl (ms; 0 when not waiting), 1 for a waiting acquire's first attempt, permits
-- (the claim's count; 0 for a read, which any number may hold), holder label ('' for none),
-- send number (see "Send order" in prelude.lua; kept in the hold's `:sharers` entry),
-- minimum uptime (ms; 0 for none: a single server's restart quarantine, as in acquire.lua,
-- answered {2, ms to go})
-- Returns per attempt a pair: {1, fencing token} granted (also when a re-sent attempt finds
-- its own hold: it is extended to ttl from now), {-1, error} when a command of this attempt
-- failed (see prelude.lua), or {0, ms left}: held by a write or another kind of claim, every
-- permit taken (ms until the first of them runs out), a writer waiting for a read (writer
-- preference: ms until it lapses, if sooner), or a permit's first attempt yielding to
-- registered waiters; -2 when free.
--
-- A permit is granted while fewer than the claim's own count of holds are live (by the
-- server's clock): a claim made with a lower count than the holders' waits until enough of
-- them are gone, and nobody's hold is taken away. A read is granted while no writer waits:
-- a waiting plain claim keeps the record's `v` live (see acquire.lua), and new reads are held
-- behind it until a writer has had the lock (its grant clears `v`), or until `v` lapses (a
-- read turned away by it is told to come back then) or is withdrawn (a writer that gave up:
-- see release.lua). Waiting shared claims keep `s` live, which makes the release that frees
-- the lock wake every waiter (see end_lease), and so does a writer's withdrawal.
local now_ms, clock_us = server_clock()
local function attempt(i)
  local key = KEYS[i + 1]
  local token, ttl, flag, arriving = ARGV[8 * i + 1], tonumber(ARGV[8 * i + 2]), ARGV[8 * i + 3], ARGV[8 * i + 4]
  local permits, label, n = tonumber(ARGV[8 * i + 5]), ARGV[8 * i + 6], ARGV[8 * i + 7]
  local min_uptime = tonumber(ARGV[8 * i + 8])
  local wait = warming(min_uptime, now_ms)
  if wait then
    return 2, wait
  end
  local mode = permits > 0 and PERMITS or READ
  local shared, sharers = key .. ':shared', key .. ':sharers'
  local seen = redis.call('HMGET', key, 't', 'e', 'f', 'x', 'a', 'v', 's', 'z')
  local t, e, f, x, a, v, s, z = seen[1], seen[2], seen[3], seen[4], seen[5], seen[6], seen[7], seen[8]
  local holder = holding(t, e, now_ms)
  local left = holder and num(e) - now_ms or -2
  if holder == mode then
    local mine = tonumber(redis.call('ZSCORE', shared, token))
    if mine and mine > now_ms then
      -- Ours already: a re-sent attempt.
      local until_ms = now_ms + ttl
      redis.call('ZADD', shared, int(until_ms), token)
      if until_ms > num(e) then
        stamp(key, 'e', until_ms, x)
      end
      keep_shared(key, until_ms, z)
      local entry = redis.call('HGET', sharers, token)
      local fence, had = sharer(entry)
      if entry and had < tonumber(n) then
        -- Its send number rises to this attempt's (see "Send order" in prelude.lua).
        local rest = string.match(entry, '^[%d/]+ (.*)$') or ''
        redis.call('HSET', sharers, token, int(fence) .. '/' .. n .. ' ' .. rest)
      end
      return 1, fence or num(f) or 0
    end
    if mine and mine < 0 then
      -- Released already (see keep_released): a late copy of the attempt, arriving after
      -- its own release, is not granted again.
      return 0, left
    end
  end
  if barred(key, token, a, now_ms) then
    -- A late copy of an attempt that was given up and cleaned up already.
    return 0, left
  end
  local function wait_here()
    if flag ~= '0' then
      -- Releases publish (to every waiter) while this flag runs.
      redis.call('HSET', key, 's', int(now_ms + tonumber(flag)))
    end
  end
  if holder and holder ~= mode then
    wait_here()
    return 0, left
  end
  if mode == READ and v and num(v) > now_ms then
    -- Writer preference: a writer waits, so new reads wait behind it; until its preference
    -- lapses at the latest (a writer that died says nothing), when the read comes back.
    wait_here()
    local lapse = num(v) - now_ms
    return 0, (left >= 0 and math.min(left, lapse)) or lapse
  end
  if mode == PERMITS and arriving == '1' and s and num(s) > now_ms then
    -- Others wait for a permit: let them go first (see acquire.lua).
    return 0, left
  end
  drop_dead(key, now_ms)
  if mode == PERMITS and holder then
    local live = redis.call('ZCOUNT', shared, '(' .. int(now_ms), '+inf')
    if live >= permits then
      wait_here()
      local first = redis.call('ZRANGEBYSCORE', shared, '(' .. int(now_ms), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
      return 0, math.max(tonumber(first[2] or e) - now_ms, 0)
    end
  end
  -- Every command that can fail on a key of another type has run (the record's HMGET, the
  -- set's read in drop_dead), but for the hash of fences and labels: it is written first, so
  -- that a failure there leaves nothing behind (a script is not rolled back).
  ours(key, x, t, f)
  local until_ms = now_ms + ttl
  -- As grant's, with no floor (shared claims are not served over Redlock).
  local fence = math.max((num(f) or 0) + 1, clock_us)
  redis.call('HSET', sharers, token, int(fence) .. '/' .. n .. ' ' .. label)
  redis.call('ZADD', shared, int(until_ms), token)
  if not holder then
    grant(key, mode, ttl, '', 0, t, e, f, x, now_ms, clock_us)
    -- A time of shared holds begins: the set and hash are given their hour anew.
    keep_shared(key, until_ms, nil)
  else
    if until_ms > num(e) then
      local at = renewal(x, until_ms)
      if at then
        redis.call('HSET', key, 'f', int(fence), 'e', int(until_ms), 'x', int(at))
        expire_at(key, at)
      else
        redis.call('HSET', key, 'f', int(fence), 'e', int(until_ms))
      end
    else
      redis.call('HSET', key, 'f', int(fence))
    end
    keep_shared(key, until_ms, z)
  end
  return 1, fence
end

local out = {}
-- (Counted by ARGV: on a cluster KEYS also declares the keys beside each lock; see keys.rs.)
for i = 0, #ARGV / 7 - 1 do
  out[2 * i + 1], out[2 * i + 2] = each(attempt, i)
end
return out
