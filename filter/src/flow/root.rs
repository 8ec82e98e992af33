//! The root's events of one worker (its wake-ups, ticks, and the stream's messages and close):
//! the calls it sends on its stream and the verdicts it comes to for the paused requests, which
//! the host carries out afterwards ([`Carry`]). Each event is one [`Turn`].

use log::{debug, warn};
use ratelimit_wire::stream::{Answer, Kind};
use ratelimit_wire::{DecideResponse, RequestAnswer, SlotsResponse};

use super::batch::{self, Flight};
use super::link::{self, Pending, Route};
use super::{Carry, Flow, Histogram, Host, Start, Stat, Worker};
use crate::verdict::{self, LimiterError, Verdict};

/// One event of the root being worked through: the worker, the host, the time, and the verdicts
/// the host carries out afterwards.
struct Turn<'a> {
    worker: &'a mut Worker,
    host: &'a mut dyn Host,
    now_ns: u64,
    out: Vec<Carry>,
}

/// What a call besides the decisions got back: the HTTP status its answer stands for (none: no
/// answer by its deadline, or the stream closed) and the body.
struct Reply {
    status: Option<Vec<u8>>,
    body: Vec<u8>,
}

impl Reply {
    fn none() -> Reply {
        Reply {
            status: None,
            body: Vec::new(),
        }
    }

    fn ok(&self) -> bool {
        self.status.as_deref() == Some(b"200")
    }
}

