//! How the store calls Redis: what the command line sets (`lib.rs` makes it from `Args`).

use super::super::StoreReset;

/// How the store calls Redis.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Upper bound of every Redis call (`--redis-timeout-ms`).
    pub timeout_ms: u64,
    /// How long a record (deduplication, refunds) is kept (`--attempt-ttl-ms`).
    pub record_ttl_ms: u64,
    /// How long a receipt of a charge is kept for its settlement (`--receipt-ttl-ms`).
    pub receipt_ttl_ms: u64,
    /// The largest lease, as a fraction of the bucket's capacity (`--lease-max-share`).
    pub lease_max_share: f64,
    /// Script calls in flight per node (`--redis-pipeline`).
    pub max_in_flight: usize,
    /// Decisions one script call carries at most.
    pub max_call_decisions: usize,
    /// What a bucket missing after the store lost its state starts with (`--store-reset`).
    pub store_reset: StoreReset,
    /// The key prefix (`--key-prefix`), for the store's epoch markers ([`super::epoch_marker`]).
    pub key_prefix: String,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            timeout_ms: 50,
            record_ttl_ms: 10_000,
            receipt_ttl_ms: 3_600_000,
            lease_max_share: 0.1,
            max_in_flight: 4,
            max_call_decisions: 512,
            store_reset: StoreReset::Full,
            key_prefix: crate::store::DEFAULT_KEY_PREFIX.into(),
        }
    }
}
