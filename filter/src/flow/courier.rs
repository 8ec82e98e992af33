//! Shared callouts (`fast_paths.share_callouts`): who sends a worker's queued requests
//! ([`sender`]), and the messages the workers of one Envoy post to each other's wake queues
//! (`ratelimit.wake.<nonce>`, one per worker VM): one kind byte and a JSON body; a bare wake-up is
//! `w`. How the courier is named and replaced: docs/fast-paths.md#coalesced-callouts.

use ratelimit_wire::{LeaseReturn, RequestAnswer, RequestDecisions};
use serde::{Deserialize, Serialize};

use crate::verdict::LimiterError;

/// A bare wake-up (of a worker's own root context, or of the courier).
pub const WAKE: &[u8] = b"w";

/// Kind byte: a worker's queued requests, for the courier to send.
pub const FORWARD: u8 = b'F';
/// Kind byte: the courier's answers to a worker's forwarded requests.
pub const ANSWERS: u8 = b'A';

/// Requests forwarded to the courier.
#[derive(Debug, Serialize, Deserialize)]
pub struct Forward {
    /// The sending worker's nonce: where the answers go.
    pub origin: u64,
    pub requests: Vec<Forwarded>,
}

#[derive(Debug, Serialize, Deserialize)]
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
#[derive(Debug, Serialize, Deserialize)]
pub struct Answers {
    pub answers: Vec<Answer>,
    /// The policy epoch the call said it was decided under.
    #[serde(default)]
    pub epoch: Option<u64>,
}

/// Who sends a worker's queued requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sender {
    /// This worker: it is the courier, or it carries other workers' requests.
    ThisWorker,
    /// This worker, which takes the courier's place: none is named.
    TakeOver,
    /// The courier with this nonce: the queue is forwarded to it.
    Courier(u64),
}

/// Who sends the queued requests of the worker `this` (its nonce). A worker that carries other
/// workers' requests sends them itself, even if another was named the courier since they came
/// (they would otherwise wait for their deadline), and does not read the name; otherwise `named`
/// reads the courier's nonce from shared data.
pub fn sender(this: u64, carries_others: bool, named: impl FnOnce() -> Option<u64>) -> Sender {
    if carries_others {
        return Sender::ThisWorker;
    }
    match named() {
        Some(c) if c != this => Sender::Courier(c),
        Some(_) => Sender::ThisWorker,
        None => Sender::TakeOver,
    }
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
/// configuration of another domain, during a reload, has a courier of its own). `courier2`: the
/// deadlines a worker forwards are on the VM's [`crate::clock`] (monotonic), so a build before
/// (wall-clock deadlines), still running during a plugin update, names a courier of its own.
pub fn key(stat_prefix: &str, domain: &str) -> String {
    format!("{stat_prefix}.courier2.{domain}")
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
            epoch: Some(3),
        };
        let m = encode(ANSWERS, &a);
        assert_eq!(m[0], ANSWERS);
        let back: Answers = serde_json::from_slice(&m[1..]).unwrap();
        assert_eq!(back.answers, a.answers);
    }

    #[test]
    fn the_named_courier_sends_unless_this_worker_carries_others_or_none_is_named() {
        assert_eq!(sender(1, false, || Some(2)), Sender::Courier(2));
        assert_eq!(sender(1, false, || Some(1)), Sender::ThisWorker);
        assert_eq!(sender(1, false, || None), Sender::TakeOver);
        // Holding other workers' requests, a worker sends them without reading the name.
        assert_eq!(
            sender(1, true, || unreachable!("the name is not read")),
            Sender::ThisWorker
        );
    }

    #[test]
    fn a_nonce_is_eight_bytes() {
        assert_eq!(decode_nonce(&42u64.to_le_bytes()), Some(42));
        assert_eq!(decode_nonce(b"short"), None);
        assert_eq!(queue_name(255), "ratelimit.wake.00000000000000ff");
    }
}
