//! `make reliability`: failure behaviour, measured. Starts the real processes on loopback (Redis
//! single, Sentinel or Cluster, the sidecar binary, Envoy with the filter, an upstream), puts load
//! on them, breaks them on purpose, and prints ONE table (markdown, as docs/failure-behaviour.md
//! carries it): per scenario the load, the fault, what was admitted and rejected, the
//! over-admission against the exact bound, the gateway's decision time (p50/p99 at the client,
//! and from the filter's `decision_us` histogram where useful), errors and recovery time.
//!
//! Every scenario is bounded in time; its processes are stopped when it ends, also when it fails
//! (the harness kills on drop; a failed scenario becomes a row saying so). Bounds are computed and
//! checked (✓/✗) in the last column; timings are printed, never judged.
//!
//! Scenarios (`--scenario 1,3` runs some): 1 shared budget, 2 hot key, 3 Redis slow/down per
//! `on_error`, 4 failover (Sentinel, Cluster), 5 uncertain results, 6 sidecar restart, 7 flood,
//! 8 many clients, 9 a region's Redis restored from an older snapshot, 10 policy reload under
//! leases, 11 a Redis that lost its state, 12 a Redis restarted from an older snapshot, 13
//! concurrency slots lost with the store, 14 a Redis Cluster's epochs.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use nix::sys::signal::Signal;
use ratelimit_e2e::load::{self, figures, Background, Callers, Figures, Outcome, Status};
use ratelimit_e2e::plugin::{max_lease_tokens, rule, with_emergency, Plugin};
use ratelimit_e2e::probe::{
    self, dbsize, filter_decision_us, script_calls, used_memory, write_calls,
};
use ratelimit_e2e::report::{markdown, ms, quantile};
use ratelimit_e2e::store_loss::{self, Loss};
use ratelimit_e2e::{
    http, Envoy, EnvoyConfig, FaultProxy, Redis, RedisCluster, Sentinel, Sidecar, Upstream,
};
use serde_json::{json, Value};

#[derive(Parser, Clone)]
#[command(
    about = "Failure behaviour, measured: every scenario of docs/failure-behaviour.md, one table"
)]
struct Args {
    /// Seconds of load per phase (a fault lasts as long).
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// Scenarios to run, by number (1-14), comma separated; all by default.
    #[arg(long, value_delimiter = ',')]
    scenario: Vec<u32>,
    /// Concurrent clients on the loaded key(s).
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Distinct keys of scenario 8.
    #[arg(long, default_value_t = 100_000)]
    keys: usize,
    /// Lost replies (and repeats) in scenario 5.
    #[arg(long, default_value_t = 100)]
    lost: usize,
    /// Also write the table to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One line of the table; every cell already formatted.
#[derive(Default, Clone)]
struct Row {
    scenario: String,
    load: String,
    fault: String,
    admitted: String,
    rejected: String,
    over: String,
    client: String,
    filter: String,
    errors: String,
    recovery: String,
    check: String,
}

const HEADER: [&str; 11] = [
    "scenario",
    "load",
    "fault",
    "admitted",
    "rejected",
    "over-admission (exact bound)",
    "decision p50 / p99, client",
    "p50 / p99, filter decision_us",
    "errors",
    "recovery",
    "bounds checked",
];

impl Row {
    fn cells(&self) -> [&str; 11] {
        [
            &self.scenario,
            &self.load,
            &self.fault,
            &self.admitted,
            &self.rejected,
            &self.over,
            &self.client,
            &self.filter,
            &self.errors,
            &self.recovery,
            &self.check,
        ]
    }
}

fn table(rows: &[Row]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.cells().iter().map(|c| c.to_string()).collect())
        .collect();
    markdown(&HEADER, &rows)
}

// ---------------------------------------------------------------------------------------------
// Load: closed-loop HTTP clients on a runtime of their own, recording every answer.

/// A group of identical clients.
#[derive(Clone)]
struct Clients {
    /// Which group the samples belong to.
    group: usize,
    count: usize,
    /// Requests go round-robin over these URLs.
    urls: Vec<String>,
    headers: Vec<(String, String)>,
    /// The loopback address to send from (the client's "ip" as Envoy sees it).
    from: Option<IpAddr>,
    /// Pause between two requests of one client (None: closed loop, as fast as answered).
    pause: Option<Duration>,
}

impl Clients {
    fn new(group: usize, count: usize, urls: &[String]) -> Clients {
        Clients {
            group,
            count,
            urls: urls.to_vec(),
            headers: Vec::new(),
            from: None,
            pause: None,
        }
    }
    fn header(mut self, k: &str, v: &str) -> Clients {
        self.headers.push((k.into(), v.into()));
        self
    }
    fn from(mut self, ip: IpAddr) -> Clients {
        self.from = Some(ip);
        self
    }
    fn pause(mut self, d: Duration) -> Clients {
        self.pause = Some(d);
        self
    }

    /// The group as callers of the load generator: GETs with a 5 s timeout.
    fn callers(self) -> Callers<Status> {
        let mut builder = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .no_proxy();
        if let Some(ip) = self.from {
            builder = builder.local_address(ip);
        }
        let client = builder.build().expect("client");
        let (urls, headers) = (self.urls, self.headers);
        let op = load::op(move |call| {
            let url = urls[(call.caller + call.n as usize) % urls.len()].clone();
            let (client, headers) = (client.clone(), headers.clone());
            async move { load::get(&client, &url, &headers).await }
        });
        let callers = Callers::new(self.group, self.count, op);
        match self.pause {
            Some(p) => callers.pause(p),
            None => callers,
        }
    }
}

/// One answer (status 0: no answer, the request failed or timed out at the client).
type Sample = load::Sample<Status>;

/// The groups' clients, on a runtime of their own (2 threads), until `finish`.
fn start_load(groups: Vec<Clients>) -> Background<Status> {
    Background::start(2, groups.into_iter().map(Clients::callers).collect())
}

fn p50_p99(f: &Figures) -> String {
    format!("{} / {}", ms(f.p50), ms(f.p99))
}

