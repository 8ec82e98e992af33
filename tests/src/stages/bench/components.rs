//! The components alone: the bucket script on Redis, the sidecar direct, a bucket's memory.

use super::*;

/// The component stages' figures the summary and the goals use.
pub(crate) struct Components {
    pub(crate) incr: StageResult,
    pub(crate) script_one: StageResult,
    pub(crate) script_batch: StageResult,
    /// `lua/single.lua`, the script the sidecar sends for a lone decision.
    pub(crate) single_one: StageResult,
    pub(crate) decide_one: StageResult,
    pub(crate) decide_batch: StageResult,
}

/// Redis's own ceiling (`INCR`), the bucket script `script` (its text) with one decision per call
/// and with `--batch`, the sidecar's `POST /v1/decide` with one request per call and with a
/// batch.
pub(crate) async fn components(b: &Bench, script: &str) -> Components {
    println!("\n== components");
    print_header();
    let conn = redis::Client::open(b.redis.url())
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect redis");
    let keys = b.args.keys as u64;
    let redis_only = &b.watched()[..1];
    let incr = {
        let conn = conn.clone();
        let op = load::op(move |call| {
            let mut conn = conn.clone();
            async move {
                redis::cmd("INCR")
                    .arg(format!("bench:incr:{}", (call.random() >> 16) % keys))
                    .query_async::<i64>(&mut conn)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
        });
        let name = "redis INCR, pipelined (Redis's ceiling)";
        b.stage(name, b.args.concurrency, redis_only, 1, op).await
    };
    print(&incr, None);
    let apply = script_cost::apply_call;
    let (script_one, script_batch) = script_stages(b, &conn, "bucket script", script, apply).await;
    print(&script_one, Some(&incr));
    print(&script_batch, Some(&incr));
    // The script a call of lone decisions without a lease ask, a share or a record runs.
    let (label, single) = ("lone-decision script (single.lua)", script_cost::SINGLE);
    let (single_one, single_batch) =
        script_stages(b, &conn, label, single, script_cost::single_call).await;
    print(&single_one, Some(&incr));
    print(&single_batch, Some(&incr));
    print_note(&format!(
        "Redis CPU per decision: the lone-decision script {:.2}x the long script's with 1 per call, {:.2}x with {}",
        single_one.cpu_per_decision("redis") / script_one.cpu_per_decision("redis").max(1e-9),
        single_batch.cpu_per_decision("redis") / script_batch.cpu_per_decision("redis").max(1e-9),
        b.args.batch
    ));
    println!("{}", script_cost::before_and_after(b.args.batch, keys));

    let decide_url = format!("{}/v1/decide", b.sidecar.base_url());
    let decide_stage = |n: usize| {
        let (http, url) = (b.http.clone(), decide_url.clone());
        load::op(move |call| {
            let (http, url) = (http.clone(), url.clone());
            let i = call.random() >> 16;
            async move {
                let requests: Vec<serde_json::Value> = (0..n as u64)
                    .map(|j| {
                        json!({"decisions": [{"rule": "many",
                            "subject": {"ip": format!("k{}", (i + j * 7919) % keys)}}]})
                    })
                    .collect();
                let body = json!({"requests": requests}).to_string();
                let resp = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .map_err(|e| e.to_string())?;
                let status = resp.status();
                resp.bytes().await.map_err(|e| e.to_string())?;
                if status == 200 {
                    Ok(())
                } else {
                    Err(format!("status {status}"))
                }
            }
        })
    };
    let (c, batch, watched) = (b.args.concurrency, b.args.batch, b.watched());
    let decide_one = b
        .stage(
            "sidecar POST /v1/decide, 1 request per call",
            c,
            &watched,
            1,
            decide_stage(1),
        )
        .await;
    print(&decide_one, Some(&script_one));
    let name = format!("sidecar POST /v1/decide, {batch} requests per call");
    let decide_batch = b
        .stage(&name, c, &watched, batch, decide_stage(batch))
        .await;
    print(&decide_batch, Some(&script_one));
    Components {
        incr,
        script_one,
        script_batch,
        single_one,
        decide_one,
        decide_batch,
    }
}

/// A bucket script (`script`, its text, loaded into Redis) called directly by `call` (the
/// `EVALSHA` of its `n` decisions for call number `i` on `keys` buckets) with one decision per
/// call and with `--batch`, its stages named `<label>, N decision(s) per call`: a second script
/// measured beside the first is one more call.
pub(crate) async fn script_stages(
    b: &Bench,
    conn: &redis::aio::MultiplexedConnection,
    label: &str,
    script: &str,
    call: fn(&str, usize, u64, u64) -> redis::Cmd,
) -> (StageResult, StageResult) {
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(script)
        .query_async(&mut conn.clone())
        .await
        .expect("SCRIPT LOAD");
    let keys = b.args.keys as u64;
    let script_op = |n: usize| {
        let (conn, sha) = (conn.clone(), sha.clone());
        load::op(move |c| {
            let mut conn = conn.clone();
            let cmd = call(&sha, n, c.random() >> 16, keys);
            async move {
                cmd.query_async::<redis::Value>(&mut conn)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
        })
    };
    let (c, batch, redis_only) = (b.args.concurrency, b.args.batch, &b.watched()[..1]);
    let one = format!("{label}, 1 decision per call");
    let one = b.stage(&one, c, redis_only, 1, script_op(1)).await;
    let many = format!("{label}, {batch} decisions per call");
    let many = b.stage(&many, c, redis_only, batch, script_op(batch)).await;
    (one, many)
}

/// Buckets written to measure memory.
pub(crate) const MEMORY_BUCKETS: usize = 10_000;

/// What one bucket costs Redis.
pub(crate) struct BucketMemory {
    pub(crate) used_per_bucket: f64,
    pub(crate) usage_per_bucket: f64,
    pub(crate) sampled: usize,
}

/// Writes [`MEMORY_BUCKETS`] buckets of the `mem` rule through the sidecar (full again only after
/// 100 s, so none expires meanwhile) and reads what Redis spends on them: the growth of
/// `used_memory` per bucket (Redis's own overhead included) and `MEMORY USAGE` of a sample.
pub(crate) async fn bucket_memory(b: &Bench) -> BucketMemory {
    let url = format!("{}/v1/decide", b.sidecar.base_url());
    let before = probe::used_memory(&b.redis);
    let run = std::process::id();
    for chunk in 0..MEMORY_BUCKETS / 250 {
        let requests: Vec<serde_json::Value> = (0..250)
            .map(|j| {
                json!({"decisions": [{"rule": "mem",
                    "subject": {"ip": format!("m{run}-{}", chunk * 250 + j)}}]})
            })
            .collect();
        let resp = b
            .http
            .post(&url)
            .header("content-type", "application/json")
            .body(json!({ "requests": requests }).to_string())
            .send()
            .await
            .expect("decide");
        assert_eq!(resp.status(), 200, "the memory stage's decisions");
    }
    let after = probe::used_memory(&b.redis);
    let mut c = b.redis.connection();
    let mut sample = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg("rl:{ratelimit|rule=mem*")
            .arg("COUNT")
            .arg(1000)
            .query(&mut c)
            .expect("SCAN");
        sample.extend(keys);
        cursor = next;
        if cursor == 0 || sample.len() >= 200 {
            break;
        }
    }
    let bytes: Vec<u64> = sample
        .iter()
        .take(200)
        .filter_map(|k| {
            redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(k)
                .query::<Option<u64>>(&mut c)
                .ok()
                .flatten()
        })
        .collect();
    BucketMemory {
        used_per_bucket: (after - before) as f64 / MEMORY_BUCKETS as f64,
        usage_per_bucket: bytes.iter().sum::<u64>() as f64 / bytes.len().max(1) as f64,
        sampled: bytes.len(),
    }
}

// ---------------------------------------------------------------------------------------------
// Envoy: the workloads, what the filter slot holds.

#[derive(Clone, Copy, PartialEq, Debug, clap::ValueEnum)]
pub enum Workload {
    ManyKeys,
    HotKey,
    Flood,
    /// Many keys told apart by API key (identity by key, as users configure it), not address.
    ManyApiKeys,
    /// Many keys (by address), each request's cost settled from its response: reserved 10, the
    /// upstream reports 4 in `x-usage-tokens` (docs/costs.md).
    Settled,
}

impl Workload {
    pub(crate) const ALL: [Workload; 3] = [Workload::ManyKeys, Workload::HotKey, Workload::Flood];
    /// Measured with the filter as shipped beside the goals' workloads, against many keys.
    pub(crate) const EXTRA: [Workload; 2] = [Workload::ManyApiKeys, Workload::Settled];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Workload::ManyKeys => "many keys",
            Workload::HotKey => "hot key",
            Workload::Flood => "flood",
            Workload::ManyApiKeys => "many API keys",
            Workload::Settled => "settled costs (many keys)",
        }
    }
    pub(crate) fn path(self) -> &'static str {
        match self {
            Workload::ManyKeys => "/many/x",
            Workload::HotKey => "/hot/x",
            Workload::Flood => "/flood/x",
            Workload::ManyApiKeys => "/keys/x",
            Workload::Settled => "/usage/header?tokens=4",
        }
    }
}

