//! `ratelimit-regions-sim`: runs every scenario of `ratelimit_regions::sim` with static and with
//! rebalanced shares and prints one table (`make simulate`).

use std::process::ExitCode;

use clap::Parser;
use ratelimit_regions::sim::{run, scenarios, Follow, Mode, Report, SimConfig};
use ratelimit_regions::{Params, Share};

/// Simulates regional shares of one global budget (1000 tokens, 100 per second) over
/// steady, shifting, rotating demand, a region cut off from the rebalancer, and failed steps.
#[derive(Debug, Parser)]
#[command(name = "ratelimit-regions-sim", version, about)]
struct Args {
    /// Seed of the demand and of the sidecars' read phases (same seed, same table).
    #[arg(long, default_value_t = 1)]
    seed: u64,

    /// Simulated time per scenario, in seconds.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(30..=86_400))]
    duration_s: u64,

    /// Run only the scenarios whose name contains this (repeatable).
    #[arg(long)]
    scenario: Vec<String>,

    /// The lease L of a sidecar's share, in milliseconds.
    #[arg(long, default_value_t = Params::default().lease_ms)]
    lease_ms: u64,

    /// Time between rebalancing rounds, in milliseconds.
    #[arg(long, default_value_t = Params::default().round_interval_ms)]
    round_interval_ms: u64,

    /// Fraction of a donor's excess one round may take.
    #[arg(long, default_value_t = Params::default().step_fraction)]
    step_fraction: f64,
}

fn follow(report: &Report) -> String {
    match report.follow {
        Follow::Within(ms) => format!("{:.1} s", ms as f64 / 1000.0),
        Follow::Never => "never".to_owned(),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let params = Params {
        lease_ms: args.lease_ms,
        round_interval_ms: args.round_interval_ms,
        step_fraction: args.step_fraction,
        ..Params::default()
    };
    if let Err(problem) = params.validate() {
        eprintln!("ratelimit-regions-sim: invalid parameters: {problem} (flags --lease-ms, --round-interval-ms, --step-fraction)");
        return ExitCode::from(2);
    }
    let config = SimConfig {
        seed: args.seed,
        duration_ms: args.duration_s * 1000,
        params,
        ..SimConfig::default()
    };
    let chosen: Vec<_> = scenarios(config.duration_ms)
        .into_iter()
        .filter(|s| {
            args.scenario.is_empty() || args.scenario.iter().any(|w| s.name.contains(w.as_str()))
        })
        .collect();
    if chosen.is_empty() {
        eprintln!("ratelimit-regions-sim: --scenario matches no scenario");
        return ExitCode::from(2);
    }
    println!(
        "budget C={} R={}/s, floor {}, lease {} ms (+{} ms margin), rounds every {} ms, step {}, {} sidecars per region, {} s per scenario, seed {}",
        config.budget.capacity,
        config.budget.refill_per_sec,
        config.floor,
        params.lease_ms,
        params.fence_margin_ms,
        params.round_interval_ms,
        params.step_fraction,
        config.sidecars_per_region,
        args.duration_s,
        args.seed
    );
    println!();
    println!(
        "{:<13} {:<10} {:>8} {:>8} {:>8} {:>5} {:>7} {:>7} {:>8} {:>7} {:>6} {:>9}",
        "scenario",
        "shares",
        "offered",
        "ideal",
        "admitted",
        "over",
        "under",
        "under%",
        "follow",
        "writes",
        "failed",
        "max sum"
    );
    let mut over = 0;
    let mut above_one = false;
    for scenario in &chosen {
        for mode in [Mode::Static, Mode::Rebalanced] {
            let r = match run(scenario, mode, &config) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("ratelimit-regions-sim: {e}");
                    return ExitCode::from(2);
                }
            };
            over += r.over_admitted;
            above_one |= r.max_share_sum_ppm > u64::from(Share::PPM);
            println!(
                "{:<13} {:<10} {:>8} {:>8} {:>8} {:>5} {:>7} {:>6.2}% {:>8} {:>7} {:>6} {:>9.6}",
                r.scenario,
                mode.name(),
                r.offered,
                r.ideal,
                r.admitted,
                r.over_admitted,
                r.under_admitted(),
                r.under_admitted_pct(),
                follow(&r),
                r.writes,
                r.failed_writes,
                r.max_share_sum_ppm as f64 / f64::from(Share::PPM),
            );
        }
    }
    println!();
    println!("over: admitted requests the exact global bucket (C, R) rejects; under: ideal - admitted, the ideal being one global bucket fed with all demand;");
    println!("follow: after each shift of demand, the slowest time until the busy region's applied share is within 10% of its demand-proportional target;");
    println!("writes/failed: share writes the rebalancer sent / refused or unanswered; max sum: the largest sum of applied shares at any simulated millisecond.");
    if over > 0 || above_one {
        eprintln!("ratelimit-regions-sim: the global bound was broken");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
