//! Scenario 4: a primary killed under Sentinel and on a Cluster, the charges lost at promotion measured.

use super::*;

pub(crate) struct Failover {
    pub(crate) samples: Vec<Sample>,
    pub(crate) killed_at: Duration,
    pub(crate) lag_bytes: i64,
    pub(crate) capacity: f64,
    pub(crate) refill: f64,
    /// Single charges (a fresh bucket of 1 each, no refill) acknowledged, and how many of them a
    /// repeat after the failover admitted again (their write was lost at promotion).
    pub(crate) charges: usize,
    pub(crate) lost: usize,
}

/// A fresh bucket of one token charged: its subject's id when the charge was answered allowed.
pub(crate) struct Charged(Option<String>);

impl Outcome for Charged {
    fn failed(&self) -> bool {
        self.0.is_none()
    }
}

/// Charges fresh buckets of one token (rule `once`) straight at the sidecar from 2 callers
/// until finished (5 ms between two charges not answered allowed).
pub(crate) fn charge_fresh_keys(url: String) -> Background<Charged> {
    let client = load::http_client(2, Duration::from_secs(10));
    let op = load::op(move |call| {
        let id = format!("k-{}-{}", call.caller, call.n + 1);
        let (client, url) = (client.clone(), url.clone());
        async move {
            let allowed = once(&client, &url, &id).await == Some(true);
            Charged(allowed.then_some(id))
        }
    });
    Background::start(
        1,
        vec![Callers::new(0, 2, op).backoff(Duration::from_millis(5))],
    )
}

