//! What both sides must agree on about names and keys, written once: the name rule of domains,
//! rules and limits, the escaping of a key's components, the digest that stands for a long
//! value, and the shape of a configuration problem.

use std::fmt;

use sha2::{Digest, Sha256};

/// Whether `b` may appear in a name: `[A-Za-z0-9_.-]`.
pub fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-')
}

/// Whether `s` is a name: 1 to `max` bytes of `[A-Za-z0-9_.-]`. A name goes into headers sent to
/// clients, metric labels, shared data and keys, so nothing else is one.
pub fn is_name(s: &str, max: usize) -> bool {
    !s.is_empty() && s.len() <= max && s.bytes().all(is_name_byte)
}

/// Whether `name` can be the name of a limit the sidecar applied: 1 to
/// [`crate::MAX_NAME_BYTES`] characters of `[A-Za-z0-9_.-]`, as the sidecar's policy
/// names its limits. It goes into the `RateLimit-Policy` and `RateLimit` headers sent to the
/// client and into shared data, so nothing else is taken from an answer: a quote, a non-ASCII
/// byte or a line break would make those headers malformed (or split them).
pub fn is_limit_name(name: &str) -> bool {
    is_name(name, crate::MAX_NAME_BYTES)
}

/// Appends `value` percent-encoded outside `[A-Za-z0-9._~:@/-]`, so that `|`, `=`, `#`, `%`,
/// `{` and `}` never appear raw in a key and no two components encode alike.
pub fn push_escaped(out: &mut String, value: &str) {
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~:@/".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(b"0123456789ABCDEF"[usize::from(b >> 4)]));
            out.push(char::from(b"0123456789ABCDEF"[usize::from(b & 0xf)]));
        }
    }
}

/// Appends a key's value: `=<value escaped>`, or `#<sha256 hex of the raw value>` when the
/// escaped value is longer than `max_escaped` bytes.
pub fn push_value(out: &mut String, value: &str, max_escaped: usize) {
    let start = out.len();
    out.push('=');
    push_escaped(out, value);
    if out.len() - start - 1 > max_escaped {
        out.truncate(start);
        out.push('#');
        out.push_str(&sha256_hex(value.as_bytes()));
    }
}

/// Lowercase hex SHA-256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut hex = String::with_capacity(64);
    for b in digest {
        hex.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
        hex.push(char::from(b"0123456789abcdef"[usize::from(b & 0xf)]));
    }
    hex
}

/// One thing wrong with a configuration (the filter's) or a policy (the sidecar's), and where:
/// shown `<path>: <message>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Where: a field path such as `rules[0].capacity`, after the file when there is one.
    pub path: String,
    /// What is wrong and what is expected.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_short_runs_of_the_name_bytes() {
        assert!(is_name("per-app_1.v2", 128));
        assert!(!is_name("", 128));
        assert!(!is_name("a b", 128));
        assert!(!is_name("é", 128));
        assert!(is_name(&"a".repeat(8), 8));
        assert!(!is_name(&"a".repeat(9), 8));
    }

    #[test]
    fn a_value_is_escaped_or_stands_as_its_digest_when_long() {
        let mut k = String::from("app");
        push_value(&mut k, "a|b=c#d%{e}", 80);
        assert_eq!(k, "app=a%7Cb%3Dc%23d%25%7Be%7D");
        let long = "x".repeat(81);
        let mut k = String::from("app");
        push_value(&mut k, &long, 80);
        assert_eq!(k, format!("app#{}", sha256_hex(long.as_bytes())));
        let mut k = String::from("app");
        push_value(&mut k, &"x".repeat(80), 80);
        assert_eq!(k, format!("app={}", "x".repeat(80)));
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
