//! The life of one request through the filter, without host calls. [`Flow::start`] takes the
//! request's facts and either answers it from what the gateway knows (no rule applies, an
//! identity it cannot name, a known rejection, leases that pay every decision) or says what to
//! ask the sidecar ([`Waiting`]); [`Flow::resolve`] turns the sidecar's answer, or why there is
//! none, into the [`Verdict`], learns the fast paths' facts from it, and gives back what the
//! request took from leases if it does not pass. [`batch`] picks the requests each callout
//! carries; [`courier`] is how the workers of one Envoy share callouts.
//!
//! The host adapter (`crate::host`) gathers the facts, calls these and carries the verdicts out.
//! What the flow needs from it comes in explicitly: the request through [`RequestView`], shared
//! data through [`SharedStore`], the time as a parameter (the host reads its clock once per
//! callback), and the stats go to a [`Stats`] sink. Why each fast path is exact:
//! docs/fast-paths.md.

pub mod batch;
pub mod courier;

use std::collections::BTreeMap;

use log::{debug, warn};
use ratelimit_wire::{
    Decision, DecisionResult, LeaseAsk, LeaseReturn, Reason, RequestAnswer, MAX_LEASE_ID,
};

use crate::config::{self, Config};
use crate::costs::{self, Meter};
use crate::emergency;
use crate::epoch;
use crate::fastpath::{
    self, DecisionOutcome, Hotness, KnownLimit, Learned, LeaseStart, Probe, ProbeFor,
    RejectionCause, Table,
};
use crate::identity::{self, Facts, ROUTE_NAME_PROPERTY, SOURCE_ADDRESS_PROPERTY};
use crate::rules::{self, Planned, RequestFacts};
use crate::shared::SharedStore;
use crate::verdict::{self, FailurePlan, LeasedAdmit, LimiterError, LocalReply, Verdict};

/// A counter of the filter (the host defines each as the Envoy stat `<stat_prefix>.<name>`;
/// docs/observability.md says what each counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stat {
    Admitted,
    Rejected,
    LimiterError,
    ConfigError,
    FailedOpen,
    FailedClosed,
    EmergencyActivations,
    EmergencyRejected,
    SubjectUnknown,
    UnknownRejected,
    RepeatedIdentity,
    KnownRejections,
    LeaseAdmitted,
    Callouts,
    Forwarded,
    /// Responses that reported a real cost other than the reservation (a settlement queued).
    CostsSettled,
    /// Responses of a rule with a `cost` object whose cost could not be read (not reported,
    /// compressed, cut short): settled at the rule's `unreported_cost`.
    CostsUnreported,
    /// Settlements sent again after their call failed.
    SettlementsRetried,
    /// Settlements given up (their calls failed every time, or the outbox was full).
    SettlementsLost,
    /// Concurrency slots renewed by the sidecar (docs/concurrency.md).
    SlotsRenewed,
    /// Concurrency slots released at their stream's end.
    SlotsReleased,
    /// Renewals or releases of slots the sidecar no longer held (expired).
    SlotsExpired,
    /// Releases sent again after their call failed.
    SlotsRetried,
    /// Releases given up (3 sends failed, or too many waiting): those slots expire by themselves.
    SlotsLost,
    /// `rule.<name>.admitted` of the rule with this index in [`Config::rules`].
    RuleAdmitted(usize),
    /// `rule.<name>.rejected`.
    RuleRejected(usize),
    /// `rule.<name>.shadow_rejected`.
    RuleShadowRejected(usize),
}

/// Where the flow counts.
pub trait Stats {
    /// Adds `n` to `stat`.
    fn add(&self, stat: Stat, n: u64);

    fn count(&self, stat: Stat) {
        self.add(stat, 1);
    }
}

/// What the flow may read of a request; it reads each only when a matching rule needs it.
pub trait RequestView {
    /// The first value of a request header, as bytes; `None` when absent or unreadable.
    fn header(&self, name: &str) -> Option<Vec<u8>>;
    /// A property's bytes; `None` when absent, null or unreadable.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
}

