//! Scenarios 3, 5 and 6: Redis slow and down per `on_error`, uncertain results, a sidecar restart.

use super::*;

pub(crate) fn redis_outage(a: &Args) -> Vec<Row> {
    let (em_capacity, em_refill) = (20u64, 2.0);
    let mut redis = Redis::start();
    let policy = "rules:\n  allow: {capacity: 100000, refill_per_sec: 10000}\n  deny: {capacity: 100000, refill_per_sec: 10000}\n  local: {capacity: 100000, refill_per_sec: 10000}\n";
    let sidecar = Sidecar::with_policy(&redis.url(), policy, &[]);
    let upstream = Upstream::start();
    let rules = json!([
        rule("allow", "/allow/", &["ip"], "allow"),
        rule("deny", "/deny/", &["ip"], "deny"),
        with_emergency(
            rule("local", "/local/", &["ip"], "local"),
            em_capacity,
            em_refill
        )
    ]);
    // Leases off: what is admitted during the fault is the policy's doing alone (with leases, a
    // gateway also admits, exactly, from a lease it held when the fault began, for at most the
    // lease's ttl_ms).
    let p = plugin(rules, FILTER_TIMEOUT_MS).leases(false);
    let e = envoy(&sidecar, &upstream, &p);
    let per = (a.clients / 3).max(1);
    let names = ["allow", "deny", "local"];
    let groups: Vec<Clients> = names
        .iter()
        .enumerate()
        .map(|(g, n)| Clients::new(g, per, &[e.url(&format!("/{n}/x"))]))
        .collect();
    let d = Duration::from_secs(a.seconds);
    log("3: Redis outage, load");
    let load = start_load(groups);
    sleep(Duration::from_secs(1));
    let em0 = emergency_admits(&[&e]);
    let frozen_at = load.now();
    redis.process.signal(Signal::SIGSTOP);
    sleep(d);
    redis.process.signal(Signal::SIGCONT);
    let thawed_at = load.now();
    let em1 = emergency_admits(&[&e]);
    sleep(Duration::from_secs(2));
    let em2 = emergency_admits(&[&e]);
    let stopped_at = load.now();
    redis.stop();
    sleep(d);
    let restarting_at = load.now();
    redis.restart();
    let em3 = emergency_admits(&[&e]);
    sleep(Duration::from_secs(2));
    let end = load.now();
    let samples = load.finish();
    let mut rows = Vec::new();
    for (fault, from, until, back, next, em) in [
        (
            format!("Redis frozen (SIGSTOP) {} s", a.seconds),
            frozen_at,
            thawed_at,
            thawed_at,
            stopped_at,
            em1 - em0,
        ),
        (
            format!("Redis stopped {} s, restarted empty", a.seconds),
            stopped_at,
            restarting_at,
            restarting_at,
            end,
            em3 - em2,
        ),
    ] {
        let outage = (until - from).as_secs_f64();
        let rec = recovery(&samples, 1, back, next);
        // Failing up to the window's end (within two filter timeouts of it) is no recovery time:
        // the decisions were still failing when it ended.
        let window = next.saturating_sub(back);
        let recovered = if rec + 2 * Duration::from_millis(FILTER_TIMEOUT_MS) >= window {
            format!(
                "still failing {} after Redis was back (the window's end)",
                ms(window)
            )
        } else {
            format!("{} after Redis is back (resumed / restart began)", ms(rec))
        };
        for (g, name) in names.iter().enumerate() {
            let window: Vec<&Sample> = samples
                .iter()
                .filter(|s| s.group == g && s.at >= from && s.done() < until)
                .collect();
            let f = figures(window.iter().copied());
            let (over, check) = match *name {
                "allow" => (
                    "unbounded (fail open)".to_string(),
                    format!(
                        "admits all {} {}",
                        f.admitted,
                        mark(f.admitted + f.errors == f.n)
                    ),
                ),
                "deny" => (
                    "0".to_string(),
                    format!("admitted 0 {}", mark(f.admitted == 0)),
                ),
                _ => {
                    let bound = em_capacity as f64 + em_refill * outage;
                    (
                        format!("{em} emergency (≤ N·(C_e + r_e·t) = {bound:.0})"),
                        format!(
                            "emergency admits {em} ≤ {bound:.0} {}",
                            mark(em as f64 <= bound)
                        ),
                    )
                }
            };
            rows.push(Row {
                scenario: format!("3 Redis outage, on_error {name}"),
                load: format!(
                    "{per} clients on /{name}/ (leases off), {} req sent and answered during the fault",
                    f.n
                ),
                fault: fault.clone(),
                admitted: f.admitted.to_string(),
                rejected: f.rejected.to_string(),
                over,
                client: p50_p99(&f),
                filter: String::new(),
                errors: errors_by_kind(window.iter().copied()),
                recovery: if *name == "deny" {
                    recovered.clone()
                } else {
                    String::new()
                },
                // The decision time is printed, not judged: the filter gives up at its timeout,
                // but a saturated machine adds its own scheduling delay on top.
                check: format!("{check}; the filter's timeout is {FILTER_TIMEOUT_MS} ms"),
            });
        }
    }
    drop(sidecar);
    rows
}

