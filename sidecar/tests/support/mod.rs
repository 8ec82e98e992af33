//! What only the sidecar's tests need: the sidecar served in-process on a free port with a policy
//! file of the test's own, small HTTP helpers, and a reader of the buckets' stored state. Redis
//! (one server or a cluster) comes from the shared harness, `ratelimit_e2e`.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use ratelimit_e2e::Redis;
use ratelimit_sidecar::calls::{AppState, Stopping};
use ratelimit_sidecar::decide::Decider;
use ratelimit_sidecar::metrics::Metrics;
use ratelimit_sidecar::policy::reload::PolicyHandle;
use ratelimit_sidecar::policy::{Bounds, Policy};
use ratelimit_sidecar::store::memory::MemoryStore;
use ratelimit_sidecar::Args;
use serde_json::{json, Value};

/// The policy the tests use unless they bring their own: one rule per bucket size they need.
pub const POLICY: &str = r#"
rules:
  b100: {capacity: 100, refill_per_sec: 10}
  b50: {capacity: 50, refill_per_sec: 0.001}
  b10: {capacity: 10, refill_per_sec: 0.001}
  b10r1: {capacity: 10, refill_per_sec: 1}
  b5: {capacity: 5, refill_per_sec: 0.001}
  b3: {capacity: 3, refill_per_sec: 0.001}
  b2: {capacity: 2, refill_per_sec: 0.001}
  b1: {capacity: 1, refill_per_sec: 1}
"#;

/// The sidecar served in-process on a free port; stopped on drop.
pub struct Sidecar {
    pub base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub http: reqwest::Client,
    /// The policy file (in a temp dir that lives as long as the sidecar).
    pub policy_file: PathBuf,
    _dir: tempfile::TempDir,
}

impl Sidecar {
    /// Starts the sidecar with [`POLICY`] and these flags (`--listen` and `--limits` are chosen
    /// here).
    pub async fn start(flags: &[&str]) -> Self {
        Self::with_policy(POLICY, flags).await
    }

    /// Starts the sidecar with a policy of the test's own.
    pub async fn with_policy(policy: &str, flags: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let policy_file = dir.path().join("limits.yaml");
        std::fs::write(&policy_file, policy).expect("write the policy");
        let limits = policy_file.display().to_string();
        let mut argv = vec!["ratelimit-sidecar", "--limits", &limits];
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
            policy_file,
            _dir: dir,
        };
        sidecar.wait_ready("/healthz").await;
        sidecar
    }

    pub async fn on_redis(redis: &Redis) -> Self {
        Self::on_redis_with(redis, POLICY).await
    }

    pub async fn on_redis_with(redis: &Redis, policy: &str) -> Self {
        // A generous timeout: these tests check semantics on a busy 2-core machine, not latency.
        let s = Self::with_policy(
            policy,
            &["--redis", &redis.url(), "--redis-timeout-ms", "2000"],
        )
        .await;
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
        self.post_to("/v1/decide", body).await
    }

    /// POSTs a raw JSON body to `path` (`/v1/settle`, `/v1/slots`): (status, JSON answer).
    pub async fn post_to(&self, path: &str, body: impl Into<reqwest::Body>) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
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

    /// POSTs a call: `{"requests": requests, ...extra}`.
    pub async fn call(&self, requests: Value, extra: Value) -> (u16, Value) {
        let mut body = json!({ "requests": requests });
        if let Value::Object(m) = extra {
            for (k, v) in m {
                body[k] = v;
            }
        }
        self.post_raw(body.to_string()).await
    }

    /// One request of these decisions: (status, that request's answer, or the error body).
    pub async fn decide(&self, decisions: Value) -> (u16, Value) {
        let (status, a) = self
            .call(json!([{ "decisions": decisions }]), json!({}))
            .await;
        if status == 200 {
            (status, a["answers"][0].clone())
        } else {
            (status, a)
        }
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

    /// Asserts the sidecar is up (`/healthz` 200) but not ready (`/readyz` 503) and answers
    /// decisions 503; returns the `/readyz` body and the decision's answer.
    pub async fn assert_up_but_unavailable(&self) -> (String, Value) {
        let (status, body) = self.get("/healthz").await;
        assert_eq!((status, body.as_str()), (200, "ok"));
        let (status, ready) = self.get("/readyz").await;
        assert_eq!(status, 503, "{ready}");
        let (status, a) = self.decide(json!([decision("b10", "k", 1)])).await;
        assert_eq!(status, 503, "{a}");
        (ready, a)
    }

    /// The value of one metric line (e.g. `ratelimit_script_loads_total`), 0 when absent.
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

/// One decision as JSON: rule `rule` for the client `id` (dimension `id`), costing `cost`.
pub fn decision(rule: &str, id: &str, cost: u64) -> Value {
    json!({ "rule": rule, "subject": { "id": id }, "cost": cost })
}

/// The bucket key the sidecar builds for [`decision`] (default prefix and domain).
pub fn bucket(rule: &str, id: &str) -> String {
    format!("rl:{{ratelimit|rule={rule}|id={id}}}")
}

/// A bucket's stored state: tokens, ts (µs), the expiry it carries (ms), and its leases
/// (id, amount, expiry µs). `None` when the key is missing.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub tokens: f64,
    pub ts_us: f64,
    pub exp_ms: f64,
    pub leases: Vec<(f64, f64, f64)>,
}

