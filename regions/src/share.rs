//! Shares of a global budget, and the record a region stores its share in.
//!
//! A share is a whole number of parts per million of the rule's global budget, so that "the
//! shares sum to at most 1" is exact integer arithmetic, never a floating-point judgement.

use std::fmt;

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

#[cfg(test)]
mod tests {
    use super::*;

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
