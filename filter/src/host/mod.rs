//! The proxy-wasm host adapter. Its contexts gather what the request flow ([`crate::flow`])
//! needs from Envoy (configuration, headers, properties, shared data, the sidecar's answers, the
//! clock), call it, and carry its verdicts out (resume, local reply, response headers, stats):
//! a request asks and pauses, then is resumed or answered. Each worker VM has one [`Vm`], shared
//! by its root context and its HTTP contexts.
//!
//! - [`abi`]: host calls that never panic; [`stats`]: the filter's Envoy stats;
//! - [`callout`]: the calls to the sidecar, sent and answered by the root context;
//! - [`link`]: the stream per worker to the sidecar that carries them;
//! - [`facts`]: the clock, the request, shared data and local replies, as the host gives them.
//!
//! No `RefCell` borrow of the [`Vm`] is held across a host call that can call back into the VM
//! (a local reply, a resume).

mod abi;
mod callout;
mod facts;
mod link;
mod stats;

use std::cell::RefCell;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::rc::Rc;
use std::time::Duration;

use log::{debug, error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};
use ratelimit_wire::RequestAnswer;

use crate::clock;
use crate::config::Config;
use crate::costs::MAX_METERED_BYTES;
use crate::emergency::{self, EmergencyBucket};
use crate::flow::batch::Queue;
use crate::flow::link::{Link, SideCalls};
use crate::flow::streams::Streams;
use crate::flow::{Flow, RequestReads, Start, Worker};
use crate::verdict::{self, LimiterError, Verdict};
use facts::{clock_kind, now_ns, send, HostRequest, HostShared};
use stats::Metrics;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(Root { id: context_id, vm: None })
    });
}}

/// The validated configuration and what is derived from it once.
struct Plugin {
    config: Config,
    reads: RequestReads,
    metrics: Metrics,
    /// `authorization` metadata of the stream, if a token is configured.
    authorization: Option<String>,
}

impl Plugin {
    fn flow(&self) -> Flow<'_> {
        Flow {
            config: &self.config,
            reads: &self.reads,
            store: &HostShared,
            stats: &self.metrics,
        }
    }
}

/// A worker VM's shared state.
struct Vm {
    plugin: Rc<Plugin>,
    root_id: u32,
    /// This worker's wake queue.
    wake_queue: u32,
    /// The requests waiting for the sidecar.
    queue: Queue,
    worker: Worker,
    /// What this worker keeps of its streams (bodies awaited, response headers, meters, slots,
    /// settlements).
    streams: Streams,
    /// The calls out besides the decisions: settlements, slot renewals or releases, the epoch
    /// poll.
    side: SideCalls,
    /// The stream to the sidecar.
    link: Link,
}

type SharedVm = Rc<RefCell<Vm>>;

struct Root {
    id: u32,
    vm: Option<SharedVm>,
}

impl Context for Root {
    fn on_grpc_stream_message(&mut self, token_id: u32, message_size: usize) {
        if let Some(vm) = self.vm.clone() {
            link::message(&vm, token_id, message_size);
        }
    }

