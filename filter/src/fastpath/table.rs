//! The table of entries in shared data: probes that answer from it, and what a decision
//! teaches it.

use super::*;
use crate::shared::{compare_and_swap, SharedDataError, SharedStore, Write};

/// The slots of one Envoy's shared data.
pub struct Table<'a> {
    pub store: &'a dyn SharedStore,
    pub slots: usize,
    /// How long a rejection is answered locally at most, from when its callout was sent.
    pub max_rejection_ns: u64,
    /// The sidecar's policy epoch as this worker knows it ([`crate::epoch`]; 0: unknown): a lease
    /// or a rejection learned under another one does not answer.
    pub epoch: u64,
}

impl Table<'_> {
    /// The entry of `id`, if its slot holds it.
    pub fn get(&self, id: &str) -> Option<Entry> {
        let (bytes, _) = self.store.get(&slot_key(id, self.slots));
        bytes
            .as_deref()
            .and_then(Entry::decode)
            .filter(|e| e.id == id)
    }

    /// Applies `change` to the entry of `id` (a new one if its slot holds none, or another
    /// bucket's that is no longer [live](Entry::live) at `now_ns`), with compare-and-swap.
    /// `change` returns `None` to write nothing. The result is what `change` returned on the
    /// entry written, or `None` if nothing was written.
    ///
    /// Another bucket's live entry keeps its slot: replacing it would strand its lease (tokens
    /// deducted in Redis for this gateway, never spent nor given back) or forget its
    /// rejection, and two busy buckets in one slot would take that from each other at every
    /// request. The bucket that finds the slot taken does without fast paths meanwhile (the
    /// exact remote path).
    pub fn update<T>(
        &self,
        id: &str,
        now_ns: u64,
        mut change: impl FnMut(&mut Entry) -> Option<T>,
    ) -> Option<T> {
        self.update_found(id, now_ns, |e, _| change(e))
    }

    /// [`Table::update`], telling `change` whether the slot held an entry of `id`.
    pub(super) fn update_found<T>(
        &self,
        id: &str,
        now_ns: u64,
        mut change: impl FnMut(&mut Entry, bool) -> Option<T>,
    ) -> Option<T> {
        let key = slot_key(id, self.slots);
        compare_and_swap(self.store, &key, |bytes| {
            let (mut entry, existed) = match bytes.and_then(Entry::decode) {
                Some(e) if e.id == id => (e, true),
                Some(other) if other.live(now_ns, self.epoch) => return Write::Keep(None),
                _ => (Entry::new(id), false),
            };
            match change(&mut entry, existed) {
                Some(out) => Write::Store(entry.encode(), Some(out)),
                None => Write::Keep(None),
            }
        })
        .ok()
        .flatten()
    }

    /// One look at the entry of `id` for a request costing `cost`: `cost` taken from a lease
    /// that pays, else a known rejection that applies (as far as `paths` let them answer), else
    /// [`Probe::Undecided`]. A single read unless a lease pays (then a compare-and-swap write).
    ///
    /// The lease goes first: its tokens were deducted in Redis for this gateway, so admitting
    /// from it is exact even while a rejection is known (one decided remotely while the lease
    /// was being granted); checked after the rejection, the gateway would strand its own lease.
    ///
    /// Early renewal: with `renew` (the bucket is busy enough for leases; the time until which
    /// an ask may be in flight), a request that would leave the lease below a quarter of its
    /// grant, or that comes in the last tenth of the lease's time, is not paid from it: it
    /// marks the entry renewing and takes the remote path
    /// ([`Probe::Renew`]), asking for the next lease while this one keeps paying the others.
    /// When the lease in use cannot pay, a next lease that holds tokens takes over.
    pub fn probe(
        &self,
        id: &str,
        cost: u64,
        now_ns: u64,
        paths: ProbeFor,
        renew: Option<u64>,
    ) -> Probe {
        let (rejections, lease) = (paths.known_rejections(), paths.leases());
        let key = slot_key(id, self.slots);
        // What the probe answers if the host refuses its write: the lease paid nothing.
        let mut unwritten = Probe::Undecided;
        let found = compare_and_swap(self.store, &key, |bytes| {
            let Some(mut entry) = bytes.and_then(Entry::decode).filter(|e| e.id == id) else {
                return Write::Keep(Probe::NoEntry);
            };
            let epoch = self.epoch;
            let known = |entry: &Entry| match entry.rejection(cost, now_ns, epoch) {
                Some((cause, left_ns)) if rejections => Probe::Rejected {
                    cause,
                    left_ns,
                    limit: entry.limit.clone(),
                },
                _ => Probe::Undecided,
            };
            // The next lease takes over when the one in use cannot pay (what is left of that
            // one, less than the cost or past its time, stays unused: Redis's record expires).
            if lease
                && !entry.lease.pays(cost, now_ns, epoch)
                && entry.next.pays(cost, now_ns, epoch)
            {
                let old = std::mem::replace(&mut entry.lease, std::mem::take(&mut entry.next));
                entry.lease.started_ns = now_ns;
                if old.id != 0 && old.until_ns > now_ns {
                    entry.retired = old;
                }
            }
            if !(lease && entry.lease_pays(cost, now_ns, epoch)) {
                return Write::Keep(known(&entry));
            }
            if let Some(until) = renew.filter(|_| entry.renewal_due(cost, now_ns, epoch)) {
                let previous = entry.lease.previous();
                let give_back = entry.take_retired(now_ns);
                entry.renewing_until_ns = until;
                unwritten = Probe::Undecided;
                return Write::Store(
                    entry.encode(),
                    Probe::Renew {
                        previous,
                        give_back,
                    },
                );
            }
            entry.lease.tokens -= cost;
            unwritten = known(&entry);
            Write::Store(
                entry.encode(),
                Probe::Taken {
                    lease_id: entry.lease.id,
                    tokens_left: entry.lease.tokens,
                    limit: entry.limit,
                },
            )
        });
        match found {
            Ok(probe) => probe,
            Err(SharedDataError::Failed) => unwritten,
            Err(SharedDataError::CasMismatch) => Probe::Undecided,
        }
    }

    /// Gives `cost` back for a take from lease `lease_id` of `id` under this table's epoch (a
    /// request that was then rejected): to that lease if it is still in use, or retired (the
    /// next ask then returns it to Redis); else, that lease being gone (given back or
    /// expired), to the lease in use if it was granted under the same epoch (Redis's refund of
    /// a lease is capped at its grant, so the token is at worst lost, never admitted twice).
    /// Lost otherwise, and if the lease is past its time (Redis's record is too).
    pub fn give_back(&self, id: &str, lease_id: u64, cost: u64, now_ns: u64) {
        if lease_id == 0 {
            return;
        }
        self.update(id, now_ns, |e| {
            let lease = if e.lease.id == lease_id {
                &mut e.lease
            } else if e.retired.id == lease_id {
                &mut e.retired
            } else if e.lease.held(now_ns) && e.lease.epoch == self.epoch {
                &mut e.lease
            } else {
                return None;
            };
            (lease.until_ns > now_ns).then(|| {
                lease.tokens = lease.tokens.saturating_add(cost);
            })
        });
    }

    /// Starts an ask for a new lease of `id` unless one is in flight: marks the entry until
    /// `renewing_until_ns`, stops the current lease (and a next one that could not pay) and
    /// returns their leftovers (lease id, tokens) to give back, and the size of the previous
    /// grant and when it was asked (to size the ask).
    pub fn begin_lease(&self, id: &str, now_ns: u64, renewing_until_ns: u64) -> Option<LeaseStart> {
        self.update(id, now_ns, |e| {
            if e.renewing_until_ns > now_ns {
                return None;
            }
            e.renewing_until_ns = renewing_until_ns;
            let retired = e.take_retired(now_ns);
            let start = LeaseStart {
                give_back: [e.lease, e.next]
                    .iter()
                    .filter(|l| l.held(now_ns))
                    .map(|l| (l.id, l.tokens))
                    .chain(retired)
                    .collect(),
                previous: e.lease.previous(),
            };
            e.lease.tokens = 0;
            e.next = Lease::default();
            Some(start)
        })
    }

    /// Records what the sidecar answered at `now_ns` for a decision of `id` costing `cost`,
    /// asked at `dispatched_ns`: `lease` is (lease id, granted tokens, ttl) when the decision
    /// asked for one. A lease granted while the one in use still holds tokens (an early
    /// renewal) waits as the next one. An admission of a bucket this Envoy holds nothing about
    /// writes nothing: only rejections and leases are worth a slot.
    pub fn learn(&self, id: &str, learned: &Learned, dispatched_ns: u64, now_ns: u64) {
        let worth_a_slot = matches!(learned.outcome, DecisionOutcome::Rejected { .. })
            || learned.asked_lease.is_some();
        self.update_found(id, now_ns, |e, existed| {
            if !existed && !worth_a_slot {
                return None;
            }
            let before = e.clone();
            if let Some(limit) = &learned.limit {
                e.limit = Some(limit.clone());
            }
            match learned.outcome {
                DecisionOutcome::Admitted => {
                    if e.reject_cost <= learned.cost {
                        e.reject_cost = 0;
                        e.reject_until_ns = 0;
                        e.reject_local_until_ns = 0;
                    }
                }
                DecisionOutcome::Rejected {
                    cause,
                    retry_after_ms,
                } => {
                    e.reject_cost = learned.cost;
                    e.reject_cause = cause;
                    e.reject_epoch = learned.epoch;
                    e.reject_until_ns = dispatched_ns.saturating_add(match cause {
                        RejectionCause::Insufficient => retry_after_ms.saturating_mul(1_000_000),
                        _ => FIXED_REJECTION_NS,
                    });
                    e.reject_local_until_ns = e
                        .reject_until_ns
                        .min(dispatched_ns.saturating_add(self.max_rejection_ns));
                }
                DecisionOutcome::NotDecided => {}
            }
            if let Some((lease_id, ttl_ms)) = learned.asked_lease {
                e.renewing_until_ns = 0;
                if learned.leased > 0 {
                    let mut granted = Lease {
                        id: lease_id,
                        tokens: learned.leased,
                        until_ns: dispatched_ns.saturating_add(ttl_ms.saturating_mul(1_000_000)),
                        granted: learned.leased,
                        granted_ns: dispatched_ns,
                        started_ns: 0,
                        epoch: learned.epoch,
                    };
                    e.ask_rtt_ns = now_ns
                        .saturating_sub(dispatched_ns)
                        .max(e.ask_rtt_ns / ASK_RTT_DIVISOR * ASK_RTT_KEPT);
                    if e.lease.held(now_ns) {
                        e.next = granted;
                    } else {
                        granted.started_ns = now_ns;
                        e.lease = granted;
                    }
                }
            }
            (*e != before).then_some(())
        });
    }
}

