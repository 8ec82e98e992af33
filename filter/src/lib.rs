//! The proxy-wasm rate-limit filter for Envoy.
//!
//! Pure core, thin edge: every module but `host` is plain Rust without host calls, built and
//! tested natively and on `wasm32-unknown-unknown` (wasm-bindgen-test under Node):
//! - [`config`]: the plugin configuration, its defaults and validation;
//! - [`clock`]: the one clock every deadline is read from (monotonic where the host has it);
//! - [`identity`]: the request's [`identity::Subject`] from trustworthy facts;
//! - [`rules`]: which rules apply, and what each asks the sidecar (rule and subject);
//! - [`flow`]: the life of a request (its start, the fast paths, the sidecar's answer or its
//!   absence), the batcher that fills each call, and the worker's stream to the sidecar;
//! - [`fastpath`]: known rejections and leases in shared data (the exact local fast paths);
//! - [`emergency`]: the local token bucket of the `local` failure policy;
//! - [`shared`]: shared data, where both of those live, and its one compare-and-swap loop;
//! - [`slots`]: the concurrency slots this worker's streams hold, renewed and released;
//! - [`verdict`]: admit or reject from the sidecar's answer, local knowledge or the failure
//!   policies, and what a rejection looks like on the wire.
//!
//! `host` (only in the `wasm32-wasip1` build) adapts the proxy-wasm ABI to them: its contexts
//! gather facts, call the flow and carry its verdicts out.

pub mod clock;
pub mod config;
pub mod costs;
pub mod emergency;
pub mod epoch;
pub mod fastpath;
pub mod flow;
pub mod identity;
pub mod rules;
pub mod shared;
pub mod slots;
pub mod verdict;

#[cfg(all(target_arch = "wasm32", target_os = "wasi"))]
mod host;
