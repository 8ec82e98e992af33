//! envoyproxy/ratelimit's configuration format, read unchanged, so an operator can switch services
//! with the same file:
//!
//! ```yaml
//! domain: edge
//! descriptors:
//!   - key: remote_address
//!     rate_limit: {unit: second, requests_per_unit: 10}
//!   - key: rule
//!     value: per-user
//!     descriptors:
//!       - key: user
//!         rate_limit: {name: per-user, unit: minute, requests_per_unit: 600}
//!       - key: user
//!         value: root
//!         rate_limit: {unlimited: true}
//! ```
//!
//! Matching follows envoyproxy/ratelimit: each entry of a request's descriptor picks, one level
//! deeper, the child with that key and value, else a child whose value is a prefix pattern
//! (`value: "acme-*"`) that matches, else the child with that key and no value; the limit is the
//! one of the node the last entry reached. A fixed window becomes a token bucket:
//! `capacity = requests_per_unit`, `refill_per_sec = requests_per_unit / unit` (second, minute,
//! hour, day, week = 7 days, month = 30 days, year = 365 days): the same average rate, the same
//! burst, without the window's edge (a fixed window admits up to twice its limit across a window
//! boundary; the bucket never does). `requests_per_unit: 0` blocks; `unlimited: true` admits
//! without counting. `shadow_mode` and `replaces` mean what they mean there. Not honoured:
//! `detailed_metric` and `value_to_metric` (metrics never carry descriptor values, to bound their
//! cardinality), and a limit sent inside a request's descriptor (a caller never chooses its limit).

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Deserializer};

use super::{check_bucket, deserialize, is_name, Bounds, Limit, LimitKind, Problems, Resolution};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    domain: String,
    #[serde(default)]
    descriptors: Vec<DescriptorSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DescriptorSpec {
    key: String,
    #[serde(default)]
    value: Option<String>,
    #[serde(default)]
    rate_limit: Option<RateLimitSpec>,
    #[serde(default)]
    descriptors: Vec<DescriptorSpec>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    detailed_metric: bool,
    #[serde(default)]
    value_to_metric: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RateLimitSpec {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<ReplacesSpec>,
    #[serde(default)]
    unit: Option<Unit>,
    #[serde(default)]
    requests_per_unit: Option<u64>,
    #[serde(default)]
    unlimited: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplacesSpec {
    name: String,
}

/// A window length, case-insensitive as envoyproxy/ratelimit reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl Unit {
    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }
}

impl<'de> Deserialize<'de> for Unit {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(match s.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            "year" => Unit::Year,
            _ => {
                return Err(serde::de::Error::custom(format_args!(
                    "unknown unit {s:?}: second, minute, hour, day, week, month or year"
                )))
            }
        })
    }
}

/// One domain in envoyproxy/ratelimit's format.
#[derive(Debug)]
pub struct EnvoyDomain {
    root: Node,
    limits: usize,
}

#[derive(Debug, Default)]
struct Node {
    /// Children by key and value (`None`: the key's default, matching any value).
    exact: HashMap<(String, Option<String>), Node>,
    /// Children whose value is a prefix pattern (`acme-*`), in file order.
    prefixed: Vec<(String, String, Node)>,
    limit: Option<Arc<Limit>>,
}

impl Node {
    fn child(&self, key: &str, value: Option<&str>) -> Option<&Node> {
        if let Some(v) = value {
            if let Some(n) = self.exact.get(&(key.to_string(), Some(v.to_string()))) {
                return Some(n);
            }
            if let Some((_, _, n)) = self
                .prefixed
                .iter()
                .find(|(k, prefix, _)| k == key && v.starts_with(prefix.as_str()))
            {
                return Some(n);
            }
        }
        self.exact.get(&(key.to_string(), None))
    }
}

impl EnvoyDomain {
    pub fn resolve(&self, entries: &[(&str, Option<&str>)]) -> Resolution<'_> {
        let mut node = &self.root;
        for (i, (key, value)) in entries.iter().enumerate() {
            let Some(next) = node.child(key, *value) else {
                return Resolution::NoLimit;
            };
            if i + 1 == entries.len() {
                return next
                    .limit
                    .as_ref()
                    .map_or(Resolution::NoLimit, Resolution::Limit);
            }
            node = next;
        }
        Resolution::NoLimit
    }

    pub fn limit_count(&self) -> usize {
        self.limits
    }
}

