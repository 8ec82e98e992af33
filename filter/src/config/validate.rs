//! The configuration's validation: [`Config::from_json`] parses, then every rule, identity and
//! fast-path setting is checked and every problem named with its field path.

use std::collections::BTreeSet;

use super::*;

impl Config {
    /// Parses and validates the plugin configuration. A JSON error names the field it happened
    /// at; otherwise every semantic problem is listed.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let config: Config = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            let path = if path == "." || path == "?" {
                "configuration".to_string()
            } else {
                path
            };
            ConfigError {
                problems: vec![Problem {
                    path,
                    message: e.into_inner().to_string(),
                }],
            }
        })?;
        config.validate()?;
        let mut config = config;
        // Header names are case-insensitive: lowercase them once here, not per request.
        for h in config
            .rules
            .iter_mut()
            .flat_map(|r| r.matcher.headers.iter_mut())
        {
            h.name.make_ascii_lowercase();
        }
        Ok(config)
    }

    /// The fields this configuration sets that no longer do anything, each with why: Envoy logs
    /// them as warnings, and the configuration is taken (docs/configuration.md#retired-fields).
    pub fn retired_fields(&self) -> Vec<String> {
        let mut retired = Vec::new();
        if self.sidecar.path.is_some() {
            retired.push("sidecar.path is ignored: decisions travel on each worker's gRPC stream, whose path is fixed; remove it".to_string());
        }
        if self.fast_paths.share_callouts.is_some() {
            retired.push("fast_paths.share_callouts is ignored: each worker has its own stream to the sidecar and sends its own requests; remove it".to_string());
        }
        retired
    }

    /// Every semantic problem of the configuration, with its field path.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut p = Problems::default();
        self.validate_sidecar(&mut p);
        self.validate_identity(&mut p);
        self.validate_rules(&mut p);
        self.validate_fast_paths(&mut p);
        if !is_name(&self.domain, 128) {
            p.add(
                "domain",
                format!(
                    "{:?} must be 1 to 128 characters of [A-Za-z0-9_.-]",
                    self.domain
                ),
            );
        }
        if !is_name(&self.stat_prefix, 128) || self.stat_prefix.starts_with('.') {
            p.add(
                "stat_prefix",
                format!(
                    "{:?} must be 1 to 128 characters of [A-Za-z0-9_.-], not starting with '.'",
                    self.stat_prefix
                ),
            );
        }
        p.into_result()
    }

    fn validate_sidecar(&self, p: &mut Problems) {
        let s = &self.sidecar;
        if s.cluster.trim().is_empty() {
            p.add("sidecar.cluster", "must name an Envoy cluster");
        }
        if s.timeout_ms == 0 || s.timeout_ms > MAX_TIMEOUT_MS {
            p.add(
                "sidecar.timeout_ms",
                format!(
                    "must be between 1 and {MAX_TIMEOUT_MS}, got {}",
                    s.timeout_ms
                ),
            );
        }
        if let Some(a) = &s.authority {
            if a.is_empty() || a.bytes().any(|b| b <= b' ' || b == 0x7f) {
                p.add(
                    "sidecar.authority",
                    "must be a non-empty host[:port] without spaces",
                );
            }
        }
        if let Some(t) = &s.token {
            if t.is_empty() || !t.bytes().all(|b| b.is_ascii_graphic()) {
                p.add(
                    "sidecar.token",
                    "must be non-empty printable ASCII without spaces",
                );
            }
        }
        if let Some(e) = &s.token_env {
            if e.is_empty() || e.contains('=') || e.contains('\0') {
                p.add("sidecar.token_env", "must name an environment variable");
            }
            if s.token.is_some() {
                p.add(
                    "sidecar.token_env",
                    "give either token or token_env, not both",
                );
            }
        }
    }

    fn validate_fast_paths(&self, p: &mut Problems) {
        let f = &self.fast_paths;
        if f.max_batch == 0 || f.max_batch > ratelimit_wire::MAX_REQUESTS {
            p.add(
                "fast_paths.max_batch",
                format!(
                    "must be 1 to {}, got {}",
                    ratelimit_wire::MAX_REQUESTS,
                    f.max_batch
                ),
            );
        }
        if f.max_in_flight == 0 || f.max_in_flight > 64 {
            p.add(
                "fast_paths.max_in_flight",
                format!("must be 1 to 64, got {}", f.max_in_flight),
            );
        }
        if f.max_rejection_ms == 0 || f.max_rejection_ms > 86_400_000 {
            p.add(
                "fast_paths.max_rejection_ms",
                format!("must be 1 to 86400000, got {}", f.max_rejection_ms),
            );
        }
        if f.policy_poll_ms > 60_000 {
            p.add(
                "fast_paths.policy_poll_ms",
                format!("must be 0 to 60000, got {}", f.policy_poll_ms),
            );
        }
        if f.slots == 0 || f.slots > 1 << 20 {
            p.add(
                "fast_paths.slots",
                format!("must be 1 to 1048576, got {}", f.slots),
            );
        }
        let l = &f.leases;
        if !(l.min_rate_per_sec.is_finite() && l.min_rate_per_sec > 0.0) {
            p.add("fast_paths.leases.min_rate_per_sec", "must be a number > 0");
        }
        if l.ttl_ms == 0 || l.ttl_ms > 60_000 {
            p.add(
                "fast_paths.leases.ttl_ms",
                format!("must be 1 to 60000, got {}", l.ttl_ms),
            );
        }
        if l.max_tokens == 0 || l.max_tokens > MAX_CAPACITY {
            p.add(
                "fast_paths.leases.max_tokens",
                format!("must be 1 to {MAX_CAPACITY}"),
            );
        }
    }

    fn validate_identity(&self, p: &mut Problems) {
        if !(1..=128).contains(&self.identity.ipv6_prefix_len) {
            p.add(
                "identity.ipv6_prefix_len",
                format!(
                    "must be between 1 and 128, got {}",
                    self.identity.ipv6_prefix_len
                ),
            );
        }
        if let Some(k) = &self.identity.api_key {
            if !is_header_name(&k.header) {
                p.add(
                    "identity.api_key.header",
                    format!("{:?} is not a valid header name", k.header),
                );
            } else if k.header.starts_with(':') {
                p.add(
                    "identity.api_key.header",
                    "must be a regular header, not a pseudo-header",
                );
            }
            if k.keys.is_empty() {
                p.add(
                    "identity.api_key.keys",
                    "must hold at least one key hash (an empty map names no application)",
                );
            }
            for (hash, app) in &k.keys {
                if hash.len() != 64 || !hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
                {
                    p.add(
                        "identity.api_key.keys",
                        format!(
                            "{hash:?} is not a lowercase hex SHA-256 (64 characters of 0-9a-f)"
                        ),
                    );
                }
                if app.is_empty() {
                    p.add(
                        format!("identity.api_key.keys.{hash}"),
                        "must name an application",
                    );
                }
            }
        }
        if let Some(j) = &self.identity.jwt {
            if j.provider.is_empty() {
                p.add(
                    "identity.jwt.provider",
                    "must be the payload_in_metadata name of jwt_authn",
                );
            }
            if j.user_claim.is_empty() {
                p.add("identity.jwt.user_claim", "must not be empty");
            }
            if j.tenant_claim.as_deref() == Some("") {
                p.add(
                    "identity.jwt.tenant_claim",
                    "must not be empty (omit it instead)",
                );
            }
        }
    }

    fn validate_rules(&self, p: &mut Problems) {
        if self.rules.is_empty() {
            p.add("rules", "must hold at least one rule");
        }
        if self.rules.len() > MAX_RULES {
            p.add(
                "rules",
                format!("at most {MAX_RULES} rules, got {}", self.rules.len()),
            );
        }
        let mut names = BTreeSet::new();
        for (i, rule) in self.rules.iter().enumerate() {
            let at = |field: &str| format!("rules[{i}].{field}");
            if !is_name(&rule.name, MAX_RULE_NAME_BYTES) {
                p.add(
                    at("name"),
                    format!(
                        "{:?} must be 1 to {MAX_RULE_NAME_BYTES} characters of [A-Za-z0-9_.-]",
                        rule.name
                    ),
                );
            } else if !names.insert(rule.name.as_str()) {
                p.add(at("name"), format!("duplicate rule name {:?}", rule.name));
            }
            self.validate_match(&rule.matcher, &at("match"), p);
            self.validate_subject(rule, &at("subject"), p);
            match &rule.cost {
                Cost::Fixed(0) => p.add(at("cost"), "must be > 0"),
                Cost::Fixed(n) if *n > MAX_CAPACITY => {
                    p.add(at("cost"), format!("must be at most {MAX_CAPACITY}"))
                }
                Cost::Fixed(_) => {}
                Cost::Settled(spec) => {
                    for (field, what) in spec.problems(&at("cost"), MAX_CAPACITY) {
                        p.add(field, what);
                    }
                }
            }
            if !matches!(rule.unknown_status, 401 | 429) {
                p.add(
                    at("unknown_status"),
                    format!("must be 401 or 429, got {}", rule.unknown_status),
                );
            }
            match (&rule.on_error, &rule.emergency) {
                (FailurePolicy::Local, None) => {
                    p.add(at("emergency"), "required when on_error is \"local\"")
                }
                (FailurePolicy::Local, Some(e)) => {
                    if e.capacity == 0 {
                        p.add(at("emergency.capacity"), "must be > 0");
                    } else if e.capacity > MAX_CAPACITY {
                        p.add(
                            at("emergency.capacity"),
                            format!("must be at most {MAX_CAPACITY}"),
                        );
                    } else if rule.cost.tokens() > e.capacity {
                        p.add(
                            at("emergency.capacity"),
                            format!(
                                "{} is less than the rule's cost {}: no request could ever pass",
                                e.capacity,
                                rule.cost.tokens()
                            ),
                        );
                    }
                    if !(e.refill_per_sec.is_finite() && e.refill_per_sec > 0.0) {
                        p.add(at("emergency.refill_per_sec"), "must be > 0");
                    } else {
                        check_refill_time(
                            e.capacity,
                            e.refill_per_sec,
                            &at("emergency.refill_per_sec"),
                            p,
                        );
                    }
                }
                (_, Some(_)) => p.add(
                    at("emergency"),
                    "only used when on_error is \"local\"; set on_error or remove it",
                ),
                (_, None) => {}
            }
        }
        self.validate_call_bytes(p);
    }

    /// An upper bound of the bytes a decision of `rule` spends in a call, each subject value at
    /// its longest: a claim or route name [`MAX_IDENTITY_BYTES`] (no control
    /// characters: 2 bytes a byte escaped at worst), an application its longest configured name,
    /// an address an IPv6 network.
    fn worst_decision_bytes(&self, rule: &Rule) -> usize {
        use ratelimit_wire::budget::str_bytes;
        let apps = self
            .identity
            .api_key
            .as_ref()
            .map(|k| k.keys.values().map(|n| str_bytes(n)).max().unwrap_or(4))
            .unwrap_or(4);
        let subject: usize = rule
            .subject
            .iter()
            .map(|d| {
                let value = match d {
                    Dimension::User | Dimension::Tenant | Dimension::Route => {
                        2 + 2 * MAX_IDENTITY_BYTES
                    }
                    Dimension::App => apps,
                    Dimension::Ip => 2 + "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff/128".len(),
                };
                str_bytes(d.as_str()) + 2 + value
            })
            .sum();
        // The largest cost, a lease ask and a receipt.
        128 + str_bytes(&rule.name) + 2 + subject
    }

    /// One request can match every rule, and its decisions must fit a call on their own (a
    /// batch of that one request: [`ratelimit_wire::budget`]).
    fn validate_call_bytes(&self, p: &mut Problems) {
        use ratelimit_wire::budget::{ITEMS_BYTES, MAX_BODY_BYTES};
        let worst: usize = 16
            + self
                .rules
                .iter()
                .map(|r| self.worst_decision_bytes(r))
                .sum::<usize>();
        if worst > ITEMS_BYTES {
            p.add(
                "rules",
                format!(
                    "a request matching every rule would carry up to {worst} bytes of decisions, \
                     more than a call to the sidecar holds ({ITEMS_BYTES} of its \
                     {MAX_BODY_BYTES}-byte body): use fewer rules, or fewer user, tenant and \
                     route dimensions (each up to {} bytes)",
                    MAX_IDENTITY_BYTES
                ),
            );
        }
    }

    fn validate_match(&self, m: &Match, at: &str, p: &mut Problems) {
        if !m.path_prefix.starts_with('/') {
            p.add(format!("{at}.path_prefix"), "must start with '/'");
        }
        if let Some(methods) = &m.methods {
            if methods.is_empty() {
                p.add(
                    format!("{at}.methods"),
                    "must list at least one method (omit it to match any method)",
                );
            }
            for (j, method) in methods.iter().enumerate() {
                if method.is_empty()
                    || method.len() > 32
                    || !method.bytes().all(|b| b.is_ascii_uppercase() || b == b'-')
                {
                    p.add(
                        format!("{at}.methods[{j}]"),
                        format!("{method:?} is not an uppercase HTTP method such as \"GET\""),
                    );
                }
            }
        }
        for (j, h) in m.headers.iter().enumerate() {
            if !is_header_name(&h.name) {
                p.add(
                    format!("{at}.headers[{j}].name"),
                    format!("{:?} is not a valid header name", h.name),
                );
            }
            let conditions = [h.exact.is_some(), h.prefix.is_some(), h.present.is_some()]
                .iter()
                .filter(|c| **c)
                .count();
            if conditions != 1 {
                p.add(
                    format!("{at}.headers[{j}]"),
                    "must have exactly one of \"exact\", \"prefix\", \"present\"",
                );
            }
        }
    }

    fn validate_subject(&self, rule: &Rule, at: &str, p: &mut Problems) {
        let mut seen = BTreeSet::new();
        for (j, d) in rule.subject.iter().enumerate() {
            if !seen.insert(*d) {
                p.add(
                    format!("{at}[{j}]"),
                    format!("duplicate dimension {:?}", d.as_str()),
                );
                continue;
            }
            let id = &self.identity;
            let missing = match d {
                Dimension::App if id.api_key.is_none() => Some("identity.api_key"),
                Dimension::User if id.jwt.is_none() => Some("identity.jwt"),
                Dimension::Tenant
                    if id
                        .jwt
                        .as_ref()
                        .and_then(|j| j.tenant_claim.as_ref())
                        .is_none() =>
                {
                    Some("identity.jwt.tenant_claim")
                }
                Dimension::Ip if !id.ip => Some("identity.ip: true"),
                _ => None,
            };
            if let Some(source) = missing {
                p.add(
                    format!("{at}[{j}]"),
                    format!(
                        "{:?} is never known without {source}: the rule could never tell clients apart",
                        d.as_str()
                    ),
                );
            }
        }
    }

    /// Whether some rule's `match.methods` looks at the request's method (else the host never
    /// reads `:method`: a host call per request saved).
    pub fn matches_methods(&self) -> bool {
        self.rules.iter().any(|r| r.matcher.methods.is_some())
    }

    /// Every request header some rule's `match.headers` looks at (lowercase), so the host reads
    /// only those.
    pub fn matched_header_names(&self) -> BTreeSet<String> {
        self.rules
            .iter()
            .flat_map(|r| r.matcher.headers.iter())
            .map(|h| h.name.to_ascii_lowercase())
            .collect()
    }
}

/// Refuses a refill so slow that a full refill (the `w` of `RateLimit-Policy`) takes more than
/// [`MAX_REFILL_S`].
fn check_refill_time(capacity: u64, refill_per_sec: f64, at: &str, p: &mut Problems) {
    let refill_s = capacity as f64 / refill_per_sec;
    if refill_s > MAX_REFILL_S {
        p.add(
            at,
            format!(
                "{refill_per_sec} is too slow: a full refill of {capacity} tokens would take \
                 {refill_s:.0} s, more than one year ({MAX_REFILL_S} s); raise refill_per_sec \
                 or lower capacity"
            ),
        );
    }
}

pub(crate) use ratelimit_wire::names::is_name;

/// An HTTP header name (RFC 9110 token), or an HTTP/2 pseudo-header such as `:authority`.
fn is_header_name(s: &str) -> bool {
    let name = s.strip_prefix(':').unwrap_or(s);
    !name.is_empty()
        && name.len() <= 256
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

#[derive(Default)]
struct Problems(Vec<Problem>);

impl Problems {
    fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }

    fn into_result(self) -> Result<(), ConfigError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ConfigError { problems: self.0 })
        }
    }
}
