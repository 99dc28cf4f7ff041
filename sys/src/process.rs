//! Child processes that cannot outlive their creator, and signals.
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

use rustix::process::Pid;

/// Makes the child receive `SIGKILL` when the **thread** that spawns it exits
/// (`prctl(PR_SET_PDEATHSIG, SIGKILL)` between fork and exec).
///
/// The kernel tracks the parent *thread*, not the process: spawn from a thread
/// that lives as long as the child should (the test sandbox's own thread, the
/// supervisor's mount thread), never from a short-lived worker. There is no
/// race with the spawning thread's exit: `Command::spawn` blocks that thread
/// until the child has exec'ed.
pub fn kill_with_parent(command: &mut Command) -> &mut Command {
    // SAFETY: the closure runs in the forked child before exec and only makes
    // one async-signal-safe syscall (prctl); it allocates nothing and takes no
    // lock.
    unsafe {
        command.pre_exec(|| {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
                .map_err(io::Error::from)
        })
    }
}

/// Leaves `fd` open in `command`'s child across its exec, at the same
/// number (`/dev/fd/<n>` there, with `n` its raw number here): a descriptor
/// handed to the program, as a mount helper hands a FUSE daemon the
/// `/dev/fuse` it mounted. The command keeps it open until it is dropped.
pub fn inherit_fd(command: &mut Command, fd: OwnedFd) -> &mut Command {
    // SAFETY: the closure runs in the forked child before exec and only makes
    // one async-signal-safe syscall (fcntl) on a descriptor the closure owns,
    // so it is open in the child; it allocates nothing and takes no lock.
    unsafe {
        command.pre_exec(move || {
            rustix::io::fcntl_setfd(fd.as_fd(), rustix::io::FdFlags::empty()).map_err(io::Error::from)
        })
    }
}

/// A signal [`signal`] can send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// `SIGKILL`
    Kill,
    /// `SIGSTOP`: freezes a FUSE daemon so requests hang instead of failing.
    Stop,
    /// `SIGCONT`
    Cont,
    /// `SIGTERM`
    Term,
    /// `SIGINT`
    Int,
    /// `SIGUSR1`
    Usr1,
}

impl Signal {
    pub(crate) fn to_rustix(self) -> rustix::process::Signal {
        use rustix::process::Signal as S;
        match self {
            Signal::Kill => S::KILL,
            Signal::Stop => S::STOP,
            Signal::Cont => S::CONT,
            Signal::Term => S::TERM,
            Signal::Int => S::INT,
            Signal::Usr1 => S::USR1,
        }
    }
}

/// How a process ended, decoded from a wait status (what `waitpid` returns,
/// what the proc connector's exit event and pidfd exit info carry).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// `exit(code)`.
    Exited(u8),
    /// Killed by `signal`.
    Signaled { signal: i32, core_dumped: bool },
}

impl ExitStatus {
    /// `WIFSIGNALED`/`WTERMSIG`/`WCOREDUMP`/`WEXITSTATUS` of a wait status.
    pub fn from_wait_status(status: u32) -> ExitStatus {
        match (status & 0x7f) as i32 {
            0 => ExitStatus::Exited(((status >> 8) & 0xff) as u8),
            signal => ExitStatus::Signaled { signal, core_dumped: status & 0x80 != 0 },
        }
    }
}

/// `kill(pid, signal)`.
pub fn signal(pid: u32, signal: Signal) -> io::Result<()> {
    let pid = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("invalid pid {pid}")))?;
    Ok(rustix::process::kill_process(pid, signal.to_rustix())?)
}

/// Sets the calling thread's nice value, leaving the rest of the process as
/// it is: on Linux `setpriority` on a thread ID applies to that thread alone.
pub fn set_thread_nice(nice: i32) -> io::Result<()> {
    Ok(rustix::process::setpriority_process(Some(rustix::thread::gettid()), nice)?)
}

