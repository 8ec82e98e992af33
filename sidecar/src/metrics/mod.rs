//! The sidecar's Prometheus metrics, served as text on `GET /metrics`. Labels never carry subject
//! values (cardinality): decisions are labelled by the limit's name, which the policy bounds.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most one "limit reached" log line per limit in this time.
pub const LIMIT_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The "limit reached" log: one line per limit and per [`LIMIT_LOG_INTERVAL`] at most, naming
/// the limit and how many refusals it stands for (never a subject: logs are not for tracking
/// clients). The map holds one entry per limit name, which the policy bounds.
#[derive(Debug, Default)]
pub struct LimitLog {
    last: Mutex<HashMap<String, (Instant, u64)>>,
}

impl LimitLog {
    /// Notes `n` refusals by `limit` at `now`; the count to log when a line is due.
    pub fn refused(&self, limit: &str, now: Instant, n: u64) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        match last.get_mut(limit) {
            Some((at, count)) => {
                *count += n;
                if now.duration_since(*at) < LIMIT_LOG_INTERVAL {
                    return None;
                }
                let n = *count;
                *at = now;
                *count = 0;
                Some(n)
            }
            None => {
                last.insert(limit.to_string(), (now, 0));
                Some(n)
            }
        }
    }
}

mod labels;

pub use self::labels::*;

