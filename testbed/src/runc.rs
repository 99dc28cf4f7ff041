//! Real OCI containers for the top tier of the heal tests: Debian's `runc`
//! running a static busybox inside a [`Sandbox`], with a pod's target
//! bind-mounted the way kubelet and containerd mount a volume.
//!
//! Everything stays in the sandbox: the bundles and runc's state directory
//! (`runc --root`) live on the sandbox's tmpfs, and runc itself runs on a
//! thread that joined the sandbox's mount namespace, so the host's runc
//! state and mount table never see these containers. Only the container's
//! cgroup (named `fuse-supervisor-<id>.scope`, as a node's names a
//! container after its ID) is on the host's cgroup tree; `runc delete`
//! removes it.
//!
//! Each container's first process is a busybox shell reading one file of
//! its volume in a loop and printing one line per change, in the format of
//! the process-model container (see [`super::container`]), minus the time,
//! which the test side stamps when the line arrives. The shell exits when
//! that output pipe is closed (it prints a heartbeat every second), so a
//! killed test leaves no container running for long.
use std::collections::HashSet;
use std::fs;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuse_supervisor_sys::ns;

use super::reader::{GaveUp, Readings};
use super::{Observation, Sandbox};

/// How long a container may take to start and report its first reading.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(20);
/// The applets the rootfs links to busybox.
const APPLETS: [&str; 9] = ["sh", "cat", "ls", "sleep", "usleep", "echo", "mount", "umount", "ln"];
/// Where each container mounts its volume.
pub const VOLUME_IN_CONTAINER: &str = "/volume";
/// A line the reader prints every second so that a closed pipe ends it.
const HEARTBEAT: &str = "#";

/// The capabilities containerd gives a container by default: no
/// `CAP_SYS_ADMIN`, so no mount calls.
const DEFAULT_CAPABILITIES: [&str; 14] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

static NEXT_CONTAINER: AtomicU64 = AtomicU64::new(0);

#[derive(Debug, thiserror::Error)]
pub enum RuncError {
    #[error("cannot enter the sandbox's mount namespace to {step}")]
    Enter {
        step: String,
        #[source]
        source: io::Error,
    },
    #[error("{step}")]
    Io {
        step: String,
        #[source]
        source: io::Error,
    },
    #[error("runc {args} failed ({status}): {stderr}")]
    Runc { args: String, status: String, stderr: String },
    #[error("runc state of {id} has no pid: {state}")]
    NoPid { id: String, state: String },
    #[error("container {name} saw nothing matching within {waited:?}; history:\n{history}")]
    Timeout { name: String, waited: Duration, history: String },
    #[error("container {name} stopped reporting before anything matched; history:\n{history}")]
    Exited { name: String, history: String },
}

fn io_step(step: impl Into<String>) -> impl FnOnce(io::Error) -> RuncError {
    let step = step.into();
    move |source| RuncError::Io { step, source }
}

/// A volume's `mountPropagation`, as the OCI mount options kubelet and
/// containerd give the bind of the pod's target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VolumePropagation {
    /// `["rbind","rslave"]`: host mounts under the volume reach the container.
    HostToContainer,
    /// `["rbind","rprivate"]`, the default: nothing propagates either way.
    None,
}

impl VolumePropagation {
    fn options(self) -> [&'static str; 2] {
        match self {
            VolumePropagation::HostToContainer => ["rbind", "rslave"],
            VolumePropagation::None => ["rbind", "rprivate"],
        }
    }
}

