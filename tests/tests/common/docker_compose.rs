//! The compose files under `envoy/` started for real: Docker Compose v2 (`scripts/compose.sh`, the
//! binary `scripts/install-container-deps.sh` installs) against a running Docker daemon, with the
//! images `make images` builds offline and names in `target/images/images.env`. `make
//! compose-test` installs what is missing, starts a daemon when none runs and builds the images
//! before it runs these tests (they are `#[ignore]`d in a plain `cargo test`).
//!
//! A [`Project`] is one compose file with a token of its own in the environment, as the files'
//! headers tell a user, and its own copy of the policy file, in a directory of its own (`POLICY_DIR`). It is brought down
//! on drop (containers, networks, volumes), and when the test is failing the end of every
//! service's log is printed first.

#![allow(dead_code)] // each test file uses a part

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use ratelimit_e2e::{http, wait_until, workspace_root};

/// One compose file, started by [`Project::up`] and brought down on drop.
pub struct Project {
    /// The project name (the file's top-level `name:`), the prefix of its containers.
    pub name: String,
    file: PathBuf,
    env: Vec<(String, String)>,
    /// The bearer token the sidecars require and the filters present.
    pub token: String,
    /// The policy file the sidecars mount (a copy of `envoy/limits.yaml` unless the test wrote
    /// another).
    pub policy: PathBuf,
    _dir: tempfile::TempDir,
    started: bool,
}

