//! Regional shares on the sidecar (`docs/regions.md`): for each regional rule of the policy, the
//! share of its global budget this region applies, read from the region's Redis under a lease,
//! and the demand counters the rebalancer reads.
//!
//! - The lease: each rule's share record ([`record`]) is read every `lease_ms / 4`, `lease_ms`
//!   being the record's (until a record exists, [`record::default_lease_ms`]). A share read
//!   `lease_ms` ago or more is not applied: the rule's requests are answered "unavailable" and
//!   the gateway's `on_error` decides. The lease counts from when the read was *sent*, on the
//!   monotonic clock. So `lease_ms` after a smaller share is written no sidecar of the region
//!   applies the larger one: the fence the rebalancer waits before it grows another region.
//! - No record yet: the policy's initial share of this region applies, as in force since always
//!   (a history of one change at 0). The rebalancer writes that same change first when it creates
//!   the record, so the two agree. A record once seen that goes missing is an error (the region's
//!   Redis lost it), not a return to the initial share: the lease runs out and the rule answers
//!   "unavailable" until a record is back.
//! - A record not trusted: one stamped by another Redis process than the one answering (its
//!   `run_id`: the Redis restarted from a snapshot, or a replica took over, since the write), or
//!   an unstamped one older than a version this sidecar saw, may be older than the share the
//!   rebalancer last fenced. Until a record written by the live process is read (the
//!   rebalancer's repair), the rule is charged under at most its floor
//!   ([`RegionalShares::share_for`]), logged at warn once per episode, counted
//!   (`ratelimit_regional_share_suspect_total`) and shown in `/readyz`. Why the floor is safe:
//!   `docs/regions.md`, "A record restored from an older state".
//! - Applying the share: [`RegionalShares::share_for`] hands the decision the record's history;
//!   the bucket script takes the bucket under the smallest share since its last decision.
//! - Demand: per rule, tokens admitted (cost plus lease grants) and rejected, counted in memory
//!   and added to the region's counters ([`record::ADMITTED`], [`record::REJECTED`]) every
//!   [`DEMAND_FLUSH`] ([`crate::store::ShareStore::add_demand`]).

pub mod record;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ratelimit_regions::{Share, ShareHistory};

use crate::metrics::Metrics;
use crate::policy::reload::PolicyHandle;
use crate::policy::{Policy, Regional};
use crate::store::ShareStore;

/// How often the demand counted in memory is added to the region's counters.
pub const DEMAND_FLUSH: Duration = Duration::from_secs(1);

/// A rule, by domain and name.
type RuleId = (String, String);

/// This region's shares of the regional rules, and their demand.
pub struct RegionalShares {
    region: String,
    /// How long before its lease ends a share stops being applied: a decision planned under the
    /// lease reaches Redis at most this much later (`--redis-timeout-ms`).
    decision_time: Duration,
    views: Mutex<HashMap<RuleId, View>>,
    /// Tokens (admitted, rejected) not yet added to the region's counters.
    demand: Mutex<HashMap<RuleId, (u64, u64)>>,
    metrics: Arc<Metrics>,
}

#[derive(Debug, Default)]
struct View {
    leased: Option<Leased>,
    /// Why the last read failed (logged when it changes).
    error: Option<String>,
    /// A record was seen: its absence is now an error, not the initial share.
    seen_record: bool,
    /// The highest version read (an unstamped record below it went back in time).
    highest_version: u64,
    /// Why the record read last is not trusted, while it is not (an episode).
    suspect: Option<String>,
}

#[derive(Debug)]
struct Leased {
    history: Arc<ShareHistory>,
    /// 0 while the region has no record.
    version: u64,
    lease_ms: u64,
    /// When the read was sent.
    read_at: Instant,
}

impl Leased {
    /// Whether a decision planned now may apply the share: it reaches Redis within
    /// `decision_time`, still under the lease.
    fn valid(&self, decision_time: Duration) -> bool {
        self.read_at.elapsed() + decision_time < Duration::from_millis(self.lease_ms)
    }
}