/// Errors of a group of samples, by kind: `503 x12, no answer x3`.
fn errors_by_kind<'a>(samples: impl IntoIterator<Item = &'a Sample>) -> String {
    let mut by: std::collections::BTreeMap<u16, usize> = Default::default();
    for s in samples.into_iter().filter(|s| s.failed()) {
        *by.entry(s.status()).or_default() += 1;
    }
    if by.is_empty() {
        return "0".into();
    }
    by.iter()
        .map(|(s, n)| match s {
            0 => format!("no answer ×{n}"),
            s => format!("{s} ×{n}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// How long decisions kept failing after `from`: from `from` to the answer of the last failed
/// request sent at or after `from` and answered before `until` (zero when none failed). `until` is
/// when the next fault begins: a request still in flight then may have failed by that fault, not
/// by this one, so it is not counted (counting it once made a Redis that resumed at once look as
/// if it had failed for the whole 2 s until it was stopped).
fn recovery(samples: &[Sample], group: usize, from: Duration, until: Duration) -> Duration {
    samples
        .iter()
        .filter(|s| s.group == group && s.at >= from && s.done() < until && s.failed())
        .map(|s| s.done().saturating_sub(from))
        .max()
        .unwrap_or_default()
}

fn mark(ok: bool) -> &'static str {
    if ok {
        "✓"
    } else {
        "✗"
    }
}

// ---------------------------------------------------------------------------------------------
// What the processes say about themselves.

fn filter_cell(envoys: &[&Envoy]) -> String {
    envoys
        .iter()
        .filter_map(|e| filter_decision_us(e))
        .map(|(p50, p99)| format!("{:.1} / {:.1} ms", p50 / 1000.0, p99 / 1000.0))
        .collect::<Vec<_>>()
        .join("; ")
}

/// A bucket as the script stores it: (tokens, ts µs, expiry ms the key carries).
fn stored(conn: &mut redis::Connection, key: &str) -> Option<(f64, f64, f64)> {
    let raw: Option<Vec<u8>> = redis::cmd("GET").arg(key).query(conn).ok()?;
    unpack(&raw?)
}

/// [`stored`] from the key's bytes: three little-endian doubles first.
fn unpack(raw: &[u8]) -> Option<(f64, f64, f64)> {
    let d = |i: usize| -> Option<f64> {
        Some(f64::from_le_bytes(
            raw.get(i * 8..i * 8 + 8)?.try_into().ok()?,
        ))
    };
    Some((d(0)?, d(1)?, d(2)?))
}

/// The sum of one counter over several Envoys.
fn counters(envoys: &[&Envoy], name: &str) -> u64 {
    envoys.iter().map(|e| e.counter(name)).sum()
}

fn emergency_admits(envoys: &[&Envoy]) -> u64 {
    counters(envoys, "ratelimit.emergency_activations")
        .saturating_sub(counters(envoys, "ratelimit.emergency_rejected"))
}

// ---------------------------------------------------------------------------------------------
// Stacks.

/// The plugin configuration of `envoy/envoy.yaml` with `rules` and the callout timeout
/// `timeout_ms`.
fn plugin(rules: Value, timeout_ms: u64) -> Plugin {
    Plugin::shipped_identities(rules).timeout_ms(timeout_ms)
}

fn envoy(sidecar: &Sidecar, upstream: &Upstream, plugin: &Plugin) -> Envoy {
    Envoy::start(
        &EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port)
            .plugin(&plugin.to_string())
            .concurrency(2),
    )
}

/// The shipped timeouts: the filter waits 50 ms, the sidecar bounds Redis at 30 ms.
const FILTER_TIMEOUT_MS: u64 = 50;

fn log(what: &str) {
    eprintln!("[reliability] {what}");
}

fn sleep(d: Duration) {
    std::thread::sleep(d);
}

// ---------------------------------------------------------------------------------------------
// 1. Shared budget.

fn shared_budget(a: &Args) -> Vec<Row> {
    let (capacity, refill) = (200.0, 50.0);
    let gateways = 2;
    let redis = Redis::start();
    let upstream = Upstream::start();
    let policy = format!("rules:\n  per-app: {{capacity: {capacity}, refill_per_sec: {refill}}}\n");
    let rules = json!([rule("per-app", "/api/", &["app"], "deny")]);
    let p = plugin(rules, FILTER_TIMEOUT_MS);
    let mut sidecars = Vec::new();
    let mut envoys = Vec::new();
    for _ in 0..gateways {
        let s = Sidecar::with_policy(&redis.url(), &policy, &[]);
        envoys.push(envoy(&s, &upstream, &p));
        sidecars.push(s);
    }
    let urls: Vec<String> = envoys.iter().map(|e| e.url("/api/x")).collect();
    log("1: shared budget, load");
    let load = start_load(vec![
        Clients::new(0, a.clients, &urls).header("x-api-key", "alpha-key")
    ]);
    sleep(Duration::from_secs(a.seconds));
    let samples = load.finish();
    let f = figures(&samples);
    let t = f.span.as_secs_f64();
    let bound = capacity + refill * t;
    let over = (f.admitted as f64 - bound.floor()).max(0.0);
    // A lease is at most the sidecar's --lease-max-share of the capacity; each gateway may end
    // holding two (the one in use and the next).
    let lease = max_lease_tokens(capacity);
    let lower = capacity + refill * t - gateways as f64 * 2.0 * lease - f.errors as f64;
    let er: Vec<&Envoy> = envoys.iter().collect();
    let leased = counters(&er, "ratelimit.lease_admitted");
    let known = counters(&er, "ratelimit.known_rejections");
    let callouts = counters(&er, "ratelimit.callouts");
    vec![Row {
        scenario: "1 shared budget".into(),
        load: format!(
            "{} clients, 1 key, {gateways} Envoys ×2 workers, a sidecar each, 1 Redis; {capacity} + {refill}/s; {} req in {t:.1} s",
            a.clients, f.n
        ),
        fault: "none".into(),
        admitted: format!("{} ({leased} from leases)", f.admitted),
        rejected: format!("{} ({known} known locally)", f.rejected),
        over: format!("{over} (≤ C + r·T = {bound:.0})"),
        client: p50_p99(&f),
        filter: filter_cell(&er),
        errors: format!("{} ({callouts} callouts)", errors_by_kind(&samples)),
        recovery: String::new(),
        check: format!(
            "admitted ≤ {bound:.0} {}; ≥ C + r·T − 2N·L − errors = {lower:.0} {}; upstream saw {} {}",
            mark(f.admitted as f64 <= bound.floor()),
            mark(f.admitted as f64 >= lower.floor()),
            upstream.hits(),
            mark(upstream.hits() as usize == f.admitted)
        ),
    }]
}

// ---------------------------------------------------------------------------------------------
// 2. Hot key beside quiet keys, on a Cluster.

fn hot_key(a: &Args) -> Vec<Row> {
    let (capacity, refill) = (100.0, 50.0);
    let cluster = RedisCluster::start();
    let policy = format!("rules:\n  per-ip: {{capacity: {capacity}, refill_per_sec: {refill}}}\n");
    let sidecar = Sidecar::start_with_args(&policy, &["--redis-cluster", &cluster.seeds()]);
    let upstream = Upstream::start();
    let rules = json!([rule("per-ip", "/", &["ip"], "deny")]);
    let e = envoy(&sidecar, &upstream, &plugin(rules, FILTER_TIMEOUT_MS));
    let url = vec![e.url("/x")];
    let quiet_clients = 50u8;
    let mut groups = vec![Clients::new(0, a.clients, &url).from([127, 0, 0, 1].into())];
    for i in 0..quiet_clients {
        groups.push(
            Clients::new(1, 1, &url)
                .from([127, 0, 1, 10 + i].into())
                .pause(Duration::from_millis(200)),
        );
    }
    let before: Vec<(u64, f64)> = cluster
        .nodes
        .iter()
        .map(|n| (script_calls(n).calls as u64, probe::redis_cpu_seconds(n)))
        .collect();
    log("2: hot key, load");
    let load = start_load(groups);
    sleep(Duration::from_secs(a.seconds));
    let samples = load.finish();
    let after: Vec<(u64, f64)> = cluster
        .nodes
        .iter()
        .map(|n| (script_calls(n).calls as u64, probe::redis_cpu_seconds(n)))
        .collect();
    // The hot client's bucket and its node.
    let hot_node = cluster
        .nodes
        .iter()
        .position(|n| !n.cli(&["--scan", "--pattern", "*ip=127.0.0.1}"]).is_empty());
    let hot: Vec<&Sample> = samples.iter().filter(|s| s.group == 0).collect();
    let quiet: Vec<&Sample> = samples.iter().filter(|s| s.group == 1).collect();
    let fh = figures(hot.iter().copied());
    let fq = figures(quiet.iter().copied());
    let t = fh.span.as_secs_f64();
    let bound = capacity + refill * t;
    let per_node: Vec<String> = cluster
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            format!(
                "{}:{} {} calls {:.2} s CPU",
                if Some(i) == hot_node { "HOT " } else { "" },
                n.port,
                after[i].0 - before[i].0,
                after[i].1 - before[i].1
            )
        })
        .collect();
    let quiet_rejected = fq.rejected;
    vec![
        Row {
            scenario: "2 hot key".into(),
            load: format!(
                "hot: {} clients from one address, {} req in {t:.1} s; {capacity} + {refill}/s; 1 Envoy, 3-primary Cluster",
                a.clients, fh.n
            ),
            fault: "none".into(),
            admitted: fh.admitted.to_string(),
            rejected: fh.rejected.to_string(),
            over: format!(
                "{} (≤ {bound:.0})",
                (fh.admitted as f64 - bound.floor()).max(0.0)
            ),
            client: p50_p99(&fh),
            filter: filter_cell(&[&e]),
            errors: errors_by_kind(hot.iter().copied()),
            recovery: String::new(),
            check: format!(
                "admitted ≤ {bound:.0} {}; shard load: {}",
                mark(fh.admitted as f64 <= bound.floor()),
                per_node.join(", ")
            ),
        },
        Row {
            scenario: "2 quiet keys".into(),
            load: format!(
                "{quiet_clients} quiet clients, each its own address at 5 req/s; {} req",
                fq.n
            ),
            fault: "beside the hot key".into(),
            admitted: fq.admitted.to_string(),
            rejected: fq.rejected.to_string(),
            over: "0 (each under its limit)".into(),
            client: p50_p99(&fq),
            filter: String::new(),
            errors: errors_by_kind(quiet.iter().copied()),
            recovery: String::new(),
            check: format!("quiet clients rejected: {quiet_rejected} {}", mark(quiet_rejected == 0)),
        },
    ]
}

// ---------------------------------------------------------------------------------------------
// 3. Redis slow (frozen) and down (stopped), for each on_error.

