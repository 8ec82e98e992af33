//! The configuration's parsing, defaults and validation.

use super::*;
use serde_json::{json, Value};
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// The plugin configuration shipped in `envoy/envoy.yaml`, verbatim (a test keeps them equal):
/// rules name limits of the sidecar's policy (`envoy/limits.yaml`), which owns their numbers.
pub(crate) const EXAMPLE: &str = r#"{
      "domain": "ratelimit",
      "sidecar": {"cluster": "ratelimit_sidecar", "timeout_ms": 50},
      "identity": {
        "api_key": {"header": "x-api-key",
                    "keys": {"677509799af78b2efa2f2af71d0f906e0a0c50c048efd3b515625f788e92b99a": "alpha"}},
        "jwt": {"provider": "example", "user_claim": "sub", "tenant_claim": "tenant"},
        "ip": true
      },
      "rules": [
        {"name": "per-app", "match": {"path_prefix": "/api/", "methods": ["GET", "POST"]},
         "subject": ["app"], "cost": 1, "on_unknown": "shared",
         "on_error": "local", "emergency": {"capacity": 10, "refill_per_sec": 1}},
        {"name": "per-ip", "match": {"path_prefix": "/"}, "subject": ["ip"], "on_error": "allow"}
      ]
    }"#;

/// The example: rule 0 `per-app` (`/api/` GET and POST, by `app`, `local` with an emergency
/// bucket of 10 at 1/s), rule 1 `per-ip` (everything, by `ip`, `allow`).
pub(crate) fn example() -> Config {
    Config::from_json(EXAMPLE.as_bytes()).expect("the example is valid")
}

fn problems(json: &str) -> Vec<String> {
    match Config::from_json(json.as_bytes()) {
        Ok(_) => panic!("expected {json} to be refused"),
        Err(e) => e.problems.iter().map(Problem::to_string).collect(),
    }
}

/// The example with `edit` applied to its JSON value.
fn edited(edit: impl FnOnce(&mut Value)) -> String {
    let mut v: Value = serde_json::from_str(EXAMPLE).unwrap();
    edit(&mut v);
    v.to_string()
}

/// The example with `edit` applied, which must be accepted.
fn accepted(edit: impl FnOnce(&mut Value)) -> Config {
    let json = edited(edit);
    Config::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{json} refused: {e}"))
}

fn assert_has(problems: &[String], expected: &str) {
    assert!(
        problems.iter().any(|p| p == expected),
        "expected {expected:?} among {problems:#?}"
    );
}

