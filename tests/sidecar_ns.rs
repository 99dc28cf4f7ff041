//! Sidecar mode without hostPID (`run --sidecar --sidecar-namespaces`): a
//! pod in a private mount namespace of its own (the sandbox) with a pid
//! namespace of its own (what `shareProcessNamespace` gives), a FUSE
//! container whose daemon crashes and comes back in the same container, and
//! application containers made from it that keep their dead copy of the
//! mount. The supervisor runs as one more process of the pod and sees only
//! the pod's processes (a proc mounted from the pod's pid namespace). Every
//! heal is judged from the container-model readers. Needs root, /dev/fuse,
//! nsenter and unshare.
//!
//! Cleanup: every process of the pod lives in its pid namespace, whose init
//! dies with the sandbox (`unshare --kill-child`), which takes every
//! process with it; the container namespaces and their mounts go with
//! their processes, the sandbox's with its thread.
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use fuse_supervisor_engine::model::table::Snapshot;
use fuse_supervisor_sys::process::{self, Signal};
use fuse_supervisor_testbed::cgroup::ContainerCgroup;
use fuse_supervisor_testbed::container::ContainerOptions;
use fuse_supervisor_testbed::kubelet::{KubeletStandIn, pod_list_body};
use fuse_supervisor_testbed::scenario::{self, SupervisorProcess};
use fuse_supervisor_testbed::{ContainerReader, Observation, Sandbox, SandboxChild, system};
use serde_json::json;

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
/// The test world's programs (demofs, refuse-calls…).
const TESTBED: &str = env!("CARGO_BIN_EXE_fuse-supervisor-testbed");
const TIMEOUT: Duration = Duration::from_secs(20);
const DATA_FILE: &str = "data.txt";
const SUBDIR_FILE: &str = "inner.txt";

/// The one child of `pid` (nsenter forks once into the pid namespace; its
/// child is the process that matters).
fn child_of(pid: u32) -> u32 {
    let children = PathBuf::from(format!("/proc/{pid}/task/{pid}/children"));
    let mut found = None;
    scenario::wait_for(&format!("a child of {pid}"), Duration::from_secs(5), || {
        found = fs::read_to_string(&children).ok().and_then(|text| text.split_whitespace().next()?.parse().ok());
        found.is_some()
    })
    .unwrap();
    found.unwrap()
}

fn fuse_mounts(mountinfo: &str) -> Vec<(PathBuf, PathBuf)> {
    let snapshot = Snapshot::parse(mountinfo.as_bytes()).unwrap();
    snapshot.fuse_mounts.into_iter().map(|mount| (mount.mount_point, mount.root)).collect()
}

/// `wrapper program args…`, in `cgroup` when given (moved there by a shell
/// before it execs `program`).
fn command_in(wrapper: &[OsString], cgroup: Option<&ContainerCgroup>, program: &Path, args: &[&str]) -> Command {
    let (program, args): (OsString, Vec<OsString>) = match cgroup {
        Some(cgroup) => {
            let inner = cgroup.command(program, args, false);
            (inner.get_program().to_owned(), inner.get_args().map(ToOwned::to_owned).collect())
        }
        None => (program.into(), args.iter().map(OsString::from).collect()),
    };
    let mut command = match wrapper.split_first() {
        Some((first, rest)) => {
            let mut command = Command::new(first);
            command.args(rest).arg(program);
            command
        }
        None => Command::new(program),
    };
    command.args(args);
    command
}

/// A FUSE container in the pod: a mount namespace made from the node's
/// like runc makes one (everything a slave), holding its first process
/// (in `cgroup`, when given). Returns the `nsenter` child and the
/// container's first process.
fn fuse_container(sandbox: &Sandbox, pause: &SandboxChild, cgroup: Option<&ContainerCgroup>) -> (SandboxChild, u32) {
    let in_pod = [
        system::program("nsenter").into(),
        format!("--pid=/proc/{}/ns/pid_for_children", pause.pid()).into(),
        "--".into(),
    ];
    let args = ["--mount", "--propagation", "slave", "sleep", "infinity"];
    let command = command_in(&in_pod, cgroup, &system::program("unshare"), &args);
    let nsenter = sandbox.spawn(command).expect("fuse container");
    let pid = child_of(nsenter.pid());
    // Its namespace is made once `unshare` has become `sleep`.
    let comm = format!("/proc/{pid}/comm");
    scenario::wait_for("the FUSE container's namespace", Duration::from_secs(5), || {
        fs::read_to_string(&comm).is_ok_and(|name| name.trim() == "sleep")
    })
    .unwrap();
    (nsenter, pid)
}

