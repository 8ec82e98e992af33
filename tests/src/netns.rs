//! Separate hosts on one machine: network namespaces ([`Netns`]) joined by veth pairs ([`link`]),
//! and a delay on the hop between two of them, by `tc netem` where the kernel has it ([`netem`])
//! or by a userspace relay that holds every byte for a set time in each direction
//! ([`DelayRelay`]). Needs root and `ip`/`tc` (iproute2).
//!
//! A namespace is deleted when its [`Netns`] is dropped (after killing what still runs in it),
//! and every namespace still alive can be removed from a signal handler ([`remove_all`]), so an
//! interrupted run leaves nothing behind. Names carry the process id and a counter, so two runs
//! (or two tests) never collide; interfaces and addresses live inside the namespaces, so every
//! run can use the same ones.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sched::CloneFlags;

/// The namespaces of this process still alive, for [`remove_all`].
static LIVE: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Runs `ip` with `args`; panics with its stderr when it fails.
pub fn ip(args: &[&str]) {
    run_tool("ip", args);
}

/// Runs `tc` with `args`; its stderr when it fails.
pub fn tc(args: &[&str]) -> Result<(), String> {
    let out = Command::new("tc")
        .args(args)
        .output()
        .map_err(|e| format!("run tc: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

fn run_tool(tool: &str, args: &[&str]) {
    let out = Command::new(tool)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {tool} (iproute2 installed? root?): {e}"));
    assert!(
        out.status.success(),
        "{tool} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// One network namespace with its loopback up; deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// A new namespace named `rl-<tag>-<pid>-<n>`.
    pub fn create(tag: &str) -> Netns {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "rl-{tag}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        // Registered before it exists, so a signal arriving meanwhile still removes it.
        LIVE.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(name.clone());
        ip(&["netns", "add", &name]);
        let ns = Netns { name };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    /// `program` to be run inside the namespace (`ip netns exec <name> <program>`, which execs
    /// it: the child's pid is the program's).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }

    /// Moves the calling thread into the namespace: the sockets it opens from now on, and the
    /// threads it starts, are the namespace's.
    pub fn enter(&self) {
        enter(&self.name);
    }

    /// Runs `f` on a thread inside the namespace and returns its result (a panic in `f` is
    /// resumed here).
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        std::thread::scope(|s| {
            s.spawn(|| {
                self.enter();
                f()
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    /// The processes whose network namespace this is (`ip netns pids`).
    pub fn pids(&self) -> Vec<u32> {
        pids(&self.name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        remove(&self.name);
        LIVE.lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|n| n != &self.name);
    }
}

/// Moves the calling thread into namespace `name` ([`Netns::enter`]).
pub fn enter(name: &str) {
    let path = format!("/run/netns/{name}");
    let file = File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
    nix::sched::setns(&file, CloneFlags::CLONE_NEWNET)
        .unwrap_or_else(|e| panic!("setns into {name}: {e}"));
}

fn pids(name: &str) -> Vec<u32> {
    Command::new("ip")
        .args(["netns", "pids", name])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Kills what still runs in the namespace (never this process), then deletes it.
fn remove(name: &str) {
    let me = std::process::id();
    for pid in pids(name).into_iter().filter(|p| *p != me) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let _ = Command::new("ip").args(["netns", "del", name]).output();
}

/// Calls `on_signal` at each Ctrl-C or SIGTERM, from a thread of its own: for a binary that
/// creates namespaces, which must [`remove_all`] before it exits.
pub fn on_interrupt(mut on_signal: impl FnMut() + Send + 'static) {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("signal runtime");
        rt.block_on(async {
            use tokio::signal::unix::{signal, SignalKind};
            let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
            loop {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
                on_signal();
            }
        });
    });
}

/// Removes every namespace this process created and has not dropped yet: for a signal handler
/// that is about to exit (Drop will not run).
pub fn remove_all() {
    let names: Vec<String> = std::mem::take(&mut *LIVE.lock().unwrap_or_else(|e| e.into_inner()));
    for name in names {
        remove(&name);
    }
}

/// True when a namespace of that name exists (`ip netns list`).
pub fn exists(name: &str) -> bool {
    Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l.split_whitespace().next() == Some(name))
        })
        .unwrap_or(false)
}

/// A veth pair between two namespaces: `a_dev` in `a` with `a_cidr` (e.g. `10.77.1.1/24`),
/// `b_dev` in `b` with `b_cidr`, both up. Deleted with either namespace.
pub fn link(a: &Netns, a_dev: &str, a_cidr: &str, b: &Netns, b_dev: &str, b_cidr: &str) {
    ip(&[
        "-n", &a.name, "link", "add", a_dev, "type", "veth", "peer", "name", b_dev, "netns",
        &b.name,
    ]);
    for (ns, dev, cidr) in [(a, a_dev, a_cidr), (b, b_dev, b_cidr)] {
        ip(&["-n", &ns.name, "addr", "add", cidr, "dev", dev]);
        ip(&["-n", &ns.name, "link", "set", dev, "up"]);
    }
}

/// Sets a `tc netem` delay of `one_way` on the egress of `dev` in `ns` (0 removes it). Err with
/// tc's message when the kernel has no netem (`Specified qdisc kind is unknown`).
pub fn netem(ns: &Netns, dev: &str, one_way: Duration) -> Result<(), String> {
    if one_way.is_zero() {
        // Nothing to remove is fine.
        let _ = tc(&["-n", &ns.name, "qdisc", "del", "dev", dev, "root"]);
        return Ok(());
    }
    let delay = format!("{}us", one_way.as_micros());
    tc(&[
        "-n", &ns.name, "qdisc", "replace", "dev", dev, "root", "netem", "delay", &delay,
    ])
}

/// How late the relay's writes were against their due time: what a delay of `d` really was
/// (`d` plus this), so a report can say how exact the emulated hop is.
#[derive(Debug, Default)]
pub struct Lateness {
    sum_ns: AtomicU64,
    count: AtomicU64,
    max_ns: AtomicU64,
}

impl Lateness {
    fn record(&self, late: Duration) {
        let ns = late.as_nanos() as u64;
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.max_ns.fetch_max(ns, Ordering::Relaxed);
    }

    /// (mean, max) since the last reset, and the number of writes.
    pub fn take(&self) -> (Duration, Duration, u64) {
        let sum = self.sum_ns.swap(0, Ordering::Relaxed);
        let count = self.count.swap(0, Ordering::Relaxed);
        let max = self.max_ns.swap(0, Ordering::Relaxed);
        (
            Duration::from_nanos(sum / count.max(1)),
            Duration::from_nanos(max),
            count,
        )
    }
}

/// A TCP relay inside a namespace that forwards every connection to `target` and holds each
/// chunk of bytes for the set one-way delay in each direction before writing it on: a network
/// delay in userspace, for kernels without `sch_netem`. Bytes keep their order; there is no
/// bandwidth limit or loss. The hold is timed by a thread sleeping with a 1 ns timer slack, so
/// it is late by the machine's wake-up latency ([`DelayRelay::lateness`] measures it); a
/// 0 delay still costs one thread hand-off per chunk, so compare delays against the relay at 0,
/// not against a direct connection.
pub struct DelayRelay {
    pub addr: SocketAddr,
    one_way_ns: Arc<AtomicU64>,
    lateness: Arc<Lateness>,
    stop: Arc<AtomicBool>,
    streams: Arc<Mutex<Vec<TcpStream>>>,
    acceptor: Option<JoinHandle<()>>,
}

impl DelayRelay {
    /// Listens on `listen` inside `ns` and relays to `target` (also reached from inside `ns`).
    pub fn start(ns: &Netns, listen: SocketAddr, target: SocketAddr) -> DelayRelay {
        let one_way_ns = Arc::new(AtomicU64::new(0));
        let lateness = Arc::new(Lateness::default());
        let stop = Arc::new(AtomicBool::new(false));
        let streams = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = mpsc::channel();
        let name = ns.name.clone();
        let acceptor = {
            let (one_way_ns, lateness, stop, streams) = (
                one_way_ns.clone(),
                lateness.clone(),
                stop.clone(),
                streams.clone(),
            );
            std::thread::spawn(move || {
                enter(&name);
                let listener = match TcpListener::bind(listen) {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("bind {listen} in {name}: {e}")));
                        return;
                    }
                };
                listener
                    .set_nonblocking(true)
                    .expect("nonblocking listener");
                let _ = ready_tx.send(Ok(listener.local_addr().expect("local addr")));
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((client, _)) => {
                            let _ = client.set_nonblocking(false);
                            let Ok(server) = TcpStream::connect(target) else {
                                continue; // the client sees its connection closed
                            };
                            for s in [&client, &server] {
                                let _ = s.set_nodelay(true);
                                if let Ok(c) = s.try_clone() {
                                    streams.lock().unwrap_or_else(|e| e.into_inner()).push(c);
                                }
                            }
                            let (c2, s2) = (
                                client.try_clone().expect("clone"),
                                server.try_clone().expect("clone"),
                            );
                            pipe(client, server, one_way_ns.clone(), lateness.clone());
                            pipe(s2, c2, one_way_ns.clone(), lateness.clone());
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
        };
        let addr = ready_rx
            .recv()
            .expect("relay thread answers")
            .unwrap_or_else(|e| panic!("{e}"));
        DelayRelay {
            addr,
            one_way_ns,
            lateness,
            stop,
            streams,
            acceptor: Some(acceptor),
        }
    }

    /// Sets the round trip this hop adds: half of it in each direction, from the next chunk on.
    pub fn set_round_trip(&self, rtt: Duration) {
        self.one_way_ns
            .store((rtt / 2).as_nanos() as u64, Ordering::Relaxed);
    }

    /// How late the writes were since the last call: (mean, max, writes).
    pub fn lateness(&self) -> (Duration, Duration, u64) {
        self.lateness.take()
    }
}

impl Drop for DelayRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for s in self
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

/// One direction of a relayed connection: a reader stamping each chunk with its due time, a
/// writer sending it on once due. The writer closes its side when the reader sees the end.
fn pipe(
    mut from: TcpStream,
    mut to: TcpStream,
    one_way_ns: Arc<AtomicU64>,
    lateness: Arc<Lateness>,
) {
    let (tx, rx) = mpsc::channel::<Option<(Instant, Vec<u8>)>>();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => {
                    let _ = tx.send(None);
                    return;
                }
                Ok(n) => {
                    let due =
                        Instant::now() + Duration::from_nanos(one_way_ns.load(Ordering::Relaxed));
                    if tx.send(Some((due, buf[..n].to_vec()))).is_err() {
                        return;
                    }
                }
            }
        }
    });
    std::thread::spawn(move || {
        // Sleep to the microsecond rather than the default 50 µs slack.
        let _ = nix::sys::prctl::set_timerslack(1);
        while let Ok(Some((due, bytes))) = rx.recv() {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            lateness.record(Instant::now().saturating_duration_since(due));
            if to.write_all(&bytes).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}
