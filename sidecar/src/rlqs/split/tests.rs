use std::collections::HashMap;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaUsageReports};
use proptest::prelude::{prop_assert, prop_assert_eq, proptest};
use prost::Message;

use super::*;

/// A usage of the bucket `{rule: per-ip, ip: <ip>}` with `allowed` requests.
fn usage(ip: &str, allowed: u64) -> BucketQuotaUsage {
    BucketQuotaUsage {
        bucket_id: Some(BucketId {
            bucket: HashMap::from([
                ("rule".to_string(), "per-ip".to_string()),
                ("ip".to_string(), ip.to_string()),
            ]),
        }),
        time_elapsed: None,
        num_requests_allowed: allowed,
        num_requests_denied: 0,
    }
}

fn report(domain: &str, usages: Vec<BucketQuotaUsage>) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: domain.into(),
        bucket_quota_usages: usages,
    }
}

/// `payload` as one gRPC message.
fn framed(flag: u8, payload: &[u8]) -> Vec<u8> {
    let mut m = vec![flag];
    m.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    m.extend_from_slice(payload);
    m
}

fn message(r: &RateLimitQuotaUsageReports) -> Vec<u8> {
    framed(0, &r.encode_to_vec())
}

/// Feeds `bytes` in chunks of `chunk` bytes; the bytes sent on.
fn run(splitter: &mut Splitter, bytes: &[u8], chunk: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for piece in bytes.chunks(chunk.max(1)) {
        splitter.push(Bytes::copy_from_slice(piece), &mut out);
    }
    out.concat()
}

/// The gRPC messages of a byte stream: (flag, payload).
fn messages(mut bytes: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let len = u32::from_be_bytes(bytes[1..5].try_into().unwrap()) as usize;
        out.push((bytes[0], bytes[5..5 + len].to_vec()));
        bytes = &bytes[5 + len..];
    }
    out
}

fn decoded(bytes: &[u8]) -> Vec<RateLimitQuotaUsageReports> {
    messages(bytes)
        .iter()
        .map(|(_, p)| RateLimitQuotaUsageReports::decode(p.as_slice()).unwrap())
        .collect()
}

const LIMIT: usize = 1024;
const MAX_USAGE: usize = 300;

#[test]
fn a_message_within_the_limit_passes_byte_for_byte() {
    let small = message(&report("ratelimit", vec![usage("10.0.0.1", 3)]));
    let twice = [small.clone(), small].concat();
    for chunk in [1, 2, 7, 4096] {
        let mut s = Splitter::new(LIMIT, MAX_USAGE);
        assert_eq!(run(&mut s, &twice, chunk), twice, "chunks of {chunk}");
        assert_eq!(s.tally().whole, 2);
        assert_eq!(s.tally().split, 0);
    }
    // Empty and compressed messages too: the service refuses a compressed one whatever its size.
    let mut s = Splitter::new(LIMIT, MAX_USAGE);
    let compressed = framed(1, &vec![7u8; 10 * LIMIT]);
    let both = [framed(0, &[]), compressed].concat();
    assert_eq!(run(&mut s, &both, 100), both);
}

#[test]
fn a_large_report_is_sent_on_as_reports_within_the_limit_with_its_domain() {
    let usages: Vec<BucketQuotaUsage> = (0..1000)
        .map(|i| usage(&format!("127.1.{}.{}", i / 250, i % 250), i))
        .collect();
    let big = message(&report("ratelimit", usages.clone()));
    assert!(big.len() > 20 * LIMIT);
    let mut s = Splitter::new(LIMIT, MAX_USAGE);
    let out = run(&mut s, &big, 333);
    let pieces = messages(&out);
    assert!(pieces.len() > 20, "{}", pieces.len());
    for (flag, payload) in &pieces {
        assert_eq!(*flag, 0);
        assert!(payload.len() <= LIMIT, "{}", payload.len());
    }
    let reports = decoded(&out);
    assert!(reports.iter().all(|r| r.domain == "ratelimit"));
    let again: Vec<BucketQuotaUsage> = reports
        .into_iter()
        .flat_map(|r| r.bucket_quota_usages)
        .collect();
    assert_eq!(again, usages, "every usage, in order");
    assert_eq!(
        s.tally(),
        Tally {
            whole: 0,
            split: 1,
            too_large: 0,
            unreadable: 0
        }
    );
}

