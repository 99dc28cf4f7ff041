//! End-to-end heals: a real FUSE daemon crashes and comes back in a private
//! mount namespace while `fuse-supervisor run` watches; every heal is judged
//! from inside a container-model reader. Needs root and /dev/fuse.
use std::path::{Path, PathBuf};
use std::time::Duration;

use fuse_supervisor_testbed::scenario::{
    self, DATA_FILE, Daemon, FuseSource, Restart, SUBDIR, SUBDIR_FILE, SupervisorProcess, layers_at,
};
use fuse_supervisor_testbed::{ContainerReader, Observation, Sandbox};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const HEAL_TIMEOUT: Duration = Duration::from_secs(20);
/// `run` arguments of a supervisor that scans on a timer instead of
/// waking on mount-table notifications.
const POLL_MODE: [&str; 6] = ["--kubelet", "none", "--mode", "poll", "--poll-period", "200ms"];

fn binary() -> &'static Path {
    Path::new(BINARY)
}

fn reads(expected: String) -> impl Fn(&Observation) -> bool {
    move |observation| observation.content() == Some(expected.as_str())
}

fn fails(observation: &Observation) -> bool {
    observation.error().is_some()
}

struct Node {
    // Declared first: readers and the supervisor die before the sandbox.
    readers: Vec<ContainerReader>,
    supervisor: Option<SupervisorProcess>,
    source: FuseSource,
    targets: Vec<PathBuf>,
    state_dir: PathBuf,
    sandbox: Sandbox,
}

impl Node {
    /// A source served by `daemon` bound into `pods` pod volumes, each with
    /// a reader of the data file.
    fn new(daemon: Daemon, pods: usize) -> Node {
        let sandbox = Sandbox::new().expect("sandbox");
        let source = FuseSource::start(&sandbox, daemon, "shared-data").expect("start daemon");
        let mut node = Node {
            readers: Vec::new(),
            supervisor: None,
            targets: Vec::new(),
            state_dir: sandbox.root().join("state"),
            source,
            sandbox,
        };
        for pod in 0..pods {
            let uid = format!("pod-{pod:04}");
            let target = node.source.bind_volume(&node.sandbox, &uid, "data").expect("bind volume");
            node.add_reader(&uid, &target, Path::new(DATA_FILE));
            node.targets.push(target);
        }
        node
    }

    fn add_reader(&mut self, name: &str, volume: &Path, read: &Path) {
        let reader = ContainerReader::spawn(&self.sandbox, name, volume, read).expect("reader");
        self.readers.push(reader);
    }

    fn start_supervisor(&mut self) {
        self.start_supervisor_with(&["--kubelet", "none"]);
    }

    fn start_supervisor_with(&mut self, args: &[&str]) {
        let supervisor = SupervisorProcess::start_with(&self.sandbox, binary(), &self.state_dir, args);
        self.supervisor = Some(supervisor.expect("supervisor"));
    }

    fn supervisor(&self) -> &SupervisorProcess {
        self.supervisor.as_ref().expect("supervisor running")
    }

    fn all_read(&self, expected: &str) {
        for reader in &self.readers[..self.targets.len()] {
            reader.wait_until(HEAL_TIMEOUT, reads(expected.to_owned())).expect("reader reads the source");
        }
    }

    fn mounts(&self) -> usize {
        self.sandbox.count_mounts_under(self.sandbox.root())
    }

    /// Readers recover at the stack; the flatten follows: wait for it.
    fn settles_to(&self, baseline: usize, targets: &[&PathBuf]) {
        for target in targets {
            scenario::wait_for("one layer", HEAL_TIMEOUT, || layers_at(&self.sandbox, target) == 1)
                .unwrap_or_else(|err| panic!("{}: {err}", target.display()));
        }
        scenario::wait_for("the baseline mount count", HEAL_TIMEOUT, || self.mounts() == baseline)
            .unwrap_or_else(|err| panic!("{err}: {} now, {baseline} before", self.mounts()));
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("mount table:\n{}", self.sandbox.mountinfo());
        }
    }
}

