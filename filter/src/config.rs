//! The plugin configuration: the JSON Envoy hands the filter (`configuration` of
//! `envoy.filters.http.wasm`), its defaults, and its validation.
//!
//! Every optional field has its default written next to it, once. [`Config::from_json`] refuses a
//! configuration that cannot be honoured and names every problem with its field path; it never
//! degrades into "allow everything".

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Deserialize;

/// The most rules one configuration may hold: every rule can become one decision of a request,
/// and the sidecar takes at most [`ratelimit_wire::MAX_DECISIONS`] per request.
pub const MAX_RULES: usize = ratelimit_wire::MAX_DECISIONS;

/// The longest rule name, in bytes (it is part of every bucket key and of a shared-data key).
pub const MAX_RULE_NAME_BYTES: usize = 64;

/// The largest integer of an RFC 8941 structured field (the `RateLimit` headers): 15 digits.
pub use ratelimit_wire::headers::MAX_SF_INTEGER;

/// The largest capacity: it appears as `q` in `RateLimit-Policy` (and stays below 2^53, exact in
/// the `f64` of the wire).
pub const MAX_CAPACITY: u64 = MAX_SF_INTEGER;

/// The longest full refill (`capacity / refill_per_sec`) accepted: one year, in seconds.
pub const MAX_REFILL_S: f64 = 31_536_000.0;

/// The longest callout timeout accepted, in milliseconds: a decision that takes longer than a
/// minute holds the request for nothing.
pub const MAX_TIMEOUT_MS: u64 = 60_000;

/// The whole plugin configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The policy domain the rules belong to in the sidecar's policy. Default: `"ratelimit"`.
    #[serde(default = "default_domain")]
    pub domain: String,
    /// Where decisions are asked for.
    pub sidecar: Sidecar,
    /// Where the request's identity comes from. Default: none of the sources (only `route` is
    /// known, and rules with an empty `subject`).
    #[serde(default)]
    pub identity: Identity,
    /// The limits. At least one, at most [`MAX_RULES`].
    pub rules: Vec<Rule>,
    /// Which responses carry the `RateLimit` / `RateLimit-Policy` headers. Default: `on_reject`.
    #[serde(default)]
    pub rate_limit_headers: RateLimitHeaders,
    /// The prefix of the filter's Envoy stats (`<stat_prefix>.admitted`, ...). Default:
    /// `"ratelimit"`.
    #[serde(default = "default_stat_prefix")]
    pub stat_prefix: String,
    /// The local fast paths: coalesced callouts, known rejections, leases. Default: all on.
    #[serde(default)]
    pub fast_paths: FastPaths,
}

fn default_domain() -> String {
    ratelimit_wire::DEFAULT_DOMAIN.to_string()
}

/// What the gateway may decide or batch locally without changing any verdict (see
/// `crate::fastpath` and `crate::coalesce` for why each is exact).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FastPaths {
    /// While a callout is in flight, further requests of the same worker wait and travel
    /// together in the next one. Default: true.
    #[serde(default = "yes")]
    pub coalesce: bool,
    /// The most requests one callout carries. Default: 64 (at most 256).
    #[serde(default = "default_max_batch")]
    pub max_batch: usize,
    /// Callouts in flight per worker at once. Default: 1.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// After a rejection, answer the same bucket and cost 429 locally until its `retry_after`.
    /// Default: true.
    #[serde(default = "yes")]
    pub known_rejections: bool,
    /// Leases of tokens for busy buckets.
    #[serde(default)]
    pub leases: Leases,
    /// Shared-data entries (per Envoy process) for known rejections and leases: bounds memory.
    /// Default: 4096.
    #[serde(default = "default_slots")]
    pub slots: usize,
}

impl Default for FastPaths {
    fn default() -> Self {
        FastPaths {
            coalesce: true,
            max_batch: default_max_batch(),
            max_in_flight: default_max_in_flight(),
            known_rejections: true,
            leases: Leases::default(),
            slots: default_slots(),
        }
    }
}

fn yes() -> bool {
    true
}

fn default_max_batch() -> usize {
    64
}

fn default_max_in_flight() -> usize {
    1
}

fn default_slots() -> usize {
    4096
}

