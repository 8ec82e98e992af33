//! Shared callouts (`fast_paths.share_callouts`): the workers of one Envoy post to each other's
//! wake queues (`ratelimit.wake.<nonce>`, one per worker VM). A message is one kind byte and a
//! JSON body; a bare wake-up is `w`.

use ratelimit_wire::{LeaseReturn, RequestAnswer, RequestDecisions};
use serde::{Deserialize, Serialize};

use crate::verdict::LimiterError;

/// Kind byte: a worker's queued requests, for the courier to send.
pub const FORWARD: u8 = b'F';
/// Kind byte: the courier's answers to a worker's forwarded requests.
pub const ANSWERS: u8 = b'A';

/// Requests forwarded to the courier.
#[derive(Serialize, Deserialize)]
pub struct Forward {
    /// The sending worker's nonce: where the answers go.
    pub origin: u64,
    pub requests: Vec<Forwarded>,
}

#[derive(Serialize, Deserialize)]
pub struct Forwarded {
    /// The request's context in its own worker.
    pub context: u32,
    pub decisions: RequestDecisions,
    /// Lease leftovers its worker gives back with it.
    pub returns: Vec<LeaseReturn>,
    /// When its worker settles it by its failure policy (the courier drops it then).
    pub deadline_ns: u64,
}

/// The answer to one forwarded request: its context, and what the sidecar said (or why it
/// could not be asked).
pub type Answer = (u32, Result<RequestAnswer, LimiterError>);

/// Answers to forwarded requests, by context.
#[derive(Serialize, Deserialize)]
pub struct Answers {
    pub answers: Vec<Answer>,
}

/// A message: its kind byte, then its JSON.
pub fn encode<T: Serialize>(kind: u8, body: &T) -> Vec<u8> {
    let mut m = vec![kind];
    // Serialising strings and numbers cannot fail.
    m.extend(serde_json::to_vec(body).unwrap_or_default());
    m
}

/// The wake queue of the worker VM with this nonce.
pub fn queue_name(nonce: u64) -> String {
    format!("ratelimit.wake.{nonce:016x}")
}

/// The shared-data key naming the courier of the plugin with this stat prefix and domain (a
/// configuration of another domain, during a reload, has a courier of its own).
pub fn key(stat_prefix: &str, domain: &str) -> String {
    format!("{stat_prefix}.courier.{domain}")
}

/// The courier's nonce as shared data holds it.
pub fn decode_nonce(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn messages_round_trip_with_their_kind() {
        let a = Answers {
            answers: vec![(7, Err(LimiterError::NoAnswer))],
        };
        let m = encode(ANSWERS, &a);
        assert_eq!(m[0], ANSWERS);
        let back: Answers = serde_json::from_slice(&m[1..]).unwrap();
        assert_eq!(back.answers, a.answers);
    }

    #[test]
    fn a_nonce_is_eight_bytes() {
        assert_eq!(decode_nonce(&42u64.to_le_bytes()), Some(42));
        assert_eq!(decode_nonce(b"short"), None);
        assert_eq!(queue_name(255), "ratelimit.wake.00000000000000ff");
    }
}
