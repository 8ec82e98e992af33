//! What a gateway knows about a bucket without asking: known rejections and leases, one
//! [`Entry`] per bucket in a [`Table`] of `slots` shared-data keys (`ratelimit.fp.<n>`), so every
//! worker VM of one Envoy sees them; how busy each bucket is at this worker ([`Hotness`]); and
//! the size of a lease ask ([`lease_size`]). It never admits what the bucket would not: a lease
//! pays only tokens Redis deducted for this gateway, and both a known rejection and a lease end
//! no later than Redis's own, their time counted from when the callout was dispatched. Each path,
//! why it is exact and what it may cost: docs/fast-paths.md.

use crate::config::FastPaths;

/// How long a rejection for a blocked subject or a cost above the capacity (no wait to go by) is
/// known, in nanoseconds.
pub const FIXED_REJECTION_NS: u64 = 1_000_000_000;

/// The entry format's version; 6: times from the VM's [`crate::clock`] (monotonic), not the wall
/// clock (an entry of a build before, still in shared data during a plugin update, is none).
const VERSION: u8 = 6;

/// A lease asks for this many times what its bucket would spend over the lease's time at the
/// rate measured (room for a rate that grows while it lasts).
pub const LEASE_HEADROOM: f64 = 1.25;

/// A lease is renewed once paying a request would leave it less than its grant divided by this
/// (a quarter).
pub const RENEW_TOKENS_DIVISOR: u64 = 4;

/// A lease is renewed once less than its time divided by this is left (its last tenth).
pub const RENEW_TIME_DIVISOR: u64 = 10;

/// A lease is renewed once what it holds would last fewer than this many round trips of the
/// last ask, at the rate it is being spent.
pub const RENEW_ROUND_TRIPS: u64 = 3;

/// The round trip of a bucket's lease asks, remembered as a decaying maximum: at each grant the
/// one remembered is kept at `ASK_RTT_KEPT / ASK_RTT_DIVISOR` of itself if the new one is
/// shorter (one slow answer is remembered for a few asks).
pub const ASK_RTT_KEPT: u64 = 3;
/// See [`ASK_RTT_KEPT`].
pub const ASK_RTT_DIVISOR: u64 = 4;

/// The shared-data key of the slot for a bucket id.
pub fn slot_key(id: &str, slots: usize) -> String {
    format!(
        "ratelimit.fp.{}",
        fnv1a(id.as_bytes()) % slots.max(1) as u64
    )
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// Why a bucket rejects (as the sidecar said), for a local reply of the same shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectionCause {
    Insufficient,
    CostExceedsCapacity,
    Blocked,
}

/// The limit a bucket was judged by, for the rate-limit headers of a local answer.
#[derive(Debug, Clone, PartialEq)]
pub struct KnownLimit {
    pub name: String,
    pub capacity: u64,
    pub refill_per_sec: f64,
}

mod entry;
mod hotness;
mod lease;
mod table;
#[cfg(test)]
mod tests;

pub use entry::{Entry, Lease};
pub use hotness::{Hotness, MAX_TRACKED, WINDOW_NS};
pub use lease::{lease_size, LeaseStart, PreviousLease};
pub use table::{DecisionOutcome, Learned, Probe, ProbeFor, Table};