/// Leases: a bucket busy at this gateway is served from tokens taken from Redis in advance.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Leases {
    /// Default: true.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// A bucket is busy once this gateway sees it this often (requests per second). Default: 50.
    #[serde(default = "default_min_rate")]
    pub min_rate_per_sec: f64,
    /// How long a lease is held, in milliseconds. Default: 1000.
    #[serde(default = "default_lease_ttl_ms")]
    pub ttl_ms: u64,
    /// The most tokens one lease asks for. Default: 1000. (The sidecar also caps a lease at
    /// `--lease-max-share` of the bucket's capacity.)
    #[serde(default = "default_lease_max_tokens")]
    pub max_tokens: u64,
}

impl Default for Leases {
    fn default() -> Self {
        Leases {
            enabled: true,
            min_rate_per_sec: default_min_rate(),
            ttl_ms: default_lease_ttl_ms(),
            max_tokens: default_lease_max_tokens(),
        }
    }
}

fn default_min_rate() -> f64 {
    50.0
}

fn default_lease_ttl_ms() -> u64 {
    1000
}

fn default_lease_max_tokens() -> u64 {
    1000
}

fn default_stat_prefix() -> String {
    "ratelimit".to_string()
}

/// The decision service, reached through an Envoy cluster.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sidecar {
    /// The Envoy cluster name of the sidecar (required).
    pub cluster: String,
    /// The whole callout's deadline, in milliseconds, counted from the request's arrival (its time
    /// in the coalescing queue included); past it the rule's `on_error` applies. Default: 50,
    /// above the sidecar's default `--redis-timeout-ms` of 30, so the sidecar answers 503 before
    /// Envoy gives up.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// The `:authority` of the callout. Default: the cluster name.
    #[serde(default)]
    pub authority: Option<String>,
    /// The `:path` of the callout. Default: [`ratelimit_wire::DECIDE_PATH`] (`/v1/decide`).
    #[serde(default)]
    pub path: Option<String>,
    /// A bearer token sent as `authorization: Bearer <token>` on every callout. Default: none.
    #[serde(default)]
    pub token: Option<String>,
    /// The environment variable holding that token, as the VM sees it (Envoy's
    /// `vm_config.environment_variables`). Default: none.
    #[serde(default)]
    pub token_env: Option<String>,
}

fn default_timeout_ms() -> u64 {
    50
}

impl Sidecar {
    /// The `:authority` to send: `authority`, or the cluster name.
    pub fn authority(&self) -> &str {
        self.authority.as_deref().unwrap_or(&self.cluster)
    }

    /// The `:path` to send: `path`, or [`ratelimit_wire::DECIDE_PATH`].
    pub fn path(&self) -> &str {
        self.path.as_deref().unwrap_or(ratelimit_wire::DECIDE_PATH)
    }
}

/// The trustworthy sources of identity. A source that is not configured names no one.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    /// `app`: an API key from a request header, known by its SHA-256. Default: absent.
    #[serde(default)]
    pub api_key: Option<ApiKey>,
    /// `user` / `tenant`: claims of a JWT verified by Envoy's `jwt_authn`. Default: absent.
    #[serde(default)]
    pub jwt: Option<Jwt>,
    /// `ip`: the downstream address Envoy computed (`source.address`). Default: false.
    #[serde(default)]
    pub ip: bool,
    /// The prefix length that keys an IPv6 client under `ip` (1 to 128): a client holds a whole
    /// prefix, not one address. IPv4 is keyed by the full address. Default: 64.
    #[serde(default = "default_ipv6_prefix_len")]
    pub ipv6_prefix_len: u8,
}

fn default_ipv6_prefix_len() -> u8 {
    64
}

impl Default for Identity {
    fn default() -> Self {
        Identity {
            api_key: None,
            jwt: None,
            ip: false,
            ipv6_prefix_len: default_ipv6_prefix_len(),
        }
    }
}

/// API keys: the header that carries one, and the keys that name an application.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// The request header holding the key (required), e.g. `x-api-key`.
    pub header: String,
    /// Lowercase hex SHA-256 of a key → the application it names (required, not empty). The keys
    /// themselves never appear in the configuration.
    pub keys: BTreeMap<String, String>,
}

