//! The processes of a run, and the hands the nemesis breaks them with: a Redis primary with a
//! replica and three Sentinels, or a Cluster of three primaries each with a replica
//! ([`Store`]); two sidecars on it, each in a network namespace of its own whose path to Redis
//! the nemesis can cut ([`RedisPath`]); two Envoys with the wasm filter
//! (one and two workers), each to its own sidecar through a [`Relay`]; an Envoy with Envoy's
//! rate limit filter and one with its quota filter (RLQS), each straight to a sidecar; the
//! recording upstream.
//! The plugin names clients by API key (`<app>-key`; the app as [`app_name`] gives it) and users
//! by a JWT Envoy verified (`envoy/envoy-jwt.yaml`), the policy file is the run's
//! ([`policy_yaml`]).

use std::net::Ipv4Addr;
use std::time::Duration;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::relay::Relay;
use super::schedule::{
    Store, StoreReset, ENVOYS, HOT, PER_APP, QUIET, SIDECARS, WARM, WARM_BUCKET,
};
use crate::netns::Netns;
use crate::redis::node_serving;
use crate::{Envoy, EnvoyConfig, Redis, RedisCluster, Sentinel, Sidecar, Upstream};

/// The apps the plugin knows, beyond [`HOT`], [`WARM`] and [`QUIET`].
pub const LLM: &str = "llm";
pub const HOLD: &str = "hold";
/// The bulk client's app: many metered streams at once under a name of [`BULK_NAME_BYTES`], so
/// that the settlements queued while a sidecar is away come to more than one call may carry.
pub const BULK: &str = "bulk";
/// The Envoys that carry `llm` and `bulk`, each alone, so that each rule's lost settlements
/// are counted apart (the filter's counter names no rule).
pub const LLM_ENVOY: usize = 1;
pub const BULK_ENVOY: usize = 0;
/// `bulk`'s reservation, and the most a bulk request really costs.
pub const BULK_RESERVE: u64 = 10;
pub const BULK_MAX_TOKENS: u64 = 20;
/// The length of the bulk app's name as the plugin names it (a subject value may be 4,096 bytes):
/// about 17 of its settlements fill a call's 64 KiB.
pub const BULK_NAME_BYTES: usize = 3_800;
/// The users the JWT client names (its tokens' `sub`), and `per-user`'s bucket for each.
pub const USERS: [&str; 3] = ["u0", "u1", "u2"];
pub const USER_BUCKET: (u64, f64) = (8, 4.0);
/// The native Envoy's index among the workload's ports ([`Topology::listen_ports`]), the
/// address its client sends from, and `per-ip`'s bucket (one per address).
pub const NATIVE_ENVOY: usize = ENVOYS;
pub const NATIVE_ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 1);
pub const NATIVE_BUCKET: (u64, f64) = (15, 6.0);
/// The native Envoy's metered route (`/usage/`, the settled route envoy-native-ratelimit.yaml
/// comments): rule [`NATIVE_LLM`], one bucket for every client, [`NATIVE_RESERVE`] charged when
/// a request arrives and settled at stream done on the `x-usage-tokens` the upstream reports
/// (1 to [`NATIVE_MAX_TOKENS`]); the address its client sends from.
pub const NATIVE_LLM: &str = "nllm";
/// How the record names [`NATIVE_LLM`]'s one bucket (the rule has no subject).
pub const NATIVE_LLM_APP: &str = "all";
pub const NATIVE_LLM_BUCKET: (u64, f64) = (100, 20.0);
pub const NATIVE_RESERVE: u64 = 10;
pub const NATIVE_MAX_TOKENS: u64 = 30;
pub const NATIVE_LLM_ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);
/// The RLQS Envoy's index among the workload's ports, the address its client sends from (a
/// `per-ip` bucket of its own), and the sidecar it reports to.
pub const RLQS_ENVOY: usize = ENVOYS + 1;
pub const RLQS_ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
pub const RLQS_SIDECAR: usize = 1;
/// The sidecars' RLQS assignment TTL and delivery margin, as shipped (`--rlqs-assignment-ttl-s`,
/// `--rlqs-delivery-margin-ms`), and the shipped fallback of `envoy/envoy-rlqs.yaml` once an
/// assignment expired: 10 tokens, then 1 a second.
pub const RLQS_TTL_S: f64 = 3.0;
pub const RLQS_MARGIN_S: f64 = 0.5;
pub const RLQS_FALLBACK: (f64, f64) = (10.0, 1.0);
/// The bearer token every gateway and the direct caller send (`--auth-token-file`, the
/// sidecars' one file), and the RLQS Envoy's own, which [`Topology::revoke_rlqs_token`] rotates
/// out under its live stream and [`Topology::issue_rlqs_token`] replaces (`<prefix><n>`).
pub const GATEWAY_TOKEN: &str = "chaos-gateway-7d41";
pub const RLQS_TOKEN_PREFIX: &str = "chaos-rlqs-";
/// The regional rule of the two-region runs: one budget across `us` and `eu`, shares 0.5 each
/// at first, then as the rebalancer moves them (`--round-interval-ms` [`ROUND_MS`], leases of
/// [`LEASE_MS`]); the direct callers of both regions ask it.
pub const GLOBAL: &str = "global";
/// Filled in 4 s (`C / R`): the span of share history a new client's bucket is charged under
/// (the smallest share of it), so that a share a few seconds old is the one a burst meets.
pub const GLOBAL_BUCKET: (u64, f64) = (200, 50.0);
pub const ROUND_MS: u64 = 1_500;
pub const LEASE_MS: u64 = 1_000;
/// The rebalancer's fence margin (its default): what a region's sidecars may apply of a share
/// past its lease, and so the bound's `R · margin` (docs/regions.md).
pub const FENCE_MARGIN_S: f64 = 0.5;
/// `bulk`'s bucket: never the limit (what its client checks is that settlements arrive).
pub const BULK_BUCKET: (u64, f64) = (1_000_000, 1_000_000.0);

