//! Daemon deaths seen by `fuse-supervisor run`: a SIGKILLed FUSE daemon's
//! targets are Degraded (logged, and shown by `status`) before it comes
//! back, with both process watchers; the heal then reports the outage from
//! the death; a connection kept open by another process is aborted so that
//! a hung reader gets an error; a death after the daemon's own mount was
//! unmounted (its target still on the connection) is reported; a daemon
//! that hands its connection to a process the supervisor had not seen is
//! not taken for dead; a freed connection number goes to the next
//! connection with another `fusectl` directory (what a connection's
//! identity stands on). Real daemons in private mount namespaces; needs
//! root and /dev/fuse.
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fuse_supervisor_engine::heal::connections::FuseConnections;
use fuse_supervisor_engine::model::table::{Dev, Snapshot};
use fuse_supervisor_sys::mount::Propagation;
use fuse_supervisor_sys::pidfd::PidFd;
use fuse_supervisor_sys::{fuse, mount};
use fuse_supervisor_testbed::container::ContainerOptions;
use fuse_supervisor_testbed::scenario::{
    DATA_FILE, Daemon, FuseSource, Restart, ScenarioError, SupervisorProcess, wait_for,
};
use fuse_supervisor_testbed::{ContainerReader, Observation, Sandbox};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(20);

fn binary() -> &'static Path {
    Path::new(BINARY)
}

/// One source bound into one pod with a reader; the supervisor runs with
/// `args` once [`World::supervise`] is called.
struct World {
    reader: Option<ContainerReader>,
    supervisor: Option<SupervisorProcess>,
    source: FuseSource,
    target: PathBuf,
    state_dir: PathBuf,
    sandbox: Sandbox,
}

impl World {
    fn new(daemon: Daemon) -> World {
        let sandbox = Sandbox::new().expect("sandbox");
        let source = FuseSource::start(&sandbox, daemon, "shared-data").expect("start daemon");
        World::with_source(sandbox, source)
    }

    fn with_source(sandbox: Sandbox, source: FuseSource) -> World {
        let mut world = World::without_reader(sandbox, source);
        world.reader = Some(spawn_reader(&world.sandbox, &world.target));
        world
    }

    fn without_reader(sandbox: Sandbox, source: FuseSource) -> World {
        let target = source.bind_volume(&sandbox, "pod-0000", "data").expect("bind volume");
        let state_dir = sandbox.root().join("state");
        World { reader: None, supervisor: None, source, target, state_dir, sandbox }
    }

    fn reader(&self) -> &ContainerReader {
        self.reader.as_ref().expect("reader running")
    }

    /// Starts the supervisor and waits until it watches the daemon.
    fn supervise(&mut self, args: &[&str]) {
        let mut all = vec!["--kubelet", "none"];
        all.extend(args);
        let supervisor =
            SupervisorProcess::start_with(&self.sandbox, binary(), &self.state_dir, all).expect("supervisor");
        supervisor.wait_for_log(TIMEOUT, |line| line.contains("watching the FUSE daemon")).expect("daemon watched");
        self.supervisor = Some(supervisor);
    }

    fn supervisor(&self) -> &SupervisorProcess {
        self.supervisor.as_ref().expect("supervisor running")
    }

    /// Waits for the death of the daemon `pid` to be logged, with the target.
    fn wait_for_death_of(&self, pid: u32) {
        let died = self
            .supervisor()
            .wait_for_log(TIMEOUT, message_is("daemon died; its targets are degraded"))
            .expect("the death is logged");
        assert_eq!(field(&died, "pid"), serde_json::json!(pid), "{died}");
        assert_eq!(field(&died, "targets"), serde_json::json!(1), "{died}");
    }

    /// Waits for the log line of the target's move to `state`.
    fn wait_for_target_state(&self, state: &str) {
        let (target, to) = (self.target.display().to_string(), format!("\"to\":\"{state}\""));
        self.supervisor()
            .wait_for_log(TIMEOUT, |line| line.contains(&target) && line.contains(&to))
            .unwrap_or_else(|err| panic!("the target is not {state}: {err}"));
    }

    fn reads_current(&self) {
        let expected = self.source.expected_content();
        self.reader().wait_until(TIMEOUT, |o| o.content() == Some(expected.as_str())).expect("reader reads the source");
    }

    /// `fuse-supervisor status` in the sandbox, against the same state dir.
    fn status(&self) -> String {
        self.status_with(&[])
    }

