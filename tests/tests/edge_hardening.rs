//! The edge hardening of the shipped configs, at run time: a real Envoy started from
//! `envoy/envoy.yaml` (and from the TLS example, `envoy/envoy-edge-tls.yaml`) in front of a real
//! upstream, with the real sidecar and a real Redis.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use ratelimit_e2e::{
    free_port, http, wait_until, Envoy, EnvoyConfig, Process, Redis, Sidecar, Upstream,
    READY_TIMEOUT,
};
use serde_json::Value;

#[path = "common/tls.rs"]
mod tls;

const ALPHA: (&str, &str) = ("x-api-key", "alpha-key");

/// Redis, the sidecar and the upstream that every Envoy here fronts.
struct Backends {
    _redis: Redis,
    sidecar: Sidecar,
    upstream: Upstream,
}

impl Backends {
    fn start() -> Backends {
        let redis = Redis::start();
        let sidecar = Sidecar::start(&redis.url(), &["--redis-timeout-ms", "500"]);
        Backends {
            _redis: redis,
            sidecar,
            upstream: Upstream::start(),
        }
    }

    fn config(&self, file: &str) -> EnvoyConfig {
        EnvoyConfig::shipped(file, self.sidecar.port, self.upstream.port)
    }
}

/// An Envoy started from a shipped config rendered by the harness and then changed by `edit` (a
/// certificate path, a lower limit), for what the harness does not rewrite.
struct EdgeEnvoy {
    listen_port: u16,
    admin_port: u16,
    _process: Process,
    _dir: tempfile::TempDir,
}

impl EdgeEnvoy {
    fn start(config: &EnvoyConfig, edit: impl FnOnce(String) -> String) -> EdgeEnvoy {
        let dir = tempfile::tempdir().unwrap();
        let (listen_port, admin_port) = (free_port(), free_port());
        let yaml = edit(config.render(
            listen_port,
            admin_port,
            &Envoy::wasm().display().to_string(),
        ));
        let path = dir.path().join("envoy.yaml");
        std::fs::write(&path, yaml).unwrap();
        let mut cmd = Command::new(Envoy::bin());
        cmd.arg("-c")
            .arg(&path)
            .args(["--concurrency", "2", "--disable-hot-restart", "-l", "info"])
            .current_dir(ratelimit_e2e::workspace_root());
        let mut process = Process::spawn(&format!("envoy-{listen_port}"), cmd, dir.path());
        let ready = format!("http://127.0.0.1:{admin_port}/ready");
        let client = http();
        // /ready answers once the workers run, and the listener is bound before them (its port is
        // not probed: a probe would be a connection the connection-limit test counts).
        wait_until("envoy /ready", READY_TIMEOUT, || {
            assert!(
                process.running(),
                "envoy exited during start:\n{}",
                process.log()
            );
            client
                .get(&ready)
                .send()
                .map(|r| r.status() == 200)
                .unwrap_or(false)
        });
        EdgeEnvoy {
            listen_port,
            admin_port,
            _process: process,
            _dir: dir,
        }
    }
}

/// The value of the admin stat `name` (0 when absent).
fn stat(admin_port: u16, name: &str) -> u64 {
    let body = http()
        .get(format!("http://127.0.0.1:{admin_port}/stats"))
        .send()
        .and_then(|r| r.text())
        .expect("admin /stats");
    body.lines()
        .filter_map(|l| l.split_once(": "))
        .find(|(n, _)| *n == name)
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0)
}

/// Whether the admin lists the stat `name`.
fn has_stat(admin_port: u16, name: &str) -> bool {
    http()
        .get(format!("http://127.0.0.1:{admin_port}/stats"))
        .send()
        .and_then(|r| r.text())
        .expect("admin /stats")
        .lines()
        .any(|l| l.split_once(": ").is_some_and(|(n, _)| n == name))
}

fn get(url: &str, headers: &[(&str, &str)]) -> u16 {
    let mut req = http().get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send()
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .status()
        .as_u16()
}

/// The access log lines (JSON objects) Envoy has written to stdout so far.
fn access_log(log: &str) -> Vec<Value> {
    log.lines()
        .filter(|l| l.starts_with('{'))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("response_code").is_some())
        .collect()
}

#[test]
fn a_header_name_with_an_underscore_is_refused_before_the_filter_and_the_upstream() {
    let backends = Backends::start();
    let envoy = Envoy::start(&backends.config("envoy.yaml"));
    let url = envoy.url("/api/orders");

    assert_eq!(get(&url, &[ALPHA]), 200);
    assert_eq!(backends.upstream.hits(), 1);
    let decided = envoy.counter("ratelimit.admitted");

    // `x_api_key` would be `x-api-key` to many upstreams, but is another header to the filter.
    assert_eq!(get(&url, &[("x_api_key", "alpha-key")]), 400);
    assert_eq!(get(&url, &[ALPHA, ("x_forwarded_for", "9.9.9.9")]), 400);
    assert_eq!(backends.upstream.hits(), 1, "nothing reached the upstream");
    assert_eq!(
        envoy.counter("ratelimit.admitted"),
        decided,
        "the filter did not run"
    );
    assert_eq!(
        stat(
            envoy.admin_port,
            "http1.requests_rejected_with_underscores_in_headers"
        ),
        2
    );
}

