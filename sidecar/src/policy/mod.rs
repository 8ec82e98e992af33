//! The limits the sidecar owns: which limit applies to a decision, from one or more policy files.
//!
//! A decision is a domain and a list of entries (key, value): the wasm filter's decision for rule
//! `R` with subject `user=alice` is `[("rule", "R"), ("user", "alice")]`, and Envoy's native rate
//! limit filter sends descriptors of the same shape. Both resolve against the same policy and
//! name the same bucket, so a client limited through either draws from one budget.
//!
//! Two file formats, told apart by their top-level keys:
//! - [`own_format`] (`rules:`): a limit per rule name, with overrides by subject value;
//! - [`envoy_format`] (`descriptors:`): envoyproxy/ratelimit's configuration, unchanged, each
//!   fixed window mapped to a token bucket (capacity = `requests_per_unit`, refill =
//!   `requests_per_unit / unit`).
//!
//! [`reload`] keeps the policy in force and swaps in a new one when the files change (file watch
//! and SIGHUP); an invalid new policy leaves the old one in force.

pub mod envoy_format;
pub mod own_format;
pub mod reload;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ratelimit_regions::RegionalQuota;

/// The largest capacity: `q` of `RateLimit-Policy` is an RFC 8941 integer (15 digits).
pub const MAX_CAPACITY: u64 = 999_999_999_999_999;

/// The default bound on a full refill (`capacity / refill_per_sec`): one year, as the filter's
/// emergency buckets. It bounds how long any key lives in Redis.
pub const DEFAULT_MAX_REFILL_S: f64 = 31_536_000.0;

/// The longest limit or rule name, in bytes (the wire's: the filter checks names by it).
pub use ratelimit_wire::MAX_NAME_BYTES;

/// One limit, as a decision is judged by it.
#[derive(Debug, Clone, PartialEq)]
pub struct Limit {
    /// Names the limit in metrics (a label of bounded cardinality: never a subject value),
    /// `RateLimit-Policy` headers and logs.
    pub name: String,
    pub kind: LimitKind,
    /// Decide and count, never reject.
    pub shadow: bool,
    /// Names of limits this one replaces when both apply to one request (envoyproxy/ratelimit's
    /// `replaces`).
    pub replaces: Vec<String>,
    /// The rule's budget is partitioned across regions: this region applies its share of the
    /// bucket's numbers (the rule's and its overrides' alike). `None`: the whole limit.
    pub regional: Option<Arc<Regional>>,
    /// At most this many requests of one subject in flight at once, across every gateway
    /// (`docs/concurrency.md`). `None`: not limited in flight.
    pub concurrency: Option<Concurrency>,
}

/// A limit on requests in flight: slots taken at admission, released when the stream ends, held
/// under a lease of `slot_ttl_ms` the gateway renews (`docs/concurrency.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Concurrency {
    /// The most slots held at once (`concurrency`, 1 to [`MAX_CONCURRENCY`]).
    pub limit: u32,
    /// How long a slot stays held without a renewal (`slot_ttl_ms`): the bound on how long a dead
    /// gateway's slots stay taken.
    pub slot_ttl_ms: u64,
}

/// The largest `concurrency`.
pub const MAX_CONCURRENCY: u32 = 10_000;
/// The default `slot_ttl_ms`.
pub const DEFAULT_SLOT_TTL_MS: u64 = 10_000;
/// The range of `slot_ttl_ms`.
pub const SLOT_TTL_MS_RANGE: std::ops::RangeInclusive<u64> = 1_000..=300_000;

/// A rule whose `capacity` and `refill_per_sec` are a global budget partitioned across regions
/// (this sidecar's format, `regions:`). Each region applies its share of the budget, read from
/// its Redis under a lease (`crate::regional`); `quota` holds the initial shares.
#[derive(Debug, Clone, PartialEq)]
pub struct Regional {
    pub domain: String,
    pub rule: String,
    /// The initial shares (in force until a share record exists) and the floor, validated.
    pub quota: RegionalQuota,
    /// The rule's global budget, as written (`quota` holds it rounded for the rebalancer's
    /// planning).
    pub capacity: u64,
    pub refill_per_sec: f64,
    /// The longest fill time (`capacity / refill_per_sec`) of the rule and its overrides, in
    /// milliseconds: how far back a bucket looks at the share history, so how much of it the
    /// share record keeps.
    pub fill_time_ms: u64,
}

