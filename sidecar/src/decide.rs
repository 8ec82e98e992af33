//! The decision: validate a [`DecideRequest`], split it by Redis Cluster slot, run the bucket
//! script once per slot, and merge the answers in request order.
//!
//! # All-or-nothing across Cluster slots (compensation)
//!
//! One script call is atomic, but only within one slot. On a single Redis every decision of a
//! request goes into one call. On a Cluster the decisions are grouped by the slot of their bucket
//! key and the groups run concurrently; if every group admits, the request is admitted. If some
//! group rejects, the groups that charged are refunded (`refund` mode of the script, keyed by the
//! attempt record, idempotent). For that a cross-slot request needs attempt ids: when the caller
//! gave none, one random id is generated for that request (single-slot requests need none).
//!
//! The price is a short window (one Redis round trip) in which a charged group holds tokens for a
//! request that will be rejected: concurrent requests on that bucket may then be rejected although
//! tokens were about to come back. The window can only over-REJECT, never over-admit. If the
//! refund itself fails (Redis down), the tokens stay deducted until they refill.
//!
//! When a group fails (timeout, connection), the request answers 503. Groups that charged stay
//! charged when the caller supplied attempt ids (its retry replays them and completes the rest);
//! with generated ids no retry can ever replay them, so they are refunded in the background.

use std::collections::BTreeMap;
use std::sync::Arc;

use ratelimit_wire::{DecideRequest, DecideResponse, DecisionResult, MAX_DECISIONS, MAX_KEY_BYTES};

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
    Unavailable(#[from] StoreError),
}

/// Parses a request body; the error names the field (`decisions[0].capacity: invalid type ...`).
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

