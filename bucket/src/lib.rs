//! The token bucket's formulas, said once. `lua/bucket.lua` computes the same in Redis; the
//! in-memory model of the script (`sidecar/src/store/memory/`), the filter's emergency bucket
//! (`filter/src/emergency.rs`) and the sidecar's applied limit of a regional rule use these. Plain
//! `f64` arithmetic in the script's order, so Rust and Lua round alike; no clock (time is passed
//! in) and no dependencies, so every crate, the wasm filter included, can hold it.
//!
//! ```text
//! tokens         = min(capacity - leased, tokens + refill_per_sec * max(0, elapsed_us) / 1e6)
//! admit if tokens >= cost, then tokens -= cost
//! retry_after_ms = ceil((cost - tokens) / refill_per_sec * 1000)
//! reset_ms       = ceil((capacity - tokens) / refill_per_sec * 1000)
//! under a share of m parts per million: capacity, refill_per_sec = floor(x * m) / 1e6
//! ```
//!
//! Why each rule holds (time from Redis, a missing bucket is full, leases): `docs/bucket.md`.

/// The largest integer a double holds exactly (2^53): figures are clamped to it, as the script
/// does for its reply.
pub const MAX_EXACT: f64 = 9_007_199_254_740_992.0;

/// The tokens of a bucket that held `tokens` `elapsed_us` microseconds ago, refilled at
/// `refill_per_sec` up to `ceiling` (the capacity, less what leases hold: [`lease_ceiling`]). A
/// negative elapsed time (a clock that went back) adds nothing. A bucket in debt (`tokens < 0`,
/// a settled cost above its reservation) refills from below zero and keeps what is left of its
/// debt; a ceiling below zero (leases above a share's capacity) caps at 0, never adds a debt.
pub fn refill(tokens: f64, refill_per_sec: f64, elapsed_us: f64, ceiling: f64) -> f64 {
    let elapsed_us = if elapsed_us < 0.0 { 0.0 } else { elapsed_us };
    let tokens = tokens + refill_per_sec * elapsed_us / 1_000_000.0;
    if tokens > ceiling {
        if ceiling > 0.0 {
            ceiling
        } else {
            tokens.min(0.0)
        }
    } else {
        tokens
    }
}

/// The lease ceiling: `capacity` less the tokens the bucket's unexpired leases hold, summed first
/// (the script's order).
pub fn lease_ceiling(capacity: f64, leased: impl IntoIterator<Item = f64>) -> f64 {
    capacity - leased.into_iter().fold(0.0, |sum, amount| sum + amount)
}

/// Milliseconds until `cost` tokens are there, for a bucket holding `tokens`: 0 when they are.
pub fn retry_after_ms(cost: f64, tokens: f64, refill_per_sec: f64) -> u64 {
    wait_ms(cost - tokens, refill_per_sec)
}

/// Milliseconds until the bucket, holding `tokens`, is full again.
pub fn reset_ms(capacity: f64, tokens: f64, refill_per_sec: f64) -> u64 {
    wait_ms(capacity - tokens, refill_per_sec)
}

/// Milliseconds the refill takes to add `tokens`, rounded up but forgiving float noise below a
/// nanosecond (100.00000000000001 is 100); 0 for nothing to add, [`MAX_EXACT`] at most (a refill
/// scaled down to 0 never adds anything).
pub fn wait_ms(tokens: f64, refill_per_sec: f64) -> u64 {
    whole((tokens / refill_per_sec * 1000.0 - 1e-6).ceil())
}

/// `x` as a whole number: rounded down, 0 for NaN or less than nothing, [`MAX_EXACT`] at most.
pub fn whole(x: f64) -> u64 {
    if x.is_nan() || x <= 0.0 {
        0
    } else if x >= MAX_EXACT {
        MAX_EXACT as u64
    } else {
        x.floor() as u64
    }
}

/// `x` (a capacity or a refill) under a share of `ppm` parts per million, rounded down to a
/// millionth: a share never holds a token more than its part.
pub fn scaled(x: f64, ppm: u32) -> f64 {
    (x * f64::from(ppm)).floor() / 1_000_000.0
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn refill_adds_the_elapsed_time_up_to_the_ceiling_and_never_goes_back() {
        assert_eq!(refill(0.0, 10.0, 250_000.0, 100.0), 2.5);
        assert_eq!(refill(99.0, 10.0, 1_000_000.0, 100.0), 100.0);
        assert_eq!(
            refill(5.0, 10.0, -1_000_000.0, 100.0),
            5.0,
            "a clock that went back"
        );
        assert_eq!(
            refill(50.0, 10.0, 0.0, 20.0),
            20.0,
            "leases lower the ceiling"
        );
        assert_eq!(
            refill(5.0, 1.0, 0.0, -3.0),
            0.0,
            "a ceiling below 0 caps at 0"
        );
    }

    #[test]
    fn a_debt_refills_from_below_zero_and_its_wait_includes_it() {
        assert_eq!(refill(-50.0, 10.0, 1_000_000.0, 100.0), -40.0);
        assert_eq!(refill(-50.0, 10.0, 6_000_000.0, 100.0), 10.0);
        assert_eq!(
            refill(-50.0, 10.0, 0.0, -3.0),
            -50.0,
            "leases never add to a debt"
        );
        // retry_after = (debt + cost) / refill
        assert_eq!(retry_after_ms(10.0, -40.0, 10.0), 5_000);
        assert_eq!(reset_ms(100.0, -40.0, 10.0), 14_000);
    }

    #[test]
    fn waits_round_up_and_forgive_float_noise() {
        assert_eq!(retry_after_ms(1.0, 0.25, 1.0), 750);
        assert_eq!(retry_after_ms(1.0, 0.0, 3.0), 334);
        assert_eq!(retry_after_ms(1.0, 1.0, 3.0), 0, "nothing missing");
        assert_eq!(
            retry_after_ms(3.0, 0.0, 0.3),
            10_000,
            "3 / 0.3 is 10.000000000000002"
        );
        assert_eq!(reset_ms(100.0, 24.5, 10.0), 7_550);
        assert_eq!(reset_ms(10.0, 10.0, 1.0), 0);
        assert_eq!(
            wait_ms(1.0, 0.0),
            MAX_EXACT as u64,
            "a refill of 0 never fills"
        );
        assert_eq!(wait_ms(0.0, 0.0), 0, "nothing to fill: 0 / 0");
    }

    #[test]
    fn whole_numbers_are_clamped_to_what_a_double_holds() {
        assert_eq!(whole(3.9), 3);
        assert_eq!(whole(-1.0), 0);
        assert_eq!(whole(f64::NAN), 0);
        assert_eq!(whole(1e300), MAX_EXACT as u64);
    }

    #[test]
    fn a_share_rounds_down_to_a_millionth() {
        assert_eq!(scaled(1000.0, 300_000), 300.0);
        assert_eq!(scaled(5.0, 990_000), 4.95);
        assert_eq!(scaled(1.0, 1), 0.000001);
        assert_eq!(
            scaled(0.001, 1),
            0.0,
            "a tiny share of a slow refill is none"
        );
        assert_eq!(scaled(7.0, 1_000_000), 7.0);
    }

    #[test]
    fn the_lease_ceiling_is_the_capacity_less_the_leases() {
        assert_eq!(lease_ceiling(100.0, [30.0, 20.0]), 50.0);
        assert_eq!(lease_ceiling(100.0, []), 100.0);
    }
}