/// Stops the whole process, from the calling thread (`raise(SIGSTOP)`, a
/// `tgkill` to itself): the calling thread stops before it returns, where a
/// `kill` to the process would let it run on until the main thread, which
/// takes such a signal, got a CPU. Returns once the process is continued.
pub fn stop_self() -> io::Result<()> {
    // SAFETY: raise takes a signal number and touches no memory of ours.
    let ret = unsafe { libc::raise(libc::SIGSTOP) };
    if ret != 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Schedules the calling thread (alone) `SCHED_FIFO` at `priority` (1-99),
/// or back to `SCHED_OTHER` with `None`. `SCHED_RESET_ON_FORK` is set too,
/// so threads it starts later begin at the normal policy. Needs
/// `CAP_SYS_NICE` (or an `RLIMIT_RTPRIO`) to raise; lowering never fails
/// for that reason.
pub fn set_thread_realtime(priority: Option<u8>) -> io::Result<()> {
    let (policy, priority) = match priority {
        Some(priority) => (libc::SCHED_FIFO, libc::c_int::from(priority)),
        None => (libc::SCHED_OTHER, 0),
    };
    let param = libc::sched_param { sched_priority: priority };
    // SAFETY: pid 0 is the calling thread; `param` is a valid, initialised
    // `sched_param` that the call only reads.
    let ret = unsafe { libc::sched_setscheduler(0, policy | libc::SCHED_RESET_ON_FORK, &raw const param) };
    if ret < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// The calling thread's `SCHED_FIFO` priority; None under any other policy.
pub fn thread_fifo_priority() -> io::Result<Option<u8>> {
    // SAFETY: pid 0 is the calling thread; the call takes no pointers.
    let policy = unsafe { libc::sched_getscheduler(0) };
    if policy < 0 {
        return Err(io::Error::last_os_error());
    }
    if policy & !libc::SCHED_RESET_ON_FORK != libc::SCHED_FIFO {
        return Ok(None);
    }
    let mut param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; `param` is writable.
    if unsafe { libc::sched_getparam(0, &raw mut param) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(u8::try_from(param.sched_priority).ok())
}

/// The symbolic name of an errno value (`107` → `"ENOTCONN"`), for the errors
/// a process reading a volume can meet; `None` for the rest.
pub fn errno_name(errno: i32) -> Option<&'static str> {
    Some(match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::ENXIO => "ENXIO",
        libc::EAGAIN => "EAGAIN",
        libc::EACCES => "EACCES",
        libc::EBUSY => "EBUSY",
        libc::ENODEV => "ENODEV",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::EINVAL => "EINVAL",
        libc::ENOSPC => "ENOSPC",
        libc::EROFS => "EROFS",
        libc::ENOSYS => "ENOSYS",
        libc::ELOOP => "ELOOP",
        libc::ENOTEMPTY => "ENOTEMPTY",
        libc::ENODATA => "ENODATA",
        libc::ENOTSUP => "ENOTSUP",
        libc::ECONNABORTED => "ECONNABORTED",
        libc::ECONNREFUSED => "ECONNREFUSED",
        libc::ENOTCONN => "ENOTCONN",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::ESTALE => "ESTALE",
        libc::EXDEV => "EXDEV",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a thread of its own: the policy belongs to the thread, and the
    /// test runner's other threads keep theirs.
    #[test]
    fn realtime_is_per_thread_and_not_inherited() {
        std::thread::spawn(|| {
            set_thread_realtime(Some(1)).expect("SCHED_FIFO 1 (the tests run as root)");
            assert_eq!(thread_fifo_priority().unwrap(), Some(1));
            let child = std::thread::spawn(|| thread_fifo_priority().unwrap()).join().unwrap();
            assert_eq!(child, None, "a thread it starts begins at the normal policy");
            set_thread_realtime(None).unwrap();
            assert_eq!(thread_fifo_priority().unwrap(), None);
        })
        .join()
        .unwrap();
        assert_eq!(thread_fifo_priority().unwrap(), None);
    }
}
