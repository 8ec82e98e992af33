//! The sidecar binary's connections to Redis carry `TCP_NODELAY` and keepalive probes on every
//! topology: one node, a Cluster's primaries, the Sentinels and the primary they name. redis-rs
//! leaves both off: with Nagle's algorithm on, a script call written while an earlier one is
//! unacknowledged waits for the earlier call's reply (docs/scaling.md, part 3); without probes,
//! a NAT or load balancer may forget an idle connection without a word.

use std::path::Path;

use ratelimit_e2e::sockets::{tcp_options_to, TcpOptions};
use ratelimit_e2e::{decide_body, free_port, http, Redis, RedisCluster, Sentinel, Sidecar};
use ratelimit_sidecar::store::redis::connection::REDIS_KEEPALIVE;

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

/// The sidecar's connections to `port`: at least one, each with `TCP_NODELAY` and the
/// keepalive probes of [`REDIS_KEEPALIVE`].
fn assert_options(s: &Sidecar, port: u16, what: &str) {
    let (idle, interval, count) = REDIS_KEEPALIVE;
    let want = TcpOptions {
        nodelay: true,
        keepalive: Some((idle.as_secs() as u32, interval.as_secs() as u32, count)),
    };
    let got = tcp_options_to(s.process.pid(), port);
    assert!(!got.is_empty(), "no connection to {what} (port {port})");
    assert!(
        got.iter().all(|o| *o == want),
        "a connection to {what} (port {port}) without {want:?}: {got:?}"
    );
}

#[test]
fn connections_to_one_redis_have_nodelay_and_keepalive() {
    let redis = Redis::start();
    let s = sidecar(&["--redis", &redis.url(), "--redis-connections", "2"]);
    decide(&s, 4);
    assert_options(&s, redis.port, "Redis");
}

#[test]
fn connections_to_every_cluster_primary_have_nodelay_and_keepalive() {
    let cluster = RedisCluster::start();
    let s = sidecar(&["--redis-cluster", &cluster.seeds()]);
    decide(&s, 30);
    for node in &cluster.nodes {
        assert_options(&s, node.port, "a Cluster primary");
    }
}

#[test]
fn connections_to_the_sentinels_and_their_primary_have_nodelay_and_keepalive() {
    let primary = Redis::start();
    let sentinel = Sentinel::start("mymaster", primary.port, 1);
    let s = sidecar(&[
        "--redis-sentinel",
        &sentinel.url(),
        "--sentinel-master",
        "mymaster",
    ]);
    decide(&s, 4);
    assert_options(&s, primary.port, "the primary Sentinel names");
    assert_options(&s, sentinel.port, "the Sentinel");
}
