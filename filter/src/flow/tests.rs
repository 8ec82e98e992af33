//! The request flow and the batcher, with shared data, counters and the request in memory and
//! time driven explicitly.

use std::cell::RefCell;
use std::collections::BTreeMap;

use ratelimit_wire::{
    AppliedLimit, DecideRequest, ErrorCode, RequestError, Subject as WireSubject,
    MAX_CALL_DECISIONS, MAX_RETURNS,
};
use serde_json::{json, Value};

use super::batch::{limits, Queue};
use super::*;
use crate::shared::fake::Memory;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const S: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * S;

/// The configuration of these tests: one rule `per-app` on `/api/`, by `app` (the API key
/// `alpha-key` names `alpha`), `on_error: deny`, a 50 ms timeout; `edit` changes its JSON.
fn config(edit: impl FnOnce(&mut Value)) -> Config {
    let mut v = json!({
        "domain": "test",
        "sidecar": {"cluster": "sidecar", "timeout_ms": 50},
        "identity": {
            "api_key": {"header": "x-api-key", "keys": {
                "677509799af78b2efa2f2af71d0f906e0a0c50c048efd3b515625f788e92b99a": "alpha"}},
            "ip": true
        },
        "rules": [
            {"name": "per-app", "match": {"path_prefix": "/api/"}, "subject": ["app"],
             "on_error": "deny"}
        ]
    });
    edit(&mut v);
    Config::from_json(v.to_string().as_bytes()).unwrap_or_else(|e| panic!("{v} refused: {e}"))
}

/// Every bucket is busy enough for leases from its first request (5 a second counted).
fn busy(v: &mut Value) {
    v["fast_paths"] = json!({"leases": {"min_rate_per_sec": 1}});
}

/// A second rule, `per-ip` on `/api/`, by `ip`, `on_error: allow`.
fn per_ip(v: &mut Value) {
    v["rules"].as_array_mut().unwrap().push(json!(
        {"name": "per-ip", "match": {"path_prefix": "/api/"}, "subject": ["ip"],
         "on_error": "allow"}
    ));
}

/// Counters in memory.
#[derive(Default)]
struct Counts(RefCell<BTreeMap<Stat, u64>>);

impl Stats for Counts {
    fn add(&self, stat: Stat, n: u64) {
        *self.0.borrow_mut().entry(stat).or_default() += n;
    }

    fn record(&self, _histogram: Histogram, _value: u64) {}
}

/// A request's headers and properties (a property by its path joined with `.`).
#[derive(Default)]
struct FakeRequest {
    headers: BTreeMap<String, Vec<u8>>,
    properties: BTreeMap<String, Vec<u8>>,
}

impl RequestView for FakeRequest {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.headers.get(name).cloned()
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.properties.get(&path.join(".")).cloned()
    }
}

/// A GET of `path` from 10.0.0.1 with the API key `api_key`, if any.
fn request(path: &str, api_key: Option<&str>) -> FakeRequest {
    let mut r = FakeRequest::default();
    r.headers.insert(":path".into(), path.into());
    r.headers.insert(":method".into(), b"GET".to_vec());
    if let Some(k) = api_key {
        r.headers.insert("x-api-key".into(), k.into());
    }
    r.properties
        .insert("source.address".into(), b"10.0.0.1:5000".to_vec());
    r
}

/// alpha's request.
fn alpha() -> FakeRequest {
    request("/api/orders", Some("alpha-key"))
}

/// One worker of one Envoy: the flow over shared data and counters in memory.
struct Gateway {
    config: Config,
    reads: RequestReads,
    store: Memory,
    counts: Counts,
    worker: Worker,
}

impl Gateway {
    fn new(config: Config) -> Gateway {
        Gateway {
            reads: RequestReads::of(&config),
            config,
            store: Memory::default(),
            counts: Counts::default(),
            worker: Worker::new(42),
        }
    }

    fn flow(&self) -> Flow<'_> {
        Flow {
            config: &self.config,
            reads: &self.reads,
            store: &self.store,
            stats: &self.counts,
        }
    }

    fn start(&mut self, request: &FakeRequest, now_ns: u64) -> Start {
        let flow = Flow {
            config: &self.config,
            reads: &self.reads,
            store: &self.store,
            stats: &self.counts,
        };
        flow.start(request, now_ns, &mut self.worker)
    }

    /// What the sidecar answered at `now_ns` to a call sent at `dispatched_ns`.
    fn resolve(
        &self,
        w: &mut Waiting,
        answer: Result<RequestAnswer, LimiterError>,
        dispatched_ns: u64,
        now_ns: u64,
    ) -> Verdict {
        self.flow().resolve(w, answer, dispatched_ns, now_ns)
    }

    /// The counters that are not zero.
    fn counted(&self) -> Vec<(Stat, u64)> {
        self.counts.0.borrow().clone().into_iter().collect()
    }

    fn count(&self, stat: Stat) -> u64 {
        self.counts.0.borrow().get(&stat).copied().unwrap_or(0)
    }

    /// The fast-path entry of alpha's `per-app` bucket.
    fn entry(&self) -> Option<fastpath::Entry> {
        self.flow().table(0).get("test/per-app|app=alpha")
    }
}

fn waits(s: Start) -> Waiting {
    match s {
        Start::Wait(w) => w,
        other => panic!("expected to wait for the sidecar, got {other:?}"),
    }
}

fn decided(s: Start) -> Verdict {
    match s {
        Start::Decided(v) => v,
        other => panic!("expected a local verdict, got {other:?}"),
    }
}

fn reply(s: Start) -> LocalReply {
    match s {
        Start::Reply(r) => r,
        other => panic!("expected a reply, got {other:?}"),
    }
}

