//! The Istio manifests under `envoy/istio/` (no cluster runs here, so they are checked statically):
//! every document parses, and the pieces name each other consistently: the AuthorizationPolicy
//! lets only the gateway reach the sidecar's port, mTLS is STRICT where the sidecar runs, the
//! Deployment reads its policy file from a ConfigMap directory, its token from a Secret and is
//! probed on its admin listener, and the WasmPlugin's callout cluster, authority and token wiring
//! match the Service and the Deployment, and the ConfigMap has envoy/limits.yaml's numbers for the
//! rules the plugin names. `istio_halves.rs` loads the plugin and the policy into a real Envoy and
//! sidecar.

use ratelimit_e2e::workspace_root;
use serde::Deserialize;
use serde_json::Value;

/// Every YAML document of `envoy/istio/<file>`.
fn documents(file: &str) -> Vec<Value> {
    let path = workspace_root().join("envoy/istio").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{file}: not YAML: {e}")))
        .filter(|doc| !doc.is_null())
        .collect()
}

/// All manifests, each checked to be a Kubernetes object.
fn manifests() -> Vec<Value> {
    let mut all = Vec::new();
    for file in [
        "namespace-and-redis.yaml",
        "sidecar.yaml",
        "wasmplugin.yaml",
        "requestauthentication.yaml",
    ] {
        for doc in documents(file) {
            for field in ["apiVersion", "kind"] {
                assert!(doc[field].is_string(), "{file}: a document without {field}");
            }
            assert!(
                doc["metadata"]["name"].is_string(),
                "{file}: a {} without a name",
                doc["kind"]
            );
            all.push(doc);
        }
    }
    all
}

fn one<'a>(all: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> = all
        .iter()
        .filter(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .collect();
    assert_eq!(found.len(), 1, "exactly one {kind} {name}");
    found[0]
}

fn sidecar_container(all: &[Value]) -> &Value {
    &one(all, "Deployment", "ratelimit-sidecar")["spec"]["template"]["spec"]["containers"][0]
}

/// The container port a probe or Service names (by name or number).
fn container_port(container: &Value, port: &Value) -> u64 {
    if let Some(n) = port.as_u64() {
        return n;
    }
    container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == *port)
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port {port}"))
}

