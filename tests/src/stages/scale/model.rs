//! The model for 1M decisions/s from the run's own figures.

use super::*;

/// A lease's time to live with the filter's defaults, in seconds.
pub(crate) fn lease_ttl_s() -> f64 {
    lease_defaults().ttl_ms as f64 / 1000.0
}

/// Renewals per second of a lease on a bucket seen at `r` requests/s at one gateway: the lease
/// holds `L = min(max_tokens, ceil(1.25 r ttl))` tokens (the filter's sizing with its defaults)
/// and the next one is asked for when it runs low (a quarter of its tokens left, taken over
/// when spent) or in the last tenth of its time, so `max(r / L, 1 / (0.9 ttl))` times a second.
pub(crate) fn lease_renewals(r: f64) -> f64 {
    (r / lease_ask(r) as f64).max(1.0 / (0.9 * lease_ttl_s()))
}

/// The share of a bucket's requests at one gateway that reach Redis, at `r` requests/s there:
/// 1 below the busy threshold; else each renewal is one decision, and the requests that find no
/// lease while it is in flight (`r x t_ask`, `t_ask` the part of the ask they wait for: near 0
/// when the next lease is asked for early) are decided remotely too:
/// `reach(r) = renewals(r) x (1 + r x t_ask) / r`, at most 1.
pub(crate) fn lease_reach(r: f64, t_ask_s: f64) -> f64 {
    if r < lease_defaults().min_rate_per_sec {
        return 1.0;
    }
    (lease_renewals(r) * (1.0 + r * t_ask_s) / r).min(1.0)
}

/// `t_ask` from a measured reach at `r` requests/s (the inverse of [`lease_reach`]).
pub(crate) fn calibrate_t_ask(reach: f64, r: f64) -> f64 {
    ((reach * r / lease_renewals(r) - 1.0) / r).max(0.0)
}

/// `(c_call, c_dec)` of `c = c_call / b + c_dec` fitted to `(b, c)` points by least squares;
/// None without two distinct batch sizes or when a coefficient comes out negative.
pub(crate) fn batch_fit(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    let xs: Vec<f64> = points.iter().map(|(b, _)| 1.0 / b).collect();
    let (mx, my) = (
        xs.iter().sum::<f64>() / n,
        points.iter().map(|(_, c)| c).sum::<f64>() / n,
    );
    let sxx: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
    if points.len() < 2 || sxx < 1e-6 {
        return None;
    }
    let sxy: f64 = xs
        .iter()
        .zip(points)
        .map(|(x, (_, c))| (x - mx) * (c - my))
        .sum();
    let c_call = sxy / sxx;
    let c_dec = my - c_call * mx;
    (c_call >= 0.0 && c_dec >= 0.0).then_some((c_call, c_dec))
}

/// The smallest number of primaries whose busiest one stays within `utilisation` for `load`
/// decisions/s reaching Redis at `c_us` µs each, with the shares of slots `by_slot` (summing to
/// 1); None if even one slot alone is too much (a single key cannot be split).
pub(crate) fn primaries_needed(
    load: f64,
    c_us: f64,
    by_slot: &[f64],
    utilisation: f64,
) -> Option<usize> {
    let max_slot = by_slot.iter().cloned().fold(0.0, f64::max);
    if load * max_slot * c_us / 1e6 > utilisation {
        return None;
    }
    (1..=16384).find(|p| {
        let busiest = shares_from_slots(by_slot, *p)
            .into_iter()
            .fold(0.0, f64::max);
        load * busiest * c_us / 1e6 <= utilisation
    })
}

