//! `make bench`: what one rate-limit decision costs, measured against baselines in the same run.
//!
//! Every stage runs the same closed loop (N concurrent callers for a fixed time) against real
//! processes on this machine, and reports throughput, latency and the CPU each process spent per
//! operation (from /proc, so the figure is a cost, independent of how many cores the machine has).
//!
//! Components: Redis's own ceiling (`INCR`), the bucket script with one decision per call and
//! with a batch per call, the sidecar's `POST /v1/decide` with one request per call and with a
//! batch. Then Envoy (1 and 2 workers) in front of an upstream, for three workloads:
//! - many distinct keys (10,000 clients told apart by address, each mostly admitted);
//! - a hot key (one client, mostly admitted);
//! - a flood (one client far over an exhausted limit: every request rejected);
//!
//! through: no filter (the baseline), a wasm filter that does nothing (the floor of any
//! proxy-wasm path), Envoy's `local_ratelimit` (no shared budget), the wasm filter calling the
//! sidecar once per request (every fast path off), the wasm filter as shipped (coalesced
//! callouts, known rejections, leases), and Envoy's native `ratelimit` filter calling the sidecar
//! over gRPC. The Envoy stages run in `--rounds` rounds (3 by default), the stages taking turns,
//! and the goals are judged on each stage's medians: one stage on a shared machine moves by 10%
//! or more from one run to the next.
//!
//! All figures are printed, then the issue's goals as ratios from this run; none is asserted. On a
//! 2-core machine the load generator, Redis, the sidecar and Envoy share the cores: read the ratios
//! and the CPU per operation, not the absolute throughput.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use ratelimit_e2e::procstat::cpu_seconds;
use ratelimit_e2e::{Envoy, EnvoyConfig, Redis, Sidecar, Upstream};

#[derive(Parser, Clone)]
#[command(about = "Measures the cost of a rate-limit decision against baselines in the same run")]
struct Args {
    /// Seconds each stage runs (each round).
    #[arg(long, default_value_t = 4)]
    seconds: u64,
    /// Milliseconds of warm-up before each stage is measured.
    #[arg(long, default_value_t = 500)]
    warmup_ms: u64,
    /// Concurrent callers in each stage.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Concurrent callers of the many-keys stages run again under load (a busy gateway: more
    /// requests wait while a callout is out, so batches grow); 0 skips them.
    #[arg(long, default_value_t = 256)]
    loaded_concurrency: usize,
    /// Distinct clients of the many-keys workload.
    #[arg(long, default_value_t = 10_000)]
    keys: usize,
    /// Envoy worker counts to measure, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    workers: Vec<u32>,
    /// Decisions per call in the batched component stages.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Only the component stages (Redis, script, sidecar), no Envoy.
    #[arg(long)]
    components_only: bool,
    /// A/B two builds of the filter instead of the full run: alternates one workload's stage
    /// (`--ab-workload`, many keys by default) of the shipped configuration between the current
    /// build and this `.wasm` (plus the no-op filter), `--ab-workers` Envoy workers, `--rounds`
    /// times, and prints Envoy's CPU per request above the no-op filter for each build. Runs
    /// that differ by less than their spread are a tie.
    #[arg(long, value_name = "WASM")]
    ab_filter: Option<std::path::PathBuf>,
    /// Rounds: every Envoy stage is measured this many times, the stages taking turns, and the
    /// goals are judged on each stage's medians (a single stage on a shared machine moves by
    /// 10% or more); `--ab-filter` alternates its builds this many times.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The workload of `--ab-filter`.
    #[arg(long, value_enum, default_value = "many-keys")]
    ab_workload: Workload,
    /// Envoy workers in `--ab-filter`.
    #[arg(long, default_value_t = 1)]
    ab_workers: u32,
    /// An extra argument for the sidecar (repeatable), e.g. `--sidecar-arg=--redis-pipeline=1`
    /// to measure a setting against the default in another run.
    #[arg(long, allow_hyphen_values = true)]
    sidecar_arg: Vec<String>,
}

/// The longest one operation may take: one that hangs (a lost response) is an error, and the
/// stage still ends on time.
const OP_TIMEOUT: Duration = Duration::from_secs(10);

/// One process whose CPU time is attributed to a stage.
#[derive(Clone, Copy)]
struct Watched {
    name: &'static str,
    pid: u32,
}

/// Where Redis spent its time during a stage (since `CONFIG RESETSTAT`): script calls, requests
/// per call (with the fast paths, most requests never reach Redis), the µs per call inside `EVALSHA` and of the commands it ran, and the keys that
/// expired (a bucket full again is deleted; a quiet client's next decision creates it anew).
/// The counts include the stage's start (Envoy starting, the warm-up): "about".
fn redis_breakdown(redis: &Redis, r: &StageResult) -> String {
    let stats = redis.cli(&["info", "commandstats"]);
    let command = |name: &str| -> (f64, f64) {
        let line = stats
            .lines()
            .find(|l| l.starts_with(&format!("cmdstat_{name}:")))
            .unwrap_or("");
        let field = |f: &str| -> f64 {
            line.split(&format!("{f}="))
                .nth(1)
                .and_then(|v| v.split(',').next())
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0.0)
        };
        (field("calls"), field("usec_per_call"))
    };
    let (calls, evalsha) = command("evalsha");
    let (_, mget) = command("mget");
    let (sets, set) = command("set");
    let expired: f64 = redis
        .cli(&["info", "stats"])
        .lines()
        .find_map(|l| l.strip_prefix("expired_keys:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    if calls == 0.0 {
        return format!(
            "redis: no script call, {:.0} keys expired/s",
            expired / r.seconds
        );
    }
    format!(
        "redis: about {:.1} requests per script call, {evalsha:.1} µs inside EVALSHA per call (MGET \
         {mget:.1} µs, {:.1} SETs of {set:.2} µs), {:.0} keys expired/s",
        r.ops as f64 / calls,
        sets / calls,
        expired / r.seconds
    )
}

