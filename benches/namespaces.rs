//! What keeping the node's mount namespaces by events costs
//! (`fuse_supervisor_engine::heal::namespaces`), against walking `/proc` for them:
//!
//! - a node's worth of processes (`--processes`, sleeping) and of container
//!   namespaces (`--namespaces`, each a process that unshared a copy of the
//!   sandbox's mounts and exec'd, so it can receive mounts by propagation
//!   and is read at every search);
//! - the keeper's first walk, then the CPU time and wake-ups of its two
//!   threads (the connector's and its own) while `--execs-per-second`
//!   processes exec in known namespaces for `--seconds`: what a busy node's
//!   probes and shells cost it;
//! - how long new namespaces take to be learnt, from their exec;
//! - a search for a connection's mounts, as at a daemon's death: the kept
//!   namespaces read again, against a walk of `/proc`.
//!
//! A benchmark, not a test: it prints numbers.
//!
//! ```text
//! cargo bench --bench namespaces [-- --processes 1000 --namespaces 100 --execs-per-second 500 --seconds 10 --searches 50]
//! ```
//!
//! Every flag is also an environment variable (`NAMESPACES_BENCH_PROCESSES`…).
//! Needs root; the namespaces are made inside a sandbox's private mount
//! namespace, and every process it starts is killed at the end.
use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fuse_supervisor_engine::heal::namespaces::{Namespaces, walk};
use fuse_supervisor_engine::heal::priority::HealActivity;
use fuse_supervisor_engine::model::table::Dev;
use fuse_supervisor_engine::watch::processes::{ConnectorOptions, ProcessConnector};
use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::system;

#[allow(dead_code)]
mod common;

use common::Flags;

const TIMEOUT: Duration = Duration::from_secs(60);

fn main() {
    if !common::is_root() {
        eprintln!("namespaces bench: needs root (mount namespaces, the process connector); not run");
        return;
    }
    let flags = Flags::new("NAMESPACES_BENCH");
    let processes: usize = flags.number("processes", "1000");
    let namespaces: usize = flags.number("namespaces", "100");
    let rate: u32 = flags.number("execs-per-second", "500");
    let seconds: u64 = flags.number("seconds", "10");
    let searches: usize = flags.number("searches", "50");

    let sandbox = Sandbox::new().expect("sandbox");
    // Killed and reaped by the sandbox when it is dropped.
    let mut children = Vec::new();
    for _ in 0..processes {
        children.push(sandbox.spawn(sleeper(&["sleep", "3600"])).expect("a sleeping process"));
    }
    for _ in 0..namespaces {
        let unshare = sleeper(&[
            &system::program("unshare").to_string_lossy(),
            "--mount",
            "--propagation",
            "unchanged",
            "sleep",
            "3600",
        ]);
        children.push(sandbox.spawn(unshare).expect("a namespace"));
    }
    println!(
        "mount namespaces kept by events: {} processes on the machine, {namespaces} namespaces made by unshare+exec",
        count_processes()
    );

    let kept = Namespaces::new(Path::new("/proc"));
    let started = Instant::now();
    let connector = ProcessConnector::open(ConnectorOptions::default()).expect("subscribe to the process connector");
    let keeper = kept.keep(&connector, Arc::new(HealActivity::default())).expect("keep the namespaces");
    wait("the first walk", || kept.is_kept());
    println!("  first walk, keeper started → kept        {:.1} ms ({} namespaces)", ms(started.elapsed()), kept.len());

    // Execs in a known namespace (this one), at the asked rate.
    let before = keeper_threads();
    let window = Duration::from_secs(seconds);
    let storm = Instant::now();
    let mut execs = 0u64;
    let period = Duration::from_secs(1) / rate.max(1);
    while storm.elapsed() < window {
        let next = storm + period * u32::try_from(execs + 1).unwrap_or(u32::MAX);
        Command::new("/bin/true").status().expect("exec /bin/true");
        execs += 1;
        if let Some(pause) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(pause);
        }
    }
    let after = keeper_threads();
    let cpu = after.cpu_ticks.saturating_sub(before.cpu_ticks);
    let switches = after.switches.saturating_sub(before.switches);
    let tick_ms = 1000.0 / USER_HZ;
    println!(
        "  {execs} execs in {seconds} s: keeper CPU {:.0} ms ({:.2} % of a core, {:.1} µs per exec), {switches} wake-ups ({:.2} per exec)",
        cpu as f64 * tick_ms,
        cpu as f64 * tick_ms / (seconds as f64 * 10.0),
        cpu as f64 * tick_ms * 1000.0 / execs.max(1) as f64,
        switches as f64 / execs.max(1) as f64,
    );

    // New namespaces, learnt from their exec.
    let known = kept.len();
    let made = Instant::now();
    let batch = namespaces.max(1);
    for _ in 0..batch {
        let unshare = sleeper(&[&system::program("unshare").to_string_lossy(), "--mount", "sleep", "3600"]);
        children.push(sandbox.spawn(unshare).expect("a namespace"));
    }
    wait("the new namespaces learnt", || kept.len() >= known + batch);
    println!("  {batch} new namespaces started → all learnt   {:.1} ms", ms(made.elapsed()));

    // Searches for a connection nobody holds: every candidate read again,
    // against a walk.
    let own = std::fs::metadata("/proc/self/ns/mnt").map(|meta| std::os::unix::fs::MetadataExt::ino(&meta));
    let skip = BTreeSet::from([own.expect("own namespace")]);
    let dead = BTreeSet::from([Dev { major: 0, minor: 1 << 19 }]);
    let mut kept_times = Vec::new();
    let mut walk_times = Vec::new();
    let mut read = 0;
    for _ in 0..searches {
        let at = Instant::now();
        read = kept.holding(&skip, &dead, ..).expect("search").read;
        kept_times.push(at.elapsed());
        let at = Instant::now();
        walk(Path::new("/proc"), &skip, || {}).expect("walk");
        walk_times.push(at.elapsed());
    }
    println!("  search at a death, kept ({read} read)       {}", summary(kept_times));
    println!("  search at a death, walk of /proc         {}", summary(walk_times));
    drop(keeper);
    drop(children);
}

