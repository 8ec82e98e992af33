//! The requests of one worker waiting for the sidecar, and the batcher that picks what each
//! callout carries: at most `fast_paths.max_batch` requests, within the wire's bounds on
//! decisions ([`MAX_CALL_DECISIONS`]), lease returns ([`MAX_RETURNS`]) and bytes
//! ([`ratelimit_wire::budget`]) per call, other workers'
//! requests (as the courier) up to half the batch first, so neither side waits behind the other.
//! Also which waiting requests are past their deadline (in the queue, or forwarded to a courier
//! that has not answered). How coalescing works: docs/fast-paths.md#coalesced-callouts.

use std::collections::{HashMap, VecDeque};

use ratelimit_wire::budget::{self, ITEMS_BYTES};
use ratelimit_wire::{DecideRequest, RequestDecisions, MAX_CALL_DECISIONS, MAX_RETURNS};

use super::courier::{Forward, Forwarded};
use super::Waiting;
use crate::config::Config;

/// A worker's requests on their way to the sidecar, by context id.
#[derive(Debug, Default)]
pub struct Queue {
    /// Every request paused for the sidecar: queued, in a flight, forwarded, or in its own
    /// callout (without coalescing).
    waiting: HashMap<u32, Waiting>,
    /// Those waiting for the next callout, in arrival order.
    queued: VecDeque<u32>,
    /// Those forwarded to the courier, with when.
    forwarded: HashMap<u32, u64>,
    /// As the courier: other workers' requests waiting for a callout.
    carried: VecDeque<Carried>,
    /// The callouts in flight, by token.
    flights: HashMap<u32, Flight>,
    /// A wake-up of the root is on its way.
    wake_pending: bool,
}

/// A request of another worker, carried by this worker as the courier.
#[derive(Debug)]
pub struct Carried {
    /// Its worker's nonce.
    pub origin: u64,
    pub request: Forwarded,
}

/// What the next callout carries.
#[derive(Debug, PartialEq, Eq)]
pub struct Batch {
    /// Requests of this worker (contexts), first in the call.
    pub own: Vec<u32>,
    /// Requests of other workers (their worker's nonce, their context), after `own`.
    pub carried: Vec<(u64, u32)>,
    /// The call's body ([`DecideRequest`]).
    pub body: Vec<u8>,
    /// The earliest deadline among its requests, from now, in milliseconds (at least 1).
    pub timeout_ms: u64,
}

/// A callout in flight: the requests it carries, and when it was sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flight {
    pub own: Vec<u32>,
    pub carried: Vec<(u64, u32)>,
    pub dispatched_ns: u64,
    /// When its earliest request's deadline passes (a call on the stream per worker has no
    /// timeout of the host's: [`Queue::overdue_flights`]).
    pub deadline_ns: u64,
}

/// Decisions, returns and bytes taken into one call so far, against the wire's bounds.
#[derive(Debug, Default)]
struct Budget {
    requests: usize,
    decisions: usize,
    returns: usize,
    bytes: usize,
}

/// What one request adds to a call.
#[derive(Debug, Clone, Copy)]
struct Size {
    decisions: usize,
    returns: usize,
    /// An upper bound of its JSON bytes ([`ratelimit_wire::budget`]).
    bytes: usize,
}

impl Budget {
    /// Whether a request of `size` still fits (the first always does: the configuration's
    /// largest request fits a call on its own, `Config::validate`).
    fn admits(&self, size: Size) -> bool {
        self.requests == 0
            || (self.decisions + size.decisions <= MAX_CALL_DECISIONS
                && self.returns + size.returns <= MAX_RETURNS
                && self.bytes + size.bytes <= ITEMS_BYTES)
    }

    fn add(&mut self, size: Size) {
        self.requests += 1;
        self.decisions += size.decisions;
        self.returns += size.returns;
        self.bytes += size.bytes;
    }
}

/// The size of a forwarded request.
fn carried_size(c: &Forwarded) -> Size {
    let returns: usize = c.returns.iter().map(budget::return_bytes).sum();
    Size {
        decisions: c.decisions.decisions.len(),
        returns: c.returns.len(),
        bytes: budget::request_bytes(&c.decisions.decisions) + returns,
    }
}

impl Queue {
    /// Holds a request with a callout of its own (without coalescing) and returns that callout:
    /// a batch of one, built as every batch is.
    pub fn alone(&mut self, ctx: u32, w: Waiting, config: &Config, now_ns: u64) -> Batch {
        let timeout_ms = timeout_ms(w.deadline_ns, now_ns);
        let body = call_body(config, [&w], &[]);
        self.waiting.insert(ctx, w);
        Batch {
            own: vec![ctx],
            carried: Vec::new(),
            body,
            timeout_ms,
        }
    }

