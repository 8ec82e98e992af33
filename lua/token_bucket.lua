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
-- Reply (apply mode): one string of little-endian doubles, each an integer (all below 2^53, so
-- exact), in this order: per group, per request: status (0 rejected, 1 charged; plus 10 when
-- replayed from a record, where 12 is a refunded request), then per decision: allowed,
-- remaining, retry_after_ms, reset_ms, reason (0 ok, 1 insufficient, 2 cost_exceeds_capacity),
-- leased (tokens granted under the lease). One string instead of an array of integers spares
-- Redis a reply value per integer and the caller a parse per value.

-- Code notes (the script runs whole on every call, so its cost is what one call does): ARGV is
-- read by position into flat arrays and one small array per decision, not a hashed table per
-- group, request and decision; decision fields that are "0" or "1" skip tonumber; the functions
-- only records, returns, leases and regional shares need are created only by the calls that use
-- them; a bucket without leases is read and written as three doubles directly; the reply is sized
-- once, filled by index and packed into one string at the end.

local OK, INSUFFICIENT, COST_EXCEEDS_CAPACITY = 0, 1, 2
local MAX_INT = 9007199254740992 -- 2^53: replies are integers; clamp what cannot be one exactly
local MAX_LEASES = 64            -- lease entries one bucket holds; more asks get no grant
local MARGIN_MS = 1000           -- expiry margin past the time the bucket is full again

local ARGV, tonumber, floor, ceil = ARGV, tonumber, math.floor, math.ceil
local spack, sunpack = struct.pack, struct.unpack

-- Every number argument must be finite (v - v is 0 only then: not for nan or +-inf).
local function bad(pos)
  error('ERR usage: argument ' .. pos .. ' must be a finite number')
end

local mode = ARGV[1]
if mode ~= 'apply' and mode ~= 'refund' then
  return redis.error_reply('ERR usage: mode must be apply or refund')
end
local record_ttl_ms = tonumber(ARGV[2])
if not record_ttl_ms or record_ttl_ms - record_ttl_ms ~= 0 then bad(2) end
local max_share = tonumber(ARGV[3])
if not max_share or max_share - max_share ~= 0 then bad(3) end
local one_slot_per_command = tonumber(ARGV[4])
if not one_slot_per_command or one_slot_per_command - one_slot_per_command ~= 0 then bad(4) end
local share_margin_ms = tonumber(ARGV[5])
if not share_margin_ms or share_margin_ms - share_margin_ms ~= 0 then bad(5) end
if record_ttl_ms < 1 or max_share < 0 or max_share > 1 or share_margin_ms < 0 then
  return redis.error_reply('ERR usage: record_ttl_ms >= 1, 0 <= max_share <= 1, share_margin_ms >= 0')
end

local nb = tonumber(ARGV[6])
if not nb or nb - nb ~= 0 then bad(6) end
-- Bucket b's key is ARGV[6 + b], b = 1 .. nkeys.
local nkeys = 0
if nb >= 1 then nkeys = floor(nb) end
local p = 6 + nkeys -- the last argument read

p = p + 1
local nl = tonumber(ARGV[p])
if not nl or nl - nl ~= 0 then bad(p) end
local limits = {}
local nlimits, any_shares = 0, false
for i = 1, nl do
  p = p + 1
  local capacity = tonumber(ARGV[p])
  if not capacity or capacity - capacity ~= 0 then bad(p) end
  p = p + 1
  local refill = tonumber(ARGV[p])
  if not refill or refill - refill ~= 0 then bad(p) end
  if capacity <= 0 or refill <= 0 then
    return redis.error_reply('ERR invalid limit ' .. i .. ': capacity and refill_per_sec must be > 0')
  end
  p = p + 1
  local nh = tonumber(ARGV[p])
  if not nh or nh - nh ~= 0 then bad(p) end
  local shares = nil
  if nh > 0 then
    shares = {}
    any_shares = true
    local last = -1
    for j = 1, nh do
      p = p + 1
      local from_ms = tonumber(ARGV[p])
      if not from_ms or from_ms - from_ms ~= 0 then bad(p) end
      p = p + 1
      local ppm = tonumber(ARGV[p])
      if not ppm or ppm - ppm ~= 0 then bad(p) end
      if from_ms < last or ppm < 0 or ppm > 1000000 then
        return redis.error_reply('ERR invalid limit ' .. i .. ': share changes must be in time order, each 0 to 1000000 ppm')
      end
      last = from_ms
      shares[j] = { from_ms, ppm }
    end
  end
  limits[i] = { capacity = capacity, refill = refill, shares = shares,
                horizon = capacity / refill * 1000000 }
  nlimits = i
