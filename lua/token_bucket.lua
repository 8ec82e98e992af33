#!lua flags=allow-cross-slot-keys
-- token_bucket.lua: the token bucket of the rate limiter, the only code that runs inside Redis.
--
-- One call decides a BATCH: the requests of one or more gateway calls whose buckets live on this
-- Redis node. Each request is all-or-nothing on its own; the requests are decided in order, each
-- seeing what the previous ones left.
--
-- The bucket, with time from the Redis server (TIME, microseconds):
--   elapsed_s   = max(0, now - ts) / 1e6        a ts in the future (clock went back) is no time
--   leased      = sum of the amounts of the bucket's unexpired leases
--   tokens      = min(capacity - leased, tokens + refill_per_sec * elapsed_s)   missing = full
--   admit cost if tokens >= cost: tokens -= cost
--   else retry_after_ms = ceil((cost - tokens) / refill_per_sec * 1000)   (a lower bound of the wait)
--   reset_ms    = ceil((capacity - tokens) / refill_per_sec * 1000)       (time until full again)
--
-- Regional shares (docs/regions.md): a limit may carry its region's share history, changes
-- (from_ms on this Redis's clock, share in parts per million) in time order, the last in force now.
-- The bucket is then taken under m, the SMALLEST share in force at any instant since its last
-- decision, which keeps the regions together within the global bucket:
--   horizon_us  = capacity / refill_per_sec * 1e6                  the fill time: the look-back
--   since       = the bucket's stored ts (before this call), or now - horizon_us when missing
--   from_ms     = max(since, now - horizon_us) / 1000 - share_margin_ms   (the margin covers
--                 clock offsets between the node that stamped the history and this one)
--   m           = min of the shares of the changes in force at any instant of [from_ms, now]
--                 (every change whose successor starts after from_ms, and the last one)
--   capacity, refill_per_sec = floor(x * m) / 1e6 of the limit's (rounded down: never a token more)
-- and the formulas above use these (a missing bucket is full at the smallest share of the last
-- horizon). One exception: cost_exceeds_capacity compares the cost with the capacity under the
-- share in force now (the last change), since m only lasts until the next decision.
--
-- Leases: a decision may ask for `want` tokens more than its cost, held by the gateway for `ttl_ms`
-- under a lease id. They are deducted now and the lease is recorded in the bucket; while it is
-- unexpired the bucket's ceiling is lowered by its amount, so tokens held by gateways plus tokens
-- in Redis never exceed the capacity (leases never create tokens: over-admission stays 0). A grant
-- is at most max_share * capacity and at most what the bucket holds after the cost. A return gives
-- the unused part of a lease back and removes the lease. An unreturned lease simply expires (its
-- unused tokens are lost: under-admission, bounded by the grant).
--
-- Storage: one key per bucket, a string of packed doubles (struct.pack, no decimal formatting):
--   tokens, ts (us), exp (ms, the PXAT the key carries), then per lease: id, amount, expiry (us).
-- The key expires once the bucket would be full again and every lease has expired, plus 1 to 3 s:
-- a missing bucket is a full one, so expiring sooner would hand out budget early. The TTL is
-- rewritten (PXAT) only when the needed expiry passes the one the key carries; otherwise the write
-- keeps it (KEEPTTL), which is cheaper. A rejected request writes nothing (but re-anchors a ts in
-- the future).
--
-- Records (deduplication and compensation): a group of requests (one gateway call's requests on
-- this node) may name a record key `<bucket key of its first decision>:a:<attempt>`. When the key
-- exists, the group is a repeat: its recorded answers are replayed and nothing is charged. The
-- record is written only when some request of the group charged. In "refund" mode a record's
-- charged requests (those listed) are given back: costs and lease grants return to their buckets,
-- the leases are removed, and the record marks them refunded (a second refund does nothing).
--
-- Cluster: keys of one call may live in several slots of this node (flag allow-cross-slot-keys).
-- KEYS[1] is one bucket of the call, for routing; every key is named in ARGV. All reads (buckets,
-- records) happen before any write, so a key this node does not serve fails the call before it
-- changes anything.
--
-- ARGV (all numbers as decimal strings):
--   1 mode ("apply" | "refund"), 2 record_ttl_ms, 3 max_share (lease cap as a fraction of capacity),
--   4 cluster (1: one key per command, as a Cluster requires; 0: MGET the buckets at once)
--   5 share_margin_ms (see regional shares above)
--   6 B, then B bucket key names
--   then L, then L x (capacity, refill_per_sec, H, then H x (from_ms, share_ppm)); H = 0: no share
--   then G, then per group: record key ("" = none), R, then per request: D, then D x
--        (bucket index, limit index, cost, shadow 0/1, lease id, lease want, lease ttl_ms)
--   then N returns: N x (bucket index, limit index, lease id, tokens)
--   refund mode only, then per group: K, then K request indices (1-based) to refund
-- In refund mode the reply is one integer per group: 1 when something was refunded, else 0.
-- Reply, flat integers, per group, per request: status (0 rejected, 1 charged; plus 10 when replayed
-- from a record, where 12 is a refunded request), then per
-- decision: allowed, remaining, retry_after_ms, reset_ms, reason (0 ok, 1 insufficient,
-- 2 cost_exceeds_capacity), leased (tokens granted under the lease).

local OK, INSUFFICIENT, COST_EXCEEDS_CAPACITY = 0, 1, 2
local MAX_INT = 9007199254740992 -- 2^53: replies are integers; clamp what cannot be one exactly
local MAX_LEASES = 16            -- lease entries one bucket holds; more asks get no grant
local MARGIN_MS = 1000           -- expiry margin past the time the bucket is full again

local pos = 0
local function nextarg()
  pos = pos + 1
  return ARGV[pos]
end
local function num()
  local v = tonumber(nextarg())
  if not v or v ~= v or v == math.huge or v == -math.huge then
    error('ERR usage: argument ' .. pos .. ' must be a finite number')
  end
  return v
end

local mode = nextarg()
if mode ~= 'apply' and mode ~= 'refund' then
  return redis.error_reply('ERR usage: mode must be apply or refund')
end
local record_ttl_ms = num()
local max_share = num()
local one_slot_per_command = num()
local share_margin_ms = num()
if record_ttl_ms < 1 or max_share < 0 or max_share > 1 or share_margin_ms < 0 then
  return redis.error_reply('ERR usage: record_ttl_ms >= 1, 0 <= max_share <= 1, share_margin_ms >= 0')
end

local nb = num()
local bkeys = {}
for i = 1, nb do bkeys[i] = nextarg() end
local nl = num()
local limits = {}
for i = 1, nl do
  local capacity, refill = num(), num()
  if capacity <= 0 or refill <= 0 then
    return redis.error_reply('ERR invalid limit ' .. i .. ': capacity and refill_per_sec must be > 0')
  end
  local nh = num()
  local shares = nil
  if nh > 0 then
    shares = {}
    local last = -1
    for j = 1, nh do
      local from_ms, ppm = num(), num()
      if from_ms < last or ppm < 0 or ppm > 1000000 then
        return redis.error_reply('ERR invalid limit ' .. i .. ': share changes must be in time order, each 0 to 1000000 ppm')
      end
      last = from_ms
      shares[j] = { from_ms, ppm }
    end
  end
  limits[i] = { capacity = capacity, refill = refill, shares = shares,
                horizon = capacity / refill * 1000000 }
end
local ng = num()
local groups = {}
for g = 1, ng do
  local group = { record = nextarg(), requests = {} }
  local nr = num()
  for r = 1, nr do
    local request = {}
    local nd = num()
    for d = 1, nd do
      local b, l, cost, shadow = num(), num(), num(), num()
      local id, want, ttl = num(), num(), num()
      if not bkeys[b] or not limits[l] or cost < 1 then
        return redis.error_reply('ERR usage: bad bucket, limit or cost in group ' .. g)
      end
      request[d] = { b = b, limit = limits[l], cost = cost, shadow = shadow == 1,
                     lease_id = id, want = want, ttl_ms = ttl }
    end
    group.requests[r] = request
  end
  groups[g] = group
end
local nret = num()
local returns = {}
for i = 1, nret do
  local b, l, id, tokens = num(), num(), num(), num()
  if not bkeys[b] or not limits[l] then return redis.error_reply('ERR usage: bad return') end
  returns[i] = { b = b, limit = limits[l], id = id, tokens = tokens }
end
local refunds = {}
if mode == 'refund' then
  for g = 1, ng do
    local k = num()
    refunds[g] = {}
    for i = 1, k do refunds[g][num()] = true end
  end
end

if nb == 0 then return {} end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now / 1000)

