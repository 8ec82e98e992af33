//! The rebalancer as a state machine without I/O: its driver reads the regions' share records,
//! starts a round, sends the writes [`Rebalancer::poll`] hands out and reports each outcome back,
//! all with the time passed in.
//!
//! One round:
//!
//! ```text
//! Idle --start_round--> Shrinking --every shrink answered--> Fencing --until--> Growing --answered--> Idle
//!                       (donors' smaller shares,            (no grow before    (recipients' larger
//!                        and retries of unknown writes)      the fence)         shares)
//! ```
//!
//! Safety rests on one number per region, its *envelope*: the largest share any of its sidecars
//! may apply now or later without another write from the rebalancer. The rebalancer keeps the
//! envelopes' sum at or below 1, which bounds the shares the regions actually apply:
//!
//! - a grow raises the envelope *before* its write is sent (and lowers it back only when the store
//!   refused the write, so it was never applied);
//! - a shrink lowers the envelope only `fence_ms` (lease + margin) after the store confirmed it
//!   (an acknowledged write, or a read showing it), since a sidecar may apply the larger share it
//!   read before until its lease runs out;
//! - a write whose outcome is unknown (timed out) freezes the region at the larger of its old and
//!   new share until a read shows a version at least as new; it is re-sent, with the same
//!   version, at the next round (applying it twice is harmless);
//! - a region the rebalancer cannot reach, or has not read since it started, is frozen: neither
//!   donor nor recipient; one never read counts as the whole budget, so nothing grows until every
//!   region has been read once;
//! - after a start, nothing grows for one fence (a previous run's shrink may still be leased).
//!
//! A round whose grow fails half way leaves the sum below 1 (under-admission only); the slack is
//! handed out by the next round's plan, from the records it reads, without another shrink.

use std::collections::BTreeMap;

use crate::bucket::Budget;
use crate::plan::{plan, Change, Observation, Params, Plan, RegionInput};
use crate::quota::RegionalQuota;
use crate::share::{sum_ppm, Share, ShareRecord};

/// Whether a write lowers or raises a share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteKind {
    Shrink,
    Grow,
}

/// One write of a region's share record: store `share` with `version`, if `version` is newer
/// than the stored one ([`ShareRecord::accepts`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareWrite {
    pub region: String,
    pub share: Share,
    pub version: u64,
    pub kind: WriteKind,
}

/// What became of a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    /// The store applied it.
    Written,
    /// The store answered and did not apply it (it holds a version at least as new).
    Refused,
    /// No answer (timed out, connection lost): it may have been applied, or may be later.
    Unknown,
}

/// What a read of a region's record found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadOutcome {
    Record(ShareRecord),
    /// A record the region's Redis did not write itself: it restarted or failed over since the
    /// last write (a restored snapshot, a promoted replica), so the record may be older than the
    /// last one written there, and its sidecars do not trust it (they apply at most the floor)
    /// until it is written again.
    Unconfirmed(ShareRecord),
    Unreachable,
}

/// A record a read could not trust, and the write [`Rebalancer::start_round`] will send to
/// repair it: reported by [`Rebalancer::observe`] for the driver to log and count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Suspect {
    /// What the read found.
    pub read: ShareRecord,
    /// The record this rebalancer knew before (written or read), when it knew one.
    pub known: Option<ShareRecord>,
    /// The read's version is lower than one seen before: the store went back in time.
    pub regressed: bool,
    /// The store restarted or failed over since the record was written.
    pub unconfirmed: bool,
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Send these writes and report each outcome with [`Rebalancer::written`].
    Write(Vec<ShareWrite>),
    /// Writes handed out earlier have not all been answered.
    AwaitWrites,
    /// The fence: nothing to do before this time.
    WaitUntil(u64),
    /// No round in progress.
    Idle,
}

/// A round could not start: the previous one has not finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a rebalancing round is still in progress")]
pub struct RoundInProgress;

/// What the last finished round did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RoundReport {
    pub plan: Plan,
    /// The grows written as they were sent (a grow is cut to what the envelopes allow then).
    pub grown: Vec<Change>,
    /// Writes that were refused or got no answer.
    pub failed: Vec<(ShareWrite, WriteOutcome)>,
}

