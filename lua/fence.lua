-- fence.lua: the store's epoch after a restart or a failover (docs/bucket.md, a store that lost
-- its state). A Redis process empties its script cache when it starts, so the sidecar runs this
-- before it loads the bucket scripts into a node again (after NOSCRIPT, or a failed SCRIPT EXISTS),
-- and every second: no bucket script runs on a node whose state may be older than what the
-- scripts last saw before the epoch says so.
--   the marker missing:               made now, stamped with this server's run_id
--   stamped by another server:        made now (a restart, from a snapshot or an append-only file,
--                                     or a replica promoted: what it holds may be older)
--   not stamped (made before stamps): stamped, the epoch kept
-- KEYS[1]: the marker (`<prefix>epoch`, on a Cluster one per primary), KEYS[2]: its stamp
-- (`<marker>:run`). Reply: {epoch, 0 kept | 1 made | 2 made anew over another server's}.
local run = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
local epoch, stamp = redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2])
if epoch and (stamp == run or not stamp) then
  if not stamp then redis.call('SET', KEYS[2], run) end
  return { epoch, 0 }
end
local t = redis.call('TIME')
local now = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
redis.call('SET', KEYS[1], now)
redis.call('SET', KEYS[2], run)
return { now, epoch and 2 or 1 }
