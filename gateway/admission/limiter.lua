-- Portico admission: every bucket a request touches, evaluated in one atomic step.
--
-- One script, two operations (ARGV[1]): "admit" and "settle". Redis runs a script atomically,
-- so a request either passes every bucket and is charged in all of them, or is charged in none.
--
-- Clock: Redis TIME (microseconds), the one clock every gateway replica shares. ARGV[2] may
-- carry a time in microseconds instead; only the conformance tests pass one (fake clock), the
-- production path passes "" and reads TIME.
--
-- Key layout (built by gateway/admission/limiter.py, all keys of one tenant share the hash tag {tenant}):
--   rate bucket   HASH  portico:rl:{tenant}:<scope>:<rpm|tpm>   fields t (tokens, may be < 0
--                       after a settle charged more than was reserved: debt) and s (stamp, us)
--   slots         ZSET  portico:rl:{tenant}:<scope>:conc        member slot id, score lease end
--   budget        STRING portico:budget:{tenant}:<scope>:<YYYY-MM>   tokens used this month
--   money budget  STRING portico:spend:{tenant}:<scope>:<d:YYYY-MM-DD|m:YYYY-MM>
--                       micro-dollars spent this UTC day or month (a budget like the token one:
--                       the script does not care about the unit; admission.py sends the charges)
--
-- Token bucket: capacity = the per-minute limit (the burst), refilled at limit/60 per second.
-- Idle keys expire once the bucket would be full again, so an absent key means full. Expiry is
-- set with PEXPIREAT on the script's own clock: in production that is Redis TIME, the clock
-- Redis expires keys by, so it equals a PEXPIRE of the time to refill; under a test clock that
-- runs ahead of real time, a key never vanishes before the script's time says it is full.
--
-- admit ARGV: op, now, n_rate, n_slot, n_budget,
--             then per rate bucket: limit, cost; per slot set: max; per budget: limit, need
--             (refused once used >= limit, or used + need > limit: what the request surely
--             costs, e.g. its prompt's price, must fit in what is left); then slot_id, lease_us.
--   KEYS: rate keys, slot keys, budget keys (in that order).
--   returns {allowed, failed (1-based index over all buckets, 0 = none), retry_ms,
--            per rate bucket: remaining, reset_ms; per slot set: in use; per budget: used}
--
-- settle ARGV: op, now, n_rate, n_slot, n_budget,
--              then per rate bucket: limit, delta (tokens used - tokens reserved: > 0 charges,
--              < 0 refunds); per budget: charge; then slot_id, budget key TTL (seconds).
--   KEYS: as for admit. returns {slots removed}

local US_PER_MINUTE = 60000000

local op = ARGV[1]
local now
if ARGV[2] ~= '' then
  now = tonumber(ARGV[2])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local n_rate = tonumber(ARGV[3])
local n_slot = tonumber(ARGV[4])
local n_budget = tonumber(ARGV[5])

-- The bucket's level now: what it held at its stamp plus the refill since, at most full.
local function level_of(key, limit)
  local state = redis.call('HMGET', key, 't', 's')
  if not state[1] then
    return limit
  end
  local elapsed = now - tonumber(state[2])
  if elapsed < 0 then
    elapsed = 0
  end
  local level = tonumber(state[1]) + elapsed * limit / US_PER_MINUTE
  if level > limit then
    level = limit
  end
  return level
end

-- Microseconds until a bucket at `level` is full again.
local function until_full_us(level, limit)
  if level >= limit then
    return 0
  end
  return (limit - level) * US_PER_MINUTE / limit
end

local function store(key, level, limit)
  redis.call('HSET', key, 't', string.format('%.17g', level), 's', string.format('%d', now))
  redis.call('PEXPIREAT', key, math.floor((now + until_full_us(level, limit)) / 1000) + 1)
end

if op == 'admit' then
  local arg = 6
  local failed, retry_us = 0, 0
  local levels, limits, costs = {}, {}, {}
  for i = 1, n_rate do
    local limit, cost = tonumber(ARGV[arg]), tonumber(ARGV[arg + 1])
    arg = arg + 2
    local level = level_of(KEYS[i], limit)
    levels[i], limits[i], costs[i] = level, limit, cost
    if level < cost then
      local wait = (cost - level) * US_PER_MINUTE / limit
      if wait > retry_us then
        failed, retry_us = i, wait
      end
    end
  end
  local in_use = {}
  local slot_failed = 0
  for j = 1, n_slot do
    local key, max = KEYS[n_rate + j], tonumber(ARGV[arg])
    arg = arg + 1
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    in_use[j] = redis.call('ZCARD', key)
    if in_use[j] >= max and slot_failed == 0 then
      slot_failed = n_rate + j
    end
  end
  local used = {}
  local budget_failed = 0
  for b = 1, n_budget do
    local limit, need = tonumber(ARGV[arg]), tonumber(ARGV[arg + 1])
    arg = arg + 2
    used[b] = tonumber(redis.call('GET', KEYS[n_rate + n_slot + b]) or '0')
    if (used[b] >= limit or used[b] + need > limit) and budget_failed == 0 then
      budget_failed = n_rate + n_slot + b
    end
  end
  local slot_id, lease_us = ARGV[arg], tonumber(ARGV[arg + 1])

  -- A spent budget outranks a busy slot, which outranks a rate bucket: the reason a client
  -- should act on first (no retry at all; retry when a request ends; retry after a wait).
  if budget_failed > 0 then
    failed = budget_failed
  elseif slot_failed > 0 then
    failed = slot_failed
  end
  local allowed = failed == 0
  if allowed then
    for i = 1, n_rate do
      levels[i] = levels[i] - costs[i]
      store(KEYS[i], levels[i], limits[i])
    end
    for j = 1, n_slot do
      local key = KEYS[n_rate + j]
      redis.call('ZADD', key, now + lease_us, slot_id)
      redis.call('PEXPIREAT', key, math.floor((now + lease_us) / 1000) + 1000)
      in_use[j] = in_use[j] + 1
    end
  end

  local out = {allowed and 1 or 0, failed, math.ceil(retry_us / 1000)}
  for i = 1, n_rate do
    local remaining = math.floor(levels[i])
    if remaining < 0 then
      remaining = 0
    end
    out[#out + 1] = remaining
    out[#out + 1] = math.ceil(until_full_us(levels[i], limits[i]) / 1000)
  end
  for j = 1, n_slot do
    out[#out + 1] = in_use[j]
  end
  for b = 1, n_budget do
    out[#out + 1] = used[b]
  end
  return out
end

if op == 'settle' then
  local arg = 6
  for i = 1, n_rate do
    local limit, delta = tonumber(ARGV[arg]), tonumber(ARGV[arg + 1])
    arg = arg + 2
    if delta ~= 0 then
      local level = level_of(KEYS[i], limit) - delta
      if level > limit then
        level = limit
      end
      store(KEYS[i], level, limit)
    end
  end
  local charges = {}
  for b = 1, n_budget do
    charges[b] = tonumber(ARGV[arg])
    arg = arg + 1
  end
  local slot_id = ARGV[arg]
  local ttl_s = tonumber(ARGV[arg + 1])
  local removed = 0
  for j = 1, n_slot do
    removed = removed + redis.call('ZREM', KEYS[n_rate + j], slot_id)
  end
  for b = 1, n_budget do
    if charges[b] > 0 then
      local key = KEYS[n_rate + n_slot + b]
      redis.call('INCRBY', key, charges[b])
      redis.call('EXPIRE', key, ttl_s)
    end
  end
  return {removed}
end

return redis.error_reply('limiter.lua: unknown operation ' .. tostring(op))