#[test]
fn every_request_is_logged_on_stdout_as_one_json_line_with_its_response_code_details() {
    let backends = Backends::start();
    let envoy = Envoy::start(&backends.config("envoy.yaml"));

    assert_eq!(get(&envoy.url("/api/logged?token=s3cr3t"), &[ALPHA]), 200);
    assert_eq!(get(&envoy.url("/api/refused"), &[("x_api_key", "k")]), 400);

    // Envoy writes its access log file (stdout here) from a buffer flushed every 10 s by default
    // (--file-flush-interval-msec); the admin's /reopen_logs (what SIGUSR1 does) flushes it now.
    let flush = format!("http://127.0.0.1:{}/reopen_logs", envoy.admin_port);
    assert_eq!(http().post(&flush).send().unwrap().status(), 200);

    let mut lines = Vec::new();
    wait_until("both access log lines", READY_TIMEOUT, || {
        lines = access_log(&envoy.process.log());
        lines.len() >= 2
    });
    let line = |code: u16| {
        lines
            .iter()
            .find(|l| l["response_code"] == code)
            .unwrap_or_else(|| panic!("no access log line with {code} in {lines:?}"))
            .clone()
    };

    let admitted = line(200);
    assert_eq!(admitted["path"], "/api/logged", "without the query string");
    assert_eq!(admitted["response_code"], 200, "{admitted}");
    assert_eq!(admitted["response_code_details"], "via_upstream");
    assert_eq!(admitted["method"], "GET");
    assert_eq!(admitted["protocol"], "HTTP/1.1");
    assert_eq!(admitted["route"], "api");
    assert_eq!(admitted["client"], "127.0.0.1");
    assert!(
        admitted["request_id"]
            .as_str()
            .is_some_and(|id| !id.is_empty()),
        "{admitted}"
    );
    for field in [
        "time",
        "response_flags",
        "upstream_host",
        "duration_ms",
        "bytes_received",
        "bytes_sent",
        "user_agent",
    ] {
        assert!(admitted.get(field).is_some(), "no {field} in {admitted}");
    }
    assert!(
        !envoy.process.log().contains("s3cr3t"),
        "the query string is logged"
    );

    // Refused while its headers were parsed: no method or path yet, but the reason.
    let refused = line(400);
    assert_eq!(refused["response_code"], 400, "{refused}");
    assert_eq!(
        refused["response_code_details"],
        "http1.unexpected_underscore"
    );
}

/// Sends one request on `stream` and returns the status line Envoy answered with, or None when
/// Envoy closed the connection without an answer.
fn status_line(stream: &mut TcpStream) -> Option<String> {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let request = "GET /api/orders HTTP/1.1\r\nhost: edge\r\nx-api-key: alpha-key\r\n\r\n";
    if stream.write_all(request.as_bytes()).is_err() {
        return None;
    }
    let mut answer = Vec::new();
    let mut byte = [0u8; 1];
    while !answer.ends_with(b"\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => answer.push(byte[0]),
            _ => break,
        }
    }
    let line = String::from_utf8_lossy(&answer).trim().to_string();
    (!line.is_empty()).then_some(line)
}

#[test]
fn the_overload_manager_runs_and_the_global_connection_limit_is_enforced() {
    let backends = Backends::start();

    // The shipped config: its resource monitors and actions are live.
    let envoy = Envoy::start(&backends.config("envoy.yaml"));
    for stat in [
        "overload.envoy.resource_monitors.global_downstream_max_connections.pressure",
        "overload.envoy.resource_monitors.fixed_heap.pressure",
        "overload.envoy.overload_actions.shrink_heap.active",
        "overload.envoy.overload_actions.stop_accepting_requests.active",
    ] {
        assert!(has_stat(envoy.admin_port, stat), "no stat {stat}");
    }
    assert_eq!(
        stat(
            envoy.admin_port,
            "overload.envoy.resource_monitors.fixed_heap.failed_updates"
        ),
        0,
        "the heap monitor can read the heap"
    );
    drop(envoy);

    // The same config with room for two connections: the third is closed unanswered.
    let shipped_limit = "max_active_downstream_connections: 50000";
    let envoy = EdgeEnvoy::start(&backends.config("envoy.yaml"), |yaml| {
        assert!(yaml.contains(shipped_limit), "the shipped limit changed");
        yaml.replace(shipped_limit, "max_active_downstream_connections: 2")
    });
    let connect = || TcpStream::connect(("127.0.0.1", envoy.listen_port)).unwrap();
    let (mut first, mut second) = (connect(), connect());
    assert_eq!(status_line(&mut first).as_deref(), Some("HTTP/1.1 200 OK"));
    assert_eq!(status_line(&mut second).as_deref(), Some("HTTP/1.1 200 OK"));
    let mut third = connect();
    assert_eq!(
        status_line(&mut third),
        None,
        "the third connection is refused"
    );
    let overflow = format!(
        "listener.127.0.0.1_{}.downstream_global_cx_overflow",
        envoy.listen_port
    );
    assert!(stat(envoy.admin_port, &overflow) >= 1, "{overflow}");
    // The admin is exempt (ignore_global_conn_limit): it answered the stat above.

    // Once a connection closes, a new one is served again.
    drop(first);
    wait_until("a connection is served again", READY_TIMEOUT, || {
        status_line(&mut connect()).as_deref() == Some("HTTP/1.1 200 OK")
    });
}

