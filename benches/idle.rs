//! The supervisor's idle cost: `fuse-supervisor run` in a sandbox whose
//! mount table holds ~1,000 and then ~10,000 mounts, watched for a while
//! with nothing happening. Counts the context switches (voluntary and
//! involuntary) and CPU time of all its threads over the window, and its
//! resident memory. Then, as a diagnostic, the cost of one rescan caused by
//! a mount change that does not concern it. A benchmark, not a test: it
//! prints numbers.
//!
//! ```text
//! cargo bench --bench idle [-- --seconds 60 --targets 1000 --large-mounts 10000 --volumes-per-pod 1]
//!     [--cases 1,2,3] [--supervisor-args '--process-watch off'] [--wrapper 'heaptrack -o /tmp/ht']
//!     [--smaps-dir /tmp/smaps]
//! ```
//!
//! `--cases` picks tables by number; `--supervisor-args` adds `run`
//! arguments; `--wrapper` starts the supervisor through a program (a heap
//! profiler), whose descendant running the binary is the one measured;
//! `--smaps-dir` keeps a copy of its `/proc/<pid>/smaps` after each window.
//!
//! Every flag is also an environment variable (`IDLE_BENCH_SECONDS`, ...).
//! Needs root and /dev/fuse. Everything runs in a private mount namespace
//! that dies with the run.
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fuse_supervisor_sys::mount;
use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::scenario::{Daemon, FuseSource, SupervisorProcess, wait_for};

// Each bench uses part of the shared module.
#[allow(dead_code)]
mod common;

use common::{Flags, is_root};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const MIB: f64 = 1024.0 * 1024.0;
/// Pause after start-up before the window opens, so the start-up scan and
/// journal write are not counted as idle work.
const SETTLE: Duration = Duration::from_secs(2);
/// Unrelated mount changes for the rescan diagnostic, and the pause between
/// them (long enough that each is a rescan of its own, not coalesced).
const CHURN_CHANGES: usize = 20;
const CHURN_PAUSE: Duration = Duration::from_millis(250);

struct Options {
    window: Duration,
    targets: usize,
    large_mounts: usize,
    /// How many of the targets share a pod (a node runs ~110 pods at most).
    volumes_per_pod: usize,
    /// Which of the three tables to measure (1-based), all by default.
    cases: Vec<usize>,
    /// Extra `run` arguments, space-separated (`--process-watch off`).
    supervisor_args: Vec<String>,
    /// A program (with arguments) the supervisor is started through, space-separated.
    wrapper: Vec<std::ffi::OsString>,
    /// Where to copy the supervisor's smaps after each window, when set.
    smaps_dir: Option<PathBuf>,
}

impl Options {
    fn parse() -> Options {
        let flags = Flags::new("IDLE_BENCH");
        Options {
            window: Duration::from_secs(flags.number("seconds", "60")),
            targets: flags.number("targets", "1000"),
            large_mounts: flags.number("large-mounts", "10000"),
            volumes_per_pod: flags.number::<usize>("volumes-per-pod", "1").max(1),
            cases: flags.list("cases", "1,2,3", |case| case.parse().ok()),
            supervisor_args: flags.text("supervisor-args", "").split_whitespace().map(str::to_owned).collect(),
            wrapper: flags.text("wrapper", "").split_whitespace().map(Into::into).collect(),
            smaps_dir: Some(flags.text("smaps-dir", "")).filter(|dir| !dir.is_empty()).map(PathBuf::from),
        }
    }
}

/// Counters of one thread, from `/proc/<pid>/task/<tid>/`.
#[derive(Debug, Clone, Default)]
struct ThreadCounters {
    name: String,
    voluntary: u64,
    involuntary: u64,
    /// On-CPU time from `schedstat`, in nanoseconds.
    cpu_ns: u64,
}

/// Counters of a process: every thread, plus the process-wide figures.
#[derive(Debug, Clone, Default)]
struct ProcessCounters {
    threads: Vec<(u32, ThreadCounters)>,
    /// utime + stime from `/proc/<pid>/stat`, in clock ticks.
    cpu_ticks: u64,
    rss_kib: u64,
    hwm_kib: u64,
    rss_anon_kib: u64,
}

