//! The simulation behind `ratelimit-regions-sim`: N regions over simulated time, each with its
//! store (the share record and its history), its sidecars (each with its own leased copy of the
//! record, re-read every `lease_ms / 2` at its own phase) and its bucket, demand that shifts
//! between regions, and faults between the rebalancer and the regions. Deterministic for a seed;
//! time advances in steps of 1 ms.
//!
//! What it measures, per scenario, for static and for rebalanced shares:
//! - over-admission: the merged sequence of admitted requests of all regions fed through one
//!   exact global bucket (`C`, `R`); what that bucket would reject (must be 0);
//! - under-admission: what one ideal global bucket fed with all the demand admits, minus what the
//!   regions admitted;
//! - how fast shares follow demand: after each shift of demand, the time until the busy region's
//!   applied share is within 10% of its demand-proportional target;
//! - the largest sum, at any simulated millisecond, of the shares the regions' sidecars apply
//!   (per region, the largest any of its sidecars applies).

use std::collections::BTreeMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::bucket::{Bucket, Budget};
use crate::lease::{LeasedShare, ShareHistory};
use crate::plan::{proportional_target, Observation, Params};
use crate::quota::{QuotaError, RegionalQuota};
use crate::rebalancer::{ReadOutcome, Rebalancer, ShareWrite, Step, WriteKind, WriteOutcome};
use crate::share::{sum_ppm, Share, ShareRecord};

mod scenarios;

pub use self::scenarios::{scenarios, Demand, Fault, Scenario, Shift};

/// Everything a run depends on besides the scenario.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimConfig {
    /// Seeds the demand and the sidecars' read phases. Default 1.
    pub seed: u64,
    /// Simulated time per scenario. Default 600 s.
    pub duration_ms: u64,
    /// The rule's global budget. Default 1000 tokens, 100 per second: a full bucket takes 10 s to
    /// refill, longer than the fence, so a fence too short would show as over-admission.
    pub budget: Budget,
    /// The floor share. Default [`RegionalQuota::DEFAULT_FLOOR`].
    pub floor: Share,
    /// The rebalancer's parameters. Default [`Params::default`].
    pub params: Params,
    /// Sidecars per region, each with its own lease. Default 2.
    pub sidecars_per_region: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            seed: 1,
            duration_ms: 600_000,
            budget: Budget {
                capacity: 1000,
                refill_per_sec: 100,
            },
            floor: RegionalQuota::DEFAULT_FLOOR,
            params: Params::default(),
            sidecars_per_region: 2,
        }
    }
}

/// Static shares (the table as configured) or shares moved by the rebalancer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Static,
    Rebalanced,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Static => "static",
            Mode::Rebalanced => "rebalanced",
        }
    }
}

/// How fast shares followed demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Follow {
    /// After every shift, within this time (the slowest).
    Within(u64),
    /// After some shift, not before the next shift or the end.
    Never,
}

/// The figures of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub scenario: &'static str,
    pub mode: Mode,
    /// Requests offered, in all regions.
    pub offered: u64,
    /// Requests the regions admitted.
    pub admitted: u64,
    /// Requests one ideal global bucket fed with all the demand admits.
    pub ideal: u64,
    /// Admitted requests the exact global bucket would have rejected.
    pub over_admitted: u64,
    /// Answers "unavailable" (a sidecar whose lease ran out).
    pub unavailable: u64,
    /// How fast the busy region's share followed demand.
    pub follow: Follow,
    /// The largest sum of applied shares at any millisecond, in parts per million.
    pub max_share_sum_ppm: u64,
    /// Share writes the rebalancer sent, and of those, refused or unanswered.
    pub writes: u64,
    pub failed_writes: u64,
}

impl Report {
    /// `ideal - admitted`.
    pub fn under_admitted(&self) -> i64 {
        self.ideal as i64 - self.admitted as i64
    }

