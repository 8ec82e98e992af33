//! The policy in force, and its live reload.
//!
//! Decisions read the policy through [`PolicyHandle::current`] (a lock-free pointer load). A
//! reload reads every file again; when their content changed and the new policy is valid, it is
//! swapped in atomically: decisions from then on use it, a decision already running finishes with
//! the policy it started with. An invalid new policy is logged and counted, and the old one stays
//! in force. Bucket state lives in Redis under keys that do not depend on the numbers, so a reload
//! loses no state: a bucket whose capacity shrank is clamped to the new capacity at its next
//! decision, one whose capacity grew refills to it at the new rate.
//!
//! What triggers a reload: a change in the directory of any policy file (a file watch on the
//! directory, not the file, so Kubernetes ConfigMap updates, which swap a symlink, are seen),
//! SIGHUP, and a check every [`POLL_INTERVAL`] in case a file system sends no events. Events
//! that change nothing are left out ([`may_change_policy`]): a file opened or read (the reload
//! itself reads the files: counted as changes, they made it read them again, about 20 times a
//! second, forever) and writes to other files of the directory (a log file beside the policy).

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use notify::event::{AccessKind, AccessMode, ModifyKind};
use notify::{EventKind, RecursiveMode, Watcher};

use super::{Bounds, Policy, PolicyError};
use crate::decide::named::RecentlyNamed;
use crate::metrics::Metrics;

/// How often the files are read again even without a file-system event.
pub const POLL_INTERVAL: Duration = Duration::from_secs(5);

/// The policy in force and where it comes from.
pub struct PolicyHandle {
    current: ArcSwap<Policy>,
    paths: Vec<PathBuf>,
    bounds: Bounds,
    /// A hash of the files' content as last loaded (or last refused), to skip no-op reloads.
    fingerprint: Mutex<u64>,
    /// How many times the files were read to look for a change.
    checks: AtomicU64,
    metrics: Arc<Metrics>,
    /// The rules gateways named recently: a reload that drops one warns, naming it.
    named: RecentlyNamed,
    /// Per limit name, a `slot_ttl_ms` a reload lowered or dropped, and until when requests
    /// given it may not have renewed under the new one ([`Self::slot_unsure_ms`]).
    replaced_ttls: Mutex<HashMap<String, (u64, Instant)>>,
}

