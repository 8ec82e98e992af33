//! How the sidecar reaches Redis: one node (several multiplexed, auto-reconnecting connections
//! used round-robin), the primary Sentinel names (one multiplexed connection, looked up again
//! after a failover) or a Cluster (one cluster connection, MOVED/ASK followed by the client);
//! with the data nodes' credentials and TLS material ([`RedisAccess`]) for every topology, and
//! [`redacted_url`] (in `redact.rs`), the one way a Redis URL is shown.

use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use redis::io::tcp::socket2::TcpKeepalive;
use redis::io::tcp::TcpSettings;
use redis::sentinel::{SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, ClientTlsConfig, Cmd, ConnectionAddr, ConnectionInfo,
    IntoConnectionInfo, TlsCertificates, TlsMode, Value,
};

pub use super::redact::{redacted_url, redacted_urls};
use super::sentinel::{LookupState, SentinelPrimary};
use crate::listener::{read_certificates, read_private_key, TlsConfigError};
use crate::secret::Secret;
use crate::store::StoreError;

/// How long the sidecar waits on Redis past a caller's deadline before it gives a connection up
/// for dead: to make a connection (Redis accepts, TLS, `AUTH`, `CLIENT SETINFO`), and, on one
/// Redis, for the answer to a command already sent (see [`SingleNode`]). `--redis-timeout-ms`, at
/// least 1 s: long enough that a Redis that is merely slow keeps its connections.
pub fn stall_limit(timeout_ms: u64) -> Duration {
    Duration::from_millis(timeout_ms.max(1000))
}

/// What the sidecar presents to the Redis data nodes beyond their address: an ACL user and a
/// password (`--redis-username`, `--redis-password-file` / `RATELIMIT_REDIS_PASSWORD`), applied
/// to the primary Sentinel names and to the `--redis` / `--redis-cluster` nodes whose URL carries
/// none; and the TLS material for `rediss://` (`--redis-ca-file`, `--redis-client-cert`,
/// `--redis-client-key`), for the data nodes and the Sentinels alike.
#[derive(Clone, Default)]
pub struct RedisAccess {
    pub username: Option<String>,
    pub password: Option<Secret>,
    /// Root CA(s) and client certificate, PEM; `None`: the system's roots, no client certificate.
    pub certificates: Option<TlsCertificates>,
}

/// The flags that give TLS material, as errors name them.
const TLS_FLAGS: &str = "--redis-ca-file/--redis-client-cert";

impl std::fmt::Debug for RedisAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisAccess")
            .field("username", &self.username)
            .field("password", &self.password)
            .field("certificates", &self.certificates)
            .finish()
    }
}

impl RedisAccess {
    /// The URL's connection info with the flags' user and password where the URL has none.
    fn apply_credentials(&self, info: ConnectionInfo) -> ConnectionInfo {
        let mut redis = info.redis_settings().clone();
        if redis.password().is_none() {
            if let Some(p) = &self.password {
                redis = redis.set_password(p.expose());
                if redis.username().is_none() {
                    if let Some(u) = &self.username {
                        redis = redis.set_username(u);
                    }
                }
            }
        }
        info.set_redis_settings(redis)
    }

    /// Refuses TLS material for URLs that are not `rediss://`: it would silently go unused.
    fn check_tls_used(&self, flag: &str, urls: &[String], tls: bool) -> Result<(), StoreError> {
        if self.certificates.is_some() && !tls {
            return Err(StoreError::Config(format!(
                "{TLS_FLAGS} given, but {flag} {} is not TLS: use rediss:// URLs",
                redacted_urls(urls)
            )));
        }
        Ok(())
    }
}