/// Parses a document of this format: (domain, tree), or records its problems.
pub(crate) fn parse(
    source: &str,
    text: &str,
    bounds: &Bounds,
    problems: &mut Problems,
) -> Option<(String, EnvoyDomain)> {
    let file: File = deserialize(source, text, problems)?;
    let before = problems.list.len();
    // A call names its domain in at most MAX_NAME_BYTES: a longer one could never be reached,
    // and its limits would silently never apply.
    if file.domain.is_empty() || file.domain.len() > super::MAX_NAME_BYTES {
        problems.add(
            format!("{source}: domain"),
            format!(
                "must be 1 to {} bytes (calls name their domain in at most that), got {}",
                super::MAX_NAME_BYTES,
                file.domain.len()
            ),
        );
    }
    let mut limits = 0;
    let mut root = Node::default();
    build(
        &mut root,
        file.descriptors,
        &format!("{source}: descriptors"),
        "",
        bounds,
        problems,
        &mut limits,
    );
    (problems.list.len() == before).then_some((file.domain, EnvoyDomain { root, limits }))
}

fn build(
    parent: &mut Node,
    specs: Vec<DescriptorSpec>,
    path: &str,
    name_prefix: &str,
    bounds: &Bounds,
    problems: &mut Problems,
    limits: &mut usize,
) {
    for (i, spec) in specs.into_iter().enumerate() {
        let here = format!("{path}[{i}]");
        if spec.key.is_empty() {
            problems.add(format!("{here}.key"), "must not be empty");
            continue;
        }
        let _ = (spec.detailed_metric, spec.value_to_metric);
        // The derived name of a limit without `name`: its path of keys (and configured values).
        let segment = match &spec.value {
            Some(v) => format!("{}_{}", spec.key, v),
            None => spec.key.clone(),
        };
        let derived = if name_prefix.is_empty() {
            segment
        } else {
            format!("{name_prefix}.{segment}")
        };
        let mut node = Node::default();
        if let Some(rl) = &spec.rate_limit {
            let kind = match (rl.unlimited, rl.unit, rl.requests_per_unit) {
                (true, None, None) => Some(LimitKind::Unlimited),
                (true, _, _) => {
                    problems.add(
                        format!("{here}.rate_limit"),
                        "unlimited: true takes no unit or requests_per_unit",
                    );
                    None
                }
                (false, Some(_), Some(0)) => Some(LimitKind::Blocked),
                (false, Some(unit), Some(rpu)) => {
                    let refill = rpu as f64 / unit.seconds() as f64;
                    let before = problems.list.len();
                    check_bucket(&format!("{here}.rate_limit"), rpu, refill, bounds, problems);
                    (problems.list.len() == before).then_some(LimitKind::Bucket {
                        capacity: rpu,
                        refill_per_sec: refill,
                    })
                }
                (false, None, _) => {
                    problems.add(format!("{here}.rate_limit.unit"), "required");
                    None
                }
                (false, _, None) => {
                    problems.add(format!("{here}.rate_limit.requests_per_unit"), "required");
                    None
                }
            };
            let name = rl.name.clone().unwrap_or_else(|| derived.clone());
            if name.len() > super::MAX_NAME_BYTES || name.is_empty() {
                problems.add(format!("{here}.rate_limit.name"), "1 to 128 bytes");
            }
            let mut replaces = Vec::new();
            for (j, r) in rl.replaces.iter().enumerate() {
                if r.name.is_empty() {
                    problems.add(
                        format!("{here}.rate_limit.replaces[{j}].name"),
                        "must not be empty",
                    );
                }
                replaces.push(r.name.clone());
            }
            if let Some(kind) = kind {
                *limits += 1;
                node.limit = Some(Arc::new(Limit {
                    name: sanitize(&name),
                    kind,
                    shadow: spec.shadow_mode,
                    replaces,
                    regional: None,
                    concurrency: None,
                }));
            }
        }
        build(
            &mut node,
            spec.descriptors,
            &format!("{here}.descriptors"),
            &derived,
            bounds,
            problems,
            limits,
        );
        let duplicate = match spec.value.as_deref() {
            Some(v) if v.ends_with('*') => {
                let prefix = v.trim_end_matches('*').to_string();
                let dup = parent
                    .prefixed
                    .iter()
                    .any(|(k, p, _)| *k == spec.key && *p == prefix);
                if !dup {
                    parent.prefixed.push((spec.key.clone(), prefix, node));
                }
                dup
            }
            _ => parent
                .exact
                .insert((spec.key.clone(), spec.value.clone()), node)
                .is_some(),
        };
        if duplicate {
            problems.add(
                &here,
                format!(
                    "duplicate descriptor key {:?} value {:?} at this level",
                    spec.key, spec.value
                ),
            );
        }
    }
}

