//! Fuzz targets of the filter: every parser an outsider's bytes reach, fed arbitrary bytes and
//! near-valid structures, each asserting no panic and the documented outcome. `docs/fuzzing.md`
//! says what each feeds; `FUZZ_CASES` (or `FUZZ_CASES_<TARGET>`) sets how many inputs.
//!
//! - `filter.config.*`: the plugin configuration (`Config::from_json`);
//! - `filter.identity`: the facts Envoy hands over (`identity::resolve`, `parse_source_address`,
//!   `text`, `app_for_key`);
//! - `filter.rules`: path, method and headers of a request (`rules::matching`, `needs`, `plan`),
//!   and the callout those decisions make;
//! - `filter.answer.*`: the sidecar's answer (`verdict::parse_answer`, `check_answer`,
//!   `from_answer`);
//! - `filter.fastpath`, `filter.emergency`: the shared-data entries every worker reads back.

// Native only: proptest is a native dev-dependency (the wasm32 runs cover the unit tests).
#![cfg(not(target_arch = "wasm32"))]

#[path = "../../fuzz/harness.rs"]
mod harness;
#[path = "../../fuzz/hostile.rs"]
mod hostile;

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use harness::{fuzz, note};
use hostile::Doc;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use ratelimit_filter::config::MAX_IDENTITY_BYTES;
use ratelimit_filter::config::{
    self, ApiKey, Config, Dimension, Identity, Jwt, RateLimitHeaders, UnknownPolicy, MAX_CAPACITY,
    MAX_RULES, MAX_RULE_NAME_BYTES, MAX_SF_INTEGER,
};
use ratelimit_filter::emergency::{EmergencyBucket, State};
use ratelimit_filter::fastpath::{
    self, DecisionOutcome, Entry, KnownLimit, Learned, Lease, Probe, ProbeFor, RejectionCause,
    Table,
};
use ratelimit_filter::identity::{self, Facts, Subject};
use ratelimit_filter::rules::{self, RequestFacts, MAX_KEY_VALUE_BYTES};
use ratelimit_filter::shared::{SharedDataError, SharedStore};
use ratelimit_filter::verdict::{self, LeasedAdmit, LimiterError, Verdict};
use ratelimit_wire::{
    DecideRequest, Decision, RequestDecisions, MAX_DECISIONS, MAX_NAME_BYTES, MAX_SUBJECT_ENTRIES,
    MAX_VALUE_BYTES,
};
use serde_json::{json, Value};

/// The shipped Envoy config, whose wasm `configuration` is the plugin JSON mutated below.
const ENVOY_YAML: &str = include_str!("../../envoy/envoy.yaml");

/// The longest error a limiter failure carries (`LimiterError`'s text, logged per request).
const MAX_LIMITER_ERROR_BYTES: usize = 1024;

/// The longest bucket id (`<domain>/<rule>|<dimension>=<value>|...`): a domain of 128 bytes, `/`,
/// and the 504 bytes `rules::MAX_KEY_VALUE_BYTES` documents (a rule name of 64 bytes and five
/// dimensions of `|`, at most 6 bytes of name, `=` or `#`, and at most 80 bytes of value).
const MAX_ID_BYTES: usize = 128 + 1 + MAX_RULE_NAME_BYTES + 5 * (1 + 6 + 1 + MAX_KEY_VALUE_BYTES);

/// API keys the generated configurations know (by their SHA-256).
const KEYS: &[&str] = &["alpha-key", "beta-key", "\u{e9}\u{1f600}", "k"];

/// Header names the generated rules match on.
const HEADER_NAMES: &[&str] = &[
    "x-tier",
    "X-Canary",
    "content-type",
    "x-api-key",
    ":authority",
];

/// The plugin JSON of `envoy/envoy.yaml` (the block under `value: |`).
fn shipped_plugin_json() -> Value {
    let lines: Vec<&str> = ENVOY_YAML.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.trim() == "value: |")
        .expect("envoy.yaml has the plugin configuration under `value: |`");
    let indent = |l: &str| l.len() - l.trim_start().len();
    let depth = indent(lines[start]);
    let text: Vec<&str> = lines[start + 1..]
        .iter()
        .take_while(|l| l.trim().is_empty() || indent(l) > depth)
        .copied()
        .collect();
    serde_json::from_str(&text.join("\n")).expect("the shipped plugin configuration is JSON")
}

/// The fields a configuration error may name at its root.
const CONFIG_FIELDS: &[&str] = &[
    "configuration",
    "domain",
    "sidecar",
    "identity",
    "rules",
    "rate_limit_headers",
    "stat_prefix",
    "fast_paths",
];

/// What `Config::from_json` must do with any input: an error naming each problem's field, or a
/// configuration within every documented bound.
fn check_config(
    input: &[u8],
    result: &Result<Config, config::ConfigError>,
) -> Result<(), TestCaseError> {
    match result {
        Err(e) => {
            note("refused");
            prop_assert!(!e.problems.is_empty(), "an error without a problem");
            for p in &e.problems {
                let root = p.path.split(['.', '[']).next().unwrap_or("");
                // serde also reads a struct from an array, by position: such errors name the
                // position (`[0]`), the field's place in that form.
                prop_assert!(
                    CONFIG_FIELDS.contains(&root)
                        || p.path.starts_with('[')
                        || p.message.starts_with("unknown field"),
                    "problem at {:?} names no field: {}",
                    p.path,
                    p.message
                );
                prop_assert!(
                    !p.message.is_empty(),
                    "problem at {:?} says nothing",
                    p.path
                );
            }
            // An error echoes what it refuses, escaped: at most ~10 bytes per input byte, plus
            // the fixed text of each problem.
            let text = e.to_string();
            prop_assert!(
                text.len() <= 10 * input.len() + 512 * e.problems.len(),
                "{} bytes of error for {} bytes of input",
                text.len(),
                input.len()
            );
        }
        Ok(c) => {
            note("accepted");
            check_config_bounds(c)?
        }
    }
    Ok(())
}