fn status_field(status: &str, field: &str) -> u64 {
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn read_counters(pid: u32) -> ProcessCounters {
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    let mut counters = ProcessCounters::default();
    let tasks = std::fs::read_dir(proc_dir.join("task")).expect("list the supervisor's threads");
    for task in tasks.map_while(Result::ok) {
        let Some(tid) = task.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
        let dir = task.path();
        // A thread that ended between the listing and the read is skipped.
        let Ok(status) = std::fs::read_to_string(dir.join("status")) else { continue };
        let cpu_ns = std::fs::read_to_string(dir.join("schedstat"))
            .ok()
            .and_then(|text| text.split_whitespace().next()?.parse().ok())
            .unwrap_or(0);
        let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default().trim().to_owned();
        counters.threads.push((
            tid,
            ThreadCounters {
                name,
                voluntary: status_field(&status, "voluntary_ctxt_switches"),
                involuntary: status_field(&status, "nonvoluntary_ctxt_switches"),
                cpu_ns,
            },
        ));
    }
    counters.threads.sort_by_key(|(tid, _)| *tid);
    let stat = std::fs::read_to_string(proc_dir.join("stat")).expect("read the supervisor's stat");
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields of the line, the 12th and 13th after it.
    let after_name = stat.rsplit_once(") ").map_or("", |(_, rest)| rest);
    let fields: Vec<u64> = after_name.split_whitespace().map(|f| f.parse().unwrap_or(0)).collect();
    counters.cpu_ticks = fields.get(11).copied().unwrap_or(0) + fields.get(12).copied().unwrap_or(0);
    let status = std::fs::read_to_string(proc_dir.join("status")).expect("read the supervisor's status");
    counters.rss_kib = status_field(&status, "VmRSS");
    counters.hwm_kib = status_field(&status, "VmHWM");
    counters.rss_anon_kib = status_field(&status, "RssAnon");
    counters
}

/// What one sandbox configuration measured.
struct Measurement {
    label: String,
    mounts: usize,
    startup: Duration,
    window: Duration,
    threads: usize,
    voluntary: u64,
    involuntary: u64,
    cpu_ticks: u64,
    cpu_ns: u64,
    rss_kib: u64,
    hwm_kib: u64,
    rss_anon_kib: u64,
    per_thread: String,
    rescan: Option<Rescans>,
}

struct Rescans {
    changes: usize,
    scans: usize,
    cpu_ns: u64,
    voluntary: u64,
}

/// Makes `targets` pod volumes bound to `source`, and `padding` tmpfs mounts
/// outside the kubelet tree, all from one task on the sandbox thread.
fn populate(sandbox: &Sandbox, source: &Path, targets: usize, per_pod: usize, padding: usize) {
    let binds: Vec<PathBuf> = (0..targets)
        .map(|target| {
            sandbox.pod_volume_dir(&format!("pod-{:05}", target / per_pod), &format!("data-{}", target % per_pod))
        })
        .collect();
    let pads: Vec<PathBuf> = (0..padding).map(|i| sandbox.root().join("padding").join(i.to_string())).collect();
    common::mount_targets_and_padding(sandbox, source, binds, pads);
}

fn measure(label: &str, targets: usize, per_pod: usize, padding: usize, options: &Options) -> Measurement {
    let window = options.window;
    let binary = Path::new(BINARY);
    eprintln!("# {label}: setting up");
    let sandbox = Sandbox::new().expect("sandbox");
    let source = FuseSource::start(&sandbox, Daemon::DemoFs, "shared-data").expect("start the FUSE daemon");
    populate(&sandbox, &source.path, targets, per_pod, padding);
    let mounts = sandbox.mountinfo().lines().count();
    let started = Instant::now();
    let mut args: Vec<&str> = vec!["--kubelet", "none"];
    args.extend(options.supervisor_args.iter().map(String::as_str));
    let supervisor =
        SupervisorProcess::start_wrapped(&sandbox, &options.wrapper, binary, &sandbox.root().join("state"), args)
            .expect("start the supervisor");
    let startup = started.elapsed();
    std::thread::sleep(SETTLE);
    let pid = supervised_pid(supervisor.pid());
    eprintln!("# {label}: {mounts} mounts, supervisor up in {startup:?}; idle for {window:?}");
    let before = read_counters(pid);
    let opened = Instant::now();
    std::thread::sleep(window);
    let after = read_counters(pid);
    let window = opened.elapsed();
    if let Some(dir) = &options.smaps_dir {
        let copy = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::copy(format!("/proc/{pid}/smaps"), dir.join(format!("{label}.smaps"))));
        if let Err(err) = copy {
            eprintln!("cannot copy the supervisor's smaps: {err}");
        }
    }

    let mut per_thread = String::new();
    let (mut voluntary, mut involuntary, mut cpu_ns) = (0, 0, 0);
    for (tid, now) in &after.threads {
        let then = before.threads.iter().find(|(t, _)| t == tid).map(|(_, c)| c.clone()).unwrap_or_default();
        let (v, i, ns) = (now.voluntary - then.voluntary, now.involuntary - then.involuntary, now.cpu_ns - then.cpu_ns);
        voluntary += v;
        involuntary += i;
        cpu_ns += ns;
        let _ = write!(per_thread, " {}({tid}): {v}/{i}", now.name);
    }
    let rescan = Some(rescan_cost(&sandbox, &supervisor, pid));
    let measured = Measurement {
        label: label.to_owned(),
        mounts,
        startup,
        window,
        threads: after.threads.len(),
        voluntary,
        involuntary,
        cpu_ticks: after.cpu_ticks - before.cpu_ticks,
        cpu_ns,
        rss_kib: after.rss_kib,
        hwm_kib: after.hwm_kib,
        rss_anon_kib: after.rss_anon_kib,
        per_thread,
        rescan,
    };
    if let Err(err) = supervisor.stop() {
        eprintln!("supervisor did not stop cleanly: {err}");
    }
    drop(source);
    drop(sandbox);
    measured
}

