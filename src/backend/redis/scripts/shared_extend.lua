-- Extend shared holds (reads, permits: see "Shared holds" in prelude.lua): each hold runs for
-- its new TTL from now, only while it is live and the record is held in a shared mode; the
-- record's `e` (the latest of them) follows when it grows, and the holds' set and hash live
-- an hour past it (see keep_shared).
-- Arguments and answers: see `extensions` in prelude.lua (the token is the hold's).
return extensions(function(key, token, ttl, now_ms)
  local seen = record(key, 't', 'e', 'x', 'z')
  if not seen or not shared_mode(holding(seen[1], seen[2], now_ms)) then
    return 0
  end
  local shared = key .. ':shared'
  local score = tonumber(redis.call('ZSCORE', shared, token))
  if not score or score <= now_ms then
    return 0
  end
  local until_ms = now_ms + ttl
  redis.call('ZADD', shared, int(until_ms), token)
  if until_ms > num(seen[2]) then
    stamp(key, 'e', until_ms, seen[3])
  end
  keep_shared(key, until_ms, seen[4])
  return 1
end)
