//! The proxy-wasm host adapter: reads what the pure core needs from Envoy (configuration,
//! headers, properties, shared data, the sidecar's answers) and carries its verdicts out (resume,
//! local reply, response headers, stats). Nothing here decides anything.
//!
//! # Coalesced callouts
//! Each worker VM has one [`Vm`] state, shared by its root context and its HTTP contexts. A request
//! that needs the sidecar joins the VM's queue; the ROOT context sends the queue as one callout
//! when fewer than `max_in_flight` callouts are in flight, so the batch is whatever queued while
//! the previous callout was out (no timer: an idle worker sends at once). The root owns the
//! callouts (Envoy does not cancel them when one client goes away), and answers each request by
//! switching Envoy's effective context to it (`proxy_set_effective_context`), resuming it or
//! sending its local reply, then back. An HTTP context cannot make the root send directly (the SDK
//! ties a callout to the context it is dispatched from), so it wakes the root through a shared
//! queue of its own VM (`on_queue_ready` runs on the same worker, right after the current event).
//! Each request keeps its own deadline: a callout's timeout is the earliest deadline of its batch,
//! and a tick fails requests whose deadline passes while they wait in the queue.
//!
//! Host calls go through [`abi`], whose wrappers never panic.
//!
//! No `RefCell` borrow of the [`Vm`] is held across a host call that can call back into the VM
//! (a local reply, a resume): those run with the state taken out.

use std::cell::RefCell;
use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::BuildHasher;
use std::rc::Rc;
use std::time::Duration;

use log::{debug, error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};
use ratelimit_wire::{
    DecideRequest, Decision, LeaseAsk, LeaseReturn, Reason, RequestAnswer, RequestDecisions,
    MAX_CALL_DECISIONS, MAX_LEASE_ID, MAX_RETURNS,
};

use crate::config::{Config, FastPaths};
use crate::courier;
use crate::emergency::{self, EmergencyBucket};
use crate::fastpath::{
    self, DecisionOutcome, Hotness, KnownLimit, Learned, LeaseStart, Probe, RejectionCause, Table,
};
use crate::identity::{self, Facts, ROUTE_NAME_PROPERTY, SOURCE_ADDRESS_PROPERTY};
use crate::rules::{self, Planned, RequestFacts};
use crate::shared::{SharedDataError, SharedStore};
use crate::verdict::{
    self, FailurePlan, LeasedAdmit, LimiterError, LocalReply, Verdict, MAX_ANSWER_BYTES,
};
use stats::{add, count, counting, Metrics};

mod abi;
mod stats;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(Root { id: context_id, vm: None })
    });
}}

/// The validated configuration and what is derived from it once.
struct Plugin {
    config: Config,
    metrics: Metrics,
    /// Request headers some rule's `match.headers` reads.
    header_names: Vec<String>,
    /// `authorization` header value for the callouts, if a token is configured.
    authorization: Option<String>,
    /// Some rule matches on the method ([`Config::matches_methods`]).
    reads_method: bool,
}

/// A request waiting for the sidecar.
struct Waiting {
    /// Every applicable decision of the request.
    planned: Vec<Planned>,
    /// Which of them go to the sidecar (indices into `planned`), in order.
    remote: Vec<usize>,
    /// Per remote decision: the fast-path table held no entry of its bucket when the request
    /// came (an admission then has nothing to learn there).
    absent: Vec<bool>,
    /// The lease asks of the remote decisions (same order).
    asks: Vec<Option<LeaseAsk>>,
    /// Per remote decision: it asks for the next lease although the one in use could pay it
    /// (an early renewal); if the sidecar cannot answer, the lease still pays it.
    renewals: Vec<bool>,
    /// Decisions admitted from leases: (index into `planned`, lease id), to give back if the
    /// request is rejected.
    taken: Vec<(usize, u64)>,
    /// Lease leftovers to give back with the callout.
    returns: Vec<LeaseReturn>,
    deadline_ns: u64,
}

/// One callout in flight: the requests it carries, and when it was sent.
struct Flight {
    contexts: Vec<u32>,
    /// Requests of other workers it carries (their worker's nonce, their context), after
    /// `contexts` in the call.
    foreign: Vec<(u64, u32)>,
    dispatched_ns: u64,
}

/// A request of another worker, waiting in the courier for a callout.
struct Foreign {
    origin: u64,
    request: courier::Forwarded,
}

/// A worker VM's shared state.
struct Vm {
    plugin: Rc<Plugin>,
    root_id: u32,
    queue_id: Option<u32>,
    waiting: HashMap<u32, Waiting>,
    queue: VecDeque<u32>,
    flights: HashMap<u32, Flight>,
    /// A wake-up of the root is on its way.
    wake_pending: bool,
    hotness: Hotness,
    nonce: u64,
    /// Shared callouts: this plugin's VM id (queues are resolved by it) and the shared-data key
    /// naming the courier; `None` when callouts are not shared.
    sharing: Option<(String, String)>,
    /// As the courier: other workers' requests waiting for a callout.
    foreign: VecDeque<Foreign>,
    /// Requests this worker forwarded to the courier, with when they were sent; at most one
    /// forward is out at a time (as one callout of its own would be).
    forwarded: HashMap<u32, u64>,
    lease_counter: u64,
    /// Headers to add to the upstream's response, by context.
    response_headers: HashMap<u32, Vec<(String, String)>>,
}

