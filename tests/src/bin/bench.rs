//! `make bench`: what one rate-limit decision costs, measured against baselines in the same run.
//!
//! Every stage runs the same closed loop (N concurrent callers for a fixed time) against real
//! processes on this machine, and reports throughput, latency and the CPU each process spent per
//! operation (from /proc, so the figure is a cost, independent of how many cores the machine has).
//!
//! Components: Redis's own ceiling (`INCR`), the bucket script with one decision per call and
//! with a batch per call, the sidecar's `POST /v1/decide` with one request per call and with a
//! batch. Then Envoy (1 and 2 workers) in front of an upstream, for three workloads:
//! - many distinct keys (10,000 clients told apart by address, each mostly admitted);
//! - a hot key (one client, mostly admitted);
//! - a flood (one client far over an exhausted limit: every request rejected);
//!
//! through: no filter (the baseline), a wasm filter that does nothing (the floor of any
//! proxy-wasm path), Envoy's `local_ratelimit` (no shared budget), the wasm filter calling the
//! sidecar once per request (every fast path off), the wasm filter as shipped (coalesced
//! callouts, known rejections, leases), and Envoy's native `ratelimit` filter calling the sidecar
//! over gRPC. The Envoy stages run in `--rounds` rounds (3 by default), the stages taking turns,
//! and the goals are judged on each stage's medians: one stage on a shared machine moves by 10%
//! or more from one run to the next.
//!
//! All figures are printed, then the goals as ratios from this run; none is asserted. On a
//! 2-core machine the load generator, Redis, the sidecar and Envoy share the cores: read the ratios
//! and the CPU per operation, not the absolute throughput.

use clap::Parser;
use ratelimit_e2e::stages::bench::{run, Args};

fn main() {
    run(Args::parse());
}
