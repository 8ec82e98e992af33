//! The bucket of `lua/bucket.lua`, in Rust, in memory: the reference model the Lua scripts are
//! tested against (the same work gives the same answers, see `sidecar/tests/differential.rs`),
//! and the store behind the decision logic's unit tests. Time is injected, so tests drive it.
//!
//! It mirrors the scripts function for function, in their order and their floating-point order:
//! [`ScriptRun::bucket`] (the script sums the lease ceiling, [`ScriptRun::ceiling`], inline),
//! [`ScriptRun::finish`], [`ScriptRun::give`] and [`ScriptRun::remove_lease`], [`ScriptRun::unpack_record`] and the
//! returns as `lua/bucket.lua` has them, then [`MemoryStore::run`] as `lua/apply.lua` and
//! [`MemoryStore::refund_now`] as `lua/refund.lua`. The script's returns and refund give tokens
//! back inline, up to `capacity - (leased - amount)` (the ceiling the bucket function found, less
//! the removed lease): the same figure as [`ScriptRun::give`]'s, since lease amounts are whole numbers.
//! The formulas themselves are `ratelimit_bucket`'s; what each rule is for: `docs/bucket.md`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ratelimit_bucket::{lease_ceiling, refill, scaled, wait_ms, whole};
use ratelimit_wire::Reason;

use super::{
    Applied, BucketLimits, BucketOutcome, BucketStore, Decided, GrantCap, Group, Readiness,
    RequestOutcome, SettleBatch, Settled, Settlement, ShareStore, Slot, SlotUpdate, SlotsTaken,
    Status, StoreError, StoreReset, Work, SHARE_MARGIN_MS,
};
use crate::keys::{record_key, settle_record_key};
use crate::regional::record;

/// Lease entries one bucket holds (as the script).
pub const MAX_LEASES: usize = 64;

/// The deepest debt, in capacities (as `lua/settle.lua`): repaid within 100 fill times.
pub const MAX_DEBT: f64 = 99.0;

#[derive(Debug, Clone, PartialEq)]
struct Lease {
    id: f64,
    amount: f64,
    expiry_us: f64,
}

/// A bucket as stored: its tokens at `ts_us`, and its leases.
#[derive(Debug, Clone, PartialEq)]
struct Stored {
    tokens: f64,
    ts_us: f64,
    leases: Vec<Lease>,
}

/// A bucket's state in one call (the script's `states[b]`): decoded once, written at the end
/// when dirty.
#[derive(Debug, Clone, PartialEq)]
struct State {
    tokens: f64,
    ts_us: f64,
    /// The unexpired leases.
    leases: Vec<Lease>,
    /// The stored ts when the call began (`None`: the bucket was missing): where the look-back
    /// of a regional share starts.
    since_us: Option<f64>,
    /// The stored ts was in the future: even a rejection re-anchors it (the script asks
    /// `s.ts > now`, which is the same while the ts is not re-anchored).
    future: bool,
    dirty: bool,
    /// What the decisions of request `avail_req` (numbered across the call from 1) decided so
    /// far would leave (the script keeps `avail` alone and clears it in pass 2, which every
    /// bucket of pass 1 reaches: the same answers).
    avail: f64,
    avail_req: usize,
}

/// One request as a record keeps it: status (0 rejected, 1 charged, 2 refunded) and per decision
/// allowed, remaining, retry_after_ms, reset_ms, reason, leased, charged tokens, lease id.
#[derive(Debug, Clone, PartialEq)]
struct Recorded {
    status: f64,
    decisions: Vec<[f64; 8]>,
}

