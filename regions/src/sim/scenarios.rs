//! The scenarios: regions, their demand over time, its shifts and the faults between the
//! rebalancer and the regions.

use super::*;

/// From `at_ms` on, `busy` (a region's index) has the most demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shift {
    pub at_ms: u64,
    pub busy: usize,
}

/// Something between the rebalancer and a region that goes wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The rebalancer cannot reach `region` in `[from_ms, until_ms)`: reads fail, writes get no
    /// answer and are not applied. The region itself keeps working.
    CutOff {
        region: usize,
        from_ms: u64,
        until_ms: u64,
    },
    /// Writes of `kind` to `region` sent in `[from_ms, until_ms)` get no answer; the store
    /// applies them `lands_after_ms` later, or never.
    NoAnswer {
        region: usize,
        kind: WriteKind,
        from_ms: u64,
        until_ms: u64,
        lands_after_ms: Option<u64>,
    },
}

/// Demand of region `index` at `t_ms`, in requests (of cost 1) per second.
pub type Demand = fn(index: usize, t_ms: u64, duration_ms: u64) -> f64;

/// A scenario: regions, their demand over time, its shifts and its faults.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: &'static str,
    pub regions: Vec<&'static str>,
    pub demand: Demand,
    pub shifts: Vec<Shift>,
    pub faults: Vec<Fault>,
}

pub(super) const REGIONS: [&str; 3] = ["eu", "us", "ap"];

pub(super) fn steady(i: usize, _t: u64, _d: u64) -> f64 {
    [50.0, 25.0, 15.0][i]
}

pub(super) fn step(i: usize, t: u64, d: u64) -> f64 {
    if t < d / 3 {
        [60.0, 20.0, 15.0][i]
    } else {
        [15.0, 80.0, 15.0][i]
    }
}

/// The diurnal period: two per run.
pub(super) fn day_ms(d: u64) -> u64 {
    d / 2
}

pub(super) fn diurnal(i: usize, t: u64, d: u64) -> f64 {
    let phase = t as f64 / day_ms(d) as f64 - i as f64 / 3.0;
    30.0 * (1.0 + 0.8 * (std::f64::consts::TAU * phase).cos())
}

/// The scenarios the simulation runs, for a run of `duration_ms` (shifts at fixed fractions of
/// it; faults in windows of fixed length after the shift).
pub fn scenarios(duration_ms: u64) -> Vec<Scenario> {
    let d = duration_ms;
    let shift = d / 3;
    let step_shifts = vec![
        Shift { at_ms: 0, busy: 0 },
        Shift {
            at_ms: shift,
            busy: 1,
        },
    ];
    // The busiest region changes halfway between two peaks (peaks of region i at i/3 of a day).
    let day = day_ms(d);
    let mut diurnal_shifts = vec![Shift { at_ms: 0, busy: 0 }];
    let mut k = 0;
    while day / 6 + k * day / 3 < d {
        diurnal_shifts.push(Shift {
            at_ms: day / 6 + k * day / 3,
            busy: (k as usize + 1) % 3,
        });
        k += 1;
    }
    vec![
        Scenario {
            name: "steady",
            regions: REGIONS.to_vec(),
            demand: steady,
            shifts: vec![Shift { at_ms: 0, busy: 0 }],
            faults: vec![],
        },
        Scenario {
            name: "step eu->us",
            regions: REGIONS.to_vec(),
            demand: step,
            shifts: step_shifts.clone(),
            faults: vec![],
        },
        Scenario {
            name: "diurnal",
            regions: REGIONS.to_vec(),
            demand: diurnal,
            shifts: diurnal_shifts,
            faults: vec![],
        },
        Scenario {
            name: "eu cut off",
            regions: REGIONS.to_vec(),
            demand: step,
            shifts: step_shifts.clone(),
            faults: vec![Fault::CutOff {
                region: 0,
                from_ms: d / 4,
                until_ms: d / 2,
            }],
        },
        Scenario {
            name: "failed steps",
            regions: REGIONS.to_vec(),
            demand: step,
            shifts: step_shifts,
            faults: vec![
                // The donor shrank, the recipient's write is lost.
                Fault::NoAnswer {
                    region: 1,
                    kind: WriteKind::Grow,
                    from_ms: shift,
                    until_ms: shift + 20_000,
                    lands_after_ms: None,
                },
                // The recipient's write lands, 2 s after the rebalancer gave up on it.
                Fault::NoAnswer {
                    region: 1,
                    kind: WriteKind::Grow,
                    from_ms: shift + 20_000,
                    until_ms: shift + 40_000,
                    lands_after_ms: Some(2_000),
                },
                // The donor's write lands, 3 s after the rebalancer gave up on it.
                Fault::NoAnswer {
                    region: 0,
                    kind: WriteKind::Shrink,
                    from_ms: shift + 40_000,
                    until_ms: shift + 60_000,
                    lands_after_ms: Some(3_000),
                },
            ],
        },
    ]
}
