//! Where buckets live: the [`BucketStore`] trait the decision logic talks to, and its Redis
//! implementation (one node, a primary found through Sentinel, or a Cluster) that runs
//! `lua/token_bucket.lua`.
//!
//! The script is embedded from `lua/` and called by EVALSHA; a NOSCRIPT answer (a restarted node,
//! a failover, a new Cluster primary) is healed by an EVAL of the same call, which also caches the
//! script on that node. No NOSCRIPT ever reaches a caller. Every call is bounded by
//! `--redis-timeout-ms`; a script call whose outcome is unknown (timeout) is never retried here.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ratelimit_wire::Reason;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::cluster::{ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{AsyncConnectionConfig, Cmd, ErrorKind, RedisError, ServerErrorKind, Value};

use crate::metrics::Metrics;

/// The bucket script, one source of truth in `lua/`.
pub const SCRIPT: &str = include_str!("../../lua/token_bucket.lua");

/// SHA1 of [`SCRIPT`], as EVALSHA wants it.
pub fn script_sha1() -> String {
    sha1_smol::Sha1::from(SCRIPT).digest().to_string()
}

/// One decision as the script takes it: keys already built, attempt `""` when there is none.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketCall {
    /// `<prefix>{<key>}`
    pub bucket_key: String,
    /// `<prefix>{<key>}:a:<attempt>` (or `<prefix>{<key>}:a:` without attempt)
    pub attempt_key: String,
    pub capacity: f64,
    pub refill_per_sec: f64,
    pub cost: f64,
    pub attempt: String,
}

/// The script's answer for one decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The bucket held `cost` tokens (it may still be uncharged: all-or-nothing).
    pub allowed: bool,
    pub remaining: u64,
    pub retry_after_ms: u64,
    pub reset_ms: u64,
    pub reason: Reason,
    /// This attempt deducted `cost` from the bucket.
    pub charged: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("redis unavailable: no answer within {timeout_ms} ms")]
    Timeout { timeout_ms: u64 },
    #[error("redis unavailable: {0}")]
    Redis(String),
    #[error("redis unavailable: unexpected script reply: {0}")]
    Reply(String),
}

/// Where buckets live. `apply` charges all calls all-or-nothing (they must share one Cluster
/// slot); `refund` gives back what the calls' attempts charged (idempotent).
pub trait BucketStore: Send + Sync + 'static {
    fn apply(
        &self,
        calls: &[BucketCall],
    ) -> impl Future<Output = Result<Vec<Outcome>, StoreError>> + Send;
    fn refund(
        &self,
        calls: &[BucketCall],
    ) -> impl Future<Output = Result<Vec<Outcome>, StoreError>> + Send;
    /// Whether keys are spread over Cluster slots, so a request must be split by slot.
    fn is_cluster(&self) -> bool;
}

/// What `/readyz` reports.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Readiness {
    pub redis_ok: bool,
    pub script_loaded: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// One entry per node that answered `CONFIG GET maxmemory-policy`.
    pub maxmemory_policy: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

/// The warning for a `maxmemory-policy` that can evict buckets, if it can.
pub fn eviction_warning(policies: &[String]) -> Option<String> {
    let evicting: Vec<&str> = policies
        .iter()
        .map(String::as_str)
        .filter(|p| *p != "noeviction")
        .collect();
    if evicting.is_empty() {
        return None;
    }
    Some(format!(
        "maxmemory-policy is {} (not noeviction): Redis may evict buckets under memory pressure, \
         which hands out budget early; set maxmemory-policy noeviction",
        evicting.join(",")
    ))
}

enum Connection {
    Single {
        connections: Vec<ConnectionManager>,
        next: AtomicUsize,
    },
    Sentinel(Arc<SentinelPrimary>),
    Cluster(ClusterConnection),
}

/// The primary that Sentinel names, and one multiplexed connection to it.
///
/// The connection is made on first use (so the sidecar starts while Sentinel is down) and
/// forgotten when it fails in a way that may mean "this is no longer the primary": an I/O or
/// connection error, a READONLY answer (a demoted primary is a replica now), or a call that did
/// not finish in time (a hung or partitioned primary never sends an error). The next call asks
/// Sentinel again, so after a failover decisions reach the new primary without a restart; the
/// call that met the error answers 503 like any other Redis error.
struct SentinelPrimary {
    /// Asked one lookup at a time (it caches its connections to the Sentinels).
    sentinel: tokio::sync::Mutex<SentinelClient>,
    current: Mutex<Option<Primary>>,
    /// Lookups that found a primary so far (each connection's generation).
    lookups: AtomicU64,
    /// Names what is being looked up, in errors and logs.
    what: String,
    config: AsyncConnectionConfig,
    /// Upper bound of one lookup (Sentinel, the primary's ROLE, the connection to it).
    lookup_timeout: Duration,
}

