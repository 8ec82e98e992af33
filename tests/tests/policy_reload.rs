//! A policy reload reaches the gateway's fast paths within 100 ms: one Envoy (two workers), two
//! hot clients holding leases; the policy is rewritten and the sidecar sent SIGHUP. From the
//! moment the sidecar's `GET /v1/epoch` shows the new epoch (t0), no request sent after t0 +
//! 100 ms is admitted from a lease or answered from a known rejection learned under the old
//! policy: the limit lowered (no lease admission), raised again (no 429 at all: the lowered
//! limit's rejections are not answered), the clients blocked (nothing admitted, no `Retry-After`
//! of the old limit), raised again (no 429: the blocked rejections are not answered). With two
//! sidecars behind the Envoy reloading 500 ms apart, the same from the second one's t0. The bound
//! and why: docs/fast-paths.md#policy-reloads.

use std::time::Duration;

use ratelimit_e2e::reload::{Stack, Step, BOUND, OPEN};
use serde_json::json;

const WINDOW: Duration = Duration::from_millis(600);
/// Between the two sidecars' reloads.
const GAP: Duration = Duration::from_millis(500);

fn show(name: &str, s: &Step) {
    println!(
        "{name}: seen {:?} after SIGHUP; {} admitted after t0, the last sent {:?} after it; {} from leases, the last counted by {:?}; sent after t0 + 100 ms: {} admitted, {} rejected ({} with Retry-After), {} admitted from leases (leases of the new policy granted {} tokens)",
        s.seen_after, s.admitted, s.last_admission, s.lease_admitted, s.last_lease_admission,
        s.late_admitted, s.late_rejected, s.late_retry_after, s.late_lease_admitted, s.granted
    );
}

#[test]
fn after_a_reload_no_lease_admits_and_no_stale_rejection_answers_past_100_ms() {
    let mut stack = Stack::start(json!({}));
    let mut run = |name: &str, spec: &str| {
        let s = stack.reload(spec, WINDOW);
        show(name, &s);
        s
    };
    let lowered = run(
        "lowered to capacity 10, refill 1/s",
        "{capacity: 10, refill_per_sec: 1}",
    );
    let raised_from_lowered = run("raised again", OPEN);
    stack.wait_for_leases();
    let blocked = stack.reload("{blocked: true}", WINDOW);
    show("blocked", &blocked);
    let raised_from_blocked = stack.reload(OPEN, WINDOW);
    show("raised again", &raised_from_blocked);
    stack.stop();

    assert_eq!(
        lowered.stale_lease_admissions(),
        0,
        "lowered: leases of the old policy admitted after t0 + 100 ms (lease admissions beyond the tokens granted under the new one)"
    );
    assert_eq!(
        (blocked.late_admitted, blocked.late_lease_admitted),
        (0, 0),
        "blocked: admitted after t0 + 100 ms (from leases: the second)"
    );
    assert_eq!(
        blocked.late_retry_after, 0,
        "blocked: 429s with the old limit's Retry-After (stale known rejections) after t0 + 100 ms"
    );
    assert!(
        blocked.late_rejected > 0,
        "blocked: no traffic after t0 + 100 ms"
    );
    for (raised, from) in [
        (raised_from_lowered, "lowered"),
        (raised_from_blocked, "blocked"),
    ] {
        assert_eq!(
            raised.late_rejected, 0,
            "raised from {from}: 429s (stale known rejections) after t0 + 100 ms"
        );
        assert!(
            raised.late_admitted > 0,
            "raised from {from}: nothing admitted after t0 + 100 ms"
        );
    }
}

/// Issue 32 (suspected): several sidecars reloading at different times make the policy epoch
/// flap. One Envoy whose sidecar cluster has two endpoints (two sidecars on one Redis, a policy
/// file each), two hot clients holding leases; the lowered limit is written to one sidecar's file,
/// then 500 ms later to the other's. Meanwhile the Envoy's polls and decisions reach either, so
/// the epoch it answers under changes back and forth: a lease or a known rejection answers only
/// under the epoch it was learned under, so a flap makes the other epoch's state not answer
/// (callouts instead, under-admission), and the old policy's leases keep paying while a sidecar
/// still grants them. From the second sidecar's t0 the single-sidecar bound holds: no request is
/// admitted from a lease of the old policy after t0 + 100 ms.
#[test]
fn two_sidecars_reloading_at_different_times_admit_from_no_old_lease_past_the_last_reload_and_the_bound(
) {
    let mut stack = Stack::start_with(json!({}), 2);
    let s = stack.reload_one_then_the_other("{capacity: 10, refill_per_sec: 1}", GAP, WINDOW);
    stack.stop();
    println!(
        "two sidecars, the second reloaded {:?} after the first; between them: {} lease admissions counted from the first t0 + {} ms ({} tokens granted under the new policy by the first), callouts {:.0}/s (before: {:.0}/s); epochs after both {:?}",
        s.gap,
        s.gap_lease_admitted,
        BOUND.as_millis(),
        s.gap_granted,
        s.gap_callouts_per_sec,
        s.before_callouts_per_sec,
        s.epochs
    );
    show("from the second sidecar's t0", &s.after);
    assert_eq!(
        s.epochs.0, s.epochs.1,
        "two sidecars with the same policy text agree on the epoch"
    );
    assert_eq!(
        s.after.stale_lease_admissions(),
        0,
        "leases of the old policy admitted after the second sidecar's t0 + 100 ms (lease admissions beyond the tokens granted under the new one)"
    );
    assert!(
        s.after.late_rejected > 0,
        "no traffic after the second t0 + 100 ms"
    );
}
