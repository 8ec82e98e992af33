//! A region's Redis restored from an older snapshot (`docs/regions.md`, "A record restored from
//! an older state"), through the real processes ([`ratelimit_e2e::snapshot_restore`]): two Redis,
//! a sidecar per region, the rebalancer. C = 100, R = 10/s, shares 0.5/0.5 moved to 0.2 (us) /
//! 0.8 (eu), then us's Redis restarted from a snapshot taken before the move (its record back at
//! version 1, share 0.5).
//!
//! A fresh key asked far more than the budget in both regions at once is admitted at most what
//! one global bucket (C, R) admits over the burst, C + R·T, plus R times the fence's margin. A
//! sidecar that applied the restored 0.5 beside eu's 0.8 would admit 80 + 50 = 130. The restored
//! record was not written by the Redis process answering (its run_id), so us's sidecars, one
//! started after the restore included, apply at most the rule's floor (0.05) until the
//! rebalancer writes the record again; then the fenced share (0.2) applies again.

use ratelimit_e2e::snapshot_restore::{self, CAPACITY, FENCE_MARGIN_S, FLOOR, REFILL};

#[test]
fn a_region_restored_from_an_older_snapshot_never_applies_more_than_its_fenced_share() {
    let run = snapshot_restore::run();
    println!("rebalancer: {}", run.plan);
    let (eu_share, us_moved) = run.moved;
    println!("moved: eu {eu_share:.4} (v2), us {us_moved:.4} (v2)");
    assert!((eu_share - 0.8).abs() < 0.01 && (us_moved - 0.2).abs() < 0.01);
    println!("us after the restore: {}", run.restored);
    let b = run.after_restore;
    println!(
        "fresh key after the restore: eu {} + us {} = {} in {:.2} s (at most C + R·(T + margin) = {:.1})",
        b.eu,
        b.us,
        b.total(),
        b.seconds,
        b.bound()
    );
    assert!(
        b.total() as f64 <= b.bound(),
        "{} admitted across the regions, above the global bound {:.1}",
        b.total(),
        b.bound()
    );
    // eu holds its grown share; us at most the floor while its record is not trusted.
    assert!(
        b.eu as f64 >= CAPACITY * eu_share - 1.0,
        "eu admits its share"
    );
    assert!(b.us as f64 <= CAPACITY * FLOOR + REFILL * (b.seconds + FENCE_MARGIN_S));
    assert!((run.restored["share"].as_f64().unwrap() - FLOOR).abs() < 1e-9);
    let why = run.restored["suspect"]
        .as_str()
        .expect("/readyz says why the record is not trusted");
    assert!(why.contains("run_id"), "{why}");
    assert!(run.suspect_episodes >= 1.0, "counted");
    // A sidecar of us started after the restore (no version seen) applies the floor too.
    println!("a sidecar started after the restore: {}", run.restarted);
    assert!((run.restarted["share"].as_f64().unwrap() - FLOOR).abs() < 1e-9);
    assert!(run.restarted["suspect"].is_string());

    // The rebalancer's repair (by the live process) is trusted: the fenced share again.
    assert!(
        run.repair_logged,
        "the rebalancer reports the record it repairs"
    );
    println!(
        "us after the repair ({:.1} s after the restore): {}",
        run.repaired_after.as_secs_f64(),
        run.repaired
    );
    assert!((run.repaired["share"].as_f64().unwrap() - us_moved).abs() < 1e-9);
    assert!(run.repaired["suspect"].is_null());
    let b = run.after_repair;
    println!(
        "fresh key after the repair: eu {} + us {} = {} in {:.2} s (at most {:.1})",
        b.eu,
        b.us,
        b.total(),
        b.seconds,
        b.bound()
    );
    assert!(b.total() as f64 <= b.bound());
    assert!(
        b.us as f64 >= CAPACITY * us_moved - 1.0,
        "us admits its fenced share again"
    );
}