pub(crate) fn print_model(
    args: &Args,
    keys: &Keyspace,
    p1: Option<&Part1>,
    p2: Option<&Part2>,
    p5: Option<&Part5>,
) {
    let Some(p1) = p1 else {
        println!("\n== 4. the model needs part 1");
        return;
    };
    let sidecar: Vec<&ShardStage> = p1
        .stages
        .iter()
        .filter(|s| s.path == "sidecar" && !s.replica)
        .collect();
    let largest = sidecar
        .iter()
        .filter(|s| s.dist == Dist::Uniform)
        .max_by_key(|s| s.primaries);
    let Some(largest) = largest else { return };
    // Redis CPU per decision against decisions per script call, over every sidecar stage:
    // c(b) = c_call / b + c_dec (least squares on 1/b), priced at the fleet's batch.
    let points: Vec<(f64, f64)> = sidecar
        .iter()
        .map(|s| {
            let b = s.decisions() / s.calls_per_node.iter().sum::<u64>().max(1) as f64;
            (b, s.redis_us())
        })
        .collect();
    let fit = batch_fit(&points);
    let c_redis = match fit {
        Some((c_call, c_dec)) => c_call / args.fleet_batch + c_dec,
        None => largest.redis_us(),
    };
    // The sidecar's cost behind Envoy (the filter coalesces requests into callouts) when that
    // ran, else on the direct API with one request per call (the most it costs).
    let through_envoy = p1
        .stages
        .iter()
        .filter(|s| s.path == "envoy" && s.dist == Dist::Uniform)
        .max_by_key(|s| s.primaries);
    let c_sidecar = through_envoy.map_or(largest.sidecar_us(), |s| s.sidecar_us());
    let replica = p1.stages.iter().find(|s| s.replica);
    let base = sidecar
        .iter()
        .find(|s| s.dist == Dist::Uniform && Some(s.primaries) == replica.map(|r| r.primaries));
    let (repl_factor, c_replica) = match (replica, base) {
        (Some(r), Some(b)) => {
            let d = r.decisions();
            (
                (r.node_cpu(0) * 1e6 / d) / b.redis_us().max(1e-9),
                r.m.cpu.of("replica") * 1e6 / d,
            )
        }
        _ => (1.0, 0.0),
    };
    // A replica cannot make its primary cheaper: a factor below 1 is the machine's noise.
    let c_primary = c_redis * repl_factor.max(1.0);
    let (d, u, g) = (args.target, args.utilisation, args.gateways as f64);
    println!(
        "\n== 4. the shard model: {:.0} decisions/s, every Redis primary and sidecar core at most {:.0}% busy",
        d,
        u * 100.0
    );
    println!("figures from this run:");
    let measured: Vec<String> = points
        .iter()
        .map(|(b, c)| format!("{c:.1} µs at {b:.1}"))
        .collect();
    println!(
        "  Redis CPU per decision at b decisions per script call (sidecar stages): {}",
        measured.join(", ")
    );
    println!(
        "  of it inside the script (INFO commandstats) with {} primaries, uniform: {:.1} of {:.1} µs",
        largest.primaries,
        largest.script_us_per_node.iter().sum::<f64>() / largest.decisions().max(1.0),
        largest.redis_us()
    );
    match fit {
        Some((c_call, c_dec)) => println!(
            "  c(b)      = c_call / b + c_dec = {c_call:.1} / b + {c_dec:.1} µs (least squares); c_redis = c({}) = {c_redis:.1} µs at the fleet's batch",
            args.fleet_batch
        ),
        None => println!(
            "  c_redis   = {c_redis:.1} µs ({} primaries, uniform keys: the batches measured did not fit c_call / b + c_dec)",
            largest.primaries
        ),
    }
    println!(
        "  f_repl    = {repl_factor:.2}: a primary's cost with a replica attached over without (1 primary; taken as at least 1); c_primary = c_redis x f_repl = {c_primary:.1} µs"
    );
    println!("  c_replica = {c_replica:.1} µs of a replica's CPU per decision it applies");
    match through_envoy {
        Some(s) => println!(
            "  c_sidecar = {c_sidecar:.1} µs of sidecar CPU per decision behind Envoy ({} primaries, uniform; {:.1} µs on the direct API with {} request(s) per call)",
            s.primaries,
            largest.sidecar_us(),
            args.requests_per_call
        ),
        None => println!(
            "  c_sidecar = {c_sidecar:.1} µs of sidecar CPU per decision on the direct API, {} request(s) per call",
            args.requests_per_call
        ),
    }
    // The lease model's one free figure, the time an ask is in flight, from part 2 when it ran.
    let (t_ask, t_ask_from) = match p2.and_then(|p| p.stages.get(2)) {
        Some(s) => {
            let (reach, rate) = (s.per_admitted(s.decisions), s.m.per_second());
            let t = calibrate_t_ask(reach, rate);
            (
                t,
                format!(
                    "from part 2: {:.2}% of the hot key's {rate:.0} requests/s at one Envoy reached Redis, {:.1} lease renewals/s",
                    reach * 100.0,
                    lease_renewals(rate)
                ),
            )
        }
        None => (0.002, "assumed (part 2 did not run)".to_string()),
    };
    println!(
        "  t_ask     = {:.2} ms: how long requests wait for a lease renewal ({t_ask_from})",
        t_ask * 1e3
    );
    println!("formula (redo it with your own figures):");
    println!("  c_primary = (c_call / b + c_dec) x f_repl   (b: decisions per script call, about 1 in a large fleet)");
    println!("  S(P)      = the share of decisions on the busiest of P primaries (even slot ranges), from the keys' weights and slots");
    println!("  primaries = the smallest P with  D_redis x S(P) x c_primary <= u   (a primary runs scripts on one core)");
    println!("              impossible when one key alone has D_redis x w_key x c_primary > u: that key must be leased (or split)");
    println!("  replicas  = primaries x {}  (a replica applies its primary's writes: D_redis x S(P) x c_replica <= u)", args.replicas_per_primary);
    println!("  sidecar cores = D_sidecar x c_sidecar / u   (sidecars share no state: spread them freely)");
    println!(
        "  with leases, a key seen at r requests/s per gateway (G = {} gateways) sends r x reach(r) to Redis:",
        args.gateways
    );
    let (leases, ttl) = (lease_defaults(), lease_ttl_s());
    let (busy, most, last) = (leases.min_rate_per_sec, leases.max_tokens, 0.9 * ttl);
    println!("              reach(r) = renewals(r) x (1 + r x t_ask) / r for r >= {busy}/s, else 1, where renewals(r) = max(r / min({most}, ceil(1.25 r x {ttl} s)), 1/({last} s))");
    println!("              (the filter's lease defaults: busy from {busy}/s, {ttl} s leases of at most {most} tokens)");
    let model = Model {
        target: d,
        utilisation: u,
        gateways: g,
        replicas_per_primary: args.replicas_per_primary,
        t_ask,
        c_sidecar,
    };
    match p5 {
        Some(p5) => {
            let f = c_primary / c_redis.max(1e-9);
            println!(
                "with c_primary from part 5 (Redis held at {:.0}% busy, one decision per call, the lone-decision script): {:.1} µs x f_repl {f:.2} = {:.1} µs",
                u * 100.0,
                p5.median(Work::Single),
                p5.median(Work::Single) * f
            );
            model_table(keys, &model, p5.median(Work::Single) * f);
            println!(
                "the same with the long script (bucket + apply: a call with a lease ask, a share or a record), part 5: {:.1} µs x f_repl {f:.2}",
                p5.median(Work::Script)
            );
            model_table(keys, &model, p5.median(Work::Script) * f);
            println!(
                "the same model for Redis doing the peer's work (one INCR per decision, part 5): {:.1} µs x f_repl {f:.2}",
                p5.median(Work::Incr)
            );
            model_table(keys, &model, p5.median(Work::Incr) * f);
            println!("and with c_primary from the fit above (Redis mostly idle between calls, as part 1 measured it):");
            model_table(keys, &model, c_primary);
            if let Some((_, c_dec)) = fit {
                shared_sidecar_table(
                    args,
                    keys,
                    p5.median(Work::Script) * f,
                    c_dec * f,
                    args.redis_pipeline.unwrap_or(4),
                );
            }
        }
        None => model_table(keys, &model, c_primary),
    }
    println!(
        "Redis cores: D_redis x c_primary, the work itself; primaries above it buy headroom and absorb the busiest shard"
    );
}

