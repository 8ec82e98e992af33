//! Concurrency slots (`docs/concurrency.md`): a request of a rule with `concurrency` takes one
//! slot per such rule, all or none, before its rate is charged; a request its rate (or anything
//! else) then rejects gives them back at once, so only admitted requests hold slots. The gateway
//! renews what its requests hold and releases it when their streams end (`POST /v1/slots`,
//! [`Decider::update_slots`]). Only the wasm filter takes slots: Envoy's rate limit API has no
//! stream end to release them at, so its decisions apply the rate part alone.

use std::sync::Arc;

use ratelimit_wire::{
    HeldSlot, Reason, RequestAnswer, SlotRef, SlotsRequest, SlotsResponse,
    CONCURRENCY_RETRY_AFTER_MS,
};

use super::plan::Plan;
use super::{rule_entries, Decider, Item};
use crate::metrics::SlotOutcome;
use crate::policy::{Limit, Resolution};
use crate::store::{BucketStore, Slot, SlotUpdate, SlotsTaken, StoreError};

/// The slots one request takes: one per decision of a rule with `concurrency`.
pub(super) struct RequestSlots {
    pub(super) slots: Vec<Slot>,
    /// Per slot: the decision's index and its limit.
    pub(super) of: Vec<(usize, Arc<Limit>)>,
}

impl RequestSlots {
    /// What the admitted request's answer tells the gateway it holds.
    pub(super) fn held(&self) -> HeldSlot {
        HeldSlot {
            id: self
                .slots
                .first()
                .map(|s| s.id.to_string())
                .unwrap_or_default(),
            ttl_ms: self.slots.iter().map(|s| s.ttl_ms).min().unwrap_or(0),
            decisions: self.of.iter().map(|(i, _)| *i as u32).collect(),
        }
    }
}

/// The limit of a planned decision whose slot the request must take: a charged or unlimited
/// limit with `concurrency` (a shadow limit is not enforced in flight).
fn slot_limit(p: &Plan) -> Option<&Arc<Limit>> {
    let limit = match p {
        Plan::Charge { limit, .. } => limit,
        Plan::Unlimited { limit: Some(limit) } => limit,
        _ => return None,
    };
    (limit.concurrency.is_some() && !limit.shadow).then_some(limit)
}

/// A slot id the sidecar chooses for a caller that sent none: 128 random bits, in hex.
fn new_slot_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

impl<S: BucketStore> Decider<S> {
    /// The slots a request must take, if any, all under one id chosen here for it alone.
    pub(super) fn request_slots(
        &self,
        domain: &str,
        plan: &[Plan],
        items: &[Item],
    ) -> Option<RequestSlots> {
        let mut slots = Vec::new();
        let mut of = Vec::new();
        let mut shared_id: Option<Arc<str>> = None;
        for (i, (p, item)) in plan.iter().zip(items).enumerate() {
            let Some(limit) = slot_limit(p) else {
                continue;
            };
            let Some(c) = limit.concurrency else {
                continue;
            };
            let key = match p {
                Plan::Charge { key, .. } => self.store.slot_set_key(key),
                _ => self.slot_set_of(domain, &item.entries),
            };
            let id = shared_id
                .get_or_insert_with(|| Arc::from(new_slot_id()))
                .clone();
            slots.push(Slot {
                key,
                id,
                ttl_ms: c.slot_ttl_ms,
                limit: c.limit,
                unsure_ms: self.policy.slot_unsure_ms(&limit.name, c.slot_ttl_ms),
            });
            of.push((i, limit.clone()));
        }
        (!slots.is_empty()).then_some(RequestSlots { slots, of })
    }