#[derive(Debug, Clone, Default)]
struct RegionState {
    /// The record as last read or acknowledged; `None` until first read.
    record: Option<ShareRecord>,
    /// Larger shares its sidecars may still apply, each until a time (exclusive).
    holds: Vec<(Share, u64)>,
    /// A write whose outcome is unknown.
    unresolved: Option<ShareWrite>,
    /// A write handed out and not yet answered.
    in_flight: Option<ShareWrite>,
    reachable: bool,
    /// A write was refused: the stored version is newer than `record`; read before planning.
    stale: bool,
    /// The record read cannot be trusted ([`Suspect`]): the next round writes it again, and the
    /// region is frozen until then. Holds the share this rebalancer knew before the suspect
    /// read, when it knew one (the repair writes no more than that).
    repair: Option<Option<Share>>,
    /// The highest version seen in this region (a repair is written above it).
    highest_version: u64,
}

impl RegionState {
    fn envelope(&self, now_ms: u64) -> Share {
        let Some(record) = self.record else {
            return Share::WHOLE;
        };
        let held = self
            .holds
            .iter()
            .filter(|&&(_, until)| now_ms < until)
            .map(|&(s, _)| s);
        let writes = [&self.unresolved, &self.in_flight]
            .into_iter()
            .flatten()
            .map(|w| w.share);
        held.chain(writes).fold(record.share, Share::max)
    }

    fn frozen(&self) -> bool {
        !self.reachable
            || self.stale
            || self.record.is_none()
            || self.unresolved.is_some()
            || self.in_flight.is_some()
            || self.repair.is_some()
    }

    /// The share the planner counts: the record, or for a frozen region the largest it may hold
    /// once its holds expire.
    fn planning_share(&self) -> Share {
        match self.record {
            None => Share::WHOLE,
            Some(r) => self
                .unresolved
                .as_ref()
                .map_or(r.share, |w| w.share.max(r.share)),
        }
    }
}

#[derive(Debug, Clone)]
enum Phase {
    Idle,
    Shrinking { first: Vec<ShareWrite>, sent: bool },
    Fencing,
    Growing,
}

/// The rebalancer of one rule's regional shares (see the module doc).
#[derive(Debug, Clone)]
pub struct Rebalancer {
    params: Params,
    budget: Budget,
    floor: Share,
    regions: BTreeMap<String, RegionState>,
    phase: Phase,
    round: RoundReport,
    waiting: usize,
    grow_not_before_ms: u64,
    last: Option<RoundReport>,
}

impl Rebalancer {
    /// A rebalancer for the regions of `quota` started at `now_ms`: it grows nothing for one
    /// fence, and nothing before it has read every region once (the quota's own shares are only
    /// where the records started; a previous run may have moved them).
    pub fn new(params: Params, quota: &RegionalQuota, now_ms: u64) -> Self {
        Rebalancer {
            params,
            budget: quota.budget(),
            floor: quota.floor(),
            regions: quota
                .regions()
                .map(|r| (r.to_owned(), RegionState::default()))
                .collect(),
            phase: Phase::Idle,
            round: RoundReport::default(),
            waiting: 0,
            grow_not_before_ms: now_ms.saturating_add(params.fence_ms()),
            last: None,
        }
    }

    pub fn params(&self) -> &Params {
        &self.params
    }

    /// The largest share any sidecar of `region` may apply at `now_ms` (the whole budget for a
    /// region never read).
    pub fn envelope(&self, region: &str, now_ms: u64) -> Option<Share> {
        self.regions.get(region).map(|r| r.envelope(now_ms))
    }

    /// The sum of the envelopes at `now_ms`, in parts per million; kept at or below 1 once every
    /// region has been read.
    pub fn envelope_sum_ppm(&self, now_ms: u64) -> u64 {
        sum_ppm(self.regions.values().map(|r| r.envelope(now_ms)))
    }

    /// The record of `region` as last read or acknowledged.
    pub fn record(&self, region: &str) -> Option<ShareRecord> {
        self.regions.get(region).and_then(|r| r.record)
    }

    /// Whether `region` is frozen now (unreachable, unread, or with an unanswered write).
    pub fn frozen(&self, region: &str) -> bool {
        self.regions.get(region).is_none_or(RegionState::frozen)
    }

    /// What the last finished round did.
    pub fn last_round(&self) -> Option<&RoundReport> {
        self.last.as_ref()
    }

    pub fn is_idle(&self) -> bool {
        matches!(self.phase, Phase::Idle)
    }

