//! The assignment planner: for one bucket and one connected Envoy, which strategy to send, and how
//! many tokens to take from the Redis bucket first so that what Envoy may admit under every
//! assignment it was sent never exceeds what was taken. Pure: time is an argument (milliseconds on
//! the sidecar's monotonic clock), the store's grant is an argument. docs/rlqs.md explains the
//! Envoy behaviour each formula rests on.
//!
//! # Envoy's side (1.40)
//!
//! A `TokenBucket` assignment `{max_tokens: B, tokens_per_fill: r, fill_interval: 1s}` that differs
//! from the bucket's current one starts a new local bucket, full (B tokens), refilled at r per
//! second continuously; the same strategy sent again keeps the local bucket and restarts the TTL
//! timer. The TTL counts from when Envoy applies the assignment, which is at most `margin` after
//! the sidecar sent it (the delivery margin, an assumption the docs state).
//!
//! # The chain and its worst case
//!
//! The assignments since the last strategy change are one chain: sent first at `s`, its local
//! bucket lives at most until the horizon `h` = (last send) + TTL + margin. By time `x`, Envoy may
//! have admitted at most
//!
//! ```text
//! W(x) = base + B + r × (min(x, h) − s)        (DENY_ALL: W(x) = base)
//! ```
//!
//! where `base` is the previous chain's worst case at `s + margin` (the old local bucket may
//! still admit until the new assignment is applied). The planner keeps `W(h) <= reserved`, the
//! tokens it took from the Redis bucket for this Envoy and bucket: a renewal takes
//! `r × (h' − h)`, a new chain `base + B' + r' × (TTL + margin) − reserved`. What the Redis bucket
//! hands out (costs and lease grants alike) is at most `C + refill × t` over any run from full, so
//! the sum over Envoys of what their assignments allow is too.

/// What one Envoy is told for one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    AllowAll,
    DenyAll,
    /// Envoy's `TokenBucket` with `fill_interval` 1 s: starts full, refills continuously.
    TokenBucket {
        max_tokens: u32,
        tokens_per_sec: u32,
    },
}

/// The timing of assignments: their TTL (Envoy reads whole seconds) and the delivery margin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub ttl_s: u64,
    /// The longest time from the sidecar planning an assignment (before it asks the store for its
    /// tokens) to Envoy applying it.
    pub margin_ms: u64,
}

impl Timing {
    /// How long after sending an assignment Envoy may still apply it: TTL + margin.
    pub fn lifetime_ms(&self) -> u64 {
        self.ttl_s * 1000 + self.margin_ms
    }
}

/// What the planner would like this Envoy to hold (from its share of the demand).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    pub max_tokens: u32,
    pub tokens_per_sec: u32,
}

/// The assignments sent since the last strategy change.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Chain {
    strategy: Strategy,
    sent_ms: u64,
    /// The previous chains' worst case when this one took over.
    base: f64,
    horizon_ms: u64,
}

impl Chain {
    fn worst_case(&self, at_ms: u64) -> f64 {
        match self.strategy {
            Strategy::TokenBucket {
                max_tokens,
                tokens_per_sec,
            } => {
                let live_ms = at_ms.min(self.horizon_ms).saturating_sub(self.sent_ms);
                self.base + f64::from(max_tokens) + f64::from(tokens_per_sec) * live_ms as f64 / 1e3
            }
            Strategy::DenyAll | Strategy::AllowAll => self.base,
        }
    }
}

/// What the planner proposes before asking the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proposal {
    /// The same token bucket again: Envoy keeps its local bucket, the horizon moves.
    Renew,
    /// A new chain with this strategy.
    Start(Strategy),
}

/// The tokens to take from the Redis bucket for a proposal (0: none needed, no store call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    pub tokens: u64,
    pub proposal: Proposal,
}

/// One Envoy's hold on one bucket: the tokens taken for it, and its current chain.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Holding {
    reserved: f64,
    chain: Option<Chain>,
}

/// Below this, two strategies' rates are close enough to renew rather than restart (a restart
/// refills Envoy's local bucket, which costs its `max_tokens` again).
const RESTART_RATIO: f64 = 0.2;

const EPSILON: f64 = 1e-6;

impl Holding {
    /// Tokens taken from the Redis bucket for this Envoy and bucket so far.
    pub fn reserved(&self) -> f64 {
        self.reserved
    }

