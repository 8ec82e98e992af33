//! The one clock every deadline and duration the filter keeps is read from: lease and
//! known-rejection expiries, request deadlines, the emergency bucket's refill and the policy
//! epoch's poll. Envoy's monotonic clock when the host offers it (WASI `clock_time_get`, clock
//! id 1, which Envoy serves from its steady clock), so a step of the host's wall clock changes no
//! deadline; the wall clock only on a host without it, chosen once per VM and never mixed. No
//! reading ever goes back: a VM's time is the largest it has read. Why a step mattered:
//! docs/fast-paths.md#the-clock.

use std::cell::Cell;

/// Where the host's time comes from.
pub trait Source {
    /// The monotonic clock in nanoseconds (an arbitrary origin, the same for every worker of one
    /// Envoy), if the host offers it.
    fn monotonic_ns(&self) -> Option<u64>;
    /// The wall clock in Unix nanoseconds.
    fn wall_ns(&self) -> Option<u64>;
}

/// Which of the two a VM's clock reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Monotonic,
    Wall,
}

/// One VM's clock.
#[derive(Debug, Default)]
pub struct Clock {
    kind: Cell<Option<Kind>>,
    last_ns: Cell<u64>,
}

impl Clock {
    /// The time now, in nanoseconds: never less than a reading before it (a failed read is the
    /// last time read).
    pub fn now_ns(&self, source: &dyn Source) -> u64 {
        let read = match self.kind(source) {
            Kind::Monotonic => source.monotonic_ns(),
            Kind::Wall => source.wall_ns(),
        };
        let now = read.unwrap_or(0).max(self.last_ns.get());
        self.last_ns.set(now);
        now
    }

    /// The clock this VM reads: chosen at the first reading, monotonic if the host answers it.
    pub fn kind(&self, source: &dyn Source) -> Kind {
        if let Some(k) = self.kind.get() {
            return k;
        }
        let k = if source.monotonic_ns().is_some() {
            Kind::Monotonic
        } else {
            Kind::Wall
        };
        self.kind.set(Some(k));
        k
    }
}

/// A host's two clocks driven by hand, for tests: each can be set, stepped or taken away.
#[cfg(test)]
pub mod fake {
    use std::cell::Cell;

    #[derive(Debug, Default)]
    pub struct Host {
        pub monotonic: Cell<Option<u64>>,
        pub wall: Cell<Option<u64>>,
    }

    impl Host {
        /// A host whose clocks read `monotonic_ns` and `wall_ns`.
        pub fn at(monotonic_ns: u64, wall_ns: u64) -> Host {
            Host {
                monotonic: Cell::new(Some(monotonic_ns)),
                wall: Cell::new(Some(wall_ns)),
            }
        }

        /// Both clocks move on by `ns` (time passes).
        pub fn advance(&self, ns: u64) {
            self.monotonic.set(self.monotonic.get().map(|t| t + ns));
            self.wall.set(self.wall.get().map(|t| t + ns));
        }

        /// The wall clock alone is set back by `ns` (an NTP step, an operator's `date -s`).
        pub fn step_wall_back(&self, ns: u64) {
            self.wall.set(self.wall.get().map(|t| t.saturating_sub(ns)));
        }
    }

    impl super::Source for Host {
        fn monotonic_ns(&self) -> Option<u64> {
            self.monotonic.get()
        }

        fn wall_ns(&self) -> Option<u64> {
            self.wall.get()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake::Host;
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const S: u64 = 1_000_000_000;

    #[test]
    fn a_host_with_a_monotonic_clock_is_read_by_it_and_a_wall_step_changes_nothing() {
        let host = Host::at(50 * S, 1_700_000_000 * S);
        let clock = Clock::default();
        assert_eq!(clock.now_ns(&host), 50 * S);
        assert_eq!(clock.kind(&host), Kind::Monotonic);
        host.advance(S);
        host.step_wall_back(3600 * S);
        assert_eq!(clock.now_ns(&host), 51 * S);
    }

    #[test]
    fn a_host_without_one_is_read_by_its_wall_clock_which_never_goes_back() {
        let host = Host::at(0, 1_700_000_000 * S);
        host.monotonic.set(None);
        let clock = Clock::default();
        assert_eq!(clock.now_ns(&host), 1_700_000_000 * S);
        assert_eq!(clock.kind(&host), Kind::Wall);
        host.step_wall_back(10 * S);
        assert_eq!(clock.now_ns(&host), 1_700_000_000 * S, "held, not rewound");
        host.advance(11 * S);
        assert_eq!(clock.now_ns(&host), 1_700_000_001 * S);
    }

    #[test]
    fn the_choice_is_made_once_so_one_vm_never_mixes_the_two() {
        let host = Host::at(50 * S, 1_700_000_000 * S);
        let clock = Clock::default();
        clock.now_ns(&host);
        host.monotonic.set(None);
        // A failed monotonic read is the last time read, never a jump to the wall clock.
        assert_eq!(clock.now_ns(&host), 50 * S);
        assert_eq!(clock.kind(&host), Kind::Monotonic);
    }
}