fn rejection(v: Verdict) -> LocalReply {
    match v {
        Verdict::Reject(r) => r,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

fn admitted_with(v: Verdict) -> Vec<(String, String)> {
    match v {
        Verdict::Admit { headers } => headers,
        other => panic!("expected an admission, got {other:?}"),
    }
}

fn header<'a>(reply: &'a LocalReply, name: &str) -> Option<&'a str> {
    reply
        .headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

fn limit() -> Option<AppliedLimit> {
    Some(AppliedLimit {
        name: "per-app".into(),
        capacity: 100,
        refill_per_sec: 10.0,
    })
}

/// Admitted, with `leased` tokens granted under the decision's lease ask.
fn admitted(leased: u64) -> DecisionResult {
    DecisionResult {
        allowed: true,
        remaining: 50,
        retry_after_ms: 0,
        reset_ms: 5_000,
        reason: Reason::Ok,
        limit: limit(),
        shadow: false,
        leased,
        receipt: None,
        error: None,
    }
}

/// Rejected for lack of tokens, with that wait.
fn rejected(retry_after_ms: u64) -> DecisionResult {
    DecisionResult {
        allowed: false,
        remaining: 0,
        retry_after_ms,
        reset_ms: 10_000,
        reason: Reason::Insufficient,
        ..admitted(0)
    }
}

fn answer(results: Vec<DecisionResult>) -> Result<RequestAnswer, LimiterError> {
    Ok(RequestAnswer {
        allowed: results.iter().all(|r| r.allowed),
        results,
        error: None,
        slot: None,
    })
}

// The request-headers step.

#[test]
fn a_request_no_rule_matches_passes_untouched_and_uncounted() {
    let mut g = Gateway::new(config(|_| {}));
    assert!(matches!(
        g.start(&request("/health", Some("alpha-key")), T0),
        Start::Pass
    ));
    assert_eq!(g.counted(), []);
}

#[test]
fn an_api_key_sent_twice_is_answered_400_before_any_limit() {
    let mut g = Gateway::new(config(|_| {}));
    let mut r = alpha();
    r.properties.insert(
        "request.headers.x-api-key".into(),
        b"junk,alpha-key".to_vec(),
    );
    let reply = reply(g.start(&r, T0));
    assert_eq!(
        (reply.status, reply.details.as_str()),
        (400, "ratelimit_repeated_identity")
    );
    assert_eq!(g.counted(), [(Stat::RepeatedIdentity, 1)]);
}

#[test]
fn a_rule_that_rejects_clients_it_cannot_name_answers_with_its_status() {
    let mut g = Gateway::new(config(|v| {
        v["rules"][0]["on_unknown"] = json!("reject");
    }));
    let reply = reply(g.start(&request("/api/orders", None), T0));
    assert_eq!(
        (reply.status, reply.details.as_str()),
        (401, "ratelimit_unknown_subject:per-app")
    );
    assert_eq!(
        g.counted(),
        [(Stat::SubjectUnknown, 1), (Stat::UnknownRejected, 1)]
    );
}

#[test]
fn a_quiet_bucket_asks_the_sidecar_without_a_lease_and_an_admission_writes_nothing() {
    let mut g = Gateway::new(config(|_| {}));
    let mut w = waits(g.start(&alpha(), T0));
    assert_eq!(w.deadline_ns(), T0 + 50 * MS);
    assert_eq!(
        w.decisions(&g.config),
        [Decision {
            rule: "per-app".into(),
            subject: WireSubject(vec![("app".into(), Some("alpha".into()))]),
            cost: 1,
            lease: None,
            receipt: false,
        }]
    );
    let v = g.resolve(&mut w, answer(vec![admitted(0)]), T0, T0 + MS);
    g.flow().delivered(&v);
    assert_eq!(admitted_with(v), []);
    assert_eq!(
        g.counted(),
        [(Stat::Admitted, 1), (Stat::RuleAdmitted(0), 1)]
    );
    assert_eq!(
        g.store.writes.get(),
        0,
        "no entry for a bucket it knows nothing of"
    );
}

#[test]
fn a_known_rejection_is_answered_429_locally_until_the_next_request_must_ask_again() {
    let mut g = Gateway::new(config(|_| {}));
    let mut w = waits(g.start(&alpha(), T0));
    let v = g.resolve(&mut w, answer(vec![rejected(1_500)]), T0, T0 + MS);
    g.flow().delivered(&v);
    let r = rejection(v);
    assert_eq!((r.status, header(&r, "retry-after")), (429, Some("2")));
    // Known for the wait, counted from the dispatch; answered locally for at most
    // `max_rejection_ms` (1 s): then the next request asks again.
    let v = decided(g.start(&alpha(), T0 + 600 * MS));
    g.flow().delivered(&v);
    let r = rejection(v);
    assert_eq!(
        (r.status, header(&r, "retry-after"), r.details.as_str()),
        (429, Some("1"), "ratelimit_rejected:per-app")
    );
    assert_eq!(
        g.counted(),
        [
            (Stat::Rejected, 2),
            (Stat::KnownRejections, 1),
            (Stat::RuleRejected(0), 2)
        ]
    );
    waits(g.start(&alpha(), T0 + S));
}

/// A gateway whose bucket holds a lease of 7 tokens (asked at `T0` for 1 s, granted at once, so
/// no round trip to renew early for), its first request admitted by the sidecar.
fn leased() -> Gateway {
    let mut g = Gateway::new(config(busy));
    let mut w = waits(g.start(&alpha(), T0));
    // 5 a second over a 1 s lease, with headroom: ceil(5 × 1.25) = 7.
    let ask = w.decisions(&g.config)[0].lease.expect("a lease ask");
    assert_eq!((ask.tokens, ask.ttl_ms), (7, 1000));
    admitted_with(g.resolve(&mut w, answer(vec![admitted(7)]), T0, T0));
    assert_eq!(g.entry().unwrap().lease.tokens, 7);
    g
}

#[test]
fn a_busy_bucket_asks_for_a_lease_and_its_next_requests_are_admitted_from_it() {
    let mut g = leased();
    for i in 1..=5 {
        let v = decided(g.start(&alpha(), T0 + i * MS));
        g.flow().delivered(&v);
        admitted_with(v);
    }
    assert_eq!(g.entry().unwrap().lease.tokens, 2);
    assert_eq!(
        g.counted(),
        [
            (Stat::Admitted, 5),
            (Stat::LeaseAdmitted, 5),
            (Stat::RuleAdmitted(0), 6)
        ]
    );
}

#[test]
fn a_wall_clock_step_back_keeps_no_lease_or_known_rejection_past_its_end() {
    use crate::clock::{fake::Host, Clock};
    // The host adapter's clock: Envoy's monotonic clock (5 s since its origin), wall clock T0.
    let host = Host::at(5 * S, T0);
    let clock = Clock::default();
    let now = || clock.now_ns(&host);
    let mut g = Gateway::new(config(busy));
    let t = now();
    let mut w = waits(g.start(&alpha(), t));
    admitted_with(g.resolve(&mut w, answer(vec![admitted(7)]), t, t));
    host.advance(500 * MS);
    admitted_with(decided(g.start(&alpha(), now())));
    // The wall clock steps back an hour; 600 ms later the 1 s lease has ended (in Redis too):
    // the next request asks the sidecar, though 6 of its tokens were left.
    host.step_wall_back(3600 * S);
    host.advance(600 * MS);
    let t = now();
    let mut w = waits(g.start(&alpha(), t));
    assert_eq!(g.count(Stat::LeaseAdmitted), 1);
    // A rejection for 1.5 s, then a step back of an hour: after the wait, the sidecar is asked.
    let v = g.resolve(&mut w, answer(vec![rejected(1_500)]), t, t);
    g.flow().delivered(&v);
    host.step_wall_back(3600 * S);
    host.advance(900 * MS);
    decided(g.start(&alpha(), now()));
    host.advance(700 * MS);
    waits(g.start(&alpha(), now()));
}

/// [`leased`], its lease spent down to 2 tokens, and the request that would leave it below a
/// quarter of its grant, which asks for the next lease instead (an early renewal).
fn renewing() -> (Gateway, Waiting) {
    let mut g = leased();
    for i in 1..=5 {
        decided(g.start(&alpha(), T0 + i * MS));
    }
    let w = waits(g.start(&alpha(), T0 + 6 * MS));
    assert!(w.remote[0].renewal && w.remote[0].ask.is_some());
    assert_eq!(g.entry().unwrap().lease.tokens, 2, "nothing taken yet");
    (g, w)
}

#[test]
fn an_early_renewal_the_sidecar_rejects_is_paid_by_the_lease_in_use() {
    let (g, mut w) = renewing();
    let before = g.count(Stat::LeaseAdmitted);
    admitted_with(g.resolve(
        &mut w,
        answer(vec![rejected(100)]),
        T0 + 6 * MS,
        T0 + 7 * MS,
    ));
    assert_eq!(g.entry().unwrap().lease.tokens, 1);
    assert_eq!(g.count(Stat::LeaseAdmitted), before + 1);
    assert_eq!(g.count(Stat::RuleRejected(0)), 0);
}

#[test]
fn an_early_renewal_the_sidecar_cannot_answer_is_paid_by_the_lease_in_use() {
    let (g, mut w) = renewing();
    let before = g.count(Stat::LeaseAdmitted);
    let v = g.resolve(
        &mut w,
        Err(LimiterError::NoAnswer),
        T0 + 6 * MS,
        T0 + 56 * MS,
    );
    admitted_with(v);
    let e = g.entry().unwrap();
    assert_eq!(e.lease.tokens, 1);
    assert_eq!(
        e.renewing_until_ns, 0,
        "the ask is released: the next may ask"
    );
    assert_eq!(g.count(Stat::LeaseAdmitted), before + 1);
    assert_eq!(g.count(Stat::LimiterError), 1);
    assert_eq!(g.count(Stat::FailedClosed), 0, "on_error did not apply");
}

#[test]
fn an_early_renewal_the_lease_can_no_longer_pay_gets_the_sidecars_429_or_its_on_error() {
    for failed in [false, true] {
        let (mut g, mut w) = renewing();
        // While the ask is out, other requests spend the lease in use.
        for i in 0..2 {
            admitted_with(decided(g.start(&alpha(), T0 + (7 + i) * MS)));
        }
        assert_eq!(g.entry().unwrap().lease.tokens, 0);
        let (answer, status) = if failed {
            (Err(LimiterError::NoAnswer), 503)
        } else {
            (answer(vec![rejected(100)]), 429)
        };
        let r = rejection(g.resolve(&mut w, answer, T0 + 6 * MS, T0 + 10 * MS));
        assert_eq!(r.status, status);
        assert_eq!(g.count(Stat::RuleRejected(0)), u64::from(!failed));
        assert_eq!(g.count(Stat::FailedClosed), u64::from(failed));
    }
}

#[test]
fn per_rule_stats_count_each_rules_result_and_shadow_rejections() {
    let mut g = Gateway::new(config(per_ip));
    let shadow = DecisionResult {
        shadow: true,
        reason: Reason::Insufficient,
        ..admitted(0)
    };
    let mut w = waits(g.start(&alpha(), T0));
    admitted_with(g.resolve(&mut w, answer(vec![admitted(0), shadow]), T0, T0));
    assert_eq!(
        g.counted(),
        [
            (Stat::RuleAdmitted(0), 1),
            (Stat::RuleAdmitted(1), 1),
            (Stat::RuleShadowRejected(1), 1)
        ]
    );
    // A request its first rule rejects: its second rule's result (not charged) counts nothing.
    let uncharged = DecisionResult {
        allowed: true,
        ..admitted(0)
    };
    let mut w = waits(g.start(&alpha(), T0 + MS));
    let v = g.resolve(&mut w, answer(vec![rejected(100), uncharged]), T0, T0);
    assert_eq!(rejection(v).details, "ratelimit_rejected:per-app");
    assert_eq!(
        g.counted(),
        [
            (Stat::RuleAdmitted(0), 1),
            (Stat::RuleAdmitted(1), 1),
            (Stat::RuleRejected(0), 1),
            (Stat::RuleShadowRejected(1), 1)
        ]
    );
}

#[test]
fn a_request_rejected_by_one_rule_gives_the_others_lease_take_back() {
    let mut g = Gateway::new(config(|v| {
        busy(v);
        per_ip(v);
    }));
    let mut w = waits(g.start(&alpha(), T0));
    // per-app gets a lease of 5, per-ip none.
    admitted_with(g.resolve(&mut w, answer(vec![admitted(5), admitted(0)]), T0, T0));
    let mut w = waits(g.start(&alpha(), T0 + MS));
    assert_eq!(
        g.entry().unwrap().lease.tokens,
        4,
        "per-app paid by its lease"
    );
    assert_eq!(w.remote_decisions(), 1, "per-ip asks the sidecar");
    let v = g.resolve(&mut w, answer(vec![rejected(100)]), T0 + MS, T0 + 2 * MS);
    assert_eq!(rejection(v).details, "ratelimit_rejected:per-ip");
    assert_eq!(g.entry().unwrap().lease.tokens, 5, "given back");
    g.flow().give_back(&mut w, T0 + 2 * MS);
    assert_eq!(g.entry().unwrap().lease.tokens, 5, "only once");
    assert_eq!(g.count(Stat::RuleRejected(1)), 1);
}

// The failure policies.

#[test]
fn without_an_answer_deny_answers_503_and_allow_admits() {
    let g_deny = Gateway::new(config(|_| {}));
    let g_allow = Gateway::new(config(|v| v["rules"][0]["on_error"] = json!("allow")));
    for (mut g, status) in [(g_deny, Some(503)), (g_allow, None)] {
        let mut w = waits(g.start(&alpha(), T0));
        let v = g.resolve(&mut w, Err(LimiterError::NoAnswer), T0, T0 + 50 * MS);
        g.flow().delivered(&v);
        match status {
            Some(503) => {
                let r = rejection(v);
                assert_eq!(
                    (r.status, r.details.as_str()),
                    (503, "ratelimit_unavailable")
                );
                assert_eq!(
                    g.counted(),
                    [(Stat::LimiterError, 1), (Stat::FailedClosed, 1)],
                    "a 503 is not counted rejected"
                );
            }
            _ => {
                admitted_with(v);
                assert_eq!(
                    g.counted(),
                    [
                        (Stat::Admitted, 1),
                        (Stat::LimiterError, 1),
                        (Stat::FailedOpen, 1)
                    ]
                );
            }
        }
    }
}

#[test]
fn without_an_answer_local_takes_the_emergency_bucket_until_it_is_empty() {
    let mut g = Gateway::new(config(|v| {
        v["rules"][0]["on_error"] = json!("local");
        v["rules"][0]["emergency"] = json!({"capacity": 2, "refill_per_sec": 1});
    }));
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let mut w = waits(g.start(&alpha(), T0));
        let v = g.resolve(&mut w, Err(LimiterError::NoAnswer), T0, T0);
        statuses.push(match v {
            Verdict::Admit { .. } => 200,
            Verdict::Reject(r) => r.status,
        });
    }
    assert_eq!(statuses, [200, 200, 429]);
    assert_eq!(
        g.counted(),
        [
            (Stat::LimiterError, 3),
            (Stat::EmergencyActivations, 3),
            (Stat::EmergencyRejected, 1)
        ]
    );
}