/// One pod: crash, restart, and the reader in the pod reads again.
fn one_pod_heals(daemon: Daemon, args: &[&str]) -> Node {
    let mut node = Node::new(daemon, 1);
    node.all_read(&node.source.expected_content());
    node.start_supervisor_with(args);
    let baseline = node.mounts();

    node.source.crash().unwrap();
    node.readers[0].wait_until(HEAL_TIMEOUT, fails).expect("reader sees the crash");
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();

    node.all_read(&node.source.expected_content());
    node.supervisor().wait_for_log(HEAL_TIMEOUT, |line| line.contains("\"healed\"")).unwrap();
    node.settles_to(baseline, &node.targets.iter().collect::<Vec<_>>());
    node
}

#[test]
fn one_demofs_pod_is_healed_after_unmount_then_mount() {
    one_pod_heals(Daemon::DemoFs, &["--kubelet", "none"]);
}

#[test]
fn one_bindfs_pod_is_healed_after_unmount_then_mount() {
    one_pod_heals(Daemon::Bindfs, &["--kubelet", "none"]);
}

/// [`one_pod_heals`] woken by the given `--table-events` backend, which
/// the supervisor must say it uses.
fn one_pod_heals_with_table_events(backend: &str) {
    let node = one_pod_heals(Daemon::Bindfs, &["--kubelet", "none", "--table-events", backend]);
    let uses = format!("\"table_events\":\"{backend}\"");
    let log = node.supervisor().log();
    let supervising = log.iter().find(|line| line.contains("\"supervising\"")).expect("logged before the heal");
    assert!(supervising.contains(&uses), "the supervisor does not say it uses {backend}: {supervising}");
}

#[test]
fn one_bindfs_pod_is_healed_woken_by_fanotify_mount_events() {
    one_pod_heals_with_table_events("fanotify");
}

#[test]
fn one_bindfs_pod_is_healed_woken_by_mountinfo_events() {
    one_pod_heals_with_table_events("mountinfo");
}

/// With fanotify naming the new global mount, its probe starts before the
/// loop reads the table (the daemon's first answer is on its way while the
/// table is read and planned), and the heal is the same.
#[test]
fn a_new_source_announced_by_fanotify_is_probed_before_the_table_is_read() {
    let mut node = Node::new(Daemon::DemoFs, 2);
    node.all_read(&node.source.expected_content());
    node.start_supervisor_with(&["--kubelet", "none", "--table-events", "fanotify", "--log", "debug"]);
    let baseline = node.mounts();

    // Unmount, then mount once the loop has scanned the unmount and is
    // waiting again, so that the mount arrives as an event of its own.
    node.source.crash().unwrap();
    let from = node.supervisor().log_len();
    let path = node.source.path.clone();
    node.sandbox.run(move || fuse_supervisor_sys::mount::detach(&path)).expect("unmount the global mount");
    let scanned = |line: &str| line.contains("\"scanned\"");
    node.supervisor().wait_for_lines(HEAL_TIMEOUT, from, 1, scanned).expect("the unmount is scanned");
    let restart_at = node.supervisor().log_len();
    node.source.restart(&node.sandbox, Restart::MountOverStale).unwrap();

    node.all_read(&node.source.expected_content());
    node.supervisor().wait_for_log(HEAL_TIMEOUT, |line| line.contains("\"healed\"")).unwrap();
    node.settles_to(baseline, &node.targets.iter().collect::<Vec<_>>());
    let log = node.supervisor().log();
    // From the event of the new mount: the loop may read the table before
    // it for what the crash left (a search for a daemon killed before it
    // was watched looks at its source again).
    let attached = |line: &&String| line.contains("\"message\":\"mount events\"") && !line.contains("\"attached\":0,");
    let event = log[restart_at..].iter().position(|line| attached(&line)).expect("the new mount's event");
    let after = &log[restart_at + event..];
    let first = |message: &str| after.iter().position(|line| line.contains(&format!("\"message\":\"{message}\"")));
    let (probing, read) = (first("probing source"), first("table read"));
    assert!(
        probing.is_some() && (read.is_none() || probing < read),
        "the probe did not start before the table read (lines {probing:?} and {read:?}):\n{}",
        after.join("\n")
    );
}

