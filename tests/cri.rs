//! The CRI tier of the heal tests: pods and containers asked of a private
//! containerd (Debian's, CRI v1) as the kubelet asks for them, one `Mount`
//! per volumeMount with its propagation and `readonly`, plus the kubelet's
//! `/etc/hosts` and termination-log mounts, on a real FUSE volume. Without
//! the agent, the smoke test shows what containerd makes of each ask; with
//! it, the proof shows that a heal changes nothing but the connection:
//! every container reads again, a read-only volume stays read-only, a
//! volume nested inside the FUSE volume stays, one layer each, and nothing
//! of containerd is left after. Needs root and /dev/fuse.
use std::path::{Path, PathBuf};
use std::time::Duration;

use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::cri::{ContainerSpec, Containerd, CriContainer, Pod, Propagation, VolumeMount};
use fuse_supervisor_testbed::scenario::{
    self, DATA_FILE, Daemon, FuseSource, Restart, SUBDIR, SUBDIR_FILE, SupervisorProcess,
};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const HEAL_TIMEOUT: Duration = Duration::from_secs(20);
/// Where every container mounts its FUSE volume.
const VOLUME: &str = "/data";
/// The directory of the FUSE volume where a second volume is nested.
const NESTED: &str = "config";
/// The file of the nested volume, and what it holds.
const NESTED_FILE: &str = "key";
const NESTED_CONTENT: &str = "nested-secret";

/// `EROFS`, what a write to a read-only mount fails with.
const EROFS: i32 = 30;

/// A promise of the pod spec that does not hold: who, what happened, what
/// was expected, and what was seen.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Broken {
    subject: String,
    event: &'static str,
    expected: &'static str,
    seen: String,
}

impl Broken {
    fn new(subject: String, event: &'static str, expected: &'static str, seen: String) -> Broken {
        Broken { subject, event, expected, seen }
    }
}

