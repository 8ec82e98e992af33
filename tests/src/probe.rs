//! What the processes say about themselves, for the measuring binaries (`make bench`, `make
//! scale`, `make reliability`): CPU time from /proc (a cost per operation whatever the number of
//! cores), Redis's `INFO` (script calls, writes, memory, keys), Envoy's stats and the sidecar's
//! metrics.
//!
//! Every probe is blocking, and none uses reqwest's blocking client, so a binary may call one on
//! a tokio worker (inside `block_in_place`, or between stages): that client, called on a
//! runtime's own thread, can wait forever for a wake-up the blocked runtime defers.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::{Envoy, Redis};

// ---------------------------------------------------------------------------------------------
// CPU from /proc.

/// The kernel's clock ticks per second (`getconf CLK_TCK`, asked once).
pub fn clock_ticks_per_second() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// The CPU time (user + system) a process has used so far, in seconds.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may contain spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = [11, 12] // utime, stime (fields 14 and 15 counted from the pid)
        .iter()
        .filter_map(|i| fields.get(*i).and_then(|v| v.parse::<f64>().ok()))
        .sum();
    ticks / clock_ticks_per_second()
}

/// CPU seconds the whole machine has been busy (all cores, from /proc/stat).
pub fn machine_busy_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal: busy = all but idle and iowait.
    let total: f64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0.0) + v.get(4).copied().unwrap_or(0.0);
    (total - idle) / clock_ticks_per_second()
}

/// The CPU's model name (`model name` of /proc/cpuinfo).
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// A process whose CPU time a stage attributes to it, by name.
#[derive(Clone, Debug)]
pub struct Watched {
    pub name: String,
    pub pid: u32,
}

impl Watched {
    pub fn new(name: impl Into<String>, pid: u32) -> Watched {
        Watched {
            name: name.into(),
            pid,
        }
    }
}

/// CPU seconds used during a window.
#[derive(Clone, Debug, Default)]
pub struct CpuUse {
    /// By each watched process, in the order they were watched.
    pub by_process: Vec<(String, f64)>,
    /// By this process (the load generator, and whatever else runs in it: the demo upstream).
    pub own: f64,
    /// By the whole machine.
    pub machine: f64,
}

impl CpuUse {
    /// The seconds of the processes named `name` (0 when none is).
    pub fn of(&self, name: &str) -> f64 {
        self.by_process
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, c)| c)
            .sum()
    }

    /// Whether a process of that name was watched.
    pub fn watched(&self, name: &str) -> bool {
        self.by_process.iter().any(|(n, _)| n == name)
    }

    /// Cores busy with processes this run did not start (the contention), over `seconds`.
    pub fn others_cores(&self, seconds: f64) -> f64 {
        let ours: f64 = self.by_process.iter().map(|(_, c)| c).sum::<f64>() + self.own;
        ((self.machine - ours) / seconds).max(0.0)
    }
}

/// CPU times read at the start of a window, to be read again at its end.
pub struct CpuMeter {
    watched: Vec<Watched>,
    before: Vec<f64>,
    own: f64,
    machine: f64,
}

impl CpuMeter {
    pub fn start(watched: &[Watched]) -> CpuMeter {
        CpuMeter {
            watched: watched.to_vec(),
            before: watched.iter().map(|w| cpu_seconds(w.pid)).collect(),
            own: cpu_seconds(std::process::id()),
            machine: machine_busy_seconds(),
        }
    }