/// Which FUSE daemon the FUSE container runs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Daemon {
    DemoFs,
    Bindfs,
}

/// How the FUSE daemon comes back.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Restart {
    /// In the same container (its dead mount detached first).
    SameContainer,
    /// The FUSE container is restarted: a new mount namespace, which the
    /// supervisor has never seen.
    NewContainer,
}

struct Pod {
    // Declared first: dropped before the sandbox.
    readers: Vec<ContainerReader>,
    /// The FUSE container's cgroup (named like a containerd container's),
    /// for the Job lifecycle to tell the pod's containers apart.
    fuse_cgroup: Option<ContainerCgroup>,
    supervisor: Option<SupervisorProcess>,
    daemon: Option<SandboxChild>,
    fuse_container: SandboxChild,
    /// The FUSE container's first process (host pid): its namespace.
    fuse_container_pid: u32,
    /// `unshare --pid --fork`: the pod's pid namespace is its children's.
    pause: SandboxChild,
    proc_root: PathBuf,
    mountpoint: PathBuf,
    backing: PathBuf,
    generation: u32,
    daemon_kind: Daemon,
    sandbox: Sandbox,
}

impl Pod {
    fn new(daemon: Daemon) -> Pod {
        Pod::with_cgroup(daemon, None)
    }

    fn with_cgroup(daemon: Daemon, fuse_cgroup: Option<ContainerCgroup>) -> Pod {
        let sandbox = Sandbox::new().expect("sandbox");
        let root = sandbox.root().to_path_buf();
        let (proc_root, mountpoint, backing) = (root.join("pod-proc"), root.join("pod/fuse"), root.join("backing"));
        let dirs = [proc_root.clone(), mountpoint.clone(), backing.join("sub")];
        let inner = backing.join("sub").join(SUBDIR_FILE);
        sandbox
            .run(move || {
                dirs.iter().try_for_each(fs::create_dir_all)?;
                fs::write(inner, "inside sub")
            })
            .unwrap();
        // The pod's pid namespace, with a proc of its own for the supervisor.
        let mut pause = Command::new(system::program("unshare"));
        pause
            .args(["--pid", "--fork", "--kill-child", "sh", "-c"])
            .arg(format!("mount -t proc proc '{}' && exec sleep infinity", proc_root.display()));
        let pause = sandbox.spawn(pause).expect("pause");
        let probe = proc_root.join("1");
        scenario::wait_for("the pod's proc", Duration::from_secs(5), || {
            let probe = probe.clone();
            sandbox.run(move || probe.exists())
        })
        .unwrap();
        let (fuse_container, fuse_container_pid) = fuse_container(&sandbox, &pause, fuse_cgroup.as_ref());
        let mut pod = Pod {
            readers: Vec::new(),
            fuse_cgroup,
            supervisor: None,
            daemon: None,
            fuse_container,
            fuse_container_pid,
            pause,
            proc_root,
            mountpoint,
            backing,
            generation: 0,
            daemon_kind: daemon,
            sandbox,
        };
        pod.start_daemon();
        pod
    }

    fn in_pod(&self) -> Vec<OsString> {
        vec![
            system::program("nsenter").into(),
            format!("--pid=/proc/{}/ns/pid_for_children", self.pause.pid()).into(),
            "--".into(),
        ]
    }

    fn in_fuse_container(&self) -> Vec<OsString> {
        let mut wrapper = self.in_pod();
        wrapper.insert(2, format!("--mount=/proc/{}/ns/mnt", self.fuse_container_pid).into());
        wrapper
    }

