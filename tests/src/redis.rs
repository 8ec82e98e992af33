//! Real `redis-server` processes for every test suite: one server on a free loopback port
//! ([`Redis`]), three cluster-enabled primaries joined into a Redis Cluster ([`RedisCluster`]),
//! or a Sentinel watching a primary ([`Sentinel`]). Each persists nothing, keeps its files and
//! log in its own temp dir, and is killed on drop. Any of them can require a password or speak
//! TLS only ([`RedisOptions`], [`SentinelOptions`]), with certificates from [`TestPki`].

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::tls::TestPki;
use crate::{free_port, wait_until, Process, READY_TIMEOUT};

/// How a [`Redis`] (or every node of a [`RedisCluster`]) starts beyond the defaults.
#[derive(Clone, Default)]
pub struct RedisOptions {
    /// TLS only: `--port 0 --tls-port <port>` with the PKI's server certificate, trusting its
    /// CA; `--tls-replication yes` and `--tls-cluster yes`, so replicas and the cluster bus use
    /// TLS too. Clients must present a certificate unless `tls_auth_clients` says otherwise.
    pub tls: Option<TestPki>,
    /// `--tls-auth-clients`: `"yes"` (the default with `tls`), `"optional"` or `"no"`.
    pub tls_auth_clients: Option<&'static str>,
    /// `--requirepass` (and `--masterauth`, so a replica authenticates to its primary).
    pub password: Option<String>,
    /// Extra `--flag value` arguments.
    pub extra: Vec<String>,
}

impl RedisOptions {
    pub fn tls(mut self, pki: &TestPki) -> Self {
        self.tls = Some(pki.clone());
        self
    }

    pub fn tls_auth_clients(mut self, mode: &'static str) -> Self {
        self.tls_auth_clients = Some(mode);
        self
    }

    pub fn password(mut self, password: &str) -> Self {
        self.password = Some(password.to_string());
        self
    }

    pub fn args(mut self, extra: &[&str]) -> Self {
        self.extra.extend(extra.iter().map(|s| s.to_string()));
        self
    }

    /// The listening arguments: `--port P`, or `--port 0 --tls-port P` and the TLS files.
    fn server_args(&self, port: u16) -> Vec<String> {
        let mut args = Vec::new();
        match &self.tls {
            None => args.extend(["--port".into(), port.to_string()]),
            Some(pki) => {
                args.extend([
                    "--port".into(),
                    "0".into(),
                    "--tls-port".into(),
                    port.to_string(),
                ]);
                args.extend(pki.redis_server_args());
                args.extend([
                    "--tls-auth-clients".into(),
                    self.tls_auth_clients.unwrap_or("yes").into(),
                    "--tls-replication".into(),
                    "yes".into(),
                ]);
            }
        }
        if let Some(p) = &self.password {
            args.extend([
                "--requirepass".into(),
                p.clone(),
                "--masterauth".into(),
                p.clone(),
            ]);
        }
        args.extend(self.extra.iter().cloned());
        args
    }

    /// redis-cli's arguments to reach a server started with these options.
    fn cli_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if let Some(pki) = &self.tls {
            args.extend(pki.redis_cli_args());
        }
        if let Some(p) = &self.password {
            args.extend(["--no-auth-warning".into(), "-a".into(), p.clone()]);
        }
        args
    }
}

/// How many free ports [`Redis::start_with`] tries (another process may take one meanwhile).
const PORT_ATTEMPTS: usize = 5;

