//! The bucket scripts and their calling convention, on the Rust side: the two scripts
//! ([`Script`]), the arguments of one call built from the work of one node ([`ScriptArgs`]), and
//! an apply call's reply read back as outcomes ([`parse_apply`]). The convention itself (ARGV
//! layout, reply layout) is documented in the headers of `lua/bucket.lua` and `lua/apply.lua`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, LazyLock};

use ratelimit_wire::Reason;
use redis::{Cmd, Value};

use super::super::{
    BucketLimits, BucketOutcome, GrantCap, RequestOutcome, Status, StoreError, Work,
    SHARE_MARGIN_MS,
};
use super::options::StoreOptions;

/// A bucket script: `lua/bucket.lua` (the bucket function, the arguments, the reads and writes)
/// followed by its mode's file, one source of truth in `lua/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Script {
    /// Decides groups of requests (`lua/apply.lua`).
    Apply,
    /// Gives back what recorded requests charged (`lua/refund.lua`).
    Refund,
    /// An apply call whose requests are each one decision on a bucket of its own, without a
    /// lease ask, a share or a record (`lua/single.lua`, standalone): the same bucket in about
    /// half of Redis's instructions.
    Single,
}

impl Script {
    pub const ALL: [Script; 3] = [Script::Apply, Script::Refund, Script::Single];

    /// The script's text, as `EVAL` and `SCRIPT LOAD` take it.
    pub fn text(self) -> &'static str {
        match self {
            Script::Apply => concat!(
                include_str!("../../../../lua/bucket.lua"),
                include_str!("../../../../lua/apply.lua")
            ),
            Script::Refund => concat!(
                include_str!("../../../../lua/bucket.lua"),
                include_str!("../../../../lua/refund.lua")
            ),
            Script::Single => include_str!("../../../../lua/single.lua"),
        }
    }

    /// SHA1 of [`Script::text`], as `EVALSHA` wants it (computed once).
    pub fn sha1(self) -> &'static str {
        static SHA1: LazyLock<[String; 3]> = LazyLock::new(|| {
            Script::ALL.map(|s| sha1_smol::Sha1::from(s.text()).digest().to_string())
        });
        &SHA1[self as usize]
    }

    /// The mode the script checks in `ARGV[1]`.
    fn mode(self) -> &'static str {
        match self {
            Script::Apply => "apply",
            Script::Refund => "refund",
            Script::Single => "",
        }
    }
}

/// The arguments of one script call (the calling convention is in the header of
/// `lua/bucket.lua`): the numbers packed little-endian into one argument, then the keys.
pub(crate) struct ScriptArgs {
    pub(crate) script: Script,
    pub(crate) routing_key: Arc<str>,
    /// `ARGV[2]`: every number of the call, in the layout `lua/bucket.lua` reads.
    pub(crate) numbers: Vec<u8>,
    /// The buckets' keys, then a record key (or "") per group; for `lua/single.lua` the buckets
    /// after the first (the routing key).
    pub(crate) keys: Vec<Arc<str>>,
    /// The last argument: the epoch marker's key, or "" (`--store-reset full`).
    pub(crate) marker: String,
}

/// The numbers of a call as `struct.unpack` reads them: `I4`, `I8` (unsigned), `d` and `B`.
#[derive(Default)]
struct Numbers(Vec<u8>);

impl Numbers {
    /// A count or an index (`I4`); one beyond `u32` saturates, and the script then finds the
    /// numbers the wrong length.
    fn count(&mut self, n: usize) {
        self.0
            .extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
    }
    fn int(&mut self, i: u64) {
        self.0.extend_from_slice(&i.to_le_bytes());
    }
    fn double(&mut self, f: f64) {
        self.0.extend_from_slice(&f.to_le_bytes());
    }
    fn flag(&mut self, b: bool) {
        self.0.push(u8::from(b));
    }
}

