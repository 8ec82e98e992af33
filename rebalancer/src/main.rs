//! The `ratelimit-rebalancer` binary: parse flags, load the policy, check every rule's regions
//! are reachable by name, then run each rule's rounds (or one round each, `--once`).

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use ratelimit_rebalancer::config::Args;
use ratelimit_rebalancer::region::Region;
use ratelimit_rebalancer::run::{RuleRun, Settings};
use ratelimit_sidecar::policy::{Bounds, Policy, RegionScope, Regional};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter);
    if args.log_format == "json" {
        logs.json().flatten_event(true).init();
    } else {
        logs.init();
    }
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The rules to rebalance: those named by `--rule`, or every regional rule.
fn select(policy: &Policy, wanted: &[String]) -> anyhow::Result<Vec<Arc<Regional>>> {
    let all = policy.regional_rules();
    if wanted.is_empty() {
        if all.is_empty() {
            bail!("the policy has no regional rule (rules with `regions:`)");
        }
        return Ok(all);
    }
    wanted
        .iter()
        .map(|w| {
            let (domain, rule) = w.split_once('/').unwrap_or(("", w.as_str()));
            all.iter()
                .find(|r| r.rule == rule && (domain.is_empty() || r.domain == domain))
                .cloned()
                .with_context(|| format!("--rule {w}: no regional rule of that name in the policy"))
        })
        .collect()
}

async fn run(args: Args) -> anyhow::Result<()> {
    let params = args.params().map_err(anyhow::Error::msg)?;
    let urls = args.region_urls().map_err(anyhow::Error::msg)?;
    let lock_region = args.lock_region().map_err(anyhow::Error::msg)?;
    let policy = Policy::load(
        &args.limits,
        &Bounds {
            region: RegionScope::Every,
            ..Bounds::default()
        },
    )
    .context("invalid policy")?;
    let rules = select(&policy, &args.rules)?;
    let tls = args
        .redis_tls
        .certificates()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if tls.is_some() {
        if let Some((name, _)) = urls.iter().find(|(_, url)| !url.starts_with("rediss://")) {
            anyhow::bail!(
                "--redis-ca-file/--redis-client-cert given, but --region {name}= is not TLS: use \
                 rediss:// URLs"
            );
        }
    }
    let regions: BTreeMap<String, Arc<Region>> = urls
        .iter()
        .map(|(name, url)| {
            (
                name.clone(),
                Arc::new(Region::new(name, url, args.redis_timeout_ms).with_tls(tls.clone())),
            )
        })
        .collect();
    let holder = format!("{}-{:016x}", std::process::id(), rand::random::<u64>());
    let settings = Settings {
        params,
        key_prefix: args.key_prefix.clone(),
        wait_replicas: args.wait_replicas,
        leader_ttl_ms: args.leader_ttl_ms,
        holder,
    };
    let mut runs = Vec::new();
    for rule in rules {
        let mut mine = BTreeMap::new();
        for region in rule.quota.regions() {
            let r = regions.get(region).with_context(|| {
                format!(
                    "rule {}: its region {region:?} has no --region {region}=URL; every region \
                     of a rebalanced rule must be reachable by name",
                    rule.rule
                )
            })?;
            mine.insert(region.to_string(), r.clone());
        }
        runs.push(RuleRun::new(
            rule,
            settings.clone(),
            mine,
            regions[&lock_region].clone(),
        ));
    }
    tracing::info!(
        rules = %runs.iter().map(RuleRun::name).collect::<Vec<_>>().join(","),
        regions = %urls.keys().cloned().collect::<Vec<_>>().join(","),
        lock_region = %lock_region,
        lease_ms = params.lease_ms,
        fence_margin_ms = params.fence_margin_ms,
        round_interval_ms = params.round_interval_ms,
        once = args.once,
        "rebalancing"
    );
    let observe = Duration::from_millis(args.observe_ms.unwrap_or(params.round_interval_ms));
    let interval = Duration::from_millis(params.round_interval_ms);
    let once = args.once;
    let tasks = runs.into_iter().map(|mut run| async move {
        if once {
            if !run.lead().await {
                bail!("rule {}: another rebalancer leads it", run.name());
            }
            run.observe_demand().await;
            tracing::info!(rule = %run.name(), observe_ms = observe.as_millis() as u64, "observing demand");
            tokio::time::sleep(observe).await;
            let report = run.round().await;
            run.resign().await;
            if report.is_none() {
                bail!("rule {}: lost its leader lock during the round", run.name());
            }
            return Ok(());
        }
        run.observe_demand().await;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            run.round().await;
        }
    });
    for result in futures::future::join_all(tasks).await {
        result?;
    }
    Ok(())
}
