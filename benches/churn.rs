//! What unrelated mount churn costs the supervisor: `fuse-supervisor run`
//! in a sandbox whose table holds N mounts (a FUSE source, a few pod targets
//! bound to it, tmpfs padding outside the kubelet tree), while R mount
//! changes a second (a tmpfs mounted and unmounted in turn, outside the
//! kubelet tree: nothing the supervisor heals) go on for T seconds. For each
//! table size it runs each watch mode in turn and prints the supervisor's
//! CPU over the window (utime + stime of `/proc/<pid>/stat`, and the finer
//! sum of its threads' `schedstat`) and its resident memory, side by side.
//! A benchmark, not a test: it prints numbers.
//!
//! ```text
//! cargo bench --bench churn [-- --mounts 1000,10000,50000 --rate 100 --seconds 10 --targets 10
//!     --modes fanotify,mountinfo,poll --binary PATH]
//! ```
//!
//! `--binary` measures another build of `fuse-supervisor` (an older one, for
//! a before-and-after) instead of this one.
//!
//! Modes: `fanotify` (`--table-events fanotify`), `mountinfo`
//! (`--table-events mountinfo`), `poll` (`--mode poll --poll-period 5s`).
//! Every flag is also an environment variable (`CHURN_BENCH_RATE`, ...).
//! Needs root, /dev/fuse and Linux 6.15+ for fanotify. Everything runs in a
//! private mount namespace that dies with the run.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fuse_supervisor_sys::mount;
use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::scenario::{Daemon, FuseSource, SupervisorProcess};

// Each bench uses part of the shared module.
#[allow(dead_code)]
mod common;

use common::{Flags, is_root};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
/// After start-up, before the window opens: the first scan and the journal
/// write are start-up work, not churn.
const SETTLE: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Fanotify,
    Mountinfo,
    Poll,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Fanotify => "fanotify",
            Mode::Mountinfo => "mountinfo",
            Mode::Poll => "poll 5s",
        }
    }

    fn args(self) -> &'static [&'static str] {
        match self {
            Mode::Fanotify => &["--table-events", "fanotify"],
            Mode::Mountinfo => &["--table-events", "mountinfo"],
            Mode::Poll => &["--mode", "poll", "--poll-period", "5s"],
        }
    }
}

struct Options {
    mounts: Vec<usize>,
    rate: u32,
    window: Duration,
    targets: usize,
    modes: Vec<Mode>,
    /// The supervisor measured; the daemon and the sandbox are this build's.
    binary: PathBuf,
}

impl Options {
    fn parse() -> Options {
        let flags = Flags::new("CHURN_BENCH");
        Options {
            mounts: flags.list("mounts", "1000,10000,50000", |n| n.parse().ok()),
            rate: flags.number::<u32>("rate", "100").max(1),
            window: Duration::from_secs(flags.number("seconds", "10")),
            targets: flags.number("targets", "10"),
            modes: flags.list("modes", "fanotify,mountinfo,poll", |name| match name {
                "fanotify" => Some(Mode::Fanotify),
                "mountinfo" => Some(Mode::Mountinfo),
                "poll" => Some(Mode::Poll),
                _ => None,
            }),
            binary: PathBuf::from(flags.text("binary", BINARY)),
        }
    }
}

