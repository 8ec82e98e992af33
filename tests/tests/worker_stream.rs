//! The stream per worker, in a real Envoy of two workers calling a
//! real sidecar: every worker sends its batches on its own gRPC stream and every answer reaches
//! its own request, exactly (no request handed to another worker); a frozen sidecar leaves the
//! calls on the stream unanswered and their requests get their failure policy within their
//! deadline; a sidecar killed and started again on its port closes the streams, the requests
//! they carried get their failure policy, and the next batches reopen them; a sidecar asked to
//! stop ends the open streams and exits; settlements, slot renewals and releases and the epoch
//! poll ride the streams too; a sidecar cluster kept on HTTP/1.1 works as well.

use std::time::Duration;

use nix::sys::signal::Signal;
use ratelimit_e2e::rounds::{assert_exact, round};
use ratelimit_e2e::scenario::plugin_with;
use ratelimit_e2e::{http, wait_until, Envoy, EnvoyConfig, FaultProxy, Redis, Sidecar, Upstream};
use serde_json::{json, Value};

/// Clients of a round, told apart by address (X-Forwarded-For).
const KEYS: usize = 60;
/// Each client's bucket: 2 tokens, a refill too slow to matter in a test.
const POLICY: &str = "rules:\n  per-ip: {capacity: 2, refill_per_sec: 0.001}\n";

/// An Envoy of two workers as shipped (the stream per worker, on a sidecar cluster that speaks
/// HTTP/2), one rule per client address; leases off, so every request is decided by the sidecar.
fn envoy(sidecar_port: u16, upstream: &Upstream, timeout_ms: u64) -> Envoy {
    Envoy::start(&envoy_config(sidecar_port, upstream, timeout_ms))
}

fn envoy_config(sidecar_port: u16, upstream: &Upstream, timeout_ms: u64) -> EnvoyConfig {
    config_with(
        sidecar_port,
        upstream,
        timeout_ms,
        json!({"leases": {"enabled": false}}),
    )
}

fn config_with(
    sidecar_port: u16,
    upstream: &Upstream,
    timeout_ms: u64,
    fast_paths: Value,
) -> EnvoyConfig {
    let rules = json!([{"name": "per-ip", "match": {"path_prefix": "/"}, "subject": ["ip"],
                        "on_error": "deny"}]);
    let mut plugin = plugin_with(rules, timeout_ms);
    plugin["fast_paths"] = fast_paths;
    EnvoyConfig::shipped("envoy.yaml", sidecar_port, upstream.port)
        .plugin(&plugin.to_string())
        // The client's address comes from X-Forwarded-For (as behind a trusted balancer).
        .replace("use_remote_address: true", "use_remote_address: false")
        .concurrency(2)
}

fn stream_calls(sidecar: &Sidecar) -> f64 {
    sidecar.metric("ratelimit_calls_total{api=\"stream\",outcome=\"answered\"}")
}

fn http_calls(sidecar: &Sidecar) -> f64 {
    sidecar.metric("ratelimit_calls_total{api=\"http\",outcome=\"answered\"}")
}

#[test]
fn every_worker_decides_on_its_own_stream_and_every_answer_reaches_its_own_request() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    // Redis's answers held 20 ms on their way to the sidecar: requests pile up while a call is
    // out, so calls carry many, and several are in flight on a stream at once.
    let slow = FaultProxy::start(redis.port);
    let sidecar = Sidecar::with_policy(&slow.url(), POLICY, &["--redis-timeout-ms", "1000"]);
    let envoy = envoy(sidecar.port, &upstream, 2000);
    slow.delay_replies(20);
    let hits = upstream.hits() as usize;
    let answers = round(&envoy, 1, KEYS, 4);
    assert_exact(&answers, KEYS, 4);
    assert_eq!(upstream.hits() as usize - hits, 2 * KEYS);
    let (calls, http) = (stream_calls(&sidecar), http_calls(&sidecar));
    let callouts = envoy.counter("ratelimit.callouts");
    println!(
        "{} requests, {callouts} calls on the streams ({calls} answered by the sidecar), {http} HTTP decision calls",
        answers.len()
    );
    assert!(calls > 0.0, "no call came on a stream");
    assert_eq!(http, 0.0, "a decision went over HTTP");
    assert!((callouts as usize) < answers.len(), "calls carry batches");
}

