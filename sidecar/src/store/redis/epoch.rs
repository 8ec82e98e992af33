//! The store's epoch on each node (docs/bucket.md, "a store that lost its state"): its marker,
//! the fence that makes it anew on a server that did not make it (`lua/fence.lua`), a loss
//! observed and counted, and no bucket script run on a node before its epoch is known.

use super::*;

/// The key of a node's epoch marker (docs/bucket.md, "a store that lost its state"):
/// `<prefix>epoch` on one Redis; on a Cluster one per primary, `<prefix>epoch{<tag>}` with a tag
/// whose slot that primary serves ([`SlotMap::marker_tags`]), so it lives, and is lost, with that
/// node's buckets. It holds the server's time (µs) when it was made: the store's epoch. Its stamp,
/// `<marker>:run`, is the run_id of the server it was made on (`lua/fence.lua`).
pub fn epoch_marker(prefix: &str, tag: Option<&str>) -> String {
    match tag {
        Some(tag) => format!("{prefix}epoch{{{tag}}}"),
        None => format!("{prefix}epoch"),
    }
}

/// `lua/fence.lua`: the node's epoch made anew when the server is not the one that made it.
pub const FENCE_SCRIPT: &str = include_str!("../../../../lua/fence.lua");

impl RedisStore {
    /// The epoch marker of `node`: `<prefix>epoch`, or on a Cluster the primary's (`None` while
    /// the slot map is not known).
    pub(super) fn node_marker(&self, node: &NodeId) -> Option<String> {
        let prefix = &self.inner.options.key_prefix;
        if !self.inner.connection.is_cluster() {
            return Some(epoch_marker(prefix, None));
        }
        self.inner.markers.load().get(&node.0).cloned()
    }

    /// The marker a script call on `node` reads: the node's under `--store-reset empty`, else
    /// "". A Cluster node whose marker is not known yet cannot be decided on: no bucket it holds
    /// could be told from one it lost.
    pub(super) fn script_marker(&self, node: &NodeId) -> Result<String, StoreError> {
        if self.inner.options.store_reset == StoreReset::Full {
            return Ok(String::new());
        }
        self.node_marker(node).ok_or_else(|| {
            StoreError::Redis(format!(
                "the epoch marker of node {} is not known yet (the cluster slot map is loading)",
                node.0
            ))
        })
    }

    /// Every node's epoch marker: `<prefix>epoch`, or on a Cluster one per primary.
    pub(super) fn epoch_markers(&self) -> Vec<(NodeId, String)> {
        if !self.inner.connection.is_cluster() {
            let node = NodeId::primary();
            return self
                .node_marker(&node)
                .map(|m| (node, m))
                .into_iter()
                .collect();
        }
        let mut all: Vec<(NodeId, String)> = self
            .inner
            .markers
            .load()
            .iter()
            .map(|(n, m)| (NodeId(n.clone()), m.clone()))
            .collect();
        all.sort();
        all
    }

    /// `lua/fence.lua` on the node of `marker`: its epoch, made now when missing or made by
    /// another server (a restart, a failover). The epoch and how it came: 0 kept, 1 made, 2 made
    /// anew over another server's.
    pub(super) async fn fence_query(
        &self,
        node: &NodeId,
        marker: &str,
    ) -> redis::RedisResult<(String, u8)> {
        let mut eval = redis::cmd("EVAL");
        eval.arg(FENCE_SCRIPT)
            .arg(2)
            .arg(marker)
            .arg(format!("{marker}:run"));
        let v = self.query(eval).await?;
        let (epoch, kind) = match &v {
            Value::Array(items) => match &items[..] {
                [epoch, Value::Int(kind)] => (
                    redis::from_redis_value::<String>(epoch.clone())?,
                    u8::try_from(*kind).unwrap_or(0),
                ),
                _ => return Err(unexpected(&v)),
            },
            _ => return Err(unexpected(&v)),
        };
        self.observe(node, marker, &epoch, kind);
        Ok((epoch, kind))
    }

