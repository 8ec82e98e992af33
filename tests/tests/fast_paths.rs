//! The fast paths are exact: across two Envoy processes (two workers each) with leases, known
//! rejections and coalesced callouts on, admitted never exceeds capacity + refill x elapsed; a
//! lease never admits more than it holds; a flood on an exhausted key costs no callouts until its
//! `retry_after`, and a cached rejection does not outlive it.

use std::time::{Duration, Instant};

use ratelimit_e2e::scenario::{burst_to, count, get, plugin_with_rules};
use ratelimit_e2e::{http, Envoy, EnvoyConfig, FaultProxy, Redis, Sidecar, Upstream};
use serde_json::json;

/// One Envoy (2 workers) with its own sidecar, both on the shared Redis.
struct Gateway {
    sidecar: Sidecar,
    envoy: Envoy,
}

/// The rule `hot`: one bucket for every request.
fn hot_rule() -> serde_json::Value {
    json!([{"name": "hot", "match": {"path_prefix": "/"}, "subject": [], "on_error": "deny"}])
}

/// An Envoy of `workers` workers with the filter's `rules` (and `fast_paths`, if given) in
/// front of `upstream`, asking `sidecar`.
/// The sidecars' Redis timeout: 500 ms (the default 30 ms answers 503 when a loaded machine
/// delays Redis, and these tests count every answer), below the filter's 2 s callout timeout.
const REDIS_TIMEOUT: &[&str] = &["--redis-timeout-ms", "500"];

fn envoy(
    sidecar: &Sidecar,
    upstream: &Upstream,
    rules: serde_json::Value,
    fast_paths: Option<serde_json::Value>,
    workers: u32,
) -> Envoy {
    let mut plugin = plugin_with_rules(rules);
    if let Some(f) = fast_paths {
        plugin["fast_paths"] = f;
    }
    let config = EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port)
        .plugin(&plugin.to_string())
        .concurrency(workers);
    Envoy::start(&config)
}

fn gateways(redis: &Redis, upstream: &Upstream, policy: &str, n: usize) -> Vec<Gateway> {
    (0..n)
        .map(|_| {
            let sidecar = Sidecar::with_policy(&redis.url(), policy, REDIS_TIMEOUT);
            let envoy = envoy(&sidecar, upstream, hot_rule(), None, 2);
            Gateway { sidecar, envoy }
        })
        .collect()
}

#[test]
fn two_envoys_with_leases_and_known_rejections_never_admit_more_than_the_bucket() {
    let (capacity, refill) = (200.0, 20.0);
    let redis = Redis::start();
    let upstream = Upstream::start();
    let policy = format!("rules:\n  hot: {{capacity: {capacity}, refill_per_sec: {refill}}}\n");
    let gws = gateways(&redis, &upstream, &policy, 2);
    let urls: Vec<String> = gws.iter().map(|g| g.envoy.url("/x")).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let started = Instant::now();
    let answers = burst_to(&urls, &[], 1500, 16);
    let elapsed = started.elapsed().as_secs_f64();
    let admitted = count(&answers, 200);
    let bound = capacity + refill * elapsed;
    println!(
        "2 Envoys, 1500 requests in {elapsed:.2} s: {admitted} admitted (bound {bound:.1}), {} rejected",
        count(&answers, 429)
    );
    assert_eq!(admitted + count(&answers, 429), 1500, "only 200 and 429");
    assert!(
        admitted as f64 <= bound,
        "over-admission: {admitted} > capacity + refill x elapsed = {bound:.1}"
    );
    assert!(
        admitted as f64 >= capacity,
        "{admitted} < capacity: budget lost"
    );
    assert_eq!(upstream.hits() as usize, admitted);
    for (i, g) in gws.iter().enumerate() {
        let leased = g.envoy.counter("ratelimit.lease_admitted");
        let granted = g
            .sidecar
            .metric("ratelimit_lease_tokens_total{result=\"granted\"}");
        let known = g.envoy.counter("ratelimit.known_rejections");
        let callouts = g.envoy.counter("ratelimit.callouts");
        println!(
            "  Envoy {i}: {leased} admitted from leases of {granted} tokens granted, {known} known rejections, {callouts} callouts"
        );
        // A lease never admits more than it holds: every request admitted from a lease (cost 1)
        // was paid by tokens the sidecar granted to this Envoy.
        assert!(
            leased as f64 <= granted,
            "Envoy {i} admitted {leased} from leases of {granted} tokens"
        );
    }
    let fast: u64 = gws
        .iter()
        .map(|g| {
            g.envoy.counter("ratelimit.lease_admitted")
                + g.envoy.counter("ratelimit.known_rejections")
        })
        .sum();
    assert!(fast > 0, "the fast paths were not exercised");
}