/// Which region's view a policy is loaded with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegionScope {
    /// A sidecar's (`--region`): every regional rule must list it; `None` refuses regional rules.
    Sidecar(Option<String>),
    /// Every region's (the rebalancer): no region is checked.
    Every,
}

/// What a limit does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LimitKind {
    /// A token bucket.
    Bucket { capacity: u64, refill_per_sec: f64 },
    /// Always admitted; nothing is counted in Redis.
    Unlimited,
    /// Never admitted.
    Blocked,
}

/// How a decision resolves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Resolution<'a> {
    /// Shared (an `Arc`), so a decision holds the policy's limit without copying it.
    Limit(&'a Arc<Limit>),
    /// The domain is known but no limit matches these entries (Envoy's API: no limit applies).
    NoLimit,
    /// No policy file defines the domain.
    UnknownDomain,
}

/// Bounds every policy must respect.
#[derive(Debug, Clone, PartialEq)]
pub struct Bounds {
    /// The longest full refill accepted, in seconds (`--max-refill-seconds`).
    pub max_refill_s: f64,
    /// The region the policy is loaded for (`--region`): a regional rule must list it.
    pub region: RegionScope,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            max_refill_s: DEFAULT_MAX_REFILL_S,
            region: RegionScope::Sidecar(None),
        }
    }
}

/// SHA-256 of the texts, each preceded by its length, folded to 53 bits (never 0).
fn epoch<'a>(texts: impl Iterator<Item = &'a str>) -> u64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for text in texts {
        h.update((text.len() as u64).to_le_bytes());
        h.update(text.as_bytes());
    }
    let digest = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    (u64::from_le_bytes(first) & ((1 << 53) - 1)).max(1)
}

/// The policy in force: every domain of every file.
#[derive(Debug, Default)]
pub struct Policy {
    domains: BTreeMap<String, Domain>,
    /// [`Policy::epoch`].
    epoch: u64,
}

#[derive(Debug)]
enum Domain {
    Own(own_format::OwnDomain),
    Envoy(envoy_format::EnvoyDomain),
}

/// One thing wrong with a policy, and where: `<file>: <path>: <message>`.
pub use ratelimit_wire::names::Problem;

/// A policy that cannot be loaded, with every problem found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", .problems.iter().map(Problem::to_string).collect::<Vec<_>>().join("; "))]
pub struct PolicyError {
    pub problems: Vec<Problem>,
}

/// Collects problems under a path prefix.
#[derive(Debug, Default)]
pub(crate) struct Problems {
    list: Vec<Problem>,
}

impl Problems {
    pub(crate) fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.list.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }
}

impl Policy {
    /// Reads and validates the policy files.
    pub fn load(paths: &[PathBuf], bounds: &Bounds) -> Result<Policy, PolicyError> {
        let mut sources = Vec::with_capacity(paths.len());
        for path in paths {
            match std::fs::read_to_string(path) {
                Ok(text) => sources.push((path.display().to_string(), text)),
                Err(e) => {
                    return Err(PolicyError {
                        problems: vec![Problem {
                            path: path.display().to_string(),
                            message: format!("cannot read the policy file: {e}"),
                        }],
                    })
                }
            }
        }
        Policy::from_sources(&sources, bounds)
    }

    /// Parses and validates policy documents: (where it came from, YAML text).
    pub fn from_sources(
        sources: &[(String, String)],
        bounds: &Bounds,
    ) -> Result<Policy, PolicyError> {
        let mut policy = Policy::default();
        let mut problems = Problems::default();
        let mut seen: BTreeMap<String, String> = BTreeMap::new();
        for (source, text) in sources {
            let parsed = parse_document(source, text, bounds, &mut problems);
            let Some((name, domain)) = parsed else {
                continue;
            };
            if let Some(first) = seen.insert(name.clone(), source.clone()) {
                problems.add(
                    format!("{source}: domain"),
                    format!("domain {name:?} is already defined in {first}; one file per domain"),
                );
                continue;
            }
            policy.domains.insert(name, domain);
        }
        if sources.is_empty() {
            problems.add("--limits", "at least one policy file is required");
        }
        policy.epoch = epoch(sources.iter().map(|(_, text)| text.as_str()));
        if problems.list.is_empty() {
            Ok(policy)
        } else {
            Err(PolicyError {
                problems: problems.list,
            })
        }
    }

