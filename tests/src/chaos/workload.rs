//! The clients of a run, each a thread until told to stop, every request tagged with an id
//! (`x-chaos-id`) the upstream records: a hot app hammering both Envoys, quiet apps, users by
//! JWT, an LLM
//! client whose costs are settled from the answers (JSON and streams, asking for gzip, some
//! answers compressed anyway, without usage or cut short), a bulk client of many metered streams
//! at once under a long name, long requests under `concurrency`,
//! and an authenticated caller straight at a sidecar (attempt ids repeated and reused, new
//! clients now and then, forged settlements on the hot app's bucket: it must not create budget).

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use super::clock_ns;
use super::schedule::{ENVOYS, HOT, QUIET, WARM};
use super::topology::{
    key_of, BULK, BULK_ENVOY, BULK_MAX_TOKENS, BULK_RESERVE, CONCURRENCY, GATEWAY_TOKEN, GLOBAL,
    HOLD, LLM, LLM_ENVOY, LLM_RESERVE_MAX, NATIVE_ADDRESS, NATIVE_ENVOY, NATIVE_LLM,
    NATIVE_LLM_ADDRESS, NATIVE_LLM_APP, NATIVE_MAX_TOKENS, NATIVE_RESERVE, RLQS_ADDRESS,
    RLQS_ENVOY, USERS,
};

/// The bulk client's streams at once, each about a second long, all through Envoy 0 (one
/// worker, one outbox: [`BULK_ENVOY`]): about 50 settlements a second, so that what queues behind a batch
/// stuck on a paused sidecar (three sends of up to 200 ms) comes to more than one call holds.
const BULK_STREAMS: u64 = 48;

/// How many addresses the RLQS crowd sends from ([`crowd_address`]): each a bucket of the RLQS
/// Envoy, whose every report names them all: some 45 bytes each, more than the 64 KiB a gRPC
/// message may hold (`--max-body-bytes`) from about 1,450.
pub const RLQS_CROWD: u32 = 2_000;

/// The `n`th address of the RLQS crowd: from 127.0.16.0 on.
pub fn crowd_address(n: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(127, 0, 16, 0)) + n)
}

/// GET `path` on 127.0.0.1:`port` from `source`, over a connection of its own: the status.
fn get_from(source: Ipv4Addr, port: u16, path: &str, id: u64) -> Option<u16> {
    use nix::sys::socket::{bind, connect, socket, AddressFamily, SockFlag, SockType, SockaddrIn};
    use std::io::{Read, Write};
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .ok()?;
    let [a, b, c, d] = source.octets();
    bind(fd.as_raw_fd(), &SockaddrIn::new(a, b, c, d, 0)).ok()?;
    connect(fd.as_raw_fd(), &SockaddrIn::new(127, 0, 0, 1, port)).ok()?;
    let mut stream = std::net::TcpStream::from(fd);
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nhost: chaos\r\nx-chaos-id: {id}\r\nconnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).ok()?;
    // The status line is all it reads: Envoy waits a second for the client to close first
    // (`delayed_close_timeout`), so reading to the end would pace the crowd at one a second.
    let (mut answer, mut chunk) = (Vec::new(), [0u8; 512]);
    while !answer.contains(&b'\n') {
        let n = stream.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        answer.extend_from_slice(&chunk[..n]);
    }
    let line = answer.split(|b| *b == b'\n').next()?;
    std::str::from_utf8(line)
        .ok()?
        .split(' ')
        .nth(1)?
        .parse()
        .ok()
}

/// The regional callers' rhythm: demand moves between the regions every this long (a move of
/// the shares takes a round and the fence, 7 s: each phase moves share to its region), and
/// both regions see a burst of [`REGION_BURST`] decisions of a new client every
/// [`REGION_BURST_MS`].
const REGION_PHASE_MS: u64 = 12_000;
pub const REGION_BURST_MS: u64 = 2_000;
const REGION_BURST: usize = 200;

/// A direct call's answer as a gateway would answer it: the call's own status (503: Redis
/// unavailable), else its first decision's.
fn status_of(answer: &Option<(u16, Option<Value>)>) -> u16 {
    match answer {
        Some((200, Some(a))) if a["answers"][0]["allowed"] == true => 200,
        Some((200, Some(a))) if a["answers"][0]["error"].is_null() => 429,
        Some((200, _)) => 503,
        Some((status, _)) => *status,
        None => 0,
    }
}

