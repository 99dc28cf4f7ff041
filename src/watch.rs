//! Mount-table watchers: they only say "the table changed", never what.
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::sync::Arc;

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

/// A source of mount-table change notifications. A fanotify/statmount
/// backend will implement this beside the mountinfo one.
pub trait MountWatcher: Send {
    /// Blocks until the table changed or shutdown was asked for.
    fn wait(&mut self) -> Result<Wake, WatchError>;
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
        let setup = |what: &str| {
            let what = what.to_owned();
            move |source| WatchError::Setup { what, source }
        };
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