/// `(name, policy, real-time priority)` of every thread of process `pid`.
fn thread_policies(pid: u32) -> Vec<(String, u32, u32)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the supervisor's threads");
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("stat")).ok())
        .filter_map(|stat| {
            let (head, rest) = stat.rsplit_once(") ")?;
            let name = head.split_once(" (")?.1.to_owned();
            // Fields 40 and 41 of stat(5); `rest` starts at field 3.
            let fields: Vec<&str> = rest.split_whitespace().collect();
            Some((name, fields.get(38)?.parse().ok()?, fields.get(37)?.parse().ok()?))
        })
        .collect()
}

fn policies_of(pid: u32, name: &str) -> Vec<(u32, u32)> {
    thread_policies(pid).into_iter().filter(|(thread, ..)| thread == name).map(|(_, p, r)| (p, r)).collect()
}

const SCHED_OTHER: (u32, u32) = (0, 0);
const SCHED_FIFO_1: (u32, u32) = (1, 1);

/// The flatten helpers and the watcher run SCHED_FIFO for good; the loop
/// only while a heal is due or expected (from a seen death to the heal), so
/// it is back to normal once the heal is done; `--realtime-priority 0`
/// leaves every thread normal.
#[test]
fn heal_threads_run_realtime_and_the_loop_only_while_a_heal_is_due_or_expected() {
    let mut node = one_pod_heals(Daemon::DemoFs, &["--kubelet", "none"]);
    let pid = node.supervisor().pid();
    let flatten = policies_of(pid, "flatten");
    assert!(!flatten.is_empty() && flatten.iter().all(|policy| *policy == SCHED_FIFO_1), "flatten: {flatten:?}");
    assert_eq!(policies_of(pid, "watcher"), [SCHED_FIFO_1]);
    let loop_at = |policy: (u32, u32)| {
        scenario::wait_for(&format!("the loop at {policy:?}"), HEAL_TIMEOUT, || {
            policies_of(pid, "supervisor") == [policy]
        })
        .unwrap();
    };
    loop_at(SCHED_OTHER);
    for other in ["metrics", "pod-watcher", "state-writer", "discovery"] {
        assert!(policies_of(pid, other).iter().all(|policy| *policy == SCHED_OTHER), "{other} runs real-time");
    }

    // A seen death raises the loop before the new mount appears: once the
    // new daemon is watched, its crash is seen.
    let daemon = format!("[{}]", node.source.pid().expect("daemon running"));
    let watched = |line: &str| line.contains("\"watching the FUSE daemon\"") && line.contains(&daemon);
    node.supervisor().wait_for_log(HEAL_TIMEOUT, watched).unwrap();
    let from = node.supervisor().log_len();
    node.source.crash().unwrap();
    let died = |line: &str| line.contains("\"daemon died; its targets are degraded\"");
    node.supervisor().wait_for_lines(HEAL_TIMEOUT, from, 1, died).unwrap();
    loop_at(SCHED_FIFO_1);
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();
    node.all_read(&node.source.expected_content());
    node.supervisor().wait_for_lines(HEAL_TIMEOUT, from, 1, |line| line.contains("\"healed\"")).unwrap();
    loop_at(SCHED_OTHER);

    drop(node.supervisor.take());
    node.start_supervisor_with(&["--kubelet", "none", "--realtime-priority", "0"]);
    node.supervisor().wait_for_log(HEAL_TIMEOUT, |line| line.contains("\"supervising\"")).unwrap();
    // A thread names itself once it runs: on a busy machine the pool's may
    // not have yet when the loop says it is supervising.
    let pid = node.supervisor().pid();
    scenario::wait_for("the flatten threads named", HEAL_TIMEOUT, || !policies_of(pid, "flatten").is_empty()).unwrap();
    let threads = thread_policies(pid);
    assert!(threads.iter().all(|(_, policy, priority)| (*policy, *priority) == SCHED_OTHER), "{threads:?}");
}

#[test]
fn one_bindfs_pod_is_healed_in_poll_mode() {
    one_pod_heals(Daemon::Bindfs, &POLL_MODE);
}

#[test]
fn fifty_pods_sharing_one_source_are_all_healed() {
    let mut node = Node::new(Daemon::Bindfs, 50);
    node.all_read(&node.source.expected_content());
    node.start_supervisor();
    let baseline = node.mounts();

    node.source.crash().unwrap();
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();

    node.all_read(&node.source.expected_content());
    node.settles_to(baseline, &node.targets.iter().collect::<Vec<_>>());
}

