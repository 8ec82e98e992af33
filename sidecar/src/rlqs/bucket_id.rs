//! An RLQS bucket id read as a decision's entries: the key `rule` names the policy rule, every
//! other key is a dimension of the subject. The map has no order; the subject's dimensions are
//! taken in name order (so a wasm filter rule whose subject lists them in name order reaches the
//! same Redis bucket).

use std::collections::HashMap;
use std::sync::LazyLock;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::BucketId;
use envoy_types::pb::google::protobuf::Duration;
use prost::Message;
use ratelimit_wire::{MAX_NAME_BYTES, MAX_SUBJECT_ENTRIES, MAX_VALUE_BYTES};

use crate::decide::Entries;
use crate::policy::own_format::RULE_KEY;

/// The decision entries of a bucket id, `rule` first; the error names what is wrong.
pub fn entries(bucket: &HashMap<String, String>) -> Result<Entries, String> {
    let rule = bucket
        .get(RULE_KEY)
        .ok_or_else(|| format!("bucket_id: no {RULE_KEY:?} key naming the policy rule"))?;
    if rule.is_empty() || rule.len() > MAX_NAME_BYTES {
        return Err(format!(
            "bucket_id.{RULE_KEY}: must be 1 to {MAX_NAME_BYTES} bytes"
        ));
    }
    if bucket.len() > 1 + MAX_SUBJECT_ENTRIES {
        return Err(format!(
            "bucket_id: at most {MAX_SUBJECT_ENTRIES} subject keys besides {RULE_KEY:?}, got {}",
            bucket.len() - 1
        ));
    }
    let mut subject: Vec<(&String, &String)> =
        bucket.iter().filter(|(k, _)| *k != RULE_KEY).collect();
    subject.sort();
    let mut out = Vec::with_capacity(bucket.len());
    out.push((RULE_KEY.to_string(), Some(rule.clone())));
    for (k, v) in subject {
        if k.is_empty() || k.len() > MAX_NAME_BYTES {
            return Err(format!(
                "bucket_id: key {:?}: must be 1 to {MAX_NAME_BYTES} bytes",
                truncated(k)
            ));
        }
        if v.len() > MAX_VALUE_BYTES {
            return Err(format!(
                "bucket_id.{k}: longer than {MAX_VALUE_BYTES} bytes"
            ));
        }
        out.push((k.clone(), Some(v.clone())));
    }
    Ok(out)
}

/// The encoded size of the largest usage report of one bucket whose id is within the limits
/// [`entries`] checks (`rule` and 8 subject keys of 128 bytes, values of 4096 bytes, the largest
/// counts and elapsed time): 34,054 bytes. A usage larger than this names no valid bucket, so the
/// quota service drops it unread rather than hold it (docs/rlqs.md, "Reports of any size").
pub fn max_usage_bytes() -> usize {
    static MAX: LazyLock<usize> = LazyLock::new(|| {
        // Keys of 128 bytes, distinct in their last 3 bytes; the rule's value is a name.
        let key = |i: usize| format!("{i:0>width$}", width = MAX_NAME_BYTES);
        let mut bucket: HashMap<String, String> = (0..MAX_SUBJECT_ENTRIES)
            .map(|i| (key(i), "v".repeat(MAX_VALUE_BYTES)))
            .collect();
        bucket.insert(RULE_KEY.to_string(), "r".repeat(MAX_NAME_BYTES));
        BucketQuotaUsage {
            bucket_id: Some(BucketId { bucket }),
            time_elapsed: Some(Duration {
                seconds: i64::MIN,
                nanos: i32::MIN,
            }),
            num_requests_allowed: u64::MAX,
            num_requests_denied: u64::MAX,
        }
        .encoded_len()
    });
    *MAX
}

/// The bucket id as one string, the same for the same map whatever its order (the key under
/// which a stream tracks the bucket).
pub fn canonical(bucket: &HashMap<String, String>) -> String {
    let mut pairs: Vec<(&String, &String)> = bucket.iter().collect();
    pairs.sort();
    let mut s = String::new();
    for (k, v) in pairs {
        s.push_str(&k.len().to_string());
        s.push(':');
        s.push_str(k);
        s.push_str(&v.len().to_string());
        s.push(':');
        s.push_str(v);
    }
    s
}

fn truncated(s: &str) -> &str {
    let mut end = s.len().min(40);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_rule_comes_first_and_the_subject_in_name_order() {
        let e = entries(&id(&[
            ("user", "u1"),
            ("rule", "per-x"),
            ("tenant", "acme"),
        ]))
        .unwrap();
        assert_eq!(
            e,
            vec![
                ("rule".into(), Some("per-x".into())),
                ("tenant".into(), Some("acme".into())),
                ("user".into(), Some("u1".into())),
            ]
        );
    }

    #[test]
    fn malformed_ids_are_named() {
        assert!(entries(&id(&[("tenant", "acme")]))
            .unwrap_err()
            .contains("no \"rule\" key"));
        assert!(entries(&id(&[("rule", "")])).unwrap_err().contains("rule"));
        let many: Vec<(String, String)> = (0..10).map(|i| (format!("k{i}"), "v".into())).collect();
        let mut m: HashMap<String, String> = many.into_iter().collect();
        m.insert("rule".into(), "r".into());
        assert!(entries(&m).unwrap_err().contains("at most 8"));
        let long = "x".repeat(MAX_VALUE_BYTES + 1);
        assert!(entries(&id(&[("rule", "r"), ("k", &long)]))
            .unwrap_err()
            .contains("bucket_id.k"));
    }

    #[test]
    fn the_largest_valid_usage_bounds_every_valid_bucket_id() {
        // The figure docs/rlqs.md states.
        assert_eq!(max_usage_bytes(), 34_054);
        let mut bucket: HashMap<String, String> = (0..MAX_SUBJECT_ENTRIES)
            .map(|i| (format!("k{i:0>127}"), "v".repeat(MAX_VALUE_BYTES)))
            .collect();
        bucket.insert(RULE_KEY.into(), "per-ip".into());
        assert!(entries(&bucket).is_ok());
        let usage = BucketQuotaUsage {
            bucket_id: Some(BucketId { bucket }),
            time_elapsed: Some(Duration {
                seconds: 5,
                nanos: 0,
            }),
            num_requests_allowed: 1 << 40,
            num_requests_denied: 1 << 40,
        };
        assert!(usage.encoded_len() <= max_usage_bytes());
    }

    #[test]
    fn the_canonical_form_does_not_depend_on_order_and_cannot_be_forged() {
        assert_eq!(
            canonical(&id(&[("a", "1"), ("b", "2")])),
            canonical(&id(&[("b", "2"), ("a", "1")]))
        );
        assert_ne!(
            canonical(&id(&[("a", "1b"), ("c", "")])),
            canonical(&id(&[("a", "1"), ("bc", "")]))
        );
    }
}
