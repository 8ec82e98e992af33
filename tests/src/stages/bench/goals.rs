//! The summary and the goals, judged from the run's own figures.

use super::*;

pub(crate) fn print_summary(b: &Bench, c: &Components, memory: &BucketMemory) {
    println!("\n== summary");
    println!(
        "Redis CPU per decision: {:.1} µs for a lone decision (single.lua), {:.1} µs for the long script with 1 decision per call, {:.1} µs with {} per call, {:.1} µs for INCR",
        c.single_one.cpu_per_decision("redis"),
        c.script_one.cpu_per_decision("redis"),
        c.script_batch.cpu_per_decision("redis"),
        b.args.batch,
        c.incr.cpu_per_decision("redis")
    );
    println!(
        "sidecar CPU per decision: {:.1} µs with 1 request per call, {:.1} µs with {} per call",
        c.decide_one.cpu_per_decision("sidecar"),
        c.decide_batch.cpu_per_decision("sidecar"),
        b.args.batch
    );
    for (label, name, one, batch) in [
        ("sidecar", "sidecar", &c.decide_one, &c.decide_batch),
        (
            "Redis (long script)",
            "redis",
            &c.script_one,
            &c.script_batch,
        ),
    ] {
        // One decision per call: its CPU per decision is its CPU per call.
        let Some(split) = PerCall::split(
            one.cpu_per_decision(name),
            batch.cpu_per_decision(name),
            b.args.batch,
        ) else {
            continue;
        };
        let needed = split
            .decisions_for(PER_DECISION_GOAL_US)
            .map_or("none: its marginal cost is above".to_string(), |n| {
                format!("{n:.0}")
            });
        println!(
            "{label} per call: {:.1} µs fixed + {:.1} µs per decision (from 1 and {} per call at {} caller(s)); decisions per call for {PER_DECISION_GOAL_US} µs per decision: {needed}",
            split.fixed, split.marginal, b.args.batch, b.args.concurrency
        );
    }
    println!(
        "Redis memory per bucket: {:.0} bytes (used_memory grew by that per bucket over {} buckets), {:.0} bytes by MEMORY USAGE ({} sampled); filter module {} KiB",
        memory.used_per_bucket,
        MEMORY_BUCKETS,
        memory.usage_per_bucket,
        memory.sampled,
        b.wasm_size / 1024
    );
}

/// The per-decision goal of the sidecar on many keys (the 6 µs), for
/// [`PerCall::decisions_for`].
pub(crate) const PER_DECISION_GOAL_US: f64 = 6.0;

/// A process's CPU per call split in two, from a stage of one decision per call and one of `n`:
/// what every call costs whatever it carries (the HTTP or Redis round trip, the wake-ups) and
/// what each decision adds, so that `c(b) = fixed / b + marginal` per decision at `b` per call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct PerCall {
    pub(crate) fixed: f64,
    pub(crate) marginal: f64,
}

impl PerCall {
    /// From `one` (µs per call of one decision) and `per_decision_at_n` (µs per decision with
    /// `n` per call); `None` without two distinct sizes.
    pub(crate) fn split(one: f64, per_decision_at_n: f64, n: usize) -> Option<PerCall> {
        if n < 2 {
            return None;
        }
        let marginal = ((per_decision_at_n * n as f64 - one) / (n as f64 - 1.0)).max(0.0);
        Some(PerCall {
            fixed: (one - marginal).max(0.0),
            marginal,
        })
    }

    /// The decisions per call at which the cost per decision falls to `goal` µs; `None` when
    /// the marginal cost alone is above it.
    pub(crate) fn decisions_for(&self, goal: f64) -> Option<f64> {
        (goal > self.marginal).then(|| (self.fixed / (goal - self.marginal)).ceil().max(1.0))
    }
}

/// The goal of "the decisions that must leave the gateway" for Envoy's CPU per request above
/// the no-op filter on many keys, for [`EnvoySplit::callouts_for`].
pub(crate) const GATEWAY_ENVOY_GOAL_US: f64 = 15.0;

