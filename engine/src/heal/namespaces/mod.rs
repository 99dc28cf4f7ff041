//! The node's other mount namespaces, kept by events, so that neither a
//! daemon's death nor a heal walks `/proc` to find the containers holding
//! mounts of a dead connection (see [`super::containers`]).
//!
//! - One walk at start learns every namespace, through its oldest process
//!   (its *anchor*: a container's first process), and reads its table.
//! - The process connector's exec events learn the namespaces made since.
//!   A container's first process execs its entrypoint in its new namespace
//!   once its mounts are in place; each exec costs one `stat` of
//!   `/proc/<pid>/ns/mnt`, and only an unknown namespace is read.
//! - The anchor's exit forgets its namespace: a container ends with its
//!   first process (its pid namespace's init, or, in a pod that shares one,
//!   the process whose exit ends the container). Another process still in
//!   such a namespace has it learnt again at its next exec. The kernel
//!   reuses a freed namespace's inode, so an entry stands for its inode
//!   only while its anchor is still in it.
//! - Events the kernel dropped are made good by another walk.
//!
//! A query reads again only the namespaces that can hold a mount of the
//! connection: those that held one at their last read (or were healed onto
//! it since), and those that receive mounts by propagation (a
//! `HostToContainer` volume, a CSI plugin's `Bidirectional` kubelet
//! directory, a copy made with propagation unchanged). Any other one could
//! only have bound a mount of the connection from one it held.
//!
//! Every table is read within caps ([`crate::model::namespace_table`]): a
//! tenant makes its table as big as it likes, and the walk at start must
//! not grow with it. A namespace a read left something out of is named in
//! one warning while it is known.
//!
//! A namespace learnt after a heal can still hold a copy of a connection
//! the heal replaced (made during the outage, its exec handled late, or no
//! exec made in it at all): every heal that replaced a dead connection
//! leaves it watched ([`Namespaces::replaced`]) and has `/proc` walked once
//! more for namespaces no exec made known; a namespace learnt from then on
//! that holds a mount of a watched connection is handed to the loop
//! ([`LateCopies`]) to heal. A connection is told by its device number and
//! its `fusectl` directory, which lives as long as any mount of it, so a
//! number given to a new connection is never taken for the dead one.
//!
//! Until the first walk is done, and where the connector cannot be had
//! (`--container-namespaces walk`, or a pod without hostPID), a query walks
//! `/proc` as it is asked.
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs;
use std::io;
use std::ops::RangeBounds;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fuse_supervisor_sys::mount::Propagation;
use fuse_supervisor_sys::{fds, ns};
use tracing::{debug, info, warn};

use super::carry::NestedSlot;
use super::connections::{FUSE_CONNECTIONS, FuseConnections};
use super::containers::{self, ContainerHealError, ForeignMount, NamespaceWorkers, dead_tops, open_namespace_of};
use super::nested_copies::NestedCopies;
use super::priority::{HealActivity, HealPriority, RealtimeReads};
use crate::errors::chain;
use crate::model::namespace_table::{self, Overflow, TableCaps};
use crate::model::table::{Dev, FuseMount};
use crate::watch::processes::{
    ExecReports, ProcConnectorWatcher, ProcessConnector, ProcessEvent, ProcessId, ProcessWatchError, ProcessWatcher,
    Stat, Subscription, read_stat,
};

/// How late the connector may hand over its events: a busy node's execs
/// (probes, shells) are then read many to a wake-up, unless another watcher
/// of the connector needs them at once (the daemons' deaths); a namespace is
/// learnt at most this much later.
const EVENT_BATCH_WINDOW: Duration = Duration::from_millis(20);

/// One namespace's mounts, as read through one of its processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceRead {
    /// The namespace's inode: its identity.
    pub namespace: u64,
    /// The process it is entered and read through: its oldest known one.
    pub anchor: ProcessId,
    pub fuse_mounts: Vec<FuseMount>,
    /// Whether any of its mounts receives mounts by propagation.
    pub receives: bool,
    /// Each FUSE mount's 64-bit unique ID, by mount ID, where the read had
    /// them (listmount).
    pub unique_ids: BTreeMap<u32, u64>,
    /// The FUSE mounts (by mount ID) that other mounts are on.
    pub with_mounts_on: BTreeSet<u32>,
    /// What the read left out for the caps (see [`crate::model::namespace_table`]).
    pub overflow: Overflow,
}

impl NamespaceRead {
    /// Whether a mount of a connection in `dead` can be in it now: it held
    /// one, or it can be given one by propagation. Any other mount of such
    /// a connection it could only have bound from one it held.
    fn may_hold(&self, dead: &BTreeSet<Dev>) -> bool {
        self.receives || self.fuse_mounts.iter().any(|mount| dead.contains(&mount.dev))
    }

