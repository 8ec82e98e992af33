//! Per-node batching of script calls: the work for one Redis node that becomes ready while that
//! node's calls are in flight travels together in the next call. No timer: an idle node gets each
//! piece of work at once; a busy one gets it in batches, so the fixed cost of a script call
//! (protocol, script lookup, `TIME`) is shared by every decision in it.
//!
//! At most `max_in_flight` calls per node run at once (pipelined on the node's connections); a
//! call carries at most `max_decisions` decisions (one piece of work larger than that goes alone).
//! Work whose deadline passed while it waited is answered with a timeout and never sent, so it
//! cannot be applied after its caller gave up.
//!
//! A call keeps its slot until it ends (Redis answered, or the store gave up on it), not until
//! its callers' deadline: the callers are answered at their deadline by the store, but a call
//! already sent is still in Redis's queue and will run there. So a stalled Redis holds at most
//! `max_in_flight` calls of a node sent for nothing; the work that arrives meanwhile waits here,
//! is answered with a timeout at its deadline, and is never sent. (Were the slot freed at the
//! deadline, a stall of `t` would queue `max_in_flight` calls per timeout in Redis, all run, and
//! all charged, once it wakes.)

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::store::{RequestOutcome, StoreError, Work};

/// The answer to one piece of work: one outcome list per group.
pub type Answer = Result<Vec<Vec<RequestOutcome>>, StoreError>;

struct Job {
    work: Work,
    deadline: Instant,
    timeout_ms: u64,
    reply: oneshot::Sender<Answer>,
}

/// The batching queue of one node.
#[derive(Clone)]
pub struct Batcher {
    tx: mpsc::UnboundedSender<Job>,
}

impl Batcher {
    /// Starts the node's batching task; `call` runs one merged piece of work.
    pub fn spawn<F, Fut>(call: F, max_in_flight: usize, max_decisions: usize) -> Batcher
    where
        F: Fn(Work) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Answer> + Send + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(
            rx,
            Arc::new(call),
            Arc::new(Semaphore::new(max_in_flight.max(1))),
            max_decisions.max(1),
        ));
        Batcher { tx }
    }

    /// Queues `work` and waits for its answer. `timeout_ms` names the deadline in errors.
    pub async fn submit(&self, work: Work, deadline: Instant, timeout_ms: u64) -> Answer {
        let (reply, answer) = oneshot::channel();
        if self
            .tx
            .send(Job {
                work,
                deadline,
                timeout_ms,
                reply,
            })
            .is_err()
        {
            return Err(StoreError::Redis("the node's batching task stopped".into()));
        }
        answer
            .await
            .unwrap_or_else(|_| Err(StoreError::Redis("the node's batching task stopped".into())))
    }
}

fn size(work: &Work) -> usize {
    work.groups.iter().map(|g| g.decisions()).sum::<usize>() + work.returns.len()
}

