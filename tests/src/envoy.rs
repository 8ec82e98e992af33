//! Envoy for the tests: the shipped configs under `envoy/` started as they are, with only their
//! four ports, the wasm path and (optionally) the plugin configuration rewritten. So every
//! end-to-end test is also a test of the configs an operator deploys.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{artifact, free_port, http, require_file, wait_until, Process, READY_TIMEOUT};

/// The ports the shipped configs use, which the tests replace with free ones.
const SHIPPED_LISTENER: &str = "port_value: 10000";
const SHIPPED_ADMIN: &str = "port_value: 9901";
const SHIPPED_SIDECAR: &str = "port_value: 8081";
const SHIPPED_UPSTREAM: &str = "port_value: 8080";
const SHIPPED_WASM: &str = "target/wasm32-wasip1/release/ratelimit_filter.wasm";

/// One of the shipped configs, to be started with the tests' ports.
#[derive(Clone)]
pub struct EnvoyConfig {
    file: String,
    template: String,
    plugin: Option<String>,
    /// YAML appended to clusters' definitions: (cluster name, lines).
    cluster_additions: Vec<(String, String)>,
    /// More endpoints of the sidecar's cluster, beside `sidecar_port`.
    more_sidecar_ports: Vec<u16>,
    /// The module the `wasm` filter loads, when not the filter's own build.
    wasm: Option<PathBuf>,
    log_level: String,
    pub sidecar_port: u16,
    pub upstream_port: u16,
    pub concurrency: u32,
}

impl EnvoyConfig {
    /// A config from `envoy/<file>` (e.g. `envoy.yaml`, `envoy-jwt.yaml`).
    pub fn shipped(file: &str, sidecar_port: u16, upstream_port: u16) -> EnvoyConfig {
        let path = crate::workspace_root().join("envoy").join(file);
        let template = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        // A config with Envoy's native rate limit filter loads no wasm module.
        let wasm = template
            .contains("envoy.filters.http.wasm")
            .then_some(SHIPPED_WASM);
        for needle in [
            SHIPPED_LISTENER,
            SHIPPED_ADMIN,
            SHIPPED_SIDECAR,
            SHIPPED_UPSTREAM,
        ]
        .into_iter()
        .chain(wasm)
        {
            assert!(
                template.contains(needle),
                "{file} no longer contains `{needle}`"
            );
        }
        EnvoyConfig {
            file: file.to_string(),
            template,
            plugin: None,
            cluster_additions: Vec::new(),
            more_sidecar_ports: Vec::new(),
            wasm: None,
            log_level: "info".to_string(),
            sidecar_port,
            upstream_port,
            concurrency: 2,
        }
    }

    /// Replaces the filter's plugin configuration (the JSON under `configuration.value`).
    pub fn plugin(mut self, json: &str) -> EnvoyConfig {
        self.plugin = Some(json.to_string());
        self
    }

    /// Appends `yaml` (keys of a cluster, e.g. a `transport_socket:` block, written at column 0)
    /// to the definition of the cluster `name` in the rendered config.
    pub fn cluster_addition(mut self, name: &str, yaml: &str) -> EnvoyConfig {
        self.cluster_additions
            .push((name.to_string(), yaml.to_string()));
        self
    }

    /// One more endpoint of the sidecar's cluster, a sidecar on `port` beside the one on
    /// `sidecar_port`: Envoy spreads the callouts (decisions, epoch polls) over them.
    pub fn sidecar_endpoint(mut self, port: u16) -> EnvoyConfig {
        assert_eq!(
            self.template.matches(SHIPPED_SIDECAR).count(),
            1,
            "{}: one sidecar endpoint to add another beside",
            self.file
        );
        self.more_sidecar_ports.push(port);
        self
    }