    fn on_grpc_stream_close(&mut self, token_id: u32, status_code: u32) {
        if let Some(vm) = self.vm.clone() {
            link::closed(&vm, token_id, now_ns(), Some(status_code));
        }
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
        let authorization = match authorization(&config) {
            Ok(a) => a,
            Err(e) => {
                error!("ratelimit filter: invalid configuration: {e}");
                return false;
            }
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
                let key = emergency::shared_key(&rule.name);
                emergency::ensure_initialized(&HostShared, &key, &EmergencyBucket::from(e), now);
            }
        }
        let nonce = RandomState::new().hash_one(now);
        let wake_queue = match callout::register_wake_queue(nonce) {
            Ok(id) => id,
            Err(status) => {
                error!("ratelimit filter: cannot register the wake-up queue: status {status}");
                return false;
            }
        };
        for warning in config.retired_fields() {
            warn!("ratelimit filter: {warning}");
        }
        let clock = clock_kind();
        metrics.clock(clock);
        if clock == clock::Kind::Wall {
            warn!("ratelimit filter: the host has no monotonic clock; deadlines follow its wall clock, which a step moves (docs/fast-paths.md#the-clock)");
        }
        info!(
            "ratelimit filter: configured {} rules in domain {:?}, sidecar cluster {:?}, timeout {} ms, coalescing {}, clock {clock:?}",
            config.rules.len(),
            config.domain,
            config.sidecar.cluster,
            config.sidecar.timeout_ms,
            config.fast_paths.coalesce
        );
        let plugin = Rc::new(Plugin {
            reads: RequestReads::of(&config),
            config,
            metrics,
            authorization,
        });
        if let Some(tick_ms) = plugin.flow().tick_period_ms() {
            let _ = hostcalls::set_tick_period(Duration::from_millis(tick_ms));
        }
        self.vm = Some(Rc::new(RefCell::new(Vm {
            plugin,
            root_id: self.id,
            wake_queue,
            queue: Queue::default(),
            worker: Worker::new(nonce),
            streams: Streams::new(nonce),
            side: SideCalls::default(),
            link: Link::default(),
        })));
        true
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        match self.vm.clone() {
            Some(vm) => callout::woken(&vm, queue_id),
            None => while let Ok(Some(_)) = abi::dequeue_shared_queue(queue_id) {},
        }
    }

    fn on_tick(&mut self) {
        let Some(vm) = self.vm.clone() else {
            return;
        };
        // Requests whose deadline passed while they waited in the queue: their failure policy.
        let now = now_ns();
        let plugin = vm.borrow().plugin.clone();
        let poll = plugin.flow().tick(&mut vm.borrow_mut().worker, now);
        if poll {
            callout::poll_epoch(&vm, now);
        }
        callout::send_settlements(&vm);
        callout::send_slots(&vm, now);
        // Requests whose body never came by their deadline: decided on the fallback reservation.
        let late = vm.borrow_mut().streams.late_bodies(now);
        if !late.is_empty() {
            for ctx in late {
                start_paused(&vm, ctx, now);
            }
            let _ = abi::set_effective_context(self.id);
            callout::send_queued(&vm);
        }
        let expired = vm.borrow_mut().queue.expired(now);
        for ctx in expired {
            resolve(&vm, ctx, Err(LimiterError::NoAnswer), None, now, now, true);
        }
        link::tick(&vm, now);
        let _ = abi::set_effective_context(self.id);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            id: context_id,
            vm: self.vm.clone(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// The `authorization` metadata of the stream: `sidecar.token`, or the environment variable
/// `sidecar.token_env` names; an error says what is wrong.
fn authorization(config: &Config) -> Result<Option<String>, String> {
    match (&config.sidecar.token, &config.sidecar.token_env) {
        (Some(t), _) => Ok(Some(format!("Bearer {t}"))),
        (None, Some(var)) => match std::env::var(var) {
            Ok(t) if !t.is_empty() && t.bytes().all(|b| b.is_ascii_graphic()) => {
                Ok(Some(format!("Bearer {t}")))
            }
            _ => Err(format!(
                "sidecar.token_env: the environment variable {var:?} is not set (or not printable ASCII) in the VM; expose it with vm_config.environment_variables"
            )),
        },
        (None, None) => Ok(None),
    }
}

/// One HTTP request going through the filter.
struct Request {
    id: u32,
    /// `None` only if Envoy created a stream although the configuration was refused: such a
    /// request is answered 503, never let through unlimited.
    vm: Option<SharedVm>,
}

impl Request {
    /// Starts the request's flow (with its body when it waited for it) and carries the verdict
    /// out, or pauses it for the sidecar.
    fn begin(&mut self, vm: &SharedVm, body: Option<Vec<u8>>) -> Action {
        let vm = vm.clone();
        let plugin = vm.borrow().plugin.clone();
        let flow = plugin.flow();
        let now = now_ns();
        let start = flow.start_with_body(
            &HostRequest,
            body.as_deref(),
            now,
            &mut vm.borrow_mut().worker,
        );
        let verdict = match start {
            Start::Pass => return Action::Continue,
            Start::Reply(reply) => {
                send(&reply);
                return Action::Pause;
            }
            Start::Decided(verdict) => verdict,
            Start::Wait(w) => {
                callout::enqueue(&vm, self.id, w);
                return Action::Pause;
            }
        };
        flow.delivered(&verdict);
        match verdict {
            Verdict::Admit { headers } => {
                vm.borrow_mut()
                    .streams
                    .admitted(self.id, headers, Vec::new());
                Action::Continue
            }
            Verdict::Reject(reply) => {
                send(&reply);
                Action::Pause
            }
        }
    }
}

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(vm) = self.vm.clone() else {
            send(&verdict::unavailable());
            return Action::Pause;
        };
        let plugin = vm.borrow().plugin.clone();
        if plugin.flow().reads_response_body(&HostRequest) {
            // The real cost is read from the response's body: it must come uncompressed.
            if let Err(status) =
                abi::replace_header(MapType::HttpRequestHeaders, "accept-encoding", "identity")
            {
                debug!("ratelimit filter: cannot set accept-encoding: status {status}");
            }
        }
        if !end_of_stream && plugin.flow().wants_request_body(&HostRequest) {
            // Envoy delivers the body to a paused filter only with the Wasm filter's
            // `allow_on_headers_stop_iteration: true` (docs/costs.md); without it the request is
            // decided without its body at the deadline (a tick), on the fallback reservation.
            let deadline = now_ns() + plugin.config.sidecar.timeout_ms * 1_000_000;
            vm.borrow_mut().streams.await_body(self.id, deadline);
            return Action::Pause;
        }
        self.begin(&vm, None)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(vm) = self.vm.clone() else {
            return Action::Pause;
        };
        if !vm.borrow().streams.awaits_body(self.id) {
            // Paused for the sidecar: the body waits with it (Envoy buffers it).
            let held = vm.borrow().queue.holds(self.id);
            return if held {
                Action::Pause
            } else {
                Action::Continue
            };
        }
        if !end_of_stream {
            return Action::Pause; // Envoy buffers the body until its end
        }
        vm.borrow_mut().streams.body_came(self.id);
        let body = (body_size <= MAX_METERED_BYTES)
            .then(|| abi::buffer(BufferType::HttpRequestBody, body_size))
            .flatten();
        self.begin(&vm, body)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(vm) = &self.vm else {
            return Action::Continue;
        };
        let plugin = vm.borrow().plugin.clone();
        let read = |name: &str| abi::header_map_value(MapType::HttpResponseHeaders, name);
        let headers =
            vm.borrow_mut()
                .streams
                .response_headers(&plugin.flow(), self.id, end_of_stream, &read);
        for (name, value) in headers {
            if let Err(status) = abi::replace_header(MapType::HttpResponseHeaders, &name, &value) {
                debug!("ratelimit filter: cannot set response header {name:?}: status {status}");
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(vm) = &self.vm else {
            return Action::Continue;
        };
        if !vm.borrow().streams.reads_response_body(self.id) {
            return Action::Continue;
        }
        // The chunk passing now (the body is never held back for metering).
        let chunk = (body_size > 0)
            .then(|| abi::buffer(BufferType::HttpResponseBody, body_size))
            .flatten()
            .unwrap_or_default();
        let plugin = vm.borrow().plugin.clone();
        vm.borrow_mut()
            .streams
            .response_body(&plugin.flow(), self.id, &chunk, end_of_stream);
        Action::Continue
    }
}

/// Starts, from the root, the flow of paused request `ctx` without its body (it did not come
/// by its deadline): a verdict is carried out at once, a wait queues it for the root's next
/// callout.
fn start_paused(vm: &SharedVm, ctx: u32, now: u64) {
    if abi::set_effective_context(ctx).is_err() {
        return; // gone
    }
    let plugin = vm.borrow().plugin.clone();
    let flow = plugin.flow();
    let start = flow.start(&HostRequest, now, &mut vm.borrow_mut().worker);
    let verdict = match start {
        Start::Pass => {
            let _ = abi::resume_http_request();
            return;
        }
        Start::Reply(reply) => return send(&reply),
        Start::Decided(verdict) => verdict,
        Start::Wait(w) => {
            let (_, max_in_flight) = crate::flow::batch::limits(&plugin.config);
            vm.borrow_mut().queue.enqueue(ctx, w, max_in_flight);
            vm.borrow_mut().queue.woken();
            return;
        }
    };
    flow.delivered(&verdict);
    match verdict {
        Verdict::Admit { headers } => {
            vm.borrow_mut().streams.admitted(ctx, headers, Vec::new());
            let _ = abi::resume_http_request();
        }
        Verdict::Reject(reply) => send(&reply),
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
        let plugin = v.plugin.clone();
        let flow = plugin.flow();
        v.streams.ended(&flow, self.id);
        let w = v.queue.forget(self.id);
        drop(v);
        if let Some(mut w) = w {
            flow.give_back(&mut w, now_ns());
        }
    }
}

/// A call's answer said it was decided under policy epoch `epoch`: the flow may make the poll due.
fn answered_under(vm: &SharedVm, epoch: Option<u64>) {
    let v = vm.borrow();
    v.plugin.flow().answered_under(&v.worker, epoch);
}

/// Resolves a paused request with the sidecar's answer (or why there is none: `answer` is the
/// error; `epoch`: the policy epoch its call said) and carries the verdict out. `switch`: the
/// root answers for the request, so its context is made the effective one first.
fn resolve(
    vm: &SharedVm,
    ctx: u32,
    answer: Result<RequestAnswer, LimiterError>,
    epoch: Option<u64>,
    dispatched_ns: u64,
    now_ns: u64,
    switch: bool,
) {
    let Some(mut w) = vm.borrow_mut().queue.take(ctx) else {
        return;
    };
    let plugin = vm.borrow().plugin.clone();
    let flow = plugin.flow();
    // The concurrency slots the sidecar took for the request: held while its stream runs, given
    // back at once if it does not pass after all.
    let held = answer.as_ref().ok().and_then(|a| a.slot.clone());
    if let Some(held) = &held {
        let decisions = w.decisions(&plugin.config);
        vm.borrow_mut()
            .streams
            .slots
            .hold(ctx, held, &decisions, now_ns);
    }
    let verdict = flow.resolve_under(&mut w, answer, epoch, dispatched_ns, now_ns);
    if switch && abi::set_effective_context(ctx).is_err() {
        // The request is gone (its client went away): nothing to answer; its leases back, and
        // its reservations stand (it never reached the upstream).
        flow.give_back(&mut w, now_ns);
        vm.borrow_mut().streams.release_slots(&flow, ctx);
        return;
    }
    flow.delivered(&verdict);
    if !matches!(verdict, Verdict::Admit { .. }) && held.is_some() {
        vm.borrow_mut().streams.release_slots(&flow, ctx);
    }
    match verdict {
        Verdict::Admit { headers } => {
            let metered = flow.metered(&w);
            vm.borrow_mut().streams.admitted(ctx, headers, metered);
            if let Err(status) = abi::resume_http_request() {
                error!("ratelimit filter: cannot resume the request: status {status}");
            }
        }
        Verdict::Reject(reply) => send(&reply),
    }
}
