//! Concurrency slots in Redis: `lua/slots.lua` (one source of truth in `lua/`), one script call
//! per node holding a part of the slots. The script's arguments and reply are documented in its
//! header.

use std::sync::LazyLock;

use redis::{Cmd, Value};

use crate::store::{Slot, SlotUpdate, StoreError};

/// The slots script's text.
pub const SLOTS_SCRIPT: &str = include_str!("../../../../lua/slots.lua");

/// SHA1 of [`SLOTS_SCRIPT`] (computed once).
pub fn slots_sha1() -> &'static str {
    static SHA1: LazyLock<String> =
        LazyLock::new(|| sha1_smol::Sha1::from(SLOTS_SCRIPT).digest().to_string());
    &SHA1
}

/// What one call of the script does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotMode {
    Take,
    Update(SlotUpdate),
}

impl SlotMode {
    fn arg(self) -> &'static str {
        match self {
            SlotMode::Take => "take",
            SlotMode::Update(SlotUpdate::Renew) => "renew",
            SlotMode::Update(SlotUpdate::Release) => "release",
        }
    }
}

/// The call of `lua/slots.lua` for one node's slots (at least one): `EVAL` when `eval` (after a
/// `NOSCRIPT`), else `EVALSHA`. `marker`: the node's epoch marker (`--store-reset empty`), or "".
pub fn slots_cmd(mode: SlotMode, marker: &str, part: &[&Slot], eval: bool) -> Cmd {
    let mut c = redis::cmd(if eval { "EVAL" } else { "EVALSHA" });
    c.arg(if eval { SLOTS_SCRIPT } else { slots_sha1() })
        .arg(1)
        .arg(&*part[0].key)
        .arg(mode.arg())
        .arg(marker)
        .arg(part.len());
    for s in part {
        c.arg(&*s.key)
            .arg(&*s.id)
            .arg(s.ttl_ms.max(1))
            .arg(s.limit.max(1))
            .arg(s.unsure_ms.max(s.ttl_ms).max(1));
    }
    c
}

/// A take's reply: `None` when every slot is held, else the index (from 0) of the full one.
pub fn parse_take(v: &Value, n: usize) -> Result<Option<usize>, StoreError> {
    let bad = || StoreError::Reply(format!("slots take reply {v:?}"));
    match v {
        Value::Array(items) => match &items[..] {
            [Value::Int(1)] => Ok(None),
            [Value::Int(0), Value::Int(i)] if *i >= 1 && (*i as usize) <= n => {
                Ok(Some(*i as usize - 1))
            }
            _ => Err(bad()),
        },
        _ => Err(bad()),
    }
}

/// An update's reply: per slot, whether it was held.
pub fn parse_update(v: &Value, n: usize) -> Result<Vec<bool>, StoreError> {
    let bad = || StoreError::Reply(format!("slots update reply {v:?}"));
    match v {
        Value::Array(items) if items.len() == n => items
            .iter()
            .map(|i| match i {
                Value::Int(0) => Ok(false),
                Value::Int(1) => Ok(true),
                _ => Err(bad()),
            })
            .collect(),
        // No slots: Redis answers an empty table as an empty array.
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_read_by_mode_and_odd_ones_are_errors() {
        let ints = |v: &[i64]| Value::Array(v.iter().map(|i| Value::Int(*i)).collect());
        assert_eq!(parse_take(&ints(&[1]), 2).unwrap(), None);
        assert_eq!(parse_take(&ints(&[0, 2]), 2).unwrap(), Some(1));
        assert!(parse_take(&ints(&[0, 3]), 2).is_err());
        assert!(parse_take(&ints(&[0, 0]), 2).is_err());
        assert!(parse_take(&Value::Nil, 2).is_err());
        assert_eq!(parse_update(&ints(&[1, 0]), 2).unwrap(), vec![true, false]);
        assert!(parse_update(&ints(&[1]), 2).is_err());
        assert!(parse_update(&ints(&[1, 2]), 2).is_err());
    }

    #[test]
    fn the_script_is_flagged_and_reads_the_servers_clock() {
        assert!(SLOTS_SCRIPT.starts_with("#!lua flags=allow-cross-slot-keys\n"));
        assert!(SLOTS_SCRIPT.contains("redis.call('TIME')"));
        assert_eq!(
            slots_sha1(),
            sha1_smol::Sha1::from(SLOTS_SCRIPT).digest().to_string()
        );
    }
}
