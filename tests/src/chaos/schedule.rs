//! A run's plan, drawn from its seed: which store policy the sidecars run, and when each fault
//! and each policy reload happens. The same seed always gives the same plan (the processes' own
//! timing does not repeat: the plan does). Faults do not overlap, so each has recovered before
//! the next and the checker can name the fault an excess happened under.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How many sidecars and Envoys the topology has (the nemesis picks among them).
pub const SIDECARS: usize = 2;
pub const ENVOYS: usize = 2;

/// The apps the workload names (API keys): one hot, the rest quiet.
pub const HOT: &str = "hot";
/// A steady app below its own larger bucket ([`WARM_BUCKET`]): busy enough for leases of many
/// tokens, which a `blocked` reload must stop within its grace.
pub const WARM: &str = "warm";
/// `warm`'s bucket (an override of `per-app`): capacity and refill per second.
pub const WARM_BUCKET: (u64, f64) = (2_000, 100.0);
pub const QUIET: [&str; 6] = ["q0", "q1", "q2", "q3", "q4", "q5"];

/// `--store-reset` of the run's sidecars.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreReset {
    Full,
    Empty,
}

impl StoreReset {
    pub fn arg(self) -> &'static str {
        match self {
            StoreReset::Full => "full",
            StoreReset::Empty => "empty",
        }
    }
}

/// Of every eight seeds, the two that run on two regions ([`Store::Regions`]); the first of
/// them under `--store-reset full` whatever its draw: a share record restored from a snapshot
/// reaches a new client's bucket under `full` only (under `empty` that bucket starts empty
/// after the restore).
pub const REGIONS_SEEDS: [u64; 2] = [6, 7];

/// What the sidecars store their buckets in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    /// A primary, its replica and three Sentinels.
    Sentinel,
    /// Three primaries, each with a replica: a fault of "the primary" hits the one serving the
    /// hot app's bucket.
    Cluster,
    /// Two regions, each a Redis of its own (no replica): `us` under both sidecars, where the
    /// faults of "the primary" go, and `eu` under a third sidecar; the rebalancer moves a
    /// regional rule's shares between them.
    Regions,
}

impl Store {
    /// Every fourth seed runs on a Cluster, two in eight on two regions (from the seed alone:
    /// the rest of a plan drawn before these variants existed stays the same).
    pub fn of_seed(seed: u64) -> Store {
        if seed.is_multiple_of(4) {
            Store::Cluster
        } else if REGIONS_SEEDS.contains(&(seed % 8)) {
            Store::Regions
        } else {
            Store::Sentinel
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Store::Sentinel => "Sentinel",
            Store::Cluster => "Cluster",
            Store::Regions => "two regions",
        }
    }
}

