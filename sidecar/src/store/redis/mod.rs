//! The Redis store: the bucket script run in Redis, over a [`Connection`] to one node, the
//! primary Sentinel names, or a Cluster ([`sentinel`]: how the primary is found). A call's way
//! through it (`decide_on`):
//! - `placement`: each request's charges grouped by the node that holds their buckets, a
//!   record key for each group that needs one, and the retry of what a moved slot refused;
//! - [`batch`]: the work ready for one node merged into one script call, `--redis-pipeline` in
//!   flight per node at most;
//! - the script call (its arguments and reply: [`script`]), EVALSHA healed by EVAL;
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
mod epoch;
mod options;
mod placement;
mod readiness;
mod redact;
pub mod script;
pub mod sentinel;
pub mod settle;
mod share;
mod slot_map;
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
pub use self::epoch::{epoch_marker, FENCE_SCRIPT};
pub use self::options::StoreOptions;
use self::script::{parse_apply, Script, ScriptArgs};
pub use self::slot_map::SlotMap;
use super::{
    Applied, BucketStore, Call, Decided, Group, Readiness, RequestOutcome, SettleBatch, Settled,
    Settlement, Slot, SlotUpdate, SlotsTaken, StoreError, StoreReset, Work,
};
use crate::keys::{bucket_key, cluster_slot};
use crate::metrics::Metrics;

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

/// Whether an error is the script failing on its data or arguments (`WRONGTYPE`: another type of
/// value where a bucket or attempt record should be; `ERR invalid decision`, `ERR usage`,
/// `ERR attempt_ttl_ms`: the script refused its arguments; `ERR user_script...`: a Lua error)
/// rather than Redis being unreachable, busy, out of memory or failing over.
fn is_script_failure(e: &RedisError) -> bool {
    let detail = e.detail().unwrap_or_default();
    e.code() == Some("WRONGTYPE")
        || (e.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
            && ["invalid limit", "usage:", "user_script"]
                .iter()
                .any(|m| detail.contains(m)))
}

