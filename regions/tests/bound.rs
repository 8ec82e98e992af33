//! Why a bucket is taken under the smallest share in force since its last take, not the share in
//! force now: a bucket idle while its region's share dips and comes back.

use ratelimit_regions::{Bucket, Budget, Share, ShareHistory};

const BUDGET: Budget = Budget {
    capacity: 1000,
    refill_per_sec: 100,
};

fn s(f: f64) -> Share {
    Share::from_fraction(f).unwrap()
}

/// Takes one token at a time from `bucket` at `now_ms` until it refuses; each admitted token is
/// fed to the exact global bucket. Returns (admitted, what the global bucket refused).
fn drain(bucket: &mut Bucket, share: Share, global: &mut Bucket, now_ms: u64) -> (u64, u64) {
    let (mut admitted, mut over) = (0, 0);
    while bucket.take(BUDGET.scaled(share), now_ms, 1) {
        admitted += 1;
        if !global.take(BUDGET.scaled(Share::WHOLE), now_ms, 1) {
            over += 1;
        }
    }
    (admitted, over)
}

/// Regions a and b hold 0.5 each of one key's budget (1000 tokens, 100/s, 10 s to fill).
/// a's bucket is full and idle. At 1 s a shrinks to 0.1; after the fence (6.5 s) b grows to 0.9,
/// and b's bucket fills to 900. At 19.9 s b takes its 900; at 20 s b shrinks back to 0.5 and
/// keeps taking what refills; at 25.5 s a grows back to 0.5 and takes what it can.
/// Returns (a's take at 25.5 s, what the global bucket refused in all).
fn dip_and_recovery(bucket_share: impl Fn(&ShareHistory, u64, u64) -> Share) -> (u64, u64) {
    let horizon = BUDGET.fill_time_ms();
    let mut a_history = ShareHistory::new(0, s(0.5));
    a_history.record(1_000, s(0.1));
    let mut b_history = ShareHistory::new(0, s(0.5));
    b_history.record(6_500, s(0.9));
    b_history.record(20_000, s(0.5));
    a_history.record(25_500, s(0.5));
    assert!(horizon < 25_500 - 1_000);

    let mut global = Bucket::full(BUDGET.scaled(Share::WHOLE), 0);
    let mut a = Bucket::full(BUDGET.scaled(s(0.5)), 0);
    let mut b = Bucket::full(BUDGET.scaled(s(0.5)), 0);
    let mut over = 0;
    let b_takes = |b: &mut Bucket, global: &mut Bucket, now| {
        let share = bucket_share(&b_history, b.updated_ms(), now);
        drain(b, share, global, now)
    };
    let (taken, refused) = b_takes(&mut b, &mut global, 19_900);
    assert_eq!(taken, 900);
    over += refused;
    for now in (20_000..=25_500).step_by(100) {
        over += b_takes(&mut b, &mut global, now).1;
    }
    let share = bucket_share(&a_history, a.updated_ms(), 25_500);
    let (a_taken, refused) = drain(&mut a, share, &mut global, 25_500);
    (a_taken, over + refused)
}

#[test]
fn an_idle_bucket_whose_share_dipped_and_came_back_is_clamped_to_the_dip() {
    let horizon = BUDGET.fill_time_ms();
    let (a_taken, over) = dip_and_recovery(|h, from, now| h.min_since(from, now, horizon));
    assert_eq!(
        a_taken, 100,
        "the capacity of 0.1, the smallest share of the last 10 s"
    );
    assert_eq!(over, 0);
}

#[test]
fn the_share_in_force_now_would_hand_out_tokens_the_global_bucket_does_not_have() {
    let horizon = BUDGET.fill_time_ms();
    let (a_taken, over) = dip_and_recovery(|h, _, now| h.min_since(now, now, horizon));
    assert_eq!(a_taken, 500);
    // The global bucket had 100 after b's 900, gained 5 per 100 ms net of b's takes: 380.
    assert_eq!(over, 120);
}
