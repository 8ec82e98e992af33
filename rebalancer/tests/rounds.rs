//! The rebalancer's rounds against real Redises, one per region: it moves unused share to the
//! rejecting region, shrinking the donor a fence before growing the recipient; it freezes a region
//! it cannot reach and rebalances around it; one rebalancer at a time leads a rule.

use std::collections::BTreeMap;
use std::sync::Arc;

use ratelimit_e2e::Redis;
use ratelimit_rebalancer::region::Region;
use ratelimit_rebalancer::run::{RuleRun, Settings};
use ratelimit_regions::{Params, Share};
use ratelimit_sidecar::policy::{Bounds, Policy, RegionScope, Regional};
use ratelimit_sidecar::regional::record::{self, ShareWrite};

const SHARE: &str = "rl:share:{ratelimit|global}";
const DEMAND: &str = "rl:demand:{ratelimit|global}";
/// Sidecars here hold shares for 200 ms; the fence is 250 ms.
const LEASE_MS: u64 = 200;

fn rule(shares: &str) -> Arc<Regional> {
    let policy = format!(
        "rules:\n  global:\n    capacity: 1000\n    refill_per_sec: 1000\n    regions: {shares}\n"
    );
    let p = Policy::from_sources(
        &[("limits.yaml".into(), policy)],
        &Bounds {
            region: RegionScope::Every,
            ..Bounds::default()
        },
    )
    .unwrap();
    p.regional_rules().remove(0)
}

fn settings(holder: &str) -> Settings {
    Settings {
        params: Params {
            lease_ms: LEASE_MS,
            fence_margin_ms: 50,
            round_interval_ms: 300,
            ..Params::default()
        },
        key_prefix: "rl:".into(),
        wait_replicas: 0,
        leader_ttl_ms: 10_000,
        holder: holder.into(),
    }
}

fn run(rule: Arc<Regional>, regions: &[(&str, &str)], holder: &str) -> RuleRun {
    let regions: BTreeMap<String, Arc<Region>> = regions
        .iter()
        .map(|(name, url)| (name.to_string(), Arc::new(Region::new(name, url, 1000))))
        .collect();
    let lock = regions.values().next().unwrap().clone();
    RuleRun::new(rule, settings(holder), regions, lock)
}

/// Writes a region's record as a previous round would have (version 1, the short lease).
fn seed(redis: &Redis, share: f64) {
    let s = Share::from_fraction(share).unwrap();
    let w = ShareWrite {
        version: 1,
        share: s,
        lease_ms: LEASE_MS,
        keep_ms: 60_000,
        initial: s,
    };
    let _: (u64, u64) = w.cmd(SHARE).query(&mut redis.connection()).unwrap();
}

fn read(redis: &Redis) -> record::StoredShare {
    let fields: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(SHARE)
        .query(&mut redis.connection())
        .unwrap();
    record::parse(&fields).unwrap().expect("a record")
}

fn demand(redis: &Redis, admitted: u64, rejected: u64) {
    let _: () = redis::cmd("HSET")
        .arg(DEMAND)
        .arg("admitted")
        .arg(admitted)
        .arg("rejected")
        .arg(rejected)
        .query(&mut redis.connection())
        .unwrap();
}

#[tokio::test]
async fn a_round_moves_unused_share_to_the_rejecting_region_shrinking_first() {
    let (eu, us) = (Redis::start(), Redis::start());
    seed(&eu, 0.5);
    seed(&us, 0.5);
    let mut run = run(
        rule("{eu: 0.5, us: 0.5}"),
        &[("eu", &eu.url()), ("us", &us.url())],
        "a",
    );
    assert!(run.lead().await);
    run.observe_demand().await;
    // Over a window of at least 200 ms (1000 tokens/s in all): eu rejects half of what it is
    // asked, us uses at most a tenth of the budget and rejects nothing.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    demand(&eu, 600, 600);
    demand(&us, 20, 0);
    let report = run.round().await.expect("leading");
    let (eu_rec, us_rec) = (read(&eu), read(&us));
    println!(
        "eu {} (v{}), us {} (v{}); grown {:?}",
        eu_rec.share, eu_rec.version, us_rec.share, us_rec.version, report.grown
    );
    assert_eq!(report.grown.len(), 1);
    assert_eq!(report.grown[0].region, "eu");
    assert!(report.failed.is_empty());
    assert!(us_rec.share < Share::from_fraction(0.5).unwrap());
    assert!(eu_rec.share > Share::from_fraction(0.5).unwrap());
    assert_eq!((eu_rec.version, us_rec.version), (2, 2));
    assert!(eu_rec.share.ppm() + us_rec.share.ppm() <= Share::PPM);
    // The grow was written a fence (lease + margin) after the shrink, both stamped by a Redis
    // clock of this machine.
    let (shrunk_at, _) = us_rec.history.changes().last().unwrap();
    let (grown_at, _) = eu_rec.history.changes().last().unwrap();
    assert!(
        grown_at >= shrunk_at + LEASE_MS + 50,
        "grow at {grown_at}, shrink at {shrunk_at}"
    );
    // The histories keep the share in force before: what buckets charged then still see.
    assert_eq!(
        us_rec
            .history
            .changes()
            .map(|(_, s)| s.ppm())
            .collect::<Vec<_>>()[0],
        500_000
    );
    run.resign().await;
}

