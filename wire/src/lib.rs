//! The wire contract of `POST /v1/decide`, shared by the filter (which sends it) and the sidecar
//! (which answers it). One definition, two users: neither side keeps its own copy.
//!
//! A call carries the requests of one gateway (one or many: the filter coalesces the requests
//! that arrive while a call is in flight). Each request is decided all-or-nothing on its own. A
//! decision names a rule and the subject's values; the numbers (capacity, refill, overrides,
//! shadow mode) belong to the sidecar's policy, and each result says which limit applied.
//!
//! Request:
//! ```json
//! {"domain":"ratelimit","attempt":"c-1",
//!  "requests":[{"decisions":[{"rule":"per-app","subject":{"app":"alpha"},"cost":1}]}]}
//! ```
//! Answer:
//! ```json
//! {"answers":[{"allowed":true,"results":[{"allowed":true,"remaining":99,"retry_after_ms":0,
//!   "reset_ms":100,"reason":"ok","limit":{"name":"per-app","capacity":100,"refill_per_sec":10}}]}]}
//! ```
//! Error (400, 401, 413, 500, 503): `{"error":"requests[0].decisions[0].rule: ..."}`.

use std::fmt;

pub mod budget;
pub mod headers;
pub mod names;
pub mod stream;

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The path the sidecar serves decisions on.
pub const DECIDE_PATH: &str = "/v1/decide";

/// The path the sidecar serves its policy epoch on (`GET`, authenticated like decisions):
/// [`EpochResponse`].
pub const EPOCH_PATH: &str = "/v1/epoch";

/// The policy domain when a call names none.
pub const DEFAULT_DOMAIN: &str = "ratelimit";

/// The most requests one call may carry.
pub const MAX_REQUESTS: usize = 256;

/// The most decisions one request may carry.
pub const MAX_DECISIONS: usize = 64;

/// The most decisions one call may carry in all.
pub const MAX_CALL_DECISIONS: usize = 1024;

/// The most dimensions of one subject.
pub const MAX_SUBJECT_ENTRIES: usize = 8;

/// The longest rule name, dimension name, domain or attempt id, in bytes.
pub const MAX_NAME_BYTES: usize = 128;

/// The longest subject value, in bytes (longer values are hashed into keys by the sidecar, but
/// the wire still bounds what a caller may send).
pub const MAX_VALUE_BYTES: usize = 4096;

/// The most lease returns one call may carry.
pub const MAX_RETURNS: usize = 256;

fn default_domain() -> String {
    DEFAULT_DOMAIN.to_string()
}

fn default_cost() -> u64 {
    1
}

/// One call: the requests of a gateway, decided independently, each all-or-nothing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecideRequest {
    /// The policy domain the rules belong to. Default: `"ratelimit"`.
    #[serde(default = "default_domain")]
    pub domain: String,
    /// Identifies this call: a repeat of the same call (same attempt, same requests) within the
    /// sidecar's record TTL gets the first answers back and is charged nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<String>,
    /// The requests, at most [`MAX_REQUESTS`].
    pub requests: Vec<RequestDecisions>,
    /// Unused lease tokens the gateway gives back (see [`LeaseAsk`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub returns: Vec<LeaseReturn>,
}

/// The decisions of one gateway request: it passes only if every decision admits. A request of
/// a rule with `concurrency` holds slots under an id the sidecar chooses for it alone
/// ([`HeldSlot`]): a caller cannot name one, so a slot is one request's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestDecisions {
    pub decisions: Vec<Decision>,
}

/// The longest slot id, in bytes.
pub const MAX_SLOT_ID_BYTES: usize = 64;

/// One rule applied to one subject.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decision {
    /// The rule's name in the sidecar's policy.
    pub rule: String,
    /// The subject's dimensions and values, in the rule's order; a `null` value is an unknown
    /// subject (all unknown clients of the rule share one bucket).
    #[serde(default)]
    pub subject: Subject,
    /// Tokens this request costs. Default: 1.
    #[serde(default = "default_cost")]
    pub cost: u64,
    /// Ask for a lease of tokens beyond the cost, when the request is admitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseAsk>,
    /// Ask for a receipt of the charge ([`DecisionResult::receipt`]): the cost is a reservation
    /// a settlement may give back (`docs/costs.md`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub receipt: bool,
}

/// A lease ask: up to `tokens` more tokens, deducted now and held by the gateway for `ttl_ms`
/// under the gateway-chosen id `id` (below 2^53). A new lease under an id still held replaces it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseAsk {
    pub id: u64,
    pub tokens: u64,
    pub ttl_ms: u64,
}

/// The unused part of a lease, given back (the gateway stopped using the lease before sending).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseReturn {
    pub rule: String,
    #[serde(default)]
    pub subject: Subject,
    pub id: u64,
    pub tokens: u64,
}

