-- Read a cached value with everything a caller decides on, in one round trip:
-- KEYS: value hash, compute lock's key (its record: see acquire.lua), the awaited round's
--       failure key, refresh cooldown marker
-- ARGV: the compute round the caller waits on (its fencing token), or '0'
-- Returns {has value (0/1), payload ('' without one), compute time (us), grace (ms),
-- value PTTL, current round (0 when the lease is free or its fence is unknown), lease PTTL
-- (-2 when free), awaited round failed (0/1), its message ('' if not), round that wrote
-- the value (0 if unknown), cooldown (0/1)}.
-- Presence is reported by flags, never by nil: a client may map nil to an empty string.
-- The remaining lifetimes are the server's: no client clock is compared with another.
local v = redis.call('HMGET', KEYS[1], 'v', 'd', 'g', 'r')
local pttl = redis.call('PTTL', KEYS[1])
local now_ms = server_clock()
local lease = record(KEYS[2], 't', 'e', 'f') or {}
local lease_pttl, round = -2, 0
if holding(lease[1], lease[2], now_ms) then
  lease_pttl, round = tonumber(lease[2]) - now_ms, tonumber(lease[3] or '0') or 0
end
local failed = false
if ARGV[1] ~= '0' then
  failed = redis.call('GET', KEYS[3])
end
local has, failed_flag = 0, 0
if v[1] then has = 1 end
if failed then failed_flag = 1 end
return {has, v[1] or '', tonumber(v[2] or '0') or 0, tonumber(v[3] or '0') or 0, pttl, round,
  lease_pttl, failed_flag, failed or '', tonumber(v[4] or '0') or 0,
  redis.call('EXISTS', KEYS[4])}