/// Reads a bucket as the script stores it (little-endian doubles).
pub fn stored(redis: &mut impl redis::ConnectionLike, key: &str) -> Option<Stored> {
    let raw: Option<Vec<u8>> = redis::cmd("GET").arg(key).query(redis).expect("GET");
    let raw = raw?;
    let f: Vec<f64> = raw
        .chunks(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    Some(Stored {
        tokens: f[0],
        ts_us: f[1],
        exp_ms: f[2],
        leases: f[3..].chunks(3).map(|c| (c[0], c[1], c[2])).collect(),
    })
}

/// Writes a bucket state (for tests that set the clock back or forth).
pub fn store_state(redis: &mut impl redis::ConnectionLike, key: &str, tokens: f64, ts_us: f64) {
    let mut raw = Vec::with_capacity(24);
    for v in [tokens, ts_us, 0.0] {
        raw.extend_from_slice(&v.to_le_bytes());
    }
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg(raw)
        .query(redis)
        .expect("SET");
}

/// A name unique to this test run, so tests may share nothing and run twice in a row.
pub fn unique(name: &str) -> String {
    format!("{name}-{:x}", rand::random::<u64>())
}

/// A decider over a store in memory (no Redis) with one policy file, `limits.yaml` holding
/// `yaml`; with the store and the metrics it counts into. For the routers tests serve in-process.
pub fn memory_decider(yaml: &str) -> (Arc<Decider<MemoryStore>>, Arc<MemoryStore>, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let policy = Policy::from_sources(&[("limits.yaml".into(), yaml.into())], &Bounds::default())
        .expect("a valid policy");
    let store = Arc::new(MemoryStore::new(1_700_000_000_000_000, 0.1, 10_000));
    let handle = PolicyHandle::fixed(policy, metrics.clone());
    let decider = Arc::new(Decider::new(store.clone(), handle, metrics.clone()));
    (decider, store, metrics)
}

/// The handlers' state over [`memory_decider`], stopping on `stopping`.
pub fn memory_state(
    yaml: &str,
    stopping: Stopping,
) -> (Arc<AppState<MemoryStore>>, Arc<MemoryStore>) {
    let (decider, store, metrics) = memory_decider(yaml);
    let state = AppState {
        decider,
        metrics,
        grpc: Default::default(),
        stopping,
    };
    (Arc::new(state), store)
}
