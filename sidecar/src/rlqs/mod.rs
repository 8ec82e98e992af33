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
mod round;
mod session;

use self::session::Session;
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
use crate::calls::Stopping;
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
    /// When the sidecar begins to stop, every stream ends once what it reported is answered.
    stopping: Stopping,
}

impl<S: BucketStore> RlqsApi<S> {
    /// The service; its streams end when `stopping` says the sidecar begins to stop.
    pub fn new(decider: Arc<Decider<S>>, settings: RlqsSettings, stopping: Stopping) -> Self {
        Self {
            shared: Arc::new(Shared {
                decider,
                settings,
                started: Instant::now(),
                next_stream: AtomicU64::new(1),
                demand: Mutex::new(HashMap::new()),
                stopping,
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
