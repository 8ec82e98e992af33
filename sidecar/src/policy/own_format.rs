//! This sidecar's policy format: a limit per rule name, with overrides by subject value.
//!
//! ```yaml
//! domain: ratelimit            # optional, default "ratelimit"
//! rules:
//!   per-app:
//!     capacity: 100            # tokens: the largest burst
//!     refill_per_sec: 10       # tokens per second: the sustained rate
//!     shadow_mode: false       # optional: decide and count, never reject
//!     overrides:               # optional; the first whose `when` holds wins
//!       - when: {app: alpha}
//!         capacity: 1000
//!         refill_per_sec: 100
//!       - when: {user: mallory}
//!         blocked: true
//!       - when: {user: root}
//!         unlimited: true
//!       - when: {app: null}    # every client the gateway could not name, together
//!         capacity: 50
//!         refill_per_sec: 5
//! ```
//!
//! A decision for rule `R` resolves to `R`'s first override whose `when` entries all appear in
//! the decision's subject with the same values, else to `R`'s own limit. Rule and override alike
//! are exactly one of: `capacity` with `refill_per_sec`, `unlimited: true`, `blocked: true`.
//! Envoy's native rate limit filter reaches these rules with descriptors whose first entry is
//! `rule` (e.g. a `generic_key` action with `descriptor_key: rule`).

use std::collections::BTreeMap;

use serde::Deserialize;

use super::{check_bucket, deserialize, is_name, Bounds, Limit, LimitKind, Problems, Resolution};

/// The entry key that names the rule in a decision.
pub const RULE_KEY: &str = "rule";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default = "default_domain")]
    domain: String,
    rules: BTreeMap<String, RuleSpec>,
}

