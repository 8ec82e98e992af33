//! The HTTP edge: `POST /v1/decide`, `GET /healthz`, `GET /readyz`, `GET /metrics`. Every error
//! answer is JSON `{"error":"..."}`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ratelimit_wire::{ErrorBody, DECIDE_PATH};

use crate::decide::{parse_request, DecideError, Decider};
use crate::metrics::{Metrics, RequestOutcome};
use crate::store::RedisStore;

/// What the handlers share.
pub struct AppState {
    pub decider: Decider<RedisStore>,
    pub metrics: Arc<Metrics>,
}

/// The sidecar's routes.
pub fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    Router::new()
        .route(DECIDE_PATH, post(decide))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such path".into()) })
        .method_not_allowed_fallback(|| async {
            error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed".into())
        })
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

fn error(status: StatusCode, error: String) -> Response {
    (status, Json(ErrorBody { error })).into_response()
}

async fn decide(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let started = Instant::now();
    let response = match body {
        Err(rejection) => {
            s.metrics.request(RequestOutcome::BadRequest);
            let status = rejection.status();
            let text = if status == StatusCode::PAYLOAD_TOO_LARGE {
                "request body is larger than --max-body-bytes".to_string()
            } else {
                rejection.body_text()
            };
            error(status, text)
        }
        Ok(body) => match parse_request(&body) {
            Err(e) => {
                s.metrics.request(RequestOutcome::BadRequest);
                error(StatusCode::BAD_REQUEST, e.to_string())
            }
            Ok(request) => match s.decider.decide(&request).await {
                Ok(answer) => {
                    s.metrics.request(if answer.allowed {
                        RequestOutcome::Allowed
                    } else {
                        RequestOutcome::Rejected
                    });
                    Json(answer).into_response()
                }
                Err(DecideError::Invalid(e)) => {
                    s.metrics.request(RequestOutcome::BadRequest);
                    error(StatusCode::BAD_REQUEST, e)
                }
                Err(DecideError::Unavailable(e)) => {
                    s.metrics.request(RequestOutcome::Unavailable);
                    tracing::warn!("decision failed: {e}");
                    error(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
                }
                Err(DecideError::Script(e)) => {
                    s.metrics.request(RequestOutcome::Error);
                    tracing::error!("decision failed: {e}");
                    error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
                }
            },
        },
    };
    s.metrics
        .decision_duration
        .observe(started.elapsed().as_secs_f64());
    response
}

async fn readyz(State(s): State<Arc<AppState>>) -> Response {
    let r = s.decider.store().readiness().await;
    let status = if r.redis_ok && r.script_loaded {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(r)).into_response()
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
        .into_response()
}