    /// The mounts of a connection in `dead` it holds, to heal, with its
    /// namespace's ID.
    pub(super) fn foreign_mounts(&self, dead: &BTreeSet<Dev>) -> Vec<ForeignMount> {
        let tops = dead_tops(&self.fuse_mounts, dead);
        if tops.is_empty() {
            return Vec::new();
        }
        let namespace_id = open_namespace_of(Path::new("/proc"), self.anchor.pid, self.namespace, None)
            .ok()
            .and_then(|namespace| ns::mount_namespace_id(namespace.as_fd()).ok());
        tops.into_iter()
            .map(|mount| ForeignMount {
                namespace: self.namespace,
                pid: self.anchor.pid,
                propagation: if mount.master.is_some() { Propagation::Slave } else { Propagation::Private },
                unique_id: self.unique_ids.get(&mount.mount_id).copied(),
                mount,
                namespace_id,
                nested: NestedSlot::default(),
            })
            .collect()
    }
}

/// The known namespaces, shared by the thread that keeps them and the heals
/// that ask.
#[derive(Debug)]
pub struct Namespaces {
    proc_root: PathBuf,
    known: Mutex<Known>,
    /// The keeper's thread, once it keeps the set: asked for a walk at a
    /// death ([`Namespaces::look_for_unknown`]).
    keeper: OnceLock<Mutex<Sender<Message>>>,
    /// Where the mounts nested in watched volumes are copied ahead, once a
    /// heal executor is there to use them.
    copier: OnceLock<Copier>,
    /// The live FUSE connections, which tell a replaced connection from a
    /// later one given its number.
    connections: Arc<FuseConnections>,
    /// Who heals the copies of replaced connections in namespaces learnt
    /// after their heal.
    late_copies: OnceLock<LateCopiesSink>,
    /// The namespace whose targets the agent heals as the host's (its
    /// inode): never a container's ([`Namespaces::heal_as_host`]).
    host: OnceLock<u64>,
}

struct LateCopiesSink(LateCopiesNotify);

impl std::fmt::Debug for LateCopiesSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LateCopiesSink")
    }
}

/// Mounts of a dead connection that a heal replaced, found in a namespace
/// learnt after it: to heal from `source`'s current mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LateCopies {
    pub source: PathBuf,
    pub mounts: Vec<ForeignMount>,
}

pub type LateCopiesNotify = Box<dyn Fn(LateCopies) + Send + Sync>;

/// A dead connection a heal replaced, watched for until it ends.
#[derive(Debug)]
struct Replaced {
    /// The inode of its `fusectl` directory.
    connection: u64,
    /// The source whose mount replaced it.
    source: PathBuf,
}

#[derive(Debug)]
struct Copier {
    copies: Arc<NestedCopies>,
    workers: NamespaceWorkers,
}

#[derive(Debug, Default)]
struct Known {
    /// Whether events keep the set: false before the first walk and after
    /// the events stopped; queries then walk `/proc`.
    kept: bool,
    by_inode: HashMap<u64, Learnt>,
    /// Anchor pid → namespace inode.
    anchors: HashMap<u32, u64>,
    /// Bumped by every namespace learnt, which records it.
    generation: u64,
    /// The namespaces over a table cap that a warning named: each is named
    /// once while it is known.
    warned: HashSet<u64>,
    /// The dead connections heals replaced, by number, while they last:
    /// under this lock, so that a namespace is either learnt before a
    /// heal's search reads the known ones or checked as it is learnt.
    replaced: BTreeMap<Dev, Replaced>,
}

#[derive(Debug)]
struct Learnt {
    read: NamespaceRead,
    generation: u64,
    /// The connections a heal put mounts of in it since it was read.
    healed_onto: BTreeSet<Dev>,
}

impl Learnt {
    fn may_hold(&self, dead: &BTreeSet<Dev>) -> bool {
        self.read.may_hold(dead) || !self.healed_onto.is_disjoint(dead)
    }
}

/// What a query found: the mounts of the dead connections, and how.
#[derive(Debug, Default)]
pub struct Holding {
    pub mounts: Vec<ForeignMount>,
    /// Namespaces read again (or, walked, read at all).
    pub read: usize,
    /// Whether `/proc` was walked for it (the set is not kept).
    pub walked: bool,
}

impl Namespaces {
    /// Not kept yet: queries walk until [`Namespaces::keep`] has walked once.
    pub fn new(proc_root: &Path) -> Arc<Namespaces> {
        Arc::new(Namespaces {
            proc_root: proc_root.to_path_buf(),
            known: Mutex::default(),
            keeper: OnceLock::new(),
            copier: OnceLock::new(),
            connections: FuseConnections::shared(Path::new(FUSE_CONNECTIONS)),
            late_copies: OnceLock::new(),
            host: OnceLock::new(),
        })
    }

