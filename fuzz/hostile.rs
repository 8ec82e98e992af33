//! Generators of hostile input for the fuzz targets, shared by the filter's and the sidecar's (each
//! includes this file with `#[path]`, next to `harness.rs`):
//!
//! - [`bytes`]: arbitrary bytes, and bytes drawn from JSON's and YAML's punctuation;
//! - [`Doc`]: a JSON document that can hold what `serde_json::Value` cannot (duplicated keys,
//!   raw text such as `NaN` or a lone surrogate escape), written as JSON or as block YAML;
//! - [`hostile`]: values that break assumptions (huge and negative numbers, NaN-like strings,
//!   deep nesting, unicode, control bytes, very long strings, long arrays);
//! - [`mutated`]: a valid document with a few of those mutations applied (a string or a number
//!   replaced by another, any value replaced by a hostile one, a key removed, renamed, duplicated
//!   or added, an array repeated past its bound), and sometimes its text cut or spliced, so most
//!   inputs are near-valid and reach the checks behind the parser.

#![allow(dead_code)]

use proptest::prelude::*;
use serde_json::Value;

/// A JSON document; objects keep their entries in order, duplicates included.
#[derive(Debug, Clone, PartialEq)]
pub enum Doc {
    Null,
    Bool(bool),
    /// A number, as its text (so `1e999` or `18446744073709551616` survive).
    Num(String),
    Str(String),
    Arr(Vec<Doc>),
    Obj(Vec<(String, Doc)>),
    /// Text written as it is, valid JSON or not (`NaN`, `"\ud800"`, `[[[[...`).
    Raw(String),
}

impl Doc {
    pub fn from_value(v: &Value) -> Doc {
        match v {
            Value::Null => Doc::Null,
            Value::Bool(b) => Doc::Bool(*b),
            Value::Number(n) => Doc::Num(n.to_string()),
            Value::String(s) => Doc::Str(s.clone()),
            Value::Array(a) => Doc::Arr(a.iter().map(Doc::from_value).collect()),
            Value::Object(o) => Doc::Obj(
                o.iter()
                    .map(|(k, v)| (k.clone(), Doc::from_value(v)))
                    .collect(),
            ),
        }
    }

    /// The document as JSON text.
    pub fn json(&self) -> String {
        let mut out = String::new();
        self.write_json(&mut out);
        out
    }

