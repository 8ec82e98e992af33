//! Envoy's rate limit service (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`) on the
//! sidecar's one listener, called by a tonic client as Envoy's native rate limit filter calls it,
//! against a real Redis.

mod support;

use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use ratelimit_e2e::Redis;
use serde_json::json;
use support::{unique, Sidecar};
use tonic::transport::Channel;

/// This sidecar's own format: rules reached by a descriptor whose first entry is `rule`.
const OWN: &str = r#"
rules:
  # A token every 1000 s: waits are long enough to read exactly.
  tiny: {capacity: 2, refill_per_sec: 0.001}
  ten:
    capacity: 10
    refill_per_sec: 0.001
    overrides:
      - when: {id: gold}
        name: gold
        capacity: 100
        refill_per_sec: 100
  one: {capacity: 1, refill_per_sec: 0.001}
  trial: {capacity: 1, refill_per_sec: 0.001, shadow_mode: true}
"#;

/// envoyproxy/ratelimit's format, unchanged.
const ENVOY: &str = r#"
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {name: per-address, unit: minute, requests_per_unit: 3}
  - key: plan
    value: vip
    rate_limit:
      name: vip
      unit: second
      requests_per_unit: 1000
      replaces: [{name: per-address}]
"#;

async fn client(sidecar: &Sidecar) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(sidecar.base.clone())
        .await
        .expect("gRPC connects (h2c) to the sidecar's listener")
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..Default::default()
    }
}

fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

async fn ask(c: &mut RateLimitServiceClient<Channel>, r: RateLimitRequest) -> RateLimitResponse {
    c.should_rate_limit(r)
        .await
        .unwrap_or_else(|s| panic!("ShouldRateLimit failed: {s:?}"))
        .into_inner()
}

fn header(r: &RateLimitResponse, name: &str) -> Option<String> {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key == name)
        .map(|h| h.value.clone())
}

fn ms(s: &DescriptorStatus) -> u64 {
    let d = s.duration_until_reset.expect("duration_until_reset");
    d.seconds as u64 * 1000 + d.nanos as u64 / 1_000_000
}

fn code(c: Code) -> i32 {
    c as i32
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_bucket_answers_ok_then_over_limit_with_its_figures_and_headers() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis_with(&redis, OWN).await;
    let mut c = client(&sidecar).await;
    let who = unique("client");
    let tiny = || {
        request(
            "ratelimit",
            vec![descriptor(&[("rule", "tiny"), ("id", &who)])],
        )
    };

    let first = ask(&mut c, tiny()).await;
    assert_eq!(first.overall_code, code(Code::Ok));
    let s = &first.statuses[0];
    assert_eq!(s.code, code(Code::Ok));
    assert_eq!(s.limit_remaining, 1);
    assert_eq!(
        s.current_limit,
        Some(RateLimit {
            name: "tiny".into(),
            requests_per_unit: 2,
            // A full refill takes 2000 s: no unit is that long.
            unit: code_unit(Unit::Unknown),
        })
    );
    // OK: until the bucket is full again (one token at 0.001/s: 1000 s, less the time since).
    assert!((990_000..=1_000_000).contains(&ms(s)), "{}", ms(s));
    assert_eq!(
        header(&first, "ratelimit-policy").as_deref(),
        Some("\"tiny\";q=2;w=2000")
    );
    assert_eq!(
        header(&first, "ratelimit").as_deref(),
        Some("\"tiny\";r=1;t=1000")
    );
    assert_eq!(header(&first, "retry-after"), None);

    assert_eq!(ask(&mut c, tiny()).await.overall_code, code(Code::Ok));
    let over = ask(&mut c, tiny()).await;
    assert_eq!(over.overall_code, code(Code::OverLimit));
    let s = &over.statuses[0];
    assert_eq!(s.code, code(Code::OverLimit));
    assert_eq!(s.limit_remaining, 0);
    // OVER_LIMIT: the wait until the cost (one token) is available.
    let wait_ms = ms(s);
    assert!((990_000..=1_000_000).contains(&wait_ms), "{wait_ms}");
    let retry_after = header(&over, "retry-after").expect("Retry-After over the limit");
    assert_eq!(
        retry_after,
        wait_ms.div_ceil(1000).to_string(),
        "rounded up"
    );
    assert_eq!(
        header(&over, "ratelimit-policy").as_deref(),
        Some("\"tiny\";q=2;w=2000")
    );
    assert_eq!(
        header(&over, "ratelimit"),
        Some(format!("\"tiny\";r=0;t={retry_after}")),
        "t equals Retry-After on a rejection"
    );
    assert_eq!(
        sidecar
            .metric("ratelimit_calls_total{api=\"grpc\",outcome=\"answered\"}")
            .await,
        3.0
    );
}

