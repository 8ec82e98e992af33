//! Envoy's native rate limit filter (`envoy/envoy-native-ratelimit.yaml`, gRPC to the sidecar) and
//! the wasm filter (`envoy/envoy.yaml`) side by side: two real Envoys, ONE sidecar, ONE Redis, one
//! policy file. A client limited through either draws from one budget, and an edit of the policy
//! file changes the limit for both.

use std::time::Duration;

use ratelimit_e2e::{http, wait_until, Envoy, EnvoyConfig, Redis, Sidecar, Upstream};
use serde_json::json;

/// The policy: the rule both Envoys name, `per-ip`, with 10 tokens and (practically) no refill.
const POLICY: &str = "\
domain: ratelimit
rules:
  per-ip: {capacity: 10, refill_per_sec: 0.001}
";

/// The same rule, edited: twice the burst, and full again within a millisecond.
const EDITED: &str = "\
domain: ratelimit
rules:
  per-ip: {capacity: 20, refill_per_sec: 100000}
";

struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
}

impl Answer {
    fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    }
}

fn get(envoy: &Envoy) -> Answer {
    let url = envoy.url("/api/orders");
    let r = http()
        .get(&url)
        .send()
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    Answer {
        status: r.status().as_u16(),
        headers: r.headers().clone(),
    }
}

#[test]
fn a_client_limited_through_the_native_filter_and_the_wasm_filter_draws_from_one_budget() {
    let redis = Redis::start();
    // Leases off: a wasm gateway holding tokens in advance would make the split below inexact
    // (never over the budget, but not 6 + 4 either).
    let sidecar = Sidecar::with_policy(
        &redis.url(),
        POLICY,
        &["--redis-timeout-ms", "1000", "--lease-max-share", "0"],
    );
    let upstream = Upstream::start();

    // The shipped native config as it is, but for a timeout that a busy 2-core machine cannot
    // miss and failing closed: an error must show as a 503, never as an uncounted admission.
    let native = Envoy::start(
        &EnvoyConfig::shipped("envoy-native-ratelimit.yaml", sidecar.port, upstream.port)
            .replace("timeout: 0.05s", "timeout: 5s")
            .replace("failure_mode_deny: false", "failure_mode_deny: true"),
    );
    // The wasm filter with the rule of the same identity: rule "per-ip", subject ["ip"].
    let wasm = Envoy::start(
        &EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port).plugin(
            &serde_json::to_string_pretty(&json!({
                "domain": "ratelimit",
                "sidecar": {"cluster": "ratelimit_sidecar", "timeout_ms": 5000},
                "identity": {"ip": true},
                "rate_limit_headers": "always",
                // Every decision asked of the sidecar: no local answer may outlive the reload
                // below (a known rejection would stand for its whole 1000 s wait).
                "fast_paths": {"known_rejections": false, "leases": {"enabled": false}},
                "rules": [
                    {"name": "per-ip", "match": {"path_prefix": "/"}, "subject": ["ip"],
                     "on_error": "deny"}
                ]
            }))
            .unwrap(),
        ),
    );

    // 6 through the native filter: admitted, with the sidecar's headers counting down.
    for i in 0..6u64 {
        let a = get(&native);
        assert_eq!(a.status, 200, "native request {i}");
        assert_eq!(
            a.header("ratelimit-policy").as_deref(),
            Some("\"per-ip\";q=10;w=10000"),
            "native request {i}"
        );
        let remaining = a
            .header("ratelimit")
            .expect("RateLimit on an admitted response");
        assert!(
            remaining.starts_with(&format!("\"per-ip\";r={};t=", 9 - i)),
            "native request {i}: {remaining}"
        );
    }
    // Then only 4 through the wasm filter.
    let statuses: Vec<u16> = (0..6).map(|_| get(&wasm).status).collect();
    assert_eq!(
        statuses,
        [200, 200, 200, 200, 429, 429],
        "wasm after native"
    );
    assert_eq!(
        upstream.hits(),
        10,
        "exactly the budget reached the upstream"
    );

    // The native Envoy's 429 carries the sidecar's RateLimit and Retry-After.
    let limited = get(&native);
    assert_eq!(limited.status, 429);
    let retry_after: u64 = limited
        .header("retry-after")
        .expect("Retry-After from the sidecar")
        .parse()
        .expect("whole seconds");
    assert!(
        (1..=1000).contains(&retry_after),
        "a token every 1000 s: {retry_after}"
    );
    assert_eq!(
        limited.header("ratelimit"),
        Some(format!("\"per-ip\";r=0;t={retry_after}"))
    );
    assert_eq!(
        limited.header("ratelimit-policy").as_deref(),
        Some("\"per-ip\";q=10;w=10000")
    );
    assert_eq!(
        limited.header("x-envoy-ratelimited").as_deref(),
        Some("true")
    );
    assert_eq!(upstream.hits(), 10);

    // Edit the policy on disk: the sidecar reloads it, and both Envoys see the new limit.
    sidecar.write_policy(EDITED);
    let new_policy = "\"per-ip\";q=20;w=1";
    wait_until(
        "the native Envoy to admit under the edited policy",
        Duration::from_secs(30),
        || {
            let a = get(&native);
            a.status == 200 && a.header("ratelimit-policy").as_deref() == Some(new_policy)
        },
    );
    wait_until(
        "the wasm Envoy to admit under the edited policy",
        Duration::from_secs(30),
        || {
            let a = get(&wasm);
            a.status == 200 && a.header("ratelimit-policy").as_deref() == Some(new_policy)
        },
    );
    drop((native, wasm, sidecar, redis));
}
