//! The decision: validate a [`DecideRequest`], split it by Redis Cluster slot, run the bucket
//! script once per slot, and merge the answers in request order.
//!
//! # All-or-nothing across Cluster slots (compensation)
//!
//! One script call is atomic, but only within one slot. On a single Redis every decision of a
//! request goes into one call. On a Cluster the decisions are grouped by the slot of their bucket
//! key and the groups run concurrently; if every group admits, the request is admitted. If some
//! group rejects, the request is rejected and the groups that charged are refunded (`refund` mode
//! of the script, keyed by the attempt record, idempotent). For that a cross-slot request needs
//! attempt ids: where the caller gave none, one random id is generated for that request, and the
//! groups that got it are remembered as *generated* (single-slot requests need none).
//!
//! Refunds run in the background: the answer does not wait for them (a caller that gives up, such
//! as Envoy on its callout timeout, cannot cancel them either). The price is a short window (a
//! Redis round trip or two) in which a charged group holds tokens for a request that was
//! rejected: concurrent requests on that bucket may then be rejected although tokens were about
//! to come back. The window can only over-REJECT, never over-admit. The figures answered for a
//! refunded decision (`remaining`, `reset_ms`) are computed here as they will be once the refund
//! lands. If the refund itself fails (Redis down), the tokens stay deducted until they refill.
//!
//! When a group fails (timeout, connection) and another group rejected, the request is still
//! rejected: it answers 200 `allowed: false`, never 503 (a 503 would let the filter's `on_error`
//! admit a client that is over its limit). The decisions of the failed group are answered
//! `allowed: false`, `reason: ok`, with `remaining`, `retry_after_ms` and `reset_ms` 0: their
//! buckets refused nothing, they simply gave no answer, and the request does not pass. The failed
//! group is refunded along with the charged ones, in case its script ran after all.
//!
//! When a group fails and no group rejected, the request answers 503. Every group with generated
//! attempt ids is refunded in the background, the failed ones included (no one can ever replay
//! them). Groups with the caller's attempt ids stay charged: a repeat of that attempt would replay
//! them and run only the rest, but the filter never repeats a callout (it applies `on_error`), so
//! in practice those tokens stay spent until they refill (over-rejection only). A refund can
//! overtake a script call that timed out but still runs in Redis; that charge then stays.
//!
//! Script errors that retrying cannot cure (`WRONGTYPE`: a key of another type where a bucket or
//! attempt record should be; the script refusing its arguments; an unreadable reply) answer 500,
//! not 503: Redis is up, and the failure is this sidecar's or its data's.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use ratelimit_wire::{
    DecideRequest, DecideResponse, DecisionResult, Reason, MAX_DECISIONS, MAX_KEY_BYTES,
};

use crate::metrics::Metrics;
use crate::store::{BucketCall, BucketStore, Outcome, StoreError};

/// Why a request got no verdict.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// The request is malformed; the message names the field (answered 400).
    #[error("{0}")]
    Invalid(String),
    /// Redis did not answer in time or failed (answered 503).
    #[error(transparent)]
    Unavailable(StoreError),
    /// Redis answered, but the script failed in a way a retry cannot cure (answered 500).
    #[error(transparent)]
    Script(StoreError),
}

impl From<StoreError> for DecideError {
    fn from(e: StoreError) -> Self {
        if e.is_deterministic() {
            DecideError::Script(e)
        } else {
            DecideError::Unavailable(e)
        }
    }
}

/// Parses and validates a request body; the error names the field
/// (`decisions[0].capacity: invalid type ...`).
pub fn parse_request(body: &[u8]) -> Result<DecideRequest, DecideError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let request: DecideRequest = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        if path == "." || path.is_empty() {
            DecideError::Invalid(e.inner().to_string())
        } else {
            DecideError::Invalid(format!("{path}: {}", e.inner()))
        }
    })?;
    de.end()
        .map_err(|e| DecideError::Invalid(format!("trailing data after the JSON body: {e}")))?;
    validate(&request)?;
    Ok(request)
}