/// Replication offsets: what `primary` wrote that `replica` had not received, in bytes.
pub(crate) fn lag_bytes(primary: &Redis, replica: &Redis) -> i64 {
    let offset = |r: &Redis, k: &str| -> i64 {
        probe::info(r, "replication")
            .get(k)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    // The replica first: the difference can only overstate the lag.
    let received = offset(replica, "slave_repl_offset");
    (offset(primary, "master_repl_offset") - received).max(0)
}

/// Loads `envoy` on one key, and after `a.seconds` runs `kill` (which kills the primary and
/// returns the replication lag it saw just before); keeps the load until decisions have gone
/// 2 s without a limiter error (at most 30 s after the kill).
pub(crate) fn failover_run(
    a: &Args,
    e: &Envoy,
    sidecar: &Sidecar,
    kill: impl FnOnce() -> i64,
) -> Failover {
    let load = start_load(vec![
        Clients::new(0, a.clients, &[e.url("/api/x")]).header("x-api-key", "alpha-key")
    ]);
    let url = format!("{}/v1/decide", sidecar.base_url());
    let charging = charge_fresh_keys(url.clone());
    sleep(Duration::from_secs(a.seconds));
    let killed_at = load.now();
    let lag_bytes = kill();
    let admitted = || counters(&[e], "ratelimit.admitted");
    let errors = || counters(&[e], "ratelimit.limiter_error");
    let deadline = Instant::now() + Duration::from_secs(30);
    // Until no limiter error for 2 s while decisions are admitted again.
    let mut quiet_since: Option<(Instant, u64, u64)> = None;
    while Instant::now() < deadline {
        sleep(Duration::from_millis(100));
        let (ad, er) = (admitted(), errors());
        match quiet_since {
            Some((t, a0, e0)) if er == e0 => {
                if t.elapsed() > Duration::from_secs(2) && ad > a0 {
                    break;
                }
            }
            _ => quiet_since = Some((Instant::now(), ad, er)),
        }
    }
    let samples = load.finish();
    let charged: Vec<String> = charging
        .finish()
        .into_iter()
        .filter_map(|s| s.outcome.0)
        .collect();
    // Every bucket of one token answered allowed must now be empty: a repeat admitted again
    // found the write of its charge lost at the promotion.
    let c = load::http_client(1, Duration::from_secs(10));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let lost = rt.block_on(async {
        let mut lost = 0;
        for id in &charged {
            if once(&c, &url, id).await == Some(true) {
                lost += 1;
            }
        }
        lost
    });
    Failover {
        samples,
        killed_at,
        lag_bytes,
        capacity: 0.0,
        refill: 0.0,
        charges: charged.len(),
        lost,
    }
}

pub(crate) fn failover_row(name: &str, topology: &str, f: Failover, envoy: &Envoy) -> Row {
    let all = figures(&f.samples);
    let during: Vec<&Sample> = f.samples.iter().filter(|s| s.at >= f.killed_at).collect();
    let rec = recovery(&f.samples, 0, f.killed_at, Duration::MAX);
    let meanwhile = during
        .iter()
        .filter(|s| s.at <= f.killed_at + rec && s.failed())
        .count();
    let t = all.span.as_secs_f64();
    let bound = f.capacity + f.refill * t;
    let over = (all.admitted as f64 - bound.floor()).max(0.0);
    Row {
        scenario: format!("4 failover, {name}"),
        load: format!(
            "{} req on 1 key, {} + {}/s; {topology}",
            all.n, f.capacity, f.refill
        ),
        fault: "primary killed (SIGKILL)".into(),
        admitted: all.admitted.to_string(),
        rejected: all.rejected.to_string(),
        over: format!(
            "{over} on the hot key (≤ C + r·T = {bound:.0}); {} on {} buckets of 1 (writes lost)",
            f.lost, f.charges
        ),
        client: p50_p99(&all),
        filter: filter_cell(&[envoy]),
        errors: errors_by_kind(&f.samples),
        recovery: format!("{} after the kill; {meanwhile} req denied (on_error deny) meanwhile", ms(rec)),
        check: format!(
            "hot key admitted ≤ C + r·T + lost = {:.0} {}; writes lost at promotion: {} of {} single charges admitted again when repeated (replication lag at the kill {} B)",
            bound + f.lost as f64,
            mark(all.admitted as f64 <= bound.floor() + f.lost as f64),
            f.lost,
            f.charges,
            f.lag_bytes
        ),
    }
}

pub(crate) fn failover(a: &Args) -> Vec<Row> {
    let (capacity, refill) = (100.0, 100.0);
    let policy = format!(
        "rules:\n  per-app: {{capacity: {capacity}, refill_per_sec: {refill}}}\n  once: {{capacity: 1, refill_per_sec: 0.001}}\n"
    );
    let rules = json!([rule("per-app", "/api/", &["app"], "deny")]);
    let p = plugin(rules, FILTER_TIMEOUT_MS);
    let upstream = Upstream::start();
    let mut rows = Vec::new();

    // Sentinel: a primary, its replica, three Sentinels (quorum 2, down-after 1 s).
    {
        let mut primary = Redis::start();
        let replica = Redis::start_with(&["--replicaof", "127.0.0.1", &primary.port.to_string()]);
        replica.wait_linked();
        let sentinels: Vec<Sentinel> = (0..3)
            .map(|_| Sentinel::start("mymaster", primary.port, 2))
            .collect();
        let urls: Vec<String> = sentinels.iter().map(Sentinel::url).collect();
        let sidecar = Sidecar::start_with_args(
            &policy,
            &[
                "--redis-sentinel",
                &urls.join(","),
                "--sentinel-master",
                "mymaster",
            ],
        );
        let e = envoy(&sidecar, &upstream, &p);
        log("4: Sentinel failover, load");
        let mut f = failover_run(a, &e, &sidecar, || {
            let lag = lag_bytes(&primary, &replica);
            primary.stop();
            lag
        });
        f.capacity = capacity;
        f.refill = refill;
        rows.push(failover_row(
            "Sentinel",
            "primary + replica + 3 Sentinels (down-after 1 s)",
            f,
            &e,
        ));
    }

    // Cluster: three primaries with a replica each (node timeout 2 s).
    {
        let mut cluster = RedisCluster::start_replicated(2000);
        let sidecar = Sidecar::start_with_args(&policy, &["--redis-cluster", &cluster.seeds()]);
        let e = envoy(&sidecar, &upstream, &p);
        let key = "rl:{ratelimit|rule=per-app|app=alpha}";
        let p_index = cluster.primary_of(key).expect("a primary serves the key");
        let r_index = cluster
            .replica_of(p_index)
            .expect("the primary has a replica");
        log("4: Cluster failover, load");
        let mut f = failover_run(a, &e, &sidecar, || {
            let lag = lag_bytes(&cluster.nodes[p_index], &cluster.nodes[r_index]);
            cluster.nodes[p_index].stop();
            lag
        });
        f.capacity = capacity;
        f.refill = refill;
        rows.push(failover_row(
            "Cluster",
            "3 primaries + 1 replica each (node timeout 2 s)",
            f,
            &e,
        ));
    }
    rows
}

// ---------------------------------------------------------------------------------------------
// 5. Uncertain results: the reply is lost after Redis applied the call.