#[test]
fn a_rule_the_sidecar_does_not_know_is_a_configuration_error_with_the_rules_on_error() {
    let mut g = Gateway::new(config(|_| {}));
    let mut w = waits(g.start(&alpha(), T0));
    let unknown = Ok(RequestAnswer {
        allowed: false,
        results: Vec::new(),
        error: Some(RequestError {
            code: ErrorCode::UnknownRule,
            message: "no rule per-app in domain test".into(),
        }),
        slot: None,
    });
    assert_eq!(rejection(g.resolve(&mut w, unknown, T0, T0)).status, 503);
    assert_eq!(
        g.counted(),
        [(Stat::ConfigError, 1), (Stat::FailedClosed, 1)]
    );
}

/// Not decided: the sidecar's policy has no such rule (that decision's error alone).
fn undecided(rule: &str) -> DecisionResult {
    DecisionResult {
        allowed: true,
        remaining: 0,
        retry_after_ms: 0,
        reset_ms: 0,
        reason: Reason::Ok,
        limit: None,
        shadow: false,
        leased: 0,
        receipt: None,
        error: Some(RequestError {
            code: ErrorCode::UnknownRule,
            message: format!("unknown rule {rule:?} in domain \"test\""),
        }),
    }
}

#[test]
fn a_rule_the_sidecar_does_not_know_fails_that_decision_alone_with_its_on_error() {
    // per-app (deny) decided by the sidecar; per-ip unknown there, under each on_error.
    let with = |on_error: &'static str| {
        Gateway::new(config(move |v| {
            per_ip(v);
            v["rules"][1]["on_error"] = json!(on_error);
            if on_error == "local" {
                v["rules"][1]["emergency"] = json!({"capacity": 1, "refill_per_sec": 1});
            }
        }))
    };
    let unknown_ip = || answer(vec![admitted(0), undecided("per-ip")]);

    // allow: the other rule's verdict.
    let mut g = with("allow");
    let mut w = waits(g.start(&alpha(), T0));
    assert_eq!(w.remote_decisions(), 2);
    admitted_with(g.resolve(&mut w, unknown_ip(), T0, T0));
    assert_eq!(
        (g.count(Stat::ConfigError), g.count(Stat::FailedOpen)),
        (1, 1)
    );
    assert_eq!(g.count(Stat::RuleAdmitted(0)), 1);

    // deny: 503 (per-app's charge is spent: under-admission only).
    let mut g = with("deny");
    let mut w = waits(g.start(&alpha(), T0));
    assert_eq!(
        rejection(g.resolve(&mut w, unknown_ip(), T0, T0)).status,
        503
    );
    assert_eq!(
        (g.count(Stat::ConfigError), g.count(Stat::FailedClosed)),
        (1, 1)
    );

    // local: per-ip's emergency bucket (1 token) for that decision alone.
    let mut g = with("local");
    let mut statuses = Vec::new();
    for i in 0..2 {
        let mut w = waits(g.start(&alpha(), T0 + i * MS));
        statuses.push(match g.resolve(&mut w, unknown_ip(), T0, T0 + i * MS) {
            Verdict::Admit { .. } => 200,
            Verdict::Reject(r) => r.status,
        });
    }
    assert_eq!(statuses, [200, 429]);
    assert_eq!(
        (
            g.count(Stat::EmergencyActivations),
            g.count(Stat::EmergencyRejected)
        ),
        (2, 1)
    );

    // The decided rule rejects: 429 by it, whatever the unknown rule's policy.
    let mut g = with("deny");
    let mut w = waits(g.start(&alpha(), T0));
    let r = rejection(g.resolve(
        &mut w,
        answer(vec![rejected(2_000), undecided("per-ip")]),
        T0,
        T0,
    ));
    assert_eq!((r.status, header(&r, "retry-after")), (429, Some("2")));
    assert_eq!(g.count(Stat::ConfigError), 1);
    assert_eq!(g.count(Stat::FailedClosed), 0);

    // The other way round: per-app (deny) unknown, per-ip decided: 503.
    let mut g = with("allow");
    let mut w = waits(g.start(&alpha(), T0));
    let both = answer(vec![undecided("per-app"), admitted(0)]);
    assert_eq!(rejection(g.resolve(&mut w, both, T0, T0)).status, 503);
}