/// One container to start.
#[derive(Debug, Clone)]
pub struct RuncSpec {
    /// Unique in the sandbox; names the bundle and, with a counter, the container.
    pub name: String,
    /// Host path (in the sandbox) bound at [`VOLUME_IN_CONTAINER`]: a pod's
    /// target, or a subPath target.
    pub volume: PathBuf,
    pub propagation: VolumePropagation,
    /// The file the container reads, relative to its volume.
    pub read: PathBuf,
    /// Pause between reads.
    pub interval: Duration,
    /// Options after the propagation's on the volume's bind: `ro` for a
    /// `readOnly` volumeMount (what containerd appends), `nosuid`…
    pub options: Vec<String>,
    /// A directory of the volume (relative to it) where the container gets
    /// a tmpfs of its own, as a configMap or an emptyDir nested in the
    /// volume is mounted; it must exist in the volume.
    pub nested_tmpfs: Option<PathBuf>,
    /// The reader also looks the nested tmpfs up at every read, as an
    /// application using its configMap does: its entry in the volume is
    /// then never older than the daemon's entry timeout.
    pub walk_nested: bool,
}

impl RuncSpec {
    /// A container that reads `read` in `volume` every `interval`, and asks
    /// nothing more of its volume.
    pub fn reader(
        name: impl Into<String>,
        volume: impl Into<PathBuf>,
        propagation: VolumePropagation,
        read: impl Into<PathBuf>,
        interval: Duration,
    ) -> RuncSpec {
        RuncSpec {
            name: name.into(),
            volume: volume.into(),
            propagation,
            read: read.into(),
            interval,
            options: Vec::new(),
            nested_tmpfs: None,
            walk_nested: false,
        }
    }
}

/// The runc of one sandbox: its binary, its private state directory and
/// the sandbox's mount namespace, in which every runc command runs.
#[derive(Clone)]
pub struct Runc {
    binary: PathBuf,
    /// `--root`, on the sandbox's tmpfs.
    state_root: PathBuf,
    /// The image every container shares (read-only): busybox and its links.
    image: PathBuf,
    bundles: PathBuf,
    /// Kept open, so runc can be run (and containers deleted) even while
    /// the sandbox is being dropped.
    namespace: Arc<OwnedFd>,
}

impl Runc {
    /// Prepares `<sandbox>/runc/{state,image,bundles}`, the image holding
    /// busybox and links to the applets the containers use.
    pub fn new(sandbox: &Sandbox) -> Result<Runc, RuncError> {
        let namespace = fs::File::open(sandbox.namespace_path())
            .map_err(io_step(format!("open {}", sandbox.namespace_path().display())))?;
        let dir = sandbox.root().join("runc");
        let runc = Runc {
            binary: super::system::program("runc"),
            state_root: dir.join("state"),
            image: dir.join("image"),
            bundles: dir.join("bundles"),
            namespace: Arc::new(namespace.into()),
        };
        let busybox = super::system::program("busybox");
        let (state_root, image, bundles) = (runc.state_root.clone(), runc.image.clone(), runc.bundles.clone());
        runc.in_namespace("build the busybox image", move || -> io::Result<()> {
            for dir in [&state_root, &bundles, &image.join("bin")] {
                fs::create_dir_all(dir)?;
            }
            // Mount points the config names must exist in a read-only rootfs.
            for dir in ["proc", "dev", "tmp", VOLUME_IN_CONTAINER.trim_start_matches('/')] {
                fs::create_dir_all(image.join(dir))?;
            }
            fs::copy(&busybox, image.join("bin/busybox"))?;
            for applet in APPLETS {
                std::os::unix::fs::symlink("busybox", image.join("bin").join(applet))?;
            }
            Ok(())
        })?
        .map_err(io_step("build the busybox image"))?;
        Ok(runc)
    }

    /// Runs `f` on a thread that joined the sandbox's mount namespace.
    fn in_namespace<T: Send>(&self, step: &str, f: impl FnOnce() -> T + Send) -> Result<T, RuncError> {
        std::thread::scope(|scope| {
            let thread = scope.spawn(|| {
                ns::enter_mount_namespace(self.namespace.as_fd())
                    .map_err(|source| RuncError::Enter { step: step.to_owned(), source })?;
                Ok(f())
            });
            // The closures here do not panic but on a broken test bed; say so.
            thread.join().unwrap_or_else(|_| panic!("the runc thread panicked while it should {step}"))
        })
    }

