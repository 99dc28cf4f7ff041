//! A daemon whose dead mount is unmounted at once: a restart script's
//! `kill -9; umount -l; start` with no wait between, where a scan may find
//! the mount gone before the loop handles the exit. The death is still
//! reported (logged with the crashed pid, counted once per crash) and every
//! target heals to one layer, with either process watcher. A daemon that
//! ends by itself after a clean unmount (its pod's volume going away) is
//! no death. Needs root, /dev/fuse and bindfs.
use std::path::Path;
use std::time::Duration;

use fuse_supervisor::testbed::node::{Node, NodeOptions, process_state};
use fuse_supervisor::testbed::scenario::{self, DATA_FILE, Daemon, FuseSource, Restart, SupervisorProcess};
use fuse_supervisor::testbed::{ContainerReader, Observation, Sandbox};
use fuse_supervisor_sys::mount;

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(30);
const ROUNDS: usize = 5;
const DEATHS: &str = "fuse_supervisor_daemon_deaths_total";
const DIED: &str = "\"daemon died; its targets are degraded\"";

fn crashes_unmounted_at_once_are_each_seen_dead(args: &[&str]) {
    let options = NodeOptions { daemon: Daemon::Bindfs, volumes: 3, subpaths: 1 };
    let mut node = Node::new(Path::new(BINARY), options).expect("node");
    node.converge(TIMEOUT).expect("readers read");
    node.start_supervisor(&[], args).expect("supervisor");
    node.converge(TIMEOUT).expect("the state saved");
    node.wait_until_watched(0, TIMEOUT).expect("the first daemon watched");
    for round in 1..=ROUNDS {
        node.cycle_unmounting_at_once(TIMEOUT)
            .unwrap_or_else(|err| panic!("round {round}: {err}\n{}", node.describe()));
        let supervisor = node.supervisor().expect("supervisor");
        assert_eq!(supervisor.metric(DEATHS).expect("scrape /metrics"), Some(round as f64), "round {round}");
    }
}

#[test]
fn pidfd_sees_every_crash_whose_mount_is_unmounted_at_once() {
    crashes_unmounted_at_once_are_each_seen_dead(&[]);
}

#[test]
fn proc_connector_sees_every_crash_whose_mount_is_unmounted_at_once() {
    crashes_unmounted_at_once_are_each_seen_dead(&["--process-watch", "connector"]);
}

/// Whether the JSON log line is a death naming `pid`.
fn death_of(line: &str, pid: u32) -> bool {
    line.contains(DIED)
        && serde_json::from_str::<serde_json::Value>(line).is_ok_and(|line| line["fields"]["pid"] == pid)
}

/// Whether the JSON log line says the daemon `pid` is watched.
fn watching(line: &str, pid: u32) -> bool {
    line.contains("\"watching the FUSE daemon\"")
        && serde_json::from_str::<serde_json::Value>(line).is_ok_and(|line| {
            line["fields"]["pids"].as_str().is_some_and(|pids| pids.trim_matches(['[', ']']) == pid.to_string())
        })
}

/// The pod goes away (its target unmounted), then its volume's global
/// mount (a CSI driver's unstage): bindfs ends by itself, exit 0, before
/// or after the supervisor's scan finds its mount gone. No death; a crash
/// of another daemon afterwards is one, the only one counted.
#[test]
fn a_daemon_ending_after_a_clean_unmount_is_no_death() {
    for round in 0..3 {
        let sandbox = Sandbox::new().expect("sandbox");
        let binary = Path::new(BINARY);
        let leaving = FuseSource::start(&sandbox, binary, Daemon::Bindfs, "leaving").expect("start daemon");
        let leaving_target = leaving.bind_volume(&sandbox, "leaving-pod", "data").expect("bind volume");
        let mut staying = FuseSource::start(&sandbox, binary, Daemon::Bindfs, "staying").expect("start daemon");
        let target = staying.bind_volume(&sandbox, "staying-pod", "data").expect("bind volume");
        let reader = ContainerReader::spawn(&sandbox, binary, "app", &target, Path::new(DATA_FILE)).expect("reader");
        let reads = |expected: String| move |seen: &Observation| seen.content() == Some(expected.as_str());
        reader.wait_until(TIMEOUT, reads(staying.expected_content())).expect("reads before the crash");

        let state_dir = sandbox.root().join("state");
        let supervisor =
            SupervisorProcess::start_with(&sandbox, binary, &state_dir, ["--kubelet", "none"]).expect("supervisor");
        let dump = Dump(&supervisor);
        let (left, stays) = (leaving.pid().expect("leaving pid"), staying.pid().expect("staying pid"));
        for pid in [left, stays] {
            supervisor.wait_for_log(TIMEOUT, |line| watching(line, pid)).expect("both daemons watched");
        }

        sandbox.run(move || mount::unmount(&leaving_target)).expect("the pod's target unmounted");
        let global = leaving.path.clone();
        sandbox.run(move || mount::unmount(&global)).expect("the global mount unmounted");
        scenario::wait_for("bindfs to end by itself", TIMEOUT, || process_state(left).is_none_or(|state| state == 'Z'))
            .expect("bindfs ends after its unmount");

        // Handled after the first daemon's end: its exit and the scan of
        // its unmount came before this crash and the new daemon's mount.
        let from = supervisor.log_len();
        staying.restart(&sandbox, Restart::UnmountThenMount).expect("crash and restart");
        reader.wait_until(TIMEOUT, reads(staying.expected_content())).expect("reads after the heal");
        let new = staying.pid().expect("restarted pid");
        supervisor.wait_for_lines(TIMEOUT, from, 1, |line| watching(line, new)).expect("the new daemon watched");
        supervisor.wait_for_log(TIMEOUT, |line| death_of(line, stays)).expect("the crash is a death");
        let log = supervisor.log();
        assert!(!log.iter().any(|line| death_of(line, left)), "round {round}: a clean end reported as a death");
        assert_eq!(supervisor.metric(DEATHS).expect("scrape /metrics"), Some(1.0), "round {round}");
        drop(dump);
        supervisor.stop().expect("stop the supervisor");
    }
}

/// Prints the supervisor's log if the test fails.
struct Dump<'a>(&'a SupervisorProcess);

impl Drop for Dump<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("supervisor log:\n{}", self.0.log().join("\n"));
        }
    }
}
