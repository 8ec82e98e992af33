//! What operators look at, under `observability/`: the Prometheus alert rules, checked and
//! unit-tested by the real `promtool` (Debian's `prometheus` package), and the Grafana dashboard,
//! parsed as JSON (Grafana itself is not packaged by Debian) and its PromQL checked by `promtool`.
//! Every metric name either uses is checked against what a real sidecar's `/metrics` and a real
//! Envoy's `/stats/prometheus` expose after traffic.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use ratelimit_e2e::scenario::{burst, count, Stack, ALPHA};
use ratelimit_e2e::{http, plugin_json, workspace_root};
use serde_json::{json, Value};
use serde_yaml_ng::Value as Yaml;

const ALERTS: &str = "observability/prometheus-alerts.yaml";
const ALERT_TESTS: &str = "observability/prometheus-alerts.test.yaml";
const DASHBOARD: &str = "observability/grafana-dashboard.json";
const DOCS: &str = "docs/observability.md";

/// Series Prometheus makes itself rather than scraping them.
const PROMETHEUS_OWN: &[&str] = &["up"];
/// Labels Prometheus adds to every scraped series.
const TARGET_LABELS: &[&str] = &["job", "instance"];

// ------------------------------------------------------------------------------------- promtool

/// `promtool`: `PROMTOOL_BIN`, or the one on the PATH (`scripts/install-deps.sh` installs it).
fn promtool() -> PathBuf {
    let bin = std::env::var_os("PROMTOOL_BIN").map_or_else(|| "promtool".into(), PathBuf::from);
    let works = Command::new(&bin)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        works,
        "promtool not found ({}): run scripts/install-deps.sh (Debian's `prometheus` package ships it) or set PROMTOOL_BIN",
        bin.display()
    );
    bin
}

/// Runs promtool with `args`; returns (success, stdout + stderr).
fn run_promtool(args: &[&str], dir: &Path) -> (bool, String) {
    let out = Command::new(promtool())
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run promtool");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn read(relative: &str) -> String {
    let path = workspace_root().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn yaml(relative: &str) -> Yaml {
    serde_yaml_ng::from_str(&read(relative))
        .unwrap_or_else(|e| panic!("{relative} is not YAML: {e}"))
}

fn dashboard() -> Value {
    serde_json::from_str(&read(DASHBOARD)).unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"))
}

// ---------------------------------------------------------------------------------- the alerts

/// The alerting rules: (name, the rule).
fn alert_rules() -> Vec<(String, Yaml)> {
    let mut rules = Vec::new();
    for group in yaml(ALERTS)["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            if let Some(name) = rule["alert"].as_str() {
                rules.push((name.to_string(), rule.clone()));
            }
        }
    }
    rules
}

#[test]
fn promtool_checks_the_alert_rules() {
    let (ok, out) = run_promtool(&["check", "rules", ALERTS], &workspace_root());
    println!("{out}");
    assert!(ok, "promtool check rules {ALERTS}:\n{out}");
    assert!(out.contains("SUCCESS"), "{out}");
}

#[test]
fn promtool_unit_tests_fire_and_leave_quiet_every_alert() {
    let (ok, out) = run_promtool(&["test", "rules", ALERT_TESTS], &workspace_root());
    println!("{out}");
    assert!(ok, "promtool test rules {ALERT_TESTS}:\n{out}");

    // Every alert has a case where it fires and one where it stays quiet.
    let mut fired = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for test in yaml(ALERT_TESTS)["tests"].as_sequence().expect("tests") {
        for case in test["alert_rule_test"].as_sequence().into_iter().flatten() {
            let name = case["alertname"].as_str().expect("alertname").to_string();
            match case["exp_alerts"].as_sequence() {
                Some(alerts) if !alerts.is_empty() => fired.insert(name),
                _ => quiet.insert(name),
            };
        }
    }
    for (name, _) in alert_rules() {
        assert!(
            fired.contains(&name),
            "no test in {ALERT_TESTS} fires {name}"
        );
        assert!(
            quiet.contains(&name),
            "no test in {ALERT_TESTS} expects {name} quiet"
        );
    }
}

