//! A private containerd inside a sandbox, its pods and containers, and its
//! teardown down to the last shim, mount and cgroup.
use std::fs;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fuse_supervisor_sys::process::{self, Signal};
use fuse_supervisor_sys::{mount, ns};

use super::api::{self, NamespaceMode};
use super::client::{CriClient, ExecOutput};
use super::image;
use super::{ContainerSpec, CriError, io_step};
use crate::runc::{ContainerMount, parse_mountinfo};
use crate::{Sandbox, SandboxChild};

/// How long containerd may take to listen, and its images to reach the CRI.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long its processes may take to go once it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a command run in a container may take.
const EXEC_TIMEOUT: Duration = Duration::from_secs(10);
/// containerd's namespace for the CRI's images and containers.
const CRI_NAMESPACE: &str = "k8s.io";

static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(0);

/// A private containerd with the CRI plugin, running in a sandbox.
///
/// Everything it writes is under `<sandbox>/containerd-<n>` and a tmpfs on the
/// sandbox's `/run`; it, its shims and its pods' containers are in cgroups
/// under one parent named after it, in every hierarchy, so that every
/// process it started can be found and killed. (Not a pid namespace of its
/// own: runc reads `/proc/<pid>` of the processes it starts, and the
/// sandbox's `/proc` is the host's.)
/// [`Containerd::stop`] removes the pods through the CRI, kills what is
/// left and says what, if anything, survived; dropping it does the same.
pub struct Containerd {
    dir: PathBuf,
    client: Arc<CriClient>,
    processes: Processes,
    /// The sandbox's mount namespace, to find and detach its mounts even
    /// while the sandbox is being dropped.
    namespace: OwnedFd,
    kubelet_root: PathBuf,
    log: PathBuf,
    stopped: bool,
}

/// What was left of containerd after [`Containerd::stop`]: empty when
/// everything it started is gone.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Leftovers {
    /// Processes of its cgroups still alive: `<pid> <cmdline>`.
    pub processes: Vec<String>,
    /// Mounts of the sandbox under its directories or `/run/containerd`.
    pub mounts: Vec<String>,
    /// Its cgroups that could not be removed.
    pub cgroups: Vec<PathBuf>,
    /// CRI calls of the teardown that failed.
    pub errors: Vec<String>,
}

impl Leftovers {
    pub fn is_empty(&self) -> bool {
        self.processes.is_empty() && self.mounts.is_empty() && self.cgroups.is_empty() && self.errors.is_empty()
    }
}

/// A pod sandbox the CRI ran: its ID, and the config its containers are
/// created with (as the kubelet passes it again).
#[derive(Debug, Clone)]
pub struct Pod {
    pub id: String,
    pub uid: String,
    config: api::PodSandboxConfig,
}

/// A running container of a pod.
#[derive(Debug, Clone)]
pub struct CriContainer {
    pub name: String,
    pub id: String,
    /// Host pid of its first process.
    pub pid: u32,
    client: Arc<CriClient>,
}

impl Containerd {
    /// Starts containerd in `sandbox` and imports the busybox image (also
    /// its pause image); returns once the CRI lists both.
    pub fn start(sandbox: &Sandbox) -> Result<Containerd, CriError> {
        let n = NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed);
        // Its own directory: a socket left by an earlier instance would be
        // found before this one listens.
        let dir = sandbox.root().join(format!("containerd-{n}"));
        let config_path = dir.join("config.toml");
        let log = dir.join("containerd.log");
        let config = config_toml(&dir);
        let (made, archive, log_at) = (dir.clone(), dir.join("image.tar"), log.clone());
        let busybox = crate::system::program("busybox");
        let log_file = sandbox
            .run(move || -> io::Result<fs::File> {
                for sub in ["root", "state", "cni/conf", "cni/bin", "opt"] {
                    fs::create_dir_all(made.join(sub))?;
                }
                fs::write(&config_path, config)?;
                image::write_archive(&busybox, &archive)?;
                // Its runc state and shim sockets go to /run/containerd,
                // whatever `state` says. The tmpfs is on /run itself: the
                // host may have no /run/containerd, and one made there for
                // a mount point would be left behind.
                mount::mount_tmpfs(Path::new("/run"))?;
                fs::File::create(&log_at)
            })
            .map_err(io_step(format!("prepare containerd in {}", dir.display())))?;
        let namespace = fs::File::open(sandbox.namespace_path())
            .map_err(io_step(format!("open {}", sandbox.namespace_path().display())))?
            .into();