#[test]
fn a_lease_ask_without_an_answer_is_released() {
    let mut g = Gateway::new(config(busy));
    let mut w = waits(g.start(&alpha(), T0));
    assert!(
        g.entry().unwrap().renewing_until_ns > T0,
        "one ask in flight"
    );
    g.resolve(&mut w, Err(LimiterError::NoAnswer), T0, T0 + 50 * MS);
    assert_eq!(g.entry().unwrap().renewing_until_ns, 0);
    let w = waits(g.start(&alpha(), T0 + 60 * MS));
    assert!(w.remote[0].ask.is_some(), "the next request asks again");
}

// Costs settled from the response (docs/costs.md).

/// `per-app`'s cost reserved from the request's `x-max-tokens` (4096 without it, 8192 at most)
/// and settled from the response's `x-usage-tokens`; leases for every busy bucket.
fn metered(v: &mut Value) {
    busy(v);
    v["rules"][0]["cost"] = json!({"reserve": 4096, "reserve_from_request_header": "x-max-tokens",
        "reserve_max": 8192, "response_header": "x-usage-tokens"});
}

#[test]
fn an_admitted_request_reserves_what_it_names_and_settles_the_difference() {
    let mut g = Gateway::new(config(metered));
    let mut r = alpha();
    r.headers.insert("x-max-tokens".into(), b"300".to_vec());
    let mut w = waits(g.start(&r, T0));
    let call = w.decisions(&g.config);
    assert_eq!(call[0].cost, 300, "the reservation");
    assert_eq!(call[0].lease, None, "a settled cost never asks for a lease");
    assert!(
        call[0].receipt,
        "a reservation asks for a receipt of its charge"
    );
    let with_receipt = DecisionResult {
        receipt: Some("77".into()),
        ..admitted(0)
    };
    admitted_with(g.resolve(&mut w, answer(vec![with_receipt]), T0, T0 + MS));
    let mut m = g.flow().metered(&w);
    assert_eq!((m.len(), m[0].reserved), (1, 300));
    m[0].meter.headers(Some(b"120"), None, None);
    let mut budget = costs::Budget::default();
    let s = g.flow().settled(m.remove(0), false, &mut budget).unwrap();
    assert_eq!((s.rule.as_str(), s.reserved, s.cost), ("per-app", 300, 120));
    assert_eq!(
        s.receipt.as_deref(),
        Some("77"),
        "settled against its receipt"
    );
    assert_eq!(g.count(Stat::CostsSettled), 1);

    // Without the header: the fallback, bounded when named.
    let w = waits(g.start(&alpha(), T0 + S));
    assert_eq!(w.decisions(&g.config)[0].cost, 4096);
    r.headers.insert("x-max-tokens".into(), b"100000".to_vec());
    let w = waits(g.start(&r, T0 + 2 * S));
    assert_eq!(w.decisions(&g.config)[0].cost, 8192);
}

