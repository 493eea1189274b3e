-- Removes the key named ARGV[1]: KEYS[1] the keys, KEYS[2] their version.
-- Returns 1 removed, 0 no such key.
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if cjson.decode(all[i + 1]).name == ARGV[1] then
    redis.call('HDEL', KEYS[1], all[i])
    redis.call('INCR', KEYS[2])
    return 1
  end
end
return 0
