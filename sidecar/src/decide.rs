//! The decision: validate a call, resolve each decision's limit in the policy, build its bucket
//! key, send the work to the Redis node(s) that hold the buckets, and answer each request.
//!
//! A call carries many requests (the filter coalesces them); each is all-or-nothing on its own.
//! Its decisions resolve to a limit (or to "unlimited" / "blocked", answered without Redis, or to
//! an unknown rule: a configuration error answered for that request, which the gateway handles
//! with its failure policy). The rest become charges, grouped by the node that holds their bucket.
//!
//! # All-or-nothing across nodes (compensation)
//!
//! One script call is atomic, but only on one node. On a single Redis (or the primary Sentinel
//! names) every request goes into one call. On a Cluster a request whose buckets live on several
//! nodes is decided by one call per node, concurrently; if every part admits, the request is
//! admitted. If some part rejects, the request is rejected and the parts that charged are
//! refunded through their group's record (idempotent). For that, a group holding such a request
//! always has a record: when the caller gave no attempt id, one is generated for the call.
//!
//! Refunds run in the background: the answer does not wait for them. The price is a short window
//! (a round trip or two) in which a charged part holds tokens for a rejected request: concurrent
//! requests on that bucket may then be rejected although tokens were about to come back. The
//! window can only over-REJECT, never over-admit. The figures answered for a refunded decision
//! (`remaining`, `reset_ms`) are as they will be once the refund lands. If the refund itself fails,
//! the tokens stay deducted until they refill.
//!
//! When a part fails (timeout, connection) and another part rejected, the request is still
//! rejected (never "unavailable", which a gateway's `on_error` might admit). The failed part's
//! decisions are answered `allowed: false`, `reason: ok`, with no figures: their buckets refused
//! nothing, they gave no answer. The failed part is refunded too, in case its script ran.
//!
//! When a part fails and none rejected, the request is answered "unavailable". Parts with
//! generated attempt ids are refunded (the failed ones included: no one can replay them); parts
//! with the caller's attempt id stay charged (a repeat of the call would replay them).
//!
//! A Cluster node that no longer serves a key answers before writing anything; the slot map is
//! then read again and that node's work is regrouped and sent once more.
//!
//! The whole decision runs in a task of its own (see [`crate::http`]), so a caller that hangs up
//! cancels neither the calls in flight nor the refunds that follow them.
//!
//! # Regional rules
//!
//! A decision of a regional rule (`docs/regions.md`) is charged under this region's share: its
//! bucket carries the share history this sidecar holds under a lease ([`RegionalShares`]), and
//! the script takes the bucket under the smallest share since its last decision. Without a valid
//! lease the request is answered "unavailable" (the gateway's `on_error` decides). The answer's
//! applied limit is the region's: the rule's numbers scaled by the share in force.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use ratelimit_wire::{
    elide_middle, AppliedLimit, DecideRequest, DecideResponse, DecisionResult, ErrorCode, LeaseAsk,
    Reason, RequestAnswer, RequestError, MAX_CALL_DECISIONS, MAX_DECISIONS, MAX_LEASE_ID,
    MAX_NAME_BYTES, MAX_REQUESTS, MAX_RETURNS, MAX_VALUE_BYTES,
};

use ratelimit_regions::ShareHistory;

use crate::keys::{bucket_key, record_key};
use crate::metrics::{Metrics, Verdict};
use crate::policy::own_format::RULE_KEY;
use crate::policy::reload::PolicyHandle;
use crate::policy::{Limit, LimitKind, Policy, Resolution, MAX_CAPACITY};
use crate::regional::RegionalShares;
use crate::store::{
    BucketLimits, BucketStore, Charge, Group, NodeId, Outcome, Readiness, RequestOutcome, Return,
    StoreError, Work,
};

/// The longest lease a caller may ask for, in milliseconds.
pub const MAX_LEASE_TTL_MS: u64 = 60_000;

/// Why a call got no answers at all.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// The call is malformed; the message names the field (answered 400).
    #[error("{0}")]
    Invalid(String),
}

/// The longest error message a refused call is answered with, in bytes. serde's messages quote
/// what they refuse (an unknown field, a string where a number belongs), and a caller chooses
/// that text: unbounded, one request could make the sidecar echo (and escape, up to six bytes a
/// byte) its whole body back.
pub const MAX_ERROR_BYTES: usize = 512;

/// Parses and validates a call body; the error names the field
/// (`requests[0].decisions[1].rule: ...`) and is at most [`MAX_ERROR_BYTES`] long.
pub fn parse_request(body: &[u8]) -> Result<DecideRequest, DecideError> {
    let bounded = |DecideError::Invalid(m)| DecideError::Invalid(elide_middle(m, MAX_ERROR_BYTES));
    // A body that parses is parsed once, without tracking the path (which allocates at every
    // field: a measurable share of a decision's CPU); one that does not is parsed again with the
    // path, for an error that names the field.
    if let Ok(request) = serde_json::from_slice::<DecideRequest>(body) {
        validate(&request).map_err(bounded)?;
        return Ok(request);
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let request: DecideRequest = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        bounded(if path == "." || path.is_empty() {
            DecideError::Invalid(e.inner().to_string())
        } else {
            DecideError::Invalid(format!("{path}: {}", e.inner()))
        })
    })?;
    de.end().map_err(|e| {
        bounded(DecideError::Invalid(format!(
            "trailing data after the JSON body: {e}"
        )))
    })?;
    validate(&request).map_err(bounded)?;
    Ok(request)
}

/// Checks what serde cannot: counts, lengths, names, costs, lease asks.
pub fn validate(call: &DecideRequest) -> Result<(), DecideError> {
    let invalid = |s: String| Err(DecideError::Invalid(s));
    if call.domain.is_empty() || call.domain.len() > MAX_NAME_BYTES {
        return invalid(format!("domain: must be 1 to {MAX_NAME_BYTES} bytes"));
    }
    if let Some(a) = &call.attempt {
        if a.is_empty() || a.len() > MAX_NAME_BYTES {
            return invalid(format!("attempt: must be 1 to {MAX_NAME_BYTES} bytes"));
        }
    }
    if call.requests.is_empty() && call.returns.is_empty() {
        return invalid("requests: must hold at least one request".into());
    }
    if call.requests.len() > MAX_REQUESTS {
        return invalid(format!(
            "requests: {} requests, at most {MAX_REQUESTS} are accepted",
            call.requests.len()
        ));
    }
    let mut total = 0;
    for (r, request) in call.requests.iter().enumerate() {
        let n = request.decisions.len();
        if n == 0 || n > MAX_DECISIONS {
            return invalid(format!(
                "requests[{r}].decisions: must hold 1 to {MAX_DECISIONS} decisions, got {n}"
            ));
        }
        total += n;
        for (d, decision) in request.decisions.iter().enumerate() {
            let at = format!("requests[{r}].decisions[{d}]");
            check_rule_and_subject(&at, &decision.rule, &decision.subject)?;
            if decision.cost == 0 || decision.cost > MAX_CAPACITY {
                return invalid(format!("{at}.cost: must be 1 to {MAX_CAPACITY}"));
            }
            if let Some(l) = &decision.lease {
                check_lease(&format!("{at}.lease"), l)?;
            }
        }
    }
    if total > MAX_CALL_DECISIONS {
        return invalid(format!(
            "requests: {total} decisions in all, at most {MAX_CALL_DECISIONS} are accepted"
        ));
    }
    if call.returns.len() > MAX_RETURNS {
        return invalid(format!("returns: at most {MAX_RETURNS} are accepted"));
    }
    for (i, r) in call.returns.iter().enumerate() {
        let at = format!("returns[{i}]");
        check_rule_and_subject(&at, &r.rule, &r.subject)?;
        if r.id > MAX_LEASE_ID {
            return invalid(format!("{at}.id: must be at most {MAX_LEASE_ID}"));
        }
        if r.tokens > MAX_CAPACITY {
            return invalid(format!("{at}.tokens: must be at most {MAX_CAPACITY}"));
        }
    }
    Ok(())
}

