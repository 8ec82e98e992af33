//! `ratelimit-rebalancer`: moves unused share of regional rules' global budgets to the regions
//! that need it (`docs/regions.md`). The algorithm and its safety (the plan, the round's state
//! machine, the envelopes) are the `ratelimit_regions` crate's; this crate is the edge that runs
//! them against each region's Redis:
//!
//! - [`config`]: the command line;
//! - [`region`]: one region's Redis (share records, demand counters, the leader lock);
//! - [`run`]: one rule's rounds.

pub mod config;
pub mod region;
pub mod run;
