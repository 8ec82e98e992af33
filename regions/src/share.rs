//! Shares of a global budget, the record a region stores its share in, and the regional quota of
//! one rule (its global budget and the table of shares per region, validated).
//!
//! A share is a whole number of parts per million of the rule's global budget, so that "the
//! shares sum to at most 1" is exact integer arithmetic, never a floating-point judgement.

use std::collections::BTreeMap;
use std::fmt;

use crate::bucket::Budget;

/// A fraction of a rule's global budget, in parts per million (`Share::WHOLE` is the whole budget).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Share(u32);

impl Share {
    /// Parts per million in the whole budget.
    pub const PPM: u32 = 1_000_000;
    /// The whole budget (1).
    pub const WHOLE: Share = Share(Self::PPM);
    /// No budget (0).
    pub const ZERO: Share = Share(0);

    /// The share of `ppm` parts per million; `None` above the whole budget.
    pub const fn from_ppm(ppm: u32) -> Option<Share> {
        if ppm <= Self::PPM {
            Some(Share(ppm))
        } else {
            None
        }
    }

    /// The share nearest below `fraction` (rounded down to a part per million, so shares read
    /// from a configuration never sum to more than the fractions written); `None` outside [0, 1]
    /// or not a number.
    pub fn from_fraction(fraction: f64) -> Option<Share> {
        if !(0.0..=1.0).contains(&fraction) {
            return None;
        }
        // The epsilon keeps 0.3 (0.29999999999999998...) at 300000 ppm.
        let ppm = (fraction * f64::from(Self::PPM) + 1e-6).floor();
        Some(Share((ppm as u32).min(Self::PPM)))
    }

    pub const fn ppm(self) -> u32 {
        self.0
    }

    pub fn fraction(self) -> f64 {
        f64::from(self.0) / f64::from(Self::PPM)
    }

    /// `self - other`, or zero.
    pub const fn saturating_sub(self, other: Share) -> Share {
        Share(self.0.saturating_sub(other.0))
    }

    /// `self + other`, at most the whole budget.
    pub fn saturating_add(self, other: Share) -> Share {
        Share((self.0 + other.0).min(Self::PPM))
    }
}

impl fmt::Display for Share {
    /// Four decimals are enough to tell shares apart in a log or a table (`0.3333`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.4}", self.fraction())
    }
}

/// The sum of several shares, in parts per million. It may exceed [`Share::WHOLE`]: that is
/// what validation and the rebalancer look for.
pub fn sum_ppm<I: IntoIterator<Item = Share>>(shares: I) -> u64 {
    shares.into_iter().map(|s| u64::from(s.ppm())).sum()
}

/// What a region's store holds for one rule: the share its sidecars apply, and a version that
/// only grows. A write carries the version it creates and is applied only when that version is
/// greater than the stored one ([`ShareRecord::accepts`]), so a stale writer (a delayed write, a
/// rebalancer that read an old record) cannot undo a newer plan, and re-sending the same write is
/// harmless.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareRecord {
    pub share: Share,
    pub version: u64,
}

impl ShareRecord {
    /// Whether a write creating `version` may replace this record.
    pub fn accepts(&self, version: u64) -> bool {
        version > self.version
    }
}

/// A rule's global budget partitioned across regions: region `r` runs an ordinary token bucket of
/// capacity `C * s_r` and refill `R * s_r`, where (`C`, `R`) is [`RegionalQuota::budget`] and
/// `s_r` the region's share. Valid when every share is in [`floor`, 1] and the shares sum to at
/// most 1 (see `docs/regions.md` for why that bounds the regions together by the global bucket).
///
/// [`floor`]: RegionalQuota::floor
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionalQuota {
    rule: String,
    budget: Budget,
    floor: Share,
    shares: BTreeMap<String, Share>,
}

