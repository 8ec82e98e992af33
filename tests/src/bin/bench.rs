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

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use ratelimit_e2e::load::{self, figures, Callers, ClosedLoop, Load, Measured, Op, Warmup};
use ratelimit_e2e::plugin::{max_lease_tokens, rule, Plugin};
use ratelimit_e2e::probe::{self, Watched};
use ratelimit_e2e::report::{median, Table};
use ratelimit_e2e::script_cost;
use ratelimit_e2e::{Envoy, EnvoyConfig, Redis, Sidecar, Upstream};
use serde_json::json;

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
    /// With `--ab-filter`: B's callouts reach the sidecar over HTTP/2 (h2c, which its listener
    /// also serves) instead of the shipped HTTP/1.1; `--ab-filter` names the same build as A to
    /// measure the protocol alone.
    #[arg(long)]
    ab_b_http2: bool,
    /// Only the RLQS comparison: per worker count, Envoy alone, local_ratelimit, the wasm filter
    /// as shipped and Envoy's quota filter (RLQS), on the hot key and many keys.
    #[arg(long)]
    rlqs_only: bool,
    /// An extra argument for the sidecar (repeatable), e.g. `--sidecar-arg=--redis-pipeline=1`
    /// to measure a setting against the default in another run.
    #[arg(long, allow_hyphen_values = true)]
    sidecar_arg: Vec<String>,
}

fn main() {
    let bench = Bench::start(Args::parse());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        if let Some(other) = &bench.args.ab_filter {
            return ab_filter(&bench, other).await;
        }
        if bench.args.rlqs_only {
            for &workers in &bench.args.workers {
                rlqs_comparison(&bench, workers).await;
            }
            return;
        }
        let components = components(&bench, SCRIPT).await;
        let memory = bucket_memory(&bench).await;
        let mut runs = Vec::new();
        if !bench.args.components_only {
            for &workers in &bench.args.workers {
                runs.push(envoy_stages(&bench, workers).await);
            }
        }
        print_summary(&bench, &components, &memory);
        print_goals(&bench, &components, &runs);
    });
}

/// The bucket script, as the sidecar embeds it.
const SCRIPT: &str = script_cost::APPLY;

/// The longest one operation may take: one that hangs (a lost response) is an error, and the
/// stage still ends on time.
const OP_TIMEOUT: Duration = Duration::from_secs(10);

/// The bench's policy: huge budgets for the admitted workloads, an exhausted one for the flood,
/// the hot key at its limit ([`EDGE_CAPACITY`]), and buckets to weigh ([`bucket_memory`]).
const POLICY: &str = "rules:
  many: {capacity: 999999999999, refill_per_sec: 1000000000}
  hot: {capacity: 999999999999, refill_per_sec: 1000000000}
  flood: {capacity: 1, refill_per_sec: 0.000001}
  edge: {capacity: 2000, refill_per_sec: 2000}
  keys: {capacity: 999999999999, refill_per_sec: 1000000000}
  settled: {capacity: 999999999999, refill_per_sec: 1000000000}
  mem: {capacity: 100, refill_per_sec: 1}
";

/// The `edge` rule of [`POLICY`]: the hot key at its limit.
const EDGE_CAPACITY: f64 = 2000.0;
const EDGE_REFILL: f64 = 2000.0;

/// What every stage runs against: Redis, the sidecar and an upstream, started once.
struct Bench {
    args: Args,
    sidecar: Sidecar,
    redis: Redis,
    upstream: Upstream,
    /// The filter's build and the filter that does nothing.
    wasm: PathBuf,
    noop_wasm: PathBuf,
    wasm_size: u64,
    http: reqwest::Client,
}

impl Bench {
    /// Prints what runs where, then starts the processes.
    fn start(args: Args) -> Bench {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let wasm = Envoy::wasm();
        let noop_wasm = ratelimit_e2e::workspace_root()
            .join("target/wasm32-wasip1/release/ratelimit_noop_filter.wasm");
        assert!(
            noop_wasm.exists() || args.rlqs_only,
            "build the no-op filter first (make bench does)"
        );
        let wasm_size = std::fs::metadata(&wasm).map(|m| m.len()).unwrap_or(0);
        println!(
            "ratelimit bench: {} s per stage, {} round(s) of the Envoy stages, {} concurrent callers, {} keys, {cores} cores ({}) shared by every process",
            args.seconds, args.rounds.max(1), args.concurrency, args.keys, probe::cpu_model()
        );
        println!(
            "filter module: {} ({} KiB)",
            wasm.display(),
            wasm_size / 1024
        );
        let redis = Redis::start_with(&["--maxmemory-policy", "noeviction"]);
        let mut sidecar_args = vec!["--redis-timeout-ms", "1000"];
        sidecar_args.extend(args.sidecar_arg.iter().map(String::as_str));
        let sidecar = Sidecar::with_policy(&redis.url(), POLICY, &sidecar_args);
        let upstream = Upstream::start();
        let http = load::http_client(args.concurrency.max(args.loaded_concurrency), OP_TIMEOUT);
        Bench {
            args,
            sidecar,
            redis,
            upstream,
            wasm,
            noop_wasm,
            wasm_size,
            http,
        }
    }

    /// Redis and the sidecar, watched in every stage that reaches them.
    fn watched(&self) -> Vec<Watched> {
        vec![
            Watched::new("redis", self.redis.pid()),
            Watched::new("sidecar", self.sidecar.process.pid()),
        ]
    }

    /// Measures `op` with `callers` callers and the bench's warm-up and length.
    async fn stage(
        &self,
        name: &str,
        callers: usize,
        watched: &[Watched],
        per_op: usize,
        op: Op<Result<(), String>>,
    ) -> StageResult {
        let measured = ClosedLoop {
            name,
            callers,
            warmup: Warmup::Alone(Duration::from_millis(self.args.warmup_ms)),
            seconds: self.args.seconds as f64,
            watched,
            probe: None,
            interrupted: None,
        }
        .measure(op)
        .await;
        StageResult::of(name, per_op, watched, &measured)
    }

    /// The shipped `envoy/envoy.yaml` with the bench's rules (every fast path on or off), the
    /// filter slot holding `filter`, and the client address taken from `X-Forwarded-For` (the
    /// bench tells its 10,000 clients apart by address; an edge Envoy must not, see the README).
    fn envoy(&self, filter: Filter, fast: bool, workers: u32) -> EnvoyConfig {
        let config = EnvoyConfig::shipped("envoy.yaml", self.sidecar.port, self.upstream.port)
            .plugin(&plugin(fast, self.args.keys).to_string())
            .concurrency(workers)
            .log_level("warning")
            .replace("use_remote_address: true", "use_remote_address: false");
        let slot = |c: EnvoyConfig, with: &str| c.replace_lines(WASM_FILTER, ROUTER, with);
        match filter {
            Filter::None => slot(config, ""),
            Filter::Noop => config.wasm_module(&self.noop_wasm),
            Filter::LocalRateLimit => slot(config, LOCAL_RATELIMIT),
            Filter::Wasm(module) => config.wasm_module(module),
        }
    }

