//! The sidecar's command line: every flag is also an environment variable, every default is
//! written once, here, next to its field.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;

pub use crate::secret::Secret;
use crate::store::redis::connection::{read_password, redis_tls_files, Connection, RedisAccess};
use crate::store::{StoreError, StoreReset};

/// `ratelimit-sidecar`: answers `POST /v1/decide` by running the token bucket in Redis.
#[derive(Debug, Clone, Parser)]
#[command(name = "ratelimit-sidecar", version, about)]
#[command(group(clap::ArgGroup::new("redis_password_source").args(["redis_password", "redis_password_file"])))]
pub struct Args {
    /// Address to serve HTTP on.
    #[arg(long, env = "RATELIMIT_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,

    /// The policy file(s), comma separated: the limits per rule (this sidecar's format) or
    /// envoyproxy/ratelimit's configuration. Reloaded when they change and on SIGHUP.
    #[arg(long, env = "RATELIMIT_LIMITS", value_delimiter = ',', num_args = 1.., required = true)]
    pub limits: Vec<PathBuf>,

    /// The longest full refill (capacity / refill_per_sec) a policy may set, in seconds: it bounds
    /// how long any bucket key lives in Redis.
    #[arg(long, env = "RATELIMIT_MAX_REFILL_SECONDS", default_value_t = 31_536_000.0, value_parser = positive_f64)]
    pub max_refill_seconds: f64,

    /// The largest lease a gateway may hold on one bucket, as a fraction of its capacity
    /// (0 turns leases off).
    #[arg(long, env = "RATELIMIT_LEASE_MAX_SHARE", default_value_t = 0.1, value_parser = share)]
    pub lease_max_share: f64,

    /// Bucket script calls in flight per Redis node; work that arrives meanwhile is batched into
    /// the next call. A call holds its place until Redis answers it (or, unanswered, for
    /// max(--redis-timeout-ms, 1 s)), also after its callers were answered 503 at the timeout: a
    /// stalled Redis is sent no more than this many calls per connection.
    #[arg(long, env = "RATELIMIT_REDIS_PIPELINE", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub redis_pipeline: u64,

    /// This sidecar's region, for rules whose budget is partitioned across regions (`regions:`
    /// in the policy): it applies that region's share. A regional rule that does not list it, or
    /// one without this flag, is refused at load. See docs/regions.md.
    #[arg(long, env = "RATELIMIT_REGION", value_name = "NAME")]
    pub region: Option<String>,

    /// Log line format: `text` or `json`.
    #[arg(long, env = "RATELIMIT_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,

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
    #[arg(long, env = "RATELIMIT_REDIS_TIMEOUT_MS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub redis_timeout_ms: u64,

    /// Prefix of every Redis key the sidecar writes: bucket `<prefix>{<key>}`, attempt record
    /// `<prefix>{<key>}:a:<attempt>`.
    #[arg(long, env = "RATELIMIT_KEY_PREFIX", default_value = "rl:")]
    pub key_prefix: String,

    /// How long a call's attempt id is remembered (deduplication window, and how long a
    /// cross-node request can be refunded), in milliseconds.
    #[arg(long, env = "RATELIMIT_ATTEMPT_TTL_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub attempt_ttl_ms: u64,

    /// How long the receipt of a charge whose cost is settled from the response is kept, in
    /// milliseconds: a settlement within it gives back what the decision was charged (once);
    /// later, nothing is given back (docs/costs.md). Covers the longest response.
    #[arg(long, env = "RATELIMIT_RECEIPT_TTL_MS", default_value_t = 3_600_000, value_parser = clap::value_parser!(u64).range(1000..=86_400_000))]
    pub receipt_ttl_ms: u64,

    /// What a bucket starts with after Redis lost its state or may hold an older one (restarted,
    /// with or without its data, flushed, a replica promoted): `full` (a missing bucket is full,
    /// as for a client never seen; one it holds is as it holds it) or `empty` (a bucket not
    /// written since the loss starts empty at the time of the loss and refills from there, so
    /// nothing is admitted that the lost state would not have admitted). The loss is seen through
    /// each node's epoch marker `<prefix>epoch` either way (logged,
    /// `ratelimit_store_resets_total`).
    #[arg(long, env = "RATELIMIT_STORE_RESET", value_enum, default_value_t = StoreReset::Full)]
    pub store_reset: StoreReset,

