//! `make chaos`: exactness checked by exploration (docs/failure-behaviour.md, "Measured under
//! generated faults"). Each seed draws a workload and a schedule of faults and reloads over real
//! processes ([`ratelimit_e2e::chaos`]); the checker holds what the upstream received against
//! the bucket model and the README's allowances. Prints every run's seed and table, then the
//! table of all runs; a violation is shrunk to the fewest faults that still show it, and the
//! command fails.
//!
//! `CHAOS_ARGS="--seed 7"` replays one seed; `--minutes 120` runs seeds one after the other from
//! `--first` until the time is up; `--plans` prints the seeds' plans without running them.

use std::time::{Duration, Instant};

use clap::Parser;
use ratelimit_e2e::chaos::run::{accumulate, run, table, under_by_bucket, Outcome};
use ratelimit_e2e::chaos::schedule::Plan;
use ratelimit_e2e::chaos::shrink::shrink;

#[derive(Parser)]
#[command(about = "Generated workloads and faults, checked against the bucket model")]
struct Args {
    /// One seed to run (and shrink, if it violates).
    #[arg(long)]
    seed: Option<u64>,
    /// The first seed of a series.
    #[arg(long, default_value_t = 1)]
    first: u64,
    /// How many seeds of the series to run (unless --minutes ends it first).
    #[arg(long, default_value_t = 3)]
    seeds: u64,
    /// Run seeds until this many minutes have passed (a run under way finishes).
    #[arg(long)]
    minutes: Option<u64>,
    /// Seconds each run lasts.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Report a violation without shrinking its schedule.
    #[arg(long)]
    no_shrink: bool,
    /// Go on with the next seed after a violation.
    #[arg(long)]
    keep_going: bool,
    /// Print the plans of the seeds and exit, running nothing.
    #[arg(long)]
    plans: bool,
}

fn main() {
    let args = Args::parse();
    remove_namespaces_on_signal();
    let began = Instant::now();
    let deadline = args.minutes.map(|m| began + Duration::from_secs(m * 60));
    let seeds: Box<dyn Iterator<Item = u64>> = match (args.seed, deadline) {
        (Some(s), _) => Box::new(std::iter::once(s)),
        (None, Some(_)) => Box::new(args.first..),
        (None, None) => Box::new(args.first..args.first + args.seeds),
    };
    let (mut total, mut runs, mut failed) = (Vec::new(), 0u64, Vec::new());
    let mut under = std::collections::BTreeMap::new();
    for seed in seeds {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let plan = Plan::draw(seed, args.seconds);
        if args.plans {
            println!("{}", plan.describe());
            continue;
        }
        let outcome = run(&plan);
        runs += 1;
        println!("{}", outcome.report());
        accumulate(&mut total, &outcome.verdict.rows);
        for (k, n) in &outcome.verdict.under_by_bucket {
            *under.entry(k.clone()).or_default() += n;
        }
        if outcome.violated() {
            failed.push(seed);
            println!(
                "seed {seed} violated after {:.1} minutes",
                began.elapsed().as_secs_f64() / 60.0
            );
            if !args.no_shrink {
                let shrunk: Outcome = shrink(outcome, |step| println!("shrinking: {step}"));
                println!("SHRUNK:\n{}", shrunk.report());
            }
            if !args.keep_going {
                break;
            }
        }
    }
    println!(
        "{runs} runs of {} s in {:.1} minutes; seeds that violated: {failed:?}\n{}{}",
        args.seconds,
        began.elapsed().as_secs_f64() / 60.0,
        table(&total),
        under_by_bucket(&under)
    );
    if !failed.is_empty() {
        std::process::exit(1);
    }
}

/// On Ctrl-C or SIGTERM, removes the sidecars' network namespaces (killing what runs in them) and
/// exits: a run stopped halfway leaves no namespace behind. (A terminal's Ctrl-C reaches the
/// other processes of the run as before: they share its process group.)
fn remove_namespaces_on_signal() {
    ratelimit_e2e::netns::on_interrupt(|| {
        ratelimit_e2e::netns::remove_all();
        eprintln!("\ninterrupted: the sidecars' namespaces removed");
        std::process::exit(130);
    });
}