#[test]
fn every_alert_has_a_severity_and_words_an_on_call_can_act_on() {
    let docs = read(DOCS);
    let anchors: BTreeSet<String> = docs
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| github_anchor(l.trim_start_matches('#')))
        .collect();
    let rules = alert_rules();
    assert!(rules.len() >= 13, "{} alerts", rules.len());
    for (name, rule) in &rules {
        let severity = rule["labels"]["severity"].as_str().unwrap_or_default();
        assert!(
            ["critical", "warning"].contains(&severity),
            "{name}: severity {severity:?}"
        );
        for key in ["summary", "description", "runbook_url"] {
            assert!(
                rule["annotations"][key]
                    .as_str()
                    .is_some_and(|s| s.len() > 10),
                "{name}: annotation {key} missing or empty"
            );
        }
        let runbook = rule["annotations"]["runbook_url"].as_str().unwrap();
        let (file, anchor) = runbook.split_once('#').expect("runbook_url has an anchor");
        assert_eq!(file, DOCS, "{name}");
        assert!(
            anchors.contains(anchor),
            "{name}: {DOCS} has no heading for #{anchor}"
        );
    }
}

/// The anchor GitHub gives a Markdown heading.
fn github_anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

// ------------------------------------------------------------------------------- the dashboard

/// Every panel, rows' nested panels included.
fn panels(d: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        out.push(p.clone());
        for inner in p["panels"].as_array().into_iter().flatten() {
            out.push(inner.clone());
        }
    }
    out
}

/// Every PromQL expression of the dashboard: the panels' targets, and the selectors of the
/// `label_values(selector, label)` variable queries, as (where, expression).
fn dashboard_expressions(d: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in panels(d) {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().expect("every target has an expr");
            let title = p["title"].as_str().unwrap_or_default();
            out.push((format!("panel {title:?}"), expr.to_string()));
        }
    }
    for v in d["templating"]["list"].as_array().expect("templating") {
        if v["type"] == "query" {
            let (selector, _) = label_values(v);
            out.push((format!("variable {}", v["name"]), selector));
        }
    }
    out
}

/// `label_values(selector, label)` of a query variable: (selector, label).
fn label_values(v: &Value) -> (String, String) {
    let q = v["query"]["query"]
        .as_str()
        .or(v["query"].as_str())
        .expect("variable query");
    let inner = q
        .strip_prefix("label_values(")
        .and_then(|s| s.strip_suffix(')'))
        .unwrap_or_else(|| panic!("variable {}: not label_values(...): {q}", v["name"]));
    let (selector, label) = inner
        .rsplit_once(',')
        .expect("label_values(selector, label)");
    (selector.trim().to_string(), label.trim().to_string())
}

/// Grafana's variables replaced so the expression is plain PromQL: intervals by `5m`, the
/// others (all used in regex matchers) by `.*`. `$1` (a label_replace group) stays.
fn without_grafana_variables(expr: &str) -> String {
    let mut out = String::with_capacity(expr.len());
    let mut chars = expr.chars().peekable();
    while let Some(c) = chars.next() {
        let starts_name = chars
            .peek()
            .is_some_and(|n| n.is_ascii_alphabetic() || *n == '_' || *n == '{');
        if c != '$' || !starts_name {
            out.push(c);
            continue;
        }
        let braced = chars.peek() == Some(&'{');
        if braced {
            chars.next();
        }
        let mut name = String::new();
        while let Some(&n) = chars.peek() {
            if n.is_ascii_alphanumeric() || n == '_' {
                name.push(n);
                chars.next();
            } else {
                break;
            }
        }
        if braced {
            assert_eq!(chars.next(), Some('}'), "unclosed ${{ in {expr}");
        }
        out.push_str(match name.as_str() {
            "__rate_interval" | "__interval" | "__range" => "5m",
            _ => ".*",
        });
    }
    out
}

