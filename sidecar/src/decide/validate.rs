//! The `/v1/decide` and `/v1/settle` bodies, parsed and checked before anything is decided: counts, lengths, names,
//! costs and lease asks within the bounds of `ratelimit-wire`, every error naming the field
//! (`requests[0].decisions[1].rule: ...`) and bounded in length.

use std::collections::HashSet;

use ratelimit_wire::{
    elide_middle, is_slot_id, DecideRequest, LeaseAsk, SettleRequest, SlotsRequest,
    MAX_CALL_DECISIONS, MAX_DECISIONS, MAX_LEASE_ID, MAX_NAME_BYTES, MAX_REQUESTS, MAX_RETURNS,
    MAX_SETTLEMENTS, MAX_SLOT_ID_BYTES, MAX_SLOT_UPDATES, MAX_VALUE_BYTES,
};
use serde::de::DeserializeOwned;

use crate::policy::own_format::RULE_KEY;
use crate::policy::MAX_CAPACITY;

/// The longest lease a caller may ask for, in milliseconds.
pub const MAX_LEASE_TTL_MS: u64 = 60_000;

/// Why a call got no answers at all.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// The call is malformed; the message names the field (answered 400).
    #[error("{0}")]
    Invalid(String),
}

/// The longest error message a refused call is answered with, in bytes. serde's messages quote
/// what they refuse (an unknown field, a string where a number belongs), and a caller chooses
/// that text: unbounded, one request could make the sidecar echo (and escape, up to six bytes a
/// byte) its whole body back.
pub const MAX_ERROR_BYTES: usize = 512;

/// Parses and validates a call body; the error names the field
/// (`requests[0].decisions[1].rule: ...`) and is at most [`MAX_ERROR_BYTES`] long.
pub fn parse_request(body: &[u8]) -> Result<DecideRequest, DecideError> {
    parse_body(body, validate)
}

/// Parses and validates a `/v1/settle` body, as [`parse_request`] a decision call.
pub fn parse_settle(body: &[u8]) -> Result<SettleRequest, DecideError> {
    parse_body(body, validate_settle)
}

/// Parses and validates a `/v1/slots` body, as [`parse_request`] a decision call.
pub fn parse_slots(body: &[u8]) -> Result<SlotsRequest, DecideError> {
    parse_body(body, validate_slots)
}

/// Checks a slots call: the domain, 1 to [`MAX_SLOT_UPDATES`] slots in all, each naming a rule
/// and subject as a decision does and a slot id.
pub fn validate_slots(call: &SlotsRequest) -> Result<(), DecideError> {
    let invalid = |s: String| Err(DecideError::Invalid(s));
    if call.domain.is_empty() || call.domain.len() > MAX_NAME_BYTES {
        return invalid(format!("domain: must be 1 to {MAX_NAME_BYTES} bytes"));
    }
    let n = call.renew.len() + call.release.len();
    if n == 0 || n > MAX_SLOT_UPDATES {
        return invalid(format!(
            "renew, release: must hold 1 to {MAX_SLOT_UPDATES} slots together, got {n}"
        ));
    }
    for (field, refs) in [("renew", &call.renew), ("release", &call.release)] {
        for (i, r) in refs.iter().enumerate() {
            let at = format!("{field}[{i}]");
            check_rule_and_subject(&at, &r.rule, &r.subject)?;
            check_slot_id(&format!("{at}.slot"), &r.slot)?;
        }
    }
    Ok(())
}

fn check_slot_id(at: &str, id: &str) -> Result<(), DecideError> {
    if is_slot_id(id) {
        return Ok(());
    }
    Err(DecideError::Invalid(format!(
        "{at}: must be 1 to {MAX_SLOT_ID_BYTES} characters of [A-Za-z0-9_.-]"
    )))
}

fn parse_body<T: DeserializeOwned>(
    body: &[u8],
    validate: fn(&T) -> Result<(), DecideError>,
) -> Result<T, DecideError> {
    let bounded = |DecideError::Invalid(m)| DecideError::Invalid(elide_middle(m, MAX_ERROR_BYTES));
    // A body that parses is parsed once, without tracking the path (which allocates at every
    // field: a measurable share of a decision's CPU); one that does not is parsed again with the
    // path, for an error that names the field.
    if let Ok(request) = serde_json::from_slice::<T>(body) {
        validate(&request).map_err(bounded)?;
        return Ok(request);
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let request: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        bounded(if path == "." || path.is_empty() {
            DecideError::Invalid(e.inner().to_string())
        } else {
            DecideError::Invalid(format!("{path}: {}", e.inner()))
        })
    })?;
    de.end().map_err(|e| {
        bounded(DecideError::Invalid(format!(
            "trailing data after the JSON body: {e}"
        )))
    })?;
    validate(&request).map_err(bounded)?;
    Ok(request)
}

