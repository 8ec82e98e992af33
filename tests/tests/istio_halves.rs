//! The two halves of the Istio deployment that run without a cluster, loaded as Istio hands them
//! over, then tried as the manifests' comments say each kind of client is limited:
//! - the `WasmPlugin`'s `pluginConfig` (`envoy/istio/wasmplugin.yaml`) as the JSON Istio
//!   serializes it to, in a real Envoy with the module under the root id of its `pluginName`,
//!   the callout cluster named as Istio names the sidecar Service's
//!   (`outbound|8081||ratelimit-sidecar.ratelimit.svc.cluster.local`), the verified JWT payload
//!   under the key `payload` (Istio 1.21 and later), and the token from Envoy's own environment
//!   (`vmConfig.env` `valueFrom: HOST`);
//! - the sidecar as its `Deployment` (`envoy/istio/sidecar.yaml`) runs it: its args and
//!   environment, the ConfigMap's `limits.yaml` in a directory of its own.
//!
//! Envoy's config around the plugin is `envoy/envoy-jwt.yaml` (jwt_authn with the test key, as
//! a `RequestAuthentication` gives the gateway). The static checks of the manifests are in
//! `istio.rs`.

use std::process::Command;
use std::time::{Duration, Instant};

use ratelimit_e2e::scenario::{get, Answer, ALPHA};
use ratelimit_e2e::{
    free_port, http, signed_jwt, wait_until, workspace_root, Envoy, EnvoyConfig, Process, Redis,
    Sidecar, Upstream, JWT_ISSUER, READY_TIMEOUT,
};
use serde::Deserialize;
use serde_json::Value;

/// The cluster name Istio gives the gateway for the sidecar's Service.
const ISTIO_CLUSTER: &str = "outbound|8081||ratelimit-sidecar.ratelimit.svc.cluster.local";

fn documents(file: &str) -> Vec<Value> {
    let path = workspace_root().join("envoy/istio").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{file}: {e}")))
        .filter(|doc| !doc.is_null())
        .collect()
}

fn one(docs: &[Value], kind: &str) -> Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
        .clone()
}

/// The sidecar as the Deployment runs it: the image's ENTRYPOINT (`--listen 0.0.0.0:8081`) and
/// the container's args, with the pod's paths and ports made this machine's, and its environment
/// with the Secret's token and this test's Redis.
/// Returns the process, its decision port and its admin port.
fn sidecar_as_deployed(redis: &Redis, token: &str, dir: &std::path::Path) -> (Process, u16, u16) {
    let docs = documents("sidecar.yaml");
    let limits = one(&docs, "ConfigMap")["data"]["limits.yaml"]
        .as_str()
        .expect("the ConfigMap's limits.yaml")
        .to_string();
    let policy_dir = dir.join("etc-ratelimit");
    std::fs::create_dir_all(&policy_dir).expect("the policy directory");
    std::fs::write(policy_dir.join("limits.yaml"), limits).expect("write limits.yaml");
    let container = &one(&docs, "Deployment")["spec"]["template"]["spec"]["containers"][0];
    let (port, admin) = (free_port(), free_port());
    let mut cmd = Command::new(Sidecar::bin());
    cmd.args(["--listen", &format!("127.0.0.1:{port}")]);
    for arg in container["args"].as_array().expect("args") {
        let arg = arg.as_str().expect("a string");
        cmd.arg(match arg {
            "/etc/ratelimit/limits.yaml" => policy_dir.join("limits.yaml").display().to_string(),
            "0.0.0.0:9090" => format!("127.0.0.1:{admin}"),
            other => other.to_string(),
        });
    }
    for env in container["env"].as_array().expect("env") {
        let name = env["name"].as_str().expect("a name");
        let value = match (name, env["value"].as_str()) {
            ("RATELIMIT_REDIS", _) => redis.url(),
            (_, Some(v)) => v.to_string(),
            ("RATELIMIT_AUTH_TOKEN", None) => token.to_string(),
            (_, None) => panic!("{name}: from where?"),
        };
        cmd.env(name, value);
    }
    let mut process = Process::spawn("sidecar", cmd, dir);
    let ready = format!("http://127.0.0.1:{admin}/readyz");
    wait_until(
        "the sidecar's /readyz on its admin listener",
        READY_TIMEOUT,
        || {
            assert!(process.running(), "the sidecar exited:\n{}", process.log());
            http().get(&ready).send().is_ok_and(|r| r.status() == 200)
        },
    );
    (process, port, admin)
}

