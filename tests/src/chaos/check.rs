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
//! until the sidecars leave it (a split brain: [`Checker::split_brain`]); a violation is an
//! admission where even that replay went below `−slack`. The slack is the
//! record's own imprecision: `r·0.3 s + 1` (the upstream stamps arrival, not the sidecar's
//! decision), plus `reserve_max` per settlement the gateways gave up on.
//!
//! **Settled costs** (`llm`): charged `min(reserve, real cost)` at admission (the reservation
//! given back early: the lenient side), the excess over the reservation when the answer ended;
//! the excesses of settlements that may still be on their way (answered in the last second, or
//! since a fault began until 4 s after it recovered: three sends) are allowed, the in-flight
//! excess the README grants, and so are those an Envoy restart may have lost with its queue.
//!
//! **Reloads.** The policy in force comes from the nemesis's log; for 0.5 s after a file was
//! written the older and newer numbers both hold (the larger is used): the reload's own bound
//! (70 ms + a round trip as shipped) with room for a loaded machine. An admission of the blocked
//! app after that is a violation.
//!
//! **Concurrency.** At every arrival of an `inflight` request, the requests the upstream held at
//! once (a request's slot is taken before it arrives and released after it is done, so the
//! upstream's intervals lie inside the slots'): at most `concurrency`, plus `concurrency` after
//! a failover, a store lost under `full`, or a fault that kept a gateway from renewing for a
//! third of `slot_ttl_ms`, and while a request admitted then still runs.
//!
//! **Answers**: 200, 429 and 503 only (every rule's `on_error` is `deny`); no answer only from an
//! Envoy that was restarted, a stream the upstream cut, or the direct caller's sidecar while it
//! was down. **Settlements**: every admitted `llm` request whose real cost was not its
//! reservation queued one. **Processes**: none panicked; each one's peak memory under its bound.

use std::collections::{BTreeMap, HashMap};

use ratelimit_bucket::refill;

use super::nemesis::{Caused, Log};
use super::schedule::{Fault, StoreReset, HOT, WARM, WARM_BUCKET};
use super::topology::{Policy, CONCURRENCY, LLM_RESERVE_MAX};
use super::workload::{Kind, Sent};
use crate::upstream::Served;

/// The record's time imprecision the slack grants, in seconds.
const DELTA_S: f64 = 0.3;
/// How long after a policy file was written both policies hold, in ns.
const RELOAD_GRACE_NS: u64 = 500_000_000;
/// How long a settlement may take to reach the store after its answer, in ns (the filter's
/// send timeout is 1 s).
const SETTLE_NS: u64 = 1_000_000_000;
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
    /// The Envoys' filter counters, summed over their restarts.
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
    c.processes();
    Verdict {
        rows: c.rows.into_values().collect(),
        violations: c.violations,
        settlements: c.settlements,
    }
}

struct Checker<'a> {
    r: &'a Record<'a>,
    served: HashMap<u64, &'a Served>,
    rows: BTreeMap<usize, Row>,
    violations: Vec<Violation>,
    settlements: (u64, u64, u64, u64, u64, u64),
}

/// A bucket's numbers at an instant: capacity, refill per second.
type Params = (f64, f64);

/// A bucket's events: when, the request's id (0: none), what.
type Timeline = Vec<(u64, u64, Event)>;

/// What happens to a bucket, in time order.
#[derive(Debug, Clone, Copy)]
enum Event {
    /// An admission: charged `charge` now, checked against `cost` (its reservation); decided
    /// after `sent` (the client sent it then).
    Admit { cost: f64, charge: f64, sent: u64 },
    /// A refusal (429) of `cost`: counted as under-admission if the model had it.
    Refuse { cost: f64 },
    /// A settlement's excess reaching the store.
    Debit(f64),
    /// The store forgot what it was charged (the allowance of fault `.1`, an index into the
    /// nemesis's log).
    Forgive(Loss, usize),
}

/// What a store that forgot may hold afterwards.
#[derive(Debug, Clone, Copy)]
enum Loss {
    /// Any bucket full again.
    Refilled,
    /// Any bucket empty at the new epoch: at most what it held, but a debt is gone.
    Emptied,
}

