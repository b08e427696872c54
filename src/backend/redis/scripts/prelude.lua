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

-- The token a lease key holds: false when the key is free, and when it holds no lease at all
-- (a value of another type, written by someone else: no lease of this client is there).
local function holder(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' and v.err then
    if string.sub(v.err, 1, 9) == 'WRONGTYPE' then
      return false
    end
    error(v)
  end
  return v
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

-- Hands a free lock to the fair queue's head: evicts the waiters whose deadline passed, then
-- publishes the head's token on `handoff` (pcall: a message an ACL refuses is dropped; the
-- head finds the lock by its re-check).
local function wake_head(queue, timeouts, handoff, now_ms)
  evict_dead(queue, timeouts, now_ms)
  local head = redis.call('LINDEX', queue, 0)
  if head then
    redis.pcall('PUBLISH', handoff, head)
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

-- After a lease's deletion: remembers the released token in the fence hash (a release re-sent
-- after a reconnect still says "ours"), drops the holder's label, gives the hash an hour, and
-- wakes plain waiters by a message on `channel` (pcall: where the user's ACL refuses the
-- channel, the message is dropped; waiters find out by their fallback re-check). `now()`
-- gives the server's ms (read only when a flag is there). Returns whether the fair queue may
-- hold waiters to hand the lock to.
local function after_release(fence, token, channel, now)
  local seen = redis.call('HMGET', fence, 'w', 'q')
  redis.call('HSET', fence, 'r', token, 'h', '')
  redis.call('PEXPIRE', fence, '3600000')
  if seen[1] and tonumber(seen[1]) > now() then
    redis.pcall('PUBLISH', channel, '1')
  end
  return seen[2] ~= false and tonumber(seen[2]) > now()
end
