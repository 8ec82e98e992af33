//! Fuzz targets of the sidecar: every parser a caller or an operator's file reaches, fed
//! arbitrary bytes and near-valid structures, each asserting no panic and the documented
//! outcome. `docs/fuzzing.md` says what each feeds; `FUZZ_CASES` (or `FUZZ_CASES_<TARGET>`) sets
//! how many inputs.
//!
//! - `sidecar.decide.*`: the `/v1/decide` body (`decide::parse_request`);
//! - `sidecar.grpc.check`: the gRPC rate limit request (`grpc::check`, and prost's decoding);
//! - `sidecar.http`: the whole router in-process (plain, behind bearer tokens, and the admin
//!   listener's), `POST /v1/decide` and the gRPC rate limit service alike, over a
//!   [`MemoryStore`] that counts what it charges;
//! - `sidecar.policy.*`: policy files (`Policy::from_sources`), both formats;
//! - `sidecar.keys`: bucket and record keys (`keys::bucket_key`, `keys::record_key`).

#[path = "../../fuzz/harness.rs"]
mod harness;
#[path = "../../fuzz/hostile.rs"]
mod hostile;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use axum::Router;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry as DescriptorEntry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use harness::{fuzz, note};
use hostile::Doc;
use http_body_util::BodyExt;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use prost::Message;
use ratelimit_sidecar::auth::{self, Auth};
use ratelimit_sidecar::calls::{AppState, Stopping};
use ratelimit_sidecar::config::Secret;
use ratelimit_sidecar::decide::{
    parse_request, DecideError, Decider, MAX_ERROR_BYTES, MAX_LEASE_TTL_MS,
};
use ratelimit_sidecar::grpc;
use ratelimit_sidecar::http::router;
use ratelimit_sidecar::keys::{
    bucket_key, cluster_slot, record_key, MAX_VALUE_BYTES as KEY_VALUE_BYTES,
};
use ratelimit_sidecar::metrics::Metrics;
use ratelimit_sidecar::policy::reload::PolicyHandle;
use ratelimit_sidecar::policy::{Bounds, LimitKind, Policy, Resolution, MAX_CAPACITY};
use ratelimit_sidecar::store::memory::MemoryStore;
use ratelimit_sidecar::store::{BucketStore, Call, Decided, Readiness, StoreError};
use ratelimit_wire::{
    DecideRequest, DecideResponse, ErrorBody, MAX_CALL_DECISIONS, MAX_DECISIONS, MAX_LEASE_ID,
    MAX_NAME_BYTES, MAX_REQUESTS, MAX_RETURNS, MAX_SUBJECT_ENTRIES, MAX_VALUE_BYTES,
};
use serde_json::Value;
use tower::ServiceExt;

/// The shipped policy file (this sidecar's format).
const LIMITS_YAML: &str = include_str!("../../envoy/limits.yaml");

/// A policy in envoyproxy/ratelimit's format, as its README writes them.
const ENVOY_POLICY: &str = r#"
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: rule
    value: per-user
    descriptors:
      - key: user
        rate_limit: {name: per-user, unit: minute, requests_per_unit: 600}
      - key: user
        value: root
        rate_limit: {unlimited: true}
      - key: user
        value: "bot-*"
        rate_limit: {unit: HOUR, requests_per_unit: 0}
  - key: header_match
    value: post
    shadow_mode: true
    rate_limit:
      name: posts
      unit: day
      requests_per_unit: 1000
      replaces: [{name: per-user}]
"#;

/// The router's policy: small buckets so some decisions reject, every kind of limit.
const ROUTER_POLICY: &str = r#"
rules:
  per-app:
    capacity: 5
    refill_per_sec: 1
    overrides:
      - when: {app: vip}
        unlimited: true
      - when: {app: banned}
        blocked: true
      - when: {app: null}
        name: unknown-apps
        capacity: 3
        refill_per_sec: 1
  per-ip: {capacity: 2, refill_per_sec: 1}
  trial: {capacity: 1, refill_per_sec: 1, shadow_mode: true}
"#;

/// Rules a call may name: the policy's, and one it lacks.
const RULES: &[&str] = &["per-app", "per-ip", "trial", "per-user", "ghost"];
const DIMENSIONS: &[&str] = &["app", "ip", "user"];
const VALUES: &[&str] = &[
    "alpha", "beta", "vip", "banned", "root", "bot-1", "10.0.0.1",
];

/// The fields a call's error may name at its root.
const CALL_FIELDS: &[&str] = &["domain", "attempt", "requests", "returns"];

/// What `parse_request` must do with any body: a bounded error naming the field (or the place of
/// a syntax error), or a call within every bound of `ratelimit_wire`.
fn check_parsed(result: &Result<DecideRequest, DecideError>) -> Result<(), TestCaseError> {
    match result {
        Ok(call) => {
            note("accepted");
            check_call_bounds(call)
        }
        Err(DecideError::Invalid(message)) => {
            note("refused");
            check_error_message(message)
        }
    }
}

fn check_error_message(message: &str) -> Result<(), TestCaseError> {
    prop_assert!(!message.is_empty(), "an empty error");
    prop_assert!(
        message.len() <= MAX_ERROR_BYTES,
        "an error of {} bytes: {}...",
        message.len(),
        &message[..message
            .char_indices()
            .nth(100)
            .map_or(message.len(), |(i, _)| i)]
    );
    let root = message.split(['.', '[', ':']).next().unwrap_or("");
    prop_assert!(
        CALL_FIELDS.contains(&root)
            || message.starts_with('[')
            || message.contains(" at line ")
            || message.starts_with("trailing data"),
        "the error names no field and no place: {message}"
    );
    Ok(())
}

fn check_call_bounds(call: &DecideRequest) -> Result<(), TestCaseError> {
    prop_assert!(!call.domain.is_empty() && call.domain.len() <= MAX_NAME_BYTES);
    if let Some(a) = &call.attempt {
        prop_assert!(!a.is_empty() && a.len() <= MAX_NAME_BYTES);
    }
    prop_assert!(!call.requests.is_empty() || !call.returns.is_empty());
    prop_assert!(call.requests.len() <= MAX_REQUESTS);
    let total: usize = call.requests.iter().map(|r| r.decisions.len()).sum();
    prop_assert!(total <= MAX_CALL_DECISIONS);
    let subject_ok = |s: &ratelimit_wire::Subject| -> Result<(), TestCaseError> {
        prop_assert!(s.0.len() <= MAX_SUBJECT_ENTRIES);
        let mut seen = HashSet::new();
        for (k, v) in s.iter() {
            prop_assert!(
                !k.is_empty() && k.len() <= MAX_NAME_BYTES && k != "rule",
                "dimension {k:?}"
            );
            prop_assert!(seen.insert(k), "dimension {k:?} twice");
            prop_assert!(v.is_none_or(|v| v.len() <= MAX_VALUE_BYTES));
        }
        Ok(())
    };
    for r in &call.requests {
        prop_assert!((1..=MAX_DECISIONS).contains(&r.decisions.len()));
        for d in &r.decisions {
            prop_assert!(!d.rule.is_empty() && d.rule.len() <= MAX_NAME_BYTES);
            subject_ok(&d.subject)?;
            prop_assert!((1..=MAX_CAPACITY).contains(&d.cost));
            if let Some(l) = &d.lease {
                prop_assert!(l.id <= MAX_LEASE_ID);
                prop_assert!((1..=MAX_LEASE_TTL_MS).contains(&l.ttl_ms));
                prop_assert!(l.tokens <= MAX_CAPACITY);
            }
        }
    }
    prop_assert!(call.returns.len() <= MAX_RETURNS);
    for r in &call.returns {
        prop_assert!(!r.rule.is_empty() && r.rule.len() <= MAX_NAME_BYTES);
        subject_ok(&r.subject)?;
        prop_assert!(r.id <= MAX_LEASE_ID && r.tokens <= MAX_CAPACITY);
    }
    Ok(())
}