#[derive(Clone)]
struct Primary {
    connection: MultiplexedConnection,
    address: String,
    /// Which lookup made this connection, so a late failure forgets only its own.
    generation: u64,
}

impl SentinelPrimary {
    /// The current primary, asking Sentinel when there is none. The lookup runs in its own
    /// task: a caller that gives up (timeout) does not cancel it, the next caller uses it.
    async fn primary(self: &Arc<Self>) -> redis::RedisResult<Primary> {
        if let Some(p) = self.current.lock().expect("not poisoned").clone() {
            return Ok(p);
        }
        let this = self.clone();
        tokio::spawn(async move { this.look_up().await })
            .await
            .map_err(|e| RedisError::from(std::io::Error::other(e.to_string())))?
    }

    async fn look_up(&self) -> redis::RedisResult<Primary> {
        let mut sentinel = self.sentinel.lock().await;
        if let Some(p) = self.current.lock().expect("not poisoned").clone() {
            return Ok(p); // another caller looked it up meanwhile
        }
        let found = tokio::time::timeout(self.lookup_timeout, async {
            let client = sentinel.async_get_client().await?;
            let address = client.get_connection_info().addr().to_string();
            let connection = client
                .get_multiplexed_async_connection_with_config(&self.config)
                .await?;
            Ok::<_, RedisError>((address, connection))
        })
        .await;
        let (address, connection) = match found {
            Ok(Ok(found)) => found,
            Ok(Err(e)) => {
                return Err(RedisError::from(std::io::Error::other(format!(
                    "{}: {e}",
                    self.what
                ))))
            }
            Err(_) => {
                return Err(RedisError::from(std::io::Error::other(format!(
                    "{}: no answer within {} ms",
                    self.what,
                    self.lookup_timeout.as_millis()
                ))))
            }
        };
        let generation = self.lookups.fetch_add(1, Ordering::Relaxed) + 1;
        let mut current = self.current.lock().expect("not poisoned");
        tracing::info!(primary = %address, "{}: connected to the primary", self.what);
        let p = Primary {
            connection,
            address,
            generation,
        };
        *current = Some(p.clone());
        Ok(p)
    }

    /// Forgets the connection of `generation` (if still current): the next call asks Sentinel.
    fn forget(&self, generation: u64, why: &str) {
        let mut current = self.current.lock().expect("not poisoned");
        if let Some(p) = current.as_ref().filter(|p| p.generation == generation) {
            tracing::warn!(primary = %p.address, "{}: {why}; asking Sentinel again", self.what);
            *current = None;
        }
    }

    async fn query(self: &Arc<Self>, cmd: &Cmd) -> redis::RedisResult<Value> {
        let mut primary = self.primary().await?;
        // Dropped unfinished (the caller timed out): the primary may be hung, forget it.
        let mut pending = ForgetUnlessDone {
            sentinel: self,
            generation: primary.generation,
            done: false,
        };
        let result = cmd.query_async(&mut primary.connection).await;
        pending.done = true;
        if let Err(e) = &result {
            if moves_the_primary(e) {
                self.forget(primary.generation, &e.to_string());
            }
        }
        result
    }
}

struct ForgetUnlessDone<'a> {
    sentinel: &'a SentinelPrimary,
    generation: u64,
    done: bool,
}

impl Drop for ForgetUnlessDone<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.sentinel
                .forget(self.generation, "no answer within the timeout");
        }
    }
}

/// Whether an error may mean the connection no longer reaches the primary.
fn moves_the_primary(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
        || e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.is_unrecoverable_error()
}

/// The Redis store: one node (several multiplexed, auto-reconnecting connections used
/// round-robin), the primary Sentinel names (one multiplexed connection, looked up again after
/// a failover) or a Cluster (one cluster connection, MOVED/ASK followed by the client).
pub struct RedisStore {
    connection: Connection,
    sha1: String,
    timeout: Duration,
    attempt_ttl_ms: u64,
    metrics: Arc<Metrics>,
}

