-- share_record.lua: writes one region's share record of one regional rule (docs/regions.md). It
-- is the rebalancer's only write; sidecars only read the record (HGETALL). Atomic: the version
-- check, this Redis's clock and the history change together.
--
-- The record, a hash:
--   version    only grows: a write is applied only when its version is greater than the stored
--              one, so a delayed or stale writer cannot undo a newer plan, and a write sent twice
--              is applied once
--   share_ppm  the share in force, in parts per million of the rule's global budget
--   lease_ms   how long a sidecar may apply a share it read (it re-reads every lease_ms / 4, and
--              answers "unavailable" for the rule once its last read is lease_ms old)
--   history    the share's changes, "<from_ms>:<ppm>" joined by ",", in time order, the last one
--              in force now; from_ms on THIS Redis's clock (TIME), the clock its buckets use; 0 is
--              "since always" (the share in force before the record existed)
--   run_id     the run_id of the Redis process that applied the write (INFO server): a reader
--              that finds another run_id knows this Redis restarted (or failed over) since, so the
--              record may be older than the last one written (a restored snapshot, a lagging
--              replica) and is not trusted until the rebalancer writes it again
--
-- KEYS[1] the record. ARGV (decimal): 1 version, 2 share_ppm, 3 lease_ms, 4 keep_ms,
--   5 initial_ppm, 6 max_changes
--   keep_ms      how far back the history must reach (the rule's longest fill time, plus a lease
--                and the clock margin): changes superseded before now - keep_ms are dropped, the
--                one in force then is kept
--   initial_ppm  the share in force before the record existed (the policy's): written as the
--                change at 0 when the record is created, so buckets charged before the first write
--                still see it
--   max_changes  the most changes kept (>= 2); beyond, the two oldest are merged into one at the
--                older's time with the smaller share: a share is never recorded larger than it was
-- Reply: {1, version} when written, {0, stored version} when refused.

local function arg(i, low, high)
  local v = tonumber(ARGV[i])
  if not v or v ~= v or v < low or v > high or v ~= math.floor(v) then
    error('ERR usage: share_record argument ' .. i .. ' must be a whole number in [' .. low .. ', ' .. high .. ']')
  end
  return v
end

local MAX = 9007199254740992
local version = arg(1, 1, MAX)
local share = arg(2, 0, 1000000)
local lease_ms = arg(3, 1, MAX)
local keep_ms = arg(4, 0, MAX)
local initial = arg(5, 0, 1000000)
local max_changes = arg(6, 2, 1000)

local stored = redis.call('HMGET', KEYS[1], 'version', 'history')
local stored_version = tonumber(stored[1]) or 0
if version <= stored_version then return { 0, stored_version } end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local h = {}
if stored[2] then
  for from_ms, ppm in string.gmatch(stored[2], '(%d+):(%d+)') do
    h[#h + 1] = { tonumber(from_ms), tonumber(ppm) }
  end
end
if #h == 0 then h[1] = { 0, initial } end

local last = h[#h]
if share ~= last[2] then
  -- A clock that went back stamps the change at the last one's time, never before it.
  local at = now_ms
  if at < last[1] then at = last[1] end
  h[#h + 1] = { at, share }
end

local cutoff = now_ms - keep_ms
while #h > 1 and h[2][1] <= cutoff do table.remove(h, 1) end
while #h > max_changes do
  h[2] = { h[1][1], math.min(h[1][2], h[2][2]) }
  table.remove(h, 1)
end

local parts = {}
for i, c in ipairs(h) do parts[i] = string.format('%.0f:%.0f', c[1], c[2]) end
local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') or ''
redis.call('HSET', KEYS[1], 'version', string.format('%.0f', version),
  'share_ppm', string.format('%.0f', share), 'lease_ms', string.format('%.0f', lease_ms),
  'history', table.concat(parts, ','), 'run_id', run_id)
return { 1, version }
