//! Redis Cluster: three primaries started by the test, keys spread over slots and nodes.

mod support;

use std::time::{Duration, Instant};

use ratelimit_e2e::RedisCluster;
use redis::Commands;
use serde_json::json;
use support::{decision, unique, Sidecar};

/// A fresh 3-primary Cluster and a ready sidecar on it.
async fn cluster_and_sidecar() -> (RedisCluster, Sidecar) {
    let cluster = RedisCluster::start();
    let sidecar = Sidecar::start(&[
        "--redis-cluster",
        &cluster.seeds(),
        "--redis-timeout-ms",
        "2000",
    ])
    .await;
    sidecar.wait_ready("/readyz").await;
    (cluster, sidecar)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_over_300_keys_succeed_and_spread_over_three_primaries() {
    let (cluster, sidecar) = cluster_and_sidecar().await;
    let prefix = unique("spread");
    // 30 requests of 10 keys each: every request spans several slots (the cross-slot path).
    for batch in 0..30 {
        let decisions: Vec<_> = (0..10)
            .map(|i| decision(&format!("{prefix}-{batch}-{i}"), 5.0, 1.0, 1.0))
            .collect();
        let (status, a) = sidecar.decide(json!(decisions)).await;
        assert_eq!(status, 200, "{a}");
        assert_eq!(a["allowed"], true, "{a}");
        assert!(a["results"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["remaining"] == 4));
    }
    for node in &cluster.nodes {
        let keys: u64 = node.cli(&["DBSIZE"]).trim().parse().unwrap();
        println!("node {} holds {keys} keys", node.port);
        assert!(keys > 0, "node {} holds no bucket", node.port);
    }
    let (_, readyz) = sidecar.get("/readyz").await;
    assert!(readyz.contains("\"script_loaded\":true"), "{readyz}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cross_slot_rejection_refunds_the_slot_that_charged() {
    let (cluster, sidecar) = cluster_and_sidecar().await;
    let (rich, poor) = (unique("rich"), unique("poor"));
    let (rich_key, poor_key) = (format!("rl:{{{rich}}}"), format!("rl:{{{poor}}}"));
    assert_ne!(
        ratelimit_sidecar::decide::cluster_slot(rich_key.as_bytes()),
        ratelimit_sidecar::decide::cluster_slot(poor_key.as_bytes())
    );
    let (_, a) = sidecar
        .decide(json!([decision(&poor, 2.0, 0.001, 2.0)]))
        .await;
    assert_eq!(a["allowed"], true);

    // The rich slot charges, the poor one rejects: the rich one is refunded.
    let (status, a) = sidecar
        .decide(json!([
            decision(&rich, 10.0, 0.001, 3.0),
            decision(&poor, 2.0, 0.001, 1.0)
        ]))
        .await;
    assert_eq!(status, 200);
    assert_eq!(a["allowed"], false, "{a}");
    assert_eq!(a["results"][0]["allowed"], true);
    assert_eq!(a["results"][0]["remaining"], 10, "refunded: {a}");
    assert_eq!(a["results"][1]["reason"], "insufficient");
    // The refund runs after the answer: poll for it.
    let mut c = cluster.client();
    let refunded = |c: &mut redis::cluster::ClusterConnection| {
        let tokens: f64 = c.hget(&rich_key, "tokens").unwrap();
        tokens
    };
    let started = Instant::now();
    while sidecar.metric("ratelimit_compensations_total").await < 1.0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "never refunded"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let tokens = refunded(&mut c);
    assert!((9.99..=10.0).contains(&tokens), "refunded: {tokens}");
    assert_eq!(sidecar.metric("ratelimit_compensations_total").await, 1.0);

    // The same request with a caller's attempt id, twice: refunded once, answered alike.
    let mut decisions = json!([
        decision(&rich, 10.0, 0.001, 3.0),
        decision(&poor, 2.0, 0.001, 1.0)
    ]);
    for d in decisions.as_array_mut().unwrap() {
        d["attempt"] = json!("r-7");
    }
    let (_, first) = sidecar.decide(decisions.clone()).await;
    while sidecar.metric("ratelimit_compensations_total").await < 2.0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "never refunded"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (_, second) = sidecar.decide(decisions).await;
    assert_eq!(first["allowed"], false);
    // A repeat of a refunded attempt replays it: not allowed, not charged again.
    assert_eq!(second["allowed"], false, "{second}");
    assert_eq!(second["results"][0]["allowed"], false, "{second}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let tokens = refunded(&mut c);
    assert!(
        (9.99..=10.0).contains(&tokens),
        "never double-refunded: {tokens}"
    );
}
