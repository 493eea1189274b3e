-- A conversation created, with its first items. KEYS: meta hash, items list.
-- ARGV: ttl_ms, tenant, created_at, metadata, items...
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], 'tenant', ARGV[2], 'created_at', ARGV[3], 'metadata', ARGV[4], 'gen', '0')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if #ARGV > 4 then
  redis.call('RPUSH', KEYS[2], unpack(ARGV, 5))
  redis.call('PEXPIRE', KEYS[2], ARGV[1])
end
return 1
