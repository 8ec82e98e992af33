//! The share record of a regional rule, as each region's Redis holds it: its layout (written by
//! `lua/share_record.lua`, the rebalancer's write), how a read of it is parsed, and the demand
//! counters next to it. One definition for the sidecars, which read records and add to the
//! counters, and the rebalancer, which writes records and reads the counters.
//!
//! - share record `<prefix>share:{<domain>|<rule>}` ([`crate::keys::share_key`]), a hash:
//!   `version`, `share_ppm`, `lease_ms`, `history` (`<from_ms>:<ppm>,...`, stamped by that Redis's
//!   clock; see the script's header), `run_id` (the Redis process that applied the write); read
//!   with the answering process's run_id by `lua/share_read.lua` ([`read_cmd`], [`parse_read`]);
//! - demand counters `<prefix>demand:{<domain>|<rule>}` ([`crate::keys::demand_key`]), a hash of
//!   two counters that only grow: `admitted` and `rejected` tokens, summed over the region's
//!   sidecars; the rebalancer reads the difference between two reads.

use ratelimit_regions::{Params, Share, ShareHistory};

/// The script that writes a share record, one source of truth in `lua/`.
pub const WRITE_SCRIPT: &str = include_str!("../../../lua/share_record.lua");

/// The script that reads a share record with the run_id of the Redis answering, in `lua/`.
pub const READ_SCRIPT: &str = include_str!("../../../lua/share_read.lua");

/// The most changes a record keeps (older ones are merged conservatively, see the script).
pub const MAX_CHANGES: usize = 32;

/// The demand counters' fields.
pub const ADMITTED: &str = "admitted";
pub const REJECTED: &str = "rejected";

/// The lease a sidecar applies while its region has no record yet: the rebalancer's default
/// (`ratelimit_regions::Params`), which writes its own into every record.
pub fn default_lease_ms() -> u64 {
    Params::default().lease_ms
}

/// A share record as a region's store holds it, as read: the plan's share and version
/// (`ratelimit_regions::ShareRecord`, what the rebalancer writes) with what the store keeps beside
/// them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredShare {
    pub version: u64,
    pub share: Share,
    pub lease_ms: u64,
    pub history: ShareHistory,
    /// The run_id of the Redis process that applied the last write (`None`: written by a
    /// rebalancer that did not stamp it).
    pub run_id: Option<String>,
}

impl StoredShare {
    /// Whether the record was written by the Redis process now answering (`live_run_id`), so it
    /// is the last one written there: a process that restarted from a snapshot, or a replica
    /// promoted after a failover, may hold an older record than the rebalancer last wrote. An
    /// unstamped record is trusted (as before stamps existed).
    pub fn written_by(&self, live_run_id: &str) -> bool {
        self.run_id.as_deref().is_none_or(|r| r == live_run_id)
    }
}

/// The read of a share record ([`READ_SCRIPT`]): `EVAL` (rare: each rule every `lease_ms / 4`).
pub fn read_cmd(key: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(READ_SCRIPT).arg(1).arg(key);
    cmd
}

/// The reply of [`read_cmd`]: the record's fields and the run_id of the Redis that answered.
pub fn parse_read(reply: redis::Value) -> Result<(Vec<(String, String)>, String), String> {
    let (flat, run_id): (Vec<String>, String) = redis::from_redis_value(reply)
        .map_err(|e| format!("unexpected reply to the share record's read: {e}"))?;
    if flat.len() % 2 != 0 {
        return Err("unexpected reply to the share record's read: an odd field list".into());
    }
    let fields = flat
        .chunks_exact(2)
        .map(|kv| (kv[0].clone(), kv[1].clone()))
        .collect();
    Ok((fields, run_id))
}

/// Parses the fields of a record (`HGETALL`): `Ok(None)` when there is none, `Err` naming what is
/// wrong with one that cannot be trusted.
pub fn parse(fields: &[(String, String)]) -> Result<Option<StoredShare>, String> {
    if fields.is_empty() {
        return Ok(None);
    }
    let field = |name: &str| -> Result<&str, String> {
        fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .ok_or_else(|| format!("the share record has no `{name}`"))
    };
    let number = |name: &str| -> Result<u64, String> {
        let v = field(name)?;
        v.parse()
            .map_err(|_| format!("the share record's `{name}` is {v:?}, not a whole number"))
    };
    let version = number("version")?;
    let share = ppm(number("share_ppm")?)
        .ok_or_else(|| "the share record's `share_ppm` is above 1000000".to_string())?;
    let lease_ms = number("lease_ms")?;
    if lease_ms == 0 {
        return Err("the share record's `lease_ms` is 0".into());
    }
    let text = field("history")?;
    let mut history: Option<ShareHistory> = None;
    let mut last = 0;
    for change in text.split(',') {
        let parsed = change
            .split_once(':')
            .and_then(|(t, p)| Some((t.parse::<u64>().ok()?, ppm(p.parse().ok()?)?)));
        let Some((from_ms, s)) = parsed else {
            return Err(format!(
                "the share record's history has {change:?}, not <from_ms>:<ppm>"
            ));
        };
        if from_ms < last {
            return Err("the share record's history is not in time order".into());
        }
        last = from_ms;
        match &mut history {
            None => history = Some(ShareHistory::new(from_ms, s)),
            Some(h) => h.record(from_ms, s),
        }
    }
    let history = history.ok_or("the share record's history is empty")?;
    if history.current() != share {
        return Err(format!(
            "the share record's `share_ppm` ({}) is not its history's last share ({})",
            share.ppm(),
            history.current().ppm()
        ));
    }
    let run_id = fields
        .iter()
        .find(|(k, _)| k == "run_id")
        .map(|(_, v)| v.clone())
        .filter(|v| !v.is_empty());
    Ok(Some(StoredShare {
        version,
        share,
        lease_ms,
        history,
        run_id,
    }))
}