/// What a request was, for the checker.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    /// `per-app`, cost 1.
    Api,
    /// `llm` (or `bulk`): it reserved `reserve`, really cost `tokens`; `readable`: its answer
    /// reports the cost in a way the filter reads (else it settles at `reserve_max`).
    Llm {
        reserve: u64,
        tokens: u64,
        readable: bool,
        /// The upstream cut the answer short on purpose (the client gets no whole answer).
        cut: bool,
    },
    /// `inflight`: held `ms` at the upstream.
    Hold { ms: u64 },
    /// The authenticated caller's decision of rule `direct`, cost `cost`; `repeat`: a repeat of
    /// its previous call (same attempt, same request), answered as it was and charged nothing;
    /// `fresh`: the first call of a subject never named before (a new client: its bucket is full,
    /// unless the store lost its state just before under `--store-reset empty`).
    Direct {
        cost: u64,
        repeat: bool,
        fresh: bool,
    },
}

/// One request, as its client saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Sent {
    pub id: u64,
    /// The rule and the app its bucket is keyed by.
    pub rule: &'static str,
    pub app: String,
    pub kind: Kind,
    /// The Envoy it went through (none: straight to a sidecar).
    pub envoy: Option<usize>,
    pub sent_ns: u64,
    pub answered_ns: u64,
    /// The answer's status; 0 when none came (a connection error, a reset).
    pub status: u16,
}

/// The run's clients.
pub struct Workload {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    sent: Arc<Mutex<Vec<Sent>>>,
    /// Forged settlements the authenticated caller sent.
    pub forged: Arc<AtomicU64>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

fn client(source: IpAddr) -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .local_address(source)
        .timeout(Duration::from_secs(10))
        .no_gzip()
        .no_deflate()
        .pool_max_idle_per_host(4)
        .build()
        .expect("client")
}