#[tokio::test]
async fn a_record_restored_from_an_older_snapshot_is_written_back_to_the_share_last_fenced() {
    let (eu, mut us) = (Redis::start(), Redis::start());
    seed(&eu, 0.5);
    seed(&us, 0.5);
    // Redis's default persistence: a snapshot taken before the move.
    let before = us.snapshot();
    let mut run = run(
        rule("{eu: 0.5, us: 0.5}"),
        &[("eu", &eu.url()), ("us", &us.url())],
        "a",
    );
    run.observe_demand().await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    demand(&eu, 600, 600);
    demand(&us, 20, 0);
    run.round().await.expect("leading");
    let (eu_moved, us_moved) = (read(&eu), read(&us));
    assert!(us_moved.share < Share::from_fraction(0.5).unwrap());
    assert_eq!(us_moved.version, 2);
    // us's Redis restarts from the snapshot: its record is back at v1, 0.5, stamped by the
    // process that wrote it, not by the one answering now.
    us.restart_from(&before);
    let restored = read(&us);
    assert_eq!((restored.version, restored.share.ppm()), (1, 500_000));
    assert!(!restored.written_by(&us.run_id()));
    let region = Region::new("us", &us.url(), 1000);
    let (_, trusted) = region.read_record(SHARE).await.unwrap().unwrap();
    assert!(!trusted, "the rebalancer's read tells the restored record");
    // The next round writes us's share back: the one fenced before, above every version seen.
    demand(&us, 20, 0);
    demand(&eu, 600, 600);
    run.round().await.expect("leading");
    let repaired = read(&us);
    println!(
        "us moved to {} (v2), restored {} (v1), repaired {} (v{}); eu {}",
        us_moved.share, restored.share, repaired.share, repaired.version, eu_moved.share
    );
    assert_eq!(repaired.share, us_moved.share);
    assert_eq!(repaired.version, 3);
    assert!(repaired.written_by(&us.run_id()));
    assert_eq!(read(&eu).share, eu_moved.share, "nothing grew meanwhile");
    assert!(repaired.share.ppm() + read(&eu).share.ppm() <= Share::PPM);
    run.resign().await;
}

#[tokio::test]
async fn a_region_it_cannot_reach_is_frozen_and_the_others_rebalance_around_it() {
    let (eu, mut us) = (Redis::start(), Redis::start());
    // Shares leave 0.2 of the budget unassigned.
    seed(&eu, 0.4);
    seed(&us, 0.4);
    let mut run = run(
        rule("{eu: 0.4, us: 0.4}"),
        &[("eu", &eu.url()), ("us", &us.url())],
        "a",
    );
    run.observe_demand().await;
    run.round().await.expect("leading");
    // us is cut off from the rebalancer; eu rejects.
    us.stop();
    demand(&eu, 400, 400);
    let report = run.round().await.expect("leading");
    let eu_rec = read(&eu);
    println!(
        "eu {} (v{}); grown {:?}",
        eu_rec.share, eu_rec.version, report.grown
    );
    // eu grows into the unassigned 0.2 only: us stays frozen at its 0.4.
    assert_eq!(eu_rec.share.ppm(), 600_000);
    assert_eq!(eu_rec.version, 2);
    // A region never reached counts as the whole budget: a fresh rebalancer grows nothing.
    run.resign().await;
    let mut fresh = run_fresh(&eu);
    demand(&eu, 800, 800);
    fresh.observe_demand().await;
    demand(&eu, 1200, 1200);
    let report = fresh.round().await.expect("leading");
    assert!(report.grown.is_empty(), "{report:?}");
    assert_eq!(read(&eu).version, 2);
}

fn run_fresh(eu: &Redis) -> RuleRun {
    run(
        rule("{eu: 0.4, us: 0.4}"),
        &[("eu", &eu.url()), ("us", "redis://127.0.0.1:1")],
        "b",
    )
}

#[tokio::test]
async fn one_rebalancer_at_a_time_leads_a_rule() {
    let (eu, us) = (Redis::start(), Redis::start());
    let regions = [("eu", eu.url()), ("us", us.url())];
    let regions: Vec<(&str, &str)> = regions.iter().map(|(n, u)| (*n, u.as_str())).collect();
    let mut first = run(rule("{eu: 0.5, us: 0.5}"), &regions, "first");
    let mut second = run(rule("{eu: 0.5, us: 0.5}"), &regions, "second");
    assert!(first.lead().await);
    assert!(!second.lead().await);
    assert!(second.round().await.is_none(), "no round without the lock");
    // Records are created with the policy's initial shares by the leader's first round.
    first.round().await.expect("leading");
    assert_eq!(
        read(&us),
        record::StoredShare {
            version: 1,
            share: Share::from_fraction(0.5).unwrap(),
            lease_ms: LEASE_MS,
            history: ratelimit_regions::ShareHistory::new(0, Share::from_fraction(0.5).unwrap()),
            run_id: Some(us.run_id()),
        }
    );
    first.resign().await;
    assert!(second.lead().await, "the lock is free once resigned");
}

#[tokio::test]
async fn a_record_lost_after_it_was_seen_is_not_recreated_with_the_initial_share() {
    let (eu, us) = (Redis::start(), Redis::start());
    seed(&eu, 0.3);
    seed(&us, 0.7);
    let mut run = run(
        rule("{eu: 0.5, us: 0.5}"),
        &[("eu", &eu.url()), ("us", &us.url())],
        "a",
    );
    run.round().await.expect("leading");
    // eu's Redis loses the record (a restart without persistence).
    let _: () = redis::cmd("DEL")
        .arg(SHARE)
        .query(&mut eu.connection())
        .unwrap();
    run.round().await.expect("leading");
    let fields: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(SHARE)
        .query(&mut eu.connection())
        .unwrap();
    assert!(
        fields.is_empty(),
        "recreated with 0.5 while us holds 0.7: {fields:?}"
    );
}