#[derive(Debug, Default)]
struct Inner {
    buckets: HashMap<Arc<str>, Stored>,
    records: HashMap<String, (Vec<Recorded>, u64)>,
    /// Hashes (regional share records, demand counters): key -> fields.
    hashes: HashMap<String, Vec<(String, String)>>,
    /// The store's epoch marker (`--store-reset empty`).
    epoch_us: Option<f64>,
    /// The run_id a share record's read answers with, as a Redis process's (empty until set).
    run_id: String,
    /// Settle batches' records: key -> expiry (ms).
    settle_records: HashMap<String, u64>,
    /// Receipts of charges (`<bucket key>:r:<id>`): key -> (the cost charged, expiry in ms).
    receipts: HashMap<String, (u64, u64)>,
    /// Concurrency slots (`lua/slots.lua`): set key -> slot id -> expiry (µs).
    slot_sets: HashMap<Arc<str>, HashMap<Arc<str>, f64>>,
}

/// The in-memory store. The clock is Unix microseconds, settable by tests.
pub struct MemoryStore {
    inner: Mutex<Inner>,
    now_us: AtomicU64,
    max_share: f64,
    record_ttl_ms: u64,
    /// How long a receipt is kept (`--receipt-ttl-ms`).
    receipt_ttl_ms: u64,
    /// Fails every call with this error while set (outage tests).
    pub fail: Mutex<Option<StoreError>>,
    /// What a bucket missing after a loss of state starts with (`--store-reset`).
    store_reset: StoreReset,
}

/// One run of a script (one store call): the store, the server's clock, the bucket states.
struct ScriptRun<'a> {
    inner: &'a mut Inner,
    now: f64,
    states: HashMap<Arc<str>, State>,
    /// `--store-reset empty`: the store's epoch (the marker's time, made now when missing); a
    /// missing bucket was empty then.
    epoch: Option<f64>,
}