/// What the flow reads of every request besides `:path`, derived from the configuration once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestReads {
    /// Request headers some rule's `match.headers` reads.
    header_names: Vec<String>,
    /// Some rule matches on the method ([`Config::matches_methods`]).
    method: bool,
}

impl RequestReads {
    pub fn of(config: &Config) -> RequestReads {
        RequestReads {
            header_names: config.matched_header_names().into_iter().collect(),
            method: config.matches_methods(),
        }
    }
}

/// What one worker VM keeps across its requests: how busy each bucket is here, and a counter for
/// the ids of its lease asks.
#[derive(Debug)]
pub struct Worker {
    hotness: Hotness,
    nonce: u64,
    lease_counter: u64,
    /// The sidecar's policy epoch as this worker last read it ([`crate::epoch`]; 0: unknown).
    epoch: u64,
}

impl Worker {
    /// A worker whose lease ids derive from `nonce` (random per VM).
    pub fn new(nonce: u64) -> Worker {
        Worker {
            hotness: Hotness::default(),
            nonce,
            lease_counter: 0,
            epoch: 0,
        }
    }

    /// The policy epoch this worker's fast paths answer under.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The id of the next lease ask: splitmix64 of (nonce + counter), distinct per VM and per
    /// ask, below 2^53 (JSON carries it exactly), never 0.
    fn lease_id(&mut self) -> u64 {
        self.lease_counter = self.lease_counter.wrapping_add(1);
        let mut z = self
            .nonce
            .wrapping_add(self.lease_counter.wrapping_mul(0x9e3779b97f4a7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^= z >> 31;
        (z & MAX_LEASE_ID).max(1)
    }
}

/// How often a worker with rules whose costs settle from the response sends its settlements
/// (at most; a callout of decisions carries them on its way sooner).
pub const SETTLE_TICK_MS: u64 = 100;

/// What [`Flow::start`] decided.
#[derive(Debug)]
pub enum Start {
    /// No rule applies, or none asks anything: the request passes untouched.
    Pass,
    /// The rules cannot name the client (an API key sent twice, an unknown subject a rule
    /// rejects): answered with this reply, not by a limit.
    Reply(LocalReply),
    /// Decided from what the gateway knows: a known rejection, or leases that paid every
    /// decision.
    Decided(Verdict),
    /// The sidecar decides the rest: the request waits for its answer.
    Wait(Waiting),
}

/// A request waiting for the sidecar: its decisions, what its leases already paid, and what it
/// asks.
#[derive(Debug)]
pub struct Waiting {
    /// Every applicable decision of the request.
    planned: Vec<Planned>,
    /// The decisions the sidecar makes, in the order of the call.
    remote: Vec<RemoteDecision>,
    /// What leases paid, given back if the request does not pass.
    taken: Vec<LeaseTake>,
    /// Lease leftovers given back with the callout.
    returns: Vec<LeaseReturn>,
    deadline_ns: u64,
    /// The policy epoch its worker knew when it came: its leases and known rejections answer
    /// under it.
    epoch: u64,
    /// The epoch what it learns from its answer is tagged with: the one its call said it was
    /// decided under, else `epoch`.
    answered_epoch: u64,
    /// The decisions (indices into `planned`) the sidecar charged for an admitted request, with
    /// the receipts of their charges: what a cost settled from the response may settle
    /// ([`Flow::metered`]).
    charged: Vec<(usize, Option<String>)>,
}

/// A charged decision whose real cost its response reports ([`crate::costs`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metered {
    /// Its rule's index in [`Config::rules`].
    pub rule: usize,
    pub subject: ratelimit_wire::Subject,
    pub reserved: u64,
    /// The receipt of the charge, for the settlement to give back against.
    pub receipt: Option<String>,
    pub meter: Meter,
}

/// One decision of a waiting request that the sidecar makes.
#[derive(Debug, Clone, PartialEq)]
struct RemoteDecision {
    /// Its index in [`Waiting::planned`].
    planned: usize,
    /// The fast-path table held no entry of its bucket when the request came (an admission then
    /// has nothing to learn there).
    no_entry: bool,
    /// The lease it asks for on the way.
    ask: Option<LeaseAsk>,
    /// It asks for the next lease although the one in use could pay it (an early renewal); if
    /// the sidecar cannot grant it, the lease in use still pays.
    renewal: bool,
}

/// A decision paid from a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LeaseTake {
    /// Its index in [`Waiting::planned`].
    planned: usize,
    lease_id: u64,
}