    fn write_json(&self, out: &mut String) {
        match self {
            Doc::Null => out.push_str("null"),
            Doc::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Doc::Num(n) | Doc::Raw(n) => out.push_str(n),
            Doc::Str(s) => out.push_str(&quoted(s)),
            Doc::Arr(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    item.write_json(out);
                }
                out.push(']');
            }
            Doc::Obj(entries) => {
                out.push('{');
                for (i, (k, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&quoted(k));
                    out.push(':');
                    v.write_json(out);
                }
                out.push('}');
            }
        }
    }

    /// The document as block YAML (scalars double-quoted as JSON strings, which YAML reads the
    /// same; raw text and numbers as they are).
    pub fn yaml(&self) -> String {
        let mut out = String::new();
        self.write_yaml(&mut out, 0);
        if !out.ends_with('\n') {
            out.push('\n');
        }
        out
    }

    fn write_yaml(&self, out: &mut String, indent: usize) {
        let pad = " ".repeat(indent);
        match self {
            Doc::Arr(items) if !items.is_empty() => {
                for item in items {
                    out.push_str(&pad);
                    out.push_str("- ");
                    item.write_yaml_inline(out, indent + 2);
                }
            }
            Doc::Obj(entries) if !entries.is_empty() => {
                for (k, v) in entries {
                    out.push_str(&pad);
                    out.push_str(&quoted(k));
                    out.push(':');
                    match v {
                        Doc::Arr(a) if !a.is_empty() => {
                            out.push('\n');
                            v.write_yaml(out, indent + 2);
                        }
                        Doc::Obj(o) if !o.is_empty() => {
                            out.push('\n');
                            v.write_yaml(out, indent + 2);
                        }
                        _ => {
                            out.push(' ');
                            v.write_yaml_inline(out, indent + 2);
                        }
                    }
                }
            }
            scalar => {
                out.push_str(&pad);
                scalar.write_yaml_inline(out, indent);
            }
        }
    }

    /// After `- ` or `key: `: a scalar on this line, or a collection starting on this line.
    fn write_yaml_inline(&self, out: &mut String, indent: usize) {
        match self {
            Doc::Arr(a) if !a.is_empty() => {
                // The first item on this line, the others below at `indent`.
                let mut nested = String::new();
                self.write_yaml(&mut nested, indent);
                out.push_str(nested.trim_start());
            }
            Doc::Obj(o) if !o.is_empty() => {
                let mut nested = String::new();
                self.write_yaml(&mut nested, indent);
                out.push_str(nested.trim_start());
            }
            other => {
                other.write_json(out);
                out.push('\n');
            }
        }
    }

    /// How many nodes the document has (mutations pick one by its preorder index).
    pub fn size(&self) -> usize {
        1 + match self {
            Doc::Arr(a) => a.iter().map(Doc::size).sum(),
            Doc::Obj(o) => o.iter().map(|(_, v)| v.size()).sum(),
            _ => 0,
        }
    }

    /// The node with preorder index `n`.
    fn node_mut(&mut self, n: usize) -> Option<&mut Doc> {
        if n == 0 {
            return Some(self);
        }
        let mut n = n - 1;
        let children: Vec<&mut Doc> = match self {
            Doc::Arr(a) => a.iter_mut().collect(),
            Doc::Obj(o) => o.iter_mut().map(|(_, v)| v).collect(),
            _ => return None,
        };
        for child in children {
            let size = child.size();
            if n < size {
                return child.node_mut(n);
            }
            n -= size;
        }
        None
    }

    /// The object or array nodes, by preorder index.
    fn containers(&self) -> usize {
        (matches!(self, Doc::Arr(_) | Doc::Obj(_)) as usize)
            + match self {
                Doc::Arr(a) => a.iter().map(Doc::containers).sum(),
                Doc::Obj(o) => o.iter().map(|(_, v)| v.containers()).sum(),
                _ => 0,
            }
    }

    fn container_mut(&mut self, n: usize) -> Option<&mut Doc> {
        let here = matches!(self, Doc::Arr(_) | Doc::Obj(_));
        if here && n == 0 {
            return Some(self);
        }
        let mut n = n - usize::from(here);
        let children: Vec<&mut Doc> = match self {
            Doc::Arr(a) => a.iter_mut().collect(),
            Doc::Obj(o) => o.iter_mut().map(|(_, v)| v).collect(),
            _ => return None,
        };
        for child in children {
            let c = child.containers();
            if n < c {
                return child.container_mut(n);
            }
            n -= c;
        }
        None
    }

    /// Every string in the document, keys included (vocabulary for probing what was parsed).
    pub fn strings(&self, out: &mut Vec<String>) {
        match self {
            Doc::Str(s) => out.push(s.clone()),
            Doc::Arr(a) => a.iter().for_each(|d| d.strings(out)),
            Doc::Obj(o) => o.iter().for_each(|(k, v)| {
                out.push(k.clone());
                v.strings(out);
            }),
            _ => {}
        }
    }
}

/// `s` as a JSON string literal.
pub fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_string())
}

/// Arbitrary bytes: uniform, or drawn from the punctuation and words of JSON and YAML, so some
/// reach past the first byte of a parser.
pub fn bytes(max_len: usize) -> BoxedStrategy<Vec<u8>> {
    const PIECES: &[&str] = &[
        "{",
        "}",
        "[",
        "]",
        "\"",
        ":",
        ",",
        "-",
        "0",
        "1",
        "9",
        ".",
        "e",
        "E",
        "+",
        "true",
        "false",
        "null",
        " ",
        "\n",
        "\t",
        "\\",
        "\\u",
        "d800",
        "a",
        "\u{e9}",
        "\u{1f600}",
        "\0",
        "&a",
        "*a",
        "!!",
        "|",
        ">",
        "? ",
        "- ",
        ": ",
        "#",
        "'",
        "%",
        "---",
        "...",
        "~",
        "NaN",
        ".inf",
        "rules",
        "descriptors",
        "domain",
        "requests",
        "decisions",
        "rule",
        "capacity",
        "answers",
    ];
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..max_len),
        prop::collection::vec(prop::sample::select(PIECES), 0..max_len / 2)
            .prop_map(|p| p.concat().into_bytes()),
    ]
    .boxed()
}