    /// The shipped `envoy-native-ratelimit.yaml` (Envoy's native rate limit filter calling the
    /// sidecar over gRPC) with one route per workload whose descriptors name the bench's rules,
    /// the same generous timeout as the wasm stages, and addresses from `X-Forwarded-For`.
    fn native(&self, workers: u32) -> EnvoyConfig {
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
        EnvoyConfig::shipped(
            "envoy-native-ratelimit.yaml",
            self.sidecar.port,
            self.upstream.port,
        )
        .concurrency(workers)
        .log_level("warning")
        .replace("use_remote_address: true", "use_remote_address: false")
        .replace("timeout: 0.05s", "timeout: 2s")
        .replace_lines("              routes:", "          http_filters:", &routes)
    }

    /// The shipped `envoy-rlqs.yaml` (Envoy's quota filter, RLQS to the sidecar) with one bucket
    /// per workload naming the bench's rules (`many` per address), addresses from
    /// `X-Forwarded-For`, and ALLOW_ALL before a bucket's first assignment: the stage measures
    /// the cost of decisions made in Envoy, not the first request of each of 10,000 buckets.
    fn rlqs(&self, workers: u32) -> EnvoyConfig {
        let bucket = |path: &str, rule: &str, ip: bool| {
            let ip = if ip {
                "                              ip:\n                                custom_value:\n                                  name: ip\n                                  typed_config:\n                                    \"@type\": type.googleapis.com/envoy.extensions.matching.common_inputs.network.v3.SourceIPInput\n"
            } else {
                ""
            };
            format!(
                "                  - predicate:\n                      single_predicate:\n                        input:\n                          name: path\n                          typed_config:\n                            \"@type\": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput\n                            header_name: \":path\"\n                        value_match: {{ prefix: \"{path}\" }}\n                    on_match:\n                      action:\n                        name: rate_limit_quota\n                        typed_config:\n                          \"@type\": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings\n                          bucket_id_builder:\n                            bucket_id_builder:\n                              rule: {{ string_value: {rule} }}\n{ip}                          reporting_interval: 1s\n                          no_assignment_behavior: {{ fallback_rate_limit: {{ blanket_rule: ALLOW_ALL }} }}\n"
            )
        };
        let matchers = format!(
            "              bucket_matchers:\n                matcher_list:\n                  matchers:\n{}{}{}",
            bucket("/many/", "many", true),
            bucket("/hot/", "hot", false),
            bucket("/flood/", "flood", false),
        );
        EnvoyConfig::shipped("envoy-rlqs.yaml", self.sidecar.port, self.upstream.port)
            .concurrency(workers)
            .log_level("warning")
            .replace("use_remote_address: true", "use_remote_address: false")
            .replace_lines(
                "              bucket_matchers:",
                "          - name: envoy.filters.http.router",
                &matchers,
            )
    }

    /// Runs one stage of `workload` against a fresh Envoy started from `config`, with `callers`
    /// callers: the stage's figures and the filter's callouts per decided request.
    async fn envoy_stage(
        &self,
        name: String,
        config: EnvoyConfig,
        workload: Workload,
        callers: usize,
    ) -> (StageResult, f64) {
        // Stopped however the stage ends: a stage that panics (its warm-up failing) leaves no
        // Envoy running behind the bench.
        let envoy = off_runtime(move || Envoy::start(&config)).await;
        let mut watched = self.watched();
        watched.push(Watched::new("envoy", envoy.process.pid()));
        let op = workload_op(
            self.http.clone(),
            envoy.url(workload.path()),
            workload,
            self.args.keys as u64,
        );
        let r = self.stage(&name, callers, &watched, 1, op).await;
        (r, callouts_per_request(&envoy))
    }
}

/// Runs `f` (which makes blocking HTTP calls: starting Envoy waits on its readiness) on a
/// blocking thread. Called on the runtime's own thread, reqwest's blocking client can spin
/// forever: its wake-up is deferred to the very runtime it blocks (seen as a bench stuck at full
/// CPU between two stages).
async fn off_runtime<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .expect("a blocking step of the bench panicked")
}

/// The filter's callouts per request it decided (admitted or rejected), since Envoy started.
fn callouts_per_request(envoy: &Envoy) -> f64 {
    probe::envoy_stat(envoy, "ratelimit.callouts")
        / (probe::envoy_stat(envoy, "ratelimit.admitted")
            + probe::envoy_stat(envoy, "ratelimit.rejected"))
        .max(1.0)
}

// ---------------------------------------------------------------------------------------------
// Stages and their table.

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
    cpu_us_per_op: Vec<(String, f64)>,
}

impl StageResult {
    /// A measured stage: the watched processes' CPU per operation, then the load generator's.
    fn of(name: &str, per_op: usize, watched: &[Watched], m: &Measured) -> StageResult {
        let mut cpu_us_per_op: Vec<(String, f64)> = watched
            .iter()
            .map(|w| (w.name.clone(), m.cpu_us_per_op(&w.name)))
            .collect();
        cpu_us_per_op.push((
            "load generator".into(),
            m.cpu.own * 1e6 / m.ops.max(1) as f64,
        ));
        StageResult {
            name: name.to_string(),
            ops: m.ops,
            per_op,
            seconds: m.seconds,
            p50: m.quantile(0.50),
            p99: m.quantile(0.99),
            cpu_us_per_op,
        }
    }
    fn per_second(&self) -> f64 {
        self.ops as f64 / self.seconds
    }
    fn cpu(&self, process: &str) -> f64 {
        self.cpu_us_per_op
            .iter()
            .find(|(n, _)| n == process)
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
            .filter(|(n, _)| n != "load generator")
            .map(|(_, v)| v)
            .sum()
    }
}

/// The table every stage is a line of.
fn stage_table() -> Table {
    Table::new()
        .left(58)
        .right(9)
        .right(9)
        .right(9)
        .gap(2)
        .right(8)
        .gap(2)
        .left(0)
}

fn print_header() {
    println!(
        "{}",
        stage_table().line(&[
            "stage",
            "ops/s",
            "p50",
            "p99",
            "vs base",
            "cpu µs per op by process"
        ])
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
        "{}",
        stage_table().line(&[
            r.name.clone(),
            format!("{:.0}", r.per_second()),
            format!("{:.2?}", r.p50),
            format!("{:.2?}", r.p99),
            ratio,
            cpu.join(", "),
        ])
    );
}

