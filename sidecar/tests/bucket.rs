//! The bucket's semantics, over real HTTP, against a real redis-server.

mod support;

use std::time::{Duration, Instant};

use ratelimit_e2e::Redis;
use redis::Commands;
use serde_json::json;
use support::{decision, unique, Sidecar};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_150_on_a_100_per_10_bucket_admits_100_then_refills() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let key = unique("burst");
    let one = json!([decision(&key, 100.0, 10.0, 1.0)]);

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
        .decide(json!([decision(&unique("big"), 10.0, 1.0, 11.0)]))
        .await;
    assert_eq!(status, 200);
    assert_eq!(a["allowed"], false);
    let r = &a["results"][0];
    assert_eq!(r["reason"], "cost_exceeds_capacity");
    assert_eq!(r["retry_after_ms"], 0);
    assert_eq!(r["remaining"], 10, "the bucket is untouched: {a}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_parameters_are_refused_by_the_sidecar_and_by_the_script() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    for (field, d) in [
        ("capacity", decision("k", 0.0, 1.0, 1.0)),
        ("refill_per_sec", decision("k", 1.0, -1.0, 1.0)),
        ("cost", decision("k", 1.0, 1.0, 0.0)),
    ] {
        let (status, a) = sidecar.decide(json!([d])).await;
        assert_eq!(status, 400, "{a}");
        let e = a["error"].as_str().unwrap();
        assert!(
            e.starts_with(&format!("decisions[0].{field}:")),
            "{field}: {e}"
        );
    }

    // The script refuses by itself too (defense in depth), with an error, never an allow.
    let mut c = redis.connection();
    let script = ratelimit_sidecar::store::SCRIPT;
    for (args, field) in [
        (["0", "1", "1"], "capacity"),
        (["10", "abc", "1"], "refill_per_sec"),
        (["10", "1", "nan"], "cost"),
        (["inf", "1", "1"], "capacity"),
        (["10", "1", "-1"], "cost"),
    ] {
        let e = redis::cmd("EVAL")
            .arg(script)
            .arg(2)
            .arg("rl:{x}")
            .arg("rl:{x}:a:")
            .arg("apply")
            .arg(10000)
            .arg(&args)
            .arg("")
            .query::<redis::Value>(&mut c)
            .expect_err("the script must refuse");
        let text = e.to_string();
        assert!(
            text.contains(&format!("invalid decision 1: {field} must be a number > 0")),
            "{args:?}: {text}"
        );
    }
    let exists: bool = c.exists("rl:{x}").unwrap();
    assert!(!exists, "a refused call writes nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timestamp_in_the_future_counts_as_no_time_passed() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let key = unique("clock");
    let bucket = format!("rl:{{{key}}}");
    let mut c = redis.connection();
    let (now_s, _): (u64, u64) = redis::cmd("TIME").query(&mut c).unwrap();
    let future_us = (now_s + 3600) * 1_000_000;
    let _: () = c
        .hset_multiple(
            &bucket,
            &[("tokens", "5".to_string()), ("ts", future_us.to_string())],
        )
        .unwrap();

    let (status, a) = sidecar
        .decide(json!([decision(&key, 10.0, 1.0, 1.0)]))
        .await;
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["allowed"], true);
    // Zero elapsed: 5 - 1, neither a negative refill nor a full bucket.
    assert_eq!(a["results"][0]["remaining"], 4, "{a}");
    let ts: u64 = c.hget(&bucket, "ts").unwrap();
    assert!(
        ts < future_us,
        "the timestamp is re-anchored to the server's now"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_attempt_twice_is_charged_once_and_answered_alike() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let key = unique("dedup");
    let mut d = decision(&key, 10.0, 0.001, 3.0);
    d["attempt"] = json!("r-1");

    let (_, first) = sidecar.decide(json!([d.clone()])).await;
    let (_, second) = sidecar.decide(json!([d.clone()])).await;
    assert_eq!(first["allowed"], true);
    assert_eq!(first, second);
    assert_eq!(first["results"][0]["remaining"], 7);
    let tokens: f64 = redis
        .connection()
        .hget(format!("rl:{{{key}}}"), "tokens")
        .unwrap();
    assert!((7.0..7.01).contains(&tokens), "charged once: {tokens}");

    d["attempt"] = json!("r-2");
    let (_, third) = sidecar.decide(json!([d])).await;
    assert_eq!(
        third["results"][0]["remaining"], 4,
        "a new attempt is charged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_decision_leaves_the_other_buckets_untouched() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let (first, second) = (unique("aon-a"), unique("aon-b"));
    let (_, a) = sidecar
        .decide(json!([
            decision(&first, 10.0, 0.001, 1.0),
            decision(&second, 3.0, 0.001, 2.0)
        ]))
        .await;
    assert_eq!(a["allowed"], true);
    // Now the second bucket holds 1 < 2: the whole request is rejected.
    let (_, a) = sidecar
        .decide(json!([
            decision(&first, 10.0, 0.001, 1.0),
            decision(&second, 3.0, 0.001, 2.0)
        ]))
        .await;
    assert_eq!(a["allowed"], false, "{a}");
    assert_eq!(
        a["results"][0]["allowed"], true,
        "the first bucket could pay"
    );
    assert_eq!(a["results"][0]["remaining"], 9, "but was not charged: {a}");
    assert_eq!(a["results"][1]["reason"], "insufficient");
    let tokens: f64 = redis
        .connection()
        .hget(format!("rl:{{{first}}}"), "tokens")
        .unwrap();
    assert!((9.0..9.01).contains(&tokens), "untouched: {tokens}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_callers_on_a_bucket_of_50_get_exactly_50() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let key = unique("race");
    let one = json!([decision(&key, 50.0, 0.001, 1.0)]);
    let calls = (0..200).map(|_| {
        let http = sidecar.http.clone();
        let url = format!("{}/v1/decide", sidecar.base);
        let body = json!({ "decisions": one }).to_string();
        tokio::spawn(async move {
            let r = http.post(url).body(body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.json::<serde_json::Value>().await.unwrap()["allowed"] == true
        })
    });
    let admitted = futures::future::join_all(calls)
        .await
        .into_iter()
        .filter(|r| *r.as_ref().unwrap())
        .count();
    assert_eq!(admitted, 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refill_follows_the_elapsed_server_time_and_the_ttl_is_the_full_refill_time() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let key = unique("drive");
    let bucket = format!("rl:{{{key}}}");
    let mut c = redis.connection();
    // Drive time: an empty bucket last touched 2.5 s ago (server clock) at 10/s holds 25 tokens.
    let (now_s, now_us): (u64, u64) = redis::cmd("TIME").query(&mut c).unwrap();
    let past_us = now_s * 1_000_000 + now_us - 2_500_000;
    let _: () = c
        .hset_multiple(
            &bucket,
            &[("tokens", "0".to_string()), ("ts", past_us.to_string())],
        )
        .unwrap();
    let (_, a) = sidecar
        .decide(json!([decision(&key, 100.0, 10.0, 1.0)]))
        .await;
    let r = &a["results"][0];
    assert_eq!(r["remaining"], 24, "25 refilled, 1 charged: {a}");
    // reset = (100 - 24.x) / 10 per s, just under 7.6 s.
    let reset = r["reset_ms"].as_u64().unwrap();
    assert!((7_500..=7_600).contains(&reset), "{reset}");
    // TTL = the full-refill time (100 / 10 = 10 s) plus a 1 s margin.
    let ttl: i64 = c.pttl(&bucket).unwrap();
    assert!((10_900..=11_000).contains(&ttl), "{ttl}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_writes_nothing_unless_the_clock_went_back() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let key = unique("quiet");
    let bucket = format!("rl:{{{key}}}");
    let one = json!([decision(&key, 5.0, 0.001, 3.0)]);
    let (_, a) = sidecar.decide(one.clone()).await;
    assert_eq!(a["allowed"], true, "{a}");
    let mut c = redis.connection();
    let before: (String, String) = redis::cmd("HMGET")
        .arg(&bucket)
        .arg("tokens")
        .arg("ts")
        .query(&mut c)
        .unwrap();
    let ttl_before: i64 = c.pttl(&bucket).unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let (_, a) = sidecar.decide(one.clone()).await;
    assert_eq!(a["allowed"], false, "2 left < 3: {a}");
    let after: (String, String) = redis::cmd("HMGET")
        .arg(&bucket)
        .arg("tokens")
        .arg("ts")
        .query(&mut c)
        .unwrap();
    assert_eq!(
        before, after,
        "a rejection leaves tokens and ts as they were"
    );
    let ttl_after: i64 = c.pttl(&bucket).unwrap();
    assert!(ttl_after <= ttl_before, "nor refreshes the TTL");

    // A timestamp in the future is re-anchored even by a rejection.
    let (now_s, _): (u64, u64) = redis::cmd("TIME").query(&mut c).unwrap();
    let future_us = (now_s + 3600) * 1_000_000;
    let _: () = c
        .hset_multiple(
            &bucket,
            &[("tokens", "0".to_string()), ("ts", future_us.to_string())],
        )
        .unwrap();
    let (_, a) = sidecar.decide(one).await;
    assert_eq!(a["allowed"], false, "{a}");
    let ts: u64 = c.hget(&bucket, "ts").unwrap();
    assert!(ts < future_us, "re-anchored to the server's now");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_with_braces_or_named_twice_are_refused_with_400() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    // `k}:a:x` would be the attempt record of key `k`.
    for key in ["k}:a:x", "a{b}", "{x"] {
        let (status, a) = sidecar.decide(json!([decision(key, 5.0, 1.0, 1.0)])).await;
        assert_eq!(status, 400, "{key}: {a}");
        let e = a["error"].as_str().unwrap();
        assert!(e.starts_with("decisions[0].key: must not contain"), "{e}");
    }
    let key = unique("twice");
    let mut d = decision(&key, 5.0, 1.0, 1.0);
    d["attempt"] = json!("r-1");
    let (status, a) = sidecar.decide(json!([d.clone(), d])).await;
    assert_eq!(status, 400, "{a}");
    assert_eq!(
        a["error"].as_str().unwrap(),
        "decisions[1].key: duplicate of decisions[0]; name each bucket once (add the costs)"
    );
    let exists: bool = redis.connection().exists(format!("rl:{{{key}}}")).unwrap();
    assert!(!exists, "nothing charged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_of_another_type_answers_500_not_redis_unavailable() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let key = unique("wrongtype");
    let _: () = redis
        .connection()
        .set(format!("rl:{{{key}}}"), "not a bucket")
        .unwrap();
    let (status, a) = sidecar.decide(json!([decision(&key, 5.0, 1.0, 1.0)])).await;
    assert_eq!(status, 500, "{a}");
    let e = a["error"].as_str().unwrap();
    assert!(
        e.starts_with("bucket script failed:") && e.contains("WRONGTYPE"),
        "{e}"
    );
    assert_eq!(
        sidecar
            .metric("ratelimit_requests_total{outcome=\"error\"}")
            .await,
        1.0
    );
}
