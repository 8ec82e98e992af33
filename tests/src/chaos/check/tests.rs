//! The checker's allowances on records made by hand: each grants what its fault allows and no
//! more (a checker that flags nothing, or everything, proves nothing).

use super::*;
use crate::chaos::schedule::Fault;
use crate::chaos::topology::Policy;
use crate::chaos::workload::{Kind, Sent};

const S: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;

/// A decision of the direct caller (rule `direct`: capacity 10, refill 5/s), sent at `sent`
/// and answered allowed at `answered`.
fn direct(id: u64, cost: u64, sent: u64, answered: u64) -> Sent {
    Sent {
        id,
        rule: "direct",
        app: "d".into(),
        kind: Kind::Direct {
            cost,
            repeat: false,
            fresh: false,
        },
        envoy: None,
        sent_ns: sent,
        answered_ns: answered,
        status: 200,
    }
}

fn fault(fault: Fault, start: u64, end: u64, recovered: u64, failover: bool) -> Caused {
    Caused {
        fault,
        start_ns: start,
        end_ns: end,
        recovered_ns: recovered,
        failover,
    }
}

/// The over-admission violations of `sent` under `faults`.
fn violations(store_reset: StoreReset, sent: &[Sent], faults: Vec<Caused>) -> Vec<String> {
    let policies = vec![(0, Policy::default())];
    violations_with(store_reset, sent, &[], faults, policies, "direct/")
}

/// The violations of the bucket `prefix` names, with `served` and the policies written.
fn violations_with(
    store_reset: StoreReset,
    sent: &[Sent],
    served: &[crate::upstream::Served],
    faults: Vec<Caused>,
    policies: Vec<(u64, Policy)>,
    prefix: &str,
) -> Vec<String> {
    let log = Log {
        faults,
        policies,
        ..Log::default()
    };
    let verdict = check(&Record {
        store_reset,
        sent,
        served,
        log: &log,
        counters: &[],
        logs: &[],
        peak_rss_kib: &[],
    });
    verdict
        .violations
        .into_iter()
        .map(|v| v.what)
        .filter(|w| w.starts_with(prefix))
        .collect()
}

