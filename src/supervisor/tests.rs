//! The loop without a kernel: a table the test sets, an executor that
//! records what it is asked to do, and a reporter that records what the loop
//! says. A change of the table goes through the loop's own scan, plan, probe
//! answer, heal and reports.
use std::collections::BTreeSet;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::supervisor::daemons::DaemonWatch;
use fuse_supervisor_engine::heal::containers::{ContainerHealError, ForeignHealed, ForeignMount};
use fuse_supervisor_engine::heal::namespaces::LateCopies;
use fuse_supervisor_engine::heal::priority::HealPriority;
use fuse_supervisor_engine::heal::probe::{ProbeOutcome, SourceHandles};
use fuse_supervisor_engine::heal::{
    ContainerOutcome, Executor, HealError, Healed, Prepared, Propagation, TargetOutcome,
};
use fuse_supervisor_engine::kube::{ContainerStatus, Kubelet, KubeletConfig, KubeletTls, Pod, PodList};
use fuse_supervisor_engine::model::source::{TableError, TableRead, TableSource};
use fuse_supervisor_engine::model::state::TargetState;
use fuse_supervisor_engine::model::table::{Dev, FuseMount, Snapshot};
use fuse_supervisor_engine::plan::layout::SourceLayouts;
use fuse_supervisor_engine::plan::{HealBatch, TargetHeal};
use fuse_supervisor_engine::report::{Report, Reporter, Reporters};
use fuse_supervisor_engine::watch::mount_table::{TableEvents, WatchMode};

use super::{Config, Event, Supervisor};

/// The global mount's path, under the test's directory: a real directory,
/// so that the loop's real probe finds it and it answers.
const GLOBAL: &str = "runtime/juicefs-fuse";

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The table the loop reads: what the test last set.
#[derive(Clone, Default)]
struct SetTable {
    text: Arc<Mutex<String>>,
    /// Set by the next read just before it reads: a change made after
    /// whatever the loop checked before the read.
    before_next_read: Arc<Mutex<Option<String>>>,
}

impl SetTable {
    fn set(&self, table: String) {
        *lock(&self.text) = table;
    }

    fn set_just_before_next_read(&self, table: String) {
        *lock(&self.before_next_read) = Some(table);
    }
}

/// What the loop reads through: a copy of the set table at each read.
struct SetTableReader {
    table: SetTable,
    buffer: Vec<u8>,
}

impl TableSource for SetTableReader {
    fn snapshot(&mut self) -> Result<TableRead, TableError> {
        if let Some(table) = lock(&self.table.before_next_read).take() {
            self.table.set(table);
        }
        let read = lock(&self.table.text).clone().into_bytes();
        let changed = read != self.buffer;
        self.buffer = read;
        Ok(TableRead { snapshot: Snapshot::parse(&self.buffer)?, changed })
    }

    fn changed_since_read(&mut self) -> io::Result<bool> {
        Ok(lock(&self.table.text).as_bytes() != self.buffer)
    }
}

/// One call the loop made to its executor.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Prepare {
        source: PathBuf,
        targets: Vec<PathBuf>,
    },
    Heal {
        source: PathBuf,
        mount_id: u32,
        targets: Vec<(PathBuf, PathBuf)>,
    },
    /// Container heals tried again: each mount's namespace and pid.
    RetryContainers {
        mounts: Vec<(u64, u32)>,
    },
}

/// Records each call; a heal stacks every target (or fails the one named
/// in `fail`) and then sets `after_heal` as the table, as the kernel would
/// show it.
struct RecordingExecutor {
    calls: Arc<Mutex<Vec<Call>>>,
    table: SetTable,
    after_heal: Option<String>,
    fail: Option<PathBuf>,
    /// What the next heal or retry in containers returns.
    containers: Vec<ContainerOutcome>,
    /// Where a heal in containers that returns something is marked, among
    /// the loop's reports.
    reports: Arc<RecordingReporter>,
}