    /// An `UpstreamTlsContext` for the cluster `name`: TLS to it, verifying its certificate
    /// against `ca` for the name `sni`, presenting `cert`/`key` as client certificate.
    pub fn upstream_tls(
        self,
        name: &str,
        sni: &str,
        ca: &Path,
        cert: &Path,
        key: &Path,
    ) -> EnvoyConfig {
        let yaml = format!(
            "transport_socket:\n  name: envoy.transport_sockets.tls\n  typed_config:\n    \
             \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n    \
             sni: {sni}\n    common_tls_context:\n      tls_certificates:\n      \
             - certificate_chain: {{ filename: \"{cert}\" }}\n        \
             private_key: {{ filename: \"{key}\" }}\n      validation_context:\n        \
             trusted_ca: {{ filename: \"{ca}\" }}\n        match_typed_subject_alt_names:\n        \
             - san_type: DNS\n          matcher: {{ exact: \"{sni}\" }}\n",
            cert = cert.display(),
            key = key.display(),
            ca = ca.display(),
        );
        self.cluster_addition(name, &yaml)
    }

    /// Changes one setting of the shipped config for a test (e.g. a longer timeout on a busy
    /// machine); `from` must be in the file, so a renamed setting fails loudly.
    pub fn replace(mut self, from: &str, to: &str) -> EnvoyConfig {
        assert!(
            self.template.contains(from),
            "{} no longer contains `{from}`",
            self.file
        );
        self.template = self.template.replace(from, to);
        self
    }

    /// Replaces the lines from the one that starts with `from` up to (not including) the next
    /// one that starts with `to` by `with` (whole lines, or nothing): a filter of the chain, a
    /// route table. Both must be in the file, so a reshaped config fails loudly.
    pub fn replace_lines(mut self, from: &str, to: &str, with: &str) -> EnvoyConfig {
        let find = |needle: &str, after: usize| {
            self.template[after..]
                .match_indices(needle)
                .map(|(i, _)| after + i)
                .find(|i| *i == 0 || self.template.as_bytes()[i - 1] == b'\n')
                .unwrap_or_else(|| panic!("{} has no line starting `{needle}`", self.file))
        };
        let start = find(from, 0);
        let end = find(to, start);
        self.template = format!("{}{with}{}", &self.template[..start], &self.template[end..]);
        self
    }

    /// The `wasm` filter loads `module` instead of the filter's build (another build, a filter
    /// that does nothing).
    pub fn wasm_module(mut self, module: &Path) -> EnvoyConfig {
        self.wasm = Some(module.to_path_buf());
        self
    }

    /// Envoy's log level (`-l`); `info` unless set.
    pub fn log_level(mut self, level: &str) -> EnvoyConfig {
        self.log_level = level.to_string();
        self
    }

    pub fn concurrency(mut self, n: u32) -> EnvoyConfig {
        self.concurrency = n;
        self
    }

    /// Whether the config loads a wasm module (Envoy's native rate limit filter does not, nor a
    /// config whose wasm filter was replaced).
    fn loads_wasm(&self) -> bool {
        self.template.contains(SHIPPED_WASM)
    }

    /// The YAML Envoy is started with.
    pub fn render(&self, listen_port: u16, admin_port: u16, wasm: &str) -> String {
        let mut yaml = add_endpoints(&self.template, SHIPPED_SIDECAR, &self.more_sidecar_ports)
            .replace(SHIPPED_LISTENER, &format!("port_value: {listen_port}"))
            .replace(SHIPPED_ADMIN, &format!("port_value: {admin_port}"))
            .replace(
                SHIPPED_SIDECAR,
                &format!("port_value: {}", self.sidecar_port),
            )
            .replace(
                SHIPPED_UPSTREAM,
                &format!("port_value: {}", self.upstream_port),
            )
            .replace(SHIPPED_WASM, wasm);
        // A config whose wasm filter was taken out ([`EnvoyConfig::replace_lines`]) has no
        // plugin to configure.
        if let Some(plugin) = self.plugin.as_ref().filter(|_| self.loads_wasm()) {
            yaml = replace_plugin_block(&yaml, plugin);
        }
        for (cluster, addition) in &self.cluster_additions {
            yaml = append_to_cluster(&yaml, cluster, addition);
        }
        yaml
    }
}

