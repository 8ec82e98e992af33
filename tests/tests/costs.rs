//! Costs known after the response, through real Envoys, sidecars and Redis (docs/costs.md): an
//! upstream reports what each request cost (a header, a JSON body, the last event of a
//! `text/event-stream`), the filter settles the difference with its reservation, and the bucket
//! holds the debt or gets the tokens back.
//!
//! - a cost above the reservation is a debt refill repays exactly: with C = 1000, r = 500/s and
//!   every request reserving C and costing 2C, admissions come every (debt + cost) / r = 4 s;
//! - cheap responses give their reservations back: a bucket of 1000 admits 7 requests reserving
//!   400 and costing 100 (as many as their real costs allow), across two Envoys sharing it, the
//!   reservation taken from the request's JSON `max_tokens`;
//! - a stream the client cancels settles at its reservation; one read to its end gives back;
//! - under load from two Envoys, the real costs admitted stay within C + r·T + the excess in
//!   flight; a settlement the sidecar cannot take is sent 3 times, then counted lost;
//! - a body reservation without `allow_on_headers_stop_iteration` falls back at the deadline.

use std::io::Read;
use std::time::{Duration, Instant};

use ratelimit_e2e::scenario::plugin_with_rules;
use ratelimit_e2e::{
    bucket_tokens, http, wait_until, Envoy, EnvoyConfig, Redis, Sidecar, Upstream,
};
use serde_json::{json, Value};

fn envoy(sidecar: &Sidecar, upstream: &Upstream, cost: Value) -> Envoy {
    let plugin = plugin_with_rules(json!([{
        "name": "llm", "match": {"path_prefix": "/usage/"}, "subject": [], "on_error": "deny",
        "cost": cost,
    }]));
    let config = EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port)
        .plugin(&plugin.to_string())
        .replace(PLUGIN_NAME, &format!("{PLUGIN_NAME}{STOP_ITERATION}"))
        .concurrency(2);
    Envoy::start(&config)
}

/// The Wasm filter's `config:` in envoy/envoy.yaml, and the line a rule reserving from the
/// request's JSON needs there (docs/costs.md).
const PLUGIN_NAME: &str = "                name: ratelimit\n";
const STOP_ITERATION: &str = "                allow_on_headers_stop_iteration: true\n";

const KEY: &str = "rl:{ratelimit|rule=llm}";

fn settled(sidecar: &Sidecar, outcome: &str) -> u64 {
    sidecar.metric(&format!(
        "ratelimit_settlements_total{{outcome=\"{outcome}\"}}"
    )) as u64
}

