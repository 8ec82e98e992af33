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
