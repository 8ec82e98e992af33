//! The HTTP edge: `POST /v1/decide`, `POST /v1/settle`, `POST /v1/slots`, `GET /v1/epoch`,
//! `GET /healthz`, `GET /readyz`, `GET /metrics`, and the router that also carries the gRPC
//! services of [`crate::grpc`] and [`crate::stream`] on the same listener (HTTP/1.1 and h2c). What
//! each call does is [`crate::calls`]'s. Every error answer of the HTTP API is JSON
//! `{"error":"..."}`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ratelimit_wire::{ErrorBody, DECIDE_PATH, EPOCH_PATH, SETTLE_PATH, SLOTS_PATH};

use crate::calls::{decide_call, epoch_call, settle_call, slots_call, Answered, AppState};
use crate::grpc::RateLimitApi;
use crate::metrics::CallOutcome;
use crate::store::BucketStore;

/// The sidecar's routes: the decision endpoints (`POST /v1/decide`, the stream per worker and
/// the gRPC rate limit service) and the health and metrics paths.
pub fn router<S: BucketStore>(state: Arc<AppState<S>>, max_body_bytes: usize) -> Router {
    let decide_json = Router::new()
        .route(DECIDE_PATH, post(decide::<S>))
        .route(SETTLE_PATH, post(settle::<S>))
        .route(SLOTS_PATH, post(slots::<S>))
        .route(EPOCH_PATH, get(epoch::<S>))
        .method_not_allowed_fallback(|| async {
            error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed".into())
        })
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state.clone());
    let grpc = RateLimitApi::new(state.decider.clone(), state.metrics.clone(), state.grpc)
        .into_router(max_body_bytes);
    // Every route that decides: `POST /v1/decide` and the gRPC service. Authentication
    // (`crate::auth::protect`, applied by `serve` around this whole router) covers both alike
    // (gRPC metadata are HTTP/2 headers: `authorization: Bearer <token>`), and `GET /v1/epoch`
    // with them, and leaves only /healthz, /readyz and /metrics open.
    let stream = crate::stream::CallStream::new(state.clone(), max_body_bytes).into_router();
    let decisions: Router = decide_json.merge(grpc).merge(stream);
    Router::new()
        .merge(health_router(state.clone()).with_state(state))
        .merge(decisions)
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such path".into()) })
        // Last, so that it covers every route merged above (/healthz, /readyz, /metrics too).
        .method_not_allowed_fallback(|| async {
            error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed".into())
        })
}

/// `/healthz`, `/readyz`, `/metrics` only (the admin listener).
pub fn health_router<S: BucketStore>(state: Arc<AppState<S>>) -> Router<Arc<AppState<S>>> {
    let _ = &state;
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz::<S>))
        .route("/metrics", get(metrics::<S>))
}

fn error(status: StatusCode, error: String) -> Response {
    (status, Json(ErrorBody { error })).into_response()
}

async fn decide<S: BucketStore>(
    State(s): State<Arc<AppState<S>>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body {
        Err(rejection) => {
            s.metrics.call("http", CallOutcome::BadRequest);
            let status = rejection.status();
            let text = if status == StatusCode::PAYLOAD_TOO_LARGE {
                "request body is larger than --max-body-bytes".to_string()
            } else {
                rejection.body_text()
            };
            error(status, text)
        }
        Ok(body) => decide_call(&s, "http", &body).await.into_response(),
    }
}

/// `POST /v1/settle`: 200 with what was applied, 400 for a malformed call, 503 (500 when the
/// script failed) when the store could not apply it: the caller may send the same batch again.
async fn settle<S: BucketStore>(
    State(s): State<Arc<AppState<S>>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body {
        Ok(body) => settle_call(&s, &body).await.into_response(),
        Err(rejection) => rejected(&s, "settle", rejection),
    }
}

/// `POST /v1/slots`: 200 with what was renewed and released, 400 for a malformed call, 503 (500
/// when the script failed) when the store could not apply it: the caller may send it again (a
/// renewal or release applied twice does nothing more).
async fn slots<S: BucketStore>(
    State(s): State<Arc<AppState<S>>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body {
        Ok(body) => slots_call(&s, &body).await.into_response(),
        Err(rejection) => rejected(&s, "slots", rejection),
    }
}

/// A body the HTTP edge could not take (too large, unreadable), counted as a bad request.
fn rejected<S>(s: &AppState<S>, api: &'static str, rejection: BytesRejection) -> Response {
    s.metrics.call(api, CallOutcome::BadRequest);
    error(rejection.status(), rejection.body_text())
}

impl IntoResponse for Answered {
    fn into_response(self) -> Response {
        (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            self.body,
        )
            .into_response()
    }
}

/// `GET /v1/epoch`: the policy's epoch, for the filter's poll (docs/fast-paths.md#policy-reloads).
async fn epoch<S: BucketStore>(State(s): State<Arc<AppState<S>>>) -> Response {
    epoch_call(&s).into_response()
}

async fn readyz<S: BucketStore>(State(s): State<Arc<AppState<S>>>) -> Response {
    let r = s.decider.readiness().await;
    let status = if r.store.redis_ok && r.store.script_loaded {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(r)).into_response()
}

async fn metrics<S: BucketStore>(State(s): State<Arc<AppState<S>>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
        .into_response()
}