#[derive(Clone)]
struct StageResult {
    name: String,
    /// Operations completed (requests, calls).
    ops: u64,
    /// Decisions per operation (a batched call carries several).
    per_op: usize,
    seconds: f64,
    p50: Duration,
    p99: Duration,
    /// CPU µs per operation, by process.
    cpu_us_per_op: Vec<(&'static str, f64)>,
}

impl StageResult {
    fn per_second(&self) -> f64 {
        self.ops as f64 / self.seconds
    }
    fn cpu(&self, process: &str) -> f64 {
        self.cpu_us_per_op
            .iter()
            .find(|(n, _)| *n == process)
            .map_or(0.0, |(_, v)| *v)
    }
    /// CPU µs per decision of a process.
    fn cpu_per_decision(&self, process: &str) -> f64 {
        self.cpu(process) / self.per_op as f64
    }
    /// CPU µs per operation of every process but the load generator.
    fn stack_cpu(&self) -> f64 {
        self.cpu_us_per_op
            .iter()
            .filter(|(n, _)| *n != "load generator")
            .map(|(_, v)| v)
            .sum()
    }
}

type Op = Arc<
    dyn Fn(u64) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>>
        + Send
        + Sync,
>;

/// Runs `concurrency` copies of `op` for `seconds` and measures them.
async fn stage(name: &str, args: &Args, watched: &[Watched], per_op: usize, op: Op) -> StageResult {
    // A short warm-up so connections, caches, leases exist before measuring.
    let warm = Instant::now();
    let mut warm_errors = 0;
    while warm.elapsed() < Duration::from_millis(args.warmup_ms) {
        if let Err(e) = op(rand_u64()).await {
            warm_errors += 1;
            if warm_errors > 1000 {
                panic!("{name}: warm-up keeps failing: {e}");
            }
        }
    }
    let cpu_before: Vec<f64> = watched.iter().map(|w| cpu_seconds(w.pid)).collect();
    let self_before = cpu_seconds(std::process::id());
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..args.concurrency {
        let (op, stop) = (op.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0u64;
            let mut first_error = None;
            let mut i = worker as u64 * 7919 + 1;
            while !stop.load(Ordering::Relaxed) {
                i = i
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let t = Instant::now();
                match op(i >> 16).await {
                    Ok(()) => latencies.push(t.elapsed()),
                    Err(e) => {
                        errors += 1;
                        first_error.get_or_insert(e);
                        // A failure can come back without waiting on anything: let the
                        // runtime's timer (the stage's end) run.
                        tokio::task::yield_now().await;
                    }
                }
            }
            (latencies, errors, first_error)
        }));
    }
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    let mut errors = 0;
    let mut first_error = None;
    for t in tasks {
        let (l, e, first) = t.await.expect("stage task");
        latencies.extend(l);
        errors += e;
        first_error = first_error.or(first);
    }
    let seconds = start.elapsed().as_secs_f64();
    let ops = latencies.len() as u64;
    let first_error = first_error.unwrap_or_default();
    assert!(
        ops > 0,
        "{name}: no operation succeeded ({errors} errors, the first: {first_error})"
    );
    if errors > 0 {
        eprintln!("{name}: {errors} operations failed, the first: {first_error}");
    }
    latencies.sort();
    let pick = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    let mut cpu_us_per_op: Vec<(&'static str, f64)> = watched
        .iter()
        .zip(cpu_before)
        .map(|(w, before)| (w.name, (cpu_seconds(w.pid) - before) * 1e6 / ops as f64))
        .collect();
    cpu_us_per_op.push((
        "load generator",
        (cpu_seconds(std::process::id()) - self_before) * 1e6 / ops as f64,
    ));
    StageResult {
        name: name.to_string(),
        ops,
        per_op,
        seconds,
        p50: pick(0.50),
        p99: pick(0.99),
        cpu_us_per_op,
    }
}

fn rand_u64() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos() as u64;
    nanos.wrapping_mul(6364136223846793005)
}

fn print_header() {
    println!(
        "{:<58} {:>9} {:>9} {:>9}  {:>8}  cpu µs per op by process",
        "stage", "ops/s", "p50", "p99", "vs base"
    );
}

fn print(r: &StageResult, baseline: Option<&StageResult>) {
    let ratio = baseline
        .map(|b| format!("{:.2}x", r.per_second() / b.per_second()))
        .unwrap_or_else(|| "baseline".into());
    let cpu: Vec<String> = r
        .cpu_us_per_op
        .iter()
        .map(|(n, v)| format!("{n} {v:.1}"))
        .collect();
    println!(
        "{:<58} {:>9.0} {:>9} {:>9}  {:>8}  {}",
        r.name,
        r.per_second(),
        format!("{:.2?}", r.p50),
        format!("{:.2?}", r.p99),
        ratio,
        cpu.join(", ")
    );
}

/// What the wasm filter slot of the shipped config holds in a stage.
#[derive(Clone, Copy, PartialEq)]
enum Filter {
    None,
    Noop,
    LocalRateLimit,
    Wasm,
}

const LOCAL_RATELIMIT: &str = r#"          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: local_ratelimit
              token_bucket: { max_tokens: 1000000000, tokens_per_fill: 1000000000, fill_interval: 1s }
              filter_enabled:
                default_value: { numerator: 100, denominator: HUNDRED }
              filter_enforced:
                default_value: { numerator: 100, denominator: HUNDRED }
"#;

/// The rendered shipped config with the filter slot replaced, and the client address taken from
/// `X-Forwarded-For` (the bench tells its 10,000 clients apart by address; an edge Envoy must not,
/// see the README).
fn edit_config(yaml: &str, filter: Filter, noop_wasm: &str, wasm: &str) -> String {
    let yaml = yaml.replace("use_remote_address: true", "use_remote_address: false");
    let start = yaml
        .find("          - name: envoy.filters.http.wasm")
        .expect("the config has the wasm filter");
    let end = yaml
        .find("          - name: envoy.filters.http.router")
        .expect("the config has the router");
    let block = &yaml[start..end];
    let replacement = match filter {
        Filter::None => String::new(),
        Filter::Noop => block.replace(wasm, noop_wasm),
        Filter::LocalRateLimit => LOCAL_RATELIMIT.to_string(),
        Filter::Wasm => block.to_string(),
    };
    format!("{}{}{}", &yaml[..start], replacement, &yaml[end..])
}

/// Starts Envoy from a YAML (for the variants the harness does not model).
/// Runs one stage against a fresh Envoy started from `yaml` (its CPU watched with `watched`'s):
/// the stage's figures and the filter's callouts per decided request.
#[allow(clippy::too_many_arguments)]
async fn envoy_stage(
    name: String,
    yaml: String,
    workers: u32,
    workload: Workload,
    http: reqwest::Client,
    args: &Args,
    keys: u64,
    watched: [Watched; 2],
) -> (StageResult, f64) {
    let (child, port, admin, _dir) = off_runtime(move || envoy_from_yaml(&yaml, workers)).await;
    // Stopped however the stage ends: a stage that panics (its warm-up failing) leaves no Envoy
    // running behind the bench.
    let child = Reaped(child);
    let envoy = Watched {
        name: "envoy",
        pid: child.0.id(),
    };
    let watched = [watched[0], watched[1], envoy];
    let op = http_get_op(
        http,
        format!("http://127.0.0.1:{port}{}", workload.path()),
        workload,
        keys,
    );
    let r = stage(&name, args, &watched, 1, op).await;
    let (callouts, requests) = off_runtime(move || {
        (
            envoy_stat(admin, "ratelimit.callouts"),
            envoy_stat(admin, "ratelimit.admitted") + envoy_stat(admin, "ratelimit.rejected"),
        )
    })
    .await;
    drop(child);
    (r, callouts / requests.max(1.0))
}

/// The `edge` rule of [`POLICY`]: the hot key at its limit.
const EDGE_CAPACITY: f64 = 2000.0;
const EDGE_REFILL: f64 = 2000.0;
/// The defaults that size a lease: the sidecar's `--lease-max-share` and the filter's
/// `fast_paths.leases.max_tokens`.
const LEASE_MAX_SHARE: f64 = 0.1;
const LEASE_MAX_TOKENS: f64 = 1000.0;

/// The hot key at its limit, measured once per worker count: one client far over a finite bucket
/// (every fast path on: leases, known rejections), its bucket fresh and full at the start.
struct AtLimit {
    admitted: u64,
    rejected: u64,
    errors: u64,
    seconds: f64,
    callouts: f64,
}

impl AtLimit {
    /// What the bucket could admit at most in the stage: `C + r·T`.
    fn exact_bound(&self) -> f64 {
        EDGE_CAPACITY + EDGE_REFILL * self.seconds
    }
    /// What leases can withhold from one Envoy at most: two leases (the one in use and the
    /// next) of `L = min(max_tokens, max_share × C)` each (docs/fast-paths.md, deviation).
    fn lease_bound() -> f64 {
        2.0 * LEASE_MAX_TOKENS.min(LEASE_MAX_SHARE * EDGE_CAPACITY)
    }
    fn over(&self) -> f64 {
        (self.admitted as f64 - self.exact_bound().floor()).max(0.0)
    }
    fn under(&self) -> f64 {
        (self.exact_bound() - self.admitted as f64).max(0.0)
    }
}

