//! The calls both edges take, whatever carried them (`POST /v1/decide` and its neighbours over
//! HTTP, [`crate::http`]; a call on the stream per worker, [`crate::stream`]): one body of a kind
//! in, its HTTP status and JSON body out ([`Answered`]), counted under the API that carried it;
//! and what their handlers share ([`AppState`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use ratelimit_wire::{DecideResponse, EpochResponse, ErrorBody, ErrorCode};

use crate::decide::{parse_request, parse_settle, parse_slots, DecideError, Decider};
use crate::metrics::{CallOutcome, Metrics, RequestOutcome};
use crate::store::{BucketStore, StoreError};

/// What the handlers share.
pub struct AppState<S> {
    pub decider: Arc<Decider<S>>,
    pub metrics: Arc<Metrics>,
    /// What the gRPC rate limit service's answers carry besides the verdict.
    pub grpc: crate::grpc::Answering,
    /// Says when the sidecar begins to stop: the streams per worker then end
    /// ([`crate::stream`]).
    pub stopping: Stopping,
}

/// The sidecar's "stopping" signal, as long-lived streams watch it.
#[derive(Clone, Debug)]
pub struct Stopping(tokio::sync::watch::Receiver<bool>);

impl Stopping {
    /// A signal and its sender (`send(true)`: the sidecar begins to stop).
    pub fn new() -> (tokio::sync::watch::Sender<bool>, Stopping) {
        let (tx, rx) = tokio::sync::watch::channel(false);
        (tx, Stopping(rx))
    }

    /// A signal that never comes (a router of a test).
    pub fn never() -> Stopping {
        Stopping::new().1
    }