fn is_name(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// Every bound the README and `config` document for an accepted configuration.
fn check_config_bounds(c: &Config) -> Result<(), TestCaseError> {
    prop_assert!(
        c.validate().is_ok(),
        "accepted but invalid: {:?}",
        c.validate()
    );
    prop_assert!(is_name(&c.domain, 128), "domain {:?}", c.domain);
    prop_assert!(is_name(&c.stat_prefix, 128));
    prop_assert!((1..=config::MAX_TIMEOUT_MS).contains(&c.sidecar.timeout_ms));
    prop_assert!(!c.sidecar.cluster.trim().is_empty());
    prop_assert!((1..=128).contains(&c.identity.ipv6_prefix_len));
    prop_assert!((1..=MAX_RULES).contains(&c.rules.len()));
    prop_assert!((1..=ratelimit_wire::MAX_REQUESTS).contains(&c.fast_paths.max_batch));
    prop_assert!((1..=1 << 20).contains(&c.fast_paths.slots));
    let mut names = std::collections::BTreeSet::new();
    for r in &c.rules {
        prop_assert!(
            is_name(&r.name, MAX_RULE_NAME_BYTES),
            "rule name {:?}",
            r.name
        );
        prop_assert!(names.insert(&r.name), "duplicate rule {:?}", r.name);
        prop_assert!((1..=MAX_CAPACITY).contains(&r.cost.tokens()));
        prop_assert!(matches!(r.unknown_status, 401 | 429));
        prop_assert!(r.matcher.path_prefix.starts_with('/'));
        for h in &r.matcher.headers {
            prop_assert_eq!(&h.name, &h.name.to_ascii_lowercase());
        }
        let mut dims = r.subject.clone();
        dims.sort();
        dims.dedup();
        prop_assert_eq!(dims.len(), r.subject.len(), "a dimension twice");
        match (&r.on_error, &r.emergency) {
            (config::FailurePolicy::Local, Some(e)) => {
                prop_assert!((r.cost.tokens()..=MAX_CAPACITY).contains(&e.capacity));
                prop_assert!(e.refill_per_sec.is_finite() && e.refill_per_sec > 0.0);
                prop_assert!(e.capacity as f64 / e.refill_per_sec <= config::MAX_REFILL_S);
            }
            (config::FailurePolicy::Local, None) => prop_assert!(false, "local without emergency"),
            (_, e) => prop_assert!(e.is_none(), "emergency without local"),
        }
    }
    Ok(())
}

#[test]
fn fuzz_config_bytes() {
    fuzz("filter.config.bytes", 600, hostile::bytes(2048), |bytes| {
        check_config(&bytes, &Config::from_json(&bytes))
    });
}

/// A header value, in a rule's condition or a request: often one both draw from, so conditions
/// hold now and then.
fn header_value() -> BoxedStrategy<String> {
    prop_oneof![
        Just("gold".to_string()),
        Just("canary-1".to_string()),
        hostile::string(40),
    ]
    .boxed()
}

/// One rule of a valid configuration, without its name: a name suffix and the rule.
fn valid_rule() -> BoxedStrategy<(String, Value)> {
    (
        "[A-Za-z0-9_.-]{0,60}",
        prop::sample::select(&["/", "/api/", "/a", "/api/v1/orders", "/\u{e9}", "//"][..]),
        prop::option::of(prop::sample::subsequence(
            &["GET", "POST", "PUT", "DELETE", "HEAD", "M-SEARCH"][..],
            1..=3,
        )),
        prop_oneof![
            Just(Vec::new()),
            prop::collection::vec(
                (
                    prop::sample::select(HEADER_NAMES),
                    0..3u8,
                    header_value(),
                    any::<bool>(),
                ),
                1..3,
            ),
        ],
        prop::sample::subsequence(&["user", "tenant", "app", "ip", "route"][..], 0..=5)
            .prop_shuffle(),
        prop_oneof![1u64..=3, 1u64..=MAX_CAPACITY],
        prop::sample::select(&["skip", "shared", "reject"][..]),
        prop::sample::select(&[401u32, 429][..]),
        prop::sample::select(&["allow", "deny", "local"][..]),
        (0u64..1000, 1u32..1000),
    )
        .prop_map(
            |(
                suffix,
                prefix,
                methods,
                hdrs,
                subject,
                cost,
                unknown,
                status,
                on_error,
                (extra, refill),
            )| {
                let conditions: Vec<Value> = hdrs
                    .into_iter()
                    .map(|(n, kind, value, present)| match kind {
                        0 => json!({"name": n, "exact": value}),
                        1 => json!({"name": n, "prefix": value}),
                        _ => json!({"name": n, "present": present}),
                    })
                    .collect();
                let mut m = json!({"path_prefix": prefix, "headers": conditions});
                if let Some(methods) = methods {
                    m["methods"] = json!(methods);
                }
                let mut r = json!({
                    "match": m, "subject": subject, "cost": cost,
                    "on_unknown": unknown, "unknown_status": status, "on_error": on_error,
                });
                if on_error == "local" {
                    let capacity = cost.saturating_add(extra).min(MAX_CAPACITY);
                    // A full refill within the year the configuration allows.
                    let refill = (capacity as f64 / 31_000_000.0).max(f64::from(refill));
                    r["emergency"] = json!({"capacity": capacity, "refill_per_sec": refill});
                }
                (suffix, r)
            },
        )
        .boxed()
}

/// A valid configuration (every one is checked by `filter.rules`): every identity source, 1 to
/// 8 rules (sometimes [`MAX_RULES`]) of random match, subject, cost and policies.
fn valid_config() -> impl Strategy<Value = Value> {
    (
        prop_oneof![Just("ratelimit".to_string()), "[A-Za-z0-9_.-]{1,128}"],
        prop_oneof![
            4 => prop::collection::vec(valid_rule(), 1..=8),
            1 => prop::collection::vec(valid_rule(), MAX_RULES..=MAX_RULES),
        ],
        1u8..=128,
        prop::sample::select(&["always", "on_reject", "never"][..]),
    )
        .prop_map(|(domain, rules, ipv6_prefix_len, headers)| {
            let rules: Vec<Value> = rules
                .into_iter()
                .enumerate()
                .map(|(i, (suffix, mut r))| {
                    // `r<i>-` keeps names distinct (no index is a prefix of another's `r<j>-`)
                    // and within the bound after the cut.
                    let mut name = format!("r{i}-{suffix}");
                    name.truncate(MAX_RULE_NAME_BYTES);
                    r["name"] = json!(name);
                    r
                })
                .collect();
            // One request matching every rule must fit a call (`rules`): at most 24 claims and
            // route names in all (each up to 1 KiB), the later rules' dropped past them.
            let mut long = 0;
            let rules: Vec<Value> = rules
                .into_iter()
                .map(|mut r| {
                    if let Some(subject) = r["subject"].as_array_mut() {
                        subject.retain(|d| {
                            let is_long = matches!(d.as_str(), Some("user" | "tenant" | "route"));
                            long += usize::from(is_long);
                            !is_long || long <= 24
                        });
                    }
                    r
                })
                .collect();
            let keys: serde_json::Map<String, Value> = KEYS
                .iter()
                .enumerate()
                .map(|(i, k)| (identity::sha256_hex(k.as_bytes()), json!(format!("app{i}"))))
                .collect();
            json!({
                "domain": domain,
                "sidecar": {"cluster": "ratelimit_sidecar", "timeout_ms": 50},
                "identity": {
                    "api_key": {"header": "x-api-key", "keys": keys},
                    "jwt": {"provider": "example", "user_claim": "sub", "tenant_claim": "tenant"},
                    "ip": true,
                    "ipv6_prefix_len": ipv6_prefix_len,
                },
                "rules": rules,
                "rate_limit_headers": headers,
            })
        })
}

#[test]
fn fuzz_config_mutated() {
    let shipped = Doc::from_value(&shipped_plugin_json());
    let seed = prop_oneof![
        1 => Just(shipped),
        2 => valid_config().prop_map(|v| Doc::from_value(&v)),
    ];
    fuzz(
        "filter.config.mutated",
        200,
        hostile::mutated(seed, 4, 3000),
        |(doc, damage)| {
            let text = damage.apply(doc.json().into_bytes());
            check_config(&text, &Config::from_json(&text))
        },
    );
}

/// A `source.address` as Envoy might report it, or nearly.
fn address() -> BoxedStrategy<String> {
    let v4 = any::<[u8; 4]>().prop_map(|b| Ipv4Addr::from(b).to_string());
    let v6 = any::<u128>().prop_map(|b| Ipv6Addr::from(b).to_string());
    let mapped = any::<[u8; 4]>().prop_map(|b| Ipv4Addr::from(b).to_ipv6_mapped().to_string());
    let ip = prop_oneof![v4.clone(), v6.clone(), mapped];
    prop_oneof![
        (v4, any::<u16>()).prop_map(|(a, p)| format!("{a}:{p}")),
        (ip.clone(), any::<u16>()).prop_map(|(a, p)| format!("[{a}]:{p}")),
        ip.clone().prop_map(|a| format!("[{a}]")),
        ip.clone(),
        (ip.clone(), hostile::string(12)).prop_map(|(a, junk)| format!("{a}{junk}")),
        (hostile::string(12), ip.clone()).prop_map(|(junk, a)| format!("{junk}{a}")),
        (v6, "[a-z0-9]{1,8}").prop_map(|(a, zone)| format!("[{a}%{zone}]:80")),
        ip.prop_map(|a| format!(" \t{a}\n ")),
        Just("pipe:/var/run/envoy.sock".to_string()),
        "[0-9a-fA-F:.\\[\\]%]{0,48}",
    ]
    .boxed()
}

/// One fact: absent, hostile text, arbitrary bytes, a known key, an address, or about the
/// longest identity accepted.
fn fact() -> BoxedStrategy<Option<Vec<u8>>> {
    prop_oneof![
        1 => Just(None),
        2 => hostile::string(6000).prop_map(|s| Some(s.into_bytes())),
        2 => prop::collection::vec(any::<u8>(), 0..64).prop_map(Some),
        1 => prop::sample::select(KEYS).prop_map(|k| Some(k.as_bytes().to_vec())),
        2 => address().prop_map(|a| Some(a.into_bytes())),
        1 => (MAX_IDENTITY_BYTES - 2..MAX_IDENTITY_BYTES + 2).prop_map(|n| Some(vec![b'u'; n])),
    ]
    .boxed()
}

fn facts() -> BoxedStrategy<Facts> {
    (fact(), fact(), fact(), fact(), fact())
        .prop_map(
            |(api_key, jwt_user, jwt_tenant, source_address, route_name)| Facts {
                api_key,
                jwt_user,
                jwt_tenant,
                source_address,
                route_name,
            },
        )
        .boxed()
}

/// Identity settings, including a prefix length validation would refuse (0, > 128).
fn identity_settings() -> impl Strategy<Value = Identity> {
    (any::<bool>(), 0u8..3, any::<bool>(), any::<u8>()).prop_map(|(api, jwt, ip, prefix)| {
        Identity {
            api_key: api.then(|| ApiKey {
                header: "x-api-key".into(),
                keys: KEYS
                    .iter()
                    .enumerate()
                    .map(|(i, k)| (identity::sha256_hex(k.as_bytes()), format!("app{i}")))
                    .collect(),
            }),
            jwt: (jwt > 0).then(|| Jwt {
                provider: "example".into(),
                user_claim: "sub".into(),
                tenant_claim: (jwt > 1).then(|| "tenant".into()),
            }),
            ip,
            ipv6_prefix_len: prefix,
        }
    })
}

/// A value taken as an identity: non-empty text without control characters, within the bound.
fn check_text(value: &Option<String>, from: &Option<Vec<u8>>) -> Result<(), TestCaseError> {
    if let Some(v) = value {
        prop_assert!(!v.is_empty() && v.len() <= MAX_IDENTITY_BYTES);
        prop_assert!(
            !v.chars().any(char::is_control),
            "control character in {v:?}"
        );
        prop_assert_eq!(Some(v.as_bytes()), from.as_deref());
    }
    Ok(())
}

#[test]
fn fuzz_identity() {
    fuzz(
        "filter.identity",
        600,
        (identity_settings(), facts(), hostile::bytes(128)),
        |(settings, facts, raw)| {
            let s = identity::resolve(&settings, &facts);
            for (known, what) in [
                (&s.app, "app"),
                (&s.user, "user"),
                (&s.ip, "ip"),
                (&s.route, "route"),
            ] {
                if known.is_some() {
                    note(what);
                }
            }
            // A source that is not configured names no one.
            prop_assert!(settings.api_key.is_some() || s.app.is_none());
            prop_assert!(settings.jwt.is_some() || s.user.is_none());
            prop_assert!(
                settings
                    .jwt
                    .as_ref()
                    .and_then(|j| j.tenant_claim.as_ref())
                    .is_some()
                    || s.tenant.is_none()
            );
            prop_assert!(settings.ip || s.ip.is_none());
            check_text(&s.user, &facts.jwt_user)?;
            check_text(&s.tenant, &facts.jwt_tenant)?;
            check_text(&s.route, &facts.route_name)?;
            // An app only for a key whose hash is configured.
            if let Some(app) = &s.app {
                let key = facts.api_key.as_deref().unwrap_or_default();
                prop_assert!(
                    KEYS.iter().any(|k| k.as_bytes() == key),
                    "{app} for {key:?}"
                );
            }
            if let Some(ip) = &s.ip {
                let len = settings.ipv6_prefix_len.clamp(1, 128);
                let ok = match ip.split_once('/') {
                    None => ip.parse::<Ipv4Addr>().is_ok(),
                    Some((net, l)) => net.parse::<Ipv6Addr>().is_ok() && l == len.to_string(),
                };
                prop_assert!(ok && ip.len() <= 43, "ip {ip:?}");
            }
            // The parts on their own, on arbitrary bytes.
            for bytes in [
                &raw[..],
                facts.source_address.as_deref().unwrap_or_default(),
            ] {
                if let Some(ip) = identity::parse_source_address(bytes) {
                    if let IpAddr::V6(v6) = ip {
                        prop_assert!(v6.to_ipv4_mapped().is_none(), "mapped {v6} kept as IPv6");
                    }
                    for len in [0, 1, 64, 127, 128, 129, 255] {
                        prop_assert!(identity::ip_key(ip, len).len() <= 43);
                    }
                }
                check_text(&identity::text(bytes), &Some(bytes.to_vec()))?;
                let keys = settings
                    .api_key
                    .as_ref()
                    .map(|k| k.keys.clone())
                    .unwrap_or_default();
                let app = identity::app_for_key(&keys, bytes);
                prop_assert_eq!(
                    app.is_some(),
                    !bytes.is_empty() && keys.contains_key(&identity::sha256_hex(bytes))
                );
            }
            Ok(())
        },
    );
}

/// The parts of a request `match` looks at: hostile paths (query strings, fragments, NUL,
/// non-UTF-8, up to 64 KiB), methods, and up to 120 headers with huge values.
fn request_facts() -> BoxedStrategy<RequestFacts> {
    let path = prop_oneof![
        3 => (
            prop::sample::select(&["/", "/api/", "/api/v1/orders", "/a", "//api/", "/\u{e9}", ""][..]),
            hostile::string(64),
            prop::sample::select(&["", "?", "?a=1&b", "#frag", "?x#y", "\0"][..]),
        )
            .prop_map(|(p, rest, q)| format!("{p}{rest}{q}").into_bytes()),
        1 => prop::collection::vec(any::<u8>(), 0..256),
        1 => (60_000usize..66_000).prop_map(|n| {
            let mut p = b"/api/".to_vec();
            p.resize(n, b'a');
            p
        }),
    ];
    let method = prop_oneof![
        3 => prop::sample::select(&["GET", "POST", "PUT", "DELETE", "HEAD", "M-SEARCH"][..])
            .prop_map(|m| m.as_bytes().to_vec()),
        1 => prop::sample::select(&["get", "", "GET ", "CONNECT", "G\0ET"][..])
            .prop_map(|m| m.as_bytes().to_vec()),
        1 => prop::collection::vec(any::<u8>(), 0..40),
    ];
    let name = prop_oneof![
        prop::sample::select(HEADER_NAMES).prop_map(|n| n.to_ascii_lowercase()),
        "[a-z0-9-]{1,20}",
        hostile::string(40),
    ];
    let value = prop_oneof![
        2 => header_value().prop_map(String::into_bytes),
        3 => hostile::string(256).prop_map(String::into_bytes),
        1 => prop::collection::vec(any::<u8>(), 0..64),
        1 => (60_000usize..70_000).prop_map(|n| vec![b'v'; n]),
    ];
    (
        path,
        method,
        // As pairs collected into the map (a later value replaces an earlier one of the same
        // name): a map strategy with a minimum size would redraw until its names are distinct.
        prop_oneof![
            3 => prop::collection::vec((name.clone(), value.clone()), 0..8),
            1 => prop::collection::vec((name, value), 100..120),
        ],
    )
        .prop_map(|(path, method, headers)| RequestFacts {
            path,
            method,
            headers: headers.into_iter().collect(),
        })
        .boxed()
}

#[test]
fn fuzz_rules() {
    let config = valid_config().prop_map(|v| {
        let text = v.to_string();
        (Config::from_json(text.as_bytes()), text)
    });
    fuzz(
        "filter.rules",
        100,
        (config, request_facts(), facts(), facts()),
        |((config, text), request, facts_a, facts_b)| {
            let config = match config {
                Ok(c) => c,
                Err(e) => {
                    return Err(TestCaseError::fail(format!(
                        "a valid configuration was refused: {e}\n{text}"
                    )))
                }
            };
            check_config_bounds(&config)?;
            let matched = rules::matching(&config, &request);
            prop_assert!(matched.windows(2).all(|w| w[0] < w[1]), "not in rule order");
            for (i, rule) in config.rules.iter().enumerate() {
                prop_assert_eq!(
                    rules::matches(&rule.matcher, &request),
                    matched.contains(&i)
                );
            }
            for &i in &matched {
                let m = &config.rules[i].matcher;
                let path = request
                    .path
                    .split(|b| *b == b'?' || *b == b'#')
                    .next()
                    .unwrap_or_default();
                prop_assert!(path.starts_with(m.path_prefix.as_bytes()));
                if let Some(methods) = &m.methods {
                    prop_assert!(methods.iter().any(|x| x.as_bytes() == request.method));
                }
            }
            if !matched.is_empty() {
                note("matched");
            }
            let needs = rules::needs(&config, &matched);
            let used = |d: Dimension| {
                matched
                    .iter()
                    .any(|&i| config.rules[i].subject.contains(&d))
            };
            prop_assert_eq!(
                (needs.user, needs.tenant, needs.app, needs.ip, needs.route),
                (
                    used(Dimension::User),
                    used(Dimension::Tenant),
                    used(Dimension::App),
                    used(Dimension::Ip),
                    used(Dimension::Route)
                )
            );
            let a = identity::resolve(&config.identity, &facts_a);
            let b = identity::resolve(&config.identity, &facts_b);
            let plan_a = rules::plan(&config, &matched, &a);
            let plan_b = rules::plan(&config, &matched, &b);
            note(if plan_a.planned.is_empty() {
                "no decision"
            } else {
                "decisions"
            });
            if plan_a.reject.is_some() {
                note("rejected unknown");
            }
            for (plan, subject) in [(&plan_a, &a), (&plan_b, &b)] {
                check_plan(&config, &matched, subject, plan)?;
            }
            // Ids tell buckets apart: equal ids exactly for equal rule and subject values.
            for pa in &plan_a.planned {
                for pb in &plan_b.planned {
                    let same = pa.rule == pb.rule && pa.subject == pb.subject;
                    prop_assert_eq!(same, pa.id == pb.id, "{} vs {}", pa.id, pb.id);
                }
            }
            Ok(())
        },
    );
}

/// A plan stays within what the sidecar accepts: at most `MAX_DECISIONS` decisions, ids within
/// [`MAX_ID_BYTES`], subjects within the wire's bounds, and its callout serialises and reads back.
fn check_plan(
    config: &Config,
    matched: &[usize],
    subject: &Subject,
    plan: &rules::Plan,
) -> Result<(), TestCaseError> {
    prop_assert!(plan.planned.len() <= matched.len());
    prop_assert!(plan.planned.len() <= MAX_DECISIONS);
    let mut unknown_seen = false;
    let mut first_reject = None;
    for &i in matched {
        let rule = &config.rules[i];
        let unknown = rule.subject.iter().any(|d| subject.get(*d).is_none());
        unknown_seen |= unknown;
        let planned = plan.planned.iter().find(|p| p.rule == i);
        match (unknown, rule.on_unknown) {
            (true, UnknownPolicy::Skip) => prop_assert!(planned.is_none()),
            (true, UnknownPolicy::Reject) => {
                prop_assert!(planned.is_none());
                first_reject.get_or_insert(i);
            }
            _ => prop_assert!(planned.is_some(), "rule {} not planned", rule.name),
        }
    }
    prop_assert_eq!(plan.subject_unknown, unknown_seen);
    prop_assert_eq!(plan.reject, first_reject);
    let mut decisions = Vec::new();
    for p in &plan.planned {
        let rule = &config.rules[p.rule];
        prop_assert!(
            p.id.len() <= MAX_ID_BYTES,
            "id of {} bytes: {}",
            p.id.len(),
            p.id
        );
        let start = format!("{}/{}", config.domain, rule.name);
        prop_assert!(
            p.id.starts_with(&start),
            "{} does not start with {}",
            p.id,
            start
        );
        prop_assert!(!p.id.contains(['{', '}', '\n', '\0']), "{}", p.id);
        prop_assert_eq!(p.cost, rule.cost.tokens());
        prop_assert!(p.subject.0.len() <= MAX_SUBJECT_ENTRIES);
        let dims: Vec<&str> = p.subject.iter().map(|(d, _)| d).collect();
        let expected: Vec<&str> = rule.subject.iter().map(|d| d.as_str()).collect();
        prop_assert_eq!(dims, expected);
        for (d, v) in p.subject.iter() {
            prop_assert!(!d.is_empty() && d.len() <= MAX_NAME_BYTES);
            prop_assert!(
                v.is_none_or(|v| v.len() <= MAX_VALUE_BYTES),
                "value over the wire bound"
            );
        }
        decisions.push(Decision {
            receipt: false,
            rule: rule.name.clone(),
            subject: p.subject.clone(),
            cost: p.cost,
            lease: None,
        });
    }
    if !decisions.is_empty() {
        let call = DecideRequest {
            domain: config.domain.clone(),
            // Filter callouts carry no attempt id.
            attempt: None,
            requests: vec![RequestDecisions { decisions }],
            returns: Vec::new(),
        };
        let body = serde_json::to_vec(&call).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let back: DecideRequest =
            serde_json::from_slice(&body).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(back, call);
    }
    Ok(())
}

/// The shipped configuration, with its rate-limit headers set to `headers`.
fn shipped_config(headers: RateLimitHeaders) -> Config {
    let mut c = Config::from_json(shipped_plugin_json().to_string().as_bytes())
        .expect("the shipped configuration is valid");
    c.rate_limit_headers = headers;
    c
}

/// What the filter sends back to a client: a field value an HTTP codec can carry (visible ASCII,
/// spaces and tabs inside), of bounded length.
fn check_field_value(name: &str, value: &str) -> Result<(), TestCaseError> {
    prop_assert!(
        value
            .bytes()
            .all(|b| b == b'\t' || (0x20..0x7f).contains(&b)),
        "header {name}: {value:?} is not a field value"
    );
    prop_assert!(
        value.trim() == value,
        "header {name}: {value:?} has outer whitespace"
    );
    prop_assert!(
        value.len() <= 64 * 1024,
        "header {name}: {} bytes",
        value.len()
    );
    Ok(())
}

/// `"name";k=N;k=N, ...`: RFC 8941 strings and integers (within [`MAX_SF_INTEGER`]).
fn check_sf_list(name: &str, value: &str, params: &[&str]) -> Result<(), TestCaseError> {
    let mut rest = value;
    loop {
        let Some(body) = rest.strip_prefix('"') else {
            return Err(TestCaseError::fail(format!("{name}: {value:?}: no string")));
        };
        // An sf-string: printable ASCII, `\"` and `\\` escaped.
        let mut end = None;
        let mut escaped = false;
        for (i, c) in body.char_indices() {
            match (escaped, c) {
                (true, '"' | '\\') => escaped = false,
                (true, _) => {
                    return Err(TestCaseError::fail(format!(
                        "{name}: bad escape in {value:?}"
                    )))
                }
                (false, '\\') => escaped = true,
                (false, '"') => {
                    end = Some(i);
                    break;
                }
                (false, c) if (' '..='~').contains(&c) => {}
                _ => {
                    return Err(TestCaseError::fail(format!(
                        "{name}: {c:?} in a string: {value:?}"
                    )))
                }
            }
        }
        let Some(end) = end else {
            return Err(TestCaseError::fail(format!(
                "{name}: unterminated string in {value:?}"
            )));
        };
        rest = &body[end + 1..];
        for p in params {
            let Some(after) = rest.strip_prefix(&format!(";{p}=")) else {
                return Err(TestCaseError::fail(format!("{name}: no {p} in {value:?}")));
            };
            let digits = after.bytes().take_while(u8::is_ascii_digit).count();
            let n: u64 = after[..digits]
                .parse()
                .map_err(|_| TestCaseError::fail(format!("{name}: {p} in {value:?}")))?;
            prop_assert!(n <= MAX_SF_INTEGER && digits <= 15, "{name}: {p}={n}");
            rest = &after[digits..];
        }
        if rest.is_empty() {
            return Ok(());
        }
        rest = rest
            .strip_prefix(", ")
            .ok_or_else(|| TestCaseError::fail(format!("{name}: junk {rest:?} in {value:?}")))?;
    }
}

/// A verdict the host can send: a 429 with a JSON body naming one of `rules` and well-formed
/// headers, or an admission with well-formed rate-limit headers.
fn check_verdict(v: &Verdict, rules: &[&str]) -> Result<(), TestCaseError> {
    let headers = match v {
        Verdict::Admit { headers } => {
            for (n, _) in headers {
                prop_assert!(
                    n == "ratelimit-policy" || n == "ratelimit",
                    "admit header {n}"
                );
            }
            headers
        }
        Verdict::Reject(reply) => {
            prop_assert_eq!(reply.status, 429);
            let body: Value = serde_json::from_str(&reply.body)
                .map_err(|e| TestCaseError::fail(format!("body {:?}: {e}", reply.body)))?;
            prop_assert!(body["error"].is_string());
            let rule = body["rule"].as_str().unwrap_or_default();
            prop_assert!(
                rules.contains(&rule),
                "rule {rule:?} is not one of {rules:?}"
            );
            prop_assert_eq!(&reply.details, &format!("ratelimit_rejected:{rule}"));
            if let Some(s) = body.get("retry_after_s") {
                let s = s.as_u64().unwrap_or(0);
                prop_assert!((1..=MAX_SF_INTEGER).contains(&s), "retry_after_s {s}");
            }
            for (n, v) in &reply.headers {
                prop_assert!(
                    [
                        "content-type",
                        "retry-after",
                        "ratelimit-policy",
                        "ratelimit"
                    ]
                    .contains(&n.as_str()),
                    "reject header {n}"
                );
                if n == "retry-after" {
                    let s: u64 = v
                        .parse()
                        .map_err(|_| TestCaseError::fail(format!("retry-after {v:?}")))?;
                    prop_assert!((1..=MAX_SF_INTEGER).contains(&s));
                }
            }
            &reply.headers
        }
    };
    for (n, v) in headers {
        check_field_value(n, v)?;
        match n.as_str() {
            "ratelimit-policy" => check_sf_list(n, v, &["q", "w"])?,
            "ratelimit" => check_sf_list(n, v, &["r", "t"])?,
            _ => {}
        }
    }
    Ok(())
}

fn check_limiter_error(e: &LimiterError) -> Result<(), TestCaseError> {
    note(match e {
        LimiterError::NoAnswer => "no answer",
        LimiterError::Status(_) => "status",
        LimiterError::Malformed(_) => "malformed",
        LimiterError::Count { .. } => "count",
        LimiterError::Results { .. } => "results",
        LimiterError::Inconsistent { .. } => "inconsistent",
        LimiterError::Request { .. } => "request error",
        LimiterError::Dispatch(_) => "dispatch",
    });
    let text = e.to_string();
    prop_assert!(
        text.len() <= MAX_LIMITER_ERROR_BYTES,
        "a limiter error of {} bytes: {}...",
        text.len(),
        &text[..text.char_indices().nth(80).map_or(text.len(), |(i, _)| i)]
    );
    Ok(())
}

#[test]
fn fuzz_answer_bytes() {
    let status = prop_oneof![
        Just(None),
        Just(Some(b"200".to_vec())),
        prop::sample::select(&["503", "429", "20", "2000", "200 ", "", "abc"][..])
            .prop_map(|s| Some(s.as_bytes().to_vec())),
        prop::collection::vec(any::<u8>(), 0..600).prop_map(Some),
    ];
    fuzz(
        "filter.answer.bytes",
        600,
        (status, hostile::bytes(2048), 0usize..300),
        |(status, body, expected)| {
            match verdict::parse_answer(status.as_deref(), &body, expected) {
                Ok(a) => {
                    note("parsed");
                    prop_assert_eq!(a.answers.len(), expected)
                }
                Err(e) => check_limiter_error(&e)?,
            }
            Ok(())
        },
    );
}

/// A number for a field the filter reads as `u64` (or `f64`), in range or not.
fn number() -> impl Strategy<Value = Doc> {
    prop_oneof![
        3 => (0u64..2000).prop_map(|n| Doc::Num(n.to_string())),
        2 => any::<u64>().prop_map(|n| Doc::Num(n.to_string())),
        1 => prop::sample::select(hostile::NUMBERS).prop_map(|n| Doc::Num(n.to_string())),
    ]
}

/// A limit name: usually the policy's kind, sometimes anything a broken sidecar could send.
fn limit_name() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[A-Za-z0-9_.-]{1,128}",
        2 => hostile::string(3000),
    ]
}

