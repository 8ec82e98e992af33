//! Test harness: real `redis-server` processes on free loopback ports (killed on drop), the
//! sidecar served in-process on a free port, and small HTTP helpers. Waits poll for readiness.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use ratelimit_sidecar::Args;
use serde_json::{json, Value};
use tempfile::TempDir;

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// Polls `ready` every 10 ms until it holds, for at most `limit`.
pub fn wait_until(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sends PING over a raw socket: true on `+PONG`.
pub fn pings(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 64];
    s.write_all(b"PING\r\n").is_ok()
        && s.read(&mut buf)
            .is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
}

/// One `redis-server` process with its own temp dir.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    extra: Vec<String>,
    dir: TempDir,
}

impl RedisServer {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with extra arguments (e.g. `--maxmemory-policy allkeys-lru`).
    pub fn start_with(extra: &[&str]) -> Self {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        for _ in 0..5 {
            let port = free_port();
            let mut server = Self {
                port,
                child: None,
                extra: extra.clone(),
                dir: tempfile::tempdir().expect("temp dir"),
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("could not start redis-server on a free port");
    }

    /// Starts a server on a given port (e.g. one a sidecar already points at).
    pub fn start_on(port: u16) -> Self {
        let mut server = Self {
            port,
            child: None,
            extra: Vec::new(),
            dir: tempfile::tempdir().expect("temp dir"),
        };
        assert!(server.spawn(), "port {port} is taken");
        server
    }

    /// Starts the process on `self.port`; false if it exited (port taken).
    fn spawn(&mut self) -> bool {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--dir", &self.dir.path().to_string_lossy()])
            .args(&self.extra)
            .current_dir(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (apt-get install redis-server)");
        self.child = Some(child);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if pings(self.port) {
                return true;
            }
            if let Some(c) = self.child.as_mut() {
                if c.try_wait().ok().flatten().is_some() {
                    self.child = None;
                    return false;
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("redis-server on port {} did not answer PING", self.port);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Kills the process (its script cache and data are gone).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts a fresh process on the same port.
    pub fn restart(&mut self) {
        self.stop();
        assert!(self.spawn(), "port {} was taken meanwhile", self.port);
    }

    /// A synchronous connection for checks.
    pub fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection())
            .expect("connect to test redis")
    }

    /// Runs `redis-cli -p PORT args...` and returns its stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Three cluster-enabled primaries joined by `redis-cli --cluster create`.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> Self {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "5000",
                ])
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        for n in &nodes {
            wait_until("cluster_state:ok", Duration::from_secs(30), || {
                n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok")
            });
        }
        Self { nodes }
    }

    pub fn seeds(&self) -> String {
        self.nodes
            .iter()
            .map(RedisServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn client(&self) -> redis::cluster::ClusterConnection {
        redis::cluster::ClusterClient::new(
            self.nodes.iter().map(RedisServer::url).collect::<Vec<_>>(),
        )
        .and_then(|c| c.get_connection())
        .expect("cluster connection")
    }
}

/// The sidecar served in-process on a free port; stopped on drop.
pub struct Sidecar {
    pub base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub http: reqwest::Client,
}

impl Sidecar {
    /// Starts the sidecar with these flags (`--listen` is chosen here).
    pub async fn start(flags: &[&str]) -> Self {
        let mut argv = vec!["ratelimit-sidecar"];
        argv.extend_from_slice(flags);
        let args = Args::try_parse_from(argv).expect("valid flags");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            ratelimit_sidecar::serve(args, listener, async {
                let _ = stopped.await;
            })
            .await
            .expect("sidecar serves");
        });
        let sidecar = Self {
            base,
            stop: Some(stop),
            http: reqwest::Client::new(),
        };
        sidecar.wait_ready("/healthz").await;
        sidecar
    }

    pub async fn on_redis(redis: &RedisServer) -> Self {
        // A generous timeout: these tests check semantics on a busy 2-core machine, not latency.
        let s = Self::start(&["--redis", &redis.url(), "--redis-timeout-ms", "2000"]).await;
        s.wait_ready("/readyz").await;
        s
    }

    /// Polls `path` until it answers 200 (bounded).
    pub async fn wait_ready(&self, path: &str) {
        let start = Instant::now();
        loop {
            if let Ok(r) = self.http.get(format!("{}{path}", self.base)).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "{path} never answered 200"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// POSTs a raw body to /v1/decide: (status, JSON answer).
    pub async fn post_raw(&self, body: impl Into<reqwest::Body>) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}/v1/decide", self.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("sidecar answers");
        let status = r.status().as_u16();
        let text = r.text().await.expect("body");
        let json = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("answer is not JSON ({e}): {status} {text}"));
        (status, json)
    }

    pub async fn decide(&self, decisions: Value) -> (u16, Value) {
        self.post_raw(json!({ "decisions": decisions }).to_string())
            .await
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let r = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("sidecar answers");
        (r.status().as_u16(), r.text().await.expect("body"))
    }

    /// The value of one metric line (e.g. `ratelimit_script_loads_total`), 0 when absent.
    pub async fn metric(&self, line_prefix: &str) -> f64 {
        let (_, text) = self.get("/metrics").await;
        text.lines()
            .find(|l| l.starts_with(line_prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// One decision as JSON.
pub fn decision(key: &str, capacity: f64, refill_per_sec: f64, cost: f64) -> Value {
    json!({ "key": key, "capacity": capacity, "refill_per_sec": refill_per_sec, "cost": cost })
}

/// A key unique to this test run, so tests may share nothing and run twice in a row.
pub fn unique(name: &str) -> String {
    format!("{name}-{:x}", rand::random::<u64>())
}