/// The TLS material of `--redis-ca-file`, `--redis-client-cert` and `--redis-client-key`, read
/// and checked (the PEM parses, the key belongs to the certificate); `None` when none is given
/// (the system's roots, no client certificate). Every error names the flag and the path. Also
/// used by `ratelimit-rebalancer`, whose flags have the same names.
pub fn redis_tls_files(
    ca_file: Option<&Path>,
    client_cert: Option<&Path>,
    client_key: Option<&Path>,
) -> Result<Option<TlsCertificates>, StoreError> {
    let tls_err = |e: TlsConfigError| StoreError::Config(e.to_string());
    let root_cert = match ca_file {
        None => None,
        Some(path) => {
            read_certificates("--redis-ca-file", path).map_err(tls_err)?;
            Some(std::fs::read(path).map_err(|e| {
                StoreError::Config(format!("--redis-ca-file {}: {e}", path.display()))
            })?)
        }
    };
    let client_tls = match (client_cert, client_key) {
        (Some(cert), Some(key)) => Some(read_client_identity(cert, key)?),
        (None, None) => None,
        _ => {
            return Err(StoreError::Config(
                "--redis-client-cert and --redis-client-key go together".into(),
            ))
        }
    };
    Ok(
        (root_cert.is_some() || client_tls.is_some()).then_some(TlsCertificates {
            client_tls,
            root_cert,
        }),
    )
}

/// The password of `--redis-password-file`: the file's first line, not empty.
pub fn read_password(path: &Path) -> Result<Secret, StoreError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        StoreError::Config(format!(
            "--redis-password-file {}: cannot read it: {e}",
            path.display()
        ))
    })?;
    let password = text.lines().next().unwrap_or_default().trim_end();
    if password.is_empty() {
        return Err(StoreError::Config(format!(
            "--redis-password-file {}: the first line is empty",
            path.display()
        )));
    }
    Ok(Secret::new(password))
}

/// The client certificate and key for Redis, checked to parse and to belong together.
fn read_client_identity(cert: &Path, key: &Path) -> Result<ClientTlsConfig, StoreError> {
    let chain = read_certificates("--redis-client-cert", cert)
        .map_err(|e| StoreError::Config(e.to_string()))?;
    let private_key = read_private_key("--redis-client-key", key)
        .map_err(|e| StoreError::Config(e.to_string()))?;
    crate::listener::install_crypto_provider();
    let provider = rustls::crypto::ring::default_provider();
    rustls::sign::CertifiedKey::from_der(chain, private_key, &provider).map_err(|e| {
        StoreError::Config(format!(
            "--redis-client-key {}: does not match the certificate of --redis-client-cert {}: {e}",
            key.display(),
            cert.display()
        ))
    })?;
    let read = |flag: &str, p: &Path| {
        std::fs::read(p)
            .map_err(|e| StoreError::Config(format!("{flag} {}: cannot read it: {e}", p.display())))
    };
    Ok(ClientTlsConfig {
        client_cert: read("--redis-client-cert", cert)?,
        client_key: read("--redis-client-key", key)?,
    })
}

/// Idle time before the first keepalive probe on a connection to Redis, the time between probes,
/// and the probes unanswered before the kernel gives the connection up.
pub const REDIS_KEEPALIVE: (Duration, Duration, u32) =
    (Duration::from_secs(60), Duration::from_secs(10), 3);

/// The TCP options of every connection to Redis (and to the Sentinels), where redis-rs leaves
/// both off:
/// - `TCP_NODELAY`. With Nagle's algorithm on, a script call written while an earlier one on the
///   same connection is still unacknowledged waits for that acknowledgement, which comes with the
///   earlier call's reply: the calls in flight per node (`--redis-pipeline`) then leave one per
///   round trip and connection, and a decision waits for the replies of the calls ahead of it
///   (`make scale`, part 3: docs/scaling.md).
/// - Keepalive probes ([`REDIS_KEEPALIVE`]). A NAT or load balancer between the sidecar and Redis
///   may forget an idle connection without a word (Azure's after 4 minutes, where Redis probes
///   every 5); the first decision after a quiet night would then wait out a dead connection
///   (max(`--redis-timeout-ms`, 1 s)) before it is replaced. Probing every minute keeps the path's
///   state alive, and finds a Redis host that vanished while no decision was asked.
fn tcp_settings() -> TcpSettings {
    let (idle, interval, retries) = REDIS_KEEPALIVE;
    TcpSettings::default().set_nodelay(true).set_keepalive(
        TcpKeepalive::new()
            .with_time(idle)
            .with_interval(interval)
            .with_retries(retries),
    )
}