impl Project {
    /// `envoy/<file>`, not started yet. Fails when the images of `make images` are missing.
    pub fn new(file: &str) -> Project {
        let root = workspace_root();
        let path = root.join("envoy").join(file);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let name = text
            .lines()
            .find_map(|l| l.strip_prefix("name: "))
            .unwrap_or_else(|| panic!("{file} has no top-level name:"))
            .trim()
            .to_string();
        let images = root.join("target/images/images.env");
        let images = std::fs::read_to_string(&images).unwrap_or_else(|e| {
            panic!(
                "{}: {e}: build the images first (make images; make compose-test does)",
                images.display()
            )
        });
        let dir = tempfile::tempdir().expect("temp dir");
        let policy = dir.path().join("limits.yaml");
        std::fs::copy(root.join("envoy/limits.yaml"), &policy).expect("copy envoy/limits.yaml");
        let token = random_hex(32);
        let mut env: Vec<(String, String)> = images
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        env.push(("RATELIMIT_AUTH_TOKEN".into(), token.clone()));
        env.push(("POLICY_DIR".into(), dir.path().display().to_string()));
        Project {
            name,
            file: path,
            env,
            token,
            policy,
            _dir: dir,
            started: false,
        }
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(workspace_root().join("scripts/compose.sh"));
        cmd.arg("-f").arg(&self.file);
        // Nothing of the caller's environment decides what the file sees.
        for var in [
            "COMPOSE_FILE",
            "COMPOSE_PROJECT_NAME",
            "COMPOSE_PROFILES",
            "REDIS_IMAGE",
            "UPSTREAM_IMAGE",
            "ENVOY_IMAGE",
        ] {
            cmd.env_remove(var);
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    /// Runs `docker compose <args>` on this file; its output, or a panic with it.
    pub fn compose(&self, args: &[&str]) -> String {
        let out = self
            .command()
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("run scripts/compose.sh: {e}"));
        checked(&format!("docker compose {}", args.join(" ")), out)
    }

    /// `docker compose up --wait`: every service started and healthy (a service that fails its
    /// health check fails the test, with the logs). Returns how long it took.
    pub fn up(&mut self) -> Duration {
        let start = Instant::now();
        self.started = true;
        self.compose(&["up", "--wait", "--wait-timeout", "180"]);
        start.elapsed()
    }

    /// The id of a service's container (running or not).
    pub fn container(&self, service: &str) -> String {
        let id = self.compose(&["ps", "--all", "--quiet", service]);
        let id = id.trim();
        assert!(
            !id.is_empty() && !id.contains('\n'),
            "one container for {service}: {id:?}"
        );
        id.to_string()
    }

    /// `docker inspect --format <format>` of a service's container.
    pub fn inspect(&self, service: &str, format: &str) -> String {
        docker(&["inspect", "--format", format, &self.container(service)])
            .trim()
            .to_string()
    }

    /// A service container's address on one of the project's networks (`gateway-a`, ...).
    pub fn address(&self, service: &str, network: &str) -> String {
        let format = format!(
            "{{{{(index .NetworkSettings.Networks \"{}_{network}\").IPAddress}}}}",
            self.name
        );
        let ip = self.inspect(service, &format);
        assert!(!ip.is_empty(), "{service} has no address on {network}");
        ip
    }

    /// The full name of one of the project's networks.
    pub fn network(&self, network: &str) -> String {
        format!("{}_{network}", self.name)
    }

    /// The process id, on this machine, of a service's main process (0 when it is not running).
    pub fn pid(&self, service: &str) -> u32 {
        self.inspect(service, "{{.State.Pid}}")
            .parse()
            .expect("a pid")
    }

    /// How often Docker restarted a service's container.
    pub fn restarts(&self, service: &str) -> u32 {
        self.inspect(service, "{{.RestartCount}}")
            .parse()
            .expect("a count")
    }

    /// When a service's container last started (Docker's timestamp).
    pub fn started_at(&self, service: &str) -> String {
        self.inspect(service, "{{.State.StartedAt}}")
    }

    /// Writes the policy file in place (the same inode).
    pub fn write_policy(&self, policy: &str) {
        std::fs::write(&self.policy, policy).expect("write the policy file");
    }

    /// Replaces the policy file as many editors and `git checkout` do: a new file renamed over
    /// it (a new inode, which a single-file bind mount would never show the container).
    pub fn replace_policy(&self, policy: &str) {
        let next = self.policy.with_extension("yaml.new");
        std::fs::write(&next, policy).expect("write the new policy file");
        std::fs::rename(&next, &self.policy).expect("rename it over the policy file");
    }

    /// `redis-cli <args>` inside a service's container.
    pub fn redis_cli(&self, service: &str, args: &[&str]) -> String {
        let mut all = vec!["exec", "-T", service, "redis-cli"];
        all.extend_from_slice(args);
        self.compose(&all)
    }

    /// What Docker still has of this project: containers, networks and volumes by its label.
    pub fn leftovers(&self) -> Vec<String> {
        let label = format!("label=com.docker.compose.project={}", self.name);
        let mut left = Vec::new();
        for (kind, args) in [
            (
                "container",
                vec!["ps", "--all", "--filter", &label, "--format", "{{.Names}}"],
            ),
            (
                "network",
                vec!["network", "ls", "--filter", &label, "--format", "{{.Name}}"],
            ),
            (
                "volume",
                vec!["volume", "ls", "--filter", &label, "--format", "{{.Name}}"],
            ),
        ] {
            for line in docker(&args).lines().filter(|l| !l.trim().is_empty()) {
                left.push(format!("{kind} {line}"));
            }
        }
        left
    }

    /// `docker compose down --volumes`, then nothing of the project may be left.
    pub fn down(&mut self) -> Duration {
        let start = Instant::now();
        self.compose(&["down", "--volumes", "--remove-orphans"]);
        self.started = false;
        let took = start.elapsed();
        let left = self.leftovers();
        assert!(left.is_empty(), "docker compose down left {left:?}");
        took
    }
}

impl Drop for Project {
    fn drop(&mut self) {
        if !self.started {
            return;
        }
        if std::thread::panicking() {
            let out = self
                .command()
                .args(["ps", "--all"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            eprintln!("---- docker compose ps ({}) ----\n{out}", self.name);
            let logs = self
                .command()
                .args(["logs", "--no-color", "--tail", "40"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            eprintln!(
                "---- the last lines of every service ({}) ----\n{logs}",
                self.name
            );
        }
        let _ = self
            .command()
            .args(["down", "--volumes", "--remove-orphans", "--timeout", "5"])
            .output();
    }
}

/// Runs the Docker CLI; its output, or a panic with it.
pub fn docker(args: &[&str]) -> String {
    let out = Command::new("docker")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run docker (scripts/install-container-deps.sh): {e}"));
    checked(&format!("docker {}", args.join(" ")), out)
}

fn checked(what: &str, out: Output) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `n` random bytes as hex, from the kernel.
fn random_hex(n: usize) -> String {
    use std::io::Read;
    let mut bytes = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .expect("read /dev/urandom");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Fails unless nothing listens on the host ports a compose file publishes (another stack, or
/// `make run`, would take the test's traffic).
pub fn ports_free(ports: &[u16]) {
    for &port in ports {
        assert!(
            !ratelimit_e2e::port_open(port),
            "127.0.0.1:{port} is taken: something else listens where the compose file publishes \
             (make run? another compose stack?)"
        );
    }
}

/// One counter of an Envoy's filter (`ratelimit.<name>`) through its admin port; 0 when absent.
pub fn filter_counter(admin_port: u16, name: &str) -> u64 {
    let text = http()
        .get(format!(
            "http://127.0.0.1:{admin_port}/stats?filter=wasmcustom"
        ))
        .send()
        .and_then(|r| r.text())
        .unwrap_or_else(|e| panic!("Envoy admin :{admin_port}: {e}"));
    let want = format!("wasmcustom.ratelimit.{name}: ");
    text.lines()
        .find_map(|l| l.strip_prefix(&want))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// One Envoy statistic by its full name (`cluster.demo_upstream.upstream_rq_200`); 0 when absent.
pub fn envoy_stat(admin_port: u16, name: &str) -> u64 {
    let text = http()
        .get(format!("http://127.0.0.1:{admin_port}/stats"))
        .send()
        .and_then(|r| r.text())
        .unwrap_or_else(|e| panic!("Envoy admin :{admin_port}: {e}"));
    let want = format!("{name}: ");
    text.lines()
        .find_map(|l| l.strip_prefix(&want))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The sidecar's Prometheus text from its admin listener published on the host.
pub fn sidecar_metrics(port: u16) -> String {
    http()
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .and_then(|r| r.text())
        .unwrap_or_else(|e| panic!("sidecar /metrics on :{port}: {e}"))
}

/// The value of the first metric line starting with `prefix`; 0 when absent.
pub fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Waits until Envoy's admin `/ready` answers 200 on `admin_port`.
pub fn wait_envoy_ready(admin_port: u16) {
    wait_until(
        &format!("Envoy's /ready on :{admin_port}"),
        Duration::from_secs(60),
        || {
            http()
                .get(format!("http://127.0.0.1:{admin_port}/ready"))
                .send()
                .map(|r| r.status() == 200)
                .unwrap_or(false)
        },
    );
}

/// Kills a process of this machine by its id (a container's main process: Docker sees it die,
/// as in a crash, and applies the restart policy).
pub fn kill_process(pid: u32) {
    assert!(pid > 0, "no process to kill");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap_or_else(|e| panic!("kill {pid}: {e}"));
}

/// The path of a file of the workspace, for messages.
pub fn shown(path: &Path) -> String {
    path.strip_prefix(workspace_root())
        .unwrap_or(path)
        .display()
        .to_string()
}
