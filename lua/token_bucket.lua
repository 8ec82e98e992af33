-- token_bucket.lua: the token bucket of the rate limiter, the only code that runs inside Redis.
--
-- Why an EVAL script and not a Redis 7 FUNCTION library: the sidecar calls EVALSHA and, on a
-- NOSCRIPT error, EVAL with the same keys and arguments, which also caches the script on that node.
-- So every node heals by itself (restart, failover, a new Cluster primary) with plain routing by key,
-- and there is no per-node FUNCTION LOAD bookkeeping to keep in step with the topology.
--
-- Calling convention (one call = the decisions of one request that live in one Cluster slot):
--   KEYS[2i-1]  bucket key of decision i, `rl:{<key>}` (a hash: tokens, ts)
--   KEYS[2i]    attempt key of decision i, `rl:{<key>}:a:<attempt>`; when the decision has no
--               attempt, pass `rl:{<key>}:a:` and "" as attempt: the key is then never touched.
--               Both keys start with `rl:{<key>`, and Cluster hashes only the text between the
--               first `{` and the next `}`, so a bucket and its attempt records share one slot.
--   ARGV[1]     mode: "apply" (charge the decisions all-or-nothing) or "refund" (give back what
--               an attempt charged; used by the sidecar to compensate a cross-slot request)
--   ARGV[2]     attempt record TTL, milliseconds
--   ARGV[3+4(i-1) .. 6+4(i-1)]  capacity, refill_per_sec, cost, attempt ("" = none) of decision i
-- Reply: a flat array, 6 integers per decision:
--   allowed (0/1), remaining, retry_after_ms, reset_ms, reason (0 ok, 1 insufficient,
--   2 cost_exceeds_capacity), charged (0/1: this call's attempt deducted cost from the bucket)
--
-- The bucket, with time from the Redis server (TIME, microseconds):
--   elapsed_s = max(0, now - ts) / 1e6         a ts in the future (clock went back) is no time
--   tokens    = min(capacity, tokens + refill_per_sec * elapsed_s)     a missing bucket is full
--   admit if tokens >= cost and deduct cost, else retry_after_ms = ceil((cost - tokens) / refill_per_sec * 1000)
--   reset_ms  = ceil((capacity - tokens) / refill_per_sec * 1000)     time until full again
--   the bucket's TTL is the full-refill time plus 1 s: expiring it sooner would hand out budget early.
--   The bucket is written (HSET + PEXPIRE) only when a decision charges or refunds it, or to re-anchor
--   a ts in the future; a rejection leaves it as it was (refill is a function of tokens, ts and now,
--   so the unwritten refill is found again next time), keeping a rejection flood free of writes.
--
-- Attempt records: a decision with an attempt leaves `rl:{<key>}:a:<attempt>` holding its answer;
-- a repeat within the TTL gets that answer back and is not charged again. After a refund the record
-- keeps its reason and says allowed 0, charged 0: a repeat of a refunded attempt is answered "not
-- allowed" (the request was rejected as a whole). A request must not name one key twice with one
-- attempt (the two decisions would share one record); the sidecar refuses that.

local OK, INSUFFICIENT, COST_EXCEEDS_CAPACITY = 0, 1, 2
local MAX_INT = 9007199254740992 -- 2^53: replies are integers; clamp what cannot be one exactly
local MAX_TTL_MS = 315360000000 -- 10 years: PEXPIRE needs a finite value

local mode = ARGV[1]
local attempt_ttl_ms = tonumber(ARGV[2])
local n = #KEYS / 2
if (mode ~= 'apply' and mode ~= 'refund') or #KEYS % 2 ~= 0 or #ARGV ~= 2 + 4 * n then
  return redis.error_reply('ERR usage: KEYS = bucket, attempt per decision; ARGV = mode (apply|refund), attempt_ttl_ms, then capacity, refill_per_sec, cost, attempt per decision')
end
if not attempt_ttl_ms or attempt_ttl_ms ~= attempt_ttl_ms or attempt_ttl_ms < 1 or attempt_ttl_ms == math.huge then
  return redis.error_reply('ERR attempt_ttl_ms must be a number >= 1')
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local function int(x) -- a non-negative integer for the reply
  if x ~= x or x <= 0 then return 0 end
  return math.min(math.floor(x), MAX_INT)
end

local function ms_ceil(x) -- ceil of milliseconds, forgiving float noise such as 100.00000000000001
  return int(math.ceil(x - 1e-6))
end

-- Validate every decision before touching anything (the sidecar validates first; this is defense in depth).
local decisions = {}
for i = 1, n do
  local base = 2 + 4 * (i - 1)
  local d = { bucket = KEYS[2 * i - 1], record = KEYS[2 * i], attempt = ARGV[base + 4] }
  for j, name in ipairs({ 'capacity', 'refill_per_sec', 'cost' }) do
    local v = tonumber(ARGV[base + j])
    if not v or v ~= v or v <= 0 or v == math.huge then
      return redis.error_reply('ERR invalid decision ' .. i .. ': ' .. name .. ' must be a number > 0')
    end
    d[name] = v
  end
  decisions[i] = d
end

-- The bucket's tokens refilled up to now, and whether its ts lies in the future (to re-anchor).
local function refill(d)
  local stored = redis.call('HMGET', d.bucket, 'tokens', 'ts')
  local tokens, ts = tonumber(stored[1]), tonumber(stored[2])
  if not tokens or not ts or tokens ~= tokens then return d.capacity, false end
  local elapsed_s = math.max(0, now - ts) / 1000000
  return math.min(d.capacity, math.max(0, tokens) + d.refill_per_sec * elapsed_s), ts > now
end

-- Store the bucket's tokens as of now (this also re-anchors a future ts to now).
local function store(d, tokens)
  redis.call('HSET', d.bucket, 'tokens', string.format('%.17g', tokens), 'ts', string.format('%.0f', now))
  local ttl_ms = math.min(MAX_TTL_MS, math.ceil(d.capacity / d.refill_per_sec * 1000) + 1000)
  redis.call('PEXPIRE', d.bucket, string.format('%.0f', ttl_ms))
end

local function reset_ms(d, tokens)
  return ms_ceil((d.capacity - tokens) / d.refill_per_sec * 1000)
end

-- An attempt record is one string, "allowed remaining retry_after_ms reset_ms reason charged":
-- one GET to replay it, one SET ... PX to write it (cheaper than a hash and its PEXPIRE).
local function read_record(d)
  if d.attempt == '' then return nil end
  local s = redis.call('GET', d.record)
  if not s then return nil end
  local r = {}
  for v in string.gmatch(s, '%S+') do r[#r + 1] = tonumber(v) or 0 end
  for j = #r + 1, 6 do r[j] = 0 end
  return r
end

local function record_value(r)
  return string.format('%d %d %d %d %d %d', r[1], r[2], r[3], r[4], r[5], r[6])
end

local reply = {}
local function answer(r)
  for j = 1, 6 do reply[#reply + 1] = r[j] end
end

if mode == 'refund' then
  for _, d in ipairs(decisions) do
    local r = read_record(d)
    if r and r[6] == 1 then
      local tokens = math.min(d.capacity, (refill(d)) + d.cost)
      store(d, tokens)
      r = { 0, int(tokens), r[3], reset_ms(d, tokens), r[5], 0 }
      redis.call('SET', d.record, record_value(r), 'KEEPTTL')
    end
    answer(r or { 0, 0, 0, 0, OK, 0 })
  end
  return reply
end

-- apply, pass 1: replay recorded attempts, refill the others and see whether each bucket admits.
-- A key named twice in one call is refilled once and each decision sees what the one before left (the
-- sidecar refuses such requests; this keeps a direct call consistent all the same).
local request_allowed = true
local refilled, available = {}, {}
for _, d in ipairs(decisions) do
  d.replay = read_record(d)
  if d.replay then
    request_allowed = request_allowed and d.replay[6] == 1
  else
    if refilled[d.bucket] then
      d.refilled = refilled[d.bucket]
    else
      d.refilled, d.future = refill(d)
      refilled[d.bucket] = d.refilled
    end
    d.tokens = available[d.bucket] or d.refilled
    if d.cost > d.capacity then
      d.allowed, d.reason, d.retry_after_ms = false, COST_EXCEEDS_CAPACITY, 0
    elseif d.tokens < d.cost then
      d.allowed, d.reason = false, INSUFFICIENT
      d.retry_after_ms = ms_ceil((d.cost - d.tokens) / d.refill_per_sec * 1000)
    else
      d.allowed, d.reason, d.retry_after_ms = true, OK, 0
    end
    available[d.bucket] = d.allowed and d.tokens - d.cost or d.tokens
    request_allowed = request_allowed and d.allowed
  end
end

-- apply, pass 2: deduct and store only if every decision admitted; a rejection writes a bucket only
-- to re-anchor a ts in the future (a clock that went back).
for _, d in ipairs(decisions) do
  if d.replay then
    answer(d.replay)
  else
    local charged = request_allowed and 1 or 0
    local tokens = request_allowed and d.tokens - d.cost or d.refilled
    if request_allowed or d.future then store(d, tokens) end
    local r = { d.allowed and 1 or 0, int(tokens), d.retry_after_ms, reset_ms(d, tokens), d.reason, charged }
    if d.attempt ~= '' then
      redis.call('SET', d.record, record_value(r), 'PX', string.format('%.0f', attempt_ttl_ms))
    end
    answer(r)
  end
end
return reply