    /// What each process used since [`CpuMeter::start`].
    pub fn stop(self) -> CpuUse {
        CpuUse {
            by_process: self
                .watched
                .iter()
                .zip(self.before)
                .map(|(w, before)| (w.name.clone(), cpu_seconds(w.pid) - before))
                .collect(),
            own: cpu_seconds(std::process::id()) - self.own,
            machine: machine_busy_seconds() - self.machine,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Redis: INFO.

/// `INFO` text as field/value pairs (`used_memory` -> `1234`; `cmdstat_get` -> `calls=...`).
pub fn parse_info(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter_map(|l| l.trim().split_once(':'))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `INFO <section>` of a Redis as field/value pairs.
pub fn info(redis: &Redis, section: &str) -> HashMap<String, String> {
    parse_info(&redis.cli(&["INFO", section]))
}

/// One numeric field of `INFO <section>`, 0 when absent.
pub fn info_number(redis: &Redis, section: &str, field: &str) -> f64 {
    info(redis, section)
        .get(field)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// One command's line of `INFO commandstats` (since the start or `CONFIG RESETSTAT`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommandStats {
    pub calls: f64,
    /// µs spent in the command, all calls together.
    pub usec: f64,
    pub usec_per_call: f64,
}

impl CommandStats {
    /// The value of a `cmdstat_<name>` field: `calls=5,usec=120,usec_per_call=24.00,...`.
    pub fn parse(value: &str) -> CommandStats {
        let field = |name: &str| -> f64 {
            value
                .split(',')
                .find_map(|kv| {
                    kv.strip_prefix(name)?
                        .strip_prefix('=')?
                        .trim()
                        .parse()
                        .ok()
                })
                .unwrap_or(0.0)
        };
        CommandStats {
            calls: field("calls"),
            usec: field("usec"),
            usec_per_call: field("usec_per_call"),
        }
    }
}

/// The `INFO commandstats` line of each of `commands` (lower case: `evalsha`), 0s for a command
/// that never ran.
pub fn command_stats(redis: &Redis, commands: &[&str]) -> Vec<CommandStats> {
    let stats = info(redis, "commandstats");
    commands
        .iter()
        .map(|c| {
            stats
                .get(&format!("cmdstat_{c}"))
                .map_or_else(CommandStats::default, |v| CommandStats::parse(v))
        })
        .collect()
}

/// Script calls a node has run (`EVALSHA`, and the `EVAL` that heals a NOSCRIPT) and the µs it
/// spent inside them; the rest of its CPU is reading, parsing and answering commands.
pub fn script_calls(redis: &Redis) -> CommandStats {
    command_stats(redis, &["evalsha", "eval"])
        .into_iter()
        .fold(CommandStats::default(), |a, b| CommandStats {
            calls: a.calls + b.calls,
            usec: a.usec + b.usec,
            usec_per_call: 0.0,
        })
}

/// Calls of the commands that write (what the bucket script may call).
pub fn write_calls(redis: &Redis) -> u64 {
    let writes = [
        "set",
        "del",
        "pexpireat",
        "expire",
        "pexpire",
        "hset",
        "setex",
        "psetex",
    ];
    command_stats(redis, &writes)
        .iter()
        .map(|s| s.calls as u64)
        .sum()
}

/// Seconds of CPU Redis has used so far (user + system, from `INFO cpu`).
pub fn redis_cpu_seconds(redis: &Redis) -> f64 {
    let i = info(redis, "cpu");
    let get = |k: &str| {
        i.get(k)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_default()
    };
    get("used_cpu_user") + get("used_cpu_sys")
}

/// `used_memory` of `INFO memory`, in bytes.
pub fn used_memory(redis: &Redis) -> i64 {
    info_number(redis, "memory", "used_memory") as i64
}

/// The keys a node holds.
pub fn dbsize(redis: &Redis) -> u64 {
    redis.cli(&["DBSIZE"]).trim().parse().unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// HTTP: Envoy's admin, the sidecar's metrics.

/// `GET <path>` over a plain HTTP/1.1 connection from the calling thread (so from its network
/// namespace): the status and the body (chunked or not), None on any failure.
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: probe\r\nconnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    // A read that times out after part of the answer leaves what came.
    let _ = s.read_to_end(&mut raw);
    parse_response(&raw)
}

/// An HTTP/1.1 response read to its end: the status and the body, decoded when chunked.
fn parse_response(raw: &[u8]) -> Option<(u16, String)> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let chunked = head.lines().any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked")
        })
    });
    if !chunked {
        return Some((status, body.to_string()));
    }
    let mut out = String::new();
    let mut rest = body;
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some((status, out));
        }
        out.push_str(after.get(..size)?);
        rest = after.get(size..)?.strip_prefix("\r\n")?;
    }
}

/// The sum of the values of the `name: value` lines whose name ends with `suffix`.
fn sum_stats(text: &str, suffix: &str) -> f64 {
    text.lines()
        .filter_map(|l| l.split_once(": "))
        .filter(|(k, _)| k.ends_with(suffix))
        .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
        .sum()
}

/// The sum of the Envoy stats whose name ends with `suffix` (e.g. `ratelimit.callouts`), 0 when
/// none answers.
pub fn envoy_stat(envoy: &Envoy, suffix: &str) -> f64 {
    let admin = ([127, 0, 0, 1], envoy.admin_port).into();
    http_get(admin, "/stats?filter=ratelimit").map_or(0.0, |(_, body)| sum_stats(&body, suffix))
}

