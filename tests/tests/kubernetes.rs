//! The Kubernetes manifests, checked offline (no cluster runs here):
//!
//! - every object of `envoy/kubernetes/` (as `make kubernetes` renders it with the images named)
//!   and of `envoy/istio/` passes the Kubernetes API's own JSON schemas, strictly (an unknown or
//!   misspelt field fails), for the versions they support (`kubernetes-validate`, installed into
//!   `.venv` by `scripts/install-deps.sh`); the Istio kinds, which those schemas lack, are the
//!   only objects not validated, and `istio.rs` checks them;
//! - the plain Kubernetes path's pieces name each other: the policy ConfigMap is
//!   `envoy/limits.yaml`, mounted as a directory; the token is one Secret, a file for the sidecar
//!   and the environment variable the gateway's filter reads; probes reach the ports the
//!   processes listen on; every container has resources; each PodDisruptionBudget selects its
//!   Deployment's pods; the filter's Wasm OCI image is mounted where Envoy loads the module;
//! - the gateway's Envoy config is `envoy/compose/envoy.yaml` with only its addresses, the
//!   module's path and the upstream changed, and a real Envoy loads it (`--mode validate`).

use std::path::{Path, PathBuf};
use std::process::Command;

use ratelimit_e2e::{workspace_root, Envoy};
use serde::Deserialize;
use serde_json::Value;

const SIDECAR_IMAGE: &str = "registry.example.com/ratelimit-sidecar:0.1.0";
const FILTER_IMAGE: &str = "registry.example.com/ratelimit-filter:0.1.0";
/// The Kubernetes versions the plain path supports (image volumes are on by default from 1.35)
/// and the newest the validator knows; the Istio manifests need no image volume.
const PLAIN_VERSIONS: &[&str] = &["1.35.0", "1.37.0"];
const ISTIO_VERSIONS: &[&str] = &["1.30.0", "1.37.0"];
/// Kinds of Istio's own API (CustomResourceDefinitions), which the Kubernetes schemas lack.
const ISTIO_KINDS: &[&str] = &[
    "WasmPlugin",
    "PeerAuthentication",
    "AuthorizationPolicy",
    "RequestAuthentication",
];

/// `make kubernetes` into a fresh directory, with the images named.
fn rendered() -> (tempfile::TempDir, Vec<PathBuf>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = Command::new(workspace_root().join("scripts/kubernetes.sh"))
        .arg(dir.path())
        .env("SIDECAR_IMAGE", SIDECAR_IMAGE)
        .env("FILTER_IMAGE", FILTER_IMAGE)
        .env_remove("ENVOY_IMAGE")
        .env_remove("REDIS_IMAGE")
        .output()
        .expect("run scripts/kubernetes.sh");
    assert!(
        out.status.success(),
        "scripts/kubernetes.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    (dir, files)
}

fn documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .filter(|doc| !doc.is_null())
        .collect()
}

fn all(files: &[PathBuf]) -> Vec<Value> {
    files.iter().flat_map(|f| documents(f)).collect()
}

fn one<'a>(all: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> = all
        .iter()
        .filter(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .collect();
    assert_eq!(found.len(), 1, "exactly one {kind} {name}");
    found[0]
}

fn container<'a>(all: &'a [Value], deployment: &str) -> &'a Value {
    &one(all, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]
}

fn pod_spec<'a>(all: &'a [Value], deployment: &str) -> &'a Value {
    &one(all, "Deployment", deployment)["spec"]["template"]["spec"]
}

/// The validator's verdict on each object of `files`: (file, "kind/name" or the kind it has no
/// schema for, verdict line).
fn validate(files: &[PathBuf], version: &str) -> (bool, Vec<String>) {
    let bin = workspace_root().join(".venv/bin/kubernetes-validate");
    assert!(
        bin.exists(),
        "{} is missing: run scripts/install-deps.sh (make build does)",
        bin.display()
    );
    let out = Command::new(&bin)
        .args(["--strict", "-k", version])
        .args(files)
        .output()
        .expect("run kubernetes-validate");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (
        out.status.success(),
        text.lines().map(str::to_string).collect(),
    )
}

