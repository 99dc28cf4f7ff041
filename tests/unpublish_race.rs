//! NodeUnpublishVolume racing a heal: a pod's target is unmounted (a plain
//! `umount(2)`, as CSI drivers do) and its directory removed, or removed
//! and made again, between the supervisor's plan of a heal and its stack.
//!
//! The hold between the two is the new daemon's first answer: a demofs that
//! mounts and answers nothing until told (`--answer-on-signal`) keeps the
//! supervisor's probe of the new source waiting, the heal planned and not
//! carried out, while the test unpublishes; then it answers. Nothing may be
//! mounted on the removed path or the recreated directory, the supervisor
//! must not retry, and the other targets of the source heal.
//!
//! The last microseconds between the loop's last look at the table and the
//! stack cannot be held from outside; the executor is given a batch planned
//! before the unpublish instead, as the loop would hand it over.
use std::path::{Path, PathBuf};
use std::time::Duration;

use fuse_supervisor_engine::heal::priority::HealPriority;
use fuse_supervisor_engine::heal::probe::SourceHandles;
use fuse_supervisor_engine::heal::{Executor, HealError, MountExecutor, Prepared};
use fuse_supervisor_engine::model::table::{Classified, Layout, Snapshot, TargetKind};
use fuse_supervisor_engine::plan::{HealBatch, TargetHeal};
use fuse_supervisor_sys::{mount, resolve};
use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::scenario::{
    self, DATA_FILE, Daemon, FuseSource, Restart, SUBDIR, SUBDIR_FILE, SupervisorProcess, layers_at,
};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(20);
const VOLUME: &str = "data";
const DETACHED: &str = "dead source detached: its daemon can mount there again; its targets' stale layers are let go";

fn message_is(message: &'static str) -> impl Fn(&str) -> bool {
    move |line| line.contains(&format!("\"message\":\"{message}\""))
}

/// A demofs source and four pods bound to it: two that stay (a whole volume
/// and a subPath), one deleted during the heal and one whose target
/// directory is removed and made again.
struct Node {
    supervisor: Option<SupervisorProcess>,
    source: FuseSource,
    staying: PathBuf,
    staying_subpath: PathBuf,
    deleted: PathBuf,
    recreated: PathBuf,
    sandbox: Sandbox,
}

impl Node {
    fn new() -> Node {
        let sandbox = Sandbox::new().expect("sandbox");
        let source = FuseSource::start(&sandbox, Daemon::DemoFs, "shared-data").expect("demofs");
        let bind = |pod: &str| source.bind_volume(&sandbox, pod, VOLUME).expect("bind volume");
        let (staying, deleted, recreated) = (bind("staying"), bind("deleted"), bind("recreated"));
        let staying_subpath = source.bind_subpath(&sandbox, "staying-subpath", VOLUME).expect("bind subPath");
        Node { supervisor: None, source, staying, staying_subpath, deleted, recreated, sandbox }
    }

    fn supervisor(&self) -> &SupervisorProcess {
        self.supervisor.as_ref().expect("supervisor running")
    }

    fn read(&self, path: &Path) -> std::io::Result<String> {
        let path = path.to_path_buf();
        self.sandbox.run(move || std::fs::read_to_string(path))
    }

    /// The staying pods read the current generation.
    fn staying_read(&self) -> bool {
        let expected = self.source.expected_content();
        let subdir = format!("inside shared-data/{SUBDIR}");
        self.read(&self.staying.join(DATA_FILE)).is_ok_and(|read| read == expected)
            && self.read(&self.staying_subpath.join(SUBDIR_FILE)).is_ok_and(|read| read == subdir)
    }

    /// The CSI driver's NodeUnpublishVolume: one plain umount(2).
    fn unpublish(&self, target: &Path) {
        let path = target.to_path_buf();
        let unmounted = self.sandbox.run(move || mount::unmount(&path));
        assert!(unmounted.is_ok(), "the first plain umount of {}: {unmounted:?}", target.display());
    }

    fn pod_dir(&self, pod: &str) -> PathBuf {
        self.sandbox.kubelet_root().join("pods").join(pod)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("mount table:\n{}", self.sandbox.mountinfo());
        }
    }
}

