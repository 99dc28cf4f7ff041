//! The FUSE filesystem built into fuse-supervisor: a read-only passthrough of
//! a backing directory, served by this process, for the demo and the tests.
//!
//! It is a real FUSE daemon, so it fails like one: after a `SIGKILL` its mount
//! stays and answers `ENOTCONN`; after a `SIGSTOP` requests hang. It mounts
//! with a raw `mount(2)`, so a new daemon can be started *on top of* the stale
//! mount of a dead one (libfuse daemons refuse that), as well as on a plain
//! directory.
//!
//! `fuse-supervisor internal demofs --backing DIR --mountpoint MP [--name N]`:
//! - mounts `fuse.N` (default `demofs`) with source `DIR` on `MP`, then prints
//!   the line `ready` on stdout once the kernel handshake is done: from then
//!   on the mount answers. Callers wait for that line.
//! - serves until the mount goes away (an unmount from outside ends it with
//!   exit status 0),
//! - on `SIGTERM` or `SIGINT` lazily detaches its mount, if it is still the
//!   top one at `MP`, and exits 0; the kernel connection ends with the
//!   process, so any remaining copy of the mount answers `ENOTCONN`.
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use fuse_supervisor_sys::fuse as sys_fuse;
use fuse_supervisor_sys::mount as sys_mount;
use fuser::{Config, Session, SessionACL};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

mod passthrough;

use passthrough::PassthroughFs;

/// What `fuse-supervisor internal demofs` serves, and where.
#[derive(Debug, Clone)]
pub struct DemoFsOptions {
    /// Directory whose contents the filesystem serves.
    pub backing: PathBuf,
    /// Where to mount; whatever is mounted there already stays underneath.
    pub mountpoint: PathBuf,
    /// FUSE subtype: the mount shows as `fuse.<name>`.
    pub name: String,
}