/// One result as the sidecar might send it (numbers anywhere in their range).
fn result_doc() -> impl Strategy<Value = Doc> {
    (
        any::<bool>(),
        number(),
        number(),
        number(),
        prop::sample::select(
            &[
                "ok",
                "insufficient",
                "cost_exceeds_capacity",
                "blocked",
                "unlimited",
            ][..],
        ),
        prop::option::of((limit_name(), number(), number())),
        any::<bool>(),
        number(),
    )
        .prop_map(
            |(allowed, remaining, retry, reset, reason, limit, shadow, leased)| {
                let mut o = vec![
                    ("allowed".to_string(), Doc::Bool(allowed)),
                    ("remaining".to_string(), remaining),
                    ("retry_after_ms".to_string(), retry),
                    ("reset_ms".to_string(), reset),
                    ("reason".to_string(), Doc::Str(reason.into())),
                ];
                if let Some((name, capacity, refill)) = limit {
                    o.push((
                        "limit".into(),
                        Doc::Obj(vec![
                            ("name".into(), Doc::Str(name)),
                            ("capacity".into(), capacity),
                            ("refill_per_sec".into(), refill),
                        ]),
                    ));
                }
                o.push(("shadow".into(), Doc::Bool(shadow)));
                o.push(("leased".into(), leased));
                Doc::Obj(o)
            },
        )
}

