//! The size of a lease ask.

use super::*;

/// What starting a lease ask found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseStart {
    /// The stopped leases' leftovers to give back: (lease id, tokens).
    pub give_back: Vec<(u64, u64)>,
    pub previous: Option<PreviousLease>,
}

/// The last lease of a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreviousLease {
    pub granted: u64,
    pub used: u64,
    pub asked_ns: u64,
}

/// The size of a lease ask: `clamp(ceil(rate * ttl * LEASE_HEADROOM), cost, max_tokens)`; `rate` from the
/// previous lease's use when there was one (tokens used over the time since it was asked), else
/// from `observed_per_sec`.
pub fn lease_size(
    previous: Option<PreviousLease>,
    observed_per_sec: f64,
    now_ns: u64,
    ttl_ms: u64,
    cost: u64,
    max_tokens: u64,
) -> u64 {
    let rate = match previous {
        Some(p) if now_ns > p.asked_ns => {
            let elapsed_s = (now_ns - p.asked_ns) as f64 / 1e9;
            (p.used as f64 / elapsed_s.max(1e-3)).max(observed_per_sec)
        }
        _ => observed_per_sec,
    };
    let want = (rate * ttl_ms as f64 / 1000.0 * LEASE_HEADROOM).ceil();
    // `as` saturates: an absurd rate cannot overflow.
    (want as u64).clamp(cost, max_tokens.max(cost))
}
