//! The LLM gateway example as shipped (`envoy/envoy-llm.yaml` with `envoy/limits-llm.yaml`,
//! docs/costs.md) in a real Envoy, sidecar and Redis: each user, named by the `sub` claim of a
//! JWT that `jwt_authn` verified, has a budget of tokens per minute and per day; a request
//! reserves its JSON `max_tokens` in both and settles the `usage.total_tokens` its answer reports,
//! from a JSON body or from the last event of a `text/event-stream`.
//!
//! - a JSON answer and a stream each settle their real cost in both buckets (the per-day bucket,
//!   refilled at 11.575 tokens/s, shows it to within its refill);
//! - a user who spent past the minute's budget holds a debt: the next request waits
//!   `(debt + reservation) / r`, while another user's budget is untouched;
//! - a request without a token is refused (`on_unknown: reject`, 401) and never reaches the API.

use std::io::Read;
use std::time::{Duration, Instant};

use ratelimit_e2e::{
    bucket_tokens, http, signed_jwt, wait_until, workspace_root, Envoy, EnvoyConfig, Redis,
    Sidecar, Upstream, JWT_ISSUER,
};
use serde_json::json;

/// The shipped route (every path to the API) and the same route with the test upstream's
/// usage-reporting paths under it: `/v1/json?tokens=N` is answered by `/usage/json?tokens=N`.
const ROUTE: &str = "match: { prefix: \"/\" }\n                route: { cluster: demo_upstream }";
const ROUTE_TO_USAGE: &str = "match: { prefix: \"/v1/\" }\n                route: { cluster: demo_upstream, prefix_rewrite: \"/usage/\" }";

/// The shipped example's capacities and refills (envoy/limits-llm.yaml).
const MINUTE_CAPACITY: f64 = 40_000.0;
const MINUTE_REFILL: f64 = 666.667;
const DAY_CAPACITY: f64 = 1_000_000.0;
const DAY_REFILL: f64 = 11.575;

struct Gateway {
    redis: Redis,
    sidecar: Sidecar,
    upstream: Upstream,
    envoy: Envoy,
}

impl Gateway {
    fn start() -> Gateway {
        let redis = Redis::start();
        let limits = std::fs::read_to_string(workspace_root().join("envoy/limits-llm.yaml"))
            .expect("read envoy/limits-llm.yaml");
        let sidecar = Sidecar::with_policy(&redis.url(), &limits, &[]);
        let upstream = Upstream::start();
        let config = EnvoyConfig::shipped("envoy-llm.yaml", sidecar.port, upstream.port)
            .replace(ROUTE, ROUTE_TO_USAGE)
            // The shipped 50 ms is for a sidecar next to Envoy; this machine runs every test.
            .replace("\"timeout_ms\": 50", "\"timeout_ms\": 2000");
        let envoy = Envoy::start(&config);
        Gateway {
            redis,
            sidecar,
            upstream,
            envoy,
        }
    }

    /// POST `path` as `user` (none: no token) with `max_tokens`: the status, `Retry-After` and
    /// the body read to its end.
    fn ask(&self, user: Option<&str>, path: &str, max_tokens: u64) -> (u16, Option<u64>, String) {
        let mut req = http()
            .post(self.envoy.url(path))
            .header("content-type", "application/json")
            .body(json!({"model": "m", "max_tokens": max_tokens}).to_string());
        if let Some(user) = user {
            let exp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
                + 600;
            let token = signed_jwt(&json!({"iss": JWT_ISSUER, "sub": user, "exp": exp}));
            req = req.bearer_auth(token);
        }
        let mut resp = req.send().expect("request through Envoy");
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()?.parse().ok());
        let mut body = String::new();
        resp.read_to_string(&mut body).expect("read the answer");
        (status, retry_after, body)
    }

    /// The per-day bucket of `user` as Redis holds it, once `settlements` settlements (each
    /// request settles both rules) were applied.
    fn day_tokens_after(&self, user: &str, settlements: u64) -> f64 {
        wait_until("the settlements", Duration::from_secs(10), || {
            self.settled() >= settlements
        });
        bucket_tokens(&self.redis, &day_key(user)).expect("the per-day bucket")
    }

    fn settled(&self) -> u64 {
        ["charged", "given_back", "skipped"]
            .iter()
            .map(|o| {
                self.sidecar
                    .metric(&format!("ratelimit_settlements_total{{outcome=\"{o}\"}}"))
                    as u64
            })
            .sum()
    }
}

fn day_key(user: &str) -> String {
    format!("rl:{{ratelimit|rule=llm-tokens-per-day|user={user}}}")
}

