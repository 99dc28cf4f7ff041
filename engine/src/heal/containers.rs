//! Healing inside the other mount namespaces of the node: the containers
//! (and any other namespace) that hold a mount of a dead FUSE connection.
//!
//! The host heal reaches a container only by propagation, and only one
//! whose volume is a slave of the target (`mountPropagation:
//! HostToContainer`); the dead copy then stays under the live one, out of
//! reach of any path, pinning the dead connection until the container
//! exits; a container whose volume is private (`None`, the default) is
//! never reached. So, in two steps:
//!
//! 1. **Isolate**, when the daemon's death is seen (before any new mount
//!    exists): find every other namespace holding a mount of the dead
//!    connection (among the node's namespaces kept by events,
//!    [`super::namespaces`], or by a walk of `/proc/*/ns/mnt` without
//!    them) and make each such mount private, so the host heal propagates
//!    nothing into it: no dead layer can end up covered. Right before the
//!    host heal, the namespaces learnt since are isolated too.
//! 2. **Replace**, after the host heal, one thread per namespace, in
//!    parallel: sidecar mode's in-namespace heal
//!    ([`super::in_namespace::heal_in_namespaces`]): clone the new source
//!    (its subdirectory for a subPath) in the watched namespace, give the
//!    clone the mount's old propagation (a slave of the new source for a
//!    slave, private for a private one), enter the container's namespace,
//!    resolve the mount point beneath its root with no symlinks, check it is
//!    still the recorded dead mount (ID and device), slide the clone beneath
//!    it and detach the dead one. The container goes from the dead mount to
//!    the live one in one step and keeps exactly one layer.
//!
//! A namespace whose mount was covered by a live one before it could be
//! isolated (the death was not seen before the new mount) is left to the
//! propagation, with its dead layer under the live one: reported, not hidden.
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fs;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, mpsc};
use std::time::{Duration, Instant};

use fuse_supervisor_sys::mount::{self, Propagation};
use fuse_supervisor_sys::{ns, resolve};

use super::carry::{self, NestedSlot, NotCarried};
use super::in_namespace::{self, HealNamespaces, InNamespaceError, InNamespaceHeal, InNamespaceHealed, LiveSource};
use super::namespace_threads::NamespaceThreads;
use super::nested_copies::{self, NestedCopies};
use super::priority::HealPriority;
use super::probe::SourceHandles;
use crate::errors::chain;
use crate::model::table::{Dev, FuseMount, root_within};
use tracing::debug;

#[derive(Debug, thiserror::Error)]
pub enum ContainerHealError {
    #[error("cannot list the namespaces of {proc_root}")]
    Walk {
        proc_root: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot open the mount namespace of process {pid}")]
    OpenNamespace {
        pid: u32,
        #[source]
        source: io::Error,
    },
    #[error("process {pid} is no longer in mount namespace {expected}")]
    NamespaceGone { pid: u32, expected: u64 },
    #[error("cannot start a thread for the mount namespace of process {pid}")]
    Thread {
        pid: u32,
        #[source]
        source: io::Error,
    },
    #[error("cannot make {path} private in the mount namespace of process {pid}")]
    Isolate {
        pid: u32,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "the mount namespace {namespace} of process {pid} was not done within {deadline_ms} ms; given up for this heal"
    )]
    Deadline { pid: u32, namespace: u64, deadline_ms: u64 },
    #[error(
        "a thread sent into the mount namespace {namespace} of process {pid} by an earlier heal is still held there; given up for this heal"
    )]
    StillHeld { pid: u32, namespace: u64 },
    #[error("{path} in the mount namespace of process {pid} is not under the new source {source_root}")]
    NotUnderSource { pid: u32, path: PathBuf, source_root: PathBuf },
    #[error(transparent)]
    InNamespace(#[from] InNamespaceError),
}