fn check_rule_and_subject(
    at: &str,
    rule: &str,
    subject: &ratelimit_wire::Subject,
) -> Result<(), DecideError> {
    let invalid = |s: String| Err(DecideError::Invalid(s));
    if rule.is_empty() || rule.len() > MAX_NAME_BYTES {
        return invalid(format!("{at}.rule: must be 1 to {MAX_NAME_BYTES} bytes"));
    }
    let mut seen = HashSet::new();
    for (k, v) in subject.iter() {
        if k.is_empty() || k.len() > MAX_NAME_BYTES || k == RULE_KEY {
            return invalid(format!(
                "{at}.subject: {k:?} is not a dimension name (1 to {MAX_NAME_BYTES} bytes, not \"rule\")"
            ));
        }
        if !seen.insert(k) {
            return invalid(format!("{at}.subject.{k}: named twice"));
        }
        if v.is_some_and(|v| v.len() > MAX_VALUE_BYTES) {
            return invalid(format!(
                "{at}.subject.{k}: the value is longer than {MAX_VALUE_BYTES} bytes"
            ));
        }
    }
    Ok(())
}

fn check_lease(at: &str, l: &LeaseAsk) -> Result<(), DecideError> {
    if l.id > MAX_LEASE_ID {
        return Err(DecideError::Invalid(format!(
            "{at}.id: must be at most {MAX_LEASE_ID}"
        )));
    }
    if l.ttl_ms == 0 || l.ttl_ms > MAX_LEASE_TTL_MS {
        return Err(DecideError::Invalid(format!(
            "{at}.ttl_ms: must be 1 to {MAX_LEASE_TTL_MS}"
        )));
    }
    if l.tokens > MAX_CAPACITY {
        return Err(DecideError::Invalid(format!(
            "{at}.tokens: must be at most {MAX_CAPACITY}"
        )));
    }
    Ok(())
}

/// Descriptor entries: (key, value), a `None` value being an unknown subject.
pub type Entries = Vec<(String, Option<String>)>;

/// One decision in the generic form both APIs share: descriptor entries, a cost, a lease ask.
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    pub entries: Entries,
    pub cost: u64,
    pub lease: Option<LeaseAsk>,
}

/// Unused lease tokens given back, in the generic form.
#[derive(Debug, Clone, PartialEq)]
pub struct ReturnItem {
    pub entries: Entries,
    pub lease_id: u64,
    pub tokens: u64,
}

/// Who asks: the wasm filter names rules (a rule the policy lacks is a configuration error), Envoy's
/// rate limit API sends descriptors (one that matches no limit is simply not limited).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    Filter,
    RateLimitService,
}

/// A resolved decision.
enum Plan {
    /// Counted in Redis (under this region's share history, for a regional limit).
    Charge {
        limit: Arc<Limit>,
        key: Arc<str>,
        share: Option<Arc<ShareHistory>>,
    },
    /// Answered here: unlimited (or not limited at all, for Envoy's API).
    Unlimited { limit: Option<Arc<Limit>> },
    /// Answered here: never admitted.
    Blocked { limit: Arc<Limit> },
}

/// Where one decision of a request went: its node group and position there.
#[derive(Clone, Copy)]
struct Placement {
    group: usize,
    request: usize,
    decision: usize,
}

/// One node's share of the call.
struct NodeGroup {
    node: NodeId,
    group: Group,
    /// Which call request each of the group's requests is.
    requests: Vec<usize>,
    /// The record's attempt was generated here (no caller can replay it).
    generated: bool,
}

/// Runs decisions against a [`BucketStore`] under the policy in force.
pub struct Decider<S> {
    store: Arc<S>,
    policy: Arc<PolicyHandle>,
    key_prefix: String,
    metrics: Arc<Metrics>,
    /// Unknown (domain, rule) pairs already logged, so a misconfigured gateway does not flood the
    /// log (bounded; every occurrence is still counted).
    logged_unknown: Mutex<HashSet<(String, String)>>,
    /// This region's shares of the regional rules (with `--region`).
    regional: Option<Arc<RegionalShares>>,
}

