//! The fast paths: the entry codec, the table, lease sizing and hotness.

use super::*;
use crate::shared::fake::Memory;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;
use ProbeFor::Both;

const S: u64 = 1_000_000_000;

fn limit() -> KnownLimit {
    KnownLimit {
        name: "per-app".into(),
        capacity: 100,
        refill_per_sec: 10.0,
    }
}

#[test]
fn entries_round_trip_and_garbage_is_none() {
    let mut e = Entry::new("per-app|app=a");
    e.limit = Some(limit());
    e.reject_cost = 3;
    e.reject_until_ns = 9;
    e.reject_cause = RejectionCause::Blocked;
    e.lease.id = 7;
    e.lease.tokens = 5;
    assert_eq!(Entry::decode(&e.encode()), Some(e.clone()));
    assert_eq!(Entry::decode(b""), None);
    assert_eq!(Entry::decode(&[VERSION, 200, 0]), None);
    let mut long = e.encode();
    long.push(0);
    assert_eq!(Entry::decode(&long), None);
    // A limit whose name the headers could not carry is dropped, the rest of the entry kept.
    let mut bad = e.clone();
    bad.limit = Some(KnownLimit {
        name: "a\r\nx-injected: 1".into(),
        ..limit()
    });
    assert_eq!(
        Entry::decode(&bad.encode()),
        Some(Entry { limit: None, ..e })
    );
}

#[test]
fn a_rejection_is_known_until_its_retry_after_counted_from_the_dispatch() {
    let m = Memory::default();
    let t = table(&m);
    let learned = rejected(2, 1500);
    t.learn("b", &learned, 10 * S, 10 * S);
    let e = t.get("b").unwrap();
    // Dispatched at 10 s, wait 1.5 s: known until 11.5 s, for costs of 2 or more.
    assert_eq!(
        e.rejection(2, 11 * S, 0),
        Some((RejectionCause::Insufficient, S / 2))
    );
    assert_eq!(
        e.rejection(5, 11 * S, 0),
        Some((RejectionCause::Insufficient, S / 2))
    );
    assert_eq!(e.rejection(1, 11 * S, 0), None, "a smaller cost may pass");
    assert_eq!(
        e.rejection(2, 11 * S + S / 2, 0),
        None,
        "never past its retry_after"
    );
    // An admission of that cost or more clears it.
    t.learn(
        "b",
        &Learned {
            outcome: DecisionOutcome::Admitted,
            ..learned
        },
        11 * S,
        11 * S,
    );
    assert_eq!(t.get("b").unwrap().rejection(2, 11 * S, 0), None);
}

#[test]
fn a_lease_pays_until_it_runs_out_or_its_time_ends_and_gives_back_only_to_itself() {
    let m = Memory::default();
    let t = table(&m);
    let start = t.begin_lease("h", 0, S).unwrap();
    assert_eq!(start.give_back, vec![]);
    assert!(t.begin_lease("h", 1, S).is_none(), "one ask in flight");
    grant(&t, 77, 3, 0, 0);
    assert_eq!(take(&t, "h", 2, S / 2), Some(77));
    assert_eq!(take(&t, "h", 2, S / 2), None, "1 left < 2");
    t.give_back("h", 77, 2, S / 2);
    assert_eq!(take(&t, "h", 3, S / 2), Some(77));
    t.give_back("h", 99, 5, S / 2);
    assert_eq!(
        t.get("h").unwrap().lease.tokens,
        0,
        "another lease's give-back is lost"
    );
    t.give_back("h", 77, 1, S / 2);
    assert_eq!(
        take(&t, "h", 1, S),
        None,
        "not at or past its end (1 s after the ask)"
    );
    // The next ask stops this lease and hands its leftover back.
    let start = t.begin_lease("h", S / 2, S).unwrap();
    assert_eq!(start.give_back, vec![(77, 1)]);
    assert_eq!(
        start.previous,
        Some(PreviousLease {
            granted: 3,
            used: 2,
            asked_ns: 0
        })
    );
    assert_eq!(take(&t, "h", 1, S / 2), None, "stopped");
}

