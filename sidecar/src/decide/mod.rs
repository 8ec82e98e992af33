//! The decision: validate a call ([`validate`]), resolve each decision's limit in the policy,
//! hand the store ([`BucketStore`]) the requests with something to charge, and answer each
//! request from the store's outcomes. The decider never learns where a bucket is kept: placing
//! requests on Redis nodes, and keeping a request all-or-nothing across them, is the store's
//! (`crate::store::redis`).
//!
//! A call carries many requests (the filter coalesces them); each is all-or-nothing on its own.
//! Its decisions resolve to a limit (or to "unlimited" / "blocked", answered without the store,
//! or to an unknown rule: a configuration error answered for that request, which the gateway
//! handles with its failure policy). The rest become charges. A request the store could not
//! decide is answered with the store's error (unavailable, or the script failed); a decision
//! whose bucket answered nothing is answered `allowed: false`, `reason: ok`, with no figures.
//!
//! The whole decision runs in a task of its own (see [`crate::http`]), so a caller that hangs up
//! cancels neither the store's calls in flight nor the refunds that follow them.
//!
//! # Regional rules
//!
//! A decision of a regional rule (`docs/regions.md`) is charged under this region's share: its
//! bucket carries the share history this sidecar holds under a lease ([`RegionalShares`]), and
//! the script takes the bucket under the smallest share since its last decision. Without a valid
//! lease the request is answered "unavailable" (the gateway's `on_error` decides). The answer's
//! applied limit is the region's: the rule's numbers scaled by the share in force.

mod validate;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use ratelimit_wire::{
    AppliedLimit, DecideRequest, DecideResponse, DecisionResult, ErrorCode, LeaseAsk, Reason,
    RequestAnswer, RequestError,
};

use ratelimit_regions::ShareHistory;

use crate::keys::bucket_key;
use crate::metrics::{Metrics, Verdict};
use crate::policy::own_format::RULE_KEY;
use crate::policy::reload::PolicyHandle;
use crate::policy::{Limit, LimitKind, Policy, Resolution};
use crate::regional::RegionalShares;
use crate::store::{
    Bucket, BucketStore, Call, Charge, Decided, Outcome, Readiness, Return, StoreError,
};

pub use validate::{parse_request, validate, DecideError, MAX_ERROR_BYTES, MAX_LEASE_TTL_MS};

/// Descriptor entries: (key, value), a `None` value being an unknown subject.
pub type Entries = Vec<(String, Option<String>)>;

/// One decision in the generic form both APIs share: descriptor entries, a cost, a lease ask.
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    pub entries: Entries,
    pub cost: u64,
    pub lease: Option<LeaseAsk>,
}

/// Unused lease tokens given back, in the generic form.
#[derive(Debug, Clone, PartialEq)]
pub struct ReturnItem {
    pub entries: Entries,
    pub lease_id: u64,
    pub tokens: u64,
}

/// Who asks: the wasm filter names rules (a rule the policy lacks is a configuration error), Envoy's
/// rate limit API sends descriptors (one that matches no limit is simply not limited).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    Filter,
    RateLimitService,
}

/// A resolved decision.
enum Plan {
    /// Charged in the store (under this region's share history, for a regional limit).
    Charge {
        limit: Arc<Limit>,
        key: Arc<str>,
        bucket: Bucket,
    },
    /// Answered here: unlimited (or not limited at all, for Envoy's API).
    Unlimited { limit: Option<Arc<Limit>> },
    /// Answered here: never admitted.
    Blocked { limit: Arc<Limit> },
}

/// Runs decisions against a [`BucketStore`] under the policy in force.
pub struct Decider<S> {
    store: Arc<S>,
    policy: Arc<PolicyHandle>,
    key_prefix: String,
    metrics: Arc<Metrics>,
    /// Unknown (domain, rule) pairs already logged, so a misconfigured gateway does not flood the
    /// log (bounded; every occurrence is still counted).
    logged_unknown: Mutex<HashSet<(String, String)>>,
    /// This region's shares of the regional rules (with `--region`).
    regional: Option<Arc<RegionalShares>>,
}

