//! A TCP relay between two local processes (an Envoy and its sidecar), in-process on a thread of
//! its own: it passes every byte, delays each chunk by a set time, or cuts the path (open
//! connections dropped, new ones closed at once). This kernel has no `sch_netem`; a userspace
//! relay does what the faults need. Stops on drop.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};

/// What the relay does now.
#[derive(Default)]
struct State {
    /// Held before each chunk is passed on, in ms.
    delay_ms: AtomicU64,
    /// Connections accepted.
    connections: AtomicU64,
}

pub struct Relay {
    pub port: u16,
    state: Arc<State>,
    /// `true` while the path is cut.
    cut: watch::Sender<bool>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Relay {
    /// A relay on a free port to `127.0.0.1:<target>`.
    pub fn start(target: u16) -> Relay {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the relay");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        let state = Arc::new(State::default());
        let (cut, cut_rx) = watch::channel(false);
        let (tx, rx) = oneshot::channel::<()>();
        let s = state.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("relay runtime");
            rt.block_on(async move {
                let listener = TcpListener::from_std(listener).expect("tokio listener");
                let accept = async {
                    loop {
                        let Ok((client, _)) = listener.accept().await else {
                            continue;
                        };
                        s.connections.fetch_add(1, Ordering::Relaxed);
                        if *cut_rx.borrow() {
                            drop(client);
                            continue;
                        }
                        let (s, cut) = (s.clone(), cut_rx.clone());
                        tokio::spawn(async move {
                            let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else {
                                return;
                            };
                            let _ = client.set_nodelay(true);
                            let _ = server.set_nodelay(true);
                            pipe(client, server, s, cut).await;
                        });
                    }
                };
                tokio::select! {
                    _ = accept => {}
                    _ = rx => {}
                }
            });
        });
        Relay {
            port,
            state,
            cut,
            shutdown: Some(tx),
            thread: Some(thread),
        }
    }

    /// Cuts the path (`true`) or mends it.
    pub fn set_cut(&self, cut: bool) {
        let _ = self.cut.send(cut);
    }

    /// Holds each chunk `ms` before passing it on (0: none).
    pub fn set_delay_ms(&self, ms: u64) {
        self.state.delay_ms.store(ms, Ordering::Relaxed);
    }

    pub fn connections(&self) -> u64 {
        self.state.connections.load(Ordering::Relaxed)
    }
}

/// Both directions of one connection, until either side closes or the path is cut.
async fn pipe(
    client: TcpStream,
    server: TcpStream,
    state: Arc<State>,
    mut cut: watch::Receiver<bool>,
) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let up = copy(&mut cr, &mut sw, &state);
    let down = copy(&mut sr, &mut cw, &state);
    let cut = async {
        loop {
            if *cut.borrow_and_update() {
                return;
            }
            if cut.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = cut => {}
    }
}

async fn copy(
    from: &mut (impl AsyncReadExt + Unpin),
    to: &mut (impl AsyncWriteExt + Unpin),
    state: &State,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let delay = state.delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