impl Executor for RecordingExecutor {
    fn prepare(&self, batch: &HealBatch, _held: Vec<Option<OwnedFd>>) -> Prepared {
        let targets = batch.targets.iter().map(|target| target.path.clone()).collect();
        lock(&self.calls).push(Call::Prepare { source: batch.source.path.clone(), targets });
        Prepared::default()
    }

    fn heal(&mut self, batch: &HealBatch, _prepared: Prepared, _source: &SourceHandles) -> Vec<TargetOutcome> {
        let targets = batch.targets.iter().map(|t| (t.path.clone(), t.root_in_source.clone())).collect();
        let (source, mount_id) = (batch.source.path.clone(), batch.source.top().mount_id);
        lock(&self.calls).push(Call::Heal { source, mount_id, targets });
        if let Some(table) = self.after_heal.take() {
            self.table.set(table);
        }
        let outcome = |target: &TargetHeal| TargetOutcome {
            path: target.path.clone(),
            result: match &self.fail {
                Some(failing) if *failing == target.path => {
                    Err(HealError::Changed { path: target.path.clone(), planned: target.top_mount_id, found: 0 })
                }
                _ => Ok(Healed::Stacked),
            },
            layers_removed: 1,
            flatten_error: None,
        };
        batch.targets.iter().map(outcome).collect()
    }

    fn open_target(&self, path: &Path) -> Result<(OwnedFd, u32), HealError> {
        Err(HealError::NotAbsolute { path: path.to_path_buf() })
    }

    fn flatten_covered(&mut self, target: &TargetHeal, _stale: OwnedFd) -> Result<usize, HealError> {
        Err(HealError::NotAbsolute { path: target.path.clone() })
    }

    fn detach_dead_source(&mut self, source: &Path, _dead: Dev) -> Result<bool, HealError> {
        Err(HealError::NotAbsolute { path: source.to_path_buf() })
    }

    fn heal_containers(
        &mut self,
        _dead: &BTreeSet<Dev>,
        _source: &FuseMount,
        _live: Option<&fuse_supervisor_engine::heal::probe::SourceHandles>,
    ) -> Vec<ContainerOutcome> {
        if !self.containers.is_empty() {
            lock(&self.reports.lines).push(HEALED_IN_CONTAINERS.to_owned());
        }
        std::mem::take(&mut self.containers)
    }

    fn retry_containers(&mut self, mounts: &[ForeignMount], _source: &FuseMount) -> Vec<ContainerOutcome> {
        let mounts = mounts.iter().map(|foreign| (foreign.namespace, foreign.pid)).collect();
        lock(&self.calls).push(Call::RetryContainers { mounts });
        std::mem::take(&mut self.containers)
    }
}

/// Marks the executor's heal in containers among the reports.
const HEALED_IN_CONTAINERS: &str = "(the executor healed in containers)";

/// What the loop reported, one line each.
#[derive(Default)]
struct RecordingReporter {
    lines: Mutex<Vec<String>>,
}

impl Reporter for RecordingReporter {
    fn report(&self, report: &Report<'_>) {
        let line = match report {
            Report::TargetBroken(target) => format!("broken {}", target.target.display()),
            Report::TargetHealed { target, heal } => format!("healed {} {:?}", target.target.display(), heal.how),
            Report::HealFailed { target, .. } => format!("failed {}", target.target.display()),
            Report::ContainerHealed { result, .. } => format!("container {result}"),
            Report::ContainersHealed { heals, .. } => {
                format!(
                    "containers of {}/{} {:?} {} {}",
                    heals.namespace, heals.pod, heals.containers, heals.replaced, heals.stacked
                )
            }
            _ => return,
        };
        lock(&self.lines).push(line);
    }
}

/// A loop over a kubelet tree in a temporary directory (the pods'
/// directories exist: the loop forgets the targets of deleted pods).
struct Harness {
    supervisor: Supervisor<RecordingExecutor>,
    table: SetTable,
    calls: Arc<Mutex<Vec<Call>>>,
    reports: Arc<RecordingReporter>,
    kubelet: tempfile::TempDir,
    /// The loop's channel, where its probes answer.
    inbox: Receiver<Event>,
    /// The mount ID of the directory standing for the new global mount:
    /// the probe checks the source is still the mount the table named.
    new_global_id: u32,
}

