//! One round of a stream: the buckets' asks planned into store calls, and the answers turned
//! into assignments sent in responses within the body limit.

use super::session::{Planned, Round, Session};
use super::*;

impl<S: BucketStore> Session<S> {
    /// Plans a round of `keys`: what each is told, and the store calls that take the tokens
    /// their plans need (a future that borrows nothing: the reports are read meanwhile). A
    /// `renewal` round (the timer's) leaves out the renewals that can wait for the next round.
    pub(super) fn plan(
        &mut self,
        keys: Vec<String>,
        renewal: bool,
    ) -> (Planned, BoxFuture<'static, Vec<RequestAnswer>>) {
        let timing = self.shared.settings.timing;
        let started = Instant::now();
        let now = self.now_ms();
        let (mut rounds, unknown) = self.classify(&keys);
        if unknown > 0 {
            // Once per round, with a count: a bucket id carries what clients sent.
            tracing::warn!(
                "rlqs stream {}: {unknown} bucket(s) of a rule or domain {:?} the policy lacks (or \
                 whose subject no limit matches): assigned DENY_ALL (the ids at debug level)",
                self.id,
                self.domain
            );
        }
        if renewal {
            let next_ms = now.saturating_add(self.shared.settings.renew_ms);
            for (key, round) in keys.iter().zip(rounds.iter_mut()) {
                if let Some(t) = self.buckets.get(key) {
                    if can_wait(&t.holding, round, now, next_ms, timing) {
                        *round = Round::Skip;
                    }
                }
            }
        }
        // The buckets whose plan needs tokens: one request each (cost 1, the rest as a lease).
        let mut asks: Vec<Option<(plan::Ask, Option<usize>)>> = Vec::with_capacity(keys.len());
        let mut items = Vec::new();
        for (key, round) in keys.iter().zip(&rounds) {
            let (Round::Plan(target), Some(t)) = (round, self.buckets.get(key)) else {
                asks.push(None);
                continue;
            };
            let ask = t.holding.ask(now, *target, timing);
            let request = match &t.entries {
                Ok(entries) if ask.tokens > 0 => {
                    items.push(vec![Item {
                        entries: entries.clone(),
                        cost: 1,
                        receipt: false,
                        // The grant is taken now and never returned; the lease record lives
                        // 1 ms, so it does not lower the bucket's ceiling (docs/rlqs.md, "The
                        // bound": the tokens are Envoy's future refill, not tokens held now).
                        lease: (ask.tokens > 1).then_some(LeaseAsk {
                            id: t.lease_id,
                            tokens: ask.tokens - 1,
                            ttl_ms: 1,
                        }),
                    }]);
                    Some(items.len() - 1)
                }
                _ => None,
            };
            asks.push(Some((ask, request)));
        }
        // The round's store calls (10,000 buckets are 40 calls) go out `--redis-pipeline` at a
        // time, not one after the other: the round must reach Envoy within the delivery margin
        // of its planning. Not all at once either: a call's Redis timeout counts from when it
        // is sent, and the last of 40 would wait behind the others.
        let calls: Vec<Vec<Vec<Item>>> = items.chunks(MAX_REQUESTS).map(<[_]>::to_vec).collect();
        let (decider, domain) = (self.shared.decider.clone(), self.domain.clone());
        let in_flight = self.shared.settings.store_calls_in_flight.max(1);
        let answers = async move {
            futures::stream::iter(calls.into_iter().map(|chunk| {
                let (decider, domain) = (decider.clone(), domain.clone());
                async move {
                    decider
                        .run(&domain, None, chunk, Vec::new(), Caller::Quota)
                        .await
                }
            }))
            .buffered(in_flight)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .flatten()
            .collect()
        }
        .boxed();
        let planned = Planned {
            keys,
            rounds,
            asks,
            now,
            started,
        };
        (planned, answers)
    }