fn redis_outage(a: &Args) -> Vec<Row> {
    let (em_capacity, em_refill) = (20u64, 2.0);
    let mut redis = Redis::start();
    let policy = "rules:\n  allow: {capacity: 100000, refill_per_sec: 10000}\n  deny: {capacity: 100000, refill_per_sec: 10000}\n  local: {capacity: 100000, refill_per_sec: 10000}\n";
    let sidecar = Sidecar::with_policy(&redis.url(), policy, &[]);
    let upstream = Upstream::start();
    let rules = json!([
        rule("allow", "/allow/", &["ip"], "allow"),
        rule("deny", "/deny/", &["ip"], "deny"),
        with_emergency(
            rule("local", "/local/", &["ip"], "local"),
            em_capacity,
            em_refill
        )
    ]);
    // Leases off: what is admitted during the fault is the policy's doing alone (with leases, a
    // gateway also admits, exactly, from a lease it held when the fault began, for at most the
    // lease's ttl_ms).
    let p = plugin(rules, FILTER_TIMEOUT_MS).leases(false);
    let e = envoy(&sidecar, &upstream, &p);
    let per = (a.clients / 3).max(1);
    let names = ["allow", "deny", "local"];
    let groups: Vec<Clients> = names
        .iter()
        .enumerate()
        .map(|(g, n)| Clients::new(g, per, &[e.url(&format!("/{n}/x"))]))
        .collect();
    let d = Duration::from_secs(a.seconds);
    log("3: Redis outage, load");
    let load = start_load(groups);
    sleep(Duration::from_secs(1));
    let em0 = emergency_admits(&[&e]);
    let frozen_at = load.now();
    redis.process.signal(Signal::SIGSTOP);
    sleep(d);
    redis.process.signal(Signal::SIGCONT);
    let thawed_at = load.now();
    let em1 = emergency_admits(&[&e]);
    sleep(Duration::from_secs(2));
    let em2 = emergency_admits(&[&e]);
    let stopped_at = load.now();
    redis.stop();
    sleep(d);
    let restarting_at = load.now();
    redis.restart();
    let em3 = emergency_admits(&[&e]);
    sleep(Duration::from_secs(2));
    let end = load.now();
    let samples = load.finish();
    let mut rows = Vec::new();
    for (fault, from, until, back, next, em) in [
        (
            format!("Redis frozen (SIGSTOP) {} s", a.seconds),
            frozen_at,
            thawed_at,
            thawed_at,
            stopped_at,
            em1 - em0,
        ),
        (
            format!("Redis stopped {} s, restarted empty", a.seconds),
            stopped_at,
            restarting_at,
            restarting_at,
            end,
            em3 - em2,
        ),
    ] {
        let outage = (until - from).as_secs_f64();
        let rec = recovery(&samples, 1, back, next);
        // Failing up to the window's end (within two filter timeouts of it) is no recovery time:
        // the decisions were still failing when it ended.
        let window = next.saturating_sub(back);
        let recovered = if rec + 2 * Duration::from_millis(FILTER_TIMEOUT_MS) >= window {
            format!(
                "still failing {} after Redis was back (the window's end)",
                ms(window)
            )
        } else {
            format!("{} after Redis is back (resumed / restart began)", ms(rec))
        };
        for (g, name) in names.iter().enumerate() {
            let window: Vec<&Sample> = samples
                .iter()
                .filter(|s| s.group == g && s.at >= from && s.done() < until)
                .collect();
            let f = figures(window.iter().copied());
            let (over, check) = match *name {
                "allow" => (
                    "unbounded (fail open)".to_string(),
                    format!(
                        "admits all {} {}",
                        f.admitted,
                        mark(f.admitted + f.errors == f.n)
                    ),
                ),
                "deny" => (
                    "0".to_string(),
                    format!("admitted 0 {}", mark(f.admitted == 0)),
                ),
                _ => {
                    let bound = em_capacity as f64 + em_refill * outage;
                    (
                        format!("{em} emergency (≤ N·(C_e + r_e·t) = {bound:.0})"),
                        format!(
                            "emergency admits {em} ≤ {bound:.0} {}",
                            mark(em as f64 <= bound)
                        ),
                    )
                }
            };
            rows.push(Row {
                scenario: format!("3 Redis outage, on_error {name}"),
                load: format!(
                    "{per} clients on /{name}/ (leases off), {} req sent and answered during the fault",
                    f.n
                ),
                fault: fault.clone(),
                admitted: f.admitted.to_string(),
                rejected: f.rejected.to_string(),
                over,
                client: p50_p99(&f),
                filter: String::new(),
                errors: errors_by_kind(window.iter().copied()),
                recovery: if *name == "deny" {
                    recovered.clone()
                } else {
                    String::new()
                },
                // The decision time is printed, not judged: the filter gives up at its timeout,
                // but a saturated machine adds its own scheduling delay on top.
                check: format!("{check}; the filter's timeout is {FILTER_TIMEOUT_MS} ms"),
            });
        }
    }
    drop(sidecar);
    rows
}

// ---------------------------------------------------------------------------------------------
// 4. Failover under load: Sentinel, and Cluster with a replica per primary.

struct Failover {
    samples: Vec<Sample>,
    killed_at: Duration,
    lag_bytes: i64,
    capacity: f64,
    refill: f64,
    /// Single charges (a fresh bucket of 1 each, no refill) acknowledged, and how many of them a
    /// repeat after the failover admitted again (their write was lost at promotion).
    charges: usize,
    lost: usize,
}

/// A fresh bucket of one token charged: its subject's id when the charge was answered allowed.
struct Charged(Option<String>);

impl Outcome for Charged {
    fn failed(&self) -> bool {
        self.0.is_none()
    }
}

/// Charges fresh buckets of one token (rule `once`) straight at the sidecar from 2 callers
/// until finished (5 ms between two charges not answered allowed).
fn charge_fresh_keys(url: String) -> Background<Charged> {
    let client = load::http_client(2, Duration::from_secs(10));
    let op = load::op(move |call| {
        let id = format!("k-{}-{}", call.caller, call.n + 1);
        let (client, url) = (client.clone(), url.clone());
        async move {
            let allowed = once(&client, &url, &id).await == Some(true);
            Charged(allowed.then_some(id))
        }
    });
    Background::start(
        1,
        vec![Callers::new(0, 2, op).backoff(Duration::from_millis(5))],
    )
}

/// One decision of rule `once` for `id`: whether it was allowed (None: no answer).
async fn once(c: &reqwest::Client, url: &str, id: &str) -> Option<bool> {
    let body =
        json!({"requests": [{"decisions": [{"rule": "once", "subject": {"id": id}, "cost": 1}]}]});
    let r = c.post(url).json(&body).send().await.ok()?;
    if r.status() != 200 {
        return None;
    }
    let v: Value = r.json().await.ok()?;
    v["answers"][0]["allowed"].as_bool()
}