impl Harness {
    fn new(after_heal: Option<String>, fail: Option<&str>) -> Harness {
        let kubelet = tempfile::tempdir().unwrap();
        for uid in ["aaaa", "bbbb", "cccc"] {
            std::fs::create_dir_all(kubelet.path().join("pods").join(uid)).unwrap();
        }
        std::fs::create_dir_all(kubelet.path().join(GLOBAL).join("sub")).unwrap();
        let (new_global_id, _global) =
            fuse_supervisor_engine::heal::probe::open_mount_root(&kubelet.path().join(GLOBAL)).unwrap();
        let reports = Arc::new(RecordingReporter::default());
        let config = Config {
            kubelet_root: kubelet.path().to_path_buf(),
            state_dir: kubelet.path().join("state"),
            mount_namespace: PathBuf::from("/proc/self/ns/mnt"),
            staging_dir: kubelet.path().join("staging"),
            probe_timeout: Duration::from_secs(2),
            kubelet: None,
            layouts: SourceLayouts::new(kubelet.path()),
            reporters: Reporters::new(vec![reports.clone() as Arc<dyn Reporter>]),
            pod_scope: None,
            job: None,
            daemons: DaemonWatch::default(),
            watch: WatchMode::Events(TableEvents::Auto),
            health: Arc::default(),
            heal_priority: HealPriority::OFF,
            container_namespaces: super::ContainerNamespaces::Walk,
            container_deadline: fuse_supervisor_engine::heal::containers::DEFAULT_DEADLINE,
            restage: None,
        };
        let table = SetTable::default();
        let calls = Arc::default();
        let executor = RecordingExecutor {
            calls: Arc::clone(&calls),
            table: table.clone(),
            after_heal,
            fail: fail.map(|target| kubelet.path().join(target)),
            containers: Vec::new(),
            reports: Arc::clone(&reports),
        };
        let reader = Box::new(SetTableReader { table: table.clone(), buffer: Vec::new() });
        let (events, inbox) = mpsc::channel();
        let supervisor = Supervisor::with_executor(&config, reader, executor, events, Arc::default());
        Harness { supervisor, table, calls, reports, kubelet, inbox, new_global_id }
    }

    fn path(&self, relative: &str) -> PathBuf {
        self.kubelet.path().join(relative)
    }

    /// A table: the root, then FUSE mounts `(id, device, root, mount point
    /// relative to the kubelet root or absolute, peer group)`.
    fn table(&self, mounts: &[(u32, u32, &str, &str, u32)]) -> String {
        let mut table = "1 0 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n".to_owned();
        for &(id, dev, root, point, group) in mounts {
            let point = if point.starts_with('/') { PathBuf::from(point) } else { self.path(point) };
            table += &format!(
                "{id} 1 0:{dev} {root} {} rw,relatime shared:{group} - fuse.juicefs JuiceFS:data rw,user_id=0\n",
                point.display()
            );
        }
        table
    }

    fn calls(&self) -> Vec<Call> {
        lock(&self.calls).clone()
    }

    fn reports(&self) -> Vec<String> {
        lock(&self.reports.lines).clone()
    }

    /// The loop's probe of the new global mount answers, and the loop takes
    /// the answer.
    fn source_answers(&mut self) {
        let event = self.inbox.recv_timeout(Duration::from_secs(10)).expect("the probe answers");
        let Event::Probed(report) = event else { panic!("not a probe's answer") };
        assert!(matches!(report.outcome, ProbeOutcome::Live(_)), "{report:?}");
        self.supervisor.on_probe(report);
    }

    /// The table after the daemon came back on device 51 (the targets are
    /// still on 50), and after they were healed.
    fn replaced_and_healed(&self) -> (String, String) {
        let new = Some((self.new_global_id, 51, 9));
        (self.table(&node(50, 7, new)), self.table(&node(51, 9, new)))
    }
}

