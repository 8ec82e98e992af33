//! `make reliability`'s scenarios, as stages the binary runs (`tests/src/bin/reliability.rs`):
//! each starts the real processes, breaks them on purpose and returns its table rows.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::load::{self, figures, Background, Callers, Figures, Outcome, Status};
use crate::plugin::{max_lease_tokens, rule, with_emergency, Plugin};
use crate::probe::{self, dbsize, filter_decision_us, script_calls, used_memory, write_calls};
use crate::report::{markdown, ms, quantile};
use crate::store_loss::{self, Loss};
use crate::{
    http, Envoy, EnvoyConfig, FaultProxy, Redis, RedisCluster, Sentinel, Sidecar, Upstream,
};
use clap::Parser;
use nix::sys::signal::Signal;
use serde_json::{json, Value};

mod budget;
mod failover;
mod flood;
mod outage;
mod reload;
mod store;

pub(crate) use self::budget::*;
pub(crate) use self::failover::*;
pub(crate) use self::flood::*;
pub(crate) use self::outage::*;
pub(crate) use self::reload::*;
pub(crate) use self::store::*;

#[derive(Parser, Clone)]
#[command(
    about = "Failure behaviour, measured: every scenario of docs/failure-behaviour.md, one table"
)]
pub struct Args {
    /// Seconds of load per phase (a fault lasts as long).
    #[arg(long, default_value_t = 3)]
    pub seconds: u64,
    /// Scenarios to run, by number (1-14), comma separated; all by default.
    #[arg(long, value_delimiter = ',')]
    pub scenario: Vec<u32>,
    /// Concurrent clients on the loaded key(s).
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// Distinct keys of scenario 8.
    #[arg(long, default_value_t = 100_000)]
    pub keys: usize,
    /// Lost replies (and repeats) in scenario 5.
    #[arg(long, default_value_t = 100)]
    pub lost: usize,
    /// Also write the table to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One line of the table; every cell already formatted.
#[derive(Default, Clone)]
pub struct Row {
    pub scenario: String,
    pub load: String,
    pub fault: String,
    pub admitted: String,
    pub rejected: String,
    pub over: String,
    pub client: String,
    pub filter: String,
    pub errors: String,
    pub recovery: String,
    pub check: String,
}

pub(crate) const HEADER: [&str; 11] = [
    "scenario",
    "load",
    "fault",
    "admitted",
    "rejected",
    "over-admission (exact bound)",
    "decision p50 / p99, client",
    "p50 / p99, filter decision_us",
    "errors",
    "recovery",
    "bounds checked",
];

impl Row {
    pub(crate) fn cells(&self) -> [&str; 11] {
        [
            &self.scenario,
            &self.load,
            &self.fault,
            &self.admitted,
            &self.rejected,
            &self.over,
            &self.client,
            &self.filter,
            &self.errors,
            &self.recovery,
            &self.check,
        ]
    }
}

pub fn table(rows: &[Row]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.cells().iter().map(|c| c.to_string()).collect())
        .collect();
    markdown(&HEADER, &rows)
}

// ---------------------------------------------------------------------------------------------
// Load: closed-loop HTTP clients on a runtime of their own, recording every answer.

/// A group of identical clients.
#[derive(Clone)]
pub(crate) struct Clients {
    /// Which group the samples belong to.
    pub(crate) group: usize,
    pub(crate) count: usize,
    /// Requests go round-robin over these URLs.
    pub(crate) urls: Vec<String>,
    pub(crate) headers: Vec<(String, String)>,
    /// The loopback address to send from (the client's "ip" as Envoy sees it).
    pub(crate) from: Option<IpAddr>,
    /// Pause between two requests of one client (None: closed loop, as fast as answered).
    pub(crate) pause: Option<Duration>,
}

