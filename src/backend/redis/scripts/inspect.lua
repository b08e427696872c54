-- What the store knows about one lock, for Lock::inspect (reads only).
-- KEYS[1] the lock's key (its record: see acquire.lua; beside it the fair timeouts and the
-- reentrant owners hash, see keys.rs)
-- Returns {ms left (-2: no lease), last fencing token or '', holder label or '' (only while
-- held), live fair waiters (deadline not passed, by the server's clock), sum of the owners'
-- counts or -1 when there is no owners hash, live shared holds (reads, permits) or -1 when the
-- lock is not held in a shared mode, {their labels, those that have one}}.
local key = KEYS[1]
local now_ms = server_clock()
local seen = record(key, 't', 'e', 'f', 'h') or {}
local left, label = -2, ''
if holding(seen[1], seen[2], now_ms) then
  left, label = tonumber(seen[2]) - now_ms, seen[4] or ''
end
local queued = redis.call('ZCOUNT', key .. ':timeouts', '(' .. now_ms, '+inf')
local owners = -1
local counts = key .. ':owners'
if redis.call('EXISTS', counts) == 1 then
  owners = 0
  for _, v in ipairs(redis.call('HVALS', counts)) do
    owners = owners + (tonumber(v) or 0)
  end
end
local shared, labels = -1, {}
if left ~= -2 and shared_mode(seen[1]) then
  local tokens = redis.call('ZRANGEBYSCORE', key .. ':shared', '(' .. int(now_ms), '+inf')
  shared = #tokens
  if shared > 0 then
    for _, v in ipairs(redis.call('HMGET', key .. ':sharers', unpack(tokens, 1, math.min(#tokens, 1000)))) do
      local l = v and string.match(v, '^[%d/]+ (.+)$')
      if l then
        labels[#labels + 1] = l
      end
    end
  end
end
return {left, seen[3] or '', label, queued, owners, shared, labels}
