//! Scenarios 9, 11 to 14: a region restored from a snapshot, a Redis that lost its state, slots lost with it, a Cluster's epochs.

use super::*;

pub(crate) fn snapshot_restore(_: &Args) -> Vec<Row> {
    use crate::snapshot_restore::{self as sr, ASKED, CAPACITY, FLOOR};
    log("9: two regions, a rebalance, us's Redis restored from an older snapshot");
    let run = sr::run();
    let (b, r) = (run.after_restore, run.after_repair);
    let us_bound = CAPACITY * FLOOR + sr::REFILL * (b.seconds + sr::FENCE_MARGIN_S);
    vec![Row {
        scenario: "9 snapshot restore (regions)".into(),
        load: format!(
            "C = {CAPACITY}, R = {}/s, shares 0.5/0.5 moved to {:.1} (eu) / {:.1} (us); a fresh key asked {ASKED} times in each region at once",
            sr::REFILL, run.moved.0, run.moved.1
        ),
        fault: "us's Redis restarted from an RDB taken before the move (its record back at v1, 0.5)".into(),
        admitted: format!(
            "eu {} + us {} = {} in {:.2} s; after the repair eu {} + us {} = {}",
            b.eu, b.us, b.total(), b.seconds, r.eu, r.us, r.total()
        ),
        rejected: format!("{}; after the repair {}", 2 * ASKED - b.total(), 2 * ASKED - r.total()),
        over: format!(
            "{:.0} (≤ C + R·(T + fence margin) = {:.1})",
            (b.total() as f64 - b.bound()).max(0.0),
            b.bound()
        ),
        client: String::new(),
        filter: String::new(),
        errors: "none".into(),
        recovery: format!(
            "us at the floor ({FLOOR}) until the rebalancer's repair was read, {:.1} s after the restore (the run waits a fill time, 11 s, before its burst, then runs one `--once` round)",
            run.repaired_after.as_secs_f64()
        ),
        check: format!(
            "{} ≤ {:.1} {}; us {} ≤ C·floor + R·(T + margin) = {us_bound:.1} {}; after the repair {} ≤ {:.1} {}",
            b.total(),
            b.bound(),
            mark(b.total() as f64 <= b.bound()),
            b.us,
            mark(b.us as f64 <= us_bound),
            r.total(),
            r.bound(),
            mark(r.total() as f64 <= r.bound())
        ),
    }]
}

// ---------------------------------------------------------------------------------------------
// 11, 12. Redis restarted without its data, or from an older snapshot, under each --store-reset.

pub(crate) fn store_lost(_: &Args) -> Vec<Row> {
    store_loss_rows(11, Loss::Empty)
}

pub(crate) fn snapshot_lost(_: &Args) -> Vec<Row> {
    store_loss_rows(12, Loss::Snapshot)
}

