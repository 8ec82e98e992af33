//! The HTTP edge: malformed requests get 4xx with a JSON reason naming the field.

mod support;

use ratelimit_e2e::Redis;
use support::Sidecar;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_4xx_with_a_reason_naming_the_field() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis(&redis).await;
    for (body, status, reason) in [
        ("{not json", 400, "key must be a string"),
        ("", 400, "EOF"),
        (
            r#"{"decisions":[{"key":"k","refill_per_sec":1}]}"#,
            400,
            "decisions[0]: missing field `capacity`",
        ),
        (
            r#"{"decisions":[{"capacity":1,"refill_per_sec":1}]}"#,
            400,
            "missing field `key`",
        ),
        (
            r#"{"decisions":[{"key":"k","capacity":"ten","refill_per_sec":1}]}"#,
            400,
            "decisions[0].capacity: invalid type",
        ),
        (
            r#"{"decisions":[{"key":7,"capacity":1,"refill_per_sec":1}]}"#,
            400,
            "decisions[0].key: invalid type",
        ),
        (r#"{"decisions":{}}"#, 400, "decisions: invalid type"),
        (
            r#"{"decisions":[]}"#,
            400,
            "decisions: must hold at least one",
        ),
        (
            r#"{"decisions":[{"key":"k","capacity":1,"refill_per_sec":1,"extra":1}]}"#,
            400,
            "unknown field `extra`",
        ),
        (
            r#"{"decisions":[{"key":"k","capacity":1e999,"refill_per_sec":1}]}"#,
            400,
            "decisions[0].capacity",
        ),
        (r#"[1,2]"#, 400, "invalid type"),
    ] {
        let (got, answer) = sidecar.post_raw(body).await;
        assert_eq!(got, status, "{body} -> {answer}");
        let error = answer["error"].as_str().unwrap_or_default();
        assert!(error.contains(reason), "{body} -> {error}");
    }

    // 65 decisions: more than wire::MAX_DECISIONS.
    let many: Vec<_> = (0..=ratelimit_wire::MAX_DECISIONS)
        .map(|i| support::decision(&format!("k{i}"), 1.0, 1.0, 1.0))
        .collect();
    let (got, answer) = sidecar.decide(serde_json::json!(many)).await;
    assert_eq!(got, 400);
    assert!(answer["error"].as_str().unwrap().starts_with("decisions:"));

    // A body over --max-body-bytes (64 KiB by default): 413, still JSON.
    let huge = format!(
        r#"{{"decisions":[{{"key":"{}","capacity":1,"refill_per_sec":1}}]}}"#,
        "k".repeat(70_000)
    );
    let (got, answer) = sidecar.post_raw(huge).await;
    assert_eq!(got, 413, "{answer}");
    assert!(answer["error"].as_str().unwrap().contains("max-body-bytes"));

    // A key over MAX_KEY_BYTES but within the body limit: 400 naming the key.
    let long_key = format!(
        r#"{{"decisions":[{{"key":"{}","capacity":1,"refill_per_sec":1}}]}}"#,
        "k".repeat(600)
    );
    let (got, answer) = sidecar.post_raw(long_key).await;
    assert_eq!(got, 400);
    assert!(answer["error"]
        .as_str()
        .unwrap()
        .starts_with("decisions[0].key:"));
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
        .body(r#"{"decisions":[{"key":"ct","capacity":5,"refill_per_sec":1}]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let (_, _) = sidecar.post_raw("{").await;
    let (status, text) = sidecar.get("/metrics").await;
    assert_eq!(status, 200);
    for name in [
        "ratelimit_decisions_total{verdict=\"allowed\"}",
        "ratelimit_requests_total{outcome=\"allowed\"}",
        "ratelimit_requests_total{outcome=\"bad_request\"}",
        "ratelimit_decision_duration_seconds_bucket{le=\"0.0001\"}",
        "ratelimit_decision_duration_seconds_bucket{le=\"1.0\"}",
        "ratelimit_redis_errors_total",
        "ratelimit_script_loads_total",
        "ratelimit_compensations_total",
    ] {
        assert!(text.contains(name), "{name} missing:\n{text}");
    }
}
