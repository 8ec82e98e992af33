//! The quota edge: Envoy's rate limit quota service, `envoy.service.rate_limit_quota.v3.
//! RateLimitQuotaService/StreamRateLimitQuotas`, for Envoy's `envoy.filters.http.rate_limit_quota`
//! filter. Each Envoy streams usage reports per bucket; the sidecar answers each bucket with an
//! assignment (a local token bucket, or a blanket rule) whose tokens it first takes from the
//! rule's Redis bucket as a lease ([`plan`] sizes both). Served on the same listener as the other
//! APIs, behind the same authentication. docs/rlqs.md is the operator's reference: the mapping,
//! the Envoy behaviour it rests on, the bound.
//!
//! # Mapping
//!
//! - The report's `domain` is the policy domain; a bucket id's key `rule` is the rule, its other
//!   keys the subject's dimensions ([`bucket_id`]).
//! - A rule's limit: a bucket -> a `TokenBucket` assignment sized by [`plan`]; `unlimited` or
//!   shadow mode -> `ALLOW_ALL`; `blocked` -> `DENY_ALL`. An unknown rule or a malformed bucket id
//!   -> `DENY_ALL` (a configuration error, logged), never `ALLOW_ALL`.
//! - Redis unavailable: no assignment is sent; what was sent stays live until its TTL, then
//!   Envoy's `expired_assignment_behavior` applies (and for a new bucket its
//!   `no_assignment_behavior`).

pub mod bucket_id;
pub mod plan;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{
    BlanketRule, Strategy as PbStrategy,
};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};
use futures::Stream;
use ratelimit_wire::{ErrorCode, LeaseAsk, Reason, MAX_LEASE_ID, MAX_NAME_BYTES, MAX_REQUESTS};
use tokio::sync::mpsc;
use tonic::server::NamedService;
use tonic::{Request, Response, Status, Streaming};

use self::plan::{Demand, Holding, Proposal, Strategy, Target, Timing};
use crate::decide::{Caller, Decider, Entries, Item};
use crate::metrics::StrategyLabels;
use crate::policy::{LimitKind, Resolution};
use crate::store::BucketStore;

/// How the sidecar assigns quota (`--rlqs-*`, docs/configuration.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RlqsSettings {
    pub timing: Timing,
    /// How often every bucket of a stream is assigned again (renewed).
    pub renew_ms: u64,
    /// The most buckets one stream may hold; reports of further buckets are not answered.
    pub max_buckets: usize,
}

/// The quota service over a [`Decider`].
pub struct RlqsApi<S> {
    shared: Arc<Shared<S>>,
}

struct Shared<S> {
    decider: Arc<Decider<S>>,
    settings: RlqsSettings,
    started: Instant,
    next_stream: AtomicU64,
    /// Every stream's smoothed demand per bucket: (domain, bucket) -> stream -> requests/s.
    demand: Mutex<HashMap<(String, String), HashMap<u64, f64>>>,
}

impl<S: BucketStore> RlqsApi<S> {
    pub fn new(decider: Arc<Decider<S>>, settings: RlqsSettings) -> Self {
        Self {
            shared: Arc::new(Shared {
                decider,
                settings,
                started: Instant::now(),
                next_stream: AtomicU64::new(1),
                demand: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The service as routes of the sidecar's router (as [`crate::grpc::RateLimitApi`]'s).
    pub fn into_router(self, max_message_bytes: usize) -> axum::Router {
        let path = format!(
            "/{}/{{*method}}",
            <RateLimitQuotaServiceServer<Self> as NamedService>::NAME
        );
        axum::Router::new().route_service(
            &path,
            RateLimitQuotaServiceServer::new(self).max_decoding_message_size(max_message_bytes),
        )
    }
}

type Assignments = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

#[tonic::async_trait]
impl<S: BucketStore> RateLimitQuotaService for RlqsApi<S> {
    type StreamRateLimitQuotasStream = Assignments;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Assignments>, Status> {
        let reports = request.into_inner();
        let (tx, rx) = mpsc::channel(8);
        let id = self.shared.next_stream.fetch_add(1, Ordering::Relaxed);
        let session = Session {
            shared: self.shared.clone(),
            id,
            tx,
            domain: String::new(),
            buckets: HashMap::new(),
            warned_full: false,
        };
        tokio::spawn(session.run(reports));
        let out =
            futures::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (Ok(m), rx)) },
            );
        Ok(Response::new(Box::pin(out)))
    }
}

