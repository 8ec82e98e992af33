//! Costs known after the response (docs/costs.md), without host calls: a rule's `cost` object
//! ([`CostSpec`]), the reservation a request is admitted with ([`reservation`]), the real cost
//! its response reports ([`Meter`]: a response header, a JSON field of the body, or the field in
//! the last `data:` event of a `text/event-stream` that carries it), and the settlements waiting
//! to be sent to the sidecar ([`Outbox`]: batched, retried a bounded number of times under one
//! id, counted when lost).

use std::collections::VecDeque;

use ratelimit_wire::{budget, Settle, SettleRequest, Subject, MAX_SETTLEMENTS};
use serde::Deserialize;

/// The most body bytes a [`Meter`] keeps to find a JSON field (a non-streamed body, or one
/// line of an event stream); a longer one settles at the rule's `unreported_cost`.
pub const MAX_METERED_BYTES: usize = 1 << 20;

/// The most body bytes all the meters of one worker keep at once ([`Budget`]): a response that
/// would go past it is not kept, and settles at its rule's `unreported_cost`.
pub const MAX_METERED_BYTES_PER_WORKER: usize = 16 << 20;

/// The most settlements a worker holds unsent; more are lost (counted).
pub const MAX_PENDING: usize = 4096;

/// How many times a batch is sent before its settlements are counted lost.
pub const MAX_ATTEMPTS: u32 = 3;

/// How long a settlement call waits for its answer at least (`sidecar.timeout_ms` when longer):
/// no request waits on it, and a short stall of the sidecar (a pause, a restart) then delays its
/// settlements instead of losing them.
pub const SEND_TIMEOUT_MS: u64 = 1_000;

/// The most segments of a JSON field's path (`usage.total_tokens` has two).
pub const MAX_PATH_SEGMENTS: usize = 8;

/// A rule's cost settled from the response (`"cost": {...}` in the configuration).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostSpec {
    /// Tokens reserved at admission (required): the reservation, or the fallback when the
    /// request does not say it (`reserve_from_request_header`).
    pub reserve: u64,
    /// A request header whose whole-number value is the reservation.
    #[serde(default)]
    pub reserve_from_request_header: Option<String>,
    /// A dotted path (`max_tokens`) to the reservation's whole number in the request's JSON
    /// body: the request is decided once its body is in (at most [`MAX_METERED_BYTES`]).
    #[serde(default)]
    pub reserve_from_request_json: Option<String>,
    /// The reservation's upper bound when it comes from the request. Default: no bound but the
    /// largest cost (a reservation above the bucket's capacity is answered
    /// `cost_exceeds_capacity`).
    #[serde(default)]
    pub reserve_max: Option<u64>,
    /// A response header whose whole-number value is the real cost.
    #[serde(default)]
    pub response_header: Option<String>,
    /// A dotted path (`usage.total_tokens`) to the real cost in the JSON response body, or in
    /// the last `data:` event of a `text/event-stream` that carries it.
    #[serde(default)]
    pub response_json: Option<String>,
    /// What a response whose real cost cannot be read settles at (not reported, compressed, cut
    /// short, too long to keep). Default: `reserve_max` when the reservation comes from the
    /// request and is bounded, else `reserve`: a figure the operator set, never one the client
    /// chose ([`CostSpec::unreported`]).
    #[serde(default)]
    pub unreported_cost: Option<u64>,
}

impl CostSpec {
    /// The cost a response settles at when its real cost cannot be read: `unreported_cost`, or
    /// `reserve_max` when the reservation comes from the request, else `reserve` (docs/costs.md).
    pub fn unreported(&self, max_cost: u64) -> u64 {
        let from_request =
            self.reserve_from_request_header.is_some() || self.reserve_from_request_json.is_some();
        let default = match self.reserve_max {
            Some(m) if from_request => m,
            _ => self.reserve,
        };
        self.unreported_cost.unwrap_or(default).min(max_cost)
    }

    /// Whether the real cost is read from the response's body (so the body must come
    /// uncompressed: the filter asks the upstream for `accept-encoding: identity`).
    pub fn reads_body(&self) -> bool {
        self.response_json.is_some()
    }

