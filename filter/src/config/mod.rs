//! The plugin configuration: the JSON Envoy hands the filter (`configuration` of
//! `envoy.filters.http.wasm`), its defaults, and its validation.
//!
//! Every optional field has its default written next to it, once. [`Config::from_json`] refuses a
//! configuration that cannot be honoured and names every problem with its field path; it never
//! degrades into "allow everything".

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;

pub use crate::costs::CostSpec;

/// The most rules one configuration may hold: every rule can become one decision of a request,
/// and the sidecar takes at most [`ratelimit_wire::MAX_DECISIONS`] per request.
pub const MAX_RULES: usize = ratelimit_wire::MAX_DECISIONS;

/// The longest rule name, in bytes (it is part of every bucket key and of a shared-data key).
pub const MAX_RULE_NAME_BYTES: usize = 64;

/// The longest claim or route name taken as an identity, in bytes; longer is unknown. It bounds
/// what one decision spends in a call to the sidecar (`Config::validate`).
pub const MAX_IDENTITY_BYTES: usize = 1024;

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
    /// Retired: accepted and ignored, with a warning ([`Config::retired_fields`]). Each worker
    /// has its own stream to the sidecar; no worker sends another's requests any more.
    #[serde(default)]
    pub share_callouts: Option<bool>,
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
            share_callouts: None,
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
    /// The whole decision's deadline, in milliseconds, counted from the request's arrival (its time
    /// in the coalescing queue included); past it the rule's `on_error` applies. Default: 50,
    /// above the sidecar's default `--redis-timeout-ms` of 30, so the sidecar answers 503 before
    /// Envoy gives up.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// The `:authority` of the stream to the sidecar. Default: the cluster name.
    #[serde(default)]
    pub authority: Option<String>,
    /// Retired: accepted and ignored, with a warning ([`Config::retired_fields`]). The stream's
    /// path is the gRPC method's ([`ratelimit_wire::stream::STREAM_PATH`]).
    #[serde(default)]
    pub path: Option<String>,
    /// A bearer token sent as `authorization: Bearer <token>` when the stream opens. Default:
    /// none.
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

    /// The `authorization` metadata of the stream: `token`, or the environment variable
    /// `token_env` names (read through `env`); an error says what is wrong.
    pub fn authorization(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<String>, String> {
        match (&self.token, &self.token_env) {
            (Some(t), _) => Ok(Some(format!("Bearer {t}"))),
            (None, Some(var)) => match env(var) {
                Some(t) if !t.is_empty() && t.bytes().all(|b| b.is_ascii_graphic()) => {
                    Ok(Some(format!("Bearer {t}")))
                }
                _ => Err(format!(
                    "sidecar.token_env: the environment variable {var:?} is not set (or not printable ASCII) in the VM; expose it with vm_config.environment_variables"
                )),
            },
            (None, None) => Ok(None),
        }
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

mod validate;

#[cfg(test)]
pub(crate) mod tests;
