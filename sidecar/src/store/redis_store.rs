//! The Redis store: the bucket script's calls and the readiness check over a [`Connection`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use ratelimit_wire::Reason;
use redis::cluster_routing::ResponsePolicy;
use redis::{Cmd, ErrorKind, ServerErrorKind, Value};

use super::connection::Connection;
use super::{
    eviction_warning, is_script_failure, script_sha1, BucketCall, BucketStore, Outcome, Readiness,
    StoreError, SCRIPT,
};
use crate::metrics::Metrics;

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
        let connection = Connection::single(url, connections, timeout_ms)?;
        Ok(Self::new(connection, timeout_ms, attempt_ttl_ms, metrics))
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
        let connection = Connection::sentinel(sentinels, master, timeout_ms)?;
        Ok(Self::new(connection, timeout_ms, attempt_ttl_ms, metrics))
    }

    /// A store on a Redis Cluster found through `seeds`. Connects in the background.
    pub fn cluster(
        seeds: &[String],
        timeout_ms: u64,
        attempt_ttl_ms: u64,
        metrics: Arc<Metrics>,
    ) -> Result<Self, StoreError> {
        let connection = Connection::cluster(seeds, timeout_ms)?;
        Ok(Self::new(connection, timeout_ms, attempt_ttl_ms, metrics))
    }

    pub fn new(
        connection: Connection,
        timeout_ms: u64,
        attempt_ttl_ms: u64,
        m: Arc<Metrics>,
    ) -> Self {
        Self {
            connection,
            sha1: script_sha1(),
            timeout: Duration::from_millis(timeout_ms),
            attempt_ttl_ms,
            metrics: m,
        }
    }

    async fn query(&self, cmd: Cmd) -> redis::RedisResult<Value> {
        self.connection.query(cmd).await
    }

    async fn query_all_primaries(
        &self,
        cmd: Cmd,
        policy: Option<ResponsePolicy>,
    ) -> redis::RedisResult<Value> {
        self.connection.query_all_primaries(cmd, policy).await
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
        self.connection.is_cluster()
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
