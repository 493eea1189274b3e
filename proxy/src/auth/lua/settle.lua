-- Settles what one key's finished requests used and frees their slots, atomically.
-- KEYS[1] tokens bucket, KEYS[2] daily, KEYS[3] requests in flight, KEYS[4] WebSockets open.
-- ARGV: tokens/min (0: none), tokens over the reservations (negative: under), tokens spent,
-- lease ttl ms, then four lists, each a count and its lease ids: requests done, requests
-- still running (renewed), WebSockets closed, WebSockets still open (renewed).
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local tpm, over, spent, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])

if tpm > 0 and over ~= 0 then
  local v = redis.call('HMGET', KEYS[1], 'level', 'at')
  local lvl, at = tonumber(v[1]), tonumber(v[2])
  if not lvl then lvl, at = tpm, now end
  lvl = math.min(lvl + math.max(now - at, 0) * tpm / 60000, tpm)
  lvl = math.min(lvl - over, tpm)
  redis.call('HSET', KEYS[1], 'level', lvl, 'at', now)
  redis.call('PEXPIRE', KEYS[1], 61000)
end
if spent > 0 then
  local day = math.floor(now / 86400000)
  local d = redis.call('HMGET', KEYS[2], 'day', 'used')
  local used = 0
  if tonumber(d[1]) == day then used = tonumber(d[2]) or 0 end
  redis.call('HSET', KEYS[2], 'day', day, 'used', used + spent)
  redis.call('PEXPIRE', KEYS[2], 2 * 86400000)
end
local i = 5
local function each(set, fn)
  local n = tonumber(ARGV[i])
  for j = 1, n do fn(set, ARGV[i + j]) end
  i = i + n + 1
end
local function free(set, id) redis.call('ZREM', set, id) end
local function renew(set, id)
  redis.call('ZADD', set, 'XX', now + ttl, id)
  redis.call('PEXPIRE', set, ttl)
end
each(KEYS[3], free)
each(KEYS[3], renew)
each(KEYS[4], free)
each(KEYS[4], renew)
return 1