/// A mount of a dead connection in a namespace other than the watched one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForeignMount {
    /// The namespace's inode: its identity.
    pub namespace: u64,
    /// A process in it, through which it is entered.
    pub pid: u32,
    /// As its own table shows it (mount point inside the namespace).
    pub mount: FuseMount,
    /// What the mount's replacement gets: `Slave` if the mount received
    /// the host's mounts (a `HostToContainer` volume), else `Private`.
    pub propagation: Propagation,
    /// The namespace's 64-bit ID (`NS_GET_MNTNS_ID`, Linux 6.11+), which
    /// the kernel never gives another namespace: the inode it is found by
    /// again at the heal is a freed namespace's number (the same inode came
    /// back within three container starts), so the heal checks both. None
    /// where the kernel has no such ID, or the namespace's process had left.
    pub namespace_id: Option<u64>,
    /// The mount's 64-bit unique ID (never reused) where the read gave it:
    /// the heal checks it finds that mount, not one with its reused 32-bit
    /// ID and its device.
    pub unique_id: Option<u64>,
    /// Handles on the mounts made on it (a configMap at `<volume>/config`),
    /// taken when it was isolated: its replacement takes them over.
    pub nested: NestedSlot,
}

impl ForeignMount {
    /// Its unique ID: the one the read gave, else that of the mount `at`
    /// (a handle on it, opened in its namespace) is on.
    fn unique_id_at(&self, at: BorrowedFd<'_>) -> io::Result<u64> {
        self.unique_id.map_or_else(|| resolve::unique_mount_id_of(at), Ok)
    }
}

/// How one foreign mount came out of a heal.
#[derive(Debug)]
pub enum ForeignHealed {
    /// The dead mount was replaced by a clone of the new source: one layer.
    /// `not_carried`: what of the dead mount it could not take over (a
    /// nested mount no handle could be had on, an idmapping).
    Replaced { not_carried: Vec<NotCarried> },
    /// The clone was stacked on the dead mount, which stays under it.
    Stacked { why: io::Error, not_carried: Vec<NotCarried> },
    /// A mount of the new source was on top there already (the host heal
    /// propagated onto it): nothing to do.
    AlreadyLive,
}

/// The mounts of `dead` connections on top at their mount point (a mount
/// under another one at the same point is out of reach), and not inside
/// another dead one (its parent's replacement takes it along). Linear in
/// the table: a tenant decides how many mounts its namespace has.
pub(super) fn dead_tops(mounts: &[FuseMount], dead: &BTreeSet<Dev>) -> Vec<FuseMount> {
    let covered: HashSet<(u32, &Path)> =
        mounts.iter().map(|other| (other.parent_id, other.mount_point.as_path())).collect();
    let dead_ids: HashSet<u32> =
        mounts.iter().filter(|other| dead.contains(&other.dev)).map(|other| other.mount_id).collect();
    mounts
        .iter()
        .filter(|mount| {
            dead.contains(&mount.dev)
                && !covered.contains(&(mount.mount_id, mount.mount_point.as_path()))
                && !dead_ids.contains(&mount.parent_id)
        })
        .cloned()
        .collect()
}

/// Makes every mount of `mounts` private, each namespace on a worker of its
/// own, so that no heal on the host propagates onto them, and takes a
/// handle on each mount made on them (into [`ForeignMount::nested`]) while
/// their mount points still resolve (see [`super::carry`]). Returns the
/// mounts that could not be isolated, with why.
/// A copy taken ahead ([`NestedCopies`]) stands in for a mount on one
/// that could not be copied now.
pub fn isolate(
    mounts: &[ForeignMount],
    workers: &NamespaceWorkers,
    copies: &Arc<NestedCopies>,
) -> Vec<(ForeignMount, ContainerHealError)> {
    let copies = Arc::clone(copies);
    let isolate_all = move |mounts: &[ForeignMount]| -> Vec<(ForeignMount, ContainerHealError)> {
        if let Err(err) = enter_namespace_of(&mounts[0]) {
            let why = err.to_string();
            let err = |foreign: &ForeignMount| ContainerHealError::Isolate {
                pid: foreign.pid,
                path: foreign.mount.mount_point.clone(),
                source: io::Error::other(why.clone()),
            };
            return failed_all(mounts, err, |err| err);
        }
        let mut failed = Vec::new();
        for foreign in mounts {
            let made_private = in_namespace::open_recorded(foreign.pid, &foreign.mount, foreign.unique_id)
                .map_err(ContainerHealError::from)
                .and_then(|stale| {
                    mount::make_private(stale.as_fd()).map_err(|source| ContainerHealError::Isolate {
                        pid: foreign.pid,
                        path: foreign.mount.mount_point.clone(),
                        source,
                    })?;
                    Ok(stale)
                });
            match made_private {
                Ok(stale) => {
                    let unique = foreign.unique_id_at(stale.as_fd());
                    // Without it the heal looks for them, and says what it missed.
                    if let Ok(unique) = unique {
                        let point = &foreign.mount.mount_point;
                        let fresh = carry::take_nested(stale.as_fd(), unique, point, &BTreeSet::new());
                        foreign.nested.put(nested_copies::stand_in(fresh, copies.take(unique), point));
                    }
                }
                Err(err) => failed.push((foreign.clone(), err)),
            }
        }
        failed
    };
    workers.run(by_namespace(mounts), isolate_all, |err| err)
}

