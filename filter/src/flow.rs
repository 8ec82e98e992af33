//! The life of one request through the filter, without host calls. [`Flow::start`] takes the
//! request's facts and either answers it from what the gateway knows (no rule applies, an
//! identity it cannot name, a known rejection, leases that pay every decision) or says what to
//! ask the sidecar ([`Waiting`]); [`Flow::resolve`] turns the sidecar's answer, or why there is
//! none, into the [`Verdict`], learns the fast paths' facts from it, and gives back what the
//! request took from leases if it does not pass. [`batch`] picks the requests each call carries;
//! [`link`] is the worker's stream to the sidecar that carries the calls.
//!
//! The host adapter (`crate::host`) gathers the facts, calls these and carries the verdicts out.
//! What the flow needs from it comes in explicitly: the request through [`RequestView`], shared
//! data through [`SharedStore`], the time as a parameter (the host reads its clock once per
//! callback), and the stats go to a [`Stats`] sink. Why each fast path is exact:
//! docs/fast-paths.md.

mod answer;
pub mod batch;
pub mod link;
mod response;
mod root;
mod setup;
mod start;
pub mod streams;
mod tick;
mod worker;

pub use setup::{Setup, Tally};
pub use worker::{Begun, Body, Carry, Headers, Host, Worker};

use std::collections::BTreeMap;

use log::{debug, warn};
use ratelimit_wire::{Decision, DecisionResult, LeaseAsk, LeaseReturn, Reason, RequestAnswer};

use crate::config::{self, Config};
use crate::costs::{self, Meter};
use crate::emergency;
use crate::epoch;
use crate::fastpath::{
    self, DecisionOutcome, KnownLimit, Learned, LeaseStart, Probe, ProbeFor, RejectionCause, Table,
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

impl Stat {
    /// Every counter but the rules' own, with its name, in the order the host defines them.
    pub const GLOBAL: [(Stat, &'static str); 23] = [
        (Stat::Admitted, "admitted"),
        (Stat::Rejected, "rejected"),
        (Stat::LimiterError, "limiter_error"),
        (Stat::ConfigError, "config_error"),
        (Stat::FailedOpen, "failed_open"),
        (Stat::FailedClosed, "failed_closed"),
        (Stat::EmergencyActivations, "emergency_activations"),
        (Stat::EmergencyRejected, "emergency_rejected"),
        (Stat::SubjectUnknown, "subject_unknown"),
        (Stat::UnknownRejected, "unknown_rejected"),
        (Stat::RepeatedIdentity, "repeated_identity"),
        (Stat::KnownRejections, "known_rejections"),
        (Stat::LeaseAdmitted, "lease_admitted"),
        (Stat::Callouts, "callouts"),
        (Stat::CostsSettled, "costs_settled"),
        (Stat::CostsUnreported, "costs_unreported"),
        (Stat::SettlementsRetried, "settlements_retried"),
        (Stat::SettlementsLost, "settlements_lost"),
        (Stat::SlotsRenewed, "slots_renewed"),
        (Stat::SlotsReleased, "slots_released"),
        (Stat::SlotsExpired, "slots_expired"),
        (Stat::SlotsRetried, "slots_retried"),
        (Stat::SlotsLost, "slots_lost"),
    ];

    /// The names of the counters of `config`, each under `<stat_prefix>.`: [`Stat::GLOBAL`]'s,
    /// then three per rule (`rule.<name>.admitted`, `.rejected`, `.shadow_rejected`).
    pub fn names(config: &Config) -> Vec<String> {
        let global = Stat::GLOBAL.iter().map(|(_, name)| name.to_string());
        let rules = config.rules.iter().flat_map(|r| {
            ["admitted", "rejected", "shadow_rejected"].map(|c| format!("rule.{}.{c}", r.name))
        });
        global.chain(rules).collect()
    }

    /// Where this counter is in [`Stat::names`] of a configuration of `rules` rules (`None`: a
    /// rule it does not have).
    pub fn index(self, rules: usize) -> Option<usize> {
        let rule = |i: usize, k: usize| (i < rules).then_some(Stat::GLOBAL.len() + 3 * i + k);
        match self {
            Stat::RuleAdmitted(i) => rule(i, 0),
            Stat::RuleRejected(i) => rule(i, 1),
            Stat::RuleShadowRejected(i) => rule(i, 2),
            global => Stat::GLOBAL.iter().position(|(s, _)| *s == global),
        }
    }
}

/// Where the flow counts.
pub trait Stats {
    /// Adds `n` to `stat`.
    fn add(&self, stat: Stat, n: u64);

    /// Records `value` in `histogram`.
    fn record(&self, histogram: Histogram, value: u64);

    fn count(&self, stat: Stat) {
        self.add(stat, 1);
    }
}

/// A histogram of the filter (the host defines each as the Envoy stat `<stat_prefix>.<name>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Histogram {
    /// Requests per call to the sidecar (`batch_requests`).
    BatchRequests,
    /// Microseconds from a call's sending to its answer, or to giving up on it (`decision_us`).
    DecisionUs,
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

#[cfg(test)]
mod tests;
