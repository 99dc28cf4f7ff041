//! A mount table bomb: a tenant that makes its mount namespace's table as
//! big as it likes, as any container with CAP_SYS_ADMIN can. It makes its
//! namespace the way runc does (see [`super::container`]), builds a chain
//! of directories whose path is `path_bytes` long, and binds a short
//! directory onto the end of the chain `binds` times (each bind on top of
//! the last): every line of its mountinfo then carries a mount point of
//! `path_bytes`. Optionally it binds a FUSE directory there too, on top: a
//! FUSE mount no reader can list without reading that long a path.
//!
//! Once built it prints `ready <namespace inode>` and execs `sleep`: a
//! container's first process execs its entrypoint once its mounts are in
//! place, which is how the agent's namespace keeper learns a namespace
//! made after its start. Killing it ends the namespace and every mount in it.
use std::ffi::OsString;
use std::fs;
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use fuse_supervisor_sys::mount::{self, Propagation};
use fuse_supervisor_sys::ns;

use super::{Sandbox, SandboxChild, TestbedError};

/// What the bomb builds.
#[derive(Debug, Clone)]
pub struct BombOptions {
    /// An empty directory of its own in which to build (the chain and the
    /// short source of the binds).
    pub dir: PathBuf,
    pub binds: usize,
    /// The length of the chain's path (and so of every mount point).
    pub path_bytes: usize,
    /// A FUSE directory bound onto the chain's end last.
    pub fuse: Option<PathBuf>,
    /// The binds are of `fuse` instead of a short directory: every one a
    /// FUSE mount whose paths a reader must ask for to keep it.
    pub fuse_binds: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum BombError {
    #[error("mount table bomb: cannot {step}")]
    Step {
        step: String,
        #[source]
        source: io::Error,
    },
}

fn step(step: impl Into<String>) -> impl FnOnce(io::Error) -> BombError {
    let step = step.into();
    move |source| BombError::Step { step, source }
}

/// The longest name a directory may have (NAME_MAX).
const NAME_MAX: usize = 255;

/// Builds the namespace and its table, reports, and execs `sleep`: returns
/// only on failure.
pub fn run(options: &BombOptions) -> Result<(), BombError> {
    ns::unshare_mount_namespace().map_err(step("unshare the mount namespace"))?;
    mount::set_propagation(Path::new("/"), Propagation::Slave, true).map_err(step("make / rslave"))?;
    let source = options.dir.join("source");
    fs::create_dir_all(&source).map_err(step(format!("create {}", source.display())))?;
    let chain = options.dir.join("chain");
    fs::create_dir_all(&chain).map_err(step(format!("create {}", chain.display())))?;
    // Down the chain by relative steps: its path is far beyond PATH_MAX,
    // which no call takes whole.
    std::env::set_current_dir(&chain).map_err(step(format!("enter {}", chain.display())))?;
    let mut length = chain.as_os_str().len();
    while length < options.path_bytes {
        let name = "d".repeat((options.path_bytes - length).clamp(1, NAME_MAX));
        fs::create_dir(&name).map_err(step(format!("create a directory at depth {length}")))?;
        std::env::set_current_dir(&name).map_err(step(format!("enter a directory at depth {length}")))?;
        length += 1 + name.len();
    }
    let here = Path::new(".");
    let bound = match &options.fuse {
        Some(fuse) if options.fuse_binds => fuse,
        _ => &source,
    };
    for bind in 0..options.binds {
        mount::bind(bound, here).map_err(step(format!("make bind {bind}")))?;
    }
    if let Some(fuse) = &options.fuse {
        mount::bind(fuse, here).map_err(step(format!("bind {} at the chain's end", fuse.display())))?;
    }
    std::env::set_current_dir("/").map_err(step("leave the chain"))?;
    let namespace = fs::metadata("/proc/self/ns/mnt").map_err(step("stat its namespace"))?.ino();
    let mut stdout = io::stdout().lock();
    writeln!(stdout, "ready {namespace}").and_then(|()| stdout.flush()).map_err(step("report"))?;
    Err(BombError::Step { step: "exec sleep".into(), source: Command::new("sleep").arg("infinity").exec() })
}

/// A running bomb, killed with its sandbox (or when dropped).
#[derive(Debug)]
pub struct MountBomb {
    child: SandboxChild,
    namespace: u64,
}

impl MountBomb {
    /// Starts the test world's `mount-bomb` program in `sandbox` and waits
    /// until its table is built.
    pub fn start(sandbox: &Sandbox, options: &BombOptions) -> Result<MountBomb, TestbedError> {
        let binary = crate::programs_binary()
            .map_err(|source| TestbedError::Setup { step: "find the test world's programs".into(), source })?;
        let mut command = Command::new(&binary);
        let mut args: Vec<OsString> = vec!["mount-bomb".into(), "--dir".into()];
        args.push(options.dir.clone().into());
        args.extend(["--binds".into(), options.binds.to_string().into()]);
        args.extend(["--path-bytes".into(), options.path_bytes.to_string().into()]);
        if let Some(fuse) = &options.fuse {
            args.extend(["--fuse".into(), fuse.clone().into()]);
        }
        if options.fuse_binds {
            args.push("--fuse-binds".into());
        }
        command.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let program = binary.display().to_string();
        let mut child = sandbox.spawn(command).map_err(|source| TestbedError::Spawn { program, source })?;
        let stdout = child.take_stdout().ok_or_else(|| TestbedError::NoStdout { name: "mount-bomb".into() })?;
        let mut line = String::new();
        let read = BufReader::new(stdout).read_line(&mut line);
        let namespace = line.trim().strip_prefix("ready ").and_then(|inode| inode.parse().ok());
        match (read, namespace) {
            (Ok(_), Some(namespace)) => Ok(MountBomb { child, namespace }),
            (read, _) => {
                let _ = child.kill();
                let source = read.err().unwrap_or_else(|| io::Error::other(format!("it said {line:?}")));
                Err(TestbedError::Setup { step: "build the mount table bomb".into(), source })
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// Its mount namespace's inode, as the agent names it.
    pub fn namespace(&self) -> u64 {
        self.namespace
    }
}

impl Drop for MountBomb {
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}
