//! The serverless Job lifecycle and sidecar mode end to end, as root: a
//! real FUSE daemon (demofs, or bindfs) and application processes in a
//! private mount namespace, each in a cgroup named like a containerd
//! container, a kubelet stand-in serving the pod as the test changes it,
//! and `fuse-supervisor run` in the namespace.
use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use fuse_supervisor::job::{PointError, RecordedMount, UnmountError, record_mounts, unmount_devices, unmount_recorded};
use fuse_supervisor_engine::model::table::Snapshot;
use fuse_supervisor_engine::watch::processes::fuse_server::MountDevice;
use fuse_supervisor_testbed::cgroup::ContainerCgroup;
use fuse_supervisor_testbed::kubelet::{KubeletStandIn, pod_list_body};
use fuse_supervisor_testbed::scenario::{
    DATA_FILE, Daemon, FuseSource, Restart, SupervisorProcess, fuse_mount_ids_at, wait_for,
};
use fuse_supervisor_testbed::tenant::TenantFuse;
use fuse_supervisor_testbed::{ContainerReader, Sandbox, SandboxChild, system};
use serde_json::{Value, json};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
/// The test world's programs (demofs, refuse-calls…).
const TESTBED: &str = env!("CARGO_BIN_EXE_fuse-supervisor-testbed");
const TIMEOUT: Duration = Duration::from_secs(30);
const UID: &str = "7d4c2a10-job0-4000-a000-000000000001";
const LABEL: &str = "done.sidecar.fluid.io/inject";
const STARTED: &str = "2025-03-04T05:06:07Z";

/// What the kubelet stand-in says about one container.
#[derive(Clone)]
enum State {
    Running(String),
    Exited(String, i32),
}

impl State {
    fn status(&self, name: &str) -> Value {
        match self {
            State::Running(id) => json!({"name": name, "containerID": format!("containerd://{id}"), "ready": true,
                "restartCount": 0, "state": {"running": {"startedAt": STARTED}}}),
            State::Exited(id, code) => json!({"name": name, "containerID": format!("containerd://{id}"),
                "restartCount": 0, "state": {"terminated": {"exitCode": code,
                "reason": if *code == 0 { "Completed" } else { "Error" }, "startedAt": STARTED,
                "finishedAt": STARTED, "containerID": format!("containerd://{id}")}}}),
        }
    }
}

/// An application container: a shell in its cgroup that exits with its
/// code once the test creates its trigger file.
struct App {
    cgroup: ContainerCgroup,
    child: SandboxChild,
    trigger: PathBuf,
}

/// A Job's pod: an app container and a FUSE container whose mount is
/// published at a global path and bound into the pod's volume.
struct JobPod {
    policy: &'static str,
    native_sidecar: bool,
    apps: Vec<App>,
    fuse_cgroup: ContainerCgroup,
    daemon: SandboxChild,
    mount: PathBuf,
    target: PathBuf,
    app_state: State,
    supervisor: Option<SupervisorProcess>,
    kubelet: KubeletStandIn,
    // Last: the namespace goes after everything in it.
    sandbox: Sandbox,
}

impl JobPod {
    fn new(policy: &'static str, native_sidecar: bool, daemon: Daemon, ignore_term: bool, first_exit: i32) -> JobPod {
        let sandbox = Sandbox::new().expect("sandbox");
        let fuse_cgroup = ContainerCgroup::new().expect("a cgroup for the FUSE container (needs a writable cgroup fs)");
        let (backing, mount) = (sandbox.root().join("backing"), sandbox.runtime_root().join("job/fuse"));
        let dirs = (backing.clone(), mount.clone());
        sandbox
            .run(move || {
                fs::create_dir_all(&dirs.1)?;
                fs::create_dir_all(&dirs.0)?;
                fs::write(dirs.0.join(DATA_FILE), "job data")
            })
            .expect("backing directory");
        let command = match daemon {
            Daemon::DemoFs => {
                let (b, m) = (backing.display().to_string(), mount.display().to_string());
                fuse_cgroup.command(Path::new(TESTBED), &["demofs", "--backing", &b, "--mountpoint", &m], ignore_term)
            }
            Daemon::Bindfs => {
                let (b, m) = (backing.display().to_string(), mount.display().to_string());
                fuse_cgroup.command(&system::program("bindfs"), &["-f", "-o", "allow_other", &b, &m], ignore_term)
            }
            other => panic!("the Job tests run demofs or bindfs, not {}", other.name()),
        };
        let daemon = sandbox.spawn(command).expect("start the FUSE daemon");
        wait_for("the FUSE mount", TIMEOUT, || !fuse_mount_ids_at(&sandbox, &mount).is_empty()).expect("mounted");
        let target = sandbox.pod_volume_dir(UID, "data");
        sandbox.bind(&mount, &target).expect("bind into the pod");
        let kubelet = KubeletStandIn::start().expect("kubelet stand-in");
        let mut pod = JobPod {
            policy,
            native_sidecar,
            apps: Vec::new(),
            fuse_cgroup,
            daemon,
            mount,
            target,
            app_state: State::Running(String::new()),
            supervisor: None,
            kubelet,
            sandbox,
        };
        pod.start_app(first_exit);
        pod
    }

