//! TLS, for real, on both sides of the sidecar binary: its listener (HTTPS with HTTP/1.1 and
//! HTTP/2, client certificates required with `--tls-client-ca`, h2c on plain TCP, a plain admin
//! listener), and its connections to Redis (`rediss://` to one node, a Cluster and the primary
//! Sentinel names, with a CA, a client certificate and a password), against redis-server started
//! with `--tls-port`. Certificates are made by the test ([`TestPki`]).

use std::path::Path;

use ratelimit_e2e::{
    bucket_key, decide_body, free_port, http, sidecar_command, Redis, RedisCluster, RedisOptions,
    Sentinel, SentinelOptions, Sidecar, TestPki,
};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_ratelimit-sidecar");

fn key(name: &str) -> String {
    format!("{name}-{:x}", rand::random::<u64>())
}

/// The sidecar binary with `args` and an admin listener; waits until the admin listener's
/// `/readyz` answers 200. Returns it with the admin listener's base URL.
fn start_ready(args: &[&str]) -> (Sidecar, String) {
    let admin_port = free_port();
    let admin = format!("127.0.0.1:{admin_port}");
    let mut all = vec!["--admin-listen", &admin, "--redis-timeout-ms", "2000"];
    all.extend_from_slice(args);
    let mut sidecar = Sidecar::spawn(Path::new(BIN), free_port(), &all);
    let base = format!("http://{admin}");
    sidecar.wait_for(&http(), &format!("{base}/readyz"), 200);
    (sidecar, base)
}

/// POSTs one decision; the answer's status, HTTP version and JSON.
fn decide(
    client: &reqwest::blocking::Client,
    base: &str,
    key: &str,
) -> reqwest::Result<(u16, reqwest::Version, Value)> {
    let r = client
        .post(format!("{base}/v1/decide"))
        .header("content-type", "application/json")
        .body(decide_body(key, 10, 0.001, 1))
        .send()?;
    let (status, version) = (r.status().as_u16(), r.version());
    Ok((status, version, r.json()?))
}

