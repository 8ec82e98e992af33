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

    /// Whether this replica's link to its primary is up (`INFO replication`).
    pub fn linked(&self) -> bool {
        self.cli(&["INFO", "replication"])
            .contains("master_link_status:up")
    }

    /// Waits until this replica's link to its primary is up.
    pub fn wait_linked(&self) {
        wait_until("a replica's link up", READY_TIMEOUT, || self.linked());
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

mod cluster;
mod sentinel;

pub use self::cluster::{even_slot_ranges, node_serving, RedisCluster};
pub use self::sentinel::{Sentinel, SentinelOptions, SentinelProbe};
