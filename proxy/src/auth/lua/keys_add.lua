-- Adds a key: KEYS[1] the keys, KEYS[2] their version; ARGV: sha256, entry (JSON), name.
-- Returns 1 added, 0 the name is taken, -1 the same key is stored already.
for _, e in ipairs(redis.call('HVALS', KEYS[1])) do
  if cjson.decode(e).name == ARGV[3] then return 0 end
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('INCR', KEYS[2])
return 1
