//! The FUSE daemons behind the sources, watched so that a death is seen the
//! moment it happens: a dead daemon changes nothing in the mount table.
//!
//! [`Daemons`] lives on the supervisor loop and keeps what is known of each
//! source connection. A discovery thread walks `/proc` for the processes
//! holding a new connection ([`FuseServers`]) and starts watching exactly
//! those, so the loop never walks `/proc` itself; the process watcher's
//! thread sends their exits. Exec events reach the loop only while some
//! connection has no known daemon (the sink drops them otherwise), so a busy
//! node's execs do not wake an idle supervisor.
//!
//! A connection is dead when every process holding it has exited: the
//! kernel then aborts it and every access answers ENOTCONN. The last known
//! holder's exit is taken as that at once, and a discovery of the
//! connection follows: a daemon that daemonized or handed its descriptor on
//! after it was found leaves the connection to a process nobody watched,
//! and if the discovery finds one the death is retracted. When a serving
//! process exits but others still hold the connection (a parent keeping the
//! descriptor, a process it was handed to), requests may hang instead; if
//! none of those left reads the device, discoveries go on until a holder
//! that was not among them shows up (a watchdog's restarted child), which is
//! then watched too. `--abort-dead-connections` aborts such a connection
//! once requests wait and no holder reads the device.
//!
//! [`FuseServers`]: fuse_supervisor_engine::watch::processes::fuse_server::FuseServers
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::heal::connections::FuseConnections;
use fuse_supervisor_engine::heal::priority::{HealActivity, HealPriority};
use fuse_supervisor_engine::model::table::Dev;
use fuse_supervisor_engine::plan::flapping::FlappingPolicy;
use fuse_supervisor_engine::watch::processes::{
    Backend, ExecReports, PidfdWatcher, ProcessConnector, ProcessEvent, ProcessId, ProcessWatchError, ProcessWatcher,
    Subscription,
};

mod discovery;
mod orphans;

use discovery::{Holders, discovery_loop, lock, remove_holder};
use orphans::{Orphan, reads_fuse_device};
pub use orphans::{connection_dir, read_waiting};

/// How daemons are watched.
#[derive(Debug, Clone)]
pub struct DaemonWatch {
    /// None: no process watching, deaths are seen only when a new mount
    /// appears. The connector falls back to pidfds when it cannot
    /// subscribe; its execs start a discovery for a connection whose daemon
    /// was not found.
    pub backend: Option<Backend>,
    /// Where pids are processes: the host's `/proc` with hostPID.
    pub proc_root: PathBuf,
    /// Abort a connection whose serving process exited while others still
    /// hold it, once requests wait and nobody reads them.
    pub abort_dead_connections: bool,
    /// The FUSE control filesystem (`fusectl`) in the watched namespace.
    pub fuse_connections: PathBuf,
    /// Detach a dead daemon's own mount from its source path once nobody
    /// holds its connection (`--detach-dead-sources`).
    pub detach_dead_sources: bool,
    /// When a source's heals are a crash loop (`--flapping-heals`,
    /// `--flapping-window`).
    pub flapping: FlappingPolicy,
}

impl Default for DaemonWatch {
    fn default() -> Self {
        DaemonWatch {
            backend: Some(Backend::Pidfd),
            proc_root: PathBuf::from("/proc"),
            abort_dead_connections: false,
            fuse_connections: PathBuf::from("/sys/fs/fuse/connections"),
            detach_dead_sources: true,
            flapping: FlappingPolicy::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("cannot start the {backend} process watcher")]
    Watcher {
        backend: &'static str,
        #[source]
        source: ProcessWatchError,
    },
    #[error("cannot start the daemon discovery thread")]
    Thread(#[source] io::Error),
}

/// What the watcher and the discovery thread tell the loop.
#[derive(Debug)]
pub enum DaemonEvent {
    Process(ProcessEvent),
    Discovered(Vec<Discovered>),
}

/// The processes found holding one connection, now watched.
#[derive(Debug)]
pub struct Discovered {
    pub source: PathBuf,
    pub dev: Dev,
    pub result: Result<Vec<ProcessId>, String>,
    /// When the `/proc` scan began: it saw no exit after that.
    pub scanned_at: Instant,
    /// Every descriptor names its connection (fdinfo): none found means
    /// nobody holds it, rather than nobody the fallback could tell apart.
    pub exact: bool,
}

/// A connection whose holders all exited: its daemon is dead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Death {
    pub source: PathBuf,
    pub dev: Dev,
}

/// A death taken back: the last known holder of the connection exited, but
/// the discovery that followed found `pids` holding it, now watched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retraction {
    pub source: PathBuf,
    pub dev: Dev,
    pub pids: Vec<u32>,
}