/// A redis-server of its own, on a free port, persisting nothing.
pub struct Redis {
    pub port: u16,
    pub process: Process,
    options: RedisOptions,
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
        Redis::start_with_options(&RedisOptions::default().args(extra))
    }

    /// Starts on a free port with these options (TLS, a password, extra arguments).
    pub fn start_with_options(options: &RedisOptions) -> Redis {
        (0..PORT_ATTEMPTS)
            .find_map(|_| Redis::try_start(free_port(), options))
            .expect("could not start redis-server on a free port")
    }

    /// Starts on a given port (e.g. one a sidecar already points at).
    pub fn start_on(port: u16, extra: &[&str]) -> Redis {
        Redis::try_start(port, &RedisOptions::default().args(extra))
            .unwrap_or_else(|| panic!("port {port} is taken"))
    }

    /// None when redis-server exited before answering (the port is taken).
    fn try_start(port: u16, options: &RedisOptions) -> Option<Redis> {
        let dir = tempfile::tempdir().expect("temp dir");
        let process = Redis::spawn(port, options, &dir)?;
        Some(Redis {
            port,
            process,
            options: options.clone(),
            dir,
        })
    }

    /// Starts the process and waits until it answers PING; None if it exited first.
    fn spawn(port: u16, options: &RedisOptions, dir: &tempfile::TempDir) -> Option<Process> {
        let bin = std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into());
        let mut cmd = Command::new(bin);
        cmd.current_dir(dir.path())
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .args(options.server_args(port));
        let mut process = Process::spawn(&format!("redis-{port}"), cmd, dir.path());
        let plain = options.tls.is_none() && options.password.is_none();
        wait_until(&format!("redis on {port}"), READY_TIMEOUT, || {
            let answers = if plain {
                pings(port)
            } else {
                cli_with(port, &options.cli_args(), &["PING"]) == "PONG"
            };
            answers || !process.running()
        });
        process.running().then_some(process)
    }

    /// `redis://127.0.0.1:<port>`, or `rediss://` with TLS; never with the password (see
    /// [`Redis::url_with_password`]).
    pub fn url(&self) -> String {
        let scheme = if self.options.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// [`Redis::url`] with the password in it (`redis://:<password>@...`).
    pub fn url_with_password(&self) -> String {
        match &self.options.password {
            None => self.url(),
            Some(p) => self.url().replacen("://", &format!("://:{p}@"), 1),
        }
    }

    /// The password it requires, if any.
    pub fn password(&self) -> Option<&str> {
        self.options.password.as_deref()
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
        self.process = Redis::spawn(self.port, &self.options, &self.dir)
            .unwrap_or_else(|| panic!("port {} was taken meanwhile", self.port));
    }

    /// Starts a fresh process on the same port without any data: a snapshot [`Redis::snapshot`]
    /// or a replica's full sync left on disk is removed first (Redis loads one at start).
    pub fn restart_empty(&mut self) {
        self.stop();
        let _ = std::fs::remove_file(self.dir.path().join("dump.rdb"));
        self.process = Redis::spawn(self.port, &self.options, &self.dir)
            .unwrap_or_else(|| panic!("port {} was taken meanwhile", self.port));
    }

    /// An RDB snapshot of the data now (`SAVE`), as Redis's default persistence takes them.
    pub fn snapshot(&self) -> Vec<u8> {
        assert_eq!(self.cli(&["SAVE"]), "OK");
        std::fs::read(self.dir.path().join("dump.rdb")).expect("the snapshot SAVE wrote")
    }

    /// Restarts the process from `snapshot` (an older [`Redis::snapshot`]): what a Redis
    /// restarted from an RDB taken earlier, or a failover to a lagging replica, holds.
    pub fn restart_from(&mut self, snapshot: &[u8]) {
        self.stop();
        std::fs::write(self.dir.path().join("dump.rdb"), snapshot).expect("write the snapshot");
        self.process = Redis::spawn(self.port, &self.options, &self.dir)
            .unwrap_or_else(|| panic!("port {} was taken meanwhile", self.port));
    }

    /// The run_id of the process (`INFO server`): a new one at every start.
    pub fn run_id(&self) -> String {
        self.cli(&["INFO", "server"])
            .lines()
            .find_map(|l| l.strip_prefix("run_id:"))
            .expect("INFO server names the run_id")
            .trim()
            .to_string()
    }

    /// A synchronous connection for checks (with the password and client certificate).
    pub fn connection(&self) -> redis::Connection {
        let url = self.url_with_password();
        match &self.options.tls {
            None => redis::Client::open(url),
            Some(pki) => redis::Client::build_with_tls(url, pki.redis_certificates()),
        }
        .and_then(|c| c.get_connection())
        .expect("connect to test redis")
    }

    /// Runs one command through `redis-cli` (with the password and client certificate) and
    /// returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        cli_with(self.port, &self.options.cli_args(), args)
    }
}

