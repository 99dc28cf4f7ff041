//! Carrying out a heal plan in the watched mount namespace.
//!
//! DESIGN.md "How a heal must be done": stack the new source onto each stale
//! target so running containers (slaves of the target's peer group) receive
//! it, skip targets a previous stack already reached by propagation, then
//! flatten so the host keeps exactly one layer per target. Every mount call
//! goes through an fd that was resolved beneath the kubelet root and checked
//! to be, at that moment, the mount the plan recorded.
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Mutex, PoisonError};

use fuse_supervisor_sys::{mount, ns, resolve};
use tracing::{debug, warn};

use crate::plan::{HealBatch, TargetHeal};
use crate::probe::SourceHandles;
use crate::table::Dev;

#[derive(Debug, thiserror::Error)]
pub enum HealError {
    #[error("target {path} is not beneath the kubelet root {root}")]
    OutsideRoot { path: PathBuf, root: PathBuf },
    #[error("cannot resolve target {path} beneath the kubelet root")]
    Resolve {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("target {path} changed since it was planned (mount {found}, planned {planned})")]
    Changed { path: PathBuf, planned: u32, found: u32 },
    #[error("no handle on {root} inside the source for target {path}")]
    NoSourceRoot { path: PathBuf, root: PathBuf },
    #[error("{step} failed for target {path}")]
    Mount {
        step: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
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

/// Carries out heal batches. The real one mounts; tests record.
pub trait Executor {
    fn heal(&mut self, batch: &HealBatch, source: &SourceHandles) -> Vec<TargetOutcome>;

    /// Resolves a target as the executor would for a heal, returning an
    /// O_PATH handle on it and the ID of the mount on top.
    fn open_target(&self, path: &Path) -> Result<(OwnedFd, u32), HealError>;

    /// Removes the stale layers under a target that a mount over its stale
    /// source healed by propagation. `stale` is a handle on the stale layer
    /// taken when its daemon died, before the new mount covered it (no path
    /// reaches it now); `target.top_mount_id` is the propagated new top.
    /// Returns the number of layers removed.
    fn flatten_covered(&mut self, target: &TargetHeal, stale: OwnedFd) -> Result<usize, HealError>;
}

/// Where a new top is parked while the layer under it is removed: a
/// private tmpfs on a directory of the supervisor's, with one parking
/// directory per flattening thread (a top parked on another's would be moved
/// back with it). (A detached tmpfs would leave no trace, but 6.18 refuses to
/// move an attached mount onto a detached tree, and to move it back out:
/// EINVAL both ways.)
#[derive(Debug)]
struct Staging {
    parks: Vec<OwnedFd>,
}

impl Staging {
    /// Mounts a private tmpfs on `path` (creating it), or reuses the one a
    /// previous run left there.
    fn prepare(path: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(path)?;
        let parent = path.parent().unwrap_or(Path::new("/"));
        let here = resolve::mount_id_of(resolve::open_dir(path)?.as_fd())?;
        if here == resolve::mount_id_of(resolve::open_dir(parent)?.as_fd())? {
            mount::mount_tmpfs(path)?;
        }
        // Private: a new top parked here must not propagate anywhere, and
        // it could not be moved back out of a shared parent.
        mount::set_propagation(path, mount::Propagation::Private, false)?;
        let parks = (0..FLATTEN_THREADS)
            .map(|index| {
                let park = path.join(format!("park-{index}"));
                std::fs::create_dir_all(&park)?;
                resolve::open_dir(&park)
            })
            .collect::<std::io::Result<_>>()?;
        Ok(Staging { parks })
    }
}

/// At most this many threads flatten one batch. Each flatten waits in
/// `umount2` for an expedited RCU grace period (namespace_unlock), tens of
/// microseconds idle, far more when both CPUs are busy; concurrent requests
/// queue on the grace-period machinery and share what they can, while the
/// mount calls themselves take the namespace lock in turn. On the 2-CPU test
/// VM 8 threads flattened 100 targets faster than 4, and 16 no faster than 8.
const FLATTEN_THREADS: usize = 8;

/// Targets per flattening thread before another is worth its start-up.
const TARGETS_PER_FLATTEN_THREAD: usize = 8;

/// One target to flatten: its index in the batch, the handle on its planned
/// top taken before the first stack, and the handle on its new top.
struct FlattenJob {
    index: usize,
    stale: OwnedFd,
    new_top: OwnedFd,
}

/// Mounts in the namespace of the calling thread (the supervisor's loop
/// thread, which joined the watched namespace), with helper threads that
/// enter the same namespace to flatten large batches.
#[derive(Debug)]
pub struct MountExecutor {
    kubelet_root: PathBuf,
    kubelet_root_fd: OwnedFd,
    staging: Staging,
    namespace: OwnedFd,
}

impl MountExecutor {
    /// Must be called from the thread that mounts, once it is in the
    /// watched namespace.
    pub fn new(kubelet_root: &Path, staging_dir: &Path) -> std::io::Result<Self> {
        Ok(MountExecutor {
            kubelet_root: kubelet_root.to_path_buf(),
            kubelet_root_fd: resolve::open_dir(kubelet_root)?,
            staging: Staging::prepare(staging_dir)?,
            namespace: ns::open_thread_mount_namespace()?,
        })
    }

    /// Resolves a target beneath the kubelet root (no symlinks, no magic
    /// links, no escaping) and returns it with the ID of its top mount.
    fn resolve_target(&self, path: &Path) -> Result<(OwnedFd, u32), HealError> {
        let relative = path
            .strip_prefix(&self.kubelet_root)
            .map_err(|_| HealError::OutsideRoot { path: path.to_path_buf(), root: self.kubelet_root.clone() })?;
        let resolve_error = |source| HealError::Resolve { path: path.to_path_buf(), source };
        let fd = resolve::open_beneath(self.kubelet_root_fd.as_fd(), relative).map_err(resolve_error)?;
        let id = resolve::mount_id_of(fd.as_fd()).map_err(resolve_error)?;
        Ok((fd, id))
    }

    /// Stacks the new source onto the target unless an earlier stack of the
    /// batch reached it by propagation; either way returns a handle on the
    /// target's new top, for flattening. `source_dev` is the device of the
    /// source's new mount.
    fn stack(
        &self,
        target: &TargetHeal,
        source: &SourceHandles,
        source_dev: Dev,
    ) -> Result<(Healed, OwnedFd), HealError> {
        let (fd, top) = self.resolve_target(&target.path)?;
        if top != target.top_mount_id {
            // An earlier stack of this batch propagated onto it if the new top
            // is on the source's connection; anything else was mounted there
            // by someone else: changed under the heal, like a failed check.
            let found = resolve::device_of(fd.as_fd())
                .map_err(|source| HealError::Resolve { path: target.path.clone(), source })?;
            if found != (source_dev.major, source_dev.minor) {
                return Err(HealError::Changed { path: target.path.clone(), planned: target.top_mount_id, found: top });
            }
            // `fd` was resolved onto the copy.
            return Ok((Healed::Propagated, fd));
        }
        let from = source.for_root(&target.root_in_source).ok_or_else(|| HealError::NoSourceRoot {
            path: target.path.clone(),
            root: target.root_in_source.clone(),
        })?;
        let step = |step| move |source| HealError::Mount { step, path: target.path.clone(), source };
        let clone = mount::clone_mount(from.as_fd()).map_err(step("clone source"))?;
        mount::move_mount(clone.as_fd(), fd.as_fd()).map_err(step("stack onto target"))?;
        // Attached now, the clone's fd is a handle on the target's new top.
        Ok((Healed::Stacked, clone))
    }

    /// Leaves one layer: parks the new top, removes every stale layer that
    /// was under it (made private first, so the removal does not propagate
    /// into containers), and puts the new top back. `stale` is the handle on
    /// the planned top taken before the first stack, `new_top` the one the
    /// stack returned: both are moved and detached by handle, and the path is
    /// resolved again only to see what lies under the parked top.
    fn flatten(
        &self,
        target: &TargetHeal,
        stale: BorrowedFd<'_>,
        new_top: BorrowedFd<'_>,
        park: BorrowedFd<'_>,
    ) -> Result<usize, HealError> {
        let step = |step| move |source| HealError::Mount { step, path: target.path.clone(), source };
        mount::make_private(stale).map_err(step("make stale layer private"))?;
        mount::move_mount(new_top, park).map_err(step("park new top"))?;
        let mut removed = 0;
        let result = loop {
            let (fd, id) = match self.resolve_target(&target.path) {
                Ok(opened) => opened,
                Err(err) => break Err(err),
            };
            if !target.layer_ids.contains(&id) {
                break Ok(fd);
            }
            // Layers below the planned top were covered until now: make them
            // private too. The planned top already is.
            let private = if id == target.top_mount_id { Ok(()) } else { mount::make_private(fd.as_fd()) };
            if let Err(err) = private.and_then(|()| mount::detach_top(fd.as_fd())) {
                break Err(HealError::Mount { step: "remove stale layer", path: target.path.clone(), source: err });
            }
            removed += 1;
        };
        // Whatever happened, the new top goes back: a parked mount serves no one.
        let restore_onto = match result {
            Ok(fd) => fd,
            Err(err) => {
                let (fd, _) = self.resolve_target(&target.path)?;
                mount::move_mount(new_top, fd.as_fd()).map_err(step("restore new top"))?;
                return Err(err);
            }
        };
        mount::move_mount(new_top, restore_onto.as_fd()).map_err(step("restore new top"))?;
        Ok(removed)
    }

    /// Flattens the jobs on `queue` until it is closed and empty, parking
    /// new tops on parking directory `park`.
    fn flatten_jobs(
        &self,
        batch: &HealBatch,
        park: usize,
        queue: &Mutex<Receiver<FlattenJob>>,
        done: &Sender<(usize, Result<usize, HealError>)>,
    ) {
        let Some(park) = self.staging.parks.get(park) else { return };
        loop {
            // The lock is held only while waiting for the next job.
            let job = queue.lock().unwrap_or_else(PoisonError::into_inner).recv();
            let Ok(FlattenJob { index, stale, new_top }) = job else { return };
            let Some(target) = batch.targets.get(index) else { continue };
            let result = self.flatten(target, stale.as_fd(), new_top.as_fd(), park.as_fd());
            // The receiver lives until every helper is joined.
            let _ = done.send((index, result));
        }
    }
}

impl Executor for MountExecutor {
    fn open_target(&self, path: &Path) -> Result<(OwnedFd, u32), HealError> {
        self.resolve_target(path)
    }

    fn flatten_covered(&mut self, target: &TargetHeal, stale: OwnedFd) -> Result<usize, HealError> {
        let (top, id) = self.resolve_target(&target.path)?;
        if id != target.top_mount_id {
            return Err(HealError::Changed { path: target.path.clone(), planned: target.top_mount_id, found: id });
        }
        // The loop thread flattens alone here: the first parking directory is its own.
        let park = self.staging.parks.first().ok_or_else(|| HealError::Mount {
            step: "find a parking directory",
            path: target.path.clone(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        })?;
        self.flatten(target, stale.as_fd(), top.as_fd(), park.as_fd())
    }

    fn heal(&mut self, batch: &HealBatch, source: &SourceHandles) -> Vec<TargetOutcome> {
        let this = &*self;
        let source_dev = batch.source.top().dev;
        let helpers = batch.targets.len().div_ceil(TARGETS_PER_FLATTEN_THREAD).clamp(1, FLATTEN_THREADS) - 1;
        let (jobs, queue) = mpsc::channel();
        let queue = Mutex::new(queue);
        let (done, finished) = mpsc::channel();
        std::thread::scope(|scope| {
            // Helpers start first, so that entering the namespace overlaps
            // the stacks; they wait for jobs until the stacks are done.
            for park in 1..=helpers {
                let (queue, done) = (&queue, done.clone());
                let helper = std::thread::Builder::new().name("flatten".into()).spawn_scoped(scope, move || {
                    match ns::enter_mount_namespace(this.namespace.as_fd()) {
                        Ok(()) => this.flatten_jobs(batch, park, queue, &done),
                        Err(err) => warn!(?err, "flatten helper cannot enter the mount namespace"),
                    }
                });
                if let Err(err) = helper {
                    warn!(?err, "cannot start a flatten helper; flattening with fewer threads");
                }
            }
            // Handles on every stale top, taken before the first stack covers them.
            let opened: Vec<Result<OwnedFd, HealError>> = batch
                .targets
                .iter()
                .map(|target| {
                    let (fd, id) = this.resolve_target(&target.path)?;
                    if id != target.top_mount_id {
                        return Err(HealError::Changed {
                            path: target.path.clone(),
                            planned: target.top_mount_id,
                            found: id,
                        });
                    }
                    Ok(fd)
                })
                .collect();
            let mut outcomes = Vec::with_capacity(opened.len());
            let mut flattens = Vec::with_capacity(opened.len());
            for (index, (target, opened)) in batch.targets.iter().zip(opened).enumerate() {
                let stacked = opened.and_then(|stale| Ok((stale, this.stack(target, source, source_dev)?)));
                let result = match stacked {
                    Ok((stale, (how, new_top))) => {
                        flattens.push(FlattenJob { index, stale, new_top });
                        Ok(how)
                    }
                    Err(err) => Err(err),
                };
                outcomes.push(TargetOutcome {
                    path: target.path.clone(),
                    result,
                    layers_removed: 0,
                    flatten_error: None,
                });
            }
            // Containers read again from here on; the heal ends with the flatten.
            debug!(targets = outcomes.len(), "stacks in place");
            // Every stack before any flatten (as DESIGN.md verified it): a
            // flatten takes its stale layer out of the peer group that later
            // stacks propagate through.
            for job in flattens {
                // The receiver is this thread's, alive until the end.
                let _ = jobs.send(job);
            }
            drop(jobs);
            this.flatten_jobs(batch, 0, &queue, &done);
            drop(done);
            for (index, flattened) in finished.iter() {
                let Some(outcome) = outcomes.get_mut(index) else { continue };
                match flattened {
                    Ok(removed) => outcome.layers_removed = removed,
                    Err(err) => outcome.flatten_error = Some(err),
                }
            }
            debug!(targets = outcomes.len(), "flattened");
            outcomes
        })
    }
}