impl PolicyHandle {
    /// Loads the policy for the first time: an error here refuses to start.
    pub fn load(
        paths: Vec<PathBuf>,
        bounds: Bounds,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<PolicyHandle>, PolicyError> {
        let policy = Policy::load(&paths, &bounds)?;
        metrics.policy_loaded(policy.limit_count());
        Ok(Arc::new(PolicyHandle {
            current: ArcSwap::from_pointee(policy),
            fingerprint: Mutex::new(fingerprint(&paths)),
            checks: AtomicU64::new(0),
            paths,
            bounds,
            metrics,
            named: RecentlyNamed::default(),
            replaced_ttls: Mutex::default(),
        }))
    }

    /// A handle on a policy given in memory (tests, embedding); it never reloads.
    pub fn fixed(policy: Policy, metrics: Arc<Metrics>) -> Arc<PolicyHandle> {
        metrics.policy_loaded(policy.limit_count());
        Arc::new(PolicyHandle {
            current: ArcSwap::from_pointee(policy),
            paths: Vec::new(),
            bounds: Bounds::default(),
            fingerprint: Mutex::new(0),
            checks: AtomicU64::new(0),
            metrics,
            named: RecentlyNamed::default(),
            replaced_ttls: Mutex::default(),
        })
    }

    /// The policy in force.
    pub fn current(&self) -> arc_swap::Guard<Arc<Policy>> {
        self.current.load()
    }

    /// The rules gateways named recently (noted by the decider).
    pub fn named(&self) -> &RecentlyNamed {
        &self.named
    }

    /// Reads the files again; swaps the policy in when they changed and are valid. `Ok(true)`
    /// when a new policy is in force, `Ok(false)` when nothing changed.
    pub fn reload(&self, why: &str) -> Result<bool, PolicyError> {
        if self.paths.is_empty() {
            return Ok(false);
        }
        self.checks.fetch_add(1, Ordering::Relaxed);
        let print = fingerprint(&self.paths);
        {
            let mut last = self.fingerprint.lock().expect("not poisoned");
            if *last == print {
                return Ok(false);
            }
            *last = print;
        }
        match Policy::load(&self.paths, &self.bounds) {
            Ok(policy) => {
                let limits = policy.limit_count();
                self.note_replaced_ttls(&self.current(), &policy);
                self.current.store(Arc::new(policy));
                self.metrics.policy_loaded(limits);
                self.named
                    .dropped_by(&self.current(), &self.metrics, std::time::Instant::now());
                tracing::info!(
                    files = %super::describe(&self.paths),
                    limits,
                    trigger = why,
                    "policy reloaded"
                );
                Ok(true)
            }
            Err(e) => {
                self.metrics.policy_refused();
                tracing::error!(
                    files = %super::describe(&self.paths),
                    trigger = why,
                    "policy reload refused, the previous policy stays in force: {e}"
                );
                Err(e)
            }
        }
    }

    /// How long after a store's epoch (`--store-reset empty`) the concurrency set of limit
    /// `name`, whose `slot_ttl_ms` is `ttl_ms`, may lack slots of requests still running: a
    /// request renews within a third of the ttl its last answer named, so `ttl_ms`, or the
    /// larger ttl a reload replaced less than that larger ttl ago (its requests may not have
    /// renewed since). `lua/slots.lua`'s `unsure_ms`; docs/concurrency.md.
    pub fn slot_unsure_ms(&self, name: &str, ttl_ms: u64) -> u64 {
        let replaced = self.replaced_ttls.lock().expect("not poisoned");
        match replaced.get(name) {
            Some(&(old, until)) if Instant::now() < until => old.max(ttl_ms),
            _ => ttl_ms,
        }
    }

    /// Remembers each `slot_ttl_ms` that `new` lowers or drops from `old`, for that ttl.
    fn note_replaced_ttls(&self, old: &Policy, new: &Policy) {
        let now = Instant::now();
        let after = new.slot_ttls();
        let mut replaced = self.replaced_ttls.lock().expect("not poisoned");
        replaced.retain(|_, (_, until)| now < *until);
        for (name, ttl) in old.slot_ttls() {
            if after.get(&name).is_none_or(|t| *t < ttl) {
                let until = now + Duration::from_millis(ttl);
                let e = replaced.entry(name).or_insert((ttl, until));
                *e = (e.0.max(ttl), e.1.max(until));
            }
        }
    }

    /// How many times the files were read to look for a change (by any trigger).
    pub fn checks(&self) -> u64 {
        self.checks.load(Ordering::Relaxed)
    }

    /// Starts the reload triggers (file watch, SIGHUP, polling) in the background, for as long as
    /// the returned guard lives.
    pub fn watch(self: &Arc<Self>) -> WatchGuard {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<&'static str>(16);
        let mut watcher = None;
        if !self.paths.is_empty() {
            let events = tx.clone();
            let files = self.paths.clone();
            match notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                // An error from the watcher may hide a change: look.
                if event.is_err() || event.is_ok_and(|e| may_change_policy(&e, &files)) {
                    let _ = events.try_send("file change");
                }
            }) {
                Ok(mut w) => {
                    let mut dirs: Vec<&Path> = self
                        .paths
                        .iter()
                        .map(|p| {
                            p.parent()
                                .filter(|d| !d.as_os_str().is_empty())
                                .unwrap_or(Path::new("."))
                        })
                        .collect();
                    dirs.sort();
                    dirs.dedup();
                    for dir in dirs {
                        if let Err(e) = w.watch(dir, RecursiveMode::NonRecursive) {
                            tracing::warn!(dir = %dir.display(), "cannot watch the policy directory ({e}); relying on SIGHUP and polling");
                        }
                    }
                    watcher = Some(w);
                }
                Err(e) => tracing::warn!("no file watcher ({e}); relying on SIGHUP and polling"),
            }
        }
        let mut tasks = Vec::new();
        #[cfg(unix)]
        {
            let hup = tx.clone();
            tasks.push(tokio::spawn(async move {
                use tokio::signal::unix::{signal, SignalKind};
                let Ok(mut s) = signal(SignalKind::hangup()) else {
                    return;
                };
                while s.recv().await.is_some() {
                    let _ = hup.send("SIGHUP").await;
                }
            }));
        }
        let poll = tx;
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(POLL_INTERVAL);
            tick.tick().await;
            loop {
                tick.tick().await;
                if poll.send("poll").await.is_err() {
                    return;
                }
            }
        }));
        let handle = self.clone();
        tasks.push(tokio::spawn(async move {
            while let Some(why) = rx.recv().await {
                // Editors and ConfigMap updates write in several steps: let them finish, and
                // take every trigger that came meanwhile as one.
                tokio::time::sleep(Duration::from_millis(50)).await;
                while rx.try_recv().is_ok() {}
                let h = handle.clone();
                let _ = tokio::task::spawn_blocking(move || h.reload(why)).await;
            }
        }));
        WatchGuard {
            _watcher: watcher,
            tasks,
        }
    }
}