/// Envoy's CPU per request above the no-op filter on many keys split in two, from the stage with
/// a callout per request and the filter as shipped at `c` callouts per request: what a request
/// costs whatever its callout carries, and what a callout adds, so that
/// `added(c) = per_request + c × per_callout`. An estimate: the per-request callout's path is not
/// the coalesced one (no queue, no hand-over between workers), so it says what fewer callouts
/// alone could reach.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct EnvoySplit {
    pub(crate) per_request: f64,
    pub(crate) per_callout: f64,
}

impl EnvoySplit {
    /// From `slow` (µs above the no-op filter with a callout per request) and `fast` (with
    /// `callouts` per request); `None` unless `callouts` is below 1.
    pub(crate) fn split(slow: f64, fast: f64, callouts: f64) -> Option<EnvoySplit> {
        if !(0.0..1.0).contains(&callouts) {
            return None;
        }
        let per_callout = ((slow - fast) / (1.0 - callouts)).max(0.0);
        Some(EnvoySplit {
            per_request: (fast - callouts * per_callout).max(0.0),
            per_callout,
        })
    }

    /// The most callouts per request at which Envoy's added CPU is `goal` µs; `None` when the
    /// per-request part alone is above it.
    pub(crate) fn callouts_for(&self, goal: f64) -> Option<f64> {
        if goal <= self.per_request {
            return None;
        }
        Some(if self.per_callout > 0.0 {
            ((goal - self.per_request) / self.per_callout).min(1.0)
        } else {
            1.0
        })
    }

    /// The line `make bench` prints for one stage.
    pub(crate) fn describe(&self, slow: f64, fast: f64, callouts: f64) -> String {
        let reach = match self.callouts_for(GATEWAY_ENVOY_GOAL_US) {
            Some(c) => format!(
                "at most {c:.3} callouts per request ({:.0} requests per callout)",
                1.0 / c.max(1e-9)
            ),
            None => "none: the per-request part alone is above it".to_string(),
        };
        format!(
            "{:.1} µs per request whatever its callout carries + {:.1} µs per callout (an estimate from {slow:.1} µs at 1 callout per request and {fast:.1} at {callouts:.3}); for {GATEWAY_ENVOY_GOAL_US} µs: {reach}",
            self.per_request, self.per_callout
        )
    }
}