/// A line under a stage's row.
fn print_note(text: &str) {
    println!("{}", stage_table().note(text));
}

/// Where Redis spent its time during a stage (since `CONFIG RESETSTAT`): script calls, requests
/// per call (with the fast paths, most requests never reach Redis), the µs per call inside
/// `EVALSHA` and of the commands it ran, and the keys that expired (a bucket full again is
/// deleted; a quiet client's next decision creates it anew). The counts include the stage's
/// start (Envoy starting, the warm-up): "about".
fn redis_breakdown(redis: &Redis, r: &StageResult) -> String {
    let [evalsha, mget, set] = probe::command_stats(redis, &["evalsha", "mget", "set"])[..] else {
        unreachable!("three commands asked")
    };
    let expired = probe::info_number(redis, "stats", "expired_keys");
    if evalsha.calls == 0.0 {
        return format!(
            "redis: no script call, {:.0} keys expired/s",
            expired / r.seconds
        );
    }
    format!(
        "redis: about {:.1} requests per script call, {:.1} µs inside EVALSHA per call (MGET \
         {:.1} µs, {:.1} SETs of {:.2} µs), {:.0} keys expired/s",
        r.ops as f64 / evalsha.calls,
        evalsha.usec_per_call,
        mget.usec_per_call,
        set.calls / evalsha.calls,
        set.usec_per_call,
        expired / r.seconds
    )
}

// ---------------------------------------------------------------------------------------------
// Components: Redis, the script, the sidecar.

/// The component stages' figures the summary and the goals use.
struct Components {
    incr: StageResult,
    script_one: StageResult,
    script_batch: StageResult,
    /// `lua/single.lua`, the script the sidecar sends for a lone decision.
    single_one: StageResult,
    decide_one: StageResult,
    decide_batch: StageResult,
}

/// Redis's own ceiling (`INCR`), the bucket script `script` (its text) with one decision per call
/// and with `--batch`, the sidecar's `POST /v1/decide` with one request per call and with a
/// batch.
async fn components(b: &Bench, script: &str) -> Components {
    println!("\n== components");
    print_header();
    let conn = redis::Client::open(b.redis.url())
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect redis");
    let keys = b.args.keys as u64;
    let redis_only = &b.watched()[..1];
    let incr = {
        let conn = conn.clone();
        let op = load::op(move |call| {
            let mut conn = conn.clone();
            async move {
                redis::cmd("INCR")
                    .arg(format!("bench:incr:{}", (call.random() >> 16) % keys))
                    .query_async::<i64>(&mut conn)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
        });
        let name = "redis INCR, pipelined (Redis's ceiling)";
        b.stage(name, b.args.concurrency, redis_only, 1, op).await
    };
    print(&incr, None);
    let apply = script_cost::apply_call;
    let (script_one, script_batch) = script_stages(b, &conn, "bucket script", script, apply).await;
    print(&script_one, Some(&incr));
    print(&script_batch, Some(&incr));
    // The script a call of lone decisions without a lease ask, a share or a record runs.
    let (label, single) = ("lone-decision script (single.lua)", script_cost::SINGLE);
    let (single_one, single_batch) =
        script_stages(b, &conn, label, single, script_cost::single_call).await;
    print(&single_one, Some(&incr));
    print(&single_batch, Some(&incr));
    print_note(&format!(
        "Redis CPU per decision: the lone-decision script {:.2}x the long script's with 1 per call, {:.2}x with {}",
        single_one.cpu_per_decision("redis") / script_one.cpu_per_decision("redis").max(1e-9),
        single_batch.cpu_per_decision("redis") / script_batch.cpu_per_decision("redis").max(1e-9),
        b.args.batch
    ));
    println!("{}", script_cost::before_and_after(b.args.batch, keys));

    let decide_url = format!("{}/v1/decide", b.sidecar.base_url());
    let decide_stage = |n: usize| {
        let (http, url) = (b.http.clone(), decide_url.clone());
        load::op(move |call| {
            let (http, url) = (http.clone(), url.clone());
            let i = call.random() >> 16;
            async move {
                let requests: Vec<serde_json::Value> = (0..n as u64)
                    .map(|j| {
                        json!({"decisions": [{"rule": "many",
                            "subject": {"ip": format!("k{}", (i + j * 7919) % keys)}}]})
                    })
                    .collect();
                let body = json!({"requests": requests}).to_string();
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
            }
        })
    };
    let (c, batch, watched) = (b.args.concurrency, b.args.batch, b.watched());
    let decide_one = b
        .stage(
            "sidecar POST /v1/decide, 1 request per call",
            c,
            &watched,
            1,
            decide_stage(1),
        )
        .await;
    print(&decide_one, Some(&script_one));
    let name = format!("sidecar POST /v1/decide, {batch} requests per call");
    let decide_batch = b
        .stage(&name, c, &watched, batch, decide_stage(batch))
        .await;
    print(&decide_batch, Some(&script_one));
    Components {
        incr,
        script_one,
        script_batch,
        single_one,
        decide_one,
        decide_batch,
    }
}

/// A bucket script (`script`, its text, loaded into Redis) called directly by `call` (the
/// `EVALSHA` of its `n` decisions for call number `i` on `keys` buckets) with one decision per
/// call and with `--batch`, its stages named `<label>, N decision(s) per call`: a second script
/// measured beside the first is one more call.
async fn script_stages(
    b: &Bench,
    conn: &redis::aio::MultiplexedConnection,
    label: &str,
    script: &str,
    call: fn(&str, usize, u64, u64) -> redis::Cmd,
) -> (StageResult, StageResult) {
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(script)
        .query_async(&mut conn.clone())
        .await
        .expect("SCRIPT LOAD");
    let keys = b.args.keys as u64;
    let script_op = |n: usize| {
        let (conn, sha) = (conn.clone(), sha.clone());
        load::op(move |c| {
            let mut conn = conn.clone();
            let cmd = call(&sha, n, c.random() >> 16, keys);
            async move {
                cmd.query_async::<redis::Value>(&mut conn)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
        })
    };
    let (c, batch, redis_only) = (b.args.concurrency, b.args.batch, &b.watched()[..1]);
    let one = format!("{label}, 1 decision per call");
    let one = b.stage(&one, c, redis_only, 1, script_op(1)).await;
    let many = format!("{label}, {batch} decisions per call");
    let many = b.stage(&many, c, redis_only, batch, script_op(batch)).await;
    (one, many)
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
async fn bucket_memory(b: &Bench) -> BucketMemory {
    let url = format!("{}/v1/decide", b.sidecar.base_url());
    let before = probe::used_memory(&b.redis);
    let run = std::process::id();
    for chunk in 0..MEMORY_BUCKETS / 250 {
        let requests: Vec<serde_json::Value> = (0..250)
            .map(|j| {
                json!({"decisions": [{"rule": "mem",
                    "subject": {"ip": format!("m{run}-{}", chunk * 250 + j)}}]})
            })
            .collect();
        let resp = b
            .http
            .post(&url)
            .header("content-type", "application/json")
            .body(json!({ "requests": requests }).to_string())
            .send()
            .await
            .expect("decide");
        assert_eq!(resp.status(), 200, "the memory stage's decisions");
    }
    let after = probe::used_memory(&b.redis);
    let mut c = b.redis.connection();
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
        used_per_bucket: (after - before) as f64 / MEMORY_BUCKETS as f64,
        usage_per_bucket: bytes.iter().sum::<u64>() as f64 / bytes.len().max(1) as f64,
        sampled: bytes.len(),
    }
}

// ---------------------------------------------------------------------------------------------
// Envoy: the workloads, what the filter slot holds.

#[derive(Clone, Copy, PartialEq, Debug, clap::ValueEnum)]
enum Workload {
    ManyKeys,
    HotKey,
    Flood,
    /// Many keys told apart by API key (identity by key, as users configure it), not address.
    ManyApiKeys,
    /// Many keys (by address), each request's cost settled from its response: reserved 10, the
    /// upstream reports 4 in `x-usage-tokens` (docs/costs.md).
    Settled,
}

impl Workload {
    const ALL: [Workload; 3] = [Workload::ManyKeys, Workload::HotKey, Workload::Flood];
    /// Measured with the filter as shipped beside the goals' workloads, against many keys.
    const EXTRA: [Workload; 2] = [Workload::ManyApiKeys, Workload::Settled];

    fn name(self) -> &'static str {
        match self {
            Workload::ManyKeys => "many keys",
            Workload::HotKey => "hot key",
            Workload::Flood => "flood",
            Workload::ManyApiKeys => "many API keys",
            Workload::Settled => "settled costs (many keys)",
        }
    }
    fn path(self) -> &'static str {
        match self {
            Workload::ManyKeys => "/many/x",
            Workload::HotKey => "/hot/x",
            Workload::Flood => "/flood/x",
            Workload::ManyApiKeys => "/keys/x",
            Workload::Settled => "/usage/header?tokens=4",
        }
    }
}

