//! The checker: holds what the upstream received against the bucket model and the policy in
//! force, granting each fault the nemesis caused the allowance docs/exactness.md gives it, and
//! nothing more.
//!
//! **Over-admission.** Every bucket's admissions (a request the upstream served; a direct
//! decision answered allowed) are replayed in time order with [`ratelimit_bucket::refill`], the
//! sidecar's own bucket math: the tokens may go below zero, and how far below zero they go at an
//! admission is the over-admission of the worst window ending there (the Lindley recursion of
//! a token bucket's arrival curve: `max over windows of admitted − C − r·window`). A second
//! replay grants the allowances as what the store forgot: a failover, or a store that lost its
//! state under `--store-reset full`, makes each bucket full again at the fault (an admission
//! on its way while the fault ran may have been decided before it or after: it is not charged
//! to what follows); a store that
//! lost its state under `empty` forgets each bucket's debt of settled costs (its buckets start
//! empty at the new epoch); after a failover, the old primary may answer beside the new one
//! until the sidecars leave it (a split brain: [`Checker::split_brain`], granted until the
//! model's bucket is full again: the new primary never saw it charged); the RLQS Envoy may spend
//! an assignment taken before the window, and in an outage of its sidecar or Redis its fallback
//! and a late assignment ([`Checker::rlqs_outage`]); a violation is an
//! admission where even that replay went below `−slack`. The slack is the
//! record's own imprecision: `r·max(0.3 s, the longest an admission in the window took from its
//! client to the record) + 1` (the record stamps arrival, or the direct caller's answer, not the
//! sidecar's decision), plus `reserve_max` per settlement the gateways gave up on.
//!
//! **Settled costs** (`llm`): charged `min(reserve, real cost)` at admission (the reservation
//! given back early: the lenient side), the excess over the reservation when the answer ended;
//! the excesses of settlements that may still be on their way (answered in the last 2.1 s: a
//! tick, the batch in flight before theirs, their own send; or
//! since a fault began until 4 s after it recovered: three sends) are allowed, the in-flight
//! excess the README grants, and so are those an Envoy restart may have lost with its queue.
//!
//! **Reloads.** The policy in force comes from the nemesis's log; for 0.5 s after a file was
//! written every policy written in that time may hold (the largest numbers are used; a burst
//! of writes is graced from its first): the reload's own bound
//! (70 ms + a round trip as shipped) with room for a loaded machine. An admission of the blocked
//! app after that is a violation.
//!
//! **Concurrency.** At every arrival of an `inflight` request, the requests the upstream held at
//! once (a request's slot is taken before it arrives and released after it is done, so the
//! upstream's intervals lie inside the slots'): at most `concurrency`, plus `concurrency` after
//! a failover, a store lost under `full`, or a fault that kept a gateway from renewing for a
//! third of `slot_ttl_ms` (its sidecar, its path to it, Redis), while a request that held its
//! slot through it still runs.
//!
//! **Answers**: 200, 429 and 503 only (every rule's `on_error` is `deny`); no answer only from an
//! Envoy that was restarted, a stream the upstream cut, or the direct caller's sidecar while it
//! was down. **Settlements**: every admitted `llm` or `bulk` request whose real cost was not its
//! reservation queued one. **Calls**: the sidecars refused none of the gateways' calls as
//! malformed or too large. **A revoked token**: once the RLQS Envoy's token was rotated out
//! (and [`REVOKED_GRACE_NS`] passed), it admits no more than what its last assignment held and
//! its fallback ([`Checker::revoked`]). **New clients**: a subject's first decision is
//! allowed but near a fault ([`Checker::new_clients`]). **The RLQS stream** breaks only under a
//! fault that breaks it ([`Checker::rlqs_streams`]). **Processes**: none panicked; each one's peak memory under its bound.

use std::collections::{BTreeMap, HashMap};

use ratelimit_bucket::refill;

use super::nemesis::{Caused, Log, CALLS_REFUSED, RLQS_STREAMS_OPENED};
use super::schedule::{Fault, StoreReset, HOT, SIDECARS, WARM, WARM_BUCKET};
use super::topology::{
    Policy, BULK_BUCKET, BULK_ENVOY, BULK_MAX_TOKENS, CONCURRENCY, FENCE_MARGIN_S, GLOBAL,
    GLOBAL_BUCKET, LLM_ENVOY, LLM_RESERVE_MAX, NATIVE_BUCKET, NATIVE_ENVOY, NATIVE_LLM,
    NATIVE_LLM_BUCKET, RLQS_ADDRESS, RLQS_ENVOY, RLQS_FALLBACK, RLQS_MARGIN_S, RLQS_SIDECAR,
    RLQS_TTL_S, USER_BUCKET,
};
use super::workload::{Kind, Sent};
use crate::upstream::Served;