impl<S: BucketStore> Decider<S> {
    pub fn new(
        store: Arc<S>,
        policy: Arc<PolicyHandle>,
        key_prefix: impl Into<String>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            store,
            policy,
            key_prefix: key_prefix.into(),
            metrics,
            logged_unknown: Mutex::new(HashSet::new()),
            regional: None,
        }
    }

    /// Decides regional rules under `shares` (this sidecar's region).
    pub fn with_regional(mut self, shares: Arc<RegionalShares>) -> Self {
        self.regional = Some(shares);
        self
    }

    pub fn regional(&self) -> Option<&Arc<RegionalShares>> {
        self.regional.as_ref()
    }

    /// What `/readyz` reports: the store's readiness, and with regional rules the shares this
    /// region applies (not ready until each was read once).
    pub async fn readiness(&self) -> Readiness {
        let mut r = self.store.readiness().await;
        if let Some(shares) = &self.regional {
            let policy = self.policy.current();
            if !shares.all_read(&policy) {
                r.error.get_or_insert_with(|| {
                    "the regional shares have not all been read yet".to_string()
                });
                r.redis_ok = false;
            }
            r.regional_shares = Some(shares.status(&policy));
        }
        r
    }

    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    pub fn policy(&self) -> &Arc<PolicyHandle> {
        &self.policy
    }

    /// Decides a call that [`validate`] accepted ([`parse_request`] validates).
    pub async fn decide(&self, call: DecideRequest) -> DecideResponse {
        let requests: Vec<Vec<Item>> = call
            .requests
            .into_iter()
            .map(|r| {
                r.decisions
                    .into_iter()
                    .map(|d| Item {
                        entries: rule_entries(d.rule, d.subject),
                        cost: d.cost,
                        lease: d.lease,
                    })
                    .collect()
            })
            .collect();
        let returns: Vec<ReturnItem> = call
            .returns
            .into_iter()
            .map(|r| ReturnItem {
                entries: rule_entries(r.rule, r.subject),
                lease_id: r.id,
                tokens: r.tokens,
            })
            .collect();
        let answers = self
            .run(
                &call.domain,
                call.attempt.as_deref(),
                requests,
                returns,
                Caller::Filter,
            )
            .await;
        DecideResponse { answers }
    }

    /// Decides requests of generic items (both APIs end here).
    pub async fn run(
        &self,
        domain: &str,
        attempt: Option<&str>,
        requests: Vec<Vec<Item>>,
        returns: Vec<ReturnItem>,
        caller: Caller,
    ) -> Vec<RequestAnswer> {
        let policy = self.policy.current().clone();
        let mut answers: Vec<Option<RequestAnswer>> = vec![None; requests.len()];
        let mut plans: Vec<Vec<Plan>> = Vec::with_capacity(requests.len());
        for (r, items) in requests.iter().enumerate() {
            match self.plan(&policy, domain, items, caller) {
                Ok(p) => plans.push(p),
                Err(e) => {
                    answers[r] = Some(error_answer(e));
                    plans.push(Vec::new());
                }
            }
        }
        let returns = self.plan_returns(&policy, domain, &returns);
        drop(policy);

        // The store decides the requests with something to charge; those a blocked limit
        // rejects, and those with nothing to charge, are answered here.
        let mut sent: Vec<usize> = Vec::new();
        let mut charges: Vec<Vec<Charge>> = Vec::new();
        for (r, plan) in plans.iter().enumerate() {
            if answers[r].is_some() || blocked(plan) {
                continue;
            }
            let request: Vec<Charge> = plan
                .iter()
                .zip(&requests[r])
                .filter_map(|(p, item)| charge(p, item))
                .collect();
            if !request.is_empty() {
                sent.push(r);
                charges.push(request);
            }
        }
        let mut decided: Vec<Option<Result<Decided, StoreError>>> =
            (0..requests.len()).map(|_| None).collect();
        if !charges.is_empty() || !returns.is_empty() {
            let call = Call {
                attempt: attempt.map(str::to_string),
                requests: charges,
                returns,
            };
            for (r, d) in sent.into_iter().zip(self.store.decide(call).await) {
                decided[r] = Some(d);
            }
        }

        let mut tally = Tally::default();
        for (r, plan) in plans.iter().enumerate() {
            if answers[r].is_some() {
                continue;
            }
            answers[r] = Some(match decided[r].take() {
                Some(Err(e)) => error_answer(from_store(&e)),
                Some(Ok(d)) => self.answer(&mut tally, plan, &requests[r], d),
                // Rejected by a blocked limit, or nothing to charge.
                None => self.answer(
                    &mut tally,
                    plan,
                    &requests[r],
                    Decided {
                        admitted: !blocked(plan),
                        decisions: Vec::new(),
                    },
                ),
            });
        }
        tally.add_to(&self.metrics);
        answers
            .into_iter()
            .map(|a| a.expect("every request answered"))
            .collect()
    }

    /// Resolves a request's items; an unknown rule (filter) fails the request.
    fn plan(
        &self,
        policy: &Policy,
        domain: &str,
        items: &[Item],
        caller: Caller,
    ) -> Result<Vec<Plan>, RequestError> {
        let mut plans = Vec::with_capacity(items.len());
        for item in items {
            let entries: Vec<(&str, Option<&str>)> = item
                .entries
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_deref()))
                .collect();
            let plan = match policy.resolve(domain, &entries) {
                Resolution::Limit(limit) => {
                    let limit = limit.clone();
                    match limit.kind {
                        LimitKind::Bucket {
                            capacity,
                            refill_per_sec,
                        } => Plan::Charge {
                            key: Arc::from(bucket_key(&self.key_prefix, domain, &entries)),
                            bucket: Bucket {
                                capacity,
                                refill_per_sec,
                                share: self.share_for(&limit)?,
                            },
                            limit,
                        },
                        LimitKind::Unlimited => Plan::Unlimited { limit: Some(limit) },
                        LimitKind::Blocked => Plan::Blocked { limit },
                    }
                }
                Resolution::NoLimit if caller == Caller::RateLimitService => {
                    Plan::Unlimited { limit: None }
                }
                Resolution::NoLimit | Resolution::UnknownDomain => {
                    let rule = entries
                        .first()
                        .filter(|(k, _)| *k == RULE_KEY)
                        .and_then(|(_, v)| *v)
                        .unwrap_or("");
                    self.metrics.unknown_rule();
                    let first = self
                        .logged_unknown
                        .lock()
                        .map(|mut seen| {
                            seen.len() < 1000 && seen.insert((domain.into(), rule.into()))
                        })
                        .unwrap_or(false);
                    let message = if matches!(
                        policy.resolve(domain, &[]),
                        Resolution::UnknownDomain
                    ) {
                        format!("unknown domain {domain:?}: no policy file defines it")
                    } else {
                        format!("unknown rule {rule:?} in domain {domain:?} (or no limit matches its subject)")
                    };
                    if first {
                        tracing::error!("configuration error: {message}");
                    }
                    return Err(RequestError {
                        code: ErrorCode::UnknownRule,
                        message,
                    });
                }
            };
            plans.push(plan);
        }
        // envoyproxy/ratelimit's `replaces`: a limit named by another applicable limit's
        // `replaces` does not apply to this request.
        let replaced: HashSet<String> = plans
            .iter()
            .filter_map(plan_limit)
            .flat_map(|l| l.replaces.iter().cloned())
            .collect();
        if !replaced.is_empty() {
            for p in &mut plans {
                if plan_limit(p).is_some_and(|l| replaced.contains(&l.name)) {
                    *p = Plan::Unlimited { limit: None };
                }
            }
        }
        Ok(plans)
    }

    /// The share history a regional limit is charged under; none for other limits. A regional
    /// limit without a share under lease fails the request as "unavailable".
    fn share_for(&self, limit: &Limit) -> Result<Option<Arc<ShareHistory>>, RequestError> {
        let Some(rule) = &limit.regional else {
            return Ok(None);
        };
        let unavailable = |message: String| RequestError {
            code: ErrorCode::Unavailable,
            message,
        };
        match &self.regional {
            None => Err(unavailable(format!(
                "rule {:?} is regional and this sidecar has no region (--region)",
                rule.rule
            ))),
            Some(shares) => shares.share_for(rule).map(Some).map_err(unavailable),
        }
    }

    fn plan_returns(&self, policy: &Policy, domain: &str, returns: &[ReturnItem]) -> Vec<Return> {
        returns
            .iter()
            .filter_map(|r| {
                let entries: Vec<(&str, Option<&str>)> = r
                    .entries
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_deref()))
                    .collect();
                let Resolution::Limit(limit) = policy.resolve(domain, &entries) else {
                    return None;
                };
                let LimitKind::Bucket {
                    capacity,
                    refill_per_sec,
                } = limit.kind
                else {
                    return None;
                };
                // Without a share under lease the tokens are not given back (under-admission).
                let share = self.share_for(limit).ok()?;
                Some(Return {
                    key: Arc::from(bucket_key(&self.key_prefix, domain, &entries)),
                    bucket: Bucket {
                        capacity,
                        refill_per_sec,
                        share,
                    },
                    lease_id: r.lease_id,
                    tokens: r.tokens,
                })
            })
            .collect()
    }

    /// A request's answer from what the store answered: `decided.decisions` holds one outcome per
    /// charge of `plan`, in order (none when nothing was sent).
    fn answer<'p>(
        &self,
        tally: &mut Tally<'p>,
        plan: &'p [Plan],
        items: &[Item],
        decided: Decided,
    ) -> RequestAnswer {
        let mut outcomes = decided.decisions.into_iter();
        let results = plan
            .iter()
            .zip(items)
            .map(|(p, item)| {
                let outcome = match p {
                    Plan::Charge { .. } => outcomes.next().flatten(),
                    _ => None,
                };
                self.result(tally, p, outcome, decided.admitted, item.cost)
            })
            .collect();
        RequestAnswer {
            allowed: decided.admitted,
            results,
            error: None,
        }
    }

    /// The wire result of one decision: `outcome` is its bucket's answer, when it has one.
    fn result<'p>(
        &self,
        tally: &mut Tally<'p>,
        plan: &'p Plan,
        outcome: Option<Outcome>,
        request_allowed: bool,
        cost: u64,
    ) -> DecisionResult {
        match plan {
            Plan::Unlimited { limit } => {
                if let Some(l) = limit {
                    tally.add(&l.name, Verdict::Unlimited);
                }
                DecisionResult {
                    allowed: true,
                    remaining: 0,
                    retry_after_ms: 0,
                    reset_ms: 0,
                    reason: Reason::Unlimited,
                    limit: None,
                    shadow: false,
                    leased: 0,
                }
            }
            Plan::Blocked { limit } => {
                tally.add(
                    &limit.name,
                    if limit.shadow {
                        Verdict::ShadowRejected
                    } else {
                        Verdict::Blocked
                    },
                );
                DecisionResult {
                    allowed: limit.shadow,
                    remaining: 0,
                    retry_after_ms: 0,
                    reset_ms: 0,
                    reason: Reason::Blocked,
                    limit: Some(AppliedLimit {
                        name: limit.name.clone(),
                        capacity: 0,
                        refill_per_sec: 0.0,
                    }),
                    shadow: limit.shadow,
                    leased: 0,
                }
            }
            Plan::Charge { limit, bucket, .. } => {
                // A regional limit applies the region's part: the numbers under the share in
                // force.
                let (capacity, refill_per_sec) = bucket.in_force();
                let applied = Some(AppliedLimit {
                    name: limit.name.clone(),
                    capacity,
                    refill_per_sec,
                });
                let Some(o) = outcome else {
                    // Its bucket answered nothing (its node failed while another rejected), or
                    // the request was rejected before it was sent: no figures.
                    return DecisionResult {
                        allowed: false,
                        remaining: 0,
                        retry_after_ms: 0,
                        reset_ms: 0,
                        reason: Reason::Ok,
                        limit: applied,
                        shadow: limit.shadow,
                        leased: 0,
                    };
                };
                let verdict = match (o.allowed, limit.shadow) {
                    (true, _) if request_allowed => Verdict::Allowed,
                    (true, _) => Verdict::NotCharged,
                    (false, true) => Verdict::ShadowRejected,
                    (false, false) => Verdict::Rejected,
                };
                tally.add(&limit.name, verdict);
                if let (Some(rule), Some(shares)) = (&limit.regional, &self.regional) {
                    // The demand the rebalancer reads, in tokens: taken (cost and lease) or refused.
                    match verdict {
                        Verdict::Allowed => shares.count(rule, cost + o.leased, 0),
                        Verdict::Rejected | Verdict::ShadowRejected => shares.count(rule, 0, cost),
                        _ => {}
                    }
                }
                DecisionResult {
                    allowed: o.allowed || limit.shadow,
                    remaining: o.remaining,
                    retry_after_ms: o.retry_after_ms,
                    reset_ms: o.reset_ms,
                    reason: o.reason,
                    limit: applied,
                    shadow: limit.shadow,
                    leased: if request_allowed { o.leased } else { 0 },
                }
            }
        }
    }
}