/// An answer to a call of `requests` requests of `decisions` decisions each: mostly results
/// (allowed or not), sometimes a request's error.
fn answer_doc() -> impl Strategy<Value = (Doc, usize, usize)> {
    (1usize..4, 1usize..4).prop_flat_map(|(requests, decisions)| {
        let answer = prop_oneof![
            4 => prop::collection::vec(result_doc(), decisions..=decisions).prop_map(|results| {
                let allowed = results.iter().all(|r| matches!(r, Doc::Obj(o) if o[0].1 == Doc::Bool(true)));
                Doc::Obj(vec![
                    ("allowed".into(), Doc::Bool(allowed)),
                    ("results".into(), Doc::Arr(results)),
                ])
            }),
            1 => (
                prop::sample::select(&["unknown_rule", "unavailable", "script_failed"][..]),
                hostile::string(5000),
            )
                .prop_map(|(code, message)| Doc::Obj(vec![
                    ("allowed".into(), Doc::Bool(false)),
                    ("error".into(), Doc::Obj(vec![
                        ("code".into(), Doc::Str(code.into())),
                        ("message".into(), Doc::Str(message)),
                    ])),
                ])),
        ];
        (
            prop::collection::vec(answer, requests..=requests)
                .prop_map(|a| Doc::Obj(vec![("answers".into(), Doc::Arr(a))])),
            Just(requests),
            Just(decisions),
        )
    })
}