/// What the discoveries that followed deaths found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Verdicts {
    /// Deaths taken back: another process holds the connection.
    pub retracted: Vec<Retraction>,
    /// Deaths that stand: nobody holds the connection, which the kernel
    /// has therefore aborted for good.
    pub confirmed: Vec<Death>,
    /// Connections nobody holds that no holder was ever found for: dead
    /// already (a daemon that exited before the search reached it) if
    /// their mount answers ENOTCONN, or a descriptor in flight to its
    /// daemon (from `fusermount`) if not.
    pub unheld: Vec<(PathBuf, Dev)>,
}

/// A connection whose serving process exited while other processes hold
/// it; `remaining` are those still watched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartialExit {
    pub source: PathBuf,
    pub dev: Dev,
    pub remaining: Vec<u32>,
}

/// A connection aborted through fusectl: requests were waiting on it and
/// no holder was reading them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Aborted {
    pub source: PathBuf,
    pub dev: Dev,
    /// The serving process whose exit left the connection orphaned.
    pub pid: u32,
    pub exited_at: Instant,
    pub waiting: u64,
}

/// What is known of one connection at a source path.
#[derive(Debug)]
enum Known {
    /// A discovery is on its way.
    Asked,
    /// Holders found and watched.
    Served,
    /// No process found to serve it yet: asked again at `retry_at`, then on
    /// exec events. Either nobody holds it (a descriptor in flight between
    /// `fusermount` and the daemon, an older kernel's ambiguous match), or
    /// its serving process exited and the holders `left` behind do not read
    /// it (a watchdog that keeps the descriptor and restarts its child on
    /// it, as JuiceFS's mount process does): only a holder not among them is
    /// the next server.
    Unserved { left: Vec<ProcessId>, tries: u32, retry_at: Option<Instant> },
    /// Every known holder exited (at `since`, on the loop's clock): a
    /// discovery that began after that tells whether a process discovery
    /// had not seen holds it still.
    Dying { since: Instant },
    /// Every holder exited.
    Dead,
}

/// Discoveries that find nobody are repeated this many times, spaced out
/// from 100 ms; then only exec events ask again (connector), or nothing
/// does (pidfd): no timer runs for good, and the connection's end is seen
/// when a new mount replaces it, as without a process watcher.
const UNSERVED_RETRIES: u32 = 5;
/// As [`UNSERVED_RETRIES`], for the next server of a connection whose
/// holders stayed: a watchdog restarts its child some time after the crash
/// (JuiceFS: one second, then the child's own start-up), so the search goes
/// on for about 12 s.
const SUCCESSOR_RETRIES: u32 = 7;
/// Exec events ask for a discovery at most this often.
const EXEC_DISCOVERY_SPACING: Duration = Duration::from_secs(1);

/// The loop's view of the daemons behind its sources.
pub struct Daemons {
    options: DaemonWatch,
    watcher: Arc<dyn ProcessWatcher>,
    holders: Holders,
    known: BTreeMap<Dev, (PathBuf, Known)>,
    /// The inode of each known connection's `fusectl` directory when it was
    /// first seen at its source: the kernel gives a freed number to the next
    /// connection made anywhere (a pod's own FUSE daemon), and a discovery
    /// that ran after that would take its holders for this one's.
    identities: BTreeMap<Dev, Option<u64>>,
    /// Where those directories are read: `fuse_connections`, or a private
    /// `fusectl` where none is mounted there.
    connections: Arc<FuseConnections>,
    want_exec: Arc<AtomicBool>,
    last_exec_discovery: Option<Instant>,
    orphans: BTreeMap<Dev, Orphan>,
    /// None once dropped: closing it ends the discovery thread.
    requests: Option<Sender<Vec<(PathBuf, Dev)>>>,
    discovery: Option<JoinHandle<()>>,
}