// ---------------------------------------------------------------------------------------------
// 4. Failover under load: Sentinel, and Cluster with a replica per primary.

pub(crate) fn uncertain(a: &Args) -> Vec<Row> {
    let capacity = 10_000.0;
    let redis = Redis::start();
    let proxy = FaultProxy::start(redis.port);
    let policy = format!("rules:\n  once: {{capacity: {capacity}, refill_per_sec: 0.001}}\n");
    let sidecar = Sidecar::start_with_args(&policy, &["--redis", &proxy.url()]);
    let c = http();
    let url = format!("{}/v1/decide", sidecar.base_url());
    let mut conn = redis.connection();
    let mut rows = Vec::new();
    for (same_attempt, label) in [(true, "same attempt id"), (false, "a new attempt id")] {
        let id = if same_attempt { "same" } else { "new" };
        let key = format!("rl:{{ratelimit|rule=once|id={id}}}");
        let body = |attempt: &str| {
            json!({"attempt": attempt,
                   "requests": [{"decisions": [{"rule": "once", "subject": {"id": id}, "cost": 1}]}]})
        };
        let mut latencies = Vec::new();
        let (mut first_failed, mut repeats, mut answered, mut errors) = (0, 0, 0, 0);
        log(&format!("5: lost replies, repeat with {label}"));
        let started = Instant::now();
        for i in 0..a.lost {
            let lost_before = proxy.lost();
            proxy.lose_replies(1);
            let attempt = format!("{id}-{i}");
            let t = Instant::now();
            let status = c
                .post(&url)
                .json(&body(&attempt))
                .send()
                .map_or(0, |r| r.status().as_u16());
            latencies.push(t.elapsed());
            if status != 200 {
                first_failed += 1;
            }
            // Bounded: the connection is closed once Redis has answered.
            let wait = Instant::now() + Duration::from_secs(5);
            while proxy.lost() == lost_before && Instant::now() < wait {
                sleep(Duration::from_millis(1));
            }
            // The caller repeats until it gets an answer (bounded).
            let repeat = if same_attempt {
                attempt.clone()
            } else {
                format!("{attempt}-retry")
            };
            let wait = Instant::now() + Duration::from_secs(10);
            loop {
                repeats += 1;
                let t = Instant::now();
                let r = c.post(&url).json(&body(&repeat)).send();
                latencies.push(t.elapsed());
                match r.map(|r| r.status().as_u16()) {
                    Ok(200) => {
                        answered += 1;
                        break;
                    }
                    _ if Instant::now() > wait => break,
                    _ => errors += 1,
                }
                sleep(Duration::from_millis(5));
            }
        }
        let elapsed = started.elapsed();
        let charged =
            stored(&mut conn, &key).map_or(0.0, |(tokens, _, _)| (capacity - tokens).round());
        let decisions = a.lost as f64;
        latencies.sort();
        let pick = |q: f64| quantile(&latencies, q);
        let over_charge = charged - decisions;
        rows.push(Row {
            scenario: format!("5 uncertain result, repeat with {label}"),
            load: format!(
                "{} decisions straight to the sidecar, each reply lost once, repeated until answered ({repeats} repeats, {} in all)",
                a.lost,
                ms(elapsed)
            ),
            fault: "proxy drops the script's reply after Redis applied it (connection closed)".into(),
            admitted: format!("{answered} answered allowed"),
            rejected: "0".into(),
            over: if same_attempt {
                "0".into()
            } else {
                format!("0 (but {over_charge} tokens charged twice: under-admission)")
            },
            client: format!("{} / {}", ms(pick(0.5)), ms(pick(0.99))),
            filter: String::new(),
            errors: format!("{first_failed} lost answers (503), {errors} failed repeats"),
            recovery: String::new(),
            check: if same_attempt {
                format!(
                    "charged {charged} for {decisions} decisions: once {}",
                    mark(charged == decisions)
                )
            } else {
                format!(
                    "charged {charged} for {decisions} decisions (twice without the id) {}",
                    mark(charged == 2.0 * decisions)
                )
            },
        });
    }
    rows
}

