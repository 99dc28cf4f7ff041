//! The executor never mounts through a path that leaves the kubelet root.
use std::os::fd::AsFd;
use std::os::unix::fs::symlink;
use std::path::Path;

use fuse_supervisor_engine::heal::priority::HealPriority;
use fuse_supervisor_engine::heal::probe::SourceHandles;
use fuse_supervisor_engine::heal::{Executor, HealError, MountExecutor, Prepared};
use fuse_supervisor_engine::model::table::{Classified, Layout, Snapshot, TargetKind};
use fuse_supervisor_engine::plan::{HealBatch, TargetHeal};
use fuse_supervisor_sys::resolve;
use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::scenario::{Daemon, FuseSource, Restart, fuse_mount_ids_at, layers_at};

#[test]
fn a_target_swapped_for_a_symlink_out_of_the_kubelet_root_is_refused() {
    let sandbox = Sandbox::new().unwrap();
    let mut source = FuseSource::start(&sandbox, Daemon::Bindfs, "data").unwrap();
    // A broken FUSE bind outside the kubelet root...
    let outside = sandbox.root().join("outside");
    sandbox.bind(&source.path, &outside.join("mount")).unwrap();
    source.restart(&sandbox, Restart::UnmountThenMount).unwrap();
    // ...and a pod volume directory swapped for a symlink to it.
    let volumes = sandbox.kubelet_root().join("pods/pod-evil/volumes/kubernetes.io~csi");
    let (link_dir, link_to) = (volumes.clone(), outside.clone());
    sandbox
        .run(move || std::fs::create_dir_all(&link_dir).and_then(|()| symlink(&link_to, link_dir.join("data"))))
        .unwrap();
    let target = volumes.join("data/mount");

    let table = sandbox.mountinfo();
    let snapshot = Snapshot::parse(table.as_bytes()).unwrap();
    let layout = Layout::new(&sandbox.kubelet_root());
    let classified = Classified::new(&snapshot, &layout);
    let stale = snapshot.fuse_mounts.iter().find(|m| m.mount_point == outside.join("mount")).unwrap().clone();
    let batch = HealBatch {
        source: classified.sources[&source.path].clone(),
        targets: vec![TargetHeal {
            path: target.clone(),
            pod_uid: "pod-evil".into(),
            kind: TargetKind::Volume,
            root_in_source: Default::default(),
            top_mount_id: stale.mount_id,
            top_dev: stale.dev,
            layer_ids: vec![stale.mount_id],
            beneath_top: None,
        }],
    };
    let (kubelet_root, staging, source_path) =
        (sandbox.kubelet_root(), sandbox.root().join("staging"), source.path.clone());
    let outcomes = sandbox.run(move || {
        let mut executor = MountExecutor::new(&kubelet_root, &staging, HealPriority::OFF).unwrap();
        let root = resolve::open_path(&source_path).unwrap();
        assert!(resolve::mount_id_of(root.as_fd()).is_ok());
        let handles = SourceHandles { root, subdirs: Default::default() };
        executor.heal(&batch, Prepared::default(), &handles)
    });

    assert_eq!(outcomes.len(), 1);
    assert!(
        matches!(&outcomes[0].result, Err(HealError::Resolve { path, .. }) if *path == target),
        "{:?}",
        outcomes[0].result
    );
    assert_eq!(layers_at(&sandbox, &outside.join("mount")), 1, "something was mounted outside the kubelet root");
    let after = Snapshot::parse(sandbox.mountinfo().as_bytes()).unwrap();
    assert_eq!(after.fuse_mounts, snapshot.fuse_mounts, "the FUSE mounts changed");
}

/// A target whose top changed during a batch counts as healed by
/// propagation only if the new top is on the source's device. Here the stack
/// on the first target carries another FUSE filesystem (handles the test
/// mixes up on purpose), which propagates onto its peer: the peer is
/// reported changed under the heal, and its layers are left alone. Peers
/// receive a stack's copies where the kernel cannot slide a mount beneath
/// another (elsewhere every target but the first has a clone of its own slid
/// in beneath, out of the group), so the executor is told it cannot.
#[test]
fn a_peer_covered_by_a_mount_of_another_device_is_not_reported_propagated() {
    let sandbox = Sandbox::new().unwrap();
    let mut source = FuseSource::start(&sandbox, Daemon::DemoFs, "data").unwrap();
    let other = FuseSource::start(&sandbox, Daemon::DemoFs, "other").unwrap();
    let first = source.bind_volume(&sandbox, "pod-a", "pv").unwrap();
    let peer = source.bind_volume(&sandbox, "pod-b", "pv").unwrap();
    source.restart(&sandbox, Restart::UnmountThenMount).unwrap();

    let snapshot = Snapshot::parse(sandbox.mountinfo().as_bytes()).unwrap();
    let classified = Classified::new(&snapshot, &Layout::new(&sandbox.kubelet_root()));
    let heal_of = |path: &Path, pod: &str| {
        let top = classified.targets[path].stack.top();
        TargetHeal {
            path: path.to_path_buf(),
            pod_uid: pod.into(),
            kind: TargetKind::Volume,
            root_in_source: Default::default(),
            top_mount_id: top.mount_id,
            top_dev: top.dev,
            layer_ids: vec![top.mount_id],
            beneath_top: None,
        }
    };
    let batch = HealBatch {
        source: classified.sources[&source.path].clone(),
        targets: vec![heal_of(&first, "pod-a"), heal_of(&peer, "pod-b")],
    };
    let stale_peer = batch.targets[1].top_mount_id;
    let (kubelet_root, staging, other_path) =
        (sandbox.kubelet_root(), sandbox.root().join("staging"), other.path.clone());
    let outcomes = sandbox.run(move || {
        let mut executor =
            MountExecutor::new(&kubelet_root, &staging, HealPriority::OFF).unwrap().without_mount_beneath();
        let handles = SourceHandles { root: resolve::open_path(&other_path).unwrap(), subdirs: Default::default() };
        executor.heal(&batch, Prepared::default(), &handles)
    });

    assert!(outcomes[0].result.is_ok(), "{:?}", outcomes[0].result);
    assert!(
        matches!(&outcomes[1].result, Err(HealError::Changed { path, planned, .. }) if *path == peer && *planned == stale_peer),
        "{:?}",
        outcomes[1].result
    );
    assert_eq!(outcomes[1].layers_removed, 0);
    let at_peer = fuse_mount_ids_at(&sandbox, &peer);
    assert_eq!(at_peer.len(), 2, "the peer keeps its stale layer under the foreign copy");
    assert!(at_peer.contains(&stale_peer));
}
