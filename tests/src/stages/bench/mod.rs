//! `make bench`'s stages, as library code the binary runs (`tests/src/bin/bench.rs`): the
//! components alone, Envoy with each filter, and the figures printed as ratios against baselines
//! measured in the same run.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::load::{self, figures, Callers, ClosedLoop, Load, Measured, Op, Warmup};
use crate::plugin::{max_lease_tokens, rule, Plugin};
use crate::probe::{self, Watched};
use crate::report::{median, Table};
use crate::script_cost;
use crate::{Envoy, EnvoyConfig, Redis, Sidecar, Upstream};
use clap::Parser;
use serde_json::json;

mod compare;
mod components;
mod envoy;
mod goals;
mod stage;

pub(crate) use self::compare::*;
pub use self::components::*;
pub(crate) use self::envoy::*;
pub(crate) use self::goals::*;
pub(crate) use self::stage::*;

#[derive(Parser, Clone)]
#[command(about = "Measures the cost of a rate-limit decision against baselines in the same run")]
pub struct Args {
    /// Seconds each stage runs (each round).
    #[arg(long, default_value_t = 4)]
    pub seconds: u64,
    /// Milliseconds of warm-up before each stage is measured.
    #[arg(long, default_value_t = 500)]
    pub warmup_ms: u64,
    /// Concurrent callers in each stage.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Concurrent callers of the many-keys stages run again under load (a busy gateway: more
    /// requests wait while a callout is out, so batches grow); 0 skips them.
    #[arg(long, default_value_t = 256)]
    pub loaded_concurrency: usize,
    /// Distinct clients of the many-keys workload.
    #[arg(long, default_value_t = 10_000)]
    pub keys: usize,
    /// Envoy worker counts to measure, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub workers: Vec<u32>,
    /// Decisions per call in the batched component stages.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Only the component stages (Redis, script, sidecar), no Envoy.
    #[arg(long)]
    pub components_only: bool,
    /// A/B two builds of the filter instead of the full run: alternates one workload's stage
    /// (`--ab-workload`, many keys by default) of the shipped configuration between the current
    /// build and this `.wasm` (plus the no-op filter), `--ab-workers` Envoy workers, `--rounds`
    /// times, and prints Envoy's CPU per request above the no-op filter for each build. Runs
    /// that differ by less than their spread are a tie.
    #[arg(long, value_name = "WASM")]
    pub ab_filter: Option<std::path::PathBuf>,
    /// Rounds: every Envoy stage is measured this many times, the stages taking turns, and the
    /// goals are judged on each stage's medians (a single stage on a shared machine moves by
    /// 10% or more); `--ab-filter` alternates its builds this many times.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// The workload of `--ab-filter` and `--ab-sidecar-arg`.
    #[arg(long, value_enum, default_value = "many-keys")]
    pub ab_workload: Workload,
    /// Envoy workers in `--ab-filter` and `--ab-sidecar-arg`.
    #[arg(long, default_value_t = 1)]
    pub ab_workers: u32,
    /// With `--ab-filter`: B's sidecar cluster speaks HTTP/1.1 instead of the shipped HTTP/2, as
    /// shipped before the stream per worker: for B a build from before it (whose callouts went
    /// over HTTP/1.1).
    #[arg(long)]
    pub ab_b_http1: bool,
    /// Only the RLQS comparison: per worker count, Envoy alone, local_ratelimit, the wasm filter
    /// as shipped and Envoy's quota filter (RLQS), on the hot key and many keys.
    #[arg(long)]
    pub rlqs_only: bool,
    /// A/B two sidecars behind Envoy's native rate limit filter instead of the full run: A the
    /// bench's sidecar, B one more on the same Redis with these extra arguments (repeatable, e.g.
    /// `--ab-sidecar-arg=--grpc-charged-metadata=false`); one workload's stage (`--ab-workload`),
    /// `--ab-workers` workers, `--rounds` times, after Envoy without a filter each round; prints
    /// Envoy's CPU per request above Envoy alone for each.
    #[arg(long, allow_hyphen_values = true, value_name = "ARG")]
    pub ab_sidecar_arg: Vec<String>,
    /// An extra argument for the sidecar (repeatable), e.g. `--sidecar-arg=--redis-pipeline=1`
    /// to measure a setting against the default in another run.
    #[arg(long, allow_hyphen_values = true)]
    pub sidecar_arg: Vec<String>,
}

