//! The stream per worker ([`ratelimit_wire::stream`]): each worker of an Envoy opens one
//! bidirectional gRPC stream and sends its coalesced batches, settlements, slot renewals and
//! releases and epoch polls on it as calls; every call runs in a task of its own, as the HTTP
//! endpoint of its kind does ([`crate::calls::decide_call`] and its neighbours), and is answered on
//! the stream with the call's id as soon as it is done, so one slow call holds up no other.
//! Concurrent calls, of one stream or many, meet in the decider's merging of script calls as
//! concurrent HTTP calls do.
//!
//! Bounds: a call's body at most `--max-body-bytes` (a larger message ends the stream, as tonic
//! refuses it); at most [`MAX_CALLS_IN_FLIGHT`] calls of one stream decided at once (the next is
//! read when one is answered, so a caller that sends faster is held back by HTTP/2's flow
//! control, not buffered). A caller whose token is no longer accepted (a token file reloaded
//! without it) has its stream ended with `UNAUTHENTICATED` at its next call. When the sidecar
//! begins to stop, every stream ends once its calls are answered.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::StatusCode;
use futures::future::BoxFuture;
use futures::StreamExt;
use ratelimit_wire::stream::{Answer, Call, Kind, STREAM_PATH};
use tokio::sync::{mpsc, Semaphore};
use tonic::server::{Grpc, StreamingService};
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;

use crate::auth::Credential;
use crate::calls::{decide_call, epoch_call, settle_call, slots_call, Answered, AppState};
use crate::metrics::CallOutcome;
use crate::store::BucketStore;

/// At most this many calls of one stream are decided at once.
pub const MAX_CALLS_IN_FLIGHT: usize = 64;

/// The stream per worker's service, for [`axum::Router::route_service`] at [`STREAM_PATH`].
pub struct CallStream<S> {
    state: Arc<AppState<S>>,
    max_body_bytes: usize,
}

impl<S> Clone for CallStream<S> {
    fn clone(&self) -> Self {
        CallStream {
            state: self.state.clone(),
            max_body_bytes: self.max_body_bytes,
        }
    }
}

impl<S: BucketStore> CallStream<S> {
    pub fn new(state: Arc<AppState<S>>, max_body_bytes: usize) -> CallStream<S> {
        CallStream {
            state,
            max_body_bytes,
        }
    }

    /// The router serving the stream.
    pub fn into_router(self) -> axum::Router {
        axum::Router::new().route_service(STREAM_PATH, self)
    }
}

type Answers = futures::stream::BoxStream<'static, Result<Answer, Status>>;

/// Serves one stream: reads its calls while fewer than [`MAX_CALLS_IN_FLIGHT`] are being decided.
struct Calls<S>(CallStream<S>);

impl<S: BucketStore> StreamingService<Call> for Calls<S> {
    type Response = Answer;
    type ResponseStream = Answers;
    type Future = BoxFuture<'static, Result<Response<Answers>, Status>>;

    fn call(&mut self, request: Request<Streaming<Call>>) -> Self::Future {
        let state = self.0.state.clone();
        Box::pin(async move {
            // Set by the authentication in front (`crate::auth::protect`) when a bearer token
            // was presented.
            let credential = request.extensions().get::<Credential>().cloned();
            let calls = request.into_inner();
            let (tx, rx) = mpsc::channel(MAX_CALLS_IN_FLIGHT);
            tokio::spawn(read_calls(state, calls, credential, tx));
            let answers =
                futures::stream::unfold(
                    rx,
                    |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
                );
            Ok(Response::new(answers.boxed()))
        })
    }
}