/// A limit name usable as a metric label and a header token: characters outside
/// `[A-Za-z0-9_.-]` become `_`.
fn sanitize(name: &str) -> String {
    if is_name(name) {
        return name.to_string();
    }
    name.chars()
        .map(|c| {
            if c.is_ascii() && ratelimit_wire::names::is_name_byte(c as u8) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::{Policy, PolicyError};
    use super::*;

    const EXAMPLE: &str = r#"
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

    fn policy(text: &str) -> Result<Policy, PolicyError> {
        Policy::from_sources(&[("rl.yaml".into(), text.into())], &Bounds::default())
    }

    fn resolve<'a>(p: &'a Policy, entries: &[(&str, Option<&str>)]) -> Resolution<'a> {
        p.resolve("edge", entries)
    }

    #[test]
    fn windows_map_to_buckets_of_the_same_rate_and_burst() {
        let p = policy(EXAMPLE).unwrap();
        let Resolution::Limit(l) = resolve(&p, &[("remote_address", Some("1.2.3.4"))]) else {
            panic!()
        };
        assert_eq!(
            l.kind,
            LimitKind::Bucket {
                capacity: 10,
                refill_per_sec: 10.0
            }
        );
        assert_eq!(l.name, "remote_address");
        let Resolution::Limit(l) =
            resolve(&p, &[("rule", Some("per-user")), ("user", Some("alice"))])
        else {
            panic!()
        };
        assert_eq!(
            (l.name.as_str(), l.kind),
            (
                "per-user",
                LimitKind::Bucket {
                    capacity: 600,
                    refill_per_sec: 10.0
                }
            )
        );
        assert_eq!(p.limit_count(), 5);
    }

    #[test]
    fn values_beat_prefixes_beat_defaults_and_zero_blocks() {
        let p = policy(EXAMPLE).unwrap();
        let kind =
            |user: &str| match resolve(&p, &[("rule", Some("per-user")), ("user", Some(user))]) {
                Resolution::Limit(l) => l.kind,
                other => panic!("{other:?}"),
            };
        assert_eq!(kind("root"), LimitKind::Unlimited);
        assert_eq!(kind("bot-7"), LimitKind::Blocked);
        assert!(matches!(kind("bob"), LimitKind::Bucket { .. }));
    }

    #[test]
    fn a_descriptor_that_stops_early_or_goes_too_deep_matches_nothing() {
        let p = policy(EXAMPLE).unwrap();
        assert_eq!(
            resolve(&p, &[("rule", Some("per-user"))]),
            Resolution::NoLimit
        );
        assert_eq!(
            resolve(&p, &[("remote_address", Some("x")), ("path", Some("/"))]),
            Resolution::NoLimit
        );
        assert_eq!(resolve(&p, &[("nope", Some("x"))]), Resolution::NoLimit);
    }

    #[test]
    fn shadow_mode_and_replaces_are_kept() {
        let p = policy(EXAMPLE).unwrap();
        let Resolution::Limit(l) = resolve(&p, &[("header_match", Some("post"))]) else {
            panic!()
        };
        assert!(l.shadow);
        assert_eq!(l.replaces, ["per-user"]);
    }

    #[test]
    fn problems_are_named_by_path() {
        let e = policy(
            r#"
domain: edge
descriptors:
  - key: a
    rate_limit: {unit: fortnight, requests_per_unit: 1}
"#,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("descriptors[0].rate_limit.unit"),
            "{e}"
        );
        let e = policy(
            r#"
domain: edge
descriptors:
  - key: a
    rate_limit: {requests_per_unit: 1}
  - key: b
    rate_limit: {unlimited: true, unit: second, requests_per_unit: 1}
  - key: c
    value: x
  - key: c
    value: x
"#,
        )
        .unwrap_err();
        let text = e.to_string();
        let long = format!("domain: {}\ndescriptors: []\n", "d".repeat(129));
        for (text, needle) in [
            (long.as_str(), "rl.yaml: domain: must be 1 to 128 bytes"),
            (
                "domain: ''\ndescriptors: []\n",
                "rl.yaml: domain: must be 1 to 128 bytes",
            ),
        ] {
            let e = policy(text).unwrap_err().to_string();
            assert!(e.contains(needle), "{needle} missing in {e}");
        }
        assert!(policy(&format!("domain: {}\ndescriptors: []\n", "d".repeat(128))).is_ok());
        for needle in [
            "rl.yaml: descriptors[0].rate_limit.unit: required",
            "rl.yaml: descriptors[1].rate_limit: unlimited: true takes no unit",
            "rl.yaml: descriptors[3]: duplicate descriptor key",
        ] {
            assert!(text.contains(needle), "{needle} missing in {text}");
        }
    }
}