/// Decision latency buckets, seconds: 100 µs to 1 s.
const DURATION_BUCKETS_S: [f64; 13] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// Quota (RLQS) round durations, seconds: 1 ms to 5 s (the delivery margin is 500 ms as shipped).
const RLQS_ROUND_BUCKETS_S: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Decisions per script call: 1 to 512.
const BATCH_BUCKETS: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// Every metric of the sidecar. Cheap to share: each field is a handle onto shared state.
pub struct Metrics {
    registry: Registry,
    /// `ratelimit_decisions_total{limit, verdict}`: one per decision answered.
    pub decisions: Family<DecisionLabels, Counter>,
    /// `ratelimit_calls_total{api, outcome}`: one per call (HTTP request or gRPC call).
    pub calls: Family<CallLabels, Counter>,
    /// `ratelimit_requests_total{outcome}`: gateway requests by outcome (`allowed`, `rejected`,
    /// `unknown_rule`, `unavailable`, `error`).
    pub requests: Family<OutcomeLabels, Counter>,
    /// `ratelimit_decision_duration_seconds`: time to answer a call, Redis included.
    pub decision_duration: Histogram,
    /// `ratelimit_script_call_decisions`: decisions per script call (the batching at work).
    pub script_call_decisions: Histogram,
    /// `ratelimit_redis_errors_total`: failed or timed-out Redis calls.
    pub redis_errors: Counter,
    /// `ratelimit_script_loads_total`: script (re)loads (startup, readiness, NOSCRIPT fallback).
    pub script_loads: Counter,
    /// `ratelimit_compensations_total`: cross-node refunds that completed.
    pub compensations: Counter,
    /// `ratelimit_store_resets_total`: times a Redis node was seen to have lost its state (its
    /// epoch marker gone or recreated, `--store-reset`).
    pub store_resets: Counter,
    /// `ratelimit_unknown_rule_total`: decisions naming a rule or domain the policy lacks.
    pub unknown_rules: Counter,
    /// `ratelimit_policy_reloads_total{result}`: `ok` or `invalid` (the old policy stayed).
    pub policy_reloads: Family<ResultLabels, Counter>,
    /// `ratelimit_policy_limits`: limits (defaults and overrides) in the policy in force.
    pub policy_limits: Gauge,
    /// `ratelimit_lease_tokens_total{result}`: tokens `granted` to gateways as leases.
    pub lease_tokens: Family<ResultLabels, Counter>,
    /// `ratelimit_redis_evicting_policy`: 1 when a Redis node's `maxmemory-policy` can evict
    /// buckets, 0 when every node said `noeviction`; set by each readiness check that reads it.
    pub redis_evicting_policy: Gauge,
    /// `ratelimit_regional_share_suspect_total{rule}`: episodes of a regional rule's share record
    /// not trusted (restored from an older state), during which the region applies at most the
    /// floor.
    pub regional_share_suspect: Family<RuleLabels, Counter>,
    /// `ratelimit_policy_dropped_rules_total{rule}`: rules a policy reload dropped while gateways
    /// had named them recently.
    pub policy_dropped_rules: Family<RuleLabels, Counter>,
    /// `ratelimit_settlements_total{outcome}`: settlements of costs known after the response
    /// ([`SettleOutcome`]).
    pub settlements: Family<OutcomeLabels, Counter>,
    /// `ratelimit_slots_total{rule, outcome}`: concurrency slots by outcome ([`SlotOutcome`]).
    pub slots: Family<SlotLabels, Counter>,
    /// `ratelimit_rlqs_streams`: quota streams (one per Envoy) open now.
    pub rlqs_streams: Gauge,
    /// `ratelimit_rlqs_assignments_total{strategy}`: bucket assignments sent to Envoys, by
    /// strategy (`token_bucket`, `allow_all`, `deny_all`).
    pub rlqs_assignments: Family<StrategyLabels, Counter>,
    /// `ratelimit_rlqs_streams_opened_total`: quota streams accepted (a stream Envoy had to
    /// reopen counts again).
    pub rlqs_streams_opened: Counter,
    /// `ratelimit_rlqs_reports_total{read}`: usage reports (gRPC messages) received, `whole` or
    /// `split` into reports within `--max-body-bytes`.
    pub rlqs_reports: Family<ReadLabels, Counter>,
    /// `ratelimit_rlqs_usages_dropped_total{reason}`: bucket usages that get no assignment:
    /// `too_large`, `max_buckets`, `unreadable` (counted once per report).
    pub rlqs_usages_dropped: Family<ReasonLabels, Counter>,
    /// `ratelimit_rlqs_round_duration_seconds`: from planning a round to its assignments ready
    /// to send (the store's calls included).
    pub rlqs_round_duration: Histogram,
    /// `ratelimit_rlqs_late_rounds_total`: rounds that took longer than
    /// `--rlqs-delivery-margin-ms` and were settled again at their end.
    pub rlqs_late_rounds: Counter,
    limit_log: LimitLog,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let decisions = Family::<DecisionLabels, Counter>::default();
        let calls = Family::<CallLabels, Counter>::default();
        let requests = Family::<OutcomeLabels, Counter>::default();
        let decision_duration = Histogram::new(DURATION_BUCKETS_S);
        let script_call_decisions = Histogram::new(BATCH_BUCKETS);
        let redis_errors = Counter::default();
        let script_loads = Counter::default();
        let compensations = Counter::default();
        let store_resets = Counter::default();
        let unknown_rules = Counter::default();
        let policy_reloads = Family::<ResultLabels, Counter>::default();
        let policy_limits = Gauge::default();
        let lease_tokens = Family::<ResultLabels, Counter>::default();
        let redis_evicting_policy = Gauge::default();
        let regional_share_suspect = Family::<RuleLabels, Counter>::default();
        let policy_dropped_rules = Family::<RuleLabels, Counter>::default();
        let settlements = Family::<OutcomeLabels, Counter>::default();
        let slots = Family::<SlotLabels, Counter>::default();
        let rlqs_streams = Gauge::default();
        let rlqs_assignments = Family::<StrategyLabels, Counter>::default();
        let rlqs_streams_opened = Counter::default();
        let rlqs_reports = Family::<ReadLabels, Counter>::default();
        let rlqs_usages_dropped = Family::<ReasonLabels, Counter>::default();
        let rlqs_round_duration = Histogram::new(RLQS_ROUND_BUCKETS_S);
        let rlqs_late_rounds = Counter::default();
        registry.register(
            "ratelimit_decisions",
            "Decisions answered, by limit name and verdict",
            decisions.clone(),
        );
        registry.register(
            "ratelimit_calls",
            "Calls to the decision APIs, by API and outcome",
            calls.clone(),
        );
        registry.register(
            "ratelimit_requests",
            "Gateway requests decided, by outcome",
            requests.clone(),
        );
        registry.register(
            "ratelimit_decision_duration_seconds",
            "Time to answer a call, Redis included",
            decision_duration.clone(),
        );
        registry.register(
            "ratelimit_script_call_decisions",
            "Decisions per bucket script call",
            script_call_decisions.clone(),
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
            "Cross-node refunds of rejected requests that completed",
            compensations.clone(),
        );
        registry.register(
            "ratelimit_store_resets",
            "Times a Redis node was seen to have lost its state (its epoch marker gone or recreated)",
            store_resets.clone(),
        );
        registry.register(
            "ratelimit_unknown_rule",
            "Decisions naming a rule or domain the policy does not define (a configuration error)",
            unknown_rules.clone(),
        );
        registry.register(
            "ratelimit_policy_reloads",
            "Policy reloads, by result (invalid: the previous policy stayed in force)",
            policy_reloads.clone(),
        );
        registry.register(
            "ratelimit_policy_limits",
            "Limits (defaults and overrides) in the policy in force",
            policy_limits.clone(),
        );
        registry.register(
            "ratelimit_lease_tokens",
            "Tokens granted to gateways as leases",
            lease_tokens.clone(),
        );
        registry.register(
            "ratelimit_redis_evicting_policy",
            "1 when a Redis node's maxmemory-policy can evict buckets (not noeviction), else 0",
            redis_evicting_policy.clone(),
        );
        registry.register(
            "ratelimit_regional_share_suspect",
            "Episodes of a regional share record not trusted (restored from an older state): the \
             region applies at most the rule's floor until the rebalancer writes it again",
            regional_share_suspect.clone(),
        );
        registry.register(
            "ratelimit_policy_dropped_rules",
            "Rules a policy reload dropped while gateways had named them recently",
            policy_dropped_rules.clone(),
        );
        registry.register(
            "ratelimit_rlqs_streams",
            "Quota (RLQS) streams open now, one per Envoy",
            rlqs_streams.clone(),
        );
        registry.register(
            "ratelimit_rlqs_assignments",
            "Quota (RLQS) bucket assignments sent to Envoys, by strategy",
            rlqs_assignments.clone(),
        );
        registry.register(
            "ratelimit_rlqs_streams_opened",
            "Quota (RLQS) streams accepted; a stream an Envoy had to reopen counts again",
            rlqs_streams_opened.clone(),
        );
        registry.register(
            "ratelimit_rlqs_reports",
            "Quota (RLQS) usage reports received, whole or split into reports within \
             --max-body-bytes",
            rlqs_reports.clone(),
        );
        registry.register(
            "ratelimit_rlqs_usages_dropped",
            "Quota (RLQS) bucket usages that get no assignment, by reason (too_large, \
             max_buckets, unreadable: once per report)",
            rlqs_usages_dropped.clone(),
        );
        registry.register(
            "ratelimit_rlqs_round_duration_seconds",
            "Quota (RLQS) rounds: from planning to the assignments ready to send",
            rlqs_round_duration.clone(),
        );
        registry.register(
            "ratelimit_rlqs_late_rounds",
            "Quota (RLQS) rounds longer than --rlqs-delivery-margin-ms, settled again at their end",
            rlqs_late_rounds.clone(),
        );
        registry.register(
            "ratelimit_settlements",
            "Settlements of costs known after the response, by outcome (charged, given_back, \
             repeated, skipped, failed)",
            settlements.clone(),
        );
        for outcome in SettleOutcome::ALL {
            let _ = settlements.get_or_create(&OutcomeLabels {
                outcome: outcome.label(),
            });
        }
        registry.register(
            "ratelimit_slots",
            "Concurrency slots, by limit and outcome (taken, full, renewed, released, \
             expired_or_unknown)",
            slots.clone(),
        );
        for result in ["ok", "invalid"] {
            let _ = policy_reloads.get_or_create(&ResultLabels { result });
        }
        for strategy in ["token_bucket", "allow_all", "deny_all"] {
            let _ = rlqs_assignments.get_or_create(&StrategyLabels { strategy });
        }
        for read in ["whole", "split"] {
            let _ = rlqs_reports.get_or_create(&ReadLabels { read });
        }
        for reason in ["too_large", "max_buckets", "unreadable"] {
            let _ = rlqs_usages_dropped.get_or_create(&ReasonLabels { reason });
        }
        Self {
            registry,
            decisions,
            calls,
            requests,
            decision_duration,
            script_call_decisions,
            redis_errors,
            script_loads,
            compensations,
            store_resets,
            unknown_rules,
            policy_reloads,
            policy_limits,
            lease_tokens,
            redis_evicting_policy,
            regional_share_suspect,
            policy_dropped_rules,
            settlements,
            slots,
            rlqs_streams,
            rlqs_assignments,
            rlqs_streams_opened,
            rlqs_reports,
            rlqs_usages_dropped,
            rlqs_round_duration,
            rlqs_late_rounds,
            limit_log: LimitLog::default(),
        }
    }

    /// Counts `n` decisions of one limit with one verdict (a call's decisions, tallied: one
    /// label lookup instead of one per decision). A refusal (rejected, shadow-rejected, blocked)
    /// may also write the "limit reached" line.
    pub fn decisions_of(&self, limit: &str, verdict: CountedAs, n: u64) {
        if n == 0 {
            return;
        }
        self.decisions
            .get_or_create(&DecisionLabels {
                limit: limit.to_string(),
                verdict: verdict.label(),
            })
            .inc_by(n);
        if matches!(
            verdict,
            CountedAs::Rejected | CountedAs::ShadowRejected | CountedAs::Blocked
        ) {
            if let Some(refusals) = self.limit_log.refused(limit, Instant::now(), n) {
                tracing::info!(
                    limit,
                    verdict = verdict.label(),
                    refusals,
                    "limit reached ({refusals} refusals since the last line for this limit)"
                );
            }
        }
    }

    /// Counts one call.
    /// Counts `n` slots of one limit with one outcome.
    pub fn slots_of(&self, rule: &str, outcome: SlotOutcome, n: u64) {
        if n > 0 {
            self.slots
                .get_or_create(&SlotLabels {
                    rule: rule.to_string(),
                    outcome: outcome.label(),
                })
                .inc_by(n);
        }
    }

    /// Counts `n` quota usage reports read `read` (`whole` or `split`).
    pub fn count_rlqs_reports(&self, read: &'static str, n: u64) {
        if n > 0 {
            self.rlqs_reports
                .get_or_create(&ReadLabels { read })
                .inc_by(n);
        }
    }

    /// Counts `n` quota bucket usages dropped for `reason`.
    pub fn count_rlqs_usages_dropped(&self, reason: &'static str, n: u64) {
        if n > 0 {
            self.rlqs_usages_dropped
                .get_or_create(&ReasonLabels { reason })
                .inc_by(n);
        }
    }

    /// Counts `n` settlements of one outcome.
    pub fn settled(&self, outcome: SettleOutcome, n: u64) {
        if n > 0 {
            self.settlements
                .get_or_create(&OutcomeLabels {
                    outcome: outcome.label(),
                })
                .inc_by(n);
        }
    }

    pub fn call(&self, api: &'static str, outcome: CallOutcome) {
        self.calls
            .get_or_create(&CallLabels {
                api,
                outcome: outcome.label(),
            })
            .inc();
    }

    /// Counts one gateway request by outcome.
    pub fn request(&self, outcome: RequestOutcome) {
        self.requests_of(outcome, 1);
    }

    /// Counts `n` gateway requests of one outcome (a call's requests, counted once per outcome:
    /// each count looks its label up).
    pub fn requests_of(&self, outcome: RequestOutcome, n: u64) {
        if n > 0 {
            self.requests
                .get_or_create(&OutcomeLabels {
                    outcome: outcome.label(),
                })
                .inc_by(n);
        }
    }

    pub fn unknown_rule(&self) {
        self.unknown_rules.inc();
    }

    pub fn lease_granted(&self, tokens: u64) {
        if tokens == 0 {
            return;
        }
        self.lease_tokens
            .get_or_create(&ResultLabels { result: "granted" })
            .inc_by(tokens);
    }

    /// A policy was loaded (at start or by a reload).
    pub fn policy_loaded(&self, limits: usize) {
        self.policy_reloads
            .get_or_create(&ResultLabels { result: "ok" })
            .inc();
        self.policy_limits.set(limits as i64);
    }

    /// A reload was refused (invalid files); the old policy stays.
    pub fn policy_refused(&self) {
        self.policy_reloads
            .get_or_create(&ResultLabels { result: "invalid" })
            .inc();
    }

    /// A regional rule's share record is not trusted (an episode begins).
    pub fn regional_share_suspect(&self, rule: String) {
        self.regional_share_suspect
            .get_or_create(&RuleLabels { rule })
            .inc();
    }

    /// A reload dropped a rule gateways had named recently.
    pub fn policy_dropped_rule(&self, rule: String) {
        self.policy_dropped_rules
            .get_or_create(&RuleLabels { rule })
            .inc();
    }

    /// What a readiness check read of Redis's `maxmemory-policy`: whether some node can evict.
    pub fn eviction_policy(&self, evicting: bool) {
        self.redis_evicting_policy.set(i64::from(evicting));
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
    fn a_limit_is_logged_once_per_interval_with_the_refusals_it_stands_for() {
        let log = LimitLog::default();
        let t0 = Instant::now();
        assert_eq!(
            log.refused("per-app", t0, 1),
            Some(1),
            "the first refusal is logged"
        );
        assert_eq!(log.refused("per-app", t0 + Duration::from_secs(1), 1), None);
        assert_eq!(
            log.refused("per-ip", t0 + Duration::from_secs(1), 1),
            Some(1),
            "per limit"
        );
        assert_eq!(log.refused("per-app", t0 + Duration::from_secs(9), 1), None);
        assert_eq!(
            log.refused("per-app", t0 + LIMIT_LOG_INTERVAL, 1),
            Some(3),
            "the two held back and this one"
        );
        assert_eq!(log.refused("per-app", t0 + LIMIT_LOG_INTERVAL, 1), None);
        assert_eq!(
            log.refused(
                "per-ip",
                t0 + Duration::from_secs(1) + LIMIT_LOG_INTERVAL,
                5
            ),
            Some(5),
            "a tally of refusals counts as each of them"
        );
    }

    #[test]
    fn request_outcomes_index_their_list() {
        for (i, o) in RequestOutcome::ALL.into_iter().enumerate() {
            assert_eq!(o as usize, i, "{o:?}");
        }
    }

    #[test]
    fn names_are_the_documented_ones() {
        let m = Metrics::new();
        m.decisions_of("per-app", CountedAs::Allowed, 1);
        m.call("http", CallOutcome::BadRequest);
        m.request(RequestOutcome::UnknownRule);
        let text = m.encode();
        for name in [
            "ratelimit_decisions_total{limit=\"per-app\",verdict=\"allowed\"} 1",
            "ratelimit_calls_total{api=\"http\",outcome=\"bad_request\"} 1",
            "ratelimit_requests_total{outcome=\"unknown_rule\"} 1",
            "ratelimit_decision_duration_seconds_bucket{le=\"0.0001\"}",
            "ratelimit_script_call_decisions_bucket{le=\"1.0\"}",
            "ratelimit_redis_errors_total",
            "ratelimit_script_loads_total",
            "ratelimit_compensations_total",
            "ratelimit_store_resets_total",
            "ratelimit_unknown_rule_total",
            "ratelimit_policy_reloads_total{result=\"invalid\"} 0",
            "ratelimit_policy_limits",
            "ratelimit_redis_evicting_policy 0",
            "ratelimit_settlements_total{outcome=\"given_back\"} 0",
            "ratelimit_rlqs_streams 0",
            "ratelimit_rlqs_assignments_total{strategy=\"deny_all\"} 0",
            "ratelimit_rlqs_streams_opened_total 0",
            "ratelimit_rlqs_reports_total{read=\"split\"} 0",
            "ratelimit_rlqs_usages_dropped_total{reason=\"too_large\"} 0",
            "ratelimit_rlqs_round_duration_seconds_bucket{le=\"0.5\"} 0",
            "ratelimit_rlqs_late_rounds_total 0",
        ] {
            assert!(text.contains(name), "{name} missing in\n{text}");
        }
    }
}
