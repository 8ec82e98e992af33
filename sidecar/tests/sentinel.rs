//! Redis Sentinel: a primary, its replica and three Sentinels started by the test; the primary
//! dies, Sentinel promotes the replica, and the sidecar carries on with the replicated buckets
//! without a restart.

mod support;

use std::time::{Duration, Instant};

use ratelimit_e2e::{free_port, Redis, Sentinel};
use serde_json::{json, Value};
use support::{decision, unique, Sidecar};

const MASTER: &str = "mymaster";

/// Polls `check` every 50 ms until it holds (bounded by `limit`).
async fn poll(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let started = Instant::now();
    while !check() {
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_decisions_reach_the_promoted_replica_and_buckets_continue() {
    let mut primary = Redis::start();
    let primary_port = primary.port.to_string();
    let replica = Redis::start_with(&["--replicaof", "127.0.0.1", &primary_port]);
    poll(
        "the replica's link to the primary",
        Duration::from_secs(30),
        || {
            replica
                .cli(&["INFO", "replication"])
                .contains("master_link_status:up")
        },
    )
    .await;
    let sentinels: Vec<Sentinel> = (0..3)
        .map(|_| Sentinel::start(MASTER, primary.port, 2))
        .collect();
    let urls: Vec<String> = sentinels.iter().map(Sentinel::url).collect();
    let sidecar = Sidecar::start(&[
        "--redis-sentinel",
        &urls.join(","),
        "--sentinel-master",
        MASTER,
        "--redis-timeout-ms",
        "2000",
    ])
    .await;
    sidecar.wait_ready("/readyz").await;

    let key = unique("failover");
    let one = json!([decision(&key, 10.0, 0.001, 1.0)]);
    let remaining = |a: &Value| a["results"][0]["remaining"].as_u64();
    for charge in 1..=4 {
        let (status, a) = sidecar.decide(one.clone()).await;
        assert_eq!(status, 200, "{a}");
        assert_eq!(remaining(&a), Some(10 - charge), "{a}");
    }
    // Every write so far acknowledged by the replica, and the bucket is there.
    assert_eq!(primary.cli(&["WAIT", "1", "10000"]), "1");
    let bucket = format!("rl:{{{key}}}");
    poll("the bucket on the replica", Duration::from_secs(10), || {
        replica.cli(&["EXISTS", &bucket]) == "1"
    })
    .await;
    let loads_before = sidecar.metric("ratelimit_script_loads_total").await;

    primary.stop();
    let killed = Instant::now();
    poll(
        "Sentinel promoting the replica",
        Duration::from_secs(60),
        || {
            sentinels
                .iter()
                .any(|s| s.master_port() == Some(replica.port))
        },
    )
    .await;
    let promoted_ms = killed.elapsed().as_millis();

    let errors_before = sidecar.metric("ratelimit_redis_errors_total").await;
    let a = loop {
        let (status, a) = sidecar.decide(one.clone()).await;
        if status == 200 {
            break a;
        }
        assert_eq!(status, 503, "{a}");
        assert!(!a.to_string().contains("NOSCRIPT"), "{a}");
        assert!(
            killed.elapsed() < Duration::from_secs(90),
            "decisions never reached the new primary: {a}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let recovered_ms = killed.elapsed().as_millis();
    assert_eq!(
        remaining(&a),
        Some(5),
        "the bucket continued from the replicated state, not a full bucket: {a}"
    );
    assert_eq!(replica.cli(&["ROLE"]).lines().next(), Some("master"));
    let loads_after = sidecar.metric("ratelimit_script_loads_total").await;
    let (status, body) = sidecar.get("/readyz").await;
    assert_eq!(status, 200, "ready on the new primary: {body}");
    let errors = sidecar.metric("ratelimit_redis_errors_total").await - errors_before;
    println!(
        "failover: Sentinel named the replica {promoted_ms} ms after the primary died; the \
         sidecar decided on it {recovered_ms} ms after ({errors} redis errors meanwhile, \
         script loads {loads_before} -> {loads_after})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_starts_while_the_sentinels_are_unreachable_and_is_not_ready() {
    let urls: Vec<String> = (0..3)
        .map(|_| format!("redis://127.0.0.1:{}", free_port()))
        .collect();
    let sidecar = Sidecar::start(&[
        "--redis-sentinel",
        &urls.join(","),
        "--redis-timeout-ms",
        "2000",
    ])
    .await;
    let (ready, a) = sidecar.assert_up_but_unavailable().await;
    assert!(ready.contains("--redis-sentinel"), "{ready}");
    assert!(a["error"]
        .as_str()
        .unwrap()
        .starts_with("redis unavailable"));
}