/// Checks what serde cannot: counts, lengths, keys without braces and named once, and that the
/// bucket parameters are numbers > 0.
pub fn validate(request: &DecideRequest) -> Result<(), DecideError> {
    let invalid = |s: String| Err(DecideError::Invalid(s));
    if request.decisions.is_empty() {
        return invalid("decisions: must hold at least one decision".into());
    }
    if request.decisions.len() > MAX_DECISIONS {
        return invalid(format!(
            "decisions: {} decisions, at most {MAX_DECISIONS} are accepted",
            request.decisions.len()
        ));
    }
    let mut seen: HashMap<&str, usize> = HashMap::with_capacity(request.decisions.len());
    for (i, d) in request.decisions.iter().enumerate() {
        if d.key.is_empty() || d.key.len() > MAX_KEY_BYTES {
            return invalid(format!(
                "decisions[{i}].key: must be 1 to {MAX_KEY_BYTES} bytes, got {}",
                d.key.len()
            ));
        }
        if d.key.contains(['{', '}']) {
            // The key goes between the braces of `<prefix>{<key>}`, the Cluster hash tag: a brace
            // inside would move the tag (bucket and attempt record in different slots) or make
            // one key's attempt record another key's name (`k}:a:x` is the record of `k`).
            return invalid(format!(
                "decisions[{i}].key: must not contain '{{' or '}}' (escape them, e.g. %7B %7D)"
            ));
        }
        if let Some(j) = seen.insert(d.key.as_str(), i) {
            // One attempt record per key and attempt: a key named twice would share it.
            return invalid(format!(
                "decisions[{i}].key: duplicate of decisions[{j}]; name each bucket once (add the costs)"
            ));
        }
        if let Some(a) = &d.attempt {
            if a.len() > MAX_KEY_BYTES {
                return invalid(format!(
                    "decisions[{i}].attempt: must be at most {MAX_KEY_BYTES} bytes, got {}",
                    a.len()
                ));
            }
        }
        for (name, v) in [
            ("capacity", d.capacity),
            ("refill_per_sec", d.refill_per_sec),
            ("cost", d.cost),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return invalid(format!(
                    "decisions[{i}].{name}: must be a number > 0, got {v}"
                ));
            }
        }
    }
    Ok(())
}

/// The Redis Cluster hash slot of a key: CRC16 (XMODEM) of its hash tag (the text between the
/// first `{` and the next `}`, when not empty) or of the whole key, modulo 16384.
pub fn cluster_slot(key: &[u8]) -> u16 {
    let tag = key.iter().position(|b| *b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        rest.iter()
            .position(|b| *b == b'}')
            .filter(|close| *close > 0)
            .map(|close| &rest[..close])
    });
    crc16::State::<crc16::XMODEM>::calculate(tag.unwrap_or(key)) % 16384
}

/// The decisions of one request that share a Cluster slot: one atomic script call.
#[derive(Debug)]
pub struct SlotGroup {
    /// Where each call sits in the request, ascending.
    pub indices: Vec<usize>,
    pub calls: Vec<BucketCall>,
    /// Some call got an attempt id generated by the sidecar (no caller can replay it).
    pub generated: bool,
}

/// The calls grouped by the slot of their bucket key, in slot order (moved, not copied).
pub fn group_by_slot(calls: Vec<BucketCall>) -> Vec<SlotGroup> {
    let mut groups: BTreeMap<u16, SlotGroup> = BTreeMap::new();
    for (i, c) in calls.into_iter().enumerate() {
        let g = groups
            .entry(cluster_slot(c.bucket_key.as_bytes()))
            .or_insert_with(|| SlotGroup {
                indices: Vec::new(),
                calls: Vec::new(),
                generated: false,
            });
        g.indices.push(i);
        g.calls.push(c);
    }
    groups.into_values().collect()
}

/// Runs decisions against a [`BucketStore`].
pub struct Decider<S> {
    store: Arc<S>,
    key_prefix: String,
    metrics: Arc<Metrics>,
}

