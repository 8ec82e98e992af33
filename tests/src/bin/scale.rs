//! `make scale`: how the decision path scales over Redis Cluster shards, measured with real
//! processes, and the shard model for a target load computed from this run's own figures
//! (docs/scaling.md explains every figure and the formula).
//!
//! 1. Shards: the sidecar's `POST /v1/decide` (and Envoy with the filter in front of it) against a
//!    Redis Cluster of 1, 2 and 3 primaries, for uniform keys and Zipf-skewed keys: decisions/s,
//!    Redis CPU per decision per shard (from `/proc/<pid>/stat` of each redis-server), the spread
//!    of keys (`DBSIZE`) and of load (decisions, CPU) across shards, the sidecar's CPU per
//!    decision; a primary with a replica, for what replication costs.
//! 2. A hot key (one bucket, so one shard): its shard's load per admitted request through the
//!    sidecar alone, and through Envoy with leases off and on.
//! 3. Latency with real hops: the gateway (this load generator), the sidecar and Redis in three
//!    network namespaces joined by veth pairs, a delay on one hop at a time (`tc netem`, or a
//!    userspace delay relay where the kernel has no netem), p50/p95/p99 of a decision.
//! 4. The model: Redis primaries, replicas and sidecar cores for the target decisions/s at the
//!    target utilisation, uniform and Zipf, from the figures above.
//!
//! Every stage runs against processes on this machine, which the load generator shares: read CPU
//! per decision (a cost, whatever the core count) and the ratios against the baseline of the same
//! run, not the absolute throughput. Nothing is asserted about timing.

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use ratelimit_e2e::load::{self, mix, ClosedLoop, Measured, Op, Warmup};
use ratelimit_e2e::netns::{self, DelayRelay, Netns};
use ratelimit_e2e::plugin::{lease_ask, lease_defaults, rule, Plugin};
use ratelimit_e2e::probe::{self, Watched};
use ratelimit_e2e::redis::even_slot_ranges;
use ratelimit_e2e::report::{quantile, short, Table};
use ratelimit_e2e::utilisation::{self, AtLoad, Work};
use ratelimit_e2e::{
    wait_until, Envoy, EnvoyConfig, Process, Redis, RedisCluster, RedisOptions, Sidecar, Upstream,
    READY_TIMEOUT,
};
use serde_json::json;

#[derive(Parser)]
#[command(
    about = "Measures the decision path over Redis Cluster shards, a hot key, network hops, and prints the shard model"
)]
struct Args {
    /// Seconds each throughput stage (parts 1 and 2) measures, after 1 s of warm-up.
    #[arg(long, default_value_t = 8.0)]
    seconds: f64,
    /// Seconds each latency stage (part 3) measures, after 0.5 s of warm-up.
    #[arg(long, default_value_t = 5.0)]
    latency_seconds: f64,
    /// Concurrent callers in the throughput stages (a closed loop).
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Gateway requests per `POST /v1/decide` call (one decision each) in the sidecar stages.
    #[arg(long, default_value_t = 1)]
    requests_per_call: usize,
    /// Distinct keys (clients) of the uniform and the Zipf workloads.
    #[arg(long, default_value_t = 100_000)]
    keys: usize,
    /// The Zipf exponent s: the key of rank k is drawn with weight 1/k^s.
    #[arg(long, default_value_t = 1.0)]
    zipf_s: f64,
    /// Cluster sizes to measure, comma separated; the first is the baseline.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    primaries: Vec<usize>,
    /// Parts to run, comma separated (4, the model, is always printed from what ran).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,5")]
    parts: Vec<u8>,
    /// Part 5: connections holding Redis at `--utilisation` (one call in flight each).
    #[arg(long, default_value_t = 32)]
    load_connections: usize,
    /// Part 5: rounds, the script and INCR taking turns.
    #[arg(long, default_value_t = 3)]
    load_rounds: usize,
    /// Skip the stages through Envoy in part 1 (part 2 always goes through Envoy).
    #[arg(long)]
    skip_envoy: bool,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 1)]
    envoy_workers: u32,
    /// Decisions per second the latency stages send (an open loop: paced, whatever the answers).
    #[arg(long, default_value_t = 1000.0)]
    latency_rate: f64,
    /// Round trips to add to one hop at a time, in milliseconds.
    #[arg(long, value_delimiter = ',', default_value = "0.2,1,5")]
    rtt_ms: Vec<f64>,
    /// How a hop's delay is made: `netem` (tc qdisc), `relay` (a userspace delay relay), or
    /// `auto` (netem when the kernel has it).
    #[arg(long, default_value = "auto", value_parser = ["auto", "netem", "relay"])]
    delay: String,
    /// The sidecars' `--redis-pipeline` (script calls in flight per Redis node); the sidecar's
    /// default when not given.
    #[arg(long)]
    redis_pipeline: Option<u64>,
    /// Part 3 also measures the sidecar-Redis hop with a sidecar started with this
    /// `--redis-pipeline` (0: not), to show what calls in flight do for a distant Redis.
    #[arg(long, default_value_t = 16)]
    alt_pipeline: u64,
    /// Model: decisions per second to plan for.
    #[arg(long, default_value_t = 1_000_000.0)]
    target: f64,
    /// Model: the busiest a Redis primary or sidecar core may be at the target load (0.5 keeps
    /// 50% headroom).
    #[arg(long, default_value_t = 0.5)]
    utilisation: f64,
    /// Model: replicas per primary.
    #[arg(long, default_value_t = 1)]
    replicas_per_primary: usize,
    /// Model: decisions per script call the fleet's calls carry. Batches form only while a
    /// sidecar has calls in flight to a node, and a large fleet splits its load over many
    /// (sidecar, primary) pairs, each carrying a few hundred decisions/s: about 1.
    #[arg(long, default_value_t = 1.0)]
    fleet_batch: f64,
    /// Model: gateways (Envoys) sharing the load, which decides which keys are busy enough at one
    /// gateway to be leased.
    #[arg(long, default_value_t = 100)]
    gateways: usize,
}

// ---------------------------------------------------------------------------------------------
// Interruption: a first Ctrl-C (or SIGTERM) ends the current stage and unwinds (every process
// killed, every namespace deleted by its Drop); a second one removes the namespaces and exits.

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

fn watch_signals() {
    std::thread::spawn(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("signal runtime");
        rt.block_on(async {
            use tokio::signal::unix::{signal, SignalKind};
            let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
            loop {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
                if INTERRUPTED.swap(true, Ordering::SeqCst) {
                    netns::remove_all();
                    std::process::exit(130);
                }
                eprintln!("\ninterrupted: stopping and cleaning up (again to exit at once)");
            }
        });
    });
}

fn check_interrupted() {
    if INTERRUPTED.load(Ordering::SeqCst) {
        std::panic::resume_unwind(Box::new("interrupted"));
    }
}

// ---------------------------------------------------------------------------------------------
// The machine.

fn first_line(cmd: &str, args: &[&str]) -> String {
    std::process::Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .map(|o| {
            let s = String::from_utf8_lossy(&o.stdout).to_string();
            s.lines()
                .map(str::trim)
                .find(|l| !l.is_empty())
                .unwrap_or("")
                .to_string()
        })
        .unwrap_or_else(|| "unknown".into())
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn describe_machine() {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let cpu_model = probe::cpu_model();
    let redis = first_line("redis-server", &["--version"]);
    let envoy = Envoy::bin();
    let envoy = first_line(&envoy.display().to_string(), &["--version"]);
    println!("== machine");
    println!(
        "nproc {cores}, {cpu_model}, kernel {}",
        first_line("uname", &["-r"])
    );
    println!("{redis}");
    println!(
        "envoy {}",
        envoy
            .trim_start_matches(|c| c != ':')
            .trim_start_matches(':')
            .trim()
    );
    println!("load average at start: {}", load_average());
}

// ---------------------------------------------------------------------------------------------
// Keys: names, Cluster slots, and how the workloads draw them.

/// The Cluster slot of a hash tag (CRC16/XMODEM modulo 16384), as Redis computes it.
fn slot(tag: &str) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(tag.as_bytes()) % 16384
}

/// The subject value of key `i` for the sidecar stages (`id`), and its bucket's hash tag.
fn key_id(i: usize) -> String {
    format!("k{i}")
}

