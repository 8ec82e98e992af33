//! `--key-prefix`: every key the sidecar writes starts with it (buckets, records, slot sets, the
//! epoch marker), so deployments that share a Redis never touch each other's keys. The store
//! names the keys, under its own prefix: the decider only asks it.

use ratelimit_e2e::{http, Redis, Sidecar};
use serde_json::{json, Value};

const POLICY: &str = "rules:\n  r: {capacity: 5, refill_per_sec: 1}\n  c: {concurrency: 2}\n";

#[test]
fn every_key_the_sidecar_writes_starts_with_its_prefix() {
    let redis = Redis::start();
    let args = ["--key-prefix", "tenant-a:"];
    let sidecar = Sidecar::with_policy(&redis.url(), POLICY, &args);
    // A decision under an attempt id (a record), and one of a rule with `concurrency` (a slot).
    let body = json!({"attempt": "a-1", "requests": [
        {"decisions": [{"rule": "r", "subject": {"app": "x"}}]},
        {"decisions": [{"rule": "c", "subject": {"app": "x"}}]},
    ]});
    let r = http()
        .post(format!("{}/v1/decide", sidecar.base_url()))
        .json(&body)
        .send()
        .expect("the sidecar answers");
    assert_eq!(r.status(), 200);
    let answer: Value = r.json().expect("JSON");
    assert_eq!(answer["answers"][0]["allowed"], true, "{answer}");
    assert_eq!(answer["answers"][1]["allowed"], true, "{answer}");

    let keys = redis.cli(&["KEYS", "*"]);
    let keys: Vec<&str> = keys.lines().map(str::trim).collect();
    for expected in [
        "tenant-a:{ratelimit|rule=r|app=x}",
        "tenant-a:{ratelimit|rule=c|app=x}:c",
        "tenant-a:epoch",
    ] {
        assert!(keys.contains(&expected), "{expected} not among {keys:?}");
    }
    assert!(
        keys.iter()
            .any(|k| k.starts_with("tenant-a:{ratelimit|rule=r|app=x}:a:")),
        "no record of the attempt among {keys:?}"
    );
    let strays: Vec<&&str> = keys
        .iter()
        .filter(|k| !k.starts_with("tenant-a:"))
        .collect();
    assert!(strays.is_empty(), "keys outside the prefix: {strays:?}");
}
