//! The bucket of `lua/token_bucket.lua`, in Rust, in memory: the reference model the Lua script
//! is tested against (the same work gives the same answers, see `sidecar/tests/differential.rs`),
//! and the store behind the decision logic's unit tests. Time is injected, so tests drive it.
//!
//! It follows the script step by step, in the same floating-point order; see the script's header
//! for the math and the semantics of leases, returns and records.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ratelimit_regions::ShareHistory;
use ratelimit_wire::Reason;

use super::{
    Bucket, BucketStore, Call, Charge, Decided, Group, Outcome, Readiness, RequestOutcome, Return,
    ShareStore, Status, StoreError, Work, SHARE_MARGIN_MS,
};
use crate::keys::record_key;
use crate::regional::record;

/// Lease entries one bucket holds (as the script).
pub const MAX_LEASES: usize = 64;
const MAX_INT: f64 = 9_007_199_254_740_992.0;

#[derive(Debug, Clone, PartialEq)]
struct Lease {
    id: f64,
    amount: f64,
    expiry_us: f64,
}

#[derive(Debug, Clone, PartialEq)]
struct State {
    tokens: f64,
    ts_us: f64,
    leases: Vec<Lease>,
    /// The stored ts when the call began (`None`: the bucket was missing): where the look-back
    /// of a regional share starts.
    since_us: Option<f64>,
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
    buckets: HashMap<Arc<str>, State>,
    records: HashMap<String, (Vec<Recorded>, u64)>,
    /// Hashes (regional share records, demand counters): key -> fields.
    hashes: HashMap<String, Vec<(String, String)>>,
}

/// The in-memory store. The clock is Unix microseconds, settable by tests.
pub struct MemoryStore {
    inner: Mutex<Inner>,
    now_us: AtomicU64,
    max_share: f64,
    record_ttl_ms: u64,
    /// Fails every call with this error while set (outage tests).
    pub fail: Mutex<Option<StoreError>>,
}

