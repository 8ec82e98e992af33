//! The bucket scripts and their calling convention, on the Rust side: the two scripts
//! ([`Script`]), the arguments of one call built from the work of one node ([`ScriptArgs`]), and
//! an apply call's reply read back as outcomes ([`parse_apply`]). The convention itself (ARGV
//! layout, reply layout) is documented in the headers of `lua/bucket.lua` and `lua/apply.lua`.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};

use ratelimit_wire::Reason;
use redis::{Cmd, Value};

use super::redis::StoreOptions;
use super::{
    epoch_marker, BucketLimits, BucketOutcome, RequestOutcome, Status, StoreError, StoreReset,
    Work, SHARE_MARGIN_MS,
};

/// A bucket script: `lua/bucket.lua` (the bucket function, the arguments, the reads and writes)
/// followed by its mode's file, one source of truth in `lua/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Script {
    /// Decides groups of requests (`lua/apply.lua`).
    Apply,
    /// Gives back what recorded requests charged (`lua/refund.lua`).
    Refund,
}

impl Script {
    pub const ALL: [Script; 2] = [Script::Apply, Script::Refund];

    /// The script's text, as `EVAL` and `SCRIPT LOAD` take it.
    pub fn text(self) -> &'static str {
        match self {
            Script::Apply => concat!(
                include_str!("../../../lua/bucket.lua"),
                include_str!("../../../lua/apply.lua")
            ),
            Script::Refund => concat!(
                include_str!("../../../lua/bucket.lua"),
                include_str!("../../../lua/refund.lua")
            ),
        }
    }

    /// SHA1 of [`Script::text`], as `EVALSHA` wants it (computed once).
    pub fn sha1(self) -> &'static str {
        static SHA1: LazyLock<[String; 2]> = LazyLock::new(|| {
            Script::ALL.map(|s| sha1_smol::Sha1::from(s.text()).digest().to_string())
        });
        &SHA1[self as usize]
    }

    /// The mode the script checks in `ARGV[1]`.
    fn mode(self) -> &'static str {
        match self {
            Script::Apply => "apply",
            Script::Refund => "refund",
        }
    }
}

/// The arguments of one script call (see the calling convention in `lua/bucket.lua`).
pub(crate) struct ScriptArgs {
    pub(crate) script: Script,
    pub(crate) routing_key: Arc<str>,
    pub(crate) argv: Vec<ArgValue>,
}

pub(crate) enum ArgValue {
    Text(Arc<str>),
    Str(String),
    Int(u64),
    Float(f64),
}