/// Repeats the `- endpoint:` entry whose address holds `port_line` once per port of `ports`,
/// after it, with that port.
fn add_endpoints(yaml: &str, port_line: &str, ports: &[u16]) -> String {
    if ports.is_empty() {
        return yaml.to_string();
    }
    let lines: Vec<&str> = yaml.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.contains(port_line))
        .unwrap_or_else(|| panic!("the config has no `{port_line}`"));
    let entry = lines[..at]
        .iter()
        .rposition(|l| l.trim_start().starts_with("- endpoint:"))
        .expect("the port is an endpoint's");
    let mut out: Vec<String> = lines[..=at].iter().map(|s| s.to_string()).collect();
    for port in ports {
        out.extend(
            lines[entry..=at]
                .iter()
                .map(|l| l.replace(port_line, &format!("port_value: {port}"))),
        );
    }
    out.extend(lines[at + 1..].iter().map(|s| s.to_string()));
    out.join("\n") + "\n"
}

/// Inserts `addition` (YAML keys at column 0) into the cluster list entry `- name: <cluster>`,
/// indented as that entry's keys.
fn append_to_cluster(yaml: &str, cluster: &str, addition: &str) -> String {
    let lines: Vec<&str> = yaml.lines().collect();
    let entry = format!("- name: {cluster}");
    let at = lines
        .iter()
        .position(|l| l.trim() == entry)
        .unwrap_or_else(|| panic!("the config has no cluster `{entry}`"));
    let pad = " ".repeat(lines[at].len() - lines[at].trim_start().len() + 2);
    let mut out: Vec<String> = lines[..=at].iter().map(|s| s.to_string()).collect();
    out.extend(addition.lines().map(|l| format!("{pad}{l}")));
    out.extend(lines[at + 1..].iter().map(|s| s.to_string()));
    out.join("\n") + "\n"
}

/// The line range of the block scalar after the first `value: |` line (the plugin JSON):
/// (the `value: |` line, the first line after the block).
fn plugin_block(lines: &[&str]) -> (usize, usize) {
    let start = lines
        .iter()
        .position(|l| l.trim_end().ends_with("value: |"))
        .expect("the config has a `value: |` plugin block");
    let indent = lines[start].len() - lines[start].trim_start().len();
    let end = lines[start + 1..]
        .iter()
        .position(|l| !l.trim().is_empty() && l.len() - l.trim_start().len() <= indent)
        .map(|i| start + 1 + i)
        .unwrap_or(lines.len());
    (start, end)
}

/// The plugin configuration (JSON) of an Envoy config.
pub fn plugin_json(yaml: &str) -> serde_json::Value {
    let lines: Vec<&str> = yaml.lines().collect();
    let (start, end) = plugin_block(&lines);
    let text = lines[start + 1..end].join("\n");
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("plugin JSON does not parse: {e}\n{text}"))
}

/// Replaces the block scalar after the first `value: |` line (the plugin JSON) with `json`.
fn replace_plugin_block(yaml: &str, json: &str) -> String {
    let lines: Vec<&str> = yaml.lines().collect();
    let (start, end) = plugin_block(&lines);
    let indent = lines[start].len() - lines[start].trim_start().len();
    let pad = " ".repeat(indent + 2);
    let mut out: Vec<String> = lines[..=start].iter().map(|s| s.to_string()).collect();
    out.extend(json.lines().map(|l| format!("{pad}{l}")));
    out.extend(lines[end..].iter().map(|s| s.to_string()));
    out.join("\n") + "\n"
}

/// A running Envoy.
pub struct Envoy {
    pub listen_port: u16,
    pub admin_port: u16,
    pub process: Process,
    _dir: tempfile::TempDir,
}

impl Envoy {
    pub fn bin() -> PathBuf {
        let p = artifact("ENVOY_BIN", ".venv/bin/envoy");
        require_file(&p, "envoy", "ENVOY_BIN")
    }

    pub fn wasm() -> PathBuf {
        let p = artifact(
            "RATELIMIT_FILTER_WASM",
            "target/wasm32-wasip1/release/ratelimit_filter.wasm",
        );
        require_file(&p, "the filter's wasm", "RATELIMIT_FILTER_WASM")
    }

    /// Starts Envoy and returns the process without waiting for readiness.
    pub fn spawn(config: &EnvoyConfig) -> Envoy {
        Envoy::spawn_on(config, free_port(), free_port())
    }

