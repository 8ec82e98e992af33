//! A Redis that lost its state (issue 20, case 5), through the real sidecar binary and a real
//! Redis restarted empty: the sidecar sees the loss (its epoch marker gone: logged, counted in
//! `ratelimit_store_resets_total`), and `--store-reset` decides what a bucket Redis no longer
//! holds starts with. `empty` keeps a client within `C + r·T` over the whole run, loss included;
//! `full` (the default) hands it its capacity again, as documented.

use std::time::Duration;

use ratelimit_e2e::scenario::{spend_across, spend_across_a_loss, Loss};

/// C = 100, r = 100/s: full again within a second (the bucket refills at 10/s; the
/// bound is the same formula).
const POLICY: &str = "rules:\n  r: {capacity: 100, refill_per_sec: 100}\n";
const C: f64 = 100.0;
const R: f64 = 100.0;
const FILL: Duration = Duration::from_millis(1100);

#[test]
fn with_store_reset_empty_a_client_stays_within_its_bound_across_the_loss() {
    let run = spend_across_a_loss(POLICY, "empty", FILL, Duration::from_millis(500));
    let bound = C + R * run.seconds;
    println!("empty: {run:?}, bound C + r·T = {bound:.1}");
    assert!(run.resets >= 1.0, "the loss was not counted");
    assert!(run.admitted >= 100, "the capacity before the loss: {run:?}");
    assert!(
        run.admitted as f64 <= bound + 1.0,
        "{} admitted over {:.2} s against C + r·T = {bound:.1}",
        run.admitted,
        run.seconds
    );
}

#[test]
fn with_store_reset_full_a_client_gets_its_capacity_again_as_documented() {
    let run = spend_across_a_loss(POLICY, "full", FILL, Duration::from_millis(500));
    let bound = C + R * run.seconds;
    println!("full: {run:?}, bound C + r·T = {bound:.1}");
    assert!(run.resets >= 1.0, "the loss was not counted");
    // The documented deviation: the lost state's capacity again (about C more).
    assert!(
        run.admitted as f64 > bound + C / 2.0,
        "{} admitted over {:.2} s: the full bucket after the loss is missing",
        run.admitted,
        run.seconds
    );
}

/// Issue 32, case 6: `SAVE`, spend, kill Redis, restart it on the same directory. The marker
/// comes back with the snapshot, but the restarted server is a new one: the sidecar fences its
/// epoch before any bucket script runs there (NOSCRIPT), so the buckets the snapshot brought
/// back start empty at the new epoch under `empty`, and the loss is counted under both policies.
#[test]
fn a_redis_restarted_from_an_older_snapshot_is_a_loss_and_empty_keeps_the_bound() {
    let run = spend_across(
        Loss::Snapshot,
        POLICY,
        "empty",
        FILL,
        Duration::from_millis(500),
    );
    let bound = C + R * run.seconds;
    println!("snapshot, empty: {run:?}, bound C + r·T = {bound:.1}");
    assert!(run.resets >= 1.0, "the restore was not counted as a loss");
    assert!(run.admitted >= 100, "the capacity before the loss: {run:?}");
    assert!(
        run.admitted as f64 <= bound + 1.0,
        "{} admitted over {:.2} s against C + r·T = {bound:.1}",
        run.admitted,
        run.seconds
    );
    let run = spend_across(
        Loss::Snapshot,
        POLICY,
        "full",
        FILL,
        Duration::from_millis(500),
    );
    println!("snapshot, full: {run:?}");
    assert!(run.resets >= 1.0, "the restore was not counted as a loss");
}
