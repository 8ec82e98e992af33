//! Redis key names: one bucket per domain and descriptor entries, whoever asks (the wasm filter
//! or Envoy's rate limit API), so both draw from one budget.
//!
//! Bucket: `<prefix>{<domain>|<key>=<value>|...}`, e.g. `rl:{ratelimit|rule=per-app|app=alpha}`.
//! Every component is percent-encoded outside `[A-Za-z0-9._~:@/-]`, so `|`, `=`, `#`, `%`, `{`,
//! `}` never appear raw and no two descriptors share a key; an encoded value longer than
//! [`MAX_VALUE_BYTES`] becomes `<key>#<sha256 hex of the raw value>`; an unknown value (a subject
//! the gateway could not identify, sharing one bucket) is `<key>~`. The whole name sits inside
//! one Cluster hash tag, so buckets spread over slots by name.
//!
//! Record (deduplication, refunds): `<bucket key of a group's first decision>:a:<attempt>`, in
//! the same slot as that bucket.
//!
//! Concurrency slots (`docs/concurrency.md`): `<bucket key>:c`, a sorted set in the bucket's slot.
//!
//! Regional rules (`docs/regions.md`), one of each per rule in each region's Redis, in one slot:
//! the share record `<prefix>share:{<domain>|<rule>}` and the demand counters
//! `<prefix>demand:{<domain>|<rule>}`; and in one region's Redis the rebalancer's leader lock
//! `<prefix>rebalancer:{<domain>|<rule>}`. Bucket keys start `<prefix>{`, so none can be one.

use ratelimit_wire::names::{push_escaped, push_value};

/// Encoded values longer than this are replaced by their SHA-256.
pub const MAX_VALUE_BYTES: usize = 80;

/// The bucket key of `entries` in `domain`.
pub fn bucket_key(prefix: &str, domain: &str, entries: &[(&str, Option<&str>)]) -> String {
    let mut key = String::with_capacity(prefix.len() + 2 + domain.len() + 24 * entries.len());
    key.push_str(prefix);
    key.push('{');
    push_escaped(&mut key, domain);
    for (k, v) in entries {
        key.push('|');
        push_escaped(&mut key, k);
        match v {
            None => key.push('~'),
            Some(v) => push_value(&mut key, v, MAX_VALUE_BYTES),
        }
    }
    key.push('}');
    key
}

/// The record key of a group whose first bucket is `bucket_key`.
pub fn record_key(bucket_key: &str, attempt: &str) -> String {
    let mut key = String::with_capacity(bucket_key.len() + 3 + attempt.len());
    key.push_str(bucket_key);
    key.push_str(":a:");
    push_escaped(&mut key, attempt);
    key
}

/// The record of a settle batch's part on one node: `<its first bucket key>:s:<id>` (same slot),
/// so that a repeat of the batch applies nothing twice.
pub fn settle_record_key(bucket_key: &str, id: &str) -> String {
    let mut key = String::with_capacity(bucket_key.len() + 3 + id.len());
    key.push_str(bucket_key);
    key.push_str(":s:");
    push_escaped(&mut key, id);
    key
}

/// The concurrency slots of a rule's subject (`lua/slots.lua`): `<its bucket key>:c`, in the
/// bucket's Cluster slot.
pub fn slots_key(bucket_key: &str) -> String {
    let mut key = String::with_capacity(bucket_key.len() + 2);
    key.push_str(bucket_key);
    key.push_str(":c");
    key
}

/// The share record of a regional rule (written by the rebalancer, read by the sidecars).
pub fn share_key(prefix: &str, domain: &str, rule: &str) -> String {
    rule_key(prefix, "share:", domain, rule)
}

/// The demand counters of a regional rule (added to by the sidecars, read by the rebalancer).
pub fn demand_key(prefix: &str, domain: &str, rule: &str) -> String {
    rule_key(prefix, "demand:", domain, rule)
}

/// The rebalancer's leader lock of a regional rule (one rebalancer at a time per rule).
pub fn leader_key(prefix: &str, domain: &str, rule: &str) -> String {
    rule_key(prefix, "rebalancer:", domain, rule)
}

fn rule_key(prefix: &str, kind: &str, domain: &str, rule: &str) -> String {
    let mut key = String::with_capacity(prefix.len() + kind.len() + domain.len() + rule.len() + 3);
    key.push_str(prefix);
    key.push_str(kind);
    key.push('{');
    push_escaped(&mut key, domain);
    key.push('|');
    push_escaped(&mut key, rule);
    key.push('}');
    key
}

