//! The Redis store: the bucket script's calls over a [`Connection`], batched per node
//! ([`super::batch`]), and the readiness check.
//!
//! On a Cluster the work is grouped by the node that serves each bucket's slot (from `CLUSTER
//! SLOTS`, refreshed every few seconds and after a MOVED): one script call per node decides keys
//! of many slots (the script is flagged `allow-cross-slot-keys`). If the map is stale the call
//! fails before writing anything (`MOVED`, or the script's read of a key this node does not
//! serve), the map is refreshed, and the caller may regroup and retry. Until the map is known,
//! work is grouped by slot.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use ratelimit_wire::Reason;
use redis::cluster_routing::ResponsePolicy;
use redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};

use super::batch::Batcher;
use super::connection::{stall_limit, Connection};
use super::{
    eviction_warning, is_script_failure, script_sha1, Bucket, BucketStore, Group, NodeId, Outcome,
    Readiness, RequestOutcome, Status, StoreError, Work, SCRIPT, SHARE_MARGIN_MS,
};
use crate::keys::cluster_slot;
use crate::metrics::Metrics;

/// How the store calls Redis.
#[derive(Debug, Clone, Copy)]
pub struct StoreOptions {
    /// Upper bound of every Redis call (`--redis-timeout-ms`).
    pub timeout_ms: u64,
    /// How long a record (deduplication, refunds) is kept (`--attempt-ttl-ms`).
    pub record_ttl_ms: u64,
    /// The largest lease, as a fraction of the bucket's capacity (`--lease-max-share`).
    pub lease_max_share: f64,
    /// Script calls in flight per node (`--redis-pipeline`).
    pub max_in_flight: usize,
    /// Decisions one script call carries at most.
    pub max_call_decisions: usize,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            timeout_ms: 50,
            record_ttl_ms: 10_000,
            lease_max_share: 0.1,
            max_in_flight: 4,
            max_call_decisions: 512,
        }
    }
}

/// How often the Cluster slot map is read again.
const SLOT_REFRESH: Duration = Duration::from_secs(5);

/// The Redis store. Cheap to clone: one shared state.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    connection: Connection,
    sha1: String,
    options: StoreOptions,
    metrics: Arc<Metrics>,
    batchers: Mutex<HashMap<NodeId, Batcher>>,
    /// Cluster only: which primary serves which slots.
    slots: ArcSwap<SlotMap>,
    refresh_now: tokio::sync::Notify,
    refresher_started: AtomicBool,
}

/// Slot ranges and the address of the primary serving each, sorted by start.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct SlotMap {
    ranges: Vec<(u16, u16, Arc<str>)>,
}

impl SlotMap {
    fn node(&self, slot: u16) -> Option<&Arc<str>> {
        let i = self.ranges.partition_point(|(start, _, _)| *start <= slot);
        let (start, end, addr) = self.ranges.get(i.checked_sub(1)?)?;
        (*start <= slot && slot <= *end).then_some(addr)
    }

    /// Parses a `CLUSTER SLOTS` reply: `[[start, end, [ip, port, id...], replicas...], ...]`.
    pub fn from_cluster_slots(v: &Value) -> Option<SlotMap> {
        let Value::Array(entries) = v else {
            return None;
        };
        let mut ranges = Vec::with_capacity(entries.len());
        for e in entries {
            let Value::Array(parts) = e else {
                return None;
            };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(primary))) =
                (parts.first(), parts.get(1), parts.get(2))
            else {
                return None;
            };
            let host = match primary.first()? {
                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                Value::SimpleString(s) => s.clone(),
                _ => return None,
            };
            let Some(Value::Int(port)) = primary.get(1) else {
                return None;
            };
            ranges.push((
                u16::try_from(*start).ok()?,
                u16::try_from(*end).ok()?,
                Arc::from(format!("{host}:{port}")),
            ));
        }
        ranges.sort_by_key(|r| r.0);
        Some(SlotMap { ranges })
    }
}

