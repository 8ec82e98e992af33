//! The reported wait is exact, for every implementation of the bucket (one test body run against
//! each, as Limitador's `test_with_all_storage_impls!` does, and governor's `accurate_not_until`
//! asks): a bucket emptied, left to refill for less than a cost, rejects that cost with some
//! `retry_after_ms`; it still rejects 1 ms before that wait has passed and admits once it has. For
//! random capacities, refills and costs, each bucket on a clock the test controls:
//!
//! - the filter's emergency bucket (`emergency::EmergencyBucket::take`), time in nanoseconds;
//! - the script's model, `MemoryStore`, time in microseconds (`set_now_us`);
//! - the real apply script on a real redis-server. Its clock is Redis's `TIME`, which a test
//!   cannot set, and real time moves between the test writing a state and the script reading
//!   the clock, so no stored state can make the elapsed time exact. So the script runs with its
//!   `TIME` answered by the test: the text the sidecar sends, with one line added after its first
//!   that shadows `redis` by a table whose `call('TIME')` reads the time from a key the test sets
//!   and passes every other call to the real `redis`. The rest is the script, byte for byte.
//!
//! Why the property can be exact in floating point: the refill is a whole number of eighths of a
//! token per second and the clock moves in whole milliseconds, so `refill_per_sec * elapsed_us`
//! is an exact integer and the one division by 1e6 rounds monotonically: `tokens >= cost` is
//! decided exactly. The bucket is emptied once at t0 (0 tokens, exactly) and then only rejects
//! (a rejection writes nothing), so every later take refills from that one exact state. The true
//! wait is a multiple of 1/refill ms (refill below 1000 per second: at least 1/8000 ms), never
//! within the 1e-6 ms the waits forgive of an integer unless it is one.

use std::sync::Arc;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use ratelimit_e2e::{script_cost, Redis};
use ratelimit_filter::emergency;
use ratelimit_sidecar::store::memory::MemoryStore;
use ratelimit_sidecar::store::{BucketLimits, Charge, GrantCap, Group, Script, Status, Work};

const T0_US: u64 = 1_700_000_000_000_000;

/// A bucket of `capacity` refilled at `refill_per_sec`, on a clock the test moves.
trait Clocked {
    /// Takes `cost` now: whether it was admitted, and the `retry_after_ms` it reported.
    fn take(&mut self, cost: u64) -> (bool, u64);
    fn advance_ms(&mut self, ms: u64);
}

