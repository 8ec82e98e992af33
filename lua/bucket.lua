#!lua flags=allow-cross-slot-keys
-- bucket.lua: the token bucket, the only code that runs in Redis; the sidecar sends it followed by
-- apply.lua or refund.lua. docs/bucket.md explains each rule and layout; its Rust model,
-- sidecar/src/store/memory.rs, follows this code function for function.
--   tokens         = min(capacity - leased, tokens + refill_per_sec * max(0, now - ts) / 1e6)
--   admit if tokens >= cost (never if cost > capacity), then tokens -= cost
--   retry_after_ms = ceil((cost - tokens) / refill_per_sec * 1000)
--   reset_ms       = ceil((capacity - tokens) / refill_per_sec * 1000)
--   under a regional share m (ppm): capacity, refill_per_sec = floor(x * m) / 1e6
-- now: this server's TIME (us); leased: the unexpired leases' tokens; a missing bucket is full,
-- or with an epoch marker empty at the marker's time.
--
-- ARGV: 1 mode "apply" | "refund", 2 the numbers, 3 .. 2 + B the buckets' keys, then per group
-- its record key or "", last the epoch marker's key or "" (--store-reset full). The numbers are
-- packed little-endian as struct.unpack reads them (I4, I8: unsigned; d: double; B: a byte);
-- "n x (...)": a count n, then n times the bracket; bucket, limit, request: 1-based indices.
--   header:  record_ttl_ms I8, max_share d (lease cap, of capacity), cluster B (1: one read per
--            bucket), share_margin_ms I8, B I4, L I4, G I4, N I4
--   limits:  L x (capacity I8, refill_per_sec d, H I4, H x (from_ms I8, share_ppm I4))
--   groups:  G x (R I4, R x (D I4, D x (bucket I4, limit I4, cost I8, shadow B, lease_id I8,
--                                        lease_want I8, lease_ttl_ms I8)))
--   returns: N x (bucket I4, limit I4, lease_id I8, tokens I8)
--   refund.lua only: G x (K I4, K x (request I4))

local OK, INSUFFICIENT, COST_EXCEEDS_CAPACITY = 0, 1, 2
local MAX_INT = 9007199254740992 -- 2^53: the reply's doubles hold integers up to this
local MAX_LEASES = 64            -- leases one bucket holds; more asks get no grant
local MARGIN_MS = 1000           -- a key outlives the time its bucket is full again by 1 to 3 s
local ARGV, tonumber, floor, ceil, min = ARGV, tonumber, math.floor, math.ceil, math.min
local spack, sunpack, srep = struct.pack, struct.unpack, string.rep

local mode, s = ARGV[1], ARGV[2] -- s: the numbers, read at byte q
if mode ~= 'apply' and mode ~= 'refund' then error({ err = 'ERR usage: mode must be apply or refund' }) end
local record_ttl_ms, max_share, cluster, share_margin_ms, nkeys, nlimits, ngroups, nreturns, q =
  sunpack('<I8dBI8I4I4I4I4', s)
if #ARGV ~= 3 + nkeys + ngroups or record_ttl_ms < 1 or not (max_share >= 0 and max_share <= 1) then
  error({ err = 'ERR usage: B + G + 3 arguments, record_ttl_ms >= 1, 0 <= max_share <= 1' })
end
-- limits[i]: capacity, refill, capacity_now (under the share in force now); a regional limit also
-- shares (from_ms, ppm, from_ms, ppm, ...) and horizon, its fill time (us).
local limits = {}
for i = 1, nlimits do
  local capacity, refill, nh, last
  capacity, refill, nh, q = sunpack('<I8dI4', s, q)
  if capacity < 1 or not (refill > 0 and refill < math.huge) then
    error({ err = 'ERR invalid limit ' .. i .. ': capacity and refill_per_sec must be > 0 and finite' })
  end
  limits[i] = { capacity = capacity, refill = refill, capacity_now = capacity }
  for j = 1, nh do
    local h, from, ppm = limits[i].shares or {}, nil, nil
    from, ppm, q = sunpack('<I8I4', s, q)
    if from < (last or 0) or ppm > 1000000 then
      error({ err = 'ERR invalid limit ' .. i .. ': share changes must be in time order, each 0 to 1000000 ppm' })
    end
    h[2 * j - 1], h[2 * j], last = from, ppm, from
    limits[i].shares, limits[i].horizon = h, capacity / refill * 1000000
    limits[i].capacity_now = floor(capacity * ppm) / 1000000
  end