/// Runs the at-its-limit stage against a fresh Envoy: `args.concurrency` callers as one client
/// (`client` names its address, so every run has a bucket of its own), no warm-up (the bucket is
/// full at the first request), `args.seconds` long. Every answer is counted: 200 admitted, 429
/// rejected, anything else an error.
async fn at_limit_stage(
    yaml: String,
    workers: u32,
    http: reqwest::Client,
    args: &Args,
    client: u32,
) -> AtLimit {
    let (child, port, admin, _dir) = off_runtime(move || envoy_from_yaml(&yaml, workers)).await;
    let child = Reaped(child);
    let url = format!("http://127.0.0.1:{port}/edge/x");
    let address = format!("10.250.{}.{}", (client >> 8) & 255, client & 255);
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..args.concurrency {
        let (http, url, address, stop) = (http.clone(), url.clone(), address.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let (mut admitted, mut rejected, mut errors) = (0u64, 0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let sent = http
                    .get(&url)
                    .header("x-forwarded-for", &address)
                    .send()
                    .await;
                match sent {
                    Ok(r) => {
                        let status = r.status().as_u16();
                        let _ = r.bytes().await;
                        match status {
                            200 => admitted += 1,
                            429 => rejected += 1,
                            _ => errors += 1,
                        }
                    }
                    Err(_) => {
                        errors += 1;
                        tokio::task::yield_now().await;
                    }
                }
            }
            (admitted, rejected, errors)
        }));
    }
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let (mut admitted, mut rejected, mut errors) = (0, 0, 0);
    for t in tasks {
        let (a, r, e) = t.await.expect("at-limit task");
        admitted += a;
        rejected += r;
        errors += e;
    }
    // Every answer counted arrived before this: the bound's time covers all of them.
    let seconds = start.elapsed().as_secs_f64();
    let callouts = off_runtime(move || {
        envoy_stat(admin, "ratelimit.callouts")
            / (envoy_stat(admin, "ratelimit.admitted") + envoy_stat(admin, "ratelimit.rejected"))
                .max(1.0)
    })
    .await;
    drop(child);
    AtLimit {
        admitted,
        rejected,
        errors,
        seconds,
        callouts,
    }
}

/// A child process, killed and reaped when dropped.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `f` (which makes blocking HTTP calls) on a blocking thread. Called on the runtime's
/// own thread, reqwest's blocking client can spin forever: its wake-up is deferred to the very
/// runtime it blocks (seen as a bench stuck at full CPU between two stages).
async fn off_runtime<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .expect("a blocking step of the bench panicked")
}

fn envoy_from_yaml(yaml: &str, workers: u32) -> (std::process::Child, u16, u16, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let (listen, admin) = (ratelimit_e2e::free_port(), ratelimit_e2e::free_port());
    let yaml = yaml
        .replace("port_value: 10000", &format!("port_value: {listen}"))
        .replace("port_value: 9901", &format!("port_value: {admin}"));
    let path = dir.path().join("envoy.yaml");
    std::fs::write(&path, yaml).expect("write config");
    let log = std::fs::File::create(dir.path().join("envoy.log")).expect("log");
    let child = std::process::Command::new(Envoy::bin())
        .arg("-c")
        .arg(&path)
        .args(["--concurrency", &workers.to_string()])
        .args(["--disable-hot-restart", "-l", "warning"])
        .current_dir(ratelimit_e2e::workspace_root())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("start envoy");
    let client = ratelimit_e2e::http();
    ratelimit_e2e::wait_until("envoy ready", ratelimit_e2e::READY_TIMEOUT, || {
        client
            .get(format!("http://127.0.0.1:{admin}/ready"))
            .send()
            .map(|r| r.status() == 200)
            .unwrap_or(false)
            && ratelimit_e2e::port_open(listen)
    });
    (child, listen, admin, dir)
}

/// Envoy stats (`/stats`) whose name contains `filter`, summed per suffix.
fn envoy_stat(admin: u16, suffix: &str) -> f64 {
    let body = ratelimit_e2e::http()
        .get(format!("http://127.0.0.1:{admin}/stats?filter=ratelimit"))
        .send()
        .and_then(|r| r.text())
        .unwrap_or_default();
    body.lines()
        .filter_map(|l| l.split_once(": "))
        .filter(|(k, _)| k.ends_with(suffix))
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .sum()
}

/// A GET through Envoy with the workload's headers; `expect` is the status that counts as done.
fn http_get_op(client: reqwest::Client, url: String, workload: Workload, keys: u64) -> Op {
    Arc::new(move |i| {
        let (client, url) = (client.clone(), url.clone());
        Box::pin(async move {
            let mut req = client.get(&url);
            if workload == Workload::ManyKeys {
                let k = i % keys;
                req = req.header(
                    "x-forwarded-for",
                    format!("10.{}.{}.{}", (k >> 16) & 255, (k >> 8) & 255, k & 255),
                );
            }
            let resp = req.send().await.map_err(|e| e.to_string())?;
            let status = resp.status().as_u16();
            resp.bytes().await.map_err(|e| e.to_string())?;
            let expected = if workload == Workload::Flood {
                429
            } else {
                200
            };
            if status == expected {
                Ok(())
            } else {
                Err(format!("status {status}"))
            }
        })
    })
}

#[derive(Clone, Copy, PartialEq, Debug, clap::ValueEnum)]
enum Workload {
    ManyKeys,
    HotKey,
    Flood,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::ManyKeys => "many keys",
            Workload::HotKey => "hot key",
            Workload::Flood => "flood",
        }
    }
    fn path(self) -> &'static str {
        match self {
            Workload::ManyKeys => "/many/x",
            Workload::HotKey => "/hot/x",
            Workload::Flood => "/flood/x",
        }
    }
}

/// The bench's policy: huge budgets for the admitted workloads, an exhausted one for the flood.
const POLICY: &str = "rules:
  many: {capacity: 999999999999, refill_per_sec: 1000000000}
  hot: {capacity: 999999999999, refill_per_sec: 1000000000}
  flood: {capacity: 1, refill_per_sec: 0.000001}
  edge: {capacity: 2000, refill_per_sec: 2000}
  mem: {capacity: 100, refill_per_sec: 1}
";

/// The plugin configuration: one rule per workload; `fast` turns every fast path on (as shipped)
/// or off (one callout per request).
fn plugin(fast: bool) -> serde_json::Value {
    let mut p = serde_json::json!({
        "domain": "ratelimit",
        "sidecar": {"cluster": "ratelimit_sidecar", "timeout_ms": 2000},
        "identity": {"ip": true},
        "rules": [
            {"name": "many", "match": {"path_prefix": "/many/"}, "subject": ["ip"], "on_error": "deny"},
            {"name": "hot", "match": {"path_prefix": "/hot/"}, "subject": [], "on_error": "deny"},
            {"name": "flood", "match": {"path_prefix": "/flood/"}, "subject": [], "on_error": "deny"},
            {"name": "edge", "match": {"path_prefix": "/edge/"}, "subject": ["ip"], "on_error": "deny"}
        ]
    });
    if !fast {
        p["fast_paths"] = serde_json::json!({
            "coalesce": false, "known_rejections": false, "leases": {"enabled": false}
        });
    }
    p
}