/// Numbers as text that stress a parser or the bounds behind it.
pub const NUMBERS: &[&str] = &[
    "0",
    "-0",
    "1",
    "-1",
    "2",
    "7",
    "64",
    "65",
    "128",
    "129",
    "256",
    "257",
    "1024",
    "4096",
    "60000",
    "60001",
    "65535",
    "65536",
    "4294967295",
    "4294967296",
    "9007199254740991",
    "9007199254740992",
    "9007199254740993",
    "999999999999999",
    "1000000000000000",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775809",
    "18446744073709551615",
    "18446744073709551616",
    "123456789012345678901234567890",
    "0.5",
    "1.0",
    "1e2",
    "1E+2",
    "1e-7",
    "1e308",
    "1e309",
    "-1e309",
    "1e999",
    "4.9e-324",
    "1e-400",
    "2.2250738585072014e-308",
    "31536000",
    "31536001",
];

/// Text that is not JSON (or not what a field expects) in a value's place.
pub const RAW: &[&str] = &[
    "NaN",
    "-NaN",
    "Infinity",
    "-Infinity",
    "nan",
    "inf",
    "+1",
    "01",
    ".5",
    "1.",
    "1e",
    "--1",
    "0x10",
    "undefined",
    "\"\\ud800\"",
    "\"\\udc00\\ud800\"",
    "\"\\u0000\"",
    "\"\\x41\"",
    "\"\\",
    "'single'",
    "",
    "{",
    "[",
    "]",
    "}",
    ",",
    ":",
    "[,]",
    "{,}",
    "{\"a\":}",
    "[1,]",
    "tru",
    "nul",
];

/// Strings whose content stresses what reads them.
pub const STRINGS: &[&str] = &[
    "",
    " ",
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1",
    "0",
    "18446744073709551616",
    "null",
    "true",
    "\0",
    "\u{7f}",
    "\r\n",
    "a\r\nx-injected: 1",
    "\"",
    "\\",
    "\"; q=1",
    "\u{feff}",
    "\u{200b}",
    "\u{202e}",
    "e\u{301}",
    "\u{1f600}",
    "\u{10ffff}",
    "\u{fffd}",
    "é",
    "日本",
    "{",
    "}",
    "{x}",
    "}{",
    "|",
    "=",
    "%",
    "%00",
    "~",
    "#",
    ":a:",
    "rule",
    "user",
    "app",
    "ip",
    "tenant",
    "route",
    "/",
    "//",
    "/../",
    "/api/",
    "/api/../admin",
    "GET",
    "get",
    "POST",
    "x-api-key",
    "X-API-KEY",
    ":authority",
    "ratelimit",
    "per-app",
    "per-ip",
    "per-user",
    "local",
    "allow",
    "deny",
    "shared",
    "skip",
    "reject",
    "always",
    "never",
    "on_reject",
    "ok",
    "insufficient",
    "cost_exceeds_capacity",
    "blocked",
    "unlimited",
    "unknown_rule",
    "unavailable",
    "script_failed",
    "second",
    "MINUTE",
    "hour",
    "fortnight",
    "10.0.0.1",
    "10.0.0.1:80",
    "[::1]:80",
    "::ffff:1.2.3.4",
    "677509799af78b2efa2f2af71d0f906e0a0c50c048efd3b515625f788e92b99a",
];

