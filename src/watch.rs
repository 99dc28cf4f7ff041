//! Mount-table watchers: they only say "the table changed", never what.
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use fuse_supervisor_sys::mountinfo_poll::priority_pending;
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
    #[error("cannot re-arm the mount-table watcher")]
    Rearm(#[source] io::Error),
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
///
/// After reporting [`Wake::TableChanged`] a watcher reports no other change
/// until its [`Rearm`] handle is called: a heal makes hundreds of changes,
/// and a watcher thread woken for each would compete for the CPU with it.
pub trait MountWatcher: Send {
    /// Blocks until the table changed (and the watcher is armed) or shutdown
    /// was asked for.
    fn wait(&mut self) -> Result<Wake, WatchError>;

    /// The handle that arms the watcher again, for the thread that reads the table.
    fn rearm_handle(&self) -> Arc<dyn Rearm>;
}

/// Arms a watcher again after it reported a change.
pub trait Rearm: Send + Sync {
    /// Call after taking a change report and before reading the table: a
    /// change before this call is in that read; one after it is reported.
    fn rearm(&self) -> Result<(), WatchError>;
}

/// Maps a setup failure to [`WatchError::Setup`] naming what failed.
fn setup(what: &'static str) -> impl FnOnce(io::Error) -> WatchError {
    move |source| WatchError::Setup { what: what.to_owned(), source }
}

const TABLE: u64 = 1;
const SHUTDOWN: u64 = 2;

/// `EPOLLPRI` on a mountinfo file: the kernel flags it once per change of
/// the namespace. No timer: the thread sleeps until the kernel wakes it.
/// Registered one-shot: disarmed from each report until [`Rearm::rearm`].
pub struct MountinfoWatcher {
    table: Arc<MountinfoArm>,
    // The registration lives as long as the eventfd.
    _waker: Arc<Waker>,
    events: Vec<u64>,
}

/// The mountinfo file and the epoll instance it is registered with, shared
/// by the watcher thread (which waits) and the loop (which re-arms).
struct MountinfoArm {
    poller: Poller,
    // Kept open: the registration lives as long as the file.
    mountinfo: File,
}

impl MountinfoWatcher {
    /// `mountinfo` must be opened in the watched namespace.
    pub fn new(mountinfo: File, waker: Arc<Waker>) -> Result<Self, WatchError> {
        let poller = Poller::new().map_err(setup("epoll"))?;
        poller.add_priority_oneshot(mountinfo.as_fd(), TABLE).map_err(setup("mountinfo"))?;
        poller.add_readable(waker.as_fd(), SHUTDOWN).map_err(setup("waker"))?;
        Ok(MountinfoWatcher {
            table: Arc::new(MountinfoArm { poller, mountinfo }),
            _waker: waker,
            events: Vec::with_capacity(2),
        })
    }
}

impl MountWatcher for MountinfoWatcher {
    fn wait(&mut self) -> Result<Wake, WatchError> {
        self.events.clear();
        self.table.poller.wait(&mut self.events, None).map_err(WatchError::Wait)?;
        if self.events.contains(&SHUTDOWN) {
            // Leave the waker set: every other waiter must see it too.
            return Ok(Wake::Shutdown);
        }
        Ok(Wake::TableChanged)
    }

    fn rearm_handle(&self) -> Arc<dyn Rearm> {
        self.table.clone()
    }
}

impl Rearm for MountinfoArm {
    fn rearm(&self) -> Result<(), WatchError> {
        // The changes made while disarmed are in the read that follows:
        // consume their notification, or re-arming would report them at once.
        priority_pending(self.mountinfo.as_fd()).map_err(WatchError::Rearm)?;
        self.poller.rearm_priority(self.mountinfo.as_fd(), TABLE).map_err(WatchError::Rearm)
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

    fn rearm_handle(&self) -> Arc<dyn Rearm> {
        Arc::new(TimerArm)
    }
}

/// A timer needs no arming: it wakes every period regardless.
struct TimerArm;

impl Rearm for TimerArm {
    fn rearm(&self) -> Result<(), WatchError> {
        Ok(())
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
