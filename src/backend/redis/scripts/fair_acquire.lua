-- Fair (FIFO) acquire, one or many attempts at once (group commit).
-- Per attempt i (0-based), KEYS[5i+1..5i+5]:
--   lease key, fence hash (fields: see acquire.lua), abandoned tokens (see release.lua),
--   queue (list of waiting tokens, oldest first), timeouts (sorted set: token -> deadline,
--   server time in ms)
-- ARGV[6i+1..6i+6]:
--   token, ttl (ms), waiter expiry (ms; 0 for a single attempt, which never joins the queue),
--   hand-off channel, holder label ('' for none; see acquire.lua), the fence hash's TTL on a
--   grant (ms; see acquire.lua)
-- Returns per attempt a pair: {1, fencing token} granted, {-1, error} when a command of this
-- attempt failed (see prelude.lua), or {0, n} not granted, where n is
-- how long until a re-check is worth it: the holder's PTTL, or, when the lease is free and
-- another waiter is at the head, that waiter's time left (-1 when unknown).
--
-- The lease is the plain lock's key, so fair and plain acquirers exclude each other. It is
-- granted only when free and the queue is empty or headed by this token. Waiters whose
-- deadline passed (by the server's clock: no client clock is compared) are evicted first;
-- the cost is one ZRANGEBYSCORE when nobody died.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function attempt(i)
  local lease, fence, abandoned = KEYS[5 * i + 1], KEYS[5 * i + 2], KEYS[5 * i + 3]
  local queue, timeouts = KEYS[5 * i + 4], KEYS[5 * i + 5]
  local token, ttl, expire, channel, label, fence_ttl = ARGV[6 * i + 1], ARGV[6 * i + 2],
    tonumber(ARGV[6 * i + 3]), ARGV[6 * i + 4], ARGV[6 * i + 5], ARGV[6 * i + 6]
  local code, value
  if redis.call('GET', lease) == token then
    -- Ours already: a re-sent attempt (after a reconnect).
    redis.call('PEXPIRE', lease, ttl)
    code, value = 1, tonumber(redis.call('HGET', fence, 'f') or '0')
  elseif redis.call('ZSCORE', abandoned, token) then
    -- A late copy of an attempt whose waiter gave up and left: never grant or queue it.
    code, value = 0, redis.call('PTTL', lease)
  else
    evict_dead(queue, timeouts, now)
    local head = redis.call('LINDEX', queue, 0)
    local free = redis.call('EXISTS', lease) == 0
    if free and (not head or head == token) then
      if head then
        redis.call('LPOP', queue)
        redis.call('ZREM', timeouts, token)
      end
      redis.call('SET', lease, token, 'PX', ttl)
      local last = tonumber(redis.call('HGET', fence, 'f') or '0')
      value = math.max(last + 1, floor)
      redis.call('HSET', fence, 'f', string.format('%.0f', value), 'h', label)
      -- Outlives the lease by an hour (see acquire.lua).
      redis.call('PEXPIRE', fence, fence_ttl)
      code = 1
    else
      code = 0
      if expire > 0 then
        -- Join at the tail, or stay in place and refresh the deadline.
        if redis.call('ZADD', timeouts, now + expire, token) == 1 then
          redis.call('RPUSH', queue, token)
          head = head or token
        end
        -- Both keys live as long as the latest deadline in them, so a queue whose waiters
        -- all died goes away by itself.
        local last = redis.call('ZRANGE', timeouts, -1, -1, 'WITHSCORES')
        local keep = math.max(tonumber(last[2]) - now, 1) + 1000
        redis.call('PEXPIRE', queue, keep)
        redis.call('PEXPIRE', timeouts, keep)
        -- Tells releases until when to look for a queue head to wake (see release.lua).
        redis.call('HSET', fence, 'q', string.format('%.0f', now + keep))
        if redis.call('PTTL', fence) == -1 then
          -- The hash was gone and this HSET made it: it must expire, an hour past the lease
          -- if one is held (see acquire.lua).
          redis.call('PEXPIRE', fence, math.max(redis.call('PTTL', lease), 0) + 3600000)
        end
      end
      if free and head and head ~= token then
        -- Free, but another waiter's turn: wake it (its wake-up may have been lost, or it
        -- just became head by an eviction) and come back by its deadline at the latest.
        -- pcall: where the user's ACL refuses the channel, the message is dropped and the
        -- script goes on (waiters then find out by their fallback re-check).
        redis.pcall('PUBLISH', channel, head)
        local due = redis.call('ZSCORE', timeouts, head)
        value = due and math.max(tonumber(due) - now, 0) or -1
      else
        value = redis.call('PTTL', lease)
      end
    end
  end
  return code, value
end

local out = {}
for i = 0, #KEYS / 5 - 1 do
  out[2 * i + 1], out[2 * i + 2] = each(attempt, i)
end
return out
