//! The bucket script's cost in Redis, the script before the split against the one the sidecar
//! sends now (`ratelimit_e2e::script_cost`): a short run that checks the measurement itself and
//! prints its figures. `make bench` runs the full comparison (docs/benchmarks.md);
//! `SCRIPT_COST_ROUNDS=n` runs n rounds here.

use ratelimit_e2e::script_cost::{apply_call, before_call, compare, report, APPLY, BEFORE};

#[test]
fn both_scripts_are_measured_side_by_side_on_one_redis() {
    let rounds = std::env::var("SCRIPT_COST_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let decisions = std::env::var("SCRIPT_COST_DECISIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000);
    let costs = compare(
        &[
            ("before", BEFORE, before_call),
            ("after", APPLY, apply_call),
        ],
        &[1, 32],
        rounds,
        decisions,
        1_000,
    );
    println!("{}", report(&costs));
    assert_eq!(costs.len(), 4, "two scripts at two batch sizes");
    for c in &costs {
        assert_eq!(c.in_script_us.len(), rounds, "{c:?}");
        // Every decision runs inside a script call, and the call is part of Redis's CPU.
        assert!(c.median_in_script() > 0.0, "{c:?}");
        assert!(c.median_cpu() > 0.0, "{c:?}");
    }
}
