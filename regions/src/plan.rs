//! The rebalancer's algorithm: from the shares regions hold and what they admitted and rejected
//! in the last interval, a [`Plan`] that moves unused share from donors to recipients.
//!
//! ```text
//! d_r    = (admitted_r + rejected_r) / interval             demand, tokens per second
//! u_r    = admitted_r / (R * interval)                       share actually used
//! P      = sum of the eligible regions' shares + slack       slack = 1 - sum of all shares
//! t_r    = max(floor, P * d_r / sum d)                       demand-proportional target
//! recipient: rejected_r / (admitted_r + rejected_r) >= recipient_reject_ratio
//!            and t_r - s_r >= min_move;          want_r = t_r - s_r
//! donor:     rejected_r = 0 and s_r - t_r >= min_move;
//!            give_r = step_fraction * min(s_r - t_r, s_r - u_r, s_r - floor)
//! moved  = min(sum want, slack + sum give), slack first; nothing if moved < min_move
//! ```
//!
//! Donors give in proportion to `give_r` and recipients receive in proportion to `want_r`, every
//! amount rounded down to a part per million. The plan shrinks before it grows and grows by no
//! more than the slack plus what it shrank, so every prefix of it keeps the sum of shares at or
//! below 1. A region that rejects anything is never a donor; a frozen region (unreachable, or
//! with a write whose outcome is unknown) is neither donor nor recipient, and counts at its
//! share. A donor never goes below what it used nor below the floor, and takes at most
//! `step_fraction` of its excess per round, so shares move geometrically toward the targets and
//! the dead band `min_move` keeps them still once there.

use crate::bucket::Budget;
use crate::share::{sum_ppm, Share};

/// The rebalancer's parameters. Every default is written once, here, in [`Params::default`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// `L`: how long a sidecar may apply a share it read; it re-reads every `lease_ms / 2`.
    /// Default 5000 ms.
    pub lease_ms: u64,
    /// Added to the lease before a recipient may grow: covers the difference in clock rates
    /// between the rebalancer and the sidecars over one lease, and the time a read takes to
    /// reach the store. Default 500 ms.
    pub fence_margin_ms: u64,
    /// Time between two rounds, and the interval the demand is observed over; at least the
    /// fence. Default 10000 ms.
    pub round_interval_ms: u64,
    /// The fraction of a donor's excess over its target (and over what it used) one round may
    /// take. Default 0.5.
    pub step_fraction: f64,
    /// A region is a recipient when at least this fraction of its decisions were rejected.
    /// Default 0.01.
    pub recipient_reject_ratio: f64,
    /// The dead band: a region whose share is closer than this to its target neither gives nor
    /// receives, and a round that would move less in all moves nothing. Default 0.01.
    pub min_move: Share,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            lease_ms: 5_000,
            fence_margin_ms: 500,
            round_interval_ms: 10_000,
            step_fraction: 0.5,
            recipient_reject_ratio: 0.01,
            min_move: Share::from_ppm(10_000).unwrap_or(Share::ZERO),
        }
    }
}

impl Params {
    /// How long after a donor's smaller share is written (and acknowledged) a recipient may grow:
    /// the lease plus the margin.
    pub fn fence_ms(&self) -> u64 {
        self.lease_ms.saturating_add(self.fence_margin_ms)
    }

    /// `Err` names every parameter that cannot be honoured.
    pub fn validate(&self) -> Result<(), String> {
        let mut problems = Vec::new();
        if self.lease_ms < 2 {
            problems.push("lease_ms: must be at least 2".to_owned());
        }
        if self.round_interval_ms < self.fence_ms() {
            problems.push(format!(
                "round_interval_ms: {} is shorter than the fence (lease_ms + fence_margin_ms = {})",
                self.round_interval_ms,
                self.fence_ms()
            ));
        }
        if !(self.step_fraction > 0.0 && self.step_fraction <= 1.0) {
            problems.push(format!(
                "step_fraction: {} must be in (0, 1]",
                self.step_fraction
            ));
        }
        if !(0.0..=1.0).contains(&self.recipient_reject_ratio) {
            problems.push(format!(
                "recipient_reject_ratio: {} must be in [0, 1]",
                self.recipient_reject_ratio
            ));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }
}

/// What one region's sidecars decided for one rule over `interval_ms` (the counters they
/// publish).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Observation {
    pub admitted: u64,
    pub rejected: u64,
    pub interval_ms: u64,
}