    /// What is wrong with the spec, each problem with its field (below `at`).
    pub fn problems(&self, at: &str, max_cost: u64) -> Vec<(String, String)> {
        let mut p = Vec::new();
        let mut add = |field: &str, what: String| p.push((format!("{at}.{field}"), what));
        if self.reserve == 0 || self.reserve > max_cost {
            add("reserve", format!("must be 1 to {max_cost}"));
        }
        if self.unreported_cost.is_some_and(|c| c > max_cost) {
            add("unreported_cost", format!("must be 0 to {max_cost}"));
        }
        if let Some(m) = self.reserve_max {
            if m < self.reserve || m > max_cost {
                add(
                    "reserve_max",
                    format!("must be between reserve ({}) and {max_cost}", self.reserve),
                );
            }
        }
        for (field, name) in [
            (
                "reserve_from_request_header",
                &self.reserve_from_request_header,
            ),
            ("response_header", &self.response_header),
        ] {
            if let Some(n) = name {
                let ok = !n.is_empty()
                    && n.len() <= 128
                    && n.bytes().all(|b| {
                        b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_'
                    });
                if !ok {
                    add(
                        field,
                        "must be a lowercase header name ([a-z0-9_-], 1 to 128 bytes)".into(),
                    );
                }
            }
        }
        for (field, path) in [
            ("reserve_from_request_json", &self.reserve_from_request_json),
            ("response_json", &self.response_json),
        ] {
            let Some(path) = path else { continue };
            let segments: Vec<&str> = path.split('.').collect();
            if path.is_empty()
                || segments.len() > MAX_PATH_SEGMENTS
                || segments.iter().any(|s| s.is_empty() || s.len() > 64)
            {
                add(
                    field,
                    format!("must be a dotted path of 1 to {MAX_PATH_SEGMENTS} names (usage.total_tokens)"),
                );
            }
        }
        if self.reserve_from_request_header.is_some() && self.reserve_from_request_json.is_some() {
            add(
                "reserve_from_request_json",
                "one source of the reservation: reserve_from_request_header or reserve_from_request_json".into(),
            );
        }
        if self.response_header.is_none() && self.response_json.is_none() {
            add(
                "response_header",
                "a cost object needs response_header or response_json (where the real cost is reported); for a fixed cost write a number".into(),
            );
        }
        if self.reserve_from_request_header.is_none()
            && self.reserve_from_request_json.is_none()
            && self.reserve_max.is_some()
        {
            add(
                "reserve_max",
                "bounds a reservation taken from the request: set reserve_from_request_header or reserve_from_request_json".into(),
            );
        }
        p
    }
}

/// A whole number of tokens as a header or a JSON field carries it: ASCII digits, surrounding
/// spaces allowed; anything else is no figure.
pub fn whole_number(bytes: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(bytes).ok()?.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// The tokens a request of rule `spec` reserves: the figure the request names (its header's
/// value, or its JSON body's field: 1 at least, at most `reserve_max`), or `reserve` when it
/// names none.
pub fn reservation(
    spec: &CostSpec,
    header: Option<&[u8]>,
    body: Option<&[u8]>,
    max_cost: u64,
) -> u64 {
    let named = match (
        &spec.reserve_from_request_header,
        &spec.reserve_from_request_json,
    ) {
        (Some(_), _) => header.and_then(whole_number),
        (None, Some(path)) => body
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(b).ok())
            .and_then(|v| json_figure(&v, path)),
        (None, None) => None,
    };
    match named {
        Some(n) => n.clamp(1, spec.reserve_max.unwrap_or(max_cost)),
        None => spec.reserve,
    }
}

/// The whole number at `path` (dotted) in `v`: `None` when a step is missing or the value is
/// not a whole number of at most 2^53.
pub fn json_figure(v: &serde_json::Value, path: &str) -> Option<u64> {
    let mut at = v;
    for segment in path.split('.') {
        at = at.get(segment)?;
    }
    match at {
        serde_json::Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| *f >= 0.0 && f.fract() == 0.0 && *f <= 9_007_199_254_740_992.0)
                .map(|f| f as u64)
        }),
        _ => None,
    }
}

/// What the meters of one worker keep of their responses' bodies, in bytes: at most
/// [`MAX_METERED_BYTES_PER_WORKER`] together.
#[derive(Debug, Default)]
pub struct Budget {
    held: usize,
}

impl Budget {
    /// Takes `n` bytes if the worker has them.
    fn take(&mut self, n: usize) -> bool {
        if self.held + n > MAX_METERED_BYTES_PER_WORKER {
            return false;
        }
        self.held += n;
        true
    }

