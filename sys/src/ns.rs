//! Moving the calling thread between mount namespaces (and, for one
//! socket, into another network namespace).
//!
//! Mount namespaces are per thread once `CLONE_FS` is unshared: only the
//! calling thread moves, the rest of the process stays where it was. A
//! thread that did this should be dedicated to mount work and never handed
//! back to a pool.
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};
use rustix::thread::{LinkNameSpaceType, UnshareFlags};

/// `unshare(CLONE_FS)` then `setns(open(ns_file), CLONE_NEWNS)`.
///
/// Only the calling thread joins the namespace at `ns_file` (e.g.
/// `/proc/1/ns/mnt`, the host's with hostPID). `setns` into a mount namespace
/// refuses a thread that shares its `fs_struct` (cwd, root) with others,
/// hence the first unshare. The thread's root and cwd become the namespace's
/// root.
pub fn join_mount_namespace(ns_file: &Path) -> io::Result<()> {
    let namespace = rustix::fs::open(ns_file, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
    enter_mount_namespace(namespace.as_fd())
}

/// `setns`'s error where it does not reach the kernel (EPERM or ENOSYS
/// from a seccomp profile): it is asked to join the namespace of no
/// descriptor (-1), which the kernel refuses with EBADF and nothing else.
/// None when it reaches the kernel.
pub fn setns_refusal() -> Option<io::Error> {
    // SAFETY: integers only; with fd -1 the kernel returns EBADF at once.
    let joined = unsafe { libc::setns(-1, 0) };
    let err = io::Error::last_os_error();
    (joined == -1 && err.raw_os_error() != Some(libc::EBADF)).then_some(err)
}

/// [`join_mount_namespace`] with an open namespace fd, e.g. one from
/// [`open_thread_mount_namespace`] on another thread.
pub fn enter_mount_namespace(namespace: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: the `unsafe` of `unshare` is about CLONE_FILES (other threads'
    // fds vanishing from this thread's table); CLONE_FS only gives this thread
    // its own cwd/root/umask, which no other thread relies on.
    unsafe { rustix::thread::unshare_unsafe(UnshareFlags::FS)? };
    rustix::thread::move_into_link_name_space(namespace, Some(LinkNameSpaceType::Mount))?;
    Ok(())
}

/// `setns(open(ns_file), CLONE_NEWNET)` on the calling thread only: a socket
/// it creates afterwards belongs to that network namespace wherever it is
/// used from (the netlink process connector answers only in the host's,
/// `/proc/1/ns/net` with hostPID). Needs CAP_SYS_ADMIN. Call it on a thread
/// of its own that ends once its sockets are made: the rest of the process
/// keeps its own network namespace.
pub fn join_network_namespace(ns_file: &Path) -> io::Result<()> {
    let namespace = rustix::fs::open(ns_file, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
    rustix::thread::move_into_link_name_space(namespace.as_fd(), Some(LinkNameSpaceType::Network))?;
    Ok(())
}

/// `NS_GET_MNTNS_ID`: `_IOR(0xb7, 5, __u64)` in the generic ioctl
/// encoding (x86, arm, riscv; linux-raw-sys has no constant for it yet).
const NS_GET_MNTNS_ID: libc::c_ulong = (2 << 30) | (8 << 16) | (0xb7 << 8) | 5;

/// `ioctl(namespace, NS_GET_MNTNS_ID)`: the 64-bit ID of the mount
/// namespace `namespace` is an nsfs descriptor of (`/proc/<pid>/ns/mnt`
/// opened), which listmount and statmount name it by (Linux 6.11+).
/// `ENOTTY` before, or when `namespace` is not a mount namespace.
pub fn mount_namespace_id(namespace: BorrowedFd<'_>) -> io::Result<u64> {
    let mut id = 0u64;
    // SAFETY: `namespace` is an open descriptor for the call's duration;
    // the request writes one u64, to `id`, which lives across the call.
    let ret = unsafe { libc::ioctl(namespace.as_raw_fd(), NS_GET_MNTNS_ID as _, &raw mut id) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(id)
}

/// `open("/proc/thread-self/ns/mnt")`: the calling thread's mount namespace,
/// for helper threads to enter with [`enter_mount_namespace`]. The fd keeps
/// the namespace, not the thread, alive.
pub fn open_thread_mount_namespace() -> io::Result<OwnedFd> {
    Ok(rustix::fs::open("/proc/thread-self/ns/mnt", OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?)
}

/// `unshare(CLONE_FS|CLONE_NEWNS)` on the calling thread.
///
/// The new namespace is a copy of the old one **with propagation unchanged**:
/// shared mounts stay in their peer groups, so mounting under one still
/// reaches the original namespace. Make `/` recursively private or slave
/// first thing if that is not wanted.
pub fn unshare_mount_namespace() -> io::Result<()> {
    // SAFETY: see `join_mount_namespace`: no CLONE_FILES, so no fd of any
    // other thread is affected.
    unsafe { rustix::thread::unshare_unsafe(UnshareFlags::FS | UnshareFlags::NEWNS)? };
    Ok(())
}

/// `/proc/<pid>/task/<tid>/ns/mnt` of the calling thread: a path other threads
/// and processes can open to join or inspect this thread's namespace while it
/// lives.
pub fn current_thread_mount_namespace() -> PathBuf {
    thread_proc_dir().join("ns/mnt")
}

/// `/proc/<pid>/task/<tid>` of the calling thread, usable from other threads
/// (unlike `/proc/thread-self`).
pub fn thread_proc_dir() -> PathBuf {
    let pid = rustix::process::getpid().as_raw_nonzero();
    let tid = rustix::thread::gettid().as_raw_nonzero();
    PathBuf::from(format!("/proc/{pid}/task/{tid}"))
}