    /// Under-admission as a percentage of the ideal.
    pub fn under_admitted_pct(&self) -> f64 {
        100.0 * self.under_admitted() as f64 / self.ideal.max(1) as f64
    }
}

/// One region's store: the record and its history (stamped with the store's clock).
struct Store {
    record: ShareRecord,
    history: ShareHistory,
}

struct Sidecar {
    view: LeasedShare,
    next_read_ms: u64,
}

/// The state of one run.
struct World<'a> {
    scenario: &'a Scenario,
    config: &'a SimConfig,
    stores: Vec<Store>,
    sidecars: Vec<Vec<Sidecar>>,
    delayed: Vec<(u64, ShareWrite)>,
    /// Draws the sidecars' read times.
    reads: ChaCha8Rng,
    writes: u64,
    failed_writes: u64,
}

impl World<'_> {
    fn index(&self, region: &str) -> usize {
        self.scenario
            .regions
            .iter()
            .position(|&r| r == region)
            .unwrap_or(0)
    }

    fn cut_off(&self, region: usize, now_ms: u64) -> bool {
        self.scenario.faults.iter().any(|f| {
            matches!(*f, Fault::CutOff { region: r, from_ms, until_ms }
                if r == region && (from_ms..until_ms).contains(&now_ms))
        })
    }

    /// A write reaching the store at `now_ms`: applied if its version is newer.
    fn apply(&mut self, write: &ShareWrite, now_ms: u64) -> bool {
        let horizon = self.config.budget.fill_time_ms();
        let index = self.index(&write.region);
        let store = &mut self.stores[index];
        if !store.record.accepts(write.version) {
            return false;
        }
        store.record = ShareRecord {
            share: write.share,
            version: write.version,
        };
        store.history.record(now_ms, write.share);
        store
            .history
            .forget_before(now_ms.saturating_sub(horizon + self.config.params.lease_ms));
        true
    }

    /// Sends `write` at `now_ms` through the scenario's faults.
    fn send(&mut self, write: &ShareWrite, now_ms: u64) -> WriteOutcome {
        self.writes += 1;
        let region = self.index(&write.region);
        let lost = self.scenario.faults.iter().find_map(|f| match *f {
            Fault::CutOff { .. } if self.cut_off(region, now_ms) => Some(None),
            Fault::NoAnswer {
                region: r,
                kind,
                from_ms,
                until_ms,
                lands_after_ms,
            } if r == region && kind == write.kind && (from_ms..until_ms).contains(&now_ms) => {
                Some(lands_after_ms)
            }
            _ => None,
        });
        let outcome = match lost {
            Some(lands) => {
                if let Some(after) = lands {
                    self.delayed.push((now_ms + after, write.clone()));
                }
                WriteOutcome::Unknown
            }
            None if self.apply(write, now_ms) => WriteOutcome::Written,
            None => WriteOutcome::Refused,
        };
        if outcome != WriteOutcome::Written {
            self.failed_writes += 1;
        }
        outcome
    }

    fn land_delayed(&mut self, now_ms: u64) {
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.delayed)
            .into_iter()
            .partition(|(at, _)| *at <= now_ms);
        self.delayed = later;
        for (_, write) in due {
            self.apply(&write, now_ms);
        }
    }

    /// Each sidecar re-reads its region's record at its own times, between a quarter and a half
    /// of the lease apart.
    fn refresh_sidecars(&mut self, now_ms: u64) {
        let half = (self.config.params.lease_ms / 2).max(1);
        for (r, sidecars) in self.sidecars.iter_mut().enumerate() {
            for sidecar in sidecars.iter_mut().filter(|s| now_ms >= s.next_read_ms) {
                let store = &self.stores[r];
                sidecar.view = LeasedShare {
                    history: store.history.clone(),
                    version: store.record.version,
                    read_at_ms: now_ms,
                };
                sidecar.next_read_ms = now_ms + self.reads.random_range(half.div_ceil(2)..=half);
            }
        }
    }

    /// Per region, the largest share any of its sidecars applies.
    fn applied_sum_ppm(&self, now_ms: u64) -> u64 {
        let lease = self.config.params.lease_ms;
        sum_ppm(self.sidecars.iter().map(|sidecars| {
            sidecars
                .iter()
                .filter_map(|s| s.view.applicable(now_ms, lease))
                .max()
                .unwrap_or(Share::ZERO)
        }))
    }

    /// The share every sidecar of `region` applies (the smallest of them).
    fn applied_share(&self, region: usize, now_ms: u64) -> Share {
        let lease = self.config.params.lease_ms;
        self.sidecars[region]
            .iter()
            .map(|s| s.view.applicable(now_ms, lease).unwrap_or(Share::ZERO))
            .min()
            .unwrap_or(Share::ZERO)
    }
}

