#!lua flags=allow-cross-slot-keys
-- bucket.lua, the token bucket, sent followed by apply.lua or refund.lua (lone decisions: single.lua).
-- docs/bucket.md explains its rules and layouts; sidecar/src/store/memory/ is its Rust model.
--   tokens         = min(capacity - leased, tokens + refill_per_sec * max(0, now - ts) / 1e6)
--   admit if tokens >= cost (never if cost > capacity), then tokens -= cost
--   retry_after_ms = ceil((cost - tokens) / refill_per_sec * 1000)
--   reset_ms       = ceil((capacity - tokens) / refill_per_sec * 1000)
--   under a regional share m (ppm): capacity, refill_per_sec = floor(x * m) / 1e6
-- now: Redis's TIME (us); leased: the unexpired leases' tokens; a missing bucket: full, or under an
-- epoch (--store-reset empty) empty at the epoch, as is a bucket last written before it.
-- ARGV: mode "apply" | "refund"; the numbers; B bucket keys; G record keys or ""; the epoch marker's
-- key or "". The numbers, little-endian (struct I4, I8 unsigned, d double, B byte; n x (...): a
-- count, then n times the bracket; bucket, limit, request: 1-based indices):
--   record_ttl_ms I8, max_share d (0..1), cluster B (0 | 1), share_margin_ms I8, receipt_ttl_ms I8,
--   B, L, G, N I4
--   limits:  L x (capacity I8, refill_per_sec d, H I4, H x (from_ms I8, share_ppm I4))
--   groups:  G x (R I4, R x (D I4, D x (bucket I4, limit I4, cost I8, shadow B, share_capped B,
--                                        lease_id I8, lease_want I8, lease_ttl_ms I8, receipt I8)))
--   returns: N x (bucket I4, limit I4, lease_id I8, tokens I8)
--   refund.lua only: G x (K I4, K x (request I4))
local OK, INSUFFICIENT, COST_EXCEEDS_CAPACITY = 0, 1, 2 -- a decision's reason
local MAX_INT, MAX_LEASES, MARGIN_MS = 2 ^ 53, 64, 1000 -- docs/bucket.md: figures, leases, expiry
local ARGV, tonumber, floor, ceil, min = ARGV, tonumber, math.floor, math.ceil, math.min
local spack, sunpack, srep = struct.pack, struct.unpack, string.rep
local mode, nums = ARGV[1], ARGV[2] -- nums: the numbers, read on from byte q; mode: checked after
local record_ttl_ms, max_share, cluster, share_margin_ms, receipt_ttl_ms, nkeys, nlimits, ngroups,
  nreturns, q = sunpack('<I8dBI8I8I4I4I4I4', nums)
if #ARGV ~= 3 + nkeys + ngroups or record_ttl_ms < 1 or receipt_ttl_ms < 1
  or not (max_share >= 0 and max_share <= 1) then
  error({ err = 'ERR usage: B + G + 3 arguments, record_ttl_ms and receipt_ttl_ms >= 1, 0 <= max_share <= 1' })
end
-- limits[i]: capacity, refill, capacity_now (under the share now), horizon (the fill time, us), shares.
local limits = {}
for i = 1, nlimits do
  local capacity, refill, nh, h
  capacity, refill, nh, q = sunpack('<I8dI4', nums, q)
  if capacity < 1 or not (refill > 0 and refill < math.huge) then
    error({ err = 'ERR invalid limit ' .. i .. ': capacity and refill_per_sec must be > 0 and finite' })
  end
  limits[i] = { capacity = capacity, refill = refill, capacity_now = capacity,
                horizon = capacity / refill * 1000000 }
  for j = 1, nh do
    h = h or {}
    h[2 * j - 1], h[2 * j], q = sunpack('<I8I4', nums, q)
    if h[2 * j - 1] < (h[2 * j - 3] or 0) or h[2 * j] > 1000000 then
      error({ err = 'ERR invalid limit ' .. i .. ': shares must be in time order, each <= 1000000 ppm' })
    end
    limits[i].shares, limits[i].capacity_now = h, floor(capacity * h[2 * j]) / 1000000
  end
end
-- A decision's fields (decs[d][k]), as the numbers give them.
local BUCKET, LIMIT, COST, SHADOW, LEASE_ID, LEASE_WANT, LEASE_TTL_MS, SHARE_CAPPED, RECEIPT =
  1, 2, 3, 4, 5, 6, 7, 8, 9