/// The client address of key `i` for the Envoy stages (sent as `X-Forwarded-For`).
fn key_ip(i: usize) -> String {
    format!("10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255)
}

/// The hash tag of a bucket, as the sidecar names it (`rl:{<domain>|rule=<rule>|<dim>=<v>}`;
/// the values used here need no escaping).
fn tag(rule: &str, dim: Option<(&str, &str)>) -> String {
    match dim {
        Some((d, v)) => format!("ratelimit|rule={rule}|{d}={v}"),
        None => format!("ratelimit|rule={rule}"),
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Dist {
    Uniform,
    Zipf,
}

/// The keyspace: `n` keys, their slots for both paths, and the Zipf weights (rank `i + 1` is
/// key `i`).
struct Keyspace {
    n: usize,
    s: f64,
    zipf_cdf: Vec<f64>,
    zipf_weights: Vec<f64>,
    slot_id: Vec<u16>,
    slot_ip: Vec<u16>,
}

impl Keyspace {
    fn new(n: usize, s: f64) -> Keyspace {
        let raw: Vec<f64> = (1..=n).map(|k| (k as f64).powf(-s)).collect();
        let h: f64 = raw.iter().sum();
        let zipf_weights: Vec<f64> = raw.iter().map(|w| w / h).collect();
        let mut acc = 0.0;
        let zipf_cdf = zipf_weights
            .iter()
            .map(|w| {
                acc += w;
                acc
            })
            .collect();
        Keyspace {
            n,
            s,
            zipf_cdf,
            zipf_weights,
            slot_id: (0..n)
                .map(|i| slot(&tag("scale", Some(("id", &key_id(i))))))
                .collect(),
            slot_ip: (0..n)
                .map(|i| slot(&tag("scale-ip", Some(("ip", &key_ip(i))))))
                .collect(),
        }
    }

    /// A key drawn from `dist` with the random bits `r`.
    fn pick(&self, dist: Dist, r: u64) -> usize {
        match dist {
            Dist::Uniform => (r % self.n as u64) as usize,
            Dist::Zipf => {
                let u = (r >> 11) as f64 / (1u64 << 53) as f64;
                self.zipf_cdf.partition_point(|c| *c < u).min(self.n - 1)
            }
        }
    }

    fn weights(&self, dist: Dist) -> Vec<f64> {
        match dist {
            Dist::Uniform => vec![1.0 / self.n as f64; self.n],
            Dist::Zipf => self.zipf_weights.clone(),
        }
    }

    fn name(&self, dist: Dist) -> String {
        match dist {
            Dist::Uniform => format!("uniform over {} keys", self.n),
            Dist::Zipf => format!("Zipf s={} over {} keys", self.s, self.n),
        }
    }
}

/// The share of decisions on each of `p` primaries holding even slot ranges, for key weights
/// `weights` whose slots are `slots`.
fn shard_shares(weights: &[f64], slots: &[u16], p: usize) -> Vec<f64> {
    let mut by_slot = vec![0.0; 16384];
    for (w, s) in weights.iter().zip(slots) {
        by_slot[*s as usize] += w;
    }
    shares_from_slots(&by_slot, p)
}

fn shares_from_slots(by_slot: &[f64], p: usize) -> Vec<f64> {
    even_slot_ranges(p)
        .into_iter()
        .map(|(a, b)| by_slot[a as usize..=b as usize].iter().sum())
        .collect()
}

fn node_of_slot(p: usize) -> Vec<u8> {
    let mut owner = vec![0u8; 16384];
    for (i, (a, b)) in even_slot_ranges(p).into_iter().enumerate() {
        for s in a..=b {
            owner[s as usize] = i as u8;
        }
    }
    owner
}

// ---------------------------------------------------------------------------------------------
// Processes of this program's own: the sidecar with the scale policy, on any address, in any
// namespace.

/// The policy of every stage: buckets so large and slow that nothing is ever rejected and every
/// bucket touched stays in Redis for the rest of its stage (a token takes 1000 s to come back),
/// so `DBSIZE` counts the keys a stage touched. The sidecar is started with a
/// `--max-refill-seconds` that allows it.
const POLICY: &str = "rules:
  scale: {capacity: 999999999999, refill_per_sec: 0.001}
  scale-ip: {capacity: 999999999999, refill_per_sec: 0.001}
  hot: {capacity: 999999999999, refill_per_sec: 0.001}
";

struct Workdir {
    dir: tempfile::TempDir,
    policy: PathBuf,
}

impl Workdir {
    fn new() -> Workdir {
        let dir = tempfile::tempdir().expect("temp dir");
        let policy = dir.path().join("limits.yaml");
        std::fs::write(&policy, POLICY).expect("write the policy");
        Workdir { dir, policy }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// Starts the sidecar binary listening on `listen` (inside `ns` if given) with `redis` flags
/// and waits for its `/readyz`.
fn start_sidecar(
    args: &Args,
    work: &Workdir,
    ns: Option<&Netns>,
    listen: SocketAddr,
    redis: &[&str],
    name: &str,
) -> Process {
    let bin = Sidecar::bin();
    let mut cmd = match ns {
        Some(ns) => ns.command(&bin),
        None => std::process::Command::new(&bin),
    };
    cmd.args(["--listen", &listen.to_string(), "--limits"])
        .arg(&work.policy)
        .args(["--max-refill-seconds", "1e16"])
        // The 5 ms round trips of part 3 would not fit the default 30 ms with queueing: one
        // bound for every stage, so they compare.
        .args(["--redis-timeout-ms", "1000"])
        .args(redis)
        .env("RUST_LOG", "warn");
    if let Some(n) = args
        .redis_pipeline
        .filter(|_| !redis.contains(&"--redis-pipeline"))
    {
        cmd.args(["--redis-pipeline", &n.to_string()]);
    }
    if !listen.ip().is_loopback() {
        cmd.arg("--allow-unauthenticated");
    }
    let mut process = Process::spawn(name, cmd, work.path());
    let ready = || probe::http_get(listen, "/readyz").is_some_and(|(status, _)| status == 200);
    let mut check = || {
        assert!(process.running(), "{name} exited:\n{}", process.log());
        match ns {
            Some(ns) => ns.run(ready),
            None => ready(),
        }
    };
    wait_until(&format!("{name} /readyz"), READY_TIMEOUT, &mut check);
    process
}

// ---------------------------------------------------------------------------------------------
// A throughput stage: concurrent callers in a closed loop, measured after a warm-up.

/// Units (decisions, requests) attributed to each Cluster node by the ops themselves.
type NodeCounts = Arc<Vec<AtomicU64>>;

fn node_counts(n: usize) -> NodeCounts {
    Arc::new((0..n).map(|_| AtomicU64::new(0)).collect())
}

/// What a throughput stage measured, and the units its ops attributed to each node.
struct Stage {
    m: Measured,
    per_node: Vec<u64>,
}

/// `--concurrency` callers of `op` for 1 s of warm-up, then `--seconds` measured; `probe`'s
/// counters (script calls, metrics) and `counts` read as the window opens and closes.
fn throughput(
    args: &Args,
    rt: &tokio::runtime::Runtime,
    name: &str,
    watched: &[Watched],
    counts: &NodeCounts,
    probe: &(dyn Fn() -> Vec<f64> + Sync),
    op: Op<Result<(), String>>,
) -> Stage {
    let with_counts = || {
        let mut v: Vec<f64> = counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed) as f64)
            .collect();
        v.extend(probe());
        v
    };
    let mut m = rt.block_on(
        ClosedLoop {
            name,
            callers: args.concurrency,
            warmup: Warmup::Together(Duration::from_secs(1)),
            seconds: args.seconds,
            watched,
            probe: Some(&with_counts),
            interrupted: Some(&INTERRUPTED),
        }
        .measure(op),
    );
    check_interrupted();
    let per_node = m.probed.drain(..counts.len()).map(|v| v as u64).collect();
    Stage { m, per_node }
}

/// The client of every throughput stage.
fn http_client(args: &Args) -> reqwest::Client {
    load::http_client(args.concurrency * 2, Duration::from_secs(10))
}

/// `POST /v1/decide` with `per_call` requests of one decision each, on keys drawn from `dist`
/// (rule `scale`) or on the hot key (rule `hot`, `dist` None); counts each decision on its node.
fn decide_op(
    http: reqwest::Client,
    url: String,
    keys: Arc<Keyspace>,
    dist: Option<Dist>,
    per_call: usize,
    owner: Arc<Vec<u8>>,
    counts: NodeCounts,
) -> Op<Result<(), String>> {
    let hot_node = owner[slot(&tag("hot", None)) as usize];
    load::op(move |call| {
        let r = call.random();
        let (http, url, keys, owner, counts) = (
            http.clone(),
            url.clone(),
            keys.clone(),
            owner.clone(),
            counts.clone(),
        );
        async move {
            let mut body = String::from("{\"requests\":[");
            let mut nodes = Vec::with_capacity(per_call);
            for j in 0..per_call {
                if j > 0 {
                    body.push(',');
                }
                match dist {
                    Some(dist) => {
                        let k = keys.pick(dist, mix(r ^ ((j as u64) << 48)));
                        nodes.push(owner[keys.slot_id[k] as usize]);
                        body.push_str(&format!(
                            "{{\"decisions\":[{{\"rule\":\"scale\",\"subject\":{{\"id\":\"{}\"}}}}]}}",
                            key_id(k)
                        ));
                    }
                    None => {
                        nodes.push(hot_node);
                        body.push_str("{\"decisions\":[{\"rule\":\"hot\"}]}");
                    }
                }
            }
            body.push_str("]}");
            let resp = http
                .post(&url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            let status = resp.status().as_u16();
            let text = resp.text().await.map_err(|e| e.to_string())?;
            if status != 200 || text.contains("\"allowed\":false") {
                return Err(format!("status {status}: {text}"));
            }
            for n in nodes {
                counts[n as usize].fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        }
    })
}

/// `GET` through Envoy: `/k/x` from the client address of a key drawn from `dist` (rule
/// `scale-ip`), or `/hot/x` (rule `hot`, `dist` None); counts each request on its key's node.
fn envoy_op(
    http: reqwest::Client,
    base: String,
    keys: Arc<Keyspace>,
    dist: Option<Dist>,
    owner: Arc<Vec<u8>>,
    counts: NodeCounts,
) -> Op<Result<(), String>> {
    let hot_node = owner[slot(&tag("hot", None)) as usize];
    load::op(move |call| {
        let r = call.random();
        let (http, base, keys, owner, counts) = (
            http.clone(),
            base.clone(),
            keys.clone(),
            owner.clone(),
            counts.clone(),
        );
        async move {
            let (req, node) = match dist {
                Some(dist) => {
                    let k = keys.pick(dist, r);
                    (
                        http.get(format!("{base}/k/x"))
                            .header("x-forwarded-for", key_ip(k)),
                        owner[keys.slot_ip[k] as usize],
                    )
                }
                None => (http.get(format!("{base}/hot/x")), hot_node),
            };
            let resp = req.send().await.map_err(|e| e.to_string())?;
            let status = resp.status().as_u16();
            resp.bytes().await.map_err(|e| e.to_string())?;
            if status != 200 {
                return Err(format!("status {status}"));
            }
            counts[node as usize].fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Envoy with the filter in front of the sidecar.

/// The filter's rules for the Envoy stages; `leases` off keeps every other fast path on.
fn plugin(leases: bool) -> String {
    let plugin = Plugin::by_address(json!([
        rule("scale-ip", "/k/", &["ip"], "deny"),
        rule("hot", "/hot/", &[], "deny")
    ]));
    match leases {
        true => plugin.to_string(),
        false => plugin.leases(false).to_string(),
    }
}

/// The shipped `envoy/envoy.yaml` with the scale rules, the client address taken from
/// `X-Forwarded-For` (the stages tell their clients apart by it; an edge Envoy must not).
fn start_envoy(sidecar_port: u16, upstream_port: u16, workers: u32, leases: bool) -> Envoy {
    let config = EnvoyConfig::shipped("envoy.yaml", sidecar_port, upstream_port)
        .plugin(&plugin(leases))
        .concurrency(workers)
        .replace("use_remote_address: true", "use_remote_address: false");
    Envoy::start(&config)
}

// ---------------------------------------------------------------------------------------------
// Part 1: shards.

/// One stage of part 1 and what the nodes held after it.
struct ShardStage {
    path: &'static str,
    dist: Dist,
    primaries: usize,
    replica: bool,
    m: Measured,
    /// Decisions (sidecar path) or requests (Envoy path) the load generator sent per node.
    per_node: Vec<u64>,
    /// Keys each node held after the stage (`DBSIZE`).
    keys_per_node: Vec<u64>,
    /// Decisions that reached the sidecar (its metric), for the Envoy path.
    sidecar_decisions: f64,
    /// Script calls per node.
    calls_per_node: Vec<u64>,
    /// µs each node spent inside script calls (its `INFO commandstats`).
    script_us_per_node: Vec<f64>,
    predicted_shares: Vec<f64>,
}

impl ShardStage {
    fn decisions(&self) -> f64 {
        if self.path == "sidecar" {
            self.m.ops as f64 * self.per_call() as f64
        } else {
            self.sidecar_decisions
        }
    }

    fn per_call(&self) -> usize {
        let total: u64 = self.per_node.iter().sum();
        (total as f64 / self.m.ops.max(1) as f64).round().max(1.0) as usize
    }

    fn node_cpu(&self, i: usize) -> f64 {
        self.m.cpu.of(&format!("redis-{i}"))
    }

    fn redis_cpu(&self) -> f64 {
        (0..self.primaries).map(|i| self.node_cpu(i)).sum()
    }

    /// Redis CPU µs per decision, all primaries together.
    fn redis_us(&self) -> f64 {
        self.redis_cpu() * 1e6 / self.decisions().max(1.0)
    }

    fn sidecar_us(&self) -> f64 {
        self.m.cpu.of("sidecar") * 1e6 / self.decisions().max(1.0)
    }

    /// The node with the most units, and its share of units, CPU and keys.
    fn hottest(&self) -> (usize, f64, f64, f64) {
        let total: u64 = self.per_node.iter().sum();
        let (i, most) = self
            .per_node
            .iter()
            .enumerate()
            .max_by_key(|(_, v)| **v)
            .map(|(i, v)| (i, *v))
            .unwrap_or((0, 0));
        let cpu = self.node_cpu(i) / self.redis_cpu().max(1e-9);
        let keys_total: u64 = self.keys_per_node.iter().sum();
        let keys =
            self.keys_per_node.get(i).copied().unwrap_or(0) as f64 / keys_total.max(1) as f64;
        (i, most as f64 / total.max(1) as f64, cpu, keys)
    }
}

/// The nodes' pids as watched processes `redis-0`, `redis-1`, ...
fn cluster_watch(cluster: &RedisCluster) -> Vec<Watched> {
    cluster
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| Watched::new(format!("redis-{i}"), n.pid()))
        .collect()
}

fn flush(cluster: &RedisCluster) {
    for n in &cluster.nodes {
        n.cli(&["FLUSHALL"]);
    }
}

/// A cluster-enabled node that becomes a replica of node 0 of `cluster`.
fn add_replica(cluster: &RedisCluster) -> Redis {
    let options = RedisOptions::default().args(&[
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-node-timeout",
        "5000",
    ]);
    let replica = Redis::start_with_options(&options);
    let primary = &cluster.nodes[0];
    let primary_id = primary.cli(&["CLUSTER", "MYID"]);
    replica.cli(&["CLUSTER", "MEET", "127.0.0.1", &primary.port.to_string()]);
    wait_until("the replica to know its primary", READY_TIMEOUT, || {
        replica.cli(&["CLUSTER", "NODES"]).contains(&primary_id)
    });
    let out = replica.cli(&["CLUSTER", "REPLICATE", &primary_id]);
    assert_eq!(out, "OK", "CLUSTER REPLICATE: {out}");
    wait_until("the replica's link up", READY_TIMEOUT, || {
        replica
            .cli(&["INFO", "replication"])
            .contains("master_link_status:up")
    });
    replica
}

struct Part1 {
    stages: Vec<ShardStage>,
    /// The last cluster and its sidecar, kept for part 2.
    kept: Option<(RedisCluster, Process, u16)>,
}

fn run_part1(
    args: &Args,
    rt: &tokio::runtime::Runtime,
    work: &Workdir,
    keys: &Arc<Keyspace>,
    upstream: &Upstream,
) -> Part1 {
    let mut stages = Vec::new();
    let mut kept = None;
    let http = http_client(args);
    for (index, &p) in args.primaries.iter().enumerate() {
        println!(
            "  starting a Cluster of {p} primar{}",
            if p == 1 { "y" } else { "ies" }
        );
        let cluster = RedisCluster::start_primaries(p);
        // The slots computed here are the server's.
        for i in [0, 1, keys.n - 1] {
            let key = format!("rl:{{{}}}", tag("scale", Some(("id", &key_id(i)))));
            let server: u16 = cluster.nodes[0]
                .cli(&["CLUSTER", "KEYSLOT", &key])
                .parse()
                .unwrap_or(u16::MAX);
            assert_eq!(server, keys.slot_id[i], "slot of {key}");
        }
        let sidecar_port = ratelimit_e2e::free_port();
        let sidecar_addr: SocketAddr = ([127, 0, 0, 1], sidecar_port).into();
        let sidecar = start_sidecar(
            args,
            work,
            None,
            sidecar_addr,
            &["--redis-cluster", &cluster.seeds()],
            &format!("sidecar-{p}p"),
        );
        let decide_url = format!("http://{sidecar_addr}/v1/decide");
        let owner = Arc::new(node_of_slot(p));
        let mut watch = cluster_watch(&cluster);
        watch.push(Watched::new("sidecar", sidecar.pid()));
        // Per stage: each node's script calls, the decisions the sidecar answered, then each
        // node's µs inside scripts.
        let probe = || -> Vec<f64> {
            let stats: Vec<_> = cluster.nodes.iter().map(probe::script_calls).collect();
            let mut v: Vec<f64> = stats.iter().map(|s| s.calls).collect();
            v.push(probe::sidecar_metric(
                sidecar_addr,
                "ratelimit_decisions_total",
            ));
            v.extend(stats.iter().map(|s| s.usec));
            v
        };
        let shard_stage = |path, dist, replica, stage: Stage, slots: &[u16]| ShardStage {
            path,
            dist,
            primaries: p,
            replica,
            per_node: stage.per_node,
            keys_per_node: cluster.nodes.iter().map(probe::dbsize).collect(),
            calls_per_node: stage.m.probed[..p].iter().map(|c| *c as u64).collect(),
            sidecar_decisions: stage.m.probed[p],
            script_us_per_node: stage.m.probed[p + 1..].to_vec(),
            predicted_shares: shard_shares(&keys.weights(dist), slots, p),
            m: stage.m,
        };
        for dist in [Dist::Uniform, Dist::Zipf] {
            flush(&cluster);
            let counts = node_counts(p);
            let op = decide_op(
                http.clone(),
                decide_url.clone(),
                keys.clone(),
                Some(dist),
                args.requests_per_call,
                owner.clone(),
                counts.clone(),
            );
            let name = format!("{p} primaries, sidecar, {}", keys.name(dist));
            println!("  {name}");
            let stage = throughput(args, rt, &name, &watch, &counts, &probe, op);
            stages.push(shard_stage("sidecar", dist, false, stage, &keys.slot_id));
        }
        if index == 0 {
            // What a replica costs: the same uniform stage with a replica behind primary 0.
            flush(&cluster);
            let replica = add_replica(&cluster);
            let mut watch = watch.clone();
            watch.push(Watched::new("replica", replica.pid()));
            let counts = node_counts(p);
            let op = decide_op(
                http.clone(),
                decide_url.clone(),
                keys.clone(),
                Some(Dist::Uniform),
                args.requests_per_call,
                owner.clone(),
                counts.clone(),
            );
            let name = format!("{p} primaries and a replica of primary 0, sidecar, uniform");
            println!("  {name}");
            let stage = throughput(args, rt, &name, &watch, &counts, &probe, op);
            stages.push(shard_stage(
                "sidecar",
                Dist::Uniform,
                true,
                stage,
                &keys.slot_id,
            ));
            // The replica goes: later stages measure primaries alone. The primaries forget it
            // (CLUSTER FORGET), or the sidecar's slot map would list a node that is gone.
            let replica_id = replica.cli(&["CLUSTER", "MYID"]);
            drop(replica);
            for n in &cluster.nodes {
                n.cli(&["CLUSTER", "FORGET", &replica_id]);
            }
        }
        if !args.skip_envoy {
            let envoy = start_envoy(sidecar_port, upstream.port, args.envoy_workers, true);
            let mut watch = watch.clone();
            watch.push(Watched::new("envoy", envoy.process.pid()));
            for dist in [Dist::Uniform, Dist::Zipf] {
                flush(&cluster);
                let counts = node_counts(p);
                let op = envoy_op(
                    http.clone(),
                    format!("http://127.0.0.1:{}", envoy.listen_port),
                    keys.clone(),
                    Some(dist),
                    owner.clone(),
                    counts.clone(),
                );
                let name = format!(
                    "{p} primaries, envoy + filter (fast paths as shipped), {}",
                    keys.name(dist)
                );
                println!("  {name}");
                let stage = throughput(args, rt, &name, &watch, &counts, &probe, op);
                stages.push(shard_stage("envoy", dist, false, stage, &keys.slot_ip));
            }
        }
        if index + 1 == args.primaries.len() {
            kept = Some((cluster, sidecar, sidecar_port));
        }
    }
    Part1 { stages, kept }
}

/// `v` with `decimals` decimals.
fn num(v: f64, decimals: usize) -> String {
    format!("{v:.decimals$}")
}

/// A share as a percentage with one decimal.
fn pct(share: f64) -> String {
    format!("{:.1}%", share * 100.0)
}

fn print_part1(args: &Args, keys: &Keyspace, part: &Part1) {
    println!(
        "\n== 1. shards: POST /v1/decide on a Redis Cluster ({} callers, {} request(s) of one decision per call, {} s per stage, nothing rejected)",
        args.concurrency, args.requests_per_call, args.seconds
    );
    let t = Table::new()
        .left(28)
        .rights(&[3, 11, 7, 8, 8, 9, 9, 8])
        .gap(2)
        .rights(&[7, 7, 7, 7]);
    println!(
        "{}",
        t.line(&[
            "keys",
            "P",
            "decisions/s",
            "vs base",
            "p50",
            "p99",
            "sidecar",
            "redis",
            "others",
            "hottest",
            "pred.",
            "of cpu",
            "of keys"
        ])
    );
    println!(
        "{}",
        t.line(&["", "", "", "", "", "", "µs/dec", "µs/dec", "cores", "shard", "", "", ""])
    );
    let sidecar: Vec<&ShardStage> = part.stages.iter().filter(|s| s.path == "sidecar").collect();
    for dist in [Dist::Uniform, Dist::Zipf] {
        let base = sidecar.iter().find(|s| s.dist == dist && !s.replica);
        for s in sidecar.iter().filter(|s| s.dist == dist && !s.replica) {
            let rate = s.decisions() / s.m.seconds;
            let (_, share, cpu, keyshare) = s.hottest();
            let pred = s.predicted_shares.iter().cloned().fold(0.0, f64::max);
            let vs = match base {
                Some(b) if b.primaries != s.primaries => {
                    format!("{:.2}x", rate / (b.decisions() / b.m.seconds))
                }
                _ => "base".into(),
            };
            println!(
                "{}",
                t.line(&[
                    keys.name(dist),
                    s.primaries.to_string(),
                    num(rate, 0),
                    vs,
                    short(s.m.quantile(0.5)),
                    short(s.m.quantile(0.99)),
                    num(s.sidecar_us(), 1),
                    num(s.redis_us(), 1),
                    num(s.m.others_cores(), 2),
                    pct(share),
                    pct(pred),
                    pct(cpu),
                    pct(keyshare),
                ])
            );
        }
    }
    if let Some(r) = sidecar.iter().find(|s| s.replica) {
        let base = sidecar
            .iter()
            .find(|s| s.dist == Dist::Uniform && s.primaries == r.primaries && !s.replica);
        let d = r.decisions();
        let primary_us = r.node_cpu(0) * 1e6 / d;
        let replica_us = r.m.cpu.of("replica") * 1e6 / d;
        let versus = base.map(|b| {
            format!(
                " (the primary: {:.2}x its cost without a replica)",
                primary_us / b.redis_us().max(1e-9)
            )
        });
        println!(
            "{}",
            t.line(&[
                "uniform, + 1 replica".to_string(),
                r.primaries.to_string(),
                num(d / r.m.seconds, 0),
                base.map(|b| format!("{:.2}x", (d / r.m.seconds) / (b.decisions() / b.m.seconds)))
                    .unwrap_or_default(),
                short(r.m.quantile(0.5)),
                short(r.m.quantile(0.99)),
                num(r.sidecar_us(), 1),
                num(r.redis_us(), 1),
                num(r.m.others_cores(), 2),
                format!(
                    "primary {primary_us:.1} µs/dec, replica {replica_us:.1} µs/dec{}",
                    versus.unwrap_or_default()
                ),
            ])
        );
    }
    println!(
        "sidecar/redis µs/dec: CPU per decision (redis: all primaries together); others: cores busy with processes this run did not start;\n\
         hottest shard: its share of the decisions, the share predicted from the keys' slots, its share of Redis CPU and of the keys (DBSIZE)"
    );

    println!("\nper shard:");
    let t = Table::new()
        .left(28)
        .rights(&[3, 5, 13, 11, 7, 9, 7, 7, 9, 7, 9, 9]);
    println!(
        "{}",
        t.line(&[
            "keys",
            "P",
            "shard",
            "slots",
            "decisions/s",
            "share",
            "µs/dec",
            "busy",
            "of cpu",
            "keys",
            "of keys",
            "dec/call",
            "in script"
        ])
    );
    for s in sidecar.iter().filter(|s| !s.replica) {
        let total: u64 = s.per_node.iter().sum();
        let keys_total: u64 = s.keys_per_node.iter().sum();
        for (i, (a, b)) in even_slot_ranges(s.primaries).into_iter().enumerate() {
            let d = s.per_node[i] as f64;
            println!(
                "{}",
                t.line(&[
                    keys.name(s.dist),
                    s.primaries.to_string(),
                    i.to_string(),
                    format!("{a}-{b}"),
                    num(d / s.m.seconds, 0),
                    pct(d / total.max(1) as f64),
                    num(s.node_cpu(i) * 1e6 / d.max(1.0), 1),
                    format!("{:.0}%", s.node_cpu(i) * 100.0 / s.m.seconds),
                    pct(s.node_cpu(i) / s.redis_cpu().max(1e-9)),
                    s.keys_per_node[i].to_string(),
                    pct(s.keys_per_node[i] as f64 / keys_total.max(1) as f64),
                    num(d / s.calls_per_node[i].max(1) as f64, 1),
                    num(s.script_us_per_node[i] / d.max(1.0), 1),
                ])
            );
        }
    }
    println!("busy: the share of one core the node used; dec/call: decisions per script call (the sidecar's batching per node);\n\
              in script: µs per decision inside EVALSHA (INFO commandstats; the rest of µs/dec is reading, parsing and answering commands)");

    let envoy: Vec<&ShardStage> = part.stages.iter().filter(|s| s.path == "envoy").collect();
    if envoy.is_empty() {
        return;
    }
    println!(
        "\nthrough Envoy ({} worker(s)) with the filter as shipped (coalesced callouts, leases), requests keyed by client address:",
        args.envoy_workers
    );
    let t = Table::new()
        .left(28)
        .rights(&[3, 10, 7, 8, 8, 9, 8, 9, 9, 8])
        .gap(2)
        .rights(&[7, 7]);
    println!(
        "{}",
        t.line(&[
            "keys",
            "P",
            "requests/s",
            "vs base",
            "p50",
            "p99",
            "decisions",
            "envoy",
            "sidecar",
            "redis",
            "others",
            "hottest",
            "of cpu"
        ])
    );
    println!(
        "{}",
        t.line(&[
            "", "", "", "", "", "", "/request", "µs/req", "µs/dec", "µs/req", "cores", "shard", ""
        ])
    );
    for dist in [Dist::Uniform, Dist::Zipf] {
        let base = envoy.iter().find(|s| s.dist == dist);
        for s in envoy.iter().filter(|s| s.dist == dist) {
            let (_, share, cpu, _) = s.hottest();
            let vs = match base {
                Some(b) if b.primaries != s.primaries => {
                    format!("{:.2}x", s.m.per_second() / b.m.per_second())
                }
                _ => "base".into(),
            };
            println!(
                "{}",
                t.line(&[
                    keys.name(dist),
                    s.primaries.to_string(),
                    num(s.m.per_second(), 0),
                    vs,
                    short(s.m.quantile(0.5)),
                    short(s.m.quantile(0.99)),
                    num(s.decisions() / s.m.ops.max(1) as f64, 3),
                    num(s.m.cpu_us_per_op("envoy"), 1),
                    num(s.sidecar_us(), 1),
                    num(s.redis_cpu() * 1e6 / s.m.ops.max(1) as f64, 1),
                    num(s.m.others_cores(), 2),
                    pct(share),
                    pct(cpu),
                ])
            );
        }
    }
    println!("decisions/request: decisions that reached the sidecar per admitted request (below 1: leases answered the rest in Envoy)");
}

// ---------------------------------------------------------------------------------------------
// Part 2: a hot key.

/// Part 2 alone: a cluster of the last size and its sidecar, without the stages of part 1.
fn cluster_of_part2(args: &Args, work: &Workdir) -> (RedisCluster, Process, u16) {
    let p = *args.primaries.last().expect("a size");
    let cluster = RedisCluster::start_primaries(p);
    let port = ratelimit_e2e::free_port();
    let sidecar = start_sidecar(
        args,
        work,
        None,
        ([127, 0, 0, 1], port).into(),
        &["--redis-cluster", &cluster.seeds()],
        "sidecar",
    );
    (cluster, sidecar, port)
}

struct HotStage {
    name: &'static str,
    m: Measured,
    /// Decisions that reached the sidecar (and Redis) during the measured window.
    decisions: f64,
    /// Script calls of the hot shard during the measured window.
    script_calls: f64,
    /// Requests answered from a lease in Envoy, per admitted request.
    lease_share: f64,
}

struct Part2 {
    primaries: usize,
    hot_node: usize,
    stages: Vec<HotStage>,
}

impl HotStage {
    fn per_admitted(&self, v: f64) -> f64 {
        v / self.m.ops.max(1) as f64
    }
}

fn run_part2(
    args: &Args,
    rt: &tokio::runtime::Runtime,
    keys: &Arc<Keyspace>,
    upstream: &Upstream,
    cluster: &RedisCluster,
    sidecar: &Process,
    sidecar_port: u16,
) -> Part2 {
    let p = cluster.nodes.len();
    let owner = Arc::new(node_of_slot(p));
    let hot_node = owner[slot(&tag("hot", None)) as usize] as usize;
    let http = http_client(args);
    let sidecar_addr: SocketAddr = ([127, 0, 0, 1], sidecar_port).into();
    let mut watch = cluster_watch(cluster);
    watch.push(Watched::new("sidecar", sidecar.pid()));
    let mut stages = Vec::new();
    let mut measure = |name: &'static str, envoy: Option<&Envoy>| {
        flush(cluster);
        let counts = node_counts(p);
        let mut watch = watch.clone();
        let op = match envoy {
            None => decide_op(
                http.clone(),
                format!("http://{sidecar_addr}/v1/decide"),
                keys.clone(),
                None,
                1,
                owner.clone(),
                counts.clone(),
            ),
            Some(e) => {
                watch.push(Watched::new("envoy", e.process.pid()));
                envoy_op(
                    http.clone(),
                    format!("http://127.0.0.1:{}", e.listen_port),
                    keys.clone(),
                    None,
                    owner.clone(),
                    counts.clone(),
                )
            }
        };
        // The hot shard's script calls, the hot bucket's decisions at the sidecar, and the
        // requests Envoy admitted from a lease.
        let probe = || {
            vec![
                probe::script_calls(&cluster.nodes[hot_node]).calls,
                probe::sidecar_metric(sidecar_addr, "ratelimit_decisions_total{limit=\"hot\""),
                envoy.map_or(0.0, |e| probe::envoy_stat(e, "ratelimit.lease_admitted")),
            ]
        };
        println!("  hot key: {name}");
        let Stage { m, .. } = throughput(args, rt, name, &watch, &counts, &probe, op);
        stages.push(HotStage {
            name,
            script_calls: m.probed[0],
            decisions: m.probed[1],
            lease_share: m.probed[2] / m.ops.max(1) as f64,
            m,
        });
    };
    measure("sidecar, 1 decision per call (no leases)", None);
    let envoy = start_envoy(sidecar_port, upstream.port, args.envoy_workers, false);
    measure("envoy + filter, fast paths, leases off", Some(&envoy));
    drop(envoy);
    let envoy = start_envoy(sidecar_port, upstream.port, args.envoy_workers, true);
    measure(
        "envoy + filter, fast paths as shipped (leases)",
        Some(&envoy),
    );
    drop(envoy);
    Part2 {
        primaries: p,
        hot_node,
        stages,
    }
}

fn print_part2(args: &Args, part: &Part2) {
    println!(
        "\n== 2. a hot key: one bucket, so one shard (node {} of {}); {} callers, {} s per stage, Envoy with {} worker(s)",
        part.hot_node, part.primaries, args.concurrency, args.seconds, args.envoy_workers
    );
    let t = Table::new()
        .left(48)
        .rights(&[10, 8, 8, 11, 9, 10, 10, 8, 8, 9, 8, 7]);
    println!(
        "{}",
        t.line(&[
            "path",
            "admitted/s",
            "p50",
            "p99",
            "to Redis/s",
            "per adm.",
            "calls/s",
            "hot µs",
            "hot",
            "others",
            "sidecar",
            "envoy",
            "leased"
        ])
    );
    println!(
        "{}",
        t.line(&[
            "",
            "",
            "",
            "",
            "decisions",
            "",
            "hot shard",
            "/admitted",
            "busy",
            "shards",
            "µs/adm.",
            "µs/adm.",
            ""
        ])
    );
    for s in &part.stages {
        let hot = s.m.cpu.of(&format!("redis-{}", part.hot_node));
        let others: f64 = (0..part.primaries)
            .filter(|i| *i != part.hot_node)
            .map(|i| s.m.cpu.of(&format!("redis-{i}")))
            .sum();
        let envoy = match s.m.cpu.watched("envoy") {
            true => num(s.per_admitted(s.m.cpu.of("envoy") * 1e6), 1),
            false => "-".into(),
        };
        println!(
            "{}",
            t.line(&[
                s.name.to_string(),
                num(s.m.per_second(), 0),
                short(s.m.quantile(0.5)),
                short(s.m.quantile(0.99)),
                num(s.decisions / s.m.seconds, 0),
                num(s.per_admitted(s.decisions), 4),
                num(s.script_calls / s.m.seconds, 0),
                num(s.per_admitted(hot * 1e6), 2),
                format!("{:.0}%", hot * 100.0 / s.m.seconds),
                format!("{:.0}%", others * 100.0 / s.m.seconds),
                num(s.per_admitted(s.m.cpu.of("sidecar") * 1e6), 2),
                envoy,
                pct(s.lease_share),
            ])
        );
    }
    if let (Some(off), Some(on)) = (part.stages.get(1), part.stages.get(2)) {
        let cpu = |s: &HotStage| s.per_admitted(s.m.cpu.of(&format!("redis-{}", part.hot_node)));
        println!(
            "leases vs leases off: {:.4}x the decisions reaching Redis per admitted request, {:.3}x the hot shard's CPU per admitted request, {:.2}x the admitted requests/s",
            on.per_admitted(on.decisions) / off.per_admitted(off.decisions).max(1e-12),
            cpu(on) / cpu(off).max(1e-12),
            on.m.per_second() / off.m.per_second()
        );
    }
    let ceiling = |s: &HotStage| {
        let us = s.per_admitted(s.m.cpu.of(&format!("redis-{}", part.hot_node)) * 1e6);
        1e6 / us.max(1e-9)
    };
    if let (Some(off), Some(on)) = (part.stages.get(1), part.stages.get(2)) {
        println!(
            "one key on one primary core at 100%: about {:.0} requests/s without leases, {:.0} with (1 s / hot µs)",
            ceiling(off),
            ceiling(on)
        );
    }
    println!("per adm.: decisions reaching Redis per admitted request; hot µs: the hot shard's CPU per admitted request; leased: requests admitted from a lease in Envoy");
}

// ---------------------------------------------------------------------------------------------
// Part 3: latency over real hops.

/// The three hosts: gateway, sidecar, Redis, each its own namespace, on two veth links.
const GW_SC: (&str, &str) = ("10.77.1.1", "10.77.1.2");
const SC_RD: (&str, &str) = ("10.77.2.1", "10.77.2.2");

/// How a hop gets its delay.
enum Hop {
    /// `tc netem` on both ends of the link (half the round trip each way).
    Netem { ends: [(usize, &'static str); 2] },
    /// A delay relay the traffic of the hop goes through.
    Relay(DelayRelay),
}

struct LatencyStage {
    name: String,
    rtt_ms: f64,
    hop: &'static str,
    latencies: Vec<Duration>,
    errors: u64,
    rate: f64,
    lateness: Option<(Duration, Duration)>,
}

impl LatencyStage {
    fn q(&self, q: f64) -> Duration {
        quantile(&self.latencies, q)
    }
}

struct Part3 {
    mode: &'static str,
    stages: Vec<LatencyStage>,
}

/// Decisions paced at `rate`/s from the calling thread's namespace to `url` for `seconds` after
/// 0.5 s of warm-up (an open loop: a slow answer does not slow the next send): the sorted
/// latencies of the answered ones, the failed ones, and the rate sent.
fn paced(url: &str, rate: f64, seconds: f64, keys: usize) -> (Vec<Duration>, u64, f64) {
    let http = load::http_client(128, Duration::from_secs(10));
    let url = url.to_string();
    let op = load::op(move |call| {
        let body = format!(
            "{{\"requests\":[{{\"decisions\":[{{\"rule\":\"scale\",\"subject\":{{\"id\":\"{}\"}}}}]}}]}}",
            key_id((mix(call.n + 1) % keys as u64) as usize)
        );
        let req = http
            .post(&url)
            .header("content-type", "application/json")
            .body(body);
        async move {
            let r = req.send().await.map_err(|e| e.to_string())?;
            let status = r.status();
            r.bytes().await.map_err(|e| e.to_string())?;
            match status.as_u16() {
                200 => Ok(()),
                s => Err(format!("status {s}")),
            }
        }
    });
    let warmup = Duration::from_millis(500);
    let (samples, sent) = load::paced(op, rate, warmup, seconds, &INTERRUPTED);
    let mut latencies: Vec<Duration> = samples
        .iter()
        .filter(|s| !s.failed())
        .map(|s| s.latency)
        .collect();
    latencies.sort();
    let errors = samples.iter().filter(|s| s.failed()).count() as u64;
    (latencies, errors, sent)
}

fn run_part3(args: &Args, work: &Workdir) -> Part3 {
    // Declared first, so they are dropped last: every process inside is gone by then.
    let gw = Netns::create("gw");
    let sc = Netns::create("sc");
    let rd = Netns::create("rd");
    netns::link(
        &gw,
        "gw0",
        &format!("{}/24", GW_SC.0),
        &sc,
        "sc0",
        &format!("{}/24", GW_SC.1),
    );
    netns::link(
        &sc,
        "sc1",
        &format!("{}/24", SC_RD.0),
        &rd,
        "rd0",
        &format!("{}/24", SC_RD.1),
    );
    let spaces = [&gw, &sc, &rd];
    let use_netem = match args.delay.as_str() {
        "netem" => true,
        "relay" => false,
        _ => netns::netem(&gw, "gw0", Duration::from_micros(1)).is_ok(),
    };
    if use_netem {
        netns::netem(&gw, "gw0", Duration::ZERO).expect("remove netem");
    }
    let mode = if use_netem { "tc netem" } else { "delay relay" };
    println!(
        "  namespaces {}, {}, {}; delays by {mode}",
        gw.name, sc.name, rd.name
    );

    // Redis in its namespace.
    let redis_dir = tempfile::tempdir().expect("temp dir");
    let mut redis_cmd = rd.command("redis-server");
    redis_cmd
        .current_dir(redis_dir.path())
        .args(["--bind", SC_RD.1, "--port", "6379"])
        .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"]);
    let mut redis = Process::spawn("redis-netns", redis_cmd, redis_dir.path());
    let redis_addr: SocketAddr = format!("{}:6379", SC_RD.1).parse().expect("addr");
    wait_until("redis in its namespace", READY_TIMEOUT, || {
        assert!(redis.running(), "redis exited:\n{}", redis.log());
        sc.run(|| TcpStream::connect_timeout(&redis_addr, Duration::from_millis(200)).is_ok())
    });

    // The hops: relays in the namespace of the far end (what crosses the veth is delayed).
    let sidecar_addr: SocketAddr = format!("{}:8081", GW_SC.1).parse().expect("addr");
    let (to_sidecar, to_redis) = if use_netem {
        (
            Hop::Netem {
                ends: [(0, "gw0"), (1, "sc0")],
            },
            Hop::Netem {
                ends: [(1, "sc1"), (2, "rd0")],
            },
        )
    } else {
        (
            Hop::Relay(DelayRelay::start(
                &sc,
                format!("{}:8082", GW_SC.1).parse().expect("addr"),
                sidecar_addr,
            )),
            Hop::Relay(DelayRelay::start(
                &rd,
                format!("{}:6380", SC_RD.1).parse().expect("addr"),
                redis_addr,
            )),
        )
    };
    let redis_url = match &to_redis {
        Hop::Relay(r) => format!("redis://{}", r.addr),
        Hop::Netem { .. } => format!("redis://{redis_addr}"),
    };
    let sidecar = start_sidecar(
        args,
        work,
        Some(&sc),
        sidecar_addr,
        &["--redis", &redis_url],
        "sidecar-netns",
    );
    let gateway_url = match &to_sidecar {
        Hop::Relay(r) => format!("http://{}/v1/decide", r.addr),
        Hop::Netem { .. } => format!("http://{sidecar_addr}/v1/decide"),
    };
    // Without relays at all (relay mode only): what the relays cost at 0 delay.
    let direct = (!use_netem).then(|| {
        let addr: SocketAddr = format!("{}:8083", GW_SC.1).parse().expect("addr");
        let p = start_sidecar(
            args,
            work,
            Some(&sc),
            addr,
            &["--redis", &format!("redis://{redis_addr}")],
            "sidecar-netns-direct",
        );
        (p, format!("http://{addr}/v1/decide"))
    });

    // A second sidecar with more script calls in flight, behind a hop of its own to the
    // gateway (undelayed), sharing the delayed hop to Redis.
    let alt_pipeline = args.alt_pipeline.to_string();
    let alt = (args.alt_pipeline > 0).then(|| {
        let addr: SocketAddr = format!("{}:8084", GW_SC.1).parse().expect("addr");
        let p = start_sidecar(
            args,
            work,
            Some(&sc),
            addr,
            &["--redis", &redis_url, "--redis-pipeline", &alt_pipeline],
            "sidecar-netns-pipeline",
        );
        let relay = (!use_netem).then(|| {
            DelayRelay::start(
                &sc,
                format!("{}:8085", GW_SC.1).parse().expect("addr"),
                addr,
            )
        });
        let url = match &relay {
            Some(r) => format!("http://{}/v1/decide", r.addr),
            None => format!("http://{addr}/v1/decide"),
        };
        (p, relay, url)
    });

    let set = |hop: &Hop, rtt: Duration| match hop {
        Hop::Relay(r) => r.set_round_trip(rtt),
        Hop::Netem { ends } => {
            for (space, dev) in ends {
                netns::netem(spaces[*space], dev, rtt / 2).expect("tc netem");
            }
        }
    };
    let lateness = |hops: [&Hop; 2]| -> Option<(Duration, Duration)> {
        let mut worst: Option<(Duration, Duration)> = None;
        for hop in hops {
            if let Hop::Relay(r) = hop {
                let (mean, max, _) = r.lateness();
                worst = Some(match worst {
                    None => (mean, max),
                    Some((m, x)) => (m.max(mean), x.max(max)),
                });
            }
        }
        worst
    };
    let mut stages = Vec::new();
    let mut stage = |name: String, hop: &'static str, rtt_ms: f64, url: &str| {
        check_interrupted();
        println!("  latency: {name}");
        lateness([&to_sidecar, &to_redis]);
        let (latencies, errors, rate) =
            gw.run(|| paced(url, args.latency_rate, args.latency_seconds, args.keys));
        check_interrupted();
        stages.push(LatencyStage {
            name,
            rtt_ms,
            hop,
            latencies,
            errors,
            rate,
            lateness: lateness([&to_sidecar, &to_redis]),
        });
    };
    if let Some((_, url)) = &direct {
        stage("no relay (veth only)".into(), "-", 0.0, url);
    }
    stage(
        format!("{} at 0", if use_netem { "no netem" } else { "relays" }),
        "baseline",
        0.0,
        &gateway_url,
    );
    for (hop, label, name) in [
        (&to_sidecar, "gateway-sidecar", "gateway ↔ sidecar"),
        (&to_redis, "sidecar-redis", "sidecar ↔ Redis"),
    ] {
        for &rtt in &args.rtt_ms {
            set(hop, Duration::from_secs_f64(rtt / 1e3));
            stage(format!("{name}, rtt {rtt} ms"), label, rtt, &gateway_url);
        }
        set(hop, Duration::ZERO);
    }
    if let Some((_, _, url)) = &alt {
        for &rtt in &args.rtt_ms {
            set(&to_redis, Duration::from_secs_f64(rtt / 1e3));
            stage(
                format!(
                    "sidecar ↔ Redis, rtt {rtt} ms, --redis-pipeline {}",
                    args.alt_pipeline
                ),
                "sidecar-redis-pipeline",
                rtt,
                url,
            );
        }
        set(&to_redis, Duration::ZERO);
    }
    drop(alt);
    drop(direct);
    drop(sidecar);
    drop(to_sidecar);
    drop(to_redis);
    drop(redis);
    Part3 { mode, stages }
}

fn print_part3(args: &Args, part: &Part3) {
    println!(
        "\n== 3. decision latency over real hops: gateway (this load generator), sidecar and Redis in three network namespaces on veth links;\n\
         one hop at a time delayed by {} (half the round trip each way); {:.0} decisions/s paced, {} s per stage; sidecar --redis-timeout-ms 1000",
        part.mode, args.latency_rate, args.latency_seconds
    );
    let t = Table::new().left(50).rights(&[8, 9, 9, 9, 10, 10, 10, 16]);
    println!(
        "{}",
        t.line(&[
            "delay",
            "sent/s",
            "p50",
            "p95",
            "p99",
            "+p50",
            "+p95",
            "+p99",
            "relay late mean/max"
        ])
    );
    let base = part.stages.iter().find(|s| s.hop == "baseline");
    for s in &part.stages {
        let plus = |q: f64| match base {
            Some(b) if s.hop != "baseline" && s.hop != "-" => {
                let d = s.q(q).as_secs_f64() - b.q(q).as_secs_f64();
                format!("{:+.3}ms", d * 1e3)
            }
            _ => String::new(),
        };
        let line = t.line(&[
            s.name.clone(),
            num(s.rate, 0),
            short(s.q(0.5)),
            short(s.q(0.95)),
            short(s.q(0.99)),
            plus(0.5),
            plus(0.95),
            plus(0.99),
            s.lateness
                .map(|(m, x)| format!("{}/{}", short(m), short(x)))
                .unwrap_or_default(),
        ]);
        match s.errors {
            0 => println!("{line}"),
            n => println!("{line}  ({n} failed)"),
        }
    }
    println!("+pNN: added to the baseline's percentile; relay late: how much later than due the relays wrote (their own cost on top of the delay)");
    for hop in ["gateway-sidecar", "sidecar-redis", "sidecar-redis-pipeline"] {
        let per_ms: Vec<String> = part
            .stages
            .iter()
            .filter(|s| s.hop == hop && s.rtt_ms > 0.0)
            .filter_map(|s| {
                let b = base?;
                let added = (s.q(0.5).as_secs_f64() - b.q(0.5).as_secs_f64()) * 1e3;
                Some(format!("{:.2}x at {} ms", added / s.rtt_ms, s.rtt_ms))
            })
            .collect();
        if per_ms.is_empty() {
            continue;
        }
        println!(
            "{hop}: p50 added per ms of round trip: {}",
            per_ms.join(", ")
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Part 5: Redis held at the model's utilisation.

/// Part 5's rounds.
struct Part5 {
    runs: Vec<AtLoad>,
}

impl Part5 {
    /// The median CPU per decision of `work`'s rounds, µs.
    fn median(&self, work: Work) -> f64 {
        let mut v: Vec<f64> = self
            .runs
            .iter()
            .filter(|r| r.work == work)
            .map(|r| r.cpu_us)
            .collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

fn run_part5(args: &Args) -> Part5 {
    println!(
        "\n== 5. Redis held at {:.0}% of a core by {} connections, one decision per call, {} keys ({} rounds of {} s)",
        args.utilisation * 100.0,
        args.load_connections,
        args.keys,
        args.load_rounds,
        args.seconds
    );
    let mut runs = Vec::new();
    for round in 0..args.load_rounds {
        // The order alternates, so drift in the machine's load falls on both alike.
        let order = if round % 2 == 0 {
            [Work::Single, Work::Script, Work::Incr]
        } else {
            [Work::Incr, Work::Script, Work::Single]
        };
        for work in order {
            if INTERRUPTED.load(Ordering::Relaxed) {
                break;
            }
            runs.push(utilisation::measure(
                work,
                args.utilisation,
                args.load_connections,
                args.keys as u64,
                args.seconds,
            ));
        }
    }
    Part5 { runs }
}

fn print_part5(args: &Args, p: &Part5) {
    let t = Table::new().left(40).rights(&[12, 12, 14]).gap(2);
    println!(
        "{}",
        t.line(&["work", "Redis busy", "decisions/s", "Redis µs/dec"])
    );
    for r in &p.runs {
        println!(
            "{}",
            t.line(&[
                r.work.name().to_string(),
                format!("{:.0}%", r.utilisation * 100.0),
                num(r.decisions_per_sec, 0),
                format!("{:.1}", r.cpu_us),
            ])
        );
    }
    let (single, script, incr) = (
        p.median(Work::Single),
        p.median(Work::Script),
        p.median(Work::Incr),
    );
    println!(
        "medians at {:.0}% busy, µs per decision: the lone-decision script {single:.1} ({:.2}x the long script's {script:.1}), INCR {incr:.1} (the lone-decision script {:.1}x, the long one {:.1}x)",
        args.utilisation * 100.0,
        single / script,
        single / incr,
        script / incr,
    );
}

// ---------------------------------------------------------------------------------------------
// Part 4: the model.

/// A lease's time to live with the filter's defaults, in seconds.
fn lease_ttl_s() -> f64 {
    lease_defaults().ttl_ms as f64 / 1000.0
}

/// Renewals per second of a lease on a bucket seen at `r` requests/s at one gateway: the lease
/// holds `L = min(max_tokens, ceil(1.25 r ttl))` tokens (the filter's sizing with its defaults)
/// and the next one is asked for when it runs low (a quarter of its tokens left, taken over
/// when spent) or in the last tenth of its time, so `max(r / L, 1 / (0.9 ttl))` times a second.
fn lease_renewals(r: f64) -> f64 {
    (r / lease_ask(r) as f64).max(1.0 / (0.9 * lease_ttl_s()))
}

/// The share of a bucket's requests at one gateway that reach Redis, at `r` requests/s there:
/// 1 below the busy threshold; else each renewal is one decision, and the requests that find no
/// lease while it is in flight (`r x t_ask`, `t_ask` the part of the ask they wait for: near 0
/// when the next lease is asked for early) are decided remotely too:
/// `reach(r) = renewals(r) x (1 + r x t_ask) / r`, at most 1.
fn lease_reach(r: f64, t_ask_s: f64) -> f64 {
    if r < lease_defaults().min_rate_per_sec {
        return 1.0;
    }
    (lease_renewals(r) * (1.0 + r * t_ask_s) / r).min(1.0)
}

/// `t_ask` from a measured reach at `r` requests/s (the inverse of [`lease_reach`]).
fn calibrate_t_ask(reach: f64, r: f64) -> f64 {
    ((reach * r / lease_renewals(r) - 1.0) / r).max(0.0)
}

/// `(c_call, c_dec)` of `c = c_call / b + c_dec` fitted to `(b, c)` points by least squares;
/// None without two distinct batch sizes or when a coefficient comes out negative.
fn batch_fit(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    let xs: Vec<f64> = points.iter().map(|(b, _)| 1.0 / b).collect();
    let (mx, my) = (
        xs.iter().sum::<f64>() / n,
        points.iter().map(|(_, c)| c).sum::<f64>() / n,
    );
    let sxx: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
    if points.len() < 2 || sxx < 1e-6 {
        return None;
    }
    let sxy: f64 = xs
        .iter()
        .zip(points)
        .map(|(x, (_, c))| (x - mx) * (c - my))
        .sum();
    let c_call = sxy / sxx;
    let c_dec = my - c_call * mx;
    (c_call >= 0.0 && c_dec >= 0.0).then_some((c_call, c_dec))
}

/// The smallest number of primaries whose busiest one stays within `utilisation` for `load`
/// decisions/s reaching Redis at `c_us` µs each, with the shares of slots `by_slot` (summing to
/// 1); None if even one slot alone is too much (a single key cannot be split).
fn primaries_needed(load: f64, c_us: f64, by_slot: &[f64], utilisation: f64) -> Option<usize> {
    let max_slot = by_slot.iter().cloned().fold(0.0, f64::max);
    if load * max_slot * c_us / 1e6 > utilisation {
        return None;
    }
    (1..=16384).find(|p| {
        let busiest = shares_from_slots(by_slot, *p)
            .into_iter()
            .fold(0.0, f64::max);
        load * busiest * c_us / 1e6 <= utilisation
    })
}

fn print_model(
    args: &Args,
    keys: &Keyspace,
    p1: Option<&Part1>,
    p2: Option<&Part2>,
    p5: Option<&Part5>,
) {
    let Some(p1) = p1 else {
        println!("\n== 4. the model needs part 1");
        return;
    };
    let sidecar: Vec<&ShardStage> = p1
        .stages
        .iter()
        .filter(|s| s.path == "sidecar" && !s.replica)
        .collect();
    let largest = sidecar
        .iter()
        .filter(|s| s.dist == Dist::Uniform)
        .max_by_key(|s| s.primaries);
    let Some(largest) = largest else { return };
    // Redis CPU per decision against decisions per script call, over every sidecar stage:
    // c(b) = c_call / b + c_dec (least squares on 1/b), priced at the fleet's batch.
    let points: Vec<(f64, f64)> = sidecar
        .iter()
        .map(|s| {
            let b = s.decisions() / s.calls_per_node.iter().sum::<u64>().max(1) as f64;
            (b, s.redis_us())
        })
        .collect();
    let fit = batch_fit(&points);
    let c_redis = match fit {
        Some((c_call, c_dec)) => c_call / args.fleet_batch + c_dec,
        None => largest.redis_us(),
    };
    // The sidecar's cost behind Envoy (the filter coalesces requests into callouts) when that
    // ran, else on the direct API with one request per call (the most it costs).
    let through_envoy = p1
        .stages
        .iter()
        .filter(|s| s.path == "envoy" && s.dist == Dist::Uniform)
        .max_by_key(|s| s.primaries);
    let c_sidecar = through_envoy.map_or(largest.sidecar_us(), |s| s.sidecar_us());
    let replica = p1.stages.iter().find(|s| s.replica);
    let base = sidecar
        .iter()
        .find(|s| s.dist == Dist::Uniform && Some(s.primaries) == replica.map(|r| r.primaries));
    let (repl_factor, c_replica) = match (replica, base) {
        (Some(r), Some(b)) => {
            let d = r.decisions();
            (
                (r.node_cpu(0) * 1e6 / d) / b.redis_us().max(1e-9),
                r.m.cpu.of("replica") * 1e6 / d,
            )
        }
        _ => (1.0, 0.0),
    };
    // A replica cannot make its primary cheaper: a factor below 1 is the machine's noise.
    let c_primary = c_redis * repl_factor.max(1.0);
    let (d, u, g) = (args.target, args.utilisation, args.gateways as f64);
    println!(
        "\n== 4. the shard model: {:.0} decisions/s, every Redis primary and sidecar core at most {:.0}% busy",
        d,
        u * 100.0
    );
    println!("figures from this run:");
    let measured: Vec<String> = points
        .iter()
        .map(|(b, c)| format!("{c:.1} µs at {b:.1}"))
        .collect();
    println!(
        "  Redis CPU per decision at b decisions per script call (sidecar stages): {}",
        measured.join(", ")
    );
    println!(
        "  of it inside the script (INFO commandstats) with {} primaries, uniform: {:.1} of {:.1} µs",
        largest.primaries,
        largest.script_us_per_node.iter().sum::<f64>() / largest.decisions().max(1.0),
        largest.redis_us()
    );
    match fit {
        Some((c_call, c_dec)) => println!(
            "  c(b)      = c_call / b + c_dec = {c_call:.1} / b + {c_dec:.1} µs (least squares); c_redis = c({}) = {c_redis:.1} µs at the fleet's batch",
            args.fleet_batch
        ),
        None => println!(
            "  c_redis   = {c_redis:.1} µs ({} primaries, uniform keys: the batches measured did not fit c_call / b + c_dec)",
            largest.primaries
        ),
    }
    println!(
        "  f_repl    = {repl_factor:.2}: a primary's cost with a replica attached over without (1 primary; taken as at least 1); c_primary = c_redis x f_repl = {c_primary:.1} µs"
    );
    println!("  c_replica = {c_replica:.1} µs of a replica's CPU per decision it applies");
    match through_envoy {
        Some(s) => println!(
            "  c_sidecar = {c_sidecar:.1} µs of sidecar CPU per decision behind Envoy ({} primaries, uniform; {:.1} µs on the direct API with {} request(s) per call)",
            s.primaries,
            largest.sidecar_us(),
            args.requests_per_call
        ),
        None => println!(
            "  c_sidecar = {c_sidecar:.1} µs of sidecar CPU per decision on the direct API, {} request(s) per call",
            args.requests_per_call
        ),
    }
    // The lease model's one free figure, the time an ask is in flight, from part 2 when it ran.
    let (t_ask, t_ask_from) = match p2.and_then(|p| p.stages.get(2)) {
        Some(s) => {
            let (reach, rate) = (s.per_admitted(s.decisions), s.m.per_second());
            let t = calibrate_t_ask(reach, rate);
            (
                t,
                format!(
                    "from part 2: {:.2}% of the hot key's {rate:.0} requests/s at one Envoy reached Redis, {:.1} lease renewals/s",
                    reach * 100.0,
                    lease_renewals(rate)
                ),
            )
        }
        None => (0.002, "assumed (part 2 did not run)".to_string()),
    };
    println!(
        "  t_ask     = {:.2} ms: how long requests wait for a lease renewal ({t_ask_from})",
        t_ask * 1e3
    );
    println!("formula (redo it with your own figures):");
    println!("  c_primary = (c_call / b + c_dec) x f_repl   (b: decisions per script call, about 1 in a large fleet)");
    println!("  S(P)      = the share of decisions on the busiest of P primaries (even slot ranges), from the keys' weights and slots");
    println!("  primaries = the smallest P with  D_redis x S(P) x c_primary <= u   (a primary runs scripts on one core)");
    println!("              impossible when one key alone has D_redis x w_key x c_primary > u: that key must be leased (or split)");
    println!("  replicas  = primaries x {}  (a replica applies its primary's writes: D_redis x S(P) x c_replica <= u)", args.replicas_per_primary);
    println!("  sidecar cores = D_sidecar x c_sidecar / u   (sidecars share no state: spread them freely)");
    println!(
        "  with leases, a key seen at r requests/s per gateway (G = {} gateways) sends r x reach(r) to Redis:",
        args.gateways
    );
    let (leases, ttl) = (lease_defaults(), lease_ttl_s());
    let (busy, most, last) = (leases.min_rate_per_sec, leases.max_tokens, 0.9 * ttl);
    println!("              reach(r) = renewals(r) x (1 + r x t_ask) / r for r >= {busy}/s, else 1, where renewals(r) = max(r / min({most}, ceil(1.25 r x {ttl} s)), 1/({last} s))");
    println!("              (the filter's lease defaults: busy from {busy}/s, {ttl} s leases of at most {most} tokens)");
    let model = Model {
        target: d,
        utilisation: u,
        gateways: g,
        replicas_per_primary: args.replicas_per_primary,
        t_ask,
        c_sidecar,
    };
    match p5 {
        Some(p5) => {
            let f = c_primary / c_redis.max(1e-9);
            println!(
                "with c_primary from part 5 (Redis held at {:.0}% busy, one decision per call, the lone-decision script): {:.1} µs x f_repl {f:.2} = {:.1} µs",
                u * 100.0,
                p5.median(Work::Single),
                p5.median(Work::Single) * f
            );
            model_table(keys, &model, p5.median(Work::Single) * f);
            println!(
                "the same with the long script (bucket + apply: a call with a lease ask, a share or a record), part 5: {:.1} µs x f_repl {f:.2}",
                p5.median(Work::Script)
            );
            model_table(keys, &model, p5.median(Work::Script) * f);
            println!(
                "the same model for Redis doing the peer's work (one INCR per decision, part 5): {:.1} µs x f_repl {f:.2}",
                p5.median(Work::Incr)
            );
            model_table(keys, &model, p5.median(Work::Incr) * f);
            println!("and with c_primary from the fit above (Redis mostly idle between calls, as part 1 measured it):");
            model_table(keys, &model, c_primary);
            if let Some((_, c_dec)) = fit {
                shared_sidecar_table(
                    args,
                    keys,
                    p5.median(Work::Script) * f,
                    c_dec * f,
                    args.redis_pipeline.unwrap_or(4),
                );
            }
        }
        None => model_table(keys, &model, c_primary),
    }
    println!(
        "Redis cores: D_redis x c_primary, the work itself; primaries above it buy headroom and absorb the busiest shard"
    );
}

/// Decisions per script call of one (sidecar, primary) pair that carries `per_sec` decisions/s,
/// each call taking `call_ms` (the round trip to Redis and its turn there), `pipeline` calls in
/// flight at most: one per call while the calls in flight suffice (Little's law:
/// `per_sec x call_ms` calls are out), then the merged rest, `per_sec x call_ms / pipeline`.
fn batch_of_pair(per_sec: f64, call_ms: f64, pipeline: u64) -> f64 {
    (per_sec * call_ms / 1e3 / pipeline.max(1) as f64).max(1.0)
}

/// The smallest P whose busiest primary stays within `u` when each sidecar serves `per_sidecar`
/// of `gateways`, for `d` decisions/s spread as `by_slot`: the batch per (sidecar, primary) pair
/// grows with the gateways a sidecar serves and shrinks with P, and a primary's cost per decision
/// is `c_at(b) = (c1 - c_dec) / b + c_dec` (its per-call part shared by the batch). The P and the
/// batch.
#[allow(clippy::too_many_arguments)]
fn primaries_shared(
    d: f64,
    by_slot: &[f64],
    gateways: f64,
    per_sidecar: f64,
    c1: f64,
    c_dec: f64,
    call_ms: f64,
    pipeline: u64,
    u: f64,
) -> Option<(usize, f64)> {
    let sidecars = (gateways / per_sidecar).max(1.0);
    (1..=16384).find_map(|p| {
        let busiest = shares_from_slots(by_slot, p)
            .into_iter()
            .fold(0.0, f64::max);
        let pair = d * busiest / sidecars;
        let b = batch_of_pair(pair, call_ms, pipeline);
        let c = (c1 - c_dec).max(0.0) / b + c_dec;
        (d * busiest * c / 1e6 <= u).then_some((p, b))
    })
}

/// The shared-sidecar variant: how the batch per Redis node, and so the primaries, change when one
/// sidecar (per node or zone) serves many gateways, uniform keys, no leases.
fn shared_sidecar_table(args: &Args, keys: &Keyspace, c1: f64, c_dec: f64, pipeline: u64) {
    let call_ms = 1.0;
    println!(
        "shared sidecars: {} gateways, uniform keys, no leases; c_at(b) = ({c1:.1} - {c_dec:.1}) / b + {c_dec:.1} µs, calls of {call_ms} ms, {pipeline} in flight per node",
        args.gateways
    );
    let weights = keys.weights(Dist::Uniform);
    let mut by_slot = vec![0.0; 16384];
    for (w, s) in weights.iter().zip(&keys.slot_id) {
        by_slot[*s as usize] += w;
    }
    let t = Table::new().rights(&[20, 10, 12, 10]).gap(2);
    println!(
        "{}",
        t.line(&[
            "gateways per sidecar",
            "sidecars",
            "batch/node",
            "primaries"
        ])
    );
    let g = args.gateways as f64;
    for per in [1.0, 10.0, 100.0, 1000.0] {
        if per > g {
            break;
        }
        let found = primaries_shared(
            args.target,
            &by_slot,
            g,
            per,
            c1,
            c_dec,
            call_ms,
            pipeline,
            args.utilisation,
        );
        let (p, b) = found.map_or(("none".to_string(), "-".to_string()), |(p, b)| {
            (p.to_string(), format!("{b:.1}"))
        });
        println!(
            "{}",
            t.line(&[
                format!("{per:.0}"),
                format!("{:.0}", (g / per).max(1.0)),
                b,
                p
            ])
        );
    }
}

/// The model's inputs but the cost per decision on a primary.
struct Model {
    target: f64,
    utilisation: f64,
    gateways: f64,
    replicas_per_primary: usize,
    t_ask: f64,
    c_sidecar: f64,
}

/// The model's table (primaries, replicas, cores per key distribution, with and without leases)
/// at `c_primary` µs per decision on a primary.
fn model_table(keys: &Keyspace, m: &Model, c_primary: f64) {
    let (d, u, g, t_ask, c_sidecar) = (m.target, m.utilisation, m.gateways, m.t_ask, m.c_sidecar);
    let t = Table::new()
        .left(40)
        .rights(&[12, 9, 9, 9, 9, 9, 8])
        .gap(2)
        .left(0);
    println!(
        "{}",
        t.line(&[
            "keys",
            "D_redis/s",
            "S(P)",
            "hottest",
            "primaries",
            "replicas",
            "sidecar",
            "Redis"
        ])
    );
    println!("{}", t.line(&["", "", "", "key", "", "", "cores", "cores"]));
    for dist in [Dist::Uniform, Dist::Zipf] {
        for leases in [false, true] {
            let weights = keys.weights(dist);
            let reach: Vec<f64> = weights
                .iter()
                .map(|w| {
                    if leases {
                        lease_reach(d * w / g, t_ask)
                    } else {
                        1.0
                    }
                })
                .collect();
            let reaching: Vec<f64> = weights.iter().zip(&reach).map(|(w, r)| w * r).collect();
            let d_redis = d * reaching.iter().sum::<f64>();
            let total: f64 = reaching.iter().sum();
            let mut by_slot = vec![0.0; 16384];
            for (w, s) in reaching.iter().zip(&keys.slot_id) {
                by_slot[*s as usize] += w / total;
            }
            let max_key = reaching.iter().cloned().fold(0.0, f64::max) / total;
            let p = primaries_needed(d_redis, c_primary, &by_slot, u);
            let busiest = p.map(|p| {
                shares_from_slots(&by_slot, p)
                    .into_iter()
                    .fold(0.0, f64::max)
            });
            let name = format!(
                "{}{}",
                keys.name(dist),
                if leases { ", leases" } else { "" }
            );
            let hottest_key = format!("{:.3}%", max_key * 100.0);
            let sidecar_cores = num((d_redis * c_sidecar / 1e6 / u).ceil(), 0);
            let redis_cores = num(d_redis * c_primary / 1e6, 0);
            let line = match p {
                Some(p) => t.line(&[
                    name,
                    num(d_redis, 0),
                    format!("{:.2}%", busiest.unwrap_or(0.0) * 100.0),
                    hottest_key,
                    p.to_string(),
                    (p * m.replicas_per_primary).to_string(),
                    sidecar_cores,
                    redis_cores,
                ]),
                None => t.line(&[
                    name,
                    num(d_redis, 0),
                    "-".into(),
                    hottest_key,
                    "none".into(),
                    "-".into(),
                    sidecar_cores,
                    redis_cores,
                    format!(
                        "the hottest key alone needs {:.2} primary cores at {:.0}%: no P suffices",
                        d_redis * max_key * c_primary / 1e6 / u,
                        u * 100.0
                    ),
                ]),
            };
            println!("{line}");
        }
    }
}

// ---------------------------------------------------------------------------------------------

fn main() {
    let args = Args::parse();
    assert!(
        !args.primaries.is_empty() && args.primaries.iter().all(|p| (1..=255).contains(p)),
        "--primaries: 1 to 255 each"
    );
    watch_signals();
    let started = Instant::now();
    describe_machine();
    println!(
        "stages: {} s (throughput), {} s (latency); {} callers; keys: {} uniform and Zipf s={}",
        args.seconds, args.latency_seconds, args.concurrency, args.keys, args.zipf_s
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let work = Workdir::new();
    let keys = Arc::new(Keyspace::new(args.keys, args.zipf_s));
    let upstream = Upstream::start();

    let mut part1 = args
        .parts
        .contains(&1)
        .then(|| run_part1(&args, &rt, &work, &keys, &upstream));
    if let Some(p) = &part1 {
        print_part1(&args, &keys, p);
    }
    let part2 = args.parts.contains(&2).then(|| {
        let kept = part1.as_mut().and_then(|p| p.kept.take());
        // The cluster and its sidecar stop when part 2 ends.
        let (cluster, sidecar, port) = kept.unwrap_or_else(|| cluster_of_part2(&args, &work));
        run_part2(&args, &rt, &keys, &upstream, &cluster, &sidecar, port)
    });
    if let Some(p) = &part2 {
        print_part2(&args, p);
    }
    if let Some(p) = part1.as_mut() {
        p.kept = None; // the cluster and its sidecar stop here
    }
    if args.parts.contains(&3) {
        print_part3(&args, &run_part3(&args, &work));
    }
    let part5 = args.parts.contains(&5).then(|| run_part5(&args));
    if let Some(p) = &part5 {
        print_part5(&args, p);
    }
    print_model(&args, &keys, part1.as_ref(), part2.as_ref(), part5.as_ref());
    println!(
        "\nrun took {:.0} s; load average at the end: {}",
        started.elapsed().as_secs_f64(),
        load_average()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_sidecar_batches_more_and_so_needs_fewer_primaries() {
        // One call in flight carries one decision until the pipeline is full.
        assert_eq!(batch_of_pair(1000.0, 1.0, 4), 1.0);
        assert_eq!(batch_of_pair(40_000.0, 1.0, 4), 10.0);
        let by_slot = vec![1.0 / 16384.0; 16384];
        // 1,000,000/s, 100 gateways, 15 µs per lone decision of which 5 per decision.
        let alone = primaries_shared(1e6, &by_slot, 100.0, 1.0, 15.0, 5.0, 1.0, 4, 0.5);
        let shared = primaries_shared(1e6, &by_slot, 100.0, 100.0, 15.0, 5.0, 1.0, 4, 0.5);
        let (pa, ba) = alone.unwrap();
        let (ps, bs) = shared.unwrap();
        // 30 x 0.5 core / 15 µs would be 1,000,000/s, but 30 even slot ranges leave the busiest
        // 547 of 16384 slots (3.34% > 1/30): 31.
        assert_eq!((pa, ba), (31, 1.0));
        assert!(ps < pa && bs > 1.0, "{ps} primaries at batch {bs}");
    }

    #[test]
    fn a_lease_is_renewed_when_spent_or_near_its_end() {
        // 800/s: leases of 1000 (ceil(1.25 × 800 × 1 s)) last 1.25 s, so the end of their time
        // comes first: once every 0.9 s.
        assert!((lease_renewals(800.0) - 1.0 / 0.9).abs() < 1e-9);
        // 10,000/s: leases of at most 1000 tokens are spent 10 times a second.
        assert!((lease_renewals(10_000.0) - 10.0).abs() < 1e-9);
        // Below the busy threshold every request reaches Redis; above it, one per renewal when
        // the asks wait for nothing.
        assert_eq!(lease_reach(49.0, 0.0), 1.0);
        assert!((lease_reach(10_000.0, 0.0) - 0.001).abs() < 1e-12);
        // The calibration inverts the reach.
        let reach = lease_reach(5000.0, 0.002);
        assert!((calibrate_t_ask(reach, 5000.0) - 0.002).abs() < 1e-9);
    }

    #[test]
    fn the_batch_fit_recovers_the_per_call_and_per_decision_costs() {
        let c = |b: f64| 30.0 / b + 4.0;
        let (c_call, c_dec) = batch_fit(&[(1.0, c(1.0)), (4.0, c(4.0)), (32.0, c(32.0))]).unwrap();
        assert!((c_call - 30.0).abs() < 1e-9 && (c_dec - 4.0).abs() < 1e-9);
        assert_eq!(
            batch_fit(&[(2.0, 10.0), (2.0, 11.0)]),
            None,
            "one batch size"
        );
    }

    #[test]
    fn primaries_are_added_until_the_busiest_fits() {
        let uniform = vec![1.0 / 16384.0; 16384];
        // 100,000 decisions/s at 10 µs: 1 core of work, 0.5 each allowed: 2 primaries.
        assert_eq!(primaries_needed(100_000.0, 10.0, &uniform, 0.5), Some(2));
        let mut one_hot = vec![0.0; 16384];
        one_hot[7] = 1.0;
        assert_eq!(primaries_needed(100_000.0, 10.0, &one_hot, 0.5), None);
    }
}
