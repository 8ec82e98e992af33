//! The decision: validate a call ([`validate`]), resolve each decision's limit in the policy
//! (`plan.rs`), hand the store ([`BucketStore`]) the requests with something to charge, and answer
//! each request from the store's outcomes (`answer.rs`). The decider never learns where a bucket
//! is kept: placing requests on Redis nodes, and keeping a request all-or-nothing across them, is
//! the store's (`crate::store::redis`).
//!
//! A call carries many requests (the filter coalesces them); each is all-or-nothing on its own.
//! A request the store could not decide is answered with the store's error (unavailable, or the
//! script failed); a decision whose bucket answered nothing is answered `allowed: false`,
//! `reason: ok`, with no figures.
//!
//! The whole decision runs in a task of its own (see [`crate::http`]), so a caller that hangs up
//! cancels neither the store's calls in flight nor the refunds that follow them.

mod answer;
pub mod named;
mod plan;
mod slots;
mod validate;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ratelimit_wire::{
    DecideRequest, DecideResponse, LeaseAsk, RequestAnswer, SettleRequest, SettleResponse,
};

use self::answer::{error_answer, from_store, Tally};
use self::plan::{blocked, charge, Plan};
use crate::metrics::{Metrics, SettleOutcome};
use crate::policy::own_format::RULE_KEY;
use crate::policy::reload::PolicyHandle;
use crate::regional::RegionalShares;
use crate::store::{
    BucketStore, Call, Charge, Decided, Readiness, SettleBatch, SlotsTaken, StoreError,
};

pub use validate::{
    parse_request, parse_settle, parse_slots, validate, validate_settle, validate_slots,
    DecideError, MAX_ERROR_BYTES, MAX_LEASE_TTL_MS,
};

/// Descriptor entries: (key, value), a `None` value being an unknown subject.
pub type Entries = Vec<(String, Option<String>)>;

/// One decision in the generic form both APIs share: descriptor entries, a cost, a lease ask.
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    pub entries: Entries,
    pub cost: u64,
    pub lease: Option<LeaseAsk>,
    /// Ask for a receipt of the charge: the cost is a reservation a settlement may give back.
    pub receipt: bool,
}

/// A settlement in the generic form: the bucket's descriptor entries, the reservation the caller
/// names, the real cost, and the receipt of the decision that charged the reservation. Charged
/// `cost` less what the receipt says was charged (past zero into a debt, below it given back),
/// once; without a receipt held, only `cost - reserved` when positive (`docs/costs.md`).
#[derive(Debug, Clone, PartialEq)]
pub struct SettleItem {
    pub entries: Entries,
    pub reserved: u64,
    pub cost: u64,
    pub receipt: Option<u64>,
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
    /// The RLQS server's planner: names rules like the filter, and sizes its own lease grants.
    Quota,
}

/// What `/readyz` reports: the store's readiness and, with `--region`, the regional shares this
/// sidecar applies, per regional rule.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SidecarReadiness {
    #[serde(flatten)]
    pub store: Readiness,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub regional_shares: Option<Vec<crate::regional::ShareStatus>>,
}

/// Runs decisions against a [`BucketStore`] under the policy in force.
pub struct Decider<S> {
    store: Arc<S>,
    policy: Arc<PolicyHandle>,
    metrics: Arc<Metrics>,
    /// When each unknown (domain, rule) was last logged and how often it was met since, so a
    /// misconfigured gateway warns once a minute with a count instead of a line per request
    /// (bounded; every occurrence is still counted in the metrics).
    logged_unknown: Mutex<HashMap<(String, String), plan::UnknownSeen>>,
    /// This region's shares of the regional rules (with `--region`).
    regional: Option<Arc<RegionalShares>>,
}

impl<S: BucketStore> Decider<S> {
    pub fn new(store: Arc<S>, policy: Arc<PolicyHandle>, metrics: Arc<Metrics>) -> Self {
        Self {
            store,
            policy,
            metrics,
            logged_unknown: Mutex::new(HashMap::new()),
            regional: None,
        }
    }

    /// The policy in force (the quota API resolves a bucket's rule before it asks for tokens).
    pub fn policy(&self) -> &Arc<PolicyHandle> {
        &self.policy
    }

    /// The sidecar's metrics (the quota API counts its streams and assignments there).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Decides regional rules under `shares` (this sidecar's region).
    pub fn with_regional(mut self, shares: Arc<RegionalShares>) -> Self {
        self.regional = Some(shares);
        self
    }