    fn expected(&self) -> String {
        format!("generation {}", self.generation)
    }

    fn fuse_container_table(&self) -> String {
        fs::read_to_string(format!("/proc/{}/mountinfo", self.fuse_container_pid)).unwrap()
    }

    /// demofs in the FUSE container, serving the current generation.
    fn start_daemon(&mut self) {
        let (file, content) = (self.backing.join(DATA_FILE), self.expected());
        self.sandbox.run(move || fs::write(file, content)).unwrap();
        let before = fuse_mounts(&self.fuse_container_table()).len();
        let (backing, mountpoint) = (self.backing.display().to_string(), self.mountpoint.display().to_string());
        let (program, args) = match self.daemon_kind {
            Daemon::DemoFs => {
                (PathBuf::from(TESTBED), vec!["demofs", "--backing", &backing, "--mountpoint", &mountpoint])
            }
            Daemon::Bindfs => (system::program("bindfs"), vec!["-f", "-o", "allow_other", &backing, &mountpoint]),
        };
        let mut command = command_in(&self.in_fuse_container(), self.fuse_cgroup.as_ref(), &program, &args);
        command.stdin(Stdio::null()).stdout(Stdio::null());
        self.daemon = Some(self.sandbox.spawn(command).expect("demofs"));
        scenario::wait_for("demofs mounted in the FUSE container", TIMEOUT, || {
            fuse_mounts(&self.fuse_container_table()).len() > before
        })
        .unwrap();
    }

    /// SIGKILL the daemon, detach its dead mount in the FUSE container (as a
    /// libfuse daemon's restart must), and start it again with new content.
    fn crash(&mut self) {
        let nsenter = self.daemon.take().expect("daemon running");
        process::signal(child_of(nsenter.pid()), Signal::Kill).unwrap();
        nsenter.wait().unwrap();
    }

    fn restart(&mut self, how: Restart) {
        match how {
            Restart::SameContainer => {
                let status = Command::new(system::program("nsenter"))
                    .arg(format!("--mount=/proc/{}/ns/mnt", self.fuse_container_pid))
                    .arg("--")
                    .arg(system::program("umount"))
                    .arg("-l")
                    .arg(&self.mountpoint)
                    .status()
                    .unwrap();
                assert!(status.success(), "cannot detach the dead mount in the FUSE container");
            }
            Restart::NewContainer => {
                // The old namespace, and its dead mount, go with its last process.
                process::signal(self.fuse_container_pid, Signal::Kill).unwrap();
                self.fuse_container.wait().unwrap();
                let (nsenter, pid) = fuse_container(&self.sandbox, &self.pause, self.fuse_cgroup.as_ref());
                (self.fuse_container, self.fuse_container_pid) = (nsenter, pid);
            }
        }
        self.generation += 1;
        self.start_daemon();
    }

    /// An application container made from the FUSE container's namespace
    /// (its copy of the mount, as it got it through the pod's emptyDir),
    /// reading `volume` (the mount or a directory in it). It sees neither
    /// the node's trees nor the mount's own path.
    fn add_reader(&mut self, name: &str, volume: &Path, read: &str) {
        let options = ContainerOptions {
            volume: volume.to_path_buf(),
            rootfs: self.sandbox.container_rootfs(name).unwrap(),
            hide: vec![self.sandbox.kubelet_root(), self.sandbox.runtime_root(), self.mountpoint.clone()],
            read: PathBuf::from(read),
            interval: Duration::from_millis(2),
            propagation: fuse_supervisor_sys::mount::Propagation::Slave,
            wake_on_mount_change: false,
        };
        let reader = ContainerReader::spawn_wrapped(&self.sandbox, &self.in_fuse_container(), name, &options);
        self.readers.push(reader.expect("reader"));
    }

    fn start_supervisor(&mut self) {
        self.start_supervisor_with(&["--kubelet", "none", "--pod-uid", "test-pod"], None);
    }

