//! An epoll wrapper for the watchers, and an eventfd to wake it.
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::event::{EventfdFlags, epoll};

/// Events the watcher loop waits on, each registered under a caller token.
#[derive(Debug)]
pub struct Poller {
    epoll: OwnedFd,
}

/// Most events returned by one [`Poller::wait`]; more stay queued for the next.
const MAX_EVENTS_PER_WAIT: usize = 64;

/// `epoll_wait` without the `linux_5_11` feature takes at most `c_int::MAX` ms.
const LONGEST_WAIT: Duration = Duration::from_millis(i32::MAX as u64);

impl Poller {
    /// `epoll_create1(EPOLL_CLOEXEC)`.
    pub fn new() -> io::Result<Self> {
        Ok(Self { epoll: epoll::create(epoll::CreateFlags::CLOEXEC)? })
    }

    /// Registers `fd` for `EPOLLPRI` only, reported as `token`.
    ///
    /// For `/proc/<pid>/mountinfo`: the kernel signals a mount table change as
    /// `POLLPRI|POLLERR`, while `EPOLLIN` is always ready on it and would spin.
    pub fn add_priority(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        Ok(epoll::add(&self.epoll, fd, epoll::EventData::new_u64(token), epoll::EventFlags::PRI)?)
    }

    /// Like [`Poller::add_priority`], with `EPOLLONESHOT`: after `fd` is
    /// reported once, it stays silent until [`Poller::rearm_priority`].
    pub fn add_priority_oneshot(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        let flags = epoll::EventFlags::PRI | epoll::EventFlags::ONESHOT;
        Ok(epoll::add(&self.epoll, fd, epoll::EventData::new_u64(token), flags)?)
    }

    /// Enables a registration of [`Poller::add_priority_oneshot`] again. The
    /// kernel polls `fd` during this call: an event it has pending now (for
    /// mountinfo: a change since the file was last polled) is reported at once.
    /// Safe to call from another thread while one waits.
    pub fn rearm_priority(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        let flags = epoll::EventFlags::PRI | epoll::EventFlags::ONESHOT;
        Ok(epoll::modify(&self.epoll, fd, epoll::EventData::new_u64(token), flags)?)
    }

    /// Registers `fd` for `EPOLLIN` (level-triggered), reported as `token`.
    pub fn add_readable(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        Ok(epoll::add(&self.epoll, fd, epoll::EventData::new_u64(token), epoll::EventFlags::IN)?)
    }

    /// Like [`Poller::add_readable`], with `EPOLLONESHOT`: after `fd` is
    /// reported once, it stays silent until [`Poller::rearm_readable`].
    pub fn add_readable_oneshot(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        let flags = epoll::EventFlags::IN | epoll::EventFlags::ONESHOT;
        Ok(epoll::add(&self.epoll, fd, epoll::EventData::new_u64(token), flags)?)
    }

    /// Enables a registration of [`Poller::add_readable_oneshot`] again; if
    /// `fd` is readable now, it is reported at once. Safe to call from
    /// another thread while one waits.
    pub fn rearm_readable(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        let flags = epoll::EventFlags::IN | epoll::EventFlags::ONESHOT;
        Ok(epoll::modify(&self.epoll, fd, epoll::EventData::new_u64(token), flags)?)
    }

    /// Stops watching `fd`.
    pub fn remove(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        Ok(epoll::delete(&self.epoll, fd)?)
    }

    /// Waits until at least one registered fd is ready or `timeout` passes
    /// (`None`: forever), then replaces `events` with the ready tokens (empty
    /// on timeout). Retries `EINTR` with the remaining time.
    pub fn wait(&self, events: &mut Vec<u64>, timeout: Option<Duration>) -> io::Result<()> {
        events.clear();
        let deadline = timeout.map(|timeout| Instant::now() + timeout);
        let mut ready = Vec::with_capacity(MAX_EVENTS_PER_WAIT);
        loop {
            let remaining = deadline.map(|deadline| deadline.saturating_duration_since(Instant::now()));
            let timespec = remaining
                .map(|remaining| rustix::event::Timespec::try_from(remaining.min(LONGEST_WAIT)))
                .transpose()
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "poll timeout out of range"))?;
            ready.clear();
            match epoll::wait(&self.epoll, rustix::buffer::spare_capacity(&mut ready), timespec.as_ref()) {
                Ok(_) => break,
                Err(rustix::io::Errno::INTR) => continue,
                Err(err) => return Err(err.into()),
            }
        }
        events.extend(ready.iter().map(|event| event.data.u64()));
        Ok(())
    }
}

impl AsFd for Poller {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}

/// An eventfd that wakes a [`Poller`] from another thread (for shutdown):
/// register it with [`Poller::add_readable`], call [`Waker::wake`] elsewhere,
/// [`Waker::drain`] after it fired.
#[derive(Debug)]
pub struct Waker {
    eventfd: OwnedFd,
}

impl Waker {
    /// `eventfd(0, EFD_CLOEXEC|EFD_NONBLOCK)`.
    pub fn new() -> io::Result<Self> {
        Ok(Self { eventfd: rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)? })
    }

    /// Makes the eventfd readable until drained.
    pub fn wake(&self) -> io::Result<()> {
        match rustix::io::write(&self.eventfd, &1u64.to_ne_bytes()) {
            // The counter is saturated: it is readable already.
            Ok(_) | Err(rustix::io::Errno::AGAIN) => Ok(()),
            Err(err) => Err(err.into()),
        }
    }

    /// Resets the eventfd to not readable.
    pub fn drain(&self) -> io::Result<()> {
        let mut counter = [0u8; 8];
        match rustix::io::read(&self.eventfd, &mut counter) {
            Ok(_) | Err(rustix::io::Errno::AGAIN) => Ok(()),
            Err(err) => Err(err.into()),
        }
    }
}

impl AsFd for Waker {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.eventfd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waker_wakes_poller_and_drain_resets_it() {
        let poller = Poller::new().unwrap();
        let waker = Waker::new().unwrap();
        poller.add_readable(waker.as_fd(), 7).unwrap();
        let mut events = Vec::new();
        poller.wait(&mut events, Some(Duration::ZERO)).unwrap();
        assert!(events.is_empty());
        waker.wake().unwrap();
        waker.wake().unwrap();
        poller.wait(&mut events, None).unwrap();
        assert_eq!(events, vec![7]);
        waker.drain().unwrap();
        poller.wait(&mut events, Some(Duration::from_millis(1))).unwrap();
        assert!(events.is_empty());
    }

    #[test]
    fn mountinfo_is_quiet_on_priority_until_a_change() {
        let mountinfo = std::fs::File::open("/proc/self/mountinfo").unwrap();
        let poller = Poller::new().unwrap();
        poller.add_priority(mountinfo.as_fd(), 1).unwrap();
        let mut events = Vec::new();
        poller.wait(&mut events, Some(Duration::ZERO)).unwrap();
        assert!(events.is_empty(), "EPOLLPRI must not fire without a mount change");
    }
}