impl RedisStore {
    /// A store on one Redis. Connects lazily: this succeeds while Redis is down.
    pub fn single(
        url: &str,
        connections: usize,
        timeout_ms: u64,
        attempt_ttl_ms: u64,
        metrics: Arc<Metrics>,
    ) -> Result<Self, StoreError> {
        let client = redis::Client::open(url)
            .map_err(|e| StoreError::Redis(format!("--redis {url}: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(timeout_ms.max(1000))))
            .set_max_delay(Duration::from_millis(500));
        let connections = (0..connections.max(1))
            .map(|_| ConnectionManager::new_lazy_with_config(client.clone(), config.clone()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| StoreError::Redis(format!("--redis {url}: {e}")))?;
        Ok(Self::new(
            Connection::Single {
                connections,
                next: AtomicUsize::new(0),
            },
            timeout_ms,
            attempt_ttl_ms,
            metrics,
        ))
    }

    /// A store on the primary that the Sentinels at `sentinels` name `master`. Connects lazily:
    /// this succeeds while the Sentinels and Redis are down.
    pub fn sentinel(
        sentinels: &[String],
        master: &str,
        timeout_ms: u64,
        attempt_ttl_ms: u64,
        metrics: Arc<Metrics>,
    ) -> Result<Self, StoreError> {
        let what = format!(
            "--redis-sentinel {} (--sentinel-master {master})",
            sentinels.join(",")
        );
        let client = SentinelClient::build(
            sentinels.to_vec(),
            master.to_string(),
            None,
            SentinelServerType::Master,
        )
        .map_err(|e| StoreError::Redis(format!("{what}: {e}")))?;
        let lookup_timeout = Duration::from_millis(timeout_ms.max(1000));
        let config = AsyncConnectionConfig::new().set_connection_timeout(Some(lookup_timeout));
        Ok(Self::new(
            Connection::Sentinel(Arc::new(SentinelPrimary {
                sentinel: tokio::sync::Mutex::new(client),
                current: Mutex::new(None),
                lookups: AtomicU64::new(0),
                what,
                config,
                lookup_timeout,
            })),
            timeout_ms,
            attempt_ttl_ms,
            metrics,
        ))
    }

    /// A store on a Redis Cluster found through `seeds`. Connects in the background.
    pub fn cluster(
        seeds: &[String],
        timeout_ms: u64,
        attempt_ttl_ms: u64,
        metrics: Arc<Metrics>,
    ) -> Result<Self, StoreError> {
        let client = ClusterClientBuilder::new(seeds.to_vec())
            .build()
            .map_err(|e| StoreError::Redis(format!("--redis-cluster {}: {e}", seeds.join(","))))?;
        let config = ClusterConfig::new()
            .set_connection_timeout(Duration::from_millis(timeout_ms.max(1000)));
        let connection = client.get_pending_async_connection_with_config(config);
        Ok(Self::new(
            Connection::Cluster(connection),
            timeout_ms,
            attempt_ttl_ms,
            metrics,
        ))
    }

    fn new(connection: Connection, timeout_ms: u64, attempt_ttl_ms: u64, m: Arc<Metrics>) -> Self {
        Self {
            connection,
            sha1: script_sha1(),
            timeout: Duration::from_millis(timeout_ms),
            attempt_ttl_ms,
            metrics: m,
        }
    }

    /// Sends one command to the node of its key (or any node for keyless commands).
    async fn query(&self, cmd: &Cmd) -> redis::RedisResult<Value> {
        match &self.connection {
            Connection::Single { connections, next } => {
                let i = next.fetch_add(1, Ordering::Relaxed) % connections.len();
                let mut c = connections[i].clone();
                cmd.query_async(&mut c).await
            }
            Connection::Sentinel(s) => s.query(cmd).await,
            Connection::Cluster(c) => cmd.query_async(&mut c.clone()).await,
        }
    }

    /// Sends one command to every primary (the one node when single).
    async fn query_all_primaries(
        &self,
        cmd: Cmd,
        policy: Option<ResponsePolicy>,
    ) -> redis::RedisResult<Value> {
        match &self.connection {
            Connection::Single { .. } | Connection::Sentinel(_) => self.query(&cmd).await,
            Connection::Cluster(c) => {
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, policy));
                c.clone().route_command(cmd, routing).await
            }
        }
    }

    async fn bounded<T>(
        &self,
        f: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        let result = match tokio::time::timeout(self.timeout, f).await {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => StoreError::Redis(e.to_string()),
            Err(_) => StoreError::Timeout {
                timeout_ms: self.timeout.as_millis() as u64,
            },
        };
        self.metrics.redis_errors.inc();
        Err(result)
    }

    /// `EVALSHA <sha1> ...` or `EVAL <script> ...` with the calls' keys and arguments.
    fn script_cmd(&self, command: &str, script: &str, mode: &str, calls: &[BucketCall]) -> Cmd {
        let mut c = redis::cmd(command);
        c.arg(script).arg(calls.len() * 2);
        for call in calls {
            c.arg(&call.bucket_key).arg(&call.attempt_key);
        }
        c.arg(mode).arg(self.attempt_ttl_ms);
        for call in calls {
            c.arg(call.capacity)
                .arg(call.refill_per_sec)
                .arg(call.cost)
                .arg(&call.attempt);
        }
        c
    }

    async fn run(&self, mode: &str, calls: &[BucketCall]) -> Result<Vec<Outcome>, StoreError> {
        let evalsha = self.script_cmd("EVALSHA", &self.sha1, mode, calls);
        let reply = self
            .bounded(async {
                match self.query(&evalsha).await {
                    Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                        // The node lost its script cache (restart, failover): EVAL caches it again.
                        // Built only here: the hot path never copies the script.
                        self.metrics.script_loads.inc();
                        tracing::info!("NOSCRIPT from redis, reloading the bucket script by EVAL");
                        self.query(&self.script_cmd("EVAL", SCRIPT, mode, calls))
                            .await
                    }
                    other => other,
                }
            })
            .await?;
        parse_outcomes(reply, calls.len())
    }

    /// Checks Redis, loads the script where it is missing, reads `maxmemory-policy`.
    pub async fn readiness(&self) -> Readiness {
        let mut r = Readiness::default();
        let mut exists = redis::cmd("SCRIPT");
        exists.arg("EXISTS").arg(&self.sha1);
        match self.bounded(self.query_all_primaries(exists, None)).await {
            Ok(v) => {
                r.redis_ok = true;
                let flags = integers(&v);
                r.script_loaded = !flags.is_empty() && flags.iter().all(|f| *f == 1);
            }
            Err(e) => {
                r.error = Some(e.to_string());
                return r;
            }
        }
        if !r.script_loaded {
            let mut load = redis::cmd("SCRIPT");
            load.arg("LOAD").arg(SCRIPT);
            match self
                .bounded(self.query_all_primaries(load, Some(ResponsePolicy::AllSucceeded)))
                .await
            {
                Ok(_) => {
                    self.metrics.script_loads.inc();
                    r.script_loaded = true;
                }
                Err(e) => r.error = Some(format!("SCRIPT LOAD: {e}")),
            }
        }
        let mut config = redis::cmd("CONFIG");
        config.arg("GET").arg("maxmemory-policy");
        match self.bounded(self.query_all_primaries(config, None)).await {
            Ok(v) => {
                let mut policies = Vec::new();
                let mut refused = None;
                maxmemory_policies(&v, &mut policies, &mut refused);
                r.maxmemory_policy = policies;
                r.warning = eviction_warning(&r.maxmemory_policy);
                if let Some(e) = refused {
                    r.warning.get_or_insert(format!(
                        "could not check maxmemory-policy (CONFIG GET refused: {e}); make sure it is noeviction"
                    ));
                }
            }
            Err(e) => {
                r.warning = Some(format!(
                    "could not check maxmemory-policy ({e}); make sure it is noeviction"
                ))
            }
        }
        r
    }
}

impl BucketStore for RedisStore {
    async fn apply(&self, calls: &[BucketCall]) -> Result<Vec<Outcome>, StoreError> {
        self.run("apply", calls).await
    }