impl Clients {
    pub(crate) fn new(group: usize, count: usize, urls: &[String]) -> Clients {
        Clients {
            group,
            count,
            urls: urls.to_vec(),
            headers: Vec::new(),
            from: None,
            pause: None,
        }
    }
    pub(crate) fn header(mut self, k: &str, v: &str) -> Clients {
        self.headers.push((k.into(), v.into()));
        self
    }
    pub(crate) fn from(mut self, ip: IpAddr) -> Clients {
        self.from = Some(ip);
        self
    }
    pub(crate) fn pause(mut self, d: Duration) -> Clients {
        self.pause = Some(d);
        self
    }

    /// The group as callers of the load generator: GETs with a 5 s timeout.
    pub(crate) fn callers(self) -> Callers<Status> {
        let mut builder = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .no_proxy();
        if let Some(ip) = self.from {
            builder = builder.local_address(ip);
        }
        let client = builder.build().expect("client");
        let (urls, headers) = (self.urls, self.headers);
        let op = load::op(move |call| {
            let url = urls[(call.caller + call.n as usize) % urls.len()].clone();
            let (client, headers) = (client.clone(), headers.clone());
            async move { load::get(&client, &url, &headers).await }
        });
        let callers = Callers::new(self.group, self.count, op);
        match self.pause {
            Some(p) => callers.pause(p),
            None => callers,
        }
    }
}

/// One answer (status 0: no answer, the request failed or timed out at the client).
pub(crate) type Sample = load::Sample<Status>;

/// The groups' clients, on a runtime of their own (2 threads), until `finish`.
pub(crate) fn start_load(groups: Vec<Clients>) -> Background<Status> {
    Background::start(2, groups.into_iter().map(Clients::callers).collect())
}

pub(crate) fn p50_p99(f: &Figures) -> String {
    format!("{} / {}", ms(f.p50), ms(f.p99))
}

