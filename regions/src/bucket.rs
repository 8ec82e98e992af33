//! The reference token bucket of a regional share, in exact integer arithmetic, with time passed
//! in (milliseconds on one clock: in production the region's Redis clock).
//!
//! A rule's global budget is a bucket of `capacity` tokens (`C`) refilled at `refill_per_sec`
//! (`R`). Region `r` holding share `s_r` runs the same bucket scaled by `s_r`:
//!
//! ```text
//! capacity_r = C * s_r            refill_r = R * s_r         (fill time C / R for any share)
//! tokens     = min(capacity_r, tokens + refill_r * elapsed)
//! admit if tokens >= cost: tokens -= cost
//! ```
//!
//! Tokens are counted in nanotokens and shares in parts per million, so `C * s_r` is
//! `C * ppm * 1000` nanotokens and `R * s_r` is `R * ppm` nanotokens per millisecond: both exact,
//! and the regions' capacities and refills add up to at most the global ones without rounding.
//!
//! A share that changes between two takes: the share passed to [`Bucket::take`] must be the
//! smallest share in force at any instant since the bucket's last take
//! ([`crate::ShareHistory::min_since`]). Both the refill over the elapsed time and the clamp use it,
//! so a shrink clamps the tokens at the next take, a grow only counts from the take after it, and
//! a share that dipped and came back while the bucket was idle still clamps it: tokens are never
//! created by a change of share (`docs/regions.md`, "The bound").

use crate::share::Share;

/// Nanotokens in one token.
pub const NANO_PER_TOKEN: u128 = 1_000_000_000;

/// A rule's global budget: a token bucket of `capacity` tokens (the burst, `C`) refilled at
/// `refill_per_sec` tokens per second (`R`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub capacity: u64,
    pub refill_per_sec: u64,
}

impl Budget {
    /// `Err` names the field that cannot be honoured.
    pub fn validate(&self) -> Result<(), String> {
        let mut problems = Vec::new();
        if self.capacity == 0 {
            problems.push("capacity: must be > 0");
        }
        if self.refill_per_sec == 0 {
            problems.push("refill_per_sec: must be > 0");
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }

    /// The time an empty bucket of any share takes to fill: `C / R`, in milliseconds, rounded up.
    pub fn fill_time_ms(&self) -> u64 {
        (self.capacity * 1000).div_ceil(self.refill_per_sec.max(1))
    }

    /// The bucket of `share` of this budget.
    pub fn scaled(&self, share: Share) -> Limit {
        let ppm = u128::from(share.ppm());
        Limit {
            capacity_nano: u128::from(self.capacity) * ppm * 1000,
            refill_nano_per_ms: u128::from(self.refill_per_sec) * ppm,
        }
    }
}

/// A bucket's size and speed, in nanotokens (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub capacity_nano: u128,
    pub refill_nano_per_ms: u128,
}

/// One bucket's state: `tokens_nano` at `updated_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    tokens_nano: u128,
    updated_ms: u64,
}

impl Bucket {
    /// A full bucket of `limit` at `now_ms` (a bucket nobody has used is a full one).
    pub fn full(limit: Limit, now_ms: u64) -> Bucket {
        Bucket {
            tokens_nano: limit.capacity_nano,
            updated_ms: now_ms,
        }
    }

    /// When the bucket was last taken from (the start of the interval whose smallest share the
    /// next take needs).
    pub fn updated_ms(&self) -> u64 {
        self.updated_ms
    }

    /// Tokens in the bucket at its last take, in nanotokens.
    pub fn tokens_nano(&self) -> u128 {
        self.tokens_nano
    }

