-- Read a cached value with everything a caller decides on, in one round trip:
-- KEYS: value hash, compute lease, the lease's fence hash, failed rounds hash
-- ARGV: the compute round the caller waits on (its fencing token), or '0'
-- Returns {payload or nil, compute time (us), grace (ms), value PTTL, current round (0 when
-- the lease is free), lease PTTL, failure message of the awaited round or nil}.
-- The remaining lifetime is the server's PTTL: no client clock is compared with another.
local v = redis.call('HMGET', KEYS[1], 'v', 'd', 'g')
local pttl = redis.call('PTTL', KEYS[1])
local lease_pttl = redis.call('PTTL', KEYS[2])
local round = 0
if lease_pttl ~= -2 then
  round = tonumber(redis.call('HGET', KEYS[3], 'f') or '0')
end
local failed = false
if ARGV[1] ~= '0' then
  failed = redis.call('HGET', KEYS[4], ARGV[1])
end
return {v[1], tonumber(v[2] or '0'), tonumber(v[3] or '0'), pttl, round, lease_pttl, failed}
