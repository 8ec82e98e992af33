//! A self-signed certificate for the TLS example (`envoy/envoy-edge-tls.yaml`), made with the
//! `openssl` command line, and the example's placeholder paths pointed at it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The placeholder paths in `envoy/envoy-edge-tls.yaml`, which the tests replace.
pub const PLACEHOLDER_CHAIN: &str = "/etc/envoy/tls/PLACEHOLDER-fullchain.pem";
pub const PLACEHOLDER_KEY: &str = "/etc/envoy/tls/PLACEHOLDER-privkey.pem";

/// Writes a self-signed ECDSA P-256 certificate for `localhost` / 127.0.0.1 into `dir` and returns
/// (certificate chain, private key).
pub fn self_signed(dir: &Path) -> (PathBuf, PathBuf) {
    let (cert, key) = (dir.join("fullchain.pem"), dir.join("privkey.pem"));
    let out = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec"])
        .args([
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
        ])
        .args(["-subj", "/CN=localhost"])
        .args(["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("run openssl (install Debian's openssl package)");
    assert!(
        out.status.success(),
        "openssl req failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (cert, key)
}

/// `yaml` with the example's placeholder certificate paths replaced by `cert` and `key`.
pub fn with_certificate(yaml: &str, cert: &Path, key: &Path) -> String {
    assert!(
        yaml.contains(PLACEHOLDER_CHAIN) && yaml.contains(PLACEHOLDER_KEY),
        "the TLS example no longer names the placeholder certificate paths"
    );
    yaml.replace(PLACEHOLDER_CHAIN, &cert.display().to_string())
        .replace(PLACEHOLDER_KEY, &key.display().to_string())
}
