//! The emergency bucket: a local token bucket per `local` rule per Envoy process, used while the
//! sidecar cannot decide. Its state lives in proxy-wasm shared data (one key per rule, shared by
//! all worker VMs of the same `vm_id`) and is updated with compare-and-swap.
//!
//! The math is the Redis bucket's, said once in `ratelimit_bucket` (refill, `retry_after_ms`,
//! `reset_ms`), with time passed in explicitly (no clock in here) and no leases: the ceiling is
//! the capacity. A clock that went backward adds nothing.
//!
//! Only an admitting take is written back: a rejection changes nothing worth storing (the refill
//! is recomputed from `updated_ns` by the next take), and writing it would make the concurrent
//! takes of other workers fail their compare-and-swap in a flood of rejected requests.
//!
//! A request charges the buckets of all its `local` rules or none ([`take_all`]): they are per
//! rule, shared by every client, so tokens taken for a request another rule rejects would be lost.
//!
//! Start-up over-admission: proxy-wasm has no "create if absent", so [`ensure_initialized`] (and a
//! take that finds no key) writes a full bucket unconditionally. Two workers configuring at once
//! may each write one over the other's takes; this admits at most one extra `capacity` per bucket,
//! once, at start.

use ratelimit_bucket::{refill, reset_ms, retry_after_ms, whole};

use crate::config::Emergency;
use crate::shared::{compare_and_swap, SharedStore, Write};

/// The shared-data key of a rule's emergency bucket.
pub fn shared_key(rule: &str) -> String {
    format!("ratelimit.emergency.{rule}")
}

/// A token bucket's size and speed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EmergencyBucket {
    /// Tokens a full bucket holds.
    pub capacity: f64,
    /// Tokens added per second.
    pub refill_per_sec: f64,
}

impl From<&Emergency> for EmergencyBucket {
    fn from(e: &Emergency) -> Self {
        EmergencyBucket {
            capacity: e.capacity as f64,
            refill_per_sec: e.refill_per_sec,
        }
    }
}

/// A bucket's state: its tokens at `updated_ns`. Encoded as 17 bytes: [`STATE_VERSION`], then
/// `tokens` (f64) and `updated_ns` (u64), both little-endian.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct State {
    pub tokens: f64,
    pub updated_ns: u64,
}

/// The state format's version; 1: `updated_ns` from the VM's [`crate::clock`] (monotonic). A
/// state of a build before (the wall clock, 16 bytes) is not one: the bucket starts full.
const STATE_VERSION: u8 = 1;

impl State {
    /// A full bucket at `now_ns`.
    pub fn full(bucket: &EmergencyBucket, now_ns: u64) -> State {
        State {
            tokens: bucket.capacity,
            updated_ns: now_ns,
        }
    }

    pub fn encode(&self) -> [u8; 17] {
        let mut out = [0u8; 17];
        out[0] = STATE_VERSION;
        out[1..9].copy_from_slice(&self.tokens.to_le_bytes());
        out[9..].copy_from_slice(&self.updated_ns.to_le_bytes());
        out
    }

    /// The state in `bytes`, or `None` when they are not a well-formed state.
    pub fn decode(bytes: &[u8]) -> Option<State> {
        let bytes: &[u8; 17] = bytes.try_into().ok()?;
        let (version, rest) = bytes.split_first()?;
        let (tokens, updated) = rest.split_at(8);
        let tokens = f64::from_le_bytes(tokens.try_into().ok()?);
        let updated_ns = u64::from_le_bytes(updated.try_into().ok()?);
        (*version == STATE_VERSION && tokens.is_finite() && tokens >= 0.0)
            .then_some(State { tokens, updated_ns })
    }
}

/// The result of one [`EmergencyBucket::take`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Take {
    /// The state to store.
    pub state: State,
    pub allowed: bool,
    /// Whole tokens left after this take.
    pub remaining: u64,
    /// Milliseconds until `cost` tokens are available; 0 when allowed.
    pub retry_after_ms: u64,
    /// Milliseconds until the bucket is full again (after this take, if allowed).
    pub reset_ms: u64,
}

