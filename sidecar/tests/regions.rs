//! Regional shares on a real Redis (`docs/regions.md`): the bucket script applies a region's
//! share, a bucket idle through a dip of the share is taken under the dip, and a sidecar applies
//! the share record the rebalancer writes (`lua/share_record.lua`) under its lease.

mod support;

use std::sync::Arc;
use std::time::Duration;

use ratelimit_e2e::Redis;
use ratelimit_regions::{Share, ShareHistory};
use ratelimit_sidecar::metrics::Metrics;
use ratelimit_sidecar::regional::record::{self, ShareWrite};
use ratelimit_sidecar::store::redis::{NodeId, Nodes, StoreOptions};
use ratelimit_sidecar::store::{BucketLimits, Charge, GrantCap, Group, RedisStore, Work};
use serde_json::{json, Value};
use support::{decision, Sidecar};

fn s(fraction: f64) -> Share {
    Share::from_fraction(fraction).unwrap()
}

/// Redis's clock, in milliseconds (the clock share histories are stamped with).
fn redis_ms(redis: &Redis) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut redis.connection()).unwrap();
    secs * 1000 + micros / 1000
}

async fn store(redis: &Redis) -> RedisStore {
    let store = RedisStore::single(
        &redis.url(),
        1,
        StoreOptions {
            timeout_ms: 5_000,
            ..StoreOptions::default()
        },
        Arc::new(Metrics::new()),
    )
    .unwrap();
    store.check_readiness().await;
    store
}

/// Takes `n` tokens one request at a time from `key` (capacity 100, refill 0.001/s) under
/// `history`; how many were admitted.
async fn take(store: &RedisStore, key: &str, history: &ShareHistory, n: usize) -> usize {
    let charge = Charge {
        receipt: 0,
        key: Arc::from(key),
        bucket: BucketLimits {
            capacity: 100,
            refill_per_sec: 0.001,
            share: Some(Arc::new(history.clone())),
        },
        cost: 1,
        shadow: false,
        lease: None,
        grant_cap: GrantCap::Share,
    };
    let work = Work {
        groups: vec![Group {
            record: None,
            requests: vec![vec![charge]; n],
        }],
        returns: vec![],
    };
    let answer = store.apply(NodeId::primary(), work).await.unwrap();
    answer[0].iter().filter(|r| r.charged()).count()
}

#[tokio::test]
async fn a_bucket_idle_through_a_dip_of_its_share_is_taken_under_the_dip() {
    let redis = Redis::start();
    let store = store(&redis).await;
    let half = ShareHistory::new(0, s(0.5));
    // Three buckets take 10 of their 50 under a share of 0.5.
    for key in ["rl:{a}", "rl:{c}"] {
        assert_eq!(take(&store, key, &half, 10).await, 10);
    }
    // Then the share dips to 0.1 and comes back to 0.5.
    let t = redis_ms(&redis);
    let mut dipped = half.clone();
    dipped.record(t + 1, s(0.1));
    dipped.record(t + 2, s(0.5));
    // A bucket whose last decision was before the dip holds at most the dip's capacity: 10, not
    // the 40 it had (the share-now rule would hand out 30 tokens another region may have spent).
    assert_eq!(take(&store, "rl:{a}", &dipped, 100).await, 10);
    // A bucket never used is full at the smallest share of the last fill time: the dip too.
    assert_eq!(take(&store, "rl:{b}", &dipped, 100).await, 10);
    // A dip that ended before the bucket's last decision (and the clock margin) does not count.
    let mut old_dip = ShareHistory::new(0, s(0.5));
    old_dip.record(t - 20_000, s(0.1));
    old_dip.record(t - 19_000, s(0.5));
    assert_eq!(take(&store, "rl:{c}", &old_dip, 100).await, 40);
    // A grow adds capacity, never tokens: the empty bucket gains nothing at once.
    let mut grown = dipped.clone();
    grown.record(redis_ms(&redis), s(0.9));
    assert_eq!(take(&store, "rl:{a}", &grown, 100).await, 0);
}

const POLICY: &str = r#"
rules:
  global:
    capacity: 100
    refill_per_sec: 0.001
    regions: {eu: 0.5, us: 0.5}
  local: {capacity: 10, refill_per_sec: 0.001}
"#;

/// Writes eu's share record as the rebalancer does; whether the script applied it.
fn write_share(redis: &Redis, version: u64, share: Share, lease_ms: u64) -> bool {
    let w = ShareWrite {
        version,
        share,
        lease_ms,
        keep_ms: 200_000_000,
        initial: s(0.5),
    };
    let (applied, _): (u64, u64) = w
        .cmd("rl:share:{ratelimit|global}")
        .query(&mut redis.connection())
        .unwrap();
    applied == 1
}

/// The share record version the sidecar's `/readyz` shows for `global`.
async fn version_read(sidecar: &Sidecar) -> Option<u64> {
    let (_, body) = sidecar.get("/readyz").await;
    let ready: Value = serde_json::from_str(&body).ok()?;
    ready["regional_shares"][0]["version"].as_u64()
}

