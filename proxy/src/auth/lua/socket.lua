-- Opens one WebSocket against a key's limit, for the whole fleet, atomically.
-- KEYS[1] WebSockets open (sorted set: lease id -> expiry, ms).
-- ARGV: the most open, lease id, lease ttl ms. Returns 1 opened, 0 refused.
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