/// The sum of the values of the metric lines starting with `prefix`.
fn sum_metrics(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The sum of the sidecar's `/metrics` lines starting with `prefix` (e.g.
/// `ratelimit_decisions_total{limit="hot"`), 0 when it does not answer.
pub fn sidecar_metric(addr: SocketAddr, prefix: &str) -> f64 {
    http_get(addr, "/metrics").map_or(0.0, |(_, body)| sum_metrics(&body, prefix))
}

/// The filter's `decision_us` histogram (p50, p99 in µs) once Envoy has merged every callout
/// into it (histograms are merged at each stats flush, every 5 s by default; waits up to 7 s).
pub fn filter_decision_us(envoy: &Envoy) -> Option<(f64, f64)> {
    let admin: SocketAddr = ([127, 0, 0, 1], envoy.admin_port).into();
    let callouts = envoy_stat(envoy, "ratelimit.callouts") as u64;
    let deadline = Instant::now() + Duration::from_secs(7);
    loop {
        let text = http_get(admin, "/stats/prometheus?filter=decision_us")
            .map(|(_, b)| b)
            .unwrap_or_default();
        let count: u64 = text
            .lines()
            .find(|l| l.contains("decision_us_count"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if count >= callouts || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let (_, body) = http_get(admin, "/stats?format=json&filter=decision_us")?;
    histogram_p50_p99(&serde_json::from_str(&body).ok()?, "decision_us")
}

/// p50 and p99 of the histogram whose name ends with `suffix` in Envoy's `/stats?format=json`.
fn histogram_p50_p99(stats: &serde_json::Value, suffix: &str) -> Option<(f64, f64)> {
    for stat in stats["stats"].as_array()? {
        let h = &stat["histograms"];
        let Some(quantiles) = h["supported_quantiles"].as_array() else {
            continue;
        };
        let at = |q: f64| quantiles.iter().position(|x| x.as_f64() == Some(q));
        let (i50, i99) = (at(50.0)?, at(99.0)?);
        for computed in h["computed_quantiles"].as_array()? {
            if computed["name"]
                .as_str()
                .is_some_and(|n| n.ends_with(suffix))
            {
                let values = computed["values"].as_array()?;
                let get = |i: usize| values.get(i)?["cumulative"].as_f64();
                return Some((get(i50)?, get(i99)?));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_fields_and_command_stats_parse() {
        let text = "# Stats\r\nexpired_keys:12\r\n\r\n# Commandstats\r\n\
                    cmdstat_evalsha:calls=5,usec=120,usec_per_call=24.00,rejected_calls=0,failed_calls=1\r\n";
        let info = parse_info(text);
        assert_eq!(info["expired_keys"], "12");
        assert_eq!(
            CommandStats::parse(&info["cmdstat_evalsha"]),
            CommandStats {
                calls: 5.0,
                usec: 120.0,
                usec_per_call: 24.0
            }
        );
        assert_eq!(CommandStats::parse(""), CommandStats::default());
    }

    #[test]
    fn responses_are_read_plain_and_chunked() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello";
        assert_eq!(parse_response(plain), Some((200, "hello".into())));
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                        6\r\na.b: 1\r\n7\r\n\nc.b: 2\r\n0\r\n\r\n";
        let (status, body) = parse_response(chunked).unwrap();
        assert_eq!((status, body.as_str()), (200, "a.b: 1\nc.b: 2"));
        assert_eq!(sum_stats(&body, ".b"), 3.0);
        assert_eq!(
            parse_response(b"HTTP/1.1 200 OK\r\n"),
            None,
            "no end of head"
        );
    }

    #[test]
    fn stats_and_metrics_are_summed_by_suffix_and_prefix() {
        let stats = "wasmcustom.ratelimit.admitted: 7\nwasmcustom.ratelimit.lease_admitted: 5\n\
                     wasmcustom.ratelimit.rule.hot.admitted: 3\n";
        assert_eq!(sum_stats(stats, "ratelimit.admitted"), 7.0);
        let metrics = "# HELP x\nratelimit_decisions_total{limit=\"hot\",result=\"admitted\"} 4\n\
                       ratelimit_decisions_total{limit=\"hot\",result=\"rejected\"} 2\n\
                       ratelimit_decisions_total{limit=\"many\",result=\"admitted\"} 9\n";
        assert_eq!(sum_metrics(metrics, "ratelimit_decisions_total"), 15.0);
        assert_eq!(
            sum_metrics(metrics, "ratelimit_decisions_total{limit=\"hot\""),
            6.0
        );
    }

    #[test]
    fn the_histogram_quantiles_are_found_by_name() {
        let stats = serde_json::json!({"stats": [
            {"name": "x", "value": 1},
            {"histograms": {"supported_quantiles": [0.0, 50.0, 99.0],
             "computed_quantiles": [
                {"name": "other", "values": [{"cumulative": 1}, {"cumulative": 2}, {"cumulative": 3}]},
                {"name": "wasmcustom.ratelimit.decision_us",
                 "values": [{"cumulative": 10}, {"cumulative": 800}, {"cumulative": 4000}]}
             ]}}
        ]});
        assert_eq!(
            histogram_p50_p99(&stats, "decision_us"),
            Some((800.0, 4000.0))
        );
        assert_eq!(histogram_p50_p99(&stats, "missing"), None);
    }
}
