//! Redis Cluster: three primaries started by the test, buckets spread over slots and nodes, one
//! script call per node for the keys of many slots, refunds across nodes, and settle batches
//! recorded per node.

mod support;

use std::time::{Duration, Instant};

use ratelimit_e2e::RedisCluster;
use serde_json::json;
use support::{bucket, decision, stored, unique, Sidecar};

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

/// Which primary (by port) serves `key`: the others answer MOVED.
fn node_of(cluster: &RedisCluster, key: &str) -> u16 {
    cluster
        .nodes
        .iter()
        .find(|n| !n.cli(&["EXISTS", key]).contains("MOVED"))
        .map(|n| n.port)
        .expect("some primary serves the slot")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_over_300_buckets_succeed_and_spread_over_three_primaries() {
    let (cluster, sidecar) = cluster_and_sidecar().await;
    let prefix = unique("spread");
    // 30 calls of 10 requests of one decision each: each call spans many slots of every node,
    // which one script call per node decides.
    for batch in 0..30 {
        let requests: Vec<_> = (0..10)
            .map(|i| json!({"decisions": [decision("b5", &format!("{prefix}-{batch}-{i}"), 1)]}))
            .collect();
        let (status, a) = sidecar.call(json!(requests), json!({})).await;
        assert_eq!(status, 200, "call {batch}: {a}");
        for answer in a["answers"].as_array().unwrap() {
            assert_eq!(answer["allowed"], true, "{a}");
            assert_eq!(answer["results"][0]["remaining"], 4, "{a}");
        }
    }
    for node in &cluster.nodes {
        // Buckets only (`rl:{...}`): each node also holds the store's epoch marker.
        let keys = node
            .cli(&["KEYS", "rl:{*"])
            .lines()
            .filter(|l| !l.is_empty())
            .count();
        println!("node {} holds {keys} buckets", node.port);
        assert!(keys > 0, "node {} holds no bucket", node.port);
    }
    let calls = sidecar
        .metric("ratelimit_script_call_decisions_count")
        .await;
    println!("300 decisions in {calls} script calls");
    assert!(
        calls <= 30.0 * 3.0,
        "one call per node per call at most: {calls}"
    );
    let (_, readyz) = sidecar.get("/readyz").await;
    assert!(readyz.contains("\"script_loaded\":true"), "{readyz}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_on_one_node_refunds_the_node_that_charged() {
    let (cluster, sidecar) = cluster_and_sidecar().await;
    // Two clients whose buckets live on different primaries.
    let rich = unique("rich");
    let poor = (0..100)
        .map(|i| format!("poor-{i}-{rich}"))
        .find(|p| node_of(&cluster, &bucket("b2", p)) != node_of(&cluster, &bucket("b10", &rich)))
        .expect("some id lands on another node");
    let (_, a) = sidecar.decide(json!([decision("b2", &poor, 2)])).await;
    assert_eq!(a["allowed"], true);

    // The rich node charges, the poor one rejects: the rich one is refunded.
    let both = json!([decision("b10", &rich, 3), decision("b2", &poor, 1)]);
    let (status, a) = sidecar.decide(both.clone()).await;
    assert_eq!(status, 200);
    assert_eq!(a["allowed"], false, "{a}");
    assert_eq!(a["results"][0]["allowed"], true);
    assert_eq!(a["results"][0]["remaining"], 10, "as after the refund: {a}");
    assert_eq!(a["results"][1]["reason"], "insufficient");
    let started = Instant::now();
    while sidecar.metric("ratelimit_compensations_total").await < 1.0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "never refunded"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut c = cluster.client();
    let tokens = stored(&mut c, &bucket("b10", &rich)).unwrap().tokens;
    assert!((9.99..=10.0).contains(&tokens), "refunded: {tokens}");

    // The same call with the caller's attempt id, twice: refunded once, answered alike.
    let (_, first) = sidecar
        .call(json!([{"decisions": both}]), json!({"attempt": "c-7"}))
        .await;
    while sidecar.metric("ratelimit_compensations_total").await < 2.0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "never refunded"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (_, second) = sidecar
        .call(json!([{"decisions": both}]), json!({"attempt": "c-7"}))
        .await;
    assert_eq!(first["answers"][0]["allowed"], false);
    // A repeat of a refunded call replays it: not allowed, not charged again.
    assert_eq!(second["answers"][0]["allowed"], false, "{second}");
    assert_eq!(
        second["answers"][0]["results"][0]["allowed"], false,
        "{second}"
    );
    let tokens = stored(&mut c, &bucket("b10", &rich)).unwrap().tokens;
    assert!(
        (9.99..=10.0).contains(&tokens),
        "never double-refunded: {tokens}"
    );
    assert_eq!(sidecar.metric("ratelimit_compensations_total").await, 2.0);
}

/// Moves the slot of `key` (and the keys in it) from the primary serving it to another one.
fn migrate_slot(cluster: &RedisCluster, key: &str) -> (u16, u16) {
    let from = node_of(cluster, key);
    let src = cluster.nodes.iter().find(|n| n.port == from).unwrap();
    let dst = cluster.nodes.iter().find(|n| n.port != from).unwrap();
    let slot = src.cli(&["CLUSTER", "KEYSLOT", key]).trim().to_string();
    let id = |n: &ratelimit_e2e::Redis| n.cli(&["CLUSTER", "MYID"]).trim().to_string();
    let (src_id, dst_id) = (id(src), id(dst));
    assert!(dst
        .cli(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &src_id])
        .contains("OK"));
    assert!(src
        .cli(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &dst_id])
        .contains("OK"));
    let keys = src.cli(&["CLUSTER", "GETKEYSINSLOT", &slot, "1000"]);
    for k in keys.lines().map(str::trim).filter(|k| !k.is_empty()) {
        let moved = src.cli(&[
            "MIGRATE",
            "127.0.0.1",
            &dst.port.to_string(),
            k,
            "0",
            "5000",
        ]);
        assert!(moved.contains("OK"), "MIGRATE {k}: {moved}");
    }
    for n in &cluster.nodes {
        assert!(n
            .cli(&["CLUSTER", "SETSLOT", &slot, "NODE", &dst_id])
            .contains("OK"));
    }
    (from, dst.port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_whose_slot_moved_is_decided_on_its_new_primary_and_charged_once() {
    let (cluster, sidecar) = cluster_and_sidecar().await;
    let client = unique("moving");
    let key = bucket("b10", &client);
    let (_, a) = sidecar.decide(json!([decision("b10", &client, 3)])).await;
    assert_eq!(a["allowed"], true, "{a}");

    let (from, to) = migrate_slot(&cluster, &key);
    assert_eq!(node_of(&cluster, &key), to, "moved off {from}");

    // The sidecar's slot map still names the old primary: it answers MOVED before writing
    // anything, the map is read again, and the decision runs once, on the new primary.
    let (status, a) = sidecar.decide(json!([decision("b10", &client, 2)])).await;
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["allowed"], true, "{a}");
    let remaining = a["results"][0]["remaining"].as_u64().unwrap();
    assert!(
        (5..=6).contains(&remaining),
        "the migrated bucket continued (10 - 3 - 2, plus refill): {a}"
    );
    let mut c = cluster.client();
    let tokens = stored(&mut c, &key).unwrap().tokens;
    assert!(
        (5.0..7.0).contains(&tokens),
        "charged once on the new primary: {tokens}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_batch_over_many_slots_is_applied_once_per_node() {
    let (cluster, sidecar) = cluster_and_sidecar().await;
    let prefix = unique("settle");
    let ids: Vec<String> = (0..30).map(|i| format!("{prefix}-{i}")).collect();
    let mut receipts = Vec::new();
    for id in &ids {
        let mut d = decision("b10", id, 8);
        d["receipt"] = json!(true);
        let (_, a) = sidecar.decide(json!([d])).await;
        assert_eq!(a["results"][0]["remaining"], 2, "{a}");
        receipts.push(a["results"][0]["receipt"].as_str().unwrap().to_string());
    }
    let body = json!({"id": "batch-1", "settlements": ids.iter().zip(&receipts)
        .map(|(id, r)| json!({"rule": "b10", "subject": {"id": id}, "reserved": 8, "cost": 3, "receipt": r}))
        .collect::<Vec<_>>()});
    let post = || async {
        let r = sidecar
            .http
            .post(format!("{}/v1/settle", sidecar.base))
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        (
            r.status().as_u16(),
            r.json::<serde_json::Value>().await.unwrap(),
        )
    };
    let (status, a) = post().await;
    assert_eq!(
        (status, a.clone()),
        (200, json!({"applied": 30, "repeated": 0, "skipped": 0}))
    );
    let nodes: std::collections::HashSet<u16> = ids
        .iter()
        .map(|id| node_of(&cluster, &bucket("b10", id)))
        .collect();
    assert_eq!(nodes.len(), 3, "the batch spans every primary");
    let tokens = |id: &str| {
        let key = bucket("b10", id);
        let node = cluster
            .nodes
            .iter()
            .find(|n| n.port == node_of(&cluster, &key))
            .unwrap();
        stored(&mut node.connection(), &key).unwrap().tokens
    };
    for id in &ids {
        assert_eq!(tokens(id).floor(), 7.0, "{id}: 2 left + 5 given back");
    }
    // The same batch again (a retry after a lost answer): every node's part is a repeat.
    let (_, a) = post().await;
    assert_eq!(a, json!({"applied": 0, "repeated": 30, "skipped": 0}));
    for id in &ids {
        assert_eq!(tokens(id).floor(), 7.0, "{id}: applied once");
    }
}
