-- Prepended to every script that serves a batch (see redis.rs): one entry's failure is its
-- own. A command that fails for one lease (a key of the wrong type written by someone else,
-- a PUBLISH an ACL refuses) fails that entry only; the entries before and after it run as if
-- it were not there.

-- The text of an error raised by redis.call (a table) or by Lua (a string).
local function error_text(e)
  if type(e) == 'table' then
    return tostring(e.err or e[1])
  end
  return tostring(e)
end

-- Runs entry `i` of a batch, `f(i)` returning its two results, or -1 and the error's text
-- when a command of it failed.
local function each(f, i)
  local ok, code, value = pcall(f, i)
  if ok then
    return code, value
  end
  return -1, error_text(code)
end

-- The lock record: one hash per lock, at the lock's key (fields: see keys.rs). A lease is
-- held while its token is `t` and its expiry `e` (server ms) is ahead of the server's clock;
-- `e` is 0 once `t` released it. The hash itself lives an hour past the lease (its expiry is
-- `x`), so the fencing counter `f`, the last released token and the flags outlive it.
local HOUR = 3600000

-- Writer preference: how long (ms) a waiting plain claim holds new reads back after its last
-- attempt, at most, whatever it asks (see acquire.lua). The engine has such a waiter come
-- back at least every second; this is its waiters flag for that, 2 x 1 s + 100 ms.
local PREFERENCE = 2100

-- Numbers handed to Redis as integers (a Lua number is a double: %.0f is exact up to 2^53).
-- Formatting costs more than most commands, and the leases of one call mostly share their
-- expiries (one clock, the same TTLs): each number is formatted once per call.
local formatted = {}
local function int(n)
  local s = formatted[n]
  if not s then
    s = string.format('%.0f', n)
    formatted[n] = s
  end
  return s
end

-- A numeric field of a record: nil when absent. One that is no number means the hash at the
-- key was written by someone else: an error (that key's own).
local function num(v)
  if not v then
    return nil
  end
  local n = tonumber(v)
  if not n then
    error('the hash at this key is not a lock record (a field holds "' .. string.sub(v, 1, 40) .. '")')
  end
  return n
end

-- Refuses to write a hash at `key` that is no lock record (someone's data at a lock's name),
-- read as `x`, `t`, `f`: every record has `x`, and one that lost it still has `t` or `f`.
-- Costs an EXISTS only when the lock is new (all three are nil).
local function ours(key, x, t, f)
  if not x and not t and not f and redis.call('EXISTS', key) == 1 then
    error('the key holds a hash that is not a lock record')
  end
end

-- The server's clock: ms and µs.
local function server_clock()
  local t = redis.call('TIME')
  local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  return math.floor(us / 1000), us
end

-- Reads fields of the record at `key`: false when it is no record at all (a value of another
-- type, written by someone else: no lease of this client is there), for the scripts that then
-- answer "not ours"; the acquire scripts use a plain HMGET, so such a key fails its attempt.
local function record(key, ...)
  local v = redis.pcall('HMGET', key, ...)
  if v.err then
    if string.sub(v.err, 1, 9) == 'WRONGTYPE' then
      return false
    end
    error(v)
  end
  return v
end

-- The holder of a record read as {t, e, ...}: its token while the lease runs at `now_ms`, else
-- false.
local function holding(t, e, now_ms)
  if t and t ~= '' and (num(e) or 0) > now_ms then
    return t
  end
  return false
end

-- The record's expiry when a lease runs until `until_ms`: nil when the one it has (`x`) is
-- far enough (more than half an hour past it), else a new one, an hour past it, for the
-- caller to write as `x` and then set by `expire_at` (one PEXPIREAT every half hour, for a
-- lease extended every few seconds).
local function renewal(x, until_ms)
  if x and num(x) >= until_ms + HOUR / 2 then
    return nil
  end
  return until_ms + HOUR
end

local function expire_at(key, at)
  if at then
    redis.call('PEXPIREAT', key, int(at))
  end
end

-- Sets the time field `field` of `key`'s record (whose expiry was read as `x`) to `until_ms`
-- (the lease's expiry `e`, or a flag), renewing the record's hour when it would end less than
-- half an hour after `until_ms`.
local function stamp(key, field, until_ms, x)
  local at = renewal(x, until_ms)
  if at then
    redis.call('HSET', key, field, int(until_ms), 'x', int(at))
  else
    redis.call('HSET', key, field, int(until_ms))
  end
  expire_at(key, at)
end

-- Marks `key`'s record as barring `token` from being granted for `ms` (an attempt given up
-- whose outcome is unknown: a late copy of it, re-sent after a reconnect, must never take the
-- lease after this clean-up). The tokens are in the sorted set `<key>:abandoned`; the
-- record's `a` says until when to look there.
local function bar(key, token, now_ms, ms)
  local abandoned = key .. ':abandoned'
  redis.call('ZREMRANGEBYSCORE', abandoned, '-inf', now_ms)
  redis.call('ZADD', abandoned, now_ms + ms, token)
  redis.call('PEXPIRE', abandoned, ms)
  local seen = redis.call('HMGET', key, 'a', 'x', 't', 'f')
  ours(key, seen[2], seen[3], seen[4])
  stamp(key, 'a', math.max(num(seen[1]) or 0, now_ms + ms), seen[2])
end

-- Whether `token` is barred from `key` (see bar): `a` is the record's field.
local function barred(key, token, a, now_ms)
  return a and num(a) > now_ms and redis.call('ZSCORE', key .. ':abandoned', token)
end

-- Takes the fair queue's waiters whose deadline passed (server ms `now_ms`) out of it (see
-- fair_acquire.lua): one ZRANGEBYSCORE when nobody died.
local function evict_dead(queue, timeouts, now_ms)
  local dead = redis.call('ZRANGEBYSCORE', timeouts, '-inf', now_ms)
  if #dead > 0 then
    for _, d in ipairs(dead) do
      redis.call('LREM', queue, 1, d)
    end
    redis.call('ZREMRANGEBYSCORE', timeouts, '-inf', now_ms)
  end