/// The unpublish comes while the supervisor waits for the new daemon's
/// first answer, its heal planned: the deleted pod's target is unmounted
/// at the first try and its pod directory removed; the other target is
/// unmounted and its directory made again, empty. Once the daemon answers,
/// the staying pods heal, nothing is mounted on the removed path or the
/// recreated directory, no heal fails, and the state file forgets the
/// deleted pod.
#[test]
fn an_unpublish_while_the_new_daemon_is_silent_mounts_nothing_and_the_others_heal() {
    let mut node = Node::new();
    assert!(node.staying_read());
    let state_dir = node.sandbox.root().join("state");
    let supervisor = SupervisorProcess::start(&node.sandbox, Path::new(BINARY), &state_dir);
    node.supervisor = Some(supervisor.expect("supervisor"));
    node.supervisor().wait_for_log(TIMEOUT, message_is("watching the FUSE daemon")).expect("daemon watched");

    node.source.crash().expect("crash");
    node.supervisor().wait_for_log(TIMEOUT, message_is(DETACHED)).expect("the dead source is detached");
    node.source.restart_unanswered(&node.sandbox, Restart::UnmountThenMount).expect("restart, silent");
    // Planned and probing; the handles taken ahead are let go when the
    // daemon is slow to answer, long before the probe overruns its time.
    let slow = message_is("the new daemon is slow to answer: its targets' handles are let go until it does");
    node.supervisor().wait_for_log(TIMEOUT, &slow).expect("the probe waits for the silent daemon");
    // Not by the probe's time (2 s): the overrun, if it came yet, came after.
    let log = node.supervisor().log();
    let overran = log.iter().position(|line| message_is("source does not answer; its heal waits until it does")(line));
    assert!(overran.is_none_or(|overran| log[..overran].iter().any(|line| slow(line))), "{log:#?}");

    node.unpublish(&node.deleted);
    let pod_dir = node.pod_dir("deleted");
    node.sandbox.run(move || std::fs::remove_dir_all(pod_dir)).expect("the kubelet removes the pod directory");
    node.unpublish(&node.recreated);
    let dir = node.recreated.clone();
    node.sandbox
        .run(move || std::fs::remove_dir(&dir).and_then(|()| std::fs::create_dir(&dir)))
        .expect("the target directory removed and made again");
    let deleted = node.deleted.display().to_string();
    let forgotten = |line: &str| message_is("pod deleted; forgetting target")(line) && line.contains(&deleted);
    node.supervisor().wait_for_log(TIMEOUT, forgotten).expect("the deleted pod's target is forgotten");

    node.source.answer().expect("the daemon answers");
    scenario::wait_for("the staying pods read again", TIMEOUT, || node.staying_read()).unwrap();
    for path in [&node.staying, &node.staying_subpath] {
        let target = path.display().to_string();
        let healed = |line: &str| message_is("healed")(line) && line.contains(&target);
        node.supervisor().wait_for_log(TIMEOUT, healed).expect("healed");
        assert_eq!(layers_at(&node.sandbox, path), 1, "{target}");
    }

    assert!(!node.sandbox.outside_path(&node.pod_dir("deleted")).exists(), "the deleted pod's directory came back");
    assert_eq!(node.sandbox.count_mounts_under(&node.pod_dir("deleted")), 0);
    assert_eq!(node.sandbox.count_mounts_under(&node.recreated), 0, "a mount on the recreated directory");
    let failed = node.supervisor().metric(r#"fuse_supervisor_heals_total{result="failed"}"#).expect("scrape");
    assert_eq!(failed, Some(0.0));
    let complaints: Vec<String> = node
        .supervisor()
        .log()
        .into_iter()
        .filter(|line| line.contains("\"WARN\"") || line.contains("\"ERROR\""))
        .filter(|line| line.contains(&deleted) || line.contains(&node.recreated.display().to_string()))
        .collect();
    assert!(complaints.is_empty(), "nothing to retry about the unpublished targets: {complaints:#?}");
    let state_file = state_dir.join("state.json");
    scenario::wait_for("the state file forgets the deleted pod's target", TIMEOUT, || {
        let file = state_file.clone();
        let state = node.sandbox.run(move || std::fs::read_to_string(file)).unwrap_or_default();
        !state.contains(&deleted) && state.contains(&node.staying.display().to_string())
    })
    .unwrap();
}

/// The heal of a batch planned before the unpublish, as the loop hands it
/// to the executor: the removed target fails to resolve, the recreated one
/// carries a new mount that took the unmounted one's ID (the kernel reuses
/// a freed ID at once; here the plan names the new mount's ID) and is
/// refused by its device, and the staying ones heal. Nothing is mounted on
/// either.
#[test]
fn a_batch_planned_before_the_unpublish_mounts_nothing_on_the_removed_or_recreated_target() {
    let mut node = Node::new();
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).expect("restart");
    let snapshot = Snapshot::parse(node.sandbox.mountinfo().as_bytes()).expect("table");
    let classified = Classified::new(&snapshot, &Layout::new(&node.sandbox.kubelet_root()));
    let heal_of = |path: &Path, pod: &str, kind: TargetKind, root: &str| {
        let top = classified.targets[path].stack.top();
        TargetHeal {
            path: path.to_path_buf(),
            pod_uid: pod.into(),
            kind,
            root_in_source: root.into(),
            top_mount_id: top.mount_id,
            top_dev: top.dev,
            layer_ids: vec![top.mount_id],
            beneath_top: None,
        }
    };
    let mut batch = HealBatch {
        source: classified.sources[&node.source.path].clone(),
        targets: vec![
            heal_of(&node.staying, "staying", TargetKind::Volume, ""),
            heal_of(&node.deleted, "deleted", TargetKind::Volume, ""),
            heal_of(&node.recreated, "recreated", TargetKind::Volume, ""),
            heal_of(&node.staying_subpath, "staying-subpath", TargetKind::Subpath, SUBDIR),
        ],
    };

    node.unpublish(&node.deleted);
    let pod_dir = node.pod_dir("deleted");
    node.sandbox.run(move || std::fs::remove_dir_all(pod_dir)).expect("remove the pod directory");
    node.unpublish(&node.recreated);
    let dir = node.recreated.clone();
    let reused = node.sandbox.run(move || -> std::io::Result<u32> {
        std::fs::remove_dir(&dir)?;
        std::fs::create_dir(&dir)?;
        mount::mount_tmpfs(&dir)?;
        resolve::mount_id_of(std::os::fd::AsFd::as_fd(&resolve::open_path(&dir)?))
    });
    let reused = reused.expect("a tmpfs on the recreated directory");
    batch.targets[2].top_mount_id = reused;
    batch.targets[2].layer_ids = vec![reused];

    let (kubelet_root, staging, source_path) =
        (node.sandbox.kubelet_root(), node.sandbox.root().join("staging"), node.source.path.clone());
    let outcomes = node.sandbox.run(move || {
        let mut executor = MountExecutor::new(&kubelet_root, &staging, HealPriority::OFF).expect("executor");
        let root = resolve::open_path(&source_path).expect("open the source");
        let sub = resolve::open_beneath(std::os::fd::AsFd::as_fd(&root), Path::new(SUBDIR)).map_err(Into::into);
        let handles = SourceHandles { root, subdirs: [(PathBuf::from(SUBDIR), sub)].into() };
        executor.heal(&batch, Prepared::default(), &handles)
    });

    assert!(outcomes[0].result.is_ok(), "{:?}", outcomes[0]);
    assert!(outcomes[3].result.is_ok(), "{:?}", outcomes[3]);
    assert!(
        matches!(&outcomes[1].result, Err(HealError::Resolve { source, .. }) if source.kind() == std::io::ErrorKind::NotFound),
        "{:?}",
        outcomes[1]
    );
    assert!(
        matches!(&outcomes[2].result, Err(HealError::Reused { mount_id, .. }) if *mount_id == reused),
        "{:?}",
        outcomes[2]
    );
    assert!(node.staying_read());
    assert_eq!(node.sandbox.count_mounts_under(&node.pod_dir("deleted")), 0);
    let at_recreated: Vec<String> = node
        .sandbox
        .mountinfo()
        .lines()
        .filter(|line| line.split(' ').nth(4) == Some(&*node.recreated.display().to_string()))
        .map(str::to_owned)
        .collect();
    assert_eq!(at_recreated.len(), 1, "only the tmpfs at the recreated directory: {at_recreated:#?}");
    assert!(at_recreated[0].contains(" - tmpfs "), "{at_recreated:#?}");
}