impl ScriptArgs {
    pub(crate) fn build<'a>(
        script: Script,
        options: &StoreOptions,
        cluster: bool,
        work: &'a Work,
        refunds: Option<&[Vec<usize>]>,
    ) -> ScriptArgs {
        let mut keys: Vec<Arc<str>> = Vec::new();
        let mut key_index: HashMap<Arc<str>, usize> = HashMap::new();
        let mut limits: Vec<&BucketLimits> = Vec::new();
        // A limit is the same when its numbers and its share history (one leased copy per rule,
        // shared by pointer) are.
        let mut limit_index: HashMap<(u64, u64, usize), usize> = HashMap::new();
        let mut key_of = |k: &Arc<str>| -> usize {
            *key_index.entry(k.clone()).or_insert_with(|| {
                keys.push(k.clone());
                keys.len()
            })
        };
        let mut limit_of = |bucket: &'a BucketLimits| -> usize {
            let share = bucket.share.as_ref().map_or(0, |h| Arc::as_ptr(h) as usize);
            *limit_index
                .entry((bucket.capacity, bucket.refill_per_sec.to_bits(), share))
                .or_insert_with(|| {
                    limits.push(bucket);
                    limits.len()
                })
        };
        let mut body: Vec<ArgValue> = Vec::new();
        body.push(ArgValue::Int(work.groups.len() as u64));
        for g in &work.groups {
            body.push(ArgValue::Str(g.record.clone().unwrap_or_default()));
            body.push(ArgValue::Int(g.requests.len() as u64));
            for request in &g.requests {
                body.push(ArgValue::Int(request.len() as u64));
                for c in request {
                    body.push(ArgValue::Int(key_of(&c.key) as u64));
                    body.push(ArgValue::Int(limit_of(&c.bucket) as u64));
                    body.push(ArgValue::Int(c.cost));
                    body.push(ArgValue::Int(u64::from(c.shadow)));
                    let (id, want, ttl) = c.lease.map_or((0, 0, 0), |l| (l.id, l.tokens, l.ttl_ms));
                    body.push(ArgValue::Int(id));
                    body.push(ArgValue::Int(want));
                    body.push(ArgValue::Int(ttl));
                }
            }
        }
        body.push(ArgValue::Int(work.returns.len() as u64));
        for r in &work.returns {
            body.push(ArgValue::Int(key_of(&r.key) as u64));
            body.push(ArgValue::Int(limit_of(&r.bucket) as u64));
            body.push(ArgValue::Int(r.lease_id));
            body.push(ArgValue::Int(r.tokens));
        }
        if let Some(refunds) = refunds {
            for indices in refunds {
                body.push(ArgValue::Int(indices.len() as u64));
                for i in indices {
                    body.push(ArgValue::Int(*i as u64 + 1));
                }
            }
        }
        let mut argv = Vec::with_capacity(6 + keys.len() + 2 * limits.len() + body.len());
        argv.push(ArgValue::Str(script.mode().to_string()));
        argv.push(ArgValue::Int(options.record_ttl_ms));
        argv.push(ArgValue::Float(options.lease_max_share));
        argv.push(ArgValue::Int(u64::from(cluster)));
        argv.push(ArgValue::Int(SHARE_MARGIN_MS));
        argv.push(ArgValue::Int(keys.len() as u64));
        let routing_key = keys.first().cloned().unwrap_or_else(|| Arc::from(""));
        argv.extend(keys.into_iter().map(ArgValue::Text));
        argv.push(ArgValue::Int(limits.len() as u64));
        for bucket in limits {
            argv.push(ArgValue::Int(bucket.capacity));
            argv.push(ArgValue::Float(bucket.refill_per_sec));
            match &bucket.share {
                None => argv.push(ArgValue::Int(0)),
                Some(history) => {
                    argv.push(ArgValue::Int(history.changes().count() as u64));
                    for (from_ms, share) in history.changes() {
                        argv.push(ArgValue::Int(from_ms));
                        argv.push(ArgValue::Int(u64::from(share.ppm())));
                    }
                }
            }
        }
        argv.extend(body);
        // Last, wherever the body ends: the epoch marker's key, or "" (missing buckets are full).
        argv.push(ArgValue::Str(match options.store_reset {
            StoreReset::Full => String::new(),
            StoreReset::Empty => epoch_marker(&options.key_prefix, cluster, &routing_key),
        }));
        ScriptArgs {
            script,
            routing_key,
            argv,
        }
    }

    /// The `EVALSHA` of the call, or with `eval` its `EVAL` (which caches the script again).
    pub(crate) fn cmd(&self, eval: bool) -> Cmd {
        let mut c = redis::cmd(if eval { "EVAL" } else { "EVALSHA" });
        let script = if eval {
            self.script.text()
        } else {
            self.script.sha1()
        };
        c.arg(script).arg(1).arg(&*self.routing_key);
        for a in &self.argv {
            match a {
                ArgValue::Text(s) => c.arg(&**s),
                ArgValue::Str(s) => c.arg(s),
                ArgValue::Int(i) => c.arg(*i),
                ArgValue::Float(f) => c.arg(format_float(*f)),
            };
        }
        c
    }
}

/// A float as Lua's `tonumber` reads it back exactly (shortest round-trip form).
fn format_float(f: f64) -> String {
    let s = format!("{f:?}");
    s.strip_suffix(".0").map(str::to_string).unwrap_or(s)
}

/// The largest integer a double holds exactly (2^53): the script clamps its figures to it.
const MAX_EXACT: f64 = 9_007_199_254_740_992.0;