#[test]
fn a_busy_key_renews_its_lease_before_it_runs_out() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    // Every decision takes 20 ms more (Redis's answers held back on their way to the sidecar):
    // a renewal asked only once the lease has run out would make every caller wait for it.
    let proxy = FaultProxy::start(redis.port);
    let policy = "rules:\n  hot: {capacity: 1000000000, refill_per_sec: 1000000}\n";
    let sidecar = Sidecar::with_policy(&proxy.url(), policy, &["--redis-timeout-ms", "500"]);
    let g = &Gateway {
        envoy: envoy(&sidecar, &upstream, hot_rule(), None, 2),
        sidecar,
    };
    proxy.delay_replies(20);
    let url = g.envoy.url("/x");
    // Warm up: the bucket becomes busy and gets its first lease.
    let warm = burst_to(&[url.as_str()], &[], 1000, 16);
    assert_eq!(count(&warm, 200), 1000);
    let remote = |g: &Gateway| {
        g.envoy.counter("ratelimit.admitted") - g.envoy.counter("ratelimit.lease_admitted")
    };
    let (remote_before, callouts_before) = (remote(g), g.envoy.counter("ratelimit.callouts"));
    let answers = burst_to(&[url.as_str()], &[], 5000, 16);
    assert_eq!(count(&answers, 200), 5000);
    let remote = remote(g) - remote_before;
    let callouts = g.envoy.counter("ratelimit.callouts") - callouts_before;
    let granted = g
        .sidecar
        .metric("ratelimit_lease_tokens_total{result=\"granted\"}");
    println!(
        "5000 requests of a busy key with 16 callers: {remote} took the remote path in {callouts} callouts, {granted} tokens granted in all"
    );
    assert!(callouts >= 1, "no lease was renewed in 5000 requests");
    // The next lease is asked for while the one in use still pays (below a quarter of its
    // grant): only the request that asks waits for it, the other callers keep being admitted
    // from the lease. Renewing only when the lease ran out made every caller wait: about 16
    // remote requests per callout.
    assert!(
        remote <= 2 * callouts,
        "{remote} remote requests in {callouts} callouts: the lease ran out before its renewal"
    );
}

/// A sidecar with `policy` and an Envoy (2 workers) with one rule `hot` and small leases that
/// last: at most 40 tokens, for 60 s (a lease runs low, and asks for the next, after about 30
/// requests).
fn small_leases(redis: &Redis, upstream: &Upstream, policy: &str) -> (Sidecar, Envoy) {
    let sidecar = Sidecar::with_policy(&redis.url(), policy, REDIS_TIMEOUT);
    let leases = json!({"leases": {"max_tokens": 40, "ttl_ms": 60000}});
    let envoy = envoy(&sidecar, upstream, hot_rule(), Some(leases), 2);
    (sidecar, envoy)
}

#[test]
fn a_lease_still_pays_the_request_whose_renewal_the_sidecar_cannot_answer() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    let (mut sidecar, envoy) = small_leases(
        &redis,
        &upstream,
        "rules:\n  hot: {capacity: 1000000000, refill_per_sec: 1000000}\n",
    );
    let url = envoy.url("/x");
    let warm = burst_to(&[url.as_str()], &[], 400, 8);
    assert_eq!(count(&warm, 200), 400);
    assert!(envoy.counter("ratelimit.lease_admitted") > 0, "no lease");
    let granted = sidecar.metric("ratelimit_lease_tokens_total{result=\"granted\"}") as u64;
    sidecar.process.stop();
    // One request at a time: the lease in use pays, including the requests that ask for the
    // next lease (their callouts fail now), until it is spent; then the rule's on_error (deny).
    let c = http();
    let statuses: Vec<u16> = (0..100).map(|_| get(&c, &url, &[]).status).collect();
    let admitted = statuses.iter().take_while(|s| **s == 200).count();
    println!(
        "sidecar stopped: {admitted} admitted from the lease, then {:?}",
        &statuses[admitted..admitted + 3]
    );
    assert!(
        statuses[admitted..].iter().all(|s| *s == 503),
        "a request was denied while the lease still paid others: {statuses:?}"
    );
    assert!(
        admitted <= 2 * 40,
        "{admitted} admitted from leases of at most 40 tokens"
    );
    // And it pays until it is spent: every token granted to this Envoy admitted a request (with
    // a cost of 1 and leases that outlast the test, no lease is given back or expires here).
    let leased = envoy.counter("ratelimit.lease_admitted");
    assert_eq!(
        leased, granted,
        "{leased} requests admitted from {granted} leased tokens: the rest stranded"
    );
}

