//! `make scale`: how the decision path scales over Redis Cluster shards, measured with real
//! processes, and the shard model for a target load computed from this run's own figures
//! (docs/scaling.md explains every figure and the formula).
//!
//! 1. Shards: the sidecar's `POST /v1/decide` (and Envoy with the filter in front of it) against a
//!    Redis Cluster of 1, 2 and 3 primaries, for uniform keys and Zipf-skewed keys: decisions/s,
//!    Redis CPU per decision per shard (from `/proc/<pid>/stat` of each redis-server), the spread
//!    of keys (`DBSIZE`) and of load (decisions, CPU) across shards, the sidecar's CPU per
//!    decision; a primary with a replica, for what replication costs.
//! 2. A hot key (one bucket, so one shard): its shard's load per admitted request through the
//!    sidecar alone, and through Envoy with leases off and on.
//! 3. Latency with real hops: the gateway (this load generator), the sidecar and Redis in three
//!    network namespaces joined by veth pairs, a delay on one hop at a time (`tc netem`, or a
//!    userspace delay relay where the kernel has no netem), p50/p95/p99 of a decision.
//! 4. The model: Redis primaries, replicas and sidecar cores for the target decisions/s at the
//!    target utilisation, uniform and Zipf, from the figures above.
//!
//! Every stage runs against processes on this machine, which the load generator shares: read CPU
//! per decision (a cost, whatever the core count) and the ratios against the baseline of the same
//! run, not the absolute throughput. Nothing is asserted about timing.

use clap::Parser;
use ratelimit_e2e::stages::scale::{run, Args};

fn main() {
    run(Args::parse());
}