/// Every object of `files` passes the schemas of `version`, but the Istio kinds, which have none.
fn assert_valid(files: &[PathBuf], version: &str) {
    let (ok, lines) = validate(files, version);
    let major_minor = version.rsplit_once('.').unwrap().0;
    for file in files {
        for doc in documents(file) {
            let kind = doc["kind"].as_str().unwrap();
            let name = doc["metadata"]["name"].as_str().unwrap();
            let expected = if ISTIO_KINDS.contains(&kind) {
                format!("Couldn't find schema for kind {kind}")
            } else {
                format!(
                    "passed for resource {}/{name} against version {major_minor}",
                    kind.to_lowercase()
                )
            };
            let file = file.display().to_string();
            assert!(
                lines
                    .iter()
                    .any(|l| l.contains(&file) && l.contains(&expected)),
                "{file}: {kind} {name} against Kubernetes {version}: no `{expected}` in\n{}",
                lines.join("\n")
            );
        }
    }
    assert!(ok, "Kubernetes {version}:\n{}", lines.join("\n"));
}

#[test]
fn every_manifest_passes_the_kubernetes_schemas_of_the_versions_it_supports() {
    let (_dir, plain) = rendered();
    assert_eq!(
        plain
            .iter()
            .map(|f| f.file_name().unwrap().to_str().unwrap())
            .collect::<Vec<_>>(),
        [
            "00-namespace.yaml",
            "10-redis.yaml",
            "20-sidecar.yaml",
            "30-gateway.yaml"
        ],
        "the files, in the order `kubectl apply -f` takes them (docs/kubernetes.md)"
    );
    for version in PLAIN_VERSIONS {
        assert_valid(&plain, version);
    }
    let istio: Vec<PathBuf> = [
        "namespace-and-redis.yaml",
        "sidecar.yaml",
        "wasmplugin.yaml",
        "requestauthentication.yaml",
    ]
    .iter()
    .map(|f| workspace_root().join("envoy/istio").join(f))
    .collect();
    for version in ISTIO_VERSIONS {
        assert_valid(&istio, version);
    }
}

#[test]
fn the_schema_check_refuses_a_misspelt_field_and_a_wrong_type() {
    let (dir, plain) = rendered();
    let sidecar = plain
        .iter()
        .find(|f| f.ends_with("20-sidecar.yaml"))
        .unwrap();
    let text = std::fs::read_to_string(sidecar).unwrap();
    for (from, to) in [
        ("failureThreshold: 2", "failureTreshold: 2"),
        ("replicas: 2", "replicas: two"),
    ] {
        assert!(text.contains(from));
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, text.replacen(from, to, 1)).unwrap();
        let (ok, lines) = validate(&[bad], PLAIN_VERSIONS[0]);
        assert!(!ok, "{to} passed:\n{}", lines.join("\n"));
        assert!(
            lines.iter().any(|l| l.contains("did not validate")),
            "{}",
            lines.join("\n")
        );
    }
}