#[test]
fn fuzz_decide_bytes() {
    fuzz("sidecar.decide.bytes", 800, hostile::bytes(2048), |body| {
        check_parsed(&parse_request(&body))
    });
}

fn subject() -> impl Strategy<Value = Doc> {
    prop::collection::vec(
        (
            prop::sample::select(DIMENSIONS),
            prop::option::weighted(0.8, prop::sample::select(VALUES)),
        ),
        0..3,
    )
    .prop_map(|entries| {
        let mut seen = HashSet::new();
        Doc::Obj(
            entries
                .into_iter()
                .filter(|(k, _)| seen.insert(*k))
                .map(|(k, v)| (k.to_string(), v.map_or(Doc::Null, |v| Doc::Str(v.into()))))
                .collect(),
        )
    })
}

/// A valid call: 1 to 3 requests of 1 to 3 decisions (rules of the policy and one it lacks),
/// optional attempt, leases and returns.
fn call() -> impl Strategy<Value = Doc> {
    let lease = (0..=MAX_LEASE_ID, 0u64..50, 1..=MAX_LEASE_TTL_MS).prop_map(|(id, tokens, ttl)| {
        Doc::Obj(vec![
            ("id".into(), Doc::Num(id.to_string())),
            ("tokens".into(), Doc::Num(tokens.to_string())),
            ("ttl_ms".into(), Doc::Num(ttl.to_string())),
        ])
    });
    let decision = (
        prop::sample::select(RULES),
        subject(),
        prop::option::of(prop_oneof![1u64..4, 1..=MAX_CAPACITY]),
        prop::option::weighted(0.2, lease),
    )
        .prop_map(|(rule, subject, cost, lease)| {
            let mut o = vec![
                ("rule".into(), Doc::Str(rule.into())),
                ("subject".into(), subject),
            ];
            if let Some(c) = cost {
                o.push(("cost".into(), Doc::Num(c.to_string())));
            }
            if let Some(l) = lease {
                o.push(("lease".into(), l));
            }
            Doc::Obj(o)
        });
    let request = prop::collection::vec(decision, 1..4)
        .prop_map(|d| Doc::Obj(vec![("decisions".into(), Doc::Arr(d))]));
    let ret = (
        prop::sample::select(RULES),
        subject(),
        0..=MAX_LEASE_ID,
        0u64..50,
    )
        .prop_map(|(rule, subject, id, tokens)| {
            Doc::Obj(vec![
                ("rule".into(), Doc::Str(rule.into())),
                ("subject".into(), subject),
                ("id".into(), Doc::Num(id.to_string())),
                ("tokens".into(), Doc::Num(tokens.to_string())),
            ])
        });
    (
        prop::option::weighted(
            0.7,
            prop::sample::select(&["ratelimit", "edge", "nowhere"][..]),
        ),
        prop::option::of("[a-z0-9-]{1,40}"),
        prop::collection::vec(request, 1..4),
        prop::collection::vec(ret, 0..2),
    )
        .prop_map(|(domain, attempt, requests, returns)| {
            let mut o = Vec::new();
            if let Some(d) = domain {
                o.push(("domain".into(), Doc::Str(d.into())));
            }
            if let Some(a) = attempt {
                o.push(("attempt".into(), Doc::Str(a)));
            }
            o.push(("requests".into(), Doc::Arr(requests)));
            if !returns.is_empty() {
                o.push(("returns".into(), Doc::Arr(returns)));
            }
            Doc::Obj(o)
        })
}

/// A call's body: valid, mutated (a few hostile changes, sometimes cut or spliced), or arbitrary.
fn call_body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        1 => call().prop_map(|d| d.json().into_bytes()),
        4 => hostile::mutated(call(), 4, 6000)
            .prop_map(|(doc, damage)| damage.apply(doc.json().into_bytes())),
        1 => hostile::bytes(512),
    ]
}

#[test]
fn fuzz_decide_mutated() {
    fuzz("sidecar.decide.mutated", 800, call_body(), |body| {
        let parsed = parse_request(&body);
        check_parsed(&parsed)?;
        Ok(())
    });
}

/// What `grpc::check` must do with any `RateLimitRequest` (decoded from arbitrary bytes, or
/// generated): an error naming the field, within [`MAX_ERROR_BYTES`], or items within the bounds
/// `POST /v1/decide` has.
#[test]
fn fuzz_grpc_check() {
    let input = prop_oneof![
        1 => hostile::bytes(512).prop_map(|b| RateLimitRequest::decode(&b[..]).ok()),
        3 => rate_limit_request().prop_map(|r| {
            let back = RateLimitRequest::decode(&r.encode_to_vec()[..]).expect("a round trip");
            assert_eq!(back, r);
            Some(r)
        }),
    ];
    fuzz("sidecar.grpc.check", 800, input, |request| {
        let Some(request) = request else {
            note("undecodable");
            return Ok(());
        };
        let descriptors = request.descriptors.len();
        match grpc::check(request) {
            Err(e) => {
                note("refused");
                prop_assert!(!e.is_empty() && e.len() <= MAX_ERROR_BYTES, "{e}");
                prop_assert!(
                    e.starts_with("domain") || e.starts_with("descriptors"),
                    "the error names no field: {e}"
                );
            }
            Ok(checked) => {
                note("accepted");
                prop_assert!(!checked.domain.is_empty() && checked.domain.len() <= MAX_NAME_BYTES);
                // Decisions, or (a stream-done call) settlements, never both.
                let settlements = checked.settlements.len();
                prop_assert!(checked.items.is_empty() || settlements == 0);
                prop_assert_eq!(checked.items.len() + settlements, descriptors);
                prop_assert!((1..=MAX_DECISIONS).contains(&descriptors));
                if settlements > 0 {
                    note("settlements");
                }
                for st in &checked.settlements {
                    prop_assert!(st.reserved >= 1 && st.reserved <= MAX_CAPACITY);
                    prop_assert!(st.cost <= MAX_CAPACITY);
                    prop_assert!((1..grpc::MAX_DESCRIPTOR_ENTRIES).contains(&st.entries.len()));
                    prop_assert!(st.entries.iter().all(|(k, _)| k != grpc::SETTLE_KEY));
                }
                for item in &checked.items {
                    prop_assert!((1..=MAX_CAPACITY).contains(&item.cost));
                    prop_assert!((1..=grpc::MAX_DESCRIPTOR_ENTRIES).contains(&item.entries.len()));
                    for (k, v) in &item.entries {
                        prop_assert!(!k.is_empty() && k.len() <= MAX_NAME_BYTES);
                        prop_assert!(v.as_ref().is_none_or(|v| v.len() <= MAX_VALUE_BYTES));
                    }
                }
            }
        }
        Ok(())
    });
}