end

-- Groups, requests and decisions, flat:
--   gs[3g-2 .. 3g]  = record key, first and last request of group g
--   rq[2r-1 .. 2r]  = first and last decision of request r (numbered across groups)
--   decs[d]         = { bucket index, limit, cost, shadow, lease id, lease want, lease ttl_ms }
p = p + 1
local ng = tonumber(ARGV[p])
if not ng or ng - ng ~= 0 then bad(p) end
local gs, rq, decs = {}, {}, {}
local ngroups, nreq, ndec = 0, 0, 0
local any_record, any_want = false, false
for g = 1, ng do
  p = p + 1
  local record = ARGV[p]
  if record ~= '' then any_record = true end
  p = p + 1
  local nr = tonumber(ARGV[p])
  if not nr or nr - nr ~= 0 then bad(p) end
  local first = nreq + 1
  for r = 1, nr do
    p = p + 1
    local nd = ARGV[p]
    if nd == '1' then nd = 1 else nd = tonumber(nd) end
    if not nd or nd - nd ~= 0 then bad(p) end
    nreq = nreq + 1
    rq[2 * nreq - 1] = ndec + 1
    for d = 1, nd do
      local b, l, cost, shadow = ARGV[p + 1], ARGV[p + 2], ARGV[p + 3], ARGV[p + 4]
      local id, want, ttl = ARGV[p + 5], ARGV[p + 6], ARGV[p + 7]
      -- Most of these are "0" or "1": a string compare (interned: a pointer compare) first is
      -- several times cheaper than tonumber.
      if b == '1' then b = 1 else b = tonumber(b) end
      if l == '1' then l = 1 else l = tonumber(l) end
      if cost == '1' then cost = 1 else cost = tonumber(cost) end
      if shadow == '0' then shadow = 0 else shadow = tonumber(shadow) end
      if id == '0' then id = 0 else id = tonumber(id) end
      if want == '0' then want = 0 else want = tonumber(want) end
      if ttl == '0' then ttl = 0 else ttl = tonumber(ttl) end
      -- All finite when their sum is (or, rarely, when the sum alone overflows: look closer).
      if not (b and l and cost and shadow and id and want and ttl)
          or (b + l + cost + shadow + id + want + ttl) * 0 ~= 0 then
        for j = 1, 7 do
          local v = tonumber(ARGV[p + j])
          if not v or v - v ~= 0 then bad(p + j) end
        end
      end
      p = p + 7
      if b < 1 or b > nkeys or b % 1 ~= 0 or not ARGV[6 + b]
          or l < 1 or l > nlimits or l % 1 ~= 0 or cost < 1 then
        return redis.error_reply('ERR usage: bad bucket, limit or cost in group ' .. g)
      end
      if want > 0 then any_want = true end
      ndec = ndec + 1
      decs[ndec] = { b, limits[l], cost, shadow, id, want, ttl }
    end
    rq[2 * nreq] = ndec
  end
  ngroups = g
  gs[3 * g - 2], gs[3 * g - 1], gs[3 * g] = record, first, nreq
end

-- Returns: rt[4i-3 .. 4i] = bucket index, limit index, lease id, tokens.
p = p + 1
local nret = tonumber(ARGV[p])
if not nret or nret - nret ~= 0 then bad(p) end
local rt, nreturns = nil, 0
for i = 1, nret do
  rt = rt or {}
  for j = 1, 4 do
    p = p + 1
    local v = tonumber(ARGV[p])
    if not v or v - v ~= 0 then bad(p) end
    rt[4 * i - 4 + j] = v
  end
  local b, l = rt[4 * i - 3], rt[4 * i - 2]
  if b < 1 or b > nkeys or b % 1 ~= 0 or not ARGV[6 + b]
      or l < 1 or l > nlimits or l % 1 ~= 0 then
    return redis.error_reply('ERR usage: bad return')
  end
  nreturns = i
