//! One RLQS stream: its reports read, its buckets tracked, its rounds run until it ends or its
//! token is revoked.

use super::*;

/// One bucket of one stream.
pub(super) struct Tracked {
    pub(super) id: BucketId,
    pub(super) entries: Result<Entries, String>,
    pub(super) holding: Holding,
    pub(super) demand: Demand,
    pub(super) lease_id: u64,
}

/// One Envoy's stream: its buckets, their holdings and demand.
pub(super) struct Session<S> {
    pub(super) shared: Arc<Shared<S>>,
    pub(super) id: u64,
    /// Assignments out; an error ends the stream with that status.
    pub(super) tx: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
    /// The bearer token the stream was accepted with, if any.
    pub(super) credential: Option<Credential>,
    pub(super) domain: String,
    pub(super) buckets: HashMap<String, Tracked>,
    pub(super) warned_full: bool,
    pub(super) warned_too_large: bool,
}

/// What one bucket is told this round, before the store is asked.
pub(super) enum Round {
    Send(Strategy),
    /// A limit with a bucket: the planner's target, and its limit's name for the logs.
    Plan(Target),
    /// Nothing is sent (the store could not be asked).
    Skip,
}

impl<S: BucketStore> Session<S> {
    pub(super) async fn run(mut self, mut reports: Streaming<RateLimitQuotaUsageReports>) {
        let mut ticker =
            tokio::time::interval(Duration::from_millis(self.shared.settings.renew_ms.max(1)));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        let metrics = self.shared.decider.metrics().clone();
        metrics.rlqs_streams.inc();
        tracing::info!("rlqs stream {} opened", self.id);
        // The reports are read as they come, also while a round's store calls are out: Envoy
        // sends each new bucket's report alone, and unread small messages pile up in the HTTP/2
        // connection until its flood protection closes it (h2: GOAWAY "too_many_data_frames").
        let mut round: Option<(Planned, BoxFuture<'static, Vec<RequestAnswer>>)> = None;
        let mut fresh: Vec<String> = Vec::new();
        let mut renewal_due = false;
        // The answers of the last round not yet taken by the stream; no round starts before.
        let mut outbox: VecDeque<RateLimitQuotaResponse> = VecDeque::new();
        let tx = self.tx.clone();
        // Envoy closed its side: what it reported is still answered, then the stream ends. So too
        // when the sidecar begins to stop (a connection drains only once its streams have).
        let mut reports_ended = false;
        let stopping = self.shared.stopping.clone();
        loop {
            if reports_ended && round.is_none() && fresh.is_empty() && outbox.is_empty() {
                break;
            }
            if round.is_none() && outbox.is_empty() {
                // A renewal round plans every bucket, the new ones included.
                if renewal_due {
                    renewal_due = false;
                    fresh.clear();
                    let all: Vec<String> = self.buckets.keys().cloned().collect();
                    if !all.is_empty() {
                        round = Some(self.plan(all, true));
                    }
                } else if !fresh.is_empty() {
                    round = Some(self.plan(std::mem::take(&mut fresh), false));
                }
            }
            tokio::select! {
                message = reports.message(), if !reports_ended => match message {
                    Ok(Some(report)) => {
                        if self.revoked() {
                            self.end_unauthenticated().await;
                            break;
                        }
                        fresh.extend(self.on_report(report));
                    }
                    Ok(None) => {
                        tracing::info!("rlqs stream {}: Envoy closed it", self.id);
                        reports_ended = true;
                    }
                    Err(e) => {
                        tracing::info!("rlqs stream {} ended: {e}", self.id);
                        break;
                    }
                },
                () = stopping.stopped(), if !reports_ended => {
                    tracing::info!("rlqs stream {}: the sidecar is stopping", self.id);
                    reports_ended = true;
                }
                _ = ticker.tick(), if !reports_ended => {
                    if self.revoked() {
                        self.end_unauthenticated().await;
                        break;
                    }
                    renewal_due = true;
                }
                answers = async {
                    match round.as_mut() {
                        Some((_, calls)) => calls.await,
                        None => std::future::pending().await,
                    }
                }, if round.is_some() => {
                    if let Some((planned, _)) = round.take() {
                        outbox.extend(self.answer_round(planned, answers));
                    }
                }
                permit = tx.reserve(), if !outbox.is_empty() => match (permit, outbox.pop_front()) {
                    (Ok(permit), Some(response)) => permit.send(Ok(response)),
                    _ => {
                        went_away(self.id, &mut reports);
                        break;
                    }
                },
                _ = tx.closed(), if outbox.is_empty() => {
                    went_away(self.id, &mut reports);
                    break;
                }
            }
        }
        metrics.rlqs_streams.dec();
        if let Ok(mut demand) = self.shared.demand.lock() {
            let domain = self.domain.clone();
            for key in self.buckets.keys() {
                let k = (domain.clone(), key.clone());
                if let Some(streams) = demand.get_mut(&k) {
                    streams.remove(&self.id);
                    if streams.is_empty() {
                        demand.remove(&k);
                    }
                }
            }
        }
    }

    /// Whether the token the stream was accepted with was rotated out since.
    pub(super) fn revoked(&self) -> bool {
        !self
            .credential
            .as_ref()
            .is_none_or(Credential::still_accepted)
    }

    /// Ends the stream with UNAUTHENTICATED (Envoy reopens it, and the authentication refuses
    /// it); a stream Envoy does not read ends without the status.
    pub(super) async fn end_unauthenticated(&self) {
        tracing::info!(
            "rlqs stream {}: its bearer token is no longer accepted (--auth-token-file \
             changed): ending it",
            self.id
        );
        let status =
            Status::unauthenticated("the bearer token of this stream is no longer accepted");
        let _ = tokio::time::timeout(Duration::from_secs(1), self.tx.send(Err(status))).await;
    }

    pub(super) fn now_ms(&self) -> u64 {
        u64::try_from(self.shared.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Records a report's usage; returns the buckets seen for the first time.
    pub(super) fn on_report(&mut self, report: RateLimitQuotaUsageReports) -> Vec<String> {
        let now = self.now_ms();
        if self.domain.is_empty()
            && !report.domain.is_empty()
            && report.domain.len() <= MAX_NAME_BYTES
        {
            self.domain = report.domain.clone();
        }
        let metrics = self.shared.decider.metrics().clone();
        let mut fresh = Vec::new();
        let mut malformed: Option<(usize, String)> = None;
        for usage in report.bucket_quota_usages {
            // A report within the limit reached the service whole: its usages are bounded here
            // as the splitter bounds those of a larger one.
            if usage.encoded_len() > bucket_id::max_usage_bytes() {
                metrics.count_rlqs_usages_dropped("too_large", 1);
                if !self.warned_too_large {
                    self.warned_too_large = true;
                    tracing::warn!(
                        "rlqs stream {}: a bucket usage larger than any valid bucket id: it gets \
                         no assignment (ratelimit_rlqs_usages_dropped_total; logged once per \
                         stream)",
                        self.id
                    );
                }
                continue;
            }
            let Some(id) = usage.bucket_id else { continue };
            let key = bucket_id::canonical(&id.bucket);
            let requests = usage
                .num_requests_allowed
                .saturating_add(usage.num_requests_denied);
            if !self.buckets.contains_key(&key) {
                if self.buckets.len() >= self.shared.settings.max_buckets {
                    metrics.count_rlqs_usages_dropped("max_buckets", 1);
                    if !self.warned_full {
                        self.warned_full = true;
                        tracing::warn!(
                            "rlqs stream {}: more than --rlqs-max-buckets {} buckets; further \
                             buckets get no assignment (ratelimit_rlqs_usages_dropped_total; \
                             logged once per stream)",
                            self.id,
                            self.shared.settings.max_buckets
                        );
                    }
                    continue;
                }
                let entries = bucket_id::entries(&id.bucket);
                if let Err(e) = &entries {
                    let (n, _) = malformed.get_or_insert_with(|| (0, e.clone()));
                    *n += 1;
                }
                self.buckets.insert(
                    key.clone(),
                    Tracked {
                        id,
                        entries,
                        holding: Holding::default(),
                        demand: Demand::default(),
                        lease_id: rand::random::<u64>() & MAX_LEASE_ID,
                    },
                );
                fresh.push(key.clone());
            }
            if let Some(t) = self.buckets.get_mut(&key) {
                t.demand.report(now, requests);
                let per_sec = t.demand.per_sec();
                if let Ok(mut demand) = self.shared.demand.lock() {
                    demand
                        .entry((self.domain.clone(), key))
                        .or_default()
                        .insert(self.id, per_sec);
                }
            }
        }
        // Once per report: the message names keys and limits, never a value.
        if let Some((n, first)) = malformed {
            tracing::warn!(
                "rlqs stream {}: {n} new bucket id(s) beyond the wire's limits ({first}): \
                 assigned DENY_ALL",
                self.id
            );
        }
        fresh
    }

    /// What each bucket's rule says, under the policy in force; and how many buckets never
    /// assigned before are refused for naming no limit (each counted once).
    pub(super) fn classify(&self, keys: &[String]) -> (Vec<Round>, usize) {
        let policy = self.shared.decider.policy().current();
        let demand = self.shared.demand.lock().ok();
        let mut unknown = 0;
        let rounds = keys
            .iter()
            .map(|key| {
                let Some(t) = self.buckets.get(key) else {
                    return Round::Skip;
                };
                let Ok(entries) = &t.entries else {
                    return Round::Send(Strategy::DenyAll);
                };
                let refs: Vec<(&str, Option<&str>)> = entries
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_deref()))
                    .collect();
                match policy.resolve(&self.domain, &refs) {
                    Resolution::Limit(limit) => match limit.kind {
                        _ if limit.shadow => Round::Send(Strategy::AllowAll),
                        LimitKind::Unlimited => Round::Send(Strategy::AllowAll),
                        LimitKind::Blocked => Round::Send(Strategy::DenyAll),
                        LimitKind::Bucket {
                            capacity,
                            refill_per_sec,
                        } => {
                            let all: Vec<f64> = demand
                                .as_ref()
                                .and_then(|d| d.get(&(self.domain.clone(), key.clone())))
                                .map(|m| m.values().copied().collect())
                                .unwrap_or_default();
                            let mine = t.demand.per_sec();
                            let all = if all.is_empty() { vec![mine] } else { all };
                            Round::Plan(plan::target(capacity, refill_per_sec, mine, &all))
                        }
                    },
                    Resolution::NoLimit | Resolution::UnknownDomain => {
                        // Once per bucket and stream: renewals repeat it every second.
                        if t.holding.strategy().is_none() {
                            unknown += 1;
                            tracing::debug!(
                                "rlqs stream {}: no limit for bucket {:?} in domain {:?}: \
                                 assigned DENY_ALL",
                                self.id,
                                t.id.bucket,
                                self.domain
                            );
                        }
                        Round::Send(Strategy::DenyAll)
                    }
                }
            })
            .collect();
        (rounds, unknown)
    }
}

/// Logs that stream `id`'s answers are no longer read, and why if its reports say.
pub(super) fn went_away(id: u64, reports: &mut Streaming<RateLimitQuotaUsageReports>) {
    let why = match reports.message().now_or_never() {
        Some(Err(e)) => e.to_string(),
        Some(Ok(None)) => "its reports ended".into(),
        Some(Ok(Some(_))) | None => "its reports still open".into(),
    };
    tracing::info!("rlqs stream {id}: Envoy went away ({why})");
}

/// A round between its plan and the store's answers.
pub(super) struct Planned {
    pub(super) keys: Vec<String>,
    pub(super) rounds: Vec<Round>,
    pub(super) asks: Vec<Option<(plan::Ask, Option<usize>)>>,
    /// The planning time (ms on the stream's clock) and instant.
    pub(super) now: u64,
    pub(super) started: Instant,
}
