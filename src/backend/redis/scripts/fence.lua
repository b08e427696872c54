-- Raise a lock's fence counter to at least ARGV[1], never lower it (Redlock writes the
-- quorum's token back to the nodes that minted less, so any later quorum mints more).
-- KEYS[1] the lock's key (its record: `f` is the last token; see acquire.lua)
local key = KEYS[1]
local seen = redis.call('HMGET', key, 'f', 'x', 't')
local want = tonumber(ARGV[1])
ours(key, seen[2], seen[3], seen[1])
if want > (num(seen[1]) or 0) then
  -- Written back to nodes that hold the lease, whose record has its hour past the lease; one
  -- made here (the record was gone) gets an hour.
  if seen[2] then
    redis.call('HSET', key, 'f', ARGV[1])
  else
    local at = server_clock() + 3600000
    redis.call('HSET', key, 'f', ARGV[1], 'x', int(at))
    expire_at(key, at)
  end
end
return 1
