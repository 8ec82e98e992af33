//! Envoy with each filter, per worker count: the floor, this project, the peers, RLQS, and the A/B of two filter builds.

use super::*;

/// What the wasm filter slot of the shipped config holds in a stage.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Filter<'a> {
    None,
    Noop,
    LocalRateLimit,
    /// The filter, this build of it.
    Wasm(&'a Path),
}

/// The lines of the shipped config's filter chain where the wasm filter starts and where the
/// router (after it) does.
pub(crate) const WASM_FILTER: &str = "          - name: envoy.filters.http.wasm";

pub(crate) const ROUTER: &str = "          - name: envoy.filters.http.router";

pub(crate) const LOCAL_RATELIMIT: &str = r#"          - name: envoy.filters.http.local_ratelimit
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
pub(crate) async fn envoy_stages(b: &Bench, workers: u32) -> (EnvoyRun, Vec<EnvoyRun>, AtLimit) {
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
pub(crate) async fn envoy_round(b: &Bench, workers: u32) -> EnvoyRun {
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

/// Many keys again with `--loaded-concurrency` callers: the fast paths' batches grow with the
/// load.
pub(crate) async fn loaded_stages(b: &Bench, workers: u32) -> Loaded {
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
pub(crate) struct AtLimit {
    pub(crate) admitted: u64,
    pub(crate) rejected: u64,
    pub(crate) errors: u64,
    pub(crate) seconds: f64,
    pub(crate) callouts: f64,
}

impl AtLimit {
    /// What the bucket could admit at most in the stage: `C + r·T`.
    pub(crate) fn exact_bound(&self) -> f64 {
        EDGE_CAPACITY + EDGE_REFILL * self.seconds
    }
    /// What leases can withhold from one Envoy at most: two leases (the one in use and the
    /// next) of `L = min(max_tokens, max_share × C)` each (docs/fast-paths.md, deviation).
    pub(crate) fn lease_bound() -> f64 {
        2.0 * max_lease_tokens(EDGE_CAPACITY)
    }
    pub(crate) fn over(&self) -> f64 {
        (self.admitted as f64 - self.exact_bound().floor()).max(0.0)
    }
    pub(crate) fn under(&self) -> f64 {
        (self.exact_bound() - self.admitted as f64).max(0.0)
    }
}

/// Runs the at-its-limit stage against a fresh Envoy: `--concurrency` callers as one client
/// (its address names the worker count, so every run has a bucket of its own), no warm-up (the
/// bucket is full at the first request), `--seconds` long. Every answer is counted: 200
/// admitted, 429 rejected, anything else an error.
pub(crate) async fn at_limit_stage(b: &Bench, workers: u32) -> AtLimit {
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

// ---------------------------------------------------------------------------------------------
// The summary and the goals.

/// Envoy stage results of one worker count.
pub(crate) struct EnvoyRun {
    pub(crate) workers: u32,
    pub(crate) baseline: StageResult,
    pub(crate) noop: StageResult,
    pub(crate) local: StageResult,
    /// (workload, per-request callout, fast paths, callouts per request with fast paths)
    pub(crate) wasm: Vec<(Workload, StageResult, StageResult, f64)>,
    /// (workload, Envoy's native filter over gRPC)
    pub(crate) native: Vec<(Workload, StageResult)>,
    /// (workload, Envoy's quota filter with the sidecar as its RLQS server)
    pub(crate) rlqs: Vec<(Workload, StageResult)>,
    /// The many-keys stages under load.
    pub(crate) loaded: Option<Loaded>,
    /// (workload, the filter as shipped, callouts per request) for the workloads measured
    /// beside the goals' ([`Workload::EXTRA`]).
    pub(crate) extra: Vec<(Workload, StageResult, f64)>,
}

/// The many-keys stages again with `--loaded-concurrency` callers.
pub(crate) struct Loaded {
    pub(crate) concurrency: usize,
    pub(crate) baseline: StageResult,
    pub(crate) noop: StageResult,
    pub(crate) slow: StageResult,
    pub(crate) fast: StageResult,
    pub(crate) callouts: f64,
}

impl EnvoyRun {
    /// The rounds of one worker count as one run: every stage's medians.
    pub(crate) fn median(rounds: &[EnvoyRun]) -> EnvoyRun {
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
    pub(crate) fn print(&self) {
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
pub(crate) struct Judged {
    pub(crate) key: String,
    /// What is measured, for the round-by-round lines.
    pub(crate) label: &'static str,
    /// The goal, as printed: `>= 0.85`.
    pub(crate) want: &'static str,
    pub(crate) shown: String,
    pub(crate) ok: bool,
}

/// Every goal with a verdict, judged on `run`. `script_redis` is Redis's CPU per decision for
/// the script with one decision per call (the component stage).
pub(crate) fn judge(run: &EnvoyRun, script_redis: f64) -> Vec<Judged> {
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
pub(crate) fn print_rounds(
    workers: u32,
    medians: &[Judged],
    rounds: &[EnvoyRun],
    script_redis: f64,
) {
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
