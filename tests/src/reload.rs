//! A policy reload under leases, measured: one Envoy (two workers) with two hot clients (two
//! connections each) holding leases, its sidecar's policy rewritten and SIGHUP sent. t0 is when
//! the sidecar's `GET /v1/epoch` first shows the new epoch; each [`Stack::reload`] says what the
//! gateway admitted and rejected after it, and when Envoy last counted a lease admission. Used by
//! `tests/tests/policy_reload.rs` and `make reliability` (docs/fast-paths.md#policy-reloads).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::json;

use crate::scenario::plugin_with_rules;
use crate::{http, Envoy, EnvoyConfig, Redis, Sidecar, Upstream};

/// The bound the fast paths promise after a reload.
pub const BOUND: Duration = Duration::from_millis(100);

/// The open policy the clients start under: leases flow.
pub const OPEN: &str = "{capacity: 20000, refill_per_sec: 20000}";

/// One answer: when its request was sent, its status, whether it had `Retry-After`.
#[derive(Debug, Clone, Copy)]
struct Sent {
    at: Instant,
    status: u16,
    retry_after: bool,
}

/// What the requests sent after one reload's t0 did, and how long the reload took to be seen.
#[derive(Debug, Clone)]
pub struct Step {
    /// From SIGHUP to t0.
    pub seen_after: Duration,
    /// Admitted, sent after t0.
    pub admitted: usize,
    /// The last admitted request's send time after t0.
    pub last_admission: Option<Duration>,
    /// Lease admissions Envoy counted after t0, and the last sample (taken about every 5 ms) at
    /// which that count still grew, after t0.
    pub lease_admitted: u64,
    pub last_lease_admission: Option<Duration>,
    /// Sent after t0 + [`BOUND`]: admitted, rejected, rejected with `Retry-After`.
    pub late_admitted: usize,
    pub late_rejected: usize,
    pub late_retry_after: usize,
    /// Lease admissions Envoy counted from t0 + [`BOUND`] to the end.
    pub late_lease_admitted: u64,
    /// Lease tokens the sidecar granted after t0 (under the new policy: a lease of it may
    /// admit).
    pub granted: u64,
}

impl Step {
    /// Lease admissions after t0 + [`BOUND`] beyond what leases of the new policy could pay:
    /// admissions from a lease of the old one.
    pub fn stale_lease_admissions(&self) -> u64 {
        self.late_lease_admitted.saturating_sub(self.granted)
    }
}

/// The stack and its clients.
pub struct Stack {
    pub sidecar: Sidecar,
    pub envoy: Envoy,
    answers: Arc<Mutex<Vec<Sent>>>,
    stop: Arc<AtomicBool>,
    clients: Vec<JoinHandle<()>>,
    epoch: u64,
    _upstream: Upstream,
    _redis: Redis,
}

fn policy(spec: &str) -> String {
    format!("rules:\n  hot-a: {spec}\n  hot-b: {spec}\n")
}

