//! What the bucket script costs Redis, one script against another, side by side: both texts are
//! loaded into one fresh redis-server and called with the same work (the bench's: one limit so
//! large that every decision admits and writes its bucket, keys spread over `keys` buckets), in
//! alternating rounds so that drift in the machine's load falls on both alike. Per decision it
//! reads Redis's own figures: the time inside `EVALSHA` (`INFO commandstats`, the script proper)
//! and the process's CPU (`INFO cpu`, `used_cpu_user` + `used_cpu_sys`: the script and the reading,
//! parsing and answering of its commands).
//!
//! [`BEFORE`] is the script as it was before it was split into `lua/bucket.lua` and a file per
//! mode, kept as a fixture (`tests/fixtures/token_bucket_before.lua`) to measure against; it
//! takes its numbers as decimal arguments ([`before_call`]), the scripts now packed into one
//! ([`apply_call`]).

use std::fmt::Write as _;

use crate::Redis;

/// The apply script as the sidecar sends it (`sidecar/src/store/redis/script.rs` joins the same files).
pub const APPLY: &str = concat!(
    include_str!("../../lua/bucket.lua"),
    include_str!("../../lua/apply.lua")
);

/// The refund script as the sidecar sends it.
pub const REFUND: &str = concat!(
    include_str!("../../lua/bucket.lua"),
    include_str!("../../lua/refund.lua")
);

/// The script of a lone decision without a lease ask, a share or a record, as the sidecar sends
/// it for such a call (`ScriptArgs::single` in `sidecar/src/store/redis/script.rs`).
pub const SINGLE: &str = include_str!("../../lua/single.lua");

/// The single-file script before the split (662 lines, apply and refund in one).
pub const BEFORE: &str = include_str!("../fixtures/token_bucket_before.lua");

/// Builds the `EVALSHA` of one apply call of `n` one-decision requests from call number `i` on
/// `keys` buckets, given the script's SHA1: [`apply_call`] or [`before_call`].
pub type CallOf = fn(&str, usize, u64, u64) -> redis::Cmd;

/// Bucket `j` of call number `i`: keys `rl:{bench|k=..}` of `keys`.
fn bench_bucket(i: u64, j: u64, keys: u64) -> String {
    format!("rl:{{bench|k={}}}", (i + j * 7919) % keys)
}

/// The `EVALSHA` of one apply call of `n` one-decision requests from call number `i`, on buckets
/// `rl:{bench|k=..}` of `keys`, as the bench's script stages make it: one limit so large that
/// every decision admits (no share), one group without a record, no returns.
pub fn apply_call(sha: &str, n: usize, i: u64, keys: u64) -> redis::Cmd {
    let buckets: Vec<String> = (0..n as u64).map(|j| bench_bucket(i, j, keys)).collect();
    one_decision_requests(sha, &buckets, 999_999_999_999, 1e9, 1)
}

/// The `EVALSHA` of an apply call of one request per bucket of `buckets`, each one decision of
/// `cost` on that bucket under one limit (`capacity`, `refill_per_sec`, no share), in one group
/// without a record, no returns, no epoch marker: the numbers packed as the header of
/// `lua/bucket.lua` lays them out.
pub fn one_decision_requests(
    sha: &str,
    buckets: &[String],
    capacity: u64,
    refill_per_sec: f64,
    cost: u64,
) -> redis::Cmd {
    let mut numbers = Vec::new();
    let mut put = |v: u64, width: usize| numbers.extend_from_slice(&v.to_le_bytes()[..width]);
    // Record ttl, lease share (a double), cluster 0, share margin, receipt ttl; B, L, G, N.
    put(10_000, 8);
    put(0.1f64.to_bits(), 8);
    put(0, 1);
    put(1000, 8);
    put(10_000, 8);
    for count in [buckets.len() as u64, 1, 1, 0] {
        put(count, 4);
    }
    // The limit: capacity, refill (a double), no share history.
    put(capacity, 8);
    put(refill_per_sec.to_bits(), 8);
    put(0, 4);
    // The group's requests, each one decision: bucket j, limit 1, the cost, no shadow, the grant
    // capped by the share, no lease, no receipt.
    put(buckets.len() as u64, 4);
    for j in 1..=buckets.len() as u64 {
        for (v, width) in [
            (1, 4),
            (j, 4),
            (1, 4),
            (cost, 8),
            (0, 1),
            (1, 1),
            (0, 8),
            (0, 8),
            (0, 8),
            (0, 8),
        ] {
            put(v, width);
        }
    }
    let mut c = redis::cmd("EVALSHA");
    c.arg(sha).arg(1).arg(&buckets[0]).arg("apply").arg(numbers);
    c.arg(buckets);
    // The group's record key: none; last, no epoch marker (--store-reset full).
    c.arg("").arg("");
    c
}