/// The block under `value: |` of the wasm filter's `configuration` in an Envoy config.
fn plugin_json(yaml: &str) -> String {
    let lines: Vec<&str> = yaml.lines().collect();
    let string_value = lines
        .iter()
        .position(|l| l.contains("type.googleapis.com/google.protobuf.StringValue"))
        .expect("a StringValue configuration");
    let value = string_value
        + lines[string_value..]
            .iter()
            .position(|l| l.trim() == "value: |")
            .expect("a `value: |` block");
    let indent = |l: &str| l.len() - l.trim_start().len();
    let depth = indent(lines[value]);
    lines[value + 1..]
        .iter()
        .take_while(|l| l.trim().is_empty() || indent(l) > depth)
        .copied()
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_example_parses_with_its_defaults() {
    let c = example();
    assert_eq!(c.domain, "ratelimit");
    assert_eq!(c.sidecar.cluster, "ratelimit_sidecar");
    assert_eq!(c.sidecar.timeout_ms, 50);
    assert_eq!(c.sidecar.authority(), "ratelimit_sidecar");
    assert_eq!(c.sidecar.path, None);
    assert_eq!((&c.sidecar.token, &c.sidecar.token_env), (&None, &None));
    assert_eq!(c.rules.len(), 2);
    let (app, ip) = (&c.rules[0], &c.rules[1]);
    assert_eq!(app.subject, [Dimension::App]);
    assert_eq!(app.on_unknown, UnknownPolicy::Shared);
    assert_eq!(app.on_error, FailurePolicy::Local);
    assert_eq!(
        app.emergency,
        Some(Emergency {
            capacity: 10,
            refill_per_sec: 1.0
        })
    );
    assert_eq!(app.matcher.methods.as_deref().unwrap(), ["GET", "POST"]);
    assert_eq!(ip.cost, 1);
    assert_eq!(ip.on_unknown, UnknownPolicy::Shared);
    assert_eq!(ip.unknown_status, 401);
    assert_eq!(ip.on_error, FailurePolicy::Allow);
    assert_eq!(ip.emergency, None);
    assert_eq!(c.rate_limit_headers, RateLimitHeaders::OnReject);
    assert_eq!(c.stat_prefix, "ratelimit");
    assert_eq!(c.fast_paths, FastPaths::default());
    assert!(c.identity.ip);
    assert_eq!(c.identity.jwt.as_ref().unwrap().user_claim, "sub");
}

#[test]
fn the_example_is_the_plugin_configuration_shipped_in_envoy_yaml() {
    let shipped = plugin_json(include_str!("../../../envoy/envoy.yaml"));
    let shipped = Config::from_json(shipped.as_bytes())
        .unwrap_or_else(|e| panic!("envoy/envoy.yaml: invalid plugin configuration: {e}"));
    assert_eq!(
        shipped,
        example(),
        "envoy/envoy.yaml changed: update EXAMPLE to match it"
    );
}

#[test]
fn a_minimal_config_takes_every_default() {
    let c =
        Config::from_json(br#"{"sidecar":{"cluster":"s"},"rules":[{"name":"g","subject":[]}]}"#)
            .unwrap();
    assert_eq!(c.domain, "ratelimit");
    assert_eq!(c.domain, ratelimit_wire::DEFAULT_DOMAIN);
    assert_eq!(c.sidecar.timeout_ms, 50);
    assert_eq!(c.sidecar.authority(), "s");
    assert!(c.retired_fields().is_empty());
    assert_eq!((&c.sidecar.token, &c.sidecar.token_env), (&None, &None));
    assert_eq!(c.identity, Identity::default());
    assert_eq!(
        (&c.identity.api_key, &c.identity.jwt, c.identity.ip),
        (&None, &None, false)
    );
    let r = &c.rules[0];
    assert_eq!(r.matcher, Match::default());
    assert_eq!(r.matcher.path_prefix, "/");
    assert_eq!(r.matcher.methods, None);
    assert!(r.matcher.headers.is_empty());
    assert_eq!(r.cost, 1);
    assert_eq!(r.on_unknown, UnknownPolicy::Shared);
    assert_eq!(r.unknown_status, 401);
    assert_eq!(r.on_error, FailurePolicy::Deny);
    assert_eq!(r.emergency, None);
    assert_eq!(c.rate_limit_headers, RateLimitHeaders::OnReject);
    assert_eq!(c.stat_prefix, "ratelimit");
    let f = &c.fast_paths;
    assert!(f.coalesce && f.share_callouts.is_none());
    assert_eq!((f.max_batch, f.max_in_flight, f.slots), (64, 1, 4096));
    assert!(f.known_rejections);
    assert_eq!(
        f.leases,
        Leases {
            enabled: true,
            min_rate_per_sec: 50.0,
            ttl_ms: 1000,
            max_tokens: 1000,
        }
    );
}

#[test]
fn fast_path_defaults_are_the_same_omitted_empty_or_in_part() {
    let omitted = example().fast_paths;
    assert_eq!(omitted, FastPaths::default());
    let empty = accepted(|v| v["fast_paths"] = json!({})).fast_paths;
    assert_eq!(empty, omitted);
    let leases_empty = accepted(|v| v["fast_paths"] = json!({"leases": {}})).fast_paths;
    assert_eq!(leases_empty, omitted);
    let some =
        accepted(|v| v["fast_paths"] = json!({"coalesce": false, "leases": {"enabled": false}}))
            .fast_paths;
    assert!(!some.coalesce && !some.leases.enabled && some.share_callouts.is_none());
    assert_eq!(
        (some.max_batch, some.leases.ttl_ms, some.leases.max_tokens),
        (64, 1000, 1000)
    );
}

#[test]
fn bad_json_is_refused() {
    let p = problems("{not json");
    assert_eq!(p.len(), 1);
    assert!(p[0].starts_with("configuration: "), "{p:?}");
    let p = problems("");
    assert!(p[0].starts_with("configuration: "), "{p:?}");
}

#[test]
fn an_unknown_field_is_refused_with_its_path() {
    let p = problems(&edited(|v| v["rules"][0]["cots"] = 5.into()));
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(
        p[0].starts_with("rules[0].cots: unknown field `cots`"),
        "{p:?}"
    );
    let p = problems(&edited(|v| v["fast_paths"] = json!({"leases": {"ttl": 5}})));
    assert!(
        p[0].starts_with("fast_paths.leases.ttl: unknown field `ttl`"),
        "{p:?}"
    );
    let p = problems(&edited(|v| v["sidecar"]["tokn"] = "t".into()));
    assert!(
        p[0].starts_with("sidecar.tokn: unknown field `tokn`"),
        "{p:?}"
    );
}

#[test]
fn the_numbers_of_the_old_design_are_refused_with_their_path() {
    // The limits' numbers belong to the sidecar's policy now: a rule that still carries them
    // is refused, never silently ignored.
    let p = problems(&edited(|v| v["rules"][1]["capacity"] = 1000.into()));
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(
        p[0].starts_with("rules[1].capacity: unknown field `capacity`, expected one of"),
        "{p:?}"
    );
    let p = problems(&edited(|v| v["rules"][0]["refill_per_sec"] = 10.into()));
    assert!(
        p[0].starts_with("rules[0].refill_per_sec: unknown field `refill_per_sec`"),
        "{p:?}"
    );
}

#[test]
fn a_wrong_type_names_its_field() {
    let p = problems(&edited(|v| v["rules"][1]["cost"] = "lots".into()));
    assert!(p[0].starts_with("rules[1].cost: invalid type"), "{p:?}");
    let p = problems(&edited(|v| v["fast_paths"] = json!({"max_batch": -1})));
    assert!(p[0].starts_with("fast_paths.max_batch: invalid"), "{p:?}");
    let p = problems(&edited(|v| {
        v["fast_paths"] = json!({"share_callouts": "yes"})
    }));
    assert!(
        p[0].starts_with("fast_paths.share_callouts: invalid type"),
        "{p:?}"
    );
    let p = problems(&edited(|v| v["domain"] = 7.into()));
    assert!(p[0].starts_with("domain: invalid type"), "{p:?}");
}

#[test]
fn an_unknown_subject_dimension_is_refused() {
    let p = problems(&edited(|v| v["rules"][0]["subject"] = json!(["country"])));
    assert!(
        p[0].starts_with("rules[0].subject[0]: unknown variant `country`"),
        "{p:?}"
    );
}

#[test]
fn every_semantic_problem_is_reported_at_once() {
    let p = problems(&edited(|v| {
        v["sidecar"]["timeout_ms"] = 0.into();
        v["rules"][0]["cost"] = 0.into();
        v["rules"][0]["emergency"] = Value::Null;
        v["rules"][1]["name"] = "per-app".into();
        v["identity"]["api_key"]["keys"] = json!({"xyz": "alpha"});
        v["fast_paths"] = json!({"max_batch": 0});
    }));
    assert_has(&p, "sidecar.timeout_ms: must be between 1 and 60000, got 0");
    assert_has(&p, "rules[0].cost: must be > 0");
    assert_has(
        &p,
        "rules[0].emergency: required when on_error is \"local\"",
    );
    assert_has(&p, "rules[1].name: duplicate rule name \"per-app\"");
    assert_has(
        &p,
        "identity.api_key.keys: \"xyz\" is not a lowercase hex SHA-256 (64 characters of 0-9a-f)",
    );
    assert_has(&p, "fast_paths.max_batch: must be 1 to 256, got 0");
    assert_eq!(p.len(), 6, "{p:#?}");
    let message = Config::from_json(
        edited(|v| {
            v["sidecar"]["timeout_ms"] = 0.into();
            v["rules"][0]["cost"] = 0.into();
        })
        .as_bytes(),
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        message,
        "sidecar.timeout_ms: must be between 1 and 60000, got 0; rules[0].cost: must be > 0"
    );
}

#[test]
fn uppercase_hex_key_hashes_are_refused() {
    let p = problems(&edited(|v| {
        v["identity"]["api_key"]["keys"] = json!({
                "677509799AF78B2EFA2F2AF71D0F906E0A0C50C048EFD3B515625F788E92B99A": "alpha"})
    }));
    assert!(p[0].starts_with("identity.api_key.keys: "), "{p:?}");
}

#[test]
fn a_config_holds_one_to_max_rules_rules() {
    let p = problems(&edited(|v| v["rules"] = json!([])));
    assert_eq!(p, ["rules: must hold at least one rule"]);
    let rules = |n: usize| {
        (0..n)
            .map(|i| json!({"name": format!("r{i}"), "subject": []}))
            .collect::<Vec<_>>()
    };
    let p = problems(&edited(|v| v["rules"] = rules(MAX_RULES + 1).into()));
    assert_eq!(p, ["rules: at most 64 rules, got 65"]);
    assert_eq!(
        accepted(|v| v["rules"] = rules(MAX_RULES).into())
            .rules
            .len(),
        MAX_RULES
    );
}

#[test]
fn a_request_matching_every_rule_must_fit_a_call() {
    // Issue 32, case 3: each rule on a user and a tenant, each up to 1,024 bytes escaped to
    // 2,048: about 4.2 KB a decision, so 15 fit the call's 64 KiB and 16 do not.
    let rules = |n: usize| {
        (0..n)
            .map(|i| json!({"name": format!("r{i}"), "subject": ["user", "tenant"]}))
            .collect::<Vec<_>>()
    };
    assert_eq!(accepted(|v| v["rules"] = rules(15).into()).rules.len(), 15);
    let p = problems(&edited(|v| v["rules"] = rules(16).into()));
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(
        p[0].starts_with("rules: a request matching every rule would carry up to ")
            && p[0].contains("more than a call to the sidecar holds"),
        "{p:?}"
    );
}

#[test]
fn a_cost_no_bucket_could_ever_pay_is_refused() {
    let p = problems(&edited(|v| v["rules"][0]["cost"] = 11.into()));
    assert_eq!(
        p,
        [
            "rules[0].emergency.capacity: 10 is less than the rule's cost 11: no request could \
              ever pass"
        ]
    );
    assert_eq!(
        accepted(|v| v["rules"][0]["cost"] = 10.into()).rules[0].cost,
        10
    );
    // A rule's own capacity is the sidecar's: any cost up to the largest header integer is
    // the filter's to accept.
    let big = accepted(|v| v["rules"][1]["cost"] = MAX_CAPACITY.into());
    assert_eq!(big.rules[1].cost, MAX_CAPACITY);
    let p = problems(&edited(|v| {
        v["rules"][1]["cost"] = (MAX_CAPACITY + 1).into()
    }));
    assert_eq!(p, ["rules[1].cost: must be at most 999999999999999"]);
}

#[test]
fn invalid_methods_are_refused() {
    let p = problems(&edited(|v| {
        v["rules"][0]["match"]["methods"] = json!(["GET", "post", ""])
    }));
    assert_has(
        &p,
        "rules[0].match.methods[1]: \"post\" is not an uppercase HTTP method such as \"GET\"",
    );
    assert_has(
        &p,
        "rules[0].match.methods[2]: \"\" is not an uppercase HTTP method such as \"GET\"",
    );
    assert_eq!(p.len(), 2, "{p:?}");
    let p = problems(&edited(|v| v["rules"][0]["match"]["methods"] = json!([])));
    assert_eq!(
        p,
        ["rules[0].match.methods: must list at least one method (omit it to match any method)"]
    );
}

#[test]
fn header_conditions_need_exactly_one_kind() {
    let p = problems(&edited(|v| {
        v["rules"][1]["match"]["headers"] = json!([
            {"name": "x-tier", "exact": "free", "prefix": "f"},
            {"name": "bad name"},
            {"name": "x-ok", "present": true}
        ])
    }));
    assert_has(
        &p,
        "rules[1].match.headers[0]: must have exactly one of \"exact\", \"prefix\", \"present\"",
    );
    assert_has(
        &p,
        "rules[1].match.headers[1].name: \"bad name\" is not a valid header name",
    );
    assert_has(
        &p,
        "rules[1].match.headers[1]: must have exactly one of \"exact\", \"prefix\", \"present\"",
    );
    assert!(!p.iter().any(|x| x.contains("headers[2]")), "{p:?}");
}

#[test]
fn a_dimension_without_its_identity_source_is_refused() {
    let p = problems(&edited(|v| {
        v["identity"] = json!({});
        v["rules"][0]["subject"] = json!(["app", "user", "tenant", "route", "app"]);
    }));
    assert_has(&p, "rules[0].subject[0]: \"app\" is never known without identity.api_key: the rule could never tell clients apart");
    assert_has(&p, "rules[0].subject[1]: \"user\" is never known without identity.jwt: the rule could never tell clients apart");
    assert_has(&p, "rules[0].subject[2]: \"tenant\" is never known without identity.jwt.tenant_claim: the rule could never tell clients apart");
    assert_has(&p, "rules[0].subject[4]: duplicate dimension \"app\"");
    assert_has(&p, "rules[1].subject[0]: \"ip\" is never known without identity.ip: true: the rule could never tell clients apart");
    assert!(!p.iter().any(|x| x.contains("subject[3]")), "{p:?}");
    assert_eq!(p.len(), 5, "{p:#?}");
}

#[test]
fn bad_names_paths_and_emergency_misuse_are_refused() {
    let p = problems(&edited(|v| {
        v["rules"][0]["name"] = "a|b".into();
        v["rules"][0]["match"]["path_prefix"] = "api".into();
        v["rules"][0]["emergency"]["refill_per_sec"] = 0.into();
        v["rules"][1]["emergency"] = json!({"capacity": 1, "refill_per_sec": 1});
        v["stat_prefix"] = "".into();
    }));
    assert_has(
        &p,
        "rules[0].name: \"a|b\" must be 1 to 64 characters of [A-Za-z0-9_.-]",
    );
    assert_has(&p, "rules[0].match.path_prefix: must start with '/'");
    assert_has(&p, "rules[0].emergency.refill_per_sec: must be > 0");
    assert_has(
        &p,
        "rules[1].emergency: only used when on_error is \"local\"; set on_error or remove it",
    );
    assert_has(
        &p,
        "stat_prefix: \"\" must be 1 to 128 characters of [A-Za-z0-9_.-], not starting with '.'",
    );
    assert_eq!(p.len(), 5, "{p:#?}");
    let p = problems(&edited(|v| {
        v["rules"][0]["name"] = "n".repeat(MAX_RULE_NAME_BYTES + 1).into();
        v["rules"][0]["emergency"]["capacity"] = 0.into();
        v["stat_prefix"] = ".ratelimit".into();
    }));
    assert_has(
        &p,
        &format!(
            "rules[0].name: \"{}\" must be 1 to 64 characters of [A-Za-z0-9_.-]",
            "n".repeat(65)
        ),
    );
    assert_has(&p, "rules[0].emergency.capacity: must be > 0");
    assert!(p.iter().any(|x| x.starts_with("stat_prefix: ")), "{p:?}");
    let c = accepted(|v| v["rules"][0]["name"] = "n".repeat(MAX_RULE_NAME_BYTES).into());
    assert_eq!(c.rules[0].name.len(), 64);
}

#[test]
fn an_unknown_failure_or_unknown_subject_policy_is_refused() {
    let p = problems(&edited(|v| v["rules"][0]["on_error"] = "ignore".into()));
    assert!(
        p[0].starts_with("rules[0].on_error: unknown variant `ignore`"),
        "{p:?}"
    );
    let p = problems(&edited(|v| v["rules"][1]["on_unknown"] = "allow".into()));
    assert!(
        p[0].starts_with("rules[1].on_unknown: unknown variant `allow`"),
        "{p:?}"
    );
}

#[test]
fn on_unknown_takes_skip_shared_or_reject() {
    let c = accepted(|v| {
        v["rules"][0]["on_unknown"] = "skip".into();
        v["rules"][1]["on_unknown"] = "reject".into();
    });
    assert_eq!(c.rules[0].on_unknown, UnknownPolicy::Skip);
    assert_eq!(c.rules[1].on_unknown, UnknownPolicy::Reject);
    assert_eq!(c.rules[1].unknown_status, 401);
    let c = accepted(|v| v["rules"][1]["on_unknown"] = "shared".into());
    assert_eq!(c.rules[1].on_unknown, UnknownPolicy::Shared);
    assert_eq!(UnknownPolicy::default(), UnknownPolicy::Shared);
}

#[test]
fn an_unknown_subject_is_answered_401_or_429_only() {
    let c = accepted(|v| {
        v["rules"][1]["on_unknown"] = "reject".into();
        v["rules"][1]["unknown_status"] = 429.into();
    });
    assert_eq!(c.rules[1].unknown_status, 429);
    for status in [0, 200, 400, 403, 503] {
        let p = problems(&edited(|v| v["rules"][1]["unknown_status"] = status.into()));
        assert_eq!(
            p,
            [format!(
                "rules[1].unknown_status: must be 401 or 429, got {status}"
            )]
        );
    }
}

#[test]
fn matched_header_names_are_lowercased() {
    let c = accepted(|v| {
        v["rules"][1]["match"]["headers"] = json!([{"name": "X-Tier", "exact": "free"}])
    });
    assert_eq!(
        c.matched_header_names().into_iter().collect::<Vec<_>>(),
        ["x-tier"]
    );
    assert!(example().matched_header_names().is_empty());
}

#[test]
fn the_method_is_read_only_when_a_rule_matches_methods() {
    assert!(example().matches_methods());
    let c = accepted(|v| {
        for r in v["rules"].as_array_mut().unwrap() {
            r["match"].as_object_mut().map(|m| m.remove("methods"));
        }
    });
    assert!(!c.matches_methods());
}

#[test]
fn header_names_are_lowercased_at_load_and_values_kept() {
    let c = accepted(|v| {
        v["rules"][1]["match"]["headers"] = json!([{"name": "X-Tier", "exact": "Free"}])
    });
    let h = &c.rules[1].matcher.headers[0];
    assert_eq!(
        (h.name.as_str(), h.exact.as_deref()),
        ("x-tier", Some("Free"))
    );
}

#[test]
fn emergency_buckets_stay_within_structured_field_integers() {
    let p = problems(&edited(|v| {
        v["rules"][0]["emergency"]["capacity"] = (MAX_CAPACITY + 1).into();
    }));
    assert_has(
        &p,
        "rules[0].emergency.capacity: must be at most 999999999999999",
    );
    let p = problems(&edited(|v| {
        v["rules"][0]["emergency"]["refill_per_sec"] = 0.0000001.into();
    }));
    assert_eq!(
        p,
        [
            "rules[0].emergency.refill_per_sec: 0.0000001 is too slow: a full refill of 10 \
              tokens would take 100000000 s, more than one year (31536000 s); raise \
              refill_per_sec or lower capacity"
        ]
    );
    // Exactly one year is accepted.
    let c =
        accepted(|v| v["rules"][0]["emergency"]["refill_per_sec"] = (10.0 / 31_536_000.0).into());
    let e = c.rules[0].emergency.as_ref().unwrap();
    assert_eq!(window_s(e.capacity, e.refill_per_sec), 31_536_000);
}

#[test]
fn the_window_is_a_full_refill_rounded_up_and_never_panics() {
    assert_eq!(window_s(100, 10.0), 10);
    assert_eq!(window_s(10, 3.0), 4);
    assert_eq!(window_s(1, 1000.0), 1, "at least one second");
    assert_eq!(window_s(MAX_CAPACITY, f64::MIN_POSITIVE), u64::MAX);
    assert_eq!(window_s(0, 0.0), 1);
}

#[test]
fn the_ipv6_prefix_length_defaults_to_64_and_is_bounded() {
    assert_eq!(example().identity.ipv6_prefix_len, 64);
    assert_eq!(Identity::default().ipv6_prefix_len, 64);
    let p = problems(&edited(|v| v["identity"]["ipv6_prefix_len"] = 0.into()));
    assert_eq!(
        p,
        ["identity.ipv6_prefix_len: must be between 1 and 128, got 0"]
    );
    let p = problems(&edited(|v| v["identity"]["ipv6_prefix_len"] = 129.into()));
    assert_eq!(
        p,
        ["identity.ipv6_prefix_len: must be between 1 and 128, got 129"]
    );
    let c = accepted(|v| v["identity"]["ipv6_prefix_len"] = 128.into());
    assert_eq!(c.identity.ipv6_prefix_len, 128);
}

#[test]
fn identity_sources_are_checked() {
    let p = problems(&edited(|v| {
        v["identity"]["api_key"] = json!({"header": ":authority", "keys": {}});
        v["identity"]["jwt"] = json!({"provider": "", "user_claim": "", "tenant_claim": ""});
    }));
    assert_has(
        &p,
        "identity.api_key.header: must be a regular header, not a pseudo-header",
    );
    assert_has(
        &p,
        "identity.api_key.keys: must hold at least one key hash (an empty map names no \
             application)",
    );
    assert_has(
        &p,
        "identity.jwt.provider: must be the payload_in_metadata name of jwt_authn",
    );
    assert_has(&p, "identity.jwt.user_claim: must not be empty");
    assert_has(
        &p,
        "identity.jwt.tenant_claim: must not be empty (omit it instead)",
    );
    assert_eq!(p.len(), 5, "{p:#?}");
    let hash = "677509799af78b2efa2f2af71d0f906e0a0c50c048efd3b515625f788e92b99a";
    let p = problems(&edited(|v| {
        v["identity"]["api_key"] = json!({"header": "x api key", "keys": {hash: ""}});
    }));
    assert_has(
        &p,
        "identity.api_key.header: \"x api key\" is not a valid header name",
    );
    assert_has(
        &p,
        &format!("identity.api_key.keys.{hash}: must name an application"),
    );
}

#[test]
fn the_domain_defaults_to_ratelimit_and_must_be_a_name() {
    let c = accepted(|v| {
        v.as_object_mut().unwrap().remove("domain");
    });
    assert_eq!(c.domain, "ratelimit");
    assert_eq!(
        accepted(|v| v["domain"] = "edge.v2_a-b".into()).domain,
        "edge.v2_a-b"
    );
    assert_eq!(
        accepted(|v| v["domain"] = "d".repeat(128).into())
            .domain
            .len(),
        128
    );
    for bad in [String::new(), "a b".into(), "a/b".into(), "d".repeat(129)] {
        let p = problems(&edited(|v| v["domain"] = bad.clone().into()));
        assert_eq!(
            p,
            [format!(
                "domain: {bad:?} must be 1 to 128 characters of [A-Za-z0-9_.-]"
            )]
        );
    }
}

#[test]
fn a_token_or_its_environment_variable_but_not_both() {
    let c = accepted(|v| v["sidecar"]["token"] = "s3cr3t-T0ken".into());
    assert_eq!(c.sidecar.token.as_deref(), Some("s3cr3t-T0ken"));
    let c = accepted(|v| v["sidecar"]["token_env"] = "RATELIMIT_TOKEN".into());
    assert_eq!(c.sidecar.token_env.as_deref(), Some("RATELIMIT_TOKEN"));
    let p = problems(&edited(|v| {
        v["sidecar"]["token"] = "t".into();
        v["sidecar"]["token_env"] = "RATELIMIT_TOKEN".into();
    }));
    assert_eq!(
        p,
        ["sidecar.token_env: give either token or token_env, not both"]
    );
    for bad in ["", "two words", "tab\there", "caf\u{e9}"] {
        let p = problems(&edited(|v| v["sidecar"]["token"] = bad.into()));
        assert_eq!(
            p,
            ["sidecar.token: must be non-empty printable ASCII without spaces"],
            "{bad:?}"
        );
    }
    for bad in ["", "A=B", "A\u{0}B"] {
        let p = problems(&edited(|v| v["sidecar"]["token_env"] = bad.into()));
        assert_eq!(
            p,
            ["sidecar.token_env: must name an environment variable"],
            "{bad:?}"
        );
    }
}

#[test]
fn the_sidecar_cluster_timeout_and_authority_are_checked() {
    let c = accepted(|v| {
        v["sidecar"]["timeout_ms"] = MAX_TIMEOUT_MS.into();
        v["sidecar"]["authority"] = "ratelimit.internal:8081".into();
    });
    assert_eq!(c.sidecar.timeout_ms, 60_000);
    assert_eq!(c.sidecar.authority(), "ratelimit.internal:8081");
    let p = problems(&edited(|v| {
        v["sidecar"] = json!({"cluster": " ", "timeout_ms": 60_001, "authority": "a b"});
    }));
    assert_eq!(
        p,
        [
            "sidecar.cluster: must name an Envoy cluster",
            "sidecar.timeout_ms: must be between 1 and 60000, got 60001",
            "sidecar.authority: must be a non-empty host[:port] without spaces",
        ]
    );
}

#[test]
fn retired_fields_are_taken_with_a_warning_each() {
    // Configurations written for the HTTP callouts and the courier still load: what those
    // fields set no longer exists, and Envoy's log says so once per worker.
    let c = accepted(|v| {
        v["sidecar"]["path"] = "/v1/ decide".into();
        v["fast_paths"] = json!({"share_callouts": false});
    });
    let retired = c.retired_fields();
    assert_eq!(retired.len(), 2, "{retired:?}");
    assert!(retired[0].starts_with("sidecar.path is ignored"));
    assert!(retired[1].starts_with("fast_paths.share_callouts is ignored"));
}

#[test]
fn fast_path_bounds_are_checked_with_every_problem_named() {
    let p = problems(&edited(|v| {
        v["fast_paths"] = json!({
            "max_batch": 0, "max_in_flight": 0, "slots": 0, "max_rejection_ms": 0,
            "leases": {"min_rate_per_sec": 0, "ttl_ms": 0, "max_tokens": 0}
        })
    }));
    assert_eq!(
        p,
        [
            "fast_paths.max_batch: must be 1 to 256, got 0",
            "fast_paths.max_in_flight: must be 1 to 64, got 0",
            "fast_paths.max_rejection_ms: must be 1 to 86400000, got 0",
            "fast_paths.slots: must be 1 to 1048576, got 0",
            "fast_paths.leases.min_rate_per_sec: must be a number > 0",
            "fast_paths.leases.ttl_ms: must be 1 to 60000, got 0",
            "fast_paths.leases.max_tokens: must be 1 to 999999999999999",
        ]
    );
    let p = problems(&edited(|v| {
        v["fast_paths"] = json!({
            "max_batch": ratelimit_wire::MAX_REQUESTS + 1, "max_in_flight": 65,
            "slots": (1 << 20) + 1, "max_rejection_ms": 86_400_001, "policy_poll_ms": 60_001,
            "leases": {"min_rate_per_sec": -1.5, "ttl_ms": 60_001, "max_tokens": MAX_CAPACITY + 1}
        })
    }));
    assert_eq!(
        p,
        [
            "fast_paths.max_batch: must be 1 to 256, got 257",
            "fast_paths.max_in_flight: must be 1 to 64, got 65",
            "fast_paths.max_rejection_ms: must be 1 to 86400000, got 86400001",
            "fast_paths.policy_poll_ms: must be 0 to 60000, got 60001",
            "fast_paths.slots: must be 1 to 1048576, got 1048577",
            "fast_paths.leases.min_rate_per_sec: must be a number > 0",
            "fast_paths.leases.ttl_ms: must be 1 to 60000, got 60001",
            "fast_paths.leases.max_tokens: must be 1 to 999999999999999",
        ]
    );
    // The bounds themselves are accepted.
    let f = accepted(|v| {
        v["fast_paths"] = json!({
            "coalesce": false, "known_rejections": false,
            "max_batch": 256, "max_in_flight": 64, "slots": 1 << 20,
            "max_rejection_ms": 86_400_000, "policy_poll_ms": 60_000,
            "leases": {"enabled": false, "min_rate_per_sec": 0.001, "ttl_ms": 60_000,
                       "max_tokens": MAX_CAPACITY}
        })
    })
    .fast_paths;
    assert_eq!(
        f,
        FastPaths {
            coalesce: false,
            max_batch: 256,
            max_in_flight: 64,
            share_callouts: None,
            known_rejections: false,
            max_rejection_ms: 86_400_000,
            policy_poll_ms: 60_000,
            leases: Leases {
                enabled: false,
                min_rate_per_sec: 0.001,
                ttl_ms: 60_000,
                max_tokens: MAX_CAPACITY,
            },
            slots: 1 << 20,
        }
    );
}

#[test]
fn the_streams_authorization_comes_from_the_token_or_its_environment_variable() {
    let env = |var: &str| (var == "RL_TOKEN").then(|| "s3cret".to_string());
    let token = accepted(|v| v["sidecar"]["token"] = "t0k".into());
    assert_eq!(
        token.sidecar.authorization(env),
        Ok(Some("Bearer t0k".into()))
    );
    let from_env = accepted(|v| v["sidecar"]["token_env"] = "RL_TOKEN".into());
    assert_eq!(
        from_env.sidecar.authorization(env),
        Ok(Some("Bearer s3cret".into()))
    );
    let unset = accepted(|v| v["sidecar"]["token_env"] = "RL_OTHER".into());
    let e = unset.sidecar.authorization(env).unwrap_err();
    assert!(
        e.starts_with("sidecar.token_env: the environment variable \"RL_OTHER\""),
        "{e}"
    );
    let spaced = |_: &str| Some("a b".to_string());
    assert!(
        from_env.sidecar.authorization(spaced).is_err(),
        "not printable ASCII"
    );
    assert_eq!(example().sidecar.authorization(env), Ok(None));
}
