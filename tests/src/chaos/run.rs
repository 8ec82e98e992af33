//! One run: the topology started, the workload and the nemesis carried out for the plan's
//! length, the record checked; and the run's table.

use std::time::{Duration, Instant};

use super::check::{check, Record, Row, Verdict, Violation};
use super::clock_ns;
use super::nemesis::{self, add, Log};
use super::schedule::Plan;
use super::topology::{Topology, RLQS_SIDECAR};
use super::workload::{Sent, Workload};
use crate::wait_until;

/// What one run recorded and what the checker said.
pub struct Outcome {
    pub plan: Plan,
    pub verdict: Verdict,
    pub log: Log,
    pub sent: Vec<Sent>,
    /// Requests the upstream served.
    pub served: usize,
    /// When the workload started (ns of [`super::clock_ns`]): the plan's zero.
    pub zero_ns: u64,
}

impl Outcome {
    pub fn violated(&self) -> bool {
        !self.verdict.violations.is_empty()
    }

    /// The run's report: its plan, what it sent, its table, and each violation with the faults
    /// and reloads around it.
    pub fn report(&self) -> String {
        let mut out = self.plan.describe();
        let (queued, expected, lost, retried, unreported, unreadable) = self.verdict.settlements;
        out += &format!(
            "{} requests, {} served; settlements queued {queued} (expected {expected}), lost {lost}, retried {retried}; costs unreported {unreported} (unreadable answers {unreadable})\n",
            self.sent.len(),
            self.served
        );
        let (opened, most) = self.verdict.rlqs_streams;
        out += &format!("RLQS streams opened {opened} (the faults explain {most})\n");
        let (crashes, unanswered) = self.verdict.rlqs_crashes;
        if crashes > 0 {
            out += &format!(
                "RLQS Envoy crashed {crashes} time(s), Envoy 1.40's own defect (docs/rlqs.md): \
                 {unanswered} requests unanswered until it was restarted\n"
            );
        }
        out += &table(&self.verdict.rows);
        out += &under_by_bucket(&self.verdict.under_by_bucket);
        for v in &self.verdict.violations {
            out += &self.describe(v);
        }
        out
    }

    /// A violation, at plan time (seconds from the start), with what the nemesis did around it.
    pub fn describe(&self, v: &Violation) -> String {
        let s = |ns: u64| ns.saturating_sub(self.zero_ns) as f64 / 1e9;
        let mut out = format!(
            "VIOLATION at {:.3} s (window {:.3} s to {:.3} s): {}\n",
            s(v.at_ns),
            s(v.window.0),
            s(v.window.1),
            v.what
        );
        let near = |t: u64| t + 5_000_000_000 >= v.window.0 && t <= v.at_ns + 1_000_000_000;
        for f in self
            .log
            .faults
            .iter()
            .filter(|f| near(f.start_ns) || near(f.recovered_ns))
        {
            out += &format!(
                "  fault {:?} from {:.3} s to {:.3} s (recovered {:.3} s, failover {})\n",
                f.fault,
                s(f.start_ns),
                s(f.end_ns),
                s(f.recovered_ns),
                f.failover
            );
        }
        for (t, p) in self.log.policies.iter().skip(1).filter(|(t, _)| near(*t)) {
            out += &format!("  policy {p:?} written at {:.3} s\n", s(*t));
        }
        out
    }
}

/// The table of rows: faults, admissions, over-admission against its bound, under-admission,
/// failure-policy answers.
pub fn table(rows: &[Row]) -> String {
    let mut out = format!(
        "{:<32} {:>6} {:>9} {:>10} {:>10} {:>7} {:>7}\n",
        "class", "faults", "admitted", "over", "bound", "under", "503"
    );
    for r in rows {
        out += &format!(
            "{:<32} {:>6} {:>9} {:>10.1} {:>10.1} {:>7} {:>7}\n",
            r.class, r.faults, r.admitted, r.over, r.bound, r.under, r.failed
        );
    }
    out
}

/// The refusals with budget left, by bucket, most first; the RLQS crowd's addresses and the
/// direct caller's new clients each summed as one.
pub fn under_by_bucket(by: &std::collections::BTreeMap<String, usize>) -> String {
    let mut summed = std::collections::BTreeMap::new();
    for (bucket, n) in by {
        let name = match bucket.split_once('/') {
            Some(("per-ip", a)) if !a.starts_with("127.0.0.") => "per-ip/<the RLQS crowd>".into(),
            Some(("direct", a)) if a != "d" => "direct/<new clients>".into(),
            _ => bucket.clone(),
        };
        *summed.entry(name).or_insert(0) += n;
    }
    let mut all: Vec<(&String, &usize)> = summed.iter().collect();
    all.sort_by(|a, b| b.1.cmp(a.1));
    let list: Vec<String> = all.iter().map(|(k, n)| format!("{k} {n}")).collect();
    format!("refused with budget left, by bucket: {}\n", list.join(", "))
}