impl<S: BucketStore> Decider<S> {
    pub fn new(
        store: Arc<S>,
        policy: Arc<PolicyHandle>,
        key_prefix: impl Into<String>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            store,
            policy,
            key_prefix: key_prefix.into(),
            metrics,
            logged_unknown: Mutex::new(HashSet::new()),
            regional: None,
        }
    }

    /// Decides regional rules under `shares` (this sidecar's region).
    pub fn with_regional(mut self, shares: Arc<RegionalShares>) -> Self {
        self.regional = Some(shares);
        self
    }

    pub fn regional(&self) -> Option<&Arc<RegionalShares>> {
        self.regional.as_ref()
    }

    /// What `/readyz` reports: the store's readiness, and with regional rules the shares this
    /// region applies (not ready until each was read once).
    pub async fn readiness(&self) -> Readiness {
        let mut r = self.store.readiness().await;
        if let Some(shares) = &self.regional {
            let policy = self.policy.current();
            if !shares.all_read(&policy) {
                r.error.get_or_insert_with(|| {
                    "the regional shares have not all been read yet".to_string()
                });
                r.redis_ok = false;
            }
            r.regional_shares = Some(shares.status(&policy));
        }
        r
    }

    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    pub fn policy(&self) -> &Arc<PolicyHandle> {
        &self.policy
    }

    /// Decides a call that [`validate`] accepted ([`parse_request`] validates).
    pub async fn decide(&self, call: DecideRequest) -> DecideResponse {
        let requests: Vec<Vec<Item>> = call
            .requests
            .into_iter()
            .map(|r| {
                r.decisions
                    .into_iter()
                    .map(|d| Item {
                        entries: rule_entries(d.rule, d.subject),
                        cost: d.cost,
                        lease: d.lease,
                    })
                    .collect()
            })
            .collect();
        let returns: Vec<ReturnItem> = call
            .returns
            .into_iter()
            .map(|r| ReturnItem {
                entries: rule_entries(r.rule, r.subject),
                lease_id: r.id,
                tokens: r.tokens,
            })
            .collect();
        let answers = self
            .run(
                &call.domain,
                call.attempt.as_deref(),
                requests,
                returns,
                Caller::Filter,
            )
            .await;
        DecideResponse {
            answers,
            epoch: None,
        }
    }

    /// Decides requests of generic items (both APIs end here).
    pub async fn run(
        &self,
        domain: &str,
        attempt: Option<&str>,
        requests: Vec<Vec<Item>>,
        returns: Vec<ReturnItem>,
        caller: Caller,
    ) -> Vec<RequestAnswer> {
        let policy = self.policy.current().clone();
        let mut answers: Vec<Option<RequestAnswer>> = vec![None; requests.len()];
        let mut plans: Vec<Vec<Plan>> = Vec::with_capacity(requests.len());
        for (r, items) in requests.iter().enumerate() {
            match self.plan(&policy, domain, items, caller) {
                Ok(p) => plans.push(p),
                Err(e) => {
                    answers[r] = Some(error_answer(e));
                    plans.push(Vec::new());
                }
            }
        }
        let return_work = self.plan_returns(&policy, domain, &returns);
        drop(policy);

        // Requests a blocked limit rejects are answered here; the others go to Redis.
        let mut node_groups: Vec<NodeGroup> = Vec::new();
        let mut by_node: BTreeMap<NodeId, usize> = BTreeMap::new();
        let mut placements: Vec<Vec<Option<Placement>>> = Vec::with_capacity(requests.len());
        let mut generated: Option<String> = None;
        for (r, plan) in plans.iter().enumerate() {
            let mut placed = vec![None; plan.len()];
            if answers[r].is_some() || blocked(plan) {
                placements.push(placed);
                continue;
            }
            let mut nodes = plan.iter().filter_map(|p| match p {
                Plan::Charge { key, .. } => Some(self.store.node_of(key)),
                _ => None,
            });
            let first = nodes.next();
            let cross_node = nodes.any(|n| Some(n) != first);
            for (d, p) in plan.iter().enumerate() {
                let Plan::Charge { limit, key, share } = p else {
                    continue;
                };
                let node = self.store.node_of(key);
                let g = *by_node.entry(node.clone()).or_insert_with(|| {
                    node_groups.push(NodeGroup {
                        node,
                        group: Group {
                            record: None,
                            requests: Vec::new(),
                        },
                        requests: Vec::new(),
                        generated: false,
                    });
                    node_groups.len() - 1
                });
                let ng = &mut node_groups[g];
                if ng.requests.last() != Some(&r) {
                    ng.requests.push(r);
                    ng.group.requests.push(Vec::new());
                }
                let request = ng.group.requests.len() - 1;
                let charges = &mut ng.group.requests[request];
                charges.push(charge(limit, key.clone(), share.clone(), &requests[r][d]));
                placed[d] = Some(Placement {
                    group: g,
                    request,
                    decision: charges.len() - 1,
                });
                if (cross_node || attempt.is_some()) && ng.group.record.is_none() {
                    let (id, gen) = match attempt {
                        Some(a) => (a.to_string(), false),
                        None => (
                            generated.get_or_insert_with(generated_attempt).clone(),
                            true,
                        ),
                    };
                    ng.group.record = Some(record_key(key, &id));
                    ng.generated = gen;
                }
            }
            placements.push(placed);
        }

        let outcomes = self.send(node_groups, return_work).await;
        let (node_groups, results) = outcomes;

        // Merge the parts of each request.
        let mut refunds: HashMap<usize, Vec<usize>> = HashMap::new();
        let mut tally = Tally::default();
        for (r, plan) in plans.iter().enumerate() {
            if answers[r].is_some() {
                continue;
            }
            // The groups this request was sent to, and its index in each (its placements say).
            let parts: Vec<(usize, usize)> = {
                let mut g: Vec<(usize, usize)> = placements[r]
                    .iter()
                    .flatten()
                    .map(|p| (p.group, p.request))
                    .collect();
                g.sort_unstable();
                g.dedup();
                g
            };
            let part = |(g, index): (usize, usize)| -> Result<&RequestOutcome, &StoreError> {
                results[g].as_ref().map(|v| &v[index])
            };
            let failure = parts.iter().find_map(|&g| part(g).err()).cloned();
            let rejected =
                blocked(plan) || parts.iter().any(|&g| part(g).is_ok_and(|o| !o.charged()));
            if let (Some(e), false) = (&failure, rejected) {
                // No verdict. Refund what no caller can replay.
                for &(g, index) in &parts {
                    if node_groups[g].generated {
                        refunds.entry(g).or_default().push(index);
                    }
                }
                answers[r] = Some(error_answer(from_store(e)));
                continue;
            }
            let allowed = !rejected;
            if !allowed {
                for &(g, index) in &parts {
                    if part((g, index)).map_or(true, RequestOutcome::charged) {
                        refunds.entry(g).or_default().push(index);
                    }
                }
            }
            let results_r: Vec<DecisionResult> = plan
                .iter()
                .zip(&placements[r])
                .zip(&requests[r])
                .map(|((p, placed), item)| {
                    let sent = placed.and_then(|pl| {
                        let part = results[pl.group].as_ref().ok()?;
                        let request = &part[pl.request];
                        Some((request.decisions[pl.decision], request.charged()))
                    });
                    self.result(&mut tally, p, sent, allowed, item.cost)
                })
                .collect();
            answers[r] = Some(RequestAnswer {
                allowed,
                results: results_r,
                error: None,
            });
        }
        tally.add_to(&self.metrics);
        self.refund_in_background(node_groups, refunds);
        answers
            .into_iter()
            .map(|a| a.expect("every request answered"))
            .collect()
    }

    /// Resolves a request's items; an unknown rule (filter) fails the request.
    fn plan(
        &self,
        policy: &Policy,
        domain: &str,
        items: &[Item],
        caller: Caller,
    ) -> Result<Vec<Plan>, RequestError> {
        let mut plans = Vec::with_capacity(items.len());
        for item in items {
            let entries: Vec<(&str, Option<&str>)> = item
                .entries
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_deref()))
                .collect();
            let plan = match policy.resolve(domain, &entries) {
                Resolution::Limit(limit) => {
                    let limit = limit.clone();
                    match limit.kind {
                        LimitKind::Bucket { .. } => Plan::Charge {
                            key: Arc::from(bucket_key(&self.key_prefix, domain, &entries)),
                            share: self.share_for(&limit)?,
                            limit,
                        },
                        LimitKind::Unlimited => Plan::Unlimited { limit: Some(limit) },
                        LimitKind::Blocked => Plan::Blocked { limit },
                    }
                }
                Resolution::NoLimit if caller == Caller::RateLimitService => {
                    Plan::Unlimited { limit: None }
                }
                Resolution::NoLimit | Resolution::UnknownDomain => {
                    let rule = entries
                        .first()
                        .filter(|(k, _)| *k == RULE_KEY)
                        .and_then(|(_, v)| *v)
                        .unwrap_or("");
                    self.metrics.unknown_rule();
                    let first = self
                        .logged_unknown
                        .lock()
                        .map(|mut seen| {
                            seen.len() < 1000 && seen.insert((domain.into(), rule.into()))
                        })
                        .unwrap_or(false);
                    let message = if matches!(
                        policy.resolve(domain, &[]),
                        Resolution::UnknownDomain
                    ) {
                        format!("unknown domain {domain:?}: no policy file defines it")
                    } else {
                        format!("unknown rule {rule:?} in domain {domain:?} (or no limit matches its subject)")
                    };
                    if first {
                        tracing::error!("configuration error: {message}");
                    }
                    return Err(RequestError {
                        code: ErrorCode::UnknownRule,
                        message,
                    });
                }
            };
            plans.push(plan);
        }
        // envoyproxy/ratelimit's `replaces`: a limit named by another applicable limit's
        // `replaces` does not apply to this request.
        let replaced: HashSet<String> = plans
            .iter()
            .filter_map(plan_limit)
            .flat_map(|l| l.replaces.iter().cloned())
            .collect();
        if !replaced.is_empty() {
            for p in &mut plans {
                if plan_limit(p).is_some_and(|l| replaced.contains(&l.name)) {
                    *p = Plan::Unlimited { limit: None };
                }
            }
        }
        Ok(plans)
    }

    /// The share history a regional limit is charged under; none for other limits. A regional
    /// limit without a share under lease fails the request as "unavailable".
    fn share_for(&self, limit: &Limit) -> Result<Option<Arc<ShareHistory>>, RequestError> {
        let Some(rule) = &limit.regional else {
            return Ok(None);
        };
        let unavailable = |message: String| RequestError {
            code: ErrorCode::Unavailable,
            message,
        };
        match &self.regional {
            None => Err(unavailable(format!(
                "rule {:?} is regional and this sidecar has no region (--region)",
                rule.rule
            ))),
            Some(shares) => shares.share_for(rule).map(Some).map_err(unavailable),
        }
    }

    fn plan_returns(
        &self,
        policy: &Policy,
        domain: &str,
        returns: &[ReturnItem],
    ) -> Vec<(NodeId, Return)> {
        returns
            .iter()
            .filter_map(|r| {
                let entries: Vec<(&str, Option<&str>)> = r
                    .entries
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_deref()))
                    .collect();
                let Resolution::Limit(limit) = policy.resolve(domain, &entries) else {
                    return None;
                };
                let LimitKind::Bucket {
                    capacity,
                    refill_per_sec,
                } = limit.kind
                else {
                    return None;
                };
                // Without a share under lease the tokens are not given back (under-admission).
                let share = self.share_for(limit).ok()?;
                let key: Arc<str> = Arc::from(bucket_key(&self.key_prefix, domain, &entries));
                Some((
                    self.store.node_of(&key),
                    Return {
                        key,
                        bucket: BucketLimits {
                            capacity,
                            refill_per_sec,
                            share,
                        },
                        lease_id: r.lease_id,
                        tokens: r.tokens,
                    },
                ))
            })
            .collect()
    }

    /// Sends each node its work (concurrently); retries once, regrouped, what a moved slot
    /// refused. Returns the groups as finally sent and one result per group.
    async fn send(
        &self,
        groups: Vec<NodeGroup>,
        returns: Vec<(NodeId, Return)>,
    ) -> (Vec<NodeGroup>, Vec<Result<Vec<RequestOutcome>, StoreError>>) {
        let mut returns_by_node: BTreeMap<NodeId, Vec<Return>> = BTreeMap::new();
        for (node, r) in returns {
            returns_by_node.entry(node).or_default().push(r);
        }
        let mut calls = Vec::new();
        for ng in &groups {
            calls.push((
                ng.node.clone(),
                Work {
                    groups: vec![ng.group.clone()],
                    returns: returns_by_node.remove(&ng.node).unwrap_or_default(),
                },
            ));
        }
        for (node, rs) in returns_by_node {
            calls.push((
                node,
                Work {
                    groups: Vec::new(),
                    returns: rs,
                },
            ));
        }
        let answers = futures::future::join_all(
            calls
                .into_iter()
                .map(|(node, work)| self.store.apply(node, work)),
        )
        .await;
        let mut results: Vec<Result<Vec<RequestOutcome>, StoreError>> = answers
            .into_iter()
            .take(groups.len())
            .map(|a| {
                a.map(|mut g| {
                    if g.is_empty() {
                        Vec::new()
                    } else {
                        g.remove(0)
                    }
                })
            })
            .collect();
        // A moved slot: nothing was written on that node. Read the slot map again and resend
        // that group's work to where its keys live now (once).
        let moved: Vec<usize> = results
            .iter()
            .enumerate()
            .filter(|(_, r)| matches!(r, Err(StoreError::Moved(_))))
            .map(|(i, _)| i)
            .collect();
        if moved.is_empty() {
            return (groups, results);
        }
        self.store.refresh_topology().await;
        let mut groups = groups;
        for g in moved {
            let regrouped = self.regroup(&groups[g]);
            if regrouped.len() != 1 {
                // The group's keys now live on several nodes: answer it as unavailable this time
                // (nothing was charged); the next call is grouped by the new map.
                continue;
            }
            let (node, group) = regrouped.into_iter().next().expect("one group");
            let answer = self
                .store
                .apply(
                    node.clone(),
                    Work {
                        groups: vec![group.clone()],
                        returns: Vec::new(),
                    },
                )
                .await;
            groups[g].node = node;
            groups[g].group = group;
            results[g] = answer.map(|mut v| {
                if v.is_empty() {
                    Vec::new()
                } else {
                    v.remove(0)
                }
            });
        }
        (groups, results)
    }

    /// A group's requests by the node that serves their keys now.
    fn regroup(&self, ng: &NodeGroup) -> Vec<(NodeId, Group)> {
        let mut by: BTreeMap<NodeId, Group> = BTreeMap::new();
        for request in &ng.group.requests {
            let Some(first) = request.first() else {
                continue;
            };
            let node = self.store.node_of(&first.key);
            if request.iter().any(|c| self.store.node_of(&c.key) != node) {
                return Vec::new();
            }
            by.entry(node)
                .or_insert_with(|| Group {
                    record: ng.group.record.as_ref().map(|rec| {
                        let attempt = rec.rsplit_once(":a:").map_or("", |(_, a)| a);
                        record_key(&first.key, attempt)
                    }),
                    requests: Vec::new(),
                })
                .requests
                .push(request.clone());
        }
        by.into_iter().collect()
    }

    /// The wire result of one decision: `sent` is its bucket's outcome and whether its part
    /// charged, when it has one.
    fn result<'p>(
        &self,
        tally: &mut Tally<'p>,
        plan: &'p Plan,
        sent: Option<(Outcome, bool)>,
        request_allowed: bool,
        cost: u64,
    ) -> DecisionResult {
        match plan {
            Plan::Unlimited { limit } => {
                if let Some(l) = limit {
                    tally.add(&l.name, Verdict::Unlimited);
                }
                DecisionResult {
                    allowed: true,
                    remaining: 0,
                    retry_after_ms: 0,
                    reset_ms: 0,
                    reason: Reason::Unlimited,
                    limit: None,
                    shadow: false,
                    leased: 0,
                }
            }
            Plan::Blocked { limit } => {
                tally.add(
                    &limit.name,
                    if limit.shadow {
                        Verdict::ShadowRejected
                    } else {
                        Verdict::Blocked
                    },
                );
                DecisionResult {
                    allowed: limit.shadow,
                    remaining: 0,
                    retry_after_ms: 0,
                    reset_ms: 0,
                    reason: Reason::Blocked,
                    limit: Some(AppliedLimit {
                        name: limit.name.clone(),
                        capacity: 0,
                        refill_per_sec: 0.0,
                    }),
                    shadow: limit.shadow,
                    leased: 0,
                }
            }
            Plan::Charge { limit, share, .. } => {
                let LimitKind::Bucket {
                    capacity,
                    refill_per_sec,
                } = limit.kind
                else {
                    unreachable!("a charge has a bucket limit")
                };
                // A regional limit applies the region's part: the numbers under the share in
                // force, rounded down as the script does.
                let (capacity, refill_per_sec) = match share.as_ref().map(|h| h.current()) {
                    None => (capacity, refill_per_sec),
                    Some(s) => {
                        let ppm = f64::from(s.ppm());
                        (
                            (capacity as f64 * ppm / 1_000_000.0).floor() as u64,
                            (refill_per_sec * ppm).floor() / 1_000_000.0,
                        )
                    }
                };
                let applied = Some(AppliedLimit {
                    name: limit.name.clone(),
                    capacity,
                    refill_per_sec,
                });
                let Some((mut o, part_charged)) = sent else {
                    // Its part failed while another rejected, or the request was rejected
                    // before it was sent: no figures.
                    return DecisionResult {
                        allowed: false,
                        remaining: 0,
                        retry_after_ms: 0,
                        reset_ms: 0,
                        reason: Reason::Ok,
                        limit: applied,
                        shadow: limit.shadow,
                        leased: 0,
                    };
                };
                let verdict = match (o.allowed, limit.shadow) {
                    (true, _) if request_allowed => Verdict::Allowed,
                    (true, _) => Verdict::NotCharged,
                    (false, true) => Verdict::ShadowRejected,
                    (false, false) => Verdict::Rejected,
                };
                tally.add(&limit.name, verdict);
                if let (Some(rule), Some(shares)) = (&limit.regional, &self.regional) {
                    // The demand the rebalancer reads, in tokens: taken (cost and lease) or refused.
                    match verdict {
                        Verdict::Allowed => shares.count(rule, cost + o.leased, 0),
                        Verdict::Rejected | Verdict::ShadowRejected => shares.count(rule, 0, cost),
                        _ => {}
                    }
                }
                if !request_allowed && part_charged && o.allowed {
                    // Another node rejected: as it will be once the refund has given the cost
                    // and the lease back.
                    let back = cost + o.leased;
                    o.remaining = o.remaining.saturating_add(back).min(capacity);
                    o.reset_ms = o
                        .reset_ms
                        .saturating_sub((back as f64 / refill_per_sec * 1000.0) as u64);
                }
                DecisionResult {
                    allowed: o.allowed || limit.shadow,
                    remaining: o.remaining,
                    retry_after_ms: o.retry_after_ms,
                    reset_ms: o.reset_ms,
                    reason: o.reason,
                    limit: applied,
                    shadow: limit.shadow,
                    leased: if request_allowed { o.leased } else { 0 },
                }
            }
        }
    }

    /// Refunds the listed requests of each group in a task of its own, so neither the answer nor
    /// a caller that gives up waits for it or cancels it. Counts a compensation per group once
    /// its refund completed.
    fn refund_in_background(&self, groups: Vec<NodeGroup>, refunds: HashMap<usize, Vec<usize>>) {
        if refunds.is_empty() {
            return;
        }
        let work: Vec<(NodeId, Group, Vec<usize>)> = groups
            .into_iter()
            .enumerate()
            .filter_map(|(g, ng)| {
                let list = refunds.get(&g)?.clone();
                ng.group
                    .record
                    .is_some()
                    .then_some((ng.node, ng.group, list))
            })
            .collect();
        if work.is_empty() {
            return;
        }
        let store = self.store.clone();
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            let done = futures::future::join_all(
                work.into_iter()
                    .map(|(node, group, list)| store.refund(node, group, list)),
            )
            .await;
            for r in done {
                match r {
                    Ok(_) => {
                        metrics.compensations.inc();
                    }
                    Err(e) => tracing::warn!(
                        "refund did not complete, tokens stay deducted until they refill: {e}"
                    ),
                }
            }
        });
    }
}

