//! A long soak of `fuse-supervisor run`: crash/restart cycles of a daemon
//! serving whole-volume and subPath targets, each read in a container;
//! each cycle waits until the node converged (every target read again, one
//! layer each, the mount count at its baseline, the state file current),
//! the supervisor saw the crashed process die, and it watches the new
//! daemon. A benchmark, not a test: it prints figures.
//!
//! ```text
//! SOAK_BENCH_CYCLES=1000 cargo bench --bench soak
//! ```
//!
//! Prints the cycles healed, the time from the crash to convergence
//! (p50/p99/max, and per daemon style when they are mixed), and the
//! supervisor's RSS, open descriptors and threads after the first, tenth
//! and last cycles and their maximum. Every flag is also an environment
//! variable (`SOAK_BENCH_CYCLES`, `SOAK_BENCH_VOLUMES` (9),
//! `SOAK_BENCH_SUBPATHS` (1), `SOAK_BENCH_DAEMON`: `mixed` (the default:
//! bindfs unmount-then-mount, demofs mounting over the stale mount, bindfs
//! daemonizing, in turn), `bindfs`, `bindfs-daemonized`, or `demofs`
//! (unmount-then-mount and mount-over-stale in turn)).
//! Needs root, /dev/fuse and bindfs.
use std::path::Path;
use std::time::Duration;

use fuse_supervisor_testbed::node::{MIXED, Node, NodeOptions, Usage};
use fuse_supervisor_testbed::scenario::{Daemon, Restart};

#[allow(dead_code)]
mod common;

use common::Flags;

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(30);

fn main() {
    if !common::is_root() {
        eprintln!("soak bench: needs root (mount namespaces, /dev/fuse); not run");
        return;
    }
    let flags = Flags::new("SOAK_BENCH");
    let cycles: usize = flags.number("cycles", "1000");
    let volumes: usize = flags.number("volumes", "9");
    let subpaths: usize = flags.number("subpaths", "1");
    let styles: Vec<(Daemon, Restart)> = match flags.text("daemon", "mixed").as_str() {
        "mixed" => MIXED.to_vec(),
        "demofs" => vec![(Daemon::DemoFs, Restart::UnmountThenMount), (Daemon::DemoFs, Restart::MountOverStale)],
        "bindfs" => vec![(Daemon::Bindfs, Restart::UnmountThenMount)],
        "bindfs-daemonized" => vec![(Daemon::BindfsDaemonized, Restart::UnmountThenMount)],
        other => panic!("--daemon: mixed, demofs, bindfs or bindfs-daemonized, not {other}"),
    };
    let named: Vec<String> = styles.iter().map(|(daemon, style)| format!("{} {style:?}", daemon.name())).collect();
    println!(
        "{cycles} crash/restart cycles ({} in turn), {volumes} volumes and {subpaths} subPath, each read",
        named.join(", ")
    );
    let daemon = styles[0].0;
    let mut node = Node::new(Path::new(BINARY), NodeOptions { daemon, volumes, subpaths }).expect("node");
    node.converge(TIMEOUT).expect("readers read");
    node.start_supervisor(&[], &["--log", "info"]).expect("supervisor");
    node.converge(TIMEOUT).expect("the state saved");
    let (soak, failure) = match node.soak(cycles, &styles, TIMEOUT) {
        Ok(soak) => (soak, None),
        Err((soak, err)) => (soak, Some(err)),
    };
    if let Some(err) = &failure {
        eprintln!("{err:?}\n{}", node.describe());
    }
    println!("cycles healed {} of {cycles} ({:.1} %)", soak.cycles, 100.0 * soak.cycles as f64 / cycles as f64);
    println!("crash → converged  {}", common::summary_ms(soak.converge_times.clone()));
    if styles.len() > 1 {
        for (index, name) in named.iter().enumerate() {
            let times = soak.converge_times.iter().skip(index).step_by(styles.len()).copied().collect();
            println!("  {name:<40} {}", common::summary_ms(times));
        }
    }
    let show = |label: &str, usage: Option<&Usage>| {
        if let Some(u) = usage {
            println!(
                "{label:>10}  RSS {:>6} KiB  descriptors {:>4}  threads {:>3}",
                u.rss_kib, u.descriptors, u.threads
            );
        }
    };
    show("cycle 1", soak.usage.first());
    show("cycle 10", soak.usage.get(9));
    show("last", soak.usage.last());
    let max = |f: fn(&Usage) -> u64| soak.usage.iter().map(f).max().unwrap_or(0);
    println!(
        "{:>10}  RSS {:>6} KiB  descriptors {:>4}  threads {:>3}",
        "max",
        max(|u| u.rss_kib),
        max(|u| u.descriptors as u64),
        max(|u| u.threads)
    );
}
