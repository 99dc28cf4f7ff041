//! "Something changed in these directories": inotify on a few directories,
//! drained into one answer, for a thread that waits on its own poller (the
//! webhook's certificate reload, the Job lifecycle's new pods). Callers that
//! need to know what changed use [`super::pods`] instead.
use std::io;
use std::ops::ControlFlow;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;

use fuse_supervisor_sys::inotify::{EventReader, Inotify, WatchFlags};

/// Which changes of a directory count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Changes {
    /// Entries created, removed or renamed in or out: new pods.
    Entries,
    /// A file rewritten in place (closed after writing), renamed over
    /// (also a Secret volume's `..data` swap), or created.
    Files,
}

impl Changes {
    fn flags(self) -> WatchFlags {
        match self {
            Changes::Entries => WatchFlags::CREATE | WatchFlags::DELETE | WatchFlags::MOVED_TO | WatchFlags::MOVED_FROM,
            Changes::Files => WatchFlags::CLOSE_WRITE | WatchFlags::MOVED_TO | WatchFlags::CREATE,
        }
    }
}

/// An inotify instance whose descriptor becomes readable on a change.
pub struct DirChanges {
    inotify: Inotify,
    reader: EventReader,
}

impl DirChanges {
    pub fn new() -> io::Result<Self> {
        Ok(DirChanges { inotify: Inotify::new()?, reader: EventReader::default() })
    }

    /// Watches `dir` (as the calling thread sees it: the watch stays on
    /// that directory whatever namespace reads the events later).
    pub fn watch(&self, dir: &Path, changes: Changes) -> io::Result<()> {
        self.inotify.watch_dir(dir, changes.flags()).map(drop)
    }

    /// Reads every pending event; whether there was any. A burst of changes
    /// (a rewrite of two files, a `..data` swap) is one answer.
    pub fn drain(&mut self) -> io::Result<bool> {
        let mut changed = false;
        // The handler never breaks: every pending event is read.
        let _read_all = self.reader.drain(&self.inotify, |_| {
            changed = true;
            ControlFlow::Continue(())
        })?;
        Ok(changed)
    }
}

impl AsFd for DirChanges {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inotify.as_fd()
    }
}
