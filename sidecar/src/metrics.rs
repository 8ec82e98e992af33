//! The sidecar's Prometheus metrics, served as text on `GET /metrics`.

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerdictLabels {
    /// `allowed` or `rejected`.
    pub verdict: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `allowed`, `rejected`, `bad_request`, `unavailable` or `error`.
    pub outcome: &'static str,
}

/// Decision latency buckets, seconds: 100 µs to 1 s.
const DURATION_BUCKETS_S: [f64; 13] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// Every metric of the sidecar. Cheap to share: each field is a handle onto shared state.
pub struct Metrics {
    registry: Registry,
    /// `ratelimit_decisions_total{verdict}`: one per decision (bucket) answered.
    pub decisions: Family<VerdictLabels, Counter>,
    /// `ratelimit_requests_total{outcome}`: one per `POST /v1/decide`.
    pub requests: Family<OutcomeLabels, Counter>,
    /// `ratelimit_decision_duration_seconds`: time to answer a `POST /v1/decide`, Redis included.
    pub decision_duration: Histogram,
    /// `ratelimit_redis_errors_total`: failed or timed-out Redis calls.
    pub redis_errors: Counter,
    /// `ratelimit_script_loads_total`: script (re)loads (startup, readiness, NOSCRIPT fallback).
    pub script_loads: Counter,
    /// `ratelimit_compensations_total`: cross-slot requests whose refunds all completed (counted
    /// after the refund calls answered, not when they were started).
    pub compensations: Counter,
    /// Handles onto `decisions`, looked up once: `[rejected, allowed]`.
    verdicts: [Counter; 2],
    /// Handles onto `requests`, looked up once, in [`OUTCOMES`] order.
    outcomes: [Counter; 5],
}

/// How a `POST /v1/decide` ended: the `outcome` label of `ratelimit_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOutcome {
    Allowed,
    Rejected,
    BadRequest,
    Unavailable,
    Error,
}

/// The labels of [`RequestOutcome`], in its order.
const OUTCOMES: [&str; 5] = ["allowed", "rejected", "bad_request", "unavailable", "error"];

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let decisions = Family::<VerdictLabels, Counter>::default();
        let requests = Family::<OutcomeLabels, Counter>::default();
        let decision_duration = Histogram::new(DURATION_BUCKETS_S);
        let redis_errors = Counter::default();
        let script_loads = Counter::default();
        let compensations = Counter::default();
        registry.register(
            "ratelimit_decisions",
            "Decisions (buckets) answered, by verdict",
            decisions.clone(),
        );
        registry.register(
            "ratelimit_requests",
            "POST /v1/decide requests, by outcome",
            requests.clone(),
        );
        registry.register(
            "ratelimit_decision_duration_seconds",
            "Time to answer POST /v1/decide, Redis included",
            decision_duration.clone(),
        );
        registry.register(
            "ratelimit_redis_errors",
            "Redis calls that failed or timed out",
            redis_errors.clone(),
        );
        registry.register(
            "ratelimit_script_loads",
            "Loads of the bucket script into Redis (startup, readiness, NOSCRIPT fallback)",
            script_loads.clone(),
        );
        registry.register(
            "ratelimit_compensations",
            "Cross-slot requests whose charged or failed slots were refunded (counted once the refunds completed)",
            compensations.clone(),
        );
        let verdicts = ["rejected", "allowed"]
            .map(|verdict| decisions.get_or_create(&VerdictLabels { verdict }).clone());
        let outcomes =
            OUTCOMES.map(|outcome| requests.get_or_create(&OutcomeLabels { outcome }).clone());
        Self {
            verdicts,
            outcomes,
            registry,
            decisions,
            requests,
            decision_duration,
            redis_errors,
            script_loads,
            compensations,
        }
    }

    /// Counts one `POST /v1/decide` by outcome.
    pub fn request(&self, outcome: RequestOutcome) {
        self.outcomes[outcome as usize].inc();
    }

    /// Counts one decision by verdict.
    pub fn decision(&self, allowed: bool) {
        self.verdicts[usize::from(allowed)].inc();
    }

    /// The metrics in the Prometheus/OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_documented_ones() {
        let m = Metrics::new();
        m.decision(true);
        m.request(RequestOutcome::BadRequest);
        let text = m.encode();
        for name in [
            "ratelimit_decisions_total{verdict=\"allowed\"} 1",
            "ratelimit_requests_total{outcome=\"bad_request\"} 1",
            "ratelimit_decision_duration_seconds_bucket{le=\"0.0001\"}",
            "ratelimit_redis_errors_total",
            "ratelimit_script_loads_total",
            "ratelimit_compensations_total",
        ] {
            assert!(text.contains(name), "{name} missing in\n{text}");
        }
    }
}
