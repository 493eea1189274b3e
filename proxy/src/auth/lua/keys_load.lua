-- The keys, if they changed since version ARGV[1] was read.
-- KEYS[1] the keys (hash: sha256 -> entry as JSON), KEYS[2] their version (a count).
-- Returns {version} when unchanged, else {version, entry, entry, ...}.
local v = redis.call('GET', KEYS[2]) or '0'
if v == ARGV[1] then return {v} end
local out = {v}
for _, e in ipairs(redis.call('HVALS', KEYS[1])) do out[#out + 1] = e end
return out