impl RedisStore {
    /// A store on one Redis. Connects lazily: this succeeds while Redis is down.
    pub fn single(
        url: &str,
        connections: usize,
        options: StoreOptions,
        metrics: Arc<Metrics>,
    ) -> Result<Self, StoreError> {
        let connection = Connection::single(url, connections, options.timeout_ms)?;
        Ok(Self::new(connection, options, metrics))
    }

    /// A store on the primary that the Sentinels at `sentinels` name `master`. Connects lazily:
    /// this succeeds while the Sentinels and Redis are down.
    pub fn sentinel(
        sentinels: &[String],
        master: &str,
        options: StoreOptions,
        metrics: Arc<Metrics>,
    ) -> Result<Self, StoreError> {
        let connection = Connection::sentinel(sentinels, master, options.timeout_ms)?;
        Ok(Self::new(connection, options, metrics))
    }

    /// A store on a Redis Cluster found through `seeds`. Connects in the background.
    pub fn cluster(
        seeds: &[String],
        options: StoreOptions,
        metrics: Arc<Metrics>,
    ) -> Result<Self, StoreError> {
        let connection = Connection::cluster(seeds, options.timeout_ms)?;
        Ok(Self::new(connection, options, metrics))
    }

    pub fn new(connection: Connection, options: StoreOptions, metrics: Arc<Metrics>) -> Self {
        RedisStore {
            inner: Arc::new(Inner {
                connection,
                sha1: script_sha1(),
                options,
                metrics,
                batchers: Mutex::new(HashMap::new()),
                slots: ArcSwap::from_pointee(SlotMap::default()),
                refresh_now: tokio::sync::Notify::new(),
                refresher_started: AtomicBool::new(false),
            }),
        }
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.inner.options.timeout_ms)
    }

    async fn query(&self, cmd: Cmd) -> redis::RedisResult<Value> {
        self.inner.connection.query(cmd).await
    }

    async fn query_all_primaries(
        &self,
        cmd: Cmd,
        policy: Option<ResponsePolicy>,
    ) -> redis::RedisResult<Value> {
        self.inner.connection.query_all_primaries(cmd, policy).await
    }

    /// `f` bounded by `--redis-timeout-ms`.
    async fn bounded<T>(
        &self,
        f: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        self.bounded_by(self.timeout(), f).await
    }

    async fn bounded_by<T>(
        &self,
        limit: Duration,
        f: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        let result = match tokio::time::timeout(limit, f).await {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) if moved(&e) => {
                self.inner.refresh_now.notify_one();
                StoreError::Moved(e.to_string())
            }
            Ok(Err(e)) if is_script_failure(&e) => StoreError::Script(e.to_string()),
            Ok(Err(e)) => StoreError::Redis(e.to_string()),
            Err(_) => StoreError::Timeout {
                timeout_ms: limit.as_millis() as u64,
            },
        };
        self.inner.metrics.redis_errors.inc();
        Err(result)
    }

    /// Starts the Cluster slot-map refresher (once; a no-op for other topologies).
    pub fn start_background(&self) {
        if !self.inner.connection.is_cluster()
            || self.inner.refresher_started.swap(true, Ordering::SeqCst)
        {
            return;
        }
        let store = self.clone();
        tokio::spawn(async move {
            loop {
                store.load_slot_map().await;
                let wait = if store.inner.slots.load().ranges.is_empty() {
                    Duration::from_millis(200)
                } else {
                    SLOT_REFRESH
                };
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {},
                    _ = store.inner.refresh_now.notified() => {},
                }
            }
        });
    }

    /// Reads `CLUSTER SLOTS` and keeps the map when it parses.
    async fn load_slot_map(&self) {
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        match self.bounded(self.query(cmd)).await {
            Ok(v) => match SlotMap::from_cluster_slots(&v) {
                Some(map) if !map.ranges.is_empty() => {
                    if **self.inner.slots.load() != map {
                        tracing::info!(ranges = map.ranges.len(), "cluster slot map loaded");
                        self.inner.slots.store(Arc::new(map));
                    }
                }
                _ => tracing::warn!("unexpected CLUSTER SLOTS reply"),
            },
            Err(e) => tracing::debug!("CLUSTER SLOTS: {e}"),
        }
    }

    fn batcher(&self, node: &NodeId) -> Batcher {
        let mut batchers = self.inner.batchers.lock().expect("not poisoned");
        if let Some(b) = batchers.get(node) {
            return b.clone();
        }
        let store = self.clone();
        let b = Batcher::spawn(
            move |work: Work| {
                let store = store.clone();
                async move { store.call(work).await }
            },
            self.inner.options.max_in_flight,
            self.inner.options.max_call_decisions,
        );
        batchers.insert(node.clone(), b.clone());
        b
    }

    /// One script call in "apply" mode for `work`, as the node's batcher makes it. Bounded by
    /// [`stall_limit`], not by `--redis-timeout-ms`: the callers are answered at their deadline
    /// by [`BucketStore::apply`], while the call keeps its pipeline slot until Redis answers it,
    /// so a stalled Redis is sent at most `--redis-pipeline` calls (see [`super::batch`]).
    async fn call(&self, work: Work) -> Result<Vec<Vec<RequestOutcome>>, StoreError> {
        let args = ScriptArgs::build(
            "apply",
            &self.inner.options,
            self.inner.connection.is_cluster(),
            &work,
            None,
        );
        self.inner
            .metrics
            .script_call_decisions
            .observe(work.groups.iter().map(Group::decisions).sum::<usize>() as f64);
        let limit = stall_limit(self.inner.options.timeout_ms);
        let reply = self.run_script(&args, limit).await?;
        parse_apply(reply, &work)
    }

    /// EVALSHA, healed by EVAL on NOSCRIPT, bounded by `limit`.
    async fn run_script(&self, args: &ScriptArgs, limit: Duration) -> Result<Value, StoreError> {
        self.bounded_by(limit, async {
            match self.query(args.cmd("EVALSHA", &self.inner.sha1)).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    // The node lost its script cache (restart, failover): EVAL caches it again.
                    // Built only here: the hot path never copies the script.
                    self.inner.metrics.script_loads.inc();
                    tracing::info!("NOSCRIPT from redis, reloading the bucket script by EVAL");
                    self.query(args.cmd("EVAL", SCRIPT)).await
                }
                other => other,
            }
        })
        .await
    }

    /// Checks Redis, loads the script where it is missing, reads `maxmemory-policy`.
    pub async fn check_readiness(&self) -> Readiness {
        let mut r = Readiness::default();
        let mut exists = redis::cmd("SCRIPT");
        exists.arg("EXISTS").arg(&self.inner.sha1);
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
                    self.inner.metrics.script_loads.inc();
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
                // 0 only when every node answered noeviction: a refused CONFIG GET leaves the
                // gauge as it was, unless another node shows it can evict.
                let evicting = r.warning.is_some();
                if evicting || (refused.is_none() && !r.maxmemory_policy.is_empty()) {
                    self.inner.metrics.eviction_policy(evicting);
                }
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
    fn node_of(&self, key: &str) -> NodeId {
        if !self.inner.connection.is_cluster() {
            return NodeId::primary();
        }
        let slot = cluster_slot(key.as_bytes());
        match self.inner.slots.load().node(slot) {
            Some(addr) => NodeId(addr.clone()),
            None => NodeId(Arc::from(format!("slot:{slot}"))),
        }
    }

    async fn apply(
        &self,
        node: NodeId,
        work: Work,
    ) -> Result<Vec<Vec<RequestOutcome>>, StoreError> {
        // The deadline drops the work if it is still queued when it passes (never sent); the
        // timeout bounds the caller's wait while calls ahead of it hang.
        let deadline = Instant::now() + self.timeout();
        let timeout_ms = self.inner.options.timeout_ms;
        let batcher = self.batcher(&node);
        let submitted = batcher.submit(work, deadline, timeout_ms);
        match tokio::time::timeout(self.timeout(), submitted).await {
            Ok(answer) => answer,
            Err(_) => {
                self.inner.metrics.redis_errors.inc();
                Err(StoreError::Timeout { timeout_ms })
            }
        }
    }

    async fn readiness(&self) -> Readiness {
        self.check_readiness().await
    }

    async fn refresh_topology(&self) {
        if self.inner.connection.is_cluster() {
            self.load_slot_map().await;
        }
    }

    async fn read_hash(&self, key: String) -> Result<Vec<(String, String)>, StoreError> {
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(&key);
        let v = self.bounded(self.query(cmd)).await?;
        redis::from_redis_value::<std::collections::BTreeMap<String, String>>(v)
            .map(|m| m.into_iter().collect())
            .map_err(|e| StoreError::Reply(format!("HGETALL {key}: {e}")))
    }

    async fn add_to_hash(
        &self,
        key: String,
        counters: Vec<(&'static str, u64)>,
    ) -> Result<(), StoreError> {
        for (field, n) in counters.into_iter().filter(|(_, n)| *n > 0) {
            let mut cmd = redis::cmd("HINCRBY");
            cmd.arg(&key).arg(field).arg(n);
            self.bounded(self.query(cmd)).await?;
        }
        Ok(())
    }

    async fn refund(
        &self,
        _node: NodeId,
        group: Group,
        requests: Vec<usize>,
    ) -> Result<bool, StoreError> {
        let work = Work {
            groups: vec![group],
            returns: Vec::new(),
        };
        let args = ScriptArgs::build(
            "refund",
            &self.inner.options,
            self.inner.connection.is_cluster(),
            &work,
            Some(&[requests]),
        );
        let reply = self.run_script(&args, self.timeout()).await?;
        match reply {
            Value::Array(v) if v.len() == 1 => Ok(matches!(v[0], Value::Int(1))),
            other => Err(StoreError::Reply(format!("refund reply {other:?}"))),
        }
    }
}

/// Whether an error says the node does not serve a key of the call (nothing was written).
fn moved(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::Moved)
            | ErrorKind::Server(ServerErrorKind::Ask)
            | ErrorKind::Server(ServerErrorKind::CrossSlot)
    ) || e.detail().is_some_and(|d| d.contains("non local key"))
        || e.to_string().contains("non local key")
}

