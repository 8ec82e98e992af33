//! Where buckets live. The decider hands a [`BucketStore`] one call's requests, each its charges
//! (all-or-nothing), and lease returns, and gets one answer per request; it never learns where a
//! bucket is kept. The regional shares are read, and their demand counted, through a
//! [`ShareStore`]. One implementation per folder or file:
//! - [`redis`]: the bucket scripts of `lua/` ([`Script`]) in Redis (one node, the primary Sentinel
//!   names, a Cluster), with the placement of requests on Cluster nodes and the compensation
//!   across them;
//! - [`memory`]: the same bucket in Rust, in memory, as one node: the script's reference model,
//!   and the store of unit tests.
//!
//! The script's own types ([`Work`], [`Group`], [`Charge`], [`BucketLimits`], [`Return`],
//! [`RequestOutcome`]) are its calling convention ([`script`]), which both implementations follow.

pub mod memory;
pub mod redis;

use std::future::Future;
use std::sync::Arc;

use ratelimit_regions::ShareHistory;

use crate::regional::record::StoredShare;
use ratelimit_wire::Reason;

pub use self::redis::script::Script;
pub use self::redis::RedisStore;

/// What a bucket missing after the store lost its state starts with (`--store-reset`,
/// docs/bucket.md#a-store-that-lost-its-state).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum StoreReset {
    /// Full, as a bucket never seen: a store that lost its state admits each client its capacity
    /// again.
    #[default]
    Full,
    /// Empty at the time of the loss (the store's epoch marker), refilling from there.
    Empty,
}

/// How far the script widens the look-back of a regional share, in milliseconds: the share history
/// is stamped by the clock of the node that holds the share record, a bucket's time by the clock
/// of its own node (another node of a Cluster, a new primary after a failover). Offsets below this
/// cannot make a bucket miss a smaller share (`docs/regions.md`).
pub const SHARE_MARGIN_MS: u64 = 1_000;

/// The numbers of one bucket, as the script takes them: its limit's capacity and refill, and a
/// regional rule's share history.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketLimits {
    pub capacity: u64,
    pub refill_per_sec: f64,
    /// A regional limit: this region's share history (stamped by its Redis's clock); the bucket
    /// is taken under the smallest share in force since its last decision (`docs/regions.md`).
    /// `None`: the whole limit.
    pub share: Option<Arc<ShareHistory>>,
}

impl BucketLimits {
    /// A bucket of the whole limit (no regional share).
    pub fn new(capacity: u64, refill_per_sec: f64) -> BucketLimits {
        BucketLimits {
            capacity,
            refill_per_sec,
            share: None,
        }
    }

    /// The capacity and refill in force now: the whole limit, or for a regional limit this
    /// region's part under the share in force, rounded down as the script does.
    pub fn in_force(&self) -> (u64, f64) {
        match self.share.as_ref().map(|h| h.current()) {
            None => (self.capacity, self.refill_per_sec),
            Some(s) => {
                let ppm = f64::from(s.ppm());
                (
                    (self.capacity as f64 * ppm / 1_000_000.0).floor() as u64,
                    (self.refill_per_sec * ppm).floor() / 1_000_000.0,
                )
            }
        }
    }
}

/// One decision as the script takes it: its bucket key built, its limit resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Charge {
    /// `<prefix>{<bucket id>}`
    pub key: Arc<str>,
    pub bucket: BucketLimits,
    pub cost: u64,
    /// Shadow mode: a rejection does not reject the request.
    pub shadow: bool,
    pub lease: Option<ratelimit_wire::LeaseAsk>,
    /// What caps the lease's grant besides the ask and what the bucket holds.
    pub grant_cap: GrantCap,
    /// A receipt id (1 to [`ratelimit_wire::MAX_RECEIPT`]; 0: none): when the request is charged,
    /// the store keeps what this decision was charged under it, for a settlement to give back
    /// once (`docs/costs.md`).
    pub receipt: u64,
}

/// What caps a lease's grant besides its ask and what the bucket holds after the cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GrantCap {
    /// At most `--lease-max-share` of the capacity: a gateway's lease (docs/fast-paths.md).
    #[default]
    Share,
    /// Only the ask: the RLQS planner sizes its own grants from its Envoys' demand
    /// (docs/rlqs.md).
    Ask,
}

