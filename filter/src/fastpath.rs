//! What a gateway knows about a bucket without asking: known rejections and leases, one
//! [`Entry`] per bucket in a [`Table`] of `slots` shared-data keys (`ratelimit.fp.<n>`), so every
//! worker VM of one Envoy sees them; how busy each bucket is at this worker ([`Hotness`]); and
//! the size of a lease ask ([`lease_size`]). It never admits what the bucket would not: a lease
//! pays only tokens Redis deducted for this gateway, and both a known rejection and a lease end
//! no later than Redis's own, their time counted from when the callout was dispatched. Each path,
//! why it is exact and what it may cost: docs/fast-paths.md.

use crate::config::FastPaths;
use crate::shared::{compare_and_swap, SharedDataError, SharedStore, Write};

/// How long a rejection for a blocked subject or a cost above the capacity (no wait to go by) is
/// known, in nanoseconds.
pub const FIXED_REJECTION_NS: u64 = 1_000_000_000;

/// The entry format's version; 6: times from the VM's [`crate::clock`] (monotonic), not the wall
/// clock (an entry of a build before, still in shared data during a plugin update, is none).
const VERSION: u8 = 6;

/// A lease asks for this many times what its bucket would spend over the lease's time at the
/// rate measured (room for a rate that grows while it lasts).
pub const LEASE_HEADROOM: f64 = 1.25;

/// A lease is renewed once paying a request would leave it less than its grant divided by this
/// (a quarter).
pub const RENEW_TOKENS_DIVISOR: u64 = 4;

/// A lease is renewed once less than its time divided by this is left (its last tenth).
pub const RENEW_TIME_DIVISOR: u64 = 10;

/// A lease is renewed once what it holds would last fewer than this many round trips of the
/// last ask, at the rate it is being spent.
pub const RENEW_ROUND_TRIPS: u64 = 3;

/// The round trip of a bucket's lease asks, remembered as a decaying maximum: at each grant the
/// one remembered is kept at `ASK_RTT_KEPT / ASK_RTT_DIVISOR` of itself if the new one is
/// shorter (one slow answer is remembered for a few asks).
pub const ASK_RTT_KEPT: u64 = 3;
/// See [`ASK_RTT_KEPT`].
pub const ASK_RTT_DIVISOR: u64 = 4;

/// The shared-data key of the slot for a bucket id.
pub fn slot_key(id: &str, slots: usize) -> String {
    format!(
        "ratelimit.fp.{}",
        fnv1a(id.as_bytes()) % slots.max(1) as u64
    )
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// Why a bucket rejects (as the sidecar said), for a local reply of the same shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectionCause {
    Insufficient,
    CostExceedsCapacity,
    Blocked,
}

/// The limit a bucket was judged by, for the rate-limit headers of a local answer.
#[derive(Debug, Clone, PartialEq)]
pub struct KnownLimit {
    pub name: String,
    pub capacity: u64,
    pub refill_per_sec: f64,
}

/// One bucket's entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub id: String,
    pub limit: Option<KnownLimit>,
    /// A rejection of `reject_cost` or more until `reject_until_ns` (0: none), answered locally
    /// until `reject_local_until_ns` (at most the table's `max_rejection_ns` after the callout:
    /// then the next request asks again, and sees a policy change).
    pub reject_cost: u64,
    pub reject_until_ns: u64,
    pub reject_local_until_ns: u64,
    pub reject_cause: RejectionCause,
    /// The policy epoch the rejection was learned under: it is not answered under another one.
    pub reject_epoch: u64,
    /// The lease in use.
    pub lease: Lease,
    /// The next lease, granted while the one in use still paid (an early renewal). It takes over
    /// when the one in use cannot pay.
    pub next: Lease,
    /// An ask for a lease is in flight until then (0: none).
    pub renewing_until_ns: u64,
    /// How long a granted ask takes, from its dispatch to its answer: the last one's, or three
    /// quarters of the one before if that was longer (0: none yet).
    pub ask_rtt_ns: u64,
    /// The lease in use before the next one took over, while Redis still holds its record: the
    /// next ask gives it back (what it holds, less than a request's cost), so that the bucket's
    /// record of it goes at once instead of at its end (a bucket holds a bounded number).
    pub retired: Lease,
}

/// A lease of tokens (all zero: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Lease {
    pub id: u64,
    /// Tokens left.
    pub tokens: u64,
    /// Usable until then.
    pub until_ns: u64,
    /// What it was granted, and when its ask was dispatched (to size the next one).
    pub granted: u64,
    pub granted_ns: u64,
    /// When it began paying (0: not yet, a next lease waiting).
    pub started_ns: u64,
    /// The policy epoch it was granted under: it pays under no other one (it still holds its
    /// tokens, given back with the next ask).
    pub epoch: u64,
}

