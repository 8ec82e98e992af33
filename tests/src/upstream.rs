//! The protected service of the tests: answers every request with 200 and counts what reached it,
//! so a test can tell what the filter let through. Runs on its own thread and tokio runtime.
//!
//! Under `/usage/` it reports a cost as an LLM API reports its tokens ([`usage_response`]):
//! `/usage/header?tokens=N` in the `x-usage-tokens` header, `/usage/json?tokens=N` in the JSON
//! body's `usage.total_tokens`, `/usage/sse?tokens=N&events=K&gap_ms=G` as a `text/event-stream`
//! of K chunks G ms apart whose last `data:` event carries `usage.total_tokens`. As an LLM API
//! does, it compresses the body when the request accepts `gzip` or `deflate`; and, to test what
//! a gateway cannot read: `usage=0` leaves the usage out, `compress=gzip|deflate` compresses
//! whatever the request accepts, `cut=1` resets the stream half way through the body.
//!
//! Under `/hold/<key>?ms=N` it holds the request open N ms before answering, and counts the
//! requests of `<key>` in flight now and at most ([`Upstream::in_flight`],
//! [`Upstream::max_in_flight`]); a request whose client went away stops counting at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::http::{HeaderMap, Uri};
use axum::response::IntoResponse;
use futures::StreamExt;
use tokio::sync::oneshot;

/// Requests in flight per key under `/hold/`: (now, at most).
type InFlight = Arc<Mutex<HashMap<String, (u64, u64)>>>;

pub struct Upstream {
    pub port: u16,
    hits: Arc<AtomicU64>,
    in_flight: InFlight,
    served: Arc<Mutex<Vec<Served>>>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A request that reached the upstream with an `x-chaos-id` header (the generated-faults run,
/// [`crate::chaos`]): what the gateways admitted, the ground truth its checker reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// The `x-chaos-id` the load generator set.
    pub id: u64,
    pub path: String,
    /// When it arrived and when its handler was done (a `/hold/` request: when it let go), in
    /// nanoseconds of [`crate::chaos::clock_ns`].
    pub arrival_ns: u64,
    pub done_ns: u64,
}

impl Upstream {
    pub fn start() -> Upstream {
        let hits = Arc::new(AtomicU64::new(0));
        let served = Arc::new(Mutex::new(Vec::new()));
        let record = served.clone();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind upstream");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        let (tx, rx) = oneshot::channel::<()>();
        let counter = hits.clone();
        let in_flight = InFlight::default();
        let held = in_flight.clone();
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
                    let held = held.clone();
                    let record = record.clone();
                    async move {
                        counter.fetch_add(1, Ordering::SeqCst);
                        let chaos_id = headers
                            .get("x-chaos-id")
                            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
                        let arrival_ns = crate::chaos::clock_ns();
                        let served = |done_ns| {
                            if let Some(id) = chaos_id {
                                record.lock().unwrap().push(Served {
                                    id,
                                    path: uri.path().to_string(),
                                    arrival_ns,
                                    done_ns,
                                });
                            }
                        };
                        if let Some(r) = hold(&uri, &held).await {
                            served(crate::chaos::clock_ns());
                            return r;
                        }
                        served(arrival_ns);
                        if let Some(r) = usage_response(&uri, &headers) {
                            return r;
                        }
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
            in_flight,
            served,
            shutdown: Some(tx),
            thread: Some(thread),
        }
    }

    /// The requests with an `x-chaos-id` that reached it so far.
    pub fn served(&self) -> Vec<Served> {
        self.served.lock().unwrap().clone()
    }

    /// How many requests reached the upstream so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::SeqCst)
    }

    /// Requests of `key` held open under `/hold/` now.
    pub fn in_flight(&self, key: &str) -> u64 {
        self.in_flight.lock().unwrap().get(key).map_or(0, |c| c.0)
    }

    /// The most requests of `key` held open under `/hold/` at once so far.
    pub fn max_in_flight(&self, key: &str) -> u64 {
        self.in_flight.lock().unwrap().get(key).map_or(0, |c| c.1)
    }
}

/// Counts one request of a key in flight while it lives (its future dropped, when its client
/// went away, included).
struct Holding {
    key: String,
    counts: InFlight,
}

impl Drop for Holding {
    fn drop(&mut self) {
        if let Some(c) = self.counts.lock().unwrap().get_mut(&self.key) {
            c.0 -= 1;
        }
    }
}

