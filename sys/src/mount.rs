//! Mounting by file descriptor (the new mount API) and the few path-based
//! mount calls the tests and the demo need.
//!
//! Everything here acts in the mount namespace of the *calling thread*; see
//! [`crate::ns`] to get a thread into the right one first.
use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use linux_raw_sys::general::{
    MOUNT_ATTR__ATIME, MOUNT_ATTR_IDMAP, MOUNT_ATTR_NOATIME, MOUNT_ATTR_NODEV, MOUNT_ATTR_NODIRATIME,
    MOUNT_ATTR_NOEXEC, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NOSYMFOLLOW, MOUNT_ATTR_RDONLY, MOUNT_ATTR_STRICTATIME,
};
use rustix::mount::{
    FsMountFlags, FsOpenFlags, MountAttrFlags, MountPropagationFlags, MoveMountFlags, OpenTreeFlags, UnmountFlags,
};

/// How a mount passes mount and unmount events to and from others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Propagation {
    /// `MS_SHARED`: a member of a peer group; events go both ways.
    Shared,
    /// `MS_SLAVE`: receives events from its former peer group, sends none.
    Slave,
    /// `MS_PRIVATE`: neither receives nor sends.
    Private,
}

impl Propagation {
    fn flags(self) -> MountPropagationFlags {
        match self {
            Propagation::Shared => MountPropagationFlags::SHARED,
            Propagation::Slave => MountPropagationFlags::DOWNSTREAM,
            Propagation::Private => MountPropagationFlags::PRIVATE,
        }
    }
}

/// `open_tree(at, "", OPEN_TREE_CLONE|OPEN_TREE_CLOEXEC|AT_EMPTY_PATH)`.
///
/// A detached, non-recursive bind of the location of `at` (mount and
/// directory), ready to be attached with [`move_mount`]. Mounts below that
/// location are not copied. Dropping the fd unmounts the copy if it was never
/// attached.
pub fn clone_mount(at: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let flags = OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC | OpenTreeFlags::AT_EMPTY_PATH;
    Ok(rustix::mount::open_tree(at, c"", flags)?)
}

/// `open_tree(at, "", OPEN_TREE_CLONE|AT_RECURSIVE|OPEN_TREE_CLOEXEC|AT_EMPTY_PATH)`:
/// a detached copy of the mount `at` is the root of, with every mount
/// below it, each with its original's attributes and propagation (a peer
/// of a shared one, a slave of a slave's master). The copy stands on its
/// own: it stays whole when the original is detached (as the kernel does
/// to mounts on a dentry it invalidates), and [`move_mount`] attaches it.
/// Refused (`EINVAL`) for a mount not in the calling thread's namespace.
pub fn clone_tree(at: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let flags = OpenTreeFlags::OPEN_TREE_CLONE
        | OpenTreeFlags::AT_RECURSIVE
        | OpenTreeFlags::OPEN_TREE_CLOEXEC
        | OpenTreeFlags::AT_EMPTY_PATH;
    Ok(rustix::mount::open_tree(at, c"", flags)?)
}

/// `open_tree(at, "", OPEN_TREE_CLOEXEC|AT_EMPTY_PATH)`: a handle on the mount
/// `at` is on, itself (no copy), to move it with [`move_mount`].
pub fn open_mount(at: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let flags = OpenTreeFlags::OPEN_TREE_CLOEXEC | OpenTreeFlags::AT_EMPTY_PATH;
    Ok(rustix::mount::open_tree(at, c"", flags)?)
}

/// `move_mount(mount, "", onto, "", MOVE_MOUNT_F_EMPTY_PATH|MOVE_MOUNT_T_EMPTY_PATH)`.
///
/// Attaches `mount` (from [`clone_mount`], [`open_mount`] or
/// [`detached_tmpfs`]) on top of whatever is at `onto`. If the destination is
/// shared, the kernel propagates copies to its peers and slaves. Fails with
/// `EINVAL` when the mount being moved has a shared parent.
pub fn move_mount(mount: BorrowedFd<'_>, onto: BorrowedFd<'_>) -> io::Result<()> {
    let flags = MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH;
    Ok(rustix::mount::move_mount(mount, c"", onto, c"", flags)?)
}

