//! A region's Redis restored from an older snapshot (`docs/regions.md`, "A record restored from
//! an older state"), run through the real processes: two Redis, a sidecar per region, the
//! rebalancer. One regional rule, `C` = 100 tokens, `R` = 10 tokens/s, shares 0.5/0.5; the
//! rebalancer moves them to 0.2 (us) / 0.8 (eu); us's Redis is then restarted from a snapshot
//! taken before the move, so its record is back at version 1, share 0.5. A fresh key is asked far
//! more than the budget in both regions at once, after the restore and again after the
//! rebalancer's repair. Shared by `tests/tests/regions_restore.rs` (which asserts) and
//! `make reliability` (which prints the row).

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::{http, wait_until, workspace_root, Redis, Sidecar};

pub const CAPACITY: f64 = 100.0;
pub const REFILL: f64 = 10.0;
/// The rebalancer's default `fence_margin_ms`, in seconds: what the design allows clocks and
/// reads, added to a burst's length in its bound.
pub const FENCE_MARGIN_S: f64 = 0.5;
/// The rule's `region_floor` (the default).
pub const FLOOR: f64 = 0.05;
/// Requests of the fresh key per region.
pub const ASKED: usize = 150;

/// eu's share record.
const SHARE_KEY: &str = "rl:share:{ratelimit|global}";

const POLICY: &str = "\
rules:
  global:
    capacity: 100
    refill_per_sec: 10
    regions: {eu: 0.5, us: 0.5}
";

/// The rebalancer binary: `RATELIMIT_REBALANCER_BIN`, else the workspace's release build.
pub fn rebalancer_bin() -> std::path::PathBuf {
    let p = std::env::var_os("RATELIMIT_REBALANCER_BIN")
        .map(Into::into)
        .unwrap_or_else(|| workspace_root().join("target/release/ratelimit-rebalancer"));
    assert!(
        p.exists(),
        "the rebalancer binary not found at {} (set RATELIMIT_REBALANCER_BIN, or run `make build`)",
        p.display()
    );
    p
}

/// What a fresh key was admitted in each region, asked [`ASKED`] times in each at once.
#[derive(Debug, Clone, Copy)]
pub struct Burst {
    pub eu: usize,
    pub us: usize,
    /// From the first send to the last answer.
    pub seconds: f64,
}

impl Burst {
    pub fn total(&self) -> usize {
        self.eu + self.us
    }

    /// What one global bucket (C, R) admits over the burst, with the fence's margin:
    /// `C + R·(T + margin)`.
    pub fn bound(&self) -> f64 {
        CAPACITY + REFILL * (self.seconds + FENCE_MARGIN_S)
    }
}

/// What a run saw.
#[derive(Debug, Clone)]
pub struct RestoreRun {
    /// The rebalancer's plan line (the move).
    pub plan: String,
    /// eu's and us's shares after the move.
    pub moved: (f64, f64),
    /// us's `/readyz` entry for the rule after its sidecar read the restored record.
    pub restored: Value,
    /// The fresh key after the restore.
    pub after_restore: Burst,
    /// `/readyz` of a us sidecar started after the restore.
    pub restarted: Value,
    /// us's `ratelimit_regional_share_suspect_total` before the repair.
    pub suspect_episodes: f64,
    /// The repair round's log says it did not trust the record.
    pub repair_logged: bool,
    /// From the restore until both us sidecars read the repaired record.
    pub repaired_after: Duration,
    /// us's `/readyz` entry after the repair.
    pub repaired: Value,
    /// A second fresh key after the repair.
    pub after_repair: Burst,
}

/// One round of `ratelimit-rebalancer --once` over both regions; its log.
fn rebalance(eu: &Redis, us: &Redis, extra: &[&str]) -> String {
    let dir = tempfile::tempdir().expect("temp dir");
    let policy = dir.path().join("limits.yaml");
    std::fs::write(&policy, POLICY).expect("write the policy");
    let out = Command::new(rebalancer_bin())
        .arg("--limits")
        .arg(&policy)
        .arg("--once")
        .args(["--region", &format!("eu={}", eu.url())])
        .args(["--region", &format!("us={}", us.url())])
        .args(extra)
        .env("RUST_LOG", "info")
        .output()
        .expect("run the rebalancer");
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "the rebalancer failed:\n{log}");
    log
}

fn sidecar(redis: &Redis, region: &str) -> Sidecar {
    Sidecar::with_policy(
        &redis.url(),
        POLICY,
        &["--region", region, "--redis-timeout-ms", "500"],
    )
}

/// The rule's entry in the sidecar's `/readyz`.
pub fn share_status(sidecar: &Sidecar) -> Value {
    let body: Value = http()
        .get(format!("{}/readyz", sidecar.base_url()))
        .send()
        .and_then(|r| r.json())
        .unwrap_or(Value::Null);
    body["regional_shares"][0].clone()
}

fn version(sidecar: &Sidecar) -> u64 {
    share_status(sidecar)["version"].as_u64().unwrap_or(0)
}

fn share(sidecar: &Sidecar) -> f64 {
    share_status(sidecar)["share"].as_f64().unwrap_or(f64::NAN)
}

