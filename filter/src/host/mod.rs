//! The proxy-wasm host adapter. Its contexts gather what the request flow ([`crate::flow`])
//! needs from Envoy (configuration, headers, properties, shared data, the sidecar's answers, the
//! clock), call it, and carry its verdicts out (resume, local reply, response headers, stats):
//! a request asks and pauses, then is resumed or answered. Each worker VM has one [`Vm`], shared
//! by its root context and its HTTP contexts.
//!
//! - [`abi`]: host calls that never panic; [`stats`]: the filter's Envoy stats;
//! - [`link`]: the stream per worker to the sidecar, opened and written for the worker's
//!   [`crate::flow::Host`];
//! - [`facts`]: the clock, the request, shared data and local replies, as the host gives them.
//!
//! No `RefCell` borrow of the [`Vm`] is held across a host call that can call back into the VM
//! (a local reply, a resume).

mod abi;
mod facts;
mod link;
mod stats;

use std::cell::RefCell;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::rc::Rc;
use std::time::Duration;

use log::{debug, error, info, warn};
use prost::Message;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};
use ratelimit_wire::stream::Answer;

use crate::clock;
use crate::flow::{Begun, Body, Carry, Flow, Setup, Stats, Tally, Worker};
use crate::verdict::{self, MAX_ANSWER_BYTES};
use facts::{clock_kind, now_ns, send, HostRequest, HostShared};
use link::HostIo;
use stats::Metrics;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(Root { id: context_id, vm: None })
    });
}}

/// The configuration and the stats it defined.
struct Plugin {
    setup: Setup,
    metrics: Metrics,
}

impl Plugin {
    fn flow<'a>(&'a self, stats: &'a dyn Stats) -> Flow<'a> {
        Flow {
            config: &self.setup.config,
            reads: &self.setup.reads,
            store: &HostShared,
            stats,
        }
    }
}

/// A worker VM's shared state.
struct Vm {
    plugin: Rc<Plugin>,
    root_id: u32,
    /// This worker's wake queue.
    wake_queue: u32,
    worker: Worker,
}

type SharedVm = Rc<RefCell<Vm>>;

struct Root {
    id: u32,
    vm: Option<SharedVm>,
}

impl Context for Root {
    fn on_grpc_stream_message(&mut self, token_id: u32, message_size: usize) {
        if let Some(vm) = &self.vm {
            // An answer's body is at most MAX_ANSWER_BYTES; its envelope adds a few bytes.
            let answer = (message_size <= MAX_ANSWER_BYTES + 64)
                .then(|| abi::buffer(BufferType::GrpcReceiveBuffer, message_size))
                .flatten()
                .and_then(|b| Answer::decode(b.as_slice()).ok());
            root_event(vm, |flow, worker, io, now| {
                flow.stream_message(worker, io, token_id, answer, now)
            });
        }
    }

