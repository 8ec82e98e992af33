//! A store that lost its state, through the real processes: a client spending its bucket across
//! a Redis restarted empty or from an older snapshot ([`spend_across`]), requests holding
//! concurrency slots through Envoy across a `FLUSHALL` ([`slots_across_a_flush`]), and a Redis
//! Cluster's epochs, one per primary ([`cluster_epochs`]). What each promises:
//! docs/bucket.md#a-store-that-lost-its-state and docs/concurrency.md#a-store-that-lost-its-slots.
//! Used by `tests/tests/store_reset.rs`, `tests/tests/concurrency.rs` and `make reliability`
//! (scenarios 11 to 14), which judge the figures returned here.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::scenario::plugin_with_rules;
use crate::{http, wait_until, Envoy, EnvoyConfig, Redis, RedisCluster, Sidecar, Upstream};

/// What [`spend_across_a_loss`] saw.
#[derive(Debug, Clone, Copy)]
pub struct LossRun {
    /// Decisions admitted over the whole run, the loss included.
    pub admitted: u64,
    /// The run's duration, in seconds.
    pub seconds: f64,
    /// `ratelimit_store_resets_total` at the end.
    pub resets: f64,
    /// Decisions without a verdict (503) while Redis came back.
    pub unanswered: u64,
}

/// How Redis loses what the client spent in [`spend_across_a_loss`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// Restarted without its data.
    Empty,
    /// Restarted from a snapshot (`SAVE`) taken before the client spent: the epoch marker comes
    /// back with it (issue 32, case 6).
    Snapshot,
}

/// Issue 20, case 5, through the real sidecar binary: one client spends its bucket (`policy`'s
/// rule `r`, 150 decisions of cost 1 straight to `/v1/decide`), Redis restarts as `loss` says,
/// the client spends again for `after`; the sidecar runs with `--store-reset <reset>`. The client
/// starts after `fill` (the rule's fill time): under `empty` a fresh Redis starts every bucket
/// empty too, and the run is about the loss, not the start. Waits (bounded) for the sidecar to
/// count the loss.
pub fn spend_across_a_loss(policy: &str, reset: &str, fill: Duration, after: Duration) -> LossRun {
    spend_across(Loss::Empty, policy, reset, fill, after)
}

/// [`spend_across_a_loss`] with the loss `loss`.
pub fn spend_across(
    loss: Loss,
    policy: &str,
    reset: &str,
    fill: Duration,
    after: Duration,
) -> LossRun {
    let mut redis = Redis::start();
    let sidecar = Sidecar::with_policy(
        &redis.url(),
        policy,
        &["--store-reset", reset, "--redis-timeout-ms", "1000"],
    );
    let client = reqwest::blocking::Client::new();
    let decide = || -> Option<bool> {
        let body =
            json!({"requests": [{"decisions": [{"rule": "r", "subject": {"id": "client"}}]}]});
        let r = client
            .post(format!("{}/v1/decide", sidecar.base_url()))
            .json(&body)
            .send()
            .ok()?;
        if r.status() != 200 {
            return None;
        }
        let v: Value = r.json().ok()?;
        v["answers"][0]["allowed"].as_bool()
    };
    // The time the refill needs, not a synchronisation: the sidecar is ready (its marker made).
    std::thread::sleep(fill);
    let snapshot = (loss == Loss::Snapshot).then(|| redis.snapshot());
    let started = Instant::now();
    let (mut admitted, mut unanswered) = (0u64, 0u64);
    let mut count = |answer: Option<bool>| match answer {
        Some(true) => admitted += 1,
        Some(false) => {}
        None => unanswered += 1,
    };
    for _ in 0..150 {
        count(decide());
    }
    match &snapshot {
        None => redis.restart(),
        Some(snapshot) => redis.restart_from(snapshot),
    }
    let back = Instant::now();
    while back.elapsed() < after {
        count(decide());
    }
    let seconds = started.elapsed().as_secs_f64();
    // Bounded, and without failing here: the caller reports what was admitted either way.
    let counting = Instant::now();
    while sidecar.metric("ratelimit_store_resets_total") < 1.0
        && counting.elapsed() < Duration::from_secs(10)
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    LossRun {
        admitted,
        seconds,
        resets: sidecar.metric("ratelimit_store_resets_total"),
        unanswered,
    }
}

/// The concurrency of [`slots_across_a_flush`]'s rule.
pub const CONCURRENCY: u64 = 2;
/// Its `slot_ttl_ms`: the filter renews every third of it.
pub const SLOT_TTL_MS: u64 = 1500;

/// What [`slots_across_a_flush`] saw.
#[derive(Debug, Clone, Copy)]
pub struct SlotsRun {
    /// Short requests admitted, and answered 429, while the two long ones ran after the flush.
    pub admitted: u64,
    pub rejected: u64,
    /// The most requests of the subject in flight at the upstream at once, over the whole run.
    pub max_in_flight: u64,
    /// The long requests answered 200 (they ran to their end).
    pub held_to_the_end: usize,
    /// `ratelimit_store_resets_total` at the end.
    pub resets: f64,
}