impl Daemons {
    /// Starts the process watcher (on `connector` with that backend; with
    /// pidfds without one) and the discovery thread; None when watching is
    /// off. Call before the loop thread leaves for the watched namespace:
    /// the threads keep this one's `/proc`.
    pub fn start(
        options: &DaemonWatch,
        connector: Option<&ProcessConnector>,
        heal_activity: Arc<HealActivity>,
        send: impl Fn(DaemonEvent) -> bool + Send + Clone + 'static,
    ) -> Result<Option<Daemons>, DaemonError> {
        let want_exec = Arc::new(AtomicBool::new(false));
        let sink = {
            let (send, want_exec) = (send.clone(), Arc::clone(&want_exec));
            move || -> fuse_supervisor_engine::watch::processes::EventSink {
                let (send, want_exec) = (send.clone(), Arc::clone(&want_exec));
                Box::new(move |event| match event {
                    // Most execs on a node are nobody's business: dropped
                    // here, on the watcher's thread, unless a connection
                    // waits for its daemon.
                    ProcessEvent::Exec { .. } if !want_exec.load(Ordering::Relaxed) => true,
                    event => send(DaemonEvent::Process(event)),
                })
            }
        };
        let pidfd = |options: &DaemonWatch| -> Result<Arc<dyn ProcessWatcher>, DaemonError> {
            let watcher = PidfdWatcher::start(options.proc_root.clone(), sink())
                .map_err(|source| DaemonError::Watcher { backend: "pidfd", source })?;
            Ok(Arc::new(watcher))
        };
        let watcher: Arc<dyn ProcessWatcher> = match options.backend {
            None => {
                info!("process watching is off: daemon deaths are seen only when a new mount appears");
                return Ok(None);
            }
            Some(Backend::Pidfd) => pidfd(options)?,
            Some(Backend::ProcConnector) => match connector {
                Some(connector) => {
                    let subscription = Subscription { exec: ExecReports::All, batch_window: None };
                    Arc::new(connector.watcher(subscription, sink()))
                }
                // Why it could not be opened was said where it was.
                None => {
                    warn!("process connector unavailable; watching daemons with pidfds");
                    pidfd(options)?
                }
            },
        };
        info!(backend = ?watcher.backend(), "watching FUSE daemons");
        let holders: Holders = Arc::default();
        let (requests, queue) = mpsc::channel();
        let discovery = {
            let (watcher, holders, proc_root) = (Arc::clone(&watcher), Arc::clone(&holders), options.proc_root.clone());
            std::thread::Builder::new()
                .name("discovery".into())
                .spawn(move || {
                    // A new daemon is looked for while its mount is being
                    // healed: the /proc walk waits for the heal, and takes
                    // no CPU another process wants.
                    if let Err(err) = HealPriority::lower_this_thread() {
                        debug!(err = %chain(&err), "daemon discovery keeps the normal CPU priority");
                    }
                    discovery_loop(&queue, &proc_root, &*watcher, &holders, &heal_activity, send)
                })
                .map_err(DaemonError::Thread)?
        };
        Ok(Some(Daemons {
            options: options.clone(),
            watcher,
            holders,
            known: BTreeMap::new(),
            identities: BTreeMap::new(),
            connections: FuseConnections::shared(&options.fuse_connections),
            want_exec,
            last_exec_discovery: None,
            orphans: BTreeMap::new(),
            requests: Some(requests),
            discovery: Some(discovery),
        }))
    }

    pub fn backend(&self) -> fuse_supervisor_engine::watch::processes::Backend {
        self.watcher.backend()
    }

    fn request(&mut self, wanted: Vec<(PathBuf, Dev)>) {
        for (source, dev) in &wanted {
            self.known.insert(*dev, (source.clone(), Known::Asked));
        }
        self.send_request(wanted);
    }

    fn send_request(&self, wanted: Vec<(PathBuf, Dev)>) {
        if wanted.is_empty() {
            return;
        }
        if let Some(requests) = &self.requests
            && requests.send(wanted).is_err()
        {
            warn!("daemon discovery thread is gone; new daemons are not watched");
        }
    }

