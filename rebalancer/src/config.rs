//! The rebalancer's command line: every flag is also an environment variable; the algorithm's
//! defaults come from `ratelimit_regions::Params::default()`, written once there.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::Parser;
use ratelimit_regions::{Params, Share};
use ratelimit_sidecar::config::RedisTlsArgs;

/// `ratelimit-rebalancer`: moves unused share of regional rules' global budgets to the regions
/// that reject, shrinking donors before growing recipients behind a fence (docs/regions.md).
#[derive(Debug, Clone, Parser)]
#[command(name = "ratelimit-rebalancer", version, about)]
pub struct Args {
    /// The policy file(s) the sidecars read, comma separated: the regional rules, their global
    /// budgets, initial shares and floors.
    #[arg(long, env = "RATELIMIT_LIMITS", value_delimiter = ',', num_args = 1.., required = true)]
    pub limits: Vec<PathBuf>,

    /// A region and the URL of its Redis, `NAME=redis://host:port` (repeatable, or comma
    /// separated in the environment variable). Every region of a rebalanced rule must be named.
    #[arg(long = "region", env = "RATELIMIT_REBALANCER_REGIONS", value_delimiter = ',', num_args = 1.., required = true, value_parser = region_url)]
    pub regions: Vec<(String, String)>,

    /// The rules to rebalance, `RULE` or `DOMAIN/RULE` (repeatable). Default: every regional
    /// rule of the policy.
    #[arg(
        long = "rule",
        env = "RATELIMIT_REBALANCER_RULES",
        value_delimiter = ','
    )]
    pub rules: Vec<String>,

    /// Prefix of the sidecars' Redis keys (their --key-prefix).
    #[arg(long, env = "RATELIMIT_KEY_PREFIX", default_value = "rl:")]
    pub key_prefix: String,

    /// The lease L, in milliseconds, written into every share record: a sidecar applies a share
    /// it read for at most this long, and re-reads it every L/4.
    #[arg(long, env = "RATELIMIT_REBALANCER_LEASE_MS", default_value_t = Params::default().lease_ms)]
    pub lease_ms: u64,

    /// Added to the lease before a recipient grows, in milliseconds (clock rates, read latency).
    #[arg(long, env = "RATELIMIT_REBALANCER_FENCE_MARGIN_MS", default_value_t = Params::default().fence_margin_ms)]
    pub fence_margin_ms: u64,

    /// Time between rounds, and the interval demand is observed over, in milliseconds; at least
    /// the fence (lease + margin).
    #[arg(long, env = "RATELIMIT_REBALANCER_ROUND_INTERVAL_MS", default_value_t = Params::default().round_interval_ms)]
    pub round_interval_ms: u64,

    /// The fraction of a donor's excess one round may take, in (0, 1].
    #[arg(long, env = "RATELIMIT_REBALANCER_STEP_FRACTION", default_value_t = Params::default().step_fraction)]
    pub step_fraction: f64,

    /// A region rejecting at least this fraction of its decisions is a recipient.
    #[arg(long, env = "RATELIMIT_REBALANCER_RECIPIENT_REJECT_RATIO", default_value_t = Params::default().recipient_reject_ratio)]
    pub recipient_reject_ratio: f64,

    /// The dead band, as a fraction of the budget: no move for a region closer than this to its
    /// target, no round moving less.
    #[arg(long, env = "RATELIMIT_REBALANCER_MIN_MOVE", default_value_t = Params::default().min_move.fraction())]
    pub min_move: f64,

    /// Run one round per rule and exit: read every region, observe demand for --observe-ms, plan,
    /// shrink, wait the fence, grow.
    #[arg(long)]
    pub once: bool,

    /// With --once: how long demand is observed before the round, in milliseconds. Default:
    /// --round-interval-ms.
    #[arg(long, env = "RATELIMIT_REBALANCER_OBSERVE_MS")]
    pub observe_ms: Option<u64>,

    /// Upper bound of every Redis call, in milliseconds: past it a region is unreachable for that
    /// round, and a write's outcome is unknown.
    #[arg(long, env = "RATELIMIT_REBALANCER_REDIS_TIMEOUT_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    pub redis_timeout_ms: u64,

    /// Replicas that must acknowledge a share write (Redis WAIT) before it counts as written; a
    /// write fewer replicas acknowledged counts as unknown (the region is frozen until a read
    /// shows it). 0: the primary's answer is enough.
    #[arg(long, env = "RATELIMIT_REBALANCER_WAIT_REPLICAS", default_value_t = 0)]
    pub wait_replicas: u64,

    /// The region whose Redis holds the leader locks (one rebalancer at a time per rule).
    /// Default: the first region by name.
    #[arg(long, env = "RATELIMIT_REBALANCER_LOCK_REGION")]
    pub lock_region: Option<String>,

    /// How long a leader lock lives without renewal, in milliseconds: another rebalancer takes a
    /// rule over this long after its leader stopped. Renewed before every step of a round.
    #[arg(long, env = "RATELIMIT_REBALANCER_LEADER_TTL_MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub leader_ttl_ms: u64,

    /// TLS to the regions' Redis (`rediss://` URLs): --redis-ca-file, --redis-client-cert,
    /// --redis-client-key, as the sidecar's.
    #[command(flatten)]
    pub redis_tls: RedisTlsArgs,

    /// Log line format: `text` or `json`.
    #[arg(long, env = "RATELIMIT_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
}