/// Moves the calling thread into the namespace of `foreign`.
fn enter_namespace_of(foreign: &ForeignMount) -> Result<(), ContainerHealError> {
    let namespace = open_namespace(foreign)?;
    ns::enter_mount_namespace(namespace.as_fd())
        .map_err(|source| ContainerHealError::OpenNamespace { pid: foreign.pid, source })
}

/// Takes copies ahead of the mounts on `mounts` (mounts of watched
/// connections), each namespace on a worker of its own, without waiting
/// (see [`NestedCopies`]). A namespace that holds a worker already is left:
/// its mounts are copied at the death, if they still resolve then.
pub fn copy_nested_ahead(mounts: &[ForeignMount], workers: &NamespaceWorkers, copies: &Arc<NestedCopies>) {
    for group in by_namespace(mounts) {
        let Some(namespace) = group.first().map(|first| first.namespace) else { continue };
        let copies = Arc::clone(copies);
        let started = workers.start(namespace, move || {
            copy_in_namespace(&group, &copies);
            || {}
        });
        if let Err(err) = started {
            debug!(namespace, err = %chain(&err), "nested mounts not copied ahead in a namespace");
        }
    }
}

/// Copies the mounts on each of `mounts` (all in one namespace), from a
/// worker that enters it.
fn copy_in_namespace(mounts: &[ForeignMount], copies: &NestedCopies) {
    let Some(first) = mounts.first() else { return };
    if let Err(err) = enter_namespace_of(first) {
        debug!(namespace = first.namespace, err = %chain(&err), "cannot enter a namespace to copy its nested mounts");
        return;
    }
    for foreign in mounts {
        let point = &foreign.mount.mount_point;
        let opened = in_namespace::open_recorded(foreign.pid, &foreign.mount, foreign.unique_id)
            .map_err(|err| err.to_string())
            .and_then(|live| {
                let unique = foreign.unique_id_at(live.as_fd()).map_err(|err| err.to_string())?;
                Ok((live, unique))
            });
        let (live, unique) = match opened {
            Ok(opened) => opened,
            Err(err) => {
                debug!(namespace = foreign.namespace, path = %point.display(), %err, "cannot open a volume to copy the mounts on it");
                continue;
            }
        };
        let nested = carry::copy_nested_live(live.as_fd(), unique, point);
        for missed in &nested.missed {
            debug!(namespace = foreign.namespace, path = %missed.mount_point.display(), why = %missed.why, "a nested mount not copied ahead");
        }
        let copied = nested.held.len();
        copies.put(foreign.namespace, unique, nested.held);
        debug!(namespace = foreign.namespace, path = %point.display(), copied, "nested mounts copied ahead");
    }
}

/// Handles on a live source to clone into containers, the probe's: its
/// root, and the subdirectories subPath targets needed, by their path
/// inside it. A container's mount of a subdirectory not among them is
/// cloned from the source opened again.
#[derive(Debug)]
pub struct LiveHandles {
    root: OwnedFd,
    subdirs: BTreeMap<PathBuf, OwnedFd>,
}

impl LiveHandles {
    /// Copies of the probe's handles (a descriptor each); None if the
    /// process is out of descriptors (the source is then opened again).
    pub fn of(handles: &SourceHandles) -> Option<LiveHandles> {
        let subdirs = handles
            .subdirs
            .iter()
            .filter_map(|(path, opened)| opened.as_ref().ok().map(|fd| (path, fd)))
            .map(|(path, fd)| Some((path.clone(), fd.try_clone().ok()?)))
            .collect::<Option<_>>()?;
        Some(LiveHandles { root: handles.root.try_clone().ok()?, subdirs })
    }

