//! The load generator of the measuring binaries (`make bench`, `make scale`, `make
//! reliability`): groups of callers in a closed loop, each calling its operation again as soon as
//! the last call came back (or after a pause), every call recorded as a [`Sample`]; a measured
//! window over such a loop ([`ClosedLoop`]); and decisions paced at a fixed rate ([`paced`]), an
//! open loop for latency.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::probe::{CpuMeter, CpuUse, Watched};
use crate::report::quantile;

/// What one call of an [`Op`] came back with.
pub trait Outcome: Send + 'static {
    /// The call did not do what the stage asks of it (an error, an unexpected answer).
    fn failed(&self) -> bool;
}

/// A call that did what its stage expects, or why not.
impl Outcome for Result<(), String> {
    fn failed(&self) -> bool {
        self.is_err()
    }
}

/// An HTTP status as the client saw it, 0 when no answer came (the request failed or timed out
/// at the client). Admitted (200) and rejected (429) are answers; anything else failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Status(pub u16);

impl Outcome for Status {
    fn failed(&self) -> bool {
        !matches!(self.0, 200 | 429)
    }
}

/// Which call this is: of which caller (numbered across every group of a load), and its number
/// among that caller's calls (from 0).
#[derive(Clone, Copy, Debug)]
pub struct Call {
    pub caller: usize,
    pub n: u64,
}

impl Call {
    /// Random bits for this call, distinct for every caller and call.
    pub fn random(&self) -> u64 {
        mix(((self.caller as u64) << 40) + self.n)
    }
}

/// splitmix64: well-mixed bits from a counter.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E3779B97F4A7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
    z ^ (z >> 31)
}

/// One operation of a load: a request, a script call, a batch.
pub type Op<T> = Arc<dyn Fn(Call) -> Pin<Box<dyn Future<Output = T> + Send>> + Send + Sync>;

/// An [`Op`] from an async closure (which clones what its future needs).
pub fn op<T, F, Fut>(f: F) -> Op<T>
where
    F: Fn(Call) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = T> + Send + 'static,
{
    Arc::new(move |call| Box::pin(f(call)))
}

/// A group of identical callers.
pub struct Callers<T> {
    group: usize,
    count: usize,
    op: Op<T>,
    pause: Option<Duration>,
    backoff: Option<Duration>,
}

impl<T> Callers<T> {
    /// `count` callers of `op`, their samples marked `group`.
    pub fn new(group: usize, count: usize, op: Op<T>) -> Callers<T> {
        Callers {
            group,
            count,
            op,
            pause: None,
            backoff: None,
        }
    }

    /// A pause after every call (none: as fast as answered).
    pub fn pause(mut self, d: Duration) -> Callers<T> {
        self.pause = Some(d);
        self
    }

    /// A pause after a failed call, so a failing target does not turn into a busy loop.
    pub fn backoff(mut self, d: Duration) -> Callers<T> {
        self.backoff = Some(d);
        self
    }
}

/// One call as the load generator saw it.
#[derive(Clone, Debug)]
pub struct Sample<T> {
    pub group: usize,
    /// When it was sent, since the load started.
    pub at: Duration,
    pub latency: Duration,
    pub outcome: T,
}

impl<T: Outcome> Sample<T> {
    /// When it came back, since the load started.
    pub fn done(&self) -> Duration {
        self.at + self.latency
    }

    pub fn failed(&self) -> bool {
        self.outcome.failed()
    }
}

impl Sample<Status> {
    pub fn status(&self) -> u16 {
        self.outcome.0
    }
}

/// Callers running on the current tokio runtime until [`Load::finish`].
pub struct Load<T> {
    t0: Instant,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Vec<Sample<T>>>>,
}

impl<T: Outcome> Load<T> {
    /// Starts every caller of `groups` at once. Must be called inside a tokio runtime.
    pub fn spawn(groups: Vec<Callers<T>>) -> Load<T> {
        let stop = Arc::new(AtomicBool::new(false));
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for g in groups {
            for _ in 0..g.count {
                let caller = tasks.len();
                let (op, stop, group, pause, backoff) =
                    (g.op.clone(), stop.clone(), g.group, g.pause, g.backoff);
                tasks.push(tokio::spawn(async move {
                    let mut samples = Vec::new();
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let sent = Instant::now();
                        let outcome = op(Call { caller, n }).await;
                        n += 1;
                        let sample = Sample {
                            group,
                            at: sent - t0,
                            latency: sent.elapsed(),
                            outcome,
                        };
                        let failed = sample.failed();
                        samples.push(sample);
                        if let (true, Some(b)) = (failed, backoff) {
                            tokio::time::sleep(b).await;
                        }
                        if let Some(p) = pause {
                            tokio::time::sleep(p).await;
                        }
                    }
                    samples
                }));
            }
        }
        Load { t0, stop, tasks }
    }

    /// Time since the load started.
    pub fn now(&self) -> Duration {
        self.t0.elapsed()
    }

    /// Stops every caller after its call in flight and returns every sample, caller by caller.
    pub async fn finish(self) -> Vec<Sample<T>> {
        self.stop.store(true, Ordering::Relaxed);
        let mut samples = Vec::new();
        for t in self.tasks {
            samples.extend(t.await.expect("a caller of the load panicked"));
        }
        samples
    }
}

