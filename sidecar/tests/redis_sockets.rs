//! The sidecar binary's connections to Redis carry `TCP_NODELAY` on every topology: one node, a
//! Cluster's primaries, the Sentinels and the primary they name. redis-rs leaves Nagle's
//! algorithm on, and with it a script call written while an earlier one is unacknowledged waits
//! for the earlier call's reply (docs/scaling.md, part 3).

use std::path::Path;

use ratelimit_e2e::sockets::tcp_nodelay_to;
use ratelimit_e2e::{decide_body, free_port, http, Redis, RedisCluster, Sentinel, Sidecar};

fn sidecar(args: &[&str]) -> Sidecar {
    let mut s = Sidecar::spawn(
        Path::new(env!("CARGO_BIN_EXE_ratelimit-sidecar")),
        free_port(),
        args,
    );
    s.wait_ready();
    s
}

/// Decisions on `n` keys, so that every node of a Cluster holds some.
fn decide(s: &Sidecar, n: usize) {
    let client = http();
    for i in 0..n {
        let r = client
            .post(format!("{}/v1/decide", s.base_url()))
            .body(decide_body(&format!("nodelay-{i}"), 10, 1.0, 1))
            .send()
            .expect("decide");
        assert_eq!(r.status(), 200);
    }
}

/// The sidecar's connections to `port`: at least one, each with `TCP_NODELAY`.
fn assert_nodelay(s: &Sidecar, port: u16, what: &str) {
    let got = tcp_nodelay_to(s.process.pid(), port);
    assert!(!got.is_empty(), "no connection to {what} (port {port})");
    assert!(
        got.iter().all(|&on| on),
        "TCP_NODELAY off on some connection to {what} (port {port}): {got:?}"
    );
}

#[test]
fn connections_to_one_redis_have_nodelay() {
    let redis = Redis::start();
    let s = sidecar(&["--redis", &redis.url(), "--redis-connections", "2"]);
    decide(&s, 4);
    assert_nodelay(&s, redis.port, "Redis");
}

#[test]
fn connections_to_every_cluster_primary_have_nodelay() {
    let cluster = RedisCluster::start();
    let s = sidecar(&["--redis-cluster", &cluster.seeds()]);
    decide(&s, 30);
    for node in &cluster.nodes {
        assert_nodelay(&s, node.port, "a Cluster primary");
    }
}

#[test]
fn connections_to_the_sentinels_and_their_primary_have_nodelay() {
    let primary = Redis::start();
    let sentinel = Sentinel::start("mymaster", primary.port, 1);
    let s = sidecar(&[
        "--redis-sentinel",
        &sentinel.url(),
        "--sentinel-master",
        "mymaster",
    ]);
    decide(&s, 4);
    assert_nodelay(&s, primary.port, "the primary Sentinel names");
    assert_nodelay(&s, sentinel.port, "the Sentinel");
}
