//! Planning: each decision's limit resolved in the policy in force. A decision becomes a bucket
//! to charge, answered by the store; an unlimited or a blocked limit, answered without the store;
//! or, for the wasm filter, an unknown rule: a configuration error of that decision alone, the
//! request's other decisions deciding as usual (its result carries the error, and the gateway
//! applies that rule's `on_error`). A request none of whose decisions is known, or of a domain no
//! policy file defines, fails as a whole. A descriptor of Envoy's rate limit API that matches no
//! limit is simply not limited. A limit that another applicable limit `replaces`
//! (envoyproxy/ratelimit's format) does not apply.
//!
//! # Regional rules
//!
//! A decision of a regional rule (`docs/regions.md`) is charged under this region's share: its
//! bucket carries the share history this sidecar holds under a lease ([`crate::regional::RegionalShares`]), and
//! the script takes the bucket under the smallest share since its last decision. Without a valid
//! lease the request is answered "unavailable" (the gateway's `on_error` decides). The answer's
//! applied limit is the region's: the rule's numbers scaled by the share in force.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ratelimit_regions::ShareHistory;
use ratelimit_wire::{ErrorCode, RequestError, MAX_RECEIPT};

use super::{Caller, Decider, Item, ReturnItem, SettleItem};
use crate::policy::own_format::RULE_KEY;
use crate::policy::{Limit, LimitKind, Policy, Resolution};
use crate::store::{BucketLimits, BucketStore, Charge, GrantCap, Return, Settlement};

/// A resolved decision.
pub(super) enum Plan {
    /// Charged in the store (under this region's share history, for a regional limit).
    Charge {
        limit: Arc<Limit>,
        key: Arc<str>,
        bucket: BucketLimits,
        /// The receipt id its charge is kept under, when the decision asked for one (0: none).
        receipt: u64,
    },
    /// Answered here: unlimited (or not limited at all, for Envoy's API).
    Unlimited { limit: Option<Arc<Limit>> },
    /// Answered here: never admitted.
    Blocked { limit: Arc<Limit> },
    /// Not decided: a rule the policy lacks (the wasm filter's). Nothing is charged for it.
    Unknown { error: RequestError },
}

