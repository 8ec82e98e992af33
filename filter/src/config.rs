//! The plugin configuration: the JSON Envoy hands the filter (`configuration` of
//! `envoy.filters.http.wasm`), its defaults, and its validation.
//!
//! Every optional field has its default written next to it, once. [`Config::from_json`] refuses a
//! configuration that cannot be honoured and names every problem with its field path; it never
//! degrades into "allow everything".

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Deserialize;

pub use crate::costs::CostSpec;

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

/// What the gateway may decide or batch locally without changing any verdict (docs/fast-paths.md
/// says why each is exact).
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
    /// With `coalesce`: the workers of one Envoy share callouts. One worker (the courier) sends
    /// the queued requests of every worker in its callouts and posts each answer back to the
    /// request's own worker, through proxy-wasm shared queues. Default: true.
    #[serde(default = "yes")]
    pub share_callouts: bool,
    /// After a rejection, answer the same bucket and cost 429 locally until its `retry_after`.
    /// Default: true.
    #[serde(default = "yes")]
    pub known_rejections: bool,
    /// How long a known rejection is answered locally at most, in milliseconds, before the
    /// next request asks again (a policy change that raised the limit is seen then; the local
    /// 429s still say the whole wait in `Retry-After`). Default: 1000.
    #[serde(default = "default_max_rejection_ms")]
    pub max_rejection_ms: u64,
    /// How often one worker of each Envoy reads the sidecar's policy epoch (`GET /v1/epoch`), in
    /// milliseconds; leases and known rejections learned under another epoch stop answering
    /// (docs/fast-paths.md#policy-reloads). 0: never (they then answer until their own end
    /// after a reload). Default: 50.
    #[serde(default = "default_policy_poll_ms")]
    pub policy_poll_ms: u64,
    /// Leases of tokens for busy buckets.
    #[serde(default)]
    pub leases: Leases,
    /// Shared-data entries (per Envoy process) for known rejections and leases: bounds memory.
    /// Default: 4096.
    #[serde(default = "default_slots")]
    pub slots: usize,
}

impl FastPaths {
    /// Whether the policy epoch is polled: `policy_poll_ms` is set and some fast path that
    /// answers from what it learned (leases, known rejections) is on.
    pub fn polls_epoch(&self) -> bool {
        self.policy_poll_ms > 0 && (self.leases.enabled || self.known_rejections)
    }
}

