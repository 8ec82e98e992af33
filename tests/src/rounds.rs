//! Rounds of requests from many clients told apart by address (X-Forwarded-For), each on a new
//! connection so that every worker of an Envoy gets some; and the check that every client got
//! exactly its bucket. Used by the tests of how a multi-worker Envoy reaches its sidecar
//! (`worker_stream.rs`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::scenario::one_connection_client;
use crate::Envoy;

/// One answer of a round: the client's index, the status, how long it took.
pub struct RoundAnswer {
    pub key: usize,
    pub status: u16,
    pub elapsed: Duration,
}

/// The address of client `key` of `round`.
pub fn address(round: u8, key: usize) -> String {
    format!("10.{round}.{}.{}", key / 256, key % 256)
}

/// The statuses client `key` got, in the order they came.
pub fn statuses_of(answers: &[RoundAnswer], key: usize) -> Vec<u16> {
    answers
        .iter()
        .filter(|a| a.key == key)
        .map(|a| a.status)
        .collect()
}

/// `per_key` requests of `GET /x` for each of `keys` clients (addresses `10.<round>.x.y`),
/// interleaved, 24 at a time, each on a new connection so that every worker gets some.
pub fn round(envoy: &Envoy, round: u8, keys: usize, per_key: usize) -> Vec<RoundAnswer> {
    let url = envoy.url("/x");
    let answers = Mutex::new(Vec::new());
    let next = AtomicUsize::new(0);
    let n = keys * per_key;
    std::thread::scope(|s| {
        for _ in 0..24 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= n {
                    break;
                }
                let key = i % keys;
                let started = Instant::now();
                let status = one_connection_client()
                    .get(&url)
                    .header("x-forwarded-for", address(round, key))
                    .send()
                    .unwrap_or_else(|e| panic!("GET {url}: {e}"))
                    .status()
                    .as_u16();
                answers.lock().expect("not poisoned").push(RoundAnswer {
                    key,
                    status,
                    elapsed: started.elapsed(),
                });
            });
        }
    });
    answers.into_inner().expect("not poisoned")
}

/// Every client got exactly its bucket of 2: 2 admitted, the rest of its `per_key` rejected.
pub fn assert_exact(answers: &[RoundAnswer], keys: usize, per_key: usize) {
    for key in 0..keys {
        let mine = statuses_of(answers, key);
        let admitted = mine.iter().filter(|&&s| s == 200).count();
        let rejected = mine.iter().filter(|&&s| s == 429).count();
        assert_eq!(
            (admitted, rejected),
            (2, per_key - 2),
            "client {key}: {mine:?}"
        );
    }
}