#[test]
fn only_a_charged_decision_settles() {
    let mut g = Gateway::new(config(metered));
    let mut w = waits(g.start(&alpha(), T0));
    rejection(g.resolve(&mut w, answer(vec![rejected(1_000)]), T0, T0 + MS));
    assert!(g.flow().metered(&w).is_empty(), "rejected: nothing charged");
    let mut g = Gateway::new(config(|v| {
        metered(v);
        v["rules"][0]["on_error"] = "allow".into();
    }));
    let mut w = waits(g.start(&alpha(), T0));
    admitted_with(g.resolve(&mut w, Err(LimiterError::NoAnswer), T0, T0 + 50 * MS));
    assert!(
        g.flow().metered(&w).is_empty(),
        "failed open: nothing charged, nothing to give back"
    );
    let mut w = waits(g.start(&alpha(), T0 + S));
    let shadow = DecisionResult {
        shadow: true,
        allowed: true,
        reason: Reason::Insufficient,
        ..admitted(0)
    };
    admitted_with(g.resolve(&mut w, answer(vec![shadow]), T0 + S, T0 + S + MS));
    assert!(
        g.flow().metered(&w).is_empty(),
        "a shadow rejection charged nothing"
    );
}

#[test]
fn a_response_without_its_cost_settles_at_the_operators_figure_never_the_clients() {
    // Issue 32, case 2: the client names a reservation of 1; a response whose cost cannot be
    // read settles at the rule's `unreported_cost`, by default its `reserve_max` (8192).
    let mut g = Gateway::new(config(metered));
    let mut r = alpha();
    r.headers.insert("x-max-tokens".into(), b"1".to_vec());
    let mut w = waits(g.start(&r, T0));
    admitted_with(g.resolve(&mut w, answer(vec![admitted(0)]), T0, T0 + MS));
    let mut budget = costs::Budget::default();
    let mut m = g.flow().metered(&w);
    m[0].meter.headers(None, None, None);
    let s = g.flow().settled(m.remove(0), true, &mut budget).unwrap();
    assert_eq!((s.reserved, s.cost), (1, 8192), "not reported");
    assert_eq!(g.count(Stat::CostsUnreported), 1);
    let mut m = g.flow().metered(&w);
    m[0].meter.headers(Some(b"1"), None, None);
    assert_eq!(
        g.flow().settled(m.remove(0), true, &mut budget),
        None,
        "the cost reserved"
    );
    // An operator's own figure.
    let mut g = Gateway::new(config(|v| {
        metered(v);
        v["rules"][0]["cost"]["unreported_cost"] = json!(500);
    }));
    let mut w = waits(g.start(&r, T0));
    admitted_with(g.resolve(&mut w, answer(vec![admitted(0)]), T0, T0 + MS));
    let mut m = g.flow().metered(&w);
    m[0].meter.headers(None, None, None);
    let s = g.flow().settled(m.remove(0), false, &mut budget).unwrap();
    assert_eq!(s.cost, 500, "cut short: unreported");
}

