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
//!   global-app:
//!     capacity: 1000           # with `regions`: the GLOBAL budget, all regions together
//!     refill_per_sec: 100
//!     regions: {eu: 0.6, us: 0.4}   # optional: initial shares per region (sum <= 1)
//!     region_floor: 0.05       # optional: the smallest share a region keeps (default 0.05)
//! ```
//!
//! A decision for rule `R` resolves to `R`'s first override whose `when` entries all appear in
//! the decision's subject with the same values, else to `R`'s own limit. Rule and override alike
//! are exactly one of: `capacity` with `refill_per_sec`, `unlimited: true`, `blocked: true`.
//! Envoy's native rate limit filter reaches these rules with descriptors whose first entry is
//! `rule` (e.g. a `generic_key` action with `descriptor_key: rule`).
//!
//! A rule may also limit its subjects' requests in flight across every gateway:
//! `concurrency: 5` (1 to 10000), with `slot_ttl_ms: 10000` (1000 to 300000, the default), beside
//! its rate or alone (its rate then unlimited); it holds for the rule's bucket overrides too, not
//! for its `unlimited` or `blocked` ones (`docs/concurrency.md`).
//!
//! A rule with `regions` has a global budget partitioned across regions (`docs/regions.md`):
//! each region's sidecars apply their region's share of the rule's numbers, and of its overrides'
//! numbers alike (`unlimited` and `blocked` overrides are not scaled). The shares are the initial
//! ones: once the rebalancer has written a region's share record, the record is in force.
//! Each share is in [`region_floor`, 1], they sum to at most 1, and a sidecar refuses a regional
//! rule that does not list its `--region`.

use std::collections::BTreeMap;
use std::sync::Arc;

use ratelimit_regions::{Budget, RegionalQuota, Share};
use serde::Deserialize;

use super::{
    check_bucket, deserialize, is_name, Bounds, Concurrency, Limit, LimitKind, Problems,
    RegionScope, Regional, Resolution, DEFAULT_SLOT_TTL_MS, MAX_CONCURRENCY, SLOT_TTL_MS_RANGE,
};

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
    /// Initial shares of the global budget per region. Default: none (not regional).
    #[serde(default)]
    regions: Option<BTreeMap<String, f64>>,
    /// The smallest share of a regional rule's region. Default 0.05
    /// ([`RegionalQuota::DEFAULT_FLOOR`]).
    #[serde(default)]
    region_floor: Option<f64>,
    /// The most requests of one subject in flight at once, across every gateway. Default: none.
    #[serde(default)]
    concurrency: Option<u64>,
    /// How long a slot stays held without a renewal. Default 10000 ([`DEFAULT_SLOT_TTL_MS`]).
    #[serde(default)]
    slot_ttl_ms: Option<u64>,
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
    limit: Arc<Limit>,
    /// (`when` entries, the limit), in file order.
    overrides: Vec<(When, Arc<Limit>)>,
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

    /// Each limit with `concurrency` (rules and overrides): its name and `slot_ttl_ms`.
    pub fn slot_ttls(&self) -> impl Iterator<Item = (&str, u64)> {
        self.rules
            .values()
            .flat_map(|r| std::iter::once(&r.limit).chain(r.overrides.iter().map(|(_, l)| l)))
            .filter_map(|l| l.concurrency.map(|c| (l.name.as_str(), c.slot_ttl_ms)))
    }

    /// The rules with regional shares.
    pub fn regional_rules(&self) -> Vec<Arc<Regional>> {
        self.rules
            .values()
            .filter_map(|r| r.limit.regional.clone())
            .collect()
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
        let concurrency = concurrency(&path, &spec, problems);
        // A rule may limit requests in flight alone: its rate is then unlimited.
        let alone = concurrency.is_some()
            && (own.capacity, own.refill_per_sec, own.unlimited, own.blocked)
                == (None, None, false, false);
        let kind = if alone {
            Some(LimitKind::Unlimited)
        } else {
            limit_kind(&path, &own, bounds, problems)
        };
        let Some(kind) = kind else {
            continue;
        };
        if concurrency.is_some() && (own.unlimited || own.blocked) {
            problems.add(
                format!("{path}.concurrency"),
                "an unlimited or blocked rule has no requests in flight to limit",
            );
        }
        if concurrency.is_some() && spec.regions.is_some() {
            problems.add(
                format!("{path}.concurrency"),
                "a regional rule cannot limit requests in flight (the slots are not partitioned across regions)",
            );
        }
        let regional = match &spec.regions {
            None => {
                if spec.region_floor.is_some() {
                    problems.add(
                        format!("{path}.region_floor"),
                        "only a rule with `regions` has a floor",
                    );
                }
                None
            }
            Some(regions) => regional(
                source,
                &file.domain,
                &name,
                kind,
                &spec.overrides,
                regions,
                spec.region_floor,
                bounds,
                problems,
            ),
        };
        let limit = Arc::new(Limit {
            name: name.clone(),
            kind,
            shadow: spec.shadow_mode,
            replaces: Vec::new(),
            regional: regional.clone(),
            concurrency,
        });
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
                    Arc::new(Limit {
                        name: oname,
                        kind,
                        shadow: spec.shadow_mode,
                        replaces: Vec::new(),
                        regional: regional
                            .clone()
                            .filter(|_| matches!(kind, LimitKind::Bucket { .. })),
                        // The rule's limit in flight holds for its bucket overrides too; an
                        // unlimited or blocked subject has none.
                        concurrency: concurrency
                            .filter(|_| matches!(kind, LimitKind::Bucket { .. })),
                    }),
                ));
            }
        }
        rules.insert(name, Rule { limit, overrides });
    }
    (problems.list.len() == before).then_some((file.domain, OwnDomain { rules }))
}

