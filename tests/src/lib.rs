//! The end-to-end harness: starts the real parts as processes on free loopback ports (redis-server,
//! the sidecar binary, Envoy with the wasm filter) plus an in-process demo upstream, waits for each
//! to be ready by polling its readiness check (never by sleeping), and stops them on drop.
//!
//! Binaries are found through environment variables, falling back to the workspace's build
//! outputs, so `make test` (which builds them first) needs no configuration:
//! - `RATELIMIT_SIDECAR_BIN` (default `target/release/ratelimit-sidecar`)
//! - `RATELIMIT_FILTER_WASM` (default `target/wasm32-wasip1/release/ratelimit_filter.wasm`)
//! - `ENVOY_BIN` (default `.venv/bin/envoy`, installed by `scripts/install-deps.sh`)
//! - `REDIS_SERVER_BIN` (default `redis-server` on the PATH)

pub mod envoy;
pub mod redis;
pub mod upstream;

use std::fs::File;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

pub use envoy::{plugin_json, Envoy, EnvoyConfig};
pub use redis::{Redis, RedisCluster, Sentinel};
pub use upstream::Upstream;

/// How long any process may take to become ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// The workspace root (this crate lives in `<root>/tests`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// A path from an environment variable, or a path relative to the workspace root.
fn artifact(var: &str, default_relative: &str) -> PathBuf {
    match std::env::var_os(var) {
        Some(p) => PathBuf::from(p),
        None => workspace_root().join(default_relative),
    }
}

fn require_file(path: &Path, what: &str, var: &str) -> PathBuf {
    assert!(
        path.exists(),
        "{what} not found at {} (set {var}, or run `make build` first)",
        path.display()
    );
    path.to_path_buf()
}

/// A free TCP port on 127.0.0.1 (the kernel picks it; the listener is closed before returning).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// Polls `check` until it returns true or `timeout` passes. This is a readiness check, not a
/// sleep: it returns as soon as the condition holds.
pub fn wait_until(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(2);
    while !check() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// True when something accepts TCP connections on the port.
pub fn port_open(port: u16) -> bool {
    TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200)).is_ok()
}

/// A blocking HTTP client that never follows redirects and treats every status as an answer.
pub fn http() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(10))
        .no_proxy()
        .build()
        .expect("http client")
}

/// A child process that is killed (and reaped) on drop; its output goes to a log file whose tail
/// is printed when the test is failing, so CI shows why a process misbehaved.
pub struct Process {
    name: String,
    child: Child,
    log_path: PathBuf,
}

impl Process {
    /// Starts `cmd` with stdout and stderr into `<log_dir>/<name>.log`.
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Process {
        let log_path = log_dir.join(format!("{name}.log"));
        let log = File::create(&log_path).expect("create log file");
        let err = log.try_clone().expect("clone log file");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name} ({cmd:?}): {e}"));
        Process {
            name: name.to_string(),
            child,
            log_path,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal (SIGSTOP freezes the process, SIGCONT resumes it).
    pub fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.child.id() as i32), signal).expect("send signal");
    }

    /// True while the process has not exited.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits for the process to exit by itself and returns whether it failed, with its log.
    pub fn wait_exit(&mut self, timeout: Duration) -> (std::process::ExitStatus, String) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return (status, self.log());
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit within {timeout:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Everything the process has printed so far.
    pub fn log(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = File::open(&self.log_path) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    /// Kills the process now and reaps it (once: a reaped pid may belong to someone else).
    pub fn stop(&mut self) {
        if self.running() {
            let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGCONT);
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!(
                "---- last lines of {} ({}) ----",
                self.name,
                self.log_path.display()
            );
            for line in tail.into_iter().rev() {
                eprintln!("{line}");
            }
        }
        self.stop();
    }
}

/// The sidecar binary, on a free port, pointed at one Redis.
pub struct Sidecar {
    pub port: u16,
    pub process: Process,
    _logs: tempfile::TempDir,
}

impl Sidecar {
    pub fn bin() -> PathBuf {
        let p = artifact("RATELIMIT_SIDECAR_BIN", "target/release/ratelimit-sidecar");
        require_file(&p, "the sidecar binary", "RATELIMIT_SIDECAR_BIN")
    }

    /// Starts the sidecar and waits until it is ready (Redis answers, the script is loaded).
    pub fn start(redis_url: &str, extra: &[&str]) -> Sidecar {
        Sidecar::start_on(free_port(), redis_url, extra)
    }

    /// Starts the sidecar with the policy file `limits` (`--limits`) and waits until it is ready.
    pub fn start_with_limits(redis_url: &str, limits: &Path, extra: &[&str]) -> Sidecar {
        let limits = limits.display().to_string();
        let mut args = vec!["--limits", limits.as_str()];
        args.extend_from_slice(extra);
        Sidecar::start_on(free_port(), redis_url, &args)
    }

    /// Starts the sidecar on a given port (to bring "the same" sidecar back after stopping it).
    pub fn start_on(port: u16, redis_url: &str, extra: &[&str]) -> Sidecar {
        let logs = tempfile::tempdir().expect("temp dir");
        let mut cmd = Command::new(Sidecar::bin());
        cmd.args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--redis",
            redis_url,
        ])
        .args(extra)
        .env("RUST_LOG", "info");
        let process = Process::spawn(&format!("sidecar-{port}"), cmd, logs.path());
        let sidecar = Sidecar {
            port,
            process,
            _logs: logs,
        };
        let client = http();
        let url = format!("{}/readyz", sidecar.base_url());
        wait_until("the sidecar's /readyz", READY_TIMEOUT, || {
            client
                .get(&url)
                .send()
                .map(|r| r.status() == 200)
                .unwrap_or(false)
        });
        sidecar
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// A JWT signed with the test key whose public half is in `envoy/jwt/jwks.json`, issued by the
/// issuer the shipped JWT example trusts.
pub fn signed_jwt(claims: &serde_json::Value) -> String {
    let pem = std::fs::read(workspace_root().join("tests/fixtures/jwt-test-key.pem"))
        .expect("read tests/fixtures/jwt-test-key.pem");
    let key = jsonwebtoken::EncodingKey::from_rsa_pem(&pem).expect("test key is RSA PEM");
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::RS256);
    header.kid = Some("test-key-1".into());
    jsonwebtoken::encode(&header, claims, &key).expect("sign JWT")
}

/// The issuer in `envoy/envoy-jwt.yaml` and in the tokens of [`signed_jwt`].
pub const JWT_ISSUER: &str = "https://issuer.example.com";
