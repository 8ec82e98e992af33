//! Bearer tokens on the real sidecar binary: a call without a valid token is answered 401 and
//! spends nothing in Redis; tokens rotate through the token file without a restart; probes and
//! metrics stay open; and a listener other hosts can reach is refused without authentication
//! unless `--allow-unauthenticated` says so.

use std::path::Path;

use ratelimit_e2e::{
    bucket_key, decide_body, free_port, http, sidecar_command, wait_until, Redis, Sidecar,
    READY_TIMEOUT,
};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_ratelimit-sidecar");

fn key(name: &str) -> String {
    format!("{name}-{:x}", rand::random::<u64>())
}

/// POSTs one decision on `key` with these headers: (status, `www-authenticate`, body).
fn post(base: &str, key: &str, headers: &[(&str, &str)]) -> (u16, Option<String>, String) {
    let mut req = http()
        .post(format!("{base}/v1/decide"))
        .header("content-type", "application/json")
        .body(decide_body(key, 5, 0.001, 1));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().unwrap();
    let status = r.status().as_u16();
    let challenge = r
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_string());
    (status, challenge, r.text().unwrap())
}

fn ready(args: &[&str], env: &[(&str, &str)]) -> Sidecar {
    let mut sidecar = Sidecar::spawn_with_env(Path::new(BIN), free_port(), args, env);
    let url = format!("{}/readyz", sidecar.base_url());
    sidecar.wait_for(&http(), &url, 200);
    sidecar
}

#[test]
fn a_call_without_a_valid_token_is_answered_401_and_spends_nothing() {
    let redis = Redis::start();
    let tokens = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(tokens.path(), "# callers\nenvoy-a-7f3c\n\nenvoy-b-91d0\n").unwrap();
    let file = tokens.path().display().to_string();
    let sidecar = ready(&["--redis", &redis.url(), "--auth-token-file", &file], &[]);
    let base = sidecar.base_url();
    let k = key("auth");
    let bucket = bucket_key(&k, 5, 0.001);

    for (headers, error) in [
        (&[][..], "missing credentials"),
        (
            &[("authorization", "Bearer envoy-a-7f3")][..],
            "invalid bearer token",
        ),
        (
            &[("authorization", "Bearer envoy-a-7f3c0")],
            "invalid bearer token",
        ),
        (
            &[("authorization", "Basic ZW52b3ktYS03ZjNj")],
            "not `Bearer <token>`",
        ),
    ] {
        let (status, challenge, body) = post(&base, &k, headers);
        assert_eq!(status, 401, "{headers:?}: {body}");
        assert!(
            challenge
                .as_deref()
                .unwrap_or_default()
                .starts_with("Bearer"),
            "{challenge:?}"
        );
        let json: Value = serde_json::from_str(&body).unwrap();
        assert!(json["error"].as_str().unwrap().contains(error), "{body}");
    }
    // A gRPC caller gets a gRPC status: 16, UNAUTHENTICATED.
    let r = http()
        .post(format!(
            "{base}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
        ))
        .header("content-type", "application/grpc")
        .body(Vec::<u8>::new())
        .send()
        .unwrap();
    assert_eq!(r.headers().get("grpc-status").unwrap(), "16");
    // Settlements are authenticated as decisions are.
    let settle = |token: Option<&str>| {
        let mut req = http()
            .post(format!("{base}/v1/settle"))
            .body(r#"{"settlements":[{"rule":"r","reserved":1,"cost":5}]}"#);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let r = req.send().unwrap();
        (r.status().as_u16(), r.text().unwrap())
    };
    assert_eq!(settle(None).0, 401);
    assert_eq!(settle(Some("envoy-a-7f3")).0, 401);
    let (status, body) = settle(Some("envoy-a-7f3c"));
    assert_eq!(
        (status, body.as_str()),
        (200, r#"{"applied":0,"repeated":0,"skipped":1}"#)
    );
    // Any other path is refused as well, before routing: nothing is learned without a token.
    let r = http().get(format!("{base}/v1/nowhere")).send().unwrap();
    assert_eq!(r.status(), 401);
    // Each refusal is counted under the API its path names (any other path: `http`).
    let metrics = http()
        .get(format!("{base}/metrics"))
        .send()
        .unwrap()
        .text()
        .unwrap();
    for (api, n) in [("http", 5), ("grpc", 1), ("settle", 2)] {
        let line = format!("ratelimit_calls_total{{api=\"{api}\",outcome=\"unauthorized\"}} {n}");
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }

    assert_eq!(
        redis.cli(&["EXISTS", &bucket]),
        "0",
        "the refused calls spent nothing"
    );

    // Either token of the file is accepted.
    let (status, _, body) = post(&base, &k, &[("authorization", "Bearer envoy-a-7f3c")]);
    assert_eq!(status, 200, "{body}");
    let (status, _, body) = post(&base, &k, &[("authorization", "bearer envoy-b-91d0")]);
    assert_eq!(status, 200, "{body}");
    let json: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json["answers"][0]["results"][0]["remaining"], 3);

    // Probes and Prometheus need no token.
    for path in ["/healthz", "/readyz", "/metrics"] {
        let r = http().get(format!("{base}{path}")).send().unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
}

#[test]
fn a_rotated_token_file_is_picked_up_without_a_restart() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "old-token-1\n").unwrap();
    let file = tokens.display().to_string();
    let sidecar = ready(&["--redis", &redis.url(), "--auth-token-file", &file], &[]);
    let base = sidecar.base_url();
    let k = key("rotate");
    let status_with =
        |token: &str| post(&base, &k, &[("authorization", &format!("Bearer {token}"))]).0;
    assert_eq!(status_with("old-token-1"), 200);
    assert_eq!(status_with("new-token-2"), 401);

    // Step 1: both tokens, as Kubernetes swaps a Secret volume (a new file renamed over).
    let staged = dir.path().join("tokens.new");
    std::fs::write(&staged, "old-token-1\nnew-token-2\n").unwrap();
    std::fs::rename(&staged, &tokens).unwrap();
    wait_until("the new token accepted", READY_TIMEOUT, || {
        status_with("new-token-2") == 200
    });
    assert_eq!(
        status_with("old-token-1"),
        200,
        "the old one still works meanwhile"
    );

    // Step 2: the old token removed.
    std::fs::write(&staged, "new-token-2\n").unwrap();
    std::fs::rename(&staged, &tokens).unwrap();
    wait_until("the old token refused", READY_TIMEOUT, || {
        status_with("old-token-1") == 401
    });
    assert_eq!(status_with("new-token-2"), 200);

    // A file emptied by mistake keeps the tokens read before, and says so in the log.
    std::fs::write(&tokens, "# nothing\n").unwrap();
    let mut sidecar = sidecar;
    wait_until("the empty file reported", READY_TIMEOUT, || {
        sidecar.process.log().contains("no token in the file")
    });
    assert!(sidecar.process.running());
    assert_eq!(status_with("new-token-2"), 200);
}