/// Something the nemesis breaks, for a while.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// A sidecar frozen (SIGSTOP) for `ms`.
    SidecarPause { sidecar: usize, ms: u64 },
    /// A sidecar killed (SIGKILL), started again after `down_ms`.
    SidecarRestart { sidecar: usize, down_ms: u64 },
    /// The Redis primary frozen for `ms` (from 1 s on, Sentinel may fail over meanwhile).
    PrimaryPause { ms: u64 },
    /// The Redis primary killed: Sentinel promotes the replica; the old primary comes back as a
    /// replica after `down_ms`.
    PrimaryKill { down_ms: u64 },
    /// Every key of the primary flushed (`FLUSHALL`).
    StoreFlush,
    /// The primary restarted without its data.
    StoreRestartEmpty,
    /// The primary restarted from a snapshot taken `age_ms` before.
    StoreSnapshotRestore { age_ms: u64 },
    /// An Envoy stopped and started again on its ports: a wasm one (below [`ENVOYS`]), the
    /// native one or the RLQS one (the workload's indexes,
    /// [`super::topology::NATIVE_ENVOY`], [`super::topology::RLQS_ENVOY`]).
    EnvoyRestart { envoy: usize },
    /// The path from an Envoy to its sidecar cut for `ms` (connections dropped, new ones
    /// refused).
    GatewayCut { envoy: usize, ms: u64 },
    /// The answers from its sidecar to an Envoy dropped for `ms` (its calls still arrive and
    /// are decided: the sidecar charges what the Envoy never hears of), then the path's
    /// connections cut (their streams lost bytes).
    AnswersLost { envoy: usize, ms: u64 },
    /// A sidecar's wall clock stepped by `seconds` (forward or back) for `ms`, then back
    /// (libfaketime; its monotonic clock runs on, as a host's does when NTP steps the time).
    ClockStep {
        sidecar: usize,
        seconds: i64,
        ms: u64,
    },
    /// A sidecar's path to Redis cut for `ms` (its connections to every node and Sentinel
    /// dropped, new ones closed at once); the other sidecar's stays.
    RedisCut { sidecar: usize, ms: u64 },
    /// A sidecar's path to Redis delayed by `delay_ms` each way for `ms` (around its
    /// `--redis-timeout-ms`: some calls time out, and their writes land after the answer).
    RedisDelay {
        sidecar: usize,
        ms: u64,
        delay_ms: u64,
    },
    /// The RLQS Envoy's bearer token rotated out of the sidecars' token file under its live
    /// stream for `ms` (it goes on sending it: its stream ends, its new ones are refused), then
    /// a new token issued and the Envoy restarted with it.
    TokenRevoked { ms: u64 },
    /// The path from an Envoy to its sidecar delayed by `delay_ms` each way for `ms`.
    GatewayDelay {
        envoy: usize,
        ms: u64,
        delay_ms: u64,
    },
    /// A failover the Sentinels made while no fault was under way, or after its fault was
    /// logged over: never drawn, logged when the nemesis's watch sees the primary change.
    Failover,
}

impl Fault {
    /// The fault's class, as the run's table names it.
    pub fn class(&self) -> &'static str {
        match self {
            Fault::SidecarPause { .. } => "sidecar paused",
            Fault::SidecarRestart { .. } => "sidecar killed",
            Fault::PrimaryPause { .. } => "primary paused",
            Fault::PrimaryKill { .. } => "primary killed (failover)",
            Fault::StoreFlush => "store flushed",
            Fault::StoreRestartEmpty => "store restarted empty",
            Fault::StoreSnapshotRestore { .. } => "store restored from a snapshot",
            Fault::EnvoyRestart { .. } => "Envoy restarted",
            Fault::GatewayCut { .. } => "gateway cut from its sidecar",
            Fault::GatewayDelay { .. } => "gateway delayed to its sidecar",
            Fault::AnswersLost { .. } => "answers lost to a gateway",
            Fault::ClockStep { .. } => "wall clock stepped on a sidecar",
            Fault::TokenRevoked { .. } => "RLQS token rotated out",
            Fault::RedisCut { .. } => "sidecar cut from Redis",
            Fault::RedisDelay { .. } => "sidecar delayed to Redis",
            Fault::Failover => "failover without a fault",
        }
    }

    /// Every class, in table order.
    pub const CLASSES: [&'static str; 16] = [
        "sidecar paused",
        "sidecar killed",
        "primary paused",
        "primary killed (failover)",
        "store flushed",
        "store restarted empty",
        "store restored from a snapshot",
        "Envoy restarted",
        "gateway cut from its sidecar",
        "gateway delayed to its sidecar",
        "answers lost to a gateway",
        "wall clock stepped on a sidecar",
        "RLQS token rotated out",
        "sidecar cut from Redis",
        "sidecar delayed to Redis",
        "failover without a fault",
    ];

    /// How long the fault itself lasts, in ms (its recovery comes after).
    pub fn lasts_ms(&self) -> u64 {
        match *self {
            Fault::SidecarPause { ms, .. }
            | Fault::PrimaryPause { ms }
            | Fault::GatewayCut { ms, .. }
            | Fault::AnswersLost { ms, .. }
            | Fault::ClockStep { ms, .. }
            | Fault::TokenRevoked { ms }
            | Fault::RedisCut { ms, .. }
            | Fault::RedisDelay { ms, .. }
            | Fault::GatewayDelay { ms, .. } => ms,
            Fault::SidecarRestart { down_ms, .. } | Fault::PrimaryKill { down_ms } => down_ms,
            Fault::StoreFlush
            | Fault::StoreRestartEmpty
            | Fault::StoreSnapshotRestore { .. }
            | Fault::EnvoyRestart { .. }
            | Fault::Failover => 0,
        }
    }

    /// Whether the store may afterwards hold less than it was charged: the bucket then gets
    /// the README's allowance for a store that lost its state, or for a failover.
    pub fn loses_store_state(&self) -> bool {
        matches!(
            self,
            Fault::PrimaryPause { .. }
                | Fault::PrimaryKill { .. }
                | Fault::StoreFlush
                | Fault::StoreRestartEmpty
                | Fault::StoreSnapshotRestore { .. }
                | Fault::Failover
        )
    }

    /// A failover (asynchronous replication): each client may get back what it spent in the
    /// replication lag, at most its capacity, under either store policy.
    pub fn is_failover(&self) -> bool {
        matches!(self, Fault::PrimaryPause { ms } if *ms >= 1_000)
            || matches!(self, Fault::PrimaryKill { .. } | Fault::Failover)
    }
}