    /// A new instance of the app container (a restart), exiting with `code`.
    fn start_app(&mut self, code: i32) {
        let cgroup = ContainerCgroup::new().expect("a cgroup for the app container");
        let trigger = self.sandbox.root().join(format!("exit-{}", cgroup.id()));
        let script = format!("while [ ! -e '{}' ]; do sleep 0.02; done; exit {code}", trigger.display());
        let child = self.sandbox.spawn(cgroup.shell(&script)).expect("start the app");
        self.app_state = State::Running(cgroup.id().to_owned());
        self.apps.push(App { cgroup, child, trigger });
        self.publish();
    }

    /// The stand-in's answer from the current states.
    fn publish(&self) {
        self.kubelet.set_pods(pod_list_body([self.pod()]));
    }

    /// The stand-in lists the pod with a start time that is not one.
    fn publish_unreadable(&self) {
        let mut pod = self.pod();
        pod["status"]["containerStatuses"][0]["state"] = json!({"running": {"startedAt": "soon"}});
        self.kubelet.set_pods(pod_list_body([pod]));
    }

    fn pod(&self) -> Value {
        let fuse = State::Running(self.fuse_cgroup.id().to_owned()).status("fluid-fuse");
        let mut spec = json!({"nodeName": "node-a", "restartPolicy": self.policy, "containers": [{"name": "app"}]});
        let mut status = json!({"phase": "Running", "containerStatuses": [self.app_state.status("app")]});
        if self.native_sidecar {
            spec["initContainers"] = json!([{"name": "fluid-fuse", "restartPolicy": "Always"}]);
            status["initContainerStatuses"] = json!([fuse]);
        } else {
            spec["containers"].as_array_mut().unwrap().push(json!({"name": "fluid-fuse"}));
            status["containerStatuses"].as_array_mut().unwrap().push(fuse);
        }
        json!({"metadata": {"name": "etl-x7k2p", "namespace": "default", "uid": UID,
            "labels": {LABEL: "true", "job-name": "etl"}}, "spec": spec, "status": status})
    }

    fn start_supervisor(&mut self, grace: &str) {
        let mut args = self.kubelet.client_args(&self.sandbox).expect("credentials");
        args.extend(["--job-lifecycle", "--job-grace", grace].map(String::from));
        let state = self.sandbox.root().join("state");
        self.supervisor =
            Some(SupervisorProcess::start_with(&self.sandbox, Path::new(BINARY), &state, args).expect("supervisor"));
    }

    fn supervisor(&self) -> &SupervisorProcess {
        self.supervisor.as_ref().expect("supervisor running")
    }

    fn logged(&self, pred: impl Fn(&str) -> bool) -> String {
        self.supervisor().wait_for_log(TIMEOUT, pred).expect("log line")
    }

    fn logged_message(&self, message: &str) -> String {
        let quoted = format!("\"message\":\"{message}");
        self.logged(|line| line.contains(&quoted))
    }

    /// Waits until the lifecycle watches the current app instance.
    fn app_watched(&self) {
        let pid = format!("\"pid\":{}", self.apps.last().expect("an app").child.pid());
        self.logged(|line| line.contains("watching application process") && line.contains(&pid));
    }

