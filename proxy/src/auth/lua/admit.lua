-- Admits one request against a key's limits, for the whole fleet, atomically.
-- KEYS[1] requests bucket, KEYS[2] tokens bucket (hashes: level, at), KEYS[3] daily (hash:
-- day, used), KEYS[4] requests in flight (sorted set: lease id -> expiry, ms).
-- ARGV: requests/min, tokens/min, estimate, tokens/day, max in flight (0: no limit),
-- lease id, lease ttl ms.
-- Returns {status, wait ms, requests remaining, requests reset ms, tokens remaining,
-- tokens reset ms}; status 0 admitted, 1 in flight, 2 requests, 3 tokens, 4 too large for
-- the tokens limit, 5 daily budget.
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, tpm, est = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local per_day, max_inflight, ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[7])

local function level(key, limit)
  if limit == 0 then return 0 end
  local v = redis.call('HMGET', key, 'level', 'at')
  local lvl, at = tonumber(v[1]), tonumber(v[2])
  if not lvl then return limit end
  lvl = lvl + math.max(now - at, 0) * limit / 60000
  return math.min(lvl, limit)
end

local req, tok = level(KEYS[1], rpm), level(KEYS[2], tpm)
local status, wait = 0, 0
if max_inflight > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  if redis.call('ZCARD', KEYS[4]) >= max_inflight then status, wait = 1, 1000 end
end
if status == 0 and rpm > 0 and req < 1 then
  status, wait = 2, math.ceil((1 - req) * 60000 / rpm)
end
if status == 0 and tpm > 0 then
  if est > tpm then
    status = 4
  elseif tok < est then
    status, wait = 3, math.ceil((est - tok) * 60000 / tpm)
  end
end
if status == 0 and per_day > 0 then
  local d = redis.call('HMGET', KEYS[3], 'day', 'used')
  local used = 0
  if tonumber(d[1]) == math.floor(now / 86400000) then used = tonumber(d[2]) or 0 end
  if used + math.min(est, per_day) > per_day then
    status, wait = 5, 86400000 - now % 86400000
  end
end
if status == 0 then
  req, tok = req - 1, tok - est
  if max_inflight > 0 then
    redis.call('ZADD', KEYS[4], now + ttl, ARGV[6])
    redis.call('PEXPIRE', KEYS[4], ttl)
  end
end
-- A bucket left alone is full again within a minute: it is written back with that expiry.
local function store(key, limit, lvl)
  if limit == 0 then return 0, 0 end
  redis.call('HSET', key, 'level', lvl, 'at', now)
  redis.call('PEXPIRE', key, 61000)
  return math.max(math.floor(lvl), 0), math.ceil((limit - lvl) * 60000 / limit)
end
local req_left, req_reset = store(KEYS[1], rpm, req)
local tok_left, tok_reset = store(KEYS[2], tpm, tok)
return {status, wait, req_left, req_reset, tok_left, tok_reset}