// ---------------------------------------------------------------------------------------------
// 6. Sidecar killed and restarted under load.

pub(crate) fn sidecar_restart(a: &Args) -> Vec<Row> {
    let (capacity, refill) = (100.0, 50.0);
    let (em_capacity, em_refill) = (10u64, 1.0);
    let redis = Redis::start();
    let policy = format!(
        "rules:\n  per-app: {{capacity: {capacity}, refill_per_sec: {refill}}}\n  probe: {{capacity: 100000, refill_per_sec: 10000}}\n"
    );
    let mut sidecar = Sidecar::with_policy(&redis.url(), &policy, &[]);
    let upstream = Upstream::start();
    let rules = json!([
        with_emergency(
            rule("per-app", "/api/", &["app"], "local"),
            em_capacity,
            em_refill
        ),
        rule("probe", "/probe/", &["ip"], "deny")
    ]);
    let e = envoy(&sidecar, &upstream, &plugin(rules, FILTER_TIMEOUT_MS));
    log("6: sidecar restart, load");
    let load = start_load(vec![
        Clients::new(0, a.clients, &[e.url("/api/x")]).header("x-api-key", "alpha-key"),
        Clients::new(1, 1, &[e.url("/probe/x")]).pause(Duration::from_millis(10)),
    ]);
    sleep(Duration::from_secs(a.seconds));
    let em0 = emergency_admits(&[&e]);
    let killed_at = load.now();
    sidecar.process.stop();
    sleep(Duration::from_secs(a.seconds));
    let restart_at = load.now();
    let port = sidecar.port;
    sidecar = Sidecar::start_on(port, &redis.url(), &policy, &[]);
    let ready_at = load.now();
    let em1 = emergency_admits(&[&e]);
    sleep(Duration::from_secs(2));
    let samples = load.finish();
    let outage = (restart_at - killed_at).as_secs_f64();
    let during: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.group == 0 && s.at >= killed_at && s.at < ready_at)
        .collect();
    let f = figures(during.iter().copied());
    let all = figures(samples.iter().filter(|s| s.group == 0));
    let em = em1 - em0;
    let em_bound = em_capacity as f64 + em_refill * (ready_at - killed_at).as_secs_f64();
    let bound = capacity + refill * all.span.as_secs_f64();
    let by_sidecar = all.admitted as f64 - (emergency_admits(&[&e]) as f64);
    let rec = recovery(&samples, 1, restart_at, Duration::MAX);
    let probe_failures: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.group == 1 && s.at >= killed_at && s.failed())
        .collect();
    let first_failure = probe_failures.iter().map(|s| s.done()).min();
    let last_failure = probe_failures.iter().map(|s| s.done()).max();
    drop(sidecar);
    vec![Row {
        scenario: "6 sidecar restart".into(),
        load: format!(
            "{} clients on 1 key ({capacity} + {refill}/s), on_error local (emergency {em_capacity} + {em_refill}/s); {} req during the outage",
            a.clients, f.n
        ),
        fault: format!("sidecar killed (SIGKILL), restarted after {outage:.1} s"),
        admitted: format!("{} during the outage ({em} by the emergency bucket)", f.admitted),
        rejected: f.rejected.to_string(),
        over: format!(
            "{} by decisions (≤ {bound:.0}); {em} emergency",
            (by_sidecar - bound.floor()).max(0.0)
        ),
        client: p50_p99(&f),
        filter: String::new(),
        errors: errors_by_kind(during.iter().copied()),
        recovery: format!(
            "{} after the restart began (ready {} after it); probe (on_error deny) failed from {} after the kill to {} after it",
            ms(rec),
            ms(ready_at - restart_at),
            first_failure.map_or("—".into(), |t| ms(t.saturating_sub(killed_at))),
            last_failure.map_or("—".into(), |t| ms(t.saturating_sub(killed_at)))
        ),
        check: format!(
            "emergency admits {em} ≤ N·(C_e + r_e·t) = {em_bound:.0} {}; decisions {by_sidecar} ≤ {bound:.0} {}",
            mark(em as f64 <= em_bound),
            mark(by_sidecar <= bound.floor())
        ),
    }]
}

// ---------------------------------------------------------------------------------------------
// 7. Flood: one key far over its limit.