/// Leases the gateway admitted from, with the limits their shared-data entries hold: any limit
/// written there, as `Entry::decode` reads it back.
fn leased() -> impl Strategy<Value = Vec<(Option<KnownLimit>, u64)>> {
    prop::collection::vec(
        (
            prop::option::of((limit_name(), any::<u64>(), any::<f64>())),
            any::<u64>(),
        )
            .prop_map(|(limit, lease_tokens)| {
                let mut e = Entry::decode(&empty_entry("id")).expect("an empty entry");
                e.limit = limit.map(|(name, capacity, refill_per_sec)| KnownLimit {
                    name,
                    capacity,
                    refill_per_sec,
                });
                let read = Entry::decode(&e.encode()).and_then(|e| e.limit);
                (read, lease_tokens)
            }),
        0..3,
    )
}

/// The encoding of an entry of `id` with nothing learned yet.
fn empty_entry(id: &str) -> Vec<u8> {
    Entry {
        id: id.into(),
        limit: None,
        reject_cost: 0,
        reject_until_ns: 0,
        reject_local_until_ns: 0,
        reject_cause: RejectionCause::Insufficient,
        reject_epoch: 0,
        lease: Lease::default(),
        next: Lease::default(),
        renewing_until_ns: 0,
        ask_rtt_ns: 0,
        retired: Lease::default(),
    }
    .encode()
}

