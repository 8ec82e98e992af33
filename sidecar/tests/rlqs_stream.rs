//! The quota stream in-process (the router over a `MemoryStore`): a usage report of any size is
//! read, and a stream whose bearer token was rotated out ends. The same through real Envoys:
//! tests/tests/rlqs.rs.

mod support;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use bytes::Bytes;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy;
use futures::StreamExt;
use http_body_util::BodyExt;
use prost::Message;
use ratelimit_sidecar::auth::{self, Auth};
use ratelimit_sidecar::calls::Stopping;
use ratelimit_sidecar::metrics::Metrics;
use ratelimit_sidecar::rlqs::plan::Timing;
use ratelimit_sidecar::rlqs::{RlqsApi, RlqsSettings};
use tower::ServiceExt;

const PATH: &str = "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas";
const MAX_MESSAGE_BYTES: usize = 65_536;

fn app(renew_ms: u64) -> (axum::Router, Arc<Metrics>) {
    app_stopping_on(renew_ms, Stopping::never())
}

fn app_stopping_on(renew_ms: u64, stopping: Stopping) -> (axum::Router, Arc<Metrics>) {
    let (decider, _, metrics) = support::memory_decider(
        "domain: ratelimit\nrules: {per-ip: {capacity: 1000, refill_per_sec: 100}}",
    );
    let settings = RlqsSettings {
        timing: Timing {
            ttl_s: 3,
            margin_ms: 500,
        },
        renew_ms,
        max_buckets: 10_000,
        max_message_bytes: MAX_MESSAGE_BYTES,
        store_calls_in_flight: 4,
    };
    (
        RlqsApi::new(decider, settings, stopping).into_router(),
        metrics,
    )
}

/// One report of the buckets `{rule: per-ip, ip: 127.1.x.y}`, `n` of them, as a gRPC message.
fn report(n: usize) -> Bytes {
    reports(0..n)
}

/// One report of the buckets `{rule: per-ip, ip: 127.1.x.y}` for `i` in `range`.
fn reports(range: std::ops::Range<usize>) -> Bytes {
    let usages = range
        .map(|i| BucketQuotaUsage {
            bucket_id: Some(BucketId {
                bucket: HashMap::from([
                    ("rule".to_string(), "per-ip".to_string()),
                    (
                        "ip".to_string(),
                        format!("127.1.{}.{}", i / 250, i % 250 + 1),
                    ),
                ]),
            }),
            time_elapsed: None,
            num_requests_allowed: 1,
            num_requests_denied: 0,
        })
        .collect();
    let message = RateLimitQuotaUsageReports {
        domain: "ratelimit".into(),
        bucket_quota_usages: usages,
    }
    .encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
    frame.extend_from_slice(&message);
    Bytes::from(frame)
}

fn stream_request(body: Body, token: Option<&str>) -> Request<Body> {
    let mut request = Request::post(PATH)
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(t) = token {
        request = request.header("authorization", format!("Bearer {t}"));
    }
    request.body(body).expect("a request")
}

/// The answers of a stream: its response messages, and its grpc-status.
async fn answers(app: axum::Router, request: Request<Body>) -> (Vec<Vec<u8>>, String) {
    let response = tokio::time::timeout(Duration::from_secs(60), app.oneshot(request))
        .await
        .expect("answered")
        .expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
    let (parts, body) = response.into_parts();
    let collected = tokio::time::timeout(Duration::from_secs(60), body.collect())
        .await
        .expect("the stream ended")
        .expect("a body");
    let trailers = collected.trailers().cloned().unwrap_or_default();
    let status = parts
        .headers
        .get("grpc-status")
        .or_else(|| trailers.get("grpc-status"))
        .map(|s| s.to_str().expect("ASCII").to_string())
        .unwrap_or_default();
    let mut bytes = collected.to_bytes();
    let mut messages = Vec::new();
    while bytes.len() >= 5 {
        let len = u32::from_be_bytes(bytes[1..5].try_into().unwrap()) as usize;
        messages.push(bytes.slice(5..5 + len).to_vec());
        bytes = bytes.slice(5 + len..);
    }
    (messages, status)
}

#[tokio::test]
async fn a_stopping_sidecar_ends_an_open_stream_once_its_reports_are_answered() {
    let (stop, stopping) = Stopping::new();
    let (app, _) = app_stopping_on(60_000, stopping);
    // Envoy's side stays open: one report, then nothing, never an end.
    let reports = futures::stream::once(async { Ok::<_, std::io::Error>(report(3)) })
        .chain(futures::stream::pending());
    let request = stream_request(Body::from_stream(reports), None);
    let response = app.oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let first = tokio::time::timeout(Duration::from_secs(60), body.frame())
        .await
        .expect("an answer")
        .expect("a frame")
        .expect("no error");
    assert!(first.is_data(), "the report's assignments come first");
    stop.send(true).unwrap();
    // The stream ends (its trailers, grpc-status 0) instead of waiting for Envoy.
    let rest = tokio::time::timeout(Duration::from_secs(60), body.collect())
        .await
        .expect("the stream ended")
        .expect("no error");
    let status = rest.trailers().and_then(|t| t.get("grpc-status")).cloned();
    assert_eq!(status.as_ref().map(|v| v.as_bytes()), Some(&b"0"[..]));
}

