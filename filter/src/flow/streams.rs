//! What one worker keeps of its streams between the host's callbacks: a request waiting for its
//! body, the headers to add to an admitted request's response, the meters of its response, the
//! concurrency slots it holds, and the settlements and releases waiting for the sidecar. The host
//! reads what Envoy gives it (headers, body chunks, the stream's end), hands it here, and sends
//! what these say is due; every decision about a stream's state is made here, under native tests.

use std::collections::HashMap;

use super::{Flow, Metered};
use crate::costs::{self, Outbox};
use crate::slots::{SlotDelivery, Slots};

/// One worker's streams.
#[derive(Debug)]
pub struct Streams {
    /// Requests decided once their body is in (a reservation from its JSON): the deadline after
    /// which they are decided without it.
    awaiting_body: HashMap<u32, u64>,
    /// Headers to add to the upstream's response.
    response_headers: HashMap<u32, Vec<(String, String)>>,
    /// The admitted requests whose responses report their real cost.
    metering: HashMap<u32, Vec<Metered>>,
    /// What the meters keep of response bodies.
    meter_budget: costs::Budget,
    /// The concurrency slots held, and the releases waiting for the sidecar.
    pub slots: Slots,
    /// The settlements waiting for the sidecar.
    pub outbox: Outbox,
}

impl Streams {
    /// A worker's streams; its settlement batches are named from `nonce`.
    pub fn new(nonce: u64) -> Streams {
        Streams {
            awaiting_body: HashMap::new(),
            response_headers: HashMap::new(),
            metering: HashMap::new(),
            meter_budget: costs::Budget::default(),
            slots: Slots::default(),
            outbox: Outbox::new(nonce),
        }
    }

    /// Request `ctx` waits for its body until `deadline_ns`.
    pub fn await_body(&mut self, ctx: u32, deadline_ns: u64) {
        self.awaiting_body.insert(ctx, deadline_ns);
    }

    /// Whether request `ctx` waits for its body.
    pub fn awaits_body(&self, ctx: u32) -> bool {
        self.awaiting_body.contains_key(&ctx)
    }

    /// Request `ctx`'s body came whole: it is decided with it.
    pub fn body_came(&mut self, ctx: u32) {
        self.awaiting_body.remove(&ctx);
    }

    /// The requests whose body did not come by `now_ns`: they no longer wait, and are decided
    /// without it (on the fallback reservation).
    pub fn late_bodies(&mut self, now_ns: u64) -> Vec<u32> {
        let mut late: Vec<u32> = self
            .awaiting_body
            .iter()
            .filter(|(_, deadline)| **deadline <= now_ns)
            .map(|(ctx, _)| *ctx)
            .collect();
        late.sort_unstable();
        for ctx in &late {
            self.awaiting_body.remove(ctx);
        }
        late
    }

    /// Request `ctx` was admitted: `headers` go on its response, `metered` read it.
    pub fn admitted(&mut self, ctx: u32, headers: Vec<(String, String)>, metered: Vec<Metered>) {
        if !headers.is_empty() {
            self.response_headers.insert(ctx, headers);
        }
        if !metered.is_empty() {
            self.metering.insert(ctx, metered);
        }
    }

    /// Request `ctx`'s response headers came: the headers to add to them (once). Each meter
    /// reads its cost header and the content type through `read`; the meters done with (a
    /// header's figure, no body to read, or the end of the stream) settle now.
    pub fn response_headers(
        &mut self,
        flow: &Flow<'_>,
        ctx: u32,
        end_of_stream: bool,
        read: &dyn Fn(&str) -> Option<Vec<u8>>,
    ) -> Vec<(String, String)> {
        if let Some(metered) = self.metering.remove(&ctx) {
            let (content_type, encoding) = (read("content-type"), read("content-encoding"));
            let mut open = Vec::new();
            let mut done = Vec::new();
            for mut m in metered {
                let header = m.meter.header_name().and_then(read);
                m.meter.headers(
                    header.as_deref(),
                    content_type.as_deref(),
                    encoding.as_deref(),
                );
                if m.meter.reads_body() && !end_of_stream {
                    open.push(m);
                } else {
                    done.push(m);
                }
            }
            self.settle(flow, done, true);
            if !open.is_empty() {
                self.metering.insert(ctx, open);
            }
        }
        self.response_headers.remove(&ctx).unwrap_or_default()
    }

    /// Whether request `ctx`'s response body is read (its meters want it).
    pub fn reads_response_body(&self, ctx: u32) -> bool {
        self.metering.contains_key(&ctx)
    }

    /// A chunk of request `ctx`'s response body passed (the body is never held back): the
    /// meters read it; at the end of the stream they settle.
    pub fn response_body(&mut self, flow: &Flow<'_>, ctx: u32, chunk: &[u8], end_of_stream: bool) {
        let Some(mut metered) = self.metering.remove(&ctx) else {
            return;
        };
        if !chunk.is_empty() {
            for m in &mut metered {
                m.meter.body(chunk, &mut self.meter_budget);
            }
        }
        if end_of_stream {
            self.settle(flow, metered, true);
        } else {
            self.metering.insert(ctx, metered);
        }
    }

    /// Request `ctx` holds no slot any more (it did not pass after all, or it is gone): they are
    /// released at the next call.
    pub fn release_slots(&mut self, flow: &Flow<'_>, ctx: u32) {
        let lost = self.slots.end(ctx);
        flow.count_slots(SlotDelivery {
            lost,
            ..SlotDelivery::default()
        });
    }

    /// Request `ctx`'s stream ended (completed, reset or cancelled): nothing more is added to
    /// its response, its slots go back, and a response cut short settles its meters as they
    /// stand (reservations stand unless a header reported the cost).
    pub fn ended(&mut self, flow: &Flow<'_>, ctx: u32) {
        self.response_headers.remove(&ctx);
        self.awaiting_body.remove(&ctx);
        self.release_slots(flow, ctx);
        let metered = self.metering.remove(&ctx).unwrap_or_default();
        self.settle(flow, metered, false);
    }

    /// Queues the settlements of meters whose responses are over (`complete`: their bodies
    /// ended); the root sends them at its next tick.
    fn settle(&mut self, flow: &Flow<'_>, metered: Vec<Metered>, complete: bool) {
        for m in metered {
            if let Some(s) = flow.settled(m, complete, &mut self.meter_budget) {
                let lost = self.outbox.push(s);
                flow.count_delivery(costs::Delivery { retried: 0, lost });
            }
        }
    }
}
