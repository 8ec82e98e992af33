//! The HTTP edge: malformed requests get 4xx with a JSON reason naming the field.

mod support;

use ratelimit_e2e::Redis;
use serde_json::json;
use support::{decision, Sidecar};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_4xx_with_a_reason_naming_the_field() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    for (body, status, reason) in [
        ("{not json", 400, "key must be a string"),
        ("", 400, "EOF"),
        (
            r#"{"requests":[{"decisions":[{}]}]}"#,
            400,
            "requests[0].decisions[0]: missing field `rule`",
        ),
        (
            r#"{"requests":[{"decisions":[{"rule":7}]}]}"#,
            400,
            "requests[0].decisions[0].rule: invalid type",
        ),
        (
            r#"{"requests":[{"decisions":[{"rule":"b5","cost":"ten"}]}]}"#,
            400,
            "requests[0].decisions[0].cost: invalid type",
        ),
        (
            r#"{"requests":[{"decisions":[{"rule":"b5","cost":-1}]}]}"#,
            400,
            "requests[0].decisions[0].cost: invalid value",
        ),
        (
            r#"{"requests":[{"decisions":[{"rule":"b5","subject":{"id":7}}]}]}"#,
            400,
            "requests[0].decisions[0].subject",
        ),
        (r#"{"requests":{}}"#, 400, "requests: invalid type"),
        (
            r#"{"requests":[]}"#,
            400,
            "requests: must hold at least one",
        ),
        (
            r#"{"requests":[{"decisions":[]}]}"#,
            400,
            "requests[0].decisions: must hold 1 to 64",
        ),
        (
            r#"{"requests":[{"decisions":[{"rule":"b5","capacity":1}]}]}"#,
            400,
            "unknown field `capacity`",
        ),
        (
            r#"{"requests":[{"decisions":[{"rule":"b5","cost":1e999}]}]}"#,
            400,
            "requests[0].decisions[0].cost",
        ),
        (
            r#"{"requests":[{"decisions":[{"rule":"b5","lease":{"id":1,"tokens":1,"ttl_ms":999999}}]}]}"#,
            400,
            "requests[0].decisions[0].lease.ttl_ms",
        ),
        (r#"[1,2]"#, 400, "invalid type"),
    ] {
        let (got, answer) = sidecar.post_raw(body).await;
        assert_eq!(got, status, "{body} -> {answer}");
        let error = answer["error"].as_str().unwrap_or_default();
        assert!(error.contains(reason), "{body} -> {error}");
    }

    // 65 decisions in one request: more than wire::MAX_DECISIONS.
    let many: Vec<_> = (0..=ratelimit_wire::MAX_DECISIONS)
        .map(|i| decision("b5", &format!("k{i}"), 1))
        .collect();
    let (got, answer) = sidecar.decide(json!(many)).await;
    assert_eq!(got, 400);
    assert!(answer["error"]
        .as_str()
        .unwrap()
        .starts_with("requests[0].decisions:"));

    // A body over --max-body-bytes (64 KiB by default): 413, still JSON.
    let huge = format!(
        r#"{{"requests":[{{"decisions":[{{"rule":"b5","subject":{{"id":"{}"}}}}]}}]}}"#,
        "k".repeat(70_000)
    );
    let (got, answer) = sidecar.post_raw(huge).await;
    assert_eq!(got, 413, "{answer}");
    assert!(answer["error"].as_str().unwrap().contains("max-body-bytes"));

    // A value over MAX_VALUE_BYTES but within the body limit: 400 naming it.
    let long = format!(
        r#"{{"requests":[{{"decisions":[{{"rule":"b5","subject":{{"id":"{}"}}}}]}}]}}"#,
        "k".repeat(5000)
    );
    let (got, answer) = sidecar.post_raw(long).await;
    assert_eq!(got, 400);
    assert!(answer["error"]
        .as_str()
        .unwrap()
        .starts_with("requests[0].decisions[0].subject.id:"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_paths_and_methods_answer_json_and_metrics_are_served() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    let r = sidecar
        .http
        .get(format!("{}/nope", sidecar.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert!(r.json::<serde_json::Value>().await.unwrap()["error"].is_string());
    let r = sidecar
        .http
        .get(format!("{}/v1/decide", sidecar.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    assert!(r.json::<serde_json::Value>().await.unwrap()["error"].is_string());

    // Content type is not checked: a parsable body is decided.
    let r = sidecar
        .http
        .post(format!("{}/v1/decide", sidecar.base))
        .header("content-type", "text/plain")
        .body(r#"{"requests":[{"decisions":[{"rule":"b5","subject":{"id":"ct"}}]}]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let (_, _) = sidecar.post_raw("{").await;
    let (status, text) = sidecar.get("/metrics").await;
    assert_eq!(status, 200);
    for name in [
        "ratelimit_decisions_total{limit=\"b5\",verdict=\"allowed\"}",
        "ratelimit_calls_total{api=\"http\",outcome=\"answered\"}",
        "ratelimit_calls_total{api=\"http\",outcome=\"bad_request\"}",
        "ratelimit_requests_total{outcome=\"allowed\"}",
        "ratelimit_decision_duration_seconds_bucket{le=\"0.0001\"}",
        "ratelimit_decision_duration_seconds_bucket{le=\"1.0\"}",
        "ratelimit_script_call_decisions_bucket",
        "ratelimit_redis_errors_total",
        "ratelimit_script_loads_total",
        "ratelimit_compensations_total",
        "ratelimit_policy_reloads_total{result=\"ok\"} 1",
        "ratelimit_policy_limits 8",
    ] {
        assert!(text.contains(name), "{name} missing:\n{text}");
    }
}
