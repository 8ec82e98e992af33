//! The configs shipped for operators are valid for the pinned Envoy and stay in step with each other.

use std::process::Command;

use ratelimit_e2e::{plugin_json, workspace_root, Envoy};

fn read(path: &str) -> String {
    std::fs::read_to_string(workspace_root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `envoy --mode validate` on a config, with the wasm path pointed at the built module.
fn validate(path: &str, wasm_in_config: &str) {
    let dir = tempfile::tempdir().unwrap();
    let yaml = read(path).replace(wasm_in_config, &Envoy::wasm().display().to_string());
    let file = dir.path().join("envoy.yaml");
    std::fs::write(&file, yaml).unwrap();
    let out = Command::new(Envoy::bin())
        .args(["--mode", "validate", "-c"])
        .arg(&file)
        .args(["--disable-hot-restart", "-l", "error"])
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
    let local = "target/wasm32-wasip1/release/ratelimit_filter.wasm";
    validate("envoy/envoy.yaml", local);
    validate("envoy/envoy-jwt.yaml", local);
    validate(
        "envoy/compose/envoy.yaml",
        "/etc/envoy/ratelimit_filter.wasm",
    );
}

#[test]
fn the_compose_config_carries_the_same_plugin_configuration_as_the_local_one() {
    assert_eq!(
        plugin_json(&read("envoy/compose/envoy.yaml")),
        plugin_json(&read("envoy/envoy.yaml"))
    );
}
