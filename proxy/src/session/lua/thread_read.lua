-- A conversation whole, if the tenant made it: created_at, metadata, gen, tokens, tokens_len,
-- tokens_gen, then the items; nothing when it does not exist or is another's.
-- KEYS: meta hash, items list. ARGV: tenant.
if redis.call('HGET', KEYS[1], 'tenant') ~= ARGV[1] then return {} end
local h = function(f, d) return redis.call('HGET', KEYS[1], f) or d end
local out = {h('created_at', '0'), h('metadata', '{}'), h('gen', '0'), h('tokens', ''),
             h('tokens_len', '-1'), h('tokens_gen', '-1')}
local items = redis.call('LRANGE', KEYS[2], 0, -1)
for i = 1, #items do out[#out + 1] = items[i] end
return out
