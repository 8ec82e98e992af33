//! The [`Verdict`] on a request: from the sidecar's answer (the limit each result names gives the
//! headers), from what the gateway knows locally (a known rejection, a lease), or — when the
//! sidecar cannot decide — from the rules' failure policies and their emergency buckets. Also
//! what a rejection looks like on the wire (status, headers, JSON body, and Envoy's response code
//! details: `ratelimit_rejected:<rule>`, `ratelimit_unavailable`, `ratelimit_unknown_subject:<rule>`,
//! `ratelimit_repeated_identity`).
//!
//! Headers: `RateLimit-Policy`, `RateLimit` and `Retry-After`, rendered by
//! [`ratelimit_wire::headers`] (one definition, shared with the sidecar's gRPC answers; it
//! documents the fields). `Retry-After` is absent when the cost exceeds the bucket's capacity:
//! waiting cannot help.

use ratelimit_wire::headers::{self as fields, limiting, HeaderLimit, Limiting};
use ratelimit_wire::headers::{ceil_s, retry_after_s};
use ratelimit_wire::{elide_middle, DecideResponse, ErrorCode, Reason, RequestAnswer};

use crate::config::{window_s, Config, Emergency, FailurePolicy, RateLimitHeaders};
use crate::emergency::{self, Contention, EmergencyBucket, EmergencyCharge, Take};
use crate::fastpath::{KnownLimit, RejectionCause};
use crate::rules::Planned;

/// The most bytes of a sidecar answer that are read.
pub const MAX_ANSWER_BYTES: usize = 1 << 20;

/// The most bytes of the sidecar's own text (a parse error quoting its answer, a request error's
/// message) a [`LimiterError`] keeps: it is logged, per request, and a broken sidecar (or whoever
/// answers in its place) chooses that text.
pub const MAX_ERROR_TEXT_BYTES: usize = 512;

/// A response the filter sends itself instead of forwarding the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: String,
    /// Envoy's response code details (`%RESPONSE_CODE_DETAILS%` in access logs).
    pub details: String,
}

/// What happens to a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Forward it; add `headers` to the upstream's response.
    Admit { headers: Vec<(String, String)> },
    /// Answer it with this reply.
    Reject(LocalReply),
}

/// Why the sidecar's answer cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum LimiterError {
    #[error("no answer (timeout, reset or unreachable cluster)")]
    NoAnswer,
    #[error("dispatch failed: {0}")]
    Dispatch(String),
    #[error("status {0}")]
    Status(String),
    #[error("malformed answer: {0}")]
    Malformed(String),
    #[error("answer has {got} answers for {expected} requests")]
    Count { expected: usize, got: usize },
    #[error("answer has {got} results for {expected} decisions")]
    Results { expected: usize, got: usize },
    #[error("answer says allowed={allowed} but its results disagree")]
    Inconsistent { allowed: bool },
    /// The sidecar answered this request with an error (an unknown rule, Redis unavailable).
    #[error("{code:?}: {message}")]
    Request { code: ErrorCode, message: String },
}

impl LimiterError {
    /// A configuration error (a rule the sidecar's policy lacks), not an outage.
    pub fn is_config_error(&self) -> bool {
        matches!(
            self,
            LimiterError::Request {
                code: ErrorCode::UnknownRule,
                ..
            }
        )
    }
}

/// Checks and parses the sidecar's answer to a call of `expected` requests: `:status` 200 and a
/// [`DecideResponse`] with one answer per request. (Each answer is checked by [`check_answer`].)
/// Anything else is an error that the rules' `on_error` policies handle for every request of the
/// call.
pub fn parse_answer(
    status: Option<&[u8]>,
    body: &[u8],
    expected: usize,
) -> Result<DecideResponse, LimiterError> {
    let status = status.ok_or(LimiterError::NoAnswer)?;
    if status != b"200" {
        return Err(LimiterError::Status(
            String::from_utf8_lossy(&status[..status.len().min(16)]).into_owned(),
        ));
    }
    let answer: DecideResponse = serde_json::from_slice(body)
        .map_err(|e| LimiterError::Malformed(elide_middle(e.to_string(), MAX_ERROR_TEXT_BYTES)))?;
    if answer.answers.len() != expected {
        return Err(LimiterError::Count {
            expected,
            got: answer.answers.len(),
        });
    }
    Ok(answer)
}

pub use ratelimit_wire::names::is_limit_name;

/// Checks one request's answer: an error, or one result per decision whose `allowed` agrees with
/// its results and whose limits have names [`is_limit_name`] accepts.
pub fn check_answer(answer: &RequestAnswer, decisions: usize) -> Result<(), LimiterError> {
    if let Some(e) = &answer.error {
        return Err(LimiterError::Request {
            code: e.code,
            message: elide_middle(e.message.clone(), MAX_ERROR_TEXT_BYTES),
        });
    }
    if answer.results.len() != decisions {
        return Err(LimiterError::Results {
            expected: decisions,
            got: answer.results.len(),
        });
    }
    if answer.allowed != answer.results.iter().all(|r| r.allowed) {
        return Err(LimiterError::Inconsistent {
            allowed: answer.allowed,
        });
    }
    if let Some(i) = answer
        .results
        .iter()
        .position(|r| r.limit.as_ref().is_some_and(|l| !is_limit_name(&l.name)))
    {
        return Err(LimiterError::Malformed(format!(
            "results[{i}].limit.name: not a limit name (1 to {} characters of [A-Za-z0-9_.-])",
            ratelimit_wire::MAX_NAME_BYTES
        )));
    }
    Ok(())
}

/// One decision the gateway admitted from a lease: its rule's limit as last seen, and the tokens
/// the lease still holds (the `r` of its `RateLimit` header; `t` is then the full window).
#[derive(Debug, Clone, PartialEq)]
pub struct LeasedAdmit<'a> {
    pub limit: Option<&'a KnownLimit>,
    pub lease_tokens: u64,
}