#[test]
fn without_coalescing_each_request_is_a_call_of_its_own_on_the_stream() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    let sidecar = Sidecar::with_policy(&redis.url(), POLICY, &["--redis-timeout-ms", "1000"]);
    let off = json!({"coalesce": false, "known_rejections": false, "leases": {"enabled": false}});
    let envoy = Envoy::start(&config_with(sidecar.port, &upstream, 2000, off));
    let answers = round(&envoy, 1, KEYS, 3);
    assert_exact(&answers, KEYS, 3);
    assert_eq!(
        envoy.counter("ratelimit.callouts") as usize,
        answers.len(),
        "a call per request"
    );
    assert_eq!(stream_calls(&sidecar) as usize, answers.len());
    assert_eq!(http_calls(&sidecar), 0.0, "a decision went over HTTP");
}

#[test]
fn a_frozen_or_restarted_sidecar_fails_the_calls_on_the_stream_by_their_policy_and_it_reopens() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    // 250 ms of Redis timeout stays below the filter's 300 on a loaded machine.
    let mut sidecar = Sidecar::with_policy(&redis.url(), POLICY, &["--redis-timeout-ms", "250"]);
    let port = sidecar.port;
    let envoy = envoy(port, &upstream, 300);
    assert_exact(&round(&envoy, 1, KEYS, 3), KEYS, 3);

    sidecar.process.signal(Signal::SIGSTOP);
    let frozen = round(&envoy, 2, 40, 1);
    sidecar.process.signal(Signal::SIGCONT);
    let slowest = frozen.iter().map(|a| a.elapsed).max().unwrap_or_default();
    println!("sidecar frozen: 40 requests, the slowest answered in {slowest:?}");
    // `on_error: deny` answers every request 503 by its deadline (300 ms, the next tick after).
    assert!(
        frozen.iter().all(|a| a.status == 503),
        "fail closed answers 503"
    );
    assert!(frozen.iter().all(|a| a.elapsed < Duration::from_secs(2)));
    assert!(envoy.counter("ratelimit.failed_closed") >= 40);
    // The same stream carries on once the sidecar wakes.
    assert_exact(&round(&envoy, 3, KEYS, 3), KEYS, 3);

    // Killed: the streams close (requests meanwhile fail closed), and reopen to the sidecar
    // started again on the same port.
    sidecar.process.stop();
    let down = round(&envoy, 4, 20, 1);
    assert!(
        down.iter().all(|a| a.status == 503),
        "fail closed answers 503"
    );
    assert!(
        envoy
            .process
            .log()
            .contains("the stream to the sidecar (cluster \"ratelimit_sidecar\") closed"),
        "Envoy's log says the stream closed"
    );
    let mut sidecar = Sidecar::start_on(port, &redis.url(), POLICY, &["--redis-timeout-ms", "250"]);
    // Each worker reopens its stream at its next batch after its backoff (up to 1 s): decisions
    // resume when a round of new connections, which reach both workers, is all admitted (each
    // try with clients of its own).
    let mut tries = 10..250u8;
    wait_until(
        "decisions resume on both workers",
        Duration::from_secs(30),
        || {
            let r = tries.next().expect("tries left");
            round(&envoy, r, 8, 1).iter().all(|a| a.status == 200)
        },
    );
    assert_exact(&round(&envoy, 5, KEYS, 3), KEYS, 3);
    assert!(stream_calls(&sidecar) > 0.0);
    assert_eq!(http_calls(&sidecar), 0.0, "a decision went over HTTP");

    // Asked to stop, the sidecar ends the open streams (a connection drains only once its
    // streams have) and exits.
    sidecar.process.signal(Signal::SIGTERM);
    wait_until(
        "the sidecar exits with streams open",
        Duration::from_secs(20),
        || !sidecar.process.running(),
    );
}