/// A GET of `url` with the workload's headers (many keys: one of `keys` client addresses);
/// done when answered 200 (429 for the flood).
fn workload_op(
    client: reqwest::Client,
    url: String,
    workload: Workload,
    keys: u64,
) -> Op<Result<(), String>> {
    load::op(move |call| {
        let mut req = client.get(&url);
        let k = (call.random() >> 16) % keys;
        match workload {
            Workload::ManyKeys | Workload::Settled => {
                req = req.header(
                    "x-forwarded-for",
                    format!("10.{}.{}.{}", (k >> 16) & 255, (k >> 8) & 255, k & 255),
                );
            }
            Workload::ManyApiKeys => req = req.header("x-api-key", api_key(k)),
            Workload::HotKey | Workload::Flood => {}
        }
        async move {
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
        }
    })
}

/// The API key of client `k` of the many-API-keys workload.
fn api_key(k: u64) -> String {
    format!("bench-key-{k}")
}

/// The plugin configuration: one rule per workload, the `keys` API keys of the many-API-keys
/// workload (each its own app); `fast` turns every fast path on (as shipped) or off (one callout
/// per request).
fn plugin(fast: bool, keys: usize) -> Plugin {
    let mut settled = rule("settled", "/usage/", &["ip"], "deny");
    settled["cost"] = json!({"reserve": 10, "response_header": "x-usage-tokens"});
    let plugin = Plugin::by_address(json!([
        rule("many", "/many/", &["ip"], "deny"),
        rule("hot", "/hot/", &[], "deny"),
        rule("flood", "/flood/", &[], "deny"),
        rule("edge", "/edge/", &["ip"], "deny"),
        rule("keys", "/keys/", &["app"], "deny"),
        settled
    ]))
    .api_keys(
        "x-api-key",
        (0..keys as u64).map(|k| (api_key(k), format!("app{k}"))),
    );
    if fast {
        plugin
    } else {
        plugin.one_callout_per_request()
    }
}

/// What the wasm filter slot of the shipped config holds in a stage.
#[derive(Clone, Copy, PartialEq)]
enum Filter<'a> {
    None,
    Noop,
    LocalRateLimit,
    /// The filter, this build of it.
    Wasm(&'a Path),
}

/// The lines of the shipped config's filter chain where the wasm filter starts and where the
/// router (after it) does.
const WASM_FILTER: &str = "          - name: envoy.filters.http.wasm";
const ROUTER: &str = "          - name: envoy.filters.http.router";

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

// ---------------------------------------------------------------------------------------------
// The Envoy stages of one worker count.

/// The Envoy stages with `workers` workers, `--rounds` times (the stages taking turns), their
/// medians, and the hot key at its limit.
async fn envoy_stages(b: &Bench, workers: u32) -> (EnvoyRun, Vec<EnvoyRun>, AtLimit) {
    println!("\n== Envoy, {workers} worker(s)");
    print_header();
    let rounds = b.args.rounds.max(1);
    let mut measured = Vec::new();
    for round in 0..rounds {
        if rounds > 1 {
            println!("-- round {} of {rounds}", round + 1);
        }
        measured.push(envoy_round(b, workers).await);
    }
    let run = EnvoyRun::median(&measured);
    if rounds > 1 {
        println!("-- medians of {rounds} rounds, {workers} worker(s)");
        run.print();
    }
    println!("-- the hot key at its limit, {workers} worker(s)");
    let edge = at_limit_stage(b, workers).await;
    println!(
        "hot key at its limit: {} admitted, {} rejected, {} errors in {:.1} s; {:.4} callouts/request",
        edge.admitted, edge.rejected, edge.errors, edge.seconds, edge.callouts
    );
    (run, measured, edge)
}