/// The `EVALSHA` of [`SINGLE`] for call number `i` on `keys` buckets: the `n` decisions of
/// [`apply_call`] (the same buckets, limit and cost), as `lua/single.lua` takes them: the first
/// bucket as the one key; per decision capacity (I8), refill (d), cost (I8), shadow (B); no
/// epoch marker; the other buckets.
pub fn single_call(sha: &str, n: usize, i: u64, keys: u64) -> redis::Cmd {
    let mut numbers = Vec::with_capacity(25 * n);
    for _ in 0..n {
        numbers.extend_from_slice(&999_999_999_999u64.to_le_bytes());
        numbers.extend_from_slice(&1e9f64.to_le_bytes());
        numbers.extend_from_slice(&1u64.to_le_bytes());
        numbers.push(0);
    }
    let mut c = redis::cmd("EVALSHA");
    c.arg(sha).arg(1).arg(bench_bucket(i, 0, keys));
    c.arg(numbers).arg("");
    for j in 1..n as u64 {
        c.arg(bench_bucket(i, j, keys));
    }
    c
}

/// [`apply_call`] in the convention of the script before its split ([`BEFORE`]): every number a
/// decimal argument.
pub fn before_call(sha: &str, n: usize, i: u64, keys: u64) -> redis::Cmd {
    let mut c = redis::cmd("EVALSHA");
    c.arg(sha).arg(1).arg(bench_bucket(i, 0, keys));
    // mode, record ttl, lease share, cluster 0, share margin; the buckets.
    c.arg("apply").arg(10_000).arg(0.1).arg(0).arg(1000).arg(n);
    for j in 0..n as u64 {
        c.arg(bench_bucket(i, j, keys));
    }
    c.arg(1)
        .arg(999_999_999_999u64)
        .arg(1_000_000_000u64)
        .arg(0);
    c.arg(1).arg("").arg(n);
    for j in 0..n {
        c.arg(1)
            .arg(j + 1)
            .arg(1)
            .arg(1)
            .arg(0)
            .arg(0)
            .arg(0)
            .arg(0);
    }
    // No returns; last, no epoch marker (ignored by the script before).
    c.arg(0).arg("");
    c
}

/// One script's figures at one batch size: per round, µs per decision.
#[derive(Debug, Clone)]
pub struct Cost {
    pub script: &'static str,
    pub per_call: usize,
    /// Inside `EVALSHA` (`INFO commandstats`).
    pub in_script_us: Vec<f64>,
    /// Redis's CPU (`INFO cpu`).
    pub cpu_us: Vec<f64>,
}

