//! Heals from the table kept from fanotify mount events while the mount
//! table churns: many pod targets of one real FUSE daemon (bindfs) crash
//! and come back while unrelated mounts come and go; and events lost to a
//! full fanotify queue are made up for by a resync that misses nothing.
//! Needs root, /dev/fuse, bindfs and Linux 6.15+.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use fuse_supervisor_engine::model::table::{Dev, Snapshot};
use fuse_supervisor_sys::mount;
use fuse_supervisor_sys::process::{Signal, signal};
use fuse_supervisor_testbed::scenario::{self, Daemon, FuseSource, Restart, SupervisorProcess, layers_at};
use fuse_supervisor_testbed::{ContainerReader, Observation, Sandbox};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const HEAL_TIMEOUT: Duration = Duration::from_secs(60);
const FANOTIFY: [&str; 4] = ["--kubelet", "none", "--table-events", "fanotify"];

fn binary() -> &'static Path {
    Path::new(BINARY)
}

/// The device of the topmost FUSE mount at `path`, from the sandbox's table.
fn top_dev(sandbox: &Sandbox, path: &Path) -> Option<Dev> {
    let snapshot = Snapshot::parse(sandbox.mountinfo().as_bytes()).ok()?;
    snapshot.fuse_mounts.iter().rfind(|mount| mount.mount_point == path).map(|mount| mount.dev)
}

fn reads(expected: String) -> impl Fn(&Observation) -> bool {
    move |observation| observation.content() == Some(expected.as_str())
}

/// A bindfs source bound into `pods` pod volumes; readers on the first few.
struct Node {
    // Declared first: they die before the sandbox.
    churn: Option<Churn>,
    readers: Vec<ContainerReader>,
    supervisor: Option<SupervisorProcess>,
    source: FuseSource,
    targets: Vec<PathBuf>,
    sandbox: Arc<Sandbox>,
}

impl Node {
    fn new(pods: usize, readers: usize) -> Node {
        let sandbox = Arc::new(Sandbox::new().expect("sandbox"));
        let source = FuseSource::start(&sandbox, Daemon::Bindfs, "shared-data").expect("start bindfs");
        let mut targets = Vec::new();
        let mut spawned = Vec::new();
        for pod in 0..pods {
            let uid = format!("pod-{pod:04}");
            let target = source.bind_volume(&sandbox, &uid, "data").expect("bind volume");
            if pod < readers {
                let reader = ContainerReader::spawn(&sandbox, &uid, &target, Path::new(scenario::DATA_FILE));
                spawned.push(reader.expect("reader"));
            }
            targets.push(target);
        }
        Node { churn: None, readers: spawned, supervisor: None, source, targets, sandbox }
    }

    /// Readers reading, the supervisor started; with the mount count then.
    fn supervised(pods: usize, readers: usize) -> (Node, usize) {
        let mut node = Node::new(pods, readers);
        node.all_read(&node.source.expected_content());
        node.start_supervisor();
        let baseline = node.mounts();
        (node, baseline)
    }

    fn start_supervisor(&mut self) {
        let state = self.sandbox.root().join("state");
        self.supervisor =
            Some(SupervisorProcess::start_with(&self.sandbox, binary(), &state, FANOTIFY).expect("start"));
    }

    fn supervisor(&self) -> &SupervisorProcess {
        self.supervisor.as_ref().expect("supervisor running")
    }

    fn all_read(&self, expected: &str) {
        for reader in &self.readers {
            reader.wait_until(HEAL_TIMEOUT, reads(expected.to_owned())).expect("reader reads the source");
        }
    }

    fn mounts(&self) -> usize {
        self.sandbox.count_mounts_under(self.sandbox.root())
    }

    /// Every target healed: one layer, on the source's current connection,
    /// and the mount count back where it was.
    fn all_healed(&self, baseline: usize) {
        let source_dev = top_dev(&self.sandbox, &self.source.path).expect("the source is mounted");
        for target in &self.targets {
            scenario::wait_for("one layer on the new connection", HEAL_TIMEOUT, || {
                layers_at(&self.sandbox, target) == 1 && top_dev(&self.sandbox, target) == Some(source_dev)
            })
            .unwrap_or_else(|err| panic!("{}: {err}", target.display()));
        }
        scenario::wait_for("the baseline mount count", HEAL_TIMEOUT, || self.mounts() == baseline)
            .unwrap_or_else(|err| panic!("{err}: {} now, {baseline} before", self.mounts()));
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        drop(self.churn.take());
    }
}

