//! The proxy-wasm host adapter: reads what the pure core needs from Envoy (configuration,
//! headers, properties, shared data, the sidecar's answer) and carries its verdict out (resume,
//! local reply, response headers, stats). Nothing here decides anything.
//!
//! Host calls go through the small [`abi`] module below instead of the SDK's wrappers, which panic
//! on non-UTF-8 values or on a status they did not expect (a timed-out callout has no response
//! headers and Envoy answers `BadArgument`): a panic would take the VM down. In [`abi`] any status
//! but `Ok` is an error the caller handles; a failed read is "unknown". The one exception is
//! `hostcalls::dispatch_http_call`, which must register the callout with the SDK's dispatcher so
//! that `on_http_call_response` reaches this context; it panics only on a status other than `Ok`,
//! `BadArgument` or `InternalFailure`, which Envoy does not return for it.

use std::cell::Cell;
use std::collections::hash_map::RandomState;
use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::rc::Rc;
use std::time::Duration;

use log::{debug, error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};

use crate::attempt::{attempt_id, REQUEST_TIME_PROPERTY};
use crate::config::Config;
use crate::emergency::{self, Bucket, SharedStore, StoreError};
use crate::identity::{self, Facts, ROUTE_NAME_PROPERTY, SOURCE_ADDRESS_PROPERTY};
use crate::rules::{self, DecideRequestRef, Planned, RequestFacts};
use crate::verdict::{self, FailurePlan, LimiterError, LocalReply, Verdict, MAX_ANSWER_BYTES};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// The filter's stats, defined once per VM.
#[derive(Debug, Clone, Copy)]
struct Metrics {
    admitted: u32,
    rejected: u32,
    limiter_error: u32,
    failed_open: u32,
    failed_closed: u32,
    emergency_activations: u32,
    emergency_rejected: u32,
    subject_unknown: u32,
    decision_us: u32,
}

impl Metrics {
    fn define(prefix: &str) -> Result<Metrics, u32> {
        let counter =
            |name: &str| abi::define_metric(MetricType::Counter, &format!("{prefix}.{name}"));
        Ok(Metrics {
            admitted: counter("admitted")?,
            rejected: counter("rejected")?,
            limiter_error: counter("limiter_error")?,
            failed_open: counter("failed_open")?,
            failed_closed: counter("failed_closed")?,
            emergency_activations: counter("emergency_activations")?,
            emergency_rejected: counter("emergency_rejected")?,
            subject_unknown: counter("subject_unknown")?,
            decision_us: abi::define_metric(
                MetricType::Histogram,
                &format!("{prefix}.decision_us"),
            )?,
        })
    }
}

fn count(metric: u32) {
    let _ = abi::increment_metric(metric, 1);
}

/// The validated configuration and what is derived from it once.
struct Plugin {
    config: Config,
    metrics: Metrics,
    /// Request headers some rule's `match.headers` reads.
    header_names: Vec<String>,
    /// Distinguishes this VM's attempt ids when a request has no `x-request-id`.
    vm_nonce: u64,
    /// Requests seen by this VM without `x-request-id`.
    counter: Cell<u64>,
}

#[derive(Default)]
struct Root {
    plugin: Option<Rc<Plugin>>,
}