/// The entries of a filter decision: `rule=<name>`, then the subject.
fn rule_entries(rule: String, subject: ratelimit_wire::Subject) -> Entries {
    let mut entries = Vec::with_capacity(1 + subject.0.len());
    entries.push((RULE_KEY.to_string(), Some(rule)));
    entries.extend(subject.0);
    entries
}

/// What the store charges for a planned decision, if anything.
fn charge(plan: &Plan, item: &Item) -> Option<Charge> {
    let Plan::Charge { limit, key, bucket } = plan else {
        return None;
    };
    Some(Charge {
        key: key.clone(),
        bucket: bucket.clone(),
        cost: item.cost,
        shadow: limit.shadow,
        lease: item.lease.filter(|l| l.tokens > 0),
    })
}

/// A call's decisions counted per limit and verdict, added to the metrics once each (a label
/// lookup per limit and call, not per decision).
#[derive(Default)]
struct Tally<'a>(Vec<(&'a str, Verdict, u64)>);

impl<'a> Tally<'a> {
    fn add(&mut self, limit: &'a str, verdict: Verdict) {
        match self
            .0
            .iter_mut()
            .find(|(l, v, _)| *v == verdict && *l == limit)
        {
            Some((_, _, n)) => *n += 1,
            None => self.0.push((limit, verdict, 1)),
        }
    }