/// A pod volume and a subPath of the same source, each with a reader.
fn node_with_subpath(daemon: Daemon) -> (Node, PathBuf) {
    let mut node = Node::new(daemon, 1);
    let subpath = node.source.bind_subpath(&node.sandbox, "pod-sub", "data").unwrap();
    node.add_reader("pod-sub", &subpath, Path::new(SUBDIR_FILE));
    (node, subpath)
}

fn subpath_reads_only_its_directory(reader: &ContainerReader) {
    let seen = reader
        .wait_until(HEAL_TIMEOUT, |o| o.content().is_some_and(|c| c.starts_with("inside")))
        .expect("subPath reader reads again");
    assert_eq!(seen.entries(), Some(&[SUBDIR_FILE.to_owned()][..]), "subPath container sees more than its directory");
}

#[test]
fn subpath_container_sees_only_its_subdirectory_after_the_heal() {
    subpath_heals(&["--kubelet", "none"]);
}

#[test]
fn subpath_container_is_healed_in_poll_mode() {
    let node = subpath_heals(&POLL_MODE);
    let started = node.supervisor().wait_for_log(HEAL_TIMEOUT, |line| line.contains("\"supervising\"")).unwrap();
    assert!(started.contains("poll every 200ms"), "not in poll mode: {started}");
}

/// A pod volume and a subPath of it: both heal, the subPath container
/// sees only its directory, and the mounts settle to the baseline.
fn subpath_heals(args: &[&str]) -> Node {
    let (mut node, subpath) = node_with_subpath(Daemon::Bindfs);
    subpath_reads_only_its_directory(&node.readers[1]);
    node.start_supervisor_with(args);
    let baseline = node.mounts();

    node.source.crash().unwrap();
    node.readers[1].wait_until(HEAL_TIMEOUT, fails).expect("subPath reader sees the crash");
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();

    node.all_read(&node.source.expected_content());
    node.readers[1].wait_until(HEAL_TIMEOUT, |o| o.content().is_some()).unwrap();
    subpath_reads_only_its_directory(&node.readers[1]);
    node.settles_to(baseline, &[&node.targets[0], &subpath]);
    node
}

#[test]
fn twenty_crash_cycles_end_with_one_layer_per_target_and_the_baseline_count() {
    let (mut node, subpath) = node_with_subpath(Daemon::Bindfs);
    for pod in 1..3 {
        let uid = format!("pod-{pod:04}");
        let target = node.source.bind_volume(&node.sandbox, &uid, "data").unwrap();
        node.targets.push(target);
    }
    node.start_supervisor();
    let baseline = node.mounts();

    for cycle in 0..20 {
        node.source.crash().unwrap();
        node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();
        node.readers[0]
            .wait_until(HEAL_TIMEOUT, reads(node.source.expected_content()))
            .unwrap_or_else(|err| panic!("cycle {cycle}: {err}"));
        subpath_reads_only_its_directory(&node.readers[1]);
        // Every heal is finished (flattened) before the next crash.
        let mut all = node.targets.iter().collect::<Vec<_>>();
        all.push(&subpath);
        node.settles_to(baseline, &all);
    }
}

#[test]
fn a_crash_while_the_supervisor_is_down_is_healed_at_its_next_start() {
    let mut node = Node::new(Daemon::Bindfs, 2);
    node.start_supervisor();
    // It learns the mapping from the healthy peer groups and keeps it.
    node.supervisor.take().unwrap().stop().unwrap();
    let baseline = node.mounts();

    node.source.crash().unwrap();
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();
    node.readers[0].wait_until(HEAL_TIMEOUT, fails).expect("no heal while the supervisor is down");

    node.start_supervisor();
    node.all_read(&node.source.expected_content());
    node.settles_to(baseline, &node.targets.iter().collect::<Vec<_>>());
}