#[test]
fn a_give_back_to_a_lease_the_next_one_replaced_is_returned_with_the_next_ask() {
    let m = Memory::default();
    let t = table(&m);
    // Lease 1 (2 tokens) in use, lease 2 (10) waiting as the next.
    grant(&t, 1, 2, 0, 0);
    grant(&t, 2, 10, 0, 0);
    // R1 takes from lease 1, R2 empties it, R3 makes lease 2 take over.
    assert_eq!(take(&t, "h", 1, 1), Some(1), "R1");
    assert_eq!(take(&t, "h", 1, 1), Some(1), "R2");
    assert_eq!(take(&t, "h", 1, 1), Some(2), "R3");
    // R1 is rejected by another rule: its token goes back to lease 1, now retired.
    t.give_back("h", 1, 1, 2);
    let e = t.get("h").unwrap();
    assert_eq!((e.lease.id, e.lease.tokens), (2, 9));
    assert_eq!(
        (e.retired.id, e.retired.tokens),
        (1, 1),
        "the rejected request's token is kept for lease 1"
    );
    // The next ask hands it back to Redis with lease 2's leftover: 10 tokens, as due.
    let start = t.begin_lease("h", 3, S).unwrap();
    let returned: u64 = start.give_back.iter().map(|(_, tokens)| tokens).sum();
    assert_eq!(start.give_back, vec![(2, 9), (1, 1)]);
    assert_eq!(returned, 10, "a rejected request charges nothing");
}

#[test]
fn a_give_back_to_a_lease_no_longer_held_goes_to_the_lease_in_use_of_its_epoch() {
    let m = Memory::default();
    let mut t = table(&m);
    grant(&t, 1, 1, 0, 0);
    assert_eq!(take(&t, "h", 1, 1), Some(1));
    // Lease 1 is spent; a new ask gives it back (its record goes) and lease 2 arrives.
    let start = t.begin_lease("h", 1, S).unwrap();
    assert_eq!(start.give_back, vec![]);
    grant(&t, 2, 5, 1, 1);
    assert_eq!(take(&t, "h", 1, 2), Some(2));
    // The request paid by lease 1 is rejected: lease 1 is gone, lease 2 (the same epoch)
    // keeps the token (Redis takes back at most what it granted lease 2: never more).
    t.give_back("h", 1, 1, 3);
    assert_eq!(t.get("h").unwrap().lease.tokens, 5);
    // Under another epoch the token is not the lease's to pay: it is lost (never admitted
    // under a policy it was not granted under).
    t.epoch = 9;
    t.give_back("h", 1, 1, 3);
    assert_eq!(t.get("h").unwrap().lease.tokens, 5);
}

#[test]
fn a_lease_running_low_asks_for_the_next_one_which_takes_over_when_it_cannot_pay() {
    let m = Memory::default();
    let t = table(&m);
    let grant = |id: u64, tokens: u64, at: u64, now: u64| grant(&t, id, tokens, at, now);
    grant(77, 8, 0, 0);
    // Without `renew` (a bucket not busy enough) the lease is simply spent.
    assert_eq!(t.probe("h", 1, 1, Both, None), t_taken(77, 7));
    // Paying down to 2 of 8 keeps at least a quarter; the request that would leave 1 asks.
    for left in (2..7).rev() {
        assert_eq!(t.probe("h", 1, 1, Both, Some(S)), t_taken(77, left));
    }
    assert_eq!(
        t.probe("h", 1, 1, Both, Some(S)),
        Probe::Renew {
            previous: Some(PreviousLease {
                granted: 8,
                used: 6,
                asked_ns: 0
            }),
            give_back: None,
        }
    );
    let e = t.get("h").unwrap();
    assert_eq!(
        (e.lease.tokens, e.renewing_until_ns),
        (2, S),
        "nothing taken, marked"
    );
    // One ask in flight: the others keep paying from the lease in use.
    assert_eq!(t.probe("h", 1, 2, Both, Some(S)), t_taken(77, 1));
    // The next lease arrives while the one in use still holds a token: it waits.
    grant(78, 10, 2, 3);
    let e = t.get("h").unwrap();
    assert_eq!(
        (e.lease.id, e.lease.tokens, e.next.id, e.next.tokens),
        (77, 1, 78, 10)
    );
    assert_eq!(e.renewing_until_ns, 0);
    assert_eq!(t.probe("h", 1, 4, Both, Some(S)), t_taken(77, 0));
    // The one in use is spent: the next one takes over, sized from its own grant.
    assert_eq!(t.probe("h", 1, 5, Both, Some(S)), t_taken(78, 9));
    let e = t.get("h").unwrap();
    assert_eq!((e.lease.granted, e.lease.granted_ns, e.next.id), (10, 2, 0));
    // A next lease never pays past its own end (1 s after its ask).
    grant(79, 4, 3, 6);
    assert_eq!(t.get("h").unwrap().next.id, 79);
    assert!(!matches!(
        t.probe("h", 10, S + 3, Both, None),
        Probe::Taken { .. }
    ));
    // A lease granted when the one in use is spent is used at once.
    t.begin_lease("h", S + 4, 2 * S);
    grant(80, 5, S + 4, S + 5);
    let e = t.get("h").unwrap();
    assert_eq!((e.lease.id, e.lease.tokens, e.next.id), (80, 5, 0));
    // In the first nine tenths of its time a full lease just pays; in the last tenth it asks
    // for the next one, however much it holds.
    let at = S + 4 + S * 85 / 100;
    assert_eq!(t.probe("h", 1, at, Both, Some(3 * S)), t_taken(80, 4));
    assert!(matches!(
        t.probe("h", 1, S + 4 + S * 95 / 100, Both, Some(3 * S)),
        Probe::Renew { .. }
    ));
}

