//! Concurrency slots (docs/concurrency.md), without host calls: the slots each admitted stream
//! of this worker holds ([`Slots`]), renewed every third of their ttl while the stream runs,
//! released when it ends (completed, reset or cancelled: the host calls [`Slots::end`] when the
//! stream's context goes away), both sent batched to `POST /v1/slots`, one call in flight per
//! worker. A release whose call failed is sent again, up to [`MAX_ATTEMPTS`] sends, then counted
//! lost: the slot then expires by itself within its ttl. A renewal is not retried on its own: the
//! next period renews again, so a slot is lost to expiry only after three renewals in a row fail.

use std::collections::{HashMap, VecDeque};

use ratelimit_wire::{
    budget, Decision, HeldSlot, SlotRef, SlotsRequest, SlotsResponse, MAX_SLOT_UPDATES,
};

/// The tick that sends renewals and releases: well within a third of the shortest ttl (1000 ms).
pub const TICK_MS: u64 = 100;

/// How many times a release is sent before it is counted lost.
pub const MAX_ATTEMPTS: u32 = 3;

/// The most releases a worker holds unsent; more are lost (counted; they expire by themselves).
pub const MAX_PENDING: usize = 4096;

/// The slots of one stream.
#[derive(Debug, Clone, PartialEq)]
struct Stream {
    slots: Vec<SlotRef>,
    ttl_ms: u64,
    /// When its next renewal is due.
    renew_at_ns: u64,
}

/// A release waiting to be sent, and the sends it has had.
#[derive(Debug, Clone, PartialEq)]
struct Release {
    slot: SlotRef,
    attempts: u32,
}

/// What one call carries: its releases (to send again if it fails), and the streams it renewed
/// (their renewal period follows the ttl the answer names: a reload may have changed it).
#[derive(Debug, Default, PartialEq)]
struct Flight {
    releases: Vec<Release>,
    renewed: Vec<u32>,
    sent_ns: u64,
}

/// What the answer (or failure) of a slots call did, for the stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotDelivery {
    pub renewed: u64,
    pub released: u64,
    /// Renewals or releases of slots the sidecar no longer held (they expired).
    pub expired: u64,
    /// Releases to be sent again.
    pub retried: u64,
    /// Releases given up (after [`MAX_ATTEMPTS`] sends, or with too many waiting).
    pub lost: u64,
}

/// The slots of one worker's streams, and the releases waiting for the sidecar.
#[derive(Debug, Default)]
pub struct Slots {
    streams: HashMap<u32, Stream>,
    releases: VecDeque<Release>,
    in_flight: Option<Flight>,
}

impl Slots {
    /// Stream `ctx` was admitted holding `held` (the answer's `slot`) for the call's `decisions`.
    pub fn hold(&mut self, ctx: u32, held: &HeldSlot, decisions: &[Decision], now_ns: u64) {
        let slots: Vec<SlotRef> = held
            .decisions
            .iter()
            .filter_map(|i| decisions.get(*i as usize))
            .map(|d| SlotRef {
                rule: d.rule.clone(),
                subject: d.subject.clone(),
                slot: held.id.clone(),
            })
            .collect();
        if slots.is_empty() {
            return;
        }
        let ttl_ms = held.ttl_ms.max(3);
        self.streams.insert(
            ctx,
            Stream {
                slots,
                ttl_ms,
                renew_at_ns: now_ns + period_ns(ttl_ms),
            },
        );
    }

    /// Stream `ctx` ended: its slots are released (at the next call). How many releases were
    /// lost to make room (they expire by themselves).
    pub fn end(&mut self, ctx: u32) -> u64 {
        let Some(stream) = self.streams.remove(&ctx) else {
            return 0;
        };
        let mut lost = 0;
        for slot in stream.slots {
            if self.releases.len() >= MAX_PENDING {
                self.releases.pop_front();
                lost += 1;
            }
            self.releases.push_back(Release { slot, attempts: 0 });
        }
        lost
    }

    /// Whether stream `ctx` holds slots.
    pub fn holds(&self, ctx: u32) -> bool {
        self.streams.contains_key(&ctx)
    }

