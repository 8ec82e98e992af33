//! The gRPC edge: Envoy's rate limit service, `envoy.service.ratelimit.v3.RateLimitService/
//! ShouldRateLimit`, for Envoy's native `envoy.filters.http.ratelimit` (and any other client of
//! that API). A thin adapter over [`Decider::run`]; served on the same listener as the HTTP API
//! (see [`crate::http::router`]). docs/grpc.md is the operator's reference.
//!
//! # Mapping
//!
//! - `domain` is the policy domain.
//! - Each descriptor is one decision: its entries, in order, are looked up in the policy (a first
//!   entry `rule=<name>` reaches a rule of this sidecar's own format; any entries reach a domain in
//!   envoyproxy/ratelimit's format). A descriptor that matches no limit is not limited.
//! - All descriptors of one `RateLimitRequest` are ONE request, decided all-or-nothing: if one is
//!   over its limit, none is charged (envoyproxy/ratelimit would still count the others).
//! - The cost of a descriptor is its own `hits_addend` when set, else the request's `hits_addend`;
//!   0 means 1. `is_negative_hits` (giving tokens back) is refused: a caller never adds budget.
//! - A descriptor with an entry `settle=<tokens>` is a settlement, not a decision: the stream-done
//!   descriptor (`apply_on_stream_done`) of a request the route charged `<tokens>` when it arrived,
//!   its `hits_addend` (else the request's) the real cost. The entry is left out of the bucket's
//!   entries, and `cost - tokens` is charged (past zero: a debt) or given back through the wasm
//!   filter's settle path ([`Decider::settle_items`]); answered OK whatever the bucket holds (the
//!   response is already sent). A request holds settlements or decisions, never both.
//! - A limit carried inside a descriptor (`RateLimitDescriptor.limit`, Envoy's `limit` action
//!   override) is ignored: the policy owns the numbers, a caller never chooses its limit.
//!
//! # Answer
//!
//! `overall_code` is OK or OVER_LIMIT; one `DescriptorStatus` per descriptor: `code` (OVER_LIMIT
//! for a descriptor whose own bucket refused, OK otherwise, and always OK under shadow mode),
//! `current_limit` (`requests_per_unit` = capacity, `unit` = the unit whose length is exactly
//! `capacity / refill_per_sec`, else UNKNOWN; absent when no limit or an unlimited one applies),
//! `limit_remaining` (whole tokens), `duration_until_reset` (OVER_LIMIT: the wait until the cost is
//! available; OK: until the bucket is full). `response_headers_to_add` carries `RateLimit-Policy`,
//! `RateLimit` and, over the limit, `Retry-After`, rendered by [`ratelimit_wire::headers`] exactly
//! as the wasm filter renders them. An admitted request's `dynamic_metadata` says what it charged
//! each rule of the own format (`settle.<rule>` = tokens, a string: [`charged_metadata`]), for its
//! stream-done descriptor's `settle` entry.
//!
//! # Errors
//!
//! A malformed request is `INVALID_ARGUMENT` naming the field (the limits of `ratelimit-wire`
//! bound it, as they bound `POST /v1/decide`); so is a domain no policy file defines. Redis
//! unavailable for the request is `UNAVAILABLE`, a failed script `INTERNAL`: Envoy's
//! `failure_mode_deny` then decides.

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::{value::Kind, Duration, Struct, Value};
use ratelimit_wire::headers::{self, limiting, retry_after_s, HeaderLimit, Limiting};
use ratelimit_wire::{
    AppliedLimit, DecisionResult, ErrorCode, Reason, RequestAnswer, MAX_DECISIONS, MAX_NAME_BYTES,
    MAX_SUBJECT_ENTRIES, MAX_VALUE_BYTES,
};
use tonic::server::NamedService;
use tonic::{Request, Response, Status};

use crate::decide::{Caller, Decider, Item, SettleItem};
use crate::metrics::{CallOutcome, Metrics, RequestOutcome};
use crate::policy::own_format::RULE_KEY;
use crate::policy::MAX_CAPACITY;
use crate::store::BucketStore;

/// The most entries of one descriptor: a rule and a subject of the wire's largest size.
pub const MAX_DESCRIPTOR_ENTRIES: usize = 1 + MAX_SUBJECT_ENTRIES;

/// Which answers carry `response_headers_to_add` (`--grpc-response-headers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ResponseHeaders {
    /// Every answer: `RateLimit-Policy` and `RateLimit` on admitted requests too.
    #[default]
    All,
    /// Only a request over its limit: `Retry-After` (and the limit it hit).
    Rejected,
    /// None: Envoy's own `enable_x_ratelimit_headers` may render headers from the statuses.
    None,
}

/// What the answers carry beyond the verdict and the statuses (`--grpc-response-headers`,
/// `--grpc-charged-metadata`): each a cost to Envoy per request (docs/benchmarks.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answering {
    pub headers: ResponseHeaders,
    /// An admitted request's charges as dynamic metadata ([`charged_metadata`]).
    pub charged_metadata: bool,
}