/// Decisions per script call of one (sidecar, primary) pair that carries `per_sec` decisions/s,
/// each call taking `call_ms` (the round trip to Redis and its turn there), `pipeline` calls in
/// flight at most: one per call while the calls in flight suffice (Little's law:
/// `per_sec x call_ms` calls are out), then the merged rest, `per_sec x call_ms / pipeline`.
pub(crate) fn batch_of_pair(per_sec: f64, call_ms: f64, pipeline: u64) -> f64 {
    (per_sec * call_ms / 1e3 / pipeline.max(1) as f64).max(1.0)
}

/// The smallest P whose busiest primary stays within `u` when each sidecar serves `per_sidecar`
/// of `gateways`, for `d` decisions/s spread as `by_slot`: the batch per (sidecar, primary) pair
/// grows with the gateways a sidecar serves and shrinks with P, and a primary's cost per decision
/// is `c_at(b) = (c1 - c_dec) / b + c_dec` (its per-call part shared by the batch). The P and the
/// batch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn primaries_shared(
    d: f64,
    by_slot: &[f64],
    gateways: f64,
    per_sidecar: f64,
    c1: f64,
    c_dec: f64,
    call_ms: f64,
    pipeline: u64,
    u: f64,
) -> Option<(usize, f64)> {
    let sidecars = (gateways / per_sidecar).max(1.0);
    (1..=16384).find_map(|p| {
        let busiest = shares_from_slots(by_slot, p)
            .into_iter()
            .fold(0.0, f64::max);
        let pair = d * busiest / sidecars;
        let b = batch_of_pair(pair, call_ms, pipeline);
        let c = (c1 - c_dec).max(0.0) / b + c_dec;
        (d * busiest * c / 1e6 <= u).then_some((p, b))
    })
}

