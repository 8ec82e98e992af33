//! A rule the sidecar's policy lacks (renamed, dropped, a typo) is that decision's configuration
//! error alone: the request's other decisions still decide. Through the sidecar's HTTP API (the
//! binary), and through Envoy with the shipped configuration and a policy whose `per-ip` was
//! renamed: `/api/` requests stay limited by `per-app` (its sidecar bucket, not its emergency
//! bucket), and `per-ip`'s `on_error: allow` applies to its decision alone.

use std::time::Duration;

use ratelimit_e2e::scenario::{burst, count, Stack, ALPHA};
use ratelimit_e2e::{http, wait_until, Redis, Sidecar};
use serde_json::{json, Value};

const POLICY: &str = "\
rules:
  per-app: {capacity: 3, refill_per_sec: 0.001}
  per-ip: {capacity: 1000, refill_per_sec: 100}
";

/// One call of one request naming `per-app` (alpha) and `per-ip`: its answer.
fn both(sidecar: &Sidecar) -> Value {
    let body = json!({"requests": [{"decisions": [
        {"rule": "per-app", "subject": {"app": "alpha"}},
        {"rule": "per-ip", "subject": {"ip": "203.0.113.7"}}
    ]}]});
    let answer: Value = http()
        .post(format!("{}/v1/decide", sidecar.base_url()))
        .json(&body)
        .send()
        .and_then(|r| r.json())
        .expect("an answer");
    answer["answers"][0].clone()
}

#[test]
fn over_the_http_api_an_unknown_rule_is_its_decisions_error_and_a_reload_dropping_it_warns() {
    let redis = Redis::start();
    let sidecar = Sidecar::with_policy(&redis.url(), POLICY, &[]);
    let a = both(&sidecar);
    assert_eq!(a["allowed"], true, "{a}");
    assert!(a["results"][1]["error"].is_null());

    // per-ip renamed while gateways name it: the reload is warned about and counted.
    sidecar.write_policy(&POLICY.replace("per-ip:", "per-client-ip:"));
    let dropped = "ratelimit_policy_dropped_rules_total{rule=\"ratelimit/per-ip\"}";
    wait_until(
        "the reload that drops per-ip",
        Duration::from_secs(20),
        || sidecar.metric(dropped) == 1.0,
    );
    assert!(
        sidecar.process.log().contains("has no rule \"per-ip\""),
        "warned, naming the rule"
    );

    // per-app still decides (2 tokens left, then none); per-ip's decision carries the error.
    let mut verdicts = Vec::new();
    for _ in 0..3 {
        let a = both(&sidecar);
        println!("{a}");
        assert!(a["error"].is_null(), "not the request's error: {a}");
        let e = &a["results"][1]["error"];
        assert_eq!(e["code"], "unknown_rule", "{a}");
        assert!(e["message"].as_str().unwrap().contains("\"per-ip\""));
        assert_eq!(a["results"][0]["limit"]["name"], "per-app");
        verdicts.push(a["allowed"].as_bool().unwrap());
    }
    assert_eq!(
        verdicts,
        [true, true, false],
        "per-app's 3 tokens, then 429"
    );
    assert_eq!(sidecar.metric("ratelimit_unknown_rule_total"), 3.0);
}

#[test]
fn through_envoy_a_renamed_rule_leaves_the_other_rule_limiting_and_its_on_error_applies() {
    // The shipped filter configuration: per-app on /api/ (on_error local, an emergency bucket of
    // 10 + 1/s), per-ip on every path (on_error allow). The policy renamed per-ip.
    let policy = "\
rules:
  per-app: {capacity: 30, refill_per_sec: 0.001}
  per-client-ip: {capacity: 1000, refill_per_sec: 100}
";
    let stack = Stack::start("envoy.yaml", None, Some(policy));
    let api = burst(&stack.envoy.url("/api/orders"), &[ALPHA], 50, 2);
    let (ok, limited) = (count(&api, 200), count(&api, 429));
    let other = burst(&stack.envoy.url("/health"), &[], 20, 2);
    let c = |name: &str| stack.envoy.counter(&format!("ratelimit.{name}"));
    println!(
        "/api/: {ok} admitted, {limited} limited of 50; /health: {} admitted of 20; \
         config_error {}, failed_open {}, emergency_activations {}",
        count(&other, 200),
        c("config_error"),
        c("failed_open"),
        c("emergency_activations")
    );
    // per-app decided by the sidecar: its 30 tokens (leases hand out only tokens taken from
    // it), never its emergency bucket (10 + 1/s for everyone).
    assert_eq!(c("emergency_activations"), 0, "per-app's emergency bucket");
    assert!((25..=30).contains(&ok), "{ok} admitted of per-app's 30");
    assert_eq!(ok + limited, 50);
    let rejected = api.iter().find(|a| a.status == 429).expect("a 429");
    assert!(rejected.body.contains("\"per-app\""), "{}", rejected.body);
    // per-ip's on_error (allow) for its decision alone: every other path passes, and each
    // decision of it counts as a configuration error that failed open.
    assert_eq!(count(&other, 200), 20);
    assert!(c("config_error") >= 20 && c("failed_open") >= 20, "counted");
}
