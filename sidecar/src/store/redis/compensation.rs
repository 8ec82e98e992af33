//! All-or-nothing across Cluster nodes: one script call is atomic only on its node, so a request
//! whose buckets live on several nodes is decided by one call per node, and its parts are merged
//! here into one answer. If every part admits, the request is admitted. If some part rejects, it
//! is rejected, and the parts that charged are refunded through their group's record, in the
//! background. If a part fails and none rejected, the request fails with that part's error. The
//! semantics, and what the refund window costs, are in `docs/bucket.md` ("Redis Cluster:
//! all-or-nothing across nodes").

use std::collections::HashMap;
use std::sync::Arc;

use super::placement::{NodeGroup, Placement};
use super::{NodeId, Nodes};
use crate::metrics::Metrics;
use crate::store::{Decided, Group, RequestOutcome, StoreError};

/// Each request's answer from its parts (`results`: one per group of `groups`, as sent), and the
/// refunds it needs, started in the background.
pub(super) fn answer<N: Nodes + Clone>(
    nodes: &N,
    metrics: &Arc<Metrics>,
    groups: Vec<NodeGroup>,
    placements: &[Vec<Placement>],
    results: Vec<Result<Vec<RequestOutcome>, StoreError>>,
) -> Vec<Result<Decided, StoreError>> {
    let mut refunds: HashMap<usize, Vec<usize>> = HashMap::new();
    let mut answers = Vec::with_capacity(placements.len());
    for placed in placements {
        // The groups this request was sent to, and its index in each.
        let parts: Vec<(usize, usize)> = {
            let mut g: Vec<(usize, usize)> = placed.iter().map(|p| (p.group, p.request)).collect();
            g.sort_unstable();
            g.dedup();
            g
        };
        let part = |(g, index): (usize, usize)| -> Result<&RequestOutcome, &StoreError> {
            results[g].as_ref().map(|v| &v[index])
        };
        let failure = parts.iter().find_map(|&g| part(g).err()).cloned();
        let rejected = parts.iter().any(|&g| part(g).is_ok_and(|o| !o.charged()));
        if let (Some(e), false) = (failure, rejected) {
            // No verdict. Refund what no caller can replay; a part under the caller's attempt
            // id stays charged, for a repeat of the call replays it.
            for &(g, index) in &parts {
                if groups[g].generated {
                    refunds.entry(g).or_default().push(index);
                }
            }
            answers.push(Err(e));
            continue;
        }
        let admitted = !rejected;
        if !admitted {
            // The failed parts too, in case their script ran.
            for &(g, index) in &parts {
                if part((g, index)).map_or(true, RequestOutcome::charged) {
                    refunds.entry(g).or_default().push(index);
                }
            }
        }
        let decisions = placed
            .iter()
            .map(|pl| {
                let request = &results[pl.group].as_ref().ok()?[pl.request];
                let mut o = request.decisions[pl.decision];
                if !admitted && request.charged() && o.allowed {
                    // Another node rejected: the figures as they will be once the refund has
                    // given the cost and the lease back.
                    let charge = &groups[pl.group].group.requests[pl.request][pl.decision];
                    let (capacity, refill_per_sec) = charge.bucket.in_force();
                    let back = charge.cost + o.leased;
                    o.remaining = o.remaining.saturating_add(back).min(capacity);
                    o.reset_ms = o
                        .reset_ms
                        .saturating_sub((back as f64 / refill_per_sec * 1000.0) as u64);
                }
                Some(o)
            })
            .collect();
        answers.push(Ok(Decided {
            admitted,
            decisions,
        }));
    }
    refund_in_background(nodes, metrics, groups, refunds);
    answers
}

