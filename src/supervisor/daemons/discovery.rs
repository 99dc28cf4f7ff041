//! The discovery thread: which processes hold each wanted FUSE connection,
//! found by one walk of `/proc` per batch of requests, and watched.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use tracing::debug;

use super::{DaemonEvent, Daemons, Discovered, Known};
use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::heal::priority::HealActivity;
use fuse_supervisor_engine::model::table::Dev;
use fuse_supervisor_engine::watch::processes::fuse_server::{FuseServers, MatchedBy, MountDevice};
use fuse_supervisor_engine::watch::processes::{ProcessId, ProcessWatcher};

/// A process watched because it holds connections of sources.
#[derive(Debug)]
pub(super) struct Holder {
    pub(super) process: ProcessId,
    pub(super) serves: Vec<(PathBuf, Dev)>,
}

pub(super) type Holders = Arc<Mutex<HashMap<u32, Holder>>>;

pub(super) fn lock(holders: &Mutex<HashMap<u32, Holder>>) -> std::sync::MutexGuard<'_, HashMap<u32, Holder>> {
    holders.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The discovery thread: one `/proc` scan for every batch of requests
/// queued meanwhile.
pub(super) fn discovery_loop(
    queue: &Receiver<Vec<(PathBuf, Dev)>>,
    proc_root: &Path,
    watcher: &dyn ProcessWatcher,
    holders: &Mutex<HashMap<u32, Holder>>,
    heal_activity: &HealActivity,
    send: impl Fn(DaemonEvent) -> bool,
) {
    while let Ok(mut wanted) = queue.recv() {
        while let Ok(more) = queue.try_recv() {
            wanted.extend(more);
        }
        wanted.sort_by_key(|(_, dev)| *dev);
        wanted.dedup_by_key(|(_, dev)| *dev);
        let found = discover(proc_root, watcher, holders, heal_activity, wanted);
        if !send(DaemonEvent::Discovered(found)) {
            return;
        }
    }
}

/// Finds and watches the holders of each wanted connection. A holder is
/// entered in `holders` before it is watched, so its exit, however soon,
/// finds it there.
pub(super) fn discover(
    proc_root: &Path,
    watcher: &dyn ProcessWatcher,
    holders: &Mutex<HashMap<u32, Holder>>,
    heal_activity: &HealActivity,
    wanted: Vec<(PathBuf, Dev)>,
) -> Vec<Discovered> {
    heal_activity.wait_until_quiet();
    let scanned_at = Instant::now();
    let servers = match FuseServers::scan_between(proc_root, || heal_activity.wait_until_quiet()) {
        Ok(servers) => servers,
        Err(err) => {
            let err = err.to_string();
            return wanted
                .into_iter()
                .map(|(source, dev)| Discovered { source, dev, result: Err(err.clone()), scanned_at, exact: false })
                .collect();
        }
    };
    wanted
        .into_iter()
        .map(|(source, dev)| {
            let serving = servers.serving(MountDevice { major: dev.major, minor: dev.minor });
            let exact = serving.as_ref().is_ok_and(|serving| serving.matched_by == MatchedBy::Connection);
            let result = serving.map_err(|err| err.to_string()).map(|serving| {
                serving
                    .processes
                    .into_iter()
                    .filter(|&process| {
                        add_holder(holders, process, &source, dev);
                        match watcher.watch(process) {
                            Ok(()) => true,
                            Err(err) => {
                                debug!(pid = process.pid, err = %chain(&err), "holder gone before it could be watched");
                                remove_holder(holders, process, dev);
                                false
                            }
                        }
                    })
                    .collect()
            });
            if result.as_ref().is_ok_and(Vec::is_empty) {
                let seen: Vec<u32> = servers.connections().map(|(id, _)| id).collect();
                debug!(connection = %dev, ?seen, "connections held on the node");
            }
            Discovered { source, dev, result, scanned_at, exact }
        })
        .collect()
}

pub(super) fn add_holder(holders: &Mutex<HashMap<u32, Holder>>, process: ProcessId, source: &Path, dev: Dev) {
    let mut holders = lock(holders);
    let holder = holders.entry(process.pid).or_insert_with(|| Holder { process, serves: Vec::new() });
    if holder.process != process {
        // The pid was reused since: the old process's entry is stale.
        *holder = Holder { process, serves: Vec::new() };
    }
    if !holder.serves.iter().any(|(_, served)| *served == dev) {
        holder.serves.push((source.to_path_buf(), dev));
    }
}

/// Forgets that `process` holds `dev`; true when it holds nothing else
/// watched (so need not be watched any more).
pub(super) fn remove_holder(holders: &Mutex<HashMap<u32, Holder>>, process: ProcessId, dev: Dev) -> bool {
    let mut holders = lock(holders);
    let Some(holder) = holders.get_mut(&process.pid).filter(|holder| holder.process == process) else { return false };
    holder.serves.retain(|(_, served)| *served != dev);
    let unneeded = holder.serves.is_empty();
    if unneeded {
        holders.remove(&process.pid);
    }
    unneeded
}

impl Daemons {
    /// A connection found unheld ([`super::Verdicts::unheld`]) whose mount
    /// answered ENOTCONN: its daemon died before any search found it. True
    /// when that is news: still unheld, and no holder found since.
    pub fn unheld_died(&mut self, dev: Dev) -> bool {
        let Some((_, known)) = self.known.get_mut(&dev) else { return false };
        if !matches!(known, Known::Unserved { left, .. } if left.is_empty()) {
            return false;
        }
        *known = Known::Dead;
        self.update_exec_interest();
        true
    }
}