end

-- Hands the free lock at `key` to its fair queue's head: evicts the waiters whose deadline
-- passed, then publishes the head's token on `<key>:handoff` (pcall: a message an ACL refuses
-- is dropped; the head finds the lock by its re-check).
local function wake_head(key, now_ms)
  local queue = key .. ':queue'
  evict_dead(queue, key .. ':timeouts', now_ms)
  local head = redis.call('LINDEX', queue, 0)
  if head then
    redis.pcall('PUBLISH', key .. ':handoff', head)
  end
end

-- How long this server has been up, in ms, as far as the restart guard needs to know: whether
-- it is at least `min_ms`. `now_s`: the server's clock in whole seconds, if the caller read it
-- (else read here). LASTSAVE is the later of the last save and the start, so now - LASTSAVE
-- never exceeds the uptime, and it answers most calls for the price of a trivial command;
-- when it falls short (a recent save, or a recent start), INFO tells. Both count whole
-- seconds of wall-clock time: one second is taken off, against the server.
local function uptime_ms(min_ms, now_s)
  now_s = now_s or tonumber(redis.call('TIME')[1])
  local since_save = 1000 * (now_s - tonumber(redis.call('LASTSAVE')) - 1)
  if since_save >= min_ms then
    return since_save
  end
  local s = tonumber(string.match(redis.call('INFO', 'server'), 'uptime_in_seconds:(%-?%d+)'))
  return 1000 * math.max((s or 0) - 1, 0)
end

-- The acquire scripts' restart guard: the ms to go while this server has been up for less
-- than `min_ms` (a quorum member's, or one server's restart quarantine; 0 asks nothing), or
-- nil. The uptime is read once per call.
local uptime_read
local function warming(min_ms, now_ms)
  if min_ms <= 0 then
    return nil
  end
  uptime_read = uptime_read or uptime_ms(min_ms, math.floor(now_ms / 1000))
  if uptime_read < min_ms then
    return min_ms - uptime_read
  end
  return nil
end

