//! Concurrency limits across gateways, through real Envoys, sidecars and Redis
//! (docs/concurrency.md): a rule with `concurrency: 5` and a short `slot_ttl_ms`, an upstream that
//! holds requests open and records how many of the subject were in flight at most.
//!
//! - many concurrent clients through two Envoys (two sidecars, one Redis): never more than 5 in
//!   flight at the upstream; the rest answered 429 with `Retry-After: 1`; once they are done,
//!   every slot is released (the subject's set is gone from Redis);
//! - an Envoy killed (SIGKILL) while its requests hold every slot: each of its slots expires at
//!   most `slot_ttl_ms` after the kill (their expiries in Redis, against Redis's `TIME`), and the
//!   other Envoy gets them back then: the time from the kill is measured and printed;
//! - a client that hangs up: its stream's slot is released.

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use ratelimit_e2e::scenario::plugin_with_rules;
use ratelimit_e2e::store_loss::{hammer, one_gateway, slots_across_a_flush, CONCURRENCY};
use ratelimit_e2e::{http, wait_until, Envoy, EnvoyConfig, Redis, Sidecar, Upstream};
use redis::Commands;
use serde_json::json;

const N: u64 = 5;
const SLOT_TTL_MS: u64 = 1500;
const SET: &str = "rl:{ratelimit|rule=inflight}:c";

fn policy() -> String {
    format!(
        "rules:\n  inflight: {{capacity: 1000000, refill_per_sec: 100000, concurrency: {N}, slot_ttl_ms: {SLOT_TTL_MS}}}\n"
    )
}

fn envoy(sidecar: &Sidecar, upstream: &Upstream) -> Envoy {
    let plugin = plugin_with_rules(json!([{
        "name": "inflight", "match": {"path_prefix": "/hold/"}, "subject": [], "on_error": "deny",
    }]));
    let config = EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port)
        .plugin(&plugin.to_string())
        .concurrency(2);
    Envoy::start(&config)
}

/// Slots the subject's set holds in Redis (expired ones included until a call drops them).
fn held(redis: &Redis) -> u64 {
    redis.connection().zcard(SET).unwrap()
}

/// Two sidecars on one Redis, an Envoy on each, one upstream.
struct Pair {
    redis: Redis,
    upstream: Upstream,
    _sidecars: [Sidecar; 2],
    envoys: [Envoy; 2],
}

fn pair() -> Pair {
    let redis = Redis::start();
    let upstream = Upstream::start();
    // The test is about slots, not timeouts: Redis's answers on a loaded machine must not trip
    // the sidecar's Redis timeout (30 ms by default), which answers 503.
    let flags = ["--redis-timeout-ms", "1000"];
    let sidecars = [0, 1].map(|_| Sidecar::with_policy(&redis.url(), &policy(), &flags));
    let envoys = [
        envoy(&sidecars[0], &upstream),
        envoy(&sidecars[1], &upstream),
    ];
    Pair {
        redis,
        upstream,
        _sidecars: sidecars,
        envoys,
    }
}

