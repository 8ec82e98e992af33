//! `make oci` (the `wasm-oci` binary) writes a Wasm OCI image layout that Istio can fetch: every
//! blob matches its descriptor, the index points at the manifest, the one layer holds the built
//! module as `plugin.wasm`, and the digest it prints is the manifest's, the same on every run.

use std::io::Read;
use std::path::Path;
use std::process::Command;

use ratelimit_e2e::Envoy;
use serde_json::Value;
use sha2::{Digest, Sha256};

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Runs `wasm-oci` on the built module into `out` and returns what it printed on stdout.
fn wasm_oci(out: &Path, tag: &str) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_wasm-oci"))
        .arg("--wasm")
        .arg(Envoy::wasm())
        .arg("--out")
        .arg(out)
        .args(["--tag", tag])
        .output()
        .expect("run wasm-oci");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "wasm-oci failed:\n{stderr}");
    assert!(
        stderr.contains("oras cp --from-oci-layout") && stderr.contains("--preserve-digests"),
        "wasm-oci does not say how to push without changing the digest:\n{stderr}"
    );
    String::from_utf8(output.stdout).unwrap().trim().to_string()
}

/// The blob a descriptor names, after checking that its digest and size match the descriptor.
fn blob(layout: &Path, descriptor: &Value) -> Vec<u8> {
    let digest = descriptor["digest"].as_str().expect("descriptor digest");
    let hex = digest
        .strip_prefix("sha256:")
        .unwrap_or_else(|| panic!("{digest}: not sha256"));
    let bytes = std::fs::read(layout.join("blobs/sha256").join(hex))
        .unwrap_or_else(|e| panic!("blob {digest}: {e}"));
    assert_eq!(sha256_hex(&bytes), hex, "blob {digest}: content digest");
    assert_eq!(
        descriptor["size"].as_u64(),
        Some(bytes.len() as u64),
        "blob {digest}: size"
    );
    bytes
}

fn json(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).expect("JSON")
}

#[test]
fn the_layout_is_a_compat_wasm_image_of_the_built_module_with_a_reproducible_digest() {
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("ratelimit-filter");
    let printed = wasm_oci(&layout, "9.9.9");

    // The OCI image layout: oci-layout, index.json, blobs/sha256/<hex>.
    let oci_layout = json(&std::fs::read(layout.join("oci-layout")).unwrap());
    assert_eq!(oci_layout["imageLayoutVersion"], "1.0.0");
    let index = json(&std::fs::read(layout.join("index.json")).unwrap());
    assert_eq!(index["schemaVersion"], 2);
    assert_eq!(
        index["mediaType"],
        "application/vnd.oci.image.index.v1+json"
    );
    let manifests = index["manifests"].as_array().expect("index.manifests");
    assert_eq!(manifests.len(), 1, "{index}");
    let manifest_descriptor = &manifests[0];
    assert_eq!(
        manifest_descriptor["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    assert_eq!(
        manifest_descriptor["annotations"]["org.opencontainers.image.ref.name"],
        "9.9.9"
    );
    // What it prints is the manifest digest: the value Istio compares WasmPlugin.sha256 with.
    assert_eq!(printed, manifest_descriptor["digest"].as_str().unwrap());

    let manifest = json(&blob(&layout, manifest_descriptor));
    assert_eq!(manifest["schemaVersion"], 2);
    assert_eq!(
        manifest["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    assert_eq!(
        manifest["annotations"]["module.wasm.image/variant"],
        "compat"
    );
    let config_descriptor = &manifest["config"];
    assert_eq!(
        config_descriptor["mediaType"],
        "application/vnd.oci.image.config.v1+json"
    );
    let config = json(&blob(&layout, config_descriptor));
    let layers = manifest["layers"].as_array().expect("manifest.layers");
    assert_eq!(layers.len(), 1, "a compat image has exactly one layer");
    assert_eq!(
        layers[0]["mediaType"],
        "application/vnd.oci.image.layer.v1.tar+gzip"
    );
    let layer = blob(&layout, &layers[0]);

    // Istio gunzips the layer and takes the file named plugin.wasm: it is the built module.
    let mut tar_bytes = Vec::new();
    flate2::read::GzDecoder::new(layer.as_slice())
        .read_to_end(&mut tar_bytes)
        .expect("the layer is gzip");
    assert_eq!(
        config["rootfs"]["diff_ids"][0].as_str(),
        Some(format!("sha256:{}", sha256_hex(&tar_bytes)).as_str()),
        "the config's diff_id is the digest of the uncompressed layer"
    );
    let mut archive = tar::Archive::new(tar_bytes.as_slice());
    let mut files = Vec::new();
    for entry in archive.entries().expect("the layer is a tar") {
        let mut entry = entry.expect("tar entry");
        let name = entry.path().unwrap().display().to_string();
        let mut content = Vec::new();
        entry.read_to_end(&mut content).unwrap();
        files.push((name, content));
    }
    assert_eq!(files.len(), 1, "one file in the layer");
    assert_eq!(files[0].0, "plugin.wasm");
    assert!(
        files[0].1 == std::fs::read(Envoy::wasm()).unwrap(),
        "plugin.wasm is not the built module"
    );

    // No blob without a descriptor.
    let mut described: Vec<String> = [manifest_descriptor, config_descriptor, &layers[0]]
        .iter()
        .map(|d| d["digest"].as_str().unwrap()["sha256:".len()..].to_string())
        .collect();
    described.sort();
    let mut on_disk: Vec<String> = std::fs::read_dir(layout.join("blobs/sha256"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    assert_eq!(on_disk, described);

    // Reproducible: another run, elsewhere, gives the same digest; a run into the same layout
    // with another tag leaves no stale blob behind.
    let again = dir.path().join("again");
    assert_eq!(wasm_oci(&again, "9.9.9"), printed);
    wasm_oci(&layout, "other-tag");
    let blobs = std::fs::read_dir(layout.join("blobs/sha256"))
        .unwrap()
        .count();
    assert_eq!(blobs, 3, "layer, config, manifest");
}

#[test]
fn a_directory_that_is_not_an_oci_layout_is_not_written_into() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("precious.txt"), "keep me").unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_wasm-oci"))
        .arg("--wasm")
        .arg(Envoy::wasm())
        .arg("--out")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("not an OCI image layout"), "{stderr}");
    assert!(dir.path().join("precious.txt").exists());
}
