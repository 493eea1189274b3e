-- A conversation's metadata replaced, or the conversation deleted (metadata ''). Returns 1, or
-- 0 when it does not exist or is another's.
-- KEYS: meta hash, items list. ARGV: tenant, metadata.
if redis.call('HGET', KEYS[1], 'tenant') ~= ARGV[1] then return 0 end
if ARGV[2] == '' then
  redis.call('DEL', KEYS[1], KEYS[2])
else
  redis.call('HSET', KEYS[1], 'metadata', ARGV[2])
end
return 1
