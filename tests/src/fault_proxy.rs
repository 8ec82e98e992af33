//! A fault-injecting TCP proxy between the sidecar and Redis, in-process (tokio, on a thread of
//! its own), for the "uncertain result" faults: Redis applies a script call, and its reply never
//! reaches the caller.
//!
//! Every byte is forwarded both ways (Redis's answers after [`FaultProxy::delay_replies`], if set)
//! until the proxy is armed with [`FaultProxy::lose_replies`].
//! Then the next script call (a command whose name is `EVALSHA` or `EVAL`) is forwarded to Redis
//! as usual, but what Redis answers on that connection is thrown away and the connection is closed
//! both ways as soon as that answer arrives: the script ran to completion (its reply exists), the
//! caller saw a dead connection. Closing, rather than holding the reply back, keeps the caller's
//! pipelined connection consistent: a reply withheld from the middle of a pipeline would pair every
//! later reply with the wrong request.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// What the proxy counts.
#[derive(Default)]
struct Counters {
    /// Script calls still to be answered into the void.
    armed: AtomicU64,
    /// Replies thrown away (connections closed after Redis answered).
    lost: AtomicU64,
    /// Connections accepted.
    connections: AtomicU64,
    /// How long each chunk of Redis's answers is held before it is forwarded, in ms.
    delay_ms: AtomicU64,
}

/// The proxy: listens on `127.0.0.1:<port>`, forwards to `127.0.0.1:<upstream>`; stops on drop.
pub struct FaultProxy {
    pub port: u16,
    counters: Arc<Counters>,
    _listener: Listener,
}

/// A listener on a free loopback port, served on a thread of its own (a one-worker tokio
/// runtime): each accepted connection goes to the future `serve` makes of it. Stops on drop.
pub struct Listener {
    pub port: u16,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Listener {
    /// Listens on `127.0.0.1:0`; `name` names it in panics.
    pub fn start<F, Fut>(name: &str, serve: F) -> Listener
    where
        F: Fn(TcpStream) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap_or_else(|e| panic!("bind the {name}: {e}"));
        Listener::start_on(name, listener, None, serve)
    }

    /// Serves `listener` (bound in whichever network namespace it was) from a runtime whose
    /// threads are in namespace `netns` (none: this process's): the connections `serve` opens
    /// are that namespace's.
    pub fn start_on<F, Fut>(
        name: &str,
        listener: std::net::TcpListener,
        netns: Option<String>,
        serve: F,
    ) -> Listener
    where
        F: Fn(TcpStream) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        let (tx, rx) = oneshot::channel::<()>();
        let name = name.to_string();
        let thread = std::thread::spawn(move || {
            if let Some(ns) = &netns {
                crate::netns::enter(ns);
            }
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap_or_else(|e| panic!("{name} runtime: {e}"));
            rt.block_on(async move {
                let listener = TcpListener::from_std(listener).expect("tokio listener");
                let accept = async {
                    loop {
                        let Ok((client, _)) = listener.accept().await else {
                            continue;
                        };
                        tokio::spawn(serve(client));
                    }
                };
                tokio::select! {
                    _ = accept => {},
                    _ = rx => {},
                }
            });
        });
        Listener {
            port,
            shutdown: Some(tx),
            thread: Some(thread),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl FaultProxy {
    pub fn start(upstream_port: u16) -> FaultProxy {
        let counters = Arc::new(Counters::default());
        let c = counters.clone();
        let listener = Listener::start("fault proxy", move |client| {
            c.connections.fetch_add(1, Ordering::SeqCst);
            relay(client, upstream_port, c.clone())
        });
        FaultProxy {
            port: listener.port,
            counters,
            _listener: listener,
        }
    }

    /// `redis://127.0.0.1:<port>`: where the sidecar should connect.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Arms the proxy: the replies to the next `n` script calls are lost (their connections closed
    /// once Redis has answered).
    pub fn lose_replies(&self, n: u64) {
        self.counters.armed.fetch_add(n, Ordering::SeqCst);
    }

    /// Holds every chunk of Redis's answers `ms` milliseconds before forwarding it (a slow
    /// link or a slow Redis, as the sidecar sees it); 0 forwards at once.
    pub fn delay_replies(&self, ms: u64) {
        self.counters.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Script calls still armed (not yet seen).
    pub fn armed(&self) -> u64 {
        self.counters.armed.load(Ordering::SeqCst)
    }

    /// Replies lost so far.
    pub fn lost(&self) -> u64 {
        self.counters.lost.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.counters.connections.load(Ordering::SeqCst)
    }
}

/// Whether a chunk the client sent holds a script call (RESP: `$7\r\nEVALSHA\r\n`, `$4\r\nEVAL\r\n`;
/// command names are case-insensitive).
fn holds_script_call(chunk: &[u8]) -> bool {
    let upper: Vec<u8> = chunk.iter().map(u8::to_ascii_uppercase).collect();
    let has = |needle: &[u8]| upper.windows(needle.len()).any(|w| w == needle);
    has(b"$7\r\nEVALSHA\r\n") || has(b"$4\r\nEVAL\r\n")
}

async fn relay(client: TcpStream, upstream_port: u16, counters: Arc<Counters>) {
    let Ok(server) = TcpStream::connect(("127.0.0.1", upstream_port)).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    // Set once a script call of this connection is to lose its reply.
    let losing = Arc::new(AtomicBool::new(false));
    let up = {
        let (losing, counters) = (losing.clone(), counters.clone());
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match client_rx.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if !losing.load(Ordering::SeqCst)
                    && holds_script_call(&buf[..n])
                    && counters
                        .armed
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |a| a.checked_sub(1))
                        .is_ok()
                {
                    losing.store(true, Ordering::SeqCst);
                }
                if server_tx.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    let down = {
        let (losing, counters) = (losing.clone(), counters.clone());
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match server_rx.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if losing.load(Ordering::SeqCst) {
                    // Redis answered (so it ran the call): the answer goes nowhere, and the
                    // connection dies.
                    counters.lost.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                let delay = counters.delay_ms.load(Ordering::SeqCst);
                if delay > 0 {
                    tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
                }
                if client_tx.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    // Whichever side ends first ends the connection (both halves are dropped here).
    tokio::select! {
        _ = up => {},
        _ = down => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_calls_are_recognised_in_resp() {
        assert!(holds_script_call(
            b"*5\r\n$7\r\nEVALSHA\r\n$40\r\nabc\r\n$1\r\n1\r\n"
        ));
        assert!(holds_script_call(b"*3\r\n$4\r\neval\r\n$3\r\nabc\r\n"));
        assert!(!holds_script_call(b"*1\r\n$4\r\nPING\r\n"));
    }
}
