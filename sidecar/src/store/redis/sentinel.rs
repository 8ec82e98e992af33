//! The primary that Sentinel names, and one multiplexed connection to it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, FutureExt, Shared};
use redis::aio::MultiplexedConnection;
use redis::sentinel::SentinelClient;
use redis::{AsyncConnectionConfig, Cmd, ErrorKind, RedisError, ServerErrorKind, Value};

/// The primary that Sentinel names, and one multiplexed connection to it.
///
/// The connection is made on first use (so the sidecar starts while Sentinel is down) and
/// forgotten when it fails in a way that may mean "this is no longer the primary": an I/O or
/// connection error, a READONLY answer (a demoted primary is a replica now), or a command that got
/// no answer within `--redis-timeout-ms` (a hung or partitioned primary never sends an error).
/// Each command runs in a task of its own, so a caller that goes away (Envoy's callout timeout
/// makes hyper drop the handler) neither cancels it nor counts as a timeout. The next call asks
/// Sentinel again, so after a failover decisions reach the new primary without a restart; the
/// call that met the error answers 503 like any other Redis error.
///
/// Lookups are single-flight: all callers without a primary share the one lookup in flight, and
/// after a failed lookup callers get its error at once for [`LOOKUP_BACKOFF`] before the next
/// lookup starts, so a Sentinel outage neither piles up tasks nor floods the Sentinels.
pub struct SentinelPrimary {
    /// Asked one lookup at a time (it caches its connections to the Sentinels).
    pub(crate) sentinel: tokio::sync::Mutex<SentinelClient>,
    pub(crate) state: Mutex<LookupState>,
    /// Lookups that found a primary so far (each connection's generation).
    pub(crate) lookups: AtomicU64,
    /// The primary's name at the Sentinels (`--sentinel-master`).
    pub(crate) master: String,
    /// A connection to one Sentinel, kept between [`Self::confirm`]'s looks (made again after
    /// an error): a look costs a Sentinel one command, the primary nothing.
    pub(crate) watch: tokio::sync::Mutex<Option<MultiplexedConnection>>,
    /// Names what is being looked up, in errors and logs.
    pub(crate) what: String,
    pub(crate) config: AsyncConnectionConfig,
    /// Upper bound of one lookup (Sentinel, the primary's ROLE, the connection to it).
    pub(crate) lookup_timeout: Duration,
    /// Upper bound of one command on the primary (`--redis-timeout-ms`).
    pub(crate) command_timeout: Duration,
}

/// How long callers get a failed lookup's error before a new lookup is started.
const LOOKUP_BACKOFF: Duration = Duration::from_millis(100);

/// A lookup's result as every waiting caller gets it (a `RedisError` is not `Clone`).
type SharedLookup = Shared<BoxFuture<'static, Result<Arc<Primary>, String>>>;

#[derive(Default)]
pub(crate) struct LookupState {
    current: Option<Arc<Primary>>,
    in_flight: Option<SharedLookup>,
    /// When the last lookup failed, and why.
    failed: Option<(Instant, String)>,
}

struct Primary {
    connection: MultiplexedConnection,
    address: String,
    /// Which lookup made this connection, so a late failure forgets only its own.
    generation: u64,
}

fn lookup_error(message: String) -> RedisError {
    RedisError::from(std::io::Error::other(message))
}

impl SentinelPrimary {
    /// The current primary, or the result of the one lookup in flight (started here if none is
    /// and the last one did not fail within [`LOOKUP_BACKOFF`]). The lookup runs in its own task:
    /// a caller that gives up (timeout) does not cancel it, the others still get its result.
    async fn primary(self: &Arc<Self>) -> redis::RedisResult<Arc<Primary>> {
        let lookup = {
            let mut state = self.state.lock().expect("not poisoned");
            if let Some(p) = &state.current {
                return Ok(p.clone());
            }
            match (&state.in_flight, &state.failed) {
                (Some(lookup), _) => lookup.clone(),
                (None, Some((at, why))) if at.elapsed() < LOOKUP_BACKOFF => {
                    return Err(lookup_error(why.clone()));
                }
                (None, _) => {
                    let this = self.clone();
                    let task = tokio::spawn(async move { this.look_up().await });
                    let lookup = async move {
                        task.await
                            .unwrap_or_else(|e| Err(format!("Sentinel lookup task: {e}")))
                    }
                    .boxed()
                    .shared();
                    state.in_flight = Some(lookup.clone());
                    lookup
                }
            }
        };
        lookup.await.map_err(lookup_error)
    }

    /// One lookup; records its result in `state` and ends the flight.
    async fn look_up(&self) -> Result<Arc<Primary>, String> {
        let result = self.ask_sentinel().await;
        let mut state = self.state.lock().expect("not poisoned");
        state.in_flight = None;
        match &result {
            Ok(p) => {
                tracing::info!(primary = %p.address, "{}: connected to the primary", self.what);
                state.current = Some(p.clone());
                state.failed = None;
            }
            Err(e) => state.failed = Some((Instant::now(), e.clone())),
        }
        result
    }

