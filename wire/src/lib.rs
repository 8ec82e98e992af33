//! The wire contract of `POST /v1/decide`, shared by the filter (which sends it) and the sidecar
//! (which answers it). One definition, two users: neither side keeps its own copy.
//!
//! Request:  `{"decisions":[{"key":"app:alpha","capacity":100,"refill_per_sec":10,"cost":1,"attempt":"r-1"}]}`
//! Answer:   `{"allowed":true,"results":[{"allowed":true,"remaining":99,"retry_after_ms":0,"reset_ms":100}]}`
//! Error:    `{"error":"decisions[0].capacity: must be a number > 0, got 0"}` (400, 500 or 503)

use serde::{Deserialize, Serialize};

/// The path the sidecar serves decisions on.
pub const DECIDE_PATH: &str = "/v1/decide";

/// The most decisions one request may carry; more is refused with 400.
pub const MAX_DECISIONS: usize = 64;

/// The longest bucket key or attempt id accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 512;

fn default_cost() -> f64 {
    1.0
}

/// One request's decisions: the request passes only if every decision admits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecideRequest {
    pub decisions: Vec<Decision>,
}

/// One bucket to charge: `cost` tokens from the bucket `key` of size `capacity` that refills at
/// `refill_per_sec` tokens per second.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decision {
    /// The bucket's name: 1 to [`MAX_KEY_BYTES`] bytes, without `{` or `}`, at most once per
    /// request (the sidecar answers 400 otherwise).
    pub key: String,
    pub capacity: f64,
    pub refill_per_sec: f64,
    /// Tokens this request costs; 1 when absent.
    #[serde(default = "default_cost")]
    pub cost: f64,
    /// Identifies this attempt: a repeat of the same attempt on the same key within its TTL gets the
    /// first verdict back and is not charged again; if that attempt was refunded (its request was
    /// rejected by another Cluster slot), the repeat is answered `allowed: false`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<String>,
}

/// Why a bucket answered as it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The bucket held `cost` tokens; with `allowed: false`, the bucket refused nothing but the
    /// request was rejected without its answer (its Cluster slot failed while another rejected).
    Ok,
    /// Not enough tokens now; `retry_after_ms` says when there will be.
    Insufficient,
    /// `cost > capacity`: this bucket can never admit it, waiting does not help.
    CostExceedsCapacity,
}

/// The answer to a whole request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecideResponse {
    /// The request's verdict: true only if every decision admitted.
    pub allowed: bool,
    /// One result per decision, in the order of the request.
    pub results: Vec<DecisionResult>,
}

/// One bucket's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionResult {
    /// Whether this bucket held enough tokens. When another decision of the same request rejected,
    /// this bucket may say `true` and still was not charged (all-or-nothing).
    pub allowed: bool,
    /// Whole tokens left in the bucket after this decision.
    pub remaining: u64,
    /// Milliseconds until `cost` tokens are available; 0 when allowed. For
    /// [`Reason::CostExceedsCapacity`] it is 0 and waiting does not help.
    pub retry_after_ms: u64,
    /// Milliseconds until the bucket is full again.
    pub reset_ms: u64,
    #[serde(default = "default_reason")]
    pub reason: Reason,
}

fn default_reason() -> Reason {
    Reason::Ok
}

/// The body of every non-200 answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_from_the_documented_example() {
        let r: DecideRequest = serde_json::from_str(
            r#"{"decisions":[{"key":"app:alpha","capacity":100,"refill_per_sec":10,"cost":1,"attempt":"r-1"}]}"#,
        )
        .unwrap();
        assert_eq!(r.decisions[0].key, "app:alpha");
        assert_eq!(r.decisions[0].attempt.as_deref(), Some("r-1"));
    }

    #[test]
    fn cost_defaults_to_one_and_attempt_is_optional() {
        let r: DecideRequest =
            serde_json::from_str(r#"{"decisions":[{"key":"k","capacity":5,"refill_per_sec":1}]}"#)
                .unwrap();
        assert_eq!(r.decisions[0].cost, 1.0);
        assert_eq!(r.decisions[0].attempt, None);
        assert!(!serde_json::to_string(&r).unwrap().contains("attempt"));
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = serde_json::from_str::<DecideRequest>(
            r#"{"decisions":[{"key":"k","capacity":5,"refill_per_sec":1,"costs":2}]}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("costs"), "{e}");
    }

    #[test]
    fn response_round_trips_and_reason_defaults_to_ok() {
        let r: DecideResponse = serde_json::from_str(
            r#"{"allowed":true,"results":[{"allowed":true,"remaining":99,"retry_after_ms":0,"reset_ms":100}]}"#,
        )
        .unwrap();
        assert_eq!(r.results[0].reason, Reason::Ok);
        let back: DecideResponse =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }
}