/// Keeps the reload triggers running; stops them on drop.
pub struct WatchGuard {
    _watcher: Option<notify::RecommendedWatcher>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Whether `event`, in the directory of some of `files`, may have changed the policy.
fn may_change_policy(event: &notify::Event, files: &[PathBuf]) -> bool {
    let names_a_policy_file = event.paths.iter().any(|p| {
        p.file_name()
            .is_some_and(|n| files.iter().any(|f| f.file_name() == Some(n)))
    });
    match event.kind {
        // A file written and closed: a policy file's new content is complete.
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => names_a_policy_file,
        // Opened, read, closed after reading: nothing changed (the reload reads the files).
        EventKind::Access(_) => false,
        // Something created, removed or renamed in the directory: a policy file, or the symlink
        // a ConfigMap update swaps (`..data`), whose name is none of the files'.
        EventKind::Create(_) | EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(_)) => {
            true
        }
        // Content or metadata: only a policy file's, not a log file's written beside it.
        EventKind::Modify(_) => names_a_policy_file,
        EventKind::Any | EventKind::Other => true,
    }
}

/// A hash of the files' bytes (an unreadable file hashes as its error, so it is retried).
fn fingerprint(paths: &[PathBuf]) -> u64 {
    let mut h = DefaultHasher::new();
    for p in paths {
        match std::fs::read(p) {
            Ok(bytes) => bytes.hash(&mut h),
            Err(e) => e.kind().to_string().hash(&mut h),
        }
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::super::Resolution;
    use super::*;

    fn capacity(h: &PolicyHandle) -> Option<u64> {
        match h.current().resolve("ratelimit", &[("rule", Some("r"))]) {
            Resolution::Limit(l) => match l.kind {
                super::super::LimitKind::Bucket { capacity, .. } => Some(capacity),
                _ => None,
            },
            _ => None,
        }
    }

    #[test]
    fn a_valid_change_is_swapped_in_and_an_invalid_one_keeps_the_old_policy() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("limits.yaml");
        std::fs::write(&file, "rules:\n  r: {capacity: 5, refill_per_sec: 1}\n").unwrap();
        let metrics = Arc::new(Metrics::new());
        let h = PolicyHandle::load(vec![file.clone()], Bounds::default(), metrics.clone()).unwrap();
        assert_eq!(capacity(&h), Some(5));
        assert!(!h.reload("test").unwrap(), "unchanged");
        std::fs::write(&file, "rules:\n  r: {capacity: 7, refill_per_sec: 1}\n").unwrap();
        assert!(h.reload("test").unwrap());
        assert_eq!(capacity(&h), Some(7));
        std::fs::write(&file, "rules:\n  r: {capacity: 0, refill_per_sec: 1}\n").unwrap();
        let e = h.reload("test").unwrap_err();
        assert!(e.to_string().contains("rules.r.capacity"), "{e}");
        assert_eq!(capacity(&h), Some(7), "the old policy stays in force");
        let text = metrics.encode();
        assert!(
            text.contains("ratelimit_policy_reloads_total{result=\"invalid\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("ratelimit_policy_reloads_total{result=\"ok\"} 2"),
            "{text}"
        );
    }

    #[test]
    fn only_events_that_may_change_the_policy_trigger_a_reload() {
        use notify::event::{CreateKind, DataChange, RemoveKind, RenameMode};
        let files = [PathBuf::from("/etc/rl/limits.yaml")];
        let event = |kind, path: &str| notify::Event::new(kind).add_path(PathBuf::from(path));
        let policy = "/etc/rl/limits.yaml";
        let log = "/etc/rl/sidecar.log";
        let cases = [
            (
                EventKind::Access(AccessKind::Open(AccessMode::Any)),
                policy,
                false,
            ),
            (EventKind::Access(AccessKind::Read), policy, false),
            (
                EventKind::Access(AccessKind::Close(AccessMode::Read)),
                policy,
                false,
            ),
            (
                EventKind::Access(AccessKind::Close(AccessMode::Write)),
                policy,
                true,
            ),
            (
                EventKind::Access(AccessKind::Close(AccessMode::Write)),
                log,
                false,
            ),
            (
                EventKind::Modify(ModifyKind::Data(DataChange::Any)),
                policy,
                true,
            ),
            (
                EventKind::Modify(ModifyKind::Data(DataChange::Any)),
                log,
                false,
            ),
            (
                EventKind::Modify(ModifyKind::Name(RenameMode::To)),
                "/etc/rl/..data",
                true,
            ),
            (
                EventKind::Create(CreateKind::Any),
                "/etc/rl/..2026_12_01",
                true,
            ),
            (EventKind::Remove(RemoveKind::Any), policy, true),
            (EventKind::Any, log, true),
        ];
        for (kind, path, expected) in cases {
            assert_eq!(
                may_change_policy(&event(kind, path), &files),
                expected,
                "{kind:?} on {path}"
            );
        }
    }

    /// Reading the files (the reload does) and writing a log file beside them are no changes:
    /// counted as changes, the first reload made the next, about 20 times a second, forever.
    #[tokio::test]
    async fn a_reload_does_not_trigger_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("limits.yaml");
        std::fs::write(&file, "rules:\n  r: {capacity: 5, refill_per_sec: 1}\n").unwrap();
        let h = PolicyHandle::load(
            vec![file.clone()],
            Bounds::default(),
            Arc::new(Metrics::new()),
        )
        .unwrap();
        let _watch = h.watch();
        std::fs::write(&file, "rules:\n  r: {capacity: 7, refill_per_sec: 1}\n").unwrap();
        capacity_becomes(&h, 7, Duration::from_secs(10), "the change was not seen").await;
        let checks = h.checks();
        // Half a second with no change but a log file written beside the policy: at most the
        // write's last event still on its way (one check), where the loop made about ten.
        let log = dir.path().join("sidecar.log");
        for i in 0..5 {
            std::fs::write(&log, format!("line {i}\n")).unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let more = h.checks() - checks;
        assert!(more <= 1, "{more} checks in 0.5 s without a change");
    }

    /// A Kubernetes ConfigMap update, as its atomic writer makes it: the new files in a new
    /// directory, then the `..data` symlink swapped to it by a rename. No event names the
    /// policy file; the reload must see it all the same.
    #[cfg(unix)]
    #[tokio::test]
    async fn a_configmap_update_is_seen() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let version = |name: &str, capacity: u64| {
            std::fs::create_dir(d.join(name)).unwrap();
            std::fs::write(
                d.join(name).join("limits.yaml"),
                format!("rules:\n  r: {{capacity: {capacity}, refill_per_sec: 1}}\n"),
            )
            .unwrap();
        };
        version("..2026_12_01_a", 5);
        symlink("..2026_12_01_a", d.join("..data")).unwrap();
        symlink("..data/limits.yaml", d.join("limits.yaml")).unwrap();
        let h = PolicyHandle::load(
            vec![d.join("limits.yaml")],
            Bounds::default(),
            Arc::new(Metrics::new()),
        )
        .unwrap();
        assert_eq!(capacity(&h), Some(5));
        let _watch = h.watch();
        version("..2026_12_01_b", 7);
        symlink("..2026_12_01_b", d.join("..data_tmp")).unwrap();
        std::fs::rename(d.join("..data_tmp"), d.join("..data")).unwrap();
        capacity_becomes(
            &h,
            7,
            POLL_INTERVAL,
            "the update was not seen before the next poll",
        )
        .await;
    }

    /// Waits (polling) until the policy in force gives rule `r` `want` tokens; fails with
    /// `why` after `within`.
    async fn capacity_becomes(h: &PolicyHandle, want: u64, within: Duration, why: &str) {
        let started = std::time::Instant::now();
        while capacity(h) != Some(want) {
            assert!(started.elapsed() < within, "{why}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[test]
    fn a_missing_file_refuses_to_start_naming_it() {
        let e = PolicyHandle::load(
            vec![PathBuf::from("/nonexistent/limits.yaml")],
            Bounds::default(),
            Arc::new(Metrics::new()),
        )
        .err()
        .unwrap();
        assert!(
            e.to_string()
                .starts_with("/nonexistent/limits.yaml: cannot read"),
            "{e}"
        );
    }
}
