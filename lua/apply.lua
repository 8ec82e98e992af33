-- apply.lua, after bucket.lua: decides the groups in order, each request all-or-nothing, seeing what
-- the ones before left; a group whose record exists is a repeat: replayed, not charged. A charged
-- decision with a receipt id leaves `<bucket key>:r:<id>` = its cost for receipt_ttl_ms (docs/costs.md).
-- Reply:
-- doubles (little-endian), per request: status (0 rejected, 1 charged, 10 + the recorded one), then
-- per decision: allowed, remaining, retry_after_ms, reset_ms, reason (bucket.lua's codes), leased.
if mode ~= 'apply' or q ~= #nums + 1 then error({ err = 'ERR usage: apply mode, all numbers read' }) end
local written, n = {}, 0 -- written: this call's records (a repeat in it sees them)
local reply = nreq + 6 * ndec <= 4000 and { unpack(ARGV, 1, nreq + 6 * ndec) } or {} -- presized
for g = 1, ngroups do
  local record = ARGV[2 + nkeys + g]
  local recorded = record ~= '' and unpack_record(written[record] or records[g] or nil, g)
  -- flat: the record to write, i: a request's place in it; charged: whether the group charged
  local flat, i, charged = not recorded and record ~= '' and {}, 1, false
  for r = gs[g - 1] + 1, gs[g] do
    local d1, d2, at = rq[r - 1] + 1, rq[r], n + 1 -- at: the request's status in the reply
    n = at + 6 * (d2 - d1 + 1)
    if recorded then
      reply[at] = 10 + recorded[i]
      for d = 0, d2 - d1 do
        for k = 1, 6 do reply[at + 6 * d + k] = recorded[i + 1 + 8 * d + k] end
      end
    else
      -- Pass 1: does every non-shadow decision admit, each seeing what the ones before would take?
      local admit = true
      for d = d1, d2 do
        local x, o = decs[d], at + 6 * (d - d1) -- reply[o + k]: the decision's figure k
        local s, tokens, _, refill = bucket(x[BUCKET], x[LIMIT])
        tokens = s.avail or tokens
        reply[o + ALLOWED], reply[o + RETRY_AFTER_MS], reply[o + REASON] = 0, 0, OK
        if x[COST] > x[LIMIT].capacity_now then
          reply[o + REASON] = COST_EXCEEDS_CAPACITY
        elseif tokens < x[COST] then
          reply[o + RETRY_AFTER_MS], reply[o + REASON] = wait_ms(x[COST] - tokens, refill), INSUFFICIENT
        else
          reply[o + ALLOWED], tokens = 1, tokens - x[COST]
        end
        s.avail, admit = tokens, admit and (reply[o + ALLOWED] == 1 or x[SHADOW] == 1)
      end
      reply[at], charged = admit and 1 or 0, charged or admit
      if flat then flat[i], flat[i + 1] = reply[at], d2 - d1 + 1 end
      -- Pass 2: charge (and grant leases) only if the request is admitted.
      for d = d1, d2 do
        local x, o, grant, paid = decs[d], at + 6 * (d - d1), 0, 0
        local s, tokens, capacity, refill = bucket(x[BUCKET], x[LIMIT])
        s.avail = nil
        if admit and reply[o + ALLOWED] == 1 then
          tokens, paid = tokens - x[COST], x[COST]
          if x[RECEIPT] > 0 then -- a receipt of the charge: what a settlement may give back, once
            redis.call('SET', ARGV[2 + x[BUCKET]] .. ':r:' .. string.format('%.0f', x[RECEIPT]), x[COST], 'PX',
              receipt_ttl_ms)
          end
          if x[LEASE_WANT] > 0 and (s.leases and #s.leases or 0) < MAX_LEASES then
            local cap = x[SHARE_CAPPED] == 0 and x[LEASE_WANT] or floor(max_share * capacity) -- store/mod.rs GrantCap
            grant = math.max(0, min(x[LEASE_WANT], cap, floor(tokens)))
          end
          if grant > 0 then
            remove_lease(s, x[LEASE_ID]) -- a new lease under an id already held replaces it
            s.leases = s.leases or {}
            s.leases[#s.leases + 1] = { id = x[LEASE_ID], amount = grant, expiry = now + x[LEASE_TTL_MS] * 1000 }
            tokens, paid = tokens - grant, paid + grant
          end
        end
        if paid > 0 or s.ts > now then s.tokens, s.ts, s.dirty = tokens, now, true end
        reply[o + REMAINING], reply[o + RESET_MS], reply[o + LEASED] = int(tokens), wait_ms(capacity - tokens, refill), grant
        if flat then -- the record keeps the reply's six figures, the tokens paid and the lease id
          local f = i + 8 * (d - d1) + 1
          for k = 1, 6 do flat[f + k] = reply[o + k] end
          flat[f + PAID], flat[f + PAID_LEASE_ID] = paid, paid > 0 and x[LEASE_ID] or 0
        end
      end
    end
    i = i + 2 + 8 * (d2 - d1 + 1)
  end
  if flat and charged then
    written[record] = spack('<' .. srep('d', #flat), unpack(flat))
    redis.call('SET', record, written[record], 'PX', record_ttl_ms)
  end
end
finish()
local packed = '' -- in runs of at most 1000 values (unpack puts a run on Lua's stack)
for k = 1, n, 1000 do
  packed = packed .. spack('<' .. srep('d', min(1000, n - k + 1)), unpack(reply, k, min(k + 999, n)))
end
return packed