impl Default for Answering {
    fn default() -> Self {
        Answering {
            headers: ResponseHeaders::All,
            charged_metadata: true,
        }
    }
}

/// The rate limit service over a [`Decider`].
pub struct RateLimitApi<S> {
    decider: Arc<Decider<S>>,
    metrics: Arc<Metrics>,
    answering: Answering,
}

impl<S: BucketStore> RateLimitApi<S> {
    pub fn new(decider: Arc<Decider<S>>, metrics: Arc<Metrics>, answering: Answering) -> Self {
        Self {
            decider,
            metrics,
            answering,
        }
    }

    /// The service as routes of the sidecar's router: `/<service name>/<method>` (the path gRPC
    /// uses); an unknown method of the service is answered UNIMPLEMENTED by tonic. A request
    /// message longer than `max_message_bytes` (`--max-body-bytes`, as for `POST /v1/decide`) is
    /// answered OUT_OF_RANGE from its length prefix, before it is read or decoded (tonic's
    /// own default, 4 MiB, would decode hundreds of thousands of descriptors before `check`
    /// refuses more than 64).
    pub fn into_router(self, max_message_bytes: usize) -> axum::Router {
        let path = format!(
            "/{}/{{*method}}",
            <RateLimitServiceServer<Self> as NamedService>::NAME
        );
        axum::Router::new().route_service(
            &path,
            RateLimitServiceServer::new(self).max_decoding_message_size(max_message_bytes),
        )
    }
}

/// The descriptor entry that marks a stream-done descriptor as a settlement (docs/grpc.md):
/// `settle=<the tokens the request path charged>`, its descriptor's `hits_addend` the real cost.
pub const SETTLE_KEY: &str = "settle";

/// A request checked and turned into the decider's items: decisions, or (a stream-done call of
/// Envoy's filter) settlements, never both.
#[derive(Debug, PartialEq)]
pub struct Checked {
    pub domain: String,
    pub items: Vec<Item>,
    pub settlements: Vec<SettleItem>,
}

/// One descriptor, checked.
#[derive(Debug, PartialEq)]
enum Checked1 {
    Decide(Item),
    Settle(SettleItem),
}

/// Checks a request; the error names the field (`descriptors[1].entries[0].key: ...`).
pub fn check(request: RateLimitRequest) -> Result<Checked, String> {
    let RateLimitRequest {
        domain,
        descriptors,
        hits_addend,
    } = request;
    if domain.is_empty() || domain.len() > MAX_NAME_BYTES {
        return Err(format!("domain: must be 1 to {MAX_NAME_BYTES} bytes"));
    }
    if descriptors.is_empty() || descriptors.len() > MAX_DECISIONS {
        return Err(format!(
            "descriptors: must hold 1 to {MAX_DECISIONS} descriptors, got {}",
            descriptors.len()
        ));
    }
    let mut items = Vec::new();
    let mut settlements = Vec::new();
    let mut first_settlement = None;
    for (d, descriptor) in descriptors.into_iter().enumerate() {
        match item(d, descriptor, hits_addend)? {
            Checked1::Decide(i) => items.push(i),
            Checked1::Settle(st) => {
                first_settlement.get_or_insert(d);
                settlements.push(st);
            }
        }
    }
    if let (Some(d), false) = (first_settlement, items.is_empty()) {
        return Err(format!(
            "descriptors[{d}]: a settlement (entry \"{SETTLE_KEY}\") cannot share a request with \
             decisions; its rate limit entry needs apply_on_stream_done: true"
        ));
    }
    Ok(Checked {
        domain,
        items,
        settlements,
    })
}