#[test]
fn a_lease_spent_faster_than_its_renewal_returns_asks_for_the_next_earlier() {
    let m = Memory::default();
    let t = table(&m);
    const MS: u64 = 1_000_000;
    // 100 tokens, asked at 0 and answered 10 ms later, then spent at one token per ms.
    t.begin_lease("h", 0, S);
    grant(&t, 77, 100, 0, 10 * MS);
    assert_eq!(t.get("h").unwrap().ask_rtt_ns, 10 * MS);
    for i in 1..=70 {
        assert_eq!(
            t.probe("h", 1, 10 * MS + i * MS, Both, Some(S)),
            t_taken(77, 100 - i),
            "take {i}"
        );
    }
    // 29 left would last 29 ms: under three round trips of the last ask (30 ms), although
    // above a quarter of the grant. Time to ask.
    assert!(matches!(
        t.probe("h", 1, 81 * MS, Both, Some(S)),
        Probe::Renew { .. }
    ));
}

#[test]
fn the_lease_a_next_one_took_over_from_is_given_back_by_the_next_ask() {
    let m = Memory::default();
    let t = table(&m);
    t.begin_lease("h", 0, S);
    grant(&t, 77, 4, 0, 0);
    for left in [3, 2, 1] {
        assert_eq!(t.probe("h", 1, 1, Both, Some(S)), t_taken(77, left));
    }
    assert!(matches!(
        t.probe("h", 1, 1, Both, Some(S)),
        Probe::Renew {
            give_back: None,
            ..
        }
    ));
    // (Asked and answered at once here: no round trip to renew early for.)
    grant(&t, 78, 8, 2, 2);
    assert_eq!(t.probe("h", 1, 3, Both, Some(S)), t_taken(77, 0));
    // 77 is spent: 78 takes over, and 77 (whose record Redis keeps until its end) retires.
    assert_eq!(t.probe("h", 1, 4, Both, Some(S)), t_taken(78, 7));
    assert_eq!(t.get("h").unwrap().retired.id, 77);
    for left in (2..7).rev() {
        assert_eq!(t.probe("h", 1, 5, Both, Some(S)), t_taken(78, left));
    }
    // The ask for 78's successor gives 77 back (0 tokens: its record goes).
    assert!(matches!(
        t.probe("h", 1, 6, Both, Some(S)),
        Probe::Renew {
            give_back: Some((77, 0)),
            ..
        }
    ));
    assert_eq!(t.get("h").unwrap().retired, Lease::default());
}

#[test]
fn while_the_bucket_is_known_to_reject_a_lease_running_low_is_spent_not_renewed() {
    let m = Memory::default();
    let t = table(&m);
    grant(&t, 77, 4, 0, 0);
    assert_eq!(t.probe("h", 1, 1, Both, None), t_taken(77, 3));
    assert_eq!(t.probe("h", 1, 1, Both, None), t_taken(77, 2));
    // Another request was rejected: the bucket is empty for 10 s.
    t.learn("h", &rejected(1, 10_000), 1, 1);
    // 2 of 4 left would ask for the next lease; the ask would be rejected, so the lease pays.
    assert_eq!(t.probe("h", 1, 2, Both, Some(S)), t_taken(77, 1));
    assert_eq!(t.probe("h", 1, 2, Both, Some(S)), t_taken(77, 0));
    // Spent: the known rejection answers.
    assert!(matches!(
        t.probe("h", 1, 2, Both, Some(S)),
        Probe::Rejected { .. }
    ));
}

