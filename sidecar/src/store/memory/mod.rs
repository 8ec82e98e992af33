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
    RequestOutcome, SettleBatch, Settled, Settlement, ShareRead, ShareStore, Slot, SlotUpdate,
    SlotsTaken, Status, StoreError, StoreReset, Work, SHARE_MARGIN_MS,
};
use crate::keys::{record_key, settle_record_key};
use crate::regional::record::StoredShare;

mod script_run;
mod settle;
mod slots;
#[cfg(test)]
mod tests;

use self::script_run::ScriptRun;

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
    /// Regional share records by (domain, rule): a record, or why it cannot be read.
    shares: HashMap<(String, String), Result<StoredShare, String>>,
    /// Regional demand counters by (domain, rule): admitted and rejected tokens.
    demand: HashMap<(String, String), (u64, u64)>,
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

/// A decision's figures in a reply and in a record, as `lua/bucket.lua` names them (from 0
/// here): the reply's six, then the tokens paid (cost and lease) and the lease's id.
const ALLOWED: usize = 0;
const REMAINING: usize = 1;
const RETRY_AFTER_MS: usize = 2;
const RESET_MS: usize = 3;
const REASON: usize = 4;
const LEASED: usize = 5;
const PAID: usize = 6;
const PAID_LEASE_ID: usize = 7;

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

    /// Replaces the share record of `rule` of `domain`: a record, none, or why it cannot be read.
    pub fn set_share(&self, domain: &str, rule: &str, record: Result<Option<StoredShare>, String>) {
        let id = (domain.to_string(), rule.to_string());
        let mut inner = self.inner.lock().expect("not poisoned");
        match record.transpose() {
            Some(r) => inner.shares.insert(id, r),
            None => inner.shares.remove(&id),
        };
    }

    /// The run_id a share record's read answers with from now on (a Redis process's: a new one
    /// after a restart).
    pub fn set_run_id(&self, run_id: &str) {
        self.inner.lock().expect("not poisoned").run_id = run_id.to_string();
    }

    /// The demand counters of `rule` of `domain`: admitted and rejected tokens.
    pub fn demand(&self, domain: &str, rule: &str) -> (u64, u64) {
        let id = (domain.to_string(), rule.to_string());
        let inner = self.inner.lock().expect("not poisoned");
        inner.demand.get(&id).copied().unwrap_or_default()
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
                    let mut x = [0.0; 8]; // a decision's figures, by name
                    let cost = c.cost as f64;
                    if cost > capacity_now(&c.bucket) {
                        x[REASON] = 2.0;
                    } else if tokens < cost {
                        x[REASON] = 1.0;
                        x[RETRY_AFTER_MS] = wait_ms(cost - tokens, refill_per_sec) as f64;
                    } else {
                        x[ALLOWED] = 1.0;
                        tokens -= cost;
                    }
                    (s.avail, s.avail_req) = (tokens, r);
                    admit = admit && (x[ALLOWED] == 1.0 || c.shadow);
                    res.push(x);
                }
                // Pass 2: charge (and grant leases) only if the request is admitted.
                for (c, x) in request.iter().zip(res.iter_mut()) {
                    let (s, mut tokens, capacity, refill_per_sec) = call.bucket(&c.key, &c.bucket);
                    let (mut grant, mut charged) = (0.0, 0.0);
                    if admit && x[ALLOWED] == 1.0 {
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
                    x[REMAINING] = whole(tokens) as f64;
                    x[RESET_MS] = wait_ms(capacity - tokens, refill_per_sec) as f64;
                    x[LEASED] = grant;
                    x[PAID] = charged;
                    x[PAID_LEASE_ID] = if charged > 0.0 {
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
                let mut charged = x[PAID];
                if charged > 0.0 {
                    let (s, tokens, capacity, refill_per_sec) = call.bucket(&c.key, &c.bucket);
                    // A returned or expired lease gave its tokens back, or lost them, already.
                    if x[LEASED] > 0.0 && ScriptRun::remove_lease(s, x[PAID_LEASE_ID]).is_none() {
                        charged -= x[LEASED];
                    }
                    let tokens = ScriptRun::give(s, tokens + charged, capacity, now);
                    (x[ALLOWED], x[REMAINING], x[LEASED]) = (0.0, whole(tokens) as f64, 0.0);
                    x[RESET_MS] = wait_ms(capacity - tokens, refill_per_sec) as f64;
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
        allowed: x[ALLOWED] == 1.0,
        remaining: x[REMAINING] as u64,
        retry_after_ms: x[RETRY_AFTER_MS] as u64,
        reset_ms: x[RESET_MS] as u64,
        reason: match x[REASON] as u64 {
            1 => Reason::Insufficient,
            2 => Reason::CostExceedsCapacity,
            _ => Reason::Ok,
        },
        leased: x[LEASED] as u64,
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
    async fn read_share(&self, domain: &str, rule: &str) -> Result<ShareRead, StoreError> {
        if let Some(e) = self.fail.lock().expect("not poisoned").clone() {
            return Err(e);
        }
        let inner = self.inner.lock().expect("not poisoned");
        let record = match inner.shares.get(&(domain.to_string(), rule.to_string())) {
            None => None,
            Some(Ok(r)) => Some(r.clone()),
            Some(Err(e)) => return Err(StoreError::Reply(e.clone())),
        };
        Ok(ShareRead {
            record,
            answered_by: inner.run_id.clone(),
        })
    }

    async fn add_demand(
        &self,
        domain: &str,
        rule: &str,
        admitted: u64,
        rejected: u64,
    ) -> Result<(), StoreError> {
        if let Some(e) = self.fail.lock().expect("not poisoned").clone() {
            return Err(e);
        }
        let mut inner = self.inner.lock().expect("not poisoned");
        let c = inner
            .demand
            .entry((domain.to_string(), rule.to_string()))
            .or_default();
        c.0 += admitted;
        c.1 += rejected;
        Ok(())
    }
}