/// Reads the calls of one stream until it ends, deciding each in a task of its own.
async fn read_calls<S: BucketStore>(
    state: Arc<AppState<S>>,
    mut calls: Streaming<Call>,
    credential: Option<Credential>,
    tx: mpsc::Sender<Result<Answer, Status>>,
) {
    let in_flight = Arc::new(Semaphore::new(MAX_CALLS_IN_FLIGHT));
    loop {
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            return;
        };
        let message = tokio::select! {
            () = state.stopping.stopped() => None,
            m = calls.message() => Some(m),
        };
        let Some(message) = message else {
            // The sidecar is stopping: no call is read any more, the ones being decided are
            // answered, and the stream ends (OK) so that the worker opens its next one on
            // another connection.
            drop(permit);
            let _ = in_flight.acquire_many(MAX_CALLS_IN_FLIGHT as u32).await;
            return;
        };
        let call = match message {
            Ok(Some(call)) => call,
            // The worker closed its side, or the stream broke (a malformed or oversized
            // message): calls still being decided are answered while the answers can go out.
            Ok(None) => return,
            // A message that does not decode, or one over the limit, is the caller's error; a
            // stream reset or a connection gone (a gateway cut off, restarted) is not.
            Err(status) if malformed(&status) => {
                state.metrics.call("stream", CallOutcome::BadRequest);
                tracing::warn!("a stream per worker sent a call this sidecar refuses: {status}");
                let _ = tx.send(Err(status)).await;
                return;
            }
            Err(status) => {
                tracing::debug!("a stream per worker ended: {status}");
                return;
            }
        };
        if !credential.as_ref().is_none_or(Credential::still_accepted) {
            state.metrics.call("stream", CallOutcome::Unauthorized);
            let _ = tx
                .send(Err(Status::unauthenticated(
                    "the token is no longer accepted",
                )))
                .await;
            return;
        }
        let (state, tx) = (state.clone(), tx.clone());
        tokio::spawn(async move {
            let answered = match Kind::try_from(call.kind) {
                Ok(Kind::Decide) => decide_call(&state, "stream", &call.body).await,
                Ok(Kind::Settle) => settle_call(&state, &call.body).await,
                Ok(Kind::Slots) => slots_call(&state, &call.body).await,
                Ok(Kind::Epoch) => epoch_call(&state),
                Err(_) => {
                    state.metrics.call("stream", CallOutcome::BadRequest);
                    Answered::error(
                        StatusCode::BAD_REQUEST,
                        format!("unknown call kind {}", call.kind),
                    )
                }
            };
            let answer = Answer {
                id: call.id,
                status: u32::from(answered.status.as_u16()),
                body: answered.body,
            };
            // A stream gone meanwhile drops the answer; the decision stands, as a callout's
            // whose caller hung up.
            let _ = tx.send(Ok(answer)).await;
            drop(permit);
        });
    }
}

/// Whether a stream's read error is the caller's message, not the transport's: one over the size
/// limit (`OUT_OF_RANGE`) or one that does not decode (`INTERNAL` with prost's error; a reset
/// or a broken connection is `INTERNAL` too, as an h2 or I/O error).
fn malformed(status: &Status) -> bool {
    match status.code() {
        tonic::Code::OutOfRange => true,
        tonic::Code::Internal => status
            .message()
            .starts_with("failed to decode Protobuf message"),
        _ => false,
    }
}

impl<S: BucketStore> tower::Service<axum::extract::Request> for CallStream<S> {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: axum::extract::Request) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            // The envelope of a call adds its id, kind and the body's length to the body.
            let max_message = this.max_body_bytes.saturating_add(32);
            let mut grpc = Grpc::new(ProstCodec::<Answer, Call>::default())
                .max_decoding_message_size(max_message);
            let response = grpc.streaming(Calls(this), request).await;
            Ok(response.map(axum::body::Body::new))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn only_the_callers_message_counts_as_malformed() {
        let undecodable = Call::decode(&b"\xff\xff"[..]).unwrap_err();
        assert!(malformed(&Status::internal(undecodable.to_string())));
        assert!(malformed(&Status::out_of_range("too large")));
        assert!(!malformed(&Status::internal(
            "h2 protocol error: broken pipe"
        )));
        assert!(!malformed(&Status::cancelled("reset")));
        assert!(!malformed(&Status::unknown("connection closed")));
    }

    #[test]
    fn an_answer_carries_its_calls_id_and_status() {
        let answered = Answered::error(StatusCode::SERVICE_UNAVAILABLE, "redis down".into());
        let answer = Answer {
            id: 41,
            status: u32::from(answered.status.as_u16()),
            body: answered.body,
        };
        let decoded = Answer::decode(answer.encode_to_vec().as_slice()).unwrap();
        assert_eq!((decoded.id, decoded.status), (41, 503));
        assert!(String::from_utf8(decoded.body)
            .unwrap()
            .contains("redis down"));
    }
}