    /// The most Envoy may have admitted by `at_ms` under every assignment it was sent.
    pub fn worst_case(&self, at_ms: u64) -> f64 {
        self.chain.map_or(0.0, |c| c.worst_case(at_ms))
    }

    /// The most Envoy may admit under what it was sent, ever (at the horizon).
    pub fn committed(&self) -> f64 {
        self.chain.map_or(0.0, |c| c.worst_case(c.horizon_ms))
    }

    /// The strategy in force (the last one sent).
    pub fn strategy(&self) -> Option<Strategy> {
        self.chain.map(|c| c.strategy)
    }

    /// Whether the last assignment may still be live in Envoy at `now_ms`.
    pub fn live(&self, now_ms: u64) -> bool {
        self.chain.is_some_and(|c| now_ms < c.horizon_ms)
    }

    /// Whether the same strategy sent at `now_ms` surely reaches Envoy while the last one is still
    /// live there (so that Envoy keeps its local bucket): it is applied by `now + margin`, and the
    /// last one expires no sooner than its send + TTL = horizon − margin.
    fn renewable(&self, now_ms: u64, timing: Timing) -> bool {
        self.chain
            .is_some_and(|c| now_ms + 2 * timing.margin_ms < c.horizon_ms)
    }

    /// Whether renewing what was sent can wait until `next_ms` (the next round): the same
    /// strategy sent then still reaches Envoy while the last one is live. A renewal that can wait
    /// costs nothing now: the one sent later takes the rate times the longer extension, so the
    /// tokens taken are the same, in fewer store calls and messages.
    pub fn renewal_can_wait(&self, next_ms: u64, timing: Timing) -> bool {
        self.renewable(next_ms, timing)
    }

    /// The base a new chain sent at `now_ms` starts from.
    fn base_at(&self, now_ms: u64, timing: Timing) -> f64 {
        self.worst_case(now_ms + timing.margin_ms)
    }

    /// What a proposal commits Envoy to, at its horizon.
    fn need(&self, now_ms: u64, proposal: Proposal, timing: Timing) -> Option<f64> {
        let horizon_ms = now_ms + timing.lifetime_ms();
        match proposal {
            Proposal::Renew => {
                let chain = self.chain?;
                (matches!(chain.strategy, Strategy::TokenBucket { .. })
                    && self.renewable(now_ms, timing))
                .then(|| {
                    Chain {
                        horizon_ms: horizon_ms.max(chain.horizon_ms),
                        ..chain
                    }
                    .worst_case(horizon_ms)
                })
            }
            Proposal::Start(strategy) => Some(
                Chain {
                    strategy,
                    sent_ms: now_ms,
                    base: self.base_at(now_ms, timing),
                    horizon_ms,
                }
                .worst_case(horizon_ms),
            ),
        }
    }

    /// The proposal for `target` and the tokens it needs beyond those already taken.
    pub fn ask(&self, now_ms: u64, target: Target, timing: Timing) -> Ask {
        let wanted = target_strategy(target);
        let proposal = match self.chain.map(|c| c.strategy) {
            Some(current @ Strategy::TokenBucket { .. })
                if close(current, wanted) && self.renewable(now_ms, timing) =>
            {
                Proposal::Renew
            }
            Some(Strategy::DenyAll) if wanted == Strategy::DenyAll => Proposal::Renew,
            _ => Proposal::Start(wanted),
        };
        let need = match proposal {
            // Renewing DENY_ALL commits nothing more.
            Proposal::Renew if wanted == Strategy::DenyAll => self.committed(),
            p => self.need(now_ms, p, timing).unwrap_or(f64::INFINITY),
        };
        Ask {
            tokens: tokens_beyond(need, self.reserved),
            proposal,
        }
    }

