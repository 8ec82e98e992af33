//! The request-headers (and request-body) step: which rules apply, who the client is, what the
//! fast paths answer, and what to ask the sidecar.

use super::*;

impl Flow<'_> {
    /// The request-headers step, at `now_ns`: which rules apply, who the client is, and what the
    /// fast paths answer for each decision.
    pub fn start(&self, request: &dyn RequestView, now_ns: u64, worker: &mut Worker) -> Start {
        self.start_with_body(request, None, now_ns, worker)
    }

    /// Whether the request is decided only once its body is in: a matching rule reserves from
    /// the request's JSON (`reserve_from_request_json`).
    pub fn wants_request_body(&self, request: &dyn RequestView) -> bool {
        let config = self.config;
        let any = config.rules.iter().any(|r| {
            r.cost
                .settled()
                .is_some_and(|s| s.reserve_from_request_json.is_some())
        });
        any && rules::matching(config, &self.request_facts(request))
            .iter()
            .any(|&i| {
                config.rules[i]
                    .cost
                    .settled()
                    .is_some_and(|s| s.reserve_from_request_json.is_some())
            })
    }

    /// Whether a matching rule reads its real cost from the response's body: the upstream is
    /// then asked for an uncompressed one (`accept-encoding: identity`), since a compressed body
    /// cannot be read (its cost would be unreported).
    pub fn reads_response_body(&self, request: &dyn RequestView) -> bool {
        let config = self.config;
        let reads = |i: usize| {
            config.rules[i]
                .cost
                .settled()
                .is_some_and(|s| s.reads_body())
        };
        (0..config.rules.len()).any(reads)
            && rules::matching(config, &self.request_facts(request))
                .into_iter()
                .any(reads)
    }

    pub(super) fn request_facts(&self, request: &dyn RequestView) -> RequestFacts {
        RequestFacts {
            path: request.header(":path").unwrap_or_default(),
            method: if self.reads.method {
                request.header(":method").unwrap_or_default()
            } else {
                Vec::new()
            },
            headers: self
                .reads
                .header_names
                .iter()
                .filter_map(|name| Some((name.clone(), request.header(name)?)))
                .collect::<BTreeMap<_, _>>(),
        }
    }

    /// [`Flow::start`] with the request's body (`body`: when [`Flow::wants_request_body`] said
    /// the request waits for it), from which a rule may take its reservation.
    pub fn start_with_body(
        &self,
        request: &dyn RequestView,
        body: Option<&[u8]>,
        now_ns: u64,
        worker: &mut Worker,
    ) -> Start {
        let config = self.config;
        let facts = self.request_facts(request);
        let matching = rules::matching(config, &facts);
        if matching.is_empty() {
            return Start::Pass;
        }
        // Read only what the matching rules' subjects need.
        let needs = rules::needs(config, &matching);
        let id = &config.identity;
        let api_key = match id.api_key.as_ref().filter(|_| needs.app) {
            Some(k) => match api_key(request, &k.header) {
                Ok(v) => v,
                Err(RepeatedHeader) => {
                    self.stats.count(Stat::RepeatedIdentity);
                    return Start::Reply(verdict::repeated_identity(&k.header));
                }
            },
            None => None,
        };
        let jwt = id.jwt.as_ref();
        let facts = Facts {
            api_key,
            jwt_user: jwt.filter(|_| needs.user).and_then(|j| {
                request.property(&identity::jwt_claim_property(&j.provider, &j.user_claim))
            }),
            jwt_tenant: jwt.filter(|_| needs.tenant).and_then(|j| {
                let claim = j.tenant_claim.as_ref()?;
                request.property(&identity::jwt_claim_property(&j.provider, claim))
            }),
            source_address: (id.ip && needs.ip)
                .then(|| request.property(&SOURCE_ADDRESS_PROPERTY))
                .flatten(),
            route_name: needs
                .route
                .then(|| request.property(&ROUTE_NAME_PROPERTY))
                .flatten(),
        };
        let subject = identity::resolve(id, &facts);
        let mut plan = rules::plan(config, &matching, &subject);
        // A cost settled from the response reserves what the request names, if it names it.
        for p in &mut plan.planned {
            if let Some(spec) = config.rules[p.rule].cost.settled() {
                let header = spec
                    .reserve_from_request_header
                    .as_deref()
                    .and_then(|h| request.header(h));
                p.cost = costs::reservation(spec, header.as_deref(), body, config::MAX_CAPACITY);
            }
        }
        if plan.subject_unknown {
            self.stats.count(Stat::SubjectUnknown);
        }
        if let Some(r) = plan.reject {
            let rule = &config.rules[r];
            self.stats.count(Stat::UnknownRejected);
            return Start::Reply(verdict::unknown_subject(&rule.name, rule.unknown_status));
        }
        if plan.planned.is_empty() {
            return Start::Pass;
        }
        self.start_decisions(plan.planned, now_ns, worker)
    }

    /// The fast paths for each planned decision: a known rejection answers the request, a lease
    /// pays its decision, the rest go to the sidecar (a busy bucket asking for a lease on the
    /// way).
    pub(super) fn start_decisions(
        &self,
        planned: Vec<Planned>,
        now_ns: u64,
        worker: &mut Worker,
    ) -> Start {
        let config = self.config;
        let fp = &config.fast_paths;
        let table = self.table(worker.epoch);
        let mut w = Waiting {
            planned,
            remote: Vec::new(),
            taken: Vec::new(),
            returns: Vec::new(),
            deadline_ns: now_ns + config.sidecar.timeout_ms * 1_000_000,
            epoch: worker.epoch,
            answered_epoch: worker.epoch,
            charged: Vec::new(),
        };
        let paths = ProbeFor::configured(fp);
        // What the leases said about the decisions they paid: (limit, tokens left).
        let mut paid: Vec<(Option<KnownLimit>, u64)> = Vec::new();
        for i in 0..w.planned.len() {
            let p = &w.planned[i];
            // A cost settled from the response varies per request: never paid from a lease,
            // only known rejections answer it locally (docs/costs.md).
            let metered = config.rules[p.rule].cost.settled().is_some();
            let paths = match paths {
                Some(ProbeFor::Both | ProbeFor::KnownRejections) if metered => {
                    Some(ProbeFor::KnownRejections)
                }
                Some(ProbeFor::Leases) if metered => None,
                other => other,
            };
            let rate = if fp.leases.enabled && !metered {
                worker.hotness.observe(&p.id, now_ns)
            } else {
                0.0
            };
            // A bucket busy enough for leases renews its lease before it runs out.
            let hot = fp.leases.enabled && rate >= fp.leases.min_rate_per_sec;
            let renew = hot.then_some(w.deadline_ns);
            let probe = match paths {
                Some(paths) => table.probe(&p.id, p.cost, now_ns, paths, renew),
                None => Probe::Undecided,
            };
            let no_entry = probe == Probe::NoEntry;
            let start = match probe {
                Probe::Rejected {
                    cause,
                    left_ns,
                    limit,
                } => {
                    let rule = p.rule;
                    self.give_back(&mut w, now_ns);
                    self.stats.count(Stat::KnownRejections);
                    self.stats.count(Stat::RuleRejected(rule));
                    let name = &config.rules[rule].name;
                    let reply =
                        verdict::known_rejection(config, name, limit.as_ref(), cause, left_ns);
                    return Start::Decided(Verdict::Reject(reply));
                }
                Probe::Taken {
                    lease_id,
                    tokens_left,
                    limit,
                } => {
                    w.taken.push(LeaseTake {
                        planned: i,
                        lease_id,
                    });
                    paid.push((limit, tokens_left));
                    continue;
                }
                // The next lease, while the one in use still pays (the probe marked the ask).
                Probe::Renew {
                    previous,
                    give_back,
                } => Some(LeaseStart {
                    give_back: give_back.into_iter().collect(),
                    previous,
                }),
                // A new lease in place of the one in use.
                Probe::Undecided | Probe::NoEntry if hot => {
                    table.begin_lease(&p.id, now_ns, w.deadline_ns)
                }
                Probe::Undecided | Probe::NoEntry => None,
            };
            let renewal = matches!(probe, Probe::Renew { .. });
            let ask = start.map(|start| {
                let ttl_ms = fp.leases.ttl_ms;
                let tokens = fastpath::lease_size(
                    start.previous,
                    rate,
                    now_ns,
                    ttl_ms,
                    p.cost,
                    fp.leases.max_tokens,
                );
                for (old, tokens) in start.give_back {
                    w.returns.push(LeaseReturn {
                        rule: config.rules[p.rule].name.clone(),
                        subject: p.subject.clone(),
                        id: old,
                        tokens,
                    });
                }
                LeaseAsk {
                    id: worker.lease_id(),
                    tokens,
                    ttl_ms,
                }
            });
            w.remote.push(RemoteDecision {
                planned: i,
                no_entry,
                ask,
                renewal,
            });
        }
        if w.remote.is_empty() {
            let leased: Vec<LeasedAdmit<'_>> = paid
                .iter()
                .map(|(limit, tokens)| LeasedAdmit {
                    limit: limit.as_ref(),
                    lease_tokens: *tokens,
                })
                .collect();
            return Start::Decided(self.admit_from_leases(&w, &leased));
        }
        Start::Wait(w)
    }

    /// Pays the request's early renewals from the leases in use where they still can (adding the
    /// takes to the request's); returns the remote decisions left unpaid.
    pub(super) fn pay_renewals(&self, w: &mut Waiting, now_ns: u64) -> Vec<Planned> {
        let table = self.table(w.epoch);
        let mut unpaid = Vec::new();
        for d in &w.remote {
            let p = &w.planned[d.planned];
            if d.renewal {
                if let Probe::Taken { lease_id, .. } =
                    table.probe(&p.id, p.cost, now_ns, ProbeFor::Leases, None)
                {
                    w.taken.push(LeaseTake {
                        planned: d.planned,
                        lease_id,
                    });
                    continue;
                }
            }
            unpaid.push(p.clone());
        }
        unpaid
    }
}

/// The API key header came more than once.
pub(super) struct RepeatedHeader;

/// The API key header's value: `Ok(None)` when absent, an error when it came more than once
/// (Envoy joins repeated values with "," in `request.headers`; an API key has no comma), so a
/// client cannot put a junk key in front of its real one.
pub(super) fn api_key(
    request: &dyn RequestView,
    name: &str,
) -> Result<Option<Vec<u8>>, RepeatedHeader> {
    match request.property(&["request", "headers", name]) {
        Some(v) if v.contains(&b',') => Err(RepeatedHeader),
        Some(v) => Ok(Some(v)),
        None => Ok(request.header(name)),
    }
}
