//! One worker VM: what it keeps across its requests (how busy each bucket is, its lease ids, the
//! policy epoch, the requests waiting for the sidecar, its streams, its stream to the sidecar
//! and the calls on it) and its requests' own events, without host calls; its root's events are
//! [`super::root`]'s.
//!
//! The host hands each event here with the facts it read, through a [`Host`] for what must
//! happen in the middle of one (open the stream, send a call, make a paused request the current
//! one), and carries out what comes back ([`Carry`]) once it no longer borrows the worker: a
//! resume or a local reply can call back into the VM. How a call travels:
//! docs/fast-paths.md#the-stream-per-worker.

use ratelimit_wire::stream::Call;

use super::batch::{self, Queue};
use super::link::{Link, SideCalls};
use super::streams::Streams;
use super::{Flow, RequestView, Start};
use crate::fastpath::Hotness;
use crate::verdict::{LimiterError, LocalReply, Verdict};

/// What one worker VM keeps across its requests.
#[derive(Debug)]
pub struct Worker {
    pub(super) hotness: Hotness,
    nonce: u64,
    lease_counter: u64,
    /// The sidecar's policy epoch as this worker last read it ([`crate::epoch`]; 0: unknown).
    pub(super) epoch: u64,
    /// The requests waiting for the sidecar.
    pub(super) queue: Queue,
    /// What it keeps of its streams (bodies awaited, response headers, meters, slots,
    /// settlements).
    pub streams: Streams,
    /// The calls besides the decisions: settlements, slot renewals or releases, the epoch poll.
    pub(super) side: SideCalls,
    /// The stream to the sidecar.
    pub(super) link: Link,
}

/// What the worker needs of the host in the middle of an event.
pub trait Host {
    /// Opens the stream to the sidecar: its token.
    fn open_stream(&mut self) -> Result<u32, LimiterError>;
    /// Sends `call` on the open stream `token`.
    fn send(&mut self, token: u32, call: &Call) -> Result<(), LimiterError>;
    /// Makes paused request `ctx` the current one: its facts, or `None` when it is gone (its
    /// client went away).
    fn request(&mut self, ctx: u32) -> Option<&dyn RequestView>;
}

/// A verdict on a paused request for the host to carry out, in the request's context.
#[derive(Debug, PartialEq)]
pub enum Carry {
    Resume(u32),
    Reply(u32, LocalReply),
}

/// What a request's own event ([`Flow::begin`]) comes to.
#[derive(Debug, PartialEq)]
pub enum Begun {
    /// It goes on (no rule applies, or it was admitted).
    Continue,
    /// It is answered with this reply.
    Reply(LocalReply),
    /// It waits for the sidecar; `wake`: the root must be woken to send it.
    Wait { wake: bool },
}

/// What a request's headers come to ([`Flow::request_headers`]).
#[derive(Debug, PartialEq)]
pub struct Headers {
    /// Ask the upstream for an uncompressed response (`accept-encoding: identity`): a matching
    /// rule reads its real cost from the response's body.
    pub identity: bool,
    /// `None`: the request waits for its body ([`Flow::request_body`]); else what it came to.
    pub begun: Option<Begun>,
}

/// What a chunk of a request's body comes to ([`Flow::request_body`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Body {
    /// Let it pass: the request is not paused.
    Continue,
    /// Hold it: the request waits for its verdict, or for the rest of its body.
    Pause,
    /// The body is whole: read it (at most this many bytes: a longer one is decided without
    /// it) and begin the request with it ([`Flow::begin`]).
    Begin { max_bytes: usize },
}

impl Worker {
    /// A worker whose lease ids and settlement batches derive from `nonce` (random per VM).
    pub fn new(nonce: u64) -> Worker {
        Worker {
            hotness: Hotness::default(),
            nonce,
            lease_counter: 0,
            epoch: 0,
            queue: Queue::default(),
            streams: Streams::new(nonce),
            side: SideCalls::default(),
            link: Link::default(),
        }
    }