#[test]
fn a_cost_above_its_reservation_is_a_debt_that_refill_repays_exactly() {
    let (capacity, refill) = (1000.0, 500.0);
    let redis = Redis::start();
    let upstream = Upstream::start();
    let policy = format!("rules:\n  llm: {{capacity: {capacity}, refill_per_sec: {refill}}}\n");
    let sidecar = Sidecar::with_policy(&redis.url(), &policy, &["--redis-timeout-ms", "500"]);
    let envoy = envoy(
        &sidecar,
        &upstream,
        json!({"reserve": 1000, "response_header": "x-usage-tokens"}),
    );
    let url = envoy.url("/usage/header?tokens=2000");
    let client = http();
    let started = Instant::now();
    let mut admitted_at = Vec::new();
    let mut first_retry_after = None;
    // Admissions are due at 0, 4 and 8 s: the loop runs 9 s, longer (up to 15 s) on a slow
    // machine until the third, so only a wait that is wrong fails it, never a slow answer.
    while (started.elapsed() < Duration::from_secs(9) || admitted_at.len() < 3)
        && started.elapsed() < Duration::from_secs(15)
    {
        let r = client.get(&url).send().expect("envoy answers");
        match r.status().as_u16() {
            200 => admitted_at.push(started.elapsed().as_secs_f64()),
            429 => {
                if admitted_at.len() == 1 && first_retry_after.is_none() {
                    // Right after the first admission its settlement may not have landed yet.
                    std::thread::sleep(Duration::from_millis(300));
                    let r = client.get(&url).send().expect("envoy answers");
                    assert_eq!(r.status(), 429);
                    first_retry_after = r
                        .headers()
                        .get("retry-after")
                        .map(|v| v.to_str().unwrap().to_string());
                }
            }
            s => panic!("unexpected status {s}"),
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let real: f64 = 2000.0 * admitted_at.len() as f64;
    let bound = capacity + refill * elapsed + 1000.0; // one request's excess in flight
    println!(
        "admitted at {admitted_at:.2?} s, Retry-After after the first: {first_retry_after:?}; real cost {real} in {elapsed:.2} s, bound C + r*T + in-flight excess = {bound:.0}"
    );
    // Reserve 1000 of 1000, settle +1000: a debt of 1000 (less the refill until it lands), so
    // the next reservation waits (debt + cost) / r = 4 s from the first admission.
    assert_eq!(first_retry_after.as_deref(), Some("4"));
    assert_eq!(
        admitted_at.len(),
        3,
        "admissions at 0, 4 and 8 s: {admitted_at:?}"
    );
    // Never before the debt is repaid; a debt charged twice would put the third past 15 s.
    for pair in admitted_at.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(
            gap >= 3.99,
            "admissions {gap:.3} s apart, before the 4 s refill allows"
        );
    }
    assert!(real <= bound, "{real} > {bound}");
    assert_eq!(upstream.hits(), 3);
    assert_eq!(settled(&sidecar, "charged"), 3);
    assert_eq!(envoy.counter("ratelimit.settlements_lost"), 0);
}

#[test]
fn cheap_responses_give_their_reservations_back_across_two_envoys() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    let policy = "rules:\n  llm: {capacity: 1000, refill_per_sec: 0.001}\n";
    // The fallback reservation (4096) exceeds the capacity: only a reservation read from the
    // request's body can pass.
    let cost = json!({"reserve_from_request_json": "max_tokens", "reserve": 4096,
                      "response_json": "usage.total_tokens"});
    let sidecars: Vec<Sidecar> = (0..2)
        .map(|_| Sidecar::with_policy(&redis.url(), policy, &["--redis-timeout-ms", "500"]))
        .collect();
    let envoys: Vec<Envoy> = sidecars
        .iter()
        .map(|s| envoy(s, &upstream, cost.clone()))
        .collect();
    let client = http();
    let given_back = |n: u64| {
        wait_until("the settlement to land", Duration::from_secs(5), || {
            sidecars
                .iter()
                .map(|s| settled(s, "given_back"))
                .sum::<u64>()
                >= n
        })
    };
    let mut admitted = 0;
    for i in 0..10 {
        let r = client
            .post(envoys[i % 2].url("/usage/json?tokens=100"))
            .header("content-type", "application/json")
            .body(r#"{"model": "m", "max_tokens": 400}"#)
            .send()
            .expect("envoy answers");
        let status = r.status().as_u16();
        let body = r.text().unwrap_or_default();
        match status {
            200 => {
                admitted += 1;
                given_back(admitted);
            }
            429 => {}
            s => panic!("unexpected {s}: {body}"),
        }
        println!(
            "request {i} (Envoy {}): {status}, bucket {:?}",
            i % 2,
            bucket_tokens(&redis, KEY)
        );
    }
    // Each admission nets 100: the k-th passes while 1000 - 100 (k - 1) >= 400.
    assert_eq!(admitted, 7);
    let tokens = bucket_tokens(&redis, KEY).unwrap();
    assert!((300.0..301.0).contains(&tokens), "{tokens}");
    // Without a body the fallback reservation is refused outright.
    let r = client
        .get(envoys[0].url("/usage/json?tokens=1"))
        .send()
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(upstream.hits(), 7);
}

#[test]
fn a_stream_the_client_cancels_settles_at_its_reservation() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    let policy = "rules:\n  llm: {capacity: 1000, refill_per_sec: 0.001}\n";
    let sidecar = Sidecar::with_policy(&redis.url(), policy, &["--redis-timeout-ms", "500"]);
    let envoy = envoy(
        &sidecar,
        &upstream,
        json!({"reserve": 400, "response_json": "usage.total_tokens"}),
    );
    let client = http();
    // Read to its end: the last event carrying usage says 100, so 300 come back.
    let body = client
        .get(envoy.url("/usage/sse?tokens=100&events=4&gap_ms=20"))
        .send()
        .unwrap()
        .text()
        .unwrap();
    assert!(body.contains("\"total_tokens\":100"), "{body}");
    wait_until("the settlement", Duration::from_secs(5), || {
        settled(&sidecar, "given_back") == 1
    });
    let tokens = bucket_tokens(&redis, KEY).unwrap();
    assert!((900.0..901.0).contains(&tokens), "{tokens}");

    // Cancelled after its first chunk: the reservation stands, nothing is sent.
    let mut r = client
        .get(envoy.url("/usage/sse?tokens=100&events=5&gap_ms=400"))
        .send()
        .unwrap();
    let mut first = [0u8; 16];
    r.read_exact(&mut first).unwrap();
    drop(r);
    wait_until(
        "the cancelled stream to end",
        Duration::from_secs(5),
        || envoy.counter("ratelimit.costs_unreported") == 1,
    );
    std::thread::sleep(Duration::from_millis(300)); // a settlement would have been sent by now
    let tokens = bucket_tokens(&redis, KEY).unwrap();
    println!("after a full stream and a cancelled one: {tokens} tokens");
    assert!(
        (500.0..501.0).contains(&tokens),
        "the reservation stands: {tokens}"
    );
    assert_eq!(settled(&sidecar, "given_back"), 1);
    assert_eq!(envoy.counter("ratelimit.costs_settled"), 1);
}

