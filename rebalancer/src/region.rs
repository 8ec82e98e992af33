//! One region's Redis as the rebalancer uses it: read a rule's share record and demand counters,
//! write a share (the versioned script of `ratelimit_sidecar::regional::record`), and the leader
//! lock. Every call is bounded by the timeout; a connection is made on first use and again after
//! it failed, so a region that comes back is reachable again.

use std::time::Duration;

use ratelimit_sidecar::regional::record::{self, ShareWrite, StoredShare};
use redis::aio::ConnectionManager;
use redis::{Cmd, TlsCertificates, Value};
use tokio::sync::Mutex;

/// Why a call got no usable answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RegionError {
    #[error("region {region}: no answer within {timeout_ms} ms")]
    Timeout { region: String, timeout_ms: u64 },
    #[error("region {region}: {message}")]
    Redis { region: String, message: String },
    /// Redis answered with an error: the command was not applied.
    #[error("region {region}: {message}")]
    Refused { region: String, message: String },
    /// Redis answered, but what it holds cannot be used (a record that does not parse).
    #[error("region {region}: {message}")]
    Data { region: String, message: String },
}

/// What became of a share write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteAnswer {
    Written,
    /// Not applied: the record holds this version, at least as new.
    Refused {
        stored_version: u64,
    },
}

/// A region's Redis.
pub struct Region {
    pub name: String,
    url: String,
    timeout: Duration,
    /// The CA and client certificate for a `rediss://` URL (`None`: the system's roots).
    tls: Option<TlsCertificates>,
    connection: Mutex<Option<ConnectionManager>>,
}

/// The leader lock's renewal: extend it only while it is ours.
const RENEW: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                     return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end";
/// Its release: delete it only while it is ours.
const RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                       return redis.call('DEL', KEYS[1]) else return 0 end";

impl Region {
    pub fn new(name: &str, url: &str, timeout_ms: u64) -> Region {
        Region {
            name: name.to_string(),
            url: url.to_string(),
            timeout: Duration::from_millis(timeout_ms),
            tls: None,
            connection: Mutex::new(None),
        }
    }

    /// With TLS material (`--redis-ca-file`, `--redis-client-cert`/`--redis-client-key`) for its
    /// `rediss://` URL.
    pub fn with_tls(mut self, tls: Option<TlsCertificates>) -> Region {
        self.tls = tls;
        self
    }

    fn error(&self, message: impl Into<String>) -> RegionError {
        RegionError::Redis {
            region: self.name.clone(),
            message: message.into(),
        }
    }

    /// One command, bounded by the timeout; the connection is dropped after a failure.
    async fn query(&self, cmd: Cmd) -> Result<Value, RegionError> {
        let timeout_ms = self.timeout.as_millis() as u64;
        let timed_out = || RegionError::Timeout {
            region: self.name.clone(),
            timeout_ms,
        };
        let mut guard = self.connection.lock().await;
        if guard.is_none() {
            let client = match &self.tls {
                None => redis::Client::open(self.url.as_str()),
                Some(tls) => redis::Client::build_with_tls(self.url.as_str(), tls.clone()),
            }
            .map_err(|e| self.error(format!("bad URL: {e}")))?;
            let connect = ConnectionManager::new(client);
            let manager = tokio::time::timeout(self.timeout, connect)
                .await
                .map_err(|_| timed_out())?
                .map_err(|e| self.error(format!("cannot connect: {e}")))?;
            *guard = Some(manager);
        }
        let mut conn = guard.clone().expect("connected above");
        drop(guard);
        let answer = tokio::time::timeout(self.timeout, cmd.query_async::<Value>(&mut conn)).await;
        let failed = |e: RegionError| async {
            *self.connection.lock().await = None;
            Err(e)
        };
        match answer {
            Err(_) => failed(timed_out()).await,
            Ok(Err(e)) if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() => {
                failed(self.error(e.to_string())).await
            }
            Ok(Err(e)) => Err(RegionError::Refused {
                region: self.name.clone(),
                message: e.to_string(),
            }),
            Ok(Ok(v)) => Ok(v),
        }
    }

