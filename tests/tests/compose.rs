//! `envoy/docker-compose.yml`, checked statically (`compose_stack.rs` starts it for real, with
//! `make compose-test`): it parses, every long-running service has a health check and starts only
//! once what it needs is healthy, its default images are pinned to exact versions, the files it
//! mounts or builds from exist, and it agrees with `envoy/compose/envoy.yaml` on names, ports,
//! paths and the sidecar's token. `envoy/docker-compose.distributed.yml` runs the same images,
//! Envoy config and sidecar (`compose_distributed.rs` starts it).

use std::path::{Path, PathBuf};

use ratelimit_e2e::workspace_root;
use serde_json::Value;

/// Files another change adds to the repository: checked once they exist, reported until then.
/// (The lead writes the sidecar's policy file, `envoy/limits.yaml`.)
const WRITTEN_ELSEWHERE: &[&str] = &["envoy/limits.yaml"];

fn envoy_dir() -> PathBuf {
    workspace_root().join("envoy")
}

fn compose() -> Value {
    let path = envoy_dir().join("docker-compose.yml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("docker-compose.yml: not YAML: {e}"))
}

fn compose_envoy() -> Value {
    let text = std::fs::read_to_string(envoy_dir().join("compose/envoy.yaml")).unwrap();
    serde_yaml_ng::from_str(&text).expect("compose/envoy.yaml is YAML")
}

fn services(compose: &Value) -> Vec<(String, Value)> {
    compose["services"]
        .as_object()
        .expect("services")
        .iter()
        .map(|(name, s)| (name.clone(), s.clone()))
        .collect()
}

/// Services `up` starts (those in a profile run only on demand).
fn long_running(compose: &Value) -> Vec<(String, Value)> {
    services(compose)
        .into_iter()
        .filter(|(_, s)| s.get("profiles").is_none())
        .collect()
}

/// The strings of a service's list field (`command`, `ports`, `volumes`).
fn strings(service: &Value, field: &str) -> Vec<String> {
    service[field]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|v| v.as_str().expect("a string").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// The value a `${VAR:-default}` stands for when VAR is not set (a plain value is itself).
fn default_of(value: &str) -> &str {
    match value.strip_prefix("${") {
        Some(rest) => rest
            .split_once(":-")
            .and_then(|(_, default)| default.strip_suffix('}'))
            .unwrap_or_else(|| panic!("{value}: a variable without a default")),
        None => value,
    }
}

/// (host path relative to envoy/, container path) of a service's bind mounts; a host path taken
/// from a variable is its default.
fn mounts(service: &Value) -> Vec<(String, String)> {
    strings(service, "volumes")
        .iter()
        .map(|v| {
            let (host, rest) = match v.strip_prefix("${") {
                Some(_) => {
                    let end = v.find('}').expect("a closing }") + 1;
                    (default_of(&v[..end]), &v[end + 1..])
                }
                None => v.split_once(':').expect("host:container"),
            };
            let container = rest.split(':').next().unwrap();
            (host.to_string(), container.to_string())
        })
        .collect()
}

/// A path of the compose file (relative to envoy/) as a path relative to the repository root.
fn repo_relative(host: &str) -> String {
    let joined = Path::new("envoy").join(host);
    let mut parts: Vec<String> = Vec::new();
    for c in joined.components() {
        match c.as_os_str().to_str().unwrap() {
            "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part.to_string()),
        }
    }
    parts.join("/")
}

#[test]
fn every_service_has_a_health_check_and_waits_for_what_it_needs_to_be_healthy() {
    let compose = compose();
    let running = long_running(&compose);
    let names: Vec<&str> = running.iter().map(|(n, _)| n.as_str()).collect();
    for expected in ["redis", "sidecar", "upstream", "envoy"] {
        assert!(names.contains(&expected), "no service {expected}");
    }
    for (name, service) in &running {
        let test = service["healthcheck"]["test"]
            .as_array()
            .unwrap_or_else(|| panic!("{name}: no healthcheck.test"));
        assert_eq!(test[0], "CMD", "{name}: exec form, no shell needed");
        let depends = &service["depends_on"];
        if depends.is_null() {
            continue;
        }
        let depends = depends
            .as_object()
            .unwrap_or_else(|| panic!("{name}: depends_on must name conditions"));
        for (on, how) in depends {
            assert!(
                names.contains(&on.as_str()),
                "{name} depends on {on}, which `up` does not start"
            );
            assert_eq!(how["condition"], "service_healthy", "{name} -> {on}");
        }
    }
    let needs = |name: &str| -> Vec<String> {
        compose["services"][name]["depends_on"]
            .as_object()
            .map(|d| d.keys().cloned().collect())
            .unwrap_or_default()
    };
    assert_eq!(needs("sidecar"), ["redis"]);
    assert_eq!(needs("envoy"), ["sidecar", "upstream"]);
}

#[test]
fn images_are_pinned_to_exact_versions() {
    let compose = compose();
    let install =
        std::fs::read_to_string(workspace_root().join("scripts/install-deps.sh")).unwrap();
    let tested_envoy = install
        .lines()
        .find_map(|l| l.strip_prefix("ENVOY_VERSION=\"${ENVOY_VERSION:-"))
        .and_then(|rest| rest.strip_suffix("}\""))
        .expect("ENVOY_VERSION in scripts/install-deps.sh");
    for (name, service) in services(&compose) {
        let image = default_of(
            service["image"]
                .as_str()
                .unwrap_or_else(|| panic!("{name}: no image")),
        );
        let (_, tag) = image
            .rsplit_once(':')
            .unwrap_or_else(|| panic!("{name}: {image} has no tag"));
        if service.get("build").is_some() {
            assert!(!tag.is_empty(), "{name}: {image}");
            continue;
        }
        let version = tag.trim_start_matches('v');
        let numbers: Vec<&str> = version.split('-').next().unwrap().split('.').collect();
        assert!(
            numbers.len() == 3 && numbers.iter().all(|n| n.parse::<u32>().is_ok()),
            "{name}: {image} is not pinned to an exact version"
        );
        if name == "envoy" {
            assert_eq!(
                image,
                format!("envoyproxy/envoy:v{tested_envoy}"),
                "the Envoy the tests run"
            );
        }
    }
}

#[test]
fn the_files_it_mounts_and_builds_from_exist() {
    let compose = compose();
    let root = workspace_root();
    let makefile = std::fs::read_to_string(root.join("Makefile")).unwrap();
    let built_wasm = makefile
        .lines()
        .find_map(|l| l.strip_prefix("WASM")?.trim_start().strip_prefix(":="))
        .expect("WASM := ... in the Makefile")
        .trim()
        .to_string();
    for (name, service) in services(&compose) {
        if let Some(build) = service.get("build") {
            let context = envoy_dir().join(build["context"].as_str().unwrap());
            let dockerfile = context.join(build["dockerfile"].as_str().unwrap());
            assert!(dockerfile.is_file(), "{name}: {}", dockerfile.display());
        }
        for (host, _) in mounts(&service) {
            let path = repo_relative(&host);
            if path.starts_with("target/") {
                // A build output: the module `make build` writes, or its directory.
                assert!(
                    path == built_wasm || built_wasm.starts_with(&format!("{path}/")),
                    "{name}: {host} is not where `make build` writes {built_wasm}"
                );
            } else if WRITTEN_ELSEWHERE.contains(&path.as_str()) && !root.join(&path).exists() {
                eprintln!("{name}: {path} is not in the repository yet (another change adds it)");
            } else {
                assert!(
                    root.join(&path).exists(),
                    "{name}: {host} ({path}) does not exist"
                );
                if path.ends_with(".yaml") {
                    let text = std::fs::read_to_string(root.join(&path)).unwrap();
                    serde_yaml_ng::from_str::<Value>(&text)
                        .unwrap_or_else(|e| panic!("{path}: not YAML: {e}"));
                }
            }
        }
    }
}

#[test]
fn the_sidecar_reads_its_policy_file_authenticates_callers_and_is_probed_on_its_admin_listener() {
    let compose = compose();
    let sidecar = &compose["services"]["sidecar"];
    let command = strings(sidecar, "command").join(" ");
    assert!(
        command.contains("--limits /etc/ratelimit/${POLICY_FILE:-limits.yaml}"),
        "{command}"
    );
    // A reload is `docker compose kill -s HUP sidecar`, which Docker counts as a manual stop:
    // only `always` still restarts a sidecar that crashes afterwards, and only if the image's
    // STOPSIGNAL is not the reload's signal.
    assert_eq!(sidecar["restart"], "always");
    let dockerfile = std::fs::read_to_string(workspace_root().join("sidecar/Dockerfile")).unwrap();
    assert!(dockerfile.lines().any(|l| l == "STOPSIGNAL SIGTERM"));
    // The policy file's directory, not the file: an editor or `git checkout` replaces the file,
    // and a single-file bind mount would keep showing the container the one it first saw.
    assert!(
        mounts(sidecar).contains(&(".".to_string(), "/etc/ratelimit".to_string())),
        "envoy/ (the directory of limits.yaml) is mounted where --limits reads it: {:?}",
        mounts(sidecar)
    );
    assert!(command.contains("--admin-listen 0.0.0.0:9090"), "{command}");
    let check = sidecar["healthcheck"]["test"].to_string();
    assert!(
        check.contains("/dev/tcp/127.0.0.1/9090") && check.contains("GET /readyz"),
        "{check}"
    );

    // One token for both ends: the sidecar requires it, Envoy's wasm VM may read it.
    let token = sidecar["environment"]["RATELIMIT_AUTH_TOKEN"]
        .as_str()
        .expect("the sidecar's RATELIMIT_AUTH_TOKEN");
    assert!(
        token.starts_with("${RATELIMIT_AUTH_TOKEN:?"),
        "required, never a default: {token}"
    );
    let envoy = &compose["services"]["envoy"];
    assert_eq!(
        envoy["environment"]["RATELIMIT_AUTH_TOKEN"].as_str(),
        Some(token)
    );
    let wasm = &compose_envoy()["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
        [0]["typed_config"]["http_filters"][0];
    assert_eq!(wasm["name"], "envoy.filters.http.wasm");
    let keys =
        &wasm["typed_config"]["config"]["vm_config"]["environment_variables"]["host_env_keys"];
    assert!(
        keys.as_array()
            .is_some_and(|k| k.iter().any(|k| k == "RATELIMIT_AUTH_TOKEN")),
        "compose/envoy.yaml does not let the wasm VM read RATELIMIT_AUTH_TOKEN: {keys}"
    );
}

#[test]
fn envoys_config_names_the_services_ports_and_paths_of_the_compose_file() {
    let compose = compose();
    let envoy_service = &compose["services"]["envoy"];
    let config = compose_envoy();

    // Each cluster points at a compose service on the port that service serves.
    let cluster = |name: &str| -> (String, u64) {
        let cluster = config["static_resources"]["clusters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no cluster {name}"))
            .clone();
        let address = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            ["address"]["socket_address"];
        (
            address["address"].as_str().unwrap().to_string(),
            address["port_value"].as_u64().unwrap(),
        )
    };
    let sidecar_command = strings(&compose["services"]["sidecar"], "command").join(" ");
    assert!(
        !sidecar_command.contains("--listen"),
        "the image's ENTRYPOINT listens on 8081"
    );
    let dockerfile = std::fs::read_to_string(workspace_root().join("sidecar/Dockerfile")).unwrap();
    assert!(dockerfile.contains(r#""--listen", "0.0.0.0:8081""#));
    assert_eq!(cluster("ratelimit_sidecar"), ("sidecar".to_string(), 8081));
    let upstream_conf = std::fs::read_to_string(envoy_dir().join("compose/upstream.conf")).unwrap();
    assert!(upstream_conf.contains("listen 8080;"));
    assert_eq!(cluster("demo_upstream"), ("upstream".to_string(), 8080));

    // Envoy is started with the mounted config, and the wasm path in it is the mounted module.
    let command = strings(envoy_service, "command").join(" ");
    let mounts = mounts(envoy_service);
    let mounted_at = |host: &str| {
        mounts
            .iter()
            .find(|(h, _)| h == host)
            .map(|(_, c)| c.clone())
            .unwrap_or_else(|| panic!("{host} is not mounted"))
    };
    assert!(
        command.contains(&format!("-c {}", mounted_at("./compose/envoy.yaml"))),
        "{command}"
    );
    let wasm = mounted_at("../target/wasm32-wasip1/release/ratelimit_filter.wasm");
    let text = std::fs::read_to_string(envoy_dir().join("compose/envoy.yaml")).unwrap();
    assert!(
        text.contains(&format!("filename: {wasm}")),
        "compose/envoy.yaml loads {wasm}"
    );

    // The published ports are the listener's and the admin's (the admin on loopback only).
    let ports = strings(envoy_service, "ports");
    assert!(
        ports.contains(&"127.0.0.1:10000:10000".to_string()),
        "the listener on the host's loopback, as `make run` listens: {ports:?}"
    );
    // And the sidecar's /metrics where `make run`'s sidecar serves it.
    assert_eq!(
        strings(&compose["services"]["sidecar"], "ports"),
        ["127.0.0.1:8081:9090"]
    );
    assert!(
        ports.contains(&"127.0.0.1:9901:9901".to_string()),
        "{ports:?}"
    );
    let check = envoy_service["healthcheck"]["test"].to_string();
    assert!(
        check.contains("/dev/tcp/127.0.0.1/9901") && check.contains("GET /ready "),
        "{check}"
    );
}

/// `envoy/docker-compose.distributed.yml`, its YAML anchors and merge keys resolved.
fn distributed() -> Value {
    let path = envoy_dir().join("docker-compose.distributed.yml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut yaml: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text)
        .unwrap_or_else(|e| panic!("docker-compose.distributed.yml: not YAML: {e}"));
    yaml.apply_merge().expect("merge keys resolve");
    serde_json::to_value(yaml).expect("JSON")
}

#[test]
fn the_distributed_file_runs_the_single_files_images_envoy_config_and_sidecar() {
    let (single, two) = (compose(), distributed());
    let service = |c: &Value, name: &str| -> Value {
        c["services"]
            .get(name)
            .cloned()
            .unwrap_or_else(|| panic!("no service {name}"))
    };
    for (name, like) in [
        ("redis-primary", "redis"),
        ("redis-replica", "redis"),
        ("sentinel-1", "redis"),
        ("sidecar-a", "sidecar"),
        ("sidecar-b", "sidecar"),
        ("upstream", "upstream"),
        ("envoy-a", "envoy"),
        ("envoy-b", "envoy"),
    ] {
        let (s, l) = (service(&two, name), service(&single, like));
        assert_eq!(s["image"], l["image"], "{name} runs {like}'s image");
        assert!(
            s["healthcheck"]["test"].is_array(),
            "{name}: a health check"
        );
        if like == "envoy" || like == "sidecar" || like == "upstream" {
            assert_eq!(
                s["volumes"], l["volumes"],
                "{name} mounts what {like} mounts"
            );
            assert_eq!(s["command"], l["command"], "{name}: {like}'s command");
        }
        if like == "sidecar" {
            assert_eq!(s["build"], l["build"], "{name} is built as {like}");
            assert_eq!(s["restart"], "always", "{name}: see docker-compose.yml");
        }
    }
    // Each Envoy reaches its own sidecar as "sidecar", the name compose/envoy.yaml calls.
    for gw in ["a", "b"] {
        let aliases = &service(&two, &format!("sidecar-{gw}"))["networks"][format!("gateway-{gw}")]
            ["aliases"];
        assert_eq!(aliases, &serde_json::json!(["sidecar"]), "sidecar-{gw}");
        assert_eq!(
            service(&two, &format!("envoy-{gw}"))["networks"],
            serde_json::json!([format!("gateway-{gw}")])
        );
    }
    // The redis network: private, and the fixed addresses apart from those Docker hands out.
    let redis = &two["networks"]["redis"];
    assert_eq!(redis["internal"], true);
    let ipam = &redis["ipam"]["config"][0];
    assert_eq!(ipam["subnet"], "10.89.0.0/24");
    assert_eq!(ipam["ip_range"], "10.89.0.128/25");
    for name in [
        "redis-primary",
        "redis-replica",
        "sentinel-1",
        "sentinel-2",
        "sentinel-3",
    ] {
        let address = service(&two, name)["networks"]["redis"]["ipv4_address"]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: a fixed address"))
            .to_string();
        let last: u8 = address
            .strip_prefix("10.89.0.")
            .and_then(|n| n.parse().ok())
            .expect(&address);
        assert!(
            last < 128,
            "{name}: {address} is in the range Docker hands out"
        );
    }
}
