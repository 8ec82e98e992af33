//! What the end-to-end scenarios share: the whole stack on a shipped Envoy config (Redis, the
//! sidecar with a policy, an upstream, Envoy with the filter), and small HTTP helpers that
//! record each answer's status, headers, body and time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::plugin::Plugin;
use crate::{Envoy, EnvoyConfig, Redis, Sidecar, Upstream};

/// The API key the shipped configs know (its SHA-256 names the app `alpha`).
pub const ALPHA: (&str, &str) = ("x-api-key", "alpha-key");

/// The whole stack on the shipped `envoy/<file>`.
pub struct Stack {
    pub redis: Redis,
    pub sidecar: Sidecar,
    pub upstream: Upstream,
    pub envoy: Envoy,
}

impl Stack {
    /// The stack with the shipped plugin configuration and policy unless given.
    pub fn start(file: &str, plugin: Option<Value>, policy: Option<&str>) -> Stack {
        let redis = Redis::start();
        let policy = policy.map_or_else(Sidecar::shipped_policy, str::to_string);
        let sidecar = Sidecar::with_policy(&redis.url(), &policy, &["--redis-timeout-ms", "500"]);
        let upstream = Upstream::start();
        let mut config = EnvoyConfig::shipped(file, sidecar.port, upstream.port);
        if let Some(p) = plugin {
            config = config.plugin(&serde_json::to_string_pretty(&p).expect("JSON"));
        }
        let envoy = Envoy::start(&config);
        Stack {
            redis,
            sidecar,
            upstream,
            envoy,
        }
    }
}

/// The plugin configuration of `envoy/envoy.yaml` with its rules replaced. The callout timeout
/// is generous: tests that count exact admissions must not see a timeout on a busy 2-core
/// machine (the failure-policy tests set their own).
pub fn plugin_with_rules(rules: Value) -> Value {
    plugin_with(rules, 2000)
}

/// As [`plugin_with_rules`], with the callout timeout `timeout_ms`.
pub fn plugin_with(rules: Value, timeout_ms: u64) -> Value {
    Plugin::shipped_identities(rules)
        .timeout_ms(timeout_ms)
        .json()
}

/// One answer as a test sees it.
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: String,
    pub elapsed: Duration,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    }
}

pub fn get(client: &reqwest::blocking::Client, url: &str, headers: &[(&str, &str)]) -> Answer {
    let mut req = client.get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let start = Instant::now();
    let resp = req.send().unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.text().unwrap_or_default();
    Answer {
        status,
        headers,
        body,
        elapsed: start.elapsed(),
    }
}

/// Sends `n` requests from `parallel` threads, each request on a new connection (so Envoy spreads
/// them over its workers), and returns every answer.
pub fn burst(url: &str, headers: &[(&str, &str)], n: usize, parallel: usize) -> Vec<Answer> {
    burst_to(&[url], headers, n, parallel)
}

/// A client whose every request opens a connection of its own (so that Envoy's workers share
/// the requests), with a 10 s timeout.
pub fn one_connection_client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(10))
        .no_proxy()
        .build()
        .expect("client")
}

/// As [`burst`], the requests spread round-robin over several URLs (several Envoys).
pub fn burst_to(urls: &[&str], headers: &[(&str, &str)], n: usize, parallel: usize) -> Vec<Answer> {
    let answers = Arc::new(Mutex::new(Vec::with_capacity(n)));
    let next = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|s| {
        for _ in 0..parallel {
            let (answers, next) = (answers.clone(), next.clone());
            s.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= n {
                    break;
                }
                let a = get(&one_connection_client(), urls[i % urls.len()], headers);
                answers.lock().expect("not poisoned").push(a);
            });
        }
    });
    Arc::try_unwrap(answers)
        .ok()
        .expect("threads done")
        .into_inner()
        .expect("not poisoned")
}

pub fn count(answers: &[Answer], status: u16) -> usize {
    answers.iter().filter(|a| a.status == status).count()
}

pub fn p99(answers: &[Answer]) -> Duration {
    let mut t: Vec<Duration> = answers.iter().map(|a| a.elapsed).collect();
    t.sort();
    t[(t.len() * 99 / 100).min(t.len() - 1)]
}