    fn give(&mut self, n: usize) {
        self.held = self.held.saturating_sub(n);
    }

    /// The bytes the worker's meters keep now.
    pub fn held(&self) -> usize {
        self.held
    }
}

/// How a response's body is read.
#[derive(Debug, Clone, PartialEq, Eq)]
enum BodyMode {
    /// Not read: the cost comes from a header, or the body has no field to look for.
    Ignore,
    /// Not readable: compressed (`content-encoding` other than `identity`).
    Unreadable,
    /// A JSON body, kept whole (up to [`MAX_METERED_BYTES`]) and parsed at its end.
    Json { body: Vec<u8>, too_long: bool },
    /// An event stream, read line by line as it passes; the last `data:` event carrying the
    /// field wins.
    Events { line: Vec<u8>, too_long: bool },
}

/// What one response reports of a rule's real cost, fed as it passes (never holding it back).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meter {
    header: Option<String>,
    path: Option<String>,
    /// From the header (final once the headers arrived) or the last event that carried it.
    found: Option<u64>,
    body: BodyMode,
}

impl Meter {
    pub fn new(spec: &CostSpec) -> Meter {
        Meter {
            header: spec.response_header.clone(),
            path: spec.response_json.clone(),
            found: None,
            body: BodyMode::Ignore,
        }
    }

    /// The response header this meter reads, if any.
    pub fn header_name(&self) -> Option<&str> {
        self.header.as_deref()
    }

    /// The response's headers: the cost header's value (when the meter reads one), the
    /// `content-type` and the `content-encoding`. Decides how the body is read: a compressed one
    /// is not (its cost is then unreported).
    pub fn headers(
        &mut self,
        cost_header: Option<&[u8]>,
        content_type: Option<&[u8]>,
        content_encoding: Option<&[u8]>,
    ) {
        if let Some(n) = cost_header.and_then(whole_number) {
            self.found = Some(n);
        }
        if self.found.is_some() || self.path.is_none() {
            return;
        }
        let identity = content_encoding.is_none_or(|e| {
            let e = e.trim_ascii();
            e.is_empty() || e.eq_ignore_ascii_case(b"identity")
        });
        if !identity {
            self.body = BodyMode::Unreadable;
            return;
        }
        let events = content_type
            .is_some_and(|c| c.len() >= 17 && c[..17].eq_ignore_ascii_case(b"text/event-stream"));
        self.body = if events {
            BodyMode::Events {
                line: Vec::new(),
                too_long: false,
            }
        } else {
            BodyMode::Json {
                body: Vec::new(),
                too_long: false,
            }
        };
    }

    /// Whether the body is worth passing to [`Meter::body`].
    pub fn reads_body(&self) -> bool {
        !matches!(self.body, BodyMode::Ignore | BodyMode::Unreadable)
    }

    /// One chunk of the response body, as it passes; what the meter keeps is taken from the
    /// worker's `budget` (a body the budget cannot hold is not kept: its cost is unreported).
    pub fn body(&mut self, chunk: &[u8], budget: &mut Budget) {
        let path = self.path.as_deref().unwrap_or_default();
        match &mut self.body {
            BodyMode::Ignore | BodyMode::Unreadable => {}
            BodyMode::Json { body, too_long } => {
                if *too_long
                    || body.len() + chunk.len() > MAX_METERED_BYTES
                    || !budget.take(chunk.len())
                {
                    *too_long = true;
                    budget.give(body.len());
                    *body = Vec::new();
                } else {
                    body.extend_from_slice(chunk);
                }
            }
            BodyMode::Events { line, too_long } => {
                for piece in chunk.split_inclusive(|b| *b == b'\n') {
                    let ends = piece.ends_with(b"\n");
                    if !*too_long {
                        if line.len() + piece.len() > MAX_METERED_BYTES || !budget.take(piece.len())
                        {
                            *too_long = true;
                            budget.give(line.len());
                            line.clear();
                        } else {
                            line.extend_from_slice(piece);
                        }
                    }
                    if ends {
                        if !*too_long {
                            if let Some(n) = event_figure(line, path) {
                                self.found = Some(n);
                            }
                        }
                        budget.give(line.len());
                        line.clear();
                        *too_long = false;
                    }
                }
            }
        }
    }