    /// Which answers of Envoy's rate limit service (gRPC) carry `RateLimit-Policy`, `RateLimit`
    /// and `Retry-After` in `response_headers_to_add`: `all`, `rejected` (only a request over
    /// its limit) or `none`. Each header costs Envoy's native filter per request
    /// (docs/benchmarks.md).
    #[arg(long, env = "RATELIMIT_GRPC_RESPONSE_HEADERS", value_enum, default_value_t = crate::grpc::ResponseHeaders::All)]
    pub grpc_response_headers: crate::grpc::ResponseHeaders,

    /// Whether an admitted request's gRPC answer carries what it charged as dynamic metadata
    /// (`settle.<rule>`), which a route's stream-done settlement reads (docs/grpc.md). `false`
    /// when no route settles a cost: Envoy then merges no metadata per request.
    #[arg(long, env = "RATELIMIT_GRPC_CHARGED_METADATA", default_value_t = true, action = clap::ArgAction::Set)]
    pub grpc_charged_metadata: bool,

    /// Largest accepted request body, in bytes: a larger `POST /v1/decide` body is answered 413,
    /// a larger gRPC request message OUT_OF_RANGE, but for the quota (RLQS) stream's usage
    /// reports, read in reports of at most this size (and answered in messages within it). At
    /// least 65536, the most a gateway puts in one call (the Wasm filter packs its batches
    /// within it).
    #[arg(long, env = "RATELIMIT_MAX_BODY_BYTES", default_value_t = ratelimit_wire::budget::MAX_BODY_BYTES, value_parser = body_bytes)]
    pub max_body_bytes: usize,

    /// How long a connection may take to send a request's headers, in milliseconds; an idle
    /// HTTP/1.1 keep-alive connection counts as one sending headers, so it is closed after this
    /// too (keep the gateways' idle timeout for the sidecar below it). Bounds what a slow or
    /// silent client holds before it is authenticated.
    #[arg(long, env = "RATELIMIT_HEADER_TIMEOUT_MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub header_timeout_ms: u64,

    /// Most client connections served at once on each listener; past it a new connection is
    /// closed at once (and logged, at most every 10 s).
    #[arg(long, env = "RATELIMIT_MAX_CONNECTIONS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: u64,

    /// Threads that serve calls and talk to Redis (1 to 64). One thread is the cheapest per
    /// decision (no hand-offs between threads: about a fifth less CPU in `make bench`) and serves
    /// tens of thousands of decisions/s; give a sidecar that serves many gateways more, at most
    /// one per core, or run more sidecars.
    #[arg(long, env = "RATELIMIT_WORKER_THREADS", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub worker_threads: u64,

    /// Multiplexed connections to a single Redis (--redis), used round-robin. Ignored with
    /// --redis-sentinel (one multiplexed connection to the primary) and --redis-cluster (one
    /// cluster connection that multiplexes one connection per node).
    #[arg(long, env = "RATELIMIT_REDIS_CONNECTIONS", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub redis_connections: u64,

    /// File of bearer tokens callers of the decision endpoints must present
    /// (`authorization: Bearer <token>`), one per line; blank lines and `#` comments are
    /// ignored. Re-read when it changes, so tokens can be rotated without a restart.
    #[arg(long, env = "RATELIMIT_AUTH_TOKEN_FILE", value_name = "PATH")]
    pub auth_token_file: Option<PathBuf>,

    /// One bearer token callers must present (in addition to those of --auth-token-file).
    /// Prefer the environment variable: a flag's value shows in the process list.
    #[arg(
        long,
        env = "RATELIMIT_AUTH_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub auth_token: Option<Secret>,