/// Parses `url` for `flag`, with [`tcp_settings`]; the error shows the URL redacted.
fn connection_info(flag: &str, url: &str) -> Result<ConnectionInfo, StoreError> {
    url.into_connection_info()
        .map(|info| info.set_tcp_settings(tcp_settings()))
        .map_err(|e| StoreError::Config(format!("{flag} {}: {e}", redacted_url(url))))
}

fn is_tls(info: &ConnectionInfo) -> bool {
    matches!(info.addr(), ConnectionAddr::TcpTls { .. })
}

fn tls_mode(info: &ConnectionInfo) -> Option<TlsMode> {
    match info.addr() {
        ConnectionAddr::TcpTls { insecure: true, .. } => Some(TlsMode::Insecure),
        ConnectionAddr::TcpTls { .. } => Some(TlsMode::Secure),
        _ => None,
    }
}

/// The Sentinel client: the Sentinels' addresses, credentials and TLS from their URLs; the
/// primary's credentials from `access`, its TLS mode following the Sentinels' scheme.
fn sentinel_client(
    sentinels: &[String],
    master: &str,
    access: &RedisAccess,
) -> redis::RedisResult<redis::sentinel::SentinelClient> {
    let infos = sentinels
        .iter()
        .map(|s| s.as_str().into_connection_info())
        .collect::<Result<Vec<_>, _>>()?;
    let invalid =
        |what: &'static str| redis::RedisError::from((redis::ErrorKind::InvalidClientConfig, what));
    let first = infos.first().ok_or_else(|| invalid("no Sentinel URL"))?;
    let (user, password, mode) = (
        first.redis_settings().username(),
        first.redis_settings().password(),
        tls_mode(first),
    );
    for i in &infos {
        if i.redis_settings().username() != user || i.redis_settings().password() != password {
            return Err(invalid(
                "every Sentinel URL must carry the same user and password",
            ));
        }
        if tls_mode(i) != mode {
            return Err(invalid(
                "every Sentinel URL must use the same scheme (redis:// or rediss://)",
            ));
        }
    }
    if access.certificates.is_some() && mode.is_none() {
        return Err(invalid(
            "--redis-ca-file/--redis-client-cert given, but the Sentinel URLs are not rediss://",
        ));
    }
    let mut b = SentinelClientBuilder::new(
        infos.iter().map(|i| i.addr().clone()),
        master,
        SentinelServerType::Master,
    )?
    .set_client_to_sentinel_tcp_settings(tcp_settings())
    .set_client_to_redis_tcp_settings(tcp_settings());
    if let Some(u) = user {
        b = b.set_client_to_sentinel_username(u);
    }
    if let Some(p) = password {
        b = b.set_client_to_sentinel_password(p);
    }
    if let Some(u) = &access.username {
        b = b.set_client_to_redis_username(u);
    }
    if let Some(p) = &access.password {
        b = b.set_client_to_redis_password(p.expose());
    }
    if let Some(mode) = mode {
        b = b.set_client_to_redis_tls_mode(mode);
        if let Some(certs) = &access.certificates {
            b = b
                .set_client_to_sentinel_certificates(certs.clone())
                .set_client_to_redis_certificates(certs.clone());
        }
    }
    b.build()
}

