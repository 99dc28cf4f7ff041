//! The top tier of the heal tests: real OCI containers (Debian's `runc`, a
//! static busybox root filesystem) with a pod's target bind-mounted as
//! kubelet and containerd mount a volume, `["rbind","rslave"]` for
//! `mountPropagation: HostToContainer` and `["rbind","rprivate"]` for the
//! default (None), whole volumes and subPaths, while a real FUSE daemon
//! crashes and comes back under `fuse-supervisor run`. Every heal is judged
//! from inside the containers: each reads again, and each container's mount
//! table, the host's and the kernel's list of FUSE connections are back to
//! what they were before the first crash. Needs root and /dev/fuse.
use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::runc::{self, Runc, RuncContainer, RuncSpec, VolumePropagation};
use fuse_supervisor_testbed::scenario::{
    self, DATA_FILE, Daemon, FuseSource, Restart, SUBDIR, SUBDIR_FILE, SupervisorProcess,
};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const HEAL_TIMEOUT: Duration = Duration::from_secs(20);
const READ_INTERVAL: Duration = Duration::from_millis(10);

/// A container and what it must read whenever its volume is healthy.
struct Watched {
    container: RuncContainer,
    /// The file's content, or `None` for "the data file of the current generation".
    fixed_content: Option<String>,
    /// The entries of its volume: the source's root, or only its subdirectory.
    entries: Vec<String>,
    /// Its mount table before the first crash: (mount point, fs type) counted.
    baseline: BTreeMap<(PathBuf, String), usize>,
    /// HostToContainer: its volume is a slave of the host's mount.
    receives_host_mounts: bool,
    /// What its pod asked of the volume, which every heal must keep.
    asked: Asked,
}

/// What a pod asked of a container's volume besides its propagation.
#[derive(Debug, Clone, Default)]
struct Asked {
    /// Options on the volume's bind (`ro` for `readOnly`), each of which
    /// its mount must show after every heal.
    options: &'static [&'static str],
    /// A container whose volume is read-only, by its own options or its
    /// target's: a write fails with EROFS.
    read_only: bool,
    /// A tmpfs of its own at [`NESTED`] in the volume (a configMap's
    /// place), with [`NESTED_FILE`] written in it.
    nested: bool,
}

/// Where a volume nests another mount, and what is written in it.
const NESTED: &str = "config";
const NESTED_FILE: &str = "nested.txt";
const NESTED_CONTENT: &str = "nested";

fn nested_file() -> PathBuf {
    Path::new(runc::VOLUME_IN_CONTAINER).join(NESTED).join(NESTED_FILE)
}

struct Node {
    // Declared first: containers and the supervisor go before the sandbox.
    containers: Vec<Watched>,
    supervisor: Option<SupervisorProcess>,
    source: FuseSource,
    runc: Runc,
    fusectl: PathBuf,
    restart: Restart,
    sandbox: Sandbox,
}

fn table_of(container: &RuncContainer) -> BTreeMap<(PathBuf, String), usize> {
    let mut table = BTreeMap::new();
    for mount in container.mounts().expect("the container's mount table") {
        *table.entry((mount.mount_point, mount.fs_type)).or_insert(0) += 1;
    }
    table
}

impl Node {
    fn new(daemon: Daemon, restart: Restart) -> Node {
        let sandbox = Sandbox::new().expect("sandbox");
        let source = FuseSource::start(&sandbox, daemon, "shared-data").expect("start daemon");
        let runc = Runc::new(&sandbox).expect("runc image");
        let fusectl = sandbox.root().join("fusectl");
        let at = fusectl.clone();
        sandbox
            .run(move || std::fs::create_dir_all(&at).and_then(|()| fuse_supervisor_sys::mount::mount_fusectl(&at)))
            .expect("mount fusectl in the sandbox");
        Node { containers: Vec::new(), supervisor: None, source, runc, fusectl, restart, sandbox }
    }

    /// A pod whose volume (its whole target) a container mounts with `propagation`.
    fn add_volume_container(&mut self, name: &str, propagation: VolumePropagation) {
        let target = self.source.bind_volume(&self.sandbox, name, "data").expect("bind volume");
        self.add_container(name, target, propagation, DATA_FILE, None, &[DATA_FILE, SUBDIR]);
    }

    /// A pod whose container mounts the source's subdirectory (a subPath).
    fn add_subpath_container(&mut self, name: &str, propagation: VolumePropagation) {
        let target = self.source.bind_subpath(&self.sandbox, name, "data").expect("bind subpath");
        let inner = format!("inside shared-data/{SUBDIR}");
        self.add_container(name, target, propagation, SUBDIR_FILE, Some(inner), &[SUBDIR_FILE]);
    }

    fn add_container(
        &mut self,
        name: &str,
        volume: PathBuf,
        propagation: VolumePropagation,
        read: &str,
        fixed_content: Option<String>,
        entries: &[&str],
    ) {
        self.add_container_with(name, volume, propagation, read, fixed_content, entries, Asked::default());
    }

    /// [`Node::add_container`] with what the pod asked of its volume.
    #[allow(clippy::too_many_arguments)]
    fn add_container_with(
        &mut self,
        name: &str,
        volume: PathBuf,
        propagation: VolumePropagation,
        read: &str,
        fixed_content: Option<String>,
        entries: &[&str],
        asked: Asked,
    ) {
        let spec = RuncSpec {
            options: asked.options.iter().map(|option| (*option).to_owned()).collect(),
            nested_tmpfs: asked.nested.then(|| PathBuf::from(NESTED)),
            ..RuncSpec::reader(name, volume, propagation, read, READ_INTERVAL)
        };
        let container = self.runc.start(&spec).unwrap_or_else(|err| panic!("start container {name}: {err}"));
        let baseline = table_of(&container);
        let entries = entries.iter().map(|entry| (*entry).to_owned()).collect();
        let receives_host_mounts = propagation == VolumePropagation::HostToContainer;
        if asked.nested {
            let write = format!("echo {NESTED_CONTENT} > {}", nested_file().display());
            container.exec(&["sh", "-c", &write]).expect("write into the nested tmpfs");
        }
        self.containers.push(Watched { container, fixed_content, entries, baseline, receives_host_mounts, asked });
    }