#[test]
fn a_usage_too_large_is_dropped_and_counted_and_the_others_kept() {
    let huge = usage(&"x".repeat(MAX_USAGE), 1);
    let mut usages: Vec<BucketQuotaUsage> = (0..100).map(|i| usage(&i.to_string(), 1)).collect();
    usages.insert(50, huge.clone());
    let big = message(&report("d", usages.clone()));
    let mut s = Splitter::new(LIMIT, MAX_USAGE);
    let reports = decoded(&run(&mut s, &big, 64));
    let kept: Vec<BucketQuotaUsage> = reports
        .into_iter()
        .flat_map(|r| r.bucket_quota_usages)
        .collect();
    usages.remove(50);
    assert_eq!(kept, usages);
    assert_eq!(s.tally().too_large, 1);
    // The limit bounds a usage too: one that fits no report is dropped.
    let mut s = Splitter::new(200, 100_000);
    let big = message(&report(
        "d",
        vec![usage(&"y".repeat(300), 1), usage("a", 1)],
    ));
    let kept: Vec<_> = decoded(&run(&mut s, &big, 7))
        .into_iter()
        .flat_map(|r| r.bucket_quota_usages)
        .collect();
    assert_eq!(kept, vec![usage("a", 1)]);
    assert_eq!(s.tally().too_large, 1);
}

#[test]
fn unknown_fields_are_skipped_and_an_unreadable_rest_costs_only_the_rest() {
    let usages: Vec<BucketQuotaUsage> = (0..60).map(|i| usage(&i.to_string(), 1)).collect();
    let mut payload = report("d", usages.clone()).encode_to_vec();
    // Fields a newer proto might add: a varint (7), a fixed64 (8), bytes (9), a fixed32 (10).
    payload.extend_from_slice(&[7 << 3, 0x96, 0x01]);
    payload.extend_from_slice(&[(8 << 3) | 1, 1, 2, 3, 4, 5, 6, 7, 8]);
    payload.extend_from_slice(&[(9 << 3) | 2, 3, b'a', b'b', b'c']);
    payload.extend_from_slice(&[(10 << 3) | 5, 1, 2, 3, 4]);
    let tail = report("", vec![usage("tail", 2)]).encode_to_vec();
    payload.extend_from_slice(&tail);
    let mut s = Splitter::new(LIMIT, MAX_USAGE);
    let kept: Vec<_> = decoded(&run(&mut s, &framed(0, &payload), 5))
        .into_iter()
        .flat_map(|r| r.bucket_quota_usages)
        .collect();
    let mut all = usages.clone();
    all.push(usage("tail", 2));
    assert_eq!(kept, all);
    assert_eq!(s.tally().unreadable, 0);

    // A group (wire type 3) is not in these messages: the usages before it are sent on, the
    // rest of the message is skipped, and the next message is read as usual.
    let mut payload = report("d", usages.clone()).encode_to_vec();
    payload.extend_from_slice(&[(11 << 3) | 3]);
    payload.extend_from_slice(&report("", vec![usage("lost", 1)]).encode_to_vec());
    let next = message(&report("d", vec![usage("next", 1)]));
    let mut s = Splitter::new(LIMIT, MAX_USAGE);
    let out = run(&mut s, &[framed(0, &payload), next].concat(), 3);
    let kept: Vec<_> = decoded(&out)
        .into_iter()
        .flat_map(|r| r.bucket_quota_usages)
        .collect();
    let mut expected = usages;
    expected.push(usage("next", 1));
    assert_eq!(kept, expected);
    assert_eq!(s.tally().unreadable, 1);
}

#[test]
fn a_length_past_the_end_or_a_varint_too_long_is_unreadable_never_a_panic() {
    for bad in [
        // A usage claiming more bytes than the message holds.
        vec![(2 << 3) | 2, 0xff, 0xff, 0x03],
        // A key of eleven continuation bytes.
        vec![0x80; 11],
        // A fixed64 cut short by the message's end.
        vec![(8 << 3) | 1, 1, 2],
        // Field 2 as a varint.
        vec![2 << 3, 1],
    ] {
        let mut payload = vec![0u8; 0];
        payload.extend_from_slice(&report("d", vec![usage("a", 1)]).encode_to_vec());
        payload.extend_from_slice(&bad);
        // Padding past the limit, inside an unknown bytes field placed before the bad bytes
        // would make it readable: put it first.
        let mut padded = vec![(9 << 3) | 2, 0x88, 0x08];
        padded.extend_from_slice(&[0u8; 1032]);
        padded.extend_from_slice(&payload);
        let mut s = Splitter::new(LIMIT, MAX_USAGE);
        let out = run(&mut s, &framed(0, &padded), 4);
        let kept: Vec<_> = decoded(&out)
            .into_iter()
            .flat_map(|r| r.bucket_quota_usages)
            .collect();
        assert_eq!(kept, vec![usage("a", 1)], "{bad:?}");
        assert_eq!(s.tally().unreadable, 1, "{bad:?}");
    }
}

