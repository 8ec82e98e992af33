//! The sidecar's policy epoch as one Envoy knows it, in one shared-data key ([`KEY`]): the epoch
//! last read from `GET /v1/epoch` and when the next read is due. Every worker reads the key on
//! its tick ([`tick`]); the one that finds the read due wins a compare-and-swap and sends it;
//! its answer is published ([`polled`]). Leases and known rejections learned under another epoch
//! do not answer ([`crate::fastpath`]). The bound this gives after a reload:
//! docs/fast-paths.md#policy-reloads.

use crate::shared::{compare_and_swap, SharedStore, Write};

/// The shared-data key of the published epoch.
pub const KEY: &str = "ratelimit.epoch";

/// The most a poll's period is divided into ticks: a worker sees a published epoch within
/// `policy_poll_ms / TICKS_PER_POLL` (and the poll is sent that soon after it is due).
pub const TICKS_PER_POLL: u64 = 5;

/// The format's version; 1: times from the VM's [`crate::clock`] (monotonic). What a build
/// before wrote (wall-clock times, 24 bytes) is not one: the poll is due at once.
const VERSION: u8 = 1;

/// What [`KEY`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Published {
    /// The sidecar's policy epoch (0: not read yet).
    pub epoch: u64,
    /// The next poll is due then (0: at once).
    pub next_poll_ns: u64,
    /// A poll is in flight until then (0: none).
    pub polling_until_ns: u64,
}

impl Published {
    /// [`VERSION`], then the three fields, little-endian.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(25);
        out.push(VERSION);
        for v in [self.epoch, self.next_poll_ns, self.polling_until_ns] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    fn decode(bytes: &[u8]) -> Option<Published> {
        let (version, fields) = bytes.split_first()?;
        let v = |i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(
                fields.get(i * 8..i * 8 + 8)?.try_into().ok()?,
            ))
        };
        (*version == VERSION && fields.len() == 24).then_some(Published {
            epoch: v(0)?,
            next_poll_ns: v(1)?,
            polling_until_ns: v(2)?,
        })
    }
}

/// What a worker's tick found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tick {
    /// The published epoch.
    pub epoch: u64,
    /// This worker sends the poll now (it won the compare-and-swap).
    pub poll: bool,
}

/// A worker's tick at `now_ns`: the published epoch, and whether this worker sends the poll
/// (it is due and none is in flight; `in_flight_ns`: how long one may be, its timeout). One read
/// unless the poll is due.
pub fn tick(store: &dyn SharedStore, now_ns: u64, in_flight_ns: u64) -> Tick {
    let mut epoch = 0;
    let poll = compare_and_swap(store, KEY, |bytes| {
        let mut p = bytes.and_then(Published::decode).unwrap_or_default();
        epoch = p.epoch;
        if p.next_poll_ns > now_ns || p.polling_until_ns > now_ns {
            return Write::Keep(false);
        }
        p.polling_until_ns = now_ns.saturating_add(in_flight_ns).max(1);
        Write::Store(p.encode(), true)
    })
    .unwrap_or(false);
    Tick { epoch, poll }
}

/// The poll sent at `dispatched_ns` was answered with `epoch` (`None`: no epoch
/// could be read; the one published stays): publishes it, and the next poll is due
/// `period_ns` after this one was sent. Returns the epoch published.
pub fn polled(
    store: &dyn SharedStore,
    epoch: Option<u64>,
    dispatched_ns: u64,
    period_ns: u64,
) -> u64 {
    let mut published = 0;
    let _ = compare_and_swap(store, KEY, |bytes| {
        let mut p = bytes.and_then(Published::decode).unwrap_or_default();
        if let Some(e) = epoch.filter(|e| *e != 0) {
            p.epoch = e;
        }
        published = p.epoch;
        p.polling_until_ns = 0;
        p.next_poll_ns = dispatched_ns.saturating_add(period_ns).max(1);
        Write::Store(p.encode(), ())
    });
    published
}

