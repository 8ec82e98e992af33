//! A policy reload reaches the gateway's fast paths within 100 ms: one Envoy (two workers), two
//! hot clients holding leases; the policy is rewritten and the sidecar sent SIGHUP. From the
//! moment the sidecar's `GET /v1/epoch` shows the new epoch (t0), no request sent after t0 +
//! 100 ms is admitted from a lease or answered from a known rejection learned under the old
//! policy: the limit lowered (no lease admission), raised again (no 429 at all: the lowered
//! limit's rejections are not answered), the clients blocked (nothing admitted, no `Retry-After`
//! of the old limit), raised again (no 429: the blocked rejections are not answered). The bound
//! and why: docs/fast-paths.md#policy-reloads.

use std::time::Duration;

use ratelimit_e2e::reload::{Stack, Step, OPEN};
use serde_json::json;

const WINDOW: Duration = Duration::from_millis(600);

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