    /// The real cost, once the response is over: `complete` when its body ended (not reset or
    /// cancelled); what the meter kept goes back to `budget`. `None`: not reported, compressed,
    /// too long to keep, or a JSON body cut short: the request settles at its rule's
    /// `unreported_cost`. A header's figure holds however the body ends, and so does the last
    /// figure an event stream reported before it was cut short (the client hung up after it).
    pub fn finish(&mut self, complete: bool, budget: &mut Budget) -> Option<u64> {
        let path = self.path.as_deref().unwrap_or_default();
        match std::mem::replace(&mut self.body, BodyMode::Ignore) {
            BodyMode::Ignore => self.found,
            BodyMode::Unreadable => None,
            BodyMode::Json { body, too_long } => {
                budget.give(body.len());
                if !complete || too_long {
                    return None;
                }
                serde_json::from_slice(&body)
                    .ok()
                    .and_then(|v| json_figure(&v, path))
            }
            BodyMode::Events { line, too_long } => {
                budget.give(line.len());
                if !complete {
                    return self.found;
                }
                // A last event without its newline.
                match (too_long, event_figure(&line, path)) {
                    (false, Some(n)) => Some(n),
                    _ => self.found,
                }
            }
        }
    }
}

/// The figure at `path` in an event stream's line, if it is a `data:` line of JSON carrying it.
fn event_figure(line: &[u8], path: &str) -> Option<u64> {
    let data = line.strip_prefix(b"data:")?;
    let data = data.strip_prefix(b" ").unwrap_or(data);
    let v: serde_json::Value = serde_json::from_slice(data.trim_ascii()).ok()?;
    json_figure(&v, path)
}

/// One settlement to send: a rule's bucket, the reservation, the real cost, and the receipt of
/// the charge (what the sidecar gives back against).
#[derive(Debug, Clone, PartialEq)]
pub struct Settlement {
    pub rule: String,
    pub subject: Subject,
    pub reserved: u64,
    pub cost: u64,
    pub receipt: Option<String>,
}

/// A batch sent, or to send again under the same id.
#[derive(Debug, Clone, PartialEq)]
struct Batch {
    id: String,
    settlements: Vec<Settle>,
    attempts: u32,
}

/// The settlements of one worker waiting for the sidecar: sent in batches of at most
/// [`MAX_SETTLEMENTS`] within the call's byte budget ([`budget::MAX_BODY_BYTES`]), one batch in
/// flight; a batch whose call failed is sent again under the
/// same id (the sidecar applies a repeat once) up to [`MAX_ATTEMPTS`] times, then lost.
#[derive(Debug)]
pub struct Outbox {
    nonce: u64,
    counter: u64,
    queue: VecDeque<Settle>,
    retry: Option<Batch>,
    in_flight: Option<Batch>,
}

/// What happened to settlements the outbox could not deliver.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Delivery {
    /// Settlements to be sent again.
    pub retried: u64,
    /// Settlements given up (after [`MAX_ATTEMPTS`] sends, or with the outbox full).
    pub lost: u64,
}

impl Outbox {
    /// An outbox whose batch ids derive from `nonce` (random per VM).
    pub fn new(nonce: u64) -> Outbox {
        Outbox {
            nonce,
            counter: 0,
            queue: VecDeque::new(),
            retry: None,
            in_flight: None,
        }
    }

    /// Queues a settlement (nothing to send when the cost equals its reservation); how many
    /// were lost to make room (0 or 1).
    pub fn push(&mut self, s: Settlement) -> u64 {
        if s.cost == s.reserved {
            return 0;
        }
        let lost = if self.queue.len() >= MAX_PENDING {
            self.queue.pop_front();
            1
        } else {
            0
        };
        self.queue.push_back(Settle {
            rule: s.rule,
            subject: s.subject,
            reserved: s.reserved,
            cost: s.cost,
            receipt: s.receipt,
        });
        lost
    }

    /// Settlements not yet delivered (queued, to retry, in flight).
    pub fn pending(&self) -> usize {
        self.queue.len()
            + self.retry.as_ref().map_or(0, |b| b.settlements.len())
            + self.in_flight.as_ref().map_or(0, |b| b.settlements.len())
    }