impl Waiting {
    /// When the request's failure policies apply if the sidecar has not answered.
    pub fn deadline_ns(&self) -> u64 {
        self.deadline_ns
    }

    /// How many decisions its call carries.
    pub fn remote_decisions(&self) -> usize {
        self.remote.len()
    }

    /// The lease leftovers given back with its call.
    pub fn returns(&self) -> &[LeaseReturn] {
        &self.returns
    }

    /// An upper bound of the bytes its call's body spends on it: its decisions and lease
    /// returns ([`ratelimit_wire::budget`]).
    pub fn wire_bytes(&self, config: &Config) -> usize {
        use ratelimit_wire::budget;
        let decisions: usize = self
            .remote
            .iter()
            .map(|d| {
                let p = &self.planned[d.planned];
                let rule = &config.rules[p.rule];
                let receipt = rule.cost.settled().is_some();
                budget::decision_bytes_of(&rule.name, &p.subject, p.cost, d.ask.as_ref(), receipt)
            })
            .sum();
        let returns: usize = self.returns.iter().map(budget::return_bytes).sum();
        16 + decisions + returns
    }

    /// The wire decisions of its call.
    pub fn decisions(&self, config: &Config) -> Vec<Decision> {
        self.remote
            .iter()
            .map(|d| {
                let p = &self.planned[d.planned];
                let rule = &config.rules[p.rule];
                Decision {
                    rule: rule.name.clone(),
                    subject: p.subject.clone(),
                    cost: p.cost,
                    lease: d.ask,
                    // A reservation settled from the response: the sidecar keeps what it charged.
                    receipt: rule.cost.settled().is_some(),
                }
            })
            .collect()
    }
}

/// How often a worker warns of configuration errors (a rule the sidecar's policy lacks) at most:
/// a line per request would bury the log, and `ratelimit.config_error` counts each anyway.
const CONFIG_ERROR_WARN_INTERVAL_NS: u64 = 60_000_000_000;

std::thread_local! {
    /// This worker's configuration-error warnings (a VM runs on one thread).
    static CONFIG_ERRORS_WARNED: std::cell::RefCell<WarnEvery> =
        const { std::cell::RefCell::new(WarnEvery { last_ns: None, since: 0 }) };
}

/// A warning given at once, then at most once per [`CONFIG_ERROR_WARN_INTERVAL_NS`], with how
/// many occurrences it stands for.
#[derive(Debug)]
struct WarnEvery {
    last_ns: Option<u64>,
    since: u64,
}

impl WarnEvery {
    /// Notes one occurrence at `now_ns`; the number to warn of (this one included) when due.
    fn met(&mut self, now_ns: u64) -> Option<u64> {
        self.since += 1;
        let due = self
            .last_ns
            .is_none_or(|at| now_ns.saturating_sub(at) >= CONFIG_ERROR_WARN_INTERVAL_NS);
        if !due {
            return None;
        }
        self.last_ns = Some(now_ns);
        Some(std::mem::take(&mut self.since))
    }
}

