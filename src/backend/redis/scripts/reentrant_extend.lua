-- Extend reentrant leases: each reign's lease and its owners and holds hashes run for the
-- same time, only where the record still holds that reign's token. The lease is never
-- shortened (other holders of the reign may use a longer TTL). Arguments and answers: see
-- `extensions` in prelude.lua (the token is the reign's lease token).
return extensions(function(key, token, ttl, now_ms)
  local holds = key .. ':holds'
  local seen = record(key, 't', 'e', 'x')
  if seen and holding(seen[1], seen[2], now_ms) == token
      and redis.call('HGET', holds, 'token') == token then
    local keep = math.max(tonumber(seen[2]) - now_ms, ttl)
    stamp(key, 'e', now_ms + keep, seen[3])
    redis.call('PEXPIRE', key .. ':owners', keep)
    redis.call('PEXPIRE', holds, keep)
    return 1
  end
  return 0
end)
