//! Carries a [`Plan`] out on a [`Topology`], step by step at its times, and logs what it did:
//! each fault with when it began and ended (and whether Sentinel failed over meanwhile), each
//! policy in force from when its file was written. The checker reads only this log: an
//! allowance is granted for a fault the nemesis caused, never for one it only planned.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use super::clock_ns;
use super::schedule::{Action, Fault, Plan, Reload, Store};
use super::topology::{
    policy_yaml, Policy, Topology, GLOBAL_BUCKET, HOT_BUCKET_KEY, NATIVE_ENVOY, RLQS_ENVOY,
    RLQS_SIDECAR,
};
use super::workload::REGION_BURST_MS;
use crate::redis::node_serving;
use crate::{wait_until, Sentinel, SentinelProbe};

/// One fault as it happened.
#[derive(Debug, Clone)]
pub struct Caused {
    pub fault: Fault,
    pub start_ns: u64,
    /// When the fault itself ended (the process resumed, started again, the path mended).
    pub end_ns: u64,
    /// When every sidecar answered ready again and Redis had its replica back.
    pub recovered_ns: u64,
    /// The Sentinels named another primary afterwards.
    pub failover: bool,
}

/// What the nemesis did, for the checker.
#[derive(Debug, Clone, Default)]
pub struct Log {
    pub faults: Vec<Caused>,
    /// The policy in force from each instant (the first from the start).
    pub policies: Vec<(u64, Policy)>,
    /// Logs of processes the nemesis replaced (killed sidecars, restarted Envoys), by name.
    pub replaced_logs: Vec<(String, String)>,
    /// Counters of processes the nemesis replaced, read just before (the Envoys' filter
    /// counters, the sidecars' [`CALLS_REFUSED`]), summed by name.
    pub counters: Vec<(String, u64)>,
}

/// How long a snapshot restore on two regions waits for the shares to move first (a move is
/// a round, then the fence before the grow: 1.5 s + 5.5 s in the chaos topology; then the
/// grow must have been in force for the regional bucket's fill time).
const SHARE_MOVE_WAIT: Duration = Duration::from_secs(20);

/// What a restore on two regions waits for: us's share in the snapshot and eu's share now
/// sum to more than the whole by this much (parts per million), and have for the regional
/// bucket's fill time `C / R` (a new client's bucket is charged under the smallest share of
/// that span: docs/regions.md). With the sidecars' suspicion of a record gone back in time
/// taken away, a new client's burst in both regions would then be admitted
/// `C × 0.25` past the budget, beyond the `R × margin` the bound grants.
const SHARES_OVER_THE_WHOLE_PPM: u64 = 250_000;

/// The share of us a snapshot on two regions waits for (parts per million).
const US_SHARE_AT_SNAPSHOT_PPM: u64 = 600_000;

/// How long the rebalancer stays down across a restore on two regions beyond a burst period
/// (the sidecars read the share record every 500 ms).
const REBALANCER_DOWN_AFTER_MS: u64 = 700;