fn minute_key(user: &str) -> String {
    format!("rl:{{ratelimit|rule=llm-tokens-per-minute|user={user}}}")
}

#[test]
fn a_json_answer_and_a_stream_settle_their_reported_tokens_in_both_of_a_users_buckets() {
    let g = Gateway::start();
    let start = Instant::now();

    // Reserved 2000 (its max_tokens), used 1234: 766 given back in each bucket.
    let (status, _, body) = g.ask(Some("alice"), "/v1/json?tokens=1234", 2000);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"total_tokens\":1234"), "{body}");
    let day = g.day_tokens_after("alice", 2);
    let refilled = DAY_REFILL * start.elapsed().as_secs_f64();
    let want = DAY_CAPACITY - 1234.0;
    assert!(
        day >= want - 1e-6 && day <= want + refilled + 1e-6,
        "per-day bucket {day}, want {want} (+ at most {refilled:.1} of refill)"
    );

    // A stream of 4 events whose last carries usage.total_tokens 3000, reserved 4000.
    let (status, _, body) = g.ask(
        Some("alice"),
        "/v1/sse?tokens=3000&events=4&gap_ms=20",
        4000,
    );
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"total_tokens\":3000"), "{body}");
    let day = g.day_tokens_after("alice", 4);
    let refilled = DAY_REFILL * start.elapsed().as_secs_f64();
    let want = DAY_CAPACITY - 1234.0 - 3000.0;
    assert!(
        day >= want - 1e-6 && day <= want + refilled + 1e-6,
        "per-day bucket {day}, want {want} (+ at most {refilled:.1} of refill)"
    );
    // The minute's bucket refills 666.667 a second: only its write shows here, not a total.
    let minute = bucket_tokens(&g.redis, &minute_key("alice")).expect("the per-minute bucket");
    assert!(minute <= MINUTE_CAPACITY, "per-minute bucket {minute}");
    assert_eq!(g.upstream.hits(), 2);
    println!(
        "alice after 1234 + 3000 tokens: per-day bucket {day:.1} (want {want} + refill), per-minute {minute:.1}"
    );
}

#[test]
fn a_user_past_the_minutes_budget_waits_for_refill_to_repay_the_debt_and_no_one_else_does() {
    let g = Gateway::start();

    // Reserved 100, used 39,000: the minute's bucket is left 1,000 (+ refill) and the day's
    // 961,000 (+ refill).
    let (status, _, body) = g.ask(Some("alice"), "/v1/json?tokens=39000", 100);
    assert_eq!(status, 200, "{body}");
    let settled_at = Instant::now();
    g.day_tokens_after("alice", 2);
    let minute = bucket_tokens(&g.redis, &minute_key("alice")).expect("the per-minute bucket");
    assert!(
        minute < MINUTE_CAPACITY - 39_000.0 + 100.0 + 1e-6 + MINUTE_REFILL * 1.0,
        "per-minute bucket {minute}: the real cost was charged"
    );

    // The next request reserves 32,768 (reserve_max): it waits for the minute's refill,
    // (32,768 - tokens) / 666.667 per second, at most 47.7 s from the settlement.
    let (status, retry_after, body) = g.ask(Some("alice"), "/v1/json?tokens=10", 32_768);
    assert_eq!(status, 429, "{body}");
    let retry_after = retry_after.expect("Retry-After on the 429");
    let elapsed = settled_at.elapsed().as_secs_f64();
    let most = ((32_768.0 - 1_000.0) / MINUTE_REFILL).ceil() as u64;
    let least = ((32_768.0 - 1_000.0) / MINUTE_REFILL - elapsed - 1.0).floor() as u64;
    assert!(
        (least..=most).contains(&retry_after),
        "Retry-After {retry_after} s, want {least} to {most}"
    );

    // Another user has a budget of their own.
    let (status, _, body) = g.ask(Some("bob"), "/v1/json?tokens=10", 32_768);
    assert_eq!(status, 200, "{body}");

    // No token: refused by the example's `on_unknown: reject` before the API.
    let hits = g.upstream.hits();
    let (status, _, _) = g.ask(None, "/v1/json?tokens=10", 10);
    assert_eq!(status, 401);
    assert_eq!(g.upstream.hits(), hits);
    println!("alice in debt: Retry-After {retry_after} s (want {least} to {most}); bob admitted");
}