    fn status_with(&self, args: &[&str]) -> String {
        let mut command = std::process::Command::new(binary());
        command
            .arg("status")
            .args(args)
            .arg("--kubelet-root")
            .arg(self.sandbox.kubelet_root())
            .arg("--state-dir")
            .arg(&self.state_dir)
            .args(["--mount-namespace", "/proc/self/ns/mnt"])
            .stdout(std::process::Stdio::piped());
        let mut child = self.sandbox.spawn(command).expect("status");
        let mut out = String::new();
        std::io::Read::read_to_string(&mut child.take_stdout().expect("stdout"), &mut out).expect("read status");
        assert!(child.wait().expect("wait status").success(), "{out}");
        out
    }

    /// The target's state and the source's recorded death in `status --json`.
    fn status_json(&self) -> (String, serde_json::Value) {
        let out = self.status_with(&["--json"]);
        let status: serde_json::Value = serde_json::from_str(&out).expect("status JSON");
        let target = self.target.display().to_string();
        let row = status["targets"].as_array().expect("targets").iter().find(|row| row["path"] == target.as_str());
        let state = row.expect("the target in status")["state"].as_str().expect("state").to_owned();
        (state, status["sources"][0]["daemon_died"].clone())
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("mount table:\n{}", self.sandbox.mountinfo());
        }
    }
}

/// A reader of the target; returns once it has read once.
fn spawn_reader(sandbox: &Sandbox, target: &Path) -> ContainerReader {
    ContainerReader::spawn(sandbox, "pod-0000", target, Path::new(DATA_FILE)).expect("reader")
}

/// A field of a JSON log line (tracing puts them under `fields`).
fn field(line: &str, name: &str) -> serde_json::Value {
    let value: serde_json::Value = serde_json::from_str(line).expect("a JSON log line");
    value["fields"][name].clone()
}

fn message_is(message: &'static str) -> impl Fn(&str) -> bool {
    move |line| line.contains(&format!("\"message\":\"{message}\""))
}

fn sigkill_marks_degraded_before_the_restart(backend: &str) {
    let mut world = World::new(Daemon::Bindfs);
    world.reads_current();
    world.supervise(&["--process-watch", backend]);
    let pid = world.source.pid().expect("daemon running");

    world.source.crash().unwrap();
    let killed = Instant::now();
    world.wait_for_death_of(pid);
    world.wait_for_target_state("degraded");
    let target = world.target.display().to_string();
    // The state file is written once the loop is idle: shortly after.
    let target_row = |status: &str| status.lines().find(|line| line.contains(&target)).map(str::to_owned);
    wait_for("status shows the target degraded", TIMEOUT, || {
        target_row(&world.status()).is_some_and(|row| row.starts_with("degraded "))
    })
    .unwrap();
    let status = world.status();
    assert!(status.contains(&format!("DEGRADED: daemon pid {pid} died")), "{status}");
    world.reader().wait_until(TIMEOUT, |o: &Observation| o.error().is_some()).expect("the reader sees the death");

    // The outage the heal reports runs from the death, not from the new mount.
    std::thread::sleep(Duration::from_millis(300));
    world.source.restart(&world.sandbox, Restart::UnmountThenMount).unwrap();
    world.reads_current();
    let healed = world.supervisor().wait_for_log(TIMEOUT, message_is("healed")).expect("healed");
    let outage_ms = field(&healed, "outage_ms").as_u64().expect("outage in the heal line");
    let latency_us = field(&healed, "latency_us").as_u64().expect("latency in the heal line");
    assert!(outage_ms >= 300, "outage {outage_ms} ms should start at the death: {healed}");
    // The outage is on the wall clock (it is reported), `killed` on the
    // monotonic one: a few milliseconds of slack for their drift.
    assert!(u128::from(outage_ms) <= killed.elapsed().as_millis() + 5, "{healed}");
    assert!(latency_us < outage_ms * 1000, "latency runs from the new mount: {healed}");
    assert!(!world.status().contains("DEGRADED"), "a replaced source is no longer degraded");
}

#[test]
fn sigkill_marks_degraded_before_the_restart_with_the_process_connector() {
    sigkill_marks_degraded_before_the_restart("connector");
}

#[test]
fn sigkill_marks_degraded_before_the_restart_with_pidfds() {
    sigkill_marks_degraded_before_the_restart("pidfd");
}