/// On-CPU time of all a process's threads, in nanoseconds (`schedstat`):
/// finer than the clock ticks of `stat`, which count 10 ms at a time.
fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    tasks
        .map_while(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("schedstat")).ok())
        .filter_map(|text| text.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// utime + stime of a process, in clock ticks, and its resident memory.
fn cpu_ticks_and_rss(pid: u32) -> (u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read the supervisor's stat");
    // utime and stime are the 12th and 13th fields after the command name.
    let after_name = stat.rsplit_once(") ").map_or("", |(_, rest)| rest);
    let fields: Vec<u64> = after_name.split_whitespace().map(|f| f.parse().unwrap_or(0)).collect();
    let ticks = fields.get(11).copied().unwrap_or(0) + fields.get(12).copied().unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read the supervisor's status");
    let rss_kib = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    (ticks, rss_kib)
}

/// A FUSE source, `targets` pod volumes bound to it, and tmpfs padding
/// until the table holds about `mounts` mounts.
fn populate(sandbox: &Sandbox, source: &Path, targets: usize, mounts: usize) {
    let binds: Vec<PathBuf> =
        (0..targets).map(|target| sandbox.pod_volume_dir(&format!("pod-{target:05}"), "data")).collect();
    let present = sandbox.mountinfo().lines().count() + targets;
    let pads: Vec<PathBuf> =
        (0..mounts.saturating_sub(present)).map(|i| sandbox.root().join("padding").join(i.to_string())).collect();
    common::mount_targets_and_padding(sandbox, source, binds, pads);
}

/// `rate` changes a second for `window`, alternately mounting and
/// unmounting a tmpfs outside the kubelet tree; how many were made.
fn churn(sandbox: &Sandbox, rate: u32, window: Duration) -> usize {
    let dir = sandbox.root().join("churn");
    let created = dir.clone();
    sandbox.run(move || std::fs::create_dir_all(&created)).expect("create the churn directory");
    let started = Instant::now();
    let step = Duration::from_secs(1) / rate;
    let mut changes = 0;
    while started.elapsed() < window {
        let path = dir.clone();
        let mounted = changes % 2 == 1;
        sandbox
            .run(move || if mounted { mount::detach(&path) } else { mount::mount_tmpfs(&path) })
            .expect("churn the mount table");
        changes += 1;
        if let Some(wait) = (step * changes as u32).checked_sub(started.elapsed()) {
            std::thread::sleep(wait);
        }
    }
    if changes % 2 == 1 {
        sandbox.run(move || mount::detach(&dir)).expect("unmount the churn tmpfs");
    }
    changes
}

struct Row {
    mounts: usize,
    mode: Mode,
    changes: usize,
    window: Duration,
    cpu_percent: f64,
    /// From the threads' `schedstat`; threads that ended during the window
    /// are not counted (the supervisor's long-lived ones do the work).
    cpu_ns_percent: f64,
    rss_kib: u64,
    /// How long the start-up listing of the namespace took, where the
    /// supervisor keeps a table (its `mount table resynced` log line).
    resync: Option<Duration>,
}

/// `took_us` of the supervisor's first `mount table resynced` line.
fn first_resync(supervisor: &SupervisorProcess) -> Option<Duration> {
    supervisor
        .log()
        .iter()
        .find_map(|line| {
            let value: serde_json::Value = serde_json::from_str(line).ok()?;
            let fields = value.get("fields")?;
            (fields.get("message")? == "mount table resynced").then(|| fields.get("took_us")?.as_u64())?
        })
        .map(Duration::from_micros)
}

fn measure(sandbox: &Sandbox, mounts: usize, mode: Mode, options: &Options) -> Row {
    let binary = options.binary.as_path();
    let mut args: Vec<&str> = vec!["--kubelet", "none", "--log", "info"];
    args.extend(mode.args());
    let state = sandbox.root().join("state").join(mode.name().replace(' ', "-"));
    let supervisor = SupervisorProcess::start_with(sandbox, binary, &state, args).expect("start the supervisor");
    std::thread::sleep(SETTLE);
    let pid = supervisor.pid();
    let (ticks_before, _) = cpu_ticks_and_rss(pid);
    let ns_before = cpu_ns(pid);
    let opened = Instant::now();
    let changes = churn(sandbox, options.rate, options.window);
    let window = opened.elapsed();
    let (ticks_after, rss_kib) = cpu_ticks_and_rss(pid);
    let ns_after = cpu_ns(pid);
    let resync = first_resync(&supervisor);
    if let Err(err) = supervisor.stop() {
        eprintln!("supervisor did not stop cleanly: {err}");
    }
    let cpu_seconds = (ticks_after - ticks_before) as f64 / procfs::ticks_per_second() as f64;
    Row {
        mounts,
        mode,
        changes,
        window,
        cpu_percent: 100.0 * cpu_seconds / window.as_secs_f64(),
        cpu_ns_percent: 100.0 * ns_after.saturating_sub(ns_before) as f64 / 1e9 / window.as_secs_f64(),
        rss_kib,
        resync,
    }
}

fn main() {
    let options = Options::parse();
    if !is_root() {
        eprintln!("churn needs root (mount namespaces, /dev/fuse): skipped");
        return;
    }
    let mut rows = Vec::new();
    for &mounts in &options.mounts {
        eprintln!("# {mounts} mounts: setting up");
        let sandbox = Sandbox::new().expect("sandbox");
        let source = FuseSource::start(&sandbox, Daemon::DemoFs, "shared-data").expect("start the FUSE daemon");
        populate(&sandbox, &source.path, options.targets, mounts);
        let counted = sandbox.mountinfo().lines().count();
        for &mode in &options.modes {
            eprintln!("# {counted} mounts, {}: {} changes/s for {:?}", mode.name(), options.rate, options.window);
            rows.push(measure(&sandbox, counted, mode, &options));
        }
        drop(source);
        drop(sandbox);
    }
    println!();
    let (rate, targets) = (options.rate, options.targets);
    println!("{} under unrelated mount churn ({rate} changes/s, {targets} targets)", options.binary.display());
    println!("target: at 10,000 mounts and 100 changes/s, fanotify at or below poll's CPU; flat from 10,000 to 50,000");
    println!();
    println!(
        "{:>7} {:>10} {:>8} {:>7} {:>12} {:>15} {:>9} {:>14}",
        "mounts", "mode", "changes", "window", "CPU % core", "(schedstat %)", "VmRSS", "start-up list"
    );
    for row in &rows {
        println!(
            "{:>7} {:>10} {:>8} {:>6.1}s {:>12.2} {:>15.3} {:>5.1} MiB {:>14}",
            row.mounts,
            row.mode.name(),
            row.changes,
            row.window.as_secs_f64(),
            row.cpu_percent,
            row.cpu_ns_percent,
            row.rss_kib as f64 / 1024.0,
            row.resync.map_or_else(|| "-".to_owned(), |took| format!("{took:.1?}")),
        );
    }
}