    fn for_subdir(&self, subdir: &Path) -> Option<BorrowedFd<'_>> {
        if subdir.as_os_str().is_empty() {
            return Some(self.root.as_fd());
        }
        self.subdirs.get(subdir).map(|fd| fd.as_fd())
    }
}

/// Replaces every mount of `mounts` with a clone of `source` (a live FUSE
/// mount of the namespace `watched` is an fd of; `live` are handles on it
/// the probe opened), of the subdirectory the dead mount showed, each
/// namespace on a worker of its own, all at once.
pub fn replace(
    watched: &Arc<OwnedFd>,
    source: &FuseMount,
    live: Option<LiveHandles>,
    mounts: &[ForeignMount],
    workers: &NamespaceWorkers,
    copies: &Arc<NestedCopies>,
) -> Vec<(ForeignMount, Result<ForeignHealed, ContainerHealError>)> {
    let own_pid = std::process::id();
    let (watched, source, copies) = (Arc::clone(watched), source.clone(), Arc::clone(copies));
    let replace_all = move |mounts: &[ForeignMount]| -> Vec<(ForeignMount, Result<ForeignHealed, ContainerHealError>)> {
        // One worker per namespace: each heal enters the watched namespace
        // and then the container's, so a fresh pair of fds each time.
        mounts
            .iter()
            .map(|foreign| {
                let healed = replace_one(&watched, own_pid, &source, live.as_ref(), foreign, &copies);
                (foreign.clone(), healed)
            })
            .collect()
    };
    workers.run(by_namespace(mounts), replace_all, Err)
}

fn replace_one(
    watched: &OwnedFd,
    own_pid: u32,
    source: &FuseMount,
    live: Option<&LiveHandles>,
    foreign: &ForeignMount,
    copies: &NestedCopies,
) -> Result<ForeignHealed, ContainerHealError> {
    let subdir = root_within(&source.root, &foreign.mount.root).ok_or_else(|| ContainerHealError::NotUnderSource {
        pid: foreign.pid,
        path: foreign.mount.mount_point.clone(),
        source_root: source.root.clone(),
    })?;
    let live = live.and_then(|live| live.for_subdir(&subdir));
    let heal = InNamespaceHeal {
        source: LiveSource { namespace: 0, pid: own_pid, mount: source.clone() },
        subdir,
        namespace: foreign.namespace,
        pid: foreign.pid,
        target: foreign.mount.clone(),
        target_unique_id: foreign.unique_id,
    };
    let source_namespace =
        watched.try_clone().map_err(|source| ContainerHealError::OpenNamespace { pid: own_pid, source })?;
    let namespaces = HealNamespaces::from_fds(source_namespace, open_namespace(foreign)?);
    let nested = foreign.nested.take();
    match in_namespace::heal_in_namespaces(&heal, &namespaces, Some(foreign.propagation), live, nested, Some(copies)) {
        Ok(InNamespaceHealed::Replaced { not_carried }) => Ok(ForeignHealed::Replaced { not_carried }),
        Ok(InNamespaceHealed::Stacked { why, not_carried }) => Ok(ForeignHealed::Stacked { why, not_carried }),
        // The host heal's propagation reached it first: live already.
        Err(InNamespaceError::Changed { found_dev, .. }) if found_dev == source.dev => Ok(ForeignHealed::AlreadyLive),
        Err(err) => Err(err.into()),
    }
}

/// The namespace of `foreign`, through `/proc/<pid>/ns/mnt`, or, if `pid`
/// exited (the walk may have found the namespace through a short-lived
/// process) or is now elsewhere, through any other process still in it:
/// one with its inode and, where the kernel names namespaces, its ID.
pub fn open_namespace(foreign: &ForeignMount) -> Result<OwnedFd, ContainerHealError> {
    let (pid, inode, id) = (foreign.pid, foreign.namespace, foreign.namespace_id);
    let proc_root = Path::new("/proc");
    open_namespace_of(proc_root, pid, inode, id).or_else(|err| {
        let others = fs::read_dir(proc_root)
            .map_err(|source| ContainerHealError::Walk { proc_root: proc_root.to_path_buf(), source })?;
        others
            .flatten()
            .filter_map(|entry| entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()))
            .filter(|other| *other != pid)
            .find_map(|other| open_namespace_of(proc_root, other, inode, id).ok())
            .ok_or(err)
    })
}