    /// PEM certificate chain of this sidecar: serve HTTPS (HTTP/1.1 and HTTP/2 by ALPN) on
    /// --listen. Needs --tls-key.
    #[arg(
        long,
        env = "RATELIMIT_TLS_CERT",
        value_name = "PATH",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(
        long,
        env = "RATELIMIT_TLS_KEY",
        value_name = "PATH",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,

    /// PEM CA certificate(s): callers must present a client certificate signed by one of them
    /// (mutual TLS). Needs --tls-cert and --tls-key.
    #[arg(
        long,
        env = "RATELIMIT_TLS_CLIENT_CA",
        value_name = "PATH",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<PathBuf>,

    /// Serve callers without credentials on a non-loopback --listen address, on purpose.
    /// Without it the sidecar refuses to start there unless a bearer token or --tls-client-ca
    /// is configured.
    #[arg(long, env = "RATELIMIT_ALLOW_UNAUTHENTICATED")]
    pub allow_unauthenticated: bool,

    /// The time to live of an RLQS assignment, in whole seconds (Envoy reads only the seconds):
    /// how long an Envoy keeps a quota assignment it was not sent again. See docs/rlqs.md.
    #[arg(long, env = "RATELIMIT_RLQS_ASSIGNMENT_TTL_S", default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=60))]
    pub rlqs_assignment_ttl_s: u64,

    /// The longest time between the sidecar sending an RLQS assignment and Envoy applying it, in
    /// milliseconds: the tokens taken for an assignment cover its TTL plus this margin.
    #[arg(long, env = "RATELIMIT_RLQS_DELIVERY_MARGIN_MS", default_value_t = 500, value_parser = clap::value_parser!(u64).range(0..=10_000))]
    pub rlqs_delivery_margin_ms: u64,

    /// How often every RLQS bucket of a stream is assigned again, in milliseconds; must be below
    /// TTL − 2 × margin, so that a renewal reaches Envoy while the last assignment is live.
    #[arg(long, env = "RATELIMIT_RLQS_RENEW_MS", default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub rlqs_renew_ms: u64,

    /// The most RLQS buckets one Envoy's stream may hold; further buckets get no assignment
    /// (Envoy's `no_assignment_behavior` applies to them).
    #[arg(long, env = "RATELIMIT_RLQS_MAX_BUCKETS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub rlqs_max_buckets: u64,

    /// A second, plain-HTTP listener serving only /healthz, /readyz and /metrics (for probes and
    /// Prometheus when --listen requires client certificates or tokens).
    #[arg(long, env = "RATELIMIT_ADMIN_LISTEN", value_name = "ADDR")]
    pub admin_listen: Option<SocketAddr>,

    /// TLS to Redis: --redis-ca-file, --redis-client-cert, --redis-client-key.
    #[command(flatten)]
    pub redis_tls: RedisTlsArgs,

    /// ACL user of the Redis data nodes (with a password from --redis-password-file or
    /// RATELIMIT_REDIS_PASSWORD): the primary Sentinel names, and the --redis or
    /// --redis-cluster nodes whose URL carries no password.
    #[arg(
        long,
        env = "RATELIMIT_REDIS_USERNAME",
        value_name = "NAME",
        requires = "redis_password_source"
    )]
    pub redis_username: Option<String>,

    /// File holding the password of the Redis data nodes (its first line): sent to the primary
    /// Sentinel names, and to the --redis or --redis-cluster nodes whose URL carries none.
    #[arg(
        long,
        env = "RATELIMIT_REDIS_PASSWORD_FILE",
        value_name = "PATH",
        conflicts_with = "redis_password"
    )]
    pub redis_password_file: Option<PathBuf>,

    /// Password of the Redis data nodes (applied like --redis-username). Prefer the
    /// environment variable or --redis-password-file: a flag's value shows in the process list.
    #[arg(
        long,
        env = "RATELIMIT_REDIS_PASSWORD",
        hide_env_values = true,
        value_name = "PASSWORD"
    )]
    pub redis_password: Option<Secret>,
}

/// `--max-body-bytes`: at least what a gateway sends in one call.
fn body_bytes(s: &str) -> Result<usize, String> {
    let min = ratelimit_wire::budget::MAX_BODY_BYTES;
    match s.parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        _ => Err(format!(
            "must be a whole number of at least {min}: the most a gateway sends in one call"
        )),
    }
}