/// The entries of a filter decision: `rule=<name>`, then the subject.
/// The attempt id the sidecar gives a call that names none but must be recorded (its requests
/// span Cluster nodes, so a failed node's partners can be refunded): 128 bits from the thread's
/// CSPRNG (seeded by the OS), so two calls never share one whatever the clock does, and no
/// recorded answer is replayed to another call.
fn generated_attempt() -> String {
    format!("gen-{:032x}", rand::random::<u128>())
}

fn rule_entries(rule: String, subject: ratelimit_wire::Subject) -> Entries {
    let mut entries = Vec::with_capacity(1 + subject.0.len());
    entries.push((RULE_KEY.to_string(), Some(rule)));
    entries.extend(subject.0);
    entries
}

fn charge(limit: &Limit, key: Arc<str>, share: Option<Arc<ShareHistory>>, item: &Item) -> Charge {
    let LimitKind::Bucket {
        capacity,
        refill_per_sec,
    } = limit.kind
    else {
        unreachable!("only bucket limits are charged")
    };
    Charge {
        key,
        bucket: BucketLimits {
            capacity,
            refill_per_sec,
            share,
        },
        cost: item.cost,
        shadow: limit.shadow,
        lease: item.lease.filter(|l| l.tokens > 0),
    }
}

/// A call's decisions counted per limit and verdict, added to the metrics once each (a label
/// lookup per limit and call, not per decision).
#[derive(Default)]
struct Tally<'a>(Vec<(&'a str, Verdict, u64)>);

