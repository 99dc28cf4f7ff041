//! `cargo xtask stress`: the integration tests run again and again beside
//! busy-looping processes, each failure reported as it happens (run, test
//! target, test and its output, which holds the supervisor's log), and a
//! table of failures per test at the end.
//!
//! A flake that shows once in twenty runs on a loaded CI machine shows here
//! in minutes: the hogs take the CPUs the tests' daemons, agent and readers
//! would otherwise have to themselves, so every wait of a test is stretched.
//!
//! The kernel's own reports of a stalled CPU (workqueue lockups, RCU
//! stalls, hung tasks) are read from `/dev/kmsg` after each target's run and
//! printed with it: a failure in a run the kernel stalled is marked so, as
//! the machine's until shown otherwise.

use std::collections::BTreeMap;
use std::env;
use std::ffi::OsString;
use std::fs;
use std::hint::black_box;
use std::io::{BufRead, BufReader, ErrorKind, Read, Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

pub const USAGE: &str = "usage: cargo xtask stress [--runs N] [--load L] [--test NAME]… [-- TEST-BINARY-ARGS…]
  runs the integration tests (all, or each --test target) N times (default 20),
  each run beside L busy-looping processes (default: one per CPU); reports each
  failure with its run, target, test and output, then failures per test;
  exits nonzero on any failure";

/// What the command line asks for.
#[derive(Debug, PartialEq, Eq)]
pub struct StressArgs {
    pub runs: u32,
    pub load: u32,
    pub targets: Vec<String>,
    pub test_args: Vec<OsString>,
}

/// Parses the arguments after `stress`.
pub fn parse_args(args: Vec<OsString>) -> Result<StressArgs, String> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX));
    let mut parsed = StressArgs { runs: 20, load: cpus, targets: Vec::new(), test_args: Vec::new() };
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let arg = arg.into_string().map_err(|arg| format!("argument {arg:?} is not UTF-8"))?;
        let mut value =
            |name: &str| args.next().and_then(|v| v.into_string().ok()).ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--runs" => parsed.runs = value("--runs")?.parse().map_err(|err| format!("--runs: {err}"))?,
            "--load" => parsed.load = value("--load")?.parse().map_err(|err| format!("--load: {err}"))?,
            "--test" => parsed.targets.push(value("--test")?),
            "--" => {
                parsed.test_args = args.collect();
                break;
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if parsed.runs == 0 {
        return Err("--runs must be at least 1".into());
    }
    Ok(parsed)
}

pub fn stress(args: StressArgs) -> ExitCode {
    let targets = match build(&args.targets) {
        Ok(targets) => targets,
        Err(message) => {
            eprintln!("xtask stress: {message}");
            return ExitCode::from(2);
        }
    };
    let root = workspace_root();
    let logs = root.join("target/stress");
    if let Err(err) = fs::create_dir_all(&logs) {
        eprintln!("xtask stress: cannot create {}: {err}", logs.display());
        return ExitCode::from(2);
    }
    let hogs = match Hogs::start(args.load) {
        Ok(hogs) => hogs,
        Err(message) => {
            eprintln!("xtask stress: {message}");
            return ExitCode::from(2);
        }
    };
    eprintln!(
        "xtask stress: {} runs of {} test target(s) beside {} busy-looping process(es); outputs in {}",
        args.runs,
        targets.len(),
        hogs.children.len(),
        logs.display()
    );
    let mut kernel = KernelLog::open();
    let mut tally = Tally::default();
    for run in 1..=args.runs {
        for target in &targets {
            let log = logs.join(format!("run{run}-{}.log", target.name));
            let started = Instant::now();
            let outcome = match run_target(target, &args.test_args, &root, &log) {
                Ok(outcome) => outcome,
                Err(message) => {
                    eprintln!("xtask stress: {message}");
                    return ExitCode::from(2);
                }
            };
            let stalls = kernel.as_mut().map(KernelLog::stalls_since_last).unwrap_or_default();
            let failed = tally.add(run, &target.name, &outcome, !stalls.is_empty());
            eprintln!(
                "run {run}/{}: {} {} passed, {} failed in {:.1} s",
                args.runs,
                target.name,
                outcome.passed.len(),
                failed.len(),
                started.elapsed().as_secs_f64()
            );
            for stall in &stalls {
                eprintln!("  the kernel reported during this run: {stall}");
            }
            for failure in failed {
                eprintln!(
                    "\n======== FAILED: run {run}, target {}, test {} ({}) ========\n{}\n======== end of run {run} {} {} ========\n",
                    target.name,
                    failure.test,
                    log.display(),
                    failure.output.trim_end(),
                    target.name,
                    failure.test
                );
            }
        }
    }
    drop(hogs);
    tally.print_summary(args.runs);
    if tally.failures() == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}

