//! `envoy/docker-compose.distributed.yml`, started for real (`make compose-test`): two gateways
//! (an Envoy and a sidecar each) on one budget in a Redis primary with a replica and three
//! Sentinels, on a private network. One budget across both gateways (exact counts, over-admission
//! 0), the primary paused (every rule's `on_error` within the filter's deadline, no failover),
//! the primary killed (Sentinel fails over, decisions resume, the charges lost measured as `make
//! reliability` measures them), one gateway's sidecar cut off from Redis with `docker network
//! disconnect` while the other keeps deciding, and `down` leaving nothing. The figures it prints
//! are in docs/failure-behaviour.md.

#[path = "common/docker_compose.rs"]
mod docker_compose;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use docker_compose::{
    docker, envoy_stat, filter_counter, metric, ports_free, sidecar_metrics, Project,
};
use ratelimit_e2e::scenario::{burst_to, get, one_connection_client, Answer, ALPHA};
use ratelimit_e2e::{http, wait_until};
use serde_json::{json, Value};

/// The two gateways: (listener, Envoy admin, sidecar admin) as the file publishes them.
const GATEWAYS: [(&str, u16, u16, u16); 2] = [("a", 10001, 9911, 9091), ("b", 10002, 9912, 9092)];
/// compose/envoy.yaml: the filter's callout deadline, the `per-app` emergency bucket.
const TIMEOUT_MS: u64 = 50;
const EMERGENCY: (f64, f64) = (10.0, 1.0);
/// How far past the deadline an answer may come here (Docker's proxying, a busy machine).
const SLACK_MS: u64 = 450;
/// The file's addresses on the redis network.
const PRIMARY: &str = "10.89.0.10";
const REPLICA: &str = "10.89.0.11";
/// `per-app` for the demo key, as shipped; the lease share the sidecar grants (its default).
const CAPACITY: f64 = 100.0;
const REFILL: f64 = 10.0;
const LEASE: f64 = 0.1 * CAPACITY;

/// The policy of the run: envoy/limits.yaml's numbers for the demo key; clients without a key
/// share 20 tokens that do not refill (an exact count); `per-ip` out of the way (every request of
/// the test comes from one address per gateway network); `once`, a bucket of one token per key,
/// for the charges a failover loses (as `make reliability` counts them).
const POLICY: &str = "\
domain: ratelimit
rules:
  per-app:
    capacity: 100
    refill_per_sec: 10
    overrides:
      - when: {app: null}
        name: unknown-apps
        capacity: 20
        refill_per_sec: 0.001
  per-ip: {capacity: 1000000, refill_per_sec: 1000000}
  once: {capacity: 1, refill_per_sec: 0.001}
";

fn url(port: u16, path: &str) -> String {
    format!("http://127.0.0.1:{port}{path}")
}

/// A counter of the filter summed over both gateways.
fn both(name: &str) -> u64 {
    GATEWAYS.iter().map(|g| filter_counter(g.2, name)).sum()
}

/// Requests the emergency buckets admitted, over both gateways.
fn emergency_admitted() -> u64 {
    both("emergency_activations") - both("emergency_rejected")
}

fn count(answers: &[Answer], status: u16) -> usize {
    answers.iter().filter(|a| a.status == status).count()
}

fn slowest(answers: &[Answer]) -> Duration {
    answers.iter().map(|a| a.elapsed).max().unwrap_or_default()
}

fn median(answers: &[Answer]) -> Duration {
    let mut t: Vec<Duration> = answers.iter().map(|a| a.elapsed).collect();
    t.sort();
    t[t.len() / 2]
}

/// Requests to both gateways in turn, one after the other, for `how_long`.
fn alternate_for(how_long: Duration, path: &str, headers: &[(&str, &str)]) -> [Vec<Answer>; 2] {
    let client = http();
    let mut answers = [Vec::new(), Vec::new()];
    let end = Instant::now() + how_long;
    let mut i = 0;
    while Instant::now() < end {
        answers[i % 2].push(get(&client, &url(GATEWAYS[i % 2].1, path), headers));
        i += 1;
    }
    answers
}

