-- Raise a lock's fence counter to at least ARGV[1], never lower it (Redlock writes the
-- quorum's token back to the nodes that minted less, so any later quorum mints more).
-- KEYS[1] fence hash {f = last token, ...}
local last = tonumber(redis.call('HGET', KEYS[1], 'f') or '0')
local want = tonumber(ARGV[1])
if want > last then
  -- Written back to nodes that hold the lease, whose grant set the hash's expiry (the lease's
  -- TTL plus an hour); one made here (the hash was gone) gets an hour.
  redis.call('HSET', KEYS[1], 'f', string.format('%.0f', want))
  if redis.call('PTTL', KEYS[1]) == -1 then
    redis.call('PEXPIRE', KEYS[1], 3600000)
  end
end
return 1
