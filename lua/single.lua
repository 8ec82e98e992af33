#!lua flags=allow-cross-slot-keys
-- single.lua: a call whose requests are each one decision on a bucket of its own, without a lease
-- ask, a regional share or a record (a fleet's quiet keys, alone or batched). The same bucket as
-- bucket.lua + apply.lua (docs/bucket.md): its state, rules and reply, in the few steps this case
-- needs; sidecar/src/store/redis/script.rs picks it. KEYS[1]: the first bucket. ARGV: the numbers (per
-- request: capacity I8, refill_per_sec d, cost I8, shadow B); the epoch marker's key or ""; the
-- other buckets, in order. Reply: doubles, per request: status, allowed, remaining,
-- retry_after_ms, reset_ms, reason, leased (0).
local OK, INSUFFICIENT, COST_EXCEEDS_CAPACITY, MAX_INT, MARGIN_MS = 0, 1, 2, 2 ^ 53, 1000
local floor, ceil, spack, sunpack = math.floor, math.ceil, struct.pack, struct.unpack
local nums, marker = ARGV[1], ARGV[2]
local n = #nums / 25
if n < 1 or n ~= floor(n) or #ARGV ~= n + 1 then
  error({ err = 'ERR usage: numbers (25 bytes a request), marker, the other buckets' })
end
local function check(capacity, refill, cost) -- refuses numbers that are not a request's
  if capacity < 1 or cost < 1 or not (refill > 0 and refill < 1 / 0) then
    error({ err = 'ERR usage: capacity, refill_per_sec and cost > 0 and finite' })
  end
end
for q = 26, #nums, 25 do check(sunpack('<I8dI8', nums, q)) end -- before anything is written
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local keys, got = n > 1 and { KEYS[1], unpack(ARGV, 3) } -- and the marker
if keys then
  if marker ~= '' then keys[n + 1] = marker end
  got = redis.call('MGET', unpack(keys))
else
  got = redis.call('MGET', KEYS[1]) -- the marker apart: on a Cluster it is the node's, in another slot
  if marker ~= '' then got[2] = redis.call('GET', marker) end
end
local epoch = marker ~= '' and tonumber(got[n + 1] or '')
local new_epoch = marker ~= '' and not epoch
epoch = epoch or new_epoch and now
local function wait_ms(x, refill) -- ms the refill takes to add x tokens, rounded up less float noise
  x = ceil(x / refill * 1000 - 1e-6)
  return (x ~= x or x <= 0) and 0 or x >= MAX_INT and MAX_INT or x
end
local reply = n > 1 and {} -- of a lone decision: its figures
for i = 1, n do
  local capacity, refill, cost, shadow = sunpack('<I8dI8B', nums, 25 * i - 24)
  if i == 1 then check(capacity, refill, cost) end
  local v = got[i]
  local m = v and #v % 24 == 0 and #v or 0 -- bytes; another value reads as missing
  local tokens, ts, exp = epoch and 0 or capacity, epoch or now, 0
  if m > 0 then tokens, ts, exp = sunpack('<ddd', v) end
  if epoch and ts < epoch then tokens, ts, exp, m = 0, epoch, 0, 0 end -- not written since: empty then
  local leased, last, tail = 0, now, '' -- the unexpired leases: their tokens, last expiry, bytes
  for j = 25, m, 24 do
    local id, amount, expiry = sunpack('<ddd', v, j)
    if expiry > now then
      leased, tail = leased + amount, tail .. spack('<ddd', id, amount, expiry)
      if expiry > last then last = expiry end
    end
  end
  if tokens ~= tokens then tokens = 0 end -- below 0: a debt (docs/costs.md)
  tokens = tokens + refill * (now > ts and now - ts or 0) / 1000000
  local top = capacity - leased
  if tokens > top then tokens = top > 0 and top or math.min(tokens, 0) end -- a debt stays one
  local allowed, retry, reason = 0, 0, OK
  if cost > capacity then
    reason = COST_EXCEEDS_CAPACITY
  elseif tokens < cost then
    retry, reason = wait_ms(cost - tokens, refill), INSUFFICIENT
  else
    allowed, tokens = 1, tokens - cost
  end
  if allowed == 1 or ts > now then -- written as bucket.lua's finish() writes it
    local full_us = (capacity - tokens) / refill * 1000000
    local need = floor(now / 1000) + ceil((full_us + (last - now)) / 1000) + MARGIN_MS
    local keep = exp >= need and exp <= need + 2 * MARGIN_MS
    local value = spack('<ddd', tokens, now, keep and exp or need + MARGIN_MS) .. tail
    if keep then redis.call('SET', keys and keys[i] or KEYS[1], value, 'KEEPTTL')
    else redis.call('SET', keys and keys[i] or KEYS[1], value, 'PXAT', need + MARGIN_MS) end
  end
  local remaining = tokens >= MAX_INT and MAX_INT or tokens > 0 and floor(tokens) or 0
  local figures = spack('<ddddddd', (allowed == 1 or shadow == 1) and 1 or 0, allowed, remaining,
    retry, wait_ms(capacity - tokens, refill), reason, 0)
  if reply then reply[i] = figures else reply = figures end
end
if new_epoch then -- the marker, and the server it was made on (lua/fence.lua reads both)
  redis.call('SET', marker, t[1] .. string.rep('0', 6 - #t[2]) .. t[2])
  redis.call('SET', marker .. ':run', string.match(redis.call('INFO', 'server'), 'run_id:(%x+)'))
end
return n > 1 and table.concat(reply) or reply