    /// `runc --root <state> <args>` in the sandbox, to completion.
    pub fn run(&self, args: &[&str]) -> Result<Output, RuncError> {
        let mut command = self.command(args);
        command.stdin(Stdio::null());
        let output = self
            .in_namespace(&format!("run runc {}", args.join(" ")), move || command.output())?
            .map_err(io_step(format!("run runc {}", args.join(" "))))?;
        if !output.status.success() {
            return Err(RuncError::Runc {
                args: args.join(" "),
                status: output.status.to_string(),
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            });
        }
        Ok(output)
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(&self.binary);
        command.arg("--root").arg(&self.state_root).args(args);
        command
    }

    /// Starts a container from `spec` (`runc run --detach`), returns once
    /// it reported its first reading.
    pub fn start(&self, spec: &RuncSpec) -> Result<RuncContainer, RuncError> {
        let n = NEXT_CONTAINER.fetch_add(1, Ordering::Relaxed);
        // Long and hex-like, as a runtime's: the last component of its cgroup
        // ties its processes to it (`job::containers`).
        let id = format!("{:016x}{:016x}{:016x}", std::process::id(), n, unix_nanos(SystemTime::now()));
        let bundle = self.bundles.join(&spec.name);
        let config = config_json(spec, &self.image, &id);
        let config_path = bundle.join("config.json");
        self.in_namespace("write the bundle", move || {
            fs::create_dir_all(config_path.parent().unwrap_or(Path::new("/")))
                .and_then(|()| fs::write(&config_path, config))
        })?
        .map_err(io_step(format!("write the bundle of {}", spec.name)))?;

        let mut command = self.command(&["run", "--detach", "--bundle"]);
        // Not stderr: the container inherits it too, and a pipe would never
        // close; runc's complaints show in the test's output.
        command.arg(&bundle).arg(&id).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut runc: Child =
            self.in_namespace("start runc", move || command.spawn())?.map_err(io_step("start runc run"))?;
        // The container keeps the pipe's write end: its readings come through it.
        let stdout = runc.stdout.take().ok_or_else(|| RuncError::Io {
            step: "take runc's stdout".into(),
            source: io::Error::other("not piped"),
        })?;
        let status = runc.wait().map_err(io_step("wait for runc run"))?;
        let container = RuncContainer {
            name: spec.name.clone(),
            id: id.clone(),
            pid: 0,
            runc: self.clone(),
            history: Readings::default(),
        };
        if !status.success() {
            return Err(RuncError::Runc {
                args: format!("run --detach {id}"),
                status: status.to_string(),
                stderr: "(on the test's stderr)".into(),
            });
        }
        let mut container = container;
        container.pid = container.state_pid()?;
        let collector = container.history.clone();
        std::thread::Builder::new()
            .name(format!("runc-{}", spec.name))
            // busybox has no clock finer than a second: each line is
            // stamped as it arrives; the heartbeats only say it is alive.
            .spawn(move || collector.collect(stdout, stamp))
            .map_err(io_step(format!("start the output thread of {}", spec.name)))?;
        container.wait_until(STARTUP_TIMEOUT, |_| true)?;
        Ok(container)
    }
}

/// The OCI configuration: the busybox image read-only, `/proc`, a tmpfs
/// `/dev` and `/tmp`, the volume bound with the options of its propagation,
/// its own pid, ipc, uts and mount namespaces, and a cgroup named after its ID.
fn config_json(spec: &RuncSpec, image: &Path, id: &str) -> String {
    let file = Path::new(VOLUME_IN_CONTAINER).join(&spec.read);
    // Builtins only but for usleep: a glob lists the volume (an unmatched
    // one, left as it is, means the listing failed: no test volume is
    // empty), `read` reads the file (its content has no newline, so `read`
    // fails but fills `c`).
    let script = format!(
        r#"F='{file}'; D='{VOLUME_IN_CONTAINER}'; last=; i=0
while :; do
  c=; {{ read -r c < "$F"; }} 2>/tmp/err{walk}
  if [ -n "$c" ]; then
    set -- "$D"/*; e=; for p; do e="$e${{e:+,}}${{p##*/}}"; done; now="ok $c | $e"
    [ "$1" = "$D/*" ] && now="err cannot list $D"
  else
    m=; read -r m < /tmp/err; now="err ${{m##*: }}"
  fi
  if [ "$now" != "$last" ]; then echo "$now" || exit 0; last=$now; fi
  i=$((i+1)); if [ $i -ge {beats} ]; then i=0; echo '{HEARTBEAT}' || exit 0; fi
  usleep {micros}
