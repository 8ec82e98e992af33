-- share_read.lua: reads one region's share record of one regional rule together with the run_id
-- of the Redis process answering (INFO server), atomically: sidecars and the rebalancer compare it
-- with the record's own `run_id` (lua/share_record.lua) to tell a record written by this process
-- from one it restored (a snapshot, a replica promoted after a failover). docs/regions.md.
--
-- KEYS[1] the record. Reply: {HGETALL of the record (flat field, value list), run_id}.
local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') or ''
return { redis.call('HGETALL', KEYS[1]), run_id }
