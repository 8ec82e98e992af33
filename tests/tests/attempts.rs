//! The HTTP API's attempt id, through the real sidecar on a real Redis (issue 20, case 3): a
//! repeat of the same call under its attempt id is answered from the first call's record and
//! charged nothing; a different call under a used attempt id (other requests, other costs) is
//! decided afresh, never replayed.

use ratelimit_e2e::{bucket_tokens, Redis, Sidecar};
use serde_json::{json, Value};

/// Capacity 5, refill slow enough that nothing comes back during the test.
const POLICY: &str = "rules:\n  per-user: {capacity: 5, refill_per_sec: 0.001}\n";

fn key(id: &str) -> String {
    format!("rl:{{ratelimit|rule=per-user|id={id}}}")
}

/// One request per subject, each of one decision at `cost`.
fn body(attempt: Option<&str>, requests: &[(&str, u64)]) -> Value {
    let requests: Vec<Value> = requests
        .iter()
        .map(|(id, cost)| {
            json!({"decisions": [{"rule": "per-user", "subject": {"id": id}, "cost": cost}]})
        })
        .collect();
    match attempt {
        Some(a) => json!({"attempt": a, "requests": requests}),
        None => json!({"requests": requests}),
    }
}

/// Each request's `allowed`, in order.
fn decide(client: &reqwest::blocking::Client, sidecar: &Sidecar, body: &Value) -> Vec<bool> {
    let r = client
        .post(format!("{}/v1/decide", sidecar.base_url()))
        .json(body)
        .send()
        .expect("the sidecar answers");
    assert_eq!(r.status(), 200);
    let v: Value = r.json().expect("a JSON answer");
    v["answers"]
        .as_array()
        .expect("answers")
        .iter()
        .map(|a| a["allowed"].as_bool().expect("allowed"))
        .collect()
}

#[test]
fn a_used_attempt_id_with_other_requests_is_decided_afresh() {
    let redis = Redis::start();
    let sidecar = Sidecar::with_policy(&redis.url(), POLICY, &["--redis-timeout-ms", "1000"]);
    let client = reqwest::blocking::Client::new();

    let first = body(Some("y"), &[("alice", 1), ("bob", 1)]);
    assert_eq!(decide(&client, &sidecar, &first), [true, true]);
    // The same call again: replayed, charged nothing.
    assert_eq!(decide(&client, &sidecar, &first), [true, true]);
    assert_eq!(bucket_tokens(&redis, &key("alice")), Some(4.0));

    for _ in 0..5 {
        assert_eq!(
            decide(&client, &sidecar, &body(None, &[("mallory", 1)])),
            [true]
        );
    }
    // Attempt "y" again, with mallory in bob's place: mallory's empty bucket admits nothing.
    let other = body(Some("y"), &[("alice", 1), ("mallory", 1)]);
    let mallory_admitted = (0..10)
        .filter(|_| decide(&client, &sidecar, &other)[1])
        .count();
    assert_eq!(
        mallory_admitted, 0,
        "a used attempt id replayed another call"
    );
    let left = bucket_tokens(&redis, &key("mallory")).expect("mallory's bucket");
    assert!(left < 1.0, "mallory holds {left}: less than a token");
}

#[test]
fn a_used_attempt_id_with_a_higher_cost_is_decided_afresh() {
    let redis = Redis::start();
    let sidecar = Sidecar::with_policy(&redis.url(), POLICY, &["--redis-timeout-ms", "1000"]);
    let client = reqwest::blocking::Client::new();

    assert_eq!(
        decide(&client, &sidecar, &body(Some("z"), &[("carol", 1)])),
        [true]
    );
    // Carol holds 4; cost 5 under the same attempt id is rejected every time.
    let dearer = body(Some("z"), &[("carol", 5)]);
    let admitted = (0..10)
        .filter(|_| decide(&client, &sidecar, &dearer)[0])
        .count();
    assert_eq!(
        admitted, 0,
        "a used attempt id replayed a call of another cost"
    );
    assert_eq!(bucket_tokens(&redis, &key("carol")), Some(4.0));
}
