//! An application container restarted after several heals, as the kubelet
//! restarts one: the old container goes, the kubelet prepares its subPaths
//! again (`testbed::subpath`, by the kubelet's own system calls) and the
//! runtime binds the host's target into a new container (runc, as in
//! `tests/containers.rs`). After K crash/heal cycles under `fuse-supervisor
//! run`, the new container reads the live data from its first read and
//! holds one layer, the subPath's preparation keeps the healed bind, and a
//! container of the pod that had not run before gets its subPath bound from
//! the healed volume. Needs root and /dev/fuse.
use std::path::{Path, PathBuf};
use std::time::Duration;

use fuse_supervisor_engine::errors::error_chain;
use fuse_supervisor_engine::model::table::{Dev, Snapshot};
use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::runc::{self, Runc, RuncContainer, RuncSpec, VolumePropagation};
use fuse_supervisor_testbed::scenario::{
    self, DATA_FILE, Daemon, FuseSource, Restart, SUBDIR, SUBDIR_FILE, SupervisorProcess,
};
use fuse_supervisor_testbed::subpath::{self, SubpathPrepared};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const HEAL_TIMEOUT: Duration = Duration::from_secs(20);
const READ_INTERVAL: Duration = Duration::from_millis(10);
/// Crash/heal cycles before the restart.
const HEALS: usize = 3;
const VOLUME: &str = "data";

/// A pod's container and where its volume comes from on the host.
struct App {
    container: RuncContainer,
    /// What the container mounts: the pod's target, or its subPath's.
    host_path: PathBuf,
    /// The pod's volume, for a subPath container.
    volume: Option<PathBuf>,
    propagation: VolumePropagation,
}

struct Node {
    // Declared first: containers and the supervisor go before the sandbox.
    apps: Vec<App>,
    supervisor: Option<SupervisorProcess>,
    source: FuseSource,
    runc: Runc,
    restart: Restart,
    sandbox: Sandbox,
}

impl Node {
    fn new(daemon: Daemon, restart: Restart) -> Node {
        let sandbox = Sandbox::new().expect("sandbox");
        let source = FuseSource::start(&sandbox, daemon, "shared-data").expect("start daemon");
        let runc = Runc::new(&sandbox).expect("runc image");
        Node { apps: Vec::new(), supervisor: None, source, runc, restart, sandbox }
    }

    /// A pod whose container mounts its whole volume.
    fn add_volume_app(&mut self, pod: &str, propagation: VolumePropagation) {
        let target = self.source.bind_volume(&self.sandbox, pod, VOLUME).expect("bind volume");
        let container = self.start(pod, &target, propagation, DATA_FILE);
        self.apps.push(App { container, host_path: target, volume: None, propagation });
    }

    /// A pod whose container mounts the volume's subdirectory: the CSI
    /// driver publishes the volume, the kubelet prepares the subPath from it.
    fn add_subpath_app(&mut self, pod: &str, propagation: VolumePropagation) {
        let volume = self.source.bind_volume(&self.sandbox, pod, VOLUME).expect("bind volume");
        let target = self.sandbox.subpath_dir(pod, VOLUME, "app", 0);
        assert_eq!(self.prepare_subpath(&volume, &target), Ok(SubpathPrepared::Bound));
        let container = self.start(pod, &target, propagation, SUBDIR_FILE);
        self.apps.push(App { container, host_path: target, volume: Some(volume), propagation });
    }

    /// The kubelet's subPath preparation, run in the sandbox; its error as text.
    fn prepare_subpath(&self, volume: &Path, target: &Path) -> Result<SubpathPrepared, String> {
        let (volume, target) = (volume.to_path_buf(), target.to_path_buf());
        self.sandbox.run(move || subpath::prepare(&volume, Path::new(SUBDIR), &target).map_err(|err| error_chain(&err)))
    }

    /// Starts a container; once the supervisor runs, returns when it has
    /// learnt the container's namespace, as a container running for more
    /// than a moment is (a crash right after the start would otherwise
    /// test the limit of a namespace learnt during the outage).
    fn start(&self, name: &str, volume: &Path, propagation: VolumePropagation, read: &str) -> RuncContainer {
        let spec = RuncSpec::reader(name, volume, propagation, read, READ_INTERVAL);
        let container = self.runc.start(&spec).unwrap_or_else(|err| panic!("start container {name}: {err}"));
        if let Some(supervisor) = &self.supervisor {
            supervisor.wait_namespace_learnt(container.pid(), HEAL_TIMEOUT).unwrap();
        }
        container
    }

    fn expected(&self, app: &App) -> String {
        match app.volume {
            Some(_) => format!("inside shared-data/{SUBDIR}"),
            None => self.source.expected_content(),
        }
    }

