//! The Redis store: the bucket script run in Redis, over a [`Connection`] to one node, the
//! primary Sentinel names, or a Cluster ([`sentinel`]: how the primary is found). A call's way
//! through it (`decide_on`):
//! - `placement`: each request's charges grouped by the node that holds their buckets, a
//!   record key for each group that needs one, and the retry of what a moved slot refused;
//! - [`batch`]: the work ready for one node merged into one script call, `--redis-pipeline` in
//!   flight per node at most;
//! - the script call (its arguments and reply: `super::script`), EVALSHA healed by EVAL;
//! - `compensation`: each request's parts merged into its answer, and what a rejected request
//!   charged on other nodes refunded.
//!
//! The script is embedded from `lua/` and called by EVALSHA; a NOSCRIPT answer (a restarted node,
//! a failover, a new Cluster primary) is healed by an EVAL of the same call, which also caches the
//! script on that node. No NOSCRIPT ever reaches a caller. Every call is bounded by
//! `--redis-timeout-ms`; a script call whose outcome is unknown (timeout) is never retried here.
//!
//! On a Cluster the work is grouped by the node that serves each bucket's slot (from `CLUSTER
//! SLOTS`, refreshed every few seconds and after a MOVED): one script call per node decides keys
//! of many slots (the script is flagged `allow-cross-slot-keys`). If the map is stale the call
//! fails before writing anything (`MOVED`, or the script's read of a key this node does not
//! serve), the map is refreshed, and the work is regrouped and sent once more. Until the map is
//! known, work is grouped by slot.

pub mod batch;
mod compensation;
pub mod connection;
mod placement;
pub mod sentinel;
pub mod settle;
pub mod slots;
#[cfg(test)]
mod two_nodes;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use redis::cluster_routing::ResponsePolicy;
use redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};

use self::batch::Batcher;
use self::connection::{stall_limit, Connection};
use super::script::{parse_apply, Script, ScriptArgs};
use super::{
    epoch_marker, eviction_warning, is_script_failure, BucketStore, Call, Decided, Group,
    Readiness, RequestOutcome, SettleBatch, Settled, Settlement, ShareStore, Slot, SlotUpdate,
    SlotsTaken, StoreError, StoreReset, Work,
};
use crate::keys::cluster_slot;
use crate::metrics::Metrics;
use crate::regional::record;

/// A Redis node, as calls are grouped: the primary's address on a Cluster (or `slot:<n>` while
/// the slot map is unknown), `primary` otherwise.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub Arc<str>);

impl NodeId {
    pub fn primary() -> NodeId {
        NodeId(Arc::from("primary"))
    }
}

/// The nodes a call is placed on, as `placement` and `compensation` use them: which node
/// holds a key, and the bucket script's calls on one node. [`RedisStore`] is one (the tests'
/// two-node fake another).
pub trait Nodes: Send + Sync + 'static {
    /// The node a bucket key lives on: work is sent per node.
    fn node_of(&self, key: &str) -> NodeId;

    /// Decides `work` (all of it on `node`): one outcome per group, in order.
    fn apply(
        &self,
        node: NodeId,
        work: Work,
    ) -> impl Future<Output = Result<Vec<Vec<RequestOutcome>>, StoreError>> + Send;

    /// Gives back what the listed requests (indices into `group.requests`) of a group applied
    /// before charged, by its record (idempotent). `group` is the group as it was applied.
    fn refund(
        &self,
        node: NodeId,
        group: Group,
        requests: Vec<usize>,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Reads the topology again now (a Cluster's slot map), after a node refused a key.
    fn refresh_topology(&self) -> impl Future<Output = ()> + Send;
}

/// Decides `call` on the nodes that hold its buckets: placed, sent (what a moved slot refused
/// once more), and each request's parts merged into its answer.
async fn decide_on<N: Nodes + Clone>(
    nodes: &N,
    metrics: &Arc<Metrics>,
    call: Call,
) -> Vec<Result<Decided, StoreError>> {
    let placed = placement::place(nodes, call);
    let (groups, results) = placement::send(nodes, placed.groups, placed.returns).await;
    compensation::answer(nodes, metrics, groups, &placed.placements, results)
}

/// How the store calls Redis.
#[derive(Debug, Clone)]
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
    /// What a bucket missing after the store lost its state starts with (`--store-reset`).
    pub store_reset: StoreReset,
    /// The key prefix (`--key-prefix`), for the store's epoch marker ([`epoch_marker`]).
    pub key_prefix: String,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            timeout_ms: 50,
            record_ttl_ms: 10_000,
            lease_max_share: 0.1,
            max_in_flight: 4,
            max_call_decisions: 512,
            store_reset: StoreReset::Full,
            key_prefix: "rl:".into(),
        }
    }
}