    async fn ask_sentinel(&self) -> Result<Arc<Primary>, String> {
        let mut sentinel = self.sentinel.lock().await;
        let found = tokio::time::timeout(self.lookup_timeout, async {
            let client = sentinel.async_get_client().await?;
            let address = client.get_connection_info().addr().to_string();
            let connection = client
                .get_multiplexed_async_connection_with_config(&self.config)
                .await?;
            Ok::<_, RedisError>((address, connection))
        })
        .await;
        match found {
            Ok(Ok((address, connection))) => Ok(Arc::new(Primary {
                connection,
                address,
                generation: self.lookups.fetch_add(1, Ordering::Relaxed) + 1,
            })),
            Ok(Err(e)) => Err(format!("{}: {e}", self.what)),
            Err(_) => Err(format!(
                "{}: no answer within {} ms",
                self.what,
                self.lookup_timeout.as_millis()
            )),
        }
    }

    /// Forgets the connection of `generation` (if still current): the next call asks Sentinel.
    fn forget(&self, generation: u64, why: &str) {
        let mut state = self.state.lock().expect("not poisoned");
        if let Some(p) = state
            .current
            .as_ref()
            .filter(|p| p.generation == generation)
        {
            tracing::warn!(primary = %p.address, "{}: {why}; asking Sentinel again", self.what);
            state.current = None;
        }
    }

    /// Asks Sentinel which primary it names now, and forgets the connection in use when that is
    /// another server: an old primary that came back before Sentinel made it a replica still
    /// answers, so no error would ever send the sidecar away from it, and two primaries would
    /// decide side by side (a split brain) until Sentinel's next look at the old one, up to
    /// 10 s later. Run every second by the store's watch; a lookup that fails or finds no
    /// primary keeps the connection (the commands' own errors send it back to Sentinel).
    pub(crate) async fn confirm(self: &Arc<Self>) {
        let current = self.state.lock().expect("not poisoned").current.clone();
        let Some(current) = current else {
            return;
        };
        let mut watch = self.watch.lock().await;
        if watch.is_none() {
            let made = tokio::time::timeout(self.lookup_timeout, async {
                let client = self
                    .sentinel
                    .lock()
                    .await
                    .async_get_sentinel_client()
                    .await?;
                client
                    .get_multiplexed_async_connection_with_config(&self.config)
                    .await
            })
            .await;
            *watch = made.ok().and_then(Result::ok);
        }
        let Some(connection) = watch.as_mut() else {
            return;
        };
        let mut ask = redis::cmd("SENTINEL");
        ask.arg("get-master-addr-by-name").arg(&self.master);
        let named = tokio::time::timeout(
            self.lookup_timeout,
            ask.query_async::<Option<(String, u16)>>(connection),
        )
        .await;
        match named {
            Ok(Ok(Some((host, port)))) => {
                let address = format!("{host}:{port}");
                if address != current.address {
                    self.forget(
                        current.generation,
                        &format!("Sentinel names {address} the primary now"),
                    );
                }
            }
            Ok(Ok(None)) => {}
            // Asked again through a new connection next time.
            _ => *watch = None,
        }
    }

    pub(crate) async fn query(self: &Arc<Self>, cmd: Cmd) -> redis::RedisResult<Value> {
        let primary = self.primary().await?;
        let this = self.clone();
        tokio::spawn(async move {
            let mut connection = primary.connection.clone();
            match tokio::time::timeout(this.command_timeout, cmd.query_async(&mut connection)).await
            {
                Ok(Err(e)) if moves_the_primary(&e) => {
                    this.forget(primary.generation, &e.to_string());
                    Err(e)
                }
                Ok(result) => result,
                Err(_) => {
                    let why = format!("no answer within {} ms", this.command_timeout.as_millis());
                    this.forget(primary.generation, &why);
                    Err(lookup_error(format!("{}: {why}", primary.address)))
                }
            }
        })
        .await
        .map_err(|e| lookup_error(format!("Sentinel command task: {e}")))?
    }
}

/// Whether an error may mean the connection no longer reaches the primary.
pub(crate) fn moves_the_primary(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
        || e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.is_unrecoverable_error()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readonly_and_broken_connections_send_the_sentinel_store_back_to_sentinel() {
        let readonly = RedisError::from((
            ErrorKind::Server(ServerErrorKind::ReadOnly),
            "You can't write against a read only replica.",
        ));
        assert!(moves_the_primary(&readonly));
        let refused = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(moves_the_primary(&refused));
        let noscript = RedisError::from((ErrorKind::Server(ServerErrorKind::NoScript), "NOSCRIPT"));
        assert!(!moves_the_primary(&noscript));
    }
}
