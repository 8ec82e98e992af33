//! `make scale`'s parts, as library code the binary runs (`tests/src/bin/scale.rs`): the shard
//! model measured over a Redis Cluster, a hot key, the latency a hop adds, and the model.

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::load::{self, mix, ClosedLoop, Measured, Op, Warmup};
use crate::netns::{self, DelayRelay, Netns};
use crate::plugin::{lease_ask, lease_defaults, rule, Plugin};
use crate::probe::{self, Watched};
use crate::redis::even_slot_ranges;
use crate::report::{quantile, short, Table};
use crate::utilisation::{self, AtLoad, Work};
use crate::{
    wait_until, Envoy, EnvoyConfig, Process, Redis, RedisCluster, RedisOptions, Sidecar, Upstream,
    READY_TIMEOUT,
};
use clap::Parser;
use serde_json::json;

mod keys;
mod model;
mod part1;
mod part2;
mod part3;
mod part5;

pub(crate) use self::keys::*;
pub(crate) use self::model::*;
pub(crate) use self::part1::*;
pub(crate) use self::part2::*;
pub(crate) use self::part3::*;
pub(crate) use self::part5::*;

#[derive(Parser)]
#[command(
    about = "Measures the decision path over Redis Cluster shards, a hot key, network hops, and prints the shard model"
)]
pub struct Args {
    /// Seconds each throughput stage (parts 1 and 2) measures, after 1 s of warm-up.
    #[arg(long, default_value_t = 8.0)]
    pub seconds: f64,
    /// Seconds each latency stage (part 3) measures, after 0.5 s of warm-up.
    #[arg(long, default_value_t = 5.0)]
    pub latency_seconds: f64,
    /// Concurrent callers in the throughput stages (a closed loop).
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Gateway requests per `POST /v1/decide` call (one decision each) in the sidecar stages.
    #[arg(long, default_value_t = 1)]
    pub requests_per_call: usize,
    /// Distinct keys (clients) of the uniform and the Zipf workloads.
    #[arg(long, default_value_t = 100_000)]
    pub keys: usize,
    /// The Zipf exponent s: the key of rank k is drawn with weight 1/k^s.
    #[arg(long, default_value_t = 1.0)]
    pub zipf_s: f64,
    /// Cluster sizes to measure, comma separated; the first is the baseline.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    pub primaries: Vec<usize>,
    /// Parts to run, comma separated (4, the model, is always printed from what ran).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,5")]
    pub parts: Vec<u8>,
    /// Part 5: connections holding Redis at `--utilisation` (one call in flight each).
    #[arg(long, default_value_t = 32)]
    pub load_connections: usize,
    /// Part 5: rounds, the script and INCR taking turns.
    #[arg(long, default_value_t = 3)]
    pub load_rounds: usize,
    /// Skip the stages through Envoy in part 1 (part 2 always goes through Envoy).
    #[arg(long)]
    pub skip_envoy: bool,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 1)]
    pub envoy_workers: u32,
    /// Decisions per second the latency stages send (an open loop: paced, whatever the answers).
    #[arg(long, default_value_t = 1000.0)]
    pub latency_rate: f64,
    /// Round trips to add to one hop at a time, in milliseconds.
    #[arg(long, value_delimiter = ',', default_value = "0.2,1,5")]
    pub rtt_ms: Vec<f64>,
    /// How a hop's delay is made: `netem` (tc qdisc), `relay` (a userspace delay relay), or
    /// `auto` (netem when the kernel has it).
    #[arg(long, default_value = "auto", value_parser = ["auto", "netem", "relay"])]
    pub delay: String,
    /// The sidecars' `--redis-pipeline` (script calls in flight per Redis node); the sidecar's
    /// default when not given.
    #[arg(long)]
    pub redis_pipeline: Option<u64>,
    /// Part 3 also measures the sidecar-Redis hop with a sidecar started with this
    /// `--redis-pipeline` (0: not), to show what calls in flight do for a distant Redis.
    #[arg(long, default_value_t = 16)]
    pub alt_pipeline: u64,
    /// Model: decisions per second to plan for.
    #[arg(long, default_value_t = 1_000_000.0)]
    pub target: f64,
    /// Model: the busiest a Redis primary or sidecar core may be at the target load (0.5 keeps
    /// 50% headroom).
    #[arg(long, default_value_t = 0.5)]
    pub utilisation: f64,
    /// Model: replicas per primary.
    #[arg(long, default_value_t = 1)]
    pub replicas_per_primary: usize,
    /// Model: decisions per script call the fleet's calls carry. Batches form only while a
    /// sidecar has calls in flight to a node, and a large fleet splits its load over many
    /// (sidecar, primary) pairs, each carrying a few hundred decisions/s: about 1.
    #[arg(long, default_value_t = 1.0)]
    pub fleet_batch: f64,
    /// Model: gateways (Envoys) sharing the load, which decides which keys are busy enough at one
    /// gateway to be leased.
    #[arg(long, default_value_t = 100)]
    pub gateways: usize,
}