    /// The policy's epoch: a content hash of its files' text in order (not their paths, so two
    /// sidecars with the same files agree), never 0, below 2^53. The filter's fast paths stop
    /// using what they learned under another epoch (docs/fast-paths.md#policy-reloads).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The limit for `entries` in `domain`.
    pub fn resolve(&self, domain: &str, entries: &[(&str, Option<&str>)]) -> Resolution<'_> {
        match self.domains.get(domain) {
            None => Resolution::UnknownDomain,
            Some(Domain::Own(d)) => d.resolve(entries),
            Some(Domain::Envoy(d)) => d.resolve(entries),
        }
    }

    /// The domains defined, in order.
    pub fn domains(&self) -> impl Iterator<Item = &str> {
        self.domains.keys().map(String::as_str)
    }

    /// The rules whose budget is partitioned across regions, by domain and rule name.
    pub fn regional_rules(&self) -> Vec<Arc<Regional>> {
        self.domains
            .values()
            .filter_map(|d| match d {
                Domain::Own(d) => Some(d.regional_rules()),
                Domain::Envoy(_) => None,
            })
            .flatten()
            .collect()
    }

    /// The `slot_ttl_ms` of each limit name with `concurrency` (the largest where a name is
    /// used twice).
    pub fn slot_ttls(&self) -> std::collections::HashMap<String, u64> {
        let mut ttls = std::collections::HashMap::new();
        for d in self.domains.values() {
            if let Domain::Own(d) = d {
                for (name, ttl) in d.slot_ttls() {
                    let t = ttls.entry(name.to_string()).or_insert(ttl);
                    *t = (*t).max(ttl);
                }
            }
        }
        ttls
    }

    /// How many limits the policy defines (defaults and overrides).
    pub fn limit_count(&self) -> usize {
        self.domains
            .values()
            .map(|d| match d {
                Domain::Own(d) => d.limit_count(),
                Domain::Envoy(d) => d.limit_count(),
            })
            .sum()
    }
}

/// Parses one document into its domain, or records its problems.
fn parse_document(
    source: &str,
    text: &str,
    bounds: &Bounds,
    problems: &mut Problems,
) -> Option<(String, Domain)> {
    let value: serde_yaml_ng::Value = match serde_yaml_ng::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            problems.add(source, format!("not valid YAML: {e}"));
            return None;
        }
    };
    let is_own = value.get("rules").is_some();
    let is_envoy = value.get("descriptors").is_some();
    match (is_own, is_envoy) {
        (true, false) => own_format::parse(source, text, bounds, problems)
            .map(|(name, d)| (name, Domain::Own(d))),
        (false, true) => envoy_format::parse(source, text, bounds, problems)
            .map(|(name, d)| (name, Domain::Envoy(d))),
        (true, true) => {
            problems.add(
                source,
                "has both `rules` (this sidecar's format) and `descriptors` (envoyproxy/ratelimit's format); use one per file",
            );
            None
        }
        (false, false) => {
            problems.add(
                source,
                "needs `rules:` (this sidecar's format) or `domain:` with `descriptors:` (envoyproxy/ratelimit's format)",
            );
            None
        }
    }
}

/// Deserialises `text` as `T`, naming the field of an error: `<source>: rules.per-app.capacity: ...`.
pub(crate) fn deserialize<T: serde::de::DeserializeOwned>(
    source: &str,
    text: &str,
    problems: &mut Problems,
) -> Option<T> {
    let de = serde_yaml_ng::Deserializer::from_str(text);
    match serde_path_to_error::deserialize(de) {
        Ok(v) => Some(v),
        Err(e) => {
            let path = e.path().to_string();
            let at = if path == "." || path.is_empty() {
                source.to_string()
            } else {
                format!("{source}: {path}")
            };
            // serde_yaml_ng puts its own (shorter) path in front of its message: say it once.
            let message = e.into_inner().to_string();
            let message = match message.split_once(": ") {
                Some((head, rest)) if !head.contains(' ') && path.starts_with(head) => {
                    rest.to_string()
                }
                _ => message,
            };
            problems.add(at, message);
            None
        }
    }
}

