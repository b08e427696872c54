-- A fenced write: set the value only if the writer's fencing token is not older than the
-- token of the write that set the value now (equal is allowed: the same holder writing
-- again). Tokens are compared as decimal strings (exact for every u64, unlike Lua numbers).
-- KEYS[1] hash {v = value, f = fencing token of the write that set it}
-- ARGV[1] value   ARGV[2] the writer's fencing token (decimal, no leading zeros)
-- Returns {1, token} applied, or {0, newest token} rejected.
local function older(a, b)
  if #a ~= #b then
    return #a < #b
  end
  return a < b
end
local last = redis.call('HGET', KEYS[1], 'f')
if last and older(ARGV[2], last) then
  return {0, last}
end
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'f', ARGV[2])
return {1, ARGV[2]}
