//! The memory store against the scripts' semantics.

use super::super::{BucketLimits, Charge, Return};
use super::*;

const T0: u64 = 1_700_000_000_000_000;

fn charge(key: &str, capacity: u64, refill: f64, cost: u64) -> Charge {
    Charge {
        receipt: 0,
        key: Arc::from(key),
        bucket: BucketLimits::new(capacity, refill),
        cost,
        shadow: false,
        lease: None,
        grant_cap: GrantCap::Share,
    }
}

fn one(store: &MemoryStore, request: Vec<Charge>) -> RequestOutcome {
    store
        .run(&Work {
            groups: vec![Group {
                record: None,
                requests: vec![request],
            }],
            returns: vec![],
        })
        .remove(0)
        .remove(0)
}

#[test]
fn a_bucket_admits_its_capacity_then_refills_with_time() {
    let s = MemoryStore::new(T0, 0.1, 10_000);
    for i in 0..5 {
        let r = one(&s, vec![charge("k", 5, 1.0, 1)]);
        assert_eq!(r.status, Status::Charged, "request {i}");
        assert_eq!(r.decisions[0].remaining, 4 - i);
    }
    let r = one(&s, vec![charge("k", 5, 1.0, 1)]);
    assert_eq!(r.status, Status::Rejected);
    assert_eq!(r.decisions[0].retry_after_ms, 1000);
    assert_eq!(r.decisions[0].reset_ms, 5000);
    s.advance_ms(1000);
    assert_eq!(
        one(&s, vec![charge("k", 5, 1.0, 1)]).status,
        Status::Charged
    );
}

#[test]
fn all_or_nothing_and_shadow_decisions_never_reject() {
    let s = MemoryStore::new(T0, 0.1, 10_000);
    let r = one(&s, vec![charge("a", 10, 1.0, 1), charge("b", 1, 1.0, 2)]);
    assert_eq!(r.status, Status::Rejected);
    assert_eq!(r.decisions[1].reason, Reason::CostExceedsCapacity);
    assert_eq!(s.stored_tokens("a"), None, "nothing charged");
    let mut shadow = charge("b", 1, 1.0, 2);
    shadow.shadow = true;
    let r = one(&s, vec![charge("a", 10, 1.0, 1), shadow]);
    assert_eq!(r.status, Status::Charged);
    assert!(!r.decisions[1].allowed);
    assert_eq!(s.stored_tokens("a"), Some(9.0));
}

#[test]
fn a_grant_capped_by_its_ask_alone_may_take_what_the_bucket_holds() {
    let s = MemoryStore::new(T0, 0.5, 10_000);
    let ask = |id| ratelimit_wire::LeaseAsk {
        id,
        tokens: 80,
        ttl_ms: 1000,
    };
    let mut c = charge("q", 100, 10.0, 1);
    (c.lease, c.grant_cap) = (Some(ask(1)), GrantCap::Ask);
    let r = one(&s, vec![c.clone()]);
    assert_eq!(
        r.decisions[0].leased, 80,
        "the ask, above max_share * capacity (50)"
    );
    assert_eq!(r.decisions[0].remaining, 19);
    // Still never more than the bucket holds after the cost.
    c.lease = Some(ask(2));
    let r = one(&s, vec![c]);
    assert_eq!(r.decisions[0].leased, 18);
    assert_eq!(r.decisions[0].remaining, 0);
}

#[test]
fn leases_lower_the_ceiling_until_returned_or_expired() {
    let s = MemoryStore::new(T0, 0.5, 10_000);
    let mut c = charge("h", 100, 10.0, 1);
    c.lease = Some(ratelimit_wire::LeaseAsk {
        id: 7,
        tokens: 80,
        ttl_ms: 1000,
    });
    let r = one(&s, vec![c]);
    assert_eq!(r.decisions[0].leased, 50, "at most max_share * capacity");
    assert_eq!(r.decisions[0].remaining, 49);
    // Refill cannot fill what the lease holds: the ceiling is 50 while it lasts.
    s.advance_ms(900);
    let r = one(&s, vec![charge("h", 100, 10.0, 1)]);
    assert_eq!(r.decisions[0].remaining, 49);
    // Giving 20 back removes the lease: the ceiling is 100 again.
    let w = Work {
        groups: vec![],
        returns: vec![Return {
            key: Arc::from("h"),
            bucket: BucketLimits::new(100, 10.0),
            lease_id: 7,
            tokens: 20,
        }],
    };
    s.run(&w);
    assert_eq!(s.stored_tokens("h"), Some(69.0));
}

#[test]
fn a_record_replays_and_a_refund_gives_back_once() {
    let s = MemoryStore::new(T0, 0.1, 10_000);
    let g = Group {
        record: Some("k:a:1".into()),
        requests: vec![vec![charge("k", 10, 1.0, 3)]],
    };
    let w = Work {
        groups: vec![g.clone()],
        returns: vec![],
    };
    assert_eq!(s.run(&w)[0][0].status, Status::Charged);
    assert_eq!(s.run(&w)[0][0].status, Status::Replayed { charged: true });
    assert_eq!(s.stored_tokens("k"), Some(7.0));
    assert!(s.refund_now(&g, &[0]));
    assert!(!s.refund_now(&g, &[0]), "a second refund does nothing");
    assert_eq!(s.stored_tokens("k"), Some(10.0));
    assert_eq!(s.run(&w)[0][0].status, Status::Replayed { charged: false });
}