fn args(container: &Value) -> String {
    container["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn only_the_ingress_gateway_may_call_the_sidecar_port_over_strict_mtls() {
    let all = manifests();
    let deployment = one(&all, "Deployment", "ratelimit-sidecar");
    let namespace = deployment["metadata"]["namespace"].as_str().unwrap();
    let namespace_doc = one(&all, "Namespace", namespace);
    assert_eq!(
        namespace_doc["metadata"]["labels"]["istio-injection"], "enabled",
        "the sidecar's namespace is in the mesh"
    );

    let peer = all
        .iter()
        .find(|d| d["kind"] == "PeerAuthentication" && d["metadata"]["namespace"] == namespace)
        .expect("a PeerAuthentication for the sidecar's namespace");
    assert_eq!(peer["spec"]["mtls"]["mode"], "STRICT");
    assert!(
        peer["spec"]["selector"].is_null(),
        "namespace-wide: every workload of the namespace"
    );

    let policy = one(&all, "AuthorizationPolicy", "ratelimit-sidecar");
    assert_eq!(policy["metadata"]["namespace"], namespace);
    assert_eq!(policy["spec"]["action"], "ALLOW");
    assert_eq!(
        policy["spec"]["selector"]["matchLabels"],
        deployment["spec"]["template"]["metadata"]["labels"],
        "the policy selects the sidecar's pods"
    );
    let rules = policy["spec"]["rules"].as_array().unwrap();
    assert_eq!(
        rules.len(),
        1,
        "one rule: the gateway, to the decision port"
    );
    let principals = rules[0]["from"][0]["source"]["principals"]
        .as_array()
        .unwrap();
    assert_eq!(principals.len(), 1);
    // cluster.local/ns/<gateway-ns>/sa/<gateway-sa>, the gateway being where the WasmPlugin runs.
    let principal = principals[0].as_str().unwrap();
    let parts: Vec<&str> = principal.split('/').collect();
    assert!(
        parts.len() == 5 && parts[1] == "ns" && parts[3] == "sa" && !parts[4].is_empty(),
        "{principal} is not <trust domain>/ns/<namespace>/sa/<service account>"
    );
    let plugin = one(&all, "WasmPlugin", "ratelimit");
    assert_eq!(
        parts[2],
        plugin["metadata"]["namespace"].as_str().unwrap(),
        "the principal is in the gateway's namespace"
    );
    let container = sidecar_container(&all);
    let decision_port = container_port(container, &Value::from("http"));
    assert_eq!(
        rules[0]["to"][0]["operation"]["ports"],
        serde_json::json!([decision_port.to_string()]),
        "only the decision port"
    );
}

#[test]
fn the_sidecar_reads_its_limits_from_a_configmap_directory_and_its_token_from_a_secret() {
    let all = manifests();
    let deployment = one(&all, "Deployment", "ratelimit-sidecar");
    let pod = &deployment["spec"]["template"]["spec"];
    let container = sidecar_container(&all);

    let args = args(container);
    assert!(
        args.contains("--limits /etc/ratelimit/limits.yaml"),
        "{args}"
    );
    let mount = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == "/etc/ratelimit")
        .expect("a volume mounted at /etc/ratelimit");
    assert!(
        mount["subPath"].is_null(),
        "a subPath mount never sees ConfigMap updates: mount the directory"
    );
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the mounted volume");
    let configmap_name = volume["configMap"]["name"]
        .as_str()
        .expect("a ConfigMap volume");
    let configmap = one(&all, "ConfigMap", configmap_name);
    let limits: Value = serde_yaml_ng::from_str(
        configmap["data"]["limits.yaml"]
            .as_str()
            .expect("the ConfigMap holds limits.yaml"),
    )
    .expect("limits.yaml is YAML");

    // Every rule the filter names has its numbers in the policy file.
    let plugin = one(&all, "WasmPlugin", "ratelimit");
    for rule in plugin["spec"]["pluginConfig"]["rules"].as_array().unwrap() {
        let name = rule["name"].as_str().unwrap();
        let limit = &limits["rules"][name];
        assert!(
            limit["capacity"].is_u64() && limit["refill_per_sec"].is_number(),
            "limits.yaml has no numbers for rule {name}"
        );
    }

    let env = container["env"].as_array().unwrap();
    let token = env
        .iter()
        .find(|e| e["name"] == "RATELIMIT_AUTH_TOKEN")
        .expect("RATELIMIT_AUTH_TOKEN");
    assert!(
        token["valueFrom"]["secretKeyRef"]["name"].is_string() && token.get("value").is_none(),
        "the token comes from a Secret, never inline: {token}"
    );
}

#[test]
fn the_sidecar_listens_on_all_interfaces_and_is_probed_on_its_admin_listener() {
    let all = manifests();
    let container = sidecar_container(&all);
    // The image's ENTRYPOINT listens on 0.0.0.0:8081 (the Deployment appends flags).
    let dockerfile = std::fs::read_to_string(workspace_root().join("sidecar/Dockerfile")).unwrap();
    assert!(dockerfile.contains(
        r#"ENTRYPOINT ["/usr/local/bin/ratelimit-sidecar", "--listen", "0.0.0.0:8081"]"#
    ));
    assert!(container["command"].is_null(), "the ENTRYPOINT is kept");
    assert_eq!(container_port(container, &Value::from("http")), 8081);

    let args = args(container);
    assert!(args.contains("--admin-listen 0.0.0.0:9090"), "{args}");
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe}");
        assert_eq!(
            container_port(container, &get["port"]),
            9090,
            "{probe} on the admin listener"
        );
    }

    let service = one(&all, "Service", "ratelimit-sidecar");
    let ports = service["spec"]["ports"].as_array().unwrap();
    assert_eq!(ports.len(), 1, "only the decision port is a Service port");
    assert_eq!(container_port(container, &ports[0]["targetPort"]), 8081);
}

