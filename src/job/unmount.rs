//! Unmounting a finished pod's FUSE mounts, in the mount namespaces that
//! hold them, never by `mount(8)` and never by a path a tenant can redirect.
//!
//! Each namespace gets a short-lived thread that joins it (the lifecycle
//! thread stays in the container's own namespace, where the kubelet token
//! and CA files are). The thread reads the namespace's table, and for each
//! mount on the connection's devices (children first, reverse table order):
//!
//! - resolves its mount point beneath the namespace's root with `openat2`
//!   (`RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS`, `O_PATH`):
//!   a directory of the path that a tenant swapped for a symlink (to `/etc`,
//!   to another mount) fails the resolution instead of leading elsewhere;
//! - checks that the mount on top there is the one the table recorded
//!   (mount ID and device);
//! - detaches it through that descriptor (`umount2("thread-self/fd/N",
//!   MNT_DETACH)` beneath a `/proc` opened before the thread left its
//!   namespace), so no path is walked again between the check and the
//!   unmount. This is `UMOUNT_NOFOLLOW` in effect: no link of the tenant's
//!   is followed, only the one magic link of our own descriptor, which the
//!   flag itself would refuse (`EINVAL`). The detach is always lazy: the
//!   descriptor itself keeps the mount busy for a plain `umount2`.
//!
//! A mount beneath another FUSE mount of a connection that is not being
//! ended is left, and reported: reaching it would ask that daemon, maybe a
//! tenant's that never answers. One beneath a mount being ended goes with
//! that mount's detach.
//!
//! Any walk can still meet a FUSE daemon that never answers (the ended
//! daemon itself answers the lookups of the directories its own mounts
//! cover; a FUSE mount made after the table was read is not known to be
//! one): a lookup the daemon has read holds the thread in the kernel, even
//! against SIGKILL. So the caller waits for the thread only until a
//! deadline and then goes on without it: a thread held by the ended daemon
//! is released when the lifecycle's SIGTERM or SIGKILL ends that daemon,
//! one held by another daemon when that one answers or dies.
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use fuse_supervisor_sys::{mount, ns, resolve};
use tracing::info;

use fuse_supervisor_engine::model::mountinfo::MountInfoReader;
use fuse_supervisor_engine::model::table::{Dev, Snapshot};
use fuse_supervisor_engine::watch::processes::fuse_server::MountDevice;