    /// Answers a round with its store calls' `answers`: what each bucket is sent, in responses
    /// of at most `--max-body-bytes` each (one action larger than that goes alone).
    pub(super) fn answer_round(
        &mut self,
        planned: Planned,
        answers: Vec<RequestAnswer>,
    ) -> Vec<RateLimitQuotaResponse> {
        let timing = self.shared.settings.timing;
        let metrics = self.shared.decider.metrics().clone();
        let Planned {
            keys,
            rounds,
            asks,
            now,
            started,
        } = planned;
        // Settled at the planning time: the margin covers the store's answer and the sending
        // (docs/rlqs.md), and the grant was sized for that time. A round whose store calls took
        // more than half the margin is settled at their end instead, leaving the other half for
        // the sending: that can only send less (what the tokens taken cover from then on).
        let at = if started.elapsed().as_millis() > u128::from(timing.margin_ms / 2) {
            metrics.rlqs_late_rounds.inc();
            self.now_ms()
        } else {
            now
        };
        let mut failed: Option<(usize, String)> = None;
        let mut actions = Vec::with_capacity(keys.len());
        for ((key, round), asked) in keys.iter().zip(rounds).zip(asks) {
            let Some(t) = self.buckets.get_mut(key) else {
                continue;
            };
            let strategy = match round {
                Round::Skip => continue,
                Round::Send(Strategy::AllowAll) => {
                    t.holding = Holding::default();
                    Strategy::AllowAll
                }
                Round::Send(_) => deny(&mut t.holding, at, timing),
                Round::Plan(target) => {
                    let Some((ask, request)) = asked else {
                        continue;
                    };
                    let granted = match request.and_then(|i| answers.get(i)) {
                        None => Some(0),
                        Some(answer) => match &answer.error {
                            Some(e) if e.code == ErrorCode::UnknownRule => None,
                            Some(e) => {
                                let (n, _) = failed.get_or_insert_with(|| (0, e.message.clone()));
                                *n += 1;
                                continue;
                            }
                            None => match answer.results.first() {
                                Some(r) if r.reason == Reason::Unlimited => {
                                    t.holding = Holding::default();
                                    actions.push(action(&t.id, Strategy::AllowAll, timing));
                                    continue;
                                }
                                Some(r) if r.reason == Reason::Blocked => None,
                                Some(r) => Some(u64::from(answer.allowed) + r.leased),
                                None => Some(0),
                            },
                        },
                    };
                    match granted {
                        Some(granted) => t.holding.choose(at, ask, granted, target, timing),
                        None => deny(&mut t.holding, at, timing),
                    }
                }
            };
            tracing::debug!(
                "rlqs stream {}: {:?} demand {:.1}/s reserved {:.0} -> {strategy:?}",
                self.id,
                t.id.bucket,
                t.demand.per_sec(),
                t.holding.reserved()
            );
            actions.push(action(&t.id, strategy, timing));
        }
        if let Some((n, first)) = failed {
            // Once per round, with a count (a Redis outage fails every bucket of every round).
            tracing::warn!(
                "rlqs stream {}: no assignment for {n} bucket(s) this round: {first}",
                self.id
            );
        }
        for a in &actions {
            metrics
                .rlqs_assignments
                .get_or_create(&StrategyLabels {
                    strategy: strategy_label(a),
                })
                .inc();
        }
        metrics
            .rlqs_round_duration
            .observe(started.elapsed().as_secs_f64());
        responses(actions, self.shared.settings.max_message_bytes)
    }
}

/// `actions` in responses of at most `limit` bytes each (one action larger than that goes
/// alone).
pub(super) fn responses(actions: Vec<BucketAction>, limit: usize) -> Vec<RateLimitQuotaResponse> {
    let mut out = Vec::new();
    let mut bucket_action = Vec::new();
    let mut size = 0;
    for a in actions {
        let n = a.encoded_len();
        let field = 1 + prost::encoding::encoded_len_varint(n as u64) + n;
        if !bucket_action.is_empty() && size + field > limit {
            out.push(RateLimitQuotaResponse {
                bucket_action: std::mem::take(&mut bucket_action),
            });
            size = 0;
        }
        size += field;
        bucket_action.push(a);
    }
    if !bucket_action.is_empty() {
        out.push(RateLimitQuotaResponse { bucket_action });
    }
    out
}

/// Whether this round can leave `round` out: it would renew what was sent (the same token
/// bucket, or DENY_ALL again), and the round at `next_ms` still reaches Envoy in time.
pub(super) fn can_wait(
    holding: &Holding,
    round: &Round,
    now_ms: u64,
    next_ms: u64,
    timing: Timing,
) -> bool {
    let renews = match round {
        Round::Plan(target) => holding.ask(now_ms, *target, timing).proposal == Proposal::Renew,
        Round::Send(Strategy::DenyAll) => holding.strategy() == Some(Strategy::DenyAll),
        Round::Send(_) | Round::Skip => false,
    };
    renews && holding.renewal_can_wait(next_ms, timing)
}

/// The `strategy` label of an assignment.
pub(super) fn strategy_label(action: &BucketAction) -> &'static str {
    let strategy = match &action.bucket_action {
        Some(Action::QuotaAssignmentAction(a)) => a
            .rate_limit_strategy
            .as_ref()
            .and_then(|s| s.strategy.as_ref()),
        _ => None,
    };
    match strategy {
        Some(PbStrategy::TokenBucket(_)) => "token_bucket",
        Some(PbStrategy::BlanketRule(r)) if *r == BlanketRule::AllowAll as i32 => "allow_all",
        _ => "deny_all",
    }
}

/// DENY_ALL through the planner, so the holding's worst case stays right.
pub(super) fn deny(holding: &mut Holding, now_ms: u64, timing: Timing) -> Strategy {
    let zero = Target {
        max_tokens: 0,
        tokens_per_sec: 0,
    };
    let ask = holding.ask(now_ms, zero, timing);
    holding.choose(now_ms, ask, 0, zero, timing)
}

/// The bucket action that assigns `strategy` for the TTL.
pub(super) fn action(id: &BucketId, strategy: Strategy, timing: Timing) -> BucketAction {
    let strategy = match strategy {
        Strategy::AllowAll => PbStrategy::BlanketRule(BlanketRule::AllowAll as i32),
        Strategy::DenyAll => PbStrategy::BlanketRule(BlanketRule::DenyAll as i32),
        Strategy::TokenBucket {
            max_tokens,
            tokens_per_sec,
        } => PbStrategy::TokenBucket(TokenBucket {
            max_tokens,
            tokens_per_fill: Some(UInt32Value {
                value: tokens_per_sec,
            }),
            fill_interval: Some(PbDuration {
                seconds: 1,
                nanos: 0,
            }),
        }),
    };
    BucketAction {
        bucket_id: Some(id.clone()),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(PbDuration {
                seconds: i64::try_from(timing.ttl_s).unwrap_or(i64::MAX),
                nanos: 0,
            }),
            rate_limit_strategy: Some(RateLimitStrategy {
                strategy: Some(strategy),
            }),
        })),
    }
}