/// The requests of one caller's call that live on one node: decided in one script call, each
/// request all-or-nothing. With a record key, the group is deduplicated (a repeat replays) and
/// its charged requests can be refunded.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    /// `<bucket key of the first decision>:a:<attempt>~<digest of the call>` ([`Call::record_id`])
    pub record: Option<String>,
    pub requests: Vec<Vec<Charge>>,
}

impl Group {
    pub fn decisions(&self) -> usize {
        self.requests.iter().map(Vec::len).sum()
    }
}

/// Unused lease tokens given back to a bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct Return {
    pub key: Arc<str>,
    pub bucket: BucketLimits,
    pub lease_id: u64,
    pub tokens: u64,
}

/// What one node is asked in one go.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Work {
    pub groups: Vec<Group>,
    pub returns: Vec<Return>,
}

/// One decision's answer from the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketOutcome {
    /// The bucket held `cost` tokens (it may still be uncharged: all-or-nothing).
    pub allowed: bool,
    pub remaining: u64,
    pub retry_after_ms: u64,
    pub reset_ms: u64,
    pub reason: Reason,
    /// Tokens granted under the decision's lease ask.
    pub leased: u64,
}

/// What happened to one request in its group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Some (non-shadow) decision rejected: nothing was charged.
    Rejected,
    /// Every decision admitted and was charged now.
    Charged,
    /// A repeat: the recorded answer, nothing charged now. `charged`: the first call charged it
    /// (and it was not refunded since).
    Replayed { charged: bool },
}

/// One request's answer from its group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestOutcome {
    pub status: Status,
    pub decisions: Vec<BucketOutcome>,
}

impl RequestOutcome {
    /// The request holds its charges (charged now, or earlier and not refunded).
    pub fn charged(&self) -> bool {
        matches!(
            self.status,
            Status::Charged | Status::Replayed { charged: true }
        )
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store cannot be set up as configured (a URL, a file, TLS material); found at start.
    #[error("{0}")]
    Config(String),
    #[error("redis unavailable: no answer within {timeout_ms} ms")]
    Timeout { timeout_ms: u64 },
    /// The node does not serve a key of the call (a Cluster slot moved): nothing was written; the
    /// caller may group the work again and retry.
    #[error("redis cluster: {0}")]
    Moved(String),
    #[error("redis unavailable: {0}")]
    Redis(String),
    /// Redis ran the script and it failed in a way a retry cannot cure.
    #[error("bucket script failed: {0}")]
    Script(String),
    #[error("bucket script failed: unexpected script reply: {0}")]
    Reply(String),
}

impl StoreError {
    /// The same call would fail the same way again: not an outage (answered 500, not 503).
    pub fn is_deterministic(&self) -> bool {
        matches!(self, StoreError::Script(_) | StoreError::Reply(_))
    }
}

/// One caller's call as a store takes it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Call {
    /// The caller's attempt id: a repeat of the call within `--attempt-ttl-ms` is answered as the
    /// first one was and charges nothing.
    pub attempt: Option<String>,
    /// The requests, each its charges (at least one), each all-or-nothing.
    pub requests: Vec<Vec<Charge>>,
    /// Unused lease tokens given back.
    pub returns: Vec<Return>,
}

impl Call {
    /// The call's attempt id as its records name it: the caller's id followed by a digest of
    /// what the call charges (each request's bucket keys, costs and shadow flags, in order), so
    /// that only a repeat of the same call finds the first call's records and is replayed; a
    /// different call under a used attempt id is decided afresh. SHA-256 (truncated to 128 bits):
    /// a caller chooses the call's content, so the digest must not be open to a crafted collision.
    pub fn record_id(attempt: &str, requests: &[Vec<Charge>]) -> String {
        use sha2::{Digest, Sha256};
        use std::fmt::Write as _;
        let mut h = Sha256::new();
        for request in requests {
            h.update((request.len() as u64).to_le_bytes());
            for c in request {
                h.update((c.key.len() as u64).to_le_bytes());
                h.update(c.key.as_bytes());
                h.update(c.cost.to_le_bytes());
                h.update([u8::from(c.shadow)]);
            }
        }
        let digest = h.finalize();
        let mut id = String::with_capacity(attempt.len() + 33);
        id.push_str(attempt);
        id.push('~');
        for b in &digest[..16] {
            let _ = write!(id, "{b:02x}");
        }
        id
    }
}