impl MemoryStore {
    pub fn new(now_us: u64, max_share: f64, record_ttl_ms: u64) -> Self {
        MemoryStore {
            inner: Mutex::new(Inner::default()),
            now_us: AtomicU64::new(now_us),
            max_share,
            record_ttl_ms,
            fail: Mutex::new(None),
        }
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

    /// Decides `work` at the store's clock.
    pub fn run(&self, work: &Work) -> Vec<Vec<RequestOutcome>> {
        let now = self.now_us.load(Ordering::SeqCst) as f64;
        let mut inner = self.inner.lock().expect("not poisoned");
        let now_ms = (now / 1000.0).floor() as u64;
        inner.records.retain(|_, (_, exp)| *exp > now_ms);
        let mut states: HashMap<Arc<str>, State> = HashMap::new();
        let mut dirty: Vec<Arc<str>> = Vec::new();
        for r in &work.returns {
            return_lease(&mut inner, &mut states, &mut dirty, now, r);
        }
        let mut out = Vec::with_capacity(work.groups.len());
        for g in &work.groups {
            // A record of another shape is not this call's (an attempt id reused for other
            // requests): the call is decided as new, as the script does.
            if let Some(recorded) = g
                .record
                .as_ref()
                .and_then(|k| inner.records.get(k))
                .filter(|(r, _)| same_shape(r, g))
            {
                out.push(replay(&recorded.0));
                continue;
            }
            let mut recorded = Vec::with_capacity(g.requests.len());
            let mut answers = Vec::with_capacity(g.requests.len());
            for request in &g.requests {
                let (r, rec) =
                    self.apply_request(&mut inner, &mut states, &mut dirty, now, request);
                answers.push(r);
                recorded.push(rec);
            }
            if let Some(k) = &g.record {
                if recorded.iter().any(|r| r.status == 1.0) {
                    inner
                        .records
                        .insert(k.clone(), (recorded, now_ms + self.record_ttl_ms));
                }
            }
            out.push(answers);
        }
        for key in dirty {
            if let Some(s) = states.remove(&key) {
                inner.buckets.insert(key, s);
            }
        }
        out
    }

    fn apply_request(
        &self,
        inner: &mut Inner,
        states: &mut HashMap<Arc<str>, State>,
        dirty: &mut Vec<Arc<str>>,
        now: f64,
        request: &[Charge],
    ) -> (RequestOutcome, Recorded) {
        let mut admit = true;
        let mut avail: HashMap<&str, f64> = HashMap::new();
        let mut results: Vec<[f64; 8]> = Vec::with_capacity(request.len());
        for c in request {
            let s = state(inner, states, &c.key, c.bucket.capacity as f64, now);
            let mut tokens = avail
                .get(&*c.key)
                .copied()
                .unwrap_or_else(|| tokens_now(s, c, now));
            let mut x = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
            let cost = c.cost as f64;
            if cost > capacity_now(&c.bucket) {
                x[4] = 2.0;
            } else if tokens < cost {
                x[4] = 1.0;
                let (_, refill) = effective(s, &c.bucket, now);
                x[2] = ms_ceil((cost - tokens) / refill * 1000.0);
            } else {
                x[0] = 1.0;
                tokens -= cost;
            }
            avail.insert(&c.key, tokens);
            if x[0] == 0.0 && !c.shadow {
                admit = false;
            }
            results.push(x);
        }
        for (c, x) in request.iter().zip(results.iter_mut()) {
            let s = state(inner, states, &c.key, c.bucket.capacity as f64, now);
            let mut tokens = tokens_now(s, c, now);
            if admit && x[0] == 1.0 {
                tokens -= c.cost as f64;
                let mut grant = 0.0;
                if let Some(ask) = c.lease.filter(|a| a.tokens > 0) {
                    if s.leases.len() < MAX_LEASES {
                        let (capacity, _) = effective(s, &c.bucket, now);
                        let cap = (self.max_share * capacity).floor();
                        grant = (ask.tokens as f64).min(cap).min(tokens.floor()).max(0.0);
                        if grant > 0.0 {
                            s.leases.retain(|l| l.id != ask.id as f64);
                            tokens -= grant;
                            s.leases.push(Lease {
                                id: ask.id as f64,
                                amount: grant,
                                expiry_us: now + ask.ttl_ms as f64 * 1000.0,
                            });
                        }
                    }
                }
                s.tokens = tokens;
                s.ts_us = now;
                mark(dirty, &c.key);
                x[5] = grant;
                x[6] = c.cost as f64 + grant;
                x[7] = c.lease.map_or(0.0, |a| a.id as f64);
            } else if s.ts_us > now {
                s.tokens = tokens;
                s.ts_us = now;
                mark(dirty, &c.key);
            }
            x[1] = int(tokens);
            x[3] = reset_ms(s, &c.bucket, tokens, now);
        }
        let status = if admit {
            Status::Charged
        } else {
            Status::Rejected
        };
        (
            RequestOutcome {
                status,
                decisions: results.iter().map(outcome).collect(),
            },
            Recorded {
                status: if admit { 1.0 } else { 0.0 },
                decisions: results,
            },
        )
    }

    /// Refunds the listed requests of a recorded group, in the order of the group (as the script
    /// does: the list is a set). The order matters in one case: two requests of the group that
    /// took a lease under one id on one bucket (the second replaced the first's), where only the
    /// lease still held comes back with the first request refunded.
    pub fn refund_now(&self, group: &Group, requests: &[usize]) -> bool {
        let mut requests = requests.to_vec();
        requests.sort_unstable();
        requests.dedup();
        let now = self.now_us.load(Ordering::SeqCst) as f64;
        let mut inner = self.inner.lock().expect("not poisoned");
        let Some(key) = &group.record else {
            return false;
        };
        let Some((mut recorded, exp)) = inner
            .records
            .get(key)
            .filter(|(r, _)| same_shape(r, group))
            .cloned()
        else {
            return false;
        };
        let mut states: HashMap<Arc<str>, State> = HashMap::new();
        let mut dirty = Vec::new();
        let mut changed = false;
        for &r in &requests {
            let (Some(rec), Some(request)) = (recorded.get_mut(r), group.requests.get(r)) else {
                continue;
            };
            if rec.status != 1.0 {
                continue;
            }
            for (x, c) in rec.decisions.iter_mut().zip(request) {
                let mut charged = x[6];
                if charged > 0.0 {
                    let s = state(&inner, &mut states, &c.key, c.bucket.capacity as f64, now);
                    let tokens = tokens_now(s, c, now);
                    if x[5] > 0.0 {
                        let before = s.leases.len();
                        s.leases.retain(|l| l.id != x[7]);
                        if s.leases.len() == before {
                            charged -= x[5];
                        }
                    }
                    let (capacity, _) = effective(s, &c.bucket, now);
                    let tokens = (tokens + charged).min(capacity - leased(s));
                    s.tokens = tokens;
                    s.ts_us = now;
                    mark(&mut dirty, &c.key);
                    x[0] = 0.0;
                    x[1] = int(tokens);
                    x[3] = reset_ms(s, &c.bucket, tokens, now);
                    x[5] = 0.0;
                }
            }
            rec.status = 2.0;
            changed = true;
        }
        if changed {
            inner.records.insert(key.clone(), (recorded, exp));
        }
        for key in dirty {
            if let Some(s) = states.remove(&key) {
                inner.buckets.insert(key, s);
            }
        }
        changed
    }
}

fn mark(dirty: &mut Vec<Arc<str>>, key: &Arc<str>) {
    if !dirty.contains(key) {
        dirty.push(key.clone());
    }
}

/// The bucket's state in this call: from the call's working set, else from storage (unexpired
/// leases only), else a full bucket.
fn state<'a>(
    inner: &Inner,
    states: &'a mut HashMap<Arc<str>, State>,
    key: &Arc<str>,
    capacity: f64,
    now: f64,
) -> &'a mut State {
    states
        .entry(key.clone())
        .or_insert_with(|| match inner.buckets.get(key) {
            Some(s) => State {
                tokens: if s.tokens.is_nan() || s.tokens < 0.0 {
                    0.0
                } else {
                    s.tokens
                },
                ts_us: s.ts_us,
                leases: s
                    .leases
                    .iter()
                    .filter(|l| l.expiry_us > now)
                    .cloned()
                    .collect(),
                since_us: Some(s.ts_us),
            },
            None => State {
                tokens: capacity,
                ts_us: now,
                leases: Vec::new(),
                since_us: None,
            },
        })
}