#[test]
fn fuzz_answer_mutated() {
    let configs = [
        shipped_config(RateLimitHeaders::Always),
        shipped_config(RateLimitHeaders::OnReject),
        shipped_config(RateLimitHeaders::Never),
    ];
    let rules = ["per-app", "per-ip", "per-app"];
    fuzz(
        "filter.answer.mutated",
        500,
        (
            answer_doc().prop_flat_map(|(doc, requests, decisions)| {
                (
                    Just(doc.clone()),
                    hostile::mutated(Just(doc), 2, 2000),
                    Just(requests),
                    Just(decisions),
                    any::<bool>(),
                )
            }),
            0usize..3,
            leased(),
        ),
        |((doc, (mutated, damage), requests, decisions, mutate), which, leases)| {
            // Half the inputs are the answer as generated (hostile values in valid shapes), half
            // mutated.
            let body = if mutate {
                damage.apply(mutated.json().into_bytes())
            } else {
                doc.json().into_bytes()
            };
            let parsed = match verdict::parse_answer(Some(b"200"), &body, requests) {
                Ok(p) => p,
                Err(e) => return check_limiter_error(&e),
            };
            prop_assert_eq!(parsed.answers.len(), requests);
            let leased: Vec<LeasedAdmit<'_>> = leases
                .iter()
                .map(|(limit, lease_tokens)| LeasedAdmit {
                    limit: limit.as_ref(),
                    lease_tokens: *lease_tokens,
                })
                .collect();
            for a in &parsed.answers {
                match verdict::check_answer(a, decisions) {
                    Err(e) => check_limiter_error(&e)?,
                    Ok(()) => {
                        let v =
                            verdict::from_answer(&configs[which], a, &rules[..decisions], &leased);
                        note(if matches!(v, Verdict::Admit { .. }) {
                            "admit"
                        } else {
                            "429"
                        });
                        check_verdict(&v, &rules)?;
                        // An answer that admits every decision admits the request.
                        prop_assert_eq!(matches!(v, Verdict::Admit { .. }), a.allowed);
                    }
                }
            }
            Ok(())
        },
    );
}