impl Context for Root {}

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
        let metrics = match Metrics::define(&config.stat_prefix) {
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
                    &Bucket::from(e),
                    now,
                );
            }
        }
        let header_names = config.matched_header_names().into_iter().collect();
        info!(
            "ratelimit filter: configured {} rules, sidecar cluster {:?}, timeout {} ms",
            config.rules.len(),
            config.sidecar.cluster,
            config.sidecar.timeout_ms
        );
        self.plugin = Some(Rc::new(Plugin {
            config,
            metrics,
            header_names,
            vm_nonce: RandomState::new().hash_one(now),
            counter: Cell::new(0),
        }));
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            plugin: self.plugin.clone(),
            planned: Vec::new(),
            dispatched_ns: None,
            response_headers: Vec::new(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One HTTP request going through the filter.
struct Request {
    /// `None` only if Envoy created a stream although the configuration was refused: such a
    /// request is answered 503, never let through unlimited.
    plugin: Option<Rc<Plugin>>,
    planned: Vec<Planned>,
    dispatched_ns: Option<u64>,
    /// Rate-limit headers for the upstream's response (`rate_limit_headers: always`).
    response_headers: Vec<(String, String)>,
}

impl Context for Request {
    fn on_http_call_response(
        &mut self,
        _token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some(plugin) = self.plugin.clone() else {
            return;
        };
        if let Some(started) = self.dispatched_ns.take() {
            let us = now_ns().saturating_sub(started) / 1_000;
            let _ = abi::record_metric(plugin.metrics.decision_us, us);
        }
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
        let verdict = match verdict::parse_answer(status.as_deref(), &body, self.planned.len()) {
            Ok(answer) => verdict::from_answer(&plugin.config, &self.planned, &answer),
            Err(e) => self.on_limiter_error(&plugin, e),
        };
        self.carry_out(&plugin, verdict, true);
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(plugin) = self.plugin.clone() else {
            send(&verdict::unavailable());
            return Action::Pause;
        };
        let config = &plugin.config;
        let request = RequestFacts {
            path: request_header(":path").unwrap_or_default(),
            method: request_header(":method").unwrap_or_default(),
            headers: plugin
                .header_names
                .iter()
                .filter_map(|name| Some((name.clone(), request_header(name)?)))
                .collect::<BTreeMap<_, _>>(),
        };
        let matching = rules::matching(config, &request);
        if matching.is_empty() {
            return Action::Continue;
        }
        // Read only what the matching rules' subjects need.
        let needs = rules::needs(config, &matching);
        let id = &config.identity;
        let facts =
            Facts {
                api_key: id
                    .api_key
                    .as_ref()
                    .filter(|_| needs.app)
                    .and_then(|k| request_header(&k.header)),
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
        let plan = rules::plan(config, &matching, &subject, || {
            let request_id = request_header("x-request-id");
            if request_id.is_none() {
                plugin.counter.set(plugin.counter.get().wrapping_add(1));
            }
            attempt_id(
                request_id.as_deref(),
                property(&REQUEST_TIME_PROPERTY).as_deref(),
                now_ns(),
                plugin.vm_nonce,
                plugin.counter.get(),
            )
        });
        if plan.subject_unknown {
            count(plugin.metrics.subject_unknown);
        }
        self.planned = plan.planned;
        if self.planned.is_empty() {
            return Action::Continue;
        }
        // Serialising strings and numbers cannot fail.
        let body = serde_json::to_vec(&DecideRequestRef {
            decisions: &self.planned,
        })
        .unwrap_or_default();
        let sidecar = &config.sidecar;
        let dispatched = hostcalls::dispatch_http_call(
            &sidecar.cluster,
            vec![
                (":method", "POST"),
                (":path", sidecar.path()),
                (":authority", sidecar.authority()),
                ("content-type", "application/json"),
            ],
            Some(&body),
            vec![],
            Duration::from_millis(sidecar.timeout_ms),
        );
        match dispatched {
            Ok(_token) => {
                self.dispatched_ns = Some(now_ns());
                Action::Pause
            }
            Err(status) => {
                let e = LimiterError::Dispatch(format!(
                    "{status:?} (is cluster {:?} defined?)",
                    sidecar.cluster
                ));
                let verdict = self.on_limiter_error(&plugin, e);
                self.carry_out(&plugin, verdict, false)
            }
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        for (name, value) in std::mem::take(&mut self.response_headers) {
            if let Err(status) = abi::replace_header(MapType::HttpResponseHeaders, &name, &value) {
                debug!("ratelimit filter: cannot set response header {name:?}: status {status}");
            }
        }
        Action::Continue
    }
}

impl Request {
    /// The verdict when the sidecar could not decide: the rules' `on_error` policies.
    fn on_limiter_error(&self, plugin: &Plugin, e: LimiterError) -> Verdict {
        let m = &plugin.metrics;
        count(m.limiter_error);
        debug!("ratelimit filter: limiter error: {e}");
        let config = &plugin.config;
        match verdict::on_error(config, &self.planned) {
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
                let charges = verdict::charges(config, &self.planned, &local);
                let takes = emergency::take_all(&HostShared, &charges, now_ns());
                for (charge, take) in charges.iter().zip(&takes) {
                    if take.is_err() {
                        warn!(
                            "ratelimit filter: emergency bucket {:?} is contended; denying",
                            charge.key
                        );
                    }
                }
                let v = verdict::from_emergency(config, &self.planned, &local, &takes);
                match &v {
                    Verdict::Reject(_) => count(m.emergency_rejected),
                    Verdict::Admit { .. } if verdict::fails_open(config, &self.planned) => {
                        count(m.failed_open)
                    }
                    Verdict::Admit { .. } => {}
                }
                v
            }
        }
    }

    /// Forwards or answers the request. `paused`: the request waits for us to resume it.
    fn carry_out(&mut self, plugin: &Plugin, verdict: Verdict, paused: bool) -> Action {
        match verdict {
            Verdict::Admit { headers } => {
                count(plugin.metrics.admitted);
                self.response_headers = headers;
                if paused {
                    if let Err(status) = abi::resume_http_request() {
                        error!("ratelimit filter: cannot resume the request: status {status}");
                    }
                }
                Action::Continue
            }
            Verdict::Reject(reply) => {
                if reply.status == 429 {
                    count(plugin.metrics.rejected);
                }
                send(&reply);
                Action::Pause
            }
        }
    }
}

fn send(reply: &LocalReply) {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    if let Err(status) = abi::send_http_response(reply.status, &headers, reply.body.as_bytes()) {
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

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        match abi::set_shared_data(key, value, cas) {
            Ok(()) => Ok(()),
            Err(abi::CAS_MISMATCH) => Err(StoreError::CasMismatch),
            Err(_) => Err(StoreError::Failed),
        }
    }
}

/// Host calls through the proxy-wasm ABI that never panic: any status but `Ok` is `None` (reads)
/// or `Err(status)`.
mod abi {
    use std::ptr::{null, null_mut};

    use proxy_wasm::types::{BufferType, MapType, MetricType};

    const OK: u32 = 0;
    const NOT_FOUND: u32 = 1;
    pub const CAS_MISMATCH: u32 = 8;
    /// `StreamType::HttpRequest`.
    const HTTP_REQUEST: u32 = 0;

    // The same imports the SDK declares; the status is taken as a plain `u32` so that an
    // unexpected value is just "not Ok".
    #[link(wasm_import_module = "env")]
    extern "C" {
        fn proxy_get_header_map_value(
            map_type: MapType,
            key_data: *const u8,
            key_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
        ) -> u32;
        fn proxy_get_property(
            path_data: *const u8,
            path_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
        ) -> u32;
        fn proxy_get_buffer_bytes(
            buffer_type: BufferType,
            start: usize,
            max_size: usize,
            return_buffer_data: *mut *mut u8,
            return_buffer_size: *mut usize,
        ) -> u32;
        fn proxy_replace_header_map_value(
            map_type: MapType,
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
        ) -> u32;
        fn proxy_send_local_response(
            status_code: u32,
            status_code_details_data: *const u8,
            status_code_details_size: usize,
            body_data: *const u8,
            body_size: usize,
            headers_data: *const u8,
            headers_size: usize,
            grpc_status: i32,
        ) -> u32;
        fn proxy_continue_stream(stream_type: u32) -> u32;
        fn proxy_close_stream(stream_type: u32) -> u32;
        fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
        fn proxy_get_shared_data(
            key_data: *const u8,
            key_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
            return_cas: *mut u32,
        ) -> u32;
        fn proxy_set_shared_data(
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
            cas: u32,
        ) -> u32;
        fn proxy_define_metric(
            metric_type: MetricType,
            name_data: *const u8,
            name_size: usize,
            return_id: *mut u32,
        ) -> u32;
        fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
        fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
    }

    fn status(status: u32) -> Result<(), u32> {
        if status == OK {
            Ok(())
        } else {
            Err(status)
        }
    }

    /// Takes ownership of what the host allocated through this module's allocator (the SDK's
    /// `proxy_on_memory_allocate`), as the SDK does.
    fn owned(status: u32, data: *mut u8, size: usize) -> Option<Vec<u8>> {
        if status != OK {
            return None;
        }
        if data.is_null() {
            return Some(Vec::new());
        }
        // SAFETY: on `Ok` the host returns a buffer of `size` bytes it allocated with
        // `proxy_on_memory_allocate`, i.e. this module's global allocator, and hands it over.
        Some(unsafe { Vec::from_raw_parts(data, size, size) })
    }

    pub fn header_map_value(map: MapType, name: &str) -> Option<Vec<u8>> {
        let mut data = null_mut();
        let mut size = 0;
        // SAFETY: pointers to live locals and to `name`'s bytes for the duration of the call.
        let status = unsafe {
            proxy_get_header_map_value(map, name.as_ptr(), name.len(), &mut data, &mut size)
        };
        owned(status, data, size)
    }

    pub fn property(path: &[&str]) -> Option<Vec<u8>> {
        let serialized = path.join("\0");
        let mut data = null_mut();
        let mut size = 0;
        // SAFETY: as above.
        let status = unsafe {
            proxy_get_property(serialized.as_ptr(), serialized.len(), &mut data, &mut size)
        };
        // A property that exists but is null comes back as `Ok` without data: unknown.
        owned(status, data, size).filter(|v| !v.is_empty())
    }

    pub fn buffer(buffer: BufferType, max_size: usize) -> Option<Vec<u8>> {
        let mut data = null_mut();
        let mut size = 0;
        // SAFETY: as above.
        let status = unsafe { proxy_get_buffer_bytes(buffer, 0, max_size, &mut data, &mut size) };
        owned(status, data, size)
    }

    pub fn replace_header(map: MapType, name: &str, value: &str) -> Result<(), u32> {
        // SAFETY: pointers to `name`'s and `value`'s bytes for the duration of the call.
        status(unsafe {
            proxy_replace_header_map_value(
                map,
                name.as_ptr(),
                name.len(),
                value.as_ptr(),
                value.len(),
            )
        })
    }

    /// The proxy-wasm map encoding: the pair count, each pair's name and value sizes, then each
    /// name and value followed by a NUL (all sizes `u32` little-endian).
    fn serialize_map(pairs: &[(&str, &str)]) -> Vec<u8> {
        let size = 4 + pairs
            .iter()
            .map(|(n, v)| n.len() + v.len() + 10)
            .sum::<usize>();
        let mut out = Vec::with_capacity(size);
        // Header counts and sizes are far below 4 GiB: the casts cannot truncate.
        out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
        for (n, v) in pairs {
            out.extend_from_slice(&(n.len() as u32).to_le_bytes());
            out.extend_from_slice(&(v.len() as u32).to_le_bytes());
        }
        for (n, v) in pairs {
            out.extend_from_slice(n.as_bytes());
            out.push(0);
            out.extend_from_slice(v.as_bytes());
            out.push(0);
        }
        out
    }

    pub fn send_http_response(code: u32, headers: &[(&str, &str)], body: &[u8]) -> Result<(), u32> {
        let headers = serialize_map(headers);
        // SAFETY: pointers to `body` and `headers` for the duration of the call.
        status(unsafe {
            proxy_send_local_response(
                code,
                null(),
                0,
                body.as_ptr(),
                body.len(),
                headers.as_ptr(),
                headers.len(),
                -1,
            )
        })
    }

    pub fn resume_http_request() -> Result<(), u32> {
        // SAFETY: no pointers.
        status(unsafe { proxy_continue_stream(HTTP_REQUEST) })
    }

    pub fn reset_http_request() -> Result<(), u32> {
        // SAFETY: no pointers.
        status(unsafe { proxy_close_stream(HTTP_REQUEST) })
    }

    pub fn current_time_ns() -> Option<u64> {
        let mut ns = 0;
        // SAFETY: a pointer to a live local.
        status(unsafe { proxy_get_current_time_nanoseconds(&mut ns) }).ok()?;
        Some(ns)
    }

    /// The value under `key` and its version; `(None, None)` when absent or unreadable.
    pub fn get_shared_data(key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        let mut data = null_mut();
        let mut size = 0;
        let mut cas = 0;
        // SAFETY: pointers to live locals and to `key`'s bytes for the duration of the call.
        let code = unsafe {
            proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas)
        };
        if code == NOT_FOUND {
            return (None, None);
        }
        let value = owned(code, data, size).filter(|v| !v.is_empty());
        let cas = (code == OK && cas != 0).then_some(cas);
        (value, cas)
    }

    pub fn set_shared_data(key: &str, value: &[u8], cas: Option<u32>) -> Result<(), u32> {
        // SAFETY: pointers to `key`'s and `value`'s bytes for the duration of the call.
        status(unsafe {
            proxy_set_shared_data(
                key.as_ptr(),
                key.len(),
                value.as_ptr(),
                value.len(),
                cas.unwrap_or(0),
            )
        })
    }

    pub fn define_metric(metric_type: MetricType, name: &str) -> Result<u32, u32> {
        let mut id = 0;
        // SAFETY: pointers to a live local and to `name`'s bytes for the duration of the call.
        status(unsafe { proxy_define_metric(metric_type, name.as_ptr(), name.len(), &mut id) })?;
        Ok(id)
    }

    pub fn increment_metric(id: u32, offset: i64) -> Result<(), u32> {
        // SAFETY: no pointers.
        status(unsafe { proxy_increment_metric(id, offset) })
    }

    pub fn record_metric(id: u32, value: u64) -> Result<(), u32> {
        // SAFETY: no pointers.
        status(unsafe { proxy_record_metric(id, value) })
    }
}