impl<S: BucketStore> Decider<S> {
    pub fn new(store: Arc<S>, key_prefix: impl Into<String>, metrics: Arc<Metrics>) -> Self {
        Self {
            store,
            key_prefix: key_prefix.into(),
            metrics,
        }
    }

    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    /// The script's calls for a validated request, keys built from the prefix.
    pub fn calls(&self, request: &DecideRequest) -> Vec<BucketCall> {
        request
            .decisions
            .iter()
            .map(|d| {
                let bucket_key = format!("{}{{{}}}", self.key_prefix, d.key);
                let attempt = d.attempt.clone().unwrap_or_default();
                BucketCall {
                    attempt_key: format!("{bucket_key}:a:{attempt}"),
                    bucket_key,
                    capacity: d.capacity,
                    refill_per_sec: d.refill_per_sec,
                    cost: d.cost,
                    attempt,
                }
            })
            .collect()
    }

    /// Decides a request that [`validate`] accepted ([`parse_request`] validates); see the module
    /// doc for how all-or-nothing holds.
    pub async fn decide(&self, request: &DecideRequest) -> Result<DecideResponse, DecideError> {
        let calls = self.calls(request);
        let n = calls.len();
        let mut groups = if self.store.is_cluster() {
            group_by_slot(calls)
        } else {
            vec![SlotGroup {
                indices: (0..n).collect(),
                calls,
                generated: false,
            }]
        };
        if groups.len() > 1 {
            let mut generated: Option<String> = None;
            for g in &mut groups {
                for c in g.calls.iter_mut().filter(|c| c.attempt.is_empty()) {
                    let attempt = generated
                        .get_or_insert_with(|| format!("gen-{:032x}", rand::random::<u128>()));
                    c.attempt_key.push_str(attempt);
                    c.attempt.clone_from(attempt);
                    g.generated = true;
                }
            }
        }
        let answers =
            futures::future::join_all(groups.iter().map(|g| self.store.apply(&g.calls))).await;

        let mut outcomes: Vec<Option<Outcome>> = vec![None; n];
        // Per group: Some(charged) when it answered, None when it failed.
        let mut charged: Vec<Option<bool>> = Vec::with_capacity(groups.len());
        let mut failure = None;
        let mut rejected = false;
        for (g, answer) in groups.iter().zip(answers) {
            match answer {
                Ok(answered) => {
                    let mut group_charged = false;
                    for (&i, o) in g.indices.iter().zip(answered) {
                        group_charged |= o.charged;
                        rejected |= !o.charged;
                        outcomes[i] = Some(o);
                    }
                    charged.push(Some(group_charged));
                }
                Err(e) => {
                    charged.push(None);
                    failure = Some(e);
                }
            }
        }
        if let Some(e) = failure {
            if !rejected {
                // No verdict: 503. Refund what no caller can ever replay.
                let refunds: Vec<Vec<BucketCall>> = groups
                    .into_iter()
                    .filter(|g| g.generated)
                    .map(|g| g.calls)
                    .collect();
                self.refund_in_background(refunds, "a failed slot");
                return Err(e.into());
            }
            tracing::warn!("a slot failed ({e}) but another rejected: answering the rejection");
        }
        // Here a failure implies a rejection (the 503 case returned above).
        let allowed = !rejected;
        if !allowed {
            // Rejected: give back what charged, and what a failed slot may have charged.
            let refunds: Vec<Vec<BucketCall>> = groups
                .into_iter()
                .zip(&charged)
                .filter(|(_, c)| **c != Some(false))
                .map(|(g, _)| g.calls)
                .collect();
            self.refund_in_background(refunds, "a rejected slot");
        }
        let results: Vec<DecisionResult> = outcomes
            .into_iter()
            .zip(&request.decisions)
            .map(|(o, d)| {
                let mut o = o.unwrap_or(NO_ANSWER);
                if !allowed && o.charged {
                    // As it will be once the background refund has given `cost` back.
                    o.remaining = (o.remaining as f64 + d.cost).min(d.capacity) as u64;
                    o.reset_ms = o
                        .reset_ms
                        .saturating_sub((d.cost / d.refill_per_sec * 1000.0) as u64);
                }
                self.metrics.decision(o.allowed && allowed);
                DecisionResult {
                    allowed: o.allowed,
                    remaining: o.remaining,
                    retry_after_ms: o.retry_after_ms,
                    reset_ms: o.reset_ms,
                    reason: o.reason,
                }
            })
            .collect();
        Ok(DecideResponse { allowed, results })
    }