/// The arguments of one script call (see the calling convention in `lua/token_bucket.lua`).
struct ScriptArgs {
    routing_key: Arc<str>,
    argv: Vec<ArgValue>,
}

enum ArgValue {
    Text(Arc<str>),
    Str(String),
    Int(u64),
    Float(f64),
}

impl ScriptArgs {
    fn build<'a>(
        mode: &'static str,
        options: &StoreOptions,
        cluster: bool,
        work: &'a Work,
        refunds: Option<&[Vec<usize>]>,
    ) -> ScriptArgs {
        let mut keys: Vec<Arc<str>> = Vec::new();
        let mut key_index: HashMap<Arc<str>, usize> = HashMap::new();
        let mut limits: Vec<&Bucket> = Vec::new();
        // A limit is the same when its numbers and its share history (one leased copy per rule,
        // shared by pointer) are.
        let mut limit_index: HashMap<(u64, u64, usize), usize> = HashMap::new();
        let mut key_of = |k: &Arc<str>| -> usize {
            *key_index.entry(k.clone()).or_insert_with(|| {
                keys.push(k.clone());
                keys.len()
            })
        };
        let mut limit_of = |bucket: &'a Bucket| -> usize {
            let share = bucket.share.as_ref().map_or(0, |h| Arc::as_ptr(h) as usize);
            *limit_index
                .entry((bucket.capacity, bucket.refill_per_sec.to_bits(), share))
                .or_insert_with(|| {
                    limits.push(bucket);
                    limits.len()
                })
        };
        let mut body: Vec<ArgValue> = Vec::new();
        body.push(ArgValue::Int(work.groups.len() as u64));
        for g in &work.groups {
            body.push(ArgValue::Str(g.record.clone().unwrap_or_default()));
            body.push(ArgValue::Int(g.requests.len() as u64));
            for request in &g.requests {
                body.push(ArgValue::Int(request.len() as u64));
                for c in request {
                    body.push(ArgValue::Int(key_of(&c.key) as u64));
                    body.push(ArgValue::Int(limit_of(&c.bucket) as u64));
                    body.push(ArgValue::Int(c.cost));
                    body.push(ArgValue::Int(u64::from(c.shadow)));
                    let (id, want, ttl) = c.lease.map_or((0, 0, 0), |l| (l.id, l.tokens, l.ttl_ms));
                    body.push(ArgValue::Int(id));
                    body.push(ArgValue::Int(want));
                    body.push(ArgValue::Int(ttl));
                }
            }
        }
        body.push(ArgValue::Int(work.returns.len() as u64));
        for r in &work.returns {
            body.push(ArgValue::Int(key_of(&r.key) as u64));
            body.push(ArgValue::Int(limit_of(&r.bucket) as u64));
            body.push(ArgValue::Int(r.lease_id));
            body.push(ArgValue::Int(r.tokens));
        }
        if let Some(refunds) = refunds {
            for indices in refunds {
                body.push(ArgValue::Int(indices.len() as u64));
                for i in indices {
                    body.push(ArgValue::Int(*i as u64 + 1));
                }
            }
        }
        let mut argv = Vec::with_capacity(6 + keys.len() + 2 * limits.len() + body.len());
        argv.push(ArgValue::Str(mode.to_string()));
        argv.push(ArgValue::Int(options.record_ttl_ms));
        argv.push(ArgValue::Float(options.lease_max_share));
        argv.push(ArgValue::Int(u64::from(cluster)));
        argv.push(ArgValue::Int(SHARE_MARGIN_MS));
        argv.push(ArgValue::Int(keys.len() as u64));
        let routing_key = keys.first().cloned().unwrap_or_else(|| Arc::from(""));
        argv.extend(keys.into_iter().map(ArgValue::Text));
        argv.push(ArgValue::Int(limits.len() as u64));
        for bucket in limits {
            argv.push(ArgValue::Int(bucket.capacity));
            argv.push(ArgValue::Float(bucket.refill_per_sec));
            match &bucket.share {
                None => argv.push(ArgValue::Int(0)),
                Some(history) => {
                    argv.push(ArgValue::Int(history.changes().count() as u64));
                    for (from_ms, share) in history.changes() {
                        argv.push(ArgValue::Int(from_ms));
                        argv.push(ArgValue::Int(u64::from(share.ppm())));
                    }
                }
            }
        }
        argv.extend(body);
        ScriptArgs { routing_key, argv }
    }

    fn cmd(&self, command: &str, script: &str) -> Cmd {
        let mut c = redis::cmd(command);
        c.arg(script).arg(1).arg(&*self.routing_key);
        for a in &self.argv {
            match a {
                ArgValue::Text(s) => c.arg(&**s),
                ArgValue::Str(s) => c.arg(s),
                ArgValue::Int(i) => c.arg(*i),
                ArgValue::Float(f) => c.arg(format_float(*f)),
            };
        }
        c
    }
}