/// How the sidecar reaches Redis, made from the flags: the store takes what these make, never
/// the command line itself.
impl Args {
    /// What the sidecar presents to the Redis data nodes ([`RedisAccess`]): the flags' files
    /// read; every error names the flag and the path.
    pub fn redis_access(&self) -> Result<RedisAccess, StoreError> {
        let password = match (&self.redis_password, &self.redis_password_file) {
            (Some(p), _) => Some(p.clone()),
            (None, Some(path)) => Some(read_password(path)?),
            (None, None) => None,
        };
        let certificates = self.redis_tls.certificates()?;
        Ok(RedisAccess {
            username: self.redis_username.clone(),
            password,
            certificates,
        })
    }

    /// The connection to Redis the flags describe: `--redis-sentinel`, `--redis-cluster` or
    /// `--redis`, with the credentials and TLS material of [`Args::redis_access`].
    pub fn redis_connection(&self) -> Result<Connection, StoreError> {
        let access = self.redis_access()?;
        let args = self;
        if !args.redis_sentinel.is_empty() {
            Connection::sentinel_with(
                &args.redis_sentinel,
                &args.sentinel_master,
                &access,
                args.redis_timeout_ms,
            )
        } else if !args.redis_cluster.is_empty() {
            Connection::cluster_with(&args.redis_cluster, &access, args.redis_timeout_ms)
        } else {
            Connection::single_with(
                &args.redis,
                &access,
                args.redis_connections as usize,
                args.redis_timeout_ms,
            )
        }
    }
}

impl RedisTlsArgs {
    /// The flags' files, read and checked ([`redis_tls_files`]).
    pub fn certificates(&self) -> Result<Option<redis::TlsCertificates>, StoreError> {
        redis_tls_files(
            self.redis_ca_file.as_deref(),
            self.redis_client_cert.as_deref(),
            self.redis_client_key.as_deref(),
        )
    }
}

impl Args {
    /// The arguments as if given nothing but `redis` and `limits` (handy for embedding and tests).
    pub fn with_redis(url: &str, limits: &str) -> Self {
        Self::parse_from(["ratelimit-sidecar", "--redis", url, "--limits", limits])
    }
}

fn positive_f64(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not a number > 0")),
    }
}

fn share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a fraction between 0 and 1")),
    }
}