        // Removes what it made (cgroups, then processes) if the start fails.
        let mut processes = Processes {
            cgroup: format!("/fuse-supervisor-cri-{}-{n}", std::process::id()),
            containerd: None,
            killed: false,
        };
        let own_cgroups = processes.create_cgroups()?;
        // Moved into its cgroups before it execs: every shim inherits them.
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(r#"bin=$1 config=$2; shift 2; for procs; do echo $$ > "$procs" || exit 1; done; exec "$bin" --config "$config""#)
            .arg("containerd")
            .arg(crate::system::program("containerd"))
            .arg(dir.join("config.toml"))
            .args(own_cgroups)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().map_err(io_step("share containerd's log"))?)
            .stderr(log_file);
        let process = processes.containerd.insert(sandbox.spawn(command).map_err(io_step("start containerd"))?);
        let socket = dir.join("containerd.sock");
        let outside_socket = sandbox.outside_path(&socket);
        let outside_log = sandbox.outside_path(&log);
        let deadline = Instant::now() + START_TIMEOUT;
        while !crate::unix_socket_listens(&socket) {
            let exited = process.try_wait().ok().flatten().is_some();
            if exited || Instant::now() > deadline {
                let log = fs::read_to_string(&outside_log).unwrap_or_default();
                return Err(CriError::NotListening { socket, waited: START_TIMEOUT, log });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let client = Arc::new(CriClient::connect(&outside_socket)?);
        let containerd = Containerd {
            dir: dir.clone(),
            client,
            processes,
            namespace,
            kubelet_root: sandbox.kubelet_root(),
            log: outside_log,
            stopped: false,
        };
        containerd.import_image(sandbox)?;
        Ok(containerd)
    }

    /// `ctr images import` of the busybox layout (both names), in the
    /// sandbox; then waits until the CRI's image store has them.
    fn import_image(&self, sandbox: &Sandbox) -> Result<(), CriError> {
        let mut ctr = Command::new(crate::system::program("ctr"));
        ctr.arg("--address")
            .arg(self.dir.join("containerd.sock"))
            .args(["--namespace", CRI_NAMESPACE, "images", "import"])
            .arg(self.dir.join("image.tar"));
        let output = sandbox.run(move || ctr.output()).map_err(io_step("run ctr images import"))?;
        if !output.status.success() {
            return Err(CriError::Command {
                program: "ctr".into(),
                args: "images import".into(),
                status: output.status.to_string(),
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            });
        }
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let names = self.client.image_names()?;
            if [image::BUSYBOX, image::PAUSE].iter().all(|name| names.iter().any(|known| known == name)) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(CriError::Incomplete { call: "ListImages", what: "the imported images" });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Where its root, state, socket, configuration and log are.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn client(&self) -> &CriClient {
        &self.client
    }

    /// containerd's own log, for failure messages.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `RunPodSandbox` of a host-network pod named `name` with UID `uid`
    /// (its kubelet directory is `kubelet/pods/<uid>`), as the kubelet asks
    /// for one: no hostname (containerd refuses one with the host's
    /// network), its own cgroup under this instance's parent.
    pub fn run_pod(&self, sandbox: &Sandbox, name: &str, uid: &str) -> Result<Pod, CriError> {
        let log_directory = sandbox.root().join("logs/pods").join(format!("default_{name}_{uid}"));
        let created = log_directory.clone();
        sandbox.run(move || fs::create_dir_all(&created)).map_err(io_step("create the pod's log directory"))?;
        let labels = [
            ("io.kubernetes.pod.name", name),
            ("io.kubernetes.pod.namespace", "default"),
            ("io.kubernetes.pod.uid", uid),
        ]
        .into_iter()
        .map(|(key, value)| (key.to_owned(), value.to_owned()))
        .collect();
        let config = api::PodSandboxConfig {
            metadata: Some(api::PodSandboxMetadata {
                name: name.into(),
                uid: uid.into(),
                namespace: "default".into(),
                attempt: 0,
            }),
            log_directory: log_directory.to_string_lossy().into_owned(),
            labels,
            linux: Some(api::LinuxPodSandboxConfig {
                cgroup_parent: format!("{}/pod{uid}", self.processes.cgroup),
                security_context: Some(api::LinuxSandboxSecurityContext {
                    namespace_options: Some(host_network()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let id = self.client.run_pod_sandbox(config.clone())?;
        Ok(Pod { id, uid: uid.into(), config })
    }

    /// `CreateContainer` and `StartContainer` of `spec` in `pod`, with the
    /// mounts the kubelet gives a container: its volumeMounts, then the
    /// pod's `/etc/hosts` (the kubelet manages it for host-network pods
    /// too) and the container's termination log.
    pub fn start_container(
        &self,
        sandbox: &Sandbox,
        pod: &Pod,
        spec: &ContainerSpec,
    ) -> Result<CriContainer, CriError> {
        let pod_dir = self.kubelet_root.join("pods").join(&pod.uid);
        let hosts = pod_dir.join("etc-hosts");
        let termination_log = pod_dir.join("containers").join(&spec.name).join(format!("{:08x}", std::process::id()));
        let (hosts_at, log_at) = (hosts.clone(), termination_log.clone());
        sandbox
            .run(move || -> io::Result<()> {
                fs::create_dir_all(log_at.parent().unwrap_or(Path::new("/")))?;
                fs::write(&hosts_at, "127.0.0.1\tlocalhost\n")?;
                fs::write(&log_at, "")
            })
            .map_err(io_step(format!("write the kubelet's files of container {}", spec.name)))?;
        let mut mounts: Vec<api::Mount> = spec
            .mounts
            .iter()
            .map(|volume| api::Mount {
                container_path: volume.container_path.to_string_lossy().into_owned(),
                host_path: volume.host_path.to_string_lossy().into_owned(),
                readonly: volume.read_only,
                propagation: volume.propagation.to_cri().into(),
                ..Default::default()
            })
            .collect();
        for (container_path, host_path) in [("/etc/hosts", hosts), ("/dev/termination-log", termination_log)] {
            mounts.push(api::Mount {
                container_path: container_path.into(),
                host_path: host_path.to_string_lossy().into_owned(),
                ..Default::default()
            });
        }
        let config = api::ContainerConfig {
            metadata: Some(api::ContainerMetadata { name: spec.name.clone(), attempt: 0 }),
            image: Some(api::ImageSpec { image: image::BUSYBOX.into(), ..Default::default() }),
            mounts,
            labels: [("io.kubernetes.container.name".to_owned(), spec.name.clone())].into_iter().collect(),
            log_path: format!("{}/0.log", spec.name),
            linux: Some(api::LinuxContainerConfig {
                security_context: Some(api::LinuxContainerSecurityContext {
                    namespace_options: Some(host_network()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let id = self.client.create_container(&pod.id, config, pod.config.clone())?;
        self.client.start_container(&id)?;
        let pid = self.client.container_pid(&id)?;
        Ok(CriContainer { name: spec.name.clone(), id, pid, client: Arc::clone(&self.client) })
    }

    /// Removes every pod (and so every container) through the CRI, kills
    /// containerd and whatever of its namespace is left, detaches its
    /// mounts and removes its cgroups; returns what survived all that.
    pub fn stop(&mut self) -> Leftovers {
        self.stopped = true;
        let mut leftovers = Leftovers::default();
        match self.client.pod_sandboxes() {
            Ok(pods) => {
                for pod in pods {
                    let removed =
                        self.client.stop_pod_sandbox(&pod).and_then(|()| self.client.remove_pod_sandbox(&pod));
                    if let Err(err) = removed {
                        leftovers.errors.push(format!("pod {pod}: {err}"));
                    }
                }
            }
            Err(err) => leftovers.errors.push(err.to_string()),
        }
        let killed = self.processes.kill();
        leftovers.processes = killed.processes;
        leftovers.cgroups = killed.cgroups;
        leftovers.errors.extend(killed.errors);
        leftovers.mounts = self.detach_mounts();
        leftovers
    }

    /// Detaches (deepest first) every mount of the sandbox under
    /// containerd's directory or `/run/containerd`; returns their lines.
    fn detach_mounts(&self) -> Vec<String> {
        let dir = self.dir.clone();
        let found = std::thread::scope(|scope| {
            scope
                .spawn(|| -> io::Result<Vec<String>> {
                    ns::enter_mount_namespace(self.namespace.as_fd())?;
                    let table = fs::read_to_string("/proc/thread-self/mountinfo")?;
                    let mut mounts: Vec<ContainerMount> = parse_mountinfo(&table)
                        .into_iter()
                        .filter(|mount| {
                            mount.mount_point.starts_with(&dir) || mount.mount_point.starts_with("/run/containerd")
                        })
                        .collect();
                    mounts.sort_by_key(|mount| std::cmp::Reverse(mount.mount_point.components().count()));
                    for mount in &mounts {
                        // Gone already with its parent: nothing to do.
                        let _ = mount::detach(&mount.mount_point);
                    }
                    Ok(mounts
                        .iter()
                        .map(|mount| format!("{} {}", mount.mount_point.display(), mount.fs_type))
                        .collect())
                })
                .join()
        });
        match found {
            Ok(Ok(mounts)) => mounts,
            Ok(Err(err)) => vec![format!("cannot read the sandbox's mounts: {err}")],
            Err(_) => vec!["the thread reading the sandbox's mounts panicked".into()],
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if self.stopped {
            return;
        }
        if std::thread::panicking() {
            eprintln!("containerd log:\n{}", self.log());
        }
        let leftovers = self.stop();
        if !leftovers.is_empty() {
            eprintln!("containerd left {leftovers:?}");
        }
    }
}

impl std::fmt::Debug for Containerd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Containerd").field("dir", &self.dir).field("cgroup", &self.processes.cgroup).finish()
    }
}

/// containerd's process, and the cgroups every process it starts is in:
/// `/fuse-supervisor-cri-<pid>-<n>`, its own (`containerd`, which its shims
/// inherit) and each pod's below it. Killed and removed on drop, unless
/// [`Processes::kill`] did it already.
struct Processes {
    cgroup: String,
    containerd: Option<SandboxChild>,
    killed: bool,
}

impl Processes {
    /// Creates `<cgroup>/containerd` in every hierarchy where the test runs
    /// in the root cgroup; returns the files that move a process into
    /// them. Where the test runs in a cgroup of its own (a memory limit of
    /// whatever runs the tests), containerd stays in it: one hierarchy is
    /// enough to find its processes, and it is not taken out of that limit.
    fn create_cgroups(&self) -> Result<Vec<PathBuf>, CriError> {
        let step = || io_step(format!("create the cgroups of containerd under {}", self.cgroup));
        let own = std::process::id().to_string();
        let mut procs = Vec::new();
        for hierarchy in hierarchies() {
            let at_root = fs::read_to_string(hierarchy.join("cgroup.procs")).map_err(step())?;
            if !at_root.lines().any(|pid| pid.trim() == own) {
                continue;
            }
            let top = hierarchy.join(self.cgroup.trim_start_matches('/'));
            let dir = top.join("containerd");
            fs::create_dir_all(&dir)
                .and_then(|()| inherit_cpuset(&top))
                .and_then(|()| inherit_cpuset(&dir))
                .map_err(step())?;
            procs.push(dir.join("cgroup.procs"));
        }
        if procs.is_empty() {
            return Err(step()(io::Error::other("the tests run in no hierarchy's root cgroup")));
        }
        Ok(procs)
    }

    /// Kills containerd, then every process of its cgroups (shims and
    /// containers outlive it), and removes the cgroups; says what is left.
    fn kill(&mut self) -> Leftovers {
        self.killed = true;
        let mut leftovers = Leftovers::default();
        if let Some(Err(err)) = self.containerd.take().map(|containerd| containerd.kill()) {
            leftovers.errors.push(format!("kill containerd: {err}"));
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        leftovers.processes = loop {
            let alive = processes_in(&self.cgroup);
            if alive.is_empty() || Instant::now() > deadline {
                break alive.iter().map(|&pid| describe(pid)).collect();
            }
            for pid in alive {
                // Gone already: nothing to do.
                let _ = process::signal(pid, Signal::Kill);
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        leftovers.cgroups = remove_cgroups(&self.cgroup);
        leftovers
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        if !self.killed {
            let leftovers = self.kill();
            if !leftovers.is_empty() {
                eprintln!("containerd left {leftovers:?}");
            }
        }
    }
}

impl CriContainer {
    /// `ExecSync` of `command` in the container.
    pub fn exec(&self, command: &[&str]) -> Result<ExecOutput, CriError> {
        self.client.exec_sync(&self.id, command, EXEC_TIMEOUT)
    }

    /// The container's mount table, from `/proc/<pid>/mountinfo` on the host.
    pub fn mountinfo(&self) -> io::Result<String> {
        fs::read_to_string(format!("/proc/{}/mountinfo", self.pid))
    }

    /// The mounts stacked at `path` (inside the container), bottom first.
    pub fn mounts_at(&self, path: &Path) -> io::Result<Vec<ContainerMount>> {
        let mounts = parse_mountinfo(&self.mountinfo()?);
        Ok(mounts.into_iter().filter(|mount| mount.mount_point == path).collect())
    }

    /// The inode of the container's mount namespace.
    pub fn namespace_inode(&self) -> io::Result<u64> {
        Ok(fs::metadata(format!("/proc/{}/ns/mnt", self.pid))?.ino())
    }
}

/// The namespaces of a host-network pod's containers, as the kubelet asks
/// for them: the node's network, the pod's IPC, a pid namespace each.
fn host_network() -> api::NamespaceOption {
    api::NamespaceOption {
        network: NamespaceMode::Node.into(),
        pid: NamespaceMode::Container.into(),
        ipc: NamespaceMode::Pod.into(),
        ..Default::default()
    }
}

/// containerd's configuration: everything under `dir`, the CRI plugin with
/// no CNI (host-network pods only), a stream server on a free port of the
/// loopback (tests run side by side), the busybox image as the pause image.
fn config_toml(dir: &Path) -> String {
    let dir = dir.display();
    format!(
        r#"version = 2
root = "{dir}/root"
state = "{dir}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]

[grpc]
  address = "{dir}/containerd.sock"

[ttrpc]
  address = "{dir}/containerd.sock.ttrpc"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{dir}/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  # The tests run without CAP_SYS_RESOURCE on some machines: containerd
  # then may only raise a container's oom_score_adj, never lower it.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{dir}/cni/bin"
    conf_dir = "{dir}/cni/conf"
"#,
        pause = image::PAUSE,
    )
}

/// The roots of the machine's cgroup hierarchies: the unified one alone
/// (cgroup v2), or each mounted under `/sys/fs/cgroup` (v1 or hybrid).
fn hierarchies() -> Vec<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.procs").exists() {
        return vec![root.to_path_buf()];
    }
    let mut found: Vec<PathBuf> = fs::read_dir(root)
        .map(|entries| entries.filter_map(|entry| entry.ok()?.path().canonicalize().ok()).collect())
        .unwrap_or_default();
    found.retain(|hierarchy| hierarchy.join("cgroup.procs").exists());
    found.sort();
    found.dedup();
    found
}

/// A new v1 cpuset cgroup has no CPUs and no memory nodes, and takes no
/// process until given some: its parent's, as runc gives its own.
fn inherit_cpuset(dir: &Path) -> io::Result<()> {
    for file in ["cpuset.cpus", "cpuset.mems"] {
        let (own, parent) = (dir.join(file), dir.join("..").join(file));
        if own.exists() && fs::read_to_string(&own)?.trim().is_empty() {
            fs::write(&own, fs::read_to_string(&parent)?.trim())?;
        }
    }
    Ok(())
}

/// Every cgroup at or below `cgroup` in every hierarchy, deepest first.
fn cgroup_dirs(cgroup: &str) -> Vec<PathBuf> {
    fn walk(dir: &Path, found: &mut Vec<PathBuf>) {
        if let Ok(entries) = fs::read_dir(dir) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                    walk(&entry.path(), found);
                }
            }
        }
        found.push(dir.to_path_buf());
    }
    let mut found = Vec::new();
    for hierarchy in hierarchies() {
        let top = hierarchy.join(cgroup.trim_start_matches('/'));
        if top.is_dir() {
            walk(&top, &mut found);
        }
    }
    found
}

/// The pids in `cgroup` or below it, in any hierarchy.
fn processes_in(cgroup: &str) -> Vec<u32> {
    let mut pids: Vec<u32> = cgroup_dirs(cgroup)
        .iter()
        .flat_map(|dir| {
            fs::read_to_string(dir.join("cgroup.procs"))
                .unwrap_or_default()
                .lines()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .filter_map(|line| line.trim().parse().ok())
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// `<pid> <cmdline>`.
fn describe(pid: u32) -> String {
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    format!("{pid} {}", String::from_utf8_lossy(&cmdline).replace('\0', " ").trim_end())
}

/// Removes `cgroup` with everything below it from every hierarchy,
/// deepest first; returns what could not be removed.
fn remove_cgroups(cgroup: &str) -> Vec<PathBuf> {
    let mut left = Vec::new();
    for dir in cgroup_dirs(cgroup) {
        // Its processes may take a moment to be reaped after the kill.
        let deadline = Instant::now() + STOP_TIMEOUT;
        while let Err(err) = fs::remove_dir(&dir) {
            if err.kind() == io::ErrorKind::NotFound {
                break;
            }
            if Instant::now() > deadline {
                left.push(dir);
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    left
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configuration_keeps_everything_in_its_directory_and_avoids_the_known_traps() {
        let config = config_toml(Path::new("/sandbox/containerd-0"));
        for line in [
            r#"root = "/sandbox/containerd-0/root""#,
            r#"state = "/sandbox/containerd-0/state""#,
            r#"address = "/sandbox/containerd-0/containerd.sock""#,
            r#"path = "/sandbox/containerd-0/opt""#,
            r#"conf_dir = "/sandbox/containerd-0/cni/conf""#,
            "restrict_oom_score_adj = true",
            r#"stream_server_port = "0""#,
            &format!(r#"sandbox_image = "{}""#, image::PAUSE),
        ] {
            assert!(config.lines().any(|known| known.trim() == line), "{line} missing from\n{config}");
        }
        let parsed: toml::Table = config.parse().expect("valid TOML");
        assert_eq!(parsed["version"].as_integer(), Some(2));
    }

    #[test]
    fn a_host_network_pod_shares_the_nodes_network_only() {
        let namespaces = host_network();
        assert_eq!(namespaces.network(), NamespaceMode::Node);
        assert_eq!(namespaces.pid(), NamespaceMode::Container);
        assert_eq!(namespaces.ipc(), NamespaceMode::Pod);
    }
}