/// `llm`'s reservation bounds: the most a request may reserve, and what an answer whose cost
/// cannot be read settles at (the rule's `reserve_max`, `unreported_cost` by default).
pub const LLM_RESERVE_MAX: u64 = 50;
/// `inflight`'s concurrency.
pub const CONCURRENCY: u64 = 2;
/// The lease share the sidecars grant (`--lease-max-share`), as shipped.
pub const LEASE_SHARE: f64 = 0.1;

/// The policy in force: what a reload writes.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub per_app: (u64, f64),
    /// `hot` and `warm` blocked.
    pub hot_blocked: bool,
    pub slot_ttl_ms: u64,
    /// Rule `per-user` in the policy: a gateway that asks for it while it is not is answered
    /// the rule's `on_error` (`deny`).
    pub per_user: bool,
    /// Rule [`GLOBAL`] in the policy (on two regions only: a sidecar without `--region` refuses
    /// a regional rule).
    pub regions: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            per_app: PER_APP,
            hot_blocked: false,
            slot_ttl_ms: 3_000,
            per_user: true,
            regions: false,
        }
    }
}

/// The policy file of `p`.
pub fn policy_yaml(p: &Policy) -> String {
    let (c, r) = WARM_BUCKET;
    let block = if p.hot_blocked {
        format!(
            "    overrides:\n      - when: {{app: {HOT}}}\n        blocked: true\n      \
             - when: {{app: {WARM}}}\n        blocked: true\n"
        )
    } else {
        format!("    overrides:\n      - when: {{app: {WARM}}}\n        capacity: {c}\n        refill_per_sec: {r}\n")
    };
    let per_user = if p.per_user {
        format!(
            "  per-user: {{capacity: {}, refill_per_sec: {}}}\n",
            USER_BUCKET.0, USER_BUCKET.1
        )
    } else {
        String::new()
    };
    let global = if p.regions {
        let (c, r) = GLOBAL_BUCKET;
        format!(
            "  {GLOBAL}: {{capacity: {c}, refill_per_sec: {r}, regions: {{us: 0.5, eu: 0.5}}}}\n"
        )
    } else {
        String::new()
    };
    format!(
        "rules:\n  per-app:\n    capacity: {}\n    refill_per_sec: {}\n{block}  llm: {{capacity: 200, refill_per_sec: 50}}\n  inflight: {{concurrency: {CONCURRENCY}, slot_ttl_ms: {}}}\n  direct: {{capacity: 10, refill_per_sec: 5}}\n  \
         bulk: {{capacity: {}, refill_per_sec: {}}}\n{per_user}  \
         per-ip: {{capacity: {}, refill_per_sec: {}}}\n  {NATIVE_LLM}: {{capacity: {}, refill_per_sec: {}}}\n{global}",
        p.per_app.0,
        p.per_app.1,
        p.slot_ttl_ms,
        BULK_BUCKET.0,
        BULK_BUCKET.1,
        NATIVE_BUCKET.0,
        NATIVE_BUCKET.1,
        NATIVE_LLM_BUCKET.0,
        NATIVE_LLM_BUCKET.1
    )
}

