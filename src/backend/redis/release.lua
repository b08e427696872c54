-- Release leases, one or many at once (group commit): compare-and-delete, and wake waiters
-- if any are registered.
-- Per lease i (0-based), KEYS[4i+1..4i+4]:
--   lease key, fence hash, waiters flag, abandoned tokens
-- ARGV[3i+1..3i+3]:
--   token, release channel,
--   tombstone ms: > 0 when abandoning an attempt whose outcome is unknown; the token is
--   then barred from the acquire script for that long, so a late copy of the attempt
--   (re-sent after a reconnect) cannot take the lease after this clean-up.
-- Returns per lease 1 (released, also when a re-sent release finds it released by the same
-- token) or 0 (not ours).
local now_ms
local out = {}
for i = 0, #KEYS / 4 - 1 do
  local lease, fence, waiters, abandoned = KEYS[4 * i + 1], KEYS[4 * i + 2], KEYS[4 * i + 3], KEYS[4 * i + 4]
  local token, channel, tombstone = ARGV[3 * i + 1], ARGV[3 * i + 2], tonumber(ARGV[3 * i + 3])
  if tombstone > 0 then
    if not now_ms then
      local now = redis.call('TIME')
      now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
    end
    redis.call('ZREMRANGEBYSCORE', abandoned, '-inf', now_ms)
    redis.call('ZADD', abandoned, now_ms + tombstone, token)
    redis.call('PEXPIRE', abandoned, tombstone)
  end
  if redis.call('GET', lease) == token then
    redis.call('DEL', lease)
    -- Remember the released token, so a release re-sent after a reconnect still says "ours".
    redis.call('HSET', fence, 'r', token)
    if redis.call('EXISTS', waiters) == 1 then
      redis.call('PUBLISH', channel, '1')
    end
    out[i + 1] = 1
  elseif redis.call('HGET', fence, 'r') == token then
    out[i + 1] = 1
  else
    out[i + 1] = 0
  end
end
return out