/// Runs one command through `redis-cli` against a local port, with connection arguments (TLS
/// files, password) before the command, and returns its output.
fn cli_with(port: u16, connect: &[String], args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(connect)
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
        RedisCluster::start_with_options(&RedisOptions::default())
    }

    /// Every node started with `options` (with TLS, the cluster bus uses TLS too).
    pub fn start_with_options(options: &RedisOptions) -> Self {
        let mut options = options.clone().args(&[
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "5000",
        ]);
        if options.tls.is_some() {
            options = options.args(&["--tls-cluster", "yes"]);
        }
        let nodes: Vec<Redis> = (0..3)
            .map(|_| Redis::start_with_options(&options))
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(options.cli_args())
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

    /// Three primaries, each with one replica (`--cluster-replicas 1`): six nodes in `nodes`.
    /// A primary unreachable for `node_timeout_ms` is failed over to its replica. With
    /// `cluster-require-full-coverage no`, the other primaries keep serving their slots meanwhile
    /// (with the default `yes`, every slot stops until the promotion). Returns once every node
    /// says `cluster_state:ok` and every replica's link to its primary is up.
    pub fn start_replicated(node_timeout_ms: u64) -> Self {
        let timeout = node_timeout_ms.to_string();
        let options = RedisOptions::default().args(&[
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            &timeout,
            "--cluster-require-full-coverage",
            "no",
        ]);
        let nodes: Vec<Redis> = (0..6)
            .map(|_| Redis::start_with_options(&options))
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Self { nodes };
        for n in &cluster.nodes {
            wait_until("cluster_state:ok", Duration::from_secs(30), || {
                n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok")
            });
        }
        for i in 0..cluster.nodes.len() {
            if cluster.primary_port_of_replica(i).is_some() {
                wait_until("a replica's link up", Duration::from_secs(30), || {
                    cluster.nodes[i]
                        .cli(&["INFO", "replication"])
                        .contains("master_link_status:up")
                });
            }
        }
        cluster
    }

    /// The index in `nodes` of the primary that serves `key` now (the others answer MOVED; a
    /// stopped node answers nothing).
    pub fn primary_of(&self, key: &str) -> Option<usize> {
        self.nodes.iter().position(|n| {
            let out = n.cli(&["EXISTS", key]);
            out == "0" || out == "1"
        })
    }

    /// The port of the primary node `i` replicates, if it is a replica (`INFO replication`).
    pub fn primary_port_of_replica(&self, i: usize) -> Option<u16> {
        let info = self.nodes[i].cli(&["INFO", "replication"]);
        if !info.contains("role:slave") {
            return None;
        }
        info.lines()
            .find_map(|l| l.trim().strip_prefix("master_port:"))
            .and_then(|p| p.trim().parse().ok())
    }

    /// The index of a replica of the primary `primary` (by index), if it has one.
    pub fn replica_of(&self, primary: usize) -> Option<usize> {
        let port = self.nodes[primary].port;
        (0..self.nodes.len()).find(|&i| self.primary_port_of_replica(i) == Some(port))
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
        let urls: Vec<String> = self.nodes.iter().map(Redis::url_with_password).collect();
        let mut builder = redis::cluster::ClusterClientBuilder::new(urls);
        if let Some(pki) = &self.nodes[0].options.tls {
            builder = builder.certs(pki.redis_certificates());
        }
        builder
            .build()
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
    options: SentinelOptions,
    _dir: tempfile::TempDir,
}

/// How a [`Sentinel`] starts beyond the defaults.
#[derive(Clone, Default)]
pub struct SentinelOptions {
    /// TLS only (`port 0`, `tls-port`), and TLS to the primary, the replicas and the other
    /// Sentinels (`tls-replication yes`), presenting the PKI's server certificate.
    pub tls: Option<TestPki>,
    /// The Sentinel's own password (`requirepass`).
    pub password: Option<String>,
    /// The monitored primary's password (`sentinel auth-pass`).
    pub primary_password: Option<String>,
}

impl SentinelOptions {
    fn cli_args(&self) -> Vec<String> {
        RedisOptions {
            tls: self.tls.clone(),
            password: self.password.clone(),
            ..RedisOptions::default()
        }
        .cli_args()
    }
}

impl Sentinel {
    /// Starts a Sentinel monitoring `master` at 127.0.0.1:`primary_port` with `quorum`, and
    /// waits until it names that master.
    pub fn start(master: &str, primary_port: u16, quorum: u32) -> Sentinel {
        Sentinel::start_with_options(master, primary_port, quorum, &SentinelOptions::default())
    }

    /// [`Sentinel::start`] with TLS or passwords.
    pub fn start_with_options(
        master: &str,
        primary_port: u16,
        quorum: u32,
        options: &SentinelOptions,
    ) -> Sentinel {
        (0..PORT_ATTEMPTS)
            .find_map(|_| Sentinel::try_start(free_port(), master, primary_port, quorum, options))
            .expect("could not start a sentinel on a free port")
    }

    fn try_start(
        port: u16,
        master: &str,
        primary_port: u16,
        quorum: u32,
        options: &SentinelOptions,
    ) -> Option<Sentinel> {
        let dir = tempfile::tempdir().expect("temp dir");
        let conf = dir.path().join("sentinel.conf");
        let mut text = match &options.tls {
            None => format!("port {port}\n"),
            Some(pki) => format!(
                "port 0\ntls-port {port}\ntls-cert-file {}\ntls-key-file {}\n\
                 tls-ca-cert-file {}\ntls-replication yes\n",
                pki.server_cert.display(),
                pki.server_key.display(),
                pki.ca.display()
            ),
        };
        text += &format!(
            "bind 127.0.0.1\nprotected-mode no\ndir {dir}\n\
             sentinel monitor {master} 127.0.0.1 {primary_port} {quorum}\n\
             sentinel down-after-milliseconds {master} 1000\n\
             sentinel failover-timeout {master} 5000\n\
             sentinel parallel-syncs {master} 1\n",
            dir = dir.path().display()
        );
        if let Some(p) = &options.password {
            text += &format!("requirepass {p}\n");
        }
        if let Some(p) = &options.primary_password {
            text += &format!("sentinel auth-pass {master} {p}\n");
        }
        std::fs::write(&conf, text).expect("write sentinel.conf");
        let bin = std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into());
        let mut cmd = Command::new(bin);
        cmd.current_dir(dir.path()).arg(&conf).arg("--sentinel");
        let process = Process::spawn(&format!("sentinel-{port}"), cmd, dir.path());
        let mut sentinel = Sentinel {
            port,
            process,
            master: master.to_string(),
            options: options.clone(),
            _dir: dir,
        };
        wait_until(&format!("sentinel on {port}"), READY_TIMEOUT, || {
            sentinel.master_port().is_some() || !sentinel.process.running()
        });
        sentinel.process.running().then_some(sentinel)
    }

    /// `redis://127.0.0.1:<port>` (`rediss://` with TLS), with the Sentinel's password if it
    /// has one.
    pub fn url(&self) -> String {
        let scheme = if self.options.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        let auth = match &self.options.password {
            Some(p) => format!(":{p}@"),
            None => String::new(),
        };
        format!("{scheme}://{auth}127.0.0.1:{}", self.port)
    }

    /// `redis-cli` against this Sentinel (its TLS and password), the output trimmed.
    pub fn cli(&self, cmd: &[&str]) -> String {
        cli_with(self.port, &self.options.cli_args(), cmd)
    }

    /// Makes this Sentinel monitor `master` at 127.0.0.1:`primary_port` instead of what it
    /// monitored (`SENTINEL REMOVE`, `SENTINEL MONITOR`): Sentinel's own view changed without a
    /// failover, as when one ended while the old primary was away.
    pub fn monitor_instead(&self, primary_port: u16, quorum: u32) {
        let out = self.cli(&["SENTINEL", "REMOVE", &self.master]);
        assert_eq!(out, "OK", "SENTINEL REMOVE on {}: {out}", self.port);
        let (port, quorum) = (primary_port.to_string(), quorum.to_string());
        let out = self.cli(&[
            "SENTINEL",
            "MONITOR",
            &self.master,
            "127.0.0.1",
            &port,
            &quorum,
        ]);
        assert_eq!(out, "OK", "SENTINEL MONITOR on {}: {out}", self.port);
    }

    /// The port of the primary this Sentinel names now (`SENTINEL get-master-addr-by-name`).
    pub fn master_port(&self) -> Option<u16> {
        let out = cli_with(
            self.port,
            &self.options.cli_args(),
            &["SENTINEL", "get-master-addr-by-name", &self.master],
        );
        out.lines().nth(1)?.trim().parse().ok()
    }
}