mod buckets;
mod others;
#[cfg(test)]
mod tests;

use self::buckets::{Event, Loss};

/// The record's time imprecision the slack grants at least, in seconds.
const DELTA_S: f64 = 0.3;
/// How long after a bucket is full its record is gone at the soonest (lua/bucket.lua writes it
/// to expire a margin of 1 s past the margin of 1 s past when it is full), less the record's
/// imprecision.
const RECORD_GONE_NS: u64 = 1_500_000_000;
/// What Envoy logs when a fatal signal stops it (its backtrace follows).
const ENVOY_CRASHED: &str = "[critical][backtrace]";
/// How long after a policy file was written every policy written since may hold, in ns.
const RELOAD_GRACE_NS: u64 = 500_000_000;
/// How long a settlement may take to reach the store after its answer, in ns, with no fault:
/// the next tick (100 ms), the batch in flight before it (its send bounded by 1 s), then its
/// own send (1 s).
const SETTLE_NS: u64 = 2_100_000_000;
/// After a fault that delayed settlements: from its recovery (the store and the sidecars answer
/// again), in ns (three sends).
const SETTLE_AFTER_FAULT_NS: u64 = 4_000_000_000;
/// After a failover: how long a sidecar may still decide on the old primary once the new one
/// is named (its next look at Sentinel, each second; here also the orchestrator making the old
/// one a replica), in ns.
const SPLIT_AFTER_NS: u64 = 1_000_000_000;
/// A fault's window, for the table and the allowances: from its start to this long after it
/// recovered, in ns.
const AFTERMATH_NS: u64 = 3_000_000_000;
/// How long after its token was rotated out of the file the RLQS Envoy's stream may still be
/// assigned, in ns: the file is read again every 2 s, the stream checked at its next round (1 s),
/// with room for a loaded machine.
const REVOKED_GRACE_NS: u64 = 5_000_000_000;
/// How long after a fault's recovery a new client's first request may still be refused, in ns:
/// under `--store-reset empty` a bucket never seen starts empty at the new epoch and refills
/// from there (the direct rule's 5 a second pay a first cost of 1 within 0.2 s).
const NEW_CLIENT_AFTER_FAULT_NS: u64 = 2_000_000_000;
/// How many quota streams a fault that breaks the RLQS Envoy's may open: the one after it, and
/// one more if Envoy's first attempt came too early (a sidecar still starting, a token file not
/// read yet).
const RLQS_STREAMS_PER_FAULT: u64 = 2;
/// Peak resident memory each kind of process may reach, in KiB.
const RSS_BOUNDS_KIB: [(&str, u64); 3] = [
    ("sidecar", 256 * 1024),
    ("envoy", 512 * 1024),
    ("redis", 256 * 1024),
];

/// Everything a run recorded.
pub struct Record<'a> {
    pub store_reset: StoreReset,
    pub sent: &'a [Sent],
    pub served: &'a [Served],
    pub log: &'a Log,
    /// The Envoys' filter counters and the sidecars' refused calls, summed over restarts.
    pub counters: &'a [(String, u64)],
    /// Every process's log, the replaced ones included.
    pub logs: &'a [(String, String)],
    /// Every live process's peak resident memory in KiB, by name.
    pub peak_rss_kib: &'a [(String, u64)],
}

/// Something the record shows the README does not allow.
#[derive(Debug, Clone)]
pub struct Violation {
    pub what: String,
    /// When, and the smallest window that shows it (ns of [`super::clock_ns`]).
    pub at_ns: u64,
    pub window: (u64, u64),
}

/// One line of the run's table.
#[derive(Debug, Clone, Default)]
pub struct Row {
    pub class: String,
    pub faults: usize,
    pub admitted: usize,
    /// The largest over-admission measured in the class's windows (tokens), and the bound the
    /// README grants it there.
    pub over: f64,
    pub bound: f64,
    /// Refusals (429) while the model's bucket held the cost and the slack: budget the
    /// gateways did not use (leases held elsewhere, known rejections, buckets emptied).
    pub under: usize,
    /// Answers of the failure policy (503).
    pub failed: usize,
}

pub struct Verdict {
    pub rows: Vec<Row>,
    pub violations: Vec<Violation>,
    /// Settlements the gateways queued and the record expected; lost and retried; costs the
    /// gateways found unreported and answers the record made unreadable.
    pub settlements: (u64, u64, u64, u64, u64, u64),
    /// Refused with budget left (the rows' `under`), by bucket (`rule/app`).
    pub under_by_bucket: BTreeMap<String, usize>,
    /// The RLQS Envoy's quota streams its sidecar opened, and the most the faults explain.
    pub rlqs_streams: (u64, u64),
    /// The RLQS Envoy's own crashes (Envoy 1.40's defect: docs/rlqs.md), and the requests left
    /// unanswered until it was restarted.
    pub rlqs_crashes: (u64, u64),
}