/// Checks a settle call: the domain and id, at most [`MAX_SETTLEMENTS`], each naming a rule and
/// subject as a decision does, its figures within a capacity.
pub fn validate_settle(call: &SettleRequest) -> Result<(), DecideError> {
    let invalid = |s: String| Err(DecideError::Invalid(s));
    if call.domain.is_empty() || call.domain.len() > MAX_NAME_BYTES {
        return invalid(format!("domain: must be 1 to {MAX_NAME_BYTES} bytes"));
    }
    if let Some(id) = &call.id {
        if id.is_empty() || id.len() > MAX_NAME_BYTES {
            return invalid(format!("id: must be 1 to {MAX_NAME_BYTES} bytes"));
        }
    }
    if call.settlements.is_empty() || call.settlements.len() > MAX_SETTLEMENTS {
        return invalid(format!(
            "settlements: must hold 1 to {MAX_SETTLEMENTS} settlements, got {}",
            call.settlements.len()
        ));
    }
    for (i, st) in call.settlements.iter().enumerate() {
        let at = format!("settlements[{i}]");
        check_rule_and_subject(&at, &st.rule, &st.subject)?;
        if st.reserved == 0 || st.reserved > MAX_CAPACITY {
            return invalid(format!("{at}.reserved: must be 1 to {MAX_CAPACITY}"));
        }
        if st.cost > MAX_CAPACITY {
            return invalid(format!("{at}.cost: must be 0 to {MAX_CAPACITY}"));
        }
        if let Some(r) = &st.receipt {
            if ratelimit_wire::parse_receipt(r).is_none() {
                return invalid(format!(
                    "{at}.receipt: must be a receipt the sidecar gave (1 to {} in decimal digits)",
                    ratelimit_wire::MAX_RECEIPT
                ));
            }
        }
    }
    Ok(())
}

/// Checks what serde cannot: counts, lengths, names, costs, lease asks.
pub fn validate(call: &DecideRequest) -> Result<(), DecideError> {
    let invalid = |s: String| Err(DecideError::Invalid(s));
    if call.domain.is_empty() || call.domain.len() > MAX_NAME_BYTES {
        return invalid(format!("domain: must be 1 to {MAX_NAME_BYTES} bytes"));
    }
    if let Some(a) = &call.attempt {
        if a.is_empty() || a.len() > MAX_NAME_BYTES {
            return invalid(format!("attempt: must be 1 to {MAX_NAME_BYTES} bytes"));
        }
    }
    if call.requests.is_empty() && call.returns.is_empty() {
        return invalid("requests: must hold at least one request".into());
    }
    if call.requests.len() > MAX_REQUESTS {
        return invalid(format!(
            "requests: {} requests, at most {MAX_REQUESTS} are accepted",
            call.requests.len()
        ));
    }
    let mut total = 0;
    for (r, request) in call.requests.iter().enumerate() {
        let n = request.decisions.len();
        if n == 0 || n > MAX_DECISIONS {
            return invalid(format!(
                "requests[{r}].decisions: must hold 1 to {MAX_DECISIONS} decisions, got {n}"
            ));
        }
        total += n;
        for (d, decision) in request.decisions.iter().enumerate() {
            let at = format!("requests[{r}].decisions[{d}]");
            check_rule_and_subject(&at, &decision.rule, &decision.subject)?;
            if decision.cost == 0 || decision.cost > MAX_CAPACITY {
                return invalid(format!("{at}.cost: must be 1 to {MAX_CAPACITY}"));
            }
            if let Some(l) = &decision.lease {
                check_lease(&format!("{at}.lease"), l)?;
            }
        }
    }
    if total > MAX_CALL_DECISIONS {
        return invalid(format!(
            "requests: {total} decisions in all, at most {MAX_CALL_DECISIONS} are accepted"
        ));
    }
    if call.returns.len() > MAX_RETURNS {
        return invalid(format!("returns: at most {MAX_RETURNS} are accepted"));
    }
    for (i, r) in call.returns.iter().enumerate() {
        let at = format!("returns[{i}]");
        check_rule_and_subject(&at, &r.rule, &r.subject)?;
        if r.id > MAX_LEASE_ID {
            return invalid(format!("{at}.id: must be at most {MAX_LEASE_ID}"));
        }
        if r.tokens > MAX_CAPACITY {
            return invalid(format!("{at}.tokens: must be at most {MAX_CAPACITY}"));
        }
    }
    Ok(())
}