    /// The body of the next call, if anything is due (renewals whose time came, releases) and no
    /// call is in flight; it is in flight until [`Slots::answered`].
    pub fn next_call(&mut self, domain: &str, now_ns: u64) -> Option<Vec<u8>> {
        if self.in_flight.is_some() {
            return None;
        }
        // At most MAX_SLOT_UPDATES slots (renewals up to half of them), within the call's byte
        // budget: half of it for renewals, the rest for releases.
        let mut renew = Vec::new();
        let mut renewed = Vec::new();
        let mut bytes = 0;
        for (ctx, s) in self.streams.iter_mut() {
            let size: usize = s.slots.iter().map(budget::slot_bytes).sum();
            // (The first stream always fits: one request's slots are fewer than its decisions,
            // which fit a call: `Config::validate`.)
            if s.renew_at_ns > now_ns
                || renew.len() + s.slots.len() > MAX_SLOT_UPDATES / 2
                || (!renew.is_empty() && bytes + size > budget::ITEMS_BYTES / 2)
            {
                continue;
            }
            s.renew_at_ns = now_ns + period_ns(s.ttl_ms);
            renew.extend(s.slots.iter().cloned());
            renewed.push(*ctx);
            bytes += size;
        }
        let room = MAX_SLOT_UPDATES - renew.len();
        let n = self
            .releases
            .iter()
            .take(room)
            .take_while(|r| {
                bytes += budget::slot_bytes(&r.slot);
                bytes <= budget::ITEMS_BYTES
            })
            .count();
        let releases: Vec<Release> = self.releases.drain(..n).collect();
        if renew.is_empty() && releases.is_empty() {
            return None;
        }
        let body = SlotsRequest {
            domain: domain.to_string(),
            renew,
            release: releases.iter().map(|r| r.slot.clone()).collect(),
        };
        let body = serde_json::to_vec(&body).ok()?;
        self.in_flight = Some(Flight {
            releases: releases
                .into_iter()
                .map(|r| Release {
                    attempts: r.attempts + 1,
                    ..r
                })
                .collect(),
            renewed,
            sent_ns: now_ns,
        });
        Some(body)
    }

    /// The call in flight was answered: `answer` when the sidecar applied it (200), else its
    /// releases are sent again or, after [`MAX_ATTEMPTS`], lost.
    pub fn answered(&mut self, answer: Option<SlotsResponse>) -> SlotDelivery {
        let Some(flight) = self.in_flight.take() else {
            return SlotDelivery::default();
        };
        if let Some(a) = answer {
            // The slots were renewed for the ttl in force now: the next renewals within a third
            // of it (a reload that lowered `slot_ttl_ms` must not let them expire meanwhile).
            if let Some(ttl_ms) = a.ttl_ms {
                let ttl_ms = ttl_ms.max(3);
                for ctx in &flight.renewed {
                    if let Some(s) = self.streams.get_mut(ctx) {
                        s.ttl_ms = ttl_ms;
                        s.renew_at_ns = flight.sent_ns + period_ns(ttl_ms);
                    }
                }
            }
            return SlotDelivery {
                renewed: a.renewed,
                released: a.released,
                expired: a.unknown,
                ..SlotDelivery::default()
            };
        }
        let mut d = SlotDelivery::default();
        for r in flight.releases.into_iter().rev() {
            if r.attempts >= MAX_ATTEMPTS {
                d.lost += 1;
            } else {
                d.retried += 1;
                self.releases.push_front(r);
            }
        }
        d
    }
}