#[tokio::test]
async fn a_report_of_ten_thousand_buckets_is_read_and_every_bucket_assigned() {
    let (app, metrics) = app(60_000);
    let report = report(10_000);
    assert!(report.len() > 6 * MAX_MESSAGE_BYTES, "{}", report.len());
    let (messages, status) = answers(app, stream_request(Body::from(report), None)).await;
    assert_eq!(status, "0");
    let mut assigned = HashSet::new();
    for m in &messages {
        assert!(
            m.len() <= MAX_MESSAGE_BYTES,
            "an answer of {} bytes",
            m.len()
        );
        for action in RateLimitQuotaResponse::decode(m.as_slice())
            .unwrap()
            .bucket_action
        {
            let Some(Action::QuotaAssignmentAction(a)) = action.bucket_action else {
                panic!("not an assignment: {action:?}");
            };
            assert!(matches!(
                a.rate_limit_strategy.and_then(|s| s.strategy),
                Some(Strategy::TokenBucket(_))
            ));
            assigned.insert(action.bucket_id.unwrap().bucket["ip"].clone());
        }
    }
    assert_eq!(assigned.len(), 10_000, "every bucket assigned");
    assert!(messages.len() > 1, "the answers were split");
    let text = metrics.encode();
    for line in [
        "ratelimit_rlqs_reports_total{read=\"split\"} 1",
        "ratelimit_rlqs_usages_dropped_total{reason=\"too_large\"} 0",
        "ratelimit_rlqs_streams_opened_total 1",
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
}

/// The assignments of a stream: the `ip` of each bucket assigned a token bucket.
fn assigned(messages: &[Vec<u8>]) -> HashSet<String> {
    let mut assigned = HashSet::new();
    for m in messages {
        assert!(
            m.len() <= MAX_MESSAGE_BYTES,
            "an answer of {} bytes",
            m.len()
        );
        for action in RateLimitQuotaResponse::decode(m.as_slice())
            .unwrap()
            .bucket_action
        {
            let Some(Action::QuotaAssignmentAction(a)) = action.bucket_action else {
                panic!("not an assignment: {action:?}");
            };
            assert!(matches!(
                a.rate_limit_strategy.and_then(|s| s.strategy),
                Some(Strategy::TokenBucket(_))
            ));
            assigned.insert(action.bucket_id.unwrap().bucket["ip"].clone());
        }
    }
    assigned
}

/// Envoy reports each new bucket alone, at once: 10,000 new clients are 10,000 small reports,
/// read as they come and assigned in a few rounds.
#[tokio::test]
async fn ten_thousand_reports_of_one_new_bucket_each_are_all_assigned() {
    let (app, metrics) = app(60_000);
    let body: Vec<u8> = (0..10_000)
        .flat_map(|i| reports(i..i + 1).to_vec())
        .collect();
    let (messages, status) = answers(app, stream_request(Body::from(body), None)).await;
    assert_eq!(status, "0");
    assert_eq!(assigned(&messages).len(), 10_000, "every bucket assigned");
    let text = metrics.encode();
    let rounds: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("ratelimit_rlqs_round_duration_seconds_count "))
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(rounds < 10_000.0, "{rounds} rounds");
}

#[tokio::test]
async fn a_stream_ends_unauthenticated_once_its_token_is_rotated_out() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "old-token\nnew-token\n").unwrap();
    let auth = Auth::load(Some(&tokens), None).unwrap().unwrap();
    let (app, _) = app(20);
    let app = auth::protect(
        app,
        auth.clone(),
        Arc::new(ratelimit_sidecar::metrics::Metrics::new()),
    );
    // The report, then a body that stays open: only the rotation can end the stream.
    let (tx, rx) = futures::channel::mpsc::unbounded::<Result<Bytes, std::io::Error>>();
    tx.unbounded_send(Ok(report(3))).unwrap();
    let response = app
        .clone()
        .oneshot(stream_request(Body::from_stream(rx), Some("old-token")))
        .await
        .expect("infallible");
    let mut body = response.into_body();
    // Its first assignment, before the rotation.
    let first = tokio::time::timeout(Duration::from_secs(60), body.frame())
        .await
        .expect("an answer")
        .expect("a frame")
        .expect("not an error");
    assert!(first.is_data(), "an assignment first");
    // The other token's stream is not touched (it ends when its body does).
    let (_, other) = answers(
        app,
        stream_request(Body::from(report(2)), Some("new-token")),
    )
    .await;
    assert_eq!(other, "0");
    std::fs::write(&tokens, "new-token\n").unwrap();
    assert!(auth.reload_if_changed().unwrap());
    let rest = tokio::time::timeout(Duration::from_secs(60), body.collect())
        .await
        .expect("the stream ended")
        .expect("a body");
    let status = rest.trailers().and_then(|t| t.get("grpc-status")).cloned();
    assert_eq!(
        status.as_ref().map(|s| s.to_str().unwrap()),
        Some("16"),
        "UNAUTHENTICATED"
    );
    drop(tx);
}