    /// The result of reading `region`'s record at `now_ms`; a record the read cannot trust (a
    /// version lower than one seen, or one the store did not write itself) is reported, and the
    /// next round writes it again (see [`Suspect`]).
    pub fn observe(&mut self, region: &str, read: ReadOutcome, now_ms: u64) -> Option<Suspect> {
        let fence = self.params.fence_ms();
        let state = self.regions.get_mut(region)?;
        let (rec, unconfirmed) = match read {
            ReadOutcome::Unreachable => {
                state.reachable = false;
                return None;
            }
            ReadOutcome::Record(rec) => (rec, false),
            ReadOutcome::Unconfirmed(rec) => (rec, true),
        };
        state.reachable = true;
        state.stale = false;
        let known = state.record;
        if let Some(known) = known {
            if rec.share < known.share {
                // Lowered by a write we did not see answered: the larger share may be leased
                // until one lease after this read.
                state
                    .holds
                    .push((known.share, now_ms.saturating_add(fence)));
            }
        }
        if state
            .unresolved
            .as_ref()
            .is_some_and(|w| rec.version >= w.version)
        {
            state.unresolved = None;
        }
        let regressed = rec.version < state.highest_version;
        state.highest_version = state.highest_version.max(rec.version);
        state.record = Some(rec);
        state.holds.retain(|&(_, until)| now_ms < until);
        if !(regressed || unconfirmed) {
            // The store wrote this record itself, at the newest version seen: trusted.
            state.repair = None;
            return None;
        }
        // Remember the smallest share known before the suspect read (a second suspect read
        // keeps the first one's).
        let before = known.map(|k| k.share);
        state.repair = Some(match state.repair {
            Some(Some(s)) => Some(before.map_or(s, |b| b.min(s))),
            Some(None) | None => before,
        });
        Some(Suspect {
            read: rec,
            known,
            regressed,
            unconfirmed,
        })
    }

    /// Plans and starts a round from `observations` (per region, over the last interval):
    /// retries of writes with unknown outcomes, then the plan's shrinks, the fence, its grows.
    pub fn start_round(
        &mut self,
        observations: &BTreeMap<String, Observation>,
        now_ms: u64,
    ) -> Result<&Plan, RoundInProgress> {
        if !self.is_idle() {
            return Err(RoundInProgress);
        }
        for r in self.regions.values_mut() {
            r.holds.retain(|&(_, until)| now_ms < until);
        }
        let inputs: Vec<RegionInput> = self
            .regions
            .iter()
            .map(|(name, r)| RegionInput {
                region: name.clone(),
                share: r.planning_share(),
                frozen: r.frozen(),
                observation: observations.get(name).copied(),
            })
            .collect();
        let plan = plan(&self.params, &self.budget, self.floor, &inputs);
        let mut first: Vec<ShareWrite> = self
            .regions
            .values()
            .filter(|r| r.reachable && !r.stale && r.in_flight.is_none())
            .filter_map(|r| r.unresolved.clone())
            .collect();
        first.extend(self.repairs(now_ms));
        for change in &plan.shrink {
            let version = self.regions[&change.region]
                .record
                .map_or(1, |r| r.version + 1);
            first.push(ShareWrite {
                region: change.region.clone(),
                share: change.to,
                version,
                kind: WriteKind::Shrink,
            });
        }
        self.round = RoundReport {
            plan,
            ..RoundReport::default()
        };
        self.phase = Phase::Shrinking { first, sent: false };
        Ok(&self.round.plan)
    }

    /// What to do at `now_ms`.
    pub fn poll(&mut self, now_ms: u64) -> Step {
        loop {
            match &mut self.phase {
                Phase::Idle => return Step::Idle,
                Phase::Shrinking { first, sent } => {
                    if !*sent {
                        *sent = true;
                        let writes = std::mem::take(first);
                        if !writes.is_empty() {
                            self.hand_out(&writes);
                            return Step::Write(writes);
                        }
                    }
                    if self.waiting > 0 {
                        return Step::AwaitWrites;
                    }
                    self.phase = Phase::Fencing;
                }
                Phase::Fencing => {
                    if self.round.plan.grow.is_empty() {
                        self.finish();
                        continue;
                    }
                    let until = self.fence_until();
                    if now_ms < until {
                        return Step::WaitUntil(until);
                    }
                    let writes = self.grow_writes(now_ms);
                    self.phase = Phase::Growing;
                    if !writes.is_empty() {
                        self.hand_out(&writes);
                        return Step::Write(writes);
                    }
                }
                Phase::Growing => {
                    if self.waiting > 0 {
                        return Step::AwaitWrites;
                    }
                    self.finish();
                }
            }
        }
    }