fn sleeper(argv: &[&str]) -> Command {
    let mut command = Command::new(argv[0]);
    command.args(&argv[1..]).stdin(Stdio::null()).stdout(Stdio::null());
    command
}

fn wait(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {TIMEOUT:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn count_processes() -> usize {
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.flatten()
                .filter(|entry| entry.file_name().to_str().is_some_and(|name| name.parse::<u32>().is_ok()))
                .count()
        })
        .unwrap_or(0)
}

/// CPU ticks and context switches of this process's keeper threads (the
/// connector's `procwatch`, and `namespaces`).
#[derive(Default)]
struct ThreadCost {
    cpu_ticks: u64,
    switches: u64,
}

fn keeper_threads() -> ThreadCost {
    let mut cost = ThreadCost::default();
    for task in std::fs::read_dir("/proc/self/task").expect("tasks").flatten() {
        let dir = task.path();
        let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !matches!(name.trim(), "procwatch" | "namespaces") {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
        let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        // utime and stime: fields 14 and 15, the 12th and 13th after the name.
        cost.cpu_ticks +=
            fields.get(11..13).map_or(0, |times| times.iter().filter_map(|t| t.parse::<u64>().ok()).sum());
        let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
        cost.switches += status
            .lines()
            .filter(|line| line.contains("ctxt_switches"))
            .filter_map(|line| line.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>();
    }
    cost
}

/// The unit of `/proc`'s CPU times: USER_HZ, 100 on every architecture
/// Linux runs on.
const USER_HZ: f64 = 100.0;

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

fn summary(mut times: Vec<Duration>) -> String {
    if times.is_empty() {
        return "none".into();
    }
    times.sort_unstable();
    let at = |q: f64| ms(times[((times.len() - 1) as f64 * q).round() as usize]);
    format!("p50 {:.2} ms  p99 {:.2} ms  ({} searches)", at(0.5), at(0.99), times.len())
}