-- Serves an extension call: KEYS[i] a lease's key, ARGV[2i] its token, ARGV[2i+1] its TTL
-- (ms), after ARGV[1], the minimum uptime (ms; 0 for none: a quorum member up for less than
-- that, which may have restarted empty, extends nothing). `extend(key, token, ttl, now_ms)`
-- extends one lease and returns 1, or 0 when it is not held. Returns one answer per lease, a
-- failed one as its error's text (see each). Costs TIME once per call.
local function extensions(extend)
  local now_ms = server_clock()
  local min_uptime = tonumber(ARGV[1])
  local counted = min_uptime <= 0 or uptime_ms(min_uptime, math.floor(now_ms / 1000)) >= min_uptime
  local function one(i)
    return extend(KEYS[i], ARGV[2 * i], tonumber(ARGV[2 * i + 1]), now_ms)
  end
  local out = {}
  -- (Counted by ARGV: on a cluster KEYS also declares the keys beside each lock; see keys.rs.)
  for i = 1, (#ARGV - 1) / 2 do
    if counted then
      local code, err = each(one, i)
      out[i] = err or code
    else
      out[i] = 0
    end
  end
  return out
end

-- Ends the lease in `key`'s record, whose flags were read as `w`, `q` and `s`: `e` becomes 0
-- and the holder's label goes with it; `t` becomes `released` (the token whose release ended
-- the lease: a reentrant reign's last hold; nil to keep `t`), so a release re-sent after a
-- reconnect still finds it released. Then waiters are woken: plain ones by a message on
-- `<key>:released` while `w` says some wait ('*', which wakes every waiter of each process,
-- while `s` says shared waiters wait: all the readers a write held back may go in together),
-- the fair queue's head while `q` says the queue may hold waiters. Nothing after the HSET can
-- fail the release: a flag that is no number counts as unset, and the wake-ups are under
-- pcall (a queue of another type, a channel the user's ACL refuses: waiters find out by their
-- fallback re-check). `n`: the release's send number as sent (a decimal string; see "Send
-- order" below), kept as the record's `n`, so that a late copy of an acquire sent before it
-- is not granted (nil: none, for a shared mode's marker or a forced release).
local function end_lease(key, w, q, now_ms, released, s, n)
  if released and n then
    redis.call('HSET', key, 't', released, 'e', '0', 'h', '', 'n', n)
  elseif released then
    redis.call('HSET', key, 't', released, 'e', '0', 'h', '')
  elseif n then
    redis.call('HSET', key, 'e', '0', 'h', '', 'n', n)
  else
    redis.call('HSET', key, 'e', '0', 'h', '')
  end
  if (tonumber(s) or 0) > now_ms then
    redis.pcall('PUBLISH', key .. ':released', '*')
  elseif (tonumber(w) or 0) > now_ms then
    redis.pcall('PUBLISH', key .. ':released', '1')
  end
  if (tonumber(q) or 0) > now_ms then
    pcall(wake_head, key, now_ms)
  end
end

-- Runs `args`, an HSET of fields of `key`'s record, with the send number `n` as its `n`
-- (nil: left as it is; see "Send order") and the record's new hour `at` as its `x` (nil:
-- unchanged; see renewal), then sets that hour.
local function write(key, args, n, at)
  if n then
    args[#args + 1] = 'n'
    args[#args + 1] = n
  end
  if at then
    args[#args + 1] = 'x'
    args[#args + 1] = int(at)
  end
  redis.call(unpack(args))
  expire_at(key, at)
end

-- Grants the lock at `key` to `token` for `ttl` ms from `now_ms`, over a record read as `t`,
-- `e`, `f`, `x` (nil when there was none), and returns the fencing token: at least the last
-- + 1, at least the server's clock in µs (`clock_us`: so a restarted server without
-- persistence, or a record gone after its hour, still hands out larger tokens), and at least
-- `floor` (a Redlock quorum's proposal; 0 for none), which is capped at the clock plus 2 s
-- (a client whose clock runs fast cannot push the counter far ahead of the clocks that floor
-- it after a restart). A token the last holder released is kept as `r`, for its re-sent
-- release (across a time of shared holds, whose markers never take its place), with its
-- release's send number `m` (the record's `n` as read, `n_seen`). `n`: the acquire's send
-- number as sent (a decimal string), kept as `n` (nil: none, for a shared mode's marker). Costs one HSET, and a
-- PEXPIREAT when the record's hour needs renewing.
local function grant(key, token, ttl, label, floor, t, e, f, x, now_ms, clock_us, n, n_seen)
  ours(key, x, t, f)
  local fence = math.max((num(f) or 0) + 1, clock_us, math.min(floor, clock_us + 2000000))
  local until_ms = now_ms + ttl
  local at = renewal(x, until_ms)
  local args = {'HSET', key, 't', token, 'e', int(until_ms), 'f', int(fence), 'h', label}
  if e == '0' and t and t ~= token and string.sub(t, 1, 1) ~= '*' then
    args[#args + 1] = 'r'
    args[#args + 1] = t
    args[#args + 1] = 'm'
    args[#args + 1] = n_seen or '0'
  end
  write(key, args, n, at)
  return fence
end

-- Whether `token` released the lease of a record read as `t`, `e`, `r` (see grant).
local function released_by(token, t, e, r)
  return (t == token and e == '0') or r == token
end

-- Send order. A client numbers every acquire and release it sends (one counter per process,
-- strictly increasing in the order the operations are made; a token is used by one process
-- only), and the record keeps, as `n`, the number of the last acquire that granted or renewed
-- `t`'s lease, or of the release that ended it (`m`: the same for `r`). A copy of a command
-- may run late: re-sent after a reconnect while the first copy still waited in the server's
-- socket buffer or in the network. So a release ends only a lease granted by an acquire sent
-- before it (a late release of a lease given back, then granted again under the same token,
-- changes nothing), and an acquire of a token that does not hold the lease is not granted
-- when a later operation of that token ran here (the release that ended its lease, released
-- or run out, or a later grant). Records written without numbers count as 0.

-- Whether an acquire numbered `n` (a number) of `token` is a late copy, sent before a later operation
-- of the same token (the release that ended its lease, or a later grant that ran out) in a
-- record read as `t`, `n`, `r`, `m`, whose lease `token` does not hold now.
local function stale_acquire(token, n, t, tn, r, m)
  return (t == token and (num(tn) or 0) > n) or (r == token and (num(m) or 0) > n)
end

-- The first steps of the plain and fair acquire scripts on `key`'s record: an attempt that
-- finds its own lease (re-sent after a reconnect, or sent again) is answered "ours",
-- extended to `ttl` from now, with its fencing token (its send number `n`, as sent, raises
-- the record's, never lowers it); a barred token (see bar), or a late copy of an attempt whose
-- token a later release ended (see "Send order"), is refused. Returns that answer as (code,
-- value), or nil, the holder's ms left (-2 when free), the holder (false when free) and the
-- record as read: {t, e, f, x, a, w, v, n}.
local function arrive(key, token, ttl, now_ms, n)
  local seen = redis.call('HMGET', key, 't', 'e', 'f', 'x', 'a', 'w', 'v', 'n', 'r', 'm')
  local sent = tonumber(n)
  local holder = holding(seen[1], seen[2], now_ms)
  if holder == token then
    local until_ms = now_ms + ttl
    local at = renewal(seen[4], until_ms)
    local raised = (num(seen[8]) or 0) < sent and n or nil
    write(key, {'HSET', key, 'e', int(until_ms)}, raised, at)
    return 1, num(seen[3]) or 0
  end
  local left = holder and tonumber(seen[2]) - now_ms or -2
  if barred(key, token, seen[5], now_ms) then
    -- A late copy of an attempt that was given up and cleaned up already: never grant it.
    return 0, left
  end
  if stale_acquire(token, sent, seen[1], seen[8], seen[9], seen[10]) then
    -- A late copy of an attempt whose lease was released already.
    return 0, left
  end
  return nil, left, holder, seen
end

-- Shared holds: the reads of a read-write lock, or a semaphore's permits. Each is a lease of
-- its own in the sorted set `<key>:shared` (token -> expiry, server ms), with its fencing
-- token and label in the hash `<key>:sharers` (token -> 'fence label'). While any runs, the
-- record's `t` is the mode's marker (READ or PERMITS: no token equals either) and its `e` the
-- latest expiry among them, so every other kind of claim sees the lock held, with no change
-- to its script; a read and a permit on one name exclude each other the same way. The set
-- and the hash live an hour past the latest hold, renewed when half of it is gone (the
-- record's `z` says until when: see keep_shared). A released hold stays in the set with a
-- negative score (minus the time of its release), so that its release, re-sent after a
-- reconnect, is still answered "released": the last KEPT_MOST of them, and for KEPT ms once
-- no hold is left (a busy name, thousands of releases a second, keeps a bounded set).
local READ, PERMITS = '*r', '*p'
local KEPT, KEPT_MOST = 60000, 1000

-- Whether `t` is a shared mode's marker.
local function shared_mode(t)
  return t == READ or t == PERMITS
end

-- A shared hold's entry in `<key>:sharers`, '<fencing token>/<send number> <label>' (see
-- "Send order"; an entry written before send numbers, '<fencing token> <label>', counts as
-- number 0): its fencing token and send number (nil, 0 for no entry).
local function sharer(v)
  local fence, n = string.match(v or '', '^(%d+)/?(%d*)')
  return tonumber(fence), tonumber(n) or 0
end

-- Drops `key`'s shared holds that ran out by `now_ms`, with their fences and labels: one
-- ZRANGEBYSCORE when none did. Returns the set's name.
local function drop_dead(key, now_ms)
  local shared = key .. ':shared'
  local dead = redis.call('ZRANGEBYSCORE', shared, 0, now_ms)
  if #dead > 0 then
    for i = 1, #dead, 500 do
      -- (pcall: a hash of another type there must not fail a release; an acquire finds it
      -- out when it writes its own entry.)
      redis.pcall('HDEL', key .. ':sharers', unpack(dead, i, math.min(i + 499, #dead)))
    end
    redis.call('ZREMRANGEBYSCORE', shared, 0, now_ms)
  end
  return shared
end

-- Keeps the set and hash of `key`'s shared holds alive past `until_ms` (a hold's expiry),
-- as `renewal` keeps the record: `z` (the record's field, read by the caller; nil to set it
-- anew) says until when they live, and when less than half an hour is left past `until_ms`
-- they are given an hour past it. One PEXPIREAT each per half hour of a time of shared
-- holds, whatever renews the record's own `x` in between.
local function keep_shared(key, until_ms, z)
  local at = renewal(z, until_ms)
  if at then
    redis.call('PEXPIREAT', key .. ':shared', int(at))
    redis.call('PEXPIREAT', key .. ':sharers', int(at))
    redis.call('HSET', key, 'z', int(at))
  end
end