    /// Started with `extra` arguments, in `cgroup` (its own container's)
    /// when given.
    fn start_supervisor_with(&mut self, extra: &[&str], cgroup: Option<&ContainerCgroup>) {
        let mut wrapper = self.in_pod();
        if let Some(cgroup) = cgroup {
            // `sh -c 'move; exec "$0" "$@"'`, with the binary as `$0`.
            let inner = cgroup.command(Path::new(BINARY), &[], false);
            wrapper.push(inner.get_program().to_owned());
            wrapper.extend(inner.get_args().take_while(|arg| *arg != BINARY).map(ToOwned::to_owned));
        }
        let proc_root = self.proc_root.clone().into_os_string();
        let run = ["--sidecar", "--sidecar-namespaces", "--proc-root"];
        let args = extra.iter().chain(&run).map(OsString::from).chain([proc_root]);
        let state_dir = self.sandbox.root().join("state");
        let supervisor = SupervisorProcess::start_wrapped(&self.sandbox, &wrapper, Path::new(BINARY), &state_dir, args);
        self.supervisor = Some(supervisor.expect("supervisor"));
    }

    fn supervisor(&self) -> &SupervisorProcess {
        self.supervisor.as_ref().expect("supervisor running")
    }

    /// The FUSE mounts a reader's container has: (mount point, root).
    fn reader_mounts(&self, index: usize) -> Vec<(PathBuf, PathBuf)> {
        let pid = child_of(self.readers[index].child().pid());
        fuse_mounts(&fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap())
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("FUSE container mount table:\n{}", self.fuse_container_table());
        }
        let _ = self.fuse_container.kill();
        // Its --kill-child takes the pod's pid namespace down with it.
        let _ = self.pause.kill();
    }
}

/// A Job's application container in the pod: a shell in a cgroup named
/// like a containerd container and a mount namespace made from the FUSE
/// container's (its copy of the volume), which exits 0 once `trigger`
/// exists.
fn job_app(pod: &Pod, cgroup: &ContainerCgroup, trigger: &Path) -> SandboxChild {
    let wait = format!("while [ ! -e '{}' ]; do sleep 0.02; done", trigger.display());
    let args = ["--mount", "--propagation", "slave", "sh", "-c", &wait];
    let command = command_in(&pod.in_fuse_container(), Some(cgroup), &system::program("unshare"), &args);
    let app = pod.sandbox.spawn(command).expect("app");
    let pid = child_of(app.pid());
    scenario::wait_for("the app's FUSE mount", TIMEOUT, || {
        fs::read_to_string(format!("/proc/{pid}/mountinfo")).is_ok_and(|table| !fuse_mounts(&table).is_empty())
    })
    .unwrap();
    app
}

/// The kubelet's view of the Job's pod: the app running (`None`) or
/// exited with a code, the FUSE container running.
fn job_pod(uid: &str, app: &str, exited: Option<i32>, fuse: &str, supervisor: &str) -> serde_json::Value {
    const STARTED: &str = "2025-03-04T05:06:07Z";
    let container_id = |id: &str| format!("containerd://{id}");
    let app_state = match exited {
        None => json!({"running": {"startedAt": STARTED}}),
        Some(code) => json!({"terminated": {"exitCode": code, "reason": "Completed", "startedAt": STARTED,
            "finishedAt": STARTED, "containerID": container_id(app)}}),
    };
    json!({
        "metadata": {"name": "etl-x7k2p", "namespace": "default", "uid": uid},
        "spec": {"nodeName": "node-a", "restartPolicy": "Never",
            "containers": [{"name": "app"}, {"name": "fluid-fuse"}, {"name": "fuse-supervisor"}]},
        "status": {"phase": "Running", "containerStatuses": [
            {"name": "app", "containerID": container_id(app), "restartCount": 0, "state": app_state},
            {"name": "fluid-fuse", "containerID": container_id(fuse), "restartCount": 0, "ready": true,
                "state": {"running": {"startedAt": STARTED}}},
            {"name": "fuse-supervisor", "containerID": container_id(supervisor), "restartCount": 0, "ready": true,
                "state": {"running": {"startedAt": STARTED}}},
        ]},
    })
}

