-- Extend many leases at once: each lease runs for its new TTL from now, only if its record
-- still holds that token and the lease has not run out.
-- ARGV[1] minimum uptime (ms; 0 for none): a quorum member up for less than that (it may
-- have restarted empty) extends nothing (see uptime_ms in prelude.lua).
-- KEYS[i] the lock's key; ARGV[2i], ARGV[2i+1]: its token, its ttl (ms).
-- Returns per lease 1 (extended), 0 (not ours any more: another token, run out, released, or
-- no record at all there; or not counted), or the error's text when a command of this lease
-- failed (see prelude.lua).
-- Costs TIME once per call, then HMGET and HSET per lease, plus a PEXPIREAT when the record's
-- hour is half gone (every half hour per lease kept alive).
local now_ms = server_clock()
local min_uptime = tonumber(ARGV[1])
local counted = true
if min_uptime > 0 then
  counted = uptime_ms(min_uptime, math.floor(now_ms / 1000)) >= min_uptime
end
local function extend(i)
  local key, token, ttl = KEYS[i], ARGV[2 * i], tonumber(ARGV[2 * i + 1])
  if not counted then
    return 0
  end
  local seen = record(key, 't', 'e', 'x')
  if not seen or holding(seen[1], seen[2], now_ms) ~= token then
    return 0
  end
  stamp(key, 'e', now_ms + ttl, seen[3])
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
