//! Every command block of README.md and docs/ does what its text says: each ```sh block follows a
//! `<!-- run: NAME -->` line, and is run here as written, or a `<!-- not run: REASON -->` line,
//! and then the targets and files it names must exist. A doc change that breaks a command, or a
//! new block that says neither, fails this test.
//!
//! How a run block is read, as a reader would:
//! - `make run ...` with no output under it starts that stack in the background, as a user does
//!   in a shell of its own, and waits for its banner; the stack is stopped (Ctrl-C, SIGINT) when
//!   the block is done. With output under it, the lines must appear in what it prints (contiguous,
//!   in order), and it is stopped once they did, or must have exited printing them.
//! - Every other command runs in one bash session (variables and background jobs carry over, and
//!   go with it), from the repository root, and must succeed; what it prints is then compared.
//! - `#` followed by two spaces or more, under a command, is what it prints; `#` and one space is
//!   a remark. `...` in an expected line stands for any text; an expected line `...` alone for any
//!   lines. A command that prints nothing is matched against what the stack printed meanwhile
//!   (`kill` of the sidecar: what `make run` says about it).
//! - A read-only command (metrics, stats, logs) is asked again until it prints what the text
//!   says (a reader is slower than the settlement or the log line it looks for).
//! - `<!-- run: NAME; refill R/s -->`: a `uniq -c` line of 200s may count what the bucket
//!   refilled during the command more (and the 429s as many fewer): the bound, not a time.
//!
//! `make run` listens on fixed ports (8080, 8081, 9901, 10000, 6379), so the stacks here run one
//! at a time (a lock), and none of the other tests uses those ports. The commands are the real
//! scripts: `make run` builds (a no-op after `make build`) and starts what `scripts/run-local.sh`
//! starts.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ratelimit_e2e::{port_open, workspace_root};

/// What a reader waits for at most: a stack's start (with `make run`'s build check), a line.
const PATIENCE: Duration = Duration::from_secs(180);
/// How long a read-only command is asked again before its output counts as wrong.
const EVENTUALLY: Duration = Duration::from_secs(20);
/// The ports `make run` listens on, and the Redis of docs/configuration.md's worked example.
const PORTS: &[u16] = &[8080, 8081, 9901, 10000, 6379, 6390];

static ONE_STACK_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> MutexGuard<'static, ()> {
    ONE_STACK_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

// ---------------------------------------------------------------------------------------------
// The blocks
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Marker {
    Run { name: String, refill_per_sec: f64 },
    NotRun(String),
}

#[derive(Debug, Clone)]
struct Block {
    file: String,
    line: usize,
    marker: Marker,
    text: String,
}

/// One command of a block and the lines the text says it prints.
#[derive(Debug, Clone)]
struct Step {
    command: String,
    expected: Vec<String>,
}

fn documents() -> Vec<PathBuf> {
    let root = workspace_root();
    let mut docs = vec![root.join("README.md")];
    let mut more: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    more.sort();
    docs.extend(more);
    docs
}

fn blocks() -> Vec<Block> {
    let root = workspace_root();
    let mut all = Vec::new();
    for path in documents() {
        let file = path.strip_prefix(&root).unwrap().display().to_string();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let fence = lines[i].trim_start();
            let opens = ["```sh", "```bash", "```shell", "```console"].contains(&fence);
            if !opens {
                if fence.starts_with("```") {
                    // Another language's block: skip it whole.
                    i += 1;
                    while i < lines.len() && !lines[i].trim_start().starts_with("```") {
                        i += 1;
                    }
                }
                i += 1;
                continue;
            }
            let start = i;
            let marker = lines[..start]
                .iter()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(|l| l.trim())
                .unwrap_or("");
            let marker = parse_marker(marker).unwrap_or_else(|| {
                panic!(
                    "{file}:{}: a command block without `<!-- run: NAME -->` or \
                     `<!-- not run: REASON -->` on the line before it",
                    start + 1
                )
            });
            i += 1;
            let mut body = Vec::new();
            while i < lines.len() && !lines[i].trim_start().starts_with("```") {
                body.push(lines[i]);
                i += 1;
            }
            i += 1;
            all.push(Block {
                file: file.clone(),
                line: start + 1,
                marker,
                text: body.join("\n"),
            });
        }
    }
    all
}

