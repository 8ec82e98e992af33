//! Calls to the sidecar, as messages on the worker's stream ([`super::link`]). The ROOT context
//! sends the queue's batches ([`send_queued`]) while as many as `fast_paths` allows are out
//! ([`crate::flow::batch::limits`]), and answers each request of a batch by switching Envoy's
//! effective context to it (`proxy_set_effective_context`), then back. The root owns the stream
//! (Envoy answers a stream to the context that opened it), so an HTTP context wakes the root
//! through the worker's own wake queue (`on_queue_ready` runs on the same worker, right after the
//! current event). Each batch's body comes from the one builder of [`crate::flow::batch`].
//! Settlements, slot renewals and releases and the epoch poll go the same way as calls of their
//! own kinds ([`send_side`], answered by [`side_answered`]).

use log::{debug, error};
use ratelimit_wire::stream::Kind;
use ratelimit_wire::DecideResponse;

use super::{abi, answered_under, link, now_ns, resolve, stats, SharedVm};
use crate::flow::batch::{self, Flight};
use crate::flow::link::Pending;
use crate::flow::{Stat, Stats, Waiting};
use crate::verdict::LimiterError;

/// A bare wake-up of a worker's root context.
const WAKE: &[u8] = b"w";

/// Registers the wake queue of the worker with this nonce (its name is unique, so a wake-up
/// reaches this worker).
pub fn register_wake_queue(nonce: u64) -> Result<u32, u32> {
    abi::register_shared_queue(&format!("ratelimit.wake.{nonce:016x}"))
}

/// Reads this worker's wake queue (wake-ups only) and sends what waits.
pub fn woken(vm: &SharedVm, queue_id: u32) {
    while let Ok(Some(_)) = abi::dequeue_shared_queue(queue_id) {}
    vm.borrow_mut().queue.woken();
    send_queued(vm);
}

/// Queues a waiting request for the next call, waking the root if it must send.
pub fn enqueue(vm: &SharedVm, ctx: u32, w: Waiting) {
    let wake = {
        let mut v = vm.borrow_mut();
        let (_, max_in_flight) = batch::limits(&v.plugin.config);
        let wake = v.queue.enqueue(ctx, w, max_in_flight);
        wake.then_some(v.wake_queue)
    };
    if let Some(q) = wake {
        if let Err(status) = abi::enqueue_shared_queue(q, WAKE) {
            error!("ratelimit filter: cannot wake the root: status {status}");
            vm.borrow_mut().queue.woken();
        }
    }
}

/// Sends the queue's batches while there is room for them, from the root context (its
/// callbacks), so the calls are the root's.
pub fn send_queued(vm: &SharedVm) {
    send_settlements(vm);
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
        let sent = link::send(vm, Kind::Decide, std::mem::take(&mut batch.body), now);
        plugin
            .metrics
            .record(plugin.metrics.batch_requests, batch.requests.len() as u64);
        match sent {
            Ok(id) => {
                plugin.metrics.count(Stat::Callouts);
                vm.borrow_mut().queue.dispatched(id, batch, now_ns());
            }
            Err(e) => {
                let now = now_ns();
                for &ctx in &batch.requests {
                    resolve(vm, ctx, Err(e.clone()), None, now, now, true);
                }
                let root = vm.borrow().root_id;
                let _ = abi::set_effective_context(root);
                return;
            }
        }
    }
}

/// The answer to the call `token`, read by `read` for the number of requests it carried, if the
/// call is still awaited.
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
    let answers = read(flight.requests.len());
    let answer = |i: usize| match &answers {
        Ok(a) => Ok(a.answers[i].clone()),
        Err(e) => Err(e.clone()),
    };
    let epoch = answers.as_ref().ok().and_then(|a| a.epoch);
    answered_under(vm, epoch);
    stats::counting(|| {
        for (i, &ctx) in flight.requests.iter().enumerate() {
            resolve(vm, ctx, answer(i), epoch, flight.dispatched_ns, now, true);
        }
    });
    let root = vm.borrow().root_id;
    let _ = abi::set_effective_context(root);
    send_queued(vm);
}

/// What a call besides the decisions got back: the HTTP status its answer stands for (none: no
/// answer by its deadline, or the stream closed) and the body.
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
}

/// Sends a call of `kind` besides the decisions, with `timeout_ms`, from the root context at
/// `now`.
fn send_side(
    vm: &SharedVm,
    kind: Kind,
    body: Vec<u8>,
    timeout_ms: u64,
    now: u64,
) -> Result<(), LimiterError> {
    let token = link::send(vm, kind, body, now)?;
    vm.borrow_mut().side.sent(
        kind,
        Pending {
            token,
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

/// Sends this Envoy's policy epoch poll (a call of kind `Epoch`) from the root context, at `now`
/// ([`crate::epoch`]); a poll that cannot be sent counts as one without an answer.
pub fn poll_epoch(vm: &SharedVm, now: u64) {
    let plugin = vm.borrow().plugin.clone();
    let timeout_ms = plugin.config.sidecar.timeout_ms;
    if let Err(e) = send_side(vm, Kind::Epoch, Vec::new(), timeout_ms, now) {
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

/// Sends the next batch of settlements (a call of kind `Settle`) from the root context, if one is
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
    if let Err(e) = send_side(vm, Kind::Settle, body, timeout_ms, now_ns()) {
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
    if let Err(e) = send_side(vm, Kind::Slots, body, timeout_ms, now) {
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