/// One reason a regional quota is refused, naming the rule and the region.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaProblem {
    #[error("rules.{rule}.regions: at least one region is required")]
    NoRegions { rule: String },
    #[error(
        "rules.{rule}.regions: {region:?} is not a region name (use [A-Za-z0-9_.-], 1 to 64 bytes)"
    )]
    BadRegionName { rule: String, region: String },
    #[error("rules.{rule}.regions.{region}: share {share} is below the floor {floor}; raise it or lower `floor`")]
    BelowFloor {
        rule: String,
        region: String,
        share: Share,
        floor: Share,
    },
    #[error("rules.{rule}.regions: the shares sum to {sum_ppm} ppm ({}), more than the whole budget (1); lower some shares", *sum_ppm as f64 / f64::from(Share::PPM))]
    SumAboveWhole { rule: String, sum_ppm: u64 },
    #[error("rules.{rule}.region_floor: {floor} for {regions} regions leaves more than the whole budget to the floors; lower it")]
    FloorTooLarge {
        rule: String,
        floor: Share,
        regions: usize,
    },
    #[error("rules.{rule}: {problem}")]
    Budget { rule: String, problem: String },
}

/// Every problem found in a regional quota (never just the first).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid regional quota: {}", .0.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("; "))]
pub struct QuotaError(pub Vec<QuotaProblem>);

fn valid_region_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

impl RegionalQuota {
    /// The floor share a region keeps when none is configured: 5% of the budget, so a region
    /// cut off from the others always has some budget of its own.
    pub const DEFAULT_FLOOR: Share = Share(50_000);

    /// A validated quota; every problem is named (rule, region, value).
    pub fn new<I, S>(
        rule: &str,
        budget: Budget,
        floor: Share,
        shares: I,
    ) -> Result<Self, QuotaError>
    where
        I: IntoIterator<Item = (S, Share)>,
        S: Into<String>,
    {
        let shares: BTreeMap<String, Share> =
            shares.into_iter().map(|(r, s)| (r.into(), s)).collect();
        let mut problems = Vec::new();
        if let Err(problem) = budget.validate() {
            problems.push(QuotaProblem::Budget {
                rule: rule.to_owned(),
                problem,
            });
        }
        if shares.is_empty() {
            problems.push(QuotaProblem::NoRegions {
                rule: rule.to_owned(),
            });
        }
        if sum_ppm(std::iter::repeat_n(floor, shares.len())) > u64::from(Share::PPM) {
            problems.push(QuotaProblem::FloorTooLarge {
                rule: rule.to_owned(),
                floor,
                regions: shares.len(),
            });
        }
        for (region, &share) in &shares {
            if !valid_region_name(region) {
                problems.push(QuotaProblem::BadRegionName {
                    rule: rule.to_owned(),
                    region: region.clone(),
                });
            }
            if share < floor {
                problems.push(QuotaProblem::BelowFloor {
                    rule: rule.to_owned(),
                    region: region.clone(),
                    share,
                    floor,
                });
            }
        }
        let sum = sum_ppm(shares.values().copied());
        if sum > u64::from(Share::PPM) {
            problems.push(QuotaProblem::SumAboveWhole {
                rule: rule.to_owned(),
                sum_ppm: sum,
            });
        }
        if problems.is_empty() {
            Ok(RegionalQuota {
                rule: rule.to_owned(),
                budget,
                floor,
                shares,
            })
        } else {
            Err(QuotaError(problems))
        }
    }