impl EmergencyBucket {
    /// Takes `cost` tokens at `now_ns` from the bucket whose stored state is `state` (absent or
    /// malformed: a full bucket). Pure: the caller stores `Take::state`.
    pub fn take(&self, state: Option<&[u8]>, now_ns: u64, cost: f64) -> Take {
        let previous = state
            .and_then(State::decode)
            .unwrap_or_else(|| State::full(self, now_ns));
        let elapsed_us = now_ns.saturating_sub(previous.updated_ns) as f64 / 1e3;
        let tokens = refill(
            previous.tokens,
            self.refill_per_sec,
            elapsed_us,
            self.capacity,
        );
        // Never move `updated_ns` backward: the interval up to it has been counted already.
        let updated_ns = previous.updated_ns.max(now_ns);
        let allowed = tokens >= cost;
        let tokens = if allowed { tokens - cost } else { tokens };
        Take {
            state: State { tokens, updated_ns },
            allowed,
            remaining: whole(tokens),
            retry_after_ms: if allowed {
                0
            } else {
                retry_after_ms(cost, tokens, self.refill_per_sec)
            },
            reset_ms: reset_ms(self.capacity, tokens, self.refill_per_sec),
        }
    }
}

/// The bucket could not be updated: too much contention, or the host refused the write. The
/// request is denied (never admitted uncounted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Contention;

/// Takes `cost` from the shared bucket `key` with [`compare_and_swap`].
pub fn take_shared(
    store: &dyn SharedStore,
    key: &str,
    bucket: &EmergencyBucket,
    now_ns: u64,
    cost: f64,
) -> Result<Take, Contention> {
    compare_and_swap(store, key, |bytes| {
        let take = bucket.take(bytes, now_ns, cost);
        if take.allowed {
            Write::Store(take.state.encode().to_vec(), take)
        } else {
            // Nothing to store: see the module doc.
            Write::Keep(take)
        }
    })
    .map_err(|_| Contention)
}

/// What [`take_shared`] would answer now, without writing.
pub fn peek_shared(
    store: &dyn SharedStore,
    key: &str,
    bucket: &EmergencyBucket,
    now_ns: u64,
    cost: f64,
) -> Take {
    bucket.take(store.get(key).0.as_deref(), now_ns, cost)
}

/// Gives `cost` tokens back to the shared bucket `key` (an earlier take of a request that ended
/// up rejected), capped at `capacity`, with compare-and-swap. `false` when it could not be
/// written (the tokens are then lost, as they would have been without the give-back).
pub fn give_back(store: &dyn SharedStore, key: &str, bucket: &EmergencyBucket, cost: f64) -> bool {
    compare_and_swap(store, key, |bytes| match bytes.and_then(State::decode) {
        // Absent or malformed reads as a full bucket already.
        None => Write::Keep(()),
        Some(state) => {
            let state = State {
                tokens: (state.tokens + cost).min(bucket.capacity),
                ..state
            };
            Write::Store(state.encode().to_vec(), ())
        }
    })
    .is_ok()
}

/// One bucket a request charges: its shared-data key, size and cost.
#[derive(Debug, Clone, PartialEq)]
pub struct EmergencyCharge {
    pub key: String,
    pub bucket: EmergencyBucket,
    pub cost: f64,
}

/// Charges every bucket of `charges` or none, returning what each said (in order).
///
/// First every bucket is checked without writing; if one would reject, nothing is written and the
/// result holds those checks. Otherwise each is taken with [`take_shared`]; if a take fails (a
/// concurrent request took the tokens in between, or contention), the takes before it are given
/// back ([`give_back`]) and the results end at the failed one.
pub fn take_all(
    store: &dyn SharedStore,
    charges: &[EmergencyCharge],
    now_ns: u64,
) -> Vec<Result<Take, Contention>> {
    let peeks: Vec<Take> = charges
        .iter()
        .map(|c| peek_shared(store, &c.key, &c.bucket, now_ns, c.cost))
        .collect();
    if peeks.iter().any(|t| !t.allowed) {
        return peeks.into_iter().map(Ok).collect();
    }
    let mut results = Vec::with_capacity(charges.len());
    for (i, c) in charges.iter().enumerate() {
        let take = take_shared(store, &c.key, &c.bucket, now_ns, c.cost);
        let admitted = matches!(take, Ok(t) if t.allowed);
        results.push(take);
        if !admitted {
            for earlier in &charges[..i] {
                give_back(store, &earlier.key, &earlier.bucket, earlier.cost);
            }
            break;
        }
    }
    results
}

