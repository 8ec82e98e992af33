//! One regional rule's rebalancing against the real Redises: the `ratelimit_regions::Rebalancer`
//! state machine driven with the regions' records, their demand counters and the share writes.
//!
//! A round: renew the leader lock (or skip the round: another rebalancer leads the rule), read
//! every region's share record and demand counters (a region that does not answer is frozen),
//! plan, write the donors' smaller shares, wait the fence (lease + margin after the last shrink
//! was acknowledged), write the recipients' larger shares. A region without a record yet gets one
//! first, holding the policy's initial share (the same the sidecars applied until then).
//!
//! The fence is counted with the largest lease any sidecar may hold: this rebalancer's
//! `--lease-ms`, the lease of every record it read, and the sidecars' default lease
//! ([`record::default_lease_ms`]) while a region had no record.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ratelimit_regions::{
    Observation, Params, Plan, ReadOutcome, Rebalancer, RoundReport, Share, ShareRecord, Step,
    WriteKind, WriteOutcome,
};
use ratelimit_sidecar::keys::{demand_key, leader_key, share_key};
use ratelimit_sidecar::policy::Regional;
use ratelimit_sidecar::regional::record::{self, ShareWrite};
use ratelimit_sidecar::store::SHARE_MARGIN_MS;

use crate::region::{Region, RegionError, WriteAnswer};

/// How one rule is rebalanced.
#[derive(Debug, Clone)]
pub struct Settings {
    pub params: Params,
    pub key_prefix: String,
    pub wait_replicas: u64,
    pub leader_ttl_ms: u64,
    /// Names this process in the leader lock.
    pub holder: String,
}

/// One rule's rebalancing.
pub struct RuleRun {
    rule: Arc<Regional>,
    settings: Settings,
    /// The rule's regions, by name.
    regions: BTreeMap<String, Arc<Region>>,
    lock: Arc<Region>,
    started: Instant,
    /// Created at the first round, once every region was read (the fence's lease depends on it).
    rebalancer: Option<Rebalancer>,
    /// The largest lease seen in a record (or assumed while a region had none).
    fence_lease_ms: u64,
    /// The demand counters as last read: (admitted, rejected, at_ms).
    demand: BTreeMap<String, (u64, u64, u64)>,
    leading: bool,
    /// Counts changes of leadership: a round that saw one starts the next afresh.
    leadership_changes: u64,
}

impl RuleRun {
    pub fn new(
        rule: Arc<Regional>,
        settings: Settings,
        regions: BTreeMap<String, Arc<Region>>,
        lock: Arc<Region>,
    ) -> RuleRun {
        RuleRun {
            fence_lease_ms: settings.params.lease_ms,
            rule,
            settings,
            regions,
            lock,
            started: Instant::now(),
            rebalancer: None,
            demand: BTreeMap::new(),
            leading: false,
            leadership_changes: 0,
        }
    }

    pub fn name(&self) -> String {
        format!("{}/{}", self.rule.domain, self.rule.rule)
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn share_key(&self) -> String {
        share_key(
            &self.settings.key_prefix,
            &self.rule.domain,
            &self.rule.rule,
        )
    }

    /// Takes or renews the leader lock; whether this process leads the rule.
    pub async fn lead(&mut self) -> bool {
        let key = leader_key(
            &self.settings.key_prefix,
            &self.rule.domain,
            &self.rule.rule,
        );
        let leading = match self
            .lock
            .lead(&key, &self.settings.holder, self.settings.leader_ttl_ms)
            .await
        {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(rule = %self.name(), "cannot reach the leader lock ({e}): not leading");
                false
            }
        };
        if leading != self.leading {
            if leading {
                tracing::info!(rule = %self.name(), lock = %key, region = %self.lock.name, "leading the rule");
            } else {
                tracing::warn!(rule = %self.name(), lock = %key, "not leading the rule: another rebalancer holds its lock");
            }
            // A new leader starts afresh: a previous one's shrinks may still be leased.
            self.rebalancer = None;
            self.leadership_changes += 1;
        }
        self.leading = leading;
        leading
    }

    /// Gives the leader lock up.
    pub async fn resign(&mut self) {
        if !self.leading {
            return;
        }
        let key = leader_key(
            &self.settings.key_prefix,
            &self.rule.domain,
            &self.rule.rule,
        );
        if let Err(e) = self.lock.resign(&key, &self.settings.holder).await {
            tracing::warn!(rule = %self.name(), "cannot release the leader lock ({e}); it expires by itself");
        }
        self.leading = false;
    }