/// A [`MemoryStore`] that counts the calls it gets and the requests it charges (answers
/// admitted: each holds its charges).
struct Counting {
    inner: MemoryStore,
    applied: AtomicU64,
    charged: AtomicU64,
}

impl BucketStore for Counting {
    async fn decide(&self, call: Call) -> Vec<Result<Decided, StoreError>> {
        self.applied.fetch_add(1, Ordering::SeqCst);
        let answers = self.inner.decide(call).await;
        let charged = answers
            .iter()
            .filter(|a| a.as_ref().is_ok_and(|d| d.admitted))
            .count();
        self.charged.fetch_add(charged as u64, Ordering::SeqCst);
        answers
    }

    async fn readiness(&self) -> Readiness {
        self.inner.readiness().await
    }
}

const TOKEN: &str = "fuzz-token-3f9a";
const MAX_BODY_BYTES: usize = 4096;

/// Which listener's router answers.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Listener {
    /// `--listen` without tokens.
    Plain,
    /// `--listen` with a bearer token.
    Protected,
    /// `--admin-listen`.
    Admin,
}

#[derive(Debug, Clone)]
struct HttpCase {
    listener: Listener,
    method: Method,
    uri: String,
    headers: Vec<(String, Vec<u8>)>,
    authorization: Option<Vec<u8>>,
    body: Vec<u8>,
    /// The store fails every call with this error (an outage, a script failure).
    failing: Option<u8>,
    advance_ms: u64,
}

fn http_case() -> impl Strategy<Value = HttpCase> {
    prop_oneof![3 => json_case().boxed(), 1 => grpc_case().boxed()]
}

