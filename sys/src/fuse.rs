//! What a FUSE daemon needs from the kernel: the `/dev/fuse` device, a raw
//! `mount(2)` of a `fuse.<subtype>` filesystem, the identity of that mount,
//! and the usage figures a `statfs` reply carries. Detaching is
//! [`crate::mount::detach`].
//!
//! The mount is made with the raw syscall on purpose: unlike libfuse and
//! `fusermount3`, it does not stat the mountpoint first, so it works on top of
//! a mountpoint whose top mount belongs to a dead FUSE daemon (the kernel does
//! not ask the dead daemon anything while mounting over it).
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{AtFlags, CWD, Mode, OFlags, StatxFlags};
use rustix::mount::MountFlags;

/// `STATX_MNT_ID_UNIQUE` (Linux 6.8): the 64-bit mount ID that is never
/// reused; rustix 1.1 has no name for it yet.
const STATX_MNT_ID_UNIQUE: u32 = 0x4000;

/// A connected pair of Unix `SOCK_SEQPACKET` sockets, close-on-exec: each
/// write is one message and each read returns one, as on `/dev/fuse`, so a
/// FUSE library can be handed one end in place of the device while the
/// other relays its messages.
pub fn message_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    Ok(rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?)
}

/// Shuts both directions of a socket from [`message_pair`]: the other end
/// reads end-of-file, as a library reads `ENODEV` from a dead connection.
pub fn end_messages(socket: BorrowedFd<'_>) -> io::Result<()> {
    Ok(rustix::net::shutdown(socket, rustix::net::Shutdown::Both)?)
}

/// Opens `/dev/fuse` for reading and writing, close-on-exec.
pub fn open_device() -> io::Result<OwnedFd> {
    Ok(rustix::fs::open("/dev/fuse", OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())?)
}

/// Mounts a `fuse.<subtype>` filesystem served through `device` on
/// `mountpoint`, on top of whatever is mounted there already.
///
/// The mount is `nosuid,nodev`, open to every user (`allow_other`) with
/// permissions checked by the kernel (`default_permissions`), and owned by the
/// calling effective user and group. `source` is what mountinfo shows as the
/// mount source. The kernel queues the FUSE `INIT` request on `device` before
/// this returns; every other request waits until the daemon has answered it.
/// The mountpoint is deliberately not examined first (see the module docs).
pub fn mount(device: BorrowedFd<'_>, mountpoint: &Path, subtype: &str, source: &str) -> io::Result<()> {
    let data = format!(
        "fd={},rootmode=40000,user_id={},group_id={},allow_other,default_permissions",
        device.as_raw_fd(),
        rustix::process::geteuid().as_raw(),
        rustix::process::getegid().as_raw(),
    );
    let data = CString::new(data).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    rustix::mount::mount(
        source,
        mountpoint,
        format!("fuse.{subtype}").as_str(),
        MountFlags::NOSUID | MountFlags::NODEV,
        Some(data.as_c_str()),
    )?;
    Ok(())
}

/// The ID of the topmost mount at `path`, read without asking any FUSE daemon
/// (`AT_STATX_DONT_SYNC`, and no attribute but the mount ID requested), so it
/// neither hangs on a stopped daemon nor fails on a dead one.
///
/// Prefers the unique 64-bit ID (Linux 6.8+), which is never reused; on older
/// kernels it is the 32-bit mountinfo ID, which can be reused once the mount
/// is gone.
pub fn top_mount_id(path: &Path) -> io::Result<u64> {
    let wanted = StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE) | StatxFlags::MNT_ID;
    let statx = rustix::fs::statx(CWD, path, AtFlags::SYMLINK_NOFOLLOW | AtFlags::STATX_DONT_SYNC, wanted)?;
    if statx.stx_mask & (STATX_MNT_ID_UNIQUE | StatxFlags::MNT_ID.bits()) == 0 {
        return Err(io::Error::from(io::ErrorKind::Unsupported));
    }
    Ok(statx.stx_mnt_id)
}

/// Space and inode usage of a filesystem, as a FUSE `statfs` reply carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsUsage {
    pub blocks: u64,
    pub blocks_free: u64,
    pub blocks_available: u64,
    pub files: u64,
    pub files_free: u64,
    pub block_size: u64,
    pub fragment_size: u64,
    pub name_max: u64,
}

/// Usage of the filesystem holding `path` (`statvfs(3)`).
pub fn fs_usage(path: &Path) -> io::Result<FsUsage> {
    let stat = rustix::fs::statvfs(path)?;
    Ok(FsUsage {
        blocks: stat.f_blocks,
        blocks_free: stat.f_bfree,
        blocks_available: stat.f_bavail,
        files: stat.f_files,
        files_free: stat.f_ffree,
        block_size: stat.f_bsize,
        fragment_size: stat.f_frsize,
        name_max: stat.f_namemax,
    })
}