/// The largest lease id: ids travel through Redis as doubles.
pub const MAX_LEASE_ID: u64 = (1 << 53) - 1;

/// A subject: dimensions and their values, in order (serialised as a JSON object whose key order
/// is kept). `None` is an unknown value.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Subject(pub Vec<(String, Option<String>)>);

impl Subject {
    pub fn new() -> Self {
        Subject(Vec::new())
    }

    pub fn push(&mut self, dimension: impl Into<String>, value: Option<String>) {
        self.0.push((dimension.into(), value));
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, Option<&str>)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_deref()))
    }
}

impl Serialize for Subject {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Subject {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct InOrder;
        impl<'de> Visitor<'de> for InOrder {
            type Value = Subject;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object of dimension names to string values (or null)")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Subject, A::Error> {
                let mut entries = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Option<String>>()? {
                    if entries.len() == MAX_SUBJECT_ENTRIES {
                        return Err(serde::de::Error::custom(format_args!(
                            "at most {MAX_SUBJECT_ENTRIES} dimensions"
                        )));
                    }
                    entries.push((k, v));
                }
                Ok(Subject(entries))
            }
        }
        d.deserialize_map(InOrder)
    }
}

/// Why a decision was answered as it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The bucket held `cost` tokens; with `allowed: false`, the bucket refused nothing but the
    /// request was rejected without its answer (another part of it failed or rejected).
    Ok,
    /// Not enough tokens now; `retry_after_ms` says when there will be at the earliest.
    Insufficient,
    /// `cost > capacity`: this bucket can never admit it, waiting does not help.
    CostExceedsCapacity,
    /// The policy blocks this subject: never admitted.
    Blocked,
    /// The policy makes this subject unlimited: always admitted, nothing counted in Redis.
    Unlimited,
    /// The rule's requests in flight for this subject are at its `concurrency`: a slot frees at
    /// a time nobody knows, so `retry_after_ms` is a small fixed [`CONCURRENCY_RETRY_AFTER_MS`].
    Concurrency,
}

/// The `retry_after_ms` of a request over its concurrency (`Retry-After: 1`).
pub const CONCURRENCY_RETRY_AFTER_MS: u64 = 1_000;

/// The limit a decision was judged by, for the `RateLimit-Policy` header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AppliedLimit {
    /// The rule's (or override's) name.
    pub name: String,
    pub capacity: u64,
    pub refill_per_sec: f64,
}

/// The answer to a call: one per request, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecideResponse {
    pub answers: Vec<RequestAnswer>,
    /// The epoch of the sidecar's policy when it began deciding the call (see
    /// [`EpochResponse`]); absent from a sidecar that does not tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
}

/// The answer to `GET /v1/epoch`: the policy's epoch, a content hash of the policy files as
/// loaded (two sidecars with the same files agree), changing on every reload that changes the
/// policy; never 0, below 2^53 (JSON carries it exactly).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochResponse {
    pub epoch: u64,
}

/// One request's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestAnswer {
    /// True only if every decision admitted.
    pub allowed: bool,
    /// One result per decision, in order; empty when `error` is set.
    #[serde(default)]
    pub results: Vec<DecisionResult>,
    /// Why this request got no verdict (the gateway applies its failure policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<RequestError>,
    /// The concurrency slots the admitted request holds: renew them while it runs, release them
    /// when its stream ends (`POST /v1/slots`). Absent: it holds none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<HeldSlot>,
}

/// The slots of an admitted request: one under `id` for each decision listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldSlot {
    pub id: String,
    /// The shortest `slot_ttl_ms` of the request's rules: renew well within it (the filter renews
    /// every third of it).
    pub ttl_ms: u64,
    /// The indices of the request's decisions whose rules hold a slot.
    pub decisions: Vec<u32>,
}

/// A request without a verdict.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestError {
    pub code: ErrorCode,
    pub message: String,
}

/// What kind of failure a [`RequestError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The policy has no such rule in the domain: a configuration error.
    UnknownRule,
    /// Redis did not answer in time or is down.
    Unavailable,
    /// Redis answered, but the script failed.
    ScriptFailed,
}