#[test]
fn the_wasmplugin_calls_the_service_and_hands_the_filter_its_token_from_the_gateway() {
    let all = manifests();
    let plugin = one(&all, "WasmPlugin", "ratelimit");
    let spec = &plugin["spec"];
    let service = one(&all, "Service", "ratelimit-sidecar");
    let (name, namespace) = (
        service["metadata"]["name"].as_str().unwrap(),
        service["metadata"]["namespace"].as_str().unwrap(),
    );
    let port = service["spec"]["ports"][0]["port"].as_u64().unwrap();
    let host = format!("{name}.{namespace}.svc.cluster.local");
    let sidecar = &spec["pluginConfig"]["sidecar"];
    assert_eq!(sidecar["cluster"], format!("outbound|{port}||{host}"));
    assert_eq!(sidecar["authority"], format!("{host}:{port}"));

    // The token: a gateway environment variable (HOST), named by the plugin's sidecar.token_env.
    let token_env = sidecar["token_env"].as_str().expect("sidecar.token_env");
    let env = spec["vmConfig"]["env"]
        .as_array()
        .expect("vmConfig.env")
        .iter()
        .find(|e| e["name"] == token_env)
        .unwrap_or_else(|| panic!("vmConfig.env does not hand {token_env} to the VM"));
    assert_eq!(
        env["valueFrom"], "HOST",
        "never INLINE: the token stays in a Secret"
    );
    assert!(env.get("value").is_none());

    assert!(spec["url"].as_str().unwrap().starts_with("oci://"));
    assert_eq!(spec["failStrategy"], "FAIL_CLOSE");
    // Pinned or not, `sha256` can only be a manifest digest: 64 lowercase hex digits.
    if let Some(sha) = spec.get("sha256").and_then(Value::as_str) {
        assert!(
            sha.len() == 64
                && sha
                    .chars()
                    .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)),
            "sha256: {sha}"
        );
    }
}

#[test]
fn the_configmap_has_envoy_limits_yamls_numbers_for_every_rule_the_plugin_names() {
    let all = manifests();
    let configmap: Value = serde_yaml_ng::from_str(
        one(&all, "ConfigMap", "ratelimit-limits")["data"]["limits.yaml"]
            .as_str()
            .expect("limits.yaml"),
    )
    .expect("the ConfigMap's limits.yaml is YAML");
    let path = workspace_root().join("envoy/limits.yaml");
    let shipped: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&path).expect("envoy/limits.yaml"))
            .expect("envoy/limits.yaml is YAML");
    assert_eq!(configmap["domain"], shipped["domain"]);
    let plugin = &one(&all, "WasmPlugin", "ratelimit")["spec"]["pluginConfig"];
    assert_eq!(plugin["domain"], configmap["domain"]);
    let rules = plugin["rules"].as_array().unwrap();
    let names: Vec<&str> = rules.iter().map(|r| r["name"].as_str().unwrap()).collect();
    let mut configured: Vec<&str> = configmap["rules"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    configured.sort_unstable();
    let mut named = names.clone();
    named.sort_unstable();
    assert_eq!(
        configured, named,
        "the ConfigMap has the rules the plugin names, no others"
    );
    for rule in rules {
        let name = rule["name"].as_str().unwrap();
        let (mine, theirs) = (&configmap["rules"][name], &shipped["rules"][name]);
        for field in ["capacity", "refill_per_sec", "shadow_mode"] {
            assert_eq!(mine[field], theirs[field], "{name}.{field}");
        }
        // The same overrides, but for a bucket of unknown clients where the plugin's rule skips
        // them (`on_unknown: skip`): there it can never apply.
        let skips_unknown = rule["on_unknown"] == "skip";
        let expected: Vec<&Value> = theirs["overrides"]
            .as_array()
            .map(|o| {
                o.iter()
                    .filter(|o| {
                        !(skips_unknown
                            && o["when"].as_object().unwrap().values().all(Value::is_null))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let have: Vec<&Value> = mine["overrides"]
            .as_array()
            .map(|o| o.iter().collect())
            .unwrap_or_default();
        assert_eq!(have, expected, "{name}.overrides");
    }
    // What the manifests promise: clients without a verified user are not one per-user bucket.
    let per_user = rules
        .iter()
        .find(|r| r["name"] == "per-user")
        .expect("per-user");
    assert_eq!(
        per_user["on_unknown"], "skip",
        "API-key and anonymous clients skip per-user"
    );
}
