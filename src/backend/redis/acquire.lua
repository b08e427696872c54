-- Acquire leases, one or many at once (group commit): per lease, SET NX PX, or "already
-- ours" when a re-sent attempt finds its own token; a new grant mints a fencing token.
-- Per lease i (0-based), KEYS[4i+1..4i+4]:
--   lease key, fence hash {f = last token, r = last released token}, waiters flag,
--   abandoned tokens (sorted set, see release.lua)
-- ARGV[7i+1..7i+7]:
--   token, ttl (ms), waiters-flag ttl (ms; 0 when not waiting),
--   1 for a waiting acquire's first attempt (it yields to registered waiters),
--   fence floor (a quorum's proposed token; 0 for none),
--   minimum uptime (ms; 0 for none: see below),
--   holder label (public description, '' for none; kept as the fence hash's `h` while held)
-- Returns per lease a pair: {1, fencing token} granted, {0, pttl} held (or yielded to
-- registered waiters), or {2, ms to go} when this server has been up for less than the
-- minimum uptime asked (a quorum member that may have restarted empty grants nothing).
-- The fence never goes backwards: at least last + 1, at least the server's clock in
-- microseconds (so a restarted server without persistence, or one restored from an old
-- snapshot, still hands out larger tokens) and at least the floor asked for, which is
-- capped at the server's clock plus 2 s (a client whose clock runs fast cannot push the
-- counter far ahead of the clocks that floor it after a restart).
-- The fence hash has no expiry while the lock is held (it carries the holder's label and the
-- token a re-sent attempt reads back), and expires an hour after a release (so a cache or job
-- key used once does not leave it forever); the clock floor keeps tokens increasing after it
-- is gone.
-- Uptime comes from INFO at one-second resolution (and Redis derives it from whole
-- seconds of wall-clock time): one second is taken off, against the server.
local now = redis.call('TIME')
local clock = tonumber(now[1]) * 1000000 + tonumber(now[2])
local uptime
local out = {}
for i = 0, #KEYS / 4 - 1 do
  local lease, fence, waiters, abandoned = KEYS[4 * i + 1], KEYS[4 * i + 2], KEYS[4 * i + 3], KEYS[4 * i + 4]
  local token, ttl, flag, arriving = ARGV[7 * i + 1], ARGV[7 * i + 2], ARGV[7 * i + 3], ARGV[7 * i + 4]
  local floor, min_uptime = tonumber(ARGV[7 * i + 5]), tonumber(ARGV[7 * i + 6])
  local label = ARGV[7 * i + 7]
  if min_uptime > 0 and not uptime then
    local s = tonumber(string.match(redis.call('INFO', 'server'), 'uptime_in_seconds:(%-?%d+)'))
    uptime = 1000 * math.max((s or 0) - 1, 0)
  end
  local code, value
  if min_uptime > 0 and uptime < min_uptime then
    code, value = 2, min_uptime - uptime
  elseif redis.call('ZSCORE', abandoned, token) then
    -- A late copy of an attempt that was given up and cleaned up already: never grant it.
    code, value = 0, redis.call('PTTL', lease)
  elseif arriving == '1' and redis.call('EXISTS', waiters) == 1
      and redis.call('GET', lease) ~= token then
    -- Others are waiting: let them go first rather than take the lock from under them (but
    -- a re-sent attempt that holds the lease already is answered below). The flag is not
    -- refreshed here: a flag left by waiters that have gone must not outlive them on
    -- newcomers' account.
    code, value = 0, redis.call('PTTL', lease)
  elseif redis.call('SET', lease, token, 'NX', 'PX', ttl) then
    local last = tonumber(redis.call('HGET', fence, 'f') or '0')
    value = math.max(last + 1, clock, math.min(floor, clock + 2000000))
    redis.call('HSET', fence, 'f', string.format('%.0f', value))
    if label ~= '' then
      redis.call('HSET', fence, 'h', label)
    else
      redis.call('HDEL', fence, 'h')
    end
    redis.call('PERSIST', fence)
    code = 1
  elseif redis.call('GET', lease) == token then
    -- Ours already: a re-sent attempt (after a reconnect, or sent again).
    redis.call('PEXPIRE', lease, ttl)
    code, value = 1, tonumber(redis.call('HGET', fence, 'f') or '0')
  else
    if flag ~= '0' then
      redis.call('SET', waiters, '1', 'PX', flag)
    end
    code, value = 0, redis.call('PTTL', lease)
  end
  out[2 * i + 1] = code
  out[2 * i + 2] = value
end
return out
