//! Over-admission: every bucket's admissions replayed against the model, with the allowances
//! of the faults the nemesis caused.

use super::*;

/// What happens to a bucket, in time order.
#[derive(Debug, Clone, Copy)]
pub(super) enum Event {
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
    /// Fault `.0` (an index into the nemesis's log) began: what the RLQS Envoy may admit
    /// meanwhile beyond the tokens taken for it ([`Checker::rlqs_outage`]).
    Outage(usize),
}

/// What a store that forgot may hold afterwards.
#[derive(Debug, Clone, Copy)]
pub(super) enum Loss {
    /// Any bucket full again.
    Refilled,
    /// Any bucket empty at the new epoch: at most what it held, but a debt is gone.
    Emptied,
}

impl Checker<'_> {
    /// What fault `f` may have made the store forget ([`Loss`]): a failover (what was spent in
    /// the replication lag, under either store policy: at most the bucket full again); a store
    /// that lost its state or went back to an older one (a primary killed and back before the
    /// Sentinels failed over comes back empty): its buckets full again under `full`, empty at
    /// its new epoch under `empty`. Either way a debt of settled costs goes with the state.
    pub(super) fn loss(&self, f: &Caused) -> Option<Loss> {
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
    pub(super) fn around_a_loss(&self, sent: u64, t: u64) -> bool {
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
    pub(super) fn split_brain(&self, f: &Caused, capacity: f64, rate: f64) -> f64 {
        let back_ns = f.recovered_ns.saturating_sub(f.end_ns) + SPLIT_AFTER_NS;
        let held = match (&f.fault, self.r.store_reset) {
            (Fault::PrimaryKill { .. }, StoreReset::Empty) => 0.0,
            _ => capacity,
        };
        held + rate * back_ns as f64 / 1e9
    }

    /// What the RLQS Envoy may admit beyond the tokens taken for it because of fault `f`
    /// (docs/rlqs.md, the bound and failure), at `rate`: while its sidecar or the store cannot
    /// assign, the shipped fallback once its assignment expired (10 tokens, then 1 a second), and
    /// an assignment planned before the fault applied after it (its rate × the fault's length:
    /// the delivery margin assumed).
    pub(super) fn rlqs_outage(&self, f: &Caused, rate: f64) -> f64 {
        let reaches = match f.fault {
            Fault::SidecarPause { sidecar, .. }
            | Fault::SidecarRestart { sidecar, .. }
            | Fault::RedisCut { sidecar, .. }
            | Fault::RedisDelay { sidecar, .. } => sidecar == RLQS_SIDECAR,
            // Its stream ended (a token rotated out of the file): an outage of its own.
            Fault::TokenRevoked { .. } => true,
            Fault::EnvoyRestart { .. }
            | Fault::GatewayCut { .. }
            | Fault::GatewayDelay { .. }
            | Fault::AnswersLost { .. }
            | Fault::ClockStep { .. } => false,
            _ => true,
        };
        if !reaches {
            return 0.0;
        }
        let outage_s = f.recovered_ns.saturating_sub(f.start_ns) as f64 / 1e9;
        let (tokens, per_s) = RLQS_FALLBACK;
        tokens + per_s * (outage_s - RLQS_TTL_S).max(0.0) + rate * outage_s
    }

    /// Replays every bucket.
    pub(super) fn buckets(&mut self) {
        let mut by_bucket: BTreeMap<(&str, &str), Timeline> = BTreeMap::new();
        // Per rule, the settlements its Envoy lost ([`LLM_ENVOY`], [`BULK_ENVOY`]), at most
        // those that owed tokens (a lost one costs its excess) and were answered while a fault
        // could make their sends fail.
        let lost_on = |envoy: usize| self.counter(&format!("settlements_lost@{envoy}"));
        let lost = [("llm", lost_on(LLM_ENVOY)), ("bulk", lost_on(BULK_ENVOY))];
        let mut at_risk: BTreeMap<&str, u64> = BTreeMap::new();
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
                    // grants (docs/costs.md, an Envoy that stops): not debited; nor is a native
                    // stream-done call a fault may have failed (Envoy sends it once and counts
                    // nothing the record can read: docs/grpc.md, costs known after the response).
                    let native_lost =
                        s.envoy == Some(NATIVE_ENVOY) && self.settlement_may_fail(s.answered_ns);
                    if real > cost && !self.settlement_cut_by_restart(s) && !native_lost {
                        events.push((s.answered_ns, s.id, Event::Debit(real - cost)));
                        if self.settlement_may_fail(s.answered_ns) {
                            *at_risk.entry(s.rule).or_default() += 1;
                        }
                    }
                }
                None if s.status == 429 => {
                    events.push((s.answered_ns, s.id, Event::Refuse { cost }));
                }
                None => {}
            }
        }
        for ((rule, app), mut events) in by_bucket {
            let rlqs = rule == "per-ip" && app == RLQS_ADDRESS.to_string();
            for (i, f) in self.r.log.faults.iter().enumerate() {
                if let Some(loss) = self.loss(f) {
                    events.push((f.start_ns, 0, Event::Forgive(loss, i)));
                }
                if rlqs {
                    events.push((f.start_ns, 0, Event::Outage(i)));
                }
            }
            events.sort_by_key(|(t, id, _)| (*t, *id));
            let lost = lost.iter().find(|(r, _)| *r == rule).map_or(0, |l| l.1);
            let lost = lost.min(at_risk.get(rule).copied().unwrap_or(0)) as f64;
            let extra = match rule {
                "llm" => lost * LLM_RESERVE_MAX as f64,
                "bulk" => lost * BULK_MAX_TOKENS as f64,
                // Tokens taken for the RLQS Envoy before a window, spent in it: its assignment's
                // burst and rate until the horizon, and the one before it until the new one
                // applies (docs/rlqs.md, the bound: a window that starts mid-run).
                _ if rlqs => NATIVE_BUCKET.1 * (1.0 + RLQS_TTL_S + 2.0 * RLQS_MARGIN_S),
                // Two regions, one budget: `C + R·(T + margin)` (docs/regions.md).
                GLOBAL => GLOBAL_BUCKET.1 * FENCE_MARGIN_S,
                _ => 0.0,
            };
            self.replay(rule, app, &events, extra);
        }
    }

    /// Whether a settlement answered at `t` may have been given up (its sends failed): a fault
    /// began before its sends could have ended, and it was answered before the fault's
    /// aftermath ended.
    pub(super) fn settlement_may_fail(&self, t: u64) -> bool {
        self.r
            .log
            .faults
            .iter()
            .any(|f| f.start_ns <= t + SETTLE_NS && t <= f.recovered_ns + SETTLE_AFTER_FAULT_NS)
    }

    /// Whether `s`'s settlement may have been lost with its Envoy: the Envoy was restarted
    /// while the request ran, or within `SETTLE_NS` after its answer (a settlement still queued,
    /// or counted after the nemesis read the counters).
    pub(super) fn settlement_cut_by_restart(&self, s: &Sent) -> bool {
        self.r.log.faults.iter().any(|f| {
            matches!(f.fault, Fault::EnvoyRestart { envoy } if Some(envoy) == s.envoy)
                && f.start_ns <= s.answered_ns + SETTLE_NS
                && s.sent_ns <= f.end_ns
        })
    }

    /// Since when a settlement answered at `t` or later may still be on its way to the store:
    /// `SETTLE_NS` before `t`, or, while a fault and the three sends after its recovery last,
    /// since the fault began.
    pub(super) fn in_flight_since(&self, t: u64) -> u64 {
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

    /// Capacity and refill of `rule` for `app` at `t` (the largest of the policies that may be
    /// in force: [`Checker::policies_around`]).
    pub(super) fn params(&self, rule: &str, app: &str, t: u64) -> Params {
        let of = |p: &Policy| match rule {
            "per-app" if app == WARM => (WARM_BUCKET.0 as f64, WARM_BUCKET.1),
            "per-app" => (p.per_app.0 as f64, p.per_app.1),
            "llm" => (200.0, 50.0),
            "direct" => (10.0, 5.0),
            "bulk" => (BULK_BUCKET.0 as f64, BULK_BUCKET.1),
            "per-user" => (USER_BUCKET.0 as f64, USER_BUCKET.1),
            "per-ip" => (NATIVE_BUCKET.0 as f64, NATIVE_BUCKET.1),
            NATIVE_LLM => (NATIVE_LLM_BUCKET.0 as f64, NATIVE_LLM_BUCKET.1),
            GLOBAL => (GLOBAL_BUCKET.0 as f64, GLOBAL_BUCKET.1),
            other => unreachable!("no bucket for rule {other}"),
        };
        self.policies_around(t)
            .into_iter()
            .map(of)
            .fold((0.0, 0.0), |(c, r), (c1, r1)| {
                (f64::max(c, c1), f64::max(r, r1))
            })
    }

    /// Whether `app` is blocked at `t` (after the reload's grace).
    pub(super) fn blocked(&self, app: &str, t: u64) -> bool {
        (app == HOT || app == WARM) && self.policies_around(t).iter().all(|p| p.hot_blocked)
    }

    /// Whether `rule` is not in the policy at `t` (after the reload's grace): a request it
    /// would limit gets the rule's `on_error` (`deny`), never an admission.
    pub(super) fn removed(&self, rule: &str, t: u64) -> bool {
        rule == "per-user" && self.policies_around(t).iter().all(|p| !p.per_user)
    }

    pub(super) fn replay(
        &mut self,
        rule: &str,
        app: &str,
        events: &[(u64, u64, Event)],
        extra: f64,
    ) {
        let first = events.first().map_or(0, |e| e.0);
        let (c0, _) = self.params(rule, app, first);
        // Strict: as if no fault forgave anything (the table's figure); allowed: with the
        // allowances (the verdict).
        // The strict replay follows the allowed one outside faults' windows, so that a row's
        // figure is what its own fault let through.
        let (mut strict, mut allowed) = (c0, c0);
        let mut strict_until = 0;
        // A failover's split brain ([`Self::split_brain`]): what the old primary admitted beside
        // the new one (until `split_until`), which the new one never saw charged: granted until
        // the replay is full again after that.
        let (mut split, mut split_until) = (0.0, 0);
        // The RLQS Envoy's admissions during outages ([`Self::rlqs_outage`]): granted until the
        // replay is full again after `outage_until` (a late assignment's life after the fault).
        let (mut outage, mut outage_until) = (0.0, 0);
        let mut last = first;
        // Where the allowed replay's current run below capacity began: the window's start.
        let mut window_start = first;
        // The longest an admission in that window took from its client to the record (s): when
        // it was decided is known only that closely.
        let mut window_lag = 0.0_f64;
        // Settlements' excesses by answer time: those still on their way are allowed.
        let debits: Vec<(u64, f64)> = events
            .iter()
            .filter_map(|&(t, _, e)| match e {
                Event::Debit(x) => Some((t, x)),
                _ => None,
            })
            .collect();
        // The capacity and refill at the last event, and since when the strict and allowed
        // replays have been full (none: not full).
        let mut before = self.params(rule, app, first);
        let (mut strict_full, mut allowed_full): (Option<u64>, Option<u64>) = (None, None);
        for &(t, id, event) in events {
            let (capacity, rate) = self.params(rule, app, t);
            // A raised capacity fills at the refill rate from what the bucket holds, but a
            // bucket full for longer than its record lives is no longer held: it starts full at
            // the new capacity, as a new client's does (README, changing a limit).
            let full_since = |held: f64, since: Option<u64>| {
                let (was, was_rate) = before;
                if held >= was {
                    return since.or(Some(last));
                }
                let full_ns = ((was - held) / was_rate.max(f64::MIN_POSITIVE) * 1e9) as u64;
                Some(last.saturating_add(full_ns)).filter(|at| *at <= t)
            };
            strict_full = full_since(strict, strict_full);
            allowed_full = full_since(allowed, allowed_full);
            let gone = |since: Option<u64>| {
                capacity > before.0 && since.is_some_and(|f| t >= f.saturating_add(RECORD_GONE_NS))
            };
            let (strict_gone, allowed_gone) = (gone(strict_full), gone(allowed_full));
            before = (capacity, rate);
            let elapsed_us = (t.saturating_sub(last)) as f64 / 1_000.0;
            strict = refill(strict, rate, elapsed_us, capacity);
            allowed = refill(allowed, rate, elapsed_us, capacity);
            if strict_gone {
                strict = capacity;
            }
            if allowed_gone {
                allowed = capacity;
            }
            last = t;
            if t > strict_until {
                strict = allowed;
            }
            if allowed >= capacity {
                window_start = t;
                window_lag = 0.0;
                // What the store did not see charged stops mattering once the model's bucket is
                // full again: both are then full.
                if t > split_until {
                    split = 0.0;
                }
                if t > outage_until {
                    outage = 0.0;
                }
            }
            let since = self.in_flight_since(t);
            let in_flight: f64 = debits
                .iter()
                .filter(|(a, _)| *a >= since && *a <= t)
                .map(|d| d.1)
                .sum();
            let mut slack = rate * DELTA_S.max(window_lag) + 1.0 + extra + in_flight;
            match event {
                Event::Admit { cost, charge, sent } => {
                    window_lag = window_lag.max(t.saturating_sub(sent) as f64 / 1e9);
                    slack = rate * DELTA_S.max(window_lag) + 1.0 + extra + in_flight;
                    if self.around_a_loss(sent, t) {
                        // Decided on the store that lost it, or on the one after: either way
                        // not owed to what follows.
                        self.row_at(t).admitted += 1;
                        continue;
                    }
                    let over_strict = cost - strict;
                    let over_allowed = cost - allowed - split - outage;
                    strict -= charge;
                    allowed -= charge;
                    // What the old primary admitted in a split brain is drawn from its own
                    // allowance first, what an outage let through from its own next.
                    for pool in [&mut split, &mut outage] {
                        let drawn = pool.min((-allowed).max(0.0));
                        *pool -= drawn;
                        allowed += drawn;
                    }
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
                    if self.removed(rule, t) {
                        self.violations.push(Violation {
                            what: format!(
                                "{rule}/{app}: request {id} admitted while its rule was not in \
                                 the policy"
                            ),
                            at_ns: t,
                            window: (t.saturating_sub(RELOAD_GRACE_NS), t),
                        });
                    }
                }
                Event::Refuse { cost } => {
                    let blocked = self.blocked(app, t);
                    if !blocked && allowed >= cost + slack {
                        self.row_at(t).under += 1;
                        *self
                            .under_by_bucket
                            .entry(format!("{rule}/{app}"))
                            .or_default() += 1;
                    }
                }
                Event::Debit(x) => {
                    strict -= x;
                    allowed -= x;
                }
                Event::Outage(i) => {
                    if let Some(f) = self.r.log.faults.get(i) {
                        outage += self.rlqs_outage(f, rate);
                        let late = ((RLQS_TTL_S + RLQS_MARGIN_S) * 1e9) as u64;
                        outage_until = outage_until.max(f.recovered_ns + late);
                    }
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
}