    /// The current app instance exits with its code; the kubelet shows it
    /// only afterwards (its status lags).
    fn app_exits(&mut self, code: i32) {
        let app = self.apps.last().expect("an app");
        let trigger = app.trigger.clone();
        self.sandbox.run(move || fs::write(trigger, "")).expect("trigger");
        let status = app.child.wait().expect("app exit");
        assert_eq!(status.code(), Some(code));
        self.app_state = State::Exited(app.cgroup.id().to_owned(), code);
        self.publish();
    }

    fn fuse_mounts(&self) -> usize {
        fuse_mount_ids_at(&self.sandbox, &self.mount).len() + fuse_mount_ids_at(&self.sandbox, &self.target).len()
    }

    fn daemon_runs(&self) -> bool {
        self.daemon.try_wait().expect("daemon status").is_none()
    }

    /// A look at the kubelet prompted from outside (a new pod directory),
    /// done, so that anything the lifecycle would do with the current
    /// answer is done.
    fn another_look(&self, name: &str) {
        let answered = self.answered();
        let dir = self.sandbox.kubelet_root().join("pods").join(name);
        self.sandbox.run(move || fs::create_dir_all(dir)).expect("pod directory");
        wait_for("another kubelet answer", TIMEOUT, || self.answered() > answered).expect("answered");
    }

    fn answered(&self) -> usize {
        self.supervisor
            .as_ref()
            .map_or(0, |s| s.log().iter().filter(|l| l.contains("pods listed for the job lifecycle")).count())
    }
}

#[test]
fn finished_app_unmounts_the_fuse_mount_and_the_daemon_exits() {
    let mut pod = JobPod::new("Never", false, Daemon::DemoFs, false, 0);
    pod.start_supervisor("10s");
    pod.app_watched();
    assert_eq!(pod.fuse_mounts(), 2);
    pod.app_exits(0);
    let finished = pod.logged_message("application containers finished");
    assert!(finished.contains("app=0 (Completed)"), "{finished}");
    let ended = pod.logged_message("FUSE daemon exited");
    assert!(ended.contains("\"ended_by\":\"unmount\""), "{ended}");
    wait_for("the daemon reaped", TIMEOUT, || !pod.daemon_runs()).expect("daemon gone");
    assert_eq!(pod.fuse_mounts(), 0, "{}", pod.sandbox.mountinfo());
    assert!(pod.supervisor().log().iter().all(|line| !line.contains("signalling")));
}

#[test]
fn a_pod_listed_unreadable_for_a_while_keeps_its_watches() {
    let mut pod = JobPod::new("Never", false, Daemon::DemoFs, false, 0);
    pod.start_supervisor("10s");
    pod.app_watched();
    pod.publish_unreadable();
    pod.another_look("prompt");
    let skipped = pod.logged_message("kubelet listed a pod that cannot be read; skipped");
    assert!(skipped.contains("default/etl-x7k2p") && skipped.contains(UID), "{skipped}");
    // Still watched: the exit is seen, and the pod ends as it would have.
    pod.app_exits(0);
    pod.logged_message("application containers finished");
    wait_for("the daemon reaped", TIMEOUT, || !pod.daemon_runs()).expect("daemon gone");
    let log = pod.supervisor().log();
    assert!(!log.iter().any(|line| line.contains("\"pod gone\"")), "the unreadable pod was forgotten");
}

#[test]
fn on_failure_with_exit_1_waits_for_the_restarted_container_to_succeed() {
    let mut pod = JobPod::new("OnFailure", false, Daemon::DemoFs, false, 1);
    pod.start_supervisor("10s");
    pod.app_watched();
    pod.app_exits(1);
    let waiting = pod.logged_message("OnFailure: waiting for the failed containers to run again");
    assert!(waiting.contains("app=1 (Error)"), "{waiting}");
    pod.another_look("some-other-pod");
    assert!(pod.daemon_runs() && pod.fuse_mounts() == 2, "touched before the container was done");

    // The kubelet restarts it; this time it succeeds.
    pod.start_app(0);
    pod.app_watched();
    assert!(pod.daemon_runs() && pod.fuse_mounts() == 2);
    pod.app_exits(0);
    pod.logged_message("FUSE daemon exited");
    wait_for("the daemon reaped", TIMEOUT, || !pod.daemon_runs()).expect("daemon gone");
    assert_eq!(pod.fuse_mounts(), 0);
}