/// The TLS material for `rediss://` Redis URLs, as flags; shared by `ratelimit-sidecar` and
/// `ratelimit-rebalancer` (read by [`crate::store::redis::connection::redis_tls_files`]).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RedisTlsArgs {
    /// PEM CA certificate(s) that sign the Redis servers' certificates (`rediss://` URLs);
    /// without it the system's roots are used.
    #[arg(long, env = "RATELIMIT_REDIS_CA_FILE", value_name = "PATH")]
    pub redis_ca_file: Option<PathBuf>,

    /// PEM client certificate chain presented to Redis (`tls-auth-clients`). Needs
    /// --redis-client-key.
    #[arg(
        long,
        env = "RATELIMIT_REDIS_CLIENT_CERT",
        value_name = "PATH",
        requires = "redis_client_key"
    )]
    pub redis_client_cert: Option<PathBuf>,

    /// PEM private key of --redis-client-cert.
    #[arg(
        long,
        env = "RATELIMIT_REDIS_CLIENT_KEY",
        value_name = "PATH",
        requires = "redis_client_cert"
    )]
    pub redis_client_key: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let a = Args::try_parse_from(["ratelimit-sidecar", "--limits", "l.yaml"]).unwrap();
        assert_eq!(a.limits, [PathBuf::from("l.yaml")]);
        assert_eq!(a.max_refill_seconds, 31_536_000.0);
        assert_eq!(a.lease_max_share, 0.1);
        assert_eq!(a.redis_pipeline, 4);
        assert_eq!(a.log_format, "text");
        assert!(
            Args::try_parse_from(["ratelimit-sidecar"]).is_err(),
            "--limits is required"
        );
        assert!(Args::try_parse_from([
            "ratelimit-sidecar",
            "--limits",
            "l",
            "--lease-max-share",
            "2"
        ])
        .is_err());
        assert_eq!(a.listen.to_string(), "127.0.0.1:8081");
        assert_eq!(a.redis, "redis://127.0.0.1:6379");
        assert!(a.redis_cluster.is_empty());
        assert!(a.redis_sentinel.is_empty());
        assert_eq!(a.sentinel_master, "mymaster");
        assert_eq!(a.redis_timeout_ms, 30);
        assert_eq!(a.key_prefix, "rl:");
        assert_eq!(a.attempt_ttl_ms, 10_000);
        assert_eq!(a.max_body_bytes, 65_536);
        assert_eq!(a.redis_connections, 2);
        assert_eq!(a.worker_threads, 1);
        assert_eq!(a.auth_token_file, None);
        assert_eq!(a.auth_token, None);
        assert_eq!((a.tls_cert, a.tls_key, a.tls_client_ca), (None, None, None));
        assert!(!a.allow_unauthenticated);
        assert_eq!(a.admin_listen, None);
        assert_eq!(
            (
                a.rlqs_assignment_ttl_s,
                a.rlqs_delivery_margin_ms,
                a.rlqs_renew_ms
            ),
            (3, 500, 1_000)
        );
        assert_eq!(a.rlqs_max_buckets, 10_000);
        assert_eq!(a.redis_tls.redis_ca_file, None);
        assert_eq!(
            (a.redis_tls.redis_client_cert, a.redis_tls.redis_client_key),
            (None, None)
        );
        assert_eq!(a.redis_username, None);
        assert_eq!((a.redis_password_file, a.redis_password), (None, None));
    }

    #[test]
    fn secrets_never_show_in_debug_or_help() {
        let a = Args::try_parse_from([
            "ratelimit-sidecar",
            "--limits",
            "l.yaml",
            "--auth-token",
            "tok-3f9a",
            "--redis-password",
            "pw-71c2",
        ])
        .unwrap();
        assert_eq!(a.auth_token.as_ref().map(Secret::expose), Some("tok-3f9a"));
        let debug = format!("{a:?}");
        assert!(
            !debug.contains("tok-3f9a") && !debug.contains("pw-71c2"),
            "{debug}"
        );
        let help = <Args as clap::CommandFactory>::command()
            .render_long_help()
            .to_string();
        assert!(help.contains("RATELIMIT_AUTH_TOKEN"), "{help}");
    }

    #[test]
    fn tls_files_come_in_pairs() {
        let parse = |flags: &[&str]| {
            let mut argv = vec!["ratelimit-sidecar", "--limits", "l.yaml"];
            argv.extend_from_slice(flags);
            Args::try_parse_from(argv)
        };
        for alone in [
            &["--tls-cert", "c.pem"][..],
            &["--tls-key", "k.pem"],
            &["--tls-client-ca", "ca.pem"],
            &["--redis-client-cert", "c.pem"],
            &["--redis-client-key", "k.pem"],
        ] {
            let e = parse(alone).unwrap_err();
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::MissingRequiredArgument,
                "{alone:?}: {e}"
            );
        }
        let a = parse(&[
            "--tls-cert",
            "c.pem",
            "--tls-key",
            "k.pem",
            "--tls-client-ca",
            "ca.pem",
        ])
        .unwrap();
        assert_eq!(a.tls_client_ca, Some(PathBuf::from("ca.pem")));
        let e = parse(&["--redis-password", "x", "--redis-password-file", "p"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{e}");
    }

    #[test]
    fn cluster_seeds_are_comma_separated_and_exclude_redis() {
        let a = Args::try_parse_from([
            "ratelimit-sidecar",
            "--limits",
            "l.yaml",
            "--redis-cluster",
            "redis://127.0.0.1:7000,redis://127.0.0.1:7001",
        ])
        .unwrap();
        assert_eq!(a.redis_cluster.len(), 2);
        assert!(Args::try_parse_from([
            "ratelimit-sidecar",
            "--limits",
            "l.yaml",
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
            "--limits",
            "l.yaml",
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
                "--limits",
                "l.yaml",
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