#[test]
fn a_bucket_held_in_a_lease_admits_every_token_before_its_first_429() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    // 300 tokens and no refill to speak of: in the end this gateway's lease holds the last of
    // them, and Redis has none left for the request that asks for the next lease.
    let (sidecar, envoy) = small_leases(
        &redis,
        &upstream,
        "rules:\n  hot: {capacity: 300, refill_per_sec: 0.00002}\n",
    );
    let url = envoy.url("/x");
    // One request at a time, past the budget.
    let c = http();
    let statuses: Vec<u16> = (0..360).map(|_| get(&c, &url, &[]).status).collect();
    let admitted = statuses.iter().take_while(|s| **s == 200).count();
    let rejected_remotely =
        sidecar.metric("ratelimit_decisions_total{limit=\"hot\",verdict=\"rejected\"}");
    println!(
        "{admitted} admitted before the first 429, {} from leases; the sidecar rejected {rejected_remotely} decisions",
        envoy.counter("ratelimit.lease_admitted")
    );
    assert!(envoy.counter("ratelimit.lease_admitted") > 0, "no lease");
    // The lease's expiry was kept on Envoy's monotonic clock (WASI's `clock_time_get`), which a
    // wall-clock step does not move (the fallback to the wall clock sets 0).
    assert_eq!(
        envoy.counter("ratelimit.monotonic_clock"),
        1,
        "{:?}",
        envoy.ratelimit_stats()
    );
    // The request that asks for the next lease when Redis is empty is paid from the lease in
    // use: no 429 while this gateway still holds tokens, and every token admits a request.
    assert_eq!(
        admitted, 300,
        "a 429 while the lease still held tokens, or a token lost: {statuses:?}"
    );
    assert!(
        statuses[admitted..].iter().all(|s| *s == 429),
        "admitted after a 429: {statuses:?}"
    );
    assert!(
        rejected_remotely >= 1.0,
        "no renewal was rejected by the sidecar"
    );
}

#[test]
fn two_busy_buckets_in_one_slot_do_not_strand_each_others_leases() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    // Two buckets of 300 tokens, no refill to speak of, and a table of one slot: both busy
    // buckets hash to it.
    let sidecar = Sidecar::with_policy(
        &redis.url(),
        "rules:\n  a: {capacity: 300, refill_per_sec: 0.00002}\n  b: {capacity: 300, refill_per_sec: 0.00002}\n",
        REDIS_TIMEOUT,
    );
    let rules = json!([
        {"name": "a", "match": {"path_prefix": "/a/"}, "subject": [], "on_error": "deny"},
        {"name": "b", "match": {"path_prefix": "/b/"}, "subject": [], "on_error": "deny"}
    ]);
    let envoy = envoy(&sidecar, &upstream, rules, Some(json!({"slots": 1})), 2);
    let (a, b) = (envoy.url("/a/x"), envoy.url("/b/x"));
    // 200 requests to each, taking turns, one at a time: well inside both budgets.
    let c = http();
    let mut statuses = Vec::new();
    for _ in 0..200 {
        statuses.push(get(&c, &a, &[]).status);
        statuses.push(get(&c, &b, &[]).status);
    }
    let granted = sidecar.metric("ratelimit_lease_tokens_total{result=\"granted\"}");
    println!(
        "{} of 400 admitted, {} from leases, {granted} tokens leased",
        count_status(&statuses, 200),
        envoy.counter("ratelimit.lease_admitted")
    );
    assert!(envoy.counter("ratelimit.lease_admitted") > 0, "no lease");
    // A bucket that found the slot taken asked without a lease: neither took the other's slot
    // (and stranded its lease) at every turn, which emptied both buckets within 20 requests.
    assert_eq!(
        count_status(&statuses, 200),
        400,
        "under-admission: {statuses:?}"
    );
}

fn count_status(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|s| **s == status).count()
}

