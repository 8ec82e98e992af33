//! The README and docs/ link to files and sections that exist: a renamed file or heading breaks
//! this test, not an operator's reading.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

/// The markdown files checked: README.md and every file under docs/.
fn documents() -> Vec<PathBuf> {
    let mut docs = vec![root().join("README.md")];
    for entry in std::fs::read_dir(root().join("docs")).expect("docs/") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            docs.push(path);
        }
    }
    docs.sort();
    docs
}

/// The targets of inline links `[text](target)` outside code blocks and code spans.
fn links(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_block = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if in_block {
            continue;
        }
        // Drop code spans, whose brackets are not links.
        let mut text = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 0 {
                text.push_str(part);
            }
        }
        let mut rest = text.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            match after.find(')') {
                Some(end) => {
                    out.push(after[..end].to_string());
                    rest = &after[end..];
                }
                None => break,
            }
        }
    }
    out
}

/// GitHub's anchor of a heading: lower case, spaces to '-', punctuation but '-' and '_' dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut in_block = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
        } else if !in_block && line.starts_with('#') {
            out.insert(anchor(line.trim_start_matches('#')));
        }
    }
    out
}

#[test]
fn every_relative_link_in_the_docs_reaches_a_file_and_a_heading() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).expect("read");
        for target in links(&text) {
            if target.starts_with("http://") || target.starts_with("https://") {
                continue;
            }
            checked += 1;
            let (file, fragment) = match target.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (target.as_str(), None),
            };
            let path = if file.is_empty() {
                doc.clone()
            } else {
                doc.parent().expect("a directory").join(file)
            };
            if !path.exists() {
                broken.push(format!("{}: {target}: no such file", doc.display()));
                continue;
            }
            if let Some(fragment) = fragment {
                let heads = anchors(&std::fs::read_to_string(&path).unwrap_or_default());
                if path.extension().is_some_and(|e| e == "md") && !heads.contains(fragment) {
                    broken.push(format!("{}: {target}: no such heading", doc.display()));
                }
            }
        }
    }
    assert!(checked > 20, "the links were found ({checked})");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn links_and_anchors_are_read_as_github_does() {
    assert_eq!(
        links("see [a](docs/a.md#x-y) and `[b](not)` and [c](#z)\n```\n[d](no)\n```"),
        vec!["docs/a.md#x-y", "#z"]
    );
    assert_eq!(
        anchor(" Using Envoy's native filter: `envoy/envoy-native-ratelimit.yaml`"),
        "using-envoys-native-filter-envoyenvoy-native-ratelimityaml"
    );
    assert_eq!(
        anchor("Identity: what names a client"),
        "identity-what-names-a-client"
    );
}