    /// What `/readyz` reports: the store's readiness, and with regional rules the shares this
    /// region applies (not ready until each was read once).
    pub async fn readiness(&self) -> SidecarReadiness {
        let mut r = SidecarReadiness {
            store: self.store.readiness().await,
            regional_shares: None,
        };
        if let Some(shares) = &self.regional {
            let policy = self.policy.current();
            if !shares.all_read(&policy) {
                r.store.error.get_or_insert_with(|| {
                    "the regional shares have not all been read yet".to_string()
                });
                r.store.redis_ok = false;
            }
            r.regional_shares = Some(shares.status(&policy));
        }
        r
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
                        receipt: d.receipt,
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
        DecideResponse {
            answers,
            epoch: None,
        }
    }

    /// Applies a settle call that [`validate_settle`] accepted: each settlement charged to or
    /// given back to its bucket in one batch ([`SettleItem`], `docs/costs.md`). An error is the
    /// store's: the caller may send the batch again (its id keeps a repeat from applying anything
    /// twice, and a receipt gives back once).
    pub async fn settle(&self, call: SettleRequest) -> Result<SettleResponse, StoreError> {
        let items = call
            .settlements
            .into_iter()
            .map(|st| SettleItem {
                entries: rule_entries(st.rule, st.subject),
                reserved: st.reserved,
                cost: st.cost,
                receipt: st
                    .receipt
                    .as_deref()
                    .and_then(ratelimit_wire::parse_receipt),
            })
            .collect();
        self.settle_items(&call.domain, call.id, items).await
    }

    /// Applies settlements of generic items in one batch (the wasm filter's `/v1/settle` and
    /// the stream-done descriptors of Envoy's rate limit filter end here): a delta of 0, or
    /// entries that name no limited bucket, is skipped.
    pub async fn settle_items(
        &self,
        domain: &str,
        id: Option<String>,
        items: Vec<SettleItem>,
    ) -> Result<SettleResponse, StoreError> {
        let policy = self.policy.current().clone();
        let mut skipped = 0;
        let mut settlements = Vec::with_capacity(items.len());
        for item in items {
            // Without a receipt, a cost at or below the reservation changes nothing.
            let anything = item.receipt.is_some() || item.cost > item.reserved;
            match anything
                .then(|| self.plan_settlement(&policy, domain, &item))
                .flatten()
            {
                Some(s) => settlements.push(s),
                None => skipped += 1,
            }
        }
        drop(policy);
        self.metrics.settled(SettleOutcome::Skipped, skipped);
        let mut answer = SettleResponse {
            skipped,
            ..SettleResponse::default()
        };
        if settlements.is_empty() {
            return Ok(answer);
        }
        let n = settlements.len() as u64;
        let batch = SettleBatch { id, settlements };
        match self.store.settle(batch).await {
            Err(e) => {
                self.metrics.settled(SettleOutcome::Failed, n);
                Err(e)
            }
            Ok(settled) => {
                let mut repeated = 0;
                for applied in &settled.applied {
                    let outcome = match applied {
                        None => SettleOutcome::Repeated,
                        Some(a) if a.delta > 0 => SettleOutcome::Charged,
                        Some(a) if a.delta < 0 => SettleOutcome::GivenBack,
                        Some(_) => SettleOutcome::Skipped,
                    };
                    repeated += u64::from(applied.is_none());
                    self.metrics.settled(outcome, 1);
                }
                answer.applied = n - repeated;
                answer.repeated = repeated;
                Ok(answer)
            }
        }
    }

    /// Decides requests of generic items (every API ends here). With the filter as caller, a
    /// request of a rule with `concurrency` takes its slots (under an id chosen here for it
    /// alone) before its rate is charged, and gives them back unless admitted ([`slots`]); the
    /// other callers' requests take none (their rules' rate part alone applies).
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
        if caller != Caller::RateLimitService {
            self.note_named(domain, &requests, &plans);
        }

