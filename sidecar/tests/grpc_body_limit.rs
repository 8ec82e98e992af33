//! A gRPC request message is bounded by `--max-body-bytes`, as a `POST /v1/decide` body is: one
//! over it is refused from its length prefix (OUT_OF_RANGE), before it is read or decoded, and
//! nothing reaches the store. In-process, on the router over a `MemoryStore`.

mod support;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use http_body_util::BodyExt;
use prost::Message;
use ratelimit_sidecar::calls::Stopping;
use ratelimit_sidecar::http::router;
use ratelimit_sidecar::store::memory::MemoryStore;
use tower::ServiceExt;

const MAX_BODY_BYTES: usize = 4096;
const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

fn app() -> (axum::Router, Arc<MemoryStore>) {
    let (state, store) = support::memory_state(
        "rules: {per-app: {capacity: 1000, refill_per_sec: 1}}",
        Stopping::never(),
    );
    (router(state, MAX_BODY_BYTES), store)
}

/// `descriptors` descriptors of `rule=per-app`, framed as one gRPC message.
fn call(descriptors: usize) -> Vec<u8> {
    let message = RateLimitRequest {
        domain: "ratelimit".into(),
        descriptors: vec![
            RateLimitDescriptor {
                entries: vec![Entry {
                    key: "rule".into(),
                    value: "per-app".into(),
                }],
                ..Default::default()
            };
            descriptors
        ],
        hits_addend: 0,
    }
    .encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
    frame.extend_from_slice(&message);
    frame
}

/// The gRPC status of a call (headers when refused at once, trailers once answered).
async fn grpc_status(app: &axum::Router, body: Vec<u8>) -> String {
    let request = Request::post(PATH)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Body::from(body))
        .expect("a request");
    let response = tokio::time::timeout(Duration::from_secs(10), app.clone().oneshot(request))
        .await
        .expect("answered within 10 s")
        .expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
    let (parts, body) = response.into_parts();
    let trailers = body
        .collect()
        .await
        .expect("a body")
        .trailers()
        .cloned()
        .unwrap_or_default();
    let status = parts
        .headers
        .get("grpc-status")
        .or_else(|| trailers.get("grpc-status"))
        .expect("a grpc-status");
    status.to_str().expect("ASCII").to_string()
}

#[tokio::test]
async fn a_grpc_message_over_max_body_bytes_is_refused_before_it_is_read() {
    let (app, store) = app();
    // Within the bound: decided (and charged).
    let small = call(3);
    assert!(small.len() <= MAX_BODY_BYTES);
    assert_eq!(grpc_status(&app, small).await, "0");
    let charged = store.stored_tokens("rl:{ratelimit|rule=per-app}");
    assert!(charged.is_some(), "the call within the bound was decided");
    // 200,000 descriptors (about 2.6 MB): refused from the length prefix, nothing charged.
    let huge = call(200_000);
    assert!(huge.len() > 2_000_000);
    assert_eq!(grpc_status(&app, huge).await, "11");
    assert_eq!(store.stored_tokens("rl:{ratelimit|rule=per-app}"), charged);
    // A prefix that claims 10 MiB and a body that holds 5 bytes: refused at once, not awaited.
    let mut liar = vec![0u8];
    liar.extend_from_slice(&(10u32 << 20).to_be_bytes());
    liar.extend_from_slice(b"hello");
    assert_eq!(grpc_status(&app, liar).await, "11");
}
