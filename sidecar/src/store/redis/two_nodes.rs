//! A Cluster of two in-memory nodes, for the tests of placement and compensation: keys containing
//! `=n2` live on node 2, the others on node 1. Node 2 can be made to fail, or to refuse its keys
//! as a moved slot does until the topology is read again (they then live on node 1). It records
//! the refunds it is asked.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{NodeId, Nodes};
use crate::store::memory::MemoryStore;
use crate::store::{BucketLimits, Charge, GrantCap, Group, RequestOutcome, StoreError, Work};

pub(super) const T0: u64 = 1_700_000_000_000_000;

#[derive(Clone)]
pub(super) struct TwoNodes(Arc<Inner>);

pub(super) struct Inner {
    pub n1: MemoryStore,
    pub n2: MemoryStore,
    /// Node 2 answers every call with a timeout.
    fail_n2: bool,
    /// Node 2's keys have moved to node 1: node 2 answers MOVED until the topology is read.
    moved_to_n1: AtomicBool,
    refreshed: AtomicBool,
    refunds: Mutex<Vec<(NodeId, Vec<usize>)>>,
}

pub(super) fn node(name: &str) -> NodeId {
    NodeId(Arc::from(name))
}

/// A charge of `cost` on `key`, a bucket of `capacity` refilled at 1 token a second.
pub(super) fn charge(key: &str, capacity: u64, cost: u64) -> Charge {
    Charge {
        receipt: 0,
        key: Arc::from(key),
        bucket: BucketLimits::new(capacity, 1.0),
        cost,
        shadow: false,
        lease: None,
        grant_cap: GrantCap::Share,
    }
}

impl TwoNodes {
    pub fn new() -> Self {
        Self::with(false, false)
    }

    /// Node 2 fails every call.
    pub fn failing_n2() -> Self {
        Self::with(true, false)
    }

    /// Node 2's keys have moved to node 1, which the topology shows once read again.
    pub fn moved_to_n1() -> Self {
        Self::with(false, true)
    }

    fn with(fail_n2: bool, moved: bool) -> Self {
        TwoNodes(Arc::new(Inner {
            n1: MemoryStore::new(T0, 0.1, 10_000),
            n2: MemoryStore::new(T0, 0.1, 10_000),
            fail_n2,
            moved_to_n1: AtomicBool::new(moved),
            refreshed: AtomicBool::new(false),
            refunds: Mutex::new(Vec::new()),
        }))
    }

    pub fn nodes(&self) -> &Inner {
        &self.0
    }

    fn store(&self, n: &NodeId) -> &MemoryStore {
        if &*n.0 == "n2" {
            &self.0.n2
        } else {
            &self.0.n1
        }
    }

    /// The refunds asked so far, once there are `n` (or after a second).
    pub async fn refunds(&self, n: usize) -> Vec<(NodeId, Vec<usize>)> {
        for _ in 0..200 {
            if self.0.refunds.lock().unwrap().len() >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.0.refunds.lock().unwrap().clone()
    }
}

impl Nodes for TwoNodes {
    fn node_of(&self, key: &str) -> NodeId {
        let moved = self.0.moved_to_n1.load(Ordering::SeqCst);
        let on_n2 = key.contains("=n2") && !(moved && self.0.refreshed.load(Ordering::SeqCst));
        node(if on_n2 { "n2" } else { "n1" })
    }

    async fn apply(
        &self,
        node: NodeId,
        work: Work,
    ) -> Result<Vec<Vec<RequestOutcome>>, StoreError> {
        if &*node.0 == "n2" {
            if self.0.fail_n2 {
                return Err(StoreError::Timeout { timeout_ms: 5 });
            }
            if self.0.moved_to_n1.load(Ordering::SeqCst) {
                return Err(StoreError::Moved("MOVED to n1".into()));
            }
        }
        Ok(self.store(&node).run(&work))
    }

    async fn refund(
        &self,
        node: NodeId,
        group: Group,
        requests: Vec<usize>,
    ) -> Result<bool, StoreError> {
        self.0
            .refunds
            .lock()
            .unwrap()
            .push((node.clone(), requests.clone()));
        Ok(self.store(&node).refund_now(&group, &requests))
    }

    async fn refresh_topology(&self) {
        self.0.refreshed.store(true, Ordering::SeqCst);
    }
}
