//! `docs/configuration.md` is the operator's configuration reference; this test keeps it honest.
//! Each table marked `<!-- checked: NAME -->` is compared, both ways, with what the code accepts:
//!
//! - `sidecar-flags`: the long flags of `ratelimit-sidecar --help` (the release binary the other
//!   end-to-end tests use), each row with the flag's environment variable, default and possible
//!   values;
//! - `filter-config`, `policy-own`, `policy-envoy`, `decide-request`: the field paths the filter's
//!   configuration, the two policy formats and a `POST /v1/decide` call accept. They are not
//!   copied from the source: the parsers are asked. Every struct of those formats refuses unknown
//!   fields, and serde's refusal names the fields it expected (`unknown field `x`, expected one of
//!   `a`, `b``), so a probe field placed at each path reveals the fields there, level by level; an
//!   enum names its values the same way, and each must appear in its field's row;
//! - `decide-response`: the fields of an answer, from a fully populated one, serialised;
//! - `wire-bounds`: the bounds of a call, against the constants;
//! - `envoy-yaml-example`, `limits-yaml-example`: the worked examples are the shipped files.
//!
//! No process but `ratelimit-sidecar --help` is started: it takes well under a second.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use ratelimit_e2e::{plugin_json, workspace_root, Sidecar};
use ratelimit_sidecar::policy::{Bounds, Policy};
use ratelimit_wire::{
    AppliedLimit, DecideResponse, DecisionResult, ErrorCode, HeldSlot, Reason, RequestAnswer,
    RequestError,
};
use serde_json::{json, Value};

const DOC: &str = "docs/configuration.md";

fn read(path: &str) -> String {
    std::fs::read_to_string(workspace_root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

// ---------------------------------------------------------------------------------------------
// The document's checked tables
// ---------------------------------------------------------------------------------------------

/// One row of a checked table: the text inside the first backticks of its first cell, its cells,
/// and the whole line.
#[derive(Debug, Clone)]
struct Row {
    key: String,
    cells: Vec<String>,
    line: String,
}

impl Row {
    /// Whether the row holds `text` in backticks (or, for a bound, as a cell).
    fn mentions(&self, text: &str) -> bool {
        self.line.contains(&format!("`{text}`"))
    }
}

/// The rows of every table that follows a `<!-- checked: name -->` line (header and separator
/// lines skipped), in document order.
fn checked_rows(doc: &str, name: &str) -> Vec<Row> {
    let marker = format!("<!-- checked: {name} -->");
    let lines: Vec<&str> = doc.lines().collect();
    let mut rows = Vec::new();
    let mut tables = 0;
    for (i, line) in lines.iter().enumerate() {
        if line.trim() != marker {
            continue;
        }
        tables += 1;
        let table: Vec<&str> = lines[i + 1..]
            .iter()
            .skip_while(|l| l.trim().is_empty())
            .take_while(|l| l.trim_start().starts_with('|'))
            .copied()
            .collect();
        assert!(
            table.len() > 2,
            "{DOC}: no table after `{marker}` (line {})",
            i + 1
        );
        for line in &table[2..] {
            let cells: Vec<String> = split_cells(line);
            let first = cells.first().cloned().unwrap_or_default();
            let key = first
                .split('`')
                .nth(1)
                .unwrap_or_else(|| panic!("{DOC}: row without a `key` in its first cell: {line}"))
                .to_string();
            rows.push(Row {
                key,
                cells,
                line: line.to_string(),
            });
        }
    }
    assert!(tables > 0, "{DOC} has no `{marker}` table");
    rows
}

/// The cells of a Markdown table line (`\|` inside a cell is not a separator).
fn split_cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    let mut cells = vec![String::new()];
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                cells.last_mut().unwrap().push('|');
                chars.next();
            }
            '|' => cells.push(String::new()),
            c => cells.last_mut().unwrap().push(c),
        }
    }
    cells.iter().map(|c| c.trim().to_string()).collect()
}

/// The rows by key; a key documented twice is an error.
fn by_key(rows: &[Row], table: &str) -> BTreeMap<String, Row> {
    let mut map = BTreeMap::new();
    for r in rows {
        assert!(
            map.insert(r.key.clone(), r.clone()).is_none(),
            "{DOC}: `{}` has two rows in the `{table}` tables",
            r.key
        );
    }
    map
}