    /// The policy epoch this worker's fast paths answer under.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The id of the next lease ask: splitmix64 of (nonce + counter), distinct per VM and per
    /// ask, below 2^53 (JSON carries it exactly), never 0.
    pub(super) fn lease_id(&mut self) -> u64 {
        self.lease_counter = self.lease_counter.wrapping_add(1);
        let mut z = self
            .nonce
            .wrapping_add(self.lease_counter.wrapping_mul(0x9e3779b97f4a7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^= z >> 31;
        (z & ratelimit_wire::MAX_LEASE_ID).max(1)
    }

    /// The wake-up of the root arrived (or could not be sent): the next request may send another.
    pub fn woken(&mut self) {
        self.queue.woken();
    }
}

impl Flow<'_> {
    /// Request `ctx` (the current one, read through `request`) starts at `now_ns`, with its body
    /// when it waited for it.
    pub fn begin(
        &self,
        worker: &mut Worker,
        request: &dyn RequestView,
        ctx: u32,
        body: Option<&[u8]>,
        now_ns: u64,
    ) -> Begun {
        match self.start_with_body(request, body, now_ns, worker) {
            Start::Pass => Begun::Continue,
            Start::Reply(reply) => Begun::Reply(reply),
            Start::Decided(verdict) => {
                self.delivered(&verdict);
                match verdict {
                    Verdict::Admit { headers } => {
                        worker.streams.admitted(ctx, headers, Vec::new());
                        Begun::Continue
                    }
                    Verdict::Reject(reply) => Begun::Reply(reply),
                }
            }
            Start::Wait(w) => {
                let (_, max_in_flight) = batch::limits(self.config);
                let wake = worker.queue.enqueue(ctx, w, max_in_flight);
                Begun::Wait { wake }
            }
        }
    }

    /// Request `ctx`'s headers came at `now_ns` (`end_of_stream`: without a body). A request a
    /// matching rule reserves for from its JSON waits for its body until `sidecar.timeout_ms`;
    /// Envoy delivers it to a paused filter only with the Wasm filter's
    /// `allow_on_headers_stop_iteration: true` (docs/costs.md), and without it the request is
    /// decided without its body at that deadline (a tick), on the fallback reservation.
    pub fn request_headers(
        &self,
        worker: &mut Worker,
        request: &dyn RequestView,
        ctx: u32,
        end_of_stream: bool,
        now_ns: u64,
    ) -> Headers {
        let identity = self.reads_response_body(request);
        if !end_of_stream && self.wants_request_body(request) {
            let deadline = now_ns.saturating_add(self.config.sidecar.timeout_ms * 1_000_000);
            worker.streams.await_body(ctx, deadline);
            return Headers {
                identity,
                begun: None,
            };
        }
        let begun = self.begin(worker, request, ctx, None, now_ns);
        Headers {
            identity,
            begun: Some(begun),
        }
    }

    /// A chunk of request `ctx`'s body came (`end_of_stream`: its last).
    pub fn request_body(&self, worker: &mut Worker, ctx: u32, end_of_stream: bool) -> Body {
        if !worker.streams.awaits_body(ctx) {
            // Paused for the sidecar: the body waits with it (Envoy buffers it).
            return if worker.queue.holds(ctx) {
                Body::Pause
            } else {
                Body::Continue
            };
        }
        if !end_of_stream {
            return Body::Pause; // Envoy buffers the body until its end
        }
        worker.streams.body_came(ctx);
        Body::Begin {
            max_bytes: crate::costs::MAX_METERED_BYTES,
        }
    }

    /// Request `ctx` went away (its stream ended, or its client hung up while it waited): nothing
    /// more is added to its response, its slots go back, its meters settle as they stand, and
    /// what its leases paid goes back if it never reached the upstream.
    pub fn ended(&self, worker: &mut Worker, ctx: u32, now_ns: u64) {
        worker.streams.ended(self, ctx);
        if let Some(mut w) = worker.queue.forget(ctx) {
            self.give_back(&mut w, now_ns);
        }
    }
}