    async fn hash(&self, key: &str) -> Result<Vec<(String, String)>, RegionError> {
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(key);
        let v = self.query(cmd).await?;
        redis::from_redis_value::<std::collections::BTreeMap<String, String>>(v)
            .map(|m| m.into_iter().collect())
            .map_err(|e| self.error(format!("HGETALL {key}: {e}")))
    }

    /// The share record at `key` (`None`: there is none yet), and whether the Redis process that
    /// answered wrote it ([`StoredShare::written_by`]: `false` after a restart or a failover).
    pub async fn read_record(&self, key: &str) -> Result<Option<(StoredShare, bool)>, RegionError> {
        let (fields, live_run_id) = record::parse_read(self.query(record::read_cmd(key)).await?)
            .map_err(|e| self.error(format!("{key}: {e}")))?;
        let parsed = record::parse(&fields).map_err(|message| RegionError::Data {
            region: self.name.clone(),
            message: format!("{key}: {message}"),
        })?;
        Ok(parsed.map(|r| {
            let trusted = r.written_by(&live_run_id);
            (r, trusted)
        }))
    }

    /// The demand counters at `key`: tokens (admitted, rejected) since they were created.
    pub async fn read_demand(&self, key: &str) -> Result<(u64, u64), RegionError> {
        let fields = self.hash(key).await?;
        record::parse_demand(&fields).map_err(|message| RegionError::Data {
            region: self.name.clone(),
            message: format!("{key}: {message}"),
        })
    }

    /// Writes a share (applied only if its version is newer); with `wait_replicas`, a write fewer
    /// replicas acknowledged within the timeout is an error (its outcome is unknown: it may be
    /// lost in a failover).
    pub async fn write_share(
        &self,
        key: &str,
        write: &ShareWrite,
        wait_replicas: u64,
    ) -> Result<WriteAnswer, RegionError> {
        let v = self.query(write.cmd(key)).await?;
        let (applied, version): (u64, u64) = redis::from_redis_value(v)
            .map_err(|e| self.error(format!("unexpected reply to the share write: {e}")))?;
        if applied == 0 {
            return Ok(WriteAnswer::Refused {
                stored_version: version,
            });
        }
        if wait_replicas > 0 {
            let mut wait = redis::cmd("WAIT");
            wait.arg(wait_replicas).arg(self.timeout.as_millis() as u64);
            let acked: u64 = redis::from_redis_value(self.query(wait).await?)
                .map_err(|e| self.error(format!("unexpected reply to WAIT: {e}")))?;
            if acked < wait_replicas {
                return Err(self.error(format!(
                    "the share write reached {acked} of {wait_replicas} replicas (--wait-replicas)"
                )));
            }
        }
        Ok(WriteAnswer::Written)
    }

    /// Takes or renews the leader lock `key` for `holder`; whether this holder leads now.
    pub async fn lead(&self, key: &str, holder: &str, ttl_ms: u64) -> Result<bool, RegionError> {
        let mut set = redis::cmd("SET");
        set.arg(key).arg(holder).arg("NX").arg("PX").arg(ttl_ms);
        if !matches!(self.query(set).await?, Value::Nil) {
            return Ok(true);
        }
        let mut renew = redis::cmd("EVAL");
        renew.arg(RENEW).arg(1).arg(key).arg(holder).arg(ttl_ms);
        Ok(matches!(self.query(renew).await?, Value::Int(1)))
    }

    /// Gives the leader lock up, if `holder` has it.
    pub async fn resign(&self, key: &str, holder: &str) -> Result<(), RegionError> {
        let mut release = redis::cmd("EVAL");
        release.arg(RELEASE).arg(1).arg(key).arg(holder);
        self.query(release).await.map(|_| ())
    }
}
