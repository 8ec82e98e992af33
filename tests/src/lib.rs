//! The end-to-end harness: starts the real parts as processes on free loopback ports (redis-server,
//! the sidecar binary, Envoy with the wasm filter) plus an in-process demo upstream, waits for each
//! to be ready by polling its readiness check (never by sleeping), and stops them on drop.
//!
//! The measuring binaries (`make bench`, `make scale`, `make reliability`) share the rest: the
//! load generator ([`load`]), what the processes say about themselves ([`probe`]), tables and
//! quantiles ([`report`]), and the filter's plugin JSON with its lease defaults ([`plugin`]).
//!
//! Binaries are found through environment variables, falling back to the workspace's build
//! outputs, so `make test` (which builds them first) needs no configuration:
//! - `RATELIMIT_SIDECAR_BIN` (default `target/release/ratelimit-sidecar`)
//! - `RATELIMIT_FILTER_WASM` (default `target/wasm32-wasip1/release/ratelimit_filter.wasm`)
//! - `ENVOY_BIN` (default `.venv/bin/envoy`, installed by `scripts/install-deps.sh`)
//! - `REDIS_SERVER_BIN` (default `redis-server` on the PATH)

pub mod chaos;
pub mod envoy;
pub mod fault_proxy;
pub mod load;
pub mod netns;
pub mod plugin;
pub mod probe;
pub mod redis;
pub mod reload;
pub mod report;
pub mod rounds;
pub mod scenario;
pub mod script_cost;
pub mod snapshot_restore;
pub mod sockets;
pub mod stages;
pub mod store_loss;
pub mod tls;
pub mod upstream;
pub mod utilisation;

use std::fs::File;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

pub use envoy::{native_settled_route, plugin_json, Envoy, EnvoyConfig};
pub use fault_proxy::FaultProxy;
pub use redis::{Redis, RedisCluster, RedisOptions, Sentinel, SentinelOptions, SentinelProbe};
pub use tls::TestPki;
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

/// Where [`free_port`] hands out ports: `FIRST_PORT .. FIRST_PORT + PORT_SPAN`, each with its
/// Redis Cluster bus port (`+ 10000`) in the span above, both below the kernel's ephemeral range.
const FIRST_PORT: u32 = 12000;
const PORT_SPAN: u32 = 10000;