fn check_rule_and_subject(
    at: &str,
    rule: &str,
    subject: &ratelimit_wire::Subject,
) -> Result<(), DecideError> {
    let invalid = |s: String| Err(DecideError::Invalid(s));
    if rule.is_empty() || rule.len() > MAX_NAME_BYTES {
        return invalid(format!("{at}.rule: must be 1 to {MAX_NAME_BYTES} bytes"));
    }
    let mut seen = HashSet::new();
    for (k, v) in subject.iter() {
        if k.is_empty() || k.len() > MAX_NAME_BYTES || k == RULE_KEY {
            return invalid(format!(
                "{at}.subject: {k:?} is not a dimension name (1 to {MAX_NAME_BYTES} bytes, not \"rule\")"
            ));
        }
        if !seen.insert(k) {
            return invalid(format!("{at}.subject.{k}: named twice"));
        }
        if v.is_some_and(|v| v.len() > MAX_VALUE_BYTES) {
            return invalid(format!(
                "{at}.subject.{k}: the value is longer than {MAX_VALUE_BYTES} bytes"
            ));
        }
    }
    Ok(())
}

fn check_lease(at: &str, l: &LeaseAsk) -> Result<(), DecideError> {
    if l.id > MAX_LEASE_ID {
        return Err(DecideError::Invalid(format!(
            "{at}.id: must be at most {MAX_LEASE_ID}"
        )));
    }
    if l.ttl_ms == 0 || l.ttl_ms > MAX_LEASE_TTL_MS {
        return Err(DecideError::Invalid(format!(
            "{at}.ttl_ms: must be 1 to {MAX_LEASE_TTL_MS}"
        )));
    }
    if l.tokens > MAX_CAPACITY {
        return Err(DecideError::Invalid(format!(
            "{at}.tokens: must be at most {MAX_CAPACITY}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> String {
        match parse_request(body.as_bytes()) {
            Err(DecideError::Invalid(e)) => e,
            Ok(_) => panic!("{body} should be invalid"),
        }
    }

    #[test]
    fn errors_quoting_a_caller_s_text_are_bounded_and_keep_both_ends() {
        let long = "x".repeat(100_000);
        for body in [
            format!(r#"{{"requests":[{{"decisions":[{{"rule":"r","cost":"{long}"}}]}}]}}"#),
            format!(r#"{{"{long}":1}}"#),
            format!(
                r#"{{"requests":[{{"decisions":[{{"rule":"r","subject":{{"{long}":"v"}}}}]}}]}}"#
            ),
        ] {
            let e = err(&body);
            assert!(e.len() <= MAX_ERROR_BYTES, "{} bytes", e.len());
            assert!(e.contains(" [...] "), "{e}");
        }
        let e = err(&format!(
            r#"{{"requests":[{{"decisions":[{{"rule":"r","cost":"{long}"}}]}}]}}"#
        ));
        assert!(
            e.starts_with("requests[0].decisions[0].cost: invalid type"),
            "{e}"
        );
        assert!(e.ends_with("expected u64 at line 1 column 100048"), "{e}");
    }

    #[test]
    fn validation_names_the_field() {
        assert!(err("nope").contains("expected"));
        assert!(err(r#"{"requests":[]}"#).starts_with("requests:"));
        assert!(err(r#"{"requests":[{"decisions":[]}]}"#).starts_with("requests[0].decisions:"));
        let e = err(r#"{"requests":[{"decisions":[{"rule":""}]}]}"#);
        assert!(e.starts_with("requests[0].decisions[0].rule:"), "{e}");
        let e = err(r#"{"requests":[{"decisions":[{"rule":"r","cost":0}]}]}"#);
        assert!(e.starts_with("requests[0].decisions[0].cost:"), "{e}");
        let e = err(r#"{"requests":[{"decisions":[{"rule":"r","subject":{"rule":"x"}}]}]}"#);
        assert!(e.starts_with("requests[0].decisions[0].subject:"), "{e}");
        let e = err(r#"{"requests":[{"decisions":[{"rule":"r","subject":{"a":"x","a":"y"}}]}]}"#);
        assert!(e.contains("subject.a: named twice"), "{e}");
        let e = err(r#"{"requests":[{"decisions":[{"rule":"r","capacity":5}]}]}"#);
        assert!(e.contains("capacity"), "{e}");
        let e = err(
            r#"{"requests":[{"decisions":[{"rule":"r","lease":{"id":1,"tokens":5,"ttl_ms":0}}]}]}"#,
        );
        assert!(
            e.starts_with("requests[0].decisions[0].lease.ttl_ms:"),
            "{e}"
        );
        let e = err(r#"{"requests":[{"decisions":[{"rule":"r"}]}]} x"#);
        assert!(e.contains("trailing"), "{e}");
        let many = format!(
            r#"{{"requests":[{}]}}"#,
            vec![r#"{"decisions":[{"rule":"r"}]}"#; MAX_REQUESTS + 1].join(",")
        );
        assert!(err(&many).contains("at most"));
    }
}