/// Replication offsets: what `primary` wrote that `replica` had not received, in bytes.
fn lag_bytes(primary: &Redis, replica: &Redis) -> i64 {
    let offset = |r: &Redis, k: &str| -> i64 {
        probe::info(r, "replication")
            .get(k)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    // The replica first: the difference can only overstate the lag.
    let received = offset(replica, "slave_repl_offset");
    (offset(primary, "master_repl_offset") - received).max(0)
}

/// Loads `envoy` on one key, and after `a.seconds` runs `kill` (which kills the primary and
/// returns the replication lag it saw just before); keeps the load until decisions have gone
/// 2 s without a limiter error (at most 30 s after the kill).
fn failover_run(a: &Args, e: &Envoy, sidecar: &Sidecar, kill: impl FnOnce() -> i64) -> Failover {
    let load = start_load(vec![
        Clients::new(0, a.clients, &[e.url("/api/x")]).header("x-api-key", "alpha-key")
    ]);
    let url = format!("{}/v1/decide", sidecar.base_url());
    let charging = charge_fresh_keys(url.clone());
    sleep(Duration::from_secs(a.seconds));
    let killed_at = load.now();
    let lag_bytes = kill();
    let admitted = || counters(&[e], "ratelimit.admitted");
    let errors = || counters(&[e], "ratelimit.limiter_error");
    let deadline = Instant::now() + Duration::from_secs(30);
    // Until no limiter error for 2 s while decisions are admitted again.
    let mut quiet_since: Option<(Instant, u64, u64)> = None;
    while Instant::now() < deadline {
        sleep(Duration::from_millis(100));
        let (ad, er) = (admitted(), errors());
        match quiet_since {
            Some((t, a0, e0)) if er == e0 => {
                if t.elapsed() > Duration::from_secs(2) && ad > a0 {
                    break;
                }
            }
            _ => quiet_since = Some((Instant::now(), ad, er)),
        }
    }
    let samples = load.finish();
    let charged: Vec<String> = charging
        .finish()
        .into_iter()
        .filter_map(|s| s.outcome.0)
        .collect();
    // Every bucket of one token answered allowed must now be empty: a repeat admitted again
    // found the write of its charge lost at the promotion.
    let c = load::http_client(1, Duration::from_secs(10));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let lost = rt.block_on(async {
        let mut lost = 0;
        for id in &charged {
            if once(&c, &url, id).await == Some(true) {
                lost += 1;
            }
        }
        lost
    });
    Failover {
        samples,
        killed_at,
        lag_bytes,
        capacity: 0.0,
        refill: 0.0,
        charges: charged.len(),
        lost,
    }
}

fn failover_row(name: &str, topology: &str, f: Failover, envoy: &Envoy) -> Row {
    let all = figures(&f.samples);
    let during: Vec<&Sample> = f.samples.iter().filter(|s| s.at >= f.killed_at).collect();
    let rec = recovery(&f.samples, 0, f.killed_at, Duration::MAX);
    let meanwhile = during
        .iter()
        .filter(|s| s.at <= f.killed_at + rec && s.failed())
        .count();
    let t = all.span.as_secs_f64();
    let bound = f.capacity + f.refill * t;
    let over = (all.admitted as f64 - bound.floor()).max(0.0);
    Row {
        scenario: format!("4 failover, {name}"),
        load: format!(
            "{} req on 1 key, {} + {}/s; {topology}",
            all.n, f.capacity, f.refill
        ),
        fault: "primary killed (SIGKILL)".into(),
        admitted: all.admitted.to_string(),
        rejected: all.rejected.to_string(),
        over: format!(
            "{over} on the hot key (≤ C + r·T = {bound:.0}); {} on {} buckets of 1 (writes lost)",
            f.lost, f.charges
        ),
        client: p50_p99(&all),
        filter: filter_cell(&[envoy]),
        errors: errors_by_kind(&f.samples),
        recovery: format!("{} after the kill; {meanwhile} req denied (on_error deny) meanwhile", ms(rec)),
        check: format!(
            "hot key admitted ≤ C + r·T + lost = {:.0} {}; writes lost at promotion: {} of {} single charges admitted again when repeated (replication lag at the kill {} B)",
            bound + f.lost as f64,
            mark(all.admitted as f64 <= bound.floor() + f.lost as f64),
            f.lost,
            f.charges,
            f.lag_bytes
        ),
    }
}

fn failover(a: &Args) -> Vec<Row> {
    let (capacity, refill) = (100.0, 100.0);
    let policy = format!(
        "rules:\n  per-app: {{capacity: {capacity}, refill_per_sec: {refill}}}\n  once: {{capacity: 1, refill_per_sec: 0.001}}\n"
    );
    let rules = json!([rule("per-app", "/api/", &["app"], "deny")]);
    let p = plugin(rules, FILTER_TIMEOUT_MS);
    let upstream = Upstream::start();
    let mut rows = Vec::new();

    // Sentinel: a primary, its replica, three Sentinels (quorum 2, down-after 1 s).
    {
        let mut primary = Redis::start();
        let replica = Redis::start_with(&["--replicaof", "127.0.0.1", &primary.port.to_string()]);
        ratelimit_e2e::wait_until("the replica's link", Duration::from_secs(30), || {
            replica
                .cli(&["INFO", "replication"])
                .contains("master_link_status:up")
        });
        let sentinels: Vec<Sentinel> = (0..3)
            .map(|_| Sentinel::start("mymaster", primary.port, 2))
            .collect();
        let urls: Vec<String> = sentinels.iter().map(Sentinel::url).collect();
        let sidecar = Sidecar::start_with_args(
            &policy,
            &[
                "--redis-sentinel",
                &urls.join(","),
                "--sentinel-master",
                "mymaster",
            ],
        );
        let e = envoy(&sidecar, &upstream, &p);
        log("4: Sentinel failover, load");
        let mut f = failover_run(a, &e, &sidecar, || {
            let lag = lag_bytes(&primary, &replica);
            primary.stop();
            lag
        });
        f.capacity = capacity;
        f.refill = refill;
        rows.push(failover_row(
            "Sentinel",
            "primary + replica + 3 Sentinels (down-after 1 s)",
            f,
            &e,
        ));
    }

    // Cluster: three primaries with a replica each (node timeout 2 s).
    {
        let mut cluster = RedisCluster::start_replicated(2000);
        let sidecar = Sidecar::start_with_args(&policy, &["--redis-cluster", &cluster.seeds()]);
        let e = envoy(&sidecar, &upstream, &p);
        let key = "rl:{ratelimit|rule=per-app|app=alpha}";
        let p_index = cluster.primary_of(key).expect("a primary serves the key");
        let r_index = cluster
            .replica_of(p_index)
            .expect("the primary has a replica");
        log("4: Cluster failover, load");
        let mut f = failover_run(a, &e, &sidecar, || {
            let lag = lag_bytes(&cluster.nodes[p_index], &cluster.nodes[r_index]);
            cluster.nodes[p_index].stop();
            lag
        });
        f.capacity = capacity;
        f.refill = refill;
        rows.push(failover_row(
            "Cluster",
            "3 primaries + 1 replica each (node timeout 2 s)",
            f,
            &e,
        ));
    }
    rows
}

// ---------------------------------------------------------------------------------------------
// 5. Uncertain results: the reply is lost after Redis applied the call.

fn uncertain(a: &Args) -> Vec<Row> {
    let capacity = 10_000.0;
    let redis = Redis::start();
    let proxy = FaultProxy::start(redis.port);
    let policy = format!("rules:\n  once: {{capacity: {capacity}, refill_per_sec: 0.001}}\n");
    let sidecar = Sidecar::start_with_args(&policy, &["--redis", &proxy.url()]);
    let c = http();
    let url = format!("{}/v1/decide", sidecar.base_url());
    let mut conn = redis.connection();
    let mut rows = Vec::new();
    for (same_attempt, label) in [(true, "same attempt id"), (false, "a new attempt id")] {
        let id = if same_attempt { "same" } else { "new" };
        let key = format!("rl:{{ratelimit|rule=once|id={id}}}");
        let body = |attempt: &str| {
            json!({"attempt": attempt,
                   "requests": [{"decisions": [{"rule": "once", "subject": {"id": id}, "cost": 1}]}]})
        };
        let mut latencies = Vec::new();
        let (mut first_failed, mut repeats, mut answered, mut errors) = (0, 0, 0, 0);
        log(&format!("5: lost replies, repeat with {label}"));
        let started = Instant::now();
        for i in 0..a.lost {
            let lost_before = proxy.lost();
            proxy.lose_replies(1);
            let attempt = format!("{id}-{i}");
            let t = Instant::now();
            let status = c
                .post(&url)
                .json(&body(&attempt))
                .send()
                .map_or(0, |r| r.status().as_u16());
            latencies.push(t.elapsed());
            if status != 200 {
                first_failed += 1;
            }
            // Bounded: the connection is closed once Redis has answered.
            let wait = Instant::now() + Duration::from_secs(5);
            while proxy.lost() == lost_before && Instant::now() < wait {
                sleep(Duration::from_millis(1));
            }
            // The caller repeats until it gets an answer (bounded).
            let repeat = if same_attempt {
                attempt.clone()
            } else {
                format!("{attempt}-retry")
            };
            let wait = Instant::now() + Duration::from_secs(10);
            loop {
                repeats += 1;
                let t = Instant::now();
                let r = c.post(&url).json(&body(&repeat)).send();
                latencies.push(t.elapsed());
                match r.map(|r| r.status().as_u16()) {
                    Ok(200) => {
                        answered += 1;
                        break;
                    }
                    _ if Instant::now() > wait => break,
                    _ => errors += 1,
                }
                sleep(Duration::from_millis(5));
            }
        }
        let elapsed = started.elapsed();
        let charged =
            stored(&mut conn, &key).map_or(0.0, |(tokens, _, _)| (capacity - tokens).round());
        let decisions = a.lost as f64;
        latencies.sort();
        let pick = |q: f64| quantile(&latencies, q);
        let over_charge = charged - decisions;
        rows.push(Row {
            scenario: format!("5 uncertain result, repeat with {label}"),
            load: format!(
                "{} decisions straight to the sidecar, each reply lost once, repeated until answered ({repeats} repeats, {} in all)",
                a.lost,
                ms(elapsed)
            ),
            fault: "proxy drops the script's reply after Redis applied it (connection closed)".into(),
            admitted: format!("{answered} answered allowed"),
            rejected: "0".into(),
            over: if same_attempt {
                "0".into()
            } else {
                format!("0 (but {over_charge} tokens charged twice: under-admission)")
            },
            client: format!("{} / {}", ms(pick(0.5)), ms(pick(0.99))),
            filter: String::new(),
            errors: format!("{first_failed} lost answers (503), {errors} failed repeats"),
            recovery: String::new(),
            check: if same_attempt {
                format!(
                    "charged {charged} for {decisions} decisions: once {}",
                    mark(charged == decisions)
                )
            } else {
                format!(
                    "charged {charged} for {decisions} decisions (twice without the id) {}",
                    mark(charged == 2.0 * decisions)
                )
            },
        });
    }
    rows
}

// ---------------------------------------------------------------------------------------------
// 6. Sidecar killed and restarted under load.

fn sidecar_restart(a: &Args) -> Vec<Row> {
    let (capacity, refill) = (100.0, 50.0);
    let (em_capacity, em_refill) = (10u64, 1.0);
    let redis = Redis::start();
    let policy = format!(
        "rules:\n  per-app: {{capacity: {capacity}, refill_per_sec: {refill}}}\n  probe: {{capacity: 100000, refill_per_sec: 10000}}\n"
    );
    let mut sidecar = Sidecar::with_policy(&redis.url(), &policy, &[]);
    let upstream = Upstream::start();
    let rules = json!([
        with_emergency(
            rule("per-app", "/api/", &["app"], "local"),
            em_capacity,
            em_refill
        ),
        rule("probe", "/probe/", &["ip"], "deny")
    ]);
    let e = envoy(&sidecar, &upstream, &plugin(rules, FILTER_TIMEOUT_MS));
    log("6: sidecar restart, load");
    let load = start_load(vec![
        Clients::new(0, a.clients, &[e.url("/api/x")]).header("x-api-key", "alpha-key"),
        Clients::new(1, 1, &[e.url("/probe/x")]).pause(Duration::from_millis(10)),
    ]);
    sleep(Duration::from_secs(a.seconds));
    let em0 = emergency_admits(&[&e]);
    let killed_at = load.now();
    sidecar.process.stop();
    sleep(Duration::from_secs(a.seconds));
    let restart_at = load.now();
    let port = sidecar.port;
    sidecar = Sidecar::start_on(port, &redis.url(), &policy, &[]);
    let ready_at = load.now();
    let em1 = emergency_admits(&[&e]);
    sleep(Duration::from_secs(2));
    let samples = load.finish();
    let outage = (restart_at - killed_at).as_secs_f64();
    let during: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.group == 0 && s.at >= killed_at && s.at < ready_at)
        .collect();
    let f = figures(during.iter().copied());
    let all = figures(samples.iter().filter(|s| s.group == 0));
    let em = em1 - em0;
    let em_bound = em_capacity as f64 + em_refill * (ready_at - killed_at).as_secs_f64();
    let bound = capacity + refill * all.span.as_secs_f64();
    let by_sidecar = all.admitted as f64 - (emergency_admits(&[&e]) as f64);
    let rec = recovery(&samples, 1, restart_at, Duration::MAX);
    let probe_failures: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.group == 1 && s.at >= killed_at && s.failed())
        .collect();
    let first_failure = probe_failures.iter().map(|s| s.done()).min();
    let last_failure = probe_failures.iter().map(|s| s.done()).max();
    drop(sidecar);
    vec![Row {
        scenario: "6 sidecar restart".into(),
        load: format!(
            "{} clients on 1 key ({capacity} + {refill}/s), on_error local (emergency {em_capacity} + {em_refill}/s); {} req during the outage",
            a.clients, f.n
        ),
        fault: format!("sidecar killed (SIGKILL), restarted after {outage:.1} s"),
        admitted: format!("{} during the outage ({em} by the emergency bucket)", f.admitted),
        rejected: f.rejected.to_string(),
        over: format!(
            "{} by decisions (≤ {bound:.0}); {em} emergency",
            (by_sidecar - bound.floor()).max(0.0)
        ),
        client: p50_p99(&f),
        filter: String::new(),
        errors: errors_by_kind(during.iter().copied()),
        recovery: format!(
            "{} after the restart began (ready {} after it); probe (on_error deny) failed from {} after the kill to {} after it",
            ms(rec),
            ms(ready_at - restart_at),
            first_failure.map_or("—".into(), |t| ms(t.saturating_sub(killed_at))),
            last_failure.map_or("—".into(), |t| ms(t.saturating_sub(killed_at)))
        ),
        check: format!(
            "emergency admits {em} ≤ N·(C_e + r_e·t) = {em_bound:.0} {}; decisions {by_sidecar} ≤ {bound:.0} {}",
            mark(em as f64 <= em_bound),
            mark(by_sidecar <= bound.floor())
        ),
    }]
}

