//! Flattening a batch: each new top slides beneath its stale layer, and one
//! detach per root in the source takes the stale layers of every target with
//! that root, by propagation, instead of one detach (and one RCU grace
//! period) per target. A kernel that cannot slide (before 6.5) has the
//! flatten pool detach each stale layer alone.
use std::collections::BTreeSet;
use std::path::PathBuf;

use fuse_supervisor_engine::heal::priority::HealPriority;
use fuse_supervisor_engine::heal::probe::SourceHandles;
use fuse_supervisor_engine::heal::{Executor, Healed, MountExecutor, Prepared};
use fuse_supervisor_engine::model::state::Journal;
use fuse_supervisor_engine::model::table::{Classified, Layout, Snapshot};
use fuse_supervisor_engine::plan::{learn, plan};
use fuse_supervisor_sys::resolve;
use fuse_supervisor_testbed::scenario::{DATA_FILE, Daemon, FuseSource, Restart, SUBDIR, SUBDIR_FILE, layers_at};
use fuse_supervisor_testbed::{CapturedLogs, Sandbox};

#[test]
fn one_detach_per_root_takes_every_stale_layer_of_a_batch() {
    flattens_every_target_to_one_layer(Kernel::SlidesBeneath, "slid=23 detaches=2");
}

/// Before 6.5 nothing slides: the pool takes each stale layer apart alone.
#[test]
fn without_move_mount_beneath_each_stale_layer_is_detached_alone() {
    flattens_every_target_to_one_layer(Kernel::CannotSlide, "slid=0 detaches=0");
}

enum Kernel {
    SlidesBeneath,
    CannotSlide,
}

/// 20 whole-volume and 3 subPath targets of one source, healed in one
/// batch: each ends with one layer, the mount count is back at its
/// baseline, and the flatten's debug line contains `flattened`.
fn flattens_every_target_to_one_layer(kernel: Kernel, flattened: &str) {
    let sandbox = Sandbox::new().unwrap();
    let mut source = FuseSource::start(&sandbox, Daemon::Bindfs, "data").unwrap();
    let volumes: Vec<PathBuf> =
        (0..20).map(|pod| source.bind_volume(&sandbox, &format!("pod-{pod}"), "pv").unwrap()).collect();
    let subpaths: Vec<PathBuf> =
        (0..3).map(|pod| source.bind_subpath(&sandbox, &format!("pod-sub-{pod}"), "pv").unwrap()).collect();
    let layout = Layout::new(&sandbox.kubelet_root());
    let mut journal = Journal::in_memory();
    let healthy = Snapshot::parse(sandbox.mountinfo().as_bytes()).unwrap();
    assert!(learn(&Classified::new(&healthy, &layout), &layout, &mut journal));
    let baseline = sandbox.count_mounts_under(&sandbox.kubelet_root());

    source.restart(&sandbox, Restart::UnmountThenMount).unwrap();
    let snapshot = Snapshot::parse(sandbox.mountinfo().as_bytes()).unwrap();
    let batches = plan(&Classified::new(&snapshot, &layout), &journal, &BTreeSet::new());
    assert_eq!(batches.len(), 1, "{batches:?}");
    let batch = batches.into_iter().next().unwrap();
    assert_eq!(batch.targets.len(), volumes.len() + subpaths.len());

    let log = CapturedLogs::default();
    let captured = log.clone();
    let (kubelet_root, staging, source_path) =
        (sandbox.kubelet_root(), sandbox.root().join("staging"), source.path.clone());
    // Slides and detaches happen on the thread that calls the executor.
    let outcomes = sandbox.run(move || {
        captured.capture(tracing::Level::DEBUG, || {
            let executor = MountExecutor::new(&kubelet_root, &staging, HealPriority::OFF).unwrap();
            let mut executor = match kernel {
                Kernel::SlidesBeneath => executor,
                Kernel::CannotSlide => executor.without_mount_beneath(),
            };
            let handles = SourceHandles {
                root: resolve::open_path(&source_path).unwrap(),
                subdirs: [(PathBuf::from(SUBDIR), Ok(resolve::open_path(&source_path.join(SUBDIR)).unwrap()))].into(),
            };
            executor.heal(&batch, Prepared::default(), &handles)
        })
    });

    for outcome in &outcomes {
        assert!(outcome.result.is_ok(), "{outcome:?}");
        assert!(outcome.flatten_error.is_none(), "{outcome:?}");
        assert_eq!(outcome.layers_removed, 1, "{outcome:?}");
    }
    // One stack per root; every other target was reached by propagation.
    let stacked = outcomes.iter().filter(|outcome| matches!(outcome.result, Ok(Healed::Stacked))).count();
    assert_eq!(stacked, 2, "{outcomes:?}");
    let line = log.text().lines().find(|line| line.contains("flattened")).map(str::to_owned);
    let line = line.unwrap_or_else(|| panic!("no flatten line in:\n{}", log.text()));
    assert!(line.contains(flattened), "{line}");

    for target in volumes.iter().chain(&subpaths) {
        assert_eq!(layers_at(&sandbox, target), 1, "{}", target.display());
    }
    assert_eq!(sandbox.count_mounts_under(&sandbox.kubelet_root()), baseline);
    let (volume, subpath) = (volumes[7].clone(), subpaths[2].clone());
    let (data, inner) = sandbox.run(move || {
        (std::fs::read_to_string(volume.join(DATA_FILE)), std::fs::read_to_string(subpath.join(SUBDIR_FILE)))
    });
    assert_eq!(data.unwrap(), source.expected_content());
    assert!(inner.unwrap().contains(SUBDIR), "the subPath target shows its subdirectory");
}