/// A change of the policy file (written to every sidecar's copy).
#[derive(Debug, Clone, PartialEq)]
pub enum Reload {
    /// `per-app`'s capacity and refill.
    PerApp { capacity: u64, refill_per_sec: f64 },
    /// The hot app blocked (`blocked: true` override), or not.
    Block(bool),
    /// `inflight`'s `slot_ttl_ms`.
    SlotTtl(u64),
    /// Rule `per-user` in the policy (added back), or removed from it.
    PerUser(bool),
}

/// One thing the nemesis does.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Fault(Fault),
    Reload(Reload),
    /// A snapshot of the primary, for a later [`Fault::StoreSnapshotRestore`].
    Snapshot,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub at_ms: u64,
    pub action: Action,
}

/// A run's plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub seed: u64,
    pub seconds: u64,
    pub store_reset: StoreReset,
    pub store: Store,
    /// In time order.
    pub steps: Vec<Step>,
}

/// The policy `per-app` starts with.
pub const PER_APP: (u64, f64) = (20, 10.0);

impl Plan {
    /// The plan of `seed` for a run of `seconds`.
    pub fn draw(seed: u64, seconds: u64) -> Plan {
        let mut rng = StdRng::seed_from_u64(seed);
        // Variations of a drawn fault, from a generator of their own: the plans drawn before
        // they existed keep every step and time ([`vary`]).
        let mut more = StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
        let store = Store::of_seed(seed);
        let store_reset = if rng.random_bool(0.5) && seed % 8 != REGIONS_SEEDS[0] {
            StoreReset::Empty
        } else {
            StoreReset::Full
        };
        let end_ms = seconds * 1000;
        // The last third is calm: reloads only, twice as often. Without a fault there is no
        // allowance, so what a reload alone breaks shows there (a request holding its slot
        // through every fault's aftermath would otherwise always be granted another in its
        // place).
        let calm_ms = end_ms - end_ms / 3;
        let mut steps = Vec::new();
        // Faults one after the other, each given time to recover (a failover takes seconds).
        let mut at = 3_000 + rng.random_range(0..2_000);
        while at + 4_000 < calm_ms {
            // A fault ends 3 s before the calm third at the latest.
            let room_ms = calm_ms - at - 3_000;
            let mut fault = vary(draw_fault(&mut rng), &mut more, room_ms);
            // On two regions us's Redis keeps its share records, as docs/regions.md requires (a
            // loss of them leaves the region's regional rules unavailable until an operator
            // writes them again): every loss of its state is a restore from a snapshot.
            if store == Store::Regions
                && matches!(
                    fault,
                    Fault::StoreFlush | Fault::StoreRestartEmpty | Fault::PrimaryKill { .. }
                )
            {
                fault = Fault::StoreSnapshotRestore {
                    age_ms: more.random_range(500..3_000),
                };
            }
            if let Fault::StoreSnapshotRestore { age_ms } = fault {
                steps.push(Step {
                    at_ms: at.saturating_sub(age_ms),
                    action: Action::Snapshot,
                });
            }
            let gap = fault.lasts_ms() + if fault.is_failover() { 6_000 } else { 3_000 };
            steps.push(Step {
                at_ms: at,
                action: Action::Fault(fault),
            });
            at += gap + rng.random_range(0..2_000);
        }
        // Reloads, independent of the faults.
        let mut at = 2_000 + rng.random_range(0..3_000);
        while at + 2_000 < end_ms {
            let reload = match rng.random_range(0..6) {
                0 => Reload::PerApp {
                    capacity: rng.random_range(5..=40),
                    refill_per_sec: f64::from(rng.random_range(2u32..=20)),
                },
                1 => Reload::Block(true),
                2 => Reload::Block(false),
                3 => Reload::PerUser(rng.random_bool(0.5)),
                _ => Reload::SlotTtl(*[1_000, 3_000, 9_000].get(rng.random_range(0..3)).unwrap()),
            };
            steps.push(Step {
                at_ms: at,
                action: Action::Reload(reload),
            });
            let gap = if at < calm_ms { 4_000 } else { 2_000 };
            at += gap + rng.random_range(0..4_000);
        }
        steps.sort_by_key(|s| s.at_ms);
        Plan {
            seed,
            seconds,
            store_reset,
            store,
            steps,
        }
    }

