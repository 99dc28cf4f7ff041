//! Death-to-Degraded latency of `fuse-supervisor run`, with each process
//! watcher: a FUSE daemon (demofs, in a private mount namespace) serving N
//! pod targets is SIGKILLed, and the time until the supervisor has marked
//! every target Degraded is measured. A benchmark, not a test: it prints
//! numbers.
//!
//! ```text
//! cargo bench --bench degraded [-- --cycles 30 --targets 10]
//! ```
//!
//! Two figures per backend, p50/p90/p99/max:
//! - kill → Degraded: from just before `kill(2)` (the bench's clock) to the
//!   timestamp of the supervisor's "daemon died" log line, written once
//!   every target is marked (same machine, same wall clock);
//! - seen → Degraded (`marked_after_us`): from the watcher's timestamp of
//!   the exit (the kernel's for the proc connector, the pidfd's readiness
//!   for pidfd) to the same point, inside the supervisor.
//!
//! Every flag is also an environment variable (`DEGRADED_BENCH_CYCLES`…).
//! Needs root and /dev/fuse.
use std::path::Path;
use std::time::{Duration, SystemTime};

use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::scenario::{self, Daemon, FuseSource, Restart, SupervisorProcess};

#[allow(dead_code)]
mod common;

use common::Flags;

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(20);

fn main() {
    if !common::is_root() {
        eprintln!("degraded bench: needs root (mount namespaces, /dev/fuse); not run");
        return;
    }
    let flags = Flags::new("DEGRADED_BENCH");
    let cycles: usize = flags.number("cycles", "30");
    let targets: usize = flags.number("targets", "10");
    println!("death-to-Degraded, {cycles} kills of a demofs daemon serving {targets} targets");
    for backend in ["connector", "pidfd"] {
        let (kill_to_marked, seen_to_marked) = measure(backend, cycles, targets);
        println!("{backend:>9}  kill → Degraded  {}", summary(kill_to_marked));
        println!("{backend:>9}  seen → Degraded  {}", summary(seen_to_marked));
    }
}

fn count(supervisor: &SupervisorProcess, message: &str) -> usize {
    let quoted = format!("\"message\":\"{message}\"");
    supervisor.log().iter().filter(|line| line.contains(&quoted)).count()
}

/// Latencies of each cycle in µs: kill → marked, and seen → marked.
fn measure(backend: &str, cycles: usize, targets: usize) -> (Vec<u64>, Vec<u64>) {
    let binary = Path::new(BINARY);
    let sandbox = Sandbox::new().expect("sandbox");
    let mut source = FuseSource::start(&sandbox, Daemon::DemoFs, "bench-data").expect("daemon");
    for pod in 0..targets {
        source.bind_volume(&sandbox, &format!("pod-{pod:04}"), "data").expect("bind");
    }
    let state_dir = sandbox.root().join("state");
    let args = ["--kubelet", "none", "--process-watch", backend];
    let supervisor = SupervisorProcess::start_with(&sandbox, binary, &state_dir, args).expect("supervisor");
    let (mut kill_to_marked, mut seen_to_marked) = (Vec::new(), Vec::new());
    for cycle in 0..cycles {
        scenario::wait_for("the daemon watched", TIMEOUT, || count(&supervisor, "watching the FUSE daemon") > cycle)
            .expect("daemon watched");
        let killed = SystemTime::now();
        source.crash().expect("kill");
        let message = "daemon died; its targets are degraded";
        scenario::wait_for("the death logged", TIMEOUT, || count(&supervisor, message) > cycle).expect("death");
        let quoted = format!("\"message\":\"{message}\"");
        let lines = supervisor.log();
        let line = lines.iter().filter(|line| line.contains(&quoted)).nth(cycle).expect("the line");
        let value: serde_json::Value = serde_json::from_str(line).expect("JSON log");
        let marked = value["timestamp"].as_str().and_then(parse_timestamp).expect("timestamp");
        kill_to_marked.push(marked.duration_since(killed).unwrap_or_default().as_micros() as u64);
        seen_to_marked.push(value["fields"]["marked_after_us"].as_u64().expect("marked_after_us"));
        source.restart(&sandbox, Restart::UnmountThenMount).expect("restart");
        scenario::wait_for("every target healed", TIMEOUT, || count(&supervisor, "healed") >= targets * (cycle + 1))
            .expect("healed");
    }
    drop(supervisor);
    (kill_to_marked, seen_to_marked)
}

/// tracing's RFC 3339 timestamp.
fn parse_timestamp(text: &str) -> Option<SystemTime> {
    let at = time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).ok()?;
    Some(SystemTime::from(at))
}

fn summary(mut micros: Vec<u64>) -> String {
    micros.sort_unstable();
    let at = |q: f64| micros[((micros.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0;
    format!("p50 {:.2} ms  p90 {:.2} ms  p99 {:.2} ms  max {:.2} ms", at(0.5), at(0.9), at(0.99), at(1.0))
}
