//! The rate-limit response headers, rendered in one place for every gateway: the wasm filter adds
//! them to its replies and admitted responses, and the sidecar hands them to Envoy's native rate
//! limit filter (`response_headers_to_add` of the gRPC answer), so a client sees the same fields
//! whichever path limited it.
//!
//! Fields (IETF draft `httpapi-ratelimit-headers`, RFC 8941 structured fields):
//! - `RateLimit-Policy: "per-app";q=100;w=10`: quota `q` = capacity, window `w` = seconds a full
//!   refill takes (`capacity / refill_per_sec`, rounded up, at least 1).
//! - `RateLimit: "per-app";r=0;t=1`: `r` = whole tokens remaining, `t` = seconds, rounded up,
//!   until the request's cost is available again (on a 429, equal to `Retry-After`) or, on an
//!   admitted response, until the bucket is full.
//! - `Retry-After` (429): seconds until the cost is available, rounded up, at least 1.
//!
//! Every integer is clamped to [`MAX_SF_INTEGER`], the largest RFC 8941 structured-field integer.

use crate::{AppliedLimit, DecisionResult, Reason};

/// The largest integer of an RFC 8941 structured field: 15 digits.
pub const MAX_SF_INTEGER: u64 = 999_999_999_999_999;

/// Header names, lowercase (HTTP/2 and Envoy's header maps want them so).
pub const RATELIMIT_POLICY: &str = "ratelimit-policy";
pub const RATELIMIT: &str = "ratelimit";
pub const RETRY_AFTER: &str = "retry-after";

/// `n`, clamped to the largest structured-field integer.
pub fn sf_integer(n: u64) -> u64 {
    n.min(MAX_SF_INTEGER)
}

/// Whole seconds, rounded up.
pub fn ceil_s(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// `Retry-After` for a wait of `retry_after_ms`: seconds rounded up, at least 1, at most
/// [`MAX_SF_INTEGER`].
pub fn retry_after_s(retry_after_ms: u64) -> u64 {
    sf_integer(ceil_s(retry_after_ms).max(1))
}

/// Seconds an empty bucket of `capacity` takes to fill at `refill_per_sec`, rounded up, at least 1.
pub fn window_s(capacity: u64, refill_per_sec: f64) -> u64 {
    // Float-to-int `as` saturates, so absurd ratios cannot panic.
    (capacity as f64 / refill_per_sec).ceil().max(1.0) as u64
}

/// One bucket's figures for the headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderLimit<'a> {
    /// The limit's name (a policy rule or override: `[A-Za-z0-9_.-]`, so it needs no escaping
    /// inside the quoted string).
    pub name: &'a str,
    /// `q`: the capacity.
    pub quota: u64,
    /// `w`: seconds a full refill takes.
    pub window_s: u64,
    /// `r`: whole tokens remaining.
    pub remaining: u64,
    /// `t`: seconds until the cost is available (rejected) or the bucket is full (admitted).
    pub reset_s: u64,
}

impl<'a> HeaderLimit<'a> {
    /// The figures of a limit the sidecar applied, with `remaining` tokens and `reset_s` seconds.
    pub fn applied(limit: &'a AppliedLimit, remaining: u64, reset_s: u64) -> HeaderLimit<'a> {
        HeaderLimit {
            name: &limit.name,
            quota: limit.capacity,
            window_s: window_s(
                limit.capacity.max(1),
                limit.refill_per_sec.max(f64::MIN_POSITIVE),
            ),
            remaining,
            reset_s,
        }
    }

    /// One member of `RateLimit-Policy`: `"name";q=..;w=..`.
    pub fn policy(&self) -> String {
        format!(
            "\"{}\";q={};w={}",
            self.name,
            sf_integer(self.quota),
            sf_integer(self.window_s)
        )
    }

    /// One member of `RateLimit`: `"name";r=..;t=..`.
    pub fn limit(&self) -> String {
        format!(
            "\"{}\";r={};t={}",
            self.name,
            sf_integer(self.remaining),
            sf_integer(self.reset_s)
        )
    }
}

/// `RateLimit-Policy` and `RateLimit` for several limits (structured-field lists), in order;
/// nothing when `limits` is empty.
pub fn admitted(limits: &[HeaderLimit<'_>]) -> Vec<(&'static str, String)> {
    if limits.is_empty() {
        return Vec::new();
    }
    let policies: Vec<_> = limits.iter().map(HeaderLimit::policy).collect();
    let remaining: Vec<_> = limits.iter().map(HeaderLimit::limit).collect();
    vec![
        (RATELIMIT_POLICY, policies.join(", ")),
        (RATELIMIT, remaining.join(", ")),
    ]
}

/// The figures of each limit an admitted request's results name, shadow mode apart, in order:
/// what its `RateLimit-Policy` and `RateLimit` headers say ([`admitted`]).
pub fn admitted_limits(results: &[DecisionResult]) -> Vec<HeaderLimit<'_>> {
    results
        .iter()
        .filter(|r| !r.shadow)
        .filter_map(|r| {
            r.limit
                .as_ref()
                .map(|l| HeaderLimit::applied(l, r.remaining, ceil_s(r.reset_ms)))
        })
        .collect()
}

/// Which decision of a rejected request names the rejection (its rule in the 429's body, its
/// figures in the headers), as both the wasm filter and the gRPC API answer it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limiting {
    /// The `i`-th decision can never admit (a cost above its capacity, a blocked subject): the
    /// first such one names the rejection, and waiting does not help.
    Never(usize),
    /// The `i`-th decision makes the client wait longest: the rejecting decision with the largest
    /// `retry_after_ms` (one whose own bucket refused before one that merely was not decided).
    Wait(usize),
}