/// A free TCP port (nothing listens on it, on any address, nor on its Redis Cluster bus port).
///
/// Taken from below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`), so neither
/// another process binding port 0 nor an outgoing connection can take it between this check and
/// the caller's bind (tests run in parallel and start many servers and connections); each test
/// process walks the span from its own starting point. Where the ephemeral range starts too low
/// for that, the kernel picks the port (bind to port 0), as a last resort.
pub fn free_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(u32::MAX);
    use std::sync::atomic::Ordering::Relaxed;
    let bindable = |port: u32| TcpListener::bind(("0.0.0.0", port as u16)).is_ok();
    if ephemeral_low() >= FIRST_PORT + 2 * PORT_SPAN {
        let start = (std::process::id()
            ^ std::time::UNIX_EPOCH
                .elapsed()
                .map_or(0, |d| d.subsec_nanos()))
            % PORT_SPAN;
        let _ = NEXT.compare_exchange(u32::MAX, start, Relaxed, Relaxed);
        for _ in 0..PORT_SPAN {
            let port = FIRST_PORT + NEXT.fetch_add(1, Relaxed) % PORT_SPAN;
            if bindable(port) && bindable(port + PORT_SPAN) {
                return port as u16;
            }
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// The first port of the kernel's ephemeral range (32768 when it cannot be read).
fn ephemeral_low() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
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

/// The sidecar binary, on a free port, pointed at one Redis, with a policy file of its own (a
/// copy the test may edit: the sidecar reloads it).
pub struct Sidecar {
    pub port: u16,
    pub process: Process,
    /// The policy file the sidecar reads.
    pub policy: PathBuf,
    _logs: tempfile::TempDir,
}

impl Sidecar {
    pub fn bin() -> PathBuf {
        let p = artifact("RATELIMIT_SIDECAR_BIN", "target/release/ratelimit-sidecar");
        require_file(&p, "the sidecar binary", "RATELIMIT_SIDECAR_BIN")
    }

    /// The shipped policy file, `envoy/limits.yaml`.
    pub fn shipped_policy() -> String {
        let path = workspace_root().join("envoy/limits.yaml");
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
    }

    /// Starts the sidecar with the shipped policy and waits until it is ready (Redis answers,
    /// the script is loaded).
    pub fn start(redis_url: &str, extra: &[&str]) -> Sidecar {
        Sidecar::start_on(free_port(), redis_url, &Sidecar::shipped_policy(), extra)
    }

    /// Starts the sidecar with a policy of the test's own.
    pub fn with_policy(redis_url: &str, policy: &str, extra: &[&str]) -> Sidecar {
        Sidecar::start_on(free_port(), redis_url, policy, extra)
    }

    /// Starts the sidecar on a given port (to bring "the same" sidecar back after stopping it).
    pub fn start_on(port: u16, redis_url: &str, policy: &str, extra: &[&str]) -> Sidecar {
        let sidecar = Sidecar::spawn_on(port, redis_url, policy, extra);
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

    /// Starts the sidecar without waiting for readiness (Redis may be down on purpose).
    pub fn spawn_on(port: u16, redis_url: &str, policy: &str, extra: &[&str]) -> Sidecar {
        let logs = tempfile::tempdir().expect("temp dir");
        let policy_path = logs.path().join("limits.yaml");
        std::fs::write(&policy_path, policy).expect("write the policy file");
        let mut cmd = Command::new(Sidecar::bin());
        cmd.args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--redis",
            redis_url,
            "--limits",
        ])
        .arg(&policy_path)
        .args(extra)
        .env("RUST_LOG", "info");
        let process = Process::spawn(&format!("sidecar-{port}"), cmd, logs.path());
        Sidecar {
            port,
            process,
            policy: policy_path,
            _logs: logs,
        }
    }

    /// Starts the sidecar with a policy of the test's own and `args` that name Redis themselves
    /// (`--redis-cluster <seeds>`, `--redis-sentinel <urls>`, ...), on `port`, without waiting:
    /// see [`Sidecar::wait_ready`].
    pub fn spawn_with_args(port: u16, policy: &str, args: &[&str]) -> Sidecar {
        Sidecar::spawn_with_args_env(port, policy, args, &[])
    }

    /// [`Sidecar::spawn_with_args`] with environment variables `env` besides.
    pub fn spawn_with_args_env(
        port: u16,
        policy: &str,
        args: &[&str],
        env: &[(String, String)],
    ) -> Sidecar {
        Sidecar::spawn_in(None, port, policy, args, env)
    }

    /// [`Sidecar::spawn_with_args_env`] inside network namespace `netns` (none: this
    /// process's), by `ip netns exec`, which execs it: the process is the sidecar's. Its
    /// `127.0.0.1` is the namespace's: reach it through a relay into the namespace.
    pub fn spawn_in(
        netns: Option<&str>,
        port: u16,
        policy: &str,
        args: &[&str],
        env: &[(String, String)],
    ) -> Sidecar {
        let logs = tempfile::tempdir().expect("temp dir");
        let policy_path = logs.path().join("limits.yaml");
        std::fs::write(&policy_path, policy).expect("write the policy file");
        let mut cmd = match netns {
            Some(ns) => {
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", ns]).arg(Sidecar::bin());
                cmd
            }
            None => Command::new(Sidecar::bin()),
        };
        cmd.args(["--listen", &format!("127.0.0.1:{port}"), "--limits"])
            .arg(&policy_path)
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(env.iter().map(|(k, v)| (k, v)));
        let process = Process::spawn(&format!("sidecar-{port}"), cmd, logs.path());
        Sidecar {
            port,
            process,
            policy: policy_path,
            _logs: logs,
        }
    }

    /// [`Sidecar::spawn_with_args`] on a free port, then waits until `/readyz` answers 200.
    pub fn start_with_args(policy: &str, args: &[&str]) -> Sidecar {
        let mut sidecar = Sidecar::spawn_with_args(free_port(), policy, args);
        sidecar.wait_ready();
        sidecar
    }

    /// Waits until `/readyz` answers 200 (Redis answers, the script is loaded), failing at once
    /// if the sidecar exits meanwhile.
    pub fn wait_ready(&mut self) {
        let url = format!("{}/readyz", self.base_url());
        self.wait_for(&http(), &url, 200);
    }

    /// Starts the sidecar binary `bin` with `--listen 127.0.0.1:<port>` and `args` (RUST_LOG
    /// `info` unless the environment says otherwise), without waiting for anything: for
    /// listeners that need TLS or tokens, and for setups that never become ready.
    pub fn spawn(bin: &Path, port: u16, args: &[&str]) -> Sidecar {
        Sidecar::spawn_with_env(bin, port, args, &[])
    }

    /// [`Sidecar::spawn`] with environment variables (e.g. `RATELIMIT_REDIS_PASSWORD`).
    pub fn spawn_with_env(bin: &Path, port: u16, args: &[&str], env: &[(&str, &str)]) -> Sidecar {
        let logs = tempfile::tempdir().expect("temp dir");
        let mut cmd = sidecar_command(bin);
        cmd.args(["--listen", &format!("127.0.0.1:{port}")])
            .args(args)
            .envs(env.iter().copied())
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            );
        let process = Process::spawn(&format!("sidecar-{port}"), cmd, logs.path());
        Sidecar {
            port,
            process,
            policy: test_policy_file(),
            _logs: logs,
        }
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Replaces the policy file (the sidecar reloads it; poll for the effect).
    pub fn write_policy(&self, policy: &str) {
        // Write beside and rename, as an operator's tooling (or a ConfigMap update) does, so the
        // sidecar never reads half a file.
        let tmp = self.policy.with_extension("yaml.new");
        std::fs::write(&tmp, policy).expect("write the new policy");
        std::fs::rename(&tmp, &self.policy).expect("swap the policy in");
    }

    /// The value of one metric line of `/metrics` (e.g. `ratelimit_script_loads_total`), 0 when
    /// absent.
    pub fn metric(&self, line_prefix: &str) -> f64 {
        let text = http()
            .get(format!("{}/metrics", self.base_url()))
            .send()
            .and_then(|r| r.text())
            .unwrap_or_default();
        text.lines()
            .find(|l| l.starts_with(line_prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }
}

/// The tokens a bucket holds as the script stores it (little-endian doubles: tokens, ts, ...);
/// `None` when the key is missing.
pub fn bucket_tokens(redis: &Redis, key: &str) -> Option<f64> {
    let raw: Option<Vec<u8>> = ::redis::cmd("GET")
        .arg(key)
        .query(&mut redis.connection())
        .expect("GET");
    raw.and_then(|v| Some(f64::from_le_bytes(v.get(..8)?.try_into().ok()?)))
}

impl Sidecar {
    /// Waits until `GET url` through `client` answers `status`, failing at once if the sidecar
    /// exits meanwhile.
    pub fn wait_for(&mut self, client: &reqwest::blocking::Client, url: &str, status: u16) {
        wait_until(&format!("{url} answering {status}"), READY_TIMEOUT, || {
            assert!(
                self.process.running(),
                "the sidecar exited:\n{}",
                self.process.log()
            );
            client
                .get(url)
                .send()
                .is_ok_and(|r| r.status().as_u16() == status)
        });
    }
}

/// The policy of the sidecars that [`sidecar_command`] starts: one rule per bucket the tests of
/// TLS, tokens and redaction use ([`decide_body`]), and the shipped configs' rules with small,
/// non-refilling numbers (the mTLS test runs the shipped `envoy.yaml` through it).
pub const TEST_POLICY: &str = "\
rules:
  c5: {capacity: 5, refill_per_sec: 0.001}
  c10: {capacity: 10, refill_per_sec: 0.001}
  c10r1: {capacity: 10, refill_per_sec: 1}
  per-app: {capacity: 3, refill_per_sec: 0.001}
  per-ip: {capacity: 1000, refill_per_sec: 100}
";

/// [`TEST_POLICY`] as a file (written once per test process).
pub fn test_policy_file() -> PathBuf {
    static FILE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        let path =
            std::env::temp_dir().join(format!("ratelimit-test-policy-{}.yaml", std::process::id()));
        std::fs::write(&path, TEST_POLICY).expect("write the test policy");
        path
    })
    .clone()
}

/// The sidecar binary `bin` as a command with the flags every sidecar of these tests needs (the
/// one place to add one: the policy file), to which a test appends its own.
pub fn sidecar_command(bin: &Path) -> Command {
    let mut cmd = Command::new(bin);
    cmd.arg("--limits").arg(test_policy_file());
    cmd
}

/// The rule of [`TEST_POLICY`] with these numbers.
fn test_rule(capacity: u64, refill_per_sec: f64) -> &'static str {
    match (capacity, refill_per_sec >= 1.0) {
        (5, false) => "c5",
        (10, false) => "c10",
        (10, true) => "c10r1",
        _ => panic!("no rule for capacity {capacity} refill {refill_per_sec} in TEST_POLICY"),
    }
}