    /// Started, and its first walk of the node's mount namespaces done:
    /// from then on no search walks `/proc`.
    fn start_supervisor(&mut self) {
        let state_dir = self.sandbox.root().join("state");
        let supervisor =
            SupervisorProcess::start_with(&self.sandbox, Path::new(BINARY), &state_dir, ["--kubelet", "none"]);
        let supervisor = supervisor.expect("supervisor");
        let walked = |line: &str| line.contains("\"mount namespaces walked\"");
        supervisor.wait_for_log(HEAL_TIMEOUT, walked).unwrap();
        self.supervisor = Some(supervisor);
    }

    /// The supervisor watches the current daemon: its death will be seen
    /// (and the containers' dead mounts isolated) before the new mount.
    fn daemon_watched(&self) {
        let pid = self.source.pid().expect("daemon running");
        self.supervisor.as_ref().expect("supervisor running").wait_watching_daemon(pid, HEAL_TIMEOUT).unwrap();
    }

    /// The supervisor has isolated the containers' dead mounts `count`
    /// times (once per death it saw before the new mount).
    fn isolated(&self, count: usize) {
        let supervisor = self.supervisor.as_ref().expect("supervisor running");
        let isolated = |line: &String| line.contains("\"containers' dead mounts isolated\"");
        scenario::wait_for("the containers isolated at the death", HEAL_TIMEOUT, || {
            supervisor.log().iter().filter(|line| isolated(line)).count() >= count
        })
        .unwrap();
    }

    /// The supervisor has seen the death of daemon `pid`, and detached its
    /// dead mount from the source path (the `cycle`th time) (`--detach-dead-sources`, milliseconds later, once nobody holds
    /// the connection). A restart that mounts over the stale mount covers
    /// every copy it propagates to, the host's targets and a
    /// HostToContainer container's volume: a layer covered before the
    /// death is seen has no handle and no path left to remove it by (a
    /// limit in docs/limits.md), so such a restart must come after (on a loaded
    /// machine the death can be seen 100 ms late, the restart comes within
    /// milliseconds); and one between the check of the dead mount and its
    /// detach has its new mount detached with it (another limit in docs/limits.md),
    /// so it comes after the detach, as a FUSE pod's restart does. An
    /// unmount-then-mount restart needs no wait: its heal isolates the
    /// containers first if the death was not seen yet.
    fn death_seen(&self, pid: u32, cycle: usize) {
        let supervisor = self.supervisor.as_ref().expect("supervisor running");
        supervisor.wait_death_detached(pid, cycle, HEAL_TIMEOUT).unwrap();
    }

    /// The host's mounts: all of the sandbox's, or, after a restart over
    /// the stale mount, the kubelet tree's only: the daemon's own dead mount
    /// stays under its new one at the source (left alone, a limit in docs/limits.md),
    /// and that one pins its dead connection.
    fn host_mounts(&self) -> usize {
        match self.restart {
            Restart::UnmountThenMount | Restart::InPlace => self.sandbox.count_mounts_under(self.sandbox.root()),
            Restart::MountOverStale => self.sandbox.count_mounts_under(&self.sandbox.kubelet_root()),
        }
    }

    fn expected(&self, watched: &Watched) -> String {
        watched.fixed_content.clone().unwrap_or_else(|| self.source.expected_content())
    }

    /// Every container reads what it must, and lists only what it must.
    fn all_read(&self, cycle: usize) {
        for watched in &self.containers {
            let expected = self.expected(watched);
            let reads = |seen: &fuse_supervisor_testbed::Observation| {
                seen.content() == Some(expected.as_str()) && seen.entries() == Some(watched.entries.as_slice())
            };
            watched.container.wait_until(HEAL_TIMEOUT, reads).unwrap_or_else(|err| {
                panic!("cycle {cycle}: container {} does not read {expected:?}: {err}", watched.container.name())
            });
        }
    }

    fn all_fail(&self, cycle: usize) {
        for watched in &self.containers {
            watched.container.wait_until(HEAL_TIMEOUT, |seen| seen.error().is_some()).unwrap_or_else(|err| {
                panic!("cycle {cycle}: container {} does not see the crash: {err}", watched.container.name())
            });
        }
    }

    /// Crashes the daemon once the supervisor watches it, and waits until
    /// every container sees it; returns the dead connection's minor.
    fn crash(&mut self, cycle: usize) -> u32 {
        self.daemon_watched();
        let dead_minor = self.source_minor();
        self.source.crash().expect("crash the daemon");
        self.all_fail(cycle);
        dead_minor
    }

    /// Waits until the supervisor has copied ahead the mounts nested in
    /// `count` containers' volumes.
    fn nested_copied_ahead(&self, count: usize) {
        let supervisor = self.supervisor.as_ref().expect("supervisor running");
        let copied = |line: &String| line.contains("\"nested mounts copied ahead\"") && !line.contains("\"copied\":0,");
        scenario::wait_for("the nested mounts copied ahead", HEAL_TIMEOUT, || {
            supervisor.log().iter().filter(|line| copied(line)).count() >= count
        })
        .unwrap();
    }

    /// Past the daemon's entry timeout (1 s) since anything looked the
    /// nested mounts' mount point up: at the next crash no handle can be
    /// had on them through the dead mount, only their copies taken ahead.
    fn let_nested_entries_expire(&self) {
        if self.containers.iter().any(|watched| watched.asked.nested) {
            std::thread::sleep(Duration::from_millis(1100));
        }
    }

    /// Each container with a nested mount looks it up by path during the
    /// outage, as an application re-reading its configuration does: with
    /// the entry timed out, the kernel detaches the nested mount there.
    fn look_up_nested_during_outage(&self) {
        for watched in self.containers.iter().filter(|watched| watched.asked.nested) {
            let nested = Path::new(runc::VOLUME_IN_CONTAINER).join(NESTED);
            // Fails (the daemon is dead): the lookup is what matters.
            let _ = watched.container.exec(&["ls", &nested.to_string_lossy()]);
        }
    }

    /// The minor of the FUSE device of the source's current mount.
    fn source_minor(&self) -> u32 {
        let ids = scenario::fuse_mount_ids_at(&self.sandbox, &self.source.path);
        let table = self.sandbox.mountinfo();
        // The last at the path is the top one (a restart over the stale
        // mount leaves the dead one under it).
        let line = table
            .lines()
            .rfind(|line| line.split(' ').next().and_then(|id| id.parse().ok()).is_some_and(|id| ids.contains(&id)))
            .expect("the source is mounted");
        let device = line.split(' ').nth(2).expect("a device field");
        device.split_once(':').and_then(|(_, minor)| minor.parse().ok()).expect("major:minor")
    }

