//! The bucket exists twice: in Lua (`lua/bucket.lua` and its modes, in Redis) and in Rust
//! (`store::memory`, the reference model). The same random work, given to a real redis-server and
//! to the model, must get the same answers: verdicts, remaining tokens, reasons, lease grants,
//! replays and refunds, and settlements of costs known after the response (debts included).
//!
//! Time differs by microseconds between the two (Redis reads its own clock), so refill is tiny
//! (0.001 token/s: under 0.01 token over a run) and leases and records outlive the run: integer
//! figures must match exactly, waits (`retry_after_ms`, `reset_ms`) within the run's duration.
//!
//! Regional shares: some keys' limits carry a share history (`docs/regions.md`): changes long
//! before the run, some after the fill time's edge and some before it, some in the future, and
//! changes made during the run; shares from 0 to the whole. Every change is stamped far (seconds)
//! from any edge of the look-back, and shares leave no fraction just below a whole token, so the
//! microseconds between the two clocks cannot tell them apart.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use proptest::prelude::*;
use ratelimit_e2e::Redis;
use ratelimit_regions::{Share, ShareHistory};
use ratelimit_sidecar::metrics::Metrics;
use ratelimit_sidecar::store::memory::MemoryStore;
use ratelimit_sidecar::store::redis::{NodeId, Nodes, StoreOptions, FENCE_SCRIPT};
use ratelimit_sidecar::store::{
    BucketLimits, BucketStore, Charge, GrantCap, Group, RedisStore, RequestOutcome, Return,
    SettleBatch, Settlement, Status, StoreReset, Work,
};
use ratelimit_wire::LeaseAsk;

const KEYS: [&str; 4] = ["rl:{a}", "rl:{b}", "rl:{c}", "rl:{d}"];
const REFILL: f64 = 0.001;
const MAX_SHARE: f64 = 0.4;

/// Each key has its own fixed limit, as a policy gives, and some a regional share history.
fn bucket_of(key: usize, shares: &[Option<Arc<ShareHistory>>]) -> BucketLimits {
    BucketLimits {
        capacity: [5, 3, 8, 1][key],
        refill_per_sec: REFILL,
        share: shares[key].clone(),
    }
}

/// Times of the changes before the run, in seconds from its start: the fill times of the keys
/// are 5000, 3000, 8000 and 1000 s, so these sit on both sides of every look-back's edge.
const CHANGE_AT_S: [i64; 6] = [-9_000, -4_500, -2_000, -500, -30, 600];
/// Shares, in parts per million. A share's part of every capacity is a whole number or 0.01 token
/// or more below one (4.95 of 5 at 990000 ppm, never 4.999995): the run's refill (under 0.01
/// token) must not carry one store across a whole token and not the other.
const PPM: [u32; 7] = [0, 1, 250_000, 300_000, 500_000, 990_000, 1_000_000];

/// One generated history: (index into CHANGE_AT_S, index into PPM), sorted by time.
type GenHistory = Vec<(usize, usize)>;

fn history() -> impl Strategy<Value = Option<GenHistory>> {
    prop::option::weighted(
        0.6,
        prop::collection::vec((0..CHANGE_AT_S.len(), 0..PPM.len()), 1..4),
    )
}

fn history_of(generated: &Option<GenHistory>, start_ms: u64) -> Option<Arc<ShareHistory>> {
    let mut changes = generated.clone()?;
    changes.sort();
    let at = |i: usize| (start_ms as i64 + CHANGE_AT_S[i] * 1000) as u64;
    let share = |i: usize| Share::from_ppm(PPM[i]).unwrap();
    let mut h = ShareHistory::new(at(changes[0].0), share(changes[0].1));
    for &(t, p) in &changes[1..] {
        h.record(at(t), share(p));
    }
    Some(Arc::new(h))
}

/// One generated decision: key index, cost, shadow, lease ask (id, tokens, capped by the share).
type Gen = (usize, u64, bool, Option<(u64, u64, bool)>);
/// One generated group: its attempt (or none) and its requests.
type GenGroup = (Option<u8>, Vec<Vec<Gen>>);