        // Slots first: a request that cannot hold all of its slots is not charged at all.
        let mut tally = Tally::default();
        let mut held: Vec<Option<slots::RequestSlots>> =
            (0..requests.len()).map(|_| None).collect();
        if caller == Caller::Filter {
            let wanted: Vec<(usize, slots::RequestSlots)> = plans
                .iter()
                .enumerate()
                .filter(|(r, plan)| answers[*r].is_none() && !blocked(plan))
                .filter_map(|(r, plan)| {
                    self.request_slots(domain, plan, &requests[r])
                        .map(|s| (r, s))
                })
                .collect();
            let takes = wanted.iter().map(|(_, s)| self.take(s));
            let taken = futures::future::join_all(takes).await;
            for ((r, s), t) in wanted.into_iter().zip(taken) {
                match t {
                    Ok(SlotsTaken::Taken) => held[r] = Some(s),
                    Ok(SlotsTaken::Full { index }) => {
                        let none = Decided {
                            admitted: false,
                            decisions: Vec::new(),
                        };
                        let a = self.answer(&mut tally, &plans[r], &requests[r], none);
                        answers[r] = Some(slots::over_concurrency(a, s.of[index].0));
                    }
                    Err(e) => answers[r] = Some(error_answer(from_store(&e))),
                }
            }
        }

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
                .filter_map(|(p, item)| charge(p, item, caller))
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
                attempt: attempt.map(|a| Call::record_id(a, &charges)),
                requests: charges,
                returns,
            };
            for (r, d) in sent.into_iter().zip(self.store.decide(call).await) {
                decided[r] = Some(d);
            }
        }

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
        // An admitted request keeps its slots and is told so; any other gives them back.
        let mut answers: Vec<RequestAnswer> = answers
            .into_iter()
            .map(|a| a.expect("every request answered"))
            .collect();
        let mut give_back = Vec::new();
        for (a, h) in answers.iter_mut().zip(&mut held) {
            match h.take() {
                Some(s) if a.allowed => a.slot = Some(s.held()),
                Some(s) => give_back.push(s),
                None => {}
            }
        }
        futures::future::join_all(give_back.iter().map(|s| self.give_back(s))).await;
        answers
    }
}

impl<S> Decider<S> {
    /// Notes the rules a call of the filter named that the policy resolved (one entry each), for
    /// the warning of a reload that drops one ([`named`]).
    fn note_named(&self, domain: &str, requests: &[Vec<Item>], plans: &[Vec<Plan>]) {
        let mut rules: Vec<(&str, &Entries)> = Vec::new();
        for (items, plan) in requests.iter().zip(plans) {
            for (item, p) in items.iter().zip(plan) {
                if matches!(p, Plan::Unknown { .. }) {
                    continue;
                }
                let Some((_, Some(rule))) = item.entries.first() else {
                    continue;
                };
                if !rules.iter().any(|(r, _)| *r == rule.as_str()) {
                    rules.push((rule.as_str(), &item.entries));
                }
            }
        }
        if !rules.is_empty() {
            self.policy
                .named()
                .note(domain, rules, std::time::Instant::now());
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use ratelimit_wire::{
        AppliedLimit, Decision, DecisionResult, ErrorCode, Reason, RequestDecisions, Subject,
    };

    use super::*;
    use crate::policy::{Bounds, Policy};
    use crate::store::memory::MemoryStore;
    use crate::store::BucketOutcome;

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
            receipt: false,
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
            Decider::new(store, policy(&metrics), metrics.clone()),
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
    async fn an_unknown_rule_is_its_decisions_error_alone_and_the_others_still_decide() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, metrics) = decider(store.clone());
        let alpha = || decision("per-app", &[("app", Some("alpha"))]);
        let renamed = || decision("per-ipp", &[("ip", Some("1.2.3.4"))]);
        let a = d
            .decide(call(vec![
                vec![alpha(), renamed()],
                vec![renamed(), alpha()],
                vec![renamed(), renamed()],
            ]))
            .await;
        for (r, unknown, known) in [(0, 1, 0), (1, 0, 1)] {
            let answer = &a.answers[r];
            assert!(answer.allowed && answer.error.is_none(), "{answer:?}");
            let e = answer.results[unknown].error.as_ref().expect("its error");
            assert_eq!(e.code, ErrorCode::UnknownRule);
            assert!(e.message.contains("\"per-ipp\""), "{}", e.message);
            assert!(answer.results[unknown].allowed && answer.results[unknown].limit.is_none());
            assert!(answer.results[known].error.is_none());
            assert_eq!(
                answer.results[known].remaining,
                4 - r as u64,
                "per-app charged"
            );
        }
        // Nothing known to decide: the request's error, as before.
        assert_eq!(
            a.answers[2].error.as_ref().map(|e| e.code),
            Some(ErrorCode::UnknownRule)
        );
        assert!(a.answers[2].results.is_empty());
        assert_eq!(
            store.stored_tokens("rl:{ratelimit|rule=per-app|app=alpha}"),
            Some(3.0)
        );
        assert!(metrics.encode().contains("ratelimit_unknown_rule_total 4"));
        // Still limited by per-app: 3 more admitted, then rejected with the error beside.
        for _ in 0..3 {
            let a = d.decide(call(vec![vec![alpha(), renamed()]])).await;
            assert!(a.answers[0].allowed);
        }
        let a = d.decide(call(vec![vec![alpha(), renamed()]])).await;
        assert!(!a.answers[0].allowed);
        assert_eq!(a.answers[0].results[0].reason, Reason::Insufficient);
        assert!(a.answers[0].results[1].error.is_some());
    }