    /// After a heal: the host, every container and the kernel's FUSE
    /// connections are as they were before the first crash.
    fn settled(&self, cycle: usize, host_baseline: usize, dead_minor: u32) {
        scenario::wait_for("the host's baseline mount count", HEAL_TIMEOUT, || self.host_mounts() == host_baseline)
            .unwrap_or_else(|err| panic!("cycle {cycle}: {err}: {} now, {host_baseline} before", self.host_mounts()));
        for watched in &self.containers {
            let name = watched.container.name();
            scenario::wait_for("the container's baseline mount table", HEAL_TIMEOUT, || {
                table_of(&watched.container) == watched.baseline
            })
            .unwrap_or_else(|err| {
                panic!(
                    "cycle {cycle}: container {name}: {err}: volume layers {:?}\nnow {:?}\nbefore {:?}",
                    watched.container.volume_mounts(),
                    table_of(&watched.container),
                    watched.baseline
                )
            });
            let layers = watched.container.volume_mounts().expect("the container's volume mounts");
            assert_eq!(layers.len(), 1, "cycle {cycle}: container {name} holds {layers:?}");
            // Its propagation unchanged: a slave of the (new) source for
            // HostToContainer, private for None, never a peer.
            let slave = layers[0].propagation.contains("master:");
            assert_eq!(slave, watched.receives_host_mounts, "cycle {cycle}: container {name}: {layers:?}");
            assert!(!layers[0].propagation.contains("shared:"), "cycle {cycle}: container {name}: {layers:?}");
        }
        // Minors are reused once free: the current connection may have the
        // number of an earlier dead one (which was then gone already).
        let current = self.source_minor();
        if self.restart == Restart::MountOverStale {
            return;
        }
        scenario::wait_for("the dead FUSE connection to go", HEAL_TIMEOUT, || {
            let alive = runc::fuse_connections(&self.sandbox.outside_path(&self.fusectl));
            dead_minor == current || !alive.contains(&dead_minor)
        })
        .unwrap_or_else(|err| {
            let alive = runc::fuse_connections(&self.sandbox.outside_path(&self.fusectl));
            panic!("cycle {cycle}: {err}: dead {dead_minor}, current {current}, alive {alive:?}")
        });
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let containers = self.containers.iter().map(|watched| &watched.container);
            runc::print_failure(&self.sandbox, containers);
        }
    }
}

/// Containers of both propagation modes, whole volumes and subPaths, on one
/// source; `cycles` crashes and restarts: after each, every container reads
/// again and holds exactly one layer at its volume; the host is flat; no
/// dead connection is left in the kernel.
fn every_container_heals(daemon: Daemon, restart: Restart, cycles: usize) {
    let mut node = Node::new(daemon, restart);
    node.add_volume_container("host-to-container", VolumePropagation::HostToContainer);
    node.add_volume_container("none", VolumePropagation::None);
    node.add_subpath_container("subpath-host-to-container", VolumePropagation::HostToContainer);
    node.add_subpath_container("subpath-none", VolumePropagation::None);
    node.all_read(0);
    node.start_supervisor();
    let host_baseline = node.host_mounts();

    for cycle in 1..=cycles {
        let daemon = node.source.pid().expect("daemon running");
        let dead_minor = node.crash(cycle);
        if restart == Restart::MountOverStale {
            node.death_seen(daemon, cycle);
        }
        node.source.restart(&node.sandbox, restart).expect("restart the daemon");
        node.all_read(cycle);
        node.settled(cycle, host_baseline, dead_minor);
    }
    // Each of them by the in-namespace heal, every cycle, as reported.
    let supervisor = node.supervisor.as_ref().expect("supervisor running");
    // Counted once the last heal is reported, a moment after the containers
    // read again.
    let expected = cycles * node.containers.len();
    let replaced = || supervisor.metric(r#"fuse_supervisor_container_heals_total{result="replaced"}"#).unwrap();
    scenario::wait_for("every container heal counted", HEAL_TIMEOUT, || replaced() == Some(expected as f64))
        .unwrap_or_else(|err| panic!("{err}: {:?}, expected {expected}", replaced()));
    // The log is read from the supervisor's stdout by a thread of its own:
    // its last lines may come in after the metric (4 of 40 had not, once,
    // at load 2).
    let healed = || supervisor.log().iter().filter(|line| line.contains("\"container healed\"")).count();
    scenario::wait_for("every container heal logged", HEAL_TIMEOUT, || healed() >= expected)
        .unwrap_or_else(|err| panic!("{err}: {}, expected {expected}", healed()));
    assert_eq!(healed(), expected);
    // Once read again, a container never failed again in the same cycle:
    // no read of a dead layer after a good one.
    for watched in &node.containers {
        let history = watched.container.history();
        let failures = history.windows(2).filter(|seen| seen[0].error().is_none() && seen[1].error().is_some()).count();
        assert_eq!(
            failures,
            cycles,
            "container {} failed more often than it crashed:\n{}",
            watched.container.name(),
            watched.container.describe_history()
        );
    }
}

#[test]
fn every_runc_container_heals_with_one_layer_after_bindfs_restarts() {
    every_container_heals(Daemon::Bindfs, Restart::UnmountThenMount, 10);
}

#[test]
fn every_runc_container_heals_with_one_layer_after_demofs_mounts_over_its_stale_mount() {
    every_container_heals(Daemon::DemoFs, Restart::MountOverStale, 10);
}

/// Third-party daemons from Debian besides bindfs: rclone (Go, its own
/// FUSE library, mounts through fusermount3) restarting as libfuse daemons
/// must, and sshfs (libfuse3) handed a connection mounted over its stale
/// mount.
#[test]
fn every_runc_container_heals_with_one_layer_after_rclone_restarts() {
    every_container_heals(Daemon::Rclone, Restart::UnmountThenMount, 10);
}

#[test]
fn every_runc_container_heals_with_one_layer_after_sshfs_mounts_over_its_stale_mount() {
    every_container_heals(Daemon::Sshfs, Restart::MountOverStale, 10);
}

/// After a heal, a HostToContainer container still receives what the host
/// mounts under the pod's volume (its new mount is a slave of the source),
/// and a None container still does not.
#[test]
fn a_healed_host_to_container_volume_still_receives_host_mounts() {
    let mut node = Node::new(Daemon::Bindfs, Restart::UnmountThenMount);
    node.add_volume_container("host-to-container", VolumePropagation::HostToContainer);
    node.add_volume_container("none", VolumePropagation::None);
    node.all_read(0);
    node.start_supervisor();
    let host_baseline = node.host_mounts();
    let dead_minor = node.crash(1);
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).expect("restart the daemon");
    node.all_read(1);
    node.settled(1, host_baseline, dead_minor);

    // The host mounts a tmpfs on the volume's subdirectory of the first pod.
    let under = node.sandbox.pod_volume_dir("host-to-container", "data").join(SUBDIR);
    node.sandbox.run(move || fuse_supervisor_sys::mount::mount_tmpfs(&under)).expect("mount under the pod's volume");
    let sub = Path::new(runc::VOLUME_IN_CONTAINER).join(SUBDIR);
    let tmpfs_at_sub = |watched: &Watched| {
        let mounts = watched.container.mounts_at(&sub).expect("the container's mount table");
        mounts.iter().any(|mount| mount.fs_type == "tmpfs")
    };
    scenario::wait_for("the host's mount in the HostToContainer container", HEAL_TIMEOUT, || {
        tmpfs_at_sub(&node.containers[0])
    })
    .unwrap_or_else(|err| {
        panic!(
            "{err}:
{}",
            node.containers[0].container.mountinfo().unwrap_or_default()
        )
    });
    assert!(!tmpfs_at_sub(&node.containers[1]), "the None container received a host mount");
}

