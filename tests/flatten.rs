//! Flattening a batch: each new top slides beneath its stale layer, and one
//! detach per root in the source takes the stale layers of every target with
//! that root, by propagation, instead of one detach (and one RCU grace
//! period) per target. A kernel that cannot slide (before 6.5) has the
//! flatten pool detach each stale layer alone.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fuse_supervisor_engine::heal::priority::HealPriority;
use fuse_supervisor_engine::heal::probe::SourceHandles;
use fuse_supervisor_engine::heal::{Executor, Healed, MountExecutor, Prepared, TargetOutcome};
use fuse_supervisor_engine::model::state::Journal;
use fuse_supervisor_engine::model::table::{Classified, Layout, Snapshot};
use fuse_supervisor_engine::plan::{learn, plan};
use fuse_supervisor_sys::resolve;
use fuse_supervisor_testbed::scenario::{DATA_FILE, Daemon, FuseSource, Restart, SUBDIR, SUBDIR_FILE, layers_at};
use fuse_supervisor_testbed::{CapturedLogs, ContainerReader, Observation, Sandbox};

const TIMEOUT: Duration = Duration::from_secs(10);

#[test]
fn one_detach_per_root_takes_every_stale_layer_of_a_batch() {
    flattens_every_target_to_one_layer(Kernel::SlidesBeneath, "slid=23 slid_in=21 detaches=2");
}

/// Before 6.5 nothing slides: the pool takes each stale layer apart alone.
#[test]
fn without_move_mount_beneath_each_stale_layer_is_detached_alone() {
    flattens_every_target_to_one_layer(Kernel::CannotSlide, "slid=0 slid_in=0 detaches=0");
}

#[derive(Clone, Copy)]
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
    let (volumes, subpaths) = bind_pods(&sandbox, &source, 20, 3);
    let baseline = sandbox.count_mounts_under(&sandbox.kubelet_root());
    let log = CapturedLogs::default();
    let outcomes = restart_and_heal_in_one_batch(&sandbox, &mut source, kernel, &log);
    assert_eq!(outcomes.len(), volumes.len() + subpaths.len());

    for outcome in &outcomes {
        assert!(outcome.result.is_ok(), "{outcome:?}");
        assert!(outcome.flatten_error.is_none(), "{outcome:?}");
        assert_eq!(outcome.layers_removed, 1, "{outcome:?}");
    }
    // One stack per root. Every other target had a clone slid in beneath
    // its stale layer, which counts as its own stack; where nothing slides,
    // the stacks' propagation reached them.
    let stacked = outcomes.iter().filter(|outcome| matches!(outcome.result, Ok(Healed::Stacked))).count();
    let expected = match kernel {
        Kernel::SlidesBeneath => outcomes.len(),
        Kernel::CannotSlide => 2,
    };
    assert_eq!(stacked, expected, "{outcomes:?}");
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

/// Binds `source` into `volumes` pods' whole-volume targets and `subpaths`
/// pods' subPath targets, and returns the two lists.
fn bind_pods(sandbox: &Sandbox, source: &FuseSource, volumes: usize, subpaths: usize) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let volumes = (0..volumes).map(|pod| source.bind_volume(sandbox, &format!("pod-{pod}"), "pv").unwrap()).collect();
    let subpaths =
        (0..subpaths).map(|pod| source.bind_subpath(sandbox, &format!("pod-sub-{pod}"), "pv").unwrap()).collect();
    (volumes, subpaths)
}

/// Learns `source`'s targets, restarts its daemon, plans, and heals the one
/// batch with the executor alone (no container is isolated or healed),
/// capturing its debug lines in `log`.
fn restart_and_heal_in_one_batch(
    sandbox: &Sandbox,
    source: &mut FuseSource,
    kernel: Kernel,
    log: &CapturedLogs,
) -> Vec<TargetOutcome> {
    let layout = Layout::new(&sandbox.kubelet_root());
    let mut journal = Journal::in_memory();
    let healthy = Snapshot::parse(sandbox.mountinfo().as_bytes()).unwrap();
    assert!(learn(&Classified::new(&healthy, &layout), &layout, &mut journal));

    source.restart(sandbox, Restart::UnmountThenMount).unwrap();
    let snapshot = Snapshot::parse(sandbox.mountinfo().as_bytes()).unwrap();
    let batches = plan(&Classified::new(&snapshot, &layout), &journal, &BTreeSet::new());
    assert_eq!(batches.len(), 1, "{batches:?}");
    let batch = batches.into_iter().next().unwrap();

    let captured = log.clone();
    let (kubelet_root, staging, source_path) =
        (sandbox.kubelet_root(), sandbox.root().join("staging"), source.path.clone());
    // Slides and detaches happen on the thread that calls the executor.
    sandbox.run(move || {
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
    })
}

/// Containers whose copies nobody isolated (namespaces the heal never
/// learnt of) still get the new source: the first target on each root is
/// stacked onto, and its stack propagates to every slave of the group,
/// those of the targets slid in directly too (taken out of the group, each
/// handed its slaves to a peer).
#[test]
fn containers_nobody_isolated_read_again_through_the_first_stack_on_their_root() {
    for kernel in [Kernel::SlidesBeneath, Kernel::CannotSlide] {
        let sandbox = Sandbox::new().unwrap();
        let mut source = FuseSource::start(&sandbox, Daemon::Bindfs, "data").unwrap();
        let (volumes, subpaths) = bind_pods(&sandbox, &source, 4, 3);
        let readers = [
            ContainerReader::spawn(&sandbox, "volume", &volumes[2], Path::new(DATA_FILE)).unwrap(),
            ContainerReader::spawn(&sandbox, "subpath", &subpaths[1], Path::new(SUBDIR_FILE)).unwrap(),
        ];
        for reader in &readers {
            reader.wait_until(TIMEOUT, |seen| seen.content().is_some()).unwrap();
        }
        let log = CapturedLogs::default();
        let outcomes = restart_and_heal_in_one_batch(&sandbox, &mut source, kernel, &log);
        assert!(outcomes.iter().all(|outcome| outcome.result.is_ok()), "{outcomes:?}");
        let healed = |seen: &Observation| seen.content() == Some(&*source.expected_content());
        readers[0].wait_until(TIMEOUT, healed).unwrap();
        readers[1].wait_until(TIMEOUT, |seen| seen.content().is_some_and(|inner| inner.contains(SUBDIR))).unwrap();
    }
}
