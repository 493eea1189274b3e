-- One item removed (by its exact stored text); the generation moves on and token ids are
-- forgotten. Returns how many were removed, or -1 when the conversation is not the tenant's.
-- KEYS: meta hash, items list. ARGV: tenant, item text.
if redis.call('HGET', KEYS[1], 'tenant') ~= ARGV[1] then return -1 end
local n = redis.call('LREM', KEYS[2], 1, ARGV[2])
if n > 0 then
  redis.call('HINCRBY', KEYS[1], 'gen', 1)
  redis.call('HDEL', KEYS[1], 'tokens', 'tokens_len', 'tokens_gen')
end
return n