    /// Records the `granted` tokens taken for `ask` and chooses what to send: the proposal if the
    /// tokens held cover it; else renewing the current token bucket; else the largest token bucket
    /// they cover (rate and burst at most the target's); else DENY_ALL, which always fits.
    pub fn choose(
        &mut self,
        now_ms: u64,
        ask: Ask,
        granted: u64,
        target: Target,
        timing: Timing,
    ) -> Strategy {
        self.reserved += granted as f64;
        let fits = |h: &Holding, p: Proposal| {
            h.need(now_ms, p, timing)
                .is_some_and(|n| n <= h.reserved + EPSILON)
        };
        let mut options = vec![ask.proposal];
        if ask.proposal != Proposal::Renew {
            options.push(Proposal::Renew);
        }
        if let Some(fitted) = self.fit(now_ms, target, timing) {
            options.push(Proposal::Start(fitted));
        }
        let chosen = options
            .into_iter()
            .find(|p| match p {
                Proposal::Start(Strategy::AllowAll) => false,
                p => fits(self, *p),
            })
            .unwrap_or(Proposal::Start(Strategy::DenyAll));
        let horizon_ms = now_ms + timing.lifetime_ms();
        match (chosen, self.chain.as_mut()) {
            (Proposal::Renew, Some(chain)) => {
                chain.horizon_ms = chain.horizon_ms.max(horizon_ms);
                chain.strategy
            }
            (Proposal::Start(_), _) | (Proposal::Renew, None) => {
                let strategy = match chosen {
                    Proposal::Start(s) => s,
                    Proposal::Renew => Strategy::DenyAll,
                };
                // Renewing DENY_ALL keeps the base: the old chain's worst case never grows.
                let base = match self.chain {
                    Some(c) if c.strategy == Strategy::DenyAll && strategy == Strategy::DenyAll => {
                        c.base
                    }
                    _ => self.base_at(now_ms, timing),
                };
                self.chain = Some(Chain {
                    strategy,
                    sent_ms: now_ms,
                    base,
                    horizon_ms,
                });
                strategy
            }
        }
    }

    /// The largest token bucket (rate first, then burst, each at most the target's) that the
    /// tokens held cover as a new chain sent now.
    fn fit(&self, now_ms: u64, target: Target, timing: Timing) -> Option<Strategy> {
        let budget = self.reserved - self.base_at(now_ms, timing);
        let lifetime_s = timing.lifetime_ms() as f64 / 1e3;
        // Leave at least one token of burst.
        let rate = ((budget - 1.0) / lifetime_s + EPSILON).floor();
        let rate = rate.min(f64::from(target.tokens_per_sec));
        if rate < 1.0 {
            return None;
        }
        let burst = (budget - rate * lifetime_s + EPSILON)
            .floor()
            .min(f64::from(target.max_tokens.max(1)));
        (burst >= 1.0).then_some(Strategy::TokenBucket {
            max_tokens: burst as u32,
            tokens_per_sec: rate as u32,
        })
    }
}

fn target_strategy(target: Target) -> Strategy {
    if target.tokens_per_sec == 0 || target.max_tokens == 0 {
        Strategy::DenyAll
    } else {
        Strategy::TokenBucket {
            max_tokens: target.max_tokens,
            tokens_per_sec: target.tokens_per_sec,
        }
    }
}

/// Whether renewing `current` is close enough to `wanted` (rates within [`RESTART_RATIO`]).
fn close(current: Strategy, wanted: Strategy) -> bool {
    match (current, wanted) {
        (
            Strategy::TokenBucket {
                tokens_per_sec: a, ..
            },
            Strategy::TokenBucket {
                tokens_per_sec: b, ..
            },
        ) => (f64::from(a) - f64::from(b)).abs() <= (f64::from(a) * RESTART_RATIO).max(1.0),
        _ => false,
    }
}

fn tokens_beyond(need: f64, reserved: f64) -> u64 {
    if !need.is_finite() {
        return 0;
    }
    let missing = need - reserved - EPSILON;
    if missing <= 0.0 {
        0
    } else {
        missing.ceil() as u64
    }
}

/// One Envoy's demand on one bucket: requests per second (allowed and denied), smoothed over its
/// usage reports (a new report weighs three quarters).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Demand {
    per_sec: f64,
    last_ms: Option<u64>,
}

/// The weight of a new report in the smoothed demand.
const DEMAND_WEIGHT: f64 = 0.75;

impl Demand {
    pub fn per_sec(&self) -> f64 {
        self.per_sec
    }

    /// Adds a usage report received at `now_ms`: `requests` (allowed and denied) since the last
    /// one. The first report of a bucket only sets the clock (and counts its requests as one
    /// second's worth).
    pub fn report(&mut self, now_ms: u64, requests: u64) {
        let sample = match self.last_ms {
            Some(last) if now_ms > last => requests as f64 * 1e3 / (now_ms - last) as f64,
            Some(_) => return,
            None => requests as f64,
        };
        self.per_sec = if self.last_ms.is_some() {
            DEMAND_WEIGHT * sample + (1.0 - DEMAND_WEIGHT) * self.per_sec
        } else {
            sample
        };
        self.last_ms = Some(now_ms);
    }
}

