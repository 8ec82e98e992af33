#!lua flags=allow-cross-slot-keys
-- slots.lua: concurrency slots (docs/concurrency.md). One sorted set per (rule, subject), its key
-- `<bucket key>:c` (the bucket's hash tag, so its Cluster slot); members are slot ids the gateway
-- chose, scores the slot's expiry in µs of this server's TIME. A slot expired (score <= now) is
-- free: a gateway that died stops renewing, and its slots come back slot_ttl_ms after its last
-- renewal at the latest (sidecar/src/store/memory/slots.rs is this code in Rust).
--   take:    all-or-none: each set drops its expired members, and a slot is admitted iff it is
--            already held (a retry) or ZCARD (plus this call's earlier takes of the set) < limit;
--            then each slot is held until now + ttl_ms
--   renew:   a slot still held (not expired) is held until now + ttl_ms; an expired one is dropped
--   release: ZREM
-- Each set expires with its latest slot (PEXPIREAT), so an abandoned set costs no memory.
-- Under an epoch (--store-reset empty: the store may have lost the slots of requests still
-- running), for unsure_ms after it no slot is taken and a renewal holds its slot again, held or
-- not: every request still running renews within the ttl it was last given, so a set is whole
-- again that long after the loss. unsure_ms is the rule's ttl, or a larger one a reload replaced
-- less than that larger ttl ago (requests given it may not have renewed since: the sidecar's
-- PolicyHandle::slot_unsure_ms; docs/concurrency.md). A missing marker is made now, as
-- lua/bucket.lua makes it.
--
-- KEYS[1]: the first set's key (routing). ARGV: 1 mode (take | renew | release), 2 the epoch
-- marker's key or "", 3 N, then N x (set key, slot id, ttl_ms >= 1, limit >= 1, unsure_ms >= 1),
-- decimal strings.
-- Reply: take {1} when every slot is held, else {0, i} (the first full set, nothing taken);
-- renew and release: per slot 1 (renewed, released) or 0 (expired or unknown).

local ARGV, ceil = ARGV, math.ceil
local function fail(text) error({ err = 'ERR ' .. text }) end
local mode, marker, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
if (mode ~= 'take' and mode ~= 'renew' and mode ~= 'release') or not n or n < 0 or n % 1 ~= 0
  or #ARGV ~= 3 + 5 * n then
  fail('usage: mode take|renew|release, marker and N slots of 5 arguments')
end
-- Slot i's field k: 1 its set's key, 2 its id, 3 its ttl_ms, 4 its set's limit, 5 unsure_ms.
local function field(i, k) return ARGV[5 * i + k - 2] end
local function whole(x) x = tonumber(x) return x and x >= 1 and x % 1 == 0 end
for i = 1, n do
  if not (whole(field(i, 3)) and whole(field(i, 4)) and whole(field(i, 5))) then
    fail('usage: slot ' .. i .. ': ttl_ms, limit and unsure_ms must be whole numbers >= 1')
  end
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local epoch = marker ~= '' and tonumber(redis.call('GET', marker) or '')
if marker ~= '' and not epoch then -- made now, and stamped (lua/fence.lua), as lua/bucket.lua does
  epoch = now
  redis.call('SET', marker, t[1] .. string.rep('0', 6 - #t[2]) .. t[2])
  redis.call('SET', marker .. ':run', string.match(redis.call('INFO', 'server'), 'run_id:(%x+)'))
end
-- Whether slot i's set is within unsure_ms of the epoch (its requests still running unknown).
local function unsure(i) return epoch and now < epoch + tonumber(field(i, 5)) * 1000 end
local function us(x) return string.format('%.0f', x) end -- all digits (tostring keeps 14)
local function hold(key, id, ttl, flag)
  if flag then redis.call('ZADD', key, flag, us(now + ttl * 1000), id)
  else redis.call('ZADD', key, us(now + ttl * 1000), id) end
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', key, us(ceil(tonumber(last[2]) / 1000)))
end

local reply = {}
if mode == 'take' then
  local pending = {}
  for i = 1, n do
    local key, id, limit = field(i, 1), field(i, 2), tonumber(field(i, 4))
    redis.call('ZREMRANGEBYSCORE', key, '-inf', us(now))
    if not redis.call('ZSCORE', key, id) then
      local held = redis.call('ZCARD', key) + (pending[key] or 0)
      if held >= limit or unsure(i) then return { 0, i } end
      pending[key] = (pending[key] or 0) + 1
    end
  end
  for i = 1, n do hold(field(i, 1), field(i, 2), tonumber(field(i, 3))) end
  return { 1 }
end
for i = 1, n do
  local key, id = field(i, 1), field(i, 2)
  local score = tonumber(redis.call('ZSCORE', key, id) or '')
  reply[i] = 0
  if mode == 'release' then
    reply[i] = redis.call('ZREM', key, id)
    if score and score <= now then reply[i] = 0 end -- it had expired: not held any more
  elseif (score and score > now) or unsure(i) then -- held, or maybe lost with the store's state
    hold(key, id, tonumber(field(i, 3)))
    reply[i] = 1
  elseif score then
    redis.call('ZREM', key, id)
  end
end
return reply
