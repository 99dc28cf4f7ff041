//! Calls that reach a FUSE daemon, for health probes. Any of them can block
//! for as long as the daemon is stopped: call them only from a worker thread.
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{Mode, OFlags, ResolveFlags};

/// `fstatfs` of the filesystem an fd is on. FUSE answers statfs from the
/// daemon, never from a cache, so success means the daemon is serving.
pub fn statfs(fd: BorrowedFd<'_>) -> io::Result<()> {
    rustix::fs::fstatfs(fd).map(drop).map_err(io::Error::from)
}

/// Opens `path` below `dir` on the same mount (O_PATH; no symlinks, no
/// magic links, no crossing into other mounts): a subdirectory of a source.
pub fn open_within_mount(dir: BorrowedFd<'_>, path: &Path) -> io::Result<OwnedFd> {
    rustix::fs::openat2(
        dir,
        path,
        OFlags::PATH | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS | ResolveFlags::NO_XDEV,
    )
    .map_err(io::Error::from)
}

/// Opens the mount on `path` below `dir`: its parent directory as
/// [`open_within_mount`] does, then its last name, which crosses onto
/// whatever is mounted there (O_PATH; no symlinks, no magic links). Both
/// lookups are `dir`'s filesystem's.
pub fn open_mount_within(dir: BorrowedFd<'_>, path: &Path) -> io::Result<OwnedFd> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::from(rustix::io::Errno::INVAL));
    };
    let within;
    let parent = if parent.as_os_str().is_empty() {
        dir
    } else {
        within = open_within_mount(dir, parent)?;
        std::os::fd::AsFd::as_fd(&within)
    };
    rustix::fs::openat2(
        parent,
        name,
        OFlags::PATH | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(io::Error::from)
}

/// `ENAMETOOLONG`: what a lookup of a path longer than `PATH_MAX` fails with,
/// before it asks any filesystem.
pub fn name_too_long() -> io::Error {
    io::Error::from(rustix::io::Errno::NAMETOOLONG)
}

/// `EIO`'s number, for an error that has none.
pub fn eio() -> i32 {
    rustix::io::Errno::IO.raw_os_error()
}