/// A string: one of [`STRINGS`], random text, control bytes, or a long repetition (up to
/// `max_len` bytes).
pub fn string(max_len: usize) -> BoxedStrategy<String> {
    prop_oneof![
        4 => prop::sample::select(STRINGS).prop_map(str::to_string),
        2 => ".{0,24}",
        1 => "[\\x00-\\x1f\\x7f]{1,8}",
        1 => "[A-Za-z0-9_.-]{1,140}",
        1 => (prop::sample::select(STRINGS), 1..=max_len.max(1))
            .prop_map(move |(s, n)| {
                let unit = if s.is_empty() { "a" } else { s };
                let mut out = unit.repeat(n / unit.len() + 1);
                let mut cut = n.min(out.len());
                while !out.is_char_boundary(cut) {
                    cut -= 1;
                }
                out.truncate(cut);
                out
            }),
    ]
    .boxed()
}

/// A hostile value for any place in a document.
pub fn hostile(max_len: usize) -> BoxedStrategy<Doc> {
    let leaf = prop_oneof![
        3 => prop::sample::select(NUMBERS).prop_map(|n| Doc::Num(n.to_string())),
        3 => string(max_len).prop_map(Doc::Str),
        1 => prop::sample::select(RAW).prop_map(|r| Doc::Raw(r.to_string())),
        1 => Just(Doc::Null),
        1 => any::<bool>().prop_map(Doc::Bool),
        1 => Just(Doc::Arr(Vec::new())),
        1 => Just(Doc::Obj(Vec::new())),
        1 => (1usize..400, any::<bool>()).prop_map(|(depth, arrays)| Doc::Raw(if arrays {
            format!("{}{}", "[".repeat(depth), "]".repeat(depth))
        } else {
            format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth))
        })),
    ];
    leaf.prop_recursive(2, 12, 4, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Doc::Arr),
            prop::collection::vec((string(16), inner), 0..4).prop_map(Doc::Obj),
        ]
    })
    .boxed()
}

/// One mutation of a document.
#[derive(Debug, Clone)]
pub enum Mutation {
    /// Replace the node at this preorder index.
    Replace(usize, Doc),
    /// Remove an entry or item of the container at this index.
    Remove(usize, usize),
    /// Add an entry (a new key, or a copy of an existing key: a duplicate) or an item.
    Add(usize, String, Doc, bool),
    /// Rename an entry's key.
    Rename(usize, usize, String),
    /// Repeat an array's first item until it holds `n` items (past a count bound).
    Repeat(usize, usize),
    /// Replace the n-th string of the document with another string: the document keeps its
    /// shape, so the value reaches the checks behind the parser.
    String(usize, String),
    /// Replace the n-th number of the document with another number (text).
    Number(usize, String),
}

fn mutation(max_len: usize) -> BoxedStrategy<Mutation> {
    prop_oneof![
        5 => (any::<usize>(), hostile(max_len)).prop_map(|(i, d)| Mutation::Replace(i, d)),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(i, j)| Mutation::Remove(i, j)),
        2 => (any::<usize>(), string(32), hostile(max_len), any::<bool>())
            .prop_map(|(i, k, d, dup)| Mutation::Add(i, k, d, dup)),
        1 => (any::<usize>(), any::<usize>(), string(32))
            .prop_map(|(i, j, k)| Mutation::Rename(i, j, k)),
        1 => (any::<usize>(), prop::sample::select(&[2usize, 8, 9, 65, 129, 257, 1025][..]))
            .prop_map(|(i, n)| Mutation::Repeat(i, n)),
        4 => (any::<usize>(), string(max_len)).prop_map(|(i, s)| Mutation::String(i, s)),
        3 => (any::<usize>(), prop::sample::select(NUMBERS))
            .prop_map(|(i, n)| Mutation::Number(i, n.to_string())),
    ]
    .boxed()
}