fn item(d: usize, descriptor: RateLimitDescriptor, request_hits: u32) -> Result<Checked1, String> {
    let RateLimitDescriptor {
        entries,
        limit: _ignored_a_caller_never_chooses_its_limit,
        hits_addend,
        is_negative_hits,
    } = descriptor;
    let at = format!("descriptors[{d}]");
    if entries.is_empty() || entries.len() > MAX_DESCRIPTOR_ENTRIES {
        return Err(format!(
            "{at}.entries: must hold 1 to {MAX_DESCRIPTOR_ENTRIES} entries, got {}",
            entries.len()
        ));
    }
    if is_negative_hits {
        return Err(format!(
            "{at}.is_negative_hits: not supported; a caller cannot give tokens back"
        ));
    }
    if let Some(h) = &hits_addend {
        if h.value > MAX_CAPACITY {
            return Err(format!("{at}.hits_addend: must be at most {MAX_CAPACITY}"));
        }
    }
    let mut checked = Vec::with_capacity(entries.len());
    let mut charged = None;
    let mut receipt = false;
    for (e, entry) in entries.into_iter().enumerate() {
        if entry.key.is_empty() || entry.key.len() > MAX_NAME_BYTES {
            return Err(format!(
                "{at}.entries[{e}].key: must be 1 to {MAX_NAME_BYTES} bytes"
            ));
        }
        if entry.value.len() > MAX_VALUE_BYTES {
            return Err(format!(
                "{at}.entries[{e}].value: longer than {MAX_VALUE_BYTES} bytes"
            ));
        }
        if entry.key == SETTLE_KEY {
            if charged.is_some() || receipt {
                return Err(format!(
                    "{at}.entries[{e}].key: a second \"{SETTLE_KEY}\" entry"
                ));
            }
            if entry.value == SETTLE_RESERVE {
                receipt = true;
                continue;
            }
            charged = Some(
                settle_charged(&entry.value)
                    .map_err(|m| format!("{at}.entries[{e}].value: {m}"))?,
            );
            continue;
        }
        checked.push((entry.key, Some(entry.value)));
    }
    let Some((charged, receipt)) = charged else {
        let cost = hits_addend.map_or(u64::from(request_hits.max(1)), |h| h.value.max(1));
        if checked.is_empty() {
            return Err(format!(
                "{at}.entries: a decision names its bucket besides its \"{SETTLE_KEY}\" entry"
            ));
        }
        return Ok(Checked1::Decide(Item {
            entries: checked,
            cost,
            lease: None,
            receipt,
        }));
    };
    if checked.is_empty() {
        return Err(format!(
            "{at}.entries: a settlement names its bucket besides its \"{SETTLE_KEY}\" entry"
        ));
    }
    // The real cost: the descriptor's own hits_addend (0 is a real cost: all given back), else
    // the request's; a settlement without one has nothing to settle on.
    let cost = match (hits_addend, request_hits) {
        (Some(h), _) => h.value,
        (None, 0) => {
            return Err(format!(
                "{at}.hits_addend: a settlement needs the real cost (set hits_addend on its \
                 rate limit entry)"
            ))
        }
        (None, n) => u64::from(n),
    };
    Ok(Checked1::Settle(SettleItem {
        entries: checked,
        reserved: charged,
        cost,
        receipt,
    }))
}

/// The value of a request-time `settle` entry: the decision is a reservation to be settled, and
/// the sidecar keeps a receipt of its charge ([`charged_metadata`] reports it).
pub const SETTLE_RESERVE: &str = "reserve";

/// The value of a stream-done `settle` entry: the tokens the request path charged, a whole number
/// from 1 (a request is charged at least 1) to [`MAX_CAPACITY`], and after a `:` the receipt of
/// that charge when the sidecar reported one (`<tokens>:<receipt>`, [`charged_metadata`]).
fn settle_charged(value: &str) -> Result<(u64, Option<u64>), String> {
    let (tokens, receipt) = match value.split_once(':') {
        Some((t, r)) => (t, Some(r)),
        None => (value, None),
    };
    let receipt = match receipt.map(ratelimit_wire::parse_receipt) {
        Some(None) => None,
        Some(Some(r)) => Some(Some(r)),
        None => Some(None),
    };
    match (tokens.parse::<u64>(), receipt) {
        (Ok(n), Some(r)) if (1..=MAX_CAPACITY).contains(&n) && !tokens.starts_with('+') => {
            Ok((n, r))
        }
        _ => {
            Err(format!(
            "the tokens the request path charged, a whole number from 1 to {MAX_CAPACITY}, and \
             after a ':' the receipt the sidecar reported; got \"{}\"{}",
            value.chars().take(32).collect::<String>().escape_debug(),
            if value.chars().count() > 32 { " (cut)" } else { "" }
        ))
        }
    }
}

#[tonic::async_trait]
impl<S: BucketStore> RateLimitService for RateLimitApi<S> {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let started = Instant::now();
        let answer = self.decide(request.into_inner()).await;
        self.metrics
            .decision_duration
            .observe(started.elapsed().as_secs_f64());
        answer.map(Response::new)
    }
}

impl<S: BucketStore> RateLimitApi<S> {
    async fn decide(&self, request: RateLimitRequest) -> Result<RateLimitResponse, Status> {
        let checked = check(request).map_err(|e| {
            self.metrics.call("grpc", CallOutcome::BadRequest);
            Status::invalid_argument(e)
        })?;
        if !checked.settlements.is_empty() {
            return self.settle(checked).await;
        }
        // The decision runs in a task of its own: a caller that gives up (Envoy's `timeout`
        // resets the stream) cancels neither its Redis calls nor the refunds that follow them.
        let charges: Vec<Option<(String, u64)>> = checked.items.iter().map(rule_charge).collect();
        let decider = self.decider.clone();
        let task = tokio::spawn(async move {
            let Checked { domain, items, .. } = checked;
            decider
                .run(
                    &domain,
                    None,
                    vec![items],
                    Vec::new(),
                    Caller::RateLimitService,
                )
                .await
        });
        let answer = match task.await {
            Ok(mut answers) if answers.len() == 1 => answers.remove(0),
            Ok(_) | Err(_) => {
                self.metrics.call("grpc", CallOutcome::Error);
                tracing::error!("decision task failed");
                return Err(Status::internal("decision failed"));
            }
        };
        self.metrics.request(RequestOutcome::of(&answer));
        if let Some(e) = &answer.error {
            let (outcome, status) = match e.code {
                ErrorCode::Unavailable => {
                    (CallOutcome::Unavailable, Status::unavailable(&e.message))
                }
                ErrorCode::ScriptFailed => (CallOutcome::Error, Status::internal(&e.message)),
                // Envoy's API: only a domain no policy file defines gets here.
                ErrorCode::UnknownRule => (
                    CallOutcome::BadRequest,
                    Status::invalid_argument(format!("domain: {}", e.message)),
                ),
            };
            self.metrics.call("grpc", outcome);
            tracing::warn!("gRPC decision failed: {}", e.message);
            return Err(status);
        }
        self.metrics.call("grpc", CallOutcome::Answered);
        let mut response = respond(&answer, self.answering.headers);
        if self.answering.charged_metadata {
            response.dynamic_metadata = charged_metadata(&charges, &answer);
        }
        Ok(response)
    }
}

