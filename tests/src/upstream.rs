//! The protected service of the tests: answers every request with 200 and counts what reached it,
//! so a test can tell what the filter let through. Runs on its own thread and tokio runtime.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::http::{HeaderMap, Uri};
use axum::response::IntoResponse;
use tokio::sync::oneshot;

pub struct Upstream {
    pub port: u16,
    hits: Arc<AtomicU64>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Upstream {
    pub fn start() -> Upstream {
        let hits = Arc::new(AtomicU64::new(0));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind upstream");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        let (tx, rx) = oneshot::channel::<()>();
        let counter = hits.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("upstream runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
                let app = axum::Router::new().fallback(move |uri: Uri, headers: HeaderMap| {
                    let counter = counter.clone();
                    async move {
                        counter.fetch_add(1, Ordering::SeqCst);
                        let echoed: serde_json::Map<String, serde_json::Value> = headers
                            .iter()
                            .map(|(k, v)| {
                                (k.to_string(), String::from_utf8_lossy(v.as_bytes()).into())
                            })
                            .collect();
                        axum::Json(serde_json::json!({
                            "upstream": "ok",
                            "path": uri.to_string(),
                            "headers": echoed,
                        }))
                        .into_response()
                    }
                });
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = rx.await;
                    })
                    .await;
            });
        });
        Upstream {
            port,
            hits,
            shutdown: Some(tx),
            thread: Some(thread),
        }
    }

    /// How many requests reached the upstream so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