// ---------------------------------------------------------------------------------------------
// 7. Flood: one key far over its limit.

fn flood(a: &Args) -> Vec<Row> {
    let capacity = 100.0;
    let redis = Redis::start();
    let policy = format!("rules:\n  per-app: {{capacity: {capacity}, refill_per_sec: 0.001}}\n");
    let sidecar = Sidecar::with_policy(&redis.url(), &policy, &[]);
    let upstream = Upstream::start();
    let rules = json!([rule("per-app", "/api/", &["app"], "deny")]);
    let e = envoy(&sidecar, &upstream, &plugin(rules, FILTER_TIMEOUT_MS));
    let mut rows = Vec::new();

    // Exhaust the bucket, then measure only the flood of rejections.
    let c = http();
    for _ in 0..(capacity as usize + 20) {
        let _ = c
            .get(e.url("/api/x"))
            .header("x-api-key", "alpha-key")
            .send();
    }
    let _ = redis.cli(&["CONFIG", "RESETSTAT"]);
    let (mem0, keys0) = (used_memory(&redis), dbsize(&redis));
    log("7: flood through Envoy");
    let load = start_load(vec![
        Clients::new(0, a.clients, &[e.url("/api/x")]).header("x-api-key", "alpha-key")
    ]);
    sleep(Duration::from_secs(a.seconds));
    let samples = load.finish();
    let f = figures(&samples);
    let (writes, scripts) = (write_calls(&redis), script_calls(&redis).calls as u64);
    let (mem1, keys1) = (used_memory(&redis), dbsize(&redis));
    rows.push(Row {
        scenario: "7 flood, through Envoy".into(),
        load: format!(
            "{} clients on 1 exhausted key ({capacity}, no refill) for {} s: {:.0} req/s",
            a.clients,
            a.seconds,
            f.n as f64 / f.span.as_secs_f64()
        ),
        fault: "far over the limit".into(),
        admitted: f.admitted.to_string(),
        rejected: format!(
            "{} ({} known at the gateway)",
            f.rejected,
            e.counter("ratelimit.known_rejections")
        ),
        over: format!("{} (≤ 0 after exhaustion)", f.admitted),
        client: p50_p99(&f),
        filter: filter_cell(&[&e]),
        errors: errors_by_kind(&samples),
        recovery: String::new(),
        check: format!(
            "Redis writes {writes} for {} rejections: {} per rejection {}; {scripts} script calls ({:.4} per rejection); memory {:+} B, keys {keys0}→{keys1}",
            f.rejected,
            writes as f64 / f.rejected.max(1) as f64,
            mark(writes == 0),
            scripts as f64 / f.rejected.max(1) as f64,
            mem1 - mem0
        ),
    });

    // Straight to the sidecar: every rejection reaches Redis (no gateway fast path), each with
    // an attempt id of its own as the filter sends.
    let _ = redis.cli(&["CONFIG", "RESETSTAT"]);
    let (mem0, keys0) = (used_memory(&redis), dbsize(&redis));
    log("7: flood straight to the sidecar");
    let callers = a.clients.min(8);
    let started = Instant::now();
    let load = Background::start(2, vec![flood_callers(&sidecar, callers)]);
    sleep(Duration::from_secs(a.seconds));
    let samples = load.finish();
    let elapsed = started.elapsed().as_secs_f64();
    let of = |v: Verdict| samples.iter().filter(|s| s.outcome == v).count();
    let (rej, adm) = (of(Verdict::Rejected), of(Verdict::Allowed));
    let n = samples.len() - of(Verdict::NoAnswer);
    let (writes, scripts) = (write_calls(&redis), script_calls(&redis).calls as u64);
    let (mem1, keys1) = (used_memory(&redis), dbsize(&redis));
    rows.push(Row {
        scenario: "7 flood, straight to the sidecar".into(),
        load: format!(
            "{callers} callers, 1 decision per call, an attempt id each: {:.0} calls/s",
            n as f64 / elapsed
        ),
        fault: "far over the limit".into(),
        admitted: adm.to_string(),
        rejected: rej.to_string(),
        over: format!("{adm} (≤ 0)"),
        client: String::new(),
        filter: String::new(),
        errors: (n - rej - adm).to_string(),
        recovery: String::new(),
        check: format!(
            "Redis writes {writes} for {rej} rejections {}; {scripts} script calls (batched: {:.2} per rejection); memory {:+} B, keys {keys0}→{keys1}",
            mark(writes == 0),
            scripts as f64 / rej.max(1) as f64,
            mem1 - mem0
        ),
    });
    rows
}