/// JWT claims, as verified and published by Envoy's `jwt_authn` filter
/// (`payload_in_metadata: <provider>`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Jwt {
    /// The `payload_in_metadata` name given to `jwt_authn` (required).
    pub provider: String,
    /// The claim naming the user. Default: `"sub"`.
    #[serde(default = "default_user_claim")]
    pub user_claim: String,
    /// The claim naming the tenant. Default: absent (`tenant` is never known).
    #[serde(default)]
    pub tenant_claim: Option<String>,
}

fn default_user_claim() -> String {
    "sub".to_string()
}

/// One limit: a token bucket per distinct subject of the requests it matches.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Unique name, `[A-Za-z0-9_.-]`, at most 64 bytes (required). Part of every bucket key.
    pub name: String,
    /// Which requests the rule applies to. Default: every request.
    #[serde(rename = "match", default)]
    pub matcher: Match,
    /// The dimensions of the bucket key (required). Every one must be known for the rule to
    /// apply; `[]` makes one global bucket for the rule.
    pub subject: Vec<Dimension>,
    /// Tokens one request takes. Default: 1.
    #[serde(default = "default_cost")]
    pub cost: u64,
    /// What happens when a dimension of the subject is unknown (no token, an unknown API key, an
    /// unnamed route). Default: `shared`.
    #[serde(default)]
    pub on_unknown: UnknownPolicy,
    /// The status of a rejection for an unknown subject (`on_unknown: reject`): 401 or 429.
    /// Default: 401.
    #[serde(default = "default_unknown_status")]
    pub unknown_status: u32,
    /// What happens when the sidecar cannot decide. Default: `deny`.
    #[serde(default)]
    pub on_error: FailurePolicy,
    /// The local bucket used when `on_error` is `local` (required then, refused otherwise).
    #[serde(default)]
    pub emergency: Option<Emergency>,
}

fn default_cost() -> u64 {
    1
}

fn default_unknown_status() -> u32 {
    401
}

/// What a rule does for a request whose subject it cannot name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownPolicy {
    /// The rule does not apply (a client can escape it by not identifying itself).
    Skip,
    /// All unknown clients of the rule share one bucket. The default.
    #[default]
    Shared,
    /// The request is answered `unknown_status` (401 or 429).
    Reject,
}

/// Seconds an empty bucket of `capacity` takes to fill at `refill_per_sec`, rounded up (the `w` of
/// `RateLimit-Policy`; rendered by `ratelimit_wire::headers`, shared with the sidecar).
pub use ratelimit_wire::headers::window_s;

/// Which requests a rule applies to: all of the given conditions hold.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Match {
    /// The path (without query string) starts with this. Default: `"/"`.
    #[serde(default = "default_path_prefix")]
    pub path_prefix: String,
    /// The method is one of these (uppercase, exact). Default: any method.
    #[serde(default)]
    pub methods: Option<Vec<String>>,
    /// Every one of these header conditions holds. Default: none.
    #[serde(default)]
    pub headers: Vec<HeaderMatch>,
}

fn default_path_prefix() -> String {
    "/".to_string()
}

impl Default for Match {
    fn default() -> Self {
        Match {
            path_prefix: default_path_prefix(),
            methods: None,
            headers: Vec::new(),
        }
    }
}

/// One header condition: exactly one of `exact`, `prefix`, `present`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderMatch {
    /// The header name (required; matched case-insensitively: lowercased at load).
    pub name: String,
    /// The (first) value equals this.
    #[serde(default)]
    pub exact: Option<String>,
    /// The (first) value starts with this.
    #[serde(default)]
    pub prefix: Option<String>,
    /// `true`: the header is present; `false`: it is absent.
    #[serde(default)]
    pub present: Option<bool>,
}

/// One dimension of a subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dimension {
    /// The JWT's user claim.
    User,
    /// The JWT's tenant claim.
    Tenant,
    /// The application named by a known API key.
    App,
    /// The downstream IP address.
    Ip,
    /// Envoy's route name (`xds.route_name`).
    Route,
}

