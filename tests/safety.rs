//! The executor never mounts through a path that leaves the kubelet root.
use std::os::fd::AsFd;
use std::os::unix::fs::symlink;
use std::path::Path;

use fuse_supervisor::heal::{Executor, HealError, MountExecutor};
use fuse_supervisor::plan::{HealBatch, TargetHeal};
use fuse_supervisor::probe::SourceHandles;
use fuse_supervisor::table::{Classified, Layout, Snapshot, TargetKind};
use fuse_supervisor::testbed::Sandbox;
use fuse_supervisor::testbed::scenario::{Daemon, FuseSource, Restart, layers_at};
use fuse_supervisor_sys::resolve;

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");

#[test]
fn a_target_swapped_for_a_symlink_out_of_the_kubelet_root_is_refused() {
    let sandbox = Sandbox::new().unwrap();
    let mut source = FuseSource::start(&sandbox, Path::new(BINARY), Daemon::Bindfs, "data").unwrap();
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
            layer_ids: vec![stale.mount_id],
        }],
    };
    let (kubelet_root, staging, source_path) =
        (sandbox.kubelet_root(), sandbox.root().join("staging"), source.path.clone());
    let outcomes = sandbox.run(move || {
        let mut executor = MountExecutor::new(&kubelet_root, &staging).unwrap();
        let root = resolve::open_path(&source_path).unwrap();
        assert!(resolve::mount_id_of(root.as_fd()).is_ok());
        let handles = SourceHandles { root, subdirs: Default::default() };
        executor.heal(&batch, &handles)
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
