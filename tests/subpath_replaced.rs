//! A subPath whose directory left its filesystem's tree after it was bound
//! (removed from the volume, or its FUSE dentry invalidated by a lookup):
//! the bind stays, rooted at `/sub//deleted`, and the kernel mounts nothing
//! on such a root (ENOENT). The heal then slides the new source beneath the
//! stale bind and detaches it: one layer, the volume's directory of now.
//! Needs root and /dev/fuse.
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use fuse_supervisor_engine::heal::priority::HealPriority;
use fuse_supervisor_engine::heal::probe::SourceHandles;
use fuse_supervisor_engine::heal::{Executor, Healed, MountExecutor, Prepared};
use fuse_supervisor_engine::model::table::{Classified, Dev, Layout, Snapshot, TargetKind};
use fuse_supervisor_engine::plan::{HealBatch, TargetHeal};
use fuse_supervisor_sys::{mount, resolve};
use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::scenario::{Daemon, FuseSource, SUBDIR, SUBDIR_FILE};

#[test]
fn a_subpath_bound_to_a_removed_directory_is_healed_beneath_its_stale_bind() {
    let sandbox = Sandbox::new().expect("sandbox");
    let source = FuseSource::start(&sandbox, Daemon::DemoFs, "data").expect("demofs");
    // The stale bind: of a directory removed since (a tmpfs stands for the
    // dead connection; the executor checks mount ID and device, not type).
    let old = sandbox.root().join("runtime/old");
    let target = sandbox.subpath_dir("pod", "data", "app", 0);
    let (at, bound) = (old.clone(), target.clone());
    let stale = sandbox.run(move || -> std::io::Result<(u32, Dev)> {
        std::fs::create_dir_all(&at)?;
        mount::mount_tmpfs(&at)?;
        std::fs::create_dir(at.join(SUBDIR))?;
        std::fs::create_dir_all(&bound)?;
        mount::bind(&at.join(SUBDIR), &bound)?;
        std::fs::remove_dir(at.join(SUBDIR))?;
        let (id, dev) = resolve::mount_and_device_of(resolve::open_path(&bound)?.as_fd())?;
        Ok((id, Dev::from(dev.unwrap_or_default())))
    });
    let (stale_id, stale_dev) = stale.expect("a bind of a removed directory");
    let root_of = |table: &str| {
        let target = target.display().to_string();
        let at_target = table.lines().filter(|line| line.split(' ').nth(4) == Some(&*target));
        at_target.map(|line| line.split(' ').nth(3).unwrap_or("").to_owned()).collect::<Vec<_>>()
    };
    assert_eq!(root_of(&sandbox.mountinfo()), ["/sub//deleted"]);

    let snapshot = Snapshot::parse(sandbox.mountinfo().as_bytes()).expect("table");
    let classified = Classified::new(&snapshot, &Layout::new(&sandbox.kubelet_root()));
    let batch = HealBatch {
        source: classified.sources[&source.path].clone(),
        targets: vec![TargetHeal {
            path: target.clone(),
            pod_uid: "pod".into(),
            kind: TargetKind::Subpath,
            root_in_source: SUBDIR.into(),
            top_mount_id: stale_id,
            top_dev: stale_dev,
            layer_ids: vec![stale_id],
            beneath_top: None,
        }],
    };
    let (kubelet_root, staging, source_path) =
        (sandbox.kubelet_root(), sandbox.root().join("staging"), source.path.clone());
    let outcomes = sandbox.run(move || {
        let mut executor = MountExecutor::new(&kubelet_root, &staging, HealPriority::OFF).expect("executor");
        let root = resolve::open_path(&source_path).expect("open the source");
        let sub = resolve::open_beneath(root.as_fd(), Path::new(SUBDIR)).map_err(Into::into);
        let handles = SourceHandles { root, subdirs: [(PathBuf::from(SUBDIR), sub)].into() };
        executor.heal(&batch, Prepared::default(), &handles)
    });

    assert!(matches!(outcomes[0].result, Ok(Healed::Stacked)), "{:?}", outcomes[0]);
    assert!(outcomes[0].flatten_error.is_none(), "{:?}", outcomes[0]);
    assert_eq!(outcomes[0].layers_removed, 1);
    let table = sandbox.mountinfo();
    assert_eq!(root_of(&table), ["/sub"], "one layer, the new source's subdirectory:\n{table}");
    let inner = target.join(SUBDIR_FILE);
    let read = sandbox.run(move || std::fs::read_to_string(inner));
    assert_eq!(read.ok().as_deref(), Some(format!("inside data/{SUBDIR}").as_str()));
}
