//! The requests of one worker waiting for the sidecar, and the batcher that picks what each call
//! on the worker's stream carries: at most `fast_paths.max_batch` requests, within the wire's
//! bounds on decisions ([`MAX_CALL_DECISIONS`]), lease returns ([`MAX_RETURNS`]) and bytes
//! ([`ratelimit_wire::budget`]) per call. Also which waiting requests are past their deadline (in
//! the queue, or in a call the sidecar has not answered). How coalescing works:
//! docs/fast-paths.md#coalesced-calls.

use std::collections::{HashMap, VecDeque};

use ratelimit_wire::budget::ITEMS_BYTES;
use ratelimit_wire::{DecideRequest, RequestDecisions, MAX_CALL_DECISIONS, MAX_RETURNS};

use super::Waiting;
use crate::config::Config;

/// A worker's requests on their way to the sidecar, by context id.
#[derive(Debug, Default)]
pub struct Queue {
    /// Every request paused for the sidecar: queued or in a flight.
    waiting: HashMap<u32, Waiting>,
    /// Those waiting for the next call, in arrival order.
    queued: VecDeque<u32>,
    /// The calls in flight, by id.
    flights: HashMap<u32, Flight>,
    /// A wake-up of the root is on its way.
    wake_pending: bool,
}

/// What the next call carries.
#[derive(Debug, PartialEq, Eq)]
pub struct Batch {
    /// The requests (contexts), in the call's order.
    pub requests: Vec<u32>,
    /// The call's body ([`DecideRequest`]).
    pub body: Vec<u8>,
    /// The earliest deadline among its requests, from now, in milliseconds (at least 1).
    pub timeout_ms: u64,
}

/// A call in flight: the requests it carries, and when it was sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flight {
    pub requests: Vec<u32>,
    pub dispatched_ns: u64,
    /// When its earliest request's deadline passes (a call on the stream has no timeout of the
    /// host's: [`Queue::overdue_flights`]).
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

/// How many requests one call carries and how many calls may be out at once: with
/// `fast_paths.coalesce`, `max_batch` and `max_in_flight`; without, one request a call, sent at
/// once.
pub fn limits(config: &Config) -> (usize, usize) {
    let fp = &config.fast_paths;
    if fp.coalesce {
        (fp.max_batch, fp.max_in_flight)
    } else {
        (1, usize::MAX)
    }
}

impl Queue {
    /// Queues a request for the next call. True when the root must be woken to send it (no
    /// wake-up on its way, room for a call: `max_in_flight` of [`limits`]).
    pub fn enqueue(&mut self, ctx: u32, w: Waiting, max_in_flight: usize) -> bool {
        self.waiting.insert(ctx, w);
        self.queued.push_back(ctx);
        let wake = !self.wake_pending && self.flights.len() < max_in_flight;
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
        self.waiting.remove(&ctx)
    }

    /// The next call, at `now_ns`, unless as many as [`limits`] allows are out or nothing waits.
    pub fn next_batch(&mut self, config: &Config, now_ns: u64) -> Option<Batch> {
        let (max_batch, max_in_flight) = limits(config);
        if self.flights.len() >= max_in_flight || self.queued.is_empty() {
            return None;
        }
        let own = self.take_queued(config, max_batch, &mut Budget::default());
        if own.is_empty() {
            return None;
        }
        let waiting: Vec<&Waiting> = own.iter().filter_map(|c| self.waiting.get(c)).collect();
        let deadline_ns = waiting
            .iter()
            .map(|w| w.deadline_ns)
            .min()
            .unwrap_or(now_ns);
        let body = call_body(config, waiting);
        Some(Batch {
            requests: own,
            body,
            timeout_ms: timeout_ms(deadline_ns, now_ns),
        })
    }

    /// A call of `batch` went out at `dispatched_ns`, as `token`.
    pub fn dispatched(&mut self, token: u32, batch: Batch, dispatched_ns: u64) {
        let flight = Flight {
            requests: batch.requests,
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

    /// The call `token` was answered: what it carried.
    pub fn landed(&mut self, token: u32) -> Option<Flight> {
        self.flights.remove(&token)
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

/// The body of a call for `own` (waiting requests of this worker), in that order.
///
/// It carries no attempt id: Envoy never repeats a message, so deduplication would cost Redis a
/// record per request for nothing (a request split across Cluster nodes gets an id from the
/// sidecar, for its refunds).
fn call_body<'a>(config: &Config, own: impl IntoIterator<Item = &'a Waiting>) -> Vec<u8> {
    let mut requests = Vec::new();
    let mut returns = Vec::new();
    for w in own {
        requests.push(RequestDecisions {
            decisions: w.decisions(config),
        });
        returns.extend(w.returns.iter().cloned());
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
