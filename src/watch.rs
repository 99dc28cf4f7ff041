//! Mount-table watchers: they only say "the table changed", never what.
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use fuse_supervisor_sys::poll::{Poller, Waker};

#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("cannot watch mount table {what}")]
    Setup {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("waiting for mount-table events failed")]
    Wait(#[source] io::Error),
}

/// What a watcher woke up for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    TableChanged,
    Shutdown,
}

/// How the loop learns that the mount table may have changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchMode {
    /// Kernel notifications ([`MountinfoWatcher`]): no timer at all.
    Events,
    /// A full scan every `period` ([`PollWatcher`]), as polling healers
    /// do: for comparison, and as a last resort where notifications fail.
    Poll { period: Duration },
}

impl std::fmt::Display for WatchMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WatchMode::Events => f.write_str("event"),
            WatchMode::Poll { period } => write!(f, "poll every {period:?}"),
        }
    }
}

/// A source of mount-table change notifications. A fanotify/statmount
/// backend will implement this beside the mountinfo one.
pub trait MountWatcher: Send {
    /// Blocks until the table changed or shutdown was asked for.
    fn wait(&mut self) -> Result<Wake, WatchError>;
}

/// Maps a setup failure to [`WatchError::Setup`] naming what failed.
fn setup(what: &'static str) -> impl FnOnce(io::Error) -> WatchError {
    move |source| WatchError::Setup { what: what.to_owned(), source }
}

const TABLE: u64 = 1;
const SHUTDOWN: u64 = 2;

/// `EPOLLPRI` on a mountinfo file: the kernel flags it once per change of
/// the namespace. No timer: the thread sleeps until the kernel wakes it.
pub struct MountinfoWatcher {
    poller: Poller,
    // Kept open: the registration lives as long as the file.
    _mountinfo: File,
    // The registration lives as long as the eventfd.
    _waker: Arc<Waker>,
    events: Vec<u64>,
}

impl MountinfoWatcher {
    /// `mountinfo` must be opened in the watched namespace.
    pub fn new(mountinfo: File, waker: Arc<Waker>) -> Result<Self, WatchError> {
        let poller = Poller::new().map_err(setup("epoll"))?;
        poller.add_priority(mountinfo.as_fd(), TABLE).map_err(setup("mountinfo"))?;
        poller.add_readable(waker.as_fd(), SHUTDOWN).map_err(setup("waker"))?;
        Ok(MountinfoWatcher { poller, _mountinfo: mountinfo, _waker: waker, events: Vec::with_capacity(2) })
    }
}

impl MountWatcher for MountinfoWatcher {
    fn wait(&mut self) -> Result<Wake, WatchError> {
        self.events.clear();
        self.poller.wait(&mut self.events, None).map_err(WatchError::Wait)?;
        if self.events.contains(&SHUTDOWN) {
            // Leave the waker set: every other waiter must see it too.
            return Ok(Wake::Shutdown);
        }
        Ok(Wake::TableChanged)
    }
}

/// Wakes every `period` whatever happened, so that the loop scans the whole
/// table: polling, for comparison with [`MountinfoWatcher`] and as a last
/// resort. Only shutdown interrupts the wait.
pub struct PollWatcher {
    poller: Poller,
    // The registration lives as long as the eventfd.
    _waker: Arc<Waker>,
    period: Duration,
    events: Vec<u64>,
}

impl PollWatcher {
    pub fn new(period: Duration, waker: Arc<Waker>) -> Result<Self, WatchError> {
        let poller = Poller::new().map_err(setup("epoll"))?;
        poller.add_readable(waker.as_fd(), SHUTDOWN).map_err(setup("waker"))?;
        Ok(PollWatcher { poller, _waker: waker, period, events: Vec::with_capacity(1) })
    }
}

impl MountWatcher for PollWatcher {
    fn wait(&mut self) -> Result<Wake, WatchError> {
        self.poller.wait(&mut self.events, Some(self.period)).map_err(WatchError::Wait)?;
        if self.events.contains(&SHUTDOWN) {
            return Ok(Wake::Shutdown);
        }
        Ok(Wake::TableChanged)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_watcher_wakes_on_its_timer_until_shutdown() {
        let waker = Arc::new(Waker::new().unwrap());
        let mut watcher = PollWatcher::new(Duration::from_millis(10), waker.clone()).unwrap();
        // Nothing changes anywhere: the timer alone wakes it, each time.
        assert_eq!(watcher.wait().unwrap(), Wake::TableChanged);
        assert_eq!(watcher.wait().unwrap(), Wake::TableChanged);
        waker.wake().unwrap();
        assert_eq!(watcher.wait().unwrap(), Wake::Shutdown);
        assert_eq!(watcher.wait().unwrap(), Wake::Shutdown, "shutdown must stay visible");
    }

    #[test]
    fn modes_name_themselves() {
        assert_eq!(WatchMode::Events.to_string(), "event");
        assert_eq!(WatchMode::Poll { period: Duration::from_millis(200) }.to_string(), "poll every 200ms");
    }
}