fn ppm(v: u64) -> Option<Share> {
    u32::try_from(v).ok().and_then(Share::from_ppm)
}

/// The counters' values in the fields of a demand hash (missing ones are 0).
pub fn parse_demand(fields: &[(String, String)]) -> Result<(u64, u64), String> {
    let get = |name: &str| -> Result<u64, String> {
        match fields.iter().find(|(k, _)| k == name) {
            None => Ok(0),
            Some((_, v)) => v
                .parse()
                .map_err(|_| format!("the demand counter `{name}` is {v:?}, not a whole number")),
        }
    };
    Ok((get(ADMITTED)?, get(REJECTED)?))
}

/// What the rebalancer writes: `share` under `version`, with the lease the sidecars must apply
/// and how much history to keep (the script's ARGV, in order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareWrite {
    pub version: u64,
    pub share: Share,
    pub lease_ms: u64,
    pub keep_ms: u64,
    /// The share in force before the record existed (the policy's initial share).
    pub initial: Share,
}

impl ShareWrite {
    /// The write of the record `key` (an `EVAL` of [`WRITE_SCRIPT`]: writes are rare, a round
    /// or so per rule every few seconds). Its reply: `[1, version]` when written, `[0, stored
    /// version]` when refused.
    pub fn cmd(&self, key: &str) -> redis::Cmd {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(WRITE_SCRIPT).arg(1).arg(key);
        for a in self.args() {
            cmd.arg(a);
        }
        cmd
    }

    /// The script's arguments.
    pub fn args(&self) -> [u64; 6] {
        [
            self.version,
            u64::from(self.share.ppm()),
            self.lease_ms,
            self.keep_ms,
            u64::from(self.initial.ppm()),
            MAX_CHANGES as u64,
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_record_parses_with_its_history() {
        let r = parse(&fields(&[
            ("version", "3"),
            ("share_ppm", "600000"),
            ("lease_ms", "5000"),
            (
                "history",
                "0:500000,1700000000000:100000,1700000001000:600000",
            ),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(r.version, 3);
        assert_eq!(r.share.ppm(), 600_000);
        assert_eq!(
            r.history
                .changes()
                .map(|(t, s)| (t, s.ppm()))
                .collect::<Vec<_>>(),
            [
                (0, 500_000),
                (1_700_000_000_000, 100_000),
                (1_700_000_001_000, 600_000)
            ]
        );
        assert_eq!(parse(&[]).unwrap(), None, "no record");
        assert_eq!(r.run_id, None);
        assert!(r.written_by("any"), "an unstamped record is trusted");
        let mut stamped = fields(&[
            ("version", "3"),
            ("share_ppm", "600000"),
            ("lease_ms", "5000"),
            ("history", "0:600000"),
            ("run_id", "abc123"),
        ]);
        let r = parse(&stamped).unwrap().unwrap();
        assert!(r.written_by("abc123") && !r.written_by("def456"));
        stamped[4].1.clear();
        assert_eq!(parse(&stamped).unwrap().unwrap().run_id, None);
    }

    #[test]
    fn a_read_carries_the_fields_and_the_live_run_id() {
        use redis::Value;
        let s = |x: &str| Value::BulkString(x.as_bytes().to_vec());
        let reply = Value::Array(vec![
            Value::Array(vec![s("version"), s("2"), s("run_id"), s("abc")]),
            s("def"),
        ]);
        let (f, live) = parse_read(reply).unwrap();
        assert_eq!(f, fields(&[("version", "2"), ("run_id", "abc")]));
        assert_eq!(live, "def");
        let odd = Value::Array(vec![Value::Array(vec![s("version")]), s("def")]);
        assert!(parse_read(odd).is_err());
        assert!(parse_read(Value::Nil).is_err());
    }

    #[test]
    fn a_record_that_cannot_be_trusted_is_an_error_naming_the_field() {
        let base = [
            ("version", "3"),
            ("share_ppm", "600000"),
            ("lease_ms", "5000"),
            ("history", "0:600000"),
        ];
        for (field, value, needle) in [
            ("version", "x", "`version` is \"x\""),
            ("share_ppm", "1000001", "above 1000000"),
            ("share_ppm", "500000", "not its history's last share"),
            ("lease_ms", "0", "`lease_ms` is 0"),
            ("history", "5:1,3:1", "not in time order"),
            ("history", "0;600000", "not <from_ms>:<ppm>"),
        ] {
            let mut f = fields(&base);
            f.iter_mut().find(|(k, _)| k == field).unwrap().1 = value.into();
            let e = parse(&f).unwrap_err();
            assert!(e.contains(needle), "{field}={value}: {e}");
        }
        let missing = fields(&base[..3]);
        assert!(parse(&missing).unwrap_err().contains("no `history`"));
    }

    #[test]
    fn demand_counters_default_to_zero() {
        assert_eq!(parse_demand(&[]).unwrap(), (0, 0));
        assert_eq!(
            parse_demand(&fields(&[("admitted", "7"), ("rejected", "2")])).unwrap(),
            (7, 2)
        );
        assert!(parse_demand(&fields(&[("admitted", "-1")])).is_err());
    }
}