impl Dimension {
    /// The name used in configuration and bucket keys.
    pub fn as_str(self) -> &'static str {
        match self {
            Dimension::User => "user",
            Dimension::Tenant => "tenant",
            Dimension::App => "app",
            Dimension::Ip => "ip",
            Dimension::Route => "route",
        }
    }
}

/// What to do when the sidecar cannot decide (error status, malformed answer, timeout, no
/// cluster).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailurePolicy {
    /// Fail open: the rule lets the request pass.
    Allow,
    /// Fail closed: 503, the limiter is unavailable. The default, so a limiter outage never
    /// silently turns into "no limit".
    #[default]
    Deny,
    /// Take from the rule's emergency bucket, local to this Envoy process.
    Local,
}

/// The emergency bucket of a `local` rule: one per rule per Envoy process (shared by its workers).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Emergency {
    /// Bucket size in tokens (required, > 0, >= the rule's cost).
    pub capacity: u64,
    /// Tokens added per second (required, > 0).
    pub refill_per_sec: f64,
}

/// Which responses carry the `RateLimit` / `RateLimit-Policy` headers (a 429 always carries
/// `Retry-After` when waiting helps).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RateLimitHeaders {
    /// Rejections and admitted responses.
    Always,
    /// Rejections only. The default.
    #[default]
    OnReject,
    /// Never.
    Never,
}

/// One thing wrong with a configuration, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The field path, e.g. `rules[0].capacity`.
    pub path: String,
    /// What is wrong and what is expected.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// A configuration that cannot be honoured, with every problem found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", join(.problems))]
pub struct ConfigError {
    pub problems: Vec<Problem>,
}

