//! Part 2: a hot key with and without leases.

use super::*;

pub(crate) struct HotStage {
    pub(crate) name: &'static str,
    pub(crate) m: Measured,
    /// Decisions that reached the sidecar (and Redis) during the measured window.
    pub(crate) decisions: f64,
    /// Script calls of the hot shard during the measured window.
    pub(crate) script_calls: f64,
    /// Requests answered from a lease in Envoy, per admitted request.
    pub(crate) lease_share: f64,
}

pub(crate) struct Part2 {
    pub(crate) primaries: usize,
    pub(crate) hot_node: usize,
    pub(crate) stages: Vec<HotStage>,
}

impl HotStage {
    pub(crate) fn per_admitted(&self, v: f64) -> f64 {
        v / self.m.ops.max(1) as f64
    }
}

pub(crate) fn run_part2(
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

pub(crate) fn print_part2(args: &Args, part: &Part2) {
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