#[test]
fn a_new_ask_gives_back_the_lease_in_use_and_a_next_one_that_could_not_pay() {
    let m = Memory::default();
    let t = table(&m);
    let grant = |id: u64, tokens: u64| grant(&t, id, tokens, 0, 0);
    grant(1, 4);
    grant(2, 2);
    let e = t.get("h").unwrap();
    assert_eq!((e.lease.tokens, e.next.tokens), (4, 2));
    // A request costing 5: neither lease pays it; its ask hands both leftovers back.
    assert_eq!(t.probe("h", 5, 1, Both, Some(S)), Probe::Undecided);
    let start = t.begin_lease("h", 1, S).unwrap();
    assert_eq!(start.give_back, vec![(1, 4), (2, 2)]);
    let e = t.get("h").unwrap();
    assert_eq!((e.lease.tokens, e.next.tokens, e.next.id), (0, 0, 0));
}

fn table(m: &Memory) -> Table<'_> {
    table_of(m, 64, u64::MAX)
}

fn table_of(m: &Memory, slots: usize, max_rejection_ns: u64) -> Table<'_> {
    Table {
        store: m,
        slots,
        max_rejection_ns,
        epoch: 0,
    }
}

/// Records a lease `id` of `tokens` granted to bucket "h" (asked at `at`, answered at `now`).
fn grant(t: &Table<'_>, id: u64, tokens: u64, at: u64, now: u64) {
    grant_to(t, "h", id, tokens, at, now)
}

/// Bucket `bucket` learns it was granted lease `id` of `tokens`, asked at `at`, for 1 s.
fn grant_to(t: &Table<'_>, bucket: &str, id: u64, tokens: u64, at: u64, now: u64) {
    t.learn(
        bucket,
        &Learned {
            cost: 1,
            limit: Some(limit()),
            outcome: DecisionOutcome::Admitted,
            asked_lease: Some((id, 1000)),
            leased: tokens,
            epoch: t.epoch,
        },
        at,
        now,
    )
}

/// The sidecar rejected `cost` for lack of tokens, with that wait.
fn rejected(cost: u64, retry_after_ms: u64) -> Learned {
    Learned {
        cost,
        limit: Some(limit()),
        outcome: DecisionOutcome::Rejected {
            cause: RejectionCause::Insufficient,
            retry_after_ms,
        },
        asked_lease: None,
        leased: 0,
        epoch: 0,
    }
}

fn t_taken(lease_id: u64, tokens_left: u64) -> Probe {
    Probe::Taken {
        lease_id,
        tokens_left,
        limit: Some(limit()),
    }
}

/// The lease id `probe` took `cost` from.
fn take(t: &Table<'_>, id: &str, cost: u64, now_ns: u64) -> Option<u64> {
    match t.probe(id, cost, now_ns, Both, None) {
        Probe::Taken { lease_id, .. } => Some(lease_id),
        _ => None,
    }
}

#[test]
fn a_long_rejection_is_answered_locally_only_up_to_the_cap_with_the_whole_wait() {
    let m = Memory::default();
    let t = table_of(&m, 16, S);
    // Redis said: an hour to wait. Locally answered for a second after the callout.
    t.learn("h", &rejected(1, 3_600_000), 0, 10);
    assert!(
        matches!(t.probe("h", 1, S - 1, Both, None), Probe::Rejected { left_ns, .. } if left_ns == 3600 * S - (S - 1)),
        "Retry-After says the whole wait"
    );
    assert_eq!(
        t.probe("h", 1, S, Both, None),
        Probe::Undecided,
        "after the cap the next request asks again (and sees a raised limit)"
    );
    assert!(!t.get("h").unwrap().live(S, 0), "nor does it hold the slot");
    // A shorter wait than the cap is answered for the wait.
    t.learn("h", &rejected(1, 300), 2 * S, 2 * S);
    assert!(matches!(
        t.probe("h", 1, 2 * S + 299_999_999, Both, None),
        Probe::Rejected { .. }
    ));
    assert_eq!(
        t.probe("h", 1, 2 * S + 300_000_000, Both, None),
        Probe::Undecided
    );
}