impl<'a> Checker<'a> {
    fn new(r: &'a Record<'a>) -> Checker<'a> {
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
        }
    }

    /// The table row an instant belongs to: the fault whose window holds it, else a reload's,
    /// else none.
    fn row_at(&mut self, t: u64) -> &mut Row {
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

    /// The policy in force at `t`, and the one before it while the reload's grace lasts.
    fn policies_at(&self, t: u64) -> (&Policy, Option<&Policy>) {
        let p = &self.r.log.policies;
        let i = p.iter().rposition(|(w, _)| *w <= t).unwrap_or(0);
        let before = (i > 0 && t < p[i].0 + RELOAD_GRACE_NS).then(|| &p[i - 1].1);
        (&p[i].1, before)
    }

    /// What fault `f` may have made the store forget ([`Loss`]): a failover (what was spent in
    /// the replication lag, under either store policy: at most the bucket full again); a store
    /// that lost its state or went back to an older one (a primary killed and back before the
    /// Sentinels failed over comes back empty): its buckets full again under `full`, empty at
    /// its new epoch under `empty`. Either way a debt of settled costs goes with the state.
    fn loss(&self, f: &Caused) -> Option<Loss> {
        let lost_state = matches!(
            f.fault,
            Fault::PrimaryKill { .. }
                | Fault::StoreFlush
                | Fault::StoreRestartEmpty
                | Fault::StoreSnapshotRestore { .. }
        );
        match self.r.store_reset {
            _ if f.failover => Some(Loss::Refilled),
            StoreReset::Full if lost_state => Some(Loss::Refilled),
            StoreReset::Empty if lost_state => Some(Loss::Emptied),
            _ => None,
        }
    }

    /// Whether an admission sent at `sent` and seen at `t` may have been decided before a loss
    /// of the store's state as well as after it: the fault ran while it was on its way.
    fn around_a_loss(&self, sent: u64, t: u64) -> bool {
        self.r
            .log
            .faults
            .iter()
            .any(|f| self.loss(f).is_some() && sent <= f.end_ns && f.start_ns <= t)
    }

    /// What the old primary of failover `f` may admit beside the new one: from its return (the
    /// fault's end) until the sidecars leave it ([`SPLIT_AFTER_NS`] after the new one is named),
    /// `r` per second, from what it held: a bucket's capacity (a pause keeps its state and the
    /// promoted copy spends it again; a restart under `full` starts full), none for a restart
    /// under `empty` (its new epoch starts empty). docs/exactness.md, a Redis failover.
    fn split_brain(&self, f: &Caused, capacity: f64, rate: f64) -> f64 {
        let back_ns = f.recovered_ns.saturating_sub(f.end_ns) + SPLIT_AFTER_NS;
        let held = match (&f.fault, self.r.store_reset) {
            (Fault::PrimaryKill { .. }, StoreReset::Empty) => 0.0,
            _ => capacity,
        };
        held + rate * back_ns as f64 / 1e9
    }

    /// Replays every bucket.
    fn buckets(&mut self) {
        let mut by_bucket: BTreeMap<(&str, &str), Timeline> = BTreeMap::new();
        let lost = self.counter("settlements_lost");
        for s in self.r.sent {
            let key = (s.rule, s.app.as_str());
            let admitted_at = match s.kind {
                Kind::Direct { repeat, .. } => {
                    (s.status == 200 && !repeat).then_some(s.answered_ns)
                }
                _ => self.served.get(&s.id).map(|v| v.arrival_ns),
            };
            let (cost, real) = match s.kind {
                Kind::Api | Kind::Hold { .. } => (1.0, 1.0),
                Kind::Direct { cost, .. } => (cost as f64, cost as f64),
                Kind::Llm {
                    reserve,
                    tokens,
                    readable,
                    ..
                } => (
                    reserve as f64,
                    if readable { tokens } else { LLM_RESERVE_MAX } as f64,
                ),
            };
            if s.rule == "inflight" {
                continue;
            }
            let events = by_bucket.entry(key).or_default();
            match admitted_at {
                Some(t) => {
                    events.push((
                        t,
                        s.id,
                        Event::Admit {
                            cost,
                            charge: cost.min(real),
                            sent: s.sent_ns,
                        },
                    ));
                    // A settlement an Envoy restart may have lost is the excess the README
                    // grants (docs/costs.md, an Envoy that stops): not debited.
                    if real > cost && !self.settlement_cut_by_restart(s) {
                        events.push((s.answered_ns, s.id, Event::Debit(real - cost)));
                    }
                }
                None if s.status == 429 => {
                    events.push((s.answered_ns, s.id, Event::Refuse { cost }));
                }
                None => {}
            }
        }
        for ((rule, app), mut events) in by_bucket {
            for (i, f) in self.r.log.faults.iter().enumerate() {
                if let Some(loss) = self.loss(f) {
                    events.push((f.start_ns, 0, Event::Forgive(loss, i)));
                }
            }
            events.sort_by_key(|(t, id, _)| (*t, *id));
            let extra = if rule == "llm" {
                lost as f64 * LLM_RESERVE_MAX as f64
            } else {
                0.0
            };
            self.replay(rule, app, &events, extra);
        }
    }

    /// Whether `s`'s settlement may have been lost with its Envoy: the Envoy was restarted
    /// while the request ran, or within `SETTLE_NS` after its answer (a settlement still queued,
    /// or counted after the nemesis read the counters).
    fn settlement_cut_by_restart(&self, s: &Sent) -> bool {
        self.r.log.faults.iter().any(|f| {
            matches!(f.fault, Fault::EnvoyRestart { envoy } if Some(envoy) == s.envoy)
                && f.start_ns <= s.answered_ns + SETTLE_NS
                && s.sent_ns <= f.end_ns
        })
    }

    /// Since when a settlement answered at `t` or later may still be on its way to the store:
    /// `SETTLE_NS` before `t`, or, while a fault and the three sends after its recovery last,
    /// since the fault began.
    fn in_flight_since(&self, t: u64) -> u64 {
        self.r
            .log
            .faults
            .iter()
            .filter(|f| f.start_ns <= t && t <= f.recovered_ns + SETTLE_AFTER_FAULT_NS)
            .map(|f| f.start_ns.saturating_sub(SETTLE_NS))
            .min()
            .unwrap_or(t.saturating_sub(SETTLE_NS))
            .min(t.saturating_sub(SETTLE_NS))
    }

    /// Capacity and refill of `rule` for `app` at `t` (the larger of two policies during a
    /// reload).
    fn params(&self, rule: &str, app: &str, t: u64) -> Params {
        let of = |p: &Policy| match rule {
            "per-app" if app == WARM => (WARM_BUCKET.0 as f64, WARM_BUCKET.1),
            "per-app" => (p.per_app.0 as f64, p.per_app.1),
            "llm" => (200.0, 50.0),
            "direct" => (10.0, 5.0),
            other => unreachable!("no bucket for rule {other}"),
        };
        let (now, before) = self.policies_at(t);
        let (c, r) = of(now);
        match before.map(of) {
            Some((c0, r0)) => (c.max(c0), r.max(r0)),
            None => (c, r),
        }
    }

    /// Whether `app` is blocked at `t` (after the reload's grace).
    fn blocked(&self, app: &str, t: u64) -> bool {
        let (now, before) = self.policies_at(t);
        (app == HOT || app == WARM) && now.hot_blocked && before.is_none_or(|b| b.hot_blocked)
    }

    fn replay(&mut self, rule: &str, app: &str, events: &[(u64, u64, Event)], extra: f64) {
        let first = events.first().map_or(0, |e| e.0);
        let (c0, _) = self.params(rule, app, first);
        // Strict: as if no fault forgave anything (the table's figure); allowed: with the
        // allowances (the verdict).
        // The strict replay follows the allowed one outside faults' windows, so that a row's
        // figure is what its own fault let through.
        let (mut strict, mut allowed) = (c0, c0);
        let mut strict_until = 0;
        // A failover's split brain ([`Self::split_brain`]): tokens granted until `split_until`.
        let (mut split, mut split_until) = (0.0, 0);
        let mut last = first;
        // Where the allowed replay's current run below capacity began: the window's start.
        let mut window_start = first;
        // Settlements' excesses by answer time: those still on their way are allowed.
        let debits: Vec<(u64, f64)> = events
            .iter()
            .filter_map(|&(t, _, e)| match e {
                Event::Debit(x) => Some((t, x)),
                _ => None,
            })
            .collect();
        for &(t, id, event) in events {
            let (capacity, rate) = self.params(rule, app, t);
            let elapsed_us = (t.saturating_sub(last)) as f64 / 1_000.0;
            strict = refill(strict, rate, elapsed_us, capacity);
            allowed = refill(allowed, rate, elapsed_us, capacity);
            last = t;
            if t > strict_until {
                strict = allowed;
            }
            if allowed >= capacity {
                window_start = t;
            }
            let since = self.in_flight_since(t);
            let in_flight: f64 = debits
                .iter()
                .filter(|(a, _)| *a >= since && *a <= t)
                .map(|d| d.1)
                .sum();
            let slack = rate * DELTA_S + 1.0 + extra + in_flight;
            match event {
                Event::Admit { cost, charge, sent } => {
                    if t > split_until {
                        split = 0.0;
                    }
                    if self.around_a_loss(sent, t) {
                        // Decided on the store that lost it, or on the one after: either way
                        // not owed to what follows.
                        self.row_at(t).admitted += 1;
                        continue;
                    }
                    let over_strict = cost - strict;
                    let over_allowed = cost - allowed - split;
                    strict -= charge;
                    allowed -= charge;
                    // What the old primary admitted in a split brain is drawn from its own
                    // allowance first.
                    let drawn = split.min((-allowed).max(0.0));
                    split -= drawn;
                    allowed += drawn;
                    let blocked = self.blocked(app, t);
                    let row = self.row_at(t);
                    row.admitted += 1;
                    if over_strict > row.over {
                        row.over = over_strict;
                        row.bound = over_strict - over_allowed + slack;
                    }
                    if over_allowed > slack {
                        self.violations.push(Violation {
                            what: format!(
                                "{rule}/{app}: request {id} admitted {over_allowed:.1} tokens past \
                                 the bucket (slack {slack:.1}, capacity {capacity}, refill {rate}/s)"
                            ),
                            at_ns: t,
                            window: (window_start, t),
                        });
                    }
                    if blocked {
                        self.violations.push(Violation {
                            what: format!("{rule}/{app}: request {id} admitted while blocked"),
                            at_ns: t,
                            window: (t.saturating_sub(RELOAD_GRACE_NS), t),
                        });
                    }
                }
                Event::Refuse { cost } => {
                    let blocked = self.blocked(app, t);
                    if !blocked && allowed >= cost + slack {
                        self.row_at(t).under += 1;
                    }
                }
                Event::Debit(x) => {
                    strict -= x;
                    allowed -= x;
                }
                Event::Forgive(loss, i) => {
                    strict = allowed;
                    let fault = self.r.log.faults.get(i);
                    strict_until = fault.map_or(t, |f| f.recovered_ns + AFTERMATH_NS);
                    if let Some(f) = fault.filter(|f| f.failover) {
                        split = self.split_brain(f, capacity, rate);
                        split_until = f.recovered_ns + AFTERMATH_NS;
                    }
                    allowed = match loss {
                        Loss::Refilled => capacity,
                        Loss::Emptied => allowed.max(0.0),
                    };
                }
            }
        }
    }

    /// Requests the upstream held at once, against `concurrency`.
    fn concurrency(&mut self) {
        let mut holds: Vec<(u64, u64, u64)> = self
            .r
            .sent
            .iter()
            .filter(|s| matches!(s.kind, Kind::Hold { .. }))
            .filter_map(|s| {
                self.served
                    .get(&s.id)
                    .map(|v| (v.arrival_ns, v.done_ns, s.id))
            })
            .collect();
        holds.sort();
        for (i, &(arrival, _, id)) in holds.iter().enumerate() {
            let overlapping: Vec<u64> = holds[..i]
                .iter()
                .filter(|(_, done, _)| *done > arrival)
                .map(|h| h.0)
                .collect();
            let at_once = overlapping.len() as u64 + 1;
            // A slot taken while slots may have been lost may be one of those the store forgot
            // (the other primary's, the one that expired): allowed while its request runs.
            let lost = std::iter::once(arrival)
                .chain(overlapping.iter().copied())
                .any(|a| self.slots_may_be_lost(a));
            let allowance = if lost { CONCURRENCY } else { 0 };
            self.row_at(arrival).admitted += 1;
            if at_once > CONCURRENCY + allowance {
                let start = overlapping.iter().copied().min().unwrap_or(arrival);
                self.violations.push(Violation {
                    what: format!(
                        "inflight: request {id} made {at_once} in flight at once (concurrency \
                         {CONCURRENCY}, allowance {allowance})"
                    ),
                    at_ns: arrival,
                    window: (start, arrival),
                });
            }
        }
    }

    /// Whether slots may have been lost or expired at `t`: a failover or a store lost under
    /// `full`, or a fault that kept a gateway from renewing for a third of `slot_ttl_ms`.
    fn slots_may_be_lost(&self, t: u64) -> bool {
        self.r.log.faults.iter().any(|f| {
            let within = f.start_ns <= t && t <= f.recovered_ns + AFTERMATH_NS;
            let ttl_ms = self.policies_at(f.start_ns).0.slot_ttl_ms;
            let long = f.fault.lasts_ms() * 3 >= ttl_ms
                || (f.end_ns - f.start_ns) / 1_000_000 * 3 >= ttl_ms;
            within && (matches!(self.loss(f), Some(Loss::Refilled)) || long)
        })
    }

    /// Statuses the failure policies allow.
    fn answers(&mut self) {
        for s in self.r.sent {
            let t = s.answered_ns;
            let ok = match s.status {
                200 | 429 | 503 => true,
                0 => self.no_answer_allowed(s),
                _ => false,
            };
            if s.status == 503 {
                self.row_at(t).failed += 1;
            }
            if !ok {
                self.violations.push(Violation {
                    what: format!(
                        "{}/{}: request {} answered {} ({:?})",
                        s.rule, s.app, s.id, s.status, s.kind
                    ),
                    at_ns: t,
                    window: (s.sent_ns, t),
                });
            }
        }
    }

    /// No answer: an Envoy restarted under it, a stream the upstream cut, or the direct caller's
    /// sidecar down.
    fn no_answer_allowed(&self, s: &Sent) -> bool {
        if matches!(s.kind, Kind::Llm { cut: true, .. }) {
            return true;
        }
        self.r.log.faults.iter().any(|f| {
            let overlaps = f.start_ns <= s.answered_ns && s.sent_ns <= f.recovered_ns;
            overlaps
                && match (&f.fault, s.envoy) {
                    (Fault::EnvoyRestart { envoy }, Some(e)) => *envoy == e,
                    (Fault::SidecarRestart { sidecar: 0, .. }, None)
                    | (Fault::SidecarPause { sidecar: 0, .. }, None) => true,
                    _ => false,
                }
        })
    }

    fn counter(&self, name: &str) -> u64 {
        self.r
            .counters
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0, |c| c.1)
    }

    /// Every admitted `llm` request whose real cost was not its reservation queued a settlement
    /// (those an Envoy restart cut excepted).
    fn settlements(&mut self) {
        let mut expected = 0;
        let mut unsure = 0;
        let mut unreadable = 0;
        for s in self.r.sent {
            let Kind::Llm {
                reserve,
                tokens,
                readable,
                ..
            } = s.kind
            else {
                continue;
            };
            if !self.served.contains_key(&s.id) {
                continue;
            }
            unreadable += u64::from(!readable);
            let real = if readable { tokens } else { LLM_RESERVE_MAX };
            if real == reserve {
                continue;
            }
            if self.settlement_cut_by_restart(s) {
                unsure += 1;
            } else {
                expected += 1;
            }
        }
        let queued = self.counter("costs_settled");
        self.settlements = (
            queued,
            expected,
            self.counter("settlements_lost"),
            self.counter("settlements_retried"),
            self.counter("costs_unreported"),
            unreadable,
        );
        if queued < expected || queued > expected + unsure {
            self.violations.push(Violation {
                what: format!(
                    "llm: the gateways queued {queued} settlements; the record expects {expected} \
                     (and up to {unsure} more cut by an Envoy restart); they found {} costs \
                     unreported, the record {unreadable} unreadable answers",
                    self.counter("costs_unreported")
                ),
                at_ns: 0,
                window: (0, 0),
            });
        }
    }

    /// No process panicked; each one's peak memory is under its bound.
    fn processes(&mut self) {
        for (name, log) in self.r.logs {
            if let Some(line) = log.lines().find(|l| l.contains("panicked at")) {
                self.violations.push(Violation {
                    what: format!("{name} panicked: {line}"),
                    at_ns: 0,
                    window: (0, 0),
                });
            }
        }
        for (name, kib) in self.r.peak_rss_kib {
            let bound = RSS_BOUNDS_KIB
                .iter()
                .find(|(kind, _)| name.starts_with(kind))
                .map_or(u64::MAX, |b| b.1);
            if *kib > bound {
                self.violations.push(Violation {
                    what: format!("{name} reached {kib} KiB resident (bound {bound} KiB)"),
                    at_ns: 0,
                    window: (0, 0),
                });
            }
        }
    }
}