#[test]
fn a_stopped_daemon_does_not_hold_up_the_heal_of_another_source() {
    let mut node = Node::new(Daemon::Bindfs, 1);
    let mut other = FuseSource::start(&node.sandbox, Daemon::Bindfs, "other-data").unwrap();
    let other_target = other.bind_volume(&node.sandbox, "pod-other", "other").unwrap();
    node.add_reader("pod-other", &other_target, Path::new(DATA_FILE));
    node.start_supervisor();
    node.supervisor.take().unwrap().stop().unwrap();

    // Both sources crash and come back while the supervisor is down; the
    // first one's new daemon is stopped before anyone could probe it.
    node.source.crash().unwrap();
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();
    node.source.stop().unwrap();
    other.crash().unwrap();
    other.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();

    node.start_supervisor();
    node.readers[1].wait_until(HEAL_TIMEOUT, reads(other.expected_content())).expect("the other source heals");
    assert!(node.readers[0].latest().is_some_and(|o| fails(&o)), "stopped source healed without answering");

    // The stopped source's probe started at the scan that planned the
    // other's heal, so it waits at least this long for the daemon.
    let stopped_for = Duration::from_millis(300);
    std::thread::sleep(stopped_for);
    node.source.resume().unwrap();
    node.readers[0].wait_until(HEAL_TIMEOUT, reads(node.source.expected_content())).expect("heals once resumed");
    let target = node.targets[0].display().to_string();
    let healed = node
        .supervisor()
        .wait_for_log(HEAL_TIMEOUT, |line| line.contains("\"healed\"") && line.contains(&target))
        .expect("the heal is logged");
    let micros = |name: &str| {
        let line: serde_json::Value = serde_json::from_str(&healed).expect("a JSON log line");
        Duration::from_micros(line["fields"][name].as_u64().unwrap_or_else(|| panic!("{name} in {healed}")))
    };
    let (latency, source_wait) = (micros("latency_us"), micros("source_wait_us"));
    assert!(source_wait >= stopped_for, "the stopped daemon's time is the source's wait: {healed}");
    assert!(source_wait <= latency, "the wait is part of the latency: {healed}");
    drop(other);
}

#[test]
fn mount_over_stale_is_healed_by_propagation_and_leaves_one_layer_per_target() {
    mount_over_stale_heals(&["--kubelet", "none"]);
}

#[test]
fn mount_over_stale_is_healed_in_poll_mode() {
    mount_over_stale_heals(&POLL_MODE);
}

fn mount_over_stale_heals(args: &[&str]) {
    let (mut node, subpath) = node_with_subpath(Daemon::DemoFs);
    let second = node.source.bind_volume(&node.sandbox, "pod-0001", "data").unwrap();
    node.targets.push(second);
    // The dead mount is left at the source, so that the restart mounts
    // over it (detached, it would mount on a directory: see
    // `a_dead_source_is_detached_and_the_restart_mounts_on_a_directory`).
    let args: Vec<&str> = args.iter().copied().chain(["--detach-dead-sources", "off"]).collect();
    node.start_supervisor_with(&args);
    node.supervisor().wait_for_log(HEAL_TIMEOUT, |line| line.contains("watching the FUSE daemon")).unwrap();
    let kubelet_root = node.sandbox.kubelet_root();
    let baseline = node.sandbox.count_mounts_under(&kubelet_root);
    let mut all = node.targets.iter().collect::<Vec<_>>();
    all.push(&subpath);
    let settled = |node: &Node| {
        for target in &all {
            scenario::wait_for("one layer", HEAL_TIMEOUT, || layers_at(&node.sandbox, target) == 1)
                .unwrap_or_else(|err| panic!("{}: {err}", target.display()));
        }
        scenario::wait_for("the baseline mount count", HEAL_TIMEOUT, || {
            node.sandbox.count_mounts_under(&kubelet_root) == baseline
        })
        .unwrap();
    };

    // The process watcher sees the death and holds every target's stale
    // layer before the new mount covers it (waiting for the log line only
    // makes sure of that order; a real restart takes far longer).
    let count = |node: &Node, what: &str| node.supervisor().log().iter().filter(|line| line.contains(what)).count();
    let deaths = |node: &Node| count(node, "daemon died");
    node.source.crash().unwrap();
    scenario::wait_for("the death seen", HEAL_TIMEOUT, || deaths(&node) == 1).unwrap();
    node.source.restart(&node.sandbox, Restart::MountOverStale).unwrap();
    node.readers[0].wait_until(HEAL_TIMEOUT, reads(node.source.expected_content())).unwrap();
    subpath_reads_only_its_directory(&node.readers[1]);
    node.supervisor().wait_for_log(HEAL_TIMEOUT, |line| line.contains("healed by propagation")).unwrap();
    node.supervisor().wait_for_log(HEAL_TIMEOUT, |line| line.contains("covered stale layer removed")).unwrap();
    // One layer per target (the covered stale layer was removed through
    // the handle held since the death), and the kubelet tree's mount count
    // is back to its baseline. The source path keeps the daemon's own dead
    // mount under its new one: that stack is the daemon's, not ours.
    settled(&node);

    // The daemon's dead first mount stays under the source path, so the
    // next restart is again a mount over a stale mount, whatever the daemon
    // does. The new daemon is watched once found (a restart within
    // milliseconds of a mount could beat the search). A short-lived holder
    // of the new connection (fusermount passing the descriptor) makes a
    // second search, and a second line, when it exits.
    scenario::wait_for("the new daemon watched", HEAL_TIMEOUT, || count(&node, "watching the FUSE daemon") >= 2)
        .unwrap();
    node.source.crash().unwrap();
    scenario::wait_for("the second death seen", HEAL_TIMEOUT, || deaths(&node) == 2).unwrap();
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();
    node.readers[0].wait_until(HEAL_TIMEOUT, reads(node.source.expected_content())).unwrap();
    node.readers[1].wait_until(HEAL_TIMEOUT, |o| o.content().is_some()).unwrap();
    subpath_reads_only_its_directory(&node.readers[1]);
    settled(&node);
}