/// The code block (its lines) that follows `<!-- checked: name -->`.
fn checked_block(doc: &str, name: &str) -> String {
    let marker = format!("<!-- checked: {name} -->");
    let after = doc
        .split_once(&marker)
        .unwrap_or_else(|| panic!("{DOC} has no `{marker}`"))
        .1;
    let body = after
        .trim_start()
        .split_once('\n')
        .filter(|(fence, _)| fence.starts_with("```"))
        .unwrap_or_else(|| panic!("{DOC}: no code block after `{marker}`"))
        .1;
    body.split_once("\n```")
        .unwrap_or_else(|| panic!("{DOC}: unterminated code block after `{marker}`"))
        .0
        .to_string()
}

/// Compares the documented keys with the code's, both ways, naming what differs.
fn assert_same_keys(table: &str, documented: &BTreeSet<String>, code: &BTreeSet<String>) {
    let missing: Vec<_> = code.difference(documented).collect();
    let gone: Vec<_> = documented.difference(code).collect();
    assert!(
        missing.is_empty() && gone.is_empty(),
        "{DOC}, `{table}` tables:\n  in the code but not documented: {missing:?}\n  documented \
         but not in the code (removed or misspelt): {gone:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Asking a parser which fields it accepts
// ---------------------------------------------------------------------------------------------

/// A field name no format has: placed somewhere, it is refused, and the refusal lists what was
/// expected there.
const PROBE: &str = "zz_docs_probe";

/// One step of a path into a document.
#[derive(Debug, Clone, PartialEq)]
enum Step {
    Field(String),
    /// The first item of a list.
    Item,
    /// An entry of a map with keys of the user's choosing (`rules.<name>` of the policy).
    Entry,
}

/// The map key used for [`Step::Entry`].
const ENTRY_KEY: &str = "r";

/// A path as serde_path_to_error prints it (`rules[0].match.zz`).
fn error_path(path: &[Step]) -> String {
    let mut s = String::new();
    for step in path {
        let name = match step {
            Step::Item => {
                s.push_str("[0]");
                continue;
            }
            Step::Field(f) => f.as_str(),
            Step::Entry => ENTRY_KEY,
        };
        if !s.is_empty() {
            s.push('.');
        }
        s.push_str(name);
    }
    s
}

/// A path as the document writes it (`rules[].match`, `rules.<name>.capacity`).
fn doc_path(path: &[Step]) -> String {
    let mut s = String::new();
    for step in path {
        match step {
            Step::Field(f) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(f);
            }
            Step::Item => s.push_str("[]"),
            Step::Entry => s.push_str(".<name>"),
        }
    }
    s
}

/// `doc` with `value` at `path`, creating what is missing; an object already there gets the
/// value's entries added instead (so required siblings stay).
fn place(doc: &mut Value, path: &[Step], value: &Value) {
    let Some((step, rest)) = path.split_first() else {
        match (doc.as_object_mut(), value.as_object()) {
            (Some(here), Some(new)) => here.extend(new.clone()),
            _ => *doc = value.clone(),
        }
        return;
    };
    let next = match step {
        Step::Field(f) => object(doc).entry(f.clone()).or_insert(Value::Null),
        Step::Entry => object(doc)
            .entry(ENTRY_KEY.to_string())
            .or_insert(Value::Null),
        Step::Item => {
            if doc.as_array().is_none_or(|a| a.is_empty()) {
                *doc = json!([null]);
            }
            &mut doc.as_array_mut().unwrap()[0]
        }
    };
    place(next, rest, value);
}

fn object(v: &mut Value) -> &mut serde_json::Map<String, Value> {
    if !v.is_object() {
        *v = json!({});
    }
    v.as_object_mut().unwrap()
}

/// A parser's first refusal of a document: where, and what it said.
struct Refusal {
    path: String,
    message: String,
}

/// A format: a valid document to start from, and its parser (`None`: accepted).
struct Format {
    name: &'static str,
    base: Value,
    refuse: fn(&Value) -> Option<Refusal>,
}

/// What sits at a path.
#[derive(Debug, Clone, PartialEq)]
enum Shape {
    /// A struct with these fields; `via` is how to reach it (itself, a list's item, a map entry).
    Struct {
        fields: Vec<String>,
        via: Vec<Step>,
    },
    /// An enum (or a list of one) with these values.
    Enum(Vec<String>),
    Other,
}

/// The backticked names after "expected" in a serde refusal.
fn expected_names(message: &str) -> Vec<String> {
    let Some((_, list)) = message.split_once("expected") else {
        return Vec::new();
    };
    list.split('`')
        .skip(1)
        .step_by(2)
        .map(String::from)
        .collect()
}

impl Format {
    /// Probes `path` as an object, then as a list of them, then as a map of them.
    fn shape(&self, path: &[Step]) -> Shape {
        for via in [vec![], vec![Step::Item], vec![Step::Entry]] {
            let at: Vec<Step> = path.iter().cloned().chain(via.clone()).collect();
            let mut doc = self.base.clone();
            // A value no scalar, list or map of scalars accepts, after the probe's name.
            place(&mut doc, &at, &json!({ PROBE: [[{}]] }));
            let Some(r) = (self.refuse)(&doc) else {
                continue;
            };
            let mut probe_path = at.clone();
            probe_path.push(Step::Field(PROBE.into()));
            // (serde_yaml_ng puts the path in front of its message too.)
            if r.path == error_path(&probe_path)
                && r.message.contains(&format!("unknown field `{PROBE}`"))
            {
                return Shape::Struct {
                    fields: expected_names(&r.message),
                    via,
                };
            }
            if r.path.starts_with(&error_path(&at))
                && r.message.contains(&format!("unknown variant `{PROBE}`"))
            {
                return Shape::Enum(expected_names(&r.message));
            }
        }
        Shape::Other
    }

    /// Every field path the format accepts (document form), with the values of enumerated ones.
    fn fields(&self) -> BTreeMap<String, Vec<String>> {
        let mut out = BTreeMap::new();
        let Shape::Struct { fields, via } = self.shape(&[]) else {
            panic!(
                "{}: the top level does not refuse unknown fields; the probe cannot work",
                self.name
            );
        };
        assert!(
            via.is_empty(),
            "{}: the top level is not an object",
            self.name
        );
        self.walk(&[], fields, &mut vec![], &mut out);
        out
    }

    fn walk(
        &self,
        at: &[Step],
        fields: Vec<String>,
        ancestors: &mut Vec<Vec<String>>,
        out: &mut BTreeMap<String, Vec<String>>,
    ) {
        ancestors.push(sorted(&fields));
        for f in fields {
            let mut path = at.to_vec();
            path.push(Step::Field(f));
            let shape = self.shape(&path);
            out.insert(
                doc_path(&path),
                match &shape {
                    Shape::Enum(values) => values.clone(),
                    _ => Vec::new(),
                },
            );
            if let Shape::Struct { fields, via } = shape {
                // A recursive structure (descriptors of descriptors) is documented once.
                if !ancestors.contains(&sorted(&fields)) {
                    path.extend(via);
                    self.walk(&path, fields, ancestors, out);
                }
            }
        }
        ancestors.pop();
    }
}

fn sorted(v: &[String]) -> Vec<String> {
    let mut v = v.to_vec();
    v.sort();
    v
}

fn filter_config() -> Format {
    Format {
        name: "the filter's plugin configuration",
        base: json!({"sidecar": {"cluster": "s"}, "rules": [{"name": "g", "subject": []}]}),
        refuse: |doc| {
            ratelimit_filter::config::Config::from_json(doc.to_string().as_bytes())
                .err()
                .map(|e| Refusal {
                    path: e.problems[0].path.clone(),
                    message: e.problems[0].message.clone(),
                })
        },
    }
}

/// The first problem of a policy document: `probe.yaml: <path>: <message>`.
fn refuse_policy(doc: &Value) -> Option<Refusal> {
    // JSON is YAML: the policy parser reads it as it is.
    let sources = [("probe.yaml".to_string(), doc.to_string())];
    let e = Policy::from_sources(&sources, &Bounds::default()).err()?;
    let p = &e.problems[0];
    let path = p
        .path
        .strip_prefix("probe.yaml")
        .unwrap_or(&p.path)
        .trim_start_matches(": ");
    Some(Refusal {
        path: path.to_string(),
        message: p.message.clone(),
    })
}

fn policy_own() -> Format {
    Format {
        name: "the policy's own format",
        base: json!({"rules": {}}),
        refuse: refuse_policy,
    }
}

fn policy_envoy() -> Format {
    Format {
        name: "envoyproxy/ratelimit's policy format",
        base: json!({"domain": "d", "descriptors": []}),
        refuse: refuse_policy,
    }
}

fn decide_request() -> Format {
    Format {
        name: "a POST /v1/decide call",
        base: json!({"requests": [{"decisions": [{"rule": "r"}]}]}),
        refuse: |doc| {
            let e = ratelimit_sidecar::decide::parse_request(doc.to_string().as_bytes()).err()?;
            let text = e.to_string();
            let (path, message) = text.split_once(": ").unwrap_or(("", &text));
            Some(Refusal {
                path: path.to_string(),
                message: message.to_string(),
            })
        },
    }
}

/// Checks a format's fields against the `table` rows, both ways, and every enumerated value.
fn check_format(doc: &str, table: &str, format: &Format) {
    let fields = format.fields();
    assert!(
        fields.len() > 3,
        "{}: the probe found only {fields:?}",
        format.name
    );
    let rows = by_key(&checked_rows(doc, table), table);
    assert_same_keys(
        table,
        &rows.keys().cloned().collect(),
        &fields.keys().cloned().collect(),
    );
    for (path, values) in &fields {
        let row = &rows[path];
        let missing: Vec<_> = values.iter().filter(|v| !row.mentions(v)).collect();
        assert!(
            missing.is_empty(),
            "{DOC}: the row of `{path}` does not name the values {missing:?} ({} accepts {values:?})",
            format.name
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The tests
// ---------------------------------------------------------------------------------------------

#[test]
fn every_sidecar_flag_is_documented_with_its_variable_default_and_values() {
    let out = Command::new(Sidecar::bin())
        .arg("--help")
        // The environment's values would show as `[env: NAME=value]`.
        .env_clear()
        .output()
        .expect("run ratelimit-sidecar --help");
    assert!(out.status.success(), "ratelimit-sidecar --help failed");
    let help = String::from_utf8(out.stdout).expect("UTF-8 help");
    let flags = parse_help(&help);
    assert!(
        flags.contains_key("--limits") && flags.contains_key("--help") && flags.len() > 10,
        "could not read the flags of:\n{help}"
    );
    let doc = read(DOC);
    let rows = by_key(&checked_rows(&doc, "sidecar-flags"), "sidecar-flags");
    assert_same_keys(
        "sidecar-flags",
        &rows
            .keys()
            .map(|k| k.split_whitespace().next().unwrap_or_default().to_string())
            .collect(),
        &flags.keys().cloned().collect(),
    );
    for (flag, f) in &flags {
        let row = rows
            .values()
            .find(|r| r.key.split_whitespace().next() == Some(flag))
            .expect("compared above");
        let env_cell = row.cells.get(1).map(String::as_str).unwrap_or_default();
        match &f.env {
            Some(env) => assert_eq!(
                env_cell,
                format!("`{env}`"),
                "{DOC}: the row of {flag} should name its variable `{env}`"
            ),
            None => assert!(
                env_cell.is_empty(),
                "{DOC}: {flag} has no environment variable, the row says {env_cell}"
            ),
        }
        if let Some(default) = &f.default {
            assert!(
                row.cells
                    .get(2)
                    .is_some_and(|c| c.contains(&format!("`{default}`"))),
                "{DOC}: the row of {flag} should give its default `{default}`"
            );
        }
        for v in &f.values {
            assert!(
                row.mentions(v),
                "{DOC}: the row of {flag} should name its value `{v}`"
            );
        }
    }
}

/// What `--help` says about one flag.
#[derive(Debug, Default)]
struct Flag {
    env: Option<String>,
    default: Option<String>,
    values: Vec<String>,
}

/// The long flags of clap's `--help`: a line starting with `-` (after indentation) names a flag;
/// the lines after it, up to the next, describe it (`[env: NAME=]`, `[default: X]`,
/// `[possible values: a, b]`).
fn parse_help(help: &str) -> BTreeMap<String, Flag> {
    let mut flags: BTreeMap<String, Flag> = BTreeMap::new();
    let mut current: Option<String> = None;
    let mut text: BTreeMap<String, String> = BTreeMap::new();
    for line in help.lines() {
        let t = line.trim_start();
        // Flags are indented by 2 or 6 spaces, their descriptions by 10.
        let indent = line.len() - t.len();
        if (1..=6).contains(&indent) && t.starts_with('-') {
            let long = t
                .split_whitespace()
                .map(|w| w.trim_end_matches(','))
                .find(|w| w.starts_with("--"));
            current = long.map(String::from);
            if let Some(l) = &current {
                flags.insert(l.clone(), Flag::default());
                text.insert(l.clone(), String::new());
            }
            continue;
        }
        if line.trim().is_empty() || !line.starts_with(' ') {
            continue;
        }
        if let Some(l) = &current {
            let t = text.get_mut(l).unwrap();
            t.push(' ');
            t.push_str(line.trim());
        }
    }
    let bracket = |s: &str, tag: &str| -> Option<String> {
        let start = s.find(&format!("[{tag}: "))? + tag.len() + 3;
        let end = start + s[start..].find(']')?;
        Some(s[start..end].to_string())
    };
    for (flag, t) in &text {
        let f = flags.get_mut(flag).unwrap();
        f.env = bracket(t, "env").map(|e| e.trim_end_matches('=').to_string());
        f.default = bracket(t, "default");
        f.values = bracket(t, "possible values")
            .map(|v| v.split(", ").map(String::from).collect())
            .unwrap_or_default();
    }
    flags
}

#[test]
fn every_field_of_the_filter_configuration_is_documented() {
    let doc = read(DOC);
    check_format(&doc, "filter-config", &filter_config());
}

#[test]
fn every_key_of_both_policy_formats_is_documented() {
    let doc = read(DOC);
    check_format(&doc, "policy-own", &policy_own());
    check_format(&doc, "policy-envoy", &policy_envoy());
}

#[test]
fn every_field_of_a_decide_call_and_its_answer_is_documented() {
    let doc = read(DOC);
    check_format(&doc, "decide-request", &decide_request());

    // An answer with every optional field present.
    let full = DecideResponse {
        answers: vec![RequestAnswer {
            allowed: true,
            results: vec![DecisionResult {
                receipt: Some("1".into()),
                allowed: true,
                remaining: 1,
                retry_after_ms: 1,
                reset_ms: 1,
                reason: Reason::Ok,
                limit: Some(AppliedLimit {
                    name: "l".into(),
                    capacity: 1,
                    refill_per_sec: 1.0,
                }),
                shadow: true,
                leased: 1,
                error: Some(RequestError {
                    code: ErrorCode::UnknownRule,
                    message: "m".into(),
                }),
            }],
            error: Some(RequestError {
                code: ErrorCode::UnknownRule,
                message: "m".into(),
            }),
            slot: Some(HeldSlot {
                id: "s".into(),
                ttl_ms: 1,
                decisions: vec![0],
            }),
        }],
        epoch: Some(1),
    };
    let mut fields = BTreeSet::new();
    collect_paths(&serde_json::to_value(&full).unwrap(), "", &mut fields);
    let rows = by_key(&checked_rows(&doc, "decide-response"), "decide-response");
    assert_same_keys("decide-response", &rows.keys().cloned().collect(), &fields);
    for (path, values) in [
        ("answers[].results[].reason", variants::<Reason>()),
        ("answers[].error.code", variants::<ErrorCode>()),
    ] {
        assert!(values.len() > 2, "{path}: {values:?}");
        for v in &values {
            assert!(
                rows[path].mentions(v),
                "{DOC}: the row of `{path}` should name `{v}`"
            );
        }
    }
}

/// Every field path of a JSON value (lists as `[]`).
fn collect_paths(v: &Value, at: &str, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                let p = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                out.insert(p.clone());
                collect_paths(v, &p, out);
            }
        }
        Value::Array(items) => {
            for item in items {
                collect_paths(item, &format!("{at}[]"), out);
            }
        }
        _ => {}
    }
}

/// The values of an enum, from serde's refusal of one it does not have.
fn variants<T: serde::de::DeserializeOwned>() -> Vec<String> {
    let e = serde_json::from_value::<T>(json!(PROBE))
        .err()
        .expect("the probe is no value");
    expected_names(&e.to_string())
}

#[test]
fn the_bounds_table_gives_the_constants() {
    let constants: BTreeMap<&str, u64> = [
        ("MAX_REQUESTS", ratelimit_wire::MAX_REQUESTS as u64),
        ("MAX_DECISIONS", ratelimit_wire::MAX_DECISIONS as u64),
        (
            "MAX_CALL_DECISIONS",
            ratelimit_wire::MAX_CALL_DECISIONS as u64,
        ),
        (
            "MAX_SUBJECT_ENTRIES",
            ratelimit_wire::MAX_SUBJECT_ENTRIES as u64,
        ),
        ("MAX_NAME_BYTES", ratelimit_wire::MAX_NAME_BYTES as u64),
        ("MAX_VALUE_BYTES", ratelimit_wire::MAX_VALUE_BYTES as u64),
        ("MAX_RETURNS", ratelimit_wire::MAX_RETURNS as u64),
        ("MAX_SETTLEMENTS", ratelimit_wire::MAX_SETTLEMENTS as u64),
        ("MAX_SLOT_UPDATES", ratelimit_wire::MAX_SLOT_UPDATES as u64),
        (
            "MAX_SLOT_ID_BYTES",
            ratelimit_wire::MAX_SLOT_ID_BYTES as u64,
        ),
        ("MAX_LEASE_ID", ratelimit_wire::MAX_LEASE_ID),
        (
            "MAX_BODY_BYTES",
            ratelimit_wire::budget::MAX_BODY_BYTES as u64,
        ),
        ("MAX_RECEIPT", ratelimit_wire::MAX_RECEIPT),
        (
            "MAX_LEASE_TTL_MS",
            ratelimit_sidecar::decide::MAX_LEASE_TTL_MS,
        ),
        ("MAX_CAPACITY", ratelimit_sidecar::policy::MAX_CAPACITY),
    ]
    .into();
    let doc = read(DOC);
    let rows = by_key(&checked_rows(&doc, "wire-bounds"), "wire-bounds");
    assert_same_keys(
        "wire-bounds",
        &rows.keys().cloned().collect(),
        &constants.keys().map(|k| k.to_string()).collect(),
    );
    for (name, value) in constants {
        assert_eq!(
            rows[name].cells.get(1).map(String::as_str),
            Some(value.to_string().as_str()),
            "{DOC}: the bound `{name}` is {value}"
        );
    }
}

#[test]
fn the_worked_examples_are_the_shipped_files() {
    let doc = read(DOC);
    let documented: Value = serde_json::from_str(&checked_block(&doc, "envoy-yaml-example"))
        .expect("the documented plugin configuration is JSON");
    assert_eq!(
        documented,
        plugin_json(&read("envoy/envoy.yaml")),
        "{DOC}: the example is not the plugin configuration of envoy/envoy.yaml"
    );
    let yaml = |text: &str| -> serde_yaml_ng::Value {
        serde_yaml_ng::from_str(text).expect("the policy example is YAML")
    };
    assert_eq!(
        yaml(&checked_block(&doc, "limits-yaml-example")),
        yaml(&read("envoy/limits.yaml")),
        "{DOC}: the example is not envoy/limits.yaml"
    );
}

#[test]
fn the_probe_finds_fields_at_every_depth_and_stops_at_recursion() {
    // The probe itself, on what it must find: a nested list's field, a map entry's field, an
    // enum's values, and the recursive descriptor tree documented once.
    let filter = filter_config().fields();
    assert_eq!(filter["rules[].on_error"], ["allow", "deny", "local"]);
    assert!(filter.contains_key("rules[].match.headers[].present"));
    assert!(filter.contains_key("fast_paths.leases.ttl_ms"));
    assert!(filter.contains_key("identity.api_key.keys"));
    assert!(!filter
        .keys()
        .any(|k| k.starts_with("identity.api_key.keys.")));
    let own = policy_own().fields();
    assert!(own.contains_key("rules.<name>.overrides[].when"));
    let envoy = policy_envoy().fields();
    assert!(envoy.contains_key("descriptors[].rate_limit.replaces[].name"));
    assert!(envoy.contains_key("descriptors[].descriptors"));
    assert!(!envoy.contains_key("descriptors[].descriptors[].key"));
    // And the table reader: a row whose cells hold an escaped pipe.
    assert_eq!(split_cells("| `a` | x \\| y | z |"), ["`a`", "x | y", "z"]);
}