/// A call of the HTTP API (or anything else an HTTP client sends).
fn json_case() -> impl Strategy<Value = HttpCase> {
    let method = prop_oneof![
        12 => Just(Method::POST),
        2 => Just(Method::GET),
        1 => prop::sample::select(
            &["HEAD", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT", "PRI", "M-SEARCH", "post"][..]
        )
        .prop_map(|m| Method::from_bytes(m.as_bytes()).expect("a method")),
        1 => "[!#$%&'*+.^_`|~0-9A-Za-z-]{1,16}"
            .prop_map(|m| Method::from_bytes(m.as_bytes()).unwrap_or(Method::POST)),
    ];
    let path = prop_oneof![
        12 => Just("/v1/decide".to_string()),
        2 => prop::sample::select(&[
            "/healthz", "/readyz", "/metrics", "/", "/v1/decide/", "/v1//decide", "/V1/DECIDE",
            "/v1/decide?x=1", "/healthz?probe=1", "/%2e%2e/metrics", "/v1/%64ecide", "*",
            "/metrics/", "//healthz", "/v1/decide#f",
        ][..]).prop_map(str::to_string),
        1 => "/[A-Za-z0-9%._~/:@!$&'()*+,;=-]{0,64}(\\?[A-Za-z0-9=&%]{0,32})?",
        1 => (1000usize..9000).prop_map(|n| format!("/{}", "a".repeat(n))),
    ];
    let header = (
        prop_oneof![
            prop::sample::select(
                &[
                    "content-type",
                    "content-length",
                    "transfer-encoding",
                    "authorization",
                    "host",
                    "expect",
                    "x-forwarded-for",
                    "te",
                    "connection",
                    "accept",
                ][..]
            )
            .prop_map(str::to_string),
            "[a-z0-9!#$%&'*+.^_`|~-]{1,24}",
        ],
        prop_oneof![
            prop::sample::select(
                &[
                    "application/json",
                    "application/grpc",
                    "application/grpc+proto",
                    "text/plain",
                    "application/json; charset=utf-8",
                    "100-continue",
                    "chunked",
                    "0",
                    "99999999999",
                    "-1",
                    "",
                    "trailers",
                ][..]
            )
            .prop_map(|v| v.as_bytes().to_vec()),
            hostile::string(200).prop_map(String::into_bytes),
            prop::collection::vec(any::<u8>(), 0..64),
            (4000usize..9000).prop_map(|n| vec![b'h'; n]),
        ],
    );
    let authorization = prop_oneof![
        2 => Just(None),
        6 => Just(Some(format!("Bearer {TOKEN}").into_bytes())),
        2 => prop::sample::select(&[
            "Bearer", "Bearer ", "bearer fuzz-token-3f9a", "BEARER  fuzz-token-3f9a ",
            "Bearer fuzz-token-3f9", "Bearer fuzz-token-3f9a2", "Basic ZnV6ejp4", "Bearer\tx",
            "Bearer fuzz-token-3f9a fuzz-token-3f9a",
        ][..]).prop_map(|v| Some(v.as_bytes().to_vec())),
        1 => prop::collection::vec(any::<u8>(), 0..80).prop_map(Some),
        1 => (4000usize..9000).prop_map(|n| {
            let mut v = b"Bearer ".to_vec();
            v.resize(n, b'x');
            Some(v)
        }),
    ];
    let body = prop_oneof![
        4 => call().prop_map(|d| d.json().into_bytes()),
        5 => call_body(),
        1 => Just(Vec::new()),
        // Over the limit: a valid call padded past --max-body-bytes (refused before it is parsed)
        // or exactly at it (accepted).
        1 => (call(), 1usize..MAX_BODY_BYTES, any::<bool>()).prop_map(|(doc, extra, over)| {
            let mut body = doc.json().into_bytes();
            let target = if over { MAX_BODY_BYTES + extra } else { MAX_BODY_BYTES };
            if body.len() < target {
                body.resize(target, b' ');
            }
            body
        }),
    ];
    (
        prop::sample::select(
            &[
                Listener::Plain,
                Listener::Plain,
                Listener::Protected,
                Listener::Protected,
                Listener::Admin,
            ][..],
        ),
        method,
        path,
        prop::collection::vec(header, 0..12),
        authorization,
        body,
        prop::option::weighted(0.1, 0u8..2),
        0u64..3000,
    )
        .prop_map(
            |(listener, method, uri, headers, authorization, body, failing, advance_ms)| HttpCase {
                listener,
                method,
                uri,
                headers,
                authorization,
                body,
                failing,
                advance_ms,
            },
        )
}

/// The gRPC method the sidecar serves (Envoy's rate limit service).
const GRPC_PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// A `RateLimitRequest` as Envoy's rate limit filter might send it, or a hostile one: domains of
/// the policy and others, 0 to 3 descriptors (sometimes past the 64 allowed), entries of the
/// policy's keys and values (and stream-done `settle` entries) or hostile ones, any
/// `hits_addend`, negative hits, limit overrides.
fn rate_limit_request() -> BoxedStrategy<RateLimitRequest> {
    let entry = (
        prop_oneof![
            5 => prop::sample::select(&["rule", "remote_address", "plan", "user", "app", "header_match", "settle"][..])
                .prop_map(str::to_string),
            1 => hostile::string(150),
        ],
        prop_oneof![
            3 => prop::sample::select(&["per-app", "per-ip", "trial", "per-user", "vip", "alpha", "banned", "post", "10.0.0.1", "10", "0"][..])
                .prop_map(str::to_string),
            1 => hostile::string(5000),
        ],
    )
        .prop_map(|(key, value)| DescriptorEntry { key, value });
    let descriptor = (
        prop_oneof![
            12 => prop::collection::vec(entry.clone(), 1..4),
            1 => Just(Vec::new()),
            1 => prop::collection::vec(entry, 9..12),
        ],
        prop::option::weighted(
            0.1,
            (any::<u32>(), 0i32..8).prop_map(|(requests_per_unit, unit)| RateLimitOverride {
                requests_per_unit,
                unit,
            }),
        ),
        prop::option::weighted(
            0.15,
            prop_oneof![
                0u64..4,
                Just(MAX_CAPACITY),
                Just(MAX_CAPACITY + 1),
                any::<u64>()
            ]
            .prop_map(|value| UInt64Value { value }),
        ),
        prop::bool::weighted(0.05),
    )
        .prop_map(
            |(entries, limit, hits_addend, is_negative_hits)| RateLimitDescriptor {
                entries,
                limit,
                hits_addend,
                is_negative_hits,
            },
        );
    (
        prop_oneof![
            6 => prop::sample::select(&["ratelimit", "edge"][..]).prop_map(str::to_string),
            1 => Just("nowhere".to_string()),
            1 => hostile::string(200),
        ],
        prop_oneof![
            10 => prop::collection::vec(descriptor.clone(), 1..4),
            1 => Just(Vec::new()),
            1 => prop::collection::vec(descriptor, 60..70),
        ],
        prop_oneof![Just(0u32), 1u32..4, any::<u32>()],
    )
        .prop_map(|(domain, descriptors, hits_addend)| RateLimitRequest {
            domain,
            descriptors,
            hits_addend,
        })
        .boxed()
}

/// One gRPC message: its compression flag, a 4-byte length and the message.
fn grpc_frame(compressed: bool, message: &[u8]) -> Vec<u8> {
    let mut frame = vec![u8::from(compressed)];
    frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
    frame.extend_from_slice(message);
    frame
}

/// A gRPC request body: a request's message framed, damaged or not, a garbage message, a length
/// prefix that lies (more than the body holds, 4 GiB), a compressed flag, two messages, a message
/// longer than `--max-body-bytes`, or bytes without framing.
fn grpc_body() -> BoxedStrategy<Vec<u8>> {
    prop_oneof![
        10 => rate_limit_request().prop_map(|r| grpc_frame(false, &r.encode_to_vec())),
        2 => (rate_limit_request(), prop::collection::vec((any::<usize>(), any::<u8>()), 1..4))
            .prop_map(|(r, flips)| {
                let mut m = r.encode_to_vec();
                for (at, b) in flips {
                    if !m.is_empty() {
                        let n = m.len();
                        m[at % n] = b;
                    }
                }
                grpc_frame(false, &m)
            }),
        1 => prop::collection::vec(any::<u8>(), 0..256).prop_map(|m| grpc_frame(false, &m)),
        1 => (rate_limit_request(), prop::sample::select(&[1u32, 4097, 65_536, 10 << 20, u32::MAX][..]))
            .prop_map(|(r, claimed)| {
                let m = r.encode_to_vec();
                let mut frame = vec![0u8];
                frame.extend_from_slice(&claimed.max(m.len() as u32 + 1).to_be_bytes());
                frame.extend_from_slice(&m);
                frame
            }),
        1 => rate_limit_request().prop_map(|r| grpc_frame(true, &r.encode_to_vec())),
        1 => rate_limit_request().prop_map(|r| {
            let m = grpc_frame(false, &r.encode_to_vec());
            [m.clone(), m].concat()
        }),
        1 => (1usize..4).prop_map(|k| {
            // Past --max-body-bytes: k times as many descriptors as fit.
            let d = RateLimitDescriptor {
                entries: vec![DescriptorEntry { key: "rule".into(), value: "per-app".into() }],
                ..Default::default()
            };
            let r = RateLimitRequest {
                domain: "ratelimit".into(),
                descriptors: vec![d; k * MAX_BODY_BYTES / 10],
                hits_addend: 0,
            };
            grpc_frame(false, &r.encode_to_vec())
        }),
        1 => prop::collection::vec(any::<u8>(), 0..16),
    ]
    .boxed()
}

/// A gRPC call to the sidecar's listener (the method it serves, or another of the service).
fn grpc_case() -> impl Strategy<Value = HttpCase> {
    (
        prop::sample::select(
            &[
                Listener::Plain,
                Listener::Plain,
                Listener::Protected,
                Listener::Protected,
                Listener::Admin,
            ][..],
        ),
        prop_oneof![8 => Just(Method::POST), 1 => Just(Method::GET), 1 => Just(Method::PUT)],
        prop_oneof![
            8 => Just(GRPC_PATH.to_string()),
            1 => Just("/envoy.service.ratelimit.v3.RateLimitService/Nope".to_string()),
            1 => Just("/envoy.service.ratelimit.v2.RateLimitService/ShouldRateLimit".to_string()),
        ],
        prop_oneof![
            8 => Just(vec![
                ("content-type".to_string(), b"application/grpc".to_vec()),
                ("te".to_string(), b"trailers".to_vec()),
            ]),
            1 => Just(vec![("content-type".to_string(), b"application/grpc+proto".to_vec())]),
            1 => Just(Vec::new()),
        ],
        prop_oneof![
            1 => Just(None),
            5 => Just(Some(format!("Bearer {TOKEN}").into_bytes())),
            1 => Just(Some(b"Bearer wrong".to_vec())),
        ],
        grpc_body(),
        prop::option::weighted(0.1, 0u8..2),
        0u64..3000,
    )
        .prop_map(
            |(listener, method, uri, headers, authorization, body, failing, advance_ms)| HttpCase {
                listener,
                method,
                uri,
                headers,
                authorization,
                body,
                failing,
                advance_ms,
            },
        )
}

/// The first message of a gRPC body: (compressed, declared length, the bytes there).
fn first_frame(body: &[u8]) -> Option<(bool, usize, &[u8])> {
    let (head, rest) = (body.get(..5)?, &body[5..]);
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    Some((head[0] != 0, len, &rest[..len.min(rest.len())]))
}

/// What a gRPC call must get: status 200 with `grpc-status` (in the headers when refused, in the
/// trailers once answered); nothing charged unless it is OK, nothing asked of the store when the
/// request was refused before its decision; a message over `--max-body-bytes` refused from its
/// length prefix; an answer with one status per descriptor and well-formed headers to add.
fn check_grpc(
    case: &HttpCase,
    status: StatusCode,
    grpc_status: Option<i32>,
    grpc_message: &str,
    body: &[u8],
    (applied, charged): (u64, u64),
) -> Result<(), TestCaseError> {
    prop_assert_eq!(status, StatusCode::OK, "gRPC answered HTTP {}", status);
    let Some(code) = grpc_status else {
        return Err(TestCaseError::fail("a gRPC answer without grpc-status"));
    };
    note(format!("grpc {code}"));
    prop_assert!(
        grpc_message.len() <= MAX_ERROR_BYTES,
        "grpc-message of {} bytes",
        grpc_message.len()
    );
    let frame = first_frame(&case.body);
    if let Some((false, len, _)) = frame {
        if len > MAX_BODY_BYTES && case.uri == GRPC_PATH && case.method == Method::POST {
            prop_assert_eq!(
                code,
                11,
                "a message of {} bytes was not refused as too large (OUT_OF_RANGE)",
                len
            );
        }
    }
    if code != 0 {
        prop_assert_eq!(charged, 0, "a refused gRPC call (status {}) charged", code);
        // Refused before the decision: malformed, too large, unimplemented, unauthenticated.
        if [3, 11, 12, 16].contains(&code) && !grpc_message.starts_with("domain") {
            prop_assert_eq!(
                applied,
                0,
                "a gRPC call refused with {} reached the store",
                code
            );
        }
        return Ok(());
    }
    let request = frame
        .and_then(|(_, len, m)| (m.len() == len).then_some(m))
        .and_then(|m| RateLimitRequest::decode(m).ok());
    let Some(request) = request else {
        return Err(TestCaseError::fail("OK for a body that holds no request"));
    };
    let answer = first_frame(body)
        .and_then(|(_, _, m)| RateLimitResponse::decode(m).ok())
        .ok_or_else(|| TestCaseError::fail("OK without a RateLimitResponse"))?;
    prop_assert_eq!(answer.statuses.len(), request.descriptors.len());
    let over = |c: i32| c == Code::OverLimit as i32;
    prop_assert_eq!(
        over(answer.overall_code),
        answer.statuses.iter().any(|s| over(s.code)),
        "overall {} for statuses {:?}",
        answer.overall_code,
        answer.statuses
    );
    for h in answer.response_headers_to_add.iter() {
        prop_assert!(
            ["ratelimit-policy", "ratelimit", "retry-after"].contains(&h.key.as_str()),
            "header {}",
            h.key
        );
        prop_assert!(
            h.value.bytes().all(|b| (0x20..0x7f).contains(&b)) && h.value.len() <= 64 * 1024,
            "header {}: {:?}",
            h.key,
            h.value
        );
    }
    Ok(())
}

struct Sidecar {
    store: Arc<Counting>,
    plain: Router,
    protected: Router,
    admin: Router,
}

fn sidecar() -> Sidecar {
    let metrics = Arc::new(Metrics::new());
    let policy = Policy::from_sources(
        &[
            ("limits.yaml".into(), ROUTER_POLICY.into()),
            ("edge.yaml".into(), ENVOY_POLICY.into()),
        ],
        &Bounds::default(),
    )
    .expect("the router's policy is valid");
    let store = Arc::new(Counting {
        inner: MemoryStore::new(1_700_000_000_000_000, 0.1, 10_000),
        applied: AtomicU64::new(0),
        charged: AtomicU64::new(0),
    });
    let state = Arc::new(AppState {
        decider: Arc::new(Decider::new(
            store.clone(),
            PolicyHandle::fixed(policy, metrics.clone()),
            metrics.clone(),
        )),
        metrics,
        grpc: Default::default(),
        stopping: Stopping::never(),
    });
    let metrics = state.metrics.clone();
    let app = router(state, MAX_BODY_BYTES);
    let token = Auth::load(None, Some(&Secret::new(TOKEN)))
        .expect("a valid token")
        .expect("a token is configured");
    Sidecar {
        store,
        protected: auth::protect(app.clone(), token, metrics),
        admin: auth::open_paths_only(app.clone()),
        plain: app,
    }
}

/// The request a case describes, or `None` if `http` cannot even build it (an invalid URI or
/// header a server would never hand over).
fn build(case: &HttpCase) -> Option<Request<Body>> {
    let uri: Uri = case.uri.parse().ok()?;
    let mut request = Request::builder()
        .method(case.method.clone())
        .uri(uri)
        .body(Body::from(case.body.clone()))
        .ok()?;
    let headers = request.headers_mut();
    for (n, v) in &case.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(n.as_bytes()),
            HeaderValue::from_bytes(v),
        ) {
            headers.append(n, v);
        }
    }
    if let Some(a) = &case.authorization {
        if let Ok(v) = HeaderValue::from_bytes(a) {
            headers.insert("authorization", v);
        }
    }
    Some(request)
}