/// `<proc_root>/<pid>/ns/mnt`, refused if it is not namespace `inode`, or
/// (when given) has another ID than `id`: another namespace with a freed
/// one's inode.
pub(super) fn open_namespace_of(
    proc_root: &Path,
    pid: u32,
    inode: u64,
    id: Option<u64>,
) -> Result<OwnedFd, ContainerHealError> {
    let path = proc_root.join(pid.to_string()).join("ns/mnt");
    let file = fs::File::open(&path).map_err(|source| ContainerHealError::OpenNamespace { pid, source })?;
    let found = file.metadata().map_err(|source| ContainerHealError::OpenNamespace { pid, source })?.ino();
    let gone = || ContainerHealError::NamespaceGone { pid, expected: inode };
    if found != inode {
        return Err(gone());
    }
    let namespace = OwnedFd::from(file);
    if let Some(id) = id
        && ns::mount_namespace_id(namespace.as_fd()).is_ok_and(|found| found != id)
    {
        return Err(gone());
    }
    Ok(namespace)
}

fn by_namespace(mounts: &[ForeignMount]) -> Vec<Vec<ForeignMount>> {
    let mut grouped: BTreeMap<u64, Vec<ForeignMount>> = BTreeMap::new();
    for foreign in mounts {
        grouped.entry(foreign.namespace).or_default().push(foreign.clone());
    }
    grouped.into_values().collect()
}

/// Every mount of a group that failed as a whole, each with its own error.
fn failed_all<T>(
    mounts: &[ForeignMount],
    err: impl Fn(&ForeignMount) -> ContainerHealError,
    wrap: impl Fn(ContainerHealError) -> T,
) -> Vec<(ForeignMount, T)> {
    mounts.iter().map(|foreign| (foreign.clone(), wrap(err(foreign)))).collect()
}

/// How long a heal waits for each namespace unless told otherwise
/// (`--container-deadline`): an isolation or a replacement takes
/// milliseconds (about 100 among 100 busy containers on two CPUs).
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(1);

/// The threads that enter other mount namespaces, and how long a heal waits
/// for them.
///
/// Whatever a tenant does in its namespace, a worker there may be held in
/// the kernel for good (a FUSE request its server never answers cannot be
/// interrupted, not even by SIGKILL). So the caller waits for each
/// namespace's worker until the deadline only; a namespace not done by
/// then is given up on for this heal (reported), and its worker is left
/// behind: it ends whenever the kernel lets it. While it is held, no other
/// worker is sent into that namespace, so a hostile tenant costs one thread
/// and never more. At the heal priority: among 100 busy containers on two
/// CPUs, each worker waited for a CPU behind the containers' shells. The
/// workers are threads kept between heals (`heal::namespace_threads`).
#[derive(Clone)]
pub struct NamespaceWorkers {
    priority: HealPriority,
    deadline: Duration,
    occupied: Arc<Mutex<Occupied>>,
    when_free: Arc<OnceLock<FreeNotify>>,
    threads: Arc<NamespaceThreads>,
}

/// The namespaces (by inode) a worker is in now, and those of them whose
/// heal was given up on (the worker late, or one still there): `when_free`
/// hears of these once their worker ends, so that the heal is tried again
/// then rather than at the source's next heal.
#[derive(Debug, Default)]
struct Occupied {
    busy: BTreeSet<u64>,
    late: BTreeSet<u64>,
}

/// Hears a namespace (by inode) whose given-up heal can be tried again.
pub type FreeNotify = Box<dyn Fn(u64) + Send + Sync>;

impl std::fmt::Debug for NamespaceWorkers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NamespaceWorkers").field("deadline", &self.deadline).field("occupied", &self.occupied).finish()
    }
}