/// Runs `scenario` for `config.duration_ms` with static or rebalanced shares, starting from
/// equal shares; `Err` when the budget or the floor cannot make a valid quota.
pub fn run(scenario: &Scenario, mode: Mode, config: &SimConfig) -> Result<Report, QuotaError> {
    let quota = RegionalQuota::equal(
        scenario.name,
        config.budget,
        config.floor,
        scenario.regions.iter().copied(),
    )?;
    let n = scenario.regions.len();
    let params = config.params;
    let budget = config.budget;
    let horizon = budget.fill_time_ms();
    let start = |i: usize| ShareRecord {
        share: quota.share(scenario.regions[i]).unwrap_or(Share::ZERO),
        version: 1,
    };
    let mut reads = ChaCha8Rng::seed_from_u64(config.seed ^ 0x5ead_ca75);
    let mut world = World {
        scenario,
        config,
        stores: (0..n)
            .map(|i| Store {
                record: start(i),
                history: ShareHistory::new(0, start(i).share),
            })
            .collect(),
        sidecars: (0..n)
            .map(|i| {
                (0..config.sidecars_per_region.max(1))
                    .map(|_| Sidecar {
                        view: LeasedShare {
                            history: ShareHistory::new(0, start(i).share),
                            version: 1,
                            read_at_ms: 0,
                        },
                        next_read_ms: reads.random_range(1..=(params.lease_ms / 2).max(1)),
                    })
                    .collect()
            })
            .collect(),
        delayed: Vec::new(),
        reads,
        writes: 0,
        failed_writes: 0,
    };
    // The same demand and the same sidecar picks in both modes.
    let mut demand_rng: Vec<ChaCha8Rng> = (0..n)
        .map(|i| ChaCha8Rng::seed_from_u64(config.seed.wrapping_mul(1_000_003) + i as u64))
        .collect();
    let mut pick_rng = ChaCha8Rng::seed_from_u64(config.seed ^ 0x0051_dec0);
    let whole = budget.scaled(Share::WHOLE);
    let mut buckets: Vec<Bucket> = (0..n)
        .map(|i| Bucket::full(budget.scaled(start(i).share), 0))
        .collect();
    let mut global = Bucket::full(whole, 0);
    let mut ideal = Bucket::full(whole, 0);
    let mut rebalancer = (mode == Mode::Rebalanced).then(|| Rebalancer::new(params, &quota, 0));
    let mut counters = vec![Observation::default(); n];
    let mut report = Report {
        scenario: scenario.name,
        mode,
        offered: 0,
        admitted: 0,
        ideal: 0,
        over_admitted: 0,
        unavailable: 0,
        follow: Follow::Within(0),
        max_share_sum_ppm: 0,
        writes: 0,
        failed_writes: 0,
    };
    let mut follow = FollowClock::new(&scenario.shifts, config.duration_ms);

    for now in 0..config.duration_ms {
        world.land_delayed(now);
        if let Some(rb) = rebalancer.as_mut() {
            if now > 0 && now % params.round_interval_ms == 0 && rb.is_idle() {
                let mut observations = BTreeMap::new();
                for (i, &region) in scenario.regions.iter().enumerate() {
                    let read = if world.cut_off(i, now) {
                        ReadOutcome::Unreachable
                    } else {
                        observations.insert(region.to_owned(), counters[i]);
                        ReadOutcome::Record(world.stores[i].record)
                    };
                    rb.observe(region, read, now);
                    counters[i] = Observation {
                        interval_ms: params.round_interval_ms,
                        ..Observation::default()
                    };
                }
                let _ = rb.start_round(&observations, now);
            }
            while let Step::Write(writes) = rb.poll(now) {
                for write in writes {
                    let outcome = world.send(&write, now);
                    rb.written(&write, outcome, now);
                }
            }
        }
        world.refresh_sidecars(now);

        for (i, bucket) in buckets.iter_mut().enumerate() {
            let rate = (scenario.demand)(i, now, config.duration_ms);
            if demand_rng[i].random::<f64>() >= rate / 1000.0 {
                continue;
            }
            report.offered += 1;
            if ideal.take(whole, now, 1) {
                report.ideal += 1;
            }
            let sidecar = &world.sidecars[i][pick_rng.random_range(0..world.sidecars[i].len())];
            if sidecar.view.applicable(now, params.lease_ms).is_none() {
                report.unavailable += 1;
                continue;
            }
            let share = sidecar
                .view
                .history
                .min_since(bucket.updated_ms(), now, horizon);
            if bucket.take(budget.scaled(share), now, 1) {
                report.admitted += 1;
                counters[i].admitted += 1;
                if !global.take(whole, now, 1) {
                    report.over_admitted += 1;
                }
            } else {
                counters[i].rejected += 1;
            }
        }

        report.max_share_sum_ppm = report.max_share_sum_ppm.max(world.applied_sum_ppm(now));
        // Shares follow demand on the scale of seconds: looked at every 100 ms.
        follow.tick(now, now % 100 == 0, |busy| {
            let demands: Vec<f64> = (0..n)
                .map(|i| (scenario.demand)(i, now, config.duration_ms))
                .collect();
            let target = proportional_target(u64::from(Share::PPM), config.floor, &demands)[busy];
            let share = world.applied_share(busy, now);
            share.ppm().abs_diff(target.ppm()) as f64 <= 0.1 * f64::from(target.ppm())
        });
    }
    report.follow = follow.result();
    report.writes = world.writes;
    report.failed_writes = world.failed_writes;
    Ok(report)
}