#[test]
fn without_allow_on_headers_stop_iteration_a_body_reservation_falls_back_at_the_deadline() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    let policy = "rules:\n  llm: {capacity: 1000, refill_per_sec: 0.001}\n";
    let sidecar = Sidecar::with_policy(&redis.url(), policy, &["--redis-timeout-ms", "500"]);
    let plugin = plugin_with_rules(json!([{
        "name": "llm", "match": {"path_prefix": "/usage/"}, "subject": [], "on_error": "deny",
        "cost": {"reserve_from_request_json": "max_tokens", "reserve": 4096,
                 "response_json": "usage.total_tokens"},
    }]));
    let config =
        EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port).plugin(&plugin.to_string());
    let envoy = Envoy::start(&config);
    let started = Instant::now();
    let r = http()
        .post(envoy.url("/usage/json?tokens=100"))
        .body(r#"{"max_tokens": 400}"#)
        .send()
        .unwrap();
    let waited = started.elapsed();
    println!("without the flag: {} after {waited:?}", r.status());
    // Envoy held the body back: decided on the fallback 4096, above the capacity.
    assert_eq!(r.status(), 429);
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    assert_eq!(upstream.hits(), 0);
}

#[test]
fn a_settlement_the_sidecar_cannot_take_is_sent_three_times_then_counted_lost() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    let policy = "rules:\n  llm: {capacity: 1000, refill_per_sec: 0.001}\n";
    let mut sidecar = Sidecar::with_policy(&redis.url(), policy, &["--redis-timeout-ms", "500"]);
    let envoy = envoy(
        &sidecar,
        &upstream,
        json!({"reserve": 100, "response_json": "usage.total_tokens"}),
    );
    // Admitted (100 reserved), then the sidecar goes away before the stream's last event.
    let mut r = http()
        .get(envoy.url("/usage/sse?tokens=300&events=3&gap_ms=500"))
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    sidecar.process.stop();
    let mut body = String::new();
    r.read_to_string(&mut body).unwrap();
    assert!(body.contains("\"total_tokens\":300"), "{body}");
    wait_until(
        "the settlement to be given up",
        Duration::from_secs(5),
        || envoy.counter("ratelimit.settlements_lost") == 1,
    );
    let retried = envoy.counter("ratelimit.settlements_retried");
    let tokens = bucket_tokens(&redis, KEY).unwrap();
    println!(
        "lost after {retried} retries; the bucket holds {tokens} (the reservation's charge only)"
    );
    assert_eq!(retried, 2, "sent 3 times in all");
    assert_eq!(envoy.counter("ratelimit.costs_settled"), 1);
    assert!((900.0..901.0).contains(&tokens), "{tokens}");
}

#[test]
fn two_envoys_under_load_admit_at_most_the_bound_with_in_flight_excess() {
    let (capacity, refill, reserve, cost) = (2000.0, 1000.0, 100.0, 150.0);
    let redis = Redis::start();
    let upstream = Upstream::start();
    let policy = format!("rules:\n  llm: {{capacity: {capacity}, refill_per_sec: {refill}}}\n");
    let sidecars: Vec<Sidecar> = (0..2)
        .map(|_| Sidecar::with_policy(&redis.url(), &policy, &["--redis-timeout-ms", "500"]))
        .collect();
    let envoys: Vec<Envoy> = sidecars
        .iter()
        .map(|s| {
            envoy(
                s,
                &upstream,
                json!({"reserve": 100, "response_header": "x-usage-tokens"}),
            )
        })
        .collect();
    let urls: Vec<String> = envoys
        .iter()
        .map(|e| e.url("/usage/header?tokens=150"))
        .collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let clients = 16;
    let started = Instant::now();
    let answers = ratelimit_e2e::scenario::burst_to(&urls, &[], 3000, clients);
    let elapsed = started.elapsed().as_secs_f64();
    let admitted = ratelimit_e2e::scenario::count(&answers, 200) as f64;
    wait_until("every settlement to land", Duration::from_secs(5), || {
        sidecars.iter().map(|s| settled(s, "charged")).sum::<u64>() as f64 == admitted
    });
    // In flight at once: at most the capacity's worth of reservations (the first burst, before
    // any settlement lands) plus one per client; each may exceed its reservation by 50.
    let in_flight = capacity / reserve + clients as f64;
    let bound = capacity + refill * elapsed + (cost - reserve) * in_flight;
    let real = cost * admitted;
    let tokens = bucket_tokens(&redis, KEY).unwrap();
    println!(
        "2 Envoys, 3000 requests in {elapsed:.2} s: {admitted} admitted, real cost {real} (reserved {}), bound C + r*T + excess in flight = {bound:.0} (C + r*T = {:.0}); the bucket ends at {tokens:.0}",
        reserve * admitted,
        capacity + refill * elapsed
    );
    assert!(real <= bound, "{real} > {bound}");
    assert!(tokens < reserve, "the budget was not used: {tokens} left");
    assert_eq!(upstream.hits() as f64, admitted);
    let lost: u64 = envoys
        .iter()
        .map(|e| e.counter("ratelimit.settlements_lost"))
        .sum();
    assert_eq!(lost, 0);
}

