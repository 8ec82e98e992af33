//! The configs shipped for operators are valid for the pinned Envoy, carry the edge hardening of
//! Envoy's "Configuring Envoy as an edge proxy", and stay in step with each other.

use std::process::Command;

use ratelimit_e2e::{workspace_root, Envoy};
use serde_json::{json, Value};

#[path = "common/tls.rs"]
mod tls;

/// The wasm path in the local configs and in the compose one.
const LOCAL_WASM: &str = "target/wasm32-wasip1/release/ratelimit_filter.wasm";
const COMPOSE_WASM: &str = "/etc/envoy/ratelimit_filter.wasm";

/// Every Envoy config shipped for an edge Envoy.
const EDGE_CONFIGS: [&str; 7] = [
    "envoy/envoy.yaml",
    "envoy/envoy-jwt.yaml",
    "envoy/compose/envoy.yaml",
    "envoy/envoy-edge-tls.yaml",
    "envoy/envoy-native-ratelimit.yaml",
    "envoy/envoy-rlqs.yaml",
    "envoy/envoy-llm.yaml",
];

fn read(path: &str) -> String {
    std::fs::read_to_string(workspace_root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn yaml(path: &str) -> Value {
    serde_yaml_ng::from_str(&read(path)).unwrap_or_else(|e| panic!("{path}: not YAML: {e}"))
}

/// `path` with its wasm path (`wasm_in_config`) pointed at the built module.
fn with_built_wasm(path: &str, wasm_in_config: &str) -> String {
    let yaml = read(path);
    assert!(
        yaml.contains(wasm_in_config),
        "{path} no longer contains `{wasm_in_config}`"
    );
    yaml.replace(wasm_in_config, &Envoy::wasm().display().to_string())
}

/// `envoy --mode validate` on a config. The wasm module is loaded with its plugin configuration
/// during validation, and TLS certificates are read. The compose config's plugin reads its
/// bearer token from Envoy's environment (`sidecar.token_env`), so one is set.
fn validate(path: &str, yaml: String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("envoy.yaml");
    std::fs::write(&file, yaml).unwrap();
    let out = Command::new(Envoy::bin())
        .args(["--mode", "validate", "-c"])
        .arg(&file)
        .args(["--disable-hot-restart", "-l", "error"])
        .env("RATELIMIT_AUTH_TOKEN", "a-token-for-validation")
        .current_dir(workspace_root())
        .output()
        .expect("run envoy --mode validate");
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{path} does not validate:\n{log}");
}

#[test]
fn every_shipped_envoy_config_validates_with_the_filter_loaded() {
    for path in ["envoy/envoy.yaml", "envoy/envoy-jwt.yaml"] {
        validate(path, with_built_wasm(path, LOCAL_WASM));
    }
    // Envoy's native rate limit filter instead of the wasm one: nothing to load.
    let native = "envoy/envoy-native-ratelimit.yaml";
    validate(native, read(native));
    let compose = "envoy/compose/envoy.yaml";
    validate(compose, with_built_wasm(compose, COMPOSE_WASM));
    // The TLS example, with a certificate made for the test in place of its placeholders.
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = tls::self_signed(dir.path());
    let path = "envoy/envoy-edge-tls.yaml";
    validate(
        path,
        tls::with_certificate(&with_built_wasm(path, LOCAL_WASM), &cert, &key),
    );
}

/// The edge listener's HTTP connection manager.
fn connection_manager(config: &Value) -> &Value {
    let filters = &config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"];
    let hcm = filters
        .as_array()
        .and_then(|f| {
            f.iter()
                .find(|f| f["name"] == "envoy.filters.network.http_connection_manager")
        })
        .expect("the listener has an HTTP connection manager");
    &hcm["typed_config"]
}

/// The settings Envoy's edge guide asks for, as one config has them.
fn hardening(config: &Value) -> Value {
    let listener = &config["static_resources"]["listeners"][0];
    let hcm = connection_manager(config);
    let clusters: Vec<Value> = config["static_resources"]["clusters"]
        .as_array()
        .expect("clusters")
        .iter()
        .map(|c| json!([c["name"], c["per_connection_buffer_limit_bytes"]]))
        .collect();
    let mut connection_manager = serde_json::Map::new();
    for field in [
        "use_remote_address",
        "xff_num_trusted_hops",
        "normalize_path",
        "merge_slashes",
        "path_with_escaped_slashes_action",
        "preserve_external_request_id",
        "request_headers_timeout",
        "stream_idle_timeout",
        "request_timeout",
        "common_http_protocol_options",
        "http2_protocol_options",
        "access_log",
    ] {
        connection_manager.insert(field.to_string(), hcm[field].clone());
    }
    json!({
        "admin.ignore_global_conn_limit": config["admin"]["ignore_global_conn_limit"],
        "overload_manager": config["overload_manager"],
        "listener.enable_reuse_port": listener["enable_reuse_port"],
        "listener.per_connection_buffer_limit_bytes": listener["per_connection_buffer_limit_bytes"],
        "clusters.per_connection_buffer_limit_bytes": clusters,
        "connection_manager": connection_manager,
    })
}

#[test]
fn every_edge_config_has_the_hardening_of_envoy_yaml() {
    let reference = hardening(&yaml("envoy/envoy.yaml"));
    for path in EDGE_CONFIGS {
        assert_eq!(
            hardening(&yaml(path)),
            reference,
            "{path}: the edge hardening differs from envoy/envoy.yaml's"
        );
    }
}

#[test]
fn the_hardening_is_what_envoys_edge_guide_asks_for() {
    let config = yaml("envoy/envoy.yaml");
    let om = &config["overload_manager"];
    let monitor = |name: &str| {
        om["resource_monitors"]
            .as_array()
            .and_then(|m| m.iter().find(|m| m["name"] == name))
            .unwrap_or_else(|| panic!("no resource monitor {name}"))
            .clone()
    };
    let connections = monitor("envoy.resource_monitors.global_downstream_max_connections");
    assert!(
        connections["typed_config"]["max_active_downstream_connections"]
            .as_u64()
            .is_some_and(|n| n > 0),
        "{connections}"
    );
    monitor("envoy.resource_monitors.fixed_heap");
    let actions: Vec<&str> = om["actions"]
        .as_array()
        .expect("overload actions")
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    for action in [
        "envoy.overload_actions.shrink_heap",
        "envoy.overload_actions.stop_accepting_requests",
    ] {
        assert!(actions.contains(&action), "no {action} in {actions:?}");
    }
    assert_eq!(config["admin"]["ignore_global_conn_limit"], true);

    let listener = &config["static_resources"]["listeners"][0];
    assert_eq!(listener["per_connection_buffer_limit_bytes"], 32768);
    assert_eq!(listener["enable_reuse_port"], false);
    for cluster in config["static_resources"]["clusters"].as_array().unwrap() {
        assert_eq!(
            cluster["per_connection_buffer_limit_bytes"], 32768,
            "cluster {}",
            cluster["name"]
        );
    }

    let hcm = connection_manager(&config);
    assert_eq!(hcm["use_remote_address"], true);
    assert_eq!(hcm["normalize_path"], true);
    assert_eq!(hcm["merge_slashes"], true);
    for timeout in [
        "request_headers_timeout",
        "stream_idle_timeout",
        "request_timeout",
    ] {
        assert!(hcm[timeout].is_string(), "{timeout} is not set");
    }
    let common = &hcm["common_http_protocol_options"];
    assert!(common["idle_timeout"].is_string(), "idle_timeout");
    assert_eq!(common["headers_with_underscores_action"], "REJECT_REQUEST");
    assert!(common["max_headers_count"].is_u64(), "max_headers_count");
    let h2 = &hcm["http2_protocol_options"];
    assert_eq!(h2["max_concurrent_streams"], 100);
    assert_eq!(h2["initial_stream_window_size"], 65536);
    assert_eq!(h2["initial_connection_window_size"], 1048576);

    let log = &hcm["access_log"][0];
    assert_eq!(log["name"], "envoy.access_loggers.stdout");
    let format = log["typed_config"]["log_format"].to_string();
    for operator in ["%RESPONSE_CODE%", "%RESPONSE_CODE_DETAILS%"] {
        assert!(format.contains(operator), "the access log lacks {operator}");
    }
}

#[test]
fn the_tls_example_offers_tls_1_2_and_up_and_http2_with_placeholder_certificates() {
    let config = yaml("envoy/envoy-edge-tls.yaml");
    let chain = &config["static_resources"]["listeners"][0]["filter_chains"][0];
    let socket = &chain["transport_socket"];
    assert_eq!(socket["name"], "envoy.transport_sockets.tls");
    let tls = &socket["typed_config"]["common_tls_context"];
    assert_eq!(tls["tls_params"]["tls_minimum_protocol_version"], "TLSv1_2");
    for suite in tls["tls_params"]["cipher_suites"].as_array().unwrap() {
        let suite = suite.as_str().unwrap();
        assert!(
            suite.starts_with("ECDHE-") && (suite.contains("GCM") || suite.contains("CHACHA20")),
            "{suite}: not a forward-secret AEAD suite"
        );
    }
    assert_eq!(tls["alpn_protocols"], json!(["h2", "http/1.1"]));
    let certificate = &tls["tls_certificates"][0];
    assert_eq!(
        certificate["certificate_chain"]["filename"],
        tls::PLACEHOLDER_CHAIN
    );
    assert_eq!(certificate["private_key"]["filename"], tls::PLACEHOLDER_KEY);
    // Otherwise the example is envoy.yaml: the same plugin configuration and filters.
    assert_eq!(
        ratelimit_e2e::plugin_json(&read("envoy/envoy-edge-tls.yaml")),
        ratelimit_e2e::plugin_json(&read("envoy/envoy.yaml"))
    );
}

/// The HTTP filters of a config, by name, in order.
fn http_filter_names(config: &Value) -> Vec<String> {
    connection_manager(config)["http_filters"]
        .as_array()
        .expect("http_filters")
        .iter()
        .map(|f| f["name"].as_str().expect("filter name").to_string())
        .collect()
}

/// A cluster's settings without what says where it is (address, and how it is resolved).
fn cluster_without_address(config: &Value, name: &str) -> Value {
    let mut cluster = config["static_resources"]["clusters"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no cluster {name}"))
        .clone();
    let fields = cluster.as_object_mut().unwrap();
    for addressing in ["load_assignment", "type", "dns_lookup_family"] {
        fields.remove(addressing);
    }
    cluster
}

#[test]
fn the_compose_config_is_the_local_one_but_for_addresses() {
    let (compose, local) = (read("envoy/compose/envoy.yaml"), read("envoy/envoy.yaml"));
    // The same plugin configuration, but for the bearer token: the compose sidecar listens on
    // 0.0.0.0 and requires one, the local stack's sidecar is on loopback.
    let mut compose_plugin = ratelimit_e2e::plugin_json(&compose);
    assert_eq!(
        compose_plugin["sidecar"]["token_env"], "RATELIMIT_AUTH_TOKEN",
        "the compose filter sends the sidecar's token"
    );
    compose_plugin["sidecar"]
        .as_object_mut()
        .expect("sidecar")
        .remove("token_env");
    assert_eq!(
        compose_plugin,
        ratelimit_e2e::plugin_json(&local),
        "plugin configuration"
    );
    let (compose, local) = (yaml("envoy/compose/envoy.yaml"), yaml("envoy/envoy.yaml"));
    assert_eq!(
        http_filter_names(&compose),
        http_filter_names(&local),
        "HTTP filter chain"
    );
    assert_eq!(
        cluster_without_address(&compose, "ratelimit_sidecar"),
        cluster_without_address(&local, "ratelimit_sidecar"),
        "the sidecar's cluster"
    );
    // The hardening is compared for every edge config above.
}

// ---------------------------------------------------------------------------------------------
// Identity from verified facts only, in every file under envoy/: a client names itself neither
// by a request header nor by a query parameter it sent (README, "Identity: what names a client").

/// The matcher input a bucket id or a descriptor may take its value from at the edge: the
/// address Envoy computed. (Dynamic metadata, where jwt_authn puts verified claims, is no string
/// to Envoy 1.40's matcher inputs: no id is built and the request passes unlimited, docs/rlqs.md
/// fact 10; Envoy's rate limit filter reads claims with its `metadata` action instead.)
const TRUSTED_INPUTS: [&str; 1] =
    ["type.googleapis.com/envoy.extensions.matching.common_inputs.network.v3.SourceIPInput"];
const METADATA_INPUT: &str =
    "type.googleapis.com/envoy.extensions.matching.common_inputs.network.v3.DynamicMetadataInput";

/// Filters whose dynamic metadata may name a client or carry a cost: jwt_authn's verified claims,
/// and what the sidecar answered (Envoy's rate limit filter, for a settlement).
const TRUSTED_METADATA: [&str; 2] = [
    "envoy.filters.http.jwt_authn",
    "envoy.filters.http.ratelimit",
];

/// Actions of Envoy's rate limit filter (`rate_limits[].actions[]`) whose descriptor values come
/// from no client input, or only a fixed value chosen by a match (the rest are checked below).
const FIXED_OR_VERIFIED_ACTIONS: [&str; 7] = [
    "generic_key",
    "remote_address",
    "masked_remote_address",
    "destination_cluster",
    "source_cluster",
    "header_value_match",
    "query_parameter_value_match",
];

/// What one walk over the files checked, and what it found wrong.
#[derive(Default)]
struct IdentityCheck {
    bucket_ids: usize,
    actions: usize,
    plugins: usize,
    problems: Vec<String>,
}

impl IdentityCheck {
    fn walk(&mut self, at: &str, v: &Value) {
        match v {
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    self.walk(&format!("{at}[{i}]"), item);
                }
            }
            Value::Object(fields) => {
                if fields.get("kind") == Some(&json!("WasmPlugin")) {
                    self.plugin(
                        &format!("{at}.spec.pluginConfig"),
                        &v["spec"]["pluginConfig"],
                    );
                }
                if fields.get("@type")
                    == Some(&json!(
                        "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
                    ))
                {
                    let value = &v["config"]["configuration"]["value"];
                    let at = format!("{at}.config.configuration.value");
                    match value.as_str().map(serde_json::from_str::<Value>) {
                        Some(Ok(plugin)) => self.plugin(&at, &plugin),
                        _ => self.problems.push(format!("{at}: not a plugin JSON")),
                    }
                }
                for (k, field) in fields {
                    let here = format!("{at}.{k}");
                    match k.as_str() {
                        "bucket_id_builder" if field.get("bucket_id_builder").is_some() => {
                            self.bucket_id(&here, &field["bucket_id_builder"])
                        }
                        "rate_limits" => {
                            for (i, entry) in field.as_array().into_iter().flatten().enumerate() {
                                self.actions(&format!("{here}[{i}].actions"), &entry["actions"]);
                            }
                        }
                        _ => {}
                    }
                    self.walk(&here, field);
                }
            }
            _ => {}
        }
    }

    /// An RLQS bucket id: each `custom_value` from a trusted input.
    fn bucket_id(&mut self, at: &str, builder: &Value) {
        for (key, value) in builder.as_object().into_iter().flatten() {
            self.bucket_ids += 1;
            if let Some(input) = value.get("custom_value") {
                self.input(&format!("{at}.{key}.custom_value"), input);
            }
        }
    }

    /// A matcher input (`{name, typed_config}`) used as identity.
    fn input(&mut self, at: &str, input: &Value) {
        let kind = input["typed_config"]["@type"].as_str().unwrap_or_default();
        if kind == METADATA_INPUT {
            self.problems.push(format!(
                "{at}: dynamic metadata is no string to Envoy 1.40's matcher inputs: no id is \
                 built, and the request passes unlimited"
            ));
        } else if !TRUSTED_INPUTS.contains(&kind) {
            self.problems.push(format!(
                "{at}: identity from {kind:?}, which a client can set (only {TRUSTED_INPUTS:?})"
            ));
        }
    }

    fn metadata(&mut self, at: &str, filter: Option<&str>) {
        if !filter.is_some_and(|f| TRUSTED_METADATA.contains(&f)) {
            self.problems.push(format!(
                "{at}: metadata of {filter:?}, not of {TRUSTED_METADATA:?}"
            ));
        }
    }

    /// The actions of one `rate_limits` entry of Envoy's rate limit filter.
    fn actions(&mut self, at: &str, actions: &Value) {
        for (i, action) in actions.as_array().into_iter().flatten().enumerate() {
            for (kind, config) in action.as_object().into_iter().flatten() {
                self.actions += 1;
                let at = format!("{at}[{i}].{kind}");
                match kind.as_str() {
                    k if FIXED_OR_VERIFIED_ACTIONS.contains(&k) => {}
                    "metadata" | "dynamic_metadata" => {
                        self.metadata(&at, config["metadata_key"]["key"].as_str())
                    }
                    "extension" => self.input(&at, config),
                    _ => self.problems.push(format!(
                        "{at}: a descriptor from what the client sent (request_headers, \
                         query_parameters) or from an action this check does not know"
                    )),
                }
            }
        }
    }

    /// The wasm filter's configuration: the filter itself accepts it, and its only identity from
    /// a header is an API key checked against configured hashes.
    fn plugin(&mut self, at: &str, plugin: &Value) {
        self.plugins += 1;
        if let Err(e) = ratelimit_filter::config::Config::from_json(plugin.to_string().as_bytes()) {
            self.problems
                .push(format!("{at}: the filter refuses it: {e}"));
        }
        for (source, config) in plugin["identity"].as_object().into_iter().flatten() {
            match source.as_str() {
                "jwt" | "ip" | "ipv6_prefix_len" => {}
                "api_key" if config["keys"].as_object().is_some_and(|k| !k.is_empty()) => {}
                _ => self.problems.push(format!(
                    "{at}.identity.{source}: not a verified source (jwt, ip, api_key with keys)"
                )),
            }
        }
    }
}

/// The YAML documents of a file (Kubernetes manifests hold several).
fn documents(text: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|doc| serde::Deserialize::deserialize(doc).expect("YAML"))
        .collect()
}

