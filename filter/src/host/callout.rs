//! Calls to the sidecar: as messages on the worker's stream ([`super::link`], the default
//! `sidecar.transport`) or as HTTP callouts. With coalescing, the ROOT context sends the queue's
//! batches ([`send_queued`]) while fewer than `max_in_flight` are out, and answers each request of
//! a batch
//! by switching Envoy's effective context to it (`proxy_set_effective_context`), then back. The
//! root owns the callouts (Envoy does not cancel them when one client goes away); an HTTP context
//! cannot make it send directly (the SDK ties a callout to the context it is dispatched from),
//! so it wakes the root through the worker's own wake queue (`on_queue_ready` runs on the same
//! worker, right after the current event). Without coalescing a request sends its own callout, a
//! batch of one ([`send_alone`]). Either way the body comes from the one builder of
//! [`crate::flow::batch`] and each answer is settled by [`super::settle`]. Settlements, slot
//! renewals and releases and the epoch poll go the same way as calls of their own kinds
//! ([`send_side`], answered by [`side_answered`]).

use std::time::Duration;

use log::{debug, error};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType};
use ratelimit_wire::DecideResponse;

use super::{abi, answered_under, courier, link, now_ns, resolve, stats, Plugin, SharedVm};
use crate::config::Transport;
use crate::flow::batch::Flight;
use crate::flow::courier::WAKE;
use crate::flow::link::Pending;
use crate::flow::{Stat, Stats, Waiting};
use crate::verdict::{self, LimiterError, MAX_ANSWER_BYTES};
use ratelimit_wire::stream::Kind;

/// Queues a waiting request for the next coalesced callout, waking the root if it must send.
pub fn enqueue(vm: &SharedVm, ctx: u32, w: Waiting) {
    let wake = {
        let mut v = vm.borrow_mut();
        let max_in_flight = v.plugin.config.fast_paths.max_in_flight;
        let wake = v.queue.enqueue(ctx, w, max_in_flight);
        wake.then_some(v.wake_queue).flatten()
    };
    if let Some(q) = wake {
        if let Err(status) = abi::enqueue_shared_queue(q, WAKE) {
            error!("ratelimit filter: cannot wake the root: status {status}");
            vm.borrow_mut().queue.woken();
        }
    }
}

/// Sends the queue as callouts while fewer than `max_in_flight` are out, from the root context
/// (its callbacks), so the callouts are the root's. When callouts are shared and another worker
/// is the courier, the queue goes to the courier instead.
pub fn send_queued(vm: &SharedVm) {
    send_settlements(vm);
    if courier::forward_queue(vm) {
        return;
    }
    loop {
        let now = now_ns();
        let (plugin, mut batch) = {
            let mut v = vm.borrow_mut();
            let plugin = v.plugin.clone();
            let Some(batch) = v.queue.next_batch(&plugin.config, now) else {
                return;
            };
            (plugin, batch)
        };
        let dispatched = match plugin.config.sidecar.transport {
            Transport::Http => dispatch(
                &plugin,
                "POST",
                plugin.config.sidecar.path(),
                Some(&batch.body),
                batch.timeout_ms,
            ),
            Transport::Stream => link::send(vm, Kind::Decide, std::mem::take(&mut batch.body), now),
        };
        let carried = (batch.own.len() + batch.carried.len()) as u64;
        plugin
            .metrics
            .record(plugin.metrics.batch_requests, carried);
        match dispatched {
            Ok(token) => {
                plugin.metrics.count(Stat::Callouts);
                vm.borrow_mut().queue.dispatched(token, batch, now_ns());
            }
            Err(e) => {
                let now = now_ns();
                for &ctx in &batch.own {
                    resolve(vm, ctx, Err(e.clone()), None, now, now, true);
                }
                courier::answer_carried(vm, &batch.carried, None, |_| Err(e.clone()));
                let root = vm.borrow().root_id;
                let _ = abi::set_effective_context(root);
                return;
            }
        }
    }
}