impl Gateway {
    /// POST `path` as `user` with `max_tokens` and an `accept-encoding` (none: none sent): the
    /// status, or 0 when the answer was cut short.
    fn ask_raw(&self, user: &str, path: &str, max_tokens: u64, accept: Option<&str>) -> u16 {
        let exp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            + 600;
        let token = signed_jwt(&json!({"iss": JWT_ISSUER, "sub": user, "exp": exp}));
        // Not reqwest's own decompression: the client asks for what it asks, as a client would.
        let client = reqwest::blocking::Client::builder()
            .no_gzip()
            .no_deflate()
            .build()
            .unwrap();
        let mut req = client
            .post(self.envoy.url(path))
            .header("content-type", "application/json")
            .bearer_auth(token)
            .body(json!({"model": "m", "max_tokens": max_tokens}).to_string());
        if let Some(a) = accept {
            req = req.header("accept-encoding", a);
        }
        let Ok(mut resp) = req.send() else {
            return 0;
        };
        let status = resp.status().as_u16();
        let mut body = Vec::new();
        match resp.read_to_end(&mut body) {
            Ok(_) => status,
            Err(_) => 0,
        }
    }
}

/// Issue 32, case 2: the client does not decide whether its cost is counted. A client asking
/// for 1 token (`max_tokens: 1`) whose answers really cost 5,000 (a long prompt): a compressed
/// answer is not offered (the filter asks the API for `accept-encoding: identity`, so it reads
/// the real cost), and an answer whose cost cannot be read (compressed anyway, no usage, no
/// field, cut short) settles at the rule's `reserve_max` (32,768), never at the client's 1.
#[test]
fn whatever_the_client_sends_its_answers_settle_at_their_real_cost_or_the_operators_figure() {
    let g = Gateway::start();
    let mut settled = g.settled();
    for (user, path, accept, charged) in [
        ("gzip", "/v1/json?tokens=5000", Some("gzip"), 5_000.0),
        ("deflate", "/v1/json?tokens=5000", Some("deflate"), 5_000.0),
        (
            "sse-gzip",
            "/v1/sse?tokens=5000&events=3",
            Some("gzip, br"),
            5_000.0,
        ),
        (
            "forced",
            "/v1/json?tokens=5000&compress=gzip",
            None,
            32_768.0,
        ),
        (
            "no-usage",
            "/v1/sse?tokens=5000&events=3&usage=0",
            None,
            32_768.0,
        ),
        ("no-field", "/v1/json?tokens=5000&usage=0", None, 32_768.0),
        ("cut", "/v1/json?tokens=5000&cut=1", None, 32_768.0),
    ] {
        let start = Instant::now();
        let status = g.ask_raw(user, path, 1, accept);
        assert!(
            status == 200 || (status == 0 && user == "cut"),
            "{user}: {status}"
        );
        settled += 2;
        let day = g.day_tokens_after(user, settled);
        let refilled = DAY_REFILL * start.elapsed().as_secs_f64();
        let want = DAY_CAPACITY - charged;
        println!("{user}: per-day bucket {day:.1}, want {want} (+ at most {refilled:.1})");
        assert!(
            day >= want - 1e-6 && day <= want + refilled + 1e-6,
            "{user}: per-day bucket {day}, want {want}: the answer settled at {}",
            DAY_CAPACITY - day
        );
    }
    // A prompt is at most 32 KiB (the listener's buffer limit): what one request in flight can
    // add beyond its reservation is bounded (docs/costs.md, "The bound").
    let hits = g.upstream.hits();
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    let token = signed_jwt(&json!({"iss": JWT_ISSUER, "sub": "long", "exp": exp}));
    let long = json!({"model": "m", "max_tokens": 1, "prompt": "x".repeat(40 * 1024)});
    let status = http()
        .post(g.envoy.url("/v1/json?tokens=1"))
        .header("content-type", "application/json")
        .bearer_auth(token)
        .body(long.to_string())
        .send()
        .map(|r| r.status().as_u16())
        .unwrap_or(0);
    assert_eq!(status, 413, "a 40 KiB prompt");
    assert_eq!(g.upstream.hits(), hits);
    // The issue's figures: 40 requests of max_tokens 1 that really cost 5,000 each, asking for
    // gzip, one after the other: what is admitted costs at most C + r·T plus the one request in
    // flight's excess (5,000 - 1), where before the fix all 40 were (200,000 tokens).
    let start = Instant::now();
    let admitted = (0..40)
        .filter(|_| g.ask_raw("many", "/v1/json?tokens=5000", 1, Some("gzip")) == 200)
        .count();
    let bound = MINUTE_CAPACITY + MINUTE_REFILL * start.elapsed().as_secs_f64() + 4_999.0;
    println!(
        "40 requests of 5,000 real tokens asking for gzip: {admitted} admitted ({} tokens, bound {bound:.0})",
        admitted * 5_000
    );
    assert!(
        admitted as f64 * 5_000.0 <= bound,
        "{admitted} admitted: {} tokens against a bound of {bound:.0}",
        admitted * 5_000
    );
}
