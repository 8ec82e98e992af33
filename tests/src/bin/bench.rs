//! `make bench`: what one rate-limit decision costs, measured against baselines in the same run.
//!
//! Every stage runs the same closed loop (N concurrent callers for a fixed time) against real
//! processes on this machine, and reports throughput, latency and the CPU each process spent per
//! operation (from /proc, so the figure is a cost, independent of how many cores the machine has):
//!
//! 1. Redis's own ceiling: `INCR` over a multiplexed (pipelined) connection (baseline).
//! 2. The bucket script called straight with EVALSHA: what the atomic decision costs Redis.
//! 3. The sidecar's `POST /v1/decide`: the HTTP hop, validation and the pipelined script call.
//! 4. Envoy in front of an upstream, without the filter (baseline for 5 and 6).
//! 5. The alternative: Envoy's built-in `local_ratelimit` (a bucket per Envoy, no shared budget).
//! 6. Envoy with the wasm filter and the sidecar: the global decision on every request, with the
//!    callout over HTTP/1.1 (as shipped) and over HTTP/2.
//!
//! All figures are printed; none is asserted. On a 2-core machine the load generator, Redis, the
//! sidecar and Envoy share the cores, so read the ratios and the CPU per operation, not the absolute
//! throughput.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use ratelimit_e2e::{Envoy, EnvoyConfig, Redis, Sidecar, Upstream};

#[derive(Parser)]
#[command(about = "Measures the cost of a rate-limit decision against baselines in the same run")]
struct Args {
    /// Seconds each stage runs.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Concurrent callers in each stage.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Distinct bucket keys the decisions spread over.
    #[arg(long, default_value_t = 10_000)]
    keys: usize,
}

/// One process whose CPU time is attributed to a stage.
struct Watched {
    name: &'static str,
    pid: u32,
}

/// The CPU time (user + system) a process has used so far, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may contain spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = [11, 12] // utime, stime (fields 14 and 15 counted from the pid)
        .iter()
        .filter_map(|i| fields.get(*i).and_then(|v| v.parse::<f64>().ok()))
        .sum();
    ticks / clock_ticks_per_second()
}

fn clock_ticks_per_second() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

struct StageResult {
    name: String,
    ops: u64,
    seconds: f64,
    p50: Duration,
    p99: Duration,
    cpu_us_per_op: Vec<(&'static str, f64)>,
}

impl StageResult {
    fn per_second(&self) -> f64 {
        self.ops as f64 / self.seconds
    }
    fn cpu_total(&self) -> f64 {
        self.cpu_us_per_op.iter().map(|(_, v)| v).sum()
    }
}

/// Runs `concurrency` copies of `op` for `seconds` and measures them.
async fn stage<F, Fut>(name: &str, args: &Args, watched: &[Watched], op: F) -> StageResult
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), String>> + Send,
{
    // A short warm-up so connections and caches exist before measuring.
    let warm = Instant::now();
    while warm.elapsed() < Duration::from_millis(300) {
        if let Err(e) = op(rand_u64()).await {
            panic!("{name}: warm-up failed: {e}");
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
            let mut i = worker as u64 * 7919;
            while !stop.load(Ordering::Relaxed) {
                i = i
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let t = Instant::now();
                match op(i >> 16).await {
                    Ok(()) => latencies.push(t.elapsed()),
                    Err(_) => errors += 1,
                }
            }
            (latencies, errors)
        }));
    }
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await.expect("stage task");
        latencies.extend(l);
        errors += e;
    }
    let seconds = start.elapsed().as_secs_f64();
    let ops = latencies.len() as u64;
    assert!(ops > 0, "{name}: no operation succeeded ({errors} errors)");
    if errors > 0 {
        eprintln!("{name}: {errors} operations failed");
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
        "{:<46} {:>10} {:>9} {:>9}  {:>10}  cpu µs per op by process",
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
        "{:<46} {:>10.0} {:>9} {:>9}  {:>10}  {}",
        r.name,
        r.per_second(),
        format!("{:.2?}", r.p50),
        format!("{:.2?}", r.p99),
        ratio,
        cpu.join(", ")
    );
}

