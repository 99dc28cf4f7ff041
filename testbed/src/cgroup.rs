//! A container's cgroup for tests: a directory named as containerd names
//! one (`cri-containerd-<id>.scope`), so that `/proc/<pid>/cgroup` ties the
//! processes started in it to a container ID, as on a node.
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fuse_supervisor_sys::process::{self, Signal};

static NEXT: AtomicU64 = AtomicU64::new(0);

/// Hierarchies tried, in order: the unified one of a hybrid setup, a pure
/// cgroup v2 root, systemd's named v1 hierarchy. Any will do: only the
/// path shows, no controller is used.
const HIERARCHIES: [&str; 3] = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup", "/sys/fs/cgroup/systemd"];

/// A cgroup `<hierarchy>/fuse-supervisor-test-<pid>-<n>/cri-containerd-<id>.scope`;
/// its processes are killed and the directories removed on drop.
#[derive(Debug)]
pub struct ContainerCgroup {
    id: String,
    parent: PathBuf,
    dir: PathBuf,
}

impl ContainerCgroup {
    /// A fresh container ID (64 hex digits, unique in this machine's run)
    /// and its cgroup.
    pub fn new() -> io::Result<ContainerCgroup> {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let id = format!("{:016x}{:016x}{:032x}", std::process::id(), n, nanos);
        let mut last = io::Error::new(io::ErrorKind::NotFound, "no cgroup hierarchy");
        for hierarchy in HIERARCHIES {
            if !Path::new(hierarchy).join("cgroup.procs").exists() {
                continue;
            }
            let parent = Path::new(hierarchy).join(format!("fuse-supervisor-test-{}-{n}", std::process::id()));
            let dir = parent.join(format!("cri-containerd-{id}.scope"));
            match fs::create_dir_all(&dir) {
                Ok(()) => return Ok(ContainerCgroup { id, parent, dir }),
                Err(err) => {
                    let _ = fs::remove_dir(&parent);
                    last = io::Error::new(err.kind(), format!("cannot create a cgroup under {hierarchy}: {err}"));
                }
            }
        }
        Err(last)
    }

    /// The container ID, as the kubelet's `containerID` would carry it
    /// after `containerd://`.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// `program args…`, started so that it runs in this cgroup from its
    /// first instruction: a shell moves itself in, then execs it.
    /// `ignore_term`: with SIGTERM ignored (inherited through exec).
    pub fn command(&self, program: &Path, args: &[&str], ignore_term: bool) -> Command {
        let trap = if ignore_term { "trap '' TERM; " } else { "" };
        let script = format!("{trap}echo 0 > '{}' && exec \"$0\" \"$@\"", self.dir.join("cgroup.procs").display());
        let mut command = Command::new("sh");
        command.arg("-c").arg(script).arg(program).args(args);
        command
    }

    /// A shell script run in this cgroup (the shell is the container's
    /// first process).
    pub fn shell(&self, script: &str) -> Command {
        let mut command = Command::new("sh");
        command.arg("-c").arg(format!("echo 0 > '{}' && {{ {script}\n}}", self.dir.join("cgroup.procs").display()));
        command
    }

    fn pids(&self) -> Vec<u32> {
        fs::read_to_string(self.dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| line.trim().parse().ok())
            .collect()
    }
}

impl Drop for ContainerCgroup {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let pids = self.pids();
            for &pid in &pids {
                let _ = process::signal(pid, Signal::Kill);
            }
            // Empty, or its processes are zombies nobody reaps yet.
            if fs::remove_dir(&self.dir).is_ok() || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = fs::remove_dir(&self.parent);
    }
}