    /// The namespace `namespace` (an inode) is the one whose targets the
    /// agent heals as the host's: no search finds it and its copies are
    /// never handed over as late ones. It is learnt like any other (and
    /// learnt again whenever its anchor, often a FUSE daemon, exits),
    /// holding the host's targets still on a dead connection; healed as a
    /// container's, their replacement raced the host heal of the same
    /// targets (two live layers on two targets, seen in CI after a restart).
    pub fn heal_as_host(&self, namespace: u64) {
        let _ = self.host.set(namespace);
    }

    /// `skip` and the host's namespace.
    fn and_host(&self, skip: &BTreeSet<u64>) -> BTreeSet<u64> {
        skip.iter().chain(self.host.get()).copied().collect()
    }

    /// `notify` hears of each namespace learnt after a heal that holds
    /// mounts of a connection the heal replaced (see [`Namespaces::replaced`]).
    pub fn when_late_copies(&self, notify: LateCopiesNotify) {
        let _ = self.late_copies.set(LateCopiesSink(notify));
    }

    /// A heal replaced the mounts of the dead connections `dead` (each
    /// with the inode of its `fusectl` directory, taken while its number
    /// was surely its own) with `source`'s: from now until a connection
    /// ends, a namespace learnt that holds a mount of it is handed to the
    /// loop, and `/proc` is walked once more for namespaces no exec made
    /// known. Returns the generation of the namespaces known now: a search
    /// of those learnt up to it, and the checks of those learnt after, see
    /// each namespace once.
    pub fn replaced(&self, dead: &[(Dev, u64)], source: &Path) -> u64 {
        let mut known = self.known();
        let connections = &self.connections;
        known.replaced.retain(|dev, replaced| connections.inode_of(*dev) == Some(replaced.connection));
        for (dev, connection) in dead {
            known.replaced.insert(*dev, Replaced { connection: *connection, source: source.to_path_buf() });
        }
        let generation = known.generation;
        drop(known);
        if !dead.is_empty() {
            self.look_for_unknown();
        }
        generation
    }

    /// Copies ahead, into `copies` and on `workers`, the mounts nested in
    /// the watched connections' mounts of the namespaces learnt from now on
    /// (see [`NestedCopies`]).
    pub fn copy_nested_with(&self, copies: Arc<NestedCopies>, workers: NamespaceWorkers) {
        let _ = self.copier.set(Copier { copies, workers });
    }

    /// The connections whose mounts' nested mounts are copied ahead are
    /// `connections` from now on: the known namespaces holding one new among
    /// them have theirs copied now.
    pub fn watch_connections(&self, connections: BTreeSet<Dev>) {
        let Some(copier) = self.copier.get() else { return };
        let new = copier.copies.watch(connections);
        if new.is_empty() {
            return;
        }
        let mounts: Vec<ForeignMount> = {
            let known = self.known();
            known.by_inode.values().flat_map(|learnt| to_copy_ahead(&learnt.read, &new, &copier.copies)).collect()
        };
        containers::copy_nested_ahead(&mounts, &copier.workers, &copier.copies);
    }