    /// [`Envoy::spawn`] on given ports (a restart keeps its clients' port).
    pub fn spawn_on(config: &EnvoyConfig, listen_port: u16, admin_port: u16) -> Envoy {
        let dir = tempfile::tempdir().expect("temp dir");
        // Only a config that loads the filter needs it built.
        let wasm = match &config.wasm {
            _ if !config.loads_wasm() => String::new(),
            Some(module) => module.display().to_string(),
            None => Envoy::wasm().display().to_string(),
        };
        let yaml = config.render(listen_port, admin_port, &wasm);
        let path = dir.path().join(&config.file);
        std::fs::write(&path, yaml).expect("write envoy config");
        let mut cmd = Command::new(Envoy::bin());
        cmd.arg("-c")
            .arg(&path)
            .args(["--concurrency", &config.concurrency.to_string()])
            .args(["--disable-hot-restart", "-l", &config.log_level])
            .current_dir(crate::workspace_root());
        let process = Process::spawn(&format!("envoy-{listen_port}"), cmd, dir.path());
        Envoy {
            listen_port,
            admin_port,
            process,
            _dir: dir,
        }
    }

    /// Starts Envoy and waits until its admin says LIVE and the listener accepts connections.
    pub fn start(config: &EnvoyConfig) -> Envoy {
        Envoy::started(Envoy::spawn(config))
    }

    /// Stops this Envoy and starts `config` again on the same ports, waiting until it is ready.
    pub fn restart(&mut self, config: &EnvoyConfig) {
        self.process.stop();
        let (listen, admin) = (self.listen_port, self.admin_port);
        *self = Envoy::started(Envoy::spawn_on(config, listen, admin));
    }

    /// Waits until `envoy`'s admin says LIVE and its listener accepts connections.
    fn started(mut envoy: Envoy) -> Envoy {
        let client = http();
        let ready = format!("http://127.0.0.1:{}/ready", envoy.admin_port);
        let port = envoy.listen_port;
        wait_until("envoy /ready", READY_TIMEOUT, || {
            assert!(
                envoy.process.running(),
                "envoy exited during start:\n{}",
                envoy.process.log()
            );
            client
                .get(&ready)
                .send()
                .map(|r| r.status() == 200)
                .unwrap_or(false)
                && crate::port_open(port)
        });
        envoy
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.listen_port)
    }

    /// Every stat whose name contains `ratelimit`, as (name, value) pairs.
    pub fn ratelimit_stats(&self) -> Vec<(String, String)> {
        let url = format!(
            "http://127.0.0.1:{}/stats?filter=ratelimit",
            self.admin_port
        );
        let body = http()
            .get(url)
            .send()
            .and_then(|r| r.text())
            .unwrap_or_default();
        body.lines()
            .filter_map(|l| l.split_once(": "))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// The value of the counter whose name ends with `suffix` (e.g. `ratelimit.admitted`).
    pub fn counter(&self, suffix: &str) -> u64 {
        self.ratelimit_stats()
            .into_iter()
            .find(|(k, _)| k.ends_with(suffix))
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0)
    }

    /// Waits for Envoy to exit (for a config it must refuse) and returns its log.
    pub fn expect_exit(mut self) -> String {
        let (status, log) = self.process.wait_exit(Duration::from_secs(60));
        assert!(!status.success(), "envoy exited successfully:\n{log}");
        log
    }
}

