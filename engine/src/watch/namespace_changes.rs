//! "A mount changed in one of these namespaces": fanotify mount events
//! (Linux 6.15+) on the namespaces the loop waits on, those of containers
//! whose heal was refused because the tenant changed or covered its own
//! mount. Retrying such a heal can only fail the same way until the tenant
//! changes its mounts again, so it is retried at that change, never on a
//! timer. Which namespace changed is not said: the loop retries what waits,
//! a handful of mounts.
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;

use fuse_supervisor_sys::fanotify::{MountEventReader, MountEvents};
use tracing::warn;

use super::thread::{ThreadError, Waiting, Watching, Woken};
use crate::errors::chain;

const GROUP: u64 = 1;

#[derive(Debug, thiserror::Error)]
pub enum NamespaceChangesError {
    #[error("cannot create a fanotify group for mount events (Linux 6.15+)")]
    Group(#[source] io::Error),
    #[error("cannot set up the namespace-changes thread")]
    Poll(#[source] io::Error),
    #[error(transparent)]
    Thread(#[from] ThreadError),
}

/// The running watcher; stops and joins its thread when dropped.
#[derive(Debug)]
pub struct NamespaceChanges {
    group: Arc<MountEvents>,
    _watching: Watching,
}

impl NamespaceChanges {
    /// Calls `changed` on its own thread after each batch of changes in the
    /// namespaces marked with [`NamespaceChanges::watch`].
    pub fn start(changed: impl Fn() + Send + 'static) -> Result<Self, NamespaceChangesError> {
        let group = Arc::new(MountEvents::new().map_err(NamespaceChangesError::Group)?);
        let stop = Watching::stop_waker("namespace-changes")?;
        let mut waiting = Waiting::new(&stop).map_err(NamespaceChangesError::Poll)?;
        waiting.add_readable(group.as_fd(), GROUP).map_err(NamespaceChangesError::Poll)?;
        let events = Arc::clone(&group);
        let watching = Watching::start("namespace-changes", stop, move || {
            let mut reader = MountEventReader::default();
            loop {
                match waiting.wait(None) {
                    Ok(Woken::Stop) => return,
                    Ok(Woken::Ready(_)) => {}
                    Err(err) => {
                        warn!(err = %chain(&err), "the namespace-changes watcher stopped; refused container heals wait for the next heal of their source");
                        return;
                    }
                }
                // What changed does not matter, only that something did (an
                // overflow included).
                match reader.drain(&events, |_| {}) {
                    Ok(0) => {}
                    Ok(_) => changed(),
                    Err(err) => {
                        warn!(err = %chain(&err), "cannot read the namespaces' mount events");
                        changed();
                    }
                }
            }
        })?;
        Ok(NamespaceChanges { group, _watching: watching })
    }

    /// From now on, changes in `namespace` (an open `/proc/<pid>/ns/mnt`;
    /// the mark does not keep it open or alive) are reported.
    pub fn watch(&self, namespace: BorrowedFd<'_>) -> io::Result<()> {
        self.group.watch_namespace(namespace)
    }

    /// Changes in `namespace` are no longer reported.
    pub fn unwatch(&self, namespace: BorrowedFd<'_>) -> io::Result<()> {
        self.group.unwatch_namespace(namespace)
    }
}