impl ScriptRun<'_> {
    /// The lease ceiling: the capacity less what the bucket's unexpired leases hold.
    fn ceiling(s: &State, capacity: f64) -> f64 {
        lease_ceiling(capacity, s.leases.iter().map(|l| l.amount))
    }

    /// The bucket function: the bucket's state, its tokens now (refilled, capped by the lease
    /// ceiling), and the capacity and refill it is taken under: a regional limit's scaled by the
    /// smallest share in force since the bucket's last decision, looking back at most its fill
    /// time, widened by [`SHARE_MARGIN_MS`] (`docs/regions.md`).
    fn bucket(&mut self, key: &Arc<str>, limit: &BucketLimits) -> (&mut State, f64, f64, f64) {
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
    fn finish(self) {
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
    fn give(s: &mut State, tokens: f64, capacity: f64, now: f64) -> f64 {
        s.tokens = tokens.min(Self::ceiling(s, capacity));
        s.ts_us = now;
        s.dirty = true;
        s.tokens
    }

    /// Removes lease `id` from the bucket: the lease, or `None` when it holds none of that id.
    fn remove_lease(s: &mut State, id: f64) -> Option<Lease> {
        let i = s.leases.iter().position(|l| l.id == id)?;
        s.dirty = true;
        Some(s.leases.remove(i))
    }

    /// The record of `group`; `None` for a record of another shape (an attempt id reused for
    /// other requests): the group is then decided as new.
    fn unpack_record(&self, group: &Group) -> Option<Vec<Recorded>> {
        let (recorded, _) = self.inner.records.get(group.record.as_ref()?)?;
        let same_shape = recorded.len() == group.requests.len()
            && recorded
                .iter()
                .zip(&group.requests)
                .all(|(r, q)| r.decisions.len() == q.len());
        same_shape.then(|| recorded.clone())
    }
}

/// The key a receipt is kept under: `<bucket key>:r:<id>` (`lua/apply.lua`).
fn receipt_key(bucket_key: &str, id: u64) -> String {
    format!("{bucket_key}:r:{id}")
}

/// The fill time of a limit, in microseconds: how far a regional share looks back.
fn horizon_us(b: &BucketLimits) -> f64 {
    b.capacity as f64 / b.refill_per_sec * 1_000_000.0
}

impl MemoryStore {
    pub fn new(now_us: u64, max_share: f64, record_ttl_ms: u64) -> Self {
        MemoryStore {
            inner: Mutex::new(Inner::default()),
            now_us: AtomicU64::new(now_us),
            max_share,
            record_ttl_ms,
            receipt_ttl_ms: 3_600_000,
            fail: Mutex::new(None),
            store_reset: StoreReset::Full,
        }
    }

    /// The same store under `--store-reset` `reset`.
    pub fn with_store_reset(mut self, reset: StoreReset) -> Self {
        self.store_reset = reset;
        self
    }

    /// Forgets everything, as a Redis restarted without its data (the epoch marker included).
    pub fn lose_state(&self) {
        *self.inner.lock().expect("not poisoned") = Inner::default();
    }

    /// The store's epoch made now whatever it holds, as `lua/fence.lua` makes it after a restart
    /// or a failover (`--store-reset empty`: what it holds is then taken as empty now).
    pub fn fence(&self) {
        let now = self.now_us.load(Ordering::SeqCst) as f64;
        self.inner.lock().expect("not poisoned").epoch_us = Some(now);
    }

    /// A call's epoch under `--store-reset empty`: the marker's time, made `now` when missing
    /// (as `lua/bucket.lua` reads and writes it).
    fn epoch(&self, inner: &mut Inner, now: f64) -> Option<f64> {
        (self.store_reset == StoreReset::Empty).then(|| *inner.epoch_us.get_or_insert(now))
    }

    pub fn set_now_us(&self, now_us: u64) {
        self.now_us.store(now_us, Ordering::SeqCst);
    }

    pub fn advance_ms(&self, ms: u64) {
        self.now_us.fetch_add(ms * 1000, Ordering::SeqCst);
    }

    /// The tokens a bucket holds as stored (`None`: missing, i.e. full).
    pub fn stored_tokens(&self, key: &str) -> Option<f64> {
        self.inner
            .lock()
            .expect("not poisoned")
            .buckets
            .get(key)
            .map(|s| s.tokens)
    }

    /// Replaces a hash (a regional share record).
    pub fn set_hash(&self, key: &str, fields: &[(&str, &str)]) {
        self.inner.lock().expect("not poisoned").hashes.insert(
            key.to_string(),
            fields
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
    }

    /// The run_id a share record's read answers with from now on (a Redis process's: a new one
    /// after a restart).
    pub fn set_run_id(&self, run_id: &str) {
        self.inner.lock().expect("not poisoned").run_id = run_id.to_string();
    }

    /// The fields of a hash (empty when missing).
    pub fn hash(&self, key: &str) -> Vec<(String, String)> {
        self.inner
            .lock()
            .expect("not poisoned")
            .hashes
            .get(key)
            .cloned()
            .unwrap_or_default()
    }

    /// Decides `work` at the store's clock, as `lua/apply.lua` (after the returns of
    /// `lua/bucket.lua`).
    pub fn run(&self, work: &Work) -> Vec<Vec<RequestOutcome>> {
        let now = self.now_us.load(Ordering::SeqCst) as f64;
        let now_ms = (now / 1000.0).floor() as u64;
        let mut inner = self.inner.lock().expect("not poisoned");
        inner.records.retain(|_, (_, exp)| *exp > now_ms);
        let epoch = self.epoch(&mut inner, now);
        let mut call = ScriptRun {
            inner: &mut inner,
            now,
            states: HashMap::new(),
            epoch,
        };
        // Returns: the unused part of a lease goes back, the lease is removed.
        for r in &work.returns {
            let (s, tokens, capacity, _) = call.bucket(&r.key, &r.bucket);
            if let Some(lease) = ScriptRun::remove_lease(s, r.lease_id as f64) {
                ScriptRun::give(
                    s,
                    tokens + (r.tokens as f64).min(lease.amount),
                    capacity,
                    now,
                );
            }
        }
        let mut out = Vec::with_capacity(work.groups.len());
        let mut receipts = Vec::new(); // the charges' receipts, kept as lua/apply.lua keeps them
        let mut r = 0; // the request, numbered across the call
        for g in &work.groups {
            if let Some(recorded) = call.unpack_record(g) {
                r += g.requests.len();
                out.push(replay(&recorded));
                continue;
            }
            let mut answers = Vec::with_capacity(g.requests.len());
            let mut flat = Vec::with_capacity(g.requests.len());
            for request in &g.requests {
                r += 1;
                // Pass 1: does every non-shadow decision admit? Decisions of one request on one
                // bucket see what the ones before them would take.
                let mut admit = true;
                let mut res: Vec<[f64; 8]> = Vec::with_capacity(request.len());
                for c in request {
                    let (s, mut tokens, _, refill_per_sec) = call.bucket(&c.key, &c.bucket);
                    if s.avail_req == r {
                        tokens = s.avail;
                    }
                    let mut x = [0.0; 8]; // allowed, remaining, retry, reset, reason, ...
                    let cost = c.cost as f64;
                    if cost > capacity_now(&c.bucket) {
                        x[4] = 2.0;
                    } else if tokens < cost {
                        x[4] = 1.0;
                        x[2] = wait_ms(cost - tokens, refill_per_sec) as f64;
                    } else {
                        x[0] = 1.0;
                        tokens -= cost;
                    }
                    (s.avail, s.avail_req) = (tokens, r);
                    admit = admit && (x[0] == 1.0 || c.shadow);
                    res.push(x);
                }
                // Pass 2: charge (and grant leases) only if the request is admitted.
                for (c, x) in request.iter().zip(res.iter_mut()) {
                    let (s, mut tokens, capacity, refill_per_sec) = call.bucket(&c.key, &c.bucket);
                    let (mut grant, mut charged) = (0.0, 0.0);
                    if admit && x[0] == 1.0 {
                        tokens -= c.cost as f64;
                        charged = c.cost as f64;
                        if c.receipt > 0 {
                            receipts.push((receipt_key(&c.key, c.receipt), c.cost));
                        }
                        if let Some(ask) = c.lease.filter(|a| a.tokens > 0) {
                            if s.leases.len() < MAX_LEASES {
                                let cap = match c.grant_cap {
                                    GrantCap::Share => (self.max_share * capacity).floor(),
                                    GrantCap::Ask => ask.tokens as f64,
                                };
                                grant = (ask.tokens as f64).min(cap).min(tokens.floor()).max(0.0);
                            }
                            if grant > 0.0 {
                                // A new lease under an id already held replaces it.
                                ScriptRun::remove_lease(s, ask.id as f64);
                                s.leases.push(Lease {
                                    id: ask.id as f64,
                                    amount: grant,
                                    expiry_us: now + ask.ttl_ms as f64 * 1000.0,
                                });
                                tokens -= grant;
                                charged += grant;
                            }
                        }
                    }
                    // A rejection writes nothing, but re-anchors a ts in the future.
                    if charged > 0.0 || s.future {
                        (s.tokens, s.ts_us, s.dirty) = (tokens, now, true);
                    }
                    x[1] = whole(tokens) as f64;
                    x[3] = wait_ms(capacity - tokens, refill_per_sec) as f64;
                    x[5] = grant;
                    x[6] = charged;
                    x[7] = if charged > 0.0 {
                        c.lease.map_or(0.0, |a| a.id as f64)
                    } else {
                        0.0
                    };
                }
                let status = if admit {
                    Status::Charged
                } else {
                    Status::Rejected
                };
                answers.push(RequestOutcome {
                    status,
                    decisions: res.iter().map(outcome).collect(),
                });
                flat.push(Recorded {
                    status: if admit { 1.0 } else { 0.0 },
                    decisions: res,
                });
            }
            if let Some(k) = &g.record {
                if flat.iter().any(|r| r.status == 1.0) {
                    let expires_ms = now_ms + self.record_ttl_ms;
                    call.inner.records.insert(k.clone(), (flat, expires_ms));
                }
            }
            out.push(answers);
        }
        for (key, cost) in receipts {
            let expires_ms = now_ms + self.receipt_ttl_ms;
            call.inner.receipts.insert(key, (cost, expires_ms));
        }
        call.finish();
        out
    }

    /// Refunds the listed requests of a recorded group, as `lua/refund.lua`: in the order of the
    /// group (the list is a set). The order matters in one case: two requests of the group that
    /// took a lease under one id on one bucket (the second replaced the first's), where only the
    /// lease still held comes back with the first request refunded.
    pub fn refund_now(&self, group: &Group, requests: &[usize]) -> bool {
        let now = self.now_us.load(Ordering::SeqCst) as f64;
        let mut inner = self.inner.lock().expect("not poisoned");
        let epoch = self.epoch(&mut inner, now);
        let mut call = ScriptRun {
            inner: &mut inner,
            now,
            states: HashMap::new(),
            epoch,
        };
        let Some(mut flat) = call.unpack_record(group) else {
            return false;
        };
        let mut changed = false;
        for (r, (rec, request)) in flat.iter_mut().zip(&group.requests).enumerate() {
            if !requests.contains(&r) || rec.status != 1.0 {
                continue;
            }
            for (x, c) in rec.decisions.iter_mut().zip(request) {
                let mut charged = x[6];
                if charged > 0.0 {
                    let (s, tokens, capacity, refill_per_sec) = call.bucket(&c.key, &c.bucket);
                    // A returned or expired lease gave its tokens back, or lost them, already.
                    if x[5] > 0.0 && ScriptRun::remove_lease(s, x[7]).is_none() {
                        charged -= x[5];
                    }
                    let tokens = ScriptRun::give(s, tokens + charged, capacity, now);
                    (x[0], x[1], x[5]) = (0.0, whole(tokens) as f64, 0.0);
                    x[3] = wait_ms(capacity - tokens, refill_per_sec) as f64;
                }
            }
            rec.status = 2.0;
            changed = true;
        }
        if changed {
            let key = group.record.clone().expect("a record was read");
            if let Some(entry) = call.inner.records.get_mut(&key) {
                entry.0 = flat;
            }
        }
        call.finish();
        changed
    }
}

/// The capacity under the share in force now (the script's `capacity_now`).
fn capacity_now(b: &BucketLimits) -> f64 {
    let capacity = b.capacity as f64;
    match b.share.as_ref().and_then(|h| h.changes().last()) {
        None => capacity,
        Some((_, share)) => scaled(capacity, share.ppm()),
    }
}

fn replay(recorded: &[Recorded]) -> Vec<RequestOutcome> {
    recorded
        .iter()
        .map(|r| RequestOutcome {
            status: Status::Replayed {
                charged: r.status == 1.0,
            },
            decisions: r.decisions.iter().map(outcome).collect(),
        })
        .collect()
}

fn outcome(x: &[f64; 8]) -> BucketOutcome {
    BucketOutcome {
        allowed: x[0] == 1.0,
        remaining: x[1] as u64,
        retry_after_ms: x[2] as u64,
        reset_ms: x[3] as u64,
        reason: match x[4] as u64 {
            1 => Reason::Insufficient,
            2 => Reason::CostExceedsCapacity,
            _ => Reason::Ok,
        },
        leased: x[5] as u64,
    }
}

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

/// Whether `slot`'s set is within `unsure_ms` of the store's epoch (`--store-reset empty`),
/// when the requests still running that held slots before a loss are not all known again.
fn unsure(epoch: Option<f64>, now: f64, slot: &Slot) -> bool {
    let window_ms = slot.unsure_ms.max(slot.ttl_ms);
    epoch.is_some_and(|e| now < e + window_ms as f64 * 1000.0)
}

/// Concurrency slots, as `lua/slots.lua`: the same passes in the same order.
impl MemoryStore {
    /// Takes one request's slots, all or none, at the store's clock.
    pub fn take_slots_now(&self, slots: &[Slot]) -> SlotsTaken {
        let now = self.now_us.load(Ordering::SeqCst) as f64;
        let mut inner = self.inner.lock().expect("not poisoned");
        let epoch = self.epoch(&mut inner, now);
        let mut pending: HashMap<&str, usize> = HashMap::new();
        for (i, slot) in slots.iter().enumerate() {
            let set = inner.slot_sets.entry(slot.key.clone()).or_default();
            set.retain(|_, expiry| *expiry > now);
            if !set.contains_key(&slot.id) {
                let p = pending.entry(&*slot.key).or_default();
                if set.len() + *p >= slot.limit as usize || unsure(epoch, now, slot) {
                    inner.slot_sets.retain(|_, set| !set.is_empty());
                    return SlotsTaken::Full { index: i };
                }
                *p += 1;
            }
        }
        for slot in slots {
            let set = inner.slot_sets.entry(slot.key.clone()).or_default();
            set.insert(slot.id.clone(), now + slot.ttl_ms as f64 * 1000.0);
        }
        SlotsTaken::Taken
    }

    /// Renews or releases slots at the store's clock: per slot, whether it was held.
    pub fn update_slots_now(&self, update: SlotUpdate, slots: &[Slot]) -> Vec<bool> {
        let now = self.now_us.load(Ordering::SeqCst) as f64;
        let mut inner = self.inner.lock().expect("not poisoned");
        let epoch = self.epoch(&mut inner, now);
        let held = slots
            .iter()
            .map(|slot| {
                let set = inner.slot_sets.entry(slot.key.clone()).or_default();
                let alive = set.get(&slot.id).is_some_and(|expiry| *expiry > now);
                match update {
                    SlotUpdate::Release => {
                        set.remove(&slot.id);
                        alive
                    }
                    // Held, or maybe lost with the store's state: held again.
                    SlotUpdate::Renew if alive || unsure(epoch, now, slot) => {
                        set.insert(slot.id.clone(), now + slot.ttl_ms as f64 * 1000.0);
                        true
                    }
                    SlotUpdate::Renew => {
                        set.remove(&slot.id);
                        false
                    }
                }
            })
            .collect();
        inner.slot_sets.retain(|_, set| !set.is_empty());
        held
    }

    /// The slots a set holds now (unexpired), sorted by id.
    pub fn held_slots(&self, key: &str) -> Vec<String> {
        let now = self.now_us.load(Ordering::SeqCst) as f64;
        let inner = self.inner.lock().expect("not poisoned");
        let mut ids: Vec<String> = inner
            .slot_sets
            .get(key)
            .map(|set| {
                set.iter()
                    .filter(|(_, expiry)| **expiry > now)
                    .map(|(id, _)| id.to_string())
                    .collect()
            })
            .unwrap_or_default();
        ids.sort();
        ids
    }
}

impl BucketStore for MemoryStore {
    async fn take_slots(&self, slots: Vec<Slot>) -> Result<SlotsTaken, StoreError> {
        if let Some(e) = self.fail.lock().expect("not poisoned").clone() {
            return Err(e);
        }
        Ok(self.take_slots_now(&slots))
    }

    async fn update_slots(
        &self,
        update: SlotUpdate,
        slots: Vec<Slot>,
    ) -> Result<Vec<bool>, StoreError> {
        if let Some(e) = self.fail.lock().expect("not poisoned").clone() {
            return Err(e);
        }
        Ok(self.update_slots_now(update, &slots))
    }

    async fn settle(&self, batch: SettleBatch) -> Result<Settled, StoreError> {
        if let Some(e) = self.fail.lock().expect("not poisoned").clone() {
            return Err(e);
        }
        let Some(first) = batch.settlements.first() else {
            return Ok(Settled::default());
        };
        let record = batch
            .id
            .as_deref()
            .map(|id| settle_record_key(&first.key, id));
        let applied = match self.settle_now(record.as_deref(), &batch.settlements) {
            Some(a) => a.into_iter().map(Some).collect(),
            None => vec![None; batch.settlements.len()],
        };
        Ok(Settled { applied })
    }

    async fn decide(&self, call: super::Call) -> Vec<Result<Decided, StoreError>> {
        if let Some(e) = self.fail.lock().expect("not poisoned").clone() {
            return vec![Err(e); call.requests.len()];
        }
        let first = call.requests.first().and_then(|r| r.first());
        let record = call
            .attempt
            .as_deref()
            .zip(first)
            .map(|(attempt, c)| record_key(&c.key, attempt));
        let groups = if call.requests.is_empty() {
            Vec::new()
        } else {
            vec![Group {
                record,
                requests: call.requests,
            }]
        };
        let work = Work {
            groups,
            returns: call.returns,
        };
        let mut answers = self.run(&work);
        answers
            .pop()
            .unwrap_or_default()
            .into_iter()
            .map(|r| Ok(Decided::from(r)))
            .collect()
    }

    async fn readiness(&self) -> Readiness {
        Readiness {
            redis_ok: true,
            script_loaded: true,
            ..Readiness::default()
        }
    }
}

impl ShareStore for MemoryStore {
    async fn read_share_record(
        &self,
        key: String,
    ) -> Result<(Vec<(String, String)>, String), StoreError> {
        if let Some(e) = self.fail.lock().expect("not poisoned").clone() {
            return Err(e);
        }
        let run_id = self.inner.lock().expect("not poisoned").run_id.clone();
        Ok((self.hash(&key), run_id))
    }

    async fn add_demand(
        &self,
        key: String,
        admitted: u64,
        rejected: u64,
    ) -> Result<(), StoreError> {
        if let Some(e) = self.fail.lock().expect("not poisoned").clone() {
            return Err(e);
        }
        let mut inner = self.inner.lock().expect("not poisoned");
        let fields = inner.hashes.entry(key).or_default();
        for (name, n) in [(record::ADMITTED, admitted), (record::REJECTED, rejected)] {
            match fields.iter_mut().find(|(k, _)| k == name) {
                Some((_, v)) => *v = (v.parse::<u64>().unwrap_or(0) + n).to_string(),
                None => fields.push((name.to_string(), n.to_string())),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{BucketLimits, Charge, Return};
    use super::*;

    const T0: u64 = 1_700_000_000_000_000;

    fn charge(key: &str, capacity: u64, refill: f64, cost: u64) -> Charge {
        Charge {
            receipt: 0,
            key: Arc::from(key),
            bucket: BucketLimits::new(capacity, refill),
            cost,
            shadow: false,
            lease: None,
            grant_cap: GrantCap::Share,
        }
    }

    fn one(store: &MemoryStore, request: Vec<Charge>) -> RequestOutcome {
        store
            .run(&Work {
                groups: vec![Group {
                    record: None,
                    requests: vec![request],
                }],
                returns: vec![],
            })
            .remove(0)
            .remove(0)
    }

    #[test]
    fn a_bucket_admits_its_capacity_then_refills_with_time() {
        let s = MemoryStore::new(T0, 0.1, 10_000);
        for i in 0..5 {
            let r = one(&s, vec![charge("k", 5, 1.0, 1)]);
            assert_eq!(r.status, Status::Charged, "request {i}");
            assert_eq!(r.decisions[0].remaining, 4 - i);
        }
        let r = one(&s, vec![charge("k", 5, 1.0, 1)]);
        assert_eq!(r.status, Status::Rejected);
        assert_eq!(r.decisions[0].retry_after_ms, 1000);
        assert_eq!(r.decisions[0].reset_ms, 5000);
        s.advance_ms(1000);
        assert_eq!(
            one(&s, vec![charge("k", 5, 1.0, 1)]).status,
            Status::Charged
        );
    }

    #[test]
    fn all_or_nothing_and_shadow_decisions_never_reject() {
        let s = MemoryStore::new(T0, 0.1, 10_000);
        let r = one(&s, vec![charge("a", 10, 1.0, 1), charge("b", 1, 1.0, 2)]);
        assert_eq!(r.status, Status::Rejected);
        assert_eq!(r.decisions[1].reason, Reason::CostExceedsCapacity);
        assert_eq!(s.stored_tokens("a"), None, "nothing charged");
        let mut shadow = charge("b", 1, 1.0, 2);
        shadow.shadow = true;
        let r = one(&s, vec![charge("a", 10, 1.0, 1), shadow]);
        assert_eq!(r.status, Status::Charged);
        assert!(!r.decisions[1].allowed);
        assert_eq!(s.stored_tokens("a"), Some(9.0));
    }

    #[test]
    fn a_grant_capped_by_its_ask_alone_may_take_what_the_bucket_holds() {
        let s = MemoryStore::new(T0, 0.5, 10_000);
        let ask = |id| ratelimit_wire::LeaseAsk {
            id,
            tokens: 80,
            ttl_ms: 1000,
        };
        let mut c = charge("q", 100, 10.0, 1);
        (c.lease, c.grant_cap) = (Some(ask(1)), GrantCap::Ask);
        let r = one(&s, vec![c.clone()]);
        assert_eq!(
            r.decisions[0].leased, 80,
            "the ask, above max_share * capacity (50)"
        );
        assert_eq!(r.decisions[0].remaining, 19);
        // Still never more than the bucket holds after the cost.
        c.lease = Some(ask(2));
        let r = one(&s, vec![c]);
        assert_eq!(r.decisions[0].leased, 18);
        assert_eq!(r.decisions[0].remaining, 0);
    }

    #[test]
    fn leases_lower_the_ceiling_until_returned_or_expired() {
        let s = MemoryStore::new(T0, 0.5, 10_000);
        let mut c = charge("h", 100, 10.0, 1);
        c.lease = Some(ratelimit_wire::LeaseAsk {
            id: 7,
            tokens: 80,
            ttl_ms: 1000,
        });
        let r = one(&s, vec![c]);
        assert_eq!(r.decisions[0].leased, 50, "at most max_share * capacity");
        assert_eq!(r.decisions[0].remaining, 49);
        // Refill cannot fill what the lease holds: the ceiling is 50 while it lasts.
        s.advance_ms(900);
        let r = one(&s, vec![charge("h", 100, 10.0, 1)]);
        assert_eq!(r.decisions[0].remaining, 49);
        // Giving 20 back removes the lease: the ceiling is 100 again.
        let w = Work {
            groups: vec![],
            returns: vec![Return {
                key: Arc::from("h"),
                bucket: BucketLimits::new(100, 10.0),
                lease_id: 7,
                tokens: 20,
            }],
        };
        s.run(&w);
        assert_eq!(s.stored_tokens("h"), Some(69.0));
    }

    #[test]
    fn a_record_replays_and_a_refund_gives_back_once() {
        let s = MemoryStore::new(T0, 0.1, 10_000);
        let g = Group {
            record: Some("k:a:1".into()),
            requests: vec![vec![charge("k", 10, 1.0, 3)]],
        };
        let w = Work {
            groups: vec![g.clone()],
            returns: vec![],
        };
        assert_eq!(s.run(&w)[0][0].status, Status::Charged);
        assert_eq!(s.run(&w)[0][0].status, Status::Replayed { charged: true });
        assert_eq!(s.stored_tokens("k"), Some(7.0));
        assert!(s.refund_now(&g, &[0]));
        assert!(!s.refund_now(&g, &[0]), "a second refund does nothing");
        assert_eq!(s.stored_tokens("k"), Some(10.0));
        assert_eq!(s.run(&w)[0][0].status, Status::Replayed { charged: false });
    }
}