/// The sidecar's verdict on one decision, as a caller of `/v1/decide` sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Allowed,
    Rejected,
    /// An answer without a verdict (an error: 503 `{"error": ...}`).
    Error,
    /// No answer, or not JSON.
    NoAnswer,
}

impl Outcome for Verdict {
    fn failed(&self) -> bool {
        matches!(self, Verdict::Error | Verdict::NoAnswer)
    }
}

/// `callers` callers flooding rule `per-app` for app `alpha` straight at the sidecar, one
/// decision per call, an attempt id each (as the filter sends).
fn flood_callers(sidecar: &Sidecar, callers: usize) -> Callers<Verdict> {
    let client = load::http_client(callers, Duration::from_secs(10));
    let url = format!("{}/v1/decide", sidecar.base_url());
    let op = load::op(move |call| {
        let body = json!({"attempt": format!("f-{}-{}", call.caller, call.n + 1),
            "requests": [{"decisions": [{"rule": "per-app", "subject": {"app": "alpha"}, "cost": 1}]}]});
        let req = client.post(&url).json(&body);
        async move {
            let Ok(r) = req.send().await else {
                return Verdict::NoAnswer;
            };
            match r.json::<Value>().await {
                Ok(v) => match v["answers"][0]["allowed"].as_bool() {
                    Some(true) => Verdict::Allowed,
                    Some(false) => Verdict::Rejected,
                    None => Verdict::Error,
                },
                Err(_) => Verdict::NoAnswer,
            }
        }
    });
    Callers::new(0, callers, op)
}

// ---------------------------------------------------------------------------------------------
// 8. Many clients: memory per bucket and expiry.