impl<S: BucketStore> Decider<S> {
    /// Resolves a request's items; an unknown rule (filter) is that item's error, an unknown
    /// domain or a request of unknown rules only fails the request.
    pub(super) fn plan(
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
                            key: self.store.bucket_key(domain, &entries),
                            bucket: BucketLimits {
                                capacity,
                                refill_per_sec,
                                share: self.share_for(&limit)?,
                            },
                            limit,
                            receipt: if item.receipt { new_receipt() } else { 0 },
                        },
                        LimitKind::Unlimited => Plan::Unlimited { limit: Some(limit) },
                        LimitKind::Blocked => Plan::Blocked { limit },
                    }
                }
                Resolution::NoLimit if caller == Caller::RateLimitService => {
                    Plan::Unlimited { limit: None }
                }
                Resolution::NoLimit => Plan::Unknown {
                    error: self.unknown(policy, domain, &entries),
                },
                Resolution::UnknownDomain => return Err(self.unknown(policy, domain, &entries)),
            };
            plans.push(plan);
        }
        if let [Plan::Unknown { error }, rest @ ..] = &plans[..] {
            if rest.iter().all(|p| matches!(p, Plan::Unknown { .. })) {
                return Err(error.clone());
            }
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

    /// The error of a decision whose rule (or domain) the policy lacks: counted, and warned the
    /// first time for each (domain, rule), then at most once per [`UNKNOWN_WARN_INTERVAL`] with
    /// how many decisions named it since.
    fn unknown(
        &self,
        policy: &Policy,
        domain: &str,
        entries: &[(&str, Option<&str>)],
    ) -> RequestError {
        let rule = entries
            .first()
            .filter(|(k, _)| *k == RULE_KEY)
            .and_then(|(_, v)| *v)
            .unwrap_or("");
        self.metrics.unknown_rule();
        let due = self.logged_unknown.lock().ok().and_then(|mut seen| {
            let key = (domain.to_string(), rule.to_string());
            if !seen.contains_key(&key) && seen.len() >= 1000 {
                return None;
            }
            seen.entry(key).or_default().met(Instant::now())
        });
        let message = if matches!(policy.resolve(domain, &[]), Resolution::UnknownDomain) {
            format!("unknown domain {domain:?}: no policy file defines it")
        } else {
            format!("unknown rule {rule:?} in domain {domain:?} (or no limit matches its subject)")
        };
        if let Some(decisions) = due {
            tracing::warn!(
                "configuration error: {message}: {decisions} decision(s) since the last warning \
                 (warned at most once a minute; ratelimit_unknown_rule_total counts each)"
            );
        }
        RequestError {
            code: ErrorCode::UnknownRule,
            message,
        }
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

    pub(super) fn plan_returns(
        &self,
        policy: &Policy,
        domain: &str,
        returns: &[ReturnItem],
    ) -> Vec<Return> {
        returns
            .iter()
            .filter_map(|r| {
                // Without a share under lease the tokens are not given back (under-admission).
                let (key, bucket) = self.bucket_of(policy, domain, &r.entries)?;
                Some(Return {
                    key,
                    bucket,
                    lease_id: r.lease_id,
                    tokens: r.tokens,
                })
            })
            .collect()
    }
}

impl<S: BucketStore> Decider<S> {
    /// The bucket a settlement on `entries` settles, under the policy in force: `None` when there
    /// is none (an unknown rule, an unlimited or blocked limit, a regional rule without a share
    /// under lease or with a share of 0 in force: nothing of this region's to settle).
    pub(super) fn plan_settlement(
        &self,
        policy: &Policy,
        domain: &str,
        item: &SettleItem,
    ) -> Option<Settlement> {
        let (key, bucket) = self.bucket_of(policy, domain, &item.entries)?;
        let (capacity_now, refill_now) = bucket.in_force();
        (capacity_now > 0 && refill_now > 0.0).then_some(Settlement {
            key,
            bucket,
            reserved: item.reserved,
            cost: item.cost,
            receipt: item.receipt,
        })
    }

    /// The key and limits of the bucket `entries` name under the policy in force: `None` for an
    /// unknown rule, an unlimited or blocked limit, or a regional rule without a share under
    /// lease (a lease return and a settlement on it are then dropped).
    fn bucket_of(
        &self,
        policy: &Policy,
        domain: &str,
        entries: &[(String, Option<String>)],
    ) -> Option<(Arc<str>, BucketLimits)> {
        let entries: Vec<(&str, Option<&str>)> = entries
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
        let share = self.share_for(limit).ok()?;
        Some((
            self.store.bucket_key(domain, &entries),
            BucketLimits {
                capacity,
                refill_per_sec,
                share,
            },
        ))
    }
}

/// A receipt id: random, 1 to [`MAX_RECEIPT`] (a caller cannot guess another's).
fn new_receipt() -> u64 {
    rand::random::<u64>() % MAX_RECEIPT + 1
}

/// What the store charges for a planned decision, if anything.
pub(super) fn charge(plan: &Plan, item: &Item, caller: Caller) -> Option<Charge> {
    let Plan::Charge {
        limit,
        key,
        bucket,
        receipt,
    } = plan
    else {
        return None;
    };
    Some(Charge {
        key: key.clone(),
        bucket: bucket.clone(),
        cost: item.cost,
        shadow: limit.shadow,
        // A rule with `concurrency` grants no lease: a gateway admitting from a lease would
        // take no slot (docs/concurrency.md).
        lease: item
            .lease
            .filter(|l| l.tokens > 0 && limit.concurrency.is_none()),
        grant_cap: if caller == Caller::Quota {
            GrantCap::Ask
        } else {
            GrantCap::Share
        },
        receipt: *receipt,
    })
}

fn plan_limit(p: &Plan) -> Option<&Limit> {
    match p {
        Plan::Charge { limit, .. } | Plan::Blocked { limit } => Some(limit),
        Plan::Unlimited { limit } => limit.as_deref(),
        Plan::Unknown { .. } => None,
    }
}

/// A non-shadow blocked limit rejects the request before anything is sent.
pub(super) fn blocked(plan: &[Plan]) -> bool {
    plan.iter()
        .any(|p| matches!(p, Plan::Blocked { limit } if !limit.shadow))
}

/// How often an unknown rule is warned at most, per (domain, rule).
pub const UNKNOWN_WARN_INTERVAL: Duration = Duration::from_secs(60);

/// One unknown (domain, rule): when it was last warned, and how often it was met since.
#[derive(Debug, Default)]
pub struct UnknownSeen {
    warned: Option<Instant>,
    since: u64,
}

impl UnknownSeen {
    /// Notes one decision at `now`; the number to warn of (this one included) when a warning
    /// is due: the first time, then once per [`UNKNOWN_WARN_INTERVAL`].
    pub fn met(&mut self, now: Instant) -> Option<u64> {
        self.since += 1;
        let due = self
            .warned
            .is_none_or(|at| now.saturating_duration_since(at) >= UNKNOWN_WARN_INTERVAL);
        if !due {
            return None;
        }
        self.warned = Some(now);
        Some(std::mem::take(&mut self.since))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::policy::reload::PolicyHandle;
    use crate::policy::{Bounds, RegionScope};
    use crate::store::memory::MemoryStore;
    use ratelimit_wire::LeaseAsk;

    const POLICY: &str = "rules:
  global: {capacity: 100, refill_per_sec: 10, regions: {eu: 0.3, us: 0.7}}
  local: {capacity: 10, refill_per_sec: 1}
";

    fn entries(rule: &str) -> Vec<(String, Option<String>)> {
        vec![(RULE_KEY.to_string(), Some(rule.to_string()))]
    }

    #[test]
    fn a_regional_rule_without_a_share_fails_its_request_and_its_returns_are_kept() {
        let bounds = Bounds {
            region: RegionScope::Sidecar(Some("eu".into())),
            ..Bounds::default()
        };
        let p = Policy::from_sources(&[("limits.yaml".into(), POLICY.into())], &bounds).unwrap();
        let metrics = Arc::new(Metrics::new());
        // A decider without this region's shares (no `with_regional`).
        let d = Decider::new(
            Arc::new(MemoryStore::new(0, 0.1, 10_000)),
            PolicyHandle::fixed(p, metrics.clone()),
            metrics,
        );
        let policy = d.policy.current().clone();
        let item = |rule: &str| Item {
            entries: entries(rule),
            cost: 1,
            lease: None,
            receipt: false,
        };
        let plan = |items: &[Item]| d.plan(&policy, "ratelimit", items, Caller::Filter);
        let e = plan(&[item("local"), item("global")])
            .err()
            .expect("unavailable");
        assert_eq!(e.code, ErrorCode::Unavailable);
        assert!(e.message.contains("no region (--region)"), "{}", e.message);
        let local = plan(&[item("local")]).unwrap();
        let [Plan::Charge { key, bucket, .. }] = &local[..] else {
            panic!("one charge");
        };
        assert_eq!(&**key, "rl:{ratelimit|rule=local}");
        assert_eq!((bucket.capacity, bucket.share.is_none()), (10, true));
        // Tokens of a regional rule without a share are not given back (under-admission), nor
        // those of a rule the policy lacks.
        let ret = |rule: &str| ReturnItem {
            entries: entries(rule),
            lease_id: 1,
            tokens: 3,
        };
        let returns = d.plan_returns(
            &policy,
            "ratelimit",
            &[ret("global"), ret("local"), ret("nope")],
        );
        assert_eq!(returns.len(), 1);
        assert_eq!(&*returns[0].key, "rl:{ratelimit|rule=local}");
        // Only the RLQS planner's grants escape --lease-max-share: it sizes its own.
        let ask = Item {
            lease: Some(LeaseAsk {
                id: 1,
                tokens: 9,
                ttl_ms: 1,
            }),
            ..item("local")
        };
        let caps: Vec<GrantCap> = [Caller::Filter, Caller::RateLimitService, Caller::Quota]
            .into_iter()
            .map(|c| charge(&local[0], &ask, c).expect("a charge").grant_cap)
            .collect();
        assert_eq!(caps, [GrantCap::Share, GrantCap::Share, GrantCap::Ask]);
    }

    #[test]
    fn an_unknown_rule_warns_at_once_then_once_an_interval_with_the_count_since() {
        let t0 = Instant::now();
        let mut seen = UnknownSeen::default();
        assert_eq!(seen.met(t0), Some(1), "the first one warns");
        for i in 1..150 {
            assert_eq!(seen.met(t0 + Duration::from_millis(i)), None);
        }
        let later = t0 + UNKNOWN_WARN_INTERVAL;
        assert_eq!(seen.met(later), Some(150), "149 quiet ones and this one");
        assert_eq!(seen.met(later + Duration::from_secs(1)), None);
    }
}