/// The workspace's root, where cargo runs the integration tests and puts
/// what it builds.
pub(crate) fn workspace_root() -> PathBuf {
    let xtask = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask.parent().unwrap_or(xtask).to_owned()
}

/// One integration test binary.
struct Target {
    name: String,
    executable: PathBuf,
}

/// Builds the test targets with cargo and returns their binaries, in
/// cargo's order.
fn build(names: &[String]) -> Result<Vec<Target>, String> {
    let (mut command, cargo) = crate::cargo();
    command.args(["test", "--workspace", "--no-run", "--message-format=json-render-diagnostics"]);
    if names.is_empty() {
        command.arg("--tests");
    }
    for name in names {
        command.args(["--test", name]);
    }
    let mut child = command
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|err| format!("cannot run {}: {err}", cargo.to_string_lossy()))?;
    let stdout = child.stdout.take().ok_or("cargo's stdout is not a pipe")?;
    let mut targets = Vec::new();
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        if let Some(target) = test_artifact(&line) {
            targets.push(target);
        }
    }
    let status = child.wait().map_err(|err| format!("cannot wait for cargo: {err}"))?;
    if !status.success() {
        return Err(format!("building the tests failed ({status})"));
    }
    if targets.is_empty() {
        return Err("cargo built no integration test target".into());
    }
    Ok(targets)
}

/// The integration test binary a line of cargo's JSON messages announces,
/// if it announces one. Cargo's messages are one object a line with the
/// keys in a fixed order; the values read here (the target's kind and
/// name, the executable) are strings without escapes on any path this
/// repository builds to, so a full JSON parser is not needed.
fn test_artifact(line: &str) -> Option<Target> {
    if !line.starts_with("{\"reason\":\"compiler-artifact\"") {
        return None;
    }
    let target = line.split_once("\"target\":{")?.1;
    if !target.starts_with("\"kind\":[\"test\"]") {
        return None;
    }
    let name = string_after(target, "\"name\":\"")?;
    let executable = string_after(line, "\"executable\":\"")?;
    Some(Target { name: name.to_owned(), executable: executable.into() })
}

fn string_after<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let rest = text.split_once(key)?.1;
    let end = rest.find('"')?;
    let value = &rest[..end];
    (!value.contains('\\')).then_some(value)
}

