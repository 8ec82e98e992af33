//! Settlements in Redis: `lua/settle.lua` (one source of truth in `lua/`), one script call per
//! node holding a part of the batch, each part recorded under the batch's id so a repeat
//! applies nothing twice. The script's arguments and reply are documented in its header.

use std::sync::{Arc, LazyLock};

use redis::{Cmd, Value};

use super::StoreOptions;
use crate::keys::settle_record_key;
use crate::store::{Applied, Settlement, StoreError};

/// The settle script's text.
pub const SETTLE_SCRIPT: &str = include_str!("../../../../lua/settle.lua");

/// SHA1 of [`SETTLE_SCRIPT`] (computed once).
pub fn settle_sha1() -> &'static str {
    static SHA1: LazyLock<String> =
        LazyLock::new(|| sha1_smol::Sha1::from(SETTLE_SCRIPT).digest().to_string());
    &SHA1
}

/// The call of `lua/settle.lua` for one node's settlements (at least one): `EVAL` when `eval`
/// (after a `NOSCRIPT`), else `EVALSHA`.
/// `marker`: the node's epoch marker (`--store-reset empty`), or "".
pub fn settle_cmd(
    options: &StoreOptions,
    id: Option<&str>,
    part: &[Settlement],
    marker: &str,
    eval: bool,
) -> Cmd {
    let first: &Arc<str> = &part[0].key;
    let mut c = redis::cmd(if eval { "EVAL" } else { "EVALSHA" });
    c.arg(if eval { SETTLE_SCRIPT } else { settle_sha1() })
        .arg(1)
        .arg(&**first);
    c.arg(
        id.map(|id| settle_record_key(first, id))
            .unwrap_or_default(),
    )
    .arg(options.record_ttl_ms.max(1))
    .arg(marker)
    .arg(part.len());
    for s in part {
        let (capacity, refill_per_sec) = s.bucket.in_force();
        c.arg(&*s.key)
            .arg(capacity)
            .arg(format_float(refill_per_sec))
            .arg(s.reserved)
            .arg(s.cost)
            .arg(s.receipt.map(|r| r.to_string()).unwrap_or_default());
    }
    c
}

/// The script's reply for a part of `n` settlements: what each applied (the tokens after it and
/// its delta), or `None` each for a repeat of the part.
pub fn parse_settle(v: Value, n: usize) -> Result<Vec<Option<Applied>>, StoreError> {
    let bad = |v: &Value| StoreError::Reply(format!("settle reply {v:?}"));
    let Value::Array(items) = &v else {
        return Err(bad(&v));
    };
    match items.first() {
        Some(Value::Int(0)) if items.len() == 1 => Ok(vec![None; n]),
        Some(Value::Int(1)) if items.len() == 2 * n + 1 => items[1..]
            .chunks(2)
            .map(|pair| match pair {
                [Value::Int(tokens), Value::Int(delta)] => Ok(Some(Applied {
                    tokens: *tokens,
                    delta: *delta,
                })),
                _ => Err(bad(&v)),
            })
            .collect(),
        _ => Err(bad(&v)),
    }
}

/// A float as Lua's `tonumber` reads it back exactly (shortest round-trip form).
fn format_float(f: f64) -> String {
    let s = format!("{f:?}");
    s.strip_suffix(".0").map(str::to_string).unwrap_or(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_is_read_per_settlement_or_as_a_repeat() {
        let ints = |v: &[i64]| Value::Array(v.iter().map(|i| Value::Int(*i)).collect());
        let r = parse_settle(ints(&[1, -40, 50, 7, -3]), 2);
        let applied = |tokens, delta| Some(Applied { tokens, delta });
        assert_eq!(r.unwrap(), vec![applied(-40, 50), applied(7, -3)]);
        let r = parse_settle(ints(&[0]), 2);
        assert_eq!(r.unwrap(), vec![None, None]);
        assert!(parse_settle(ints(&[1]), 2).is_err());
        assert!(parse_settle(ints(&[1, 7, -3]), 2).is_err());
        assert!(parse_settle(Value::Nil, 1).is_err());
    }
}