/// `n` requests of one decision each for `app` in one call: how many were admitted.
fn burst(client: &reqwest::blocking::Client, sidecar: &Sidecar, app: &str, n: usize) -> usize {
    let requests: Vec<Value> = (0..n)
        .map(|_| json!({"decisions": [{"rule": "global", "subject": {"app": app}}]}))
        .collect();
    let answer: Value = client
        .post(format!("{}/v1/decide", sidecar.base_url()))
        .json(&json!({ "requests": requests }))
        .send()
        .and_then(|r| r.json())
        .expect("an answer to /v1/decide");
    answer["answers"]
        .as_array()
        .map_or(0, |a| a.iter().filter(|a| a["allowed"] == true).count())
}

/// Redis's clock, in milliseconds (the clock share histories are stamped with).
fn redis_ms(redis: &Redis) -> u64 {
    let (secs, micros): (u64, u64) = ::redis::cmd("TIME")
        .query(&mut redis.connection())
        .expect("TIME");
    secs * 1000 + micros / 1000
}

/// Waits until the last change of `redis`'s share record is older than a fresh bucket's look-back
/// (the fill time `C / R` and the script's 1 s margin): before, a fresh key is still taken under
/// the smaller share in force before that change (`docs/regions.md`, "The bound").
fn wait_past_look_back(redis: &Redis) {
    let history: String = ::redis::cmd("HGET")
        .arg(SHARE_KEY)
        .arg("history")
        .query(&mut redis.connection())
        .expect("HGET history");
    let last_ms: u64 = history
        .rsplit(',')
        .next()
        .and_then(|c| c.split(':').next())
        .and_then(|t| t.parse().ok())
        .expect("a history of <from_ms>:<ppm> changes");
    let look_back_ms = (CAPACITY / REFILL * 1000.0) as u64 + 1_000 + 100;
    wait_until(
        "the move to be older than a fresh bucket's look-back",
        Duration::from_millis(look_back_ms + 5_000),
        || redis_ms(redis) > last_ms + look_back_ms,
    );
}

fn fresh_key(eu: &Sidecar, us: &Sidecar, app: &str) -> Burst {
    let start = Instant::now();
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| burst(&http(), eu, app, ASKED));
        let b = s.spawn(|| burst(&http(), us, app, ASKED));
        (a.join().expect("eu's burst"), b.join().expect("us's burst"))
    });
    Burst {
        eu: a,
        us: b,
        seconds: start.elapsed().as_secs_f64(),
    }
}

/// Runs the scenario (about 20 s); panics if a process or a step fails.
pub fn run() -> RestoreRun {
    let (eu_redis, mut us_redis) = (Redis::start(), Redis::start());
    let (eu, us) = (sidecar(&eu_redis, "eu"), sidecar(&us_redis, "us"));
    let read_within = Duration::from_secs(15);

    // The rebalancer's first round creates both records (v1, 0.5 each): nothing to move yet.
    rebalance(&eu_redis, &us_redis, &["--observe-ms", "200"]);
    wait_until("both sidecars read the records", read_within, || {
        version(&eu) == 1 && version(&us) == 1
    });
    // Redis's default persistence: a snapshot of us taken before the move.
    let before = us_redis.snapshot();

    // eu rejects (a flood on another key) and us asks nothing: the rebalancer moves 0.3 of the
    // budget from us to eu (shrink, fence, grow).
    let flooding = std::sync::atomic::AtomicBool::new(true);
    let log = std::thread::scope(|s| {
        s.spawn(|| {
            let client = http();
            while flooding.load(std::sync::atomic::Ordering::SeqCst) {
                burst(&client, &eu, "flood", 20);
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let log = rebalance(
            &eu_redis,
            &us_redis,
            &["--observe-ms", "3000", "--step-fraction", "0.6666667"],
        );
        flooding.store(false, std::sync::atomic::Ordering::SeqCst);
        log
    });
    let plan = log
        .lines()
        .find(|l| l.contains("round planned"))
        .unwrap_or_default()
        .to_string();
    wait_until("both sidecars read the moved shares", read_within, || {
        version(&eu) == 2 && version(&us) == 2
    });
    let moved = (share(&eu), share(&us));

    // us's Redis restarts from the snapshot: its record is back at v1, 0.5.
    us_redis.restart_from(&before);
    let restored_at = Instant::now();
    wait_until("us's sidecar read the restored record", read_within, || {
        version(&us) == 1
    });
    let restored = share_status(&us);
    wait_past_look_back(&eu_redis);
    let after_restore = fresh_key(&eu, &us, "fresh");
    let restarted_sidecar = sidecar(&us_redis, "us");
    let restarted = share_status(&restarted_sidecar);
    let suspect_episodes = us.metric("ratelimit_regional_share_suspect_total");

    // The next round of a rebalancer writes us's share again, by the live process: the share
    // eu's envelope leaves (0.2), above every version it saw (a rebalancer started afresh saw
    // only the restored v1: v2).
    let log = rebalance(&eu_redis, &us_redis, &["--observe-ms", "200"]);
    wait_until(
        "us's sidecars read the repaired record",
        read_within,
        || version(&us) >= 2 && version(&restarted_sidecar) >= 2,
    );
    let repaired_after = restored_at.elapsed();
    let repaired = share_status(&us);
    let after_repair = fresh_key(&eu, &us, "fresh-after-repair");
    RestoreRun {
        plan,
        moved,
        restored,
        after_restore,
        restarted,
        suspect_episodes,
        repair_logged: log.contains("share record not trusted"),
        repaired_after,
        repaired,
        after_repair,
    }
}