#[test]
fn two_envoys_never_hold_more_than_the_limit_in_flight_and_release_every_slot() {
    let p = pair();
    let (clients, each) = (24, 6);
    let urls: Vec<String> = p.envoys.iter().map(|e| e.url("/hold/k?ms=150")).collect();
    let outcomes: Vec<(u16, Option<String>)> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..clients)
            .map(|c| {
                let url = urls[c % 2].clone();
                s.spawn(move || {
                    let client = http();
                    (0..each)
                        .map(|_| {
                            let r = client.get(&url).send().expect("envoy answers");
                            let retry = r
                                .headers()
                                .get("retry-after")
                                .map(|v| v.to_str().unwrap().to_string());
                            (r.status().as_u16(), retry)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect()
    });
    let admitted = outcomes.iter().filter(|(s, _)| *s == 200).count() as u64;
    let rejected: Vec<&Option<String>> = outcomes
        .iter()
        .filter(|(s, _)| *s == 429)
        .map(|(_, r)| r)
        .collect();
    let max = p.upstream.max_in_flight("k");
    println!(
        "{} requests: {admitted} admitted, {} answered 429; at most {max} in flight (limit {N})",
        outcomes.len(),
        rejected.len()
    );
    assert_eq!(
        admitted + rejected.len() as u64,
        outcomes.len() as u64,
        "only 200 and 429: {outcomes:?}"
    );
    assert!(max <= N, "{max} in flight, the limit is {N}");
    assert_eq!(max, N, "the load filled the limit");
    assert!(!rejected.is_empty(), "24 clients over a limit of 5");
    assert!(
        rejected.iter().all(|r| r.as_deref() == Some("1")),
        "Retry-After: 1 on every 429: {rejected:?}"
    );
    assert_eq!(p.upstream.hits(), admitted);
    // Every admitted stream's slot released at its end (at the worker's next tick).
    let released = Instant::now();
    wait_until("every slot released", Duration::from_secs(10), || {
        held(&p.redis) == 0
    });
    let exists: bool = p.redis.connection().exists(SET).unwrap();
    assert!(!exists, "the set is gone with its last slot");
    let counted: u64 = p
        .envoys
        .iter()
        .map(|e| e.counter("ratelimit.slots_released"))
        .sum();
    println!(
        "all slots released {} ms after the last answer; releases counted by the Envoys: {counted}",
        released.elapsed().as_millis()
    );
    assert_eq!(counted, admitted, "one release per admitted request");
    for e in &p.envoys {
        assert_eq!(e.counter("ratelimit.slots_lost"), 0);
    }
}

#[test]
fn a_killed_envoys_slots_come_back_within_slot_ttl_ms() {
    let p = pair();
    // Envoy 0's clients take every slot and hold their requests open (8 s).
    let url = p.envoys[0].url("/hold/kill?ms=8000");
    let holders: Vec<_> = (0..N)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || http().get(&url).send().map(|r| r.status().as_u16()))
        })
        .collect();
    wait_until("5 requests in flight", Duration::from_secs(10), || {
        p.upstream.in_flight("kill") == N
    });
    let client = http();
    let other = p.envoys[1].url("/hold/kill?ms=0");
    // Held past a renewal: the slots are renewed while Envoy 0 lives.
    std::thread::sleep(Duration::from_millis(SLOT_TTL_MS));
    assert_eq!(
        client.get(&other).send().unwrap().status(),
        429,
        "all 5 held"
    );
    assert!(
        p.envoys[0].counter("ratelimit.slots_renewed") >= N,
        "Envoy 0 renewed its slots while it lived"
    );
    p.envoys[0].process.signal(Signal::SIGKILL);
    let killed = Instant::now();
    // The bound, from Redis's own state: every slot the dead Envoy holds expires (its score, in
    // µs of Redis's TIME) at most slot_ttl_ms from now, since its last renewal was before now.
    let mut c = p.redis.connection();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut c).unwrap();
    let now_us = secs * 1_000_000 + micros;
    let expiries: Vec<(String, f64)> = c.zrange_withscores(SET, 0, -1).unwrap();
    assert_eq!(
        expiries.len() as u64,
        N,
        "the dead Envoy's slots: {expiries:?}"
    );
    for (id, expiry_us) in &expiries {
        assert!(
            *expiry_us <= (now_us + SLOT_TTL_MS * 1000) as f64,
            "slot {id} expires {} µs after the kill, past slot_ttl_ms",
            *expiry_us - now_us as f64
        );
    }
    let mut refused = 0;
    loop {
        match client.get(&other).send().unwrap().status().as_u16() {
            200 => break,
            429 => refused += 1,
            s => panic!("status {s}"),
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "the slots never came back"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let back_ms = killed.elapsed().as_millis() as u64;
    let period_ms = SLOT_TTL_MS / 3;
    println!(
        "a killed Envoy's slots came back after {back_ms} ms ({refused} requests refused meanwhile); bound: slot_ttl_ms = {SLOT_TTL_MS} ms after the last renewal, which was at most {period_ms} ms before the kill"
    );
    for h in holders {
        assert!(h.join().unwrap().is_err(), "a killed Envoy answers nothing");
    }
}

#[test]
fn a_client_that_hangs_up_releases_its_slot() {
    let p = pair();
    let port = p.envoys[0].listen_port;
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .write_all(b"GET /hold/gone?ms=8000 HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .unwrap();
    wait_until("the request in flight", Duration::from_secs(10), || {
        p.upstream.in_flight("gone") == 1
    });
    assert_eq!(held(&p.redis), 1, "its slot is taken");
    let closed = Instant::now();
    drop(stream);
    wait_until("its slot released", Duration::from_secs(10), || {
        held(&p.redis) == 0
    });
    println!(
        "a cancelled request's slot was released {} ms after its client closed the connection",
        closed.elapsed().as_millis()
    );
    assert_eq!(p.upstream.in_flight("gone"), 0);
    assert_eq!(p.envoys[0].counter("ratelimit.slots_released"), 1);
}

/// Issue 32, case 4a: a reload lowers `slot_ttl_ms` (9000 to 1000) while two requests run at
/// `concurrency: 2`. Their renewals come back with the new ttl and the filter renews within a
/// third of it, so their slots never expire under them: nothing else gets in while they run.
#[test]
fn a_reload_that_lowers_slot_ttl_ms_keeps_the_running_requests_slots() {
    let policy = |ttl: u64| {
        format!("rules:\n  inflight: {{capacity: 1000000, refill_per_sec: 100000, concurrency: 2, slot_ttl_ms: {ttl}}}\n")
    };
    let (_redis, upstream, sidecar, envoy) = one_gateway(&policy(9_000), &[]);
    let long = envoy.url("/hold/k?ms=7000");
    let holders: Vec<_> = (0..2)
        .map(|_| {
            let url = long.clone();
            std::thread::spawn(move || http().get(&url).send().map(|r| r.status().as_u16()))
        })
        .collect();
    wait_until("2 requests in flight", Duration::from_secs(10), || {
        upstream.in_flight("k") == 2
    });
    let reloads = sidecar.metric("ratelimit_policy_reloads_total{result=\"ok\"}");
    sidecar.write_policy(&policy(1_000));
    wait_until("the reload", Duration::from_secs(10), || {
        sidecar.metric("ratelimit_policy_reloads_total{result=\"ok\"}") > reloads
    });
    // Past the filter's next renewal (3 s, a third of the old ttl) and two of the new ttl.
    let (admitted, _) = hammer(&envoy.url("/hold/k?ms=0"), 4, Duration::from_millis(4_500));
    let max = upstream.max_in_flight("k");
    println!("{admitted} short requests admitted while 2 held every slot; at most {max} in flight");
    assert_eq!(admitted, 0, "a slot of a running request expired under it");
    assert!(max <= 2, "{max} in flight at concurrency 2");
    for h in holders {
        assert_eq!(h.join().unwrap().unwrap(), 200);
    }
}

/// Issue 32, case 4b: Redis flushed under `--store-reset empty` while two requests run at
/// `concurrency: 2`. For one `slot_ttl_ms` after the loss no slot is taken, and the running
/// requests' renewals hold their slots again: never more than 2 in flight.
#[test]
fn a_store_that_loses_its_slots_under_store_reset_empty_keeps_the_limit() {
    let run = slots_across_a_flush("empty");
    println!(
        "after the flush: {} short requests admitted, {} answered 429; at most {} in flight; {} of {CONCURRENCY} long requests ran to their end; resets counted {}",
        run.admitted, run.rejected, run.max_in_flight, run.held_to_the_end, run.resets
    );
    assert!(
        run.max_in_flight <= CONCURRENCY,
        "{} in flight at concurrency {CONCURRENCY}",
        run.max_in_flight
    );
    assert_eq!(
        run.admitted, 0,
        "the running requests' slots were taken again by others"
    );
    assert_eq!(run.held_to_the_end, CONCURRENCY as usize);
    assert!(run.resets >= 1.0, "the flush was not counted as a loss");
}