impl Default for FastPaths {
    fn default() -> Self {
        FastPaths {
            coalesce: true,
            max_batch: default_max_batch(),
            max_in_flight: default_max_in_flight(),
            share_callouts: true,
            known_rejections: true,
            max_rejection_ms: default_max_rejection_ms(),
            policy_poll_ms: default_policy_poll_ms(),
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

fn default_policy_poll_ms() -> u64 {
    50
}

fn default_max_rejection_ms() -> u64 {
    1000
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
    /// Tokens one request takes: a number, or an object whose `reserve` is charged at
    /// admission and settled from the response (docs/costs.md). Default: 1.
    #[serde(default)]
    pub cost: Cost,
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

/// A rule's cost: fixed, or reserved and settled from the response ([`CostSpec`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    Fixed(u64),
    Settled(CostSpec),
}

impl Default for Cost {
    fn default() -> Self {
        Cost::Fixed(1)
    }
}

impl Cost {
    /// The tokens charged at admission: the fixed cost, or the reservation's fallback.
    pub fn tokens(&self) -> u64 {
        match self {
            Cost::Fixed(n) => *n,
            Cost::Settled(s) => s.reserve,
        }
    }

    /// How the cost is settled from the response, if it is.
    pub fn settled(&self) -> Option<&CostSpec> {
        match self {
            Cost::Fixed(_) => None,
            Cost::Settled(s) => Some(s),
        }
    }
}

impl PartialEq<u64> for Cost {
    fn eq(&self, other: &u64) -> bool {
        *self == Cost::Fixed(*other)
    }
}

impl<'de> Deserialize<'de> for Cost {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Cost, D::Error> {
        struct CostVisitor;
        impl<'de> serde::de::Visitor<'de> for CostVisitor {
            type Value = Cost;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a whole number of tokens or a cost object ({\"reserve\": ..., \"response_header\" or \"response_json\": ...})")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Cost, E> {
                Ok(Cost::Fixed(n))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Cost, A::Error> {
                CostSpec::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(Cost::Settled)
            }
        }
        d.deserialize_any(CostVisitor)
    }
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

pub use ratelimit_wire::names::Problem;

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
    /// its longest: a claim or route name [`crate::identity::MAX_IDENTITY_BYTES`] (no control
    /// characters: 2 bytes a byte escaped at worst), an application its longest configured name,
    /// an address an IPv6 network.
    fn worst_decision_bytes(&self, rule: &Rule) -> usize {
        use crate::identity::MAX_IDENTITY_BYTES;
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
                    crate::identity::MAX_IDENTITY_BYTES
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

#[cfg(test)]
pub(crate) mod tests {
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
        assert_eq!(c.sidecar.path(), "/v1/decide");
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
        let shipped = plugin_json(include_str!("../../envoy/envoy.yaml"));
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
        let c = Config::from_json(
            br#"{"sidecar":{"cluster":"s"},"rules":[{"name":"g","subject":[]}]}"#,
        )
        .unwrap();
        assert_eq!(c.domain, "ratelimit");
        assert_eq!(c.domain, ratelimit_wire::DEFAULT_DOMAIN);
        assert_eq!(c.sidecar.timeout_ms, 50);
        assert_eq!(c.sidecar.authority(), "s");
        assert_eq!(c.sidecar.path(), ratelimit_wire::DECIDE_PATH);
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
        assert!(f.coalesce && f.share_callouts);
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
        let some = accepted(|v| {
            v["fast_paths"] = json!({"coalesce": false, "leases": {"enabled": false}})
        })
        .fast_paths;
        assert!(!some.coalesce && !some.leases.enabled && some.share_callouts);
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
            ["rules[0].emergency.capacity: 10 is less than the rule's cost 11: no request could \
              ever pass"]
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
            v["sidecar"]["path"] = "v1/decide".into();
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
            "sidecar.path: must start with '/' and contain no spaces",
        );
        assert_has(
            &p,
            "stat_prefix: \"\" must be 1 to 128 characters of [A-Za-z0-9_.-], not starting with '.'",
        );
        assert_eq!(p.len(), 6, "{p:#?}");
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
        let c = accepted(|v| {
            v["rules"][0]["emergency"]["refill_per_sec"] = (10.0 / 31_536_000.0).into()
        });
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
    fn the_sidecar_cluster_timeout_authority_and_path_are_checked() {
        let c = accepted(|v| {
            v["sidecar"]["timeout_ms"] = MAX_TIMEOUT_MS.into();
            v["sidecar"]["authority"] = "ratelimit.internal:8081".into();
            v["sidecar"]["path"] = "/v2/decide".into();
        });
        assert_eq!(c.sidecar.timeout_ms, 60_000);
        assert_eq!(c.sidecar.authority(), "ratelimit.internal:8081");
        assert_eq!(c.sidecar.path(), "/v2/decide");
        let p = problems(&edited(|v| {
            v["sidecar"] = json!({"cluster": " ", "timeout_ms": 60_001, "authority": "a b",
                                  "path": "/v1/ decide"});
        }));
        assert_eq!(
            p,
            [
                "sidecar.cluster: must name an Envoy cluster",
                "sidecar.timeout_ms: must be between 1 and 60000, got 60001",
                "sidecar.authority: must be a non-empty host[:port] without spaces",
                "sidecar.path: must start with '/' and contain no spaces",
            ]
        );
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
                "coalesce": false, "known_rejections": false, "share_callouts": false,
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
                share_callouts: false,
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
}