#[test]
fn a_finished_job_ends_the_fuse_container_and_the_supervisor_without_host_pid() {
    const UID: &str = "7d4c2a10-side-4000-a000-000000000001";
    let fuse = ContainerCgroup::new().expect("a cgroup for the FUSE container (needs a writable cgroup fs)");
    let fuse_id = fuse.id().to_owned();
    let mut pod = Pod::with_cgroup(Daemon::DemoFs, Some(fuse));
    let app_cgroup = ContainerCgroup::new().expect("a cgroup for the app container");
    let supervisor_cgroup = ContainerCgroup::new().expect("a cgroup for the supervisor's container");
    let trigger = pod.sandbox.root().join("app-done");
    let app = job_app(&pod, &app_cgroup, &trigger);
    let kubelet = KubeletStandIn::start().expect("kubelet stand-in");
    kubelet.set_pods(pod_list_body([job_pod(UID, app_cgroup.id(), None, &fuse_id, supervisor_cgroup.id())]));
    let mut args = kubelet.client_args(&pod.sandbox).expect("credentials");
    args.extend(["--pod-uid", UID, "--job-grace", "10s"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    pod.start_supervisor_with(&args, Some(&supervisor_cgroup));
    pod.supervisor().wait_for_log(TIMEOUT, |line| line.contains("watching application process")).unwrap();

    pod.sandbox.run(move || fs::write(trigger, "")).expect("trigger");
    assert_eq!(app.wait().expect("app exit").code(), Some(0));
    kubelet.set_pods(pod_list_body([job_pod(UID, app_cgroup.id(), Some(0), &fuse_id, supervisor_cgroup.id())]));
    let finished = pod.supervisor().wait_for_log(TIMEOUT, |line| line.contains("application containers finished"));
    assert!(finished.unwrap().contains("app=0 (Completed)"));
    let ended = pod.supervisor().wait_for_log(TIMEOUT, |line| line.contains("\"FUSE daemon exited\""));
    assert!(ended.unwrap().contains("\"ended_by\":\"unmount\""));
    let daemon = pod.daemon.take().expect("daemon");
    scenario::wait_for("the daemon gone", TIMEOUT, || daemon.try_wait().is_ok_and(|status| status.is_some())).unwrap();
    assert!(fuse_mounts(&pod.fuse_container_table()).is_empty(), "{}", pod.fuse_container_table());
    // With its FUSE container done, the supervisor exits: the pod completes.
    let mut exited = None;
    scenario::wait_for("the supervisor's exit", TIMEOUT, || {
        exited = pod.supervisor().try_wait().unwrap();
        exited.is_some()
    })
    .unwrap();
    assert!(exited.unwrap().success(), "{:?}", exited);
    assert!(pod.supervisor().log().iter().all(|line| !line.contains("signalling")));
}

fn reads(expected: String) -> impl Fn(&Observation) -> bool {
    move |observation| observation.content() == Some(expected.as_str())
}

fn fails(observation: &Observation) -> bool {
    observation.error().is_some()
}

#[test]
fn app_containers_are_healed_from_the_fuse_container_without_host_pid() {
    heals(Daemon::DemoFs, SupervisorStarts::BeforeTheCrash, Restart::SameContainer);
}

#[test]
fn bindfs_app_containers_are_healed_without_host_pid() {
    heals(Daemon::Bindfs, SupervisorStarts::BeforeTheCrash, Restart::SameContainer);
}

#[test]
fn a_supervisor_started_after_the_restart_heals_at_its_first_scan() {
    heals(Daemon::DemoFs, SupervisorStarts::AfterTheRestart, Restart::SameContainer);
}

#[test]
fn a_restarted_fuse_container_in_a_new_namespace_is_found_and_healed_from() {
    heals(Daemon::DemoFs, SupervisorStarts::BeforeTheCrash, Restart::NewContainer);
}

#[derive(PartialEq)]
enum SupervisorStarts {
    BeforeTheCrash,
    AfterTheRestart,
}

fn heals(daemon: Daemon, starts: SupervisorStarts, restart: Restart) {
    let mut pod = Pod::new(daemon);
    let mountpoint = pod.mountpoint.clone();
    pod.add_reader("app", &mountpoint, DATA_FILE);
    pod.add_reader("app-sub", &mountpoint.join("sub"), SUBDIR_FILE);
    pod.readers[0].wait_until(TIMEOUT, reads(pod.expected())).expect("app reads");
    pod.readers[1].wait_until(TIMEOUT, reads("inside sub".into())).expect("subPath reads");
    let node_before = pod.sandbox.mountinfo();
    assert!(fuse_mounts(&node_before).is_empty(), "the pod's FUSE mount leaked into the node:\n{node_before}");
    let volume_in_app = (pod.sandbox.root().join("containers/app/rootfs/volume"), PathBuf::from("/"));
    assert_eq!(pod.reader_mounts(0), std::slice::from_ref(&volume_in_app));
    if starts == SupervisorStarts::BeforeTheCrash {
        pod.start_supervisor();
    }

    pod.crash();
    for reader in &pod.readers {
        reader.wait_until(TIMEOUT, fails).expect("reader sees the crash");
    }
    if starts == SupervisorStarts::BeforeTheCrash {
        pod.supervisor().wait_for_log(TIMEOUT, |line| line.contains("fuse daemon exited")).unwrap();
    }
    pod.restart(restart);
    if starts == SupervisorStarts::AfterTheRestart {
        pod.start_supervisor();
    }

    pod.readers[0].wait_until(TIMEOUT, reads(pod.expected())).expect("app reads the new daemon");
    let seen = pod.readers[1].wait_until(TIMEOUT, reads("inside sub".into())).expect("subPath reads again");
    assert_eq!(
        seen.entries(),
        Some(&[SUBDIR_FILE.to_owned()][..]),
        "the subPath container sees more than its directory"
    );
    let healed = |line: &str| line.contains("\"healed\"");
    scenario::wait_for("two heals logged", TIMEOUT, || {
        pod.supervisor().log().iter().filter(|l| healed(l)).count() == 2
    })
    .unwrap();
    for line in pod.supervisor().log().iter().filter(|line| healed(line)) {
        assert!(line.contains("\"how\":\"replaced\""), "a dead layer was left: {line}");
    }
    // One layer in each container: the dead mount is gone, not covered.
    assert_eq!(pod.reader_mounts(0), [volume_in_app]);
    let sub_in_app = (pod.sandbox.root().join("containers/app-sub/rootfs/volume"), PathBuf::from("/sub"));
    assert_eq!(pod.reader_mounts(1), [sub_in_app]);
    // Nothing mounted outside the pod's containers: the node is as it was,
    // and the FUSE container has only its daemon's new mount.
    assert_eq!(pod.sandbox.mountinfo().lines().count(), node_before.lines().count());
    assert!(fuse_mounts(&pod.sandbox.mountinfo()).is_empty());
    assert_eq!(fuse_mounts(&pod.fuse_container_table()), [(mountpoint, PathBuf::from("/"))]);
    // The heals reach the reporters: metrics (and Events) see them.
    let metric = |series: &str| pod.supervisor().metric(series).unwrap().unwrap_or(0.0);
    // Reported just after the "healed" line is logged.
    scenario::wait_for("two heals counted", TIMEOUT, || {
        metric(r#"fuse_supervisor_heals_total{result="stacked"}"#) == 2.0
    })
    .unwrap();
    assert_eq!(metric("fuse_supervisor_targets_broken_total"), 2.0);
    assert_eq!(metric("fuse_supervisor_stale_layers_removed_total"), 2.0);
    assert_eq!(metric("fuse_supervisor_heal_outage_seconds_count"), 2.0);
    if starts == SupervisorStarts::BeforeTheCrash {
        assert!(metric(r#"fuse_supervisor_process_events_total{event="exited"}"#) >= 1.0);
    }
}