/// Errors of a group of samples, by kind: `503 x12, no answer x3`.
pub(crate) fn errors_by_kind<'a>(samples: impl IntoIterator<Item = &'a Sample>) -> String {
    let mut by: std::collections::BTreeMap<u16, usize> = Default::default();
    for s in samples.into_iter().filter(|s| s.failed()) {
        *by.entry(s.status()).or_default() += 1;
    }
    if by.is_empty() {
        return "0".into();
    }
    by.iter()
        .map(|(s, n)| match s {
            0 => format!("no answer ×{n}"),
            s => format!("{s} ×{n}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// How long decisions kept failing after `from`: from `from` to the answer of the last failed
/// request sent at or after `from` and answered before `until` (zero when none failed). `until` is
/// when the next fault begins: a request still in flight then may have failed by that fault, not
/// by this one, so it is not counted (counting it once made a Redis that resumed at once look as
/// if it had failed for the whole 2 s until it was stopped).
pub(crate) fn recovery(
    samples: &[Sample],
    group: usize,
    from: Duration,
    until: Duration,
) -> Duration {
    samples
        .iter()
        .filter(|s| s.group == group && s.at >= from && s.done() < until && s.failed())
        .map(|s| s.done().saturating_sub(from))
        .max()
        .unwrap_or_default()
}

pub(crate) fn mark(ok: bool) -> &'static str {
    if ok {
        "✓"
    } else {
        "✗"
    }
}

// ---------------------------------------------------------------------------------------------
// What the processes say about themselves.

pub(crate) fn filter_cell(envoys: &[&Envoy]) -> String {
    envoys
        .iter()
        .filter_map(|e| filter_decision_us(e))
        .map(|(p50, p99)| format!("{:.1} / {:.1} ms", p50 / 1000.0, p99 / 1000.0))
        .collect::<Vec<_>>()
        .join("; ")
}

/// A bucket as the script stores it: (tokens, ts µs, expiry ms the key carries).
pub(crate) fn stored(conn: &mut redis::Connection, key: &str) -> Option<(f64, f64, f64)> {
    let raw: Option<Vec<u8>> = redis::cmd("GET").arg(key).query(conn).ok()?;
    unpack(&raw?)
}

/// [`stored`] from the key's bytes: three little-endian doubles first.
pub(crate) fn unpack(raw: &[u8]) -> Option<(f64, f64, f64)> {
    let d = |i: usize| -> Option<f64> {
        Some(f64::from_le_bytes(
            raw.get(i * 8..i * 8 + 8)?.try_into().ok()?,
        ))
    };
    Some((d(0)?, d(1)?, d(2)?))
}

/// The sum of one counter over several Envoys.
pub(crate) fn counters(envoys: &[&Envoy], name: &str) -> u64 {
    envoys.iter().map(|e| e.counter(name)).sum()
}

pub(crate) fn emergency_admits(envoys: &[&Envoy]) -> u64 {
    counters(envoys, "ratelimit.emergency_activations")
        .saturating_sub(counters(envoys, "ratelimit.emergency_rejected"))
}

// ---------------------------------------------------------------------------------------------
// Stacks.

/// The plugin configuration of `envoy/envoy.yaml` with `rules` and the callout timeout
/// `timeout_ms`.
pub(crate) fn plugin(rules: Value, timeout_ms: u64) -> Plugin {
    Plugin::shipped_identities(rules).timeout_ms(timeout_ms)
}

pub(crate) fn envoy(sidecar: &Sidecar, upstream: &Upstream, plugin: &Plugin) -> Envoy {
    Envoy::start(
        &EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port)
            .plugin(&plugin.to_string())
            .concurrency(2),
    )
}

/// The shipped timeouts: the filter waits 50 ms, the sidecar bounds Redis at 30 ms.
pub(crate) const FILTER_TIMEOUT_MS: u64 = 50;

pub(crate) fn log(what: &str) {
    eprintln!("[reliability] {what}");
}

pub(crate) fn sleep(d: Duration) {
    std::thread::sleep(d);
}

// ---------------------------------------------------------------------------------------------
// 1. Shared budget.

/// One decision of rule `once` for `id`: whether it was allowed (None: no answer).
pub(crate) async fn once(c: &reqwest::Client, url: &str, id: &str) -> Option<bool> {
    let body =
        json!({"requests": [{"decisions": [{"rule": "once", "subject": {"id": id}, "cost": 1}]}]});
    let r = c.post(url).json(&body).send().await.ok()?;
    if r.status() != 200 {
        return None;
    }
    let v: Value = r.json().await.ok()?;
    v["answers"][0]["allowed"].as_bool()
}

pub type Scenario = fn(&Args) -> Vec<Row>;

pub const SCENARIOS: [(u32, &str, Scenario); 14] = [
    (1, "shared budget", shared_budget),
    (2, "hot key", hot_key),
    (3, "Redis slow and down", redis_outage),
    (4, "failover", failover),
    (5, "uncertain results", uncertain),
    (6, "sidecar restart", sidecar_restart),
    (7, "flood", flood),
    (8, "many clients", many_clients),
    (9, "snapshot restore", snapshot_restore),
    (10, "policy reload under leases", policy_reload),
    (11, "store lost its state", store_lost),
    (12, "Redis restarted from an older snapshot", snapshot_lost),
    (13, "slots lost with the store", slots_lost),
    (14, "Cluster epochs", cluster_epochs),
];

/// Scenario `n`'s rows; a scenario that fails becomes a row saying so (its processes were
/// stopped as it unwound).
pub fn run_scenario(args: &Args, n: u32, name: &str, run: Scenario) -> Vec<Row> {
    let t = Instant::now();
    log(&format!("scenario {n}: {name}"));
    let rows = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(args))) {
        Ok(rows) => rows,
        Err(e) => {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            let msg = msg.lines().next().unwrap_or_default().to_string();
            vec![Row {
                scenario: format!("{n} {name}"),
                check: format!("✗ FAILED: {msg}"),
                ..Row::default()
            }]
        }
    };
    log(&format!(
        "scenario {n} took {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    rows
}