fn parse_marker(line: &str) -> Option<Marker> {
    let inner = line.strip_prefix("<!--")?.strip_suffix("-->")?.trim();
    if let Some(reason) = inner.strip_prefix("not run:") {
        return Some(Marker::NotRun(reason.trim().to_string()));
    }
    let spec = inner.strip_prefix("run:")?;
    let mut parts = spec.split(';').map(str::trim);
    let name = parts.next()?.to_string();
    let mut refill_per_sec = 0.0;
    for option in parts {
        let r = option
            .strip_prefix("refill ")
            .and_then(|r| r.strip_suffix("/s"))
            .unwrap_or_else(|| panic!("unknown option `{option}` in `{line}`"));
        refill_per_sec = r.parse().expect("a refill per second");
    }
    Some(Marker::Run {
        name,
        refill_per_sec,
    })
}

/// The commands of a block, each with its expected output.
fn steps(text: &str) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    let mut continuing = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if continuing {
            let step = steps.last_mut().unwrap();
            step.command.push('\n');
            step.command.push_str(line);
            continuing = line.ends_with('\\') || open_quote(&step.command);
            continue;
        }
        if trimmed.is_empty() {
            continue;
        }
        if let Some(rest) = trimmed.strip_prefix('#') {
            if rest.starts_with("  ") {
                if let Some(step) = steps.last_mut() {
                    step.expected.push(rest.trim().to_string());
                }
            }
            continue;
        }
        steps.push(Step {
            command: line.to_string(),
            expected: Vec::new(),
        });
        continuing = line.ends_with('\\') || open_quote(line);
    }
    steps
}

/// Whether a command's text ends inside a quoted string (a JSON body over several lines).
fn open_quote(text: &str) -> bool {
    let (mut single, mut double, mut escaped) = (false, false, false);
    for c in text.chars() {
        match c {
            _ if escaped => escaped = false,
            '\\' if !single => escaped = true,
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double => break,
            _ => {}
        }
    }
    single || double
}

fn block(name: &str) -> Block {
    let found: Vec<Block> = blocks()
        .into_iter()
        .filter(|b| matches!(&b.marker, Marker::Run { name: n, .. } if n == name))
        .collect();
    assert_eq!(found.len(), 1, "exactly one block marked `run: {name}`");
    found.into_iter().next().unwrap()
}

// ---------------------------------------------------------------------------------------------
// Matching what a command printed with what the text says
// ---------------------------------------------------------------------------------------------

