//! The bucket's semantics, over real HTTP, against a real redis-server.

mod support;

use std::time::{Duration, Instant};

use ratelimit_e2e::Redis;
use redis::Commands;
use serde_json::json;
use support::{bucket, decision, store_state, stored, unique, Sidecar};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_150_on_a_100_per_10_bucket_admits_100_then_refills() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let id = unique("burst");
    let one = json!([decision("b100", &id, 1)]);

    let started = Instant::now();
    let burst = (0..150).map(|_| sidecar.decide(one.clone()));
    let answers = futures::future::join_all(burst).await;
    let burst_ms = started.elapsed().as_millis() as i64;
    assert!(answers.iter().all(|(s, _)| *s == 200));
    let mut admitted = answers.iter().filter(|(_, a)| a["allowed"] == true).count() as i64;
    // Exactly 100, plus whatever refilled during the burst itself (10/s: one per 100 ms).
    println!("burst of 150 took {burst_ms} ms, admitted {admitted}");
    assert!(admitted >= 100, "admitted {admitted}");
    assert!(
        admitted <= 100 + burst_ms / 100,
        "admitted {admitted} in {burst_ms} ms"
    );

    // Probe until rejected (a slow machine may see a token refill in between). At the rejected
    // probe tokens = 100 + 10/s * t - admitted, so retry_after = ceil((1 - tokens) * 100 ms)
    // lies between the deficit at t = 0 and that deficit less the time elapsed.
    let probe = loop {
        let (status, a) = sidecar.decide(one.clone()).await;
        assert_eq!(status, 200);
        if a["allowed"] == false {
            break a;
        }
        admitted += 1;
        assert!(admitted < 150, "the bucket never ran dry");
    };
    let elapsed_ms = started.elapsed().as_millis() as i64;
    let r = &probe["results"][0];
    assert_eq!(r["reason"], "insufficient");
    assert_eq!(r["remaining"], 0);
    assert_eq!(
        r["limit"],
        json!({"name":"b100","capacity":100,"refill_per_sec":10.0})
    );
    let retry = r["retry_after_ms"].as_i64().unwrap();
    let deficit_ms = (admitted - 99) * 100;
    println!("retry_after_ms {retry}, deficit {deficit_ms} ms, elapsed {elapsed_ms} ms");
    assert!(retry <= deficit_ms, "{retry} > {deficit_ms}");
    assert!(retry >= deficit_ms - elapsed_ms - 1, "{retry} too small");
    assert!(retry > 0);

    // After the wait it said, it admits again (polled, bounded).
    let waited = Instant::now();
    loop {
        let (_, a) = sidecar.decide(one.clone()).await;
        if a["allowed"] == true {
            break;
        }
        assert!(
            waited.elapsed() < Duration::from_secs(5),
            "never refilled: {a}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("admitted again after {} ms", waited.elapsed().as_millis());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_above_capacity_is_never_satisfiable() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let (status, a) = sidecar
        .decide(json!([decision("b10", &unique("big"), 11)]))
        .await;
    assert_eq!(status, 200);
    assert_eq!(a["allowed"], false);
    let r = &a["results"][0];
    assert_eq!(r["reason"], "cost_exceeds_capacity");
    assert_eq!(r["retry_after_ms"], 0);
    assert_eq!(r["remaining"], 10, "the bucket is untouched: {a}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_script_refuses_invalid_arguments_by_itself_and_writes_nothing() {
    let redis = Redis::start();
    let mut c = redis.connection();
    let script = ratelimit_sidecar::store::Script::Apply.text();
    // The call's numbers as lua/bucket.lua's header lays them out: one bucket, one limit of
    // `capacity`, `refill` and share changes `shares` (from_ms, ppm), one request of cost 1.
    let numbers = |capacity: u64, refill: f64, shares: &[(u64, u32)]| {
        let mut n = Vec::new();
        n.extend(10_000u64.to_le_bytes());
        n.extend(0.1f64.to_le_bytes());
        n.push(0);
        n.extend(1000u64.to_le_bytes());
        n.extend(3_600_000u64.to_le_bytes()); // receipt_ttl_ms
        for count in [1u32, 1, 1, 0] {
            n.extend(count.to_le_bytes());
        }
        n.extend(capacity.to_le_bytes());
        n.extend(refill.to_le_bytes());
        n.extend((shares.len() as u32).to_le_bytes());
        for (from_ms, ppm) in shares {
            n.extend(from_ms.to_le_bytes());
            n.extend(ppm.to_le_bytes());
        }
        for count in [1u32, 1, 1, 1] {
            n.extend(count.to_le_bytes());
        }
        n.extend(1u64.to_le_bytes());
        n.extend([0u8, 1]); // not shadow, the grant capped by the share
        n.extend([0u8; 24]); // no lease
        n.extend(0u64.to_le_bytes()); // no receipt
        n
    };
    let mut torn = numbers(10, 1.0, &[]);
    torn.pop();
    let mut long = numbers(10, 1.0, &[]);
    long.push(0);
    // Defense in depth: the sidecar never sends these; the script errors, never allows.
    for (numbers, needle) in [
        (numbers(0, 1.0, &[]), "invalid limit 1"),
        (numbers(10, -1.0, &[]), "invalid limit 1"),
        (numbers(10, f64::NAN, &[]), "must be > 0 and finite"),
        (numbers(10, f64::INFINITY, &[]), "must be > 0 and finite"),
        // A regional share history out of time order, or a share above the whole.
        (numbers(10, 1.0, &[(5, 1000), (3, 1000)]), "invalid limit 1"),
        (numbers(10, 1.0, &[(5, 1_000_001)]), "invalid limit 1"),
        // Numbers cut short or with bytes to spare.
        (torn, "data string too short"),
        (long, "usage: apply mode, all numbers read"),
    ] {
        let e = redis::cmd("EVAL")
            .arg(script)
            .arg(1)
            .arg("rl:{x}")
            .arg("apply")
            .arg(&numbers)
            .arg(&["rl:{x}", "", ""])
            .query::<redis::Value>(&mut c)
            .expect_err("the script must refuse");
        let text = e.to_string();
        assert!(text.contains(needle), "{numbers:?}: {text}");
    }
    let exists: bool = c.exists("rl:{x}").unwrap();
    assert!(!exists, "a refused call writes nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lone_decision_script_refuses_invalid_arguments_and_writes_nothing() {
    let redis = Redis::start();
    let mut c = redis.connection();
    let script = ratelimit_sidecar::store::Script::Single.text();
    // A request's numbers as lua/single.lua reads them: capacity, refill, cost, shadow.
    let request = |capacity: u64, refill: f64, cost: u64| {
        let mut n = Vec::new();
        n.extend(capacity.to_le_bytes());
        n.extend(refill.to_le_bytes());
        n.extend(cost.to_le_bytes());
        n.push(0);
        n
    };
    let good = request(10, 1.0, 1);
    let mut torn = good.clone();
    torn.pop();
    // Defense in depth: the sidecar never sends these; the script errors, never allows. The
    // buckets after the first: one per request after the first.
    for (numbers, others, needle) in [
        (
            request(0, 1.0, 1),
            vec![],
            "capacity, refill_per_sec and cost",
        ),
        (
            request(10, f64::NAN, 1),
            vec![],
            "capacity, refill_per_sec and cost",
        ),
        (
            request(10, f64::INFINITY, 1),
            vec![],
            "capacity, refill_per_sec and cost",
        ),
        (
            request(10, 1.0, 0),
            vec![],
            "capacity, refill_per_sec and cost",
        ),
        (torn, vec![], "25 bytes a request"),
        // Two requests and one bucket, or one request and two.
        (
            [good.clone(), good.clone()].concat(),
            vec![],
            "25 bytes a request",
        ),
        (good.clone(), vec!["rl:{y}"], "25 bytes a request"),
        // The second request is bad: the first, valid, is not decided either.
        (
            [good.clone(), request(10, -1.0, 1)].concat(),
            vec!["rl:{y}"],
            "capacity, refill_per_sec and cost",
        ),
    ] {
        let e = redis::cmd("EVAL")
            .arg(script)
            .arg(1)
            .arg("rl:{x}")
            .arg(&numbers)
            .arg("rl:epoch")
            .arg(&others)
            .query::<redis::Value>(&mut c)
            .expect_err("the script must refuse");
        let text = e.to_string();
        assert!(text.contains(needle), "{numbers:?}: {text}");
    }
    let written: usize = redis::cmd("DBSIZE").query(&mut c).unwrap();
    assert_eq!(
        written, 0,
        "a refused call writes nothing, not even the epoch marker"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timestamp_in_the_future_counts_as_no_time_passed() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let id = unique("clock");
    let key = bucket("b10r1", &id);
    let mut c = redis.connection();
    let (now_s, _): (u64, u64) = redis::cmd("TIME").query(&mut c).unwrap();
    let future_us = ((now_s + 3600) * 1_000_000) as f64;
    store_state(&mut c, &key, 5.0, future_us);

    let (status, a) = sidecar.decide(json!([decision("b10r1", &id, 1)])).await;
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["allowed"], true);
    // Zero elapsed: 5 - 1, neither a negative refill nor a full bucket.
    assert_eq!(a["results"][0]["remaining"], 4, "{a}");
    let s = stored(&mut c, &key).unwrap();
    assert!(
        s.ts_us < future_us,
        "the timestamp is re-anchored to the server's now"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_call_twice_is_charged_once_and_answered_alike() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let id = unique("dedup");
    let requests = json!([
        {"decisions": [decision("b10", &id, 3)]},
        {"decisions": [decision("b10", &id, 2)]}
    ]);
    let (_, first) = sidecar
        .call(requests.clone(), json!({"attempt": "c-1"}))
        .await;
    let (_, second) = sidecar
        .call(requests.clone(), json!({"attempt": "c-1"}))
        .await;
    assert_eq!(first["answers"][1]["allowed"], true, "{first}");
    assert_eq!(first, second);
    assert_eq!(first["answers"][1]["results"][0]["remaining"], 5);
    let s = stored(&mut redis.connection(), &bucket("b10", &id)).unwrap();
    assert!((5.0..5.01).contains(&s.tokens), "charged once: {s:?}");

    let (_, third) = sidecar.call(requests, json!({"attempt": "c-2"})).await;
    assert_eq!(
        third["answers"][1]["results"][0]["remaining"], 0,
        "a new attempt is charged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_decision_leaves_the_other_buckets_untouched() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let id = unique("aon");
    let both = json!([decision("b10", &id, 1), decision("b3", &id, 2)]);
    let (_, a) = sidecar.decide(both.clone()).await;
    assert_eq!(a["allowed"], true);
    // Now the second bucket holds 1 < 2: the whole request is rejected.
    let (_, a) = sidecar.decide(both).await;
    assert_eq!(a["allowed"], false, "{a}");
    assert_eq!(
        a["results"][0]["allowed"], true,
        "the first bucket could pay"
    );
    assert_eq!(a["results"][0]["remaining"], 9, "but was not charged: {a}");
    assert_eq!(a["results"][1]["reason"], "insufficient");
    let s = stored(&mut redis.connection(), &bucket("b10", &id)).unwrap();
    assert!((9.0..9.01).contains(&s.tokens), "untouched: {s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_callers_on_a_bucket_of_50_get_exactly_50() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let id = unique("race");
    let body = json!({"requests": [{"decisions": [decision("b50", &id, 1)]}]}).to_string();
    let calls = (0..200).map(|_| {
        let http = sidecar.http.clone();
        let url = format!("{}/v1/decide", sidecar.base);
        let body = body.clone();
        tokio::spawn(async move {
            let r = http.post(url).body(body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.json::<serde_json::Value>().await.unwrap()["answers"][0]["allowed"] == true
        })
    });
    let admitted = futures::future::join_all(calls)
        .await
        .into_iter()
        .filter(|r| *r.as_ref().unwrap())
        .count();
    assert_eq!(admitted, 50);
    // Concurrent calls were batched into fewer script calls than calls.
    let batches = sidecar
        .metric("ratelimit_script_call_decisions_count")
        .await;
    println!("200 calls took {batches} script calls");
    assert!((1.0..=200.0).contains(&batches));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refill_follows_the_server_clock_and_the_key_expires_once_full_again() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let id = unique("drive");
    let key = bucket("b100", &id);
    let mut c = redis.connection();
    // Drive time: an empty bucket last touched 2.5 s ago (server clock) at 10/s holds 25 tokens.
    let (now_s, now_us): (u64, u64) = redis::cmd("TIME").query(&mut c).unwrap();
    let past_us = (now_s * 1_000_000 + now_us - 2_500_000) as f64;
    store_state(&mut c, &key, 0.0, past_us);
    let (_, a) = sidecar.decide(json!([decision("b100", &id, 1)])).await;
    let r = &a["results"][0];
    assert_eq!(r["remaining"], 24, "25 refilled, 1 charged: {a}");
    // reset = (100 - 24.x) / 10 per s, just under 7.6 s.
    let reset = r["reset_ms"].as_u64().unwrap();
    assert!((7_500..=7_600).contains(&reset), "{reset}");
    // The key lives until the bucket is full again, plus 1 to 3 s: never less, so it never hands
    // out budget early.
    let ttl: i64 = c.pttl(&key).unwrap();
    assert!(
        (reset as i64 + 900..=reset as i64 + 3_000).contains(&ttl),
        "ttl {ttl} ms for a bucket full in {reset} ms"
    );
    // A nearly full bucket expires soon, whatever its full-refill time: memory follows use.
    let slow = unique("slow");
    let (_, a) = sidecar.decide(json!([decision("b10", &slow, 1)])).await;
    let reset = a["results"][0]["reset_ms"].as_u64().unwrap();
    let ttl: i64 = c.pttl(bucket("b10", &slow)).unwrap();
    assert!(
        (reset as i64 + 900..=reset as i64 + 3_000).contains(&ttl),
        "ttl {ttl} ms for a bucket full in {reset} ms"
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_rejections_writes_nothing_unless_the_clock_went_back() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let id = unique("quiet");
    let key = bucket("b5", &id);
    let one = json!([decision("b5", &id, 3)]);
    let (_, a) = sidecar.decide(one.clone()).await;
    assert_eq!(a["allowed"], true, "{a}");
    let mut c = redis.connection();
    // The sidecar makes the store's epoch marker and its stamp (two writes) once, within a second
    // of starting.
    let started = std::time::Instant::now();
    while redis.cli(&["EXISTS", "rl:epoch", "rl:epoch:run"]) != "2" {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "no epoch marker"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let before = stored(&mut c, &key).unwrap();
    let ttl_before: i64 = c.pttl(&key).unwrap();
    let writes_before = writes(&redis);
    // 50 rejected requests, the way the filter calls: each call with an attempt id.
    for i in 0..50 {
        let (_, a) = sidecar
            .call(
                json!([{ "decisions": one }]),
                json!({"attempt": format!("c-{i}")}),
            )
            .await;
        assert_eq!(a["answers"][0]["allowed"], false, "2 left < 3: {a}");
    }
    assert_eq!(
        writes(&redis) - writes_before,
        0,
        "0 writes per rejected request"
    );
    let keys: u64 = redis.cli(&["DBSIZE"]).parse().unwrap();
    assert_eq!(
        keys, 3,
        "the bucket, the epoch marker and its stamp, no attempt records for rejected calls"
    );
    assert_eq!(
        stored(&mut c, &key).unwrap(),
        before,
        "the bucket is as it was"
    );
    let ttl_after: i64 = c.pttl(&key).unwrap();
    assert!(ttl_after <= ttl_before, "nor is its TTL refreshed");

    // A timestamp in the future is re-anchored even by a rejection.
    let (now_s, _): (u64, u64) = redis::cmd("TIME").query(&mut c).unwrap();
    let future_us = ((now_s + 3600) * 1_000_000) as f64;
    store_state(&mut c, &key, 0.0, future_us);
    let (_, a) = sidecar.decide(one).await;
    assert_eq!(a["allowed"], false, "{a}");
    assert!(
        stored(&mut c, &key).unwrap().ts_us < future_us,
        "re-anchored"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_value_under_a_bucket_key_is_a_full_bucket_and_is_replaced() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let id = unique("foreign");
    let key = bucket("b5", &id);
    let mut c = redis.connection();
    let _: () = c.set(&key, "not a bucket").unwrap();
    let (status, a) = sidecar.decide(json!([decision("b5", &id, 1)])).await;
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["results"][0]["remaining"], 4);
    assert!(stored(&mut c, &key).is_some());
    // A hash (the bucket layout of earlier versions) is replaced the same way.
    let old_id = unique("old");
    let old = bucket("b5", &old_id);
    let _: () = c.hset(&old, "tokens", "1").unwrap();
    let (status, a) = sidecar.decide(json!([decision("b5", &old_id, 1)])).await;
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["results"][0]["remaining"], 4);
    assert!(stored(&mut c, &old).is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_rule_is_its_decisions_error_alone_and_charges_nothing_for_it() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let id = unique("unknown");
    let (status, a) = sidecar
        .call(
            json!([
                {"decisions": [decision("b10", &id, 1), decision("nope", &id, 1)]},
                {"decisions": [decision("b10", &id, 1)]}
            ]),
            json!({}),
        )
        .await;
    assert_eq!(status, 200, "{a}");
    // The unknown rule's decision carries the error; the request's known rule decides.
    let first = &a["answers"][0];
    assert!(first["error"].is_null(), "{a}");
    assert_eq!(first["results"][1]["error"]["code"], "unknown_rule", "{a}");
    assert_eq!(first["allowed"], true);
    assert_eq!(
        first["results"][0]["remaining"], 9,
        "the known rule charged"
    );
    assert_eq!(a["answers"][1]["allowed"], true);
    assert_eq!(
        a["answers"][1]["results"][0]["remaining"], 8,
        "charged once per request, nothing for the unknown rule"
    );
    assert_eq!(sidecar.metric("ratelimit_unknown_rule_total").await, 1.0);
    // A request of unknown rules only: still 200, the request answered with its error.
    let (status, a) = sidecar.decide(json!([decision("nope", &id, 1)])).await;
    assert_eq!(status, 200);
    assert_eq!(a["error"]["code"], "unknown_rule");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lowers_the_ceiling_until_it_is_given_back_or_expires() {
    let redis = Redis::start();
    let sidecar = Sidecar::with_policy(
        "rules:\n  hot: {capacity: 100, refill_per_sec: 1000}\n",
        &[
            "--redis",
            &redis.url(),
            "--redis-timeout-ms",
            "2000",
            "--lease-max-share",
            "0.3",
        ],
    )
    .await;
    sidecar.wait_ready("/readyz").await;
    let id = unique("lease");
    let key = format!("rl:{{ratelimit|rule=hot|id={id}}}");
    let ask = json!([{"rule": "hot", "subject": {"id": id},
                      "lease": {"id": 42, "tokens": 80, "ttl_ms": 60000}}]);
    let (_, a) = sidecar.decide(ask).await;
    assert_eq!(a["allowed"], true, "{a}");
    assert_eq!(a["results"][0]["leased"], 30, "at most 0.3 of the capacity");
    let mut c = redis.connection();
    let s = stored(&mut c, &key).unwrap();
    assert_eq!(s.leases.len(), 1);
    assert_eq!((s.leases[0].0, s.leases[0].1), (42.0, 30.0));
    // Even after a refill of 1000/s, Redis holds at most 100 - 30 while the lease lasts.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (_, a) = sidecar
        .decide(json!([{"rule": "hot", "subject": {"id": id}}]))
        .await;
    assert_eq!(a["results"][0]["remaining"], 69, "{a}");
    // Giving back 10 of the 30 removes the lease: the ceiling is 100 again.
    let (status, a) = sidecar
        .call(
            json!([]),
            json!({"returns": [{"rule": "hot", "subject": {"id": id}, "id": 42, "tokens": 10}]}),
        )
        .await;
    assert_eq!(status, 200, "{a}");
    assert!(stored(&mut c, &key).unwrap().leases.is_empty());
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (_, a) = sidecar
        .decide(json!([{"rule": "hot", "subject": {"id": id}}]))
        .await;
    assert_eq!(a["results"][0]["remaining"], 99, "{a}");
    // A lease nobody gives back: its tokens are lost, but only until it expires.
    let (_, a) = sidecar
        .decide(json!([{"rule": "hot", "subject": {"id": id},
                         "lease": {"id": 43, "tokens": 30, "ttl_ms": 100}}]))
        .await;
    assert_eq!(a["results"][0]["leased"], 30, "{a}");
    let expiry_us = stored(&mut c, &key).unwrap().leases[0].2;
    let (now_s, now_us): (u64, u64) = redis::cmd("TIME").query(&mut c).unwrap();
    let left_ms = (expiry_us - (now_s * 1_000_000 + now_us) as f64) / 1000.0;
    assert!(
        left_ms <= 100.0,
        "expires 100 ms after the grant: {left_ms}"
    );
    // Time passes (the lease's own lifetime, not a synchronisation).
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (_, a) = sidecar
        .decide(json!([{"rule": "hot", "subject": {"id": id}}]))
        .await;
    assert_eq!(a["results"][0]["remaining"], 99, "the ceiling is back: {a}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_policy_file_applies_from_the_next_decision_and_keeps_the_buckets() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis_with(
        &redis,
        "rules:\n  live: {capacity: 10, refill_per_sec: 0.001}\n",
    )
    .await;
    let id = unique("live");
    let one = json!([{"rule": "live", "subject": {"id": id}, "cost": 4}]);
    let (_, a) = sidecar.decide(one.clone()).await;
    assert_eq!(a["results"][0]["remaining"], 6, "{a}");
    // Shrink the capacity to 5: the bucket's 6 tokens are clamped to 5 at the next decision.
    std::fs::write(
        &sidecar.policy_file,
        "rules:\n  live: {capacity: 5, refill_per_sec: 0.001}\n",
    )
    .unwrap();
    let started = Instant::now();
    let a = loop {
        let (_, a) = sidecar
            .decide(json!([{"rule": "live", "subject": {"id": unique("probe")}}]))
            .await;
        if a["results"][0]["limit"]["capacity"] == 5 {
            break a;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "never reloaded: {a}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    println!("reloaded after {} ms: {a}", started.elapsed().as_millis());
    let (_, a) = sidecar.decide(one.clone()).await;
    assert_eq!(a["results"][0]["remaining"], 1, "min(5, 6) - 4: {a}");
    // An invalid file keeps the policy in force and is counted.
    std::fs::write(&sidecar.policy_file, "rules:\n  live: {capacity: 0}\n").unwrap();
    let started = Instant::now();
    while sidecar
        .metric("ratelimit_policy_reloads_total{result=\"invalid\"}")
        .await
        < 1.0
    {
        assert!(started.elapsed() < Duration::from_secs(15), "never tried");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, a) = sidecar
        .decide(json!([{"rule": "live", "subject": {"id": unique("after")}}]))
        .await;
    assert_eq!(a["results"][0]["limit"]["capacity"], 5, "{a}");
}