/// The shipped config's filter block, to swap the wasm filter for another (or none).
fn without_wasm_filter(yaml: &str, replacement: &str) -> String {
    let start = yaml
        .find("          - name: envoy.filters.http.wasm")
        .expect("the config has the wasm filter");
    let end = yaml
        .find("          - name: envoy.filters.http.router")
        .expect("the config has the router");
    format!("{}{}{}", &yaml[..start], replacement, &yaml[end..])
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

/// The shipped config with the sidecar cluster speaking HTTP/2 (cleartext) instead of HTTP/1.1.
fn sidecar_over_http2(yaml: &str) -> String {
    let anchor = "  - name: ratelimit_sidecar\n    type: STATIC\n    connect_timeout: 0.25s\n";
    assert!(
        yaml.contains(anchor),
        "the sidecar cluster is where the bench expects it"
    );
    yaml.replace(
        anchor,
        &format!(
            "{anchor}    typed_extension_protocol_options:\n      \
             envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n        \
             \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n        \
             explicit_http_config:\n          http2_protocol_options: {{}}\n"
        ),
    )
}

/// Starts Envoy from a rendered YAML (for the variants the harness does not model).
fn envoy_from_yaml(
    config: &EnvoyConfig,
    edit: impl Fn(&str) -> String,
) -> (std::process::Child, u16, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let (listen, admin) = (ratelimit_e2e::free_port(), ratelimit_e2e::free_port());
    let yaml = edit(&config.render(listen, admin, &Envoy::wasm().display().to_string()));
    let path = dir.path().join("envoy.yaml");
    std::fs::write(&path, yaml).expect("write config");
    let log = std::fs::File::create(dir.path().join("envoy.log")).expect("log");
    let child = std::process::Command::new(Envoy::bin())
        .arg("-c")
        .arg(&path)
        .args([
            "--concurrency",
            "1",
            "--disable-hot-restart",
            "-l",
            "warning",
        ])
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
    (child, listen, dir)
}

fn http_get_op(
    client: reqwest::Client,
    url: String,
    headers: Vec<(&'static str, &'static str)>,
) -> impl Fn(u64) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>>
       + Clone {
    move |_| {
        let (client, url, headers) = (client.clone(), url.clone(), headers.clone());
        Box::pin(async move {
            let mut req = client.get(&url);
            for (k, v) in headers {
                req = req.header(k, v);
            }
            let resp = req.send().await.map_err(|e| e.to_string())?;
            let status = resp.status();
            resp.bytes().await.map_err(|e| e.to_string())?;
            if status == 200 {
                Ok(())
            } else {
                Err(format!("status {status}"))
            }
        })
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
    println!(
        "ratelimit bench: {} s per stage, {} concurrent callers, {} keys, {cores} cores shared by every process",
        args.seconds, args.concurrency, args.keys
    );

    let redis = Redis::start_with(&["--maxmemory-policy", "noeviction"]);
    let sidecar = Sidecar::start(&redis.url(), &["--redis-timeout-ms", "1000"]);
    let upstream = Upstream::start();
    let redis_w = Watched {
        name: "redis",
        pid: redis.process.pid(),
    };
    let sidecar_w = Watched {
        name: "sidecar",
        pid: sidecar.process.pid(),
    };

    rt.block_on(async {
        let client = redis::Client::open(redis.url()).expect("redis url");
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect redis");
        let keys = args.keys as u64;

        print_header();
        let incr = {
            let conn = conn.clone();
            stage("redis INCR, pipelined (Redis's ceiling)", &args, std::slice::from_ref(&redis_w), move |i| {
                let mut conn = conn.clone();
                async move {
                    redis::cmd("INCR")
                        .arg(format!("bench:incr:{}", i % keys))
                        .query_async::<i64>(&mut conn)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                }
            })
            .await
        };
        print(&incr, None);

        let script = include_str!("../../../lua/token_bucket.lua");
        let sha = sha1_smol::Sha1::from(script).digest().to_string();
        let _: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(script)
            .query_async(&mut conn.clone())
            .await
            .expect("SCRIPT LOAD");
        let evalsha = {
            let conn = conn.clone();
            stage("bucket script, EVALSHA straight", &args, std::slice::from_ref(&redis_w), move |i| {
                let mut conn = conn.clone();
                let sha = sha.clone();
                async move {
                    let key = format!("rl:{{bench:{}}}", i % keys);
                    redis::cmd("EVALSHA")
                        .arg(&sha)
                        .arg(2)
                        .arg(&key)
                        .arg(format!("{key}:a:"))
                        .arg("apply")
                        .arg(10_000)
                        .arg(1_000_000_000)
                        .arg(1_000_000)
                        .arg(1)
                        .arg("")
                        .query_async::<redis::Value>(&mut conn)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                }
            })
            .await
        };
        print(&evalsha, Some(&incr));

        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(args.concurrency)
            .build()
            .expect("client");
        let decide_url = format!("{}/v1/decide", sidecar.base_url());
        let watched = [
            Watched { name: "redis", pid: redis_w.pid },
            Watched { name: "sidecar", pid: sidecar_w.pid },
        ];
        let decide = {
            let (http, url) = (http.clone(), decide_url.clone());
            stage("sidecar POST /v1/decide (1 decision)", &args, &watched, move |i| {
                let (http, url) = (http.clone(), url.clone());
                async move {
                    let body = format!(
                        r#"{{"decisions":[{{"key":"bench:{}","capacity":1000000000,"refill_per_sec":1000000}}]}}"#,
                        i % keys
                    );
                    let resp = http
                        .post(&url)
                        .header("content-type", "application/json")
                        .body(body)
                        .send()
                        .await
                        .map_err(|e| e.to_string())?;
                    let status = resp.status();
                    resp.bytes().await.map_err(|e| e.to_string())?;
                    if status == 200 { Ok(()) } else { Err(format!("status {status}")) }
                }
            })
            .await
        };
        print(&decide, Some(&evalsha));

        let plugin = serde_json::json!({
            "sidecar": {"cluster": "ratelimit_sidecar", "timeout_ms": 1000},
            "identity": {"api_key": {"header": "x-api-key",
                "keys": {"677509799af78b2efa2f2af71d0f906e0a0c50c048efd3b515625f788e92b99a": "alpha"}}},
            "rules": [{"name": "per-app", "match": {"path_prefix": "/api/"}, "subject": ["app"],
                       "capacity": 1_000_000_000u64, "refill_per_sec": 1_000_000, "on_error": "deny"}]
        });
        let config = EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port)
            .plugin(&plugin.to_string())
            .concurrency(1);
        let alpha = vec![("x-api-key", "alpha-key")];

        let mut envoy_results = Vec::new();
        for (name, edit) in [
            ("envoy, no rate limit (baseline)", Box::new(|y: &str| without_wasm_filter(y, "")) as Box<dyn Fn(&str) -> String>),
            ("envoy + local_ratelimit (per-Envoy, no global)", Box::new(|y: &str| without_wasm_filter(y, LOCAL_RATELIMIT))),
            ("envoy + filter + sidecar, HTTP/1.1 callout", Box::new(|y: &str| y.to_string())),
            ("envoy + filter + sidecar, HTTP/2 callout", Box::new(sidecar_over_http2)),
        ] {
            let (mut child, port, _dir) = envoy_from_yaml(&config, edit);
            let watched = [
                Watched { name: "redis", pid: redis_w.pid },
                Watched { name: "sidecar", pid: sidecar_w.pid },
                Watched { name: "envoy", pid: child.id() },
            ];
            let op = http_get_op(http.clone(), format!("http://127.0.0.1:{port}/api/bench"), alpha.clone());
            let r = stage(name, &args, &watched, op).await;
            let _ = child.kill();
            let _ = child.wait();
            envoy_results.push(r);
        }
        print(&envoy_results[0], None);
        print(&envoy_results[1], Some(&envoy_results[0]));
        print(&envoy_results[2], Some(&envoy_results[0]));
        print(&envoy_results[3], Some(&envoy_results[0]));

        let decision_cpu_us = decide.cpu_us_per_op.iter().filter(|(n, _)| *n != "load generator").map(|(_, v)| v).sum::<f64>();
        let envoy_cpu = |r: &StageResult| r.cpu_us_per_op.iter().find(|(n, _)| *n == "envoy").map(|(_, v)| *v).unwrap_or(0.0);
        let redis_cpu = |r: &StageResult| r.cpu_us_per_op.iter().find(|(n, _)| *n == "redis").map(|(_, v)| *v).unwrap_or(0.0);
        let sidecar_cpu = |r: &StageResult| {
            r.cpu_us_per_op
                .iter()
                .find(|(n, _)| *n == "sidecar")
                .map(|(_, v)| *v)
                .unwrap_or(0.0)
        };
        let (base, global) = (&envoy_results[0], &envoy_results[2]);
        println!();
        println!(
            "HTTP/2 vs HTTP/1.1 callout: {:.2}x throughput, Envoy CPU {:.1} vs {:.1} µs/request, sidecar CPU {:.1} vs {:.1} µs/decision",
            envoy_results[3].per_second() / envoy_results[2].per_second(),
            envoy_cpu(&envoy_results[3]),
            envoy_cpu(&envoy_results[2]),
            sidecar_cpu(&envoy_results[3]),
            sidecar_cpu(&envoy_results[2]),
        );
        println!();
        println!("added by the global decision in Envoy: p50 +{:.2?}, p99 +{:.2?}, Envoy CPU +{:.1} µs/request",
            global.p50.saturating_sub(base.p50), global.p99.saturating_sub(base.p99), envoy_cpu(global) - envoy_cpu(base));
        println!("bucket script vs INCR in Redis: {:.1} vs {:.1} µs of Redis CPU per op ({:.2}x)",
            redis_cpu(&evalsha), redis_cpu(&incr), redis_cpu(&evalsha) / redis_cpu(&incr).max(1e-9));
        println!("one decision through the sidecar costs {:.1} µs CPU (Redis + sidecar); {:.1} µs in all with the load generator",
            decision_cpu_us, decide.cpu_total());
        println!(
            "fleet sizing for 1,000,000 decisions/s: ~{:.0} Redis cores (one per Cluster primary) and ~{:.0} sidecar cores",
            redis_cpu(&evalsha) , // µs per decision × 1e6 decisions/s ÷ 1e6 µs per core-second
            decide.cpu_us_per_op.iter().find(|(n, _)| *n == "sidecar").map(|(_, v)| *v).unwrap_or(0.0)
        );
    });
    drop(sidecar);
    drop(redis);
}
