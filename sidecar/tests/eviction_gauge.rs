//! `ratelimit_redis_evicting_policy`: the eviction risk as a metric an alert can read, set by
//! every readiness check from what Redis says its `maxmemory-policy` is.

mod support;

use ratelimit_e2e::Redis;
use support::Sidecar;

const GAUGE: &str = "ratelimit_redis_evicting_policy ";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_policy_sets_the_gauge_and_noeviction_clears_it_at_the_next_readiness_check() {
    let redis = Redis::start_with(&["--maxmemory-policy", "allkeys-lru"]);
    let sidecar = Sidecar::on_redis(&redis).await;
    // `on_redis` waited for /readyz, which read the policy.
    assert_eq!(sidecar.metric(GAUGE).await, 1.0, "allkeys-lru can evict");

    // The operator fixes Redis; the next readiness check (a kubelet probe) sees it.
    let ok = redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    assert_eq!(ok, "OK");
    let (status, body) = sidecar.get("/readyz").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(sidecar.metric(GAUGE).await, 0.0, "{body}");

    // And back: a volatile-* policy evicts these keys too (they carry TTLs).
    let ok = redis.cli(&["CONFIG", "SET", "maxmemory-policy", "volatile-ttl"]);
    assert_eq!(ok, "OK");
    sidecar.get("/readyz").await;
    assert_eq!(sidecar.metric(GAUGE).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noeviction_reads_zero() {
    let redis = Redis::start_with(&["--maxmemory-policy", "noeviction"]);
    let sidecar = Sidecar::on_redis(&redis).await;
    let (_, text) = sidecar.get("/metrics").await;
    assert!(
        text.contains("# TYPE ratelimit_redis_evicting_policy gauge"),
        "{text}"
    );
    assert_eq!(sidecar.metric(GAUGE).await, 0.0);
}
