//! Opening paths without following attacker-controlled links, and asking which
//! mount an fd is on without touching the filesystem behind it.
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags, StatxFlags};

/// `openat2(dir, path, O_PATH|O_CLOEXEC, RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS)`.
///
/// `path` is relative to `dir`; `..` escapes, absolute paths and any symlink
/// on the way fail (`EXDEV`, `ELOOP`). The result is an `O_PATH` fd: no
/// `open` call reaches the filesystem, so it is safe on a dead FUSE mount.
pub fn open_beneath(dir: BorrowedFd<'_>, path: &Path) -> io::Result<OwnedFd> {
    open_path_beneath(dir, path, ResolveFlags::empty())
}

/// [`open_beneath`] that also crosses no mount (`RESOLVE_NO_XDEV`): `path`
/// is looked up within the mount `dir` is on, and names only a place on
/// that mount, or the call fails with `EXDEV` (a mount on the way, or at
/// `path` itself). Its lookups ask no filesystem but that one's.
pub fn open_beneath_within_mount(dir: BorrowedFd<'_>, path: &Path) -> io::Result<OwnedFd> {
    open_path_beneath(dir, path, ResolveFlags::NO_XDEV)
}

/// `openat2(dir, path, O_PATH|O_CLOEXEC)` beneath `dir`, refusing symlinks
/// and magic links, with `more` resolve flags.
fn open_path_beneath(dir: BorrowedFd<'_>, path: &Path, more: ResolveFlags) -> io::Result<OwnedFd> {
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS | more;
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

/// The inode of `name` in `dir` (`fstatat`, not following a symlink).
pub fn inode_at(dir: BorrowedFd<'_>, name: &str) -> io::Result<u64> {
    Ok(rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)?.st_ino)
}

/// `open(path, O_RDONLY|O_NOFOLLOW|O_CLOEXEC)`: a real open, which a FUSE
/// filesystem answers (a dead one with `ENOTCONN`), refusing a symlink in
/// the last component. The kubelet opens a volume so before it walks a
/// subPath beneath it; the test world does the same.
pub fn open_read_nofollow(path: &Path) -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(path, OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())?)
}

/// `openat(dir, path, O_RDONLY|O_CLOEXEC)`: a file read through a directory
/// the caller trusts and opened earlier, links followed (a `/proc` opened
/// before the thread joined another mount namespace, whose own `/proc` may
/// show another pid namespace: `thread-self/mountinfo` beneath it is the
/// calling thread's table wherever the thread is now).
pub fn open_readable_in(dir: BorrowedFd<'_>, path: &Path) -> io::Result<OwnedFd> {
    Ok(rustix::fs::openat(dir, path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?)
}

/// `openat(dir, name, O_PATH|O_NOFOLLOW|O_CLOEXEC)`: one component below
/// `dir`, a symlink opened as itself rather than followed (the kubelet's
/// walk of a subPath, one component at a time).
pub fn open_component_nofollow(dir: BorrowedFd<'_>, name: &Path) -> io::Result<OwnedFd> {
    Ok(rustix::fs::openat(dir, name, OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())?)
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

/// Whether a resolution failed on the tree itself: a symlink on the way
/// (`ELOOP`), an escape or a crossing refused (`EXDEV`), a component gone
/// or not a directory. Whoever owns the tree did that; trying again finds
/// the same until they change it.
pub fn refused_by_tree(err: &io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::ELOOP | libc::EXDEV | libc::ENOENT | libc::ENOTDIR))
}

/// The 32-bit mount ID (the first field of mountinfo) of the mount `fd` is on.
///
/// `statx(fd, "", AT_EMPTY_PATH|AT_STATX_DONT_SYNC|AT_SYMLINK_NOFOLLOW, 0)`:
/// the kernel fills `stx_mnt_id` from the fd's `struct path` after the
/// filesystem's getattr, and with an empty request mask and `DONT_SYNC` FUSE's
/// getattr answers from its cache (or, for a process the mount does not
/// allow, with the device alone): the daemon behind the fd, maybe hung, is
/// never asked. One syscall, where reading `/proc/thread-self/fdinfo/<fd>`
/// takes three and formats text; that stays the fallback should statx fail
/// (a FUSE inode marked bad answers every getattr with EIO). IDs are reused
/// after unmount, so do not key long-lived state on this alone.
pub fn mount_id_of(fd: BorrowedFd<'_>) -> io::Result<u32> {
    let flags = AtFlags::EMPTY_PATH | AtFlags::STATX_DONT_SYNC | AtFlags::SYMLINK_NOFOLLOW;
    match rustix::fs::statx(fd, c"", flags, StatxFlags::empty()) {
        Ok(stat) if stat.stx_mask & StatxFlags::MNT_ID.bits() != 0 => u32::try_from(stat.stx_mnt_id)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "statx mount ID does not fit 32 bits")),
        _ => mount_id_from_fdinfo(fd),
    }
}