/// One line per broken promise, naming the heals after which it was
/// broken: `container ro-whole: write succeeded after heal 1 (and 2, 3),
/// expected EROFS`, with what was seen the first time.
fn report(broken: &[(usize, Broken)]) -> String {
    let mut lines: Vec<(String, Vec<usize>, String)> = Vec::new();
    for (heal, promise) in broken {
        let head = format!("{}: {}", promise.subject, promise.event);
        match lines.iter_mut().find(|(known, ..)| *known == head) {
            Some((_, heals, _)) => heals.push(*heal),
            None => {
                let seen = if promise.seen.is_empty() { String::new() } else { format!("; seen: {}", promise.seen) };
                lines.push((head, vec![*heal], format!("{}{seen}", promise.expected)));
            }
        }
    }
    lines
        .iter()
        .map(|(head, heals, tail)| {
            let later: Vec<String> = heals[1..].iter().map(ToString::to_string).collect();
            let also = if later.is_empty() { String::new() } else { format!(" (and {})", later.join(", ")) };
            format!("{head} after heal {}{also}, {tail}", heals[0])
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// How a container's volume was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Volume {
    /// The pod's whole target.
    Whole,
    /// The source's subdirectory, bound by the kubelet (a subPath).
    SubPath,
}

/// What one container was asked for, and so what it must show.
#[derive(Debug, Clone, Copy)]
struct Ask {
    name: &'static str,
    volume: Volume,
    propagation: Propagation,
    /// `readOnly: true` on the volumeMount.
    read_only: bool,
    /// The host target published read-only (bind, then remount `ro`), as
    /// a CSI driver publishes a read-only volume.
    read_only_target: bool,
    /// A tmpfs volume (a secret's) mounted at `/data/config`.
    nested: bool,
}

const fn ask(name: &'static str, volume: Volume, propagation: Propagation) -> Ask {
    Ask { name, volume, propagation, read_only: false, read_only_target: false, nested: false }
}

/// Whole and subPath, HostToContainer and None, a readOnly one, two with
/// a volume nested in theirs (HostToContainer and None), one on a target
/// published read-only.
const ASKS: [Ask; 7] = [
    ask("whole-htc", Volume::Whole, Propagation::HostToContainer),
    ask("whole-none", Volume::Whole, Propagation::None),
    ask("subpath-none", Volume::SubPath, Propagation::None),
    Ask { read_only: true, ..ask("ro-whole", Volume::Whole, Propagation::None) },
    Ask { nested: true, ..ask("nested-htc", Volume::Whole, Propagation::HostToContainer) },
    Ask { nested: true, ..ask("nested-none", Volume::Whole, Propagation::None) },
    Ask { read_only: true, read_only_target: true, ..ask("ro-target", Volume::Whole, Propagation::None) },
];

struct Running {
    ask: Ask,
    /// The host target its volume is bound from.
    target: PathBuf,
    pod: Pod,
    container: CriContainer,
}

struct Node {
    // Declared first: the supervisor and containerd go before the sandbox.
    supervisor: Option<SupervisorProcess>,
    containerd: Option<Containerd>,
    running: Vec<Running>,
    source: FuseSource,
    restart: Restart,
    sandbox: Sandbox,
}

impl Node {
    fn new(daemon: Daemon, restart: Restart) -> Node {
        let sandbox = Sandbox::new().expect("sandbox");
        let source = FuseSource::start(&sandbox, daemon, "shared-data").expect("start daemon");
        // The mount point of the nested volume, in the FUSE volume.
        let nested = source.backing.join(NESTED);
        sandbox.run(move || std::fs::create_dir_all(nested)).expect("create the nested volume's directory");
        let containerd = Containerd::start(&sandbox).unwrap_or_else(|err| panic!("start containerd: {err}"));
        Node { supervisor: None, containerd: Some(containerd), running: Vec::new(), source, restart, sandbox }
    }

    fn containerd(&self) -> &Containerd {
        self.containerd.as_ref().expect("containerd running")
    }

    /// A pod per ask, its target bound from the source as the CSI driver
    /// and the kubelet bind it, and its container started through the CRI.
    fn run(&mut self, ask: Ask) {
        let uid = format!("uid-{}", ask.name);
        let target = match ask.volume {
            Volume::Whole => self.source.bind_volume(&self.sandbox, &uid, "data"),
            Volume::SubPath => self.source.bind_subpath(&self.sandbox, &uid, "data"),
        }
        .unwrap_or_else(|err| panic!("{}: bind its target: {err}", ask.name));
        if ask.read_only_target {
            let at = target.clone();
            self.sandbox
                .run(move || fuse_supervisor_sys::mount::remount_bind_read_only(&at))
                .unwrap_or_else(|err| panic!("{}: publish its target read-only: {err}", ask.name));
        }
        let mut mounts = vec![VolumeMount {
            host_path: target.clone(),
            container_path: VOLUME.into(),
            read_only: ask.read_only,
            propagation: ask.propagation,
        }];
        if ask.nested {
            mounts.push(VolumeMount {
                host_path: self.secret_volume(&uid),
                container_path: Path::new(VOLUME).join(NESTED),
                read_only: true,
                propagation: Propagation::None,
            });
        }
        let pod = self.containerd().run_pod(&self.sandbox, ask.name, &uid).expect("run the pod sandbox");
        let spec = ContainerSpec { name: ask.name.into(), mounts };
        let container = self
            .containerd()
            .start_container(&self.sandbox, &pod, &spec)
            .unwrap_or_else(|err| panic!("start container {}: {err}", ask.name));
        self.running.push(Running { ask, target, pod, container });
    }

    /// A secret volume of pod `uid`: a tmpfs in its kubelet directory,
    /// holding one file.
    fn secret_volume(&self, uid: &str) -> PathBuf {
        let dir = self.sandbox.kubelet_root().join("pods").join(uid).join("volumes/kubernetes.io~secret/config");
        let at = dir.clone();
        self.sandbox
            .run(move || -> std::io::Result<()> {
                std::fs::create_dir_all(&at)?;
                fuse_supervisor_sys::mount::mount_tmpfs(&at)?;
                std::fs::write(at.join(NESTED_FILE), NESTED_CONTENT)
            })
            .expect("the secret volume");
        dir
    }

    /// What a container reads from its volume: the current generation's
    /// data file, or the subdirectory's fixed file.
    fn expected(&self, ask: &Ask) -> (PathBuf, String) {
        match ask.volume {
            Volume::Whole => (Path::new(VOLUME).join(DATA_FILE), self.source.expected_content()),
            Volume::SubPath => (Path::new(VOLUME).join(SUBDIR_FILE), format!("inside shared-data/{SUBDIR}")),
        }
    }

    /// Every container reads its volume (through `ExecSync`).
    fn all_read(&self, when: &str) {
        for running in &self.running {
            let (file, expected) = self.expected(&running.ask);
            let file = file.to_string_lossy().into_owned();
            let mut last = None;
            scenario::wait_for("the container to read its volume", HEAL_TIMEOUT, || {
                let read = running.container.exec(&["cat", &file]);
                let done = read.as_ref().is_ok_and(|read| read.succeeded() && read.stdout == expected);
                last = Some(read);
                done
            })
            .unwrap_or_else(|err| {
                panic!("{when}: container {} does not read {expected:?}: {err}; last: {last:?}", running.ask.name)
            });
        }
    }

    /// Waits until the agent has copied ahead the volumes nested in every
    /// container that has one.
    fn nested_copied_ahead(&self) {
        let count = self.running.iter().filter(|running| running.ask.nested).count();
        let copied = |line: &String| line.contains("\"nested mounts copied ahead\"") && !line.contains("\"copied\":0,");
        scenario::wait_for("the nested volumes copied ahead", HEAL_TIMEOUT, || {
            self.supervisor().log().iter().filter(|line| copied(line)).count() >= count
        })
        .unwrap();
    }

    /// Past the daemon's entry timeout (1 s) since anything looked the
    /// nested volumes' mount point up: at the next crash no handle can be
    /// had on them through the dead mount, only their copies taken ahead.
    fn let_nested_entries_expire(&self) {
        if self.running.iter().any(|running| running.ask.nested) {
            std::thread::sleep(Duration::from_millis(1100));
        }
    }

    /// Each container with a nested volume looks it up by path during the
    /// outage, as an application re-reading its configuration does: with
    /// the entry timed out, the kernel detaches the nested volume there.
    fn look_up_nested_during_outage(&self) {
        for running in self.running.iter().filter(|running| running.ask.nested) {
            // Fails (the daemon is dead): the lookup is what matters.
            let _ = running.container.exec(&["ls", &format!("{VOLUME}/{NESTED}")]);
        }
    }

    /// Every container's read fails (the daemon is dead).
    fn all_fail(&self, when: &str) {
        for running in &self.running {
            let (file, _) = self.expected(&running.ask);
            let file = file.to_string_lossy().into_owned();
            scenario::wait_for("the container to see the crash", HEAL_TIMEOUT, || {
                running.container.exec(&["cat", &file]).is_ok_and(|read| !read.succeeded())
            })
            .unwrap_or_else(|err| panic!("{when}: container {} does not see the crash: {err}", running.ask.name));
        }
    }

    /// The promises (read-only, nested volume) that do not hold now.
    fn broken_promises(&self) -> Vec<Broken> {
        let mut broken = Vec::new();
        for running in &self.running {
            let name = running.ask.name;
            if running.ask.read_only {
                let container = format!("container {name}");
                let probe = format!("{VOLUME}/written-by-{name}");
                match running.container.exec(&["touch", &probe]) {
                    Ok(write) if write.succeeded() => {
                        broken.push(Broken::new(container, "write succeeded", "expected EROFS", String::new()));
                        // Not left on the shared volume.
                        let _ = running.container.exec(&["rm", "-f", &probe]);
                    }
                    Ok(write) if write.stderr.contains("Read-only file system") => {}
                    other => {
                        broken.push(Broken::new(container, "write failed", "expected EROFS", format!("{other:?}")))
                    }
                }
            }
            if running.ask.read_only_target {
                let target = format!("host target of {name}");
                let probe = running.target.join(format!("written-on-the-host-by-{name}"));
                let written = self.sandbox.run(move || {
                    let written = std::fs::write(&probe, "");
                    if written.is_ok() {
                        let _ = std::fs::remove_file(&probe);
                    }
                    written
                });
                match written {
                    Ok(()) => broken.push(Broken::new(target, "write succeeded", "expected EROFS", String::new())),
                    Err(err) if err.raw_os_error() == Some(EROFS) => {}
                    Err(err) => broken.push(Broken::new(target, "write failed", "expected EROFS", err.to_string())),
                }
            }
            if running.ask.nested {
                let file = format!("{VOLUME}/{NESTED}/{NESTED_FILE}");
                match running.container.exec(&["cat", &file]) {
                    Ok(read) if read.succeeded() && read.stdout == NESTED_CONTENT => {}
                    other => broken.push(Broken::new(
                        format!("container {name}"),
                        "nested volume gone",
                        "expected it mounted and readable",
                        format!(
                            "cat {file}: {other:?}; mounts at {VOLUME}/{NESTED}: {:?}",
                            running.container.mounts_at(&Path::new(VOLUME).join(NESTED))
                        ),
                    )),
                }
            }
        }
        broken
    }

    /// One FUSE layer at each container's volume, and at each host target.
    fn one_layer_each(&self, when: &str) {
        for running in &self.running {
            let on_host = || scenario::layers_at(&self.sandbox, &running.target);
            scenario::wait_for("one layer at the host target", HEAL_TIMEOUT, || on_host() == 1)
                .unwrap_or_else(|err| panic!("{when}: host target of {}: {err}: {}", running.ask.name, on_host()));
            let fuse_layers = || {
                let mounts = running.container.mounts_at(Path::new(VOLUME)).expect("the container's mount table");
                mounts.into_iter().filter(|mount| mount.fs_type.starts_with("fuse")).collect::<Vec<_>>()
            };
            scenario::wait_for("one layer at the container's volume", HEAL_TIMEOUT, || fuse_layers().len() == 1)
                .unwrap_or_else(|err| panic!("{when}: container {}: {err}: {:?}", running.ask.name, fuse_layers()));
        }
    }

    /// The host's mounts: all of the sandbox's (but containerd's, which
    /// are its own business), or after a restart over the stale mount the
    /// kubelet tree's only (the daemon's own dead mount stays under its new
    /// one at the source, a limit in docs/limits.md).
    fn host_mounts(&self) -> usize {
        match self.restart {
            Restart::UnmountThenMount | Restart::InPlace => {
                let root = self.sandbox.root();
                let containerd = self.containerd().dir();
                let table = self.sandbox.mountinfo();
                table
                    .lines()
                    .filter_map(|line| line.split(' ').nth(4))
                    .filter(|point| Path::new(point).starts_with(root) && !Path::new(point).starts_with(containerd))
                    .count()
            }
            Restart::MountOverStale => self.sandbox.count_mounts_under(&self.sandbox.kubelet_root()),
        }
    }

    fn start_supervisor(&mut self) {
        let state_dir = self.sandbox.root().join("state");
        let supervisor =
            SupervisorProcess::start_with(&self.sandbox, Path::new(BINARY), &state_dir, ["--kubelet", "none"]);
        let supervisor = supervisor.expect("supervisor");
        supervisor.wait_for_log(HEAL_TIMEOUT, |line| line.contains("\"mount namespaces walked\"")).unwrap();
        self.supervisor = Some(supervisor);
    }

    fn supervisor(&self) -> &SupervisorProcess {
        self.supervisor.as_ref().expect("supervisor running")
    }

    /// Stops containerd and asserts that nothing of it is left: no process
    /// of its pid namespace, no mount, no cgroup, no failed CRI call.
    fn stop_containerd(&mut self) {
        let mut containerd = self.containerd.take().expect("containerd running");
        let leftovers = containerd.stop();
        assert!(leftovers.is_empty(), "containerd left {leftovers:#?}");
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("host mount table:\n{}", self.sandbox.mountinfo());
            for running in &self.running {
                let table = running.container.mountinfo().unwrap_or_default();
                eprintln!("container {} mount table:\n{table}", running.ask.name);
            }
        }
    }
}

/// The test bed itself, without the agent: containerd runs each ask, each
/// container reads its volume, the readOnly ones refuse a write (EROFS),
/// the nested volume is there, and each container's mount table shows
/// what containerd asked of runc: `rbind,rslave` (a slave) for
/// HostToContainer, `rbind,rprivate` for None, `ro` for readOnly.
#[test]
fn containerd_runs_each_pod_as_the_kubelet_asks() {
    let mut node = Node::new(Daemon::Bindfs, Restart::UnmountThenMount);
    let version = node.containerd().client().version().expect("CRI Version");
    assert_eq!((version.runtime_name.as_str(), version.runtime_api_version.as_str()), ("containerd", "v1"));
    for ask in ASKS {
        node.run(ask);
    }
    node.all_read("at start");
    assert_eq!(node.broken_promises(), []);
    let sandbox_namespace = std::fs::metadata(node.sandbox.namespace_path()).map(|meta| {
        use std::os::unix::fs::MetadataExt;
        meta.ino()
    });
    for running in &node.running {
        let (name, container) = (running.ask.name, &running.container);
        let layers = container.mounts_at(Path::new(VOLUME)).expect("the container's mount table");
        assert_eq!(layers.len(), 1, "{name}: {layers:?}");
        let volume = &layers[0];
        assert!(volume.fs_type.starts_with("fuse"), "{name}: {volume:?}");
        let slave = volume.propagation.contains("master:");
        assert_eq!(slave, running.ask.propagation == Propagation::HostToContainer, "{name}: {volume:?}");
        assert!(!volume.propagation.contains("shared:"), "{name}: {volume:?}");
        let read_only = volume.options.split(',').any(|option| option == "ro");
        assert_eq!(read_only, running.ask.read_only, "{name}: {volume:?}");
        if running.ask.nested {
            let nested = container.mounts_at(&Path::new(VOLUME).join(NESTED)).expect("the container's mount table");
            let kinds: Vec<&str> = nested.iter().map(|mount| mount.fs_type.as_str()).collect();
            assert_eq!(kinds, ["tmpfs"], "{name}: {nested:?}");
        }
        // The kubelet's own mounts are there too.
        for file in ["/etc/hosts", "/dev/termination-log"] {
            assert_eq!(container.mounts_at(Path::new(file)).map(|mounts| mounts.len()).ok(), Some(1), "{name}: {file}");
        }
        assert_ne!(container.namespace_inode().ok(), sandbox_namespace.as_ref().ok().copied(), "{name}");
        assert_eq!(running.pod.uid, format!("uid-{name}"));
    }
    node.stop_containerd();
}

/// The proof: every ask on one FUSE source, the agent in node mode, and
/// `cycles` crashes and restarts of a third-party daemon. After each heal
/// every container reads again with one FUSE layer at its volume and the
/// host is back to its mount count; a container started after the heals
/// on a healed target reads; nothing of containerd is left. What the pods
/// asked for beyond the connection (a readOnly volume stays read-only, in
/// the container and on a target published read-only; a volume nested in
/// the FUSE volume stays) is checked after every heal and reported at the
/// end, each broken promise by container and heal.
fn what_the_pods_asked_for_survives_every_heal(daemon: Daemon, restart: Restart, cycles: usize) {
    let mut node = Node::new(daemon, restart);
    for ask in ASKS {
        node.run(ask);
    }
    node.all_read("at start");
    assert_eq!(node.broken_promises(), []);
    node.start_supervisor();
    let host_baseline = node.host_mounts();
    node.nested_copied_ahead();
    let mut broken = Vec::new();
    for cycle in 1..=cycles {
        let pid = node.source.pid().expect("daemon running");
        node.supervisor().wait_watching_daemon(pid, HEAL_TIMEOUT).unwrap();
        node.let_nested_entries_expire();
        node.source.crash().expect("crash the daemon");
        node.all_fail(&format!("crash {cycle}"));
        node.look_up_nested_during_outage();
        if restart == Restart::MountOverStale {
            node.supervisor().wait_death_detached(pid, cycle, HEAL_TIMEOUT).unwrap();
        }
        node.source.restart(&node.sandbox, restart).expect("restart the daemon");
        let when = format!("after heal {cycle}");
        node.all_read(&when);
        node.one_layer_each(&when);
        scenario::wait_for("the host's baseline mount count", HEAL_TIMEOUT, || node.host_mounts() == host_baseline)
            .unwrap_or_else(|err| panic!("{when}: {err}: {} now, {host_baseline} before", node.host_mounts()));
        broken.extend(node.broken_promises().into_iter().map(|promise| (cycle, promise)));
    }

    // A container created after the heals, in a pod whose target was
    // healed: containerd stats its volume first, and a dead one stops it.
    let healed = node.running.iter().find(|running| running.ask.name == "whole-none").expect("the whole-none pod");
    let (pod, target) = (healed.pod.clone(), healed.target.clone());
    let mounts = vec![VolumeMount {
        host_path: target,
        container_path: VOLUME.into(),
        read_only: false,
        propagation: Propagation::None,
    }];
    let spec = ContainerSpec { name: "late".into(), mounts };
    let late =
        node.containerd().start_container(&node.sandbox, &pod, &spec).expect("start a container after the heals");
    let expected = node.source.expected_content();
    let read = late.exec(&["cat", &format!("{VOLUME}/{DATA_FILE}")]).expect("ExecSync in the late container");
    assert_eq!((read.exit_code, read.stdout.as_str()), (0, expected.as_str()), "the late container: {read:?}");

    node.stop_containerd();
    assert!(broken.is_empty(), "what the pods asked for did not survive the heals:\n{}", report(&broken));
}

/// bindfs (libfuse3) restarting as libfuse daemons must: the stale mount
/// detached, then a fresh mount.
#[test]
fn what_the_pods_asked_for_survives_every_heal_after_bindfs_restarts() {
    what_the_pods_asked_for_survives_every_heal(Daemon::Bindfs, Restart::UnmountThenMount, 10);
}

/// sshfs (libfuse3) handed a connection mounted raw over its stale mount:
/// the new mount reaches every target by propagation.
#[test]
fn what_the_pods_asked_for_survives_every_heal_after_sshfs_mounts_over_its_stale_mount() {
    what_the_pods_asked_for_survives_every_heal(Daemon::Sshfs, Restart::MountOverStale, 10);
}
