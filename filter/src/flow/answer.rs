//! A paused request resolved: the verdict from the sidecar's answer or from why there is
//! none, what the fast paths learn from it, and what a request that does not pass gives back.

use super::*;

impl Flow<'_> {
    /// The verdict on a waiting request from the sidecar's answer, or from why there is none
    /// (`answer` is then the error), for a call dispatched at `dispatched_ns` and answered at
    /// `now_ns`. Learns the fast paths' facts from it; a request that does not pass gives its
    /// lease takes back.
    pub fn resolve(
        &self,
        w: &mut Waiting,
        answer: Result<RequestAnswer, LimiterError>,
        dispatched_ns: u64,
        now_ns: u64,
    ) -> Verdict {
        self.resolve_under(w, answer, None, dispatched_ns, now_ns)
    }

    /// [`Flow::resolve`] of an answer its call said was decided under policy epoch `epoch`
    /// (`None`: it did not say).
    pub fn resolve_under(
        &self,
        w: &mut Waiting,
        answer: Result<RequestAnswer, LimiterError>,
        epoch: Option<u64>,
        dispatched_ns: u64,
        now_ns: u64,
    ) -> Verdict {
        if self.config.fast_paths.polls_epoch() {
            if let Some(e) = epoch {
                w.answered_epoch = e;
            }
        }
        let checked = answer.and_then(|a| verdict::check_answer(&a, w.remote.len()).map(|()| a));
        let verdict = match checked {
            Ok(answer) => self.with_answer(w, &answer, dispatched_ns, now_ns),
            Err(e) => self.without_answer(w, e, dispatched_ns, now_ns),
        };
        if matches!(verdict, Verdict::Reject(_)) {
            self.give_back(w, now_ns);
        }
        verdict
    }

    /// The verdict from a checked answer (one result per remote decision).
    pub(super) fn with_answer(
        &self,
        w: &mut Waiting,
        answer: &RequestAnswer,
        dispatched_ns: u64,
        now_ns: u64,
    ) -> Verdict {
        let config = self.config;
        // A rejected early renewal: Redis had too few tokens left because this gateway holds
        // them in the lease in use. When every remote decision of the request was such a
        // renewal (nothing was deducted for any of them), the lease pays it after all.
        let renewals_only = !answer.allowed
            && w.remote.iter().all(|d| d.renewal)
            && answer
                .results
                .iter()
                .all(|r| !r.shadow && (r.allowed || r.reason == Reason::Insufficient));
        for (d, r) in w.remote.iter().zip(&answer.results) {
            let p = &w.planned[d.planned];
            if r.error.is_some() {
                // Not decided (a rule the sidecar's policy lacks): nothing to learn, and its
                // lease ask, if any, was not granted.
                if let Some(ask) = d.ask {
                    self.release_ask(w, p, ask, dispatched_ns, now_ns);
                }
                continue;
            }
            if r.shadow && !matches!(r.reason, Reason::Ok | Reason::Unlimited) {
                self.stats.count(Stat::RuleShadowRejected(p.rule));
            }
            if !r.allowed && !renewals_only {
                self.stats.count(Stat::RuleRejected(p.rule));
            } else if answer.allowed {
                self.stats.count(Stat::RuleAdmitted(p.rule));
            }
            self.learn(w, d, r, answer.allowed, dispatched_ns, now_ns);
        }
        if answer.allowed {
            // Charged: admitted by its bucket (a shadow limit that would reject charged nothing).
            w.charged = w
                .remote
                .iter()
                .zip(&answer.results)
                .filter(|(_, r)| r.allowed && r.error.is_none() && r.reason == Reason::Ok)
                .map(|(d, r)| (d.planned, r.receipt.clone()))
                .collect();
        }
        let table = self.table(w.epoch);
        if renewals_only {
            let taken = w.taken.len();
            if self.pay_renewals(w, now_ns).is_empty() {
                let entries = taken_entries(&table, w);
                return self.admit_from_leases(w, &leased_admits(&entries));
            }
            // Not every one could be paid: give the takes just made back, reject.
            for take in w.taken.drain(taken..) {
                let p = &w.planned[take.planned];
                table.give_back(&p.id, take.lease_id, p.cost, now_ns);
            }
            for (d, r) in w.remote.iter().zip(&answer.results) {
                if !r.allowed {
                    self.stats
                        .count(Stat::RuleRejected(w.planned[d.planned].rule));
                }
            }
        }
        let entries = taken_entries(&table, w);
        if answer.allowed {
            for take in &w.taken {
                self.stats
                    .count(Stat::RuleAdmitted(w.planned[take.planned].rule));
            }
        }
        let rules: Vec<&str> = w
            .remote
            .iter()
            .map(|d| config.rules[w.planned[d.planned].rule].name.as_str())
            .collect();
        let decided = verdict::from_answer(config, answer, &rules, &leased_admits(&entries));
        self.with_undecided(w, answer, decided, now_ns)
    }

    /// The verdict when some decisions of an answer were not decided (`error` on their results:
    /// rules the sidecar's policy lacks): a request the decided ones reject stays rejected;
    /// one they admit is then up to the undecided rules' `on_error` (`allow`: admitted; `deny`:
    /// 503; `local`: their emergency buckets), the decided ones' charges being spent either way.
    pub(super) fn with_undecided(
        &self,
        w: &Waiting,
        answer: &RequestAnswer,
        decided: Verdict,
        now_ns: u64,
    ) -> Verdict {
        let mut undecided = Vec::new();
        let mut first = None;
        for (d, r) in w.remote.iter().zip(&answer.results) {
            if let Some(e) = &r.error {
                undecided.push(w.planned[d.planned].clone());
                first.get_or_insert(e);
            }
        }
        let Some(e) = first else {
            return decided;
        };
        let e = LimiterError::Request {
            code: e.code,
            message: ratelimit_wire::elide_middle(e.message.clone(), verdict::MAX_ERROR_TEXT_BYTES),
        };
        if !answer.allowed {
            self.count_limiter_error(&e, now_ns);
            return decided;
        }
        match self.on_limiter_error(&undecided, e, now_ns) {
            // Admitted by the undecided rules' policies: the decided limits' headers.
            Verdict::Admit { .. } => decided,
            rejected => rejected,
        }
    }

    /// Releases a lease ask the sidecar did not grant (it did not decide the decision).
    pub(super) fn release_ask(
        &self,
        w: &Waiting,
        p: &Planned,
        ask: LeaseAsk,
        dispatched_ns: u64,
        now_ns: u64,
    ) {
        let learned = Learned {
            cost: p.cost,
            limit: None,
            outcome: DecisionOutcome::NotDecided,
            asked_lease: Some((ask.id, ask.ttl_ms)),
            leased: 0,
            epoch: w.answered_epoch,
        };
        self.table(w.epoch)
            .learn(&p.id, &learned, dispatched_ns, now_ns);
    }

    /// What the fast paths learn from the sidecar's result `r` for remote decision `d` of
    /// request `w`, which the sidecar admitted or not (`request_allowed`).
    pub(super) fn learn(
        &self,
        w: &Waiting,
        d: &RemoteDecision,
        r: &DecisionResult,
        request_allowed: bool,
        dispatched_ns: u64,
        now_ns: u64,
    ) {
        let (p, epoch) = (&w.planned[d.planned], w.answered_epoch);
        let fp = &self.config.fast_paths;
        let outcome = if r.shadow || (r.allowed && !request_allowed) {
            DecisionOutcome::NotDecided
        } else if r.allowed {
            DecisionOutcome::Admitted
        } else {
            DecisionOutcome::Rejected {
                cause: rejection_cause(r.reason),
                retry_after_ms: r.retry_after_ms,
            }
        };
        let learns = fp.known_rejections || d.ask.is_some();
        // An admission (or shadow answer) of a bucket the table did not hold, without a lease
        // ask, would only read the table to find nothing to write: skip the read. (An entry
        // another worker made meanwhile keeps what it says until it lapses: at worst a rejection
        // stays known a little longer, never an admission more.)
        let nothing_to_learn =
            d.no_entry && d.ask.is_none() && !matches!(outcome, DecisionOutcome::Rejected { .. });
        // A full concurrency limit says nothing of the bucket, and frees at an unknown time: the
        // next request asks again.
        if !learns
            || nothing_to_learn
            || matches!(r.reason, Reason::Unlimited | Reason::Concurrency)
        {
            return;
        }
        let learned = Learned {
            cost: p.cost,
            limit: r.limit.as_ref().map(|l| KnownLimit {
                name: l.name.clone(),
                capacity: l.capacity,
                refill_per_sec: l.refill_per_sec,
            }),
            outcome: if fp.known_rejections {
                outcome
            } else {
                DecisionOutcome::NotDecided
            },
            asked_lease: d.ask.map(|a| (a.id, a.ttl_ms)),
            leased: if request_allowed { r.leased } else { 0 },
            epoch,
        };
        self.table(epoch)
            .learn(&p.id, &learned, dispatched_ns, now_ns);
    }

    /// The verdict when the sidecar could not decide: the lease asks released, early renewals
    /// paid from the leases in use if they still can, the rest by the rules' `on_error`.
    pub(super) fn without_answer(
        &self,
        w: &mut Waiting,
        e: LimiterError,
        dispatched_ns: u64,
        now_ns: u64,
    ) -> Verdict {
        for d in &w.remote {
            if let Some(ask) = d.ask {
                self.release_ask(w, &w.planned[d.planned], ask, dispatched_ns, now_ns);
            }
        }
        // The gateway holds a renewal's tokens in the lease in use whether or not the sidecar
        // answers.
        let unpaid = self.pay_renewals(w, now_ns);
        if unpaid.is_empty() {
            self.count_limiter_error(&e, now_ns);
            let entries = taken_entries(&self.table(w.epoch), w);
            return self.admit_from_leases(w, &leased_admits(&entries));
        }
        self.on_limiter_error(&unpaid, e, now_ns)
    }

    /// The verdict of a request every decision of which its leases paid (`leased`: what they say
    /// about it), counted as such.
    pub(super) fn admit_from_leases(&self, w: &Waiting, leased: &[LeasedAdmit<'_>]) -> Verdict {
        self.stats.count(Stat::LeaseAdmitted);
        for take in &w.taken {
            self.stats
                .count(Stat::RuleAdmitted(w.planned[take.planned].rule));
        }
        verdict::from_leases(self.config, leased)
    }

    pub(super) fn count_limiter_error(&self, e: &LimiterError, now_ns: u64) {
        if e.is_config_error() {
            self.stats.count(Stat::ConfigError);
            if let Some(n) = CONFIG_ERRORS_WARNED.with(|w| w.borrow_mut().met(now_ns)) {
                warn!(
                    "ratelimit filter: configuration error: {e}: {n} decision(s) since the last \
                     warning (warned at most once a minute per worker; ratelimit.config_error \
                     counts each)"
                );
            }
        } else {
            self.stats.count(Stat::LimiterError);
            debug!("ratelimit filter: limiter error: {e}");
        }
    }

    /// The verdict when the sidecar could not decide `remote`: the rules' `on_error` policies.
    pub(super) fn on_limiter_error(
        &self,
        remote: &[Planned],
        e: LimiterError,
        now_ns: u64,
    ) -> Verdict {
        let config = self.config;
        self.count_limiter_error(&e, now_ns);
        match verdict::on_error(config, remote) {
            FailurePlan::Deny => {
                self.stats.count(Stat::FailedClosed);
                Verdict::Reject(verdict::unavailable())
            }
            FailurePlan::Allow => {
                self.stats.count(Stat::FailedOpen);
                Verdict::Admit {
                    headers: Vec::new(),
                }
            }
            FailurePlan::Local(local) => {
                self.stats.count(Stat::EmergencyActivations);
                let charges = verdict::charges(config, remote, &local);
                let takes = emergency::take_all(self.store, &charges, now_ns);
                for (charge, take) in charges.iter().zip(&takes) {
                    if take.is_err() {
                        warn!(
                            "ratelimit filter: emergency bucket {:?} is contended; denying",
                            charge.key
                        );
                    }
                }
                let v = verdict::from_emergency(config, remote, &local, &takes);
                match &v {
                    Verdict::Reject(_) => self.stats.count(Stat::EmergencyRejected),
                    Verdict::Admit { .. } if verdict::fails_open(config, remote) => {
                        self.stats.count(Stat::FailedOpen)
                    }
                    Verdict::Admit { .. } => {}
                }
                v
            }
        }
    }

    /// Gives what a request took from leases back to them (it does not pass, or its client went
    /// away); a second call gives nothing.
    pub fn give_back(&self, w: &mut Waiting, now_ns: u64) {
        let table = self.table(w.epoch);
        for take in w.taken.drain(..) {
            let p = &w.planned[take.planned];
            table.give_back(&p.id, take.lease_id, p.cost, now_ns);
        }
    }

    /// This Envoy's fast-path table, as configured, answering under policy epoch `epoch`.
    pub(super) fn table(&self, epoch: u64) -> Table<'_> {
        let fp = &self.config.fast_paths;
        Table {
            store: self.store,
            slots: fp.slots,
            max_rejection_ns: fp.max_rejection_ms.saturating_mul(1_000_000),
            epoch,
        }
    }
}

/// Why the sidecar rejected a decision, as the fast paths keep it.
pub(super) fn rejection_cause(reason: Reason) -> RejectionCause {
    match reason {
        Reason::CostExceedsCapacity => RejectionCause::CostExceedsCapacity,
        Reason::Blocked => RejectionCause::Blocked,
        _ => RejectionCause::Insufficient,
    }
}

/// The table's entries of the buckets a request's leases paid (for its rate-limit headers).
pub(super) fn taken_entries(table: &Table<'_>, w: &Waiting) -> Vec<Option<fastpath::Entry>> {
    w.taken
        .iter()
        .map(|take| table.get(&w.planned[take.planned].id))
        .collect()
}

/// What those leases say about the request they paid: the limit, the tokens left.
pub(super) fn leased_admits(entries: &[Option<fastpath::Entry>]) -> Vec<LeasedAdmit<'_>> {
    entries
        .iter()
        .map(|e| LeasedAdmit {
            limit: e.as_ref().and_then(|e| e.limit.as_ref()),
            lease_tokens: e.as_ref().map_or(0, |e| e.lease.tokens),
        })
        .collect()
}
