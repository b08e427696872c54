-- What the store knows about one lock, for Lock::inspect (reads only).
-- KEYS: lease key, fence hash {f = last token, h = holder label}, fair timeouts (sorted set
-- of waiting tokens by deadline), reentrant owners hash {owner: count}
-- Returns {pttl (-2: no lease), last fencing token or '', holder label or '' (only while
-- held), live fair waiters (deadline not passed, by the server's clock), sum of the owners'
-- counts or -1 when there is no owners hash}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local pttl = redis.call('PTTL', KEYS[1])
local fence = redis.call('HGET', KEYS[2], 'f') or ''
local label = ''
if pttl ~= -2 then
  label = redis.call('HGET', KEYS[2], 'h') or ''
end
local queued = redis.call('ZCOUNT', KEYS[3], '(' .. now, '+inf')
local owners = -1
if redis.call('EXISTS', KEYS[4]) == 1 then
  owners = 0
  for _, v in ipairs(redis.call('HVALS', KEYS[4])) do
    owners = owners + (tonumber(v) or 0)
  end
end
return {pttl, fence, label, queued, owners}
