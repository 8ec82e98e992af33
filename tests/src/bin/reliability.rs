//! `make reliability`: failure behaviour, measured. Starts the real processes on loopback (Redis
//! single, Sentinel or Cluster, the sidecar binary, Envoy with the filter, an upstream), puts load
//! on them, breaks them on purpose, and prints ONE table (markdown, as docs/failure-behaviour.md
//! carries it): per scenario the load, the fault, what was admitted and rejected, the
//! over-admission against the exact bound, the gateway's decision time (p50/p99 at the client,
//! and from the filter's `decision_us` histogram where useful), errors and recovery time.
//!
//! Every scenario is bounded in time; its processes are stopped when it ends, also when it fails
//! (the harness kills on drop; a failed scenario becomes a row saying so). Bounds are computed and
//! checked (✓/✗) in the last column; timings are printed, never judged.
//!
//! Scenarios (`--scenario 1,3` runs some): 1 shared budget, 2 hot key, 3 Redis slow/down per
//! `on_error`, 4 failover (Sentinel, Cluster), 5 uncertain results, 6 sidecar restart, 7 flood,
//! 8 many clients, 9 a region's Redis restored from an older snapshot, 10 policy reload under
//! leases, 11 a Redis that lost its state, 12 a Redis restarted from an older snapshot, 13
//! concurrency slots lost with the store, 14 a Redis Cluster's epochs.

use std::time::Instant;

use clap::Parser;
use ratelimit_e2e::stages::reliability::{run_scenario, table, Args, Row, SCENARIOS};

fn main() {
    let args = Args::parse();
    let started = Instant::now();
    let rows: Vec<Row> = SCENARIOS
        .into_iter()
        .filter(|(n, ..)| args.scenario.is_empty() || args.scenario.contains(n))
        .flat_map(|(n, name, run)| run_scenario(&args, n, name, run))
        .collect();
    let out = table(&rows);
    println!("{out}");
    println!(
        "({} scenarios in {:.0} s; ✓ a bound held, ✗ it did not)",
        rows.len(),
        started.elapsed().as_secs_f64()
    );
    if let Some(path) = &args.out {
        std::fs::write(path, &out).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
    if rows.iter().any(|r| r.check.contains('✗')) {
        std::process::exit(1);
    }
}
