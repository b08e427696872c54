-- Read a cached value with everything a caller decides on, in one round trip:
-- KEYS: value hash, compute lease, the lease's fence hash, the awaited round's failure key,
--       refresh cooldown marker
-- ARGV: the compute round the caller waits on (its fencing token), or '0'
-- Returns {has value (0/1), payload ('' without one), compute time (us), grace (ms),
-- value PTTL, current round (0 when the lease is free or its fence is unknown), lease PTTL
-- (-2 when free), awaited round failed (0/1), its message ('' if not), round that wrote
-- the value (0 if unknown), cooldown (0/1)}.
-- Presence is reported by flags, never by nil: a client may map nil to an empty string.
-- The remaining lifetime is the server's PTTL: no client clock is compared with another.
local v = redis.call('HMGET', KEYS[1], 'v', 'd', 'g', 'r')
local pttl = redis.call('PTTL', KEYS[1])
local lease_pttl = redis.call('PTTL', KEYS[2])
local round = 0
if lease_pttl ~= -2 then
  round = tonumber(redis.call('HGET', KEYS[3], 'f') or '0') or 0
end
local failed = false
if ARGV[1] ~= '0' then
  failed = redis.call('GET', KEYS[4])
end
local has, failed_flag = 0, 0
if v[1] then has = 1 end
if failed then failed_flag = 1 end
return {has, v[1] or '', tonumber(v[2] or '0') or 0, tonumber(v[3] or '0') or 0, pttl, round,
  lease_pttl, failed_flag, failed or '', tonumber(v[4] or '0') or 0,
  redis.call('EXISTS', KEYS[5])}