    /// Takes `cost` tokens at `now_ms` under `limit`, the bucket of the smallest share in force
    /// since [`Bucket::updated_ms`]; `true` when admitted. A clock that went backward counts as
    /// no time passing.
    pub fn take(&mut self, limit: Limit, now_ms: u64, cost: u64) -> bool {
        let elapsed_ms = u128::from(now_ms.saturating_sub(self.updated_ms));
        let refilled = self
            .tokens_nano
            .saturating_add(limit.refill_nano_per_ms.saturating_mul(elapsed_ms));
        let tokens = refilled.min(limit.capacity_nano);
        self.updated_ms = self.updated_ms.max(now_ms);
        let cost = u128::from(cost) * NANO_PER_TOKEN;
        if tokens >= cost {
            self.tokens_nano = tokens - cost;
            true
        } else {
            self.tokens_nano = tokens;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUDGET: Budget = Budget {
        capacity: 100,
        refill_per_sec: 10,
    };

    fn share(f: f64) -> Share {
        Share::from_fraction(f).unwrap()
    }

    /// Takes one token `n` times at `now_ms`; how many were admitted.
    fn burst(bucket: &mut Bucket, limit: Limit, now_ms: u64, n: u64) -> u64 {
        (0..n).filter(|_| bucket.take(limit, now_ms, 1)).count() as u64
    }

    #[test]
    fn a_full_bucket_admits_its_capacity_then_refills_at_its_rate() {
        let limit = BUDGET.scaled(Share::WHOLE);
        let mut b = Bucket::full(limit, 0);
        assert_eq!(burst(&mut b, limit, 0, 150), 100);
        assert_eq!(burst(&mut b, limit, 999, 20), 9, "9.99 tokens after 999 ms");
        assert_eq!(
            burst(&mut b, limit, 1_000, 5),
            1,
            "the 0.99 left plus 0.01, exactly"
        );
        assert_eq!(burst(&mut b, limit, 1_099, 5), 0);
        assert_eq!(burst(&mut b, limit, 1_100, 5), 1);
    }

    #[test]
    fn a_share_scales_capacity_and_refill_and_keeps_the_fill_time() {
        let limit = BUDGET.scaled(share(0.3));
        let mut b = Bucket::full(limit, 0);
        assert_eq!(burst(&mut b, limit, 0, 100), 30);
        assert_eq!(
            burst(&mut b, limit, 10_000, 100),
            30,
            "3 per second for 10 s"
        );
        assert_eq!(BUDGET.fill_time_ms(), 10_000);
    }

    #[test]
    fn shares_that_sum_to_one_sum_to_the_global_bucket_exactly() {
        let parts = [share(0.1), share(0.2), share(0.7)];
        let cap: u128 = parts.iter().map(|&s| BUDGET.scaled(s).capacity_nano).sum();
        let refill: u128 = parts
            .iter()
            .map(|&s| BUDGET.scaled(s).refill_nano_per_ms)
            .sum();
        assert_eq!(cap, BUDGET.scaled(Share::WHOLE).capacity_nano);
        assert_eq!(refill, BUDGET.scaled(Share::WHOLE).refill_nano_per_ms);
    }

    #[test]
    fn a_shrink_clamps_the_tokens_at_the_next_take() {
        let mut b = Bucket::full(BUDGET.scaled(share(0.5)), 0);
        let small = BUDGET.scaled(share(0.2));
        assert_eq!(burst(&mut b, small, 0, 100), 20);
    }

    #[test]
    fn a_grow_adds_capacity_but_no_tokens() {
        let small = BUDGET.scaled(share(0.2));
        let mut b = Bucket::full(small, 0);
        assert_eq!(burst(&mut b, small, 0, 20), 20);
        // Grown to 0.5 at 1 s. The take at 2 s passes the smallest share since 0 (0.2): 4 tokens
        // (2 per second), one taken. The take at 4 s passes 0.5: 3 + 5 per second for 2 s.
        assert_eq!(burst(&mut b, small, 2_000, 1), 1);
        let big = BUDGET.scaled(share(0.5));
        assert_eq!(burst(&mut b, big, 4_000, 100), 13);
    }

    #[test]
    fn a_clock_that_went_backward_adds_nothing() {
        let limit = BUDGET.scaled(Share::WHOLE);
        let mut b = Bucket::full(limit, 5_000);
        assert_eq!(burst(&mut b, limit, 5_000, 100), 100);
        assert_eq!(burst(&mut b, limit, 1_000, 1), 0);
        assert_eq!(b.updated_ms(), 5_000, "never moves back");
        assert_eq!(burst(&mut b, limit, 5_100, 1), 1);
    }

    #[test]
    fn a_cost_above_the_capacity_never_succeeds() {
        let limit = BUDGET.scaled(share(0.5));
        let mut b = Bucket::full(limit, 0);
        assert!(!b.take(limit, 1_000_000, 51));
        assert!(b.take(limit, 1_000_000, 50));
    }

    #[test]
    fn a_zero_budget_is_refused_by_name() {
        let bad = Budget {
            capacity: 0,
            refill_per_sec: 0,
        };
        assert_eq!(
            bad.validate().unwrap_err(),
            "capacity: must be > 0; refill_per_sec: must be > 0"
        );
    }
}