/// One round of the Envoy stages: the baselines, the filter one callout per request and as
/// shipped for each workload, Envoy's native filter, and many keys again under load.
async fn envoy_round(b: &Bench, workers: u32) -> EnvoyRun {
    let c = b.args.concurrency;
    let wasm = Filter::Wasm(&b.wasm);
    let stage = |name: &str, filter, fast, workload| {
        b.envoy_stage(
            name.to_string(),
            b.envoy(filter, fast, workers),
            workload,
            c,
        )
    };
    let hot = Workload::HotKey;
    let (baseline, _) = stage("envoy, no filter (baseline)", Filter::None, true, hot).await;
    print(&baseline, None);
    let name = "envoy + a wasm filter that does nothing (floor)";
    let (noop, _) = stage(name, Filter::Noop, true, hot).await;
    print(&noop, Some(&baseline));
    let name = "envoy + local_ratelimit (per-Envoy, no shared budget)";
    let (local, _) = stage(name, Filter::LocalRateLimit, true, hot).await;
    print(&local, Some(&baseline));
    let mut wasm_stages = Vec::new();
    for workload in Workload::ALL {
        let name = format!("{}: filter, one callout per request", workload.name());
        let (slow, _) = stage(&name, wasm, false, workload).await;
        print(&slow, Some(&baseline));
        b.redis.cli(&["config", "resetstat"]);
        let name = format!("{}: filter as shipped (fast paths)", workload.name());
        let (fast, callouts) = stage(&name, wasm, true, workload).await;
        print(&fast, Some(&baseline));
        print_note(&format!("callouts per request: {callouts:.3}"));
        print_note(&redis_breakdown(&b.redis, &fast));
        wasm_stages.push((workload, slow, fast, callouts));
    }
    let mut extra = Vec::new();
    for workload in Workload::EXTRA {
        let name = format!("{}: filter as shipped (fast paths)", workload.name());
        let (r, callouts) = stage(&name, wasm, true, workload).await;
        print(&r, Some(&baseline));
        print_note(&format!("callouts per request: {callouts:.3}"));
        extra.push((workload, r, callouts));
    }
    let mut native = Vec::new();
    for workload in Workload::ALL {
        let name = format!("{}: Envoy's native ratelimit filter, gRPC", workload.name());
        let (r, _) = b.envoy_stage(name, b.native(workers), workload, c).await;
        print(&r, Some(&baseline));
        native.push((workload, r));
    }
    let mut rlqs = Vec::new();
    for workload in [Workload::ManyKeys, Workload::HotKey] {
        let name = format!("{}: Envoy's quota filter (RLQS)", workload.name());
        let (r, _) = b.envoy_stage(name, b.rlqs(workers), workload, c).await;
        print(&r, Some(&baseline));
        rlqs.push((workload, r));
    }
    let loaded = match b.args.loaded_concurrency {
        0 => None,
        _ => Some(loaded_stages(b, workers).await),
    };
    EnvoyRun {
        workers,
        baseline,
        noop,
        local,
        wasm: wasm_stages,
        native,
        rlqs,
        loaded,
        extra,
    }
}

/// `--rlqs-only`: Envoy alone, local_ratelimit, the wasm filter as shipped and Envoy's quota
/// filter over RLQS, on the hot key and many keys, each stage once; throughput and whole-stack
/// CPU per request (Envoy, sidecar and Redis).
async fn rlqs_comparison(b: &Bench, workers: u32) {
    println!("\n== RLQS against Envoy alone and the wasm filter, {workers} worker(s)");
    print_header();
    let c = b.args.concurrency;
    let hot = Workload::HotKey;
    let (baseline, _) = b
        .envoy_stage(
            "envoy, no filter (baseline)".into(),
            b.envoy(Filter::None, true, workers),
            hot,
            c,
        )
        .await;
    print(&baseline, None);
    let (local, _) = b
        .envoy_stage(
            "envoy + local_ratelimit (per-Envoy, no shared budget)".into(),
            b.envoy(Filter::LocalRateLimit, true, workers),
            hot,
            c,
        )
        .await;
    print(&local, Some(&baseline));
    for workload in [Workload::HotKey, Workload::ManyKeys] {
        let name = format!("{}: filter as shipped (fast paths)", workload.name());
        let (wasm, callouts) = b
            .envoy_stage(
                name,
                b.envoy(Filter::Wasm(&b.wasm), true, workers),
                workload,
                c,
            )
            .await;
        print(&wasm, Some(&baseline));
        print_note(&format!("callouts per request: {callouts:.3}"));
        let name = format!("{}: Envoy's quota filter (RLQS)", workload.name());
        let (rlqs, _) = b.envoy_stage(name, b.rlqs(workers), workload, c).await;
        print(&rlqs, Some(&baseline));
        println!(
            "[{workers} worker(s)] {}: RLQS {:.0}/s ({:.2}x Envoy alone, {:.2}x local_ratelimit, {:.2}x the wasm filter); whole-stack CPU per request: RLQS {:.1} µs, Envoy alone {:.1}, local_ratelimit {:.1}, wasm filter {:.1}",
            workload.name(),
            rlqs.per_second(),
            rlqs.per_second() / baseline.per_second(),
            rlqs.per_second() / local.per_second(),
            rlqs.per_second() / wasm.per_second(),
            rlqs.stack_cpu(),
            baseline.stack_cpu(),
            local.stack_cpu(),
            wasm.stack_cpu(),
        );
    }
}

/// Many keys again with `--loaded-concurrency` callers: the fast paths' batches grow with the
/// load.
async fn loaded_stages(b: &Bench, workers: u32) -> Loaded {
    let c = b.args.loaded_concurrency;
    let stage = |name: &str, filter, fast| {
        let name = format!("{c} callers, many keys: {name}");
        b.envoy_stage(name, b.envoy(filter, fast, workers), Workload::ManyKeys, c)
    };
    let wasm = Filter::Wasm(&b.wasm);
    let (baseline, _) = stage("no filter (baseline)", Filter::None, true).await;
    print(&baseline, None);
    let (noop, _) = stage("the no-op filter", Filter::Noop, true).await;
    print(&noop, Some(&baseline));
    let (slow, _) = stage("filter, one callout per request", wasm, false).await;
    print(&slow, Some(&baseline));
    b.redis.cli(&["config", "resetstat"]);
    let (fast, callouts) = stage("filter as shipped (fast paths)", wasm, true).await;
    print(&fast, Some(&baseline));
    print_note(&format!("callouts per request: {callouts:.3}"));
    print_note(&redis_breakdown(&b.redis, &fast));
    Loaded {
        concurrency: c,
        baseline,
        noop,
        slow,
        fast,
        callouts,
    }
}

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
        2.0 * max_lease_tokens(EDGE_CAPACITY)
    }
    fn over(&self) -> f64 {
        (self.admitted as f64 - self.exact_bound().floor()).max(0.0)
    }
    fn under(&self) -> f64 {
        (self.exact_bound() - self.admitted as f64).max(0.0)
    }
}