#[test]
fn the_dashboard_is_a_grafana_10_dashboard_on_a_prometheus_datasource_variable() {
    let d = dashboard();
    assert!(
        d["schemaVersion"].as_u64().unwrap_or(0) >= 36,
        "schemaVersion of Grafana 10 or later"
    );
    assert!(d["uid"]
        .as_str()
        .is_some_and(|u| !u.is_empty() && u.len() <= 40));
    assert!(d["title"].as_str().is_some());

    let vars: BTreeMap<String, Value> = d["templating"]["list"]
        .as_array()
        .expect("templating.list")
        .iter()
        .map(|v| (v["name"].as_str().expect("name").to_string(), v.clone()))
        .collect();
    let ds = &vars["DS_PROMETHEUS"];
    assert_eq!(
        (ds["type"].as_str(), ds["query"].as_str()),
        (Some("datasource"), Some("prometheus"))
    );
    for name in ["job", "instance", "envoy_job", "envoy_instance"] {
        let v = vars
            .get(name)
            .unwrap_or_else(|| panic!("no variable {name}"));
        assert_eq!(v["type"], "query", "{name}");
        assert_eq!(v["datasource"]["uid"], "${DS_PROMETHEUS}", "{name}");
    }

    let mut ids = BTreeSet::new();
    let all = panels(&d);
    assert!(all.len() >= 20, "{} panels", all.len());
    for p in &all {
        let title = p["title"].as_str().expect("every panel has a title");
        assert!(
            ids.insert(p["id"].as_u64().expect("id")),
            "duplicate id: {title}"
        );
        let g = &p["gridPos"];
        let (x, w) = (g["x"].as_u64().unwrap(), g["w"].as_u64().unwrap());
        assert!(
            x + w <= 24 && g["h"].as_u64().unwrap() > 0,
            "{title}: gridPos {g}"
        );
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${DS_PROMETHEUS}", "{title}");
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        for t in targets {
            assert_eq!(t["datasource"]["uid"], "${DS_PROMETHEUS}", "{title}");
        }
        assert!(
            p["description"].as_str().is_some_and(|s| !s.is_empty()),
            "{title}: say what it shows"
        );
    }
}

#[test]
fn every_dashboard_expression_is_promql_that_promtool_accepts() {
    // Each expression as a recording rule: `promtool check rules` parses them all.
    let d = dashboard();
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, expr)) in dashboard_expressions(&d).iter().enumerate() {
        let promql = without_grafana_variables(expr);
        rules.push_str(&format!(
            "      - record: dashboard:expression_{i}\n        expr: {}\n",
            serde_json::to_string(&promql).unwrap()
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("dashboard-rules.yaml"), &rules).unwrap();
    let (ok, out) = run_promtool(&["check", "rules", "dashboard-rules.yaml"], dir.path());
    assert!(ok, "{out}\n{rules}");
    println!("{out}");
}

// ------------------------------------------------------------------------ PromQL's metric names

/// One vector selector: its metric name (if written before the braces) and its label matchers
/// (label, operator, value).
#[derive(Debug, Clone, PartialEq)]
struct Selector {
    name: Option<String>,
    matchers: Vec<(String, String, String)>,
}

const AGGREGATIONS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];
const KEYWORDS: &[&str] = &[
    "and", "or", "unless", "bool", "offset", "atan2", "inf", "nan",
];
const LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The vector selectors of a PromQL expression. A lexer, not a parser: identifiers that are
/// function calls, aggregations, keywords or label lists are skipped; strings, numbers, durations
/// and ranges are skipped; what remains is a metric name, with its `{...}` matchers if any.
fn selectors(expr: &str) -> Vec<Selector> {
    let b: Vec<char> = expr.chars().collect();
    let mut i = 0;
    let mut out = Vec::new();
    let skip_ws = |mut j: usize| {
        while j < b.len() && b[j].is_whitespace() {
            j += 1;
        }
        j
    };
    while i < b.len() {
        let c = b[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '#' {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '"' || c == '\'' || c == '`' {
            i = string_end(&b, i).1;
        } else if c.is_ascii_digit() || (c == '.' && b.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '.') {
                i += 1;
            }
        } else if c == '[' {
            while i < b.len() && b[i] != ']' {
                i += 1;
            }
            i += 1;
        } else if c == '{' {
            let (matchers, end) = matchers(&b, i);
            out.push(Selector {
                name: None,
                matchers,
            });
            i = end;
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '_' || b[i] == ':') {
                i += 1;
            }
            let word: String = b[start..i].iter().collect();
            let next = skip_ws(i);
            let lower = word.to_lowercase();
            if LABEL_LISTS.contains(&lower.as_str()) {
                if b.get(next) == Some(&'(') {
                    while i < b.len() && b[i] != ')' {
                        i += 1;
                    }
                    i += 1;
                }
            } else if b.get(next) == Some(&'(')
                || AGGREGATIONS.contains(&lower.as_str())
                || KEYWORDS.contains(&lower.as_str())
            {
                // A function call, an aggregation or a keyword.
            } else if b.get(next) == Some(&'{') {
                let (matchers, end) = matchers(&b, next);
                out.push(Selector {
                    name: Some(word),
                    matchers,
                });
                i = end;
            } else {
                out.push(Selector {
                    name: Some(word),
                    matchers: Vec::new(),
                });
            }
        } else {
            i += 1;
        }
    }
    out
}

