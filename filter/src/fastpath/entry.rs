//! One bucket's entry in shared data: what is known of it (a rejection, leases) and its
//! binary encoding.

use super::*;

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
    pub(super) fn held(&self, now_ns: u64) -> bool {
        self.until_ns > now_ns && self.tokens > 0 && self.id != 0
    }

    /// What it was used at, to size the next ask by.
    pub(super) fn previous(&self) -> Option<PreviousLease> {
        (self.granted > 0).then(|| PreviousLease {
            granted: self.granted,
            used: self.granted - self.tokens.min(self.granted),
            asked_ns: self.granted_ns,
        })
    }

    pub(super) fn put(&self, out: &mut Vec<u8>) {
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

    pub(super) fn read(r: &mut Reader<'_>) -> Option<Lease> {
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
    pub(super) fn new(id: &str) -> Entry {
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
    pub(super) fn take_retired(&mut self, now_ns: u64) -> Option<(u64, u64)> {
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
    pub(super) fn renewal_due(&self, cost: u64, now_ns: u64, epoch: u64) -> bool {
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

pub(super) fn put_str(out: &mut Vec<u8>, s: &str) {
    let bytes = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
    out.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
    out.extend_from_slice(bytes);
}

pub(super) struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    pub(super) fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    pub(super) fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    pub(super) fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    }
    pub(super) fn str(&mut self) -> Option<String> {
        let n = self.take(2).map(|b| u16::from_le_bytes([b[0], b[1]]))? as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
}
