#!lua flags=allow-cross-slot-keys
-- settle.lua: settlements of costs known after the response (docs/costs.md): each charges its
-- bucket the difference between the real cost and the reservation admitted, refilled first as
-- lua/bucket.lua refills (sidecar/src/store/memory/settle.rs, `settle_now`, is this code in Rust). What was
-- charged is known from the decision's receipt (`<bucket key>:r:<receipt>`, lua/apply.lua), used
-- once; without one held, only a cost above the reservation the caller names is charged:
--   delta  = cost - charged (the receipt's, deleted)   or   max(0, cost - reserved)
--   tokens = min(capacity - leased, tokens + refill_per_sec * max(0, now - ts) / 1e6)
--   delta > 0 (cost above the reservation): tokens -= delta, past zero (a debt: the bucket then
--             rejects until refill repays it, retry_after = (debt + cost) / refill_per_sec),
--             down to -99 x capacity at most
--   delta < 0 (cost below it): tokens = min(capacity - leased, tokens - delta)
-- A batch may name a record key: a repeat of the batch within record_ttl_ms changes nothing.
--
-- KEYS[1]: the first bucket's key (routing). ARGV, decimal strings:
--   1 record key or ""   2 record_ttl_ms >= 1   3 the epoch marker's key or "" (--store-reset;
--   a bucket not written since the epoch is empty at it, a missing marker is made now)
--   4 N, then N x (bucket key, capacity > 0, refill_per_sec > 0, reserved >= 0, cost >= 0: whole
--   numbers, the receipt or "")
-- Reply: {1 applied | 0 a repeat, then per settlement the bucket's tokens after it, rounded down,
-- and the delta applied}
-- Stored bucket as lua/bucket.lua keeps it: doubles tokens, ts_us, exp_ms, then per lease id,
-- amount, expiry_us.

local MARGIN_MS = 1000 -- as lua/bucket.lua: a key outlives the time it is full again by 1 to 3 s
-- A debt is at most this many capacities: repaid within 100 fill times, so every expiry stays a
-- whole number Lua writes in full (below 1e14 ms) whatever cost a response reports.
local MAX_DEBT = 99
local ARGV, floor, ceil, min = ARGV, math.floor, math.ceil, math.min
local spack, sunpack, srep = struct.pack, struct.unpack, string.rep
local function fail(text) error({ err = 'ERR ' .. text }) end
local function num(i)
  local v = tonumber(ARGV[i])
  if not v or v - v ~= 0 then fail('usage: argument ' .. i .. ' must be a finite number') end
  return v
end

local record, record_ttl_ms, marker, n = ARGV[1], num(2), ARGV[3], num(4)
if record_ttl_ms < 1 or n < 0 or n % 1 ~= 0 or #ARGV ~= 4 + 6 * n then
  fail('usage: record_ttl_ms >= 1 and N settlements of 6 arguments')
end
for i = 1, n do
  local capacity, refill, reserved, cost = num(6 * i), num(6 * i + 1), num(6 * i + 2), num(6 * i + 3)
  if capacity <= 0 or refill <= 0 or reserved < 0 or reserved % 1 ~= 0 or cost < 0 or cost % 1 ~= 0 then
    fail('usage: settlement ' .. i .. ': capacity and refill_per_sec > 0, whole reserved and cost')
  end
end
if record ~= '' and redis.call('EXISTS', record) == 1 then return { 0 } end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = floor(now / 1000)
local epoch = marker ~= '' and tonumber(redis.call('GET', marker) or '')
if marker ~= '' and not epoch then -- made now, and stamped (lua/fence.lua), as lua/bucket.lua does
  epoch = now
  redis.call('SET', marker, t[1] .. string.rep('0', 6 - #t[2]) .. t[2])
  redis.call('SET', marker .. ':run', string.match(redis.call('INFO', 'server'), 'run_id:(%x+)'))
end
local states, reply = {}, { 1 }
for i = 1, n do
  local key, capacity, refill, reserved, cost, receipt =
    ARGV[6 * i - 1], num(6 * i), num(6 * i + 1), num(6 * i + 2), num(6 * i + 3), ARGV[6 * i + 4]
  local charged = receipt ~= '' and tonumber(redis.call('GET', key .. ':r:' .. receipt) or '')
  local delta = cost - reserved
  if charged then
    delta = cost - charged
    redis.call('DEL', key .. ':r:' .. receipt)
  elseif delta < 0 then
    delta = 0 -- nothing is given back that no receipt shows was charged
  end
  local s = states[key]
  if not s then -- decoded as lua/bucket.lua decodes: another value reads as a missing bucket
    local v = redis.call('GET', key)
    local nd = type(v) == 'string' and #v % 24 == 0 and #v / 8 or 0
    s = { tokens = epoch and 0 or capacity, ts = epoch or now, leases = {} }
    if nd >= 3 then
      local all = { sunpack('<' .. srep('d', nd), v) }
      s.tokens, s.ts = all[1], all[2]
      for j = 4, nd, 3 do
        if all[j + 2] > now then s.leases[#s.leases + 1] = { all[j], all[j + 1], all[j + 2] } end
      end
    end
    if epoch and s.ts < epoch then s.tokens, s.ts, s.leases = 0, epoch, {} end -- empty at the epoch
    if s.tokens ~= s.tokens then s.tokens = 0 end
    states[key] = s
  end
  local leased = 0 -- summed first, as lua/bucket.lua's ceiling()
  for j = 1, #s.leases do leased = leased + s.leases[j][2] end
  local top = capacity - leased
  local tokens = s.tokens + refill * (now > s.ts and now - s.ts or 0) / 1000000
  if tokens > top then tokens = top > 0 and top or min(tokens, 0) end
  tokens = tokens - delta
  if tokens < -MAX_DEBT * capacity then tokens = -MAX_DEBT * capacity end
  if delta < 0 and tokens > top then tokens = top > 0 and top or min(tokens, 0) end
  s.tokens, s.ts, s.capacity, s.refill = tokens, now, capacity, refill
  reply[2 * i], reply[2 * i + 1] = floor(tokens), delta
end
-- Each bucket written once; its key expires once it is full again and every lease expired.
for key, s in pairs(states) do
  local last, tail = now, ''
  for j = 1, #s.leases do
    local l = s.leases[j]
    last, tail = l[3] > last and l[3] or last, tail .. spack('<ddd', l[1], l[2], l[3])
  end
  local full_us = (s.capacity - s.tokens) / s.refill * 1000000
  local exp = now_ms + ceil((full_us + (last - now)) / 1000) + 2 * MARGIN_MS
  redis.call('SET', key, spack('<ddd', s.tokens, s.ts, exp) .. tail, 'PXAT', exp)
end
if record ~= '' then redis.call('SET', record, '1', 'PX', record_ttl_ms) end
return reply
