-- Extend many leases at once: each key's TTL is set only if it still holds that token.
-- KEYS[i] lease key   ARGV[2i-1] its token   ARGV[2i] its ttl (ms)
-- Returns one 1 (extended) or 0 (not ours any more) per key.
local out = {}
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[2 * i - 1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