impl Observation {
    pub fn decisions(&self) -> u64 {
        self.admitted + self.rejected
    }

    /// Rejected decisions over all decisions (0 without decisions).
    pub fn reject_ratio(&self) -> f64 {
        match self.decisions() {
            0 => 0.0,
            n => self.rejected as f64 / n as f64,
        }
    }

    /// Demand in tokens (decisions of cost 1) per second: admitted and rejected.
    pub fn demand_per_sec(&self) -> f64 {
        self.decisions() as f64 * 1000.0 / self.interval_ms.max(1) as f64
    }

    /// The share of `budget` the admitted decisions used: `admitted / (R * interval)`.
    pub fn used_share(&self, budget: &Budget) -> f64 {
        self.admitted as f64 * 1000.0
            / (budget.refill_per_sec.max(1) as f64 * self.interval_ms.max(1) as f64)
    }
}

/// One region as the planner sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct RegionInput {
    pub region: String,
    /// The share the region holds (for a frozen region: the largest it may apply).
    pub share: Share,
    /// Unreachable, or a write to it has an unknown outcome: neither donor nor recipient.
    pub frozen: bool,
    /// Its decisions over the last interval (`None`: not known; the region is left alone).
    pub observation: Option<Observation>,
}

/// One region's share moving `from` -> `to`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub region: String,
    pub from: Share,
    pub to: Share,
}

/// What one round does: write every `shrink`, wait for the fence, then write every `grow`.
/// Applied in that order to the shares it was planned from, no prefix sums above 1.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    pub shrink: Vec<Change>,
    pub grow: Vec<Change>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.shrink.is_empty() && self.grow.is_empty()
    }

    /// The changes in the order they are written: shrinks, then grows.
    pub fn steps(&self) -> impl Iterator<Item = &Change> {
        self.shrink.iter().chain(&self.grow)
    }

    /// The share the plan moves (the sum of the grows).
    pub fn moved_ppm(&self) -> u64 {
        self.grow
            .iter()
            .map(|c| u64::from(c.to.saturating_sub(c.from).ppm()))
            .sum()
    }
}

/// Shares proportional to `demands` that sum to at most `pool_ppm`, none below `floor` (a
/// region whose proportional part falls below the floor gets the floor, and the others split
/// the rest). Without any demand, equal parts.
pub fn proportional_target(pool_ppm: u64, floor: Share, demands: &[f64]) -> Vec<Share> {
    let n = demands.len();
    if n == 0 {
        return Vec::new();
    }
    let floor_ppm = u64::from(floor.ppm()).min(pool_ppm / n as u64);
    let mut at_floor = vec![false; n];
    loop {
        let fixed = at_floor.iter().filter(|&&f| f).count() as u64;
        let rest = pool_ppm.saturating_sub(fixed * floor_ppm) as f64;
        let demand: f64 = (0..n)
            .filter(|&i| !at_floor[i])
            .map(|i| demands[i].max(0.0))
            .sum();
        let free = n as f64 - fixed as f64;
        let part = |i: usize| {
            if demand > 0.0 {
                rest * demands[i].max(0.0) / demand
            } else {
                rest / free
            }
        };
        let newly: Vec<usize> = (0..n)
            .filter(|&i| !at_floor[i] && part(i) < floor_ppm as f64)
            .collect();
        if newly.is_empty() {
            return (0..n)
                .map(|i| {
                    let ppm = if at_floor[i] {
                        floor_ppm
                    } else {
                        part(i).floor() as u64
                    };
                    Share::from_ppm(ppm.min(u64::from(Share::PPM)) as u32).unwrap_or(Share::WHOLE)
                })
                .collect();
        }
        for i in newly {
            at_floor[i] = true;
        }
    }
}

fn ppm(x: f64) -> u64 {
    x.max(0.0).floor() as u64
}

/// `amount * part / whole`, rounded down, in integers.
fn pro_rata(amount: u64, part: u64, whole: u64) -> u64 {
    if whole == 0 {
        0
    } else {
        (u128::from(amount) * u128::from(part) / u128::from(whole)) as u64
    }
}

fn share_of(ppm: u64) -> Share {
    Share::from_ppm(ppm.min(u64::from(Share::PPM)) as u32).unwrap_or(Share::WHOLE)
}