/// After each shift, the time until the busy region's share is first near its target.
struct FollowClock<'a> {
    shifts: &'a [Shift],
    end_ms: u64,
    current: usize,
    reached: Vec<Option<u64>>,
}

impl<'a> FollowClock<'a> {
    fn new(shifts: &'a [Shift], end_ms: u64) -> Self {
        FollowClock {
            shifts,
            end_ms,
            current: 0,
            reached: vec![None; shifts.len()],
        }
    }

    fn tick(&mut self, now_ms: u64, look: bool, near_target: impl FnOnce(usize) -> bool) {
        while self
            .shifts
            .get(self.current + 1)
            .is_some_and(|s| s.at_ms <= now_ms)
        {
            self.current += 1;
        }
        let Some(shift) = self.shifts.get(self.current) else {
            return;
        };
        if look
            && now_ms >= shift.at_ms
            && self.reached[self.current].is_none()
            && near_target(shift.busy)
        {
            self.reached[self.current] = Some(now_ms - shift.at_ms);
        }
    }

    fn result(&self) -> Follow {
        let mut slowest = 0;
        for (shift, reached) in self.shifts.iter().zip(&self.reached) {
            if shift.at_ms >= self.end_ms {
                continue;
            }
            match reached {
                Some(ms) => slowest = slowest.max(*ms),
                None => return Follow::Never,
            }
        }
        Follow::Within(slowest)
    }
}