end
local refunds = nil
if mode == 'refund' then
  refunds = {}
  for g = 1, ng do
    p = p + 1
    local k = tonumber(ARGV[p])
    if not k or k - k ~= 0 then bad(p) end
    local set = {}
    for i = 1, k do
      p = p + 1
      local v = tonumber(ARGV[p])
      if not v or v - v ~= 0 then bad(p) end
      set[v] = true
    end
    refunds[g] = set
  end
end

if nb == 0 then return {} end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = floor(now / 1000)

-- Reads first (see Cluster above). On a Cluster each command must stay in one slot (the flag
-- lets the script, not a command, span slots): one GET per bucket there, one MGET elsewhere.
local raw
if one_slot_per_command == 1 then
  raw = {}
  for i = 1, nkeys do
    local v = redis.pcall('GET', ARGV[6 + i])
    if type(v) == 'table' and v.err then
      if string.find(v.err, 'WRONGTYPE', 1, true) then v = false else return v end
    end
    raw[i] = v
  end
else
  raw = redis.call('MGET', unpack(ARGV, 7, 6 + nkeys))
end
local records = nil
if any_record then
  records = {}
  for g = 1, ngroups do
    local record = gs[3 * g - 2]
    if record ~= '' then records[g] = redis.call('MGET', record)[1] end
  end
end

local effective -- see below; a function only for calls with regional limits, leases or records