/// Runs the at-its-limit stage against a fresh Envoy: `--concurrency` callers as one client
/// (its address names the worker count, so every run has a bucket of its own), no warm-up (the
/// bucket is full at the first request), `--seconds` long. Every answer is counted: 200
/// admitted, 429 rejected, anything else an error.
async fn at_limit_stage(b: &Bench, workers: u32) -> AtLimit {
    let config = b.envoy(Filter::Wasm(&b.wasm), true, workers);
    let envoy = off_runtime(move || Envoy::start(&config)).await;
    let (http, url) = (b.http.clone(), envoy.url("/edge/x"));
    let address = format!("10.250.{}.{}", (workers >> 8) & 255, workers & 255);
    let headers = vec![("x-forwarded-for".to_string(), address)];
    let op = load::op(move |_| {
        let (http, url, headers) = (http.clone(), url.clone(), headers.clone());
        async move { load::get(&http, &url, &headers).await }
    });
    let start = Instant::now();
    let callers = Callers::new(0, b.args.concurrency, op).backoff(Duration::from_millis(1));
    let load = Load::spawn(vec![callers]);
    tokio::time::sleep(Duration::from_secs(b.args.seconds)).await;
    let samples = load.finish().await;
    // Every answer counted arrived before this: the bound's time covers all of them.
    let seconds = start.elapsed().as_secs_f64();
    let f = figures(&samples);
    AtLimit {
        admitted: f.admitted as u64,
        rejected: f.rejected as u64,
        errors: f.errors as u64,
        seconds,
        callouts: callouts_per_request(&envoy),
    }
}

// ---------------------------------------------------------------------------------------------
// A/B: two builds of the filter.