/// The supervisor's own process: `pid`, or when started through a wrapper,
/// the descendant of `pid` that runs the binary.
fn supervised_pid(pid: u32) -> u32 {
    let runs_binary =
        |pid: u32| std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| exe == Path::new(BINARY));
    let mut todo = vec![pid];
    while let Some(parent) = todo.pop() {
        if runs_binary(parent) {
            return parent;
        }
        let Ok(entries) = std::fs::read_dir("/proc") else { break };
        for entry in entries.map_while(Result::ok) {
            let Some(child) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            let ppid = stat.rsplit_once(") ").and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            if ppid == Some(parent) {
                todo.push(child);
            }
        }
    }
    pid
}

/// Mounts and unmounts a tmpfs outside the kubelet tree, paced so that each
/// change is a rescan of its own, and counts what the supervisor spent.
fn rescan_cost(sandbox: &Sandbox, supervisor: &SupervisorProcess, pid: u32) -> Rescans {
    let dir = sandbox.root().join("churn");
    let created = dir.clone();
    sandbox.run(move || std::fs::create_dir_all(&created)).expect("create the churn directory");
    let scans_before = scans(supervisor);
    let before = read_counters(pid);
    for _ in 0..CHURN_CHANGES / 2 {
        let path = dir.clone();
        sandbox.run(move || mount::mount_tmpfs(&path)).expect("mount a churn tmpfs");
        std::thread::sleep(CHURN_PAUSE);
        let path = dir.clone();
        sandbox.run(move || mount::detach(&path)).expect("unmount the churn tmpfs");
        std::thread::sleep(CHURN_PAUSE);
    }
    let _ = wait_for("supervisor rescans settle", Duration::from_secs(5), || {
        scans(supervisor) - scans_before >= CHURN_CHANGES
    });
    let after = read_counters(pid);
    let sum = |counters: &ProcessCounters, f: fn(&ThreadCounters) -> u64| -> u64 {
        counters.threads.iter().map(|(_, c)| f(c)).sum()
    };
    Rescans {
        changes: CHURN_CHANGES,
        scans: scans(supervisor) - scans_before,
        cpu_ns: sum(&after, |c| c.cpu_ns) - sum(&before, |c| c.cpu_ns),
        voluntary: sum(&after, |c| c.voluntary) - sum(&before, |c| c.voluntary),
    }
}

