//! Connections that leave the sources: their holders stop being watched.
//!
//! A daemon whose mount is removed within milliseconds of its exit (a
//! restart script's `umount` right after the kill) may be found gone by a
//! scan before the loop handles its exit: once its holders are forgotten,
//! that exit names nobody. So a connection whose every holder has exited
//! when it leaves, with no exit of theirs handled yet, is handed back to
//! the loop to tell a death from a daemon that ended after a clean unmount.
use std::path::PathBuf;

use tracing::{debug, warn};

use super::discovery::lock;
use super::{Daemons, Known};
use crate::model::table::Dev;
use crate::watch::processes::{ExitStatus, Lifecycle, ProcessId, lifecycle};

/// The holders of a connection that left the sources had all exited, and
/// the loop had not handled their exits: the death, if it is one, is
/// unreported so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitedUnmounted {
    pub source: PathBuf,
    pub dev: Dev,
    /// The holder reported: one that crashed, if any did.
    pub pid: u32,
    /// Its status while it was a zombie; `None` once reaped.
    pub status: Option<ExitStatus>,
}

impl ExitedUnmounted {
    /// Killed by a signal or failed: not the end of a daemon whose mount was
    /// unmounted (libfuse daemons then exit 0).
    pub fn crashed(&self) -> bool {
        self.status.is_some_and(|status| status != ExitStatus::Exited(0))
    }
}

impl Daemons {
    /// Forgets connection `dev`, no longer at any source, and stops watching
    /// every holder that served only it. Returns its holders' exit if they
    /// had all exited unseen (see the module's note).
    pub(super) fn forget_gone(&mut self, dev: Dev) -> Option<ExitedUnmounted> {
        let (source, known) = self.known.remove(&dev)?;
        self.orphans.remove(&dev);
        let mut holders = lock(&self.holders);
        let serving: Vec<ProcessId> = holders
            .values()
            .filter(|holder| holder.serves.iter().any(|(_, served)| *served == dev))
            .map(|holder| holder.process)
            .collect();
        // A death seen already is not seen again; one still running holder
        // keeps the connection alive.
        let unseen = !matches!(known, Known::Dying { .. } | Known::Dead);
        let exits: Option<Vec<(u32, Option<ExitStatus>)>> = serving
            .iter()
            .map(|process| match lifecycle(&self.options.proc_root, *process) {
                Ok(Lifecycle::Exited { status }) => Some((process.pid, status)),
                Ok(Lifecycle::Running) => None,
                Err(err) => {
                    warn!(pid = process.pid, %err, "cannot tell whether a holder of a removed source exited");
                    None
                }
            })
            .collect();
        holders.retain(|&pid, holder| {
            holder.serves.retain(|(_, served)| *served != dev);
            let keep = !holder.serves.is_empty();
            if !keep {
                // Its exit, queued or to come, now matches nobody.
                self.watcher.unwatch(pid);
            }
            keep
        });
        drop(holders);
        let exits = exits.filter(|exits| unseen && !exits.is_empty())?;
        let pids: Vec<u32> = exits.iter().map(|(pid, _)| *pid).collect();
        debug!(source = %source.display(), connection = %dev, ?pids, "the holders of a removed source had exited");
        let mut exits =
            exits.into_iter().map(|(pid, status)| ExitedUnmounted { source: source.clone(), dev, pid, status });
        let first = exits.next()?;
        Some(if first.crashed() { first } else { exits.find(ExitedUnmounted::crashed).unwrap_or(first) })
    }
}
