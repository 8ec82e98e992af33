//! Where a call's requests go: each request's charges grouped by the node that holds their
//! buckets (one group per node, decided in one script call), a record key for each group that
//! needs one, and the retry of a group a moved Cluster slot refused. On one node (a single Redis,
//! the primary Sentinel names) the whole call is one group.
//!
//! A group needs a record when the caller named an attempt (a repeat replays it), or when one of
//! its requests spans nodes (its charges there can be refunded, [`super::compensation`]); for
//! the latter, a call without an attempt id gets a generated one.

use std::collections::BTreeMap;

use super::{NodeId, Nodes};
use crate::keys::record_key;
use crate::store::{Call, Group, RequestOutcome, Return, StoreError, Work};

/// Where one charge of a request went: its group, and its place there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Placement {
    pub group: usize,
    pub request: usize,
    pub decision: usize,
}

/// One node's share of the call.
#[derive(Debug)]
pub(super) struct NodeGroup {
    pub node: NodeId,
    pub group: Group,
    /// Which request of the call each of the group's requests is.
    requests: Vec<usize>,
    /// The record's attempt was generated here (no caller can replay it).
    pub generated: bool,
}

/// A call placed on its nodes.
pub(super) struct Placed {
    pub groups: Vec<NodeGroup>,
    /// Per request of the call, per charge: where it went.
    pub placements: Vec<Vec<Placement>>,
    /// The lease returns, each with its node.
    pub returns: Vec<(NodeId, Return)>,
}

/// Groups `call`'s requests by the node of each charge.
pub(super) fn place<N: Nodes>(nodes: &N, call: Call) -> Placed {
    let Call {
        attempt,
        requests,
        returns,
    } = call;
    let mut groups: Vec<NodeGroup> = Vec::new();
    let mut by_node: BTreeMap<NodeId, usize> = BTreeMap::new();
    let mut placements: Vec<Vec<Placement>> = Vec::with_capacity(requests.len());
    let mut generated: Option<String> = None;
    for (r, charges) in requests.into_iter().enumerate() {
        let mut placed = Vec::with_capacity(charges.len());
        let mut of_request = charges.iter().map(|c| nodes.node_of(&c.key));
        let first = of_request.next();
        let cross_node = of_request.any(|n| Some(n) != first);
        for c in charges {
            let node = nodes.node_of(&c.key);
            let g = *by_node.entry(node.clone()).or_insert_with(|| {
                groups.push(NodeGroup {
                    node,
                    group: Group {
                        record: None,
                        requests: Vec::new(),
                    },
                    requests: Vec::new(),
                    generated: false,
                });
                groups.len() - 1
            });
            let ng = &mut groups[g];
            if ng.requests.last() != Some(&r) {
                ng.requests.push(r);
                ng.group.requests.push(Vec::new());
            }
            if (cross_node || attempt.is_some()) && ng.group.record.is_none() {
                let (id, gen) = match &attempt {
                    Some(a) => (a.clone(), false),
                    None => (
                        generated.get_or_insert_with(generated_attempt).clone(),
                        true,
                    ),
                };
                ng.group.record = Some(record_key(&c.key, &id));
                ng.generated = gen;
            }
            let request = ng.group.requests.len() - 1;
            let charges = &mut ng.group.requests[request];
            charges.push(c);
            placed.push(Placement {
                group: g,
                request,
                decision: charges.len() - 1,
            });
        }
        placements.push(placed);
    }
    let returns = returns
        .into_iter()
        .map(|r| (nodes.node_of(&r.key), r))
        .collect();
    Placed {
        groups,
        placements,
        returns,
    }
}

/// The attempt id a call that names none gets when it must be recorded (its requests span
/// Cluster nodes, so a failed node's partners can be refunded): 128 bits from the thread's
/// CSPRNG (seeded by the OS), so two calls never share one whatever the clock does, and no
/// recorded answer is replayed to another call.
fn generated_attempt() -> String {
    format!("gen-{:032x}", rand::random::<u128>())
}