/// "scanned" debug lines the supervisor has logged so far.
fn scans(supervisor: &SupervisorProcess) -> usize {
    supervisor.log().iter().filter(|line| line.contains("\"scanned\"")).count()
}

fn report(measurements: &[Measurement]) {
    println!();
    println!("fuse-supervisor idle cost (debug logging on, as the testbed runs it)");
    println!(
        "targets: zero idle wakeups (context switches) while nothing happens; < 16 MiB resident with 10,000 mounts"
    );
    println!();
    println!(
        "{:<44} {:>6} {:>7} {:>7} {:>9} {:>9} {:>9} {:>10} {:>9} {:>9} {:>9}",
        "table",
        "mounts",
        "window",
        "threads",
        "vol cs",
        "invol cs",
        "cpu ms",
        "cpu ticks",
        "VmRSS",
        "VmHWM",
        "RssAnon"
    );
    for m in measurements {
        println!(
            "{:<44} {:>6} {:>6.0}s {:>7} {:>9} {:>9} {:>9.3} {:>10} {:>5.1} MiB {:>5.1} MiB {:>5.1} MiB",
            m.label,
            m.mounts,
            m.window.as_secs_f64(),
            m.threads,
            m.voluntary,
            m.involuntary,
            m.cpu_ns as f64 / 1e6,
            m.cpu_ticks,
            m.rss_kib as f64 * 1024.0 / MIB,
            m.hwm_kib as f64 * 1024.0 / MIB,
            m.rss_anon_kib as f64 * 1024.0 / MIB,
        );
    }
    println!();
    for m in measurements {
        let rss_verdict = if m.mounts >= 10_000 {
            if m.rss_kib * 1024 < 16 * 1024 * 1024 { " (meets < 16 MiB)" } else { " (MISSES < 16 MiB)" }
        } else {
            ""
        };
        let wake_verdict = if m.voluntary + m.involuntary == 0 { "meets zero wakeups" } else { "MISSES zero wakeups" };
        println!("{}: {wake_verdict}{rss_verdict}; start-up (spawn to first scan done) {:?}", m.label, m.startup);
        println!("  context switches per thread over the window (voluntary/involuntary):{}", m.per_thread);
        if let Some(r) = &m.rescan {
            let per_scan = if r.scans > 0 { r.cpu_ns as f64 / r.scans as f64 / 1e6 } else { f64::NAN };
            println!(
                "  unrelated mount changes: {} changes -> {} rescans, {:.3} ms CPU per rescan, {} voluntary switches",
                r.changes, r.scans, per_scan, r.voluntary
            );
        }
    }
}

fn main() {
    let options = Options::parse();
    if !is_root() {
        eprintln!("idle needs root (mount namespaces, /dev/fuse): skipped");
        return;
    }
    let small = options.targets;
    let large = options.large_mounts;
    let large_padding = large.saturating_sub(small);
    let per_pod = options.volumes_per_pod;
    let pods = |targets: usize| targets.div_ceil(per_pod);
    let cases = [
        (format!("1 source + {small} targets in {} pods", pods(small)), small, 0),
        (format!("1 source + {small} targets in {} pods + {large_padding} tmpfs", pods(small)), small, large_padding),
        (format!("1 source + {large} targets in {} pods", pods(large)), large, 0),
    ];
    let measurements: Vec<Measurement> = cases
        .iter()
        .enumerate()
        .filter(|(at, _)| options.cases.contains(&(at + 1)))
        .map(|(_, (label, targets, padding))| measure(label, *targets, per_pod, *padding, &options))
        .collect();
    report(&measurements);
}
