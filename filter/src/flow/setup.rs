//! What a worker VM derives once from its configuration, what the host names the stream with,
//! and how a root event's counters are summed: pure, so the host adapter only reads the bytes,
//! logs and calls.

use std::cell::RefCell;

use prost::Message;

use super::{Histogram, RequestReads, Stat, Stats};
use crate::config::Config;

/// A worker VM's configuration, validated, and what is derived from it once.
#[derive(Debug)]
pub struct Setup {
    pub config: Config,
    pub reads: RequestReads,
    /// The stream's `authorization` metadata, if a token is configured.
    pub authorization: Option<String>,
}

impl Setup {
    /// The configuration in `bytes`, its token read through `env`; an error says what is wrong.
    pub fn from_json(bytes: &[u8], env: impl Fn(&str) -> Option<String>) -> Result<Setup, String> {
        let config = Config::from_json(bytes).map_err(|e| e.to_string())?;
        let authorization = config.sidecar.authorization(env)?;
        Ok(Setup {
            reads: RequestReads::of(&config),
            config,
            authorization,
        })
    }

    /// One line on what was configured, for the log.
    pub fn summary(&self) -> String {
        let c = &self.config;
        format!(
            "configured {} rules in domain {:?}, sidecar cluster {:?}, timeout {} ms, coalescing {}",
            c.rules.len(),
            c.domain,
            c.sidecar.cluster,
            c.sidecar.timeout_ms,
            c.fast_paths.coalesce
        )
    }

    /// Envoy's `GrpcService` naming the sidecar's cluster and authority (`envoy_grpc`), as the
    /// SDK's `open_grpc_stream` takes it: as text. The encoded message is ASCII while the names
    /// are shorter than 128 bytes; past that, the cluster's name, which Envoy also takes.
    pub fn grpc_service(&self) -> String {
        let sidecar = &self.config.sidecar;
        let service = GrpcService {
            envoy_grpc: Some(EnvoyGrpc {
                cluster_name: sidecar.cluster.clone(),
                authority: sidecar.authority().to_string(),
            }),
        };
        String::from_utf8(service.encode_to_vec()).unwrap_or_else(|_| sidecar.cluster.clone())
    }
}

/// Envoy's `config.core.v3.GrpcService`, the part that names a cluster.
#[derive(Clone, PartialEq, Message)]
struct GrpcService {
    #[prost(message, optional, tag = "1")]
    envoy_grpc: Option<EnvoyGrpc>,
}

#[derive(Clone, PartialEq, Message)]
struct EnvoyGrpc {
    #[prost(string, tag = "1")]
    cluster_name: String,
    #[prost(string, tag = "2")]
    authority: String,
}

/// A root event's counter increments, summed per counter and added to `sink` once each when
/// the event is done ([`Tally::finish`]): one host call per counter and event instead of several
/// per request. Histogram values go through at once.
pub struct Tally<'a> {
    sink: &'a dyn Stats,
    held: RefCell<Vec<(Stat, u64)>>,
}

impl<'a> Tally<'a> {
    pub fn new(sink: &'a dyn Stats) -> Tally<'a> {
        Tally {
            sink,
            held: RefCell::new(Vec::new()),
        }
    }

    /// Adds each counter's sum to the sink.
    pub fn finish(self) {
        for (stat, n) in self.held.into_inner() {
            self.sink.add(stat, n);
        }
    }
}

impl Stats for Tally<'_> {
    fn add(&self, stat: Stat, n: u64) {
        let mut held = self.held.borrow_mut();
        match held.iter_mut().find(|(s, _)| *s == stat) {
            Some((_, sum)) => *sum = sum.saturating_add(n),
            None => held.push((stat, n)),
        }
    }

    fn record(&self, histogram: Histogram, value: u64) {
        self.sink.record(histogram, value);
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use std::cell::RefCell;

    use super::*;

    fn setup(sidecar: &str) -> Result<Setup, String> {
        let json = format!(
            r#"{{"domain": "d", "sidecar": {sidecar}, "rules": [{{"name": "r", "subject": []}}]}}"#
        );
        Setup::from_json(json.as_bytes(), |var| {
            (var == "TOKEN").then(|| "s3cret".to_string())
        })
    }

    #[test]
    fn the_stream_is_named_by_envoys_grpc_service_with_the_cluster_and_its_authority() {
        let s = setup(r#"{"cluster": "ratelimit_sidecar", "authority": "rl.internal"}"#).unwrap();
        let decoded = GrpcService::decode(s.grpc_service().as_bytes()).unwrap();
        let grpc = decoded.envoy_grpc.unwrap();
        assert_eq!(grpc.cluster_name, "ratelimit_sidecar");
        assert_eq!(grpc.authority, "rl.internal");

        let s = setup(r#"{"cluster": "c"}"#).unwrap();
        let grpc = GrpcService::decode(s.grpc_service().as_bytes())
            .unwrap()
            .envoy_grpc
            .unwrap();
        assert_eq!(
            (grpc.cluster_name.as_str(), grpc.authority.as_str()),
            ("c", "c")
        );
    }

    #[test]
    fn a_cluster_name_too_long_for_ascii_text_is_given_as_the_name_alone() {
        let long = "c".repeat(200);
        let s = setup(&format!(r#"{{"cluster": "{long}"}}"#)).unwrap();
        assert_eq!(s.grpc_service(), long);
    }

    #[test]
    fn the_token_is_read_from_the_environment_and_a_missing_one_is_refused() {
        let s = setup(r#"{"cluster": "c", "token_env": "TOKEN"}"#).unwrap();
        assert_eq!(s.authorization.as_deref(), Some("Bearer s3cret"));
        let e = setup(r#"{"cluster": "c", "token_env": "NOT_SET"}"#).unwrap_err();
        assert!(e.contains("NOT_SET"), "{e}");
        let e = setup(r#"{"cluster": 7}"#).unwrap_err();
        assert!(e.contains("cluster"), "{e}");
    }

    #[derive(Default)]
    struct Calls(RefCell<Vec<(Stat, u64)>>, RefCell<Vec<(Histogram, u64)>>);

    impl Stats for Calls {
        fn add(&self, stat: Stat, n: u64) {
            self.0.borrow_mut().push((stat, n));
        }
        fn record(&self, histogram: Histogram, value: u64) {
            self.1.borrow_mut().push((histogram, value));
        }
    }

    #[test]
    fn a_tally_adds_each_counter_once_with_its_sum_when_the_event_is_done() {
        let sink = Calls::default();
        let tally = Tally::new(&sink);
        tally.count(Stat::Admitted);
        tally.add(Stat::RuleAdmitted(1), 3);
        tally.count(Stat::Admitted);
        tally.add(Stat::RuleAdmitted(0), 2);
        tally.add(Stat::RuleAdmitted(1), u64::MAX);
        tally.record(Histogram::DecisionUs, 250);
        assert!(sink.0.borrow().is_empty(), "nothing added before the end");
        assert_eq!(*sink.1.borrow(), [(Histogram::DecisionUs, 250)]);
        tally.finish();
        assert_eq!(
            *sink.0.borrow(),
            [
                (Stat::Admitted, 2),
                (Stat::RuleAdmitted(1), u64::MAX),
                (Stat::RuleAdmitted(0), 2)
            ]
        );
    }
}