/// Shared data in memory, with compare-and-swap versions.
#[derive(Default)]
struct Memory(RefCell<HashMap<String, (Vec<u8>, u32)>>);

impl SharedStore for Memory {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        match self.0.borrow().get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedDataError> {
        let mut data = self.0.borrow_mut();
        let current = data.get(key).map(|(_, c)| *c);
        if cas.is_some() && cas != current {
            return Err(SharedDataError::CasMismatch);
        }
        data.insert(
            key.to_string(),
            (value.to_vec(), current.unwrap_or(0).wrapping_add(1)),
        );
        Ok(())
    }
}

fn entry() -> impl Strategy<Value = Entry> {
    (
        "[ -~]{0,80}",
        prop::option::of((hostile::string(200), any::<u64>(), any::<f64>())),
        any::<[u64; 3]>(),
        0u8..3,
        any::<[[u64; 6]; 3]>(),
        any::<[u64; 2]>(),
    )
        .prop_map(
            |(
                id,
                limit,
                [reject_cost, reject_until_ns, reject_local_until_ns],
                cause,
                leases,
                [renewing_until_ns, ask_rtt_ns],
            )| {
                let [lease, next, retired] = leases.map(
                    |[id, tokens, until_ns, granted, granted_ns, started_ns]| Lease {
                        id,
                        tokens,
                        until_ns,
                        granted,
                        granted_ns,
                        started_ns,
                        // A few epochs, so that some match the table's.
                        epoch: started_ns % 3,
                    },
                );
                Entry {
                    id,
                    limit: limit.map(|(name, capacity, refill_per_sec)| KnownLimit {
                        name,
                        capacity,
                        refill_per_sec,
                    }),
                    reject_cost,
                    reject_until_ns,
                    reject_local_until_ns,
                    reject_cause: [
                        RejectionCause::Insufficient,
                        RejectionCause::CostExceedsCapacity,
                        RejectionCause::Blocked,
                    ][usize::from(cause)],
                    reject_epoch: reject_cost % 3,
                    lease,
                    next,
                    renewing_until_ns,
                    ask_rtt_ns,
                    retired,
                }
            },
        )
}

/// What the fast paths might be asked with any figures an answer carries.
#[derive(Debug, Clone)]
enum TableOp {
    Learn(Learned, u64, u64),
    Probe(u64, u64, ProbeFor, Option<u64>),
    GiveBack(u64, u64, u64),
    Begin(u64, u64),
}

fn table_op() -> impl Strategy<Value = TableOp> {
    let outcome = prop_oneof![
        Just(DecisionOutcome::Admitted),
        Just(DecisionOutcome::NotDecided),
        (0u8..3, any::<u64>()).prop_map(|(w, retry_after_ms)| DecisionOutcome::Rejected {
            cause: [
                RejectionCause::Insufficient,
                RejectionCause::CostExceedsCapacity,
                RejectionCause::Blocked
            ][usize::from(w)],
            retry_after_ms,
        }),
    ];
    prop_oneof![
        (
            any::<u64>(),
            prop::option::of((limit_name(), any::<u64>(), any::<f64>())),
            outcome,
            prop::option::of(any::<(u64, u64)>()),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
        )
            .prop_map(|(cost, limit, outcome, asked_lease, leased, at, now)| {
                TableOp::Learn(
                    Learned {
                        cost,
                        limit: limit.map(|(name, capacity, refill_per_sec)| KnownLimit {
                            name,
                            capacity,
                            refill_per_sec,
                        }),
                        outcome,
                        asked_lease,
                        leased,
                        epoch: at % 3,
                    },
                    at,
                    now,
                )
            }),
        (
            any::<(u64, u64, Option<u64>)>(),
            prop_oneof![
                Just(ProbeFor::Both),
                Just(ProbeFor::Leases),
                Just(ProbeFor::KnownRejections)
            ]
        )
            .prop_map(|((c, n, renew), paths)| TableOp::Probe(c, n, paths, renew)),
        any::<(u64, u64, u64)>().prop_map(|(l, c, now)| TableOp::GiveBack(l, c, now)),
        any::<(u64, u64)>().prop_map(|(n, u)| TableOp::Begin(n, u)),
    ]
}