impl Mutation {
    pub fn apply(&self, doc: &mut Doc) {
        match self {
            Mutation::Replace(i, d) => {
                let n = doc.size();
                if let Some(node) = doc.node_mut(i % n) {
                    *node = d.clone();
                }
            }
            Mutation::Remove(i, j) => match container(doc, *i) {
                Some(Doc::Arr(a)) if !a.is_empty() => {
                    let j = j % a.len();
                    a.remove(j);
                }
                Some(Doc::Obj(o)) if !o.is_empty() => {
                    let j = j % o.len();
                    o.remove(j);
                }
                _ => {}
            },
            Mutation::Add(i, key, d, duplicate) => match container(doc, *i) {
                Some(Doc::Arr(a)) => a.push(d.clone()),
                Some(Doc::Obj(o)) => {
                    let key = match (duplicate, o.first()) {
                        (true, Some((k, _))) => k.clone(),
                        _ => key.clone(),
                    };
                    o.push((key, d.clone()));
                }
                _ => {}
            },
            Mutation::Rename(i, j, key) => {
                if let Some(Doc::Obj(o)) = container(doc, *i) {
                    if !o.is_empty() {
                        let j = j % o.len();
                        o[j].0 = key.clone();
                    }
                }
            }
            Mutation::Repeat(i, n) => {
                if let Some(Doc::Arr(a)) = container(doc, *i) {
                    if let Some(first) = a.first().cloned() {
                        a.resize(*n, first);
                    }
                }
            }
            Mutation::String(i, s) => {
                let mut found = Vec::new();
                scalars(doc, |d| matches!(d, Doc::Str(_)), &mut found);
                if !found.is_empty() {
                    let n = found.len();
                    *found.swap_remove(i % n) = Doc::Str(s.clone());
                }
            }
            Mutation::Number(i, text) => {
                let mut found = Vec::new();
                scalars(doc, |d| matches!(d, Doc::Num(_)), &mut found);
                if !found.is_empty() {
                    let n = found.len();
                    *found.swap_remove(i % n) = Doc::Num(text.clone());
                }
            }
        }
    }
}

/// The scalars of `doc` that `wanted` picks, in document order.
fn scalars<'a>(doc: &'a mut Doc, wanted: fn(&Doc) -> bool, out: &mut Vec<&'a mut Doc>) {
    match doc {
        Doc::Arr(a) => a.iter_mut().for_each(|d| scalars(d, wanted, out)),
        Doc::Obj(o) => o.iter_mut().for_each(|(_, d)| scalars(d, wanted, out)),
        other => {
            if wanted(other) {
                out.push(other);
            }
        }
    }
}

fn container(doc: &mut Doc, i: usize) -> Option<&mut Doc> {
    let n = doc.containers();
    if n == 0 {
        return None;
    }
    doc.container_mut(i % n)
}

/// How a mutated document's text is finally damaged, if at all.
#[derive(Debug, Clone)]
pub enum Damage {
    None,
    /// Cut at this fraction (per mille) of the text.
    Cut(u16),
    /// Insert this byte at this fraction (per mille) of the text.
    Splice(u16, u8),
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        8 => Just(Damage::None),
        1 => (0u16..1000).prop_map(Damage::Cut),
        1 => (0u16..1000, any::<u8>()).prop_map(|(at, b)| Damage::Splice(at, b)),
    ]
}

impl Damage {
    pub fn apply(&self, text: Vec<u8>) -> Vec<u8> {
        let at = |per_mille: u16| text.len() * usize::from(per_mille) / 1000;
        match self {
            Damage::None => text,
            Damage::Cut(p) => text[..at(*p)].to_vec(),
            Damage::Splice(p, b) => {
                let mut t = text.clone();
                t.insert(at(*p), *b);
                t
            }
        }
    }
}

/// A document made from `seed` by 1 to `max_mutations` mutations (0 included: the seed itself
/// stays in the mix), with the text of each possibly damaged afterwards.
pub fn mutated(
    seed: impl Strategy<Value = Doc> + 'static,
    max_mutations: usize,
    max_len: usize,
) -> BoxedStrategy<(Doc, Damage)> {
    (
        seed,
        prop::collection::vec(mutation(max_len), 0..=max_mutations),
        damage(),
    )
        .prop_map(|(mut doc, mutations, damage)| {
            for m in &mutations {
                m.apply(&mut doc);
            }
            (doc, damage)
        })
        .boxed()
}