impl<'a> Tally<'a> {
    fn add(&mut self, limit: &'a str, verdict: Verdict) {
        match self
            .0
            .iter_mut()
            .find(|(l, v, _)| *v == verdict && *l == limit)
        {
            Some((_, _, n)) => *n += 1,
            None => self.0.push((limit, verdict, 1)),
        }
    }

    fn add_to(self, metrics: &Metrics) {
        for (limit, verdict, n) in self.0 {
            metrics.decisions_of(limit, verdict, n);
        }
    }
}

fn plan_limit(p: &Plan) -> Option<&Limit> {
    match p {
        Plan::Charge { limit, .. } | Plan::Blocked { limit } => Some(limit),
        Plan::Unlimited { limit } => limit.as_deref(),
    }
}

/// A non-shadow blocked limit rejects the request before anything is sent.
fn blocked(plan: &[Plan]) -> bool {
    plan.iter()
        .any(|p| matches!(p, Plan::Blocked { limit } if !limit.shadow))
}

fn error_answer(e: RequestError) -> RequestAnswer {
    RequestAnswer {
        allowed: false,
        results: Vec::new(),
        error: Some(e),
    }
}

fn from_store(e: &StoreError) -> RequestError {
    RequestError {
        code: if e.is_deterministic() {
            ErrorCode::ScriptFailed
        } else {
            ErrorCode::Unavailable
        },
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex as StdMutex;

    use ratelimit_wire::{Decision, RequestDecisions, Subject};

    use super::*;
    use crate::policy::Bounds;
    use crate::regional::RegionalShares;
    use crate::store::memory::MemoryStore;

    #[test]
    fn generated_attempt_ids_are_distinct() {
        let ids: std::collections::HashSet<String> =
            (0..100_000).map(|_| generated_attempt()).collect();
        assert_eq!(ids.len(), 100_000);
        assert!(ids
            .iter()
            .all(|id| id.len() == 36 && id.starts_with("gen-")));
    }

    const T0: u64 = 1_700_000_000_000_000;

    const POLICY: &str = r#"
rules:
  per-app:
    capacity: 5
    refill_per_sec: 1
    overrides:
      - when: {app: vip}
        unlimited: true
      - when: {app: banned}
        blocked: true
  per-ip: {capacity: 2, refill_per_sec: 1}
  trial: {capacity: 1, refill_per_sec: 1, shadow_mode: true}
"#;

    fn policy(metrics: &Arc<Metrics>) -> Arc<PolicyHandle> {
        let p = Policy::from_sources(&[("limits.yaml".into(), POLICY.into())], &Bounds::default())
            .unwrap();
        PolicyHandle::fixed(p, metrics.clone())
    }

    fn decision(rule: &str, dims: &[(&str, Option<&str>)]) -> Decision {
        let mut subject = Subject::new();
        for (k, v) in dims {
            subject.push(*k, v.map(String::from));
        }
        Decision {
            rule: rule.into(),
            subject,
            cost: 1,
            lease: None,
        }
    }

    fn call(requests: Vec<Vec<Decision>>) -> DecideRequest {
        DecideRequest {
            domain: "ratelimit".into(),
            attempt: None,
            requests: requests
                .into_iter()
                .map(|decisions| RequestDecisions { decisions })
                .collect(),
            returns: Vec::new(),
        }
    }

    fn decider<S: BucketStore>(store: Arc<S>) -> (Decider<S>, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        (
            Decider::new(store, policy(&metrics), "rl:", metrics.clone()),
            metrics,
        )
    }

    fn err(body: &str) -> String {
        match parse_request(body.as_bytes()) {
            Err(DecideError::Invalid(e)) => e,
            Ok(_) => panic!("{body} should be invalid"),
        }
    }

    #[test]
    fn errors_quoting_a_caller_s_text_are_bounded_and_keep_both_ends() {
        let long = "x".repeat(100_000);
        for body in [
            format!(r#"{{"requests":[{{"decisions":[{{"rule":"r","cost":"{long}"}}]}}]}}"#),
            format!(r#"{{"{long}":1}}"#),
            format!(
                r#"{{"requests":[{{"decisions":[{{"rule":"r","subject":{{"{long}":"v"}}}}]}}]}}"#
            ),
        ] {
            let e = err(&body);
            assert!(e.len() <= MAX_ERROR_BYTES, "{} bytes", e.len());
            assert!(e.contains(" [...] "), "{e}");
        }
        let e = err(&format!(
            r#"{{"requests":[{{"decisions":[{{"rule":"r","cost":"{long}"}}]}}]}}"#
        ));
        assert!(
            e.starts_with("requests[0].decisions[0].cost: invalid type"),
            "{e}"
        );
        assert!(e.ends_with("expected u64 at line 1 column 100048"), "{e}");
    }

    #[test]
    fn validation_names_the_field() {
        assert!(err("nope").contains("expected"));
        assert!(err(r#"{"requests":[]}"#).starts_with("requests:"));
        assert!(err(r#"{"requests":[{"decisions":[]}]}"#).starts_with("requests[0].decisions:"));
        let e = err(r#"{"requests":[{"decisions":[{"rule":""}]}]}"#);
        assert!(e.starts_with("requests[0].decisions[0].rule:"), "{e}");
        let e = err(r#"{"requests":[{"decisions":[{"rule":"r","cost":0}]}]}"#);
        assert!(e.starts_with("requests[0].decisions[0].cost:"), "{e}");
        let e = err(r#"{"requests":[{"decisions":[{"rule":"r","subject":{"rule":"x"}}]}]}"#);
        assert!(e.starts_with("requests[0].decisions[0].subject:"), "{e}");
        let e = err(r#"{"requests":[{"decisions":[{"rule":"r","subject":{"a":"x","a":"y"}}]}]}"#);
        assert!(e.contains("subject.a: named twice"), "{e}");
        let e = err(r#"{"requests":[{"decisions":[{"rule":"r","capacity":5}]}]}"#);
        assert!(e.contains("capacity"), "{e}");
        let e = err(
            r#"{"requests":[{"decisions":[{"rule":"r","lease":{"id":1,"tokens":5,"ttl_ms":0}}]}]}"#,
        );
        assert!(
            e.starts_with("requests[0].decisions[0].lease.ttl_ms:"),
            "{e}"
        );
        let e = err(r#"{"requests":[{"decisions":[{"rule":"r"}]}]} x"#);
        assert!(e.contains("trailing"), "{e}");
        let many = format!(
            r#"{{"requests":[{}]}}"#,
            vec![r#"{"decisions":[{"rule":"r"}]}"#; MAX_REQUESTS + 1].join(",")
        );
        assert!(err(&many).contains("at most"));
    }

    #[tokio::test]
    async fn a_bucket_admits_its_capacity_and_answers_with_the_limit_it_applied() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, _) = decider(store);
        for i in 0..5 {
            let a = d
                .decide(call(vec![vec![decision("per-app", &[("app", Some("a"))])]]))
                .await;
            assert!(a.answers[0].allowed, "request {i}");
            let r = &a.answers[0].results[0];
            assert_eq!(r.remaining, 4 - i);
            assert_eq!(
                r.limit,
                Some(AppliedLimit {
                    name: "per-app".into(),
                    capacity: 5,
                    refill_per_sec: 1.0
                })
            );
        }
        let a = d
            .decide(call(vec![vec![decision("per-app", &[("app", Some("a"))])]]))
            .await;
        assert!(!a.answers[0].allowed);
        assert_eq!(a.answers[0].results[0].reason, Reason::Insufficient);
        assert_eq!(a.answers[0].results[0].retry_after_ms, 1000);
    }

    #[tokio::test]
    async fn requests_of_one_call_are_decided_in_order_each_all_or_nothing() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, metrics) = decider(store.clone());
        let both = || {
            vec![
                decision("per-app", &[("app", Some("a"))]),
                decision("per-ip", &[("ip", Some("1.2.3.4"))]),
            ]
        };
        let a = d.decide(call(vec![both(), both(), both()])).await;
        let allowed: Vec<bool> = a.answers.iter().map(|a| a.allowed).collect();
        assert_eq!(allowed, [true, true, false], "per-ip holds 2");
        // The third request's per-app decision could pay but was not charged.
        assert!(a.answers[2].results[0].allowed);
        // Counted per limit and verdict once per call, each decision in its count.
        let text = metrics.encode();
        for line in [
            "ratelimit_decisions_total{limit=\"per-app\",verdict=\"allowed\"} 2",
            "ratelimit_decisions_total{limit=\"per-app\",verdict=\"not_charged\"} 1",
            "ratelimit_decisions_total{limit=\"per-ip\",verdict=\"allowed\"} 2",
            "ratelimit_decisions_total{limit=\"per-ip\",verdict=\"rejected\"} 1",
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
        assert_eq!(
            store.stored_tokens("rl:{ratelimit|rule=per-app|app=a}"),
            Some(3.0)
        );
    }

    #[tokio::test]
    async fn overrides_unknown_rules_and_shadow_mode() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, metrics) = decider(store.clone());
        let a = d
            .decide(call(vec![
                vec![decision("per-app", &[("app", Some("vip"))])],
                vec![decision("per-app", &[("app", Some("banned"))])],
                vec![decision("nope", &[])],
                vec![decision("trial", &[]), decision("trial", &[])],
            ]))
            .await;
        assert!(a.answers[0].allowed);
        assert_eq!(a.answers[0].results[0].reason, Reason::Unlimited);
        assert!(!a.answers[1].allowed);
        assert_eq!(a.answers[1].results[0].reason, Reason::Blocked);
        let e = a.answers[2].error.as_ref().expect("unknown rule");
        assert_eq!(e.code, ErrorCode::UnknownRule);
        assert!(e.message.contains("\"nope\""), "{}", e.message);
        // Shadow mode: the second decision finds the bucket empty but does not reject.
        assert!(a.answers[3].allowed);
        assert!(a.answers[3].results[1].shadow);
        assert_eq!(a.answers[3].results[1].reason, Reason::Insufficient);
        assert_eq!(
            store.stored_tokens("rl:{ratelimit|rule=per-app|app=vip}"),
            None
        );
        let text = metrics.encode();
        assert!(text.contains("ratelimit_unknown_rule_total 1"), "{text}");
        assert!(
            text.contains(
                "ratelimit_decisions_total{limit=\"trial\",verdict=\"shadow_rejected\"} 1"
            ),
            "{text}"
        );
    }

    #[tokio::test]
    async fn unknown_subjects_share_one_bucket() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, _) = decider(store.clone());
        for _ in 0..2 {
            let a = d
                .decide(call(vec![vec![decision("per-ip", &[("ip", None)])]]))
                .await;
            assert!(a.answers[0].allowed);
        }
        let a = d
            .decide(call(vec![vec![decision("per-ip", &[("ip", None)])]]))
            .await;
        assert!(!a.answers[0].allowed);
        assert_eq!(
            store.stored_tokens("rl:{ratelimit|rule=per-ip|ip~}"),
            Some(0.0)
        );
    }

    /// Two in-memory nodes: keys containing "=n2" live on node 2. Records the refunds.
    struct TwoNodes {
        n1: MemoryStore,
        n2: MemoryStore,
        fail_n2: bool,
        refunds: StdMutex<Vec<(NodeId, Vec<usize>)>>,
    }

    impl TwoNodes {
        fn new(fail_n2: bool) -> Self {
            TwoNodes {
                n1: MemoryStore::new(T0, 0.1, 10_000),
                n2: MemoryStore::new(T0, 0.1, 10_000),
                fail_n2,
                refunds: StdMutex::new(Vec::new()),
            }
        }
        fn node(&self, n: &NodeId) -> &MemoryStore {
            if &*n.0 == "n2" {
                &self.n2
            } else {
                &self.n1
            }
        }
        async fn refunds(&self, n: usize) -> Vec<(NodeId, Vec<usize>)> {
            for _ in 0..200 {
                if self.refunds.lock().unwrap().len() >= n {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            self.refunds.lock().unwrap().clone()
        }
    }

    impl BucketStore for TwoNodes {
        fn node_of(&self, key: &str) -> NodeId {
            NodeId(Arc::from(if key.contains("=n2") { "n2" } else { "n1" }))
        }
        async fn apply(
            &self,
            node: NodeId,
            work: Work,
        ) -> Result<Vec<Vec<RequestOutcome>>, StoreError> {
            if self.fail_n2 && &*node.0 == "n2" {
                return Err(StoreError::Timeout { timeout_ms: 5 });
            }
            Ok(self.node(&node).run(&work))
        }
        async fn refund(
            &self,
            node: NodeId,
            group: Group,
            requests: Vec<usize>,
        ) -> Result<bool, StoreError> {
            self.refunds
                .lock()
                .unwrap()
                .push((node.clone(), requests.clone()));
            Ok(self.node(&node).refund_now(&group, &requests))
        }
    }

    #[tokio::test]
    async fn a_rejection_on_one_node_refunds_what_another_node_charged() {
        let store = Arc::new(TwoNodes::new(false));
        let (d, metrics) = decider(store.clone());
        let req = || {
            vec![
                decision("per-app", &[("app", Some("n1"))]),
                decision("per-ip", &[("ip", Some("n2"))]),
            ]
        };
        // per-ip (on n2) holds 2: the third request is rejected there, and its per-app charge on
        // n1 is given back.
        let a = d.decide(call(vec![req(), req(), req()])).await;
        let allowed: Vec<bool> = a.answers.iter().map(|a| a.allowed).collect();
        assert_eq!(allowed, [true, true, false]);
        assert_eq!(
            a.answers[2].results[0].remaining, 3,
            "as it will be after the refund"
        );
        let refunds = store.refunds(1).await;
        assert_eq!(refunds, vec![(NodeId(Arc::from("n1")), vec![2])]);
        assert_eq!(
            store.n1.stored_tokens("rl:{ratelimit|rule=per-app|app=n1}"),
            Some(3.0)
        );
        for _ in 0..100 {
            if metrics.encode().contains("ratelimit_compensations_total 1") {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        panic!("the completed refund was never counted");
    }

    #[tokio::test]
    async fn a_failed_node_makes_a_request_unavailable_unless_another_rejected() {
        let store = Arc::new(TwoNodes::new(true));
        let (d, _) = decider(store.clone());
        let a = d
            .decide(call(vec![
                vec![
                    decision("per-app", &[("app", Some("n1"))]),
                    decision("per-ip", &[("ip", Some("n2"))]),
                ],
                vec![decision("per-app", &[("app", Some("n1"))])],
            ]))
            .await;
        assert_eq!(
            a.answers[0].error.as_ref().map(|e| e.code),
            Some(ErrorCode::Unavailable)
        );
        assert!(
            a.answers[1].allowed,
            "a request on the healthy node is decided"
        );
        // The generated record lets the charged part on n1 be refunded.
        assert_eq!(store.refunds(2).await.len(), 2);
        assert_eq!(
            store.n1.stored_tokens("rl:{ratelimit|rule=per-app|app=n1}"),
            Some(4.0),
            "only the second request's charge stays"
        );
        // With a rejecting part on n1, the failed part does not turn the rejection into an error.
        let banned = d
            .decide(call(vec![vec![
                decision("per-app", &[("app", Some("banned"))]),
                decision("per-ip", &[("ip", Some("n2"))]),
            ]]))
            .await;
        assert!(!banned.answers[0].allowed);
        assert!(banned.answers[0].error.is_none());
    }

    #[tokio::test]
    async fn a_repeated_attempt_is_charged_once() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, _) = decider(store.clone());
        let mut c = call(vec![vec![decision("per-app", &[("app", Some("a"))])]]);
        c.attempt = Some("c-1".into());
        let first = d.decide(c.clone()).await;
        let again = d.decide(c).await;
        assert_eq!(first, again);
        assert_eq!(
            store.stored_tokens("rl:{ratelimit|rule=per-app|app=a}"),
            Some(4.0)
        );
    }

    #[tokio::test]
    async fn a_lease_is_granted_and_given_back() {
        let store = Arc::new(MemoryStore::new(T0, 0.5, 10_000));
        let (d, _) = decider(store.clone());
        let mut ask = decision("per-app", &[("app", Some("a"))]);
        ask.lease = Some(LeaseAsk {
            id: 9,
            tokens: 10,
            ttl_ms: 1000,
        });
        let a = d.decide(call(vec![vec![ask]])).await;
        assert_eq!(a.answers[0].results[0].leased, 2, "half of 5, rounded down");
        assert_eq!(
            store.stored_tokens("rl:{ratelimit|rule=per-app|app=a}"),
            Some(2.0)
        );
        let mut give = call(vec![]);
        give.returns.push(ratelimit_wire::LeaseReturn {
            rule: "per-app".into(),
            subject: decision("per-app", &[("app", Some("a"))]).subject,
            id: 9,
            tokens: 2,
        });
        d.decide(give).await;
        assert_eq!(
            store.stored_tokens("rl:{ratelimit|rule=per-app|app=a}"),
            Some(4.0)
        );
    }

    const REGIONAL: &str = r#"
rules:
  global:
    capacity: 100
    refill_per_sec: 10
    regions: {eu: 0.3, us: 0.7}
    overrides:
      - when: {app: big}
        capacity: 1000
        refill_per_sec: 100
"#;

    /// A decider for region eu of [`REGIONAL`], whose share of `global` is read from `store`.
    async fn regional_decider(
        store: Arc<MemoryStore>,
    ) -> (Decider<MemoryStore>, Arc<RegionalShares>) {
        let metrics = Arc::new(Metrics::new());
        let bounds = Bounds {
            region: crate::policy::RegionScope::Sidecar(Some("eu".into())),
            ..Bounds::default()
        };
        let p = Policy::from_sources(&[("limits.yaml".into(), REGIONAL.into())], &bounds).unwrap();
        let shares = RegionalShares::new("eu", "rl:", std::time::Duration::ZERO);
        shares.refresh(&*store, &p).await;
        let d = Decider::new(
            store,
            PolicyHandle::fixed(p, metrics.clone()),
            "rl:",
            metrics,
        )
        .with_regional(shares.clone());
        (d, shares)
    }

    #[tokio::test]
    async fn a_regional_rule_is_charged_under_this_regions_share() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        let (d, _) = regional_decider(store.clone()).await;
        let burst = |app: &'static str, n: usize| {
            call(vec![vec![decision("global", &[("app", Some(app))])]; n])
        };
        // No record yet: the policy's initial share, 0.3 of 100.
        let a = d.decide(burst("a", 40)).await;
        assert_eq!(a.answers.iter().filter(|a| a.allowed).count(), 30);
        assert_eq!(
            a.answers[0].results[0].limit,
            Some(AppliedLimit {
                name: "global".into(),
                capacity: 30,
                refill_per_sec: 3.0
            }),
            "the answer names the region's part"
        );
        // An override is scaled alike: 0.3 of 1000.
        let a = d.decide(burst("big", 400)).await;
        assert_eq!(a.answers.iter().filter(|a| a.allowed).count(), 300);
    }

    #[tokio::test]
    async fn a_share_without_a_lease_answers_unavailable_and_demand_is_counted() {
        let store = Arc::new(MemoryStore::new(T0, 0.1, 10_000));
        store.set_hash(
            "rl:share:{ratelimit|global}",
            &[
                ("version", "4"),
                ("share_ppm", "500000"),
                ("lease_ms", "30"),
                ("history", "0:500000"),
            ],
        );
        let (d, shares) = regional_decider(store.clone()).await;
        let a = d
            .decide(call(vec![
                vec![decision("global", &[("app", Some("a"))])];
                60
            ]))
            .await;
        assert_eq!(
            a.answers.iter().filter(|a| a.allowed).count(),
            50,
            "the record's 0.5"
        );
        shares.flush_demand(&*store).await;
        assert_eq!(
            crate::regional::record::parse_demand(&store.hash("rl:demand:{ratelimit|global}"))
                .unwrap(),
            (50, 10)
        );
        std::thread::sleep(std::time::Duration::from_millis(40));
        let a = d
            .decide(call(vec![vec![decision("global", &[("app", Some("a"))])]]))
            .await;
        let e = a.answers[0].error.as_ref().expect("unavailable");
        assert_eq!(e.code, ErrorCode::Unavailable);
        assert!(
            e.message.contains("past its lease of 30 ms"),
            "{}",
            e.message
        );
    }
}