/// A GET of `url` with the workload's headers (many keys: one of `keys` client addresses);
/// done when answered 200 (429 for the flood).
pub(crate) fn workload_op(
    client: reqwest::Client,
    url: String,
    workload: Workload,
    keys: u64,
) -> Op<Result<(), String>> {
    load::op(move |call| {
        let mut req = client.get(&url);
        let k = (call.random() >> 16) % keys;
        match workload {
            Workload::ManyKeys | Workload::Settled => {
                req = req.header(
                    "x-forwarded-for",
                    format!("10.{}.{}.{}", (k >> 16) & 255, (k >> 8) & 255, k & 255),
                );
            }
            Workload::ManyApiKeys => req = req.header("x-api-key", api_key(k)),
            Workload::HotKey | Workload::Flood => {}
        }
        async move {
            let resp = req.send().await.map_err(|e| e.to_string())?;
            let status = resp.status().as_u16();
            resp.bytes().await.map_err(|e| e.to_string())?;
            let expected = if workload == Workload::Flood {
                429
            } else {
                200
            };
            if status == expected {
                Ok(())
            } else {
                Err(format!("status {status}"))
            }
        }
    })
}

/// The API key of client `k` of the many-API-keys workload.
pub(crate) fn api_key(k: u64) -> String {
    format!("bench-key-{k}")
}

/// The plugin configuration: one rule per workload, the `keys` API keys of the many-API-keys
/// workload (each its own app); `fast` turns every fast path on (as shipped) or off (one callout
/// per request).
pub(crate) fn plugin(fast: bool, keys: usize) -> Plugin {
    let mut settled = rule("settled", "/usage/", &["ip"], "deny");
    settled["cost"] = json!({"reserve": 10, "response_header": "x-usage-tokens"});
    let plugin = Plugin::by_address(json!([
        rule("many", "/many/", &["ip"], "deny"),
        rule("hot", "/hot/", &[], "deny"),
        rule("flood", "/flood/", &[], "deny"),
        rule("edge", "/edge/", &["ip"], "deny"),
        rule("keys", "/keys/", &["app"], "deny"),
        settled
    ]))
    .api_keys(
        "x-api-key",
        (0..keys as u64).map(|k| (api_key(k), format!("app{k}"))),
    );
    if fast {
        plugin
    } else {
        plugin.one_callout_per_request()
    }
}