/// A namespace made during the outage holds copies of the dead mounts
/// made after the death was seen, which the search at the death did not
/// find. (Not a runc container: runc stats a volume's source before binding
/// it, so a container bound to a dead target fails to start, ENOTCONN, and
/// its kubelet starts it again after the heal.) Here a process that
/// unshares its own namespace (as `unshare -m` does) and execs: learnt at
/// its exec, healed with one layer, and pinning no dead connection.
fn a_namespace_made_during_the_outage_is_healed_with_one_layer(propagation: &str) {
    let mut node = Node::new(Daemon::Bindfs, Restart::UnmountThenMount);
    node.add_volume_container("before", VolumePropagation::None);
    node.all_read(0);
    node.start_supervisor();
    let host_baseline = node.host_mounts();
    let dead_minor = node.crash(1);
    node.isolated(1);

    let mut command = std::process::Command::new(fuse_supervisor_testbed::system::program("unshare"));
    command.args(["--mount", "--propagation", propagation, "sleep", "600"]);
    let process = node.sandbox.spawn(command).expect("unshare");
    let sandbox_namespace = std::fs::metadata(node.sandbox.namespace_path()).expect("sandbox namespace").ino();
    let namespace = || std::fs::metadata(format!("/proc/{}/ns/mnt", process.pid())).map(|meta| meta.ino()).ok();
    scenario::wait_for("the process in a namespace of its own", HEAL_TIMEOUT, || {
        namespace().is_some_and(|inode| inode != sandbox_namespace)
    })
    .unwrap();
    let target = node.sandbox.pod_volume_dir("before", "data");
    let layers = || {
        let table = std::fs::read_to_string(format!("/proc/{}/mountinfo", process.pid())).unwrap_or_default();
        let point = target.to_str().expect("a UTF-8 path");
        table
            .lines()
            .filter(|line| line.split(' ').nth(4) == Some(point) && line.contains(" - fuse"))
            .filter_map(|line| line.split(' ').nth(2).map(str::to_owned))
            .collect::<Vec<_>>()
    };
    assert_eq!(layers(), [format!("0:{dead_minor}")], "its copy of the target is the dead mount");
    // Known before the new mount, from its exec's event: a copy that
    // receives the host's mounts is isolated before the host heal, or that
    // heal would stack the live mount over its dead one.
    // Its own namespace's line: the exec of `unshare` itself, before it
    // unshared, is learnt too (in the sandbox's namespace, which the dead
    // daemon's exit had made unknown), and waiting for that one raced the
    // heal (seen once in a loaded run: the new namespace learnt 9 ms after
    // the host heal, its copy never healed).
    let own = format!("\"namespace\":{},", namespace().expect("its namespace"));
    // Learnt from the exec's event, or, when the keeper had not handled
    // that event yet, by the walk at the death (its own line).
    let learnt = |line: &str| {
        (line.contains("\"mount namespace learnt\"") || line.contains("\"mount namespace learnt by a walk\""))
            && line.contains(&own)
    };
    node.supervisor.as_ref().expect("supervisor running").wait_for_log(HEAL_TIMEOUT, learnt).unwrap();

    node.source.restart(&node.sandbox, Restart::UnmountThenMount).expect("restart the daemon");
    node.all_read(1);
    // Read through its own root: its namespace's tree.
    let data = PathBuf::from(format!("/proc/{}/root", process.pid())).join(target.strip_prefix("/").unwrap());
    let expected = node.source.expected_content();
    scenario::wait_for("the process's copy read again", HEAL_TIMEOUT, || {
        std::fs::read_to_string(data.join(DATA_FILE)).is_ok_and(|read| read == expected)
    })
    .unwrap_or_else(|err| panic!("{err}: layers {:?}", layers()));
    scenario::wait_for("one layer in the process's namespace", HEAL_TIMEOUT, || layers().len() == 1)
        .unwrap_or_else(|err| panic!("{err}: {:?}", layers()));
    assert_ne!(layers()[0], format!("0:{dead_minor}"), "{:?}", layers());
    node.settled(1, host_baseline, dead_minor);
    let supervisor = node.supervisor.as_ref().expect("supervisor running");
    let walked = supervisor.log().iter().filter(|line| line.contains("\"walked\":true")).cloned().collect::<Vec<_>>();
    assert!(walked.is_empty(), "found by the namespaces kept by events, not by walks of /proc: {walked:?}");
}

#[test]
fn a_private_namespace_made_during_the_outage_is_healed_with_one_layer() {
    a_namespace_made_during_the_outage_is_healed_with_one_layer("private");
}

/// Its copy is a slave of the target, as a HostToContainer volume is: it
/// would get the host heal's mount by propagation, over its dead copy.
#[test]
fn a_slave_namespace_made_during_the_outage_is_healed_with_one_layer() {
    a_namespace_made_during_the_outage_is_healed_with_one_layer("slave");
}