/// Sends a request's own callout (without coalescing) from its context, at `now`: when it was
/// sent, or why it could not be (the request then waits in the queue, to be settled).
pub fn send_alone(vm: &SharedVm, ctx: u32, w: Waiting, now: u64) -> Result<u64, LimiterError> {
    let (plugin, batch) = {
        let mut v = vm.borrow_mut();
        let plugin = v.plugin.clone();
        let batch = v.queue.alone(ctx, w, &plugin.config, now);
        (plugin, batch)
    };
    dispatch(
        &plugin,
        "POST",
        plugin.config.sidecar.path(),
        Some(&batch.body),
        batch.timeout_ms,
    )?;
    plugin.metrics.count(Stat::Callouts);
    Ok(now_ns())
}

/// The answer to the root's callout `token`: settles the worker's requests it carried, posts
/// the other workers' answers back to them, and sends what queued meanwhile.
pub fn answered(vm: &SharedVm, token: u32, num_headers: usize, body_size: usize) {
    landed(vm, token, |expected| {
        read_answer(num_headers, body_size, expected)
    });
}

/// The answer to the call `token` (a callout, or a call on the stream per worker), read by
/// `read` for the number of requests it carried, if the call is still awaited.
pub fn landed(
    vm: &SharedVm,
    token: u32,
    read: impl FnOnce(usize) -> Result<DecideResponse, LimiterError>,
) {
    let Some(flight) = vm.borrow_mut().queue.landed(token) else {
        return;
    };
    settle_flight(vm, flight, read);
}

/// A call in flight that will get no answer (its stream closed, or its deadline passed): its
/// requests' failure policies.
pub fn failed(vm: &SharedVm, flight: Flight, e: LimiterError) {
    settle_flight(vm, flight, |_| Err(e));
}

/// Settles the requests `flight` carried by the answer `read` gives, then sends what queued
/// meanwhile.
fn settle_flight(
    vm: &SharedVm,
    flight: Flight,
    read: impl FnOnce(usize) -> Result<DecideResponse, LimiterError>,
) {
    let plugin = vm.borrow().plugin.clone();
    let now = now_ns();
    plugin.metrics.record(
        plugin.metrics.decision_us,
        now.saturating_sub(flight.dispatched_ns) / 1_000,
    );
    let own = flight.own.len();
    let answers = read(own + flight.carried.len());
    let answer = |i: usize| match &answers {
        Ok(a) => Ok(a.answers[i].clone()),
        Err(e) => Err(e.clone()),
    };
    let epoch = answers.as_ref().ok().and_then(|a| a.epoch);
    answered_under(vm, epoch);
    stats::counting(|| {
        for (i, &ctx) in flight.own.iter().enumerate() {
            resolve(vm, ctx, answer(i), epoch, flight.dispatched_ns, now, true);
        }
    });
    courier::answer_carried(vm, &flight.carried, epoch, |j| answer(own + j));
    let root = vm.borrow().root_id;
    let _ = abi::set_effective_context(root);
    send_queued(vm);
}

/// The answer to a request's own callout (sent at `sent_ns`), in its context.
pub fn answered_alone(vm: &SharedVm, ctx: u32, sent_ns: u64, num_headers: usize, body_size: usize) {
    let plugin = vm.borrow().plugin.clone();
    let now = now_ns();
    plugin.metrics.record(
        plugin.metrics.decision_us,
        now.saturating_sub(sent_ns) / 1_000,
    );
    let answer = read_answer(num_headers, body_size, 1);
    let epoch = answer.as_ref().ok().and_then(|a| a.epoch);
    answered_under(vm, epoch);
    let answer = answer.map(|mut a| a.answers.remove(0));
    resolve(vm, ctx, answer, epoch, sent_ns, now, false);
}

/// What a call besides the decisions got back: the HTTP status (none: no answer, a timeout, a
/// reset, a stream closed) and the body.
pub struct Reply {
    pub status: Option<Vec<u8>>,
    pub body: Vec<u8>,
}