-- Reads first (see Cluster above). On a Cluster each command must stay in one slot (the flag
-- lets the script, not a command, span slots): one GET per bucket there, one MGET elsewhere.
local raw
if one_slot_per_command == 1 then
  raw = {}
  for i = 1, nb do
    local v = redis.pcall('GET', bkeys[i])
    if type(v) == 'table' and v.err then
      if string.find(v.err, 'WRONGTYPE', 1, true) then v = false else return v end
    end
    raw[i] = v
  end
else
  raw = redis.call('MGET', unpack(bkeys))
end
local records = {}
for g = 1, ng do
  if groups[g].record ~= '' then
    records[g] = redis.call('MGET', groups[g].record)[1]
  end
end

-- Bucket states, decoded once and written once at the end if changed.
local states = {}
local function state(b, limit)
  local s = states[b]
  if s then return s end
  s = { limit = limit, tokens = limit.capacity, ts = now, exp = 0, leases = {}, dirty = false,
        future = false, since = nil }
  local v = raw[b]
  if v and #v >= 24 and (#v - 24) % 24 == 0 then
    local n = (#v - 24) / 24
    local all = { struct.unpack('<' .. string.rep('d', 3 + 3 * n), v) }
    s.tokens, s.ts, s.exp = all[1], all[2], all[3]
    for i = 0, n - 1 do
      local expiry = all[6 + 3 * i]
      if expiry > now then
        s.leases[#s.leases + 1] = { id = all[4 + 3 * i], amount = all[5 + 3 * i], expiry = expiry }
      end
    end
    if s.tokens ~= s.tokens or s.tokens < 0 then s.tokens = 0 end
    if s.ts > now then s.future = true end
    s.since = s.ts
  end
  states[b] = s
  return s
end

local function leased(s)
  local sum = 0
  for _, l in ipairs(s.leases) do sum = sum + l.amount end
  return sum
end

-- x scaled by ppm parts per million, rounded down to a millionth.
local function scaled(x, ppm)
  return math.floor(x * ppm) / 1000000
end

-- The smallest share (ppm) of the limit's history in force at any instant since `since` (see the
-- header: bounded by the fill time, widened by the margin).
local function smallest_share(limit, since)
  local h = limit.shares
  local from_ms = math.max(since, now - limit.horizon) / 1000 - share_margin_ms
  local m = h[#h][2]
  for j = 1, #h - 1 do
    if h[j + 1][1] > from_ms and h[j][2] < m then m = h[j][2] end
  end
  return m
end

-- The capacity and refill a bucket is taken under in this call: the limit's, or for a regional
-- limit the limit's scaled by the smallest share since the bucket's last decision.
local function effective(s, limit)
  if not limit.shares then return limit.capacity, limit.refill end
  local m = smallest_share(limit, s.since or (now - limit.horizon))
  return scaled(limit.capacity, m), scaled(limit.refill, m)
end

-- The capacity under the share in force now (the largest cost that can ever succeed).
local function capacity_now(limit)
  if not limit.shares then return limit.capacity end
  return scaled(limit.capacity, limit.shares[#limit.shares][2])
end

-- The bucket's tokens now (refilled, capped by capacity minus unexpired leases).
local function tokens_now(s, limit)
  local capacity, refill = effective(s, limit)
  local elapsed = now - s.ts
  if elapsed < 0 then elapsed = 0 end
  local tokens = s.tokens + refill * elapsed / 1000000
  local ceiling = capacity - leased(s)
  if tokens > ceiling then tokens = ceiling end
  if tokens < 0 then tokens = 0 end
  return tokens
end

local function set_tokens(s, tokens)
  s.tokens, s.ts, s.dirty = tokens, now, true
end

local function int(x)
  if x ~= x or x <= 0 then return 0 end
  if x >= MAX_INT then return MAX_INT end
  return math.floor(x)
end
local function ms_ceil(x) -- ceil of milliseconds, forgiving float noise such as 100.00000000000001
  return int(math.ceil(x - 1e-6))
end

local function remove_lease(s, id)
  for i, l in ipairs(s.leases) do
    if l.id == id then
      table.remove(s.leases, i)
      s.dirty = true
      return l
    end
  end
  return nil
end

-- Returns: the unused part of a lease goes back, the lease is removed.
for _, r in ipairs(returns) do
  local s = state(r.b, r.limit)
  local tokens = tokens_now(s, r.limit)
  local lease = remove_lease(s, r.id)
  if lease then
    local back = math.min(r.tokens, lease.amount)
    local capacity = effective(s, r.limit)
    set_tokens(s, math.min(tokens + back, capacity - leased(s)))
  end
end

local reply = {}
local function push(x) reply[#reply + 1] = x end

local function pack_record(answers)
  -- answers: per request { status, decision count, per decision {allowed, remaining, retry, reset,
  -- reason, leased, charged_tokens, lease_id} }, flattened as doubles.
  local flat = {}
  for _, a in ipairs(answers) do
    flat[#flat + 1] = a.status
    flat[#flat + 1] = #a.decisions
    for _, d in ipairs(a.decisions) do
      for j = 1, 8 do flat[#flat + 1] = d[j] end
    end
  end
  return struct.pack('<' .. string.rep('d', #flat), unpack(flat))
end

-- A record of another shape is not this group's (an attempt id reused for other requests): nil,
-- and the group is decided as new.
local function unpack_record(v, group)
  local expected = 0
  for _, request in ipairs(group.requests) do expected = expected + 2 + 8 * #request end
  if not v or #v ~= 8 * expected then return nil end
  local flat = { struct.unpack('<' .. string.rep('d', expected), v) }
  local answers, i = {}, 1
  for r, request in ipairs(group.requests) do
    if flat[i + 1] ~= #request then return nil end
    local a = { status = flat[i], decisions = {} }
    i = i + 2
    for d = 1, #request do
      local x = {}
      for j = 1, 8 do x[j] = flat[i]; i = i + 1 end
      a.decisions[d] = x
    end
    answers[r] = a
  end
  return answers
end

local function reply_answers(answers, replayed)
  for _, a in ipairs(answers) do
    push((replayed and 10 or 0) + a.status)
    for _, d in ipairs(a.decisions) do
      for j = 1, 6 do push(d[j]) end
    end
  end
end

local function reset_ms(s, limit, tokens)
  local capacity, refill = effective(s, limit)
  return ms_ceil((capacity - tokens) / refill * 1000)
end

if mode == 'refund' then
  for g, group in ipairs(groups) do
    local answers = unpack_record(records[g], group)
    local changed = false
    if answers then
      for r, request in ipairs(group.requests) do
        local a = answers[r]
        if refunds[g][r] and a.status == 1 then
          for d, dec in ipairs(request) do
            local x = a.decisions[d]
            local charged, lease_id = x[7], x[8]
            if charged > 0 then
              local s = state(dec.b, dec.limit)
              local tokens = tokens_now(s, dec.limit)
              -- The lease's part comes back only while the lease is still held (a returned or
              -- expired lease gave its tokens back, or lost them, already).
              if x[6] > 0 and not remove_lease(s, lease_id) then charged = charged - x[6] end
              local capacity = effective(s, dec.limit)
              tokens = math.min(tokens + charged, capacity - leased(s))
              set_tokens(s, tokens)
              x[1], x[2], x[4], x[6] = 0, int(tokens), reset_ms(s, dec.limit, tokens), 0
            end
          end
          a.status = 2
          changed = true
        end
      end
      if changed then redis.call('SET', group.record, pack_record(answers), 'KEEPTTL') end
    end
    push(changed and 1 or 0)
  end
else
  -- Records written by this call: a repeat of a group in the same batch (a retry that joined
  -- its original's call) must see them, though they were read before any write.
  local written = {}
  for g, group in ipairs(groups) do
    local recorded = group.record ~= '' and unpack_record(written[group.record] or records[g], group)
    if recorded then
      reply_answers(recorded, true)
    else
      local answers, any_charged = {}, false
      for r, request in ipairs(group.requests) do
        -- Pass 1: does every (non-shadow) decision admit? Decisions of one request on one bucket
        -- see what the ones before them would take.
        local admit = true
        local avail = {}
        local results = {}
        for d, dec in ipairs(request) do
          local s = state(dec.b, dec.limit)
          local tokens = avail[dec.b] or tokens_now(s, dec.limit)
          local x = { 0, 0, 0, 0, OK, 0, 0, 0 }
          if dec.cost > capacity_now(dec.limit) then
            x[5] = COST_EXCEEDS_CAPACITY
          elseif tokens < dec.cost then
            x[5] = INSUFFICIENT
            local _, refill = effective(s, dec.limit)
            x[3] = ms_ceil((dec.cost - tokens) / refill * 1000)
          else
            x[1] = 1
            tokens = tokens - dec.cost
          end
          avail[dec.b] = tokens
          if x[1] == 0 and not dec.shadow then admit = false end
          results[d] = x
        end
        -- Pass 2: charge (and grant leases) only if the request is admitted.
        for d, dec in ipairs(request) do
          local s = state(dec.b, dec.limit)
          local x = results[d]
          local tokens = tokens_now(s, dec.limit)
          if admit and x[1] == 1 then
            tokens = tokens - dec.cost
            local grant = 0
            if dec.want > 0 and #s.leases < MAX_LEASES then
              local cap = math.floor(max_share * effective(s, dec.limit))
              grant = math.min(dec.want, cap, math.floor(tokens))
              if grant < 0 then grant = 0 end
              if grant > 0 then
                -- A new lease under an id already held replaces it (its holder gave it up).
                remove_lease(s, dec.lease_id)
                tokens = tokens - grant
                s.leases[#s.leases + 1] = { id = dec.lease_id, amount = grant,
                                            expiry = now + dec.ttl_ms * 1000 }
              end
            end
            set_tokens(s, tokens)
            x[6], x[7], x[8] = grant, dec.cost + grant, dec.lease_id
          elseif s.future then
            set_tokens(s, tokens) -- re-anchor a ts in the future
          end
          x[2] = int(tokens)
          x[4] = reset_ms(s, dec.limit, tokens)
        end
        answers[r] = { status = admit and 1 or 0, decisions = results }
        any_charged = any_charged or admit
      end
      if group.record ~= '' and any_charged then
        written[group.record] = pack_record(answers)
        redis.call('SET', group.record, written[group.record], 'PX', record_ttl_ms)
      end
      reply_answers(answers, false)
    end
  end
end

-- Writes: each changed bucket once (a bucket that only lost expired leases is left alone).
for b, s in pairs(states) do
  if s.dirty then
    local capacity, refill = effective(s, s.limit)
    local last_lease = now
    for _, l in ipairs(s.leases) do if l.expiry > last_lease then last_lease = l.expiry end end
    -- A refill rounded down to 0 (a tiny share) never fills: expire after the fill time (a
    -- missing bucket is full at the smallest share of the last fill time, see the header).
    local full_us = s.limit.horizon
    if refill > 0 then full_us = (capacity - s.tokens) / refill * 1000000 end
    local full_ms = math.ceil((full_us + (last_lease - now)) / 1000)
    local need = now_ms + full_ms + MARGIN_MS
    local parts = { s.tokens, s.ts, s.exp }
    for _, l in ipairs(s.leases) do
      parts[#parts + 1] = l.id; parts[#parts + 1] = l.amount; parts[#parts + 1] = l.expiry
    end
    if s.exp >= need and s.exp <= need + 2 * MARGIN_MS then
      redis.call('SET', bkeys[b], struct.pack('<' .. string.rep('d', #parts), unpack(parts)), 'KEEPTTL')
    else
      parts[3] = need + MARGIN_MS
      redis.call('SET', bkeys[b], struct.pack('<' .. string.rep('d', #parts), unpack(parts)), 'PXAT', parts[3])
    end
  end
end
return reply