    /// Refunds `groups` (each one script call) in a task of its own, so neither the answer nor a
    /// caller that gives up waits for it or cancels it. Counts a compensation once every refund
    /// completed.
    fn refund_in_background(&self, groups: Vec<Vec<BucketCall>>, after: &'static str) {
        if groups.is_empty() {
            return;
        }
        let store = self.store.clone();
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            let refunds = futures::future::join_all(groups.iter().map(|b| store.refund(b))).await;
            let mut complete = true;
            for refund in refunds {
                if let Err(e) = refund {
                    complete = false;
                    tracing::warn!(
                        "refund after {after} did not complete, tokens stay deducted until they refill: {e}"
                    );
                }
            }
            if complete {
                metrics.compensations.inc();
            }
        });
    }
}

/// The answer for a decision whose slot failed while another slot rejected: not allowed (the
/// request does not pass), but its bucket refused nothing (`ok`), and no figures are known.
const NO_ANSWER: Outcome = Outcome {
    allowed: false,
    remaining: 0,
    retry_after_ms: 0,
    reset_ms: 0,
    reason: Reason::Ok,
    charged: false,
};

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use ratelimit_wire::{Decision, Reason};

    use super::*;

    fn decision(key: &str) -> Decision {
        Decision {
            key: key.into(),
            capacity: 10.0,
            refill_per_sec: 1.0,
            cost: 1.0,
            attempt: None,
        }
    }

    fn err(body: &str) -> String {
        match parse_request(body.as_bytes()) {
            Err(DecideError::Invalid(e)) => e,
            other => panic!("{body} should be invalid, got {other:?}"),
        }
    }

    #[test]
    fn validation_names_the_field() {
        assert!(err("nope").contains("expected"));
        assert!(err(r#"{"decisions":[]}"#).starts_with("decisions:"));
        let e = err(r#"{"decisions":[{"key":"k","refill_per_sec":1}]}"#);
        assert!(
            e.starts_with("decisions[0]") && e.contains("capacity"),
            "{e}"
        );
        let e = err(r#"{"decisions":[{"key":"k","capacity":"10","refill_per_sec":1}]}"#);
        assert!(e.starts_with("decisions[0].capacity:"), "{e}");
        let e = err(
            r#"{"decisions":[{"key":"k","capacity":1,"refill_per_sec":1},{"key":"j","capacity":0,"refill_per_sec":1}]}"#,
        );
        assert_eq!(e, "decisions[1].capacity: must be a number > 0, got 0");
        let e = err(r#"{"decisions":[{"key":"k","capacity":1,"refill_per_sec":-1}]}"#);
        assert!(e.starts_with("decisions[0].refill_per_sec:"), "{e}");
        let e = err(r#"{"decisions":[{"key":"k","capacity":1,"refill_per_sec":1,"cost":0}]}"#);
        assert!(e.starts_with("decisions[0].cost:"), "{e}");
        let e = err(r#"{"decisions":[{"key":"","capacity":1,"refill_per_sec":1}]}"#);
        assert!(e.starts_with("decisions[0].key:"), "{e}");
        for key in ["}x", "k}:a:x", "a{b", "x}", "{}"] {
            let e = err(&format!(
                r#"{{"decisions":[{{"key":"{key}","capacity":1,"refill_per_sec":1}}]}}"#
            ));
            assert!(
                e.starts_with("decisions[0].key: must not contain"),
                "{key}: {e}"
            );
        }
        let e = err(
            r#"{"decisions":[{"key":"a","capacity":1,"refill_per_sec":1},{"key":"b","capacity":1,"refill_per_sec":1},{"key":"a","capacity":2,"refill_per_sec":1}]}"#,
        );
        assert!(
            e.starts_with("decisions[2].key: duplicate of decisions[0]"),
            "{e}"
        );
        let e = err(r#"{"decisions":[{"key":"k","capacity":1,"refill_per_sec":1}]} x"#);
        assert!(e.contains("trailing"), "{e}");
        let e = err(r#"{"decisions":[{"key":"k","capacity":1,"refill_per_sec":1,"colour":1}]}"#);
        assert!(e.contains("colour"), "{e}");
    }

    #[test]
    fn limits_on_counts_and_lengths() {
        let mut r = DecideRequest {
            decisions: (0..=MAX_DECISIONS)
                .map(|i| decision(&format!("k{i}")))
                .collect(),
        };
        assert!(validate(&r).is_err());
        r.decisions.truncate(MAX_DECISIONS);
        assert!(validate(&r).is_ok());
        r.decisions[3].key = "x".repeat(MAX_KEY_BYTES + 1);
        assert!(validate(&r).is_err());
        r.decisions[3].key = "x".repeat(MAX_KEY_BYTES);
        assert!(validate(&r).is_ok());
        r.decisions[4].attempt = Some("a".repeat(MAX_KEY_BYTES + 1));
        assert!(validate(&r).is_err());
        r.decisions[4].attempt = None;
        r.decisions[5].cost = f64::INFINITY;
        assert!(validate(&r).is_err());
        r.decisions[5].cost = f64::NAN;
        assert!(validate(&r).is_err());
    }

    #[test]
    fn slots_follow_the_cluster_spec() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(cluster_slot(b"123456789"), 0x31C3);
        assert_eq!(cluster_slot(b"foo"), 12182);
        assert_eq!(
            cluster_slot(b"{user1000}.following"),
            cluster_slot(b"{user1000}.followers")
        );
        assert_eq!(cluster_slot(b"foo{}{bar}"), cluster_slot(b"foo{}{bar}"));
        assert_ne!(cluster_slot(b"foo{}{bar}"), cluster_slot(b"bar"));
        assert_eq!(cluster_slot(b"foo{{bar}}zap"), cluster_slot(b"{bar"));
        for key in ["a", "rl:{app:alpha}", "x{y}z", "{}", "{", "}{a}"] {
            assert_eq!(
                redis::cluster_routing::Slot::for_key(key),
                redis::cluster_routing::Slot::new(cluster_slot(key.as_bytes())).unwrap(),
                "{key}"
            );
        }
    }

    #[test]
    fn a_bucket_and_its_attempt_records_share_a_slot() {
        let d = Decider::new(Arc::new(Fake::default()), "rl:", Arc::new(Metrics::new()));
        for key in ["alpha", "a}b", "{x", "weird{}key", "x}", "{}"] {
            let mut r = DecideRequest {
                decisions: vec![decision(key)],
            };
            r.decisions[0].attempt = Some("r-1".into());
            let c = &d.calls(&r)[0];
            assert_eq!(
                cluster_slot(c.bucket_key.as_bytes()),
                cluster_slot(c.attempt_key.as_bytes()),
                "{c:?}"
            );
        }
    }

    #[test]
    fn grouping_keeps_request_order_within_a_slot() {
        let d = Decider::new(Arc::new(Fake::default()), "rl:", Arc::new(Metrics::new()));
        let keys: Vec<String> = (0..50).map(|i| format!("k{i}")).collect();
        let r = DecideRequest {
            decisions: keys.iter().map(|k| decision(k)).collect(),
        };
        let calls = d.calls(&r);
        let groups = group_by_slot(calls.clone());
        let mut seen: Vec<usize> = groups.iter().flat_map(|g| g.indices.clone()).collect();
        seen.sort();
        assert_eq!(seen, (0..50).collect::<Vec<_>>());
        for g in &groups {
            assert!(g.indices.windows(2).all(|w| w[0] < w[1]));
            let slot = cluster_slot(g.calls[0].bucket_key.as_bytes());
            for (&i, c) in g.indices.iter().zip(&g.calls) {
                assert_eq!(*c, calls[i]);
                assert_eq!(cluster_slot(c.bucket_key.as_bytes()), slot);
            }
        }
        assert!(groups.len() > 1);
    }

    /// A store that admits every bucket except the keys listed in `reject`, times out on a call
    /// that holds a key listed in `fail`, and records calls; `refund_hangs` makes refunds never
    /// finish.
    #[derive(Default)]
    struct Fake {
        cluster: bool,
        reject: Vec<String>,
        fail: Vec<String>,
        refund_hangs: bool,
        applied: Mutex<Vec<Vec<BucketCall>>>,
        refunded: Mutex<Vec<Vec<BucketCall>>>,
    }

    impl Fake {
        /// The refunds started so far, once `n` have been (they run in the background).
        async fn refunds(&self, n: usize) -> Vec<Vec<BucketCall>> {
            for _ in 0..200 {
                if self.refunded.lock().unwrap().len() >= n {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            self.refunded.lock().unwrap().clone()
        }

        /// The bucket keys refunded once at least `n` refunds arrived, sorted.
        async fn refunded_keys(&self, n: usize) -> Vec<String> {
            let mut keys: Vec<String> = self
                .refunds(n)
                .await
                .iter()
                .flatten()
                .map(|c| c.bucket_key.clone())
                .collect();
            keys.sort();
            keys
        }
    }

    impl BucketStore for Fake {
        async fn apply(&self, calls: &[BucketCall]) -> Result<Vec<Outcome>, StoreError> {
            self.applied.lock().unwrap().push(calls.to_vec());
            if calls.iter().any(|c| self.fail.contains(&c.bucket_key)) {
                return Err(StoreError::Timeout { timeout_ms: 50 });
            }
            let admit = calls.iter().all(|c| !self.reject.contains(&c.bucket_key));
            Ok(calls
                .iter()
                .map(|c| Outcome {
                    allowed: !self.reject.contains(&c.bucket_key),
                    remaining: if admit { 4 } else { 5 },
                    retry_after_ms: 0,
                    reset_ms: 0,
                    reason: Reason::Ok,
                    charged: admit,
                })
                .collect())
        }
        async fn refund(&self, calls: &[BucketCall]) -> Result<Vec<Outcome>, StoreError> {
            self.refunded.lock().unwrap().push(calls.to_vec());
            if self.refund_hangs {
                std::future::pending::<()>().await;
            }
            Ok(calls
                .iter()
                .map(|_| Outcome {
                    allowed: false,
                    remaining: 5,
                    retry_after_ms: 0,
                    reset_ms: 0,
                    reason: Reason::Ok,
                    charged: false,
                })
                .collect())
        }
        fn is_cluster(&self) -> bool {
            self.cluster
        }
    }

    fn two_slots() -> DecideRequest {
        assert_ne!(cluster_slot(b"rl:{a}"), cluster_slot(b"rl:{b}"));
        DecideRequest {
            decisions: vec![decision("a"), decision("b")],
        }
    }

    #[tokio::test]
    async fn single_node_sends_one_call_without_generated_attempts() {
        let fake = Arc::new(Fake::default());
        let d = Decider::new(fake.clone(), "rl:", Arc::new(Metrics::new()));
        let r = d.decide(&two_slots()).await.unwrap();
        assert!(r.allowed);
        let applied = fake.applied.lock().unwrap();
        assert_eq!(applied.len(), 1);
        assert!(applied[0].iter().all(|c| c.attempt.is_empty()));
    }

    #[tokio::test]
    async fn cross_slot_rejection_refunds_the_slots_that_charged() {
        let fake = Arc::new(Fake {
            cluster: true,
            reject: vec!["rl:{b}".into()],
            ..Fake::default()
        });
        let metrics = Arc::new(Metrics::new());
        let d = Decider::new(fake.clone(), "rl:", metrics.clone());
        let r = d.decide(&two_slots()).await.unwrap();
        assert!(!r.allowed);
        assert!(r.results[0].allowed && !r.results[1].allowed);
        assert_eq!(r.results[0].remaining, 5, "remaining after the refund");
        {
            let applied = fake.applied.lock().unwrap();
            assert_eq!(applied.len(), 2);
            let attempt = &applied[0][0].attempt;
            assert!(attempt.starts_with("gen-"), "{attempt}");
            assert!(applied[0][0].attempt_key.ends_with(attempt.as_str()));
        }
        let refunded = fake.refunds(1).await;
        assert_eq!(refunded.len(), 1);
        assert_eq!(refunded[0][0].bucket_key, "rl:{a}");
        for _ in 0..100 {
            if metrics.encode().contains("ratelimit_compensations_total 1") {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        panic!("the completed refund was never counted");
    }

    fn three_slots() -> DecideRequest {
        let slots = [b"rl:{a}", b"rl:{b}", b"rl:{c}"].map(|k| cluster_slot(k));
        assert!(slots[0] != slots[1] && slots[1] != slots[2] && slots[0] != slots[2]);
        DecideRequest {
            decisions: vec![decision("a"), decision("b"), decision("c")],
        }
    }

    #[tokio::test]
    async fn a_failed_slot_does_not_hide_a_rejection_from_another() {
        let fake = Arc::new(Fake {
            cluster: true,
            reject: vec!["rl:{b}".into()],
            fail: vec!["rl:{c}".into()],
            ..Fake::default()
        });
        let d = Decider::new(fake.clone(), "rl:", Arc::new(Metrics::new()));
        let r = d
            .decide(&three_slots())
            .await
            .expect("a rejection, not an error");
        assert!(!r.allowed);
        assert!(r.results[0].allowed, "a could pay (and is refunded)");
        assert!(!r.results[1].allowed);
        let c = &r.results[2];
        assert!(!c.allowed, "no answer from c: not allowed");
        assert_eq!(
            (c.reason, c.remaining, c.retry_after_ms),
            (Reason::Ok, 0, 0)
        );
        // The charged slot (a) and the failed one (c) are refunded, the rejecting one (b) is not.
        assert_eq!(fake.refunded_keys(2).await, ["rl:{a}", "rl:{c}"]);
    }

    #[tokio::test]
    async fn after_a_failure_every_generated_group_is_refunded_and_caller_attempts_stay() {
        let fake = Arc::new(Fake {
            cluster: true,
            fail: vec!["rl:{b}".into()],
            ..Fake::default()
        });
        let d = Decider::new(fake.clone(), "rl:", Arc::new(Metrics::new()));
        let mut req = three_slots();
        req.decisions[0].attempt = Some("r-1".into());
        assert!(matches!(
            d.decide(&req).await,
            Err(DecideError::Unavailable(StoreError::Timeout { .. }))
        ));
        // a carries the caller's id (a repeat would replay it): it stays. b (failed) and c
        // (charged) carry generated ids that nobody can replay: both are refunded.
        // The pause lets a wrong third refund (of a) arrive before the exact comparison.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert_eq!(fake.refunded_keys(2).await, ["rl:{b}", "rl:{c}"]);
    }

    #[tokio::test]
    async fn a_rejection_is_answered_without_waiting_for_the_refund() {
        let fake = Arc::new(Fake {
            cluster: true,
            reject: vec!["rl:{b}".into()],
            refund_hangs: true,
            ..Fake::default()
        });
        let metrics = Arc::new(Metrics::new());
        let d = Decider::new(fake.clone(), "rl:", metrics.clone());
        let r = tokio::time::timeout(std::time::Duration::from_secs(2), d.decide(&two_slots()))
            .await
            .expect("answered while the refund hangs")
            .unwrap();
        assert!(!r.allowed);
        assert_eq!(fake.refunds(1).await.len(), 1, "the refund was started");
        assert!(
            metrics.encode().contains("ratelimit_compensations_total 0"),
            "not counted before it completes"
        );
    }

    #[tokio::test]
    async fn cross_slot_admission_refunds_nothing_and_keeps_caller_attempts() {
        let fake = Arc::new(Fake {
            cluster: true,
            ..Fake::default()
        });
        let d = Decider::new(fake.clone(), "rl:", Arc::new(Metrics::new()));
        let mut req = two_slots();
        for x in &mut req.decisions {
            x.attempt = Some("r-1".into());
        }
        assert!(d.decide(&req).await.unwrap().allowed);
        assert!(fake.refunded.lock().unwrap().is_empty());
        let applied = fake.applied.lock().unwrap();
        assert!(applied.iter().flatten().all(|c| c.attempt == "r-1"));
    }
}