/// Validates a rule's `regions` (and `region_floor`) against its numbers and this sidecar's
/// region; records every problem.
#[allow(clippy::too_many_arguments)]
fn regional(
    source: &str,
    domain: &str,
    rule: &str,
    kind: LimitKind,
    overrides: &[OverrideSpec],
    regions: &BTreeMap<String, f64>,
    floor: Option<f64>,
    bounds: &Bounds,
    problems: &mut Problems,
) -> Option<Arc<Regional>> {
    let path = format!("{source}: rules.{rule}");
    let before = problems.list.len();
    let LimitKind::Bucket {
        capacity,
        refill_per_sec,
    } = kind
    else {
        problems.add(
            format!("{path}.regions"),
            "a regional rule needs capacity and refill_per_sec (its global budget)",
        );
        return None;
    };
    let floor = match floor {
        None => RegionalQuota::DEFAULT_FLOOR,
        Some(f) => Share::from_fraction(f).unwrap_or_else(|| {
            problems.add(
                format!("{path}.region_floor"),
                format!("must be a number in [0, 1], got {f}"),
            );
            RegionalQuota::DEFAULT_FLOOR
        }),
    };
    let mut shares = Vec::with_capacity(regions.len());
    for (region, &fraction) in regions {
        match Share::from_fraction(fraction) {
            Some(share) => shares.push((region.clone(), share)),
            None => problems.add(
                format!("{path}.regions.{region}"),
                format!("a share is a number in [0, 1], got {fraction}"),
            ),
        }
    }
    // The planner's view of the budget: refill rounded to whole tokens per second (it only weighs
    // demand with it); the buckets use the numbers as written.
    let budget = Budget {
        capacity,
        refill_per_sec: (refill_per_sec.round() as u64).max(1),
    };
    let quota = match RegionalQuota::new(rule, budget, floor, shares) {
        Ok(q) => Some(q),
        Err(e) => {
            for problem in e.0 {
                problems.add(source, problem.to_string());
            }
            None
        }
    };
    if let Some(q) = &quota {
        let listed = || q.regions().collect::<Vec<_>>().join(", ");
        match &bounds.region {
            RegionScope::Every => {}
            RegionScope::Sidecar(None) => problems.add(
                format!("{path}.regions"),
                format!(
                    "this sidecar has no region: start it with --region NAME (RATELIMIT_REGION), one of {}",
                    listed()
                ),
            ),
            RegionScope::Sidecar(Some(region)) if q.share(region).is_none() => problems.add(
                format!("{path}.regions"),
                format!(
                    "this sidecar's region {region:?} (--region) is not listed; add it, or start the sidecar with one of {}",
                    listed()
                ),
            ),
            RegionScope::Sidecar(Some(_)) => {}
        }
    }
    let fill_time = |capacity: u64, refill: f64| (capacity as f64 / refill * 1000.0).ceil();
    let fill_time_ms = overrides
        .iter()
        .filter_map(|o| Some(fill_time(o.capacity?, o.refill_per_sec?)))
        .fold(fill_time(capacity, refill_per_sec), f64::max) as u64;
    let quota = quota?;
    (problems.list.len() == before).then(|| {
        Arc::new(Regional {
            domain: domain.to_string(),
            rule: rule.to_string(),
            quota,
            capacity,
            refill_per_sec,
            fill_time_ms,
        })
    })
}

