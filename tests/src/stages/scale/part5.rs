//! Part 5: one sidecar shared by gateways.

use super::*;

/// Part 5's rounds.
pub(crate) struct Part5 {
    pub(crate) runs: Vec<AtLoad>,
}

impl Part5 {
    /// The median CPU per decision of `work`'s rounds, µs.
    pub(crate) fn median(&self, work: Work) -> f64 {
        let mut v: Vec<f64> = self
            .runs
            .iter()
            .filter(|r| r.work == work)
            .map(|r| r.cpu_us)
            .collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

pub(crate) fn run_part5(args: &Args) -> Part5 {
    println!(
        "\n== 5. Redis held at {:.0}% of a core by {} connections, one decision per call, {} keys ({} rounds of {} s)",
        args.utilisation * 100.0,
        args.load_connections,
        args.keys,
        args.load_rounds,
        args.seconds
    );
    let mut runs = Vec::new();
    for round in 0..args.load_rounds {
        // The order alternates, so drift in the machine's load falls on both alike.
        let order = if round % 2 == 0 {
            [Work::Single, Work::Script, Work::Incr]
        } else {
            [Work::Incr, Work::Script, Work::Single]
        };
        for work in order {
            if INTERRUPTED.load(Ordering::Relaxed) {
                break;
            }
            runs.push(utilisation::measure(
                work,
                args.utilisation,
                args.load_connections,
                args.keys as u64,
                args.seconds,
            ));
        }
    }
    Part5 { runs }
}

pub(crate) fn print_part5(args: &Args, p: &Part5) {
    let t = Table::new().left(40).rights(&[12, 12, 14]).gap(2);
    println!(
        "{}",
        t.line(&["work", "Redis busy", "decisions/s", "Redis µs/dec"])
    );
    for r in &p.runs {
        println!(
            "{}",
            t.line(&[
                r.work.name().to_string(),
                format!("{:.0}%", r.utilisation * 100.0),
                num(r.decisions_per_sec, 0),
                format!("{:.1}", r.cpu_us),
            ])
        );
    }
    let (single, script, incr) = (
        p.median(Work::Single),
        p.median(Work::Script),
        p.median(Work::Incr),
    );
    println!(
        "medians at {:.0}% busy, µs per decision: the lone-decision script {single:.1} ({:.2}x the long script's {script:.1}), INCR {incr:.1} (the lone-decision script {:.1}x, the long one {:.1}x)",
        args.utilisation * 100.0,
        single / script,
        single / incr,
        script / incr,
    );
}

// ---------------------------------------------------------------------------------------------
// Part 4: the model.