/// `--ab-filter`: one workload's stage of the shipped configuration, the current build (A) and
/// `other` (B) in turns after the no-op filter, `--rounds` times; then each build's medians.
async fn ab_filter(b: &Bench, other: &Path) {
    let (workload, workers) = (b.args.ab_workload, b.args.ab_workers);
    println!(
        "\n== A/B: {}, filter as shipped, {workers} worker(s): A = {}, B = {}{}",
        workload.name(),
        b.wasm.display(),
        other.display(),
        if b.args.ab_b_http2 {
            ", its callouts over HTTP/2"
        } else {
            ""
        }
    );
    print_header();
    // Per build: Envoy CPU above the no-op filter, sidecar and Redis CPU per request,
    // throughput relative to the no-op filter, callouts per request. The builds take turns going
    // first (a stage right after the no-op one finds every bucket expired in Redis).
    let mut figures: [Vec<[f64; 5]>; 2] = [Vec::new(), Vec::new()];
    // The floor admits everything: for a flood it is measured as the full run does, with the hot
    // key's requests (one key, answered 200).
    let floor_workload = match workload {
        Workload::Flood => Workload::HotKey,
        w => w,
    };
    let c = b.args.concurrency;
    for round in 0..b.args.rounds.max(1) {
        let name = format!("round {round}: no-op filter");
        let config = b.envoy(Filter::Noop, true, workers);
        let (floor, _) = b.envoy_stage(name, config, floor_workload, c).await;
        print(&floor, None);
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let (label, wasm) = [("A", b.wasm.as_path()), ("B", other)][i];
            let name = format!("round {round}: {label}");
            let mut config = b.envoy(Filter::Wasm(wasm), true, workers);
            if i == 1 && b.args.ab_b_http2 {
                config = config.replace(
                    "explicit_http_config: { http_protocol_options: {} }",
                    "explicit_http_config: { http2_protocol_options: {} }",
                );
            }
            let (r, callouts) = b.envoy_stage(name, config, workload, c).await;
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
    let median_of = |v: &[[f64; 5]], k: usize| median(v.iter().map(|f| f[k]));
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
}

// ---------------------------------------------------------------------------------------------
// The summary and the goals.

fn print_summary(b: &Bench, c: &Components, memory: &BucketMemory) {
    println!("\n== summary");
    println!(
        "Redis CPU per decision: {:.1} µs for a lone decision (single.lua), {:.1} µs for the long script with 1 decision per call, {:.1} µs with {} per call, {:.1} µs for INCR",
        c.single_one.cpu_per_decision("redis"),
        c.script_one.cpu_per_decision("redis"),
        c.script_batch.cpu_per_decision("redis"),
        b.args.batch,
        c.incr.cpu_per_decision("redis")
    );
    println!(
        "sidecar CPU per decision: {:.1} µs with 1 request per call, {:.1} µs with {} per call",
        c.decide_one.cpu_per_decision("sidecar"),
        c.decide_batch.cpu_per_decision("sidecar"),
        b.args.batch
    );
    for (label, name, one, batch) in [
        ("sidecar", "sidecar", &c.decide_one, &c.decide_batch),
        (
            "Redis (long script)",
            "redis",
            &c.script_one,
            &c.script_batch,
        ),
    ] {
        // One decision per call: its CPU per decision is its CPU per call.
        let Some(split) = PerCall::split(
            one.cpu_per_decision(name),
            batch.cpu_per_decision(name),
            b.args.batch,
        ) else {
            continue;
        };
        let needed = split
            .decisions_for(PER_DECISION_GOAL_US)
            .map_or("none: its marginal cost is above".to_string(), |n| {
                format!("{n:.0}")
            });
        println!(
            "{label} per call: {:.1} µs fixed + {:.1} µs per decision (from 1 and {} per call at {} caller(s)); decisions per call for {PER_DECISION_GOAL_US} µs per decision: {needed}",
            split.fixed, split.marginal, b.args.batch, b.args.concurrency
        );
    }
    println!(
        "Redis memory per bucket: {:.0} bytes (used_memory grew by that per bucket over {} buckets), {:.0} bytes by MEMORY USAGE ({} sampled); filter module {} KiB",
        memory.used_per_bucket,
        MEMORY_BUCKETS,
        memory.usage_per_bucket,
        memory.sampled,
        b.wasm_size / 1024
    );
}

/// The per-decision goal of the sidecar on many keys (the issue's 6 µs), for
/// [`PerCall::decisions_for`].
const PER_DECISION_GOAL_US: f64 = 6.0;

/// A process's CPU per call split in two, from a stage of one decision per call and one of `n`:
/// what every call costs whatever it carries (the HTTP or Redis round trip, the wake-ups) and
/// what each decision adds, so that `c(b) = fixed / b + marginal` per decision at `b` per call.
#[derive(Debug, Clone, Copy, PartialEq)]
struct PerCall {
    fixed: f64,
    marginal: f64,
}

impl PerCall {
    /// From `one` (µs per call of one decision) and `per_decision_at_n` (µs per decision with
    /// `n` per call); `None` without two distinct sizes.
    fn split(one: f64, per_decision_at_n: f64, n: usize) -> Option<PerCall> {
        if n < 2 {
            return None;
        }
        let marginal = ((per_decision_at_n * n as f64 - one) / (n as f64 - 1.0)).max(0.0);
        Some(PerCall {
            fixed: (one - marginal).max(0.0),
            marginal,
        })
    }

    /// The decisions per call at which the cost per decision falls to `goal` µs; `None` when
    /// the marginal cost alone is above it.
    fn decisions_for(&self, goal: f64) -> Option<f64> {
        (goal > self.marginal).then(|| (self.fixed / (goal - self.marginal)).ceil().max(1.0))
    }
}

/// The goal of "the decisions that must leave the gateway" for Envoy's CPU per request above
/// the no-op filter on many keys, for [`EnvoySplit::callouts_for`].
const GATEWAY_ENVOY_GOAL_US: f64 = 15.0;

/// Envoy's CPU per request above the no-op filter on many keys split in two, from the stage with
/// a callout per request and the filter as shipped at `c` callouts per request: what a request
/// costs whatever its callout carries, and what a callout adds, so that
/// `added(c) = per_request + c × per_callout`. An estimate: the per-request callout's path is not
/// the coalesced one (no queue, no hand-over between workers), so it says what fewer callouts
/// alone could reach.
#[derive(Debug, Clone, Copy, PartialEq)]
struct EnvoySplit {
    per_request: f64,
    per_callout: f64,
}

impl EnvoySplit {
    /// From `slow` (µs above the no-op filter with a callout per request) and `fast` (with
    /// `callouts` per request); `None` unless `callouts` is below 1.
    fn split(slow: f64, fast: f64, callouts: f64) -> Option<EnvoySplit> {
        if !(0.0..1.0).contains(&callouts) {
            return None;
        }
        let per_callout = ((slow - fast) / (1.0 - callouts)).max(0.0);
        Some(EnvoySplit {
            per_request: (fast - callouts * per_callout).max(0.0),
            per_callout,
        })
    }

    /// The most callouts per request at which Envoy's added CPU is `goal` µs; `None` when the
    /// per-request part alone is above it.
    fn callouts_for(&self, goal: f64) -> Option<f64> {
        if goal <= self.per_request {
            return None;
        }
        Some(if self.per_callout > 0.0 {
            ((goal - self.per_request) / self.per_callout).min(1.0)
        } else {
            1.0
        })
    }

    /// The line `make bench` prints for one stage.
    fn describe(&self, slow: f64, fast: f64, callouts: f64) -> String {
        let reach = match self.callouts_for(GATEWAY_ENVOY_GOAL_US) {
            Some(c) => format!(
                "at most {c:.3} callouts per request ({:.0} requests per callout)",
                1.0 / c.max(1e-9)
            ),
            None => "none: the per-request part alone is above it".to_string(),
        };
        format!(
            "{:.1} µs per request whatever its callout carries + {:.1} µs per callout (an estimate from {slow:.1} µs at 1 callout per request and {fast:.1} at {callouts:.3}); for {GATEWAY_ENVOY_GOAL_US} µs: {reach}",
            self.per_request, self.per_callout
        )
    }
}

/// Each worker count's goals, as ratios from this run, judged on the medians of its rounds.
fn print_goals(b: &Bench, c: &Components, runs: &[(EnvoyRun, Vec<EnvoyRun>, AtLimit)]) {
    println!(
        "\n== goals (ratios from this run: the medians of {} round(s) of the Envoy stages)",
        b.args.rounds.max(1)
    );
    let script_redis = c.script_one.cpu_per_decision("redis");
    let single = c.single_one.cpu_per_decision("redis");
    let incr = c.incr.cpu_per_decision("redis");
    println!(
        "lone-decision script (single.lua), 1 decision per call, Redis kept busy: {single:.1} µs of Redis per decision (goal <= {PER_DECISION_GOAL_US}: {}); INCR in the same run {incr:.1} µs ({:.2}x of it)",
        if single <= PER_DECISION_GOAL_US { "met" } else { "NOT met" },
        single / incr.max(1e-9)
    );
    for (run, rounds, edge) in runs {
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
            "[{w} worker(s)] many keys, Envoy CPU above the no-op filter: {added_fast:.1} µs/request vs {added_slow:.1} with a callout per request ({:.2} of it; {}; {} µs)",
            added_fast / added_slow.max(1e-9),
            verdict("envoy"),
            verdict("gateway envoy")
        );
        if let Some(split) = EnvoySplit::split(added_slow, added_fast, *many_callouts) {
            println!(
                "[{w} worker(s)] many keys, Envoy's added CPU split: {}",
                split.describe(added_slow, added_fast, *many_callouts)
            );
        }
        if w >= 2 {
            println!(
                "[{w} worker(s)] many keys: {:.2}x the no-op filter's throughput ({})",
                many.per_second() / run.noop.per_second(),
                verdict("gateway many")
            );
        }
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
            "[{w} worker(s)] many keys, sidecar CPU per decision: {sidecar_real:.1} µs ({}; {})",
            verdict("sidecar"),
            verdict("gateway sidecar")
        );
        println!(
            "[{w} worker(s)] many keys, Redis CPU per decision: {redis_real:.1} µs ({})",
            verdict("gateway redis")
        );
        for (wl, r, callouts) in &run.extra {
            println!(
                "[{w} worker(s)] {}: {:.2}x the no-op filter's throughput ({:.2}x many keys by address); Envoy CPU above the no-op filter {:.1} µs/request (many keys {added_fast:.1}); whole-stack CPU per request {:.1} µs, {:.2}x many keys'; sidecar {:.1} µs, Redis {:.1} µs per request; {callouts:.3} callouts/request",
                wl.name(),
                r.per_second() / run.noop.per_second(),
                r.per_second() / many.per_second(),
                r.cpu("envoy") - noop_envoy,
                r.stack_cpu(),
                r.stack_cpu() / many.stack_cpu().max(1e-9),
                r.cpu_per_decision("sidecar"),
                r.cpu_per_decision("redis"),
            );
        }
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
            if let Some(split) = EnvoySplit::split(added_slow, added_fast, l.callouts) {
                println!(
                    "[{w} worker(s), {c} callers] many keys, Envoy's added CPU split: {}",
                    split.describe(added_slow, added_fast, l.callouts)
                );
            }
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
        for (wl, rlqs) in &run.rlqs {
            let (_, _, fast, _) = find(*wl);
            println!(
                "[{w} worker(s)] {}: Envoy's quota filter (RLQS): {:.2}x the baseline's throughput, {:.2}x local_ratelimit's; whole-stack CPU per request {:.1} µs vs {:.1} for Envoy alone, {:.1} for local_ratelimit, {:.1} for the wasm filter as shipped",
                wl.name(),
                rlqs.per_second() / run.baseline.per_second(),
                rlqs.per_second() / run.local.per_second(),
                rlqs.stack_cpu(),
                run.baseline.stack_cpu(),
                run.local.stack_cpu(),
                fast.stack_cpu(),
            );
        }
        println!(
            "[{w} worker(s)] hot key at its limit ({EDGE_CAPACITY} + {EDGE_REFILL}/s, {} callers as one client, {:.1} s): {} admitted, exact bound C + r·T = {:.0}: over-admission {:.0} (goal 0: {}); under-admission {:.0} tokens ({:.1}% of the bound; leases withhold at most 2·L = {:.0} per Envoy, plus {} errors), {:.4} callouts/request",
            b.args.concurrency,
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
    /// (workload, Envoy's quota filter with the sidecar as its RLQS server)
    rlqs: Vec<(Workload, StageResult)>,
    /// The many-keys stages under load.
    loaded: Option<Loaded>,
    /// (workload, the filter as shipped, callouts per request) for the workloads measured
    /// beside the goals' ([`Workload::EXTRA`]).
    extra: Vec<(Workload, StageResult, f64)>,
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

/// One stage measured in several rounds, as one: the median of each figure (throughput,
/// latencies, each process's CPU) over the rounds.
fn median_stage(rounds: &[&StageResult]) -> StageResult {
    let first = rounds[0];
    let of = |f: &dyn Fn(&StageResult) -> f64| median(rounds.iter().map(|r| f(r)));
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
            .map(|(name, _)| (name.clone(), of(&|r| r.cpu(name))))
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
                    median(rounds.iter().map(|r| r.wasm[i].3)),
                )
            })
            .collect();
        let native = (0..first.native.len())
            .map(|i| (first.native[i].0, stage(&|r| &r.native[i].1)))
            .collect();
        let rlqs = (0..first.rlqs.len())
            .map(|i| (first.rlqs[i].0, stage(&|r| &r.rlqs[i].1)))
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
                    callouts: median(l.iter().map(|x| x.callouts)),
                }
            });
        let extra = (0..first.extra.len())
            .map(|i| {
                (
                    first.extra[i].0,
                    stage(&|r| &r.extra[i].1),
                    median(rounds.iter().map(|r| r.extra[i].2)),
                )
            })
            .collect();
        EnvoyRun {
            workers: first.workers,
            baseline: stage(&|r| &r.baseline),
            noop: stage(&|r| &r.noop),
            local: stage(&|r| &r.local),
            wasm,
            native,
            rlqs,
            loaded,
            extra,
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
            print_note(&format!("callouts per request: {callouts:.3}"));
        }
        for (_, r) in &self.native {
            print(r, Some(&self.baseline));
        }
        for (_, r) in &self.rlqs {
            print(r, Some(&self.baseline));
        }
        for (_, r, callouts) in &self.extra {
            print(r, Some(&self.baseline));
            print_note(&format!("callouts per request: {callouts:.3}"));
        }
        if let Some(l) = &self.loaded {
            print(&l.baseline, None);
            print(&l.noop, Some(&l.baseline));
            print(&l.slow, Some(&l.baseline));
            print(&l.fast, Some(&l.baseline));
            print_note(&format!("callouts per request: {:.3}", l.callouts));
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
    // The goals of "the decisions that must leave the gateway", on many keys at the light load.
    let added = many.cpu("envoy") - run.noop.cpu("envoy");
    add(
        "gateway envoy",
        "many keys: Envoy µs above the no-op",
        "<= 15",
        format!("{added:.1}"),
        added <= GATEWAY_ENVOY_GOAL_US,
    );
    if run.workers >= 2 {
        let r = many.per_second() / run.noop.per_second();
        add(
            "gateway many",
            "many keys vs the no-op filter",
            ">= 0.8",
            format!("{r:.2}x"),
            r >= 0.8,
        );
    }
    let sidecar = many.cpu_per_decision("sidecar");
    add(
        "gateway sidecar",
        "many keys: sidecar µs per decision",
        "<= 6",
        format!("{sidecar:.1}"),
        sidecar <= PER_DECISION_GOAL_US,
    );
    let redis = many.cpu_per_decision("redis");
    add(
        "gateway redis",
        "many keys: Redis µs per decision",
        "<= 5",
        format!("{redis:.1}"),
        redis <= 5.0,
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_splits_into_what_it_costs_and_what_each_decision_adds() {
        // 80 µs for a call of one decision, 9 µs per decision with 11 per call (99 µs a call):
        // 1.9 µs per further decision, 78.1 fixed; 6 µs per decision at 20 per call.
        let s = PerCall::split(80.0, 9.0, 11).unwrap();
        assert!((s.marginal - 1.9).abs() < 1e-9 && (s.fixed - 78.1).abs() < 1e-9);
        assert_eq!(s.decisions_for(6.0), Some(20.0));
        assert_eq!(s.decisions_for(1.5), None);
        assert_eq!(PerCall::split(80.0, 9.0, 1), None);
    }

    #[test]
    fn envoys_added_cpu_splits_into_a_part_per_request_and_one_per_callout() {
        // 90 µs with a callout per request, 27 at 0.1: 70 per callout, 20 per request, so
        // 15 µs is out of reach by fewer callouts.
        let s = EnvoySplit::split(90.0, 27.0, 0.1).unwrap();
        assert!((s.per_callout - 70.0).abs() < 1e-9 && (s.per_request - 20.0).abs() < 1e-9);
        assert_eq!(s.callouts_for(15.0), None);
        // 5 per request: 15 µs at 1 callout per 7 requests.
        let s = EnvoySplit::split(75.0, 12.0, 0.1).unwrap();
        assert!((s.per_request - 5.0).abs() < 1e-9);
        assert!((s.callouts_for(15.0).unwrap() - 1.0 / 7.0).abs() < 1e-9);
        assert!(s
            .describe(75.0, 12.0, 0.1)
            .contains("7 requests per callout"));
        assert_eq!(EnvoySplit::split(90.0, 27.0, 1.0), None);
    }

    /// A stage of `ops` operations in one second, with this CPU per operation by process.
    fn stage(ops: u64, cpu: &[(&str, f64)]) -> StageResult {
        StageResult {
            name: String::new(),
            ops,
            per_op: 1,
            seconds: 1.0,
            p50: Duration::ZERO,
            p99: Duration::ZERO,
            cpu_us_per_op: cpu.iter().map(|(n, v)| (n.to_string(), *v)).collect(),
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
            rlqs: Vec::new(),
            extra: Vec::new(),
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
        // The gateway's goals: Envoy 10 µs above the no-op filter (<= 15), the sidecar 9 µs per
        // decision (> 6), Redis 4 (<= 5); the throughput goal only with two workers.
        assert!(verdict(&js, "gateway envoy"));
        assert!(!verdict(
            &judge(&run(850, 66.0, false), 12.0),
            "gateway envoy"
        ));
        assert!(!verdict(&js, "gateway sidecar"));
        assert!(verdict(&js, "gateway redis"));
        assert!(js.iter().all(|j| j.key != "gateway many"));
        let mut two = run(850, 60.0, false);
        two.workers = 2;
        assert!(
            !verdict(&judge(&two, 12.0), "gateway many"),
            "0.5x is not 0.8x"
        );
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