fn join(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(Problem::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

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
        if let Some(path) = &s.path {
            if !path.starts_with('/') || path.bytes().any(|b| b <= b' ' || b == 0x7f) {
                p.add("sidecar.path", "must start with '/' and contain no spaces");
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
            if rule.cost == 0 {
                p.add(at("cost"), "must be > 0");
            } else if rule.cost > MAX_CAPACITY {
                p.add(at("cost"), format!("must be at most {MAX_CAPACITY}"));
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
                    } else if rule.cost > e.capacity {
                        p.add(
                            at("emergency.capacity"),
                            format!(
                                "{} is less than the rule's cost {}: no request could ever pass",
                                e.capacity, rule.cost
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
                        "{:?} is never known without {source}: the rule would never apply",
                        d.as_str()
                    ),
                );
            }
        }
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

/// `[A-Za-z0-9_.-]{1,max}`.
fn is_name(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// The plugin configuration of issue 3, verbatim.
    pub(crate) const ISSUE_EXAMPLE: &str = r#"{
      "sidecar": {"cluster": "ratelimit_sidecar", "timeout_ms": 25},
      "identity": {
        "api_key": {"header": "x-api-key",
                    "keys": {"677509799af78b2efa2f2af71d0f906e0a0c50c048efd3b515625f788e92b99a": "alpha"}},
        "jwt": {"provider": "example", "user_claim": "sub", "tenant_claim": "tenant"},
        "ip": true
      },
      "rules": [
        {"name": "per-app", "match": {"path_prefix": "/api/", "methods": ["GET", "POST"]},
         "subject": ["app"], "capacity": 100, "refill_per_sec": 10, "cost": 1,
         "on_error": "local", "emergency": {"capacity": 10, "refill_per_sec": 1}},
        {"name": "per-ip", "match": {"path_prefix": "/"}, "subject": ["ip"],
         "capacity": 1000, "refill_per_sec": 100, "on_error": "allow"}
      ]
    }"#;

    pub(crate) fn example() -> Config {
        Config::from_json(ISSUE_EXAMPLE.as_bytes()).expect("the issue's example is valid")
    }

    fn problems(json: &str) -> Vec<String> {
        match Config::from_json(json.as_bytes()) {
            Ok(_) => panic!("expected {json} to be refused"),
            Err(e) => e.problems.iter().map(Problem::to_string).collect(),
        }
    }

    /// The issue's example with `edit` applied to its JSON value.
    fn edited(edit: impl FnOnce(&mut serde_json::Value)) -> String {
        let mut v: serde_json::Value = serde_json::from_str(ISSUE_EXAMPLE).unwrap();
        edit(&mut v);
        v.to_string()
    }

    fn assert_has(problems: &[String], expected: &str) {
        assert!(
            problems.iter().any(|p| p == expected),
            "expected {expected:?} among {problems:#?}"
        );
    }

    #[test]
    fn the_issue_example_parses_with_its_defaults() {
        let c = example();
        assert_eq!(c.sidecar.cluster, "ratelimit_sidecar");
        assert_eq!(c.sidecar.timeout_ms, 25);
        assert_eq!(c.sidecar.authority(), "ratelimit_sidecar");
        assert_eq!(c.sidecar.path(), "/v1/decide");
        assert_eq!(c.rules.len(), 2);
        assert_eq!(c.rules[0].on_error, FailurePolicy::Local);
        assert_eq!(
            c.rules[0].emergency,
            Some(Emergency {
                capacity: 10,
                refill_per_sec: 1.0
            })
        );
        assert_eq!(c.rules[1].cost, 1);
        assert_eq!(c.rules[1].on_error, FailurePolicy::Allow);
        assert_eq!(
            c.rules[0].matcher.methods.as_deref().unwrap(),
            ["GET", "POST"]
        );
        assert_eq!(c.rate_limit_headers, RateLimitHeaders::OnReject);
        assert_eq!(c.stat_prefix, "ratelimit");
        assert!(c.identity.ip);
        assert_eq!(c.identity.jwt.as_ref().unwrap().user_claim, "sub");
        assert_eq!(c.rules[0].window_s(), 10);
    }

    #[test]
    fn defaults_of_a_minimal_config() {
        let c = Config::from_json(
            br#"{"sidecar":{"cluster":"s"},"rules":[{"name":"g","subject":[],"capacity":5,"refill_per_sec":0.5}]}"#,
        )
        .unwrap();
        assert_eq!(c.sidecar.timeout_ms, 25);
        assert_eq!(c.rules[0].matcher, Match::default());
        assert_eq!(c.rules[0].matcher.path_prefix, "/");
        assert_eq!(c.rules[0].cost, 1);
        assert_eq!(c.rules[0].on_error, FailurePolicy::Deny);
        assert_eq!(c.identity, Identity::default());
        assert_eq!(c.rules[0].window_s(), 10);
    }

    #[test]
    fn bad_json_is_refused() {
        let p = problems("{not json");
        assert_eq!(p.len(), 1);
        assert!(p[0].starts_with("configuration: "), "{p:?}");
    }

    #[test]
    fn an_unknown_field_is_refused_with_its_path() {
        let p = problems(&edited(|v| v["rules"][0]["capacty"] = 5.into()));
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].starts_with("rules[0]"), "{p:?}");
        assert!(p[0].contains("unknown field `capacty`"), "{p:?}");
    }

    #[test]
    fn a_wrong_type_names_its_field() {
        let p = problems(&edited(|v| v["rules"][1]["capacity"] = "lots".into()));
        assert!(p[0].starts_with("rules[1].capacity: invalid type"), "{p:?}");
    }

    #[test]
    fn an_unknown_subject_dimension_is_refused() {
        let p = problems(&edited(|v| {
            v["rules"][0]["subject"] = serde_json::json!(["country"])
        }));
        assert!(
            p[0].starts_with("rules[0].subject[0]: unknown variant `country`"),
            "{p:?}"
        );
    }

    #[test]
    fn every_semantic_problem_is_reported_at_once() {
        let p = problems(&edited(|v| {
            v["sidecar"]["timeout_ms"] = 0.into();
            v["rules"][0]["capacity"] = 0.into();
            v["rules"][0]["emergency"] = serde_json::Value::Null;
            v["rules"][1]["name"] = "per-app".into();
            v["identity"]["api_key"]["keys"] = serde_json::json!({"xyz": "alpha"});
        }));
        assert_has(&p, "sidecar.timeout_ms: must be between 1 and 60000, got 0");
        assert_has(&p, "rules[0].capacity: must be > 0");
        assert_has(
            &p,
            "rules[0].emergency: required when on_error is \"local\"",
        );
        assert_has(&p, "rules[1].name: duplicate rule name \"per-app\"");
        assert_has(
            &p,
            "identity.api_key.keys: \"xyz\" is not a lowercase hex SHA-256 (64 characters of 0-9a-f)",
        );
        let message = Config::from_json(
            edited(|v| {
                v["sidecar"]["timeout_ms"] = 0.into();
                v["rules"][0]["capacity"] = 0.into();
            })
            .as_bytes(),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            message,
            "sidecar.timeout_ms: must be between 1 and 60000, got 0; rules[0].capacity: must be > 0"
        );
    }

    #[test]
    fn uppercase_hex_key_hashes_are_refused() {
        let p = problems(&edited(|v| {
            v["identity"]["api_key"]["keys"] = serde_json::json!({
                "677509799AF78B2EFA2F2AF71D0F906E0A0C50C048EFD3B515625F788E92B99A": "alpha"})
        }));
        assert!(p[0].starts_with("identity.api_key.keys: "), "{p:?}");
    }

    #[test]
    fn empty_rules_are_refused() {
        let p = problems(&edited(|v| v["rules"] = serde_json::json!([])));
        assert_eq!(p, ["rules: must hold at least one rule"]);
    }

    #[test]
    fn cost_above_capacity_is_refused() {
        let p = problems(&edited(|v| {
            v["rules"][1]["cost"] = 1001.into();
        }));
        assert_has(
            &p,
            "rules[1].cost: 1001 exceeds capacity 1000: no request could ever pass",
        );
        let p = problems(&edited(|v| v["rules"][0]["cost"] = 11.into()));
        assert_has(
            &p,
            "rules[0].emergency.capacity: 10 is less than the rule's cost 11: no request could ever pass",
        );
    }

    #[test]
    fn invalid_methods_are_refused() {
        let p = problems(&edited(|v| {
            v["rules"][0]["match"]["methods"] = serde_json::json!(["GET", "post", ""])
        }));
        assert_has(
            &p,
            "rules[0].match.methods[1]: \"post\" is not an uppercase HTTP method such as \"GET\"",
        );
        assert_has(
            &p,
            "rules[0].match.methods[2]: \"\" is not an uppercase HTTP method such as \"GET\"",
        );
        let p = problems(&edited(|v| {
            v["rules"][0]["match"]["methods"] = serde_json::json!([])
        }));
        assert!(p[0].starts_with("rules[0].match.methods: "), "{p:?}");
    }

    #[test]
    fn header_conditions_need_exactly_one_kind() {
        let p = problems(&edited(|v| {
            v["rules"][1]["match"]["headers"] = serde_json::json!([
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
        assert!(!p.iter().any(|x| x.contains("headers[2]")), "{p:?}");
    }

    #[test]
    fn a_dimension_without_its_identity_source_is_refused() {
        let p = problems(&edited(|v| {
            v["identity"] = serde_json::json!({});
            v["rules"][0]["subject"] = serde_json::json!(["app", "user", "tenant", "route", "app"]);
        }));
        assert_has(&p, "rules[0].subject[0]: \"app\" is never known without identity.api_key: the rule would never apply");
        assert_has(&p, "rules[0].subject[1]: \"user\" is never known without identity.jwt: the rule would never apply");
        assert_has(&p, "rules[0].subject[2]: \"tenant\" is never known without identity.jwt.tenant_claim: the rule would never apply");
        assert_has(&p, "rules[0].subject[4]: duplicate dimension \"app\"");
        assert_has(&p, "rules[1].subject[0]: \"ip\" is never known without identity.ip: true: the rule would never apply");
        assert!(!p.iter().any(|x| x.contains("subject[3]")), "{p:?}");
    }

    #[test]
    fn bad_names_paths_and_emergency_misuse_are_refused() {
        let p = problems(&edited(|v| {
            v["rules"][0]["name"] = "a|b".into();
            v["rules"][0]["match"]["path_prefix"] = "api".into();
            v["rules"][0]["refill_per_sec"] = 0.into();
            v["rules"][1]["emergency"] = serde_json::json!({"capacity": 1, "refill_per_sec": 1});
            v["sidecar"]["path"] = "v1/decide".into();
            v["stat_prefix"] = "".into();
        }));
        assert_has(
            &p,
            "rules[0].name: \"a|b\" must be 1 to 64 characters of [A-Za-z0-9_.-]",
        );
        assert_has(&p, "rules[0].match.path_prefix: must start with '/'");
        assert_has(&p, "rules[0].refill_per_sec: must be > 0");
        assert_has(
            &p,
            "rules[1].emergency: only used when on_error is \"local\"; set on_error or remove it",
        );
        assert_has(
            &p,
            "sidecar.path: must start with '/' and contain no spaces",
        );
        assert!(p.iter().any(|x| x.starts_with("stat_prefix: ")), "{p:?}");
    }

    #[test]
    fn an_unknown_failure_policy_is_refused() {
        let p = problems(&edited(|v| v["rules"][0]["on_error"] = "ignore".into()));
        assert!(
            p[0].starts_with("rules[0].on_error: unknown variant `ignore`"),
            "{p:?}"
        );
    }

    #[test]
    fn matched_header_names_are_lowercased() {
        let c = Config::from_json(
            edited(|v| {
                v["rules"][1]["match"]["headers"] =
                    serde_json::json!([{"name": "X-Tier", "exact": "free"}])
            })
            .as_bytes(),
        )
        .unwrap();
        assert_eq!(
            c.matched_header_names().into_iter().collect::<Vec<_>>(),
            ["x-tier"]
        );
    }

    #[test]
    fn capacities_and_refills_stay_within_structured_field_integers() {
        let p = problems(&edited(|v| {
            v["rules"][1]["capacity"] = 1_000_000_000_000_000u64.into();
            v["rules"][0]["emergency"]["capacity"] = 1_000_000_000_000_000u64.into();
        }));
        assert_has(&p, "rules[1].capacity: must be at most 999999999999999");
        assert_has(
            &p,
            "rules[0].emergency.capacity: must be at most 999999999999999",
        );
        let p = problems(&edited(|v| {
            v["rules"][1]["refill_per_sec"] = 0.00001.into();
            v["rules"][0]["emergency"]["refill_per_sec"] = 0.0000001.into();
        }));
        assert_has(
            &p,
            "rules[1].refill_per_sec: 0.00001 is too slow: a full refill of 1000 tokens would take \
             100000000 s, more than one year (31536000 s); raise refill_per_sec or lower capacity",
        );
        assert!(
            p.iter()
                .any(|x| x.starts_with("rules[0].emergency.refill_per_sec: 0.0000001 is too slow")),
            "{p:?}"
        );
        // Exactly one year is accepted.
        Config::from_json(
            edited(|v| v["rules"][1]["refill_per_sec"] = (1000.0 / 31_536_000.0).into()).as_bytes(),
        )
        .unwrap();
    }

    #[test]
    fn the_ipv6_prefix_length_defaults_to_64_and_is_bounded() {
        assert_eq!(example().identity.ipv6_prefix_len, 64);
        assert_eq!(Identity::default().ipv6_prefix_len, 64);
        let p = problems(&edited(|v| v["identity"]["ipv6_prefix_len"] = 0.into()));
        assert_has(
            &p,
            "identity.ipv6_prefix_len: must be between 1 and 128, got 0",
        );
        let p = problems(&edited(|v| v["identity"]["ipv6_prefix_len"] = 129.into()));
        assert_has(
            &p,
            "identity.ipv6_prefix_len: must be between 1 and 128, got 129",
        );
        let c =
            Config::from_json(edited(|v| v["identity"]["ipv6_prefix_len"] = 128.into()).as_bytes())
                .unwrap();
        assert_eq!(c.identity.ipv6_prefix_len, 128);
    }

    #[test]
    fn header_names_are_lowercased_at_load() {
        let c = Config::from_json(
            edited(|v| {
                v["rules"][1]["match"]["headers"] =
                    serde_json::json!([{"name": "X-Tier", "exact": "Free"}])
            })
            .as_bytes(),
        )
        .unwrap();
        let h = &c.rules[1].matcher.headers[0];
        assert_eq!(
            (h.name.as_str(), h.exact.as_deref()),
            ("x-tier", Some("Free"))
        );
    }
}