fn normalise(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// One line against an expected line, `...` standing for any text.
fn line_matches(expected: &str, actual: &str) -> bool {
    let actual = normalise(actual);
    let parts: Vec<String> = expected.split("...").map(normalise).collect();
    if parts.len() == 1 {
        return actual == parts[0];
    }
    let mut rest = actual.as_str();
    for (i, part) in parts.iter().enumerate() {
        if part.is_empty() {
            continue;
        }
        if i == 0 {
            match rest.strip_prefix(part.as_str()) {
                Some(r) => rest = r,
                None => return false,
            }
        } else if i == parts.len() - 1 {
            return rest.trim_end().ends_with(part.as_str());
        } else {
            match rest.find(part.as_str()) {
                Some(at) => rest = &rest[at + part.len()..],
                None => return false,
            }
        }
    }
    true
}

/// Lines against expected lines, a lone `...` standing for any lines.
fn lines_match(expected: &[String], actual: &[String]) -> bool {
    match expected.split_first() {
        None => actual.is_empty(),
        Some((e, rest)) if e == "..." => {
            (0..=actual.len()).any(|skip| lines_match(rest, &actual[skip..]))
        }
        Some((e, rest)) => {
            !actual.is_empty() && line_matches(e, &actual[0]) && lines_match(rest, &actual[1..])
        }
    }
}

/// Whether the expected lines appear, contiguous and in order, somewhere in `actual`.
fn appears_in(expected: &[String], actual: &[String]) -> bool {
    (0..=actual.len())
        .any(|from| (from..=actual.len()).any(|to| lines_match(expected, &actual[from..to])))
}

/// `uniq -c` counts of a status, within what the bucket refilled meanwhile: the 200s may be up to
/// `extra` more than the text says, the 429s as many fewer, and the total is the same.
fn counts_match(expected: &[String], actual: &[String], extra: u64) -> bool {
    let parse = |lines: &[String]| -> Option<Vec<(u64, String)>> {
        lines
            .iter()
            .map(|l| {
                let mut w = l.split_whitespace();
                let n = w.next()?.parse().ok()?;
                let what = w.next()?.to_string();
                w.next().is_none().then_some((n, what))
            })
            .collect()
    };
    let (Some(e), Some(a)) = (parse(expected), parse(actual)) else {
        return false;
    };
    let total = |v: &[(u64, String)]| v.iter().map(|x| x.0).sum::<u64>();
    if total(&e) != total(&a) {
        return false;
    }
    // The same statuses in the same order, but a 429 line the refill may have emptied.
    let mut a_iter = a.iter().peekable();
    for (n, what) in &e {
        match a_iter.peek() {
            Some((m, w)) if w == what => {
                let ok = match what.as_str() {
                    "200" => *m >= *n && *m <= n + extra,
                    "429" => *m <= *n && m + extra >= *n,
                    _ => m == n,
                };
                if !ok {
                    return false;
                }
                a_iter.next();
            }
            _ if what == "429" && *n <= extra => {}
            _ => return false,
        }
    }
    a_iter.next().is_none()
}

// ---------------------------------------------------------------------------------------------
// A stack started by `make run`, and a bash session for the commands
// ---------------------------------------------------------------------------------------------

/// A process in its own process group whose output (stdout and stderr) is read line by line.
struct Background {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    what: String,
}

impl Background {
    fn spawn(command: &str) -> Background {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new("bash");
        cmd.arg("-c")
            .arg(format!("exec {command} 2>&1"))
            .current_dir(workspace_root())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0);
        // A reader's shell: none of the example's variables, and not inside make test's make.
        for var in [
            "EXAMPLE",
            "ENVOY_CONFIG",
            "LIMITS",
            "REDIS_URL",
            "LOG_DIR",
            "MAKEFLAGS",
            "MFLAGS",
            "MAKELEVEL",
            "CARGO_MAKEFLAGS",
        ] {
            cmd.env_remove(var);
        }
        without_cargos_test_env(&mut cmd);
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("start `{command}`: {e}"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push(line);
            }
        });
        Background {
            child,
            lines,
            what: command.to_string(),
        }
    }

    fn output(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    fn exited(&mut self) -> bool {
        self.child.try_wait().unwrap().is_some()
    }

    /// Waits until `done` holds for the output, or the process exits (then one last look).
    fn wait_for(&mut self, what: &str, done: impl Fn(&[String]) -> bool) -> bool {
        let start = Instant::now();
        loop {
            if done(&self.output()) {
                return true;
            }
            if self.exited() {
                // Its reader may still hold the last lines.
                std::thread::sleep(Duration::from_millis(200));
                return done(&self.output());
            }
            assert!(
                start.elapsed() < PATIENCE,
                "`{}`: no {what} after {PATIENCE:?}; it printed:\n{}",
                self.what,
                self.output().join("\n")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Ctrl-C, as a reader stops `make run`, and waits for the group to go.
    fn stop(&mut self) {
        let pgid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGINT);
        let start = Instant::now();
        while !self.exited() {
            if start.elapsed() > Duration::from_secs(20) {
                let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
                let _ = self.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Whatever the group left behind (a stack's processes) goes with it.
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        group_gone(pgid);
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!("--- `{}` printed:\n{}", self.what, self.output().join("\n"));
            for log in ["sidecar", "envoy", "upstream", "redis"] {
                let path = workspace_root().join(format!("run/{log}.log"));
                if let Ok(text) = std::fs::read_to_string(&path) {
                    let tail: Vec<&str> = text.lines().rev().take(15).collect();
                    eprintln!("--- the end of run/{log}.log:");
                    for l in tail.iter().rev() {
                        eprintln!("{l}");
                    }
                }
            }
        }
    }
}

/// Removes what `cargo test` sets for the test process (`CARGO_PKG_NAME`, `CARGO_MANIFEST_DIR`,
/// ...): some crates' build scripts rerun when those change, so a `make run` that saw them would
/// rebuild the release binaries, and `make build` after it would rebuild them again.
fn without_cargos_test_env(cmd: &mut Command) {
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        let set_by_cargo_test = name == "CARGO"
            || name == "OUT_DIR"
            || name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_BIN_EXE_")
            || matches!(
                name,
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
                    | "CARGO_RUSTC_CURRENT_DIR"
            );
        if set_by_cargo_test {
            cmd.env_remove(name);
        }
    }
}

/// One bash session for a block's commands: variables set by one are seen by the next.
struct Shell {
    child: Child,
    stdin: ChildStdin,
    out: Receiver<String>,
}

const END: &str = "\u{1e}end-of-command";

impl Shell {
    fn start() -> Shell {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new("bash");
        cmd.args(["--norc", "--noprofile"])
            .current_dir(workspace_root())
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        without_cargos_test_env(&mut cmd);
        let mut child = cmd.spawn().expect("start bash");
        let mut stdin = child.stdin.take().unwrap();
        writeln!(stdin, "exec 2>&1").unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match reader.read_until(b'\n', &mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        let line = String::from_utf8_lossy(&buf)
                            .trim_end_matches('\n')
                            .to_string();
                        if tx.send(line).is_err() {
                            break;
                        }
                    }
                }
            }
        });
        let _ = child.stderr.take().map(|mut e| {
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = e.read_to_string(&mut s);
            })
        });
        Shell {
            child,
            stdin,
            out: rx,
        }
    }

    /// Runs one command: its exit status and the lines it printed.
    fn run(&mut self, command: &str) -> (i32, Vec<String>) {
        writeln!(self.stdin, "{command}\nprintf '\\n{END} %d\\n' \"$?\"").unwrap();
        self.stdin.flush().unwrap();
        let mut lines = Vec::new();
        loop {
            let line = self
                .out
                .recv_timeout(PATIENCE)
                .unwrap_or_else(|_| panic!("`{command}` did not end within {PATIENCE:?}"));
            if let Some(status) = line.strip_prefix(END) {
                // The newline printed before the marker ends the command's last line.
                if lines.last().is_some_and(|l: &String| l.is_empty()) {
                    lines.pop();
                }
                return (status.trim().parse().unwrap_or(-1), lines);
            }
            lines.push(line);
        }
    }
}

