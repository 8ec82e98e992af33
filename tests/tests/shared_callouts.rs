//! Shared callouts (`fast_paths.share_callouts`), in a real Envoy of two workers: one worker (the
//! courier) sends the other's queued requests in its callouts and every answer reaches its own
//! request; with sharing off no request is forwarded; while the sidecar is frozen, forwarded
//! requests are settled by their failure policy within their deadline, and sharing resumes when
//! it wakes.

use std::time::Duration;

use nix::sys::signal::Signal;
use ratelimit_e2e::rounds::{address, assert_exact, round, statuses_of, RoundAnswer};
use ratelimit_e2e::scenario::plugin_with;
use ratelimit_e2e::{http, wait_until, Envoy, EnvoyConfig, FaultProxy, Redis, Sidecar, Upstream};
use serde_json::json;

/// Clients of a round, told apart by address (X-Forwarded-For).
const KEYS: usize = 60;
/// Each client's bucket: 2 tokens, a refill too slow to matter in a test.
const POLICY: &str = "rules:\n  per-ip: {capacity: 2, refill_per_sec: 0.001}\n";

/// An Envoy of two workers, one rule per client address; leases off, so every request is
/// decided by the sidecar (and on the non-courier worker, forwarded).
fn envoy(sidecar: &Sidecar, upstream: &Upstream, share: bool, timeout_ms: u64) -> Envoy {
    let rules = json!([{"name": "per-ip", "match": {"path_prefix": "/"}, "subject": ["ip"],
                        "on_error": "deny"}]);
    let mut plugin = plugin_with(rules, timeout_ms);
    // Callouts over HTTP (the courier shares those; the stream per worker has none).
    plugin["sidecar"]["transport"] = json!("http");
    plugin["fast_paths"] = json!({"share_callouts": share, "leases": {"enabled": false}});
    let config = EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port)
        .plugin(&plugin.to_string())
        // The client's address comes from X-Forwarded-For (as behind a trusted balancer).
        .replace("use_remote_address: true", "use_remote_address: false")
        .concurrency(2);
    Envoy::start(&config)
}

/// Spends the bucket of every odd client of `round` beforehand (two requests each, one at a time),
/// so that a round's batches mix clients to admit and clients to reject.
fn spend_odd(envoy: &Envoy, round: u8, keys: usize) {
    for key in (1..keys).step_by(2) {
        for _ in 0..2 {
            let status = http()
                .get(envoy.url("/x"))
                .header("x-forwarded-for", address(round, key))
                .send()
                .expect("GET")
                .status()
                .as_u16();
            assert_eq!(status, 200, "client {key}");
        }
    }
}

/// After [`spend_odd`], two requests per client: even clients admitted twice, odd ones rejected
/// twice. An answer that reached another request than its own would show as a client with the
/// other's statuses.
fn assert_even_admitted_odd_rejected(answers: &[RoundAnswer], keys: usize) {
    for key in 0..keys {
        let mine = statuses_of(answers, key);
        let expected = if key % 2 == 0 { [200, 200] } else { [429, 429] };
        assert_eq!(mine, expected, "client {key}");
    }
}

#[test]
fn the_workers_share_callouts_and_every_answer_reaches_its_own_request() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    // Redis's answers held 20 ms on their way to the sidecar: requests pile up while a callout
    // is out, so a forward and a callout carry many, of clients to admit and to reject.
    let slow = FaultProxy::start(redis.port);
    // The test is about where answers go, not about timeouts: Redis's 20 ms must stay well
    // inside the sidecar's Redis timeout (30 ms by default) however loaded the machine is.
    let sidecar = Sidecar::with_policy(&slow.url(), POLICY, &["--redis-timeout-ms", "1000"]);
    let shared = envoy(&sidecar, &upstream, true, 2000);
    spend_odd(&shared, 1, KEYS);
    slow.delay_replies(20);
    let hits = upstream.hits() as usize;
    let answers = round(&shared, 1, KEYS, 2);
    assert_even_admitted_odd_rejected(&answers, KEYS);
    assert_eq!(upstream.hits() as usize - hits, KEYS);
    let forwarded = shared.counter("ratelimit.forwarded");
    let callouts = shared.counter("ratelimit.callouts");
    println!(
        "shared: {} requests, {forwarded} forwarded to the courier, {callouts} callouts",
        answers.len()
    );
    // Every request on the worker that is not the courier went through the courier's callouts.
    assert!(forwarded > 0, "no request was forwarded");
    assert!(callouts > 0 && (callouts as usize) < answers.len());

    // Sharing off: the same answers, and each worker sends its own callouts.
    slow.delay_replies(0);
    let own = envoy(&sidecar, &upstream, false, 2000);
    spend_odd(&own, 2, KEYS);
    slow.delay_replies(20);
    let answers = round(&own, 2, KEYS, 2);
    assert_even_admitted_odd_rejected(&answers, KEYS);
    assert_eq!(own.counter("ratelimit.forwarded"), 0);
    assert!(own.counter("ratelimit.callouts") > 0);
}

#[test]
fn a_frozen_sidecar_settles_forwarded_requests_by_their_policy_and_sharing_resumes() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    // Redis's answers on a loaded machine must not trip the sidecar's timeout (30 ms by
    // default): the test freezes the sidecar, not Redis. 250 ms stays below the filter's 300.
    let sidecar = Sidecar::with_policy(&redis.url(), POLICY, &["--redis-timeout-ms", "250"]);
    let envoy = envoy(&sidecar, &upstream, true, 300);
    assert_exact(&round(&envoy, 1, KEYS, 3), KEYS, 3);
    let forwarded = envoy.counter("ratelimit.forwarded");
    assert!(forwarded > 0, "no request was forwarded");

    sidecar.process.signal(Signal::SIGSTOP);
    let frozen = round(&envoy, 2, 40, 1);
    sidecar.process.signal(Signal::SIGCONT);
    let slowest = frozen.iter().map(|a| a.elapsed).max().unwrap_or_default();
    println!("sidecar frozen: 40 requests, the slowest answered in {slowest:?}");
    // `on_error: deny` answers every request 503 by its deadline (300 ms, the next tick after):
    // none waits for the frozen sidecar (the client's own timeout is 10 s), whichever worker
    // it reached.
    assert!(
        frozen.iter().all(|a| a.status == 503),
        "fail closed answers 503"
    );
    assert!(frozen.iter().all(|a| a.elapsed < Duration::from_secs(2)));
    assert!(envoy.counter("ratelimit.failed_closed") >= 40);

    wait_until("decisions resume", Duration::from_secs(30), || {
        http()
            .get(envoy.url("/x"))
            .header("x-forwarded-for", "10.9.9.9")
            .send()
            .is_ok_and(|r| r.status() == 200)
    });
    let forwarded = envoy.counter("ratelimit.forwarded");
    assert_exact(&round(&envoy, 3, KEYS, 3), KEYS, 3);
    assert!(
        envoy.counter("ratelimit.forwarded") > forwarded,
        "sharing did not resume"
    );
}