/// Every YAML file under `dir`, relative to the workspace root.
fn yaml_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            yaml_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(path);
        }
    }
}

/// The problems of `text`, a file of one or more YAML documents.
fn identity_problems(name: &str, text: &str) -> IdentityCheck {
    let mut check = IdentityCheck::default();
    for (i, doc) in documents(text).iter().enumerate() {
        check.walk(&format!("{name}#{i}"), doc);
    }
    check
}

#[test]
fn no_shipped_config_takes_identity_from_what_the_client_sent() {
    let root = workspace_root();
    let mut files = Vec::new();
    yaml_files(&root.join("envoy"), &mut files);
    files.sort();
    let mut all = IdentityCheck::default();
    for path in &files {
        let name = path.strip_prefix(&root).unwrap().display().to_string();
        let check = identity_problems(&name, &read(&name));
        all.bucket_ids += check.bucket_ids;
        all.actions += check.actions;
        all.plugins += check.plugins;
        all.problems.extend(check.problems);
    }
    println!(
        "{} files: {} bucket id entries, {} rate limit actions, {} plugin configurations",
        files.len(),
        all.bucket_ids,
        all.actions,
        all.plugins
    );
    assert!(files.iter().any(|f| f.ends_with("istio/wasmplugin.yaml")));
    assert!(all.bucket_ids > 0 && all.actions > 0 && all.plugins >= 5);
    assert!(all.problems.is_empty(), "{}", all.problems.join("\n"));
}