const OPEN_PATHS: [&str; 3] = ["/healthz", "/readyz", "/metrics"];

#[test]
fn fuzz_http() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let sidecar = sidecar();
    fuzz("sidecar.http", 500, http_case(), |case| {
        let Some(request) = build(&case) else {
            return Ok(());
        };
        let path = request.uri().path().to_string();
        let authorized = request
            .headers()
            .get("authorization")
            .is_some_and(|v| v.as_bytes() == format!("Bearer {TOKEN}").as_bytes());
        let router = match case.listener {
            Listener::Plain => sidecar.plain.clone(),
            Listener::Protected => sidecar.protected.clone(),
            Listener::Admin => sidecar.admin.clone(),
        };
        let store = &sidecar.store;
        store.inner.advance_ms(case.advance_ms);
        *store.inner.fail.lock().expect("not poisoned") = case.failing.map(|f| match f {
            0 => StoreError::Redis("connection refused".into()),
            _ => StoreError::Script("WRONGTYPE".into()),
        });
        let applied = store.applied.load(Ordering::SeqCst);
        let charged = store.charged.load(Ordering::SeqCst);
        let started = Instant::now();
        // The request runs in a task of its own, so a handler that blocked its worker would
        // still let the other worker fire the timeout.
        let answered = rt.block_on(async {
            let task = tokio::spawn(async move {
                let response = router.oneshot(request).await.expect("infallible");
                let (parts, body) = response.into_parts();
                let body = body.collect().await;
                (parts, body)
            });
            tokio::time::timeout(Duration::from_secs(10), task).await
        });
        let elapsed = started.elapsed();
        let (parts, body) = match answered {
            Err(_) => return Err(TestCaseError::fail("no answer within 10 s")),
            Ok(Err(join)) => {
                return Err(TestCaseError::fail(format!("the request panicked: {join}")))
            }
            Ok(Ok((parts, body))) => (parts, body),
        };
        let collected = body.map_err(|e| TestCaseError::fail(format!("unreadable body: {e}")))?;
        let trailers = collected.trailers().cloned().unwrap_or_default();
        let body = collected.to_bytes();
        // gRPC: `grpc-status` in the headers (refused at once) or in the trailers (answered).
        let grpc_field = |name: &str| {
            parts
                .headers
                .get(name)
                .or_else(|| trailers.get(name))
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let grpc_status = grpc_field("grpc-status").and_then(|v| v.parse::<i32>().ok());
        let grpc_message = grpc_field("grpc-message").unwrap_or_default();
        prop_assert!(
            elapsed < Duration::from_secs(5),
            "answered after {elapsed:?}"
        );
        let status = parts.status;
        let applied = store.applied.load(Ordering::SeqCst) - applied;
        let charged = store.charged.load(Ordering::SeqCst) - charged;
        note(status.as_u16().to_string());
        if charged > 0 {
            note("charged");
        }
        let refused_by_grpc_auth = grpc_status == Some(16);
        let json_error = || -> Result<String, TestCaseError> {
            let ct = parts
                .headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            prop_assert!(
                ct.starts_with("application/json"),
                "{status} with content-type {ct:?}"
            );
            let e: ErrorBody = serde_json::from_slice(&body).map_err(|e| {
                TestCaseError::fail(format!(
                    "{status}: body {:?} is not an error: {e}",
                    String::from_utf8_lossy(&body)
                ))
            })?;
            check_error_message(&e.error).or_else(|_| {
                // Errors that are not about a call's fields (paths, methods, credentials, the
                // store): bounded too, and not empty.
                prop_assert!(
                    !e.error.is_empty() && e.error.len() <= MAX_ERROR_BYTES,
                    "{}",
                    e.error
                );
                Ok(())
            })?;
            Ok(e.error)
        };
        // Well-formed: a status the router may use, JSON errors for every 4xx and 5xx.
        prop_assert!(
            [200, 400, 401, 404, 405, 413, 500, 503].contains(&status.as_u16()),
            "status {status}"
        );
        if case.method == Method::HEAD {
            prop_assert!(body.is_empty(), "a body for HEAD");
        } else if status.as_u16() >= 400 {
            json_error()?;
        }
        // A refused call is never charged; one refused before the decision never reaches the store.
        if status != StatusCode::OK || refused_by_grpc_auth {
            prop_assert_eq!(charged, 0, "a refused call ({}) charged", status);
        }
        if status.is_client_error() || refused_by_grpc_auth {
            prop_assert_eq!(applied, 0, "a refused call ({}) reached the store", status);
        }
        // What each listener answers.
        let open = OPEN_PATHS.contains(&path.as_str());
        let decide_path = path == ratelimit_wire::DECIDE_PATH;
        if case.listener == Listener::Protected && !open {
            if !authorized && !refused_by_grpc_auth {
                let plausible = case
                    .authorization
                    .as_deref()
                    .is_some_and(|a| String::from_utf8_lossy(a).contains(TOKEN));
                prop_assert!(
                    plausible || status == StatusCode::UNAUTHORIZED,
                    "{status} without the token"
                );
            }
            if status == StatusCode::UNAUTHORIZED {
                prop_assert!(parts.headers.get("www-authenticate").is_some());
                return Ok(());
            }
            if refused_by_grpc_auth {
                return Ok(());
            }
        }
        if case.listener == Listener::Admin && !open {
            prop_assert_eq!(status, StatusCode::NOT_FOUND);
            return Ok(());
        }
        if path.starts_with("/envoy.service.ratelimit.v3.RateLimitService/") {
            return check_grpc(
                &case,
                status,
                grpc_status,
                &grpc_message,
                &body,
                (applied, charged),
            );
        }
        if open {
            let expected = if matches!(case.method, Method::GET | Method::HEAD) {
                StatusCode::OK
            } else {
                StatusCode::METHOD_NOT_ALLOWED
            };
            prop_assert_eq!(status, expected);
            return Ok(());
        }
        if !decide_path {
            prop_assert_eq!(status, StatusCode::NOT_FOUND, "{}", path);
            return Ok(());
        }
        if case.method != Method::POST {
            prop_assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
            return Ok(());
        }
        if case.body.len() > MAX_BODY_BYTES {
            prop_assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
            return Ok(());
        }
        let call = match parse_request(&case.body) {
            Err(DecideError::Invalid(e)) => {
                prop_assert_eq!(status, StatusCode::BAD_REQUEST);
                prop_assert_eq!(json_error()?, e);
                return Ok(());
            }
            Ok(call) => call,
        };
        if status != StatusCode::OK {
            prop_assert!(case.failing.is_some(), "{status} from a working store");
            return Ok(());
        }
        let answer: DecideResponse = serde_json::from_slice(&body).map_err(|e| {
            TestCaseError::fail(format!(
                "200 with {:?}: {e}",
                String::from_utf8_lossy(&body)
            ))
        })?;
        prop_assert_eq!(answer.answers.len(), call.requests.len());
        for (a, r) in answer.answers.iter().zip(&call.requests) {
            match &a.error {
                Some(e) => {
                    prop_assert!(!a.allowed && a.results.is_empty());
                    prop_assert!(e.message.len() <= MAX_ERROR_BYTES);
                }
                None => {
                    prop_assert_eq!(a.results.len(), r.decisions.len());
                    prop_assert_eq!(a.allowed, a.results.iter().all(|x| x.allowed));
                    for x in &a.results {
                        if let Some(l) = &x.limit {
                            prop_assert!(x.remaining <= l.capacity);
                            prop_assert!(is_name(&l.name), "limit name {:?}", l.name);
                        }
                        prop_assert!(!x.allowed || x.retry_after_ms == 0 || x.shadow);
                    }
                }
            }
        }
        Ok(())
    });
}