#[test]
fn settlements_slots_and_epoch_polls_ride_the_stream_too() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    // Every cost settled (the upstream reports 3 tokens for a reservation of 10), every request
    // holding a concurrency slot until its response ends, the epoch polled every 100 ms.
    let policy = "rules:\n  llm: {capacity: 1000, refill_per_sec: 0.001, concurrency: 50}\n";
    let sidecar = Sidecar::with_policy(&redis.url(), policy, &["--redis-timeout-ms", "500"]);
    let rules = json!([{"name": "llm", "match": {"path_prefix": "/usage/"}, "subject": [],
                        "on_error": "deny",
                        "cost": {"reserve": 10, "response_header": "x-usage-tokens"}}]);
    let mut plugin = plugin_with(rules, 2000);
    plugin["fast_paths"] = json!({"policy_poll_ms": 100});
    let config = EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port)
        .plugin(&plugin.to_string())
        .concurrency(2);
    let envoy = Envoy::start(&config);
    let client = http();
    for _ in 0..20 {
        let r = client
            .get(envoy.url("/usage/header?tokens=3"))
            .send()
            .expect("envoy answers");
        assert_eq!(r.status(), 200);
    }
    let metric = |name: &str| sidecar.metric(name);
    wait_until(
        "every settlement and slot release applied",
        Duration::from_secs(10),
        || {
            metric("ratelimit_calls_total{api=\"settle\",outcome=\"answered\"}") > 0.0
                && metric("ratelimit_calls_total{api=\"slots\",outcome=\"answered\"}") > 0.0
                && metric("ratelimit_slots_total{rule=\"llm\",outcome=\"released\"}") == 20.0
                && metric("ratelimit_settlements_total{outcome=\"given_back\"}") == 20.0
                // The filter read the answers on the stream (it counts the releases they report).
                && envoy.counter("ratelimit.slots_released") == 20
        },
    );
    assert_eq!(envoy.counter("ratelimit.settlements_lost"), 0);
    assert_eq!(envoy.counter("ratelimit.slots_lost"), 0);
    // Polls come every 100 ms; let a few go out.
    let polls = envoy.counter("cluster.ratelimit_sidecar.upstream_rq_total");
    std::thread::sleep(Duration::from_millis(500));
    // Every call of both workers went on their streams: Envoy opened no other request to the
    // sidecar (one stream per worker: two workers, and the root context of the main thread,
    // which polls the epoch too).
    let requests = envoy.counter("cluster.ratelimit_sidecar.upstream_rq_total");
    println!("requests Envoy opened to the sidecar: {requests} (before the polls: {polls})");
    assert!(
        requests <= 3,
        "{requests} requests: a call left the streams"
    );
    assert_eq!(http_calls(&sidecar), 0.0);
}

#[test]
fn a_sidecar_cluster_kept_on_http1_from_an_earlier_release_still_decides_exactly() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    let sidecar = Sidecar::with_policy(&redis.url(), POLICY, &["--redis-timeout-ms", "1000"]);
    // The cluster as the callouts of an earlier release needed it: HTTP/1.1. Envoy carries each
    // worker's stream on a connection of its own.
    let config = envoy_config(sidecar.port, &upstream, 2000).replace(
        "explicit_http_config: { http2_protocol_options: {} }",
        "explicit_http_config: { http_protocol_options: {} }",
    );
    let envoy = Envoy::start(&config);
    assert_exact(&round(&envoy, 1, KEYS, 3), KEYS, 3);
    assert!(stream_calls(&sidecar) > 0.0);
    assert_eq!(http_calls(&sidecar), 0.0, "a decision went over HTTP");
}