#[test]
fn usages_before_a_late_domain_go_on_without_it() {
    let mut payload = Vec::new();
    for i in 0..40 {
        payload.extend_from_slice(&report("", vec![usage(&i.to_string(), 1)]).encode_to_vec());
    }
    payload.extend_from_slice(&report("late", vec![]).encode_to_vec());
    for i in 40..80 {
        payload.extend_from_slice(&report("", vec![usage(&i.to_string(), 1)]).encode_to_vec());
    }
    let mut s = Splitter::new(LIMIT, MAX_USAGE);
    let reports = decoded(&run(&mut s, &framed(0, &payload), 9));
    let first_late = reports.iter().position(|r| r.domain == "late").unwrap();
    assert!(reports[..first_late].iter().all(|r| r.domain.is_empty()));
    assert!(reports[first_late..].iter().all(|r| r.domain == "late"));
    let n: usize = reports.iter().map(|r| r.bucket_quota_usages.len()).sum();
    assert_eq!(n, 80);
}

proptest! {
    /// Whatever the usages and however the bytes arrive: every message sent on is within the
    /// limit, and the usages that fit come out in order, each exactly once.
    #[test]
    fn every_report_sent_on_fits_and_loses_nothing_that_fits(
        sizes in proptest::collection::vec(0usize..400, 1..120),
        chunk in 1usize..700,
        limit in 300usize..3000,
    ) {
        let usages: Vec<BucketQuotaUsage> = sizes
            .iter()
            .enumerate()
            .map(|(i, n)| usage(&format!("{i}-{}", "z".repeat(*n)), i as u64))
            .collect();
        let bytes = message(&report("ratelimit", usages.clone()));
        let mut s = Splitter::new(limit, MAX_USAGE);
        let out = run(&mut s, &bytes, chunk);
        if bytes.len() - PREFIX_BYTES <= limit {
            prop_assert_eq!(out, bytes);
            return Ok(());
        }
        for (_, payload) in messages(&out) {
            prop_assert!(payload.len() <= limit);
        }
        let fits = |u: &BucketQuotaUsage| {
            let n = u.encoded_len();
            let field = 1 + encoded_len_varint(n as u64) + n;
            n <= MAX_USAGE && field <= limit - MAX_DOMAIN_FIELD_BYTES
        };
        let kept: Vec<BucketQuotaUsage> = decoded(&out)
            .into_iter()
            .flat_map(|r| r.bucket_quota_usages)
            .collect();
        let expected: Vec<BucketQuotaUsage> = usages.iter().filter(|u| fits(u)).cloned().collect();
        prop_assert_eq!(s.tally().too_large as usize, usages.len() - expected.len());
        prop_assert_eq!(kept, expected);
    }
}

proptest! {
    /// A stream of reports, some within the limit and some over it, however the bytes arrive:
    /// the service reads every usage that fits, in order, in messages within the limit.
    #[test]
    fn a_stream_of_reports_of_every_size_reads_in_order(
        reports in proptest::collection::vec(0usize..60, 1..8),
        chunk in 1usize..2000,
    ) {
        let mut bytes = Vec::new();
        let mut expected = Vec::new();
        for (r, n) in reports.iter().enumerate() {
            let usages: Vec<BucketQuotaUsage> =
                (0..*n).map(|i| usage(&format!("{r}.{i}"), i as u64)).collect();
            bytes.extend(message(&report("d", usages.clone())));
            expected.extend(usages);
        }
        let mut s = Splitter::new(LIMIT, MAX_USAGE);
        let out = run(&mut s, &bytes, chunk);
        for (flag, payload) in messages(&out) {
            prop_assert_eq!(flag, 0);
            prop_assert!(payload.len() <= LIMIT);
        }
        let kept: Vec<BucketQuotaUsage> = decoded(&out)
            .into_iter()
            .flat_map(|r| r.bucket_quota_usages)
            .collect();
        prop_assert_eq!(kept, expected);
        prop_assert_eq!(s.tally().unreadable + s.tally().too_large, 0);
    }
}
