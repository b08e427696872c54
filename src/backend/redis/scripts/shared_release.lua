-- Shared release: gives back one read or one permit (see "Shared holds" in prelude.lua). The
-- release that leaves no shared hold ends the lease and wakes waiters as release.lua does (see
-- end_lease); one that leaves others holding permits wakes one permit waiter per process
-- while `s` says some wait (a read that others still share frees nothing anyone waits for).
-- KEYS[1] the lock's key; ARGV: token, tombstone ms (> 0 when abandoning an attempt whose
-- outcome is unknown: the token is barred from being granted for that long, see bar)
-- Returns 1 (released, also when a re-sent release finds it released already) or 0 (not
-- held: never granted, or run out, or taken away by a forced release).
local key, token, tombstone = KEYS[1], ARGV[1], tonumber(ARGV[2])
local now_ms = server_clock()
if tombstone > 0 then
  bar(key, token, now_ms, tombstone)
end
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
-- (pcall: a hash of another type beside the set must not keep the hold from being given back.)
redis.pcall('HDEL', key .. ':sharers', token)
if score <= now_ms or not shared_mode(holding(t, e, now_ms)) then
  redis.call('ZREM', shared, token)
  return 0
end
redis.call('ZADD', shared, int(-(now_ms + KEPT)), token)
drop_dead(key, now_ms)
-- The released holds, newest first (the most negative scores): the oldest beyond KEPT_MOST go.
local gone = redis.call('ZCOUNT', shared, '-inf', '(0')
if gone > KEPT_MOST then
  redis.call('ZREMRANGEBYRANK', shared, KEPT_MOST, gone - 1)
end
local latest = redis.call('ZREVRANGEBYSCORE', shared, '+inf', '(' .. int(now_ms), 'WITHSCORES', 'LIMIT', 0, 1)
if #latest == 0 then
  end_lease(key, seen[3], seen[4], now_ms, nil, seen[5])
  redis.call('PEXPIRE', shared, KEPT)
  return 1
end
if tonumber(latest[2]) < num(e) then
  redis.call('HSET', key, 'e', latest[2])
end
if t == PERMITS and (tonumber(seen[5]) or 0) > now_ms then
  redis.pcall('PUBLISH', key .. ':released', '1')
end
return 1
