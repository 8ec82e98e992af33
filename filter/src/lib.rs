//! The proxy-wasm rate-limit filter for Envoy.
//!
//! Pure core, thin edge: every module but `host` is plain Rust without host calls, built and
//! tested natively and on `wasm32-unknown-unknown` (wasm-bindgen-test under Node):
//! - [`config`]: the plugin configuration, its defaults and validation;
//! - [`identity`]: the request's [`identity::Subject`] from trustworthy facts;
//! - [`rules`]: which rules apply, their bucket keys and [`ratelimit_wire::Decision`]s;
//! - [`attempt`]: the attempt id that keeps a repeated decision from being charged twice;
//! - [`emergency`]: the local token bucket of the `local` failure policy;
//! - [`verdict`]: admit or reject from the sidecar's answer or the failure policies.
//!
//! `host` (only in the `wasm32-wasip1` build) adapts the proxy-wasm ABI to them.

pub mod attempt;
pub mod config;
pub mod emergency;
pub mod identity;
pub mod rules;
pub mod verdict;

#[cfg(all(target_arch = "wasm32", target_os = "wasi"))]
mod host;
