//! `ratelimit-sidecar`: the decision service of the rate limiter. It answers `POST /v1/decide`
//! (the contract of `ratelimit-wire`) and Envoy's gRPC rate limit service
//! (`envoy.service.ratelimit.v3.RateLimitService`) on one listener, by running the token bucket of
//! `lua/bucket.lua` in Redis (one node, a primary found through Sentinel, or a Cluster), and
//! serves `/healthz`, `/readyz` and `/metrics`.
//!
//! Pure core, thin edges: [`policy`] owns the limits, [`decide`] validates calls, resolves limits
//! and answers from what the store ([`store::BucketStore`]) decided; the Redis store places the
//! requests on its nodes and keeps each all-or-nothing across them; [`regional`] reads this
//! region's shares through [`store::ShareStore`]. [`http`], [`grpc`] and `main` only adapt.
//! [`auth`] decides who may ask, [`listener`] accepts connections (TLS, HTTP/1.1 and HTTP/2).

pub mod auth;
pub mod calls;
pub mod config;
pub mod decide;
pub mod grpc;
pub mod http;
pub mod keys;
pub mod listener;
pub mod metrics;
pub mod policy;
pub mod regional;
pub mod rlqs;
pub mod secret;
pub mod store;
pub mod stream;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use config::Args;
use tokio::net::TcpListener;

use crate::auth::{Auth, AuthConfigError};
use crate::calls::AppState;
use crate::decide::Decider;
use crate::listener::TlsConfigError;
use crate::metrics::Metrics;
use crate::policy::reload::PolicyHandle;
use crate::policy::{Bounds, PolicyError, RegionScope};
use crate::regional::RegionalShares;
use crate::store::redis::StoreOptions;
use crate::store::{RedisStore, StoreError};

/// Why the sidecar could not serve.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("bad redis configuration: {0}")]
    Store(StoreError),
    #[error("invalid policy: {0}")]
    Policy(#[from] PolicyError),
    #[error("http server failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Auth(#[from] AuthConfigError),
    #[error("{0}")]
    Tls(#[from] TlsConfigError),
    #[error("cannot listen on --admin-listen {addr}: {source}")]
    AdminListen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(
        "refusing to serve decisions on --listen {0} without authentication: anyone who reaches \
         it could spend every client's budget. Configure a bearer token (--auth-token-file or \
         RATELIMIT_AUTH_TOKEN) or client certificates (--tls-client-ca), listen on a loopback \
         address, or pass --allow-unauthenticated to serve it unauthenticated on purpose"
    )]
    Unauthenticated(SocketAddr),
    #[error(
        "--rlqs-renew-ms {renew_ms} must be below --rlqs-assignment-ttl-s × 1000 − 2 × \
         --rlqs-delivery-margin-ms ({bound_ms} ms): a renewal must reach Envoy while its last \
         assignment is live"
    )]
    RlqsTiming { renew_ms: u64, bound_ms: u64 },
}

impl From<StoreError> for ServeError {
    fn from(e: StoreError) -> Self {
        ServeError::Store(e)
    }
}

/// The quota service's settings from the arguments, checked.
pub fn rlqs_settings(args: &Args) -> Result<rlqs::RlqsSettings, ServeError> {
    let timing = rlqs::plan::Timing {
        ttl_s: args.rlqs_assignment_ttl_s,
        margin_ms: args.rlqs_delivery_margin_ms,
    };
    let bound_ms = (timing.ttl_s * 1000).saturating_sub(2 * timing.margin_ms);
    if args.rlqs_renew_ms >= bound_ms {
        return Err(ServeError::RlqsTiming {
            renew_ms: args.rlqs_renew_ms,
            bound_ms,
        });
    }
    Ok(rlqs::RlqsSettings {
        timing,
        renew_ms: args.rlqs_renew_ms,
        max_buckets: usize::try_from(args.rlqs_max_buckets).unwrap_or(usize::MAX),
        max_message_bytes: args.max_body_bytes,
        store_calls_in_flight: usize::try_from(args.redis_pipeline).unwrap_or(1),
    })
}

