//! The regional quota of one rule: its global budget and the table of shares per region,
//! validated.

use std::collections::BTreeMap;

use crate::bucket::Budget;
use crate::share::{sum_ppm, Share};

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
    pub const DEFAULT_FLOOR: Share = match Share::from_ppm(50_000) {
        Some(s) => s,
        None => Share::ZERO,
    };

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
        let each = Share::from_ppm(Share::PPM / regions.len().max(1) as u32).unwrap_or(Share::ZERO);
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
}