/// One regional rule's share as `/readyz` shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ShareStatus {
    /// `<domain>/<rule>`
    pub rule: String,
    pub region: String,
    /// The share in force (a fraction of the rule's global budget), once read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub share: Option<f64>,
    /// The record's version (0: no record yet, the policy's initial share applies).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
    /// Whether the share is applied now (read less than a lease ago).
    pub leased: bool,
    /// Why the last read failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Why the record is not trusted, while it is not: `share` is then the safe share applied
    /// (at most the rule's floor), not the record's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub suspect: Option<String>,
}

impl RegionalShares {
    /// The shares of `region`; a decision reaches Redis within `decision_time` of its planning
    /// (the Redis timeout), so a share stops being applied that long before its lease ends.
    pub fn new(
        region: impl Into<String>,
        decision_time: Duration,
        metrics: Arc<Metrics>,
    ) -> Arc<RegionalShares> {
        Arc::new(RegionalShares {
            region: region.into(),
            decision_time,
            views: Mutex::new(HashMap::new()),
            demand: Mutex::new(HashMap::new()),
            metrics,
        })
    }

    /// The share history to charge `rule`'s buckets under, or why there is none (a lease that
    /// ran out, a rule never read): the request is then answered "unavailable".
    pub fn share_for(&self, rule: &Regional) -> Result<Arc<ShareHistory>, String> {
        let views = self.views.lock().expect("not poisoned");
        let view = views.get(&(rule.domain.clone(), rule.rule.clone()));
        match view.and_then(|v| v.leased.as_ref().map(|l| (v, l))) {
            Some((_, l)) if l.valid(self.decision_time) => Ok(l.history.clone()),
            Some((v, l)) => Err(format!(
                "the share of regional rule {:?} in region {:?} was read {} ms ago, past its \
                 lease of {} ms less the Redis timeout ({} ms){}",
                rule.rule,
                self.region,
                l.read_at.elapsed().as_millis(),
                l.lease_ms,
                self.decision_time.as_millis(),
                v.error
                    .as_ref()
                    .map(|e| format!(" (the last read failed: {e})"))
                    .unwrap_or_default()
            )),
            None => Err(format!(
                "the share of regional rule {:?} in region {:?} has not been read yet{}",
                rule.rule,
                self.region,
                view.and_then(|v| v.error.as_ref())
                    .map(|e| format!(" ({e})"))
                    .unwrap_or_default()
            )),
        }
    }

    /// Counts a decision of `rule`: `admitted` tokens taken (cost and lease grant), `rejected`
    /// tokens refused.
    pub fn count(&self, rule: &Regional, admitted: u64, rejected: u64) {
        let mut demand = self.demand.lock().expect("not poisoned");
        let c = demand
            .entry((rule.domain.clone(), rule.rule.clone()))
            .or_default();
        c.0 += admitted;
        c.1 += rejected;
    }

    /// Reads the share record of every regional rule of `policy` once (concurrently).
    pub async fn refresh<S: ShareStore>(&self, store: &S, policy: &Policy) {
        let rules = policy.regional_rules();
        futures::future::join_all(rules.iter().map(|r| self.refresh_rule(store, r))).await;
        let current: Vec<RuleId> = rules
            .iter()
            .map(|r| (r.domain.clone(), r.rule.clone()))
            .collect();
        self.views
            .lock()
            .expect("not poisoned")
            .retain(|id, _| current.contains(id));
    }