/// A restart script's `kill; umount` whose unmount the loop scans before it
/// handles the exit, made certain here: the global mount is unmounted first
/// (its daemon still serving the target, which holds the connection), the
/// scan that finds the source gone is waited for, and only then is the
/// daemon killed. The target still on the connection keeps its daemon
/// watched, so its exit is a death (before, the scan stopped watching it and
/// the exit named nobody), and the new mount heals the target. (The target
/// is Broken from the scan on, its source down: the death keeps that.)
fn a_death_after_its_source_was_unmounted_is_reported(backend: &str) {
    let mut world = World::new(Daemon::Bindfs);
    world.reads_current();
    world.supervise(&["--process-watch", backend]);
    let pid = world.source.pid().expect("daemon running");
    let global = world.source.path.clone();
    world.sandbox.run(move || mount::unmount(&global)).expect("the global mount unmounted");
    let sources = || world.supervisor().metric("fuse_supervisor_sources").expect("scrape /metrics");
    wait_for("a scan without the source", TIMEOUT, || sources() == Some(0.0)).unwrap();
    world.reads_current();

    world.source.crash().unwrap();
    world.wait_for_death_of(pid);
    world.source.restart(&world.sandbox, Restart::UnmountThenMount).unwrap();
    world.reads_current();
    world.supervisor().wait_for_log(TIMEOUT, message_is("healed")).expect("healed");
}

#[test]
fn a_death_after_its_source_was_unmounted_is_reported_with_pidfds() {
    a_death_after_its_source_was_unmounted_is_reported("pidfd");
}

#[test]
fn a_death_after_its_source_was_unmounted_is_reported_with_the_process_connector() {
    a_death_after_its_source_was_unmounted_is_reported("connector");
}