/// One request's answer from a store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decided {
    /// Every charge that may reject (not a shadow one) found its tokens, and the request holds
    /// them: charged now, or by the first call of its attempt and not given back since.
    pub admitted: bool,
    /// One per charge, in order: what its bucket answered, or `None` when it answered nothing (on
    /// a Cluster, its node failed while another node rejected the request).
    pub decisions: Vec<Option<BucketOutcome>>,
}

impl From<RequestOutcome> for Decided {
    /// A request decided in one script call.
    fn from(r: RequestOutcome) -> Decided {
        Decided {
            admitted: r.charged(),
            decisions: r.decisions.into_iter().map(Some).collect(),
        }
    }
}

/// One settlement: the real cost of an admitted request, known after its response, against what
/// it was charged (`docs/costs.md`). The store charges `cost` less what the decision's receipt
/// says it was charged (past zero: a debt; below: given back, up to the bucket's ceiling), and
/// forgets the receipt; without a receipt it holds, only `cost - reserved` when positive.
#[derive(Debug, Clone, PartialEq)]
pub struct Settlement {
    pub key: Arc<str>,
    pub bucket: BucketLimits,
    /// The reservation the caller names (trusted only to charge more).
    pub reserved: u64,
    pub cost: u64,
    /// The decision's receipt id, if the caller has one.
    pub receipt: Option<u64>,
}

/// Settlements applied together (`lua/settle.lua`, one script call per node). With a record id,
/// a repeat of the batch within `--attempt-ttl-ms` changes nothing (a gateway retrying a
/// settlement whose answer it lost).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SettleBatch {
    /// The caller's id of the batch; each node's part is recorded under
    /// `<its first bucket key>:s:<id>` ([`crate::keys::settle_record_key`]).
    pub id: Option<String>,
    pub settlements: Vec<Settlement>,
}

/// What a settle batch did: per settlement, in order, what it applied, or `None` when its node's
/// part was a repeat (applied before).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settled {
    pub applied: Vec<Option<Applied>>,
}

/// What one settlement did to its bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    /// The bucket's tokens after it, rounded down (below 0: a debt).
    pub tokens: i64,
    /// The tokens charged (positive) or given back (negative).
    pub delta: i64,
}

/// One concurrency slot of a request, as `lua/slots.lua` takes it (`docs/concurrency.md`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    /// The rule's and subject's set ([`BucketStore::slot_set_key`]).
    pub key: Arc<str>,
    /// The gateway's id of the request's slot (unique per request).
    pub id: Arc<str>,
    /// How long the slot stays held without a renewal.
    pub ttl_ms: u64,
    /// The most slots the set holds at once (the rule's `concurrency`).
    pub limit: u32,
    /// How long after the store's epoch (`--store-reset empty`) the set may lack slots of
    /// requests still running: the longest ttl they may have been given (`ttl_ms`, or a larger
    /// one a reload just replaced: [`crate::policy::PolicyHandle::slot_unsure_ms`]).
    pub unsure_ms: u64,
}

/// What a take of one request's slots did: all of them are held, or none (a set was full).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotsTaken {
    Taken,
    /// The slot at `index` found its set full; nothing was taken.
    Full {
        index: usize,
    },
}

/// What an update does to slots already held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotUpdate {
    /// Held `ttl_ms` longer from now, if still held.
    Renew,
    /// Given back.
    Release,
}