/// How often the store's epoch markers are read (a loss of state is seen within this).
const EPOCH_CHECK: Duration = Duration::from_secs(1);

/// How often the Cluster slot map is read again.
const SLOT_REFRESH: Duration = Duration::from_secs(5);

/// The Redis store. Cheap to clone: one shared state.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    connection: Connection,
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

    /// Starts the watch of the store's epoch marker and, on a Cluster, the slot-map refresher
    /// (once).
    pub fn start_background(&self) {
        if self.inner.refresher_started.swap(true, Ordering::SeqCst) {
            return;
        }
        let store = self.clone();
        tokio::spawn(async move {
            let mut seen = HashMap::new();
            loop {
                store.check_epoch(&mut seen).await;
                tokio::time::sleep(EPOCH_CHECK).await;
            }
        });
        if !self.inner.connection.is_cluster() {
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

    /// The epoch markers to watch: `<prefix>epoch`, or on a Cluster one per primary, in a slot
    /// it serves (any: a node loses its slots' keys together).
    fn epoch_markers(&self) -> Vec<String> {
        let prefix = &self.inner.options.key_prefix;
        if !self.inner.connection.is_cluster() {
            return vec![epoch_marker(prefix, false, "")];
        }
        let slots = self.inner.slots.load();
        let mut nodes: Vec<&Arc<str>> = slots.ranges.iter().map(|(_, _, n)| n).collect();
        nodes.sort();
        nodes.dedup();
        nodes
            .into_iter()
            .filter_map(|node| {
                // A tag per node: the first `{n<k>}` whose slot the node serves (a few tries).
                (0..100_000u32).find_map(|k| {
                    let tag = format!("{{n{k}}}");
                    let served = slots.node(cluster_slot(tag.as_bytes())) == Some(node);
                    served.then(|| epoch_marker(prefix, true, &tag))
                })
            })
            .collect()
    }

    /// Epoch marker `marker`'s value, made now (the server's `TIME`, "<s><µs, 6 digits>", as the
    /// bucket script makes it) when missing: the value and whether it was made by this call. Plain
    /// commands, not a script: a stalled Redis's backlog of script calls stays the decisions'.
    async fn ensure_marker(&self, marker: &str) -> Result<(String, bool), StoreError> {
        // Read first: the marker exists on every check but the first, and a read writes nothing
        // (no write per second in Redis's stats, its AOF or its replicas' streams).
        if let Some(value) = self.read_marker(marker).await? {
            return Ok((value, false));
        }
        let time: Vec<String> = self
            .bounded(self.query(redis::cmd("TIME")))
            .await
            .and_then(|v| {
                redis::from_redis_value(v).map_err(|e| StoreError::Reply(e.to_string()))
            })?;
        let [secs, micros] = &time[..] else {
            return Err(StoreError::Reply(format!("TIME: {time:?}")));
        };
        let now = format!("{secs}{micros:0>6}");
        let mut set = redis::cmd("SET");
        set.arg(marker).arg(&now).arg("NX");
        let made = !matches!(self.bounded(self.query(set)).await?, Value::Nil);
        let value = self.read_marker(marker).await?;
        Ok((value.unwrap_or(now), made))
    }

    /// Epoch marker `marker`'s value, if it exists.
    async fn read_marker(&self, marker: &str) -> Result<Option<String>, StoreError> {
        let mut get = redis::cmd("GET");
        get.arg(marker);
        self.bounded(self.query(get)).await.and_then(|v| {
            redis::from_redis_value::<Option<String>>(v)
                .map_err(|e| StoreError::Reply(e.to_string()))
        })
    }

    /// Reads (or creates) each epoch marker; a marker gone or changed since the last read means
    /// its node lost its state: logged at warn and counted (`ratelimit_store_resets_total`).
    async fn check_epoch(&self, seen: &mut HashMap<String, String>) {
        for marker in self.epoch_markers() {
            let (value, created) = match self.ensure_marker(&marker).await {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!(%marker, "epoch marker not read: {e}");
                    continue;
                }
            };
            match seen.insert(marker.clone(), value.clone()) {
                Some(before) if before != value || created => {
                    self.inner.metrics.store_resets.inc();
                    tracing::warn!(
                        %marker,
                        policy = ?self.inner.options.store_reset,
                        "redis lost its state (the epoch marker was gone or recreated): buckets it no longer holds start {} (--store-reset)",
                        match self.inner.options.store_reset {
                            StoreReset::Full => "full",
                            StoreReset::Empty => "empty at the loss and refill from there",
                        }
                    );
                }
                None if created => tracing::info!(
                    %marker,
                    "created the store's epoch marker (a new Redis, or one that lost its state before this sidecar started)"
                ),
                _ => {}
            }
        }
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
    /// by [`Nodes::apply`], while the call keeps its pipeline slot until Redis answers it,
    /// so a stalled Redis is sent at most `--redis-pipeline` calls (see [`batch`]).
    async fn call(&self, work: Work) -> Result<Vec<Vec<RequestOutcome>>, StoreError> {
        let args = ScriptArgs::build(
            Script::Apply,
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
            match self.query(args.cmd(false)).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    // The node lost its script cache (restart, failover): EVAL caches it again.
                    // Built only here: the hot path never copies the script.
                    self.inner.metrics.script_loads.inc();
                    tracing::info!("NOSCRIPT from redis, reloading the bucket script by EVAL");
                    self.query(args.cmd(true)).await
                }
                other => other,
            }
        })
        .await
    }

    /// Checks Redis, loads the scripts where one is missing, reads `maxmemory-policy`.
    pub async fn check_readiness(&self) -> Readiness {
        let mut r = Readiness::default();
        let mut exists = redis::cmd("SCRIPT");
        exists.arg("EXISTS");
        for script in Script::ALL {
            exists.arg(script.sha1());
        }
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
            for script in Script::ALL {
                let mut load = redis::cmd("SCRIPT");
                load.arg("LOAD").arg(script.text());
                let all = Some(ResponsePolicy::AllSucceeded);
                if let Err(e) = self.bounded(self.query_all_primaries(load, all)).await {
                    r.error = Some(format!("SCRIPT LOAD: {e}"));
                    break;
                }
                self.inner.metrics.script_loads.inc();
            }
            r.script_loaded = r.error.is_none();
        }
        // Ready means the epoch markers exist (made here when missing; the watch still sees a
        // marker made anew as a loss of state).
        for marker in self.epoch_markers() {
            if let Err(e) = self.ensure_marker(&marker).await {
                r.error.get_or_insert(format!("epoch marker {marker}: {e}"));
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

impl RedisStore {
    /// One node's part of a settle batch: `lua/settle.lua`, EVALSHA healed by EVAL on NOSCRIPT,
    /// bounded by `--redis-timeout-ms`.
    async fn settle_part(
        &self,
        id: Option<&str>,
        part: &[Settlement],
    ) -> Result<Vec<Option<i64>>, StoreError> {
        let (options, cluster) = (&self.inner.options, self.inner.connection.is_cluster());
        let reply = self
            .bounded(async {
                match self
                    .query(settle::settle_cmd(options, cluster, id, part, false))
                    .await
                {
                    Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                        self.inner.metrics.script_loads.inc();
                        self.query(settle::settle_cmd(options, cluster, id, part, true))
                            .await
                    }
                    other => other,
                }
            })
            .await?;
        settle::parse_settle(reply, part.len())
    }
}

impl RedisStore {
    /// One node's part of a slots call: `lua/slots.lua`, EVALSHA healed by EVAL on NOSCRIPT,
    /// bounded by `--redis-timeout-ms`.
    async fn slots_part(&self, mode: slots::SlotMode, part: &[&Slot]) -> Result<Value, StoreError> {
        self.bounded(async {
            match self.query(slots::slots_cmd(mode, part, false)).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    self.inner.metrics.script_loads.inc();
                    self.query(slots::slots_cmd(mode, part, true)).await
                }
                other => other,
            }
        })
        .await
    }

    /// `slots` grouped by the node that holds their sets: (node, indices), in first-seen order.
    fn slots_by_node(&self, slots: &[Slot]) -> Vec<(NodeId, Vec<usize>)> {
        let mut parts: Vec<(NodeId, Vec<usize>)> = Vec::new();
        for (i, s) in slots.iter().enumerate() {
            let node = self.node_of(&s.key);
            match parts.iter_mut().find(|(n, _)| *n == node) {
                Some((_, idx)) => idx.push(i),
                None => parts.push((node, vec![i])),
            }
        }
        parts
    }
}