#[derive(Debug, Clone)]
enum Step {
    Apply {
        groups: Vec<GenGroup>,
        returns: Vec<(usize, u64, u64)>,
    },
    /// Refund requests of an earlier recorded group (by its index among recorded groups).
    Refund { group: usize, requests: Vec<usize> },
    /// A key's regional share changes (stamped half a second ago: in every bucket's look-back).
    Share { key: usize, ppm: usize },
    /// The store loses its state (Redis flushed; the model forgets everything).
    Lose,
    /// A new server holds the store (a restart from a snapshot, a replica promoted): its epoch
    /// is fenced anew (`lua/fence.lua`), what it holds is kept.
    Restart,
    /// Settlements (key, reserved, cost, receipt of a charge of that cost on that key or none)
    /// of costs known after the response, under a batch id or none: charged past zero (a debt
    /// the next decisions see) or given back against a receipt, once (`lua/settle.lua`).
    Settle {
        id: Option<u8>,
        settlements: Vec<(usize, u64, u64, Option<u64>)>,
    },
}

fn decision() -> impl Strategy<Value = Gen> {
    (
        0..KEYS.len(),
        1..4u64,
        prop::bool::weighted(0.15),
        prop::option::weighted(0.3, (1..4u64, 0..4u64, prop::bool::weighted(0.7))),
    )
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => (
            prop::collection::vec(
                (
                    prop::option::weighted(0.4, 0..3u8),
                    prop::collection::vec(prop::collection::vec(decision(), 1..4), 1..4),
                ),
                1..3,
            ),
            prop::collection::vec((0..KEYS.len(), 1..4u64, 0..4u64), 0..2),
        )
            .prop_map(|(groups, returns)| Step::Apply { groups, returns }),
        // A lone decision: without a lease, a share or a record, lua/single.lua decides it.
        4 => decision().prop_map(|d| Step::Apply {
            groups: vec![(None, vec![vec![d]])],
            returns: vec![],
        }),
        // A batch of lone decisions on buckets of their own: lua/single.lua decides it too.
        4 => (
            prop::sample::subsequence((0..KEYS.len()).collect::<Vec<_>>(), 2..=KEYS.len()),
            prop::collection::vec((1..4u64, prop::bool::weighted(0.15)), KEYS.len()),
            0..3usize,
        )
            .prop_map(|(keys, figures, split)| {
                let requests: Vec<Vec<Gen>> = keys
                    .iter()
                    .zip(&figures)
                    .map(|(&k, &(cost, shadow))| vec![(k, cost, shadow, None)])
                    .collect();
                // In one group or two.
                let groups = match split {
                    0 => vec![(None, requests)],
                    _ => {
                        let (a, b) = requests.split_at(split.min(requests.len() - 1));
                        vec![(None, a.to_vec()), (None, b.to_vec())]
                    }
                };
                Step::Apply {
                    groups,
                    returns: vec![],
                }
            }),
        1 => (0..4usize, prop::collection::vec(0..4usize, 1..3))
            .prop_map(|(group, requests)| Step::Refund { group, requests }),
        2 => (0..KEYS.len(), 0..PPM.len()).prop_map(|(key, ppm)| Step::Share { key, ppm }),
        1 => Just(Step::Lose),
        1 => Just(Step::Restart),
        3 => (
            prop::option::weighted(0.5, 0..2u8),
            prop::collection::vec(
                (0..KEYS.len(), 1..8u64, 0..9u64, prop::option::weighted(0.7, 1..30u64)),
                1..4
            )
        )
            .prop_map(|(id, settlements)| Step::Settle { id, settlements }),
    ]
}

/// The receipt id a charge of `cost` on key `k` asks for: a repeat of the same charge reuses it
/// (a receipt the scripts write again), which the model follows too.
fn receipt_id(k: usize, cost: u64) -> u64 {
    (k as u64 + 1) * 10 + cost
}

fn work_of(
    groups: &[GenGroup],
    returns: &[(usize, u64, u64)],
    case: u64,
    shares: &[Option<Arc<ShareHistory>>],
) -> Work {
    Work {
        groups: groups
            .iter()
            .map(|(attempt, requests)| {
                let first = KEYS[requests[0][0].0];
                Group {
                    record: attempt.map(|a| format!("{first}:a:{case}-{a}")),
                    requests: requests
                        .iter()
                        .map(|r| {
                            r.iter()
                                .map(|&(k, cost, shadow, lease)| Charge {
                                    // Odd costs ask for a receipt (its id: the key and the cost,
                                    // so a settle step can name it or one never given).
                                    receipt: if cost % 2 == 1 {
                                        receipt_id(k, cost)
                                    } else {
                                        0
                                    },
                                    key: Arc::from(KEYS[k]),
                                    bucket: bucket_of(k, shares),
                                    cost,
                                    shadow,
                                    lease: lease.map(|(id, tokens, _)| LeaseAsk {
                                        id,
                                        tokens,
                                        ttl_ms: 60_000,
                                    }),
                                    grant_cap: match lease {
                                        Some((_, _, false)) => GrantCap::Ask,
                                        _ => GrantCap::Share,
                                    },
                                })
                                .collect()
                        })
                        .collect(),
                }
            })
            .collect(),
        returns: returns
            .iter()
            .map(|&(k, id, tokens)| Return {
                key: Arc::from(KEYS[k]),
                bucket: bucket_of(k, shares),
                lease_id: id,
                tokens,
            })
            .collect(),
    }
}