/// One decision's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionResult {
    /// Whether this decision lets the request pass (a shadow-mode limit always does). When another
    /// decision of the same request rejected, this one may say `true` and still was not charged.
    pub allowed: bool,
    /// Whole tokens left in the bucket.
    pub remaining: u64,
    /// Milliseconds until `cost` tokens can be available (a lower bound); 0 when allowed.
    pub retry_after_ms: u64,
    /// Milliseconds until the bucket is full again.
    pub reset_ms: u64,
    pub reason: Reason,
    /// The limit applied; absent for an unlimited subject.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<AppliedLimit>,
    /// The limit is in shadow mode: `reason` says what it would have done.
    #[serde(default, skip_serializing_if = "is_false")]
    pub shadow: bool,
    /// Tokens granted under the decision's lease ask (beyond its cost).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub leased: u64,
    /// The receipt of the charge, when the decision asked for one and its request was admitted
    /// and charged: a settlement names it to give back what this decision was charged, once
    /// (`docs/costs.md`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt: Option<String>,
    /// Why this decision was not decided: its rule is not in the policy (`unknown_rule`, a
    /// configuration error of this decision alone). `allowed` is then `true` and says nothing
    /// (nothing was charged for it): the request's verdict is its other decisions', which were
    /// decided and charged, and the gateway applies this rule's failure policy to it. Absent
    /// otherwise, and when no decision of the request could be decided (the request's `error`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<RequestError>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The path the sidecar takes settlements on (`POST`, authenticated like decisions):
/// [`SettleRequest`], answered [`SettleResponse`]. `docs/costs.md`.
pub const SETTLE_PATH: &str = "/v1/settle";

/// The most settlements one call may carry.
pub const MAX_SETTLEMENTS: usize = 1024;

/// Costs known after the response: each admitted request's real cost against the reservation it
/// was admitted with; the difference is charged (past zero: a debt) or given back.
/// ```json
/// {"domain":"ratelimit","id":"gw-1-17",
///  "settlements":[{"rule":"llm-tpm","subject":{"user":"ann"},"reserved":4096,"cost":312}]}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettleRequest {
    /// The policy domain the rules belong to. Default: `"ratelimit"`.
    #[serde(default = "default_domain")]
    pub domain: String,
    /// Identifies this batch: a repeat (a retry after a lost answer) within the sidecar's record
    /// TTL applies nothing twice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// At most [`MAX_SETTLEMENTS`].
    pub settlements: Vec<Settle>,
}

/// One admitted request's settlement on one rule's bucket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settle {
    pub rule: String,
    #[serde(default)]
    pub subject: Subject,
    /// The tokens the request was admitted with (its decision's `cost`).
    pub reserved: u64,
    /// What the request really cost, as its response reported it.
    pub cost: u64,
    /// The receipt of the decision that charged the reservation ([`DecisionResult::receipt`]).
    /// With it, the bucket is charged the real cost less what that decision was charged (given
    /// back when below), once; without it (or with one settled already, or expired), nothing is
    /// given back: only a cost above `reserved` is charged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt: Option<String>,
}

/// The largest receipt id: receipts travel through Redis as doubles.
pub const MAX_RECEIPT: u64 = (1 << 53) - 1;

/// A receipt as the sidecar hands it out: the decimal digits of a number from 1 to
/// [`MAX_RECEIPT`], without leading zeros.
pub fn parse_receipt(text: &str) -> Option<u64> {
    if text.is_empty() || text.len() > 16 || text.starts_with('0') {
        return None;
    }
    if !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok().filter(|n| (1..=MAX_RECEIPT).contains(n))
}

/// The answer to a settle call: how many settlements changed a bucket now, how many were a
/// repeat of a batch applied before, and how many had no bucket to settle (an unknown or
/// unlimited rule, a cost equal to its reservation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettleResponse {
    pub applied: u64,
    pub repeated: u64,
    pub skipped: u64,
}

/// The path the sidecar renews and releases concurrency slots on (`POST`, authenticated like
/// decisions): [`SlotsRequest`], answered [`SlotsResponse`]. `docs/concurrency.md`.
pub const SLOTS_PATH: &str = "/v1/slots";
/// The most slots one slots call may name (renewals and releases together).
pub const MAX_SLOT_UPDATES: usize = 1024;

/// Slots a gateway holds, renewed while their requests run, released when they end.
/// ```json
/// {"domain":"ratelimit","renew":[{"rule":"per-app","subject":{"app":"alpha"},"slot":"9f1c-17"}],
///  "release":[]}
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotsRequest {
    /// The policy domain the rules belong to. Default: `"ratelimit"`.
    #[serde(default = "default_domain")]
    pub domain: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub renew: Vec<SlotRef>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub release: Vec<SlotRef>,
}

/// One slot: the rule and subject of the decision that took it, and the request's slot id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotRef {
    pub rule: String,
    #[serde(default)]
    pub subject: Subject,
    pub slot: String,
}

/// The answer to a slots call: slots renewed, released, and unknown (expired already, or never
/// held: renewing one does not take it again).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotsResponse {
    pub renewed: u64,
    pub released: u64,
    pub unknown: u64,
    /// The shortest `slot_ttl_ms` the renewed slots were held for, under the policy in force
    /// now (a reload may have changed it since the slot was taken): renew them again within a
    /// third of it. Absent when nothing was renewed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
}

