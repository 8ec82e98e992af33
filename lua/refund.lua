-- refund.lua, after bucket.lua: gives back what the listed requests of each group charged, by the
-- group's record (docs/bucket.md, records): costs and lease grants return to their buckets (a
-- lease's part only while it is held; the lease is removed), and the record marks the requests
-- refunded (2), so a second refund gives nothing. Reply: per group 1 when it refunded, else 0.
if mode ~= 'refund' then error({ err = 'ERR usage: mode must be refund for this script' }) end
local refunds, reply = {}, {} -- refunds[g]: the set of group g's requests to refund
for g = 1, ngroups do
  local k
  k, q = sunpack('<I4', nums, q)
  refunds[g] = {}
  for _ = 1, k do
    local r
    r, q = sunpack('<I4', nums, q)
    refunds[g][r] = true
  end
end
if q ~= #nums + 1 then error({ err = 'ERR usage: refund mode, all numbers read' }) end
for g = 1, ngroups do
  local record, r1 = ARGV[2 + nkeys + g], gs[g - 1] + 1
  local flat, i = record ~= '' and unpack_record(records[g], g), 1 -- i: a request's status
  reply[g] = 0
  for r = r1, flat and gs[g] or 0 do
    local d1, d2 = rq[r - 1] + 1, rq[r]
    if refunds[g][r - r1 + 1] and flat[i] == 1 then
      for d = d1, d2 do
        local x = i + 1 + 8 * (d - d1) -- flat[x + k]: the decision's value k
        local charged = flat[x + PAID]
        if charged > 0 then
          local s, tokens, capacity, refill, leased = bucket(decs[d][BUCKET], decs[d][LIMIT])
          -- A returned or expired lease gave its tokens back, or lost them, already.
          local amount = flat[x + LEASED] > 0 and remove_lease(s, flat[x + PAID_LEASE_ID]) or 0
          if flat[x + LEASED] > 0 and amount == 0 then charged = charged - flat[x + LEASED] end
          tokens = min(tokens + charged, capacity - (leased - amount)) -- as returns do
          s.tokens, s.ts, s.dirty = tokens, now, true
          flat[x + ALLOWED], flat[x + REMAINING], flat[x + LEASED] = 0, int(tokens), 0
          flat[x + RESET_MS] = wait_ms(capacity - tokens, refill)
        end
      end
      flat[i], reply[g] = 2, 1
    end
    i = i + 2 + 8 * (d2 - d1 + 1)
  end
  if reply[g] == 1 then
    flat[i] = nil -- struct.unpack's trailing position
    redis.call('SET', record, spack('<' .. srep('d', #flat), unpack(flat)), 'KEEPTTL')
  end
end
finish()
return reply