/// How often the store's epoch markers are read (a loss of state is seen within this), and
/// Sentinel asked which primary it names.
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
    /// Cluster only: each primary's epoch marker (from the slot map).
    markers: ArcSwap<HashMap<Arc<str>, String>>,
    /// Each marker's epoch as last fenced: a change is a loss of state ([`RedisStore::observe`]).
    epochs_seen: Mutex<HashMap<String, String>>,
    refresh_now: tokio::sync::Notify,
    refresher_started: AtomicBool,
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
                markers: ArcSwap::from_pointee(HashMap::new()),
                epochs_seen: Mutex::new(HashMap::new()),
                refresh_now: tokio::sync::Notify::new(),
                refresher_started: AtomicBool::new(false),
            }),
        }
    }

    pub(super) fn timeout(&self) -> Duration {
        Duration::from_millis(self.inner.options.timeout_ms)
    }

    pub(super) async fn query(&self, cmd: Cmd) -> redis::RedisResult<Value> {
        self.inner.connection.query(cmd).await
    }

    pub(super) async fn query_all_primaries(
        &self,
        cmd: Cmd,
        policy: Option<ResponsePolicy>,
    ) -> redis::RedisResult<Value> {
        self.inner.connection.query_all_primaries(cmd, policy).await
    }

    /// `f` bounded by `--redis-timeout-ms`.
    pub(super) async fn bounded<T>(
        &self,
        f: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        self.bounded_by(self.timeout(), f).await
    }

    pub(super) async fn bounded_by<T>(
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

    /// Starts the watch of the store's epoch marker (and, under Sentinel, of the primary it
    /// names) and, on a Cluster, the slot-map refresher (once).
    pub fn start_background(&self) {
        if self.inner.refresher_started.swap(true, Ordering::SeqCst) {
            return;
        }
        let store = self.clone();
        tokio::spawn(async move {
            loop {
                // Leave a primary Sentinel no longer names first, so the epoch is then read
                // where decisions go next.
                store.inner.connection.confirm_primary().await;
                store.check_epoch().await;
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

    pub(super) fn batcher(&self, node: &NodeId) -> Batcher {
        let mut batchers = self.inner.batchers.lock().expect("not poisoned");
        if let Some(b) = batchers.get(node) {
            return b.clone();
        }
        let store = self.clone();
        let at = node.clone();
        let b = Batcher::spawn(
            move |work: Work| {
                let (store, node) = (store.clone(), at.clone());
                async move { store.call(&node, work).await }
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
    pub(super) async fn call(
        &self,
        node: &NodeId,
        work: Work,
    ) -> Result<Vec<Vec<RequestOutcome>>, StoreError> {
        let marker = self.script_marker(node)?;
        let args = ScriptArgs::build(
            Script::Apply,
            &self.inner.options,
            self.inner.connection.is_cluster(),
            &work,
            None,
            &marker,
        );
        self.inner
            .metrics
            .script_call_decisions
            .observe(work.groups.iter().map(Group::decisions).sum::<usize>() as f64);
        let limit = stall_limit(self.inner.options.timeout_ms);
        let reply = self.run_healed(node, |eval| args.cmd(eval), limit).await?;
        parse_apply(reply, &work)
    }
}

impl RedisStore {
    /// One node's part of a settle batch: `lua/settle.lua`, EVALSHA healed by EVAL on NOSCRIPT,
    /// bounded by `--redis-timeout-ms`.
    async fn settle_part(
        &self,
        node: &NodeId,
        id: Option<&str>,
        part: &[Settlement],
    ) -> Result<Vec<Option<Applied>>, StoreError> {
        let options = &self.inner.options;
        let marker = self.script_marker(node)?;
        let cmd = |eval| settle::settle_cmd(options, id, part, &marker, eval);
        let reply = self.run_healed(node, cmd, self.timeout()).await?;
        settle::parse_settle(reply, part.len())
    }
}

impl RedisStore {
    /// One node's part of a slots call: `lua/slots.lua`, EVALSHA healed by EVAL on NOSCRIPT,
    /// bounded by `--redis-timeout-ms`.
    async fn slots_part(
        &self,
        node: &NodeId,
        mode: slots::SlotMode,
        part: &[&Slot],
    ) -> Result<Value, StoreError> {
        let marker = self.script_marker(node)?;
        let cmd = |eval| slots::slots_cmd(mode, &marker, part, eval);
        self.run_healed(node, cmd, self.timeout()).await
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
    fn bucket_key(&self, domain: &str, entries: &[(&str, Option<&str>)]) -> Arc<str> {
        Arc::from(bucket_key(&self.inner.options.key_prefix, domain, entries))
    }

    /// One script call per node, one node after the other: a part that finds a set full (or
    /// fails) releases the parts taken before it, so the request holds all or none. A release
    /// that fails leaves those slots to expire by themselves (`slot_ttl_ms`).
    async fn take_slots(&self, slots: Vec<Slot>) -> Result<SlotsTaken, StoreError> {
        let parts = self.slots_by_node(&slots);
        let mut taken: Vec<&Slot> = Vec::new();
        let mut outcome = Ok(SlotsTaken::Taken);
        for (node, idx) in &parts {
            let part: Vec<&Slot> = idx.iter().map(|&i| &slots[i]).collect();
            let full = self
                .slots_part(node, slots::SlotMode::Take, &part)
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
        let calls = parts.iter().map(|(node, idx)| {
            let part: Vec<&Slot> = idx.iter().map(|&i| &slots[i]).collect();
            async move {
                let v = self
                    .slots_part(node, slots::SlotMode::Update(update), &part)
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
        let calls = parts.iter().map(|(node, idx)| {
            let part: Vec<Settlement> = idx.iter().map(|&i| batch.settlements[i].clone()).collect();
            async move { self.settle_part(node, id, &part).await }
        });
        let answers = futures::future::join_all(calls).await;
        let mut applied = vec![None; batch.settlements.len()];
        for ((_, idx), answer) in parts.iter().zip(answers) {
            for (&i, a) in idx.iter().zip(answer?) {
                applied[i] = a;
            }
        }
        Ok(Settled { applied })
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
        node: NodeId,
        group: Group,
        requests: Vec<usize>,
    ) -> Result<bool, StoreError> {
        let work = Work {
            groups: vec![group],
            returns: Vec::new(),
        };
        let marker = self.script_marker(&node)?;
        let args = ScriptArgs::build(
            Script::Refund,
            &self.inner.options,
            self.inner.connection.is_cluster(),
            &work,
            Some(&[requests]),
            &marker,
        );
        let reply = self
            .run_healed(&node, |eval| args.cmd(eval), self.timeout())
            .await?;
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

/// A reply of an unexpected shape, as an error.
fn unexpected(v: &Value) -> RedisError {
    RedisError::from((ErrorKind::Parse, "unexpected reply", format!("{v:?}")))
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

#[cfg(test)]
mod tests {
    use super::readiness::maxmemory_policies;
    use super::*;

    #[test]
    fn script_failures_are_told_from_outages() {
        let ext = |code: &str, detail: &str| {
            ::redis::make_extension_error(code.to_string(), Some(detail.to_string()))
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
            "invalid limit 1: capacity and refill_per_sec must be > 0 script: ..."
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
