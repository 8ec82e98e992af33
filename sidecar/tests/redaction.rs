//! No secret ever leaves the sidecar: the real binary is started in setups that fail (a wrong
//! password, Redis down, a URL that does not parse, a Sentinel whose primary refuses the
//! password), every endpoint is called, and every output is collected (the process's stdout and
//! stderr at `RUST_LOG=debug`, every answer body): the failure shows, the passwords and tokens
//! do not.

use std::path::Path;

use ratelimit_e2e::{
    decide_body, free_port, http, sidecar_command, wait_until, Redis, RedisOptions, Sentinel,
    SentinelOptions, Sidecar, READY_TIMEOUT,
};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimit-sidecar");

/// Everything one failing sidecar showed.
struct Seen {
    texts: Vec<String>,
}

impl Seen {
    /// Starts the binary with `args` and `env`, polls `/readyz` until its body shows `failure`,
    /// then calls `/metrics`, `/healthz`, a path that does not exist and `/v1/decide` (with the
    /// given `authorization`, if any) and collects every body and the log.
    fn collect(
        args: &[&str],
        env: &[(&str, &str)],
        authorization: Option<&str>,
        failure: &str,
    ) -> Seen {
        let mut env = env.to_vec();
        env.push(("RUST_LOG", "debug"));
        let mut all = vec!["--redis-timeout-ms", "500"];
        all.extend_from_slice(args);
        let mut sidecar = Sidecar::spawn_with_env(Path::new(BIN), free_port(), &all, &env);
        let base = sidecar.base_url();
        sidecar.wait_for(&http(), &format!("{base}/healthz"), 200);
        let mut texts = Vec::new();
        wait_until(&format!("/readyz showing {failure}"), READY_TIMEOUT, || {
            let r = http().get(format!("{base}/readyz")).send().unwrap();
            let text = format!("GET /readyz: {} {}", r.status(), r.text().unwrap());
            let shown = text.contains(failure);
            texts.push(text);
            shown
        });
        for path in ["/metrics", "/healthz", "/nowhere"] {
            let r = http().get(format!("{base}{path}")).send().unwrap();
            texts.push(format!("GET {path}: {} {}", r.status(), r.text().unwrap()));
        }
        for _ in 0..2 {
            let mut post = http()
                .post(format!("{base}/v1/decide"))
                .header("content-type", "application/json")
                .body(decide_body("redaction", 10, 1.0, 1));
            if let Some(a) = authorization {
                post = post.header("authorization", a);
            }
            let r = post.send().unwrap();
            texts.push(format!(
                "POST /v1/decide: {} {}",
                r.status(),
                r.text().unwrap()
            ));
        }
        sidecar.process.stop();
        texts.push(sidecar.process.log());
        Seen { texts }
    }

    fn all(&self) -> String {
        self.texts.join("\n")
    }

    /// The secrets appear nowhere; `visible` (the failure) does somewhere.
    fn assert_hidden(&self, secrets: &[&str], visible: &[&str]) {
        let all = self.all();
        for s in secrets {
            assert!(!all.contains(s), "`{s}` leaked:\n{all}");
        }
        for v in visible {
            assert!(all.contains(v), "the failure (`{v}`) is not shown:\n{all}");
        }
    }
}

#[test]
fn a_wrong_redis_password_shows_as_a_failure_and_never_as_text() {
    let redis = Redis::start_with_options(&RedisOptions::default().password("right-pw-5b0e"));
    // The wrong password in the URL.
    let url = format!("redis://:wrong-pw-in-url-77a1@127.0.0.1:{}", redis.port);
    let seen = Seen::collect(&["--redis", &url], &[], None, "AuthenticationFailed");
    seen.assert_hidden(
        &["wrong-pw-in-url-77a1", "right-pw-5b0e"],
        &[
            "AuthenticationFailed",
            "GET /readyz: 503",
            "POST /v1/decide: 503",
        ],
    );
    // The wrong password from the environment, and a bearer token: neither a wrong nor the
    // right token shows either.
    let seen = Seen::collect(
        &["--redis", &redis.url()],
        &[
            ("RATELIMIT_REDIS_PASSWORD", "wrong-pw-in-env-c3d9"),
            ("RATELIMIT_AUTH_TOKEN", "token-1f2e3d"),
        ],
        Some("Bearer not-the-token-9a8b"),
        "AuthenticationFailed",
    );
    seen.assert_hidden(
        &["wrong-pw-in-env-c3d9", "token-1f2e3d", "not-the-token-9a8b"],
        &[
            "AuthenticationFailed",
            "POST /v1/decide: 401",
            "invalid bearer token",
        ],
    );
}

#[test]
fn redis_down_shows_as_a_failure_and_the_url_without_its_password() {
    // Ports 1 and 2: nothing listens there, and no test's process can take them meanwhile (a
    // free port could be handed to a Redis another test starts).
    let url = "redis://app:down-pw-0c4f@127.0.0.1:1".to_string();
    let seen = Seen::collect(&["--redis", &url], &[], None, "refused");
    seen.assert_hidden(
        &["down-pw-0c4f"],
        &["GET /readyz: 503", "POST /v1/decide: 503", "refused"],
    );
    let seeds = "redis://:cluster-pw-6e2a@127.0.0.1:1,redis://:cluster-pw-6e2a@127.0.0.1:2";
    let seen = Seen::collect(&["--redis-cluster", seeds], &[], None, "redis_ok\":false");
    seen.assert_hidden(
        &["cluster-pw-6e2a"],
        &["GET /readyz: 503", "POST /v1/decide: 503"],
    );
}

