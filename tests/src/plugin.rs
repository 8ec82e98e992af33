//! The filter's plugin configuration (the JSON under the `wasm` filter's `configuration` in
//! Envoy) as the harness writes it, and what the lease defaults that come with it bound. The
//! defaults are the filter crate's own ([`ratelimit_filter::config::Leases`]), never copies.

use serde_json::{json, Value};

/// The SHA-256 of the shipped configs' API key `alpha-key`, which names the app `alpha`.
const ALPHA_KEY_SHA256: &str = "677509799af78b2efa2f2af71d0f906e0a0c50c048efd3b515625f788e92b99a";

/// A plugin configuration, built from its rules.
#[derive(Clone, Debug)]
pub struct Plugin(Value);

impl Plugin {
    fn with_identity(identity: Value, rules: Value) -> Plugin {
        Plugin(json!({
            "domain": "ratelimit",
            "sidecar": {"cluster": "ratelimit_sidecar", "timeout_ms": 2000},
            "identity": identity,
            "rules": rules
        }))
    }

    /// `rules` for clients told apart by address alone (`identity.ip`), a 2 s callout timeout
    /// (no timeout on a busy 2-core machine), every fast path on (the defaults).
    pub fn by_address(rules: Value) -> Plugin {
        Plugin::with_identity(json!({"ip": true}), rules)
    }

    /// `rules` with the identities of `envoy/envoy.yaml`: the API key `alpha-key` (app `alpha`),
    /// the JWT claims `sub` and `tenant` (provider `example`), the address; a 2 s callout
    /// timeout.
    pub fn shipped_identities(rules: Value) -> Plugin {
        Plugin::with_identity(
            json!({
                "api_key": {"header": "x-api-key", "keys": {ALPHA_KEY_SHA256: "alpha"}},
                "jwt": {"provider": "example", "user_claim": "sub", "tenant_claim": "tenant"},
                "ip": true
            }),
            rules,
        )
    }

    /// `identity.api_key`: the API keys `keys` read from `header`, each naming its app (the
    /// configuration holds their SHA-256 hashes).
    pub fn api_keys(
        mut self,
        header: &str,
        keys: impl IntoIterator<Item = (String, String)>,
    ) -> Plugin {
        use sha2::{Digest, Sha256};
        let hashes: serde_json::Map<String, Value> = keys
            .into_iter()
            .map(|(key, app)| {
                let hash: String = Sha256::digest(key.as_bytes())
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                (hash, Value::String(app))
            })
            .collect();
        self.0["identity"]["api_key"] = json!({"header": header, "keys": hashes});
        self
    }

    /// The callout timeout (`sidecar.timeout_ms`).
    pub fn timeout_ms(mut self, ms: u64) -> Plugin {
        self.0["sidecar"]["timeout_ms"] = json!(ms);
        self
    }

    /// `fast_paths.coalesce`: requests that arrive while a callout is out travel in the next.
    pub fn coalesce(mut self, on: bool) -> Plugin {
        self.0["fast_paths"]["coalesce"] = json!(on);
        self
    }

    /// `fast_paths.known_rejections`: a bucket known to be exhausted is answered locally.
    pub fn known_rejections(mut self, on: bool) -> Plugin {
        self.0["fast_paths"]["known_rejections"] = json!(on);
        self
    }

    /// `fast_paths.leases.enabled`: busy buckets are served from leases of tokens.
    pub fn leases(mut self, on: bool) -> Plugin {
        self.0["fast_paths"]["leases"] = json!({"enabled": on});
        self
    }

    /// Every fast path off: one callout per request.
    pub fn one_callout_per_request(self) -> Plugin {
        self.coalesce(false).known_rejections(false).leases(false)
    }

    pub fn json(self) -> Value {
        self.0
    }
}

