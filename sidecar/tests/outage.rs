//! Redis down, hung, restarted: 503 within the timeout, and recovery without a sidecar restart.

mod support;

use std::time::{Duration, Instant};

use ratelimit_e2e::{free_port, Redis};
use serde_json::json;
use support::{decision, unique, Sidecar};

const TIMEOUT_MS: u64 = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_answers_503_and_a_restarted_redis_is_used_again() {
    let mut redis = Redis::start();
    let sidecar = Sidecar::start(&[
        "--redis",
        &redis.url(),
        "--redis-timeout-ms",
        &TIMEOUT_MS.to_string(),
    ])
    .await;
    sidecar.wait_ready("/readyz").await;
    let one = json!([decision("b100", &unique("outage"), 1)]);
    // Poll rather than assume: on a busy machine one call may exceed 100 ms.
    let mut ok = false;
    for _ in 0..50 {
        if sidecar.decide(one.clone()).await.0 == 200 {
            ok = true;
            break;
        }
    }
    assert!(ok, "no decision succeeded before the outage");
    let loads_before = sidecar.metric("ratelimit_script_loads_total").await;

    // Hung Redis (SIGSTOP): the timeout answers.
    let pid = redis.pid().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    let started = Instant::now();
    let (status, a) = sidecar.decide(one.clone()).await;
    let hung_ms = started.elapsed().as_millis();
    std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status()
        .unwrap();
    println!("hung redis: {status} after {hung_ms} ms (timeout {TIMEOUT_MS} ms): {a}");
    assert_eq!(status, 503, "{a}");
    assert!(a["error"]
        .as_str()
        .unwrap()
        .starts_with("redis unavailable"));
    assert!(hung_ms >= u128::from(TIMEOUT_MS));
    assert!(hung_ms < u128::from(TIMEOUT_MS) + 1000, "{hung_ms} ms");

    // Stopped Redis: connection refused, answered at once.
    redis.stop();
    let started = Instant::now();
    let (status, a) = sidecar.decide(one.clone()).await;
    let down_ms = started.elapsed().as_millis();
    println!("stopped redis: {status} after {down_ms} ms: {a}");
    assert_eq!(status, 503, "{a}");
    assert!(down_ms < u128::from(TIMEOUT_MS) + 1000, "{down_ms} ms");
    let (status, _) = sidecar.get("/readyz").await;
    assert_eq!(status, 503);

    // Restarted on the same port, script cache empty: decisions succeed again, no NOSCRIPT leaks.
    redis.restart();
    let started = Instant::now();
    loop {
        let (status, a) = sidecar.decide(one.clone()).await;
        if status == 200 {
            assert_eq!(a["allowed"], true, "{a}");
            break;
        }
        assert_eq!(status, 503, "{a}");
        assert!(!a.to_string().contains("NOSCRIPT"), "{a}");
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "never recovered: {a}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "recovered {} ms after the restart",
        started.elapsed().as_millis()
    );
    let loads_after = sidecar.metric("ratelimit_script_loads_total").await;
    assert!(
        loads_after > loads_before,
        "{loads_before} -> {loads_after}"
    );
    assert!(sidecar.metric("ratelimit_redis_errors_total").await >= 2.0);
    assert!(
        sidecar
            .metric("ratelimit_requests_total{outcome=\"unavailable\"}")
            .await
            >= 2.0
    );
}