/// A [`Load`] on a runtime of its own, for a caller that blocks meanwhile (breaks processes,
/// sleeps, reads counters).
pub struct Background<T> {
    runtime: tokio::runtime::Runtime,
    load: Load<T>,
}

impl<T: Outcome> Background<T> {
    /// Starts `groups` on a runtime of `workers` threads.
    pub fn start(workers: usize, groups: Vec<Callers<T>>) -> Background<T> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
            .expect("load runtime");
        let load = runtime.block_on(async { Load::spawn(groups) });
        Background { runtime, load }
    }

    /// Time since the load started.
    pub fn now(&self) -> Duration {
        self.load.now()
    }

    pub fn finish(self) -> Vec<Sample<T>> {
        self.runtime.block_on(self.load.finish())
    }
}

/// A GET through `client` with `headers`: its status once the body is read, 0 without an answer.
pub async fn get(client: &reqwest::Client, url: &str, headers: &[(String, String)]) -> Status {
    let mut req = client.get(url);
    for (k, v) in headers {
        req = req.header(k, v);
    }
    match req.send().await {
        Ok(r) => {
            let status = r.status().as_u16();
            match r.bytes().await {
                Ok(_) => Status(status),
                Err(_) => Status(0),
            }
        }
        Err(_) => Status(0),
    }
}

/// An async HTTP client for `callers` callers that keep their connections, with a timeout of
/// `timeout` per request.
pub fn http_client(callers: usize, timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(callers)
        .timeout(timeout)
        .build()
        .expect("http client")
}

// ---------------------------------------------------------------------------------------------
// A measured closed loop.

/// How a [`ClosedLoop`] warms up before its window opens.
#[derive(Clone, Copy, Debug)]
pub enum Warmup {
    /// One caller alone, call after call, for this long; the window opens as every caller
    /// starts. Panics when the warm-up keeps failing (1000 failures).
    Alone(Duration),
    /// Every caller, for this long; then the window opens.
    Together(Duration),
}

/// Counters a stage reads as its window opens and closes (script calls, metrics): the window's
/// [`Measured::probed`] holds their increase.
pub type Probe<'a> = &'a (dyn Fn() -> Vec<f64> + Sync);

/// A stage: `callers` concurrent callers of one operation, warmed up, then measured for
/// `seconds` (throughput, latency, the CPU of the `watched` processes, of this one and of the
/// machine), the window ending before the callers stop.
pub struct ClosedLoop<'a> {
    /// For messages.
    pub name: &'a str,
    pub callers: usize,
    pub warmup: Warmup,
    pub seconds: f64,
    pub watched: &'a [Watched],
    pub probe: Option<Probe<'a>>,
    /// Set: the window closes early (an interrupted run).
    pub interrupted: Option<&'a AtomicBool>,
}

/// What a [`ClosedLoop`]'s window measured.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub seconds: f64,
    /// Operations that came back successful inside the window.
    pub ops: u64,
    /// Operations that came back failed inside the window.
    pub errors: u64,
    /// Sorted: the latencies of the successful operations sent and answered inside the window.
    pub latencies: Vec<Duration>,
    pub cpu: CpuUse,
    /// The increase of each counter of the stage's probe.
    pub probed: Vec<f64>,
}

impl Measured {
    pub fn per_second(&self) -> f64 {
        self.ops as f64 / self.seconds
    }

    pub fn quantile(&self, q: f64) -> Duration {
        quantile(&self.latencies, q)
    }

    /// CPU µs of the processes named `name` per successful operation.
    pub fn cpu_us_per_op(&self, name: &str) -> f64 {
        self.cpu.of(name) * 1e6 / self.ops.max(1) as f64
    }

    /// Cores busy with processes this run did not start.
    pub fn others_cores(&self) -> f64 {
        self.cpu.others_cores(self.seconds)
    }
}

