//! One run of a bucket script on the memory store: the bucket function of `lua/bucket.lua`,
//! leases and records.

use super::*;

/// One run of a script (one store call): the store, the server's clock, the bucket states.
pub(super) struct ScriptRun<'a> {
    pub(super) inner: &'a mut Inner,
    pub(super) now: f64,
    pub(super) states: HashMap<Arc<str>, State>,
    /// `--store-reset empty`: the store's epoch (the marker's time, made now when missing); a
    /// missing bucket was empty then.
    pub(super) epoch: Option<f64>,
}

impl ScriptRun<'_> {
    /// The lease ceiling: the capacity less what the bucket's unexpired leases hold.
    pub(super) fn ceiling(s: &State, capacity: f64) -> f64 {
        lease_ceiling(capacity, s.leases.iter().map(|l| l.amount))
    }

    /// The bucket function: the bucket's state, its tokens now (refilled, capped by the lease
    /// ceiling), and the capacity and refill it is taken under: a regional limit's scaled by the
    /// smallest share in force since the bucket's last decision, looking back at most its fill
    /// time, widened by [`SHARE_MARGIN_MS`] (`docs/regions.md`).
    pub(super) fn bucket(
        &mut self,
        key: &Arc<str>,
        limit: &BucketLimits,
    ) -> (&mut State, f64, f64, f64) {
        let now = self.now;
        let stored = self.inner.buckets.get(key);
        let s = self.states.entry(key.clone()).or_insert_with(|| {
            // Not written since the epoch (missing, or last written before it): empty then.
            let stale = stored.is_some_and(|b| self.epoch.is_some_and(|e| b.ts_us < e));
            let (tokens, ts_us, leases, since_us) = match stored.filter(|_| !stale) {
                Some(b) => (
                    b.tokens,
                    b.ts_us,
                    b.leases
                        .iter()
                        .filter(|l| l.expiry_us > now)
                        .cloned()
                        .collect(),
                    Some(b.ts_us),
                ),
                None => match self.epoch {
                    Some(epoch) => (0.0, epoch, Vec::new(), None),
                    None => (limit.capacity as f64, now, Vec::new(), None),
                },
            };
            State {
                // Below 0: a debt (a settled cost above its reservation, docs/costs.md).
                tokens: if tokens.is_nan() { 0.0 } else { tokens },
                ts_us,
                leases,
                since_us,
                future: ts_us > now,
                dirty: false,
                avail: 0.0,
                avail_req: 0,
            }
        });
        let (mut capacity, mut refill_per_sec) = (limit.capacity as f64, limit.refill_per_sec);
        if let Some(history) = &limit.share {
            let changes: Vec<(f64, u32)> = history
                .changes()
                .map(|(t, share)| (t as f64, share.ppm()))
                .collect();
            let horizon = now - horizon_us(limit);
            let from_ms =
                s.since_us.unwrap_or(horizon).max(horizon) / 1000.0 - SHARE_MARGIN_MS as f64;
            let mut m = changes.last().map_or(0, |c| c.1);
            for pair in changes.windows(2) {
                if pair[1].0 > from_ms && pair[0].1 < m {
                    m = pair[0].1;
                }
            }
            (capacity, refill_per_sec) = (scaled(capacity, m), scaled(refill_per_sec, m));
        }
        let tokens = refill(
            s.tokens,
            refill_per_sec,
            now - s.ts_us,
            Self::ceiling(s, capacity),
        );
        (s, tokens, capacity, refill_per_sec)
    }

    /// Writes each dirty bucket once (the script also sets its key's expiry: a missing bucket is
    /// a full one, so the model keeps every bucket instead).
    pub(super) fn finish(self) {
        for (key, s) in self.states.into_iter().filter(|(_, s)| s.dirty) {
            let (tokens, ts_us, leases) = (s.tokens, s.ts_us, s.leases);
            self.inner.buckets.insert(
                key,
                Stored {
                    tokens,
                    ts_us,
                    leases,
                },
            );
        }
    }

    /// Puts tokens back as of now, up to the lease ceiling; what the bucket then holds.
    pub(super) fn give(s: &mut State, tokens: f64, capacity: f64, now: f64) -> f64 {
        s.tokens = tokens.min(Self::ceiling(s, capacity));
        s.ts_us = now;
        s.dirty = true;
        s.tokens
    }

    /// Removes lease `id` from the bucket: the lease, or `None` when it holds none of that id.
    pub(super) fn remove_lease(s: &mut State, id: f64) -> Option<Lease> {
        let i = s.leases.iter().position(|l| l.id == id)?;
        s.dirty = true;
        Some(s.leases.remove(i))
    }

    /// The record of `group`; `None` for a record of another shape (an attempt id reused for
    /// other requests): the group is then decided as new.
    pub(super) fn unpack_record(&self, group: &Group) -> Option<Vec<Recorded>> {
        let (recorded, _) = self.inner.records.get(group.record.as_ref()?)?;
        let same_shape = recorded.len() == group.requests.len()
            && recorded
                .iter()
                .zip(&group.requests)
                .all(|(r, q)| r.decisions.len() == q.len());
        same_shape.then(|| recorded.clone())
    }
}