/// What a [`Table::probe`] may answer a request from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeFor {
    /// A lease that pays, else a known rejection.
    Both,
    /// A lease that pays, and nothing else.
    Leases,
    /// A known rejection (leases are off).
    KnownRejections,
}

impl ProbeFor {
    /// What the fast paths configured answer from; `None`: neither is on (the table is not read).
    pub fn configured(fp: &FastPaths) -> Option<ProbeFor> {
        match (fp.leases.enabled, fp.known_rejections) {
            (true, true) => Some(ProbeFor::Both),
            (true, false) => Some(ProbeFor::Leases),
            (false, true) => Some(ProbeFor::KnownRejections),
            (false, false) => None,
        }
    }

    pub fn leases(self) -> bool {
        matches!(self, ProbeFor::Both | ProbeFor::Leases)
    }

    pub fn known_rejections(self) -> bool {
        matches!(self, ProbeFor::Both | ProbeFor::KnownRejections)
    }
}

/// What [`Table::probe`] found.
#[derive(Debug, Clone, PartialEq)]
pub enum Probe {
    /// A known rejection applies for `left_ns` more.
    Rejected {
        cause: RejectionCause,
        left_ns: u64,
        limit: Option<KnownLimit>,
    },
    /// The cost was taken from lease `lease_id`, which has `tokens_left`.
    Taken {
        lease_id: u64,
        tokens_left: u64,
        limit: Option<KnownLimit>,
    },
    /// The lease could pay but is running low: the request takes the remote path and asks for
    /// the next lease (sized from `previous`); the entry is marked renewing.
    Renew {
        previous: Option<PreviousLease>,
        /// The retired lease to give back with the ask: (lease id, tokens).
        give_back: Option<(u64, u64)>,
    },
    /// Nothing local decides: the request goes to the sidecar.
    Undecided,
    /// As `Undecided`, and the table holds no entry of this bucket (so an admission has nothing
    /// to update there: [`Table::learn`] can be skipped).
    NoEntry,
}

/// What a callout answered for one decision, as the fast paths learn from it.
#[derive(Debug, Clone, PartialEq)]
pub struct Learned {
    pub cost: u64,
    pub limit: Option<KnownLimit>,
    pub outcome: DecisionOutcome,
    /// The decision asked for a lease: (lease id, ttl_ms).
    pub asked_lease: Option<(u64, u64)>,
    pub leased: u64,
    /// The policy epoch the answer was decided under (as far as the gateway knows).
    pub epoch: u64,
}

/// The sidecar's verdict on one decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionOutcome {
    Admitted,
    Rejected {
        cause: RejectionCause,
        retry_after_ms: u64,
    },
    /// No verdict for this bucket (an error, a shadow limit, another part rejected first).
    NotDecided,
}