#[test]
fn fuzz_fastpath() {
    let always = shipped_config(RateLimitHeaders::Always);
    let input = prop_oneof![
        hostile::bytes(512),
        (
            entry(),
            prop::collection::vec((any::<usize>(), any::<u8>()), 0..4),
            any::<u16>()
        )
            .prop_map(|(e, flips, cut)| {
                let mut bytes = e.encode();
                for (at, b) in flips {
                    let n = bytes.len();
                    bytes[at % n] = b;
                }
                if cut % 4 == 0 {
                    bytes.truncate(usize::from(cut) % (bytes.len() + 1));
                }
                bytes
            }),
    ];
    fuzz(
        "filter.fastpath",
        1000,
        (
            input,
            prop::collection::vec(table_op(), 0..6),
            any::<u64>(),
            1usize..8,
        ),
        |(bytes, ops, now_ns, slots)| {
            if let Some(e) = Entry::decode(&bytes) {
                note("decoded");
                prop_assert!(
                    e.id.len() + e.limit.as_ref().map_or(0, |l| l.name.len()) <= bytes.len()
                );
                prop_assert!(e.limit.as_ref().is_none_or(|l| l.refill_per_sec.is_finite()
                    && l.refill_per_sec > 0.0
                    && verdict::is_limit_name(&l.name)));
                prop_assert_eq!(Entry::decode(&e.encode()), Some(e.clone()));
                let _ = e.rejection(now_ns, now_ns, now_ns % 3);
                let _ = e.lease_pays(now_ns, now_ns, now_ns % 3);
                // What the gateway answers from the entry alone: a known rejection, or an
                // admission from its lease, with headers from the limit it holds.
                let reply = verdict::known_rejection(
                    &always,
                    "per-app",
                    e.limit.as_ref(),
                    e.reject_cause,
                    now_ns,
                );
                check_verdict(&Verdict::Reject(reply), &["per-app"])?;
                let leased = [LeasedAdmit {
                    limit: e.limit.as_ref(),
                    lease_tokens: e.lease.tokens,
                }];
                check_verdict(&verdict::from_leases(&always, &leased), &["per-app"])?;
            }
            // The table over a slot holding those bytes: every operation, any figures.
            let store = Memory::default();
            let id = "ratelimit/per-app|app=alpha";
            store
                .0
                .borrow_mut()
                .insert(fastpath::slot_key(id, slots), (bytes, 1));
            let table = Table {
                store: &store,
                slots,
                max_rejection_ns: now_ns / 3,
                epoch: now_ns % 3,
            };
            for op in &ops {
                // Another bucket's entry, live when the operation runs, keeps its slot.
                let op_now = match op {
                    TableOp::Learn(_, _, now)
                    | TableOp::Probe(_, now, ..)
                    | TableOp::GiveBack(_, _, now)
                    | TableOp::Begin(now, _) => *now,
                };
                let (before, _) = store.get(&fastpath::slot_key(id, slots));
                let kept = before.clone().filter(|b| {
                    Entry::decode(b).is_some_and(|e| e.id != id && e.live(op_now, table.epoch))
                });
                match op {
                    TableOp::Learn(l, at, now) => table.learn(id, l, *at, *now),
                    TableOp::Probe(cost, now, paths, renew) => {
                        let (rejections, lease) = (paths.known_rejections(), paths.leases());
                        // The lease that pays: the one in use, else the next one taking over.
                        let held = table.get(id);
                        let before = held.as_ref().map_or(0, |e| {
                            if e.lease_pays(*cost, *now, table.epoch) {
                                e.lease.tokens
                            } else {
                                e.next.tokens
                            }
                        });
                        match table.probe(id, *cost, *now, *paths, *renew) {
                            Probe::Taken {
                                tokens_left, limit, ..
                            } => {
                                prop_assert!(lease, "a lease taken when leases are off");
                                prop_assert_eq!(
                                    tokens_left,
                                    before - cost,
                                    "a take took other than its cost"
                                );
                                prop_assert_eq!(
                                    table.get(id).map_or(0, |e| e.lease.tokens),
                                    tokens_left
                                );
                                prop_assert!(limit.is_none_or(|l| verdict::is_limit_name(&l.name)));
                            }
                            Probe::Rejected { left_ns, limit, .. } => {
                                prop_assert!(rejections && left_ns > 0);
                                prop_assert!(limit.is_none_or(|l| verdict::is_limit_name(&l.name)));
                            }
                            Probe::Renew { .. } => {
                                prop_assert!(lease && renew.is_some(), "a renewal not asked for");
                                let after = table.get(id);
                                prop_assert_eq!(
                                    after.as_ref().map(|e| e.lease.tokens),
                                    held.as_ref().map(|_| before),
                                    "a renewal took tokens"
                                );
                                prop_assert_eq!(
                                    after.map(|e| e.renewing_until_ns),
                                    *renew,
                                    "a renewal not marked"
                                );
                            }
                            Probe::Undecided | Probe::NoEntry => {}
                        }
                    }
                    TableOp::GiveBack(lease, cost, now) => table.give_back(id, *lease, *cost, *now),
                    TableOp::Begin(now, until) => {
                        let _ = table.begin_lease(id, *now, *until);
                    }
                }
                // What was written reads back.
                let (stored, _) = store.get(&fastpath::slot_key(id, slots));
                if let Some(kept) = kept {
                    prop_assert_eq!(
                        stored.as_ref(),
                        Some(&kept),
                        "a live entry of another bucket replaced"
                    );
                }
                if let Some(e) = stored.as_deref().and_then(Entry::decode) {
                    prop_assert_eq!(Entry::decode(&e.encode()), Some(e));
                }
            }
            let size =
                fastpath::lease_size(None, f64::from_bits(now_ns), now_ns, now_ns, 1, now_ns);
            prop_assert!(size >= 1);
            Ok(())
        },
    );
}

#[test]
fn fuzz_emergency() {
    let state = prop_oneof![
        hostile::bytes(40),
        (any::<f64>(), any::<u64>()).prop_map(|(t, u)| State {
            tokens: t,
            updated_ns: u
        }
        .encode()
        .to_vec()),
        (0.0f64..2e15, any::<u64>()).prop_map(|(t, u)| State {
            tokens: t,
            updated_ns: u
        }
        .encode()
        .to_vec()),
    ];
    let bucket = (1u64..=MAX_CAPACITY, 1e-6f64..1e9).prop_filter_map(
        "a full refill within a year",
        |(capacity, refill_per_sec)| {
            (capacity as f64 / refill_per_sec <= config::MAX_REFILL_S).then_some(EmergencyBucket {
                capacity: capacity as f64,
                refill_per_sec,
            })
        },
    );
    fuzz(
        "filter.emergency",
        2000,
        (state, bucket, any::<u64>(), any::<u64>()),
        |(bytes, bucket, now_ns, cost_seed)| {
            let decoded = State::decode(&bytes);
            if let Some(s) = decoded {
                note("decoded");
                prop_assert!(s.tokens.is_finite() && s.tokens >= 0.0);
                prop_assert_eq!(
                    &s.encode()[..],
                    &bytes[..],
                    "a state that does not round-trip"
                );
            }
            let cost = (cost_seed % bucket.capacity as u64).max(1) as f64;
            let take = bucket.take(Some(&bytes), now_ns, cost);
            note(if take.allowed { "admitted" } else { "rejected" });
            let t = take.state.tokens;
            prop_assert!(
                t.is_finite() && (0.0..=bucket.capacity).contains(&t),
                "tokens {t}"
            );
            prop_assert!(take.remaining as f64 <= bucket.capacity);
            prop_assert!(
                take.state.updated_ns >= now_ns.min(decoded.map_or(now_ns, |s| s.updated_ns))
            );
            prop_assert!(!take.allowed || take.retry_after_ms == 0);
            prop_assert_eq!(State::decode(&take.state.encode()), Some(take.state));
            Ok(())
        },
    );
}
