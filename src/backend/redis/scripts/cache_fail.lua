-- Record that a compute round failed, fenced by its lease, so callers in other processes
-- that wait on that round get the error instead of running the origin again; later rounds
-- never see it. One key per round (`…:failed:<round>`), each with its own expiry, so an
-- origin that keeps failing leaves at most a few short-lived keys, never a growing hash.
-- A failed background refresh (a value is there) also sets the refresh cooldown marker, so
-- the stale window does not start a refresh per flight while the origin is down.
-- KEYS: compute lock's key (its record: see acquire.lua), this round's failure key, refresh cooldown marker
-- ARGV: token, message, how long to keep it (ms), channel, cooldown (ms; 0 for none)
local lease = record(KEYS[1], 't', 'e')
if not lease or holding(lease[1], lease[2], server_clock()) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
if tonumber(ARGV[5]) > 0 then
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[5])
end
-- pcall: where the user's ACL refuses the channel, the message is dropped and the
-- script goes on (waiters then find out by their fallback re-check).
redis.pcall('PUBLISH', ARGV[4], '1')
return 1
