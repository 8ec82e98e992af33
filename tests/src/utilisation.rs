//! Redis held at a utilisation, as a fleet keeps it: many connections, each sending one decision
//! per call, paced so that redis-server's CPU stays near a target share of one core; what a
//! decision costs Redis at that load. An idle Redis pays for waking up at every call, a busy one
//! much less, so the cost at the utilisation a capacity model plans for is the figure the model
//! needs (`make scale`, part 5; docs/scaling.md#the-shard-model).
//!
//! Three kinds of work, measured in the same run: the bucket script with one decision per call,
//! as the sidecar sends a lone decision (`lua/single.lua`), and as the long script
//! (`bucket.lua` + `apply.lua`) that calls with leases, shares or records take (on `keys`
//! buckets, every decision admitted and written); and the peer's work, one `INCR` per decision
//! on as many keys.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::probe::cpu_seconds;
use crate::script_cost::{apply_call, single_call, APPLY, SINGLE};
use crate::Redis;

/// What each call does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// The script a lone decision runs (`lua/single.lua`).
    Single,
    /// The long apply script (`bucket.lua` + `apply.lua`), one decision per call.
    Script,
    /// One `INCR` per decision.
    Incr,
}

impl Work {
    pub fn name(self) -> &'static str {
        match self {
            Work::Single => "lone-decision script (single.lua)",
            Work::Script => "long script (bucket + apply), 1 decision",
            Work::Incr => "INCR per decision (the peer's work)",
        }
    }
}

/// One measurement.
#[derive(Debug, Clone)]
pub struct AtLoad {
    pub work: Work,
    /// Redis's CPU over the measured window, in cores (the target, as near as it came).
    pub utilisation: f64,
    pub decisions_per_sec: f64,
    /// Redis's CPU per decision, µs.
    pub cpu_us: f64,
}

/// The next rate to send at, from the rate sent and the utilisation it gave: proportional, at
/// most doubled or halved per step (a window's figure is noisy), at least 100 a second.
pub fn next_rate(rate: f64, measured: f64, target: f64) -> f64 {
    let factor = if measured > 0.0 {
        (target / measured).clamp(0.5, 2.0)
    } else {
        2.0
    };
    (rate * factor).max(100.0)
}

/// Whether a window's utilisation is near enough to the target to measure at (within 10%).
pub fn settled(measured: f64, target: f64) -> bool {
    (measured - target).abs() <= 0.1 * target
}

/// Callers sending `work` at a shared rate over `connections` connections, each paced at its
/// share; a call that takes longer than its interval is followed by the next at once.
struct Callers {
    rate_milli: Arc<AtomicU64>,
    done: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Callers {
    fn start(redis: &Redis, work: Work, sha: &str, connections: usize, keys: u64) -> Callers {
        let rate_milli = Arc::new(AtomicU64::new(0));
        let done = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let url = redis.url();
        let threads = (0..connections as u64)
            .map(|c| {
                let (rate_milli, done, failed, stop) = (
                    rate_milli.clone(),
                    done.clone(),
                    failed.clone(),
                    stop.clone(),
                );
                let (url, sha) = (url.clone(), sha.to_string());
                let n = connections as f64;
                std::thread::spawn(move || {
                    let mut conn = redis::Client::open(url.as_str())
                        .and_then(|c| c.get_connection())
                        .expect("a connection to Redis");
                    let mut i = c;
                    let mut next = Instant::now();
                    while !stop.load(Ordering::Relaxed) {
                        let rate = rate_milli.load(Ordering::Relaxed) as f64 / 1000.0;
                        if rate <= 0.0 {
                            std::thread::sleep(Duration::from_millis(5));
                            next = Instant::now();
                            continue;
                        }
                        let now = Instant::now();
                        if next > now {
                            std::thread::sleep(next - now);
                        }
                        next = next.max(now) + Duration::from_secs_f64(n / rate);
                        let cmd = match work {
                            Work::Single => single_call(&sha, 1, i, keys),
                            Work::Script => apply_call(&sha, 1, i, keys),
                            Work::Incr => {
                                let mut c = redis::cmd("INCR");
                                c.arg(format!("rl:{{bench|k={}}}", i % keys));
                                c
                            }
                        };
                        i = i.wrapping_add(connections as u64);
                        match cmd.query::<redis::Value>(&mut conn) {
                            Ok(_) => done.fetch_add(1, Ordering::Relaxed),
                            Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                        };
                    }
                })
            })
            .collect();
        Callers {
            rate_milli,
            done,
            failed,
            stop,
            threads,
        }
    }

    fn set_rate(&self, rate: f64) {
        self.rate_milli
            .store((rate * 1000.0) as u64, Ordering::Relaxed);
    }

    /// Decisions done and Redis's CPU seconds over `window`.
    fn window(&self, redis: &Redis, window: Duration) -> (f64, f64) {
        let cpu = || cpu_seconds(redis.pid());
        let (d0, c0, t0) = (self.done.load(Ordering::Relaxed), cpu(), Instant::now());
        std::thread::sleep(window);
        let (d1, c1) = (self.done.load(Ordering::Relaxed), cpu());
        let wall = t0.elapsed().as_secs_f64();
        ((d1 - d0) as f64 / wall, (c1 - c0) / wall)
    }

    fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        self.failed.load(Ordering::Relaxed)
    }
}

/// Holds a fresh Redis at `target` cores of CPU with `work` from `connections` connections on
/// `keys` keys (up to 10 one-second steps to get there), then measures for `seconds`.
pub fn measure(work: Work, target: f64, connections: usize, keys: u64, seconds: f64) -> AtLoad {
    let redis = Redis::start();
    let sha: String = {
        let mut c = redis.connection();
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(if work == Work::Single { SINGLE } else { APPLY })
            .query(&mut c)
            .expect("SCRIPT LOAD")
    };
    let callers = Callers::start(&redis, work, &sha, connections, keys);
    let mut rate = 2000.0;
    for _ in 0..10 {
        callers.set_rate(rate);
        let (_, util) = callers.window(&redis, Duration::from_secs(1));
        if settled(util, target) {
            break;
        }
        rate = next_rate(rate, util, target);
    }
    let (per_sec, util) = callers.window(&redis, Duration::from_secs_f64(seconds));
    let failed = callers.stop();
    assert_eq!(failed, 0, "{}: {failed} calls failed", work.name());
    AtLoad {
        work,
        utilisation: util,
        decisions_per_sec: per_sec,
        cpu_us: util * 1e6 / per_sec.max(1.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_moves_toward_the_target_by_at_most_a_factor_of_two() {
        assert_eq!(next_rate(1000.0, 0.25, 0.5), 2000.0);
        assert_eq!(next_rate(1000.0, 0.1, 0.5), 2000.0);
        assert_eq!(next_rate(1000.0, 2.0, 0.5), 500.0);
        assert_eq!(next_rate(1000.0, 0.0, 0.5), 2000.0);
        assert_eq!(next_rate(150.0, 1.0, 0.1), 100.0);
        assert!(settled(0.52, 0.5) && !settled(0.4, 0.5));
    }
}