fn region_url(s: &str) -> Result<(String, String), String> {
    let (name, url) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=URL (e.g. eu=redis://10.0.0.1:6379)"))?;
    if name.is_empty() || url.is_empty() {
        return Err(format!(
            "{s:?} is not NAME=URL (e.g. eu=redis://10.0.0.1:6379)"
        ));
    }
    Ok((name.to_string(), url.to_string()))
}

impl Args {
    /// The algorithm's parameters; `Err` names every flag that cannot be honoured.
    pub fn params(&self) -> Result<Params, String> {
        let mut problems = Vec::new();
        let min_move = Share::from_fraction(self.min_move).unwrap_or_else(|| {
            problems.push(format!("--min-move: {} must be in [0, 1]", self.min_move));
            Share::ZERO
        });
        let params = Params {
            lease_ms: self.lease_ms,
            fence_margin_ms: self.fence_margin_ms,
            round_interval_ms: self.round_interval_ms,
            step_fraction: self.step_fraction,
            recipient_reject_ratio: self.recipient_reject_ratio,
            min_move,
        };
        if let Err(p) = params.validate() {
            problems.push(format!("--{}", p.replace("; ", "; --").replace('_', "-")));
        }
        if problems.is_empty() {
            Ok(params)
        } else {
            Err(problems.join("; "))
        }
    }

    /// Regions by name; `Err` names a region given twice.
    pub fn region_urls(&self) -> Result<BTreeMap<String, String>, String> {
        let mut urls = BTreeMap::new();
        for (name, url) in &self.regions {
            if urls.insert(name.clone(), url.clone()).is_some() {
                return Err(format!("--region: {name:?} is given twice"));
            }
        }
        Ok(urls)
    }

    /// The region holding the leader locks.
    pub fn lock_region(&self) -> Result<String, String> {
        let urls = self.region_urls()?;
        match &self.lock_region {
            Some(r) if urls.contains_key(r) => Ok(r.clone()),
            Some(r) => Err(format!(
                "--lock-region: {r:?} is not one of the --region names"
            )),
            None => Ok(urls.keys().next().cloned().unwrap_or_default()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        let mut argv = vec!["ratelimit-rebalancer", "--limits", "limits.yaml"];
        argv.extend_from_slice(args);
        Args::try_parse_from(argv)
    }

    #[test]
    fn regions_are_name_equals_url_and_defaults_come_from_the_algorithm() {
        let a = parse(&[
            "--region",
            "us=redis://b:6379",
            "--region",
            "eu=redis://a:6379",
        ])
        .unwrap();
        let urls = a.region_urls().unwrap();
        assert_eq!(urls["eu"], "redis://a:6379");
        assert_eq!(a.lock_region().unwrap(), "eu", "the first by name");
        assert_eq!(a.params().unwrap(), Params::default());
        assert!(!a.once);
        let e = parse(&["--region", "eu"]).unwrap_err().to_string();
        assert!(e.contains("is not NAME=URL"), "{e}");
        let twice = parse(&["--region", "eu=redis://a", "--region", "eu=redis://b"]).unwrap();
        assert!(twice.region_urls().unwrap_err().contains("given twice"));
        let lock = parse(&["--region", "eu=redis://a", "--lock-region", "ap"]).unwrap();
        assert!(lock.lock_region().unwrap_err().contains("--lock-region"));
    }

    #[test]
    fn parameters_that_cannot_be_honoured_are_named_by_flag() {
        let a = parse(&[
            "--region",
            "eu=redis://a",
            "--round-interval-ms",
            "1000",
            "--step-fraction",
            "2",
            "--min-move",
            "1.5",
        ])
        .unwrap();
        let e = a.params().unwrap_err();
        assert!(e.contains("--min-move: 1.5"), "{e}");
        assert!(
            e.contains("--round-interval-ms: 1000 is shorter than the fence"),
            "{e}"
        );
        assert!(e.contains("--step-fraction: 2"), "{e}");
    }
}
