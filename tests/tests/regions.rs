//! Two regions on this machine (`docs/regions.md`): each has its own Redis, a sidecar started
//! with `--region`, and an Envoy with the wasm filter; a client load per region, eu busy and us
//! light. One regional rule with a global budget of C = 40 tokens and R = 20 tokens/s, 0.5 each.
//!
//! The scenario, load running throughout:
//! 1. static shares: each region admits at most its half;
//! 2. `ratelimit-rebalancer --once` moves unused share from us to eu (shrink, fence, grow), and eu
//!    then admits more;
//! 3. the rebalancer cannot reach us: it freezes us and writes nothing; both regions keep deciding;
//! 4. us's Redis stops: us answers 503 (the rule's `on_error: deny`), eu keeps within its share.
//!
//! Throughout, everything admitted in both regions stays within one global bucket (C, R): for
//! every window [a, b] between a request's send time and another's answer time, the admissions
//! sent and answered within it number at most C + R·(b − a). The filter's leases are off, so an
//! admission is charged when it is decided (a lease admits tokens taken earlier, shifting
//! admissions in time by up to its TTL).

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ratelimit_e2e::scenario::{plugin_with_rules, ALPHA};
use ratelimit_e2e::{
    http, wait_until, workspace_root, Envoy, EnvoyConfig, Redis, Sidecar, Upstream,
};
use serde_json::{json, Value};

const CAPACITY: f64 = 40.0;
const REFILL: f64 = 20.0;
/// The regions' indices in the answers.
const EU: usize = 0;
const US: usize = 1;

const POLICY: &str = "\
rules:
  global:
    capacity: 40
    refill_per_sec: 20
    regions: {eu: 0.5, us: 0.5}
";

fn rebalancer_bin() -> std::path::PathBuf {
    let p = std::env::var_os("RATELIMIT_REBALANCER_BIN")
        .map(Into::into)
        .unwrap_or_else(|| workspace_root().join("target/release/ratelimit-rebalancer"));
    assert!(
        p.exists(),
        "the rebalancer binary not found at {} (set RATELIMIT_REBALANCER_BIN, or run `make build`)",
        p.display()
    );
    p
}

/// One region: Redis, a sidecar with `--region`, an upstream, Envoy with the filter.
struct Region {
    redis: Redis,
    sidecar: Sidecar,
    _upstream: Upstream,
    envoy: Envoy,
}

impl Region {
    fn start(name: &'static str) -> Region {
        let redis = Redis::start();
        let sidecar = Sidecar::with_policy(
            &redis.url(),
            POLICY,
            &["--region", name, "--redis-timeout-ms", "500"],
        );
        let upstream = Upstream::start();
        let mut plugin = plugin_with_rules(json!([
            {"name": "global", "match": {"path_prefix": "/api/"}, "subject": ["app"], "on_error": "deny"}
        ]));
        plugin["fast_paths"] = json!({"leases": {"enabled": false}});
        let config = EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port)
            .plugin(&serde_json::to_string_pretty(&plugin).unwrap())
            .concurrency(1);
        let envoy = Envoy::start(&config);
        Region {
            redis,
            sidecar,
            _upstream: upstream,
            envoy,
        }
    }

    /// The share record as this region's sidecar last read it: (share, version).
    fn share_read(&self) -> (f64, u64) {
        let body: Value = http()
            .get(format!("{}/readyz", self.sidecar.base_url()))
            .send()
            .and_then(|r| r.json())
            .unwrap_or(Value::Null);
        let s = &body["regional_shares"][0];
        (
            s["share"].as_f64().unwrap_or(0.0),
            s["version"].as_u64().unwrap_or(0),
        )
    }
}

/// One answer: the region, when it was sent and answered (seconds since the start), its status.
#[derive(Debug, Clone, Copy)]
struct Answer {
    region: usize,
    sent: f64,
    answered: f64,
    status: u16,
}

/// A client load on each region's Envoy until dropped: `threads` loops each, pausing `pause`
/// between requests.
struct Load {
    stop: Arc<AtomicBool>,
    answers: Arc<Mutex<Vec<Answer>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    start: Instant,
}