/// Without a process watcher no handle is taken on the stale layers before
/// the new mount covers them: the kernel's propagation heals the targets,
/// the covered layers stay (nothing reaches them), and the heals are still
/// reported, as propagated with nothing removed.
#[test]
fn mount_over_stale_without_a_seen_death_is_reported_as_propagated() {
    let mut node = Node::new(Daemon::DemoFs, 1);
    node.all_read(&node.source.expected_content());
    node.start_supervisor_with(&["--kubelet", "none", "--process-watch", "off"]);
    let heals = |node: &Node| {
        node.supervisor().metric(r#"fuse_supervisor_heals_total{result="propagated"}"#).unwrap().unwrap_or(0.0)
    };
    assert_eq!(heals(&node), 0.0);
    node.source.crash().unwrap();
    node.readers[0].wait_until(HEAL_TIMEOUT, fails).unwrap();
    node.source.restart(&node.sandbox, Restart::MountOverStale).unwrap();
    node.all_read(&node.source.expected_content());
    scenario::wait_for("the heal reported", HEAL_TIMEOUT, || heals(&node) == 1.0).unwrap();
    assert_eq!(layers_at(&node.sandbox, &node.targets[0]), 2, "the covered stale layer is out of reach");
    assert!(node.supervisor().log().iter().all(|line| !line.contains("covered stale layer removed")));
}

/// Runs `fuse-supervisor <args>` in the sandbox and returns its stdout.
fn run_cli(node: &Node, args: &[&str]) -> (bool, String) {
    let mut command = std::process::Command::new(binary());
    command
        .args(args)
        .arg("--kubelet-root")
        .arg(node.sandbox.kubelet_root())
        .arg("--state-dir")
        .arg(&node.state_dir)
        .args(["--mount-namespace", "/proc/self/ns/mnt", "--staging-dir"])
        .arg(node.sandbox.root().join("staging"))
        .stdout(std::process::Stdio::piped());
    let mut child = node.sandbox.spawn(command).unwrap();
    let mut stdout = String::new();
    std::io::Read::read_to_string(&mut child.take_stdout().unwrap(), &mut stdout).unwrap();
    (child.wait().unwrap().success(), stdout)
}

#[test]
fn heal_once_prints_the_plan_and_dry_run_changes_nothing() {
    let (mut node, subpath) = node_with_subpath(Daemon::Bindfs);
    let (ok, status) = run_cli(&node, &["status", "--json"]);
    assert!(ok);
    assert!(status.contains("\"healthy\""), "{status}");
    // `heal --once` on the healthy node learns and records the mapping.
    let (ok, plan) = run_cli(&node, &["heal", "--once"]);
    assert!(ok && plan.starts_with("0 broken target(s)"), "{plan}");
    let baseline = node.mounts();

    node.source.crash().unwrap();
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();
    let (ok, status) = run_cli(&node, &["status"]);
    assert!(ok && status.matches("broken ").count() == 2, "{status}");

    let (ok, plan) = run_cli(&node, &["heal", "--once", "--dry-run"]);
    assert!(ok, "{plan}");
    assert!(plan.starts_with("2 broken target(s) in 1 source(s)"), "{plan}");
    assert!(plan.contains(&format!("{} (pod pod-sub)", subpath.display())), "{plan}");
    assert!(node.readers[0].latest().is_some_and(|o| fails(&o)), "a dry run healed");

    let (ok, report) = run_cli(&node, &["heal", "--once"]);
    assert!(ok, "{report}");
    assert_eq!(report.matches("healed ").count(), 2, "{report}");
    node.all_read(&node.source.expected_content());
    subpath_reads_only_its_directory(&node.readers[1]);
    node.settles_to(baseline, &[&node.targets[0], &subpath]);
}

#[test]
fn a_dead_target_on_a_connection_the_state_file_does_not_know_is_healed() {
    let mut node = Node::new(Daemon::Bindfs, 1);
    node.start_supervisor();
    node.supervisor.take().unwrap().stop().unwrap();
    // An old state file: it names a connection the target is not on.
    let state = node.sandbox.outside_path(&node.state_dir.join("state.json"));
    let text = std::fs::read_to_string(&state).unwrap();
    let mut value: serde_json::Value = serde_json::from_str(&text).unwrap();
    for mapping in value["targets"].as_object_mut().unwrap().values_mut() {
        mapping["dev"] = serde_json::json!({ "major": 0, "minor": 99999 });
    }
    std::fs::write(&state, serde_json::to_vec(&value).unwrap()).unwrap();

    node.source.crash().unwrap();
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();
    node.start_supervisor();
    node.all_read(&node.source.expected_content());
    node.supervisor().wait_for_log(HEAL_TIMEOUT, |line| line.contains("unrecorded connection is dead")).unwrap();
}

/// The `healed` or `heal failed` lines logged for `target`.
fn heal_lines(node: &Node, target: &Path, message: &str) -> Vec<String> {
    let (target, message) = (format!("\"target\":\"{}\"", target.display()), format!("\"message\":\"{message}\""));
    node.supervisor().log().into_iter().filter(|line| line.contains(&target) && line.contains(&message)).collect()
}

/// A tenant who can write to the volume replaces its subPath directory with
/// a symlink out of the volume while the daemon is down. Only that subPath
/// target is refused (failed, with the reason, retried with back-off); the
/// other pod's whole volume heals; the subPath container never sees what
/// the symlink points at; once the directory is back, a retry heals it.
#[test]
fn a_subpath_replaced_by_a_symlink_fails_alone_and_exposes_nothing() {
    let (mut node, subpath) = node_with_subpath(Daemon::Bindfs);
    subpath_reads_only_its_directory(&node.readers[1]);
    node.start_supervisor();
    let baseline = node.mounts();

    node.source.crash().unwrap();
    node.readers[1].wait_until(HEAL_TIMEOUT, fails).expect("subPath reader sees the crash");
    let (subdir, moved, outside) = (
        node.source.backing.join(SUBDIR),
        node.source.backing.with_extension("moved-subdir"),
        node.sandbox.root().join("outside-the-volume"),
    );
    let (from, to, secret) = (subdir.clone(), moved.clone(), outside.clone());
    node.sandbox
        .run(move || {
            std::fs::create_dir_all(&secret)?;
            std::fs::write(secret.join(SUBDIR_FILE), "outside the volume")?;
            std::fs::rename(&from, &to)?;
            std::os::unix::fs::symlink(&secret, &from)
        })
        .expect("the tenant swaps its subPath directory for a symlink");
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();

    node.readers[0].wait_until(HEAL_TIMEOUT, reads(node.source.expected_content())).expect("the whole volume heals");
    scenario::wait_for("the subPath heal retried", HEAL_TIMEOUT, || {
        heal_lines(&node, &subpath, "heal failed").len() >= 2
    })
    .unwrap();
    let failed = heal_lines(&node, &subpath, "heal failed");
    assert!(failed[0].contains("Too many levels of symbolic links"), "the reason is not given: {}", failed[0]);
    assert!(failed[1].contains("\"attempts\":2"), "not a retry: {}", failed[1]);
    assert!(heal_lines(&node, &subpath, "healed").is_empty(), "a symlinked subPath was healed");
    assert_eq!(layers_at(&node.sandbox, &subpath), 1, "something was stacked on the refused subPath");
    assert!(node.readers[1].latest().is_some_and(|o| fails(&o)), "the subPath container reads again");

    // The tenant puts the directory back: the next retry heals it.
    node.sandbox
        .run(move || std::fs::remove_file(&subdir).and_then(|()| std::fs::rename(&moved, &subdir)))
        .expect("the directory is put back");
    subpath_reads_only_its_directory(&node.readers[1]);
    node.settles_to(baseline, &[&node.targets[0], &subpath]);
    let outside_seen = node.readers[1].history().iter().any(|o| o.content() == Some("outside the volume"));
    assert!(!outside_seen, "the subPath container saw a file outside the volume");
}

/// The per-mount options of the mount on top at `path` on the host.
fn options_at(sandbox: &Sandbox, path: &Path) -> String {
    let table = sandbox.mountinfo();
    let line = table.lines().rfind(|line| line.split(' ').nth(4).map(Path::new) == Some(path));
    let line = line.unwrap_or_else(|| panic!("nothing mounted at {}", path.display()));
    line.split(' ').nth(5).unwrap_or_default().to_owned()
}

/// Three pods on one source, the second's target published read-only and
/// noexec by its driver (bind, then remount), the third's noatime: after
/// each of three crashes, every target is healed with the attributes its
/// stale layer had, the read-only one by its own stack (never by a
/// propagated writable copy), a write to it fails with EROFS, and the host
/// is flat again.
#[test]
fn each_target_keeps_its_attributes_through_heals_by_propagation() {
    use fuse_supervisor_sys::mount::{MountAttributes, set_attributes_of};
    use fuse_supervisor_sys::{resolve, statmount};
    let mut node = Node::new(Daemon::Bindfs, 3);
    let remount = |target: &PathBuf, added: MountAttributes| {
        let at = target.clone();
        node.sandbox
            .run(move || {
                let fd = resolve::open_path(&at)?;
                let unique = resolve::unique_mount_id_of(std::os::fd::AsFd::as_fd(&fd))?;
                let now = statmount::mount_attributes(unique, statmount::Namespace::Current)?;
                set_attributes_of(std::os::fd::AsFd::as_fd(&fd), now.union(added), None)
            })
            .expect("remount the target");
    };
    remount(&node.targets[1], MountAttributes::READ_ONLY.union(MountAttributes::NOEXEC));
    remount(&node.targets[2], MountAttributes::NOATIME);
    let before: Vec<String> = node.targets.iter().map(|target| options_at(&node.sandbox, target)).collect();
    assert!(before[1].starts_with("ro,") && before[1].contains("noexec"), "{before:?}");
    assert!(before[2].contains("noatime"), "{before:?}");
    node.all_read(&node.source.expected_content());
    node.start_supervisor();
    let baseline = node.mounts();

    for cycle in 1..=3 {
        node.source.crash().unwrap();
        for reader in &node.readers {
            reader.wait_until(HEAL_TIMEOUT, fails).expect("reader sees the crash");
        }
        node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();
        node.all_read(&node.source.expected_content());
        node.settles_to(baseline, &node.targets.iter().collect::<Vec<_>>());
        let after: Vec<String> = node.targets.iter().map(|target| options_at(&node.sandbox, target)).collect();
        assert_eq!(after, before, "cycle {cycle}");
        let probe = node.targets[1].join("written-on-host");
        let err = node.sandbox.run(move || std::fs::write(probe, "x")).expect_err("a write to a read-only target");
        assert_eq!(err.kind(), std::io::ErrorKind::ReadOnlyFilesystem, "cycle {cycle}: {err}");
    }
    let set_back = node.supervisor().log().iter().filter(|line| line.contains("has other attributes")).count();
    assert_eq!(set_back, 0, "a target was reached by a copy with other attributes");
}
