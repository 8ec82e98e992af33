//! Settlements of costs known after the response (`POST /v1/settle`, `lua/settle.lua`), over
//! real HTTP, against a real redis-server: a debt past zero rejects until refill repays it, with
//! `retry_after = (debt + cost) / refill`; a cheap response gives its reservation back up to the
//! capacity; a repeated batch applies nothing twice; bad calls are refused naming the field.

mod support;

use std::time::{Duration, Instant};

use ratelimit_e2e::Redis;
use serde_json::{json, Value};
use support::{bucket, decision, stored, unique, Sidecar};

async fn settle(sidecar: &Sidecar, body: Value) -> (u16, Value) {
    sidecar.post_to("/v1/settle", body.to_string()).await
}

fn one(rule: &str, id: &str, reserved: u64, cost: u64) -> Value {
    json!({"rule": rule, "subject": {"id": id}, "reserved": reserved, "cost": cost})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debt_past_zero_rejects_until_refill_repays_it() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let id = unique("debt");
    // b100: capacity 100, 10 tokens/s. Reserve 100 (all of it), then the response says 150.
    // Times are counted from before the reservation: the bucket refills from it on.
    let settled_at = Instant::now();
    let (s, a) = sidecar.decide(json!([decision("b100", &id, 100)])).await;
    assert_eq!((s, a["allowed"].clone()), (200, json!(true)), "{a}");
    let (s, a) = settle(
        &sidecar,
        json!({"id": "s1", "settlements": [one("b100", &id, 100, 150)]}),
    )
    .await;
    assert_eq!(s, 200, "{a}");
    assert_eq!(a, json!({"applied": 1, "repeated": 0, "skipped": 0}));
    let tokens = stored(&mut redis.connection(), &bucket("b100", &id))
        .unwrap()
        .tokens;
    assert!((-50.0..-45.0).contains(&tokens), "a debt of 50: {tokens}");

    // In debt: a request of 10 waits (debt + cost) / refill = (50 + 10) / 10 = 6 s, less the
    // time since the settlement.
    let (_, a) = sidecar.decide(json!([decision("b100", &id, 10)])).await;
    let elapsed = settled_at.elapsed().as_millis() as i64;
    let r = &a["results"][0];
    assert_eq!(
        (r["allowed"].clone(), r["reason"].clone()),
        (json!(false), json!("insufficient"))
    );
    assert_eq!(r["remaining"], 0);
    let retry = r["retry_after_ms"].as_i64().unwrap();
    println!("retry_after_ms {retry} at {elapsed} ms after the settlement");
    assert!(retry <= 6_000 && retry >= 6_000 - elapsed - 1, "{retry}");
    // A repeat of the batch charges nothing more.
    let (_, a) = settle(
        &sidecar,
        json!({"id": "s1", "settlements": [one("b100", &id, 100, 150)]}),
    )
    .await;
    assert_eq!(a, json!({"applied": 0, "repeated": 1, "skipped": 0}));
    let again = stored(&mut redis.connection(), &bucket("b100", &id))
        .unwrap()
        .tokens;
    assert!(
        again < -40.0,
        "the repeat changed nothing but refill: {again}"
    );

    // Rejected until the debt is repaid and 10 tokens refilled: not before 6 s after the
    // settlement, and soon after (polled).
    loop {
        let (_, a) = sidecar.decide(json!([decision("b100", &id, 10)])).await;
        let t = settled_at.elapsed();
        if a["allowed"] == true {
            println!("admitted again {} ms after the settlement", t.as_millis());
            assert!(t >= Duration::from_millis(5_990), "admitted early: {t:?}");
            break;
        }
        assert!(t < Duration::from_secs(9), "never repaid: {a}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        sidecar
            .metric("ratelimit_settlements_total{outcome=\"charged\"}")
            .await,
        1.0
    );
    assert_eq!(
        sidecar
            .metric("ratelimit_settlements_total{outcome=\"repeated\"}")
            .await,
        1.0
    );
}

/// A decision that asks for a receipt of its charge, and the receipt its answer holds.
async fn reserve(sidecar: &Sidecar, rule: &str, id: &str, cost: u64) -> (Value, Option<String>) {
    let mut d = decision(rule, id, cost);
    d["receipt"] = json!(true);
    let (s, a) = sidecar.decide(json!([d])).await;
    assert_eq!(s, 200, "{a}");
    let receipt = a["results"][0]["receipt"].as_str().map(str::to_string);
    (a, receipt)
}

fn with_receipt(rule: &str, id: &str, reserved: u64, cost: u64, receipt: &str) -> Value {
    let mut v = one(rule, id, reserved, cost);
    v["receipt"] = json!(receipt);
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cheap_response_gives_back_what_its_receipt_charged() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let id = unique("cheap");
    // b10: capacity 10, almost no refill. Reserve 8, the response says 2: 6 come back.
    let (a, receipt) = reserve(&sidecar, "b10", &id, 8).await;
    assert_eq!(a["results"][0]["remaining"], 2);
    let receipt = receipt.expect("an admitted decision that asked has a receipt");
    let (s, a) = settle(
        &sidecar,
        json!({"settlements": [with_receipt("b10", &id, 8, 2, &receipt)]}),
    )
    .await;
    assert_eq!((s, a["applied"].clone()), (200, json!(1)), "{a}");
    let (a, second) = reserve(&sidecar, "b10", &id, 8).await;
    assert_eq!(
        (a["allowed"].clone(), a["results"][0]["remaining"].clone()),
        (json!(true), json!(0))
    );
    // The receipt of 8, settled at 0, gives back those 8; a cost equal to its reservation
    // without a receipt changes nothing, nor does an unknown rule.
    let (_, a) = settle(
        &sidecar,
        json!({"settlements": [with_receipt("b10", &id, 8, 0, &second.unwrap()), one("b10", &id, 5, 5), one("nope", &id, 5, 1)]}),
    )
    .await;
    assert_eq!(a, json!({"applied": 1, "repeated": 0, "skipped": 2}));
    let tokens = stored(&mut redis.connection(), &bucket("b10", &id))
        .unwrap()
        .tokens;
    assert_eq!(tokens.floor(), 8.0, "{tokens}");
    assert_eq!(
        sidecar
            .metric("ratelimit_settlements_total{outcome=\"given_back\"}")
            .await,
        2.0
    );
    assert_eq!(
        sidecar
            .metric("ratelimit_settlements_total{outcome=\"skipped\"}")
            .await,
        2.0
    );
}

async fn admitted(sidecar: &Sidecar, id: &str) -> bool {
    sidecar.decide(json!([decision("b10", id, 1)])).await.1["allowed"] == true
}

/// Issue 32, case 9: an authenticated caller cannot create budget. A settlement gives back at
/// most what the sidecar charged the decision its receipt names, once; without a receipt it
/// holds (none, made up, used already, or another bucket's) nothing is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_gives_back_at_most_what_its_receipt_charged_once() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let (id, other) = (unique("spent"), unique("other"));
    // b10: capacity 10, almost no refill; spent down to 0.
    let (_, receipt) = reserve(&sidecar, "b10", &id, 1).await;
    let receipt = receipt.unwrap();
    let (_, a) = sidecar.decide(json!([decision("b10", &id, 9)])).await;
    assert_eq!(a["allowed"], true);
    let (_, other_receipt) = reserve(&sidecar, "b10", &other, 5).await;
    assert!(!admitted(&sidecar, &id).await, "spent");
    let huge = 999_999_999_999_999;
    for forged in [
        one("b10", &id, huge, 0),
        with_receipt("b10", &id, huge, 0, "12345"),
        with_receipt("b10", &id, huge, 0, &other_receipt.unwrap()),
    ] {
        let (s, a) = settle(&sidecar, json!({ "settlements": [forged] })).await;
        assert_eq!(s, 200, "{a}");
        assert!(
            !admitted(&sidecar, &id).await,
            "budget made from nothing by {forged}"
        );
    }
    // Its own receipt gives back what that decision was charged (1), not what the call claims.
    let (_, a) = settle(
        &sidecar,
        json!({"settlements": [with_receipt("b10", &id, huge, 0, &receipt)]}),
    )
    .await;
    assert_eq!(a["applied"], 1, "{a}");
    assert!(admitted(&sidecar, &id).await, "the 1 charged, back");
    assert!(!admitted(&sidecar, &id).await, "and no more");
    // Once: the same receipt again gives nothing.
    let (_, a) = settle(
        &sidecar,
        json!({"settlements": [with_receipt("b10", &id, huge, 0, &receipt)]}),
    )
    .await;
    assert_eq!(a["applied"], 1, "{a}");
    assert!(!admitted(&sidecar, &id).await, "a receipt gives back once");
    // A cost above the reservation is charged with or without a receipt.
    let (_, a) = settle(&sidecar, json!({"settlements": [one("b10", &other, 1, 4)]})).await;
    assert_eq!(a["applied"], 1, "{a}");
    let tokens = stored(&mut redis.connection(), &bucket("b10", &other))
        .unwrap()
        .tokens;
    assert_eq!(tokens.floor(), 2.0, "10 - 5 - 3 more: {tokens}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_settle_call_is_refused_naming_the_field_and_changes_nothing() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    for (body, field) in [
        (json!({"settlements": []}), "settlements"),
        (
            json!({"settlements": [one("b10", "x", 0, 1)]}),
            "settlements[0].reserved",
        ),
        (
            json!({"settlements": [one("b10", "x", 1, 1_000_000_000_000_000)]}),
            "settlements[0].cost",
        ),
        (
            json!({"settlements": [{"rule": "b10", "reserved": 1, "cost": 1.5}]}),
            "settlements[0].cost",
        ),
        (
            json!({"settlements": [{"rule": "b10", "reserved": 1, "cost": -1}]}),
            "settlements[0].cost",
        ),
        (
            json!({"settlements": [one("b10", "x", 1, 2)], "extra": 1}),
            "extra",
        ),
        (
            json!({"id": "", "settlements": [one("b10", "x", 1, 2)]}),
            "id",
        ),
        (
            json!({"settlements": [with_receipt("b10", "x", 1, 2, "0x1f")]}),
            "settlements[0].receipt",
        ),
    ] {
        let (s, a) = settle(&sidecar, body.clone()).await;
        assert_eq!(s, 400, "{body}: {a}");
        assert!(a["error"].as_str().unwrap().contains(field), "{body}: {a}");
    }
    let many: Vec<Value> = (0..1025)
        .map(|i| one("b10", &i.to_string(), 1, 2))
        .collect();
    let (s, _) = settle(&sidecar, json!({ "settlements": many })).await;
    assert_eq!(s, 400);
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("rl:{*")
        .query(&mut redis.connection())
        .unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debt_is_at_most_99_capacities_whatever_the_response_reported() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let id = unique("deep");
    let (_, a) = sidecar.decide(json!([decision("b10", &id, 1)])).await;
    assert_eq!(a["allowed"], true);
    let (s, _) = settle(
        &sidecar,
        json!({"settlements": [one("b10", &id, 1, 999_999_999_999_999)]}),
    )
    .await;
    assert_eq!(s, 200);
    let tokens = stored(&mut redis.connection(), &bucket("b10", &id))
        .unwrap()
        .tokens;
    assert!((-990.0..-989.0).contains(&tokens), "{tokens}");
    // The bucket still decides (its expiry, 100 fill times away, is a number Redis takes).
    let (s, a) = sidecar.decide(json!([decision("b10", &id, 1)])).await;
    assert_eq!(
        (s, a["results"][0]["reason"].clone()),
        (200, json!("insufficient")),
        "{a}"
    );
}