impl Reply {
    /// No answer.
    pub fn none() -> Reply {
        Reply {
            status: None,
            body: Vec::new(),
        }
    }

    /// A callout's answer, its body read up to `max_body` bytes.
    pub fn of_callout(num_headers: usize, body_size: usize, max_body: usize) -> Reply {
        let status = call_status(num_headers);
        let body = if body_size == 0 || body_size > max_body {
            Vec::new()
        } else {
            abi::buffer(BufferType::HttpCallResponseBody, body_size).unwrap_or_default()
        };
        Reply { status, body }
    }
}

/// The most bytes read of an epoch poll's answer.
pub const MAX_EPOCH_ANSWER_BYTES: usize = 256;

/// Sends a call of `kind` besides the decisions (`method` and `path` as a callout), with
/// `timeout_ms`, from the root context at `now`, on the worker's transport.
fn send_side(
    vm: &SharedVm,
    plugin: &Plugin,
    kind: Kind,
    (method, path): (&str, &str),
    body: Vec<u8>,
    timeout_ms: u64,
    now: u64,
) -> Result<(), LimiterError> {
    let (token, on_stream) = match plugin.config.sidecar.transport {
        Transport::Http => {
            let body = (method == "POST").then_some(body.as_slice());
            (dispatch(plugin, method, path, body, timeout_ms)?, false)
        }
        Transport::Stream => (link::send(vm, kind, body, now)?, true),
    };
    vm.borrow_mut().side.sent(
        kind,
        Pending {
            token,
            on_stream,
            sent_ns: now,
            deadline_ns: now.saturating_add(timeout_ms.saturating_mul(1_000_000)),
        },
    );
    Ok(())
}

/// The answer to a call besides the decisions, of `kind`, sent as `pending`.
pub fn side_answered(vm: &SharedVm, kind: Kind, pending: Pending, reply: Reply) {
    match kind {
        Kind::Settle => settlements_answered(vm, reply),
        Kind::Slots => slots_answered(vm, reply),
        Kind::Epoch => epoch_polled(vm, pending.sent_ns, reply),
        Kind::Decide => {}
    }
}

/// Sends this Envoy's policy epoch poll (`GET /v1/epoch`) from the root context, at `now`
/// ([`crate::epoch`]); a poll that cannot be sent counts as one without an answer.
pub fn poll_epoch(vm: &SharedVm, now: u64) {
    let plugin = vm.borrow().plugin.clone();
    let path = ("GET", ratelimit_wire::EPOCH_PATH);
    let timeout_ms = plugin.config.sidecar.timeout_ms;
    if let Err(e) = send_side(vm, &plugin, Kind::Epoch, path, Vec::new(), timeout_ms, now) {
        debug!("ratelimit filter: cannot send the policy epoch poll: {e}");
        plugin.flow().polled(&mut vm.borrow_mut().worker, None, now);
    }
}

/// The answer to this worker's policy epoch poll, sent at `sent_ns`: published.
fn epoch_polled(vm: &SharedVm, sent_ns: u64, reply: Reply) {
    let epoch = crate::epoch::parse(reply.status.as_deref(), &reply.body);
    let plugin = vm.borrow().plugin.clone();
    plugin
        .flow()
        .polled(&mut vm.borrow_mut().worker, epoch, sent_ns);
}

/// Sends the next batch of settlements (`POST /v1/settle`) from the root context, if one is
/// due and none is in flight ([`crate::costs::Outbox`]).
pub fn send_settlements(vm: &SharedVm) {
    let (plugin, body) = {
        let mut v = vm.borrow_mut();
        if v.side.out(Kind::Settle) {
            return;
        }
        let plugin = v.plugin.clone();
        let Some(body) = v.streams.outbox.next_call(&plugin.config.domain) else {
            return;
        };
        (plugin, body)
    };
    let timeout_ms = plugin
        .config
        .sidecar
        .timeout_ms
        .max(crate::costs::SEND_TIMEOUT_MS);
    let path = ("POST", ratelimit_wire::SETTLE_PATH);
    if let Err(e) = send_side(vm, &plugin, Kind::Settle, path, body, timeout_ms, now_ns()) {
        debug!("ratelimit filter: cannot send settlements: {e}");
        let d = vm.borrow_mut().streams.outbox.answered(false);
        plugin.flow().count_delivery(d);
    }
}