impl Cost {
    pub fn median_in_script(&self) -> f64 {
        median(&self.in_script_us)
    }
    pub fn median_cpu(&self) -> f64 {
        median(&self.cpu_us)
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// `usec` of `cmdstat_evalsha` and the CPU seconds Redis has used so far.
fn counters(c: &mut redis::Connection) -> (f64, f64) {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .arg("cpu")
        .query(c)
        .expect("INFO");
    // `cmdstat_evalsha:calls=..,usec=..,...` and `used_cpu_user:1.234`.
    let value = |name: &str| -> f64 {
        info.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split(',').next())
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    let evalsha_us = info
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
        .and_then(|l| l.split(',').find_map(|kv| kv.strip_prefix("usec=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    let cpu_s = value("used_cpu_user:") + value("used_cpu_sys:");
    (evalsha_us, cpu_s)
}

/// Measures `scripts` (name, text, the builder of its calls) at each batch size of `per_call` on a fresh redis-server:
/// `rounds` rounds, each calling every (script, batch size) in turn (the order reversed every
/// other round) for about `decisions` decisions, 16 calls pipelined at a time.
pub fn compare(
    scripts: &[(&'static str, &str, CallOf)],
    per_call: &[usize],
    rounds: usize,
    decisions: usize,
    keys: u64,
) -> Vec<Cost> {
    let redis = Redis::start_with(&["--maxmemory-policy", "noeviction"]);
    let mut c = redis.connection();
    let mut shas = Vec::new();
    for (_, text, _) in scripts {
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(*text)
            .query(&mut c)
            .expect("SCRIPT LOAD");
        shas.push(sha);
    }
    let pipeline = 16;
    let mut i = 0u64;
    let mut run = |c: &mut redis::Connection, s: usize, n: usize, calls: usize| {
        let mut sent = 0;
        while sent < calls {
            let mut pipe = redis::pipe();
            for _ in 0..pipeline.min(calls - sent) {
                pipe.add_command((scripts[s].2)(&shas[s], n, i, keys));
                i += n as u64;
                sent += 1;
            }
            let replies: Vec<redis::Value> = pipe.query(c).expect("script call");
            assert!(
                replies
                    .iter()
                    .all(|r| matches!(r, redis::Value::BulkString(b) if b.len() == 8 * 7 * n)),
                "every call answers one status and six figures per decision: {replies:?}"
            );
        }
    };
    let cases: Vec<(usize, usize)> = (0..scripts.len())
        .flat_map(|s| per_call.iter().map(move |&n| (s, n)))
        .collect();
    // Every bucket exists before the first round, so no round pays for creating them.
    for &(s, n) in &cases {
        run(&mut c, s, n, (keys as usize).div_ceil(n));
    }
    let mut costs: Vec<Cost> = cases
        .iter()
        .map(|&(s, n)| Cost {
            script: scripts[s].0,
            per_call: n,
            in_script_us: Vec::new(),
            cpu_us: Vec::new(),
        })
        .collect();
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..cases.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for k in order {
            let (s, n) = cases[k];
            let calls = decisions.div_ceil(n);
            let (us0, cpu0) = counters(&mut c);
            run(&mut c, s, n, calls);
            let (us1, cpu1) = counters(&mut c);
            let d = (calls * n) as f64;
            costs[k].in_script_us.push((us1 - us0) / d);
            costs[k].cpu_us.push((cpu1 - cpu0) * 1e6 / d);
        }
    }
    costs
}

/// [`compare`]'s figures as a table: per script and batch size the medians and the spread over
/// the rounds, and each later script against the first.
pub fn report(costs: &[Cost]) -> String {
    let mut out = String::new();
    let spread = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{lo:.2}..{hi:.2}")
    };
    let _ = writeln!(
        out,
        "{:<10} {:>9} {:>22} {:>22} {:>7}",
        "script", "per call", "in EVALSHA µs/dec", "Redis CPU µs/dec", "rounds"
    );
    for c in costs {
        let base = costs
            .iter()
            .find(|b| b.per_call == c.per_call)
            .expect("itself at least");
        let vs = if std::ptr::eq(base, c) {
            String::new()
        } else {
            format!(
                "  ({:.2}x, {:.2}x of {})",
                c.median_in_script() / base.median_in_script(),
                c.median_cpu() / base.median_cpu(),
                base.script
            )
        };
        let _ = writeln!(
            out,
            "{:<10} {:>9} {:>6.2} ({:>13}) {:>6.2} ({:>13}) {:>7}{vs}",
            c.script,
            c.per_call,
            c.median_in_script(),
            spread(&c.in_script_us),
            c.median_cpu(),
            spread(&c.cpu_us),
            c.in_script_us.len()
        );
    }
    out
}

/// Rounds of [`before_and_after`].
pub const ROUNDS: usize = 7;

/// The script before the split against the apply script now, at 1 and `batch` decisions per call,
/// [`ROUNDS`] alternating rounds of 20,000 decisions each, as a titled table (the bench's
/// components stage prints it).
pub fn before_and_after(batch: usize, keys: u64) -> String {
    let costs = compare(
        &[
            ("before", BEFORE, before_call),
            ("after", APPLY, apply_call),
        ],
        &[1, batch],
        ROUNDS,
        20_000,
        keys,
    );
    format!(
        "\n== bucket script, before and after its split (medians of {ROUNDS} alternating rounds, min..max)\n{}",
        report(&costs)
    )
}
