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
use crate::identity::Subject;

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
    /// `<domain>/<rule>|<dimension>=<value>|...`, see [`bucket_id`]; the domain keeps two plugins
    /// that share a `vm_id` apart.
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
            id: format!("{}/{}", config.domain, bucket_id(rule, subject)),
            subject: wire,
            cost: rule.cost.tokens(),
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
    key.push_str(d.as_str());
    ratelimit_wire::names::push_value(key, value, MAX_KEY_VALUE_BYTES);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::example;
    use crate::config::{Config, MAX_RULE_NAME_BYTES};
    use crate::identity::sha256_hex;
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

    /// A wire subject from `(dimension, value)` pairs.
    fn wire(entries: &[(&str, Option<&str>)]) -> WireSubject {
        WireSubject(
            entries
                .iter()
                .map(|(d, v)| (d.to_string(), v.map(str::to_string)))
                .collect(),
        )
    }

    /// Plans every matching rule, as the host does.
    fn plan_all(c: &Config, r: &RequestFacts, s: &Subject) -> Plan {
        plan(c, &matching(c, r), s)
    }

    /// The planned ids without their `<domain>/` (the domain has no `/`).
    fn ids(planned: &[Planned]) -> Vec<&str> {
        planned
            .iter()
            .map(|p| p.id.split_once('/').map_or(p.id.as_str(), |(_, id)| id))
            .collect()
    }

    /// The example with its rule 0 (`per-app`, by `app`) set to `on_unknown`.
    fn example_with(on_unknown: UnknownPolicy) -> Config {
        let mut c = example();
        c.rules[0].on_unknown = on_unknown;
        c
    }

    #[test]
    fn both_rules_of_the_example_apply_to_an_api_get() {
        let c = example();
        let p = plan_all(
            &c,
            &request("GET", "/api/items?x=1"),
            &subject(Some("alpha"), Some("10.0.0.1")),
        );
        assert_eq!(
            p,
            Plan {
                planned: vec![
                    Planned {
                        rule: 0,
                        subject: wire(&[("app", Some("alpha"))]),
                        cost: 1,
                        id: "ratelimit/per-app|app=alpha".into(),
                    },
                    Planned {
                        rule: 1,
                        subject: wire(&[("ip", Some("10.0.0.1"))]),
                        cost: 1,
                        id: "ratelimit/per-ip|ip=10.0.0.1".into(),
                    },
                ],
                subject_unknown: false,
                reject: None,
            }
        );
    }

    #[test]
    fn a_planned_decision_is_the_documented_wire_decision() {
        // The host sends each planned entry as a decision naming its rule (see the wire's
        // documented request).
        let c = example();
        let p = plan_all(
            &c,
            &request("POST", "/api/items"),
            &subject(Some("alpha"), Some("10.0.0.1")),
        );
        let decision = ratelimit_wire::Decision {
            receipt: false,
            rule: c.rules[p.planned[0].rule].name.clone(),
            subject: p.planned[0].subject.clone(),
            cost: p.planned[0].cost,
            lease: None,
        };
        assert_eq!(
            serde_json::to_string(&decision).unwrap(),
            r#"{"rule":"per-app","subject":{"app":"alpha"},"cost":1}"#
        );
    }

    #[test]
    fn the_cost_is_the_rules() {
        let mut c = example();
        c.rules[1].cost = crate::config::Cost::Fixed(7);
        let p = plan_all(&c, &request("GET", "/"), &subject(None, Some("::1")));
        assert_eq!(p.planned.len(), 1);
        assert_eq!((p.planned[0].rule, p.planned[0].cost), (1, 7));
    }

    #[test]
    fn method_and_path_prefix_must_fit() {
        let c = example();
        let s = subject(Some("alpha"), Some("10.0.0.1"));
        for (method, path) in [
            ("DELETE", "/api/x"),
            ("GET", "/apix"),
            ("GET", "/other?/api/"),
            ("GET", "/other#/api/"),
            ("get", "/api/x"),
        ] {
            assert_eq!(
                ids(&plan_all(&c, &request(method, path), &s).planned),
                ["per-ip|ip=10.0.0.1"],
                "{method} {path}"
            );
        }
        assert_eq!(matching(&c, &request("POST", "/api/")), [0, 1]);
        assert_eq!(matching(&c, &request("GET", "")), Vec::<usize>::new());
    }

    #[test]
    fn header_conditions() {
        let c = Config::from_json(
            br#"{"sidecar":{"cluster":"s"},"rules":[
                {"name":"free","match":{"headers":[{"name":"X-Tier","exact":"free"}]},"subject":[]},
                {"name":"beta","match":{"headers":[{"name":"x-client","prefix":"beta/"}]},"subject":[]},
                {"name":"anon","match":{"headers":[{"name":"authorization","present":false}]},"subject":[]}
            ]}"#,
        )
        .unwrap();
        let none = Subject::default();
        let mut r = request("GET", "/");
        assert_eq!(ids(&plan_all(&c, &r, &none).planned), ["anon"]);
        r.headers.insert("x-tier".into(), b"free".to_vec());
        r.headers.insert("x-client".into(), b"beta/2".to_vec());
        r.headers
            .insert("authorization".into(), b"Bearer x".to_vec());
        assert_eq!(ids(&plan_all(&c, &r, &none).planned), ["free", "beta"]);
        r.headers.insert("x-tier".into(), b"freemium".to_vec());
        r.headers.insert("x-client".into(), vec![0xff, b'b']);
        assert!(plan_all(&c, &r, &none).planned.is_empty());
    }

    #[test]
    fn on_unknown_shared_puts_every_unknown_client_in_one_bucket() {
        let c = example_with(UnknownPolicy::Shared);
        let a = plan_all(
            &c,
            &request("GET", "/api/x"),
            &subject(None, Some("10.0.0.1")),
        );
        let b = plan_all(
            &c,
            &request("GET", "/api/x"),
            &subject(None, Some("10.0.0.2")),
        );
        assert!(a.subject_unknown);
        assert_eq!(a.reject, None);
        assert_eq!(ids(&a.planned), ["per-app|app~", "per-ip|ip=10.0.0.1"]);
        assert_eq!(a.planned[0].subject, wire(&[("app", None)]));
        assert_eq!(
            serde_json::to_string(&a.planned[0].subject).unwrap(),
            r#"{"app":null}"#
        );
        // Another unknown client: the same bucket for per-app.
        assert_eq!(a.planned[0], b.planned[0]);
    }

    #[test]
    fn on_unknown_skip_leaves_the_rule_out() {
        let c = example_with(UnknownPolicy::Skip);
        let p = plan_all(&c, &request("GET", "/api/x"), &subject(None, Some("::1")));
        assert!(p.subject_unknown);
        assert_eq!(p.reject, None);
        assert_eq!(ids(&p.planned), ["per-ip|ip=::1"]);
        let p = plan_all(&c, &request("GET", "/api/x"), &subject(None, None));
        // per-ip is `shared` (the default): it still applies, to the shared unknown bucket.
        assert_eq!(ids(&p.planned), ["per-ip|ip~"]);
        // Known, the rule applies as usual.
        let p = plan_all(&c, &request("GET", "/api/x"), &subject(Some("alpha"), None));
        assert_eq!(ids(&p.planned), ["per-app|app=alpha", "per-ip|ip~"]);
    }

    #[test]
    fn on_unknown_reject_names_the_rule_and_plans_no_decision_for_it() {
        let c = example_with(UnknownPolicy::Reject);
        let p = plan_all(&c, &request("GET", "/api/x"), &subject(None, Some("::1")));
        assert!(p.subject_unknown);
        assert_eq!(p.reject, Some(0));
        assert_eq!(ids(&p.planned), ["per-ip|ip=::1"]);
        let p = plan_all(
            &c,
            &request("GET", "/api/x"),
            &subject(Some("alpha"), Some("::1")),
        );
        assert_eq!((p.subject_unknown, p.reject), (false, None));
        // A rule that does not match rejects nothing.
        let p = plan_all(
            &c,
            &request("DELETE", "/api/x"),
            &subject(None, Some("::1")),
        );
        assert_eq!((p.subject_unknown, p.reject), (false, None));
    }

    #[test]
    fn the_first_rejecting_rule_is_the_one_named() {
        let c = Config::from_json(
            br#"{"sidecar":{"cluster":"s"},
                 "identity":{"jwt":{"provider":"p","tenant_claim":"tenant"},"ip":true},
                 "rules":[
                   {"name":"skip","subject":["user"],"on_unknown":"skip"},
                   {"name":"shared","subject":["user"]},
                   {"name":"first","subject":["ip"],"on_unknown":"reject"},
                   {"name":"second","subject":["tenant"],"on_unknown":"reject","unknown_status":429},
                   {"name":"global","subject":[]}
                 ]}"#,
        )
        .unwrap();
        let all = matching(&c, &request("GET", "/"));
        assert_eq!(all, [0, 1, 2, 3, 4]);
        let p = plan(&c, &all, &Subject::default());
        assert_eq!(p.reject, Some(2));
        assert!(p.subject_unknown);
        assert_eq!(ids(&p.planned), ["shared|user~", "global"]);
        // Only the second one rejects once the ip is known.
        let ip_known = Subject {
            ip: Some("10.0.0.1".into()),
            ..Subject::default()
        };
        assert_eq!(plan(&c, &all, &ip_known).reject, Some(3));
        // In the order given, not by index.
        assert_eq!(plan(&c, &[3, 2], &Subject::default()).reject, Some(3));
    }

    #[test]
    fn the_wire_subject_keeps_the_rules_dimension_order_with_unknown_values() {
        let c = Config::from_json(
            br#"{"sidecar":{"cluster":"s"},
                 "identity":{"jwt":{"provider":"p","tenant_claim":"tenant"}},
                 "rules":[{"name":"r","subject":["tenant","user","route"]}]}"#,
        )
        .unwrap();
        let s = Subject {
            tenant: Some("acme".into()),
            route: Some("api".into()),
            ..Subject::default()
        };
        let p = plan(&c, &[0], &s);
        assert!(p.subject_unknown);
        let planned = &p.planned[0];
        assert_eq!(
            planned.subject,
            wire(&[
                ("tenant", Some("acme")),
                ("user", None),
                ("route", Some("api"))
            ])
        );
        assert_eq!(
            serde_json::to_string(&planned.subject).unwrap(),
            r#"{"tenant":"acme","user":null,"route":"api"}"#
        );
        assert_eq!(planned.id, "ratelimit/r|tenant=acme|user~|route=api");
    }

    fn rule(subject: Vec<Dimension>) -> Rule {
        Rule {
            name: "r".into(),
            matcher: Match::default(),
            subject,
            cost: crate::config::Cost::Fixed(1),
            on_unknown: UnknownPolicy::Shared,
            unknown_status: 401,
            on_error: Default::default(),
            emergency: None,
        }
    }

    #[test]
    fn ids_cannot_collide_through_separators() {
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
        let ka = bucket_id(&r, &a);
        assert_ne!(ka, bucket_id(&r, &b));
        assert_eq!(ka, "r|user=a%7Ctenant%3Db|tenant=c");
        let pct = Subject {
            user: Some("a%7Ctenant%3Db".into()),
            tenant: Some("c".into()),
            ..Subject::default()
        };
        assert_eq!(bucket_id(&r, &pct), "r|user=a%257Ctenant%253Db|tenant=c");
        let braces = Subject {
            user: Some("{x} y".into()),
            tenant: Some("t".into()),
            ..Subject::default()
        };
        assert_eq!(bucket_id(&r, &braces), "r|user=%7Bx%7D%20y|tenant=t");
        let kept = Subject {
            user: Some("Az09-._~:@/".into()),
            tenant: Some("é".into()),
            ..Subject::default()
        };
        assert_eq!(bucket_id(&r, &kept), "r|user=Az09-._~:@/|tenant=%C3%A9");
    }

    #[test]
    fn an_unknown_value_has_its_own_form_no_value_can_take() {
        let r = rule(vec![Dimension::User, Dimension::Tenant]);
        let unknown = Subject {
            tenant: Some("t".into()),
            ..Subject::default()
        };
        let id = bucket_id(&r, &unknown);
        assert_eq!(id, "r|user~|tenant=t");
        for value in ["~", "", "%7E", "user~"] {
            let known = Subject {
                user: Some(value.into()),
                ..unknown.clone()
            };
            assert_ne!(bucket_id(&r, &known), id, "{value:?}");
        }
        assert_eq!(bucket_id(&r, &Subject::default()), "r|user~|tenant~");
    }

    #[test]
    fn long_values_are_hashed_and_ids_stay_bounded() {
        let r = Rule {
            name: "n".repeat(MAX_RULE_NAME_BYTES),
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
            // 27 bytes, 81 escaped: one over.
            ip: Some("|".repeat(27)),
            route: Some("r".into()),
        };
        let id = bucket_id(&r, &s);
        assert!(
            id.contains(&format!("|user#{}", sha256_hex(long.as_bytes()))),
            "{id}"
        );
        assert!(
            id.contains(&format!("|tenant#{}|", sha256_hex(&[b'x'; 81]))),
            "{id}"
        );
        assert!(
            id.contains(&format!("|app={}|", "x".repeat(MAX_KEY_VALUE_BYTES))),
            "{id}"
        );
        assert!(id.contains("|ip#"), "{id}");
        assert!(id.ends_with("|route=r"), "{id}");
        // The documented bound: the rule name and five dimensions of at most 1 + 6 + 1 + 80.
        let bound = MAX_RULE_NAME_BYTES + 5 * (1 + "tenant".len() + 1 + MAX_KEY_VALUE_BYTES);
        assert_eq!(bound, 504);
        let widest = Subject {
            user: Some("x".repeat(MAX_KEY_VALUE_BYTES)),
            tenant: Some("x".repeat(MAX_KEY_VALUE_BYTES)),
            app: Some("x".repeat(MAX_KEY_VALUE_BYTES)),
            ip: Some("x".repeat(MAX_KEY_VALUE_BYTES)),
            route: Some("x".repeat(MAX_KEY_VALUE_BYTES)),
        };
        for s in [&s, &widest] {
            let id = bucket_id(&r, s);
            assert!(id.len() <= bound, "{} > {bound}", id.len());
        }
        // The hashed form of one value is never the plain form of another.
        let plain = Subject {
            user: Some(format!("#{}", sha256_hex(long.as_bytes()))),
            ..s.clone()
        };
        assert_ne!(bucket_id(&r, &plain), id);
    }

    #[test]
    fn a_global_rule_has_one_id() {
        assert_eq!(bucket_id(&rule(vec![]), &Subject::default()), "r");
        assert_eq!(
            bucket_id(&rule(vec![]), &subject(Some("a"), Some("b"))),
            "r"
        );
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
        let mut c = c;
        c.rules[0].subject = vec![Dimension::User, Dimension::Tenant, Dimension::Route];
        assert_eq!(
            needs(&c, &[0]),
            Needs {
                user: true,
                tenant: true,
                route: true,
                ..Needs::default()
            }
        );
    }
}
