//! A request's answer from the store's outcomes: each decision's result on the wire (the limit
//! it applied, its figures, its reason) and its count in the metrics and in this region's demand.

use ratelimit_wire::{
    AppliedLimit, DecisionResult, ErrorCode, Reason, RequestAnswer, RequestError,
};

use super::plan::Plan;
use super::{Decider, Item};
use crate::metrics::{CountedAs, Metrics};
use crate::store::{BucketOutcome, Decided, StoreError};

impl<S> Decider<S> {
    /// A request's answer from what the store answered: `decided.decisions` holds one outcome per
    /// charge of `plan`, in order (none when nothing was sent).
    pub(super) fn answer<'p>(
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
            slot: None,
        }
    }

    /// The wire result of one decision: `outcome` is its bucket's answer, when it has one.
    fn result<'p>(
        &self,
        tally: &mut Tally<'p>,
        plan: &'p Plan,
        outcome: Option<BucketOutcome>,
        request_allowed: bool,
        cost: u64,
    ) -> DecisionResult {
        match plan {
            // Not decided (counted as an unknown rule when planned): says nothing of the request.
            Plan::Unknown { error } => DecisionResult {
                allowed: true,
                remaining: 0,
                retry_after_ms: 0,
                reset_ms: 0,
                reason: Reason::Ok,
                limit: None,
                shadow: false,
                leased: 0,
                receipt: None,
                error: Some(error.clone()),
            },
            Plan::Unlimited { limit } => {
                if let Some(l) = limit {
                    tally.add(&l.name, CountedAs::Unlimited);
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
                    receipt: None,
                    error: None,
                }
            }
            Plan::Blocked { limit } => {
                tally.add(
                    &limit.name,
                    if limit.shadow {
                        CountedAs::ShadowRejected
                    } else {
                        CountedAs::Blocked
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
                    receipt: None,
                    error: None,
                }
            }
            Plan::Charge {
                limit,
                bucket,
                receipt,
                ..
            } => {
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
                        receipt: None,
                        error: None,
                    };
                };
                let counted = match (o.allowed, limit.shadow) {
                    (true, _) if request_allowed => CountedAs::Allowed,
                    (true, _) => CountedAs::NotCharged,
                    (false, true) => CountedAs::ShadowRejected,
                    (false, false) => CountedAs::Rejected,
                };
                tally.add(&limit.name, counted);
                if let (Some(rule), Some(shares)) = (&limit.regional, &self.regional) {
                    // The demand the rebalancer reads, in tokens: taken (cost and lease) or refused.
                    match counted {
                        CountedAs::Allowed => shares.count(rule, cost + o.leased, 0),
                        CountedAs::Rejected | CountedAs::ShadowRejected => {
                            shares.count(rule, 0, cost)
                        }
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
                    // Charged under its receipt only when the request was admitted.
                    receipt: (request_allowed && o.allowed && *receipt > 0)
                        .then(|| receipt.to_string()),
                    error: None,
                }
            }
        }
    }
}

/// A call's decisions counted per limit and verdict, added to the metrics once each (a label
/// lookup per limit and call, not per decision).
#[derive(Default)]
pub(super) struct Tally<'a>(Vec<(&'a str, CountedAs, u64)>);

impl<'a> Tally<'a> {
    fn add(&mut self, limit: &'a str, verdict: CountedAs) {
        match self
            .0
            .iter_mut()
            .find(|(l, v, _)| *v == verdict && *l == limit)
        {
            Some((_, _, n)) => *n += 1,
            None => self.0.push((limit, verdict, 1)),
        }
    }

    pub(super) fn add_to(self, metrics: &Metrics) {
        for (limit, verdict, n) in self.0 {
            metrics.decisions_of(limit, verdict, n);
        }
    }
}

pub(super) fn error_answer(e: RequestError) -> RequestAnswer {
    RequestAnswer {
        allowed: false,
        results: Vec::new(),
        error: Some(e),
        slot: None,
    }
}

pub(super) fn from_store(e: &StoreError) -> RequestError {
    RequestError {
        code: if e.is_deterministic() {
            ErrorCode::ScriptFailed
        } else {
            ErrorCode::Unavailable
        },
        message: e.to_string(),
    }
}