#[test]
fn make_kubernetes_names_the_images_and_refuses_to_guess_them() {
    let (_dir, plain) = rendered();
    let objects = all(&plain);
    assert_eq!(
        container(&objects, "ratelimit-sidecar")["image"],
        SIDECAR_IMAGE
    );
    assert_eq!(
        container(&objects, "ratelimit-gateway")["image"],
        "envoyproxy/envoy:v1.40.0",
        "the Envoy the tests run"
    );
    let filter = pod_spec(&objects, "ratelimit-gateway")["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "filter")
        .expect("the filter's volume");
    assert_eq!(filter["image"]["reference"], FILTER_IMAGE);
    for file in &plain {
        let text = std::fs::read_to_string(file).unwrap();
        assert!(!text.contains("${"), "{}: a variable left", file.display());
    }

    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(workspace_root().join("scripts/kubernetes.sh"))
        .arg(dir.path())
        .env_remove("SIDECAR_IMAGE")
        .env_remove("FILTER_IMAGE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("SIDECAR_IMAGE=") && err.contains("FILTER_IMAGE="),
        "{err}"
    );
}

#[test]
fn the_sidecar_has_its_policy_as_a_configmap_directory_its_token_from_the_secret_probes_and_a_budget(
) {
    let (_dir, plain) = rendered();
    let objects = all(&plain);
    let policy = one(&objects, "ConfigMap", "ratelimit-limits")["data"]["limits.yaml"]
        .as_str()
        .unwrap();
    let shipped = std::fs::read_to_string(workspace_root().join("envoy/limits.yaml")).unwrap();
    assert_eq!(
        policy, shipped,
        "the ConfigMap's policy is envoy/limits.yaml"
    );
    ratelimit_sidecar::policy::Policy::from_sources(
        &[("limits.yaml".into(), policy.into())],
        &ratelimit_sidecar::policy::Bounds::default(),
    )
    .expect("the sidecar accepts the policy");

    let sidecar = container(&objects, "ratelimit-sidecar");
    let spec = pod_spec(&objects, "ratelimit-sidecar");
    let args: Vec<&str> = sidecar["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let arg = |flag: &str| {
        let i = args
            .iter()
            .position(|a| *a == flag)
            .unwrap_or_else(|| panic!("{flag}"));
        args[i + 1]
    };
    let mount = |volume_kind: &str, name: &str| -> String {
        let volume = spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v[volume_kind].is_object() && v.to_string().contains(name))
            .unwrap_or_else(|| panic!("a {volume_kind} volume of {name}"));
        let m = sidecar["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == volume["name"])
            .expect("mounted");
        assert!(
            m["subPath"].is_null(),
            "a directory: a subPath mount never sees an update"
        );
        m["mountPath"].as_str().unwrap().to_string()
    };
    assert_eq!(
        arg("--limits"),
        format!("{}/limits.yaml", mount("configMap", "ratelimit-limits"))
    );
    assert_eq!(
        arg("--auth-token-file"),
        format!("{}/token", mount("secret", "ratelimit-token"))
    );
    assert_eq!(arg("--admin-listen"), "0.0.0.0:9090");
    let port = |name: &str| -> u64 {
        sidecar["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("port {name}"))
    };
    assert_eq!(port("http-admin"), 9090);
    assert_eq!(port("http"), 8081, "the image's --listen 0.0.0.0:8081");
    assert_eq!(sidecar["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(sidecar["livenessProbe"]["httpGet"]["path"], "/healthz");
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(sidecar[probe]["httpGet"]["port"], "http-admin");
    }
    let service = one(&objects, "Service", "ratelimit-sidecar");
    assert!(service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["port"] == 8081 && p["targetPort"] == "http"));

    // The gateway presents the same Secret's token, from its environment, to the filter.
    let gateway = container(&objects, "ratelimit-gateway");
    let env = gateway["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "RATELIMIT_AUTH_TOKEN")
        .expect("the gateway's RATELIMIT_AUTH_TOKEN");
    assert_eq!(
        env["valueFrom"]["secretKeyRef"],
        serde_json::json!({"name": "ratelimit-token", "key": "token"})
    );
    let config = gateway_config(&objects);
    let plugin = ratelimit_e2e::plugin_json(&config);
    assert_eq!(plugin["sidecar"]["token_env"], "RATELIMIT_AUTH_TOKEN");

    // Every container has requests and a memory limit; each budget selects its pods.
    for deployment in ["redis", "ratelimit-sidecar", "ratelimit-gateway"] {
        let c = container(&objects, deployment);
        assert!(
            c["resources"]["requests"]["cpu"].is_string()
                && c["resources"]["requests"]["memory"].is_string()
                && c["resources"]["limits"]["memory"].is_string(),
            "{deployment}: resources {}",
            c["resources"]
        );
        assert!(c["readinessProbe"].is_object() && c["livenessProbe"].is_object());
    }
    for name in ["ratelimit-sidecar", "ratelimit-gateway"] {
        let pdb = one(&objects, "PodDisruptionBudget", name);
        let deployment = one(&objects, "Deployment", name);
        assert_eq!(
            pdb["spec"]["selector"]["matchLabels"],
            deployment["spec"]["template"]["metadata"]["labels"]
        );
        assert!(
            deployment["spec"]["replicas"].as_u64().unwrap()
                > pdb["spec"]["minAvailable"].as_u64().unwrap()
        );
    }
}

/// The gateway's envoy.yaml, from its ConfigMap.
fn gateway_config(objects: &[Value]) -> String {
    one(objects, "ConfigMap", "ratelimit-gateway")["data"]["envoy.yaml"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn the_gateway_runs_the_compose_envoy_config_with_only_addresses_module_and_upstream_changed() {
    let (_dir, plain) = rendered();
    let objects = all(&plain);
    let text = gateway_config(&objects);
    let mut gateway: Value = serde_yaml_ng::from_str(&text).unwrap();
    let compose: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(workspace_root().join("envoy/compose/envoy.yaml")).unwrap(),
    )
    .unwrap();

    // The module, where the filter's image volume is mounted.
    let spec = pod_spec(&objects, "ratelimit-gateway");
    let mount = container(&objects, "ratelimit-gateway")["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "filter")
        .expect("the filter mounted");
    let module = format!("{}/plugin.wasm", mount["mountPath"].as_str().unwrap());
    assert!(spec["volumes"].to_string().contains(FILTER_IMAGE));
    let wasm = &mut gateway["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"][0]["typed_config"]["config"]["vm_config"]["code"]["local"]
        ["filename"];
    assert_eq!(wasm.as_str(), Some(module.as_str()));
    *wasm = "/etc/envoy/ratelimit_filter.wasm".into();
    // The admin on the pod's loopback (compose publishes its container's on the host's).
    let admin = &mut gateway["admin"]["address"]["socket_address"]["address"];
    assert_eq!(admin, "127.0.0.1");
    *admin = "0.0.0.0".into();
    // The sidecar's Service, and the protected service in place of the demo upstream.
    let clusters = gateway["static_resources"]["clusters"]
        .as_array_mut()
        .unwrap();
    fn address(c: &mut Value) -> &mut Value {
        &mut c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            ["socket_address"]["address"]
    }
    assert_eq!(clusters[0]["name"], "ratelimit_sidecar");
    assert_eq!(
        address(&mut clusters[0]),
        "ratelimit-sidecar.ratelimit.svc.cluster.local"
    );
    *address(&mut clusters[0]) = "sidecar".into();
    assert_eq!(clusters[1]["name"], "service");
    clusters[1]["name"] = "demo_upstream".into();
    clusters[1]["load_assignment"]["cluster_name"] = "demo_upstream".into();
    *address(&mut clusters[1]) = "upstream".into();
    let route = &mut gateway["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"];
    assert_eq!(route, "service");
    *route = "demo_upstream".into();
    assert_eq!(
        gateway, compose,
        "the gateway's envoy.yaml differs from envoy/compose/envoy.yaml in more than its \
         addresses, module path and upstream"
    );

    // A real Envoy loads it (the module from this build, in place of the image volume).
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("envoy.yaml");
    std::fs::write(
        &config,
        text.replace(&module, &Envoy::wasm().display().to_string()),
    )
    .unwrap();
    let out = Command::new(Envoy::bin())
        .args(["--mode", "validate", "-c"])
        .arg(&config)
        .env("RATELIMIT_AUTH_TOKEN", "validate-only")
        .output()
        .expect("run envoy --mode validate");
    assert!(
        out.status.success(),
        "envoy --mode validate:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