    async fn refresh_rule<S: ShareStore>(&self, store: &S, rule: &Regional) {
        let sent = Instant::now();
        let read = match store.read_share(&rule.domain, &rule.rule).await {
            Ok(read) => Ok(read.record.map(|r| (r, read.answered_by))),
            Err(e) => Err(e.to_string()),
        };
        let mut views = self.views.lock().expect("not poisoned");
        let view = views
            .entry((rule.domain.clone(), rule.rule.clone()))
            .or_default();
        let read = match read {
            Ok(None) if view.seen_record => Err(format!(
                "the share record of {}/{} is gone (the region's Redis lost it?); the rule stays \
                 unavailable until a record is written",
                rule.domain, rule.rule
            )),
            other => other,
        };
        match read {
            Ok(found) => {
                let suspect = found
                    .as_ref()
                    .and_then(|(r, live)| suspicion(r, live, view.highest_version));
                let (history, version, lease_ms) = match found {
                    Some((r, _)) if suspect.is_some() => {
                        // Charged under at most the floor until the record is written again.
                        let safe = r.share.min(rule.quota.floor());
                        (ShareHistory::new(0, safe), r.version, r.lease_ms)
                    }
                    Some((r, _)) => (r.history, r.version, r.lease_ms),
                    None => (
                        ShareHistory::new(0, rule.quota.share(&self.region).unwrap_or(Share::ZERO)),
                        0,
                        record::default_lease_ms(),
                    ),
                };
                self.note_suspicion(rule, view, suspect.as_deref(), &history);
                let changed = view.leased.as_ref().is_none_or(|l| l.version != version)
                    || view.error.is_some();
                if changed {
                    tracing::info!(
                        rule = %rule.rule,
                        domain = %rule.domain,
                        region = %self.region,
                        share = %history.current(),
                        version,
                        lease_ms,
                        "regional share read{}",
                        if version == 0 { " (no record yet: the policy's initial share)" } else { "" }
                    );
                }
                if changed && Duration::from_millis(lease_ms) <= self.decision_time {
                    tracing::error!(
                        rule = %rule.rule,
                        lease_ms,
                        redis_timeout_ms = self.decision_time.as_millis() as u64,
                        "the share's lease is no longer than --redis-timeout-ms: it can never be \
                         applied and the rule answers unavailable; lower the timeout or raise \
                         the rebalancer's --lease-ms"
                    );
                }
                view.seen_record |= version > 0;
                view.highest_version = view.highest_version.max(version);
                view.error = None;
                view.leased = Some(Leased {
                    history: Arc::new(history),
                    version,
                    lease_ms,
                    read_at: sent,
                });
            }
            Err(e) => {
                if view.error.as_ref() != Some(&e) {
                    tracing::warn!(
                        rule = %rule.rule,
                        domain = %rule.domain,
                        region = %self.region,
                        "cannot read the regional share ({e}); the last one read applies until its \
                         lease runs out, then the rule answers unavailable"
                    );
                }
                view.error = Some(e);
            }
        }
    }

    /// Logs and counts the start of an episode of a record not trusted (`suspect`: why), and its
    /// end; `view.suspect` follows.
    fn note_suspicion(
        &self,
        rule: &Regional,
        view: &mut View,
        suspect: Option<&str>,
        applied: &ShareHistory,
    ) {
        match (view.suspect.is_some(), suspect) {
            (false, Some(why)) => {
                tracing::warn!(
                    rule = %rule.rule,
                    domain = %rule.domain,
                    region = %self.region,
                    applied = %applied.current(),
                    floor = %rule.quota.floor(),
                    "regional share record not trusted ({why}): the rule is charged under at most \
                     its floor until the rebalancer writes the record again"
                );
                self.metrics
                    .regional_share_suspect(format!("{}/{}", rule.domain, rule.rule));
            }
            (true, None) => tracing::info!(
                rule = %rule.rule,
                domain = %rule.domain,
                region = %self.region,
                "regional share record trusted again (written by the Redis process answering)"
            ),
            _ => {}
        }
        view.suspect = suspect.map(str::to_string);
    }

