-- Items appended to a conversation; the token ids kept for the whole of it when the caller read
-- it as it still is (same length and generation), else forgotten. Returns the new length, or
-- -1 when the conversation does not exist or is another's.
-- KEYS: meta hash, items list. ARGV: tenant, ttl_ms, read_len, read_gen, tokens ('' = none),
-- items...
if redis.call('HGET', KEYS[1], 'tenant') ~= ARGV[1] then return -1 end
local n = redis.call('LLEN', KEYS[2])
local gen = redis.call('HGET', KEYS[1], 'gen') or '0'
local added = #ARGV - 5
if added > 0 then redis.call('RPUSH', KEYS[2], unpack(ARGV, 6)) end
if ARGV[5] ~= '' and tostring(n) == ARGV[3] and gen == ARGV[4] then
  redis.call('HSET', KEYS[1], 'tokens', ARGV[5], 'tokens_len', n + added, 'tokens_gen', gen)
else
  redis.call('HDEL', KEYS[1], 'tokens', 'tokens_len', 'tokens_gen')
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if n + added > 0 then redis.call('PEXPIRE', KEYS[2], ARGV[2]) end
return n + added