async fn run<F, Fut>(
    mut rx: mpsc::UnboundedReceiver<Job>,
    call: Arc<F>,
    in_flight: Arc<Semaphore>,
    max_decisions: usize,
) where
    F: Fn(Work) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Answer> + Send + 'static,
{
    let mut held: Option<Job> = None;
    loop {
        let first = match held.take() {
            Some(j) => j,
            None => match rx.recv().await {
                Some(j) => j,
                None => return,
            },
        };
        // Wait for a free call slot; meanwhile more work queues up and joins this call.
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            return;
        };
        let now = Instant::now();
        let mut jobs: Vec<Job> = Vec::new();
        let mut total = 0;
        let take = |job: Job, jobs: &mut Vec<Job>, total: &mut usize| {
            if job.deadline <= now {
                let _ = job.reply.send(Err(StoreError::Timeout {
                    timeout_ms: job.timeout_ms,
                }));
            } else {
                *total += size(&job.work);
                jobs.push(job);
            }
        };
        take(first, &mut jobs, &mut total);
        while total < max_decisions {
            match rx.try_recv() {
                Ok(job) if total > 0 && total + size(&job.work) > max_decisions => {
                    held = Some(job);
                    break;
                }
                Ok(job) => take(job, &mut jobs, &mut total),
                Err(_) => break,
            }
        }
        if jobs.is_empty() {
            continue;
        }
        let call = call.clone();
        tokio::spawn(async move {
            let mut merged = Work::default();
            let mut shape = Vec::with_capacity(jobs.len());
            let mut replies = Vec::with_capacity(jobs.len());
            for job in jobs {
                shape.push(job.work.groups.len());
                merged.groups.extend(job.work.groups);
                merged.returns.extend(job.work.returns);
                replies.push(job.reply);
            }
            let answer = call(merged).await;
            drop(permit);
            match answer {
                Ok(mut groups) => {
                    for (reply, n) in replies.into_iter().zip(shape) {
                        let rest = groups.split_off(n.min(groups.len()));
                        let mine = std::mem::replace(&mut groups, rest);
                        let _ = reply.send(Ok(mine));
                    }
                }
                Err(e) => {
                    for reply in replies {
                        let _ = reply.send(Err(e.clone()));
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::store::{BucketLimits, BucketOutcome, Charge, GrantCap, Group, Status};

    fn work(key: &str) -> Work {
        Work {
            groups: vec![Group {
                record: None,
                requests: vec![vec![Charge {
                    receipt: 0,
                    key: Arc::from(key),
                    bucket: BucketLimits::new(1, 1.0),
                    cost: 1,
                    shadow: false,
                    lease: None,
                    grant_cap: GrantCap::Share,
                }]],
            }],
            returns: vec![],
        }
    }

    #[tokio::test]
    async fn work_that_arrives_during_a_call_shares_the_next_one_and_answers_go_back_in_order() {
        let calls = Arc::new(AtomicUsize::new(0));
        let sizes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (gate_tx, gate_rx) = tokio::sync::watch::channel(false);
        let b = {
            let (calls, sizes) = (calls.clone(), sizes.clone());
            Batcher::spawn(
                move |w: Work| {
                    let (calls, sizes, mut gate) = (calls.clone(), sizes.clone(), gate_rx.clone());
                    async move {
                        let n = calls.fetch_add(1, Ordering::SeqCst);
                        sizes.lock().unwrap().push(w.groups.len());
                        if n == 0 {
                            // The first call hangs until the others are queued.
                            let _ = gate.wait_for(|open| *open).await;
                        }
                        Ok(w.groups
                            .iter()
                            .map(|g| {
                                vec![RequestOutcome {
                                    status: Status::Charged,
                                    decisions: vec![BucketOutcome {
                                        allowed: true,
                                        remaining: g.requests[0][0].key.len() as u64,
                                        retry_after_ms: 0,
                                        reset_ms: 0,
                                        reason: ratelimit_wire::Reason::Ok,
                                        leased: 0,
                                    }],
                                }]
                            })
                            .collect())
                    }
                },
                1,
                100,
            )
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let first = tokio::spawn({
            let b = b.clone();
            async move { b.submit(work("a"), deadline, 1).await }
        });
        while calls.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        let rest: Vec<_> = ["bb", "ccc", "dddd"]
            .into_iter()
            .map(|k| {
                let b = b.clone();
                tokio::spawn(async move { b.submit(work(k), deadline, 1).await })
            })
            .collect();
        // Let the three queue up behind the hanging call, then release it.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        gate_tx.send(true).unwrap();
        assert_eq!(
            first.await.unwrap().unwrap()[0][0].decisions[0].remaining,
            1
        );
        for (i, r) in rest.into_iter().enumerate() {
            let got = r.await.unwrap().unwrap();
            assert_eq!(got.len(), 1);
            assert_eq!(
                got[0][0].decisions[0].remaining,
                i as u64 + 2,
                "answers in order"
            );
        }
        assert_eq!(
            *sizes.lock().unwrap(),
            vec![1, 3],
            "the three queued ones went in one call"
        );
    }

    #[tokio::test]
    async fn work_past_its_deadline_is_never_sent() {
        let calls = Arc::new(AtomicUsize::new(0));
        let b = {
            let calls = calls.clone();
            Batcher::spawn(
                move |_w: Work| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    async { Ok(vec![]) }
                },
                1,
                100,
            )
        };
        let r = b.submit(work("a"), Instant::now(), 5).await;
        assert!(
            matches!(r, Err(StoreError::Timeout { timeout_ms: 5 })),
            "{r:?}"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }
}
