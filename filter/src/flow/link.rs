//! The worker's stream to the sidecar (docs/fast-paths.md#the-stream-per-worker), without host
//! calls: whether a call can go out on
//! it now, is sent after opening it, or finds it down; the ids of its calls; and the backoff
//! after it breaks. The host opens the stream, sends and reads the messages
//! (`crate::host`); what each call carried is the queue's flight under the call's id
//! ([`super::batch::Queue`]), failed with its requests' `on_error` when the stream closes or its
//! deadline passes.

use ratelimit_wire::stream::{Answer, Call, Kind};

/// The longest wait before the stream is opened again after it broke.
pub const MAX_BACKOFF_MS: u64 = 1_000;
/// The wait after the second break in a row (the first reopens at once), doubled after each.
pub const FIRST_BACKOFF_MS: u64 = 10;

/// The stream of one worker.
#[derive(Debug, Default)]
pub struct Link {
    state: State,
    /// Breaks in a row without an answer in between.
    breaks: u32,
    /// The id of the last call (ids run on across streams, so an answer of a stream that is gone
    /// never matches a call of the next).
    last_id: u32,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not opened yet.
    #[default]
    Closed,
    /// Open (or opening: the host buffers what is sent before it connects), as `token`.
    Open { token: u32 },
    /// Broke; not opened again before `until_ns`.
    Down { until_ns: u64 },
}

/// How a call goes out at a given time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// On the open stream `token`.
    Send { token: u32 },
    /// The stream must be opened first ([`Link::opened`] with its token, or
    /// [`Link::open_failed`]).
    Open,
    /// The stream is down and waits out its backoff: the call's requests get their `on_error`.
    Down,
}

impl Link {
    /// How a call goes out at `now_ns`.
    pub fn route(&self, now_ns: u64) -> Route {
        match self.state {
            State::Open { token } => Route::Send { token },
            State::Closed => Route::Open,
            State::Down { until_ns } if now_ns >= until_ns => Route::Open,
            State::Down { .. } => Route::Down,
        }
    }

    /// The host opened the stream as `token`.
    pub fn opened(&mut self, token: u32) {
        self.state = State::Open { token };
    }

    /// The host could not open the stream at `now_ns`: a break.
    pub fn open_failed(&mut self, now_ns: u64) {
        self.broke(now_ns);
    }

    /// The stream `token` closed at `now_ns` (the sidecar ended it, or the connection broke):
    /// true when it was this worker's stream, whose calls in flight are then all failed.
    pub fn closed(&mut self, token: u32, now_ns: u64) -> bool {
        if self.state != (State::Open { token }) {
            return false;
        }
        self.broke(now_ns);
        true
    }

    /// Breaks in a row without an answer in between (the host warns at 1, 2, 4, 8, ...: a stream
    /// that never opens, as to a cluster without HTTP/2, is logged without flooding the log).
    pub fn breaks(&self) -> u32 {
        self.breaks
    }

    /// Whether `token` is this worker's open stream: an answer on it also ends the backoff.
    pub fn answered_on(&mut self, token: u32) -> bool {
        let ours = self.state == State::Open { token };
        if ours {
            self.breaks = 0;
        }
        ours
    }

    /// The next call of `kind` carrying `body`: its id is new among this worker's calls.
    pub fn call(&mut self, kind: Kind, body: Vec<u8>) -> Call {
        self.last_id = self.last_id.wrapping_add(1);
        Call {
            id: self.last_id,
            kind: kind as i32,
            body,
        }
    }

    fn broke(&mut self, now_ns: u64) {
        self.breaks = self.breaks.saturating_add(1);
        let wait_ms = match self.breaks {
            0 | 1 => 0,
            n => FIRST_BACKOFF_MS
                .saturating_mul(1u64 << (n - 2).min(16))
                .min(MAX_BACKOFF_MS),
        };
        self.state = State::Down {
            until_ns: now_ns.saturating_add(wait_ms.saturating_mul(1_000_000)),
        };
    }
}

/// An answer read from the stream, as the HTTP answer's `:status` and body it stands for.
pub fn status_text(answer: &Answer) -> Vec<u8> {
    answer.status.to_string().into_bytes()
}

/// A call out besides the decisions: settlements, slot renewals and releases, or the epoch
/// poll (at most one of each kind per worker).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pending {
    /// The call's id on the stream.
    pub token: u32,
    pub sent_ns: u64,
    /// Past it, the call is given up.
    pub deadline_ns: u64,
}

/// The worker's calls out besides the decisions, by kind.
#[derive(Debug, Default)]
pub struct SideCalls {
    settle: Option<Pending>,
    slots: Option<Pending>,
    epoch: Option<Pending>,
}

impl SideCalls {
    fn slot(&mut self, kind: Kind) -> Option<&mut Option<Pending>> {
        match kind {
            Kind::Settle => Some(&mut self.settle),
            Kind::Slots => Some(&mut self.slots),
            Kind::Epoch => Some(&mut self.epoch),
            Kind::Decide => None,
        }
    }

    /// Whether a call of `kind` is out.
    pub fn out(&self, kind: Kind) -> bool {
        match kind {
            Kind::Settle => self.settle.is_some(),
            Kind::Slots => self.slots.is_some(),
            Kind::Epoch => self.epoch.is_some(),
            Kind::Decide => false,
        }
    }

