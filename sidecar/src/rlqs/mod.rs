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
//!
//! # Size and trust
//!
//! Envoy's reports grow with its buckets: [`split`] re-frames them into reports within
//! `--max-body-bytes` before the service decodes them, and the answers are split the same way.
//! A stream accepted with a bearer token ends (UNAUTHENTICATED) once a rotation removed that
//! token: it is checked on every report and every round.

pub mod body;
pub mod bucket_id;
pub mod plan;
pub mod split;

use std::collections::{HashMap, VecDeque};
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
use axum::extract::State;
use futures::future::BoxFuture;
use futures::{FutureExt, Stream, StreamExt};
use prost::Message;
use ratelimit_wire::{
    ErrorCode, LeaseAsk, Reason, RequestAnswer, MAX_LEASE_ID, MAX_NAME_BYTES, MAX_REQUESTS,
};
use tokio::sync::mpsc;
use tonic::server::NamedService;
use tonic::{Request, Response, Status, Streaming};

use self::body::{read_ahead, SplitReports};
use self::plan::{Demand, Holding, Proposal, Strategy, Target, Timing};
use self::split::Splitter;
use crate::auth::Credential;
use crate::decide::{Caller, Decider, Entries, Item};
use crate::metrics::{Metrics, StrategyLabels};
use crate::policy::{LimitKind, Resolution};
use crate::store::BucketStore;

/// A stream's reports are read ahead of its session up to this many messages of
/// `--max-body-bytes` (16 MiB as shipped; [`body`] says why).
const READ_AHEAD_MESSAGES: usize = 256;

/// How the sidecar assigns quota (`--rlqs-*`, docs/configuration.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RlqsSettings {
    pub timing: Timing,
    /// How often every bucket of a stream is assigned again (renewed).
    pub renew_ms: u64,
    /// The most buckets one stream may hold; reports of further buckets are not answered.
    pub max_buckets: usize,
    /// The largest message read or sent (`--max-body-bytes`): larger reports are split
    /// ([`split`]), answers are sent in messages within it.
    pub max_message_bytes: usize,
    /// A round's store calls in flight at once (`--redis-pipeline`): each is within
    /// `--redis-timeout-ms` of being sent, not of the round's start.
    pub store_calls_in_flight: usize,
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

    /// The service as routes of the sidecar's router (as [`crate::grpc::RateLimitApi`]'s), its
    /// request bodies through the report splitter.
    pub fn into_router(self) -> axum::Router {
        let path = format!(
            "/{}/{{*method}}",
            <RateLimitQuotaServiceServer<Self> as NamedService>::NAME
        );
        let limit = ReportLimit {
            max_message_bytes: self.shared.settings.max_message_bytes,
            metrics: self.shared.decider.metrics().clone(),
        };
        let server = RateLimitQuotaServiceServer::new(self)
            .max_decoding_message_size(limit.max_message_bytes);
        axum::Router::new().route_service(&path, server).layer(
            axum::middleware::map_request_with_state(limit, split_reports),
        )
    }
}

/// What the report splitter of each stream needs.
#[derive(Clone)]
struct ReportLimit {
    max_message_bytes: usize,
    metrics: Arc<Metrics>,
}

/// The request with its body through a [`Splitter`].
async fn split_reports(
    State(limit): State<ReportLimit>,
    request: axum::extract::Request,
) -> axum::extract::Request {
    request.map(|body| {
        axum::body::Body::new(SplitReports::new(
            read_ahead(body, READ_AHEAD_MESSAGES * limit.max_message_bytes),
            Splitter::new(limit.max_message_bytes, bucket_id::max_usage_bytes()),
            limit.metrics,
        ))
    })
}

type Assignments = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