fn leased(s: &State) -> f64 {
    s.leases.iter().map(|l| l.amount).sum()
}

/// `x` scaled by `ppm` parts per million, rounded down to a millionth.
fn scaled(x: f64, ppm: f64) -> f64 {
    (x * ppm).floor() / 1_000_000.0
}

/// The fill time of a limit, in microseconds: how far a regional share looks back.
fn horizon_us(b: &Bucket) -> f64 {
    b.capacity as f64 / b.refill_per_sec * 1_000_000.0
}

/// The smallest share (ppm) of `history` in force at any instant since `since_us`, looking back
/// at most the fill time, widened by [`SHARE_MARGIN_MS`].
fn smallest_share(history: &ShareHistory, b: &Bucket, since_us: f64, now: f64) -> f64 {
    let changes: Vec<(f64, f64)> = history
        .changes()
        .map(|(t, s)| (t as f64, f64::from(s.ppm())))
        .collect();
    let from_ms = since_us.max(now - horizon_us(b)) / 1000.0 - SHARE_MARGIN_MS as f64;
    let mut m = changes.last().map_or(0.0, |c| c.1);
    for pair in changes.windows(2) {
        if pair[1].0 > from_ms && pair[0].1 < m {
            m = pair[0].1;
        }
    }
    m
}