/// Each worker count's goals, as ratios from this run, judged on the medians of its rounds.
pub(crate) fn print_goals(b: &Bench, c: &Components, runs: &[(EnvoyRun, Vec<EnvoyRun>, AtLimit)]) {
    println!(
        "\n== goals (ratios from this run: the medians of {} round(s) of the Envoy stages)",
        b.args.rounds.max(1)
    );
    let script_redis = c.script_one.cpu_per_decision("redis");
    let single = c.single_one.cpu_per_decision("redis");
    let incr = c.incr.cpu_per_decision("redis");
    println!(
        "lone-decision script (single.lua), 1 decision per call, Redis kept busy: {single:.1} µs of Redis per decision (goal <= {PER_DECISION_GOAL_US}: {}); INCR in the same run {incr:.1} µs ({:.2}x of it)",
        if single <= PER_DECISION_GOAL_US { "met" } else { "NOT met" },
        single / incr.max(1e-9)
    );
    for (run, rounds, edge) in runs {
        let w = run.workers;
        let find = |wl: Workload| run.wasm.iter().find(|(x, ..)| *x == wl).expect("workload");
        let judged = judge(run, script_redis);
        let verdict = |key: &str| {
            let j = judged.iter().find(|j| j.key == key).expect("goal");
            format!("goal {}: {}", j.want, if j.ok { "met" } else { "NOT met" })
        };
        let (_, _, hot, hot_callouts) = find(Workload::HotKey);
        let (_, _, flood, flood_callouts) = find(Workload::Flood);
        let (_, many_slow, many, many_callouts) = find(Workload::ManyKeys);
        let noop_envoy = run.noop.cpu("envoy");
        let r = hot.per_second() / run.noop.per_second();
        println!("[{w} worker(s)] hot key, mostly admitted: {r:.2}x the no-op filter's throughput ({}), {hot_callouts:.3} callouts/request", verdict("hot"));
        let r = flood.per_second() / run.noop.per_second();
        println!("[{w} worker(s)] flood on an exhausted key: {r:.2}x the no-op filter's throughput ({}), {flood_callouts:.4} callouts/request", verdict("flood"));
        let r = many.per_second() / run.baseline.per_second();
        println!("[{w} worker(s)] many keys: {r:.2}x the no-limit baseline ({}), {many_callouts:.3} callouts/request", verdict("many"));
        let added_fast = many.cpu("envoy") - noop_envoy;
        let added_slow = many_slow.cpu("envoy") - noop_envoy;
        println!(
            "[{w} worker(s)] many keys, Envoy CPU above the no-op filter: {added_fast:.1} µs/request vs {added_slow:.1} with a callout per request ({:.2} of it; {}; {} µs)",
            added_fast / added_slow.max(1e-9),
            verdict("envoy"),
            verdict("gateway envoy")
        );
        if let Some(split) = EnvoySplit::split(added_slow, added_fast, *many_callouts) {
            println!(
                "[{w} worker(s)] many keys, Envoy's added CPU split: {}",
                split.describe(added_slow, added_fast, *many_callouts)
            );
        }
        if w >= 2 {
            println!(
                "[{w} worker(s)] many keys: {:.2}x the no-op filter's throughput ({})",
                many.per_second() / run.noop.per_second(),
                verdict("gateway many")
            );
        }
        let redis_real = many.cpu_per_decision("redis");
        println!(
            "[{w} worker(s)] many keys, Redis CPU per decision on the real path: {redis_real:.1} µs vs {script_redis:.1} µs for the 1-decision script ({:.2}; {})",
            redis_real / script_redis.max(1e-9),
            verdict("redis")
        );
        for (wl, _, fast, _) in &run.wasm {
            let r = fast.cpu_per_decision("redis");
            println!(
                "[{w} worker(s)] {}: Redis CPU {r:.2} µs and sidecar CPU {:.2} µs per request",
                wl.name(),
                fast.cpu_per_decision("sidecar")
            );
        }
        let sidecar_real = many.cpu_per_decision("sidecar");
        println!(
            "[{w} worker(s)] many keys, sidecar CPU per decision: {sidecar_real:.1} µs ({}; {})",
            verdict("sidecar"),
            verdict("gateway sidecar")
        );
        println!(
            "[{w} worker(s)] many keys, Redis CPU per decision: {redis_real:.1} µs ({})",
            verdict("gateway redis")
        );
        for (wl, r, callouts) in &run.extra {
            println!(
                "[{w} worker(s)] {}: {:.2}x the no-op filter's throughput ({:.2}x many keys by address); Envoy CPU above the no-op filter {:.1} µs/request (many keys {added_fast:.1}); whole-stack CPU per request {:.1} µs, {:.2}x many keys'; sidecar {:.1} µs, Redis {:.1} µs per request; {callouts:.3} callouts/request",
                wl.name(),
                r.per_second() / run.noop.per_second(),
                r.per_second() / many.per_second(),
                r.cpu("envoy") - noop_envoy,
                r.stack_cpu(),
                r.stack_cpu() / many.stack_cpu().max(1e-9),
                r.cpu_per_decision("sidecar"),
                r.cpu_per_decision("redis"),
            );
        }
        if let Some(l) = &run.loaded {
            let c = l.concurrency;
            let r = l.fast.per_second() / l.baseline.per_second();
            println!("[{w} worker(s), {c} callers] many keys: {r:.2}x the no-limit baseline ({}), {:.3} callouts/request", verdict("loaded many"), l.callouts);
            let added_fast = l.fast.cpu("envoy") - l.noop.cpu("envoy");
            let added_slow = l.slow.cpu("envoy") - l.noop.cpu("envoy");
            println!(
                "[{w} worker(s), {c} callers] many keys, Envoy CPU above the no-op filter: {added_fast:.1} µs/request vs {added_slow:.1} with a callout per request ({:.2} of it; {})",
                added_fast / added_slow.max(1e-9),
                verdict("loaded envoy")
            );
            if let Some(split) = EnvoySplit::split(added_slow, added_fast, l.callouts) {
                println!(
                    "[{w} worker(s), {c} callers] many keys, Envoy's added CPU split: {}",
                    split.describe(added_slow, added_fast, l.callouts)
                );
            }
            let redis_real = l.fast.cpu_per_decision("redis");
            println!(
                "[{w} worker(s), {c} callers] many keys, Redis CPU per decision on the real path: {redis_real:.1} µs vs {script_redis:.1} µs for the 1-decision script ({:.2}; {})",
                redis_real / script_redis.max(1e-9),
                verdict("loaded redis")
            );
            let sidecar_real = l.fast.cpu_per_decision("sidecar");
            println!(
                "[{w} worker(s), {c} callers] many keys, sidecar CPU per decision: {sidecar_real:.1} µs ({})",
                verdict("loaded sidecar")
            );
        }
        println!(
            "[{w} worker(s)] local_ratelimit (no shared budget) for reference: {:.2}x the baseline",
            run.local.per_second() / run.baseline.per_second()
        );
        for (wl, native) in &run.native {
            let (_, _, fast, _) = find(*wl);
            let t = fast.per_second() / native.per_second();
            let c = fast.stack_cpu() / native.stack_cpu().max(1e-9);
            let key = format!("native {}", wl.name());
            let wanted = judged.iter().any(|j| j.key == key);
            println!(
                "[{w} worker(s)] {}: the wasm filter vs Envoy's native filter + sidecar (gRPC): {t:.2}x the throughput, {c:.2}x the whole-stack CPU per request ({:.1} vs {:.1} µs){}",
                wl.name(),
                fast.stack_cpu(),
                native.stack_cpu(),
                if wanted { format!(" ({})", verdict(&key)) } else { String::new() }
            );
        }
        for (wl, rlqs) in &run.rlqs {
            let (_, _, fast, _) = find(*wl);
            println!(
                "[{w} worker(s)] {}: Envoy's quota filter (RLQS): {:.2}x the baseline's throughput, {:.2}x local_ratelimit's; whole-stack CPU per request {:.1} µs vs {:.1} for Envoy alone, {:.1} for local_ratelimit, {:.1} for the wasm filter as shipped",
                wl.name(),
                rlqs.per_second() / run.baseline.per_second(),
                rlqs.per_second() / run.local.per_second(),
                rlqs.stack_cpu(),
                run.baseline.stack_cpu(),
                run.local.stack_cpu(),
                fast.stack_cpu(),
            );
        }
        println!(
            "[{w} worker(s)] hot key at its limit ({EDGE_CAPACITY} + {EDGE_REFILL}/s, {} callers as one client, {:.1} s): {} admitted, exact bound C + r·T = {:.0}: over-admission {:.0} (goal 0: {}); under-admission {:.0} tokens ({:.1}% of the bound; leases withhold at most 2·L = {:.0} per Envoy, plus {} errors), {:.4} callouts/request",
            b.args.concurrency,
            edge.seconds,
            edge.admitted,
            edge.exact_bound(),
            edge.over(),
            if edge.over() == 0.0 { "met" } else { "NOT met" },
            edge.under(),
            100.0 * edge.under() / edge.exact_bound(),
            AtLimit::lease_bound(),
            edge.errors,
            edge.callouts
        );
        if rounds.len() > 1 {
            print_rounds(w, &judged, rounds, script_redis);
        }
    }
}