/// The containers' namespaces are kept by events: one walk of `/proc` at
/// start, then each container started after it is learnt when its first
/// process execs, and forgotten when it exits. No death and no heal walks
/// `/proc`, and every container still heals with one layer.
#[test]
fn containers_started_after_the_supervisor_are_known_by_events_and_no_heal_walks_proc() {
    let mut node = Node::new(Daemon::Bindfs, Restart::UnmountThenMount);
    node.start_supervisor();
    let walked = |line: &str| line.contains("\"mount namespaces walked\"");
    node.add_volume_container("host-to-container", VolumePropagation::HostToContainer);
    node.add_volume_container("none", VolumePropagation::None);
    node.add_subpath_container("subpath-none", VolumePropagation::None);
    node.all_read(0);
    let supervisor = node.supervisor.as_ref().expect("supervisor running");
    for watched in &node.containers {
        supervisor.wait_namespace_learnt(watched.container.pid(), HEAL_TIMEOUT).unwrap();
    }
    let host_baseline = node.host_mounts();
    let cycles = 3;
    for cycle in 1..=cycles {
        let dead_minor = node.crash(cycle);
        node.isolated(cycle);
        node.source.restart(&node.sandbox, Restart::UnmountThenMount).expect("restart the daemon");
        node.all_read(cycle);
        node.settled(cycle, host_baseline, dead_minor);
    }
    let supervisor = node.supervisor.as_ref().expect("supervisor running");
    let log = supervisor.log();
    let isolations: Vec<&String> =
        log.iter().filter(|line| line.contains("\"containers' dead mounts isolated\"")).collect();
    assert_eq!(isolations.len(), cycles, "{isolations:#?}");
    for line in &isolations {
        assert!(line.contains("\"walked\":false") && line.contains("\"mounts\":3"), "{line}");
    }
    assert_eq!(log.iter().filter(|line| walked(line)).count(), 1, "one walk, at start");
    assert!(!log.iter().any(|line| line.contains("\"walked\":true")), "a heal walked /proc");

    // A container that exits is forgotten.
    let gone = node.containers.pop().expect("a container");
    let pid = gone.container.pid();
    drop(gone);
    let pid_field = [format!("\"pid\":{pid},"), format!("\"pid\":{pid}}}")];
    let forgotten = |line: &str| {
        line.contains("\"mount namespace forgotten") && pid_field.iter().any(|field| line.contains(field.as_str()))
    };
    node.supervisor.as_ref().expect("supervisor running").wait_for_log(HEAL_TIMEOUT, forgotten).unwrap();
}

/// The test bed itself: a container reads its volume through runc, `runc
/// exec` reads it too, and its table shows the bind with its propagation.
#[test]
fn a_runc_container_mounts_the_pod_target_with_its_propagation() {
    let mut node = Node::new(Daemon::Bindfs, Restart::UnmountThenMount);
    node.add_volume_container("host-to-container", VolumePropagation::HostToContainer);
    node.add_volume_container("none", VolumePropagation::None);
    node.all_read(0);
    let volume = Path::new(runc::VOLUME_IN_CONTAINER);
    for watched in &node.containers {
        let container = &watched.container;
        let read = container.read_file(&volume.join(DATA_FILE)).expect("runc exec cat");
        assert_eq!(read, node.source.expected_content());
        let layers = container.volume_mounts().expect("mount table");
        assert_eq!(layers.len(), 1, "{layers:?}");
        assert!(layers[0].fs_type.starts_with("fuse"), "{layers:?}");
        let slave = layers[0].propagation.contains("master:");
        assert_eq!(slave, container.name() == "host-to-container", "{}: {layers:?}", container.name());
        let host_ns = std::fs::metadata(node.sandbox.namespace_path()).map(|m| std::os::unix::fs::MetadataExt::ino(&m));
        assert_ne!(container.namespace_inode().ok(), host_ns.ok(), "a namespace of its own");
    }
}