    /// Reads every region's demand counters; the next round observes from here.
    pub async fn observe_demand(&mut self) -> BTreeMap<String, Observation> {
        let key = demand_key(
            &self.settings.key_prefix,
            &self.rule.domain,
            &self.rule.rule,
        );
        let reads = futures::future::join_all(
            self.regions
                .values()
                .map(|r| async { (r.name.clone(), r.read_demand(&key).await) }),
        )
        .await;
        let now = self.now_ms();
        let mut observations = BTreeMap::new();
        for (region, read) in reads {
            match read {
                Ok((admitted, rejected)) => {
                    // Counters that went back (the region's Redis lost them) observe nothing.
                    if let Some(&(a0, r0, t0)) = self.demand.get(&region) {
                        if admitted >= a0 && rejected >= r0 {
                            observations.insert(
                                region.clone(),
                                Observation {
                                    admitted: admitted - a0,
                                    rejected: rejected - r0,
                                    interval_ms: now.saturating_sub(t0).max(1),
                                },
                            );
                        }
                    }
                    self.demand.insert(region, (admitted, rejected, now));
                }
                Err(e) => {
                    tracing::warn!(rule = %self.name(), %region, "cannot read the demand counters: {e}");
                    self.demand.remove(&region);
                }
            }
        }
        observations
    }

    /// Reads a region's record, creating it with the initial share when there is none; with the
    /// lease its sidecars may hold (the default one when there was no record). A record this run
    /// has seen that is gone is an error: the region's Redis lost it, and the initial share may be
    /// more than the region held.
    async fn read_record(
        &self,
        region: &Region,
        seen: bool,
    ) -> Result<(ReadOutcome, u64), RegionError> {
        let key = self.share_key();
        if let Some((r, trusted)) = region.read_record(&key).await? {
            let record = ShareRecord {
                share: r.share,
                version: r.version,
            };
            let outcome = if trusted {
                ReadOutcome::Record(record)
            } else {
                ReadOutcome::Unconfirmed(record)
            };
            return Ok((outcome, r.lease_ms));
        }
        if seen {
            return Err(RegionError::Data {
                region: region.name.clone(),
                message: format!(
                    "{key} is gone (the region's Redis lost it): the region stays frozen until \
                     its record is written again"
                ),
            });
        }
        let initial = self.rule.quota.share(&region.name).unwrap_or(Share::ZERO);
        let seed = ShareWrite {
            version: 1,
            share: initial,
            lease_ms: self.settings.params.lease_ms,
            keep_ms: self.keep_ms(),
            initial,
        };
        let answer = region
            .write_share(&key, &seed, self.settings.wait_replicas)
            .await?;
        tracing::info!(
            rule = %self.name(),
            region = %region.name,
            share = %initial,
            "no share record yet: created it with the policy's initial share ({answer:?})"
        );
        match region.read_record(&key).await? {
            Some((r, _)) => Ok((
                ReadOutcome::Record(ShareRecord {
                    share: r.share,
                    version: r.version,
                }),
                r.lease_ms.max(record::default_lease_ms()),
            )),
            None => Err(RegionError::Data {
                region: region.name.clone(),
                message: format!("{key}: still no record after creating it"),
            }),
        }
    }

    /// How much history a record keeps: the rule's longest fill time, a lease and the margin.
    fn keep_ms(&self) -> u64 {
        self.rule.fill_time_ms + self.fence_lease_ms + SHARE_MARGIN_MS
    }

    /// One round (see the module doc); `None` when this process does not lead the rule.
    pub async fn round(&mut self) -> Option<RoundReport> {
        if !self.lead().await {
            return None;
        }
        let leadership = self.leadership_changes;
        let observations = self.observe_demand().await;
        let this = &*self;
        let reads = futures::future::join_all(this.regions.values().map(|r| {
            let seen = this
                .rebalancer
                .as_ref()
                .and_then(|rb| rb.record(&r.name))
                .is_some();
            async move { (r.name.clone(), this.read_record(r, seen).await) }
        }))
        .await;
        let mut outcomes = Vec::new();
        for (region, read) in reads {
            let outcome = match read {
                Ok((r, lease_ms)) => {
                    // The fence covers the lease of every record, and the default one while
                    // none existed.
                    self.fence_lease_ms = self.fence_lease_ms.max(lease_ms);
                    r
                }
                Err(e) => {
                    tracing::warn!(rule = %self.name(), %region, "region unreachable, frozen this round: {e}");
                    ReadOutcome::Unreachable
                }
            };
            outcomes.push((region, outcome));
        }
        let now = self.now_ms();
        let mut rb = match self.rebalancer.take() {
            Some(rb) => rb,
            None => {
                let params = Params {
                    lease_ms: self.fence_lease_ms,
                    ..self.settings.params
                };
                tracing::info!(
                    rule = %self.name(),
                    fence_ms = params.fence_ms(),
                    "starting: nothing grows before one fence has passed"
                );
                Rebalancer::new(params, &self.rule.quota, now)
            }
        };
        for (region, outcome) in &outcomes {
            if let Some(suspect) = rb.observe(region, *outcome, now) {
                tracing::warn!(
                    rule = %self.name(),
                    %region,
                    version = suspect.read.version,
                    share = %suspect.read.share,
                    known_version = suspect.known.map(|k| k.version),
                    known_share = %suspect.known.map_or("none".into(), |k| k.share.to_string()),
                    went_back = suspect.regressed,
                    restarted = suspect.unconfirmed,
                    "share record not trusted ({}): its sidecars apply at most the floor; this \
                     round writes it again",
                    if suspect.regressed {
                        "older than one seen: the region's Redis went back in time"
                    } else {
                        "the region's Redis restarted or failed over since it was written"
                    }
                );
            }
        }
        for (region, o) in &observations {
            tracing::info!(
                rule = %self.name(),
                %region,
                admitted = o.admitted,
                rejected = o.rejected,
                interval_ms = o.interval_ms,
                share = %rb.record(region).map_or(Share::ZERO, |r| r.share),
                "demand"
            );
        }
        match rb.start_round(&observations, now) {
            Ok(plan) => {
                tracing::info!(rule = %self.name(), plan = %describe(plan), "round planned")
            }
            Err(e) => tracing::warn!(rule = %self.name(), "{e}"),
        }
        self.drive(&mut rb).await;
        let report = rb.last_round().cloned();
        // Leadership lost (or lost and taken again) during the round: the next starts afresh.
        if self.leadership_changes == leadership {
            self.rebalancer = Some(rb);
        }
        report
    }