/// The answer of a `/hold/<key>?ms=N` path, after N ms; `None` for another path.
async fn hold(uri: &Uri, counts: &InFlight) -> Option<axum::response::Response> {
    let key = uri.path().strip_prefix("/hold/")?.to_string();
    let ms: u64 = uri
        .query()
        .and_then(|q| q.strip_prefix("ms="))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    {
        let mut all = counts.lock().unwrap();
        let c = all.entry(key.clone()).or_default();
        c.0 += 1;
        c.1 = c.1.max(c.0);
    }
    let _holding = Holding {
        key,
        counts: counts.clone(),
    };
    tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    Some(axum::Json(serde_json::json!({"upstream": "ok", "held_ms": ms})).into_response())
}

/// The answer of a `/usage/` path (see the module's header), `None` for another path.
pub fn usage_response(uri: &Uri, headers: &HeaderMap) -> Option<axum::response::Response> {
    let mode = uri.path().strip_prefix("/usage/")?;
    let query: std::collections::HashMap<String, String> = uri
        .query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let num = |k: &str, default: u64| query.get(k).and_then(|v| v.parse().ok()).unwrap_or(default);
    let tokens = num("tokens", 1);
    let with_usage = num("usage", 1) == 1;
    let cut = num("cut", 0) == 1;
    let accepts = headers
        .get("accept-encoding")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_ascii_lowercase();
    let encoding: Option<&'static str> = match query.get("compress").map(String::as_str) {
        Some("gzip") => Some("gzip"),
        Some("deflate") => Some("deflate"),
        _ if accepts.contains("gzip") => Some("gzip"),
        _ if accepts.contains("deflate") => Some("deflate"),
        _ => None,
    };
    let usage = serde_json::json!({"prompt_tokens": 1, "total_tokens": tokens});
    let mut body = serde_json::json!({"id": "x"});
    if with_usage {
        body["usage"] = usage;
    }
    let (content_type, chunks): (&str, Vec<Vec<u8>>) = match mode {
        "header" => {
            return Some(
                (
                    [("x-usage-tokens", tokens.to_string())],
                    axum::Json(serde_json::json!({"upstream": "ok"})),
                )
                    .into_response(),
            )
        }
        "json" => ("application/json", vec![body.to_string().into_bytes()]),
        "sse" => {
            let events = num("events", 3);
            let mut chunks: Vec<Vec<u8>> = (0..events.saturating_sub(1))
                .map(|i| {
                    format!("data: {{\"choices\":[{{\"delta\":\"chunk {i}\"}}]}}\n\n").into_bytes()
                })
                .collect();
            if with_usage {
                chunks.push(
                    format!("data: {{\"choices\":[],\"usage\":{{\"total_tokens\":{tokens}}}}}\n\n")
                        .into_bytes(),
                );
            }
            chunks.push(b"data: [DONE]\n\n".to_vec());
            ("text/event-stream", chunks)
        }
        _ => return Some(axum::http::StatusCode::NOT_FOUND.into_response()),
    };
    // Compressed as one body (a stream compressed as it goes is the same to a gateway: unread).
    let chunks = match encoding {
        None => chunks,
        Some(e) => vec![compress(e, &chunks.concat())],
    };
    let mut chunks: Vec<Option<Vec<u8>>> = chunks.into_iter().map(Some).collect();
    if cut {
        // Half the last chunk, then an error: the stream is reset mid-body.
        let last = chunks.pop().flatten().unwrap_or_default();
        chunks.push(Some(last[..last.len() / 2].to_vec()));
        chunks.push(None);
    }
    let gap_ms = num("gap_ms", 0);
    let stream =
        futures::stream::iter(chunks.into_iter().enumerate()).then(move |(i, c)| async move {
            if gap_ms > 0 && i > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(gap_ms)).await;
            }
            if c.is_none() {
                // Past the headers and the first half, on the wire before the reset.
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            c.ok_or_else(|| std::io::Error::other("cut short on purpose"))
        });
    let mut response = (
        [("content-type", content_type)],
        axum::body::Body::from_stream(stream),
    )
        .into_response();
    if let Some(e) = encoding {
        response
            .headers_mut()
            .insert("content-encoding", axum::http::HeaderValue::from_static(e));
    }
    Some(response)
}

/// `body` compressed as `encoding` (`gzip` or `deflate`, zlib-wrapped as HTTP's deflate is).
fn compress(encoding: &str, body: &[u8]) -> Vec<u8> {
    use std::io::Write;
    if encoding == "gzip" {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(body).expect("in memory");
        e.finish().expect("in memory")
    } else {
        let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(body).expect("in memory");
        e.finish().expect("in memory")
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