    /// A call of `kind` went out.
    pub fn sent(&mut self, kind: Kind, pending: Pending) {
        if let Some(slot) = self.slot(kind) {
            *slot = Some(pending);
        }
    }

    /// The call answered as `token` (its id on the stream), no longer out: its kind and what
    /// was kept of it; none when it is not one of these.
    pub fn take(&mut self, token: u32) -> Option<(Kind, Pending)> {
        self.take_where(|p| p.token == token).pop()
    }

    /// The calls whose deadline passed at `now_ns`, no longer out.
    pub fn overdue(&mut self, now_ns: u64) -> Vec<(Kind, Pending)> {
        self.take_where(|p| p.deadline_ns <= now_ns)
    }

    /// Every call out, no longer out (the stream closed).
    pub fn all(&mut self) -> Vec<(Kind, Pending)> {
        self.take_where(|_| true)
    }

    fn take_where(&mut self, pick: impl Fn(&Pending) -> bool) -> Vec<(Kind, Pending)> {
        let mut taken = Vec::new();
        for kind in [Kind::Settle, Kind::Slots, Kind::Epoch] {
            if let Some(slot) = self.slot(kind) {
                if slot.as_ref().is_some_and(&pick) {
                    taken.extend(slot.take().map(|p| (kind, p)));
                }
            }
        }
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn the_first_call_opens_the_stream_and_the_next_ones_ride_it() {
        let mut link = Link::default();
        assert_eq!(link.route(0), Route::Open);
        link.opened(7);
        assert_eq!(link.route(1), Route::Send { token: 7 });
        let (a, b) = (
            link.call(Kind::Decide, vec![]),
            link.call(Kind::Decide, vec![]),
        );
        assert_ne!(a.id, b.id);
    }

    #[test]
    fn a_break_reopens_at_once_then_backs_off_doubling_up_to_a_second() {
        let mut link = Link::default();
        link.opened(1);
        assert!(link.closed(1, 100 * MS));
        // The first break: reopened at the next call.
        assert_eq!(link.route(100 * MS), Route::Open);
        link.opened(2);
        assert!(link.closed(2, 100 * MS));
        assert_eq!(link.route(100 * MS), Route::Down);
        assert_eq!(link.route(110 * MS - 1), Route::Down);
        assert_eq!(link.route(110 * MS), Route::Open);
        link.open_failed(110 * MS);
        assert_eq!(link.route(130 * MS - 1), Route::Down);
        assert_eq!(link.route(130 * MS), Route::Open);
        for _ in 0..20 {
            link.open_failed(0);
        }
        assert_eq!(link.route(MAX_BACKOFF_MS * MS - 1), Route::Down);
        assert_eq!(link.route(MAX_BACKOFF_MS * MS), Route::Open);
    }

    #[test]
    fn an_answer_ends_the_backoff() {
        let mut link = Link::default();
        link.opened(1);
        link.closed(1, 0);
        link.opened(2);
        assert!(link.answered_on(2));
        link.closed(2, 0);
        assert_eq!(link.route(0), Route::Open);
    }

    #[test]
    fn a_stream_that_is_not_this_workers_any_more_changes_nothing() {
        let mut link = Link::default();
        link.opened(1);
        link.closed(1, 0);
        link.opened(2);
        assert!(!link.closed(1, 0));
        assert!(!link.answered_on(1));
        assert_eq!(link.route(0), Route::Send { token: 2 });
    }

    fn pending(token: u32, deadline_ns: u64) -> Pending {
        Pending {
            token,
            sent_ns: 0,
            deadline_ns,
        }
    }

    #[test]
    fn a_side_call_is_found_by_its_id_once() {
        let mut side = SideCalls::default();
        side.sent(Kind::Settle, pending(5, 10));
        side.sent(Kind::Epoch, pending(6, 10));
        assert!(side.out(Kind::Settle) && side.out(Kind::Epoch) && !side.out(Kind::Slots));
        assert_eq!(side.take(6).map(|(k, _)| k), Some(Kind::Epoch));
        assert_eq!(side.take(6), None);
        assert_eq!(side.take(7), None);
        assert_eq!(side.take(5).map(|(k, _)| k), Some(Kind::Settle));
        assert!(!side.out(Kind::Settle));
    }

    #[test]
    fn side_calls_end_at_their_deadline_or_with_the_stream() {
        let mut side = SideCalls::default();
        side.sent(Kind::Settle, pending(1, 10));
        side.sent(Kind::Slots, pending(2, 20));
        assert!(side.overdue(9).is_empty());
        assert_eq!(side.overdue(10), [(Kind::Settle, pending(1, 10))]);
        assert!(side.out(Kind::Slots));
        assert_eq!(side.all(), [(Kind::Slots, pending(2, 20))]);
        assert!(!side.out(Kind::Slots));
    }

    #[test]
    fn ids_run_on_across_streams_and_wrap() {
        let mut link = Link {
            last_id: u32::MAX - 1,
            ..Link::default()
        };
        assert_eq!(link.call(Kind::Decide, vec![]).id, u32::MAX);
        link.opened(3);
        link.closed(3, 0);
        assert_eq!(link.call(Kind::Decide, vec![]).id, 0);
    }
}