// ---------------------------------------------------------------------------------------------
// Interruption: a first Ctrl-C (or SIGTERM) ends the current stage and unwinds (every process
// killed, every namespace deleted by its Drop); a second one removes the namespaces and exits.

pub(crate) static INTERRUPTED: AtomicBool = AtomicBool::new(false);

pub(crate) fn watch_signals() {
    netns::on_interrupt(|| {
        if INTERRUPTED.swap(true, Ordering::SeqCst) {
            netns::remove_all();
            std::process::exit(130);
        }
        eprintln!("\ninterrupted: stopping and cleaning up (again to exit at once)");
    });
}

pub(crate) fn check_interrupted() {
    if INTERRUPTED.load(Ordering::SeqCst) {
        std::panic::resume_unwind(Box::new("interrupted"));
    }
}

// ---------------------------------------------------------------------------------------------
// The machine.

pub(crate) fn first_line(cmd: &str, args: &[&str]) -> String {
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

pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub(crate) fn describe_machine() {
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

/// The policy of every stage: buckets so large and slow that nothing is ever rejected and every
/// bucket touched stays in Redis for the rest of its stage (a token takes 1000 s to come back),
/// so `DBSIZE` counts the keys a stage touched. The sidecar is started with a
/// `--max-refill-seconds` that allows it.
pub(crate) const POLICY: &str = "rules:
  scale: {capacity: 999999999999, refill_per_sec: 0.001}
  scale-ip: {capacity: 999999999999, refill_per_sec: 0.001}
  hot: {capacity: 999999999999, refill_per_sec: 0.001}
";

pub(crate) struct Workdir {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) policy: PathBuf,
}

impl Workdir {
    pub(crate) fn new() -> Workdir {
        let dir = tempfile::tempdir().expect("temp dir");
        let policy = dir.path().join("limits.yaml");
        std::fs::write(&policy, POLICY).expect("write the policy");
        Workdir { dir, policy }
    }

    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// Starts the sidecar binary listening on `listen` (inside `ns` if given) with `redis` flags
/// and waits for its `/readyz`.
pub(crate) fn start_sidecar(
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
pub(crate) type NodeCounts = Arc<Vec<AtomicU64>>;

pub(crate) fn node_counts(n: usize) -> NodeCounts {
    Arc::new((0..n).map(|_| AtomicU64::new(0)).collect())
}

/// What a throughput stage measured, and the units its ops attributed to each node.
pub(crate) struct Stage {
    pub(crate) m: Measured,
    pub(crate) per_node: Vec<u64>,
}

/// `--concurrency` callers of `op` for 1 s of warm-up, then `--seconds` measured; `probe`'s
/// counters (script calls, metrics) and `counts` read as the window opens and closes.
pub(crate) fn throughput(
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
pub(crate) fn http_client(args: &Args) -> reqwest::Client {
    load::http_client(args.concurrency * 2, Duration::from_secs(10))
}

/// `POST /v1/decide` with `per_call` requests of one decision each, on keys drawn from `dist`
/// (rule `scale`) or on the hot key (rule `hot`, `dist` None); counts each decision on its node.
pub(crate) fn decide_op(
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
pub(crate) fn envoy_op(
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
pub(crate) fn plugin(leases: bool) -> String {
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
pub(crate) fn start_envoy(
    sidecar_port: u16,
    upstream_port: u16,
    workers: u32,
    leases: bool,
) -> Envoy {
    let config = EnvoyConfig::shipped("envoy.yaml", sidecar_port, upstream_port)
        .plugin(&plugin(leases))
        .concurrency(workers)
        .replace("use_remote_address: true", "use_remote_address: false");
    Envoy::start(&config)
}

// ---------------------------------------------------------------------------------------------
// Part 1: shards.

/// Runs the parts `args` asks for, printing as it goes.
pub fn run(args: Args) {
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
    pub(crate) fn a_shared_sidecar_batches_more_and_so_needs_fewer_primaries() {
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
    pub(crate) fn a_lease_is_renewed_when_spent_or_near_its_end() {
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
    pub(crate) fn the_batch_fit_recovers_the_per_call_and_per_decision_costs() {
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
    pub(crate) fn primaries_are_added_until_the_busiest_fits() {
        let uniform = vec![1.0 / 16384.0; 16384];
        // 100,000 decisions/s at 10 µs: 1 core of work, 0.5 each allowed: 2 primaries.
        assert_eq!(primaries_needed(100_000.0, 10.0, &uniform, 0.5), Some(2));
        let mut one_hot = vec![0.0; 16384];
        one_hot[7] = 1.0;
        assert_eq!(primaries_needed(100_000.0, 10.0, &one_hot, 0.5), None);
    }
}