-- A decision's figures in a reply (reply[o + k]) and in a record (flat[x + k]), where two more
-- follow them: the tokens it paid (cost and lease) and the lease's id.
local ALLOWED, REMAINING, RETRY_AFTER_MS, RESET_MS, REASON, LEASED, PAID, PAID_LEASE_ID =
  1, 2, 3, 4, 5, 6, 7, 8
-- gs[g], rq[r]: group g's last request, request r's last decision; decs[d]: decision d's fields.
local gs, rq, decs, nreq, ndec, any_want = { [0] = 0 }, { [0] = 0 }, {}, 0, 0, false
for g = 1, ngroups do
  local nr
  nr, q = sunpack('<I4', nums, q)
  for r = nreq + 1, nreq + nr do
    local nd
    nd, q = sunpack('<I4', nums, q)
    for d = ndec + 1, ndec + nd do
      local b, l, cost, shadow, capped, id, want, ttl, receipt
      b, l, cost, shadow, capped, id, want, ttl, receipt, q = sunpack('<I4I4I8BBI8I8I8I8', nums, q)
      if b < 1 or b > nkeys or not limits[l] or cost < 1 or receipt >= MAX_INT then
        error({ err = 'ERR usage: bad bucket, limit, cost or receipt in group ' .. g })
      end
      decs[d], any_want = { b, limits[l], cost, shadow, id, want, ttl, capped, receipt },
        any_want or want > 0
    end
    ndec, rq[r] = ndec + nd, ndec + nd
  end
  nreq, gs[g] = nreq + nr, nreq + nr
end
local t = redis.call('TIME') -- every read before any write (docs/bucket.md, Cluster)
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = floor(now / 1000)
local raw = (cluster == 1 or nkeys == 0) and {} or redis.call('MGET', unpack(ARGV, 3, 2 + nkeys))
for b = 1, cluster == 1 and nkeys or 0 do raw[b] = redis.call('MGET', ARGV[2 + b])[1] end
local records = {} -- records[g]: group g's record (false: missing) when it names one
for g = 1, ngroups do
  if ARGV[2 + nkeys + g] ~= '' then records[g] = redis.call('MGET', ARGV[2 + nkeys + g])[1] or false end
