//! `wasm-oci` (`make oci`): packages the filter's Wasm module as a Wasm OCI image, written as an OCI
//! image layout directory (`oci-layout`, `index.json`, `blobs/sha256/...`), without a container
//! engine. Prints the manifest digest (the value Istio's `WasmPlugin.sha256` is compared with) on
//! stdout, and how to push the layout on stderr.
//!
//! The image is the *compat* variant of the Wasm image specification that Istio fetches
//! (solo-io/wasm `spec/spec-compat.md`, Istio `pkg/wasm/imagefetcher.go`): a plain OCI image whose
//! one `application/vnd.oci.image.layer.v1.tar+gzip` layer holds `plugin.wasm`, with the manifest
//! annotation `module.wasm.image/variant: compat`. It is stored and copied like any container
//! image by every registry and tool. (The *oci* variant, with custom media types, is read by Istio
//! only with exactly two layers, the module and its runtime config; a module-only artifact with
//! one `application/vnd.module.wasm.content.layer.v1+wasm` layer is refused.)
//!
//! The output is reproducible: the same module gives the same bytes and the same digest (tar
//! entry with mtime 0, uid/gid 0; gzip header without time or name; JSON with sorted keys).
//!
//!     cargo run -q -p ratelimit-e2e --bin wasm-oci -- --wasm target/wasm32-wasip1/release/ratelimit_filter.wasm

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::json;
use sha2::{Digest, Sha256};

const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// The file Istio looks for in the layer of a compat image.
const MODULE_FILE: &str = "plugin.wasm";

#[derive(Parser)]
#[command(
    name = "wasm-oci",
    about = "Writes the filter's Wasm module as a Wasm OCI image (Istio's compat variant) in an OCI image layout"
)]
struct Args {
    /// The Wasm module to package.
    #[arg(
        long,
        default_value = "target/wasm32-wasip1/release/ratelimit_filter.wasm"
    )]
    wasm: PathBuf,
    /// The OCI image layout directory to write (created; blobs no descriptor refers to are removed).
    #[arg(long, default_value = "target/oci/ratelimit-filter")]
    out: PathBuf,
    /// The tag recorded in index.json (`org.opencontainers.image.ref.name`), used when pushing.
    #[arg(long, default_value = "0.1.0")]
    tag: String,
    /// The repository the push commands printed on stderr name (a placeholder by default).
    #[arg(long, default_value = "ghcr.io/example/ratelimit-filter")]
    repository: String,
}

/// A content descriptor: what a manifest or an index says about a blob.
struct Blob {
    media_type: &'static str,
    bytes: Vec<u8>,
}

impl Blob {
    fn hex(&self) -> String {
        hex_sha256(&self.bytes)
    }

    fn descriptor(&self) -> serde_json::Value {
        json!({
            "mediaType": self.media_type,
            "digest": format!("sha256:{}", self.hex()),
            "size": self.bytes.len(),
        })
    }
}

fn hex_sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A tar archive holding only `plugin.wasm`, with fixed metadata so the bytes depend on the module
/// alone.
fn layer_tar(module: &[u8]) -> Result<Vec<u8>> {
    let mut header = tar::Header::new_ustar();
    header.set_path(MODULE_FILE)?;
    header.set_size(module.len() as u64);
    header.set_mode(0o644);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    header.set_entry_type(tar::EntryType::Regular);
    header.set_cksum();
    let mut archive = tar::Builder::new(Vec::new());
    archive.append(&header, module)?;
    Ok(archive.into_inner()?)
}

/// gzip without a file name or modification time in its header.
fn gzip(bytes: &[u8]) -> Result<Vec<u8>> {
    let mut encoder = flate2::GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), flate2::Compression::best());
    encoder.write_all(bytes)?;
    Ok(encoder.finish()?)
}

/// The layout's blobs (layer, config, manifest) and its index.json, for a module.
struct Image {
    layer: Blob,
    config: Blob,
    manifest: Blob,
    index: Vec<u8>,
}