/// A slot's renewal period: a third of its ttl.
fn period_ns(ttl_ms: u64) -> u64 {
    ttl_ms / 3 * 1_000_000
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratelimit_wire::Subject;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const MS: u64 = 1_000_000;

    fn decision(rule: &str) -> Decision {
        let mut subject = Subject::new();
        subject.push("app", Some("a".into()));
        Decision {
            receipt: false,
            rule: rule.into(),
            subject,
            cost: 1,
            lease: None,
        }
    }

    fn held(id: &str, ttl_ms: u64, decisions: Vec<u32>) -> HeldSlot {
        HeldSlot {
            id: id.into(),
            ttl_ms,
            decisions,
        }
    }

    fn call(slots: &mut Slots, now_ns: u64) -> Option<SlotsRequest> {
        let body = slots.next_call("ratelimit", now_ns)?;
        Some(serde_json::from_slice(&body).unwrap())
    }

    fn ids(refs: &[SlotRef]) -> Vec<(&str, &str)> {
        refs.iter()
            .map(|r| (r.rule.as_str(), r.slot.as_str()))
            .collect()
    }

    #[test]
    fn a_stream_renews_every_third_of_its_ttl_and_releases_at_its_end() {
        let mut s = Slots::default();
        let decisions = [decision("rate-only"), decision("inflight")];
        s.hold(7, &held("s7", 3_000, vec![1]), &decisions, 0);
        assert!(s.holds(7));
        assert_eq!(call(&mut s, 999 * MS), None, "nothing due before ttl / 3");
        let c = call(&mut s, 1_000 * MS).unwrap();
        assert_eq!(ids(&c.renew), [("inflight", "s7")]);
        assert!(c.release.is_empty());
        assert_eq!(call(&mut s, 1_500 * MS), None, "one call in flight");
        let d = s.answered(Some(SlotsResponse {
            renewed: 1,
            released: 0,
            unknown: 0,
            ttl_ms: Some(3_000),
        }));
        assert_eq!(d.renewed, 1);
        assert_eq!(
            call(&mut s, 1_500 * MS),
            None,
            "the next renewal is at 2000 ms"
        );
        assert_eq!(s.end(7), 0);
        assert!(!s.holds(7));
        let c = call(&mut s, 1_600 * MS).unwrap();
        assert_eq!(ids(&c.release), [("inflight", "s7")]);
        assert!(c.renew.is_empty(), "an ended stream renews nothing");
        s.answered(Some(SlotsResponse {
            renewed: 0,
            released: 1,
            unknown: 0,
            ttl_ms: None,
        }));
        assert_eq!(call(&mut s, 10_000 * MS), None, "nothing left");
    }

    #[test]
    fn a_renewal_answered_with_a_shorter_ttl_renews_within_a_third_of_it() {
        let mut s = Slots::default();
        s.hold(4, &held("s4", 9_000, vec![0]), &[decision("r")], 0);
        assert!(call(&mut s, 2_999 * MS).is_none());
        assert!(call(&mut s, 3_000 * MS).is_some());
        // A reload lowered slot_ttl_ms to 1000: the sidecar renewed for 1 s and says so.
        s.answered(Some(SlotsResponse {
            renewed: 1,
            released: 0,
            unknown: 0,
            ttl_ms: Some(1_000),
        }));
        assert!(call(&mut s, 3_332 * MS).is_none());
        let c = call(&mut s, 3_333 * MS).expect("renewed within a third of the new ttl");
        assert_eq!(ids(&c.renew), [("r", "s4")]);
        // Raised again: the period follows.
        s.answered(Some(SlotsResponse {
            renewed: 1,
            released: 0,
            unknown: 0,
            ttl_ms: Some(30_000),
        }));
        assert!(call(&mut s, 13_332 * MS).is_none());
        assert!(call(&mut s, 13_333 * MS).is_some());
    }

    #[test]
    fn every_call_fits_the_sidecars_body_limit_with_the_longest_subjects() {
        // Issue 32, case 3: 1,000 streams' slots of 1,024-byte subjects, renewed and released.
        let mut s = Slots::default();
        let long = |i: u32| {
            let mut subject = Subject::new();
            subject.push("user", Some(format!("{i:04}{}", "\\".repeat(1020))));
            Decision {
                rule: "r".into(),
                subject,
                cost: 1,
                lease: None,
                receipt: false,
            }
        };
        for ctx in 0..1_000 {
            let id = format!("{ctx:064}");
            s.hold(ctx, &held(&id, 3_000, vec![0]), &[long(ctx)], 0);
        }
        for ctx in 0..500 {
            s.end(ctx);
        }
        let (mut renewed, mut released) = (0, 0);
        while let Some(body) = s.next_call(&"d".repeat(128), 1_000 * MS) {
            assert!(body.len() <= budget::MAX_BODY_BYTES, "{} bytes", body.len());
            let c: SlotsRequest = serde_json::from_slice(&body).unwrap();
            (renewed, released) = (renewed + c.renew.len(), released + c.release.len());
            s.answered(Some(SlotsResponse::default()));
        }
        assert_eq!((renewed, released), (500, 500));
    }

    #[test]
    fn a_release_is_sent_three_times_then_counted_lost() {
        let mut s = Slots::default();
        s.hold(1, &held("a", 1_000, vec![0]), &[decision("r")], 0);
        s.end(1);
        for attempt in 1..=MAX_ATTEMPTS {
            let c = call(&mut s, 0).unwrap();
            assert_eq!(ids(&c.release), [("r", "a")], "send {attempt}");
            let d = s.answered(None);
            if attempt < MAX_ATTEMPTS {
                assert_eq!((d.retried, d.lost), (1, 0));
            } else {
                assert_eq!((d.retried, d.lost), (0, 1));
            }
        }
        assert_eq!(call(&mut s, 0), None);
    }

    #[test]
    fn a_failed_renewal_waits_for_the_next_period_and_a_stream_without_slots_holds_none() {
        let mut s = Slots::default();
        s.hold(1, &held("a", 1_500, vec![0]), &[decision("r")], 0);
        assert!(call(&mut s, 500 * MS).is_some());
        assert_eq!(s.answered(None), SlotDelivery::default());
        assert_eq!(call(&mut s, 999 * MS), None);
        assert!(call(&mut s, 1_000 * MS).is_some());
        s.hold(2, &held("b", 1_500, vec![5]), &[decision("r")], 0);
        assert!(!s.holds(2), "no decision of the request holds a slot");
    }
}