/// The slots of a Cluster of `n` primaries split evenly, in order: primary `i` serves
/// `16384 * i / n ..= 16384 * (i + 1) / n - 1`.
pub fn even_slot_ranges(n: usize) -> Vec<(u16, u16)> {
    assert!(n >= 1, "a Cluster has at least one primary");
    (0..n)
        .map(|i| ((16384 * i / n) as u16, (16384 * (i + 1) / n - 1) as u16))
        .collect()
}

impl RedisCluster {
    /// `n` cluster-enabled primaries (1 or more, no replicas), primary `i` serving
    /// [`even_slot_ranges`]`(n)[i]`, joined by hand: `CLUSTER ADDSLOTSRANGE`,
    /// `CLUSTER SET-CONFIG-EPOCH` and `CLUSTER MEET` (`redis-cli --cluster create` wants at least
    /// three). Returns once every node sees all `n` nodes and all 16384 slots served.
    pub fn start_primaries(n: usize) -> Self {
        RedisCluster::start_primaries_with_options(n, &RedisOptions::default())
    }

    /// [`RedisCluster::start_primaries`] with every node started with `options`.
    pub fn start_primaries_with_options(n: usize, options: &RedisOptions) -> Self {
        let ranges = even_slot_ranges(n);
        let mut options = options.clone().args(&[
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "5000",
        ]);
        if options.tls.is_some() {
            options = options.args(&["--tls-cluster", "yes"]);
        }
        let nodes: Vec<Redis> = (0..n)
            .map(|_| Redis::start_with_options(&options))
            .collect();
        for (i, (node, (first, last))) in nodes.iter().zip(&ranges).enumerate() {
            let (first, last, epoch) = (first.to_string(), last.to_string(), (i + 1).to_string());
            for cmd in [
                &["CLUSTER", "ADDSLOTSRANGE", &first, &last][..],
                &["CLUSTER", "SET-CONFIG-EPOCH", &epoch][..],
            ] {
                let out = node.cli(cmd);
                assert_eq!(out, "OK", "{cmd:?} on node {}: {out}", node.port);
            }
        }
        for node in &nodes[1..] {
            let out = nodes[0].cli(&["CLUSTER", "MEET", "127.0.0.1", &node.port.to_string()]);
            assert_eq!(out, "OK", "CLUSTER MEET {}: {out}", node.port);
        }
        let known = format!("cluster_known_nodes:{n}");
        for node in &nodes {
            wait_until(
                &format!("node {} to see {n} nodes and every slot", node.port),
                Duration::from_secs(30),
                || {
                    let info = node.cli(&["CLUSTER", "INFO"]);
                    ["cluster_state:ok", "cluster_slots_ok:16384", &known]
                        .iter()
                        .all(|want| info.lines().any(|l| l.trim() == *want))
                },
            );
        }
        RedisCluster { nodes }
    }
}
