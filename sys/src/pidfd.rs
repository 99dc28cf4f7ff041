//! Process file descriptors: a handle on one process that a recycled pid
//! cannot redirect. It becomes readable (`EPOLLIN`) once the whole thread
//! group has exited, in any pid namespace, without being the parent.
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::process::{Pid, PidfdFlags};

use crate::process::{ExitStatus, Signal};

/// `struct pidfd_info` up to `exit_code` (`PIDFD_INFO_SIZE_VER0`, 64 bytes,
/// Linux 6.15). Later kernels append fields; the ioctl is extensible and
/// copies only the size the caller passes.
#[repr(C)]
#[derive(Debug, Default)]
struct PidfdInfo {
    mask: u64,
    cgroupid: u64,
    pid: u32,
    tgid: u32,
    ppid: u32,
    ruid: u32,
    rgid: u32,
    euid: u32,
    egid: u32,
    suid: u32,
    sgid: u32,
    fsuid: u32,
    fsgid: u32,
    exit_code: i32,
}

const _: () = assert!(std::mem::size_of::<PidfdInfo>() == 64);

/// `PIDFD_INFO_EXIT`: ask for (and, in the answer, "there is") the exit status.
const PIDFD_INFO_EXIT: u64 = 1 << 3;
/// `PIDFD_GET_INFO`: `_IOWR(PIDFS_IOCTL_MAGIC = 0xFF, 11, struct pidfd_info)`.
const PIDFD_GET_INFO: rustix::ioctl::Opcode = rustix::ioctl::opcode::read_write::<PidfdInfo>(0xFF, 11);

/// A pidfd (`pidfd_open(pid, 0)`).
#[derive(Debug)]
pub struct PidFd {
    fd: OwnedFd,
}

impl PidFd {
    /// Opens the process that has `pid` in the caller's pid namespace now.
    /// `ESRCH`: no such process (a zombie still has one).
    pub fn open(pid: u32) -> io::Result<PidFd> {
        let pid = raw_pid(pid)?;
        Ok(PidFd { fd: rustix::process::pidfd_open(pid, PidfdFlags::empty())? })
    }

    /// `pidfd_send_signal`: reaches this process even if its pid was reused.
    pub fn signal(&self, signal: Signal) -> io::Result<()> {
        Ok(rustix::process::pidfd_send_signal(&self.fd, signal.to_rustix())?)
    }

    /// The exit status (`PIDFD_GET_INFO`, Linux 6.15+). `None` while the
    /// process runs, after it exited but before its parent reaped it (the
    /// kernel records the status at reap), and on older kernels.
    pub fn exit_status(&self) -> io::Result<Option<ExitStatus>> {
        let mut info = PidfdInfo { mask: PIDFD_INFO_EXIT, ..PidfdInfo::default() };
        // SAFETY: PIDFD_GET_INFO takes a pointer to a `struct pidfd_info` of
        // the size encoded in the opcode, which is `PidfdInfo`'s (a `repr(C)`
        // copy of the uapi layout up to `exit_code`); the kernel writes at
        // most that many bytes, and `info` outlives the call.
        let result = unsafe {
            rustix::ioctl::ioctl(&self.fd, rustix::ioctl::Updater::<PIDFD_GET_INFO, PidfdInfo>::new(&mut info))
        };
        match result {
            Ok(()) if info.mask & PIDFD_INFO_EXIT != 0 => Ok(Some(ExitStatus::from_wait_status(info.exit_code as u32))),
            Ok(()) => Ok(None),
            // Before 6.15 pidfds have no ioctls.
            Err(rustix::io::Errno::NOTTY | rustix::io::Errno::INVAL) => Ok(None),
            Err(errno) => Err(errno.into()),
        }
    }
}

impl PidFd {
    /// `pidfd_getfd`: a duplicate, in this process, of the process's open
    /// file `fd` (the same open file, not a new open). Needs ptrace access
    /// to the process.
    pub fn get_fd(&self, fd: i32) -> io::Result<OwnedFd> {
        Ok(rustix::process::pidfd_getfd(&self.fd, fd, rustix::process::PidfdGetfdFlags::empty())?)
    }
}

impl AsFd for PidFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

fn raw_pid(pid: u32) -> io::Result<Pid> {
    i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("invalid pid {pid}")))
}

#[cfg(test)]
mod tests {
    use std::process::Command;
    use std::time::Duration;

    use super::*;
    use crate::poll::Poller;

    #[test]
    fn readable_at_exit_and_status_after_reap() {
        let mut child = Command::new("sleep").arg("100").spawn().unwrap();
        let pidfd = PidFd::open(child.id()).unwrap();
        let poller = Poller::new().unwrap();
        poller.add_readable(pidfd.as_fd(), 1).unwrap();
        let mut ready = Vec::new();
        poller.wait(&mut ready, Some(Duration::ZERO)).unwrap();
        assert!(ready.is_empty(), "a running process is not readable");
        assert_eq!(pidfd.exit_status().unwrap(), None);

        pidfd.signal(Signal::Kill).unwrap();
        poller.wait(&mut ready, Some(Duration::from_secs(10))).unwrap();
        assert_eq!(ready, vec![1]);
        child.wait().unwrap();
        assert_eq!(pidfd.exit_status().unwrap(), Some(ExitStatus::Signaled { signal: 9, core_dumped: false }));
    }

    #[test]
    fn exit_code_of_a_reaped_process() {
        let mut child =
            Command::new("sh").args(["-c", "read line; exit 3"]).stdin(std::process::Stdio::piped()).spawn().unwrap();
        let pidfd = PidFd::open(child.id()).unwrap();
        drop(child.stdin.take());
        child.wait().unwrap();
        assert_eq!(pidfd.exit_status().unwrap(), Some(ExitStatus::Exited(3)));
    }
}