/// A float as Lua's `tonumber` reads it back exactly (shortest round-trip form).
fn format_float(f: f64) -> String {
    let s = format!("{f:?}");
    s.strip_suffix(".0").map(str::to_string).unwrap_or(s)
}

/// The largest integer a double holds exactly (2^53): the script clamps its figures to it.
const MAX_EXACT: f64 = 9_007_199_254_740_992.0;

/// The script's reply for `work` (one string of little-endian doubles, each an integer: see
/// `lua/token_bucket.lua`) as outcomes per group and request.
fn parse_apply(reply: Value, work: &Work) -> Result<Vec<Vec<RequestOutcome>>, StoreError> {
    let bad = |what: String| StoreError::Reply(what);
    let bytes: &[u8] = match &reply {
        Value::BulkString(b) => b,
        // No buckets, nothing decided: the script answers an empty array.
        Value::Array(items) if items.is_empty() => &[],
        other => return Err(bad(format!("{other:?}"))),
    };
    let expected: usize = work
        .groups
        .iter()
        .map(|g| g.requests.iter().map(|r| 1 + 6 * r.len()).sum::<usize>())
        .sum();
    if bytes.len() != 8 * expected {
        return Err(bad(format!(
            "{} bytes where {} were expected",
            bytes.len(),
            8 * expected
        )));
    }
    let mut ints = bytes.chunks_exact(8).map(|c| {
        let mut le = [0u8; 8];
        le.copy_from_slice(c);
        let f = f64::from_le_bytes(le);
        if (0.0..=MAX_EXACT).contains(&f) && f.fract() == 0.0 {
            Ok(f as u64)
        } else {
            Err(bad(format!("{f} is not a count")))
        }
    });
    let mut next = move || {
        ints.next()
            .unwrap_or_else(|| Err(bad("short reply".into())))
    };
    let mut groups = Vec::with_capacity(work.groups.len());
    for g in &work.groups {
        let mut requests = Vec::with_capacity(g.requests.len());
        for r in &g.requests {
            let status = match next()? {
                0 => Status::Rejected,
                1 => Status::Charged,
                10 | 12 => Status::Replayed { charged: false },
                11 => Status::Replayed { charged: true },
                other => return Err(bad(format!("status code {other}"))),
            };
            let mut decisions = Vec::with_capacity(r.len());
            for _ in r {
                let allowed = next()? == 1;
                let remaining = next()?;
                let retry_after_ms = next()?;
                let reset_ms = next()?;
                let reason = match next()? {
                    0 => Reason::Ok,
                    1 => Reason::Insufficient,
                    2 => Reason::CostExceedsCapacity,
                    other => return Err(bad(format!("reason code {other}"))),
                };
                let leased = next()?;
                decisions.push(Outcome {
                    allowed,
                    remaining,
                    retry_after_ms,
                    reset_ms,
                    reason,
                    leased,
                });
            }
            requests.push(RequestOutcome { status, decisions });
        }
        groups.push(requests);
    }
    Ok(groups)
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
    fn replies_parse_by_the_shape_of_the_work_and_odd_ones_are_errors() {
        use super::super::{Bucket, Charge};
        let charge = |k: &str| Charge {
            key: Arc::from(k),
            bucket: Bucket::new(10, 1.0),
            cost: 1,
            shadow: false,
            lease: None,
        };
        let work = Work {
            groups: vec![Group {
                record: None,
                requests: vec![vec![charge("a"), charge("b")], vec![charge("a")]],
            }],
            returns: vec![],
        };
        let ints = |v: &[i64]| {
            Value::BulkString(v.iter().flat_map(|i| (*i as f64).to_le_bytes()).collect())
        };
        let reply = ints(&[
            1, 1, 9, 0, 1000, 0, 0, 1, 9, 0, 1000, 0, 0, 11, 1, 8, 0, 2000, 0, 3,
        ]);
        let g = parse_apply(reply, &work).unwrap();
        assert_eq!(g[0][0].status, Status::Charged);
        assert_eq!(g[0][1].status, Status::Replayed { charged: true });
        assert_eq!(g[0][1].decisions[0].leased, 3);
        assert!(parse_apply(ints(&[1]), &work).is_err());
        assert!(parse_apply(Value::Nil, &work).is_err());
        // The former shape (an array of integers), a torn double, a fraction, a negative count.
        let array = Value::Array(vec![Value::Int(1); 20]);
        assert!(parse_apply(array, &work).is_err(), "an array of integers");
        let mut torn: Vec<u8> = (0..20).flat_map(|_| 1f64.to_le_bytes()).collect();
        torn.pop();
        assert!(parse_apply(Value::BulkString(torn), &work).is_err());
        for odd in [0.5, -1.0, f64::NAN, f64::INFINITY, 1e300] {
            let mut v: Vec<u8> = [
                1.0, 1.0, 9.0, 0.0, 1000.0, 0.0, 0.0, 1.0, 9.0, 0.0, 1000.0, 0.0, 0.0, 1.0, 1.0,
                8.0, 0.0, 2000.0, 0.0, 0.0,
            ]
            .iter()
            .flat_map(|f: &f64| f.to_le_bytes())
            .collect();
            v[16..24].copy_from_slice(&odd.to_le_bytes());
            assert!(
                parse_apply(Value::BulkString(v), &work).is_err(),
                "{odd} as remaining"
            );
        }
        let mut bad = vec![
            1, 1, 9, 0, 1000, 7, 0, 1, 9, 0, 1000, 0, 0, 1, 1, 8, 0, 2000, 0, 0,
        ];
        assert!(parse_apply(ints(&bad), &work).is_err(), "reason 7");
        bad[5] = 0;
        bad[0] = 5;
        assert!(parse_apply(ints(&bad), &work).is_err(), "status 5");
    }

    #[test]
    fn arguments_name_each_bucket_and_limit_once() {
        use super::super::{Bucket, Charge};
        let charge = |k: &str, capacity: u64| Charge {
            key: Arc::from(k),
            bucket: Bucket::new(capacity, 0.5),
            cost: 2,
            shadow: true,
            lease: None,
        };
        let work = Work {
            groups: vec![Group {
                record: Some("rec".into()),
                requests: vec![
                    vec![charge("a", 10), charge("b", 10)],
                    vec![charge("a", 20)],
                ],
            }],
            returns: vec![],
        };
        let args = ScriptArgs::build("apply", &StoreOptions::default(), false, &work, None);
        let text: Vec<String> = args
            .argv
            .iter()
            .map(|a| match a {
                ArgValue::Text(s) => s.to_string(),
                ArgValue::Str(s) => s.clone(),
                ArgValue::Int(i) => i.to_string(),
                ArgValue::Float(f) => format_float(*f),
            })
            .collect();
        assert_eq!(
            text.join(" "),
            "apply 10000 0.1 0 1000 2 a b 2 10 0.5 0 20 0.5 0 1 rec 2 2 1 1 2 1 0 0 0 2 1 2 1 0 0 0 1 1 2 2 1 0 0 0 0"
        );
        assert_eq!(&*args.routing_key, "a");
    }

    #[test]
    fn slot_maps_find_the_primary_of_a_slot() {
        let s = |x: &str| Value::BulkString(x.as_bytes().to_vec());
        let entry = |a: i64, b: i64, port: i64| {
            Value::Array(vec![
                Value::Int(a),
                Value::Int(b),
                Value::Array(vec![s("127.0.0.1"), Value::Int(port), s("id")]),
            ])
        };
        let map = SlotMap::from_cluster_slots(&Value::Array(vec![
            entry(5461, 10922, 7001),
            entry(0, 5460, 7000),
            entry(10923, 16383, 7002),
        ]))
        .unwrap();
        assert_eq!(map.node(0).map(|a| &**a), Some("127.0.0.1:7000"));
        assert_eq!(map.node(5461).map(|a| &**a), Some("127.0.0.1:7001"));
        assert_eq!(map.node(16383).map(|a| &**a), Some("127.0.0.1:7002"));
        assert_eq!(SlotMap::default().node(3), None);
        assert!(SlotMap::from_cluster_slots(&Value::Nil).is_none());
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
