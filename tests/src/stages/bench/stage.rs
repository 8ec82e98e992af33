//! One measured stage: the bench's processes, a stage's result and how it is printed.

use super::*;

/// What every stage runs against: Redis, the sidecar and an upstream, started once.
pub(crate) struct Bench {
    pub(crate) args: Args,
    pub(crate) sidecar: Sidecar,
    pub(crate) redis: Redis,
    pub(crate) upstream: Upstream,
    /// The filter's build and the filter that does nothing.
    pub(crate) wasm: PathBuf,
    pub(crate) noop_wasm: PathBuf,
    pub(crate) wasm_size: u64,
    pub(crate) http: reqwest::Client,
}

impl Bench {
    /// Prints what runs where, then starts the processes.
    pub(crate) fn start(args: Args) -> Bench {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let wasm = Envoy::wasm();
        let noop_wasm =
            crate::workspace_root().join("target/wasm32-wasip1/release/ratelimit_noop_filter.wasm");
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
    pub(crate) fn watched(&self) -> Vec<Watched> {
        self.watched_with(&self.sidecar)
    }

    /// Redis and `sidecar` (the bench's, or another on the same Redis).
    pub(crate) fn watched_with(&self, sidecar: &Sidecar) -> Vec<Watched> {
        vec![
            Watched::new("redis", self.redis.pid()),
            Watched::new("sidecar", sidecar.process.pid()),
        ]
    }

    /// Measures `op` with `callers` callers and the bench's warm-up and length.
    pub(crate) async fn stage(
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
    pub(crate) fn envoy(&self, filter: Filter, fast: bool, workers: u32) -> EnvoyConfig {
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
    pub(crate) fn native(&self, workers: u32) -> EnvoyConfig {
        self.native_to(&self.sidecar, workers)
    }

    /// [`Bench::native`] calling `sidecar`.
    pub(crate) fn native_to(&self, sidecar: &Sidecar, workers: u32) -> EnvoyConfig {
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
            sidecar.port,
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
    pub(crate) fn rlqs(&self, workers: u32) -> EnvoyConfig {
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
    pub(crate) async fn envoy_stage(
        &self,
        name: String,
        config: EnvoyConfig,
        workload: Workload,
        callers: usize,
    ) -> (StageResult, f64) {
        self.envoy_stage_with(name, config, workload, callers, &self.sidecar)
            .await
    }

    /// [`Bench::envoy_stage`] with `sidecar` watched (the one `config` calls).
    pub(crate) async fn envoy_stage_with(
        &self,
        name: String,
        config: EnvoyConfig,
        workload: Workload,
        callers: usize,
        sidecar: &Sidecar,
    ) -> (StageResult, f64) {
        // Stopped however the stage ends: a stage that panics (its warm-up failing) leaves no
        // Envoy running behind the bench.
        let envoy = off_runtime(move || Envoy::start(&config)).await;
        let mut watched = self.watched_with(sidecar);
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
pub(crate) async fn off_runtime<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .expect("a blocking step of the bench panicked")
}

/// The filter's callouts per request it decided (admitted or rejected), since Envoy started.
pub(crate) fn callouts_per_request(envoy: &Envoy) -> f64 {
    probe::envoy_stat(envoy, "ratelimit.callouts")
        / (probe::envoy_stat(envoy, "ratelimit.admitted")
            + probe::envoy_stat(envoy, "ratelimit.rejected"))
        .max(1.0)
}

// ---------------------------------------------------------------------------------------------
// Stages and their table.

#[derive(Clone)]
pub(crate) struct StageResult {
    pub(crate) name: String,
    /// Operations completed (requests, calls).
    pub(crate) ops: u64,
    /// Decisions per operation (a batched call carries several).
    pub(crate) per_op: usize,
    pub(crate) seconds: f64,
    pub(crate) p50: Duration,
    pub(crate) p99: Duration,
    /// CPU µs per operation, by process.
    pub(crate) cpu_us_per_op: Vec<(String, f64)>,
}

impl StageResult {
    /// A measured stage: the watched processes' CPU per operation, then the load generator's.
    pub(crate) fn of(name: &str, per_op: usize, watched: &[Watched], m: &Measured) -> StageResult {
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
    pub(crate) fn per_second(&self) -> f64 {
        self.ops as f64 / self.seconds
    }
    pub(crate) fn cpu(&self, process: &str) -> f64 {
        self.cpu_us_per_op
            .iter()
            .find(|(n, _)| n == process)
            .map_or(0.0, |(_, v)| *v)
    }
    /// CPU µs per decision of a process.
    pub(crate) fn cpu_per_decision(&self, process: &str) -> f64 {
        self.cpu(process) / self.per_op as f64
    }
    /// CPU µs per operation of every process but the load generator.
    pub(crate) fn stack_cpu(&self) -> f64 {
        self.cpu_us_per_op
            .iter()
            .filter(|(n, _)| n != "load generator")
            .map(|(_, v)| v)
            .sum()
    }
}

/// The table every stage is a line of.
pub(crate) fn stage_table() -> Table {
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

pub(crate) fn print_header() {
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

pub(crate) fn print(r: &StageResult, baseline: Option<&StageResult>) {
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
pub(crate) fn print_note(text: &str) {
    println!("{}", stage_table().note(text));
}

/// Where Redis spent its time during a stage (since `CONFIG RESETSTAT`): script calls, requests
/// per call (with the fast paths, most requests never reach Redis), the µs per call inside
/// `EVALSHA` and of the commands it ran, and the keys that expired (a bucket full again is
/// deleted; a quiet client's next decision creates it anew). The counts include the stage's
/// start (Envoy starting, the warm-up): "about".
pub(crate) fn redis_breakdown(redis: &Redis, r: &StageResult) -> String {
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

/// One stage measured in several rounds, as one: the median of each figure (throughput,
/// latencies, each process's CPU) over the rounds.
pub(crate) fn median_stage(rounds: &[&StageResult]) -> StageResult {
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