const POD_A: &str = "pods/aaaa/volumes/kubernetes.io~csi/data/mount";
const POD_B: &str = "pods/bbbb/volumes/kubernetes.io~csi/data/mount";
const SUB: &str = "pods/cccc/volume-subpaths/data/app/0";

/// The global mount and three targets on device `dev` in peer group `group`;
/// the global mount is `global` (None: gone).
fn node(dev: u32, group: u32, global: Option<(u32, u32, u32)>) -> Vec<(u32, u32, &'static str, &'static str, u32)> {
    let mut mounts = vec![(11, dev, "/", POD_A, group), (12, dev, "/", POD_B, group), (13, dev, "/sub", SUB, group)];
    if let Some((id, dev, group)) = global {
        mounts.insert(0, (id, dev, "/", GLOBAL, group));
    }
    mounts
}

#[test]
fn a_replaced_source_is_planned_probed_healed_and_reported() {
    let mut harness = Harness::new(None, None);
    let healthy = harness.table(&node(50, 7, Some((10, 50, 7))));
    harness.table.set(healthy);
    harness.supervisor.rescan();
    for target in [POD_A, POD_B, SUB] {
        let mapping = harness.supervisor.journal.get(&harness.path(target)).expect("learned");
        assert_eq!(mapping.source, harness.path(GLOBAL));
    }
    assert!(harness.calls().is_empty(), "a healthy table heals nothing");

    let (replaced, healed) = harness.replaced_and_healed();
    harness.supervisor.executor.after_heal = Some(healed);
    harness.table.set(replaced);
    harness.supervisor.rescan();
    let targets = [harness.path(POD_A), harness.path(POD_B), harness.path(SUB)];
    let global = harness.path(GLOBAL);
    let prepared = Call::Prepare { source: global.clone(), targets: targets.to_vec() };
    assert_eq!(harness.calls(), std::slice::from_ref(&prepared), "prepared while the probe waits, whole volumes first");
    assert!(harness.supervisor.sources.get(&global).is_some_and(|record| record.probed.is_some()));

    harness.source_answers();
    let roots = [PathBuf::new(), PathBuf::new(), PathBuf::from("sub")];
    let heal = Call::Heal {
        source: global.clone(),
        mount_id: harness.new_global_id,
        targets: targets.iter().cloned().zip(roots).collect(),
    };
    assert_eq!(harness.calls(), [prepared, heal]);
    let mut expected: Vec<String> = targets.iter().map(|t| format!("broken {}", t.display())).collect();
    expected.extend(targets.iter().map(|t| format!("healed {} Stacked", t.display())));
    assert_eq!(harness.reports(), expected);
    // The scan after the heal finds them on the new connection.
    assert!(harness.supervisor.records.values().all(|record| record.state == TargetState::Healthy));
    assert_eq!(harness.supervisor.journal.get(&targets[0]).unwrap().source_mount_id, harness.new_global_id);
}

/// A read outside a scan (a daemon's death holds the stale layers) that
/// takes in the new global mount drains its report: the loop scans it
/// anyway once the event is handled, and its heal is prepared.
#[test]
fn a_new_mount_taken_in_by_a_read_outside_a_scan_is_scanned() {
    read_outside_a_scan_takes_in(SetTable::set);
}

/// The same when the new mount lands after whatever the loop checked
/// before its read and before the read itself: the read's own account says
/// it took a change in (under load, a daemon's death read the other
/// daemon's new mount so, and it was healed only 30 s later).
#[test]
fn a_new_mount_made_just_before_a_read_outside_a_scan_is_scanned() {
    read_outside_a_scan_takes_in(SetTable::set_just_before_next_read);
}