impl Lease {
    /// Whether it can pay `cost` at `now_ns` under policy epoch `epoch`.
    pub fn pays(&self, cost: u64, now_ns: u64, epoch: u64) -> bool {
        self.until_ns > now_ns && self.tokens >= cost && self.epoch == epoch
    }

    /// Whether it holds tokens at `now_ns`.
    fn held(&self, now_ns: u64) -> bool {
        self.until_ns > now_ns && self.tokens > 0 && self.id != 0
    }

    /// What it was used at, to size the next ask by.
    fn previous(&self) -> Option<PreviousLease> {
        (self.granted > 0).then(|| PreviousLease {
            granted: self.granted,
            used: self.granted - self.tokens.min(self.granted),
            asked_ns: self.granted_ns,
        })
    }

    fn put(&self, out: &mut Vec<u8>) {
        for v in [
            self.id,
            self.tokens,
            self.until_ns,
            self.granted,
            self.granted_ns,
            self.started_ns,
            self.epoch,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    fn read(r: &mut Reader<'_>) -> Option<Lease> {
        Some(Lease {
            id: r.u64()?,
            tokens: r.u64()?,
            until_ns: r.u64()?,
            granted: r.u64()?,
            granted_ns: r.u64()?,
            started_ns: r.u64()?,
            epoch: r.u64()?,
        })
    }
}

impl Entry {
    fn new(id: &str) -> Entry {
        Entry {
            id: id.to_string(),
            limit: None,
            reject_cost: 0,
            reject_until_ns: 0,
            reject_local_until_ns: 0,
            reject_cause: RejectionCause::Insufficient,
            reject_epoch: 0,
            lease: Lease::default(),
            next: Lease::default(),
            renewing_until_ns: 0,
            ask_rtt_ns: 0,
            retired: Lease::default(),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(96 + self.id.len());
        out.push(VERSION);
        put_str(&mut out, &self.id);
        match &self.limit {
            Some(l) => {
                out.push(1);
                put_str(&mut out, &l.name);
                out.extend_from_slice(&l.capacity.to_le_bytes());
                out.extend_from_slice(&l.refill_per_sec.to_le_bytes());
            }
            None => out.push(0),
        }
        for v in [
            self.reject_cost,
            self.reject_until_ns,
            self.reject_local_until_ns,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.push(match self.reject_cause {
            RejectionCause::Insufficient => 0,
            RejectionCause::CostExceedsCapacity => 1,
            RejectionCause::Blocked => 2,
        });
        out.extend_from_slice(&self.reject_epoch.to_le_bytes());
        self.lease.put(&mut out);
        out.extend_from_slice(&self.renewing_until_ns.to_le_bytes());
        self.next.put(&mut out);
        out.extend_from_slice(&self.ask_rtt_ns.to_le_bytes());
        self.retired.put(&mut out);
        out
    }

    /// The entry in `bytes`, or `None` when they are not one (another version, garbage).
    pub fn decode(bytes: &[u8]) -> Option<Entry> {
        let mut r = Reader(bytes);
        if r.u8()? != VERSION {
            return None;
        }
        let id = r.str()?;
        let limit = match r.u8()? {
            0 => None,
            1 => Some(KnownLimit {
                name: r.str()?,
                capacity: r.u64()?,
                refill_per_sec: f64::from_bits(r.u64()?),
            }),
            _ => return None,
        };
        let mut e = Entry::new(&id);
        // Only what the answer checks let in (a limit name the headers can carry), whoever wrote
        // the entry.
        e.limit = limit.filter(|l| {
            l.refill_per_sec.is_finite()
                && l.refill_per_sec > 0.0
                && ratelimit_wire::names::is_limit_name(&l.name)
        });
        e.reject_cost = r.u64()?;
        e.reject_until_ns = r.u64()?;
        e.reject_local_until_ns = r.u64()?;
        e.reject_cause = match r.u8()? {
            0 => RejectionCause::Insufficient,
            1 => RejectionCause::CostExceedsCapacity,
            2 => RejectionCause::Blocked,
            _ => return None,
        };
        e.reject_epoch = r.u64()?;
        e.lease = Lease::read(&mut r)?;
        e.renewing_until_ns = r.u64()?;
        e.next = Lease::read(&mut r)?;
        e.ask_rtt_ns = r.u64()?;
        e.retired = Lease::read(&mut r)?;
        r.0.is_empty().then_some(e)
    }

    /// The rejection answered locally for `cost` at `now_ns` under policy epoch `epoch`: (cause,
    /// time left in ns until the bucket may admit it, for `Retry-After`).
    pub fn rejection(&self, cost: u64, now_ns: u64, epoch: u64) -> Option<(RejectionCause, u64)> {
        (self.reject_local_until_ns > now_ns
            && cost >= self.reject_cost
            && self.reject_cost > 0
            && self.reject_epoch == epoch)
            .then(|| {
                (
                    self.reject_cause,
                    self.reject_until_ns.max(self.reject_local_until_ns) - now_ns,
                )
            })
    }

    /// Whether it holds state worth its slot at `now_ns` under policy epoch `epoch`: a lease (in
    /// use or next) with tokens (of any epoch: they are Redis's until given back), an ask for one
    /// in flight, or a rejection in force.
    pub fn live(&self, now_ns: u64, epoch: u64) -> bool {
        self.lease.held(now_ns)
            || self.next.held(now_ns)
            || self.renewing_until_ns > now_ns
            || (self.reject_local_until_ns > now_ns && self.reject_epoch == epoch)
    }

    /// The retired lease to give back, if Redis still holds its record at `now_ns`: (lease id,
    /// tokens); it is no longer the entry's.
    fn take_retired(&mut self, now_ns: u64) -> Option<(u64, u64)> {
        let r = std::mem::take(&mut self.retired);
        (r.id != 0 && r.until_ns > now_ns).then_some((r.id, r.tokens))
    }

    /// Whether the lease in use can pay `cost` at `now_ns` under policy epoch `epoch`.
    pub fn lease_pays(&self, cost: u64, now_ns: u64, epoch: u64) -> bool {
        self.lease.pays(cost, now_ns, epoch)
    }

    /// Whether the lease in use (which can pay `cost`) is running low, with no next lease held,
    /// no ask in flight and no known rejection of `cost` (the bucket has nothing to lease: an ask
    /// would be rejected, and the lease's last tokens would never be spent): time to ask for the
    /// next one while this one still pays. Low: paying `cost` would leave less than a quarter of
    /// its grant ([`RENEW_TOKENS_DIVISOR`]); or, at the rate it is being spent, what is left would last less than
    /// [`RENEW_ROUND_TRIPS`] round trips of the last ask (a lease capped by `max_tokens` on a
    /// bucket busy enough to spend a quarter of it within one ask's round trip); or less than a
    /// tenth of its time is left ([`RENEW_TIME_DIVISOR`]) (a lease used more slowly than it was sized for: its
    /// successor, whose time starts when it is asked for, should not wait long unused).
    fn renewal_due(&self, cost: u64, now_ns: u64, epoch: u64) -> bool {
        let l = &self.lease;
        let ttl_ns = l.until_ns.saturating_sub(l.granted_ns);
        let left = l.tokens - cost;
        // What is left lasts left × spent / used: compared without a division, in floating
        // point (the products overflow 64 bits; an estimate is all it is).
        let soon = || {
            let used = l.granted.saturating_sub(l.tokens).saturating_add(cost);
            let spent_ns = now_ns.saturating_sub(l.started_ns.max(l.granted_ns)).max(1);
            (left as f64) * (spent_ns as f64)
                < (RENEW_ROUND_TRIPS as f64) * (self.ask_rtt_ns as f64) * (used.max(1) as f64)
        };
        self.renewing_until_ns <= now_ns
            && !self.next.held(now_ns)
            && self.rejection(cost, now_ns, epoch).is_none()
            && (left.saturating_mul(RENEW_TOKENS_DIVISOR) < l.granted
                || (l.until_ns - now_ns).saturating_mul(RENEW_TIME_DIVISOR) < ttl_ns
                || (self.ask_rtt_ns > 0 && soon()))
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let bytes = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
    out.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
    out.extend_from_slice(bytes);
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    }
    fn str(&mut self) -> Option<String> {
        let n = self.take(2).map(|b| u16::from_le_bytes([b[0], b[1]]))? as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
}

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
    fn update_found<T>(
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

/// What starting a lease ask found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseStart {
    /// The stopped leases' leftovers to give back: (lease id, tokens).
    pub give_back: Vec<(u64, u64)>,
    pub previous: Option<PreviousLease>,
}

/// The last lease of a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreviousLease {
    pub granted: u64,
    pub used: u64,
    pub asked_ns: u64,
}

/// The size of a lease ask: `clamp(ceil(rate * ttl * LEASE_HEADROOM), cost, max_tokens)`; `rate` from the
/// previous lease's use when there was one (tokens used over the time since it was asked), else
/// from `observed_per_sec`.
pub fn lease_size(
    previous: Option<PreviousLease>,
    observed_per_sec: f64,
    now_ns: u64,
    ttl_ms: u64,
    cost: u64,
    max_tokens: u64,
) -> u64 {
    let rate = match previous {
        Some(p) if now_ns > p.asked_ns => {
            let elapsed_s = (now_ns - p.asked_ns) as f64 / 1e9;
            (p.used as f64 / elapsed_s.max(1e-3)).max(observed_per_sec)
        }
        _ => observed_per_sec,
    };
    let want = (rate * ttl_ms as f64 / 1000.0 * LEASE_HEADROOM).ceil();
    // `as` saturates: an absurd rate cannot overflow.
    (want as u64).clamp(cost, max_tokens.max(cost))
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

/// How busy each bucket is at this worker: requests counted in fixed windows of `WINDOW_NS`,
/// for at most `MAX_TRACKED` buckets (a full table starts over: bounded memory).
#[derive(Debug, Default)]
pub struct Hotness {
    counts: std::collections::HashMap<String, (u64, u32, f64)>,
}

/// The counting window.
pub const WINDOW_NS: u64 = 200_000_000;
/// The most buckets one worker tracks.
pub const MAX_TRACKED: usize = 4096;

impl Hotness {
    /// Counts one request of `id` at `now_ns`; returns the rate of the last complete window
    /// (requests per second), or of the current one if it is higher.
    pub fn observe(&mut self, id: &str, now_ns: u64) -> f64 {
        if !self.counts.contains_key(id) {
            if self.counts.len() >= MAX_TRACKED {
                self.counts.clear();
            }
            // The id is copied only for a bucket not tracked yet.
            self.counts.insert(id.to_string(), (now_ns, 0, 0.0));
        }
        let Some((start, count, last_rate)) = self.counts.get_mut(id) else {
            return 0.0;
        };
        if now_ns >= *start + WINDOW_NS {
            let windows = (now_ns - *start) / WINDOW_NS;
            *last_rate = if windows == 1 {
                f64::from(*count) * 1e9 / WINDOW_NS as f64
            } else {
                0.0
            };
            *start += windows * WINDOW_NS;
            *count = 0;
        }
        *count = count.saturating_add(1);
        let current = f64::from(*count) * 1e9 / WINDOW_NS as f64;
        last_rate.max(current)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::fake::Memory;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;
    use ProbeFor::Both;

    const S: u64 = 1_000_000_000;

    fn limit() -> KnownLimit {
        KnownLimit {
            name: "per-app".into(),
            capacity: 100,
            refill_per_sec: 10.0,
        }
    }

    #[test]
    fn entries_round_trip_and_garbage_is_none() {
        let mut e = Entry::new("per-app|app=a");
        e.limit = Some(limit());
        e.reject_cost = 3;
        e.reject_until_ns = 9;
        e.reject_cause = RejectionCause::Blocked;
        e.lease.id = 7;
        e.lease.tokens = 5;
        assert_eq!(Entry::decode(&e.encode()), Some(e.clone()));
        assert_eq!(Entry::decode(b""), None);
        assert_eq!(Entry::decode(&[VERSION, 200, 0]), None);
        let mut long = e.encode();
        long.push(0);
        assert_eq!(Entry::decode(&long), None);
        // A limit whose name the headers could not carry is dropped, the rest of the entry kept.
        let mut bad = e.clone();
        bad.limit = Some(KnownLimit {
            name: "a\r\nx-injected: 1".into(),
            ..limit()
        });
        assert_eq!(
            Entry::decode(&bad.encode()),
            Some(Entry { limit: None, ..e })
        );
    }

    #[test]
    fn a_rejection_is_known_until_its_retry_after_counted_from_the_dispatch() {
        let m = Memory::default();
        let t = table(&m);
        let learned = rejected(2, 1500);
        t.learn("b", &learned, 10 * S, 10 * S);
        let e = t.get("b").unwrap();
        // Dispatched at 10 s, wait 1.5 s: known until 11.5 s, for costs of 2 or more.
        assert_eq!(
            e.rejection(2, 11 * S, 0),
            Some((RejectionCause::Insufficient, S / 2))
        );
        assert_eq!(
            e.rejection(5, 11 * S, 0),
            Some((RejectionCause::Insufficient, S / 2))
        );
        assert_eq!(e.rejection(1, 11 * S, 0), None, "a smaller cost may pass");
        assert_eq!(
            e.rejection(2, 11 * S + S / 2, 0),
            None,
            "never past its retry_after"
        );
        // An admission of that cost or more clears it.
        t.learn(
            "b",
            &Learned {
                outcome: DecisionOutcome::Admitted,
                ..learned
            },
            11 * S,
            11 * S,
        );
        assert_eq!(t.get("b").unwrap().rejection(2, 11 * S, 0), None);
    }

    #[test]
    fn a_lease_pays_until_it_runs_out_or_its_time_ends_and_gives_back_only_to_itself() {
        let m = Memory::default();
        let t = table(&m);
        let start = t.begin_lease("h", 0, S).unwrap();
        assert_eq!(start.give_back, vec![]);
        assert!(t.begin_lease("h", 1, S).is_none(), "one ask in flight");
        grant(&t, 77, 3, 0, 0);
        assert_eq!(take(&t, "h", 2, S / 2), Some(77));
        assert_eq!(take(&t, "h", 2, S / 2), None, "1 left < 2");
        t.give_back("h", 77, 2, S / 2);
        assert_eq!(take(&t, "h", 3, S / 2), Some(77));
        t.give_back("h", 99, 5, S / 2);
        assert_eq!(
            t.get("h").unwrap().lease.tokens,
            0,
            "another lease's give-back is lost"
        );
        t.give_back("h", 77, 1, S / 2);
        assert_eq!(
            take(&t, "h", 1, S),
            None,
            "not at or past its end (1 s after the ask)"
        );
        // The next ask stops this lease and hands its leftover back.
        let start = t.begin_lease("h", S / 2, S).unwrap();
        assert_eq!(start.give_back, vec![(77, 1)]);
        assert_eq!(
            start.previous,
            Some(PreviousLease {
                granted: 3,
                used: 2,
                asked_ns: 0
            })
        );
        assert_eq!(take(&t, "h", 1, S / 2), None, "stopped");
    }

    #[test]
    fn a_give_back_to_a_lease_the_next_one_replaced_is_returned_with_the_next_ask() {
        let m = Memory::default();
        let t = table(&m);
        // Lease 1 (2 tokens) in use, lease 2 (10) waiting as the next.
        grant(&t, 1, 2, 0, 0);
        grant(&t, 2, 10, 0, 0);
        // R1 takes from lease 1, R2 empties it, R3 makes lease 2 take over.
        assert_eq!(take(&t, "h", 1, 1), Some(1), "R1");
        assert_eq!(take(&t, "h", 1, 1), Some(1), "R2");
        assert_eq!(take(&t, "h", 1, 1), Some(2), "R3");
        // R1 is rejected by another rule: its token goes back to lease 1, now retired.
        t.give_back("h", 1, 1, 2);
        let e = t.get("h").unwrap();
        assert_eq!((e.lease.id, e.lease.tokens), (2, 9));
        assert_eq!(
            (e.retired.id, e.retired.tokens),
            (1, 1),
            "the rejected request's token is kept for lease 1"
        );
        // The next ask hands it back to Redis with lease 2's leftover: 10 tokens, as due.
        let start = t.begin_lease("h", 3, S).unwrap();
        let returned: u64 = start.give_back.iter().map(|(_, tokens)| tokens).sum();
        assert_eq!(start.give_back, vec![(2, 9), (1, 1)]);
        assert_eq!(returned, 10, "a rejected request charges nothing");
    }

    #[test]
    fn a_give_back_to_a_lease_no_longer_held_goes_to_the_lease_in_use_of_its_epoch() {
        let m = Memory::default();
        let mut t = table(&m);
        grant(&t, 1, 1, 0, 0);
        assert_eq!(take(&t, "h", 1, 1), Some(1));
        // Lease 1 is spent; a new ask gives it back (its record goes) and lease 2 arrives.
        let start = t.begin_lease("h", 1, S).unwrap();
        assert_eq!(start.give_back, vec![]);
        grant(&t, 2, 5, 1, 1);
        assert_eq!(take(&t, "h", 1, 2), Some(2));
        // The request paid by lease 1 is rejected: lease 1 is gone, lease 2 (the same epoch)
        // keeps the token (Redis takes back at most what it granted lease 2: never more).
        t.give_back("h", 1, 1, 3);
        assert_eq!(t.get("h").unwrap().lease.tokens, 5);
        // Under another epoch the token is not the lease's to pay: it is lost (never admitted
        // under a policy it was not granted under).
        t.epoch = 9;
        t.give_back("h", 1, 1, 3);
        assert_eq!(t.get("h").unwrap().lease.tokens, 5);
    }

    #[test]
    fn a_lease_running_low_asks_for_the_next_one_which_takes_over_when_it_cannot_pay() {
        let m = Memory::default();
        let t = table(&m);
        let grant = |id: u64, tokens: u64, at: u64, now: u64| grant(&t, id, tokens, at, now);
        grant(77, 8, 0, 0);
        // Without `renew` (a bucket not busy enough) the lease is simply spent.
        assert_eq!(t.probe("h", 1, 1, Both, None), t_taken(77, 7));
        // Paying down to 2 of 8 keeps at least a quarter; the request that would leave 1 asks.
        for left in (2..7).rev() {
            assert_eq!(t.probe("h", 1, 1, Both, Some(S)), t_taken(77, left));
        }
        assert_eq!(
            t.probe("h", 1, 1, Both, Some(S)),
            Probe::Renew {
                previous: Some(PreviousLease {
                    granted: 8,
                    used: 6,
                    asked_ns: 0
                }),
                give_back: None,
            }
        );
        let e = t.get("h").unwrap();
        assert_eq!(
            (e.lease.tokens, e.renewing_until_ns),
            (2, S),
            "nothing taken, marked"
        );
        // One ask in flight: the others keep paying from the lease in use.
        assert_eq!(t.probe("h", 1, 2, Both, Some(S)), t_taken(77, 1));
        // The next lease arrives while the one in use still holds a token: it waits.
        grant(78, 10, 2, 3);
        let e = t.get("h").unwrap();
        assert_eq!(
            (e.lease.id, e.lease.tokens, e.next.id, e.next.tokens),
            (77, 1, 78, 10)
        );
        assert_eq!(e.renewing_until_ns, 0);
        assert_eq!(t.probe("h", 1, 4, Both, Some(S)), t_taken(77, 0));
        // The one in use is spent: the next one takes over, sized from its own grant.
        assert_eq!(t.probe("h", 1, 5, Both, Some(S)), t_taken(78, 9));
        let e = t.get("h").unwrap();
        assert_eq!((e.lease.granted, e.lease.granted_ns, e.next.id), (10, 2, 0));
        // A next lease never pays past its own end (1 s after its ask).
        grant(79, 4, 3, 6);
        assert_eq!(t.get("h").unwrap().next.id, 79);
        assert!(!matches!(
            t.probe("h", 10, S + 3, Both, None),
            Probe::Taken { .. }
        ));
        // A lease granted when the one in use is spent is used at once.
        t.begin_lease("h", S + 4, 2 * S);
        grant(80, 5, S + 4, S + 5);
        let e = t.get("h").unwrap();
        assert_eq!((e.lease.id, e.lease.tokens, e.next.id), (80, 5, 0));
        // In the first nine tenths of its time a full lease just pays; in the last tenth it asks
        // for the next one, however much it holds.
        let at = S + 4 + S * 85 / 100;
        assert_eq!(t.probe("h", 1, at, Both, Some(3 * S)), t_taken(80, 4));
        assert!(matches!(
            t.probe("h", 1, S + 4 + S * 95 / 100, Both, Some(3 * S)),
            Probe::Renew { .. }
        ));
    }

    #[test]
    fn a_lease_spent_faster_than_its_renewal_returns_asks_for_the_next_earlier() {
        let m = Memory::default();
        let t = table(&m);
        const MS: u64 = 1_000_000;
        // 100 tokens, asked at 0 and answered 10 ms later, then spent at one token per ms.
        t.begin_lease("h", 0, S);
        grant(&t, 77, 100, 0, 10 * MS);
        assert_eq!(t.get("h").unwrap().ask_rtt_ns, 10 * MS);
        for i in 1..=70 {
            assert_eq!(
                t.probe("h", 1, 10 * MS + i * MS, Both, Some(S)),
                t_taken(77, 100 - i),
                "take {i}"
            );
        }
        // 29 left would last 29 ms: under three round trips of the last ask (30 ms), although
        // above a quarter of the grant. Time to ask.
        assert!(matches!(
            t.probe("h", 1, 81 * MS, Both, Some(S)),
            Probe::Renew { .. }
        ));
    }

    #[test]
    fn the_lease_a_next_one_took_over_from_is_given_back_by_the_next_ask() {
        let m = Memory::default();
        let t = table(&m);
        t.begin_lease("h", 0, S);
        grant(&t, 77, 4, 0, 0);
        for left in [3, 2, 1] {
            assert_eq!(t.probe("h", 1, 1, Both, Some(S)), t_taken(77, left));
        }
        assert!(matches!(
            t.probe("h", 1, 1, Both, Some(S)),
            Probe::Renew {
                give_back: None,
                ..
            }
        ));
        // (Asked and answered at once here: no round trip to renew early for.)
        grant(&t, 78, 8, 2, 2);
        assert_eq!(t.probe("h", 1, 3, Both, Some(S)), t_taken(77, 0));
        // 77 is spent: 78 takes over, and 77 (whose record Redis keeps until its end) retires.
        assert_eq!(t.probe("h", 1, 4, Both, Some(S)), t_taken(78, 7));
        assert_eq!(t.get("h").unwrap().retired.id, 77);
        for left in (2..7).rev() {
            assert_eq!(t.probe("h", 1, 5, Both, Some(S)), t_taken(78, left));
        }
        // The ask for 78's successor gives 77 back (0 tokens: its record goes).
        assert!(matches!(
            t.probe("h", 1, 6, Both, Some(S)),
            Probe::Renew {
                give_back: Some((77, 0)),
                ..
            }
        ));
        assert_eq!(t.get("h").unwrap().retired, Lease::default());
    }

    #[test]
    fn while_the_bucket_is_known_to_reject_a_lease_running_low_is_spent_not_renewed() {
        let m = Memory::default();
        let t = table(&m);
        grant(&t, 77, 4, 0, 0);
        assert_eq!(t.probe("h", 1, 1, Both, None), t_taken(77, 3));
        assert_eq!(t.probe("h", 1, 1, Both, None), t_taken(77, 2));
        // Another request was rejected: the bucket is empty for 10 s.
        t.learn("h", &rejected(1, 10_000), 1, 1);
        // 2 of 4 left would ask for the next lease; the ask would be rejected, so the lease pays.
        assert_eq!(t.probe("h", 1, 2, Both, Some(S)), t_taken(77, 1));
        assert_eq!(t.probe("h", 1, 2, Both, Some(S)), t_taken(77, 0));
        // Spent: the known rejection answers.
        assert!(matches!(
            t.probe("h", 1, 2, Both, Some(S)),
            Probe::Rejected { .. }
        ));
    }

    #[test]
    fn a_new_ask_gives_back_the_lease_in_use_and_a_next_one_that_could_not_pay() {
        let m = Memory::default();
        let t = table(&m);
        let grant = |id: u64, tokens: u64| grant(&t, id, tokens, 0, 0);
        grant(1, 4);
        grant(2, 2);
        let e = t.get("h").unwrap();
        assert_eq!((e.lease.tokens, e.next.tokens), (4, 2));
        // A request costing 5: neither lease pays it; its ask hands both leftovers back.
        assert_eq!(t.probe("h", 5, 1, Both, Some(S)), Probe::Undecided);
        let start = t.begin_lease("h", 1, S).unwrap();
        assert_eq!(start.give_back, vec![(1, 4), (2, 2)]);
        let e = t.get("h").unwrap();
        assert_eq!((e.lease.tokens, e.next.tokens, e.next.id), (0, 0, 0));
    }

    fn table(m: &Memory) -> Table<'_> {
        table_of(m, 64, u64::MAX)
    }

    fn table_of(m: &Memory, slots: usize, max_rejection_ns: u64) -> Table<'_> {
        Table {
            store: m,
            slots,
            max_rejection_ns,
            epoch: 0,
        }
    }

    /// Records a lease `id` of `tokens` granted to bucket "h" (asked at `at`, answered at `now`).
    fn grant(t: &Table<'_>, id: u64, tokens: u64, at: u64, now: u64) {
        grant_to(t, "h", id, tokens, at, now)
    }

    /// Bucket `bucket` learns it was granted lease `id` of `tokens`, asked at `at`, for 1 s.
    fn grant_to(t: &Table<'_>, bucket: &str, id: u64, tokens: u64, at: u64, now: u64) {
        t.learn(
            bucket,
            &Learned {
                cost: 1,
                limit: Some(limit()),
                outcome: DecisionOutcome::Admitted,
                asked_lease: Some((id, 1000)),
                leased: tokens,
                epoch: t.epoch,
            },
            at,
            now,
        )
    }

    /// The sidecar rejected `cost` for lack of tokens, with that wait.
    fn rejected(cost: u64, retry_after_ms: u64) -> Learned {
        Learned {
            cost,
            limit: Some(limit()),
            outcome: DecisionOutcome::Rejected {
                cause: RejectionCause::Insufficient,
                retry_after_ms,
            },
            asked_lease: None,
            leased: 0,
            epoch: 0,
        }
    }

    fn t_taken(lease_id: u64, tokens_left: u64) -> Probe {
        Probe::Taken {
            lease_id,
            tokens_left,
            limit: Some(limit()),
        }
    }

    /// The lease id `probe` took `cost` from.
    fn take(t: &Table<'_>, id: &str, cost: u64, now_ns: u64) -> Option<u64> {
        match t.probe(id, cost, now_ns, Both, None) {
            Probe::Taken { lease_id, .. } => Some(lease_id),
            _ => None,
        }
    }

    #[test]
    fn a_long_rejection_is_answered_locally_only_up_to_the_cap_with_the_whole_wait() {
        let m = Memory::default();
        let t = table_of(&m, 16, S);
        // Redis said: an hour to wait. Locally answered for a second after the callout.
        t.learn("h", &rejected(1, 3_600_000), 0, 10);
        assert!(
            matches!(t.probe("h", 1, S - 1, Both, None), Probe::Rejected { left_ns, .. } if left_ns == 3600 * S - (S - 1)),
            "Retry-After says the whole wait"
        );
        assert_eq!(
            t.probe("h", 1, S, Both, None),
            Probe::Undecided,
            "after the cap the next request asks again (and sees a raised limit)"
        );
        assert!(!t.get("h").unwrap().live(S, 0), "nor does it hold the slot");
        // A shorter wait than the cap is answered for the wait.
        t.learn("h", &rejected(1, 300), 2 * S, 2 * S);
        assert!(matches!(
            t.probe("h", 1, 2 * S + 299_999_999, Both, None),
            Probe::Rejected { .. }
        ));
        assert_eq!(
            t.probe("h", 1, 2 * S + 300_000_000, Both, None),
            Probe::Undecided
        );
    }

    #[test]
    fn a_lease_that_pays_goes_before_a_known_rejection() {
        let m = Memory::default();
        let t = table_of(&m, 16, u64::MAX);
        t.begin_lease("h", 0, S);
        grant(&t, 7, 2, 0, 0);
        t.learn("h", &rejected(1, 500), 0, 0);
        assert_eq!(
            t.probe("h", 1, 1, Both, None),
            Probe::Taken {
                lease_id: 7,
                tokens_left: 1,
                limit: Some(limit())
            }
        );
        assert_eq!(take(&t, "h", 1, 1), Some(7));
        assert!(
            matches!(t.probe("h", 1, 1, Both, None), Probe::Rejected { cause: RejectionCause::Insufficient, left_ns, .. } if left_ns == 500_000_000 - 1),
            "the lease is spent: the rejection answers"
        );
        assert_eq!(
            t.probe("h", 1, 1, ProbeFor::Leases, None),
            Probe::Undecided,
            "rejections off"
        );
    }

    #[test]
    fn an_admission_of_an_unknown_bucket_writes_nothing() {
        let m = Memory::default();
        let t = table_of(&m, 16, u64::MAX);
        let admitted = Learned {
            cost: 1,
            limit: Some(limit()),
            outcome: DecisionOutcome::Admitted,
            asked_lease: None,
            leased: 0,
            epoch: 0,
        };
        t.learn("quiet", &admitted, 0, 0);
        assert!(t.get("quiet").is_none());
        assert_eq!(t.probe("quiet", 1, 0, Both, None), Probe::NoEntry);
        // Once known (a rejection), an admission clears it.
        t.learn(
            "quiet",
            &Learned {
                outcome: DecisionOutcome::Rejected {
                    cause: RejectionCause::Insufficient,
                    retry_after_ms: 100,
                },
                ..admitted.clone()
            },
            0,
            0,
        );
        assert!(t.get("quiet").is_some());
        t.learn("quiet", &admitted, 1, 1);
        assert_eq!(t.get("quiet").unwrap().reject_until_ns, 0);
    }

    #[test]
    fn another_bucket_takes_a_slot_only_once_its_entry_is_no_longer_live() {
        let m = Memory::default();
        let t = table_of(&m, 1, u64::MAX);
        t.begin_lease("a", 0, S);
        grant_to(&t, "a", 1, 10, 0, 0);
        assert_eq!(take(&t, "b", 1, 1), None, "b never pays with a's lease");
        // While a's lease holds tokens, b gets no slot: no lease ask, no rejection recorded.
        assert!(t.begin_lease("b", 1, S).is_none());
        t.learn("b", &rejected(1, 60_000), 1, 1);
        assert_eq!(t.get("b"), None);
        assert_eq!(take(&t, "a", 1, 2), Some(1), "a's lease still pays");
        // Past a's lease (1 s after its ask), the slot is b's; a's state is gone.
        assert!(t.begin_lease("b", S + 1, 2 * S).is_some());
        assert!(t.get("a").is_none());
        assert!(t.get("b").is_some());
        // b's ask in flight keeps the slot too, and so does a rejection in force.
        assert!(t.begin_lease("a", S + 2, 2 * S).is_none());
        t.learn("b", &rejected(1, 5_000), S + 1, S + 3);
        assert!(
            t.begin_lease("a", 2 * S + 1, 3 * S).is_none(),
            "b's rejection is in force"
        );
        assert!(t.begin_lease("a", S + 1 + 5 * S + 1, 7 * S).is_some());
    }

    #[test]
    fn leases_are_sized_by_their_use() {
        assert_eq!(lease_size(None, 100.0, 0, 1000, 1, 1000), 125);
        assert_eq!(
            lease_size(None, 0.0, 0, 1000, 3, 1000),
            3,
            "at least the cost"
        );
        assert_eq!(
            lease_size(None, 1e12, 0, 1000, 1, 500),
            500,
            "at most max_tokens"
        );
        let previous = PreviousLease {
            granted: 100,
            used: 100,
            asked_ns: 0,
        };
        // 100 used in half a second: 200/s, so a 1 s lease asks 250.
        assert_eq!(lease_size(Some(previous), 10.0, S / 2, 1000, 1, 1000), 250);
    }

    #[test]
    fn hotness_counts_per_window() {
        let mut h = Hotness::default();
        for i in 0..20 {
            h.observe("k", i * 1_000_000);
        }
        // 20 requests within 200 ms: 100/s.
        assert_eq!(h.observe("k", WINDOW_NS + 1), 100.0);
        assert_eq!(h.observe("quiet", 0), 5.0);
        assert_eq!(
            h.observe("k", 5 * WINDOW_NS),
            5.0,
            "idle windows reset the rate"
        );
    }
}
