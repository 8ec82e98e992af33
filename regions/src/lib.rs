//! Partitioned regional quotas for the rate limiter: a rule's global budget (capacity `C`,
//! refill `R`) split into shares, one per region; the rebalancer that moves unused share to the
//! regions that need it; and a simulation that checks the global bound. A pure library: no I/O,
//! no clock (time is passed in, in milliseconds).
//!
//! The design, the bound and why it holds, the fence and the failure cases: `docs/regions.md`.
//!
//! - [`share`]: [`Share`] (parts per million), [`ShareRecord`] (share + version).
//! - [`quota`]: the validated [`RegionalQuota`] of a rule.
//! - [`bucket`]: [`Budget`] and the reference [`Bucket`], exact integer arithmetic.
//! - [`lease`]: a sidecar's leased view of its region's share and the record's history.
//! - [`plan`]: the algorithm, from shares and observed demand to a [`Plan`], and its [`Params`].
//! - [`rebalancer`]: one round as a state machine (shrink, fence, grow) and its failure handling.
//! - [`sim`]: the simulation of regions, demand and faults behind `ratelimit-regions-sim`.

pub mod bucket;
pub mod lease;
pub mod plan;
pub mod quota;
pub mod rebalancer;
pub mod share;
pub mod sim;

pub use bucket::{Bucket, Budget, Limit};
pub use lease::{LeasedShare, ShareHistory};
pub use plan::{plan, proportional_target, Change, Observation, Params, Plan, RegionInput};
pub use quota::{QuotaError, QuotaProblem, RegionalQuota};
pub use rebalancer::{
    ReadOutcome, Rebalancer, RoundInProgress, RoundReport, ShareWrite, Step, Suspect, WriteKind,
    WriteOutcome,
};
pub use share::{Share, ShareRecord};