/// Like [`move_mount`], with `MOVE_MOUNT_BENEATH` (Linux ≥ 6.5): the mount is
/// slid *under* the topmost mount at `onto` instead of stacked on it.
pub fn move_mount_beneath(mount: BorrowedFd<'_>, onto: BorrowedFd<'_>) -> io::Result<()> {
    let flags = MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH
        | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH
        | MoveMountFlags::MOVE_MOUNT_BENEATH;
    Ok(rustix::mount::move_mount(mount, c"", onto, c"", flags)?)
}

/// Whether this kernel knows `MOVE_MOUNT_BENEATH` (6.5, or a backport). The
/// call names no mount: a kernel that knows the flag fails the lookup of the
/// empty path (`ENOENT`), one that does not refuses the flag first (`EINVAL`).
pub fn move_mount_beneath_supported() -> bool {
    let flags = MoveMountFlags::MOVE_MOUNT_BENEATH;
    let refused = rustix::mount::move_mount(rustix::fs::CWD, c"", rustix::fs::CWD, c"", flags);
    !matches!(refused, Err(rustix::io::Errno::INVAL))
}

/// A flag bit no kernel gives a meaning in `open_tree`, `move_mount` or
/// `mount_setattr`: each refuses it (EINVAL) before doing anything else.
const UNKNOWN_FLAG: u32 = 1 << 30;

/// The first of the new mount API's calls a heal makes (`open_tree`,
/// `move_mount`, `mount_setattr`) that does not reach the kernel, with its
/// error: ENOSYS from a kernel without it (before 5.2; `mount_setattr`
/// 5.12) or a seccomp profile that does not list it, EPERM from one (or an
/// LSM) that forbids it. Each is made with a flag no kernel knows, which
/// the kernel refuses with EINVAL before it looks at anything: nothing is
/// opened, moved or changed. None when all three reach it.
pub fn new_mount_api_refusal() -> Option<(&'static str, io::Error)> {
    let refused = |call: &'static str, result: io::Result<()>| match result {
        Err(err) if err.raw_os_error() == Some(libc::EINVAL) => None,
        Err(err) => Some((call, err)),
        // A kernel that took the flag: the call reaches it all the same.
        Ok(()) => None,
    };
    let open_tree = rustix::mount::open_tree(rustix::fs::CWD, c"", OpenTreeFlags::from_bits_retain(UNKNOWN_FLAG));
    let move_mount = rustix::mount::move_mount(
        rustix::fs::CWD,
        c"",
        rustix::fs::CWD,
        c"",
        MoveMountFlags::from_bits_retain(UNKNOWN_FLAG),
    );
    // SAFETY: integers, a NUL-terminated empty path and a null attribute
    // pointer of size 0: the kernel refuses the flag before it reads either,
    // and would answer EFAULT, not write, for the null pointer.
    let set_attributes = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            c"".as_ptr(),
            UNKNOWN_FLAG,
            std::ptr::null::<libc::mount_attr>(),
            0_usize,
        )
    };
    let set_attributes = if set_attributes == -1 { Err(io::Error::last_os_error()) } else { Ok(()) };
    refused("open_tree", open_tree.map(drop).map_err(io::Error::from))
        .or_else(|| refused("move_mount", move_mount.map_err(io::Error::from)))
        .or_else(|| refused("mount_setattr", set_attributes))
}

/// `mount_setattr(mount, "", AT_EMPTY_PATH, {propagation})`, non-recursive.
///
/// Acts on exactly the mount the fd is on, even when other mounts are stacked
/// on top of it, as long as the fd points at that mount's root (an `O_PATH` fd
/// taken on the mount point before it was covered does). `EINVAL` otherwise.
pub fn set_propagation_of(mount: BorrowedFd<'_>, propagation: Propagation) -> io::Result<()> {
    let attr =
        libc::mount_attr { attr_set: 0, attr_clr: 0, propagation: u64::from(propagation.flags().bits()), userns_fd: 0 };
    mount_setattr(mount, &attr)
}