/// The answer to the settlements' call: delivered on a 200, else sent again (bounded); then the
/// next batch.
fn settlements_answered(vm: &SharedVm, reply: Reply) {
    let plugin = vm.borrow().plugin.clone();
    let d = vm
        .borrow_mut()
        .streams
        .outbox
        .answered(reply.status.as_deref() == Some(b"200"));
    plugin.flow().count_delivery(d);
    send_settlements(vm);
}

/// Sends the concurrency slots' renewals that are due and the releases waiting, from the root
/// (one call in flight per worker; docs/concurrency.md).
pub fn send_slots(vm: &SharedVm, now: u64) {
    let (plugin, body) = {
        let mut v = vm.borrow_mut();
        if v.side.out(Kind::Slots) {
            return;
        }
        let plugin = v.plugin.clone();
        let Some(body) = v.streams.slots.next_call(&plugin.config.domain, now) else {
            return;
        };
        (plugin, body)
    };
    let timeout_ms = plugin.config.sidecar.timeout_ms;
    let path = ("POST", ratelimit_wire::SLOTS_PATH);
    if let Err(e) = send_side(vm, &plugin, Kind::Slots, path, body, timeout_ms, now) {
        debug!("ratelimit filter: cannot send slot renewals and releases: {e}");
        let d = vm.borrow_mut().streams.slots.answered(None);
        plugin.flow().count_slots(d);
    }
}

/// The answer to the slots' call: applied on a 200 (its counts read), else its releases are sent
/// again (bounded); then the next call.
fn slots_answered(vm: &SharedVm, reply: Reply) {
    let answer = (reply.status.as_deref() == Some(b"200"))
        .then(|| serde_json::from_slice::<ratelimit_wire::SlotsResponse>(&reply.body).ok())
        .flatten();
    let plugin = vm.borrow().plugin.clone();
    let d = vm.borrow_mut().streams.slots.answered(answer);
    plugin.flow().count_slots(d);
    send_slots(vm, now_ns());
}

/// Sends a callout to `path` from the current context.
fn dispatch(
    plugin: &Plugin,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    timeout_ms: u64,
) -> Result<u32, LimiterError> {
    let sidecar = &plugin.config.sidecar;
    let mut headers = vec![
        (":method", method),
        (":path", path),
        (":authority", sidecar.authority()),
    ];
    if body.is_some() {
        headers.push(("content-type", "application/json"));
    }
    if let Some(a) = &plugin.authorization {
        headers.push(("authorization", a.as_str()));
    }
    hostcalls::dispatch_http_call(
        &sidecar.cluster,
        headers,
        body,
        vec![],
        Duration::from_millis(timeout_ms),
    )
    .map_err(|status| {
        LimiterError::Dispatch(format!(
            "{status:?} (is cluster {:?} defined?)",
            sidecar.cluster
        ))
    })
}

/// The sidecar's answer to a callout of `expected` requests, read from the host.
fn read_answer(
    num_headers: usize,
    body_size: usize,
    expected: usize,
) -> Result<DecideResponse, LimiterError> {
    let status = call_status(num_headers);
    let body = if body_size == 0 || body_size > MAX_ANSWER_BYTES {
        Vec::new()
    } else {
        abi::buffer(BufferType::HttpCallResponseBody, body_size).unwrap_or_default()
    };
    verdict::parse_answer(status.as_deref(), &body, expected)
}

/// The `:status` of a callout's answer; none for a failed callout (timeout, reset, no healthy
/// host), which comes with no headers at all.
fn call_status(num_headers: usize) -> Option<Vec<u8>> {
    if num_headers == 0 {
        None
    } else {
        abi::header_map_value(MapType::HttpCallResponseHeaders, ":status")
    }
}
