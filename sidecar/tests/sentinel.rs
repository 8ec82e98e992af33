//! Redis Sentinel: a primary, its replica and three Sentinels started by the test; the primary
//! dies, Sentinel promotes the replica, and the sidecar carries on with the replicated buckets
//! without a restart.

mod support;

use std::time::{Duration, Instant};

use ratelimit_e2e::{free_port, Redis, Sentinel};
use serde_json::{json, Value};
use support::{bucket, decision, unique, Sidecar};

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

/// A primary, its replica linked, three Sentinels (quorum 2) watching the primary, and a
/// sidecar on them (with `extra` flags), ready.
async fn sentinel_stack(extra: &[&str]) -> (Redis, Redis, Vec<Sentinel>, Sidecar) {
    let primary = Redis::start();
    let replica = Redis::start_with(&["--replicaof", "127.0.0.1", &primary.port.to_string()]);
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
    let urls = sentinels
        .iter()
        .map(Sentinel::url)
        .collect::<Vec<_>>()
        .join(",");
    let mut flags = vec![
        "--redis-sentinel",
        urls.as_str(),
        "--sentinel-master",
        MASTER,
    ];
    flags.extend_from_slice(extra);
    let sidecar = Sidecar::start(&flags).await;
    sidecar.wait_ready("/readyz").await;
    (primary, replica, sentinels, sidecar)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_decisions_reach_the_promoted_replica_and_buckets_continue() {
    let (mut primary, replica, sentinels, sidecar) =
        sentinel_stack(&["--redis-timeout-ms", "2000"]).await;

    let id = unique("failover");
    let one = json!([decision("b10", &id, 1)]);
    let remaining = |a: &Value| a["results"][0]["remaining"].as_u64();
    for charge in 1..=4 {
        let (status, a) = sidecar.decide(one.clone()).await;
        assert_eq!(status, 200, "{a}");
        assert_eq!(remaining(&a), Some(10 - charge), "{a}");
    }
    // Every write so far acknowledged by the replica, and the bucket is there.
    assert_eq!(primary.cli(&["WAIT", "1", "10000"]), "1");
    let key = bucket("b10", &id);
    poll("the bucket on the replica", Duration::from_secs(10), || {
        replica.cli(&["EXISTS", &key]) == "1"
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

/// A split brain: the old primary still answers as a primary (it came back before Sentinel made
/// it a replica, which Sentinel does only at its next look, up to 10 s later), while Sentinel
/// names the promoted replica. No command fails on the old one, so only asking Sentinel moves
/// the sidecar; until then the two primaries would decide side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_still_answers_is_left_once_sentinel_names_another() {
    let (old, new, sentinels, sidecar) = sentinel_stack(&[]).await;
    let first = unique("before");
    let (status, a) = sidecar.decide(json!([decision("b10", &first, 1)])).await;
    assert_eq!(status, 200, "{a}");
    assert_eq!(old.cli(&["EXISTS", &bucket("b10", &first)]), "1");

    // The replica promoted and named by every Sentinel; the old primary untouched.
    assert_eq!(new.cli(&["REPLICAOF", "NO", "ONE"]), "OK");
    for s in &sentinels {
        s.monitor_instead(new.port, 2);
    }
    let switched = Instant::now();
    let mut decisions = 0;
    loop {
        let id = unique("after");
        let (status, a) = sidecar.decide(json!([decision("b10", &id, 1)])).await;
        decisions += 1;
        if status == 200 && new.cli(&["EXISTS", &bucket("b10", &id)]) == "1" {
            break;
        }
        assert!(
            switched.elapsed() < Duration::from_secs(15),
            "still deciding on the old primary {decisions} decisions later: {status} {a}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        old.cli(&["ROLE"]).starts_with("master"),
        "the old primary still answers as one: only Sentinel could move the sidecar"
    );
    println!(
        "split brain: the sidecar left the old primary {} ms after Sentinel named the new one ({decisions} decisions meanwhile)",
        switched.elapsed().as_millis()
    );
}

/// The sidecar asks Sentinel every second which primary it names: a command to a Sentinel on a
/// connection it keeps, never a new connection to the primary (with TLS, a handshake a second
/// per sidecar).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asking_sentinel_every_second_costs_the_primary_no_connection() {
    let (primary, _replica, _sentinels, sidecar) = sentinel_stack(&[]).await;
    let (status, a) = sidecar
        .decide(json!([decision("b10", &unique("watch"), 1)]))
        .await;
    assert_eq!(status, 200, "{a}");
    let connections = || -> u64 {
        primary
            .cli(&["INFO", "stats"])
            .lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("INFO stats")
    };
    let before = connections();
    // Three of the sidecar's looks at Sentinel.
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let new = connections() - before;
    // One is redis-cli's own; one more is left for a Sentinel reconnecting.
    assert!(new <= 2, "{new} new connections to the primary in 3.5 s");
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

/// A "Sentinel" that accepts connections and counts them: `hang` keeps each one open without a
/// word (a lookup then times out), otherwise it is closed at once (a lookup fails at once).
fn counting_listener(hang: bool) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}", listener.local_addr().unwrap());
    let accepted = std::sync::Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        let mut open = Vec::new();
        for stream in listener.incoming().flatten() {
            count.fetch_add(1, Ordering::SeqCst);
            if hang {
                open.push(stream);
            }
        }
    });
    (url, accepted)
}