/// Unrelated mount changes, as fast as `pause` lets them, until dropped: a
/// tmpfs outside the kubelet tree mounted and unmounted in turn.
struct Churn {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<usize>>,
}

impl Churn {
    fn start(sandbox: &Arc<Sandbox>, pause: Duration) -> Churn {
        let stop = Arc::new(AtomicBool::new(false));
        let dir = sandbox.root().join("churn");
        let created = dir.clone();
        sandbox.run(move || std::fs::create_dir_all(&created)).expect("churn directory");
        let (sandbox, stopped) = (Arc::clone(sandbox), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            let mut changes = 0;
            while !stopped.load(Ordering::Relaxed) {
                let path = dir.clone();
                sandbox.run(move || mount_and_unmount(&path, 1)).expect("churn the mount table");
                changes += 2;
                std::thread::sleep(pause);
            }
            changes
        });
        Churn { stop, thread: Some(thread) }
    }
}

/// Mounts a tmpfs on `dir` and unmounts it, `times` times: two changes each.
fn mount_and_unmount(dir: &Path, times: usize) -> std::io::Result<()> {
    for _ in 0..times {
        mount::mount_tmpfs(dir)?;
        mount::detach(dir)?;
    }
    Ok(())
}

impl Drop for Churn {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[test]
fn a_hundred_targets_are_healed_while_unrelated_mounts_churn() {
    let (mut node, baseline) = Node::supervised(100, 5);
    let started = node.supervisor().log().len();
    // About 200 changes a second around the crash, the heal and after.
    node.churn = Some(Churn::start(&node.sandbox, Duration::from_millis(10)));
    std::thread::sleep(Duration::from_millis(300));
    let from = node.supervisor().log().len();
    let scans = node.supervisor().log()[started..].iter().filter(|line| line.contains("\"scanned\"")).count();
    assert_eq!(scans, 0, "changes of mounts that are not FUSE made the loop scan");

    node.source.crash().unwrap();
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();

    node.all_read(&node.source.expected_content());
    node.supervisor().wait_for_lines(HEAL_TIMEOUT, from, 100, |line| line.contains("\"healed\"")).unwrap();
    drop(node.churn.take());
    node.all_healed(baseline);
}

/// The kernel's limit on a group's queue; events past it are dropped and
/// an overflow event says so.
fn fanotify_queue_limit() -> usize {
    let limit = std::fs::read_to_string("/proc/sys/fs/fanotify/max_queued_events").expect("fanotify queue limit");
    limit.trim().parse().expect("a number")
}

#[test]
fn an_overflow_resync_misses_nothing() {
    let (mut node, baseline) = Node::supervised(10, 2);
    let pid = node.supervisor().pid();
    let from = node.supervisor().log().len();

    // Frozen, the supervisor reads no events: more unrelated changes than
    // the queue holds fill it, and the crash and the new mount that follow
    // are lost (the kernel drops events once the queue is full, and queues
    // one overflow event). Only the resync can find the new mount.
    signal(pid, Signal::Stop).expect("stop the supervisor");
    let frozen = Frozen(pid);
    let changes = fanotify_queue_limit() + 1000;
    let dir = node.sandbox.root().join("flood");
    node.sandbox
        .run(move || std::fs::create_dir_all(&dir).and_then(|()| mount_and_unmount(&dir, changes.div_ceil(2))))
        .expect("flood the mount table");
    node.source.crash().unwrap();
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();
    drop(frozen);

    let overflow = |line: &str| line.contains("\"mount table resynced\"") && line.contains("\"overflow\"");
    node.supervisor().wait_for_lines(HEAL_TIMEOUT, from, 1, overflow).expect("an overflow resync");
    node.all_read(&node.source.expected_content());
    node.all_healed(baseline);
}

/// Continues the process when dropped, even if the test fails first.
struct Frozen(u32);

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = signal(self.0, Signal::Cont);
    }
}