/// Sends each node its work (concurrently); retries once, regrouped, what a moved slot refused.
/// Returns the groups as finally sent and one result per group.
pub(super) async fn send<N: Nodes>(
    nodes: &N,
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
            .map(|(node, work)| nodes.apply(node, work)),
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
    // A moved slot: nothing was written on that node. Read the slot map again and resend that
    // group's work to where its keys live now (once).
    let moved: Vec<usize> = results
        .iter()
        .enumerate()
        .filter(|(_, r)| matches!(r, Err(StoreError::Moved(_))))
        .map(|(i, _)| i)
        .collect();
    if moved.is_empty() {
        return (groups, results);
    }
    nodes.refresh_topology().await;
    let mut groups = groups;
    for g in moved {
        let regrouped = regroup(nodes, &groups[g]);
        if regrouped.len() != 1 {
            // The group's keys now live on several nodes: answer it as unavailable this time
            // (nothing was charged); the next call is grouped by the new map.
            continue;
        }
        let (node, group) = regrouped.into_iter().next().expect("one group");
        let answer = nodes
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
fn regroup<N: Nodes>(nodes: &N, ng: &NodeGroup) -> Vec<(NodeId, Group)> {
    let mut by: BTreeMap<NodeId, Group> = BTreeMap::new();
    for request in &ng.group.requests {
        let Some(first) = request.first() else {
            continue;
        };
        let node = nodes.node_of(&first.key);
        if request.iter().any(|c| nodes.node_of(&c.key) != node) {
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::two_nodes::{charge, node, TwoNodes};
    use super::*;
    use crate::store::BucketLimits;

    const A: &str = "rl:{app=n1}";
    const B: &str = "rl:{ip=n1}";
    const X: &str = "rl:{ip=n2}";

    fn at(group: usize, request: usize, decision: usize) -> Placement {
        Placement {
            group,
            request,
            decision,
        }
    }

    #[test]
    fn a_call_on_one_node_is_one_group_recorded_only_under_the_callers_attempt() {
        let nodes = TwoNodes::new();
        let call = |attempt: Option<&str>| Call {
            attempt: attempt.map(String::from),
            requests: vec![
                vec![charge(A, 5, 1)],
                vec![charge(B, 5, 1), charge(A, 5, 1)],
            ],
            returns: vec![],
        };
        let placed = place(&nodes, call(None));
        assert_eq!(placed.groups.len(), 1);
        assert_eq!(placed.groups[0].group.record, None);
        assert_eq!(
            placed.placements,
            vec![vec![at(0, 0, 0)], vec![at(0, 1, 0), at(0, 1, 1)]]
        );
        let placed = place(&nodes, call(Some("c-1")));
        assert_eq!(placed.groups.len(), 1);
        assert_eq!(
            placed.groups[0].group.record,
            Some(record_key(A, "c-1")),
            "keyed by the group's first bucket"
        );
        assert!(!placed.groups[0].generated);
    }

    #[test]
    fn a_request_across_nodes_has_each_part_recorded_under_one_generated_attempt() {
        let nodes = TwoNodes::new();
        let placed = place(
            &nodes,
            Call {
                attempt: None,
                requests: vec![
                    vec![charge(A, 5, 1)],
                    vec![charge(B, 5, 1), charge(X, 5, 1)],
                ],
                returns: vec![Return {
                    key: Arc::from(X),
                    bucket: BucketLimits::new(5, 1.0),
                    lease_id: 1,
                    tokens: 1,
                }],
            },
        );
        assert_eq!(
            placed.placements,
            vec![vec![at(0, 0, 0)], vec![at(0, 1, 0), at(1, 0, 0)]]
        );
        let [n1, n2] = &placed.groups[..] else {
            panic!("two groups: {:?}", placed.groups);
        };
        assert_eq!((&n1.node, &n2.node), (&node("n1"), &node("n2")));
        assert!(n1.generated && n2.generated);
        // Recorded from the first request that spans nodes, under one attempt.
        let attempt = |g: &NodeGroup, key: &str| {
            let record = g.group.record.clone().expect("recorded");
            let prefix = format!("{key}:a:");
            record.strip_prefix(&prefix).map(String::from)
        };
        let id = attempt(n1, B).expect("keyed by B");
        assert!(id.starts_with("gen-"), "{id}");
        assert_eq!(attempt(n2, X), Some(id));
        assert_eq!(placed.returns[0].0, node("n2"));
    }

    #[test]
    fn generated_attempt_ids_are_distinct() {
        let ids: std::collections::HashSet<String> =
            (0..100_000).map(|_| generated_attempt()).collect();
        assert_eq!(ids.len(), 100_000);
        assert!(ids
            .iter()
            .all(|id| id.len() == 36 && id.starts_with("gen-")));
    }
}