#[test]
fn restart_policy_always_is_never_touched() {
    let mut pod = JobPod::new("Always", false, Daemon::DemoFs, false, 0);
    pod.start_supervisor("1s");
    pod.logged(|line| line.contains("restartPolicy Always"));
    pod.app_exits(0);
    pod.another_look("some-other-pod");
    pod.another_look("yet-another-pod");
    assert!(pod.daemon_runs() && pod.fuse_mounts() == 2);
    assert!(pod.supervisor().log().iter().all(|line| !line.contains("application containers finished")));
}

#[test]
fn a_native_sidecar_is_left_to_the_kubelet() {
    let mut pod = JobPod::new("Never", true, Daemon::DemoFs, false, 0);
    pod.start_supervisor("1s");
    let judged = pod.logged_message("job pod");
    assert!(judged.contains("\"assessment\":\"native-sidecar\""), "{judged}");
    pod.app_exits(0);
    pod.another_look("some-other-pod");
    assert!(pod.daemon_runs() && pod.fuse_mounts() == 2);
}

#[test]
fn a_daemon_that_outlives_its_unmount_and_ignores_sigterm_is_killed_after_the_grace() {
    // bindfs (libfuse) keeps an ignored SIGTERM ignored; a process in a
    // namespace of its own holds a copy of the mount, so the connection
    // survives the unmount and the daemon keeps serving.
    let mut pod = JobPod::new("Never", false, Daemon::Bindfs, true, 0);
    let mut holder = Command::new(system::program("unshare"));
    holder.args(["--mount", "--propagation", "private", "sleep", "600"]);
    let holder = pod.sandbox.spawn(holder).expect("holder");
    pod.start_supervisor("1s");
    pod.app_watched();
    pod.app_exits(0);
    pod.logged_message("unmounted FUSE mount");
    let term = pod.logged(|line| line.contains("signalling") && line.contains("\"signal\":\"Term\""));
    assert!(term.contains(&format!("\"pid\":{}", pod.daemon.pid())), "{term}");
    pod.logged(|line| line.contains("signalling") && line.contains("\"signal\":\"Kill\""));
    let ended = pod.logged_message("FUSE daemon exited");
    assert!(ended.contains("\"ended_by\":\"SIGKILL\""), "{ended}");
    wait_for("the daemon reaped", TIMEOUT, || !pod.daemon_runs()).expect("daemon gone");
    assert_eq!(pod.fuse_mounts(), 0);
    holder.kill().expect("holder");
}

#[test]
fn sidecar_mode_heals_only_its_own_pods_targets() {
    let sandbox = Sandbox::new().expect("sandbox");
    let binary = Path::new(BINARY);
    let mut mine = FuseSource::start(&sandbox, Daemon::DemoFs, "mine").expect("source");
    let mut other = FuseSource::start(&sandbox, Daemon::DemoFs, "other").expect("source");
    let my_target = mine.bind_volume(&sandbox, "my-pod", "data").expect("bind");
    let other_target = other.bind_volume(&sandbox, "other-pod", "data").expect("bind");
    let state = sandbox.root().join("state");
    let args = ["--kubelet", "none", "--sidecar", "--pod-uid", "my-pod"];
    let supervisor = SupervisorProcess::start_with(&sandbox, binary, &state, args).expect("supervisor");
    supervisor.wait_for_log(TIMEOUT, |line| line.contains("job lifecycle is off")).expect("no kubelet, no lifecycle");
    for source in [&mut mine, &mut other] {
        source.restart(&sandbox, Restart::UnmountThenMount).expect("restart");
    }
    let read = |target: &Path| {
        let file = target.join(DATA_FILE);
        sandbox.run(move || fs::read_to_string(file))
    };
    let expected = mine.expected_content();
    wait_for("own target healed", TIMEOUT, || read(&my_target).is_ok_and(|text| text == expected))
        .unwrap_or_else(|err| panic!("{err}; supervisor log:\n{}", supervisor.log().join("\n")));
    // The other pod's source is back too, and its target stays broken.
    assert_eq!(read(&other.path).expect("other source"), other.expected_content());
    supervisor.wait_for_log(TIMEOUT, |line| line.contains("\"healed\"")).expect("healed line");
    let err = read(&other_target).expect_err("another pod's target was healed");
    assert_eq!(err.raw_os_error(), Some(107), "ENOTCONN: {err}");
    let other_name = other_target.display().to_string();
    assert!(supervisor.log().iter().all(|line| !line.contains(&other_name)), "another pod's target was considered");
    supervisor.stop().expect("stop");
}