fn store_on(
    sentinel_url: &str,
    timeout_ms: u64,
) -> std::sync::Arc<ratelimit_sidecar::store::RedisStore> {
    std::sync::Arc::new(
        ratelimit_sidecar::store::RedisStore::sentinel(
            &[sentinel_url.to_string()],
            MASTER,
            ratelimit_sidecar::store::redis::StoreOptions {
                timeout_ms,
                ..Default::default()
            },
            std::sync::Arc::new(ratelimit_sidecar::metrics::Metrics::new()),
        )
        .unwrap(),
    )
}

/// One decision's work, on the one node a Sentinel store has.
fn call(key: &str) -> ratelimit_sidecar::store::Work {
    use ratelimit_sidecar::store::{BucketLimits, Charge, GrantCap, Group, Work};
    Work {
        groups: vec![Group {
            record: None,
            requests: vec![vec![Charge {
                receipt: 0,
                key: std::sync::Arc::from(bucket("b10", key)),
                bucket: BucketLimits::new(10, 1.0),
                cost: 1,
                shadow: false,
                lease: None,
                grant_cap: GrantCap::Share,
            }]],
        }],
        returns: vec![],
    }
}

fn the_node() -> ratelimit_sidecar::store::redis::NodeId {
    ratelimit_sidecar::store::redis::NodeId::primary()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_without_a_primary_share_one_lookup_and_a_failed_one_backs_off() {
    use ratelimit_sidecar::store::redis::Nodes;
    use std::sync::atomic::Ordering;
    // A hung Sentinel: 50 concurrent callers give up after 50 ms; one lookup (1 s) runs, no
    // queue of 50 lookups behind it.
    let (url, accepted) = counting_listener(true);
    let store = store_on(&url, 50);
    let calls = call("flight");
    let answers =
        futures::future::join_all((0..50).map(|_| store.apply(the_node(), calls.clone()))).await;
    assert!(answers.iter().all(Result::is_err));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "one lookup for 50 callers"
    );

    // A Sentinel that fails at once: callers in a tight loop for 1 s start at most one lookup
    // per 100 ms back-off, not one each.
    let (url, accepted) = counting_listener(false);
    let store = store_on(&url, 50);
    let started = Instant::now();
    let mut n = 0;
    while started.elapsed() < Duration::from_secs(1) {
        assert!(store.apply(the_node(), calls.clone()).await.is_err());
        n += 1;
    }
    let lookups = accepted.load(Ordering::SeqCst);
    println!("{n} calls in 1 s started {lookups} lookups");
    assert!(n > 50, "callers got the error at once: {n}");
    assert!(lookups <= 15, "{lookups} lookups for {n} calls");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_gives_up_does_not_make_the_store_forget_the_primary() {
    use ratelimit_sidecar::store::redis::Nodes;
    let primary = Redis::start();
    let sentinel = Sentinel::start(MASTER, primary.port, 1);
    let store = store_on(&sentinel.url(), 2000);
    let calls = call(&unique("dropped"));
    store
        .apply(the_node(), calls.clone())
        .await
        .expect("a first call finds the primary");
    let connections = || -> u64 {
        primary
            .cli(&["INFO", "stats"])
            .lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let before = connections();
    // Callers that go away mid-call (as hyper drops a handler when Envoy gives up).
    for _ in 0..10 {
        let _ = tokio::time::timeout(
            Duration::from_micros(1),
            store.apply(the_node(), calls.clone()),
        )
        .await;
    }
    store
        .apply(the_node(), calls.clone())
        .await
        .expect("still decides");
    tokio::time::sleep(Duration::from_millis(200)).await;
    store
        .apply(the_node(), calls.clone())
        .await
        .expect("still decides");
    // The only new connection is the one redis-cli makes to read INFO: no lookup happened (a
    // lookup connects twice, to check ROLE and to decide).
    assert_eq!(
        connections(),
        before + 1,
        "no new lookup: the primary was not forgotten"
    );
}