    /// Copies ahead the mounts nested in `reads`' mounts of watched
    /// connections not copied yet.
    fn copy_ahead<'a>(&self, reads: impl IntoIterator<Item = &'a NamespaceRead>) {
        let Some(copier) = self.copier.get() else { return };
        let watched = copier.copies.watched();
        if watched.is_empty() {
            return;
        }
        let mounts: Vec<ForeignMount> =
            reads.into_iter().flat_map(|read| to_copy_ahead(read, &watched, &copier.copies)).collect();
        containers::copy_nested_ahead(&mounts, &copier.workers, &copier.copies);
    }

    /// Drops what was copied ahead in `namespace`, which is forgotten.
    fn forget_copies(&self, namespace: u64) {
        if let Some(copier) = self.copier.get() {
            copier.copies.forget_namespace(namespace);
        }
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether events keep the set (no query walks `/proc`).
    pub fn is_kept(&self) -> bool {
        self.known().kept
    }

    /// How many namespaces are known.
    pub fn len(&self) -> usize {
        self.known().by_inode.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The stamp of the namespace learnt last: [`Namespaces::holding`]
    /// with it as `learnt_after` reads only the namespaces learnt since.
    pub fn generation(&self) -> u64 {
        self.known().generation
    }

    /// Every mount of a connection in `dead` in the known namespaces but
    /// `skip`'s (inodes), each read again now through its anchor; only in
    /// those learnt at one of `generations`. Walks `/proc` instead while
    /// the set is not kept.
    pub fn holding(
        &self,
        skip: &BTreeSet<u64>,
        dead: &BTreeSet<Dev>,
        generations: impl RangeBounds<u64>,
    ) -> Result<Holding, ContainerHealError> {
        let skip = &self.and_host(skip);
        // Searched at a death on the loop, raised: a tenant's table is
        // read at the heal priority only up to a node's worth of mounts.
        let mut realtime = RealtimeReads::of_this_thread();
        let candidates: Vec<(u64, ProcessId)> = {
            let known = self.known();
            if !known.kept {
                drop(known);
                let walked = walk_counted(&self.proc_root, skip, || {}, &mut |listed| realtime.listed(listed))?;
                let read = walked.len();
                let mounts = walked.iter().flat_map(|read| read.foreign_mounts(dead)).collect();
                return Ok(Holding { mounts, read, walked: true });
            }
            known
                .by_inode
                .iter()
                .filter(|(inode, learnt)| {
                    !skip.contains(inode) && learnt.may_hold(dead) && generations.contains(&learnt.generation)
                })
                .map(|(inode, learnt)| (*inode, learnt.read.anchor))
                .collect()
        };
        let mut holding = Holding::default();
        for (namespace, anchor) in candidates {
            let read = read_namespace_counted(&self.proc_root, anchor.pid, Some(namespace), &mut |listed| {
                realtime.listed(listed)
            })
            .map_err(|source| ContainerHealError::Walk { proc_root: self.proc_root.clone(), source })?;
            holding.read += 1;
            let mut known = self.known();
            match read.filter(|read| read.anchor == anchor) {
                Some(read) => {
                    known.warn_once_if_over_caps(&read);
                    holding.mounts.extend(read.foreign_mounts(dead));
                    if let Some(learnt) = known.by_inode.get_mut(&namespace) {
                        learnt.read = read;
                        learnt.healed_onto.clear();
                    }
                }
                // The anchor is gone (its exit event is on its way) or was
                // never there: forgotten, as at its exit.
                None => {
                    known.forget_namespace(namespace);
                    drop(known);
                    self.forget_copies(namespace);
                }
            }
        }
        Ok(holding)
    }

    /// Asks the keeper's thread to walk `/proc` for the namespaces no exec
    /// made known: a process that called unshare(2) itself and never
    /// exec'd since (the start walk being the last to see its namespace)
    /// can hold a copy of a dead connection's mount. Asked at a death, so
    /// the walk runs during the outage, at the background priority and after
    /// any heal, and what it learns is searched before the host heal (those
    /// learnt since the death's search). Nothing where events do not keep
    /// the set: searches walk `/proc` there anyway.
    pub fn look_for_unknown(&self) {
        if let Some(keeper) = self.keeper.get() {
            let _ = keeper.lock().unwrap_or_else(PoisonError::into_inner).send(Message::LookForUnknown);
        }
    }

    /// A heal put a mount of connection `dev` in `namespace`: the next
    /// search for `dev` reads it.
    pub fn healed_onto(&self, namespace: u64, dev: Dev) {
        if let Some(learnt) = self.known().by_inode.get_mut(&namespace) {
            learnt.healed_onto.insert(dev);
        }
    }

    /// Keeps the set by the process connector's events from now on: a
    /// thread walks `/proc` once, then learns and forgets namespaces as
    /// processes exec and exit. It waits for any heal under way before it
    /// reads a table (`heal_activity`), at the background CPU priority. The
    /// connector must have been opened with execs.
    pub fn keep(
        self: &Arc<Self>,
        connector: &ProcessConnector,
        heal_activity: Arc<HealActivity>,
    ) -> Result<NamespaceKeeper, ProcessWatchError> {
        let (send, events) = mpsc::channel();
        let sink_send = send.clone();
        let _ = self.keeper.set(Mutex::new(send.clone()));
        let subscription = Subscription { exec: ExecReports::All, batch_window: Some(EVENT_BATCH_WINDOW) };
        // Most execs are in a known namespace (a probe, a shell's command):
        // told apart on the connector's thread by one stat, so that the
        // keeper's thread wakes only for a new one.
        let sink_namespaces = Arc::clone(self);
        let watcher = connector.watcher(
            subscription,
            Box::new(move |event| match event {
                ProcessEvent::Exec { pid, .. } if sink_namespaces.knows_namespace_of(pid) => true,
                event => sink_send.send(Message::Process(event)).is_ok(),
            }),
        );
        let namespaces = Arc::clone(self);
        let thread = std::thread::Builder::new()
            .name("namespaces".into())
            .spawn(move || {
                if let Err(err) = HealPriority::lower_this_thread() {
                    debug!(err = %chain(&err), "the namespace keeper keeps the normal CPU priority");
                }
                namespaces.keep_by(&watcher, &events, &heal_activity);
            })
            .map_err(|source| {
                ProcessWatchError::Thread(crate::watch::thread::ThreadError::Spawn { name: "namespaces", source })
            })?;
        Ok(NamespaceKeeper { stop: send, thread: Some(thread) })
    }

    fn keep_by(&self, watcher: &ProcConnectorWatcher, events: &Receiver<Message>, heal_activity: &HealActivity) {
        self.walk_again(watcher, heal_activity, "start");
        for message in events {
            match message {
                Message::Process(ProcessEvent::Exec { pid, .. }) => self.exec_seen(pid, watcher, heal_activity),
                Message::Process(ProcessEvent::Exited { pid, .. }) => {
                    let forgotten = self.known().forget(pid);
                    if let Some(namespace) = forgotten {
                        self.forget_copies(namespace);
                        debug!(namespace, pid, "mount namespace forgotten: its first process exited");
                    }
                }
                Message::Process(ProcessEvent::Lost) => self.walk_again(watcher, heal_activity, "lost events"),
                Message::LookForUnknown => self.learn_unknown(watcher, heal_activity),
                Message::Process(ProcessEvent::Failed(err)) => {
                    warn!(err = %chain(&err), "the namespace keeper's process events stopped; heals in containers walk /proc again");
                    self.known().kept = false;
                    return;
                }
                Message::Stop => return,
            }
        }
    }

    /// Whether the namespace of process `pid` is known (or `pid` is gone).
    fn knows_namespace_of(&self, pid: u32) -> bool {
        namespace_of(&self.proc_root, pid).is_none_or(|namespace| self.is_known(namespace))
    }

    /// Whether `namespace` is known, and is still the one its entry was
    /// learnt as: the kernel reuses a freed namespace's inode, so an entry
    /// whose anchor has left it (exited, its exit not handled yet, or moved
    /// to another namespace) may name a new namespace; its anchor is then
    /// elsewhere, and it is learnt afresh.
    fn is_known(&self, namespace: u64) -> bool {
        let anchor = self.known().by_inode.get(&namespace).map(|learnt| learnt.read.anchor.pid);
        anchor.is_some_and(|anchor| namespace_of(&self.proc_root, anchor) == Some(namespace))
    }

    /// A process exec'd: its namespace is read if it is not known.
    fn exec_seen(&self, pid: u32, watcher: &ProcConnectorWatcher, heal_activity: &HealActivity) {
        let Some(namespace) = namespace_of(&self.proc_root, pid) else { return };
        if self.is_known(namespace) {
            return;
        }
        heal_activity.wait_until_quiet();
        let anchor = oldest_ancestor_within(&self.proc_root, pid, namespace);
        let read = match read_namespace(&self.proc_root, anchor, Some(namespace)) {
            Ok(Some(read)) => read,
            // Exited already (its namespace is learnt at the next exec in
            // it), or out of descriptors for a moment.
            Ok(None) => return,
            Err(err) => {
                warn!(pid, namespace, err = %chain(&err), "cannot read a new mount namespace");
                return;
            }
        };
        if watcher.watch(read.anchor).is_err() {
            return;
        }
        let fuse_mounts = read.fuse_mounts.len();
        let receives = read.receives;
        let learnt = self.learn_new(read);
        debug!(namespace, pid, fuse_mounts, receives, "mount namespace learnt");
        self.copy_ahead([&learnt]);
    }

    /// Learns `read`, of a namespace not known, whose anchor is watched, and
    /// returns it for the caller to say so and then copy ahead the mounts
    /// nested in its copies (see `copy_ahead`): known first, since copying
    /// ahead waits for the namespace workers, which a heal may hold, and a
    /// heal meanwhile must find this namespace to isolate its copies of the
    /// dead mount before the host heal (a slave copy would get the new
    /// mount over its dead one otherwise).
    fn learn_new(&self, read: NamespaceRead) -> NamespaceRead {
        // Not known: what was copied for its inode was another namespace's.
        self.forget_copies(read.namespace);
        let mut known = self.known();
        known.warn_once_if_over_caps(&read);
        let late = known.replaced_held_by(&read, &self.connections);
        let learnt = read.clone();
        known.learn(read);
        drop(known);
        if !late.is_empty() {
            self.hand_over_late(&learnt, late);
        }
        learnt
    }

    /// Hands `read`'s mounts of the replaced connections `late` (by the
    /// source that replaced them) to the loop.
    fn hand_over_late(&self, read: &NamespaceRead, late: BTreeMap<PathBuf, BTreeSet<Dev>>) {
        let Some(LateCopiesSink(notify)) = self.late_copies.get() else { return };
        if self.host.get() == Some(&read.namespace) {
            return;
        }
        for (source, connections) in late {
            let mounts = read.foreign_mounts(&connections);
            if !mounts.is_empty() {
                notify(LateCopies { source, mounts });
            }
        }
    }

    /// Learns every namespace afresh by a walk of `/proc`.
    fn walk_again(&self, watcher: &ProcConnectorWatcher, heal_activity: &HealActivity, reason: &str) {
        let started = Instant::now();
        let walked = match walk(&self.proc_root, &BTreeSet::new(), || heal_activity.wait_until_quiet()) {
            Ok(walked) => walked,
            Err(err) => {
                // Kept as it was: queries walk until a walk succeeds.
                warn!(err = %chain(&err), reason, "cannot walk the mount namespaces; heals in containers walk /proc");
                self.known().kept = false;
                return;
            }
        };
        let watched: Vec<NamespaceRead> =
            walked.into_iter().filter(|read| watcher.watch(read.anchor).is_ok()).collect();
        let known = self.known();
        let old_anchors: Vec<u32> = known.anchors.keys().copied().collect();
        let before: HashSet<(u64, u32)> =
            known.by_inode.iter().map(|(namespace, learnt)| (*namespace, learnt.read.anchor.pid)).collect();
        let still: HashSet<(u64, u32)> = watched.iter().map(|read| (read.namespace, read.anchor.pid)).collect();
        let gone: Vec<u64> = known
            .by_inode
            .iter()
            .filter(|(namespace, learnt)| !still.contains(&(**namespace, learnt.read.anchor.pid)))
            .map(|(namespace, _)| *namespace)
            .collect();
        drop(known);
        for namespace in gone {
            self.forget_copies(namespace);
        }
        self.copy_ahead(&watched);
        let mut known = self.known();
        known.by_inode.clear();
        known.anchors.clear();
        let mut late = Vec::new();
        for read in watched {
            known.warn_once_if_over_caps(&read);
            if !before.contains(&(read.namespace, read.anchor.pid)) {
                let held = known.replaced_held_by(&read, &self.connections);
                if !held.is_empty() {
                    late.push((read.clone(), held));
                }
            }
            known.learn(read);
        }
        let Known { warned, by_inode, .. } = &mut *known;
        warned.retain(|namespace| by_inode.contains_key(namespace));
        for pid in old_anchors.into_iter().filter(|pid| !known.anchors.contains_key(pid)) {
            watcher.unwatch(pid);
        }
        known.kept = true;
        let holding = known
            .by_inode
            .values()
            .filter(|learnt| learnt.read.receives || !learnt.read.fuse_mounts.is_empty())
            .count();
        let namespaces = known.by_inode.len();
        drop(known);
        for (read, held) in late {
            self.hand_over_late(&read, held);
        }
        let took_us = started.elapsed().as_micros() as u64;
        info!(reason, namespaces, holding, took_us, "mount namespaces walked");
    }

    /// Walks `/proc` for namespaces not known (reading only those), and
    /// learns them; the known ones keep their entries, so a search of those
    /// learnt since reads only the new.
    fn learn_unknown(&self, watcher: &ProcConnectorWatcher, heal_activity: &HealActivity) {
        let started = Instant::now();
        let known: BTreeSet<u64> = self.known().by_inode.keys().copied().collect();
        let walked = match walk(&self.proc_root, &known, || heal_activity.wait_until_quiet()) {
            Ok(walked) => walked,
            Err(err) => {
                warn!(err = %chain(&err), "cannot walk /proc for mount namespaces no exec made known");
                return;
            }
        };
        let mut learnt = 0;
        for read in walked {
            // Learnt by an exec meanwhile, or its anchor gone already.
            if self.is_known(read.namespace) || watcher.watch(read.anchor).is_err() {
                continue;
            }
            let (namespace, pid, fuse_mounts) = (read.namespace, read.anchor.pid, read.fuse_mounts.len());
            let read = self.learn_new(read);
            debug!(namespace, pid, fuse_mounts, "mount namespace learnt by a walk");
            self.copy_ahead([&read]);
            learnt += 1;
        }
        let took_us = started.elapsed().as_micros() as u64;
        info!(learnt, took_us, "mount namespaces walked for those no exec made known");
    }
}

impl Known {
    fn learn(&mut self, read: NamespaceRead) {
        if let Some(stale) = self.by_inode.get(&read.namespace) {
            self.anchors.remove(&stale.read.anchor.pid);
        }
        self.generation += 1;
        self.anchors.insert(read.anchor.pid, read.namespace);
        self.by_inode
            .insert(read.namespace, Learnt { read, generation: self.generation, healed_onto: BTreeSet::new() });
    }

    /// The replaced connections `read` holds mounts of that are still the
    /// connections replaced (their `fusectl` directory the one recorded),
    /// by the source that replaced them.
    fn replaced_held_by(
        &self,
        read: &NamespaceRead,
        connections: &FuseConnections,
    ) -> BTreeMap<PathBuf, BTreeSet<Dev>> {
        let mut held: BTreeMap<PathBuf, BTreeSet<Dev>> = BTreeMap::new();
        if self.replaced.is_empty() {
            return held;
        }
        let devs: BTreeSet<Dev> = read.fuse_mounts.iter().map(|mount| mount.dev).collect();
        for dev in devs {
            let Some(replaced) = self.replaced.get(&dev) else { continue };
            if connections.inode_of(dev) == Some(replaced.connection) {
                held.entry(replaced.source.clone()).or_default().insert(dev);
            }
        }
        held
    }

    /// Names `read`'s namespace in a warning if the read left something
    /// out for the caps, and no warning named it since it was learnt.
    fn warn_once_if_over_caps(&mut self, read: &NamespaceRead) {
        let Overflow { long_mounts, unkept_fuse_mounts, malformed_lines } = read.overflow;
        if read.overflow.any() && self.warned.insert(read.namespace) {
            warn!(
                namespace = read.namespace,
                pid = read.anchor.pid,
                long_mounts,
                unkept_fuse_mounts,
                malformed_lines,
                kept_fuse_mounts = read.fuse_mounts.len(),
                "mount namespace over a table cap"
            );
        }
    }

    /// Forgets the namespace `pid` anchors, if any.
    fn forget(&mut self, pid: u32) -> Option<u64> {
        let namespace = self.anchors.remove(&pid)?;
        self.by_inode.remove(&namespace);
        self.warned.remove(&namespace);
        Some(namespace)
    }

    /// Forgets `namespace`, and its anchor's entry if it is this one's.
    fn forget_namespace(&mut self, namespace: u64) {
        self.warned.remove(&namespace);
        if let Some(learnt) = self.by_inode.remove(&namespace) {
            let pid = learnt.read.anchor.pid;
            if self.anchors.get(&pid) == Some(&namespace) {
                self.anchors.remove(&pid);
            }
        }
    }
}

/// The mounts of `read` worth copying ahead: those of `connections` that
/// other mounts are on, and whose copies are not held yet.
fn to_copy_ahead(read: &NamespaceRead, connections: &BTreeSet<Dev>, copies: &NestedCopies) -> Vec<ForeignMount> {
    if read.with_mounts_on.is_empty() {
        return Vec::new();
    }
    let mut mounts = read.foreign_mounts(connections);
    mounts.retain(|foreign| {
        read.with_mounts_on.contains(&foreign.mount.mount_id)
            && foreign.unique_id.is_none_or(|unique| !copies.holds(unique))
    });
    mounts
}

enum Message {
    Process(ProcessEvent),
    /// A death: walk for the namespaces no exec made known.
    LookForUnknown,
    Stop,
}

/// The thread that keeps a [`Namespaces`]; dropping it stops the thread and
/// its process connector.
#[derive(Debug)]
pub struct NamespaceKeeper {
    stop: Sender<Message>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for NamespaceKeeper {
    fn drop(&mut self) {
        let _ = self.stop.send(Message::Stop);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The eldest of `pid` and its ancestors that are in `namespace` without a
/// break: the process that made or entered it (a container's first
/// process), which outlives the short-lived ones that exec in it (a
/// probe, a shell's commands), so that the namespace is not forgotten and
/// read again each time one of those exits.
fn oldest_ancestor_within(proc_root: &Path, pid: u32, namespace: u64) -> u32 {
    /// Far deeper than any process tree within one namespace.
    const MAX_DEPTH: usize = 64;
    let mut anchor = pid;
    for _ in 0..MAX_DEPTH {
        let parent = match read_stat(proc_root, anchor) {
            Ok(Some(stat)) if stat.ppid > 1 => stat.ppid,
            _ => break,
        };
        if namespace_of(proc_root, parent) != Some(namespace) {
            break;
        }
        anchor = parent;
    }
    anchor
}

/// The mount namespace inode of process `pid`, if it is there.
fn namespace_of(proc_root: &Path, pid: u32) -> Option<u64> {
    fs::metadata(proc_root.join(pid.to_string()).join("ns/mnt")).map(|meta| meta.ino()).ok()
}

/// The namespace of `pid` (which must be `expected` when given), read
/// through it within the table caps: None if the process is gone, was replaced by another with
/// its pid, or left the namespace while it was read. Fails only for want
/// of descriptors, which a caller must not take for a process gone.
pub fn read_namespace(proc_root: &Path, pid: u32, expected: Option<u64>) -> io::Result<Option<NamespaceRead>> {
    read_namespace_counted(proc_root, pid, expected, &mut |_| {})
}

/// [`read_namespace`], telling `listed` of its mounts as they are listed
/// ([`namespace_table::read_counted`]).
fn read_namespace_counted(
    proc_root: &Path,
    pid: u32,
    expected: Option<u64>,
    listed: &mut dyn FnMut(usize),
) -> io::Result<Option<NamespaceRead>> {
    let Some(namespace) = namespace_of(proc_root, pid) else { return Ok(None) };
    if expected.is_some_and(|expected| expected != namespace) {
        return Ok(None);
    }
    let Some(before) = stat_of(proc_root, pid)? else { return Ok(None) };
    let Some(table) = namespace_table::read_counted(proc_root, pid, &TableCaps::DEFAULT, listed)? else {
        return Ok(None);
    };
    // Still the same process, still there: the table was its namespace's.
    let after = stat_of(proc_root, pid)?;
    if namespace_of(proc_root, pid) != Some(namespace)
        || after.is_none_or(|after| after.start_time != before.start_time || after.exited())
    {
        return Ok(None);
    }
    Ok(Some(NamespaceRead {
        namespace,
        anchor: ProcessId { pid, start_time: before.start_time },
        fuse_mounts: table.fuse_mounts,
        receives: table.receives,
        unique_ids: table.unique_ids,
        with_mounts_on: table.with_mounts_on,
        overflow: table.overflow,
    }))
}

/// `<proc_root>/<pid>/stat`, None if the process is gone; fails only for
/// want of descriptors, which is not a process gone: taken for one, a
/// search at a low open-file limit forgot every namespace it read.
fn stat_of(proc_root: &Path, pid: u32) -> io::Result<Option<Stat>> {
    match read_stat(proc_root, pid) {
        Ok(stat) => Ok(stat),
        Err(ProcessWatchError::Proc { source, .. }) if fds::out_of_descriptors(&source) => Err(source),
        Err(_) => Ok(None),
    }
}

/// Every mount namespace of `proc_root`'s processes but `skip`'s (inodes),
/// each read once, through the first of its processes in pid order whose
/// table could be read, and anchored at its oldest process. `pause` is
/// called before each table is read.
pub fn walk(
    proc_root: &Path,
    skip: &BTreeSet<u64>,
    pause: impl FnMut(),
) -> Result<Vec<NamespaceRead>, ContainerHealError> {
    walk_counted(proc_root, skip, pause, &mut |_| {})
}

/// [`walk`], telling `listed` of the mounts of each table as they are listed.
fn walk_counted(
    proc_root: &Path,
    skip: &BTreeSet<u64>,
    mut pause: impl FnMut(),
    listed: &mut dyn FnMut(usize),
) -> Result<Vec<NamespaceRead>, ContainerHealError> {
    let walk_error = |source| ContainerHealError::Walk { proc_root: proc_root.to_path_buf(), source };
    let mut pids: Vec<u32> = fs::read_dir(proc_root)
        .map_err(walk_error)?
        .flatten()
        .filter_map(|entry| entry.file_name().to_str().and_then(|name| name.parse().ok()))
        .collect();
    // In pid order, as /proc lists them (a test's tree does not).
    pids.sort_unstable();
    let mut reads: BTreeMap<u64, NamespaceRead> = BTreeMap::new();
    let mut members: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    for pid in pids {
        let Some(namespace) = namespace_of(proc_root, pid) else { continue };
        if skip.contains(&namespace) {
            continue;
        }
        members.entry(namespace).or_default().push(pid);
        if reads.contains_key(&namespace) {
            continue;
        }
        // The first process of a namespace in the walk may be a short-lived
        // one (a container's `usleep`: pids wrap, so it can come before the
        // container's init) that exits before its table is read: the
        // namespace is then read through the next one.
        pause();
        if let Some(read) = read_namespace_counted(proc_root, pid, Some(namespace), listed).map_err(walk_error)? {
            reads.insert(namespace, read);
        }
    }
    // Entered later through its oldest process (a container's init), the
    // one most likely to be still there then.
    for (namespace, read) in &mut reads {
        let oldest = members.get(namespace).and_then(|pids| {
            pids.iter()
                .filter_map(|pid| {
                    Some(ProcessId { pid: *pid, start_time: read_stat(proc_root, *pid).ok()??.start_time })
                })
                .min_by_key(|process| (process.start_time, process.pid))
        });
        if let Some(oldest) = oldest {
            read.anchor = oldest;
        }
    }
    Ok(reads.into_values().collect())
}

#[cfg(test)]
mod tests;
