//! Concurrency slots (`lua/slots.lua`, docs/concurrency.md) against real redis-servers: the
//! script and its Rust model (`store::memory`) answer the same random work alike; a slot nobody
//! renews comes back after its ttl, not before, and the set's key expires with its last slot;
//! on a Cluster a request's slots on several nodes are all or none; through Sentinel the slots
//! live on the primary it names; and over real HTTP a full set answers `concurrency` until
//! `POST /v1/slots` releases a slot.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use ratelimit_e2e::{Redis, RedisCluster, Sentinel};
use ratelimit_sidecar::metrics::Metrics;
use ratelimit_sidecar::store::memory::MemoryStore;
use ratelimit_sidecar::store::redis::StoreOptions;
use ratelimit_sidecar::store::{BucketStore, RedisStore, Slot, SlotUpdate, SlotsTaken};
use redis::Commands;
use serde_json::{json, Value};
use support::{unique, Sidecar};

const SETS: [&str; 3] = ["rl:{a}:c", "rl:{b}:c", "rl:{c}:c"];
const LIMITS: [u32; 3] = [1, 2, 3];

fn slot(set: usize, id: &str, ttl_ms: u64) -> Slot {
    Slot {
        key: Arc::from(SETS[set]),
        id: Arc::from(id),
        ttl_ms,
        limit: LIMITS[set],
        unsure_ms: ttl_ms,
    }
}