/// The new global mount, set by `make`, is taken in by a read outside a
/// scan: the next scan plans its heal, and one scan is enough.
fn read_outside_a_scan_takes_in(make: fn(&SetTable, String)) {
    let mut harness = Harness::new(None, None);
    harness.table.set(harness.table(&node(50, 7, Some((10, 50, 7)))));
    harness.supervisor.rescan();
    let (replaced, _) = harness.replaced_and_healed();
    make(&harness.table, replaced);
    assert!(harness.supervisor.read_table().is_some());
    assert!(harness.calls().is_empty(), "a read alone plans nothing");
    harness.supervisor.scan_unscanned();
    assert!(matches!(harness.calls().as_slice(), [Call::Prepare { .. }]), "{:?}", harness.calls());
    harness.supervisor.scan_unscanned();
    assert_eq!(harness.calls().len(), 1, "scanned: nothing is left for the next event to scan");
}

/// A heal of the three targets in which POD_B's stack failed.
fn healed_but_pod_b() -> Harness {
    let mut harness = Harness::new(None, Some(POD_B));
    harness.table.set(harness.table(&node(50, 7, Some((10, 50, 7)))));
    harness.supervisor.rescan();
    let (replaced, _) = harness.replaced_and_healed();
    // Healed but for the target whose stack failed: still on the dead one.
    let mut healed_but_b = node(51, 9, Some((harness.new_global_id, 51, 9)));
    healed_but_b[2] = (12, 50, "/", POD_B, 7);
    harness.supervisor.executor.after_heal = Some(harness.table(&healed_but_b));
    harness.table.set(replaced);
    harness.supervisor.rescan();
    harness.source_answers();
    harness
}

#[test]
fn a_failed_target_is_reported_and_waits_out_its_back_off_while_the_others_heal() {
    let harness = healed_but_pod_b();

    let (pod_a, pod_b) = (harness.path(POD_A), harness.path(POD_B));
    let reports = harness.reports();
    assert!(reports.contains(&format!("healed {} Stacked", pod_a.display())), "{reports:?}");
    assert!(reports.contains(&format!("failed {}", pod_b.display())), "{reports:?}");
    assert!(matches!(harness.supervisor.records.get(&pod_b).unwrap().state, TargetState::Failed { .. }));
    assert!(harness.supervisor.in_back_off(&pod_b));
    // Still in the work set: its mapping stays until it is healed.
    assert!(harness.supervisor.journal.get(&pod_b).is_some());
}

/// A retry that falls due while the loop is busy with other events is
/// still due once they are handled: the loop used to look only at
/// deadlines still ahead, wait for the next event with none, and leave the
/// target broken (a subPath's back-off ended just before a daemon's news
/// came in, in a stress run of tests/heal.rs).
#[test]
fn a_retry_due_while_other_events_were_handled_wakes_the_loop_at_once() {
    let mut harness = healed_but_pod_b();
    let retry_at = harness.supervisor.next_deadline().expect("the failed target's retry");

    std::thread::sleep(retry_at.saturating_duration_since(std::time::Instant::now()));
    assert_eq!(harness.supervisor.next_deadline(), Some(retry_at), "passed, and due at once");
    harness.supervisor.on_deadline();
    assert!(harness.supervisor.next_deadline().is_none_or(|at| at > retry_at), "handled once");
}

/// A new source that cannot even be opened for its probe (out of
/// descriptors for a moment) leaves its targets in the work set: each fails
/// with a back-off, whose deadline wakes the loop to try again, and that try
/// probes and heals. Before, nothing but another event woke it.
#[test]
fn a_source_that_cannot_be_opened_for_its_probe_is_tried_again_after_a_back_off() {
    let mut harness = Harness::new(None, None);
    harness.table.set(harness.table(&node(50, 7, Some((10, 50, 7)))));
    harness.supervisor.rescan();
    let (global, away) = (harness.path(GLOBAL), harness.path("away"));
    std::fs::rename(&global, &away).unwrap();
    let (replaced, healed) = harness.replaced_and_healed();
    harness.table.set(replaced);
    harness.supervisor.rescan();
    let targets = [POD_A, POD_B, SUB].map(|target| harness.path(target));
    for target in &targets {
        assert!(harness.supervisor.in_back_off(target), "{}", target.display());
        assert!(harness.reports().contains(&format!("failed {}", target.display())), "{:?}", harness.reports());
    }
    let retry_at = harness.supervisor.next_deadline().expect("a deadline wakes the loop to try again");

    std::fs::rename(&away, &global).unwrap();
    std::thread::sleep(retry_at.saturating_duration_since(std::time::Instant::now()));
    harness.supervisor.executor.after_heal = Some(healed);
    harness.supervisor.rescan();
    harness.source_answers();
    for target in &targets {
        assert!(harness.reports().contains(&format!("healed {} Stacked", target.display())), "{:?}", harness.reports());
    }
}

