//! The fuzz targets' harness, shared by `filter/tests/fuzz.rs` and `sidecar/tests/fuzz.rs` (each
//! includes this file with `#[path]`): runs one target under proptest, counts the inputs it tried
//! and the ones that panicked, and writes one summary line per target. See `docs/fuzzing.md`.
//!
//! - Cases: `FUZZ_CASES_<TARGET>` (the target's name upper-cased, `.` and `-` as `_`), else
//!   `FUZZ_CASES`, else the target's default (a short run, the one `make test` does).
//! - Seed: `FUZZ_SEED` (decimal or `0x` hex) replays a run; otherwise one is drawn and printed.
//! - Summary: printed on stdout (`--nocapture` shows it) and, with `FUZZ_SUMMARY=<file>`,
//!   appended to that file, which `make fuzz` prints and totals.
//!
//! A panic is caught, counted, and turned into a failure, so proptest shrinks it to a minimal
//! input and the target fails; the line is written first either way. A target may [`note`] what
//! its inputs reached (accepted, refused, a status): the line ends with those counts, which show
//! whether the near-valid inputs get past the parser to the checks behind it.

#![allow(dead_code)]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

thread_local! {
    /// What the running target's inputs reached (each target runs on a thread of its own).
    static NOTES: RefCell<BTreeMap<String, u64>> = const { RefCell::new(BTreeMap::new()) };
}

/// Counts one input of the running target as having reached `what`.
pub fn note(what: impl Into<String>) {
    NOTES.with(|n| *n.borrow_mut().entry(what.into()).or_default() += 1);
}

/// The number of cases a target runs: see the module doc.
pub fn cases(target: &str, default: u32) -> u32 {
    let own = format!(
        "FUZZ_CASES_{}",
        target.to_ascii_uppercase().replace(['.', '-'], "_")
    );
    for var in [own.as_str(), "FUZZ_CASES"] {
        if let Ok(v) = std::env::var(var) {
            match v.trim().parse::<u32>() {
                Ok(n) if n > 0 => return n,
                _ => panic!("{var}={v:?}: expected a positive number of cases"),
            }
        }
    }
    default
}

fn seed() -> u64 {
    match std::env::var("FUZZ_SEED") {
        Ok(v) => {
            let v = v.trim();
            let parsed = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => v.parse(),
            };
            parsed.unwrap_or_else(|_| panic!("FUZZ_SEED={v:?}: expected a number"))
        }
        Err(_) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            // Mix in the address of a stack variable, so two targets started in the same
            // nanosecond still differ.
            let local = 0u8;
            nanos ^ (&local as *const u8 as u64).rotate_left(32)
        }
    }
}

/// Runs `target`: `test` on inputs drawn from `strategy`, for the target's number of cases.
/// Fails (after writing the summary line) if an input panicked or failed an assertion.
pub fn fuzz<S>(
    target: &str,
    default_cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S: Strategy,
    S::Value: Debug,
{
    let cases = cases(target, default_cases);
    let seed = seed();
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let config = Config {
        cases,
        // Regressions are kept as named tests, not in files next to the sources.
        failure_persistence: None,
        // A failure is shrunk to a small input, within bounds (inputs can be large).
        max_shrink_iters: 4096,
        max_shrink_time: 60_000,
        ..Config::default()
    };
    let mut runner = TestRunner::new_with_rng(
        config,
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes),
    );
    let tried = std::cell::Cell::new(0u64);
    let panics = std::cell::Cell::new(0u64);
    let failures = std::cell::Cell::new(0u64);
    NOTES.with(|n| n.borrow_mut().clear());
    let started = Instant::now();
    let result = runner.run(&strategy, |input| {
        tried.set(tried.get() + 1);
        match catch_unwind(AssertUnwindSafe(|| test(input))) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                failures.set(failures.get() + 1);
                Err(e)
            }
            Err(payload) => {
                panics.set(panics.get() + 1);
                let what = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Err(TestCaseError::fail(format!("panicked: {what}")))
            }
        }
    });
    let notes = NOTES.with(|n| {
        n.borrow()
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    });
    let line = format!(
        "fuzz {target:<24} inputs {:>8}  panics {}  failed {}  {:>7.2} s  seed {seed:#018x}  [{notes}]",
        tried.get(),
        panics.get(),
        failures.get(),
        started.elapsed().as_secs_f64(),
    );
    println!("{line}");
    if let Ok(path) = std::env::var("FUZZ_SUMMARY") {
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
        if let Err(e) = written {
            panic!("FUZZ_SUMMARY={path}: {e}");
        }
    }
    if let Err(e) = result {
        panic!("{target}: {e}\nreplay with FUZZ_SEED={seed:#x}");
    }
}
