//! The other invariants: requests in flight against `concurrency`, the answers the failure
//! policies allow, every settlement queued, and the processes' health.

use super::*;

impl Checker<'_> {
    /// Requests the upstream held at once, against `concurrency`.
    pub(super) fn concurrency(&mut self) {
        let mut holds: Vec<(u64, u64, u64, Option<usize>)> = self
            .r
            .sent
            .iter()
            .filter(|s| matches!(s.kind, Kind::Hold { .. }))
            .filter_map(|s| {
                self.served
                    .get(&s.id)
                    .map(|v| (v.arrival_ns, v.done_ns, s.id, s.envoy))
            })
            .collect();
        holds.sort();
        for (i, &(arrival, _, id, envoy)) in holds.iter().enumerate() {
            let overlapping: Vec<(u64, Option<usize>)> = holds[..i]
                .iter()
                .filter(|h| h.1 > arrival)
                .map(|h| (h.0, h.3))
                .collect();
            let at_once = overlapping.len() as u64 + 1;
            // A request that ran while slots may have been lost may hold one the store forgot
            // (the other primary's, one that expired, one a restore took back): another may
            // take its place, allowed while it still runs. Each one's life up to this arrival.
            let lost = std::iter::once((arrival, envoy))
                .chain(overlapping.iter().copied())
                .any(|(a, through)| self.slots_may_be_lost(a, arrival, through));
            let allowance = if lost { CONCURRENCY } else { 0 };
            self.row_at(arrival).admitted += 1;
            if at_once > CONCURRENCY + allowance {
                let start = overlapping.iter().map(|h| h.0).min().unwrap_or(arrival);
                self.violations.push(Violation {
                    what: format!(
                        "inflight: request {id} made {at_once} in flight at once (concurrency \
                         {CONCURRENCY}, allowance {allowance})"
                    ),
                    at_ns: arrival,
                    window: (start, arrival),
                });
            }
        }
    }

    /// Whether a slot held from `from` to `to` through Envoy `envoy` may have been lost or
    /// expired meanwhile: a failover or a store lost under `full`, or a fault that kept that
    /// Envoy from renewing for a third of `slot_ttl_ms` (its sidecar, its path to it, Redis),
    /// from the fault's start to its aftermath's end.
    pub(super) fn slots_may_be_lost(&self, from: u64, to: u64, envoy: Option<usize>) -> bool {
        self.r.log.faults.iter().any(|f| {
            let within = f.start_ns <= to && from <= f.recovered_ns + AFTERMATH_NS;
            let ttl_ms = self.policy_at(f.start_ns).slot_ttl_ms;
            let long = f.fault.lasts_ms() * 3 >= ttl_ms
                || (f.end_ns - f.start_ns) / 1_000_000 * 3 >= ttl_ms;
            let blocks = match f.fault {
                Fault::SidecarPause { sidecar, .. }
                | Fault::SidecarRestart { sidecar, .. }
                | Fault::RedisCut { sidecar, .. }
                | Fault::RedisDelay { sidecar, .. } => {
                    envoy.is_none_or(|e| e % SIDECARS == sidecar)
                }
                Fault::GatewayCut { envoy: cut, .. }
                | Fault::GatewayDelay { envoy: cut, .. }
                | Fault::AnswersLost { envoy: cut, .. } => envoy.is_none_or(|e| e == cut),
                // Its own requests end with it; no other Envoy's renewals wait for it. A
                // sidecar's wall-clock step stops no renewal (Redis's clock decides).
                Fault::EnvoyRestart { .. }
                | Fault::ClockStep { .. }
                | Fault::TokenRevoked { .. } => false,
                _ => true,
            };
            within && (matches!(self.loss(f), Some(Loss::Refilled)) || (blocks && long))
        })
    }

    /// Statuses the failure policies allow.
    pub(super) fn answers(&mut self) {
        let dead = self.rlqs_crash_windows();
        for s in self.r.sent {
            let t = s.answered_ns;
            let ok = match s.status {
                200 | 429 | 503 => true,
                0 if self.no_answer_allowed(s) => true,
                0 if s.envoy == Some(RLQS_ENVOY)
                    && dead.iter().any(|(a, b)| *a <= s.sent_ns && s.sent_ns < *b) =>
                {
                    self.rlqs_crashes.1 += 1;
                    true
                }
                _ => false,
            };
            if s.status == 503 {
                self.row_at(t).failed += 1;
            }
            if !ok {
                self.violations.push(Violation {
                    what: format!(
                        "{}/{}: request {} answered {} ({:?})",
                        s.rule, s.app, s.id, s.status, s.kind
                    ),
                    at_ns: t,
                    window: (s.sent_ns, t),
                });
            }
        }
    }

    /// While the RLQS Envoy was down of a crash of its own: Envoy 1.40's quota filter destroys a
    /// bucket's timer on a worker thread (docs/rlqs.md, fact 11), and the run's crowd of 2,000
    /// buckets met it in a few percent of runs, a segmentation fault in Envoy's main thread. That
    /// Envoy runs no code of ours; what it admitted until then is checked as everything else.
    /// Each crash its logs show opens a window at the first request it left unanswered with no
    /// fault to explain it, until the nemesis next restarted it (the run's end if never). Counted
    /// in [`Verdict::rlqs_crashes`]; a window without a crash in the logs is none.
    fn rlqs_crash_windows(&mut self) -> Vec<(u64, u64)> {
        let crashes = self
            .r
            .logs
            .iter()
            .filter(|(name, log)| name == "envoy rlqs" && log.contains(ENVOY_CRASHED))
            .count() as u64;
        self.rlqs_crashes.0 = crashes;
        let mut unanswered: Vec<&Sent> = self
            .r
            .sent
            .iter()
            .filter(|s| s.envoy == Some(RLQS_ENVOY) && s.status == 0)
            .filter(|s| !self.no_answer_allowed(s))
            .collect();
        unanswered.sort_by_key(|s| s.sent_ns);
        let restarted_after = |t: u64| {
            self.r
                .log
                .faults
                .iter()
                .filter_map(|f| match f.fault {
                    Fault::EnvoyRestart { envoy } if envoy == RLQS_ENVOY => Some(f.start_ns),
                    Fault::TokenRevoked { .. } => Some(f.end_ns),
                    _ => None,
                })
                .filter(|at| *at > t)
                .min()
                .unwrap_or(u64::MAX)
        };
        let mut windows: Vec<(u64, u64)> = Vec::new();
        for s in unanswered {
            if windows.len() as u64 == crashes {
                break;
            }
            if !windows
                .iter()
                .any(|(a, b)| *a <= s.sent_ns && s.sent_ns < *b)
            {
                windows.push((s.sent_ns, restarted_after(s.sent_ns)));
            }
        }
        windows
    }

    /// No answer: an Envoy restarted under it, a stream the upstream cut, or the direct caller's
    /// sidecar down.
    pub(super) fn no_answer_allowed(&self, s: &Sent) -> bool {
        if matches!(s.kind, Kind::Llm { cut: true, .. }) {
            return true;
        }
        self.r.log.faults.iter().any(|f| {
            let overlaps = f.start_ns <= s.answered_ns && s.sent_ns <= f.recovered_ns;
            overlaps
                && match (&f.fault, s.envoy) {
                    (Fault::EnvoyRestart { envoy }, Some(e)) => *envoy == e,
                    // Restarted with its new token at the end.
                    (Fault::TokenRevoked { .. }, Some(e)) => e == RLQS_ENVOY,
                    (Fault::SidecarRestart { sidecar: 0, .. }, None)
                    | (Fault::SidecarPause { sidecar: 0, .. }, None) => true,
                    _ => false,
                }
        })
    }

    /// While the RLQS Envoy's token is rotated out (from [`REVOKED_GRACE_NS`] after the file
    /// changed until a new one is issued), what it admits: no more than its last assignment
    /// held until its TTL (a bucket's capacity and its refill for the TTL) and its fallback
    /// after that (docs/rlqs.md: an Envoy whose stream ended for its token is in an outage). A
    /// stream that outlived its token goes on being assigned the bucket's refill.
    pub(super) fn revoked(&mut self) {
        let address = RLQS_ADDRESS.to_string();
        for f in &self.r.log.faults {
            if !matches!(f.fault, Fault::TokenRevoked { .. }) {
                continue;
            }
            let (from, to) = (f.start_ns + REVOKED_GRACE_NS, f.end_ns);
            let admitted: Vec<u64> = self
                .r
                .sent
                .iter()
                .filter(|s| s.rule == "per-ip" && s.app == address)
                .filter_map(|s| self.served.get(&s.id).map(|v| v.arrival_ns))
                .filter(|t| (from..=to).contains(t))
                .collect();
            let window_s = to.saturating_sub(from) as f64 / 1e9;
            let (c, r) = NATIVE_BUCKET;
            let (fc, fr) = RLQS_FALLBACK;
            let bound = c as f64 + r * RLQS_TTL_S + fc + fr * window_s + 1.0;
            if admitted.len() as f64 > bound {
                self.violations.push(Violation {
                    what: format!(
                        "per-ip/{address}: the RLQS Envoy admitted {} in {window_s:.1} s while its \
                         token was rotated out (at most {bound:.1}: its last assignment and its \
                         fallback)",
                        admitted.len()
                    ),
                    at_ns: admitted.last().copied().unwrap_or(to),
                    window: (from, to),
                });
            }
        }
    }

    /// A new client's first decision (the direct caller naming a subject for the first time) is
    /// allowed: its bucket is full, or under `--store-reset empty` refilled from the epoch a
    /// store loss began, so it is refused only within [`NEW_CLIENT_AFTER_FAULT_NS`] of a fault
    /// (a refusal elsewhere is a bucket that started empty with no loss to explain it).
    pub(super) fn new_clients(&mut self) {
        for s in self.r.sent {
            if !matches!(s.kind, Kind::Direct { fresh: true, .. }) || s.status != 429 {
                continue;
            }
            let near_a_fault = self.r.log.faults.iter().any(|f| {
                f.start_ns <= s.answered_ns
                    && s.sent_ns <= f.recovered_ns + NEW_CLIENT_AFTER_FAULT_NS
            });
            if !near_a_fault {
                self.violations.push(Violation {
                    what: format!(
                        "direct/{}: a new client's first request (request {}) refused with no \
                         fault before it",
                        s.app, s.id
                    ),
                    at_ns: s.answered_ns,
                    window: (s.sent_ns, s.answered_ns),
                });
            }
        }
    }

    /// The RLQS Envoy's quota stream breaks only when a fault breaks it: its Envoy restarted
    /// (its token rotated out and a new one issued), its sidecar killed or paused. Each such
    /// fault may open [`RLQS_STREAMS_PER_FAULT`] streams, and the run's first one; a stream that
    /// breaks at every report (one the sidecar cannot take: the crowd's reports are larger than
    /// a gRPC message may be) opens one a second.
    pub(super) fn rlqs_streams(&mut self) {
        let breaks = self
            .r
            .log
            .faults
            .iter()
            .filter(|f| match f.fault {
                Fault::EnvoyRestart { envoy } => envoy == RLQS_ENVOY,
                Fault::TokenRevoked { .. } => true,
                Fault::SidecarRestart { sidecar, .. } | Fault::SidecarPause { sidecar, .. } => {
                    sidecar == RLQS_SIDECAR
                }
                _ => false,
            })
            .count() as u64;
        let opened = self.counter(RLQS_STREAMS_OPENED);
        let most = 1 + RLQS_STREAMS_PER_FAULT * breaks;
        self.rlqs_streams = (opened, most);
        if opened > most {
            self.violations.push(Violation {
                what: format!(
                    "rlqs: sidecar {RLQS_SIDECAR} opened {opened} quota streams; {breaks} faults \
                     could break one, so at most {most}"
                ),
                at_ns: 0,
                window: (0, 0),
            });
        }
    }

    pub(super) fn counter(&self, name: &str) -> u64 {
        self.r
            .counters
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0, |c| c.1)
    }

    /// Every admitted `llm` or `bulk` request whose real cost was not its reservation queued a
    /// settlement
    /// (those an Envoy restart cut excepted).
    pub(super) fn settlements(&mut self) {
        let mut expected = 0;
        let mut unsure = 0;
        let mut unreadable = 0;
        for s in self.r.sent {
            let Kind::Llm {
                reserve,
                tokens,
                readable,
                ..
            } = s.kind
            else {
                continue;
            };
            // The native Envoy's settlements are its stream-done calls, counted by no filter.
            if !self.served.contains_key(&s.id) || s.envoy == Some(NATIVE_ENVOY) {
                continue;
            }
            unreadable += u64::from(!readable);
            let real = if readable { tokens } else { LLM_RESERVE_MAX };
            if real == reserve {
                continue;
            }
            if self.settlement_cut_by_restart(s) {
                unsure += 1;
            } else {
                expected += 1;
            }
        }
        let queued = self.counter("costs_settled");
        self.settlements = (
            queued,
            expected,
            self.counter("settlements_lost"),
            self.counter("settlements_retried"),
            self.counter("costs_unreported"),
            unreadable,
        );
        if queued < expected || queued > expected + unsure {
            self.violations.push(Violation {
                what: format!(
                    "llm and bulk: the gateways queued {queued} settlements; the record expects {expected} \
                     (and up to {unsure} more cut by an Envoy restart); they found {} costs \
                     unreported, the record {unreadable} unreadable answers",
                    self.counter("costs_unreported")
                ),
                at_ns: 0,
                window: (0, 0),
            });
        }
    }

    /// No call of a gateway was refused as malformed or too large: each batch it builds fits
    /// what its sidecar accepts (the authenticated caller sends only well-formed calls).
    pub(super) fn calls_refused(&mut self) {
        let refused = self.counter(CALLS_REFUSED);
        if refused > 0 {
            self.violations.push(Violation {
                what: format!(
                    "the sidecars refused {refused} calls as malformed or too large (400, 413): \
                     a gateway built a batch its sidecar does not accept"
                ),
                at_ns: 0,
                window: (0, 0),
            });
        }
    }

    /// No process panicked; each one's peak memory is under its bound.
    pub(super) fn processes(&mut self) {
        for (name, log) in self.r.logs {
            if let Some(line) = log.lines().find(|l| l.contains("panicked at")) {
                self.violations.push(Violation {
                    what: format!("{name} panicked: {line}"),
                    at_ns: 0,
                    window: (0, 0),
                });
            }
        }
        for (name, kib) in self.r.peak_rss_kib {
            let bound = RSS_BOUNDS_KIB
                .iter()
                .find(|(kind, _)| name.starts_with(kind))
                .map_or(u64::MAX, |b| b.1);
            if *kib > bound {
                self.violations.push(Violation {
                    what: format!("{name} reached {kib} KiB resident (bound {bound} KiB)"),
                    at_ns: 0,
                    window: (0, 0),
                });
            }
        }
    }
}