/// The devices of the FUSE mounts at `path` in the sandbox, as the
/// lifecycle learns them from the daemon's descriptor.
fn devices_at(sandbox: &Sandbox, path: &Path) -> Vec<MountDevice> {
    let snapshot = Snapshot::parse(sandbox.mountinfo().as_bytes()).expect("the sandbox's table parses");
    let devices: Vec<MountDevice> = snapshot
        .fuse_mounts
        .iter()
        .filter(|m| m.mount_point == path)
        .map(|m| MountDevice { major: m.dev.major, minor: m.dev.minor })
        .collect();
    assert!(!devices.is_empty(), "no FUSE mount at {}", path.display());
    devices
}

/// A tenant swaps a directory on the mount point's path for a symlink to
/// another mount after the lifecycle read its table: the unmount resolves
/// the path anew without links, so it fails naming the path, and neither the
/// other mount nor the FUSE mount (moved along with its directory) is touched.
#[test]
fn a_directory_swapped_for_a_symlink_after_the_table_was_read_unmounts_nothing_elsewhere() {
    let sandbox = Sandbox::new().expect("sandbox");
    let (tenant, victim) = (sandbox.root().join("tenant"), sandbox.root().join("victim"));
    let mount_point = tenant.join("a/b/mnt");
    let source = FuseSource::start_at(&sandbox, Daemon::DemoFs, "swapped", &mount_point).expect("demofs");
    let victim_mount = victim.join("b/mnt");
    let at = victim_mount.clone();
    sandbox
        .run(move || {
            fs::create_dir_all(&at)?;
            fuse_supervisor_sys::mount::mount_tmpfs(&at)?;
            fs::write(at.join("kept"), "victim")
        })
        .expect("the other mount");
    let namespace = sandbox.namespace_path();
    let deadline = || Instant::now() + TIMEOUT;

    let recorded = record_mounts(&namespace, &devices_at(&sandbox, &mount_point), deadline()).expect("recorded");
    assert!(recorded.refused.is_empty(), "{:?}", recorded.refused);
    let recorded_points: Vec<&Path> = recorded.mounts.iter().map(|m| m.mount_point.as_path()).collect();
    assert_eq!(recorded_points, [mount_point.as_path()]);

    let (a, moved, target) = (tenant.join("a"), tenant.join("a.moved"), victim.clone());
    sandbox.run(move || fs::rename(&a, moved).and_then(|()| symlink(target, &a))).expect("the tenant's swap");
    let done = unmount_recorded(&namespace, &recorded.mounts, deadline()).expect("unmount ran");

    assert!(done.unmounted.is_empty(), "unmounted {:?}", done.unmounted);
    let [failed] = &done.failed[..] else { panic!("one failure expected: {:?}", done.failed) };
    assert_eq!(failed.path(), mount_point);
    assert!(
        matches!(failed, PointError::Resolve { source, .. } if source.raw_os_error() == Some(40)),
        "ELOOP: {failed}"
    );
    assert!(failed.to_string().contains(&mount_point.display().to_string()), "{failed}");
    let kept = sandbox.outside_path(&victim_mount.join("kept"));
    assert_eq!(fs::read_to_string(kept).expect("the other mount still serves"), "victim");
    assert_eq!(sandbox.count_mounts_under(&victim_mount), 1, "{}", sandbox.mountinfo());
    assert_eq!(fuse_mount_ids_at(&sandbox, &tenant.join("a.moved/b/mnt")).len(), 1, "{}", sandbox.mountinfo());
    drop(source);
}