/// Waits, on two regions, until the shares in us's and eu's records (ppm) have met `wanted` for
/// `held` (at most [`SHARE_MOVE_WAIT`]).
fn wait_for_shares(topology: &Topology, wanted: impl Fn(u64, u64) -> bool, held: Duration) {
    let deadline = Instant::now() + SHARE_MOVE_WAIT;
    let mut met_since: Option<Instant> = None;
    while Instant::now() < deadline {
        let met = topology.shares_ppm().is_some_and(|(us, eu)| wanted(us, eu));
        met_since = met.then(|| met_since.unwrap_or_else(Instant::now));
        if met_since.is_some_and(|t| t.elapsed() >= held) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// How long recovery may take before the run is declared broken (not a finding: the harness's).
const RECOVERY: Duration = Duration::from_secs(60);

/// The sidecars' count of calls they refused as malformed or too large (400, 413): a gateway's
/// batch must fit what its sidecar accepts, so the checker wants none.
pub const CALLS_REFUSED: &str = "sidecar_calls_refused";

/// The quota streams the RLQS Envoy's sidecar opened (`ratelimit_rlqs_streams_opened_total`):
/// a stream that breaks with no fault to break it (a report the sidecar cannot take) shows as
/// many.
pub const RLQS_STREAMS_OPENED: &str = "rlqs_streams_opened";

/// The Envoy counters the checker sums across restarts.
pub const ENVOY_COUNTERS: [&str; 4] = [
    "costs_settled",
    "costs_unreported",
    "settlements_lost",
    "settlements_retried",
];

/// Runs `plan` from `started` until its end, then returns the log.
pub fn carry_out(plan: &Plan, topology: &mut Topology, started: Instant) -> Log {
    let mut log = Log {
        policies: vec![(clock_ns(), topology.policy.clone())],
        ..Log::default()
    };
    let watch = Watch::start(topology);
    // The node a snapshot was taken of, and the snapshot.
    let mut snapshot: Option<(usize, Vec<u8>)> = None;
    // On two regions, us's share when the snapshot was taken.
    let mut share_at_snapshot = None;
    for step in &plan.steps {
        let at = started + Duration::from_millis(step.at_ms);
        if let Some(wait) = at.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        match &step.action {
            Action::Snapshot => {
                // On two regions the snapshot is taken once us holds 0.6 of the share or more
                // (at most [`SHARE_MOVE_WAIT`] later): what a restore brings back is then worth
                // distrusting.
                if topology.eu.is_some() {
                    wait_for_shares(
                        topology,
                        |us, _| us >= US_SHARE_AT_SNAPSHOT_PPM,
                        Duration::ZERO,
                    );
                }
                let p = topology.primary();
                snapshot = Some((p, topology.nodes[p].snapshot()));
                share_at_snapshot = topology.shares_ppm().map(|(us, _)| us);
            }
            Action::Reload(r) => {
                let mut policy = topology.policy.clone();
                match *r {
                    Reload::PerApp {
                        capacity,
                        refill_per_sec,
                    } => policy.per_app = (capacity, refill_per_sec),
                    Reload::Block(b) => policy.hot_blocked = b,
                    Reload::SlotTtl(ms) => policy.slot_ttl_ms = ms,
                    Reload::PerUser(present) => policy.per_user = present,
                }
                topology.write_policy(policy.clone());
                log.policies.push((clock_ns(), policy));
            }
            Action::Fault(f) => {
                // On two regions a snapshot is restored once the rebalancer has moved share from
                // us to eu since it was taken: the restore brings back an older record whose
                // share, with eu's in force, is more than the whole (what the sidecars'
                // suspicion of a record gone back in time is for), for long enough that a new
                // client's bucket is charged under eu's share as it is.
                if let (Fault::StoreSnapshotRestore { .. }, Some(us)) = (f, share_at_snapshot) {
                    let (c, r) = GLOBAL_BUCKET;
                    let fill = Duration::from_secs_f64(c as f64 / r);
                    let over_the_whole = 1_000_000 + SHARES_OVER_THE_WHOLE_PPM;
                    wait_for_shares(topology, |_, eu| us + eu > over_the_whole, fill);
                }
                // On two regions the rebalancer is down across the restore (a deploy of it, say)
                // until a burst of a new client has come (one every [`REGION_BURST_MS`]): it
                // would otherwise write the record again within a round, and the restored
                // share would meet a burst only by chance.
                let pauses_rebalancer =
                    matches!(f, Fault::StoreSnapshotRestore { .. }) && topology.eu.is_some();
                let restoring = Instant::now();
                if pauses_rebalancer {
                    topology.signal_rebalancer(Signal::SIGSTOP);
                }
                let snap = snapshot.as_ref().map(|(p, s)| (*p, s.as_slice()));
                let caused = cause(f, topology, snap, &mut log);
                if pauses_rebalancer {
                    let down = Duration::from_millis(REGION_BURST_MS + REBALANCER_DOWN_AFTER_MS);
                    if let Some(wait) = down.checked_sub(restoring.elapsed()) {
                        std::thread::sleep(wait);
                    }
                    topology.signal_rebalancer(Signal::SIGCONT);
                }
                log.faults.push(caused);
            }
        }
    }
    let end = started + Duration::from_secs(plan.seconds);
    if let Some(wait) = end.checked_duration_since(Instant::now()) {
        std::thread::sleep(wait);
    }
    for (before_ns, seen_ns) in watch.finish() {
        let logged = log
            .faults
            .iter()
            .any(|f| f.failover && f.start_ns <= seen_ns && seen_ns <= f.recovered_ns);
        if !logged {
            log.faults.push(Caused {
                fault: Fault::Failover,
                start_ns: before_ns,
                end_ns: seen_ns,
                recovered_ns: seen_ns,
                failover: true,
            });
        }
    }
    log.faults.sort_by_key(|f| f.start_ns);
    log
}

/// Which primary the Sentinels agree on, looked at every [`WATCH_EVERY`] from a thread of its
/// own for the whole run: a failover is logged even when no fault was under way, or when it
/// completed after its fault was over (a primary paused past the down-after was once failed
/// over seconds after the nemesis saw it answer again, and once for no fault of the nemesis's
/// at all, 3 s after a restart).
struct Watch {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(u64, u64)>>,
}

/// How often the [`Watch`] asks the Sentinels.
const WATCH_EVERY: Duration = Duration::from_millis(200);

impl Watch {
    fn start(t: &Topology) -> Watch {
        let probes: Vec<SentinelProbe> = t.sentinels.iter().map(Sentinel::probe).collect();
        let nodes: Vec<u16> = t.nodes.iter().map(|n| n.port).collect();
        let cluster = t.store == Store::Cluster;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            // The Cluster's "primary" is the node serving the hot app's bucket.
            let agreed = || {
                if cluster {
                    return node_serving(&nodes, HOT_BUCKET_KEY);
                }
                let ports: Vec<u16> = probes
                    .iter()
                    .filter_map(SentinelProbe::master_port)
                    .collect();
                (ports.len() >= 2 && ports.iter().all(|p| *p == ports[0])).then(|| ports[0])
            };
            let (mut primary, mut seen_ns) = (agreed(), clock_ns());
            let mut changes = Vec::new();
            while !stopped.load(Ordering::Relaxed) {
                std::thread::sleep(WATCH_EVERY);
                let (now, at) = (agreed(), clock_ns());
                match (primary, now) {
                    (Some(before), Some(after)) if before != after => changes.push((seen_ns, at)),
                    _ => {}
                }
                if now.is_some() {
                    (primary, seen_ns) = (now, at);
                }
            }
            changes
        });
        Watch { stop, thread }
    }

    /// Stops watching; each change of primary: when the old one was last agreed on, and when
    /// the new one was first.
    fn finish(self) -> Vec<(u64, u64)> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

fn cause(
    fault: &Fault,
    t: &mut Topology,
    snapshot: Option<(usize, &[u8])>,
    log: &mut Log,
) -> Caused {
    let primary_before = t.primary();
    let mut fault = fault.clone();
    let start_ns = clock_ns();
    let sleep = |ms: u64| std::thread::sleep(Duration::from_millis(ms));
    match fault {
        Fault::SidecarPause { sidecar, ms } => {
            let p = &t.sidecars[sidecar].sidecar.process;
            p.signal(Signal::SIGSTOP);
            sleep(ms);
            p.signal(Signal::SIGCONT);
        }
        Fault::SidecarRestart { sidecar, down_ms } => {
            add(&mut log.counters, CALLS_REFUSED, calls_refused(t, sidecar));
            if sidecar == RLQS_SIDECAR {
                let opened = rlqs_streams_opened(t, sidecar);
                add(&mut log.counters, RLQS_STREAMS_OPENED, opened);
            }
            let s = &mut t.sidecars[sidecar];
            s.sidecar.process.stop();
            log.replaced_logs
                .push((format!("sidecar {sidecar}"), s.sidecar.process.log()));
            sleep(down_ms);
            s.start_again(&policy_yaml(&t.policy));
        }
        Fault::PrimaryPause { ms } => {
            let p = &t.nodes[primary_before].process;
            p.signal(Signal::SIGSTOP);
            sleep(ms);
            p.signal(Signal::SIGCONT);
        }
        Fault::PrimaryKill { down_ms } => {
            t.nodes[primary_before].stop();
            sleep(down_ms);
            t.nodes[primary_before].restart_empty();
        }
        Fault::StoreFlush => {
            t.nodes[primary_before].cli(&["FLUSHALL"]);
        }
        Fault::StoreRestartEmpty => t.nodes[primary_before].restart_empty(),
        // Under Sentinel both nodes hold one dataset: the snapshot goes to the primary now. In
        // the Cluster another node may serve the hot app's slot by now (a failover since), and
        // the snapshot would bring it keys of slots it does not serve: that node is restarted
        // empty instead, and logged so.
        Fault::StoreSnapshotRestore { .. } => match snapshot {
            Some((node, s)) if node == primary_before || t.store == Store::Sentinel => {
                t.nodes[primary_before].restart_from(s)
            }
            _ => {
                t.nodes[primary_before].restart_empty();
                fault = Fault::StoreRestartEmpty;
            }
        },
        Fault::EnvoyRestart { envoy } if envoy == NATIVE_ENVOY => {
            log.replaced_logs
                .push(("envoy native".into(), t.native.process.log()));
            let config = t.native_config.clone();
            t.native.restart(&config);
        }
        Fault::EnvoyRestart { envoy } if envoy == RLQS_ENVOY => {
            log.replaced_logs
                .push(("envoy rlqs".into(), t.rlqs.process.log()));
            let config = t.rlqs_config.clone();
            t.rlqs.restart(&config);
        }
        Fault::EnvoyRestart { envoy } => {
            add_envoy_counters(&mut log.counters, t, envoy);
            log.replaced_logs
                .push((format!("envoy {envoy}"), t.envoys[envoy].process.log()));
            let config = t.configs[envoy].clone();
            t.envoys[envoy].restart(&config);
        }
        Fault::GatewayCut { envoy, ms } => {
            t.relays[envoy].set_cut(true);
            sleep(ms);
            t.relays[envoy].set_cut(false);
        }
        Fault::AnswersLost { envoy, ms } => {
            let relay = &t.relays[envoy];
            relay.set_answers_lost(true);
            sleep(ms);
            // The streams lost bytes: their connections go, as a real path would drop them.
            // Cut long enough for every connection's task to see it.
            relay.set_cut(true);
            sleep(100);
            relay.set_answers_lost(false);
            relay.set_cut(false);
        }
        Fault::ClockStep {
            sidecar,
            seconds,
            ms,
        } => {
            t.step_clock(sidecar, seconds);
            sleep(ms);
            t.step_clock(sidecar, 0);
        }
        Fault::RedisCut { sidecar, ms } => {
            t.paths[sidecar].set_cut(true);
            sleep(ms);
            t.paths[sidecar].set_cut(false);
        }
        Fault::RedisDelay {
            sidecar,
            ms,
            delay_ms,
        } => {
            t.paths[sidecar].set_delay_ms(delay_ms);
            sleep(ms);
            t.paths[sidecar].set_delay_ms(0);
        }
        // The new token is issued after the fault's end (below): the checker's window of a
        // revoked token ends when the Envoy may be admitted again.
        Fault::TokenRevoked { ms } => {
            t.revoke_rlqs_token();
            sleep(ms);
        }
        // Never drawn: logged by the watch.
        Fault::Failover => {}
        Fault::GatewayDelay {
            envoy,
            ms,
            delay_ms,
        } => {
            t.relays[envoy].set_delay_ms(delay_ms);
            sleep(ms);
            t.relays[envoy].set_delay_ms(0);
        }
    }
    let end_ns = clock_ns();
    if let Fault::TokenRevoked { .. } = fault {
        log.replaced_logs
            .push(("envoy rlqs".into(), t.rlqs.process.log()));
        t.issue_rlqs_token();
    }
    recover(t);
    Caused {
        fault,
        start_ns,
        end_ns,
        recovered_ns: clock_ns(),
        failover: t.primary() != primary_before,
    }
}

/// Waits until the Sentinels agree on a primary that answers with no failover under way, its
/// replica is linked, and every sidecar is ready. (A primary paused past Sentinel's down-after
/// was once logged "no failover" when it resumed, and failed over a second later: the checker
/// then granted nothing for the old primary deciding beside the new one.)
fn recover(t: &mut Topology) {
    match t.store {
        Store::Cluster => wait_until("the Cluster at rest", RECOVERY, || t.cluster_at_rest()),
        Store::Sentinel => recover_sentinel(t),
        // us's one node answers (a primary killed comes back empty, with no one to fail over to).
        Store::Regions => wait_until("us's Redis back", RECOVERY, || {
            t.nodes[0].cli(&["PING"]).contains("PONG")
        }),
    }
    let client = crate::http();
    for s in &t.sidecars {
        let url = format!("{}/readyz", s.sidecar.base_url());
        wait_until("the sidecars ready", RECOVERY, || {
            client
                .get(&url)
                .send()
                .is_ok_and(|r| r.status().is_success())
        });
    }
}

fn recover_sentinel(t: &mut Topology) {
    wait_until("a primary with its replica", RECOVERY, || {
        if !t.sentinels_at_rest() {
            return false;
        }
        let Some(p) = t.agreed_primary() else {
            return false;
        };
        let replica = &t.nodes[1 - p];
        // An old primary back on its own is made a replica at once (the Sentinels would, after
        // their next 10 s look at it): the orchestrator's part, not the fault's.
        if replica.cli(&["ROLE"]).starts_with("master") {
            replica.cli(&["REPLICAOF", "127.0.0.1", &t.nodes[p].port.to_string()]);
        }
        t.nodes[p].cli(&["ROLE"]).starts_with("master") && replica.linked()
    });
}

/// The filter's counters of Envoy `i` now ([`ENVOY_COUNTERS`]).
pub fn envoy_counters(t: &Topology, i: usize) -> Vec<(String, u64)> {
    ENVOY_COUNTERS
        .iter()
        .map(|c| (c.to_string(), t.envoys[i].counter(c)))
        .collect()
}

/// Sidecar `i`'s calls refused as malformed or too large: `ratelimit_calls_total` of outcome
/// `bad_request`, over its APIs ([`CALLS_REFUSED`]).
pub fn calls_refused(t: &Topology, i: usize) -> u64 {
    metric_sum(t, i, |l| {
        l.starts_with("ratelimit_calls_total{") && l.contains("outcome=\"bad_request\"")
    })
}

/// The quota streams sidecar `i` opened ([`RLQS_STREAMS_OPENED`]).
pub fn rlqs_streams_opened(t: &Topology, i: usize) -> u64 {
    metric_sum(t, i, |l| {
        l.starts_with("ratelimit_rlqs_streams_opened_total ")
    })
}

/// The sum of sidecar `i`'s metric lines `pick` picks.
fn metric_sum(t: &Topology, i: usize, pick: impl Fn(&str) -> bool) -> u64 {
    let url = format!("{}/metrics", t.sidecars[i].sidecar.base_url());
    let text = crate::http()
        .get(url)
        .send()
        .and_then(|r| r.text())
        .unwrap_or_default();
    text.lines()
        .filter(|l| pick(l))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Adds Envoy `i`'s counters to `into`, under their names (summed over the Envoys) and as
/// `<name>@<i>` (its own: [`super::topology::LLM_ENVOY`] alone carries `llm`).
pub fn add_envoy_counters(into: &mut Vec<(String, u64)>, t: &Topology, i: usize) {
    for (name, v) in envoy_counters(t, i) {
        add(into, &name, v);
        add(into, &format!("{name}@{i}"), v);
    }
}

/// Adds `v` to the counter `name` of `into`.
pub fn add(into: &mut Vec<(String, u64)>, name: &str, v: u64) {
    match into.iter_mut().find(|(n, _)| n == name) {
        Some((_, total)) => *total += v,
        None => into.push((name.to_string(), v)),
    }
}