pub const NO_FAULT: &str = "no fault";
pub const RELOADED: &str = "policy reloaded";

/// Checks `r`.
pub fn check(r: &Record) -> Verdict {
    let mut c = Checker::new(r);
    c.buckets();
    c.concurrency();
    c.answers();
    c.settlements();
    c.calls_refused();
    c.revoked();
    c.new_clients();
    c.rlqs_streams();
    c.processes();
    Verdict {
        rows: c.rows.into_values().collect(),
        violations: c.violations,
        settlements: c.settlements,
        under_by_bucket: c.under_by_bucket,
        rlqs_streams: c.rlqs_streams,
        rlqs_crashes: c.rlqs_crashes,
    }
}

struct Checker<'a> {
    r: &'a Record<'a>,
    served: HashMap<u64, &'a Served>,
    rows: BTreeMap<usize, Row>,
    violations: Vec<Violation>,
    settlements: (u64, u64, u64, u64, u64, u64),
    under_by_bucket: BTreeMap<String, usize>,
    rlqs_streams: (u64, u64),
    rlqs_crashes: (u64, u64),
}

/// A bucket's numbers at an instant: capacity, refill per second.
type Params = (f64, f64);

/// A bucket's events: when, the request's id (0: none), what.
type Timeline = Vec<(u64, u64, Event)>;

impl<'a> Checker<'a> {
    pub(super) fn new(r: &'a Record<'a>) -> Checker<'a> {
        let served = r.served.iter().map(|s| (s.id, s)).collect();
        let mut rows = BTreeMap::new();
        let classes = std::iter::once(NO_FAULT)
            .chain(Fault::CLASSES)
            .chain(std::iter::once(RELOADED));
        for (i, class) in classes.enumerate() {
            let faults = if class == RELOADED {
                r.log.policies.len() - 1
            } else {
                r.log
                    .faults
                    .iter()
                    .filter(|f| f.fault.class() == class)
                    .count()
            };
            rows.insert(
                i,
                Row {
                    class: class.to_string(),
                    faults,
                    ..Row::default()
                },
            );
        }
        Checker {
            r,
            served,
            rows,
            violations: Vec::new(),
            settlements: (0, 0, 0, 0, 0, 0),
            under_by_bucket: BTreeMap::new(),
            rlqs_streams: (0, 0),
            rlqs_crashes: (0, 0),
        }
    }

    /// The table row an instant belongs to: the fault whose window holds it, else a reload's,
    /// else none.
    pub(super) fn row_at(&mut self, t: u64) -> &mut Row {
        let class = self
            .r
            .log
            .faults
            .iter()
            .find(|f| f.start_ns <= t && t <= f.recovered_ns + AFTERMATH_NS)
            .map(|f| f.fault.class())
            .or_else(|| {
                self.r
                    .log
                    .policies
                    .iter()
                    .skip(1)
                    .any(|(w, _)| *w <= t && t <= w + RELOAD_GRACE_NS)
                    .then_some(RELOADED)
            })
            .unwrap_or(NO_FAULT);
        self.rows
            .values_mut()
            .find(|row| row.class == class)
            .expect("every class has a row")
    }

    /// The policy last written at `t`.
    pub(super) fn policy_at(&self, t: u64) -> &Policy {
        let p = &self.r.log.policies;
        &p[p.iter().rposition(|(w, _)| *w <= t).unwrap_or(0)].1
    }

    /// Every policy that may be in force at `t`: the one at `t` less the reload's grace, and
    /// each written since (a burst of reloads is one grace from its first write).
    /// A sidecar frozen meanwhile reads the file only once it runs again: while it was paused
    /// and for the grace after, what was in force since the grace before the pause may hold.
    pub(super) fn policies_around(&self, t: u64) -> Vec<&Policy> {
        let paused_since = self
            .r
            .log
            .faults
            .iter()
            .filter(|f| matches!(f.fault, Fault::SidecarPause { .. }))
            .filter(|f| f.start_ns <= t && t <= f.end_ns + RELOAD_GRACE_NS)
            .map(|f| f.start_ns)
            .min()
            .unwrap_or(t);
        let from = paused_since.min(t).saturating_sub(RELOAD_GRACE_NS);
        let p = &self.r.log.policies;
        // The first in the log holds from the start, even before it was written.
        let first = p.iter().rposition(|(w, _)| *w <= from).unwrap_or(0);
        std::iter::once(&p[first].1)
            .chain(
                p[first + 1..]
                    .iter()
                    .take_while(|(w, _)| *w <= t)
                    .map(|(_, policy)| policy),
            )
            .collect()
    }
}
