#!lua flags=allow-cross-slot-keys
-- bucket.lua: the token bucket, the only code that runs in Redis; the sidecar sends it followed by
-- apply.lua or refund.lua. docs/bucket.md explains each rule; sidecar/src/store/memory.rs is this
-- code in Rust, function for function.
--   tokens         = min(capacity - leased, tokens + refill_per_sec * max(0, now - ts) / 1e6)
--   admit if tokens >= cost (never if cost > capacity), then tokens -= cost
--   retry_after_ms = ceil((cost - tokens) / refill_per_sec * 1000)
--   reset_ms       = ceil((capacity - tokens) / refill_per_sec * 1000)
--   under a regional share m (ppm): capacity, refill_per_sec = floor(x * m) / 1e6
-- now: this server's TIME (us); leased: the unexpired leases' tokens; a missing bucket is full,
-- or with a marker (ARGV's last) empty at the store's epoch (docs/bucket.md, a store that lost
-- its state).
--
-- ARGV, decimal strings ("n x (...)": a count n, then n times the bracket's fields):
--   1 mode "apply" | "refund"   2 record_ttl_ms >= 1   3 max_share 0..1 (lease cap, of capacity)
--   4 cluster 0 | 1 (1: one read per bucket)          5 share_margin_ms >= 0
--   6 buckets: B x (key)
--   limits:    L x (capacity, refill_per_sec, H x (from_ms, share_ppm))
--   groups:    G x (record key or "", R x (D x (bucket, limit, cost, shadow 0 | 1, lease_id,
--                                                lease_want, lease_ttl_ms)))
--   returns:   N x (bucket, limit, lease_id, tokens)
--   refund.lua only, per group: K x (request)        bucket, limit, request: 1-based indices
--   last: the epoch marker's key, or "" (--store-reset full)
-- Stored bucket: little-endian doubles tokens, ts_us, exp_ms, then per lease id, amount, expiry_us.

local OK, INSUFFICIENT, COST_EXCEEDS_CAPACITY = 0, 1, 2
local MAX_INT = 9007199254740992 -- 2^53: the reply's doubles hold integers up to this
local MAX_LEASES = 64            -- leases one bucket holds; more asks get no grant
local MARGIN_MS = 1000           -- a key outlives the time its bucket is full again by 1 to 3 s
local ARGV, tonumber, floor, ceil, min = ARGV, tonumber, math.floor, math.ceil, math.min
local spack, sunpack, srep = struct.pack, struct.unpack, string.rep
local function fail(text) error({ err = 'ERR ' .. text }) end

-- The next argument, a finite number (v - v is 0 only then); "0" and "1" by a string compare,
-- far cheaper than tonumber (docs/bucket.md, the script's cost).
local p = 1
local function num()
  p = p + 1
  local v = ARGV[p]
  v = v == '0' and 0 or v == '1' and 1 or tonumber(v)
  if not v or v - v ~= 0 then fail('usage: argument ' .. p .. ' must be a finite number') end
  return v
end

local mode = ARGV[1]
if mode ~= 'apply' and mode ~= 'refund' then fail('usage: mode must be apply or refund') end
local record_ttl_ms, max_share, cluster, share_margin_ms, nb = num(), num(), num(), num(), num()
if record_ttl_ms < 1 or max_share < 0 or max_share > 1 or share_margin_ms < 0 then
  fail('usage: record_ttl_ms >= 1, 0 <= max_share <= 1, share_margin_ms >= 0')
end
local nkeys = nb >= 1 and floor(nb) or 0 -- bucket b's key is ARGV[6 + b]
p = 6 + nkeys
-- limits[i]: capacity, refill, capacity_now (under the share in force now); with a share history
-- also shares (shares[j]: from_ms, ppm) and horizon, the fill time (us): how far a share looks back.
local limits = {}
for i = 1, num() do
  local capacity, refill, shares, last = num(), num(), nil, -1
  if capacity <= 0 or refill <= 0 then fail('invalid limit ' .. i .. ': capacity and refill_per_sec must be > 0') end
  limits[i] = { capacity = capacity, refill = refill, capacity_now = capacity }
  for j = 1, num() do
    shares = shares or {}
    shares[j] = { num(), num() }
    if shares[j][1] < last or shares[j][2] < 0 or shares[j][2] > 1000000 then
      fail('invalid limit ' .. i .. ': share changes must be in time order, each 0 to 1000000 ppm')
    end
    last, limits[i].shares, limits[i].horizon = shares[j][1], shares, capacity / refill * 1000000
    limits[i].capacity_now = floor(capacity * shares[j][2]) / 1000000
  end
end
-- gs[3g-2 .. 3g]: group g's record key, first and last request; rq[2r-1 .. 2r]: request r's first
-- and last decision (numbered across groups); decs[d]: decision d's fields, its limit's table.
local gs, rq, decs, ngroups, nreq, ndec, any_record, any_want = {}, {}, {}, 0, 0, 0, false, false
for g = 1, num() do
  p = p + 1
  gs[3 * g - 2], gs[3 * g - 1], any_record = ARGV[p], nreq + 1, any_record or ARGV[p] ~= ''
  for _ = 1, num() do
    nreq = nreq + 1
    rq[2 * nreq - 1] = ndec + 1
    for _ = 1, num() do -- as num() does, inline (a table or a call per field costs more)
      local b, l, cost, shadow, id, want, ttl = unpack(ARGV, p + 1, p + 7)
      if b == '1' then b = 1 else b = tonumber(b) end
      if l == '1' then l = 1 else l = tonumber(l) end
      if cost == '1' then cost = 1 else cost = tonumber(cost) end
      if shadow == '0' then shadow = 0 elseif shadow == '1' then shadow = 1 else shadow = tonumber(shadow) end
      if id == '0' then id = 0 else id = tonumber(id) end
      if want == '0' then want = 0 else want = tonumber(want) end
      if ttl == '0' then ttl = 0 else ttl = tonumber(ttl) end
      if not (b and l and cost and shadow and id and want and ttl)
          or (b + l + cost + shadow + id + want + ttl) * 0 ~= 0 then
        for _ = 1, 7 do num() end -- fails at the first that is not finite (else the sum overflowed)
        p = p - 7
      end
      p = p + 7
      if b < 1 or b > nkeys or b % 1 ~= 0 or not ARGV[6 + b] or not limits[l] or cost < 1 then
        fail('usage: bad bucket, limit or cost in group ' .. g)
      end
      ndec, any_want = ndec + 1, any_want or want > 0
      decs[ndec] = { b, limits[l], cost, shadow, id, want, ttl }
    end
    rq[2 * nreq] = ndec
  end
  gs[3 * g], ngroups = nreq, g
end
local rt, nreturns = nil, 0 -- rt[4i-3 .. 4i]: return i's bucket, limit, lease_id, tokens
for i = 1, num() do
  rt = rt or {}
  rt[4 * i - 3], rt[4 * i - 2], rt[4 * i - 1], rt[4 * i], nreturns = num(), num(), num(), num(), i
  local b = rt[4 * i - 3]
  if b < 1 or b > nkeys or b % 1 ~= 0 or not ARGV[6 + b] or not limits[rt[4 * i - 2]] then
    fail('usage: bad return')
  end
end
if nkeys == 0 then return {} end
-- Every read before any write (docs/bucket.md, Cluster): MGET reads another type as missing.
local t = redis.call('TIME')
local now, records = tonumber(t[1]) * 1000000 + tonumber(t[2]), any_record and {}
local now_ms, raw = floor(now / 1000), cluster ~= 1 and redis.call('MGET', unpack(ARGV, 7, 6 + nkeys))
for i = 1, raw and 0 or nkeys do -- on a Cluster, a command stays in one slot
  raw = raw or {}
  raw[i] = redis.call('MGET', ARGV[6 + i])[1]
end
for g = 1, any_record and ngroups or 0 do
  if gs[3 * g - 2] ~= '' then records[g] = redis.call('MGET', gs[3 * g - 2])[1] end
end
-- The epoch: when the marker was made ("<s><us, 6 digits>", as the sidecar makes it); made now when missing.
local marker, epoch = ARGV[#ARGV], nil
if marker ~= '' then epoch = tonumber(redis.call('MGET', marker)[1] or '') end
local new_epoch = marker ~= '' and not epoch
if new_epoch then epoch = now end
-- Bucket states, decoded once, written at the end when dirty: limit, tokens, ts, exp, since (the
-- stored ts, nil for a new bucket), leases (nil or the unexpired ones), dirty, and avail: what the
-- decisions of the request being decided would leave (apply.lua's pass 1; pass 2 clears it).
local states = {}
-- The lease ceiling: the capacity less what the bucket's unexpired leases hold.
local function ceiling(s, capacity)
  local leased, leases = 0, s.leases
  for i = 1, leases and #leases or 0 do leased = leased + leases[i].amount end
  return capacity - leased
end

-- The bucket function: bucket b's state, its tokens now (refilled, capped by the lease ceiling),
-- and the capacity and refill it is taken under: a regional limit's scaled by the smallest share
-- in force since the bucket's last decision, looking back at most its fill time (docs/regions.md).
local function bucket(b, limit)
  local s = states[b]
  if not s then
    local v, leases = raw[b], nil
    local n = v and #v % 24 == 0 and #v / 8 or 0 -- doubles; another value reads as missing
    local tokens, ts, exp = epoch and 0 or limit.capacity, epoch or now, 0
    if n >= 3 then tokens, ts, exp = sunpack('<ddd', v) end
    if n > 3 then
      local all = { sunpack('<' .. srep('d', n), v) }
      for i = 4, n, 3 do
        if all[i + 2] > now then
          leases = leases or {}
          leases[#leases + 1] = { id = all[i], amount = all[i + 1], expiry = all[i + 2] }
        end
      end
    end
    if tokens ~= tokens then tokens = 0 end -- below 0: a debt (docs/costs.md)
    -- five fields, room for the three set later (leases, dirty, avail): never resized
    s = { limit = limit, tokens = tokens, ts = ts, exp = exp, since = n >= 3 and ts or nil }
    s.leases = leases
    states[b] = s
  end
  local capacity, refill, h = limit.capacity, limit.refill, limit.shares
  if h then
    local horizon = now - limit.horizon
    local from_ms, m = math.max(s.since or horizon, horizon) / 1000 - share_margin_ms, h[#h][2]
    for j = 1, #h - 1 do
      if h[j + 1][1] > from_ms and h[j][2] < m then m = h[j][2] end
    end
    capacity, refill = floor(capacity * m) / 1000000, floor(refill * m) / 1000000
  end
  local tokens = s.tokens + refill * (now > s.ts and now - s.ts or 0) / 1000000
  local top = s.leases and ceiling(s, capacity) or capacity
  if tokens > top then tokens = top > 0 and top or min(tokens, 0) end -- a debt stays one
  return s, tokens, capacity, refill
end
-- A reply's integer: x rounded down, 0 for less than nothing, at most 2^53.
local function int(x) return (x ~= x or x <= 0) and 0 or x >= MAX_INT and MAX_INT or floor(x) end
-- Milliseconds the refill takes to add `tokens` (retry_after_ms for the missing ones, reset_ms for
-- the empty room), rounded up but forgiving float noise such as 100.00000000000001; int(x) inline.
local function wait_ms(tokens, refill)
  local x = ceil(tokens / refill * 1000 - 1e-6)
  return (x ~= x or x <= 0) and 0 or x >= MAX_INT and MAX_INT or x
end
-- Writes each dirty bucket once. Its key expires once it is full again and every lease expired,
-- plus the margin; the expiry is rewritten (PXAT) only when that passes the one it carries.
local function finish()
  if new_epoch then redis.call('SET', marker, t[1] .. srep('0', 6 - #t[2]) .. t[2]) end
  for b, s in pairs(states) do
    if s.dirty then
      local limit, leases, last, tail = s.limit, s.leases, now, '' -- last: the last lease's expiry
      local capacity, refill = limit.capacity, limit.refill
      if limit.shares then capacity, refill = select(3, bucket(b, limit)) end
      for i = 1, leases and #leases or 0 do
        local l = leases[i]
        last, tail = l.expiry > last and l.expiry or last, tail .. spack('<ddd', l.id, l.amount, l.expiry)
      end
      -- A refill rounded down to 0 (a tiny share) never fills: expire after the fill time.
      local full_us = refill > 0 and (capacity - s.tokens) / refill * 1000000 or limit.horizon
      local need = now_ms + ceil((full_us + (last - now)) / 1000) + MARGIN_MS
      local keep = s.exp >= need and s.exp <= need + 2 * MARGIN_MS
      local exp = keep and s.exp or need + MARGIN_MS
      local value = spack('<ddd', s.tokens, s.ts, exp) .. tail
      if keep then redis.call('SET', ARGV[6 + b], value, 'KEEPTTL')
      else redis.call('SET', ARGV[6 + b], value, 'PXAT', exp) end
    end
  end
end
-- What only calls with leases, returns or records use, built only for them (docs/bucket.md).
local give, remove_lease, unpack_record
if any_want or nreturns > 0 or any_record or mode == 'refund' then
  -- Puts tokens back as of now, up to the lease ceiling; what the bucket then holds.
  function give(s, tokens, capacity)
    s.tokens, s.ts, s.dirty = min(tokens, ceiling(s, capacity)), now, true
    return s.tokens
  end
  -- Removes lease `id` from bucket state s: the lease, or nil when it holds none of that id.
  function remove_lease(s, id)
    for i = 1, s.leases and #s.leases or 0 do
      if s.leases[i].id == id then
        s.dirty = true
        return table.remove(s.leases, i)
      end
    end
  end
  -- The doubles of the record of group requests r1 .. r2 (docs/bucket.md, records), or nil for a
  -- record of another shape (an attempt id reused for other requests): the group is then new.
  function unpack_record(v, r1, r2)
    local n = 0
    for r = r1, r2 do n = n + 2 + 8 * (rq[2 * r] - rq[2 * r - 1] + 1) end
    local flat, i = v and #v == 8 * n and { sunpack('<' .. srep('d', n), v) }, 1
    for r = r1, flat and r2 or r1 - 1 do
      if flat[i + 1] ~= rq[2 * r] - rq[2 * r - 1] + 1 then return nil end
      i = i + 2 + 8 * flat[i + 1]
    end
    return flat
  end
end
-- Returns: the unused part of a lease goes back, the lease is removed.
for i = 1, nreturns do
  local s, tokens, capacity = bucket(rt[4 * i - 3], limits[rt[4 * i - 2]])
  local lease = remove_lease(s, rt[4 * i - 1])
  if lease then give(s, tokens + min(rt[4 * i], lease.amount), capacity) end
end