/// `mount_setattr(mount, "", AT_EMPTY_PATH, attr)`: on the mount `mount` is
/// the root of.
fn mount_setattr(mount: BorrowedFd<'_>, attr: &libc::mount_attr) -> io::Result<()> {
    // SAFETY: `mount` is a valid open fd for the duration of the call, the path
    // is a NUL-terminated empty string, and `attr` is a live, initialised
    // `mount_attr` whose exact size is passed; the kernel only reads it.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            mount.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint,
            attr as *const libc::mount_attr,
            size_of::<libc::mount_attr>(),
        )
    };
    if ret == -1 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// A mount's own attributes (`MOUNT_ATTR_*`), as `statmount` reports them
/// (`mnt_attr`) and `mount_setattr` sets them: per mount, not per
/// filesystem, so a bind or a clone does not inherit them from the mount
/// it copies (the clone takes its source's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct MountAttributes(u64);

impl MountAttributes {
    pub const READ_ONLY: MountAttributes = MountAttributes(MOUNT_ATTR_RDONLY as u64);
    pub const NOSUID: MountAttributes = MountAttributes(MOUNT_ATTR_NOSUID as u64);
    pub const NODEV: MountAttributes = MountAttributes(MOUNT_ATTR_NODEV as u64);
    pub const NOEXEC: MountAttributes = MountAttributes(MOUNT_ATTR_NOEXEC as u64);
    /// The atime mode is a field, not a flag: relatime is 0.
    pub const NOATIME: MountAttributes = MountAttributes(MOUNT_ATTR_NOATIME as u64);
    pub const STRICTATIME: MountAttributes = MountAttributes(MOUNT_ATTR_STRICTATIME as u64);
    pub const NODIRATIME: MountAttributes = MountAttributes(MOUNT_ATTR_NODIRATIME as u64);
    pub const NOSYMFOLLOW: MountAttributes = MountAttributes(MOUNT_ATTR_NOSYMFOLLOW as u64);
    /// The mount shows its files' owners through a user namespace's
    /// mapping; only `mount_setattr` with that namespace sets it.
    pub const IDMAP: MountAttributes = MountAttributes(MOUNT_ATTR_IDMAP as u64);
    /// Everything a replacement takes over by [`set_attributes_of`]: the
    /// idmapping is not among them (it needs a user namespace, and once
    /// set it cannot be cleared).
    const CARRIED: u64 = (MOUNT_ATTR_RDONLY
        | MOUNT_ATTR_NOSUID
        | MOUNT_ATTR_NODEV
        | MOUNT_ATTR_NOEXEC
        | MOUNT_ATTR__ATIME
        | MOUNT_ATTR_NODIRATIME
        | MOUNT_ATTR_NOSYMFOLLOW) as u64;

    pub const fn from_bits(bits: u64) -> Self {
        MountAttributes(bits)
    }

    pub const fn bits(self) -> u64 {
        self.0
    }

    pub const fn contains(self, other: MountAttributes) -> bool {
        self.0 & other.0 == other.0
    }

    pub const fn union(self, other: MountAttributes) -> Self {
        MountAttributes(self.0 | other.0)
    }

    /// The attributes [`set_attributes_of`] carries: all but the idmapping.
    pub const fn carried(self) -> Self {
        MountAttributes(self.0 & Self::CARRIED)
    }
}

/// `mount_setattr(mount, "", AT_EMPTY_PATH, {attr_set, attr_clr, propagation})`
/// (Linux 5.12), non-recursive: gives the mount exactly `attributes`'
/// read-only, nosuid, nodev, noexec, atime mode, nodiratime and
/// nosymfollow (each set or cleared), and `propagation` if given, in one
/// call. Meant for a detached clone, before it is attached: nothing sees
/// it with its source's attributes. An idmapping in `attributes` is
/// ignored (see [`MountAttributes::carried`]).
pub fn set_attributes_of(
    mount: BorrowedFd<'_>,
    attributes: MountAttributes,
    propagation: Option<Propagation>,
) -> io::Result<()> {
    let attr = libc::mount_attr {
        attr_set: attributes.carried().bits(),
        attr_clr: MountAttributes::CARRIED,
        propagation: propagation.map_or(0, |propagation| u64::from(propagation.flags().bits())),
        userns_fd: 0,
    };
    mount_setattr(mount, &attr)
}

