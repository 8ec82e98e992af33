//! Side-by-side runs: RLQS against this project's own path, and the A/B of two filter builds.

use super::*;

/// `--rlqs-only`: Envoy alone, local_ratelimit, the wasm filter as shipped and Envoy's quota
/// filter over RLQS, on the hot key and many keys, each stage once; throughput and whole-stack
/// CPU per request (Envoy, sidecar and Redis).
pub(crate) async fn rlqs_comparison(b: &Bench, workers: u32) {
    println!("\n== RLQS against Envoy alone and the wasm filter, {workers} worker(s)");
    print_header();
    let c = b.args.concurrency;
    let hot = Workload::HotKey;
    let (baseline, _) = b
        .envoy_stage(
            "envoy, no filter (baseline)".into(),
            b.envoy(Filter::None, true, workers),
            hot,
            c,
        )
        .await;
    print(&baseline, None);
    let (local, _) = b
        .envoy_stage(
            "envoy + local_ratelimit (per-Envoy, no shared budget)".into(),
            b.envoy(Filter::LocalRateLimit, true, workers),
            hot,
            c,
        )
        .await;
    print(&local, Some(&baseline));
    for workload in [Workload::HotKey, Workload::ManyKeys] {
        let name = format!("{}: filter as shipped (fast paths)", workload.name());
        let (wasm, callouts) = b
            .envoy_stage(
                name,
                b.envoy(Filter::Wasm(&b.wasm), true, workers),
                workload,
                c,
            )
            .await;
        print(&wasm, Some(&baseline));
        print_note(&format!("callouts per request: {callouts:.3}"));
        let name = format!("{}: Envoy's quota filter (RLQS)", workload.name());
        let (rlqs, _) = b.envoy_stage(name, b.rlqs(workers), workload, c).await;
        print(&rlqs, Some(&baseline));
        println!(
            "[{workers} worker(s)] {}: RLQS {:.0}/s ({:.2}x Envoy alone, {:.2}x local_ratelimit, {:.2}x the wasm filter); whole-stack CPU per request: RLQS {:.1} µs, Envoy alone {:.1}, local_ratelimit {:.1}, wasm filter {:.1}",
            workload.name(),
            rlqs.per_second(),
            rlqs.per_second() / baseline.per_second(),
            rlqs.per_second() / local.per_second(),
            rlqs.per_second() / wasm.per_second(),
            rlqs.stack_cpu(),
            baseline.stack_cpu(),
            local.stack_cpu(),
            wasm.stack_cpu(),
        );
    }
}

/// `--ab-filter`: one workload's stage of the shipped configuration, the current build (A) and
/// `other` (B) in turns after the no-op filter, `--rounds` times; then each build's medians.
pub(crate) async fn ab_filter(b: &Bench, other: &Path) {
    let (workload, workers) = (b.args.ab_workload, b.args.ab_workers);
    println!(
        "\n== A/B: {}, filter as shipped, {workers} worker(s): A = {}, B = {}{}",
        workload.name(),
        b.wasm.display(),
        other.display(),
        if b.args.ab_b_http1 {
            ", its sidecar cluster on HTTP/1.1"
        } else {
            ""
        }
    );
    print_header();
    // The builds take turns going first (a stage right after the no-op one finds every bucket
    // expired in Redis).
    let mut figures = AbFigures::default();
    let floor_workload = floor_of(workload);
    let c = b.args.concurrency;
    for round in 0..b.args.rounds.max(1) {
        let name = format!("round {round}: no-op filter");
        let config = b.envoy(Filter::Noop, true, workers);
        let (floor, _) = b.envoy_stage(name, config, floor_workload, c).await;
        print(&floor, None);
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let (label, wasm) = [("A", b.wasm.as_path()), ("B", other)][i];
            let name = format!("round {round}: {label}");
            let mut config = b.envoy(Filter::Wasm(wasm), true, workers);
            if i == 1 && b.args.ab_b_http1 {
                config = config.replace(
                    "explicit_http_config: { http2_protocol_options: {} }",
                    "explicit_http_config: { http_protocol_options: {} }",
                );
            }
            let (r, callouts) = b.envoy_stage(name, config, workload, c).await;
            print(&r, Some(&floor));
            println!("  {callouts:.4} callouts/request");
            figures.push(i, &r, &floor, callouts);
        }
    }
    figures.print("the no-op filter", true);
}

