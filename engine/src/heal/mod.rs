//! Carrying out a heal plan in the watched mount namespace.
//!
//! docs/heal.md, "The heal, step by step": stack the new source onto each stale
//! target so running containers (slaves of the target's peer group) receive
//! it, skip targets a previous stack already reached by propagation, then
//! flatten so the host keeps exactly one layer per target. Every mount call
//! goes through an fd that was resolved without symlinks (beneath the kubelet
//! root, for everything under it) and checked to be, at that moment, the
//! mount the plan recorded.
use std::collections::BTreeSet;
use std::ops::Bound;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use fuse_supervisor_sys::mount::MountAttributes;
use fuse_supervisor_sys::{fds, mount, ns, resolve};
use tracing::{debug, info, warn};

use crate::errors::chain;
use crate::heal::priority::HealPriority;
use crate::heal::probe::SourceHandles;
use crate::model::table::{Dev, FuseMount};
use crate::plan::{HealBatch, TargetHeal};

/// How a container's copy of a target follows the host's (the container
/// heal's outcome names it).
pub use fuse_supervisor_sys::mount::Propagation;

pub mod carry;
pub mod connections;
pub mod containers;
mod dead_source;
pub mod fuse_calls;
pub mod in_namespace;
mod isolations;
mod let_go;
mod mounter;
mod namespace_threads;
pub mod namespaces;
pub mod nested_copies;
mod pool;

use let_go::LetGoOnDrop;
use mounter::{Mounter, Placed, Staging};
pub mod priority;
pub mod probe;

use pool::{FLATTEN_THREADS, FlattenJob, FlattenPool, TARGETS_PER_FLATTEN_THREAD};