fn code_unit(u: Unit) -> i32 {
    u as i32
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_addend_is_the_cost_and_a_descriptors_own_wins() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis_with(&redis, OWN).await;
    let mut c = client(&sidecar).await;
    let who = unique("cost");
    let ten = || descriptor(&[("rule", "ten"), ("id", &who)]);

    let mut r = request("ratelimit", vec![ten()]);
    r.hits_addend = 4;
    let a = ask(&mut c, r).await;
    assert_eq!(a.statuses[0].limit_remaining, 6);

    // The descriptor's own hits_addend overrides the request's: 7 > 6 left.
    let mut d = ten();
    d.hits_addend = Some(UInt64Value { value: 7 });
    let mut r = request("ratelimit", vec![d]);
    r.hits_addend = 1;
    let a = ask(&mut c, r).await;
    assert_eq!(a.overall_code, code(Code::OverLimit));
    assert_eq!(a.statuses[0].limit_remaining, 6, "nothing charged");

    let mut r = request("ratelimit", vec![ten()]);
    r.hits_addend = 6;
    let a = ask(&mut c, r).await;
    assert_eq!(a.overall_code, code(Code::Ok));
    assert_eq!(a.statuses[0].limit_remaining, 0);

    // A limit inside the descriptor is ignored: the policy's numbers apply.
    let mut d = ten();
    d.limit = Some(RateLimitOverride {
        requests_per_unit: 1_000_000,
        unit: code_unit(Unit::Second),
    });
    let a = ask(&mut c, request("ratelimit", vec![d])).await;
    assert_eq!(a.overall_code, code(Code::OverLimit));
    assert_eq!(
        a.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit),
        Some(10)
    );
    // An override of the rule, by the subject's value, applies as for the wasm filter.
    let a = ask(
        &mut c,
        request(
            "ratelimit",
            vec![descriptor(&[("rule", "ten"), ("id", "gold")])],
        ),
    )
    .await;
    assert_eq!(
        a.statuses[0].current_limit,
        Some(RateLimit {
            name: "gold".into(),
            requests_per_unit: 100,
            unit: code_unit(Unit::Second),
        })
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_descriptors_of_one_request_are_all_or_nothing_and_unmatched_ones_are_not_limited() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis_with(&redis, OWN).await;
    let mut c = client(&sidecar).await;
    let who = unique("both");
    let both = || {
        request(
            "ratelimit",
            vec![
                descriptor(&[("rule", "ten"), ("id", &who)]),
                descriptor(&[("rule", "one"), ("id", &who)]),
                descriptor(&[("path", "/no/limit/for/this")]),
            ],
        )
    };
    let a = ask(&mut c, both()).await;
    assert_eq!(a.overall_code, code(Code::Ok));
    assert_eq!(a.statuses.len(), 3);
    assert_eq!(a.statuses[0].limit_remaining, 9);
    assert_eq!(a.statuses[1].limit_remaining, 0);
    // Matches no limit: OK, no limit, no figures, no header of its own.
    assert_eq!(a.statuses[2].code, code(Code::Ok));
    assert_eq!(a.statuses[2].current_limit, None);
    assert_eq!(a.statuses[2].duration_until_reset, None);
    let policy = header(&a, "ratelimit-policy").unwrap();
    assert_eq!(policy, "\"ten\";q=10;w=10000, \"one\";q=1;w=1000");

    // "one" is empty: the request is over the limit, and "ten" is not charged for it.
    let a = ask(&mut c, both()).await;
    assert_eq!(a.overall_code, code(Code::OverLimit));
    assert_eq!(a.statuses[0].code, code(Code::Ok), "ten could pay");
    assert_eq!(a.statuses[1].code, code(Code::OverLimit));
    assert_eq!(a.statuses[2].code, code(Code::Ok));
    let a = ask(
        &mut c,
        request(
            "ratelimit",
            vec![descriptor(&[("rule", "ten"), ("id", &who)])],
        ),
    )
    .await;
    assert_eq!(a.statuses[0].limit_remaining, 8, "charged once, not twice");

    // A request of nothing but unmatched descriptors: OK, no headers.
    let a = ask(
        &mut c,
        request("ratelimit", vec![descriptor(&[("rule", "no-such-rule")])]),
    )
    .await;
    assert_eq!(a.overall_code, code(Code::Ok));
    assert!(a.response_headers_to_add.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_never_rejects_and_counts_what_it_would_have_done() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis_with(&redis, OWN).await;
    let mut c = client(&sidecar).await;
    let who = unique("shadow");
    let trial = || {
        request(
            "ratelimit",
            vec![descriptor(&[("rule", "trial"), ("id", &who)])],
        )
    };
    for _ in 0..3 {
        let a = ask(&mut c, trial()).await;
        assert_eq!(a.overall_code, code(Code::Ok));
        assert_eq!(a.statuses[0].code, code(Code::Ok));
        assert_eq!(header(&a, "retry-after"), None);
    }
    assert_eq!(
        sidecar
            .metric("ratelimit_decisions_total{limit=\"trial\",verdict=\"shadow_rejected\"}")
            .await,
        2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoyproxy_ratelimit_format_windows_become_buckets_and_replaces_holds() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis_with(&redis, ENVOY).await;
    let mut c = client(&sidecar).await;
    let addr = format!("10.0.0.{}", rand::random::<u8>());
    let by_address = || request("edge", vec![descriptor(&[("remote_address", &addr)])]);

    // 3 per minute: a bucket of 3 refilling 3/60 per second.
    let a = ask(&mut c, by_address()).await;
    assert_eq!(
        a.statuses[0].current_limit,
        Some(RateLimit {
            name: "per-address".into(),
            requests_per_unit: 3,
            unit: code_unit(Unit::Minute),
        })
    );
    assert_eq!(a.statuses[0].limit_remaining, 2);
    // Until full: one token at 0.05/s.
    let reset = ms(&a.statuses[0]);
    assert!((19_000..=20_000).contains(&reset), "{reset}");
    assert_eq!(
        header(&a, "ratelimit-policy").as_deref(),
        Some("\"per-address\";q=3;w=60")
    );
    ask(&mut c, by_address()).await;
    ask(&mut c, by_address()).await;
    let a = ask(&mut c, by_address()).await;
    assert_eq!(a.overall_code, code(Code::OverLimit));
    let wait = ms(&a.statuses[0]);
    assert!((19_000..=20_000).contains(&wait), "{wait}");

    // `replaces`: with the vip descriptor in the same request, per-address does not apply.
    let vip = || {
        request(
            "edge",
            vec![
                descriptor(&[("remote_address", &addr)]),
                descriptor(&[("plan", "vip")]),
            ],
        )
    };
    let a = ask(&mut c, vip()).await;
    assert_eq!(a.overall_code, code(Code::Ok));
    assert_eq!(a.statuses[0].code, code(Code::Ok));
    assert_eq!(a.statuses[0].current_limit, None, "replaced");
    assert_eq!(
        a.statuses[1]
            .current_limit
            .as_ref()
            .map(|l| l.name.as_str()),
        Some("vip")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_and_http_apis_draw_from_one_bucket() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis_with(&redis, OWN).await;
    let mut c = client(&sidecar).await;
    let who = unique("shared");
    let (status, a) = sidecar
        .decide(json!([{"rule": "tiny", "subject": {"id": who}}]))
        .await;
    assert_eq!((status, a["allowed"].as_bool()), (200, Some(true)), "{a}");
    let a = ask(
        &mut c,
        request(
            "ratelimit",
            vec![descriptor(&[("rule", "tiny"), ("id", &who)])],
        ),
    )
    .await;
    assert_eq!(a.statuses[0].limit_remaining, 0, "the HTTP call took one");
    let (_, a) = sidecar
        .decide(json!([{"rule": "tiny", "subject": {"id": who}}]))
        .await;
    assert_eq!(a["allowed"], false, "{a}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_invalid_argument_naming_the_field() {
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis_with(&redis, OWN).await;
    let mut c = client(&sidecar).await;
    let one = || vec![descriptor(&[("rule", "ten"), ("id", "x")])];
    let long = "v".repeat(ratelimit_wire::MAX_VALUE_BYTES + 1);
    let cases = [
        (request("", one()), "domain:"),
        (
            request("ratelimit", vec![]),
            "descriptors: must hold 1 to 64",
        ),
        (
            request("ratelimit", vec![descriptor(&[("a", "b")]); 65]),
            "descriptors: must hold 1 to 64",
        ),
        (
            request("ratelimit", vec![descriptor(&[])]),
            "descriptors[0].entries:",
        ),
        (
            request(
                "ratelimit",
                vec![descriptor(&[("rule", "ten"), ("id", &long)])],
            ),
            "descriptors[0].entries[1].value:",
        ),
        (
            request("nowhere", one()),
            "domain: unknown domain \"nowhere\"",
        ),
    ];
    let n = cases.len();
    for (r, field) in cases {
        let status = c.should_rate_limit(r).await.expect_err("refused");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(status.message().starts_with(field), "{status:?}");
    }
    assert_eq!(
        sidecar
            .metric("ratelimit_calls_total{api=\"grpc\",outcome=\"bad_request\"}")
            .await,
        n as f64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_is_unavailable() {
    let mut redis = Redis::start();
    let sidecar =
        Sidecar::with_policy(OWN, &["--redis", &redis.url(), "--redis-timeout-ms", "500"]).await;
    sidecar.wait_ready("/readyz").await;
    let mut c = client(&sidecar).await;
    let r = || {
        request(
            "ratelimit",
            vec![descriptor(&[("rule", "ten"), ("id", "x")])],
        )
    };
    assert_eq!(ask(&mut c, r()).await.overall_code, code(Code::Ok));
    redis.stop();
    let status = tokio::time::timeout(Duration::from_secs(30), c.should_rate_limit(r()))
        .await
        .expect("answered")
        .expect_err("no decision without Redis");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains("redis"), "{status:?}");
    assert_eq!(
        sidecar
            .metric("ratelimit_calls_total{api=\"grpc\",outcome=\"unavailable\"}")
            .await,
        1.0
    );
}

/// A stream-done descriptor of Envoy's filter: the bucket's entries, `settle=<charged>` (what the
/// answer's metadata reported: the tokens, and the receipt after a `:`), and the real cost as its
/// hits_addend (docs/grpc.md#costs-known-after-the-response).
fn settle(bucket: &[(&str, &str)], charged: &str, cost: u64) -> RateLimitRequest {
    let mut entries = bucket.to_vec();
    entries.push(("settle", charged));
    let mut d = descriptor(&entries);
    d.hits_addend = Some(UInt64Value { value: cost });
    request("ratelimit", vec![d])
}

/// What an answer's dynamic metadata says `rule` was charged (`settle.<rule>`).
fn charged(r: &RateLimitResponse, rule: &str) -> Option<String> {
    use envoy_types::pb::google::protobuf::value::Kind;
    let settle = r.dynamic_metadata.as_ref()?.fields.get("settle")?;
    let Some(Kind::StructValue(rules)) = &settle.kind else {
        return None;
    };
    match &rules.fields.get(rule)?.kind {
        Some(Kind::StringValue(v)) => Some(v.clone()),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_charges_or_gives_back_against_its_receipt_into_a_debt_and_always_answers_ok()
{
    let redis = Redis::start();
    let sidecar = Sidecar::on_redis_with(&redis, OWN).await;
    let mut c = client(&sidecar).await;
    let who = unique("settle");
    let bucket = [("rule", "ten"), ("id", who.as_str())];
    // A reservation: `settle=reserve` asks for a receipt of the charge.
    let reserve = |cost: u32| {
        let mut entries = bucket.to_vec();
        entries.push(("settle", "reserve"));
        let mut r = request("ratelimit", vec![descriptor(&entries)]);
        r.hits_addend = cost;
        r
    };
    let remaining = |a: &RateLimitResponse| a.statuses[0].limit_remaining;

    // Reserve 4 of 10, really 2: 2 come back. The answer says what rule "ten" was charged, and
    // the receipt of that charge.
    let a = ask(&mut c, reserve(4)).await;
    assert_eq!(remaining(&a), 6);
    let reported = charged(&a, "ten").expect("the charge reported");
    let (tokens, receipt) = reported.split_once(':').expect("<tokens>:<receipt>");
    assert_eq!(tokens, "4");
    assert!(receipt.parse::<u64>().is_ok(), "{reported}");
    let s = ask(&mut c, settle(&bucket, &reported, 2)).await;
    assert_eq!(s.overall_code, code(Code::Ok));
    assert_eq!(s.statuses.len(), 1);
    assert_eq!(s.statuses[0].code, code(Code::Ok));
    assert!(s.response_headers_to_add.is_empty(), "{s:?}");
    let a = ask(&mut c, reserve(1)).await;
    assert_eq!(remaining(&a), 7, "8 left, then 1");
    let one = charged(&a, "ten").unwrap();
    // Charged 1, really 1: nothing to settle.
    ask(&mut c, settle(&bucket, &one, 1)).await;
    // Issue 32, case 9: a made-up charge gives nothing back (no receipt, or one never given, or
    // one used already): 7 left.
    for forged in [
        "999999999999999",
        "999999999999999:12345",
        reported.as_str(),
    ] {
        ask(&mut c, settle(&bucket, forged, 0)).await;
    }
    // Charged 1, really 15: 14 more, past zero, and the settlement is still OK.
    let s = ask(&mut c, settle(&bucket, "1", 15)).await;
    assert_eq!(s.overall_code, code(Code::Ok));
    assert_eq!(s.statuses[0].code, code(Code::Ok));
    // A debt of 7: the next request of cost 1 waits for 8 tokens, a token every 1000 s.
    let over = ask(&mut c, reserve(1)).await;
    assert_eq!(over.overall_code, code(Code::OverLimit));
    assert_eq!(
        over.dynamic_metadata, None,
        "a rejected request was charged nothing"
    );
    let wait = ms(&over.statuses[0]);
    assert!((7_990_000..=8_000_000).contains(&wait), "waits {wait} ms");
    assert_eq!(header(&over, "retry-after").as_deref(), Some("8000"));
    // A settlement on a descriptor that matches no limit, or in envoyproxy/ratelimit's format,
    // settles the bucket its entries name there, or nothing.
    let s = ask(&mut c, settle(&[("rule", "nowhere")], "1", 5)).await;
    assert_eq!(s.overall_code, code(Code::Ok));
    let metric = |o: &str| format!("ratelimit_settlements_total{{outcome=\"{o}\"}}");
    assert_eq!(sidecar.metric(&metric("given_back")).await, 1.0);
    assert_eq!(sidecar.metric(&metric("charged")).await, 1.0);
    assert_eq!(
        sidecar.metric(&metric("skipped")).await,
        5.0,
        "1 = 1, the three made up, no limit"
    );
    // Malformed: refused naming the field, nothing applied.
    let mut bad = settle(&bucket, "1", 1);
    bad.descriptors[0].entries[2].value = "x".into();
    let status = c.should_rate_limit(bad).await.expect_err("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status
            .message()
            .starts_with("descriptors[0].entries[2].value:"),
        "{status:?}"
    );
    let mut mixed = settle(&bucket, "1", 1);
    mixed.descriptors.insert(0, descriptor(&bucket));
    let status = c.should_rate_limit(mixed).await.expect_err("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().starts_with("descriptors[1]:"),
        "{status:?}"
    );
    let over = ask(&mut c, reserve(1)).await;
    assert_eq!(over.overall_code, code(Code::OverLimit), "still in debt");
}
