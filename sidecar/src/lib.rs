//! `ratelimit-sidecar`: the decision service of the rate limiter. It answers `POST /v1/decide`
//! (the contract of `ratelimit-wire`) and Envoy's gRPC rate limit service
//! (`envoy.service.ratelimit.v3.RateLimitService`) on one listener, by running the token bucket of
//! `lua/token_bucket.lua` in Redis (one node, a primary found through Sentinel, or a Cluster), and
//! serves `/healthz`, `/readyz` and `/metrics`.
//!
//! Pure core, thin edges: [`policy`] owns the limits, [`decide`] validates calls, resolves limits,
//! splits the work by Redis node and merges answers, behind the [`store::BucketStore`] trait;
//! [`http`], [`grpc`] and `main` only adapt.

pub mod config;
pub mod decide;
pub mod grpc;
pub mod http;
pub mod keys;
pub mod metrics;
pub mod policy;
pub mod store;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

pub use config::Args;
use tokio::net::TcpListener;

use crate::decide::Decider;
use crate::http::AppState;
use crate::metrics::Metrics;
use crate::policy::reload::PolicyHandle;
use crate::policy::{Bounds, PolicyError};
use crate::store::redis_store::StoreOptions;
use crate::store::{RedisStore, StoreError};

/// Why the sidecar could not serve.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("bad redis configuration: {0}")]
    Store(#[from] StoreError),
    #[error("invalid policy: {0}")]
    Policy(#[from] PolicyError),
    #[error("http server failed: {0}")]
    Io(#[from] std::io::Error),
}

/// Serves the sidecar on `listener` until `shutdown` completes.
///
/// Redis is connected lazily: the server starts while Redis is down (`/readyz` answers 503 until
/// it answers). A background task loads the script and checks `maxmemory-policy` as soon as Redis
/// answers, and warns when that policy can evict buckets.
pub async fn serve(
    args: Args,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let metrics = Arc::new(Metrics::new());
    let policy = PolicyHandle::load(
        args.limits.clone(),
        Bounds {
            max_refill_s: args.max_refill_seconds,
        },
        metrics.clone(),
    )?;
    let _reloads = policy.watch();
    let options = StoreOptions {
        timeout_ms: args.redis_timeout_ms,
        record_ttl_ms: args.attempt_ttl_ms,
        lease_max_share: args.lease_max_share,
        max_in_flight: args.redis_pipeline as usize,
        max_call_decisions: ratelimit_wire::MAX_CALL_DECISIONS,
    };
    let store = Arc::new(if !args.redis_sentinel.is_empty() {
        RedisStore::sentinel(
            &args.redis_sentinel,
            &args.sentinel_master,
            options,
            metrics.clone(),
        )?
    } else if args.redis_cluster.is_empty() {
        RedisStore::single(
            &args.redis,
            args.redis_connections as usize,
            options,
            metrics.clone(),
        )?
    } else {
        RedisStore::cluster(&args.redis_cluster, options, metrics.clone())?
    });
    store.start_background();
    let startup_check = tokio::spawn(check_redis_until_ready(store.clone()));
    let state = Arc::new(AppState {
        decider: Arc::new(Decider::new(
            store,
            policy,
            args.key_prefix.clone(),
            metrics.clone(),
        )),
        metrics,
    });
    let app = http::router(state, args.max_body_bytes);
    tracing::info!(addr = %listener.local_addr()?, "serving");
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await;
    startup_check.abort();
    Ok(served?)
}

/// Polls Redis until it answers once, then logs what it found (script, eviction policy).
async fn check_redis_until_ready(store: Arc<RedisStore>) {
    let mut logged_down = false;
    loop {
        let r = store.check_readiness().await;
        if r.redis_ok {
            tracing::info!(
                script_loaded = r.script_loaded,
                maxmemory_policy = ?r.maxmemory_policy,
                "redis answers"
            );
            if let Some(w) = &r.warning {
                tracing::warn!("{w}");
            }
            return;
        }
        if !logged_down {
            tracing::warn!(
                "redis does not answer yet ({}); retrying every second",
                r.error.unwrap_or_default()
            );
            logged_down = true;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