/// A rule's `concurrency` and `slot_ttl_ms`, validated; every problem recorded.
fn concurrency(path: &str, spec: &RuleSpec, problems: &mut Problems) -> Option<Concurrency> {
    let Some(limit) = spec.concurrency else {
        if spec.slot_ttl_ms.is_some() {
            problems.add(
                format!("{path}.slot_ttl_ms"),
                "only a rule with `concurrency` has slots",
            );
        }
        return None;
    };
    let before = problems.list.len();
    if !(1..=u64::from(MAX_CONCURRENCY)).contains(&limit) {
        problems.add(
            format!("{path}.concurrency"),
            format!("must be between 1 and {MAX_CONCURRENCY}, got {limit}"),
        );
    }
    let slot_ttl_ms = spec.slot_ttl_ms.unwrap_or(DEFAULT_SLOT_TTL_MS);
    if !SLOT_TTL_MS_RANGE.contains(&slot_ttl_ms) {
        problems.add(
            format!("{path}.slot_ttl_ms"),
            format!(
                "must be between {} and {}, got {slot_ttl_ms}",
                SLOT_TTL_MS_RANGE.start(),
                SLOT_TTL_MS_RANGE.end()
            ),
        );
    }
    (problems.list.len() == before).then_some(Concurrency {
        limit: limit as u32,
        slot_ttl_ms,
    })
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
    use super::super::{Policy, PolicyError, RegionScope, Resolution};
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

    fn in_region(text: &str, region: RegionScope) -> Result<Policy, PolicyError> {
        Policy::from_sources(
            &[("limits.yaml".into(), text.into())],
            &Bounds {
                region,
                ..Bounds::default()
            },
        )
    }

    const REGIONAL: &str = r#"
rules:
  global:
    capacity: 1000
    refill_per_sec: 100
    regions: {eu: 0.6, us: 0.4}
    overrides:
      - when: {app: alpha}
        capacity: 5000
        refill_per_sec: 50
      - when: {app: root}
        unlimited: true
  local: {capacity: 10, refill_per_sec: 1}
"#;

    #[test]
    fn a_regional_rule_and_its_bucket_overrides_carry_the_shares() {
        let p = in_region(REGIONAL, RegionScope::Sidecar(Some("eu".into()))).unwrap();
        let rules = p.regional_rules();
        assert_eq!(rules.len(), 1);
        let g = &rules[0];
        assert_eq!(
            (g.domain.as_str(), g.rule.as_str()),
            ("ratelimit", "global")
        );
        assert_eq!(g.quota.share("eu").map(|s| s.ppm()), Some(600_000));
        assert_eq!(g.quota.floor().ppm(), 50_000, "the default floor");
        assert_eq!(
            g.fill_time_ms, 100_000,
            "the override's 5000 / 50 is the longest"
        );
        let of = |app: &str| {
            limit(&p, &[("rule", Some("global")), ("app", Some(app))])
                .regional
                .clone()
        };
        assert_eq!(of("beta").as_deref(), Some(&**g));
        assert_eq!(
            of("alpha").as_deref(),
            Some(&**g),
            "overrides are scaled alike"
        );
        assert_eq!(of("root"), None, "unlimited is not scaled");
        assert_eq!(limit(&p, &[("rule", Some("local"))]).regional, None);
        // The rebalancer sees every region.
        assert!(in_region(REGIONAL, RegionScope::Every).is_ok());
    }

    #[test]
    fn a_regional_rule_needs_this_sidecars_region() {
        let e = in_region(REGIONAL, RegionScope::Sidecar(None))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("limits.yaml: rules.global.regions: this sidecar has no region: start it with --region NAME (RATELIMIT_REGION), one of eu, us"),
            "{e}"
        );
        let e = in_region(REGIONAL, RegionScope::Sidecar(Some("ap".into())))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "rules.global.regions: this sidecar's region \"ap\" (--region) is not listed"
            ),
            "{e}"
        );
        // A policy without regional rules needs no region.
        assert!(in_region(
            "rules:\n  a: {capacity: 1, refill_per_sec: 1}\n",
            RegionScope::Sidecar(None)
        )
        .is_ok());
    }

    #[test]
    fn a_rule_limits_requests_in_flight_beside_its_rate_or_alone() {
        let p = policy(
            r#"
rules:
  both:
    capacity: 10
    refill_per_sec: 1
    concurrency: 5
    overrides:
      - {when: {app: big}, capacity: 100, refill_per_sec: 10}
      - {when: {app: root}, unlimited: true}
  alone: {concurrency: 2, slot_ttl_ms: 1500}
  rate: {capacity: 10, refill_per_sec: 1}
"#,
        )
        .unwrap();
        let slots = |entries: &[(&str, Option<&str>)]| limit(&p, entries).concurrency;
        let five = Some(Concurrency {
            limit: 5,
            slot_ttl_ms: DEFAULT_SLOT_TTL_MS,
        });
        assert_eq!(slots(&[("rule", Some("both")), ("app", Some("x"))]), five);
        assert_eq!(slots(&[("rule", Some("both")), ("app", Some("big"))]), five);
        assert_eq!(
            slots(&[("rule", Some("both")), ("app", Some("root"))]),
            None
        );
        let alone = limit(&p, &[("rule", Some("alone"))]);
        assert_eq!(alone.kind, LimitKind::Unlimited);
        assert_eq!(
            alone.concurrency,
            Some(Concurrency {
                limit: 2,
                slot_ttl_ms: 1500
            })
        );
        assert_eq!(slots(&[("rule", Some("rate"))]), None);
    }

    #[test]
    fn concurrency_is_validated_with_every_problem_named() {
        let e = policy(
            r#"
rules:
  a: {concurrency: 0}
  b: {concurrency: 10001, slot_ttl_ms: 999}
  c: {capacity: 1, refill_per_sec: 1, slot_ttl_ms: 2000}
  d: {unlimited: true, concurrency: 3}
  e: {concurrency: 3, slot_ttl_ms: 300001}
"#,
        )
        .unwrap_err()
        .to_string();
        for needle in [
            "rules.a.concurrency: must be between 1 and 10000, got 0",
            "rules.b.concurrency: must be between 1 and 10000, got 10001",
            "rules.b.slot_ttl_ms: must be between 1000 and 300000, got 999",
            "rules.c.slot_ttl_ms: only a rule with `concurrency` has slots",
            "rules.d.concurrency: an unlimited or blocked rule",
            "rules.e.slot_ttl_ms: must be between 1000 and 300000, got 300001",
        ] {
            assert!(e.contains(needle), "{needle} missing in {e}");
        }
    }

    #[test]
    fn regional_shares_are_validated_with_every_problem_named() {
        let every = RegionScope::Every;
        let e = in_region(
            r#"
rules:
  a: {capacity: 10, refill_per_sec: 1, regions: {eu: 0.7, us: 0.5}}
  b: {capacity: 10, refill_per_sec: 1, regions: {eu: 1.5, "bad name": 0.1}}
  c: {capacity: 10, refill_per_sec: 1, regions: {eu: 0.5, us: 0.02}}
  d: {unlimited: true, regions: {eu: 1}}
  e: {capacity: 10, refill_per_sec: 1, region_floor: 0.1}
  f: {capacity: 10, refill_per_sec: 1, regions: {eu: 0.5, us: 0.5}, region_floor: 0.6}
  g: {capacity: 10, refill_per_sec: 1, regions: {}}
"#,
            every,
        )
        .unwrap_err()
        .to_string();
        for needle in [
            "rules.a.regions: the shares sum to 1200000 ppm (1.2)",
            "rules.b.regions.eu: a share is a number in [0, 1], got 1.5",
            "rules.b.regions: \"bad name\" is not a region name",
            "rules.c.regions.us: share 0.0200 is below the floor 0.0500",
            "rules.d.regions: a regional rule needs capacity and refill_per_sec",
            "rules.e.region_floor: only a rule with `regions` has a floor",
            "rules.f.region_floor: 0.6000 for 2 regions",
            "rules.g.regions: at least one region is required",
        ] {
            assert!(e.contains(needle), "{needle} missing in {e}");
        }
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