impl Image {
    fn new(module: &[u8], tag: &str) -> Result<Image> {
        if module.len() < 8 || &module[..4] != b"\0asm" {
            bail!("not a Wasm module (no \\0asm magic number)");
        }
        let tar = layer_tar(module)?;
        let layer = Blob {
            media_type: LAYER_MEDIA_TYPE,
            bytes: gzip(&tar)?,
        };
        // A valid OCI image config; architecture/os as Go names them (GOARCH=wasm, GOOS=wasip1).
        let config = Blob {
            media_type: CONFIG_MEDIA_TYPE,
            bytes: serde_json::to_vec(&json!({
                "architecture": "wasm",
                "os": "wasip1",
                "config": {},
                "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{}", hex_sha256(&tar))]},
            }))?,
        };
        let manifest = Blob {
            media_type: MANIFEST_MEDIA_TYPE,
            bytes: serde_json::to_vec(&json!({
                "schemaVersion": 2,
                "mediaType": MANIFEST_MEDIA_TYPE,
                "config": config.descriptor(),
                "layers": [layer.descriptor()],
                "annotations": {"module.wasm.image/variant": "compat"},
            }))?,
        };
        let mut manifest_descriptor = manifest.descriptor();
        manifest_descriptor["annotations"] = json!({"org.opencontainers.image.ref.name": tag});
        let index = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": INDEX_MEDIA_TYPE,
            "manifests": [manifest_descriptor],
        }))?;
        Ok(Image {
            layer,
            config,
            manifest,
            index,
        })
    }

    /// Writes the layout into `out`. Blobs of an earlier run that no descriptor refers to are
    /// removed, so every blob in the directory is described.
    fn write(&self, out: &Path) -> Result<()> {
        let blobs = out.join("blobs").join("sha256");
        if out.exists() && !out.join("oci-layout").exists() {
            let not_empty = std::fs::read_dir(out)
                .with_context(|| format!("read {}", out.display()))?
                .next()
                .is_some();
            if not_empty {
                bail!(
                    "--out {}: the directory exists, is not empty and is not an OCI image layout (no oci-layout file); choose another",
                    out.display()
                );
            }
        }
        std::fs::create_dir_all(&blobs).with_context(|| format!("create {}", blobs.display()))?;
        let mut keep = BTreeSet::new();
        for blob in [&self.layer, &self.config, &self.manifest] {
            let path = blobs.join(blob.hex());
            std::fs::write(&path, &blob.bytes)
                .with_context(|| format!("write {}", path.display()))?;
            keep.insert(blob.hex());
        }
        for entry in std::fs::read_dir(&blobs)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !keep.contains(&name) {
                std::fs::remove_file(entry.path())
                    .with_context(|| format!("remove stale blob {}", entry.path().display()))?;
            }
        }
        std::fs::write(out.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
        std::fs::write(out.join("index.json"), &self.index)?;
        Ok(())
    }
}

fn run(args: &Args) -> Result<String> {
    let module = std::fs::read(&args.wasm).with_context(|| {
        format!(
            "read the Wasm module {} (build it first: make build)",
            args.wasm.display()
        )
    })?;
    let image = Image::new(&module, &args.tag)
        .with_context(|| format!("package {}", args.wasm.display()))?;
    image.write(&args.out)?;
    Ok(image.manifest.hex())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(hex) => {
            let (out, tag, repo) = (args.out.display(), &args.tag, &args.repository);
            eprintln!(
                "\
wrote the Wasm OCI image (compat variant) of {wasm} as an OCI image layout: {out} (tag {tag})

Pin the MANIFEST digest in envoy/istio/wasmplugin.yaml (Istio compares `sha256` with it):
  url: oci://{repo}:{tag}
  sha256: {hex}
or pin it in the URL: oci://{repo}@sha256:{hex}

Push without changing the digest (any one of; each copies the manifest bytes as they are):
  oras cp --from-oci-layout {out}:{tag} {repo}:{tag}
  skopeo copy --preserve-digests oci:{out}:{tag} docker://{repo}:{tag}
  crane push {out} {repo}:{tag}
Then check: crane digest {repo}:{tag}   (must print sha256:{hex})
",
                wasm = args.wasm.display(),
            );
            println!("sha256:{hex}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("wasm-oci: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_module_gives_the_same_digest_and_another_module_another() {
        let a = b"\0asm\x01\0\0\0 module a";
        let b = b"\0asm\x01\0\0\0 module b";
        let digest = |m: &[u8]| Image::new(m, "t").unwrap().manifest.hex();
        assert_eq!(digest(a), digest(a));
        assert_ne!(digest(a), digest(b));
    }

    #[test]
    fn a_file_that_is_not_wasm_is_refused() {
        let e = Image::new(b"#!/bin/sh\necho", "t").err().unwrap();
        assert!(e.to_string().contains("not a Wasm module"), "{e}");
    }
}