impl Workload {
    /// Starts every client: `envoy_ports` are the Envoys' listeners, `sidecar` the URL the
    /// authenticated caller calls; `seed` draws their choices.
    /// On two regions `eu` is eu's sidecar: a caller in each region asks the regional rule.
    pub fn start(
        seed: u64,
        envoy_ports: Vec<u16>,
        sidecar: String,
        eu: Option<String>,
        started: std::time::Instant,
    ) -> Workload {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(Mutex::new(Vec::new()));
        let forged = Arc::new(AtomicU64::new(0));
        let mut threads = Vec::new();
        // A client's connections come from `source` (a loopback address: its own `per-ip`
        // bucket).
        let spawn_from = |n: u64, source: IpAddr, f: Box<dyn FnMut(&mut Ctx) + Send>| {
            let ctx = Ctx {
                rng: StdRng::seed_from_u64(seed.wrapping_mul(31).wrapping_add(n)),
                client: client(source),
                ports: envoy_ports.clone(),
                sent: sent.clone(),
                stop: stop.clone(),
            };
            run_client(ctx, f)
        };
        let spawn = |n: u64, f| spawn_from(n, Ipv4Addr::LOCALHOST.into(), f);
        // The hot app, on both Envoys.
        for n in 0..2 {
            threads.push(spawn(n, Box::new(|c: &mut Ctx| c.api(HOT, 2))));
        }
        // The warm app, on Envoy 0 (one worker): about 60 a second, leases of many tokens.
        threads.push(spawn(5, Box::new(|c: &mut Ctx| c.api_on(WARM, 0, 15))));
        // Quiet apps, one request each in turn.
        threads.push(spawn(
            10,
            Box::new(|c: &mut Ctx| {
                let app = QUIET[c.rng.random_range(0..QUIET.len())];
                c.api(app, 25)
            }),
        ));
        threads.push(spawn(20, Box::new(|c: &mut Ctx| c.llm())));
        // Through the native filter's Envoy and the RLQS Envoy: `per-ip`, a bucket per address
        // ([`NATIVE_ADDRESS`], [`RLQS_ADDRESS`]), about 20 requests a second each.
        let through = [
            (22, NATIVE_ENVOY, NATIVE_ADDRESS, "/native/x"),
            (23, RLQS_ENVOY, RLQS_ADDRESS, "/rlqs/x"),
        ];
        for (n, envoy, source, path) in through {
            threads.push(spawn_from(
                n,
                source.into(),
                Box::new(move |c: &mut Ctx| {
                    let id = next_id();
                    let sent_ns = clock_ns();
                    let status = c.get(envoy, path, "", id, &[]);
                    c.record(Sent {
                        id,
                        rule: "per-ip",
                        app: source.to_string(),
                        kind: Kind::Api,
                        envoy: Some(envoy),
                        sent_ns,
                        answered_ns: clock_ns(),
                        status,
                    });
                    std::thread::sleep(Duration::from_millis(50));
                }),
            ));
        }
        // The native Envoy's metered route: reserved, settled at stream done.
        threads.push(spawn_from(
            24,
            NATIVE_LLM_ADDRESS.into(),
            Box::new(|c: &mut Ctx| c.native_llm()),
        ));
        // A crowd of addresses through the RLQS Envoy, one request each in turn: a bucket each,
        // so that its usage reports come to more than one gRPC message may hold.
        let port = envoy_ports[RLQS_ENVOY];
        let mut next = 0;
        threads.push(spawn(
            26,
            Box::new(move |c: &mut Ctx| {
                next = (next + 1) % RLQS_CROWD;
                c.crowd(port, crowd_address(next))
            }),
        ));
        // Users by JWT, one request each in turn, on both Envoys.
        let tokens: Vec<(String, String)> = USERS
            .iter()
            .map(|u| {
                let exp = 4_000_000_000u64; // far past any run
                let claims = json!({"iss": crate::JWT_ISSUER, "sub": u, "exp": exp});
                (u.to_string(), crate::signed_jwt(&claims))
            })
            .collect();
        threads.push(spawn(
            25,
            Box::new(move |c: &mut Ctx| {
                let (user, token) = &tokens[c.rng.random_range(0..tokens.len())];
                c.user(user, token)
            }),
        ));
        for n in 0..BULK_STREAMS {
            threads.push(spawn(100 + n, Box::new(|c: &mut Ctx| c.bulk())));
        }
        // Twice as many holders as `concurrency`, so that a slot lost or expired shows.
        for n in 0..2 * CONCURRENCY {
            threads.push(spawn(30 + n, Box::new(|c: &mut Ctx| c.hold())));
        }
        // Two regions: in each, a steady caller whose demand moves between the regions every
        // [`REGION_PHASE_MS`] (so the rebalancer keeps moving the shares), and bursts of a new
        // client in both at once (what a region may admit of a new bucket is its share of the
        // capacity).
        if let Some(eu) = eu {
            for (n, url, region) in [(60, sidecar.clone(), 0), (61, eu, 1)] {
                let burst_url = url.clone();
                threads.push(spawn(
                    n,
                    Box::new(move |c: &mut Ctx| c.regional_steady(&url, region, started)),
                ));
                threads.push(spawn(
                    n + 10,
                    Box::new(move |c: &mut Ctx| c.regional_burst(&burst_url, started)),
                ));
            }
        }
        let url = sidecar.clone();
        let mut attempt = Attempt::default();
        threads.push(spawn(
            40,
            Box::new(move |c: &mut Ctx| c.direct(&url, &mut attempt)),
        ));
        let (url, count) = (sidecar, forged.clone());
        threads.push(spawn(
            50,
            Box::new(move |c: &mut Ctx| c.forge(&url, &count)),
        ));
        Workload {
            stop,
            threads,
            sent,
            forged,
        }
    }

    /// Stops every client and returns what they sent.
    pub fn finish(self) -> Vec<Sent> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        std::mem::take(&mut *self.sent.lock().unwrap())
    }
}

fn run_client(mut ctx: Ctx, mut f: Box<dyn FnMut(&mut Ctx) + Send>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        while !ctx.stop.load(Ordering::Relaxed) {
            f(&mut ctx);
        }
    })
}

/// The authenticated caller's attempt id, its subject and the costs it decided under it.
#[derive(Default)]
struct Attempt {
    id: String,
    subject: String,
    made: Vec<u64>,
    last: u64,
}