impl ClosedLoop<'_> {
    /// Runs the stage on the current (multi-threaded) runtime. Panics when no operation
    /// succeeded in the window (unless interrupted); reports failures on stderr.
    pub async fn measure(&self, op: Op<Result<(), String>>) -> Measured {
        if let Warmup::Alone(d) = self.warmup {
            self.warm_up_alone(&op, d).await;
        }
        let load = Load::spawn(vec![
            Callers::new(0, self.callers, op).backoff(Duration::from_millis(1))
        ]);
        if let Warmup::Together(d) = self.warmup {
            tokio::time::sleep(d).await;
        }
        let probe = || self.probe.map(|p| tokio::task::block_in_place(p));
        let probed_before = probe();
        let cpu = CpuMeter::start(self.watched);
        let opened = load.now();
        let window = Duration::from_secs_f64(self.seconds);
        while load.now() - opened < window && !self.interrupted() {
            let left = window.saturating_sub(load.now() - opened);
            tokio::time::sleep(left.min(Duration::from_millis(50))).await;
        }
        let closed = load.now();
        let cpu = cpu.stop();
        let probed = match (probe(), probed_before) {
            (Some(after), Some(before)) => after.iter().zip(before).map(|(a, b)| a - b).collect(),
            _ => Vec::new(),
        };
        let samples = load.finish().await;
        let measured = window_of(&samples, opened, closed, cpu, probed);
        let first_error = samples
            .iter()
            .find_map(|s| s.outcome.as_ref().err())
            .cloned()
            .unwrap_or_default();
        // An interrupted stage may end before any answer: the caller unwinds.
        assert!(
            measured.ops > 0 || self.interrupted(),
            "{}: no operation succeeded ({} errors, the first: {first_error})",
            self.name,
            measured.errors
        );
        if measured.errors > 0 {
            eprintln!(
                "{}: {} operations failed, the first: {first_error}",
                self.name, measured.errors
            );
        }
        measured
    }

    fn interrupted(&self) -> bool {
        self.interrupted.is_some_and(|i| i.load(Ordering::Relaxed))
    }

    async fn warm_up_alone(&self, op: &Op<Result<(), String>>, d: Duration) {
        let start = Instant::now();
        let mut errors = 0;
        // A caller of its own: its random bits differ from the measured callers'.
        let caller = usize::MAX >> 24;
        let mut n = 0;
        while start.elapsed() < d {
            if let Err(e) = op(Call { caller, n }).await {
                errors += 1;
                assert!(errors <= 1000, "{}: warm-up keeps failing: {e}", self.name);
            }
            n += 1;
        }
    }
}

/// The figures of the window `[opened, closed]` of `samples`: operations answered inside it,
/// latencies of those sent inside it too.
fn window_of(
    samples: &[Sample<Result<(), String>>],
    opened: Duration,
    closed: Duration,
    cpu: CpuUse,
    probed: Vec<f64>,
) -> Measured {
    let inside = |s: &&Sample<Result<(), String>>| s.done() >= opened && s.done() <= closed;
    let mut latencies: Vec<Duration> = samples
        .iter()
        .filter(inside)
        .filter(|s| !s.failed() && s.at >= opened)
        .map(|s| s.latency)
        .collect();
    latencies.sort();
    Measured {
        seconds: (closed - opened).as_secs_f64(),
        ops: samples
            .iter()
            .filter(inside)
            .filter(|s| !s.failed())
            .count() as u64,
        errors: samples.iter().filter(inside).filter(|s| s.failed()).count() as u64,
        latencies,
        cpu,
        probed,
    }
}

// ---------------------------------------------------------------------------------------------
// Answers of HTTP loads.

/// What a set of [`Status`] samples adds up to.
#[derive(Clone, Debug, PartialEq)]
pub struct Figures {
    pub n: usize,
    pub admitted: usize,
    pub rejected: usize,
    pub errors: usize,
    pub p50: Duration,
    pub p99: Duration,
    /// From the first send to the last answer.
    pub span: Duration,
}

pub fn figures<'a>(samples: impl IntoIterator<Item = &'a Sample<Status>>) -> Figures {
    let s: Vec<&Sample<Status>> = samples.into_iter().collect();
    let mut lat: Vec<Duration> = s.iter().map(|x| x.latency).collect();
    lat.sort();
    let first = s.iter().map(|x| x.at).min().unwrap_or_default();
    let last = s.iter().map(|x| x.done()).max().unwrap_or_default();
    Figures {
        n: s.len(),
        admitted: s.iter().filter(|x| x.status() == 200).count(),
        rejected: s.iter().filter(|x| x.status() == 429).count(),
        errors: s.iter().filter(|x| x.failed()).count(),
        p50: quantile(&lat, 0.5),
        p99: quantile(&lat, 0.99),
        span: last.saturating_sub(first),
    }
}

// ---------------------------------------------------------------------------------------------
// An open loop.

