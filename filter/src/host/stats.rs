//! The filter's stats in Envoy: their definitions (`<stat_prefix>.<name>`, once per VM; what each
//! counts: docs/observability.md), the request flow's [`Stats`] sink, and counter increments held
//! back while a callout's answers are settled ([`counting`]).

use std::cell::RefCell;

use proxy_wasm::types::MetricType;

use super::abi;
use crate::clock;
use crate::config::Config;
use crate::flow::{Histogram, Stat, Stats};

/// The counters of one rule.
#[derive(Debug, Clone, Copy)]
struct RuleStats {
    admitted: u32,
    rejected: u32,
    shadow_rejected: u32,
}

/// The filter's stats (their ids), defined once per VM.
#[derive(Debug, Clone)]
pub struct Metrics {
    admitted: u32,
    rejected: u32,
    limiter_error: u32,
    config_error: u32,
    failed_open: u32,
    failed_closed: u32,
    emergency_activations: u32,
    emergency_rejected: u32,
    subject_unknown: u32,
    unknown_rejected: u32,
    repeated_identity: u32,
    known_rejections: u32,
    lease_admitted: u32,
    callouts: u32,
    costs_settled: u32,
    costs_unreported: u32,
    settlements_retried: u32,
    settlements_lost: u32,
    slots_renewed: u32,
    slots_released: u32,
    slots_expired: u32,
    slots_retried: u32,
    slots_lost: u32,
    decision_us: u32,
    batch_requests: u32,
    /// Gauge: 1 when the VM's clock is the host's monotonic clock, 0 on the wall-clock fallback.
    monotonic_clock: u32,
    rules: Vec<RuleStats>,
}

impl Metrics {
    pub fn define(config: &Config) -> Result<Metrics, u32> {
        let prefix = &config.stat_prefix;
        let counter =
            |name: &str| abi::define_metric(MetricType::Counter, &format!("{prefix}.{name}"));
        let histogram =
            |name: &str| abi::define_metric(MetricType::Histogram, &format!("{prefix}.{name}"));
        let mut rules = Vec::with_capacity(config.rules.len());
        for r in &config.rules {
            rules.push(RuleStats {
                admitted: counter(&format!("rule.{}.admitted", r.name))?,
                rejected: counter(&format!("rule.{}.rejected", r.name))?,
                shadow_rejected: counter(&format!("rule.{}.shadow_rejected", r.name))?,
            });
        }
        Ok(Metrics {
            admitted: counter("admitted")?,
            rejected: counter("rejected")?,
            limiter_error: counter("limiter_error")?,
            config_error: counter("config_error")?,
            failed_open: counter("failed_open")?,
            failed_closed: counter("failed_closed")?,
            emergency_activations: counter("emergency_activations")?,
            emergency_rejected: counter("emergency_rejected")?,
            subject_unknown: counter("subject_unknown")?,
            unknown_rejected: counter("unknown_rejected")?,
            repeated_identity: counter("repeated_identity")?,
            known_rejections: counter("known_rejections")?,
            lease_admitted: counter("lease_admitted")?,
            callouts: counter("callouts")?,
            costs_settled: counter("costs_settled")?,
            costs_unreported: counter("costs_unreported")?,
            settlements_retried: counter("settlements_retried")?,
            settlements_lost: counter("settlements_lost")?,
            slots_renewed: counter("slots_renewed")?,
            slots_released: counter("slots_released")?,
            slots_expired: counter("slots_expired")?,
            slots_retried: counter("slots_retried")?,
            slots_lost: counter("slots_lost")?,
            decision_us: histogram("decision_us")?,
            batch_requests: histogram("batch_requests")?,
            monotonic_clock: abi::define_metric(
                MetricType::Gauge,
                &format!("{prefix}.monotonic_clock"),
            )?,
            rules,
        })
    }
}

impl Metrics {
    /// The counter of `stat` (`None`: a rule this configuration does not have).
    fn counter(&self, stat: Stat) -> Option<u32> {
        let rule = |i: usize| self.rules.get(i);
        Some(match stat {
            Stat::Admitted => self.admitted,
            Stat::Rejected => self.rejected,
            Stat::LimiterError => self.limiter_error,
            Stat::ConfigError => self.config_error,
            Stat::FailedOpen => self.failed_open,
            Stat::FailedClosed => self.failed_closed,
            Stat::EmergencyActivations => self.emergency_activations,
            Stat::EmergencyRejected => self.emergency_rejected,
            Stat::SubjectUnknown => self.subject_unknown,
            Stat::UnknownRejected => self.unknown_rejected,
            Stat::RepeatedIdentity => self.repeated_identity,
            Stat::KnownRejections => self.known_rejections,
            Stat::LeaseAdmitted => self.lease_admitted,
            Stat::Callouts => self.callouts,
            Stat::CostsSettled => self.costs_settled,
            Stat::CostsUnreported => self.costs_unreported,
            Stat::SettlementsRetried => self.settlements_retried,
            Stat::SettlementsLost => self.settlements_lost,
            Stat::SlotsRenewed => self.slots_renewed,
            Stat::SlotsReleased => self.slots_released,
            Stat::SlotsExpired => self.slots_expired,
            Stat::SlotsRetried => self.slots_retried,
            Stat::SlotsLost => self.slots_lost,
            Stat::RuleAdmitted(i) => rule(i)?.admitted,
            Stat::RuleRejected(i) => rule(i)?.rejected,
            Stat::RuleShadowRejected(i) => rule(i)?.shadow_rejected,
        })
    }

    /// Sets the `monotonic_clock` gauge from the clock this VM reads.
    pub fn clock(&self, kind: clock::Kind) {
        let _ = abi::record_metric(
            self.monotonic_clock,
            u64::from(kind == clock::Kind::Monotonic),
        );
    }
}

impl Stats for Metrics {
    fn add(&self, stat: Stat, n: u64) {
        if let Some(metric) = self.counter(stat) {
            add(metric, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    fn record(&self, histogram: Histogram, value: u64) {
        let id = match histogram {
            Histogram::BatchRequests => self.batch_requests,
            Histogram::DecisionUs => self.decision_us,
        };
        let _ = abi::record_metric(id, value);
    }
}

thread_local! {
    /// Counter increments held back while a callout's answers are settled ([`counting`]): one
    /// host call per counter and callout instead of several per request.
    static HELD: RefCell<Option<Vec<(u32, i64)>>> = const { RefCell::new(None) };
}

/// Adds `n` to a counter, now or (inside [`counting`]) when the batch is settled.
fn add(metric: u32, n: i64) {
    let held = HELD.with(|h| match h.borrow_mut().as_mut() {
        Some(held) => {
            match held.iter_mut().find(|(m, _)| *m == metric) {
                Some((_, sum)) => *sum += n,
                None => held.push((metric, n)),
            }
            true
        }
        None => false,
    });
    if !held {
        let _ = abi::increment_metric(metric, n);
    }
}

/// Runs `f` with the counters it increments held back, then adds each counter's sum at once
/// (to an enclosing `counting`, if any).
pub fn counting<T>(f: impl FnOnce() -> T) -> T {
    let outer = HELD.with(|h| h.borrow_mut().replace(Vec::new()));
    let out = f();
    let held = HELD.with(|h| std::mem::replace(&mut *h.borrow_mut(), outer));
    for (metric, n) in held.unwrap_or_default() {
        add(metric, n);
    }
    out
}