    async fn refund(&self, calls: &[BucketCall]) -> Result<Vec<Outcome>, StoreError> {
        self.run("refund", calls).await
    }

    fn is_cluster(&self) -> bool {
        matches!(self.connection, Connection::Cluster(_))
    }
}

/// The script's flat reply, 6 integers per decision, as outcomes.
fn parse_outcomes(reply: Value, n: usize) -> Result<Vec<Outcome>, StoreError> {
    let bad = |what: &str| StoreError::Reply(what.to_string());
    let Value::Array(items) = reply else {
        return Err(bad(&format!("{reply:?}")));
    };
    if items.len() != n * 6 {
        return Err(bad(&format!("{} integers for {n} decisions", items.len())));
    }
    let ints = items
        .iter()
        .map(|v| match v {
            Value::Int(i) => u64::try_from(*i).map_err(|_| bad("negative integer")),
            other => Err(bad(&format!("{other:?}"))),
        })
        .collect::<Result<Vec<u64>, _>>()?;
    ints.chunks(6)
        .map(|c| {
            Ok(Outcome {
                allowed: c[0] == 1,
                remaining: c[1],
                retry_after_ms: c[2],
                reset_ms: c[3],
                reason: match c[4] {
                    0 => Reason::Ok,
                    1 => Reason::Insufficient,
                    2 => Reason::CostExceedsCapacity,
                    other => return Err(bad(&format!("reason code {other}"))),
                },
                charged: c[5] == 1,
            })
        })
        .collect()
}

/// Every integer in a reply, however nested (SCRIPT EXISTS from one or many nodes).
fn integers(v: &Value) -> Vec<i64> {
    match v {
        Value::Int(i) => vec![*i],
        Value::Boolean(b) => vec![i64::from(*b)],
        Value::Array(items) | Value::Set(items) => items.iter().flat_map(integers).collect(),
        Value::Map(pairs) => pairs.iter().flat_map(|(_, v)| integers(v)).collect(),
        _ => vec![-1],
    }
}

/// The `maxmemory-policy` values in a `CONFIG GET` reply from one or many nodes.
fn maxmemory_policies(v: &Value, out: &mut Vec<String>, refused: &mut Option<String>) {
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    match v {
        Value::Array(items) if items.len() == 2 && text(&items[0]).is_some() => {
            if let Some(policy) = text(&items[1]) {
                out.push(policy);
            }
        }
        Value::Array(items) if items.is_empty() => {
            *refused = Some("empty reply".into());
        }
        Value::Map(pairs) => {
            for (k, v) in pairs {
                if text(k).as_deref() == Some("maxmemory-policy") {
                    if let Some(policy) = text(v) {
                        out.push(policy);
                    }
                } else {
                    maxmemory_policies(v, out, refused);
                }
            }
        }
        Value::ServerError(e) => *refused = Some(format!("{e:?}")),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha1_is_computed_from_the_embedded_script() {
        let sha = script_sha1();
        assert_eq!(sha.len(), 40);
        assert!(SCRIPT.contains("redis.call('TIME')"));
    }

    #[test]
    fn outcomes_parse_and_odd_replies_are_errors() {
        let v = Value::Array([1, 99, 0, 100, 0, 1].map(Value::Int).to_vec());
        let o = parse_outcomes(v, 1).unwrap();
        assert!(o[0].allowed && o[0].charged);
        assert_eq!((o[0].remaining, o[0].reset_ms), (99, 100));
        assert!(parse_outcomes(Value::Array(vec![Value::Int(1)]), 1).is_err());
        assert!(parse_outcomes(Value::Nil, 1).is_err());
        let bad_reason = Value::Array([0, 0, 0, 0, 7, 0].map(Value::Int).to_vec());
        assert!(parse_outcomes(bad_reason, 1).is_err());
    }

    #[test]
    fn readonly_and_broken_connections_send_the_sentinel_store_back_to_sentinel() {
        let readonly = RedisError::from((
            ErrorKind::Server(ServerErrorKind::ReadOnly),
            "You can't write against a read only replica.",
        ));
        assert!(moves_the_primary(&readonly));
        let refused = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(moves_the_primary(&refused));
        let noscript = RedisError::from((ErrorKind::Server(ServerErrorKind::NoScript), "NOSCRIPT"));
        assert!(!moves_the_primary(&noscript));
    }

    #[test]
    fn policies_that_evict_are_warned_about() {
        assert_eq!(eviction_warning(&["noeviction".into()]), None);
        let w = eviction_warning(&["noeviction".into(), "allkeys-lru".into()]).unwrap();
        assert!(w.contains("allkeys-lru"), "{w}");
        assert!(eviction_warning(&["volatile-ttl".into()]).is_some());
    }

    #[test]
    fn policies_are_read_from_one_node_or_many() {
        let s = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let one = Value::Array(vec![s("maxmemory-policy"), s("allkeys-lru")]);
        let mut out = Vec::new();
        let mut refused = None;
        maxmemory_policies(&one, &mut out, &mut refused);
        let many = Value::Map(vec![(s("127.0.0.1:7000"), one.clone()), (s("n2"), one)]);
        maxmemory_policies(&many, &mut out, &mut refused);
        assert_eq!(out, vec!["allkeys-lru"; 3]);
        assert!(refused.is_none());
    }
}