/// What one run of one target did.
#[derive(Debug, Default, PartialEq, Eq)]
struct Outcome {
    passed: Vec<String>,
    /// Each failed test and its output (libtest's `---- NAME stdout ----`
    /// section); a binary that failed without naming a test (a crash, a
    /// signal) is one failure named `(the test binary)` with its whole
    /// output.
    failed: Vec<Failure>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Failure {
    test: String,
    output: String,
}

/// Runs `target`'s binary once from the workspace root (where cargo runs
/// it), its output to `log`.
fn run_target(target: &Target, test_args: &[OsString], root: &Path, log: &Path) -> Result<Outcome, String> {
    let file = fs::File::create(log).map_err(|err| format!("cannot create {}: {err}", log.display()))?;
    let stderr = file.try_clone().map_err(|err| format!("cannot share {}: {err}", log.display()))?;
    let status = Command::new(&target.executable)
        .args(test_args)
        .current_dir(root)
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(stderr)
        .status()
        .map_err(|err| format!("cannot run {}: {err}", target.executable.display()))?;
    let output = fs::read(log).map_err(|err| format!("cannot read {}: {err}", log.display()))?;
    Ok(parse_outcome(&String::from_utf8_lossy(&output), status.success()))
}

/// Reads libtest's report: the `test NAME ... ok|FAILED` lines and the
/// `---- NAME stdout ----` sections of the failures.
fn parse_outcome(output: &str, succeeded: bool) -> Outcome {
    let mut outcome = Outcome::default();
    let mut failed_names = Vec::new();
    for line in output.lines() {
        let Some(rest) = line.strip_prefix("test ") else { continue };
        if let Some(name) = rest.strip_suffix(" ... ok") {
            outcome.passed.push(name.to_owned());
        } else if let Some(name) = rest.strip_suffix(" ... FAILED") {
            failed_names.push(name.to_owned());
        }
    }
    for test in failed_names {
        let header = format!("---- {test} stdout ----");
        let section = output.split_once(&header).map_or("", |(_, rest)| rest);
        let end = ["\n---- ", "\nfailures:\n"].iter().filter_map(|marker| section.find(marker)).min();
        let output = end.map_or(section, |end| &section[..end]).trim_start_matches('\n').to_owned();
        outcome.failed.push(Failure { test, output });
    }
    if !succeeded && outcome.failed.is_empty() {
        outcome.failed.push(Failure { test: "(the test binary)".into(), output: output.to_owned() });
    }
    outcome
}

/// Runs and failures of one test, over every run.
#[derive(Debug, Default, PartialEq, Eq)]
struct TestTally {
    runs: u32,
    /// The runs it failed in; `*` marks one the kernel reported a stall in.
    failed_in: Vec<String>,
}

/// Every test's tally.
#[derive(Default)]
struct Tally {
    tests: BTreeMap<(String, String), TestTally>,
}

impl Tally {
    /// Counts `outcome` and returns its failures; `kernel_stalled` says the
    /// kernel reported a stall while it ran.
    fn add<'a>(&mut self, run: u32, target: &str, outcome: &'a Outcome, kernel_stalled: bool) -> &'a [Failure] {
        for test in &outcome.passed {
            self.tests.entry((target.to_owned(), test.clone())).or_default().runs += 1;
        }
        for failure in &outcome.failed {
            let entry = self.tests.entry((target.to_owned(), failure.test.clone())).or_default();
            entry.runs += 1;
            entry.failed_in.push(if kernel_stalled { format!("{run}*") } else { run.to_string() });
        }
        &outcome.failed
    }

    fn failures(&self) -> usize {
        self.tests.values().map(|test| test.failed_in.len()).sum()
    }

    fn print_summary(&self, runs: u32) {
        println!("\n| target | test | failures/runs | failed in runs (* the kernel reported a stall) |");
        println!("|---|---|---|---|");
        for ((target, test), tally) in &self.tests {
            println!(
                "| {target} | {test} | {}/{} | {} |",
                tally.failed_in.len(),
                tally.runs,
                tally.failed_in.join(", ")
            );
        }
        let tests = self.tests.len();
        println!("\n{} failure(s) in {runs} run(s) of {tests} test(s)", self.failures());
    }
}

/// The kernel's log from the moment the stress started, for the reports of
/// a CPU held so long that every wait of a test is stretched past its
/// deadline: a lockup, an RCU stall, a task blocked for minutes.
struct KernelLog {
    kmsg: fs::File,
}

/// Words of the kernel's stall reports (kernel/workqueue.c,
/// kernel/rcu/tree_stall.h, kernel/watchdog.c, kernel/hung_task.c).
const STALL_REPORTS: &[&str] =
    &["workqueue lockup", "rcu: INFO:", "kthread starved", "soft lockup", "hard LOCKUP", "blocked for more than"];

