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
    let _sidecar = Process(
        Command::new(env!("CARGO_BIN_EXE_ratelimit-sidecar"))
            .env("RATELIMIT_LISTEN", format!("127.0.0.1:{port}"))
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
    let key = unique("bin");
    let answer: serde_json::Value = http
        .post(format!("{base}/v1/decide"))
        .body(json!({"decisions":[{"key": key, "capacity": 100, "refill_per_sec": 10, "cost": 1, "attempt": "r-1"}]}).to_string())
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(
        answer,
        json!({"allowed":true,"results":[{"allowed":true,"remaining":99,"retry_after_ms":0,"reset_ms":100,"reason":"ok"}]})
    );
    assert_eq!(
        redis.cli(&["EXISTS", &format!("bin:{{{key}}}")]).trim(),
        "1",
        "RATELIMIT_KEY_PREFIX is used"
    );
}

#[test]
fn redis_and_redis_cluster_together_are_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_ratelimit-sidecar"))
        .args([
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