/// Issue 32, case 3: settlements of the longest subjects the configuration allows (a user claim
/// of 1,024 bytes) finishing together while the sidecar is paused (120 ms): their batches fit what
/// the sidecar accepts (`MAX_BODY_BYTES`), and none is lost (before: one batch of 150, 413, lost
/// after 3 sends).
#[test]
fn settlements_of_the_longest_subjects_fit_the_sidecars_body_limit_and_none_is_lost() {
    use nix::sys::signal::Signal;
    use ratelimit_e2e::{signed_jwt, JWT_ISSUER};
    const N: usize = 150;
    let redis = Redis::start();
    let upstream = Upstream::start();
    let policy = "rules:\n  llm: {capacity: 1000000000, refill_per_sec: 1000000}\n";
    let sidecar = Sidecar::with_policy(&redis.url(), policy, &["--redis-timeout-ms", "1000"]);
    let mut plugin = plugin_with_rules(json!([{
        "name": "llm", "match": {"path_prefix": "/usage/"}, "subject": ["user"],
        "on_error": "deny", "cost": {"reserve": 10, "response_json": "usage.total_tokens"},
    }]));
    plugin["identity"] = json!({"jwt": {"provider": "example", "user_claim": "sub"}});
    plugin["sidecar"]["timeout_ms"] = json!(2000);
    let envoy = Envoy::start(
        &EnvoyConfig::shipped("envoy-jwt.yaml", sidecar.port, upstream.port)
            .plugin(&plugin.to_string())
            .concurrency(1),
    );
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    let tokens: Vec<String> = (0..N)
        .map(|i| {
            let sub = format!("{i:04}{}", "u".repeat(1020));
            signed_jwt(&json!({"iss": JWT_ISSUER, "sub": sub, "exp": exp}))
        })
        .collect();
    let url = envoy.url("/usage/sse?tokens=3&events=2&gap_ms=1500");
    let clients: Vec<_> = tokens
        .into_iter()
        .map(|t| {
            let url = url.clone();
            std::thread::spawn(move || {
                let mut r = http()
                    .get(&url)
                    .bearer_auth(t)
                    .send()
                    .expect("envoy answers");
                let mut body = String::new();
                r.read_to_string(&mut body).expect("the stream to its end");
                r.status().as_u16()
            })
        })
        .collect();
    wait_until("every stream admitted", Duration::from_secs(30), || {
        upstream.hits() == N as u64
    });
    // The streams end (their usage event comes 1.5 s after they began) while the sidecar is
    // paused: their settlements queue together.
    sidecar.process.signal(Signal::SIGSTOP);
    let statuses: Vec<u16> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    std::thread::sleep(Duration::from_millis(120)); // the pause itself, not a synchronisation
    sidecar.process.signal(Signal::SIGCONT);
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    wait_until("every settlement applied", Duration::from_secs(30), || {
        settled(&sidecar, "given_back") == N as u64
            || envoy.counter("ratelimit.settlements_lost") > 0
    });
    let lost = envoy.counter("ratelimit.settlements_lost");
    println!(
        "{N} settlements of 1,024-byte subjects after a 120 ms pause: {} given back, {lost} lost",
        settled(&sidecar, "given_back")
    );
    assert_eq!(lost, 0, "settlements lost");
    assert_eq!(settled(&sidecar, "given_back"), N as u64);
}