#[derive(Debug, thiserror::Error)]
pub enum DemoFsError {
    #[error("demofs backing directory {path} is not usable")]
    Backing {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("demofs backing {path} is not a directory")]
    BackingNotDirectory { path: PathBuf },
    #[error("demofs name {name:?} is not a valid fuse subtype")]
    InvalidName { name: String },
    #[error("cannot install the SIGTERM/SIGINT handlers")]
    Signals(#[source] io::Error),
    #[error("cannot open /dev/fuse")]
    OpenDevice(#[source] io::Error),
    #[error("cannot mount fuse.{name} on {mountpoint}")]
    Mount {
        mountpoint: PathBuf,
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("fuse handshake for {mountpoint} failed")]
    Handshake {
        mountpoint: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot start the {thread} thread for {mountpoint}")]
    SpawnThread {
        thread: &'static str,
        mountpoint: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("serving {mountpoint} failed")]
    Serve {
        mountpoint: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot detach the demofs mount on {mountpoint}")]
    Detach {
        mountpoint: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// What ends serving.
enum Stop {
    SessionEnded(io::Result<()>),
    Signal(i32),
}

/// Mounts and serves until the mount goes away or the process is killed.
pub fn serve(options: &DemoFsOptions) -> Result<(), DemoFsError> {
    // Before mounting: a signal that comes earlier kills the process while
    // there is no mount to leave behind yet.
    let mut signals = Signals::new([SIGTERM, SIGINT]).map_err(DemoFsError::Signals)?;

    if options.name.is_empty() || options.name.contains([',', '/', '\0']) {
        return Err(DemoFsError::InvalidName { name: options.name.clone() });
    }
    let backing = std::fs::canonicalize(&options.backing)
        .map_err(|source| DemoFsError::Backing { path: options.backing.clone(), source })?;
    let backing_metadata =
        std::fs::metadata(&backing).map_err(|source| DemoFsError::Backing { path: backing.clone(), source })?;
    if !backing_metadata.is_dir() {
        return Err(DemoFsError::BackingNotDirectory { path: backing });
    }
    let mountpoint = options.mountpoint.clone();

    let device = sys_fuse::open_device().map_err(DemoFsError::OpenDevice)?;
    sys_fuse::mount(device.as_fd(), &mountpoint, &options.name, &backing.to_string_lossy())
        .map_err(|source| DemoFsError::Mount { mountpoint: mountpoint.clone(), name: options.name.clone(), source })?;

    // From here on the mount exists: any failure detaches it again rather
    // than leave a mount behind that no daemon will ever answer.
    let detach_on_error = |err: DemoFsError| {
        if let Err(detach_err) = sys_mount::detach(&mountpoint) {
            tracing::warn!(mountpoint = %mountpoint.display(), ?detach_err, "cannot detach after failure");
        }
        err
    };

    // fuser 0.18 reads the ACL from its own argument, not from the config;
    // set both so they cannot disagree.
    let mut config = Config::default();
    config.acl = SessionACL::All;
    let session = Session::from_fd(PassthroughFs::new(backing), device, SessionACL::All, config)
        .map_err(|source| detach_on_error(DemoFsError::Handshake { mountpoint: mountpoint.clone(), source }))?;

    let (stop_sender, stop) = mpsc::channel();
    let session_stop = stop_sender.clone();
    std::thread::Builder::new()
        .name("demofs-session".into())
        .spawn(move || {
            // The receiver lives until serve() returns, and then nobody cares.
            let _ = session_stop.send(Stop::SessionEnded(session.run()));
        })
        .map_err(|source| {
            detach_on_error(DemoFsError::SpawnThread { thread: "session", mountpoint: mountpoint.clone(), source })
        })?;

    // Taken once requests are being answered: reading the mount ID asks the
    // daemon nothing, but if it ever did, it must not wait on ourselves.
    let own_mount = match sys_fuse::top_mount_id(&mountpoint) {
        Ok(id) => Some(id),
        Err(err) => {
            tracing::warn!(mountpoint = %mountpoint.display(), ?err, "cannot read own mount id");
            None
        }
    };

    std::thread::Builder::new()
        .name("demofs-signals".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                let _ = stop_sender.send(Stop::Signal(signal));
            }
        })
        .map_err(|source| {
            detach_on_error(DemoFsError::SpawnThread { thread: "signal", mountpoint: mountpoint.clone(), source })
        })?;

    announce_ready();
    tracing::info!(mountpoint = %mountpoint.display(), name = %options.name, "demofs ready");

    // The session thread always sends before it ends, so recv() cannot fail
    // while the process lives; treat it as the session's end all the same.
    match stop.recv() {
        Ok(Stop::SessionEnded(Ok(()))) | Err(_) => Ok(()),
        Ok(Stop::SessionEnded(Err(source))) => Err(DemoFsError::Serve { mountpoint, source }),
        Ok(Stop::Signal(signal)) => {
            tracing::info!(mountpoint = %mountpoint.display(), signal, "demofs stopping");
            detach_own_mount(&mountpoint, own_mount)
        }
    }
    // Returning ends the process, which closes the device: the kernel aborts
    // the connection, and the session thread's blocked read ends with it.
}

/// Detaches the top mount at `mountpoint` if it is ours. A mount stacked on
/// top of ours belongs to someone else and stays.
fn detach_own_mount(mountpoint: &Path, own_mount: Option<u64>) -> Result<(), DemoFsError> {
    match (own_mount, sys_fuse::top_mount_id(mountpoint)) {
        (Some(own), Ok(top)) if own != top => {
            tracing::info!(mountpoint = %mountpoint.display(), "another mount is on top of ours; leaving it");
            Ok(())
        }
        _ => sys_mount::detach(mountpoint)
            .map_err(|source| DemoFsError::Detach { mountpoint: mountpoint.to_path_buf(), source }),
    }
}

/// Tells the caller that the mount answers: one line `ready` on stdout.
fn announce_ready() {
    let mut stdout = io::stdout().lock();
    // A caller that does not read stdout does not wait for the line either.
    let _ = writeln!(stdout, "ready").and_then(|()| stdout.flush());
}
