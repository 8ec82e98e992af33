//! The real `ratelimit-sidecar` binary: flags and environment variables work.

mod support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ratelimit_e2e::{free_port, wait_until, Redis};
use serde_json::json;
use support::unique;

struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_binary_reads_its_flags_and_environment() {
    let redis = Redis::start();
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let limits = dir.path().join("limits.yaml");
    std::fs::write(
        &limits,
        "rules:\n  per-app: {capacity: 100, refill_per_sec: 10}\n",
    )
    .unwrap();
    let _sidecar = Process(
        Command::new(env!("CARGO_BIN_EXE_ratelimit-sidecar"))
            .env("RATELIMIT_LISTEN", format!("127.0.0.1:{port}"))
            .env("RATELIMIT_LIMITS", &limits)
            .env("RATELIMIT_REDIS", redis.url())
            .env("RATELIMIT_KEY_PREFIX", "bin:")
            .args(["--redis-timeout-ms", "2000"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the sidecar binary"),
    );
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::blocking::Client::new();
    wait_until("the binary's /readyz", Duration::from_secs(15), || {
        http.get(format!("{base}/readyz"))
            .send()
            .is_ok_and(|r| r.status() == 200)
    });
    let app = unique("bin");
    let answer: serde_json::Value = http
        .post(format!("{base}/v1/decide"))
        .body(
            json!({"requests":[{"decisions":[{"rule": "per-app", "subject": {"app": app}}]}]})
                .to_string(),
        )
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert!(answer["epoch"].as_u64().is_some_and(|e| e > 0), "{answer}");
    assert_eq!(
        answer["answers"],
        json!([{"allowed":true,"results":[{"allowed":true,"remaining":99,"retry_after_ms":0,"reset_ms":100,"reason":"ok",
               "limit":{"name":"per-app","capacity":100,"refill_per_sec":10.0}}]}])
    );
    assert_eq!(
        redis
            .cli(&[
                "EXISTS",
                &format!("bin:{{ratelimit|rule=per-app|app={app}}}")
            ])
            .trim(),
        "1",
        "RATELIMIT_KEY_PREFIX is used"
    );
}

#[test]
fn redis_and_redis_cluster_together_are_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_ratelimit-sidecar"))
        .args([
            "--limits",
            "l.yaml",
            "--redis",
            "redis://127.0.0.1:1",
            "--redis-cluster",
            "redis://127.0.0.1:2",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--redis-cluster"), "{stderr}");
}

#[test]
fn an_invalid_policy_refuses_to_start_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let limits = dir.path().join("limits.yaml");
    std::fs::write(
        &limits,
        "rules:\n  per-app: {capacity: 0, refill_per_sec: 10}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ratelimit-sidecar"))
        .arg("--limits")
        .arg(&limits)
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("limits.yaml: rules.per-app.capacity: must be between 1"),
        "{stderr}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_ratelimit-sidecar"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--limits"));
}

#[test]
fn log_format_json_writes_one_json_object_per_line() {
    let dir = tempfile::tempdir().unwrap();
    let limits = dir.path().join("limits.yaml");
    std::fs::write(&limits, "rules:\n  r: {capacity: 1, refill_per_sec: 1}\n").unwrap();
    let port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratelimit-sidecar"))
        .arg("--limits")
        .arg(&limits)
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--log-format",
            "json",
        ])
        .args(["--redis", "redis://127.0.0.1:1"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stderr, &mut line).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let v: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    assert!(v["level"].is_string() && v["message"].is_string(), "{v}");
}