    /// A node's epoch as a fence found it (`kind`: 0 kept, 1 made, 2 made anew over another
    /// server's): one gone or changed since the last fence means the node lost its state or may
    /// hold an older one (a restart, a snapshot, a failover): logged at warn and counted
    /// (`ratelimit_store_resets_total`).
    pub(super) fn observe(&self, node: &NodeId, marker: &str, epoch: &str, kind: u8) {
        let before = self
            .inner
            .epochs_seen
            .lock()
            .expect("not poisoned")
            .insert(marker.to_string(), epoch.to_string());
        match before {
            Some(before) if before != epoch || kind != 0 => {
                self.inner.metrics.store_resets.inc();
                let what = match kind {
                    2 => "a new server holds it (restarted, from a snapshot or not, or a replica promoted): what it holds may be older than what was decided",
                    _ => "its epoch marker was gone or made anew (restarted empty, or flushed)",
                };
                tracing::warn!(
                    %marker,
                    node = %node.0,
                    policy = ?self.inner.options.store_reset,
                    "redis lost its state ({what}); buckets it no longer holds, or last wrote before the new epoch, start {} (--store-reset)",
                    match self.inner.options.store_reset {
                        StoreReset::Full => "full (or as it holds them)",
                        StoreReset::Empty => "empty at the new epoch and refill from there",
                    }
                );
            }
            None if kind != 0 => tracing::info!(
                %marker,
                "made the store's epoch marker (a new Redis, or one that lost its state or restarted before this sidecar started)"
            ),
            _ => {}
        }
    }

    /// [`Self::fence_query`] on `node`, bounded, and observed.
    pub(super) async fn fence(&self, node: &NodeId) -> Result<(String, u8), StoreError> {
        let marker = self.node_marker(node).ok_or_else(|| {
            StoreError::Redis(format!(
                "the epoch marker of node {} is not known yet (the cluster slot map is loading)",
                node.0
            ))
        })?;
        self.bounded(self.fence_query(node, &marker)).await
    }

    /// Runs a script call, `cmd(false)` (EVALSHA). A NOSCRIPT answer means the node's process
    /// is new (restarted, promoted, or its scripts flushed), so what it holds may be older than
    /// what the scripts last saw: its epoch is fenced first ([`Self::fence_query`]), then
    /// `cmd(true)` (EVAL) runs the call and caches the script again. No bucket script runs on a
    /// node before its epoch says what it holds (docs/bucket.md). Bounded by `limit`.
    pub(super) async fn run_healed(
        &self,
        node: &NodeId,
        cmd: impl Fn(bool) -> Cmd,
        limit: Duration,
    ) -> Result<Value, StoreError> {
        self.bounded_by(limit, async {
            match self.query(cmd(false)).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    // Built only here: the hot path never copies the script.
                    self.inner.metrics.script_loads.inc();
                    tracing::info!(
                        node = %node.0,
                        "NOSCRIPT from redis (a restart, a failover or a flush of its scripts): \
                         fencing the node's epoch, then loading the script by EVAL"
                    );
                    match self.node_marker(node) {
                        Some(marker) => {
                            self.fence_query(node, &marker).await?;
                        }
                        // Under `full` the epoch only counts losses: the watch fences the node
                        // once the slot map names it.
                        None if self.inner.options.store_reset == StoreReset::Full => {}
                        None => {
                            return Err(RedisError::from((
                                ErrorKind::Client,
                                "no epoch marker known for the node yet (slot map loading)",
                            )))
                        }
                    }
                    self.query(cmd(true)).await
                }
                other => other,
            }
        })
        .await
    }

    /// Fences each node's epoch (`lua/fence.lua`, which also makes a missing marker), so a loss
    /// is seen within [`EPOCH_CHECK`] whether or not a call ran there ([`Self::observe`]).
    pub(super) async fn check_epoch(&self) {
        for (node, marker) in self.epoch_markers() {
            if let Err(e) = self.fence(&node).await {
                tracing::debug!(%marker, "epoch marker not fenced: {e}");
            }
        }
    }
}