/// [`serve`]'s refusal of an unauthenticated listener other hosts can reach, judged from the
/// arguments alone: called before binding `--listen`, so a refused configuration says why
/// without touching the port (which may be taken).
pub fn check_listen(args: &Args) -> Result<(), ServeError> {
    let configured =
        args.auth_token_file.is_some() || args.auth_token.is_some() || args.tls_client_ca.is_some();
    let loopback = args.listen.ip().to_canonical().is_loopback();
    if loopback || configured || args.allow_unauthenticated {
        return Ok(());
    }
    Err(ServeError::Unauthenticated(args.listen))
}

/// Refuses a listener that other hosts can reach when no caller is authenticated, unless
/// `--allow-unauthenticated` says so.
fn check_exposure(
    addr: SocketAddr,
    authenticated: bool,
    allow_unauthenticated: bool,
) -> Result<(), ServeError> {
    let loopback = addr.ip().to_canonical().is_loopback();
    if loopback || authenticated {
        return Ok(());
    }
    if !allow_unauthenticated {
        return Err(ServeError::Unauthenticated(addr));
    }
    tracing::warn!(
        %addr,
        "serving decisions without authentication on a non-loopback address \
         (--allow-unauthenticated)"
    );
    Ok(())
}

/// Serves the sidecar on `listener` until `shutdown` completes (and, with `--admin-listen`,
/// `/healthz`, `/readyz` and `/metrics` on a second, plain listener).
///
/// Refuses to start when a file of `--auth-token-file`, `--tls-*` or `--redis-*` cannot be used,
/// or when `listener` is reachable from other hosts and nothing authenticates callers (see
/// `--allow-unauthenticated`).
///
/// Redis is connected lazily: the server starts while Redis is down (`/readyz` answers 503 until
/// it answers). A background task loads the script and checks `maxmemory-policy` as soon as Redis
/// answers, and warns when that policy can evict buckets.
pub async fn serve(
    args: Args,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    listener::install_crypto_provider();
    let auth = Auth::load(args.auth_token_file.as_deref(), args.auth_token.as_ref())?;
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(listener::tls_acceptor(
            cert,
            key,
            args.tls_client_ca.as_deref(),
        )?),
        _ => None,
    };
    let addr = listener.local_addr()?;
    check_exposure(
        addr,
        auth.is_some() || args.tls_client_ca.is_some(),
        args.allow_unauthenticated,
    )?;
    let metrics = Arc::new(Metrics::new());
    let policy = PolicyHandle::load(
        args.limits.clone(),
        Bounds {
            max_refill_s: args.max_refill_seconds,
            region: RegionScope::Sidecar(args.region.clone()),
        },
        metrics.clone(),
    )?;
    let _reloads = policy.watch();
    let options = StoreOptions {
        timeout_ms: args.redis_timeout_ms,
        record_ttl_ms: args.attempt_ttl_ms,
        receipt_ttl_ms: args.receipt_ttl_ms,
        lease_max_share: args.lease_max_share,
        max_in_flight: args.redis_pipeline as usize,
        max_call_decisions: ratelimit_wire::MAX_CALL_DECISIONS,
        store_reset: args.store_reset,
        key_prefix: args.key_prefix.clone(),
    };
    let connection = args.redis_connection()?;
    let admin = match args.admin_listen {
        None => None,
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServeError::AdminListen { addr, source })?,
        ),
    };
    let store = Arc::new(RedisStore::new(connection, options, metrics.clone()));
    store.start_background();
    let startup_check = tokio::spawn(check_redis_until_ready(store.clone()));
    let mut decider = Decider::new(store.clone(), policy.clone(), metrics.clone());
    // With a region: read its shares of the regional rules, publish their demand.
    let mut regional_tasks = Vec::new();
    if let Some(region) = &args.region {
        let shares = RegionalShares::new(
            region.clone(),
            Duration::from_millis(args.redis_timeout_ms),
            metrics.clone(),
        );
        regional_tasks = shares.start(store, policy);
        decider = decider.with_regional(shares);
        tracing::info!(%region, "regional shares of this region apply to regional rules");
    }
    let (begin_stopping, stopping) = calls::Stopping::new();
    let state = Arc::new(AppState {
        decider: Arc::new(decider),
        metrics,
        grpc: crate::grpc::Answering {
            headers: args.grpc_response_headers,
            charged_metadata: args.grpc_charged_metadata,
        },
        stopping,
    });
    let app = http::router(state.clone(), args.max_body_bytes).merge(
        rlqs::RlqsApi::new(
            state.decider.clone(),
            rlqs_settings(&args)?,
            state.stopping.clone(),
        )
        .into_router(),
    );
    let token_watch = auth
        .clone()
        .and_then(|a| a.watch_token_file(auth::TOKEN_FILE_CHECK_INTERVAL));
    let main_app = match &auth {
        Some(a) => auth::protect(app.clone(), a.clone(), state.metrics.clone()),
        None => app.clone(),
    };
    tracing::info!(
        %addr,
        tls = tls.is_some(),
        client_certificates = args.tls_client_ca.is_some(),
        bearer_tokens = auth.is_some(),
        "serving"
    );
    let limits = listener::ConnectionLimits {
        header_timeout: Duration::from_millis(args.header_timeout_ms),
        max_connections: usize::try_from(args.max_connections).unwrap_or(usize::MAX),
    };
    let (stop, stopped) = tokio::sync::watch::channel(());
    let signal = tokio::spawn(async move {
        shutdown.await;
        // The streams per worker end first: a connection drains only once its streams have.
        let _ = begin_stopping.send(true);
        let _ = stop.send(());
    });
    let on_stop = |mut rx: tokio::sync::watch::Receiver<()>| async move {
        let _ = rx.changed().await;
    };
    let admin_served = async {
        match admin {
            None => Ok(()),
            Some(admin) => {
                tracing::info!(addr = %admin.local_addr()?, "serving /healthz, /readyz, /metrics");
                let admin_app = auth::open_paths_only(app);
                listener::serve(admin, None, admin_app, limits, on_stop(stopped.clone())).await
            }
        }
    };
    let served = tokio::try_join!(
        listener::serve(listener, tls, main_app, limits, on_stop(stopped.clone())),
        admin_served
    );
    signal.abort();
    startup_check.abort();
    for t in regional_tasks {
        t.abort();
    }
    if let Some(t) = token_watch {
        t.abort();
    }
    served?;
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_may_serve_without_authentication() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        for loopback in [
            "127.0.0.1:8081",
            "127.9.9.9:1",
            "[::1]:8081",
            "[::ffff:127.0.0.1]:1",
        ] {
            assert!(
                check_exposure(a(loopback), false, false).is_ok(),
                "{loopback}"
            );
        }
        for exposed in ["0.0.0.0:8081", "10.1.2.3:8081", "[::]:8081"] {
            let e = check_exposure(a(exposed), false, false)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("--allow-unauthenticated") && e.contains(exposed),
                "{e}"
            );
            assert!(check_exposure(a(exposed), true, false).is_ok());
            assert!(check_exposure(a(exposed), false, true).is_ok());
        }
    }

    #[test]
    fn the_arguments_alone_refuse_an_exposed_listener_before_it_is_bound() {
        use clap::Parser;
        let args = |listen: &str, extra: &[&str]| {
            let mut argv = vec![
                "ratelimit-sidecar",
                "--limits",
                "limits.yaml",
                "--listen",
                listen,
            ];
            argv.extend_from_slice(extra);
            Args::try_parse_from(argv).unwrap()
        };
        let exposed = "0.0.0.0:8081";
        let e = check_listen(&args(exposed, &[])).unwrap_err().to_string();
        assert!(
            e.contains("--allow-unauthenticated") && e.contains(exposed),
            "{e}"
        );
        assert!(check_listen(&args(exposed, &["--allow-unauthenticated"])).is_ok());
        assert!(check_listen(&args(exposed, &["--auth-token-file", "/nonexistent"])).is_ok());
        assert!(check_listen(&args("127.0.0.1:8081", &[])).is_ok());
    }
}