/// Calls of `op` paced at `rate` a second for `warmup` then `seconds`, on a runtime of its own
/// on the calling thread (so from its network namespace): a slow answer does not delay the next
/// call. The samples of the calls sent after the warm-up, in the order sent, and the rate at
/// which they were sent.
pub fn paced<T: Outcome>(
    op: Op<T>,
    rate: f64,
    warmup: Duration,
    seconds: f64,
    interrupted: &AtomicBool,
) -> (Vec<Sample<T>>, f64) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("paced runtime");
    rt.block_on(async {
        let interval = Duration::from_secs_f64(1.0 / rate);
        let start = tokio::time::Instant::now();
        let end = start + warmup + Duration::from_secs_f64(seconds);
        let mut next = start;
        let mut tasks = Vec::new();
        let mut n = 0u64;
        while next < end && !interrupted.load(Ordering::Relaxed) {
            tokio::time::sleep_until(next).await;
            let recorded = next >= start + warmup;
            let call = op(Call { caller: 0, n });
            n += 1;
            let t0 = start.into_std();
            tasks.push(tokio::spawn(async move {
                let sent = Instant::now();
                let outcome = call.await;
                let sample = Sample {
                    group: 0,
                    at: sent - t0,
                    latency: sent.elapsed(),
                    outcome,
                };
                recorded.then_some(sample)
            }));
            next += interval;
        }
        let mut samples = Vec::new();
        for t in tasks {
            if let Ok(Some(s)) = t.await {
                samples.push(s);
            }
        }
        let sent = samples.len() as f64 / seconds;
        (samples, sent)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(
        at_ms: u64,
        latency_ms: u64,
        outcome: Result<(), String>,
    ) -> Sample<Result<(), String>> {
        Sample {
            group: 0,
            at: Duration::from_millis(at_ms),
            latency: Duration::from_millis(latency_ms),
            outcome,
        }
    }

    #[test]
    fn a_window_counts_what_came_back_inside_it_and_times_what_also_started_there() {
        let samples = vec![
            sample(90, 20, Ok(())), // answered inside, sent before: counted, not timed
            sample(100, 5, Ok(())), // inside
            sample(150, 30, Err("503".into())), // a failure inside
            sample(190, 20, Ok(())), // answered after the window
        ];
        let from = Duration::from_millis(100);
        let to = Duration::from_millis(200);
        let m = window_of(&samples, from, to, CpuUse::default(), Vec::new());
        assert_eq!((m.ops, m.errors), (2, 1));
        assert_eq!(m.latencies, vec![Duration::from_millis(5)]);
        assert!((m.per_second() - 20.0).abs() < 1e-9);
    }

    #[test]
    fn figures_count_answers_by_status_and_span_first_send_to_last_answer() {
        let s = |at: u64, lat: u64, status: u16| Sample {
            group: 0,
            at: Duration::from_millis(at),
            latency: Duration::from_millis(lat),
            outcome: Status(status),
        };
        let samples = [s(10, 5, 200), s(12, 1, 429), s(20, 30, 0), s(30, 2, 503)];
        let f = figures(&samples);
        assert_eq!((f.n, f.admitted, f.rejected, f.errors), (4, 1, 1, 2));
        assert_eq!(f.span, Duration::from_millis(40));
        assert_eq!(f.p50, Duration::from_millis(5));
        assert_eq!(f.p99, Duration::from_millis(30));
    }

    #[test]
    fn callers_draw_distinct_bits() {
        let bits: std::collections::HashSet<u64> = (0..4)
            .flat_map(|caller| (0..1000).map(move |n| Call { caller, n }.random()))
            .collect();
        assert_eq!(bits.len(), 4000);
    }

    #[test]
    fn a_load_records_every_call_of_every_group_with_its_outcome() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let samples = rt.block_on(async {
            let ok = op(|_| async {
                tokio::time::sleep(Duration::from_millis(1)).await;
                Status(200)
            });
            let failing = op(|_| async { Status(0) });
            let load = Load::spawn(vec![
                Callers::new(0, 2, ok),
                Callers::new(1, 1, failing).backoff(Duration::from_millis(5)),
            ]);
            tokio::time::sleep(Duration::from_millis(100)).await;
            load.finish().await
        });
        let of = |g: usize| samples.iter().filter(|s| s.group == g).count();
        assert!(of(0) >= 2, "{} calls in group 0", of(0));
        assert!(samples.iter().filter(|s| s.group == 0).all(|s| !s.failed()));
        // The failing caller backs off 5 ms after each call.
        let failing: Vec<Duration> = samples
            .iter()
            .filter(|s| s.group == 1)
            .map(|s| s.at)
            .collect();
        assert!(!failing.is_empty());
        assert!(
            failing
                .windows(2)
                .all(|w| w[1] - w[0] >= Duration::from_millis(5)),
            "{failing:?}"
        );
        assert!(samples.iter().filter(|s| s.group == 1).all(|s| s.failed()));
    }
}