    fn on_grpc_stream_close(&mut self, token_id: u32, status_code: u32) {
        if let Some(vm) = &self.vm {
            root_event(vm, |flow, worker, io, now| {
                flow.stream_closed(worker, io, token_id, Some(status_code), now)
            });
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let bytes = abi::buffer(BufferType::PluginConfiguration, usize::MAX).unwrap_or_default();
        let setup = match Setup::from_json(&bytes, |var| std::env::var(var).ok()) {
            Ok(setup) => setup,
            Err(e) => {
                error!("ratelimit filter: invalid configuration: {e}");
                return false;
            }
        };
        let metrics = match Metrics::define(&setup.config) {
            Ok(m) => m,
            Err(status) => {
                error!("ratelimit filter: cannot define stats: status {status}");
                return false;
            }
        };
        let now = now_ns();
        let nonce = RandomState::new().hash_one(now);
        let wake_queue = match abi::register_shared_queue(&format!("ratelimit.wake.{nonce:016x}")) {
            Ok(id) => id,
            Err(status) => {
                error!("ratelimit filter: cannot register the wake-up queue: status {status}");
                return false;
            }
        };
        for warning in setup.config.retired_fields() {
            warn!("ratelimit filter: {warning}");
        }
        let clock = clock_kind();
        metrics.clock(clock);
        if clock == clock::Kind::Wall {
            warn!("ratelimit filter: the host has no monotonic clock; deadlines follow its wall clock, which a step moves (docs/fast-paths.md#the-clock)");
        }
        info!("ratelimit filter: {}, clock {clock:?}", setup.summary());
        let plugin = Rc::new(Plugin { setup, metrics });
        let flow = plugin.flow(&plugin.metrics);
        flow.prepare_emergency(now);
        if let Some(tick_ms) = flow.tick_period_ms() {
            let _ = hostcalls::set_tick_period(Duration::from_millis(tick_ms));
        }
        self.vm = Some(Rc::new(RefCell::new(Vm {
            plugin,
            root_id: self.id,
            wake_queue,
            worker: Worker::new(nonce),
        })));
        true
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        // Wake-ups only: what waits is sent.
        while let Ok(Some(_)) = abi::dequeue_shared_queue(queue_id) {}
        if let Some(vm) = &self.vm {
            root_event(vm, |flow, worker, io, now| flow.woken(worker, io, now));
        }
    }

    fn on_tick(&mut self) {
        if let Some(vm) = &self.vm {
            root_event(vm, |flow, worker, io, now| flow.tick(worker, io, now));
        }
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

/// One HTTP request going through the filter.
struct Request {
    id: u32,
    /// `None` only if Envoy created a stream although the configuration was refused: such a
    /// request is answered 503, never let through unlimited.
    vm: Option<SharedVm>,
}

/// Runs `f` over the flow, the worker and the time, the worker borrowed only meanwhile (no host
/// call in `f` calls back into the VM: it reads the request and shared data only).
fn with_worker<T>(vm: &SharedVm, f: impl FnOnce(&Flow<'_>, &mut Worker, u64) -> T) -> T {
    let mut v = vm.borrow_mut();
    let plugin = v.plugin.clone();
    f(&plugin.flow(&plugin.metrics), &mut v.worker, now_ns())
}

/// Carries out what the current request's own event came to (with a wake-up of the root when
/// it waits: the root sends, as it owns the stream, and `on_queue_ready` runs right after this
/// event).
fn carry_out(vm: &SharedVm, begun: Begun) -> Action {
    match begun {
        Begun::Continue => Action::Continue,
        Begun::Reply(reply) => {
            send(&reply);
            Action::Pause
        }
        Begun::Wait { wake } => {
            let queue = vm.borrow().wake_queue;
            if wake {
                if let Err(status) = abi::enqueue_shared_queue(queue, b"w") {
                    error!("ratelimit filter: cannot wake the root: status {status}");
                    vm.borrow_mut().worker.woken();
                }
            }
            Action::Pause
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
        let headers = with_worker(&vm, |flow, worker, now| {
            flow.request_headers(worker, &HostRequest, self.id, end_of_stream, now)
        });
        if headers.identity {
            // The real cost is read from the response's body: it must come uncompressed.
            if let Err(status) =
                abi::replace_header(MapType::HttpRequestHeaders, "accept-encoding", "identity")
            {
                debug!("ratelimit filter: cannot set accept-encoding: status {status}");
            }
        }
        match headers.begun {
            Some(begun) => carry_out(&vm, begun),
            None => Action::Pause,
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(vm) = self.vm.clone() else {
            return Action::Pause;
        };
        let body = with_worker(&vm, |flow, worker, _| {
            flow.request_body(worker, self.id, end_of_stream)
        });
        match body {
            Body::Continue => Action::Continue,
            Body::Pause => Action::Pause,
            Body::Begin { max_bytes } => {
                let body = (body_size <= max_bytes)
                    .then(|| abi::buffer(BufferType::HttpRequestBody, body_size))
                    .flatten();
                let begun = with_worker(&vm, |flow, worker, now| {
                    flow.begin(worker, &HostRequest, self.id, body.as_deref(), now)
                });
                carry_out(&vm, begun)
            }
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(vm) = &self.vm else {
            return Action::Continue;
        };
        let read = |name: &str| abi::header_map_value(MapType::HttpResponseHeaders, name);
        let headers = with_worker(vm, |flow, worker, _| {
            worker
                .streams
                .response_headers(flow, self.id, end_of_stream, &read)
        });
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
        if !vm.borrow().worker.streams.reads_response_body(self.id) {
            return Action::Continue;
        }
        // The chunk passing now (the body is never held back for metering).
        let chunk = (body_size > 0)
            .then(|| abi::buffer(BufferType::HttpResponseBody, body_size))
            .flatten()
            .unwrap_or_default();
        with_worker(vm, |flow, worker, _| {
            worker
                .streams
                .response_body(flow, self.id, &chunk, end_of_stream)
        });
        Action::Continue
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // A request that goes away (its stream ended, or its client hung up while it waited).
        let Some(vm) = self.vm.take() else {
            return;
        };
        let Ok(mut v) = vm.try_borrow_mut() else {
            return;
        };
        let plugin = v.plugin.clone();
        plugin
            .flow(&plugin.metrics)
            .ended(&mut v.worker, self.id, now_ns());
    }
}

/// Works an event of the root through the worker (`event` gets the flow, the worker, the host and
/// the time), then carries out the verdicts it came to, each in its request's context, once the
/// worker is no longer borrowed (a reply or a resume can call back into the VM); the counters it
/// increments are added once per event ([`Tally`]).
fn root_event(
    vm: &SharedVm,
    event: impl FnOnce(&Flow<'_>, &mut Worker, &mut HostIo<'_>, u64) -> Vec<Carry>,
) {
    let (plugin, root) = {
        let v = vm.borrow();
        (v.plugin.clone(), v.root_id)
    };
    let tally = Tally::new(&plugin.metrics);
    let carries = {
        let mut v = vm.borrow_mut();
        let mut io = HostIo::new(&plugin, root);
        event(&plugin.flow(&tally), &mut v.worker, &mut io, now_ns())
    };
    tally.finish();
    for carry in carries {
        let (ctx, reply) = match carry {
            Carry::Resume(ctx) => (ctx, None),
            Carry::Reply(ctx, reply) => (ctx, Some(reply)),
        };
        if abi::set_effective_context(ctx).is_err() {
            continue; // gone meanwhile
        }
        match reply {
            Some(reply) => send(&reply),
            None => {
                if let Err(status) = abi::resume_http_request() {
                    error!("ratelimit filter: cannot resume the request: status {status}");
                }
            }
        }
    }
    let _ = abi::set_effective_context(root);
}