end
-- gs[g]: group g's last request, rq[r]: request r's last decision (numbered across groups; the
-- first is one after the one before's last); decs[d]: decision d's fields, its limit's table.
local gs, rq, decs, nreq, ndec, any_record, any_want = { [0] = 0 }, { [0] = 0 }, {}, 0, 0, false, false
for g = 1, ngroups do
  local nr
  nr, q = sunpack('<I4', s, q)
  any_record = any_record or ARGV[2 + nkeys + g] ~= ''
  for _ = 1, nr do
    local nd
    nd, q = sunpack('<I4', s, q)
    for _ = 1, nd do
      local b, l, cost, shadow, id, want, ttl
      b, l, cost, shadow, id, want, ttl, q = sunpack('<I4I4I8BI8I8I8', s, q)
      if b < 1 or b > nkeys or not limits[l] or cost < 1 then
        error({ err = 'ERR usage: bad bucket, limit or cost in group ' .. g })
      end
      ndec, any_want = ndec + 1, any_want or want > 0
      decs[ndec] = { b, limits[l], cost, shadow, id, want, ttl }
    end
    nreq = nreq + 1
    rq[nreq] = ndec
  end
  gs[g] = nreq
end
local rt = nreturns > 0 and {} -- rt[4i-3 .. 4i]: return i's bucket, limit, lease_id, tokens
for i = 1, nreturns do
  rt[4 * i - 3], rt[4 * i - 2], rt[4 * i - 1], rt[4 * i], q = sunpack('<I4I4I8I8', s, q)
  if rt[4 * i - 3] < 1 or rt[4 * i - 3] > nkeys or not limits[rt[4 * i - 2]] then
    error({ err = 'ERR usage: bad return ' .. i })
  end
end
if nkeys == 0 then return {} end
-- Every read before any write (docs/bucket.md, Cluster): MGET reads another type as missing.
local t = redis.call('TIME')
local now, records = tonumber(t[1]) * 1000000 + tonumber(t[2]), any_record and {}
local now_ms, raw = floor(now / 1000), cluster ~= 1 and redis.call('MGET', unpack(ARGV, 3, 2 + nkeys))
for i = 1, raw and 0 or nkeys do -- on a Cluster, a command stays in one slot
  raw = raw or {}
  raw[i] = redis.call('MGET', ARGV[2 + i])[1]
end
for g = 1, any_record and ngroups or 0 do
  if ARGV[2 + nkeys + g] ~= '' then records[g] = redis.call('MGET', ARGV[2 + nkeys + g])[1] end
end
-- The epoch (docs/bucket.md, a store that lost its state), made now when missing.
local marker, epoch = ARGV[#ARGV], nil
if marker ~= '' then epoch = tonumber(redis.call('MGET', marker)[1] or '') end
local new_epoch = marker ~= '' and not epoch
if new_epoch then epoch = now end
-- Bucket states, decoded once, written at the end when dirty: limit, tokens, ts, exp, since (the
-- stored ts, nil for a new bucket), leases (nil or the unexpired ones), dirty, and avail (apply.lua).
local states = {}
-- The lease ceiling: the capacity less what the bucket's unexpired leases hold.
local function ceiling(s, capacity)
  local leased, leases = 0, s.leases
  for i = 1, leases and #leases or 0 do leased = leased + leases[i].amount end
  return capacity - leased
end

-- The bucket function: bucket b's state, its tokens now (refilled, capped by the lease ceiling),
-- and the capacity and refill it is taken under: a regional limit's scaled by the smallest share
-- in force since the bucket's last decision, looking back at most its fill time.
local function bucket(b, limit)
  local s = states[b]
  if not s then
    local v, leases = raw[b], nil
    local n = v and #v % 24 == 0 and #v or 0 -- bytes; another value reads as missing
    local tokens, ts, exp = epoch and 0 or limit.capacity, epoch or now, 0
    if n > 0 then tokens, ts, exp = sunpack('<ddd', v) end
    for i = 25, n, 24 do -- the leases: id, amount, expiry (us); the unexpired ones kept
      local id, amount, expiry = sunpack('<ddd', v, i)
      if expiry > now then
        leases = leases or {}
        leases[#leases + 1] = { id = id, amount = amount, expiry = expiry }
      end
    end
    if tokens ~= tokens or tokens < 0 then tokens = 0 end
    s = { limit = limit, tokens = tokens, ts = ts, exp = exp, since = n > 0 and ts or nil }
    s.leases = leases -- five fields, room for the three set later: never resized
    states[b] = s
  end
  local capacity, refill, h = limit.capacity, limit.refill, limit.shares
  if h then
    local horizon = now - limit.horizon
    local from_ms, m = math.max(s.since or horizon, horizon) / 1000 - share_margin_ms, h[#h]
    for j = 2, #h - 2, 2 do -- a share counts if the next change came after from_ms
      if h[j + 1] > from_ms and h[j] < m then m = h[j] end
    end
    capacity, refill = floor(capacity * m) / 1000000, floor(refill * m) / 1000000
  end
  local tokens = s.tokens + refill * (now > s.ts and now - s.ts or 0) / 1000000
  local top = s.leases and ceiling(s, capacity) or capacity
  if tokens > top then tokens = top end
  if tokens < 0 then tokens = 0 end
  return s, tokens, capacity, refill
end
-- A reply's integer: x rounded down, 0 for less than nothing, at most 2^53.
local function int(x) return (x ~= x or x <= 0) and 0 or x >= MAX_INT and MAX_INT or floor(x) end
-- Milliseconds the refill takes to add `tokens` (retry_after_ms, reset_ms), rounded up but
-- forgiving float noise such as 100.00000000000001; int(x) inline.
local function wait_ms(tokens, refill)
  local x = ceil(tokens / refill * 1000 - 1e-6)
  return (x ~= x or x <= 0) and 0 or x >= MAX_INT and MAX_INT or x
end
-- Writes each dirty bucket once (docs/bucket.md, expiry): PXAT only when the key must outlive the
-- expiry it carries, else KEEPTTL.
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
      if keep then redis.call('SET', ARGV[2 + b], value, 'KEEPTTL')
      else redis.call('SET', ARGV[2 + b], value, 'PXAT', exp) end
    end
  end
end
-- What only calls with leases, returns or records use, built only for them.
local give, remove_lease, unpack_record
if any_want or rt or any_record or mode == 'refund' then
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
  -- The doubles of the record of group g (docs/bucket.md, records), or nil for a record of
  -- another shape (an attempt id reused for other requests): the group is then new.
  function unpack_record(v, g)
    local n = 0
    for r = gs[g - 1] + 1, gs[g] do n = n + 2 + 8 * (rq[r] - rq[r - 1]) end
    local flat, i = v and #v == 8 * n and { sunpack('<' .. srep('d', n), v) }, 1
    for r = gs[g - 1] + 1, flat and gs[g] or 0 do
      if flat[i + 1] ~= rq[r] - rq[r - 1] then return nil end
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
