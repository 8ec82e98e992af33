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
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, FutureExt, Shared};

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
    /// Redis ran the script and it failed in a way a retry cannot cure.
    #[error("bucket script failed: {0}")]
    Script(String),
    #[error("bucket script failed: unexpected script reply: {0}")]
    Reply(String),
}

impl StoreError {
    /// The same call would fail the same way again: not an outage (answered 500, not 503).
    pub fn is_deterministic(&self) -> bool {
        matches!(self, StoreError::Script(_) | StoreError::Reply(_))
    }
}

/// Whether an error is the script failing on its data or arguments (`WRONGTYPE`: another type of
/// value where a bucket or attempt record should be; `ERR invalid decision`, `ERR usage`,
/// `ERR attempt_ttl_ms`: the script refused its arguments; `ERR user_script...`: a Lua error)
/// rather than Redis being unreachable, busy, out of memory or failing over.
fn is_script_failure(e: &RedisError) -> bool {
    let detail = e.detail().unwrap_or_default();
    e.code() == Some("WRONGTYPE")
        || (e.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
            && [
                "invalid decision",
                "usage:",
                "attempt_ttl_ms",
                "user_script",
            ]
            .iter()
            .any(|m| detail.contains(m)))
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
/// connection error, a READONLY answer (a demoted primary is a replica now), or a command that got
/// no answer within `--redis-timeout-ms` (a hung or partitioned primary never sends an error).
/// Each command runs in a task of its own, so a caller that goes away (Envoy's callout timeout
/// makes hyper drop the handler) neither cancels it nor counts as a timeout. The next call asks
/// Sentinel again, so after a failover decisions reach the new primary without a restart; the
/// call that met the error answers 503 like any other Redis error.
///
/// Lookups are single-flight: all callers without a primary share the one lookup in flight, and
/// after a failed lookup callers get its error at once for [`LOOKUP_BACKOFF`] before the next
/// lookup starts, so a Sentinel outage neither piles up tasks nor floods the Sentinels.
struct SentinelPrimary {
    /// Asked one lookup at a time (it caches its connections to the Sentinels).
    sentinel: tokio::sync::Mutex<SentinelClient>,
    state: Mutex<LookupState>,
    /// Lookups that found a primary so far (each connection's generation).
    lookups: AtomicU64,
    /// Names what is being looked up, in errors and logs.
    what: String,
    config: AsyncConnectionConfig,
    /// Upper bound of one lookup (Sentinel, the primary's ROLE, the connection to it).
    lookup_timeout: Duration,
    /// Upper bound of one command on the primary (`--redis-timeout-ms`).
    command_timeout: Duration,
}

/// How long callers get a failed lookup's error before a new lookup is started.
const LOOKUP_BACKOFF: Duration = Duration::from_millis(100);

/// A lookup's result as every waiting caller gets it (a `RedisError` is not `Clone`).
type SharedLookup = Shared<BoxFuture<'static, Result<Arc<Primary>, String>>>;

#[derive(Default)]
struct LookupState {
    current: Option<Arc<Primary>>,
    in_flight: Option<SharedLookup>,
    /// When the last lookup failed, and why.
    failed: Option<(Instant, String)>,
}

struct Primary {
    connection: MultiplexedConnection,
    address: String,
    /// Which lookup made this connection, so a late failure forgets only its own.
    generation: u64,
}

fn lookup_error(message: String) -> RedisError {
    RedisError::from(std::io::Error::other(message))
}

impl SentinelPrimary {
    /// The current primary, or the result of the one lookup in flight (started here if none is
    /// and the last one did not fail within [`LOOKUP_BACKOFF`]). The lookup runs in its own task:
    /// a caller that gives up (timeout) does not cancel it, the others still get its result.
    async fn primary(self: &Arc<Self>) -> redis::RedisResult<Arc<Primary>> {
        let lookup = {
            let mut state = self.state.lock().expect("not poisoned");
            if let Some(p) = &state.current {
                return Ok(p.clone());
            }
            match (&state.in_flight, &state.failed) {
                (Some(lookup), _) => lookup.clone(),
                (None, Some((at, why))) if at.elapsed() < LOOKUP_BACKOFF => {
                    return Err(lookup_error(why.clone()));
                }
                (None, _) => {
                    let this = self.clone();
                    let task = tokio::spawn(async move { this.look_up().await });
                    let lookup = async move {
                        task.await
                            .unwrap_or_else(|e| Err(format!("Sentinel lookup task: {e}")))
                    }
                    .boxed()
                    .shared();
                    state.in_flight = Some(lookup.clone());
                    lookup
                }
            }
        };
        lookup.await.map_err(lookup_error)
    }

    /// One lookup; records its result in `state` and ends the flight.
    async fn look_up(&self) -> Result<Arc<Primary>, String> {
        let result = self.ask_sentinel().await;
        let mut state = self.state.lock().expect("not poisoned");
        state.in_flight = None;
        match &result {
            Ok(p) => {
                tracing::info!(primary = %p.address, "{}: connected to the primary", self.what);
                state.current = Some(p.clone());
                state.failed = None;
            }
            Err(e) => state.failed = Some((Instant::now(), e.clone())),
        }
        result
    }

    async fn ask_sentinel(&self) -> Result<Arc<Primary>, String> {
        let mut sentinel = self.sentinel.lock().await;
        let found = tokio::time::timeout(self.lookup_timeout, async {
            let client = sentinel.async_get_client().await?;
            let address = client.get_connection_info().addr().to_string();
            let connection = client
                .get_multiplexed_async_connection_with_config(&self.config)
                .await?;
            Ok::<_, RedisError>((address, connection))
        })
        .await;
        match found {
            Ok(Ok((address, connection))) => Ok(Arc::new(Primary {
                connection,
                address,
                generation: self.lookups.fetch_add(1, Ordering::Relaxed) + 1,
            })),
            Ok(Err(e)) => Err(format!("{}: {e}", self.what)),
            Err(_) => Err(format!(
                "{}: no answer within {} ms",
                self.what,
                self.lookup_timeout.as_millis()
            )),
        }
    }

    /// Forgets the connection of `generation` (if still current): the next call asks Sentinel.
    fn forget(&self, generation: u64, why: &str) {
        let mut state = self.state.lock().expect("not poisoned");
        if let Some(p) = state
            .current
            .as_ref()
            .filter(|p| p.generation == generation)
        {
            tracing::warn!(primary = %p.address, "{}: {why}; asking Sentinel again", self.what);
            state.current = None;
        }
    }

    async fn query(self: &Arc<Self>, cmd: Cmd) -> redis::RedisResult<Value> {
        let primary = self.primary().await?;
        let this = self.clone();
        tokio::spawn(async move {
            let mut connection = primary.connection.clone();
            match tokio::time::timeout(this.command_timeout, cmd.query_async(&mut connection)).await
            {
                Ok(Err(e)) if moves_the_primary(&e) => {
                    this.forget(primary.generation, &e.to_string());
                    Err(e)
                }
                Ok(result) => result,
                Err(_) => {
                    let why = format!("no answer within {} ms", this.command_timeout.as_millis());
                    this.forget(primary.generation, &why);
                    Err(lookup_error(format!("{}: {why}", primary.address)))
                }
            }
        })
        .await
        .map_err(|e| lookup_error(format!("Sentinel command task: {e}")))?
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
                state: Mutex::new(LookupState::default()),
                lookups: AtomicU64::new(0),
                what,
                config,
                lookup_timeout,
                command_timeout: Duration::from_millis(timeout_ms),
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
    async fn query(&self, cmd: Cmd) -> redis::RedisResult<Value> {
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
            Connection::Single { .. } | Connection::Sentinel(_) => self.query(cmd).await,
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
            Ok(Err(e)) if is_script_failure(&e) => StoreError::Script(e.to_string()),
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
                match self.query(evalsha).await {
                    Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                        // The node lost its script cache (restart, failover): EVAL caches it again.
                        // Built only here: the hot path never copies the script.
                        self.metrics.script_loads.inc();
                        tracing::info!("NOSCRIPT from redis, reloading the bucket script by EVAL");
                        self.query(self.script_cmd("EVAL", SCRIPT, mode, calls))
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
    fn script_failures_are_told_from_outages() {
        let ext = |code: &str, detail: &str| {
            redis::make_extension_error(code.to_string(), Some(detail.to_string()))
        };
        assert!(is_script_failure(&ext(
            "WRONGTYPE",
            "Operation against a key holding the wrong kind of value"
        )));
        let err = |detail: &'static str| {
            RedisError::from((
                ErrorKind::Server(ServerErrorKind::ResponseError),
                "ERR",
                detail.to_string(),
            ))
        };
        assert!(is_script_failure(&err(
            "invalid decision 1: cost must be a number > 0 script: ..."
        )));
        assert!(!is_script_failure(&err("max number of clients reached")));
        assert!(!is_script_failure(&ext("OOM", "command not allowed")));
        assert!(!is_script_failure(&ext(
            "BUSY",
            "Redis is busy running a script"
        )));
        let refused = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(!is_script_failure(&refused));
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