/// This Envoy's target on a bucket of `capacity` and `refill_per_sec`, given its demand and the
/// demand of every Envoy this sidecar serves on that bucket (its own included): a share of the
/// refill in proportion to demand (equal shares when nobody asks), at least one token per
/// second; a burst of one second at that rate, at most the capacity's share.
pub fn target(capacity: u64, refill_per_sec: f64, mine: f64, all: &[f64]) -> Target {
    let total: f64 = all.iter().sum();
    let share = if total > 0.0 {
        mine / total
    } else {
        1.0 / all.len().max(1) as f64
    };
    let rate = (refill_per_sec * share)
        .floor()
        .clamp(1.0, f64::from(u32::MAX));
    let burst = (capacity as f64 * share)
        .floor()
        .min(rate)
        .clamp(1.0, f64::from(u32::MAX));
    Target {
        max_tokens: burst as u32,
        tokens_per_sec: rate as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{prop_assert, proptest};
    use proptest::strategy::Strategy as _;

    const TIMING: Timing = Timing {
        ttl_s: 2,
        margin_ms: 500,
    };

    /// A holding whose first assignment (burst 10, 5 a second, sent at 0) got every token it
    /// asked for, and its target.
    fn assigned() -> (Holding, Target) {
        let target = Target {
            max_tokens: 10,
            tokens_per_sec: 5,
        };
        let mut h = Holding::default();
        let ask = h.ask(0, target, TIMING);
        h.choose(0, ask, ask.tokens, target, TIMING);
        (h, target)
    }

    fn tb(max_tokens: u32, tokens_per_sec: u32) -> Strategy {
        Strategy::TokenBucket {
            max_tokens,
            tokens_per_sec,
        }
    }

    #[test]
    fn a_first_assignment_takes_its_burst_and_its_lifetime_at_its_rate() {
        let h = Holding::default();
        let target = Target {
            max_tokens: 10,
            tokens_per_sec: 5,
        };
        let ask = h.ask(0, target, TIMING);
        // 10 + 5 × 2.5 s
        assert_eq!(ask.tokens, 23);
        assert_eq!(ask.proposal, Proposal::Start(tb(10, 5)));
        let mut h = h;
        assert_eq!(h.choose(0, ask, 23, target, TIMING), tb(10, 5));
        assert_eq!(h.committed(), 22.5);
    }

    #[test]
    fn a_renewal_takes_the_rate_times_the_extension_only() {
        let (mut h, target) = assigned();
        let ask = h.ask(1000, target, TIMING);
        assert_eq!(ask.proposal, Proposal::Renew);
        assert_eq!(ask.tokens, 5);
        // 22.5 + 5 = 27.5 needed, 23 held
        assert_eq!(ask.tokens, 5);
        assert_eq!(h.choose(1000, ask, 5, target, TIMING), tb(10, 5));
        assert_eq!(h.committed(), 27.5);
        // Too late to be sure the last one is still live: a new chain.
        let ask = h.ask(3000, target, TIMING);
        assert_eq!(ask.proposal, Proposal::Start(tb(10, 5)));
    }

    #[test]
    fn a_renewal_waits_while_the_next_round_still_reaches_envoy_in_time() {
        // TTL 2 s, margin 500 ms: sent at 0, live in Envoy until at least 2000 − 500 + 500.
        let (h, target) = assigned();
        // A renewal sent at 1400 arrives by 1900, before the last assignment's 2000: the round
        // at 1000 can leave it to the round at 1400, not to one at 1500.
        assert!(h.renewal_can_wait(1400, TIMING));
        assert!(!h.renewal_can_wait(1500, TIMING));
        // Waiting costs no tokens: one renewal at 1400 takes what two would have.
        let ask = h.ask(1400, target, TIMING);
        assert_eq!((ask.proposal, ask.tokens), (Proposal::Renew, 7));
        assert!(
            !Holding::default().renewal_can_wait(0, TIMING),
            "nothing sent yet"
        );
    }

    #[test]
    fn a_short_grant_fits_a_smaller_bucket_or_denies() {
        let target = Target {
            max_tokens: 10,
            tokens_per_sec: 5,
        };
        let mut h = Holding::default();
        let ask = h.ask(0, target, TIMING);
        // 13 tokens over 2.5 s: rate 4 (10), burst 3.
        assert_eq!(h.choose(0, ask, 13, target, TIMING), tb(3, 4));
        assert!(h.committed() <= h.reserved());
        let mut h = Holding::default();
        assert_eq!(h.choose(0, ask, 3, target, TIMING), Strategy::DenyAll);
        assert_eq!(h.committed(), 0.0);
    }

    #[test]
    fn a_failed_renewal_keeps_what_was_sent_and_can_always_deny() {
        let (mut h, target) = assigned();
        let ask = h.ask(1000, target, TIMING);
        // Nothing granted: the old chain's reservation still covers a smaller bucket from now on
        // (the 10 tokens of its last two seconds), or DENY_ALL.
        let s = h.choose(1000, ask, 0, target, TIMING);
        assert!(h.committed() <= h.reserved() + EPSILON, "{s:?} {h:?}");
    }

    #[test]
    fn a_rate_change_within_a_fifth_renews() {
        assert!(close(tb(10, 10), tb(10, 12)));
        assert!(!close(tb(10, 10), tb(10, 13)));
        assert!(close(tb(1, 1), tb(1, 2)));
    }

    #[test]
    fn demand_follows_reports() {
        let mut d = Demand::default();
        d.report(0, 10);
        assert_eq!(d.per_sec(), 10.0);
        d.report(1000, 30);
        assert_eq!(d.per_sec(), 25.0);
        d.report(2000, 0);
        assert_eq!(d.per_sec(), 6.25);
        let t = target(100, 10.0, 3.0, &[3.0, 1.0]);
        assert_eq!(t.tokens_per_sec, 7);
        assert_eq!(t.max_tokens, 7);
        let idle = target(100, 10.0, 0.0, &[0.0, 0.0]);
        assert_eq!(idle.tokens_per_sec, 5);
    }

    /// One step of a run: at `at_ms` since the last, Envoy `envoy` gets its target renewed or
    /// changed; the bucket grants what it holds.
    #[derive(Debug, Clone)]
    struct Step {
        after_ms: u64,
        envoy: usize,
        rate: u32,
        burst: u32,
        /// The store's answer came this late: settled then (a late round, docs/rlqs.md).
        late_ms: u64,
    }

    fn steps() -> impl proptest::strategy::Strategy<Value = Vec<Step>> {
        proptest::collection::vec(
            (0u64..2500, 0usize..3, 0u32..40, 0u32..40, 0u64..3000).prop_map(
                |(after_ms, envoy, rate, burst, late_ms)| Step {
                    after_ms,
                    envoy,
                    rate,
                    burst,
                    late_ms: late_ms.saturating_sub(1500),
                },
            ),
            1..60,
        )
    }

    proptest! {
        /// The global bound: a bucket of capacity C and refill r hands out at most C + r·t over
        /// a run of t; the planner keeps every Envoy's worst case within the tokens it took, so
        /// the sum of what the Envoys may admit under their assignments, up to the last horizon,
        /// never exceeds what the bucket handed out (and so C + r·t). Also when the store
        /// answers late and the plan is settled at the answer's time.
        #[test]
        fn envoys_never_may_admit_more_than_the_bucket_handed_out(run in steps()) {
            let capacity = 100.0;
            let refill = 20.0;
            let mut tokens = capacity;
            let mut handed_out = 0.0;
            let mut now = 0u64;
            let mut holdings = vec![Holding::default(); 3];
            for step in run {
                now += step.after_ms;
                tokens = (tokens + refill * step.after_ms as f64 / 1e3).min(capacity);
                let target = Target { max_tokens: step.burst, tokens_per_sec: step.rate };
                let h = &mut holdings[step.envoy];
                let ask = h.ask(now, target, TIMING);
                let granted = (ask.tokens as f64).min(tokens.floor()).max(0.0) as u64;
                tokens -= granted as f64;
                handed_out += granted as f64;
                now += step.late_ms;
                h.choose(now, ask, granted, target, TIMING);
                for h in &holdings {
                    prop_assert!(h.committed() <= h.reserved() + 1e-6, "{h:?}");
                }
                let committed: f64 = holdings.iter().map(Holding::committed).sum();
                prop_assert!(committed <= handed_out + 1e-6);
                let horizon = now + TIMING.lifetime_ms();
                prop_assert!(handed_out <= capacity + refill * horizon as f64 / 1e3 + 1e-6);
            }
        }
    }
}