/// A decision's answer said the sidecar's epoch is `answered`, not the published one: the next
/// poll is due at once (the answer alone is not trusted to be newer: an answer decided before
/// the reload may arrive after the poll that saw it).
pub fn answered(store: &dyn SharedStore, answered: u64) {
    let _ = compare_and_swap(store, KEY, |bytes| {
        let mut p = bytes.and_then(Published::decode).unwrap_or_default();
        if p.epoch == answered || p.next_poll_ns == 0 {
            return Write::Keep(());
        }
        p.next_poll_ns = 0;
        Write::Store(p.encode(), ())
    });
}

/// The epoch in a poll's answer (`status`: its `:status`, absent when it failed), if it is one:
/// anything else (another status, a sidecar without the endpoint, garbage) is none.
pub fn parse(status: Option<&[u8]>, body: &[u8]) -> Option<u64> {
    if status? != b"200" {
        return None;
    }
    serde_json::from_slice::<ratelimit_wire::EpochResponse>(body)
        .ok()
        .map(|r| r.epoch)
        .filter(|e| *e != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::fake::Memory;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const MS: u64 = 1_000_000;

    #[test]
    fn one_worker_polls_when_due_and_every_worker_reads_what_it_published() {
        let m = Memory::default();
        // Nothing published: the first tick polls, the next worker's does not (one in flight).
        assert_eq!(
            tick(&m, 0, 50 * MS),
            Tick {
                epoch: 0,
                poll: true
            }
        );
        assert_eq!(
            tick(&m, MS, 50 * MS),
            Tick {
                epoch: 0,
                poll: false
            }
        );
        assert_eq!(polled(&m, Some(7), 0, 50 * MS), 7);
        assert_eq!(
            tick(&m, 3 * MS, 50 * MS),
            Tick {
                epoch: 7,
                poll: false
            }
        );
        let writes = m.writes.get();
        assert!(!tick(&m, 49 * MS, 50 * MS).poll);
        assert_eq!(
            m.writes.get(),
            writes,
            "a tick before the poll is due writes nothing"
        );
        // Due 50 ms after the last poll was sent.
        assert_eq!(
            tick(&m, 50 * MS, 50 * MS),
            Tick {
                epoch: 7,
                poll: true
            }
        );
        // A failed poll keeps the epoch; the next one is due a period later.
        assert_eq!(polled(&m, None, 50 * MS, 50 * MS), 7);
        assert!(!tick(&m, 99 * MS, 50 * MS).poll);
        assert!(tick(&m, 100 * MS, 50 * MS).poll);
        // A poll never answered (its worker went away) is sent again once its timeout passed.
        assert!(!tick(&m, 149 * MS, 50 * MS).poll);
        assert!(tick(&m, 150 * MS, 50 * MS).poll);
        assert_eq!(polled(&m, Some(9), 150 * MS, 50 * MS), 9);
    }

    #[test]
    fn an_answer_under_another_epoch_makes_the_poll_due_at_once() {
        let m = Memory::default();
        assert!(tick(&m, 0, 50 * MS).poll);
        polled(&m, Some(7), 0, 50 * MS);
        answered(&m, 7);
        assert!(
            !tick(&m, 2 * MS, 50 * MS).poll,
            "the same epoch: nothing due"
        );
        answered(&m, 8);
        assert_eq!(
            tick(&m, 3 * MS, 50 * MS),
            Tick {
                epoch: 7,
                poll: true
            }
        );
        assert_eq!(polled(&m, Some(8), 3 * MS, 50 * MS), 8);
    }

    #[test]
    fn only_a_200_with_an_epoch_is_an_epoch() {
        assert_eq!(parse(Some(b"200"), br#"{"epoch":42}"#), Some(42));
        assert_eq!(parse(Some(b"200"), br#"{"epoch":0}"#), None);
        assert_eq!(parse(Some(b"404"), br#"{"epoch":42}"#), None);
        assert_eq!(parse(None, b""), None);
        assert_eq!(parse(Some(b"200"), b"{"), None);
    }

    #[test]
    fn garbage_under_the_key_is_nothing_published() {
        let m = Memory::default();
        m.put(KEY, b"junk");
        assert_eq!(
            tick(&m, 0, MS),
            Tick {
                epoch: 0,
                poll: true
            }
        );
    }
}