    fn all_read(&self, cycle: usize) {
        for app in &self.apps {
            let expected = self.expected(app);
            app.container.wait_until(HEAL_TIMEOUT, |seen| seen.content() == Some(expected.as_str())).unwrap_or_else(
                |err| panic!("cycle {cycle}: container {} does not read {expected:?}: {err}", app.container.name()),
            );
        }
    }

    fn all_fail(&self, cycle: usize) {
        for app in &self.apps {
            app.container.wait_until(HEAL_TIMEOUT, |seen| seen.error().is_some()).unwrap_or_else(|err| {
                panic!("cycle {cycle}: container {} does not see the crash: {err}", app.container.name())
            });
        }
    }

    fn supervisor(&self) -> &SupervisorProcess {
        self.supervisor.as_ref().expect("supervisor running")
    }

    /// Crashes the daemon and brings it back, once the supervisor watches
    /// it; a restart over the stale mount waits for the death to be seen (a
    /// layer it covers before has no handle: see `tests/containers.rs`).
    fn crash_and_heal(&mut self, cycle: usize) {
        let pid = self.source.pid().expect("daemon running");
        let watched = format!("[{pid}]");
        let watching = |line: &str| line.contains("\"watching the FUSE daemon\"") && line.contains(&watched);
        self.supervisor().wait_for_log(HEAL_TIMEOUT, watching).unwrap();
        self.source.crash().expect("crash the daemon");
        self.all_fail(cycle);
        // Meanwhile the kubelet could not prepare a subPath: its open of
        // the volume reaches the dead daemon.
        for app in &self.apps {
            let Some(volume) = &app.volume else { continue };
            let prepared = self.prepare_subpath(volume, &app.host_path);
            assert!(
                prepared.as_ref().is_err_and(|err| err.contains("not connected")),
                "cycle {cycle}: {}: {prepared:?}",
                app.container.name()
            );
        }
        if self.restart == Restart::MountOverStale {
            let pid = format!("\"pid\":{pid},");
            let died = |line: &str| line.contains("\"daemon died; its targets are degraded\"") && line.contains(&pid);
            self.supervisor().wait_for_log(HEAL_TIMEOUT, died).unwrap();
            // The agent detaches the dead source milliseconds after the
            // death; a mount over it made in that instant fails with ENOENT
            // (docs/limits.md). The daemon starts once it is done, as a
            // restarted pod would, on the directory or over the stale mount.
            let detached = |line: &String| line.contains("\"dead source detached");
            scenario::wait_for("the dead source detached", HEAL_TIMEOUT, || {
                self.supervisor().log().iter().filter(|line| detached(line)).count() >= cycle
            })
            .unwrap();
        }
        self.source.restart(&self.sandbox, self.restart).expect("restart the daemon");
        self.all_read(cycle);
    }

    /// The connection of the source's current mount (the top one: a restart
    /// over the stale mount leaves the dead one under it).
    fn live_connection(&self) -> Dev {
        let snapshot = Snapshot::parse(self.sandbox.mountinfo().as_bytes()).expect("the sandbox's table");
        let mut at_source = snapshot.fuse_mounts.iter().filter(|mount| mount.mount_point == self.source.path);
        at_source.next_back().map(|mount| mount.dev).expect("the source is mounted")
    }

    /// On the host: one mount at `path`, on the live connection, and nothing
    /// mounted below it that a new container's `rbind` would take along.
    fn one_live_layer_on_host(&self, path: &Path) {
        let live = self.live_connection();
        scenario::wait_for("one live layer at the target", HEAL_TIMEOUT, || {
            let snapshot = Snapshot::parse(self.sandbox.mountinfo().as_bytes()).expect("the sandbox's table");
            let layers: Vec<Dev> =
                snapshot.fuse_mounts.iter().filter(|mount| mount.mount_point == path).map(|mount| mount.dev).collect();
            layers == [live] && self.sandbox.count_mounts_under(path) == 1
        })
        .unwrap_or_else(|err| panic!("{}: {err}:\n{}", path.display(), self.sandbox.mountinfo()));
    }

    /// The kubelet restarts every container: the old one exits, its
    /// subPath is prepared again, a new one binds the host's path.
    fn restart_containers(&mut self) {
        for app in std::mem::take(&mut self.apps) {
            let App { container, host_path, volume, propagation } = app;
            let (name, read) = (container.name().to_owned(), if volume.is_some() { SUBDIR_FILE } else { DATA_FILE });
            drop(container);
            if let Some(volume) = &volume {
                assert_eq!(
                    self.prepare_subpath(volume, &host_path),
                    Ok(SubpathPrepared::AlreadyMounted),
                    "{name}: the healed subPath bind is kept"
                );
            }
            let container = self.start(&name, &host_path, propagation, read);
            self.apps.push(App { container, host_path, volume, propagation });
        }
    }