impl BucketStore for RedisStore {
    /// One script call per node, one node after the other: a part that finds a set full (or
    /// fails) releases the parts taken before it, so the request holds all or none. A release
    /// that fails leaves those slots to expire by themselves (`slot_ttl_ms`).
    async fn take_slots(&self, slots: Vec<Slot>) -> Result<SlotsTaken, StoreError> {
        let parts = self.slots_by_node(&slots);
        let mut taken: Vec<&Slot> = Vec::new();
        let mut outcome = Ok(SlotsTaken::Taken);
        for (_, idx) in &parts {
            let part: Vec<&Slot> = idx.iter().map(|&i| &slots[i]).collect();
            let full = self
                .slots_part(slots::SlotMode::Take, &part)
                .await
                .and_then(|v| slots::parse_take(&v, part.len()));
            match full {
                Ok(None) => taken.extend(part),
                Ok(Some(i)) => {
                    outcome = Ok(SlotsTaken::Full { index: idx[i] });
                    break;
                }
                Err(e) => {
                    outcome = Err(e);
                    break;
                }
            }
        }
        if !matches!(outcome, Ok(SlotsTaken::Taken)) && !taken.is_empty() {
            let back: Vec<Slot> = taken.into_iter().cloned().collect();
            let _ = self.update_slots(SlotUpdate::Release, back).await;
        }
        outcome
    }