/// A request of cost 1 of `rule` for `app` through Envoy `envoy`, served at `at` (sent 1 ms
/// before, answered 1 ms after).
fn served_api(
    id: u64,
    (rule, app): (&'static str, &str),
    envoy: usize,
    path: &str,
    at: u64,
) -> (Sent, crate::upstream::Served) {
    let sent = Sent {
        id,
        rule,
        app: app.into(),
        kind: Kind::Api,
        envoy: Some(envoy),
        sent_ns: at - MS,
        answered_ns: at + MS,
        status: 200,
    };
    let served = crate::upstream::Served {
        id,
        path: path.into(),
        arrival_ns: at,
        done_ns: at,
    };
    (sent, served)
}

/// The violations of bucket `prefix` with one request served (under `full`, no fault).
fn one_violations(
    (sent, served): (Sent, crate::upstream::Served),
    policies: &[(u64, Policy)],
    prefix: &str,
) -> Vec<String> {
    let (sent, served, policies) = (&[sent], &[served], policies.to_vec());
    violations_with(StoreReset::Full, sent, served, vec![], policies, prefix)
}

/// `n` decisions of cost 1 answered from `at`, 1 ms apart, each sent 1 ms before.
fn burst(first_id: u64, n: u64, at: u64) -> Vec<Sent> {
    (0..n)
        .map(|i| direct(first_id + i, 1, at + i * MS - MS, at + i * MS))
        .collect()
}

#[test]
fn a_full_bucket_spent_at_once_is_clean_and_three_more_are_not() {
    let clean = burst(1, 10, S);
    assert_eq!(
        violations(StoreReset::Full, &clean, vec![]),
        Vec::<String>::new()
    );
    // The slack is r·0.3 s + 1 = 2.5 tokens: three more at once go past it.
    let over = burst(1, 13, S);
    assert!(!violations(StoreReset::Full, &over, vec![]).is_empty());
}

/// Redis restarted empty at 2 s (back 20 ms later).
fn restart() -> Vec<Caused> {
    vec![fault(
        Fault::StoreRestartEmpty,
        2 * S,
        2 * S + 20 * MS,
        3 * S,
        false,
    )]
}

/// The bucket spent at 1 s, and again 100 ms after the restart.
fn spent_restarted_spent() -> Vec<Sent> {
    let mut sent = burst(1, 10, S);
    sent.extend(burst(100, 10, 2 * S + 100 * MS));
    sent
}

#[test]
fn a_store_restarted_empty_under_full_grants_the_capacity_again_once() {
    let mut sent = spent_restarted_spent();
    assert_eq!(
        violations(StoreReset::Full, &sent, restart()),
        Vec::<String>::new()
    );
    // Under `empty` the new epoch starts empty: the second burst is past the bucket.
    assert!(!violations(StoreReset::Empty, &sent, restart()).is_empty());
    // And under `full`, a third burst right after is too.
    sent.extend(burst(200, 10, 2 * S + 200 * MS));
    assert!(!violations(StoreReset::Full, &sent, restart()).is_empty());
}

#[test]
fn an_admission_on_its_way_across_a_loss_is_not_charged_after_it() {
    // Four decisions of cost 2 sent before the restart and answered after it: charged to the
    // store that lost them, or to the new one, but not owed twice.
    let mut sent = spent_restarted_spent();
    let across: Vec<Sent> = (0..4)
        .map(|i| direct(300 + i, 2, 2 * S - 10 * MS, 2 * S + 150 * MS + i * MS))
        .collect();
    let mut with_across = sent.clone();
    with_across.extend(across);
    assert_eq!(
        violations(StoreReset::Full, &with_across, restart()),
        Vec::<String>::new()
    );
    // The same four sent after the restart began are past the bucket.
    let after: Vec<Sent> = (0..4)
        .map(|i| direct(300 + i, 2, 2 * S + 30 * MS, 2 * S + 150 * MS + i * MS))
        .collect();
    sent.extend(after);
    assert!(!violations(StoreReset::Full, &sent, restart()).is_empty());
}

#[test]
fn a_failover_grants_the_replication_lag_and_the_old_primary_beside_the_new_one() {
    // Killed at 2 s, back (empty, `empty`: nothing held) at 3 s, the replica named and the old
    // one a replica at 3.5 s: the capacity again, and r·(0.5 s + 1 s) = 7.5 while both answer.
    let kill = || {
        vec![fault(
            Fault::PrimaryKill { down_ms: 1000 },
            2 * S,
            3 * S,
            3 * S + 500 * MS,
            true,
        )]
    };
    let mut sent = burst(1, 10, S);
    sent.extend(burst(100, 10 + 7, 3 * S + 100 * MS));
    assert_eq!(
        violations(StoreReset::Empty, &sent, kill()),
        Vec::<String>::new()
    );
    sent.extend(burst(200, 6, 3 * S + 200 * MS));
    assert!(!violations(StoreReset::Empty, &sent, kill()).is_empty());
}

#[test]
fn what_the_old_primary_admitted_beside_the_new_one_stays_granted_until_the_bucket_refilled() {
    // As above (7.5 granted for the split brain until 6.5 s): the bucket spent at 3.1 s, then
    // admissions at its refill rate until 8 s. The new primary never saw what the old one
    // charged, so it may still hold those tokens at 8 s, when a burst spends them: granted,
    // the model's bucket never having been full since. One past the slack is not.
    let kill = vec![fault(
        Fault::PrimaryKill { down_ms: 1000 },
        2 * S,
        3 * S,
        3 * S + 500 * MS,
        true,
    )];
    let mut sent = burst(1, 10, 3 * S + 100 * MS);
    for i in 0..24 {
        let t = 3 * S + 300 * MS + i * 200 * MS;
        sent.push(direct(1_000 + i, 1, t - MS, t));
    }
    let mut within = sent.clone();
    within.extend(burst(2_000, 9, 8 * S));
    assert_eq!(
        violations(StoreReset::Empty, &within, kill.clone()),
        Vec::<String>::new()
    );
    sent.extend(burst(2_000, 12, 8 * S));
    assert!(!violations(StoreReset::Empty, &sent, kill).is_empty());
}

#[test]
fn an_answer_that_took_long_widens_the_slack_of_its_window() {
    // Thirteen at once is three past the bucket, past r·0.3 s + 1 = 2.5; but when one of them
    // took 0.5 s from its client to its answer, it was decided somewhere in that half second:
    // r·0.5 s + 1 = 3.5.
    let mut sent = burst(1, 13, S);
    sent[12].sent_ns = sent[12].answered_ns - 500 * MS;
    assert_eq!(
        violations(StoreReset::Full, &sent, vec![]),
        Vec::<String>::new()
    );
    let mut more = burst(1, 14, S);
    more[13].sent_ns = more[13].answered_ns - 500 * MS;
    assert!(!violations(StoreReset::Full, &more, vec![]).is_empty());
}

#[test]
fn a_burst_of_reloads_is_graced_from_its_first_write() {
    use crate::chaos::schedule::HOT;
    let blocked = Policy {
        hot_blocked: true,
        ..Policy::default()
    };
    // Blocked at 1 s, written again (still blocked) 10 ms later: the block holds from 1.5 s.
    let policies = vec![
        (0, Policy::default()),
        (S, blocked.clone()),
        (S + 10 * MS, blocked),
    ];
    let hot = |id: u64, at: u64| served_api(id, ("per-app", HOT), 0, "/api/x", at);
    let run = |at: u64| one_violations(hot(1, at), &policies, "per-app/");
    assert_eq!(run(S + 200 * MS), Vec::<String>::new(), "within the grace");
    let late = run(S + 600 * MS);
    assert!(
        late.iter().any(|v| v.contains("admitted while blocked")),
        "{late:?}"
    );
}

#[test]
fn a_sidecar_paused_across_a_reload_may_decide_under_the_old_policy_until_the_grace_after_it() {
    use crate::chaos::schedule::HOT;
    let blocked = Policy {
        hot_blocked: true,
        ..Policy::default()
    };
    // Blocked at 1 s; sidecar 1 frozen from 1.01 s to 1.6 s (seed 63 of the two-hour run: it
    // decided the hot app 4 ms after it ran again, before it had read the file).
    let policies = vec![(0, Policy::default()), (S, blocked)];
    let pause = fault(
        Fault::SidecarPause {
            sidecar: 1,
            ms: 590,
        },
        S + 10 * MS,
        S + 600 * MS,
        S + 620 * MS,
        false,
    );
    let hot = |id: u64, at: u64| served_api(id, ("per-app", HOT), 1, "/api/x", at);
    let run = |at: u64, faults: Vec<Caused>| {
        let (sent, served) = hot(1, at);
        violations_with(
            StoreReset::Full,
            &[sent],
            &[served],
            faults,
            policies.clone(),
            "per-app/",
        )
    };
    let blocked_at = |v: &[String]| v.iter().any(|v| v.contains("admitted while blocked"));
    assert!(
        blocked_at(&run(S + 604 * MS, vec![])),
        "no pause: past the grace"
    );
    assert_eq!(run(S + 604 * MS, vec![pause.clone()]), Vec::<String>::new());
    assert_eq!(
        run(S + 1_050 * MS, vec![pause.clone()]),
        Vec::<String>::new()
    );
    assert!(
        blocked_at(&run(S + 1_150 * MS, vec![pause])),
        "past the grace after it"
    );
}

#[test]
fn the_first_policy_holds_from_the_start() {
    // The nemesis writes its log's first policy as the run starts; the workload may be faster.
    let policies = vec![(2 * S, Policy::default())];
    let sent = burst(1, 10, S);
    assert_eq!(
        violations_with(StoreReset::Full, &sent, &[], vec![], policies, "direct/"),
        Vec::<String>::new()
    );
}

/// An `llm` request through its Envoy that reserved `reserve` and really cost `tokens` (its
/// answer readable), served at `at`, and its served record.
fn llm(id: u64, reserve: u64, tokens: u64, at: u64) -> (Sent, crate::upstream::Served) {
    let sent = Sent {
        id,
        rule: "llm",
        app: "llm".into(),
        kind: Kind::Llm {
            reserve,
            tokens,
            readable: true,
            cut: false,
        },
        envoy: Some(LLM_ENVOY),
        sent_ns: at - MS,
        answered_ns: at + MS,
        status: 200,
    };
    let served = crate::upstream::Served {
        id,
        path: "/usage/json".into(),
        arrival_ns: at,
        done_ns: at,
    };
    (sent, served)
}

/// The violations of `llm/` with eight settlements counted lost on Envoy `envoy`.
fn llm_violations_with_eight_lost_on(
    envoy: usize,
    sent: &[Sent],
    served: &[crate::upstream::Served],
    faults: Vec<Caused>,
) -> Vec<String> {
    let log = Log {
        faults,
        policies: vec![(0, Policy::default())],
        ..Log::default()
    };
    let counters = [
        ("settlements_lost".to_string(), 8),
        (format!("settlements_lost@{envoy}"), 8),
        ("costs_settled".to_string(), 8),
    ];
    check(&Record {
        store_reset: StoreReset::Full,
        sent,
        served,
        log: &log,
        counters: &counters,
        logs: &[],
        peak_rss_kib: &[],
    })
    .violations
    .into_iter()
    .map(|v| v.what)
    .filter(|w| w.starts_with("llm/"))
    .collect()
}

#[test]
fn a_lost_settlement_is_granted_only_to_the_rule_of_its_envoy_and_while_a_fault_put_it_at_risk() {
    // Eight requests at 1 s reserve 1 and cost 50 (49 each owed by their settlements: the
    // bucket 200 in debt), then 200 admitted at 7 s, past the aftermath of any fault below: the
    // bucket holds 100 by then, so 84 past its slack unless those settlements were lost.
    let (mut sent, mut served): (Vec<Sent>, Vec<_>) =
        (0..8).map(|i| llm(1 + i, 1, 50, S + i * MS)).unzip();
    let (more, more_served): (Vec<Sent>, Vec<_>) =
        (0..4).map(|i| llm(10 + i, 50, 50, 7 * S + i * MS)).unzip();
    sent.extend(more);
    served.extend(more_served);
    // A sidecar paused around them: the eight may be the ones lost.
    let pause = fault(
        Fault::SidecarPause {
            sidecar: 0,
            ms: 500,
        },
        S + 50 * MS,
        S + 550 * MS,
        S + 600 * MS,
        false,
    );
    assert_eq!(
        llm_violations_with_eight_lost_on(LLM_ENVOY, &sent, &served, vec![pause.clone()]),
        Vec::<String>::new()
    );
    // Lost on the other Envoy (bulk's): these were charged.
    assert!(!llm_violations_with_eight_lost_on(BULK_ENVOY, &sent, &served, vec![pause]).is_empty());
    // No fault near them: they cannot be among the eight lost.
    assert!(!llm_violations_with_eight_lost_on(LLM_ENVOY, &sent, &served, vec![]).is_empty());
}

#[test]
fn a_call_the_sidecar_refused_is_a_violation() {
    let log = Log {
        policies: vec![(0, Policy::default())],
        ..Log::default()
    };
    let refused = |n: u64| {
        let counters = [(CALLS_REFUSED.to_string(), n)];
        check(&Record {
            store_reset: StoreReset::Full,
            sent: &[],
            served: &[],
            log: &log,
            counters: &counters,
            logs: &[],
            peak_rss_kib: &[],
        })
        .violations
        .len()
    };
    assert_eq!(refused(0), 0);
    assert_eq!(refused(1), 1);
}

#[test]
fn a_failover_the_watch_saw_without_a_fault_grants_what_a_failover_does() {
    // The bucket spent at 1 s and again just after a failover Sentinel made on its own at 2 s
    // (the old primary last agreed on at 1.9 s): the promoted replica may not have had the
    // first spending.
    let sent = spent_restarted_spent();
    let failover = vec![fault(Fault::Failover, 2 * S - 100 * MS, 2 * S, 2 * S, true)];
    assert_eq!(
        violations(StoreReset::Empty, &sent, failover),
        Vec::<String>::new()
    );
    assert!(!violations(StoreReset::Empty, &sent, vec![]).is_empty());
}

/// `n` requests of `per-ip` (capacity 15, refill 6/s) through the RLQS Envoy, from its own
/// address, served from `at` 1 ms apart.
fn rlqs_burst(first_id: u64, n: u64, at: u64) -> (Vec<Sent>, Vec<crate::upstream::Served>) {
    use crate::chaos::topology::RLQS_ENVOY;
    (0..n)
        .map(|i| {
            served_api(
                first_id + i,
                ("per-ip", "127.0.0.2"),
                RLQS_ENVOY,
                "/rlqs/x",
                at + i * MS,
            )
        })
        .unzip()
}

#[test]
fn the_rlqs_envoy_may_spend_tokens_taken_before_a_window_and_its_fallback_in_an_outage_only() {
    let run = |n: u64, faults: Vec<Caused>| {
        let (sent, served) = rlqs_burst(1, n, 12 * S);
        let policies = vec![(0, Policy::default())];
        violations_with(
            StoreReset::Full,
            &sent,
            &served,
            faults,
            policies,
            "per-ip/",
        )
    };
    // The bucket (15), the slack (6 · 0.3 + 1 = 2.8) and an assignment taken before the window
    // (6 · (1 + 3 + 2 · 0.5) = 30): 47 at once are within, 49 are not.
    assert_eq!(run(47, vec![]), Vec::<String>::new());
    assert!(!run(49, vec![]).is_empty());
    // The native Envoy's address is not granted it.
    let (mut sent, served) = rlqs_burst(1, 20, 12 * S);
    for s in &mut sent {
        s.app = "127.0.0.1".into();
    }
    let policies = vec![(0, Policy::default())];
    let native = violations_with(
        StoreReset::Full,
        &sent,
        &served,
        vec![],
        policies,
        "per-ip/",
    );
    assert!(!native.is_empty());
    // Its sidecar paused for 4 s meanwhile: the fallback (10 + 1 · (4 − 3)) and an assignment
    // delivered 4 s late (6 · 4): 35 more.
    let paused = |sidecar, start| {
        let end = start + 4 * S;
        vec![fault(
            Fault::SidecarPause { sidecar, ms: 4_000 },
            start,
            end,
            end,
            false,
        )]
    };
    assert_eq!(run(82, paused(1, 10 * S)), Vec::<String>::new());
    assert!(!run(85, paused(1, 10 * S)).is_empty());
    // Not the other sidecar's pause, nor one whose late assignment expired before the window
    // (over at 4 s, expired at 7.5 s, the bucket full since).
    assert!(!run(60, paused(0, 10 * S)).is_empty());
    assert!(!run(60, paused(1, 0)).is_empty());
}

#[test]
fn a_request_that_held_a_slot_through_a_loss_lets_another_take_its_place_while_it_runs() {
    use crate::upstream::Served;
    // Two held from 1 s and 2 s to 10 s; a third arrives at 8 s: three in flight at once.
    let holds = [(1, S, 10 * S), (2, 2 * S, 10 * S), (3, 8 * S, 9 * S)];
    let (sent, served): (Vec<Sent>, Vec<Served>) = holds
        .iter()
        .map(|&(id, at, done)| {
            let sent = Sent {
                id,
                rule: "inflight",
                app: "hold".into(),
                kind: Kind::Hold {
                    ms: (done - at) / MS,
                },
                envoy: Some(0),
                sent_ns: at - MS,
                answered_ns: done + MS,
                status: 200,
            };
            let served = Served {
                id,
                path: "/hold/hold".into(),
                arrival_ns: at,
                done_ns: done,
            };
            (sent, served)
        })
        .unzip();
    // The store went back to a snapshot at 3 s (its aftermath over at 6.5 s): under `full` the
    // first two's slots may be gone while they run, so the third may take one.
    let restore = vec![fault(
        Fault::StoreSnapshotRestore { age_ms: 2_000 },
        3 * S,
        3 * S + 20 * MS,
        3 * S + 500 * MS,
        false,
    )];
    let run = |store_reset, faults| {
        let policies = vec![(0, Policy::default())];
        violations_with(store_reset, &sent, &served, faults, policies, "inflight:")
    };
    assert_eq!(run(StoreReset::Full, restore.clone()), Vec::<String>::new());
    // Under `empty` the slots follow the epoch: none lost; nor without the fault.
    assert_eq!(run(StoreReset::Empty, restore).len(), 1);
    assert_eq!(run(StoreReset::Full, vec![]).len(), 1);
    // Their Envoy's sidecar (Envoy 0's is sidecar 0) paused for two thirds of `slot_ttl_ms`
    // (3 s): they could not renew; the other sidecar's pause did not stop them.
    let paused = |sidecar| {
        let pause = Fault::SidecarPause { sidecar, ms: 2_000 };
        vec![fault(pause, 3 * S, 5 * S, 5 * S, false)]
    };
    assert_eq!(run(StoreReset::Empty, paused(0)), Vec::<String>::new());
    assert_eq!(run(StoreReset::Empty, paused(1)).len(), 1);
}

#[test]
fn a_request_admitted_while_its_rule_is_out_of_the_policy_is_a_violation_past_the_grace() {
    let user = |id: u64, at: u64| served_api(id, ("per-user", "u0"), 0, "/user/x", at);
    let removed = Policy {
        per_user: false,
        ..Policy::default()
    };
    // Removed at 1 s: an admission at 1.2 s is within the reload's grace, one at 2 s is not.
    let policies = vec![(0, Policy::default()), (S, removed)];
    let run = |at: u64| one_violations(user(1, at), &policies, "per-user/");
    assert_eq!(run(S + 200 * MS), Vec::<String>::new());
    assert_eq!(run(2 * S).len(), 1);
}

#[test]
fn the_rlqs_envoy_whose_token_was_rotated_out_admits_its_last_assignment_and_fallback_only() {
    // Rotated out from 0 to 20 s: from 5 s on, the last assignment (15 + 6 · 3) and the fallback
    // (10 + 1 · 15) with 1 of slack: 59.
    let revoked = fault(Fault::TokenRevoked { ms: 20_000 }, 0, 20 * S, 23 * S, false);
    let run = |n: u64| {
        let (sent, served): (Vec<Sent>, Vec<crate::upstream::Served>) = (0..n)
            .map(|i| {
                let (s, v) = rlqs_burst(i + 1, 1, 6 * S + i * 100 * MS);
                (s[0].clone(), v[0].clone())
            })
            .unzip();
        let policies = vec![(0, Policy::default())];
        let prefix = "per-ip/127.0.0.2: the RLQS Envoy";
        violations_with(
            StoreReset::Full,
            &sent,
            &served,
            vec![revoked.clone()],
            policies,
            prefix,
        )
    };
    assert_eq!(run(59), Vec::<String>::new());
    assert_eq!(run(61).len(), 1, "{:?}", run(61));
}

#[test]
fn a_new_clients_first_request_is_refused_only_near_a_fault() {
    let refused = |at: u64| Sent {
        app: "n1".into(),
        kind: Kind::Direct {
            cost: 1,
            repeat: false,
            fresh: true,
        },
        status: 429,
        ..direct(1, 1, at - MS, at)
    };
    let run = |faults: Vec<Caused>| {
        let policies = vec![(0, Policy::default())];
        let sent = [refused(10 * S)];
        violations_with(
            StoreReset::Empty,
            &sent,
            &[],
            faults,
            policies,
            "direct/n1: a new",
        )
    };
    assert_eq!(run(vec![]).len(), 1);
    let emptied = |at: u64| {
        vec![fault(
            Fault::StoreRestartEmpty,
            at,
            at,
            at + 500 * MS,
            false,
        )]
    };
    assert_eq!(run(emptied(9 * S)), Vec::<String>::new());
    assert_eq!(run(emptied(5 * S)).len(), 1, "recovered 4.5 s before");
    // Refused when it was not new: no violation of this kind.
    let mut again = refused(10 * S);
    again.kind = Kind::Direct {
        cost: 1,
        repeat: false,
        fresh: false,
    };
    let policies = vec![(0, Policy::default())];
    assert!(violations_with(
        StoreReset::Empty,
        &[again],
        &[],
        vec![],
        policies,
        "direct/n1: a new"
    )
    .is_empty());
}

#[test]
fn the_rlqs_envoy_unanswered_after_a_crash_of_its_own_is_counted_not_flagged_until_its_restart() {
    use crate::chaos::topology::RLQS_ENVOY;
    // The RLQS Envoy answers until 10 s, then nothing: at 10, 11 and (after the nemesis restarted
    // it at 12 s, recovered at 13 s) 14 s.
    let unanswered = |id: u64, at: u64| Sent {
        id,
        rule: "per-ip",
        app: "127.0.16.1".into(),
        kind: Kind::Api,
        envoy: Some(RLQS_ENVOY),
        sent_ns: at,
        answered_ns: at + MS,
        status: 0,
    };
    let sent = [
        unanswered(1, 10 * S),
        unanswered(2, 11 * S),
        unanswered(3, 14 * S),
    ];
    let restart = fault(
        Fault::EnvoyRestart { envoy: RLQS_ENVOY },
        12 * S,
        12 * S,
        13 * S,
        false,
    );
    let run = |rlqs_log: &str| {
        let log = Log {
            faults: vec![restart.clone()],
            policies: vec![(0, Policy::default())],
            ..Log::default()
        };
        let logs = [("envoy rlqs".to_string(), rlqs_log.to_string())];
        let verdict = check(&Record {
            store_reset: StoreReset::Full,
            sent: &sent,
            served: &[],
            log: &log,
            counters: &[],
            logs: &logs,
            peak_rss_kib: &[],
        });
        let answered: Vec<String> = verdict
            .violations
            .into_iter()
            .map(|v| v.what)
            .filter(|w| w.contains("answered 0"))
            .collect();
        (answered, verdict.rlqs_crashes)
    };
    // Without a crash in its log, every unanswered request is a violation.
    let (flagged, crashes) = run("[info][main] starting\n");
    assert_eq!(flagged.len(), 3, "{flagged:?}");
    assert_eq!(crashes, (0, 0));
    // With one, those until the restart are counted; one after it (answered 0 again with no
    // second crash logged) is still a violation.
    let crashed = "[2026-12-07 10:34:47.769][27134][critical][backtrace] \
                   [./source/server/backtrace.h:173] Caught Segmentation fault\n";
    let (flagged, crashes) = run(crashed);
    assert_eq!(flagged, ["per-ip/127.0.16.1: request 3 answered 0 (Api)"]);
    assert_eq!(crashes, (1, 2));
}

#[test]
fn a_raised_capacity_fills_at_the_refill_rate_unless_the_bucket_was_idle_past_its_record() {
    // `per-app` 20 + 10/s, raised to 38 at 10 s (seed 98 of the two-hour run: an app blocked
    // for 30 s, then unblocked and raised, got the new capacity at once).
    let raised = Policy {
        per_app: (38, 10.0),
        ..Policy::default()
    };
    let policies = vec![
        (
            0,
            Policy {
                per_app: (20, 10.0),
                ..Policy::default()
            },
        ),
        (10 * S, raised),
    ];
    let app = |id: u64, at: u64| served_api(id, ("per-app", "q1"), 0, "/api/x", at);
    // Refused every 100 ms meanwhile (as while blocked): each refusal replays the bucket at the
    // capacity then in force.
    let refused = |id: u64, at: u64| Sent {
        status: 429,
        ..app(id, at).0
    };
    let run = |first_burst_at: u64| {
        // 20 admitted at `first_burst_at`, then 38 from 11 s, 1 ms apart.
        let (mut sent, served): (Vec<Sent>, Vec<_>) = (0..20)
            .map(|i| app(1 + i, first_burst_at + i * MS))
            .chain((0..38).map(|i| app(100 + i, 11 * S + i * MS)))
            .unzip();
        sent.extend((0..99).map(|i| refused(1_000 + i, S + 100 * MS * i + 50 * MS)));
        violations_with(
            StoreReset::Full,
            &sent,
            &served,
            vec![],
            policies.clone(),
            "per-app/",
        )
    };
    // Idle and full since 3 s: its record is gone by 11 s, a new bucket full at 38.
    assert_eq!(run(S), Vec::<String>::new());
    // Drained at 9.9 s: at 11 s it holds 11 tokens (20 at most before the raise), and fills at
    // 10/s from there: 38 at once is far past it.
    assert!(!run(9_900 * MS).is_empty());
}
