//! A policy reload under leases, measured: one Envoy (two workers) with two hot clients (two
//! connections each) holding leases, its sidecar's policy rewritten and SIGHUP sent. t0 is when
//! the sidecar's `GET /v1/epoch` first shows the new epoch; each [`Stack::reload`] says what the
//! gateway admitted and rejected after it, and when Envoy last counted a lease admission. With
//! two sidecars behind the Envoy's sidecar cluster ([`Stack::start_with`]),
//! [`Stack::reload_one_then_the_other`] reloads them at different moments (the epoch the Envoy
//! polls flaps between the two meanwhile) and measures from the second. Used by
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

/// What the gateway did while only the first of two sidecars had reloaded, and after the second
/// ([`Stack::reload_one_then_the_other`]).
#[derive(Debug, Clone)]
pub struct Staggered {
    /// From the first sidecar's t0 to the second's.
    pub gap: Duration,
    /// Between the two: lease admissions Envoy counted from the first t0 + [`BOUND`], tokens
    /// the first sidecar granted under the new policy, callouts per second (and before the
    /// first reload, for as long).
    pub gap_lease_admitted: u64,
    pub gap_granted: u64,
    pub gap_callouts_per_sec: f64,
    pub before_callouts_per_sec: f64,
    /// The two sidecars' epochs once both have reloaded (equal: the same policy text).
    pub epochs: (u64, u64),
    /// From the second sidecar's t0, as [`Stack::reload`] measures a single one; its `granted`
    /// counts the first sidecar's grants from the first t0.
    pub after: Step,
}

/// The stack and its clients.
pub struct Stack {
    pub sidecars: Vec<Sidecar>,
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
        Stack::start_with(fast_paths, 1)
    }

    /// [`Stack::start`] with `sidecars` sidecars on the one Redis, each with a policy file of its
    /// own, all endpoints of the Envoy's sidecar cluster.
    pub fn start_with(fast_paths: serde_json::Value, sidecars: usize) -> Stack {
        let redis = Redis::start();
        let upstream = Upstream::start();
        let sidecars: Vec<Sidecar> = (0..sidecars)
            .map(|_| {
                Sidecar::with_policy(&redis.url(), &policy(OPEN), &["--redis-timeout-ms", "500"])
            })
            .collect();
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
        let mut config = EnvoyConfig::shipped("envoy.yaml", sidecars[0].port, upstream.port)
            .plugin(&plugin.to_string())
            .concurrency(2);
        for more in &sidecars[1..] {
            config = config.sidecar_endpoint(more.port);
        }
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
        let epoch = epoch(&http(), &sidecars[0]);
        let stack = Stack {
            sidecars,
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

    /// Lease tokens granted so far, per sidecar.
    fn granted(&self) -> Vec<u64> {
        self.sidecars
            .iter()
            .map(|s| s.metric("ratelimit_lease_tokens_total{result=\"granted\"}") as u64)
            .collect()
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

    /// Rewrites both rules to `spec` in every sidecar's file, sends SIGHUP, and measures
    /// `window` after t0 (when the last sidecar shows the new epoch).
    pub fn reload(&mut self, spec: &str, window: Duration) -> Step {
        let all: Vec<usize> = (0..self.sidecars.len()).collect();
        let (hup, t0) = self.swap(&all, spec);
        let granted = self.granted().iter().sum();
        self.measure(hup, t0, granted, window)
    }

    /// Rewrites both rules to `spec` in the first sidecar's file and sends it SIGHUP, then
    /// `gap` after its t0 in the second's: while only the first has reloaded the Envoy's epoch
    /// polls reach either, and the epoch it answers under flaps. Measures `window` after the
    /// second's t0, as [`Stack::reload`] does.
    pub fn reload_one_then_the_other(
        &mut self,
        spec: &str,
        gap: Duration,
        window: Duration,
    ) -> Staggered {
        assert_eq!(self.sidecars.len(), 2, "two sidecars");
        let callouts = |s: &Stack| (Instant::now(), s.envoy.counter("ratelimit.callouts"));
        let per_sec = |(t, n): (Instant, u64), (t2, n2): (Instant, u64)| {
            n2.saturating_sub(n) as f64 / (t2 - t).as_secs_f64()
        };
        // The callout rate before, over as long as the gap: a measurement window.
        let before = callouts(self);
        std::thread::sleep(gap);
        let before_callouts_per_sec = per_sec(before, callouts(self));
        let old = self.epoch;
        let (_, first) = self.swap(&[0], spec);
        let first_granted = self.granted()[0];
        let gap_from = callouts(self);
        // The gap between the two reloads is the scenario's (an operator's rollout), not a
        // synchronisation. Lease admissions are counted from the first t0 + BOUND.
        std::thread::sleep(BOUND.saturating_sub(first.elapsed()));
        let leased_at_bound = self.leased();
        std::thread::sleep(gap.saturating_sub(first.elapsed()));
        let gap_lease_admitted = self.leased() - leased_at_bound;
        let gap_callouts_per_sec = per_sec(gap_from, callouts(self));
        // The second sidecar still answers the old epoch: its swap waits for it to change.
        self.epoch = old;
        let (hup, second) = self.swap(&[1], spec);
        let granted = self.granted();
        let gap_granted = granted[0] - first_granted;
        let after = self.measure(hup, second, first_granted + granted[1], window);
        let client = http();
        Staggered {
            gap: second - first,
            gap_lease_admitted,
            gap_granted,
            gap_callouts_per_sec,
            before_callouts_per_sec,
            epochs: (
                epoch(&client, &self.sidecars[0]),
                epoch(&client, &self.sidecars[1]),
            ),
            after,
        }
    }

    /// Rewrites the policy of the sidecars `which` to `spec` and sends them SIGHUP: (when,
    /// t0). t0 is when the first request that saw the new epoch at the last of them was sent
    /// (the sidecar swapped the policy in at or after the previous answer, before this one: the
    /// earliest safe t0).
    fn swap(&mut self, which: &[usize], spec: &str) -> (Instant, Instant) {
        for &i in which {
            std::fs::write(&self.sidecars[i].policy, policy(spec)).expect("rewrite the policy");
        }
        let hup = Instant::now();
        for &i in which {
            self.sidecars[i].process.signal(Signal::SIGHUP);
        }
        let client = http();
        let deadline = hup + Duration::from_secs(10);
        let mut t0 = hup;
        let mut seen = self.epoch;
        for &i in which {
            t0 = loop {
                let sent = Instant::now();
                let e = epoch(&client, &self.sidecars[i]);
                if e != self.epoch {
                    seen = e;
                    break sent;
                }
                assert!(Instant::now() < deadline, "the reload was not seen in 10 s");
                std::thread::sleep(Duration::from_millis(1));
            };
        }
        self.epoch = seen;
        (hup, t0)
    }

    /// What the clients' requests and Envoy's lease counter did from `t0` for `window`;
    /// `granted_at_t0`: the lease tokens granted before the new policy (the sum over the
    /// sidecars, [`Stack::granted`]).
    fn measure(&self, hup: Instant, t0: Instant, granted_at_t0: u64, window: Duration) -> Step {
        let at_t0 = self.leased();
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
        let granted = self
            .granted()
            .iter()
            .sum::<u64>()
            .saturating_sub(granted_at_t0);
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