/// The primary the Sentinels name (`address:port`).
fn sentinels_primary(stack: &Project) -> String {
    let out = stack.redis_cli(
        "sentinel-1",
        &[
            "-p",
            "26379",
            "sentinel",
            "get-master-addr-by-name",
            "mymaster",
        ],
    );
    out.split_whitespace().collect::<Vec<_>>().join(":")
}

/// One decision of rule `once` for `id` straight at a sidecar: allowed or not (None: no answer).
fn once(client: &reqwest::blocking::Client, sidecar: &str, token: &str, id: &str) -> Option<bool> {
    let body =
        json!({"requests": [{"decisions": [{"rule": "once", "subject": {"id": id}, "cost": 1}]}]});
    let r = client
        .post(format!("http://{sidecar}:8081/v1/decide"))
        .bearer_auth(token)
        .json(&body)
        .send()
        .ok()?;
    if r.status() != 200 {
        return None;
    }
    let v: Value = r.json().ok()?;
    v["answers"][0]["allowed"].as_bool()
}

#[test]
#[ignore = "needs Docker and the images of `make images`: run `make compose-test`"]
fn two_gateways_share_one_budget_and_ride_out_a_paused_a_killed_primary_and_a_cut_off_sidecar() {
    let ports: Vec<u16> = GATEWAYS.iter().flat_map(|g| [g.1, g.2, g.3]).collect();
    ports_free(&ports);
    let mut stack = Project::new("docker-compose.distributed.yml");
    stack.write_policy(POLICY);
    let took = stack.up();
    println!("up --wait: 9 services healthy in {took:.1?}");
    assert_eq!(sentinels_primary(&stack), format!("{PRIMARY}:6379"));

    // One budget, exactly: clients without a key share 20 tokens across both gateways. Paced
    // below the rate at which a gateway asks for a lease (50/s a worker), every decision is
    // Redis's, so exactly 20 pass, whichever gateway they come to.
    let client = http();
    let (errors, emergency) = (both("limiter_error"), emergency_admitted());
    let mut statuses = Vec::new();
    for i in 0..30 {
        let paced = Instant::now();
        statuses.push(get(&client, &url(GATEWAYS[i % 2].1, "/api/exact"), &[]).status);
        std::thread::sleep(Duration::from_millis(40).saturating_sub(paced.elapsed()));
    }
    let admitted = statuses.iter().filter(|s| **s == 200).count() as u64;
    let by_emergency = emergency_admitted() - emergency;
    println!("one budget, paced: {admitted} of 30 admitted over both gateways ({by_emergency} by an emergency bucket)");
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 429),
        "{statuses:?}"
    );
    if both("limiter_error") == errors {
        assert_eq!(admitted, 20, "exactly the shared bucket: {statuses:?}");
        assert!(statuses[..20].iter().all(|s| *s == 200), "{statuses:?}");
    } else {
        // A decision that timed out may have been charged: fewer, never more.
        assert!(
            admitted - by_emergency <= 20,
            "over-admission: {statuses:?}"
        );
    }

    // One budget under a burst: the demo key from 8 clients over both gateways, leases and known
    // rejections at work. Never more than C + r·T; what the leases strand is bounded.
    let admitted_before = both("admitted");
    let upstream_before: u64 = GATEWAYS
        .iter()
        .map(|g| envoy_stat(g.2, "cluster.demo_upstream.upstream_rq_200"))
        .sum();
    let (errors, emergency) = (both("limiter_error"), emergency_admitted());
    let urls: Vec<String> = GATEWAYS.iter().map(|g| url(g.1, "/api/burst")).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let start = Instant::now();
    let answers = burst_to(&urls, &[ALPHA], 600, 8);
    let t = start.elapsed().as_secs_f64();
    let admitted = count(&answers, 200) as f64;
    let by_emergency = (emergency_admitted() - emergency) as f64;
    let errors = (both("limiter_error") - errors) as f64;
    let bound = (CAPACITY + REFILL * t).floor();
    let lower = CAPACITY + REFILL * t - 2.0 * 2.0 * LEASE - errors;
    println!(
        "one budget, burst: {admitted} of 600 admitted in {t:.2} s over both gateways (≤ C + r·T = {bound}, \
         ≥ C + r·T − 2N·L − errors = {lower:.0}; {by_emergency} by an emergency bucket, {errors} limiter errors)"
    );
    assert_eq!(
        count(&answers, 200) + count(&answers, 429),
        600,
        "only 200 and 429"
    );
    assert!(
        admitted - by_emergency <= bound,
        "over-admission: {admitted} > {bound} (+{by_emergency} emergency)"
    );
    assert!(
        admitted >= lower,
        "{admitted} < {lower:.0}: more budget stranded than leases can hold"
    );
    assert_eq!(
        both("admitted") - admitted_before,
        admitted as u64,
        "the filters' count"
    );
    let upstream: u64 = GATEWAYS
        .iter()
        .map(|g| envoy_stat(g.2, "cluster.demo_upstream.upstream_rq_200"))
        .sum();
    assert_eq!(
        upstream - upstream_before,
        admitted as u64,
        "only admitted requests reach the upstream"
    );
    for g in GATEWAYS {
        let metrics = sidecar_metrics(g.3);
        assert!(
            metric(
                &metrics,
                "ratelimit_decisions_total{limit=\"per-app\",verdict=\"allowed\"}"
            ) > 0.0,
            "gateway {} decided nothing",
            g.0
        );
    }

    // The primary paused (a stalled Redis; shorter than the Sentinels' 2 s down-after): each
    // answer comes within the filter's deadline, by the rules' on_error (per-app: the emergency
    // bucket; per-ip: allow), and decisions resume once it runs again, with no failover.
    std::thread::sleep(Duration::from_millis(1200)); // no lease or known rejection left
    let primary = stack.container("redis-primary");
    let emergency = emergency_admitted();
    docker(&["pause", &primary]);
    let paused = alternate_for(Duration::from_millis(900), "/api/paused", &[ALPHA]);
    docker(&["unpause", &primary]);
    let all: Vec<&Answer> = paused.iter().flatten().collect();
    let by_emergency = emergency_admitted() - emergency;
    let (p50, max) = {
        let mut t: Vec<Duration> = all.iter().map(|a| a.elapsed).collect();
        t.sort();
        (t[t.len() / 2], t[t.len() - 1])
    };
    println!(
        "primary paused 0.9 s: {} requests, {} admitted (the emergency buckets: {by_emergency}), p50 {p50:.1?}, slowest {max:.1?}",
        all.len(),
        all.iter().filter(|a| a.status == 200).count()
    );
    assert!(all.iter().all(|a| a.status == 200 || a.status == 429));
    assert!(by_emergency >= 1 && by_emergency as f64 <= 2.0 * (EMERGENCY.0 + EMERGENCY.1));
    assert!(
        max < Duration::from_millis(TIMEOUT_MS + SLACK_MS),
        "slowest answer {max:?}"
    );
    let resumed = Instant::now();
    for g in GATEWAYS {
        let c = http();
        wait_until("decisions after the pause", Duration::from_secs(30), || {
            let errors = filter_counter(g.2, "limiter_error");
            get(&c, &url(g.1, "/resume"), &[]).status == 200
                && filter_counter(g.2, "limiter_error") == errors
        });
    }
    println!(
        "  decisions resumed {:.1?} after the unpause",
        resumed.elapsed()
    );
    assert_eq!(
        sentinels_primary(&stack),
        format!("{PRIMARY}:6379"),
        "a pause is no failover"
    );

    // The primary killed under load: the Sentinels promote the replica, both sidecars follow,
    // decisions resume. The loss: fresh buckets of one token charged straight at both sidecars
    // until the failover is over; one that admits again when repeated lost its charge.
    std::thread::sleep(Duration::from_millis(1200));
    let sidecars: Vec<String> = GATEWAYS
        .iter()
        .map(|g| stack.address(&format!("sidecar-{}", g.0), &format!("gateway-{}", g.0)))
        .collect();
    let stop = AtomicBool::new(false);
    let charged = Mutex::new(Vec::new());
    let load = Mutex::new(Vec::new());
    let (admitted_before, emergency_before) = (both("admitted"), emergency_admitted());
    let calls = |port: u16| {
        let m = sidecar_metrics(port);
        let outcome = |o: &str| {
            metric(
                &m,
                &format!("ratelimit_calls_total{{api=\"stream\",outcome=\"{o}\"}}"),
            )
        };
        (outcome("answered"), outcome("unavailable"))
    };
    let mut recovered: [Option<Duration>; 2] = [None, None];
    let (lag, load_span) = std::thread::scope(|s| {
        for (i, sidecar) in sidecars.iter().enumerate() {
            let (stop, charged, token) = (&stop, &charged, &stack.token);
            s.spawn(move || {
                let c = http();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let id = format!("k-{i}-{n}");
                    if once(&c, sidecar, token, &id) == Some(true) {
                        charged.lock().unwrap().push((i, id));
                    }
                }
            });
        }
        for t in 0..4 {
            let (stop, load) = (&stop, &load);
            s.spawn(move || {
                let c = one_connection_client();
                let mut mine = Vec::new();
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    mine.push(get(&c, &url(GATEWAYS[i % 2].1, "/api/failover"), &[ALPHA]));
                    i += 1;
                }
                load.lock().unwrap().extend(mine);
            });
        }
        let start = Instant::now();
        std::thread::sleep(Duration::from_secs(2));
        let offset = |info: &str, field: &str| -> i64 {
            info.lines()
                .find_map(|l| {
                    l.trim()
                        .strip_prefix(field)?
                        .strip_prefix(':')?
                        .parse()
                        .ok()
                })
                .unwrap_or(0)
        };
        let replica_info = stack.redis_cli("redis-replica", &["info", "replication"]);
        let primary_info = stack.redis_cli("redis-primary", &["info", "replication"]);
        let lag = (offset(&primary_info, "master_repl_offset")
            - offset(&replica_info, "slave_repl_offset"))
        .max(0);
        docker(&["kill", &primary]);
        let killed = Instant::now();
        // A sidecar has recovered when it answers a decision again after answering "unavailable"
        // for the first time since the kill. The load goes on until both have, and 2 s more.
        let mut first_unavailable: [Option<(f64, f64)>; 2] = [None, None];
        let before: Vec<(f64, f64)> = GATEWAYS.iter().map(|g| calls(g.3)).collect();
        while recovered.iter().any(Option::is_none) && killed.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(50));
            for (i, g) in GATEWAYS.iter().enumerate() {
                let (answered, unavailable) = calls(g.3);
                match first_unavailable[i] {
                    None if unavailable > before[i].1 => {
                        first_unavailable[i] = Some((answered, unavailable))
                    }
                    Some((a0, _)) if recovered[i].is_none() && answered > a0 => {
                        recovered[i] = Some(killed.elapsed())
                    }
                    _ => {}
                }
            }
        }
        std::thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::Relaxed);
        (lag, start.elapsed())
    });
    let recovery = recovered
        .iter()
        .map(|r| r.expect("a sidecar did not decide again within 60 s of the kill"))
        .max()
        .unwrap();
    let charged = charged.into_inner().unwrap();
    let c = http();
    let lost = charged
        .iter()
        .filter(|(i, id)| once(&c, &sidecars[*i], &stack.token, id) == Some(true))
        .count();
    let load = load.into_inner().unwrap();
    let admitted = both("admitted") - admitted_before;
    let by_emergency = emergency_admitted() - emergency_before;
    let span = load_span.as_secs_f64();
    let bound = (CAPACITY + REFILL * span).floor() + lost as f64;
    println!(
        "primary killed: Sentinel promoted {}; both sidecars decided again {recovery:.1?} after the kill \
         (a {:.1?}, b {:.1?}); \
         {lost} of {} charges lost (replication lag at the kill {lag} B); hot key {} admitted of {} \
         in {span:.1} s (≤ C + r·T + lost = {bound}, +{by_emergency} by the emergency buckets)",
        sentinels_primary(&stack),
        recovered[0].unwrap(),
        recovered[1].unwrap(),
        charged.len(),
        admitted,
        load.len()
    );
    assert_eq!(
        sentinels_primary(&stack),
        format!("{REPLICA}:6379"),
        "the replica is the primary"
    );
    assert!(!charged.is_empty(), "no charge answered");
    assert!(lost <= charged.len());
    assert!(
        (admitted - by_emergency) as f64 <= bound,
        "over-admission on the hot key: {admitted} - {by_emergency} emergency > {bound}"
    );
    assert!(load.iter().all(|a| a.status == 200 || a.status == 429));
    // The old primary started again: the Sentinels make it a replica of the new one.
    stack.compose(&["start", "redis-primary"]);
    wait_until(
        "the old primary following the new one",
        Duration::from_secs(60),
        || {
            let info = stack.redis_cli("redis-primary", &["info", "replication"]);
            info.contains("role:slave") && info.contains("master_link_status:up")
        },
    );
    println!("  the old primary, started again, replicates {REPLICA}");

    // Gateway a's sidecar cut off from the redis network: a answers by its on_error within the
    // deadline, b keeps deciding; connected again, a decides again.
    std::thread::sleep(Duration::from_millis(1200));
    let sidecar_a = stack.container("sidecar-a");
    let network = stack.network("redis");
    let (errors_a, errors_b) = (
        filter_counter(GATEWAYS[0].2, "limiter_error"),
        filter_counter(GATEWAYS[1].2, "limiter_error"),
    );
    let decided_b = metric(
        &sidecar_metrics(GATEWAYS[1].3),
        "ratelimit_calls_total{api=\"stream\",outcome=\"answered\"}",
    );
    docker(&["network", "disconnect", &network, &sidecar_a]);
    let [a, b] = alternate_for(Duration::from_millis(1500), "/api/cut", &[ALPHA]);
    let errors = [
        filter_counter(GATEWAYS[0].2, "limiter_error") - errors_a,
        filter_counter(GATEWAYS[1].2, "limiter_error") - errors_b,
    ];
    let b_decided = metric(
        &sidecar_metrics(GATEWAYS[1].3),
        "ratelimit_calls_total{api=\"stream\",outcome=\"answered\"}",
    ) - decided_b;
    println!(
        "gateway a cut off: a {} requests, {} limiter errors, p50 {:.1?}, slowest {:.1?}; b {} requests, {} limiter errors, {b_decided} callouts answered",
        a.len(),
        errors[0],
        median(&a),
        slowest(&a),
        b.len(),
        errors[1]
    );
    assert!(errors[0] >= 1, "gateway a saw no limiter error");
    assert_eq!(errors[1], 0, "gateway b kept deciding");
    assert!(b_decided >= 1.0, "gateway b's sidecar answered no callout");
    assert!(a
        .iter()
        .chain(&b)
        .all(|x| x.status == 200 || x.status == 429));
    assert!(
        slowest(&a) < Duration::from_millis(TIMEOUT_MS + SLACK_MS),
        "slowest answer {:?}",
        slowest(&a)
    );
    docker(&["network", "connect", &network, &sidecar_a]);
    let reconnected = Instant::now();
    let c = http();
    wait_until("gateway a deciding again", Duration::from_secs(60), || {
        let errors = filter_counter(GATEWAYS[0].2, "limiter_error");
        get(&c, &url(GATEWAYS[0].1, "/resume"), &[]).status == 200
            && filter_counter(GATEWAYS[0].2, "limiter_error") == errors
    });
    println!(
        "  connected again: a decides {:.1?} later",
        reconnected.elapsed()
    );

    let took = stack.down();
    println!("down: no container, network or volume left ({took:.1?})");
}
