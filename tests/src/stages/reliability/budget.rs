//! Scenarios 1 and 2: one budget shared by two gateways, and a hot key.

use super::*;

pub(crate) fn shared_budget(a: &Args) -> Vec<Row> {
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

pub(crate) fn hot_key(a: &Args) -> Vec<Row> {
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
