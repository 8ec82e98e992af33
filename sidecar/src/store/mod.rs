//! Where buckets live: the [`BucketStore`] trait the decision logic talks to, and its Redis
//! implementation that runs `lua/token_bucket.lua`:
//! - [`connection`]: how Redis is reached (one node, the primary Sentinel names, a Cluster);
//! - [`sentinel`]: the Sentinel lookup of the primary;
//! - [`redis_store`]: the script calls and the readiness check over a connection.
//!
//! The script is embedded from `lua/` and called by EVALSHA; a NOSCRIPT answer (a restarted node,
//! a failover, a new Cluster primary) is healed by an EVAL of the same call, which also caches the
//! script on that node. No NOSCRIPT ever reaches a caller. Every call is bounded by
//! `--redis-timeout-ms`; a script call whose outcome is unknown (timeout) is never retried here.

pub mod connection;
pub mod redis_store;
pub mod sentinel;

use std::future::Future;

use ratelimit_wire::Reason;
use redis::{ErrorKind, RedisError, ServerErrorKind};

pub use redis_store::RedisStore;

/// The bucket script, one source of truth in `lua/`.
pub const SCRIPT: &str = include_str!("../../../lua/token_bucket.lua");

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
    /// The store cannot be set up as configured (a URL, a file, TLS material); found at start.
    #[error("{0}")]
    Config(String),
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
pub(crate) fn is_script_failure(e: &RedisError) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn sha1_is_computed_from_the_embedded_script() {
        let sha = script_sha1();
        assert_eq!(sha.len(), 40);
        assert!(SCRIPT.contains("redis.call('TIME')"));
    }
}
