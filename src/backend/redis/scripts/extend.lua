-- Extend many leases at once: each lease runs for its new TTL from now, only if its record
-- still holds that token and the lease has not run out. The call's arguments and answers are
-- those of `extensions` in prelude.lua: per lease 1 (extended), 0 (not ours any more: another
-- token, run out, released, or no record at all there; or not counted), or the error's text.
-- Costs TIME once per call, then HMGET and HSET per lease, plus a PEXPIREAT when the record's
-- hour is half gone (every half hour per lease kept alive).
return extensions(function(key, token, ttl, now_ms)
  local seen = record(key, 't', 'e', 'x')
  if not seen or holding(seen[1], seen[2], now_ms) ~= token then
    return 0
  end
  stamp(key, 'e', now_ms + ttl, seen[3])
  return 1
end)