/// One Redis: several multiplexed connections used round-robin.
///
/// redis-rs's `ConnectionManager` reconnects after I/O errors only. Two failures that are not
/// I/O errors replace a connection by a fresh one:
/// - a reconnection that failed authentication (a wrong or rotated password, an ACL user not
///   there yet), which it would otherwise answer forever: the sidecar recovers as soon as Redis
///   accepts its credentials, and shows the failure meanwhile;
/// - a command with no answer within [`stall_limit`]: a stalled Redis (stopped, swapping, stuck
///   in a slow script) or a peer gone without a reset (a partition) sends no error, and the
///   kernel would keep the connection for many minutes. Every command queued behind the one that
///   got no answer would be run by Redis when it wakes, for callers long answered: the stale
///   connection is closed instead, so nothing more is written to it. What Redis had already
///   received on it still runs (closing a socket does not take back what the peer's kernel
///   holds). Its replacement cannot be made while Redis is stalled (the kernel accepts the TCP
///   connection, but Redis does not answer `CLIENT SETINFO`), so no command is sent meanwhile.
///
/// Each command runs in a task of its own, so its bound and the replacement also happen when
/// its caller gave up sooner (`--redis-timeout-ms`).
pub struct SingleNode {
    client: redis::Client,
    config: ConnectionManagerConfig,
    connections: Vec<Mutex<Slot>>,
    next: AtomicUsize,
    /// How long a command may wait for its answer before its connection is replaced.
    stall_limit: Duration,
    /// Names the node in logs and errors (redacted).
    shown: String,
}

/// One of a node's connections, and how many times it was replaced (so that of several
/// commands that fail on one connection, only the first replaces it).
struct Slot {
    generation: u64,
    connection: ConnectionManager,
}

impl SingleNode {
    async fn query(self: &Arc<Self>, cmd: Cmd) -> redis::RedisResult<Value> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.connections.len();
        let (generation, mut c) = {
            let slot = self.connections[i].lock().expect("not poisoned");
            (slot.generation, slot.connection.clone())
        };
        let this = self.clone();
        tokio::spawn(async move {
            let result = tokio::time::timeout(this.stall_limit, cmd.query_async(&mut c)).await;
            drop(c);
            match result {
                Ok(Err(e)) if e.kind() == redis::ErrorKind::AuthenticationFailed => {
                    this.replace(i, generation, &e.to_string());
                    Err(e)
                }
                Ok(result) => result,
                Err(_) => {
                    let why = format!("no answer within {} ms", this.stall_limit.as_millis());
                    this.replace(i, generation, &why);
                    Err(redis::RedisError::from(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("{}: {why}", this.shown),
                    )))
                }
            }
        })
        .await
        .map_err(|e| {
            redis::RedisError::from(std::io::Error::other(format!("redis command task: {e}")))
        })?
    }

    /// Replaces connection `i` by a fresh one (made on its first use), unless it was replaced
    /// since `generation`. The old one closes once the commands still waiting on it end.
    fn replace(&self, i: usize, generation: u64, why: &str) {
        let mut slot = self.connections[i].lock().expect("not poisoned");
        if slot.generation != generation {
            return;
        }
        match ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone()) {
            Ok(fresh) => {
                tracing::warn!(redis = %self.shown, connection = i, "{why}; replacing the connection");
                slot.connection = fresh;
                slot.generation += 1;
            }
            Err(e) => tracing::warn!(redis = %self.shown, "cannot replace a connection: {e}"),
        }
    }
}

pub enum Connection {
    Single(Arc<SingleNode>),
    Sentinel(Arc<SentinelPrimary>),
    Cluster(ClusterConnection),
}