/// Script calls Redis has run (EVALSHA and EVAL), from `INFO commandstats`.
/// The bucket script calls Redis ran: EVALSHA (an EVAL heals a NOSCRIPT, which this test does
/// not cause; the epoch's fence, once a second, is an EVAL of its own: lua/fence.lua).
fn script_calls(redis: &Redis) -> u64 {
    let stats = redis.cli(&["info", "commandstats"]);
    ["cmdstat_evalsha:"]
        .iter()
        .filter_map(|name| stats.lines().find(|l| l.starts_with(name)))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

fn connected_clients(redis: &Redis) -> u64 {
    let info = redis.cli(&["info", "clients"]);
    info.lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(u64::MAX)
}

fn signal(redis: &Redis, signal: &str) {
    let pid = redis.pid().to_string();
    assert!(std::process::Command::new("kill")
        .args([signal, &pid])
        .status()
        .unwrap()
        .success());
}

/// A Redis that stalls (SIGSTOP) while callers keep deciding: each decision is answered 503 at
/// the timeout, and the script calls already sent wait in Redis's queue: all of them run when it
/// resumes, charging buckets for decisions answered long ago. A call keeps its pipeline slot until
/// Redis answers it, and a connection with a command unanswered for the stall limit (1 s) is
/// closed, so however long the stall and however many decisions it failed, Redis runs at most
/// `--redis-pipeline` calls per connection it had when the stall began, plus the calls holding a
/// slot when it resumes: `pipeline · (connections + 1)`. (Before, it ran one call per slot per
/// timeout: about 100 here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_redis_runs_a_bounded_backlog_of_script_calls_when_it_resumes() {
    const PIPELINE: u64 = 2;
    const CONNECTIONS: u64 = 2;
    let redis = Redis::start();
    let sidecar = std::sync::Arc::new(
        Sidecar::start(&[
            "--redis",
            &redis.url(),
            "--redis-timeout-ms",
            "50",
            "--redis-pipeline",
            &PIPELINE.to_string(),
            "--redis-connections",
            &CONNECTIONS.to_string(),
        ])
        .await,
    );
    sidecar.wait_ready("/readyz").await;
    let key = unique("stall");
    let one = json!([decision("b100", &key, 1)]);
    let mut ok = false;
    for _ in 0..50 {
        if sidecar.decide(one.clone()).await.0 == 200 {
            ok = true;
            break;
        }
    }
    assert!(ok, "no decision succeeded before the stall");
    let before = script_calls(&redis);

    // 8 callers decide as fast as they are answered for 2.5 s of stall: more than twice the
    // stall limit, so every connection is given up at least twice.
    signal(&redis, "-STOP");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let callers: Vec<_> = (0..8)
        .map(|c| {
            let (sidecar, stop) = (sidecar.clone(), stop.clone());
            let mine = json!([decision("b100", &format!("{key}-{c}"), 1)]);
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    statuses.push(sidecar.decide(mine.clone()).await.0);
                }
                statuses
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut failed = 0;
    for c in callers {
        let statuses = c.await.unwrap();
        assert!(statuses.iter().all(|s| *s == 503), "{statuses:?}");
        failed += statuses.len() as u64;
    }
    signal(&redis, "-CONT");

    // Redis has run what it was sent once the connections the sidecar gave up are gone (Redis
    // reads a closed connection to its end, running every command on it, before it frees it) and
    // the count stands still.
    let started = Instant::now();
    let mut last = u64::MAX;
    let ran = loop {
        let now = script_calls(&redis);
        if now == last && connected_clients(&redis) <= CONNECTIONS + 1 {
            break now - before;
        }
        last = now;
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "Redis never settled: {now} script calls, {} clients",
            connected_clients(&redis)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let bound = PIPELINE * (CONNECTIONS + 1);
    println!("{failed} decisions answered 503 during the stall; Redis then ran {ran} script calls (bound {bound})");
    assert!(
        failed > 4 * bound,
        "the stall failed only {failed} decisions"
    );
    assert!(
        ran <= bound,
        "{ran} script calls ran after the stall, more than {bound}"
    );

    // And the sidecar decides again at once.
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let (status, a) = sidecar.decide(one.clone()).await;
        statuses.push(status);
        if status == 200 {
            assert_eq!(a["allowed"], true, "{a}");
            break;
        }
    }
    assert_eq!(
        statuses.last(),
        Some(&200),
        "after the resume: {statuses:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_starts_without_redis_and_becomes_ready_when_it_answers() {
    let port = free_port();
    let sidecar = Sidecar::start(&[
        "--redis",
        &format!("redis://127.0.0.1:{port}"),
        "--redis-timeout-ms",
        "2000",
    ])
    .await;
    sidecar.assert_up_but_unavailable().await;

    let _redis = Redis::start_on(port, &[]);
    sidecar.wait_ready("/readyz").await;
    let (status, a) = sidecar
        .decide(json!([decision("b1", &unique("late"), 1)]))
        .await;
    assert_eq!(status, 200, "{a}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_maxmemory_policy_is_reported_by_readyz() {
    let redis = Redis::start_with(&["--maxmemory-policy", "allkeys-lru"]);
    let sidecar = Sidecar::on_redis(&redis).await;
    let (status, body) = sidecar.get("/readyz").await;
    assert_eq!(status, 200, "Redis answers, so ready: {body}");
    assert!(body.contains("allkeys-lru"), "{body}");
    assert!(body.contains("evict"), "{body}");

    let quiet = Redis::start_with(&["--maxmemory-policy", "noeviction"]);
    let sidecar = Sidecar::on_redis(&quiet).await;
    let (_, body) = sidecar.get("/readyz").await;
    assert!(!body.contains("warning"), "{body}");
}
