//! A worker's events (its requests, its root's wake-ups, ticks and stream messages) through a
//! host in memory: the calls it sends on its stream, and the verdicts it hands the host.

use std::collections::{BTreeSet, HashMap};

use ratelimit_wire::stream::{Answer, Call, Kind};
use ratelimit_wire::DecideResponse;

use super::*;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// The host of these tests: a stream that opens as `token` 1, 2, ... (unless `refuse_open`),
/// the calls sent on it, and the paused requests it can switch to (a request in `gone` went away).
#[derive(Default)]
struct FakeHost {
    opened: u32,
    refuse_open: bool,
    refuse_send: bool,
    sent: Vec<(u32, Call)>,
    requests: HashMap<u32, FakeRequest>,
    gone: BTreeSet<u32>,
}

impl Host for FakeHost {
    fn open_stream(&mut self) -> Result<u32, LimiterError> {
        if self.refuse_open {
            return Err(LimiterError::Dispatch("refused".into()));
        }
        self.opened += 1;
        Ok(self.opened)
    }

    fn send(&mut self, token: u32, call: &Call) -> Result<(), LimiterError> {
        if self.refuse_send {
            return Err(LimiterError::Dispatch("broken".into()));
        }
        self.sent.push((token, call.clone()));
        Ok(())
    }

    fn request(&mut self, ctx: u32) -> Option<&dyn RequestView> {
        if self.gone.contains(&ctx) {
            return None;
        }
        Some(self.requests.entry(ctx).or_insert_with(alpha))
    }
}

impl FakeHost {
    /// The calls of `kind` sent so far, with their stream's token.
    fn calls(&self, kind: Kind) -> Vec<(u32, &Call)> {
        self.sent
            .iter()
            .filter(|(_, c)| c.kind == kind as i32)
            .map(|(t, c)| (*t, c))
            .collect()
    }

    /// The last call of decisions: its id and how many requests it carries.
    fn last_decide(&self) -> (u32, usize) {
        let (_, call) = *self
            .calls(Kind::Decide)
            .last()
            .expect("a call of decisions");
        let body: DecideRequest = serde_json::from_slice(&call.body).unwrap();
        (call.id, body.requests.len())
    }
}

/// The sidecar's answer to call `id`: every one of its `n` requests admitted.
fn admit_all(id: u32, n: usize) -> Answer {
    let answers = (0..n).map(|_| answer(vec![admitted(0)]).unwrap()).collect();
    let body = DecideResponse {
        answers,
        epoch: None,
    };
    Answer {
        id,
        status: 200,
        body: serde_json::to_vec(&body).unwrap(),
    }
}

/// Requests `ctxs` begin at `now`, in their own contexts: each waits for the sidecar.
fn begin_all(g: &mut Gateway, ctxs: &[u32], now: u64) -> Vec<bool> {
    ctxs.iter()
        .map(|&ctx| {
            let flow = Flow {
                config: &g.config,
                reads: &g.reads,
                store: &g.store,
                stats: &g.counts,
            };
            match flow.begin(&mut g.worker, &alpha(), ctx, None, now) {
                Begun::Wait { wake } => wake,
                other => panic!("request {ctx} did not wait: {other:?}"),
            }
        })
        .collect()
}

