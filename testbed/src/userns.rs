//! A user-namespace pod's container, as the kubelet asks for one
//! (`hostUsers: false`): a process in a user namespace of its own, whose
//! volume is an idmapped mount (its runtime maps the volume through the
//! container's user namespace, so that the files' owners show as the
//! container's). Its mount namespace is the node's (made before the user
//! namespace), as a rootful runtime's is. Debian's runc (1.1) and containerd (1.6) predate idmapped
//! volumes, so the test world makes that mount itself, as containerd 2
//! does: a clone of the pod's target, private, idmapped, attached in the
//! container's mount namespace.
use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use fuse_supervisor_sys::process::Signal;
use fuse_supervisor_sys::{mount, ns, resolve};

use super::{Sandbox, SandboxChild, TestbedError};

/// The container's process and where its idmapped volume is.
#[derive(Debug)]
pub struct UsernsContainer {
    process: SandboxChild,
    /// The volume's mount point, in the container's namespace (and the
    /// same directory of the sandbox's tree).
    pub volume: PathBuf,
}

impl UsernsContainer {
    /// Starts a process in new user and mount namespaces, maps its ids as
    /// `uid_map`/`gid_map` (`"0 100000 65536"`: one extent a line), and
    /// mounts `target` (a pod's volume in the sandbox) idmapped through its
    /// user namespace at `volume` (a directory made here, on the sandbox's
    /// tree, so that the copy of it in the container's namespace is there).
    pub fn start(
        sandbox: &Sandbox,
        target: &Path,
        volume: &Path,
        uid_map: &str,
        gid_map: &str,
    ) -> Result<UsernsContainer, TestbedError> {
        let step = |step: &str| {
            let step = step.to_owned();
            move |source| TestbedError::Setup { step, source }
        };
        let made = volume.to_path_buf();
        sandbox.run(move || std::fs::create_dir_all(made)).map_err(step("create the container's volume directory"))?;
        // A container sees its own root, not the node's mounts: the
        // sandbox's kubelet and runtime trees are detached from its copy of
        // the sandbox's namespace before it enters its user namespace.
        let unshare = super::system::program("unshare");
        let mut command = Command::new(&unshare);
        command
            .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg("umount -l \"$1\" \"$2\" && exec \"$3\" --user -- sh -c 'echo ready; exec sleep infinity'")
            .arg("sh")
            .arg(sandbox.kubelet_root())
            .arg(sandbox.runtime_root())
            .arg(&unshare)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut process =
            sandbox.spawn(command).map_err(|source| TestbedError::Spawn { program: "unshare".into(), source })?;
        let stdout = process.take_stdout().ok_or_else(|| TestbedError::NoStdout { name: "userns container".into() })?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).map_err(step("read the container's ready line"))?;
        let container = UsernsContainer { process, volume: volume.to_path_buf() };
        if line.trim() != "ready" {
            return Err(step("start the userns container")(io::Error::other(format!("it said {line:?}"))));
        }
        let proc = PathBuf::from(format!("/proc/{}", container.pid()));
        write_map(&proc.join("uid_map"), uid_map).map_err(step("write the container's uid_map"))?;
        write_map(&proc.join("gid_map"), gid_map).map_err(step("write the container's gid_map"))?;
        let (target, volume) = (target.to_path_buf(), volume.to_path_buf());
        sandbox
            .run(move || {
                let source = resolve::open_path(&target)?;
                let users = std::fs::File::open(proc.join("ns/user"))?;
                let clone = mount::clone_mount(source.as_fd())?;
                mount::make_private(clone.as_fd())?;
                mount::set_idmapping_of(clone.as_fd(), users.as_fd())?;
                // Attached from a thread in the container's mount namespace.
                std::thread::scope(|scope| {
                    scope
                        .spawn(|| {
                            ns::join_mount_namespace(&proc.join("ns/mnt"))?;
                            let onto = resolve::open_path(&volume)?;
                            mount::move_mount(clone.as_fd(), onto.as_fd())
                        })
                        .join()
                        .unwrap_or_else(|_| Err(io::Error::other("the mounting thread panicked")))
                })
            })
            .map_err(step("mount the container's volume idmapped"))?;
        Ok(container)
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Its mount namespace, as `/proc` names it.
    pub fn namespace(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/mnt", self.pid()))
    }

    /// `path` inside the container, as the sandbox reaches it.
    pub fn path(&self, path: &Path) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root", self.pid())).join(path.strip_prefix("/").unwrap_or(path))
    }
}

impl Drop for UsernsContainer {
    fn drop(&mut self) {
        if self.process.signal(Signal::Kill).is_ok() {
            let _ = self.process.wait();
        }
    }
}

/// Writes a user namespace's map, whole, in one write as the kernel wants.
fn write_map(path: &Path, map: &str) -> io::Result<()> {
    std::fs::OpenOptions::new().write(true).open(path)?.write_all(map.as_bytes())
}