/// A quoted string starting at `b[i]`: (its value, the index after it).
fn string_end(b: &[char], i: usize) -> (String, usize) {
    let quote = b[i];
    let mut j = i + 1;
    let mut value = String::new();
    while j < b.len() && b[j] != quote {
        if b[j] == '\\' && quote != '`' {
            j += 1;
        }
        if let Some(&c) = b.get(j) {
            value.push(c);
        }
        j += 1;
    }
    (value, j + 1)
}

/// The matchers of `{...}` starting at `b[i]`: (matchers, the index after `}`).
fn matchers(b: &[char], mut i: usize) -> (Vec<(String, String, String)>, usize) {
    assert_eq!(b[i], '{');
    i += 1;
    let mut out = Vec::new();
    loop {
        while i < b.len() && (b[i].is_whitespace() || b[i] == ',') {
            i += 1;
        }
        if i >= b.len() || b[i] == '}' {
            return (out, i + 1);
        }
        let start = i;
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '_') {
            i += 1;
        }
        let label: String = b[start..i].iter().collect();
        while i < b.len() && b[i].is_whitespace() {
            i += 1;
        }
        let op_start = i;
        while i < b.len() && matches!(b[i], '=' | '!' | '~') {
            i += 1;
        }
        let op: String = b[op_start..i].iter().collect();
        while i < b.len() && b[i].is_whitespace() {
            i += 1;
        }
        assert!(
            i < b.len() && matches!(b[i], '"' | '\'' | '`'),
            "matcher {label}{op} without a quoted value in {}",
            b.iter().collect::<String>()
        );
        let (value, end) = string_end(b, i);
        out.push((label, op, value));
        i = end;
    }
}

#[test]
fn the_lexer_finds_metric_names_and_matchers_and_nothing_else() {
    let got = selectors(
        r#"sum by (le, job) (rate(a_bucket{le="+Inf", job=~"x|y"}[5m] offset 1m)) / on (job) group_left (instance)
           sum(rate(b_total[5m:1m])) > bool 0.5 and c unless max without (x) (label_replace({__name__=~"r_.+_d"}, "rule", "$1", "__name__", "r_(.+)_d")) * 1e6"#,
    );
    let names: Vec<Option<&str>> = got.iter().map(|s| s.name.as_deref()).collect();
    assert_eq!(names, [Some("a_bucket"), Some("b_total"), Some("c"), None]);
    assert_eq!(
        got[0].matchers,
        [
            ("le".into(), "=".into(), "+Inf".into()),
            ("job".into(), "=~".into(), "x|y".into())
        ]
    );
    assert_eq!(
        got[3].matchers,
        [("__name__".into(), "=~".into(), "r_.+_d".into())]
    );
    assert_eq!(
        without_grafana_variables(
            r#"rate(x{job=~"$job", i=~"${instance}"}[$__rate_interval]) "$1""#
        ),
        r#"rate(x{job=~".*", i=~".*"}[5m]) "$1""#
    );
}

// ------------------------------------------------------------- names against the real binaries

/// The series a Prometheus text exposition holds: sample name → the label names it carries; and
/// the metric families its `# TYPE` lines declare.
fn exposed(text: &str) -> (BTreeMap<String, BTreeSet<String>>, BTreeSet<String>) {
    let mut series: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut families = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            families.insert(
                rest.split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_string(),
            );
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = line[..name_end].to_string();
        let labels = series.entry(name).or_default();
        if line[name_end..].starts_with('{') {
            let b: Vec<char> = line[name_end..].chars().collect();
            for (label, _, _) in matchers(&b, 0).0 {
                labels.insert(label);
            }
        }
    }
    (series, families)
}

fn get_text(url: &str) -> String {
    http()
        .get(url)
        .send()
        .and_then(|r| r.text())
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
}

