//! The filter's stats in Envoy: their definitions (`<stat_prefix>.<name>`, once per VM), and
//! counter increments held back while a callout's answers are settled ([`counting`]).

use std::cell::RefCell;

use proxy_wasm::types::MetricType;

use super::abi;
use crate::config::Config;

/// The counters of one rule.
#[derive(Debug, Clone, Copy)]
pub struct RuleStats {
    pub admitted: u32,
    pub rejected: u32,
    pub shadow_rejected: u32,
}

/// The filter's stats, defined once per VM.
#[derive(Debug, Clone)]
pub struct Metrics {
    pub admitted: u32,
    pub rejected: u32,
    pub limiter_error: u32,
    pub config_error: u32,
    pub failed_open: u32,
    pub failed_closed: u32,
    pub emergency_activations: u32,
    pub emergency_rejected: u32,
    pub subject_unknown: u32,
    pub unknown_rejected: u32,
    pub repeated_identity: u32,
    pub known_rejections: u32,
    pub lease_admitted: u32,
    pub callouts: u32,
    pub forwarded: u32,
    pub decision_us: u32,
    pub batch_requests: u32,
    pub rules: Vec<RuleStats>,
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
            forwarded: counter("forwarded")?,
            decision_us: histogram("decision_us")?,
            batch_requests: histogram("batch_requests")?,
            rules,
        })
    }
}

thread_local! {
    /// Counter increments held back while a callout's answers are settled ([`counting`]): one
    /// host call per counter and callout instead of several per request.
    static HELD: RefCell<Option<Vec<(u32, i64)>>> = const { RefCell::new(None) };
}

pub fn count(metric: u32) {
    add(metric, 1);
}

/// Adds `n` to a counter, now or (inside [`counting`]) when the batch is settled.
pub fn add(metric: u32, n: i64) {
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