    /// Every container read the live data from its first read on, holds
    /// one layer at its volume, on the live connection, with nothing below.
    fn new_containers_read_at_once(&self) {
        let live = self.live_connection().to_string();
        for app in &self.apps {
            let name = app.container.name();
            let expected = self.expected(app);
            let first = app.container.history().into_iter().next().expect("started once it read");
            assert_eq!(first.content(), Some(expected.as_str()), "{name}:\n{}", app.container.describe_history());
            let mounts = app.container.mounts().expect("the container's mount table");
            let volume = Path::new(fuse_supervisor_testbed::runc::VOLUME_IN_CONTAINER);
            let at_or_below: Vec<_> = mounts.iter().filter(|mount| mount.mount_point.starts_with(volume)).collect();
            assert_eq!(at_or_below.len(), 1, "{name}: {at_or_below:?}");
            assert_eq!(at_or_below[0].device, live, "{name}: not on the live connection: {at_or_below:?}");
            let slave = at_or_below[0].propagation.contains("master:");
            assert_eq!(slave, app.propagation == VolumePropagation::HostToContainer, "{name}: {at_or_below:?}");
            self.one_live_layer_on_host(&app.host_path);
            if let Some(volume) = &app.volume {
                self.one_live_layer_on_host(volume);
            }
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if std::thread::panicking() {
            runc::print_failure(&self.sandbox, self.apps.iter().map(|app| &app.container));
        }
    }
}

/// Whole volumes and subPaths, `HostToContainer` and `None`, on one source:
/// [`HEALS`] crash/heal cycles with the containers running, then each is
/// restarted as the kubelet restarts one, and a container of a subPath pod
/// that had not run before starts too.
fn containers_restarted_after_heals(daemon: Daemon, restart: Restart) {
    let mut node = Node::new(daemon, restart);
    node.add_volume_app("whole-host-to-container", VolumePropagation::HostToContainer);
    node.add_volume_app("whole-none", VolumePropagation::None);
    node.add_subpath_app("subpath-host-to-container", VolumePropagation::HostToContainer);
    node.add_subpath_app("subpath-none", VolumePropagation::None);
    node.all_read(0);
    let state_dir = node.sandbox.root().join("state");
    let supervisor = SupervisorProcess::start(&node.sandbox, Path::new(BINARY), &state_dir).expect("supervisor");
    node.supervisor = Some(supervisor);

    for cycle in 1..=HEALS {
        node.crash_and_heal(cycle);
    }
    node.restart_containers();
    node.new_containers_read_at_once();

    // A container of the pod that had not run before (its own
    // volume-subpaths directory): the kubelet opens the subPath through the
    // healed volume and binds it by its descriptor.
    let pod = "subpath-none";
    let volume = node.sandbox.pod_volume_dir(pod, VOLUME);
    let fresh = node.sandbox.subpath_dir(pod, VOLUME, "late", 0);
    assert_eq!(node.prepare_subpath(&volume, &fresh), Ok(SubpathPrepared::Bound));
    let container = node.start("late", &fresh, VolumePropagation::None, SUBDIR_FILE);
    node.apps.push(App { container, host_path: fresh, volume: Some(volume), propagation: VolumePropagation::None });
    node.new_containers_read_at_once();

    // And the heal after the restart reaches the new containers.
    node.crash_and_heal(HEALS + 1);
    let healed = |line: &str| line.contains("\"container healed\"");
    scenario::wait_for("the new containers healed in their namespaces", HEAL_TIMEOUT, || {
        node.supervisor().log().iter().filter(|line| healed(line)).count() == (HEALS + 1) * 4 + 1
    })
    .unwrap_or_else(|err| {
        panic!("{err}: {} heals logged", node.supervisor().log().iter().filter(|l| healed(l)).count())
    });
    for app in &node.apps {
        let layers = app.container.volume_mounts().expect("the container's mount table");
        assert_eq!(layers.len(), 1, "{}: {layers:?}", app.container.name());
        node.one_live_layer_on_host(&app.host_path);
    }
}

#[test]
fn containers_restarted_after_bindfs_heals_read_at_once_with_one_layer() {
    containers_restarted_after_heals(Daemon::Bindfs, Restart::UnmountThenMount);
}

#[test]
fn containers_restarted_after_demofs_mounted_over_its_stale_mount_read_at_once_with_one_layer() {
    containers_restarted_after_heals(Daemon::DemoFs, Restart::MountOverStale);
}