/// Runs the bench `args` asks for, printing as it goes.
pub fn run(args: Args) {
    let bench = Bench::start(args);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        if let Some(other) = &bench.args.ab_filter {
            return ab_filter(&bench, other).await;
        }
        if !bench.args.ab_sidecar_arg.is_empty() {
            return ab_sidecar(&bench).await;
        }
        if bench.args.rlqs_only {
            for &workers in &bench.args.workers {
                rlqs_comparison(&bench, workers).await;
            }
            return;
        }
        let components = components(&bench, SCRIPT).await;
        let memory = bucket_memory(&bench).await;
        let mut runs = Vec::new();
        if !bench.args.components_only {
            for &workers in &bench.args.workers {
                runs.push(envoy_stages(&bench, workers).await);
            }
        }
        print_summary(&bench, &components, &memory);
        print_goals(&bench, &components, &runs);
    });
}

/// The bucket script, as the sidecar embeds it.
pub(crate) const SCRIPT: &str = script_cost::APPLY;

/// The longest one operation may take: one that hangs (a lost response) is an error, and the
/// stage still ends on time.
pub(crate) const OP_TIMEOUT: Duration = Duration::from_secs(10);

/// The bench's policy: huge budgets for the admitted workloads, an exhausted one for the flood,
/// the hot key at its limit ([`EDGE_CAPACITY`]), and buckets to weigh ([`bucket_memory`]).
pub(crate) const POLICY: &str = "rules:
  many: {capacity: 999999999999, refill_per_sec: 1000000000}
  hot: {capacity: 999999999999, refill_per_sec: 1000000000}
  flood: {capacity: 1, refill_per_sec: 0.000001}
  edge: {capacity: 2000, refill_per_sec: 2000}
  keys: {capacity: 999999999999, refill_per_sec: 1000000000}
  settled: {capacity: 999999999999, refill_per_sec: 1000000000}
  mem: {capacity: 100, refill_per_sec: 1}
";

/// The `edge` rule of [`POLICY`]: the hot key at its limit.
pub(crate) const EDGE_CAPACITY: f64 = 2000.0;