    /// Queues a request for the next callout. True when the root must be woken to send it (no
    /// wake-up on its way, room for a callout, no forward out).
    pub fn enqueue(&mut self, ctx: u32, w: Waiting, max_in_flight: usize) -> bool {
        self.waiting.insert(ctx, w);
        self.queued.push_back(ctx);
        let wake =
            !self.wake_pending && self.flights.len() < max_in_flight && self.forwarded.is_empty();
        self.wake_pending |= wake;
        wake
    }

    /// The wake-up arrived (or could not be sent): the next request may send another.
    pub fn woken(&mut self) {
        self.wake_pending = false;
    }

    /// Whether request `ctx` is paused for the sidecar (its body, if more comes, is held back
    /// until its verdict).
    pub fn holds(&self, ctx: u32) -> bool {
        self.waiting.contains_key(&ctx)
    }

    /// Takes a waiting request out, to settle it.
    pub fn take(&mut self, ctx: u32) -> Option<Waiting> {
        self.waiting.remove(&ctx)
    }

    /// Forgets a request that went away while it waited; returns it, for its lease takes.
    pub fn forget(&mut self, ctx: u32) -> Option<Waiting> {
        self.forwarded.remove(&ctx);
        self.waiting.remove(&ctx)
    }

    /// The next callout, at `now_ns`, unless `max_in_flight` are out or nothing waits. Other
    /// workers' requests past their deadline are dropped unsent (their own worker settles them).
    pub fn next_batch(&mut self, config: &Config, now_ns: u64) -> Option<Batch> {
        let fp = &config.fast_paths;
        if self.flights.len() >= fp.max_in_flight
            || (self.queued.is_empty() && self.carried.is_empty())
        {
            return None;
        }
        self.carried.retain(|c| c.request.deadline_ns > now_ns);
        let mut budget = Budget::default();
        let reserved = self.carried.len().min(fp.max_batch / 2);
        let mut own = self.take_queued(config, fp.max_batch - reserved, &mut budget);
        let mut carried = Vec::new();
        while own.len() + carried.len() < fp.max_batch {
            let Some(c) = self.carried.front() else {
                break;
            };
            let size = carried_size(&c.request);
            if !budget.admits(size) {
                break;
            }
            budget.add(size);
            carried.extend(self.carried.pop_front());
        }
        let room = fp.max_batch - own.len() - carried.len();
        own.extend(self.take_queued(config, room, &mut budget));
        if own.is_empty() && carried.is_empty() {
            return None;
        }
        let waiting: Vec<&Waiting> = own.iter().filter_map(|c| self.waiting.get(c)).collect();
        let deadline_ns = waiting
            .iter()
            .map(|w| w.deadline_ns)
            .chain(carried.iter().map(|c| c.request.deadline_ns))
            .min()
            .unwrap_or(now_ns);
        let body = call_body(config, waiting, &carried);
        Some(Batch {
            own,
            carried: carried
                .iter()
                .map(|c| (c.origin, c.request.context))
                .collect(),
            body,
            timeout_ms: timeout_ms(deadline_ns, now_ns),
        })
    }

    /// A callout of `batch` went out at `dispatched_ns`, as `token`.
    pub fn dispatched(&mut self, token: u32, batch: Batch, dispatched_ns: u64) {
        let flight = Flight {
            own: batch.own,
            carried: batch.carried,
            dispatched_ns,
            deadline_ns: dispatched_ns.saturating_add(batch.timeout_ms.saturating_mul(1_000_000)),
        };
        self.flights.insert(token, flight);
    }

    /// The calls in flight whose deadline passed at `now_ns`, no longer awaited (an answer that
    /// comes later finds no flight): their requests' failure policies apply.
    pub fn overdue_flights(&mut self, now_ns: u64) -> Vec<Flight> {
        let overdue: Vec<u32> = self
            .flights
            .iter()
            .filter(|(_, f)| f.deadline_ns <= now_ns)
            .map(|(t, _)| *t)
            .collect();
        overdue
            .into_iter()
            .filter_map(|t| self.flights.remove(&t))
            .collect()
    }

    /// Every call in flight, no longer awaited (the stream that carried them closed).
    pub fn all_flights(&mut self) -> Vec<Flight> {
        self.flights.drain().map(|(_, f)| f).collect()
    }

    /// The callout `token` was answered (or failed): what it carried.
    pub fn landed(&mut self, token: u32) -> Option<Flight> {
        self.flights.remove(&token)
    }

    /// As the courier: another worker's forwarded requests, for the next callouts.
    pub fn carry(&mut self, forward: Forward) {
        let origin = forward.origin;
        self.carried.extend(
            forward
                .requests
                .into_iter()
                .map(|request| Carried { origin, request }),
        );
    }

    /// Whether this worker holds other workers' requests (it then sends them itself: see
    /// [`super::courier::sender`]).
    pub fn carries_others(&self) -> bool {
        !self.carried.is_empty()
    }