/// The property, for one bucket made by `make(capacity, refill_per_sec)`.
fn the_reported_wait_is_exact<B: Clocked>(make: impl Fn(u64, f64) -> B) {
    let strategy = (1..10_000u64, 1..8_000u64, any::<u64>(), any::<u64>());
    let mut runner = TestRunner::new(Config {
        cases: 128,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&strategy, |(capacity, eighths, cost_seed, idle_seed)| {
            let refill_per_sec = eighths as f64 / 8.0;
            let cost = 1 + cost_seed % capacity;
            let mut b = make(capacity, refill_per_sec);
            prop_assert!(b.take(capacity).0, "a full bucket admits its capacity");
            // Idle for less than the refill of `cost` (idle * refill < cost * 1000 ms).
            let idle_ms = idle_seed % (cost * 8_000).div_ceil(eighths);
            b.advance_ms(idle_ms);
            let (admitted, retry_ms) = b.take(cost);
            prop_assert!(!admitted, "{idle_ms} ms refill less than {cost}");
            prop_assert!(retry_ms >= 1);
            b.advance_ms(retry_ms - 1);
            let (admitted, left_ms) = b.take(cost);
            prop_assert!(!admitted, "admitted 1 ms before the {retry_ms} ms it said");
            prop_assert_eq!(left_ms, 1, "the wait counts down with the clock");
            b.advance_ms(1);
            prop_assert!(
                b.take(cost).0,
                "rejected when the {} ms it said had passed",
                retry_ms
            );
            Ok(())
        })
        .unwrap();
}

/// The filter's emergency bucket: its state kept by the test, stored after an admitting take
/// only (as `emergency::take_shared` does).
struct EmergencyBucket {
    bucket: emergency::EmergencyBucket,
    state: Option<[u8; 17]>,
    now_ns: u64,
}

impl Clocked for EmergencyBucket {
    fn take(&mut self, cost: u64) -> (bool, u64) {
        let t = self.bucket.take(
            self.state.as_ref().map(|s| &s[..]),
            self.now_ns,
            cost as f64,
        );
        if t.allowed {
            self.state = Some(t.state.encode());
        }
        (t.allowed, t.retry_after_ms)
    }
    fn advance_ms(&mut self, ms: u64) {
        self.now_ns += ms * 1_000_000;
    }
}

/// One request of one decision, as the script and its model take it.
fn work(key: &str, limits: &BucketLimits, cost: u64) -> Work {
    let charge = Charge {
        receipt: 0,
        key: Arc::from(key),
        bucket: limits.clone(),
        cost,
        shadow: false,
        lease: None,
        grant_cap: GrantCap::Share,
    };
    Work {
        groups: vec![Group {
            record: None,
            requests: vec![vec![charge]],
        }],
        returns: vec![],
    }
}

/// The script's model.
struct Memory {
    store: MemoryStore,
    limits: BucketLimits,
    now_us: u64,
}

impl Clocked for Memory {
    fn take(&mut self, cost: u64) -> (bool, u64) {
        self.store.set_now_us(self.now_us);
        let r = self
            .store
            .run(&work("rl:{exact}", &self.limits, cost))
            .remove(0)
            .remove(0);
        (r.status == Status::Charged, r.decisions[0].retry_after_ms)
    }
    fn advance_ms(&mut self, ms: u64) {
        self.now_us += ms * 1_000;
    }
}

/// The apply script, its `TIME` answered from the key `exact:now_us` (see the module doc).
fn clocked_script() -> String {
    let text = Script::Apply.text();
    let (shebang, rest) = text.split_once('\n').expect("a first line");
    format!(
        "{shebang}\nlocal real = redis; local redis = setmetatable({{ call = function(c, ...) \
         if c == 'TIME' then local us = tonumber(real.call('GET', 'exact:now_us')) \
         return {{ string.format('%d', math.floor(us / 1000000)), string.format('%d', us % 1000000) }} \
         end return real.call(c, ...) end }}, {{ __index = real }})\n{rest}"
    )
}

struct OnRedis {
    connection: redis::Connection,
    sha: String,
    key: String,
    capacity: u64,
    refill_per_sec: f64,
    now_us: u64,
}

impl Clocked for OnRedis {
    fn take(&mut self, cost: u64) -> (bool, u64) {
        let c = &mut self.connection;
        let _: () = redis::cmd("SET")
            .arg("exact:now_us")
            .arg(self.now_us)
            .query(c)
            .unwrap();
        // One bucket, one limit, one request, as lua/bucket.lua's header lays the call out.
        let reply: Vec<u8> = script_cost::one_decision_requests(
            &self.sha,
            std::slice::from_ref(&self.key),
            self.capacity,
            self.refill_per_sec,
            cost,
        )
        .query(c)
        .unwrap();
        let f: Vec<f64> = reply
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        // status, then allowed, remaining, retry_after_ms, reset_ms, reason, leased.
        (f[0] == 1.0, f[3] as u64)
    }
    fn advance_ms(&mut self, ms: u64) {
        self.now_us += ms * 1_000;
    }
}

#[test]
fn the_emergency_bucket_reports_an_exact_wait() {
    the_reported_wait_is_exact(|capacity, refill_per_sec| EmergencyBucket {
        bucket: emergency::EmergencyBucket {
            capacity: capacity as f64,
            refill_per_sec,
        },
        state: None,
        now_ns: T0_US * 1_000,
    });
}

#[test]
fn the_memory_store_reports_an_exact_wait() {
    the_reported_wait_is_exact(|capacity, refill_per_sec| Memory {
        store: MemoryStore::new(T0_US, 0.1, 10_000),
        limits: BucketLimits::new(capacity, refill_per_sec),
        now_us: T0_US,
    });
}

#[test]
fn the_redis_script_reports_an_exact_wait() {
    let redis = Redis::start();
    let mut connection = redis.connection();
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(clocked_script())
        .query(&mut connection)
        .unwrap();
    // Ahead of real time: a bucket's key expires at a PXAT on this clock, and Redis drops a key
    // whose PXAT real time has passed.
    let start_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
        + 3_600_000_000;
    let case = std::cell::Cell::new(0);
    the_reported_wait_is_exact(|capacity, refill_per_sec| {
        case.set(case.get() + 1);
        OnRedis {
            connection: redis.connection(),
            sha: sha.clone(),
            key: format!("rl:{{exact-{}}}", case.get()),
            capacity,
            refill_per_sec,
            now_us: start_us,
        }
    });
}