/// Takes a namespace off the busy list when its worker ends, panicking or
/// not, and tells `when_free` if its heal was given up on.
struct BusyUntilDropped {
    workers: NamespaceWorkers,
    namespace: u64,
}

impl Drop for BusyUntilDropped {
    fn drop(&mut self) {
        let late = {
            let mut occupied = self.workers.occupied();
            occupied.busy.remove(&self.namespace);
            occupied.late.remove(&self.namespace)
        };
        if late {
            self.workers.tell_free(self.namespace);
        }
    }
}

/// Why no worker went into a namespace.
#[derive(Debug, thiserror::Error)]
enum Unstarted {
    #[error("a worker is there still")]
    StillHeld,
    #[error("cannot start a worker thread")]
    Thread(#[source] io::Error),
}

impl NamespaceWorkers {
    pub fn new(priority: HealPriority, deadline: Duration) -> Self {
        NamespaceWorkers {
            priority,
            deadline,
            occupied: Arc::default(),
            when_free: Arc::default(),
            threads: NamespaceThreads::new(priority),
        }
    }

    /// `notify` hears each namespace whose given-up heal can be tried again:
    /// its worker ended. Set once; later calls change nothing.
    pub fn when_free(&self, notify: FreeNotify) {
        let _ = self.when_free.set(notify);
    }

    fn occupied(&self) -> std::sync::MutexGuard<'_, Occupied> {
        self.occupied.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The heal in `namespace` was given up on: tried again once its worker
    /// ends, or now if it ended meanwhile.
    fn mark_late(&self, namespace: u64) {
        let mut occupied = self.occupied();
        if occupied.busy.contains(&namespace) {
            occupied.late.insert(namespace);
            return;
        }
        drop(occupied);
        self.tell_free(namespace);
    }

    fn tell_free(&self, namespace: u64) {
        if let Some(notify) = self.when_free.get() {
            notify(namespace);
        }
    }

    pub fn priority(&self) -> HealPriority {
        self.priority
    }

    /// How many namespaces hold a worker now (each at most one).
    pub fn busy(&self) -> usize {
        self.occupied().busy.len()
    }

    /// Starts `work` on a worker of `namespace` unless one is there
    /// already, and does not wait for it. What `work` returns runs once the
    /// namespace is free again (so a caller told of the end may send
    /// another worker there at once).
    fn start<W, Then>(&self, namespace: u64, work: W) -> Result<(), Unstarted>
    where
        W: FnOnce() -> Then + Send + 'static,
        Then: FnOnce(),
    {
        if !self.occupied().busy.insert(namespace) {
            return Err(Unstarted::StillHeld);
        }
        let leaving = BusyUntilDropped { workers: self.clone(), namespace };
        // The worker's lines read as part of what sent it (a heal, a death).
        let span = tracing::info_span!("namespace", namespace);
        self.threads
            .submit(Box::new(move || {
                let _span = span.entered();
                let then = work();
                drop(leaving);
                then();
            }))
            .map_err(Unstarted::Thread)
    }