    /// The outcome of a write handed out by [`Rebalancer::poll`], at `now_ms`.
    pub fn written(&mut self, write: &ShareWrite, outcome: WriteOutcome, now_ms: u64) {
        let fence = self.params.fence_ms();
        let Some(state) = self.regions.get_mut(&write.region) else {
            return;
        };
        if state.in_flight.as_ref() != Some(write) {
            return;
        }
        state.in_flight = None;
        self.waiting = self.waiting.saturating_sub(1);
        match outcome {
            WriteOutcome::Written => {
                if let Some(previous) = state.record {
                    if write.share < previous.share {
                        state
                            .holds
                            .push((previous.share, now_ms.saturating_add(fence)));
                    }
                }
                state.record = Some(ShareRecord {
                    share: write.share,
                    version: write.version,
                });
                state.highest_version = state.highest_version.max(write.version);
                // Any write stamps the record with the store's current process: trusted again.
                state.repair = None;
                if state.unresolved.as_ref() == Some(write) {
                    state.unresolved = None;
                }
            }
            WriteOutcome::Refused => {
                state.stale = true;
                self.round.failed.push((write.clone(), outcome));
            }
            WriteOutcome::Unknown => {
                state.unresolved = Some(write.clone());
                self.round.failed.push((write.clone(), outcome));
            }
        }
    }

    /// The writes that repair the records reads could not trust: each region's share again, no
    /// larger than the one read, than the one known before, nor than what the other regions'
    /// envelopes leave (at least the floor), above every version seen there. Sent as shrinks: the
    /// share read stays in the envelope for a fence after the write is acknowledged.
    fn repairs(&self, now_ms: u64) -> Vec<ShareWrite> {
        let mut writes = Vec::new();
        for (name, r) in &self.regions {
            let (Some(before), Some(record)) = (r.repair, r.record) else {
                continue;
            };
            if !r.reachable || r.stale || r.in_flight.is_some() || r.unresolved.is_some() {
                continue;
            }
            let others = sum_ppm(
                self.regions
                    .iter()
                    .filter(|(n, _)| *n != name)
                    .map(|(_, o)| o.envelope(now_ms)),
            );
            let room = Share::from_ppm(u64::from(Share::PPM).saturating_sub(others) as u32)
                .unwrap_or(Share::ZERO);
            let share = before
                .map_or(record.share, |b| b.min(record.share))
                .min(room)
                .max(self.floor);
            writes.push(ShareWrite {
                region: name.clone(),
                share,
                version: r.highest_version.max(record.version) + 1,
                kind: WriteKind::Shrink,
            });
        }
        writes
    }

    fn hand_out(&mut self, writes: &[ShareWrite]) {
        for w in writes {
            if let Some(state) = self.regions.get_mut(&w.region) {
                state.in_flight = Some(w.clone());
            }
        }
        self.waiting = writes.len();
    }

    fn finish(&mut self) {
        self.last = Some(std::mem::take(&mut self.round));
        self.phase = Phase::Idle;
    }

    /// No grow before the start-up fence nor while a hold (a shrink's fence) is running.
    fn fence_until(&self) -> u64 {
        self.regions
            .values()
            .flat_map(|r| r.holds.iter().map(|&(_, until)| until))
            .fold(self.grow_not_before_ms, u64::max)
    }