/// One bucket of one stream.
struct Tracked {
    id: BucketId,
    entries: Result<Entries, String>,
    holding: Holding,
    demand: Demand,
    lease_id: u64,
}

/// One Envoy's stream: its buckets, their holdings and demand.
struct Session<S> {
    shared: Arc<Shared<S>>,
    id: u64,
    tx: mpsc::Sender<RateLimitQuotaResponse>,
    domain: String,
    buckets: HashMap<String, Tracked>,
    warned_full: bool,
}

/// What one bucket is told this round, before the store is asked.
enum Round {
    Send(Strategy),
    /// A limit with a bucket: the planner's target, and its limit's name for the logs.
    Plan(Target),
    /// Nothing is sent (the store could not be asked).
    Skip,
}

impl<S: BucketStore> Session<S> {
    async fn run(mut self, mut reports: Streaming<RateLimitQuotaUsageReports>) {
        let mut ticker =
            tokio::time::interval(Duration::from_millis(self.shared.settings.renew_ms.max(1)));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        let metrics = self.shared.decider.metrics().clone();
        metrics.rlqs_streams.inc();
        loop {
            tokio::select! {
                message = reports.message() => match message {
                    Ok(Some(report)) => {
                        let fresh = self.on_report(report);
                        if !fresh.is_empty() {
                            self.assign(fresh, false).await;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!("rlqs stream {} ended: {e}", self.id);
                        break;
                    }
                },
                _ = ticker.tick() => {
                    let all: Vec<String> = self.buckets.keys().cloned().collect();
                    if !all.is_empty() {
                        self.assign(all, true).await;
                    }
                }
                _ = self.tx.closed() => break,
            }
        }
        metrics.rlqs_streams.dec();
        if let Ok(mut demand) = self.shared.demand.lock() {
            let domain = self.domain.clone();
            for key in self.buckets.keys() {
                let k = (domain.clone(), key.clone());
                if let Some(streams) = demand.get_mut(&k) {
                    streams.remove(&self.id);
                    if streams.is_empty() {
                        demand.remove(&k);
                    }
                }
            }
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.shared.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Records a report's usage; returns the buckets seen for the first time.
    fn on_report(&mut self, report: RateLimitQuotaUsageReports) -> Vec<String> {
        let now = self.now_ms();
        if self.domain.is_empty()
            && !report.domain.is_empty()
            && report.domain.len() <= MAX_NAME_BYTES
        {
            self.domain = report.domain.clone();
        }
        let mut fresh = Vec::new();
        for usage in report.bucket_quota_usages {
            let Some(id) = usage.bucket_id else { continue };
            let key = bucket_id::canonical(&id.bucket);
            let requests = usage
                .num_requests_allowed
                .saturating_add(usage.num_requests_denied);
            if !self.buckets.contains_key(&key) {
                if self.buckets.len() >= self.shared.settings.max_buckets {
                    if !self.warned_full {
                        self.warned_full = true;
                        tracing::warn!(
                            "rlqs stream {}: more than --rlqs-max-buckets {} buckets; further \
                             buckets get no assignment",
                            self.id,
                            self.shared.settings.max_buckets
                        );
                    }
                    continue;
                }
                let entries = bucket_id::entries(&id.bucket);
                if let Err(e) = &entries {
                    tracing::warn!("rlqs stream {}: {e}: assigned DENY_ALL", self.id);
                }
                self.buckets.insert(
                    key.clone(),
                    Tracked {
                        id,
                        entries,
                        holding: Holding::default(),
                        demand: Demand::default(),
                        lease_id: rand::random::<u64>() & MAX_LEASE_ID,
                    },
                );
                fresh.push(key.clone());
            }
            if let Some(t) = self.buckets.get_mut(&key) {
                t.demand.report(now, requests);
                let per_sec = t.demand.per_sec();
                if let Ok(mut demand) = self.shared.demand.lock() {
                    demand
                        .entry((self.domain.clone(), key))
                        .or_default()
                        .insert(self.id, per_sec);
                }
            }
        }
        fresh
    }

    /// What each bucket's rule says, under the policy in force.
    fn classify(&self, keys: &[String]) -> Vec<Round> {
        let policy = self.shared.decider.policy().current();
        let demand = self.shared.demand.lock().ok();
        keys.iter()
            .map(|key| {
                let Some(t) = self.buckets.get(key) else {
                    return Round::Skip;
                };
                let Ok(entries) = &t.entries else {
                    return Round::Send(Strategy::DenyAll);
                };
                let refs: Vec<(&str, Option<&str>)> = entries
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_deref()))
                    .collect();
                match policy.resolve(&self.domain, &refs) {
                    Resolution::Limit(limit) => match limit.kind {
                        _ if limit.shadow => Round::Send(Strategy::AllowAll),
                        LimitKind::Unlimited => Round::Send(Strategy::AllowAll),
                        LimitKind::Blocked => Round::Send(Strategy::DenyAll),
                        LimitKind::Bucket {
                            capacity,
                            refill_per_sec,
                        } => {
                            let all: Vec<f64> = demand
                                .as_ref()
                                .and_then(|d| d.get(&(self.domain.clone(), key.clone())))
                                .map(|m| m.values().copied().collect())
                                .unwrap_or_default();
                            let mine = t.demand.per_sec();
                            let all = if all.is_empty() { vec![mine] } else { all };
                            Round::Plan(plan::target(capacity, refill_per_sec, mine, &all))
                        }
                    },
                    Resolution::NoLimit | Resolution::UnknownDomain => {
                        // Once per bucket and stream: renewals repeat it every second.
                        if t.holding.strategy().is_none() {
                            tracing::warn!(
                            "rlqs: unknown rule in domain {:?} for bucket {:?} (or no limit matches \
                             its subject): assigned DENY_ALL",
                            self.domain,
                            t.id.bucket
                        );
                        }
                        Round::Send(Strategy::DenyAll)
                    }
                }
            })
            .collect()
    }

    /// Assigns `keys`: takes what their plans need from the store, then sends one response. A
    /// `renewal` round (the timer's) leaves out the renewals that can wait for the next round.
    async fn assign(&mut self, keys: Vec<String>, renewal: bool) {
        let timing = self.shared.settings.timing;
        let now = self.now_ms();
        let mut rounds = self.classify(&keys);
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
        let mut answers = Vec::with_capacity(items.len());
        for chunk in items.chunks(MAX_REQUESTS) {
            answers.extend(
                self.shared
                    .decider
                    .run(
                        &self.domain,
                        None,
                        chunk.to_vec(),
                        Vec::new(),
                        Caller::Quota,
                    )
                    .await,
            );
        }
        // Settled at the planning time: the margin covers the store's answer and the sending
        // (docs/rlqs.md), and the grant was sized for that time.
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
                Round::Send(_) => deny(&mut t.holding, now, timing),
                Round::Plan(target) => {
                    let Some((ask, request)) = asked else {
                        continue;
                    };
                    let granted = match request.and_then(|i| answers.get(i)) {
                        None => Some(0),
                        Some(answer) => match &answer.error {
                            Some(e) if e.code == ErrorCode::UnknownRule => None,
                            Some(e) => {
                                tracing::warn!(
                                    "rlqs: no assignment for {:?}: {}",
                                    t.id.bucket,
                                    e.message
                                );
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
                        Some(granted) => t.holding.settle(now, ask, granted, target, timing),
                        None => deny(&mut t.holding, now, timing),
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
        let metrics = self.shared.decider.metrics();
        for a in &actions {
            metrics
                .rlqs_assignments
                .get_or_create(&StrategyLabels {
                    strategy: strategy_label(a),
                })
                .inc();
        }
        if !actions.is_empty() {
            let _ = self
                .tx
                .send(RateLimitQuotaResponse {
                    bucket_action: actions,
                })
                .await;
        }
    }
}

/// Whether this round can leave `round` out: it would renew what was sent (the same token
/// bucket, or DENY_ALL again), and the round at `next_ms` still reaches Envoy in time.
fn can_wait(holding: &Holding, round: &Round, now_ms: u64, next_ms: u64, timing: Timing) -> bool {
    let renews = match round {
        Round::Plan(target) => holding.ask(now_ms, *target, timing).proposal == Proposal::Renew,
        Round::Send(Strategy::DenyAll) => holding.strategy() == Some(Strategy::DenyAll),
        Round::Send(_) | Round::Skip => false,
    };
    renews && holding.renewal_can_wait(next_ms, timing)
}

/// The `strategy` label of an assignment.
fn strategy_label(action: &BucketAction) -> &'static str {
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
fn deny(holding: &mut Holding, now_ms: u64, timing: Timing) -> Strategy {
    let zero = Target {
        max_tokens: 0,
        tokens_per_sec: 0,
    };
    let ask = holding.ask(now_ms, zero, timing);
    holding.settle(now_ms, ask, 0, zero, timing)
}

/// The bucket action that assigns `strategy` for the TTL.
fn action(id: &BucketId, strategy: Strategy, timing: Timing) -> BucketAction {
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
