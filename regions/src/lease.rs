//! What a sidecar knows of its region's share: the share record's recent history, read from the
//! region's store, held under a lease.
//!
//! - The lease: a sidecar re-reads the record at least every `lease_ms / 2` and stops applying a
//!   share read `lease_ms` ago or more (it answers "unavailable" instead, and the gateway's failure
//!   policy decides). So `lease_ms` after a smaller share is written, no sidecar of the region
//!   applies the larger one: that is the fence the rebalancer waits before it grows another region.
//! - The history: the record keeps its changes of the last fill time (`C / R`), stamped by the
//!   store's clock when written, so that a bucket can be taken under the smallest share in force
//!   since its last take ([`ShareHistory::min_since`], [`crate::Bucket::take`]).

use std::collections::VecDeque;

use crate::share::Share;

/// A share record's changes over time: `(from_ms, share)` in time order, the last one in force
/// now. Times are on the store's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareHistory {
    changes: VecDeque<(u64, Share)>,
}

impl ShareHistory {
    /// A history that starts with `share` at `at_ms`.
    pub fn new(at_ms: u64, share: Share) -> ShareHistory {
        ShareHistory {
            changes: VecDeque::from([(at_ms, share)]),
        }
    }

    /// The share in force now.
    pub fn current(&self) -> Share {
        self.changes.back().map_or(Share::ZERO, |&(_, s)| s)
    }

    /// `share` is in force from `at_ms` on. A time before the last change (a clock that moved
    /// backward) counts as the time of the last change.
    pub fn record(&mut self, at_ms: u64, share: Share) {
        let at_ms = at_ms.max(self.changes.back().map_or(0, |&(t, _)| t));
        self.changes.push_back((at_ms, share));
    }

    /// The smallest share in force at any instant of `[from_ms, now_ms]`, the current share being
    /// in force until `now_ms`. Looks back at most `horizon_ms` (the budget's fill time `C / R`):
    /// a bucket idle for longer has refilled, at the smallest share of that window, to that
    /// share's capacity, which is as far as this share lets it go (`docs/regions.md`).
    pub fn min_since(&self, from_ms: u64, now_ms: u64, horizon_ms: u64) -> Share {
        let from_ms = from_ms.max(now_ms.saturating_sub(horizon_ms));
        // The change in force at `from_ms` is the last one at or before it. A history kept for
        // the horizon always has one; only a record created after `from_ms` has none, and then no
        // share was in force before its first change.
        let start = self
            .changes
            .iter()
            .rposition(|&(t, _)| t <= from_ms)
            .unwrap_or(0);
        let mut changes = self.changes.iter().skip(start);
        let first = changes.next().map_or(Share::ZERO, |&(_, s)| s);
        changes
            .take_while(|&&(t, _)| t <= now_ms)
            .fold(first, |min, &(_, s)| min.min(s))
    }

    /// Forgets the changes superseded before `before_ms`, keeping the one in force then.
    pub fn forget_before(&mut self, before_ms: u64) {
        while self.changes.len() > 1 && self.changes[1].0 <= before_ms {
            self.changes.pop_front();
        }
    }

    pub fn changes(&self) -> impl Iterator<Item = (u64, Share)> + '_ {
        self.changes.iter().copied()
    }
}

/// A sidecar's copy of its region's share record, read at `read_at_ms` (the sidecar's clock,
/// taken when the read was sent, so the lease never starts later than the read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeasedShare {
    pub history: ShareHistory,
    pub version: u64,
    pub read_at_ms: u64,
}

impl LeasedShare {
    /// The share to apply at `now_ms`, or `None` once the lease of `lease_ms` has run out (the
    /// sidecar then answers "unavailable" until a read succeeds).
    pub fn applicable(&self, now_ms: u64, lease_ms: u64) -> Option<Share> {
        (now_ms < self.read_at_ms.saturating_add(lease_ms)).then(|| self.history.current())
    }

    /// Whether the record is due to be read again (every `lease_ms / 2`).
    pub fn needs_refresh(&self, now_ms: u64, lease_ms: u64) -> bool {
        now_ms >= self.read_at_ms.saturating_add(lease_ms / 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(f: f64) -> Share {
        Share::from_fraction(f).unwrap()
    }

    fn history() -> ShareHistory {
        // 0.5 from 0, 0.2 from 10 s, 0.6 from 20 s.
        let mut h = ShareHistory::new(0, s(0.5));
        h.record(10_000, s(0.2));
        h.record(20_000, s(0.6));
        h
    }

    #[test]
    fn the_smallest_share_of_an_interval() {
        let h = history();
        let far = u64::MAX;
        assert_eq!(h.current(), s(0.6));
        assert_eq!(h.min_since(1_000, 9_000, far), s(0.5));
        assert_eq!(
            h.min_since(1_000, 10_000, far),
            s(0.2),
            "a change at the end counts"
        );
        assert_eq!(h.min_since(12_000, 15_000, far), s(0.2));
        assert_eq!(h.min_since(21_000, 30_000, far), s(0.6));
        assert_eq!(
            h.min_since(5_000, 30_000, far),
            s(0.2),
            "a dip and a recovery while the bucket was idle still count"
        );
    }

    #[test]
    fn the_look_back_stops_at_the_horizon() {
        let h = history();
        assert_eq!(h.min_since(0, 35_000, 10_000), s(0.6));
        assert_eq!(h.min_since(0, 25_000, 10_000), s(0.2));
    }

    #[test]
    fn forgetting_keeps_the_change_in_force() {
        let mut h = history();
        h.forget_before(15_000);
        assert_eq!(
            h.changes().collect::<Vec<_>>(),
            [(10_000, s(0.2)), (20_000, s(0.6))]
        );
        assert_eq!(h.min_since(0, 25_000, u64::MAX), s(0.2));
        h.forget_before(u64::MAX);
        assert_eq!(h.changes().count(), 1);
    }

    #[test]
    fn a_change_stamped_before_the_last_counts_at_the_last() {
        let mut h = history();
        h.record(5_000, s(0.1));
        assert_eq!(h.changes().last(), Some((20_000, s(0.1))));
    }

    #[test]
    fn a_share_is_applied_only_under_its_lease() {
        let view = LeasedShare {
            history: ShareHistory::new(0, s(0.4)),
            version: 3,
            read_at_ms: 1_000,
        };
        assert!(!view.needs_refresh(3_999, 6_000));
        assert!(view.needs_refresh(4_000, 6_000));
        assert_eq!(view.applicable(6_999, 6_000), Some(s(0.4)));
        assert_eq!(view.applicable(7_000, 6_000), None);
    }
}