#[test]
fn a_source_that_fails_its_probe_heals_nothing() {
    let mut harness = Harness::new(None, None);
    harness.table.set(harness.table(&node(50, 7, Some((10, 50, 7)))));
    harness.supervisor.rescan();
    harness.table.set(harness.replaced_and_healed().0);
    harness.supervisor.rescan();
    let event = harness.inbox.recv_timeout(Duration::from_secs(10)).expect("the probe answers");
    let Event::Probed(mut report) = event else { panic!("not a probe's answer") };
    // As a dead daemon answers.
    report.outcome = ProbeOutcome::Failed(io::Error::from(io::ErrorKind::NotConnected));
    harness.supervisor.on_probe(report);
    assert!(harness.calls().iter().all(|call| matches!(call, Call::Prepare { .. })), "{:?}", harness.calls());
    assert!(harness.reports().iter().all(|line| line.starts_with("broken ")));
}

/// A source whose probe overran its time keeps no handles on its targets:
/// the scans that follow (a pod's target unmounted meanwhile, say) plan
/// the heal again but prepare nothing, so the kubelet's plain umount of a
/// deleted pod's target is not refused with EBUSY while the daemon is silent.
#[test]
fn a_source_that_does_not_answer_has_nothing_prepared_by_later_scans() {
    let mut harness = Harness::new(None, None);
    harness.table.set(harness.table(&node(50, 7, Some((10, 50, 7)))));
    harness.supervisor.rescan();
    let new = Some((harness.new_global_id, 51, 9));
    harness.table.set(harness.table(&node(50, 7, new)));
    harness.supervisor.rescan();
    let global = harness.path(GLOBAL);
    assert_eq!(harness.calls().len(), 1, "prepared while the probe waits: {:?}", harness.calls());
    // What on_deadline does once the probe is overdue.
    harness.supervisor.sources.update(&global, |record| {
        record.overdue_reported = true;
        record.probed.as_mut().expect("planned").prepared = Prepared::default();
    });

    let mut without_a = node(50, 7, new);
    without_a.retain(|mount| mount.3 != POD_A);
    harness.table.set(harness.table(&without_a));
    harness.supervisor.rescan();
    assert_eq!(harness.calls().len(), 1, "nothing prepared for a silent source: {:?}", harness.calls());
    let record = harness.supervisor.sources.get(&global).expect("a record of the source");
    let batch = &record.probed.as_ref().expect("planned").batch;
    assert_eq!(batch.targets.len(), 2, "planned again without the unmounted target");
}