/// The verdict from a checked answer (see [`check_answer`]); `answer.results[i]` belongs to the
/// i-th remote decision, whose rule is `rules[i]` (the gateway's rule names the rejection in the
/// body and the response code details; the limit the sidecar applied names `RateLimit-Policy`);
/// `leased` are the request's decisions admitted from leases.
pub fn from_answer(
    config: &Config,
    answer: &RequestAnswer,
    rules: &[&str],
    leased: &[LeasedAdmit<'_>],
) -> Verdict {
    let results = &answer.results;
    let rule_of = |i: usize| rules.get(i).copied().unwrap_or("");
    match limiting(results) {
        Some(Limiting::Never(i)) => {
            let r = &results[i];
            let limit = r.limit.as_ref().map(|l| HeaderLimit::applied(l, 0, 0));
            return Verdict::Reject(never(config, rule_of(i), limit.as_ref(), r.reason));
        }
        Some(Limiting::Wait(i)) => {
            let r = &results[i];
            let wait_s = retry_after_s(r.retry_after_ms);
            let limit = r
                .limit
                .as_ref()
                .map(|l| HeaderLimit::applied(l, r.remaining, wait_s));
            return Verdict::Reject(rate_limited(config, rule_of(i), limit.as_ref(), wait_s));
        }
        None => {}
    }
    let mut limits = fields::admitted_limits(results);
    limits.extend(leased.iter().filter_map(|a| {
        a.limit.map(|l| {
            let w = window_s(l.capacity.max(1), l.refill_per_sec.max(f64::MIN_POSITIVE));
            HeaderLimit {
                name: &l.name,
                quota: l.capacity,
                window_s: w,
                remaining: a.lease_tokens,
                reset_s: w,
            }
        })
    }));
    admit(config, &limits)
}

/// The verdict when every decision was admitted from leases.
pub fn from_leases(config: &Config, leased: &[LeasedAdmit<'_>]) -> Verdict {
    from_answer(
        config,
        &RequestAnswer {
            allowed: true,
            results: Vec::new(),
            error: None,
            slot: None,
        },
        &[],
        leased,
    )
}

/// The 429 for a rejection known locally: the same reply the sidecar's answer would give, with
/// `Retry-After` the time left of the known wait.
pub fn known_rejection(
    config: &Config,
    rule: &str,
    limit: Option<&KnownLimit>,
    cause: RejectionCause,
    left_ns: u64,
) -> LocalReply {
    let wait_s = retry_after_s(left_ns.div_ceil(1_000_000));
    let figures = limit.map(|l| HeaderLimit {
        name: &l.name,
        quota: l.capacity,
        window_s: window_s(l.capacity.max(1), l.refill_per_sec.max(f64::MIN_POSITIVE)),
        remaining: 0,
        reset_s: wait_s,
    });
    match cause {
        RejectionCause::Insufficient => rate_limited(config, rule, figures.as_ref(), wait_s),
        RejectionCause::CostExceedsCapacity => {
            never(config, rule, figures.as_ref(), Reason::CostExceedsCapacity)
        }
        RejectionCause::Blocked => never(config, rule, figures.as_ref(), Reason::Blocked),
    }
}

/// What the failure policies of the applicable rules call for when the sidecar cannot decide.
#[derive(Debug, Clone, PartialEq)]
pub enum FailurePlan<'a> {
    /// Some rule says `deny` (or a `local` rule has no emergency bucket): answer 503.
    Deny,
    /// Take from the emergency buckets of these entries of `planned` (their rules say `local`):
    /// the entry's index and its rule's bucket. The others say `allow`.
    Local(Vec<(usize, &'a Emergency)>),
    /// Every rule says `allow`: forward the request.
    Allow,
}

/// The plan for a request whose decisions could not be made.
pub fn on_error<'a>(config: &'a Config, planned: &[Planned]) -> FailurePlan<'a> {
    let policy = |p: &Planned| config.rules[p.rule].on_error;
    if planned.iter().any(|p| policy(p) == FailurePolicy::Deny) {
        return FailurePlan::Deny;
    }
    let mut local = Vec::new();
    for (i, p) in planned.iter().enumerate() {
        let rule = &config.rules[p.rule];
        if rule.on_error == FailurePolicy::Local {
            match &rule.emergency {
                Some(e) => local.push((i, e)),
                // Refused by validation; never admit uncounted.
                None => return FailurePlan::Deny,
            }
        }
    }
    if local.is_empty() {
        FailurePlan::Allow
    } else {
        FailurePlan::Local(local)
    }
}

/// Whether some applicable rule fails open (`allow`): a request admitted on a limiter error then
/// passed at least one limit unchecked.
pub fn fails_open(config: &Config, planned: &[Planned]) -> bool {
    planned
        .iter()
        .any(|p| config.rules[p.rule].on_error == FailurePolicy::Allow)
}

/// The emergency buckets to charge for the entries of [`FailurePlan::Local`], in order (see
/// [`emergency::take_all`]).
pub fn charges(
    config: &Config,
    planned: &[Planned],
    local: &[(usize, &Emergency)],
) -> Vec<EmergencyCharge> {
    local
        .iter()
        .map(|&(i, e)| {
            let rule = &config.rules[planned[i].rule];
            EmergencyCharge {
                key: emergency::shared_key(&rule.name),
                bucket: EmergencyBucket::from(e),
                cost: rule.cost.tokens() as f64,
            }
        })
        .collect()
}

/// The verdict from the emergency buckets: `takes[k]` is what the bucket of `local[k]` said
/// ([`emergency::take_all`]; a missing result counts as contention). All must admit. Contention
/// on the shared bucket denies (never admits uncounted), with `Retry-After: 1`. On admission `t`
/// is the time until the bucket is full again, as on the sidecar path.
pub fn from_emergency(
    config: &Config,
    planned: &[Planned],
    local: &[(usize, &Emergency)],
    takes: &[Result<Take, Contention>],
) -> Verdict {
    let limit = |i: usize, e: &Emergency, remaining: u64, reset_s: u64| HeaderLimit {
        name: &config.rules[planned[i].rule].name,
        quota: e.capacity,
        window_s: window_s(e.capacity, e.refill_per_sec),
        remaining,
        reset_s,
    };
    let entries = || {
        local
            .iter()
            .enumerate()
            .map(|(k, &(i, e))| (i, e, takes.get(k).copied().unwrap_or(Err(Contention))))
    };
    let rejecting = entries()
        .filter_map(|(i, e, t)| match t {
            Ok(t) if t.allowed => None,
            Ok(t) => Some((i, e, t.remaining, t.retry_after_ms)),
            Err(Contention) => Some((i, e, 0, 1000)),
        })
        .max_by_key(|(_, _, _, retry_after_ms)| *retry_after_ms);
    if let Some((i, e, remaining, retry_after_ms)) = rejecting {
        let wait_s = retry_after_s(retry_after_ms);
        let figures = limit(i, e, remaining, wait_s);
        return Verdict::Reject(rate_limited(config, figures.name, Some(&figures), wait_s));
    }
    let limits: Vec<_> = entries()
        .filter_map(|(i, e, t)| t.ok().map(|t| limit(i, e, t.remaining, ceil_s(t.reset_ms))))
        .collect();
    admit(config, &limits)
}

/// 503: the limiter is unavailable (a `deny` rule could not be decided). Not the client's quota,
/// so no `Retry-After` and no rate-limit headers.
pub fn unavailable() -> LocalReply {
    LocalReply {
        status: 503,
        headers: vec![content_type()],
        body: body(&RejectBody {
            error: "rate limiter unavailable",
            rule: None,
            retry_after_s: None,
        }),
        details: "ratelimit_unavailable".into(),
    }
}

/// The answer to a request whose subject a rule with `on_unknown: reject` cannot name.
pub fn unknown_subject(rule: &str, status: u32) -> LocalReply {
    LocalReply {
        status,
        headers: vec![content_type()],
        body: body(&RejectBody {
            error: "identity required",
            rule: Some(rule),
            retry_after_s: None,
        }),
        details: format!("ratelimit_unknown_subject:{rule}"),
    }
}

/// 400: an identity header (the API key) came more than once, so it names no one for sure.
pub fn repeated_identity(header: &str) -> LocalReply {
    LocalReply {
        status: 400,
        headers: vec![content_type()],
        body: body(&RejectBody {
            error: &format!("{header} must be sent once"),
            rule: None,
            retry_after_s: None,
        }),
        details: "ratelimit_repeated_identity".into(),
    }
}

/// The JSON body of a local reply, fields in this order.
#[derive(serde::Serialize)]
struct RejectBody<'a> {
    error: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    rule: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after_s: Option<u64>,
}

