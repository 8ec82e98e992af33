//! Part 1: the decision path over a Redis Cluster of 1, 2 and 3 primaries.

use super::*;

/// One stage of part 1 and what the nodes held after it.
pub(crate) struct ShardStage {
    pub(crate) path: &'static str,
    pub(crate) dist: Dist,
    pub(crate) primaries: usize,
    pub(crate) replica: bool,
    pub(crate) m: Measured,
    /// Decisions (sidecar path) or requests (Envoy path) the load generator sent per node.
    pub(crate) per_node: Vec<u64>,
    /// Keys each node held after the stage (`DBSIZE`).
    pub(crate) keys_per_node: Vec<u64>,
    /// Decisions that reached the sidecar (its metric), for the Envoy path.
    pub(crate) sidecar_decisions: f64,
    /// Script calls per node.
    pub(crate) calls_per_node: Vec<u64>,
    /// µs each node spent inside script calls (its `INFO commandstats`).
    pub(crate) script_us_per_node: Vec<f64>,
    pub(crate) predicted_shares: Vec<f64>,
}

impl ShardStage {
    pub(crate) fn decisions(&self) -> f64 {
        if self.path == "sidecar" {
            self.m.ops as f64 * self.per_call() as f64
        } else {
            self.sidecar_decisions
        }
    }

    pub(crate) fn per_call(&self) -> usize {
        let total: u64 = self.per_node.iter().sum();
        (total as f64 / self.m.ops.max(1) as f64).round().max(1.0) as usize
    }

    pub(crate) fn node_cpu(&self, i: usize) -> f64 {
        self.m.cpu.of(&format!("redis-{i}"))
    }

    pub(crate) fn redis_cpu(&self) -> f64 {
        (0..self.primaries).map(|i| self.node_cpu(i)).sum()
    }

    /// Redis CPU µs per decision, all primaries together.
    pub(crate) fn redis_us(&self) -> f64 {
        self.redis_cpu() * 1e6 / self.decisions().max(1.0)
    }

    pub(crate) fn sidecar_us(&self) -> f64 {
        self.m.cpu.of("sidecar") * 1e6 / self.decisions().max(1.0)
    }

    /// The node with the most units, and its share of units, CPU and keys.
    pub(crate) fn hottest(&self) -> (usize, f64, f64, f64) {
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
pub(crate) fn cluster_watch(cluster: &RedisCluster) -> Vec<Watched> {
    cluster
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| Watched::new(format!("redis-{i}"), n.pid()))
        .collect()
}

pub(crate) fn flush(cluster: &RedisCluster) {
    for n in &cluster.nodes {
        n.cli(&["FLUSHALL"]);
    }
}

/// A cluster-enabled node that becomes a replica of node 0 of `cluster`.
pub(crate) fn add_replica(cluster: &RedisCluster) -> Redis {
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
    replica.wait_linked();
    replica
}

pub(crate) struct Part1 {
    pub(crate) stages: Vec<ShardStage>,
    /// The last cluster and its sidecar, kept for part 2.
    pub(crate) kept: Option<(RedisCluster, Process, u16)>,
}

pub(crate) fn run_part1(
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
        let sidecar_port = crate::free_port();
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
pub(crate) fn num(v: f64, decimals: usize) -> String {
    format!("{v:.decimals$}")
}

/// A share as a percentage with one decimal.
pub(crate) fn pct(share: f64) -> String {
    format!("{:.1}%", share * 100.0)
}

pub(crate) fn print_part1(args: &Args, keys: &Keyspace, part: &Part1) {
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
pub(crate) fn cluster_of_part2(args: &Args, work: &Workdir) -> (RedisCluster, Process, u16) {
    let p = *args.primaries.last().expect("a size");
    let cluster = RedisCluster::start_primaries(p);
    let port = crate::free_port();
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