/// The shipped `envoy-native-ratelimit.yaml` (Envoy's native rate limit filter calling the
/// sidecar over gRPC), rendered with one route per workload whose descriptors name the bench's
/// rules, the same generous timeout as the wasm stages, and addresses from `X-Forwarded-For`.
fn native_config(sidecar_port: u16, upstream_port: u16) -> String {
    let yaml = EnvoyConfig::shipped("envoy-native-ratelimit.yaml", sidecar_port, upstream_port)
        .render(10000, 9901, "")
        .replace("use_remote_address: true", "use_remote_address: false")
        .replace("timeout: 0.05s", "timeout: 2s");
    let start = yaml
        .find("              routes:\n")
        .expect("the native config has routes");
    let end = yaml
        .find("          http_filters:")
        .expect("the native config has http filters");
    let route = |prefix: &str, actions: &str| {
        format!(
            "              - match: {{ prefix: \"{prefix}\" }}\n                route:\n                  cluster: demo_upstream\n                  rate_limits:\n                  - actions:\n{actions}"
        )
    };
    let generic = |rule: &str| {
        format!("                    - generic_key: {{ descriptor_key: rule, descriptor_value: {rule} }}\n")
    };
    let ip = "                    - extension:\n                        name: ip\n                        typed_config:\n                          \"@type\": type.googleapis.com/envoy.extensions.matching.common_inputs.network.v3.SourceIPInput\n";
    let routes = format!(
        "              routes:\n{}{}{}",
        route("/many/", &format!("{}{ip}", generic("many"))),
        route("/hot/", &generic("hot")),
        route("/flood/", &generic("flood")),
    );
    format!("{}{}{}", &yaml[..start], routes, &yaml[end..])
}

/// Envoy stage results of one worker count.
struct EnvoyRun {
    workers: u32,
    baseline: StageResult,
    noop: StageResult,
    local: StageResult,
    /// (workload, per-request callout, fast paths, callouts per request with fast paths)
    wasm: Vec<(Workload, StageResult, StageResult, f64)>,
    /// (workload, Envoy's native filter over gRPC)
    native: Vec<(Workload, StageResult)>,
    /// The many-keys stages under load.
    loaded: Option<Loaded>,
}

/// The many-keys stages again with `--loaded-concurrency` callers.
struct Loaded {
    concurrency: usize,
    baseline: StageResult,
    noop: StageResult,
    slow: StageResult,
    fast: StageResult,
    callouts: f64,
}

/// The median of `values` (the mean of the middle two for an even count).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// One stage measured in several rounds, as one: the median of each figure (throughput,
/// latencies, each process's CPU) over the rounds.
fn median_stage(rounds: &[&StageResult]) -> StageResult {
    let first = rounds[0];
    let of = |f: &dyn Fn(&StageResult) -> f64| median(rounds.iter().map(|r| f(r)).collect());
    let duration =
        |f: &dyn Fn(&StageResult) -> Duration| Duration::from_secs_f64(of(&|r| f(r).as_secs_f64()));
    StageResult {
        name: first.name.clone(),
        ops: of(&|r| r.per_second()).round() as u64,
        per_op: first.per_op,
        seconds: 1.0,
        p50: duration(&|r| r.p50),
        p99: duration(&|r| r.p99),
        cpu_us_per_op: first
            .cpu_us_per_op
            .iter()
            .map(|(name, _)| (*name, of(&|r| r.cpu(name))))
            .collect(),
    }
}

impl EnvoyRun {
    /// The rounds of one worker count as one run: every stage's medians.
    fn median(rounds: &[EnvoyRun]) -> EnvoyRun {
        let stage = |f: &dyn Fn(&EnvoyRun) -> &StageResult| {
            median_stage(&rounds.iter().map(f).collect::<Vec<_>>())
        };
        let first = &rounds[0];
        let wasm = (0..first.wasm.len())
            .map(|i| {
                (
                    first.wasm[i].0,
                    stage(&|r| &r.wasm[i].1),
                    stage(&|r| &r.wasm[i].2),
                    median(rounds.iter().map(|r| r.wasm[i].3).collect()),
                )
            })
            .collect();
        let native = (0..first.native.len())
            .map(|i| (first.native[i].0, stage(&|r| &r.native[i].1)))
            .collect();
        let loaded = rounds
            .iter()
            .map(|r| r.loaded.as_ref())
            .collect::<Option<Vec<&Loaded>>>()
            .map(|l| {
                let stage = |f: &dyn Fn(&Loaded) -> &StageResult| {
                    median_stage(&l.iter().map(|x| f(x)).collect::<Vec<_>>())
                };
                Loaded {
                    concurrency: l[0].concurrency,
                    baseline: stage(&|x| &x.baseline),
                    noop: stage(&|x| &x.noop),
                    slow: stage(&|x| &x.slow),
                    fast: stage(&|x| &x.fast),
                    callouts: median(l.iter().map(|x| x.callouts).collect()),
                }
            });
        EnvoyRun {
            workers: first.workers,
            baseline: stage(&|r| &r.baseline),
            noop: stage(&|r| &r.noop),
            local: stage(&|r| &r.local),
            wasm,
            native,
            loaded,
        }
    }

    /// The run's table, every stage against its baseline.
    fn print(&self) {
        print_header();
        print(&self.baseline, None);
        print(&self.noop, Some(&self.baseline));
        print(&self.local, Some(&self.baseline));
        for (_, slow, fast, callouts) in &self.wasm {
            print(slow, Some(&self.baseline));
            print(fast, Some(&self.baseline));
            println!("{:<58} callouts per request: {callouts:.3}", "");
        }
        for (_, r) in &self.native {
            print(r, Some(&self.baseline));
        }
        if let Some(l) = &self.loaded {
            print(&l.baseline, None);
            print(&l.noop, Some(&l.baseline));
            print(&l.slow, Some(&l.baseline));
            print(&l.fast, Some(&l.baseline));
            println!("{:<58} callouts per request: {:.3}", "", l.callouts);
        }
    }
}

/// One of the issue's goals, judged on one run (the medians, or a single round).
struct Judged {
    key: String,
    /// What is measured, for the round-by-round lines.
    label: &'static str,
    /// The goal, as printed: `>= 0.85`.
    want: &'static str,
    shown: String,
    ok: bool,
}

/// Every goal with a verdict, judged on `run`. `script_redis` is Redis's CPU per decision for
/// the script with one decision per call (the component stage).
fn judge(run: &EnvoyRun, script_redis: f64) -> Vec<Judged> {
    let mut out = Vec::new();
    let mut add = |key: &str, label, want, shown: String, ok| {
        out.push(Judged {
            key: key.to_string(),
            label,
            want,
            shown,
            ok,
        })
    };
    let find = |wl: Workload| run.wasm.iter().find(|(x, ..)| *x == wl).expect("workload");
    let (_, _, hot, _) = find(Workload::HotKey);
    let (_, _, flood, _) = find(Workload::Flood);
    let (_, many_slow, many, _) = find(Workload::ManyKeys);
    let r = hot.per_second() / run.noop.per_second();
    add(
        "hot",
        "hot key vs the no-op filter",
        ">= 0.85",
        format!("{r:.2}x"),
        r >= 0.85,
    );
    let r = flood.per_second() / run.noop.per_second();
    add(
        "flood",
        "flood vs the no-op filter",
        ">= 0.85",
        format!("{r:.2}x"),
        r >= 0.85,
    );
    // The many-keys goals, at the light load and again under load.
    let mut many_keys = |prefix: &str, base: &StageResult, noop: &StageResult, slow, fast| {
        let (slow, fast): (&StageResult, &StageResult) = (slow, fast);
        let loaded = !prefix.is_empty();
        let r = fast.per_second() / base.per_second();
        let label = if loaded {
            "loaded: many keys vs Envoy alone"
        } else {
            "many keys vs Envoy alone"
        };
        add(
            &format!("{prefix}many"),
            label,
            ">= 0.5",
            format!("{r:.2}x"),
            r >= 0.5,
        );
        let added = (fast.cpu("envoy") - noop.cpu("envoy"))
            / (slow.cpu("envoy") - noop.cpu("envoy")).max(1e-9);
        let label = if loaded {
            "loaded: Envoy's added CPU"
        } else {
            "Envoy's added CPU"
        };
        add(
            &format!("{prefix}envoy"),
            label,
            "<= 0.25",
            format!("{added:.2}"),
            added <= 0.25,
        );
        let redis = fast.cpu_per_decision("redis") / script_redis.max(1e-9);
        let label = if loaded {
            "loaded: Redis vs the 1-decision script"
        } else {
            "Redis vs the 1-decision script"
        };
        add(
            &format!("{prefix}redis"),
            label,
            "<= 1/3",
            format!("{redis:.2}"),
            redis <= 1.0 / 3.0,
        );
        let sidecar = fast.cpu_per_decision("sidecar");
        let label = if loaded {
            "loaded: sidecar µs per decision"
        } else {
            "sidecar µs per decision"
        };
        add(
            &format!("{prefix}sidecar"),
            label,
            "<= 10",
            format!("{sidecar:.1}"),
            sidecar <= 10.0,
        );
    };
    many_keys("", &run.baseline, &run.noop, many_slow, many);
    if let Some(l) = &run.loaded {
        many_keys("loaded ", &l.baseline, &l.noop, &l.slow, &l.fast);
    }
    for (wl, native) in &run.native {
        if *wl == Workload::ManyKeys {
            continue;
        }
        let (_, _, fast, _) = find(*wl);
        let t = fast.per_second() / native.per_second();
        let c = fast.stack_cpu() / native.stack_cpu().max(1e-9);
        let label = match wl {
            Workload::HotKey => "hot key vs the native filter",
            _ => "flood vs the native filter",
        };
        out.push(Judged {
            key: format!("native {}", wl.name()),
            label,
            want: ">= 1.3x and <= 0.7x",
            shown: format!("{t:.2}x/{c:.2}x"),
            ok: t >= 1.3 && c <= 0.7,
        });
    }
    out
}