/// One Envoy (one worker) on a sidecar started with `extra`, `concurrency: 2` on `/hold/`.
pub fn one_gateway(policy: &str, extra: &[&str]) -> (Redis, Upstream, Sidecar, Envoy) {
    let redis = Redis::start();
    let upstream = Upstream::start();
    let sidecar = Sidecar::with_policy(&redis.url(), policy, extra);
    let plugin = plugin_with_rules(json!([{
        "name": "inflight", "match": {"path_prefix": "/hold/"}, "subject": [], "on_error": "deny",
    }]));
    let config = EnvoyConfig::shipped("envoy.yaml", sidecar.port, upstream.port)
        .plugin(&plugin.to_string())
        .concurrency(1);
    let envoy = Envoy::start(&config);
    (redis, upstream, sidecar, envoy)
}

/// Requests to `url` from `clients` threads for `run`: how many were admitted and how many
/// answered 429 (a client pauses 20 ms after a 429).
pub fn hammer(url: &str, clients: usize, run: Duration) -> (u64, u64) {
    let started = Instant::now();
    std::thread::scope(|s| {
        (0..clients)
            .map(|_| {
                s.spawn(|| {
                    let client = http();
                    let (mut admitted, mut rejected) = (0, 0);
                    while started.elapsed() < run {
                        match client.get(url).send().map(|r| r.status().as_u16()) {
                            Ok(200) => admitted += 1,
                            Ok(429) => {
                                rejected += 1;
                                std::thread::sleep(Duration::from_millis(20));
                            }
                            other => panic!("{url}: {other:?}, neither 200 nor 429"),
                        }
                    }
                    (admitted, rejected)
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .fold((0, 0), |(a, r), (a2, r2)| (a + a2, r + r2))
    })
}

/// Issue 32, case 4b, through Envoy: two requests hold every slot of `concurrency: 2`
/// (5 s each), Redis is flushed (`FLUSHALL`), and 4 clients send short requests for 3 s, past
/// two of the running requests' renewals and one `slot_ttl_ms`. The sidecar runs with
/// `--store-reset <reset>` and `--redis-timeout-ms 1000`.
pub fn slots_across_a_flush(reset: &str) -> SlotsRun {
    let policy = format!(
        "rules:\n  inflight: {{capacity: 1000000, refill_per_sec: 100000, concurrency: {CONCURRENCY}, slot_ttl_ms: {SLOT_TTL_MS}}}\n"
    );
    // A Redis call slowed by a loaded machine is not what this measures: 1 s, not 30 ms, before
    // the sidecar gives up on one (the filter's callout timeout is 2 s).
    let (redis, upstream, sidecar, envoy) = one_gateway(
        &policy,
        &["--store-reset", reset, "--redis-timeout-ms", "1000"],
    );
    let client = http();
    let probe = envoy.url("/hold/probe?ms=0");
    // Under `empty` a fresh store is one that may have lost its slots too: takes resume one ttl
    // after its epoch.
    wait_until(
        "takes after the first window",
        Duration::from_secs(10),
        || client.get(&probe).send().unwrap().status() == 200,
    );
    let set = "rl:{ratelimit|rule=inflight}:c";
    wait_until("the probe's slot released", Duration::from_secs(10), || {
        redis.cli(&["ZCARD", set]) == "0"
    });
    let long = envoy.url("/hold/k?ms=5000");
    let holders: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let url = long.clone();
            std::thread::spawn(move || http().get(&url).send().map(|r| r.status().as_u16()))
        })
        .collect();
    wait_until("2 requests in flight", Duration::from_secs(10), || {
        upstream.in_flight("k") == CONCURRENCY
    });
    assert_eq!(redis.cli(&["FLUSHALL"]), "OK");
    let (admitted, rejected) = hammer(&envoy.url("/hold/k?ms=0"), 4, Duration::from_millis(3_000));
    let held_to_the_end = holders
        .into_iter()
        .filter_map(|h| h.join().ok())
        .filter(|r| matches!(r, Ok(200)))
        .count();
    SlotsRun {
        admitted,
        rejected,
        max_in_flight: upstream.max_in_flight("k"),
        held_to_the_end,
        resets: sidecar.metric("ratelimit_store_resets_total"),
    }
}

/// The rule of [`cluster_epochs`]: full again 1 s after it is spent, its first token 0.5 s after.
pub const CLUSTER_POLICY: &str = "rules:\n  r: {capacity: 2, refill_per_sec: 2}\n";
/// New clients asked per primary after one primary is flushed.
pub const PER_PRIMARY: usize = 10;

/// What [`cluster_epochs`] saw.
#[derive(Debug, Clone)]
pub struct ClusterEpochs {
    /// New clients' first requests (300, 10 to a call), and how many were admitted.
    pub new_clients: usize,
    pub new_admitted: usize,
    /// The `rl:epoch*` keys on the primaries after them.
    pub markers: Vec<String>,
    /// A returning client whose bucket is gone (full again), sent behind a new client in one
    /// call: (the new client admitted, the returning one admitted).
    pub returning: (bool, bool),
    /// Primary 0 flushed, then [`PER_PRIMARY`] new clients of each primary in one call: admitted
    /// per primary (primary 0's start empty at its new epoch).
    pub after_flush: Vec<usize>,
    /// `ratelimit_store_resets_total` at the end.
    pub resets: f64,
}

/// Issue 32, case 7, through the sidecar binary on a real 3-primary Cluster under
/// `--store-reset empty`: the Cluster keeps one epoch marker per primary (before: one per
/// client's hash tag, so every new client's first request was a loss and the markers grew
/// without bound).
pub fn cluster_epochs() -> ClusterEpochs {
    let cluster = RedisCluster::start();
    let sidecar = Sidecar::start_with_args(
        CLUSTER_POLICY,
        &[
            "--redis-cluster",
            &cluster.seeds(),
            "--redis-timeout-ms",
            "2000",
            "--store-reset",
            "empty",
        ],
    );
    let client = http();
    let call = |requests: Vec<Value>| -> Vec<bool> {
        let r = client
            .post(format!("{}/v1/decide", sidecar.base_url()))
            .json(&json!({ "requests": requests }))
            .send()
            .expect("the sidecar answers");
        assert_eq!(r.status(), 200);
        let v: Value = r.json().expect("JSON");
        v["answers"]
            .as_array()
            .expect("answers")
            .iter()
            .map(|a| a["allowed"] == true)
            .collect()
    };
    let request = |id: &str| json!({"decisions": [{"rule": "r", "subject": {"id": id}}]});
    let key = |id: &str| format!("rl:{{ratelimit|rule=r|id={id}}}");
    // The primary serving a key: the one that does not answer MOVED.
    let mut nodes: Vec<redis::Connection> = cluster.nodes.iter().map(Redis::connection).collect();
    let mut node_of = |key: &str| {
        nodes
            .iter_mut()
            .position(|c| redis::cmd("EXISTS").arg(key).query::<i64>(c).is_ok())
            .expect("a primary serves it")
    };
    // The markers, made when the sidecar became ready, get older than the fill time of `r`
    // (1 s): a bucket missing since then is full again (not a synchronisation: the wait the
    // bucket's refill needs).
    std::thread::sleep(Duration::from_millis(1200));
    let new_clients = 300;
    let new_admitted = (0..new_clients / 10)
        .map(|batch| {
            let requests = (0..10)
                .map(|i| request(&format!("new-{batch}-{i}")))
                .collect();
            call(requests).into_iter().filter(|a| *a).count()
        })
        .sum();
    let markers = cluster
        .nodes
        .iter()
        .flat_map(|n| {
            n.cli(&["KEYS", "rl:epoch*"])
                .lines()
                .filter(|l| !l.is_empty())
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    // A returning client whose bucket is gone (full again), behind a new client in one call.
    assert_eq!(
        call(vec![
            json!({"decisions": [{"rule": "r", "subject": {"id": "returning"}, "cost": 2}]})
        ]),
        [true],
        "the returning client spends its bucket"
    );
    let gone = key("returning");
    assert_eq!(cluster.nodes[node_of(&gone)].cli(&["DEL", &gone]), "1");
    let returning = match call(vec![request("fresh"), request("returning")])[..] {
        [fresh, returning] => (fresh, returning),
        ref other => panic!("two answers: {other:?}"),
    };
    // One primary loses its state: its new clients start empty at its new epoch (the first
    // script call there makes it), the others' do not.
    let ids: Vec<Vec<String>> = (0..cluster.nodes.len())
        .map(|node| {
            (0..)
                .map(|i| format!("c{node}-{i}"))
                .filter(|id| node_of(&key(id)) == node)
                .take(PER_PRIMARY)
                .collect()
        })
        .collect();
    assert_eq!(cluster.nodes[0].cli(&["FLUSHALL"]), "OK");
    let answers = call(ids.iter().flatten().map(|id| request(id)).collect());
    let after_flush = answers
        .chunks(PER_PRIMARY)
        .map(|node| node.iter().filter(|a| **a).count())
        .collect();
    wait_until("the loss counted", Duration::from_secs(10), || {
        sidecar.metric("ratelimit_store_resets_total") >= 1.0
    });
    ClusterEpochs {
        new_clients,
        new_admitted,
        markers,
        returning,
        after_flush,
        resets: sidecar.metric("ratelimit_store_resets_total"),
    }
}