impl ScriptArgs {
    /// The arguments of `script` for `work` on one node; `marker`: the node's epoch marker
    /// (`--store-reset empty`), or "".
    pub(crate) fn build<'a>(
        script: Script,
        options: &StoreOptions,
        cluster: bool,
        work: &'a Work,
        refunds: Option<&[Vec<usize>]>,
        marker: &str,
    ) -> ScriptArgs {
        if let Some(args) = Self::single(script, cluster, work, marker) {
            return args;
        }
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
        let mut body = Numbers::default();
        for g in &work.groups {
            body.count(g.requests.len());
            for request in &g.requests {
                body.count(request.len());
                for c in request {
                    body.count(key_of(&c.key));
                    body.count(limit_of(&c.bucket));
                    body.int(c.cost);
                    body.flag(c.shadow);
                    body.flag(c.grant_cap == GrantCap::Share);
                    let (id, want, ttl) = c.lease.map_or((0, 0, 0), |l| (l.id, l.tokens, l.ttl_ms));
                    body.int(id);
                    body.int(want);
                    body.int(ttl);
                    body.int(c.receipt);
                }
            }
        }
        for r in &work.returns {
            body.count(key_of(&r.key));
            body.count(limit_of(&r.bucket));
            body.int(r.lease_id);
            body.int(r.tokens);
        }
        for indices in refunds.unwrap_or_default() {
            body.count(indices.len());
            for i in indices {
                body.count(*i + 1);
            }
        }
        let mut numbers = Numbers::default();
        numbers.int(options.record_ttl_ms);
        numbers.double(options.lease_max_share);
        numbers.flag(cluster);
        numbers.int(SHARE_MARGIN_MS);
        numbers.int(options.receipt_ttl_ms.max(1));
        numbers.count(keys.len());
        numbers.count(limits.len());
        numbers.count(work.groups.len());
        numbers.count(work.returns.len());
        for bucket in limits {
            numbers.int(bucket.capacity);
            numbers.double(bucket.refill_per_sec);
            match &bucket.share {
                None => numbers.count(0),
                Some(history) => {
                    numbers.count(history.changes().count());
                    for (from_ms, share) in history.changes() {
                        numbers.int(from_ms);
                        numbers.count(share.ppm() as usize);
                    }
                }
            }
        }
        numbers.0.extend_from_slice(&body.0);
        let routing_key = keys.first().cloned().unwrap_or_else(|| Arc::from(""));
        keys.extend(
            work.groups
                .iter()
                .map(|g| Arc::from(g.record.as_deref().unwrap_or_default())),
        );
        ScriptArgs {
            script,
            routing_key,
            numbers: numbers.0,
            keys,
            marker: marker.to_string(),
        }
    }

    /// An apply call whose requests are each one decision on a bucket of its own, without a
    /// lease ask, a share or a record, as `lua/single.lua` takes it: the first bucket as the one
    /// key; per request capacity, refill, cost and shadow; the other buckets after the marker. A
    /// Cluster's call of several decisions is left to the long script, which reads each key on its
    /// own (one `MGET` cannot span slots).
    fn single(script: Script, cluster: bool, work: &Work, marker: &str) -> Option<Self> {
        if script != Script::Apply || !work.returns.is_empty() {
            return None;
        }
        let mut charges = Vec::new();
        for g in &work.groups {
            if g.record.is_some() {
                return None;
            }
            for request in &g.requests {
                let [c] = &request[..] else {
                    return None;
                };
                if c.bucket.share.is_some()
                    || c.lease.is_some_and(|l| l.tokens > 0)
                    || c.receipt > 0
                {
                    return None;
                }
                charges.push(c);
            }
        }
        let (first, rest) = charges.split_first()?;
        if !rest.is_empty() && cluster {
            return None;
        }
        // A bucket twice in one call: the second sees the first's charge only in the long script.
        // (A set, not pairs: a call may carry a thousand decisions.)
        let mut seen = HashSet::with_capacity(charges.len());
        if !charges.iter().all(|c| seen.insert(&*c.key)) {
            return None;
        }
        let mut numbers = Numbers::default();
        for c in &charges {
            numbers.int(c.bucket.capacity);
            numbers.double(c.bucket.refill_per_sec);
            numbers.int(c.cost);
            numbers.flag(c.shadow);
        }
        Some(ScriptArgs {
            script: Script::Single,
            routing_key: first.key.clone(),
            numbers: numbers.0,
            keys: rest.iter().map(|c| c.key.clone()).collect(),
            marker: marker.to_string(),
        })
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
        if self.script == Script::Single {
            c.arg(&self.numbers[..]).arg(&self.marker);
            for k in &self.keys {
                c.arg(&**k);
            }
            return c;
        }
        c.arg(self.script.mode()).arg(&self.numbers[..]);
        for k in &self.keys {
            c.arg(&**k);
        }
        c.arg(&self.marker);
        c
    }
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
    use super::super::super::{Charge, Group};
    use super::*;

    #[test]
    fn replies_parse_by_the_shape_of_the_work_and_odd_ones_are_errors() {
        let charge = |k: &str| Charge {
            receipt: 0,
            key: Arc::from(k),
            bucket: BucketLimits::new(10, 1.0),
            cost: 1,
            shadow: false,
            lease: None,
            grant_cap: GrantCap::Share,
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
    fn only_a_lone_decision_without_lease_share_or_record_takes_the_single_script() {
        let one = |record: Option<&str>, lease: u64, decisions: usize| Work {
            groups: vec![Group {
                record: record.map(String::from),
                requests: vec![(0..decisions)
                    .map(|_| Charge {
                        receipt: 0,
                        key: Arc::from("rl:{a}"),
                        bucket: BucketLimits::new(10, 0.5),
                        cost: 3,
                        shadow: true,
                        lease: Some(ratelimit_wire::LeaseAsk {
                            id: 1,
                            tokens: lease,
                            ttl_ms: 1000,
                        }),
                        grant_cap: GrantCap::Share,
                    })
                    .collect()],
            }],
            returns: vec![],
        };
        let build = |w: &Work| {
            ScriptArgs::build(Script::Apply, &StoreOptions::default(), false, w, None, "")
        };
        let single = build(&one(None, 0, 1));
        assert_eq!(single.script, Script::Single);
        let mut numbers = 10u64.to_le_bytes().to_vec();
        numbers.extend(0.5f64.to_le_bytes());
        numbers.extend(3u64.to_le_bytes());
        numbers.push(1);
        assert_eq!(
            single.numbers, numbers,
            "capacity I8, refill d, cost I8, shadow B"
        );
        assert_eq!((&*single.routing_key, single.keys.len()), ("rl:{a}", 0));
        for w in [one(Some("rec"), 0, 1), one(None, 5, 1), one(None, 0, 2)] {
            assert_eq!(build(&w).script, Script::Apply);
        }
    }

    #[test]
    fn a_batch_of_lone_decisions_on_buckets_of_their_own_takes_the_single_script() {
        let charge = |k: &str, cost: u64| Charge {
            receipt: 0,
            key: Arc::from(k),
            bucket: BucketLimits::new(10, 0.5),
            cost,
            shadow: false,
            lease: None,
            grant_cap: GrantCap::Share,
        };
        let work = |requests: Vec<Vec<Charge>>| Work {
            groups: vec![
                Group {
                    record: None,
                    requests: requests[..1].to_vec(),
                },
                Group {
                    record: None,
                    requests: requests[1..].to_vec(),
                },
            ],
            returns: vec![],
        };
        let build = |w: &Work, cluster| {
            ScriptArgs::build(
                Script::Apply,
                &StoreOptions::default(),
                cluster,
                w,
                None,
                "",
            )
        };
        let three = work(vec![
            vec![charge("a", 1)],
            vec![charge("b", 2)],
            vec![charge("c", 3)],
        ]);
        let args = build(&three, false);
        assert_eq!(args.script, Script::Single);
        assert_eq!(&*args.routing_key, "a");
        let keys: Vec<&str> = args.keys.iter().map(|k| &**k).collect();
        assert_eq!(
            keys,
            ["b", "c"],
            "the other buckets, in the requests' order"
        );
        assert_eq!(args.numbers.len(), 3 * 25);
        assert_eq!(
            &args.numbers[25 + 16..25 + 24],
            &2u64.to_le_bytes(),
            "b's cost"
        );
        let cmd = args.cmd(false);
        let sent: Vec<Vec<u8>> = cmd
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => b.to_vec(),
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(sent.len(), 8, "EVALSHA sha 1 a numbers marker b c");
        assert_eq!(
            (&sent[3][..], &sent[6][..], &sent[7][..]),
            (&b"a"[..], &b"b"[..], &b"c"[..])
        );
        // The long script: on a Cluster, a bucket twice, a request of two decisions.
        assert_eq!(build(&three, true).script, Script::Apply);
        let twice = work(vec![vec![charge("a", 1)], vec![charge("a", 2)]]);
        assert_eq!(build(&twice, false).script, Script::Apply);
        let pair = work(vec![
            vec![charge("a", 1)],
            vec![charge("b", 1), charge("c", 1)],
        ]);
        assert_eq!(build(&pair, false).script, Script::Apply);
        // One decision alone takes it on a Cluster too.
        let lone = work(vec![vec![charge("a", 1)]]);
        assert_eq!(build(&lone, true).script, Script::Single);
    }

    #[test]
    fn arguments_name_each_bucket_and_limit_once() {
        let charge = |k: &str, capacity: u64| Charge {
            receipt: 0,
            key: Arc::from(k),
            bucket: BucketLimits::new(capacity, 0.5),
            cost: 2,
            shadow: true,
            lease: None,
            grant_cap: GrantCap::Share,
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
        let args = ScriptArgs::build(
            Script::Apply,
            &StoreOptions::default(),
            false,
            &work,
            None,
            "",
        );
        // The numbers read back field by field, as `struct.unpack` would with these formats.
        let layout = [
            ("header", "I8 d B I8 I8 I4 I4 I4 I4"),
            ("limits", "I8 d I4 I8 d I4"),
            ("group", "I4"),
            (
                "request 1",
                "I4 I4 I4 I8 B B I8 I8 I8 I8 I4 I4 I8 B B I8 I8 I8 I8",
            ),
            ("request 2", "I4 I4 I4 I8 B B I8 I8 I8 I8"),
        ];
        let mut at = 0;
        let read: Vec<String> = layout
            .iter()
            .map(|(_, fields)| {
                let values: Vec<String> = fields
                    .split(' ')
                    .map(|f| {
                        let n = if f == "B" {
                            1
                        } else if f == "I4" {
                            4
                        } else {
                            8
                        };
                        let mut b = [0u8; 8];
                        b[..n].copy_from_slice(&args.numbers[at..at + n]);
                        at += n;
                        match f {
                            "d" => f64::from_le_bytes(b).to_string(),
                            _ => u64::from_le_bytes(b).to_string(),
                        }
                    })
                    .collect();
                values.join(" ")
            })
            .collect();
        assert_eq!(at, args.numbers.len(), "every byte read");
        assert_eq!(
            read,
            [
                "10000 0.1 0 1000 3600000 2 2 1 0",
                "10 0.5 0 20 0.5 0",
                "2",
                "2 1 1 2 1 1 0 0 0 0 2 1 2 1 1 0 0 0 0",
                "1 1 2 2 1 1 0 0 0 0"
            ]
        );
        let keys: Vec<&str> = args.keys.iter().map(|k| &**k).collect();
        assert_eq!(keys, ["a", "b", "rec"], "the buckets, then the record");
        // The last argument: no epoch marker (--store-reset full), or the node's.
        assert_eq!(args.marker, "");
        let options = StoreOptions::default();
        let on_cluster =
            ScriptArgs::build(Script::Apply, &options, true, &work, None, "rl:epoch{n0}");
        assert_eq!(on_cluster.marker, "rl:epoch{n0}");
        let last = on_cluster.cmd(false).args_iter().last().map(|a| match a {
            redis::Arg::Simple(b) => b.to_vec(),
            _ => Vec::new(),
        });
        assert_eq!(
            last.as_deref(),
            Some(&b"rl:epoch{n0}"[..]),
            "the last argument"
        );
        assert_eq!(on_cluster.numbers[16], 1, "on a Cluster");
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
