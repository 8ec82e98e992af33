//! Settlements on the memory store, as `lua/settle.lua`.

use super::*;

/// One node: a call is one group, recorded under the caller's attempt id (keyed by its first
/// bucket, as on Redis), decided at once.
impl MemoryStore {
    /// Applies settlements as one node's part of a batch, as `lua/settle.lua`: each bucket
    /// refilled as the bucket function refills it (under the share in force now), then charged
    /// the delta, past zero, or given it back, up to the lease ceiling. With a `record` that
    /// exists, a repeat: nothing changes (`None`).
    pub fn settle_now(
        &self,
        record: Option<&str>,
        settlements: &[Settlement],
    ) -> Option<Vec<Applied>> {
        let now = self.now_us.load(Ordering::SeqCst) as f64;
        let now_ms = (now / 1000.0).floor() as u64;
        let mut inner = self.inner.lock().expect("not poisoned");
        inner.settle_records.retain(|_, exp| *exp > now_ms);
        if record.is_some_and(|k| inner.settle_records.contains_key(k)) {
            return None;
        }
        let epoch = self.epoch(&mut inner, now);
        inner.receipts.retain(|_, (_, exp)| *exp > now_ms);
        let mut applied = Vec::with_capacity(settlements.len());
        for st in settlements {
            // What was charged, by the receipt (used once); without one, no give-back.
            let charged = st
                .receipt
                .and_then(|r| inner.receipts.remove(&receipt_key(&st.key, r)));
            let delta = match charged {
                Some((charged, _)) => st.cost as i64 - charged as i64,
                None => (st.cost as i64 - st.reserved as i64).max(0),
            };
            let (capacity, refill_per_sec) = st.bucket.in_force();
            let capacity = capacity as f64;
            let b = inner
                .buckets
                .entry(st.key.clone())
                .or_insert_with(|| Stored {
                    tokens: if epoch.is_some() { 0.0 } else { capacity },
                    ts_us: epoch.unwrap_or(now),
                    leases: Vec::new(),
                });
            if let Some(e) = epoch.filter(|e| b.ts_us < *e) {
                // Not written since the epoch: empty then (as a missing bucket).
                (b.tokens, b.ts_us, b.leases) = (0.0, e, Vec::new());
            }
            b.leases.retain(|l| l.expiry_us > now);
            if b.tokens.is_nan() {
                b.tokens = 0.0;
            }
            let top = lease_ceiling(capacity, b.leases.iter().map(|l| l.amount));
            let mut tokens = refill(b.tokens, refill_per_sec, now - b.ts_us, top);
            tokens -= delta as f64;
            if tokens < -MAX_DEBT * capacity {
                tokens = -MAX_DEBT * capacity;
            }
            if delta < 0 {
                tokens = refill(tokens, refill_per_sec, 0.0, top);
            }
            (b.tokens, b.ts_us) = (tokens, now);
            applied.push(Applied {
                tokens: tokens.floor() as i64,
                delta,
            });
        }
        if let Some(k) = record {
            inner
                .settle_records
                .insert(k.to_string(), now_ms + self.record_ttl_ms);
        }
        Some(applied)
    }
}