#[test]
fn the_identity_check_finds_each_way_a_client_could_name_itself() {
    let header = "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput";
    let hostile = [
        // An RLQS bucket id from jwt_authn's metadata (envoy-rlqs.yaml once had it: never built).
        format!(
            "bucket_id_builder:\n  bucket_id_builder:\n    tenant:\n      custom_value:\n        \
             name: t\n        typed_config:\n          \"@type\": {METADATA_INPUT}\n          \
             filter: envoy.filters.http.jwt_authn\n          path: [{{key: example}}, {{key: tenant}}]\n"
        ),
        // An RLQS bucket id from a header (the x-tenant matcher envoy-rlqs.yaml once had).
        format!(
            "bucket_id_builder:\n  bucket_id_builder:\n    rule: {{string_value: r}}\n    \
             tenant:\n      custom_value:\n        name: t\n        typed_config:\n          \
             \"@type\": {header}\n          header_name: x-tenant\n"
        ),
        // Envoy's rate limit filter: a raw header, a query parameter, a header input.
        "rate_limits:\n- actions:\n  - request_headers: {header_name: x-user, descriptor_key: user}\n"
            .to_string(),
        "rate_limits:\n- actions:\n  - query_parameters: {query_parameter_name: u, descriptor_key: u}\n"
            .to_string(),
        format!(
            "rate_limits:\n- actions:\n  - extension:\n      name: u\n      typed_config:\n        \
             \"@type\": {header}\n        header_name: x-user\n"
        ),
        // Metadata another filter may have copied from a header.
        "rate_limits:\n- actions:\n  - metadata: {descriptor_key: u, metadata_key: {key: \
         envoy.filters.http.header_to_metadata, path: [{key: u}]}}\n"
            .to_string(),
        // The wasm filter's configuration with an identity it does not know.
        "kind: WasmPlugin\nspec:\n  pluginConfig:\n    sidecar: {cluster: s}\n    identity: \
         {header: x-user}\n    rules: []\n"
            .to_string(),
    ];
    for yaml in &hostile {
        let check = identity_problems("hostile", yaml);
        assert!(!check.problems.is_empty(), "not found:\n{yaml}");
    }
    // And what the shipped configs do is accepted.
    let verified = "rate_limits:\n- actions:\n  - generic_key: {descriptor_key: rule, \
                    descriptor_value: per-ip}\n  - remote_address: {}\n  - metadata: \
                    {descriptor_key: user, metadata_key: {key: envoy.filters.http.jwt_authn, \
                    path: [{key: example}, {key: sub}]}}\n";
    assert!(identity_problems("verified", verified).problems.is_empty());
}