    /// The body of the next batch to send, if one is due and none is in flight; it is in flight
    /// until [`Outbox::answered`].
    pub fn next_call(&mut self, domain: &str) -> Option<Vec<u8>> {
        if self.in_flight.is_some() {
            return None;
        }
        let batch = match self.retry.take() {
            Some(b) => b,
            None if self.queue.is_empty() => return None,
            None => {
                self.counter += 1;
                // At most MAX_SETTLEMENTS, within the call's byte budget (the first always fits:
                // one settlement is far below it).
                let mut bytes = 0;
                let n = self
                    .queue
                    .iter()
                    .take(MAX_SETTLEMENTS)
                    .take_while(|s| {
                        bytes += budget::settle_bytes(s);
                        bytes <= budget::ITEMS_BYTES
                    })
                    .count()
                    .max(1);
                Batch {
                    id: format!("{:x}-{}", self.nonce, self.counter),
                    settlements: self.queue.drain(..n).collect(),
                    attempts: 0,
                }
            }
        };
        let body = SettleRequest {
            domain: domain.to_string(),
            id: Some(batch.id.clone()),
            settlements: batch.settlements.clone(),
        };
        let body = serde_json::to_vec(&body).ok()?;
        self.in_flight = Some(Batch {
            attempts: batch.attempts + 1,
            ..batch
        });
        Some(body)
    }