#[test]
fn a_url_that_cannot_be_used_is_refused_without_its_password() {
    for args in [
        &["--redis", "redis://:parse-pw-1a2b@[::1"][..],
        &[
            "--redis-cluster",
            "redis://:parse-pw-1a2b@127.0.0.1:1,redis://:other-pw-3c4d@127.0.0.1:2",
        ],
        &[
            "--redis-sentinel",
            "redis://:parse-pw-1a2b@127.0.0.1:1,bogus://:other-pw-3c4d@h:2",
        ],
        &[
            "--redis-sentinel",
            "redis://:parse-pw-1a2b@127.0.0.1:1,redis://:other-pw-3c4d@127.0.0.1:2",
        ],
    ] {
        let out = sidecar_command(Path::new(BIN))
            .args(["--listen", &format!("127.0.0.1:{}", free_port())])
            .args(args)
            .env("RUST_LOG", "debug")
            .output()
            .unwrap();
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.status.success(), "{args:?} started: {all}");
        assert!(all.contains(args[0]), "the flag is named: {all}");
        assert!(all.contains("***@"), "the URL is shown, redacted: {all}");
        for secret in ["parse-pw-1a2b", "other-pw-3c4d"] {
            assert!(!all.contains(secret), "`{secret}` leaked: {all}");
        }
    }
}

#[test]
fn a_sentinel_whose_primary_refuses_the_password_shows_the_failure_and_neither_password() {
    let primary = Redis::start_with_options(&RedisOptions::default().password("primary-pw-8d7c"));
    let sentinel = Sentinel::start_with_options(
        "buckets",
        primary.port,
        1,
        &SentinelOptions {
            password: Some("sentinel-pw-2b3a".into()),
            primary_password: Some("primary-pw-8d7c".into()),
            ..SentinelOptions::default()
        },
    );
    let url = sentinel.url();
    assert!(
        url.contains("sentinel-pw-2b3a"),
        "the Sentinel URL carries its password"
    );
    // No password for the primary: it answers NOAUTH.
    let seen = Seen::collect(
        &["--redis-sentinel", &url, "--sentinel-master", "buckets"],
        &[],
        None,
        "NOAUTH",
    );
    seen.assert_hidden(
        &["sentinel-pw-2b3a", "primary-pw-8d7c"],
        &[
            "GET /readyz: 503",
            "POST /v1/decide: 503",
            "NOAUTH",
            ":***@127.0.0.1",
        ],
    );
    // A wrong one: authentication fails.
    let seen = Seen::collect(
        &["--redis-sentinel", &url, "--sentinel-master", "buckets"],
        &[("RATELIMIT_REDIS_PASSWORD", "wrong-primary-pw-4e5f")],
        None,
        "AuthenticationFailed",
    );
    seen.assert_hidden(
        &[
            "sentinel-pw-2b3a",
            "primary-pw-8d7c",
            "wrong-primary-pw-4e5f",
        ],
        &[
            "GET /readyz: 503",
            "POST /v1/decide: 503",
            "AuthenticationFailed",
        ],
    );
}

/// redis-rs reads a unix socket URL's user and password from its query (`user=`, `pass=`): they
/// are credentials too, in a Sentinel URL (shown by the log and `/readyz` while the Sentinel
/// cannot be reached) and in a `--redis` or `--redis-cluster` URL the sidecar refuses at start.
#[test]
fn credentials_in_a_unix_socket_url_never_show() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nothing-listens-here.sock");
    let socket = socket.display();
    let sentinel = format!("redis+unix://{socket}?user=sentinel-user-5d6e&pass=unix-pw-9f8e");
    let seen = Seen::collect(
        &[
            "--redis-sentinel",
            &sentinel,
            "--sentinel-master",
            "buckets",
        ],
        &[],
        None,
        "nothing-listens-here.sock",
    );
    seen.assert_hidden(
        &["unix-pw-9f8e", "sentinel-user-5d6e"],
        &["GET /readyz: 503", "pass=***", "user=***"],
    );
    for args in [
        vec![
            "--redis".to_string(),
            format!("redis+unix://{socket}?pass=unix-pw-9f8e&protocol=bogus"),
        ],
        vec![
            "--redis-cluster".to_string(),
            format!("redis+unix://{socket}?pass=unix-pw-9f8e"),
        ],
        vec![
            "--redis".to_string(),
            format!("unix://{socket}?password=unix-pw-9f8e&protocol=bogus"),
        ],
    ] {
        let out = sidecar_command(Path::new(BIN))
            .args(["--listen", &format!("127.0.0.1:{}", free_port())])
            .args(&args)
            .env("RUST_LOG", "debug")
            .output()
            .unwrap();
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.status.success(), "{args:?} started: {all}");
        assert!(all.contains(&args[0]), "the flag is named: {all}");
        assert!(all.contains("=***"), "the URL is shown, redacted: {all}");
        assert!(!all.contains("unix-pw-9f8e"), "the password leaked: {all}");
    }
}