pub(crate) fn store_loss_rows(n: u32, loss: Loss) -> Vec<Row> {
    let (c, r) = (100.0, 100.0);
    let policy = "rules:\n  r: {capacity: 100, refill_per_sec: 100}\n";
    let (name, fault) = match loss {
        Loss::Empty => ("store lost its state", "Redis restarted without its data"),
        Loss::Snapshot => (
            "Redis restarted from an older snapshot",
            "Redis restarted from an RDB saved before the client spent (its epoch marker with it)",
        ),
    };
    ["full", "empty"]
        .into_iter()
        .map(|reset| {
            log(&format!("{n}: {name}, --store-reset {reset}"));
            let run = store_loss::spend_across(
                loss,
                policy,
                reset,
                Duration::from_millis(1100),
                Duration::from_millis(500),
            );
            let bound = c + r * run.seconds;
            let over = (run.admitted as f64 - bound).max(0.0);
            // `empty`: nothing over C + r·T; `full`: the lost state's capacity again, at most.
            let (held, allowance) = match reset {
                "empty" => (run.admitted as f64 <= bound + 1.0, "0"),
                _ => (over <= c + 1.0, "C"),
            };
            Row {
                scenario: format!("{n} {name}, --store-reset {reset}"),
                load: "1 client (C = 100, r = 100/s), 150 decisions straight to the sidecar, then 0.5 s more".into(),
                fault: fault.into(),
                admitted: format!("{} in {:.2} s", run.admitted, run.seconds),
                rejected: String::new(),
                over: format!("{over:.0} (C + r·T = {bound:.0}; bound {allowance})"),
                client: String::new(),
                filter: String::new(),
                errors: format!("{} unanswered while Redis came back", run.unanswered),
                recovery: String::new(),
                check: format!(
                    "admitted {} ≤ C + r·T{} = {:.0} {}; {} reset counted {}",
                    run.admitted,
                    if reset == "empty" { "" } else { " + C" },
                    if reset == "empty" { bound } else { bound + c },
                    mark(held),
                    run.resets,
                    mark(run.resets >= 1.0)
                ),
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// 13. Concurrency slots lost with the store, through Envoy.

pub(crate) fn slots_lost(_: &Args) -> Vec<Row> {
    use store_loss::{CONCURRENCY, SLOT_TTL_MS};
    ["empty", "full"]
        .into_iter()
        .map(|reset| {
            log(&format!("13: slots lost with the store, --store-reset {reset}"));
            let run = store_loss::slots_across_a_flush(reset);
            // `empty`: never more than `concurrency` in flight, nothing admitted while the two
            // running requests hold their slots; `full`: up to `concurrency` more, documented.
            let (bound, check) = match reset {
                "empty" => (
                    CONCURRENCY,
                    format!(
                        "in flight {} ≤ {CONCURRENCY} {}; admitted past the limit {} {}",
                        run.max_in_flight,
                        mark(run.max_in_flight <= CONCURRENCY),
                        run.admitted,
                        mark(run.admitted == 0)
                    ),
                ),
                _ => (
                    2 * CONCURRENCY,
                    format!(
                        "in flight {} ≤ 2 × {CONCURRENCY} {}",
                        run.max_in_flight,
                        mark(run.max_in_flight <= 2 * CONCURRENCY)
                    ),
                ),
            };
            Row {
                scenario: format!("13 slots lost with the store, --store-reset {reset}"),
                load: format!(
                    "1 Envoy ×1 worker, `concurrency: {CONCURRENCY}`, `slot_ttl_ms: {SLOT_TTL_MS}`; 2 requests held 5 s, then 4 clients sending short requests for 3 s"
                ),
                fault: "FLUSHALL while the 2 requests hold every slot".into(),
                admitted: format!("{} short requests", run.admitted),
                rejected: run.rejected.to_string(),
                over: format!(
                    "{} in flight at most (bound {bound})",
                    run.max_in_flight
                ),
                client: String::new(),
                filter: String::new(),
                errors: "0".into(),
                recovery: format!("{} of {CONCURRENCY} held requests ran to their end", run.held_to_the_end),
                check: format!(
                    "{check}; {} reset counted {}",
                    run.resets,
                    mark(run.resets >= 1.0)
                ),
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// 14. A Cluster's epochs under --store-reset empty: one per primary.

pub(crate) fn cluster_epochs(_: &Args) -> Vec<Row> {
    use store_loss::PER_PRIMARY;
    log("14: Cluster epochs");
    let run = store_loss::cluster_epochs();
    let lost = run.after_flush.first().copied().unwrap_or_default();
    let kept: usize = run.after_flush.iter().skip(1).sum();
    let others = PER_PRIMARY * run.after_flush.len().saturating_sub(1);
    vec![Row {
        scenario: "14 Cluster epochs, --store-reset empty".into(),
        load: format!(
            "3 primaries, 1 sidecar (C = 2, r = 2/s); {} new clients' first requests, 10 to a call; then {PER_PRIMARY} new clients per primary in one call",
            run.new_clients
        ),
        fault: "primary 0 flushed (FLUSHALL)".into(),
        admitted: format!(
            "{} of {} new clients; after the flush {lost} of primary 0's {PER_PRIMARY}, {kept} of the others' {others}",
            run.new_admitted, run.new_clients
        ),
        rejected: String::new(),
        over: "0 (primary 0's clients start empty at its new epoch)".into(),
        client: String::new(),
        filter: String::new(),
        errors: "0".into(),
        recovery: String::new(),
        check: format!(
            "new clients admitted {}/{} {}; marker keys {} (a marker and its stamp per primary: 6) {}; a returning client behind a new one admitted {}; the flush costs only primary 0's clients: {lost} + {kept} {}; {} reset counted {}",
            run.new_admitted,
            run.new_clients,
            mark(run.new_admitted == run.new_clients),
            run.markers.len(),
            mark(run.markers.len() == 6),
            mark(run.returning == (true, true)),
            mark(lost == 0 && kept == others),
            run.resets,
            mark(run.resets >= 1.0)
        ),
    }]
}

// ---------------------------------------------------------------------------------------------
// 10. A policy reload under leases.