fn many_clients(a: &Args) -> Vec<Row> {
    // One token of 10 refilling at 0.1/s: the bucket is full again 10 s after its charge.
    let (capacity, refill) = (10.0, 0.1);
    let redis = Redis::start();
    let policy = format!("rules:\n  many: {{capacity: {capacity}, refill_per_sec: {refill}}}\n");
    let sidecar = Sidecar::with_policy(&redis.url(), &policy, &["--redis-timeout-ms", "2000"]);
    let url = format!("{}/v1/decide", sidecar.base_url());
    let mem0 = used_memory(&redis);
    let next = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let keys = a.keys as u64;
    let per_call = ratelimit_wire::MAX_REQUESTS as u64;
    log(&format!("8: {keys} keys"));
    let started = Instant::now();
    let deadline = started + Duration::from_secs(120);
    std::thread::scope(|s| {
        for _ in 0..4 {
            let (url, next, failed) = (&url, next.clone(), failed.clone());
            s.spawn(move || {
                let c = http();
                loop {
                    let from = next.fetch_add(per_call, Ordering::Relaxed);
                    if from >= keys || Instant::now() > deadline {
                        break;
                    }
                    let requests: Vec<Value> = (from..(from + per_call).min(keys))
                        .map(|k| json!({"decisions": [{"rule": "many", "subject": {"id": format!("client-{k}")}, "cost": 1}]}))
                        .collect();
                    let ok = c
                        .post(url)
                        .json(&json!({ "requests": requests }))
                        .send()
                        .is_ok_and(|r| r.status() == 200);
                    if !ok {
                        failed.fetch_add(requests.len() as u64, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let wrote = started.elapsed();
    let mem1 = used_memory(&redis);
    let n = dbsize(&redis);
    // MEMORY USAGE on a sample.
    let mut conn = redis.connection();
    let key = |k: u64| format!("rl:{{ratelimit|rule=many|id=client-{k}}}");
    let usage: Vec<u64> = (0..keys)
        .step_by((keys as usize / 200).max(1))
        .filter_map(|k| {
            redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(key(k))
                .query::<Option<u64>>(&mut conn)
                .ok()
                .flatten()
        })
        .collect();
    let avg_usage = usage.iter().sum::<u64>() as f64 / usage.len().max(1) as f64;
    // What the product promises is each key's expiry: the bucket is full again, plus 1 to 3 s.
    // Every key's is read (PEXPIRETIME, against the one the bucket records), not a sample.
    let expiries = expiries(&mut conn, keys, capacity, refill, &key);
    // Then every key must read as gone once the latest expiry has passed, whether or not Redis's
    // active expiry cycle has reclaimed it yet (it frees expired keys by sampling, so DBSIZE
    // lags: printed, not judged).
    let now_ms = redis_time_ms(&mut conn);
    // The wait the keys' expiry needs, not a synchronisation.
    sleep(Duration::from_millis(
        (expiries.latest_ms - now_ms).max(0.0) as u64 + 50,
    ));
    let unreclaimed = dbsize(&redis);
    let readable = readable_keys(&mut conn, keys, &key);
    let failed = failed.load(Ordering::Relaxed);
    let e = &expiries;
    vec![Row {
        scenario: "8 many clients".into(),
        load: format!(
            "{keys} distinct keys straight to the sidecar, {per_call} per call, 4 callers: {:.0} decisions/s",
            keys as f64 / wrote.as_secs_f64()
        ),
        fault: "none".into(),
        admitted: (keys - failed).to_string(),
        rejected: "0".into(),
        over: String::new(),
        client: String::new(),
        filter: String::new(),
        errors: failed.to_string(),
        recovery: String::new(),
        check: format!(
            "{n} keys; {:.0} B per bucket (used_memory Δ / keys), MEMORY USAGE {avg_usage:.0} B (sample of {}); expiry − full-again time in [{:.2}, {:.2}] s, in [1, 3] s for {}/{} {}; at the latest expiry ({:.1} s after the last write) {readable} of {keys} readable {} ({unreclaimed} not yet reclaimed by Redis's active expiry)",
            (mem1 - mem0) as f64 / n.max(1) as f64,
            usage.len(),
            e.min_margin_ms / 1000.0,
            e.max_margin_ms / 1000.0,
            e.within,
            e.read,
            mark(e.within == e.read && e.read > 0),
            (e.latest_ms - e.last_write_ms) / 1000.0,
            mark(readable == 0)
        ),
    }]
}

/// Every bucket's expiry against the time it is full again ([`many_clients`]).
struct Expiries {
    /// Keys read (their bucket and expiry).
    read: u64,
    /// Keys whose expiry (`PEXPIRETIME`, the same as the one the bucket records) is its
    /// full-again time plus 1 to 3 s.
    within: u64,
    /// The smallest and largest expiry − full-again time, ms.
    min_margin_ms: f64,
    max_margin_ms: f64,
    /// The latest expiry, and the latest write, in Redis's ms.
    latest_ms: f64,
    last_write_ms: f64,
}

/// Reads every key's bucket and `PEXPIRETIME`, 1000 keys to a pipeline.
fn expiries(
    conn: &mut redis::Connection,
    keys: u64,
    capacity: f64,
    refill: f64,
    key: &dyn Fn(u64) -> String,
) -> Expiries {
    let mut e = Expiries {
        read: 0,
        within: 0,
        min_margin_ms: f64::MAX,
        max_margin_ms: f64::MIN,
        latest_ms: 0.0,
        last_write_ms: 0.0,
    };
    for from in (0..keys).step_by(1000) {
        let mut pipe = redis::pipe();
        for k in from..(from + 1000).min(keys) {
            pipe.cmd("GET").arg(key(k)).cmd("PEXPIRETIME").arg(key(k));
        }
        let values: Vec<redis::Value> = pipe.query(conn).expect("GET and PEXPIRETIME");
        for pair in values.chunks(2) {
            let (redis::Value::BulkString(raw), redis::Value::Int(pexpiretime)) =
                (&pair[0], &pair[1])
            else {
                continue;
            };
            let Some((tokens, ts_us, exp_ms)) = unpack(raw) else {
                continue;
            };
            let pexpiretime = *pexpiretime as f64;
            e.read += 1;
            let full_at_ms = ts_us / 1000.0 + (capacity - tokens) / refill * 1000.0;
            let margin = pexpiretime - full_at_ms;
            e.min_margin_ms = e.min_margin_ms.min(margin);
            e.max_margin_ms = e.max_margin_ms.max(margin);
            e.latest_ms = e.latest_ms.max(pexpiretime);
            e.last_write_ms = e.last_write_ms.max(ts_us / 1000.0);
            if (999.0..=3001.0).contains(&margin) && (pexpiretime - exp_ms).abs() < 1.0 {
                e.within += 1;
            }
        }
    }
    e
}

/// Keys that a read still finds (`EXISTS`; an expired key reads as missing, and the read
/// frees it).
fn readable_keys(conn: &mut redis::Connection, keys: u64, key: &dyn Fn(u64) -> String) -> u64 {
    (0..keys)
        .step_by(1000)
        .map(|from| {
            let mut pipe = redis::pipe();
            for k in from..(from + 1000).min(keys) {
                pipe.cmd("EXISTS").arg(key(k));
            }
            let found: Vec<u64> = pipe.query(conn).expect("EXISTS");
            found.iter().sum::<u64>()
        })
        .sum()
}

/// Redis's clock (`TIME`), in ms.
fn redis_time_ms(conn: &mut redis::Connection) -> f64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(conn).expect("TIME");
    secs as f64 * 1000.0 + micros as f64 / 1000.0
}

// ---------------------------------------------------------------------------------------------
// 9. A region's Redis restored from a snapshot taken before the rebalancer moved its share.

fn snapshot_restore(_: &Args) -> Vec<Row> {
    use ratelimit_e2e::snapshot_restore::{self as sr, ASKED, CAPACITY, FLOOR};
    log("9: two regions, a rebalance, us's Redis restored from an older snapshot");
    let run = sr::run();
    let (b, r) = (run.after_restore, run.after_repair);
    let us_bound = CAPACITY * FLOOR + sr::REFILL * (b.seconds + sr::FENCE_MARGIN_S);
    vec![Row {
        scenario: "9 snapshot restore (regions)".into(),
        load: format!(
            "C = {CAPACITY}, R = {}/s, shares 0.5/0.5 moved to {:.1} (eu) / {:.1} (us); a fresh key asked {ASKED} times in each region at once",
            sr::REFILL, run.moved.0, run.moved.1
        ),
        fault: "us's Redis restarted from an RDB taken before the move (its record back at v1, 0.5)".into(),
        admitted: format!(
            "eu {} + us {} = {} in {:.2} s; after the repair eu {} + us {} = {}",
            b.eu, b.us, b.total(), b.seconds, r.eu, r.us, r.total()
        ),
        rejected: format!("{}; after the repair {}", 2 * ASKED - b.total(), 2 * ASKED - r.total()),
        over: format!(
            "{:.0} (≤ C + R·(T + fence margin) = {:.1})",
            (b.total() as f64 - b.bound()).max(0.0),
            b.bound()
        ),
        client: String::new(),
        filter: String::new(),
        errors: "none".into(),
        recovery: format!(
            "us at the floor ({FLOOR}) until the rebalancer's repair was read, {:.1} s after the restore (the run waits a fill time, 11 s, before its burst, then runs one `--once` round)",
            run.repaired_after.as_secs_f64()
        ),
        check: format!(
            "{} ≤ {:.1} {}; us {} ≤ C·floor + R·(T + margin) = {us_bound:.1} {}; after the repair {} ≤ {:.1} {}",
            b.total(),
            b.bound(),
            mark(b.total() as f64 <= b.bound()),
            b.us,
            mark(b.us as f64 <= us_bound),
            r.total(),
            r.bound(),
            mark(r.total() as f64 <= r.bound())
        ),
    }]
}

// ---------------------------------------------------------------------------------------------
// 11, 12. Redis restarted without its data, or from an older snapshot, under each --store-reset.

fn store_lost(_: &Args) -> Vec<Row> {
    store_loss_rows(11, Loss::Empty)
}

fn snapshot_lost(_: &Args) -> Vec<Row> {
    store_loss_rows(12, Loss::Snapshot)
}

fn store_loss_rows(n: u32, loss: Loss) -> Vec<Row> {
    let (c, r) = (100.0, 100.0);
    let policy = "rules:\n  r: {capacity: 100, refill_per_sec: 100}\n";
    let (name, fault) = match loss {
        Loss::Empty => ("store lost its state", "Redis restarted without its data"),
        Loss::Snapshot => (
            "Redis restarted from an older snapshot",
            "Redis restarted from an RDB saved before the client spent (its epoch marker with it)",
        ),
    };
    ["full", "empty"]
        .into_iter()
        .map(|reset| {
            log(&format!("{n}: {name}, --store-reset {reset}"));
            let run = store_loss::spend_across(
                loss,
                policy,
                reset,
                Duration::from_millis(1100),
                Duration::from_millis(500),
            );
            let bound = c + r * run.seconds;
            let over = (run.admitted as f64 - bound).max(0.0);
            // `empty`: nothing over C + r·T; `full`: the lost state's capacity again, at most.
            let (held, allowance) = match reset {
                "empty" => (run.admitted as f64 <= bound + 1.0, "0"),
                _ => (over <= c + 1.0, "C"),
            };
            Row {
                scenario: format!("{n} {name}, --store-reset {reset}"),
                load: "1 client (C = 100, r = 100/s), 150 decisions straight to the sidecar, then 0.5 s more".into(),
                fault: fault.into(),
                admitted: format!("{} in {:.2} s", run.admitted, run.seconds),
                rejected: String::new(),
                over: format!("{over:.0} (C + r·T = {bound:.0}; bound {allowance})"),
                client: String::new(),
                filter: String::new(),
                errors: format!("{} unanswered while Redis came back", run.unanswered),
                recovery: String::new(),
                check: format!(
                    "admitted {} ≤ C + r·T{} = {:.0} {}; {} reset counted {}",
                    run.admitted,
                    if reset == "empty" { "" } else { " + C" },
                    if reset == "empty" { bound } else { bound + c },
                    mark(held),
                    run.resets,
                    mark(run.resets >= 1.0)
                ),
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// 13. Concurrency slots lost with the store, through Envoy.

fn slots_lost(_: &Args) -> Vec<Row> {
    use store_loss::{CONCURRENCY, SLOT_TTL_MS};
    ["empty", "full"]
        .into_iter()
        .map(|reset| {
            log(&format!("13: slots lost with the store, --store-reset {reset}"));
            let run = store_loss::slots_across_a_flush(reset);
            // `empty`: never more than `concurrency` in flight, nothing admitted while the two
            // running requests hold their slots; `full`: up to `concurrency` more, documented.
            let (bound, check) = match reset {
                "empty" => (
                    CONCURRENCY,
                    format!(
                        "in flight {} ≤ {CONCURRENCY} {}; admitted past the limit {} {}",
                        run.max_in_flight,
                        mark(run.max_in_flight <= CONCURRENCY),
                        run.admitted,
                        mark(run.admitted == 0)
                    ),
                ),
                _ => (
                    2 * CONCURRENCY,
                    format!(
                        "in flight {} ≤ 2 × {CONCURRENCY} {}",
                        run.max_in_flight,
                        mark(run.max_in_flight <= 2 * CONCURRENCY)
                    ),
                ),
            };
            Row {
                scenario: format!("13 slots lost with the store, --store-reset {reset}"),
                load: format!(
                    "1 Envoy ×1 worker, `concurrency: {CONCURRENCY}`, `slot_ttl_ms: {SLOT_TTL_MS}`; 2 requests held 5 s, then 4 clients sending short requests for 3 s"
                ),
                fault: "FLUSHALL while the 2 requests hold every slot".into(),
                admitted: format!("{} short requests", run.admitted),
                rejected: run.rejected.to_string(),
                over: format!(
                    "{} in flight at most (bound {bound})",
                    run.max_in_flight
                ),
                client: String::new(),
                filter: String::new(),
                errors: "0".into(),
                recovery: format!("{} of {CONCURRENCY} held requests ran to their end", run.held_to_the_end),
                check: format!(
                    "{check}; {} reset counted {}",
                    run.resets,
                    mark(run.resets >= 1.0)
                ),
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// 14. A Cluster's epochs under --store-reset empty: one per primary.

fn cluster_epochs(_: &Args) -> Vec<Row> {
    use store_loss::PER_PRIMARY;
    log("14: Cluster epochs");
    let run = store_loss::cluster_epochs();
    let lost = run.after_flush.first().copied().unwrap_or_default();
    let kept: usize = run.after_flush.iter().skip(1).sum();
    let others = PER_PRIMARY * run.after_flush.len().saturating_sub(1);
    vec![Row {
        scenario: "14 Cluster epochs, --store-reset empty".into(),
        load: format!(
            "3 primaries, 1 sidecar (C = 2, r = 2/s); {} new clients' first requests, 10 to a call; then {PER_PRIMARY} new clients per primary in one call",
            run.new_clients
        ),
        fault: "primary 0 flushed (FLUSHALL)".into(),
        admitted: format!(
            "{} of {} new clients; after the flush {lost} of primary 0's {PER_PRIMARY}, {kept} of the others' {others}",
            run.new_admitted, run.new_clients
        ),
        rejected: String::new(),
        over: "0 (primary 0's clients start empty at its new epoch)".into(),
        client: String::new(),
        filter: String::new(),
        errors: "0".into(),
        recovery: String::new(),
        check: format!(
            "new clients admitted {}/{} {}; marker keys {} (a marker and its stamp per primary: 6) {}; a returning client behind a new one admitted {}; the flush costs only primary 0's clients: {lost} + {kept} {}; {} reset counted {}",
            run.new_admitted,
            run.new_clients,
            mark(run.new_admitted == run.new_clients),
            run.markers.len(),
            mark(run.markers.len() == 6),
            mark(run.returning == (true, true)),
            mark(lost == 0 && kept == others),
            run.resets,
            mark(run.resets >= 1.0)
        ),
    }]
}

// ---------------------------------------------------------------------------------------------
// 10. A policy reload under leases.

fn policy_reload(a: &Args) -> Vec<Row> {
    use ratelimit_e2e::reload::{Stack, BOUND, OPEN};
    let window = Duration::from_secs(a.seconds).min(Duration::from_secs(1));
    // The filter's defaults: the epoch polled every 50 ms, 5 ticks per poll.
    let (poll_ms, tick_ms) = (50, 10);
    let mut stack = Stack::start(json!({}));
    let steps = [
        (
            "lowered to capacity 10, refill 1/s",
            "{capacity: 10, refill_per_sec: 1}",
        ),
        ("blocked (`blocked: true`)", "{blocked: true}"),
    ];
    let mut rows = Vec::new();
    for (i, (name, spec)) in steps.into_iter().enumerate() {
        if i > 0 {
            stack.reload(OPEN, window);
            stack.wait_for_leases();
        }
        log(&format!("10: {name}"));
        let s = stack.reload(spec, window);
        let stale = s.stale_lease_admissions();
        let ms_of = |d: Option<Duration>| d.map_or("none".to_string(), ms);
        rows.push(Row {
            scenario: format!("10 policy reload, {name}"),
            load: "2 hot clients (2 connections each) holding leases, 1 Envoy ×2 workers, 1 sidecar, 1 Redis; 20000 + 20000/s before".into(),
            fault: format!(
                "policy rewritten, SIGHUP; t0 = the sidecar's /v1/epoch shows it ({} after SIGHUP)",
                ms(s.seen_after)
            ),
            admitted: format!(
                "{} after t0 ({} from leases; {} of the new policy's leases granted)",
                s.admitted, s.lease_admitted, s.granted
            ),
            rejected: format!("{} sent after t0 + 100 ms", s.late_rejected),
            over: format!("{stale} from old leases after t0 + 100 ms"),
            client: String::new(),
            filter: filter_cell(&[&stack.envoy]),
            errors: "0".into(),
            recovery: format!(
                "last admission sent {} after t0; last lease admission counted by {}",
                ms_of(s.last_admission),
                ms_of(s.last_lease_admission)
            ),
            check: {
                let blocked = spec.contains("blocked");
                let mut c = format!(
                    "old leases after t0 + {} ms: {stale} {}",
                    BOUND.as_millis(),
                    mark(stale == 0)
                );
                if blocked {
                    c += &format!(
                        "; admitted after it: {}, stale Retry-After: {} {}",
                        s.late_admitted,
                        s.late_retry_after,
                        mark(s.late_admitted == 0 && s.late_retry_after == 0)
                    );
                }
                c + &format!("; bound poll + 2·tick + RTT = {} ms + RTT", poll_ms + 2 * tick_ms)
            },
        });
    }
    stack.stop();
    rows.push(policy_reload_two_sidecars(window, poll_ms + 2 * tick_ms));
    rows
}

/// Scenario 10 with two sidecars behind the Envoy, reloaded `GAP` apart: the bound from the
/// second one's t0.
fn policy_reload_two_sidecars(window: Duration, bound_ms: u64) -> Row {
    use ratelimit_e2e::reload::{Stack, BOUND};
    const GAP: Duration = Duration::from_millis(500);
    log("10: two sidecars reloading 500 ms apart");
    let mut stack = Stack::start_with(json!({}), 2);
    let s = stack.reload_one_then_the_other("{capacity: 10, refill_per_sec: 1}", GAP, window);
    stack.stop();
    let (a, stale) = (&s.after, s.after.stale_lease_admissions());
    let ms_of = |d: Option<Duration>| d.map_or("none".to_string(), ms);
    Row {
        scenario: "10 policy reload, two sidecars reloading 500 ms apart, lowered to capacity 10, refill 1/s".into(),
        load: "as above, the Envoy's sidecar cluster with 2 endpoints (2 sidecars on 1 Redis, a policy file each)".into(),
        fault: format!(
            "one sidecar's policy rewritten and SIGHUP, the other's {} later; t0 = the second's /v1/epoch shows it",
            ms(s.gap)
        ),
        admitted: format!(
            "between the reloads {} from leases (after the first t0 + {} ms); {} after t0 ({} from leases; {} of the new policy's leases granted)",
            s.gap_lease_admitted,
            BOUND.as_millis(),
            a.admitted,
            a.lease_admitted,
            a.granted
        ),
        rejected: format!("{} sent after t0 + 100 ms", a.late_rejected),
        over: format!("{stale} from old leases after t0 + 100 ms"),
        client: String::new(),
        filter: String::new(),
        errors: "0".into(),
        recovery: format!(
            "callouts {:.0}/s between the reloads ({:.0}/s before); last lease admission (the new policy's included) counted by {} after t0",
            s.gap_callouts_per_sec,
            s.before_callouts_per_sec,
            ms_of(a.last_lease_admission)
        ),
        check: format!(
            "old leases after t0 + {} ms: {stale} {}; the sidecars' epochs agree {}; bound: the last sidecar's reload + poll + 2·tick + RTT = {bound_ms} ms + RTT",
            BOUND.as_millis(),
            mark(stale == 0),
            mark(s.epochs.0 == s.epochs.1)
        ),
    }
}

type Scenario = fn(&Args) -> Vec<Row>;

const SCENARIOS: [(u32, &str, Scenario); 14] = [
    (1, "shared budget", shared_budget),
    (2, "hot key", hot_key),
    (3, "Redis slow and down", redis_outage),
    (4, "failover", failover),
    (5, "uncertain results", uncertain),
    (6, "sidecar restart", sidecar_restart),
    (7, "flood", flood),
    (8, "many clients", many_clients),
    (9, "snapshot restore", snapshot_restore),
    (10, "policy reload under leases", policy_reload),
    (11, "store lost its state", store_lost),
    (12, "Redis restarted from an older snapshot", snapshot_lost),
    (13, "slots lost with the store", slots_lost),
    (14, "Cluster epochs", cluster_epochs),
];

fn main() {
    let args = Args::parse();
    let started = Instant::now();
    let rows: Vec<Row> = SCENARIOS
        .into_iter()
        .filter(|(n, ..)| args.scenario.is_empty() || args.scenario.contains(n))
        .flat_map(|(n, name, run)| run_scenario(&args, n, name, run))
        .collect();
    let out = table(&rows);
    println!("{out}");
    println!(
        "({} scenarios in {:.0} s; ✓ a bound held, ✗ it did not)",
        rows.len(),
        started.elapsed().as_secs_f64()
    );
    if let Some(path) = &args.out {
        std::fs::write(path, &out).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
    if rows.iter().any(|r| r.check.contains('✗')) {
        std::process::exit(1);
    }
}

/// Scenario `n`'s rows; a scenario that fails becomes a row saying so (its processes were
/// stopped as it unwound).
fn run_scenario(args: &Args, n: u32, name: &str, run: Scenario) -> Vec<Row> {
    let t = Instant::now();
    log(&format!("scenario {n}: {name}"));
    let rows = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(args))) {
        Ok(rows) => rows,
        Err(e) => {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            let msg = msg.lines().next().unwrap_or_default().to_string();
            vec![Row {
                scenario: format!("{n} {name}"),
                check: format!("✗ FAILED: {msg}"),
                ..Row::default()
            }]
        }
    };
    log(&format!(
        "scenario {n} took {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    rows
}