#[test]
fn a_lease_that_pays_goes_before_a_known_rejection() {
    let m = Memory::default();
    let t = table_of(&m, 16, u64::MAX);
    t.begin_lease("h", 0, S);
    grant(&t, 7, 2, 0, 0);
    t.learn("h", &rejected(1, 500), 0, 0);
    assert_eq!(
        t.probe("h", 1, 1, Both, None),
        Probe::Taken {
            lease_id: 7,
            tokens_left: 1,
            limit: Some(limit())
        }
    );
    assert_eq!(take(&t, "h", 1, 1), Some(7));
    assert!(
        matches!(t.probe("h", 1, 1, Both, None), Probe::Rejected { cause: RejectionCause::Insufficient, left_ns, .. } if left_ns == 500_000_000 - 1),
        "the lease is spent: the rejection answers"
    );
    assert_eq!(
        t.probe("h", 1, 1, ProbeFor::Leases, None),
        Probe::Undecided,
        "rejections off"
    );
}

#[test]
fn an_admission_of_an_unknown_bucket_writes_nothing() {
    let m = Memory::default();
    let t = table_of(&m, 16, u64::MAX);
    let admitted = Learned {
        cost: 1,
        limit: Some(limit()),
        outcome: DecisionOutcome::Admitted,
        asked_lease: None,
        leased: 0,
        epoch: 0,
    };
    t.learn("quiet", &admitted, 0, 0);
    assert!(t.get("quiet").is_none());
    assert_eq!(t.probe("quiet", 1, 0, Both, None), Probe::NoEntry);
    // Once known (a rejection), an admission clears it.
    t.learn(
        "quiet",
        &Learned {
            outcome: DecisionOutcome::Rejected {
                cause: RejectionCause::Insufficient,
                retry_after_ms: 100,
            },
            ..admitted.clone()
        },
        0,
        0,
    );
    assert!(t.get("quiet").is_some());
    t.learn("quiet", &admitted, 1, 1);
    assert_eq!(t.get("quiet").unwrap().reject_until_ns, 0);
}

#[test]
fn another_bucket_takes_a_slot_only_once_its_entry_is_no_longer_live() {
    let m = Memory::default();
    let t = table_of(&m, 1, u64::MAX);
    t.begin_lease("a", 0, S);
    grant_to(&t, "a", 1, 10, 0, 0);
    assert_eq!(take(&t, "b", 1, 1), None, "b never pays with a's lease");
    // While a's lease holds tokens, b gets no slot: no lease ask, no rejection recorded.
    assert!(t.begin_lease("b", 1, S).is_none());
    t.learn("b", &rejected(1, 60_000), 1, 1);
    assert_eq!(t.get("b"), None);
    assert_eq!(take(&t, "a", 1, 2), Some(1), "a's lease still pays");
    // Past a's lease (1 s after its ask), the slot is b's; a's state is gone.
    assert!(t.begin_lease("b", S + 1, 2 * S).is_some());
    assert!(t.get("a").is_none());
    assert!(t.get("b").is_some());
    // b's ask in flight keeps the slot too, and so does a rejection in force.
    assert!(t.begin_lease("a", S + 2, 2 * S).is_none());
    t.learn("b", &rejected(1, 5_000), S + 1, S + 3);
    assert!(
        t.begin_lease("a", 2 * S + 1, 3 * S).is_none(),
        "b's rejection is in force"
    );
    assert!(t.begin_lease("a", S + 1 + 5 * S + 1, 7 * S).is_some());
}

#[test]
fn leases_are_sized_by_their_use() {
    assert_eq!(lease_size(None, 100.0, 0, 1000, 1, 1000), 125);
    assert_eq!(
        lease_size(None, 0.0, 0, 1000, 3, 1000),
        3,
        "at least the cost"
    );
    assert_eq!(
        lease_size(None, 1e12, 0, 1000, 1, 500),
        500,
        "at most max_tokens"
    );
    let previous = PreviousLease {
        granted: 100,
        used: 100,
        asked_ns: 0,
    };
    // 100 used in half a second: 200/s, so a 1 s lease asks 250.
    assert_eq!(lease_size(Some(previous), 10.0, S / 2, 1000, 1, 1000), 250);
}

#[test]
fn hotness_counts_per_window() {
    let mut h = Hotness::default();
    for i in 0..20 {
        h.observe("k", i * 1_000_000);
    }
    // 20 requests within 200 ms: 100/s.
    assert_eq!(h.observe("k", WINDOW_NS + 1), 100.0);
    assert_eq!(h.observe("quiet", 0), 5.0);
    assert_eq!(
        h.observe("k", 5 * WINDOW_NS),
        5.0,
        "idle windows reset the rate"
    );
}
