//! A hostile tenant inside a container's mount namespace: mounts of its
//! own made where the agent has to walk or heal.
//!
//! Each helper acts in the namespace of a container-model process (a
//! [`super::ContainerReader`]'s `/proc/<pid>/ns/mnt`) or of any process the
//! test names the same way: mounts are made from a thread that joined it,
//! and the tenant's FUSE daemon is started in it by `nsenter --mount`.
use std::ffi::OsString;
use std::fs;
use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use fuse_supervisor_sys::process::Signal;
use fuse_supervisor_sys::{mount, ns};

use super::{Sandbox, SandboxChild, TestbedError};

/// A tenant's own FUSE server (a demofs with `--hang-lookup NAME`), mounted
/// at a directory of a container, with the container's copy of a volume
/// bound onto `<mount_point>/<NAME>`: every path to the copy walks through
/// the tenant's FUSE, which answers lookups with a zero timeout (every walk
/// asks again) and never answers the lookup of NAME after the one the bind
/// made, until [`TenantFuse::release`].
///
/// Dropping it releases the held lookups, ends the daemon with SIGTERM
/// (its mount, and the copy bound beneath it, are detached with it) and
/// reaps it; the sandbox would kill it at its own end anyway.
pub struct TenantFuse {
    /// Where the tenant's FUSE is mounted, in the container's namespace.
    pub mount_point: PathBuf,
    /// Where the copy of the volume is bound: `<mount_point>/<name>`.
    pub copy: PathBuf,
    /// The name whose lookups hang.
    pub name: OsString,
    daemon: SandboxChild,
}

impl TenantFuse {
    /// In the mount namespace `namespace` (`/proc/<pid>/ns/mnt` of a
    /// container process): mounts a demofs with
    /// `--hang-lookup name --hang-lookup-after 1` at `mount_point` (created
    /// from the sandbox, so it must be on a filesystem the container shares
    /// with it, such as a container rootfs under [`Sandbox::root`]), serving
    /// a backing directory that holds `name`, and binds the container's
    /// mount at `copy` (its volume) onto `<mount_point>/<name>`, the one
    /// lookup of `name` the daemon answers. Returns once the bind is made.
    pub fn mount_over_copy(
        sandbox: &Sandbox,
        namespace: &Path,
        mount_point: &Path,
        copy: &Path,
        name: &str,
    ) -> Result<TenantFuse, TestbedError> {
        let step = |step: String| move |source| TestbedError::Setup { step, source };
        let backing = sandbox.root().join("tenant-backing").join(unique_dir_name(mount_point));
        let dirs = [backing.join(name), mount_point.to_path_buf()];
        sandbox
            .run(move || dirs.iter().try_for_each(fs::create_dir_all))
            .map_err(step(format!("create the tenant's backing directory and {}", mount_point.display())))?;
        let binary = crate::programs_binary().map_err(step("find the test world's programs".into()))?;
        let mut command = Command::new(super::system::program("nsenter"));
        command
            .arg(format!("--mount={}", namespace.display()))
            .arg("--")
            .arg(&binary)
            .args(["demofs", "--name", "tenant", "--backing"])
            .arg(&backing)
            .arg("--mountpoint")
            .arg(mount_point)
            .args(["--hang-lookup", name, "--hang-lookup-after", "1"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut daemon = sandbox
            .spawn(command)
            .map_err(|source| TestbedError::Spawn { program: binary.display().to_string(), source })?;
        let stdout = daemon.take_stdout().ok_or_else(|| TestbedError::NoStdout { name: "tenant demofs".into() })?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).map_err(step("read the tenant daemon's ready line".into()))?;
        let tenant = TenantFuse {
            mount_point: mount_point.to_path_buf(),
            copy: mount_point.join(name),
            name: name.into(),
            daemon,
        };
        if line.trim() != "ready" {
            return Err(step(format!("start the tenant's FUSE at {}", mount_point.display()))(io::Error::other(
                format!("the daemon said {line:?} instead of ready"),
            )));
        }
        let (source, target) = (copy.to_path_buf(), tenant.copy.clone());
        in_namespace(namespace, move || mount::bind(&source, &target)).map_err(|source| TestbedError::Bind {
            source_path: copy.to_path_buf(),
            target: tenant.copy.clone(),
            source,
        })?;
        Ok(tenant)
    }

    /// Answers every lookup held so far and every later one (`SIGUSR1`).
    pub fn release(&self) -> io::Result<()> {
        self.daemon.signal(Signal::Usr1)
    }

    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.daemon.pid()
    }
}

impl Drop for TenantFuse {
    fn drop(&mut self) {
        // Gone already if the test or the sandbox ended it: fine either way.
        let _ = self.release();
        if self.daemon.signal(Signal::Term).is_ok() {
            let _ = self.daemon.wait();
        }
    }
}

/// Mounts a fresh tmpfs on top of `mount_point` in the mount namespace
/// `namespace` (`/proc/<pid>/ns/mnt`): a tenant covering its copy of a
/// volume (or any mount) so that a path to it reaches the tmpfs instead.
/// The tmpfs goes with the namespace.
pub fn cover_with_tmpfs(namespace: &Path, mount_point: &Path) -> Result<(), TestbedError> {
    let at = mount_point.to_path_buf();
    in_namespace(namespace, move || mount::mount_tmpfs(&at))
        .map_err(|source| TestbedError::Setup { step: format!("cover {} with a tmpfs", mount_point.display()), source })
}

/// Runs `work` on a new thread that joined the mount namespace at
/// `namespace`, and waits for it.
fn in_namespace(namespace: &Path, work: impl FnOnce() -> io::Result<()> + Send + 'static) -> io::Result<()> {
    let namespace = namespace.to_path_buf();
    std::thread::Builder::new()
        .name("tenant".into())
        .spawn(move || ns::join_mount_namespace(&namespace).and_then(|()| work()))?
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the tenant's thread panicked")))
}

/// A directory name made from `path`, unique among the tenant's mounts.
fn unique_dir_name(path: &Path) -> String {
    path.to_string_lossy().trim_start_matches('/').replace('/', "_")
}
