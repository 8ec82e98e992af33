//! Scenario 10: policy reloads under leases, with one and two sidecars.

use super::*;

pub(crate) fn policy_reload(a: &Args) -> Vec<Row> {
    use crate::reload::{Stack, BOUND, OPEN};
    let window = Duration::from_secs(a.seconds).min(Duration::from_secs(1));
    // The filter's defaults: the epoch polled every 50 ms, 5 ticks per poll.
    let (poll_ms, tick_ms) = (50, 10);
    let mut stack = Stack::start(json!({}));
    let steps = [
        (
            "lowered to capacity 10, refill 1/s",
            "{capacity: 10, refill_per_sec: 1}",
        ),
        ("blocked (`blocked: true`)", "{blocked: true}"),
    ];
    let mut rows = Vec::new();
    for (i, (name, spec)) in steps.into_iter().enumerate() {
        if i > 0 {
            stack.reload(OPEN, window);
            stack.wait_for_leases();
        }
        log(&format!("10: {name}"));
        let s = stack.reload(spec, window);
        let stale = s.stale_lease_admissions();
        let ms_of = |d: Option<Duration>| d.map_or("none".to_string(), ms);
        rows.push(Row {
            scenario: format!("10 policy reload, {name}"),
            load: "2 hot clients (2 connections each) holding leases, 1 Envoy ×2 workers, 1 sidecar, 1 Redis; 20000 + 20000/s before".into(),
            fault: format!(
                "policy rewritten, SIGHUP; t0 = the sidecar's /v1/epoch shows it ({} after SIGHUP)",
                ms(s.seen_after)
            ),
            admitted: format!(
                "{} after t0 ({} from leases; {} of the new policy's leases granted)",
                s.admitted, s.lease_admitted, s.granted
            ),
            rejected: format!("{} sent after t0 + 100 ms", s.late_rejected),
            over: format!("{stale} from old leases after t0 + 100 ms"),
            client: String::new(),
            filter: filter_cell(&[&stack.envoy]),
            errors: "0".into(),
            recovery: format!(
                "last admission sent {} after t0; last lease admission counted by {}",
                ms_of(s.last_admission),
                ms_of(s.last_lease_admission)
            ),
            check: {
                let blocked = spec.contains("blocked");
                let mut c = format!(
                    "old leases after t0 + {} ms: {stale} {}",
                    BOUND.as_millis(),
                    mark(stale == 0)
                );
                if blocked {
                    c += &format!(
                        "; admitted after it: {}, stale Retry-After: {} {}",
                        s.late_admitted,
                        s.late_retry_after,
                        mark(s.late_admitted == 0 && s.late_retry_after == 0)
                    );
                }
                c + &format!("; bound poll + 2·tick + RTT = {} ms + RTT", poll_ms + 2 * tick_ms)
            },
        });
    }
    stack.stop();
    rows.push(policy_reload_two_sidecars(window, poll_ms + 2 * tick_ms));
    rows
}

/// Scenario 10 with two sidecars behind the Envoy, reloaded `GAP` apart: the bound from the
/// second one's t0.
pub(crate) fn policy_reload_two_sidecars(window: Duration, bound_ms: u64) -> Row {
    use crate::reload::{Stack, BOUND};
    const GAP: Duration = Duration::from_millis(500);
    log("10: two sidecars reloading 500 ms apart");
    let mut stack = Stack::start_with(json!({}), 2);
    let s = stack.reload_one_then_the_other("{capacity: 10, refill_per_sec: 1}", GAP, window);
    stack.stop();
    let (a, stale) = (&s.after, s.after.stale_lease_admissions());
    let ms_of = |d: Option<Duration>| d.map_or("none".to_string(), ms);
    Row {
        scenario: "10 policy reload, two sidecars reloading 500 ms apart, lowered to capacity 10, refill 1/s".into(),
        load: "as above, the Envoy's sidecar cluster with 2 endpoints (2 sidecars on 1 Redis, a policy file each)".into(),
        fault: format!(
            "one sidecar's policy rewritten and SIGHUP, the other's {} later; t0 = the second's /v1/epoch shows it",
            ms(s.gap)
        ),
        admitted: format!(
            "between the reloads {} from leases (after the first t0 + {} ms); {} after t0 ({} from leases; {} of the new policy's leases granted)",
            s.gap_lease_admitted,
            BOUND.as_millis(),
            a.admitted,
            a.lease_admitted,
            a.granted
        ),
        rejected: format!("{} sent after t0 + 100 ms", a.late_rejected),
        over: format!("{stale} from old leases after t0 + 100 ms"),
        client: String::new(),
        filter: String::new(),
        errors: "0".into(),
        recovery: format!(
            "callouts {:.0}/s between the reloads ({:.0}/s before); last lease admission (the new policy's included) counted by {} after t0",
            s.gap_callouts_per_sec,
            s.before_callouts_per_sec,
            ms_of(a.last_lease_admission)
        ),
        check: format!(
            "old leases after t0 + {} ms: {stale} {}; the sidecars' epochs agree {}; bound: the last sidecar's reload + poll + 2·tick + RTT = {bound_ms} ms + RTT",
            BOUND.as_millis(),
            mark(stale == 0),
            mark(s.epochs.0 == s.epochs.1)
        ),
    }
}