impl Vm {
    fn lease_id(&mut self) -> u64 {
        self.lease_counter = self.lease_counter.wrapping_add(1);
        // splitmix64 of (nonce + counter): distinct per VM and per ask, below 2^53, never 0.
        let mut z = self
            .nonce
            .wrapping_add(self.lease_counter.wrapping_mul(0x9e3779b97f4a7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^= z >> 31;
        (z & MAX_LEASE_ID).max(1)
    }
}

type SharedVm = Rc<RefCell<Vm>>;

struct Root {
    id: u32,
    vm: Option<SharedVm>,
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some(vm) = self.vm.clone() else {
            return;
        };
        let flight = vm.borrow_mut().flights.remove(&token_id);
        let Some(flight) = flight else {
            return;
        };
        let plugin = vm.borrow().plugin.clone();
        let now = now_ns();
        let _ = abi::record_metric(
            plugin.metrics.decision_us,
            now.saturating_sub(flight.dispatched_ns) / 1_000,
        );
        let own = flight.contexts.len();
        let answers = read_answer(num_headers, body_size, own + flight.foreign.len());
        counting(|| {
            for (i, ctx) in flight.contexts.iter().enumerate() {
                let answer = match &answers {
                    Ok(a) => Ok(a.answers[i].clone()),
                    Err(e) => Err(e.clone()),
                };
                settle_waiting(&vm, *ctx, answer, flight.dispatched_ns, true);
            }
        });
        answer_foreign(&vm, &flight.foreign, |j| match &answers {
            Ok(a) => Ok(a.answers[own + j].clone()),
            Err(e) => Err(e.clone()),
        });
        let _ = abi::set_effective_context(self.id);
        pump(&vm);
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let bytes = abi::buffer(BufferType::PluginConfiguration, usize::MAX).unwrap_or_default();
        let config = match Config::from_json(&bytes) {
            Ok(config) => config,
            Err(e) => {
                error!("ratelimit filter: invalid configuration: {e}");
                return false;
            }
        };
        let authorization = match (&config.sidecar.token, &config.sidecar.token_env) {
            (Some(t), _) => Some(format!("Bearer {t}")),
            (None, Some(var)) => match std::env::var(var) {
                Ok(t) if !t.is_empty() && t.bytes().all(|b| b.is_ascii_graphic()) => {
                    Some(format!("Bearer {t}"))
                }
                _ => {
                    error!(
                        "ratelimit filter: invalid configuration: sidecar.token_env: the environment variable {var:?} is not set (or not printable ASCII) in the VM; expose it with vm_config.environment_variables"
                    );
                    return false;
                }
            },
            (None, None) => None,
        };
        let metrics = match Metrics::define(&config) {
            Ok(m) => m,
            Err(status) => {
                error!("ratelimit filter: cannot define stats: status {status}");
                return false;
            }
        };
        let now = now_ns();
        for rule in &config.rules {
            if let Some(e) = &rule.emergency {
                emergency::ensure_initialized(
                    &HostShared,
                    &emergency::shared_key(&rule.name),
                    &EmergencyBucket::from(e),
                    now,
                );
            }
        }
        let nonce = RandomState::new().hash_one(now);
        let mut queue_id = None;
        let mut sharing = None;
        if config.fast_paths.coalesce {
            // A queue of this VM's own (the name is unique), so a wake-up reaches this worker.
            match abi::register_shared_queue(&courier::queue_name(nonce)) {
                Ok(id) => queue_id = Some(id),
                Err(status) => {
                    error!("ratelimit filter: cannot register the wake-up queue: status {status}");
                    return false;
                }
            }
            if config.fast_paths.share_callouts {
                // The worker configured last is the courier (until one takes over).
                let vm_id =
                    abi::property(&["plugin_vm_id"]).and_then(|b| String::from_utf8(b).ok());
                let key = courier::key(&config.stat_prefix, &config.domain);
                match vm_id {
                    Some(vm_id) if abi::set_shared_data(&key, &nonce.to_le_bytes(), None).is_ok() => {
                        sharing = Some((vm_id, key));
                    }
                    _ => warn!("ratelimit filter: cannot share callouts (no VM id or shared data): each worker sends its own"),
                }
            }
            let tick_ms = (config.sidecar.timeout_ms / 2).clamp(1, 50);
            let _ = hostcalls::set_tick_period(Duration::from_millis(tick_ms));
        }
        let header_names = config.matched_header_names().into_iter().collect();
        info!(
            "ratelimit filter: configured {} rules in domain {:?}, sidecar cluster {:?}, timeout {} ms, coalescing {}",
            config.rules.len(),
            config.domain,
            config.sidecar.cluster,
            config.sidecar.timeout_ms,
            config.fast_paths.coalesce
        );
        let plugin = Rc::new(Plugin {
            reads_method: config.matches_methods(),
            config,
            metrics,
            header_names,
            authorization,
        });
        self.vm = Some(Rc::new(RefCell::new(Vm {
            plugin,
            root_id: self.id,
            queue_id,
            waiting: HashMap::new(),
            queue: VecDeque::new(),
            flights: HashMap::new(),
            wake_pending: false,
            hotness: Hotness::default(),
            nonce,
            sharing,
            foreign: VecDeque::new(),
            forwarded: HashMap::new(),
            lease_counter: 0,
            response_headers: HashMap::new(),
        })));
        true
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(vm) = self.vm.clone() else {
            while let Ok(Some(_)) = abi::dequeue_shared_queue(queue_id) {}
            return;
        };
        while let Ok(Some(message)) = abi::dequeue_shared_queue(queue_id) {
            match message.split_first() {
                Some((&courier::FORWARD, body)) => {
                    match serde_json::from_slice::<courier::Forward>(body) {
                        Ok(f) => {
                            let mut v = vm.borrow_mut();
                            for request in f.requests {
                                v.foreign.push_back(Foreign {
                                    origin: f.origin,
                                    request,
                                });
                            }
                        }
                        Err(e) => warn!("ratelimit filter: a malformed forward from a worker: {e}"),
                    }
                }
                Some((&courier::ANSWERS, body)) => {
                    match serde_json::from_slice::<courier::Answers>(body) {
                        Ok(a) => counting(|| {
                            for (ctx, answer) in a.answers {
                                let sent = vm.borrow_mut().forwarded.remove(&ctx);
                                if let Some(sent_ns) = sent {
                                    settle_waiting(&vm, ctx, answer, sent_ns, true);
                                }
                            }
                        }),
                        Err(e) => {
                            warn!("ratelimit filter: malformed answers from the courier: {e}")
                        }
                    }
                }
                // A wake-up.
                _ => {}
            }
        }
        let _ = abi::set_effective_context(self.id);
        vm.borrow_mut().wake_pending = false;
        pump(&vm);
    }

    fn on_tick(&mut self) {
        let Some(vm) = self.vm.clone() else {
            return;
        };
        // Requests whose deadline passed while they waited in the queue: their failure policy.
        let now = now_ns();
        let expired: Vec<u32> = {
            let mut v = vm.borrow_mut();
            let Vm { queue, waiting, .. } = &mut *v;
            // One pass (a queue of thousands during an outage must not cost its square).
            let mut expired = Vec::new();
            queue.retain(|&c| {
                let overdue = waiting.get(&c).is_none_or(|w| w.deadline_ns <= now);
                if overdue {
                    expired.push(c);
                }
                !overdue
            });
            expired
        };
        for ctx in expired {
            settle_waiting(&vm, ctx, Err(LimiterError::NoAnswer), now, true);
        }
        // Requests forwarded to the courier and not answered by their deadline: their failure
        // policy, and this worker takes the courier's place (it may be gone or stuck).
        let overdue: Vec<u32> = {
            let mut v = vm.borrow_mut();
            let Vm {
                forwarded, waiting, ..
            } = &mut *v;
            let mut overdue = Vec::new();
            forwarded.retain(|c, _| match waiting.get(c) {
                Some(w) if w.deadline_ns <= now => {
                    overdue.push(*c);
                    false
                }
                Some(_) => true,
                None => false,
            });
            overdue
        };
        if !overdue.is_empty() {
            take_over(&vm);
            for ctx in overdue {
                settle_waiting(&vm, ctx, Err(LimiterError::NoAnswer), now, true);
            }
            let _ = abi::set_effective_context(self.id);
            pump(&vm);
        }
        let _ = abi::set_effective_context(self.id);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            id: context_id,
            vm: self.vm.clone(),
            direct: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Sends the queue as callouts while fewer than `max_in_flight` are out. Runs in the root
/// context (its callbacks), so the callouts are the root's. When callouts are shared and another
/// worker is the courier, the queue goes to the courier instead (one forward out at a time).
fn pump(vm: &SharedVm) {
    // A worker holding other workers' requests sends them itself, even if another worker was
    // named the courier since they came (they would otherwise wait for their deadline).
    let holds_foreign = !vm.borrow().foreign.is_empty();
    if !holds_foreign {
        if let Some(c) = other_courier(vm) {
            if forward(vm, c) {
                return;
            }
            // The courier's queue is gone (its VM was replaced): this worker takes its place.
            take_over(vm);
        }
    }
    loop {
        let (plugin, batch, foreign, body, timeout_ms) = {
            let mut v = vm.borrow_mut();
            let plugin = v.plugin.clone();
            let fp = &plugin.config.fast_paths;
            if v.flights.len() >= fp.max_in_flight || (v.queue.is_empty() && v.foreign.is_empty()) {
                return;
            }
            let now = now_ns();
            // Other workers' requests past their deadline were settled there: not sent.
            v.foreign.retain(|f| f.request.deadline_ns > now);
            // At most max_batch requests, and within the wire's bounds on decisions and returns
            // per call (a request that would pass them waits for the next callout). Other
            // workers' requests get up to half the batch first, so neither side waits behind the
            // other.
            let mut budget = Budget::default();
            let reserved = v.foreign.len().min(fp.max_batch / 2);
            let mut batch = take_batch(&mut v, fp.max_batch - reserved, &mut budget);
            let mut foreign = Vec::new();
            while batch.len() + foreign.len() < fp.max_batch {
                let Some(f) = v.foreign.front() else {
                    break;
                };
                let (d, r) = (f.request.decisions.decisions.len(), f.request.returns.len());
                if !budget.admits(d, r) {
                    break;
                }
                budget.add(d, r);
                foreign.extend(v.foreign.pop_front());
            }
            let room = fp.max_batch - batch.len() - foreign.len();
            batch.extend(take_batch(&mut v, room, &mut budget));
            if batch.is_empty() && foreign.is_empty() {
                return;
            }
            let deadline = batch
                .iter()
                .filter_map(|c| v.waiting.get(c))
                .map(|w| w.deadline_ns)
                .chain(foreign.iter().map(|f| f.request.deadline_ns))
                .min()
                .unwrap_or(now);
            let timeout_ms = deadline.saturating_sub(now).div_ceil(1_000_000).max(1);
            let body = call_body(&plugin.config, &v, &batch, &foreign);
            let foreign: Vec<(u64, u32)> = foreign
                .iter()
                .map(|f| (f.origin, f.request.context))
                .collect();
            (plugin, batch, foreign, body, timeout_ms)
        };
        let dispatched = dispatch(&plugin, &body, timeout_ms);
        let _ = abi::record_metric(
            plugin.metrics.batch_requests,
            (batch.len() + foreign.len()) as u64,
        );
        match dispatched {
            Ok(token) => {
                count(plugin.metrics.callouts);
                vm.borrow_mut().flights.insert(
                    token,
                    Flight {
                        contexts: batch,
                        foreign,
                        dispatched_ns: now_ns(),
                    },
                );
            }
            Err(e) => {
                let now = now_ns();
                for ctx in batch {
                    settle_waiting(vm, ctx, Err(e.clone()), now, true);
                }
                answer_foreign(vm, &foreign, |_| Err(e.clone()));
                let root = vm.borrow().root_id;
                let _ = abi::set_effective_context(root);
                return;
            }
        }
    }
}

/// Decisions and returns taken into one call so far, against the wire's bounds.
#[derive(Default)]
struct Budget {
    requests: usize,
    decisions: usize,
    returns: usize,
}

impl Budget {
    /// Whether a request of `d` decisions and `r` returns still fits (the first always does).
    fn admits(&self, d: usize, r: usize) -> bool {
        self.requests == 0
            || (self.decisions + d <= MAX_CALL_DECISIONS && self.returns + r <= MAX_RETURNS)
    }
    fn add(&mut self, d: usize, r: usize) {
        self.requests += 1;
        self.decisions += d;
        self.returns += r;
    }
}

/// Takes up to `max` requests from the front of the queue, within `budget`.
fn take_batch(v: &mut Vm, max: usize, budget: &mut Budget) -> Vec<u32> {
    let mut batch = Vec::new();
    while batch.len() < max {
        let Some(&ctx) = v.queue.front() else {
            break;
        };
        let Some(w) = v.waiting.get(&ctx) else {
            v.queue.pop_front();
            continue;
        };
        let (d, r) = (w.remote.len(), w.returns.len());
        if !budget.admits(d, r) {
            break;
        }
        v.queue.pop_front();
        batch.push(ctx);
        budget.add(d, r);
    }
    batch
}

/// The courier's nonce when callouts are shared and another worker is the courier. A worker
/// that finds no courier named takes the place.
fn other_courier(vm: &SharedVm) -> Option<u64> {
    let (me, key) = {
        let v = vm.borrow();
        (v.nonce, v.sharing.as_ref()?.1.clone())
    };
    match abi::get_shared_data(&key)
        .0
        .as_deref()
        .and_then(courier::decode_nonce)
    {
        Some(c) if c != me => Some(c),
        Some(_) => None,
        None => {
            take_over(vm);
            None
        }
    }
}

/// Names this worker the courier (the last to write is).
fn take_over(vm: &SharedVm) {
    let v = vm.borrow();
    if let Some((_, key)) = &v.sharing {
        if let Err(status) = abi::set_shared_data(key, &v.nonce.to_le_bytes(), None) {
            warn!("ratelimit filter: cannot name this worker the courier: status {status}");
        }
    }
}

/// Sends the queue to the courier, unless a forward is still out. False when the courier's
/// queue cannot be reached (nothing was taken from the queue then).
fn forward(vm: &SharedVm, courier_nonce: u64) -> bool {
    let mut v = vm.borrow_mut();
    if !v.forwarded.is_empty() || v.queue.is_empty() {
        return true;
    }
    let Some((vm_id, _)) = v.sharing.clone() else {
        return false;
    };
    let Ok(Some(queue)) =
        hostcalls::resolve_shared_queue(&vm_id, &courier::queue_name(courier_nonce))
    else {
        return false;
    };
    let plugin = v.plugin.clone();
    let config = &plugin.config;
    let batch = take_batch(&mut v, config.fast_paths.max_batch, &mut Budget::default());
    let requests: Vec<courier::Forwarded> = batch
        .iter()
        .filter_map(|c| {
            let w = v.waiting.get(c)?;
            Some(courier::Forwarded {
                context: *c,
                decisions: RequestDecisions {
                    decisions: decisions(config, w),
                },
                returns: w.returns.clone(),
                deadline_ns: w.deadline_ns,
            })
        })
        .collect();
    let message = courier::encode(
        courier::FORWARD,
        &courier::Forward {
            origin: v.nonce,
            requests,
        },
    );
    if abi::enqueue_shared_queue(queue, &message).is_err() {
        for c in batch.into_iter().rev() {
            v.queue.push_front(c);
        }
        return false;
    }
    let now = now_ns();
    add(plugin.metrics.forwarded, batch.len() as i64);
    for c in batch {
        v.forwarded.insert(c, now);
    }
    true
}

/// Posts the answers to other workers' requests a callout carried back to their workers: `answer`
/// gives the one of the `j`-th of `foreign`. A worker whose queue is gone has nothing to answer.
fn answer_foreign(
    vm: &SharedVm,
    foreign: &[(u64, u32)],
    answer: impl Fn(usize) -> Result<RequestAnswer, LimiterError>,
) {
    if foreign.is_empty() {
        return;
    }
    let Some((vm_id, _)) = vm.borrow().sharing.clone() else {
        return;
    };
    let mut by_origin: BTreeMap<u64, Vec<courier::Answer>> = BTreeMap::new();
    for (j, (origin, ctx)) in foreign.iter().enumerate() {
        by_origin
            .entry(*origin)
            .or_default()
            .push((*ctx, answer(j)));
    }
    for (origin, answers) in by_origin {
        let message = courier::encode(courier::ANSWERS, &courier::Answers { answers });
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

/// The body of a callout for `contexts` (waiting requests of this VM) and `foreign` (other
/// workers' requests), in that order.
///
/// It carries no attempt id: Envoy never repeats a callout, so deduplication would cost Redis a
/// record per request for nothing (a request split across Cluster nodes gets an id from the
/// sidecar, for its refunds).
fn call_body(config: &Config, vm: &Vm, contexts: &[u32], foreign: &[Foreign]) -> Vec<u8> {
    let mut requests = Vec::with_capacity(contexts.len() + foreign.len());
    let mut returns = Vec::new();
    for c in contexts {
        if let Some(w) = vm.waiting.get(c) {
            requests.push(RequestDecisions {
                decisions: decisions(config, w),
            });
            returns.extend(w.returns.iter().cloned());
        }
    }
    for f in foreign {
        requests.push(f.request.decisions.clone());
        returns.extend(f.request.returns.iter().cloned());
    }
    let call = DecideRequest {
        domain: config.domain.clone(),
        attempt: None,
        requests,
        returns,
    };
    // Serialising strings and numbers cannot fail.
    serde_json::to_vec(&call).unwrap_or_default()
}

/// The wire decisions of a waiting request's remote part.
fn decisions(config: &Config, w: &Waiting) -> Vec<Decision> {
    w.remote
        .iter()
        .zip(&w.asks)
        .map(|(&i, ask)| {
            let p = &w.planned[i];
            Decision {
                rule: config.rules[p.rule].name.clone(),
                subject: p.subject.clone(),
                cost: p.cost,
                lease: *ask,
            }
        })
        .collect()
}

/// Sends a callout from the current context.
fn dispatch(plugin: &Plugin, body: &[u8], timeout_ms: u64) -> Result<u32, LimiterError> {
    let sidecar = &plugin.config.sidecar;
    let mut headers = vec![
        (":method", "POST"),
        (":path", sidecar.path()),
        (":authority", sidecar.authority()),
        ("content-type", "application/json"),
    ];
    if let Some(a) = &plugin.authorization {
        headers.push(("authorization", a.as_str()));
    }
    hostcalls::dispatch_http_call(
        &sidecar.cluster,
        headers,
        Some(body),
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
) -> Result<ratelimit_wire::DecideResponse, LimiterError> {
    // A failed callout (timeout, reset, no healthy host) comes with no headers at all.
    let status = if num_headers == 0 {
        None
    } else {
        abi::header_map_value(MapType::HttpCallResponseHeaders, ":status")
    };
    let body = if body_size == 0 || body_size > MAX_ANSWER_BYTES {
        Vec::new()
    } else {
        abi::buffer(BufferType::HttpCallResponseBody, body_size).unwrap_or_default()
    };
    verdict::parse_answer(status.as_deref(), &body, expected)
}

/// Settles a request of the queue or a flight: `switch` makes the request's context the effective
/// one first (the root answers for it). Gives back lease takes of a request that does not pass.
fn settle_waiting(
    vm: &SharedVm,
    ctx: u32,
    answer: Result<RequestAnswer, LimiterError>,
    dispatched_ns: u64,
    switch: bool,
) {
    let (plugin, mut w) = {
        let mut v = vm.borrow_mut();
        let plugin = v.plugin.clone();
        let Some(w) = v.waiting.remove(&ctx) else {
            return;
        };
        (plugin, w)
    };
    let outcome = conclude(&plugin, &mut w, answer, dispatched_ns);
    if switch && abi::set_effective_context(ctx).is_err() {
        // The request is gone (its client went away): nothing to answer; its leases back.
        give_back(&plugin, &w);
        return;
    }
    match outcome {
        Verdict::Admit { headers } => {
            count(plugin.metrics.admitted);
            if !headers.is_empty() {
                vm.borrow_mut().response_headers.insert(ctx, headers);
            }
            if let Err(status) = abi::resume_http_request() {
                error!("ratelimit filter: cannot resume the request: status {status}");
            }
        }
        Verdict::Reject(reply) => {
            give_back(&plugin, &w);
            if reply.status == 429 {
                count(plugin.metrics.rejected);
            }
            send(&reply);
        }
    }
}

/// The verdict of a waiting request from the sidecar's answer (or its failure); learns the fast
/// paths' facts from it.
fn conclude(
    plugin: &Plugin,
    w: &mut Waiting,
    answer: Result<RequestAnswer, LimiterError>,
    dispatched_ns: u64,
) -> Verdict {
    let config = &plugin.config;
    let m = &plugin.metrics;
    let checked = answer.and_then(|a| verdict::check_answer(&a, w.remote.len()).map(|()| a));
    let table = table(&config.fast_paths);
    // The host clock, read once and only when an answer needs it.
    let clock = std::cell::OnceCell::new();
    let now = || *clock.get_or_init(now_ns);
    match checked {
        Ok(answer) => {
            // A rejected early renewal: Redis had too few tokens left because this gateway holds
            // them in the lease in use. When every remote decision of the request was such a
            // renewal (nothing was deducted for any of them), the lease pays it after all.
            let renewals_only = !answer.allowed
                && w.renewals.iter().all(|r| *r)
                && answer
                    .results
                    .iter()
                    .all(|r| !r.shadow && (r.allowed || r.reason == Reason::Insufficient));
            for (k, r) in answer.results.iter().enumerate() {
                let p = &w.planned[w.remote[k]];
                let outcome = if r.shadow {
                    DecisionOutcome::NotDecided
                } else if r.allowed && answer.allowed {
                    DecisionOutcome::Admitted
                } else if r.allowed {
                    DecisionOutcome::NotDecided
                } else {
                    DecisionOutcome::Rejected {
                        cause: match r.reason {
                            Reason::CostExceedsCapacity => RejectionCause::CostExceedsCapacity,
                            Reason::Blocked => RejectionCause::Blocked,
                            _ => RejectionCause::Insufficient,
                        },
                        retry_after_ms: r.retry_after_ms,
                    }
                };
                let stats = &m.rules[p.rule];
                if r.shadow && !matches!(r.reason, Reason::Ok | Reason::Unlimited) {
                    count(stats.shadow_rejected);
                }
                if !r.allowed && !renewals_only {
                    count(stats.rejected);
                } else if answer.allowed {
                    count(stats.admitted);
                }
                let learns = config.fast_paths.known_rejections || w.asks[k].is_some();
                // An admission (or shadow answer) of a bucket the table did not hold, without a
                // lease ask, would only read the table to find nothing to write: skip the read.
                // (An entry another worker made meanwhile keeps what it says until it lapses:
                // at worst a rejection stays known a little longer, never an admission more.)
                let nothing_to_learn = w.absent.get(k) == Some(&true)
                    && w.asks[k].is_none()
                    && !matches!(outcome, DecisionOutcome::Rejected { .. });
                if learns && !nothing_to_learn && r.reason != Reason::Unlimited {
                    table.learn(
                        &p.id,
                        &Learned {
                            cost: p.cost,
                            limit: r.limit.as_ref().map(|l| KnownLimit {
                                name: l.name.clone(),
                                capacity: l.capacity,
                                refill_per_sec: l.refill_per_sec,
                            }),
                            outcome: if config.fast_paths.known_rejections {
                                outcome
                            } else {
                                DecisionOutcome::NotDecided
                            },
                            asked_lease: w.asks[k].map(|a| (a.id, a.ttl_ms)),
                            leased: if answer.allowed { r.leased } else { 0 },
                        },
                        dispatched_ns,
                        now(),
                    );
                }
            }
            if renewals_only {
                let taken = w.taken.len();
                if pay_renewals(&table, w, now()).is_empty() {
                    let entries = taken_entries(&table, w);
                    return admit_from_leases(plugin, w, &leased_admits(&entries));
                }
                // Not every one could be paid: give the takes just made back, reject.
                for (i, lease_id) in w.taken.drain(taken..) {
                    let p = &w.planned[i];
                    table.give_back(&p.id, lease_id, p.cost, now());
                }
                for (k, r) in answer.results.iter().enumerate() {
                    if !r.allowed {
                        count(m.rules[w.planned[w.remote[k]].rule].rejected);
                    }
                }
            }
            let entries = taken_entries(&table, w);
            let leased = leased_admits(&entries);
            if answer.allowed {
                for (i, _) in &w.taken {
                    count(m.rules[w.planned[*i].rule].admitted);
                }
            }
            let rules: Vec<&str> = w
                .remote
                .iter()
                .map(|&i| config.rules[w.planned[i].rule].name.as_str())
                .collect();
            verdict::from_answer(config, &answer, &rules, &leased)
        }
        Err(e) => {
            // No verdict: release the lease asks, apply the remote decisions' failure policies.
            for (k, ask) in w.asks.iter().enumerate() {
                if ask.is_some() {
                    let p = &w.planned[w.remote[k]];
                    table.learn(
                        &p.id,
                        &Learned {
                            cost: p.cost,
                            limit: None,
                            outcome: DecisionOutcome::NotDecided,
                            asked_lease: ask.map(|a| (a.id, a.ttl_ms)),
                            leased: 0,
                        },
                        dispatched_ns,
                        now(),
                    );
                }
            }
            // An early renewal's request is paid from the lease in use after all, if it still
            // can: the gateway holds those tokens whether or not the sidecar answers.
            let remote = pay_renewals(&table, w, now());
            if remote.is_empty() {
                count_limiter_error(plugin, &e);
                let entries = taken_entries(&table, w);
                return admit_from_leases(plugin, w, &leased_admits(&entries));
            }
            on_limiter_error(plugin, &remote, e)
        }
    }
}

/// Pays the request's early renewals from the leases in use where they still can (adding the
/// takes to `w.taken`); returns the remote decisions left unpaid.
fn pay_renewals(table: &Table<'_>, w: &mut Waiting, now_ns: u64) -> Vec<Planned> {
    let mut unpaid = Vec::new();
    for (k, &i) in w.remote.iter().enumerate() {
        let p = &w.planned[i];
        if w.renewals.get(k) == Some(&true) {
            if let Probe::Taken { lease_id, .. } =
                table.probe(&p.id, p.cost, now_ns, false, true, None)
            {
                w.taken.push((i, lease_id));
                continue;
            }
        }
        unpaid.push(p.clone());
    }
    unpaid
}

/// The verdict of a request every decision of which its leases paid (`leased`: what they say
/// about it), counted as such.
fn admit_from_leases(plugin: &Plugin, w: &Waiting, leased: &[LeasedAdmit<'_>]) -> Verdict {
    let m = &plugin.metrics;
    count(m.lease_admitted);
    for (i, _) in &w.taken {
        count(m.rules[w.planned[*i].rule].admitted);
    }
    verdict::from_leases(&plugin.config, leased)
}

/// The table's entries of the buckets a request's leases paid (for its rate-limit headers).
fn taken_entries(table: &Table<'_>, w: &Waiting) -> Vec<Option<fastpath::Entry>> {
    w.taken
        .iter()
        .map(|(i, _)| table.get(&w.planned[*i].id))
        .collect()
}

/// What those leases say about the request they paid: the limit, the tokens left.
fn leased_admits(entries: &[Option<fastpath::Entry>]) -> Vec<LeasedAdmit<'_>> {
    entries
        .iter()
        .map(|e| LeasedAdmit {
            limit: e.as_ref().and_then(|e| e.limit.as_ref()),
            lease_tokens: e.as_ref().map_or(0, |e| e.lease.tokens),
        })
        .collect()
}

/// This Envoy's fast-path table, as configured.
fn table(fp: &FastPaths) -> Table<'static> {
    Table {
        store: &HostShared,
        slots: fp.slots,
        max_rejection_ns: fp.max_rejection_ms.saturating_mul(1_000_000),
    }
}

/// Gives the lease takes of a request that does not pass back to their leases.
fn give_back(plugin: &Plugin, w: &Waiting) {
    let table = table(&plugin.config.fast_paths);
    if w.taken.is_empty() {
        return;
    }
    let now = now_ns();
    for (i, lease_id) in &w.taken {
        let p = &w.planned[*i];
        table.give_back(&p.id, *lease_id, p.cost, now);
    }
}

/// The verdict when the sidecar could not decide `remote`: the rules' `on_error` policies.
fn count_limiter_error(plugin: &Plugin, e: &LimiterError) {
    let m = &plugin.metrics;
    if e.is_config_error() {
        count(m.config_error);
        warn!("ratelimit filter: configuration error: {e}");
    } else {
        count(m.limiter_error);
        debug!("ratelimit filter: limiter error: {e}");
    }
}

fn on_limiter_error(plugin: &Plugin, remote: &[Planned], e: LimiterError) -> Verdict {
    let m = &plugin.metrics;
    count_limiter_error(plugin, &e);
    let config = &plugin.config;
    match verdict::on_error(config, remote) {
        FailurePlan::Deny => {
            count(m.failed_closed);
            Verdict::Reject(verdict::unavailable())
        }
        FailurePlan::Allow => {
            count(m.failed_open);
            Verdict::Admit {
                headers: Vec::new(),
            }
        }
        FailurePlan::Local(local) => {
            count(m.emergency_activations);
            let charges = verdict::charges(config, remote, &local);
            let takes = emergency::take_all(&HostShared, &charges, now_ns());
            for (charge, take) in charges.iter().zip(&takes) {
                if take.is_err() {
                    warn!(
                        "ratelimit filter: emergency bucket {:?} is contended; denying",
                        charge.key
                    );
                }
            }
            let v = verdict::from_emergency(config, remote, &local, &takes);
            match &v {
                Verdict::Reject(_) => count(m.emergency_rejected),
                Verdict::Admit { .. } if verdict::fails_open(config, remote) => {
                    count(m.failed_open)
                }
                Verdict::Admit { .. } => {}
            }
            v
        }
    }
}

/// One HTTP request going through the filter.
struct Request {
    id: u32,
    /// `None` only if Envoy created a stream although the configuration was refused: such a
    /// request is answered 503, never let through unlimited.
    vm: Option<SharedVm>,
    /// Without coalescing: the request's own callout (its waiting state and when it was sent).
    direct: Option<(Waiting, u64)>,
}

impl Context for Request {
    fn on_http_call_response(
        &mut self,
        _token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let (Some(vm), Some((w, dispatched_ns))) = (self.vm.clone(), self.direct.take()) else {
            return;
        };
        let plugin = vm.borrow().plugin.clone();
        let _ = abi::record_metric(
            plugin.metrics.decision_us,
            now_ns().saturating_sub(dispatched_ns) / 1_000,
        );
        let answer = read_answer(num_headers, body_size, 1).map(|mut a| a.answers.remove(0));
        vm.borrow_mut().waiting.insert(self.id, w);
        settle_waiting(&vm, self.id, answer, dispatched_ns, false);
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(vm) = self.vm.clone() else {
            send(&verdict::unavailable());
            return Action::Pause;
        };
        let plugin = vm.borrow().plugin.clone();
        match self.start(&vm, &plugin) {
            Start::Continue(headers) => {
                count(plugin.metrics.admitted);
                if !headers.is_empty() {
                    vm.borrow_mut().response_headers.insert(self.id, headers);
                }
                Action::Continue
            }
            Start::Pass => Action::Continue,
            Start::Reply(reply) => {
                send(&reply);
                Action::Pause
            }
            Start::Wait => Action::Pause,
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let headers = self
            .vm
            .as_ref()
            .and_then(|vm| vm.borrow_mut().response_headers.remove(&self.id))
            .unwrap_or_default();
        for (name, value) in headers {
            if let Err(status) = abi::replace_header(MapType::HttpResponseHeaders, &name, &value) {
                debug!("ratelimit filter: cannot set response header {name:?}: status {status}");
            }
        }
        Action::Continue
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // A request that goes away while it waits (its client hung up): forget it, and give its
        // lease takes back (it never reached the upstream).
        let Some(vm) = self.vm.take() else {
            return;
        };
        let Ok(mut v) = vm.try_borrow_mut() else {
            return;
        };
        v.response_headers.remove(&self.id);
        v.forwarded.remove(&self.id);
        let w = v
            .waiting
            .remove(&self.id)
            .or(self.direct.take().map(|(w, _)| w));
        let plugin = v.plugin.clone();
        drop(v);
        if let Some(w) = w {
            give_back(&plugin, &w);
        }
    }
}

/// What the request-headers step decided.
enum Start {
    /// No rule applies (or no decision): pass untouched.
    Pass,
    /// Admitted locally (leases): pass, with these response headers.
    Continue(Vec<(String, String)>),
    /// Answered locally.
    Reply(LocalReply),
    /// Waiting for the sidecar.
    Wait,
}

impl Request {
    fn start(&mut self, vm: &SharedVm, plugin: &Rc<Plugin>) -> Start {
        let config = &plugin.config;
        let m = &plugin.metrics;
        let request = RequestFacts {
            path: request_header(":path").unwrap_or_default(),
            method: if plugin.reads_method {
                request_header(":method").unwrap_or_default()
            } else {
                Vec::new()
            },
            headers: plugin
                .header_names
                .iter()
                .filter_map(|name| Some((name.clone(), request_header(name)?)))
                .collect::<BTreeMap<_, _>>(),
        };
        let matching = rules::matching(config, &request);
        if matching.is_empty() {
            return Start::Pass;
        }
        // Read only what the matching rules' subjects need.
        let needs = rules::needs(config, &matching);
        let id = &config.identity;
        let api_key = match id.api_key.as_ref().filter(|_| needs.app) {
            Some(k) => match api_key_header(&k.header) {
                Ok(v) => v,
                Err(()) => {
                    count(m.repeated_identity);
                    return Start::Reply(verdict::repeated_identity(&k.header));
                }
            },
            None => None,
        };
        let facts =
            Facts {
                api_key,
                jwt_user: id.jwt.as_ref().filter(|_| needs.user).and_then(|j| {
                    property(&identity::jwt_claim_property(&j.provider, &j.user_claim))
                }),
                jwt_tenant: id.jwt.as_ref().filter(|_| needs.tenant).and_then(|j| {
                    property(&identity::jwt_claim_property(
                        &j.provider,
                        j.tenant_claim.as_ref()?,
                    ))
                }),
                source_address: (id.ip && needs.ip)
                    .then(|| property(&SOURCE_ADDRESS_PROPERTY))
                    .flatten(),
                route_name: needs
                    .route
                    .then(|| property(&ROUTE_NAME_PROPERTY))
                    .flatten(),
            };
        let subject = identity::resolve(id, &facts);
        let plan = rules::plan(config, &matching, &subject);
        if plan.subject_unknown {
            count(m.subject_unknown);
        }
        if let Some(r) = plan.reject {
            let rule = &config.rules[r];
            count(m.unknown_rejected);
            return Start::Reply(verdict::unknown_subject(&rule.name, rule.unknown_status));
        }
        if plan.planned.is_empty() {
            return Start::Pass;
        }
        let now = now_ns();
        let fp = &config.fast_paths;
        let table = table(fp);
        let mut w = Waiting {
            planned: plan.planned,
            remote: Vec::new(),
            absent: Vec::new(),
            asks: Vec::new(),
            renewals: Vec::new(),
            taken: Vec::new(),
            returns: Vec::new(),
            deadline_ns: now + config.sidecar.timeout_ms * 1_000_000,
        };
        let uses_table = fp.known_rejections || fp.leases.enabled;
        // What the leases said about the requests they paid: (limit, tokens left).
        let mut paid: Vec<(Option<KnownLimit>, u64)> = Vec::new();
        for i in 0..w.planned.len() {
            let p = &w.planned[i];
            let rate = if fp.leases.enabled {
                vm.borrow_mut().hotness.observe(&p.id, now)
            } else {
                0.0
            };
            // A bucket busy enough for leases renews its lease before it runs out.
            let hot = fp.leases.enabled && rate >= fp.leases.min_rate_per_sec;
            let probe = if uses_table {
                let renew = hot.then_some(w.deadline_ns);
                table.probe(
                    &p.id,
                    p.cost,
                    now,
                    fp.known_rejections,
                    fp.leases.enabled,
                    renew,
                )
            } else {
                Probe::Undecided
            };
            let absent = probe == Probe::NoEntry;
            match probe {
                Probe::Rejected {
                    cause,
                    left_ns,
                    limit,
                } => {
                    give_back(plugin, &w);
                    count(m.known_rejections);
                    count(m.rejected);
                    count(m.rules[p.rule].rejected);
                    let rule = &config.rules[p.rule].name;
                    return Start::Reply(verdict::known_rejection(
                        config,
                        rule,
                        limit.as_ref(),
                        cause,
                        left_ns,
                    ));
                }
                Probe::Taken {
                    lease_id,
                    tokens_left,
                    limit,
                } => {
                    w.taken.push((i, lease_id));
                    paid.push((limit, tokens_left));
                    continue;
                }
                Probe::Renew { .. } | Probe::Undecided | Probe::NoEntry => {}
            }
            // The remote path; a busy bucket asks for a lease on the way: the next one while the
            // lease in use still pays (the probe marked the ask), or a new one in its place.
            let start = match probe {
                Probe::Renew {
                    previous,
                    give_back,
                } => Some(LeaseStart {
                    give_back: give_back.into_iter().collect(),
                    previous,
                }),
                _ if hot => table.begin_lease(&p.id, now, w.deadline_ns),
                _ => None,
            };
            let mut ask = None;
            if let Some(start) = start {
                let ttl_ms = fp.leases.ttl_ms;
                let id = vm.borrow_mut().lease_id();
                let tokens = fastpath::lease_size(
                    start.previous,
                    rate,
                    now,
                    ttl_ms,
                    p.cost,
                    fp.leases.max_tokens,
                );
                for (old, tokens) in start.give_back {
                    w.returns.push(LeaseReturn {
                        rule: config.rules[p.rule].name.clone(),
                        subject: p.subject.clone(),
                        id: old,
                        tokens,
                    });
                }
                ask = Some(LeaseAsk { id, tokens, ttl_ms });
            }
            w.remote.push(i);
            w.absent.push(absent);
            w.asks.push(ask);
            w.renewals.push(matches!(probe, Probe::Renew { .. }));
        }
        if w.remote.is_empty() {
            let leased: Vec<LeasedAdmit<'_>> = paid
                .iter()
                .map(|(limit, tokens)| LeasedAdmit {
                    limit: limit.as_ref(),
                    lease_tokens: *tokens,
                })
                .collect();
            return match admit_from_leases(plugin, &w, &leased) {
                Verdict::Admit { headers } => Start::Continue(headers),
                Verdict::Reject(r) => Start::Reply(r),
            };
        }
        if fp.coalesce {
            let wake = {
                let mut v = vm.borrow_mut();
                v.waiting.insert(self.id, w);
                v.queue.push_back(self.id);
                let wake =
                    !v.wake_pending && v.flights.len() < fp.max_in_flight && v.forwarded.is_empty();
                if wake {
                    v.wake_pending = true;
                }
                wake.then_some(v.queue_id).flatten()
            };
            if let Some(q) = wake {
                if let Err(status) = abi::enqueue_shared_queue(q, b"w") {
                    error!("ratelimit filter: cannot wake the root: status {status}");
                    vm.borrow_mut().wake_pending = false;
                }
            }
            return Start::Wait;
        }
        // Without coalescing: this request's own callout, answered to this context.
        let body = {
            let call = DecideRequest {
                domain: config.domain.clone(),
                attempt: None,
                requests: vec![RequestDecisions {
                    decisions: decisions(config, &w),
                }],
                returns: w.returns.clone(),
            };
            serde_json::to_vec(&call).unwrap_or_default()
        };
        match dispatch(plugin, &body, config.sidecar.timeout_ms) {
            Ok(_) => {
                count(m.callouts);
                self.direct = Some((w, now_ns()));
                Start::Wait
            }
            Err(e) => {
                let remote: Vec<Planned> = w.remote.iter().map(|&i| w.planned[i].clone()).collect();
                match on_limiter_error(plugin, &remote, e) {
                    Verdict::Admit { headers } => Start::Continue(headers),
                    Verdict::Reject(r) => {
                        give_back(plugin, &w);
                        if r.status == 429 {
                            count(m.rejected);
                        }
                        Start::Reply(r)
                    }
                }
            }
        }
    }
}

/// The API key header's value: `Ok(None)` when absent, `Err(())` when it came more than once
/// (Envoy joins repeated values with "," in `request.headers`; an API key has no comma), so a
/// client cannot put a junk key in front of its real one.
fn api_key_header(name: &str) -> Result<Option<Vec<u8>>, ()> {
    let joined = abi::property(&["request", "headers", name]);
    match joined {
        Some(v) if v.contains(&b',') => Err(()),
        Some(v) => Ok(Some(v)),
        None => Ok(request_header(name)),
    }
}

fn send(reply: &LocalReply) {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    if let Err(status) = abi::send_http_response(
        reply.status,
        &reply.details,
        &headers,
        reply.body.as_bytes(),
    ) {
        error!(
            "ratelimit filter: cannot send the {} reply: status {status}",
            reply.status
        );
        let _ = abi::reset_http_request();
    }
}

/// The first value of a request header, as bytes; `None` when absent or unreadable.
fn request_header(name: &str) -> Option<Vec<u8>> {
    abi::header_map_value(MapType::HttpRequestHeaders, name)
}

/// A property's bytes; `None` when absent or unreadable.
fn property(path: &[&str]) -> Option<Vec<u8>> {
    abi::property(path)
}

/// The host clock in Unix nanoseconds (0 if unreadable).
fn now_ns() -> u64 {
    abi::current_time_ns().unwrap_or(0)
}

/// proxy-wasm shared data (per `vm_id`, shared by all worker VMs of one Envoy process).
struct HostShared;

impl SharedStore for HostShared {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        abi::get_shared_data(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedDataError> {
        match abi::set_shared_data(key, value, cas) {
            Ok(()) => Ok(()),
            Err(abi::CAS_MISMATCH) => Err(SharedDataError::CasMismatch),
            Err(_) => Err(SharedDataError::Failed),
        }
    }
}