/// A store on one Redis, made inside `rt` (its connections live there).
fn store_on(rt: &tokio::runtime::Runtime, url: &str) -> RedisStore {
    let options = StoreOptions {
        timeout_ms: 5_000,
        ..StoreOptions::default()
    };
    rt.block_on(async { RedisStore::single(url, 1, options, Arc::new(Metrics::new())).unwrap() })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// One generated step: a take of 1 to 3 slots (set, id), a renewal or a release.
#[derive(Debug, Clone)]
enum Step {
    Take(Vec<(usize, u8)>),
    Renew(Vec<(usize, u8)>),
    Release(Vec<(usize, u8)>),
}

fn step() -> impl Strategy<Value = Step> {
    let slots = prop::collection::vec((0..SETS.len(), 0u8..6), 1..4);
    prop_oneof![
        3 => slots.clone().prop_map(Step::Take),
        1 => slots.clone().prop_map(Step::Renew),
        2 => slots.prop_map(Step::Release),
    ]
}

#[test]
fn the_lua_slots_and_the_rust_model_answer_alike() {
    let redis = Redis::start();
    let rt = runtime();
    let store = store_on(&rt, &redis.url());
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let case = std::sync::atomic::AtomicU64::new(0);
    runner
        .run(&prop::collection::vec(step(), 1..40), |steps| {
            // Each case its own ids: slots outlive the case (ttl 600 s, no expiry in a run).
            let n = case.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let model = MemoryStore::new(1_700_000_000_000_000, 0.1, 10_000);
            rt.block_on(async {
                for k in SETS {
                    let _: () = redis.connection().del(k).unwrap();
                }
            });
            for (i, s) in steps.iter().enumerate() {
                let slots = |v: &[(usize, u8)]| -> Vec<Slot> {
                    v.iter()
                        .map(|(set, id)| slot(*set, &format!("c{n}-s{id}"), 600_000))
                        .collect()
                };
                let (lua, rust) = match s {
                    Step::Take(v) => {
                        let lua = rt.block_on(store.take_slots(slots(v))).unwrap();
                        (
                            format!("{lua:?}"),
                            format!("{:?}", model.take_slots_now(&slots(v))),
                        )
                    }
                    Step::Renew(v) | Step::Release(v) => {
                        let update = if matches!(s, Step::Renew(_)) {
                            SlotUpdate::Renew
                        } else {
                            SlotUpdate::Release
                        };
                        let lua = rt.block_on(store.update_slots(update, slots(v))).unwrap();
                        (
                            format!("{lua:?}"),
                            format!("{:?}", model.update_slots_now(update, &slots(v))),
                        )
                    }
                };
                prop_assert_eq!(&lua, &rust, "step {} {:?}", i, s);
            }
            for k in SETS {
                let mut held: Vec<String> = redis.connection().zrange(k, 0, -1).unwrap();
                held.sort();
                prop_assert_eq!(held, model.held_slots(k), "set {}", k);
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn a_slot_nobody_renews_comes_back_after_its_ttl_and_its_set_expires_with_it() {
    let redis = Redis::start();
    let rt = runtime();
    let store = store_on(&rt, &redis.url());
    let taken_at = Instant::now();
    let first = rt.block_on(store.take_slots(vec![slot(0, "dead", 1_000)]));
    assert_eq!(first.unwrap(), SlotsTaken::Taken);
    let pttl: i64 = redis.connection().pttl(SETS[0]).unwrap();
    // PEXPIREAT rounds the slot's expiry (µs of TIME) up to the next ms: at most 1 ms more.
    assert!(
        (1..=1_001).contains(&pttl),
        "the set expires with its slot: {pttl} ms"
    );
    // A renewal holds a live slot longer; nobody renews "dead": it comes back by itself.
    let mut refused = 0;
    let came_back = loop {
        match rt
            .block_on(store.take_slots(vec![slot(0, "next", 1_000)]))
            .unwrap()
        {
            SlotsTaken::Taken => break taken_at.elapsed(),
            SlotsTaken::Full { index } => {
                assert_eq!(index, 0);
                refused += 1;
            }
        }
        assert!(
            taken_at.elapsed() < Duration::from_secs(30),
            "never came back"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(refused > 0, "the slot was held at first");
    assert!(
        came_back >= Duration::from_millis(1_000),
        "a slot is held its whole ttl: back after {came_back:?}"
    );
    println!("an unrenewed slot (ttl 1000 ms) came back after {came_back:?}");
    let renewed = rt
        .block_on(store.update_slots(SlotUpdate::Renew, vec![slot(0, "dead", 1_000)]))
        .unwrap();
    assert_eq!(renewed, [false], "an expired slot is not renewed");
    let released = rt
        .block_on(store.update_slots(SlotUpdate::Release, vec![slot(0, "next", 1_000)]))
        .unwrap();
    assert_eq!(released, [true]);
    let exists: bool = redis.connection().exists(SETS[0]).unwrap();
    assert!(!exists, "the last release removes the set");
}

#[test]
fn through_sentinel_slots_are_taken_renewed_and_released_on_the_primary_it_names() {
    let primary = Redis::start();
    let sentinel = Sentinel::start("slots", primary.port, 1);
    let rt = runtime();
    let store = rt.block_on(async {
        RedisStore::sentinel(
            &[sentinel.url()],
            "slots",
            StoreOptions {
                timeout_ms: 5_000,
                ..StoreOptions::default()
            },
            Arc::new(Metrics::new()),
        )
        .unwrap()
    });
    // Set 0 holds 1 slot: a second request waits until the first releases it.
    let take = |id: &str| {
        rt.block_on(store.take_slots(vec![slot(0, id, 10_000)]))
            .unwrap()
    };
    assert_eq!(take("first"), SlotsTaken::Taken);
    assert_eq!(take("second"), SlotsTaken::Full { index: 0 });
    let members: Vec<String> = primary.connection().zrange(SETS[0], 0, -1).unwrap();
    assert_eq!(
        members,
        ["first"],
        "the slot is on the primary Sentinel names"
    );
    let renewed = rt
        .block_on(store.update_slots(SlotUpdate::Renew, vec![slot(0, "first", 10_000)]))
        .unwrap();
    assert_eq!(renewed, [true]);
    let released = rt
        .block_on(store.update_slots(SlotUpdate::Release, vec![slot(0, "first", 10_000)]))
        .unwrap();
    assert_eq!(released, [true]);
    assert_eq!(take("second"), SlotsTaken::Taken);
}

#[test]
fn on_a_cluster_a_requests_slots_on_several_nodes_are_all_or_none() {
    let cluster = RedisCluster::start();
    let rt = runtime();
    let seeds: Vec<String> = cluster.nodes.iter().map(Redis::url).collect();
    let store = rt.block_on(async {
        let s = RedisStore::cluster(
            &seeds,
            StoreOptions {
                timeout_ms: 5_000,
                ..StoreOptions::default()
            },
            Arc::new(Metrics::new()),
        )
        .unwrap();
        s.check_readiness().await;
        s
    });
    // Keys whose hash tags land on different primaries ({a}, {b}, {c}: slots 15495, 3300, 7365).
    let mut one_of_a = slot(0, "holder", 60_000);
    one_of_a.limit = 1;
    assert_eq!(
        rt.block_on(store.take_slots(vec![one_of_a])).unwrap(),
        SlotsTaken::Taken
    );
    let both = vec![
        slot(1, "req", 60_000),
        slot(2, "req", 60_000),
        slot(0, "req", 60_000),
    ];
    assert_eq!(
        rt.block_on(store.take_slots(both.clone())).unwrap(),
        SlotsTaken::Full { index: 2 }
    );
    let held = rt
        .block_on(store.update_slots(SlotUpdate::Renew, both.clone()))
        .unwrap();
    assert_eq!(
        held,
        [false, false, false],
        "nothing of the refused request is held"
    );
    let freed = rt
        .block_on(store.update_slots(SlotUpdate::Release, vec![slot(0, "holder", 60_000)]))
        .unwrap();
    assert_eq!(freed, [true]);
    assert_eq!(
        rt.block_on(store.take_slots(both.clone())).unwrap(),
        SlotsTaken::Taken
    );
    let held = rt
        .block_on(store.update_slots(SlotUpdate::Renew, both))
        .unwrap();
    assert_eq!(held, [true, true, true]);
}

const POLICY: &str = r#"
rules:
  pair: {capacity: 100, refill_per_sec: 10, concurrency: 2, slot_ttl_ms: 5000}
"#;

async fn slots_call(sidecar: &Sidecar, body: Value) -> (u16, Value) {
    sidecar.post_to("/v1/slots", body.to_string()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http_a_full_set_answers_concurrency_until_a_slot_is_released() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis_with(&redis, POLICY).await;
    let app = unique("app");
    let request = json!({"decisions": [{"rule": "pair", "subject": {"app": app}}]});
    let mut ids = Vec::new();
    for _ in 0..2 {
        let (status, a) = sidecar.call(json!([request.clone()]), json!({})).await;
        assert_eq!(status, 200, "{a}");
        let answer = &a["answers"][0];
        assert_eq!(answer["allowed"], json!(true), "{a}");
        let id = answer["slot"]["id"].as_str().unwrap().to_string();
        assert_eq!(
            answer["slot"],
            json!({"id": id, "ttl_ms": 5000, "decisions": [0]})
        );
        ids.push(id);
    }
    assert_ne!(ids[0], ids[1], "each request holds a slot of its own");
    let (_, a) = sidecar.call(json!([request.clone()]), json!({})).await;
    let r = &a["answers"][0]["results"][0];
    assert_eq!(a["answers"][0]["allowed"], json!(false), "{a}");
    assert_eq!(
        (r["reason"].clone(), r["retry_after_ms"].clone()),
        (json!("concurrency"), json!(1000))
    );
    let slot_ref = |s: &str| json!({"rule": "pair", "subject": {"app": app}, "slot": s});
    let (status, u) = slots_call(
        &sidecar,
        json!({"renew": [slot_ref(&ids[1]), slot_ref("nope")], "release": [slot_ref(&ids[0])]}),
    )
    .await;
    assert_eq!(status, 200, "{u}");
    assert_eq!(
        u,
        json!({"renewed": 1, "released": 1, "unknown": 1, "ttl_ms": 5000})
    );
    let (_, a) = sidecar.call(json!([request.clone()]), json!({})).await;
    assert_eq!(a["answers"][0]["allowed"], json!(true), "{a}");
    assert_eq!(
        sidecar
            .metric("ratelimit_slots_total{rule=\"pair\",outcome=\"full\"}")
            .await,
        1.0
    );
    // Issue 32, case 9: a caller cannot name a slot id, so it cannot share one between requests.
    let named = json!({"slot": ids[1], "decisions": [{"rule": "pair", "subject": {"app": app}}]});
    let (status, e) = sidecar.call(json!([named]), json!({})).await;
    assert_eq!(status, 400, "{e}");
    assert!(e["error"].as_str().unwrap().contains("slot"), "{e}");
    let (status, e) = slots_call(
        &sidecar,
        json!({"release": [{"rule": "pair", "slot": "a b"}]}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        e["error"]
            .as_str()
            .unwrap()
            .starts_with("release[0].slot: "),
        "{e}"
    );
    let (status, _) = slots_call(&sidecar, json!({})).await;
    assert_eq!(status, 400, "an empty call");
}
