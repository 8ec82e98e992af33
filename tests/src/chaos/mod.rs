//! Exactness checked by exploration (`make chaos`, docs/failure-behaviour.md#measured-under-
//! generated-faults): a seed draws a workload and a schedule of faults over a whole topology of
//! real processes; the upstream records what it was sent (the ground truth of what the gateways
//! admitted), the nemesis logs what it broke and when, and a checker holds the record against
//! the bucket model and the policy in force, granting each fault the README's allowance and
//! nothing more. A violation comes with its seed, its schedule and the smallest window that shows
//! it, and [`shrink`] re-runs the schedule with fewer faults until none can be dropped.
//!
//! - [`schedule`]: the seed's plan (store policy, faults, reloads), the same for the same seed;
//! - [`topology`]: the processes (Redis, its replica and Sentinels, sidecars, wasm Envoys behind
//!   relays, an Envoy with the native rate limit filter, one with the quota filter (RLQS), the
//!   recording upstream) and the hands the nemesis breaks them with;
//! - [`relay`]: a TCP relay that passes, delays or cuts (this kernel has no netem);
//! - [`workload`]: the clients, each request tagged with an id the upstream records;
//! - [`nemesis`]: carries the schedule out and logs each fault (and each failover it sees);
//! - [`check`]: the checker; [`run`]: one run, start to table; [`shrink`]: the smallest schedule.

pub mod check;
pub mod nemesis;
pub mod relay;
pub mod run;
pub mod schedule;
pub mod shrink;
pub mod topology;
pub mod workload;

use std::sync::LazyLock;
use std::time::Instant;

static ZERO: LazyLock<Instant> = LazyLock::new(Instant::now);

/// Nanoseconds since this process first asked: the one clock every record of a run is stamped
/// with (the upstream runs in this process).
pub fn clock_ns() -> u64 {
    u64::try_from(ZERO.elapsed().as_nanos()).unwrap_or(u64::MAX)
}