    /// Runs the round's steps: writes, the fence, until idle.
    async fn drive(&mut self, rb: &mut Rebalancer) {
        let key = self.share_key();
        loop {
            let now = self.now_ms();
            match rb.poll(now) {
                Step::Idle => break,
                Step::AwaitWrites => {
                    tracing::error!(rule = %self.name(), "a write was left unanswered; ending the round");
                    break;
                }
                Step::WaitUntil(until) => {
                    tracing::info!(
                        rule = %self.name(),
                        wait_ms = until - now,
                        "fence: no grow until every sidecar's lease on the larger shares has run out"
                    );
                    tokio::time::sleep(Duration::from_millis(until - now)).await;
                }
                Step::Write(writes) => {
                    // Never write without the lock: a write not sent is a write refused.
                    let leading = self.lead().await;
                    let this = &*self;
                    let sent = futures::future::join_all(writes.iter().map(|w| {
                        let region = this.regions.get(&w.region).cloned();
                        let key = key.clone();
                        async move {
                            let Some(region) = region.filter(|_| leading) else {
                                return WriteOutcome::Refused;
                            };
                            let write = ShareWrite {
                                version: w.version,
                                share: w.share,
                                lease_ms: this.settings.params.lease_ms,
                                keep_ms: this.keep_ms(),
                                initial: this.rule.quota.share(&w.region).unwrap_or(Share::ZERO),
                            };
                            match region
                                .write_share(&key, &write, this.settings.wait_replicas)
                                .await
                            {
                                Ok(WriteAnswer::Written) => WriteOutcome::Written,
                                Ok(WriteAnswer::Refused { stored_version }) => {
                                    tracing::warn!(rule = %this.name(), region = %w.region, version = w.version, stored_version, "write refused: the record is newer");
                                    WriteOutcome::Refused
                                }
                                Err(RegionError::Refused { message, .. }) => {
                                    tracing::warn!(rule = %this.name(), region = %w.region, "write refused: {message}");
                                    WriteOutcome::Refused
                                }
                                Err(e) => {
                                    tracing::warn!(rule = %this.name(), region = %w.region, "write unanswered, its outcome is unknown: the region is frozen at the larger share until a read shows it: {e}");
                                    WriteOutcome::Unknown
                                }
                            }
                        }
                    }))
                    .await;
                    // Acknowledged no later than now: the fence counts from here.
                    let now = self.now_ms();
                    for (w, outcome) in writes.iter().zip(sent) {
                        if outcome == WriteOutcome::Written {
                            tracing::info!(
                                rule = %self.name(),
                                region = %w.region,
                                share = %w.share,
                                version = w.version,
                                "{} written",
                                match w.kind {
                                    WriteKind::Shrink => "shrink",
                                    WriteKind::Grow => "grow",
                                }
                            );
                        }
                        rb.written(w, outcome, now);
                    }
                }
            }
        }
        if let Some(r) = rb.last_round() {
            tracing::info!(
                rule = %self.name(),
                grown = %r.grown.iter().map(|c| format!("{} {} -> {}", c.region, c.from, c.to)).collect::<Vec<_>>().join(", "),
                failed = r.failed.len(),
                "round done"
            );
        }
    }
}

/// A plan as a log line: `shrink us 0.5000 -> 0.3000; grow eu 0.5000 -> 0.7000`.
fn describe(plan: &Plan) -> String {
    if plan.is_empty() {
        return "nothing to move".into();
    }
    let list = |changes: &[ratelimit_regions::Change]| {
        changes
            .iter()
            .map(|c| format!("{} {} -> {}", c.region, c.from, c.to))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!("shrink {}; grow {}", list(&plan.shrink), list(&plan.grow))
}