/// Refunds the listed requests of each group in a task of its own, so neither the answer nor a
/// caller that gives up waits for it or cancels it. Counts a compensation per group once its
/// refund completed.
fn refund_in_background<N: Nodes + Clone>(
    nodes: &N,
    metrics: &Arc<Metrics>,
    groups: Vec<NodeGroup>,
    refunds: HashMap<usize, Vec<usize>>,
) {
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
    let nodes = nodes.clone();
    let metrics = metrics.clone();
    tokio::spawn(async move {
        let done = futures::future::join_all(
            work.into_iter()
                .map(|(node, group, list)| nodes.refund(node, group, list)),
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ratelimit_wire::Reason;

    use super::super::decide_on;
    use super::super::two_nodes::{charge, node, TwoNodes};
    use super::*;
    use crate::store::Call;

    /// A bucket of 5 on node 1, one of 2 on node 2.
    const APP: &str = "rl:{ratelimit|rule=per-app|app=n1}";
    const IP: &str = "rl:{ratelimit|rule=per-ip|ip=n2}";

    fn call(requests: Vec<Vec<crate::store::Charge>>) -> Call {
        Call {
            attempt: None,
            requests,
            returns: vec![],
        }
    }

    fn both() -> Vec<crate::store::Charge> {
        vec![charge(APP, 5, 1), charge(IP, 2, 1)]
    }

    #[tokio::test]
    async fn a_rejection_on_one_node_refunds_what_another_node_charged() {
        let nodes = TwoNodes::new();
        let metrics = Arc::new(Metrics::new());
        // The bucket on n2 holds 2: the third request is rejected there, and its charge on n1 is
        // given back.
        let a = decide_on(&nodes, &metrics, call(vec![both(), both(), both()])).await;
        let admitted: Vec<bool> = a.iter().map(|a| a.as_ref().unwrap().admitted).collect();
        assert_eq!(admitted, [true, true, false]);
        let n1_part = a[2].as_ref().unwrap().decisions[0].unwrap();
        assert_eq!(n1_part.remaining, 3, "as it will be after the refund");
        let refunds = nodes.refunds(1).await;
        assert_eq!(refunds, vec![(node("n1"), vec![2])]);
        assert_eq!(nodes.nodes().n1.stored_tokens(APP), Some(3.0));
        for _ in 0..100 {
            if metrics.encode().contains("ratelimit_compensations_total 1") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("the completed refund was never counted");
    }

    #[tokio::test]
    async fn a_failed_node_makes_a_request_fail_unless_another_node_rejected() {
        let nodes = TwoNodes::failing_n2();
        let metrics = Arc::new(Metrics::new());
        let a = decide_on(
            &nodes,
            &metrics,
            call(vec![both(), vec![charge(APP, 5, 1)]]),
        )
        .await;
        assert!(
            matches!(a[0], Err(StoreError::Timeout { .. })),
            "{:?}",
            a[0]
        );
        assert!(
            a[1].as_ref().unwrap().admitted,
            "a request on the healthy node is decided"
        );
        // The generated record lets the charged part on n1 be refunded (and the failed part on
        // n2, in case its script ran).
        assert_eq!(nodes.refunds(2).await.len(), 2);
        assert_eq!(
            nodes.nodes().n1.stored_tokens(APP),
            Some(4.0),
            "only the second request's charge stays"
        );
        // A part that rejects on n1 (its cost is more than the bucket holds): the failed part on
        // n2 does not turn the rejection into an error; it answered nothing, and is refunded.
        let a = decide_on(
            &nodes,
            &metrics,
            call(vec![vec![charge(APP, 5, 6), charge(IP, 2, 1)]]),
        )
        .await;
        let d = a[0].as_ref().expect("rejected, not failed");
        assert!(!d.admitted);
        assert_eq!(
            d.decisions[0].map(|o| o.reason),
            Some(Reason::CostExceedsCapacity)
        );
        assert_eq!(d.decisions[1], None, "the failed node answered nothing");
        assert_eq!(nodes.refunds(3).await[2], (node("n2"), vec![0]));
        assert_eq!(nodes.nodes().n1.stored_tokens(APP), Some(4.0));
    }

    #[tokio::test]
    async fn a_part_under_the_callers_attempt_stays_charged_when_another_fails() {
        let nodes = TwoNodes::failing_n2();
        let metrics = Arc::new(Metrics::new());
        let mut c = call(vec![both()]);
        c.attempt = Some("c-1".into());
        let a = decide_on(&nodes, &metrics, c.clone()).await;
        assert!(a[0].is_err());
        assert_eq!(nodes.nodes().n1.stored_tokens(APP), Some(4.0));
        // A repeat replays n1's part: nothing charged again there.
        let again = decide_on(&nodes, &metrics, c).await;
        assert!(again[0].is_err());
        assert_eq!(nodes.nodes().n1.stored_tokens(APP), Some(4.0));
        assert_eq!(nodes.refunds(0).await, vec![], "nothing to refund");
    }

    #[tokio::test]
    async fn a_group_a_moved_slot_refused_is_sent_again_where_its_keys_live_now() {
        let nodes = TwoNodes::moved_to_n1();
        let metrics = Arc::new(Metrics::new());
        let a = decide_on(&nodes, &metrics, call(vec![vec![charge(IP, 2, 1)]])).await;
        let d = a[0].as_ref().expect("decided on the new node");
        assert!(d.admitted);
        assert_eq!(d.decisions[0].map(|o| o.remaining), Some(1));
        assert_eq!(
            nodes.nodes().n1.stored_tokens(IP),
            Some(1.0),
            "charged once"
        );
        assert_eq!(nodes.nodes().n2.stored_tokens(IP), None);
    }
}