#[test]
fn a_response_whose_cost_is_in_its_body_is_asked_for_uncompressed() {
    let g = Gateway::new(config(|v| {
        v["rules"][0]["cost"] = json!({"reserve": 100, "response_json": "usage.total_tokens"});
    }));
    assert!(g.flow().reads_response_body(&alpha()));
    assert!(!g.flow().reads_response_body(&request("/health", None)));
    let by_header = Gateway::new(config(metered));
    assert!(!by_header.flow().reads_response_body(&alpha()));
}

#[test]
fn a_rule_reserving_from_the_request_json_waits_for_the_body() {
    let g = Gateway::new(config(|v| {
        v["rules"][0]["cost"] = json!({"reserve_from_request_json": "max_tokens",
            "reserve": 4096, "response_json": "usage.total_tokens"});
    }));
    assert!(g.flow().wants_request_body(&alpha()));
    assert!(!g.flow().wants_request_body(&request("/health", None)));
    let mut g = g;
    let start = Flow {
        config: &g.config,
        reads: &g.reads,
        store: &g.store,
        stats: &g.counts,
    }
    .start_with_body(&alpha(), Some(br#"{"max_tokens": 777}"#), T0, &mut g.worker);
    assert_eq!(waits(start).decisions(&g.config)[0].cost, 777);
    assert!(!Gateway::new(config(|_| {}))
        .flow()
        .wants_request_body(&alpha()));
}

#[test]
fn a_worker_ticks_for_its_calls_deadlines_with_coalescing_or_without() {
    // A call on the stream has no timeout of the host's: the tick gives it up at its deadline.
    for coalesce in [true, false] {
        for (timeout_ms, tick_ms) in [(50, 25), (400, 50), (1, 1)] {
            let g = Gateway::new(config(|v| {
                v["sidecar"]["timeout_ms"] = json!(timeout_ms);
                v["fast_paths"] = json!({"coalesce": coalesce, "policy_poll_ms": 0});
            }));
            assert_eq!(g.flow().tick_period_ms(), Some(tick_ms), "{timeout_ms} ms");
        }
    }
}

// The batcher.

/// A waiting request of `decisions` decisions (all of rule 0) and `returns` lease returns.
fn waiting(decisions: usize, returns: usize, deadline_ns: u64) -> Waiting {
    Waiting {
        planned: vec![Planned {
            rule: 0,
            subject: WireSubject::new(),
            cost: 1,
            id: "test/per-app|app~".into(),
        }],
        remote: (0..decisions)
            .map(|_| RemoteDecision {
                planned: 0,
                no_entry: true,
                ask: None,
                renewal: false,
            })
            .collect(),
        taken: Vec::new(),
        charged: Vec::new(),
        returns: (0..returns)
            .map(|i| LeaseReturn {
                rule: "per-app".into(),
                subject: WireSubject::new(),
                id: i as u64 + 1,
                tokens: 1,
            })
            .collect(),
        deadline_ns,
        epoch: 0,
        answered_epoch: 0,
    }
}

fn batching(max_batch: usize, max_in_flight: usize) -> Config {
    config(|v| {
        v["fast_paths"] = json!({"max_batch": max_batch, "max_in_flight": max_in_flight});
    })
}

fn call(body: &[u8]) -> DecideRequest {
    serde_json::from_slice(body).unwrap()
}

/// The requests the next call carries.
fn next(q: &mut Queue, c: &Config, now_ns: u64) -> Option<Vec<u32>> {
    let b = q.next_batch(c, now_ns)?;
    assert_eq!(call(&b.body).requests.len(), b.requests.len());
    Some(b.requests)
}

#[test]
fn a_callout_carries_at_most_max_batch_requests_with_one_in_flight() {
    let c = batching(2, 1);
    let mut q = Queue::default();
    let wakes: Vec<bool> = (1..=5)
        .map(|ctx| q.enqueue(ctx, waiting(1, 0, T0 + 50 * MS), 1))
        .collect();
    assert_eq!(
        wakes,
        [true, false, false, false, false],
        "one wake-up on its way"
    );
    q.woken();
    let b = q.next_batch(&c, T0).unwrap();
    assert_eq!((b.requests.as_slice(), b.timeout_ms), (&[1, 2][..], 50));
    q.dispatched(7, b, T0);
    assert!(q.next_batch(&c, T0).is_none(), "one call in flight");
    assert_eq!(q.landed(7).unwrap().requests, [1, 2]);
    assert_eq!(next(&mut q, &c, T0), Some(vec![3, 4]));
    assert_eq!(next(&mut q, &c, T0), Some(vec![5]));
    assert_eq!(next(&mut q, &c, T0), None);
}

#[test]
fn a_call_on_the_stream_is_given_up_at_its_earliest_deadline_or_when_the_stream_closes() {
    let c = batching(2, 4);
    let mut q = Queue::default();
    q.enqueue(1, waiting(1, 0, T0 + 30 * MS), 4);
    q.enqueue(2, waiting(1, 0, T0 + 50 * MS), 4);
    q.enqueue(3, waiting(1, 0, T0 + 50 * MS), 4);
    q.woken();
    let first = q.next_batch(&c, T0).unwrap();
    q.dispatched(1, first, T0);
    let second = q.next_batch(&c, T0).unwrap();
    q.dispatched(2, second, T0);
    assert!(q.overdue_flights(T0 + 30 * MS - 1).is_empty());
    let overdue = q.overdue_flights(T0 + 30 * MS);
    assert_eq!(overdue.len(), 1);
    assert_eq!(overdue[0].requests, [1, 2], "the batch's earliest deadline");
    assert!(
        q.landed(1).is_none(),
        "an answer that comes later finds nothing"
    );
    let closed = q.all_flights();
    assert_eq!(closed.len(), 1);
    assert_eq!(closed[0].requests, [3]);
    assert!(q.landed(2).is_none());
}

#[test]
fn a_callout_stays_within_the_wires_bounds_on_decisions_and_returns() {
    let c = batching(256, 64);
    let mut q = Queue::default();
    // 64 decisions a request: 16 of them make MAX_CALL_DECISIONS.
    for ctx in 0..20 {
        q.enqueue(ctx, waiting(64, 0, T0 + S), 64);
    }
    assert_eq!(next(&mut q, &c, T0).unwrap().len(), MAX_CALL_DECISIONS / 64);
    assert_eq!(next(&mut q, &c, T0).unwrap().len(), 4);
    // 100 returns a request: a third would pass MAX_RETURNS (256).
    for ctx in 20..23 {
        q.enqueue(ctx, waiting(1, 100, T0 + S), 64);
    }
    assert_eq!(next(&mut q, &c, T0).unwrap(), [20, 21]);
    assert_eq!(next(&mut q, &c, T0).unwrap(), [22]);
    // A request alone always goes.
    q.enqueue(23, waiting(1, MAX_RETURNS + 1, T0 + S), 64);
    assert_eq!(next(&mut q, &c, T0).unwrap(), [23]);
}

#[test]
fn a_callout_stays_within_the_wires_byte_budget_with_the_longest_subjects() {
    // Issue 32, case 3: requests whose subjects are the longest identities (1,024 bytes, each
    // escaped to 2): each body fits what the sidecar accepts, and every request goes.
    let c = batching(256, 64);
    let mut q = Queue::default();
    for ctx in 0..200 {
        let mut w = waiting(2, 0, T0 + S);
        let mut subject = WireSubject::new();
        subject.push("user", Some(format!("{ctx:04}{}", "\"".repeat(1020))));
        w.planned[0].subject = subject;
        q.enqueue(ctx, w, 64);
    }
    let mut sent = 0;
    while let Some(b) = q.next_batch(&c, T0) {
        assert!(
            b.body.len() <= ratelimit_wire::budget::MAX_BODY_BYTES,
            "{} bytes",
            b.body.len()
        );
        sent += b.requests.len();
        let token = sent as u32;
        q.dispatched(token, b, T0);
        q.landed(token);
    }
    assert_eq!(sent, 200);
}

#[test]
fn requests_past_their_deadline_leave_the_queue_and_a_callouts_timeout_is_the_earliest() {
    let c = batching(64, 1);
    let mut q = Queue::default();
    q.enqueue(1, waiting(1, 0, T0 + 10 * MS), 1);
    q.enqueue(2, waiting(1, 0, T0 + 50 * MS), 1);
    q.enqueue(3, waiting(1, 0, T0 + 40 * MS), 1);
    q.enqueue(4, waiting(1, 0, T0 + 50 * MS), 1);
    assert!(q.forget(4).is_some(), "its client went away");
    assert_eq!(q.expired(T0 + 10 * MS - 1), [4]);
    assert_eq!(q.expired(T0 + 10 * MS), [1]);
    assert!(q.take(1).is_some(), "settled by its failure policy");
    let b = q.next_batch(&c, T0 + 20 * MS).unwrap();
    assert_eq!(b.requests, [2, 3]);
    assert_eq!(b.timeout_ms, 20, "the earliest deadline, 40 ms, from now");
}

#[test]
fn without_coalescing_each_request_is_a_call_of_its_own_sent_at_once() {
    let mut c = batching(64, 1);
    c.fast_paths.coalesce = false;
    assert_eq!(limits(&c), (1, usize::MAX));
    let mut q = Queue::default();
    let (_, max_in_flight) = limits(&c);
    assert!(q.enqueue(1, waiting(2, 1, T0 + 50 * MS), max_in_flight));
    q.enqueue(2, waiting(1, 0, T0 + 50 * MS), max_in_flight);
    q.woken();
    let first = q.next_batch(&c, T0).unwrap();
    let call = call(&first.body);
    assert_eq!(
        (
            first.requests.as_slice(),
            call.requests[0].decisions.len(),
            call.returns.len()
        ),
        (&[1][..], 2, 1)
    );
    q.dispatched(1, first, T0);
    // Not held behind the call in flight, as a coalesced request would be.
    assert_eq!(next(&mut q, &c, T0), Some(vec![2]));
    assert!(q.enqueue(3, waiting(1, 0, T0 + 50 * MS), max_in_flight));
}

#[test]
fn a_configuration_error_warns_at_once_then_once_a_minute_with_the_count_since() {
    let mut w = WarnEvery {
        last_ns: None,
        since: 0,
    };
    assert_eq!(w.met(5), Some(1), "the first one warns");
    for i in 1..150 {
        assert_eq!(w.met(5 + i * 1_000_000), None);
    }
    let later = 5 + CONFIG_ERROR_WARN_INTERVAL_NS;
    assert_eq!(w.met(later), Some(150), "149 quiet ones and this one");
    assert_eq!(w.met(later + 1), None);
}

// A worker's streams between callbacks (`streams.rs`).

#[test]
fn a_request_waiting_for_its_body_is_decided_without_it_at_its_deadline() {
    let mut s = streams::Streams::new(7);
    s.await_body(1, T0 + 50 * MS);
    s.await_body(2, T0 + 80 * MS);
    assert_eq!(s.late_bodies(T0 + 49 * MS), Vec::<u32>::new());
    assert_eq!(s.late_bodies(T0 + 60 * MS), [1]);
    assert!(!s.awaits_body(1) && s.awaits_body(2));
    s.body_came(2);
    assert!(!s.awaits_body(2));
    assert_eq!(s.late_bodies(T0 + S), Vec::<u32>::new(), "decided once");
}

/// Request 9 admitted with a receipt under `metered`, its streams holding its meters and a
/// header to add.
fn admitted_metered(g: &mut Gateway) -> streams::Streams {
    let mut r = alpha();
    r.headers.insert("x-max-tokens".into(), b"300".to_vec());
    let mut w = waits(g.start(&r, T0));
    let with_receipt = DecisionResult {
        receipt: Some("77".into()),
        ..admitted(0)
    };
    admitted_with(g.resolve(&mut w, answer(vec![with_receipt]), T0, T0 + MS));
    let mut s = streams::Streams::new(7);
    s.admitted(
        9,
        vec![("x-ratelimit".into(), "1".into())],
        g.flow().metered(&w),
    );
    s
}

#[test]
fn response_headers_are_added_once_and_a_cost_header_settles_at_once() {
    let mut g = Gateway::new(config(metered));
    let mut s = admitted_metered(&mut g);
    assert!(s.reads_response_body(9), "metered until its cost is read");
    let read = |name: &str| (name == "x-usage-tokens").then(|| b"120".to_vec());
    let headers = s.response_headers(&g.flow(), 9, false, &read);
    assert_eq!(headers, [("x-ratelimit".to_string(), "1".to_string())]);
    assert_eq!(s.outbox.pending(), 1, "120 against a reservation of 300");
    assert!(!s.reads_response_body(9), "done with at the headers");
    assert!(
        s.response_headers(&g.flow(), 9, false, &read).is_empty(),
        "once"
    );
    s.ended(&g.flow(), 9);
    assert_eq!(s.outbox.pending(), 1, "nothing settles twice");
}

#[test]
fn a_stream_that_ends_before_its_cost_is_read_settles_at_the_unreported_cost() {
    let mut g = Gateway::new(config(metered));
    let mut s = admitted_metered(&mut g);
    s.ended(&g.flow(), 9);
    assert_eq!(
        s.outbox.pending(),
        1,
        "the reservation does not stand as the cost"
    );
    assert!(!s.reads_response_body(9));
    let read = |_: &str| None;
    assert!(
        s.response_headers(&g.flow(), 9, false, &read).is_empty(),
        "an ended stream's headers are gone"
    );
}

#[test]
fn a_stream_that_ends_gives_its_slots_back_at_the_next_call() {
    let g = Gateway::new(config(|_| {}));
    let mut s = streams::Streams::new(7);
    let decisions = vec![Decision {
        rule: "per-app".into(),
        subject: WireSubject::new(),
        cost: 1,
        lease: None,
        receipt: false,
    }];
    let held = ratelimit_wire::HeldSlot {
        id: "s1".into(),
        ttl_ms: 3000,
        decisions: vec![0],
    };
    s.slots.hold(9, &held, &decisions, T0);
    assert!(s.slots.holds(9));
    assert_eq!(s.slots.next_call("test", T0 + MS), None, "nothing due yet");
    s.ended(&g.flow(), 9);
    assert!(!s.slots.holds(9));
    let call = s
        .slots
        .next_call("test", T0 + 2 * MS)
        .expect("the release is due");
    assert!(
        String::from_utf8_lossy(&call).contains("\"s1\""),
        "it names the slot"
    );
}

#[test]
fn every_counter_has_one_name_and_its_index_finds_it() {
    let c = config(per_ip);
    let names = Stat::names(&c);
    let unique: std::collections::BTreeSet<&String> = names.iter().collect();
    assert_eq!(unique.len(), names.len(), "{names:?}");
    assert_eq!(names.len(), Stat::GLOBAL.len() + 3 * 2);
    for (stat, name) in Stat::GLOBAL {
        assert_eq!(names[stat.index(2).unwrap()], name);
    }
    let name_of = |s: Stat| s.index(2).map(|i| names[i].as_str());
    assert_eq!(
        name_of(Stat::RuleAdmitted(0)),
        Some("rule.per-app.admitted")
    );
    assert_eq!(name_of(Stat::RuleRejected(1)), Some("rule.per-ip.rejected"));
    assert_eq!(
        name_of(Stat::RuleShadowRejected(1)),
        Some("rule.per-ip.shadow_rejected")
    );
    assert_eq!(
        Stat::RuleAdmitted(2).index(2),
        None,
        "a rule it does not have"
    );
}

mod worker;