/// The shared-sidecar variant: how the batch per Redis node, and so the primaries, change when one
/// sidecar (per node or zone) serves many gateways, uniform keys, no leases.
pub(crate) fn shared_sidecar_table(
    args: &Args,
    keys: &Keyspace,
    c1: f64,
    c_dec: f64,
    pipeline: u64,
) {
    let call_ms = 1.0;
    println!(
        "shared sidecars: {} gateways, uniform keys, no leases; c_at(b) = ({c1:.1} - {c_dec:.1}) / b + {c_dec:.1} µs, calls of {call_ms} ms, {pipeline} in flight per node",
        args.gateways
    );
    let weights = keys.weights(Dist::Uniform);
    let mut by_slot = vec![0.0; 16384];
    for (w, s) in weights.iter().zip(&keys.slot_id) {
        by_slot[*s as usize] += w;
    }
    let t = Table::new().rights(&[20, 10, 12, 10]).gap(2);
    println!(
        "{}",
        t.line(&[
            "gateways per sidecar",
            "sidecars",
            "batch/node",
            "primaries"
        ])
    );
    let g = args.gateways as f64;
    for per in [1.0, 10.0, 100.0, 1000.0] {
        if per > g {
            break;
        }
        let found = primaries_shared(
            args.target,
            &by_slot,
            g,
            per,
            c1,
            c_dec,
            call_ms,
            pipeline,
            args.utilisation,
        );
        let (p, b) = found.map_or(("none".to_string(), "-".to_string()), |(p, b)| {
            (p.to_string(), format!("{b:.1}"))
        });
        println!(
            "{}",
            t.line(&[
                format!("{per:.0}"),
                format!("{:.0}", (g / per).max(1.0)),
                b,
                p
            ])
        );
    }
}

/// The model's inputs but the cost per decision on a primary.
pub(crate) struct Model {
    pub(crate) target: f64,
    pub(crate) utilisation: f64,
    pub(crate) gateways: f64,
    pub(crate) replicas_per_primary: usize,
    pub(crate) t_ask: f64,
    pub(crate) c_sidecar: f64,
}

/// The model's table (primaries, replicas, cores per key distribution, with and without leases)
/// at `c_primary` µs per decision on a primary.
pub(crate) fn model_table(keys: &Keyspace, m: &Model, c_primary: f64) {
    let (d, u, g, t_ask, c_sidecar) = (m.target, m.utilisation, m.gateways, m.t_ask, m.c_sidecar);
    let t = Table::new()
        .left(40)
        .rights(&[12, 9, 9, 9, 9, 9, 8])
        .gap(2)
        .left(0);
    println!(
        "{}",
        t.line(&[
            "keys",
            "D_redis/s",
            "S(P)",
            "hottest",
            "primaries",
            "replicas",
            "sidecar",
            "Redis"
        ])
    );
    println!("{}", t.line(&["", "", "", "key", "", "", "cores", "cores"]));
    for dist in [Dist::Uniform, Dist::Zipf] {
        for leases in [false, true] {
            let weights = keys.weights(dist);
            let reach: Vec<f64> = weights
                .iter()
                .map(|w| {
                    if leases {
                        lease_reach(d * w / g, t_ask)
                    } else {
                        1.0
                    }
                })
                .collect();
            let reaching: Vec<f64> = weights.iter().zip(&reach).map(|(w, r)| w * r).collect();
            let d_redis = d * reaching.iter().sum::<f64>();
            let total: f64 = reaching.iter().sum();
            let mut by_slot = vec![0.0; 16384];
            for (w, s) in reaching.iter().zip(&keys.slot_id) {
                by_slot[*s as usize] += w / total;
            }
            let max_key = reaching.iter().cloned().fold(0.0, f64::max) / total;
            let p = primaries_needed(d_redis, c_primary, &by_slot, u);
            let busiest = p.map(|p| {
                shares_from_slots(&by_slot, p)
                    .into_iter()
                    .fold(0.0, f64::max)
            });
            let name = format!(
                "{}{}",
                keys.name(dist),
                if leases { ", leases" } else { "" }
            );
            let hottest_key = format!("{:.3}%", max_key * 100.0);
            let sidecar_cores = num((d_redis * c_sidecar / 1e6 / u).ceil(), 0);
            let redis_cores = num(d_redis * c_primary / 1e6, 0);
            let line = match p {
                Some(p) => t.line(&[
                    name,
                    num(d_redis, 0),
                    format!("{:.2}%", busiest.unwrap_or(0.0) * 100.0),
                    hottest_key,
                    p.to_string(),
                    (p * m.replicas_per_primary).to_string(),
                    sidecar_cores,
                    redis_cores,
                ]),
                None => t.line(&[
                    name,
                    num(d_redis, 0),
                    "-".into(),
                    hottest_key,
                    "none".into(),
                    "-".into(),
                    sidecar_cores,
                    redis_cores,
                    format!(
                        "the hottest key alone needs {:.2} primary cores at {:.0}%: no P suffices",
                        d_redis * max_key * c_primary / 1e6 / u,
                        u * 100.0
                    ),
                ]),
            };
            println!("{line}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