    /// The faults of the plan, with their index among the steps.
    pub fn faults(&self) -> impl Iterator<Item = (usize, &Fault)> {
        self.steps
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match &s.action {
                Action::Fault(f) => Some((i, f)),
                _ => None,
            })
    }

    /// The plan without step `i` (and, for a snapshot restore, the snapshot it needs).
    pub fn without(&self, i: usize) -> Plan {
        let mut steps = self.steps.clone();
        let removed = steps.remove(i);
        if let Action::Fault(Fault::StoreSnapshotRestore { age_ms }) = removed.action {
            let at = removed.at_ms.saturating_sub(age_ms);
            if let Some(j) = steps
                .iter()
                .position(|s| s.at_ms == at && s.action == Action::Snapshot)
            {
                steps.remove(j);
            }
        }
        Plan {
            steps,
            ..self.clone()
        }
    }

    /// The plan as lines, for the report (and to re-run it by eye).
    pub fn describe(&self) -> String {
        let mut out = format!(
            "seed {} ({} s, --store-reset {}, Redis {})\n",
            self.seed,
            self.seconds,
            self.store_reset.arg(),
            self.store.name()
        );
        for s in &self.steps {
            out += &format!("  {:>6} ms  {:?}\n", s.at_ms, s.action);
        }
        out
    }
}

/// Half the Envoy restarts hit the native or the RLQS Envoy instead of a wasm one, half the
/// cuts lose only the answers, and half the delays are a step of the sidecar's wall clock
/// instead (10 minutes to 2 hours, forward or back); of the cuts and delays left, half rotate
/// the RLQS Envoy's token out for 16 to 24 s where `room_ms` (before the calm third) holds 10 s
/// (long enough for what a stream that outlived its token admits to pass what the Envoy's
/// fallback may); and half the sidecar restarts cut that sidecar from Redis instead, for 0.5 to
/// 3 s, or, when that length is odd in milliseconds (no new draw: the plans drawn before stay
/// the same), delay its path to Redis by 20 to 99 ms each way (around `--redis-timeout-ms`).
fn vary(fault: Fault, more: &mut StdRng, room_ms: u64) -> Fault {
    let fault = vary_first(fault, more);
    match fault {
        Fault::SidecarRestart { sidecar, .. } if more.random_bool(0.5) => {
            let ms = more.random_range(500..3_000);
            if ms % 2 == 1 {
                Fault::RedisDelay {
                    sidecar,
                    ms,
                    delay_ms: 20 + ms % 80,
                }
            } else {
                Fault::RedisCut { sidecar, ms }
            }
        }
        Fault::GatewayCut { .. } | Fault::GatewayDelay { .. } if more.random_bool(0.5) => {
            let ms = more.random_range(16_000..24_000).min(room_ms);
            if ms >= 10_000 {
                Fault::TokenRevoked { ms }
            } else {
                fault
            }
        }
        f => f,
    }
}