-- Bucket states, decoded once and written once at the end if changed. `leases` is nil or a list
-- of the unexpired leases; `avail`/`avail_req`: the tokens the decisions of request avail_req
-- decided so far would leave (pass 1 below).
local states = {}
local function state(b, limit)
  local s = states[b]
  if s then return s end
  local v = raw[b]
  local n = v and #v
  if n == 24 then
    local tokens, ts, exp = sunpack('<ddd', v)
    if tokens ~= tokens or tokens < 0 then tokens = 0 end
    s = { limit = limit, tokens = tokens, ts = ts, exp = exp, leases = nil, dirty = false,
          future = ts > now, since = ts, avail = 0, avail_req = 0 }
  elseif n and n > 24 and (n - 24) % 24 == 0 then
    local m = (n - 24) / 24
    local all = { sunpack('<' .. string.rep('d', 3 + 3 * m), v) }
    local tokens, ts, exp = all[1], all[2], all[3]
    local leases = nil
    for i = 0, m - 1 do
      local expiry = all[6 + 3 * i]
      if expiry > now then
        leases = leases or {}
        leases[#leases + 1] = { id = all[4 + 3 * i], amount = all[5 + 3 * i], expiry = expiry }
      end
    end
    if tokens ~= tokens or tokens < 0 then tokens = 0 end
    s = { limit = limit, tokens = tokens, ts = ts, exp = exp, leases = leases, dirty = false,
          future = ts > now, since = ts, avail = 0, avail_req = 0 }
  else
    s = { limit = limit, tokens = limit.capacity, ts = now, exp = 0, leases = nil, dirty = false,
          future = false, since = nil, avail = 0, avail_req = 0 }
  end
  states[b] = s
  return s
end

-- The bucket's tokens now (refilled, capped by capacity minus unexpired leases). The capacity and
-- refill are the limit's, or for a regional limit `effective`'s (below).
local function tokens_now(s, limit)
  local capacity, refill = limit.capacity, limit.refill
  if limit.shares then capacity, refill = effective(s, limit) end
  local elapsed = now - s.ts
  if elapsed < 0 then elapsed = 0 end
  local tokens = s.tokens + refill * elapsed / 1000000
  local ceiling = capacity
  local leases = s.leases
  if leases then
    local sum = 0
    for i = 1, #leases do sum = sum + leases[i].amount end
    ceiling = capacity - sum
  end
  if tokens > ceiling then tokens = ceiling end
  if tokens < 0 then tokens = 0 end
  return tokens
end

-- An integer for the reply. A wait in ms is int(ceil(ms - 1e-6)): the ceil, forgiving float noise
-- such as 100.00000000000001.
local function int(x)
  if x ~= x or x <= 0 then return 0 end
  if x >= MAX_INT then return MAX_INT end
  return floor(x)
end

-- Regional shares, leases and records: functions created only for the calls that need them.
local scaled, smallest_share, leased, remove_lease, pack_record, unpack_record
if any_shares or any_want or nreturns > 0 or any_record then
  -- x scaled by ppm parts per million, rounded down to a millionth.
  scaled = function(x, ppm)
    return floor(x * ppm) / 1000000
  end

  -- The smallest share (ppm) of the limit's history in force at any instant since `since` (see
  -- the header: bounded by the fill time, widened by the margin).
  smallest_share = function(limit, since)
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
  effective = function(s, limit)
    if not limit.shares then return limit.capacity, limit.refill end
    local m = smallest_share(limit, s.since or (now - limit.horizon))
    return scaled(limit.capacity, m), scaled(limit.refill, m)
  end

  leased = function(s)
    local sum = 0
    local leases = s.leases
    if leases then
      for i = 1, #leases do sum = sum + leases[i].amount end
    end
    return sum
  end

  remove_lease = function(s, id)
    local leases = s.leases
    if not leases then return nil end
    for i = 1, #leases do
      if leases[i].id == id then
        s.dirty = true
        return table.remove(leases, i)
      end
    end
    return nil
  end

  -- A record is the group's answers, flattened as doubles: per request status, decision count,
  -- then per decision allowed, remaining, retry, reset, reason, leased, charged_tokens, lease_id.
  pack_record = function(flat)
    return spack('<' .. string.rep('d', #flat), unpack(flat))
  end

  -- The doubles of a record of this group (requests r1 .. r2); a record of another shape is not
  -- this group's (an attempt id reused for other requests): nil, and the group is decided as new.
  unpack_record = function(v, r1, r2)
    local expected = 0
    for r = r1, r2 do expected = expected + 2 + 8 * (rq[2 * r] - rq[2 * r - 1] + 1) end
    if not v or #v ~= 8 * expected then return nil end
    local flat = { sunpack('<' .. string.rep('d', expected), v) }
    local i = 1
    for r = r1, r2 do
      local nd = rq[2 * r] - rq[2 * r - 1] + 1
      if flat[i + 1] ~= nd then return nil end
      i = i + 2 + 8 * nd
    end
    return flat
  end
end

-- Returns: the unused part of a lease goes back, the lease is removed.
for i = 1, nreturns do
  local limit = limits[rt[4 * i - 2]]
  local s = state(rt[4 * i - 3], limit)
  local tokens = tokens_now(s, limit)
  local lease = remove_lease(s, rt[4 * i - 1])
  if lease then
    local back = math.min(rt[4 * i], lease.amount)
    local capacity = effective(s, limit)
    s.tokens, s.ts, s.dirty = math.min(tokens + back, capacity - leased(s)), now, true
  end
end

local reply, nreply = {}, 0

if mode == 'refund' then
  for g = 1, ngroups do
    local record, r1, r2 = gs[3 * g - 2], gs[3 * g - 1], gs[3 * g]
    local flat = record ~= '' and unpack_record(records[g], r1, r2)
    local changed = false
    if flat then
      local i = 1 -- the request's status in flat
      for r = r1, r2 do
        local d1, d2 = rq[2 * r - 1], rq[2 * r]
        if refunds[g][r - r1 + 1] and flat[i] == 1 then
          for d = d1, d2 do
            local x = i + 2 + 8 * (d - d1) - 1 -- flat[x + j] is the decision's j-th value
            local charged, lease_id = flat[x + 7], flat[x + 8]
            if charged > 0 then
              local dec = decs[d]
              local limit = dec[2]
              local s = state(dec[1], limit)
              local tokens = tokens_now(s, limit)
              -- The lease's part comes back only while the lease is still held (a returned or
              -- expired lease gave its tokens back, or lost them, already).
              if flat[x + 6] > 0 and not remove_lease(s, lease_id) then
                charged = charged - flat[x + 6]
              end
              local capacity, refill = effective(s, limit)
              tokens = math.min(tokens + charged, capacity - leased(s))
              s.tokens, s.ts, s.dirty = tokens, now, true
              flat[x + 1], flat[x + 2], flat[x + 6] = 0, int(tokens), 0
              flat[x + 4] = int(ceil((capacity - tokens) / refill * 1000 - 1e-6))
            end
          end
          flat[i] = 2
          changed = true
        end
        i = i + 2 + 8 * (d2 - d1 + 1)
      end
      if changed then
        flat[i] = nil -- struct.unpack's trailing position
        redis.call('SET', record, pack_record(flat), 'KEEPTTL')
      end
    end
    nreply = nreply + 1
    reply[nreply] = changed and 1 or 0
  end
else
  -- Records written by this call: a repeat of a group in the same batch (a retry that joined
  -- its original's call) must see them, though they were read before any write.
  local written = nil
  -- The reply has one status per request and 6 integers per decision: its array is sized at once
  -- (a table constructor sizes it for every value unpack gives, nils included; all are replaced
  -- below), sparing the reallocations of growing it entry by entry.
  local size = nreq + 6 * ndec
  if size <= 4000 then reply = { unpack(ARGV, 1, size) } end
  -- Pass 1's results for the decisions of the current request: allowed, reason, retry (3 each).
  local res = {}
  for g = 1, ngroups do
    local record, r1, r2 = gs[3 * g - 2], gs[3 * g - 1], gs[3 * g]
    local recorded = record ~= ''
      and unpack_record(written and written[record] or records[g], r1, r2)
    if recorded then
      local i = 1
      for r = r1, r2 do
        nreply = nreply + 1
        reply[nreply] = 10 + recorded[i]
        local nd = recorded[i + 1]
        i = i + 2
        for d = 1, nd do
          for j = 0, 5 do reply[nreply + 1 + j] = recorded[i + j] end
          nreply = nreply + 6
          i = i + 8
        end
      end
    else
      local flat = record ~= '' and {} -- the record, when the group has one
      local nflat = 0
      local any_charged = false
      for r = r1, r2 do
        local d1, d2 = rq[2 * r - 1], rq[2 * r]
        -- Pass 1: does every (non-shadow) decision admit? Decisions of one request on one bucket
        -- see what the ones before them would take.
        local admit = true
        for d = d1, d2 do
          local dec = decs[d]
          local limit, cost = dec[2], dec[3]
          local s = state(dec[1], limit)
          local tokens
          if s.avail_req == r then tokens = s.avail else tokens = tokens_now(s, limit) end
          local allowed, reason, retry = 0, OK, 0
          local capacity_now = limit.capacity -- under the share in force now
          if limit.shares then
            capacity_now = scaled(limit.capacity, limit.shares[#limit.shares][2])
          end
          if cost > capacity_now then
            reason = COST_EXCEEDS_CAPACITY
          elseif tokens < cost then
            reason = INSUFFICIENT
            local refill = limit.refill
            if limit.shares then refill = select(2, effective(s, limit)) end
            retry = int(ceil((cost - tokens) / refill * 1000 - 1e-6))
          else
            allowed = 1
            tokens = tokens - cost
          end
          s.avail, s.avail_req = tokens, r
          if allowed == 0 and dec[4] ~= 1 then admit = false end
          local j = 3 * (d - d1)
          res[j + 1], res[j + 2], res[j + 3] = allowed, reason, retry
        end
        local status = admit and 1 or 0
        nreply = nreply + 1
        reply[nreply] = status
        if flat then
          flat[nflat + 1], flat[nflat + 2] = status, d2 - d1 + 1
          nflat = nflat + 2
        end
        -- Pass 2: charge (and grant leases) only if the request is admitted.
        for d = d1, d2 do
          local dec = decs[d]
          local limit, cost = dec[2], dec[3]
          local s = states[dec[1]]
          local j = 3 * (d - d1)
          local allowed = res[j + 1]
          local tokens = tokens_now(s, limit)
          local grant, charged, lease_id = 0, 0, 0
          if admit and allowed == 1 then
            tokens = tokens - cost
            local want = dec[6]
            if want > 0 and (not s.leases or #s.leases < MAX_LEASES) then
              local cap = floor(max_share * (effective(s, limit)))
              grant = math.min(want, cap, floor(tokens))
              if grant < 0 then grant = 0 end
              if grant > 0 then
                -- A new lease under an id already held replaces it (its holder gave it up).
                remove_lease(s, dec[5])
                tokens = tokens - grant
                local leases = s.leases or {}
                s.leases = leases
                leases[#leases + 1] = { id = dec[5], amount = grant,
                                        expiry = now + dec[7] * 1000 }
              end
            end
            s.tokens, s.ts, s.dirty = tokens, now, true
            charged, lease_id = cost + grant, dec[5]
          elseif s.future then
            s.tokens, s.ts, s.dirty = tokens, now, true -- re-anchor a ts in the future
          end
          local capacity, refill = limit.capacity, limit.refill
          if limit.shares then capacity, refill = effective(s, limit) end
          local remaining = int(tokens)
          local reset = int(ceil((capacity - tokens) / refill * 1000 - 1e-6))
          reply[nreply + 1], reply[nreply + 2], reply[nreply + 3] = allowed, remaining, res[j + 3]
          reply[nreply + 4], reply[nreply + 5], reply[nreply + 6] = reset, res[j + 2], grant
          nreply = nreply + 6
          if flat then
            flat[nflat + 1], flat[nflat + 2], flat[nflat + 3] = allowed, remaining, res[j + 3]
            flat[nflat + 4], flat[nflat + 5], flat[nflat + 6] = reset, res[j + 2], grant
            flat[nflat + 7], flat[nflat + 8] = charged, lease_id
            nflat = nflat + 8
          end
        end
        any_charged = any_charged or admit
      end
      if flat and any_charged then
        local v = pack_record(flat)
        written = written or {}
        written[record] = v
        redis.call('SET', record, v, 'PX', record_ttl_ms)
      end
    end
  end
end

-- Writes: each changed bucket once (a bucket that only lost expired leases is left alone).
for b, s in pairs(states) do
  if s.dirty then
    local limit = s.limit
    local capacity, refill = limit.capacity, limit.refill
    if limit.shares then capacity, refill = effective(s, limit) end
    local leases = s.leases
    local last_lease = now
    if leases then
      for i = 1, #leases do
        if leases[i].expiry > last_lease then last_lease = leases[i].expiry end
      end
    end
    -- A refill rounded down to 0 (a tiny share) never fills: expire after the fill time (a
    -- missing bucket is full at the smallest share of the last fill time, see the header).
    local full_us = limit.horizon
    if refill > 0 then full_us = (capacity - s.tokens) / refill * 1000000 end
    local full_ms = ceil((full_us + (last_lease - now)) / 1000)
    local need = now_ms + full_ms + MARGIN_MS
    local exp = s.exp
    local keep = exp >= need and exp <= need + 2 * MARGIN_MS
    if not keep then exp = need + MARGIN_MS end
    local value
    if not leases or #leases == 0 then
      value = spack('<ddd', s.tokens, s.ts, exp)
    else
      local parts = { s.tokens, s.ts, exp }
      for i = 1, #leases do
        local l = leases[i]
        parts[3 * i + 1], parts[3 * i + 2], parts[3 * i + 3] = l.id, l.amount, l.expiry
      end
      value = spack('<' .. string.rep('d', #parts), unpack(parts))
    end
    if keep then
      redis.call('SET', ARGV[6 + b], value, 'KEEPTTL')
    else
      redis.call('SET', ARGV[6 + b], value, 'PXAT', exp)
    end
  end
end
if mode == 'refund' then return reply end
-- Packed in runs of at most 1000 values (unpack puts each run on Lua's stack).
local packed = {}
for i = 1, nreply, 1000 do
  local j = math.min(i + 999, nreply)
  packed[#packed + 1] = spack('<' .. string.rep('d', j - i + 1), unpack(reply, i, j))
end
return table.concat(packed)
