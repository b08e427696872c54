-- Acquire leases, one or many at once (group commit): per lease, SET NX PX, or "already
-- ours" when a re-sent attempt finds its own token; a new grant mints a fencing token.
-- Per lease i (0-based), KEYS[3i+1..3i+3]:
--   lease key, fence hash, abandoned tokens (sorted set, see release.lua)
-- The fence hash holds: f = last fencing token, r = last released token (release.lua),
--   h = holder label ('' for none), w = until when (server ms) plain waiters want a message
--   on release, q = until when (server ms) the fair queue may hold waiters (fair_acquire.lua),
--   a = until when (server ms) some token of this key is barred (release.lua)
-- ARGV[8i+1..8i+8]:
--   token, ttl (ms), waiters-flag ttl (ms; 0 when not waiting),
--   1 for a waiting acquire's first attempt (it yields to registered waiters),
--   fence floor (a quorum's proposed token; 0 for none),
--   minimum uptime (ms; 0 for none: see below),
--   holder label (public description, '' for none; kept as the fence hash's `h` while held),
--   the fence hash's TTL on a grant (ms: the lease's plus an hour; given by the client, since a
--   Lua number handed to Redis is formatted as a double, which costs on this hot path)
-- Returns per lease a pair: {1, fencing token} granted, {0, pttl} held (or yielded to
-- registered waiters), {-1, error} when a command of this lease failed (see prelude.lua;
-- a lease key of another type fails SET ... GET), or {2, ms to go} when this server has been up for less than the
-- minimum uptime asked (a quorum member that may have restarted empty grants nothing).
-- The fence never goes backwards: at least last + 1, at least the server's clock in
-- microseconds (so a restarted server without persistence, or one restored from an old
-- snapshot, still hands out larger tokens) and at least the floor asked for, which is
-- capped at the server's clock plus 2 s (a client whose clock runs fast cannot push the
-- counter far ahead of the clocks that floor it after a restart).
-- The fence hash outlives the lease by an hour: each grant and extension sets its TTL to the
-- lease's plus an hour, a release to an hour (so a cache or job key used once, or a holder
-- that crashed, does not leave it forever); the clock floor keeps tokens increasing after it
-- is gone.
-- Uptime: see uptime_ms in prelude.lua (read once per call, only by quorum members).
-- A grant costs TIME once per call, then HMGET, SET, HSET and PEXPIRE per lease.
local now = redis.call('TIME')
local clock = tonumber(now[1]) * 1000000 + tonumber(now[2])
local now_ms = math.floor(clock / 1000)
local uptime
local function grant(i)
  local lease, fence, abandoned = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  local token, ttl, flag, arriving = ARGV[8 * i + 1], ARGV[8 * i + 2], ARGV[8 * i + 3], ARGV[8 * i + 4]
  local floor, min_uptime = tonumber(ARGV[8 * i + 5]), tonumber(ARGV[8 * i + 6])
  local label, fence_ttl = ARGV[8 * i + 7], ARGV[8 * i + 8]
  if min_uptime > 0 and not uptime then
    uptime = uptime_ms(min_uptime, tonumber(now[1]))
  end
  local code, value
  if min_uptime > 0 and uptime < min_uptime then
    code, value = 2, min_uptime - uptime
  else
    local seen = redis.call('HMGET', fence, 'f', 'a', 'w')
    local last, barred, waited = seen[1], tonumber(seen[2]), tonumber(seen[3])
    if barred and barred > now_ms and redis.call('ZSCORE', abandoned, token) then
      -- A late copy of an attempt that was given up and cleaned up already: never grant it.
      code, value = 0, redis.call('PTTL', lease)
    elseif arriving == '1' and waited and waited > now_ms
        and redis.call('GET', lease) ~= token then
      -- Others are waiting: let them go first rather than take the lock from under them (but
      -- a re-sent attempt that holds the lease already is answered below). The flag is not
      -- refreshed here: a flag left by waiters that have gone must not outlive them on
      -- newcomers' account.
      code, value = 0, redis.call('PTTL', lease)
    else
      -- NX with GET: nothing when the lease was free (and is now ours), else the holder's token.
      local current = redis.call('SET', lease, token, 'NX', 'PX', ttl, 'GET')
      if not current then
        value = math.max(tonumber(last or '0') + 1, clock, math.min(floor, clock + 2000000))
        redis.call('HSET', fence, 'f', string.format('%.0f', value), 'h', label)
        redis.call('PEXPIRE', fence, fence_ttl)
        code = 1
      elseif current == token then
        -- Ours already: a re-sent attempt (after a reconnect, or sent again).
        redis.call('PEXPIRE', lease, ttl)
        code, value = 1, tonumber(last or '0')
      else
        code, value = 0, redis.call('PTTL', lease)
        if flag ~= '0' then
          redis.call('HSET', fence, 'w', string.format('%.0f', now_ms + tonumber(flag)))
          if redis.call('PTTL', fence) == -1 then
            -- The hash was gone (evicted, deleted) and this HSET made it: it must expire.
            redis.call('PEXPIRE', fence, math.max(value, 0) + 3600000)
          end
        end
      end
    end
  end
  return code, value
end

local out = {}
for i = 0, #KEYS / 3 - 1 do
  out[2 * i + 1], out[2 * i + 2] = each(grant, i)
end
return out