/// Runs a root event of `g`'s worker through `host`.
fn root(
    g: &mut Gateway,
    host: &mut FakeHost,
    event: impl FnOnce(&Flow<'_>, &mut Worker, &mut FakeHost) -> Vec<Carry>,
) -> Vec<Carry> {
    let flow = Flow {
        config: &g.config,
        reads: &g.reads,
        store: &g.store,
        stats: &g.counts,
    };
    event(&flow, &mut g.worker, host)
}

fn no_leases(v: &mut Value) {
    v["fast_paths"] = json!({"leases": {"enabled": false}, "policy_poll_ms": 0});
}

fn denied(carry: &Carry) -> Option<u32> {
    match carry {
        Carry::Reply(_, reply) => Some(reply.status),
        Carry::Resume(_) => None,
    }
}

#[test]
fn a_wake_up_opens_the_stream_and_sends_what_queued_and_the_answer_resumes_each_request() {
    let mut g = Gateway::new(config(no_leases));
    let mut host = FakeHost::default();
    assert_eq!(begin_all(&mut g, &[1, 2], T0), [true, false], "one wake-up");
    let out = root(&mut g, &mut host, |f, w, h| f.woken(w, h, T0));
    assert!(out.is_empty());
    assert_eq!(host.opened, 1);
    let (id, carried) = host.last_decide();
    assert_eq!(carried, 2, "one call for both");
    // Meanwhile two more queue behind the call in flight (one at a time by default).
    assert_eq!(begin_all(&mut g, &[3, 4], T0), [false, false]);
    let out = root(&mut g, &mut host, |f, w, h| {
        f.stream_message(w, h, 1, Some(admit_all(id, 2)), T0 + MS)
    });
    assert_eq!(out, [Carry::Resume(1), Carry::Resume(2)]);
    // The answer sent the next batch on the same stream.
    assert_eq!(host.opened, 1);
    let (next, carried) = host.last_decide();
    assert_eq!((next > id, carried), (true, 2));
    assert_eq!(g.count(Stat::Callouts), 2);
    assert_eq!(g.count(Stat::Admitted), 2);
}

#[test]
fn a_closed_stream_fails_its_calls_by_their_policy_at_once_and_the_next_batch_reopens_it() {
    let mut g = Gateway::new(config(no_leases));
    let mut host = FakeHost::default();
    begin_all(&mut g, &[1, 2], T0);
    root(&mut g, &mut host, |f, w, h| f.woken(w, h, T0));
    let (id, _) = host.last_decide();
    let out = root(&mut g, &mut host, |f, w, h| {
        f.stream_closed(w, h, 1, Some(14), T0 + MS)
    });
    let statuses: Vec<_> = out.iter().map(denied).collect();
    assert_eq!(statuses, [Some(503), Some(503)], "on_error: deny");
    // A late answer on the stream that closed reaches nothing.
    let late = root(&mut g, &mut host, |f, w, h| {
        f.stream_message(w, h, 1, Some(admit_all(id, 2)), T0 + 2 * MS)
    });
    assert!(late.is_empty());
    // The first break reopens at once.
    begin_all(&mut g, &[3], T0 + 3 * MS);
    root(&mut g, &mut host, |f, w, h| f.woken(w, h, T0 + 3 * MS));
    assert_eq!(host.opened, 2);
    assert_eq!(host.sent.last().unwrap().0, 2, "on the new stream");
}

#[test]
fn a_call_unanswered_by_its_deadline_is_given_up_at_the_tick_and_its_late_answer_finds_nothing() {
    let mut g = Gateway::new(config(no_leases));
    let mut host = FakeHost::default();
    begin_all(&mut g, &[1], T0);
    root(&mut g, &mut host, |f, w, h| f.woken(w, h, T0));
    let (id, _) = host.last_decide();
    let before = root(&mut g, &mut host, |f, w, h| f.tick(w, h, T0 + 50 * MS - 1));
    assert!(before.is_empty());
    let at = root(&mut g, &mut host, |f, w, h| f.tick(w, h, T0 + 50 * MS));
    assert_eq!(at.iter().map(denied).collect::<Vec<_>>(), [Some(503)]);
    let late = root(&mut g, &mut host, |f, w, h| {
        f.stream_message(w, h, 1, Some(admit_all(id, 1)), T0 + 60 * MS)
    });
    assert!(late.is_empty(), "answered once");
    assert_eq!(g.count(Stat::Admitted), 0);
}

#[test]
fn a_stream_that_cannot_be_opened_or_written_fails_the_batch_by_its_policy() {
    let mut g = Gateway::new(config(no_leases));
    let mut host = FakeHost {
        refuse_open: true,
        ..FakeHost::default()
    };
    begin_all(&mut g, &[1], T0);
    let out = root(&mut g, &mut host, |f, w, h| f.woken(w, h, T0));
    assert_eq!(out.iter().map(denied).collect::<Vec<_>>(), [Some(503)]);
    // Opened, but the write fails: the stream counts as closed, the batch fails.
    host.refuse_open = false;
    host.refuse_send = true;
    begin_all(&mut g, &[2], T0 + 100 * MS);
    let out = root(&mut g, &mut host, |f, w, h| f.woken(w, h, T0 + 100 * MS));
    assert_eq!(out.iter().map(denied).collect::<Vec<_>>(), [Some(503)]);
    // Two breaks in a row: the stream waits out its backoff, and a batch meanwhile fails at once
    // without trying.
    host.refuse_send = false;
    begin_all(&mut g, &[3], T0 + 100 * MS);
    let out = root(&mut g, &mut host, |f, w, h| f.woken(w, h, T0 + 100 * MS));
    assert_eq!(out.iter().map(denied).collect::<Vec<_>>(), [Some(503)]);
    assert_eq!((host.opened, host.sent.len()), (1, 0));
    begin_all(&mut g, &[4], T0 + 200 * MS);
    let out = root(&mut g, &mut host, |f, w, h| f.woken(w, h, T0 + 200 * MS));
    assert!(out.is_empty(), "sent after the backoff");
    assert_eq!(host.sent.len(), 1);
}

#[test]
fn a_request_gone_before_its_answer_gets_no_verdict_and_the_others_do() {
    let mut g = Gateway::new(config(no_leases));
    let mut host = FakeHost::default();
    begin_all(&mut g, &[1, 2], T0);
    root(&mut g, &mut host, |f, w, h| f.woken(w, h, T0));
    let (id, _) = host.last_decide();
    host.gone.insert(1);
    let out = root(&mut g, &mut host, |f, w, h| {
        f.stream_message(w, h, 1, Some(admit_all(id, 2)), T0 + MS)
    });
    assert_eq!(out, [Carry::Resume(2)]);
}

#[test]
fn without_coalescing_every_request_is_a_call_sent_at_once() {
    let mut g = Gateway::new(config(|v| {
        v["fast_paths"] = json!({"coalesce": false, "leases": {"enabled": false},
                                 "policy_poll_ms": 0});
    }));
    let mut host = FakeHost::default();
    assert_eq!(begin_all(&mut g, &[1], T0), [true]);
    root(&mut g, &mut host, |f, w, h| f.woken(w, h, T0));
    assert_eq!(begin_all(&mut g, &[2, 3], T0), [true, false]);
    root(&mut g, &mut host, |f, w, h| f.woken(w, h, T0));
    let sizes: Vec<usize> = host
        .calls(Kind::Decide)
        .iter()
        .map(|(_, c)| {
            serde_json::from_slice::<DecideRequest>(&c.body)
                .unwrap()
                .requests
                .len()
        })
        .collect();
    assert_eq!(sizes, [1, 1, 1], "a call each, none held behind another");
}

#[test]
fn the_epoch_poll_rides_the_stream_and_its_answer_is_read() {
    let mut g = Gateway::new(config(|v| {
        v["fast_paths"] = json!({"leases": {"enabled": false}, "policy_poll_ms": 50});
    }));
    let mut host = FakeHost::default();
    root(&mut g, &mut host, |f, w, h| f.tick(w, h, T0));
    let polls = host.calls(Kind::Epoch);
    assert_eq!(polls.len(), 1, "the poll is due at the first tick");
    let id = polls[0].1.id;
    let answer = Answer {
        id,
        status: 200,
        body: br#"{"epoch": 7}"#.to_vec(),
    };
    root(&mut g, &mut host, |f, w, h| {
        f.stream_message(w, h, 1, Some(answer), T0 + MS)
    });
    assert_eq!(g.worker.epoch(), 7);
}

#[test]
fn a_request_whose_body_does_not_come_by_its_deadline_is_decided_on_the_fallback_at_the_tick() {
    let mut g = Gateway::new(config(|v| {
        no_leases(v);
        v["rules"][0]["cost"] = json!({"reserve_from_request_json": "max_tokens",
            "reserve": 4096, "response_json": "usage.total_tokens"});
    }));
    let mut host = FakeHost::default();
    g.worker.streams.await_body(1, T0 + 50 * MS);
    root(&mut g, &mut host, |f, w, h| f.tick(w, h, T0 + 50 * MS - 1));
    assert!(
        host.calls(Kind::Decide).is_empty(),
        "still waits for its body"
    );
    root(&mut g, &mut host, |f, w, h| f.tick(w, h, T0 + 50 * MS));
    let (_, call) = host.calls(Kind::Decide)[0];
    let body: DecideRequest = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(
        body.requests[0].decisions[0].cost, 4096,
        "the fallback reservation"
    );
    assert!(!g.worker.streams.awaits_body(1));
}

#[test]
fn a_request_reserving_from_its_json_waits_for_its_whole_body_and_begins_with_it() {
    let mut g = Gateway::new(config(|v| {
        no_leases(v);
        v["rules"][0]["cost"] = json!({"reserve_from_request_json": "max_tokens",
            "reserve": 4096, "response_json": "usage.total_tokens"});
    }));
    let flow = Flow {
        config: &g.config,
        reads: &g.reads,
        store: &g.store,
        stats: &g.counts,
    };
    let headers = flow.request_headers(&mut g.worker, &alpha(), 1, false, T0);
    // Its cost is read from the response's JSON body: asked for uncompressed.
    assert_eq!((headers.identity, headers.begun), (true, None));
    assert_eq!(flow.request_body(&mut g.worker, 1, false), Body::Pause);
    let whole = flow.request_body(&mut g.worker, 1, true);
    assert_eq!(
        whole,
        Body::Begin {
            max_bytes: crate::costs::MAX_METERED_BYTES
        }
    );
    let begun = flow.begin(
        &mut g.worker,
        &alpha(),
        1,
        Some(br#"{"max_tokens": 7}"#),
        T0,
    );
    assert_eq!(begun, Begun::Wait { wake: true });
    // Paused for the sidecar now: more body is held with it; another request's passes.
    assert_eq!(flow.request_body(&mut g.worker, 1, true), Body::Pause);
    assert_eq!(flow.request_body(&mut g.worker, 2, true), Body::Continue);
    // Without a body (headers only) it begins at once.
    let at_once = flow.request_headers(&mut g.worker, &alpha(), 3, true, T0);
    assert_eq!(at_once.begun, Some(Begun::Wait { wake: false }));
}

#[test]
fn the_emergency_buckets_are_put_in_shared_data_full_once() {
    let g = Gateway::new(config(|v| {
        v["rules"][0]["on_error"] = json!("local");
        v["rules"][0]["emergency"] = json!({"capacity": 5, "refill_per_sec": 1});
    }));
    let key = crate::emergency::shared_key("per-app");
    assert!(g.store.get(&key).0.is_none());
    g.flow().prepare_emergency(T0);
    let first = g.store.get(&key).0.expect("put there");
    // Spent meanwhile by another worker: a second configuration leaves it as it is.
    g.store.set(&key, b"spent", None).unwrap();
    g.flow().prepare_emergency(T0 + S);
    assert_ne!(g.store.get(&key).0.unwrap(), first);
}
