//! Opening paths without following attacker-controlled links, and asking which
//! mount an fd is on without touching the filesystem behind it.
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{Mode, OFlags, ResolveFlags};

/// `openat2(dir, path, O_PATH|O_CLOEXEC, RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS)`.
///
/// `path` is relative to `dir`; `..` escapes, absolute paths and any symlink
/// on the way fail (`EXDEV`, `ELOOP`). The result is an `O_PATH` fd: no
/// `open` call reaches the filesystem, so it is safe on a dead FUSE mount.
pub fn open_beneath(dir: BorrowedFd<'_>, path: &Path) -> io::Result<OwnedFd> {
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    Ok(rustix::fs::openat2(dir, path, OFlags::PATH | OFlags::CLOEXEC, Mode::empty(), resolve)?)
}

/// `open(path, O_PATH|O_CLOEXEC|O_NOFOLLOW)`: an fd on whatever is at `path`
/// (the topmost mount if it is a mount point), without following a symlink in
/// the last component. Meant for absolute paths the caller trusts.
pub fn open_path(path: &Path) -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(path, OFlags::PATH | OFlags::CLOEXEC | OFlags::NOFOLLOW, Mode::empty())?)
}

/// `open(path, O_PATH|O_DIRECTORY|O_CLOEXEC)`: an fd on a directory, to
/// resolve beneath or to mount onto.
pub fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(path, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?)
}

/// Reads a small regular file whole, refusing a symlink in the last component
/// (`ELOOP`), anything but a regular file (so a FIFO put there cannot block the
/// reader), and a file longer than `limit` bytes (`EFBIG`).
pub fn read_small_file(path: &Path, limit: usize) -> io::Result<Vec<u8>> {
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
    let file = fs::File::from(rustix::fs::open(path, flags, Mode::empty())?);
    if !file.metadata()?.file_type().is_file() {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let mut bytes = Vec::new();
    // One byte past the limit tells a file at the limit from a longer one.
    io::Read::read_to_end(&mut io::Read::take(&file, limit as u64 + 1), &mut bytes)?;
    if bytes.len() > limit {
        return Err(io::Error::from_raw_os_error(libc::EFBIG));
    }
    Ok(bytes)
}

/// The 32-bit mount ID (the first field of mountinfo) of the mount `fd` is on.
///
/// Read from the `mnt_id:` line of `/proc/thread-self/fdinfo/<fd>`, which the
/// kernel fills from the fd's `struct path` alone: the filesystem behind the
/// fd (maybe a hung FUSE mount) is never asked. IDs are reused after unmount,
/// so do not key long-lived state on this alone.
pub fn mount_id_of(fd: BorrowedFd<'_>) -> io::Result<u32> {
    let fdinfo = fs::read_to_string(format!("/proc/thread-self/fdinfo/{}", fd.as_raw_fd()))?;
    fdinfo
        .lines()
        .find_map(|line| line.strip_prefix("mnt_id:"))
        .and_then(|value| value.trim().parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "fdinfo has no mnt_id line"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn open_beneath_refuses_to_escape() {
        let root = open_dir(Path::new("/proc/self")).unwrap();
        let err = open_beneath(root.as_fd(), Path::new("../self")).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EXDEV));
        // /proc/self/cwd is a magic link.
        let err = open_beneath(root.as_fd(), Path::new("cwd")).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ELOOP));
    }

    #[test]
    fn mount_id_of_matches_mountinfo_of_root() {
        let root = open_dir(Path::new("/")).unwrap();
        let id = mount_id_of(root.as_fd()).unwrap();
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let root_line = mountinfo.lines().rfind(|line| line.split(" ").nth(4) == Some("/")).unwrap();
        assert_eq!(root_line.split(' ').next().unwrap(), id.to_string());
    }
}