/// A method a path does not serve is answered 405 with a JSON error, on every path.
#[tokio::test]
async fn a_wrong_method_is_a_json_405_on_every_path() {
    let sidecar = sidecar();
    for (method, path) in [
        (Method::GET, ratelimit_wire::DECIDE_PATH),
        (Method::POST, "/healthz"),
        (Method::DELETE, "/readyz"),
        (Method::PUT, "/metrics"),
    ] {
        for router in [sidecar.plain.clone(), sidecar.admin.clone()] {
            let request = Request::builder()
                .method(method.clone())
                .uri(path)
                .header("authorization", format!("Bearer {TOKEN}"))
                .body(Body::empty())
                .expect("a request");
            let response = router.oneshot(request).await.expect("infallible");
            if path == ratelimit_wire::DECIDE_PATH && response.status() == StatusCode::NOT_FOUND {
                continue; // the admin listener does not serve it at all
            }
            assert_eq!(
                response.status(),
                StatusCode::METHOD_NOT_ALLOWED,
                "{method} {path}"
            );
            let body = axum::body::to_bytes(response.into_body(), 1 << 16)
                .await
                .expect("a body");
            let e: ErrorBody = serde_json::from_slice(&body)
                .unwrap_or_else(|e| panic!("{method} {path}: {e}: {body:?}"));
            assert_eq!(e.error, "method not allowed");
        }
    }
}

