//! How long `fuse-supervisor run` takes to know a node again after a storm
//! that overflowed its inotify and fanotify queues (`testbed::storm`: 10,000
//! new pods, 100 of them with a target, thousands of pods deleted, more
//! mount changes than the fanotify queue holds, all while the supervisor
//! was frozen). A benchmark, not a test: it prints numbers.
//!
//! ```text
//! cargo bench --bench overflow [-- --rounds 3]
//! ```
//!
//! Per round, from the thaw (`SIGCONT`, the bench's clock) to the
//! timestamps of the supervisor's log lines (same machine, same clock):
//! - mounts: to `mount table resynced` (reason `overflow`), with its
//!   `took_us` (the listing and the statmount of every mount);
//! - pods: to `pod directories rescanned`, with its `took_us` (the walk
//!   and the watches of every pod directory); before it, the watcher reads
//!   the queue's events up to the overflow event;
//! - all known: until `/metrics` counts every target of the storm healthy
//!   (polled every 5 ms).
//!
//! Every flag is also an environment variable (`OVERFLOW_BENCH_ROUNDS`).
//! Needs root, /dev/fuse, bindfs and Linux 6.15+.
use std::path::Path;
use std::time::{Duration, SystemTime};

use fuse_supervisor_testbed::storm::{StormNode, StormPlan};

#[allow(dead_code)]
mod common;

use common::Flags;

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(300);

fn main() {
    if !common::is_root() {
        eprintln!("overflow bench: needs root (mount namespaces, /dev/fuse); not run");
        return;
    }
    let flags = Flags::new("OVERFLOW_BENCH");
    let rounds: usize = flags.number("rounds", "3");
    let plan = StormPlan::overflowing().expect("queue limits");
    println!(
        "storm: {} new pods ({} with a target), {} pods deleted, {} mount changes; {} targets before, {} after",
        plan.new_pods,
        plan.new_targets,
        plan.bare_pods_deleted + plan.deleted_pods,
        plan.mount_changes,
        plan.kept_pods + plan.deleted_pods,
        plan.kept_pods + plan.new_targets,
    );
    println!("round  storm      thaw→mounts (took)     thaw→pods (took)       thaw→all known");
    for round in 1..=rounds {
        let mut node = StormNode::prepare(Path::new(BINARY), plan, &["--log", "info"]).expect("a supervised node");
        let from = node.supervisor.log_len();
        let (storm, thawed) = node.storm().expect("the storm");
        node.wait_for_healthy_targets(node.targets.len(), TIMEOUT).expect("every target known");
        let all_known = thawed.elapsed().unwrap_or_default();
        let mounts = logged(&node, from, thawed, |line| {
            line.contains("\"mount table resynced\"") && line.contains("\"overflow\"")
        });
        let pods = logged(&node, from, thawed, |line| line.contains("\"pod directories rescanned\""));
        println!(
            "{round:>5}  {:>7.2} s  {:>8.1} ms ({:>6.1} ms)  {:>8.1} ms ({:>6.1} ms)  {:>8.1} ms",
            storm.as_secs_f64(),
            ms(mounts.0),
            ms(mounts.1),
            ms(pods.0),
            ms(pods.1),
            ms(all_known),
        );
    }
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// The first line from `from` on matching `pred`, once logged: how long
/// after `thawed` it was written, and its `took_us`.
fn logged(node: &StormNode, from: usize, thawed: SystemTime, pred: impl Fn(&str) -> bool) -> (Duration, Duration) {
    node.supervisor.wait_for_lines(TIMEOUT, from, 1, &pred).expect("the resync's log line");
    let line = node.supervisor.log()[from..].iter().find(|line| pred(line)).cloned().unwrap_or_default();
    let value: serde_json::Value = serde_json::from_str(&line).expect("a JSON log line");
    let at = value["timestamp"].as_str().and_then(parse_timestamp).expect("timestamp");
    let took = Duration::from_micros(value["fields"]["took_us"].as_u64().expect("took_us"));
    (at.duration_since(thawed).unwrap_or_default(), took)
}

/// tracing's RFC 3339 timestamp.
fn parse_timestamp(text: &str) -> Option<SystemTime> {
    let at = time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::from_nanos(u64::try_from(at.unix_timestamp_nanos()).ok()?))
}
