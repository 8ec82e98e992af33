//! Host calls through the proxy-wasm ABI that never panic: any status but `Ok` is `None` (reads)
//! or `Err(status)`, which the caller handles; a failed read is "unknown". The SDK's wrappers
//! (`proxy_wasm::hostcalls`) panic on a non-UTF-8 value or on a status they did not expect (a
//! timed-out callout has no response headers and Envoy answers `BadArgument`), and a panic takes
//! the VM down. Called through the SDK all the same: `open_grpc_stream` and
//! `send_grpc_stream_message` (the SDK's dispatcher then hands the stream's messages to the root
//! context that opened it) and `set_tick_period`.

use std::ptr::null_mut;

use proxy_wasm::types::{BufferType, MapType, MetricType};

const OK: u32 = 0;
const NOT_FOUND: u32 = 1;
pub const CAS_MISMATCH: u32 = 8;
/// `StreamType::HttpRequest`.
const HTTP_REQUEST: u32 = 0;
/// WASI's `CLOCKID_MONOTONIC`.
const MONOTONIC: u32 = 1;

#[link(wasm_import_module = "wasi_snapshot_preview1")]
extern "C" {
    fn clock_time_get(id: u32, precision: u64, time: *mut u64) -> u32;
}

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
    fn proxy_register_shared_queue(
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_enqueue_shared_queue(queue_id: u32, value_data: *const u8, value_size: usize) -> u32;
    fn proxy_dequeue_shared_queue(
        queue_id: u32,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
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
    let status =
        unsafe { proxy_get_header_map_value(map, name.as_ptr(), name.len(), &mut data, &mut size) };
    owned(status, data, size)
}

pub fn property(path: &[&str]) -> Option<Vec<u8>> {
    let serialized = path.join("\0");
    let mut data = null_mut();
    let mut size = 0;
    // SAFETY: as above.
    let status =
        unsafe { proxy_get_property(serialized.as_ptr(), serialized.len(), &mut data, &mut size) };
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
        proxy_replace_header_map_value(map, name.as_ptr(), name.len(), value.as_ptr(), value.len())
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

pub fn send_http_response(
    code: u32,
    details: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<(), u32> {
    let headers = serialize_map(headers);
    // SAFETY: pointers to `details`, `body` and `headers` for the duration of the call.
    status(unsafe {
        proxy_send_local_response(
            code,
            details.as_ptr(),
            details.len(),
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

/// WASI's monotonic clock (`clock_time_get`, clock id 1): Envoy answers it from its steady clock.
pub fn monotonic_time_ns() -> Option<u64> {
    let mut ns = 0;
    // SAFETY: a pointer to a live local; WASI's errno 0 is success.
    (unsafe { clock_time_get(MONOTONIC, 1, &mut ns) } == 0).then_some(ns)
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
    let code =
        unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
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

pub fn register_shared_queue(name: &str) -> Result<u32, u32> {
    let mut id = 0;
    // SAFETY: pointers to a live local and to `name`'s bytes for the duration of the call.
    status(unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

pub fn enqueue_shared_queue(queue_id: u32, value: &[u8]) -> Result<(), u32> {
    // SAFETY: a pointer to `value`'s bytes for the duration of the call.
    status(unsafe { proxy_enqueue_shared_queue(queue_id, value.as_ptr(), value.len()) })
}

/// The next item of the queue; `Ok(None)` when it is empty.
pub fn dequeue_shared_queue(queue_id: u32) -> Result<Option<Vec<u8>>, u32> {
    let mut data = null_mut();
    let mut size = 0;
    // SAFETY: pointers to live locals for the duration of the call.
    let code = unsafe { proxy_dequeue_shared_queue(queue_id, &mut data, &mut size) };
    match code {
        OK => Ok(owned(code, data, size)),
        // Empty
        7 => Ok(None),
        other => Err(other),
    }
}

pub fn set_effective_context(context_id: u32) -> Result<(), u32> {
    // SAFETY: no pointers.
    status(unsafe { proxy_set_effective_context(context_id) })
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
