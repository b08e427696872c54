-- Extend shared holds (reads, permits: see "Shared holds" in prelude.lua): each hold runs for
-- its new TTL from now, only while it is live and the record is held in a shared mode; the
-- record's `e` (the latest of them) and the holds' set and hash follow when it grows.
-- ARGV[1] minimum uptime (ms; 0 for none; see extend.lua)
-- KEYS[i] the lock's key   ARGV[2i] the hold's token   ARGV[2i+1] ttl
-- Returns per hold 1 (extended), 0 (not held any more: run out, released, taken away, or not
-- counted), or the error's text when a command of this hold failed (see prelude.lua).
local now_ms = server_clock()
local min_uptime = tonumber(ARGV[1])
local counted = true
if min_uptime > 0 then
  counted = uptime_ms(min_uptime, math.floor(now_ms / 1000)) >= min_uptime
end
local function extend(i)
  local key, token = KEYS[i], ARGV[2 * i]
  local seen = counted and record(key, 't', 'e', 'x')
  if not seen or not shared_mode(holding(seen[1], seen[2], now_ms)) then
    return 0
  end
  local shared = key .. ':shared'
  local score = tonumber(redis.call('ZSCORE', shared, token))
  if not score or score <= now_ms then
    return 0
  end
  local until_ms = now_ms + tonumber(ARGV[2 * i + 1])
  redis.call('ZADD', shared, int(until_ms), token)
  if until_ms > num(seen[2]) then
    stamp(key, 'e', until_ms, seen[3])
    keep_shared(key, until_ms)
  end
  return 1
end

local out = {}
-- (Counted by ARGV: on a cluster KEYS also declares the keys beside each lock; see keys.rs.)
for i = 1, (#ARGV - 1) / 2 do
  local code, err = each(extend, i)
  -- A failed entry is its error's text, in place of its number.
  out[i] = err or code
end
return out
