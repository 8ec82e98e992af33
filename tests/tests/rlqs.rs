//! Envoy's own quota filter (`envoy/envoy-rlqs.yaml`, RLQS to the sidecar): real Envoys, real
//! sidecars, one Redis. Every scenario loads one bucket (rule `per-ip`, the client 127.0.0.1)
//! from several Envoys and checks the global bound of docs/rlqs.md: over a run of T seconds from
//! a full bucket, everything admitted is at most C + r·T.

use std::collections::VecDeque;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use futures::StreamExt;
use ratelimit_e2e::{http, wait_until, Envoy, EnvoyConfig, Redis, Sidecar, Upstream};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CAPACITY: f64 = 100.0;
const REFILL: f64 = 20.0;

/// The policy: the bucket every scenario loads (C = 100, r = 20/s).
const POLICY: &str = "\
domain: ratelimit
rules:
  per-ip: {capacity: 100, refill_per_sec: 20}
";

/// RLQS grants are sized by the planner, within the lease cap: allow a grant of the whole bucket.
const SIDECAR_ARGS: &[&str] = &["--redis-timeout-ms", "1000"];

fn rlqs_envoy(sidecar_port: u16, upstream: &Upstream) -> Envoy {
    Envoy::start(&EnvoyConfig::shipped(
        "envoy-rlqs.yaml",
        sidecar_port,
        upstream.port,
    ))
}

