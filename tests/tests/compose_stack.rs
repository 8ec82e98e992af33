//! `envoy/docker-compose.yml`, started for real as its header tells a user (`make compose-test`):
//! the README's quick start through the ports it publishes on 127.0.0.1, the policy file changed
//! and reloaded with SIGHUP, then replaced (renamed over, as editors do) and reloaded without
//! one, Redis stopped and started, the sidecar killed and restarted by its
//! restart policy, and `docker compose down` leaving nothing behind. The static checks of the
//! same file are in `compose.rs`.

#[path = "common/docker_compose.rs"]
mod docker_compose;

use std::time::{Duration, Instant};

use docker_compose::{
    envoy_stat, filter_counter, kill_process, metric, ports_free, sidecar_metrics, Project,
};
use ratelimit_e2e::scenario::{get, Answer, ALPHA};
use ratelimit_e2e::{http, wait_until};

/// What the file publishes on the host: Envoy's listener and admin, the sidecar's admin.
const LISTENER: u16 = 10000;
const ENVOY_ADMIN: u16 = 9901;
const SIDECAR_ADMIN: u16 = 8081;
/// compose/envoy.yaml: the filter's callout deadline, and the `per-app` emergency bucket.
const TIMEOUT_MS: u64 = 50;
const EMERGENCY: (u64, u64) = (10, 1);
/// How far past the filter's deadline an answer may come on this busy machine (the proxying
/// through Docker, the request itself): a hung callout would take seconds.
const SLACK_MS: u64 = 450;
/// The longest a gateway keeps a lease or a known rejection (`fast_paths` as shipped).
const LOCAL_STATE: Duration = Duration::from_millis(1000);

fn url(path: &str) -> String {
    format!("http://127.0.0.1:{LISTENER}{path}")
}

/// `n` requests one after the other on one connection, as `curl 'url?n=[1-n]'` sends them.
fn sequence(path: &str, headers: &[(&str, &str)], n: usize) -> Vec<Answer> {
    let client = http();
    (0..n).map(|_| get(&client, &url(path), headers)).collect()
}

fn statuses(answers: &[Answer]) -> Vec<u16> {
    answers.iter().map(|a| a.status).collect()
}

fn slowest(answers: &[Answer]) -> Duration {
    answers.iter().map(|a| a.elapsed).max().unwrap_or_default()
}

fn median(answers: &[Answer]) -> Duration {
    let mut t: Vec<Duration> = answers.iter().map(|a| a.elapsed).collect();
    t.sort();
    t[t.len() / 2]
}

/// Requests the emergency bucket admitted so far.
fn emergency_admitted() -> u64 {
    filter_counter(ENVOY_ADMIN, "emergency_activations")
        - filter_counter(ENVOY_ADMIN, "emergency_rejected")
}

/// The policy reloads the sidecar counted as applied.
fn reloads() -> f64 {
    metric(
        &sidecar_metrics(SIDECAR_ADMIN),
        "ratelimit_policy_reloads_total{result=\"ok\"}",
    )
}

/// Waits until a request through Envoy is decided by the sidecar again (no new limiter error),
/// and returns how long that took.
fn wait_decisions_resume(what: &str, since: Instant) -> Duration {
    let client = http();
    wait_until(what, Duration::from_secs(60), || {
        let errors = filter_counter(ENVOY_ADMIN, "limiter_error");
        let answer = get(&client, &url("/resume"), &[]);
        answer.status == 200 && filter_counter(ENVOY_ADMIN, "limiter_error") == errors
    });
    since.elapsed()
}