/// Each goal judged on every round on its own (the stages of one round ran back to back, so
/// their ratio shares the machine's state): how often it was met, beside the medians' verdict.
fn print_rounds(workers: u32, medians: &[Judged], rounds: &[EnvoyRun], script_redis: f64) {
    let judged: Vec<Vec<Judged>> = rounds.iter().map(|r| judge(r, script_redis)).collect();
    println!("[{workers} worker(s)] each goal round by round (the medians' verdict in brackets):");
    for m in medians {
        let of_rounds: Vec<&Judged> = judged
            .iter()
            .filter_map(|js| js.iter().find(|j| j.key == m.key))
            .collect();
        let shown: Vec<&str> = of_rounds.iter().map(|j| j.shown.as_str()).collect();
        let met = of_rounds.iter().filter(|j| j.ok).count();
        println!(
            "    {:<40} goal {:<20} {}: met in {met} of {} ({})",
            m.label,
            m.want,
            shown.join(", "),
            of_rounds.len(),
            if m.ok { "met" } else { "NOT met" }
        );
    }
}

fn main() {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let wasm_path = Envoy::wasm();
    let noop_wasm = ratelimit_e2e::workspace_root()
        .join("target/wasm32-wasip1/release/ratelimit_noop_filter.wasm");
    assert!(
        noop_wasm.exists(),
        "build the no-op filter first (make bench does)"
    );
    let wasm_size = std::fs::metadata(&wasm_path).map(|m| m.len()).unwrap_or(0);
    println!(
        "ratelimit bench: {} s per stage, {} round(s) of the Envoy stages, {} concurrent callers, {} keys, {cores} cores ({cpu_model}) shared by every process",
        args.seconds, args.rounds.max(1), args.concurrency, args.keys
    );
    println!(
        "filter module: {} ({} KiB)",
        wasm_path.display(),
        wasm_size / 1024
    );

    let redis = Redis::start_with(&["--maxmemory-policy", "noeviction"]);
    let mut sidecar_args = vec!["--redis-timeout-ms", "1000"];
    sidecar_args.extend(args.sidecar_arg.iter().map(String::as_str));
    let sidecar = Sidecar::with_policy(&redis.url(), POLICY, &sidecar_args);
    let upstream = Upstream::start();
    let redis_w = Watched {
        name: "redis",
        pid: redis.process.pid(),
    };
    let sidecar_w = Watched {
        name: "sidecar",
        pid: sidecar.process.pid(),
    };
    let keys = args.keys as u64;

    rt.block_on(async {
        let client = redis::Client::open(redis.url()).expect("redis url");
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect redis");

        if let Some(other) = &args.ab_filter {
            let http = reqwest::Client::builder()
                .pool_max_idle_per_host(args.concurrency.max(args.loaded_concurrency))
                .timeout(OP_TIMEOUT)
                .build()
                .expect("client");
            let current = wasm_path.display().to_string();
            let other = other.display().to_string();
            let noop = noop_wasm.display().to_string();
            let watched = [redis_w, sidecar_w];
            let yaml = |wasm: &str, filter: Filter| {
                let y = EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port)
                    .plugin(&plugin(true).to_string())
                    .concurrency(args.ab_workers)
                    .render(10000, 9901, wasm);
                edit_config(&y, filter, &noop, wasm)
            };
            let (workload, workers) = (args.ab_workload, args.ab_workers);
            println!(
                "\n== A/B: {}, filter as shipped, {workers} worker(s): A = {current}, B = {other}",
                workload.name()
            );
            print_header();
            // Per build: Envoy CPU above the no-op filter, sidecar and Redis CPU per request,
            // throughput relative to the no-op filter. The builds take turns going first (a
            // stage right after the no-op one finds every bucket expired in Redis).
            let mut figures: [Vec<[f64; 5]>; 2] = [Vec::new(), Vec::new()];
            for round in 0..args.rounds.max(1) {
                let run = |name: String, y: String, workload: Workload| {
                    let http = http.clone();
                    let (a, w) = (&args, watched);
                    async move { envoy_stage(name, y, workers, workload, http, a, keys, w).await }
                };
                // The floor admits everything: for a flood it is measured as the full run does,
                // with the hot key's requests (one key, answered 200).
                let floor_workload = match workload {
                    Workload::Flood => Workload::HotKey,
                    w => w,
                };
                let (floor, _) = run(
                    format!("round {round}: no-op filter"),
                    yaml(&current, Filter::Noop),
                    floor_workload,
                )
                .await;
                print(&floor, None);
                let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
                for i in order {
                    let (label, wasm) = [("A", &current), ("B", &other)][i];
                    let (r, callouts) = run(
                        format!("round {round}: {label}"),
                        yaml(wasm, Filter::Wasm),
                        workload,
                    )
                    .await;
                    print(&r, Some(&floor));
                    println!("  {callouts:.4} callouts/request");
                    figures[i].push([
                        r.cpu("envoy") - floor.cpu("envoy"),
                        r.cpu("sidecar"),
                        r.cpu("redis"),
                        r.per_second() / floor.per_second(),
                        callouts,
                    ]);
                }
            }
            let median_of = |v: &[[f64; 5]], k: usize| median(v.iter().map(|f| f[k]).collect());
            for (label, f) in ["A", "B"].iter().zip(&figures) {
                println!(
                    "{label}: medians of {} rounds: Envoy CPU above the no-op filter {:.1} µs/request (rounds: {}), sidecar {:.1} µs, Redis {:.1} µs per request, {:.2}x the no-op filter's throughput, {:.4} callouts/request",
                    f.len(),
                    median_of(f, 0),
                    f.iter().map(|x| format!("{:.1}", x[0])).collect::<Vec<_>>().join(", "),
                    median_of(f, 1),
                    median_of(f, 2),
                    median_of(f, 3),
                    median_of(f, 4),
                );
            }
            return;
        }
        println!("\n== components");
        print_header();
        let incr = {
            let conn = conn.clone();
            let op: Op = Arc::new(move |i| {
                let mut conn = conn.clone();
                Box::pin(async move {
                    redis::cmd("INCR")
                        .arg(format!("bench:incr:{}", i % keys))
                        .query_async::<i64>(&mut conn)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                })
            });
            stage("redis INCR, pipelined (Redis's ceiling)", &args, &[redis_w], 1, op).await
        };
        print(&incr, None);

        let script = ratelimit_sidecar_script();
        let sha = sha1_smol::Sha1::from(script).digest().to_string();
        let _: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(script)
            .query_async(&mut conn.clone())
            .await
            .expect("SCRIPT LOAD");
        let script_stage = |n: usize| {
            let (conn, sha) = (conn.clone(), sha.clone());
            let op: Op = Arc::new(move |i| {
                let (mut conn, sha) = (conn.clone(), sha.clone());
                Box::pin(async move {
                    let bucket = |j: u64| format!("rl:{{bench|k={}}}", (i + j * 7919) % keys);
                    let mut c = redis::cmd("EVALSHA");
                    c.arg(&sha).arg(1).arg(bucket(0));
                    // As lua/bucket.lua's header lays out ARGV: mode, record ttl, lease
                    // share, cluster 0, share margin; the buckets; one limit with no regional
                    // share; one group without a record of n one-decision requests; no returns.
                    c.arg("apply").arg(10_000).arg(0.1).arg(0).arg(1000).arg(n);
                    for j in 0..n as u64 {
                        c.arg(bucket(j));
                    }
                    c.arg(1).arg(999_999_999_999u64).arg(1_000_000_000u64).arg(0);
                    c.arg(1).arg("").arg(n);
                    for j in 0..n {
                        c.arg(1).arg(j + 1).arg(1).arg(1).arg(0).arg(0).arg(0).arg(0);
                    }
                    c.arg(0);
                    c.query_async::<redis::Value>(&mut conn)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                })
            });
            op
        };
        let script_one = stage(
            "bucket script, 1 decision per call",
            &args,
            &[redis_w],
            1,
            script_stage(1),
        )
        .await;
        print(&script_one, Some(&incr));
        let script_batch = stage(
            &format!("bucket script, {} decisions per call", args.batch),
            &args,
            &[redis_w],
            args.batch,
            script_stage(args.batch),
        )
        .await;
        print(&script_batch, Some(&incr));
        println!("{}", ratelimit_e2e::script_cost::before_and_after(args.batch, keys));

        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(args.concurrency.max(args.loaded_concurrency))
            .timeout(OP_TIMEOUT)
            .build()
            .expect("client");
        let decide_url = format!("{}/v1/decide", sidecar.base_url());
        let decide_stage = |n: usize| {
            let (http, url) = (http.clone(), decide_url.clone());
            let op: Op = Arc::new(move |i| {
                let (http, url) = (http.clone(), url.clone());
                Box::pin(async move {
                    let requests: Vec<serde_json::Value> = (0..n as u64)
                        .map(|j| {
                            serde_json::json!({"decisions": [{"rule": "many",
                                "subject": {"ip": format!("k{}", (i + j * 7919) % keys)}}]})
                        })
                        .collect();
                    let body = serde_json::json!({"requests": requests}).to_string();
                    let resp = http
                        .post(&url)
                        .header("content-type", "application/json")
                        .body(body)
                        .send()
                        .await
                        .map_err(|e| e.to_string())?;
                    let status = resp.status();
                    resp.bytes().await.map_err(|e| e.to_string())?;
                    if status == 200 {
                        Ok(())
                    } else {
                        Err(format!("status {status}"))
                    }
                })
            });
            op
        };
        let watched_sc = [redis_w, sidecar_w];
        let decide_one = stage(
            "sidecar POST /v1/decide, 1 request per call",
            &args,
            &watched_sc,
            1,
            decide_stage(1),
        )
        .await;
        print(&decide_one, Some(&script_one));
        let decide_batch = stage(
            &format!("sidecar POST /v1/decide, {} requests per call", args.batch),
            &args,
            &watched_sc,
            args.batch,
            decide_stage(args.batch),
        )
        .await;
        print(&decide_batch, Some(&script_one));

        let memory = bucket_memory(&redis, &http, &decide_url).await;

        let mut runs = Vec::new();
        let workers_measured: &[u32] = if args.components_only {
            &[]
        } else {
            &args.workers
        };
        for &workers in workers_measured {
            println!("\n== Envoy, {workers} worker(s)");
            print_header();
            let config = |fast: bool| {
                EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port)
                    .plugin(&plugin(fast).to_string())
                    .concurrency(workers)
                    .render(10000, 9901, &wasm_path.display().to_string())
            };
            let run_stage_with = |name: String, yaml: String, workload: Workload, args: Args| {
                let http = http.clone();
                let watched = [redis_w, sidecar_w];
                async move {
                    envoy_stage(name, yaml, workers, workload, http, &args, keys, watched).await
                }
            };
            let run_stage = |name: String, yaml: String, workload: Workload| {
                run_stage_with(name, yaml, workload, args.clone())
            };
            let wasm_str = wasm_path.display().to_string();
            let noop_str = noop_wasm.display().to_string();
            let rounds = args.rounds.max(1);
            let mut measured = Vec::new();
            for round in 0..rounds {
            if rounds > 1 {
                println!("-- round {} of {rounds}", round + 1);
            }
            let baseline = run_stage(
                "envoy, no filter (baseline)".into(),
                edit_config(&config(true), Filter::None, &noop_str, &wasm_str),
                Workload::HotKey,
            )
            .await
            .0;
            print(&baseline, None);
            let noop = run_stage(
                "envoy + a wasm filter that does nothing (floor)".into(),
                edit_config(&config(true), Filter::Noop, &noop_str, &wasm_str),
                Workload::HotKey,
            )
            .await
            .0;
            print(&noop, Some(&baseline));
            let local = run_stage(
                "envoy + local_ratelimit (per-Envoy, no shared budget)".into(),
                edit_config(&config(true), Filter::LocalRateLimit, &noop_str, &wasm_str),
                Workload::HotKey,
            )
            .await
            .0;
            print(&local, Some(&baseline));
            let mut wasm = Vec::new();
            for workload in [Workload::ManyKeys, Workload::HotKey, Workload::Flood] {
                let slow = run_stage(
                    format!("{}: filter, one callout per request", workload.name()),
                    edit_config(&config(false), Filter::Wasm, &noop_str, &wasm_str),
                    workload,
                )
                .await
                .0;
                print(&slow, Some(&baseline));
                redis.cli(&["config", "resetstat"]);
                let (fast, callouts) = run_stage(
                    format!("{}: filter as shipped (fast paths)", workload.name()),
                    edit_config(&config(true), Filter::Wasm, &noop_str, &wasm_str),
                    workload,
                )
                .await;
                print(&fast, Some(&baseline));
                println!("{:<58} callouts per request: {callouts:.3}", "");
                println!("{:<58} {}", "", redis_breakdown(&redis, &fast));
                wasm.push((workload, slow, fast, callouts));
            }
            let mut native = Vec::new();
            for workload in [Workload::ManyKeys, Workload::HotKey, Workload::Flood] {
                let r = run_stage(
                    format!("{}: Envoy's native ratelimit filter, gRPC", workload.name()),
                    native_config(sidecar.port, upstream.port),
                    workload,
                )
                .await
                .0;
                print(&r, Some(&baseline));
                native.push((workload, r));
            }
            // Many keys again with more callers: the fast paths' batches grow with the load.
            let mut loaded = None;
            if args.loaded_concurrency > 0 {
                let c = args.loaded_concurrency;
                let la = Args {
                    concurrency: c,
                    ..args.clone()
                };
                let run_loaded = |name: &str, filter: Filter, fast: bool| {
                    run_stage_with(
                        format!("{c} callers, many keys: {name}"),
                        edit_config(&config(fast), filter, &noop_str, &wasm_str),
                        Workload::ManyKeys,
                        la.clone(),
                    )
                };
                let base = run_loaded("no filter (baseline)", Filter::None, true).await.0;
                print(&base, None);
                let noop = run_loaded("the no-op filter", Filter::Noop, true).await.0;
                print(&noop, Some(&base));
                let slow = run_loaded("filter, one callout per request", Filter::Wasm, false)
                    .await
                    .0;
                print(&slow, Some(&base));
                redis.cli(&["config", "resetstat"]);
                let (fast, callouts) =
                    run_loaded("filter as shipped (fast paths)", Filter::Wasm, true).await;
                print(&fast, Some(&base));
                println!("{:<58} callouts per request: {callouts:.3}", "");
                println!("{:<58} {}", "", redis_breakdown(&redis, &fast));
                loaded = Some(Loaded {
                    concurrency: c,
                    baseline: base,
                    noop,
                    slow,
                    fast,
                    callouts,
                });
            }
            measured.push(EnvoyRun {
                workers,
                baseline,
                noop,
                local,
                wasm,
                native,
                loaded,
            });
            }
            let run = EnvoyRun::median(&measured);
            if rounds > 1 {
                println!("-- medians of {rounds} rounds, {workers} worker(s)");
                run.print();
            }
            println!("-- the hot key at its limit, {workers} worker(s)");
            let yaml = edit_config(&config(true), Filter::Wasm, &noop_str, &wasm_str);
            let edge = at_limit_stage(yaml, workers, http.clone(), &args, workers).await;
            println!(
                "hot key at its limit: {} admitted, {} rejected, {} errors in {:.1} s; {:.4} callouts/request",
                edge.admitted, edge.rejected, edge.errors, edge.seconds, edge.callouts
            );
            runs.push((run, measured, edge));
        }


        println!("\n== summary");
        println!(
            "Redis CPU per decision: {:.1} µs for the script with 1 decision per call, {:.1} µs with {} per call, {:.1} µs for INCR",
            script_one.cpu_per_decision("redis"),
            script_batch.cpu_per_decision("redis"),
            args.batch,
            incr.cpu_per_decision("redis")
        );
        println!(
            "sidecar CPU per decision: {:.1} µs with 1 request per call, {:.1} µs with {} per call",
            decide_one.cpu_per_decision("sidecar"),
            decide_batch.cpu_per_decision("sidecar"),
            args.batch
        );
        println!(
            "Redis memory per bucket: {:.0} bytes (used_memory grew by that per bucket over {} buckets), {:.0} bytes by MEMORY USAGE ({} sampled); filter module {} KiB",
            memory.used_per_bucket,
            MEMORY_BUCKETS,
            memory.usage_per_bucket,
            memory.sampled,
            wasm_size / 1024
        );
        println!(
            "\n== goals (ratios from this run: the medians of {} round(s) of the Envoy stages)",
            args.rounds.max(1)
        );
        let script_redis = script_one.cpu_per_decision("redis");
        for (run, rounds, edge) in &runs {
            let w = run.workers;
            let find = |wl: Workload| run.wasm.iter().find(|(x, ..)| *x == wl).expect("workload");
            let judged = judge(run, script_redis);
            let verdict = |key: &str| {
                let j = judged.iter().find(|j| j.key == key).expect("goal");
                format!("goal {}: {}", j.want, if j.ok { "met" } else { "NOT met" })
            };
            let (_, _, hot, hot_callouts) = find(Workload::HotKey);
            let (_, _, flood, flood_callouts) = find(Workload::Flood);
            let (_, many_slow, many, many_callouts) = find(Workload::ManyKeys);
            let noop_envoy = run.noop.cpu("envoy");
            let r = hot.per_second() / run.noop.per_second();
            println!("[{w} worker(s)] hot key, mostly admitted: {r:.2}x the no-op filter's throughput ({}), {hot_callouts:.3} callouts/request", verdict("hot"));
            let r = flood.per_second() / run.noop.per_second();
            println!("[{w} worker(s)] flood on an exhausted key: {r:.2}x the no-op filter's throughput ({}), {flood_callouts:.4} callouts/request", verdict("flood"));
            let r = many.per_second() / run.baseline.per_second();
            println!("[{w} worker(s)] many keys: {r:.2}x the no-limit baseline ({}), {many_callouts:.3} callouts/request", verdict("many"));
            let added_fast = many.cpu("envoy") - noop_envoy;
            let added_slow = many_slow.cpu("envoy") - noop_envoy;
            println!(
                "[{w} worker(s)] many keys, Envoy CPU above the no-op filter: {added_fast:.1} µs/request vs {added_slow:.1} with a callout per request ({:.2} of it; {})",
                added_fast / added_slow.max(1e-9),
                verdict("envoy")
            );
            let redis_real = many.cpu_per_decision("redis");
            println!(
                "[{w} worker(s)] many keys, Redis CPU per decision on the real path: {redis_real:.1} µs vs {script_redis:.1} µs for the 1-decision script ({:.2}; {})",
                redis_real / script_redis.max(1e-9),
                verdict("redis")
            );
            for (wl, _, fast, _) in &run.wasm {
                let r = fast.cpu_per_decision("redis");
                println!(
                    "[{w} worker(s)] {}: Redis CPU {r:.2} µs and sidecar CPU {:.2} µs per request",
                    wl.name(),
                    fast.cpu_per_decision("sidecar")
                );
            }
            let sidecar_real = many.cpu_per_decision("sidecar");
            println!(
                "[{w} worker(s)] many keys, sidecar CPU per decision: {sidecar_real:.1} µs ({})",
                verdict("sidecar")
            );
            if let Some(l) = &run.loaded {
                let c = l.concurrency;
                let r = l.fast.per_second() / l.baseline.per_second();
                println!("[{w} worker(s), {c} callers] many keys: {r:.2}x the no-limit baseline ({}), {:.3} callouts/request", verdict("loaded many"), l.callouts);
                let added_fast = l.fast.cpu("envoy") - l.noop.cpu("envoy");
                let added_slow = l.slow.cpu("envoy") - l.noop.cpu("envoy");
                println!(
                    "[{w} worker(s), {c} callers] many keys, Envoy CPU above the no-op filter: {added_fast:.1} µs/request vs {added_slow:.1} with a callout per request ({:.2} of it; {})",
                    added_fast / added_slow.max(1e-9),
                    verdict("loaded envoy")
                );
                let redis_real = l.fast.cpu_per_decision("redis");
                println!(
                    "[{w} worker(s), {c} callers] many keys, Redis CPU per decision on the real path: {redis_real:.1} µs vs {script_redis:.1} µs for the 1-decision script ({:.2}; {})",
                    redis_real / script_redis.max(1e-9),
                    verdict("loaded redis")
                );
                let sidecar_real = l.fast.cpu_per_decision("sidecar");
                println!(
                    "[{w} worker(s), {c} callers] many keys, sidecar CPU per decision: {sidecar_real:.1} µs ({})",
                    verdict("loaded sidecar")
                );
            }
            println!(
                "[{w} worker(s)] local_ratelimit (no shared budget) for reference: {:.2}x the baseline",
                run.local.per_second() / run.baseline.per_second()
            );
            for (wl, native) in &run.native {
                let (_, _, fast, _) = find(*wl);
                let t = fast.per_second() / native.per_second();
                let c = fast.stack_cpu() / native.stack_cpu().max(1e-9);
                let key = format!("native {}", wl.name());
                let wanted = judged.iter().any(|j| j.key == key);
                println!(
                    "[{w} worker(s)] {}: the wasm filter vs Envoy's native filter + sidecar (gRPC): {t:.2}x the throughput, {c:.2}x the whole-stack CPU per request ({:.1} vs {:.1} µs){}",
                    wl.name(),
                    fast.stack_cpu(),
                    native.stack_cpu(),
                    if wanted { format!(" ({})", verdict(&key)) } else { String::new() }
                );
            }
            println!(
                "[{w} worker(s)] hot key at its limit ({EDGE_CAPACITY} + {EDGE_REFILL}/s, {} callers as one client, {:.1} s): {} admitted, exact bound C + r·T = {:.0}: over-admission {:.0} (goal 0: {}); under-admission {:.0} tokens ({:.1}% of the bound; leases withhold at most 2·L = {:.0} per Envoy, plus {} errors), {:.4} callouts/request",
                args.concurrency,
                edge.seconds,
                edge.admitted,
                edge.exact_bound(),
                edge.over(),
                if edge.over() == 0.0 { "met" } else { "NOT met" },
                edge.under(),
                100.0 * edge.under() / edge.exact_bound(),
                AtLimit::lease_bound(),
                edge.errors,
                edge.callouts
            );
            if rounds.len() > 1 {
                print_rounds(w, &judged, rounds, script_redis);
            }
        }
    });
    drop(sidecar);
    drop(redis);
}