fn default_domain() -> String {
    ratelimit_wire::DEFAULT_DOMAIN.to_string()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleSpec {
    #[serde(default)]
    capacity: Option<u64>,
    #[serde(default)]
    refill_per_sec: Option<f64>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    blocked: bool,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    overrides: Vec<OverrideSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OverrideSpec {
    when: BTreeMap<String, Option<String>>,
    /// Names the override in headers and metrics. Default: the rule's name.
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    capacity: Option<u64>,
    #[serde(default)]
    refill_per_sec: Option<f64>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    blocked: bool,
}

/// The limit fields a rule and an override share.
#[derive(Debug, Default)]
struct LimitSpec {
    capacity: Option<u64>,
    refill_per_sec: Option<f64>,
    unlimited: bool,
    blocked: bool,
}

/// An override's condition: dimensions and values (`None`: unknown).
type When = Vec<(String, Option<String>)>;

/// One domain in this format.
#[derive(Debug)]
pub struct OwnDomain {
    rules: BTreeMap<String, Rule>,
}

#[derive(Debug)]
struct Rule {
    limit: Limit,
    /// (`when` entries, the limit), in file order.
    overrides: Vec<(When, Limit)>,
}

impl OwnDomain {
    /// `entries[0]` must be `("rule", R)`; the rest is the subject.
    pub fn resolve(&self, entries: &[(&str, Option<&str>)]) -> Resolution<'_> {
        let Some((&(RULE_KEY, Some(name)), subject)) = entries.split_first() else {
            return Resolution::NoLimit;
        };
        let Some(rule) = self.rules.get(name) else {
            return Resolution::NoLimit;
        };
        let holds = |when: &[(String, Option<String>)]| {
            when.iter().all(|(k, v)| {
                subject
                    .iter()
                    .any(|(sk, sv)| *sk == k.as_str() && *sv == v.as_deref())
            })
        };
        let limit = rule
            .overrides
            .iter()
            .find(|(when, _)| holds(when))
            .map(|(_, l)| l)
            .unwrap_or(&rule.limit);
        Resolution::Limit(limit)
    }

    pub fn limit_count(&self) -> usize {
        self.rules.values().map(|r| 1 + r.overrides.len()).sum()
    }
}

/// Parses a document of this format: (domain, rules), or records its problems.
pub(crate) fn parse(
    source: &str,
    text: &str,
    bounds: &Bounds,
    problems: &mut Problems,
) -> Option<(String, OwnDomain)> {
    let file: File = deserialize(source, text, problems)?;
    let before = problems.list.len();
    if !is_name(&file.domain) {
        problems.add(
            format!("{source}: domain"),
            format!(
                "{:?} must be 1 to 128 characters of [A-Za-z0-9_.-]",
                file.domain
            ),
        );
    }
    let mut rules = BTreeMap::new();
    for (name, spec) in file.rules {
        let path = format!("{source}: rules.{name}");
        if !is_name(&name) {
            problems.add(
                &path,
                "a rule name is 1 to 128 characters of [A-Za-z0-9_.-]",
            );
        }
        let own = LimitSpec {
            capacity: spec.capacity,
            refill_per_sec: spec.refill_per_sec,
            unlimited: spec.unlimited,
            blocked: spec.blocked,
        };
        let Some(kind) = limit_kind(&path, &own, bounds, problems) else {
            continue;
        };
        let limit = Limit {
            name: name.clone(),
            kind,
            shadow: spec.shadow_mode,
            replaces: Vec::new(),
        };
        let mut overrides = Vec::new();
        for (i, o) in spec.overrides.into_iter().enumerate() {
            let opath = format!("{path}.overrides[{i}]");
            if o.when.is_empty() {
                problems.add(
                    format!("{opath}.when"),
                    "must name at least one dimension and value (an empty `when` would hide the rule's own limit)",
                );
            }
            for k in o.when.keys() {
                if k.is_empty() || k == RULE_KEY {
                    problems.add(format!("{opath}.when"), format!("{k:?} is not a dimension"));
                }
            }
            let oname = o.name.unwrap_or_else(|| name.clone());
            if !is_name(&oname) {
                problems.add(
                    format!("{opath}.name"),
                    "1 to 128 characters of [A-Za-z0-9_.-]",
                );
            }
            let spec_o = LimitSpec {
                capacity: o.capacity,
                refill_per_sec: o.refill_per_sec,
                unlimited: o.unlimited,
                blocked: o.blocked,
            };
            if let Some(kind) = limit_kind(&opath, &spec_o, bounds, problems) {
                overrides.push((
                    o.when.into_iter().collect(),
                    Limit {
                        name: oname,
                        kind,
                        shadow: spec.shadow_mode,
                        replaces: Vec::new(),
                    },
                ));
            }
        }
        rules.insert(name, Rule { limit, overrides });
    }
    (problems.list.len() == before).then_some((file.domain, OwnDomain { rules }))
}

fn limit_kind(
    path: &str,
    spec: &LimitSpec,
    bounds: &Bounds,
    problems: &mut Problems,
) -> Option<LimitKind> {
    match (
        spec.capacity,
        spec.refill_per_sec,
        spec.unlimited,
        spec.blocked,
    ) {
        (Some(capacity), Some(refill_per_sec), false, false) => {
            let before = problems.list.len();
            check_bucket(path, capacity, refill_per_sec, bounds, problems);
            (problems.list.len() == before).then_some(LimitKind::Bucket {
                capacity,
                refill_per_sec,
            })
        }
        (None, None, true, false) => Some(LimitKind::Unlimited),
        (None, None, false, true) => Some(LimitKind::Blocked),
        (Some(_), None, false, false) => {
            problems.add(format!("{path}.refill_per_sec"), "required with capacity");
            None
        }
        (None, Some(_), false, false) => {
            problems.add(format!("{path}.capacity"), "required with refill_per_sec");
            None
        }
        _ => {
            problems.add(
                path,
                "must be exactly one of: capacity with refill_per_sec, unlimited: true, blocked: true",
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Policy, PolicyError, Resolution};
    use super::*;

    const EXAMPLE: &str = r#"
rules:
  per-app:
    capacity: 100
    refill_per_sec: 10
    overrides:
      - when: {app: alpha}
        capacity: 1000
        refill_per_sec: 100
  per-user:
    capacity: 20
    refill_per_sec: 2
    shadow_mode: true
    overrides:
      - when: {user: mallory}
        blocked: true
      - when: {user: root}
        unlimited: true
      - when: {tenant: acme}
        name: acme-users
        capacity: 200
        refill_per_sec: 20
      - when: {user: null}
        name: anonymous
        capacity: 2
        refill_per_sec: 1
"#;

    fn policy(text: &str) -> Result<Policy, PolicyError> {
        Policy::from_sources(&[("limits.yaml".into(), text.into())], &Bounds::default())
    }

    fn limit<'a>(p: &'a Policy, entries: &[(&str, Option<&str>)]) -> &'a Limit {
        match p.resolve("ratelimit", entries) {
            Resolution::Limit(l) => l,
            other => panic!("{entries:?}: {other:?}"),
        }
    }

    #[test]
    fn rules_and_overrides_resolve_by_subject_value() {
        let p = policy(EXAMPLE).unwrap();
        let app = |a| limit(&p, &[("rule", Some("per-app")), ("app", Some(a))]).kind;
        assert_eq!(
            app("beta"),
            LimitKind::Bucket {
                capacity: 100,
                refill_per_sec: 10.0
            }
        );
        assert_eq!(
            app("alpha"),
            LimitKind::Bucket {
                capacity: 1000,
                refill_per_sec: 100.0
            }
        );
        let user = |u: Option<&'static str>, t: Option<&'static str>| {
            limit(
                &p,
                &[("rule", Some("per-user")), ("tenant", t), ("user", u)],
            )
            .clone()
        };
        assert_eq!(user(Some("mallory"), Some("acme")).kind, LimitKind::Blocked);
        assert_eq!(user(Some("root"), None).kind, LimitKind::Unlimited);
        let acme = user(Some("bob"), Some("acme"));
        assert_eq!(acme.name, "acme-users");
        assert!(acme.shadow, "overrides inherit the rule's shadow mode");
        assert_eq!(
            user(None, None).name,
            "anonymous",
            "null matches an unknown user"
        );
        assert_eq!(user(Some("bob"), None).name, "per-user");
        assert_eq!(p.limit_count(), 7);
    }

    #[test]
    fn an_unknown_rule_matches_no_limit() {
        let p = policy(EXAMPLE).unwrap();
        assert_eq!(
            p.resolve("ratelimit", &[("rule", Some("nope"))]),
            Resolution::NoLimit
        );
        assert_eq!(
            p.resolve("ratelimit", &[("app", Some("alpha"))]),
            Resolution::NoLimit
        );
        assert_eq!(p.resolve("ratelimit", &[]), Resolution::NoLimit);
    }

    #[test]
    fn every_problem_is_named_by_its_path() {
        let e = policy(
            r#"
rules:
  a: {capacity: 0, refill_per_sec: 1}
  b: {capacity: 5}
  c: {capacity: 5, refill_per_sec: 1, unlimited: true}
  "bad name": {blocked: true}
  d:
    capacity: 1
    refill_per_sec: 1
    overrides:
      - when: {}
        blocked: true
"#,
        )
        .unwrap_err();
        let text = e.to_string();
        for needle in [
            "limits.yaml: rules.a.capacity: must be between 1",
            "limits.yaml: rules.b.refill_per_sec: required with capacity",
            "limits.yaml: rules.c: must be exactly one of",
            "limits.yaml: rules.bad name: a rule name",
            "limits.yaml: rules.d.overrides[0].when: must name at least one",
        ] {
            assert!(text.contains(needle), "{needle} missing in {text}");
        }
        let e = policy("rules:\n  a: {capacity: 1, refill_per_sec: 1, colour: red}\n").unwrap_err();
        assert!(
            e.to_string()
                .contains("rules.a.colour: unknown field `colour`"),
            "{e}"
        );
        assert_eq!(
            e.to_string().matches("rules.a").count(),
            1,
            "the path once: {e}"
        );
        let e = policy("rules:\n  a: {capacity: -1, refill_per_sec: 1}\n").unwrap_err();
        assert!(e.to_string().contains("rules.a"), "{e}");
    }
}