#[test]
#[ignore = "needs Docker and the images of `make images`: run `make compose-test`"]
fn the_shipped_compose_file_runs_the_quick_start_reloads_survives_outages_and_leaves_nothing() {
    ports_free(&[LISTENER, ENVOY_ADMIN, SIDECAR_ADMIN]);
    let mut stack = Project::new("docker-compose.yml");
    let took = stack.up();
    println!("up --wait: every service healthy in {took:.1?}");

    // The README's quick start: 150 requests with the demo API key, one after the other.
    let start = Instant::now();
    let errors = filter_counter(ENVOY_ADMIN, "limiter_error");
    let answers = sequence("/api/hello", &[ALPHA], 150);
    let elapsed = start.elapsed();
    let admitted = answers.iter().filter(|a| a.status == 200).count();
    let rejected = answers.iter().filter(|a| a.status == 429).count();
    let refilled = (elapsed.as_secs_f64() * 10.0).floor() as usize;
    let by_emergency = emergency_admitted() as usize;
    println!(
        "quick start: {admitted} x 200, {rejected} x 429 in {elapsed:.2?} ({refilled} tokens \
         refilled meanwhile, {by_emergency} by the emergency bucket)"
    );
    assert_eq!(
        admitted + rejected,
        150,
        "only 200 and 429: {:?}",
        statuses(&answers)
    );
    // A callout that timed out on this busy machine was answered by the emergency bucket, and
    // its charge may still have been taken: only without one are the first 100 sure to pass.
    let errors = filter_counter(ENVOY_ADMIN, "limiter_error") - errors;
    if errors == 0 {
        assert!(
            answers[..100].iter().all(|a| a.status == 200),
            "the first 100 pass: {:?}",
            statuses(&answers)
        );
    } else {
        println!("  ({errors} callouts timed out: the first 100 need not all pass)");
        assert!(
            admitted + errors as usize >= 100,
            "{:?}",
            statuses(&answers)
        );
    }
    assert!(
        admitted <= 100 + refilled + by_emergency,
        "over-admission: {admitted} > 100 + {refilled} refilled + {by_emergency} emergency"
    );
    let limited = answers.iter().find(|a| a.status == 429).expect("a 429");
    let retry_after: u64 = limited
        .header("retry-after")
        .expect("429 carries Retry-After")
        .parse()
        .expect("Retry-After in whole seconds");
    assert!(retry_after >= 1);
    let policy = limited
        .header("ratelimit-policy")
        .expect("RateLimit-Policy");
    assert!(
        policy.contains("\"per-app\"") && policy.contains("q=100"),
        "{policy}"
    );
    assert!(
        limited.header("ratelimit").is_some(),
        "429 carries RateLimit"
    );
    assert!(
        limited.body.contains("\"rule\":\"per-app\""),
        "{}",
        limited.body
    );

    // The filter's stats on the admin port, the upstream's count, the sidecar's metrics: the
    // token reached the filter (every call answered, none refused).
    assert_eq!(filter_counter(ENVOY_ADMIN, "admitted") as usize, admitted);
    assert_eq!(
        filter_counter(ENVOY_ADMIN, "rule.per-app.rejected") as usize,
        rejected
    );
    assert_eq!(
        envoy_stat(ENVOY_ADMIN, "cluster.demo_upstream.upstream_rq_200") as usize,
        admitted,
        "only admitted requests reach the upstream"
    );
    let metrics = sidecar_metrics(SIDECAR_ADMIN);
    let answered = metric(
        &metrics,
        "ratelimit_calls_total{api=\"stream\",outcome=\"answered\"}",
    );
    assert!(answered > 0.0, "the sidecar answered no call:\n{metrics}");
    assert_eq!(
        metric(
            &metrics,
            "ratelimit_calls_total{api=\"stream\",outcome=\"unauthorized\"}"
        ),
        0.0,
        "the filter's token was refused"
    );
    assert!(
        metric(
            &metrics,
            "ratelimit_decisions_total{limit=\"per-app\",verdict=\"allowed\"}"
        ) > 0.0
    );
    println!("filter stats and sidecar metrics agree; {answered} callouts answered");

    // A limit changed in the mounted policy file, then the documented reload: SIGHUP. The
    // sidecar watches the mounted directory too, so either may be the one that reloads it.
    let shipped = std::fs::read_to_string(&stack.policy).expect("the policy copy");
    let lowered = shipped
        .replacen(
            "per-app:\n    capacity: 100\n    refill_per_sec: 10\n",
            "per-app:\n    capacity: 5\n    refill_per_sec: 0.01\n",
            1,
        )
        .replacen(
            "name: unknown-apps\n        capacity: 50\n        refill_per_sec: 5\n",
            "name: unknown-apps\n        capacity: 3\n        refill_per_sec: 0.01\n",
            1,
        );
    assert_ne!(
        lowered, shipped,
        "envoy/limits.yaml no longer has the quick start's numbers"
    );
    let before = reloads();
    stack.write_policy(&lowered);
    stack.compose(&["kill", "-s", "HUP", "sidecar"]);
    wait_until("the reload after the edit", Duration::from_secs(10), || {
        reloads() > before
    });
    let log = stack.compose(&["logs", "--no-color", "sidecar"]);
    assert!(
        log.lines().any(|l| l.contains("policy reloaded")
            && (l.contains("SIGHUP") || l.contains("file change"))),
        "no reload by SIGHUP or the file watch in the sidecar's log:\n{log}"
    );
    // The demo key's bucket now answers with the new limit (the gateway's known rejection of
    // the old one lasts at most fast_paths.max_rejection_ms).
    wait_until(
        "per-app's new limit in the 429",
        Duration::from_secs(10),
        || {
            let a = get(&http(), &url("/api/hello"), &[ALPHA]);
            a.status == 429
                && a.header("ratelimit-policy")
                    .is_some_and(|p| p.contains("q=5"))
        },
    );
    // Clients without a key share the `unknown-apps` bucket, untouched so far: now 3 exactly.
    let errors = filter_counter(ENVOY_ADMIN, "limiter_error");
    let emergency = emergency_admitted();
    let unknown = sequence("/api/hello", &[], 10);
    if filter_counter(ENVOY_ADMIN, "limiter_error") == errors {
        assert_eq!(
            statuses(&unknown),
            [200, 200, 200, 429, 429, 429, 429, 429, 429, 429],
            "the unknown-apps override's new capacity"
        );
    } else {
        // A timed-out callout: the emergency bucket answered it, its charge may have been taken.
        let admitted = unknown.iter().filter(|a| a.status == 200).count() as u64;
        assert!(
            admitted - (emergency_admitted() - emergency) <= 3,
            "more than 3 admitted by unknown-apps: {:?}",
            statuses(&unknown)
        );
    }
    println!("reload (file watch or SIGHUP): per-app q=5, unknown-apps 3 of 10");
    // The shipped policy back, as an editor or `git checkout` puts it: a new file renamed over
    // the old one, and no signal. The mounted directory shows the container the new file, and
    // the sidecar's watch (or its periodic check) reloads it.
    let before = reloads();
    stack.replace_policy(&shipped);
    wait_until(
        "the replaced policy file reloaded without a signal",
        Duration::from_secs(60),
        || reloads() > before,
    );
    println!("a replaced policy file reloaded without a signal");

    // Redis stopped: the shipped rules' on_error answer, within the filter's deadline. First the
    // gateway forgets its leases and known rejections, so that every decision is asked for.
    std::thread::sleep(LOCAL_STATE + Duration::from_millis(200));
    let (sidecar_started, envoy_started) = (stack.started_at("sidecar"), stack.started_at("envoy"));
    let counters = |name: &str| filter_counter(ENVOY_ADMIN, name);
    let (activations, emergency_rejected, failed_open, failed_closed) = (
        counters("emergency_activations"),
        counters("emergency_rejected"),
        counters("failed_open"),
        counters("failed_closed"),
    );
    stack.compose(&["stop", "redis"]);
    let outage = Instant::now();
    // per-app: on_error local (the emergency bucket, 10 + 1/s); per-ip: on_error allow.
    let api = sequence("/api/hello", &[ALPHA], 25);
    let other = sequence("/other", &[], 10);
    let t = outage.elapsed();
    let emergency_admitted = (counters("emergency_activations") - activations)
        - (counters("emergency_rejected") - emergency_rejected);
    let api_admitted = api.iter().filter(|a| a.status == 200).count() as u64;
    println!(
        "redis stopped: /api/ {api_admitted} of 25 admitted by the emergency bucket; /other 10 \
         of 10 allowed; answers p50 {:.1?}, slowest {:.1?} (the filter's timeout {TIMEOUT_MS} ms)",
        median(&api),
        slowest(&api).max(slowest(&other))
    );
    assert!(
        api.iter().all(|a| a.status == 200 || a.status == 429),
        "per-app on_error local answers from the emergency bucket: {:?}",
        statuses(&api)
    );
    assert_eq!(
        api_admitted, emergency_admitted,
        "every admission is the emergency bucket's"
    );
    assert!(
        emergency_admitted >= 1
            && emergency_admitted <= EMERGENCY.0 + EMERGENCY.1 * t.as_secs().saturating_add(1),
        "emergency admitted {emergency_admitted} in {t:.1?}"
    );
    assert!(
        other.iter().all(|a| a.status == 200),
        "per-ip on_error allow: {:?}",
        statuses(&other)
    );
    assert!(counters("failed_open") - failed_open >= other.len() as u64);
    assert_eq!(
        counters("failed_closed"),
        failed_closed,
        "no shipped rule denies"
    );
    let bound = Duration::from_millis(TIMEOUT_MS + SLACK_MS);
    assert!(
        slowest(&api).max(slowest(&other)) < bound,
        "an answer took longer than the filter's timeout allows ({bound:?})"
    );

    // Redis started again: decisions resume without restarting anything.
    stack.compose(&["start", "redis"]);
    let back = Instant::now();
    let resumed = wait_decisions_resume("decisions after Redis started", back);
    assert_eq!(
        stack.started_at("sidecar"),
        sidecar_started,
        "the sidecar was restarted"
    );
    assert_eq!(
        stack.started_at("envoy"),
        envoy_started,
        "Envoy was restarted"
    );
    println!("redis started: decisions resumed {resumed:.1?} later, nothing restarted");

    // The sidecar's process killed (a crash, not `docker stop`): its restart policy brings it
    // back, Envoy finds it by its service name, decisions resume.
    let killed = Instant::now();
    kill_process(stack.pid("sidecar"));
    wait_until(
        "the sidecar restarted by Docker",
        Duration::from_secs(60),
        || stack.restarts("sidecar") == 1 && stack.pid("sidecar") > 0,
    );
    let resumed = wait_decisions_resume("decisions after the sidecar's restart", killed);
    println!(
        "sidecar killed: restarted by its policy, decisions resumed {resumed:.1?} after the kill"
    );

    let took = stack.down();
    println!("down: no container, network or volume left ({took:.1?})");
}