    /// The plan's grows that the envelopes allow now, each cut to the room left.
    fn grow_writes(&mut self, now_ms: u64) -> Vec<ShareWrite> {
        let mut room = u64::from(Share::PPM).saturating_sub(self.envelope_sum_ppm(now_ms));
        let mut writes = Vec::new();
        for change in &self.round.plan.grow {
            let Some(state) = self.regions.get(&change.region) else {
                continue;
            };
            let Some(record) = state.record.filter(|r| r.share == change.from) else {
                continue;
            };
            if state.frozen() {
                continue;
            }
            let grant = u64::from(change.to.saturating_sub(change.from).ppm()).min(room);
            if grant == 0 {
                continue;
            }
            room -= grant;
            let to = Share::from_ppm(change.from.ppm() + grant as u32).unwrap_or(Share::WHOLE);
            self.round.grown.push(Change {
                region: change.region.clone(),
                from: change.from,
                to,
            });
            writes.push(ShareWrite {
                region: change.region.clone(),
                share: to,
                version: record.version + 1,
                kind: WriteKind::Grow,
            });
        }
        writes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BUDGET: Budget = Budget {
        capacity: 200,
        refill_per_sec: 100,
    };
    const FENCE: u64 = 5_500;

    fn s(f: f64) -> Share {
        Share::from_fraction(f).unwrap()
    }

    fn rec(share: f64, version: u64) -> ReadOutcome {
        ReadOutcome::Record(ShareRecord {
            share: s(share),
            version,
        })
    }

    fn obs(admitted: u64, rejected: u64) -> Observation {
        Observation {
            admitted,
            rejected,
            interval_ms: 10_000,
        }
    }

    /// eu rejects half of 60/s on 0.3, us uses 10/s of its 0.7.
    fn busy_eu() -> BTreeMap<String, Observation> {
        BTreeMap::from([("eu".into(), obs(300, 300)), ("us".into(), obs(100, 0))])
    }

    fn quota() -> RegionalQuota {
        RegionalQuota::equal("per-app", BUDGET, s(0.05), ["eu", "us"]).unwrap()
    }

    /// A rebalancer started at 0 that has read eu 0.3 (v1) and us 0.7 (v1) at 10 s.
    fn started() -> Rebalancer {
        let mut rb = Rebalancer::new(Params::default(), &quota(), 0);
        rb.observe("eu", rec(0.3, 1), 10_000);
        rb.observe("us", rec(0.7, 1), 10_000);
        rb
    }

    fn writes(step: Step) -> Vec<ShareWrite> {
        match step {
            Step::Write(w) => w,
            other => panic!("expected writes, got {other:?}"),
        }
    }

    #[test]
    fn a_round_shrinks_waits_one_fence_then_grows() {
        let mut rb = started();
        rb.start_round(&busy_eu(), 10_000).unwrap();
        let shrink = writes(rb.poll(10_000));
        assert_eq!(shrink.len(), 1);
        assert_eq!(
            (shrink[0].region.as_str(), shrink[0].kind, shrink[0].version),
            ("us", WriteKind::Shrink, 2)
        );
        assert_eq!(rb.poll(10_000), Step::AwaitWrites);
        rb.written(&shrink[0], WriteOutcome::Written, 10_020);
        assert_eq!(rb.poll(10_020), Step::WaitUntil(10_020 + FENCE));
        assert_eq!(
            rb.envelope("us", 10_020 + FENCE - 1),
            Some(s(0.7)),
            "leased until the fence"
        );
        assert_eq!(rb.envelope("us", 10_020 + FENCE), Some(shrink[0].share));
        let grow = writes(rb.poll(10_020 + FENCE));
        assert_eq!(
            (grow[0].region.as_str(), grow[0].kind),
            ("eu", WriteKind::Grow)
        );
        let moved = s(0.7).ppm() - shrink[0].share.ppm();
        assert_eq!(grow[0].share.ppm(), s(0.3).ppm() + moved);
        assert!(rb.envelope_sum_ppm(10_020 + FENCE) <= u64::from(Share::PPM));
        rb.written(&grow[0], WriteOutcome::Written, 15_600);
        assert_eq!(rb.poll(15_600), Step::Idle);
        let last = rb.last_round().unwrap();
        assert!(last.failed.is_empty());
        assert_eq!(last.grown.len(), 1);
        assert_eq!(rb.start_round(&busy_eu(), 15_600).map(|_| ()), Ok(()));
        assert_eq!(
            rb.start_round(&busy_eu(), 15_600).map(|_| ()),
            Err(RoundInProgress)
        );
    }

    #[test]
    fn nothing_grows_before_every_region_was_read_nor_during_the_start_up_fence() {
        let mut rb = Rebalancer::new(Params::default(), &quota(), 0);
        rb.observe("eu", rec(0.3, 1), 1_000);
        assert_eq!(rb.envelope("us", 1_000), Some(Share::WHOLE));
        assert!(rb.start_round(&busy_eu(), 1_000).unwrap().is_empty());
        assert_eq!(rb.poll(1_000), Step::Idle);

        rb.observe("us", rec(0.7, 1), 1_000);
        assert!(!rb.start_round(&busy_eu(), 1_000).unwrap().is_empty());
        let shrink = writes(rb.poll(1_000));
        rb.written(&shrink[0], WriteOutcome::Written, 1_000);
        assert_eq!(rb.poll(1_000), Step::WaitUntil(1_000 + FENCE));
    }

    #[test]
    fn a_grow_that_failed_half_way_leaves_slack_the_next_round_hands_out() {
        let mut rb = started();
        rb.start_round(&busy_eu(), 10_000).unwrap();
        let shrink = writes(rb.poll(10_000));
        rb.written(&shrink[0], WriteOutcome::Written, 10_000);
        let grow = writes(rb.poll(20_000));
        // The recipient's write times out: it may land, so eu counts at the larger share and is
        // frozen until a read shows it.
        rb.written(&grow[0], WriteOutcome::Unknown, 20_000);
        assert_eq!(rb.poll(20_000), Step::Idle);
        assert_eq!(rb.envelope("eu", 20_000), Some(grow[0].share));
        assert!(rb.frozen("eu"));
        assert_eq!(
            rb.last_round().unwrap().failed,
            [(grow[0].clone(), WriteOutcome::Unknown)]
        );

        // The read shows it did not land: the next round sends it again, same version.
        rb.observe("eu", rec(0.3, 1), 30_000);
        rb.observe(
            "us",
            ReadOutcome::Record(ShareRecord {
                share: shrink[0].share,
                version: 2,
            }),
            30_000,
        );
        assert!(rb.frozen("eu"));
        rb.start_round(&busy_eu(), 30_000).unwrap();
        let retry = writes(rb.poll(30_000));
        assert!(retry.contains(&grow[0]), "{retry:?}");
        for w in &retry {
            rb.written(w, WriteOutcome::Written, 30_000);
        }
        assert!(!rb.frozen("eu"));
        assert_eq!(rb.record("eu").unwrap().share, grow[0].share);
    }

    #[test]
    fn a_grow_the_store_refused_was_never_applied() {
        let mut rb = started();
        rb.start_round(&busy_eu(), 10_000).unwrap();
        let shrink = writes(rb.poll(10_000));
        rb.written(&shrink[0], WriteOutcome::Written, 10_000);
        let grow = writes(rb.poll(20_000));
        rb.written(&grow[0], WriteOutcome::Refused, 20_000);
        assert_eq!(rb.poll(20_000), Step::Idle);
        assert_eq!(rb.envelope("eu", 20_000), Some(s(0.3)));
        assert!(rb.frozen("eu"), "stale until read");
        // The sum is below 1 now: under-admission only.
        assert!(rb.envelope_sum_ppm(20_000) < u64::from(Share::PPM));
    }

    #[test]
    fn a_shrink_without_an_answer_funds_no_grow() {
        let mut rb = started();
        rb.start_round(&busy_eu(), 10_000).unwrap();
        let shrink = writes(rb.poll(10_000));
        rb.written(&shrink[0], WriteOutcome::Unknown, 10_050);
        // No room: the round ends without growing anyone.
        assert_eq!(rb.poll(20_000), Step::Idle);
        assert!(rb.last_round().unwrap().grown.is_empty());
        assert_eq!(rb.envelope("us", 20_000), Some(s(0.7)));
        // A read shows it landed (late): us keeps the larger share leased one fence after it.
        rb.observe(
            "us",
            ReadOutcome::Record(ShareRecord {
                share: shrink[0].share,
                version: 2,
            }),
            25_000,
        );
        assert!(!rb.frozen("us"));
        assert_eq!(rb.envelope("us", 25_000 + FENCE - 1), Some(s(0.7)));
        assert_eq!(rb.envelope("us", 25_000 + FENCE), Some(shrink[0].share));
    }

    /// us 0.7 -> 0.3 (v2) funds eu 0.3 -> 0.7 (v2); returns the rebalancer after the round.
    fn moved_to_eu() -> (Rebalancer, Share, Share) {
        let mut rb = started();
        rb.start_round(&busy_eu(), 10_000).unwrap();
        let shrink = writes(rb.poll(10_000));
        rb.written(&shrink[0], WriteOutcome::Written, 10_000);
        let grow = writes(rb.poll(20_000));
        rb.written(&grow[0], WriteOutcome::Written, 20_000);
        assert_eq!(rb.poll(20_000), Step::Idle);
        assert_eq!((shrink[0].version, grow[0].version), (2, 2));
        (rb, shrink[0].share, grow[0].share)
    }

    #[test]
    fn a_record_that_went_back_in_time_is_repaired_to_the_share_last_fenced() {
        let (mut rb, us_now, eu_now) = moved_to_eu();
        assert_eq!(rb.envelope_sum_ppm(30_000), u64::from(Share::PPM));
        // us's Redis restarted from a snapshot taken before the move: v1, 0.7 again.
        let suspect = rb.observe(
            "us",
            ReadOutcome::Unconfirmed(ShareRecord {
                share: s(0.7),
                version: 1,
            }),
            30_000,
        );
        let suspect = suspect.expect("reported");
        assert!(suspect.regressed && suspect.unconfirmed);
        assert_eq!(suspect.known.map(|k| k.share), Some(us_now));
        assert!(rb.frozen("us"));
        // The next round plans nothing for us and writes its share back, above every version
        // seen there, no larger than what was fenced for it.
        rb.start_round(&busy_eu(), 30_000).unwrap();
        let repair = writes(rb.poll(30_000));
        assert_eq!(
            repair,
            [ShareWrite {
                region: "us".into(),
                share: us_now,
                version: 3,
                kind: WriteKind::Shrink
            }]
        );
        rb.written(&repair[0], WriteOutcome::Written, 30_000);
        assert!(!rb.frozen("us"));
        // Until a fence after the repair, the share read stays in us's envelope (a sidecar that
        // does not check the stamp may apply it): nothing grows meanwhile.
        assert_eq!(rb.envelope("us", 30_000), Some(s(0.7)));
        assert_eq!(rb.envelope("us", 30_000 + FENCE), Some(us_now));
        assert_eq!(rb.envelope("eu", 30_000 + FENCE), Some(eu_now));
        assert_eq!(rb.envelope_sum_ppm(30_000 + FENCE), u64::from(Share::PPM));
    }

    #[test]
    fn a_restarted_rebalancer_repairs_a_region_to_what_the_others_leave() {
        let (_, us_now, eu_now) = moved_to_eu();
        // A new rebalancer (no memory) reads eu's v2 and us's restored v1 0.7 (unconfirmed).
        let mut rb = Rebalancer::new(Params::default(), &quota(), 0);
        rb.observe(
            "eu",
            ReadOutcome::Record(ShareRecord {
                share: eu_now,
                version: 2,
            }),
            10_000,
        );
        let suspect = rb.observe(
            "us",
            ReadOutcome::Unconfirmed(ShareRecord {
                share: s(0.7),
                version: 1,
            }),
            10_000,
        );
        assert!(suspect.is_some_and(|s| s.unconfirmed && !s.regressed && s.known.is_none()));
        rb.start_round(&busy_eu(), 10_000).unwrap();
        let repair = writes(rb.poll(10_000));
        assert_eq!(repair.len(), 1);
        assert_eq!(
            (
                repair[0].region.as_str(),
                repair[0].share,
                repair[0].version
            ),
            ("us", us_now, 2)
        );
        // A restarted Redis whose record is intact is confirmed at the same share.
        let mut rb = Rebalancer::new(Params::default(), &quota(), 0);
        rb.observe("eu", rec(0.3, 1), 10_000);
        rb.observe(
            "us",
            ReadOutcome::Unconfirmed(ShareRecord {
                share: s(0.7),
                version: 1,
            }),
            10_000,
        );
        rb.start_round(&BTreeMap::new(), 10_000).unwrap();
        let confirm = writes(rb.poll(10_000));
        assert_eq!((confirm[0].share, confirm[0].version), (s(0.7), 2));
        // A trusted read of a newer version (another writer repaired it) clears the repair.
        let mut rb = Rebalancer::new(Params::default(), &quota(), 0);
        rb.observe("eu", rec(0.3, 1), 10_000);
        rb.observe(
            "us",
            ReadOutcome::Unconfirmed(ShareRecord {
                share: s(0.7),
                version: 1,
            }),
            10_000,
        );
        assert!(rb.frozen("us"));
        assert_eq!(rb.observe("us", rec(0.7, 2), 11_000), None);
        assert!(!rb.frozen("us"));
    }

    #[test]
    fn an_unreachable_region_is_frozen_at_its_share() {
        let mut rb = started();
        rb.observe("us", ReadOutcome::Unreachable, 10_000);
        assert!(rb.start_round(&busy_eu(), 10_000).unwrap().is_empty());
        assert_eq!(rb.envelope("us", 10_000), Some(s(0.7)));
        assert_eq!(rb.poll(10_000), Step::Idle);
    }

    /// The stores of a few regions, as the rebalancer's writes reach them (or not), and the
    /// largest share any sidecar may apply: every value a record held in the last lease.
    struct World {
        names: Vec<String>,
        records: Vec<ShareRecord>,
        history: Vec<Vec<(u64, Share)>>,
        delayed: Vec<(u64, ShareWrite)>,
        now: u64,
        lease_ms: u64,
    }

    impl World {
        fn index(&self, region: &str) -> usize {
            self.names.iter().position(|n| n == region).unwrap()
        }

        fn apply(&mut self, w: &ShareWrite) -> bool {
            let i = self.index(&w.region);
            if !self.records[i].accepts(w.version) {
                return false;
            }
            self.records[i] = ShareRecord {
                share: w.share,
                version: w.version,
            };
            self.history[i].push((self.now, w.share));
            true
        }

        /// Sum over regions of the largest share a sidecar may apply now.
        fn leased_sum(&self) -> u64 {
            let since = self.now.saturating_sub(self.lease_ms);
            sum_ppm(self.history.iter().map(|h| {
                h.iter()
                    .enumerate()
                    .filter(|&(j, _)| h.get(j + 1).is_none_or(|&(next, _)| next > since))
                    .map(|(_, &(_, s))| s)
                    .max()
                    .unwrap_or(Share::ZERO)
            }))
        }

        fn check(&self) -> Result<(), TestCaseError> {
            prop_assert!(
                self.leased_sum() <= u64::from(Share::PPM),
                "at {} ms the leased shares sum to {} ppm",
                self.now,
                self.leased_sum()
            );
            Ok(())
        }

        fn advance_to(&mut self, t: u64) -> Result<(), TestCaseError> {
            self.delayed.sort_by_key(|(at, _)| *at);
            while self.delayed.first().is_some_and(|(at, _)| *at <= t) {
                let (at, w) = self.delayed.remove(0);
                self.now = self.now.max(at);
                self.apply(&w);
                self.check()?;
            }
            self.now = self.now.max(t);
            Ok(())
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// Whatever happens to the writes (answered, lost, applied without an answer, applied
        /// late) and whoever is unreachable, the shares the regions' sidecars may apply never sum
        /// above 1.
        #[test]
        fn leased_shares_never_sum_above_one_whatever_the_writes_meet(
            n in 2usize..=4,
            rounds in prop::collection::vec(
                (prop::collection::vec((0u64..2_000, 0u64..2_000, any::<bool>()), 4),
                 prop::collection::vec(0u8..12, 4)),
                1..25),
            faults in prop::collection::vec((0u8..6, 1u64..20_000), 1..64),
        ) {
            let params = Params::default();
            let names: Vec<String> = (0..n).map(|i| format!("r{i}")).collect();
            let start = Share::from_ppm(Share::PPM / n as u32).unwrap();
            let mut world = World {
                names: names.clone(),
                records: vec![ShareRecord { share: start, version: 1 }; n],
                history: vec![vec![(0, start)]; n],
                delayed: Vec::new(),
                now: 0,
                lease_ms: params.lease_ms,
            };
            let quota = RegionalQuota::equal("r", BUDGET, s(0.05), names.clone()).unwrap();
            let mut rb = Rebalancer::new(params, &quota, 0);
            let mut fault = faults.iter().cycle();
            for (k, (counters, reach)) in rounds.iter().enumerate() {
                world.advance_to(k as u64 * params.round_interval_ms)?;
                let unreachable = |i: usize| reach[i] == 0;
                for (i, name) in names.iter().enumerate() {
                    let read = if unreachable(i) {
                        ReadOutcome::Unreachable
                    } else {
                        ReadOutcome::Record(world.records[i])
                    };
                    rb.observe(name, read, world.now);
                }
                let observations = names
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| !unreachable(i))
                    .map(|(i, name)| {
                        let (admitted, rejected, rejects) = counters[i];
                        (name.clone(), obs(admitted, if rejects { rejected } else { 0 }))
                    })
                    .collect();
                if rb.start_round(&observations, world.now).is_err() {
                    continue;
                }
                loop {
                    match rb.poll(world.now) {
                        Step::Idle => break,
                        Step::WaitUntil(t) => world.advance_to(t)?,
                        Step::AwaitWrites => prop_assert!(false, "every write was answered"),
                        Step::Write(ws) => {
                            for w in ws {
                                let i = world.index(&w.region);
                                let (kind, delay) = *fault.next().unwrap();
                                let outcome = if unreachable(i) || kind == 3 {
                                    WriteOutcome::Unknown // lost
                                } else if kind == 4 {
                                    world.apply(&w); // applied, answer lost
                                    WriteOutcome::Unknown
                                } else if kind == 5 {
                                    world.delayed.push((world.now + delay, w.clone()));
                                    WriteOutcome::Unknown
                                } else if world.apply(&w) {
                                    WriteOutcome::Written
                                } else {
                                    WriteOutcome::Refused
                                };
                                world.check()?;
                                rb.written(&w, outcome, world.now);
                            }
                        }
                    }
                }
            }
            world.advance_to(u64::MAX / 2)?;
        }
    }
}