    fn add_to(self, metrics: &Metrics) {
        for (limit, verdict, n) in self.0 {
            metrics.decisions_of(limit, verdict, n);
        }
    }
}

fn plan_limit(p: &Plan) -> Option<&Limit> {
    match p {
        Plan::Charge { limit, .. } | Plan::Blocked { limit } => Some(limit),
        Plan::Unlimited { limit } => limit.as_deref(),
    }
}

/// A non-shadow blocked limit rejects the request before anything is sent.
fn blocked(plan: &[Plan]) -> bool {
    plan.iter()
        .any(|p| matches!(p, Plan::Blocked { limit } if !limit.shadow))
}

fn error_answer(e: RequestError) -> RequestAnswer {
    RequestAnswer {
        allowed: false,
        results: Vec::new(),
        error: Some(e),
    }
}

fn from_store(e: &StoreError) -> RequestError {
    RequestError {
        code: if e.is_deterministic() {
            ErrorCode::ScriptFailed
        } else {
            ErrorCode::Unavailable
        },
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use ratelimit_wire::{Decision, RequestDecisions, Subject};

    use super::*;
    use crate::policy::Bounds;
    use crate::regional::RegionalShares;
    use crate::store::memory::MemoryStore;

    const T0: u64 = 1_700_000_000_000_000;

    const POLICY: &str = r#"
rules:
  per-app:
    capacity: 5
    refill_per_sec: 1
    overrides:
      - when: {app: vip}
        unlimited: true
      - when: {app: banned}
        blocked: true
  per-ip: {capacity: 2, refill_per_sec: 1}
  trial: {capacity: 1, refill_per_sec: 1, shadow_mode: true}
"#;

    fn policy(metrics: &Arc<Metrics>) -> Arc<PolicyHandle> {
        let p = Policy::from_sources(&[("limits.yaml".into(), POLICY.into())], &Bounds::default())
            .unwrap();
        PolicyHandle::fixed(p, metrics.clone())
    }

    fn decision(rule: &str, dims: &[(&str, Option<&str>)]) -> Decision {
        let mut subject = Subject::new();
        for (k, v) in dims {
            subject.push(*k, v.map(String::from));
        }
        Decision {
            rule: rule.into(),
            subject,
            cost: 1,
            lease: None,
        }
    }

    fn call(requests: Vec<Vec<Decision>>) -> DecideRequest {
        DecideRequest {
            domain: "ratelimit".into(),
            attempt: None,
            requests: requests
                .into_iter()
                .map(|decisions| RequestDecisions { decisions })
                .collect(),
            returns: Vec::new(),
        }
    }

    fn decider<S: BucketStore>(store: Arc<S>) -> (Decider<S>, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        (
            Decider::new(store, policy(&metrics), "rl:", metrics.clone()),
            metrics,
        )
    }

    #[tokio::test]
    async fn a_bucket_admits_its_capacity_and_answers_with_the_limit_it_applied() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, _) = decider(store);
        for i in 0..5 {
            let a = d
                .decide(call(vec![vec![decision("per-app", &[("app", Some("a"))])]]))
                .await;
            assert!(a.answers[0].allowed, "request {i}");
            let r = &a.answers[0].results[0];
            assert_eq!(r.remaining, 4 - i);
            assert_eq!(
                r.limit,
                Some(AppliedLimit {
                    name: "per-app".into(),
                    capacity: 5,
                    refill_per_sec: 1.0
                })
            );
        }
        let a = d
            .decide(call(vec![vec![decision("per-app", &[("app", Some("a"))])]]))
            .await;
        assert!(!a.answers[0].allowed);
        assert_eq!(a.answers[0].results[0].reason, Reason::Insufficient);
        assert_eq!(a.answers[0].results[0].retry_after_ms, 1000);
    }

    #[tokio::test]
    async fn requests_of_one_call_are_decided_in_order_each_all_or_nothing() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, metrics) = decider(store.clone());
        let both = || {
            vec![
                decision("per-app", &[("app", Some("a"))]),
                decision("per-ip", &[("ip", Some("1.2.3.4"))]),
            ]
        };
        let a = d.decide(call(vec![both(), both(), both()])).await;
        let allowed: Vec<bool> = a.answers.iter().map(|a| a.allowed).collect();
        assert_eq!(allowed, [true, true, false], "per-ip holds 2");
        // The third request's per-app decision could pay but was not charged.
        assert!(a.answers[2].results[0].allowed);
        // Counted per limit and verdict once per call, each decision in its count.
        let text = metrics.encode();
        for line in [
            "ratelimit_decisions_total{limit=\"per-app\",verdict=\"allowed\"} 2",
            "ratelimit_decisions_total{limit=\"per-app\",verdict=\"not_charged\"} 1",
            "ratelimit_decisions_total{limit=\"per-ip\",verdict=\"allowed\"} 2",
            "ratelimit_decisions_total{limit=\"per-ip\",verdict=\"rejected\"} 1",
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
        assert_eq!(
            store.stored_tokens("rl:{ratelimit|rule=per-app|app=a}"),
            Some(3.0)
        );
    }

    #[tokio::test]
    async fn overrides_unknown_rules_and_shadow_mode() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, metrics) = decider(store.clone());
        let a = d
            .decide(call(vec![
                vec![decision("per-app", &[("app", Some("vip"))])],
                vec![decision("per-app", &[("app", Some("banned"))])],
                vec![decision("nope", &[])],
                vec![decision("trial", &[]), decision("trial", &[])],
            ]))
            .await;
        assert!(a.answers[0].allowed);
        assert_eq!(a.answers[0].results[0].reason, Reason::Unlimited);
        assert!(!a.answers[1].allowed);
        assert_eq!(a.answers[1].results[0].reason, Reason::Blocked);
        let e = a.answers[2].error.as_ref().expect("unknown rule");
        assert_eq!(e.code, ErrorCode::UnknownRule);
        assert!(e.message.contains("\"nope\""), "{}", e.message);
        // Shadow mode: the second decision finds the bucket empty but does not reject.
        assert!(a.answers[3].allowed);
        assert!(a.answers[3].results[1].shadow);
        assert_eq!(a.answers[3].results[1].reason, Reason::Insufficient);
        assert_eq!(
            store.stored_tokens("rl:{ratelimit|rule=per-app|app=vip}"),
            None
        );
        let text = metrics.encode();
        assert!(text.contains("ratelimit_unknown_rule_total 1"), "{text}");
        assert!(
            text.contains(
                "ratelimit_decisions_total{limit=\"trial\",verdict=\"shadow_rejected\"} 1"
            ),
            "{text}"
        );
    }

    #[tokio::test]
    async fn unknown_subjects_share_one_bucket() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, _) = decider(store.clone());
        for _ in 0..2 {
            let a = d
                .decide(call(vec![vec![decision("per-ip", &[("ip", None)])]]))
                .await;
            assert!(a.answers[0].allowed);
        }
        let a = d
            .decide(call(vec![vec![decision("per-ip", &[("ip", None)])]]))
            .await;
        assert!(!a.answers[0].allowed);
        assert_eq!(
            store.stored_tokens("rl:{ratelimit|rule=per-ip|ip~}"),
            Some(0.0)
        );
    }

    /// A store that answers each call with the answers it was given, in order, and counts its
    /// calls.
    struct Answering {
        answers: Vec<Result<Decided, StoreError>>,
        calls: AtomicUsize,
    }

    impl Answering {
        fn new(answers: Vec<Result<Decided, StoreError>>) -> Self {
            Answering {
                answers,
                calls: AtomicUsize::new(0),
            }
        }
    }

    impl BucketStore for Answering {
        async fn decide(&self, call: Call) -> Vec<Result<Decided, StoreError>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.answers
                .iter()
                .take(call.requests.len())
                .cloned()
                .collect()
        }

        async fn readiness(&self) -> Readiness {
            Readiness::default()
        }
    }

    fn outcome(allowed: bool, remaining: u64, reason: Reason) -> Outcome {
        Outcome {
            allowed,
            remaining,
            retry_after_ms: if allowed { 0 } else { 1000 },
            reset_ms: 1000,
            reason,
            leased: 0,
        }
    }

    #[tokio::test]
    async fn a_store_error_answers_its_request_alone_and_a_bucket_that_answered_nothing_has_no_figures(
    ) {
        let store = Arc::new(Answering::new(vec![
            Err(StoreError::Timeout { timeout_ms: 5 }),
            Err(StoreError::Script("WRONGTYPE".into())),
            Ok(Decided {
                admitted: false,
                decisions: vec![Some(outcome(false, 0, Reason::Insufficient)), None],
            }),
        ]));
        let (d, metrics) = decider(store.clone());
        let both = || {
            vec![
                decision("per-app", &[("app", Some("a"))]),
                decision("per-ip", &[("ip", Some("1.2.3.4"))]),
            ]
        };
        let a = d.decide(call(vec![both(), both(), both()])).await;
        assert_eq!(
            store.calls.load(Ordering::SeqCst),
            1,
            "one call for the call"
        );
        let code = |i: usize| a.answers[i].error.as_ref().map(|e| e.code);
        assert_eq!(code(0), Some(ErrorCode::Unavailable));
        assert_eq!(code(1), Some(ErrorCode::ScriptFailed));
        assert_eq!(code(2), None, "rejected, not failed");
        let rejected = &a.answers[2];
        assert!(!rejected.allowed);
        assert_eq!(rejected.results[0].reason, Reason::Insufficient);
        assert_eq!(rejected.results[0].retry_after_ms, 1000);
        // The per-ip bucket answered nothing: not allowed, no figures, the limit named.
        assert_eq!(
            rejected.results[1],
            DecisionResult {
                allowed: false,
                remaining: 0,
                retry_after_ms: 0,
                reset_ms: 0,
                reason: Reason::Ok,
                limit: Some(AppliedLimit {
                    name: "per-ip".into(),
                    capacity: 2,
                    refill_per_sec: 1.0
                }),
                shadow: false,
                leased: 0,
            }
        );
        // Counted: the decision the bucket rejected, not the one that answered nothing.
        let text = metrics.encode();
        assert!(
            text.contains("ratelimit_decisions_total{limit=\"per-app\",verdict=\"rejected\"} 1"),
            "{text}"
        );
        assert!(!text.contains("limit=\"per-ip\""), "{text}");
    }

    #[tokio::test]
    async fn requests_with_nothing_to_charge_are_answered_without_the_store() {
        // A store that fails everything it is asked.
        let store = Arc::new(Answering::new(vec![
            Err(StoreError::Redis("down".into()));
            4
        ]));
        let (d, _) = decider(store.clone());
        let a = d
            .decide(call(vec![
                // A blocked limit rejects the request before anything is sent: its other
                // decision is not charged, and the failing store does not make it an error.
                vec![
                    decision("per-app", &[("app", Some("banned"))]),
                    decision("per-ip", &[("ip", Some("1.2.3.4"))]),
                ],
                vec![decision("per-app", &[("app", Some("vip"))])],
                vec![decision("nope", &[])],
            ]))
            .await;
        assert_eq!(store.calls.load(Ordering::SeqCst), 0, "nothing to charge");
        assert!(!a.answers[0].allowed);
        assert!(a.answers[0].error.is_none());
        assert_eq!(a.answers[0].results[0].reason, Reason::Blocked);
        assert_eq!(a.answers[0].results[1].reason, Reason::Ok, "no figures");
        assert!(a.answers[1].allowed, "unlimited");
        assert_eq!(
            a.answers[2].error.as_ref().map(|e| e.code),
            Some(ErrorCode::UnknownRule)
        );
    }

    #[tokio::test]
    async fn a_repeated_attempt_is_charged_once() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, _) = decider(store.clone());
        let mut c = call(vec![vec![decision("per-app", &[("app", Some("a"))])]]);
        c.attempt = Some("c-1".into());
        let first = d.decide(c.clone()).await;
        let again = d.decide(c).await;
        assert_eq!(first, again);
        assert_eq!(
            store.stored_tokens("rl:{ratelimit|rule=per-app|app=a}"),
            Some(4.0)
        );
    }

    #[tokio::test]
    async fn a_lease_is_granted_and_given_back() {
        let store = Arc::new(MemoryStore::new(T0, 0.5, 10_000));
        let (d, _) = decider(store.clone());
        let mut ask = decision("per-app", &[("app", Some("a"))]);
        ask.lease = Some(LeaseAsk {
            id: 9,
            tokens: 10,
            ttl_ms: 1000,
        });
        let a = d.decide(call(vec![vec![ask]])).await;
        assert_eq!(a.answers[0].results[0].leased, 2, "half of 5, rounded down");
        assert_eq!(
            store.stored_tokens("rl:{ratelimit|rule=per-app|app=a}"),
            Some(2.0)
        );
        let mut give = call(vec![]);
        give.returns.push(ratelimit_wire::LeaseReturn {
            rule: "per-app".into(),
            subject: decision("per-app", &[("app", Some("a"))]).subject,
            id: 9,
            tokens: 2,
        });
        d.decide(give).await;
        assert_eq!(
            store.stored_tokens("rl:{ratelimit|rule=per-app|app=a}"),
            Some(4.0)
        );
    }

    const REGIONAL: &str = r#"