/// A target unmounted in the instant between the loop's last look at the
/// table and its stack fails that heal once; it is not in the table at its
/// retry, so nothing is attempted again, and it leaves the work set with its
/// pod directory.
#[test]
fn a_target_unmounted_just_before_its_stack_fails_once_and_leaves_with_its_pod() {
    let mut harness = Harness::new(None, Some(POD_B));
    harness.table.set(harness.table(&node(50, 7, Some((10, 50, 7)))));
    harness.supervisor.rescan();
    let (replaced, _) = harness.replaced_and_healed();
    let mut healed_without_b = node(51, 9, Some((harness.new_global_id, 51, 9)));
    healed_without_b.retain(|mount| mount.3 != POD_B);
    harness.supervisor.executor.after_heal = Some(harness.table(&healed_without_b));
    harness.table.set(replaced);
    harness.supervisor.rescan();
    harness.source_answers();
    let pod_b = harness.path(POD_B);
    assert!(harness.reports().contains(&format!("failed {}", pod_b.display())), "{:?}", harness.reports());

    // Its retry comes: the table has no such target any more.
    if let Some(record) = harness.supervisor.records.get_mut(&pod_b) {
        record.state = TargetState::Failed { attempts: 1, retry_at: std::time::Instant::now(), error: String::new() };
    }
    harness.supervisor.on_deadline();
    let heals = harness.calls().iter().filter(|call| matches!(call, Call::Heal { .. })).count();
    assert_eq!(heals, 1, "{:?}", harness.calls());
    assert_eq!(harness.supervisor.next_deadline(), None, "nothing left to retry");

    std::fs::remove_dir_all(harness.path("pods/bbbb")).unwrap();
    harness.supervisor.on_pods(fuse_supervisor_engine::watch::pods::PodChange::PodRemoved { uid: "bbbb".into() });
    assert!(harness.supervisor.journal.get(&pod_b).is_none());
    assert!(!harness.supervisor.records.contains_key(&pod_b));
}

/// A container's mount of the dead connection, in namespace `namespace`
/// through process `pid`.
fn foreign(pid: u32, namespace: u64) -> ForeignMount {
    ForeignMount {
        namespace,
        pid,
        mount: FuseMount {
            mount_id: 99,
            parent_id: 1,
            dev: Dev { major: 0, minor: 50 },
            root: "/".into(),
            mount_point: "/data".into(),
            peer_group: None,
            master: None,
            fs_type: "fuse.juicefs".into(),
            source: "JuiceFS:data".into(),
            table_order: 0,
        },
        propagation: Propagation::Private,
        namespace_id: None,
        unique_id: None,
        nested: Default::default(),
    }
}

#[test]
fn container_heals_after_the_host_heal_are_reported_with_their_pod() {
    const ID: &str = "4f1bd2c7e0a94b5f8c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b";
    let mut harness = Harness::new(None, None);
    harness.table.set(harness.table(&node(50, 7, Some((10, 50, 7)))));
    harness.supervisor.rescan();
    // Process 4242 is in container `app` of pod default/reader, by its cgroup
    // and the kubelet's last list; process 4343 is no pod's container.
    let proc_root = tempfile::tempdir().unwrap();
    let cgroup = format!("0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-{ID}.scope\n");
    for (pid, cgroup) in [(4242, cgroup.as_str()), (4343, "0::/user.slice/session-1.scope\n")] {
        std::fs::create_dir(proc_root.path().join(pid.to_string())).unwrap();
        std::fs::write(proc_root.path().join(pid.to_string()).join("cgroup"), cgroup).unwrap();
    }
    harness.supervisor.proc_root = proc_root.path().to_path_buf();
    let kubelet = Kubelet::new(KubeletConfig::new("127.0.0.1", KubeletTls::InsecureSkipVerify));
    let mut pod = Pod::default();
    (pod.metadata.namespace, pod.metadata.name, pod.metadata.uid) = ("default".into(), "reader".into(), "aaaa".into());
    pod.status.container_statuses = vec![ContainerStatus {
        name: "app".into(),
        container_id: Some(format!("containerd://{ID}")),
        ..Default::default()
    }];
    kubelet.set_last_listed(PodList { items: vec![pod], ..Default::default() });
    harness.supervisor.kubelet = Some(kubelet);
    harness.supervisor.executor.containers = vec![
        (foreign(4242, 1), Ok(ForeignHealed::Replaced { not_carried: Vec::new() })),
        (foreign(4242, 1), Ok(ForeignHealed::Stacked { why: io::Error::other("busy"), not_carried: Vec::new() })),
        (foreign(4343, 2), Ok(ForeignHealed::Replaced { not_carried: Vec::new() })),
    ];

    let (replaced, healed) = harness.replaced_and_healed();
    harness.supervisor.executor.after_heal = Some(healed);
    harness.table.set(replaced);
    harness.supervisor.rescan();
    harness.source_answers();
    let reports = harness.reports();
    let after_broken = reports.iter().skip_while(|line| line.starts_with("broken ")).collect::<Vec<_>>();
    assert!(after_broken[1..4].iter().all(|line| line.starts_with("healed ")), "{reports:?}");
    assert_eq!(
        [after_broken[0]].into_iter().chain(after_broken[4..].iter().copied()).collect::<Vec<_>>(),
        [
            HEALED_IN_CONTAINERS,
            "container replaced",
            "container stacked",
            "container replaced",
            r#"containers of default/reader {"app"} 1 1"#
        ],
        "the containers healed before anything is reported (their readers wait, nobody waits for a report), \
         then the targets' heals reported first, then each container's, then one report for the pod: {reports:?}"
    );
}

