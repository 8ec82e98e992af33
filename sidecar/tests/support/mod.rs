//! What only the sidecar's tests need: the sidecar served in-process on a free port, and small
//! HTTP helpers. Redis (one server or a cluster) comes from the shared harness, `ratelimit_e2e`.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use clap::Parser;
use ratelimit_e2e::Redis;
use ratelimit_sidecar::Args;
use serde_json::{json, Value};

/// The sidecar served in-process on a free port; stopped on drop.
pub struct Sidecar {
    pub base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub http: reqwest::Client,
}

impl Sidecar {
    /// Starts the sidecar with these flags (`--listen` is chosen here).
    pub async fn start(flags: &[&str]) -> Self {
        let mut argv = vec!["ratelimit-sidecar"];
        argv.extend_from_slice(flags);
        let args = Args::try_parse_from(argv).expect("valid flags");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            ratelimit_sidecar::serve(args, listener, async {
                let _ = stopped.await;
            })
            .await
            .expect("sidecar serves");
        });
        let sidecar = Self {
            base,
            stop: Some(stop),
            http: reqwest::Client::new(),
        };
        sidecar.wait_ready("/healthz").await;
        sidecar
    }

    pub async fn on_redis(redis: &Redis) -> Self {
        // A generous timeout: these tests check semantics on a busy 2-core machine, not latency.
        let s = Self::start(&["--redis", &redis.url(), "--redis-timeout-ms", "2000"]).await;
        s.wait_ready("/readyz").await;
        s
    }

    /// Polls `path` until it answers 200 (bounded).
    pub async fn wait_ready(&self, path: &str) {
        let start = Instant::now();
        loop {
            if let Ok(r) = self.http.get(format!("{}{path}", self.base)).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "{path} never answered 200"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// POSTs a raw body to /v1/decide: (status, JSON answer).
    pub async fn post_raw(&self, body: impl Into<reqwest::Body>) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}/v1/decide", self.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("sidecar answers");
        let status = r.status().as_u16();
        let text = r.text().await.expect("body");
        let json = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("answer is not JSON ({e}): {status} {text}"));
        (status, json)
    }

    pub async fn decide(&self, decisions: Value) -> (u16, Value) {
        self.post_raw(json!({ "decisions": decisions }).to_string())
            .await
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let r = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("sidecar answers");
        (r.status().as_u16(), r.text().await.expect("body"))
    }

    /// The value of one metric line (e.g. `ratelimit_script_loads_total`), 0 when absent.
    /// Asserts the sidecar is up (`/healthz` 200) but not ready (`/readyz` 503) and answers
    /// decisions 503; returns the `/readyz` body and the decision's answer.
    pub async fn assert_up_but_unavailable(&self) -> (String, Value) {
        let (status, body) = self.get("/healthz").await;
        assert_eq!((status, body.as_str()), (200, "ok"));
        let (status, ready) = self.get("/readyz").await;
        assert_eq!(status, 503, "{ready}");
        let (status, a) = self
            .decide(serde_json::json!([decision("k", 1.0, 1.0, 1.0)]))
            .await;
        assert_eq!(status, 503, "{a}");
        (ready, a)
    }

    pub async fn metric(&self, line_prefix: &str) -> f64 {
        let (_, text) = self.get("/metrics").await;
        text.lines()
            .find(|l| l.starts_with(line_prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// One decision as JSON.
pub fn decision(key: &str, capacity: f64, refill_per_sec: f64, cost: f64) -> Value {
    json!({ "key": key, "capacity": capacity, "refill_per_sec": refill_per_sec, "cost": cost })
}

/// A key unique to this test run, so tests may share nothing and run twice in a row.
pub fn unique(name: &str) -> String {
    format!("{name}-{:x}", rand::random::<u64>())
}