    #[tokio::test]
    async fn a_reload_that_drops_a_rule_gateways_named_warns_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("limits.yaml");
        std::fs::write(&path, POLICY).unwrap();
        let metrics = Arc::new(Metrics::new());
        let handle =
            PolicyHandle::load(vec![path.clone()], Bounds::default(), metrics.clone()).unwrap();
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let d = Decider::new(store, handle.clone(), metrics.clone());
        d.decide(call(vec![vec![
            decision("per-ip", &[("ip", Some("1.2.3.4"))]),
            decision("nope", &[]),
        ]]))
        .await;
        // per-ip renamed, trial dropped (never named): only per-ip is warned about.
        std::fs::write(
            &path,
            POLICY.replace("per-ip:", "per-client-ip:").replace(
                "  trial: {capacity: 1, refill_per_sec: 1, shadow_mode: true}\n",
                "",
            ),
        )
        .unwrap();
        assert!(handle.reload("test").unwrap());
        let text = metrics.encode();
        assert!(
            text.contains("ratelimit_policy_dropped_rules_total{rule=\"ratelimit/per-ip\"} 1"),
            "{text}"
        );
        assert!(!text.contains("rule=\"ratelimit/trial\""), "{text}");
        assert!(!text.contains("rule=\"ratelimit/nope\""), "{text}");
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

    fn outcome(allowed: bool, remaining: u64, reason: Reason) -> BucketOutcome {
        BucketOutcome {
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
                receipt: None,
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
                error: None,
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

    /// Issue 20, case 3: a used attempt id with other requests (or other costs) is decided
    /// afresh, never replayed.
    #[tokio::test]
    async fn a_used_attempt_id_replays_only_the_same_call() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, _) = decider(store.clone());
        let app = |a: &str| decision("per-app", &[("app", Some(a))]);
        let mut y = call(vec![vec![app("alice")], vec![app("bob")]]);
        y.attempt = Some("y".into());
        let first = d.decide(y).await;
        assert!(first.answers.iter().all(|a| a.allowed));
        for _ in 0..5 {
            assert!(d.decide(call(vec![vec![app("mallory")]])).await.answers[0].allowed);
        }
        let mut other = call(vec![vec![app("alice")], vec![app("mallory")]]);
        other.attempt = Some("y".into());
        for _ in 0..10 {
            let a = d.decide(other.clone()).await;
            assert!(
                !a.answers[1].allowed,
                "mallory's empty bucket admits nothing"
            );
        }
        assert_eq!(
            store.stored_tokens("rl:{ratelimit|rule=per-app|app=mallory}"),
            Some(0.0)
        );

        let mut z = call(vec![vec![app("carol")]]);
        z.attempt = Some("z".into());
        assert!(d.decide(z.clone()).await.answers[0].allowed);
        z.requests[0].decisions[0].cost = 5;
        for _ in 0..10 {
            assert!(
                !d.decide(z.clone()).await.answers[0].allowed,
                "4 tokens, cost 5"
            );
        }
        assert_eq!(
            store.stored_tokens("rl:{ratelimit|rule=per-app|app=carol}"),
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
        let shares = RegionalShares::new("eu", std::time::Duration::ZERO, metrics.clone());
        shares.refresh(&*store, &p).await;
        let d = Decider::new(store, PolicyHandle::fixed(p, metrics.clone()), metrics)
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
        let fields = [
            ("version", "4"),
            ("share_ppm", "500000"),
            ("lease_ms", "30"),
            ("history", "0:500000"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        store.set_share(
            "ratelimit",
            "global",
            crate::regional::record::parse(&fields),
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
        assert_eq!(store.demand("ratelimit", "global"), (50, 10));
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