/// Sums `rows` into `total` (counts added, figures their largest).
pub fn accumulate(total: &mut Vec<Row>, rows: &[Row]) {
    for r in rows {
        match total.iter_mut().find(|t| t.class == r.class) {
            Some(t) => {
                t.faults += r.faults;
                t.admitted += r.admitted;
                if r.over > t.over {
                    t.over = r.over;
                    t.bound = r.bound;
                }
                t.under += r.under;
                t.failed += r.failed;
            }
            None => total.push(r.clone()),
        }
    }
}

/// Runs `plan` on a topology of its own.
pub fn run(plan: &Plan) -> Outcome {
    let mut topology = Topology::start(plan.store_reset, plan.store);
    let ports = topology.listen_ports();
    let (started, zero_ns) = (Instant::now(), clock_ns());
    let workload = Workload::start(
        plan.seed,
        ports,
        topology.sidecar_url(0),
        topology.eu_url(),
        started,
    );
    let log = nemesis::carry_out(plan, &mut topology, started);
    let sent = workload.finish();
    drain(&topology);
    let served = topology.upstream.served();
    let mut counters = log.counters.clone();
    for i in 0..topology.envoys.len() {
        nemesis::add_envoy_counters(&mut counters, &topology, i);
    }
    for i in 0..topology.sidecars.len() {
        let refused = nemesis::calls_refused(&topology, i);
        add(&mut counters, nemesis::CALLS_REFUSED, refused);
    }
    let opened = nemesis::rlqs_streams_opened(&topology, RLQS_SIDECAR);
    add(&mut counters, nemesis::RLQS_STREAMS_OPENED, opened);
    let mut logs = topology.logs();
    logs.extend(log.replaced_logs.iter().cloned());
    let peak: Vec<(String, u64)> = topology
        .processes()
        .into_iter()
        .map(|(name, pid)| (name, peak_rss_kib(pid)))
        .collect();
    let verdict = check(&Record {
        store_reset: plan.store_reset,
        sent: &sent,
        served: &served,
        log: &log,
        counters: &counters,
        logs: &logs,
        peak_rss_kib: &peak,
    });
    // CHAOS_DUMP=<file>: this run's record; CHAOS_KEEP=<dir>: the record of each run that
    // violated, as <dir>/seed-<n> (a long run's violations can be looked at afterwards).
    let path = std::env::var("CHAOS_DUMP").ok().or_else(|| {
        let dir = std::env::var("CHAOS_KEEP").ok()?;
        (!verdict.violations.is_empty()).then(|| format!("{dir}/seed-{}", plan.seed))
    });
    if let Some(path) = path {
        if let Some(dir) = std::path::Path::new(&path).parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        dump(&path, zero_ns, &sent, &served);
        // Numbered: a replaced process's log has the name of its successor.
        for (i, (name, text)) in logs.iter().enumerate() {
            let _ = std::fs::write(format!("{path}.{i}-{}.log", name.replace(' ', "-")), text);
        }
    }
    Outcome {
        plan: plan.clone(),
        verdict,
        log,
        served: served.len(),
        sent,
        zero_ns,
    }
}

/// Waits until the gateways' settlements are all sent or given up: their counters hold still
/// for a second.
fn drain(t: &Topology) {
    let read = || {
        (0..t.envoys.len())
            .flat_map(|i| nemesis::envoy_counters(t, i))
            .map(|(_, v)| v)
            .collect::<Vec<u64>>()
    };
    let mut last = read();
    let mut still_since = Instant::now();
    wait_until("the settlements sent", Duration::from_secs(30), || {
        let now = read();
        if now != last {
            last = now;
            still_since = Instant::now();
        }
        still_since.elapsed() >= Duration::from_secs(1)
    });
}

/// The peak resident memory of `pid` (`VmHWM`), in KiB; 0 when it is gone.
fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// `CHAOS_DUMP=<file>` (or `CHAOS_KEEP=<dir>` for the runs that violate): every request as a line (plan ms sent and answered, the upstream's
/// arrival and done, id, rule, app, status, kind), to look at a violation by hand; each
/// process's log beside it (`<file>.0-sidecar-0.log`, ...).
fn dump(path: &str, zero_ns: u64, sent: &[Sent], served: &[crate::upstream::Served]) {
    use std::fmt::Write;
    let at: std::collections::HashMap<u64, (u64, u64)> = served
        .iter()
        .map(|s| (s.id, (s.arrival_ns, s.done_ns)))
        .collect();
    let ms = |ns: u64| ns.saturating_sub(zero_ns) as f64 / 1e6;
    let mut out = String::new();
    for s in sent {
        let (a, d) = at.get(&s.id).map_or((-1.0, -1.0), |v| (ms(v.0), ms(v.1)));
        let _ = writeln!(
            out,
            "{:.1} {:.1} {a:.1} {d:.1} {} {} {} {} {:?} {:?}",
            ms(s.sent_ns),
            ms(s.answered_ns),
            s.id,
            s.rule,
            s.app,
            s.status,
            s.envoy,
            s.kind
        );
    }
    let _ = std::fs::write(path, out);
}