/// The apply script's reply for `work` (one string of little-endian doubles, each an integer: see
/// `lua/apply.lua`) as outcomes per group and request.
pub(crate) fn parse_apply(
    reply: Value,
    work: &Work,
) -> Result<Vec<Vec<RequestOutcome>>, StoreError> {
    let bad = |what: String| StoreError::Reply(what);
    let bytes: &[u8] = match &reply {
        Value::BulkString(b) => b,
        // No buckets, nothing decided: the script answers an empty array.
        Value::Array(items) if items.is_empty() => &[],
        other => return Err(bad(format!("{other:?}"))),
    };
    let expected: usize = work
        .groups
        .iter()
        .map(|g| g.requests.iter().map(|r| 1 + 6 * r.len()).sum::<usize>())
        .sum();
    if bytes.len() != 8 * expected {
        return Err(bad(format!(
            "{} bytes where {} were expected",
            bytes.len(),
            8 * expected
        )));
    }
    let mut ints = bytes.chunks_exact(8).map(|c| {
        let mut le = [0u8; 8];
        le.copy_from_slice(c);
        let f = f64::from_le_bytes(le);
        if (0.0..=MAX_EXACT).contains(&f) && f.fract() == 0.0 {
            Ok(f as u64)
        } else {
            Err(bad(format!("{f} is not a count")))
        }
    });
    let mut next = move || {
        ints.next()
            .unwrap_or_else(|| Err(bad("short reply".into())))
    };
    let mut groups = Vec::with_capacity(work.groups.len());
    for g in &work.groups {
        let mut requests = Vec::with_capacity(g.requests.len());
        for r in &g.requests {
            let status = match next()? {
                0 => Status::Rejected,
                1 => Status::Charged,
                10 | 12 => Status::Replayed { charged: false },
                11 => Status::Replayed { charged: true },
                other => return Err(bad(format!("status code {other}"))),
            };
            let mut decisions = Vec::with_capacity(r.len());
            for _ in r {
                let allowed = next()? == 1;
                let remaining = next()?;
                let retry_after_ms = next()?;
                let reset_ms = next()?;
                let reason = match next()? {
                    0 => Reason::Ok,
                    1 => Reason::Insufficient,
                    2 => Reason::CostExceedsCapacity,
                    other => return Err(bad(format!("reason code {other}"))),
                };
                let leased = next()?;
                decisions.push(BucketOutcome {
                    allowed,
                    remaining,
                    retry_after_ms,
                    reset_ms,
                    reason,
                    leased,
                });
            }
            requests.push(RequestOutcome { status, decisions });
        }
        groups.push(requests);
    }
    Ok(groups)
}

#[cfg(test)]
mod tests {
    use super::super::{Charge, Group};
    use super::*;