/// `mount_setattr` with `MOUNT_ATTR_IDMAP` (Linux 5.12; a FUSE filesystem
/// from 6.12, where its server allows it): `mount` shows its files' owners
/// through the mapping of the user namespace `user_namespace` (an fd on a
/// `/proc/<pid>/ns/user`). Only a detached mount (a clone not attached yet)
/// that is not idmapped already can be given one.
pub fn set_idmapping_of(mount: BorrowedFd<'_>, user_namespace: BorrowedFd<'_>) -> io::Result<()> {
    let attr = libc::mount_attr {
        attr_set: u64::from(MOUNT_ATTR_IDMAP),
        attr_clr: 0,
        propagation: 0,
        userns_fd: user_namespace.as_raw_fd() as u64,
    };
    mount_setattr(mount, &attr)
}

/// [`set_propagation_of`] with `MS_PRIVATE`: the mount leaves its peer group
/// and its master, so unmounting or moving it afterwards propagates nowhere.
pub fn make_private(mount: BorrowedFd<'_>) -> io::Result<()> {
    set_propagation_of(mount, Propagation::Private)
}

/// `umount2("/proc/thread-self/fd/N", MNT_DETACH)`.
///
/// Beware: this acts on the **topmost** mount at the fd's location, not
/// necessarily on the mount the fd was opened on. If another mount has been
/// stacked there since the fd was taken, that one is detached. Only call it
/// once the mount you mean is known to be on top.
pub fn detach_top(at: BorrowedFd<'_>) -> io::Result<()> {
    detach(Path::new(&format!("/proc/thread-self/fd/{}", at.as_raw_fd())))
}

/// [`detach_top`] through `proc`, an fd of a `/proc` opened before the
/// thread left its namespace: `fchdir(proc)`, then
/// `umount2("thread-self/fd/N", MNT_DETACH)`, then back to `/`. In a
/// container's mount namespace `/proc` is the container's, which shows only
/// the processes of its pid namespace: `/proc/thread-self` names nothing
/// there. Changes the calling thread's working directory, so call it only
/// on a thread that unshared `CLONE_FS` (as [`crate::ns`] does).
pub fn detach_top_through(proc: BorrowedFd<'_>, at: BorrowedFd<'_>) -> io::Result<()> {
    rustix::process::fchdir(proc)?;
    let detached = rustix::mount::unmount(format!("thread-self/fd/{}", at.as_raw_fd()).as_str(), UnmountFlags::DETACH);
    // The root is always there to go back to.
    let _ = rustix::process::chdir("/");
    Ok(detached?)
}

/// `umount2(path, MNT_DETACH)`: lazily detach the topmost mount at `path`,
/// with every mount below it in the tree.
pub fn detach(path: &Path) -> io::Result<()> {
    Ok(rustix::mount::unmount(path, UnmountFlags::DETACH)?)
}

/// `umount2(path, MNT_EXPIRE|UMOUNT_NOFOLLOW)`: the topmost mount at
/// `path`, unused and with no mounts on it, is marked expired (`EAGAIN`) the
/// first time and unmounted the second, unless it was used in between (any
/// lookup through it clears the mark). A mount made on top in between is
/// unmarked, so the second call cannot take it; `EBUSY` while it is used.
pub fn expire(path: &Path) -> io::Result<()> {
    Ok(rustix::mount::unmount(path, UnmountFlags::EXPIRE | UnmountFlags::NOFOLLOW)?)
}

/// `umount2(path, 0)`: unmount the topmost mount at `path`; `EBUSY` while
/// anything uses it (an open file, a mount below it).
pub fn unmount(path: &Path) -> io::Result<()> {
    Ok(rustix::mount::unmount(path, UnmountFlags::empty())?)
}

/// `mount(source, target, NULL, MS_BIND)`: a non-recursive bind by path. For
/// tests and the demo; the healer mounts by fd.
pub fn bind(source: &Path, target: &Path) -> io::Result<()> {
    Ok(rustix::mount::mount_bind(source, target)?)
}

