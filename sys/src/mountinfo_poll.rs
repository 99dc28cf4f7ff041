//! Zero-timeout check for the mountinfo change notification.
//!
//! An open `/proc/<pid>/mountinfo` reports `POLLPRI` (with `POLLERR`) once per
//! change of its mount namespace since the last poll of that open file; polling
//! resets it. A reader polls right after reading to EOF to learn whether the
//! table changed while it was reading.

use std::io;
use std::os::fd::BorrowedFd;

use rustix::event::{PollFd, PollFlags, Timespec, poll};

/// Whether `fd` (an open mountinfo file) has a priority event pending, without
/// waiting. Consumes the event: a second call returns `false` until the next
/// change.
pub fn priority_pending(fd: BorrowedFd<'_>) -> io::Result<bool> {
    let zero = Timespec { tv_sec: 0, tv_nsec: 0 };
    loop {
        let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::PRI)];
        match poll(&mut fds, Some(&zero)) {
            Ok(0) => return Ok(false),
            Ok(_) => return Ok(fds[0].revents().contains(PollFlags::PRI)),
            Err(rustix::io::Errno::INTR) => continue,
            Err(errno) => return Err(errno.into()),
        }
    }
}
