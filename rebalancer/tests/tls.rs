//! `ratelimit-rebalancer` reaches the regions' Redis over TLS with required client certificates
//! (`--redis-ca-file`, `--redis-client-cert`, `--redis-client-key`): its first round writes every
//! region's share record. Without the CA it reaches no region and writes nothing; TLS material
//! with a `redis://` region is refused at start.

use std::process::{Command, Output};

use ratelimit_e2e::redis::RedisOptions;
use ratelimit_e2e::tls::TestPki;
use ratelimit_e2e::Redis;

const SHARE: &str = "rl:share:{ratelimit|global}";
const POLICY: &str =
    "rules:\n  global:\n    capacity: 1000\n    refill_per_sec: 100\n    regions: {eu: 0.5, us: 0.5}\n";

fn rebalance(dir: &std::path::Path, regions: &[(&str, String)], extra: &[String]) -> Output {
    let policy = dir.join("limits.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ratelimit-rebalancer"));
    cmd.arg("--limits")
        .arg(&policy)
        .args(["--once", "--observe-ms", "1"]);
    for (name, url) in regions {
        cmd.args(["--region", &format!("{name}={url}")]);
    }
    cmd.args(extra).env("RUST_LOG", "info").output().unwrap()
}

fn has_record(redis: &Redis) -> bool {
    let fields: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(SHARE)
        .query(&mut redis.connection())
        .unwrap();
    !fields.is_empty()
}

#[test]
fn the_rebalancer_reaches_tls_regions_with_the_ca_and_its_client_certificate() {
    let pki = TestPki::generate();
    let options = RedisOptions::default().tls(&pki);
    let (eu, us) = (
        Redis::start_with_options(&options),
        Redis::start_with_options(&options),
    );
    let regions = [("eu", eu.url()), ("us", us.url())];
    assert!(regions.iter().all(|(_, u)| u.starts_with("rediss://")));
    let dir = tempfile::tempdir().unwrap();

    // Without the CA (the system's roots do not know the test CA) no region is reached.
    let out = rebalance(dir.path(), &regions, &[]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        !has_record(&eu) && !has_record(&us),
        "a region was written without trusting its certificate:\n{log}"
    );

    // With the CA and the client certificate, the first round creates both records.
    let (cert, key) = pki.client_identity().expect("a client identity");
    let tls = vec![
        "--redis-ca-file".to_string(),
        pki.ca.display().to_string(),
        "--redis-client-cert".to_string(),
        cert.display().to_string(),
        "--redis-client-key".to_string(),
        key.display().to_string(),
    ];
    let out = rebalance(dir.path(), &regions, &tls);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the rebalancer failed:\n{log}");
    assert!(
        has_record(&eu) && has_record(&us),
        "the records were not written over TLS:\n{log}"
    );

    // TLS material for a region that is not TLS is a configuration error, named.
    let plain = Redis::start();
    let out = rebalance(dir.path(), &[("eu", eu.url()), ("us", plain.url())], &tls);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "accepted a redis:// region with TLS material"
    );
    assert!(
        log.contains("--region us= is not TLS"),
        "the error does not name the region:\n{log}"
    );
}