/// The name the plugin gives `app` (its key's app): the app itself, but for [`BULK`].
pub fn app_name(app: &str) -> String {
    if app == BULK {
        format!("{BULK}-{}", "x".repeat(BULK_NAME_BYTES - BULK.len() - 1))
    } else {
        app.to_string()
    }
}

/// The API key of `app`.
pub fn key_of(app: &str) -> String {
    format!("{app}-key")
}

/// The filter's configuration: every app by its API key, three rules.
fn plugin() -> Value {
    let apps = [HOT, WARM, LLM, HOLD, BULK].into_iter().chain(QUIET);
    let keys: serde_json::Map<String, Value> = apps
        .map(|app| {
            let digest = Sha256::digest(key_of(app).as_bytes());
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            (hex, json!(app_name(app)))
        })
        .collect();
    let bulk = json!([{"name": "x-bulk", "present": true}]);
    // Users by a JWT Envoy's jwt_authn verified (`envoy/envoy-jwt.yaml`: a request without a
    // token passes on to be named by its API key).
    let jwt = json!({"provider": "example", "user_claim": "sub"});
    let not_bulk = json!([{"name": "x-bulk", "present": false}]);
    json!({
        "domain": "ratelimit",
        "sidecar": {"cluster": "ratelimit_sidecar", "timeout_ms": 200, "token": GATEWAY_TOKEN},
        "identity": {"api_key": {"header": "x-api-key", "keys": keys}, "jwt": jwt},
        "rules": [
            {"name": "per-app", "match": {"path_prefix": "/api/"}, "subject": ["app"],
             "on_error": "deny"},
            {"name": "llm", "match": {"path_prefix": "/usage/", "headers": not_bulk},
             "subject": ["app"], "on_error": "deny",
             "cost": {"reserve": 10, "reserve_from_request_header": "x-max-tokens",
                      "reserve_max": LLM_RESERVE_MAX, "response_json": "usage.total_tokens"}},
            {"name": "bulk", "match": {"path_prefix": "/usage/", "headers": bulk},
             "subject": ["app"], "on_error": "deny",
             "cost": {"reserve": BULK_RESERVE, "response_json": "usage.total_tokens"}},
            {"name": "per-user", "match": {"path_prefix": "/user/"}, "subject": ["user"],
             "on_error": "deny"},
            {"name": "inflight", "match": {"path_prefix": "/hold/"}, "subject": ["app"],
             "on_error": "deny"},
        ]
    })
}