pub(crate) const EDGE_REFILL: f64 = 2000.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(crate) fn a_call_splits_into_what_it_costs_and_what_each_decision_adds() {
        // 80 µs for a call of one decision, 9 µs per decision with 11 per call (99 µs a call):
        // 1.9 µs per further decision, 78.1 fixed; 6 µs per decision at 20 per call.
        let s = PerCall::split(80.0, 9.0, 11).unwrap();
        assert!((s.marginal - 1.9).abs() < 1e-9 && (s.fixed - 78.1).abs() < 1e-9);
        assert_eq!(s.decisions_for(6.0), Some(20.0));
        assert_eq!(s.decisions_for(1.5), None);
        assert_eq!(PerCall::split(80.0, 9.0, 1), None);
    }

    #[test]
    pub(crate) fn envoys_added_cpu_splits_into_a_part_per_request_and_one_per_callout() {
        // 90 µs with a callout per request, 27 at 0.1: 70 per callout, 20 per request, so
        // 15 µs is out of reach by fewer callouts.
        let s = EnvoySplit::split(90.0, 27.0, 0.1).unwrap();
        assert!((s.per_callout - 70.0).abs() < 1e-9 && (s.per_request - 20.0).abs() < 1e-9);
        assert_eq!(s.callouts_for(15.0), None);
        // 5 per request: 15 µs at 1 callout per 7 requests.
        let s = EnvoySplit::split(75.0, 12.0, 0.1).unwrap();
        assert!((s.per_request - 5.0).abs() < 1e-9);
        assert!((s.callouts_for(15.0).unwrap() - 1.0 / 7.0).abs() < 1e-9);
        assert!(s
            .describe(75.0, 12.0, 0.1)
            .contains("7 requests per callout"));
        assert_eq!(EnvoySplit::split(90.0, 27.0, 1.0), None);
    }

    /// A stage of `ops` operations in one second, with this CPU per operation by process.
    pub(crate) fn stage(ops: u64, cpu: &[(&str, f64)]) -> StageResult {
        StageResult {
            name: String::new(),
            ops,
            per_op: 1,
            seconds: 1.0,
            p50: Duration::ZERO,
            p99: Duration::ZERO,
            cpu_us_per_op: cpu.iter().map(|(n, v)| (n.to_string(), *v)).collect(),
        }
    }

    /// A run where the hot key reaches `hot` requests/s against a no-op filter at 1000, many keys
    /// costs Envoy `many_envoy` µs (the no-op filter 50, the per-request callout 90).
    pub(crate) fn run(hot: u64, many_envoy: f64, loaded: bool) -> EnvoyRun {
        let envoy = |v| [("envoy", v), ("redis", 4.0), ("sidecar", 9.0)];
        let wasm = vec![
            (
                Workload::ManyKeys,
                stage(300, &envoy(90.0)),
                stage(500, &envoy(many_envoy)),
                0.1,
            ),
            (
                Workload::HotKey,
                stage(300, &envoy(90.0)),
                stage(hot, &envoy(60.0)),
                0.0,
            ),
            (
                Workload::Flood,
                stage(300, &envoy(90.0)),
                stage(1500, &envoy(40.0)),
                0.0,
            ),
        ];
        let native = [Workload::ManyKeys, Workload::HotKey, Workload::Flood]
            .into_iter()
            .map(|w| (w, stage(400, &envoy(150.0))))
            .collect();
        EnvoyRun {
            workers: 1,
            baseline: stage(1000, &envoy(45.0)),
            noop: stage(1000, &envoy(50.0)),
            local: stage(1000, &envoy(48.0)),
            wasm,
            native,
            rlqs: Vec::new(),
            extra: Vec::new(),
            loaded: loaded.then(|| Loaded {
                concurrency: 256,
                baseline: stage(1000, &envoy(45.0)),
                noop: stage(1000, &envoy(50.0)),
                slow: stage(300, &envoy(90.0)),
                fast: stage(800, &envoy(55.0)),
                callouts: 0.03,
            }),
        }
    }

    pub(crate) fn verdict(judged: &[Judged], key: &str) -> bool {
        judged.iter().find(|j| j.key == key).expect(key).ok
    }

    #[test]
    pub(crate) fn goals_are_judged_at_their_thresholds() {
        let js = judge(&run(850, 60.0, false), 12.0);
        assert!(verdict(&js, "hot"), "0.85x is met");
        assert!(!verdict(&judge(&run(849, 60.0, false), 12.0), "hot"));
        assert!(verdict(&js, "flood"));
        assert!(verdict(&js, "many"), "0.5x is met");
        // Envoy added 10 µs against 40 for the per-request callout: 0.25, met; 11 is not.
        assert!(verdict(&js, "envoy"));
        assert!(!verdict(&judge(&run(850, 61.0, false), 12.0), "envoy"));
        // Redis 4 µs against 12 for the 1-decision script: a third, met; 11.9 is not.
        assert!(verdict(&js, "redis"));
        assert!(!verdict(&judge(&run(850, 60.0, false), 11.9), "redis"));
        assert!(verdict(&js, "sidecar"));
        // The gateway's goals: Envoy 10 µs above the no-op filter (<= 15), the sidecar 9 µs per
        // decision (> 6), Redis 4 (<= 5); the throughput goal only with two workers.
        assert!(verdict(&js, "gateway envoy"));
        assert!(!verdict(
            &judge(&run(850, 66.0, false), 12.0),
            "gateway envoy"
        ));
        assert!(!verdict(&js, "gateway sidecar"));
        assert!(verdict(&js, "gateway redis"));
        assert!(js.iter().all(|j| j.key != "gateway many"));
        let mut two = run(850, 60.0, false);
        two.workers = 2;
        assert!(
            !verdict(&judge(&two, 12.0), "gateway many"),
            "0.5x is not 0.8x"
        );
        assert!(verdict(&js, "native hot key"));
        assert!(
            js.iter().all(|j| j.key != "native many keys"),
            "no goal for many keys"
        );
        assert!(
            js.iter().all(|j| !j.key.starts_with("loaded")),
            "no loaded stages, no goals"
        );
    }

    #[test]
    pub(crate) fn the_hot_key_at_its_limit_is_held_to_its_exact_bound() {
        let edge = |admitted| AtLimit {
            admitted,
            rejected: 0,
            errors: 0,
            seconds: 4.0,
            callouts: 0.0,
        };
        // 2000 + 2000/s over 4 s: 10,000 tokens at most.
        assert_eq!(edge(9_990).exact_bound(), 10_000.0);
        assert_eq!((edge(9_990).over(), edge(9_990).under()), (0.0, 10.0));
        assert_eq!((edge(10_003).over(), edge(10_003).under()), (3.0, 0.0));
        // Two leases of min(1000, 10% of 2000) tokens.
        assert_eq!(AtLimit::lease_bound(), 400.0);
    }

    #[test]
    pub(crate) fn the_loaded_stages_are_judged_when_measured() {
        let js = judge(&run(850, 60.0, true), 12.0);
        for key in [
            "loaded many",
            "loaded envoy",
            "loaded redis",
            "loaded sidecar",
        ] {
            assert!(verdict(&js, key), "{key}");
        }
    }
}