    /// One script call per node, concurrently; the first error is the call's.
    async fn update_slots(
        &self,
        update: SlotUpdate,
        slots: Vec<Slot>,
    ) -> Result<Vec<bool>, StoreError> {
        let parts = self.slots_by_node(&slots);
        let calls = parts.iter().map(|(_, idx)| {
            let part: Vec<&Slot> = idx.iter().map(|&i| &slots[i]).collect();
            async move {
                let v = self
                    .slots_part(slots::SlotMode::Update(update), &part)
                    .await?;
                slots::parse_update(&v, part.len())
            }
        });
        let answers = futures::future::join_all(calls).await;
        let mut held = vec![false; slots.len()];
        for ((_, idx), answer) in parts.iter().zip(answers) {
            for (&i, h) in idx.iter().zip(answer?) {
                held[i] = h;
            }
        }
        Ok(held)
    }

    async fn decide(&self, call: Call) -> Vec<Result<Decided, StoreError>> {
        decide_on(self, &self.inner.metrics, call).await
    }

    /// One script call per node, concurrently; the first error is the batch's (the parts that
    /// applied are recorded, so the caller's retry of the batch applies only the others).
    async fn settle(&self, batch: SettleBatch) -> Result<Settled, StoreError> {
        let mut parts: Vec<(NodeId, Vec<usize>)> = Vec::new();
        for (i, s) in batch.settlements.iter().enumerate() {
            let node = self.node_of(&s.key);
            match parts.iter_mut().find(|(n, _)| *n == node) {
                Some((_, idx)) => idx.push(i),
                None => parts.push((node, vec![i])),
            }
        }
        let id = batch.id.as_deref();
        let calls = parts.iter().map(|(_, idx)| {
            let part: Vec<Settlement> = idx.iter().map(|&i| batch.settlements[i].clone()).collect();
            async move { self.settle_part(id, &part).await }
        });
        let answers = futures::future::join_all(calls).await;
        let mut tokens = vec![None; batch.settlements.len()];
        for ((_, idx), answer) in parts.iter().zip(answers) {
            for (&i, t) in idx.iter().zip(answer?) {
                tokens[i] = t;
            }
        }
        Ok(Settled { tokens })
    }

    async fn readiness(&self) -> Readiness {
        self.check_readiness().await
    }
}

impl Nodes for RedisStore {
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

    async fn refresh_topology(&self) {
        if self.inner.connection.is_cluster() {
            self.load_slot_map().await;
        }
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
            Script::Refund,
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

impl ShareStore for RedisStore {
    async fn read_share_record(
        &self,
        key: String,
    ) -> Result<(Vec<(String, String)>, String), StoreError> {
        let v = self.bounded(self.query(record::read_cmd(&key))).await?;
        record::parse_read(v).map_err(|e| StoreError::Reply(format!("{key}: {e}")))
    }

    async fn add_demand(
        &self,
        key: String,
        admitted: u64,
        rejected: u64,
    ) -> Result<(), StoreError> {
        let counters = [(record::ADMITTED, admitted), (record::REJECTED, rejected)];
        for (field, n) in counters.into_iter().filter(|(_, n)| *n > 0) {
            let mut cmd = redis::cmd("HINCRBY");
            cmd.arg(&key).arg(field).arg(n);
            self.bounded(self.query(cmd)).await?;
        }
        Ok(())
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