impl Load {
    fn start(targets: &[(usize, String, usize, Duration)]) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let answers = Arc::new(Mutex::new(Vec::new()));
        let start = Instant::now();
        let mut threads = Vec::new();
        for (region, url, n, pause) in targets {
            for _ in 0..*n {
                let (stop, answers, url, pause, region) =
                    (stop.clone(), answers.clone(), url.clone(), *pause, *region);
                threads.push(std::thread::spawn(move || {
                    let client = reqwest::blocking::Client::builder()
                        .timeout(Duration::from_secs(10))
                        .no_proxy()
                        .build()
                        .unwrap();
                    while !stop.load(Ordering::SeqCst) {
                        let sent = start.elapsed().as_secs_f64();
                        let status = client
                            .get(&url)
                            .header(ALPHA.0, ALPHA.1)
                            .send()
                            .map(|r| r.status().as_u16())
                            .unwrap_or(0);
                        let answered = start.elapsed().as_secs_f64();
                        answers.lock().unwrap().push(Answer {
                            region,
                            sent,
                            answered,
                            status,
                        });
                        std::thread::sleep(pause);
                    }
                }));
            }
        }
        Load {
            stop,
            answers,
            threads,
            start,
        }
    }

    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    fn answers(&self) -> Vec<Answer> {
        self.answers.lock().unwrap().clone()
    }

    fn finish(mut self) -> Vec<Answer> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
        self.answers()
    }
}

/// Admitted (200) answers of `region` (or all) sent and answered within [from, to].
fn admitted(answers: &[Answer], region: Option<usize>, from: f64, to: f64) -> usize {
    answers
        .iter()
        .filter(|a| a.status == 200 && region.is_none_or(|r| a.region == r))
        .filter(|a| a.sent >= from && a.answered <= to)
        .count()
}

/// The largest excess over a bucket of (capacity, refill) of the admissions of `region` (or all)
/// in any window [a's send, b's answer] within [from, to]: the admissions sent and answered in it,
/// minus refill × its length. At most `capacity` when the bucket's bound holds.
fn worst_window(answers: &[Answer], region: Option<usize>, refill: f64, from: f64, to: f64) -> f64 {
    let mut ok: Vec<Answer> = answers
        .iter()
        .filter(|a| a.status == 200 && region.is_none_or(|r| a.region == r))
        .filter(|a| a.sent >= from && a.answered <= to)
        .copied()
        .collect();
    ok.sort_by(|a, b| a.answered.total_cmp(&b.answered));
    let mut worst: f64 = 0.0;
    for start in ok.iter().map(|a| a.sent) {
        let mut count = 0.0;
        for a in ok.iter().filter(|a| a.sent >= start) {
            count += 1.0;
            worst = worst.max(count - refill * (a.answered - start));
        }
    }
    worst
}

fn rebalance(regions: &[(&str, String)], extra: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("limits.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let mut cmd = Command::new(rebalancer_bin());
    cmd.arg("--limits")
        .arg(&policy)
        .args(["--once", "--observe-ms", "3000"]);
    for (name, url) in regions {
        cmd.args(["--region", &format!("{name}={url}")]);
    }
    let out = cmd.args(extra).env("RUST_LOG", "info").output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "the rebalancer failed:\n{log}");
    log
}

fn sleep_until(load: &Load, t: f64) {
    let now = load.now();
    if t > now {
        // Load runs meanwhile: this is the length of a measured phase, not a synchronisation.
        std::thread::sleep(Duration::from_secs_f64(t - now));
    }
}