/// The request flow of one plugin configuration, over one Envoy's shared data.
pub struct Flow<'a> {
    pub config: &'a Config,
    pub reads: &'a RequestReads,
    pub store: &'a dyn SharedStore,
    pub stats: &'a dyn Stats,
}

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

    fn request_facts(&self, request: &dyn RequestView) -> RequestFacts {
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
    fn start_decisions(&self, planned: Vec<Planned>, now_ns: u64, worker: &mut Worker) -> Start {
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

    /// The charged decisions of an admitted request whose real cost its response reports: one
    /// [`Meter`] each, for the host to feed the response to ([`Flow::settled`] at its end).
    pub fn metered(&self, w: &Waiting) -> Vec<Metered> {
        w.charged
            .iter()
            .filter_map(|(i, receipt)| {
                let p = &w.planned[*i];
                let spec = self.config.rules[p.rule].cost.settled()?;
                Some(Metered {
                    rule: p.rule,
                    subject: p.subject.clone(),
                    reserved: p.cost,
                    receipt: receipt.clone(),
                    meter: Meter::new(spec),
                })
            })
            .collect()
    }

    /// A metered decision's response is over (`complete`: its body ended, not cut short): the
    /// settlement to send, if the real cost differs from the reservation. A response whose cost
    /// cannot be read (not reported, compressed, cut short) settles at the rule's
    /// `unreported_cost`, never at what the client chose ([`costs::CostSpec::unreported`]).
    pub fn settled(
        &self,
        mut m: Metered,
        complete: bool,
        budget: &mut costs::Budget,
    ) -> Option<costs::Settlement> {
        let spec = self.config.rules[m.rule].cost.settled()?;
        let cost = match m.meter.finish(complete, budget) {
            Some(cost) => cost,
            None => {
                self.stats.count(Stat::CostsUnreported);
                spec.unreported(config::MAX_CAPACITY)
            }
        };
        let cost = cost.min(config::MAX_CAPACITY);
        if cost == m.reserved {
            return None;
        }
        self.stats.count(Stat::CostsSettled);
        Some(costs::Settlement {
            rule: self.config.rules[m.rule].name.clone(),
            subject: m.subject,
            reserved: m.reserved,
            cost,
            receipt: m.receipt,
        })
    }

    /// Counts what an outbox could not deliver.
    pub fn count_delivery(&self, d: costs::Delivery) {
        self.stats.add(Stat::SettlementsRetried, d.retried);
        self.stats.add(Stat::SettlementsLost, d.lost);
    }

    /// Counts what a slots call (or its failure) did.
    pub fn count_slots(&self, d: crate::slots::SlotDelivery) {
        self.stats.add(Stat::SlotsRenewed, d.renewed);
        self.stats.add(Stat::SlotsReleased, d.released);
        self.stats.add(Stat::SlotsExpired, d.expired);
        self.stats.add(Stat::SlotsRetried, d.retried);
        self.stats.add(Stat::SlotsLost, d.lost);
    }

    /// Counts a verdict the host carried out: the request admitted, or answered 429.
    pub fn delivered(&self, verdict: &Verdict) {
        match verdict {
            Verdict::Admit { .. } => self.stats.count(Stat::Admitted),
            Verdict::Reject(reply) if reply.status == 429 => self.stats.count(Stat::Rejected),
            Verdict::Reject(_) => {}
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

    /// The verdict from a checked answer (one result per remote decision).
    fn with_answer(
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
    fn with_undecided(
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
    fn release_ask(
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
    fn learn(
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
    fn without_answer(
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

    /// Pays the request's early renewals from the leases in use where they still can (adding the
    /// takes to the request's); returns the remote decisions left unpaid.
    fn pay_renewals(&self, w: &mut Waiting, now_ns: u64) -> Vec<Planned> {
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

    /// The verdict of a request every decision of which its leases paid (`leased`: what they say
    /// about it), counted as such.
    fn admit_from_leases(&self, w: &Waiting, leased: &[LeasedAdmit<'_>]) -> Verdict {
        self.stats.count(Stat::LeaseAdmitted);
        for take in &w.taken {
            self.stats
                .count(Stat::RuleAdmitted(w.planned[take.planned].rule));
        }
        verdict::from_leases(self.config, leased)
    }

    fn count_limiter_error(&self, e: &LimiterError, now_ns: u64) {
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
    fn on_limiter_error(&self, remote: &[Planned], e: LimiterError, now_ns: u64) -> Verdict {
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

    /// This Envoy's fast-path table, as configured, answering under policy epoch `epoch`.
    fn table(&self, epoch: u64) -> Table<'_> {
        let fp = &self.config.fast_paths;
        Table {
            store: self.store,
            slots: fp.slots,
            max_rejection_ns: fp.max_rejection_ms.saturating_mul(1_000_000),
            epoch,
        }
    }

    /// How often the host ticks, in milliseconds (`None`: no tick needed): with coalescing, for
    /// the queue's deadlines (half the callout timeout, at most 50 ms); with the policy epoch
    /// polled, at least [`epoch::TICKS_PER_POLL`] times per poll period.
    pub fn tick_period_ms(&self) -> Option<u64> {
        let fp = &self.config.fast_paths;
        let queue = fp
            .coalesce
            .then(|| (self.config.sidecar.timeout_ms / 2).clamp(1, 50));
        let poll = fp
            .polls_epoch()
            .then(|| (fp.policy_poll_ms / epoch::TICKS_PER_POLL).max(1));
        // Settlements of costs known after the response are sent at ticks (docs/costs.md).
        let settle = self
            .config
            .rules
            .iter()
            .any(|r| r.cost.settled().is_some())
            .then_some(SETTLE_TICK_MS);
        // Any rule may limit requests in flight (the sidecar's policy says which): the slots of
        // admitted streams are renewed and released at ticks (docs/concurrency.md).
        let slots = Some(crate::slots::TICK_MS);
        [queue, poll, settle, slots].into_iter().flatten().min()
    }

    /// A tick of `worker` at `now_ns`: it reads the published policy epoch, and whether it sends
    /// the poll for this Envoy now (then [`Flow::polled`] with its answer).
    pub fn tick(&self, worker: &mut Worker, now_ns: u64) -> bool {
        if !self.config.fast_paths.polls_epoch() {
            return false;
        }
        let timeout_ns = self.config.sidecar.timeout_ms.saturating_mul(1_000_000);
        let t = epoch::tick(self.store, now_ns, timeout_ns);
        worker.epoch = t.epoch;
        t.poll
    }

    /// The answer to the epoch poll `worker` sent at `dispatched_ns`: the epoch read (`None`: no
    /// answer, or not one), published for every worker.
    pub fn polled(&self, worker: &mut Worker, epoch: Option<u64>, dispatched_ns: u64) {
        let period_ns = self
            .config
            .fast_paths
            .policy_poll_ms
            .saturating_mul(1_000_000);
        worker.epoch = epoch::polled(self.store, epoch, dispatched_ns, period_ns);
    }

    /// A call's answer said it was decided under policy epoch `epoch`: when that is not the one
    /// `worker` knows, the poll is made due at once (once per call, and a shared-data write only
    /// then).
    pub fn answered_under(&self, worker: &Worker, epoch: Option<u64>) {
        match epoch {
            Some(e) if self.config.fast_paths.polls_epoch() && e != worker.epoch => {
                epoch::answered(self.store, e)
            }
            _ => {}
        }
    }
}

/// The API key header came more than once.
struct RepeatedHeader;

/// The API key header's value: `Ok(None)` when absent, an error when it came more than once
/// (Envoy joins repeated values with "," in `request.headers`; an API key has no comma), so a
/// client cannot put a junk key in front of its real one.
fn api_key(request: &dyn RequestView, name: &str) -> Result<Option<Vec<u8>>, RepeatedHeader> {
    match request.property(&["request", "headers", name]) {
        Some(v) if v.contains(&b',') => Err(RepeatedHeader),
        Some(v) => Ok(Some(v)),
        None => Ok(request.header(name)),
    }
}

/// Why the sidecar rejected a decision, as the fast paths keep it.
fn rejection_cause(reason: Reason) -> RejectionCause {
    match reason {
        Reason::CostExceedsCapacity => RejectionCause::CostExceedsCapacity,
        Reason::Blocked => RejectionCause::Blocked,
        _ => RejectionCause::Insufficient,
    }
}

/// The table's entries of the buckets a request's leases paid (for its rate-limit headers).
fn taken_entries(table: &Table<'_>, w: &Waiting) -> Vec<Option<fastpath::Entry>> {
    w.taken
        .iter()
        .map(|take| table.get(&w.planned[take.planned].id))
        .collect()
}

/// What those leases say about the request they paid: the limit, the tokens left.
fn leased_admits(entries: &[Option<fastpath::Entry>]) -> Vec<LeasedAdmit<'_>> {
    entries
        .iter()
        .map(|e| LeasedAdmit {
            limit: e.as_ref().and_then(|e| e.limit.as_ref()),
            lease_tokens: e.as_ref().map_or(0, |e| e.lease.tokens),
        })
        .collect()
}

#[cfg(test)]
mod tests;