/// What curl made of one request to the TLS example.
struct Curl {
    exit_code: i32,
    /// `%{http_version} %{http_code}`, e.g. `2 200`.
    answer: String,
    /// curl's --verbose trace (the TLS handshake, the response headers).
    trace: String,
}

/// curl (built with OpenSSL and nghttp2) against the TLS example's listener, not verifying the
/// test's self-signed certificate.
fn curl(port: u16, args: &[&str]) -> Curl {
    let out = Command::new("curl")
        .args([
            "-skv",
            "--noproxy",
            "*",
            "--max-time",
            "10",
            "-o",
            "/dev/null",
        ])
        .args(["-w", "%{http_version} %{http_code}"])
        .args(args)
        .arg(format!("https://127.0.0.1:{port}/api/orders"))
        .output()
        .expect("run curl");
    Curl {
        exit_code: out.status.code().unwrap_or(-1),
        answer: String::from_utf8_lossy(&out.stdout).into_owned(),
        trace: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[test]
fn the_tls_example_serves_http2_through_alpn_and_refuses_old_protocols_and_ciphers() {
    let backends = Backends::start();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = tls::self_signed(dir.path());
    let envoy = EdgeEnvoy::start(&backends.config("envoy-edge-tls.yaml"), |yaml| {
        tls::with_certificate(&yaml, &cert, &key)
    });
    let port = envoy.listen_port;
    let with_key = |args: &[&'static str]| [args, &["-H", "x-api-key: alpha-key"]].concat();

    let h2 = curl(port, &with_key(&["--http2"]));
    assert_eq!(h2.answer, "2 200", "HTTP/2 through ALPN:\n{}", h2.trace);
    assert!(
        h2.trace.contains("ALPN: server accepted h2"),
        "{}",
        h2.trace
    );
    assert!(
        h2.trace
            .to_lowercase()
            .contains("strict-transport-security: max-age=31536000"),
        "HSTS:\n{}",
        h2.trace
    );
    let h1 = curl(port, &with_key(&["--http1.1"]));
    assert_eq!(h1.answer, "1.1 200", "{}", h1.trace);
    let tls12 = curl(port, &["--tlsv1.2", "--tls-max", "1.2"]);
    assert!(
        tls12.answer.ends_with(" 200") && tls12.trace.contains("SSL connection using TLSv1.2"),
        "TLS 1.2 is served:\n{}",
        tls12.trace
    );

    // Refused by Envoy (its alert is in the trace), not by curl.
    let tls11 = curl(port, &["--tlsv1.1", "--tls-max", "1.1"]);
    assert_ne!(tls11.exit_code, 0);
    assert!(
        tls11.trace.contains("alert protocol version"),
        "TLS 1.1 is not refused by the server:\n{}",
        tls11.trace
    );
    let cbc = curl(
        port,
        &[
            "--tlsv1.2",
            "--tls-max",
            "1.2",
            "--ciphers",
            "ECDHE-ECDSA-AES128-SHA",
        ],
    );
    assert_ne!(cbc.exit_code, 0);
    assert!(
        cbc.trace.contains("alert handshake failure"),
        "a CBC suite is not refused by the server:\n{}",
        cbc.trace
    );

    // Over HTTP/2 a header name with an underscore resets the stream.
    let underscore = curl(port, &["--http2", "-H", "x_api_key: alpha-key"]);
    assert_ne!(underscore.exit_code, 0, "{}", underscore.trace);
    assert_eq!(
        stat(
            envoy.admin_port,
            "http2.requests_rejected_with_underscores_in_headers"
        ),
        1
    );
    assert_eq!(
        backends.upstream.hits(),
        3,
        "only the HTTP/2, HTTP/1.1 and TLS 1.2 requests reached the upstream"
    );
}