impl<S: BucketStore> RateLimitApi<S> {
    /// A stream-done call of settlements: applied in one batch (in a task of its own, as a
    /// decision) and answered OK for every descriptor: the response they belong to is already
    /// sent, so a settlement never limits anyone, even into a debt.
    async fn settle(&self, checked: Checked) -> Result<RateLimitResponse, Status> {
        let Checked {
            domain,
            settlements,
            ..
        } = checked;
        let n = settlements.len();
        let decider = self.decider.clone();
        match tokio::spawn(async move { decider.settle_items(&domain, None, settlements).await })
            .await
        {
            Ok(Ok(_)) => {
                self.metrics.call("grpc", CallOutcome::Answered);
                Ok(settled(n))
            }
            Ok(Err(e)) => {
                let (outcome, status) = if e.is_deterministic() {
                    (CallOutcome::Error, Status::internal(e.to_string()))
                } else {
                    (CallOutcome::Unavailable, Status::unavailable(e.to_string()))
                };
                self.metrics.call("grpc", outcome);
                tracing::warn!("gRPC settlement failed: {e}");
                Err(status)
            }
            Err(e) => {
                self.metrics.call("grpc", CallOutcome::Error);
                tracing::error!("settle task failed: {e}");
                Err(Status::internal("settle failed"))
            }
        }
    }
}

/// The key of the dynamic metadata that says what an admitted request was charged per rule:
/// `{"settle": {"<rule>": "<tokens>"}}` in Envoy's filter namespace
/// (`envoy.filters.http.ratelimit`), for a stream-done descriptor's `settle` entry to read with a
/// `metadata` action (docs/grpc.md#costs-known-after-the-response).
pub const CHARGED_METADATA_KEY: &str = SETTLE_KEY;

/// The rule a decision names in this sidecar's own format (first entry `rule=<name>`) and its cost.
pub fn rule_charge(item: &Item) -> Option<(String, u64)> {
    match item.entries.first() {
        Some((key, Some(rule))) if key == RULE_KEY => Some((rule.clone(), item.cost)),
        _ => None,
    }
}

/// What an admitted request charged each rule of this sidecar's own format, as dynamic metadata
/// (`None` when nothing was charged: a rejected request, unlimited or shadow-rejected limits, no
/// own-format rule). The values are strings: Envoy's `metadata` action reads only strings. A rule
/// named by two descriptors keeps the first one's charge.
pub fn charged_metadata(
    charges: &[Option<(String, u64)>],
    answer: &RequestAnswer,
) -> Option<Struct> {
    if !answer.allowed {
        return None;
    }
    let mut fields = std::collections::HashMap::new();
    for (charge, r) in charges.iter().zip(&answer.results) {
        let charged = r.allowed && r.reason == Reason::Ok && r.limit.is_some() && r.error.is_none();
        if let (Some((rule, cost)), true) = (charge, charged) {
            let value = match &r.receipt {
                Some(receipt) => format!("{cost}:{receipt}"),
                None => cost.to_string(),
            };
            fields.entry(rule.clone()).or_insert_with(|| Value {
                kind: Some(Kind::StringValue(value)),
            });
        }
    }
    if fields.is_empty() {
        return None;
    }
    let inner = Value {
        kind: Some(Kind::StructValue(Struct { fields })),
    };
    Some(Struct {
        fields: [(CHARGED_METADATA_KEY.to_string(), inner)].into(),
    })
}