#[test]
fn a_raised_limit_is_seen_through_a_known_rejection_with_a_long_wait() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    // 2 tokens, one back every 1000 s: after them, Redis says wait about 1000 s.
    let sidecar = Sidecar::with_policy(
        &redis.url(),
        "rules:\n  hot: {capacity: 2, refill_per_sec: 0.001}\n",
        REDIS_TIMEOUT,
    );
    let envoy = envoy(&sidecar, &upstream, hot_rule(), None, 1);
    let url = envoy.url("/x");
    let c = http();
    let first: Vec<u16> = (0..3).map(|_| get(&c, &url, &[]).status).collect();
    assert_eq!(first, [200, 200, 429]);
    // The gateway answers the rejection itself (a known rejection) once its workers have read
    // the sidecar's policy epoch, which the rejection is tagged with: the first poll, answered
    // milliseconds after Envoy starts (docs/fast-paths.md#policy-reloads). Until then every
    // request asks the sidecar, and each 429 is the sidecar's.
    let mut local = None;
    ratelimit_e2e::wait_until(
        "a rejection answered by the gateway itself",
        Duration::from_secs(5),
        || {
            let known = envoy.counter("ratelimit.known_rejections");
            let r = get(&c, &url, &[]);
            assert_eq!(r.status, 429, "the bucket is empty for 1000 s");
            let answered_locally = envoy.counter("ratelimit.known_rejections") == known + 1;
            local = Some(r);
            answered_locally
        },
    );
    let local = local.expect("a rejection");
    // It says the whole wait.
    let retry_after: u64 = local
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("a Retry-After");
    assert!(
        retry_after > 900,
        "Retry-After {retry_after}: not the whole wait"
    );
    // The operator raises the limit: the gateway admits again once the sidecar has reloaded
    // and the rejection is no longer answered locally (`fast_paths.max_rejection_ms`, 1 s),
    // not after the 1000 s the rejection said.
    let raised = Instant::now();
    sidecar.write_policy("rules:\n  hot: {capacity: 1000, refill_per_sec: 100}\n");
    ratelimit_e2e::wait_until(
        "the gateway to admit under the raised limit",
        Duration::from_secs(30),
        || get(&c, &url, &[]).status == 200,
    );
    println!(
        "admitted {:.2} s after the limit was raised (the rejection said {retry_after} s)",
        raised.elapsed().as_secs_f64()
    );
}

#[test]
fn a_flood_on_an_exhausted_key_costs_no_callouts_until_its_retry_after() {
    let redis = Redis::start();
    let upstream = Upstream::start();
    // 3 tokens, one back per second: after the burst a rejection says "wait about 1 s".
    let gws = gateways(
        &redis,
        &upstream,
        "rules:\n  hot: {capacity: 3, refill_per_sec: 1}\n",
        2,
    );
    let urls: Vec<String> = gws.iter().map(|g| g.envoy.url("/x")).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let c = http();
    // Exhaust the bucket and let each Envoy learn the rejection.
    let mut admitted = 0;
    for u in urls.iter().cycle().take(6) {
        admitted += usize::from(get(&c, u, &[]).status == 200);
    }
    assert!(admitted <= 3 + 1, "{admitted}");
    let calls_before: f64 = gws
        .iter()
        .map(|g| {
            g.sidecar
                .metric("ratelimit_calls_total{api=\"http\",outcome=\"answered\"}")
        })
        .sum();
    let writes_before = writes(&redis);
    // A flood of 200 requests over both Envoys, for well under the wait.
    let started = Instant::now();
    let flood = burst_to(&urls, &[], 200, 8);
    let flood_s = started.elapsed().as_secs_f64();
    let calls: f64 = gws
        .iter()
        .map(|g| {
            g.sidecar
                .metric("ratelimit_calls_total{api=\"http\",outcome=\"answered\"}")
        })
        .sum::<f64>()
        - calls_before;
    let rejected = count(&flood, 429);
    println!(
        "flood of 200 in {flood_s:.2} s: {rejected} rejected, {} admitted, {calls} callouts, {} Redis writes",
        count(&flood, 200),
        writes(&redis) - writes_before
    );
    // Every admission is a token the bucket refilled during the flood (1/s).
    assert!(
        count(&flood, 200) as f64 <= 1.0 + flood_s,
        "over-admission in the flood"
    );
    // Callouts happen only when a known rejection runs out (about once a second per Envoy), never
    // per request.
    assert!(
        calls <= 4.0 * (1.0 + flood_s),
        "{calls} callouts for a flood of 200"
    );
    // A rejected request writes nothing in Redis.
    assert!(
        writes(&redis) - writes_before <= count(&flood, 200) as u64 * 2,
        "rejections wrote to Redis"
    );
    // A cached rejection does not outlive its retry_after: once the wait the 429 named has passed
    // (the bucket has refilled a token), the next request is admitted.
    let last = flood.iter().rfind(|a| a.status == 429).expect("some 429");
    let wait: u64 = last
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .expect("seconds");
    // The wait the sidecar announced must pass: this is the bucket's time, not a synchronisation.
    std::thread::sleep(Duration::from_secs(wait) + Duration::from_millis(100));
    let next = get(&c, urls[0], &[]);
    assert_eq!(
        next.status, 200,
        "the cached rejection outlived its Retry-After of {wait} s"
    );
}

/// Write commands Redis has executed so far (`INFO commandstats`).
fn writes(redis: &Redis) -> u64 {
    redis
        .cli(&["INFO", "commandstats"])
        .lines()
        .filter(|l| {
            [
                "cmdstat_set:",
                "cmdstat_hset:",
                "cmdstat_pexpire:",
                "cmdstat_del:",
            ]
            .iter()
            .any(|w| l.starts_with(w))
        })
        .filter_map(|l| {
            l.split(['=', ','])
                .nth(1)
                .and_then(|n| n.parse::<u64>().ok())
        })
        .sum()
}
