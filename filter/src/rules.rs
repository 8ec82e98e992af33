//! Which rules apply to a request, and what each applicable rule asks the sidecar: a
//! [`Planned`] decision that names the rule and the subject's values (the numbers belong to the
//! sidecar's policy). A rule applies when its `match` fits; a dimension of its subject that is
//! unknown is handled by the rule's `on_unknown` (skip the rule, share one bucket for all unknown
//! clients, or reject the request).
//!
//! In request order: [`matching`] (from path, method and headers only), then [`needs`] (which
//! identity facts those rules' subjects need, so the host reads nothing else), then [`plan`].

use std::collections::BTreeMap;

use ratelimit_wire::Subject as WireSubject;

use crate::config::{Config, Dimension, HeaderMatch, Match, Rule, UnknownPolicy};
use crate::identity::{sha256_hex, Subject};

/// Escaped values longer than this are replaced by their SHA-256 in a bucket's local id, so it
/// stays bounded: a 64-byte rule name plus five dimensions of at most `1 + 6 + 1 + 80` bytes is
/// 504 bytes.
pub const MAX_KEY_VALUE_BYTES: usize = 80;

/// The parts of a request that `match` looks at, as the host read them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestFacts {
    /// `:path`, query string included (it is cut here).
    pub path: Vec<u8>,
    /// `:method`.
    pub method: Vec<u8>,
    /// The first value of each header named in some rule's `match.headers` (lowercase names, as
    /// the configuration holds them); absent headers are not in the map.
    pub headers: BTreeMap<String, Vec<u8>>,
}

/// One applicable rule and what to ask the sidecar for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    /// Index of the rule in [`Config::rules`].
    pub rule: usize,
    /// The subject's dimensions in the rule's order; `None` is an unknown value (a bucket shared
    /// by every unknown client of the rule).
    pub subject: WireSubject,
    pub cost: u64,
    /// The bucket's identity at this gateway (for the fast paths' shared data):
    /// `<rule>|<dimension>=<value>|...`, see [`bucket_id`].
    pub id: String,
}

/// The indices of the rules whose `match` fits the request, in rule order.
pub fn matching(config: &Config, request: &RequestFacts) -> Vec<usize> {
    config
        .rules
        .iter()
        .enumerate()
        .filter(|(_, rule)| matches(&rule.matcher, request))
        .map(|(i, _)| i)
        .collect()
}

/// The dimensions the subjects of some rules need: the identity facts worth reading.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Needs {
    pub user: bool,
    pub tenant: bool,
    pub app: bool,
    pub ip: bool,
    pub route: bool,
}

/// What the subjects of `rules` (indices into [`Config::rules`]) need.
pub fn needs(config: &Config, rules: &[usize]) -> Needs {
    let mut n = Needs::default();
    for d in rules.iter().flat_map(|&i| &config.rules[i].subject) {
        match d {
            Dimension::User => n.user = true,
            Dimension::Tenant => n.tenant = true,
            Dimension::App => n.app = true,
            Dimension::Ip => n.ip = true,
            Dimension::Route => n.route = true,
        }
    }
    n
}

/// The decisions of one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    /// One per applicable rule, in rule order.
    pub planned: Vec<Planned>,
    /// Some matching rule met an unknown dimension of its subject (whatever its `on_unknown`).
    pub subject_unknown: bool,
    /// The first matching rule whose `on_unknown: reject` met an unknown subject: the request is
    /// answered with that rule's `unknown_status`.
    pub reject: Option<usize>,
}

/// The decisions for the matching `rules` (see [`matching`]).
pub fn plan(config: &Config, rules: &[usize], subject: &Subject) -> Plan {
    let mut p = Plan::default();
    for &i in rules {
        let rule = &config.rules[i];
        let unknown = rule.subject.iter().any(|d| subject.get(*d).is_none());
        if unknown {
            p.subject_unknown = true;
            match rule.on_unknown {
                UnknownPolicy::Skip => continue,
                UnknownPolicy::Reject => {
                    p.reject.get_or_insert(i);
                    continue;
                }
                UnknownPolicy::Shared => {}
            }
        }
        let mut wire = WireSubject::new();
        for d in &rule.subject {
            wire.push(d.as_str(), subject.get(*d).map(str::to_string));
        }
        p.planned.push(Planned {
            rule: i,
            id: bucket_id(rule, subject),
            subject: wire,
            cost: rule.cost,
        });
    }
    p
}

