//! The smallest schedule that still shows a violation: the plan cut a few seconds after the
//! first violation, then each fault dropped in turn, kept dropped while a re-run still violates,
//! until no fault can be dropped. Processes' timing does not repeat, so a re-run that passes
//! keeps the fault (the shrunk plan may hold one more than it needs, never one less).

use super::run::{run, Outcome};
use super::schedule::{Action, Plan};

/// How long past the first violation the cut plan runs, in seconds.
const PAST_VIOLATION_S: u64 = 5;

/// The first violation's time in plan seconds (rounded up).
fn first_violation_s(o: &Outcome) -> Option<u64> {
    o.verdict
        .violations
        .iter()
        .filter(|v| v.at_ns > 0)
        .map(|v| v.at_ns.saturating_sub(o.zero_ns).div_ceil(1_000_000_000))
        .min()
}

/// `plan` cut to its first `seconds`.
fn cut(plan: &Plan, seconds: u64) -> Plan {
    Plan {
        seconds,
        steps: plan
            .steps
            .iter()
            .filter(|s| s.at_ms < seconds * 1000)
            .cloned()
            .collect(),
        ..plan.clone()
    }
}

/// Shrinks a violating outcome's plan; returns the smallest plan that violated and its outcome.
/// `progress` is told each re-run.
pub fn shrink(failing: Outcome, mut progress: impl FnMut(&str)) -> Outcome {
    let mut best = failing;
    if let Some(s) = first_violation_s(&best) {
        let shorter = cut(&best.plan, s + PAST_VIOLATION_S);
        if shorter.seconds < best.plan.seconds {
            progress(&format!("re-running the first {} s", shorter.seconds));
            let o = run(&shorter);
            if o.violated() {
                best = o;
            }
        }
    }
    loop {
        let mut dropped = false;
        let mut i = 0;
        while i < best.plan.steps.len() {
            if !matches!(best.plan.steps[i].action, Action::Fault(_)) {
                i += 1;
                continue;
            }
            let fewer = best.plan.without(i);
            progress(&format!(
                "re-running without {:?} at {} ms",
                best.plan.steps[i].action, best.plan.steps[i].at_ms
            ));
            let o = run(&fewer);
            if o.violated() {
                best = o;
                dropped = true;
            } else {
                i += 1;
            }
        }
        if !dropped {
            return best;
        }
    }
}