    fn slot_set_of(&self, domain: &str, entries: &[(String, Option<String>)]) -> Arc<str> {
        let entries: Vec<(&str, Option<&str>)> = entries
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_deref()))
            .collect();
        self.store
            .slot_set_key(&self.store.bucket_key(domain, &entries))
    }

    /// Takes a request's slots: counted per limit (`taken` or `full`).
    pub(super) async fn take(&self, r: &RequestSlots) -> Result<SlotsTaken, StoreError> {
        let taken = self.store.take_slots(r.slots.clone()).await;
        match &taken {
            Ok(SlotsTaken::Taken) => {
                for (_, limit) in &r.of {
                    self.metrics.slots_of(&limit.name, SlotOutcome::Taken, 1);
                }
            }
            Ok(SlotsTaken::Full { index }) => {
                if let Some((_, limit)) = r.of.get(*index) {
                    self.metrics.slots_of(&limit.name, SlotOutcome::Full, 1);
                }
            }
            Err(_) => {}
        }
        taken
    }

    /// Gives back the slots of a request that was not admitted after all. A release that fails
    /// leaves them to expire (`slot_ttl_ms`): under-admission, never over.
    pub(super) async fn give_back(&self, r: &RequestSlots) {
        if let Ok(held) = self
            .store
            .update_slots(SlotUpdate::Release, r.slots.clone())
            .await
        {
            for ((_, limit), was) in r.of.iter().zip(held) {
                let outcome = if was {
                    SlotOutcome::Released
                } else {
                    SlotOutcome::ExpiredOrUnknown
                };
                self.metrics.slots_of(&limit.name, outcome, 1);
            }
        }
    }

    /// Renews and releases slots a gateway holds (a call [`super::validate_slots`] accepted). A
    /// slot whose rule no longer limits requests in flight is not renewed (it expires), and is
    /// still released.
    pub async fn update_slots(&self, call: SlotsRequest) -> Result<SlotsResponse, StoreError> {
        let mut answer = SlotsResponse::default();
        for (update, refs) in [
            (SlotUpdate::Renew, call.renew),
            (SlotUpdate::Release, call.release),
        ] {
            let (slots, names) = self.resolve_slots(&call.domain, update, refs, &mut answer);
            if slots.is_empty() {
                continue;
            }
            let ttls: Vec<u64> = slots.iter().map(|s| s.ttl_ms).collect();
            let held = self.store.update_slots(update, slots).await?;
            for ((name, was), ttl_ms) in names.iter().zip(held).zip(ttls) {
                let outcome = match (was, update) {
                    (false, _) => {
                        answer.unknown += 1;
                        SlotOutcome::ExpiredOrUnknown
                    }
                    (true, SlotUpdate::Renew) => {
                        answer.renewed += 1;
                        answer.ttl_ms = Some(answer.ttl_ms.map_or(ttl_ms, |t| t.min(ttl_ms)));
                        SlotOutcome::Renewed
                    }
                    (true, SlotUpdate::Release) => {
                        answer.released += 1;
                        SlotOutcome::Released
                    }
                };
                self.metrics.slots_of(name, outcome, 1);
            }
        }
        Ok(answer)
    }

    /// The slots `refs` name under the policy in force, each with its limit's name; one that
    /// names no limit with `concurrency` is counted unknown (a release names the rule's set all
    /// the same: the policy may have changed while the request ran).
    fn resolve_slots(
        &self,
        domain: &str,
        update: SlotUpdate,
        refs: Vec<SlotRef>,
        answer: &mut SlotsResponse,
    ) -> (Vec<Slot>, Vec<String>) {
        let policy = self.policy.current().clone();
        let mut slots = Vec::with_capacity(refs.len());
        let mut names = Vec::with_capacity(refs.len());
        for r in refs {
            let entries = rule_entries(r.rule, r.subject);
            let key = self.slot_set_of(domain, &entries);
            let view: Vec<(&str, Option<&str>)> = entries
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_deref()))
                .collect();
            let limit = match policy.resolve(domain, &view) {
                Resolution::Limit(l) => Some(l.clone()),
                _ => None,
            };
            let c = limit.as_ref().and_then(|l| l.concurrency);
            // A label of bounded cardinality: never a name the caller made up.
            let name = limit
                .as_ref()
                .map_or_else(|| "-".to_string(), |l| l.name.clone());
            match (c, update) {
                (None, SlotUpdate::Renew) => answer.unknown += 1,
                _ => {
                    let ttl_ms = c.map_or(1, |c| c.slot_ttl_ms);
                    slots.push(Slot {
                        key: key.clone(),
                        id: Arc::from(r.slot),
                        ttl_ms,
                        limit: c.map_or(1, |c| c.limit),
                        unsure_ms: self.policy.slot_unsure_ms(&name, ttl_ms),
                    });
                    names.push(name);
                }
            }
        }
        (slots, names)
    }
}