/// The plan for one round (see the module doc). Regions keep their order in `regions` within
/// the plan's shrink and grow lists.
pub fn plan(params: &Params, budget: &Budget, floor: Share, regions: &[RegionInput]) -> Plan {
    let whole = u64::from(Share::PPM);
    let total = sum_ppm(regions.iter().map(|r| r.share));
    if total > whole {
        // Someone holds more than the budget allows: nothing may grow until it is resolved.
        return Plan::default();
    }
    let slack = whole - total;
    let eligible: Vec<(&RegionInput, Observation)> = regions
        .iter()
        .filter(|r| !r.frozen)
        .filter_map(|r| r.observation.filter(|o| o.interval_ms > 0).map(|o| (r, o)))
        .collect();
    let demands: Vec<f64> = eligible.iter().map(|(_, o)| o.demand_per_sec()).collect();
    if demands.iter().sum::<f64>() <= 0.0 {
        return Plan::default();
    }
    let pool = sum_ppm(eligible.iter().map(|(r, _)| r.share)) + slack;
    let targets = proportional_target(pool, floor, &demands);
    let min_move = u64::from(params.min_move.ppm());

    let mut wants = Vec::new(); // (region, want_ppm)
    let mut gives = Vec::new(); // (region, give_ppm)
    for (&(region, obs), &target) in eligible.iter().zip(&targets) {
        let share = u64::from(region.share.ppm());
        let target = u64::from(target.ppm());
        if obs.reject_ratio() >= params.recipient_reject_ratio
            && obs.rejected > 0
            && target >= share + min_move.max(1)
        {
            wants.push((region, target - share));
        } else if obs.rejected == 0 && share >= target + min_move.max(1) {
            let used = ppm(obs.used_share(budget) * whole as f64);
            let excess = (share - target)
                .min(share.saturating_sub(used))
                .min(share.saturating_sub(u64::from(floor.ppm())));
            let give = ppm(params.step_fraction * excess as f64);
            if give > 0 {
                gives.push((region, give));
            }
        }
    }
    let want: u64 = wants.iter().map(|&(_, w)| w).sum();
    let give: u64 = gives.iter().map(|&(_, g)| g).sum();
    let moved = want.min(slack + give);
    if moved == 0 || moved < min_move {
        return Plan::default();
    }
    let from_slack = slack.min(moved);
    let from_donors = moved - from_slack;
    let shrink: Vec<Change> = gives
        .iter()
        .map(|&(r, g)| (r, pro_rata(from_donors, g, give)))
        .filter(|&(_, take)| take > 0)
        .map(|(r, take)| Change {
            region: r.region.clone(),
            from: r.share,
            to: share_of(u64::from(r.share.ppm()) - take),
        })
        .collect();
    let taken: u64 = shrink
        .iter()
        .map(|c| u64::from(c.from.ppm() - c.to.ppm()))
        .sum();
    let granted = from_slack + taken;
    let grow: Vec<Change> = wants
        .iter()
        .map(|&(r, w)| (r, pro_rata(granted, w, want).min(w)))
        .filter(|&(_, g)| g > 0)
        .map(|(r, g)| Change {
            region: r.region.clone(),
            from: r.share,
            to: share_of(u64::from(r.share.ppm()) + g),
        })
        .collect();
    if grow.is_empty() {
        return Plan::default();
    }
    Plan { shrink, grow }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BUDGET: Budget = Budget {
        capacity: 200,
        refill_per_sec: 100,
    };

    fn s(f: f64) -> Share {
        Share::from_fraction(f).unwrap()
    }

    fn region(name: &str, share: f64, admitted: u64, rejected: u64) -> RegionInput {
        RegionInput {
            region: name.to_owned(),
            share: s(share),
            frozen: false,
            observation: Some(Observation {
                admitted,
                rejected,
                interval_ms: 10_000,
            }),
        }
    }

    fn floor() -> Share {
        s(0.05)
    }

    /// The shares after applying `steps` of `plan` to `regions`.
    fn after<'a>(regions: &[RegionInput], steps: impl Iterator<Item = &'a Change>) -> Vec<Share> {
        let mut shares: Vec<Share> = regions.iter().map(|r| r.share).collect();
        for c in steps {
            let i = regions.iter().position(|r| r.region == c.region).unwrap();
            assert_eq!(shares[i], c.from, "a change starts from the planned share");
            shares[i] = c.to;
        }
        shares
    }

    #[test]
    fn a_rejecting_region_receives_what_an_idle_one_does_not_use() {
        // Budget 100/s. eu wants 60/s on a third (33/s admitted), us uses 10/s, ap 20/s.
        let regions = [
            region("eu", 1.0 / 3.0, 333, 267),
            region("us", 1.0 / 3.0, 100, 0),
            region("ap", 1.0 / 3.0, 200, 0),
        ];
        let p = plan(&Params::default(), &BUDGET, floor(), &regions);
        // Targets over the whole (0.999999 + slack): eu 0.6667, us 0.1111, ap 0.2222.
        // us gives 0.5 * min(0.2222, 0.2333) = 0.1111; ap 0.5 * min(0.1111, 0.1333) = 0.0555.
        let names: Vec<_> = p.shrink.iter().map(|c| c.region.as_str()).collect();
        assert_eq!(names, ["us", "ap"]);
        assert_eq!(p.grow.len(), 1);
        assert_eq!(p.grow[0].region, "eu");
        let moved = p.moved_ppm();
        assert!((166_000..=166_668).contains(&moved), "{moved}");
        let shares = after(&regions, p.steps());
        assert!(sum_ppm(shares) <= u64::from(Share::PPM));
    }

    #[test]
    fn nobody_rejecting_means_no_moves() {
        let regions = [region("eu", 0.5, 400, 0), region("us", 0.5, 10, 0)];
        assert!(plan(&Params::default(), &BUDGET, floor(), &regions).is_empty());
    }

    #[test]
    fn a_region_rejecting_a_little_neither_gives_nor_receives() {
        // us rejects 0.5% (below the 1% threshold) and has more than its target.
        let regions = [region("eu", 0.5, 500, 100), region("us", 0.5, 199, 1)];
        let p = plan(&Params::default(), &BUDGET, floor(), &regions);
        assert!(p.is_empty(), "{p:?}");
    }

    #[test]
    fn slack_left_by_a_failed_step_goes_first_and_needs_no_shrink() {
        // The shares sum to 0.8: 0.2 nobody holds (a grow that failed last round).
        // us rejects a little (0.2%): neither donor nor recipient.
        let regions = [region("eu", 0.3, 300, 300), region("us", 0.5, 499, 1)];
        let p = plan(&Params::default(), &BUDGET, floor(), &regions);
        assert!(p.shrink.is_empty(), "{p:?}");
        assert_eq!(p.grow.len(), 1);
        assert_eq!(
            p.grow[0].to,
            s(0.5),
            "eu takes the 0.2 of slack (it wants 0.2454)"
        );
    }

    #[test]
    fn frozen_and_unobserved_regions_are_left_alone() {
        let mut cut_off = region("us", 0.5, 0, 0);
        cut_off.frozen = true;
        let unknown = RegionInput {
            observation: None,
            ..region("ap", 0.2, 0, 0)
        };
        let regions = [region("eu", 0.3, 300, 500), cut_off, unknown];
        let p = plan(&Params::default(), &BUDGET, floor(), &regions);
        assert!(p.is_empty(), "{p:?}");
    }

    #[test]
    fn a_donor_keeps_what_it_uses_and_the_floor() {
        // us uses 0.45 of the budget out of 0.5; its target is lower, but it gives at most half
        // of what it does not use.
        let regions = [region("eu", 0.5, 500, 2000), region("us", 0.5, 450, 0)];
        let p = plan(&Params::default(), &BUDGET, floor(), &regions);
        assert_eq!(
            p.shrink,
            [Change {
                region: "us".into(),
                from: s(0.5),
                to: s(0.475)
            }]
        );
        assert_eq!(p.grow[0].to, s(0.525));

        let regions = [region("eu", 0.9, 900, 2000), region("us", 0.06, 0, 0)];
        let p = plan(&Params::default(), &BUDGET, floor(), &regions);
        // 0.04 of slack, and us gives half of its 0.01 above the floor.
        assert_eq!(p.shrink[0].to, s(0.055));
        assert!(p.shrink[0].to >= floor());
    }

    #[test]
    fn more_than_the_whole_budget_plans_nothing() {
        let regions = [region("eu", 0.7, 700, 500), region("us", 0.4, 0, 0)];
        assert!(plan(&Params::default(), &BUDGET, floor(), &regions).is_empty());
    }

    #[test]
    fn targets_are_proportional_with_floors() {
        let t = proportional_target(1_000_000, s(0.05), &[90.0, 9.0, 1.0]);
        assert_eq!(t[2], s(0.05));
        assert_eq!(t[0].ppm() + t[1].ppm() + t[2].ppm(), 1_000_000 - 1);
        assert_eq!(t[0], Share::from_ppm(863_636).unwrap());
        let idle = proportional_target(900_000, s(0.05), &[0.0, 0.0, 0.0]);
        assert_eq!(idle, [s(0.3); 3]);
    }

    #[test]
    fn defaults_are_valid_and_bad_parameters_are_named() {
        Params::default().validate().unwrap();
        let bad = Params {
            round_interval_ms: 1_000,
            step_fraction: 0.0,
            ..Params::default()
        };
        let text = bad.validate().unwrap_err();
        assert!(
            text.contains("round_interval_ms: 1000 is shorter than the fence"),
            "{text}"
        );
        assert!(
            text.contains("step_fraction: 0 must be in (0, 1]"),
            "{text}"
        );
    }

    fn arb_regions() -> impl Strategy<Value = Vec<RegionInput>> {
        // 1 to 5 regions with shares summing to at most 1 (some slack), each at least the floor,
        // and arbitrary counters; some frozen, some unobserved.
        prop::collection::vec(
            (1u32..=100, 0u64..5_000, 0u64..5_000, any::<bool>(), 0u8..10),
            1..=5,
        )
        .prop_flat_map(|raw| {
            let weight: u32 = raw.iter().map(|r| r.0).sum();
            (Just(raw), weight..=weight * 2)
        })
        .prop_map(|(raw, scale)| {
            let n = raw.len() as u32;
            let floor = floor().ppm();
            let spare = Share::PPM - floor * n;
            raw.iter()
                .enumerate()
                .map(|(i, &(w, admitted, rejected, rejects, kind))| RegionInput {
                    region: format!("r{i}"),
                    share: Share::from_ppm(
                        floor + (u64::from(spare) * u64::from(w) / u64::from(scale)) as u32,
                    )
                    .unwrap(),
                    frozen: kind == 0,
                    observation: (kind != 1).then_some(Observation {
                        admitted,
                        rejected: if rejects { rejected } else { 0 },
                        interval_ms: 10_000,
                    }),
                })
                .collect()
        })
    }

    fn arb_params() -> impl Strategy<Value = Params> {
        (0.05f64..=1.0, 0.0f64..0.2, 0u32..50_000).prop_map(|(step, ratio, min_move)| Params {
            step_fraction: step,
            recipient_reject_ratio: ratio,
            min_move: Share::from_ppm(min_move).unwrap(),
            ..Params::default()
        })
    }

    proptest! {
        #[test]
        fn no_prefix_of_any_plan_exceeds_one(regions in arb_regions(), params in arb_params()) {
            prop_assume!(sum_ppm(regions.iter().map(|r| r.share)) <= u64::from(Share::PPM));
            let p = plan(&params, &BUDGET, floor(), &regions);
            let steps: Vec<&Change> = p.steps().collect();
            for k in 0..=steps.len() {
                let shares = after(&regions, steps[..k].iter().copied());
                prop_assert!(sum_ppm(shares.iter().copied()) <= u64::from(Share::PPM),
                    "prefix {k} of {p:?} sums above 1");
                for (r, &share) in regions.iter().zip(&shares) {
                    prop_assert!(share >= floor().min(r.share), "{} below the floor", r.region);
                }
            }
            for c in &p.shrink {
                prop_assert!(c.to < c.from);
            }
            for c in &p.grow {
                prop_assert!(c.to > c.from);
            }
        }

        #[test]
        fn a_plan_never_moves_share_from_a_rejecting_region(
            regions in arb_regions(), params in arb_params()
        ) {
            let p = plan(&params, &BUDGET, floor(), &regions);
            for c in &p.shrink {
                let r = regions.iter().find(|r| r.region == c.region).unwrap();
                prop_assert!(!r.frozen);
                prop_assert_eq!(r.observation.map(|o| o.rejected), Some(0),
                    "{} rejects and was shrunk", c.region);
            }
            for c in &p.grow {
                let r = regions.iter().find(|r| r.region == c.region).unwrap();
                prop_assert!(!r.frozen);
                prop_assert!(r.observation.is_some_and(|o| o.rejected > 0));
            }
        }
    }
}