/// Clients hammering one Envoy until stopped: 200s and 429s counted, anything else is a failure.
struct Clients {
    stop: Arc<AtomicBool>,
    admitted: Arc<AtomicU64>,
    rejected: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl Clients {
    fn start(envoy: &Envoy, threads: usize, pause: Duration) -> Clients {
        let stop = Arc::new(AtomicBool::new(false));
        let admitted = Arc::new(AtomicU64::new(0));
        let rejected = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let url = envoy.url("/api/orders");
        let handles = (0..threads)
            .map(|_| {
                let (stop, admitted, rejected, failed) = (
                    stop.clone(),
                    admitted.clone(),
                    rejected.clone(),
                    failed.clone(),
                );
                let url = url.clone();
                thread::spawn(move || {
                    let client = http();
                    while !stop.load(Ordering::Relaxed) {
                        match client.get(&url).send().map(|r| r.status().as_u16()) {
                            Ok(200) => admitted.fetch_add(1, Ordering::Relaxed),
                            Ok(429) => rejected.fetch_add(1, Ordering::Relaxed),
                            _ => failed.fetch_add(1, Ordering::Relaxed),
                        };
                        thread::sleep(pause);
                    }
                })
            })
            .collect();
        Clients {
            stop,
            admitted,
            rejected,
            failed,
            threads: handles,
        }
    }

    fn admitted(&self) -> u64 {
        self.admitted.load(Ordering::Relaxed)
    }

    /// Stops the clients; (admitted, rejected, failed).
    fn finish(self) -> (u64, u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        (
            self.admitted.load(Ordering::Relaxed),
            self.rejected.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

fn bound(run: Duration) -> f64 {
    CAPACITY + REFILL * run.as_secs_f64()
}

/// Runs load on every Envoy for `run`; asserts the global bound on what reached the upstream.
fn loaded_run(envoys: &[&Envoy], upstream: &Upstream, run: Duration) -> u64 {
    let before = upstream.hits();
    let started = Instant::now();
    let clients: Vec<Clients> = envoys
        .iter()
        .map(|e| Clients::start(e, 3, Duration::from_millis(2)))
        .collect();
    thread::sleep(run);
    let mut admitted = 0;
    let mut rejected = 0;
    for c in clients {
        let (a, r, f) = c.finish();
        assert_eq!(f, 0, "every request was answered 200 or 429");
        admitted += a;
        rejected += r;
    }
    let elapsed = started.elapsed();
    let reached = upstream.hits() - before;
    assert_eq!(reached, admitted, "every 200 reached the upstream");
    println!(
        "{} Envoys, {:.1} s: admitted {admitted}, rejected {rejected}, bound C + r·T = {:.0}",
        envoys.len(),
        elapsed.as_secs_f64(),
        bound(elapsed)
    );
    assert!(
        admitted as f64 <= bound(elapsed),
        "admitted {admitted} > C + r·T = {:.1} over {:?}",
        bound(elapsed),
        elapsed
    );
    assert!(rejected > 0, "the load exceeded the budget");
    admitted
}

#[test]
fn two_envoys_on_one_sidecar_admit_at_most_the_budget() {
    let redis = Redis::start();
    let sidecar = Sidecar::with_policy(&redis.url(), POLICY, SIDECAR_ARGS);
    let upstream = Upstream::start();
    let a = rlqs_envoy(sidecar.port, &upstream);
    let b = rlqs_envoy(sidecar.port, &upstream);
    let run = Duration::from_secs(8);
    let assigned = |strategy: &str| {
        sidecar.metric(&format!(
            "ratelimit_rlqs_assignments_total{{strategy=\"{strategy}\"}}"
        ))
    };
    let admitted = loaded_run(&[&a, &b], &upstream, run);
    // Most of the budget is used: at least the sustained rate over the second half of the run
    // (the first assignment of each bucket follows its first request by one report).
    assert!(
        admitted as f64 >= REFILL * run.as_secs_f64() / 2.0,
        "admitted only {admitted}"
    );
    let (token_buckets, denials) = (assigned("token_bucket"), assigned("deny_all"));
    println!(
        "{} streams; assignments: {token_buckets} token buckets, {denials} DENY_ALL",
        sidecar.metric("ratelimit_rlqs_streams")
    );
    assert_eq!(sidecar.metric("ratelimit_rlqs_streams"), 2.0);
    assert!(token_buckets >= 2.0, "each Envoy got a token bucket");
    // A renewal that the next round can still deliver in time waits for it (TTL 3 s, margin
    // 500 ms, rounds every second: on a quiet machine a bucket is renewed every other second);
    // a late round renews at once. Either way a stream's one bucket is assigned at most once
    // per round: no round repeats an assignment (how many rounds were late is the machine's).
    let rounds = sidecar.metric("ratelimit_rlqs_round_duration_seconds_count");
    println!("{rounds} rounds");
    assert!(
        token_buckets + denials <= rounds,
        "{token_buckets} + {denials} assignments in {rounds} rounds over {run:?}"
    );
}

#[test]
fn two_envoys_with_a_sidecar_each_on_one_redis_admit_at_most_the_budget() {
    let redis = Redis::start();
    let first = Sidecar::with_policy(&redis.url(), POLICY, SIDECAR_ARGS);
    let second = Sidecar::with_policy(&redis.url(), POLICY, SIDECAR_ARGS);
    let upstream = Upstream::start();
    let a = rlqs_envoy(first.port, &upstream);
    let b = rlqs_envoy(second.port, &upstream);
    let admitted = loaded_run(&[&a, &b], &upstream, Duration::from_secs(8));
    assert!(admitted > 0);
}

/// Waits until `clients` admit at least `per_sec` a second over the last `window` (however long
/// that takes on this machine, up to `deadline`); returns how long it took.
fn wait_for_pace(
    clients: &Clients,
    per_sec: f64,
    window: Duration,
    deadline: Duration,
) -> Duration {
    let started = Instant::now();
    let mut seen: VecDeque<(Instant, u64)> = VecDeque::new();
    wait_until(
        &format!("{per_sec:.1} admitted a second over {window:?}"),
        deadline,
        || {
            let (now, admitted) = (Instant::now(), clients.admitted());
            seen.push_back((now, admitted));
            while seen.len() > 1 && now - seen[1].0 >= window {
                seen.pop_front();
            }
            let (then, before) = seen[0];
            let span = now - then;
            span >= window && (admitted - before) as f64 / span.as_secs_f64() >= per_sec
        },
    );
    started.elapsed()
}

/// Envoy 1.40 reports usage every 5 s (docs/rlqs.md, fact 4): the planner learns of a shift by
/// the next report, then moves the assignments. Whatever the machine's speed: once the demand
/// moved, B comes to admit at least half the pace A admitted at when it held the demand (the
/// planner gives the Envoy with the demand the refill), and everything stays within the budget.
#[test]
fn demand_moving_from_one_envoy_to_the_other_moves_the_assignments() {
    let redis = Redis::start();
    let sidecar = Sidecar::with_policy(&redis.url(), POLICY, SIDECAR_ARGS);
    let upstream = Upstream::start();
    let a = rlqs_envoy(sidecar.port, &upstream);
    let b = rlqs_envoy(sidecar.port, &upstream);
    let started = Instant::now();
    // B has a bucket (and an assignment) but little demand; A carries the load. A's pace is
    // measured once its assignment settled (its last 5 s).
    let idle_b = Clients::start(&b, 1, Duration::from_millis(500));
    let busy_a = Clients::start(&a, 3, Duration::from_millis(2));
    thread::sleep(Duration::from_secs(6));
    let (a_from, a_then) = (Instant::now(), busy_a.admitted());
    thread::sleep(Duration::from_secs(5));
    let a_pace = (busy_a.admitted() - a_then) as f64 / a_from.elapsed().as_secs_f64();
    let (a_admitted, _, a_failed) = busy_a.finish();
    let (b_idle_admitted, _, _) = idle_b.finish();
    assert_eq!(a_failed, 0);
    assert!(a_pace > 0.0, "A admitted nothing once settled");
    // The demand moves to B.
    let busy_b = Clients::start(&b, 3, Duration::from_millis(2));
    let moved_after = wait_for_pace(
        &busy_b,
        a_pace / 2.0,
        Duration::from_secs(4),
        Duration::from_secs(90),
    );
    let (b_admitted, _, b_failed) = busy_b.finish();
    assert_eq!(b_failed, 0);
    let elapsed = started.elapsed();
    let total = a_admitted + b_idle_admitted + b_admitted;
    println!(
        "A admitted {a_admitted} ({a_pace:.1}/s once settled); B reached half that pace over 4 s \
         {:.1} s after the shift; total {total}, bound {:.0}",
        moved_after.as_secs_f64(),
        bound(elapsed)
    );
    assert!(
        total as f64 <= bound(elapsed),
        "{total} > {}",
        bound(elapsed)
    );
}

#[test]
fn with_the_sidecar_killed_each_envoy_admits_at_most_its_live_assignment_and_the_fallback() {
    let redis = Redis::start();
    let mut sidecar = Sidecar::with_policy(&redis.url(), POLICY, SIDECAR_ARGS);
    let upstream = Upstream::start();
    let a = rlqs_envoy(sidecar.port, &upstream);
    let b = rlqs_envoy(sidecar.port, &upstream);
    let started = Instant::now();
    let clients = [
        Clients::start(&a, 3, Duration::from_millis(2)),
        Clients::start(&b, 3, Duration::from_millis(2)),
    ];
    thread::sleep(Duration::from_secs(4));
    let before_kill: u64 = clients.iter().map(Clients::admitted).sum();
    let run_before = started.elapsed();
    sidecar.process.stop();
    let killed = Instant::now();
    thread::sleep(Duration::from_secs(8));
    let mut total = 0;
    for c in clients {
        let (a, _, f) = c.finish();
        assert_eq!(f, 0);
        total += a;
    }
    let after_kill = total - before_kill;
    let since_kill = killed.elapsed().as_secs_f64();
    // Per Envoy: its live assignment (within the budget, counted in C + r·T up to the kill plus
    // its TTL and margin) and then the shipped fallback, 10 + 1/s for 60 s; then DENY_ALL.
    let live = bound(run_before + Duration::from_millis(3500));
    let fallback = 2.0 * (10.0 + since_kill);
    println!(
        "before the kill {before_kill}, after {after_kill} in {since_kill:.1} s; \
         bound {live:.0} + fallback {fallback:.0}"
    );
    assert!(
        total as f64 <= live + fallback,
        "admitted {total} > {live:.0} + {fallback:.0}"
    );
}

#[test]
fn a_budget_shared_with_the_wasm_filter_holds_across_both_kinds_of_gateway() {
    let redis = Redis::start();
    let sidecar = Sidecar::with_policy(&redis.url(), POLICY, SIDECAR_ARGS);
    let upstream = Upstream::start();
    let quota = rlqs_envoy(sidecar.port, &upstream);
    // The wasm filter with the rule of the same identity: rule "per-ip", subject ["ip"].
    let wasm = Envoy::start(
        &EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port).plugin(
            &serde_json::to_string_pretty(&json!({
                "domain": "ratelimit",
                "sidecar": {"cluster": "ratelimit_sidecar", "timeout_ms": 5000},
                "identity": {"ip": true},
                "rules": [
                    {"name": "per-ip", "match": {"path_prefix": "/"}, "subject": ["ip"],
                     "on_error": "deny"}
                ]
            }))
            .unwrap(),
        ),
    );
    let admitted = loaded_run(&[&quota, &wasm], &upstream, Duration::from_secs(8));
    assert!(admitted > 0);
}

#[test]
fn a_bucket_of_a_rule_the_policy_lacks_is_refused_never_admitted() {
    let redis = Redis::start();
    let sidecar = Sidecar::with_policy(&redis.url(), POLICY, SIDECAR_ARGS);
    let upstream = Upstream::start();
    let envoy = rlqs_envoy(sidecar.port, &upstream);
    // The route /admin has a bucket of rule `per-route`, which this policy does not define.
    let client = http();
    let url = envoy.url("/admin/users");
    let started = Instant::now();
    let mut statuses = Vec::new();
    while started.elapsed() < Duration::from_secs(3) {
        let status = client
            .get(&url)
            .send()
            .map(|r| r.status().as_u16())
            .unwrap_or(0);
        statuses.push(status);
        thread::sleep(Duration::from_millis(20));
    }
    assert!(statuses.iter().all(|s| *s == 429), "{statuses:?}");
    assert_eq!(upstream.hits(), 0);
    assert!(
        sidecar.process.log().contains("assigned DENY_ALL"),
        "the sidecar says why"
    );
}

#[test]
fn the_quota_stream_is_authenticated_like_the_other_apis() {
    let redis = Redis::start();
    let mut args = SIDECAR_ARGS.to_vec();
    args.extend(["--auth-token", "rlqs-secret-51d0"]);
    let sidecar = Sidecar::with_policy(&redis.url(), POLICY, &args);
    let upstream = Upstream::start();
    let shipped = EnvoyConfig::shipped("envoy-rlqs.yaml", sidecar.port, upstream.port);
    let grpc = "                envoy_grpc: { cluster_name: ratelimit_sidecar }";
    let without = Envoy::start(&shipped);
    let with = Envoy::start(&shipped.clone().replace(
        grpc,
        &format!(
            "{grpc}\n                initial_metadata: [{{ key: authorization, value: \"Bearer rlqs-secret-51d0\" }}]"
        ),
    ));
    let statuses = |envoy: &Envoy| -> Vec<u16> {
        let client = http();
        let url = envoy.url("/api/orders");
        let started = Instant::now();
        let mut out = Vec::new();
        while started.elapsed() < Duration::from_secs(3) {
            out.push(
                client
                    .get(&url)
                    .send()
                    .map(|r| r.status().as_u16())
                    .unwrap_or(0),
            );
            thread::sleep(Duration::from_millis(50));
        }
        out
    };
    // Without the token the stream is refused: no assignment ever comes, DENY_ALL stays.
    let refused = statuses(&without);
    assert!(refused.iter().all(|s| *s == 429), "{refused:?}");
    assert_eq!(upstream.hits(), 0);
    // With it, the bucket is assigned and requests pass.
    let admitted = statuses(&with);
    assert!(admitted.contains(&200), "{admitted:?}");
}

/// `GET /api/orders` through Envoy on `port` from the source address `source` (loopback takes
/// any 127.x.y.z as a client's address): the status, 0 without an answer.
async fn get_from(source: Ipv4Addr, port: u16) -> u16 {
    let exchange = async {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(SocketAddr::from((source, 0)))?;
        let mut stream = socket
            .connect(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
            .await?;
        stream
            .write_all(b"GET /api/orders HTTP/1.1\r\nhost: rlqs\r\nconnection: close\r\n\r\n")
            .await?;
        // The status line is enough (Envoy may hold a closing connection open for a second).
        let mut answer = Vec::new();
        let mut buf = [0u8; 256];
        while !answer.windows(2).any(|w| w == b"\r\n") {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buf[..n]);
        }
        std::io::Result::Ok(answer)
    };
    match tokio::time::timeout(Duration::from_secs(10), exchange).await {
        Ok(Ok(answer)) => std::str::from_utf8(answer.get(9..12).unwrap_or_default())
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0),
        _ => 0,
    }
}

/// One request from each of `sources`, 32 at a time: their statuses, in order.
fn one_request_each(
    runtime: &tokio::runtime::Runtime,
    sources: &[Ipv4Addr],
    port: u16,
) -> Vec<u16> {
    runtime.block_on(
        futures::stream::iter(sources.iter().map(|s| get_from(*s, port)))
            .buffered(32)
            .collect(),
    )
}

/// Envoy reports every bucket it tracks in one message (about 470 KiB for 10,000 buckets by
/// address; the sidecar reads 64 KiB messages): the stream must live on, and every bucket hold
/// an assignment. Before the report splitter, 1,400 buckets made the stream die at every
/// report and no assignment was sent again.
#[test]
fn ten_thousand_buckets_of_one_envoy_all_hold_assignments_on_one_stream() {
    const BUCKETS: usize = 10_000;
    let redis = Redis::start();
    // Generous, so that every bucket's assignment is a token bucket whatever the others take.
    let policy = "domain: ratelimit\nrules:\n  per-ip: {capacity: 1000, refill_per_sec: 100}\n";
    let sidecar = Sidecar::with_policy(&redis.url(), policy, SIDECAR_ARGS);
    let upstream = Upstream::start();
    // An assignment that expired is DENY_ALL here (the shipped fallback, 10 + 1/s, would still
    // admit): a 200 says the bucket holds a live assignment.
    let envoy = Envoy::start(
        &EnvoyConfig::shipped("envoy-rlqs.yaml", sidecar.port, upstream.port).replace(
            "token_bucket: { max_tokens: 10, tokens_per_fill: 1, fill_interval: 1s }",
            "blanket_rule: DENY_ALL",
        ),
    );
    let sources: Vec<Ipv4Addr> = (0..BUCKETS)
        .map(|i| Ipv4Addr::new(127, 1, (i / 250) as u8, (i % 250 + 1) as u8))
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let metric = |name: &str| sidecar.metric(name);
    // Each address's first request makes its bucket (refused: no assignment yet).
    let started = Instant::now();
    let first = one_request_each(&runtime, &sources, envoy.listen_port);
    assert!(first.iter().all(|s| *s == 200 || *s == 429), "{:?}", {
        let mut odd: Vec<u16> = first
            .iter()
            .copied()
            .filter(|s| *s != 200 && *s != 429)
            .collect();
        odd.dedup();
        odd
    });
    let made_in = started.elapsed();
    // Each bucket is assigned: requests from the addresses not admitted yet, until each was
    // (polled as `wait_until` does, up to 2 minutes).
    let mut waiting = sources.clone();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut pause = Duration::from_millis(2);
    while !waiting.is_empty() && Instant::now() < deadline {
        let statuses = one_request_each(&runtime, &waiting, envoy.listen_port);
        waiting = waiting
            .iter()
            .zip(statuses)
            .filter(|(_, s)| *s != 200)
            .map(|(a, _)| *a)
            .collect();
        thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
    let assigned_in = started.elapsed();
    if waiting.is_empty() {
        // Two more reports of every bucket (each over 64 KiB, one every 5 s), so that the
        // assignments live on by their renewals, past a TTL (3 s).
        let split = || metric("ratelimit_rlqs_reports_total{read=\"split\"}");
        let after_assigned = split();
        wait_until(
            "two reports of every bucket",
            Duration::from_secs(120),
            || split() >= after_assigned + 2.0,
        );
    }
    let second = one_request_each(&runtime, &sources, envoy.listen_port);
    let admitted = second.iter().filter(|s| **s == 200).count();
    println!(
        "{BUCKETS} buckets made in {:.1} s, {} of them assigned by {:.1} s; two reports later \
         {admitted} of {BUCKETS} admitted; streams opened \
         {}, reports {} whole and {} split, usages dropped {}/{}/{} (too large, max buckets, \
         unreadable); assignments {} token buckets, {} DENY_ALL; rounds {} ({:.3} s on average), \
         late {}",
        made_in.as_secs_f64(),
        BUCKETS - waiting.len(),
        assigned_in.as_secs_f64(),
        metric("ratelimit_rlqs_streams_opened_total"),
        metric("ratelimit_rlqs_reports_total{read=\"whole\"}"),
        metric("ratelimit_rlqs_reports_total{read=\"split\"}"),
        metric("ratelimit_rlqs_usages_dropped_total{reason=\"too_large\"}"),
        metric("ratelimit_rlqs_usages_dropped_total{reason=\"max_buckets\"}"),
        metric("ratelimit_rlqs_usages_dropped_total{reason=\"unreadable\"}"),
        metric("ratelimit_rlqs_assignments_total{strategy=\"token_bucket\"}"),
        metric("ratelimit_rlqs_assignments_total{strategy=\"deny_all\"}"),
        metric("ratelimit_rlqs_round_duration_seconds_count"),
        metric("ratelimit_rlqs_round_duration_seconds_sum")
            / metric("ratelimit_rlqs_round_duration_seconds_count").max(1.0),
        metric("ratelimit_rlqs_late_rounds_total"),
    );
    let lines = |log: String, needle: &str| -> Vec<String> {
        log.lines()
            .filter(|l| l.contains(needle))
            .map(String::from)
            .collect()
    };
    assert_eq!(
        metric("ratelimit_rlqs_streams_opened_total"),
        1.0,
        "the stream was never reset:\n{:#?}\n{:#?}",
        lines(sidecar.process.log(), "rlqs stream"),
        lines(envoy.process.log(), "RLQS")
    );
    assert!(
        waiting.is_empty(),
        "{} buckets never assigned",
        waiting.len()
    );
    assert_eq!(admitted, BUCKETS, "every bucket holds a live assignment");
    for reason in ["too_large", "max_buckets", "unreadable"] {
        assert_eq!(
            metric(&format!(
                "ratelimit_rlqs_usages_dropped_total{{reason=\"{reason}\"}}"
            )),
            0.0,
            "{reason}"
        );
    }
}

/// envoy-rlqs.yaml once named a tenant's bucket from an `x-tenant` header at the edge: a client
/// rotating 100 values from one address was admitted by 100 buckets. Identity comes from
/// verified facts only: such a client stays in its address's bucket.
#[test]
fn rotating_a_tenant_header_from_one_address_does_not_escape_its_bucket() {
    let redis = Redis::start();
    // Both rules one would reach: the address's, and the tenants' (C = 100, r = 20/s each).
    let policy = "domain: ratelimit\nrules:\n  per-ip: {capacity: 100, refill_per_sec: 20}\n  \
                  per-tenant: {capacity: 100, refill_per_sec: 20}\n";
    let sidecar = Sidecar::with_policy(&redis.url(), policy, SIDECAR_ARGS);
    let upstream = Upstream::start();
    let envoy = rlqs_envoy(sidecar.port, &upstream);
    let url = envoy.url("/api/orders");
    let started = Instant::now();
    let threads: Vec<_> = (0..2)
        .map(|t| {
            let url = url.clone();
            thread::spawn(move || {
                let client = http();
                let (mut admitted, mut other) = (0u64, Vec::new());
                let mut i = t;
                while started.elapsed() < Duration::from_secs(6) {
                    let status = client
                        .get(&url)
                        .header("x-tenant", format!("tenant-{}", i % 100))
                        .send()
                        .map(|r| r.status().as_u16())
                        .unwrap_or(0);
                    match status {
                        200 => admitted += 1,
                        429 => {}
                        s => other.push(s),
                    }
                    i += 2;
                }
                (admitted, other)
            })
        })
        .collect();
    let mut admitted = 0;
    for t in threads {
        let (a, other) = t.join().unwrap();
        assert!(
            other.is_empty(),
            "answers other than 200 and 429: {other:?}"
        );
        admitted += a;
    }
    let elapsed = started.elapsed();
    println!(
        "100 x-tenant values from one address, {:.1} s: admitted {admitted}, bound C + r·T = {:.0}",
        elapsed.as_secs_f64(),
        bound(elapsed)
    );
    assert_eq!(upstream.hits(), admitted);
    assert!(admitted > 0, "the address's bucket admits");
    assert!(
        admitted as f64 <= bound(elapsed),
        "admitted {admitted} > C + r·T = {:.0}: the header named buckets",
        bound(elapsed)
    );
}

/// A token rotated out of `--auth-token-file` ends the quota streams opened with it (the file
/// is checked every 2 s, the stream at its next report or round): before, such a stream went on
/// receiving assignments while `/v1/decide` refused the same token.
#[test]
fn a_stream_whose_token_was_rotated_out_ends_and_the_others_go_on() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "old-token-7c1e\nnew-token-2b9f\n").unwrap();
    let mut args = SIDECAR_ARGS.to_vec();
    let path = tokens.display().to_string();
    args.extend(["--auth-token-file", &path]);
    let sidecar = Sidecar::with_policy(&redis.url(), POLICY, &args);
    let upstream = Upstream::start();
    let with_token = |token: &str| {
        let grpc = "                envoy_grpc: { cluster_name: ratelimit_sidecar }";
        Envoy::start(
            &EnvoyConfig::shipped("envoy-rlqs.yaml", sidecar.port, upstream.port).replace(
                grpc,
                &format!(
                    "{grpc}\n                initial_metadata: [{{ key: authorization, value: \"Bearer {token}\" }}]"
                ),
            ),
        )
    };
    let old = with_token("old-token-7c1e");
    let new = with_token("new-token-2b9f");
    let clients = [
        Clients::start(&old, 1, Duration::from_millis(50)),
        Clients::start(&new, 1, Duration::from_millis(50)),
    ];
    wait_until("both streams assigned", Duration::from_secs(60), || {
        sidecar.metric("ratelimit_rlqs_streams") == 2.0 && clients.iter().all(|c| c.admitted() > 0)
    });
    let opened = sidecar.metric("ratelimit_rlqs_streams_opened_total");
    // The rotation: the new file is swapped in whole, as an operator's tooling does.
    let next = dir.path().join("tokens.new");
    std::fs::write(&next, "new-token-2b9f\n").unwrap();
    std::fs::rename(&next, &tokens).unwrap();
    let rotated = Instant::now();
    wait_until("the revoked stream to end", Duration::from_secs(60), || {
        sidecar.metric("ratelimit_rlqs_streams") == 1.0
    });
    let ended_after = rotated.elapsed();
    // Envoy opens the stream again (at its next report) with the same token: refused.
    let attempts = || old.counter("cluster.ratelimit_sidecar.upstream_rq_total");
    let ended_at = attempts();
    wait_until(
        "the old Envoy to try again",
        Duration::from_secs(60),
        || attempts() > ended_at,
    );
    // The stream of the token still accepted goes on being assigned.
    let assigned = || sidecar.metric("ratelimit_rlqs_assignments_total{strategy=\"token_bucket\"}");
    let before = assigned();
    wait_until(
        "assignments on the other stream",
        Duration::from_secs(60),
        || assigned() > before,
    );
    println!(
        "the revoked stream ended {:.1} s after the rotation; the old Envoy tried {} streams in \
         all; streams open {}, opened {} (before the rotation {opened})",
        ended_after.as_secs_f64(),
        attempts(),
        sidecar.metric("ratelimit_rlqs_streams"),
        sidecar.metric("ratelimit_rlqs_streams_opened_total"),
    );
    assert_eq!(sidecar.metric("ratelimit_rlqs_streams"), 1.0);
    assert_eq!(
        sidecar.metric("ratelimit_rlqs_streams_opened_total"),
        opened,
        "the old token opens no stream again"
    );
    assert!(sidecar
        .process
        .log()
        .contains("its bearer token is no longer accepted"));
    for c in clients {
        let (_, _, failed) = c.finish();
        assert_eq!(failed, 0);
    }
}