done"#,
        file = file.display(),
        beats = (Duration::from_secs(1).as_micros() / spec.interval.as_micros().max(1)).max(1),
        walk = match (&spec.nested_tmpfs, spec.walk_nested) {
            (Some(nested), true) => format!("; [ -d \"$D/{}\" ]", nested.display()),
            _ => String::new(),
        },
        micros = spec.interval.as_micros(),
    );
    let config = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["/bin/sh", "-c", script],
            "env": ["PATH=/bin"],
            "cwd": "/",
            // A pod's default set; `runc exec --cap` needs the section.
            "capabilities": {
                "bounding": DEFAULT_CAPABILITIES,
                "effective": DEFAULT_CAPABILITIES,
                "permitted": DEFAULT_CAPABILITIES,
            },
        },
        "root": {"path": image, "readonly": true},
        "hostname": spec.name,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"]},
            {
                "destination": VOLUME_IN_CONTAINER,
                "type": "bind",
                "source": spec.volume,
                "options": spec.propagation.options().iter().map(|option| (*option).to_owned()).chain(spec.options.iter().cloned()).collect::<Vec<_>>(),
            },
        ],
        "linux": {
            "cgroupsPath": format!("/fuse-supervisor-{id}.scope"),
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
        },
    });
    let mut config = config;
    if let (Some(nested), Some(mounts)) = (&spec.nested_tmpfs, config["mounts"].as_array_mut()) {
        mounts.push(serde_json::json!({
            "destination": Path::new(VOLUME_IN_CONTAINER).join(nested),
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=755"],
        }));
    }
    config.to_string()
}

/// A running runc container and what it has read so far. Deleted
/// (`runc delete --force`) on drop.
pub struct RuncContainer {
    name: String,
    id: String,
    pid: u32,
    runc: Runc,
    history: Readings,
}

/// One mount of a container's table (a line of its mountinfo).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerMount {
    pub mount_id: u32,
    pub mount_point: PathBuf,
    pub fs_type: String,
    /// The optional fields (`shared:N`, `master:N`), space-separated.
    pub propagation: String,
    /// `major:minor` of the filesystem.
    pub device: String,
    /// The per-mount options (`ro`/`rw`, `nosuid`, the atime mode, …).
    pub options: String,
}