    /// The queued requests to forward to the courier (at most `max_batch`, within the wire's
    /// bounds) as a message from this worker (`origin`), unless a forward is still out or
    /// nothing is queued. They leave the queue: [`Queue::forwarded`] or [`Queue::unforward`]
    /// once the message was posted or not.
    pub fn next_forward(&mut self, config: &Config, origin: u64) -> Option<(Vec<u32>, Forward)> {
        if !self.forwarded.is_empty() || self.queued.is_empty() {
            return None;
        }
        let contexts =
            self.take_queued(config, config.fast_paths.max_batch, &mut Budget::default());
        let requests = contexts
            .iter()
            .filter_map(|c| {
                let w = self.waiting.get(c)?;
                Some(Forwarded {
                    context: *c,
                    decisions: RequestDecisions {
                        decisions: w.decisions(config),
                    },
                    returns: w.returns.clone(),
                    deadline_ns: w.deadline_ns,
                })
            })
            .collect();
        Some((contexts, Forward { origin, requests }))
    }

    /// The forward of `contexts` went out at `now_ns`.
    pub fn forwarded(&mut self, contexts: Vec<u32>, now_ns: u64) {
        self.forwarded
            .extend(contexts.into_iter().map(|c| (c, now_ns)));
    }

    /// The forward of `contexts` could not be posted: they go back to the front of the queue,
    /// in their order.
    pub fn unforward(&mut self, contexts: Vec<u32>) {
        for c in contexts.into_iter().rev() {
            self.queued.push_front(c);
        }
    }

    /// The courier answered a forwarded request: when it was forwarded, if it still waits for
    /// that answer.
    pub fn forward_answered(&mut self, ctx: u32) -> Option<u64> {
        self.forwarded.remove(&ctx)
    }

    /// The queued requests whose deadline passed at `now_ns` (or that are gone), taken out of
    /// the queue: their failure policies apply.
    pub fn expired(&mut self, now_ns: u64) -> Vec<u32> {
        let Queue {
            queued, waiting, ..
        } = self;
        // One pass (a queue of thousands during an outage must not cost its square).
        let mut expired = Vec::new();
        queued.retain(|&c| {
            let overdue = waiting.get(&c).is_none_or(|w| w.deadline_ns <= now_ns);
            if overdue {
                expired.push(c);
            }
            !overdue
        });
        expired
    }

    /// The forwarded requests the courier did not answer by their deadline (`now_ns`), no
    /// longer awaited from it: their failure policies apply, and this worker takes the courier's
    /// place (it may be gone or stuck).
    pub fn overdue_forwards(&mut self, now_ns: u64) -> Vec<u32> {
        let Queue {
            forwarded, waiting, ..
        } = self;
        let mut overdue = Vec::new();
        forwarded.retain(|c, _| match waiting.get(c) {
            Some(w) if w.deadline_ns <= now_ns => {
                overdue.push(*c);
                false
            }
            Some(_) => true,
            None => false,
        });
        overdue
    }

    /// Takes up to `max` requests from the front of the queue, within `budget` (a request that
    /// would pass it waits for the next call).
    fn take_queued(&mut self, config: &Config, max: usize, budget: &mut Budget) -> Vec<u32> {
        let mut taken = Vec::new();
        while taken.len() < max {
            let Some(&ctx) = self.queued.front() else {
                break;
            };
            let Some(w) = self.waiting.get(&ctx) else {
                self.queued.pop_front();
                continue;
            };
            let size = Size {
                decisions: w.remote.len(),
                returns: w.returns.len(),
                bytes: w.wire_bytes(config),
            };
            if !budget.admits(size) {
                break;
            }
            self.queued.pop_front();
            taken.push(ctx);
            budget.add(size);
        }
        taken
    }
}

/// Milliseconds from `now_ns` to `deadline_ns`, rounded up, at least 1.
fn timeout_ms(deadline_ns: u64, now_ns: u64) -> u64 {
    deadline_ns
        .saturating_sub(now_ns)
        .div_ceil(1_000_000)
        .max(1)
}

/// The body of a callout for `own` (waiting requests of this worker) and `carried` (other
/// workers' requests), in that order.
///
/// It carries no attempt id: Envoy never repeats a callout, so deduplication would cost Redis a
/// record per request for nothing (a request split across Cluster nodes gets an id from the
/// sidecar, for its refunds).
fn call_body<'a>(
    config: &Config,
    own: impl IntoIterator<Item = &'a Waiting>,
    carried: &[Carried],
) -> Vec<u8> {
    let mut requests = Vec::new();
    let mut returns = Vec::new();
    for w in own {
        requests.push(RequestDecisions {
            decisions: w.decisions(config),
        });
        returns.extend(w.returns.iter().cloned());
    }
    for c in carried {
        requests.push(c.request.decisions.clone());
        returns.extend(c.request.returns.iter().cloned());
    }
    let call = DecideRequest {
        domain: config.domain.clone(),
        attempt: None,
        requests,
        returns,
    };
    // Serialising strings and numbers cannot fail.
    serde_json::to_vec(&call).unwrap_or_default()
}