/// The decision that names a request's rejection; `None` when no decision rejected.
pub fn limiting(results: &[DecisionResult]) -> Option<Limiting> {
    if let Some(i) = results.iter().position(|r| {
        !r.allowed && matches!(r.reason, Reason::CostExceedsCapacity | Reason::Blocked)
    }) {
        return Some(Limiting::Never(i));
    }
    results
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.allowed)
        // Ties go to the last, as `max_by_key` has it.
        .max_by_key(|(_, r)| (r.reason != Reason::Ok, r.retry_after_ms))
        .map(|(i, _)| Limiting::Wait(i))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_are_clamped_and_seconds_round_up() {
        assert_eq!(sf_integer(u64::MAX), MAX_SF_INTEGER);
        assert_eq!(ceil_s(0), 0);
        assert_eq!(ceil_s(1), 1);
        assert_eq!(ceil_s(1000), 1);
        assert_eq!(ceil_s(1001), 2);
        assert_eq!(retry_after_s(0), 1, "at least 1");
        assert_eq!(retry_after_s(1500), 2);
        assert_eq!(retry_after_s(u64::MAX), MAX_SF_INTEGER);
        assert_eq!(window_s(10, 1.0), 10);
        assert_eq!(window_s(10, 3.0), 4);
        assert_eq!(window_s(1, 100.0), 1, "at least 1");
        assert_eq!(window_s(u64::MAX, f64::MIN_POSITIVE), u64::MAX);
    }

    #[test]
    fn fields_render_as_structured_field_lists() {
        let a = AppliedLimit {
            name: "per-app".into(),
            capacity: 100,
            refill_per_sec: 10.0,
        };
        let b = AppliedLimit {
            name: "per-ip".into(),
            capacity: 5,
            refill_per_sec: 0.5,
        };
        let limits = [
            HeaderLimit::applied(&a, 99, 1),
            HeaderLimit::applied(&b, 0, 2),
        ];
        assert_eq!(limits[0].policy(), "\"per-app\";q=100;w=10");
        assert_eq!(limits[1].limit(), "\"per-ip\";r=0;t=2");
        assert_eq!(
            admitted(&limits),
            vec![
                (
                    RATELIMIT_POLICY,
                    "\"per-app\";q=100;w=10, \"per-ip\";q=5;w=10".to_string()
                ),
                (
                    RATELIMIT,
                    "\"per-app\";r=99;t=1, \"per-ip\";r=0;t=2".to_string()
                ),
            ]
        );
        assert!(admitted(&[]).is_empty());
        let huge = HeaderLimit {
            name: "x",
            quota: u64::MAX,
            window_s: u64::MAX,
            remaining: u64::MAX,
            reset_s: u64::MAX,
        };
        assert_eq!(
            huge.policy(),
            format!("\"x\";q={MAX_SF_INTEGER};w={MAX_SF_INTEGER}")
        );
    }

    #[test]
    fn the_rejection_is_named_by_a_decision_that_never_admits_else_the_longest_wait() {
        let r = |allowed: bool, reason: Reason, retry_after_ms: u64| DecisionResult {
            receipt: None,
            allowed,
            remaining: 0,
            retry_after_ms,
            reset_ms: 0,
            reason,
            limit: None,
            shadow: false,
            leased: 0,
            error: None,
        };
        let ok = r(true, Reason::Ok, 0);
        assert_eq!(limiting(&[ok.clone(), ok.clone()]), None);
        let short = r(false, Reason::Insufficient, 100);
        let long = r(false, Reason::Insufficient, 900);
        let never = r(false, Reason::CostExceedsCapacity, 0);
        let blocked = r(false, Reason::Blocked, 0);
        let undecided = r(false, Reason::Ok, 0);
        assert_eq!(
            limiting(&[ok.clone(), short.clone(), long.clone(), short.clone()]),
            Some(Limiting::Wait(2))
        );
        assert_eq!(
            limiting(&[long.clone(), never.clone(), blocked.clone()]),
            Some(Limiting::Never(1))
        );
        assert_eq!(
            limiting(&[blocked, never, long.clone()]),
            Some(Limiting::Never(0))
        );
        // A decision that was not decided (another part failed) names the rejection only when
        // no bucket refused.
        assert_eq!(
            limiting(&[short.clone(), undecided.clone()]),
            Some(Limiting::Wait(0))
        );
        assert_eq!(
            limiting(&[undecided.clone(), undecided]),
            Some(Limiting::Wait(1))
        );
        assert_eq!(limiting(&[long.clone(), long]), Some(Limiting::Wait(1)));
    }
}