impl Flow<'_> {
    /// The root was woken at `now_ns`: the settlements due, then the queue's batches while there
    /// is room for them ([`batch::limits`]).
    pub fn woken(&self, worker: &mut Worker, host: &mut dyn Host, now_ns: u64) -> Vec<Carry> {
        worker.queue.woken();
        let mut t = Turn::new(worker, host, now_ns);
        self.send_settlements(&mut t);
        self.send_batches(&mut t);
        t.out
    }

    /// A tick at `now_ns`, in its order: the policy epoch read (and polled when due), the
    /// settlements and slot renewals and releases due, the requests whose body did not come by
    /// their deadline decided without it, and the requests queued past their deadline and the
    /// calls unanswered by theirs given their failure policies.
    pub fn tick(&self, worker: &mut Worker, host: &mut dyn Host, now_ns: u64) -> Vec<Carry> {
        let mut t = Turn::new(worker, host, now_ns);
        if self.epoch_tick(t.worker, now_ns) {
            let timeout_ms = self.config.sidecar.timeout_ms;
            if let Err(e) = self.send_side(&mut t, Kind::Epoch, Vec::new(), timeout_ms) {
                debug!("ratelimit filter: cannot send the policy epoch poll: {e}");
                self.polled(t.worker, None, now_ns);
            }
        }
        self.send_settlements(&mut t);
        self.send_slots(&mut t);
        let late = t.worker.streams.late_bodies(now_ns);
        if !late.is_empty() {
            for ctx in late {
                self.start_paused(&mut t, ctx);
            }
            self.send_batches(&mut t);
        }
        for ctx in t.worker.queue.expired(now_ns) {
            self.resolve_paused(&mut t, ctx, Err(LimiterError::NoAnswer), None, now_ns);
        }
        for flight in t.worker.queue.overdue_flights(now_ns) {
            self.answer_flight(&mut t, flight, Err(LimiterError::NoAnswer));
        }
        for (kind, pending) in t.worker.side.overdue(now_ns) {
            self.side_answered(&mut t, kind, pending, Reply::none());
        }
        t.out
    }

    /// A message on stream `token` at `now_ns`: the answer to one call (`None`: it could not be
    /// read, and reaches no call; they end at their deadline).
    pub fn stream_message(
        &self,
        worker: &mut Worker,
        host: &mut dyn Host,
        token: u32,
        answer: Option<Answer>,
        now_ns: u64,
    ) -> Vec<Carry> {
        let mut t = Turn::new(worker, host, now_ns);
        if !t.worker.link.answered_on(token) {
            return t.out;
        }
        let Some(answer) = answer else {
            warn!("ratelimit filter: an unreadable message on the stream to the sidecar");
            return t.out;
        };
        let status = link::status_text(&answer);
        if let Some((kind, pending)) = t.worker.side.take(answer.id) {
            let reply = Reply {
                status: Some(status),
                body: answer.body,
            };
            self.side_answered(&mut t, kind, pending, reply);
            return t.out;
        }
        let Some(flight) = t.worker.queue.landed(answer.id) else {
            return t.out;
        };
        let answers = verdict::parse_answer(Some(&status), &answer.body, flight.requests.len());
        self.answer_flight(&mut t, flight, answers);
        self.send_batches(&mut t);
        t.out
    }

    /// Stream `token` closed at `now_ns` (the sidecar ended it, or the connection broke; `status`:
    /// the gRPC status the host gave): every call in flight on it gets its requests' failure
    /// policies; the next batch reopens it (after a backoff when it breaks again).
    pub fn stream_closed(
        &self,
        worker: &mut Worker,
        host: &mut dyn Host,
        token: u32,
        status: Option<u32>,
        now_ns: u64,
    ) -> Vec<Carry> {
        let mut t = Turn::new(worker, host, now_ns);
        self.closed(&mut t, token, status);
        t.out
    }

    fn closed(&self, t: &mut Turn<'_>, token: u32, status: Option<u32>) {
        if !t.worker.link.closed(token, t.now_ns) {
            return;
        }
        let breaks = t.worker.link.breaks();
        if breaks.is_power_of_two() {
            warn!(
                "ratelimit filter: the stream to the sidecar (cluster {:?}) closed with gRPC status {status:?}, {breaks} time(s) in a row without an answer; requests get their on_error until it answers again",
                self.config.sidecar.cluster
            );
        } else {
            debug!(
                "ratelimit filter: the stream to the sidecar closed ({token}, status {status:?})"
            );
        }
        for flight in t.worker.queue.all_flights() {
            self.answer_flight(t, flight, Err(LimiterError::NoAnswer));
        }
        for (kind, pending) in t.worker.side.all() {
            self.side_answered(t, kind, pending, Reply::none());
        }
    }

    /// Sends `body` as a call of `kind` on the stream, opening it first if needed: the call's
    /// id, or why it could not go out.
    fn send_call(&self, t: &mut Turn<'_>, kind: Kind, body: Vec<u8>) -> Result<u32, LimiterError> {
        let token = match t.worker.link.route(t.now_ns) {
            Route::Send { token } => token,
            Route::Down => {
                return Err(LimiterError::Dispatch(
                    "the stream to the sidecar is down (reopened after its backoff)".into(),
                ))
            }
            Route::Open => match t.host.open_stream() {
                Ok(token) => {
                    t.worker.link.opened(token);
                    token
                }
                Err(e) => {
                    t.worker.link.open_failed(t.now_ns);
                    return Err(e);
                }
            },
        };
        let call = t.worker.link.call(kind, body);
        match t.host.send(token, &call) {
            Ok(()) => Ok(call.id),
            Err(e) => {
                // The stream is gone under us: the calls it carried are failed now, as by a close.
                self.closed(t, token, None);
                Err(e)
            }
        }
    }

    /// Sends the queue's batches while there is room for them.
    fn send_batches(&self, t: &mut Turn<'_>) {
        while let Some(mut batch) = t.worker.queue.next_batch(self.config, t.now_ns) {
            let body = std::mem::take(&mut batch.body);
            self.stats
                .record(Histogram::BatchRequests, batch.requests.len() as u64);
            match self.send_call(t, Kind::Decide, body) {
                Ok(id) => {
                    self.stats.count(Stat::Callouts);
                    t.worker.queue.dispatched(id, batch, t.now_ns);
                }
                Err(e) => {
                    for ctx in batch.requests {
                        self.resolve_paused(t, ctx, Err(e.clone()), None, t.now_ns);
                    }
                    return;
                }
            }
        }
    }

    /// Answers the requests `flight` carried by `answers` (or why there are none: a call that
    /// gets no answer, as its stream closed or its deadline passed).
    fn answer_flight(
        &self,
        t: &mut Turn<'_>,
        flight: Flight,
        answers: Result<DecideResponse, LimiterError>,
    ) {
        self.stats.record(
            Histogram::DecisionUs,
            t.now_ns.saturating_sub(flight.dispatched_ns) / 1_000,
        );
        let epoch = answers.as_ref().ok().and_then(|a| a.epoch);
        self.answered_under(t.worker, epoch);
        for (i, &ctx) in flight.requests.iter().enumerate() {
            // `parse_answer` checked there is one answer per request.
            let answer = match &answers {
                Ok(a) => a.answers.get(i).cloned().ok_or(LimiterError::Count {
                    expected: flight.requests.len(),
                    got: a.answers.len(),
                }),
                Err(e) => Err(e.clone()),
            };
            self.resolve_paused(t, ctx, answer, epoch, flight.dispatched_ns);
        }
    }

    /// Resolves paused request `ctx` with the sidecar's answer to a call sent at `dispatched_ns`
    /// (or why there is none; `epoch`: the policy epoch the call said) into the verdict the host
    /// carries out.
    fn resolve_paused(
        &self,
        t: &mut Turn<'_>,
        ctx: u32,
        answer: Result<RequestAnswer, LimiterError>,
        epoch: Option<u64>,
        dispatched_ns: u64,
    ) {
        let Some(mut w) = t.worker.queue.take(ctx) else {
            return;
        };
        let now_ns = t.now_ns;
        // The concurrency slots the sidecar took for the request: held while its stream runs,
        // given back at once if it does not pass after all.
        let held = answer.as_ref().ok().and_then(|a| a.slot.clone());
        if let Some(held) = &held {
            let decisions = w.decisions(self.config);
            t.worker.streams.slots.hold(ctx, held, &decisions, now_ns);
        }
        let verdict = self.resolve_under(&mut w, answer, epoch, dispatched_ns, now_ns);
        if t.host.request(ctx).is_none() {
            // Gone (its client went away): nothing to answer; its leases back, and its
            // reservations stand (it never reached the upstream).
            self.give_back(&mut w, now_ns);
            t.worker.streams.release_slots(self, ctx);
            return;
        }
        self.delivered(&verdict);
        if !matches!(verdict, Verdict::Admit { .. }) && held.is_some() {
            t.worker.streams.release_slots(self, ctx);
        }
        let carry = match verdict {
            Verdict::Admit { headers } => {
                t.worker.streams.admitted(ctx, headers, self.metered(&w));
                Carry::Resume(ctx)
            }
            Verdict::Reject(reply) => Carry::Reply(ctx, reply),
        };
        t.out.push(carry);
    }

    /// Paused request `ctx` whose body did not come by its deadline starts without it: a verdict
    /// now, or it joins the queue.
    fn start_paused(&self, t: &mut Turn<'_>, ctx: u32) {
        let Some(request) = t.host.request(ctx) else {
            return; // gone
        };
        let verdict = match self.start(request, t.now_ns, t.worker) {
            Start::Pass => return t.out.push(Carry::Resume(ctx)),
            Start::Reply(reply) => return t.out.push(Carry::Reply(ctx, reply)),
            Start::Decided(verdict) => verdict,
            Start::Wait(w) => {
                let (_, max_in_flight) = batch::limits(self.config);
                t.worker.queue.enqueue(ctx, w, max_in_flight);
                t.worker.queue.woken();
                return;
            }
        };
        self.delivered(&verdict);
        match verdict {
            Verdict::Admit { headers } => {
                t.worker.streams.admitted(ctx, headers, Vec::new());
                t.out.push(Carry::Resume(ctx));
            }
            Verdict::Reject(reply) => t.out.push(Carry::Reply(ctx, reply)),
        }
    }

    /// Sends a call of `kind` besides the decisions, with `timeout_ms`.
    fn send_side(
        &self,
        t: &mut Turn<'_>,
        kind: Kind,
        body: Vec<u8>,
        timeout_ms: u64,
    ) -> Result<(), LimiterError> {
        let token = self.send_call(t, kind, body)?;
        let pending = Pending {
            token,
            sent_ns: t.now_ns,
            deadline_ns: t
                .now_ns
                .saturating_add(timeout_ms.saturating_mul(1_000_000)),
        };
        t.worker.side.sent(kind, pending);
        Ok(())
    }

    /// The answer to a call besides the decisions, of `kind`, sent as `pending`.
    fn side_answered(&self, t: &mut Turn<'_>, kind: Kind, pending: Pending, reply: Reply) {
        match kind {
            Kind::Epoch => {
                let epoch = crate::epoch::parse(reply.status.as_deref(), &reply.body);
                self.polled(t.worker, epoch, pending.sent_ns);
            }
            // Delivered on a 200, else sent again (bounded); then the next batch.
            Kind::Settle => {
                let d = t.worker.streams.outbox.answered(reply.ok());
                self.count_delivery(d);
                self.send_settlements(t);
            }
            // Applied on a 200 (its counts read), else its releases are sent again (bounded).
            Kind::Slots => {
                let answer = reply
                    .ok()
                    .then(|| serde_json::from_slice::<SlotsResponse>(&reply.body).ok())
                    .flatten();
                let d = t.worker.streams.slots.answered(answer);
                self.count_slots(d);
                self.send_slots(t);
            }
            Kind::Decide => {}
        }
    }

    /// Sends the next batch of settlements, if one is due and none is in flight
    /// ([`crate::costs::Outbox`]).
    fn send_settlements(&self, t: &mut Turn<'_>) {
        if t.worker.side.out(Kind::Settle) {
            return;
        }
        let Some(body) = t.worker.streams.outbox.next_call(&self.config.domain) else {
            return;
        };
        let timeout_ms = self
            .config
            .sidecar
            .timeout_ms
            .max(crate::costs::SEND_TIMEOUT_MS);
        if let Err(e) = self.send_side(t, Kind::Settle, body, timeout_ms) {
            debug!("ratelimit filter: cannot send settlements: {e}");
            let d = t.worker.streams.outbox.answered(false);
            self.count_delivery(d);
        }
    }

    /// Sends the concurrency slots' renewals that are due and the releases waiting (one call in
    /// flight per worker; docs/concurrency.md).
    fn send_slots(&self, t: &mut Turn<'_>) {
        if t.worker.side.out(Kind::Slots) {
            return;
        }
        let Some(body) = t
            .worker
            .streams
            .slots
            .next_call(&self.config.domain, t.now_ns)
        else {
            return;
        };
        let timeout_ms = self.config.sidecar.timeout_ms;
        if let Err(e) = self.send_side(t, Kind::Slots, body, timeout_ms) {
            debug!("ratelimit filter: cannot send slot renewals and releases: {e}");
            let d = t.worker.streams.slots.answered(None);
            self.count_slots(d);
        }
    }
}
impl<'a> Turn<'a> {
    fn new(worker: &'a mut Worker, host: &'a mut dyn Host, now_ns: u64) -> Turn<'a> {
        Turn {
            worker,
            host,
            now_ns,
            out: Vec::new(),
        }
    }
}