    /// Runs `work` on each group (the mounts of one namespace) on a worker of
    /// its own, and collects what finished by the deadline; the rest, and a
    /// group whose namespace still holds a worker or whose worker cannot
    /// start or panics, are failed through `wrap`.
    fn run<T, F>(
        &self,
        groups: Vec<Vec<ForeignMount>>,
        work: F,
        wrap: impl Fn(ContainerHealError) -> T,
    ) -> Vec<(ForeignMount, T)>
    where
        T: Send + 'static,
        F: Fn(&[ForeignMount]) -> Vec<(ForeignMount, T)> + Send + Sync + 'static,
    {
        let work = Arc::new(work);
        let (done, finished) = mpsc::channel();
        let mut outcomes = Vec::new();
        let mut pending: BTreeMap<usize, Vec<ForeignMount>> = BTreeMap::new();
        for (index, group) in groups.into_iter().enumerate() {
            let Some(first) = group.first() else { continue };
            let namespace = first.namespace;
            let (work, done, mounts) = (Arc::clone(&work), done.clone(), group.clone());
            let started = self.start(namespace, move || {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(&mounts)));
                // The caller may have stopped waiting: nobody to tell then.
                move || {
                    let _ = done.send((index, result.ok()));
                }
            });
            match started {
                Ok(()) => {
                    pending.insert(index, group);
                }
                Err(Unstarted::StillHeld) => {
                    let held = |foreign: &ForeignMount| ContainerHealError::StillHeld { pid: foreign.pid, namespace };
                    outcomes.extend(failed_all(&group, held, &wrap));
                    self.mark_late(namespace);
                }
                Err(Unstarted::Thread(err)) => {
                    let message = err.to_string();
                    let failed = |foreign: &ForeignMount| ContainerHealError::Thread {
                        pid: foreign.pid,
                        source: io::Error::other(message.clone()),
                    };
                    outcomes.extend(failed_all(&group, failed, &wrap));
                }
            }
        }
        drop(done);
        let until = Instant::now() + self.deadline;
        while !pending.is_empty() {
            let Ok((index, result)) = finished.recv_timeout(until.saturating_duration_since(Instant::now())) else {
                break;
            };
            let Some(group) = pending.remove(&index) else { continue };
            match result {
                Some(done) => outcomes.extend(done),
                None => {
                    let panicked = |foreign: &ForeignMount| ContainerHealError::Thread {
                        pid: foreign.pid,
                        source: io::Error::other("the thread panicked"),
                    };
                    outcomes.extend(failed_all(&group, panicked, &wrap));
                }
            }
        }
        let deadline_ms = self.deadline.as_millis() as u64;
        for group in pending.into_values() {
            if let Some(first) = group.first() {
                self.mark_late(first.namespace);
            }
            let late = |foreign: &ForeignMount| ContainerHealError::Deadline {
                pid: foreign.pid,
                namespace: foreign.namespace,
                deadline_ms,
            };
            outcomes.extend(failed_all(&group, late, &wrap));
        }
        outcomes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::table::Snapshot;

    fn fuse(mount_id: u32, parent_id: u32, minor: u32, point: &str, root: &str) -> FuseMount {
        FuseMount {
            mount_id,
            parent_id,
            dev: Dev { major: 0, minor },
            root: root.into(),
            mount_point: point.into(),
            peer_group: None,
            master: None,
            fs_type: "fuse.bindfs".into(),
            source: "x".into(),
            table_order: mount_id,
        }
    }

    fn foreign(namespace: u64, mount_id: u32) -> ForeignMount {
        ForeignMount {
            namespace,
            pid: 7,
            mount: fuse(mount_id, 1, 50, "/data", "/"),
            propagation: Propagation::Private,
            namespace_id: None,
            unique_id: None,
            nested: NestedSlot::default(),
        }
    }

    #[test]
    fn a_namespace_that_misses_the_deadline_is_given_up_sent_nothing_more_and_told_free_when_its_worker_ends() {
        let workers = NamespaceWorkers::new(HealPriority::OFF, Duration::from_millis(50));
        let (told, free) = mpsc::channel::<u64>();
        workers.when_free(Box::new(move |namespace| {
            let _ = told.send(namespace);
        }));
        let (release, held) = mpsc::channel::<()>();
        let held = Arc::new(Mutex::new(held));
        // Namespace 1's worker is held (as by a FUSE request nobody
        // answers); namespace 2's is not.
        let work = move |mounts: &[ForeignMount]| -> Vec<(ForeignMount, Result<(), ContainerHealError>)> {
            if mounts[0].namespace == 1 {
                let _ = held.lock().unwrap().recv();
            }
            mounts.iter().map(|foreign| (foreign.clone(), Ok(()))).collect()
        };
        type Work = dyn Fn(&[ForeignMount]) -> Vec<(ForeignMount, Result<(), ContainerHealError>)> + Send + Sync;
        let work: Arc<Work> = Arc::new(work);
        let run = |work: &Arc<Work>| {
            let work = Arc::clone(work);
            let mut outcomes = workers.run(
                vec![vec![foreign(1, 10), foreign(1, 11)], vec![foreign(2, 20)]],
                move |mounts: &[ForeignMount]| work(mounts),
                Err,
            );
            outcomes.sort_by_key(|(foreign, _)| foreign.mount.mount_id);
            outcomes
        };
        let first = run(&work);
        assert!(matches!(first[0].1, Err(ContainerHealError::Deadline { namespace: 1, deadline_ms: 50, .. })));
        assert!(matches!(first[1].1, Err(ContainerHealError::Deadline { namespace: 1, .. })));
        assert!(first[2].1.is_ok(), "the other namespace is healed: {:?}", first[2].1);
        assert_eq!(workers.busy(), 1);

        // Still held: nothing more is sent there, the rest goes on.
        let second = run(&work);
        assert!(matches!(second[0].1, Err(ContainerHealError::StillHeld { namespace: 1, .. })));
        assert!(second[2].1.is_ok());
        assert_eq!(workers.busy(), 1, "no second worker in the held namespace");

        assert!(free.try_recv().is_err(), "told free while its worker is held");

        // Once its worker is let go, the heal given up on is told of it,
        // once, and the namespace is worked again.
        release.send(()).unwrap();
        assert_eq!(free.recv_timeout(Duration::from_secs(10)), Ok(1));
        assert_eq!(workers.busy(), 0);
        release.send(()).unwrap();
        let third = run(&work);
        assert!(third.iter().all(|(_, outcome)| outcome.is_ok()), "{third:?}");
        assert!(free.try_recv().is_err(), "told free twice, or for a heal not given up on");
    }

