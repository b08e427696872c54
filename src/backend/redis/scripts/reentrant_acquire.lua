-- Reentrant acquire: add one hold of an owner to the lock, starting a reign if it is free.
-- KEYS: lease key, fence hash (see acquire.lua), owners hash {owner: count},
--   holds hash {owner = .., token = lease token, fence = .., <hold> = 1 per live hold},
--   abandoned tokens (see release.lua)
-- ARGV: owner, hold (an `h…` token), ttl (ms), waiters-flag ttl (ms; 0 when not waiting),
--   1 for a waiting acquire's first attempt, fence floor, minimum uptime (ms), holder label
--   ('' for none; kept as the fence hash's `h` while the reign holds; a client that sends
--   no label leaves none)
-- Returns {1, fencing token, lease token, count} (counted), {0, pttl} (held by another owner
-- or a plain lock, or yielded to registered waiters) or {2, ms to go} (up for less than the
-- minimum uptime: see acquire.lua).
--
-- The lease key stays a plain string holding the lease token, so plain acquirers see it
-- held. The three keys of a reign (lease, owners, holds) always carry the same TTL, so they
-- expire together; a reign's holds hash names its lease token, so leftovers of an older
-- reign are never mistaken for the current one.
-- Idempotent per hold: a hold already counted is not counted again (a command re-sent
-- after a reconnect), and an abandoned hold is never counted.
local lease, fence, owners, holds, abandoned = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local owner, hold, ttl, flag, arriving =
  ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local floor, min_uptime = tonumber(ARGV[6]), tonumber(ARGV[7])
local label = ARGV[8] or ''
if min_uptime > 0 then
  local up = uptime_ms(min_uptime)
  if up < min_uptime then
    return {2, min_uptime - up}
  end
end
local now = redis.call('TIME')
local clock = tonumber(now[1]) * 1000000 + tonumber(now[2])
local now_ms = math.floor(clock / 1000)
if redis.call('ZSCORE', abandoned, hold) then
  -- A late copy of an attempt that was given up and cleaned up already.
  return {0, redis.call('PTTL', lease)}
end
local current = redis.call('GET', lease)
if current then
  if redis.call('HGET', holds, 'token') == current and redis.call('HGET', holds, 'owner') == owner then
    local count
    if redis.call('HSETNX', holds, hold, '1') == 1 then
      count = redis.call('HINCRBY', owners, owner, 1)
    else
      count = tonumber(redis.call('HGET', owners, owner) or '0')
    end
    -- A re-entry never shortens the lease.
    local keep = math.max(redis.call('PTTL', lease), ttl)
    redis.call('PEXPIRE', lease, keep)
    redis.call('PEXPIRE', owners, keep)
    redis.call('PEXPIRE', holds, keep)
    redis.call('PEXPIRE', fence, keep + 3600000)
    -- The reign's token, or more if a quorum wrote a larger one back (Redlock).
    local minted = tonumber(redis.call('HGET', holds, 'fence') or '0')
    local raised = tonumber(redis.call('HGET', fence, 'f') or '0')
    return {1, math.max(minted, raised), current, count}
  end
  if flag ~= '0' then
    redis.call('HSET', fence, 'w', string.format('%.0f', now_ms + tonumber(flag)))
    if redis.call('PTTL', fence) == -1 then
      -- The hash was gone and this HSET made it: it must expire (see acquire.lua).
      redis.call('PEXPIRE', fence, math.max(redis.call('PTTL', lease), 0) + 3600000)
    end
  end
  return {0, redis.call('PTTL', lease)}
end
if arriving == '1' and tonumber(redis.call('HGET', fence, 'w') or '0') > now_ms then
  -- Free, but others wait: let them go first (see acquire.lua).
  return {0, -2}
end
local last = tonumber(redis.call('HGET', fence, 'f') or '0')
local value = math.max(last + 1, clock, math.min(floor, clock + 2000000))
-- The label of the hold that starts the reign is the reign's (it also clears one a crashed
-- plain holder may have left).
redis.call('HSET', fence, 'f', string.format('%.0f', value), 'h', label)
-- Outlives the lease by an hour (see acquire.lua).
redis.call('PEXPIRE', fence, ttl + 3600000)
redis.call('DEL', owners, holds)
redis.call('SET', lease, hold, 'PX', ttl)
redis.call('HSET', holds, 'owner', owner, 'token', hold, 'fence', string.format('%.0f', value), hold, '1')
redis.call('HSET', owners, owner, 1)
redis.call('PEXPIRE', owners, ttl)
redis.call('PEXPIRE', holds, ttl)
return {1, value, hold, 1}