rules:
  global:
    capacity: 100
    refill_per_sec: 10
    regions: {eu: 0.3, us: 0.7}
    overrides:
      - when: {app: big}
        capacity: 1000
        refill_per_sec: 100
"#;

    /// A decider for region eu of [`REGIONAL`], whose share of `global` is read from `store`.
    async fn regional_decider(
        store: Arc<MemoryStore>,
    ) -> (Decider<MemoryStore>, Arc<RegionalShares>) {
        let metrics = Arc::new(Metrics::new());
        let bounds = Bounds {
            region: crate::policy::RegionScope::Sidecar(Some("eu".into())),
            ..Bounds::default()
        };
        let p = Policy::from_sources(&[("limits.yaml".into(), REGIONAL.into())], &bounds).unwrap();
        let shares = RegionalShares::new("eu", "rl:", std::time::Duration::ZERO);
        shares.refresh(&*store, &p).await;
        let d = Decider::new(
            store,
            PolicyHandle::fixed(p, metrics.clone()),
            "rl:",
            metrics,
        )
        .with_regional(shares.clone());
        (d, shares)
    }

    #[tokio::test]
    async fn a_regional_rule_is_charged_under_this_regions_share() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, _) = regional_decider(store.clone()).await;
        let burst = |app: &'static str, n: usize| {
            call(vec![vec![decision("global", &[("app", Some(app))])]; n])
        };
        // No record yet: the policy's initial share, 0.3 of 100.
        let a = d.decide(burst("a", 40)).await;
        assert_eq!(a.answers.iter().filter(|a| a.allowed).count(), 30);
        assert_eq!(
            a.answers[0].results[0].limit,
            Some(AppliedLimit {
                name: "global".into(),
                capacity: 30,
                refill_per_sec: 3.0
            }),
            "the answer names the region's part"
        );
        // An override is scaled alike: 0.3 of 1000.
        let a = d.decide(burst("big", 400)).await;
        assert_eq!(a.answers.iter().filter(|a| a.allowed).count(), 300);
    }

    #[tokio::test]
    async fn a_share_without_a_lease_answers_unavailable_and_demand_is_counted() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        store.set_hash(
            "rl:share:{ratelimit|global}",
            &[
                ("version", "4"),
                ("share_ppm", "500000"),
                ("lease_ms", "30"),
                ("history", "0:500000"),
            ],
        );
        let (d, shares) = regional_decider(store.clone()).await;
        let a = d
            .decide(call(vec![
                vec![decision("global", &[("app", Some("a"))])];
                60
            ]))
            .await;
        assert_eq!(
            a.answers.iter().filter(|a| a.allowed).count(),
            50,
            "the record's 0.5"
        );
        shares.flush_demand(&*store).await;
        assert_eq!(
            crate::regional::record::parse_demand(&store.hash("rl:demand:{ratelimit|global}"))
                .unwrap(),
            (50, 10)
        );
        std::thread::sleep(std::time::Duration::from_millis(40));
        let a = d
            .decide(call(vec![vec![decision("global", &[("app", Some("a"))])]]))
            .await;
        let e = a.answers[0].error.as_ref().expect("unavailable");
        assert_eq!(e.code, ErrorCode::Unavailable);
        assert!(
            e.message.contains("past its lease of 30 ms"),
            "{}",
            e.message
        );
    }
}