impl Stack {
    /// Starts the stack under [`OPEN`] (the plugin's `fast_paths` as shipped, with `fast_paths`
    /// merged in), the clients sending, and waits until they are admitted from leases.
    pub fn start(fast_paths: serde_json::Value) -> Stack {
        let redis = Redis::start();
        let upstream = Upstream::start();
        let sidecar =
            Sidecar::with_policy(&redis.url(), &policy(OPEN), &["--redis-timeout-ms", "500"]);
        let rules = json!([
            {"name": "hot-a", "match": {"path_prefix": "/a"}, "subject": [], "on_error": "deny"},
            {"name": "hot-b", "match": {"path_prefix": "/b"}, "subject": [], "on_error": "deny"}
        ]);
        let mut plugin = plugin_with_rules(rules);
        if let (Some(to), Some(from)) =
            (plugin["fast_paths"].as_object_mut(), fast_paths.as_object())
        {
            to.extend(from.clone());
        } else if fast_paths.is_object() {
            plugin["fast_paths"] = fast_paths;
        }
        let config = EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port)
            .plugin(&plugin.to_string())
            .concurrency(2);
        let envoy = Envoy::start(&config);
        let answers = Arc::new(Mutex::new(Vec::<Sent>::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let clients = ["/a", "/b", "/a", "/b"]
            .iter()
            .map(|path| {
                let (answers, stop, url) = (answers.clone(), stop.clone(), envoy.url(path));
                std::thread::spawn(move || {
                    let client = http();
                    while !stop.load(Ordering::Relaxed) {
                        let at = Instant::now();
                        let Ok(r) = client.get(&url).send() else {
                            continue;
                        };
                        let sent = Sent {
                            at,
                            status: r.status().as_u16(),
                            retry_after: r.headers().contains_key("retry-after"),
                        };
                        answers.lock().expect("not poisoned").push(sent);
                    }
                })
            })
            .collect();
        let epoch = epoch(&http(), &sidecar);
        let stack = Stack {
            sidecar,
            envoy,
            answers,
            stop,
            clients,
            epoch,
            _upstream: upstream,
            _redis: redis,
        };
        stack.wait_for_leases();
        stack
    }

    fn leased(&self) -> u64 {
        self.envoy.counter("ratelimit.lease_admitted")
    }

    fn granted(&self) -> u64 {
        self.sidecar
            .metric("ratelimit_lease_tokens_total{result=\"granted\"}") as u64
    }

    /// Waits until the clients are admitted from leases (1000 more lease admissions).
    pub fn wait_for_leases(&self) {
        let (from, deadline) = (self.leased(), Instant::now() + Duration::from_secs(20));
        while self.leased() < from + 1000 {
            assert!(
                Instant::now() < deadline,
                "the clients do not hold leases ({} lease admissions)",
                self.leased() - from
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Rewrites both rules to `spec`, sends SIGHUP, and measures `window` after t0.
    pub fn reload(&mut self, spec: &str, window: Duration) -> Step {
        std::fs::write(&self.sidecar.policy, policy(spec)).expect("rewrite the policy");
        let hup = Instant::now();
        self.sidecar.process.signal(Signal::SIGHUP);
        let client = http();
        let deadline = hup + Duration::from_secs(10);
        // t0: when the first request that saw the new epoch was sent (the sidecar swapped the
        // policy in at or after the previous answer, before this one: the earliest safe t0).
        let t0 = loop {
            let sent = Instant::now();
            let e = epoch(&client, &self.sidecar);
            if e != self.epoch {
                self.epoch = e;
                break sent;
            }
            assert!(Instant::now() < deadline, "the reload was not seen in 10 s");
            std::thread::sleep(Duration::from_millis(1));
        };
        let at_t0 = self.leased();
        let granted_at_t0 = self.granted();
        let (mut last, mut last_lease, mut at_bound) = (at_t0, None, None);
        while t0.elapsed() < window {
            let now = self.leased();
            let since = t0.elapsed();
            if at_bound.is_none() && since >= BOUND {
                at_bound = Some(now);
            }
            if now > last {
                last = now;
                last_lease = Some(since);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let end = self.leased();
        let granted = self.granted().saturating_sub(granted_at_t0);
        let answers = self.answers.lock().expect("not poisoned");
        let after = |d: Duration| answers.iter().filter(move |a| a.at >= t0 + d);
        let admitted = |d: Duration| after(d).filter(|a| a.status == 200);
        Step {
            seen_after: t0 - hup,
            admitted: admitted(Duration::ZERO).count(),
            last_admission: admitted(Duration::ZERO).map(|a| a.at - t0).max(),
            lease_admitted: end - at_t0,
            last_lease_admission: last_lease,
            late_admitted: admitted(BOUND).count(),
            late_rejected: after(BOUND).filter(|a| a.status == 429).count(),
            late_retry_after: after(BOUND)
                .filter(|a| a.status == 429 && a.retry_after)
                .count(),
            late_lease_admitted: end - at_bound.unwrap_or(end),
            granted,
        }
    }

    /// Stops the clients.
    pub fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for c in self.clients {
            c.join().expect("a client panicked");
        }
    }
}

/// The sidecar's policy epoch, by its own endpoint.
pub fn epoch(client: &reqwest::blocking::Client, sidecar: &Sidecar) -> u64 {
    let url = format!("http://127.0.0.1:{}/v1/epoch", sidecar.port);
    let body: serde_json::Value = client
        .get(&url)
        .send()
        .and_then(|r| r.json())
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    body["epoch"]
        .as_u64()
        .unwrap_or_else(|| panic!("GET {url}: no epoch in {body}"))
}