    /// The batch in flight was answered: `delivered` when the sidecar applied it (200), else it
    /// is sent again or, after [`MAX_ATTEMPTS`], lost.
    pub fn answered(&mut self, delivered: bool) -> Delivery {
        let Some(batch) = self.in_flight.take() else {
            return Delivery::default();
        };
        let n = batch.settlements.len() as u64;
        if delivered {
            Delivery::default()
        } else if batch.attempts >= MAX_ATTEMPTS {
            Delivery {
                retried: 0,
                lost: n,
            }
        } else {
            self.retry = Some(batch);
            Delivery {
                retried: n,
                lost: 0,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const MAX: u64 = 999_999_999_999_999;

    fn spec(json: &str) -> CostSpec {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn a_reservation_comes_from_the_request_bounded_or_falls_back() {
        let s = spec(
            r#"{"reserve": 4096, "reserve_from_request_header": "x-max-tokens", "reserve_max": 8192, "response_json": "usage.total_tokens"}"#,
        );
        assert_eq!(reservation(&s, Some(b"100"), None, MAX), 100);
        assert_eq!(reservation(&s, Some(b" 9000 "), None, MAX), 8192, "bounded");
        assert_eq!(reservation(&s, Some(b"0"), None, MAX), 1);
        assert_eq!(
            reservation(&s, Some(b"-5"), None, MAX),
            4096,
            "not a figure"
        );
        assert_eq!(reservation(&s, Some(b"1e3"), None, MAX), 4096);
        assert_eq!(
            reservation(&s, None, Some(b"{\"max_tokens\": 5}"), MAX),
            4096
        );
        let j = spec(
            r#"{"reserve_from_request_json": "max_tokens", "reserve": 4096, "response_json": "usage.total_tokens"}"#,
        );
        assert!(j.problems("c", MAX).is_empty());
        assert_eq!(
            reservation(&j, None, Some(br#"{"model":"m","max_tokens":300}"#), MAX),
            300
        );
        assert_eq!(reservation(&j, None, Some(br#"{"model":"m"}"#), MAX), 4096);
        assert_eq!(reservation(&j, None, Some(b"not json"), MAX), 4096);
        assert_eq!(reservation(&j, None, None, MAX), 4096, "no body");
        assert_eq!(
            reservation(&j, None, Some(br#"{"max_tokens":1e30}"#), MAX),
            4096
        );
    }

    #[test]
    fn bad_specs_name_the_field() {
        let fields = |json: &str| -> Vec<String> {
            spec(json)
                .problems("rules[0].cost", MAX)
                .into_iter()
                .map(|(f, _)| f)
                .collect()
        };
        assert_eq!(
            fields(r#"{"reserve": 0, "response_header": "x-usage"}"#),
            ["rules[0].cost.reserve"]
        );
        assert_eq!(
            fields(r#"{"reserve": 10}"#),
            ["rules[0].cost.response_header"]
        );
        assert_eq!(
            fields(r#"{"reserve": 10, "response_header": "X-Usage"}"#),
            ["rules[0].cost.response_header"]
        );
        assert_eq!(
            fields(r#"{"reserve": 10, "response_json": "usage..total"}"#),
            ["rules[0].cost.response_json"]
        );
        assert_eq!(
            fields(
                r#"{"reserve": 10, "reserve_from_request_header": "x-m", "reserve_max": 5, "response_json": "u"}"#
            ),
            ["rules[0].cost.reserve_max"]
        );
        assert_eq!(
            fields(r#"{"reserve": 10, "reserve_max": 50, "response_json": "u"}"#),
            ["rules[0].cost.reserve_max"]
        );
        assert!(fields(r#"{"reserve": 1000, "response_header": "x-usage-tokens"}"#).is_empty());
        assert!(serde_json::from_str::<CostSpec>(r#"{"reserve": 1, "response": "x"}"#).is_err());
    }

    #[test]
    fn a_header_reports_the_cost_whatever_the_body_does() {
        let mut b = Budget::default();
        let mut m = Meter::new(&spec(
            r#"{"reserve": 1000, "response_header": "x-usage-tokens"}"#,
        ));
        assert_eq!(m.header_name(), Some("x-usage-tokens"));
        m.headers(Some(b"312"), Some(b"application/json"), None);
        assert!(!m.reads_body());
        assert_eq!(m.finish(false, &mut b), Some(312));
        let mut m = Meter::new(&spec(
            r#"{"reserve": 1000, "response_header": "x-usage-tokens"}"#,
        ));
        m.headers(None, None, None);
        assert_eq!(
            m.finish(true, &mut b),
            None,
            "not reported: the reservation holds"
        );
    }

    #[test]
    fn a_json_body_reports_the_field_once_it_is_whole() {
        let mut b = Budget::default();
        let s = spec(r#"{"reserve": 4096, "response_json": "usage.total_tokens"}"#);
        let mut m = Meter::new(&s);
        m.headers(None, Some(b"application/json"), None);
        assert!(m.reads_body());
        m.body(br#"{"id":"x","usage":{"prompt_tokens":10,"#, &mut b);
        m.body(br#""total_tokens":57}}"#, &mut b);
        assert_eq!(m.finish(true, &mut b), Some(57));
        let mut m = Meter::new(&s);
        m.headers(None, Some(b"application/json"), None);
        m.body(br#"{"usage":{"total_tokens":57}}"#, &mut b);
        assert_eq!(
            m.finish(false, &mut b),
            None,
            "cut short: the reservation holds"
        );
        let mut m = Meter::new(&s);
        m.headers(None, None, None);
        m.body(br#"{"usage":{"total_tokens":"57"}}"#, &mut b);
        assert_eq!(m.finish(true, &mut b), None, "not a number");
        let mut m = Meter::new(&s);
        m.headers(None, None, None);
        m.body(&vec![b' '; MAX_METERED_BYTES + 1], &mut b);
        m.body(br#"{"usage":{"total_tokens":57}}"#, &mut b);
        assert_eq!(m.finish(true, &mut b), None, "too long to keep");
    }

    #[test]
    fn an_event_stream_reports_the_last_event_that_carries_the_field() {
        let mut b = Budget::default();
        let s = spec(r#"{"reserve": 4096, "response_json": "usage.total_tokens"}"#);
        let mut m = Meter::new(&s);
        m.headers(None, Some(b"text/event-stream; charset=utf-8"), None);
        m.body(
            b"data: {\"choices\":[{\"delta\":\"hi\"}]}\n\ndata: {\"usage\":{\"total_",
            &mut b,
        );
        m.body(
            b"tokens\":40}}\n\ndata: {\"usage\":{\"total_tokens\":41}}\n\n",
            &mut b,
        );
        m.body(b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n", &mut b);
        assert_eq!(m.finish(true, &mut b), Some(41));
        let mut m = Meter::new(&s);
        m.headers(None, Some(b"text/event-stream"), None);
        m.body(b"data: {\"usage\":{\"total_tokens\":41}}\n\n", &mut b);
        assert_eq!(
            m.finish(false, &mut b),
            Some(41),
            "a stream cut short after its usage event settles at that figure"
        );
        let mut m = Meter::new(&s);
        m.headers(None, Some(b"text/event-stream"), None);
        m.body(b"data: {\"choices\":[]}\n\n", &mut b);
        assert_eq!(
            m.finish(false, &mut b),
            None,
            "cut short before it: unreported"
        );
        let mut m = Meter::new(&s);
        m.headers(None, Some(b"text/event-stream"), None);
        m.body(b"data: {\"usage\":{\"total_tokens\":9}}", &mut b);
        assert_eq!(
            m.finish(true, &mut b),
            Some(9),
            "the last line without its newline"
        );
    }

    fn settlement(reserved: u64, cost: u64) -> Settlement {
        Settlement {
            rule: "llm".into(),
            subject: Subject::new(),
            reserved,
            cost,
            receipt: None,
        }
    }

    #[test]
    fn a_worker_keeps_at_most_its_budget_of_metered_bodies_at_once() {
        let s = spec(r#"{"reserve": 4096, "response_json": "usage.total_tokens"}"#);
        let mut b = Budget::default();
        let chunk = vec![b' '; MAX_METERED_BYTES - 64];
        let mut meters: Vec<Meter> = (0..20)
            .map(|_| {
                let mut m = Meter::new(&s);
                m.headers(None, Some(b"application/json"), None);
                m.body(&chunk, &mut b);
                m
            })
            .collect();
        assert!(b.held() <= MAX_METERED_BYTES_PER_WORKER, "{}", b.held());
        let kept = MAX_METERED_BYTES_PER_WORKER / chunk.len();
        assert_eq!(b.held(), kept * chunk.len(), "{kept} bodies kept whole");
        for m in &mut meters {
            m.body(br#"{"usage":{"total_tokens":7}}"#, &mut b);
        }
        let read: Vec<Option<u64>> = meters.iter_mut().map(|m| m.finish(true, &mut b)).collect();
        assert_eq!(read.iter().filter(|r| **r == Some(7)).count(), kept);
        assert_eq!(
            read.iter().filter(|r| r.is_none()).count(),
            20 - kept,
            "unreported"
        );
        assert_eq!(b.held(), 0, "every byte given back");
    }

    #[test]
    fn every_batch_fits_the_sidecars_body_limit_with_the_longest_subjects() {
        // Issue 32, case 3: 600 settlements of 1,024-byte subjects (the longest claim taken as
        // an identity) are 600 KiB: sent in batches that each fit a call.
        let mut o = Outbox::new(1);
        for i in 0..600 {
            let mut subject = Subject::new();
            subject.push("user", Some(format!("{i:04}{}", "\"".repeat(1020))));
            o.push(Settlement {
                subject,
                receipt: Some(ratelimit_wire::MAX_RECEIPT.to_string()),
                ..settlement(999_999_999_999_999, 3)
            });
        }
        let (mut sent, mut calls) = (0, 0);
        while let Some(body) = o.next_call(&"d".repeat(128)) {
            assert!(body.len() <= budget::MAX_BODY_BYTES, "{} bytes", body.len());
            let req: SettleRequest = serde_json::from_slice(&body).unwrap();
            sent += req.settlements.len();
            calls += 1;
            o.answered(true);
        }
        assert_eq!(sent, 600, "every settlement sent");
        assert!(calls > 10, "{calls} calls");
    }

    #[test]
    fn the_outbox_sends_batches_retries_under_one_id_and_counts_the_lost() {
        let mut o = Outbox::new(0xab);
        assert_eq!(o.push(settlement(10, 10)), 0);
        assert_eq!(o.pending(), 0, "nothing to settle");
        o.push(settlement(10, 3));
        o.push(settlement(10, 30));
        let first = o.next_call("d").unwrap();
        assert!(o.next_call("d").is_none(), "one batch in flight");
        let req: SettleRequest = serde_json::from_slice(&first).unwrap();
        assert_eq!(
            (req.id.as_deref(), req.settlements.len()),
            (Some("ab-1"), 2)
        );
        assert_eq!(
            o.answered(false),
            Delivery {
                retried: 2,
                lost: 0
            }
        );
        o.push(settlement(1, 2));
        assert_eq!(
            o.next_call("d").unwrap(),
            first,
            "the same batch, the same id"
        );
        assert_eq!(o.answered(false).retried, 2);
        assert_eq!(o.next_call("d").unwrap(), first);
        assert_eq!(
            o.answered(false),
            Delivery {
                retried: 0,
                lost: 2
            }
        );
        let next: SettleRequest = serde_json::from_slice(&o.next_call("d").unwrap()).unwrap();
        assert_eq!(
            (next.id.as_deref(), next.settlements.len()),
            (Some("ab-2"), 1)
        );
        assert_eq!(o.answered(true), Delivery::default());
        assert_eq!(o.pending(), 0);
        for _ in 0..MAX_PENDING {
            assert_eq!(o.push(settlement(1, 2)), 0);
        }
        assert_eq!(o.push(settlement(1, 2)), 1, "full: the oldest is lost");
    }
}