/// A container heal given up on (its namespace's worker late) is tried
/// again when the loop hears that worker ended, and not for another
/// namespace's.
#[test]
fn a_container_heal_given_up_on_is_tried_again_once_its_worker_ends() {
    let mut harness = Harness::new(None, None);
    harness.table.set(harness.table(&node(50, 7, Some((10, 50, 7)))));
    harness.supervisor.rescan();
    let late = ContainerHealError::Deadline { pid: 4242, namespace: 1, deadline_ms: 1000 };
    harness.supervisor.executor.containers = vec![(foreign(4242, 1), Err(late))];
    let (replaced, healed) = harness.replaced_and_healed();
    harness.supervisor.executor.after_heal = Some(healed);
    harness.table.set(replaced);
    harness.supervisor.rescan();
    harness.source_answers();
    let retries = |harness: &Harness| {
        harness.calls().into_iter().filter(|call| matches!(call, Call::RetryContainers { .. })).collect::<Vec<_>>()
    };
    assert!(retries(&harness).is_empty(), "tried again before its worker ended");

    harness.supervisor.retry_given_up(2);
    assert!(retries(&harness).is_empty(), "tried again for another namespace's worker");
    // The worker left behind replaced the mount before it ended: found
    // live, and counted as the replacement it was.
    harness.supervisor.executor.containers = vec![(foreign(4242, 1), Ok(ForeignHealed::AlreadyLive))];
    harness.supervisor.retry_given_up(1);
    assert_eq!(retries(&harness), [Call::RetryContainers { mounts: vec![(1, 4242)] }]);
    let replaced = harness.reports().iter().filter(|line| *line == "container replaced").count();
    assert_eq!(replaced, 1, "{:?}", harness.reports());
    harness.supervisor.retry_given_up(1);
    assert_eq!(retries(&harness).len(), 1, "tried again twice for one given-up heal");
}

/// Copies of a replaced connection in a namespace learnt after the heal
/// are healed at once from their source's current mount; handed over
/// again while their heal waits (a namespace learnt anew), they are not
/// healed twice.
#[test]
fn late_copies_are_healed_from_their_source_once() {
    let mut harness = Harness::new(None, None);
    let (_, healed) = harness.replaced_and_healed();
    harness.table.set(healed);
    harness.supervisor.rescan();
    let retries = |harness: &Harness| {
        harness.calls().into_iter().filter(|call| matches!(call, Call::RetryContainers { .. })).collect::<Vec<_>>()
    };
    let late = LateCopies { source: harness.path(GLOBAL), mounts: vec![foreign(4242, 1)] };
    // Its worker is late: the heal waits for it.
    let given_up = ContainerHealError::Deadline { pid: 4242, namespace: 1, deadline_ms: 1000 };
    harness.supervisor.executor.containers = vec![(foreign(4242, 1), Err(given_up))];
    harness.supervisor.heal_late_copies(late.clone());
    assert_eq!(retries(&harness), [Call::RetryContainers { mounts: vec![(1, 4242)] }]);

    harness.supervisor.heal_late_copies(late);
    assert_eq!(retries(&harness).len(), 1, "a copy whose heal waits for its worker was healed again");
    harness.supervisor.retry_given_up(1);
    assert_eq!(retries(&harness).len(), 2, "and is tried again once that worker ends");
}