/// [`vary`]'s first variations, drawn as before the token's rotation existed.
fn vary_first(fault: Fault, more: &mut StdRng) -> Fault {
    match fault {
        Fault::GatewayDelay { envoy, ms, .. } if more.random_bool(0.5) => {
            let seconds = more.random_range(600..7_200);
            Fault::ClockStep {
                sidecar: envoy % SIDECARS,
                seconds: if more.random_bool(0.5) {
                    seconds
                } else {
                    -seconds
                },
                ms,
            }
        }
        Fault::EnvoyRestart { .. } if more.random_bool(0.5) => Fault::EnvoyRestart {
            envoy: ENVOYS + more.random_range(0..2),
        },
        Fault::GatewayCut { envoy, ms } if more.random_bool(0.5) => {
            Fault::AnswersLost { envoy, ms }
        }
        f => f,
    }
}

fn draw_fault(rng: &mut StdRng) -> Fault {
    let sidecar = rng.random_range(0..SIDECARS);
    let envoy = rng.random_range(0..ENVOYS);
    match rng.random_range(0..10) {
        0 => Fault::SidecarPause {
            sidecar,
            ms: rng.random_range(100..1_500),
        },
        1 => Fault::SidecarRestart {
            sidecar,
            down_ms: rng.random_range(200..2_000),
        },
        2 => Fault::PrimaryPause {
            ms: rng.random_range(100..2_500),
        },
        3 => Fault::PrimaryKill {
            down_ms: rng.random_range(1_000..3_000),
        },
        4 => Fault::StoreFlush,
        5 => Fault::StoreRestartEmpty,
        6 => Fault::StoreSnapshotRestore {
            age_ms: rng.random_range(500..3_000),
        },
        7 => Fault::EnvoyRestart { envoy },
        8 => Fault::GatewayCut {
            envoy,
            ms: rng.random_range(100..2_000),
        },
        _ => Fault::GatewayDelay {
            envoy,
            ms: rng.random_range(500..2_000),
            delay_ms: rng.random_range(5..80),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_always_draws_the_same_plan_and_faults_never_overlap() {
        for seed in 0..50 {
            let a = Plan::draw(seed, 60);
            assert_eq!(a, Plan::draw(seed, 60), "seed {seed}");
            let faults: Vec<(u64, u64)> = a
                .steps
                .iter()
                .filter_map(|s| match &s.action {
                    Action::Fault(f) => Some((s.at_ms, s.at_ms + f.lasts_ms())),
                    _ => None,
                })
                .collect();
            assert!(!faults.is_empty(), "seed {seed}: no fault");
            for w in faults.windows(2) {
                assert!(w[0].1 + 3_000 <= w[1].0, "seed {seed}: {w:?}");
            }
            assert!(faults.last().unwrap().1 <= 60_000);
        }
        assert_ne!(Plan::draw(1, 60), Plan::draw(2, 60));
    }

    #[test]
    fn the_last_third_is_calm_reloads_only() {
        for seed in 0..50 {
            let plan = Plan::draw(seed, 60);
            let last_fault = plan
                .steps
                .iter()
                .filter(|s| matches!(s.action, Action::Fault(_)))
                .map(|s| s.at_ms + 3_000)
                .max();
            assert!(
                last_fault.is_some_and(|at| at <= 40_000),
                "seed {seed}: {plan:?}"
            );
            // A rotated token is issued again before it.
            for s in &plan.steps {
                if let Action::Fault(f @ Fault::TokenRevoked { .. }) = &s.action {
                    assert!(
                        s.at_ms + f.lasts_ms() + 3_000 <= 40_000,
                        "seed {seed}: {s:?}"
                    );
                }
            }
            let calm_reloads = plan.steps.iter().filter(|s| s.at_ms > 40_000).count();
            assert!(calm_reloads >= 2, "seed {seed}: {plan:?}");
        }
    }

    #[test]
    fn plans_restart_every_kind_of_envoy_lose_answers_and_run_clusters_and_regions() {
        let plans: Vec<Plan> = (0..100).map(|s| Plan::draw(s, 120)).collect();
        let any = |f: &dyn Fn(&Fault) -> bool| plans.iter().any(|p| p.faults().any(|(_, x)| f(x)));
        for target in [0, ENVOYS, ENVOYS + 1] {
            assert!(
                any(&|f| matches!(f, Fault::EnvoyRestart { envoy } if *envoy == target)),
                "no plan restarts Envoy {target}"
            );
        }
        assert!(any(&|f| matches!(f, Fault::AnswersLost { .. })));
        assert!(any(&|f| matches!(f, Fault::TokenRevoked { .. })));
        assert!(any(&|f| matches!(f, Fault::RedisCut { .. })));
        assert!(any(&|f| matches!(f, Fault::RedisDelay { .. })));
        assert!(any(
            &|f| matches!(f, Fault::ClockStep { seconds, .. } if *seconds < 0)
        ));
        assert!(any(
            &|f| matches!(f, Fault::ClockStep { seconds, .. } if *seconds > 0)
        ));
        assert!(any(&|f| matches!(f, Fault::GatewayCut { .. })));
        // The native and RLQS Envoys call their sidecars straight: no relay to cut.
        assert!(!any(&|f| matches!(
            f,
            Fault::GatewayCut { envoy, .. }
                | Fault::AnswersLost { envoy, .. }
                | Fault::GatewayDelay { envoy, .. } if *envoy >= ENVOYS
        )));
        for p in &plans {
            assert_eq!(
                p.store == Store::Cluster,
                p.seed % 4 == 0,
                "seed {}",
                p.seed
            );
            assert_eq!(
                p.store == Store::Regions,
                p.seed % 8 == 6 || p.seed % 8 == 7,
                "seed {}",
                p.seed
            );
            if p.seed % 8 == 6 {
                assert_eq!(p.store_reset, StoreReset::Full, "seed {}", p.seed);
            }
            // us's share records are never lost on two regions: its losses are restores.
            if p.store == Store::Regions {
                assert!(
                    !p.faults().any(|(_, f)| matches!(
                        f,
                        Fault::StoreFlush | Fault::StoreRestartEmpty | Fault::PrimaryKill { .. }
                    )),
                    "seed {}",
                    p.seed
                );
            }
        }
    }

    #[test]
    fn a_step_dropped_takes_its_snapshot_with_it() {
        let plan = (0..200)
            .map(|s| Plan::draw(s, 120))
            .find(|p| {
                p.faults()
                    .any(|(_, f)| matches!(f, Fault::StoreSnapshotRestore { .. }))
            })
            .expect("some seed restores a snapshot");
        let (i, _) = plan
            .faults()
            .find(|(_, f)| matches!(f, Fault::StoreSnapshotRestore { .. }))
            .unwrap();
        let snapshots = |p: &Plan| {
            p.steps
                .iter()
                .filter(|s| s.action == Action::Snapshot)
                .count()
        };
        let fewer = plan.without(i);
        assert_eq!(fewer.steps.len(), plan.steps.len() - 2);
        assert_eq!(snapshots(&fewer), snapshots(&plan) - 1);
    }
}