/// `--ab-sidecar-arg`: one workload's stage of Envoy's native rate limit filter calling the
/// bench's sidecar (A) and one started with those arguments (B), in turns after Envoy without a
/// filter, `--rounds` times; then each one's medians.
pub(crate) async fn ab_sidecar(b: &Bench) {
    let (workload, workers) = (b.args.ab_workload, b.args.ab_workers);
    let other = off_runtime({
        let extra = b.args.ab_sidecar_arg.clone();
        let (redis, policy_args) = (b.redis.url(), b.args.sidecar_arg.clone());
        move || {
            let mut args = vec!["--redis-timeout-ms".to_string(), "1000".into()];
            args.extend(policy_args);
            args.extend(extra);
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            Sidecar::with_policy(&redis, POLICY, &refs)
        }
    })
    .await;
    println!(
        "\n== A/B: {}, Envoy's native filter, {workers} worker(s): A = the sidecar as configured, B = with {}",
        workload.name(),
        b.args.ab_sidecar_arg.join(" ")
    );
    print_header();
    let mut figures = AbFigures::default();
    let floor_workload = floor_of(workload);
    let c = b.args.concurrency;
    for round in 0..b.args.rounds.max(1) {
        let name = format!("round {round}: envoy, no filter");
        let (floor, _) = b
            .envoy_stage(
                name,
                b.envoy(Filter::None, true, workers),
                floor_workload,
                c,
            )
            .await;
        print(&floor, None);
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let (label, sidecar) = [("A", &b.sidecar), ("B", &other)][i];
            let name = format!("round {round}: {label}");
            let config = b.native_to(sidecar, workers);
            let (r, _) = b.envoy_stage_with(name, config, workload, c, sidecar).await;
            print(&r, Some(&floor));
            figures.push(i, &r, &floor, 0.0);
        }
    }
    figures.print("Envoy alone", false);
}

/// The workload a floor is measured with: it admits everything, so for a flood it is measured as
/// the full run does, with the hot key's requests (one key, answered 200).
fn floor_of(workload: Workload) -> Workload {
    match workload {
        Workload::Flood => Workload::HotKey,
        w => w,
    }
}

/// An A/B's figures, per side (A, B) and round: Envoy's CPU per request above the floor, the
/// sidecar's and Redis's, the throughput against the floor's, and callouts per request.
#[derive(Default)]
struct AbFigures([Vec<[f64; 5]>; 2]);

impl AbFigures {
    fn push(&mut self, side: usize, r: &StageResult, floor: &StageResult, callouts: f64) {
        self.0[side].push([
            r.cpu("envoy") - floor.cpu("envoy"),
            r.cpu("sidecar"),
            r.cpu("redis"),
            r.per_second() / floor.per_second(),
            callouts,
        ]);
    }

    /// Each side's medians, above `floor` (named so), with the callouts when they count.
    fn print(&self, floor: &str, callouts: bool) {
        let median_of = |v: &[[f64; 5]], k: usize| median(v.iter().map(|f| f[k]));
        for (label, f) in ["A", "B"].iter().zip(&self.0) {
            let rounds: Vec<String> = f.iter().map(|x| format!("{:.1}", x[0])).collect();
            let calls = if callouts {
                format!(", {:.4} callouts/request", median_of(f, 4))
            } else {
                String::new()
            };
            println!(
                "{label}: medians of {} rounds: Envoy CPU above {floor} {:.1} µs/request (rounds: {}), sidecar {:.1} µs, Redis {:.1} µs per request, {:.2}x {floor}'s throughput{calls}",
                f.len(),
                median_of(f, 0),
                rounds.join(", "),
                median_of(f, 1),
                median_of(f, 2),
                median_of(f, 3),
            );
        }
    }
}