/// The Redis key of the bucket that [`decide_body`]`(key, capacity, refill_per_sec, ..)` charges
/// (the one place the tests of TLS, tokens and redaction name it).
pub fn bucket_key(key: &str, capacity: u64, refill_per_sec: f64) -> String {
    let rule = test_rule(capacity, refill_per_sec);
    format!("rl:{{ratelimit|rule={rule}|id={key}}}")
}

/// The body of one `POST /v1/decide` with one request of one decision (the one place the tests
/// of TLS, tokens and redaction build it); its answer's first result is at
/// `["answers"][0]["results"][0]`.
pub fn decide_body(key: &str, capacity: u64, refill_per_sec: f64, cost: u64) -> String {
    serde_json::json!({"requests": [{"decisions": [{
        "rule": test_rule(capacity, refill_per_sec), "subject": {"id": key}, "cost": cost
    }]}]})
    .to_string()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
        for p in &ports {
            let _listener = TcpListener::bind(("127.0.0.1", *p)).expect("a free port binds");
            if ephemeral_low() >= FIRST_PORT + 2 * PORT_SPAN {
                assert!(
                    (FIRST_PORT..FIRST_PORT + PORT_SPAN).contains(&u32::from(*p)),
                    "{p}"
                );
            }
        }
    }
}
