//! How busy each bucket is at this worker.

/// How busy each bucket is at this worker: requests counted in fixed windows of `WINDOW_NS`,
/// for at most `MAX_TRACKED` buckets (a full table starts over: bounded memory).
#[derive(Debug, Default)]
pub struct Hotness {
    counts: std::collections::HashMap<String, (u64, u32, f64)>,
}

/// The counting window.
pub const WINDOW_NS: u64 = 200_000_000;
/// The most buckets one worker tracks.
pub const MAX_TRACKED: usize = 4096;

impl Hotness {
    /// Counts one request of `id` at `now_ns`; returns the rate of the last complete window
    /// (requests per second), or of the current one if it is higher.
    pub fn observe(&mut self, id: &str, now_ns: u64) -> f64 {
        if !self.counts.contains_key(id) {
            if self.counts.len() >= MAX_TRACKED {
                self.counts.clear();
            }
            // The id is copied only for a bucket not tracked yet.
            self.counts.insert(id.to_string(), (now_ns, 0, 0.0));
        }
        let Some((start, count, last_rate)) = self.counts.get_mut(id) else {
            return 0.0;
        };
        if now_ns >= *start + WINDOW_NS {
            let windows = (now_ns - *start) / WINDOW_NS;
            *last_rate = if windows == 1 {
                f64::from(*count) * 1e9 / WINDOW_NS as f64
            } else {
                0.0
            };
            *start += windows * WINDOW_NS;
            *count = 0;
        }
        *count = count.saturating_add(1);
        let current = f64::from(*count) * 1e9 / WINDOW_NS as f64;
        last_rate.max(current)
    }
}