/// The capacity and refill a bucket is taken under in this call (the script's `effective`).
fn effective(s: &State, b: &Bucket, now: f64) -> (f64, f64) {
    let capacity = b.capacity as f64;
    match &b.share {
        None => (capacity, b.refill_per_sec),
        Some(history) => {
            let since = s.since_us.unwrap_or(now - horizon_us(b));
            let m = smallest_share(history, b, since, now);
            (scaled(capacity, m), scaled(b.refill_per_sec, m))
        }
    }
}

/// The capacity under the share in force now.
fn capacity_now(b: &Bucket) -> f64 {
    let capacity = b.capacity as f64;
    match b.share.as_ref().and_then(|h| h.changes().last()) {
        None => capacity,
        Some((_, share)) => scaled(capacity, f64::from(share.ppm())),
    }
}

fn reset_ms(s: &State, b: &Bucket, tokens: f64, now: f64) -> f64 {
    let (capacity, refill) = effective(s, b, now);
    ms_ceil((capacity - tokens) / refill * 1000.0)
}

fn tokens_now(s: &State, c: &Charge, now: f64) -> f64 {
    tokens_at(s, &c.bucket, now)
}

fn tokens_at(s: &State, b: &Bucket, now: f64) -> f64 {
    let (capacity, refill) = effective(s, b, now);
    let elapsed = (now - s.ts_us).max(0.0);
    let mut tokens = s.tokens + refill * elapsed / 1_000_000.0;
    let ceiling = capacity - leased(s);
    if tokens > ceiling {
        tokens = ceiling;
    }
    if tokens < 0.0 {
        tokens = 0.0;
    }
    tokens
}

fn return_lease(
    inner: &mut Inner,
    states: &mut HashMap<Arc<str>, State>,
    dirty: &mut Vec<Arc<str>>,
    now: f64,
    r: &Return,
) {
    let s = state(inner, states, &r.key, r.bucket.capacity as f64, now);
    let tokens = tokens_at(s, &r.bucket, now);
    if let Some(i) = s.leases.iter().position(|l| l.id == r.lease_id as f64) {
        let lease = s.leases.remove(i);
        let back = (r.tokens as f64).min(lease.amount);
        let (capacity, _) = effective(s, &r.bucket, now);
        s.tokens = (tokens + back).min(capacity - leased(s));
        s.ts_us = now;
        mark(dirty, &r.key);
    }
}

fn same_shape(recorded: &[Recorded], g: &Group) -> bool {
    recorded.len() == g.requests.len()
        && recorded
            .iter()
            .zip(&g.requests)
            .all(|(r, q)| r.decisions.len() == q.len())
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

fn outcome(x: &[f64; 8]) -> Outcome {
    Outcome {
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

fn int(x: f64) -> f64 {
    if x.is_nan() || x <= 0.0 {
        0.0
    } else if x >= MAX_INT {
        MAX_INT
    } else {
        x.floor()
    }
}

fn ms_ceil(x: f64) -> f64 {
    int((x - 1e-6).ceil())
}

/// One node: a call is one group, recorded under the caller's attempt id (keyed by its first
/// bucket, as on Redis), decided at once.
impl BucketStore for MemoryStore {
    async fn decide(&self, call: Call) -> Vec<Result<Decided, StoreError>> {
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
    async fn read_share_record(&self, key: String) -> Result<Vec<(String, String)>, StoreError> {
        if let Some(e) = self.fail.lock().expect("not poisoned").clone() {
            return Err(e);
        }
        Ok(self.hash(&key))
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
    use super::super::Bucket;
    use super::*;

    const T0: u64 = 1_700_000_000_000_000;

    fn charge(key: &str, capacity: u64, refill: f64, cost: u64) -> Charge {
        Charge {
            key: Arc::from(key),
            bucket: Bucket::new(capacity, refill),
            cost,
            shadow: false,
            lease: None,
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
                bucket: Bucket::new(100, 10.0),
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