/// Checks what serde cannot: counts, lengths, and that the bucket parameters are numbers > 0.
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
    for (i, d) in request.decisions.iter().enumerate() {
        if d.key.is_empty() || d.key.len() > MAX_KEY_BYTES {
            return invalid(format!(
                "decisions[{i}].key: must be 1 to {MAX_KEY_BYTES} bytes, got {}",
                d.key.len()
            ));
        }
        if d.key.starts_with('}') {
            // `<prefix>{}...` has an empty hash tag: Cluster would hash the whole key, and the
            // bucket and its attempt records could land in different slots.
            return invalid(format!("decisions[{i}].key: must not start with '}}'"));
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

/// Indices of the calls grouped by the slot of their bucket key, in slot order.
pub fn group_by_slot(calls: &[BucketCall]) -> Vec<Vec<usize>> {
    let mut groups: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
    for (i, c) in calls.iter().enumerate() {
        groups
            .entry(cluster_slot(c.bucket_key.as_bytes()))
            .or_default()
            .push(i);
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

    /// Decides a validated request (see the module doc for how all-or-nothing holds).
    pub async fn decide(&self, request: &DecideRequest) -> Result<DecideResponse, DecideError> {
        validate(request)?;
        let mut calls = self.calls(request);
        let groups = if self.store.is_cluster() {
            group_by_slot(&calls)
        } else {
            vec![(0..calls.len()).collect()]
        };
        let mut generated_attempts = false;
        if groups.len() > 1 && calls.iter().any(|c| c.attempt.is_empty()) {
            let attempt = format!("gen-{:032x}", rand::random::<u128>());
            for c in calls.iter_mut().filter(|c| c.attempt.is_empty()) {
                c.attempt_key.push_str(&attempt);
                c.attempt = attempt.clone();
            }
            generated_attempts = true;
        }
        let batches: Vec<Vec<BucketCall>> = groups
            .iter()
            .map(|g| g.iter().map(|&i| calls[i].clone()).collect())
            .collect();
        let answers = futures::future::join_all(batches.iter().map(|b| self.store.apply(b))).await;

        let mut outcomes: Vec<Option<Outcome>> = vec![None; calls.len()];
        let mut failure = None;
        for (group, answer) in groups.iter().zip(answers) {
            match answer {
                Ok(o) => {
                    for (&i, o) in group.iter().zip(o) {
                        outcomes[i] = Some(o);
                    }
                }
                Err(e) => failure = Some(e),
            }
        }
        // The groups whose attempt deducted tokens: the ones to refund if the request fails.
        let charged: Vec<(Vec<usize>, Vec<BucketCall>)> = groups
            .iter()
            .zip(&batches)
            .filter(|(g, _)| g.iter().any(|&i| outcomes[i].is_some_and(|o| o.charged)))
            .map(|(g, b)| (g.clone(), b.clone()))
            .collect();
        if let Some(e) = failure {
            if generated_attempts && !charged.is_empty() {
                let store = self.store.clone();
                let metrics = self.metrics.clone();
                tokio::spawn(async move {
                    metrics.compensations.inc();
                    for (_, batch) in charged {
                        if let Err(e) = store.refund(&batch).await {
                            tracing::warn!("refund after a failed slot did not complete: {e}");
                        }
                    }
                });
            }
            return Err(e.into());
        }
        let mut outcomes: Vec<Outcome> = outcomes.into_iter().flatten().collect();
        let allowed = outcomes.iter().all(|o| o.charged);
        if !allowed && !charged.is_empty() {
            self.metrics.compensations.inc();
            let refunds =
                futures::future::join_all(charged.iter().map(|(_, b)| self.store.refund(b))).await;
            for ((group, _), refund) in charged.iter().zip(refunds) {
                match refund {
                    Ok(r) => {
                        for (&i, r) in group.iter().zip(r) {
                            outcomes[i].remaining = r.remaining;
                            outcomes[i].reset_ms = r.reset_ms;
                            outcomes[i].charged = false;
                        }
                    }
                    Err(e) => tracing::warn!(
                        "compensation failed, tokens stay deducted until they refill: {e}"
                    ),
                }
            }
        }
        for o in &outcomes {
            self.metrics.decision(o.allowed && allowed);
        }
        Ok(DecideResponse {
            allowed,
            results: outcomes
                .into_iter()
                .map(|o| DecisionResult {
                    allowed: o.allowed,
                    remaining: o.remaining,
                    retry_after_ms: o.retry_after_ms,
                    reset_ms: o.reset_ms,
                    reason: o.reason,
                })
                .collect(),
        })
    }
}

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
            r#"{"decisions":[{"key":"k","capacity":1,"refill_per_sec":1},{"key":"k","capacity":0,"refill_per_sec":1}]}"#,
        );
        assert_eq!(e, "decisions[1].capacity: must be a number > 0, got 0");
        let e = err(r#"{"decisions":[{"key":"k","capacity":1,"refill_per_sec":-1}]}"#);
        assert!(e.starts_with("decisions[0].refill_per_sec:"), "{e}");
        let e = err(r#"{"decisions":[{"key":"k","capacity":1,"refill_per_sec":1,"cost":0}]}"#);
        assert!(e.starts_with("decisions[0].cost:"), "{e}");
        let e = err(r#"{"decisions":[{"key":"","capacity":1,"refill_per_sec":1}]}"#);
        assert!(e.starts_with("decisions[0].key:"), "{e}");
        let e = err(r#"{"decisions":[{"key":"}x","capacity":1,"refill_per_sec":1}]}"#);
        assert!(e.starts_with("decisions[0].key:"), "{e}");
        let e = err(r#"{"decisions":[{"key":"k","capacity":1,"refill_per_sec":1}]} x"#);
        assert!(e.contains("trailing"), "{e}");
        let e = err(r#"{"decisions":[{"key":"k","capacity":1,"refill_per_sec":1,"colour":1}]}"#);
        assert!(e.contains("colour"), "{e}");
    }

    #[test]
    fn limits_on_counts_and_lengths() {
        let mut r = DecideRequest {
            decisions: vec![decision("k"); MAX_DECISIONS + 1],
        };
        assert!(validate(&r).is_err());
        r.decisions.truncate(MAX_DECISIONS);
        assert!(validate(&r).is_ok());
        r.decisions[3].key = "x".repeat(MAX_KEY_BYTES + 1);
        assert!(validate(&r).is_err());
        r.decisions[3].key = "x".repeat(MAX_KEY_BYTES);
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
        let groups = group_by_slot(&d.calls(&r));
        let mut seen: Vec<usize> = groups.iter().flatten().copied().collect();
        seen.sort();
        assert_eq!(seen, (0..50).collect::<Vec<_>>());
        for g in &groups {
            assert!(g.windows(2).all(|w| w[0] < w[1]));
            let slot = cluster_slot(d.calls(&r)[g[0]].bucket_key.as_bytes());
            assert!(g
                .iter()
                .all(|&i| cluster_slot(d.calls(&r)[i].bucket_key.as_bytes()) == slot));
        }
        assert!(groups.len() > 1);
    }

    /// A store that admits every bucket except the keys listed in `reject`, and records calls.
    #[derive(Default)]
    struct Fake {
        cluster: bool,
        reject: Vec<String>,
        applied: Mutex<Vec<Vec<BucketCall>>>,
        refunded: Mutex<Vec<Vec<BucketCall>>>,
    }

    impl BucketStore for Fake {
        async fn apply(&self, calls: &[BucketCall]) -> Result<Vec<Outcome>, StoreError> {
            self.applied.lock().unwrap().push(calls.to_vec());
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
        let applied = fake.applied.lock().unwrap();
        assert_eq!(applied.len(), 2);
        let attempt = &applied[0][0].attempt;
        assert!(attempt.starts_with("gen-"), "{attempt}");
        assert!(applied[0][0].attempt_key.ends_with(attempt.as_str()));
        let refunded = fake.refunded.lock().unwrap();
        assert_eq!(refunded.len(), 1);
        assert_eq!(refunded[0][0].bucket_key, "rl:{a}");
        assert!(metrics.encode().contains("ratelimit_compensations_total 1"));
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