/// The answer to a stream-done call of `n` settlements: OK, no limit, no headers.
pub fn settled(n: usize) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: Code::Ok as i32,
        statuses: (0..n)
            .map(|_| DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// The answer to a request the decider answered (no error), with the headers `headers` asks for.
pub fn respond(answer: &RequestAnswer, headers: ResponseHeaders) -> RateLimitResponse {
    let overall = if answer.allowed {
        Code::Ok
    } else {
        Code::OverLimit
    };
    let rendered = match headers {
        ResponseHeaders::All => response_headers(answer),
        ResponseHeaders::Rejected if !answer.allowed => response_headers(answer),
        ResponseHeaders::Rejected | ResponseHeaders::None => Vec::new(),
    };
    RateLimitResponse {
        overall_code: overall as i32,
        statuses: answer.results.iter().map(status).collect(),
        response_headers_to_add: rendered
            .into_iter()
            .map(|(key, value)| HeaderValue {
                key: key.to_string(),
                value,
                raw_value: Vec::new(),
            })
            .collect(),
        ..Default::default()
    }
}

/// Whether this decision's own bucket refused (the request is rejected for it).
fn refused(r: &DecisionResult) -> bool {
    !r.allowed && r.reason != Reason::Ok
}

fn status(r: &DecisionResult) -> DescriptorStatus {
    let over = refused(r);
    let wait_ms = match r.reason {
        // Waiting cannot help, and an unlimited subject has nothing to reset.
        Reason::CostExceedsCapacity | Reason::Blocked | Reason::Unlimited => None,
        _ if over => Some(r.retry_after_ms),
        _ => Some(r.reset_ms),
    };
    DescriptorStatus {
        code: if over { Code::OverLimit } else { Code::Ok } as i32,
        current_limit: r.limit.as_ref().map(current_limit),
        limit_remaining: u32::try_from(r.remaining).unwrap_or(u32::MAX),
        duration_until_reset: wait_ms.filter(|_| r.limit.is_some()).map(duration),
        quota: None,
    }
}

fn duration(ms: u64) -> Duration {
    Duration {
        seconds: i64::try_from(ms / 1000).unwrap_or(i64::MAX),
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

/// `requests_per_unit` = capacity (saturated to u32); `unit` = the unit whose length equals a
/// full refill (`capacity / refill_per_sec`) exactly, else UNKNOWN.
pub fn current_limit(l: &AppliedLimit) -> RateLimit {
    RateLimit {
        name: l.name.clone(),
        requests_per_unit: u32::try_from(l.capacity).unwrap_or(u32::MAX),
        unit: unit_of(l.capacity, l.refill_per_sec) as i32,
    }
}

/// The unit whose length in seconds is `capacity / refill_per_sec`: the window that turns
/// `requests_per_unit` into this refill rate (envoyproxy/ratelimit's format maps a window to a
/// bucket the same way, so its limits come back with their unit).
pub fn unit_of(capacity: u64, refill_per_sec: f64) -> Unit {
    const UNITS: [(Unit, u64); 7] = [
        (Unit::Second, 1),
        (Unit::Minute, 60),
        (Unit::Hour, 3_600),
        (Unit::Day, 86_400),
        (Unit::Week, 7 * 86_400),
        (Unit::Month, 30 * 86_400),
        (Unit::Year, 365 * 86_400),
    ];
    if capacity == 0 || !(refill_per_sec.is_finite() && refill_per_sec > 0.0) {
        return Unit::Unknown;
    }
    UNITS
        .into_iter()
        .find(|&(_, seconds)| {
            let rate = capacity as f64 / seconds as f64;
            (rate - refill_per_sec).abs() <= rate * 1e-12
        })
        .map_or(Unit::Unknown, |(unit, _)| unit)
}

/// The headers the wasm filter would add for this answer (`verdict::from_answer` there): over the
/// limit, `Retry-After` and the figures of the limit that makes the client wait longest (none but
/// `RateLimit-Policy` when waiting cannot help: a cost above the capacity; nothing for a blocked
/// subject); admitted, `RateLimit-Policy` and `RateLimit` of every limit that is not in shadow
/// mode.
pub fn response_headers(answer: &RequestAnswer) -> Vec<(&'static str, String)> {
    let results = &answer.results;
    match limiting(results) {
        Some(Limiting::Never(i)) => {
            let r = &results[i];
            return match (&r.limit, r.reason) {
                (Some(l), Reason::CostExceedsCapacity) => {
                    vec![(
                        headers::RATELIMIT_POLICY,
                        HeaderLimit::applied(l, 0, 0).policy(),
                    )]
                }
                _ => Vec::new(),
            };
        }
        Some(Limiting::Wait(i)) => {
            let r = &results[i];
            let wait_s = retry_after_s(r.retry_after_ms);
            let mut out = vec![(headers::RETRY_AFTER, wait_s.to_string())];
            if let Some(l) = &r.limit {
                let limit = HeaderLimit::applied(l, r.remaining, wait_s);
                out.push((headers::RATELIMIT_POLICY, limit.policy()));
                out.push((headers::RATELIMIT, limit.limit()));
            }
            return out;
        }
        None => {}
    }
    headers::admitted(&headers::admitted_limits(results))
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
        Entry, RateLimitOverride,
    };
    use envoy_types::pb::google::protobuf::UInt64Value;

    use super::*;

    fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: k.to_string(),
                    value: v.to_string(),
                })
                .collect(),
            ..Default::default()
        }
    }

    fn request(descriptors: Vec<RateLimitDescriptor>, hits_addend: u32) -> RateLimitRequest {
        RateLimitRequest {
            domain: "ratelimit".into(),
            descriptors,
            hits_addend,
        }
    }

    #[test]
    fn costs_come_from_hits_addend_and_limits_in_descriptors_are_ignored() {
        let mut with_limit = descriptor(&[("rule", "per-ip"), ("ip", "1.2.3.4")]);
        with_limit.limit = Some(RateLimitOverride {
            requests_per_unit: 1_000_000,
            unit: Unit::Second as i32,
        });
        let mut own_cost = descriptor(&[("path", "/x")]);
        own_cost.hits_addend = Some(UInt64Value { value: 7 });
        let c = check(request(vec![with_limit, own_cost], 0)).unwrap();
        assert_eq!(c.domain, "ratelimit");
        assert_eq!(c.items[0].cost, 1, "hits_addend 0 is 1");
        assert_eq!(
            c.items[0].entries,
            [
                ("rule".to_string(), Some("per-ip".to_string())),
                ("ip".to_string(), Some("1.2.3.4".to_string()))
            ]
        );
        assert_eq!(c.items[1].cost, 7, "the descriptor's own hits_addend wins");
        let c = check(request(vec![descriptor(&[("a", "b")])], 3)).unwrap();
        assert_eq!(c.items[0].cost, 3);
    }

    #[test]
    fn bad_requests_name_the_field() {
        let err = |r: RateLimitRequest| check(r).unwrap_err();
        let mut r = request(vec![descriptor(&[("a", "b")])], 0);
        r.domain.clear();
        assert!(err(r).starts_with("domain:"));
        assert!(err(request(vec![], 0)).starts_with("descriptors: must hold 1 to 64"));
        let many = vec![descriptor(&[("a", "b")]); MAX_DECISIONS + 1];
        assert!(err(request(many, 0)).starts_with("descriptors:"));
        let e = err(request(vec![descriptor(&[("a", "b")]), descriptor(&[])], 0));
        assert!(e.starts_with("descriptors[1].entries:"), "{e}");
        let e = err(request(vec![descriptor(&[("", "b")])], 0));
        assert!(e.starts_with("descriptors[0].entries[0].key:"), "{e}");
        let long = "v".repeat(MAX_VALUE_BYTES + 1);
        let e = err(request(vec![descriptor(&[("a", "b"), ("k", &long)])], 0));
        assert!(e.starts_with("descriptors[0].entries[1].value:"), "{e}");
        let mut negative = descriptor(&[("a", "b")]);
        negative.is_negative_hits = true;
        let e = err(request(vec![negative], 0));
        assert!(e.starts_with("descriptors[0].is_negative_hits:"), "{e}");
        let mut huge = descriptor(&[("a", "b")]);
        huge.hits_addend = Some(UInt64Value { value: u64::MAX });
        let e = err(request(vec![huge], 0));
        assert!(e.starts_with("descriptors[0].hits_addend:"), "{e}");
    }

    fn with_hits(mut d: RateLimitDescriptor, hits: u64) -> RateLimitDescriptor {
        d.hits_addend = Some(UInt64Value { value: hits });
        d
    }

    fn entries(pairs: &[(&str, &str)]) -> Vec<(String, Option<String>)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), Some(v.to_string())))
            .collect()
    }

    /// The settlement of a stream-done descriptor that charged `charged` and really cost
    /// `cost` (its hits_addend).
    fn settlement(charged: &str, cost: u64) -> Result<Checked, String> {
        let d = descriptor(&[("rule", "llm"), ("user", "ann"), ("settle", charged)]);
        check(request(vec![with_hits(d, cost)], 0))
    }

    #[test]
    fn a_settle_entry_makes_a_descriptor_a_settlement_of_the_real_cost_against_the_charge() {
        let bucket = entries(&[("rule", "llm"), ("user", "ann")]);
        for (charged, cost, reserved, receipt) in [
            ("10", 25, 10, None),         // the reservation as configured, no receipt
            ("10:77", 3, 10, Some(77)),   // what the sidecar reported: its receipt
            ("1", MAX_CAPACITY, 1, None), // the largest real cost
        ] {
            let c = settlement(charged, cost).unwrap();
            assert!(c.items.is_empty(), "a settlement decides nothing");
            assert_eq!(
                c.settlements,
                [SettleItem {
                    entries: bucket.clone(),
                    reserved,
                    cost,
                    receipt,
                }],
                "charged {charged}, cost {cost}"
            );
        }
        // The bucket is the one the request path charged: the settle entry is left out
        // wherever it stands, and the other entries keep their order.
        let d = descriptor(&[("rule", "llm"), ("settle", "4"), ("user", "ann")]);
        let c = check(request(vec![with_hits(d, 6)], 0)).unwrap();
        assert_eq!(c.settlements[0].entries, bucket);
        // Without its own hits_addend, the request's is the real cost.
        let d = descriptor(&[("rule", "llm"), ("user", "ann"), ("settle", "4")]);
        let c = check(request(vec![d], 9)).unwrap();
        assert_eq!(c.settlements[0].cost, 9);
        // Several settlements of one stream-done call, each its own.
        let a = with_hits(descriptor(&[("rule", "a"), ("settle", "2")]), 5);
        let b = with_hits(descriptor(&[("rule", "b"), ("settle", "8")]), 1);
        let c = check(request(vec![a, b], 0)).unwrap();
        let costs: Vec<(u64, u64)> = c.settlements.iter().map(|s| (s.reserved, s.cost)).collect();
        assert_eq!(costs, [(2, 5), (8, 1)]);
        // At request time, `settle=reserve` asks for a receipt and is left out of the bucket.
        let d = descriptor(&[("rule", "llm"), ("settle", "reserve"), ("user", "ann")]);
        let c = check(request(vec![with_hits(d, 10)], 0)).unwrap();
        assert!(c.settlements.is_empty());
        assert_eq!(
            (&c.items[0].entries, c.items[0].cost, c.items[0].receipt),
            (&bucket, 10, true)
        );
    }

    #[test]
    fn a_malformed_settlement_is_refused_naming_the_field() {
        for bad in [
            "0",
            "-3",
            "+3",
            "1.5",
            "ten",
            "",
            " 4",
            "1000000000000000",
            "4:",
            "4:0",
            "4:x",
            ":7",
            "4:07",
            "4:9007199254740992",
        ] {
            let e = settlement(bad, 5).unwrap_err();
            assert!(
                e.starts_with(
                    "descriptors[0].entries[2].value: the tokens the request path charged"
                ),
                "{bad:?}: {e}"
            );
        }
        let e = settlement(&"9".repeat(MAX_VALUE_BYTES), 5).unwrap_err();
        assert!(
            e.len() < 240 && e.ends_with(" (cut)"),
            "quotes a bounded part: {e}"
        );
        let e = settlement("10", MAX_CAPACITY + 1).unwrap_err();
        assert!(
            e.starts_with("descriptors[0].hits_addend: must be at most"),
            "{e}"
        );
        let twice = descriptor(&[("rule", "llm"), ("settle", "1"), ("settle", "2")]);
        let e = check(request(vec![with_hits(twice, 3)], 0)).unwrap_err();
        assert!(
            e.starts_with("descriptors[0].entries[2].key: a second \"settle\""),
            "{e}"
        );
        let alone = with_hits(descriptor(&[("settle", "1")]), 3);
        let e = check(request(vec![alone], 0)).unwrap_err();
        assert!(
            e.starts_with("descriptors[0].entries: a settlement names its bucket"),
            "{e}"
        );
        // No real cost: neither the descriptor's hits_addend nor the request's.
        let no_cost = descriptor(&[("rule", "llm"), ("settle", "10")]);
        let e = check(request(vec![no_cost], 0)).unwrap_err();
        assert!(
            e.starts_with("descriptors[0].hits_addend: a settlement needs the real cost"),
            "{e}"
        );
        // A settlement among decisions: its rate limit entry is not a stream-done one.
        let decision = descriptor(&[("rule", "llm")]);
        let settle = with_hits(descriptor(&[("rule", "llm"), ("settle", "10")]), 3);
        let e = check(request(vec![decision, settle], 0)).unwrap_err();
        assert!(
            e.starts_with("descriptors[1]: a settlement (entry \"settle\") cannot share"),
            "{e}"
        );
        let mut negative = with_hits(descriptor(&[("rule", "llm"), ("settle", "10")]), 3);
        negative.is_negative_hits = true;
        let e = check(request(vec![negative], 0)).unwrap_err();
        assert!(e.starts_with("descriptors[0].is_negative_hits:"), "{e}");
    }

    #[test]
    fn a_settlement_is_answered_ok_without_limits_or_headers() {
        let r = settled(2);
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert_eq!(r.statuses.len(), 2);
        for s in &r.statuses {
            assert_eq!(s.code, Code::Ok as i32);
            assert_eq!(s.current_limit, None);
            assert_eq!(s.duration_until_reset, None);
        }
        assert!(r.response_headers_to_add.is_empty());
    }

    #[test]
    fn an_admitted_request_reports_what_it_charged_each_rule_for_its_settlement() {
        let item = |entries: &[(&str, &str)], cost: u64| Item {
            receipt: false,
            entries: entries
                .iter()
                .map(|(k, v)| (k.to_string(), Some(v.to_string())))
                .collect(),
            cost,
            lease: None,
        };
        let charges: Vec<_> = [
            item(&[("rule", "llm"), ("user", "ann")], 1000),
            item(&[("remote_address", "1.2.3.4")], 3), // not this sidecar's format
            item(&[("rule", "free")], 2),              // unlimited: nothing charged
            item(&[("rule", "trial")], 4),             // shadow, would have rejected
            item(&[("rule", "llm"), ("user", "bob")], 5), // the rule's first charge stands
        ]
        .iter()
        .map(rule_charge)
        .collect();
        let mut unlimited = result(true, Reason::Unlimited, 0, 0);
        unlimited.limit = None;
        let mut shadow = result(true, Reason::Insufficient, 0, 0);
        shadow.shadow = true;
        let mut answer = RequestAnswer {
            allowed: true,
            results: vec![
                result(true, Reason::Ok, 4, 0),
                result(true, Reason::Ok, 4, 0),
                unlimited,
                shadow,
                result(true, Reason::Ok, 4, 0),
            ],
            error: None,
            slot: None,
        };
        let m = charged_metadata(&charges, &answer).expect("something was charged");
        let Some(Kind::StructValue(settle)) = &m.fields["settle"].kind else {
            panic!("{m:?}")
        };
        assert_eq!(settle.fields.len(), 1, "{settle:?}");
        assert_eq!(
            settle.fields["llm"].kind,
            Some(Kind::StringValue("1000".into()))
        );
        // A rejected request was charged nothing: no metadata, so no settle entry.
        answer.allowed = false;
        assert_eq!(charged_metadata(&charges, &answer), None);
        answer.allowed = true;
        answer.results[0].reason = Reason::Insufficient;
        answer.results[4].reason = Reason::Insufficient;
        assert_eq!(charged_metadata(&charges, &answer), None);
    }

    #[test]
    fn a_unit_is_named_only_when_a_full_refill_takes_exactly_one() {
        assert_eq!(unit_of(10, 10.0), Unit::Second);
        assert_eq!(unit_of(600, 10.0), Unit::Minute);
        assert_eq!(unit_of(5, 5.0 / 60.0), Unit::Minute);
        assert_eq!(unit_of(24, 24.0 / 86_400.0), Unit::Day);
        assert_eq!(unit_of(7, 7.0 / 604_800.0), Unit::Week);
        assert_eq!(unit_of(30, 30.0 / 2_592_000.0), Unit::Month);
        assert_eq!(unit_of(100, 10.0), Unit::Unknown, "a 10 s refill");
        assert_eq!(unit_of(0, 0.0), Unit::Unknown, "a blocking limit");
    }

    fn result(allowed: bool, reason: Reason, remaining: u64, wait_ms: u64) -> DecisionResult {
        DecisionResult {
            receipt: None,
            allowed,
            remaining,
            retry_after_ms: if allowed { 0 } else { wait_ms },
            reset_ms: wait_ms,
            reason,
            limit: Some(AppliedLimit {
                name: "per-ip".into(),
                capacity: 5,
                refill_per_sec: 1.0,
            }),
            shadow: false,
            leased: 0,
            error: None,
        }
    }

    #[test]
    fn an_answer_maps_to_codes_figures_and_the_filters_headers() {
        let ok = RequestAnswer {
            allowed: true,
            results: vec![result(true, Reason::Ok, 4, 1000)],
            error: None,
            slot: None,
        };
        let r = respond(&ok, ResponseHeaders::All);
        assert_eq!(r.overall_code, Code::Ok as i32);
        let s = &r.statuses[0];
        assert_eq!(s.code, Code::Ok as i32);
        assert_eq!(s.limit_remaining, 4);
        assert_eq!(
            s.current_limit,
            Some(RateLimit {
                name: "per-ip".into(),
                requests_per_unit: 5,
                unit: Unit::Unknown as i32
            })
        );
        assert_eq!(s.duration_until_reset, Some(duration(1000)));
        let h: Vec<(String, String)> = r
            .response_headers_to_add
            .iter()
            .map(|h| (h.key.clone(), h.value.clone()))
            .collect();
        assert_eq!(
            h,
            [
                ("ratelimit-policy".into(), "\"per-ip\";q=5;w=5".into()),
                ("ratelimit".into(), "\"per-ip\";r=4;t=1".into())
            ]
        );

        let over = RequestAnswer {
            allowed: false,
            results: vec![
                result(true, Reason::Ok, 3, 2000),
                result(false, Reason::Insufficient, 0, 1500),
            ],
            error: None,
            slot: None,
        };
        let r = respond(&over, ResponseHeaders::All);
        assert_eq!(r.overall_code, Code::OverLimit as i32);
        assert_eq!(r.statuses[0].code, Code::Ok as i32);
        assert_eq!(r.statuses[1].code, Code::OverLimit as i32);
        assert_eq!(r.statuses[1].duration_until_reset, Some(duration(1500)));
        assert_eq!(
            response_headers(&over),
            [
                ("retry-after", "2".to_string()),
                ("ratelimit-policy", "\"per-ip\";q=5;w=5".to_string()),
                ("ratelimit", "\"per-ip\";r=0;t=2".to_string())
            ]
        );

        let never = RequestAnswer {
            allowed: false,
            results: vec![result(false, Reason::CostExceedsCapacity, 5, 0)],
            error: None,
            slot: None,
        };
        assert_eq!(
            response_headers(&never),
            [("ratelimit-policy", "\"per-ip\";q=5;w=5".to_string())]
        );
        assert_eq!(
            respond(&never, ResponseHeaders::All).statuses[0].duration_until_reset,
            None
        );

        // `rejected`: only the refusal carries headers; `none`: no answer does, and the
        // statuses stay whole (Envoy's own headers are rendered from them).
        let rejected = ResponseHeaders::Rejected;
        assert!(respond(&ok, rejected).response_headers_to_add.is_empty());
        assert_eq!(respond(&over, rejected).response_headers_to_add.len(), 3);
        for a in [&ok, &over] {
            let r = respond(a, ResponseHeaders::None);
            assert!(r.response_headers_to_add.is_empty());
            assert_eq!(r.statuses, respond(a, ResponseHeaders::All).statuses);
        }
    }
}
