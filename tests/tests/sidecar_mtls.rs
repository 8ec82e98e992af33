//! Envoy calls the sidecar over mutual TLS: the shipped `envoy/envoy.yaml` with an
//! `UpstreamTlsContext` on its `ratelimit_sidecar` cluster that presents a client certificate,
//! and the sidecar binary started with `--tls-cert`, `--tls-key` and `--tls-client-ca`. Requests
//! through Envoy are decided (200, then 429 on a small bucket); the same sidecar refuses a caller
//! without a certificate and a plain-HTTP caller, and an Envoy without the client certificate
//! gets no decision at all (503, `on_error: deny`).

use std::time::Duration;

use ratelimit_e2e::{
    decide_body, free_port, http, plugin_json, wait_until, Envoy, EnvoyConfig, Redis, Sidecar,
    TestPki, Upstream,
};

const ALPHA: (&str, &str) = ("x-api-key", "alpha-key");

/// The shipped plugin configuration with a generous callout timeout and `on_error: deny` on every
/// rule, so a callout that fails shows as 503 instead of being answered locally (the sidecar's
/// test policy, `TEST_POLICY`, gives `per-app` a bucket of 3 that does not refill). No leases, so
/// every decision is the sidecar's.
fn small_bucket_plugin() -> String {
    let shipped = std::fs::read_to_string(ratelimit_e2e::workspace_root().join("envoy/envoy.yaml"))
        .expect("read envoy/envoy.yaml");
    let mut plugin = plugin_json(&shipped);
    plugin["sidecar"]["timeout_ms"] = 2000.into();
    for rule in plugin["rules"].as_array_mut().expect("rules") {
        rule["on_error"] = "deny".into();
        rule.as_object_mut().expect("rule").remove("emergency");
    }
    plugin["fast_paths"] =
        serde_json::json!({"leases": {"enabled": false}, "known_rejections": false});
    serde_json::to_string_pretty(&plugin).expect("plugin JSON")
}

/// GET /api/hello through Envoy with the demo API key: the status.
fn call(envoy: &Envoy) -> u16 {
    http()
        .get(envoy.url("/api/hello"))
        .header(ALPHA.0, ALPHA.1)
        .send()
        .expect("envoy answers")
        .status()
        .as_u16()
}

/// The value of a Prometheus line of the sidecar's `/metrics` (0 when absent).
fn metric(admin: &str, line_prefix: &str) -> f64 {
    let text = http()
        .get(format!("{admin}/metrics"))
        .send()
        .and_then(|r| r.text())
        .unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn envoy_with_a_client_certificate_gets_decisions_and_callers_without_one_are_refused() {
    let pki = TestPki::generate();
    let redis = Redis::start();
    let upstream = Upstream::start();
    let port = free_port();
    let admin_addr = format!("127.0.0.1:{}", free_port());
    let redis_url = redis.url();
    let mtls = pki.sidecar_mtls_args();
    let mut args = vec![
        "--redis",
        redis_url.as_str(),
        "--admin-listen",
        admin_addr.as_str(),
        "--redis-timeout-ms",
        "500",
    ];
    args.extend(mtls.iter().map(String::as_str));
    let mut sidecar = Sidecar::spawn(&Sidecar::bin(), port, &args);
    let admin = format!("http://{admin_addr}");
    sidecar.wait_for(&http(), &format!("{admin}/readyz"), 200);

    let config = EnvoyConfig::shipped("envoy.yaml", port, upstream.port)
        .plugin(&small_bucket_plugin())
        .upstream_tls(
            "ratelimit_sidecar",
            "localhost",
            &pki.ca,
            &pki.client_cert,
            &pki.client_key,
        );
    let envoy = Envoy::start(&config);
    let statuses: Vec<u16> = (0..4).map(|_| call(&envoy)).collect();
    assert_eq!(statuses, [200, 200, 200, 429], "{}", envoy.process.log());
    assert_eq!(upstream.hits(), 3);
    assert_eq!(envoy.counter("ratelimit.limiter_error"), 0);
    let allowed = r#"ratelimit_requests_total{outcome="allowed"}"#;
    let rejected = r#"ratelimit_requests_total{outcome="rejected"}"#;
    assert_eq!(metric(&admin, allowed), 3.0, "decided by the sidecar");
    assert_eq!(metric(&admin, rejected), 1.0);

    // The same sidecar, called without a certificate, or in plain HTTP: no answer.
    let direct = format!("https://localhost:{port}/v1/decide");
    let anonymous = pki
        .https_client(None)
        .post(&direct)
        .header("content-type", "application/json")
        .body(decide_body("direct", 10, 1.0, 1))
        .send();
    assert!(anonymous.is_err(), "{anonymous:?}");
    let plain = http()
        .post(format!("http://127.0.0.1:{port}/v1/decide"))
        .header("content-type", "application/json")
        .body(decide_body("direct", 10, 1.0, 1))
        .send();
    assert!(plain.is_err(), "{plain:?}");
    assert_eq!(
        metric(&admin, allowed) + metric(&admin, rejected),
        4.0,
        "the refused callers reached no handler"
    );
    drop(envoy);

    // An Envoy that trusts the sidecar but presents no certificate gets no decision: 503.
    let without_cert = EnvoyConfig::shipped("envoy.yaml", port, upstream.port)
        .plugin(&small_bucket_plugin())
        .cluster_addition(
            "ratelimit_sidecar",
            &format!(
                "transport_socket:\n  name: envoy.transport_sockets.tls\n  typed_config:\n    \
                 \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n    \
                 sni: localhost\n    common_tls_context:\n      validation_context:\n        \
                 trusted_ca: {{ filename: \"{}\" }}\n",
                pki.ca.display()
            ),
        );
    let envoy = Envoy::start(&without_cert);
    assert_eq!(call(&envoy), 503);
    wait_until(
        "the failed callout counted",
        Duration::from_secs(10),
        || envoy.counter("ratelimit.limiter_error") >= 1,
    );
    assert_eq!(upstream.hits(), 3, "nothing more reached the upstream");
    assert!(
        sidecar.process.log().contains("TLS handshake refused"),
        "{}",
        sidecar.process.log()
    );
}