/// The reservation and its settlement envoy/envoy-native-ratelimit.yaml comments (the snippet
/// docs/grpc.md shows: a reservation charged when the request arrives, settled at stream done
/// from `x-usage-tokens` with the `settle` entry the sidecar reported), uncommented for rule
/// `rule`, reserving `reserve` instead of 1000: a route's `typed_per_filter_config`, indented to
/// sit beside its `route:`.
pub fn native_settled_route(rule: &str, reserve: u64) -> String {
    const COMMENT: &str = "                  #   ";
    let shipped =
        std::fs::read_to_string(crate::workspace_root().join("envoy/envoy-native-ratelimit.yaml"))
            .expect("the shipped native config");
    let lines: Vec<&str> = shipped
        .lines()
        .skip_while(|l| !l.starts_with(&format!("{COMMENT}typed_per_filter_config:")))
        .take_while(|l| l.starts_with(COMMENT))
        .collect();
    assert!(
        lines.iter().any(|l| l.contains("descriptor_key: settle")),
        "envoy-native-ratelimit.yaml no longer comments the settled route: {lines:?}"
    );
    let route: String = lines
        .iter()
        .map(|l| format!("                {}\n", &l[COMMENT.len()..]))
        .collect();
    assert_eq!(route.matches("1000").count(), 1, "{route}");
    assert_eq!(route.matches("descriptor_value: llm").count(), 2, "{route}");
    route
        .replace("1000", &reserve.to_string())
        .replace(
            "descriptor_value: llm",
            &format!("descriptor_value: {rule}"),
        )
        .replace("{ key: llm }", &format!("{{ key: {rule} }}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn additions_land_inside_the_named_cluster() {
        let yaml = "clusters:\n  - name: a\n    type: STATIC\n  - name: b\n    type: STATIC\n";
        let out = append_to_cluster(yaml, "b", "transport_socket:\n  name: tls\n");
        assert_eq!(
            out,
            "clusters:\n  - name: a\n    type: STATIC\n  - name: b\n    transport_socket:\n      name: tls\n    type: STATIC\n"
        );
    }

    /// A config of the file `x.yaml` holding `template`.
    fn config(template: &str) -> EnvoyConfig {
        EnvoyConfig {
            file: "x.yaml".into(),
            template: template.into(),
            plugin: None,
            cluster_additions: Vec::new(),
            more_sidecar_ports: Vec::new(),
            wasm: None,
            log_level: "info".into(),
            sidecar_port: 1,
            upstream_port: 2,
            concurrency: 1,
        }
    }

    #[test]
    fn a_second_sidecar_endpoint_repeats_the_first_with_its_port() {
        let yaml = EnvoyConfig::shipped("envoy.yaml", 7001, 7003)
            .sidecar_endpoint(7002)
            .render(1, 2, "x.wasm");
        let at = yaml.find("port_value: 7001").expect("the first sidecar");
        let second = yaml.find("port_value: 7002").expect("the second sidecar");
        assert!(second > at, "after the first");
        assert_eq!(
            yaml[at..second].matches("- endpoint:").count(),
            1,
            "an endpoint entry of its own in the same list:\n{yaml}"
        );
    }

    #[test]
    fn lines_are_replaced_from_one_line_start_to_another() {
        let config = config("a\n  - name: f\n    x: 1\n  - name: router\nb\n");
        let out = config
            .clone()
            .replace_lines("  - name: f", "  - name: router", "  - name: g\n");
        assert_eq!(out.template, "a\n  - name: g\n  - name: router\nb\n");
        let removed = config.replace_lines("  - name: f", "  - name: router", "");
        assert_eq!(removed.template, "a\n  - name: router\nb\n");
    }

    #[test]
    fn the_shipped_config_without_its_wasm_filter_renders_without_a_plugin() {
        let without = EnvoyConfig::shipped("envoy.yaml", 1, 2)
            .plugin("{\"rules\": []}")
            .replace_lines(
                "          - name: envoy.filters.http.wasm",
                "          - name: envoy.filters.http.router",
                "",
            );
        assert!(!without.loads_wasm());
        let yaml = without.render(3, 4, "");
        assert!(!yaml.contains("envoy.filters.http.wasm"), "{yaml}");
        assert!(yaml.contains("envoy.filters.http.router"), "{yaml}");
    }

    #[test]
    #[should_panic(expected = "x.yaml has no line starting `  - name: h`")]
    fn a_missing_line_is_refused() {
        let config = config("a\n  - name: f\n");
        let _ = config.replace_lines("  - name: h", "  - name: f", "");
    }

    #[test]
    fn plugin_block_is_replaced_and_the_rest_kept() {
        let yaml = "a:\n  value: |\n    {\"x\": 1}\n    \n  b: 2\nc: 3\n";
        let out = replace_plugin_block(yaml, "{\n  \"y\": 2\n}");
        assert_eq!(
            out,
            "a:\n  value: |\n    {\n      \"y\": 2\n    }\n  b: 2\nc: 3\n"
        );
    }
}
