//! How the sidecar reaches Redis: one node (several multiplexed, auto-reconnecting connections
//! used round-robin), the primary Sentinel names (one multiplexed connection, looked up again
//! after a failover) or a Cluster (one cluster connection, MOVED/ASK followed by the client).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{AsyncConnectionConfig, Cmd, Value};

use super::sentinel::{LookupState, SentinelPrimary};
use super::StoreError;

pub enum Connection {
    Single {
        connections: Vec<ConnectionManager>,
        next: AtomicUsize,
    },
    Sentinel(Arc<SentinelPrimary>),
    Cluster(ClusterConnection),
}

impl Connection {
    /// A connection to one Redis. Connects lazily: this succeeds while Redis is down.
    pub fn single(url: &str, connections: usize, timeout_ms: u64) -> Result<Self, StoreError> {
        let client = redis::Client::open(url)
            .map_err(|e| StoreError::Redis(format!("--redis {url}: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(timeout_ms.max(1000))))
            .set_max_delay(Duration::from_millis(500));
        let connections = (0..connections.max(1))
            .map(|_| ConnectionManager::new_lazy_with_config(client.clone(), config.clone()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| StoreError::Redis(format!("--redis {url}: {e}")))?;
        Ok(Connection::Single {
            connections,
            next: AtomicUsize::new(0),
        })
    }

    /// A connection to the primary that the Sentinels at `sentinels` name `master`. Connects lazily:
    /// this succeeds while the Sentinels and Redis are down.
    pub fn sentinel(
        sentinels: &[String],
        master: &str,
        timeout_ms: u64,
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
        Ok(Connection::Sentinel(Arc::new(SentinelPrimary {
            sentinel: tokio::sync::Mutex::new(client),
            state: Mutex::new(LookupState::default()),
            lookups: AtomicU64::new(0),
            what,
            config,
            lookup_timeout,
            command_timeout: Duration::from_millis(timeout_ms),
        })))
    }

    /// A connection to a Redis Cluster found through `seeds`. Connects in the background.
    pub fn cluster(seeds: &[String], timeout_ms: u64) -> Result<Self, StoreError> {
        let client = ClusterClientBuilder::new(seeds.to_vec())
            .build()
            .map_err(|e| StoreError::Redis(format!("--redis-cluster {}: {e}", seeds.join(","))))?;
        let config = ClusterConfig::new()
            .set_connection_timeout(Duration::from_millis(timeout_ms.max(1000)));
        let connection = client.get_pending_async_connection_with_config(config);
        Ok(Connection::Cluster(connection))
    }

    /// Sends one command to the node of its key (or any node for keyless commands).
    pub async fn query(&self, cmd: Cmd) -> redis::RedisResult<Value> {
        match self {
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
    pub async fn query_all_primaries(
        &self,
        cmd: Cmd,
        policy: Option<ResponsePolicy>,
    ) -> redis::RedisResult<Value> {
        match self {
            Connection::Single { .. } | Connection::Sentinel(_) => self.query(cmd).await,
            Connection::Cluster(c) => {
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, policy));
                c.clone().route_command(cmd, routing).await
            }
        }
    }

    /// Whether keys are spread over Cluster slots.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Connection::Cluster(_))
    }
}