/// Envoy with the pluginConfig as Istio hands it to the module.
fn gateway(sidecar_port: u16, upstream_port: u16) -> Envoy {
    let plugin = one(&documents("wasmplugin.yaml"), "WasmPlugin");
    let spec = &plugin["spec"];
    assert_eq!(spec["pluginConfig"]["sidecar"]["cluster"], ISTIO_CLUSTER);
    let root_id = spec["pluginName"].as_str().expect("pluginName");
    let env_keys: Vec<&str> = spec["vmConfig"]["env"]
        .as_array()
        .expect("vmConfig.env")
        .iter()
        .filter(|e| e["valueFrom"] == "HOST")
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    let provider = spec["pluginConfig"]["identity"]["jwt"]["provider"]
        .as_str()
        .expect("identity.jwt.provider");
    let json = serde_json::to_string_pretty(&spec["pluginConfig"]).expect("JSON");
    let config = EnvoyConfig::shipped("envoy-jwt.yaml", sidecar_port, upstream_port)
        .replace("root_id: ratelimit\n", &format!("root_id: {root_id}\n"))
        .replace(
            "payload_in_metadata: example",
            &format!("payload_in_metadata: {provider}"),
        )
        .replace(
            "- name: ratelimit_sidecar\n",
            &format!("- name: \"{ISTIO_CLUSTER}\"\n"),
        )
        .replace(
            "cluster_name: ratelimit_sidecar\n",
            &format!("cluster_name: \"{ISTIO_CLUSTER}\"\n"),
        )
        .replace(
            "runtime: envoy.wasm.runtime.v8\n",
            &format!(
                "runtime: envoy.wasm.runtime.v8\n                  environment_variables: {{ host_env_keys: {env_keys:?} }}\n"
            ),
        )
        .plugin(&json);
    Envoy::start(&config)
}

/// `n` requests one after the other on one connection.
fn sequence(
    envoy: &Envoy,
    path: &str,
    headers: &[(&str, &str)],
    n: usize,
) -> (Vec<Answer>, Duration) {
    let client = http();
    let start = Instant::now();
    let answers = (0..n)
        .map(|_| get(&client, &envoy.url(path), headers))
        .collect();
    (answers, start.elapsed())
}

fn statuses(answers: &[Answer]) -> Vec<u16> {
    answers.iter().map(|a| a.status).collect()
}

/// (requests the emergency buckets admitted, limiter errors) so far.
fn by_emergency(envoy: &Envoy) -> (u64, u64) {
    (
        envoy.counter("ratelimit.emergency_activations")
            - envoy.counter("ratelimit.emergency_rejected"),
        envoy.counter("ratelimit.limiter_error"),
    )
}

fn since(now: (u64, u64), before: (u64, u64)) -> (u64, u64) {
    (now.0 - before.0, now.1 - before.1)
}

/// `capacity` admitted first, then 429 from `rule` with its limit `q=capacity`; never more than
/// the bucket gave (`capacity + refill·T`, and what an emergency bucket admitted meanwhile).
fn limited_by(
    answers: &[Answer],
    t: Duration,
    (emergency, errors): (u64, u64),
    rule: &str,
    capacity: usize,
    refill: f64,
) {
    let admitted = answers.iter().filter(|a| a.status == 200).count();
    let refilled = (t.as_secs_f64() * refill).floor() as usize;
    println!(
        "  {rule}: {admitted} of {} admitted in {t:.2?} (capacity {capacity}, {refilled} refilled, {emergency} by the emergency bucket)",
        answers.len()
    );
    // A callout that timed out (this machine is busy; the timeout is 50 ms) was answered by the
    // emergency bucket and its charge may still have been taken: only without one are the first
    // `capacity` sure to pass.
    if errors == 0 {
        assert!(
            answers[..capacity].iter().all(|a| a.status == 200),
            "the first {capacity} pass: {:?}",
            statuses(answers)
        );
    } else {
        assert!(
            admitted + errors as usize >= capacity,
            "{:?}",
            statuses(answers)
        );
    }
    assert!(
        admitted <= capacity + refilled + emergency as usize,
        "over-admission: {:?}",
        statuses(answers)
    );
    let limited = answers.iter().find(|a| a.status == 429).expect("a 429");
    assert!(
        limited.body.contains(&format!("\"rule\":\"{rule}\"")),
        "the 429 names {rule}: {}",
        limited.body
    );
    let policy = limited
        .header("ratelimit-policy")
        .expect("RateLimit-Policy");
    assert!(policy.contains(&format!("q={capacity}")), "{policy}");
    assert!(limited.header("retry-after").is_some(), "Retry-After");
}