/// A container controls its own tree: one that mounts over its volume
/// while the daemon is down (`over`: a tmpfs, or a bind of its own `/tmp`)
/// gets nothing mounted by the heal (its mount point is no longer the
/// recorded dead mount), and the refusal is reported (counted as
/// `refused`); the other container is healed as usual. The refused heal is
/// not dropped: it is retried at the container's next mount change, and once the container took its own mount
/// away, the dead one is replaced (one layer, reading again).
fn a_container_that_mounted_over_its_dead_volume_is_refused_not_redirected(over: &[&str]) {
    let mut node = Node::new(Daemon::Bindfs, Restart::UnmountThenMount);
    node.add_volume_container("tampering", VolumePropagation::None);
    node.add_volume_container("none", VolumePropagation::None);
    node.all_read(0);
    node.start_supervisor();
    node.crash(1);
    node.isolated(1);
    let tampering = &node.containers[0].container;
    let mount_over: Vec<&str> = over.iter().copied().chain([runc::VOLUME_IN_CONTAINER]).collect();
    tampering.exec_with_sys_admin(&mount_over).expect("mount over the volume");
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).expect("restart the daemon");

    let healthy = &node.containers[1];
    let expected = node.source.expected_content();
    healthy.container.wait_until(HEAL_TIMEOUT, |seen| seen.content() == Some(expected.as_str())).unwrap();
    let supervisor = node.supervisor.as_ref().expect("supervisor running");
    let refused = |line: &str| line.contains("\"container heal refused") && line.contains("changed");
    supervisor.wait_for_log(HEAL_TIMEOUT, refused).unwrap();
    let refused = supervisor.metric(r#"fuse_supervisor_container_heals_total{result="refused"}"#).unwrap();
    assert!(refused >= Some(1.0), "{refused:?}");
    // Its own mount on top (a tmpfs, or its /tmp's), the dead mount under
    // it, nothing live: the heal mounted nothing in its tree.
    let layers = tampering.volume_mounts().expect("the container's mount table");
    let kinds: Vec<&str> = layers.iter().map(|mount| mount.fs_type.as_str()).collect();
    assert_eq!(kinds, ["fuse", "tmpfs"], "{layers:?}");
    let live = healthy.container.volume_mounts().expect("the other container's mount table");
    assert_ne!(layers[0].device, live[0].device, "the FUSE layer under the tmpfs is the dead one: {layers:?}");

    // Busy for a moment when one of its own processes has a file open
    // through it (seen once on a loaded CI run); busy for long, the agent
    // would be pinning the tenant's mount, which it must never do.
    let unmounted = scenario::wait_for("the container to unmount its own mount", Duration::from_secs(5), || {
        tampering.exec_with_sys_admin(&["umount", runc::VOLUME_IN_CONTAINER]).is_ok()
    });
    unmounted.unwrap_or_else(|err| panic!("{err}: {:?}", tampering.volume_mounts()));
    let retried = |line: &str| line.contains("\"container healed\"") && !line.contains("\"attempts\":0");
    supervisor.wait_for_log(HEAL_TIMEOUT, retried).unwrap();
    tampering.wait_until(HEAL_TIMEOUT, |seen| seen.content() == Some(expected.as_str())).unwrap();
    let layers = tampering.volume_mounts().expect("the container's mount table");
    assert_eq!(layers.len(), 1, "{layers:?}");
    assert_eq!(layers[0].device, live[0].device, "{layers:?}");
    // Logged before it is counted: the count may follow the line.
    let replaced = || supervisor.metric(r#"fuse_supervisor_container_heals_total{result="replaced"}"#).unwrap();
    scenario::wait_for("both containers' heals counted", HEAL_TIMEOUT, || replaced() == Some(2.0))
        .unwrap_or_else(|err| panic!("{err}: {:?}", replaced()));
}

#[test]
fn a_container_that_mounted_a_tmpfs_over_its_dead_volume_is_refused_not_redirected() {
    a_container_that_mounted_over_its_dead_volume_is_refused_not_redirected(&["mount", "-t", "tmpfs", "tmpfs"]);
}

#[test]
fn a_container_that_bound_its_own_directory_over_its_dead_volume_is_refused_not_redirected() {
    a_container_that_mounted_over_its_dead_volume_is_refused_not_redirected(&["mount", "-o", "bind", "/tmp"]);
}

/// A container that takes its dead volume away and leaves a symlink at its
/// mount point (to its own `/tmp`) gets nothing mounted through the link:
/// the mount point is resolved beneath its root with no symlinks. The
/// refusal is reported and retried; its `/tmp` stays the tmpfs alone.
#[test]
fn a_container_that_left_a_symlink_at_its_volume_gets_nothing_mounted_through_it() {
    // Its image is its own: the only container of its sandbox.
    let mut node = Node::new(Daemon::Bindfs, Restart::UnmountThenMount);
    node.add_volume_container("tampering", VolumePropagation::None);
    node.all_read(0);
    node.start_supervisor();
    node.crash(1);
    node.isolated(1);
    let tampering = &node.containers[0].container;
    let volume = runc::VOLUME_IN_CONTAINER;
    let steps: [&[&str]; 4] = [
        &["mount", "-o", "remount,bind,rw", "/"],
        &["umount", "-l", volume],
        &["busybox", "rmdir", volume],
        &["busybox", "ln", "-s", "/tmp", volume],
    ];
    for step in steps {
        tampering.exec_with_sys_admin(step).unwrap_or_else(|err| panic!("{step:?}: {err}"));
    }
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).expect("restart the daemon");

    let supervisor = node.supervisor.as_ref().expect("supervisor running");
    // ELOOP: a symlink met where none may be.
    let refused = |line: &str| {
        line.contains("\"container heal refused")
            && line.contains("cannot resolve")
            && line.contains("Too many levels of symbolic links")
    };
    supervisor.wait_for_log(HEAL_TIMEOUT, refused).unwrap();
    let refused = supervisor.metric(r#"fuse_supervisor_container_heals_total{result="refused"}"#).unwrap();
    assert!(refused >= Some(1.0), "{refused:?}");
    let mounts = tampering.mounts().expect("the container's mount table");
    let at_tmp: Vec<&str> = mounts
        .iter()
        .filter(|mount| mount.mount_point == Path::new("/tmp"))
        .map(|mount| mount.fs_type.as_str())
        .collect();
    assert_eq!(at_tmp, ["tmpfs"], "{mounts:?}");
    assert!(!mounts.iter().any(|mount| mount.fs_type.starts_with("fuse")), "{mounts:?}");
}

/// Not only pods' containers: any process that unshared its own mount
/// namespace with a copy of a target pins the dead connection as much, and
/// is healed the same way (here the fast tier's container model, a plain
/// process whose copy is a slave of the target).
#[test]
fn a_process_with_its_own_copy_of_a_target_is_healed_in_its_namespace_too() {
    let mut node = Node::new(Daemon::Bindfs, Restart::UnmountThenMount);
    let target = node.source.bind_volume(&node.sandbox, "plain", "data").expect("bind volume");
    let reader = fuse_supervisor_testbed::ContainerReader::spawn(&node.sandbox, "plain", &target, Path::new(DATA_FILE))
        .expect("reader");
    let volume = fuse_supervisor_testbed::ContainerReader::volume_in_container(
        &fuse_supervisor_testbed::container::ContainerOptions {
            volume: target.clone(),
            rootfs: node.sandbox.root().join("containers/plain/rootfs"),
            hide: Vec::new(),
            read: DATA_FILE.into(),
            interval: READ_INTERVAL,
            propagation: fuse_supervisor_sys::mount::Propagation::Slave,
            wake_on_mount_change: false,
        },
    );
    let fuse_layers = || {
        let table = std::fs::read_to_string(format!("/proc/{}/mountinfo", reader.child().pid())).unwrap_or_default();
        table
            .lines()
            .filter(|line| line.split(' ').nth(4) == volume.to_str() && line.contains(" - fuse"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    assert_eq!(fuse_layers().len(), 1);
    node.start_supervisor();
    for cycle in 1..=3 {
        node.daemon_watched();
        node.source.crash().expect("crash the daemon");
        reader.wait_until(HEAL_TIMEOUT, |seen| seen.error().is_some()).expect("the reader sees the crash");
        node.source.restart(&node.sandbox, Restart::UnmountThenMount).expect("restart the daemon");
        let expected = node.source.expected_content();
        reader.wait_until(HEAL_TIMEOUT, |seen| seen.content() == Some(expected.as_str())).expect("reads again");
        scenario::wait_for("one layer in the process's namespace", HEAL_TIMEOUT, || fuse_layers().len() == 1)
            .unwrap_or_else(|err| panic!("cycle {cycle}: {err}: {:?}", fuse_layers()));
    }
}

/// What a pod asked of its volume, checked after every heal: each mount
/// shows its options, a read-only one refuses a write with EROFS (and a
/// target published read-only does on the host too), and a nested tmpfs is
/// still there with what was written in it.
fn asked_for_is_kept(node: &Node, cycle: usize, read_only_target: &Path) {
    for watched in &node.containers {
        let name = watched.container.name();
        let layers = watched.container.volume_mounts().expect("the container's volume mounts");
        let options: Vec<&str> = layers[0].options.split(',').collect();
        for option in watched.asked.options {
            assert!(options.contains(option), "cycle {cycle}: container {name}: {option} lost: {layers:?}");
        }
        // Only where it must fail: a file written would change what every
        // container lists.
        if watched.asked.read_only {
            let write = format!("echo written > {}/written-{name}", runc::VOLUME_IN_CONTAINER);
            let err = watched.container.exec(&["sh", "-c", &write]).expect_err("a write to a read-only volume");
            assert!(err.to_string().contains("Read-only file system"), "cycle {cycle}: container {name}: {err}");
        }
        if watched.asked.nested {
            let read = watched.container.read_file(&nested_file()).expect("read the nested mount");
            assert_eq!(read.trim(), NESTED_CONTENT, "cycle {cycle}: container {name}: the nested tmpfs");
            let nested = watched.container.mounts_at(&Path::new(runc::VOLUME_IN_CONTAINER).join(NESTED)).unwrap();
            assert_eq!(nested.len(), 1, "cycle {cycle}: container {name}: nested mounts {nested:?}");
            assert_eq!(nested[0].fs_type, "tmpfs", "cycle {cycle}: container {name}");
        }
    }
    let table = node.sandbox.mountinfo();
    let line = table
        .lines()
        .rfind(|line| line.split(' ').nth(4).map(Path::new) == Some(read_only_target))
        .expect("the read-only target is mounted");
    let options = line.split(' ').nth(5).expect("options");
    assert!(options.split(',').any(|option| option == "ro"), "cycle {cycle}: the target turned {options}: {line}");
    let probe = read_only_target.join("written-on-host");
    let written = node.sandbox.run(move || std::fs::write(probe, "x"));
    let err = written.expect_err("a write to a target published read-only");
    assert_eq!(err.kind(), std::io::ErrorKind::ReadOnlyFilesystem, "cycle {cycle}: {err}");
}

/// Containers whose pods asked for more than the volume: `readOnly`
/// (`rbind,rslave,ro` and `rbind,rprivate,ro`, the latter with nosuid,
/// nodev and noexec too), a tmpfs nested in the volume (HostToContainer
/// and None), and a pod whose target the driver published read-only (bind,
/// then remount `ro`), placed last so that a stack on a writable peer
/// would reach it by propagation. After each of `cycles` crashes: every
/// container reads again and keeps all of it, with one layer each and the
/// host's mount count back to its baseline.
fn what_the_pod_asked_for_survives_every_heal(daemon: Daemon, restart: Restart, cycles: usize) {
    let mut node = Node::new(daemon, restart);
    let nested_dir = node.source.backing.join(NESTED);
    node.sandbox.run(move || std::fs::create_dir_all(nested_dir)).expect("the nested mount's directory");
    let entries = [NESTED, DATA_FILE, SUBDIR];
    let volumes = [
        ("nested-host-to-container", VolumePropagation::HostToContainer, Asked { nested: true, ..Asked::default() }),
        ("nested-none", VolumePropagation::None, Asked { nested: true, ..Asked::default() }),
        (
            "ro-host-to-container",
            VolumePropagation::HostToContainer,
            Asked { options: &["ro"], read_only: true, nested: true },
        ),
        (
            "ro-none",
            VolumePropagation::None,
            Asked { options: &["ro", "nosuid", "nodev", "noexec"], read_only: true, ..Asked::default() },
        ),
    ];
    for (name, propagation, asked) in volumes {
        let target = node.source.bind_volume(&node.sandbox, name, "data").expect("bind volume");
        node.add_container_with(name, target, propagation, DATA_FILE, None, &entries, asked);
    }
    // Published read-only by its driver; its container asked nothing more.
    let read_only_target = node.source.bind_volume(&node.sandbox, "z-published-ro", "data").expect("bind volume");
    let at = read_only_target.clone();
    node.sandbox
        .run(move || {
            use fuse_supervisor_sys::mount::{MountAttributes, set_attributes_of};
            use fuse_supervisor_sys::{resolve, statmount};
            let fd = resolve::open_path(&at)?;
            let unique = resolve::unique_mount_id_of(std::os::fd::AsFd::as_fd(&fd))?;
            let now = statmount::mount_attributes(unique, statmount::Namespace::Current)?;
            set_attributes_of(std::os::fd::AsFd::as_fd(&fd), now.union(MountAttributes::READ_ONLY), None)
        })
        .expect("remount the target read-only");
    let asked = Asked { options: &["ro"], read_only: true, ..Asked::default() };
    let propagation = VolumePropagation::HostToContainer;
    node.add_container_with("z-published-ro", read_only_target.clone(), propagation, DATA_FILE, None, &entries, asked);
    node.all_read(0);
    asked_for_is_kept(&node, 0, &read_only_target);
    node.start_supervisor();
    let host_baseline = node.host_mounts();
    node.nested_copied_ahead(3);

    for cycle in 1..=cycles {
        let daemon = node.source.pid().expect("daemon running");
        node.let_nested_entries_expire();
        let dead_minor = node.crash(cycle);
        node.look_up_nested_during_outage();
        if restart == Restart::MountOverStale {
            node.death_seen(daemon, cycle);
        }
        node.source.restart(&node.sandbox, restart).expect("restart the daemon");
        node.all_read(cycle);
        node.settled(cycle, host_baseline, dead_minor);
        asked_for_is_kept(&node, cycle, &read_only_target);
    }
    let supervisor = node.supervisor.as_ref().expect("supervisor running");
    let lost = supervisor.log().iter().filter(|line| line.contains("not carried over")).cloned().collect::<Vec<_>>();
    assert!(lost.is_empty(), "{lost:?}");
    // Healed by its own stack, never by a writable peer's propagated copy
    // set read-only afterwards (which a process could write through
    // meanwhile). A daemon mounting over its stale mount propagates its own
    // mount by the kernel, which no heal can prevent (docs/heal.md).
    let copied = |line: &&String| line.contains("has other attributes than its stale layer had");
    let set_back = supervisor.log().iter().filter(copied).cloned().collect::<Vec<_>>();
    if restart != Restart::MountOverStale {
        assert!(set_back.is_empty(), "{set_back:?}");
    } else {
        assert!(set_back.len() <= cycles, "one copy set back per cycle at most: {set_back:?}");
    }
}

#[test]
fn read_only_and_nested_volumes_survive_bindfs_restarts() {
    what_the_pod_asked_for_survives_every_heal(Daemon::Bindfs, Restart::UnmountThenMount, 5);
}

#[test]
fn read_only_and_nested_volumes_survive_demofs_mounting_over_its_stale_mount() {
    what_the_pod_asked_for_survives_every_heal(Daemon::DemoFs, Restart::MountOverStale, 5);
}

/// A mount nested in a volume after its container started (no copy was
/// taken ahead: its namespace was learnt before), whose entry in the dead
/// volume had timed out at the death (nobody looked it up within the
/// daemon's entry timeout, 1 s for demofs, which does no readdirplus): no
/// handle can be had on it, so it goes with the dead layer, and the heal
/// says so, naming the namespace and the mount point, instead of dropping
/// it silently. The mount nested from the start is carried by its copy
/// taken ahead, and the volume itself is healed as ever.
#[test]
fn a_nested_mount_made_late_and_out_of_reach_at_the_death_is_reported_not_dropped_silently() {
    const LATE: &str = "late";
    let mut node = Node::new(Daemon::DemoFs, Restart::UnmountThenMount);
    let (nested_dir, late_dir) = (node.source.backing.join(NESTED), node.source.backing.join(LATE));
    node.sandbox
        .run(move || std::fs::create_dir_all(nested_dir).and_then(|()| std::fs::create_dir_all(late_dir)))
        .expect("the nested mounts' directories");
    let target = node.source.bind_volume(&node.sandbox, "idle-config", "data").expect("bind volume");
    let asked = Asked { nested: true, ..Asked::default() };
    let entries = [NESTED, DATA_FILE, LATE, SUBDIR];
    let propagation = VolumePropagation::HostToContainer;
    node.add_container_with("idle-config", target, propagation, DATA_FILE, None, &entries, asked);
    node.all_read(0);
    node.start_supervisor();
    let host_baseline = node.host_mounts();
    let namespace = node.containers[0].container.namespace_inode().expect("the container's namespace");
    node.daemon_watched();
    node.nested_copied_ahead(1);
    let late = Path::new(runc::VOLUME_IN_CONTAINER).join(LATE);
    let container = &node.containers[0].container;
    container
        .exec_with_sys_admin(&["mount", "-t", "tmpfs", "late", &late.to_string_lossy()])
        .expect("mount a tmpfs late");
    node.let_nested_entries_expire();
    let dead_minor = node.crash(1);
    node.look_up_nested_during_outage();
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).expect("restart the daemon");
    node.all_read(1);
    let supervisor = node.supervisor.as_ref().expect("supervisor running");
    let namespace_field = format!("\"namespace\":{namespace},");
    let reported = |line: &str| {
        line.contains("\"not carried over to the container's new mount by its heal\"")
            && line.contains(&namespace_field)
            && line.contains("\"mount_point\":\"/volume/late\"")
    };
    supervisor.wait_for_log(HEAL_TIMEOUT, reported).unwrap();
    let lost = supervisor.log().iter().filter(|line| line.contains("/volume/config")).cloned().collect::<Vec<_>>();
    assert!(lost.iter().all(|line| !line.contains("not carried over")), "{lost:?}");
    // The late mount is gone with the dead layer (it was never in the
    // container's baseline); the one nested from the start is there.
    node.settled(1, host_baseline, dead_minor);
}

/// A user-namespace pod (`hostUsers: false`): its volume is mounted
/// idmapped through its container's user namespace, so that the files'
/// owners show as the container's. The kernel says a mount is idmapped,
/// and with which maps, but not through which user namespace; the heal
/// takes the container's, checked to have the dead mount's maps, and the
/// replacement shows the same owners after every heal, one layer.
#[test]
fn an_idmapped_volume_stays_idmapped_through_heals() {
    use fuse_supervisor_testbed::userns::UsernsContainer;
    let mut node = Node::new(Daemon::DemoFs, Restart::UnmountThenMount);
    let target = node.source.bind_volume(&node.sandbox, "userns", "data").expect("bind volume");
    let volume = node.sandbox.root().join("userns-volume");
    let container = UsernsContainer::start(&node.sandbox, &target, &volume, "0 100000 65536", "0 200000 65536")
        .expect("a user-namespace container with an idmapped volume");
    let data = container.path(&volume).join(DATA_FILE);
    let owners = |node: &Node| {
        let data = data.clone();
        node.sandbox.run(move || std::fs::metadata(data).map(|meta| (meta.uid(), meta.gid())))
    };
    // The backing files are root's: seen through the mapping.
    assert_eq!(owners(&node).expect("the volume's file"), (100_000, 200_000));
    let layers = || {
        let table = std::fs::read_to_string(format!("/proc/{}/mountinfo", container.pid())).expect("its table");
        let point = volume.to_string_lossy().into_owned();
        table.lines().filter(|line| line.split(' ').nth(4) == Some(point.as_str())).count()
    };
    node.start_supervisor();
    let host_baseline = node.host_mounts();

    for cycle in 1..=2 {
        let dead_minor = node.crash(cycle);
        scenario::wait_for("the container's volume to fail", HEAL_TIMEOUT, || owners(&node).is_err()).unwrap();
        node.source.restart(&node.sandbox, Restart::UnmountThenMount).expect("restart the daemon");
        scenario::wait_for("the container's volume to answer", HEAL_TIMEOUT, || owners(&node).is_ok())
            .unwrap_or_else(|err| panic!("cycle {cycle}: {err}"));
        assert_eq!(owners(&node).expect("the volume's file"), (100_000, 200_000), "cycle {cycle}: owners unmapped");
        assert_eq!(layers(), 1, "cycle {cycle}: layers at the container's volume");
        node.settled(cycle, host_baseline, dead_minor);
    }
    let supervisor = node.supervisor.as_ref().expect("supervisor running");
    let lost = supervisor.log().iter().filter(|line| line.contains("not carried over")).cloned().collect::<Vec<_>>();
    assert!(lost.is_empty(), "{lost:?}");
    drop(container);
}