/// One client's state.
struct Ctx {
    rng: StdRng,
    client: reqwest::blocking::Client,
    ports: Vec<u16>,
    sent: Arc<Mutex<Vec<Sent>>>,
    stop: Arc<AtomicBool>,
}

impl Ctx {
    fn envoy(&mut self) -> usize {
        self.rng.random_range(0..ENVOYS.min(self.ports.len()))
    }

    /// GET `path` through Envoy `envoy` as `app` (none: ""), with `headers`: the status (0:
    /// none).
    fn get(&self, envoy: usize, path: &str, app: &str, id: u64, headers: &[(&str, String)]) -> u16 {
        let mut req = self
            .client
            .get(format!("http://127.0.0.1:{}{path}", self.ports[envoy]))
            .header("x-chaos-id", id.to_string());
        if !app.is_empty() {
            req = req.header("x-api-key", key_of(app));
        }
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        match req.send() {
            Ok(mut r) => {
                let status = r.status().as_u16();
                // Read to the end: a cut stream is no answer.
                match std::io::copy(&mut r, &mut std::io::sink()) {
                    Ok(_) => status,
                    Err(_) => 0,
                }
            }
            Err(_) => 0,
        }
    }

    fn record(&self, sent: Sent) {
        self.sent.lock().unwrap().push(sent);
    }

    fn api(&mut self, app: &str, pause_ms: u64) {
        let envoy = self.envoy();
        self.api_on(app, envoy, pause_ms)
    }

    /// [`Self::api`] through Envoy `envoy`.
    fn api_on(&mut self, app: &str, envoy: usize, pause_ms: u64) {
        let id = next_id();
        let sent_ns = clock_ns();
        let status = self.get(envoy, "/api/x", app, id, &[]);
        self.record(Sent {
            id,
            rule: "per-app",
            app: app.to_string(),
            kind: Kind::Api,
            envoy: Some(envoy),
            sent_ns,
            answered_ns: clock_ns(),
            status,
        });
        std::thread::sleep(Duration::from_millis(pause_ms));
    }

    fn llm(&mut self) {
        let (id, envoy) = (next_id(), LLM_ENVOY);
        let reserve = self.rng.random_range(1..=LLM_RESERVE_MAX);
        let tokens = self.rng.random_range(1..=LLM_RESERVE_MAX);
        let stream = self.rng.random_bool(0.5);
        // What the client does: ask for gzip (the filter asks the API for identity: readable);
        // an answer compressed anyway, without usage, or cut short is not readable, but for an
        // event stream cut after its usage event (the upstream cuts its last chunk, `[DONE]`):
        // the filter keeps the figure it read.
        let unreadable = match self.rng.random_range(0..10) {
            0 => "&compress=gzip",
            1 => "&usage=0",
            2 => "&cut=1",
            _ => "",
        };
        let path = if stream {
            format!("/usage/sse?tokens={tokens}&events=3&gap_ms=20{unreadable}")
        } else {
            format!("/usage/json?tokens={tokens}{unreadable}")
        };
        let mut headers = vec![("x-max-tokens", reserve.to_string())];
        if self.rng.random_bool(0.5) {
            headers.push(("accept-encoding", "gzip".into()));
        }
        let sent_ns = clock_ns();
        let status = self.get(envoy, &path, LLM, id, &headers);
        self.record(Sent {
            id,
            rule: "llm",
            app: LLM.into(),
            kind: Kind::Llm {
                reserve,
                tokens,
                readable: unreadable.is_empty() || (stream && unreadable == "&cut=1"),
                cut: unreadable == "&cut=1",
            },
            envoy: Some(envoy),
            sent_ns,
            answered_ns: clock_ns(),
            status,
        });
        std::thread::sleep(Duration::from_millis(30));
    }

    /// A request on the native Envoy's metered route ([`NATIVE_LLM`]): reserved
    /// [`NATIVE_RESERVE`], settled at stream done on the cost the upstream reports in
    /// `x-usage-tokens`.
    fn native_llm(&mut self) {
        let id = next_id();
        let tokens = self.rng.random_range(1..=NATIVE_MAX_TOKENS);
        let sent_ns = clock_ns();
        let path = format!("/usage/header?tokens={tokens}");
        let status = self.get(NATIVE_ENVOY, &path, "", id, &[]);
        self.record(Sent {
            id,
            rule: NATIVE_LLM,
            app: NATIVE_LLM_APP.into(),
            kind: Kind::Llm {
                reserve: NATIVE_RESERVE,
                tokens,
                readable: true,
                cut: false,
            },
            envoy: Some(NATIVE_ENVOY),
            sent_ns,
            answered_ns: clock_ns(),
            status,
        });
        std::thread::sleep(Duration::from_millis(80));
    }