/// Sends `n` requests of one `global` decision for `id`; how many were admitted.
async fn burst(sidecar: &Sidecar, id: &str, n: usize) -> usize {
    let (status, a) = sidecar
        .call(
            json!(vec![json!({"decisions": [decision("global", id, 1)]}); n]),
            json!({}),
        )
        .await;
    assert_eq!(status, 200, "{a}");
    a["answers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["allowed"] == true)
        .count()
}

async fn wait_for_version(sidecar: &Sidecar, version: u64) {
    for _ in 0..1500 {
        if version_read(sidecar).await == Some(version) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the sidecar never read version {version}");
}

#[tokio::test]
async fn a_sidecar_applies_its_regions_share_record_under_its_lease() {
    let redis = Redis::start();
    let sidecar = Sidecar::with_policy(
        POLICY,
        &[
            "--redis",
            &redis.url(),
            "--redis-timeout-ms",
            "500",
            "--region",
            "eu",
        ],
    )
    .await;
    sidecar.wait_ready("/readyz").await;
    // No record yet: the policy's initial share (0.5 of 100), as the answer says.
    assert_eq!(version_read(&sidecar).await, Some(0));
    assert_eq!(burst(&sidecar, "a", 60).await, 50);
    let (_, a) = sidecar.decide(json!([decision("global", "a", 1)])).await;
    assert_eq!(a["results"][0]["limit"]["capacity"], 50);

    // The rebalancer's writes: versioned, a stale one refused.
    assert!(write_share(&redis, 1, s(0.5), 5_000));
    assert!(burst(&sidecar, "b", 10).await == 10);
    assert!(write_share(&redis, 2, s(0.1), 5_000));
    assert!(write_share(&redis, 3, s(0.5), 5_000));
    assert!(!write_share(&redis, 3, s(0.9), 5_000), "same version");
    assert!(!write_share(&redis, 2, s(0.9), 5_000), "older version");
    wait_for_version(&sidecar, 3).await;
    // b took 10 before the dip: it holds the dip's 10, not its 40.
    assert_eq!(burst(&sidecar, "b", 100).await, 10);

    // A grow: a new bucket is full at the smallest share of its fill time (the dip), and the
    // answer names the share in force.
    assert!(write_share(&redis, 4, s(0.8), 5_000));
    wait_for_version(&sidecar, 4).await;
    let (_, a) = sidecar.decide(json!([decision("global", "c", 1)])).await;
    assert_eq!(a["results"][0]["limit"]["capacity"], 80);

    // The demand counters hold what eu decided, in tokens: a 50 of 60, a 0 of 1, b 10 of 10 and
    // 10 of 100, c 1 of 1.
    let demand = || {
        let fields: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg("rl:demand:{ratelimit|global}")
            .query(&mut redis.connection())
            .unwrap();
        record::parse_demand(&fields).unwrap()
    };
    let mut counted = demand();
    for _ in 0..1000 {
        if counted == (50 + 10 + 10 + 1, 10 + 1 + 90) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        counted = demand();
    }
    assert_eq!(counted, (71, 101));

    // A short lease, then a record the sidecar cannot trust: once the lease (less the time a
    // decision may take to reach Redis, the Redis timeout) runs out the
    // regional rule answers "unavailable" (the gateway's on_error decides); other rules decide.
    assert!(write_share(&redis, 5, s(0.8), 1_000));
    wait_for_version(&sidecar, 5).await;
    let _: () = redis::cmd("HSET")
        .arg("rl:share:{ratelimit|global}")
        .arg("history")
        .arg("garbage")
        .query(&mut redis.connection())
        .unwrap();
    let mut answer = Value::Null;
    for _ in 0..1500 {
        let (status, a) = sidecar.decide(json!([decision("global", "d", 1)])).await;
        if status == 503 {
            answer = a;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let error = answer["error"].as_str().expect("503 unavailable");
    assert!(
        error.contains("past its lease of 1000 ms less the Redis timeout (500 ms)"),
        "{error}"
    );
    assert!(error.contains("not <from_ms>:<ppm>"), "{error}");
    let (status, a) = sidecar.decide(json!([decision("local", "d", 1)])).await;
    assert_eq!((status, a["allowed"].clone()), (200, json!(true)));
    let (status, ready) = sidecar.get("/readyz").await;
    assert_eq!(status, 200, "only the rule is unavailable: {ready}");
    assert!(ready.contains("\"leased\":false"), "{ready}");
}

#[tokio::test]
async fn the_share_record_keeps_its_history_bounded_and_never_larger() {
    let redis = Redis::start();
    let key = "rl:share:{ratelimit|global}";
    let write = |version: u64, ppm: u32, keep_ms: u64| {
        let w = ShareWrite {
            version,
            share: Share::from_ppm(ppm).unwrap(),
            lease_ms: 5_000,
            keep_ms,
            initial: s(0.5),
        };
        let _: (u64, u64) = w.cmd(key).query(&mut redis.connection()).unwrap();
    };
    let read = || {
        let fields: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(key)
            .query(&mut redis.connection())
            .unwrap();
        record::parse(&fields).unwrap().unwrap()
    };
    // Created with the policy's share as the change at 0, then the write's.
    write(1, 300_000, 1_000_000);
    let r = read();
    let changes: Vec<(u64, u32)> = r.history.changes().map(|(t, s)| (t, s.ppm())).collect();
    assert_eq!(changes[0], (0, 500_000));
    assert_eq!(changes[1].1, 300_000);
    assert_eq!((r.version, r.share.ppm(), r.lease_ms), (1, 300_000, 5_000));
    // More changes than kept: the oldest merge into the smaller share, the newest stay exact.
    for v in 2..=(record::MAX_CHANGES as u64 + 10) {
        write(v, 100_000 + (v as u32 % 7) * 100_000, 1_000_000);
    }
    let r = read();
    let changes: Vec<(u64, u32)> = r.history.changes().map(|(t, s)| (t, s.ppm())).collect();
    assert_eq!(changes.len(), record::MAX_CHANGES);
    assert_eq!(changes[0].0, 0, "merged into the oldest's time");
    assert_eq!(changes[0].1, 100_000, "with the smallest share merged");
    // A write with no look-back keeps only the change in force.
    write(100, 700_000, 0);
    let r = read();
    assert_eq!(
        r.history
            .changes()
            .map(|(_, s)| s.ppm())
            .collect::<Vec<_>>(),
        [700_000]
    );
}