/// Checks a bucket's numbers; records problems under `path`.
pub(crate) fn check_bucket(
    path: &str,
    capacity: u64,
    refill_per_sec: f64,
    bounds: &Bounds,
    problems: &mut Problems,
) {
    if capacity == 0 || capacity > MAX_CAPACITY {
        problems.add(
            format!("{path}.capacity"),
            format!("must be between 1 and {MAX_CAPACITY}, got {capacity}"),
        );
    }
    if !(refill_per_sec.is_finite() && refill_per_sec > 0.0) {
        problems.add(
            format!("{path}.refill_per_sec"),
            format!("must be a number > 0, got {refill_per_sec}"),
        );
    } else if capacity > 0 && capacity as f64 / refill_per_sec > bounds.max_refill_s {
        problems.add(
            format!("{path}.refill_per_sec"),
            format!(
                "a full refill (capacity / refill_per_sec = {:.0} s) may take at most {} s (--max-refill-seconds): raise refill_per_sec",
                capacity as f64 / refill_per_sec,
                bounds.max_refill_s
            ),
        );
    }
}

/// Whether `name` is a usable limit or rule name: 1 to [`MAX_NAME_BYTES`] of `[A-Za-z0-9_.-]`.
pub(crate) fn is_name(name: &str) -> bool {
    ratelimit_wire::names::is_name(name, MAX_NAME_BYTES)
}

/// The files a policy is read from, for messages.
pub fn describe(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p: &PathBuf| Path::new(p).display().to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_epoch_is_the_files_content_not_their_paths() {
        let bounds = Bounds::default();
        let doc = "rules:\n  r: {capacity: 5, refill_per_sec: 1}\n";
        let at = |path: &str, text: &str| {
            Policy::from_sources(&[(path.to_string(), text.to_string())], &bounds)
                .unwrap()
                .epoch()
        };
        assert_eq!(at("/a/limits.yaml", doc), at("/b/other.yaml", doc));
        assert_ne!(
            at("/a/limits.yaml", doc),
            at("/a/limits.yaml", &doc.replace('5', "6"))
        );
        assert!(at("x", doc) > 0 && at("x", doc) < 1 << 53);
    }

    fn load(docs: &[&str]) -> Result<Policy, PolicyError> {
        let sources: Vec<(String, String)> = docs
            .iter()
            .enumerate()
            .map(|(i, d)| (format!("file{i}.yaml"), d.to_string()))
            .collect();
        Policy::from_sources(&sources, &Bounds::default())
    }

    #[test]
    fn both_formats_load_side_by_side_and_domains_are_unique() {
        let p = load(&[
            "rules:\n  per-app: {capacity: 10, refill_per_sec: 1}\n",
            "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: second, requests_per_unit: 5}\n",
        ])
        .unwrap();
        assert_eq!(p.domains().collect::<Vec<_>>(), ["edge", "ratelimit"]);
        let e = load(&[
            "rules:\n  a: {capacity: 1, refill_per_sec: 1}\n",
            "domain: ratelimit\ndescriptors: []\n",
        ])
        .unwrap_err();
        assert!(
            e.to_string().contains("already defined in file0.yaml"),
            "{e}"
        );
    }

    #[test]
    fn a_file_of_neither_format_is_refused() {
        let e = load(&["domain: x\n"]).unwrap_err();
        assert!(
            e.to_string().starts_with("file0.yaml: needs `rules:`"),
            "{e}"
        );
        let e = load(&["rules: {}\ndescriptors: []\n"]).unwrap_err();
        assert!(e.to_string().contains("use one per file"), "{e}");
        let e = load(&["{not yaml"]).unwrap_err();
        assert!(e.to_string().contains("not valid YAML"), "{e}");
        assert!(load(&[]).is_err());
    }

    #[test]
    fn unknown_domains_resolve_as_such() {
        let p = load(&["rules:\n  a: {capacity: 1, refill_per_sec: 1}\n"]).unwrap();
        assert_eq!(
            p.resolve("other", &[("rule", Some("a"))]),
            Resolution::UnknownDomain
        );
    }

    #[test]
    fn refill_time_is_bounded() {
        let e = load(&["rules:\n  slow: {capacity: 1000, refill_per_sec: 0.00001}\n"]).unwrap_err();
        assert!(
            e.to_string()
                .contains("file0.yaml: rules.slow.refill_per_sec: a full refill"),
            "{e}"
        );
    }
}