/// The Redis Cluster hash slot of a key: CRC16 (XMODEM) of its hash tag (the text between the
/// first `{` and the next `}`, when not empty) or of the whole key, modulo 16384.
pub fn cluster_slot(key: &[u8]) -> u16 {
    let tag = key.iter().position(|b| *b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        rest.iter()
            .position(|b| *b == b'}')
            .filter(|close| *close > 0)
            .map(|close| &rest[..close])
    });
    crc16::State::<crc16::XMODEM>::calculate(tag.unwrap_or(key)) % 16384
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wasm_decision_and_a_descriptor_name_the_same_bucket() {
        let k = bucket_key(
            "rl:",
            "ratelimit",
            &[("rule", Some("per-app")), ("app", Some("alpha"))],
        );
        assert_eq!(k, "rl:{ratelimit|rule=per-app|app=alpha}");
    }

    #[test]
    fn values_cannot_collide_or_break_the_hash_tag() {
        let a = bucket_key("rl:", "d", &[("user", Some("a|app=b"))]);
        let b = bucket_key("rl:", "d", &[("user", Some("a")), ("app", Some("b"))]);
        assert_ne!(a, b);
        let tricky = bucket_key("rl:", "d", &[("user", Some("x}{y"))]);
        assert_eq!(tricky, "rl:{d|user=x%7D%7By}");
        assert_eq!(tricky.matches('{').count(), 1);
        let unknown = bucket_key("rl:", "d", &[("user", None)]);
        let tilde = bucket_key("rl:", "d", &[("user", Some("~"))]);
        assert_eq!(unknown, "rl:{d|user~}");
        assert_ne!(unknown, tilde);
    }

    #[test]
    fn long_values_are_hashed_and_keys_stay_bounded() {
        let long = "é".repeat(1000);
        let k = bucket_key("rl:", "d", &[("user", Some(&long))]);
        assert!(k.contains("user#") && k.len() < 100, "{k}");
        assert_ne!(
            k,
            bucket_key("rl:", "d", &[("user", Some(&"é".repeat(1001)))])
        );
    }

    #[test]
    fn a_record_shares_its_buckets_slot() {
        let b = bucket_key("rl:", "ratelimit", &[("rule", Some("r"))]);
        let r = record_key(&b, "c-1/{x}");
        assert_eq!(cluster_slot(b.as_bytes()), cluster_slot(r.as_bytes()));
    }

    #[test]
    fn slots_share_their_buckets_slot() {
        let b = bucket_key(
            "rl:",
            "ratelimit",
            &[("rule", Some("r")), ("app", Some("a"))],
        );
        let c = slots_key(&b);
        assert_eq!(c, "rl:{ratelimit|rule=r|app=a}:c");
        assert_eq!(cluster_slot(b.as_bytes()), cluster_slot(c.as_bytes()));
    }

    #[test]
    fn a_regional_rule_keeps_its_share_and_demand_in_one_slot() {
        let share = share_key("rl:", "ratelimit", "per-app");
        let demand = demand_key("rl:", "ratelimit", "per-app");
        assert_eq!(share, "rl:share:{ratelimit|per-app}");
        assert_eq!(demand, "rl:demand:{ratelimit|per-app}");
        assert_eq!(
            cluster_slot(share.as_bytes()),
            cluster_slot(demand.as_bytes())
        );
        assert_ne!(
            share,
            bucket_key("rl:", "ratelimit", &[("rule", Some("per-app"))])
        );
    }

    #[test]
    fn slots_follow_the_cluster_spec() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(cluster_slot(b"123456789"), 0x31C3);
        assert_eq!(cluster_slot(b"foo"), 12182);
        assert_eq!(
            cluster_slot(b"{user1000}.following"),
            cluster_slot(b"{user1000}.followers")
        );
        assert_ne!(cluster_slot(b"foo{}{bar}"), cluster_slot(b"bar"));
        assert_eq!(cluster_slot(b"foo{{bar}}zap"), cluster_slot(b"{bar"));
        for key in ["a", "rl:{app:alpha}", "x{y}z", "{}", "{", "}{a}"] {
            assert_eq!(
                redis::cluster_routing::Slot::for_key(key),
                redis::cluster_routing::Slot::new(cluster_slot(key.as_bytes())).unwrap(),
                "{key}"
            );
        }
    }
}