/// Without a swap the same two steps detach the FUSE mount through the
/// descriptor they checked, and its daemon sees the unmount and exits.
#[test]
fn recorded_mounts_are_detached_through_the_descriptor_checked() {
    let sandbox = Sandbox::new().expect("sandbox");
    let mount_point = sandbox.root().join("tenant/a/b/mnt");
    let source = FuseSource::start_at(&sandbox, Daemon::DemoFs, "plain", &mount_point).expect("demofs");
    let target = source.bind_volume(&sandbox, UID, "data").expect("bind into the pod");
    let namespace = sandbox.namespace_path();
    let devices = devices_at(&sandbox, &mount_point);
    let done = unmount_devices(&namespace, &devices, Instant::now() + TIMEOUT).expect("unmount ran");
    assert!(done.failed.is_empty(), "{:?}", done.failed);
    let mut unmounted = done.unmounted.clone();
    unmounted.sort();
    let mut expected = vec![mount_point.clone(), target.clone()];
    expected.sort();
    assert_eq!(unmounted, expected);
    assert!(fuse_mount_ids_at(&sandbox, &mount_point).is_empty(), "{}", sandbox.mountinfo());
    assert!(fuse_mount_ids_at(&sandbox, &target).is_empty(), "{}", sandbox.mountinfo());
}

/// A container's copy of the FUSE volume bound beneath a tenant's own FUSE
/// mount: reaching it would ask the tenant's daemon, so it is left and
/// reported by path (the container's own copy is unmounted); and a
/// recorded mount whose path walks through that daemon (a table read
/// before the tenant mounted) holds the unmount thread, which the caller
/// stops waiting for at the deadline, naming the namespace.
#[test]
fn a_mount_beneath_a_tenants_fuse_is_not_walked_and_a_hung_walk_is_not_waited_for() {
    let sandbox = Sandbox::new().expect("sandbox");
    let source = FuseSource::start(&sandbox, Daemon::DemoFs, "shared").expect("demofs");
    let volume = source.bind_volume(&sandbox, UID, "data").expect("bind into the pod");
    let reader = ContainerReader::spawn(&sandbox, "app", &volume, Path::new(DATA_FILE)).expect("container");
    let pid = reader.child().pid();
    let namespace = PathBuf::from(format!("/proc/{pid}/ns/mnt"));
    let rootfs = sandbox.root().join("containers/app/rootfs");
    let (tenant_dir, copy) = (rootfs.join("tenant"), rootfs.join("volume"));
    let tenant = TenantFuse::mount_over_copy(&sandbox, &namespace, &tenant_dir, &copy, "hidden").expect("tenant");
    let devices = devices_at(&sandbox, &source.path);

    let recorded = record_mounts(&namespace, &devices, Instant::now() + TIMEOUT).expect("recorded");
    let [refused] = &recorded.refused[..] else { panic!("one refusal expected: {:?}", recorded.refused) };
    assert!(matches!(refused, PointError::BeneathOtherFuse { fuse, .. } if *fuse == tenant_dir), "{refused}");
    assert_eq!(refused.path(), tenant.copy);
    let recorded_points: Vec<&Path> = recorded.mounts.iter().map(|m| m.mount_point.as_path()).collect();
    assert_eq!(recorded_points, [copy.as_path()]);

    let beneath = RecordedMount { mount_point: tenant.copy.clone(), ..recorded.mounts[0].clone() };
    let overdue = unmount_recorded(&namespace, &[beneath], Instant::now() + Duration::from_millis(500));
    assert!(matches!(&overdue, Err(UnmountError::Overdue { path, .. }) if *path == namespace), "{overdue:?}");
    // Released, the held thread finds another mount there and leaves it.
    tenant.release().expect("release the tenant");
    drop(tenant);

    let done = unmount_devices(&namespace, &devices, Instant::now() + TIMEOUT).expect("unmount ran");
    assert!(done.failed.is_empty(), "{:?}", done.failed);
    assert_eq!(done.unmounted, [copy]);
    reader.wait_until(TIMEOUT, |seen| seen.error().is_some()).expect("the container's copy is gone");
}