    /// After a scan: asks who serves each connection not seen before at a
    /// source, and forgets those no longer there, with their holders. A
    /// daemon killed and its mount unmounted at once (a restart script's
    /// `kill; umount`) leaves its source before the loop may have handled
    /// its exit: a connection still under a target (`under_targets`) whose
    /// holders are watched stays known, so that their exit is a death. One
    /// whose daemon was never found is forgotten all the same: a search for
    /// it would probe its source, which shows another mount or none.
    pub fn sources_seen<'a>(
        &mut self,
        sources: impl Iterator<Item = (&'a Path, Dev)>,
        under_targets: impl Iterator<Item = Dev>,
    ) {
        let current: BTreeMap<Dev, &Path> = sources.map(|(path, dev)| (dev, path)).collect();
        let new: Vec<(PathBuf, Dev)> = current
            .iter()
            .filter(|(dev, _)| !self.known.contains_key(dev))
            .map(|(dev, path)| (path.to_path_buf(), *dev))
            .collect();
        let mut gone: Vec<Dev> = self.known.keys().filter(|dev| !current.contains_key(dev)).copied().collect();
        // Only when one left its source: a node has thousands of targets,
        // and the loop calls this after every scan.
        if !gone.is_empty() {
            let watched: BTreeSet<Dev> =
                lock(&self.holders).values().flat_map(|holder| holder.serves.iter().map(|(_, dev)| *dev)).collect();
            let kept: BTreeSet<Dev> = under_targets.filter(|dev| watched.contains(dev)).collect();
            gone.retain(|dev| !kept.contains(dev));
        }
        for (_, dev) in &new {
            self.identities.insert(*dev, self.connections.inode_of(*dev));
        }
        for dev in gone {
            self.known.remove(&dev);
            self.identities.remove(&dev);
            self.orphans.remove(&dev);
            let mut holders = lock(&self.holders);
            holders.retain(|&pid, holder| {
                holder.serves.retain(|(_, served)| *served != dev);
                let keep = !holder.serves.is_empty();
                if !keep {
                    self.watcher.unwatch(pid);
                }
                keep
            });
        }
        self.request(new);
        self.update_exec_interest();
    }

    /// After lost process events: every connection is asked about again.
    pub fn rediscover_all(&mut self) {
        let (mut waiting, mut all) = (Vec::new(), Vec::new());
        for (dev, (path, known)) in &self.known {
            match known {
                // A dying connection's discovery is on its way already.
                Known::Dead | Known::Dying { .. } => {}
                // Still looking for a server beside the holders it keeps.
                Known::Unserved { left, .. } if !left.is_empty() => waiting.push((path.clone(), *dev)),
                _ => all.push((path.clone(), *dev)),
            }
        }
        self.send_request(waiting);
        self.request(all);
    }

    /// A process exited: the connections it held, split into those it
    /// leaves dead and those others still hold. A death is checked by a
    /// discovery of the connection, which may retract it
    /// ([`Daemons::discovered`]).
    pub fn exited(&mut self, pid: u32) -> (Vec<Death>, Vec<PartialExit>) {
        let mut holders = lock(&self.holders);
        let Some(holder) = holders.remove(&pid) else { return (Vec::new(), Vec::new()) };
        let (mut deaths, mut partial, mut check, mut left_unread) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let now = Instant::now();
        for (source, dev) in holder.serves {
            let left: Vec<ProcessId> = holders
                .values()
                .filter(|other| other.serves.iter().any(|(_, served)| *served == dev))
                .map(|other| other.process)
                .collect();
            if !left.is_empty() {
                let remaining = left.iter().map(|process| process.pid).collect();
                // Nobody left reads it: a watchdog's next child is to come.
                if !left.iter().any(|process| reads_fuse_device(&self.options.proc_root, process.pid)) {
                    left_unread.push((dev, left));
                }
                partial.push(PartialExit { source, dev, remaining });
                continue;
            }
            // A holder found by a discovery of a dying connection exited
            // before its answer came: that answer is stale, the death
            // already reported.
            let before =
                self.known.get_mut(&dev).map(|(_, known)| std::mem::replace(known, Known::Dying { since: now }));
            let dying = matches!(before, Some(Known::Dying { .. }));
            check.push((source.clone(), dev));
            if !dying {
                deaths.push(Death { source, dev });
            }
        }
        drop(holders);
        // The rest of a partly exited connection's holders may have changed
        // (a descriptor handed to a new process): look again, and where
        // nobody left reads it, until a new holder shows up.
        let again = partial.iter().map(|exit| (exit.source.clone(), exit.dev)).collect();
        self.request(again);
        for (dev, left) in left_unread {
            if let Some((_, known)) = self.known.get_mut(&dev) {
                *known = Known::Unserved { left, tries: 0, retry_at: None };
            }
        }
        self.send_request(check);
        self.update_exec_interest();
        (deaths, partial)
    }