#[derive(Debug, thiserror::Error)]
pub enum HealError {
    #[error("target {path} is not an absolute path")]
    NotAbsolute { path: PathBuf },
    #[error("cannot resolve target {path} without symlinks")]
    Resolve {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("target {path} changed since it was planned (mount {found}, planned {planned})")]
    Changed { path: PathBuf, planned: u32, found: u32 },
    #[error(
        "target {path} changed since it was planned: its mount ID {mount_id} is now another mount's (device {found}, planned {planned})"
    )]
    Reused { path: PathBuf, mount_id: u32, planned: Dev, found: Dev },
    #[error("no handle on {root} inside the source for target {path}")]
    NoSourceRoot { path: PathBuf, root: PathBuf },
    #[error("subdirectory {root} of the source cannot be opened beneath it for target {path}")]
    SourceRootRefused {
        path: PathBuf,
        root: PathBuf,
        #[source]
        source: Arc<std::io::Error>,
    },
    #[error(
        "not enough descriptors to heal target {path}: its batch of {targets} targets needs {needed} at once, and nothing was mounted; retried"
    )]
    Descriptors {
        path: PathBuf,
        targets: usize,
        needed: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read the attributes of the stale layer of target {path}")]
    Attributes {
        path: PathBuf,
        #[source]
        source: carry::CarryError,
    },
    #[error("{step} failed for target {path}")]
    Mount {
        step: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl HealError {
    /// Whether it failed for want of a descriptor (the process's open-file
    /// limit, or the system's): a heal that meets one anywhere is put off
    /// whole, before any mount change.
    pub fn lacks_descriptors(&self) -> bool {
        let source = match self {
            HealError::Descriptors { .. } => return true,
            HealError::Resolve { source, .. } | HealError::Mount { source, .. } => source,
            _ => return false,
        };
        fds::out_of_descriptors(source)
    }

    /// The error of mount step `step` on `path`, for `map_err` (the path is
    /// copied only when the step fails).
    fn mount<'a>(step: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> HealError + 'a {
        move |source| HealError::Mount { step, path: path.to_path_buf(), source }
    }
}

/// What happened to one target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Healed {
    /// The new source was stacked onto it.
    Stacked,
    /// A stack on a peer reached it by propagation.
    Propagated,
}

#[derive(Debug)]
pub struct TargetOutcome {
    pub path: PathBuf,
    pub result: Result<Healed, HealError>,
    /// Stale layers removed from the host by flattening.
    pub layers_removed: usize,
    /// Flattening failed: healed, but stale layers remain.
    pub flatten_error: Option<HealError>,
}

/// Handles on each target's planned top, taken before the first stack
/// covers them (in batch order; each checked against the plan when taken).
/// Taking them needs nothing from the source, so it is done while the
/// source's probe waits for its daemon.
#[derive(Debug, Default)]
pub struct Prepared {
    stale: Vec<Result<OwnedFd, HealError>>,
}

impl Prepared {
    /// Whether it was prepared for a batch of `targets` targets.
    fn fits(&self, targets: usize) -> bool {
        self.stale.len() == targets
    }

    /// Whether it holds nothing (prepared for no target, or let go).
    pub fn is_empty(&self) -> bool {
        self.stale.is_empty()
    }
}

/// Carries out heal batches. The real one mounts; tests record.
pub trait Executor {
    /// What a heal of `batch` can do before its source answers. `held` are
    /// handles already taken on targets' planned tops, in batch order (None,
    /// or missing at the end, where there is none): the rest are opened.
    fn prepare(&self, batch: &HealBatch, held: Vec<Option<OwnedFd>>) -> Prepared;

    /// Heals `batch` from `source`; `prepared` is what [`Executor::prepare`]
    /// returned for this batch, or empty (then it is done here).
    fn heal(&mut self, batch: &HealBatch, prepared: Prepared, source: &SourceHandles) -> Vec<TargetOutcome>;

    /// Resolves a target as the executor would for a heal, returning an
    /// O_PATH handle on it and the ID of the mount on top.
    fn open_target(&self, path: &Path) -> Result<(OwnedFd, u32), HealError>;

    /// Removes the stale layers under a target that a mount over its stale
    /// source healed by propagation. `stale` is a handle on the stale layer
    /// taken when its daemon died, before the new mount covered it (no path
    /// reaches it now); `target.top_mount_id` is the propagated new top.
    /// Returns the number of layers removed.
    fn flatten_covered(&mut self, target: &TargetHeal, stale: OwnedFd) -> Result<usize, HealError>;

    /// Like [`Executor::flatten_covered`] without a handle on the covered
    /// layers: they are reached once the top is parked, which the kernel
    /// allows only when the layer under the top is private (a heal cut
    /// short after its stacks left it so; a daemon's mount over its stale
    /// source leaves it shared, and the move is refused). Returns the
    /// number of layers removed.
    fn flatten_covered_unheld(&mut self, _target: &TargetHeal) -> Result<usize, HealError> {
        Ok(0)
    }

    /// Detaches the mount on top of `source` if it is on the dead
    /// connection `dead`: the source's own dead mount, never a target (its
    /// binds are other mounts and stay). Returns whether it detached one.
    fn detach_dead_source(&mut self, source: &Path, dead: Dev) -> Result<bool, HealError>;

    /// When connection `dev` died, before any new mount exists: records the
    /// mounts of it in other mount namespaces (containers) and makes them
    /// private, so the host heal propagates nothing onto them (see
    /// [`containers`]). Returns how many namespaces and mounts it found,
    /// and the mounts it could not isolate. None where the executor does
    /// not see other namespaces, or has isolated these already.
    fn isolate_containers(&mut self, _dev: Dev) -> Option<Isolated> {
        None
    }

    /// After the host heal of a batch from `source`: replaces the mounts of
    /// the `dead` connections in other namespaces with clones of `source`,
    /// in parallel, and says how each went. Called after every heal, with
    /// no dead connection too.
    /// `live` are the handles the source's probe opened, when there was one:
    /// the heals clone those rather than open the source again.
    fn heal_containers(
        &mut self,
        _dead: &BTreeSet<Dev>,
        _source: &FuseMount,
        _live: Option<&SourceHandles>,
    ) -> Vec<ContainerOutcome> {
        Vec::new()
    }

    /// Heals `mounts` again, whose heal from `source` failed before.
    fn retry_containers(&mut self, _mounts: &[containers::ForeignMount], _source: &FuseMount) -> Vec<ContainerOutcome> {
        Vec::new()
    }

    /// The watched sources are on `connections` now: the mounts nested in
    /// containers' mounts of them are copied ahead (see [`nested_copies`]).
    fn watch_connections(&mut self, _connections: BTreeSet<Dev>) {}

    /// `notify` hears each namespace (by inode) whose container heal was
    /// given up on (its worker late, or one still there) once its worker
    /// ended: the heal can be tried again then.
    fn when_namespace_free(&mut self, _notify: containers::FreeNotify) {}
}

/// What a batch's stacks need of each target before the first: the handle
/// on its stale top, and that top's own attributes, which its new mount
/// gets.
struct Stacking {
    stale: Vec<Result<OwnedFd, HealError>>,
    attributes: Vec<Result<MountAttributes, HealError>>,
}

/// A target healed by a clone slid in beneath its stale top.
struct SlidIn {
    stale_unique_id: Option<u64>,
}

/// The generations of namespaces learnt after `generation` (all of them
/// when None).
fn after(generation: Option<u64>) -> (Bound<u64>, Bound<u64>) {
    (generation.map_or(Bound::Unbounded, Bound::Excluded), Bound::Unbounded)
}

/// The mount ID of a target's new top, which a slide put under its stale
/// layer.
fn new_top_id(target: &TargetHeal, new_top: std::os::fd::BorrowedFd<'_>) -> Result<u32, HealError> {
    resolve::mount_id_of(new_top).map_err(|source| HealError::Resolve { path: target.path.clone(), source })
}

/// Whether the mount with unique ID `unique` is still in this namespace
/// (an ID is never reused): true where the kernel does not say.
fn still_attached(unique: u64) -> bool {
    use fuse_supervisor_sys::statmount;
    !matches!(statmount::mount_attributes(unique, statmount::Namespace::Current), Err(err) if err.kind() == std::io::ErrorKind::NotFound)
}

/// Which targets of a batch get a clone of the source slid in beneath their
/// stale top, each taken out of its peer group here, before any stack: on
/// a kernel that slides, every target with one stale layer but the first
/// on each root in the source. Those first ones are stacked onto: their
/// stack propagates to the slaves of the group, which are the copies in
/// containers the death's search did not find (and so did not isolate),
/// while the targets out of the group receive nothing. A slid-in target
/// takes one mount call where a propagated copy takes three (the copy,
/// its park, its slide), and its clone gets its own attributes.
///
/// A target made private keeps its slaves in the group: the kernel hands
/// them to a peer with the same root where there is one.
///
/// Each slid-in target comes with its stale top's unique mount ID, where the
/// kernel tells it: once the batch's first detach has taken the layers by
/// propagation, asking for that ID says whether this one went too, which
/// costs far less than resolving the target again.
fn slid_in_directly(
    batch: &HealBatch,
    stale: &[Result<OwnedFd, HealError>],
    slides_in: &[bool],
) -> Vec<Option<SlidIn>> {
    batch
        .targets
        .iter()
        .zip(stale)
        .zip(slides_in)
        .map(|((target, stale), slides_in)| {
            let (Ok(stale), true) = (stale, *slides_in) else { return None };
            match mount::make_private(stale.as_fd()) {
                Ok(()) => Some(SlidIn { stale_unique_id: resolve::unique_mount_id_of(stale.as_fd()).ok() }),
                Err(err) => {
                    debug!(target = %target.path.display(), err = %chain(&err), "cannot take the target out of its peer group: stacked onto instead");
                    None
                }
            }
        })
        .collect()
}

/// Which targets [`slid_in_directly`] slides in, decided before anything is
/// changed (the descriptors a heal reserves depend on it).
fn to_slide_in(batch: &HealBatch, stale: &[Result<OwnedFd, HealError>], mount_beneath: bool) -> Vec<bool> {
    let mut stacked_roots = BTreeSet::new();
    batch
        .targets
        .iter()
        .zip(stale)
        .map(|(target, stale)| {
            if stale.is_err() || !mount_beneath {
                return false;
            }
            let first_on_root = stacked_roots.insert(target.root_in_source.as_path());
            target.layer_ids.len() == 1 && !first_on_root
        })
        .collect()
}

/// Reads each stale top's attributes (from its mount, never its dead
/// filesystem), and takes out of the peer group, before any stack, every
/// stacked target (not `direct`) whose attributes differ from the first
/// stacked one's.
///
/// A stack on one target propagates a copy onto every peer still in the
/// group, and a copy has the attributes of the mount it copies, not those
/// of the layer it lands on: a target the driver published read-only
/// (bind, then remount `ro`) would come back writable the instant a stack
/// on a writable peer reached it, before anything could set it read-only
/// again. So the first target's stack, with its attributes, reaches only
/// the peers with the same ones; each other one, private by then, gets its
/// own stack with its own attributes, set on the detached clone: no
/// process ever sees any target with attributes it did not have. (Its
/// containers' copies, isolated at the death and healed in their own
/// namespaces, never depended on that propagation.) A slid-in target is
/// out of the group already, and its clone gets its own attributes.
fn own_stacks_where_attributes_differ(
    batch: &HealBatch,
    prepared: Prepared,
    direct: &[Option<SlidIn>],
    mount_beneath: bool,
) -> Stacking {
    let attributes: Vec<Result<MountAttributes, HealError>> = batch
        .targets
        .iter()
        .zip(&prepared.stale)
        .zip(direct)
        .map(|((target, stale), direct)| match stale {
            Ok(stale) => {
                let unique = direct.as_ref().and_then(|direct| direct.stale_unique_id);
                carry::attributes_of(stale.as_fd(), target.top_mount_id, unique, None)
                    .map_err(|source| HealError::Attributes { path: target.path.clone(), source })
            }
            Err(_) => Ok(MountAttributes::default()),
        })
        .collect();
    let stacked = || {
        batch.targets.iter().zip(&prepared.stale).zip(&attributes).zip(direct).filter(|(_, direct)| direct.is_none())
    };
    let first = stacked().find_map(|(((_, stale), attributes), _)| match (stale, attributes) {
        (Ok(_), Ok(attributes)) => Some(*attributes),
        _ => None,
    });
    for (((target, stale), attributes), _) in stacked() {
        let (Ok(stale), Ok(attributes), Some(first)) = (stale, attributes, first) else { continue };
        if attributes.carried() == first.carried() {
            continue;
        }
        match mount::make_private(stale.as_fd()) {
            Ok(()) => debug!(
                target = %target.path.display(),
                attributes = attributes.bits(),
                peers = first.bits(),
                "its attributes differ from its peers': healed by its own stack, not by propagation"
            ),
            // Its stack then fails to tell its copy from its own: see
            // `Mounter::stack`, which sets the copy's attributes.
            Err(err) => {
                warn!(target = %target.path.display(), err = %chain(&err), "cannot take a target whose attributes differ from its peers' out of their group")
            }
        }
    }
    // A target slid beneath its stale layer says so when that layer is
    // detached ([`Mounter::detach_slid`]): only where no peer's detach took
    // it, which is where something is mounted on it.
    for (((target, stale), _), _) in stacked() {
        if let Ok(stale) = stale
            && !(mount_beneath && target.layer_ids.len() == 1)
        {
            warn_of_mounts_on_stale_layer(target, stale.as_fd());
        }
    }
    Stacking { stale: prepared.stale, attributes }
}

/// Says which mounts were made on a target's stale layer on the host
/// (under the pod's volume): the flatten detaches them with it. Moving
/// them onto the new top would propagate a copy to every peer of the new
/// source, on top of the copies the peers' own layers held, so a host heal
/// does not carry them (docs/heal.md, "What a heal preserves"); containers' own
/// nested mounts are carried by their heal.
fn warn_of_mounts_on_stale_layer(target: &TargetHeal, stale: std::os::fd::BorrowedFd<'_>) {
    let Ok(unique) = resolve::unique_mount_id_of(stale) else { return };
    let Ok(children) = fuse_supervisor_sys::listmount::children(unique, 64) else { return };
    let on_it: Vec<String> = children
        .into_iter()
        .filter_map(|child| {
            fuse_supervisor_sys::statmount::mount_stat(child, fuse_supervisor_sys::statmount::Namespace::Current).ok()
        })
        .filter(|stat| stat.parent_unique_id == unique)
        .map(|stat| stat.mount_point.display().to_string())
        .collect();
    if !on_it.is_empty() {
        warn!(target = %target.path.display(), mounts = ?on_it, "mounts on the target's stale layer on the host are not carried over by its heal: they go with it");
    }
}

/// Descriptors a stack opens at once: the target resolved, the source's
/// clone. Each is kept to the flatten, and a copy of the stale layer's
/// handle too (the pin).
const DESCRIPTORS_PER_STACK: usize = 2;
/// Held at once by each flattening thread (the target resolved again, the
/// layer under the parked top), and a few for the loop's own.
const DESCRIPTORS_PER_FLATTEN_THREAD: usize = 2;
const DESCRIPTORS_SPARE: usize = 4;

/// Descriptors set aside for a heal, given back a few at a time as it opens
/// its own, so that no other thread of the process takes them meanwhile.
#[derive(Debug)]
struct Reserve(Vec<OwnedFd>);

impl Reserve {
    fn release(&mut self, count: usize) {
        self.0.truncate(self.0.len().saturating_sub(count));
    }
}

/// What [`Executor::isolate_containers`] did.
#[derive(Debug, Default)]
pub struct Isolated {
    pub namespaces: usize,
    pub mounts: usize,
    pub failed: Vec<(containers::ForeignMount, containers::ContainerHealError)>,
    /// Namespaces whose tables were read to find them.
    pub read: usize,
    /// Whether `/proc` was walked for them (the known namespaces are not
    /// kept by events).
    pub walked: bool,
    /// How long finding them took, of the whole.
    pub searched_us: u64,
}

/// How one mount in another namespace came out of a heal.
pub type ContainerOutcome =
    (containers::ForeignMount, Result<containers::ForeignHealed, containers::ContainerHealError>);

/// Mounts in the namespace of the calling thread (the supervisor's loop
/// thread, which joined the watched namespace), with a pool of helper
/// threads in the same namespace to flatten large batches.
#[derive(Debug)]
pub struct MountExecutor {
    mounter: Arc<Mounter>,
    pool: FlattenPool,
    /// Whether the kernel slides mounts beneath others (6.5): without it,
    /// every target is flattened on the pool.
    mount_beneath: bool,
    /// The watched namespace, which container heals clone the source in,
    /// and its inode, which the namespaces are told is the host's.
    watched: Arc<OwnedFd>,
    watched_inode: u64,
    /// Mounts of dead connections in other namespaces, isolated when their
    /// daemon died and replaced at the heal.
    isolated: isolations::Isolations,
    /// The other mount namespaces of the node, where they are looked for.
    namespaces: Arc<namespaces::Namespaces>,
    /// Handles on the stale layers of the last batch, kept from its flatten
    /// to its heal in containers: they keep the dead connections alive, so
    /// their device numbers are nobody else's while containers are searched
    /// by number for mounts made during the outage.
    pinned: LetGoOnDrop,
    /// Where the work in containers' namespaces runs, with its deadline.
    workers: containers::NamespaceWorkers,
    /// Copies of the mounts nested in containers' volumes, taken ahead.
    nested_copies: Arc<nested_copies::NestedCopies>,
}

impl MountExecutor {
    /// Must be called from the thread that mounts, once it is in the
    /// watched namespace.
    /// The flatten helpers and the heals in containers run at `priority`
    /// (see [`crate::heal::priority`]).
    pub fn new(kubelet_root: &Path, staging_dir: &Path, priority: HealPriority) -> std::io::Result<Self> {
        let mounter = Arc::new(Mounter {
            kubelet_root: kubelet_root.to_path_buf(),
            kubelet_root_fd: resolve::open_dir(kubelet_root)?,
            root_fd: resolve::open_dir(Path::new("/"))?,
            staging: Staging::prepare(staging_dir)?,
        });
        let watched = Arc::new(ns::open_thread_mount_namespace()?);
        let watched_inode = std::fs::File::from(watched.try_clone()?).metadata()?.ino();
        let pool = FlattenPool::start(&mounter, &watched, priority);
        let mount_beneath = mount::move_mount_beneath_supported();
        if !mount_beneath {
            info!("this kernel cannot slide a mount beneath another (before 6.5): each stale layer is detached alone");
        }
        let namespaces = namespaces::Namespaces::new(Path::new("/proc"));
        namespaces.heal_as_host(watched_inode);
        Ok(MountExecutor {
            mounter,
            pool,
            mount_beneath,
            watched,
            watched_inode,
            isolated: isolations::Isolations::new(connections::FuseConnections::shared(Path::new(
                connections::FUSE_CONNECTIONS,
            ))),
            namespaces,
            pinned: LetGoOnDrop::default(),
            workers: containers::NamespaceWorkers::new(priority, containers::DEFAULT_DEADLINE),
            nested_copies: Arc::default(),
        })
    }

    /// Looks for containers' mounts in `namespaces` (kept by events) rather
    /// than by walks of `/proc`.
    /// They copy ahead the mounts nested in watched volumes.
    pub fn use_namespaces(&mut self, namespaces: Arc<namespaces::Namespaces>) {
        namespaces.heal_as_host(self.watched_inode);
        namespaces.copy_nested_with(Arc::clone(&self.nested_copies), self.workers.clone());
        self.namespaces = namespaces;
    }

    /// Replaces `mounts` with clones of `source` (see
    /// [`containers::replace`]); each namespace healed now holds a mount
    /// of `source`'s connection, which the known namespaces are told. The
    /// workers get copies of the probe's handles `live`, if any, taken only
    /// now that there are mounts to heal.
    fn replace_in_containers(
        &self,
        source: &FuseMount,
        live: Option<&SourceHandles>,
        mounts: &[containers::ForeignMount],
    ) -> Vec<ContainerOutcome> {
        let live = live.and_then(containers::LiveHandles::of);
        let outcomes = containers::replace(&self.watched, source, live, mounts, &self.workers, &self.nested_copies);
        for (foreign, _) in outcomes.iter().filter(|(_, healed)| healed.is_ok()) {
            self.namespaces.healed_onto(foreign.namespace, source.dev);
        }
        outcomes
    }

    /// Waits for each namespace's share of an isolation or a heal in
    /// containers until `deadline` (see [`containers::NamespaceWorkers`]).
    pub fn with_container_deadline(mut self, deadline: Duration) -> Self {
        self.workers = containers::NamespaceWorkers::new(self.workers.priority(), deadline);
        self
    }

    /// Flattens as on a kernel that cannot slide a mount beneath another.
    pub fn without_mount_beneath(mut self) -> Self {
        self.mount_beneath = false;
        self
    }
}

impl MountExecutor {
    /// Sets aside the descriptors a heal of `batch` opens once its handles
    /// on the stale layers (`prepared`) are taken: copies of one of the
    /// executor's own, let go as the heal opens its own. Where a stale
    /// handle or a copy could not be had for want of descriptors, nothing
    /// is mounted and every target of the batch fails with
    /// [`HealError::Descriptors`], retried with the usual back-off.
    /// A target slid in keeps no descriptor of its own beyond its stale
    /// handle: its clone is closed once attached, one at a time.
    fn reserve_descriptors(
        &self,
        batch: &HealBatch,
        prepared: &Prepared,
        slides_in: &[bool],
    ) -> Result<Reserve, Vec<TargetOutcome>> {
        let targets = batch.targets.len();
        let slid_in = slides_in.iter().filter(|slides| **slides).count();
        let needed = (targets - slid_in) * (DESCRIPTORS_PER_STACK + 1)
            + usize::from(slid_in > 0) * DESCRIPTORS_PER_STACK
            + FLATTEN_THREADS * DESCRIPTORS_PER_FLATTEN_THREAD
            + DESCRIPTORS_SPARE;
        let mut reserve = Reserve(Vec::with_capacity(needed));
        let stale_short = prepared.stale.iter().any(|stale| stale.as_ref().is_err_and(HealError::lacks_descriptors));
        let short = if stale_short {
            Some(fds::too_many_open_files())
        } else {
            (0..needed).find_map(|_| match self.mounter.root_fd.try_clone() {
                Ok(copy) => {
                    reserve.0.push(copy);
                    None
                }
                Err(err) => Some(err),
            })
        };
        let Some(short) = short else { return Ok(reserve) };
        let errno = short.raw_os_error();
        // Stale handles included: the batch needs them all at once. Logged
        // by the caller, per target.
        let needed = needed + targets;
        Err(batch
            .targets
            .iter()
            .map(|target| TargetOutcome {
                path: target.path.clone(),
                result: Err(HealError::Descriptors {
                    path: target.path.clone(),
                    targets,
                    needed,
                    source: errno.map_or_else(fds::too_many_open_files, std::io::Error::from_raw_os_error),
                }),
                layers_removed: 0,
                flatten_error: None,
            })
            .collect())
    }
}

impl Executor for MountExecutor {
    fn prepare(&self, batch: &HealBatch, held: Vec<Option<OwnedFd>>) -> Prepared {
        let held = held.into_iter().chain(std::iter::repeat_with(|| None));
        let stale = batch
            .targets
            .iter()
            .zip(held)
            .map(|(target, held)| held.map_or_else(|| self.mounter.open_planned(target), Ok))
            .collect();
        Prepared { stale }
    }

    fn open_target(&self, path: &Path) -> Result<(OwnedFd, u32), HealError> {
        self.mounter.resolve_target(path)
    }

    fn detach_dead_source(&mut self, source: &Path, dead: Dev) -> Result<bool, HealError> {
        dead_source::detach(&self.mounter, source, dead)
    }

    fn flatten_covered(&mut self, target: &TargetHeal, stale: OwnedFd) -> Result<usize, HealError> {
        let top = self.mounter.open_planned(target)?;
        // The kernel put a copy of the daemon's new mount here, with that
        // mount's attributes, the moment it was made: a read-only target
        // was writable from then until now, which no heal can prevent
        // (docs/heal.md, "What a heal preserves"). Set back at once.
        let stale_id = resolve::mount_id_of(stale.as_fd())
            .map_err(|source| HealError::Resolve { path: target.path.clone(), source })?;
        let attributes = carry::attributes_of(stale.as_fd(), stale_id, None, None)
            .map_err(|source| HealError::Attributes { path: target.path.clone(), source })?;
        mounter::carry_onto_copy(target, top.as_fd(), target.top_mount_id, attributes)?;
        mount::make_private(stale.as_fd()).map_err(HealError::mount("make stale layer private", &target.path))?;
        // The loop thread flattens alone here, on its own parking directory.
        self.mounter.flatten(target, top.as_fd(), 0)
    }

    fn flatten_covered_unheld(&mut self, target: &TargetHeal) -> Result<usize, HealError> {
        let top = self.mounter.open_planned(target)?;
        self.mounter.flatten(target, top.as_fd(), 0)
    }

    fn isolate_containers(&mut self, dev: Dev) -> Option<Isolated> {
        let generation = self.namespaces.generation();
        let mut skip = BTreeSet::new();
        let searched = self.isolated.searched(dev);
        let searched_before = searched.is_some();
        // What the record says was searched once this is done: `generation`
        // once a search succeeds.
        let mut searched_at = searched.as_ref().map_or(generation, |(at, _)| *at);
        // Searched at the death: the mounts it could not make private then
        // are tried again, and only a namespace learnt since (a process
        // that unshared a copy of the dead mount during the outage) can
        // hold one it did not see; none is read when none was learnt.
        // Without namespaces kept by events that would take a walk of
        // `/proc` before the host heal: the heal after it looks instead.
        let retried = if searched_before { self.isolated.take_unisolated(dev) } else { Vec::new() };
        let query = match searched {
            None => Some(None),
            Some((at, _)) if !self.namespaces.is_kept() || at == generation => None,
            Some((at, found)) => {
                skip.extend(found);
                Some(Some(at))
            }
        };
        if !searched_before {
            // The death's search reads the namespaces known; those no exec
            // made known are walked for now, off the loop, during the
            // outage: the search before the host heal reads them.
            self.namespaces.look_for_unknown();
        }
        let searching = std::time::Instant::now();
        let mut found = match query
            .map(|learnt_after| self.namespaces.holding(&skip, &BTreeSet::from([dev]), after(learnt_after)))
        {
            None => namespaces::Holding::default(),
            Some(Ok(found)) => {
                searched_at = generation;
                found
            }
            Some(Err(err)) => {
                warn!(connection = %dev, err = %chain(&err), "cannot look for the connection's mounts in containers");
                if !searched_before {
                    // Nothing recorded: the heal searches again.
                    return Some(Isolated::default());
                }
                namespaces::Holding::default()
            }
        };
        if searched_before && found.mounts.is_empty() && retried.is_empty() {
            self.isolated.insert(dev, Vec::new(), Vec::new(), searched_at);
            return None;
        }
        let searched_us = searching.elapsed().as_micros() as u64;
        found.mounts.extend(retried);
        let failed = containers::isolate(&found.mounts, &self.workers, &self.nested_copies);
        let namespaces = found.mounts.iter().map(|foreign| foreign.namespace).collect::<BTreeSet<_>>().len();
        let unisolated = failed.iter().map(|(foreign, _)| foreign.clone()).collect();
        let isolated = Isolated {
            namespaces,
            mounts: found.mounts.len(),
            failed,
            read: found.read,
            walked: found.walked,
            searched_us,
        };
        self.isolated.insert(dev, found.mounts, unisolated, searched_at);
        Some(isolated)
    }

    fn heal_containers(
        &mut self,
        dead: &BTreeSet<Dev>,
        source: &FuseMount,
        live: Option<&SourceHandles>,
    ) -> Vec<ContainerOutcome> {
        let pinned = std::mem::take(&mut self.pinned);
        let mut isolated = Vec::new();
        // The oldest search among the dead connections'.
        let mut searched_at: Option<u64> = None;
        // Those whose number is surely theirs still (isolated under it, or
        // pinned), with their `fusectl` directory.
        let mut identified = Vec::new();
        for dev in dead {
            let removed = self.isolated.remove(*dev);
            if removed.is_some() || !pinned.0.is_empty() {
                identified.extend(self.isolated.connection_inode(*dev).map(|inode| (*dev, inode)));
            }
            if let Some((at, mounts)) = removed {
                searched_at = Some(searched_at.map_or(at, |oldest| oldest.min(at)));
                isolated.extend(mounts);
            }
        }
        let mut outcomes =
            if isolated.is_empty() { Vec::new() } else { self.replace_in_containers(source, live, &isolated) };
        // A namespace learnt from now on is checked for copies of these as
        // it is learnt; those learnt up to now are searched below.
        let generation = self.namespaces.replaced(&identified, &source.mount_point);
        // Then the namespaces that got a copy of a dead mount during the
        // outage and were not isolated (a process that unshared its own
        // meanwhile; runc refuses to start a container on a dead volume):
        // with namespaces kept by events, only those learnt since the last
        // search, and nothing is read when none was; else by a walk of
        // `/proc`. Found by device number, which only the pins make safe.
        // Without them (a heal by the kernel's propagation) the host heal
        // let go of the dead connection's last mounts here, and a freed
        // number is soon another connection's (another pod's, live), whose
        // mounts a search would find and replace.
        if pinned.0.is_empty() || dead.is_empty() {
            return outcomes;
        }
        let learnt_after = if self.namespaces.is_kept() { searched_at } else { None };
        if learnt_after == Some(generation) {
            return outcomes;
        }
        let skip: BTreeSet<u64> = isolated.iter().map(|foreign| foreign.namespace).collect();
        let searched = std::time::Instant::now();
        let found = self.namespaces.holding(&skip, dead, (after(learnt_after).0, Bound::Included(generation)));
        match found {
            Ok(found) => {
                let took_us = searched.elapsed().as_micros() as u64;
                debug!(
                    took_us,
                    read = found.read,
                    walked = found.walked,
                    mounts = found.mounts.len(),
                    "searched for dead mounts made during the outage"
                );
                if !found.mounts.is_empty() {
                    outcomes.extend(self.replace_in_containers(source, live, &found.mounts));
                }
            }
            Err(err) => warn!(err = %chain(&err), "cannot look for dead mounts made in containers during the outage"),
        }
        drop(pinned);
        outcomes
    }

    fn retry_containers(&mut self, mounts: &[containers::ForeignMount], source: &FuseMount) -> Vec<ContainerOutcome> {
        self.replace_in_containers(source, None, mounts)
    }

    fn watch_connections(&mut self, connections: BTreeSet<Dev>) {
        self.namespaces.watch_connections(connections);
    }

    fn when_namespace_free(&mut self, notify: containers::FreeNotify) {
        self.workers.when_free(notify);
    }

    fn heal(&mut self, batch: &HealBatch, prepared: Prepared, source: &SourceHandles) -> Vec<TargetOutcome> {
        let mounter = &*self.mounter;
        let source_dev = batch.source.top().dev;
        // Handles on every stale top, taken before the first stack covers them.
        // (Those prepared for another batch are let go first: they may be as
        // many as the process can open.)
        let prepared = if prepared.fits(batch.targets.len()) {
            prepared
        } else {
            drop(prepared);
            self.prepare(batch, Vec::new())
        };
        // And every descriptor the stacks will open, before the first: a
        // stack that ran out half-way would leave the targets after it
        // reached by the first ones' propagation while their stale layers
        // are still shared, beyond any flatten's reach.
        let slides_in = to_slide_in(batch, &prepared.stale, self.mount_beneath);
        let mut reserve = match self.reserve_descriptors(batch, &prepared, &slides_in) {
            Ok(reserve) => reserve,
            Err(shortage) => return shortage,
        };
        let mut outcomes = Vec::with_capacity(batch.targets.len());
        let mut flattens = Vec::with_capacity(batch.targets.len());
        // Placed beneath their stale layer: only that layer's detach is left
        // (older layers under it, if any, stay under the new mount).
        let mut slid = Vec::new();
        let source_root = &batch.source.top().root;
        let started = Instant::now();
        // What every clone of the source has before it is given the stale
        // top's attributes.
        let source_has = carry::attributes_of(source.root.as_fd(), batch.source.top().mount_id, None, None).ok();
        let direct = slid_in_directly(batch, &prepared.stale, &slides_in);
        let slid_in = direct.iter().flatten().count();
        let prepared = own_stacks_where_attributes_differ(batch, prepared, &direct, self.mount_beneath);
        let grouped = started.elapsed();
        // The stale tops of the slid-in targets, kept to the containers'
        // heal like the stacked ones' (see `pinned`).
        let mut slid_in_stale = Vec::new();
        let mut clone_room = false;
        for (index, (((target, opened), attributes), direct)) in
            batch.targets.iter().zip(prepared.stale).zip(prepared.attributes).zip(direct).enumerate()
        {
            if target
                .beneath_top
                .as_ref()
                .is_some_and(|(dev, root)| *dev == source_dev && *root == source_root.join(&target.root_in_source))
            {
                // A heal cut short (the supervisor killed) after it slid
                // the new source beneath this stale layer: only the detach
                // is left to do. It counts as that heal's stack.
                let detached = opened.and_then(|_| mounter.finish_slide(target, source_dev));
                let layers_removed = usize::from(matches!(detached, Ok(true)));
                let result = detached.map(|_| Healed::Stacked);
                outcomes.push(TargetOutcome { path: target.path.clone(), result, layers_removed, flatten_error: None });
                continue;
            }
            if let (Some(direct), Ok(stale), Ok(attributes)) = (&direct, &opened, &attributes) {
                // Room for one clone, closed before the next is made.
                if !clone_room {
                    reserve.release(DESCRIPTORS_PER_STACK);
                    clone_room = true;
                }
                match mounter.slide_in(target, stale.as_fd(), source, *attributes, source_has) {
                    Ok(new_top) => {
                        // Its mount ID is all the detach needs of it: the
                        // clone's descriptor goes.
                        slid.push((index, new_top_id(target, new_top.as_fd()), direct.stale_unique_id));
                        slid_in_stale.extend(opened.ok());
                        let result = Ok(Healed::Stacked);
                        outcomes.push(TargetOutcome {
                            path: target.path.clone(),
                            result,
                            layers_removed: 0,
                            flatten_error: None,
                        });
                        continue;
                    }
                    // Stacked onto instead, and flattened as a stacked target is
                    // (with the clone's room, or what is spare).
                    Err(err) => {
                        debug!(err = %chain(&err), "cannot slide the new source in beneath the stale target; stacking onto it")
                    }
                }
            }
            // The stack's own: the target resolved, and the source's clone.
            if direct.is_none() {
                reserve.release(DESCRIPTORS_PER_STACK);
            }
            let stacked = opened
                .and_then(|stale| Ok((stale, mounter.stack(target, source, source_dev, attributes?, source_has)?)));
            let mut flatten_error = None;
            let result = match stacked {
                Ok((stale, (how, new_top, placed))) => {
                    // Out of the old peer group as soon as the new mount is on
                    // it: a later stack (a subPath's) can then no longer
                    // propagate a copy onto this stale layer, a mount on it
                    // that would keep it from going with the others.
                    match mount::make_private(stale.as_fd()) {
                        Ok(()) if placed == Placed::Beneath => {
                            slid.push((index, new_top_id(target, new_top.as_fd()), None))
                        }
                        Ok(()) => flattens.push((index, stale, new_top)),
                        Err(err) => {
                            flatten_error = Some(HealError::mount("make stale layer private", &target.path)(err));
                        }
                    }
                    Ok(how)
                }
                Err(err) => Err(err),
            };
            outcomes.push(TargetOutcome { path: target.path.clone(), result, layers_removed: 0, flatten_error });
        }
        // Containers read again from here on; the heal ends with the flatten.
        let stacked = started.elapsed();
        debug!(targets = outcomes.len(), "stacks in place");
        // The flatten's: a flatten that runs short leaves the stale layer,
        // private by now, for the next heal's flatten to reach.
        drop(reserve);
        // A copy per stale layer (a dup each): any of them may be the only
        // one of its dead connection.
        let stacked_stale = flattens.iter().filter_map(|(_, stale, _): &(_, OwnedFd, _)| stale.try_clone().ok());
        self.pinned = LetGoOnDrop(stacked_stale.chain(slid_in_stale).collect());
        crate::stop_point::reached(crate::stop_point::STACKED);
        // Every stack before any flatten, as tests/testbed.rs shows it: the
        // containers read again once the stacks are in place, and the
        // flatten, which only the host sees, comes after.
        //
        // A target with one stale layer is flattened by sliding its new top
        // beneath that layer and detaching the layers together (one grace
        // period for the batch instead of one per target: a detach waits for
        // one); older stacks of several layers, and every target on a
        // kernel that cannot slide, are taken apart one by one, by the
        // pool's threads beside this one.
        let (slides, layered): (Vec<_>, Vec<_>) = flattens.into_iter().partition(|(index, _, _)| {
            self.mount_beneath && batch.targets.get(*index).is_some_and(|target| target.layer_ids.len() == 1)
        });
        let helpers = layered.len().div_ceil(TARGETS_PER_FLATTEN_THREAD).min(FLATTEN_THREADS - 1);
        let targets: Arc<[TargetHeal]> = batch.targets.clone().into();
        let (done, finished) = mpsc::channel();
        {
            let mut queue = self.pool.queue.lock();
            for (index, stale, new_top) in layered {
                let targets = Arc::clone(&targets);
                queue.jobs.push_back(FlattenJob { targets, index, _stale: stale, new_top, done: done.clone() });
            }
        }
        drop(done);
        for _ in 0..helpers {
            self.pool.queue.ready.notify_one();
        }
        for (index, stale, new_top) in slides {
            let (Some(target), Some(outcome)) = (batch.targets.get(index), outcomes.get_mut(index)) else { continue };
            match mounter.slide_beneath(target, stale.as_fd(), new_top.as_fd()) {
                Ok(None) => slid.push((index, new_top_id(target, new_top.as_fd()), None)),
                Ok(Some(removed)) => outcome.layers_removed = removed,
                Err(err) => outcome.flatten_error = Some(err),
            }
        }
        let slid_under = started.elapsed();
        let (slid_count, mut detaches) = (slid.len(), 0);
        if slid_count > 0 {
            crate::stop_point::reached(crate::stop_point::SLID);
        }
        for (index, new_top, stale_unique_id) in slid {
            let (Some(target), Some(outcome)) = (batch.targets.get(index), outcomes.get_mut(index)) else { continue };
            if detaches > 0 && stale_unique_id.is_some_and(|unique| !still_attached(unique)) {
                outcome.layers_removed = 1;
                continue;
            }
            match new_top.and_then(|new_top| mounter.detach_slid(target, new_top)) {
                Ok(detached) => {
                    outcome.layers_removed = 1;
                    detaches += usize::from(detached);
                }
                Err(err) => outcome.flatten_error = Some(err),
            }
        }
        let detached = started.elapsed();
        while let Some(job) = self.pool.queue.try_next() {
            job.run(mounter, 0);
        }
        // Ends when every job has sent its outcome and dropped its sender.
        for (index, flattened) in finished.iter() {
            let Some(outcome) = outcomes.get_mut(index) else { continue };
            match flattened {
                Ok(removed) => outcome.layers_removed = removed,
                Err(err) => outcome.flatten_error = Some(err),
            }
        }
        // The host heal's phases, each from the end of the one before.
        let micros = |phase: Duration| phase.as_micros() as u64;
        info!(
            targets = outcomes.len(),
            slid = slid_count,
            slid_in,
            detaches,
            grouped_us = micros(grouped),
            stacks_us = micros(stacked - grouped),
            slides_us = micros(slid_under - stacked),
            detaches_us = micros(detached - slid_under),
            layered_us = micros(started.elapsed() - detached),
            "flattened"
        );
        outcomes
    }
}