    #[test]
    fn replies_parse_by_the_shape_of_the_work_and_odd_ones_are_errors() {
        let charge = |k: &str| Charge {
            key: Arc::from(k),
            bucket: BucketLimits::new(10, 1.0),
            cost: 1,
            shadow: false,
            lease: None,
        };
        let work = Work {
            groups: vec![Group {
                record: None,
                requests: vec![vec![charge("a"), charge("b")], vec![charge("a")]],
            }],
            returns: vec![],
        };
        let ints = |v: &[i64]| {
            Value::BulkString(v.iter().flat_map(|i| (*i as f64).to_le_bytes()).collect())
        };
        let reply = ints(&[
            1, 1, 9, 0, 1000, 0, 0, 1, 9, 0, 1000, 0, 0, 11, 1, 8, 0, 2000, 0, 3,
        ]);
        let g = parse_apply(reply, &work).unwrap();
        assert_eq!(g[0][0].status, Status::Charged);
        assert_eq!(g[0][1].status, Status::Replayed { charged: true });
        assert_eq!(g[0][1].decisions[0].leased, 3);
        assert!(parse_apply(ints(&[1]), &work).is_err());
        assert!(parse_apply(Value::Nil, &work).is_err());
        // The former shape (an array of integers), a torn double, a fraction, a negative count.
        let array = Value::Array(vec![Value::Int(1); 20]);
        assert!(parse_apply(array, &work).is_err(), "an array of integers");
        let mut torn: Vec<u8> = (0..20).flat_map(|_| 1f64.to_le_bytes()).collect();
        torn.pop();
        assert!(parse_apply(Value::BulkString(torn), &work).is_err());
        for odd in [0.5, -1.0, f64::NAN, f64::INFINITY, 1e300] {
            let mut v: Vec<u8> = [
                1.0, 1.0, 9.0, 0.0, 1000.0, 0.0, 0.0, 1.0, 9.0, 0.0, 1000.0, 0.0, 0.0, 1.0, 1.0,
                8.0, 0.0, 2000.0, 0.0, 0.0,
            ]
            .iter()
            .flat_map(|f: &f64| f.to_le_bytes())
            .collect();
            v[16..24].copy_from_slice(&odd.to_le_bytes());
            assert!(
                parse_apply(Value::BulkString(v), &work).is_err(),
                "{odd} as remaining"
            );
        }
        let mut bad = vec![
            1, 1, 9, 0, 1000, 7, 0, 1, 9, 0, 1000, 0, 0, 1, 1, 8, 0, 2000, 0, 0,
        ];
        assert!(parse_apply(ints(&bad), &work).is_err(), "reason 7");
        bad[5] = 0;
        bad[0] = 5;
        assert!(parse_apply(ints(&bad), &work).is_err(), "status 5");
    }

    #[test]
    fn arguments_name_each_bucket_and_limit_once() {
        let charge = |k: &str, capacity: u64| Charge {
            key: Arc::from(k),
            bucket: BucketLimits::new(capacity, 0.5),
            cost: 2,
            shadow: true,
            lease: None,
        };
        let work = Work {
            groups: vec![Group {
                record: Some("rec".into()),
                requests: vec![
                    vec![charge("a", 10), charge("b", 10)],
                    vec![charge("a", 20)],
                ],
            }],
            returns: vec![],
        };
        let args = ScriptArgs::build(Script::Apply, &StoreOptions::default(), false, &work, None);
        let text: Vec<String> = args
            .argv
            .iter()
            .map(|a| match a {
                ArgValue::Text(s) => s.to_string(),
                ArgValue::Str(s) => s.clone(),
                ArgValue::Int(i) => i.to_string(),
                ArgValue::Float(f) => format_float(*f),
            })
            .collect();
        // The last argument: no epoch marker (--store-reset full).
        assert_eq!(text.last().map(String::as_str), Some(""));
        assert_eq!(
            text[..text.len() - 1].join(" "),
            "apply 10000 0.1 0 1000 2 a b 2 10 0.5 0 20 0.5 0 1 rec 2 2 1 1 2 1 0 0 0 2 1 2 1 0 0 0 1 1 2 2 1 0 0 0 0"
        );
        let empty = StoreOptions {
            store_reset: StoreReset::Empty,
            ..StoreOptions::default()
        };
        let on_cluster = ScriptArgs::build(Script::Apply, &empty, true, &work, None);
        assert!(
            matches!(on_cluster.argv.last(), Some(ArgValue::Str(m)) if m == "rl:epoch"),
            "a key without a hash tag: the one marker"
        );
        assert_eq!(&*args.routing_key, "a");
    }

    #[test]
    fn each_script_is_the_bucket_followed_by_its_mode_and_its_sha1_is_computed() {
        for script in Script::ALL {
            assert!(script
                .text()
                .starts_with("#!lua flags=allow-cross-slot-keys\n"));
            assert!(script.text().contains("redis.call('TIME')"));
            let sha = sha1_smol::Sha1::from(script.text()).digest().to_string();
            assert_eq!(script.sha1(), sha);
        }
        assert_ne!(Script::Apply.sha1(), Script::Refund.sha1());
        assert!(Script::Refund.text().contains("mode ~= 'refund'"));
    }
}