#[test]
fn two_regions_stay_within_one_global_budget_under_load_rebalancing_and_cut_off() {
    let eu = Region::start("eu");
    let us = Region::start("us");
    let load = Load::start(&[
        (EU, eu.envoy.url("/api/orders"), 2, Duration::from_millis(5)),
        (
            US,
            us.envoy.url("/api/orders"),
            1,
            Duration::from_millis(500),
        ),
    ]);

    // 1. Static shares, 8 s.
    sleep_until(&load, 8.0);
    let static_end = load.now();

    // 2. A rebalance: observe 3 s, shrink us, fence 5.5 s, grow eu.
    let rebalance_start = load.now();
    let log = rebalance(
        &[("eu", eu.redis.url()), ("us", us.redis.url())],
        &["--step-fraction", "1"],
    );
    let plan = log
        .lines()
        .find(|l| l.contains("round planned"))
        .unwrap_or_default()
        .to_string();
    println!("rebalancer: {plan}");
    let rebalance_end = load.now();
    let mut grown = (0.0, 0);
    wait_until(
        "eu's sidecars read the grown share",
        Duration::from_secs(30),
        || {
            grown = eu.share_read();
            grown.1 >= 2
        },
    );
    let shrunk = us.share_read();
    println!(
        "after the rebalance: eu {:.4} (v{}), us {:.4} (v{})",
        grown.0, grown.1, shrunk.0, shrunk.1
    );
    assert!(grown.0 > 0.5 && shrunk.0 < 0.5 && grown.0 + shrunk.0 <= 1.0);
    let grown_from = load.now();
    sleep_until(&load, grown_from + 8.0);
    let grown_end = load.now();

    // 3. The rebalancer cannot reach us: us is frozen, nothing is written anywhere.
    let log = rebalance(
        &[("eu", eu.redis.url()), ("us", "redis://127.0.0.1:1".into())],
        &["--step-fraction", "1", "--redis-timeout-ms", "300"],
    );
    assert!(
        log.contains("region unreachable, frozen this round"),
        "{log}"
    );
    assert!(!log.contains("written"), "{log}");
    assert_eq!(eu.share_read().1, grown.1, "eu's record unchanged");
    assert_eq!(us.share_read().1, shrunk.1, "us's record unchanged");

    // 4. us's Redis stops: us answers 503; eu keeps deciding within its share.
    let mut us = us;
    us.redis.stop();
    let cut_from = load.now();
    sleep_until(&load, cut_from + 6.0);
    let answers = load.finish();
    let end = answers.iter().map(|a| a.answered).fold(0.0, f64::max);

    let count = |region, from, to| admitted(&answers, region, from, to);
    let rate = |region, from: f64, to: f64| count(region, from, to) as f64 / (to - from);
    let total = count(None, 0.0, end);
    let bound = CAPACITY + REFILL * end;
    let worst = worst_window(&answers, None, REFILL, 0.0, end);
    // Static: eu from 2 s (its burst spent) to the rebalance; grown: the 8 s after eu read it.
    let (eu_static, eu_grown) = (
        rate(Some(EU), 2.0, static_end),
        rate(Some(EU), grown_from, grown_end),
    );
    let us_cut = answers
        .iter()
        .filter(|a| a.region == US && a.sent >= cut_from)
        .map(|a| a.status)
        .collect::<Vec<_>>();
    println!(
        "{} answers in {end:.1} s; admitted {total} of at most C + R·t = {bound:.0} (eu {}, us {})",
        answers.len(),
        count(Some(EU), 0.0, end),
        count(Some(US), 0.0, end)
    );
    println!("worst window, all regions: {worst:.1} tokens above R·t (at most C = {CAPACITY})");
    println!(
        "eu admitted/s: {eu_static:.1} on 0.5 (refill {:.1}/s), {eu_grown:.1} on {:.4} (refill {:.1}/s)",
        0.5 * REFILL,
        grown.0,
        grown.0 * REFILL
    );
    println!(
        "during the rebalance ({rebalance_start:.1}-{rebalance_end:.1} s): worst window {:.1}",
        worst_window(&answers, None, REFILL, rebalance_start, rebalance_end)
    );
    println!(
        "us cut off: {} answers, {} of them 503; eu worst window on {:.4}: {:.1} (its C·s = {:.1})",
        us_cut.len(),
        us_cut.iter().filter(|s| **s == 503).count(),
        grown.0,
        worst_window(&answers, Some(EU), REFILL * grown.0, cut_from, end),
        CAPACITY * grown.0
    );

    // The global bound, over the whole run and every window in it (rebalance and cut-off
    // included).
    assert!(total as f64 <= bound, "{total} > {bound}");
    assert!(
        worst <= CAPACITY,
        "a window exceeds the global bucket by {worst}"
    );
    // Each region within its share: eu on 0.5 before the rebalance, on its grown share after.
    assert!(worst_window(&answers, Some(EU), REFILL * 0.5, 0.0, static_end) <= CAPACITY * 0.5);
    assert!(
        worst_window(&answers, Some(EU), REFILL * grown.0, grown_from, end) <= CAPACITY * grown.0
    );
    // The busier region admits more once it holds more.
    assert!(
        eu_grown > eu_static,
        "eu admitted {eu_grown}/s after, {eu_static}/s before"
    );
    // Cut off from its Redis, us admits nothing (on_error deny).
    assert!(us_cut.iter().all(|s| *s != 200), "{us_cut:?}");
}
