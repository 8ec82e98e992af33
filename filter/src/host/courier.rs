//! Shared callouts between the workers of one Envoy, host side: the courier's name in shared
//! data, each worker's wake queue, and the messages posted between them (their format and who
//! sends: [`crate::flow::courier`]; how the courier is named and replaced:
//! docs/fast-paths.md#coalesced-callouts).

use std::collections::BTreeMap;

use log::{debug, warn};
use proxy_wasm::hostcalls;
use ratelimit_wire::RequestAnswer;

use super::{abi, answered_under, now_ns, resolve, stats, SharedVm};
use crate::config::Config;
use crate::flow::courier::{self, Answers, Forward, Sender};
use crate::flow::{Stat, Stats};
use crate::verdict::LimiterError;

/// What a worker needs to share callouts.
pub struct Sharing {
    /// This plugin's VM id: queues are resolved by it.
    vm_id: String,
    /// The shared-data key naming the courier.
    key: String,
}

impl Sharing {
    /// Shares callouts from this worker (`nonce`) on: it names itself the courier (the worker
    /// configured last is, until one takes over). `None` without the VM id or shared data: each
    /// worker then sends its own.
    pub fn start(config: &Config, nonce: u64) -> Option<Sharing> {
        let vm_id = abi::property(&["plugin_vm_id"]).and_then(|b| String::from_utf8(b).ok());
        let key = courier::key(&config.stat_prefix, &config.domain);
        match vm_id {
            Some(vm_id) if abi::set_shared_data(&key, &nonce.to_le_bytes(), None).is_ok() => {
                Some(Sharing { vm_id, key })
            }
            _ => {
                warn!("ratelimit filter: cannot share callouts (no VM id or shared data): each worker sends its own");
                None
            }
        }
    }
}

/// Registers the wake queue of the worker with this nonce (its name is unique, so a wake-up
/// reaches this worker).
pub fn register_wake_queue(nonce: u64) -> Result<u32, u32> {
    abi::register_shared_queue(&courier::queue_name(nonce))
}

/// When another worker is the courier, forwards the queue to it (one forward out at a time, as
/// one callout of its own would be): true then. False when this worker sends its queue itself;
/// a worker that finds no courier named, or the courier's queue gone, takes its place.
pub fn forward_queue(vm: &SharedVm) -> bool {
    let (this, carries_others, key) = {
        let v = vm.borrow();
        let Some(sharing) = &v.sharing else {
            return false;
        };
        (v.nonce, v.queue.carries_others(), sharing.key.clone())
    };
    let named = || {
        abi::get_shared_data(&key)
            .0
            .as_deref()
            .and_then(courier::decode_nonce)
    };
    match courier::sender(this, carries_others, named) {
        Sender::ThisWorker => false,
        Sender::TakeOver => {
            take_over(vm);
            false
        }
        Sender::Courier(c) => {
            if forward(vm, c) {
                return true;
            }
            // The courier's queue is gone (its VM was replaced).
            take_over(vm);
            false
        }
    }
}

/// Names this worker the courier (the last to write is).
pub fn take_over(vm: &SharedVm) {
    let v = vm.borrow();
    if let Some(sharing) = &v.sharing {
        if let Err(status) = abi::set_shared_data(&sharing.key, &v.nonce.to_le_bytes(), None) {
            warn!("ratelimit filter: cannot name this worker the courier: status {status}");
        }
    }
}

/// Posts the queue to the courier's wake queue. False when that queue cannot be reached (the
/// queue is left as it was then).
fn forward(vm: &SharedVm, courier_nonce: u64) -> bool {
    let mut v = vm.borrow_mut();
    let plugin = v.plugin.clone();
    let origin = v.nonce;
    let Some(vm_id) = v.sharing.as_ref().map(|s| s.vm_id.clone()) else {
        return false;
    };
    let Some((contexts, forward)) = v.queue.next_forward(&plugin.config, origin) else {
        return true;
    };
    let posted = match hostcalls::resolve_shared_queue(&vm_id, &courier::queue_name(courier_nonce))
    {
        Ok(Some(queue)) => {
            let message = courier::encode(courier::FORWARD, &forward);
            abi::enqueue_shared_queue(queue, &message).is_ok()
        }
        _ => false,
    };
    if !posted {
        v.queue.unforward(contexts);
        return false;
    }
    plugin.metrics.add(Stat::Forwarded, contexts.len() as u64);
    v.queue.forwarded(contexts, now_ns());
    true
}

/// Posts the answers to other workers' requests a callout carried back to their workers:
/// `answer` gives the one of the `j`-th of `carried` (worker nonce, context). A worker whose
/// queue is gone has nothing to answer.
pub fn answer_carried(
    vm: &SharedVm,
    carried: &[(u64, u32)],
    epoch: Option<u64>,
    answer: impl Fn(usize) -> Result<RequestAnswer, LimiterError>,
) {
    if carried.is_empty() {
        return;
    }
    let Some(vm_id) = vm.borrow().sharing.as_ref().map(|s| s.vm_id.clone()) else {
        return;
    };
    let mut by_origin: BTreeMap<u64, Vec<courier::Answer>> = BTreeMap::new();
    for (j, (origin, ctx)) in carried.iter().enumerate() {
        by_origin
            .entry(*origin)
            .or_default()
            .push((*ctx, answer(j)));
    }
    for (origin, answers) in by_origin {
        let message = courier::encode(courier::ANSWERS, &Answers { answers, epoch });
        match hostcalls::resolve_shared_queue(&vm_id, &courier::queue_name(origin)) {
            Ok(Some(q)) => {
                if let Err(status) = abi::enqueue_shared_queue(q, &message) {
                    debug!("ratelimit filter: cannot answer worker {origin:016x}: status {status}");
                }
            }
            _ => debug!("ratelimit filter: worker {origin:016x} is gone: its answers dropped"),
        }
    }
}

/// Reads this worker's wake queue: other workers' requests to carry (as the courier), the
/// courier's answers to this worker's forwarded requests, wake-ups (the caller then sends what
/// waits).
pub fn receive(vm: &SharedVm, queue_id: u32) {
    while let Ok(Some(message)) = abi::dequeue_shared_queue(queue_id) {
        match message.split_first() {
            Some((&courier::FORWARD, body)) => match serde_json::from_slice::<Forward>(body) {
                Ok(forward) => vm.borrow_mut().queue.carry(forward),
                Err(e) => warn!("ratelimit filter: a malformed forward from a worker: {e}"),
            },
            Some((&courier::ANSWERS, body)) => match serde_json::from_slice::<Answers>(body) {
                Ok(a) => {
                    let now = now_ns();
                    answered_under(vm, a.epoch);
                    stats::counting(|| {
                        for (ctx, answer) in a.answers {
                            let sent = vm.borrow_mut().queue.forward_answered(ctx);
                            if let Some(sent_ns) = sent {
                                resolve(vm, ctx, answer, a.epoch, sent_ns, now, true);
                            }
                        }
                    })
                }
                Err(e) => warn!("ratelimit filter: malformed answers from the courier: {e}"),
            },
            // A wake-up.
            _ => {}
        }
    }
    let root = vm.borrow().root_id;
    let _ = abi::set_effective_context(root);
    vm.borrow_mut().queue.woken();
}