    /// One request of the RLQS crowd from `source`, on a connection of its own (HTTP/1.1, closed
    /// after the answer).
    fn crowd(&mut self, port: u16, source: Ipv4Addr) {
        let id = next_id();
        let sent_ns = clock_ns();
        let status = get_from(source, port, "/rlqs/x", id).unwrap_or(0);
        self.record(Sent {
            id,
            rule: "per-ip",
            app: source.to_string(),
            kind: Kind::Api,
            envoy: Some(RLQS_ENVOY),
            sent_ns,
            answered_ns: clock_ns(),
            status,
        });
        std::thread::sleep(Duration::from_millis(5));
    }

    /// A request of `user` by its JWT (`per-user`).
    fn user(&mut self, user: &str, token: &str) {
        let (id, envoy) = (next_id(), self.envoy());
        let sent_ns = clock_ns();
        let auth = format!("Bearer {token}");
        let status = self.get(envoy, "/user/x", "", id, &[("authorization", auth)]);
        self.record(Sent {
            id,
            rule: "per-user",
            app: user.to_string(),
            kind: Kind::Api,
            envoy: Some(envoy),
            sent_ns,
            answered_ns: clock_ns(),
            status,
        });
        std::thread::sleep(Duration::from_millis(60));
    }

    /// One metered stream of the bulk app (`bulk`: reserved [`BULK_RESERVE`], settled on the
    /// usage its last event reports) through [`BULK_ENVOY`], about a second long.
    fn bulk(&mut self) {
        let (id, envoy) = (next_id(), BULK_ENVOY);
        let tokens = self.rng.random_range(1..=BULK_MAX_TOKENS);
        let path = format!("/usage/sse?tokens={tokens}&events=4&gap_ms=250");
        let sent_ns = clock_ns();
        let status = self.get(envoy, &path, BULK, id, &[("x-bulk", "1".into())]);
        self.record(Sent {
            id,
            rule: "bulk",
            app: BULK.into(),
            kind: Kind::Llm {
                reserve: BULK_RESERVE,
                tokens,
                readable: true,
                cut: false,
            },
            envoy: Some(envoy),
            sent_ns,
            answered_ns: clock_ns(),
            status,
        });
        if status != 200 {
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn hold(&mut self) {
        let (id, envoy) = (next_id(), self.envoy());
        // Mostly short; one in four outlives the shortest `slot_ttl_ms` a reload sets (1 s), so
        // its slot lives only by its renewals; one in four outlives the longest renewal period
        // (3 s, of 9 s) by more than that shortest ttl, so that a reload lowering the ttl while
        // it runs leaves its slot to the new ttl's renewals (a gateway still renewing at the old
        // period lets it expire under the request).
        let ms = match self.rng.random_range(0..4) {
            0 => self.rng.random_range(1_200..3_000),
            1 => self.rng.random_range(4_500..7_000),
            _ => self.rng.random_range(100..600),
        };
        let sent_ns = clock_ns();
        let status = self.get(envoy, &format!("/hold/{HOLD}?ms={ms}"), HOLD, id, &[]);
        self.record(Sent {
            id,
            rule: "inflight",
            app: HOLD.into(),
            kind: Kind::Hold { ms },
            envoy: Some(envoy),
            sent_ns,
            answered_ns: clock_ns(),
            status,
        });
        if status != 200 {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The authenticated caller: a decision of `direct` under a new attempt id, or a repeat of
    /// its previous call (same attempt, same request: the first answer back, nothing charged), or
    /// another request under its attempt id (decided afresh, never replayed, unless it is one
    /// the attempt already made).
    fn direct(&mut self, url: &str, a: &mut Attempt) {
        let cost = match self.rng.random_range(0..6) {
            0 if !a.id.is_empty() => a.last,
            1 if !a.id.is_empty() => 3 - a.last,
            _ => {
                // One new attempt in four names a new client.
                let subject = if self.rng.random_range(0..4) == 0 {
                    format!("n{}", next_id())
                } else {
                    "d".into()
                };
                *a = Attempt {
                    id: format!("a-{}", next_id()),
                    subject,
                    ..Attempt::default()
                };
                1
            }
        };
        let repeat = a.made.contains(&cost);
        let fresh = a.made.is_empty() && a.subject != "d";
        let attempt = a.id.clone();
        let body = json!({"attempt": attempt,
            "requests": [{"decisions": [{"rule": "direct", "subject": {"app": a.subject}, "cost": cost}]}]});
        let (id, sent_ns) = (next_id(), clock_ns());
        let status = self.decide(url, &body);
        self.record(Sent {
            id,
            rule: "direct",
            app: a.subject.clone(),
            kind: Kind::Direct {
                cost,
                repeat,
                fresh,
            },
            envoy: None,
            sent_ns,
            answered_ns: clock_ns(),
            status,
        });
        a.made.push(cost);
        a.last = cost;
        std::thread::sleep(Duration::from_millis(40));
    }

    /// `POST /v1/decide` of `body` at the sidecar `url`, authenticated as a gateway: the answer
    /// as a gateway would answer it ([`status_of`]).
    fn decide(&self, url: &str, body: &Value) -> u16 {
        let answer = self
            .client
            .post(format!("{url}/v1/decide"))
            .bearer_auth(GATEWAY_TOKEN)
            .json(body)
            .send()
            .ok()
            .map(|r| (r.status().as_u16(), r.json::<Value>().ok()));
        status_of(&answer)
    }

    /// One decision of the regional rule for `subject` at the sidecar `url`: the status as a
    /// gateway would answer it.
    fn regional(&mut self, url: &str, subject: &str) {
        let body = json!({"requests": [{"decisions":
            [{"rule": GLOBAL, "subject": {"app": subject}, "cost": 1}]}]});
        let (id, sent_ns) = (next_id(), clock_ns());
        let status = self.decide(url, &body);
        self.record(Sent {
            id,
            rule: GLOBAL,
            app: subject.to_string(),
            kind: Kind::Direct {
                cost: 1,
                repeat: false,
                fresh: false,
            },
            envoy: None,
            sent_ns,
            answered_ns: clock_ns(),
            status,
        });
    }

    /// Region `region`'s steady caller: heavy while its phase is on, light while the other
    /// region's is.
    fn regional_steady(&mut self, url: &str, region: u128, started: std::time::Instant) {
        self.regional(url, "g");
        let phase = started.elapsed().as_millis() / u128::from(REGION_PHASE_MS) % 2;
        // Heavy: a few hundred decisions a second, so the bursts (both regions at once, but
        // each sidecar adds its demand up on its own second) do not decide where shares go.
        let pause = if phase == region { 3 } else { 1_000 };
        std::thread::sleep(Duration::from_millis(pause));
    }

    /// A burst of a new client every [`REGION_BURST_MS`], in both regions at once (the same
    /// subject: the slot's number).
    fn regional_burst(&mut self, url: &str, started: std::time::Instant) {
        let slot = started.elapsed().as_millis() / u128::from(REGION_BURST_MS);
        let subject = format!("b{slot}");
        for _ in 0..REGION_BURST {
            self.regional(url, &subject);
        }
        let next = Duration::from_millis(((slot + 1) * u128::from(REGION_BURST_MS)) as u64);
        if let Some(wait) = next.checked_sub(started.elapsed()) {
            std::thread::sleep(wait);
        }
    }

    /// A forged settlement on the hot app's bucket: a huge reservation settled at 0, no receipt.
    fn forge(&mut self, url: &str, count: &AtomicU64) {
        let body = json!({"settlements": [{"rule": "per-app", "subject": {"app": HOT},
            "reserved": 999_999_999_999u64, "cost": 0}]});
        if self
            .client
            .post(format!("{url}/v1/settle"))
            .bearer_auth(GATEWAY_TOKEN)
            .json(&body)
            .send()
            .is_ok()
        {
            count.fetch_add(1, Ordering::Relaxed);
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}