fn body(b: &RejectBody<'_>) -> String {
    // Serializing strings and integers cannot fail; an empty body would still be a valid reply.
    serde_json::to_string(b).unwrap_or_default()
}

fn content_type() -> (String, String) {
    ("content-type".into(), "application/json".into())
}

fn admit(config: &Config, limits: &[HeaderLimit<'_>]) -> Verdict {
    let headers = if config.rate_limit_headers == RateLimitHeaders::Always {
        fields::admitted(limits)
            .into_iter()
            .map(|(name, value)| (name.to_string(), value))
            .collect()
    } else {
        Vec::new()
    };
    Verdict::Admit { headers }
}

fn rate_limited(
    config: &Config,
    rule: &str,
    limit: Option<&HeaderLimit<'_>>,
    wait_s: u64,
) -> LocalReply {
    let mut headers = vec![
        content_type(),
        (fields::RETRY_AFTER.into(), wait_s.to_string()),
    ];
    if let (Some(limit), true) = (limit, config.rate_limit_headers != RateLimitHeaders::Never) {
        headers.push((fields::RATELIMIT_POLICY.into(), limit.policy()));
        headers.push((fields::RATELIMIT.into(), limit.limit()));
    }
    LocalReply {
        status: 429,
        headers,
        body: body(&RejectBody {
            error: "rate limited",
            rule: Some(rule),
            retry_after_s: Some(wait_s),
        }),
        details: format!("ratelimit_rejected:{rule}"),
    }
}

/// A 429 waiting cannot cure: the cost exceeds the capacity, or the subject is blocked.
fn never(
    config: &Config,
    rule: &str,
    limit: Option<&HeaderLimit<'_>>,
    reason: Reason,
) -> LocalReply {
    let mut headers = vec![content_type()];
    if let (Some(limit), true) = (limit, config.rate_limit_headers != RateLimitHeaders::Never) {
        if reason == Reason::CostExceedsCapacity {
            headers.push((fields::RATELIMIT_POLICY.into(), limit.policy()));
        }
    }
    LocalReply {
        status: 429,
        headers,
        body: body(&RejectBody {
            error: if reason == Reason::Blocked {
                "blocked by the rate limit policy"
            } else {
                "request cost exceeds the rate limit"
            },
            rule: Some(rule),
            retry_after_s: None,
        }),
        details: format!("ratelimit_rejected:{rule}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::example;
    use crate::emergency::State;
    use ratelimit_wire::headers::MAX_SF_INTEGER;
    use ratelimit_wire::{AppliedLimit, DecisionResult, RequestError, Subject as WireSubject};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// The example's rules, in the order of its remote decisions.
    const RULES: [&str; 2] = ["per-app", "per-ip"];

    fn limit(name: &str, capacity: u64, refill_per_sec: f64) -> Option<AppliedLimit> {
        Some(AppliedLimit {
            name: name.into(),
            capacity,
            refill_per_sec,
        })
    }

    /// The sidecar's limits for the example's rules: 100 at 10/s, 1000 at 100/s.
    fn per_app() -> Option<AppliedLimit> {
        limit("per-app", 100, 10.0)
    }

    fn per_ip() -> Option<AppliedLimit> {
        limit("per-ip", 1000, 100.0)
    }

    fn admitted(remaining: u64, reset_ms: u64, limit: Option<AppliedLimit>) -> DecisionResult {
        DecisionResult {
            receipt: None,
            allowed: true,
            remaining,
            retry_after_ms: 0,
            reset_ms,
            reason: Reason::Ok,
            limit,
            shadow: false,
            leased: 0,
            error: None,
        }
    }

    fn rejected(
        remaining: u64,
        retry_after_ms: u64,
        limit: Option<AppliedLimit>,
    ) -> DecisionResult {
        DecisionResult {
            allowed: false,
            retry_after_ms,
            reason: Reason::Insufficient,
            ..admitted(remaining, 0, limit)
        }
    }

    /// A shadow-mode result: the sidecar lets it pass, whatever it would have done.
    fn shadow(reason: Reason, retry_after_ms: u64, limit: Option<AppliedLimit>) -> DecisionResult {
        DecisionResult {
            shadow: true,
            reason,
            retry_after_ms,
            ..admitted(0, 0, limit)
        }
    }

    fn answer(results: Vec<DecisionResult>) -> RequestAnswer {
        RequestAnswer {
            allowed: results.iter().all(|r| r.allowed),
            results,
            error: None,
            slot: None,
        }
    }

    fn failed(code: ErrorCode, message: &str) -> RequestAnswer {
        RequestAnswer {
            allowed: false,
            results: Vec::new(),
            error: Some(RequestError {
                code,
                message: message.into(),
            }),
            slot: None,
        }
    }

    fn header<'a>(reply: &'a LocalReply, name: &str) -> Option<&'a str> {
        reply
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn header_names(reply: &LocalReply) -> Vec<&str> {
        reply.headers.iter().map(|(n, _)| n.as_str()).collect()
    }

    fn reject(v: Verdict) -> LocalReply {
        match v {
            Verdict::Reject(r) => r,
            other => panic!("expected a rejection, got {other:?}"),
        }
    }

    fn admit(v: Verdict) -> Vec<(String, String)> {
        match v {
            Verdict::Admit { headers } => headers,
            other => panic!("expected an admission, got {other:?}"),
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    fn always() -> Config {
        Config {
            rate_limit_headers: RateLimitHeaders::Always,
            ..example()
        }
    }

    /// The planned decisions of the example's rules `rules` (as the host holds them).
    fn planned(config: &Config, rules: &[usize]) -> Vec<Planned> {
        rules
            .iter()
            .map(|&i| Planned {
                rule: i,
                subject: WireSubject::new(),
                cost: config.rules[i].cost.tokens(),
                id: config.rules[i].name.clone(),
            })
            .collect()
    }

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one() {
        assert_eq!(retry_after_s(0), 1);
        assert_eq!(retry_after_s(1), 1);
        assert_eq!(retry_after_s(1000), 1);
        assert_eq!(retry_after_s(1001), 2);
        assert_eq!(retry_after_s(2999), 3);
        assert_eq!(retry_after_s(u64::MAX), MAX_SF_INTEGER);
        assert_eq!(retry_after_s(MAX_SF_INTEGER * 1000), MAX_SF_INTEGER);
        assert_eq!(
            (ceil_s(0), ceil_s(1), ceil_s(1000), ceil_s(1001)),
            (0, 1, 1, 2)
        );
    }

    #[test]
    fn an_exhausted_rule_gives_429_with_its_headers_body_and_details() {
        let c = example();
        let r = reject(from_answer(
            &c,
            &answer(vec![
                rejected(0, 100, per_app()),
                admitted(998, 20, per_ip()),
            ]),
            &RULES,
            &[],
        ));
        assert_eq!(r.status, 429);
        assert_eq!(
            r.headers,
            headers(&[
                ("content-type", "application/json"),
                ("retry-after", "1"),
                ("ratelimit-policy", "\"per-app\";q=100;w=10"),
                ("ratelimit", "\"per-app\";r=0;t=1"),
            ])
        );
        assert_eq!(
            r.body,
            r#"{"error":"rate limited","rule":"per-app","retry_after_s":1}"#
        );
        assert_eq!(r.details, "ratelimit_rejected:per-app");
    }

    #[test]
    fn the_policy_header_names_the_limit_and_the_body_names_the_rule() {
        // The sidecar applied an override of `per-app` (envoy/limits.yaml: clients without a
        // known API key share `unknown-apps`, 50 at 5/s).
        let c = example();
        let r = reject(from_answer(
            &c,
            &answer(vec![rejected(3, 1200, limit("unknown-apps", 50, 5.0))]),
            &RULES[..1],
            &[],
        ));
        assert_eq!(
            header(&r, "ratelimit-policy"),
            Some("\"unknown-apps\";q=50;w=10")
        );
        assert_eq!(header(&r, "ratelimit"), Some("\"unknown-apps\";r=3;t=2"));
        assert_eq!(header(&r, "retry-after"), Some("2"));
        assert_eq!(
            r.body,
            r#"{"error":"rate limited","rule":"per-app","retry_after_s":2}"#
        );
        assert_eq!(r.details, "ratelimit_rejected:per-app");
    }

    #[test]
    fn the_longest_wait_names_the_limiting_rule() {
        let c = example();
        for (results, slow) in [
            (
                vec![rejected(0, 100, per_app()), rejected(0, 2_500, per_ip())],
                "per-ip",
            ),
            (
                vec![rejected(0, 2_500, per_app()), rejected(0, 100, per_ip())],
                "per-app",
            ),
        ] {
            let r = reject(from_answer(&c, &answer(results), &RULES, &[]));
            assert_eq!(header(&r, "retry-after"), Some("3"));
            assert_eq!(
                header(&r, "ratelimit"),
                Some(format!("\"{slow}\";r=0;t=3").as_str())
            );
            assert_eq!(r.details, format!("ratelimit_rejected:{slow}"));
            assert!(
                r.body.contains(&format!("\"rule\":\"{slow}\"")),
                "{}",
                r.body
            );
        }
    }

    #[test]
    fn cost_exceeding_capacity_is_a_429_without_retry_after() {
        let c = example();
        let never = DecisionResult {
            reason: Reason::CostExceedsCapacity,
            ..rejected(100, 0, per_ip())
        };
        // Even when another rule asks for a wait: waiting cannot help.
        let r = reject(from_answer(
            &c,
            &answer(vec![rejected(0, 5_000, per_app()), never]),
            &RULES,
            &[],
        ));
        assert_eq!(r.status, 429);
        assert_eq!(
            r.headers,
            headers(&[
                ("content-type", "application/json"),
                ("ratelimit-policy", "\"per-ip\";q=1000;w=10"),
            ])
        );
        assert_eq!(
            r.body,
            r#"{"error":"request cost exceeds the rate limit","rule":"per-ip"}"#
        );
        assert_eq!(r.details, "ratelimit_rejected:per-ip");
    }

    #[test]
    fn a_blocked_subject_is_a_429_without_retry_after_or_rate_limit_headers() {
        let c = always();
        // As the sidecar answers a blocked subject: no bucket, so no figures.
        let blocked = DecisionResult {
            reason: Reason::Blocked,
            ..rejected(0, 0, limit("banned", 0, 0.0))
        };
        let r = reject(from_answer(
            &c,
            &answer(vec![admitted(99, 100, per_app()), blocked]),
            &RULES,
            &[],
        ));
        assert_eq!(r.status, 429);
        assert_eq!(header_names(&r), ["content-type"]);
        assert_eq!(
            r.body,
            r#"{"error":"blocked by the rate limit policy","rule":"per-ip"}"#
        );
        assert_eq!(r.details, "ratelimit_rejected:per-ip");
    }

    #[test]
    fn admitted_headers_follow_the_configuration() {
        let mut c = example();
        let a = answer(vec![
            admitted(99, 100, per_app()),
            admitted(999, 10, per_ip()),
        ]);
        assert_eq!(admit(from_answer(&c, &a, &RULES, &[])), []);
        c.rate_limit_headers = RateLimitHeaders::Always;
        assert_eq!(
            admit(from_answer(&c, &a, &RULES, &[])),
            headers(&[
                (
                    "ratelimit-policy",
                    "\"per-app\";q=100;w=10, \"per-ip\";q=1000;w=10"
                ),
                ("ratelimit", "\"per-app\";r=99;t=1, \"per-ip\";r=999;t=1"),
            ])
        );
        c.rate_limit_headers = RateLimitHeaders::Never;
        assert_eq!(admit(from_answer(&c, &a, &RULES, &[])), []);
        let r = reject(from_answer(
            &c,
            &answer(vec![rejected(0, 10, per_app()), admitted(1, 0, per_ip())]),
            &RULES,
            &[],
        ));
        assert_eq!(header_names(&r), ["content-type", "retry-after"]);
        let never = DecisionResult {
            reason: Reason::CostExceedsCapacity,
            ..rejected(0, 0, per_app())
        };
        let r = reject(from_answer(&c, &answer(vec![never]), &RULES, &[]));
        assert_eq!(header_names(&r), ["content-type"]);
    }

    #[test]
    fn shadow_results_never_reject_and_are_left_out_of_admitted_headers() {
        let c = always();
        let results = vec![
            admitted(99, 100, per_app()),
            shadow(Reason::Insufficient, 9_000, limit("trial", 1, 1.0)),
            shadow(Reason::Blocked, 0, limit("banned", 0, 0.0)),
            shadow(Reason::CostExceedsCapacity, 0, limit("tiny", 1, 1.0)),
        ];
        let rules = ["per-app", "trial", "banned", "tiny"];
        assert_eq!(
            admit(from_answer(&c, &answer(results.clone()), &rules, &[])),
            headers(&[
                ("ratelimit-policy", "\"per-app\";q=100;w=10"),
                ("ratelimit", "\"per-app\";r=99;t=1"),
            ])
        );
        // Nor do they name the limiting rule when another rejects, whatever their wait.
        let mut results = results;
        results[0] = rejected(0, 500, per_app());
        let r = reject(from_answer(&c, &answer(results), &rules, &[]));
        assert_eq!(header(&r, "retry-after"), Some("1"));
        assert_eq!(r.details, "ratelimit_rejected:per-app");
    }

    #[test]
    fn an_unlimited_subject_adds_no_headers() {
        let c = always();
        let unlimited = DecisionResult {
            reason: Reason::Unlimited,
            ..admitted(0, 0, None)
        };
        assert_eq!(
            admit(from_answer(
                &c,
                &answer(vec![unlimited.clone()]),
                &RULES,
                &[]
            )),
            []
        );
        assert_eq!(
            admit(from_answer(
                &c,
                &answer(vec![unlimited, admitted(5, 2_001, per_ip())]),
                &RULES,
                &[]
            )),
            headers(&[
                ("ratelimit-policy", "\"per-ip\";q=1000;w=10"),
                ("ratelimit", "\"per-ip\";r=5;t=3"),
            ])
        );
    }

    #[test]
    fn leased_admissions_add_their_headers_with_the_lease_tokens_remaining() {
        let per_ip = KnownLimit {
            name: "per-ip".into(),
            capacity: 1000,
            refill_per_sec: 100.0,
        };
        let leased = [
            LeasedAdmit {
                limit: Some(&per_ip),
                lease_tokens: 37,
            },
            // A lease whose limit is not known (yet): it passes, without figures.
            LeasedAdmit {
                limit: None,
                lease_tokens: 5,
            },
        ];
        let c = always();
        // `t` of a leased admission is the full window: the lease says nothing of the bucket.
        assert_eq!(
            admit(from_answer(
                &c,
                &answer(vec![admitted(99, 100, per_app())]),
                &RULES[..1],
                &leased
            )),
            headers(&[
                (
                    "ratelimit-policy",
                    "\"per-app\";q=100;w=10, \"per-ip\";q=1000;w=10"
                ),
                ("ratelimit", "\"per-app\";r=99;t=1, \"per-ip\";r=37;t=10"),
            ])
        );
        assert_eq!(
            admit(from_leases(&c, &leased)),
            headers(&[
                ("ratelimit-policy", "\"per-ip\";q=1000;w=10"),
                ("ratelimit", "\"per-ip\";r=37;t=10"),
            ])
        );
        assert_eq!(admit(from_leases(&c, &leased[1..])), []);
        assert_eq!(admit(from_leases(&example(), &leased)), []);
        // A remote rejection answers alone: the leased parts are given back, not reported.
        let r = reject(from_answer(
            &c,
            &answer(vec![rejected(0, 100, per_app())]),
            &RULES[..1],
            &leased,
        ));
        assert_eq!(header(&r, "ratelimit"), Some("\"per-app\";r=0;t=1"));
    }

    #[test]
    fn a_checked_answer_has_one_consistent_result_per_decision() {
        let ok = answer(vec![admitted(1, 0, per_app()), rejected(0, 5, per_ip())]);
        assert_eq!(check_answer(&ok, 2), Ok(()));
        assert_eq!(
            check_answer(&ok, 3),
            Err(LimiterError::Results {
                expected: 3,
                got: 2
            })
        );
        assert_eq!(
            check_answer(&answer(vec![]), 1),
            Err(LimiterError::Results {
                expected: 1,
                got: 0
            })
        );
        let liar = RequestAnswer {
            allowed: true,
            ..ok.clone()
        };
        assert_eq!(
            check_answer(&liar, 2),
            Err(LimiterError::Inconsistent { allowed: true })
        );
        let mut pessimist = answer(vec![admitted(1, 0, per_app())]);
        pessimist.allowed = false;
        assert_eq!(
            check_answer(&pessimist, 1),
            Err(LimiterError::Inconsistent { allowed: false })
        );
        assert_eq!(
            LimiterError::Results {
                expected: 3,
                got: 2
            }
            .to_string(),
            "answer has 2 results for 3 decisions"
        );
    }

    #[test]
    fn a_per_request_error_is_an_error_and_an_unknown_rule_a_configuration_error() {
        let e =
            check_answer(&failed(ErrorCode::UnknownRule, "no rule \"per-app\""), 1).unwrap_err();
        assert_eq!(
            e,
            LimiterError::Request {
                code: ErrorCode::UnknownRule,
                message: "no rule \"per-app\"".into()
            }
        );
        assert!(e.is_config_error());
        assert_eq!(e.to_string(), "UnknownRule: no rule \"per-app\"");
        for code in [ErrorCode::Unavailable, ErrorCode::ScriptFailed] {
            let e = check_answer(&failed(code, "redis"), 1).unwrap_err();
            assert_eq!(
                e,
                LimiterError::Request {
                    code,
                    message: "redis".into()
                }
            );
            assert!(!e.is_config_error(), "{e}");
        }
        // The error wins over whatever else the answer says.
        let mut both = failed(ErrorCode::Unavailable, "down");
        both.allowed = true;
        both.results = vec![admitted(1, 0, per_app())];
        assert!(matches!(
            check_answer(&both, 1),
            Err(LimiterError::Request {
                code: ErrorCode::Unavailable,
                ..
            })
        ));
        for e in [
            LimiterError::NoAnswer,
            LimiterError::Dispatch("x".into()),
            LimiterError::Status("500".into()),
            LimiterError::Malformed("x".into()),
            LimiterError::Count {
                expected: 1,
                got: 0,
            },
            LimiterError::Results {
                expected: 1,
                got: 0,
            },
            LimiterError::Inconsistent { allowed: true },
        ] {
            assert!(!e.is_config_error(), "{e}");
        }
    }

    #[test]
    fn answers_that_cannot_be_trusted_are_errors() {
        // The wire's documented answer, and a per-request error (left to `check_answer`).
        let ok = br#"{"answers":[{"allowed":true,"results":[{"allowed":true,"remaining":99,"retry_after_ms":0,
            "reset_ms":100,"reason":"ok","limit":{"name":"per-app","capacity":100,"refill_per_sec":10}}]},
            {"allowed":false,"error":{"code":"unknown_rule","message":"no rule x"}}]}"#;
        let parsed = parse_answer(Some(b"200"), ok, 2).unwrap();
        assert_eq!(parsed.answers[0].results[0].limit, per_app());
        assert_eq!(parsed.answers[1].results, []);
        assert_eq!(parse_answer(None, ok, 2), Err(LimiterError::NoAnswer));
        assert_eq!(
            parse_answer(Some(b"503"), ok, 2),
            Err(LimiterError::Status("503".into()))
        );
        assert_eq!(
            parse_answer(
                Some(b"400"),
                br#"{"error":"requests[0].decisions[0].rule: ..."}"#,
                2
            ),
            Err(LimiterError::Status("400".into()))
        );
        assert_eq!(
            parse_answer(Some(b"200"), ok, 1),
            Err(LimiterError::Count {
                expected: 1,
                got: 2
            })
        );
        assert_eq!(
            parse_answer(Some(b"200"), br#"{"answers":[]}"#, 1),
            Err(LimiterError::Count {
                expected: 1,
                got: 0
            })
        );
        // The old wire's answer, HTML, nothing, an unknown reason.
        for body in [
            &br#"{"allowed":true,"results":[{"allowed":true,"remaining":1,"retry_after_ms":0,"reset_ms":0}]}"#[..],
            b"<html>",
            b"",
            br#"{"answers":[{"allowed":true,"results":[{"allowed":true,"remaining":1,"retry_after_ms":0,"reset_ms":0,"reason":"maybe"}]}]}"#,
        ] {
            assert!(
                matches!(
                    parse_answer(Some(b"200"), body, 1),
                    Err(LimiterError::Malformed(_))
                ),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        // A garbage status is reported, cut short.
        let Err(LimiterError::Status(s)) = parse_answer(Some(&[0xff; 40]), ok, 2) else {
            panic!("a garbage status is an error");
        };
        assert_eq!(s.chars().count(), 16);
    }

    #[test]
    fn a_limit_name_that_would_break_the_headers_is_a_malformed_answer() {
        for bad in [
            "",
            "a\r\nx-injected: 1",
            "\"; q=1",
            "caf\u{e9}",
            "with space",
            &"n".repeat(129),
        ] {
            let a = answer(vec![admitted(1, 0, limit(bad, 100, 10.0))]);
            assert!(
                matches!(check_answer(&a, 1), Err(LimiterError::Malformed(ref m)) if m.starts_with("results[0].limit.name")),
                "{bad:?}"
            );
        }
        for good in ["per-app", "tenant.acme_2", &"n".repeat(128)] {
            let a = answer(vec![admitted(1, 0, limit(good, 100, 10.0))]);
            assert_eq!(check_answer(&a, 1), Ok(()), "{good:?}");
        }
        // An unlimited result names no limit.
        assert_eq!(check_answer(&answer(vec![admitted(0, 0, None)]), 1), Ok(()));
    }

    #[test]
    fn the_sidecar_s_text_in_an_error_is_bounded() {
        // serde quotes the string it refuses; a request error carries the sidecar's message.
        let long = "\u{e9}".repeat(50_000);
        let body = format!(
            r#"{{"answers":[{{"allowed":true,"results":[{{"allowed":true,"remaining":1,"retry_after_ms":0,"reset_ms":0,"reason":"{long}"}}]}}]}}"#
        );
        let Err(LimiterError::Malformed(m)) = parse_answer(Some(b"200"), body.as_bytes(), 1) else {
            panic!("an unknown reason is malformed");
        };
        assert!(m.len() <= MAX_ERROR_TEXT_BYTES, "{} bytes", m.len());
        assert!(
            m.starts_with("unknown variant") && m.contains(" [...] "),
            "{m}"
        );
        assert!(
            m.contains("expected one of") && m.contains("at line 1 column"),
            "{m}"
        );
        let e = check_answer(&failed(ErrorCode::Unavailable, &long), 1).unwrap_err();
        assert!(e.to_string().len() <= MAX_ERROR_TEXT_BYTES + 16, "{e}");
        // Short texts are kept whole.
        let e = check_answer(&failed(ErrorCode::Unavailable, "redis down"), 1).unwrap_err();
        assert_eq!(e.to_string(), "Unavailable: redis down");
    }

    #[test]
    fn a_known_rejection_is_the_reply_the_sidecar_would_give() {
        let c = example();
        let known = KnownLimit {
            name: "per-app".into(),
            capacity: 100,
            refill_per_sec: 10.0,
        };
        // 1.5 s left of a known wait: the same reply as a remote rejection with that wait.
        assert_eq!(
            known_rejection(
                &c,
                "per-app",
                Some(&known),
                RejectionCause::Insufficient,
                1_500_000_000
            ),
            reject(from_answer(
                &c,
                &answer(vec![rejected(0, 1_500, per_app())]),
                &RULES[..1],
                &[]
            ))
        );
        for (cause, reason) in [
            (
                RejectionCause::CostExceedsCapacity,
                Reason::CostExceedsCapacity,
            ),
            (RejectionCause::Blocked, Reason::Blocked),
        ] {
            let remote = DecisionResult {
                reason,
                ..rejected(0, 0, per_app())
            };
            assert_eq!(
                known_rejection(&c, "per-app", Some(&known), cause, 700_000_000),
                reject(from_answer(&c, &answer(vec![remote]), &RULES[..1], &[])),
                "{cause:?}"
            );
        }
        // Without a known limit: the same reply without rate-limit headers.
        let r = known_rejection(&c, "per-ip", None, RejectionCause::Insufficient, 1);
        assert_eq!(
            r.headers,
            headers(&[("content-type", "application/json"), ("retry-after", "1")])
        );
        assert_eq!(r.details, "ratelimit_rejected:per-ip");
        // The time left is rounded up to whole milliseconds, then seconds.
        let r = known_rejection(
            &c,
            "per-ip",
            None,
            RejectionCause::Insufficient,
            1_000_000_001,
        );
        assert_eq!(header(&r, "retry-after"), Some("2"));
    }

    #[test]
    fn an_unknown_subject_is_answered_with_the_rules_status() {
        for status in [401, 429] {
            let r = unknown_subject("per-app", status);
            assert_eq!(r.status, status);
            assert_eq!(r.headers, headers(&[("content-type", "application/json")]));
            assert_eq!(r.body, r#"{"error":"identity required","rule":"per-app"}"#);
            assert_eq!(r.details, "ratelimit_unknown_subject:per-app");
        }
    }

    #[test]
    fn a_repeated_identity_header_is_a_400_naming_the_header() {
        let r = repeated_identity("x-api-key");
        assert_eq!(r.status, 400);
        assert_eq!(r.headers, headers(&[("content-type", "application/json")]));
        assert_eq!(r.body, r#"{"error":"x-api-key must be sent once"}"#);
        assert_eq!(r.details, "ratelimit_repeated_identity");
    }

    #[test]
    fn the_503_says_the_limiter_is_unavailable() {
        let r = unavailable();
        assert_eq!(r.status, 503);
        assert_eq!(r.body, r#"{"error":"rate limiter unavailable"}"#);
        assert_eq!(r.headers, headers(&[("content-type", "application/json")]));
        assert_eq!(r.details, "ratelimit_unavailable");
    }

    #[test]
    fn failure_policies_combine_deny_first_then_local_then_allow() {
        let mut c = example();
        let e = c.rules[0].emergency.clone().unwrap();
        // rules: 0 per-app local, 1 per-ip allow.
        assert_eq!(
            on_error(&c, &planned(&c, &[0, 1])),
            FailurePlan::Local(vec![(0, &e)])
        );
        assert_eq!(
            on_error(&c, &planned(&c, &[1, 0])),
            FailurePlan::Local(vec![(1, &e)])
        );
        assert_eq!(on_error(&c, &planned(&c, &[1])), FailurePlan::Allow);
        assert!(fails_open(&c, &planned(&c, &[0, 1])));
        assert!(!fails_open(&c, &planned(&c, &[0])));
        c.rules[1].on_error = FailurePolicy::Deny;
        assert_eq!(on_error(&c, &planned(&c, &[0, 1])), FailurePlan::Deny);
        assert_eq!(on_error(&c, &planned(&c, &[1])), FailurePlan::Deny);
        assert_eq!(
            on_error(&c, &planned(&c, &[0])),
            FailurePlan::Local(vec![(0, &e)])
        );
        assert!(!fails_open(&c, &planned(&c, &[0, 1])));
        // A `local` rule without a bucket (refused by validation) never admits uncounted.
        c.rules[0].emergency = None;
        assert_eq!(on_error(&c, &planned(&c, &[0])), FailurePlan::Deny);
        // Nothing planned, nothing to deny.
        assert_eq!(on_error(&c, &[]), FailurePlan::Allow);
    }

    fn take(allowed: bool, remaining: u64, retry_after_ms: u64) -> Take {
        Take {
            state: State {
                tokens: 0.0,
                updated_ns: 0,
            },
            allowed,
            remaining,
            retry_after_ms,
            reset_ms: 0,
        }
    }

    #[test]
    fn emergency_buckets_must_all_admit() {
        let c = always();
        let p = planned(&c, &[0, 1]);
        let e = c.rules[0].emergency.clone().unwrap();
        let local = [(0, &e)];
        // 9 of 10 tokens left at 1 per second: full again in 1 s.
        let admitted = Take {
            reset_ms: 1000,
            ..take(true, 9, 0)
        };
        assert_eq!(
            admit(from_emergency(&c, &p, &local, &[Ok(admitted)])),
            headers(&[
                ("ratelimit-policy", "\"per-app\";q=10;w=10"),
                ("ratelimit", "\"per-app\";r=9;t=1"),
            ])
        );
        let r = reject(from_emergency(&c, &p, &local, &[Ok(take(false, 0, 1500))]));
        assert_eq!(r.status, 429);
        assert_eq!(header(&r, "retry-after"), Some("2"));
        assert_eq!(
            header(&r, "ratelimit-policy"),
            Some("\"per-app\";q=10;w=10")
        );
        assert_eq!(header(&r, "ratelimit"), Some("\"per-app\";r=0;t=2"));
        assert_eq!(
            r.body,
            r#"{"error":"rate limited","rule":"per-app","retry_after_s":2}"#
        );
        assert_eq!(r.details, "ratelimit_rejected:per-app");
        // A missing result (take_all stopped early) is contention.
        let r = reject(from_emergency(&c, &p, &local, &[]));
        assert_eq!(header(&r, "retry-after"), Some("1"));
    }

    #[test]
    fn an_emergency_admission_resets_when_the_bucket_is_full() {
        let c = always();
        let e = c.rules[0].emergency.clone().unwrap();
        let p = planned(&c, &[0]);
        let take = EmergencyBucket::from(&e).take(None, 0, 1.0);
        let headers = admit(from_emergency(&c, &p, &[(0, &e)], &[Ok(take)]));
        assert_eq!(headers[1].1, "\"per-app\";r=9;t=1");
    }

    #[test]
    fn contention_on_an_emergency_bucket_denies() {
        let c = example();
        let e = c.rules[0].emergency.clone().unwrap();
        let p = planned(&c, &[0]);
        let r = reject(from_emergency(&c, &p, &[(0, &e)], &[Err(Contention)]));
        assert_eq!(r.status, 429);
        assert_eq!(header(&r, "retry-after"), Some("1"));
    }

    #[test]
    fn charges_name_each_local_rules_bucket_and_cost() {
        let mut c = example();
        c.rules[0].cost = crate::config::Cost::Fixed(3);
        let e = c.rules[0].emergency.clone().unwrap();
        let p = planned(&c, &[1, 0]);
        assert_eq!(
            charges(&c, &p, &[(1, &e)]),
            [EmergencyCharge {
                key: "ratelimit.emergency.per-app".into(),
                bucket: EmergencyBucket {
                    capacity: 10.0,
                    refill_per_sec: 1.0
                },
                cost: 3.0,
            }]
        );
    }

    #[test]
    fn header_integers_are_clamped_to_structured_field_range() {
        let l = HeaderLimit {
            name: "x",
            quota: u64::MAX,
            window_s: u64::MAX,
            remaining: u64::MAX,
            reset_s: u64::MAX,
        };
        let max = MAX_SF_INTEGER;
        assert_eq!(l.policy(), format!("\"x\";q={max};w={max}"));
        assert_eq!(l.limit(), format!("\"x\";r={max};t={max}"));
        // Absurd figures from the sidecar (a zero refill, the largest integers) still make
        // valid headers, and nothing panics.
        let c = always();
        let r = reject(from_answer(
            &c,
            &answer(vec![rejected(
                u64::MAX,
                u64::MAX,
                limit("x", u64::MAX, 0.0),
            )]),
            &RULES[..1],
            &[],
        ));
        assert_eq!(header(&r, "retry-after"), Some("999999999999999"));
        assert_eq!(
            header(&r, "ratelimit-policy"),
            Some(format!("\"x\";q={max};w={max}").as_str())
        );
        assert_eq!(
            header(&r, "ratelimit"),
            Some(format!("\"x\";r={max};t={max}").as_str())
        );
        let headers = admit(from_answer(
            &c,
            &answer(vec![admitted(u64::MAX, u64::MAX, limit("y", 0, -1.0))]),
            &RULES[..1],
            &[],
        ));
        assert_eq!(headers[0].1, format!("\"y\";q=0;w={max}"));
        assert_eq!(headers[1].1, format!("\"y\";r={max};t={max}"));
    }
}