impl RuncContainer {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The runtime's ID of the container (what the kubelet reports as
    /// `containerID` after the `runc://` scheme).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The host pid of the container's first process.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    fn state_pid(&self) -> Result<u32, RuncError> {
        let output = self.runc.run(&["state", &self.id])?;
        let state = String::from_utf8_lossy(&output.stdout).into_owned();
        let pid = serde_json::from_str::<serde_json::Value>(&state)
            .ok()
            .and_then(|state| state.get("pid")?.as_u64())
            .and_then(|pid| u32::try_from(pid).ok())
            .filter(|pid| *pid > 0);
        pid.ok_or(RuncError::NoPid { id: self.id.clone(), state })
    }

    /// `runc exec <id> <args>`: its output, or the error with its stderr.
    pub fn exec(&self, args: &[&str]) -> Result<Output, RuncError> {
        let mut full = vec!["exec", self.id.as_str()];
        full.extend_from_slice(args);
        self.runc.run(&full)
    }

    /// [`RuncContainer::exec`] with `CAP_SYS_ADMIN` (mount calls): a
    /// tenant tampering with its own tree.
    pub fn exec_with_sys_admin(&self, args: &[&str]) -> Result<Output, RuncError> {
        let mut full = vec!["exec", "--cap", "CAP_SYS_ADMIN", self.id.as_str()];
        full.extend_from_slice(args);
        self.runc.run(&full)
    }

    /// A file of the container (absolute inside it) read by `cat` run in it.
    pub fn read_file(&self, path: &Path) -> Result<String, RuncError> {
        let path = path.to_string_lossy();
        let output = self.exec(&["cat", &path])?;
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// The inode of the container's mount namespace.
    pub fn namespace_inode(&self) -> io::Result<u64> {
        Ok(fs::metadata(format!("/proc/{}/ns/mnt", self.pid))?.ino())
    }

    /// The container's mount table, from `/proc/<pid>/mountinfo`.
    pub fn mountinfo(&self) -> io::Result<String> {
        fs::read_to_string(format!("/proc/{}/mountinfo", self.pid))
    }

    /// Every mount of the container's table.
    pub fn mounts(&self) -> io::Result<Vec<ContainerMount>> {
        Ok(parse_mountinfo(&self.mountinfo()?))
    }

    /// The mounts stacked at `path` (inside the container), bottom first.
    pub fn mounts_at(&self, path: &Path) -> io::Result<Vec<ContainerMount>> {
        Ok(self.mounts()?.into_iter().filter(|mount| mount.mount_point == path).collect())
    }

    /// The mounts stacked at the volume, bottom first.
    pub fn volume_mounts(&self) -> io::Result<Vec<ContainerMount>> {
        self.mounts_at(Path::new(VOLUME_IN_CONTAINER))
    }

    /// Waits until the **latest** reading satisfies `pred` and returns it.
    pub fn wait_until(&self, timeout: Duration, pred: impl Fn(&Observation) -> bool) -> Result<Observation, RuncError> {
        self.history.wait_until(timeout, pred).map_err(|gave_up| match gave_up {
            GaveUp::Exited(history) => RuncError::Exited { name: self.name.clone(), history },
            GaveUp::Timeout(history) => RuncError::Timeout { name: self.name.clone(), waited: timeout, history },
        })
    }

    /// Every reading so far, oldest first.
    pub fn history(&self) -> Vec<Observation> {
        self.history.observations()
    }

    /// The history, one reading a line, for failure messages.
    pub fn describe_history(&self) -> String {
        self.history.describe()
    }
}

impl Drop for RuncContainer {
    fn drop(&mut self) {
        if let Err(err) = self.runc.run(&["delete", "--force", &self.id]) {
            eprintln!("cannot delete runc container {} ({}): {err}", self.name, self.id);
        }
    }
}

impl std::fmt::Debug for RuncContainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuncContainer").field("name", &self.name).field("id", &self.id).field("pid", &self.pid).finish()
    }
}

/// A line of the container's output as an observation, stamped with its
/// arrival; None for a heartbeat.
fn stamp(line: String) -> Option<String> {
    (line != HEARTBEAT).then(|| format!("{} {line}", unix_nanos(SystemTime::now())))
}

fn unix_nanos(at: SystemTime) -> u128 {
    // Before 1970 only with a broken clock; 0 is as good an answer as any.
    at.duration_since(UNIX_EPOCH).map_or(0, |since| since.as_nanos())
}

/// The mounts of a mountinfo text (escapes in paths left as they are: the
/// test bed's paths have none).
pub(crate) fn parse_mountinfo(text: &str) -> Vec<ContainerMount> {
    text.lines()
        .filter_map(|line| {
            let (head, tail) = line.split_once(" - ")?;
            let fields: Vec<&str> = head.split(' ').collect();
            Some(ContainerMount {
                mount_id: fields.first()?.parse().ok()?,
                device: (*fields.get(2)?).to_owned(),
                mount_point: PathBuf::from(fields.get(4)?),
                options: (*fields.get(5)?).to_owned(),
                propagation: fields.get(6..).map(|optional| optional.join(" ")).unwrap_or_default(),
                fs_type: tail.split(' ').next()?.to_owned(),
            })
        })
        .collect()
}