fn remaining(a: &Value) -> u64 {
    a["answers"][0]["results"][0]["remaining"]
        .as_u64()
        .expect("remaining")
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn with_client_certificates_required_only_callers_with_a_certificate_from_the_ca_are_served() {
    let pki = TestPki::generate();
    let redis = Redis::start();
    let url = redis.url();
    let mut flags = vec!["--redis", url.as_str()];
    let mtls = pki.sidecar_mtls_args();
    flags.extend(args(&mtls));
    let (sidecar, admin) = start_ready(&flags);
    let base = format!("https://localhost:{}", sidecar.port);
    let k = key("mtls");

    // ALPN picks HTTP/2 when the client offers it, HTTP/1.1 otherwise.
    let h2 = pki.https_client(pki.client_identity());
    let (status, version, a) = decide(&h2, &base, &k).unwrap();
    assert_eq!((status, version), (200, reqwest::Version::HTTP_2), "{a}");
    assert_eq!(remaining(&a), 9);
    let h1 = pki
        .https_client_builder(pki.client_identity())
        .http1_only()
        .build()
        .unwrap();
    let (status, version, a) = decide(&h1, &base, &k).unwrap();
    assert_eq!((status, version), (200, reqwest::Version::HTTP_11), "{a}");
    assert_eq!(remaining(&a), 8);

    // No certificate, a certificate from another CA, plain HTTP: no answer at all.
    let anonymous = pki.https_client(None);
    let e = decide(&anonymous, &base, &k).unwrap_err();
    assert!(e.is_connect() || e.is_request(), "{e:?}");
    let impostor = pki.https_client(Some((&pki.impostor_cert, &pki.impostor_key)));
    decide(&impostor, &base, &k).unwrap_err();
    let plain = format!("http://127.0.0.1:{}", sidecar.port);
    decide(&http(), &plain, &k).unwrap_err();

    let log = sidecar.process.log();
    assert!(log.contains("TLS handshake refused"), "{log}");
    let (status, _, a) = decide(&h2, &base, &k).unwrap();
    assert_eq!(
        (status, remaining(&a)),
        (200, 7),
        "the refused callers spent nothing: {a}"
    );
    // Probes and Prometheus use the plain admin listener; it serves nothing else.
    for path in ["/healthz", "/readyz", "/metrics"] {
        let r = http().get(format!("{admin}{path}")).send().unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
    let r = http()
        .post(format!("{admin}/v1/decide"))
        .body(decide_body(&k, 10, 0.001, 1))
        .send()
        .unwrap();
    assert_eq!(r.status(), 404);
}

#[test]
fn tls_without_client_ca_serves_any_https_caller_and_plain_tcp_speaks_h2c() {
    let pki = TestPki::generate();
    let redis = Redis::start();
    let cert = pki.server_cert.display().to_string();
    let tls_key = pki.server_key.display().to_string();
    let url = redis.url();
    let (sidecar, _) = start_ready(&["--redis", &url, "--tls-cert", &cert, "--tls-key", &tls_key]);
    let (status, version, _) = decide(
        &pki.https_client(None),
        &format!("https://127.0.0.1:{}", sidecar.port),
        &key("tls"),
    )
    .unwrap();
    assert_eq!((status, version), (200, reqwest::Version::HTTP_2));

    let (plain, _) = start_ready(&["--redis", &url]);
    let h2c = reqwest::blocking::Client::builder()
        .http2_prior_knowledge()
        .no_proxy()
        .build()
        .unwrap();
    let (status, version, a) = decide(&h2c, &plain.base_url(), &key("h2c")).unwrap();
    assert_eq!((status, version), (200, reqwest::Version::HTTP_2), "{a}");
}

/// Runs the binary with `args` expecting it to refuse to start; its stderr.
fn refused(args: &[&str]) -> String {
    let out = sidecar_command(Path::new(BIN))
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "started with {args:?}: {stderr}");
    stderr
}

#[test]
fn unusable_certificate_files_are_refused_naming_the_flag_and_the_path() {
    let pki = TestPki::generate();
    let p = |p: &Path| p.display().to_string();
    let (cert, server_key, client_key, ca) = (
        p(&pki.server_cert),
        p(&pki.server_key),
        p(&pki.client_key),
        p(&pki.ca),
    );
    let e = refused(&[
        "--tls-cert",
        "/nonexistent/cert.pem",
        "--tls-key",
        &server_key,
    ]);
    assert!(e.contains("--tls-cert /nonexistent/cert.pem"), "{e}");
    let e = refused(&["--tls-cert", &cert, "--tls-key", &client_key]);
    assert!(
        e.contains(&format!("--tls-key {client_key}")) && e.contains("does not match"),
        "{e}"
    );
    let e = refused(&["--tls-cert", &cert, "--tls-key", &cert]);
    assert!(e.contains(&format!("--tls-key {cert}")), "{e}");
    let e = refused(&[
        "--tls-cert",
        &cert,
        "--tls-key",
        &server_key,
        "--tls-client-ca",
        &server_key,
    ]);
    assert!(e.contains(&format!("--tls-client-ca {server_key}")), "{e}");
    let e = refused(&[
        "--redis",
        "rediss://127.0.0.1:1",
        "--redis-ca-file",
        "/nonexistent/ca.pem",
    ]);
    assert!(e.contains("--redis-ca-file /nonexistent/ca.pem"), "{e}");
    let e = refused(&[
        "--redis",
        "rediss://127.0.0.1:1",
        "--redis-client-cert",
        &cert,
        "--redis-client-key",
        &client_key,
    ]);
    assert!(
        e.contains(&format!("--redis-client-key {client_key}")),
        "{e}"
    );
    let e = refused(&["--redis", "redis://127.0.0.1:1", "--redis-ca-file", &ca]);
    assert!(
        e.contains("rediss://"),
        "a CA for a plain URL would go unused: {e}"
    );
    let e = refused(&["--redis-password-file", "/nonexistent/password"]);
    assert!(
        e.contains("--redis-password-file /nonexistent/password"),
        "{e}"
    );
}

#[test]
fn a_tls_only_redis_that_requires_client_certificates_and_a_password_is_used_over_rediss() {
    let pki = TestPki::generate();
    let password = "tls-redis-password";
    let redis = Redis::start_with_options(&RedisOptions::default().tls(&pki).password(password));
    let password_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(password_file.path(), format!("{password}\n")).unwrap();
    let url = redis.url();
    assert!(url.starts_with("rediss://"));
    let pw = password_file.path().display().to_string();
    let tls = pki.sidecar_redis_args();
    let mut flags = vec!["--redis", url.as_str(), "--redis-password-file", &pw];
    flags.extend(args(&tls));
    let (sidecar, _) = start_ready(&flags);
    let k = key("rediss");
    let (status, _, a) = decide(&http(), &sidecar.base_url(), &k).unwrap();
    assert_eq!(status, 200, "{a}");
    assert_eq!(redis.cli(&["EXISTS", &bucket_key(&k, 10, 0.001)]), "1");

    // Without the client certificate Redis refuses the handshake: not ready, decisions 503.
    let ca = pki.ca.display().to_string();
    let mut without_cert = Sidecar::spawn(
        Path::new(BIN),
        free_port(),
        &[
            "--redis",
            &url,
            "--redis-password-file",
            &pw,
            "--redis-ca-file",
            &ca,
        ],
    );
    let base = without_cert.base_url();
    without_cert.wait_for(&http(), &format!("{base}/healthz"), 200);
    let ready = http().get(format!("{base}/readyz")).send().unwrap();
    assert_eq!(ready.status(), 503);
    let (status, _, a) = decide(&http(), &base, &k).unwrap();
    assert_eq!(status, 503, "{a}");
}

#[test]
fn a_tls_cluster_is_used_over_rediss_with_the_client_certificate() {
    let pki = TestPki::generate();
    let cluster = RedisCluster::start_with_options(&RedisOptions::default().tls(&pki));
    let seeds = cluster.seeds();
    let tls = pki.sidecar_redis_args();
    let mut flags = vec!["--redis-cluster", seeds.as_str()];
    flags.extend(args(&tls));
    let (sidecar, _) = start_ready(&flags);
    // Random keys spread over the three primaries: decide until every shard holds some (12 keys
    // at least; 60 leave a shard empty with a chance of about 1e-10).
    let sizes = || -> Vec<usize> {
        cluster
            .nodes
            .iter()
            // Buckets only (`rl:{...}`): each node also holds the store's epoch marker.
            .map(|n| {
                n.cli(&["KEYS", "rl:{*"])
                    .lines()
                    .filter(|l| !l.is_empty())
                    .count()
            })
            .collect()
    };
    let mut decided = 0;
    while decided < 12 || (decided < 60 && sizes().contains(&0)) {
        let k = key(&format!("c{decided}"));
        let (status, _, a) = decide(&http(), &sidecar.base_url(), &k).unwrap();
        assert_eq!((status, remaining(&a)), (200, 9), "{a}");
        decided += 1;
    }
    let sizes = sizes();
    assert!(
        sizes.iter().sum::<usize>() >= decided,
        "a key per decision: {sizes:?}"
    );
    assert!(!sizes.contains(&0), "every shard decided some: {sizes:?}");
}

/// A primary that requires a password, its replica and three Sentinels, optionally all on TLS.
struct Monitored {
    primary: Redis,
    _replica: Redis,
    sentinels: Vec<Sentinel>,
}

const MASTER: &str = "buckets";

impl Monitored {
    fn start(password: &str, tls: Option<&TestPki>) -> Monitored {
        let mut options = RedisOptions::default().password(password);
        if let Some(pki) = tls {
            options = options.tls(pki);
        }
        let primary = Redis::start_with_options(&options);
        let replica = Redis::start_with_options(&options.clone().args(&[
            "--replicaof",
            "127.0.0.1",
            &primary.port.to_string(),
        ]));
        ratelimit_e2e::wait_until(
            "the replica's link to the primary",
            std::time::Duration::from_secs(30),
            || {
                replica
                    .cli(&["INFO", "replication"])
                    .contains("master_link_status:up")
            },
        );
        let sentinel_options = SentinelOptions {
            tls: tls.cloned(),
            primary_password: Some(password.to_string()),
            ..SentinelOptions::default()
        };
        let sentinels = (0..3)
            .map(|_| Sentinel::start_with_options(MASTER, primary.port, 2, &sentinel_options))
            .collect();
        Monitored {
            primary,
            _replica: replica,
            sentinels,
        }
    }

    fn urls(&self) -> String {
        self.sentinels
            .iter()
            .map(Sentinel::url)
            .collect::<Vec<_>>()
            .join(",")
    }
}

#[test]
fn through_sentinel_the_primary_gets_the_password() {
    let password = "primary-password-4d1";
    let m = Monitored::start(password, None);
    let urls = m.urls();
    let (sidecar, _) = start_ready(&[
        "--redis-sentinel",
        &urls,
        "--sentinel-master",
        MASTER,
        "--redis-password",
        password,
    ]);
    let k = key("sentinel-auth");
    let (status, _, a) = decide(&http(), &sidecar.base_url(), &k).unwrap();
    assert_eq!(status, 200, "{a}");
    assert_eq!(m.primary.cli(&["EXISTS", &bucket_key(&k, 10, 0.001)]), "1");
}

#[test]
fn through_tls_sentinels_the_primary_gets_tls_the_client_certificate_and_the_password() {
    let pki = TestPki::generate();
    let password = "primary-password-9e7";
    let m = Monitored::start(password, Some(&pki));
    let urls = m.urls();
    assert!(urls.starts_with("rediss://"));
    let tls = pki.sidecar_redis_args();
    let mut flags = vec![
        "--redis-sentinel",
        urls.as_str(),
        "--sentinel-master",
        MASTER,
    ];
    flags.extend(args(&tls));
    // The password from the environment this time.
    let admin = format!("127.0.0.1:{}", free_port());
    flags.extend(["--admin-listen", &admin, "--redis-timeout-ms", "2000"]);
    let mut sidecar = Sidecar::spawn_with_env(
        Path::new(BIN),
        free_port(),
        &flags,
        &[("RATELIMIT_REDIS_PASSWORD", password)],
    );
    sidecar.wait_for(&http(), &format!("http://{admin}/readyz"), 200);
    let k = key("sentinel-tls");
    let (status, _, a) = decide(&http(), &sidecar.base_url(), &k).unwrap();
    assert_eq!(status, 200, "{a}");
    assert_eq!(m.primary.cli(&["EXISTS", &bucket_key(&k, 10, 0.001)]), "1");
}

#[test]
fn a_refused_password_shows_in_readyz_and_the_sidecar_recovers_once_redis_accepts_it() {
    let redis = Redis::start_with_options(&RedisOptions::default().password("before-rotation"));
    let url = redis.url();
    let mut sidecar = Sidecar::spawn(
        Path::new(BIN),
        free_port(),
        &[
            "--redis",
            &url,
            "--redis-password",
            "after-rotation",
            "--redis-timeout-ms",
            "2000",
        ],
    );
    let base = sidecar.base_url();
    sidecar.wait_for(&http(), &format!("{base}/healthz"), 200);
    ratelimit_e2e::wait_until(
        "/readyz naming the refusal",
        ratelimit_e2e::READY_TIMEOUT,
        || {
            let r = http().get(format!("{base}/readyz")).send().unwrap();
            r.status() == 503 && r.text().unwrap().contains("AuthenticationFailed")
        },
    );
    // The server side of a rotation: Redis now wants the sidecar's password.
    assert_eq!(
        redis.cli(&["CONFIG", "SET", "requirepass", "after-rotation"]),
        "OK"
    );
    sidecar.wait_for(&http(), &format!("{base}/readyz"), 200);
    let (status, _, a) = decide(&http(), &base, &key("rotated")).unwrap();
    assert_eq!(status, 200, "{a}");
}

#[test]
fn with_optional_client_certificates_the_ca_alone_reaches_a_tls_redis() {
    let pki = TestPki::generate();
    let redis = Redis::start_with_options(
        &RedisOptions::default()
            .tls(&pki)
            .tls_auth_clients("optional"),
    );
    let (url, ca) = (redis.url(), pki.ca.display().to_string());
    let (sidecar, _) = start_ready(&["--redis", &url, "--redis-ca-file", &ca]);
    let (status, _, a) = decide(&http(), &sidecar.base_url(), &key("ca-only")).unwrap();
    assert_eq!(status, 200, "{a}");
}

#[test]
fn an_acl_user_and_its_password_from_the_flags_reach_redis() {
    use redis::Commands;
    let redis = Redis::start();
    assert_eq!(
        redis.cli(&[
            "ACL",
            "SETUSER",
            "limiter",
            "on",
            ">acl-pw-3e1d",
            "~rl:*",
            "+@all"
        ]),
        "OK"
    );
    // The default user needs a password too now, so only the ACL user gets in.
    assert_eq!(
        redis.cli(&["CONFIG", "SET", "requirepass", "default-pw-0f9a"]),
        "OK"
    );
    let url = redis.url();
    let (sidecar, _) = start_ready(&[
        "--redis",
        &url,
        "--redis-username",
        "limiter",
        "--redis-password",
        "acl-pw-3e1d",
    ]);
    let k = key("acl");
    let (status, _, a) = decide(&http(), &sidecar.base_url(), &k).unwrap();
    assert_eq!(status, 200, "{a}");
    let check = redis::Client::open(format!(
        "redis://limiter:acl-pw-3e1d@127.0.0.1:{}",
        redis.port
    ))
    .unwrap()
    .get_connection()
    .unwrap()
    .exists::<_, bool>(bucket_key(&k, 10, 0.001))
    .unwrap();
    assert!(check, "written as the ACL user");
}
