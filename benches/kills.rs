//! The supervisor SIGKILLed mid-heal, again and again: each kill lands at
//! one of the chosen points in turn (after the stacks, with a new top
//! parked, with new tops slid beneath the stale layers, during a state
//! save, while a dead daemon's layers are held), then a plain supervisor
//! starts and the node must converge (every target read again in its
//! container, one layer each, the mount count at its baseline, the state
//! file valid and current). A benchmark, not a test: it prints figures.
//!
//! ```text
//! cargo bench --bench kills [-- --kills 100 --volumes 8 --subpaths 2]
//! ```
//!
//! Prints the kills done, how many converged, and the time from the
//! restarted supervisor's start to convergence (p50/p99/max), per point
//! and overall. Every flag is also an environment variable
//! (`KILLS_BENCH_KILLS`…). Needs root, /dev/fuse and bindfs.
use std::path::Path;
use std::time::Duration;

use fuse_supervisor_testbed::node::{KillPoint, Node, NodeOptions};
use fuse_supervisor_testbed::scenario::Daemon;

#[allow(dead_code)]
mod common;

use common::Flags;

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(30);

fn main() {
    if !common::is_root() {
        eprintln!("kills bench: needs root (mount namespaces, /dev/fuse); not run");
        return;
    }
    let flags = Flags::new("KILLS_BENCH");
    let kills: usize = flags.number("kills", "100");
    let volumes: usize = flags.number("volumes", "8");
    let subpaths: usize = flags.number("subpaths", "2");
    println!("{kills} SIGKILLs of `run` mid-heal, {volumes} whole-volume and {subpaths} subPath targets of one bindfs");
    let mut node =
        Node::new(Path::new(BINARY), NodeOptions { daemon: Daemon::Bindfs, volumes, subpaths }).expect("the node");
    node.converge(TIMEOUT).expect("readers read before anything happens");
    let mut times: Vec<(KillPoint, Duration)> = Vec::with_capacity(kills);
    let mut failures = Vec::new();
    for kill in 0..kills {
        let point = KillPoint::ALL[kill % KillPoint::ALL.len()];
        match node.kill_at(point, TIMEOUT) {
            Ok(took) => times.push((point, took)),
            Err(err) => {
                eprintln!("kill {kill} at {}: did not converge: {err:?}\n{}", point.name(), node.describe());
                failures.push(kill);
                break;
            }
        }
    }
    println!(
        "kills done {}, converged {}, not converged {}",
        times.len() + failures.len(),
        times.len(),
        failures.len()
    );
    for point in KillPoint::ALL {
        let took: Vec<Duration> = times.iter().filter(|(at, _)| *at == point).map(|(_, took)| *took).collect();
        println!("{:>14}  {:>3} kills  start → converged  {}", point.name(), took.len(), common::summary_ms(took));
    }
    println!(
        "{:>14}  {:>3} kills  start → converged  {}",
        "all",
        times.len(),
        common::summary_ms(times.iter().map(|t| t.1).collect())
    );
}
