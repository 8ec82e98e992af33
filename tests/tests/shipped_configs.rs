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