    /// Completes once the sidecar begins to stop (never, if the sender is gone without saying
    /// so).
    pub async fn stopped(&self) {
        let mut rx = self.0.clone();
        if rx.wait_for(|s| *s).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// A decision call's answer, whichever transport carried it: its HTTP status and JSON body
/// ([`DecideResponse`], or [`ErrorBody`]).
#[derive(Debug)]
pub struct Answered {
    pub status: StatusCode,
    pub body: Vec<u8>,
}

impl Answered {
    pub fn error(status: StatusCode, error: String) -> Answered {
        Answered {
            status,
            body: serde_json::to_vec(&ErrorBody { error }).unwrap_or_default(),
        }
    }
}

/// Decides one `POST /v1/decide` body that came over `api` (`"http"`, or `"stream"`: a call of
/// the stream per worker, [`crate::stream`]): 200 with the answers, 400 for a malformed call, 503
/// (500 when the script failed) when no decision could be made.
pub async fn decide_call<S: BucketStore>(
    s: &AppState<S>,
    api: &'static str,
    body: &[u8],
) -> Answered {
    let started = Instant::now();
    let answered = match parse_request(body) {
        Err(e) => {
            s.metrics.call(api, CallOutcome::BadRequest);
            Answered::error(StatusCode::BAD_REQUEST, e.to_string())
        }
        Ok(call) => {
            // The decision runs in a task of its own: a caller that hangs up (Envoy's
            // callout timeout resets the stream) cancels neither its Redis calls nor the
            // refunds that follow them.
            let decider = s.decider.clone();
            // The epoch read before deciding: the decision's policy is this one or a later
            // one, so what the filter learns is never tagged newer than it is.
            let epoch = decider.policy().current().epoch();
            match tokio::spawn(async move { decider.decide(call).await }).await {
                Ok(mut answer) => {
                    answer.epoch = Some(epoch);
                    respond(&s.metrics, api, answer)
                }
                Err(e) => {
                    s.metrics.call(api, CallOutcome::Error);
                    tracing::error!("decision task failed: {e}");
                    Answered::error(StatusCode::INTERNAL_SERVER_ERROR, "decision failed".into())
                }
            }
        }
    };
    s.metrics
        .decision_duration
        .observe(started.elapsed().as_secs_f64());
    answered
}

/// One `/v1/settle` body, whichever transport carried it.
pub async fn settle_call<S: BucketStore>(s: &AppState<S>, body: &[u8]) -> Answered {
    applied(s, "settle", body, parse_settle, |d, call| async move {
        d.settle(call).await
    })
    .await
}

/// One `/v1/slots` body, whichever transport carried it.
pub async fn slots_call<S: BucketStore>(s: &AppState<S>, body: &[u8]) -> Answered {
    applied(s, "slots", body, parse_slots, |d, call| async move {
        d.update_slots(call).await
    })
    .await
}

/// The policy's epoch, as `GET /v1/epoch` answers it.
pub fn epoch_call<S: BucketStore>(s: &AppState<S>) -> Answered {
    json_answer(&EpochResponse {
        epoch: s.decider.policy().current().epoch(),
    })
}

/// 200 with `answer` as JSON.
fn json_answer(answer: &impl serde::Serialize) -> Answered {
    match serde_json::to_vec(answer) {
        Ok(body) => Answered {
            status: StatusCode::OK,
            body,
        },
        Err(e) => Answered::error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// A call the store applies (`api`: `settle`, `slots`): the body parsed (400), the call run in a
/// task of its own, as a decision, so that a caller that hangs up does not cancel the script
/// call in flight (its retry then finds what was applied); 500 when the script failed, 503 when
/// the store could not be reached; counted per outcome.
async fn applied<S, C, A, F>(
    s: &AppState<S>,
    api: &'static str,
    body: &[u8],
    parse: fn(&[u8]) -> Result<C, DecideError>,
    run: impl FnOnce(Arc<Decider<S>>, C) -> F,
) -> Answered
where
    S: BucketStore,
    A: serde::Serialize + Send + 'static,
    F: Future<Output = Result<A, StoreError>> + Send + 'static,
{
    let call = match parse(body) {
        Ok(call) => call,
        Err(e) => {
            s.metrics.call(api, CallOutcome::BadRequest);
            return Answered::error(StatusCode::BAD_REQUEST, e.to_string());
        }
    };
    match tokio::spawn(run(s.decider.clone(), call)).await {
        Ok(Ok(answer)) => {
            s.metrics.call(api, CallOutcome::Answered);
            json_answer(&answer)
        }
        Ok(Err(e)) => {
            let status = if e.is_deterministic() {
                s.metrics.call(api, CallOutcome::Error);
                StatusCode::INTERNAL_SERVER_ERROR
            } else {
                s.metrics.call(api, CallOutcome::Unavailable);
                StatusCode::SERVICE_UNAVAILABLE
            };
            Answered::error(status, e.to_string())
        }
        Err(e) => {
            s.metrics.call(api, CallOutcome::Error);
            tracing::error!("{api} task failed: {e}");
            Answered::error(StatusCode::INTERNAL_SERVER_ERROR, format!("{api} failed"))
        }
    }
}

/// 200 with the answers, unless every request failed for one reason: then 503 (Redis
/// unavailable) or 500 (the script failed), so a simple caller sees the outage in the status.
fn respond(metrics: &Metrics, api: &'static str, answer: DecideResponse) -> Answered {
    // The call's requests by outcome, and its leased tokens: counted once each.
    let mut counts = [0u64; RequestOutcome::ALL.len()];
    let mut leased = 0u64;
    for a in &answer.answers {
        counts[RequestOutcome::of(a) as usize] += 1;
        leased = a
            .results
            .iter()
            .fold(leased, |n, r| n.saturating_add(r.leased));
    }
    for (outcome, n) in RequestOutcome::ALL.into_iter().zip(counts) {
        metrics.requests_of(outcome, n);
    }
    metrics.lease_granted(leased);
    let all = |code: ErrorCode| {
        !answer.answers.is_empty()
            && answer
                .answers
                .iter()
                .all(|a| a.error.as_ref().is_some_and(|e| e.code == code))
    };
    let first_error = || {
        answer
            .answers
            .iter()
            .find_map(|a| a.error.as_ref().map(|e| e.message.clone()))
            .unwrap_or_default()
    };
    if all(ErrorCode::Unavailable) {
        metrics.call(api, CallOutcome::Unavailable);
        let e = first_error();
        tracing::warn!("decision failed: {e}");
        return Answered::error(StatusCode::SERVICE_UNAVAILABLE, e);
    }
    if all(ErrorCode::ScriptFailed) {
        metrics.call(api, CallOutcome::Error);
        let e = first_error();
        tracing::error!("decision failed: {e}");
        return Answered::error(StatusCode::INTERNAL_SERVER_ERROR, e);
    }
    metrics.call(api, CallOutcome::Answered);
    json_answer(&answer)
}

#[cfg(test)]
mod tests {
    use ratelimit_wire::{DecisionResult, Reason, RequestAnswer, RequestError};

    use super::*;

    fn answer(allowed: bool, leased: &[u64], error: Option<ErrorCode>) -> RequestAnswer {
        RequestAnswer {
            allowed,
            results: leased
                .iter()
                .map(|&leased| DecisionResult {
                    receipt: None,
                    allowed,
                    remaining: 0,
                    retry_after_ms: 0,
                    reset_ms: 0,
                    reason: Reason::Ok,
                    limit: None,
                    shadow: false,
                    leased,
                    error: None,
                })
                .collect(),
            error: error.map(|code| RequestError {
                code,
                message: "x".into(),
            }),
            slot: None,
        }
    }

    #[test]
    fn a_call_s_requests_are_counted_by_outcome_and_its_leases_summed() {
        let m = Metrics::new();
        let answers = vec![
            answer(true, &[0, 5], None),
            answer(true, &[7], None),
            answer(false, &[0], None),
            answer(false, &[], Some(ErrorCode::UnknownRule)),
            answer(true, &[0], None),
        ];
        let r = respond(
            &m,
            "http",
            DecideResponse {
                answers,
                epoch: None,
            },
        );
        assert_eq!(r.status, StatusCode::OK);
        let text = m.encode();
        for line in [
            "ratelimit_requests_total{outcome=\"allowed\"} 3",
            "ratelimit_requests_total{outcome=\"rejected\"} 1",
            "ratelimit_requests_total{outcome=\"unknown_rule\"} 1",
            "ratelimit_lease_tokens_total{result=\"granted\"} 12",
            "ratelimit_calls_total{api=\"http\",outcome=\"answered\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
        assert!(
            !text.contains("outcome=\"unavailable\"} "),
            "no count for an outcome no request had:\n{text}"
        );
    }
}
