//! The filter's stats in Envoy: their definitions (`<stat_prefix>.<name>`, once per VM; what each
//! counts: docs/observability.md) and the request flow's [`Stats`] sink (a root event's counters
//! reach it summed, through [`crate::flow::Tally`]).

use proxy_wasm::types::MetricType;

use super::abi;
use crate::clock;
use crate::config::Config;
use crate::flow::{Histogram, Stat, Stats};

/// The filter's stats (their ids), defined once per VM.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// The counters, in the order of [`Stat::names`].
    counters: Vec<u32>,
    rules: usize,
    decision_us: u32,
    batch_requests: u32,
    /// Gauge: 1 when the VM's clock is the host's monotonic clock, 0 on the wall-clock fallback.
    monotonic_clock: u32,
}

impl Metrics {
    pub fn define(config: &Config) -> Result<Metrics, u32> {
        let define =
            |kind, name: &str| abi::define_metric(kind, &format!("{}.{name}", config.stat_prefix));
        let counters = Stat::names(config)
            .iter()
            .map(|name| define(MetricType::Counter, name))
            .collect::<Result<_, _>>()?;
        Ok(Metrics {
            counters,
            rules: config.rules.len(),
            decision_us: define(MetricType::Histogram, "decision_us")?,
            batch_requests: define(MetricType::Histogram, "batch_requests")?,
            monotonic_clock: define(MetricType::Gauge, "monotonic_clock")?,
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
        if let Some(&metric) = stat.index(self.rules).and_then(|i| self.counters.get(i)) {
            let _ = abi::increment_metric(metric, i64::try_from(n).unwrap_or(i64::MAX));
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
