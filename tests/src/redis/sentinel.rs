//! A Redis Sentinel started by a test, monitoring one primary.

use super::*;

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
        self.probe().master_port()
    }

    /// What asks this Sentinel which primary it names, from another thread.
    pub fn probe(&self) -> SentinelProbe {
        SentinelProbe {
            port: self.port,
            master: self.master.clone(),
            options: self.options.clone(),
        }
    }

    /// The flags this Sentinel holds on its primary (`SENTINEL MASTER`: `master` at rest; also
    /// `s_down`, `o_down` or `failover_in_progress` while it thinks the primary down or fails it
    /// over), or `None` when it does not answer.
    pub fn master_flags(&self) -> Option<String> {
        let out = self.cli(&["SENTINEL", "MASTER", &self.master]);
        let mut lines = out.lines();
        while let Some(key) = lines.next() {
            if key.trim() == "flags" {
                return lines.next().map(|v| v.trim().to_string());
            }
        }
        None
    }
}

/// A [`Sentinel`]'s address and credentials, to ask it from another thread.
#[derive(Clone)]
pub struct SentinelProbe {
    port: u16,
    master: String,
    options: SentinelOptions,
}

impl SentinelProbe {
    /// The port of the primary the Sentinel names now (`SENTINEL get-master-addr-by-name`).
    pub fn master_port(&self) -> Option<u16> {
        let out = cli_with(
            self.port,
            &self.options.cli_args(),
            &["SENTINEL", "get-master-addr-by-name", &self.master],
        );
        out.lines().nth(1)?.trim().parse().ok()
    }
}