impl KernelLog {
    /// Opened at its end: only what the kernel says from now on. None
    /// (said once) when `/dev/kmsg` cannot be read.
    fn open() -> Option<Self> {
        let opened = fs::OpenOptions::new()
            .read(true)
            .custom_flags(O_NONBLOCK)
            .open("/dev/kmsg")
            .and_then(|mut kmsg| kmsg.seek(SeekFrom::End(0)).map(|_| kmsg));
        match opened {
            Ok(kmsg) => Some(KernelLog { kmsg }),
            Err(err) => {
                eprintln!("xtask stress: cannot read /dev/kmsg ({err}); the kernel's stall reports are not shown");
                None
            }
        }
    }

    /// The stall reports the kernel logged since the last call.
    fn stalls_since_last(&mut self) -> Vec<String> {
        let mut stalls = Vec::new();
        // One record a read; a record longer than this is cut by the kernel.
        let mut record = [0u8; 8192];
        loop {
            match self.kmsg.read(&mut record) {
                Ok(0) => break,
                Ok(len) => stalls.extend(stall_report(&String::from_utf8_lossy(&record[..len]))),
                // Records overwritten before they were read: go on with the next.
                Err(err) if err.kind() == ErrorKind::BrokenPipe => {}
                Err(err) if err.kind() == ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        stalls
    }
}

/// `O_NONBLOCK` (the standard library does not name it): reading
/// `/dev/kmsg` past its last record fails with `EAGAIN` instead of waiting.
const O_NONBLOCK: i32 = 0o4000;

/// The message of a `/dev/kmsg` record (`PRIORITY,SEQUENCE,MICROSECONDS,FLAGS;MESSAGE`)
/// with its time since boot, if it reports a stall.
fn stall_report(record: &str) -> Option<String> {
    let (prefix, message) = record.split_once(';')?;
    let message = message.lines().next()?.trim_end();
    if !STALL_REPORTS.iter().any(|words| message.contains(words)) {
        return None;
    }
    let micros: u64 = prefix.split(',').nth(2)?.parse().ok()?;
    Some(format!("[{:.1} s since boot] {message}", micros as f64 / 1e6))
}

/// The busy-looping processes: this program again (`xtask hog`), killed
/// and reaped when dropped, so also when the stress panics. On Ctrl-C the
/// terminal's SIGINT reaches them too (they are in its foreground process
/// group); killed any other way, this program leaves them orphans, and
/// each exits when it sees its parent change.
struct Hogs {
    children: Vec<Child>,
}

impl Hogs {
    fn start(count: u32) -> Result<Self, String> {
        let exe = env::current_exe().map_err(|err| format!("cannot find this program to start hogs: {err}"))?;
        let mut hogs = Hogs { children: Vec::new() };
        for _ in 0..count {
            let child = Command::new(&exe)
                .arg("hog")
                .stdin(Stdio::null())
                .spawn()
                .map_err(|err| format!("cannot start a hog: {err}"))?;
            hogs.children.push(child);
        }
        Ok(hogs)
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        for child in &mut self.children {
            // Already gone (e.g. by SIGINT) is fine: either way it is reaped.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `xtask hog`: spins on one CPU until its parent is gone.
pub fn hog() -> ExitCode {
    let parent = std::os::unix::process::parent_id();
    let mut last_check = Instant::now();
    let mut counter: u64 = 0;
    loop {
        for _ in 0..1_000_000 {
            counter = black_box(counter.wrapping_add(1));
        }
        if last_check.elapsed() >= Duration::from_millis(200) {
            if std::os::unix::process::parent_id() != parent {
                return ExitCode::SUCCESS;
            }
            last_check = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_parse_with_defaults_and_the_test_binarys_own() {
        let args = |list: &[&str]| list.iter().map(OsString::from).collect::<Vec<_>>();
        let parsed =
            parse_args(args(&["--runs", "3", "--load", "2", "--test", "hung", "--test", "heal", "--", "--exact", "x"]))
                .unwrap();
        assert_eq!(
            parsed,
            StressArgs {
                runs: 3,
                load: 2,
                targets: vec!["hung".into(), "heal".into()],
                test_args: args(&["--exact", "x"])
            }
        );
        assert_eq!(parse_args(Vec::new()).unwrap().runs, 20);
        assert!(parse_args(args(&["--runs", "0"])).is_err());
        assert!(parse_args(args(&["--runs"])).is_err());
        assert!(parse_args(args(&["--bogus"])).is_err());
    }

    #[test]
    fn only_integration_test_artifacts_are_taken() {
        let test = r#"{"reason":"compiler-artifact","package_id":"path+file:///r#fuse-supervisor@0.1.0","manifest_path":"/r/Cargo.toml","target":{"kind":["test"],"crate_types":["bin"],"name":"hung","src_path":"/r/tests/hung.rs","edition":"2024","doc":false,"doctest":false,"test":true},"profile":{},"features":[],"filenames":["/r/target/debug/deps/hung-0a1b"],"executable":"/r/target/debug/deps/hung-0a1b","fresh":true}"#;
        let target = test_artifact(test).unwrap();
        assert_eq!(
            (target.name.as_str(), target.executable.as_path()),
            ("hung", Path::new("/r/target/debug/deps/hung-0a1b"))
        );
        let lib = test.replace(r#""kind":["test"]"#, r#""kind":["lib"]"#);
        assert!(test_artifact(&lib).is_none());
        assert!(test_artifact(r#"{"reason":"build-finished","success":true}"#).is_none());
    }

    #[test]
    fn failures_carry_their_own_output_section() {
        let output = "\nrunning 3 tests\ntest a ... ok\ntest b ... FAILED\ntest c::d ... FAILED\n\nfailures:\n\n\
                      ---- b stdout ----\nsupervisor log:\n{\"x\":1}\nthread 'b' panicked\n\n\
                      ---- c::d stdout ----\nboom\n\nfailures:\n    b\n    c::d\n\ntest result: FAILED.\n";
        let outcome = parse_outcome(output, false);
        assert_eq!(outcome.passed, ["a"]);
        assert_eq!(
            outcome.failed,
            [
                Failure { test: "b".into(), output: "supervisor log:\n{\"x\":1}\nthread 'b' panicked\n".into() },
                Failure { test: "c::d".into(), output: "boom\n".into() },
            ]
        );
    }

    #[test]
    fn stall_reports_are_taken_from_the_kernels_records_and_marked_in_the_tally() {
        let lockup =
            "4,812345,31650886400,-;BUG: workqueue lockup - pool cpus=0 node=0 flags=0x0 nice=0 stuck for 49s!\n";
        assert_eq!(
            stall_report(lockup).as_deref(),
            Some("[31650.9 s since boot] BUG: workqueue lockup - pool cpus=0 node=0 flags=0x0 nice=0 stuck for 49s!")
        );
        let continuation = "6,812346,31650887125,-;Showing busy workqueues and worker pools:\n SUBSYSTEM=x\n";
        assert_eq!(stall_report(continuation), None);
        assert_eq!(stall_report("not a record"), None);

        let outcome = parse_outcome("test a ... FAILED\n\n---- a stdout ----\nslow\n", false);
        let mut tally = Tally::default();
        tally.add(1, "t", &outcome, false);
        tally.add(2, "t", &outcome, true);
        let test = &tally.tests[&("t".to_owned(), "a".to_owned())];
        assert_eq!(test, &TestTally { runs: 2, failed_in: vec!["1".into(), "2*".into()] });
        assert_eq!(tally.failures(), 2);
    }

    #[test]
    fn a_binary_that_fails_without_naming_a_test_is_one_failure() {
        let outcome = parse_outcome("running 1 test\nSegmentation fault\n", false);
        assert_eq!(outcome.failed.len(), 1);
        assert_eq!(outcome.failed[0].test, "(the test binary)");
        assert!(parse_outcome("running 0 tests\n", true).failed.is_empty());
    }
}