/// A duplicate of the daemon's `/dev/fuse` descriptor (the same open file):
/// while this process holds it, the connection outlives the daemon.
fn keep_connection(pid: u32) -> OwnedFd {
    let fd_dir = PathBuf::from(format!("/proc/{pid}/fd"));
    let number = std::fs::read_dir(&fd_dir)
        .expect("daemon fds")
        .filter_map(Result::ok)
        .find(|entry| std::fs::read_link(entry.path()).is_ok_and(|target| target == Path::new("/dev/fuse")))
        .and_then(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .expect("the daemon holds /dev/fuse");
    PidFd::open(pid).expect("pidfd").get_fd(number).expect("pidfd_getfd")
}

#[test]
fn a_connection_kept_open_without_its_daemon_is_aborted_for_a_hung_reader() {
    let mut world = World::new(Daemon::DemoFs);
    world.reads_current();
    let fusectl = world.sandbox.root().join("fusectl");
    let at = fusectl.clone();
    world
        .sandbox
        .run(move || std::fs::create_dir_all(&at).and_then(|()| mount::mount_fusectl(&at)))
        .expect("mount fusectl in the sandbox");
    let daemon = world.source.pid().expect("daemon running");
    let keeper = keep_connection(daemon);
    world.supervise(&["--abort-dead-connections", "--fuse-connections-dir", fusectl.to_str().unwrap()]);
    let watched = world.supervisor().wait_for_log(TIMEOUT, message_is("watching the FUSE daemon")).unwrap();
    let pids = field(&watched, "pids").as_str().unwrap_or_default().to_owned();
    assert!(pids.contains(&std::process::id().to_string()), "the keeper is a holder too: {watched}");

    world.source.crash().unwrap();
    world
        .supervisor()
        .wait_for_log(
            TIMEOUT,
            message_is("a process serving the source exited; other processes still hold its connection"),
        )
        .expect("the partial exit is seen");
    let aborted = world
        .supervisor()
        .wait_for_log(TIMEOUT, |line| line.contains("aborted so that readers get an error"))
        .expect("the connection is aborted");
    assert!(field(&aborted, "waiting").as_u64().is_some_and(|waiting| waiting >= 1), "{aborted}");
    assert_eq!(field(&aborted, "pid"), serde_json::json!(daemon), "{aborted}");
    // The reader was hung in a read; the abort ends it with an error.
    let failed = world.reader().wait_until(TIMEOUT, |o: &Observation| o.error().is_some()).expect("reader fails");
    assert!(matches!(failed.error(), Some("ECONNABORTED" | "ENOTCONN")), "{failed:?}");
    world.supervisor().wait_for_log(TIMEOUT, message_is("daemon died; its targets are degraded")).unwrap();
    drop(keeper);
}

/// A daemon seen holding its connection hands it to a successor and exits
/// (as one that daemonizes does): the death the exit suggests is retracted
/// at once, the reader never notices, and a later real crash still counts.
fn a_handed_off_connection_is_not_dead(backend: &str) {
    let sandbox = Sandbox::new().expect("sandbox");
    let source = FuseSource::start_handing_off(&sandbox, "shared-data").expect("start daemon");
    let mut world = World::without_reader(sandbox, source);
    let first = world.source.pid().expect("daemon running");
    world.supervise(&["--process-watch", backend]);
    let watched = world.supervisor().wait_for_log(TIMEOUT, message_is("watching the FUSE daemon")).unwrap();
    assert_eq!(field(&watched, "pids"), serde_json::json!(format!("[{first}]")), "{watched}");

    // The first process never answers: the reader's first request waits
    // through the hand-off, and the successor answers it.
    let (sandbox, target, source) = (&world.sandbox, &world.target, &mut world.source);
    let (reader, successor) = std::thread::scope(|scope| {
        let reader = scope.spawn(|| spawn_reader(sandbox, target));
        std::thread::sleep(Duration::from_millis(100));
        let successor = source.hand_off().expect("hand off");
        (reader.join().expect("reader thread"), successor)
    });
    world.reader = Some(reader);
    world.reads_current();
    let died = world.supervisor().wait_for_log(TIMEOUT, message_is("daemon died; its targets are degraded")).unwrap();
    assert_eq!(field(&died, "pid"), serde_json::json!(first), "{died}");
    let retracted = world
        .supervisor()
        .wait_for_log(TIMEOUT, message_is("connection still served by another process; death retracted"))
        .expect("the death is retracted");
    assert_eq!(field(&retracted, "pids"), serde_json::json!(format!("[{successor}]")), "{retracted}");
    assert_eq!(field(&retracted, "targets"), serde_json::json!(1), "{retracted}");
    world.wait_for_target_state("healthy");

    // The state file is written in the background.
    wait_for("status without the retracted death", TIMEOUT, || {
        world.status_json() == ("healthy".to_owned(), serde_json::Value::Null)
    })
    .unwrap();
    assert!(!world.status().contains("DEGRADED"), "{}", world.status());
    // The reader reports changes only: nothing new is nothing failed.
    let expected = world.source.expected_content();
    let history = world.reader().history();
    let first_read = history.iter().position(|o| o.content() == Some(expected.as_str())).expect("read once");
    std::thread::sleep(Duration::from_millis(300));
    let since = world.reader().history().split_off(first_read);
    assert!(since.iter().all(|o| o.content() == Some(expected.as_str())), "{since:?}");
    world.reads_current();

    // The successor is watched: its crash is a real death, then healed.
    world.source.crash().unwrap();
    let died = world
        .supervisor()
        .wait_for_log(TIMEOUT, |line| {
            message_is("daemon died; its targets are degraded")(line)
                && field(line, "pid") == serde_json::json!(successor)
        })
        .expect("the successor's death is seen");
    assert_eq!(field(&died, "targets"), serde_json::json!(1), "{died}");
    world.reader().wait_until(TIMEOUT, |o: &Observation| o.error().is_some()).expect("the reader sees the death");
    wait_for("status degraded", TIMEOUT, || world.status_json().0 == "degraded").unwrap();
    world.source.restart(&world.sandbox, Restart::UnmountThenMount).unwrap();
    world.reads_current();
    world.supervisor().wait_for_log(TIMEOUT, message_is("healed")).expect("healed");
    wait_for("status healthy after the heal", TIMEOUT, || world.status_json().1.is_null()).unwrap();
    let retractions = world
        .supervisor()
        .log()
        .iter()
        .filter(|line| message_is("connection still served by another process; death retracted")(line))
        .count();
    assert_eq!(retractions, 1, "a real death is not retracted");
}

#[test]
fn a_handed_off_connection_is_not_dead_with_the_process_connector() {
    a_handed_off_connection_is_not_dead("connector");
}

#[test]
fn a_handed_off_connection_is_not_dead_with_pidfds() {
    a_handed_off_connection_is_not_dead("pidfd");
}

/// The processes a JSON log line's `pids` field names.
fn pids_in(line: &str) -> Vec<u32> {
    let pids = field(line, "pids");
    let text = pids.as_str().unwrap_or_default().trim_matches(['[', ']']);
    text.split(", ").filter_map(|pid| pid.parse().ok()).collect()
}

/// A watchdog keeps its connection and restarts its crashed child on it, as
/// JuiceFS's mount process does a second later: the connection never dies,
/// its target stays healthy, and the new child, which started after the
/// supervisor looked again at the crash, ends up watched, so that its own
/// crash is seen at once. The reader runs only while no child is killed: a
/// request a killed child had read is lost with it, the connection living
/// on, and its reader hangs beyond any signal until the connection ends.
fn a_watchdogs_restarted_child_is_watched(backend: &str) {
    let sandbox = Sandbox::new().expect("sandbox");
    let source = FuseSource::start_watchdog(&sandbox, "shared-data").expect("start the watchdog");
    let mut world = World::without_reader(sandbox, source);
    let (watchdog, first) = (world.source.pid().expect("watchdog running"), world.source.serving_child().unwrap());
    world.supervise(&["--process-watch", backend]);
    let watched = world.supervisor().wait_for_log(TIMEOUT, message_is("watching the FUSE daemon")).unwrap();
    assert_eq!(pids_in(&watched), [watchdog, first], "both hold the connection: {watched}");

    let from = world.supervisor().log_len();
    assert_eq!(world.source.crash_serving_child().unwrap(), first);
    let partial_exit = "a process serving the source exited; other processes still hold its connection";
    let exited = |pid: u32| move |line: &str| message_is(partial_exit)(line) && field(line, "pid") == pid;
    world.supervisor().wait_for_lines(TIMEOUT, from, 1, exited(first)).expect("the child's exit is seen");
    // The watchdog restarts its child only once the supervisor's look at
    // the exit found nobody new (JuiceFS waits a second).
    let looked = |line: &str| {
        (message_is("watching the FUSE daemon")(line) && pids_in(line) == [watchdog])
            || message_is("no new process serves the connection yet")(line)
    };
    world.supervisor().wait_for_lines(TIMEOUT, from, 1, looked).expect("the exit is looked into");
    let second = world.source.restart_serving_child().unwrap();
    world.reader = Some(spawn_reader(&world.sandbox, &world.target));
    world.reads_current();
    let serves = |line: &str| message_is("watching the FUSE daemon")(line) && pids_in(line).contains(&second);
    world.supervisor().wait_for_lines(TIMEOUT, from, 1, serves).expect("the new child is watched");

    world.reader = None;
    let from = world.supervisor().log_len();
    world.source.crash_serving_child().unwrap();
    world.supervisor().wait_for_lines(TIMEOUT, from, 1, exited(second)).expect("the new child's exit is seen");
    let log = world.supervisor().log();
    assert!(!log.iter().any(|line| message_is("daemon died; its targets are degraded")(line)), "taken for dead");
    let target = world.target.display().to_string();
    assert!(!log.iter().any(|line| line.contains(&target) && line.contains("\"to\":\"degraded\"")), "degraded");
}

#[test]
fn a_watchdogs_restarted_child_is_watched_with_pidfds() {
    a_watchdogs_restarted_child_is_watched("pidfd");
}

#[test]
fn a_watchdogs_restarted_child_is_watched_with_the_process_connector() {
    a_watchdogs_restarted_child_is_watched("connector");
}

const DETACHED: &str = "dead source detached: its daemon can mount there again; its targets' stale layers are let go";

/// A second pod on the same source, with its target.
fn second_target(world: &World) -> PathBuf {
    world.source.bind_volume(&world.sandbox, "pod-0001", "data").expect("bind a second volume")
}

/// How many FUSE mounts are stacked at `path` in the sandbox.
fn layers_at(world: &World, path: &Path) -> usize {
    let path = path.display().to_string();
    world
        .sandbox
        .mountinfo()
        .lines()
        .filter(|line| line.split(' ').nth(4) == Some(path.as_str()) && line.contains(" - fuse"))
        .count()
}

/// The CSI driver's NodeUnpublishVolume for a pod deleted while the daemon
/// is dead: a plain umount(2) of its target (no MNT_DETACH), then the
/// kubelet removes the pod's directory. The umount succeeds at the first
/// try, the state forgets the target, and the other pod still heals.
#[test]
fn a_pod_deleted_during_an_outage_unmounts_at_the_first_try() {
    let mut world = World::new(Daemon::Bindfs);
    let deleted = second_target(&world);
    world.reads_current();
    world.supervise(&["--process-watch", "pidfd"]);
    world.source.crash().unwrap();
    world.supervisor().wait_for_log(TIMEOUT, message_is(DETACHED)).expect("the dead source is detached");

    let path = deleted.clone();
    let unmounted = world.sandbox.run(move || mount::unmount(&path));
    assert!(unmounted.is_ok(), "the first plain umount of the deleted pod's target: {unmounted:?}");
    let pod_dir = world.sandbox.kubelet_root().join("pods/pod-0001");
    let removed = world.sandbox.run(move || std::fs::remove_dir_all(&pod_dir));
    assert!(removed.is_ok(), "{removed:?}");

    world.source.restart(&world.sandbox, Restart::InPlace).unwrap();
    world.reads_current();
    world.supervisor().wait_for_log(TIMEOUT, message_is("healed")).expect("the other pod heals");
    let deleted_path = deleted.display().to_string();
    let state_file = world.state_dir.join("state.json");
    wait_for("the state file forgets the deleted pod's target", TIMEOUT, || {
        let file = state_file.clone();
        let state = world.sandbox.run(move || std::fs::read_to_string(file)).unwrap_or_default();
        !state.contains(&deleted_path) && state.contains(&world.target.display().to_string())
    })
    .unwrap();
    let complaints: Vec<String> = world
        .supervisor()
        .log()
        .into_iter()
        .filter(|line| line.contains(&deleted_path) && (line.contains("\"WARN\"") || line.contains("\"ERROR\"")))
        .collect();
    assert!(complaints.is_empty(), "nothing to retry about a deleted pod: {complaints:#?}");
}

/// A FUSE pod restarted while its dead mount is still at its mount point
/// cannot mount there (libfuse stats the mount point: ENOTCONN) when the
/// supervisor leaves the dead mount in place.
#[test]
fn a_dead_mount_left_in_place_blocks_the_daemons_restart() {
    let mut world = World::new(Daemon::Bindfs);
    world.reads_current();
    world.supervise(&["--process-watch", "pidfd", "--detach-dead-sources", "off"]);
    world.source.crash().unwrap();
    world.supervisor().wait_for_log(TIMEOUT, message_is("daemon died; its targets are degraded")).expect("death seen");
    let restarted = world.source.restart(&world.sandbox, Restart::InPlace);
    assert!(
        matches!(restarted, Err(ScenarioError::DaemonExited { .. })),
        "bindfs cannot start on its dead mount: {restarted:?}"
    );
    // What an operator does by hand today, which the supervisor does by default.
    let path = world.source.path.clone();
    world.sandbox.run(move || mount::detach(&path)).unwrap();
    world.source.restart(&world.sandbox, Restart::InPlace).unwrap();
    world.reads_current();
}

/// With the default `--detach-dead-sources on`, the daemon's own dead mount
/// goes once nobody holds its connection: the restarted FUSE pod mounts on
/// a directory (bindfs would refuse a dead mount there), the source path
/// keeps one layer, the targets heal, and an Event on the FUSE pod would
/// say so (here the metric counts it).
#[test]
fn a_dead_source_is_detached_so_the_daemon_restarts_in_place() {
    let mut world = World::new(Daemon::Bindfs);
    let second = second_target(&world);
    world.reads_current();
    world.supervise(&["--process-watch", "pidfd", "--metrics-addr", "127.0.0.1:0"]);
    for cycle in 0..3 {
        let mark = world.supervisor().log_len();
        world.source.crash().unwrap();
        world.supervisor().wait_for_lines(TIMEOUT, mark, 1, message_is(DETACHED)).expect("the dead source is detached");
        let log = world.supervisor().log();
        let detached = log[mark..].iter().find(|line| message_is(DETACHED)(line)).expect("the line");
        assert_eq!(field(detached, "targets"), serde_json::json!(2), "{detached}");
        wait_for("no mount left at the source", TIMEOUT, || layers_at(&world, &world.source.path) == 0).unwrap();
        let mark = world.supervisor().log_len();
        world.source.restart(&world.sandbox, Restart::InPlace).unwrap();
        world.reads_current();
        // Its death is seen once the new daemon is found.
        world.supervisor().wait_for_lines(TIMEOUT, mark, 1, message_is("watching the FUSE daemon")).expect("watched");
        for target in [&world.target, &second] {
            wait_for("one layer per target", TIMEOUT, || layers_at(&world, target) == 1)
                .unwrap_or_else(|err| panic!("cycle {cycle}, {}: {err}", target.display()));
        }
        assert_eq!(layers_at(&world, &world.source.path), 1, "cycle {cycle}: one mount at the source");
    }
    let detached = world.supervisor().metric("fuse_supervisor_dead_sources_detached_total").expect("scrape");
    assert_eq!(detached, Some(3.0));
}

/// A daemon that mounts over whatever is at its mount point (raw mount(2))
/// and restarts within milliseconds of its death can beat the detach: its
/// new mount is then never detached, and the targets heal either way. One
/// that mounts in the instant between the dead mount's check and its lazy
/// detach has its new mount detached with it (a limit in docs/limits.md): it exits,
/// and is started again, as its pod's restart would.
#[test]
fn a_restart_that_beats_the_detach_keeps_its_new_mount() {
    let mut world = World::new(Daemon::DemoFs);
    world.reads_current();
    world.supervise(&["--process-watch", "pidfd"]);
    for cycle in 0..5 {
        let mark = world.supervisor().log_len();
        world.source.crash().unwrap();
        let died = message_is("daemon died; its targets are degraded");
        world.supervisor().wait_for_lines(TIMEOUT, mark, 1, died).expect("death");
        let mark = world.supervisor().log_len();
        match world.source.restart(&world.sandbox, Restart::MountOverStale) {
            Ok(()) => {}
            Err(ScenarioError::DaemonExited { .. }) => {
                world.source.restart(&world.sandbox, Restart::MountOverStale).unwrap_or_else(|err| {
                    panic!("cycle {cycle}, started again after its mount went with the detach: {err}")
                })
            }
            Err(err) => panic!("cycle {cycle}: {err}"),
        }
        world.reads_current();
        wait_for("one layer at the target", TIMEOUT, || layers_at(&world, &world.target) == 1).unwrap();
        // Its death is seen once the new daemon is found.
        world.supervisor().wait_for_lines(TIMEOUT, mark, 1, message_is("watching the FUSE daemon")).expect("watched");
    }
}

/// The kernel's behaviour a connection's identity stands on: once a FUSE
/// connection's superblock is gone, its number goes to the next connection
/// made (a pod's own daemon, anywhere on the node), and that connection's
/// `fusectl` directory is another one (a new inode). So the supervisor keys
/// a connection by both: a discovery of the number that ran after the reuse
/// would otherwise take the new connection's holders for the old one's.
#[test]
fn a_freed_connection_number_goes_to_the_next_connection_with_another_fusectl_directory() {
    let sandbox = Sandbox::new().expect("sandbox");
    let root = sandbox.root().to_path_buf();
    let outcome = sandbox.run(move || -> std::io::Result<Option<(String, u64, u64)>> {
        let (fusectl, first, second) = (root.join("fusectl"), root.join("first"), root.join("second"));
        for dir in [&fusectl, &first, &second] {
            std::fs::create_dir_all(dir)?;
        }
        mount::mount_fusectl(&fusectl)?;
        // A connection with no daemon: the mount alone makes it, and no
        // call here asks its filesystem anything. This thread is in the
        // sandbox's namespace, not the process: thread-self's table.
        let connect = |at: &Path| -> std::io::Result<(OwnedFd, Dev)> {
            let device = fuse::open_device()?;
            fuse::mount(device.as_fd(), at, "identity", "identity")?;
            let table = std::fs::read_to_string("/proc/thread-self/mountinfo")?;
            let dev = Snapshot::parse(table.as_bytes())
                .ok()
                .and_then(|snapshot| snapshot.fuse_mounts.into_iter().find(|mount| mount.mount_point == at))
                .map(|mount| mount.dev)
                .ok_or_else(|| {
                    std::io::Error::other(format!("the FUSE mount at {} is not in the table", at.display()))
                })?;
            Ok((device, dev))
        };
        // Other tests of this binary make mounts meanwhile and may take the
        // number first: a few tries.
        for _ in 0..20 {
            let (device, old) = connect(&first)?;
            let old_inode =
                FuseConnections::at(&fusectl).inode_of(old).ok_or_else(|| std::io::Error::other("no fusectl entry"))?;
            mount::unmount(&first)?;
            drop(device);
            let (device, new) = connect(&second)?;
            let new_inode = FuseConnections::at(&fusectl).inode_of(new);
            mount::unmount(&second)?;
            drop(device);
            if new == old {
                let new_inode = new_inode.ok_or_else(|| std::io::Error::other("no fusectl entry"))?;
                return Ok(Some((new.to_string(), old_inode, new_inode)));
            }
        }
        Ok(None)
    });
    let (number, old_inode, new_inode) =
        outcome.expect("FUSE mounts in the sandbox").expect("the freed number came back in 20 tries");
    assert_ne!(old_inode, new_inode, "connection {number}: the same fusectl directory for two connections");
}

/// A demofs source and its target, no reader yet, supervised once the
/// supervisor's start walk is done.
fn walked_world() -> World {
    let sandbox = Sandbox::new().expect("sandbox");
    let source = FuseSource::start(&sandbox, Daemon::DemoFs, "shared-data").expect("start daemon");
    let mut world = World::without_reader(sandbox, source);
    world.supervise(&[]);
    let walked = |line: &str| line.contains("\"mount namespaces walked\"");
    world.supervisor().wait_for_log(TIMEOUT, walked).expect("the start walk");
    world
}

/// The test world's container model on the target, with a private copy
/// of it (`None` propagation, which no host heal reaches).
fn private_container(world: &World) -> ContainerReader {
    let rootfs = world.sandbox.container_rootfs("pod-0000").expect("rootfs");
    let options = ContainerOptions {
        volume: world.target.clone(),
        rootfs,
        hide: vec![world.sandbox.kubelet_root(), world.sandbox.runtime_root()],
        read: PathBuf::from(DATA_FILE),
        interval: Duration::from_millis(20),
        propagation: Propagation::Private,
        wake_on_mount_change: true,
    };
    ContainerReader::spawn_with(&world.sandbox, "pod-0000", &options).expect("reader")
}

/// A container made after the supervisor's start walk whose namespace no
/// exec was ever made in (the container model unshares after its own exec,
/// as any process calling unshare(2) itself does) is not known by events:
/// the walk at the daemon's death finds it during the outage, and its
/// private copy of the dead volume (`None` propagation, which no host heal
/// reaches) reads again after the heal.
#[test]
fn a_namespace_no_exec_made_known_is_found_at_the_death_and_healed() {
    let mut world = walked_world();
    world.reader = Some(private_container(&world));
    world.reads_current();

    world.source.crash().unwrap();
    // Unloaded, the walk is what learns the container's namespace (without
    // it the reader stays ENOTCONN). On a loaded machine the keeper may
    // handle the model's own exec only after its unshare, and learn the
    // namespace from it: the walk then finds nothing new, and the heal
    // reaches the container all the same.
    world
        .supervisor()
        .wait_for_log(TIMEOUT, message_is("mount namespaces walked for those no exec made known"))
        .expect("the walk at the death");
    world.source.restart(&world.sandbox, Restart::UnmountThenMount).unwrap();
    world.reads_current();
}

/// A container made during the outage after the walk at the death, whose
/// namespace no exec made known (the container model unshares after its
/// own exec), holds a private copy of the dead volume that no search
/// before or just after the host heal can know of. The walk that follows
/// the heal learns it, finds a copy of the connection the heal replaced,
/// and the container reads again.
#[test]
fn a_namespace_made_after_the_walk_at_the_death_is_found_after_the_heal() {
    let mut world = walked_world();

    world.source.crash().unwrap();
    let searched = message_is("mount namespaces walked for those no exec made known");
    world.supervisor().wait_for_log(TIMEOUT, &searched).expect("the walk at the death");
    world.reader = Some(private_container(&world));
    world.reader().wait_until(TIMEOUT, |o| o.error().is_some()).expect("the container's copy is dead");

    world.source.restart(&world.sandbox, Restart::UnmountThenMount).unwrap();
    world.reads_current();
    // On a loaded machine the keeper may handle the model's exec after its
    // unshare and learn the namespace before the heal, which then heals it
    // as any other; otherwise only the walk after the heal finds it.
    let namespace = std::fs::metadata(format!("/proc/{}/ns/mnt", world.reader().child().pid()))
        .map(|metadata| std::os::unix::fs::MetadataExt::ino(&metadata))
        .expect("the container's namespace");
    // Waited for, not read once: the keeper's line comes from a thread of
    // its own, and may reach the log after the heal's.
    let late_line = "\"a namespace learnt after a heal holds mounts of the connection it replaced\"";
    let known = |line: &str| {
        line.contains(late_line)
            || (line.contains("\"mount namespace learnt\"") && field(line, "namespace") == serde_json::json!(namespace))
    };
    let supervisor = world.supervisor();
    let line = supervisor.wait_for_log(TIMEOUT, known).unwrap_or_else(|err| {
        panic!("the container healed without its namespace being learnt: {err:?}\n{}", supervisor.log().join("\n"))
    });
    if line.contains(late_line) {
        assert_eq!(field(&line, "namespace"), serde_json::json!(namespace), "{line}");
    }
}
