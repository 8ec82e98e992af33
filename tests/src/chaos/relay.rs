//! A TCP relay between two local processes (an Envoy and its sidecar, a sidecar and Redis, from
//! one network namespace into another), in-process on a thread of its own: it passes every byte, delays each chunk by a set time, or cuts the path (open
//! connections dropped, new ones closed at once). This kernel has no `sch_netem`; a userspace
//! relay does what the faults need. It can also drop what the server answers while passing
//! what the client sends. Stops on drop.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::fault_proxy::Listener;

/// What the relay does now.
#[derive(Default)]
struct State {
    /// Held before each chunk is passed on, in ms.
    delay_ms: AtomicU64,
    /// Connections accepted.
    connections: AtomicU64,
    /// The server's bytes read and dropped, the client's passed.
    answers_lost: AtomicBool,
}

pub struct Relay {
    pub port: u16,
    state: Arc<State>,
    /// `true` while the path is cut.
    cut: watch::Sender<bool>,
    _listener: Listener,
}

impl Relay {
    /// A relay on a free port to `127.0.0.1:<target>`.
    pub fn start(target: u16) -> Relay {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a relay");
        Relay::start_on(listener, target, None)
    }

    /// A relay from `listener` (bound in whichever network namespace it was) to
    /// `127.0.0.1:<target>` in namespace `netns` (none: this process's).
    pub fn start_on(listener: std::net::TcpListener, target: u16, netns: Option<String>) -> Relay {
        let state = Arc::new(State::default());
        let (cut, cut_rx) = watch::channel(false);
        let s = state.clone();
        let listener = Listener::start_on("relay", listener, netns, move |client| {
            s.connections.fetch_add(1, Ordering::Relaxed);
            let (s, cut) = (s.clone(), cut_rx.clone());
            async move {
                if *cut.borrow() {
                    return;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else {
                    return;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                pipe(client, server, s, cut).await;
            }
        });
        Relay {
            port: listener.port,
            state,
            cut,
            _listener: listener,
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

    /// Drops every byte the server sends (`true`) while passing the client's, or passes both.
    /// A stream that lost bytes is broken: cut the path once this ends.
    pub fn set_answers_lost(&self, lost: bool) {
        self.state.answers_lost.store(lost, Ordering::Relaxed);
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
    let up = copy(&mut cr, &mut sw, &state, false);
    let down = copy(&mut sr, &mut cw, &state, true);
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

/// Passes what `from` sends to `to`; `answers`: the server's side, dropped while the answers
/// are lost.
async fn copy(
    from: &mut (impl AsyncReadExt + Unpin),
    to: &mut (impl AsyncWriteExt + Unpin),
    state: &State,
    answers: bool,
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
        if answers && state.answers_lost.load(Ordering::Relaxed) {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