/// A body that never ends is refused once it passes `--max-body-bytes`: read up to the limit (not
/// buffered whole), answered 413 before anything is parsed, the store never asked.
#[tokio::test]
async fn an_endless_body_is_refused_at_the_limit() {
    let sidecar = sidecar();
    let pulled = Arc::new(AtomicU64::new(0));
    let counter = pulled.clone();
    let chunk = axum::body::Bytes::from(vec![b' '; 1000]);
    let endless = futures::stream::repeat_with(move || {
        counter.fetch_add(1000, Ordering::SeqCst);
        Ok::<_, std::io::Error>(chunk.clone())
    });
    for router in [sidecar.plain.clone(), sidecar.protected.clone()] {
        pulled.store(0, Ordering::SeqCst);
        let request = Request::post(ratelimit_wire::DECIDE_PATH)
            .header("authorization", format!("Bearer {TOKEN}"))
            .body(Body::from_stream(endless.clone()))
            .expect("a request");
        let response = tokio::time::timeout(Duration::from_secs(10), router.oneshot(request))
            .await
            .expect("answered within 10 s")
            .expect("infallible");
        assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let read = pulled.load(Ordering::SeqCst);
        assert!(read <= MAX_BODY_BYTES as u64 + 2000, "{read} bytes read");
    }
    assert_eq!(sidecar.store.applied.load(Ordering::SeqCst), 0);
}

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME_BYTES
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// What `Policy::from_sources` must do with any document: every problem located in its file, or
/// a policy whose every limit (found by probing it with the document's own words) is within its
/// bounds.
fn check_policy(doc_words: &[String], text: &str) -> Result<(), TestCaseError> {
    let bounds = Bounds::default();
    let started = Instant::now();
    let result = Policy::from_sources(&[("limits.yaml".into(), text.to_string())], &bounds);
    // Linear in the text (generous enough for a debug build on a busy machine): an alias that
    // expands, or nesting that recurses, shows as far more.
    let allowed = Duration::from_secs(1) + Duration::from_micros(50) * text.len() as u32;
    prop_assert!(
        started.elapsed() < allowed,
        "{:?} to read {} bytes",
        started.elapsed(),
        text.len()
    );
    match result {
        Err(e) => {
            note("refused");
            prop_assert!(!e.problems.is_empty());
            for p in &e.problems {
                prop_assert!(p.path.starts_with("limits.yaml"), "problem at {:?}", p.path);
                prop_assert!(!p.message.is_empty());
            }
            let shown = e.to_string();
            prop_assert!(
                shown.len() <= 10 * text.len() + 512 * e.problems.len(),
                "{} bytes of error for {} bytes of policy",
                shown.len(),
                text.len()
            );
        }
        Ok(policy) => {
            note("accepted");
            let domains: Vec<String> = policy.domains().map(str::to_string).collect();
            prop_assert_eq!(domains.len(), 1);
            for d in &domains {
                prop_assert!(!d.is_empty() && d.len() <= MAX_NAME_BYTES, "domain {d:?}");
            }
            let words: Vec<&str> = doc_words.iter().map(String::as_str).take(16).collect();
            let mut probes: Vec<Vec<(&str, Option<&str>)>> = Vec::new();
            for w in &words {
                probes.push(vec![("rule", Some(w))]);
                probes.push(vec![(w, None)]);
                for v in words.iter().take(4) {
                    probes.push(vec![(w, Some(v))]);
                    probes.push(vec![("rule", Some(w)), (v, None)]);
                    for x in words.iter().take(4) {
                        probes.push(vec![("rule", Some(w)), (v, Some(x))]);
                        probes.push(vec![(w, Some(v)), (x, None)]);
                    }
                }
            }
            for d in &domains {
                for p in &probes {
                    if let Resolution::Limit(l) = policy.resolve(d, p) {
                        note("limit found");
                        prop_assert!(is_name(&l.name), "limit name {:?}", l.name);
                        if let LimitKind::Bucket {
                            capacity,
                            refill_per_sec,
                        } = l.kind
                        {
                            prop_assert!((1..=MAX_CAPACITY).contains(&capacity));
                            prop_assert!(refill_per_sec.is_finite() && refill_per_sec > 0.0);
                            prop_assert!(capacity as f64 / refill_per_sec <= bounds.max_refill_s);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// YAML that expands: each level's anchor is a list of `width` aliases of the level below.
fn alias_bomb() -> impl Strategy<Value = String> {
    (1usize..12, 2usize..12, any::<bool>()).prop_map(|(levels, width, own)| {
        let mut out = String::from("domain: bomb\n");
        out.push_str("l0: &l0 [\"x\"]\n");
        for l in 1..=levels {
            let refs = vec![format!("*l{}", l - 1); width].join(", ");
            out.push_str(&format!("l{l}: &l{l} [{refs}]\n"));
        }
        if own {
            out.push_str(&format!("rules: {{r: {{capacity: 1, refill_per_sec: 1, overrides: [{{when: {{a: *l{levels}}}, capacity: 1, refill_per_sec: 1}}]}}}}\n"));
        } else {
            out.push_str(&format!("descriptors: *l{levels}\n"));
        }
        out
    })
}

#[test]
fn fuzz_policy_bytes() {
    let text = prop_oneof![
        4 => hostile::bytes(2048).prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        1 => alias_bomb(),
        1 => (1usize..300).prop_map(|depth| format!("rules: {}1{}", "[".repeat(depth), "]".repeat(depth))),
        1 => (1usize..300).prop_map(|depth| format!("descriptors:\n{}", (0..depth).map(|i| format!("{}- key: k\n{}  descriptors:\n", " ".repeat(4 * i), " ".repeat(4 * i))).collect::<String>())),
    ];
    fuzz("sidecar.policy.bytes", 300, text, |text| {
        check_policy(&[], &text)
    });
}

/// A document of YAML as a [`Doc`].
fn yaml_doc(text: &str) -> Doc {
    let v: Value = serde_yaml_ng::from_str(text).expect("a valid policy document");
    Doc::from_value(&v)
}

/// A mutated policy written as block YAML or as JSON (which YAML reads too).
fn policy_text(seed: impl Strategy<Value = Doc> + 'static) -> impl Strategy<Value = (Doc, String)> {
    (hostile::mutated(seed, 4, 3000), any::<bool>()).prop_map(|((doc, damage), yaml)| {
        let text = if yaml { doc.yaml() } else { doc.json() };
        let text = damage.apply(text.into_bytes());
        (doc, String::from_utf8_lossy(&text).into_owned())
    })
}

/// A valid document of this sidecar's format: rules with buckets, unlimited or blocked limits,
/// overrides, shadow mode.
fn own_policy() -> impl Strategy<Value = Doc> {
    let limit = prop_oneof![
        4 => (1u64..=1000, 1u32..1000).prop_map(|(c, r)| vec![
            ("capacity".to_string(), Doc::Num(c.to_string())),
            ("refill_per_sec".to_string(), Doc::Num(r.to_string())),
        ]),
        1 => Just(vec![("unlimited".to_string(), Doc::Bool(true))]),
        1 => Just(vec![("blocked".to_string(), Doc::Bool(true))]),
    ];
    let override_ = (
        prop::sample::select(DIMENSIONS),
        prop::option::of(prop::sample::select(VALUES)),
        prop::option::of("[A-Za-z0-9_.-]{1,20}"),
        limit.clone(),
    )
        .prop_map(|(k, v, name, mut limit)| {
            let mut o = vec![(
                "when".to_string(),
                Doc::Obj(vec![(
                    k.to_string(),
                    v.map_or(Doc::Null, |v| Doc::Str(v.into())),
                )]),
            )];
            if let Some(n) = name {
                o.push(("name".into(), Doc::Str(n)));
            }
            o.append(&mut limit);
            Doc::Obj(o)
        });
    let rule = (
        "[A-Za-z0-9_.-]{1,24}",
        limit,
        any::<bool>(),
        prop::collection::vec(override_, 0..3),
    )
        .prop_map(|(name, mut o, shadow, overrides)| {
            if shadow {
                o.push(("shadow_mode".into(), Doc::Bool(true)));
            }
            if !overrides.is_empty() {
                o.push(("overrides".into(), Doc::Arr(overrides)));
            }
            (name, Doc::Obj(o))
        });
    (
        prop::option::of("[A-Za-z0-9_.-]{1,24}"),
        prop::collection::btree_map("[A-Za-z0-9_.-]{1,24}", rule, 1..5),
    )
        .prop_map(|(domain, rules)| {
            let mut o = Vec::new();
            if let Some(d) = domain {
                o.push(("domain".to_string(), Doc::Str(d)));
            }
            o.push(("rules".into(), Doc::Obj(rules.into_values().collect())));
            Doc::Obj(o)
        })
}

#[test]
fn fuzz_policy_own() {
    let shipped = yaml_doc(LIMITS_YAML);
    let seed = prop_oneof![1 => Just(shipped), 2 => own_policy()];
    fuzz(
        "sidecar.policy.own",
        500,
        policy_text(seed),
        |(doc, text)| {
            let mut words = Vec::new();
            doc.strings(&mut words);
            check_policy(&words, &text)
        },
    );
}

/// A valid document of envoyproxy/ratelimit's format: a tree of descriptors, some with limits.
fn envoy_policy() -> impl Strategy<Value = Doc> {
    let rate_limit = prop_oneof![
        4 => (
            prop::sample::select(&["second", "minute", "HOUR", "day", "week", "month", "year"][..]),
            0u64..1000,
            prop::option::of("[A-Za-z0-9_.-]{1,20}"),
        )
            .prop_map(|(unit, rpu, name)| {
                let mut o = vec![
                    ("unit".to_string(), Doc::Str(unit.into())),
                    ("requests_per_unit".to_string(), Doc::Num(rpu.to_string())),
                ];
                if let Some(n) = name {
                    o.push(("name".into(), Doc::Str(n)));
                }
                Doc::Obj(o)
            }),
        1 => Just(Doc::Obj(vec![("unlimited".into(), Doc::Bool(true))])),
    ];
    let leaf = (
        prop::sample::select(
            &[
                "remote_address",
                "rule",
                "user",
                "header_match",
                "generic_key",
            ][..],
        ),
        prop::option::of(prop::sample::select(
            &["per-user", "root", "bot-*", "post", "alpha"][..],
        )),
        prop::option::of(rate_limit),
        any::<bool>(),
    )
        .prop_map(|(key, value, rl, shadow)| {
            let mut o = vec![("key".to_string(), Doc::Str(key.into()))];
            if let Some(v) = value {
                o.push(("value".into(), Doc::Str(v.into())));
            }
            if let Some(rl) = rl {
                o.push(("rate_limit".into(), rl));
            }
            if shadow {
                o.push(("shadow_mode".into(), Doc::Bool(true)));
            }
            Doc::Obj(o)
        });
    let tree = leaf.prop_recursive(3, 16, 3, |inner| {
        (inner.clone(), prop::collection::vec(inner, 1..3)).prop_map(|(node, children)| {
            let Doc::Obj(mut o) = node else { return node };
            o.push(("descriptors".into(), Doc::Arr(children)));
            Doc::Obj(o)
        })
    });
    ("[A-Za-z0-9_.-]{1,24}", prop::collection::vec(tree, 1..4)).prop_map(|(domain, d)| {
        Doc::Obj(vec![
            ("domain".into(), Doc::Str(domain)),
            ("descriptors".into(), Doc::Arr(d)),
        ])
    })
}

#[test]
fn fuzz_policy_envoy() {
    let shipped = yaml_doc(ENVOY_POLICY);
    let seed = prop_oneof![1 => Just(shipped), 2 => envoy_policy()];
    fuzz(
        "sidecar.policy.envoy",
        400,
        policy_text(seed),
        |(doc, text)| {
            let mut words = Vec::new();
            doc.strings(&mut words);
            check_policy(&words, &text)
        },
    );
}

/// A bucket's name: a domain and descriptor entries.
type Named = (String, Vec<(String, Option<String>)>);

fn named() -> impl Strategy<Value = Named> {
    let value = prop_oneof![
        2 => prop::sample::select(VALUES).prop_map(str::to_string),
        3 => hostile::string(6000),
    ];
    (
        prop_oneof![Just("ratelimit".to_string()), hostile::string(128)],
        prop::collection::vec(
            (
                prop_oneof![
                    prop::sample::select(DIMENSIONS).prop_map(str::to_string),
                    hostile::string(128)
                ],
                prop::option::weighted(0.8, value),
            ),
            0..=MAX_SUBJECT_ENTRIES + 1,
        ),
    )
}

/// Small edits of a name that might collide with it if the encoding were careless.
fn edited(n: &Named, edit: u8, at: usize, s: &str) -> Named {
    let (mut domain, mut entries) = n.clone();
    let pick = |len: usize| if len == 0 { 0 } else { at % len };
    match edit % 8 {
        0 => domain.push_str(s),
        1 if !entries.is_empty() => {
            let i = pick(entries.len());
            entries[i].1 = match &entries[i].1 {
                None => Some("~".into()),
                Some(v) if v.is_empty() => None,
                Some(v) => Some(format!("{v}{s}")),
            };
        }
        2 if entries.len() >= 2 => {
            // Merge two entries into one whose value holds the separators.
            let i = pick(entries.len() - 1);
            let (k2, v2) = entries.remove(i + 1);
            let v1 = entries[i].1.clone().unwrap_or_default();
            entries[i].1 = Some(format!("{v1}|{k2}={}", v2.unwrap_or_default()));
        }
        3 if !entries.is_empty() => {
            let i = pick(entries.len());
            entries[i].0.push_str(s);
        }
        4 => entries.push((s.to_string(), None)),
        5 if entries.len() >= 2 => {
            let i = pick(entries.len() - 1);
            entries.swap(i, i + 1);
        }
        6 if !entries.is_empty() => {
            // A value just across the length at which it is hashed.
            let i = pick(entries.len());
            let c = s.chars().next().unwrap_or('v');
            entries[i].1 = Some(c.to_string().repeat(KEY_VALUE_BYTES + at % 3));
        }
        _ => domain = format!("{s}{domain}"),
    }
    (domain, entries)
}

fn key_of(prefix: &str, (domain, entries): &Named) -> String {
    let e: Vec<(&str, Option<&str>)> = entries
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_deref()))
        .collect();
    bucket_key(prefix, domain, &e)
}

#[test]
fn fuzz_keys() {
    fuzz(
        "sidecar.keys",
        600,
        (
            prop::sample::select(&["rl:", "", "ratelimit:v2:"][..]),
            named(),
            prop::collection::vec((any::<u8>(), any::<usize>(), hostile::string(90)), 1..4),
            hostile::string(200),
        ),
        |(prefix, name, edits, attempt)| {
            let key = key_of(prefix, &name);
            if key.contains('#') {
                note("hashed");
            }
            // Bounded: the domain and dimension names escaped (3 bytes a byte at most), every
            // value within `=` and 80 bytes, or `#` and a 64-byte hash.
            let (domain, entries) = &name;
            let bound = prefix.len()
                + 2
                + 3 * domain.len()
                + entries
                    .iter()
                    .map(|(k, _)| 1 + 3 * k.len() + 1 + KEY_VALUE_BYTES)
                    .sum::<usize>();
            prop_assert!(key.len() <= bound, "{} bytes, bound {bound}", key.len());
            // One hash tag, the whole name inside it.
            prop_assert_eq!(key.matches('{').count(), 1);
            prop_assert_eq!(key.matches('}').count(), 1);
            let opening = format!("{prefix}{{");
            prop_assert!(key.starts_with(&opening) && key.ends_with('}'), "{}", key);
            prop_assert!(key.is_ascii() && !key.bytes().any(|b| b.is_ascii_control() || b == b' '));
            // A record shares its bucket's slot, whatever the attempt id (the hash tag is never
            // empty: a call names a domain of 1 byte or more).
            if !(domain.is_empty() && entries.is_empty()) {
                let record = record_key(&key, &attempt);
                prop_assert_eq!(
                    cluster_slot(record.as_bytes()),
                    cluster_slot(key.as_bytes())
                );
            }
            // Injective: a different name gives a different key.
            for (edit, at, s) in &edits {
                let other = edited(&name, *edit, *at, s);
                let other_key = key_of(prefix, &other);
                prop_assert_eq!(
                    other == name,
                    other_key == key,
                    "{:?} and {:?}: {}",
                    name,
                    other,
                    key
                );
            }
            Ok(())
        },
    );
}
