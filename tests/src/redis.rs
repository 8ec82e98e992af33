//! Real `redis-server` processes for every test suite: one server on a free loopback port
//! ([`Redis`]), three cluster-enabled primaries joined into a Redis Cluster ([`RedisCluster`]),
//! or a Sentinel watching a primary ([`Sentinel`]). Each persists nothing, keeps its files and
//! log in its own temp dir, and is killed on drop.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::{free_port, wait_until, Process, READY_TIMEOUT};

/// How many free ports [`Redis::start_with`] tries (another process may take one meanwhile).
const PORT_ATTEMPTS: usize = 5;

/// A redis-server of its own, on a free port, persisting nothing.
pub struct Redis {
    pub port: u16,
    pub process: Process,
    extra: Vec<String>,
    /// Declared after `process`, so the log is still there when a failing test prints its tail.
    dir: tempfile::TempDir,
}

impl Redis {
    pub fn start() -> Redis {
        Redis::start_with(&[])
    }

    /// Starts on a free port with extra `--flag value` arguments (e.g. `--maxmemory-policy
    /// allkeys-lru`).
    pub fn start_with(extra: &[&str]) -> Redis {
        (0..PORT_ATTEMPTS)
            .find_map(|_| Redis::try_start(free_port(), extra))
            .expect("could not start redis-server on a free port")
    }

    /// Starts on a given port (e.g. one a sidecar already points at).
    pub fn start_on(port: u16, extra: &[&str]) -> Redis {
        Redis::try_start(port, extra).unwrap_or_else(|| panic!("port {port} is taken"))
    }

    /// None when redis-server exited before answering (the port is taken).
    fn try_start(port: u16, extra: &[&str]) -> Option<Redis> {
        let dir = tempfile::tempdir().expect("temp dir");
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let process = Redis::spawn(port, &extra, &dir)?;
        Some(Redis {
            port,
            process,
            extra,
            dir,
        })
    }

    /// Starts the process and waits until it answers PING; None if it exited first.
    fn spawn(port: u16, extra: &[String], dir: &tempfile::TempDir) -> Option<Process> {
        let bin = std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into());
        let mut cmd = Command::new(bin);
        cmd.current_dir(dir.path())
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .args(extra);
        let mut process = Process::spawn(&format!("redis-{port}"), cmd, dir.path());
        wait_until(&format!("redis on {port}"), READY_TIMEOUT, || {
            pings(port) || !process.running()
        });
        process.running().then_some(process)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Kills the process (its script cache and data are gone).
    pub fn stop(&mut self) {
        self.process.stop();
    }

    /// Starts a fresh process on the same port, with the same arguments.
    pub fn restart(&mut self) {
        self.stop();
        self.process = Redis::spawn(self.port, &self.extra, &self.dir)
            .unwrap_or_else(|| panic!("port {} was taken meanwhile", self.port));
    }

    /// A synchronous connection for checks.
    pub fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection())
            .expect("connect to test redis")
    }

    /// Runs one command through `redis-cli` and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }
}

/// Runs one command through `redis-cli` against a local port and returns its output.
fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Sends PING over a raw socket: true on `+PONG`.
fn pings(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 64];
    s.write_all(b"PING\r\n").is_ok()
        && s.read(&mut buf)
            .is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
}

/// Three cluster-enabled primaries joined by `redis-cli --cluster create`.
pub struct RedisCluster {
    pub nodes: Vec<Redis>,
}

impl RedisCluster {
    pub fn start() -> Self {
        let nodes: Vec<Redis> = (0..3)
            .map(|_| {
                Redis::start_with(&[
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

    /// The nodes' URLs, comma-separated (the sidecar's `--redis-cluster`).
    pub fn seeds(&self) -> String {
        self.nodes
            .iter()
            .map(Redis::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn client(&self) -> redis::cluster::ClusterConnection {
        redis::cluster::ClusterClient::new(self.nodes.iter().map(Redis::url).collect::<Vec<_>>())
            .and_then(|c| c.get_connection())
            .expect("cluster connection")
    }
}

/// A Redis Sentinel (`redis-server <conf> --sentinel`) on a free port, monitoring one primary
/// with a 1 s down-after, so a failover starts about a second after the primary dies. Its config
/// file lives in its own temp dir (Sentinel rewrites it).
pub struct Sentinel {
    pub port: u16,
    pub process: Process,
    master: String,
    _dir: tempfile::TempDir,
}

impl Sentinel {
    /// Starts a Sentinel monitoring `master` at 127.0.0.1:`primary_port` with `quorum`, and
    /// waits until it names that master.
    pub fn start(master: &str, primary_port: u16, quorum: u32) -> Sentinel {
        (0..PORT_ATTEMPTS)
            .find_map(|_| Sentinel::try_start(free_port(), master, primary_port, quorum))
            .expect("could not start a sentinel on a free port")
    }

    fn try_start(port: u16, master: &str, primary_port: u16, quorum: u32) -> Option<Sentinel> {
        let dir = tempfile::tempdir().expect("temp dir");
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {dir}\n\
                 sentinel monitor {master} 127.0.0.1 {primary_port} {quorum}\n\
                 sentinel down-after-milliseconds {master} 1000\n\
                 sentinel failover-timeout {master} 5000\n\
                 sentinel parallel-syncs {master} 1\n",
                dir = dir.path().display()
            ),
        )
        .expect("write sentinel.conf");
        let bin = std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into());
        let mut cmd = Command::new(bin);
        cmd.current_dir(dir.path()).arg(&conf).arg("--sentinel");
        let process = Process::spawn(&format!("sentinel-{port}"), cmd, dir.path());
        let mut sentinel = Sentinel {
            port,
            process,
            master: master.to_string(),
            _dir: dir,
        };
        wait_until(&format!("sentinel on {port}"), READY_TIMEOUT, || {
            sentinel.master_port().is_some() || !sentinel.process.running()
        });
        sentinel.process.running().then_some(sentinel)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The port of the primary this Sentinel names now (`SENTINEL get-master-addr-by-name`).
    pub fn master_port(&self) -> Option<u16> {
        let out = cli(
            self.port,
            &["SENTINEL", "get-master-addr-by-name", &self.master],
        );
        out.lines().nth(1)?.trim().parse().ok()
    }
}