/// `mount(NULL, target, NULL, MS_REMOUNT|MS_BIND|MS_RDONLY)`: the bind at
/// `target` made read-only, its filesystem left as it is, as a CSI driver
/// publishes a read-only volume. For tests.
pub fn remount_bind_read_only(target: &Path) -> io::Result<()> {
    let flags = rustix::mount::MountFlags::BIND | rustix::mount::MountFlags::RDONLY;
    Ok(rustix::mount::mount_remount(target, flags, c"")?)
}

/// `mount("tmpfs", target, "tmpfs", 0, NULL)`.
pub fn mount_tmpfs(target: &Path) -> io::Result<()> {
    const TMPFS: &CStr = c"tmpfs";
    Ok(rustix::mount::mount(TMPFS, target, TMPFS, rustix::mount::MountFlags::empty(), None)?)
}

/// `mount("tmpfs", target, "tmpfs", ro ? MS_RDONLY : 0, "size=<bytes>")`:
/// a small tmpfs, for tests of a full or read-only directory.
pub fn mount_tmpfs_limited(target: &Path, bytes: u64, read_only: bool) -> io::Result<()> {
    const TMPFS: &CStr = c"tmpfs";
    let flags = if read_only { rustix::mount::MountFlags::RDONLY } else { rustix::mount::MountFlags::empty() };
    let data = std::ffi::CString::new(format!("size={bytes}")).map_err(io::Error::other)?;
    Ok(rustix::mount::mount(TMPFS, target, TMPFS, flags, Some(data.as_c_str()))?)
}

/// `mount("fusectl", target, "fusectl", 0, NULL)`: the FUSE control
/// filesystem (`/sys/fs/fuse/connections` on a host), for a namespace that
/// has none mounted.
pub fn mount_fusectl(target: &Path) -> io::Result<()> {
    const FUSECTL: &CStr = c"fusectl";
    Ok(rustix::mount::mount(FUSECTL, target, FUSECTL, rustix::mount::MountFlags::empty(), None)?)
}

/// `fsopen("fusectl")`, `fsconfig(CREATE)`, `fsmount()`: the FUSE control
/// filesystem, attached nowhere. It has one instance for the whole node,
/// listing every connection whatever namespace made it, so this reads the
/// same directories as a mount of it elsewhere, where there is none or it
/// cannot be reached. Needs `CAP_SYS_ADMIN` in the initial user namespace.
pub fn detached_fusectl() -> io::Result<OwnedFd> {
    let context = rustix::mount::fsopen(c"fusectl", FsOpenFlags::FSOPEN_CLOEXEC)?;
    rustix::mount::fsconfig_create(&context)?;
    Ok(rustix::mount::fsmount(&context, FsMountFlags::FSMOUNT_CLOEXEC, MountAttrFlags::MOUNT_ATTR_RDONLY)?)
}

/// Whether `fd` is on the FUSE control filesystem (its `statfs` magic).
pub fn is_fusectl(fd: BorrowedFd<'_>) -> io::Result<bool> {
    const FUSE_CTL_SUPER_MAGIC: i64 = 0x6573_5543;
    Ok(rustix::fs::fstatfs(fd)?.f_type as i64 == FUSE_CTL_SUPER_MAGIC)
}

/// `fsopen("tmpfs")`, `fsconfig(CREATE)`, `fsmount()`: a new private tmpfs
/// attached nowhere. It disappears when the fd is closed unless it was
/// attached with [`move_mount`] first.
pub fn detached_tmpfs() -> io::Result<OwnedFd> {
    let context = rustix::mount::fsopen(c"tmpfs", FsOpenFlags::FSOPEN_CLOEXEC)?;
    rustix::mount::fsconfig_create(&context)?;
    Ok(rustix::mount::fsmount(&context, FsMountFlags::FSMOUNT_CLOEXEC, MountAttrFlags::empty())?)
}

/// `mount(NULL, path, NULL, MS_SHARED|MS_SLAVE|MS_PRIVATE [|MS_REC])`: change
/// the propagation of the topmost mount at `path` (and, with `recursive`, of
/// every mount below it).
pub fn set_propagation(path: &Path, propagation: Propagation, recursive: bool) -> io::Result<()> {
    let mut flags = propagation.flags();
    if recursive {
        flags |= MountPropagationFlags::REC;
    }
    Ok(rustix::mount::mount_change(path, flags)?)
}