/// The answer of a request over its concurrency: not admitted, the full decision's reason
/// `concurrency` with a short fixed wait (a slot frees when some request ends, at a time nobody
/// knows).
pub(super) fn over_concurrency(mut answer: RequestAnswer, decision: usize) -> RequestAnswer {
    answer.allowed = false;
    if let Some(r) = answer.results.get_mut(decision) {
        r.allowed = false;
        r.reason = Reason::Concurrency;
        r.retry_after_ms = CONCURRENCY_RETRY_AFTER_MS;
        r.remaining = 0;
        r.reset_ms = 0;
    }
    answer
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ratelimit_wire::{
        DecideRequest, Decision, LeaseAsk, Reason, RequestDecisions, SlotRef, SlotsRequest, Subject,
    };

    use super::super::{Caller, Decider, Item};
    use crate::metrics::Metrics;
    use crate::policy::reload::PolicyHandle;
    use crate::policy::{Bounds, Policy};
    use crate::store::memory::MemoryStore;

    const T0: u64 = 1_700_000_000_000_000;

    const POLICY: &str = r#"
rules:
  inflight: {capacity: 2, refill_per_sec: 0.001, concurrency: 3}
  one: {capacity: 10, refill_per_sec: 0.001, concurrency: 1, slot_ttl_ms: 1000}
  many: {concurrency: 5, slot_ttl_ms: 2000}
"#;

    fn decider(store: &Arc<MemoryStore>) -> (Decider<MemoryStore>, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        let p = Policy::from_sources(&[("limits.yaml".into(), POLICY.into())], &Bounds::default())
            .unwrap();
        let policy = PolicyHandle::fixed(p, metrics.clone());
        (
            Decider::new(store.clone(), policy, metrics.clone()),
            metrics,
        )
    }

    fn decision(rule: &str) -> Decision {
        let mut subject = Subject::new();
        subject.push("app", Some("a".into()));
        Decision {
            receipt: false,
            rule: rule.into(),
            subject,
            cost: 1,
            lease: None,
        }
    }

    fn call(rules: &[&str]) -> DecideRequest {
        DecideRequest {
            domain: "ratelimit".into(),
            attempt: None,
            requests: vec![RequestDecisions {
                decisions: rules.iter().map(|r| decision(r)).collect(),
            }],
            returns: Vec::new(),
        }
    }

    /// The slot id an admitted answer holds.
    fn held_id(a: &ratelimit_wire::DecideResponse) -> String {
        a.answers[0].slot.as_ref().expect("holds a slot").id.clone()
    }

    fn sorted(mut ids: Vec<String>) -> Vec<String> {
        ids.sort();
        ids
    }

    fn set(rule: &str) -> String {
        format!("rl:{{ratelimit|rule={rule}|app=a}}:c")
    }

    fn slot_ref(rule: &str, slot: &str) -> SlotRef {
        let mut subject = Subject::new();
        subject.push("app", Some("a".into()));
        SlotRef {
            rule: rule.into(),
            subject,
            slot: slot.into(),
        }
    }

    fn slots_total(metrics: &Metrics, rule: &str, outcome: &str) -> bool {
        metrics.encode().lines().any(|l| {
            l.starts_with("ratelimit_slots_total")
                && l.contains(&format!("rule=\"{rule}\""))
                && l.contains(&format!("outcome=\"{outcome}\""))
        })
    }

    #[tokio::test]
    async fn a_request_the_rate_rejects_gives_its_slot_back() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, metrics) = decider(&store);
        let mut ids = Vec::new();
        for _ in 0..2 {
            let a = d.decide(call(&["inflight"])).await;
            assert!(a.answers[0].allowed);
            let held = a.answers[0].slot.as_ref().expect("holds a slot");
            assert_eq!((held.id.len(), held.ttl_ms), (32, 10_000));
            assert_eq!(held.decisions, [0]);
            ids.push(held.id.clone());
        }
        // The bucket (capacity 2) is empty: the third request took a slot, then gave it back.
        let a = d.decide(call(&["inflight"])).await;
        assert!(!a.answers[0].allowed);
        assert_eq!(a.answers[0].results[0].reason, Reason::Insufficient);
        assert_eq!(a.answers[0].slot, None);
        assert_eq!(store.held_slots(&set("inflight")), sorted(ids));
        assert!(slots_total(&metrics, "inflight", "released"));
    }

    #[tokio::test]
    async fn a_full_set_answers_concurrency_and_charges_nothing() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, metrics) = decider(&store);
        let first = d.decide(call(&["one"])).await;
        assert!(first.answers[0].allowed);
        let bucket = "rl:{ratelimit|rule=one|app=a}";
        assert_eq!(store.stored_tokens(bucket).map(f64::floor), Some(9.0));
        let a = d.decide(call(&["one"])).await;
        assert!(!a.answers[0].allowed);
        let r = &a.answers[0].results[0];
        assert_eq!((r.reason, r.retry_after_ms), (Reason::Concurrency, 1000));
        assert_eq!(
            store.stored_tokens(bucket).map(f64::floor),
            Some(9.0),
            "the rate was not charged"
        );
        assert!(slots_total(&metrics, "one", "full"));
        // The first request's stream ends: its release frees the slot for the next request.
        let released = d
            .update_slots(SlotsRequest {
                domain: "ratelimit".into(),
                renew: vec![],
                release: vec![slot_ref("one", &held_id(&first))],
            })
            .await
            .unwrap();
        assert_eq!(released.released, 1);
        assert!(d.decide(call(&["one"])).await.answers[0].allowed);
    }

    #[tokio::test]
    async fn an_unrenewed_slot_expires_after_its_ttl_and_a_renewed_one_does_not() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, _) = decider(&store);
        let kept = held_id(&d.decide(call(&["many"])).await);
        let dead = held_id(&d.decide(call(&["many"])).await);
        let renew = |ids: &[&str]| SlotsRequest {
            domain: "ratelimit".into(),
            renew: ids.iter().map(|id| slot_ref("many", id)).collect(),
            release: vec![],
        };
        store.advance_ms(1_500);
        let r = d.update_slots(renew(&[&kept])).await.unwrap();
        assert_eq!((r.renewed, r.unknown, r.ttl_ms), (1, 0, Some(2_000)));
        store.advance_ms(600);
        // 2100 ms after the take: `dead` (ttl 2000, never renewed) is free again, `kept` is held.
        assert_eq!(store.held_slots(&set("many")), std::slice::from_ref(&kept));
        let r = d.update_slots(renew(&[&kept, &dead])).await.unwrap();
        assert_eq!(
            (r.renewed, r.unknown),
            (1, 1),
            "an expired slot is not revived"
        );
        assert_eq!(store.held_slots(&set("many")), [kept]);
    }

    #[tokio::test]
    async fn the_slots_of_a_request_are_all_or_none_and_each_request_holds_its_own() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, _) = decider(&store);
        assert!(d.decide(call(&["one"])).await.answers[0].allowed);
        let a = d.decide(call(&["many", "one"])).await;
        assert!(!a.answers[0].allowed);
        assert_eq!(a.answers[0].results[1].reason, Reason::Concurrency);
        assert!(
            store.held_slots(&set("many")).is_empty(),
            "no slot of the rejected request is held"
        );
        // Issue 32, case 9: a slot is one request's. 20 requests at concurrency 5 hold 5 slots
        // of their own (a caller cannot name a slot id to share one).
        let admitted = futures::future::join_all((0..20).map(|_| d.decide(call(&["many"]))))
            .await
            .iter()
            .filter(|a| a.answers[0].allowed)
            .count();
        assert_eq!(admitted, 5);
        assert_eq!(store.held_slots(&set("many")).len(), 5);
    }

    #[tokio::test]
    async fn a_rule_with_concurrency_grants_no_lease_and_the_rate_limit_api_takes_no_slot() {
        let store = Arc::new(MemoryStore::new(T0, 0.5, 10_000));
        let (d, _) = decider(&store);
        let mut c = call(&["one"]);
        c.requests[0].decisions[0].lease = Some(LeaseAsk {
            id: 7,
            tokens: 4,
            ttl_ms: 1000,
        });
        let a = d.decide(c).await;
        assert!(a.answers[0].allowed);
        assert_eq!(a.answers[0].results[0].leased, 0);
        let leased = held_id(&a);
        let item = Item {
            receipt: false,
            entries: vec![
                ("rule".into(), Some("one".into())),
                ("app".into(), Some("a".into())),
            ],
            cost: 1,
            lease: None,
        };
        let a = d
            .run(
                "ratelimit",
                None,
                vec![vec![item]],
                vec![],
                Caller::RateLimitService,
            )
            .await;
        assert!(a[0].allowed, "the rate part alone applies");
        assert_eq!(a[0].slot, None);
        assert_eq!(store.held_slots(&set("one")), [leased]);
    }

    #[tokio::test]
    async fn after_a_loss_under_store_reset_empty_no_slot_is_taken_for_one_ttl_and_renewals_hold_theirs(
    ) {
        use crate::store::StoreReset;
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000).with_store_reset(StoreReset::Empty));
        let (d, _) = decider(&store);
        store.advance_ms(2_000); // past one ttl of the epoch the first call makes
        let _ = d.decide(call(&["inflight"])).await;
        store.lose_state();
        store.advance_ms(3_000);
        // Two requests held slots before the loss; the store no longer knows them.
        let a = d.decide(call(&["many"])).await;
        assert!(!a.answers[0].allowed, "a take within one ttl of the loss");
        assert_eq!(a.answers[0].results[0].reason, Reason::Concurrency);
        let renew = |ids: &[&str]| SlotsRequest {
            domain: "ratelimit".into(),
            renew: ids.iter().map(|id| slot_ref("many", id)).collect(),
            release: vec![],
        };
        store.advance_ms(500);
        let r = d
            .update_slots(renew(&["before-1", "before-2"]))
            .await
            .unwrap();
        assert_eq!(
            r.renewed, 2,
            "a renewal within one ttl holds its slot again"
        );
        store.advance_ms(1_600);
        // One ttl (2000 ms) after the loss: the set is whole again, and takes resume.
        assert_eq!(store.held_slots(&set("many")), ["before-1", "before-2"]);
        let taken: usize = futures::future::join_all((0..5).map(|_| d.decide(call(&["many"]))))
            .await
            .iter()
            .filter(|a| a.answers[0].allowed)
            .count();
        assert_eq!(taken, 3, "5 - the 2 running requests");
        let r = d.update_slots(renew(&["unknown"])).await.unwrap();
        assert_eq!(
            r.unknown, 1,
            "past the window an unknown slot is not taken again"
        );
    }

    /// A decider on `store` under a policy file of rule `r` (`concurrency: 2`,
    /// `slot_ttl_ms: 9000`), and what reloads it with `slot_ttl_ms: 1000`.
    fn on_ttl_9000(
        store: &Arc<MemoryStore>,
    ) -> (tempfile::TempDir, impl Fn(), Decider<MemoryStore>) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("limits.yaml");
        std::fs::write(&file, "rules:\n  r: {concurrency: 2, slot_ttl_ms: 9000}\n").unwrap();
        let metrics = Arc::new(Metrics::new());
        let policy =
            PolicyHandle::load(vec![file.clone()], Bounds::default(), metrics.clone()).unwrap();
        let d = Decider::new(store.clone(), policy.clone(), metrics);
        let reload = move || {
            std::fs::write(&file, "rules:\n  r: {concurrency: 2, slot_ttl_ms: 1000}\n").unwrap();
            assert!(policy.reload("test").unwrap());
        };
        (dir, reload, d)
    }

    #[tokio::test]
    async fn a_renewal_after_a_reload_that_lowered_slot_ttl_ms_names_the_new_ttl() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (_dir, reload, d) = on_ttl_9000(&store);
        let a = d.decide(call(&["r"])).await;
        assert_eq!(a.answers[0].slot.as_ref().map(|h| h.ttl_ms), Some(9_000));
        reload();
        let r = d
            .update_slots(SlotsRequest {
                domain: "ratelimit".into(),
                renew: vec![slot_ref("r", &held_id(&a))],
                release: vec![],
            })
            .await
            .unwrap();
        assert_eq!((r.renewed, r.ttl_ms), (1, Some(1_000)));
    }

    /// Requests given 9000 ms renew every 3 s: after a reload to 1000 ms, a store loss leaves
    /// them unknown for up to 9 s, not 1 s (make chaos, seed 10).
    #[tokio::test]
    async fn after_a_reload_that_lowered_slot_ttl_ms_a_loss_waits_for_the_old_ttl() {
        use crate::store::StoreReset;
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000).with_store_reset(StoreReset::Empty));
        let (_dir, reload, d) = on_ttl_9000(&store);
        let _ = d.decide(call(&["r"])).await; // makes the epoch
        store.advance_ms(9_100);
        for _ in 0..2 {
            assert!(d.decide(call(&["r"])).await.answers[0].allowed);
        }
        reload();
        store.lose_state();
        let _ = d.decide(call(&["r"])).await; // the epoch, made by the first call after the loss
        store.advance_ms(2_000);
        let a = d.decide(call(&["r"])).await;
        assert!(
            !a.answers[0].allowed,
            "2 s after the loss the two requests may still run without having renewed"
        );
        store.advance_ms(7_100);
        assert!(
            d.decide(call(&["r"])).await.answers[0].allowed,
            "9 s after the loss every request still running has renewed"
        );
    }
}
