//! The byte budget of one call, which both sides keep: a gateway packs its batches (decisions,
//! settlements, slot renewals and releases) so that each body is at most [`MAX_BODY_BYTES`],
//! and the sidecar accepts at least that much (`--max-body-bytes` cannot be set lower). The
//! sizes here are upper bounds of what `serde_json` writes for each item, cheap to compute
//! without serialising it (checked against the serialised length by this module's tests).

use crate::{Decision, LeaseAsk, LeaseReturn, Settle, SlotRef, Subject};

/// The largest body a gateway sends in one call (`POST /v1/decide`, `/v1/settle`, `/v1/slots`),
/// and the least a sidecar accepts.
pub const MAX_BODY_BYTES: usize = 65_536;

/// An upper bound of a call's envelope: its domain, attempt or batch id (each at most 128
/// bytes, 6 bytes a byte escaped at worst), field names, brackets and separators.
pub const ENVELOPE_BYTES: usize = 2 * 6 * crate::MAX_NAME_BYTES + 128;

/// What the items of one call may spend: [`MAX_BODY_BYTES`] less the envelope.
pub const ITEMS_BYTES: usize = MAX_BODY_BYTES - ENVELOPE_BYTES;

/// The bytes of `s` as a JSON string: its quotes, and each byte `serde_json` escapes (`"`, `\`,
/// the control characters) as it escapes it.
pub fn str_bytes(s: &str) -> usize {
    2 + s
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum::<usize>()
}

/// An upper bound of a subject's JSON bytes.
pub fn subject_bytes(subject: &Subject) -> usize {
    2 + subject
        .0
        .iter()
        .map(|(k, v)| str_bytes(k) + 2 + v.as_deref().map_or(4, str_bytes))
        .sum::<usize>()
}

/// An upper bound of a decision's JSON bytes (a separator included).
pub fn decision_bytes(d: &Decision) -> usize {
    decision_bytes_of(&d.rule, &d.subject, d.cost, d.lease.as_ref(), d.receipt)
}

/// [`decision_bytes`] of a decision of these fields, without building it.
pub fn decision_bytes_of(
    rule: &str,
    subject: &Subject,
    cost: u64,
    lease: Option<&LeaseAsk>,
    receipt: bool,
) -> usize {
    // {"rule":,"subject":,"cost":N}, and ,"lease":{"id":N,"tokens":N,"ttl_ms":N} ,"receipt":true
    let lease = lease.map_or(0, |l| {
        34 + digits(l.id) + digits(l.tokens) + digits(l.ttl_ms)
    });
    28 + str_bytes(rule) + subject_bytes(subject) + digits(cost) + lease + 15 * usize::from(receipt)
}

/// The decimal digits of `n`.
fn digits(n: u64) -> usize {
    n.checked_ilog10().map_or(1, |d| d as usize + 1)
}

/// An upper bound of a request's JSON bytes: its decisions, each with a separator.
pub fn request_bytes(decisions: &[Decision]) -> usize {
    16 + decisions.iter().map(decision_bytes).sum::<usize>()
}

/// An upper bound of a lease return's JSON bytes (a separator included).
pub fn return_bytes(r: &LeaseReturn) -> usize {
    64 + str_bytes(&r.rule) + subject_bytes(&r.subject)
}

/// An upper bound of a settlement's JSON bytes (a separator included).
pub fn settle_bytes(s: &Settle) -> usize {
    // {"rule":,"subject":,"reserved":N,"cost":N,"receipt":"N"},
    96 + str_bytes(&s.rule) + subject_bytes(&s.subject)
}

/// An upper bound of a slot reference's JSON bytes (a separator included).
pub fn slot_bytes(s: &SlotRef) -> usize {
    // {"rule":,"subject":,"slot":},
    32 + str_bytes(&s.rule) + subject_bytes(&s.subject) + str_bytes(&s.slot)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DecideRequest, RequestDecisions, SettleRequest, SlotsRequest};

    fn subject(values: &[&str]) -> Subject {
        let mut s = Subject::new();
        for (i, v) in values.iter().enumerate() {
            s.push(format!("d{i}"), Some((*v).to_string()));
        }
        s.push("unknown", None);
        s
    }

    const AWKWARD: [&str; 4] = ["plain", "q\"u\\o\te", "\u{1}\u{1f}ctl", "ünïcødé"];

    #[test]
    fn a_string_is_measured_as_serde_writes_it() {
        for s in AWKWARD {
            assert_eq!(
                str_bytes(s),
                serde_json::to_string(s).unwrap().len(),
                "{s:?}"
            );
        }
    }

    #[test]
    fn each_bound_holds_what_serde_writes_with_the_largest_numbers() {
        let subject = subject(&AWKWARD);
        let d = Decision {
            rule: "a-rule".into(),
            subject: subject.clone(),
            cost: 999_999_999_999_999,
            lease: Some(LeaseAsk {
                id: crate::MAX_LEASE_ID,
                tokens: 999_999_999_999_999,
                ttl_ms: 60_000,
            }),
            receipt: true,
        };
        let r = LeaseReturn {
            rule: "a-rule".into(),
            subject: subject.clone(),
            id: crate::MAX_LEASE_ID,
            tokens: 999_999_999_999_999,
        };
        let call = DecideRequest {
            domain: "d".repeat(crate::MAX_NAME_BYTES),
            attempt: Some("\u{1}".repeat(crate::MAX_NAME_BYTES)),
            requests: vec![RequestDecisions {
                decisions: vec![d.clone(), d.clone()],
            }],
            returns: vec![r.clone()],
        };
        let body = serde_json::to_vec(&call).unwrap().len();
        let bound = ENVELOPE_BYTES + request_bytes(&[d.clone(), d.clone()]) + return_bytes(&r);
        assert!(body <= bound, "decide: {body} > {bound}");
        // Without a lease or a receipt, every number of one digit: still a bound.
        let small = Decision {
            cost: 1,
            lease: None,
            receipt: false,
            ..d
        };
        let one = serde_json::to_vec(&small).unwrap().len() + 1;
        assert!(one <= decision_bytes(&small), "{one}");
        assert!(decision_bytes(&small) <= one + 16, "tight: {one}");
        let s = Settle {
            rule: "a-rule".into(),
            subject: subject.clone(),
            reserved: 999_999_999_999_999,
            cost: 999_999_999_999_999,
            receipt: Some(crate::MAX_RECEIPT.to_string()),
        };
        let call = SettleRequest {
            domain: "d".repeat(crate::MAX_NAME_BYTES),
            id: Some("\u{1}".repeat(crate::MAX_NAME_BYTES)),
            settlements: vec![s.clone(), s.clone()],
        };
        let body = serde_json::to_vec(&call).unwrap().len();
        assert!(
            body <= ENVELOPE_BYTES + 2 * settle_bytes(&s),
            "settle: {body}"
        );
        let slot = SlotRef {
            rule: "a-rule".into(),
            subject,
            slot: "s".repeat(crate::MAX_SLOT_ID_BYTES),
        };
        let call = SlotsRequest {
            domain: "d".repeat(crate::MAX_NAME_BYTES),
            renew: vec![slot.clone()],
            release: vec![slot.clone()],
        };
        let body = serde_json::to_vec(&call).unwrap().len();
        assert!(
            body <= ENVELOPE_BYTES + 2 * slot_bytes(&slot),
            "slots: {body}"
        );
    }
}