impl Drop for Shell {
    /// The session and whatever its commands left running in the background (its group).
    fn drop(&mut self) {
        let pgid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
        group_gone(pgid);
    }
}

/// Waits until no process of a killed group is left (a signal is delivered, not awaited).
fn group_gone(pgid: nix::unistd::Pid) {
    let start = Instant::now();
    while nix::sys::signal::killpg(pgid, None).is_ok() && start.elapsed() < PATIENCE {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether a command only reads (metrics, stats, logs): asked again until it says what the text
/// does.
fn read_only(command: &str) -> bool {
    let c = command.trim_start();
    (c.starts_with("curl")
        && (c.contains("/metrics") || c.contains("/stats") || c.contains("/readyz")))
        || c.starts_with("grep")
        || c.starts_with("tail")
}

/// The fixed ports free: a stack stopped just before may still be closing its listeners.
fn ports_free() {
    for port in PORTS {
        let start = Instant::now();
        while port_open(*port) && start.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            !port_open(*port),
            "port {port} is in use: `make run` needs it (stop what holds it, a `make run` of yours?)"
        );
    }
}

/// Runs a block as a reader would, and compares what each command printed with the text.
fn run_block(name: &str) {
    run_blocks(&[name]);
}

/// Runs blocks one after the other in one shell, as a reader follows a page.
fn run_blocks(names: &[&str]) {
    let _one = one_at_a_time();
    ports_free();
    let mut stacks: Vec<Background> = Vec::new();
    let mut shell = Shell::start();
    for name in names {
        run_steps(name, &mut shell, &mut stacks);
    }
    for mut stack in stacks {
        stack.stop();
    }
}

fn run_steps(name: &str, shell: &mut Shell, stacks: &mut Vec<Background>) {
    let block = block(name);
    let Marker::Run { refill_per_sec, .. } = block.marker else {
        unreachable!()
    };
    let at = format!("{}:{} (run: {name})", block.file, block.line);
    for step in steps(&block.text) {
        let command = step.command.trim();
        if command.starts_with("make run") || command.contains(" make run") {
            let mut stack = Background::spawn(command);
            if step.expected.is_empty() {
                let up = stack.wait_for("banner", |out| {
                    out.iter().any(|l| l.contains("Ctrl-C stops everything."))
                });
                assert!(
                    up,
                    "{at}: `{command}` exited before its banner:\n{}",
                    stack.output().join("\n")
                );
                stacks.push(stack);
            } else {
                let shown = stack.wait_for("expected lines", |out| {
                    let out: Vec<String> = out.to_vec();
                    appears_in(&step.expected, &out)
                });
                assert!(
                    shown,
                    "{at}: `{command}` should print\n{}\nbut printed\n{}",
                    step.expected.join("\n"),
                    stack.output().join("\n")
                );
                stack.stop();
            }
            continue;
        }
        let since = stacks.last().map(|s| s.output().len()).unwrap_or(0);
        let start = Instant::now();
        let (mut status, mut out) = shell.run(command);
        let elapsed = start.elapsed();
        let extra = (elapsed.as_secs_f64() * refill_per_sec).ceil() as u64 + 1;
        let matches = |out: &[String]| {
            step.expected.is_empty()
                || lines_match(&step.expected, out)
                || (refill_per_sec > 0.0 && counts_match(&step.expected, out, extra))
        };
        if read_only(command) {
            // Asked again until it succeeds and says what the text does, as a reader would.
            let start = Instant::now();
            while start.elapsed() < EVENTUALLY && !(status == 0 && matches(&out)) {
                std::thread::sleep(Duration::from_millis(100));
                (status, out) = shell.run(command);
            }
        }
        assert_eq!(status, 0, "{at}: `{command}` failed:\n{}", out.join("\n"));
        if step.expected.is_empty() {
            continue;
        }
        if out.is_empty() {
            // What the stack said about it (the sidecar killed: `make run`'s message).
            let stack = stacks
                .last_mut()
                .unwrap_or_else(|| panic!("{at}: `{command}` printed nothing"));
            let said = stack.wait_for("its message", |all| {
                appears_in(&step.expected, &all[since.min(all.len())..])
            });
            assert!(
                said,
                "{at}: after `{command}` the stack should say\n{}\nbut said\n{}",
                step.expected.join("\n"),
                stack.output()[since..].join("\n")
            );
            continue;
        }
        assert!(
            matches(&out),
            "{at}: `{command}` should print\n{}\nbut printed\n{}",
            step.expected.join("\n"),
            out.join("\n")
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The tests
// ---------------------------------------------------------------------------------------------

/// The blocks run here, by name (a block marked `run:` with a name not listed fails).
const RUN: &[&str] = &[
    "api-walkthrough",
    "api-walkthrough-decide",
    "api-walkthrough-keys",
    "api-walkthrough-lease",
    "api-walkthrough-errors",
    "api-key",
    "compose",
    "jwt",
    "llm",
    "rlqs",
    "native",
    "mistake-policy-typo",
    "mistake-redis-url",
    "mistake-redis-refused",
    "mistake-filter-field",
    "mistake-sidecar-killed",
    "mistake-unknown-rule",
];

#[test]
fn every_command_block_is_run_here_or_says_why_not() {
    let all = blocks();
    assert!(all.len() > 10, "{} blocks found", all.len());
    let makefile = std::fs::read_to_string(workspace_root().join("Makefile")).unwrap();
    let targets: BTreeSet<String> = makefile
        .lines()
        .filter(|l| !l.starts_with('\t') && !l.starts_with('#'))
        .filter_map(|l| l.split_once(':').map(|(t, _)| t))
        .flat_map(|t| t.split_whitespace().map(str::to_string))
        .collect();
    let mut names = BTreeSet::new();
    for b in &all {
        let at = format!("{}:{}", b.file, b.line);
        match &b.marker {
            Marker::Run { name, .. } => {
                assert!(
                    RUN.contains(&name.as_str()),
                    "{at}: `run: {name}` is run by no test here"
                );
                assert!(names.insert(name.clone()), "{at}: two blocks named {name}");
            }
            Marker::NotRun(reason) => {
                assert!(!reason.is_empty(), "{at}: `not run:` without a reason");
            }
        }
        // Whatever the block names must exist: make targets, and the repository's paths.
        for step in steps(&b.text) {
            let words: Vec<&str> = step.command.split_whitespace().collect();
            for (i, w) in words.iter().enumerate() {
                if *w == "make" {
                    if let Some(target) = words.get(i + 1).filter(|t| !t.contains('=')) {
                        assert!(
                            targets.contains(*target),
                            "{at}: `make {target}`: the Makefile has no such target"
                        );
                    }
                }
                let path = w.trim_matches(|c| "'\"()$;".contains(c));
                let repo_path = ["scripts/", "envoy/", "docs/", "observability/"]
                    .iter()
                    .any(|p| path.starts_with(p));
                if repo_path && !path.contains('*') && !path.contains('<') {
                    let path = path.split(':').next().unwrap();
                    assert!(
                        workspace_root().join(path).exists(),
                        "{at}: `{path}` does not exist"
                    );
                }
            }
        }
    }
    for name in RUN {
        assert!(names.contains(*name), "no block is marked `run: {name}`");
    }
}

#[test]
fn the_banner_of_each_example_shows_the_commands_of_its_readme_block() {
    let script = std::fs::read_to_string(workspace_root().join("scripts/run-local.sh")).unwrap();
    for example in ["api-key", "jwt", "llm", "rlqs", "native"] {
        let block = block(example);
        let commands: Vec<String> = steps(&block.text)
            .into_iter()
            .map(|s| s.command)
            .filter(|c| !c.starts_with("make run"))
            .map(|c| normalise(&c.replace("\\\n", " ")))
            .map(|c| c.split(" # ").next().unwrap().to_string())
            .collect();
        // The script's heredoc for the example, each command on one line.
        let banner = script
            .split(&format!("  {example}) cat <<'TXT'"))
            .nth(1)
            .unwrap_or_else(|| panic!("scripts/run-local.sh has no banner for {example}"))
            .split("\nTXT")
            .next()
            .unwrap();
        let shown: Vec<String> = banner
            .lines()
            .filter(|l| l.starts_with("  "))
            .map(|l| normalise(l).replace("%{http_code}\\\\n", "%{http_code}\\n"))
            .collect();
        for s in &shown {
            assert!(
                commands.contains(s),
                "the {example} banner shows `{s}`, which its README block does not run: {commands:?}"
            );
        }
        assert!(!shown.is_empty());
    }
}

#[test]
fn the_matching_reads_wildcards_and_refills_as_documented() {
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert!(lines_match(&s(&["a ... c"]), &s(&["a  b b c"])));
    assert!(!lines_match(&s(&["a ... c"]), &s(&["a b d"])));
    assert!(lines_match(&s(&["...", "x"]), &s(&["1", "2", "x"])));
    assert!(appears_in(&s(&["x", "y"]), &s(&["a", "x", "y", "b"])));
    assert!(!appears_in(&s(&["x", "y"]), &s(&["x", "a", "y"])));
    let expected = s(&["100 200", "50 429"]);
    assert!(counts_match(&expected, &s(&["  101 200", "   49 429"]), 2));
    assert!(!counts_match(&expected, &s(&["  103 200", "   47 429"]), 2));
    assert!(!counts_match(&expected, &s(&["   99 200", "   51 429"]), 2));
    assert!(!counts_match(&expected, &s(&["  101 200", "   50 429"]), 2));
    let steps = steps(
        "make run\n# remark\ncurl a \\\n  b | uniq -c\n#   1 200\n#  2 429\necho x\ncurl -d '{\"a\",\n  \"b\"}' x",
    );
    assert_eq!(steps.len(), 4);
    assert_eq!(steps[3].command, "curl -d '{\"a\",\n  \"b\"}' x");
    assert_eq!(steps[1].command, "curl a \\\n  b | uniq -c");
    assert_eq!(steps[1].expected, ["1 200", "2 429"]);
}

#[test]
fn the_http_api_walkthrough_of_the_configuration_reference_runs_as_written() {
    run_blocks(&[
        "api-walkthrough",
        "api-walkthrough-decide",
        "api-walkthrough-keys",
        "api-walkthrough-lease",
        "api-walkthrough-errors",
    ]);
}

#[test]
#[ignore = "needs Docker and the images of `make images`: run `make compose-test`"]
fn the_container_quick_start_runs_as_written_without_a_registry() {
    // Whatever happens, the project goes (the compose tests after this one need its ports).
    struct Down;
    impl Drop for Down {
        fn drop(&mut self) {
            let _ = Command::new("docker")
                .args(["compose", "-f", "envoy/docker-compose.yml", "down"])
                .env("RATELIMIT_AUTH_TOKEN", "down")
                .current_dir(workspace_root())
                .output();
        }
    }
    let _down = Down;
    run_block("compose");
}

#[test]
fn the_api_key_quick_start_runs_as_written() {
    run_block("api-key");
}

#[test]
fn the_jwt_example_runs_as_written() {
    run_block("jwt");
}

#[test]
fn the_llm_example_shows_its_settlements() {
    run_block("llm");
}

#[test]
fn the_rlqs_example_runs_as_written() {
    run_block("rlqs");
}

#[test]
fn the_native_filter_example_runs_as_written() {
    run_block("native");
}

#[test]
fn a_typo_in_the_policy_file_is_said_at_once() {
    run_block("mistake-policy-typo");
}

#[test]
fn a_bad_redis_url_is_said_at_once() {
    run_block("mistake-redis-url");
}

#[test]
fn a_redis_that_refuses_is_said_to_refuse() {
    run_block("mistake-redis-refused");
}

#[test]
fn an_unknown_field_in_the_filter_json_is_said_at_once() {
    run_block("mistake-filter-field");
}

#[test]
fn a_killed_sidecar_leaves_envoy_serving_by_on_error() {
    run_block("mistake-sidecar-killed");
}

#[test]
fn an_unknown_rule_warns_once_with_a_count() {
    run_block("mistake-unknown-rule");
}