/// Stores a full bucket under `key` unless one is there already (at configuration time, before
/// traffic, so the first takes of several workers find a versioned value to compare against).
///
/// The check and the write are not atomic (proxy-wasm has no create-if-absent): a worker that
/// configures after another worker's first takes may overwrite them with a full bucket. The
/// over-admission is bounded by one `capacity` per bucket, at start only.
pub fn ensure_initialized(
    store: &dyn SharedStore,
    key: &str,
    bucket: &EmergencyBucket,
    now_ns: u64,
) {
    let (bytes, _) = store.get(key);
    if bytes.as_deref().and_then(State::decode).is_none() {
        let _ = store.set(key, &State::full(bucket, now_ns).encode(), None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::fake::Memory;
    use crate::shared::MAX_CAS_ATTEMPTS;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const S: u64 = 1_000_000_000;
    const T0: u64 = 1_700_000_000 * S;

    fn bucket() -> EmergencyBucket {
        EmergencyBucket {
            capacity: 10.0,
            refill_per_sec: 1.0,
        }
    }

    #[test]
    fn a_fresh_bucket_admits_exactly_capacity_at_one_instant() {
        let b = bucket();
        let mut state: Option<[u8; 17]> = None;
        let mut admitted = 0;
        for _ in 0..15 {
            let t = b.take(state.as_ref().map(|s| &s[..]), T0, 1.0);
            state = Some(t.state.encode());
            admitted += usize::from(t.allowed);
        }
        assert_eq!(admitted, 10);
    }

    #[test]
    fn rejection_says_when_the_cost_is_back() {
        let b = bucket();
        let empty = State {
            tokens: 0.25,
            updated_ns: T0,
        }
        .encode();
        let t = b.take(Some(&empty), T0, 1.0);
        assert!(!t.allowed);
        assert_eq!(t.retry_after_ms, 750);
        assert_eq!(t.remaining, 0);
        let t = b.take(Some(&empty), T0, 3.0);
        assert_eq!(t.retry_after_ms, 2750);
    }

    #[test]
    fn refill_follows_elapsed_time_up_to_capacity() {
        let b = bucket();
        let empty = State {
            tokens: 0.0,
            updated_ns: T0,
        }
        .encode();
        let t = b.take(Some(&empty), T0 + 2 * S + S / 2, 1.0);
        assert!(t.allowed);
        assert_eq!(t.state.tokens, 1.5);
        assert_eq!(t.remaining, 1);
        let t = b.take(Some(&empty), T0 + 3600 * S, 1.0);
        assert_eq!(t.state.tokens, 9.0);
    }

    #[test]
    fn a_clock_going_backward_adds_nothing_and_keeps_the_later_time() {
        let b = bucket();
        let s = State {
            tokens: 0.5,
            updated_ns: T0,
        }
        .encode();
        let t = b.take(Some(&s), T0 - 5 * S, 1.0);
        assert!(!t.allowed);
        assert_eq!(t.state.tokens, 0.5);
        assert_eq!(t.state.updated_ns, T0);
        assert_eq!(t.retry_after_ms, 500);
        // The next call at T0 + 0.5 s counts only the half second after T0.
        let t = b.take(Some(&t.state.encode()), T0 + S / 2, 1.0);
        assert!(t.allowed);
        assert_eq!(t.state.tokens, 0.0);
    }

    #[test]
    fn state_is_sixteen_bytes_and_garbage_is_a_full_bucket() {
        let s = State {
            tokens: 3.5,
            updated_ns: 42,
        };
        assert_eq!(State::decode(&s.encode()), Some(s));
        assert_eq!(State::decode(&[1, 2, 3]), None);
        let nan = State {
            tokens: f64::NAN,
            updated_ns: 1,
        }
        .encode();
        assert_eq!(State::decode(&nan), None);
        let t = bucket().take(Some(&[9; 3]), T0, 1.0);
        assert!(t.allowed);
        assert_eq!(t.state.tokens, 9.0);
        assert_eq!(t.state.encode().len(), 17);
        // A build before's state (wall-clock time, no version byte) is not one.
        assert_eq!(State::decode(&s.encode()[1..]), None);
    }

    #[test]
    fn a_smaller_capacity_after_reconfiguration_clamps_the_tokens() {
        let big = State {
            tokens: 500.0,
            updated_ns: T0,
        }
        .encode();
        let t = bucket().take(Some(&big), T0, 1.0);
        assert_eq!(t.state.tokens, 9.0);
    }

    #[test]
    fn reset_says_when_the_bucket_is_full_again() {
        let b = bucket();
        let t = b.take(None, T0, 1.0);
        assert_eq!((t.remaining, t.reset_ms), (9, 1000));
        let s = State {
            tokens: 0.5,
            updated_ns: T0,
        }
        .encode();
        let t = b.take(Some(&s), T0, 1.0);
        assert!(!t.allowed);
        assert_eq!(t.reset_ms, 9500);
    }

    /// The tokens the bucket under `key` holds.
    fn tokens(store: &Memory, key: &str) -> f64 {
        State::decode(&store.get(key).0.unwrap()).unwrap().tokens
    }

    /// Another worker stores a bucket of `tokens` under `key`.
    fn put(store: &Memory, key: &str, tokens: f64) {
        store.put(key, &state(tokens));
    }

    fn state(tokens: f64) -> Vec<u8> {
        State {
            tokens,
            updated_ns: T0,
        }
        .encode()
        .to_vec()
    }

    #[test]
    fn shared_takes_retry_on_cas_mismatch() {
        let store = Memory::default();
        let key = shared_key("per-app");
        assert_eq!(key, "ratelimit.emergency.per-app");
        ensure_initialized(&store, &key, &bucket(), T0);
        store.conflicts.set(5);
        let t = take_shared(&store, &key, &bucket(), T0, 1.0).unwrap();
        assert!(t.allowed);
        assert_eq!(store.writes.get(), 1 + 6);
        let stored = State::decode(&store.get(&key).0.unwrap()).unwrap();
        assert_eq!(stored.tokens, 9.0);
    }

    #[test]
    fn endless_contention_denies() {
        let store = Memory::default();
        store.conflicts.set(usize::MAX);
        assert_eq!(
            take_shared(&store, "k", &bucket(), T0, 1.0),
            Err(Contention)
        );
        assert_eq!(store.writes.get(), MAX_CAS_ATTEMPTS);
    }

    #[test]
    fn initialization_keeps_an_existing_bucket() {
        let store = Memory::default();
        let key = shared_key("r");
        ensure_initialized(&store, &key, &bucket(), T0);
        take_shared(&store, &key, &bucket(), T0, 4.0).unwrap();
        ensure_initialized(&store, &key, &bucket(), T0);
        let stored = State::decode(&store.get(&key).0.unwrap()).unwrap();
        assert_eq!(stored.tokens, 6.0);
    }

    #[test]
    fn a_rejected_take_writes_nothing_and_cannot_be_contended() {
        let store = Memory::default();
        put(&store, "k", 0.0);
        let t = take_shared(&store, "k", &bucket(), T0, 1.0).unwrap();
        assert!(!t.allowed);
        assert_eq!(store.writes.get(), 0);
        // Even while every write would conflict, a rejection is an answer, not contention.
        store.conflicts.set(usize::MAX);
        let t = take_shared(&store, "k", &bucket(), T0, 1.0).unwrap();
        assert!(!t.allowed);
        assert_eq!(t.retry_after_ms, 1000);
        assert_eq!(store.writes.get(), 0);
    }

    fn charge(key: &str) -> EmergencyCharge {
        EmergencyCharge {
            key: key.into(),
            bucket: bucket(),
            cost: 1.0,
        }
    }

    #[test]
    fn take_all_charges_nothing_when_one_bucket_rejects() {
        let store = Memory::default();
        put(&store, "a", 5.0);
        put(&store, "b", 0.0);
        let results = take_all(&store, &[charge("a"), charge("b")], T0);
        assert_eq!(results.len(), 2);
        assert!(results[0].unwrap().allowed);
        assert!(!results[1].unwrap().allowed);
        assert_eq!(store.writes.get(), 0);
        assert_eq!(tokens(&store, "a"), 5.0);
    }

    #[test]
    fn take_all_charges_every_bucket_when_all_admit() {
        let store = Memory::default();
        put(&store, "a", 5.0);
        put(&store, "b", 2.0);
        let results = take_all(&store, &[charge("a"), charge("b")], T0);
        assert!(results.iter().all(|r| r.unwrap().allowed));
        assert_eq!((tokens(&store, "a"), tokens(&store, "b")), (4.0, 1.0));
    }

    #[test]
    fn take_all_gives_back_earlier_takes_when_a_later_one_loses_a_race() {
        let store = Memory::default();
        put(&store, "a", 5.0);
        put(&store, "b", 1.0);
        // Between our check and our take, another worker empties `b`.
        store.interleave.replace(Some(("b".into(), state(0.0))));
        let results = take_all(&store, &[charge("a"), charge("b")], T0);
        assert_eq!(results.len(), 2);
        assert!(!results[1].unwrap().allowed);
        assert_eq!(tokens(&store, "a"), 5.0);
        assert_eq!(tokens(&store, "b"), 0.0);
    }

    #[test]
    fn give_back_is_capped_at_capacity() {
        let store = Memory::default();
        put(&store, "a", 9.5);
        assert!(give_back(&store, "a", &bucket(), 3.0));
        assert_eq!(tokens(&store, "a"), 10.0);
        assert!(give_back(&store, "absent", &bucket(), 1.0));
        assert!(store.get("absent").0.is_none());
    }
}