    /// Adds the demand counted since the last flush to the region's counters; what cannot be
    /// added is kept for the next flush.
    pub async fn flush_demand<S: ShareStore>(&self, store: &S) {
        let counts: Vec<(RuleId, (u64, u64))> =
            self.demand.lock().expect("not poisoned").drain().collect();
        for ((domain, rule), (admitted, rejected)) in counts {
            let added = store.add_demand(&domain, &rule, admitted, rejected).await;
            if let Err(e) = added {
                tracing::debug!(%rule, "demand counters not updated, kept for the next flush: {e}");
                let mut demand = self.demand.lock().expect("not poisoned");
                let c = demand.entry((domain, rule)).or_default();
                c.0 += admitted;
                c.1 += rejected;
            }
        }
    }

    /// How long until the next read: a quarter of the shortest lease.
    pub fn refresh_interval(&self) -> Duration {
        let shortest = self
            .views
            .lock()
            .expect("not poisoned")
            .values()
            .filter_map(|v| v.leased.as_ref().map(|l| l.lease_ms))
            .min()
            .unwrap_or_else(record::default_lease_ms);
        Duration::from_millis((shortest / 4).max(10))
    }

    /// Every regional rule of `policy`, as `/readyz` shows it.
    pub fn status(&self, policy: &Policy) -> Vec<ShareStatus> {
        let views = self.views.lock().expect("not poisoned");
        policy
            .regional_rules()
            .iter()
            .map(|r| {
                let view = views.get(&(r.domain.clone(), r.rule.clone()));
                let leased = view.and_then(|v| v.leased.as_ref());
                ShareStatus {
                    rule: format!("{}/{}", r.domain, r.rule),
                    region: self.region.clone(),
                    share: leased.map(|l| l.history.current().fraction()),
                    version: leased.map(|l| l.version),
                    leased: leased.is_some_and(|l| l.valid(self.decision_time)),
                    error: view.and_then(|v| v.error.clone()),
                    suspect: view.and_then(|v| v.suspect.clone()),
                }
            })
            .collect()
    }

    /// Whether every regional rule of `policy` has been read once (the start-up part of
    /// `/readyz`; a lease that runs out later shows in the status, and only its rule answers
    /// "unavailable").
    pub fn all_read(&self, policy: &Policy) -> bool {
        let views = self.views.lock().expect("not poisoned");
        policy.regional_rules().iter().all(|r| {
            views
                .get(&(r.domain.clone(), r.rule.clone()))
                .is_some_and(|v| v.leased.is_some())
        })
    }

    /// Starts reading the shares and flushing the demand in the background, for as long as the
    /// returned tasks live.
    pub fn start<S: ShareStore>(
        self: &Arc<Self>,
        store: Arc<S>,
        policy: Arc<PolicyHandle>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let shares = self.clone();
        let reader_store = store.clone();
        let reader = tokio::spawn(async move {
            loop {
                let current = policy.current().clone();
                shares.refresh(&*reader_store, &current).await;
                tokio::time::sleep(shares.refresh_interval()).await;
            }
        });
        let shares = self.clone();
        let flusher = tokio::spawn(async move {
            let mut tick = tokio::time::interval(DEMAND_FLUSH);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                shares.flush_demand(&*store).await;
            }
        });
        vec![reader, flusher]
    }
}