/// The device (`major`, `minor`) of the filesystem `fd` is on, as mountinfo's
/// third field shows it.
///
/// The same `statx` call as [`mount_id_of`]: FUSE fills the device from its
/// superblock without asking the daemon.
pub fn device_of(fd: BorrowedFd<'_>) -> io::Result<(u32, u32)> {
    let flags = AtFlags::EMPTY_PATH | AtFlags::STATX_DONT_SYNC | AtFlags::SYMLINK_NOFOLLOW;
    let stat = rustix::fs::statx(fd, c"", flags, StatxFlags::empty())?;
    Ok((stat.stx_dev_major, stat.stx_dev_minor))
}

/// The mount ID and the device of the mount `fd` is on, from the one `statx`
/// of [`mount_id_of`] and [`device_of`]. The device is None where that
/// `statx` fails (the mount ID then comes from fdinfo, as in [`mount_id_of`]).
pub fn mount_and_device_of(fd: BorrowedFd<'_>) -> io::Result<(u32, Option<(u32, u32)>)> {
    let flags = AtFlags::EMPTY_PATH | AtFlags::STATX_DONT_SYNC | AtFlags::SYMLINK_NOFOLLOW;
    let Ok(stat) = rustix::fs::statx(fd, c"", flags, StatxFlags::empty()) else {
        return Ok((mount_id_from_fdinfo(fd)?, None));
    };
    let device = Some((stat.stx_dev_major, stat.stx_dev_minor));
    if stat.stx_mask & StatxFlags::MNT_ID.bits() == 0 {
        return Ok((mount_id_from_fdinfo(fd)?, device));
    }
    let id = u32::try_from(stat.stx_mnt_id)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "statx mount ID does not fit 32 bits"))?;
    Ok((id, device))
}

/// The unique, never reused, 64-bit ID of the mount `fd` is on
/// (`statx` with `STATX_MNT_ID_UNIQUE`, Linux 6.8): what `listmount` and
/// `statmount` take. `EOPNOTSUPP` where the kernel does not give it.
pub fn unique_mount_id_of(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let flags = AtFlags::EMPTY_PATH | AtFlags::STATX_DONT_SYNC | AtFlags::SYMLINK_NOFOLLOW;
    let unique = StatxFlags::from_bits_retain(linux_raw_sys::general::STATX_MNT_ID_UNIQUE);
    let stat = rustix::fs::statx(fd, c"", flags, unique)?;
    if stat.stx_mask & unique.bits() == 0 {
        return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
    }
    Ok(stat.stx_mnt_id)
}

/// The `mnt_id:` line of `/proc/thread-self/fdinfo/<fd>`, which the kernel
/// fills from the fd's `struct path` alone.
fn mount_id_from_fdinfo(fd: BorrowedFd<'_>) -> io::Result<u32> {
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
    fn statx_and_fdinfo_agree() {
        for path in ["/", "/proc", "/proc/self", "/dev", "/sys"] {
            let fd = open_path(Path::new(path)).unwrap();
            assert_eq!(mount_id_of(fd.as_fd()).unwrap(), mount_id_from_fdinfo(fd.as_fd()).unwrap(), "{path}");
        }
    }

    #[test]
    fn device_of_matches_stat() {
        use std::os::unix::fs::MetadataExt;
        for path in ["/", "/proc", "/dev"] {
            let fd = open_path(Path::new(path)).unwrap();
            let dev = fs::metadata(path).unwrap().dev();
            assert_eq!(device_of(fd.as_fd()).unwrap(), (libc::major(dev), libc::minor(dev)), "{path}");
        }
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