    /// A discovery's answer; returns the deaths it retracts or confirms.
    pub fn discovered(&mut self, found: Vec<Discovered>) -> Verdicts {
        let now = Instant::now();
        let mut verdicts = Verdicts::default();
        for Discovered { source, dev, result, scanned_at, mut exact } in found {
            let result = match result {
                Ok(processes) if !processes.is_empty() && !self.same_connection(dev) => {
                    debug!(source = %source.display(), connection = %dev, "the connection's number is another connection's now: its holders are not this one's");
                    self.let_go(&processes, dev);
                    // Nobody holds the connection that was seen: it is gone.
                    exact = true;
                    Ok(Vec::new())
                }
                result => result,
            };
            let Some((_, known)) = self.known.get_mut(&dev) else { continue };
            match known {
                Known::Dead => continue,
                // Begun before the exit: the answer to an earlier question.
                Known::Dying { since } if scanned_at < *since => continue,
                Known::Dying { .. } => {
                    match result {
                        Ok(processes) if !processes.is_empty() => {
                            let pids: Vec<u32> = processes.iter().map(|process| process.pid).collect();
                            *known = Known::Served;
                            verdicts.retracted.push(Retraction { source, dev, pids });
                        }
                        Ok(_) => {
                            debug!(source = %source.display(), connection = %dev, "no process holds the connection: the death stands");
                            *known = Known::Dead;
                            verdicts.confirmed.push(Death { source, dev });
                        }
                        Err(err) => {
                            warn!(source = %source.display(), connection = %dev, %err, "cannot tell whether another process holds a dead daemon's connection; the death stands");
                            *known = Known::Dead;
                        }
                    }
                    continue;
                }
                _ => {}
            }
            let (left, tries) = match known {
                Known::Unserved { left, tries, .. } => (std::mem::take(left), *tries + 1),
                _ => (Vec::new(), 1),
            };
            match result {
                Ok(processes) if processes.iter().any(|process| !left.contains(process)) => {
                    let pids: Vec<u32> = processes.iter().map(|process| process.pid).collect();
                    info!(source = %source.display(), connection = %dev, ?pids, "watching the FUSE daemon");
                    *known = Known::Served;
                    continue;
                }
                Ok(_) if left.is_empty() => {
                    debug!(source = %source.display(), connection = %dev, tries, "no process holds the connection yet");
                    if exact {
                        verdicts.unheld.push((source.clone(), dev));
                    }
                }
                Ok(_) => {
                    let holders: Vec<u32> = left.iter().map(|process| process.pid).collect();
                    debug!(source = %source.display(), connection = %dev, ?holders, tries, "no new process serves the connection yet")
                }
                Err(err) => {
                    warn!(source = %source.display(), connection = %dev, %err, "cannot tell which process serves the source")
                }
            }
            let execs = self.watcher.backend() == Backend::ProcConnector;
            let limit = if left.is_empty() { UNSERVED_RETRIES } else { SUCCESSOR_RETRIES };
            let retry_at = (tries < limit).then(|| now + Duration::from_millis(100) * (1 << tries));
            if tries == limit {
                let again =
                    if execs { "when a process starts" } else { "never: its end is seen when a new mount appears" };
                if left.is_empty() {
                    info!(source = %source.display(), connection = %dev, again, "no daemon found for the source");
                } else {
                    let holders: Vec<u32> = left.iter().map(|process| process.pid).collect();
                    info!(source = %source.display(), connection = %dev, ?holders, again, "no new process serves the connection; its holders stay watched");
                }
            }
            *known = Known::Unserved { left, tries, retry_at };
        }
        self.update_exec_interest();
        verdicts
    }