    /// Equal shares (`1/n` each, rounded down to a part per million) for `regions`.
    pub fn equal<I, S>(
        rule: &str,
        budget: Budget,
        floor: Share,
        regions: I,
    ) -> Result<Self, QuotaError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let regions: Vec<String> = regions.into_iter().map(Into::into).collect();
        let each = Share(Share::PPM / regions.len().max(1) as u32);
        Self::new(rule, budget, floor, regions.into_iter().map(|r| (r, each)))
    }

    pub fn rule(&self) -> &str {
        &self.rule
    }

    pub fn budget(&self) -> Budget {
        self.budget
    }

    pub fn floor(&self) -> Share {
        self.floor
    }

    /// The share of `region`, `None` for a region the quota does not name.
    pub fn share(&self, region: &str) -> Option<Share> {
        self.shares.get(region).copied()
    }

    /// Regions and their shares, by region name.
    pub fn shares(&self) -> impl Iterator<Item = (&str, Share)> {
        self.shares.iter().map(|(r, s)| (r.as_str(), *s))
    }

    pub fn regions(&self) -> impl Iterator<Item = &str> {
        self.shares.keys().map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget() -> Budget {
        Budget {
            capacity: 100,
            refill_per_sec: 10,
        }
    }

    fn s(f: f64) -> Share {
        Share::from_fraction(f).unwrap()
    }

    #[test]
    fn fractions_round_down_to_parts_per_million() {
        assert_eq!(s(0.3).ppm(), 300_000);
        assert_eq!(s(1.0), Share::WHOLE);
        assert_eq!(s(1.0 / 3.0).ppm(), 333_333);
        assert_eq!(Share::from_fraction(1.01), None);
        assert_eq!(Share::from_fraction(-0.1), None);
        assert_eq!(Share::from_fraction(f64::NAN), None);
        assert_eq!(s(0.25).to_string(), "0.2500");
    }

    #[test]
    fn a_valid_table_is_accepted() {
        let q = RegionalQuota::new(
            "per-app",
            budget(),
            s(0.05),
            [("eu", s(0.5)), ("us", s(0.3)), ("ap", s(0.2))],
        )
        .unwrap();
        assert_eq!(q.share("us"), Some(s(0.3)));
        assert_eq!(q.share("mars"), None);
        assert_eq!(q.regions().collect::<Vec<_>>(), ["ap", "eu", "us"]);
    }

    #[test]
    fn equal_shares_never_sum_above_one() {
        let q = RegionalQuota::equal("r", budget(), s(0.05), ["a", "b", "c"]).unwrap();
        assert_eq!(sum_ppm(q.shares().map(|(_, s)| s)), 999_999);
    }

    #[test]
    fn every_problem_is_named_with_rule_and_region() {
        let err = RegionalQuota::new(
            "per-app",
            budget(),
            s(0.1),
            [
                ("eu", s(0.7)),
                ("us", s(0.35)),
                ("ap", s(0.05)),
                ("bad name", s(0.1)),
            ],
        )
        .unwrap_err();
        let text = err.to_string();
        assert_eq!(err.0.len(), 3, "{text}");
        assert!(
            text.contains("rules.per-app.regions.ap: share 0.0500 is below the floor 0.1000"),
            "{text}"
        );
        assert!(text.contains("\"bad name\" is not a region name"), "{text}");
        assert!(text.contains("sum to 1200000 ppm (1.2)"), "{text}");
    }

    #[test]
    fn floors_that_cannot_fit_and_bad_budgets_are_refused() {
        let err = RegionalQuota::equal(
            "r",
            Budget {
                capacity: 0,
                refill_per_sec: 1,
            },
            s(0.4),
            ["a", "b", "c"],
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("rules.r.region_floor: 0.4000 for 3 regions"),
            "{text}"
        );
        assert!(text.contains("rules.r: capacity: must be > 0"), "{text}");
        assert!(text.contains("below the floor"), "{text}");
        let none = RegionalQuota::new::<_, String>("r", budget(), s(0.05), []).unwrap_err();
        assert!(none.to_string().contains("at least one region"));
    }

    #[test]
    fn a_write_replaces_a_record_only_with_a_newer_version() {
        let rec = ShareRecord {
            share: s(0.5),
            version: 7,
        };
        assert!(rec.accepts(8));
        assert!(!rec.accepts(7), "the same write again changes nothing");
        assert!(!rec.accepts(3), "a stale writer cannot undo a newer plan");
    }
}