fn same(
    redis: &[Vec<RequestOutcome>],
    model: &[Vec<RequestOutcome>],
    slack_ms: u64,
) -> Result<(), String> {
    if redis.len() != model.len() {
        return Err(format!("{} groups vs {}", redis.len(), model.len()));
    }
    for (g, (a, b)) in redis.iter().zip(model).enumerate() {
        for (r, (x, y)) in a.iter().zip(b).enumerate() {
            if x.status != y.status {
                return Err(format!(
                    "group {g} request {r}: {:?} vs {:?}",
                    x.status, y.status
                ));
            }
            for (d, (p, q)) in x.decisions.iter().zip(&y.decisions).enumerate() {
                let exact = (p.allowed, p.remaining, p.reason, p.leased)
                    == (q.allowed, q.remaining, q.reason, q.leased);
                let close = p.retry_after_ms.abs_diff(q.retry_after_ms) <= slack_ms
                    && p.reset_ms.abs_diff(q.reset_ms) <= slack_ms;
                if !exact || !close {
                    return Err(format!(
                        "group {g} request {r} decision {d}: {p:?} vs {q:?}"
                    ));
                }
            }
        }
    }
    Ok(())
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_micros() as u64
}

#[test]
fn the_lua_bucket_and_the_rust_model_answer_alike() {
    differential(StoreReset::Full);
}

/// The same under `--store-reset empty`: each case starts on a flushed Redis, so every bucket
/// starts empty at the epoch the first call makes, and again after each loss of state.
#[test]
fn the_lua_bucket_and_the_rust_model_answer_alike_under_store_reset_empty() {
    differential(StoreReset::Empty);
}

