//! The short run of `make chaos` inside `make test` (docs/failure-behaviour.md, "Measured under
//! generated faults"): one seed's workload and faults over the real processes for 90 s, checked
//! against the bucket model and the README's allowances. Asserts only the invariants, never a
//! speed. `CHAOS_SEED` picks another seed (the report names it, to replay with `make chaos`).

use ratelimit_e2e::chaos::run::run;
use ratelimit_e2e::chaos::schedule::Plan;

#[test]
fn generated_faults_leave_every_bucket_within_its_allowance() {
    let seed = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let outcome = run(&Plan::draw(seed, 90));
    println!("{}", outcome.report());
    assert!(
        !outcome.violated(),
        "seed {seed} violated (replay: make chaos CHAOS_ARGS=\"--seed {seed} --seconds 90\"):\n{}",
        outcome.report()
    );
    // The run did what it is for: faults caused, requests admitted and refused.
    assert!(!outcome.log.faults.is_empty(), "no fault was caused");
    assert!(
        outcome.served > 100,
        "only {} requests served",
        outcome.served
    );
}