#[tonic::async_trait]
impl<S: BucketStore> RateLimitQuotaService for RlqsApi<S> {
    type StreamRateLimitQuotasStream = Assignments;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Assignments>, Status> {
        // Set by the authentication in front (`crate::auth::protect`) when a bearer token was
        // presented.
        let credential = request.extensions().get::<Credential>().cloned();
        let reports = request.into_inner();
        let (tx, rx) = mpsc::channel(8);
        let id = self.shared.next_stream.fetch_add(1, Ordering::Relaxed);
        self.shared.decider.metrics().rlqs_streams_opened.inc();
        let session = Session {
            shared: self.shared.clone(),
            id,
            tx,
            credential,
            domain: String::new(),
            buckets: HashMap::new(),
            warned_full: false,
            warned_too_large: false,
        };
        tokio::spawn(session.run(reports));
        let out =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
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
    /// Assignments out; an error ends the stream with that status.
    tx: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
    /// The bearer token the stream was accepted with, if any.
    credential: Option<Credential>,
    domain: String,
    buckets: HashMap<String, Tracked>,
    warned_full: bool,
    warned_too_large: bool,
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
        tracing::info!("rlqs stream {} opened", self.id);
        // The reports are read as they come, also while a round's store calls are out: Envoy
        // sends each new bucket's report alone, and unread small messages pile up in the HTTP/2
        // connection until its flood protection closes it (h2: GOAWAY "too_many_data_frames").
        let mut round: Option<(Planned, BoxFuture<'static, Vec<RequestAnswer>>)> = None;
        let mut fresh: Vec<String> = Vec::new();
        let mut renewal_due = false;
        // The answers of the last round not yet taken by the stream; no round starts before.
        let mut outbox: VecDeque<RateLimitQuotaResponse> = VecDeque::new();
        let tx = self.tx.clone();
        // Envoy closed its side: what it reported is still answered, then the stream ends.
        let mut reports_ended = false;
        loop {
            if reports_ended && round.is_none() && fresh.is_empty() && outbox.is_empty() {
                break;
            }
            if round.is_none() && outbox.is_empty() {
                // A renewal round plans every bucket, the new ones included.
                if renewal_due {
                    renewal_due = false;
                    fresh.clear();
                    let all: Vec<String> = self.buckets.keys().cloned().collect();
                    if !all.is_empty() {
                        round = Some(self.plan(all, true));
                    }
                } else if !fresh.is_empty() {
                    round = Some(self.plan(std::mem::take(&mut fresh), false));
                }
            }
            tokio::select! {
                message = reports.message(), if !reports_ended => match message {
                    Ok(Some(report)) => {
                        if self.revoked() {
                            self.end_unauthenticated().await;
                            break;
                        }
                        fresh.extend(self.on_report(report));
                    }
                    Ok(None) => {
                        tracing::info!("rlqs stream {}: Envoy closed it", self.id);
                        reports_ended = true;
                    }
                    Err(e) => {
                        tracing::info!("rlqs stream {} ended: {e}", self.id);
                        break;
                    }
                },
                _ = ticker.tick(), if !reports_ended => {
                    if self.revoked() {
                        self.end_unauthenticated().await;
                        break;
                    }
                    renewal_due = true;
                }
                answers = async {
                    match round.as_mut() {
                        Some((_, calls)) => calls.await,
                        None => std::future::pending().await,
                    }
                }, if round.is_some() => {
                    if let Some((planned, _)) = round.take() {
                        outbox.extend(self.answer_round(planned, answers));
                    }
                }
                permit = tx.reserve(), if !outbox.is_empty() => match (permit, outbox.pop_front()) {
                    (Ok(permit), Some(response)) => permit.send(Ok(response)),
                    _ => {
                        went_away(self.id, &mut reports);
                        break;
                    }
                },
                _ = tx.closed(), if outbox.is_empty() => {
                    went_away(self.id, &mut reports);
                    break;
                }
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

    /// Whether the token the stream was accepted with was rotated out since.
    fn revoked(&self) -> bool {
        !self
            .credential
            .as_ref()
            .is_none_or(Credential::still_accepted)
    }

    /// Ends the stream with UNAUTHENTICATED (Envoy reopens it, and the authentication refuses
    /// it); a stream Envoy does not read ends without the status.
    async fn end_unauthenticated(&self) {
        tracing::info!(
            "rlqs stream {}: its bearer token is no longer accepted (--auth-token-file \
             changed): ending it",
            self.id
        );
        let status =
            Status::unauthenticated("the bearer token of this stream is no longer accepted");
        let _ = tokio::time::timeout(Duration::from_secs(1), self.tx.send(Err(status))).await;
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
        let metrics = self.shared.decider.metrics().clone();
        let mut fresh = Vec::new();
        let mut malformed: Option<(usize, String)> = None;
        for usage in report.bucket_quota_usages {
            // A report within the limit reached the service whole: its usages are bounded here
            // as the splitter bounds those of a larger one.
            if usage.encoded_len() > bucket_id::max_usage_bytes() {
                metrics.count_rlqs_usages_dropped("too_large", 1);
                if !self.warned_too_large {
                    self.warned_too_large = true;
                    tracing::warn!(
                        "rlqs stream {}: a bucket usage larger than any valid bucket id: it gets \
                         no assignment (ratelimit_rlqs_usages_dropped_total; logged once per \
                         stream)",
                        self.id
                    );
                }
                continue;
            }
            let Some(id) = usage.bucket_id else { continue };
            let key = bucket_id::canonical(&id.bucket);
            let requests = usage
                .num_requests_allowed
                .saturating_add(usage.num_requests_denied);
            if !self.buckets.contains_key(&key) {
                if self.buckets.len() >= self.shared.settings.max_buckets {
                    metrics.count_rlqs_usages_dropped("max_buckets", 1);
                    if !self.warned_full {
                        self.warned_full = true;
                        tracing::warn!(
                            "rlqs stream {}: more than --rlqs-max-buckets {} buckets; further \
                             buckets get no assignment (ratelimit_rlqs_usages_dropped_total; \
                             logged once per stream)",
                            self.id,
                            self.shared.settings.max_buckets
                        );
                    }
                    continue;
                }
                let entries = bucket_id::entries(&id.bucket);
                if let Err(e) = &entries {
                    let (n, _) = malformed.get_or_insert_with(|| (0, e.clone()));
                    *n += 1;
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
        // Once per report: the message names keys and limits, never a value.
        if let Some((n, first)) = malformed {
            tracing::warn!(
                "rlqs stream {}: {n} new bucket id(s) beyond the wire's limits ({first}): \
                 assigned DENY_ALL",
                self.id
            );
        }
        fresh
    }

    /// What each bucket's rule says, under the policy in force; and how many buckets never
    /// assigned before are refused for naming no limit (each counted once).
    fn classify(&self, keys: &[String]) -> (Vec<Round>, usize) {
        let policy = self.shared.decider.policy().current();
        let demand = self.shared.demand.lock().ok();
        let mut unknown = 0;
        let rounds = keys
            .iter()
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
                            unknown += 1;
                            tracing::debug!(
                                "rlqs stream {}: no limit for bucket {:?} in domain {:?}: \
                                 assigned DENY_ALL",
                                self.id,
                                t.id.bucket,
                                self.domain
                            );
                        }
                        Round::Send(Strategy::DenyAll)
                    }
                }
            })
            .collect();
        (rounds, unknown)
    }

    /// Plans a round of `keys`: what each is told, and the store calls that take the tokens
    /// their plans need (a future that borrows nothing: the reports are read meanwhile). A
    /// `renewal` round (the timer's) leaves out the renewals that can wait for the next round.
    fn plan(
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
    fn answer_round(
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

/// Logs that stream `id`'s answers are no longer read, and why if its reports say.
fn went_away(id: u64, reports: &mut Streaming<RateLimitQuotaUsageReports>) {
    let why = match reports.message().now_or_never() {
        Some(Err(e)) => e.to_string(),
        Some(Ok(None)) => "its reports ended".into(),
        Some(Ok(Some(_))) | None => "its reports still open".into(),
    };
    tracing::info!("rlqs stream {id}: Envoy went away ({why})");
}

/// A round between its plan and the store's answers.
struct Planned {
    keys: Vec<String>,
    rounds: Vec<Round>,
    asks: Vec<Option<(plan::Ask, Option<usize>)>>,
    /// The planning time (ms on the stream's clock) and instant.
    now: u64,
    started: Instant,
}

/// `actions` in responses of at most `limit` bytes each (one action larger than that goes
/// alone).
fn responses(actions: Vec<BucketAction>, limit: usize) -> Vec<RateLimitQuotaResponse> {
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
    holding.choose(now_ms, ask, 0, zero, timing)
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