fn differential(reset: StoreReset) {
    let redis = Redis::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store = rt.block_on(async {
        let s = RedisStore::single(
            &redis.url(),
            1,
            StoreOptions {
                timeout_ms: 5_000,
                record_ttl_ms: 600_000,
                lease_max_share: MAX_SHARE,
                store_reset: reset,
                ..StoreOptions::default()
            },
            Arc::new(Metrics::new()),
        )
        .unwrap();
        s.check_readiness().await;
        s
    });
    let cases = std::env::var("DIFFERENTIAL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48);
    let case = std::sync::atomic::AtomicU64::new(0);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(
            &(
                prop::collection::vec(step(), 1..12),
                prop::collection::vec(history(), KEYS.len()),
            ),
            |(steps, histories)| {
                let case = case.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                let _: () = redis::cmd("FLUSHALL")
                    .query(&mut redis.connection())
                    .unwrap();
                let model = MemoryStore::new(now_us(), MAX_SHARE, 600_000).with_store_reset(reset);
                let started = Instant::now();
                let start_ms = now_us() / 1000;
                let mut shares: Vec<Option<Arc<ShareHistory>>> =
                    histories.iter().map(|h| history_of(h, start_ms)).collect();
                let mut recorded: Vec<Group> = Vec::new();
                let mut issued: Vec<(Arc<str>, u64)> = Vec::new();
                for step in &steps {
                    model.set_now_us(now_us());
                    match step {
                        Step::Lose => {
                            let _: () = redis::cmd("FLUSHALL")
                                .query(&mut redis.connection())
                                .unwrap();
                            model.lose_state();
                        }
                        Step::Restart => {
                            // As the stamp another server left: the fence makes the epoch anew.
                            let mut c = redis.connection();
                            let _: () = redis::cmd("SET")
                                .arg("rl:epoch:run")
                                .arg("another-server")
                                .query(&mut c)
                                .unwrap();
                            let _: redis::Value = redis::cmd("EVAL")
                                .arg(FENCE_SCRIPT)
                                .arg(2)
                                .arg("rl:epoch")
                                .arg("rl:epoch:run")
                                .query(&mut c)
                                .unwrap();
                            model.fence();
                        }
                        Step::Share { key, ppm } => {
                            if let Some(h) = &shares[*key] {
                                let mut h = (**h).clone();
                                h.record(
                                    now_us() / 1000 - 500,
                                    Share::from_ppm(PPM[*ppm]).unwrap(),
                                );
                                shares[*key] = Some(Arc::new(h));
                            }
                        }
                        Step::Apply { groups, returns } => {
                            let work = work_of(groups, returns, case, &shares);
                            let from_redis = rt
                                .block_on(store.apply(NodeId::primary(), work.clone()))
                                .map_err(|e| TestCaseError::fail(e.to_string()))?;
                            let from_model = model.run(&work);
                            let slack = started.elapsed().as_millis() as u64 + 1_000;
                            same(&from_redis, &from_model, slack * 1000)
                                .map_err(|e| TestCaseError::fail(format!("{e}\n{work:#?}")))?;
                            // The receipts the charged requests hold: what a settle step names.
                            for (g, outcomes) in work.groups.iter().zip(&from_model) {
                                for (request, o) in g.requests.iter().zip(outcomes) {
                                    if o.status == Status::Charged {
                                        issued.extend(
                                            request
                                                .iter()
                                                .zip(&o.decisions)
                                                .filter(|(c, d)| c.receipt > 0 && d.allowed)
                                                .map(|(c, _)| (c.key.clone(), c.receipt)),
                                        );
                                    }
                                }
                            }
                            recorded.extend(work.groups.into_iter().filter(|g| g.record.is_some()));
                        }
                        Step::Settle { id, settlements } => {
                            // A share of 0 holds no bucket to settle (the decider skips those).
                            let settlements: Vec<Settlement> = settlements
                                .iter()
                                .map(|&(k, reserved, cost, pick)| {
                                    // A receipt issued before (on its own key), or one never
                                    // given (a made-up id), or none.
                                    let (key, receipt) = match pick {
                                        Some(p) if !issued.is_empty() && p % 3 != 0 => {
                                            let (key, r) = &issued[p as usize % issued.len()];
                                            (key.clone(), Some(*r))
                                        }
                                        Some(p) => (Arc::from(KEYS[k]), Some(receipt_id(k, p))),
                                        None => (Arc::from(KEYS[k]), None),
                                    };
                                    let k = KEYS.iter().position(|x| **x == *key).unwrap();
                                    Settlement {
                                        key,
                                        bucket: bucket_of(k, &shares),
                                        reserved,
                                        cost,
                                        receipt,
                                    }
                                })
                                .filter(|s| {
                                    let (c, r) = s.bucket.in_force();
                                    c > 0 && r > 0.0
                                })
                                .collect();
                            if settlements.is_empty() {
                                continue;
                            }
                            let batch = SettleBatch {
                                id: id.map(|i| format!("{case}-{i}")),
                                settlements,
                            };
                            let a = rt
                                .block_on(store.settle(batch.clone()))
                                .map_err(|e| TestCaseError::fail(e.to_string()))?;
                            let b = rt.block_on(model.settle(batch.clone())).unwrap();
                            prop_assert_eq!(a, b, "settle {:?}", batch);
                        }
                        Step::Refund { group, requests } => {
                            let Some(g) = recorded.get(*group % recorded.len().max(1)).cloned()
                            else {
                                continue;
                            };
                            let requests: Vec<usize> =
                                requests.iter().map(|r| r % g.requests.len()).collect();
                            let a = rt
                                .block_on(store.refund(
                                    NodeId::primary(),
                                    g.clone(),
                                    requests.clone(),
                                ))
                                .map_err(|e| TestCaseError::fail(e.to_string()))?;
                            let b = model.refund_now(&g, &requests);
                            prop_assert_eq!(a, b, "refund of {:?} {:?}", g, requests);
                        }
                    }
                }
                // The stored tokens agree too.
                for key in KEYS {
                    let from_redis: Option<Vec<u8>> = redis::cmd("GET")
                        .arg(key)
                        .query(&mut redis.connection())
                        .unwrap();
                    let redis_tokens =
                        from_redis.map(|v| f64::from_le_bytes(v[..8].try_into().unwrap()));
                    let model_tokens = model.stored_tokens(key);
                    match (redis_tokens, model_tokens) {
                        (Some(a), Some(b)) => {
                            prop_assert!((a - b).abs() < 0.02, "{key}: {a} vs {b}")
                        }
                        (a, b) => {
                            prop_assert_eq!(a.is_some(), b.is_some(), "{}: {:?} vs {:?}", key, a, b)
                        }
                    }
                }
                Ok(())
            },
        )
        .unwrap();
}