    /// A namespace with the recorded inode but another ID is one that got a
    /// freed namespace's inode: not the one the mount was found in.
    #[test]
    fn a_namespace_is_known_again_by_its_inode_and_its_id() {
        let proc_root = Path::new("/proc");
        let pid = std::process::id();
        let inode = fs::metadata("/proc/self/ns/mnt").unwrap().ino();
        let own = open_namespace_of(proc_root, pid, inode, None).expect("this process's namespace");
        let Ok(id) = ns::mount_namespace_id(own.as_fd()) else {
            panic!("this kernel names no mount namespace by ID (NS_GET_MNTNS_ID, Linux 6.11+)")
        };
        assert!(open_namespace_of(proc_root, pid, inode, Some(id)).is_ok());
        let reused = open_namespace_of(proc_root, pid, inode, Some(id + 1));
        assert!(matches!(reused, Err(ContainerHealError::NamespaceGone { .. })), "{reused:?}");
        let other_inode = open_namespace_of(proc_root, pid, inode + 1, None);
        assert!(matches!(other_inode, Err(ContainerHealError::NamespaceGone { .. })), "{other_inode:?}");
    }

    #[test]
    fn a_worker_that_panics_fails_its_namespace_only() {
        let workers = NamespaceWorkers::new(HealPriority::OFF, Duration::from_secs(60));
        let work = |mounts: &[ForeignMount]| -> Vec<(ForeignMount, Result<(), ContainerHealError>)> {
            assert_ne!(mounts[0].namespace, 1, "a bug in one namespace's work");
            mounts.iter().map(|foreign| (foreign.clone(), Ok(()))).collect()
        };
        let mut outcomes = workers.run(vec![vec![foreign(1, 10)], vec![foreign(2, 20)]], work, Err);
        outcomes.sort_by_key(|(foreign, _)| foreign.mount.mount_id);
        assert!(matches!(outcomes[0].1, Err(ContainerHealError::Thread { pid: 7, .. })));
        assert!(outcomes[1].1.is_ok());
        assert_eq!(workers.busy(), 0);
    }

    #[test]
    fn only_uncovered_dead_mounts_outside_other_dead_ones_are_healed() {
        let dead = BTreeSet::from([Dev { major: 0, minor: 50 }]);
        let snapshot = Snapshot {
            fuse_mounts: vec![
                fuse(10, 1, 50, "/volume", "/"),
                // Inside the dead /volume: goes with it.
                fuse(11, 10, 50, "/volume/sub", "/sub"),
                // Dead, covered by a live mount at the same point.
                fuse(12, 1, 50, "/other", "/"),
                fuse(13, 12, 60, "/other", "/"),
                // Live.
                fuse(14, 1, 60, "/live", "/"),
                fuse(15, 1, 50, "/subpath", "/sub"),
            ],
            total_mounts: 20,
        };
        let ids: Vec<u32> = dead_tops(&snapshot.fuse_mounts, &dead).iter().map(|mount| mount.mount_id).collect();
        assert_eq!(ids, [10, 15]);
    }
}