#[test]
fn every_metric_name_in_the_alerts_and_the_dashboard_is_exposed_by_a_real_sidecar_and_envoy() {
    // The shipped envoy.yaml (per-app: `on_error: local`, per-ip: `allow`) with a small per-app
    // bucket, so a burst gets 429s and known rejections, and every bucket counted as busy, so
    // the first callout already asks for a lease (the sidecar's lease counter appears once one
    // is granted).
    let mut plugin = plugin_json(&read("envoy/envoy.yaml"));
    plugin["fast_paths"] = json!({"leases": {"min_rate_per_sec": 1}});
    let stack = Stack::start(
        "envoy.yaml",
        Some(plugin),
        // per-ip also limits requests in flight (never reached), so slots are taken and counted.
        Some("rules:\n  per-app: {capacity: 20, refill_per_sec: 0.001}\n  per-ip: {capacity: 1000, refill_per_sec: 100, concurrency: 1000}\n"),
    );
    let answers = burst(&stack.envoy.url("/api/orders"), &[ALPHA], 100, 8);
    let (admitted, rejected) = (count(&answers, 200), count(&answers, 429));
    println!("traffic: {admitted} admitted, {rejected} rejected");
    assert!(
        admitted > 0 && rejected > 0,
        "{admitted} admitted, {rejected} rejected"
    );

    let sidecar_text = get_text(&format!("{}/metrics", stack.sidecar.base_url()));
    let envoy_text = get_text(&format!(
        "http://127.0.0.1:{}/stats/prometheus",
        stack.envoy.admin_port
    ));
    let (sidecar, sidecar_families) = exposed(&sidecar_text);
    let (envoy, envoy_families) = exposed(&envoy_text);
    let ours = |m: &BTreeMap<String, BTreeSet<String>>| -> Vec<String> {
        m.keys()
            .filter(|n| n.starts_with("ratelimit_"))
            .cloned()
            .collect()
    };
    println!("sidecar /metrics: {}", ours(&sidecar).join(" "));
    println!("envoy /stats/prometheus: {}", ours(&envoy).join(" "));
    let mut series = sidecar.clone();
    for (name, labels) in &envoy {
        series
            .entry(name.clone())
            .or_default()
            .extend(labels.iter().cloned());
    }

    let d = dashboard();
    let mut expressions: Vec<(String, String)> = alert_rules()
        .into_iter()
        .map(|(name, rule)| {
            (
                format!("alert {name}"),
                rule["expr"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let from_dashboard = dashboard_expressions(&d);
    expressions.extend(from_dashboard.iter().cloned());

    let mut problems = Vec::new();
    let mut by_regex = Vec::new();
    let mut used = BTreeSet::new();
    let mut dashboard_used = BTreeSet::new();
    for (where_, expr) in &expressions {
        let in_dashboard = from_dashboard.iter().any(|(w, _)| w == where_);
        for s in selectors(&without_grafana_variables(expr)) {
            match &s.name {
                Some(name) => {
                    used.insert(name.clone());
                    if in_dashboard {
                        dashboard_used.insert(name.clone());
                    }
                    if PROMETHEUS_OWN.contains(&name.as_str()) {
                        continue;
                    }
                    let Some(labels) = series.get(name) else {
                        problems.push(format!("{where_}: {name} is exposed by neither"));
                        continue;
                    };
                    for (label, _, _) in &s.matchers {
                        if !labels.contains(label) && !TARGET_LABELS.contains(&label.as_str()) {
                            problems.push(format!("{where_}: {name} has no label {label}"));
                        }
                    }
                }
                None => {
                    assert!(
                        s.matchers
                            .iter()
                            .any(|(l, op, _)| l == "__name__" && op == "=~"),
                        "{where_}: a selector without a name or a __name__ regex: {s:?}"
                    );
                    by_regex.push((where_.clone(), s));
                }
            }
        }
    }
    // The labels of the variables exist on their metrics.
    for v in d["templating"]["list"].as_array().unwrap() {
        if v["type"] == "query" {
            let (selector, label) = label_values(v);
            let name = selectors(&without_grafana_variables(&selector))[0]
                .name
                .clone()
                .unwrap();
            let ok = TARGET_LABELS.contains(&label.as_str())
                || series.get(&name).is_some_and(|l| l.contains(&label));
            assert!(ok, "variable {}: {name} has no label {label}", v["name"]);
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // `__name__` regexes (the filter's per-rule stats), by Prometheus's own regex engine: each
    // must select some exposed series.
    assert!(!by_regex.is_empty());
    check_name_regexes(&series, &by_regex);
    check_per_rule_labels(&series, &from_dashboard);

    // And the other way: every family the sidecar and the filter expose is on the dashboard.
    let per_rule = by_regex.iter().any(|(w, _)| w.starts_with("panel"));
    let mut missing = Vec::new();
    for family in sidecar_families.iter().chain(&envoy_families) {
        if !family.starts_with("ratelimit_") {
            continue;
        }
        if family.starts_with("ratelimit_rule_") && per_rule {
            continue;
        }
        let shown = ["", "_total", "_bucket", "_sum", "_count"]
            .iter()
            .any(|suffix| dashboard_used.contains(&format!("{family}{suffix}")));
        if !shown {
            missing.push(family.clone());
        }
    }
    assert!(
        missing.is_empty(),
        "exposed but on no panel of {DASHBOARD} (add a panel, and a row to {DOCS}): {missing:?}"
    );
    println!("{} names used, all exposed: {used:?}", used.len());
}

/// Checks with `promtool test rules` that each `__name__` regex selector selects at least one of
/// the exposed series (given as input series with a job and an instance).
fn check_name_regexes(
    series: &BTreeMap<String, BTreeSet<String>>,
    selectors: &[(String, Selector)],
) {
    let mut test =
        String::from("evaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n");
    for name in series.keys() {
        test.push_str(&format!(
            "      - series: '{name}{{job=\"x\", instance=\"x\"}}'\n        values: '1x10'\n"
        ));
    }
    test.push_str("    promql_expr_test:\n");
    for (_, s) in selectors {
        let matchers: Vec<String> = s
            .matchers
            .iter()
            .map(|(l, op, v)| format!("{l}{op}{}", serde_json::to_string(v).unwrap()))
            .collect();
        let expr = format!("count({{{}}}) > bool 0", matchers.join(", "));
        test.push_str(&format!(
            "      - expr: {}\n        eval_time: 5m\n        exp_samples:\n          - labels: '{{}}'\n            value: 1\n",
            serde_json::to_string(&expr).unwrap()
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("names.test.yaml"), &test).unwrap();
    let (ok, out) = run_promtool(&["test", "rules", "names.test.yaml"], dir.path());
    let wheres: Vec<&String> = selectors.iter().map(|(w, _)| w).collect();
    assert!(
        ok,
        "a __name__ regex selects no exposed series (in {wheres:?}):\n{out}"
    );
}

/// Checks with `promtool test rules`, on the exposed series, that the per-rule panel turns the
/// filter's per-rule stats into one series per rule of the Envoy config (the names Envoy wrote),
/// and that `shadow_rejected` does not leak into `rejected` as a rule of its own.
fn check_per_rule_labels(
    series: &BTreeMap<String, BTreeSet<String>>,
    dashboard: &[(String, String)],
) {
    let rules: Vec<&str> = series
        .keys()
        .filter_map(|n| n.strip_prefix("ratelimit_rule_")?.strip_suffix("_admitted"))
        .collect();
    assert!(rules.contains(&"per_app"), "{rules:?}");
    let per_rule: Vec<&String> = dashboard
        .iter()
        .filter(|(_, e)| e.contains("ratelimit_rule_"))
        .map(|(_, e)| e)
        .collect();
    assert_eq!(per_rule.len(), 3, "admitted, rejected, shadow_rejected");
    let mut test =
        String::from("evaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n");
    for name in series.keys().filter(|n| n.starts_with("ratelimit_rule_")) {
        test.push_str(&format!(
            "      - series: '{name}{{job=\"x\", instance=\"x\"}}'\n        values: '0+1x20'\n"
        ));
    }
    test.push_str("    promql_expr_test:\n");
    for expr in per_rule {
        let expr = format!("count by (rule) ({})", without_grafana_variables(expr));
        test.push_str(&format!(
            "      - expr: {}\n        eval_time: 10m\n        exp_samples:\n",
            serde_json::to_string(&expr).unwrap()
        ));
        for rule in &rules {
            test.push_str(&format!(
                "          - labels: '{{rule=\"{rule}\"}}'\n            value: 1\n"
            ));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("per-rule.test.yaml"), &test).unwrap();
    let (ok, out) = run_promtool(&["test", "rules", "per-rule.test.yaml"], dir.path());
    assert!(
        ok,
        "the per-rule panel's rules are not {rules:?}:\n{out}\n{test}"
    );
}