/// Why a record read with the run_id `live` of the Redis answering is not trusted, if it is not:
/// stamped by another process (that Redis restarted or failed over since the write, and may hold
/// an older record), or unstamped and older than `highest_seen`.
fn suspicion(r: &record::StoredShare, live: &str, highest_seen: u64) -> Option<String> {
    match &r.run_id {
        Some(writer) if !r.written_by(live) => Some(format!(
            "version {} was written by Redis run_id {writer}, not by the process answering \
             ({live}): it restarted or failed over since, and may hold an older record",
            r.version
        )),
        None if r.version < highest_seen => Some(format!(
            "version {} is lower than version {highest_seen} read before: the region's Redis went \
             back in time",
            r.version
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Bounds, RegionScope};
    use crate::store::memory::MemoryStore;

    const POLICY: &str = "rules:\n  g:\n    capacity: 100\n    refill_per_sec: 10\n    regions: {eu: 0.6, us: 0.4}\n";

    fn policy() -> Policy {
        Policy::from_sources(
            &[("limits.yaml".into(), POLICY.into())],
            &Bounds {
                region: RegionScope::Sidecar(Some("eu".into())),
                ..Bounds::default()
            },
        )
        .unwrap()
    }

    fn rule(p: &Policy) -> Arc<Regional> {
        p.regional_rules().remove(0)
    }

    fn fields(
        version: &str,
        share: &str,
        lease: &str,
        history: &str,
    ) -> Vec<(&'static str, String)> {
        vec![
            ("version", version.into()),
            ("share_ppm", share.into()),
            ("lease_ms", lease.into()),
            ("history", history.into()),
        ]
    }

    /// Sets `g`'s record as the Redis layout's `fields` read ([`record::parse`]).
    fn set(store: &MemoryStore, fields: &[(&'static str, String)]) {
        let f: Vec<(String, String)> = fields
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        store.set_share("ratelimit", "g", record::parse(&f));
    }

    #[tokio::test]
    async fn the_initial_share_applies_until_a_record_exists_then_the_record() {
        let p = policy();
        let store = MemoryStore::new(0, 0.1, 10_000);
        let shares = RegionalShares::new("eu", Duration::ZERO, Arc::new(Metrics::new()));
        assert!(shares
            .share_for(&rule(&p))
            .unwrap_err()
            .contains("not been read yet"));
        assert!(!shares.all_read(&p));
        shares.refresh(&store, &p).await;
        let h = shares.share_for(&rule(&p)).unwrap();
        assert_eq!(
            h.changes().collect::<Vec<_>>(),
            [(0, Share::from_ppm(600_000).unwrap())]
        );
        assert!(shares.all_read(&p));

        set(
            &store,
            &fields("2", "700000", "5000", "0:600000,1000:700000"),
        );
        shares.refresh(&store, &p).await;
        assert_eq!(
            shares.share_for(&rule(&p)).unwrap().current().ppm(),
            700_000
        );
        let status = shares.status(&p);
        assert_eq!(status[0].version, Some(2));
        assert_eq!(status[0].share, Some(0.7));
        assert!(status[0].leased);

        // Gone after it was seen: not the initial share again.
        store.set_share("ratelimit", "g", Ok(None));
        shares.refresh(&store, &p).await;
        assert_eq!(
            shares.status(&p)[0].version,
            Some(2),
            "the old lease still runs"
        );
        assert!(shares.status(&p)[0]
            .error
            .as_deref()
            .unwrap()
            .contains("is gone"));
    }

    #[tokio::test]
    async fn a_share_is_applied_only_under_its_lease() {
        let p = policy();
        let store = MemoryStore::new(0, 0.1, 10_000);
        set(&store, &fields("1", "600000", "40", "0:600000"));
        let shares = RegionalShares::new("eu", Duration::ZERO, Arc::new(Metrics::new()));
        shares.refresh(&store, &p).await;
        assert!(shares.share_for(&rule(&p)).is_ok());
        assert_eq!(shares.refresh_interval(), Duration::from_millis(10));
        // The record becomes unreadable: the share read last applies until its lease runs out.
        set(&store, &fields("2", "600000", "40", "garbage"));
        shares.refresh(&store, &p).await;
        std::thread::sleep(Duration::from_millis(50));
        let e = shares.share_for(&rule(&p)).unwrap_err();
        assert!(
            e.contains("past its lease of 40 ms") && e.contains("not <from_ms>:<ppm>"),
            "{e}"
        );
        assert!(!shares.status(&p)[0].leased);
    }

    #[tokio::test]
    async fn a_record_the_live_redis_did_not_write_is_charged_under_at_most_the_floor() {
        let p = policy();
        let store = MemoryStore::new(0, 0.1, 10_000);
        store.set_run_id("live");
        let metrics = Arc::new(Metrics::new());
        let shares = RegionalShares::new("eu", Duration::ZERO, metrics.clone());
        let stamped = |version: &str, ppm: &str, history: &str, run_id: &str| {
            let mut f = fields(version, ppm, "5000", history);
            f.push(("run_id", run_id.into()));
            f
        };
        // Fenced at 0.3 (v2) by the process answering: applied as written.
        set(
            &store,
            &stamped("2", "300000", "0:600000,1000:300000", "live"),
        );
        shares.refresh(&store, &p).await;
        assert_eq!(
            shares.share_for(&rule(&p)).unwrap().current().ppm(),
            300_000
        );
        // The Redis restarts from an older snapshot: v1, 0.6, stamped by the process before.
        store.set_run_id("restarted");
        set(&store, &stamped("1", "600000", "0:600000", "live"));
        for _ in 0..2 {
            shares.refresh(&store, &p).await;
            let h = shares.share_for(&rule(&p)).unwrap();
            assert_eq!(
                h.changes().collect::<Vec<_>>(),
                [(0, Share::from_ppm(50_000).unwrap())],
                "the floor (0.05), since always"
            );
        }
        let status = &shares.status(&p)[0];
        assert_eq!((status.share, status.version), (Some(0.05), Some(1)));
        assert!(status.leased);
        let why = status.suspect.as_deref().unwrap();
        assert!(
            why.contains("run_id live") && why.contains("(restarted)"),
            "{why}"
        );
        let counted = "ratelimit_regional_share_suspect_total{rule=\"ratelimit/g\"} 1\n";
        assert!(
            metrics.encode().contains(counted),
            "one episode, counted once"
        );

        // A sidecar that starts now (it saw no version) does not trust it either.
        let fresh = RegionalShares::new("eu", Duration::ZERO, Arc::new(Metrics::new()));
        fresh.refresh(&store, &p).await;
        assert_eq!(fresh.share_for(&rule(&p)).unwrap().current().ppm(), 50_000);

        // The rebalancer's repair, written by the process answering: trusted again.
        set(
            &store,
            &stamped("3", "300000", "0:600000,9000:300000", "restarted"),
        );
        shares.refresh(&store, &p).await;
        assert_eq!(
            shares.share_for(&rule(&p)).unwrap().current().ppm(),
            300_000
        );
        assert_eq!(shares.status(&p)[0].suspect, None);

        // Unstamped records (an older rebalancer's): below a version seen, not trusted; a
        // sidecar that saw none has nothing to compare with.
        set(&store, &fields("2", "600000", "5000", "0:600000"));
        shares.refresh(&store, &p).await;
        assert_eq!(shares.share_for(&rule(&p)).unwrap().current().ppm(), 50_000);
        assert!(shares.status(&p)[0]
            .suspect
            .as_deref()
            .unwrap()
            .contains("lower than version 3"));
        assert!(metrics
            .encode()
            .contains("ratelimit_regional_share_suspect_total{rule=\"ratelimit/g\"} 2\n"));
        let fresh = RegionalShares::new("eu", Duration::ZERO, Arc::new(Metrics::new()));
        fresh.refresh(&store, &p).await;
        assert_eq!(fresh.share_for(&rule(&p)).unwrap().current().ppm(), 600_000);
    }

    #[tokio::test]
    async fn demand_is_added_to_the_regions_counters() {
        let p = policy();
        let store = MemoryStore::new(0, 0.1, 10_000);
        let shares = RegionalShares::new("eu", Duration::ZERO, Arc::new(Metrics::new()));
        shares.count(&rule(&p), 5, 0);
        shares.count(&rule(&p), 0, 2);
        shares.flush_demand(&store).await;
        shares.count(&rule(&p), 1, 1);
        shares.flush_demand(&store).await;
        assert_eq!(store.demand("ratelimit", "g"), (6, 3));
    }
}