/// Whether `m` fits the request.
pub fn matches(m: &Match, request: &RequestFacts) -> bool {
    let path = request
        .path
        .split(|b| *b == b'?' || *b == b'#')
        .next()
        .unwrap_or_default();
    path.starts_with(m.path_prefix.as_bytes())
        && m.methods.as_ref().is_none_or(|methods| {
            methods
                .iter()
                .any(|x| x.as_bytes() == request.method.as_slice())
        })
        && m.headers.iter().all(|h| header_fits(h, request))
}

fn header_fits(h: &HeaderMatch, request: &RequestFacts) -> bool {
    // Names are lowercased once, at configuration load.
    let value = request.headers.get(h.name.as_str());
    match (&h.exact, &h.prefix, h.present) {
        (Some(exact), _, _) => value.is_some_and(|v| v == exact.as_bytes()),
        (_, Some(prefix), _) => value.is_some_and(|v| v.starts_with(prefix.as_bytes())),
        (_, _, Some(present)) => value.is_some() == present,
        // Refused by validation; a condition that says nothing does not fit.
        (None, None, None) => false,
    }
}

/// The local identity of `rule`'s bucket for `subject`.
///
/// Shape: `<rule>|<dimension>=<value>|...` in the rule's dimension order, e.g.
/// `per-app|app=alpha`; an unknown value is `<dimension>~`. Values are percent-encoded outside
/// `[A-Za-z0-9._~:@/-]`, so `|`, `=`, `#`, `%` never appear raw and no two subjects share an id.
/// An encoded value longer than [`MAX_KEY_VALUE_BYTES`] becomes `<dimension>#<sha256 hex of the
/// raw value>`. Rule names are restricted to `[A-Za-z0-9_.-]` by validation.
pub fn bucket_id(rule: &Rule, subject: &Subject) -> String {
    let mut key = rule.name.clone();
    for d in &rule.subject {
        key.push('|');
        match subject.get(*d) {
            Some(value) => push_component(&mut key, *d, value),
            None => {
                key.push_str(d.as_str());
                key.push('~');
            }
        }
    }
    key
}

fn push_component(key: &mut String, d: Dimension, value: &str) {
    let escaped = escape(value);
    key.push_str(d.as_str());
    if escaped.len() > MAX_KEY_VALUE_BYTES {
        key.push('#');
        key.push_str(&sha256_hex(value.as_bytes()));
    } else {
        key.push('=');
        key.push_str(&escaped);
    }
}

fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~:@/".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(b"0123456789ABCDEF"[usize::from(b >> 4)]));
            out.push(char::from(b"0123456789ABCDEF"[usize::from(b & 0xf)]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::example;
    use crate::config::Config;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn request(method: &str, path: &str) -> RequestFacts {
        RequestFacts {
            path: path.into(),
            method: method.into(),
            headers: BTreeMap::new(),
        }
    }

    fn subject(app: Option<&str>, ip: Option<&str>) -> Subject {
        Subject {
            app: app.map(Into::into),
            ip: ip.map(Into::into),
            ..Subject::default()
        }
    }

    /// Plans every matching rule, as the host does.
    fn plan_all(c: &Config, r: &RequestFacts, s: &Subject, attempt: &str) -> Vec<Planned> {
        plan(c, &matching(c, r), s, || attempt.into()).planned
    }

    fn keys(planned: &[Planned]) -> Vec<&str> {
        planned.iter().map(|p| p.decision.key.as_str()).collect()
    }

    #[test]
    fn both_rules_of_the_example_apply_to_an_api_get() {
        let c = example();
        let p = plan_all(
            &c,
            &request("GET", "/api/items?x=1"),
            &subject(Some("alpha"), Some("10.0.0.1")),
            "rid@1",
        );
        assert_eq!(keys(&p), ["per-app|app=alpha", "per-ip|ip=10.0.0.1"]);
        assert_eq!(p[0].rule, 0);
        assert_eq!(
            p[0].decision,
            Decision {
                key: "per-app|app=alpha".into(),
                capacity: 100.0,
                refill_per_sec: 10.0,
                cost: 1.0,
                attempt: Some("rid@1".into()),
            }
        );
        assert_eq!(p[1].decision.attempt.as_deref(), Some("rid@1"));
    }

    #[test]
    fn method_and_path_prefix_must_fit() {
        let c = example();
        let s = subject(Some("alpha"), Some("10.0.0.1"));
        assert_eq!(
            keys(&plan_all(&c, &request("DELETE", "/api/x"), &s, "a")),
            ["per-ip|ip=10.0.0.1"]
        );
        assert_eq!(
            keys(&plan_all(&c, &request("GET", "/apix"), &s, "a")),
            ["per-ip|ip=10.0.0.1"]
        );
        assert_eq!(
            keys(&plan_all(&c, &request("GET", "/other?/api/"), &s, "a")),
            ["per-ip|ip=10.0.0.1"]
        );
        assert_eq!(
            keys(&plan_all(&c, &request("get", "/api/x"), &s, "a")),
            ["per-ip|ip=10.0.0.1"]
        );
    }

    #[test]
    fn a_rule_whose_subject_is_unknown_is_skipped() {
        let c = example();
        let p = plan_all(
            &c,
            &request("GET", "/api/x"),
            &subject(None, Some("::1")),
            "a",
        );
        assert_eq!(keys(&p), ["per-ip|ip=::1"]);
        let p = plan_all(&c, &request("GET", "/api/x"), &subject(None, None), "a");
        assert!(p.is_empty());
    }

    #[test]
    fn header_conditions() {
        let c = Config::from_json(
            br#"{"sidecar":{"cluster":"s"},"rules":[
                {"name":"free","match":{"headers":[{"name":"X-Tier","exact":"free"}]},"subject":[],"capacity":1,"refill_per_sec":1},
                {"name":"beta","match":{"headers":[{"name":"x-client","prefix":"beta/"}]},"subject":[],"capacity":1,"refill_per_sec":1},
                {"name":"anon","match":{"headers":[{"name":"authorization","present":false}]},"subject":[],"capacity":1,"refill_per_sec":1}
            ]}"#,
        )
        .unwrap();
        let mut r = request("GET", "/");
        assert_eq!(keys(&plan_all(&c, &r, &Subject::default(), "a")), ["anon"]);
        r.headers.insert("x-tier".into(), b"free".to_vec());
        r.headers.insert("x-client".into(), b"beta/2".to_vec());
        r.headers
            .insert("authorization".into(), b"Bearer x".to_vec());
        assert_eq!(
            keys(&plan_all(&c, &r, &Subject::default(), "a")),
            ["free", "beta"]
        );
        r.headers.insert("x-tier".into(), b"freemium".to_vec());
        r.headers.insert("x-client".into(), vec![0xff, b'b']);
        assert!(plan_all(&c, &r, &Subject::default(), "a").is_empty());
    }

    fn rule(subject: Vec<Dimension>) -> Rule {
        Rule {
            name: "r".into(),
            matcher: Match::default(),
            subject,
            capacity: 1,
            refill_per_sec: 1.0,
            cost: 1,
            on_error: Default::default(),
            emergency: None,
        }
    }

    #[test]
    fn keys_cannot_collide_through_separators() {
        let r = rule(vec![Dimension::User, Dimension::Tenant]);
        let a = Subject {
            user: Some("a|tenant=b".into()),
            tenant: Some("c".into()),
            ..Subject::default()
        };
        let b = Subject {
            user: Some("a".into()),
            tenant: Some("b|tenant=c".into()),
            ..Subject::default()
        };
        let ka = bucket_key(&r, &a).unwrap();
        let kb = bucket_key(&r, &b).unwrap();
        assert_ne!(ka, kb);
        assert_eq!(ka, "r|user=a%7Ctenant%3Db|tenant=c");
        let pct = Subject {
            user: Some("a%7Ctenant%3Db".into()),
            tenant: Some("c".into()),
            ..Subject::default()
        };
        assert_ne!(bucket_key(&r, &pct).unwrap(), ka);
        let braces = Subject {
            user: Some("{x} y".into()),
            tenant: Some("t".into()),
            ..Subject::default()
        };
        assert_eq!(
            bucket_key(&r, &braces).unwrap(),
            "r|user=%7Bx%7D%20y|tenant=t"
        );
    }

    #[test]
    fn long_values_are_hashed_and_keys_stay_bounded() {
        let r = Rule {
            name: "n".repeat(64),
            ..rule(vec![
                Dimension::User,
                Dimension::Tenant,
                Dimension::App,
                Dimension::Ip,
                Dimension::Route,
            ])
        };
        let long = "é".repeat(2000);
        let s = Subject {
            user: Some(long.clone()),
            tenant: Some("x".repeat(MAX_KEY_VALUE_BYTES + 1)),
            app: Some("x".repeat(MAX_KEY_VALUE_BYTES)),
            ip: Some("|".repeat(27)),
            route: Some("r".into()),
        };
        let k = bucket_key(&r, &s).unwrap();
        assert!(k.len() <= ratelimit_wire::MAX_KEY_BYTES, "{}", k.len());
        assert!(
            k.contains(&format!("|user#{}", sha256_hex(long.as_bytes()))),
            "{k}"
        );
        assert!(k.contains("|tenant#"), "{k}");
        assert!(
            k.contains(&format!("|app={}", "x".repeat(MAX_KEY_VALUE_BYTES))),
            "{k}"
        );
        assert!(k.contains("|ip#"), "{k}");
        assert!(k.ends_with("|route=r"), "{k}");
        // The hashed form of one value is never the plain form of another.
        let plain = Subject {
            user: Some(format!("#{}", sha256_hex(long.as_bytes()))),
            ..s.clone()
        };
        assert_ne!(bucket_key(&r, &plain).unwrap(), k);
    }

    #[test]
    fn a_global_rule_has_one_key() {
        assert_eq!(
            bucket_key(&rule(vec![]), &Subject::default()).as_deref(),
            Some("r")
        );
    }

    #[test]
    fn a_matching_rule_skipped_for_an_unknown_subject_is_reported() {
        let c = example();
        let m = matching(&c, &request("GET", "/api/x"));
        assert_eq!(m, [0, 1]);
        let p = plan(&c, &m, &subject(None, Some("10.0.0.1")), || "a".into());
        assert!(p.subject_unknown);
        assert_eq!(keys(&p.planned), ["per-ip|ip=10.0.0.1"]);
        let p = plan(&c, &m, &subject(Some("alpha"), Some("10.0.0.1")), || {
            "a".into()
        });
        assert!(!p.subject_unknown);
        // A rule that does not match is not "skipped".
        let m = matching(&c, &request("DELETE", "/api/x"));
        let p = plan(&c, &m, &subject(None, Some("10.0.0.1")), || "a".into());
        assert!(!p.subject_unknown);
    }

    #[test]
    fn the_attempt_id_is_built_only_when_there_are_decisions() {
        let c = example();
        let m = matching(&c, &request("GET", "/api/x"));
        let p = plan(&c, &m, &Subject::default(), || {
            panic!("no decision, no attempt id")
        });
        assert!(p.planned.is_empty());
        assert!(p.subject_unknown);
        let mut calls = 0;
        let p = plan(&c, &m, &subject(Some("alpha"), Some("::1")), || {
            calls += 1;
            "rid@1".into()
        });
        assert_eq!(calls, 1);
        assert_eq!(p.planned[1].decision.attempt.as_deref(), Some("rid@1"));
    }

    #[test]
    fn needs_name_only_the_dimensions_of_the_matching_rules() {
        let c = example();
        assert_eq!(
            needs(&c, &[1]),
            Needs {
                ip: true,
                ..Needs::default()
            }
        );
        assert_eq!(
            needs(&c, &[0, 1]),
            Needs {
                app: true,
                ip: true,
                ..Needs::default()
            }
        );
        assert_eq!(needs(&c, &[]), Needs::default());
    }

    #[test]
    fn the_callout_body_is_a_decide_request() {
        let c = example();
        let p = plan_all(
            &c,
            &request("GET", "/api/x"),
            &subject(Some("alpha"), Some("10.0.0.1")),
            "rid@1",
        );
        let owned = ratelimit_wire::DecideRequest {
            decisions: p.iter().map(|p| p.decision.clone()).collect(),
        };
        assert_eq!(
            serde_json::to_string(&DecideRequestRef { decisions: &p }).unwrap(),
            serde_json::to_string(&owned).unwrap()
        );
    }
}