#[derive(Debug, thiserror::Error)]
pub enum UnmountError {
    #[error("cannot open /proc before joining mount namespace {path}")]
    Proc {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot join mount namespace {path}")]
    Namespace {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot open the root of mount namespace {path}")]
    Root {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the mount table of namespace {path}")]
    Table {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot start the unmount thread")]
    Thread(#[source] io::Error),
    #[error("the unmount thread panicked")]
    Panicked,
    #[error(
        "the unmount thread in namespace {path} has not finished after {waited:?} (a FUSE daemon not answering?); left to finish alone"
    )]
    Overdue { path: PathBuf, waited: Duration },
}

/// Why one mount point was not unmounted.
#[derive(Debug, thiserror::Error)]
pub enum PointError {
    #[error("cannot resolve mount point {path} beneath the namespace's root without links")]
    Resolve {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot tell which mount is on top at {path}")]
    Identify {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("mount point {path} is beneath the FUSE mount {fuse} of another connection, which is not walked")]
    BeneathOtherFuse { path: PathBuf, fuse: PathBuf },
    #[error("cannot detach the FUSE mount at {path}")]
    Detach {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl PointError {
    /// The mount point the error is about.
    pub fn path(&self) -> &Path {
        match self {
            PointError::Resolve { path, .. }
            | PointError::Identify { path, .. }
            | PointError::BeneathOtherFuse { path, .. }
            | PointError::Detach { path, .. } => path,
        }
    }
}

/// A FUSE mount as the namespace's table showed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedMount {
    /// As the namespace's root sees it.
    pub mount_point: PathBuf,
    pub mount_id: u32,
    pub dev: Dev,
}

/// The FUSE mounts of one namespace to unmount, and what is left alone.
#[derive(Debug, Default)]
pub struct Recorded {
    /// On the devices, children first, none beneath another of them.
    pub mounts: Vec<RecordedMount>,
    /// On the devices, but beneath a FUSE mount of another connection.
    pub refused: Vec<PointError>,
}

/// What happened in one namespace.
#[derive(Debug, Default)]
pub struct Unmounted {
    /// Mount points detached.
    pub unmounted: Vec<PathBuf>,
    /// Mount points that were not, with why.
    pub failed: Vec<PointError>,
}

/// Unmounts every mount on `devices` in the namespace at `namespace`
/// (`/proc/<pid>/ns/mnt`), waiting for the namespace's thread until
/// `deadline` at most.
pub fn unmount_devices(
    namespace: &Path,
    devices: &[MountDevice],
    deadline: Instant,
) -> Result<Unmounted, UnmountError> {
    let devices = devices.to_vec();
    in_namespace(namespace, deadline, move |proc, namespace| {
        let recorded = record_here(proc, namespace, &devices)?;
        let mut done = unmount_here(proc, namespace, &recorded.mounts)?;
        done.failed.extend(recorded.refused);
        Ok(done)
    })
}

/// The first half of [`unmount_devices`]: the FUSE mounts on `devices` that
/// the namespace's table shows.
pub fn record_mounts(namespace: &Path, devices: &[MountDevice], deadline: Instant) -> Result<Recorded, UnmountError> {
    let devices = devices.to_vec();
    in_namespace(namespace, deadline, move |proc, namespace| record_here(proc, namespace, &devices))
}

/// The second half of [`unmount_devices`]: detaches each of `mounts` that is
/// still, at its mount point resolved anew, the mount on top.
pub fn unmount_recorded(
    namespace: &Path,
    mounts: &[RecordedMount],
    deadline: Instant,
) -> Result<Unmounted, UnmountError> {
    let mounts = mounts.to_vec();
    in_namespace(namespace, deadline, move |proc, namespace| unmount_here(proc, namespace, &mounts))
}

/// Runs `work` on a new thread in the namespace at `namespace`, with a
/// descriptor of this thread's `/proc` (the namespace's may show another pid
/// namespace, where `thread-self` names nothing). Waits until `deadline`;
/// after it the thread is left to finish alone.
fn in_namespace<T: Send + 'static>(
    namespace: &Path,
    deadline: Instant,
    work: impl FnOnce(BorrowedFd<'_>, &Path) -> Result<T, UnmountError> + Send + 'static,
) -> Result<T, UnmountError> {
    let proc = resolve::open_dir(Path::new("/proc"))
        .map_err(|source| UnmountError::Proc { path: namespace.to_path_buf(), source })?;
    let (answer, answered) = mpsc::sync_channel(1);
    let joined = namespace.to_path_buf();
    let started = Instant::now();
    // Not joined: a thread held by a FUSE daemon must not hold the caller.
    std::thread::Builder::new()
        .name("job-unmount".into())
        .spawn(move || {
            let result = ns::join_mount_namespace(&joined)
                .map_err(|source| UnmountError::Namespace { path: joined.clone(), source })
                .and_then(|()| work(proc.as_fd(), &joined));
            // The caller stopped waiting past the deadline: nobody to tell.
            let _ = answer.send(result);
        })
        .map_err(UnmountError::Thread)?;
    match answered.recv_timeout(deadline.saturating_duration_since(started)) {
        Ok(result) => result,
        Err(mpsc::RecvTimeoutError::Timeout) => {
            Err(UnmountError::Overdue { path: namespace.to_path_buf(), waited: started.elapsed() })
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => Err(UnmountError::Panicked),
    }
}

/// In the calling thread's namespace (which it joined): its table's FUSE
/// mounts on `devices`.
fn record_here(proc: BorrowedFd<'_>, namespace: &Path, devices: &[MountDevice]) -> Result<Recorded, UnmountError> {
    let table_error = |source| UnmountError::Table { path: namespace.to_path_buf(), source };
    let file = File::from(resolve::open_readable_in(proc, Path::new("thread-self/mountinfo")).map_err(table_error)?);
    let mut reader = MountInfoReader::from_file(file);
    let table = reader.read().map_err(table_error)?;
    let snapshot =
        Snapshot::parse(table).map_err(|err| table_error(io::Error::new(io::ErrorKind::InvalidData, err)))?;
    let devs: Vec<Dev> = devices.iter().map(|d| Dev { major: d.major, minor: d.minor }).collect();
    let ours = |dev: &Dev| devs.contains(dev);
    let mut recorded = Recorded::default();
    for fuse in snapshot.fuse_mounts.iter().rev().filter(|m| ours(&m.dev)) {
        let path = &fuse.mount_point;
        // FUSE mounts a walk to `path` passes through.
        let above: Vec<_> = snapshot
            .fuse_mounts
            .iter()
            .filter(|other| path != &other.mount_point && path.starts_with(&other.mount_point))
            .collect();
        match above.iter().find(|other| !ours(&other.dev)) {
            Some(other) => {
                recorded
                    .refused
                    .push(PointError::BeneathOtherFuse { path: path.clone(), fuse: other.mount_point.clone() });
            }
            // The detach of the mount it is beneath takes it along.
            None if !above.is_empty() => {}
            None => recorded.mounts.push(RecordedMount {
                mount_point: path.clone(),
                mount_id: fuse.mount_id,
                dev: fuse.dev,
            }),
        }
    }
    Ok(recorded)
}

/// In the calling thread's namespace: detaches each of `mounts` that is the
/// mount on top at its mount point, resolved beneath the root.
fn unmount_here(proc: BorrowedFd<'_>, namespace: &Path, mounts: &[RecordedMount]) -> Result<Unmounted, UnmountError> {
    // The thread's root is the namespace's since it joined.
    let root = resolve::open_dir(Path::new("/"))
        .map_err(|source| UnmountError::Root { path: namespace.to_path_buf(), source })?;
    let mut done = Unmounted::default();
    for recorded in mounts {
        match unmount_one(proc, root.as_fd(), recorded) {
            Ok(true) => done.unmounted.push(recorded.mount_point.clone()),
            Ok(false) => {}
            Err(err) => done.failed.push(err),
        }
    }
    Ok(done)
}

/// Detaches `recorded` if it is on top at its mount point; false if another
/// mount is (it covers ours, or ours went with a parent already).
fn unmount_one(proc: BorrowedFd<'_>, root: BorrowedFd<'_>, recorded: &RecordedMount) -> Result<bool, PointError> {
    let path = &recorded.mount_point;
    let at = open_mount_point(root, path).map_err(|source| PointError::Resolve { path: path.clone(), source })?;
    let (id, device) = resolve::mount_and_device_of(at.as_fd())
        .map_err(|source| PointError::Identify { path: path.clone(), source })?;
    let recorded_device = (recorded.dev.major, recorded.dev.minor);
    if id != recorded.mount_id || device.is_some_and(|device| device != recorded_device) {
        info!(mount_point = %path.display(), expected = recorded.mount_id, found = id, ?device, "not the FUSE mount on top; left");
        return Ok(false);
    }
    mount::detach_top_through(proc, at.as_fd()).map_err(|source| PointError::Detach { path: path.clone(), source })?;
    Ok(true)
}

/// An `O_PATH` descriptor on the top mount at `path` (absolute, as the
/// namespace's table shows it), resolved beneath `root` with no link.
fn open_mount_point(root: BorrowedFd<'_>, path: &Path) -> io::Result<OwnedFd> {
    let relative = path.strip_prefix("/").map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let relative = if relative.as_os_str().is_empty() { Path::new(".") } else { relative };
    resolve::open_beneath(root, relative)
}
