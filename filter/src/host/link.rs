//! The stream per worker, host side: the root context opens it
//! (`open_grpc_stream`, to the service of [`ratelimit_wire::stream`] on `sidecar.cluster`), sends
//! a batch, settlements, slot renewals and releases or the epoch poll as a call on it, and reads
//! the answers and the close Envoy reports; the state of the stream and of its calls is
//! [`crate::flow::link`]'s and the queue's.

use log::{debug, warn};
use prost::Message;
use proxy_wasm::hostcalls;
use proxy_wasm::types::BufferType;
use ratelimit_wire::stream::{Answer, Kind, STREAM_METHOD, STREAM_SERVICE};
use ratelimit_wire::DecideResponse;

use super::callout::{self, Reply};
use super::{abi, Plugin, SharedVm};
use crate::flow::link::{self, Route};
use crate::verdict::{self, LimiterError, MAX_ANSWER_BYTES};

/// Envoy's `GrpcService` naming the cluster (`envoy_grpc`), as `open_grpc_stream` takes it: the
/// authority travels in it.
#[derive(Clone, PartialEq, Message)]
struct GrpcService {
    #[prost(message, optional, tag = "1")]
    envoy_grpc: Option<EnvoyGrpc>,
}

#[derive(Clone, PartialEq, Message)]
struct EnvoyGrpc {
    #[prost(string, tag = "1")]
    cluster_name: String,
    #[prost(string, tag = "2")]
    authority: String,
}

/// Sends `body` as a call of `kind` on the stream at `now`, opening it first if needed: the
/// call's id (its flight's key), or why it could not go out.
pub fn send(vm: &SharedVm, kind: Kind, body: Vec<u8>, now: u64) -> Result<u32, LimiterError> {
    let plugin = vm.borrow().plugin.clone();
    let route = vm.borrow().link.route(now);
    let token = match route {
        Route::Send { token } => token,
        Route::Down => {
            return Err(LimiterError::Dispatch(
                "the stream to the sidecar is down (reopened after its backoff)".into(),
            ))
        }
        Route::Open => match open(&plugin) {
            Ok(token) => {
                vm.borrow_mut().link.opened(token);
                token
            }
            Err(e) => {
                vm.borrow_mut().link.open_failed(now);
                return Err(e);
            }
        },
    };
    let call = vm.borrow_mut().link.call(kind, body);
    match hostcalls::send_grpc_stream_message(token, Some(&call.encode_to_vec()), false) {
        Ok(()) => Ok(call.id),
        Err(status) => {
            // The stream is gone under us: the calls it carried are failed now, as by a close.
            closed(vm, token, now, None);
            Err(LimiterError::Dispatch(format!(
                "cannot send on the stream to the sidecar: {status:?}"
            )))
        }
    }
}

fn open(plugin: &Plugin) -> Result<u32, LimiterError> {
    let sidecar = &plugin.config.sidecar;
    let service = GrpcService {
        envoy_grpc: Some(EnvoyGrpc {
            cluster_name: sidecar.cluster.clone(),
            authority: sidecar.authority().to_string(),
        }),
    }
    .encode_to_vec();
    // The SDK takes the service as text: the encoded message is ASCII while the names are
    // shorter than 128 bytes; past that Envoy is given the cluster's name, which it also takes.
    let upstream = String::from_utf8(service).unwrap_or_else(|_| sidecar.cluster.clone());
    let mut metadata: Vec<(&str, &[u8])> = Vec::new();
    if let Some(a) = &plugin.authorization {
        metadata.push(("authorization", a.as_bytes()));
    }
    let token = hostcalls::open_grpc_stream(&upstream, STREAM_SERVICE, STREAM_METHOD, metadata)
        .map_err(|status| {
            LimiterError::Dispatch(format!(
                "cannot open the stream to the sidecar: {status:?} (is cluster {:?} defined, with HTTP/2?)",
                sidecar.cluster
            ))
        })?;
    debug!("ratelimit filter: opened the stream to the sidecar ({token})");
    Ok(token)
}

/// A message of `size` bytes on stream `token`: the answer to one call.
pub fn message(vm: &SharedVm, token: u32, size: usize) {
    if !vm.borrow_mut().link.answered_on(token) {
        return;
    }
    // An answer's body is at most MAX_ANSWER_BYTES; its envelope adds a few bytes.
    let bytes = if size > MAX_ANSWER_BYTES + 64 {
        None
    } else {
        abi::buffer(BufferType::GrpcReceiveBuffer, size)
    };
    let Some(answer) = bytes.and_then(|b| Answer::decode(b.as_slice()).ok()) else {
        // Without its id the answer reaches no call: they end at their deadline.
        warn!(
            "ratelimit filter: an unreadable message of {size} bytes on the stream to the sidecar"
        );
        return;
    };
    let status = link::status_text(&answer);
    let side = vm.borrow_mut().side.take(answer.id);
    if let Some((kind, pending)) = side {
        let reply = Reply {
            status: Some(status),
            body: answer.body,
        };
        callout::side_answered(vm, kind, pending, reply);
        return;
    }
    callout::landed(
        vm,
        answer.id,
        |expected| -> Result<DecideResponse, LimiterError> {
            verdict::parse_answer(Some(&status), &answer.body, expected)
        },
    );
}

/// The stream `token` closed (the sidecar ended it, or the connection broke; `status`: the gRPC
/// status Envoy gave) at `now`: every call in flight on it gets its requests' failure policies;
/// the next batch reopens it (after a backoff when it breaks again).
pub fn closed(vm: &SharedVm, token: u32, now: u64, status: Option<u32>) {
    if !vm.borrow_mut().link.closed(token, now) {
        return;
    }
    let breaks = vm.borrow().link.breaks();
    if breaks.is_power_of_two() {
        let cluster = vm.borrow().plugin.config.sidecar.cluster.clone();
        warn!(
            "ratelimit filter: the stream to the sidecar (cluster {cluster:?}) closed with gRPC status {status:?}, {breaks} time(s) in a row without an answer; requests get their on_error until it answers again"
        );
    } else {
        debug!("ratelimit filter: the stream to the sidecar closed ({token}, status {status:?})");
    }
    let flights = vm.borrow_mut().queue.all_flights();
    for flight in flights {
        callout::failed(vm, flight, LimiterError::NoAnswer);
    }
    let side = vm.borrow_mut().side.all();
    for (kind, pending) in side {
        callout::side_answered(vm, kind, pending, Reply::none());
    }
}

/// At a tick at `now`: the calls on the stream unanswered by their deadline are given up.
pub fn tick(vm: &SharedVm, now: u64) {
    let overdue = vm.borrow_mut().queue.overdue_flights(now);
    for flight in overdue {
        callout::failed(vm, flight, LimiterError::NoAnswer);
    }
    let side = vm.borrow_mut().side.overdue(now);
    for (kind, pending) in side {
        callout::side_answered(vm, kind, pending, Reply::none());
    }
}