    /// Whether the connection numbered `dev` is still the one seen at its
    /// source. Asked once a discovery is over: a connection that is there
    /// both when first seen and after the `/proc` scan was there all along
    /// (a number is not given again while its connection lives), so the
    /// holders the scan found are its own. Where either look found no
    /// `fusectl` directory (none readable, or gone by then), the number
    /// alone tells.
    fn same_connection(&self, dev: Dev) -> bool {
        let Some(Some(seen)) = self.identities.get(&dev) else { return true };
        self.connections.inode_of(dev).is_none_or(|now| now == *seen)
    }

    /// Stops watching `processes` as holders of `dev`.
    fn let_go(&self, processes: &[ProcessId], dev: Dev) {
        for process in processes {
            if remove_holder(&self.holders, *process, dev) {
                self.watcher.unwatch(process.pid);
            }
        }
    }

    /// An exec somewhere: worth a discovery if a connection has no daemon.
    pub fn exec_seen(&mut self) {
        let now = Instant::now();
        let spaced = self.last_exec_discovery.is_none_or(|last| now >= last + EXEC_DISCOVERY_SPACING);
        for (_, known) in self.known.values_mut() {
            if let Known::Unserved { retry_at: retry_at @ None, .. } = known {
                // Too soon after the last one: a deadline asks instead, so
                // this exec is not lost.
                *retry_at = (!spaced).then(|| self.last_exec_discovery.unwrap_or(now) + EXEC_DISCOVERY_SPACING);
            }
        }
        if spaced {
            self.last_exec_discovery = Some(now);
            self.retry_unserved(now, true);
        }
    }

    fn retry_unserved(&mut self, now: Instant, on_exec: bool) {
        let due: Vec<(PathBuf, Dev)> = self
            .known
            .iter()
            .filter(|(_, (_, known))| match known {
                Known::Unserved { retry_at: Some(at), .. } => *at <= now,
                Known::Unserved { retry_at: None, .. } => on_exec,
                _ => false,
            })
            .map(|(dev, (path, _))| (path.clone(), *dev))
            .collect();
        // Keep the count of tries across the new request.
        for (_, dev) in &due {
            if let Some((_, Known::Unserved { retry_at, .. })) = self.known.get_mut(dev) {
                *retry_at = None;
            }
        }
        if let Some(requests) = &self.requests
            && !due.is_empty()
            && requests.send(due).is_err()
        {
            warn!("daemon discovery thread is gone; new daemons are not watched");
        }
    }

    fn update_exec_interest(&self) {
        let unserved = self.known.values().any(|(_, known)| matches!(known, Known::Unserved { retry_at: None, .. }));
        self.want_exec.store(unserved, Ordering::Relaxed);
    }

    /// Whether `--detach-dead-sources` is on.
    pub fn detaches_dead_sources(&self) -> bool {
        self.options.detach_dead_sources
    }

    /// Whether `--abort-dead-connections` is on.
    pub fn aborts(&self) -> bool {
        self.options.abort_dead_connections
    }

    /// The earliest discovery retry or orphan check ahead.
    pub fn next_deadline(&self) -> Option<Instant> {
        let retries = self.known.values().filter_map(|(_, known)| match known {
            Known::Unserved { retry_at, .. } => *retry_at,
            _ => None,
        });
        retries.chain(self.orphans.values().map(|orphan| orphan.check_at)).min()
    }

    /// Runs what is due: discovery retries, and orphan checks, returning the
    /// connections aborted.
    pub fn on_deadline(&mut self) -> Vec<Aborted> {
        let now = Instant::now();
        self.retry_unserved(now, false);
        self.update_exec_interest();
        let due: Vec<Dev> =
            self.orphans.iter().filter(|(_, orphan)| orphan.check_at <= now).map(|(dev, _)| *dev).collect();
        let mut aborted = Vec::new();
        for dev in due {
            if let Some(done) = self.check_orphan(dev, now) {
                aborted.push(done);
            }
        }
        aborted
    }
}

impl Drop for Daemons {
    fn drop(&mut self) {
        // Closing the queue ends the discovery thread after its scan.
        self.requests = None;
        if self.discovery.take().is_some_and(|thread| thread.join().is_err()) {
            warn!("daemon discovery thread panicked");
        }
    }
}

#[cfg(test)]
mod tests;