/// Whether `id` is a usable slot id: 1 to [`MAX_SLOT_ID_BYTES`] of `[A-Za-z0-9_.-]`.
pub fn is_slot_id(id: &str) -> bool {
    names::is_name(id, MAX_SLOT_ID_BYTES)
}

/// The body of every non-200 answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

/// `text` cut to at most `max` bytes by eliding its middle, so that both the field path an error
/// starts with and the expectation it ends with (serde's `expected u64 at line 1 column 80`)
/// remain. Error messages that quote what another party sent are bounded with it.
pub fn elide_middle(text: String, max: usize) -> String {
    const GAP: &str = " [...] ";
    if text.len() <= max {
        return text;
    }
    let keep = max.saturating_sub(GAP.len()) / 2;
    let mut head = keep;
    while !text.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = text.len() - keep;
    while !text.is_char_boundary(tail) {
        tail += 1;
    }
    format!("{}{GAP}{}", &text[..head], &text[tail..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_errors_keep_both_ends_within_the_bound() {
        assert_eq!(elide_middle("short".into(), 100), "short");
        // Multi-byte characters are never split.
        assert_eq!(elide_middle("é".repeat(300), 100).len(), 99);
        let long = format!("requests[0].rule: {} expected u64", "x".repeat(1000));
        let cut = elide_middle(long, 64);
        assert!(cut.len() <= 64, "{cut}");
        assert!(cut.starts_with("requests[0].rule: ") && cut.ends_with("expected u64"));
        assert!(cut.contains(" [...] "));
    }

    #[test]
    fn request_from_the_documented_example() {
        let r: DecideRequest = serde_json::from_str(
            r#"{"domain":"ratelimit","attempt":"c-1",
                "requests":[{"decisions":[{"rule":"per-app","subject":{"app":"alpha"},"cost":1}]}]}"#,
        )
        .unwrap();
        let d = &r.requests[0].decisions[0];
        assert_eq!(d.rule, "per-app");
        assert_eq!(d.subject.0, vec![("app".to_string(), Some("alpha".into()))]);
        assert_eq!(r.attempt.as_deref(), Some("c-1"));
    }

    #[test]
    fn defaults_domain_cost_subject() {
        let r: DecideRequest =
            serde_json::from_str(r#"{"requests":[{"decisions":[{"rule":"global"}]}]}"#).unwrap();
        assert_eq!(r.domain, DEFAULT_DOMAIN);
        assert_eq!(r.requests[0].decisions[0].cost, 1);
        assert!(r.requests[0].decisions[0].subject.is_empty());
        let json = serde_json::to_string(&r).unwrap();
        assert!(
            !json.contains("attempt") && !json.contains("returns"),
            "{json}"
        );
    }

    #[test]
    fn subject_keeps_its_order_and_unknown_values() {
        let s: Subject = serde_json::from_str(r#"{"tenant":"acme","user":null}"#).unwrap();
        assert_eq!(
            s.0,
            vec![
                ("tenant".into(), Some("acme".into())),
                ("user".into(), None)
            ]
        );
        assert_eq!(
            serde_json::to_string(&s).unwrap(),
            r#"{"tenant":"acme","user":null}"#
        );
        let many = format!(
            "{{{}}}",
            (0..=MAX_SUBJECT_ENTRIES)
                .map(|i| format!("\"d{i}\":\"v\""))
                .collect::<Vec<_>>()
                .join(",")
        );
        assert!(serde_json::from_str::<Subject>(&many).is_err());
        assert!(serde_json::from_str::<Subject>(r#"{"user":5}"#).is_err());
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = serde_json::from_str::<DecideRequest>(
            r#"{"requests":[{"decisions":[{"rule":"r","capacity":5}]}]}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("capacity"), "{e}");
        // A slot id is the sidecar's to choose (a slot is one request's).
        let e = serde_json::from_str::<DecideRequest>(
            r#"{"requests":[{"decisions":[{"rule":"r"}],"slot":"shared"}]}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("slot"), "{e}");
    }

    #[test]
    fn response_round_trips() {
        let r: DecideResponse = serde_json::from_str(
            r#"{"answers":[{"allowed":true,"results":[{"allowed":true,"remaining":99,"retry_after_ms":0,"reset_ms":100,"reason":"ok","limit":{"name":"per-app","capacity":100,"refill_per_sec":10}}]},
                           {"allowed":false,"error":{"code":"unknown_rule","message":"no rule x"}}]}"#,
        )
        .unwrap();
        assert_eq!(
            r.answers[0].results[0].limit.as_ref().unwrap().capacity,
            100
        );
        assert_eq!(
            r.answers[1].error.as_ref().unwrap().code,
            ErrorCode::UnknownRule
        );
        let back: DecideResponse =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }
}