#[test]
fn the_environment_token_authenticates_and_never_shows() {
    let redis = Redis::start();
    let env = [("RATELIMIT_AUTH_TOKEN", "env-token-5e6f")];
    let mut sidecar = ready(&["--redis", &redis.url()], &env);
    let base = sidecar.base_url();
    let k = key("env");
    assert_eq!(post(&base, &k, &[]).0, 401);
    assert_eq!(
        post(&base, &k, &[("authorization", "Bearer env-token-5e6f")]).0,
        200
    );
    sidecar.process.stop();
    assert!(!sidecar.process.log().contains("env-token-5e6f"));

    let help = sidecar_command(Path::new(BIN))
        .arg("--help")
        .envs(env)
        .env("RATELIMIT_REDIS_PASSWORD", "env-password-7a8b")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("RATELIMIT_AUTH_TOKEN"), "{help}");
    assert!(
        !help.contains("env-token-5e6f") && !help.contains("env-password-7a8b"),
        "{help}"
    );
}

#[test]
fn a_listener_other_hosts_can_reach_is_refused_without_authentication_unless_allowed() {
    let exposed = format!("0.0.0.0:{}", free_port());
    let out = sidecar_command(Path::new(BIN))
        .args(["--listen", &exposed, "--redis", "redis://127.0.0.1:1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("--allow-unauthenticated"), "{stderr}");
    assert!(stderr.contains(&exposed), "{stderr}");

    // On purpose, or with a token, it serves.
    for (args, env) in [
        (&["--allow-unauthenticated"][..], &[][..]),
        (&[][..], &[("RATELIMIT_AUTH_TOKEN", "t-0d1e")][..]),
        (&[][..], &[("RATELIMIT_ALLOW_UNAUTHENTICATED", "true")][..]),
    ] {
        let port = free_port();
        let mut cmd = sidecar_command(Path::new(BIN));
        cmd.args([
            "--listen",
            &format!("0.0.0.0:{port}"),
            "--redis",
            "redis://127.0.0.1:1",
        ])
        .args(args)
        .envs(env.iter().copied());
        let logs = tempfile::tempdir().unwrap();
        let mut p = ratelimit_e2e::Process::spawn("sidecar-exposed", cmd, logs.path());
        wait_until("/healthz on the exposed listener", READY_TIMEOUT, || {
            assert!(p.running(), "{args:?} {env:?}: {}", p.log());
            http()
                .get(format!("http://127.0.0.1:{port}/healthz"))
                .send()
                .is_ok_and(|r| r.status() == 200)
        });
    }
}