impl Connection {
    /// For one Redis (`--redis`) that did not answer within `within`: whether it refuses
    /// connections (nothing listens there: a wrong port, Redis not started), said so rather
    /// than as a timeout. One TCP connection attempt; `None` for anything else.
    pub async fn refused(&self, within: Duration) -> Option<String> {
        let Connection::Single(node) = self else {
            return None;
        };
        let (host, port) = match node.client.get_connection_info().addr() {
            redis::ConnectionAddr::Tcp(host, port) => (host.clone(), *port),
            redis::ConnectionAddr::TcpTls { host, port, .. } => (host.clone(), *port),
            _ => return None,
        };
        let attempt = tokio::net::TcpStream::connect((host.as_str(), port));
        match tokio::time::timeout(within, attempt).await {
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                Some(format!("{}: connection refused", node.shown))
            }
            _ => None,
        }
    }

    /// A connection to one Redis. Connects lazily: this succeeds while Redis is down.
    pub fn single(url: &str, connections: usize, timeout_ms: u64) -> Result<Self, StoreError> {
        Self::single_with(url, &RedisAccess::default(), connections, timeout_ms)
    }

    /// [`Connection::single`] with credentials and TLS material.
    pub fn single_with(
        url: &str,
        access: &RedisAccess,
        connections: usize,
        timeout_ms: u64,
    ) -> Result<Self, StoreError> {
        let shown = redacted_url(url);
        let info = access.apply_credentials(connection_info("--redis", url)?);
        access.check_tls_used("--redis", &[url.to_string()], is_tls(&info))?;
        let client = match &access.certificates {
            Some(certs) => redis::Client::build_with_tls(info, certs.clone()),
            None => redis::Client::open(info),
        }
        .map_err(|e| StoreError::Config(format!("--redis {shown}: {e}")))?;
        // One retry: a (re)connection that fails (refused, TLS handshake, authentication)
        // fails the commands waiting on it with its real cause within about 100 ms, instead of
        // leaving them to time out through seconds of backoff; the next command starts a new
        // attempt (see SingleNode). No response timeout of redis-rs: SingleNode bounds each
        // command itself, and replaces the connection when that bound passes.
        let stall = stall_limit(timeout_ms);
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(stall))
            .set_response_timeout(None)
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let connections = (0..connections.max(1))
            .map(|_| {
                ConnectionManager::new_lazy_with_config(client.clone(), config.clone()).map(
                    |connection| {
                        Mutex::new(Slot {
                            generation: 0,
                            connection,
                        })
                    },
                )
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| StoreError::Config(format!("--redis {shown}: {e}")))?;
        Ok(Connection::Single(Arc::new(SingleNode {
            client,
            config,
            connections,
            next: AtomicUsize::new(0),
            stall_limit: stall,
            shown,
        })))
    }

    /// A connection to the primary that the Sentinels at `sentinels` name `master`. Connects lazily:
    /// this succeeds while the Sentinels and Redis are down.
    pub fn sentinel(
        sentinels: &[String],
        master: &str,
        timeout_ms: u64,
    ) -> Result<Self, StoreError> {
        Self::sentinel_with(sentinels, master, &RedisAccess::default(), timeout_ms)
    }

    /// [`Connection::sentinel`] with the data nodes' credentials and TLS material. The Sentinels'
    /// own credentials come from their URLs (the same in every URL); `rediss://` Sentinel URLs
    /// mean TLS to the Sentinels and to the primary they name.
    pub fn sentinel_with(
        sentinels: &[String],
        master: &str,
        access: &RedisAccess,
        timeout_ms: u64,
    ) -> Result<Self, StoreError> {
        let what = format!(
            "--redis-sentinel {} (--sentinel-master {master})",
            redacted_urls(sentinels)
        );
        let client = sentinel_client(sentinels, master, access)
            .map_err(|e| StoreError::Config(format!("{what}: {e}")))?;
        let lookup_timeout = stall_limit(timeout_ms);
        let config = AsyncConnectionConfig::new().set_connection_timeout(Some(lookup_timeout));
        Ok(Connection::Sentinel(Arc::new(SentinelPrimary {
            sentinel: tokio::sync::Mutex::new(client),
            state: Mutex::new(LookupState::default()),
            lookups: AtomicU64::new(0),
            master: master.to_string(),
            watch: tokio::sync::Mutex::new(None),
            what,
            config,
            lookup_timeout,
            command_timeout: Duration::from_millis(timeout_ms),
        })))
    }

    /// A connection to a Redis Cluster found through `seeds`. Connects in the background.
    pub fn cluster(seeds: &[String], timeout_ms: u64) -> Result<Self, StoreError> {
        Self::cluster_with(seeds, &RedisAccess::default(), timeout_ms)
    }

    /// [`Connection::cluster`] with credentials and TLS material.
    pub fn cluster_with(
        seeds: &[String],
        access: &RedisAccess,
        timeout_ms: u64,
    ) -> Result<Self, StoreError> {
        let infos = seeds
            .iter()
            .map(|s| connection_info("--redis-cluster", s).map(|i| access.apply_credentials(i)))
            .collect::<Result<Vec<_>, _>>()?;
        let tls = infos.first().is_some_and(is_tls);
        access.check_tls_used("--redis-cluster", seeds, tls)?;
        // No retries inside the client: a script call whose connection dropped after Redis ran
        // it would be sent again and charged twice. A failed call is answered as such, and a
        // MOVED is followed by the store (slot map refreshed, work regrouped). The client still
        // reconnects after a dropped connection.
        let mut builder = ClusterClientBuilder::new(infos)
            .retries(0)
            .tcp_settings(tcp_settings());
        if let Some(certs) = access.certificates.clone() {
            builder = builder.certs(certs);
        }
        let client = builder.build().map_err(|e| {
            StoreError::Config(format!("--redis-cluster {}: {e}", redacted_urls(seeds)))
        })?;
        let config = ClusterConfig::new().set_connection_timeout(stall_limit(timeout_ms));
        let connection = client.get_pending_async_connection_with_config(config);
        Ok(Connection::Cluster(connection))
    }

    /// Sends one command to the node of its key (or any node for keyless commands).
    pub async fn query(&self, cmd: Cmd) -> redis::RedisResult<Value> {
        match self {
            Connection::Single(node) => node.query(cmd).await,
            Connection::Sentinel(s) => s.query(cmd).await,
            Connection::Cluster(c) => cmd.query_async(&mut c.clone()).await,
        }
    }

    /// Sends one command to every primary (the one node when single).
    pub async fn query_all_primaries(
        &self,
        cmd: Cmd,
        policy: Option<ResponsePolicy>,
    ) -> redis::RedisResult<Value> {
        match self {
            Connection::Single(_) | Connection::Sentinel(_) => self.query(cmd).await,
            Connection::Cluster(c) => {
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, policy));
                c.clone().route_command(cmd, routing).await
            }
        }
    }

    /// Under Sentinel, leaves a primary that Sentinel no longer names
    /// ([`SentinelPrimary::confirm`]); nothing for the other topologies.
    pub async fn confirm_primary(&self) {
        if let Connection::Sentinel(s) = self {
            s.confirm().await;
        }
    }

    /// Whether keys are spread over Cluster slots.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Connection::Cluster(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_urls_are_refused_without_their_password() {
        let e = Connection::single("redis://:hunter2@[::1", 1, 50)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--redis") && !e.contains("hunter2"), "{e}");
        let e = Connection::sentinel(&["bogus://:hunter2@h:1".into()], "m", 50)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("--redis-sentinel") && !e.contains("hunter2"),
            "{e}"
        );
    }

    #[test]
    fn tls_material_without_a_tls_url_is_refused() {
        let access = RedisAccess {
            certificates: Some(TlsCertificates {
                client_tls: None,
                root_cert: Some(Vec::new()),
            }),
            ..RedisAccess::default()
        };
        let e = Connection::single_with("redis://127.0.0.1:1", &access, 1, 50)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("rediss://") && e.contains("--redis-ca-file"),
            "{e}"
        );
    }

    #[test]
    fn the_flag_password_fills_in_only_where_the_url_has_none() {
        let access = RedisAccess {
            username: Some("app".into()),
            password: Some(Secret::new("from-flag")),
            ..RedisAccess::default()
        };
        let info = |url: &str| access.apply_credentials(url.into_connection_info().unwrap());
        let plain = info("redis://127.0.0.1:1");
        assert_eq!(plain.redis_settings().password(), Some("from-flag"));
        assert_eq!(plain.redis_settings().username(), Some("app"));
        let own = info("redis://:from-url@127.0.0.1:1");
        assert_eq!(own.redis_settings().password(), Some("from-url"));
        assert_eq!(own.redis_settings().username(), None);
    }
}
