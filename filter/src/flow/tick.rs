//! The worker's tick: its period, and the policy epoch polled and answered under.

use super::*;

impl Flow<'_> {
    /// At configuration, at `now_ns`: the emergency buckets of the `local` failure policy that
    /// shared data does not hold yet are put there full (once per Envoy process).
    pub fn prepare_emergency(&self, now_ns: u64) {
        for rule in &self.config.rules {
            if let Some(e) = &rule.emergency {
                let key = emergency::shared_key(&rule.name);
                let bucket = emergency::EmergencyBucket::from(e);
                emergency::ensure_initialized(self.store, &key, &bucket, now_ns);
            }
        }
    }

    /// How often the host ticks, in milliseconds (`None`: no tick needed): for the deadlines of
    /// the requests queued and of the calls on the stream, which has no timeout of the host's
    /// (half `sidecar.timeout_ms`, at most 50 ms, with coalescing or without); with the policy
    /// epoch polled, at least [`epoch::TICKS_PER_POLL`] times per poll period.
    pub fn tick_period_ms(&self) -> Option<u64> {
        let fp = &self.config.fast_paths;
        let queue = Some((self.config.sidecar.timeout_ms / 2).clamp(1, 50));
        let poll = fp
            .polls_epoch()
            .then(|| (fp.policy_poll_ms / epoch::TICKS_PER_POLL).max(1));
        // Settlements of costs known after the response are sent at ticks (docs/costs.md).
        let settle = self
            .config
            .rules
            .iter()
            .any(|r| r.cost.settled().is_some())
            .then_some(SETTLE_TICK_MS);
        // Any rule may limit requests in flight (the sidecar's policy says which): the slots of
        // admitted streams are renewed and released at ticks (docs/concurrency.md).
        let slots = Some(crate::slots::TICK_MS);
        [queue, poll, settle, slots].into_iter().flatten().min()
    }

    /// A tick of `worker` at `now_ns`: it reads the published policy epoch, and whether it sends
    /// the poll for this Envoy now (then [`Flow::polled`] with its answer).
    pub(super) fn epoch_tick(&self, worker: &mut Worker, now_ns: u64) -> bool {
        if !self.config.fast_paths.polls_epoch() {
            return false;
        }
        let timeout_ns = self.config.sidecar.timeout_ms.saturating_mul(1_000_000);
        let t = epoch::tick(self.store, now_ns, timeout_ns);
        worker.epoch = t.epoch;
        t.poll
    }

    /// The answer to the epoch poll `worker` sent at `dispatched_ns`: the epoch read (`None`: no
    /// answer, or not one), published for every worker.
    pub(super) fn polled(&self, worker: &mut Worker, epoch: Option<u64>, dispatched_ns: u64) {
        let period_ns = self
            .config
            .fast_paths
            .policy_poll_ms
            .saturating_mul(1_000_000);
        worker.epoch = epoch::polled(self.store, epoch, dispatched_ns, period_ns);
    }

    /// A call's answer said it was decided under policy epoch `epoch`: when that is not the one
    /// `worker` knows, the poll is made due at once (once per call, and a shared-data write only
    /// then).
    pub fn answered_under(&self, worker: &Worker, epoch: Option<u64>) {
        match epoch {
            Some(e) if self.config.fast_paths.polls_epoch() && e != worker.epoch => {
                epoch::answered(self.store, e)
            }
            _ => {}
        }
    }
}
