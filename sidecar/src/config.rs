//! The sidecar's command line: every flag is also an environment variable, every default is
//! written once, here, next to its field.

use std::net::SocketAddr;

use clap::Parser;

/// `ratelimit-sidecar`: answers `POST /v1/decide` by running the token bucket in Redis.
#[derive(Debug, Clone, Parser)]
#[command(name = "ratelimit-sidecar", version, about)]
pub struct Args {
    /// Address to serve HTTP on.
    #[arg(long, env = "RATELIMIT_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,

    /// URL of one Redis (a primary). Mutually exclusive with --redis-cluster and
    /// --redis-sentinel.
    #[arg(
        long,
        env = "RATELIMIT_REDIS",
        default_value = "redis://127.0.0.1:6379",
        conflicts_with_all = ["redis_cluster", "redis_sentinel"]
    )]
    pub redis: String,

    /// Seed URLs of a Redis Cluster, comma separated (redis://host:port,...).
    #[arg(long, env = "RATELIMIT_REDIS_CLUSTER", value_delimiter = ',', num_args = 1..)]
    pub redis_cluster: Vec<String>,

    /// URLs of the Sentinels that watch the primary, comma separated (redis://host:26379,...);
    /// the primary they name for --sentinel-master is used, and asked for again after a
    /// failover. Mutually exclusive with --redis and --redis-cluster.
    #[arg(
        long,
        env = "RATELIMIT_REDIS_SENTINEL",
        value_delimiter = ',',
        num_args = 1..,
        conflicts_with = "redis_cluster"
    )]
    pub redis_sentinel: Vec<String>,

    /// Name of the primary the Sentinels monitor (`sentinel monitor <name> ...`).
    #[arg(long, env = "RATELIMIT_SENTINEL_MASTER", default_value = "mymaster")]
    pub sentinel_master: String,

    /// Upper bound of every Redis call, in milliseconds; past it the decision answers 503.
    #[arg(long, env = "RATELIMIT_REDIS_TIMEOUT_MS", default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..))]
    pub redis_timeout_ms: u64,

    /// Prefix of every Redis key the sidecar writes: bucket `<prefix>{<key>}`, attempt record
    /// `<prefix>{<key>}:a:<attempt>`.
    #[arg(long, env = "RATELIMIT_KEY_PREFIX", default_value = "rl:")]
    pub key_prefix: String,

    /// How long an attempt id is remembered (deduplication window), in milliseconds.
    #[arg(long, env = "RATELIMIT_ATTEMPT_TTL_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub attempt_ttl_ms: u64,

    /// Largest accepted request body, in bytes; more is answered 413.
    #[arg(long, env = "RATELIMIT_MAX_BODY_BYTES", default_value_t = 65_536)]
    pub max_body_bytes: usize,

    /// Multiplexed connections to a single Redis (--redis), used round-robin. Ignored with
    /// --redis-sentinel (one multiplexed connection to the primary) and --redis-cluster (one
    /// cluster connection that multiplexes one connection per node).
    #[arg(long, env = "RATELIMIT_REDIS_CONNECTIONS", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub redis_connections: u64,
}

impl Args {
    /// The arguments as if given nothing but `redis` (handy for embedding and tests).
    pub fn with_redis(url: &str) -> Self {
        Self::parse_from(["ratelimit-sidecar", "--redis", url])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let a = Args::try_parse_from(["ratelimit-sidecar"]).unwrap();
        assert_eq!(a.listen.to_string(), "127.0.0.1:8081");
        assert_eq!(a.redis, "redis://127.0.0.1:6379");
        assert!(a.redis_cluster.is_empty());
        assert!(a.redis_sentinel.is_empty());
        assert_eq!(a.sentinel_master, "mymaster");
        assert_eq!(a.redis_timeout_ms, 50);
        assert_eq!(a.key_prefix, "rl:");
        assert_eq!(a.attempt_ttl_ms, 10_000);
        assert_eq!(a.max_body_bytes, 65_536);
        assert_eq!(a.redis_connections, 2);
    }

    #[test]
    fn cluster_seeds_are_comma_separated_and_exclude_redis() {
        let a = Args::try_parse_from([
            "ratelimit-sidecar",
            "--redis-cluster",
            "redis://127.0.0.1:7000,redis://127.0.0.1:7001",
        ])
        .unwrap();
        assert_eq!(a.redis_cluster.len(), 2);
        assert!(Args::try_parse_from([
            "ratelimit-sidecar",
            "--redis",
            "redis://x",
            "--redis-cluster",
            "redis://y"
        ])
        .is_err());
    }

    #[test]
    fn sentinels_are_comma_separated_and_exclude_redis_and_cluster() {
        let a = Args::try_parse_from([
            "ratelimit-sidecar",
            "--redis-sentinel",
            "redis://127.0.0.1:26379,redis://127.0.0.1:26380",
            "--sentinel-master",
            "buckets",
        ])
        .unwrap();
        assert_eq!(
            a.redis_sentinel,
            ["redis://127.0.0.1:26379", "redis://127.0.0.1:26380"]
        );
        assert_eq!(a.sentinel_master, "buckets");
        let with = |other: &str| {
            Args::try_parse_from([
                "ratelimit-sidecar",
                other,
                "redis://x",
                "--redis-sentinel",
                "redis://y",
            ])
        };
        let e = with("--redis").unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{e}");
        let e = with("--redis-cluster").unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{e}");
    }
}