#[test]
fn the_wasmplugin_and_the_configmap_as_istio_hands_them_limit_each_kind_of_client_by_its_own_rule()
{
    let dir = tempfile::tempdir().expect("temp dir");
    let token = format!("istio-test-token-{}", std::process::id());
    let redis = Redis::start();
    let (mut sidecar, sidecar_port, admin) = sidecar_as_deployed(&redis, &token, dir.path());
    let upstream = Upstream::start();
    // The gateway pod's environment: vmConfig.env `valueFrom: HOST` hands this to the module.
    // (The only test of this file, so no other thread reads the environment meanwhile.)
    std::env::set_var("RATELIMIT_AUTH_TOKEN", &token);
    let envoy = gateway(sidecar_port, upstream.port);

    // Anonymous clients (no key, no token) outside /api/: per-user does not apply, per-ip does.
    println!("anonymous, /orders:");
    let (anonymous, _) = sequence(&envoy, "/orders", &[], 40);
    assert!(
        anonymous.iter().all(|a| a.status == 200),
        "40 anonymous requests, limited per address (1000 + 100/s), not in one per-user bucket: {:?}",
        statuses(&anonymous)
    );
    assert_eq!(
        envoy.counter("ratelimit.rule.per-user.admitted"),
        0,
        "per-user skipped them"
    );
    assert_eq!(envoy.counter("ratelimit.rule.per-ip.admitted"), 40);

    // An API-key client: its app's bucket, 100 + 10/s; never a per-user bucket.
    println!("the demo API key, /api/:");
    let emergency = by_emergency(&envoy);
    let (keyed, t) = sequence(&envoy, "/api/hello", &[ALPHA], 150);
    limited_by(
        &keyed,
        t,
        since(by_emergency(&envoy), emergency),
        "per-app",
        100,
        10.0,
    );
    assert!(
        keyed.iter().all(|a| !a.body.contains("per-user")),
        "no API-key request answered by per-user"
    );
    assert_eq!(envoy.counter("ratelimit.rule.per-user.admitted"), 0);

    // Keyless requests on /api/ share the unknown-apps bucket of the ConfigMap's override.
    println!("no key, /api/:");
    let emergency = by_emergency(&envoy);
    let (keyless, t) = sequence(&envoy, "/api/hello", &[], 60);
    limited_by(
        &keyless,
        t,
        since(by_emergency(&envoy), emergency),
        "per-app",
        50,
        5.0,
    );

    // A user with a verified JWT: a bucket of their own (20 + 2/s); another user is untouched.
    println!("a verified user, /orders:");
    let alice = format!(
        "Bearer {}",
        signed_jwt(&serde_json::json!({"iss": JWT_ISSUER, "sub": "alice"}))
    );
    let emergency = by_emergency(&envoy);
    let (user, t) = sequence(&envoy, "/orders", &[("authorization", &alice)], 30);
    limited_by(
        &user,
        t,
        since(by_emergency(&envoy), emergency),
        "per-user",
        20,
        2.0,
    );
    let bob = format!(
        "Bearer {}",
        signed_jwt(&serde_json::json!({"iss": JWT_ISSUER, "sub": "bob"}))
    );
    let (other, _) = sequence(&envoy, "/orders", &[("authorization", &bob)], 5);
    assert!(
        other.iter().all(|a| a.status == 200),
        "bob's own bucket: {:?}",
        statuses(&other)
    );

    // The callouts went through the cluster of Istio's name, with the token from the gateway's
    // environment: the sidecar answered them all and refused none.
    let stats = http()
        .get(format!(
            "http://127.0.0.1:{}/stats?filter=outbound",
            envoy.admin_port
        ))
        .send()
        .and_then(|r| r.text())
        .expect("Envoy's stats");
    let to_sidecar = stats
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cluster.{ISTIO_CLUSTER}.upstream_rq_200: ")))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    let metrics = http()
        .get(format!("http://127.0.0.1:{admin}/metrics"))
        .send()
        .and_then(|r| r.text())
        .expect("the sidecar's metrics");
    // Decisions ride each worker's stream (`stream`, a token refused there counted there too).
    let calls = |api: &str, outcome: &str| {
        metrics
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!(
                    "ratelimit_calls_total{{api=\"{api}\",outcome=\"{outcome}\"}} "
                ))
            })
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    println!(
        "{to_sidecar} callouts through {ISTIO_CLUSTER}; the sidecar answered {} and refused {}",
        calls("stream", "answered"),
        calls("stream", "unauthorized")
    );
    assert!(
        to_sidecar > 0,
        "no callout through {ISTIO_CLUSTER}:\n{stats}"
    );
    assert!(calls("stream", "answered") > 0.0);
    assert_eq!(
        calls("stream", "unauthorized") + calls("http", "unauthorized"),
        0.0,
        "the token from the environment was refused"
    );
    assert!(sidecar.running(), "the sidecar exited:\n{}", sidecar.log());
}