impl std::fmt::Display for Plugin {
    /// The JSON on one line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A rule for requests whose path starts with `path_prefix`, one bucket per value of the
/// `subject` dimensions (none: one bucket for all), `on_error` `allow`, `deny` or `local`.
pub fn rule(name: &str, path_prefix: &str, subject: &[&str], on_error: &str) -> Value {
    json!({"name": name, "match": {"path_prefix": path_prefix}, "subject": subject,
           "on_error": on_error})
}

/// `rule` with the emergency bucket its `on_error: local` falls back to.
pub fn with_emergency(mut rule: Value, capacity: u64, refill_per_sec: f64) -> Value {
    rule["emergency"] = json!({"capacity": capacity, "refill_per_sec": refill_per_sec});
    rule
}

// ---------------------------------------------------------------------------------------------
// Leases.

/// The sidecar's default `--lease-max-share`: the largest lease it grants on a bucket, as a
/// share of the bucket's capacity (checked against the sidecar's own default by a test).
pub const SIDECAR_LEASE_MAX_SHARE: f64 = 0.1;

/// The filter's lease defaults (`fast_paths.leases`: busy from `min_rate_per_sec`, leases of
/// `ttl_ms` holding at most `max_tokens`).
pub fn lease_defaults() -> ratelimit_filter::config::Leases {
    ratelimit_filter::config::Leases::default()
}

/// The largest lease a gateway holds on a bucket of `capacity` tokens, with the defaults of the
/// filter and the sidecar: `L = min(max_tokens, floor(max_share × C))`. A gateway withholds at
/// most two of them from the others (the one in use and the next; docs/fast-paths.md).
pub fn max_lease_tokens(capacity: f64) -> f64 {
    (SIDECAR_LEASE_MAX_SHARE * capacity)
        .floor()
        .min(lease_defaults().max_tokens as f64)
}

/// The tokens a lease asks for at `rate_per_sec` requests a second at one gateway, the first
/// time (no previous lease) and with the default `ttl_ms` and `max_tokens`: the filter's own
/// sizing ([`ratelimit_filter::fastpath::lease_size`]).
pub fn lease_ask(rate_per_sec: f64) -> u64 {
    let d = lease_defaults();
    ratelimit_filter::fastpath::lease_size(None, rate_per_sec, 0, d.ttl_ms, 1, d.max_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plugins_are_built_as_the_filter_reads_them() {
        let rules = json!([
            rule("many", "/many/", &["ip"], "deny"),
            with_emergency(rule("local", "/local/", &[], "local"), 20, 2.0)
        ]);
        let plugin = Plugin::by_address(rules.clone()).one_callout_per_request();
        let config = ratelimit_filter::config::Config::from_json(plugin.to_string().as_bytes())
            .expect("the filter accepts it");
        assert!(!config.fast_paths.coalesce);
        assert!(!config.fast_paths.known_rejections);
        assert!(!config.fast_paths.leases.enabled);
        assert_eq!(config.sidecar.timeout_ms, 2000);
        assert_eq!(
            plugin.json()["fast_paths"],
            json!({"coalesce": false, "known_rejections": false, "leases": {"enabled": false}})
        );
        let shipped = Plugin::shipped_identities(rules)
            .timeout_ms(50)
            .leases(false);
        let config = ratelimit_filter::config::Config::from_json(shipped.to_string().as_bytes())
            .expect("the filter accepts it");
        assert_eq!(config.sidecar.timeout_ms, 50);
        assert!(config.fast_paths.coalesce && !config.fast_paths.leases.enabled);
        assert_eq!(shipped.json()["rules"][1]["emergency"]["capacity"], 20);
    }

    #[test]
    fn the_lease_share_is_the_sidecars_default() {
        use clap::Parser;
        let args = ratelimit_sidecar::config::Args::try_parse_from([
            "ratelimit-sidecar",
            "--limits",
            "limits.yaml",
        ])
        .expect("the sidecar's defaults");
        assert_eq!(args.lease_max_share, SIDECAR_LEASE_MAX_SHARE);
    }

    #[test]
    fn leases_are_capped_by_the_share_and_the_filters_maximum() {
        // With the defaults (a tenth of the capacity, at most 1000 tokens).
        assert_eq!(max_lease_tokens(200.0), 20.0);
        assert_eq!(max_lease_tokens(2000.0), 200.0);
        assert_eq!(max_lease_tokens(1e9), lease_defaults().max_tokens as f64);
        // 1.25 × rate × 1 s, rounded up, within [1, 1000].
        assert_eq!(lease_ask(80.0), 100);
        assert_eq!(lease_ask(0.0), 1);
        assert_eq!(lease_ask(1e6), 1000);
    }
}
