//! The attempt id of a request's decisions: what lets the sidecar recognise a repeat of the same
//! decision (a retried callout) and not charge it twice.
//!
//! It is `<request id>@<request start in ns>`:
//! - the request id is Envoy's `x-request-id` header (Envoy generates it for edge requests, or
//!   keeps a trusted one), used as is when it is short printable ASCII, else as its SHA-256;
//! - the start time is the `request.time` property (when Envoy received the first byte).
//!
//! The time makes the id per *request*, not per header value: a client that replays the same
//! `x-request-id` on a new request gets a new attempt id and is charged again, instead of getting
//! the first answer back for free. Without `x-request-id` the id is `vm-<nonce>-<counter>@<time>`,
//! a counter of this VM plus a per-VM random nonce, so two worker VMs never produce the same id.

use crate::identity::sha256_hex;

/// The longest request id used as is; longer ones are hashed.
pub const MAX_REQUEST_ID_BYTES: usize = 128;

/// The property holding the request's start time.
pub const REQUEST_TIME_PROPERTY: [&str; 2] = ["request", "time"];

/// The attempt id of one request.
///
/// `request_id` is the `x-request-id` value, if any; `request_time` the raw `request.time`
/// property (Envoy serializes a timestamp as 8 little-endian bytes of Unix nanoseconds), if any;
/// `now_ns` the host clock, used when `request.time` is missing or odd; `vm_nonce` and
/// `counter` distinguish requests without an id.
pub fn attempt_id(
    request_id: Option<&[u8]>,
    request_time: Option<&[u8]>,
    now_ns: u64,
    vm_nonce: u64,
    counter: u64,
) -> String {
    let time = request_time
        .and_then(decode_request_time)
        .map(|ns| ns.to_string())
        .unwrap_or_else(|| match request_time {
            Some(raw) if !raw.is_empty() => format!("h{}", &sha256_hex(raw)[..16]),
            _ => now_ns.to_string(),
        });
    let id = match request_id {
        Some(id) if !id.is_empty() => {
            if id.len() <= MAX_REQUEST_ID_BYTES && id.iter().all(|b| b.is_ascii_graphic()) {
                // ASCII-graphic bytes are valid UTF-8.
                String::from_utf8_lossy(id).into_owned()
            } else {
                format!("sha256:{}", sha256_hex(id))
            }
        }
        _ => format!("vm-{vm_nonce:016x}-{counter}"),
    };
    format!("{id}@{time}")
}

/// `request.time` as Unix nanoseconds: 8 little-endian bytes of a signed 64-bit integer.
pub fn decode_request_time(raw: &[u8]) -> Option<i64> {
    let bytes: [u8; 8] = raw.try_into().ok()?;
    Some(i64::from_le_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const T: i64 = 1_700_000_000_123_456_789;

    #[test]
    fn request_id_and_start_time() {
        let id = attempt_id(Some(b"abc-123"), Some(&T.to_le_bytes()), 5, 7, 1);
        assert_eq!(id, "abc-123@1700000000123456789");
    }

    #[test]
    fn the_same_request_id_on_a_new_request_is_a_new_attempt() {
        let first = attempt_id(Some(b"abc"), Some(&T.to_le_bytes()), 0, 0, 0);
        let replay = attempt_id(Some(b"abc"), Some(&(T + 1).to_le_bytes()), 0, 0, 0);
        assert_ne!(first, replay);
    }

    #[test]
    fn missing_request_id_uses_the_vm_nonce_and_counter() {
        let a = attempt_id(None, Some(&T.to_le_bytes()), 0, 0xabc, 1);
        let b = attempt_id(Some(b""), Some(&T.to_le_bytes()), 0, 0xabc, 2);
        assert_eq!(a, "vm-0000000000000abc-1@1700000000123456789");
        assert_ne!(a, b);
        assert_ne!(a, attempt_id(None, Some(&T.to_le_bytes()), 0, 0xabd, 1));
    }

    #[test]
    fn odd_or_missing_times_and_ids_stay_bounded_and_printable() {
        assert_eq!(attempt_id(Some(b"x"), None, 42, 0, 0), "x@42");
        let odd = attempt_id(Some(b"x"), Some(b"2024"), 42, 0, 0);
        assert!(odd.starts_with("x@h") && odd.len() == 2 + 1 + 16, "{odd}");
        let long = attempt_id(Some(&[b'a'; 5000]), None, 1, 0, 0);
        assert!(long.starts_with("sha256:") && long.len() < 100, "{long}");
        let binary = attempt_id(Some(&[0xff, b' ', 0]), None, 1, 0, 0);
        assert!(binary.starts_with("sha256:"), "{binary}");
        assert!(long.len() <= ratelimit_wire::MAX_KEY_BYTES);
    }
}
