//! The loop's mount-table sources besides the mountinfo text: tables kept
//! by unique mount ID, each mount asked about with `statmount`, so that a
//! change costs the loop the same whatever the namespace's size.
//!
//! - from fanotify mount events (Linux 6.15+), each mount they name asked
//!   about once;
//! - from mountinfo's flag on Linux 6.8+: the flag says only
//!   "changed"; each look lists the namespace's IDs (`listmount`, about
//!   0.3 µs a mount) and asks only about the new ones and the kept ones.
//!
//! Both say a table "changed" only when what they keep changed: an
//! unrelated mount's change costs a look, never a scan.
use std::fs::File;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use tracing::{debug, info};

use fuse_supervisor_engine::model::incremental::{IncrementalTable, KernelMounts};
use fuse_supervisor_engine::model::mountinfo::take_change_flag;
use fuse_supervisor_engine::model::source::{TableError, TableRead, TableSource};
use fuse_supervisor_engine::watch::mount_table::{MountEvent, MountEventFeed, Rearm, WatchError};

/// What tells a [`KeptTable`] that the namespace changed, and how much.
pub enum Changes {
    /// fanotify mount events, each naming its mount.
    Events { feed: MountEventFeed, events: Vec<MountEvent> },
    /// mountinfo's `POLLPRI` on a file of its own (open in the watched
    /// namespace), apart from the watcher's: "changed", nothing more.
    Flag { mountinfo: File },
}

/// The FUSE mounts of the watched namespace, kept by unique mount ID and
/// brought up to date from [`Changes`] at each look.
pub struct KeptTable {
    changes: Changes,
    table: IncrementalTable,
    kernel: KernelMounts,
    /// The first look lists the whole namespace.
    synced: bool,
    /// What is kept changed since the last snapshot.
    dirty: bool,
    /// Resyncs after lost events (a queue overflow) not yet taken by the loop.
    lost_resyncs: u32,
}

impl KeptTable {
    /// Kept from fanotify mount events; make it after the feed's watcher
    /// marked the namespace, so that no change falls between its first
    /// listing and the first event.
    pub fn from_events(feed: MountEventFeed) -> Self {
        Self::new(Changes::Events { feed, events: Vec::new() })
    }

    /// Kept by listing the namespace at each change mountinfo's flag
    /// reports; see [`KernelMounts::listing_supported`].
    pub fn from_listings(mountinfo: File) -> Self {
        Self::new(Changes::Flag { mountinfo })
    }

    fn new(changes: Changes) -> Self {
        KeptTable {
            changes,
            table: IncrementalTable::default(),
            kernel: KernelMounts,
            synced: false,
            dirty: true,
            lost_resyncs: 0,
        }
    }

    /// Applies what changed since the last look; whether there was any.
    fn update(&mut self) -> Result<bool, TableError> {
        let started = Instant::now();
        let (applied, reason) = match &mut self.changes {
            Changes::Events { feed, events } => {
                events.clear();
                let unreported = feed.take(events).map_err(|err| TableError::Events(Box::new(err)))?;
                if !self.synced {
                    (self.table.resync(&mut self.kernel)?, "start")
                } else if unreported.0 {
                    // A heal's own changes, made with the events off.
                    (self.table.refresh(&mut self.kernel)?, "unreported")
                } else if events.is_empty() {
                    return Ok(false);
                } else {
                    (self.table.apply(events, &mut self.kernel)?, "events")
                }
            }
            Changes::Flag { mountinfo } => {
                // Consumed before the look: a change during it raises it
                // again and costs one more look, not one per change.
                let changed = take_change_flag(mountinfo).map_err(TableError::Read)?;
                if !self.synced {
                    (self.table.resync(&mut self.kernel)?, "start")
                } else if changed {
                    (self.table.refresh(&mut self.kernel)?, "changed")
                } else {
                    return Ok(false);
                }
            }
        };
        self.synced = true;
        if applied.resynced {
            let reason = if reason == "events" { "overflow" } else { reason };
            if reason == "overflow" {
                self.lost_resyncs += 1;
            }
            let took_us = started.elapsed().as_micros() as u64;
            info!(reason, mounts = self.table.mounts(), kept = self.table.kept(), took_us, "mount table resynced");
        } else {
            debug!(reason, stats = applied.stats, changed = applied.changed, "mount table updated");
        }
        self.dirty |= applied.changed;
        Ok(true)
    }
}

impl TableSource for KeptTable {
    fn snapshot(&mut self) -> Result<TableRead, TableError> {
        self.update()?;
        Ok(TableRead { snapshot: self.table.snapshot(), changed: std::mem::take(&mut self.dirty) })
    }

    fn changed_since_read(&mut self) -> io::Result<bool> {
        self.update().map_err(io::Error::other)?;
        // Lost events are looked at too, if only to be counted.
        Ok(self.dirty || self.lost_resyncs > 0)
    }

    fn take_lost_resyncs(&mut self) -> u32 {
        std::mem::take(&mut self.lost_resyncs)
    }
}

/// A [`KeptTable`] shared by the loop (its table source) and the watcher
/// thread, which applies the events it was woken for at once and wakes the
/// loop only when a kept mount changed: an unrelated mount's change then
/// wakes one thread, not two. Cheap to clone.
#[derive(Clone)]
pub struct SharedTable(Arc<Mutex<KeptTable>>);

impl SharedTable {
    pub fn new(table: KeptTable) -> Self {
        SharedTable(Arc::new(Mutex::new(table)))
    }

    fn lock(&self) -> MutexGuard<'_, KeptTable> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// For the watcher thread after a report: applies the events, and if no
    /// kept mount changed, re-arms the watcher (as the loop would) and
    /// applies what the re-arm took in, until a re-arm takes in nothing.
    /// True: a kept mount changed, or events were lost (which the loop
    /// counts), the loop must look (and re-arm).
    pub fn settle(&self, rearm: &dyn Rearm) -> Result<bool, SettleError> {
        let mut rearmed = false;
        loop {
            let took = self.lock().update().map_err(SettleError::Table)?;
            let table = self.lock();
            if table.dirty || table.lost_resyncs > 0 {
                return Ok(true);
            }
            drop(table);
            if rearmed && !took {
                return Ok(false);
            }
            rearm.rearm().map_err(SettleError::Rearm)?;
            rearmed = true;
        }
    }
}

/// Why [`SharedTable::settle`] stopped.
#[derive(Debug, thiserror::Error)]
pub enum SettleError {
    /// The loop reads the table again and reports it.
    #[error(transparent)]
    Table(TableError),
    /// The watcher cannot go on.
    #[error(transparent)]
    Rearm(WatchError),
}

impl TableSource for SharedTable {
    fn snapshot(&mut self) -> Result<TableRead, TableError> {
        self.lock().snapshot()
    }

    fn changed_since_read(&mut self) -> io::Result<bool> {
        self.lock().changed_since_read()
    }

    fn take_lost_resyncs(&mut self) -> u32 {
        self.lock().take_lost_resyncs()
    }
}