/// Where buckets live.
pub trait BucketStore: Send + Sync + 'static {
    /// The key the store's calls name the bucket of `entries` in `domain` by: a handle the
    /// decider passes back ([`Charge::key`]), its layout the store's. By default the Redis
    /// layout under `--key-prefix`'s default ([`crate::keys::bucket_key`]), so that the memory
    /// store names the keys Redis does.
    fn bucket_key(&self, domain: &str, entries: &[(&str, Option<&str>)]) -> Arc<str> {
        Arc::from(crate::keys::bucket_key(DEFAULT_KEY_PREFIX, domain, entries))
    }

    /// The key of the set of slots of the bucket `bucket_key` names ([`Slot::key`]; a key
    /// [`Self::bucket_key`] made): the bucket's key and `:c` ([`crate::keys::slots_key`]).
    fn slot_set_key(&self, bucket_key: &str) -> Arc<str> {
        Arc::from(crate::keys::slots_key(bucket_key))
    }

    /// Takes one request's slots, all or none (`lua/slots.lua`, `take`). A slot the set holds
    /// already under its id (a retry) is held again and counts once.
    fn take_slots(
        &self,
        slots: Vec<Slot>,
    ) -> impl Future<Output = Result<SlotsTaken, StoreError>> + Send {
        let _ = slots;
        async {
            Err(StoreError::Config(
                "this store has no concurrency slots".into(),
            ))
        }
    }

    /// Renews or releases slots: per slot, whether it was held (false: expired or unknown).
    fn update_slots(
        &self,
        update: SlotUpdate,
        slots: Vec<Slot>,
    ) -> impl Future<Output = Result<Vec<bool>, StoreError>> + Send {
        let _ = (update, slots);
        async {
            Err(StoreError::Config(
                "this store has no concurrency slots".into(),
            ))
        }
    }

    /// Applies a batch of settlements, each atomically on its bucket. An error leaves each node's
    /// part applied or not as a whole; a repeat of the batch (same id) applies only the parts
    /// that were not.
    fn settle(
        &self,
        batch: SettleBatch,
    ) -> impl Future<Output = Result<Settled, StoreError>> + Send {
        let _ = batch;
        async { Err(StoreError::Config("this store cannot settle costs".into())) }
    }

    /// Decides every request of `call`, each all-or-nothing, and gives its lease returns back:
    /// one answer per request, in order. An error is that request's own: the others may still be
    /// decided. A rejected request keeps no tokens, and its figures (`remaining`, `reset_ms`) are
    /// its buckets' without it.
    fn decide(&self, call: Call) -> impl Future<Output = Vec<Result<Decided, StoreError>>> + Send;

    /// Whether the store can decide (for `/readyz`).
    fn readiness(&self) -> impl Future<Output = Readiness> + Send;
}

/// `--key-prefix`'s default: what [`BucketStore::bucket_key`] names keys under by default.
pub const DEFAULT_KEY_PREFIX: &str = "rl:";

/// Where this region's shares of the regional rules live ([`crate::regional`]): each rule's share
/// record, read under a lease, and its demand counters, added to. The backend keeps its own
/// layout (Redis: [`crate::regional::record`]); this speaks rules and records.
pub trait ShareStore: Send + Sync + 'static {
    /// The share record of regional rule `rule` of `domain`, none when there is none, with the
    /// process that answered (read together): a record stamped by another process may be older
    /// than the last one written ([`StoredShare::written_by`]). A record that cannot be read is
    /// an error naming why. Bounded like every call.
    fn read_share(
        &self,
        domain: &str,
        rule: &str,
    ) -> impl Future<Output = Result<ShareRead, StoreError>> + Send;

    /// Adds `admitted` and `rejected` tokens to the demand counters of `rule` of `domain`.
    fn add_demand(
        &self,
        domain: &str,
        rule: &str,
        admitted: u64,
        rejected: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// A read of a share record ([`ShareStore::read_share`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareRead {
    pub record: Option<StoredShare>,
    /// The id of the store process that answered (Redis's `run_id`).
    pub answered_by: String,
}

/// What the store tells `/readyz` (the decider adds the regional shares:
/// [`crate::decide::SidecarReadiness`]).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Readiness {
    /// The store answers (named as `/readyz` has always shown it: Redis is the store).
    pub redis_ok: bool,
    pub script_loaded: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// One entry per node that answered `CONFIG GET maxmemory-policy`.
    pub maxmemory_policy: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}
