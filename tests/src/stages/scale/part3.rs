//! Part 3: the latency a network hop adds (network namespaces).

use super::*;

/// The three hosts: gateway, sidecar, Redis, each its own namespace, on two veth links.
pub(crate) const GW_SC: (&str, &str) = ("10.77.1.1", "10.77.1.2");

pub(crate) const SC_RD: (&str, &str) = ("10.77.2.1", "10.77.2.2");

/// How a hop gets its delay.
pub(crate) enum Hop {
    /// `tc netem` on both ends of the link (half the round trip each way).
    Netem { ends: [(usize, &'static str); 2] },
    /// A delay relay the traffic of the hop goes through.
    Relay(DelayRelay),
}

pub(crate) struct LatencyStage {
    pub(crate) name: String,
    pub(crate) rtt_ms: f64,
    pub(crate) hop: &'static str,
    pub(crate) latencies: Vec<Duration>,
    pub(crate) errors: u64,
    pub(crate) rate: f64,
    pub(crate) lateness: Option<(Duration, Duration)>,
}

impl LatencyStage {
    pub(crate) fn q(&self, q: f64) -> Duration {
        quantile(&self.latencies, q)
    }
}

pub(crate) struct Part3 {
    pub(crate) mode: &'static str,
    pub(crate) stages: Vec<LatencyStage>,
}

/// Decisions paced at `rate`/s from the calling thread's namespace to `url` for `seconds` after
/// 0.5 s of warm-up (an open loop: a slow answer does not slow the next send): the sorted
/// latencies of the answered ones, the failed ones, and the rate sent.
pub(crate) fn paced(url: &str, rate: f64, seconds: f64, keys: usize) -> (Vec<Duration>, u64, f64) {
    let http = load::http_client(128, Duration::from_secs(10));
    let url = url.to_string();
    let op = load::op(move |call| {
        let body = format!(
            "{{\"requests\":[{{\"decisions\":[{{\"rule\":\"scale\",\"subject\":{{\"id\":\"{}\"}}}}]}}]}}",
            key_id((mix(call.n + 1) % keys as u64) as usize)
        );
        let req = http
            .post(&url)
            .header("content-type", "application/json")
            .body(body);
        async move {
            let r = req.send().await.map_err(|e| e.to_string())?;
            let status = r.status();
            r.bytes().await.map_err(|e| e.to_string())?;
            match status.as_u16() {
                200 => Ok(()),
                s => Err(format!("status {s}")),
            }
        }
    });
    let warmup = Duration::from_millis(500);
    let (samples, sent) = load::paced(op, rate, warmup, seconds, &INTERRUPTED);
    let mut latencies: Vec<Duration> = samples
        .iter()
        .filter(|s| !s.failed())
        .map(|s| s.latency)
        .collect();
    latencies.sort();
    let errors = samples.iter().filter(|s| s.failed()).count() as u64;
    (latencies, errors, sent)
}

pub(crate) fn run_part3(args: &Args, work: &Workdir) -> Part3 {
    // Declared first, so they are dropped last: every process inside is gone by then.
    let gw = Netns::create("gw");
    let sc = Netns::create("sc");
    let rd = Netns::create("rd");
    netns::link(
        &gw,
        "gw0",
        &format!("{}/24", GW_SC.0),
        &sc,
        "sc0",
        &format!("{}/24", GW_SC.1),
    );
    netns::link(
        &sc,
        "sc1",
        &format!("{}/24", SC_RD.0),
        &rd,
        "rd0",
        &format!("{}/24", SC_RD.1),
    );
    let spaces = [&gw, &sc, &rd];
    let use_netem = match args.delay.as_str() {
        "netem" => true,
        "relay" => false,
        _ => netns::netem(&gw, "gw0", Duration::from_micros(1)).is_ok(),
    };
    if use_netem {
        netns::netem(&gw, "gw0", Duration::ZERO).expect("remove netem");
    }
    let mode = if use_netem { "tc netem" } else { "delay relay" };
    println!(
        "  namespaces {}, {}, {}; delays by {mode}",
        gw.name, sc.name, rd.name
    );

    // Redis in its namespace.
    let redis_dir = tempfile::tempdir().expect("temp dir");
    let mut redis_cmd = rd.command("redis-server");
    redis_cmd
        .current_dir(redis_dir.path())
        .args(["--bind", SC_RD.1, "--port", "6379"])
        .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"]);
    let mut redis = Process::spawn("redis-netns", redis_cmd, redis_dir.path());
    let redis_addr: SocketAddr = format!("{}:6379", SC_RD.1).parse().expect("addr");
    wait_until("redis in its namespace", READY_TIMEOUT, || {
        assert!(redis.running(), "redis exited:\n{}", redis.log());
        sc.run(|| TcpStream::connect_timeout(&redis_addr, Duration::from_millis(200)).is_ok())
    });

    // The hops: relays in the namespace of the far end (what crosses the veth is delayed).
    let sidecar_addr: SocketAddr = format!("{}:8081", GW_SC.1).parse().expect("addr");
    let (to_sidecar, to_redis) = if use_netem {
        (
            Hop::Netem {
                ends: [(0, "gw0"), (1, "sc0")],
            },
            Hop::Netem {
                ends: [(1, "sc1"), (2, "rd0")],
            },
        )
    } else {
        (
            Hop::Relay(DelayRelay::start(
                &sc,
                format!("{}:8082", GW_SC.1).parse().expect("addr"),
                sidecar_addr,
            )),
            Hop::Relay(DelayRelay::start(
                &rd,
                format!("{}:6380", SC_RD.1).parse().expect("addr"),
                redis_addr,
            )),
        )
    };
    let redis_url = match &to_redis {
        Hop::Relay(r) => format!("redis://{}", r.addr),
        Hop::Netem { .. } => format!("redis://{redis_addr}"),
    };
    let sidecar = start_sidecar(
        args,
        work,
        Some(&sc),
        sidecar_addr,
        &["--redis", &redis_url],
        "sidecar-netns",
    );
    let gateway_url = match &to_sidecar {
        Hop::Relay(r) => format!("http://{}/v1/decide", r.addr),
        Hop::Netem { .. } => format!("http://{sidecar_addr}/v1/decide"),
    };
    // Without relays at all (relay mode only): what the relays cost at 0 delay.
    let direct = (!use_netem).then(|| {
        let addr: SocketAddr = format!("{}:8083", GW_SC.1).parse().expect("addr");
        let p = start_sidecar(
            args,
            work,
            Some(&sc),
            addr,
            &["--redis", &format!("redis://{redis_addr}")],
            "sidecar-netns-direct",
        );
        (p, format!("http://{addr}/v1/decide"))
    });

    // A second sidecar with more script calls in flight, behind a hop of its own to the
    // gateway (undelayed), sharing the delayed hop to Redis.
    let alt_pipeline = args.alt_pipeline.to_string();
    let alt = (args.alt_pipeline > 0).then(|| {
        let addr: SocketAddr = format!("{}:8084", GW_SC.1).parse().expect("addr");
        let p = start_sidecar(
            args,
            work,
            Some(&sc),
            addr,
            &["--redis", &redis_url, "--redis-pipeline", &alt_pipeline],
            "sidecar-netns-pipeline",
        );
        let relay = (!use_netem).then(|| {
            DelayRelay::start(
                &sc,
                format!("{}:8085", GW_SC.1).parse().expect("addr"),
                addr,
            )
        });
        let url = match &relay {
            Some(r) => format!("http://{}/v1/decide", r.addr),
            None => format!("http://{addr}/v1/decide"),
        };
        (p, relay, url)
    });

    let set = |hop: &Hop, rtt: Duration| match hop {
        Hop::Relay(r) => r.set_round_trip(rtt),
        Hop::Netem { ends } => {
            for (space, dev) in ends {
                netns::netem(spaces[*space], dev, rtt / 2).expect("tc netem");
            }
        }
    };
    let lateness = |hops: [&Hop; 2]| -> Option<(Duration, Duration)> {
        let mut worst: Option<(Duration, Duration)> = None;
        for hop in hops {
            if let Hop::Relay(r) = hop {
                let (mean, max, _) = r.lateness();
                worst = Some(match worst {
                    None => (mean, max),
                    Some((m, x)) => (m.max(mean), x.max(max)),
                });
            }
        }
        worst
    };
    let mut stages = Vec::new();
    let mut stage = |name: String, hop: &'static str, rtt_ms: f64, url: &str| {
        check_interrupted();
        println!("  latency: {name}");
        lateness([&to_sidecar, &to_redis]);
        let (latencies, errors, rate) =
            gw.run(|| paced(url, args.latency_rate, args.latency_seconds, args.keys));
        check_interrupted();
        stages.push(LatencyStage {
            name,
            rtt_ms,
            hop,
            latencies,
            errors,
            rate,
            lateness: lateness([&to_sidecar, &to_redis]),
        });
    };
    if let Some((_, url)) = &direct {
        stage("no relay (veth only)".into(), "-", 0.0, url);
    }
    stage(
        format!("{} at 0", if use_netem { "no netem" } else { "relays" }),
        "baseline",
        0.0,
        &gateway_url,
    );
    for (hop, label, name) in [
        (&to_sidecar, "gateway-sidecar", "gateway ↔ sidecar"),
        (&to_redis, "sidecar-redis", "sidecar ↔ Redis"),
    ] {
        for &rtt in &args.rtt_ms {
            set(hop, Duration::from_secs_f64(rtt / 1e3));
            stage(format!("{name}, rtt {rtt} ms"), label, rtt, &gateway_url);
        }
        set(hop, Duration::ZERO);
    }
    if let Some((_, _, url)) = &alt {
        for &rtt in &args.rtt_ms {
            set(&to_redis, Duration::from_secs_f64(rtt / 1e3));
            stage(
                format!(
                    "sidecar ↔ Redis, rtt {rtt} ms, --redis-pipeline {}",
                    args.alt_pipeline
                ),
                "sidecar-redis-pipeline",
                rtt,
                url,
            );
        }
        set(&to_redis, Duration::ZERO);
    }
    drop(alt);
    drop(direct);
    drop(sidecar);
    drop(to_sidecar);
    drop(to_redis);
    drop(redis);
    Part3 { mode, stages }
}

pub(crate) fn print_part3(args: &Args, part: &Part3) {
    println!(
        "\n== 3. decision latency over real hops: gateway (this load generator), sidecar and Redis in three network namespaces on veth links;\n\
         one hop at a time delayed by {} (half the round trip each way); {:.0} decisions/s paced, {} s per stage; sidecar --redis-timeout-ms 1000",
        part.mode, args.latency_rate, args.latency_seconds
    );
    let t = Table::new().left(50).rights(&[8, 9, 9, 9, 10, 10, 10, 16]);
    println!(
        "{}",
        t.line(&[
            "delay",
            "sent/s",
            "p50",
            "p95",
            "p99",
            "+p50",
            "+p95",
            "+p99",
            "relay late mean/max"
        ])
    );
    let base = part.stages.iter().find(|s| s.hop == "baseline");
    for s in &part.stages {
        let plus = |q: f64| match base {
            Some(b) if s.hop != "baseline" && s.hop != "-" => {
                let d = s.q(q).as_secs_f64() - b.q(q).as_secs_f64();
                format!("{:+.3}ms", d * 1e3)
            }
            _ => String::new(),
        };
        let line = t.line(&[
            s.name.clone(),
            num(s.rate, 0),
            short(s.q(0.5)),
            short(s.q(0.95)),
            short(s.q(0.99)),
            plus(0.5),
            plus(0.95),
            plus(0.99),
            s.lateness
                .map(|(m, x)| format!("{}/{}", short(m), short(x)))
                .unwrap_or_default(),
        ]);
        match s.errors {
            0 => println!("{line}"),
            n => println!("{line}  ({n} failed)"),
        }
    }
    println!("+pNN: added to the baseline's percentile; relay late: how much later than due the relays wrote (their own cost on top of the delay)");
    for hop in ["gateway-sidecar", "sidecar-redis", "sidecar-redis-pipeline"] {
        let per_ms: Vec<String> = part
            .stages
            .iter()
            .filter(|s| s.hop == hop && s.rtt_ms > 0.0)
            .filter_map(|s| {
                let b = base?;
                let added = (s.q(0.5).as_secs_f64() - b.q(0.5).as_secs_f64()) * 1e3;
                Some(format!("{:.2}x at {} ms", added / s.rtt_ms, s.rtt_ms))
            })
            .collect();
        if per_ms.is_empty() {
            continue;
        }
        println!(
            "{hop}: p50 added per ms of round trip: {}",
            per_ms.join(", ")
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Part 5: Redis held at the model's utilisation.