/// The bucket script, as the sidecar embeds it.
fn ratelimit_sidecar_script() -> &'static str {
    ratelimit_e2e::script_cost::APPLY
}

/// Buckets written to measure memory.
const MEMORY_BUCKETS: usize = 10_000;

/// What one bucket costs Redis.
struct BucketMemory {
    used_per_bucket: f64,
    usage_per_bucket: f64,
    sampled: usize,
}

/// Writes [`MEMORY_BUCKETS`] buckets of the `mem` rule through the sidecar (full again only after
/// 100 s, so none expires meanwhile) and reads what Redis spends on them: the growth of
/// `used_memory` per bucket (Redis's own overhead included) and `MEMORY USAGE` of a sample.
async fn bucket_memory(redis: &Redis, http: &reqwest::Client, url: &str) -> BucketMemory {
    let mut c = redis.connection();
    let used = |c: &mut redis::Connection| -> f64 {
        let info: String = redis::cmd("INFO").arg("memory").query(c).expect("INFO");
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("used_memory")
    };
    let before = used(&mut c);
    let run = std::process::id();
    for chunk in 0..MEMORY_BUCKETS / 250 {
        let requests: Vec<serde_json::Value> = (0..250)
            .map(|j| {
                serde_json::json!({"decisions": [{"rule": "mem",
                    "subject": {"ip": format!("m{run}-{}", chunk * 250 + j)}}]})
            })
            .collect();
        let resp = http
            .post(url)
            .header("content-type", "application/json")
            .body(serde_json::json!({ "requests": requests }).to_string())
            .send()
            .await
            .expect("decide");
        assert_eq!(resp.status(), 200, "the memory stage's decisions");
    }
    let after = used(&mut c);
    let mut sample = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg("rl:{ratelimit|rule=mem*")
            .arg("COUNT")
            .arg(1000)
            .query(&mut c)
            .expect("SCAN");
        sample.extend(keys);
        cursor = next;
        if cursor == 0 || sample.len() >= 200 {
            break;
        }
    }
    let bytes: Vec<u64> = sample
        .iter()
        .take(200)
        .filter_map(|k| {
            redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(k)
                .query::<Option<u64>>(&mut c)
                .ok()
                .flatten()
        })
        .collect();
    BucketMemory {
        used_per_bucket: (after - before) / MEMORY_BUCKETS as f64,
        usage_per_bucket: bytes.iter().sum::<u64>() as f64 / bytes.len().max(1) as f64,
        sampled: bytes.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stage of `ops` operations in one second, with this CPU per operation by process.
    fn stage(ops: u64, cpu: &[(&'static str, f64)]) -> StageResult {
        StageResult {
            name: String::new(),
            ops,
            per_op: 1,
            seconds: 1.0,
            p50: Duration::ZERO,
            p99: Duration::ZERO,
            cpu_us_per_op: cpu.to_vec(),
        }
    }

    /// A run where the hot key reaches `hot` requests/s against a no-op filter at 1000, many keys
    /// costs Envoy `many_envoy` µs (the no-op filter 50, the per-request callout 90).
    fn run(hot: u64, many_envoy: f64, loaded: bool) -> EnvoyRun {
        let envoy = |v| [("envoy", v), ("redis", 4.0), ("sidecar", 9.0)];
        let wasm = vec![
            (
                Workload::ManyKeys,
                stage(300, &envoy(90.0)),
                stage(500, &envoy(many_envoy)),
                0.1,
            ),
            (
                Workload::HotKey,
                stage(300, &envoy(90.0)),
                stage(hot, &envoy(60.0)),
                0.0,
            ),
            (
                Workload::Flood,
                stage(300, &envoy(90.0)),
                stage(1500, &envoy(40.0)),
                0.0,
            ),
        ];
        let native = [Workload::ManyKeys, Workload::HotKey, Workload::Flood]
            .into_iter()
            .map(|w| (w, stage(400, &envoy(150.0))))
            .collect();
        EnvoyRun {
            workers: 1,
            baseline: stage(1000, &envoy(45.0)),
            noop: stage(1000, &envoy(50.0)),
            local: stage(1000, &envoy(48.0)),
            wasm,
            native,
            loaded: loaded.then(|| Loaded {
                concurrency: 256,
                baseline: stage(1000, &envoy(45.0)),
                noop: stage(1000, &envoy(50.0)),
                slow: stage(300, &envoy(90.0)),
                fast: stage(800, &envoy(55.0)),
                callouts: 0.03,
            }),
        }
    }

    fn verdict(judged: &[Judged], key: &str) -> bool {
        judged.iter().find(|j| j.key == key).expect(key).ok
    }

    #[test]
    fn goals_are_judged_at_their_thresholds() {
        let js = judge(&run(850, 60.0, false), 12.0);
        assert!(verdict(&js, "hot"), "0.85x is met");
        assert!(!verdict(&judge(&run(849, 60.0, false), 12.0), "hot"));
        assert!(verdict(&js, "flood"));
        assert!(verdict(&js, "many"), "0.5x is met");
        // Envoy added 10 µs against 40 for the per-request callout: 0.25, met; 11 is not.
        assert!(verdict(&js, "envoy"));
        assert!(!verdict(&judge(&run(850, 61.0, false), 12.0), "envoy"));
        // Redis 4 µs against 12 for the 1-decision script: a third, met; 11.9 is not.
        assert!(verdict(&js, "redis"));
        assert!(!verdict(&judge(&run(850, 60.0, false), 11.9), "redis"));
        assert!(verdict(&js, "sidecar"));
        assert!(verdict(&js, "native hot key"));
        assert!(
            js.iter().all(|j| j.key != "native many keys"),
            "no goal for many keys"
        );
        assert!(
            js.iter().all(|j| !j.key.starts_with("loaded")),
            "no loaded stages, no goals"
        );
    }

    #[test]
    fn the_hot_key_at_its_limit_is_held_to_its_exact_bound() {
        let edge = |admitted| AtLimit {
            admitted,
            rejected: 0,
            errors: 0,
            seconds: 4.0,
            callouts: 0.0,
        };
        // 2000 + 2000/s over 4 s: 10,000 tokens at most.
        assert_eq!(edge(9_990).exact_bound(), 10_000.0);
        assert_eq!((edge(9_990).over(), edge(9_990).under()), (0.0, 10.0));
        assert_eq!((edge(10_003).over(), edge(10_003).under()), (3.0, 0.0));
        // Two leases of min(1000, 10% of 2000) tokens.
        assert_eq!(AtLimit::lease_bound(), 400.0);
    }

    #[test]
    fn the_loaded_stages_are_judged_when_measured() {
        let js = judge(&run(850, 60.0, true), 12.0);
        for key in [
            "loaded many",
            "loaded envoy",
            "loaded redis",
            "loaded sidecar",
        ] {
            assert!(verdict(&js, key), "{key}");
        }
    }
}
