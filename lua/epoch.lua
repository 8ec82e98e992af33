-- epoch.lua: the store's epoch marker KEYS[1] (docs/bucket.md, a store that lost its state): the
-- server's time when it was created, "<seconds><microseconds, 6 digits>", created now when missing.
-- Reply: { value, 1 if created now else 0 }.
local v = redis.call('GET', KEYS[1])
if v then return { v, 0 } end
local t = redis.call('TIME')
v = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
redis.call('SET', KEYS[1], v)
return { v, 1 }