/// What a failed runc-tier test prints about its node: the host's mount
/// table, and each container's readings and table (the supervisor prints
/// its log itself).
pub fn print_failure<'a>(sandbox: &Sandbox, containers: impl IntoIterator<Item = &'a RuncContainer>) {
    eprintln!("host mount table:\n{}", sandbox.mountinfo());
    for container in containers {
        eprintln!("container {} history:\n{}", container.name(), container.describe_history());
        eprintln!("container {} mount table:\n{}", container.name(), container.mountinfo().unwrap_or_default());
    }
}

/// FUSE connections alive on the machine, by device minor, as the FUSE
/// control filesystem mounted at `fusectl` lists them (a host's
/// `/sys/fs/fuse/connections`): the kernel keeps one for every dead mount
/// still attached in some namespace.
pub fn fuse_connections(fusectl: &Path) -> HashSet<u32> {
    let Ok(entries) = fs::read_dir(fusectl) else { return HashSet::new() };
    entries.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_with_and_without_optional_fields() {
        let text = "\
36 35 0:40 / / ro,relatime master:1 - tmpfs tmpfs rw
41 36 0:52 /sub /volume rw,nosuid master:7 shared:9 - fuse.bindfs bindfs rw,user_id=0
42 36 0:21 / /proc rw - proc proc rw
";
        let mounts = parse_mountinfo(text);
        assert_eq!(mounts.len(), 3);
        assert_eq!(mounts[1].mount_point, Path::new("/volume"));
        assert_eq!(mounts[1].fs_type, "fuse.bindfs");
        assert_eq!(mounts[1].propagation, "master:7 shared:9");
        assert_eq!(mounts[1].device, "0:52");
        assert_eq!(mounts[1].options, "rw,nosuid");
        assert_eq!(mounts[2].propagation, "");
    }

    #[test]
    fn the_volume_is_bound_with_the_options_of_its_propagation() {
        let spec = RuncSpec {
            name: "app".into(),
            volume: "/k/pods/p/volumes/v/mount".into(),
            propagation: VolumePropagation::HostToContainer,
            read: "data.txt".into(),
            interval: Duration::from_millis(10),
            options: vec!["ro".into()],
            nested_tmpfs: Some("config".into()),
            walk_nested: true,
        };
        let config: serde_json::Value = serde_json::from_str(&config_json(&spec, Path::new("/img"), "abc")).unwrap();
        let volume = config["mounts"].as_array().unwrap().iter().find(|m| m["destination"] == "/volume").unwrap();
        assert_eq!(volume["options"], serde_json::json!(["rbind", "rslave", "ro"]));
        let nested = config["mounts"].as_array().unwrap().iter().find(|m| m["destination"] == "/volume/config");
        assert_eq!(nested.unwrap()["type"], "tmpfs", "a tmpfs nested in the volume, after it");
        assert_eq!(volume["source"], "/k/pods/p/volumes/v/mount");
        assert_eq!(config["linux"]["cgroupsPath"], "/fuse-supervisor-abc.scope");
        assert!(config["process"]["args"][2].as_str().unwrap().contains("F='/volume/data.txt'"));
        assert!(config["process"]["args"][2].as_str().unwrap().contains(r#"[ -d "$D/config" ]"#));
        let none = RuncSpec { propagation: VolumePropagation::None, options: Vec::new(), ..spec };
        let config: serde_json::Value = serde_json::from_str(&config_json(&none, Path::new("/img"), "abc")).unwrap();
        assert_eq!(config["mounts"][3]["options"], serde_json::json!(["rbind", "rprivate"]));
    }
}