/// A sidecar the nemesis can kill and start again on its port, in its own network namespace
/// ([`RedisPath`]).
pub struct Restartable {
    pub sidecar: Sidecar,
    netns: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Restartable {
    fn start(
        path: &RedisPath,
        policy: &str,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> Restartable {
        let netns = path.ns.name.clone();
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut sidecar = Sidecar::spawn_in(Some(&netns), path.port, policy, &refs, &env);
        sidecar.wait_ready();
        Restartable {
            sidecar,
            netns,
            args,
            env,
        }
    }

    /// Starts it again on its port with `policy` (the old process must be gone).
    pub fn start_again(&mut self, policy: &str) {
        let refs: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let port = self.sidecar.port;
        let mut s = Sidecar::spawn_in(Some(&self.netns), port, policy, &refs, &self.env);
        s.wait_ready();
        self.sidecar = s;
    }
}

/// A sidecar's own network namespace and what crosses its edge: inside it, a relay on every port
/// of Redis (the data nodes and the Sentinels) to the real one outside, so that Sentinel and the
/// Cluster hand out addresses that lead through them and the nemesis can cut this sidecar's path
/// to Redis, and only its; outside, a door on the sidecar's port to its listener inside.
pub struct RedisPath {
    pub ns: Netns,
    /// The sidecar's port, inside and at the door.
    pub port: u16,
    relays: Vec<Relay>,
    _door: Relay,
}

impl RedisPath {
    fn open(tag: &str, redis_ports: &[u16]) -> RedisPath {
        let ns = Netns::create(tag);
        let relays = redis_ports
            .iter()
            .map(|&p| {
                let inside = ns.run(|| std::net::TcpListener::bind(("127.0.0.1", p)));
                let inside = inside.expect("bind a Redis port inside the sidecar's namespace");
                Relay::start_on(inside, p, None)
            })
            .collect();
        let door = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the sidecar's door");
        let port = door.local_addr().expect("the door's address").port();
        let door = Relay::start_on(door, port, Some(ns.name.clone()));
        RedisPath {
            ns,
            port,
            relays,
            _door: door,
        }
    }

    /// Cuts this sidecar's path to Redis (`true`: its connections dropped, new ones closed at
    /// once) or mends it.
    pub fn set_cut(&self, cut: bool) {
        for r in &self.relays {
            r.set_cut(cut);
        }
    }

    /// Delays this sidecar's path to Redis by `ms` each way (0: none).
    pub fn set_delay_ms(&self, ms: u64) {
        for r in &self.relays {
            r.set_delay_ms(ms);
        }
    }

    /// A relay from a free port outside to the sidecar inside (a gateway's path, which the
    /// nemesis cuts apart from this one).
    fn relay_in(&self) -> Relay {
        let outside = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a relay");
        Relay::start_on(outside, self.port, Some(self.ns.name.clone()))
    }
}

/// Every process of a run.
pub struct Topology {
    pub store_reset: StoreReset,
    pub store: Store,
    /// The Redis data nodes: two under Sentinel, six in the Cluster; which one a fault of "the
    /// primary" hits changes with failovers ([`Topology::primary`]).
    pub nodes: Vec<Redis>,
    /// The three Sentinels (none for the Cluster).
    pub sentinels: Vec<Sentinel>,
    pub sidecars: Vec<Restartable>,
    /// Each sidecar's namespace and its path to Redis.
    pub paths: Vec<RedisPath>,
    /// Each wasm Envoy's path to its sidecar.
    pub relays: Vec<Relay>,
    pub envoys: Vec<Envoy>,
    pub configs: Vec<EnvoyConfig>,
    /// The wall-clock offset of each sidecar, a file libfaketime reads ([`Topology::step_clock`]),
    /// and the sidecars' `--auth-token-file` ([`GATEWAY_TOKEN`], the RLQS Envoy's token).
    clocks: tempfile::TempDir,
    /// The generation of the RLQS Envoy's token ([`RLQS_TOKEN_PREFIX`]).
    rlqs_token: u32,
    /// An Envoy with Envoy's native rate limit filter (`envoy/envoy-native-ratelimit.yaml`,
    /// failing closed) calling sidecar 0 over gRPC: rule `per-ip`, every client one address, and
    /// the metered route it comments ([`NATIVE_LLM`]: reserved, settled at stream done).
    /// Restarted by the nemesis, never cut (it calls its sidecar straight).
    pub native: Envoy,
    pub native_config: EnvoyConfig,
    /// An Envoy with Envoy's quota filter (`envoy/envoy-rlqs.yaml` as shipped) reporting to
    /// sidecar [`RLQS_SIDECAR`]: `per-ip` too. Likewise restarted, never cut.
    pub rlqs: Envoy,
    pub rlqs_config: EnvoyConfig,
    pub upstream: Upstream,
    pub policy: Policy,
    /// The second region of a two-region run.
    pub eu: Option<Eu>,
}

/// The second region of a two-region run ([`Store::Regions`]): its Redis, its sidecar (in a
/// namespace of its own, as the others; the faults leave this region alone) and the rebalancer
/// over both regions.
pub struct Eu {
    pub redis: Redis,
    pub sidecar: Restartable,
    _path: RedisPath,
    pub rebalancer: crate::Process,
    /// The rebalancer's policy file.
    limits: std::path::PathBuf,
}

impl Eu {
    fn start(us: &Redis, dir: &std::path::Path, text: &str, sidecar_args: &[String]) -> Eu {
        let redis = Redis::start_with(&NODE_ARGS);
        let path = RedisPath::open("chaos-eu", &[redis.port]);
        let mut args = vec![
            "--redis".into(),
            redis.url(),
            "--region".into(),
            "eu".into(),
        ];
        args.extend(sidecar_args.iter().cloned());
        let sidecar = Restartable::start(&path, text, args, Vec::new());
        let limits = dir.join("rebalancer-limits.yaml");
        std::fs::write(&limits, text).expect("write the rebalancer's policy");
        let mut cmd = std::process::Command::new(crate::snapshot_restore::rebalancer_bin());
        cmd.arg("--limits")
            .arg(&limits)
            .args(["--region", &format!("us={}", us.url())])
            .args(["--region", &format!("eu={}", redis.url())])
            .args(["--round-interval-ms", &ROUND_MS.to_string()])
            .args(["--lease-ms", &LEASE_MS.to_string()])
            .env("RUST_LOG", "info");
        let rebalancer = crate::Process::spawn("rebalancer", cmd, dir);
        Eu {
            redis,
            sidecar,
            _path: path,
            rebalancer,
            limits,
        }
    }
}

impl Topology {
    pub fn start(store_reset: StoreReset, store: Store) -> Topology {
        let (nodes, sentinels, store_args) = match store {
            Store::Sentinel => start_sentinel(),
            Store::Cluster => {
                // A primary is failed over after 1 s, as the Sentinels do.
                let cluster = RedisCluster::start_replicated(1_000);
                let seeds = cluster.seeds();
                (
                    cluster.nodes,
                    Vec::new(),
                    vec!["--redis-cluster".into(), seeds],
                )
            }
            Store::Regions => {
                let us = Redis::start_with(&NODE_ARGS);
                let args = vec!["--redis".into(), us.url(), "--region".into(), "us".into()];
                (vec![us], Vec::new(), args)
            }
        };
        // Every sidecar's arguments besides its store's (eu's too).
        let mut common: Vec<String> = vec![
            "--redis-timeout-ms".into(),
            "100".into(),
            "--store-reset".into(),
            store_reset.arg().into(),
        ];
        let policy = Policy {
            regions: store == Store::Regions,
            ..Policy::default()
        };
        let text = policy_yaml(&policy);
        let clocks = tempfile::tempdir().expect("a directory for the clocks' offsets");
        let tokens = tokens_file(clocks.path());
        write_tokens(&tokens, Some(0));
        common.extend(["--auth-token-file".into(), tokens.display().to_string()]);
        let args: Vec<String> = store_args.iter().chain(&common).cloned().collect();
        let redis_ports: Vec<u16> = nodes
            .iter()
            .map(|n| n.port)
            .chain(sentinels.iter().map(|s| s.port))
            .collect();
        let paths: Vec<RedisPath> = (0..SIDECARS)
            .map(|i| RedisPath::open(&format!("chaos-s{i}"), &redis_ports))
            .collect();
        let sidecars: Vec<Restartable> = (0..SIDECARS)
            .map(|i| {
                let env = faked_clock(&clock_file(clocks.path(), i));
                Restartable::start(&paths[i], &text, args.clone(), env)
            })
            .collect();
        let eu =
            (store == Store::Regions).then(|| Eu::start(&nodes[0], clocks.path(), &text, &common));
        let upstream = Upstream::start();
        let relays: Vec<Relay> = (0..ENVOYS)
            .map(|i| paths[i % SIDECARS].relay_in())
            .collect();
        let configs: Vec<EnvoyConfig> = (0..ENVOYS)
            .map(|i| {
                EnvoyConfig::shipped("envoy-jwt.yaml", relays[i].port, upstream.port)
                    .plugin(&plugin().to_string())
                    .concurrency(i as u32 + 1)
            })
            .collect();
        let envoys = configs.iter().map(Envoy::start).collect();
        let native_config = EnvoyConfig::shipped(
            "envoy-native-ratelimit.yaml",
            sidecars[0].sidecar.port,
            upstream.port,
        )
        .replace("timeout: 0.05s", "timeout: 0.2s")
        .replace("failure_mode_deny: false", "failure_mode_deny: true")
        .replace(GRPC_SERVICE, &with_bearer(GATEWAY_TOKEN, NATIVE_INDENT))
        .replace(NATIVE_ROUTES, &native_usage_route());
        let native = Envoy::start(&native_config);
        let rlqs_config = EnvoyConfig::shipped(
            "envoy-rlqs.yaml",
            sidecars[RLQS_SIDECAR].sidecar.port,
            upstream.port,
        )
        .replace(GRPC_SERVICE, &with_bearer(&rlqs_token(0), RLQS_INDENT));
        let rlqs = Envoy::start(&rlqs_config);
        Topology {
            store_reset,
            store,
            nodes,
            sentinels,
            sidecars,
            paths,
            relays,
            envoys,
            configs,
            clocks,
            rlqs_token: 0,
            native,
            native_config,
            rlqs,
            rlqs_config,
            upstream,
            policy,
            eu,
        }
    }

    /// The index in [`Topology::nodes`] of the node the Sentinels name primary now, or in the
    /// Cluster the primary serving the hot app's bucket ([`HOT_BUCKET_KEY`]).
    pub fn primary(&self) -> usize {
        if self.store == Store::Cluster {
            let ports: Vec<u16> = self.nodes.iter().map(|n| n.port).collect();
            return node_serving(&ports, HOT_BUCKET_KEY)
                .and_then(|port| ports.iter().position(|p| *p == port))
                .unwrap_or(0);
        }
        self.agreed_primary().unwrap_or_else(|| {
            let port = self
                .sentinels
                .iter()
                .find_map(Sentinel::master_port)
                .unwrap_or(self.nodes[0].port);
            self.nodes.iter().position(|n| n.port == port).unwrap_or(0)
        })
    }

    /// The primary every Sentinel that answers names, when at least two answer: `None` while
    /// they disagree (a failover under way), so that the orchestrator never acts on one
    /// Sentinel's view against the others'.
    pub fn agreed_primary(&self) -> Option<usize> {
        let ports: Vec<u16> = self
            .sentinels
            .iter()
            .filter_map(Sentinel::master_port)
            .collect();
        if ports.len() < 2 || ports.iter().any(|p| *p != ports[0]) {
            return None;
        }
        self.nodes.iter().position(|n| n.port == ports[0])
    }

    /// Whether every Sentinel answers and holds its primary up with no failover under way: a
    /// primary paused past the down-after may be failed over seconds after it resumed, and a
    /// fault is over only once that is decided.
    pub fn sentinels_at_rest(&self) -> bool {
        self.sentinels.iter().all(|s| {
            s.master_flags().is_some_and(|flags| {
                !flags
                    .split(',')
                    .any(|f| matches!(f, "s_down" | "o_down" | "failover_in_progress"))
            })
        })
    }

    /// Whether the Cluster is at rest: every node up with `cluster_state:ok`, three primaries,
    /// and every replica linked to its primary (an old primary back after a failover rejoins
    /// as a replica of its own accord).
    pub fn cluster_at_rest(&self) -> bool {
        let mut primaries = 0;
        for n in &self.nodes {
            if !n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok") {
                return false;
            }
            let replication = n.cli(&["INFO", "replication"]);
            if replication.contains("role:master") {
                primaries += 1;
            } else if !n.linked() {
                return false;
            }
        }
        primaries == 3
    }

    /// Sets sidecar `sidecar`'s wall clock `seconds` away from the host's (0: back to it), and
    /// waits out libfaketime's cache (it reads the file again every second); the monotonic clock
    /// runs on. (The sidecar's `date` header cannot show it: hyper renews its cached date only
    /// once the clock passes the next second it expects, an hour later after a step back of an
    /// hour; `tests/tests/chaos.rs` checks a step on a `date` that can show it.)
    pub fn step_clock(&self, sidecar: usize, seconds: i64) {
        let path = clock_file(self.clocks.path(), sidecar);
        std::fs::write(&path, format!("{seconds:+}\n")).expect("write the clock's offset");
        std::thread::sleep(Duration::from_millis(1_100));
    }

    /// Rewrites the sidecars' token file without the RLQS Envoy's token, which it goes on
    /// sending (a gateway whose credentials were revoked): its stream must end within about 3 s
    /// (the file is read again every 2 s, the stream checked at every round, each second).
    pub fn revoke_rlqs_token(&self) {
        write_tokens(&tokens_file(self.clocks.path()), None);
    }

    /// Issues the RLQS Envoy a new token (added to the file, as rotation goes: the old one is
    /// gone already) and restarts it with it; the file is read again before it starts.
    pub fn issue_rlqs_token(&mut self) {
        let old = with_bearer(&rlqs_token(self.rlqs_token), RLQS_INDENT);
        self.rlqs_token += 1;
        write_tokens(&tokens_file(self.clocks.path()), Some(self.rlqs_token));
        self.rlqs_config = self.rlqs_config.clone().replace(
            &old,
            &with_bearer(&rlqs_token(self.rlqs_token), RLQS_INDENT),
        );
        std::thread::sleep(Duration::from_millis(2_100));
        let config = self.rlqs_config.clone();
        self.rlqs.restart(&config);
    }

    /// Writes `policy` to every sidecar's file (and the rebalancer's).
    pub fn write_policy(&mut self, policy: Policy) {
        let text = policy_yaml(&policy);
        for s in &self.sidecars {
            s.sidecar.write_policy(&text);
        }
        if let Some(eu) = &self.eu {
            eu.sidecar.sidecar.write_policy(&text);
            std::fs::write(&eu.limits, &text).expect("write the rebalancer's policy");
        }
        self.policy = policy;
    }

    /// The base URL of sidecar `i` (for the direct caller).
    pub fn sidecar_url(&self, i: usize) -> String {
        self.sidecars[i].sidecar.base_url()
    }

    /// The process ids to watch, by name: memory and panics.
    pub fn processes(&self) -> Vec<(String, u32)> {
        let mut out = Vec::new();
        for (i, s) in self.sidecars.iter().enumerate() {
            out.push((format!("sidecar {i}"), s.sidecar.process.pid()));
        }
        for (i, e) in self.envoys.iter().enumerate() {
            out.push((format!("envoy {i}"), e.process.pid()));
        }
        out.push(("envoy native".into(), self.native.process.pid()));
        out.push(("envoy rlqs".into(), self.rlqs.process.pid()));
        for (i, n) in self.nodes.iter().enumerate() {
            out.push((format!("redis {i}"), n.pid()));
        }
        if let Some(eu) = &self.eu {
            out.push(("sidecar eu".into(), eu.sidecar.sidecar.process.pid()));
            out.push(("redis eu".into(), eu.redis.pid()));
        }
        out
    }

    /// Every process's log, by name (to look for panics, and kept with a violation: Redis's and
    /// the Sentinels' say who failed over when).
    pub fn logs(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (i, n) in self.nodes.iter().enumerate() {
            out.push((format!("redis {i}"), n.process.log()));
        }
        for (i, s) in self.sentinels.iter().enumerate() {
            out.push((format!("sentinel {i}"), s.process.log()));
        }
        for (i, s) in self.sidecars.iter().enumerate() {
            out.push((format!("sidecar {i}"), s.sidecar.process.log()));
        }
        for (i, e) in self.envoys.iter().enumerate() {
            out.push((format!("envoy {i}"), e.process.log()));
        }
        out.push(("envoy native".into(), self.native.process.log()));
        out.push(("envoy rlqs".into(), self.rlqs.process.log()));
        if let Some(eu) = &self.eu {
            out.push(("sidecar eu".into(), eu.sidecar.sidecar.process.log()));
            out.push(("redis eu".into(), eu.redis.process.log()));
            out.push(("rebalancer".into(), eu.rebalancer.log()));
        }
        out
    }

    /// The shares of [`GLOBAL`] in us's and eu's records, in parts per million (none: a record
    /// missing, or not two regions).
    pub fn shares_ppm(&self) -> Option<(u64, u64)> {
        let eu = self.eu.as_ref()?;
        let key = format!("rl:share:{{ratelimit|{GLOBAL}}}");
        let read = |r: &Redis| r.cli(&["HGET", &key, "share_ppm"]).trim().parse().ok();
        Some((read(&self.nodes[0])?, read(&eu.redis)?))
    }

    /// Signals the rebalancer, on two regions.
    pub fn signal_rebalancer(&self, signal: nix::sys::signal::Signal) {
        if let Some(eu) = &self.eu {
            eu.rebalancer.signal(signal);
        }
    }

    /// The base URL of eu's sidecar, on two regions.
    pub fn eu_url(&self) -> Option<String> {
        self.eu.as_ref().map(|eu| eu.sidecar.sidecar.base_url())
    }

    /// The listeners the workload sends to: the wasm Envoys' (by index), then the native one's
    /// ([`NATIVE_ENVOY`]) and the RLQS one's ([`RLQS_ENVOY`]).
    pub fn listen_ports(&self) -> Vec<u16> {
        let wasm = self.envoys.iter().map(|e| e.listen_port);
        wasm.chain([self.native.listen_port, self.rlqs.listen_port])
            .collect()
    }
}

/// The hot app's `per-app` bucket: in the Cluster, the faults of "the primary" hit the node
/// that serves it.
pub const HOT_BUCKET_KEY: &str = "rl:{ratelimit|rule=per-app|app=hot}";

/// A data node's arguments: no eviction; a full sync starts at once (diskless, Redis waits 5 s by
/// default for more replicas).
const NODE_ARGS: [&str; 4] = [
    "--maxmemory-policy",
    "noeviction",
    "--repl-diskless-sync-delay",
    "0",
];

/// A primary with a replica and three Sentinels: the data nodes, the Sentinels and the
/// sidecars' arguments to reach them.
fn start_sentinel() -> (Vec<Redis>, Vec<Sentinel>, Vec<String>) {
    let node = NODE_ARGS;
    let primary = Redis::start_with(&node);
    // Linked by a command, not an argument: a node the nemesis restarts comes back as a
    // primary of its own, and the Sentinels make it a replica again, as in production.
    let replica = Redis::start_with(&node);
    replica.cli(&["REPLICAOF", "127.0.0.1", &primary.port.to_string()]);
    replica.wait_linked();
    let sentinels: Vec<Sentinel> = (0..3)
        .map(|_| Sentinel::start("mymaster", primary.port, 2))
        .collect();
    let urls: Vec<String> = sentinels.iter().map(Sentinel::url).collect();
    let args = vec![
        "--redis-sentinel".into(),
        urls.join(","),
        "--sentinel-master".into(),
        "mymaster".into(),
    ];
    (vec![primary, replica], sentinels, args)
}

/// The native config's route table, and the metered route put first in it: the settled
/// route the file comments, on rule [`NATIVE_LLM`] ([`crate::native_settled_route`]).
const NATIVE_ROUTES: &str = "              routes:\n";

fn native_usage_route() -> String {
    format!(
        "{NATIVE_ROUTES}              - name: usage\n                match: {{ prefix: \"/usage/\" }}\n                \
         route: {{ cluster: demo_upstream }}\n{}",
        crate::native_settled_route(NATIVE_LLM, NATIVE_RESERVE)
    )
}

/// The line of the shipped native and RLQS configs that names the sidecar's gRPC cluster.
const GRPC_SERVICE: &str = "envoy_grpc: { cluster_name: ratelimit_sidecar }";

/// How far [`GRPC_SERVICE`] is indented in the shipped native and RLQS configs.
const NATIVE_INDENT: usize = 18;
const RLQS_INDENT: usize = 16;

/// [`GRPC_SERVICE`] sending `token` (the `initial_metadata` the shipped files comment), the
/// line indented by `indent`.
fn with_bearer(token: &str, indent: usize) -> String {
    format!(
        "{GRPC_SERVICE}\n{:indent$}initial_metadata: [{{ key: authorization, value: \"Bearer {token}\" }}]",
        ""
    )
}

fn rlqs_token(generation: u32) -> String {
    format!("{RLQS_TOKEN_PREFIX}{generation}")
}

fn tokens_file(dir: &std::path::Path) -> std::path::PathBuf {
    dir.join("tokens")
}

/// Writes the token file: [`GATEWAY_TOKEN`], and the RLQS Envoy's token of `rlqs` (none:
/// revoked), swapped in whole as an operator's tooling does.
fn write_tokens(path: &std::path::Path, rlqs: Option<u32>) {
    let mut text = format!("{GATEWAY_TOKEN}\n");
    if let Some(g) = rlqs {
        text += &format!("{}\n", rlqs_token(g));
    }
    let next = path.with_extension("new");
    std::fs::write(&next, text).expect("write the token file");
    std::fs::rename(&next, path).expect("swap the token file in");
}

/// The offset file of sidecar `i`'s wall clock ("+0" until a step).
pub fn clock_file(dir: &std::path::Path, i: usize) -> std::path::PathBuf {
    let path = dir.join(format!("clock-{i}"));
    if !path.exists() {
        std::fs::write(&path, "+0\n").expect("write the clock's offset");
    }
    path
}

/// The environment that reads a process's wall clock through libfaketime (Debian's `faketime`,
/// installed by scripts/install-deps.sh) at the offset in `offset_file`, read again every
/// second; the monotonic clock is left alone. (Envoy 1.40 hangs at its start under libfaketime,
/// even for `--version`: a futex wait before `main`; so only the sidecars' clocks are stepped.)
pub fn faked_clock(offset_file: &std::path::Path) -> Vec<(String, String)> {
    let lib = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib",
    ]
    .iter()
    .map(|d| std::path::Path::new(d).join("faketime/libfaketimeMT.so.1"))
    .find(|p| p.exists())
    .expect("libfaketime is missing: install Debian's faketime (scripts/install-deps.sh)");
    [
        ("LD_PRELOAD", lib.display().to_string()),
        ("FAKETIME_TIMESTAMP_FILE", offset_file.display().to_string()),
        ("FAKETIME_CACHE_DURATION", "1".into()),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}