end
local marker = ARGV[#ARGV] -- the epoch (docs/bucket.md, a store that lost its state)
local epoch = marker ~= '' and tonumber(redis.call('MGET', marker)[1] or '')
local new_epoch = marker ~= '' and not epoch -- then made now
epoch = epoch or new_epoch and now
local states = {} -- bucket states, decoded once, written at the end when dirty (docs/bucket.md)
-- The bucket function: bucket b's state, its tokens now (refilled, at most capacity - leased),
-- the capacity and refill it is taken under (docs/regions.md), and its leased tokens.
local function bucket(b, limit)
  local s = states[b]
  if not s then
    local v = raw[b]
    local n = v and #v % 24 == 0 and #v or 0 -- bytes; another value reads as missing
    local tokens, ts, exp, leases = epoch and 0 or limit.capacity, epoch or now, 0, n > 24 and {} or nil
    if n > 0 then tokens, ts, exp = sunpack('<ddd', v) end
    if epoch and ts < epoch then tokens, ts, exp, n = 0, epoch, 0, 0 end -- not written since: empty then
    for i = 25, n, 24 do -- the leases, each id, amount, expiry (us): the unexpired ones kept
      local id, amount, expiry = sunpack('<ddd', v, i)
      if expiry > now then leases[#leases + 1] = { id = id, amount = amount, expiry = expiry } end
    end
    if tokens ~= tokens then tokens = 0 end -- below 0: a debt (docs/costs.md)
    s = { limit = limit, tokens = tokens, ts = ts, exp = exp, since = n > 0 and ts or nil }
    s.leases, states[b] = leases, s -- five fields, room for the three set later: never resized
  end
  local capacity, refill, h, leases = limit.capacity, limit.refill, limit.shares, s.leases
  if h then
    local horizon = now - limit.horizon
    local from_ms, m = math.max(s.since or horizon, horizon) / 1000 - share_margin_ms, h[#h]
    for j = 2, #h - 2, 2 do -- a share counts when the change after it came after from_ms
      if h[j + 1] > from_ms and h[j] < m then m = h[j] end
    end
    capacity, refill = floor(capacity * m) / 1000000, floor(refill * m) / 1000000
  end
  local tokens, leased = s.tokens + refill * (now > s.ts and now - s.ts or 0) / 1000000, 0
  if leases then for i = 1, #leases do leased = leased + leases[i].amount end end
  local top = capacity - leased
  if tokens > top then tokens = top > 0 and top or min(tokens, 0) end -- a debt stays one
  return s, tokens, capacity, refill, leased
end
-- A reply's integer: x rounded down, 0 for less than nothing, at most 2^53.
local function int(x) return (x ~= x or x <= 0) and 0 or x >= MAX_INT and MAX_INT or floor(x) end
-- Milliseconds the refill takes to add `tokens`, rounded up less float noise; int(x) inline.
local function wait_ms(tokens, refill)
  local x = ceil(tokens / refill * 1000 - 1e-6)
  return (x ~= x or x <= 0) and 0 or x >= MAX_INT and MAX_INT or x
end
-- Writes each dirty bucket once, with a new expiry (PXAT) only when it must (docs/bucket.md).
local function finish()
  if new_epoch then -- the marker, and the server it was made on (lua/fence.lua reads both)
    redis.call('SET', marker, t[1] .. srep('0', 6 - #t[2]) .. t[2])
    redis.call('SET', marker .. ':run', string.match(redis.call('INFO', 'server'), 'run_id:(%x+)'))
  end
  for b, s in pairs(states) do
    if s.dirty then
      local limit, leases, last, tail = s.limit, s.leases, now, '' -- last: the last lease's expiry
      local capacity, refill = limit.capacity, limit.refill
      if limit.shares then capacity, refill = select(3, bucket(b, limit)) end
      for i = 1, leases and #leases or 0 do
        local l = leases[i]
        last, tail = l.expiry > last and l.expiry or last, tail .. spack('<ddd', l.id, l.amount, l.expiry)
      end
      local full_us = refill > 0 and (capacity - s.tokens) / refill * 1000000 or limit.horizon
      local need = now_ms + ceil((full_us + (last - now)) / 1000) + MARGIN_MS
      local keep = s.exp >= need and s.exp <= need + 2 * MARGIN_MS
      local value = spack('<ddd', s.tokens, s.ts, keep and s.exp or need + MARGIN_MS) .. tail
      if keep then redis.call('SET', ARGV[2 + b], value, 'KEEPTTL')
      else redis.call('SET', ARGV[2 + b], value, 'PXAT', need + MARGIN_MS) end
    end
  end
end
-- What only calls with leases, returns or records use, built only for them.
local remove_lease, unpack_record
if any_want or nreturns > 0 or next(records) or mode == 'refund' then
  -- Removes lease `id` from state s (the caller marks it dirty): its amount, or nil if none.
  function remove_lease(s, id)
    for i = 1, s.leases and #s.leases or 0 do
      if s.leases[i].id == id then return table.remove(s.leases, i).amount end
    end
  end
  -- Group g's record as doubles, or nil for one of another shape: the group is then new.
  function unpack_record(v, g)
    local n = 2 * (gs[g] - gs[g - 1]) + 8 * (rq[gs[g]] - rq[gs[g - 1]]) -- 2 per request, 8 per decision
    local flat, i = v and #v == 8 * n and { sunpack('<' .. srep('d', n), v) }, 1
    for r = gs[g - 1] + 1, flat and gs[g] or 0 do
      if flat[i + 1] ~= rq[r] - rq[r - 1] then return nil end
      i = i + 2 + 8 * flat[i + 1]
    end
    return flat
  end
end
-- Returns: a lease's unused part goes back, up to the ceiling without it; the lease is removed.
for i = 1, nreturns do
  local b, l, id, unused
  b, l, id, unused, q = sunpack('<I4I4I8I8', nums, q)
  if b < 1 or b > nkeys or not limits[l] then error({ err = 'ERR usage: bad return ' .. i }) end
  local s, tokens, capacity, _, leased = bucket(b, limits[l])
  local amount = remove_lease(s, id)
  if amount then
    s.tokens, s.ts, s.dirty = min(tokens + min(unused, amount), capacity - (leased - amount)), now, true
  end
end
