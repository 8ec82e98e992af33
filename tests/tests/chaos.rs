//! The short run of `make chaos` inside `make test` (docs/failure-behaviour.md, "Measured under
//! generated faults"): one seed's workload and faults over the real processes for 90 s, checked
//! against the bucket model and the README's allowances. Asserts only the invariants, never a
//! speed. `CHAOS_SEED` picks another seed (the report names it, to replay with `make chaos`).

use ratelimit_e2e::chaos::run::run;
use ratelimit_e2e::chaos::schedule::Plan;

#[test]
fn generated_faults_leave_every_bucket_within_its_allowance() {
    let seed = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let outcome = run(&Plan::draw(seed, 90));
    println!("{}", outcome.report());
    assert!(
        !outcome.violated(),
        "seed {seed} violated (replay: make chaos CHAOS_ARGS=\"--seed {seed} --seconds 90\"):\n{}",
        outcome.report()
    );
    // The run did what it is for: faults caused, requests admitted and refused.
    assert!(!outcome.log.faults.is_empty(), "no fault was caused");
    assert!(
        outcome.served > 100,
        "only {} requests served",
        outcome.served
    );
}

/// The nemesis's clock step works: a sidecar started on a wall clock two hours ahead
/// (libfaketime, as the chaos topology starts its sidecars) says so in its `date` header and is
/// ready (Redis answers it, its script loaded). A step back cannot be seen this way (hyper renews
/// its cached date only once the clock passes the second it expects next).
#[test]
fn a_sidecar_on_the_nemesis_clock_runs_on_the_time_it_is_given() {
    use ratelimit_e2e::chaos::topology::{clock_file, faked_clock};
    use ratelimit_e2e::{free_port, http, Redis, Sidecar};

    let dir = tempfile::tempdir().expect("temp dir");
    let file = clock_file(dir.path(), 0);
    std::fs::write(&file, "+7200\n").expect("write the offset");
    let redis = Redis::start();
    let policy = "rules:\n  a: {capacity: 1, refill_per_sec: 1}\n";
    let mut sidecar = Sidecar::spawn_with_args_env(
        free_port(),
        policy,
        &["--redis", &redis.url()],
        &faked_clock(&file),
    );
    sidecar.wait_ready();
    let answer = http()
        .get(format!("{}/healthz", sidecar.base_url()))
        .send()
        .expect("the sidecar answers");
    let date = answer.headers()["date"]
        .to_str()
        .expect("a date")
        .to_string();
    let at = httpdate::parse_http_date(&date).expect("an HTTP date");
    let ahead = at
        .duration_since(std::time::SystemTime::now())
        .map(|d| d.as_secs())
        .unwrap_or(0);
    assert!(
        (7_190..=7_210).contains(&ahead),
        "the sidecar's date {date} is {ahead} s ahead, not 7200"
    );
}
