//! The mount operations of a heal, each on a target resolved by descriptor
//! beneath its root and checked to be the planned mount: stack, park,
//! flatten, slide beneath, and the parking directories they use.
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fuse_supervisor_sys::mount::MountAttributes;
use fuse_supervisor_sys::{mount, resolve};
use tracing::{debug, warn};

use super::carry;
use super::probe::SourceHandles;
use super::{FLATTEN_THREADS, HealError, Healed};
use crate::errors::chain;
use crate::model::table::Dev;
use crate::plan::TargetHeal;

/// Where a new top is parked while the layer under it is removed: a
/// private tmpfs on a directory of the supervisor's, with one parking
/// directory per flattening thread (a top parked on another's would be moved
/// back with it). (A detached tmpfs would leave no trace, but 6.18 refuses to
/// move an attached mount onto a detached tree, and to move it back out:
/// EINVAL both ways.)
#[derive(Debug)]
pub(super) struct Staging {
    pub(super) parks: Vec<OwnedFd>,
}

impl Staging {
    /// Mounts a private tmpfs on `path` (creating it), or reuses the one a
    /// previous run left there.
    pub(super) fn prepare(path: &Path) -> std::io::Result<Self> {
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
                clear_park(&park)?;
                resolve::open_dir(&park)
            })
            .collect::<std::io::Result<_>>()?;
        Ok(Staging { parks })
    }
}

/// Whether the mount `id` on device `dev` (None: unknown) at the target is
/// the top its heal was planned for: the ID, and the device, since a freed
/// ID is reused at once (a target unmounted and its directory recreated,
/// with another mount on it, between the plan and the heal).
pub(super) fn planned_top(target: &TargetHeal, id: u32, dev: Option<Dev>) -> Result<(), HealError> {
    if id != target.top_mount_id {
        return Err(HealError::Changed { path: target.path.clone(), planned: target.top_mount_id, found: id });
    }
    match dev {
        Some(found) if found != target.top_dev => {
            Err(HealError::Reused { path: target.path.clone(), mount_id: id, planned: target.top_dev, found })
        }
        _ => Ok(()),
    }
}

/// Gives a copy that propagation put on `target` (mount `top`, attached
/// and visible already) the stale layer's `attributes` if it has others:
/// nothing the heal did should make it so, so it is said loudly.
pub(super) fn carry_onto_copy(
    target: &TargetHeal,
    copy: BorrowedFd<'_>,
    top: u32,
    attributes: MountAttributes,
) -> Result<(), HealError> {
    let found = carry::attributes_of(copy, top, None, None)
        .map_err(|source| HealError::Attributes { path: target.path.clone(), source })?;
    if found.carried() == attributes.carried() {
        return Ok(());
    }
    warn!(
        target = %target.path.display(),
        found = found.bits(),
        stale = attributes.bits(),
        "a copy propagated onto the target has other attributes than its stale layer had; set to those now"
    );
    mount::set_attributes_of(copy, attributes, None)
        .map_err(HealError::mount("give the propagated copy the stale layer's attributes", &target.path))
}

/// Where a stack put the new source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Placed {
    /// On top of the stale layer, as a stack does.
    OnTop,
    /// Beneath it, where the stale layer's root cannot be mounted on: the
    /// stale layer is then on top, as after a flatten's slide.
    Beneath,
}

/// Detaches whatever a previous run left parked on `park`: a run killed in
/// the middle of a flatten leaves a new top there, which nobody would ever
/// move back, and which would pass for a bind of its source.
fn clear_park(park: &Path) -> std::io::Result<()> {
    let mut removed = 0;
    loop {
        match mount::detach(park) {
            Ok(()) => removed += 1,
            // Not a mount point (any more).
            Err(err) if err.kind() == std::io::ErrorKind::InvalidInput => break,
            Err(err) => return Err(err),
        }
    }
    if removed > 0 {
        warn!(park = %park.display(), removed, "mounts a previous run left parked removed");
    }
    Ok(())
}

/// What every flattening thread needs: the roots to resolve targets
/// beneath, and the parking directories.
#[derive(Debug)]
pub(super) struct Mounter {
    pub(super) kubelet_root: PathBuf,
    pub(super) kubelet_root_fd: OwnedFd,
    /// The namespace's root, for a source's binds outside the kubelet tree.
    pub(super) root_fd: OwnedFd,
    pub(super) staging: Staging,
}

impl Mounter {
    /// Resolves a target (no symlinks, no magic links, no escaping) and
    /// returns it with the ID of its top mount. Pod targets and CSI staging
    /// binds lie beneath the kubelet root and are resolved from it; a
    /// source's bind elsewhere (learned from the table as the source's peer,
    /// never from anything a pod wrote) from the namespace's root.
    pub(super) fn resolve_target(&self, path: &Path) -> Result<(OwnedFd, u32), HealError> {
        self.resolve_mount(path).map(|(fd, id, _)| (fd, id))
    }

    /// [`Mounter::resolve_target`], with the device of the top mount where
    /// the kernel tells it without asking the filesystem.
    pub(super) fn resolve_mount(&self, path: &Path) -> Result<(OwnedFd, u32, Option<Dev>), HealError> {
        let (base, relative) = match path.strip_prefix(&self.kubelet_root) {
            Ok(relative) => (self.kubelet_root_fd.as_fd(), relative),
            Err(_) => {
                let relative =
                    path.strip_prefix("/").map_err(|_| HealError::NotAbsolute { path: path.to_path_buf() })?;
                (self.root_fd.as_fd(), relative)
            }
        };
        let resolve_error = |source| HealError::Resolve { path: path.to_path_buf(), source };
        let fd = resolve::open_beneath(base, relative).map_err(resolve_error)?;
        let (id, dev) = resolve::mount_and_device_of(fd.as_fd()).map_err(resolve_error)?;
        Ok((fd, id, dev.map(Dev::from)))
    }

    /// A handle on the target's top, if it is still the planned one.
    pub(super) fn open_planned(&self, target: &TargetHeal) -> Result<OwnedFd, HealError> {
        let (fd, id, dev) = self.resolve_mount(&target.path)?;
        planned_top(target, id, dev)?;
        Ok(fd)
    }

    /// Stacks the new source onto the target unless an earlier stack of the
    /// batch reached it by propagation; either way returns a handle on the
    /// target's new top, for flattening. `source_dev` is the device of the
    /// source's new mount; `attributes` the stale top's own, which the new
    /// top gets (on the clone, before it is attached).
    pub(super) fn stack(
        &self,
        target: &TargetHeal,
        source: &SourceHandles,
        source_dev: Dev,
        attributes: MountAttributes,
        source_has: Option<MountAttributes>,
    ) -> Result<(Healed, OwnedFd, Placed), HealError> {
        let (fd, top, dev) = self.resolve_mount(&target.path)?;
        if let Err(changed) = planned_top(target, top, dev) {
            // An earlier stack of this batch propagated onto it if the new top
            // is on the source's connection; anything else was mounted there
            // by someone else: changed under the heal, like a failed check.
            if dev != Some(source_dev) {
                return Err(changed);
            }
            // `fd` was resolved onto the copy, whose attributes are the
            // stacked peer's: the same as this target's, since a target
            // whose differ was taken out of the group first; made sure of.
            carry_onto_copy(target, fd.as_fd(), top, attributes)?;
            return Ok((Healed::Propagated, fd, Placed::OnTop));
        }
        let clone = self.clone_for(target, source, attributes, source_has)?;
        // Attached, the clone's fd is a handle on the target's new mount.
        match mount::move_mount(clone.as_fd(), fd.as_fd()) {
            Ok(()) => Ok((Healed::Stacked, clone, Placed::OnTop)),
            // The stale layer's root directory is out of its filesystem's
            // tree (a subPath directory removed since it was bound, or its
            // dentry invalidated by a lookup through FUSE): the kernel mounts
            // nothing on an unhashed dentry, but the new source can go under
            // the stale layer, on the target's own directory.
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                mount::move_mount_beneath(clone.as_fd(), fd.as_fd())
                    .map_err(HealError::mount("slide the new source beneath the stale target", &target.path))?;
                debug!(target = %target.path.display(), "its stale root is out of its filesystem's tree: the new source slid beneath it");
                Ok((Healed::Stacked, clone, Placed::Beneath))
            }
            Err(err) => Err(HealError::mount("stack onto target", &target.path)(err)),
        }
    }

    /// A detached clone of the source's root for `target`, given the stale
    /// top's `attributes`. A clone has its source's attributes
    /// (`source_has`, where known): it is given the stale top's only where
    /// they differ.
    fn clone_for(
        &self,
        target: &TargetHeal,
        source: &SourceHandles,
        attributes: MountAttributes,
        source_has: Option<MountAttributes>,
    ) -> Result<OwnedFd, HealError> {
        let from = match source.for_root(&target.root_in_source) {
            Some(Ok(from)) => from,
            // A symlink, another mount, or gone: only the targets on this root fail.
            Some(Err(refusal)) => {
                return Err(HealError::SourceRootRefused {
                    path: target.path.clone(),
                    root: target.root_in_source.clone(),
                    source: Arc::clone(refusal),
                });
            }
            None => {
                return Err(HealError::NoSourceRoot { path: target.path.clone(), root: target.root_in_source.clone() });
            }
        };
        let clone = mount::clone_mount(from.as_fd()).map_err(HealError::mount("clone source", &target.path))?;
        if source_has.is_some_and(|has| has == attributes && !attributes.contains(MountAttributes::IDMAP)) {
            return Ok(clone);
        }
        let idmapped = carry::give_attributes(clone.as_fd(), attributes, None)
            .map_err(HealError::mount("give the clone the stale layer's attributes", &target.path))?;
        if idmapped {
            warn!(target = %target.path.display(), "the stale layer was idmapped: its new mount is not (the mapping's user namespace cannot be had from the mount)");
        }
        Ok(clone)
    }

    /// Slides a clone of the source, with the stale top's `attributes`,
    /// beneath the target's stale top `stale` (private, so nothing
    /// propagates from it): the target's final tree is in place, and only
    /// the stale layer's detach ([`Mounter::detach_slid`]) is left. Returns
    /// a handle on the new mount.
    pub(super) fn slide_in(
        &self,
        target: &TargetHeal,
        stale: BorrowedFd<'_>,
        source: &SourceHandles,
        attributes: MountAttributes,
        source_has: Option<MountAttributes>,
    ) -> Result<OwnedFd, HealError> {
        let clone = self.clone_for(target, source, attributes, source_has)?;
        mount::move_mount_beneath(clone.as_fd(), stale)
            .map_err(HealError::mount("slide the new source beneath the stale target", &target.path))?;
        Ok(clone)
    }

    /// Leaves one layer: parks the new top, removes every stale layer that
    /// was under it (private, so the removal does not propagate into
    /// containers: the planned top already is, the covered ones are made so
    /// on the way), and puts the new top back. `new_top` is the handle the
    /// stack returned: it is moved by handle, and the path is resolved again
    /// only to see what lies under the parked top.
    pub(super) fn flatten(
        &self,
        target: &TargetHeal,
        new_top: BorrowedFd<'_>,
        park: usize,
    ) -> Result<usize, HealError> {
        self.park(target, new_top, park)?;
        self.remove_under_parked(target, new_top)
    }

    pub(super) fn park(&self, target: &TargetHeal, new_top: BorrowedFd<'_>, park: usize) -> Result<(), HealError> {
        let park = self
            .staging
            .parks
            .get(park)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
            .map_err(HealError::mount("find a parking directory", &target.path))?;
        mount::move_mount(new_top, park.as_fd()).map_err(HealError::mount("park new top", &target.path))
    }

    /// With the new top parked: detaches each planned layer now on top at
    /// the target (making the lower ones private first), then puts the new
    /// top back, also when a removal failed. Returns the layers removed.
    pub(super) fn remove_under_parked(&self, target: &TargetHeal, new_top: BorrowedFd<'_>) -> Result<usize, HealError> {
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
                break Err(HealError::mount("remove stale layer", &target.path)(err));
            }
            removed += 1;
        };
        // Whatever happened, the new top goes back: a parked mount serves no one.
        let restore_onto = match result {
            Ok(fd) => fd,
            Err(err) => {
                let (fd, _) = self.resolve_target(&target.path)?;
                mount::move_mount(new_top, fd.as_fd()).map_err(HealError::mount("restore new top", &target.path))?;
                return Err(err);
            }
        };
        mount::move_mount(new_top, restore_onto.as_fd()).map_err(HealError::mount("restore new top", &target.path))?;
        Ok(removed)
    }

    /// The first half of flattening a target whose only stale layer is the
    /// (already private) planned top: parks the new top and slides it back
    /// *beneath* the stale layer (`MOVE_MOUNT_BENEATH`), so the target's
    /// final tree is in place and the stale layer sits on the root of a peer
    /// of the new source, where [`Mounter::detach_slid`] removes it. Where
    /// the kernel refuses this slide all the same, the stale layer is
    /// removed under the parked top instead: `Ok(Some(layers removed))`.
    pub(super) fn slide_beneath(
        &self,
        target: &TargetHeal,
        stale: BorrowedFd<'_>,
        new_top: BorrowedFd<'_>,
    ) -> Result<Option<usize>, HealError> {
        self.park(target, new_top, 0)?;
        crate::stop_point::reached(crate::stop_point::PARKED);
        match mount::move_mount_beneath(new_top, stale) {
            Ok(()) => Ok(None),
            Err(err) => {
                debug!(err = %chain(&err), path = %target.path.display(), "cannot slide the new top beneath; detaching the stale layer alone");
                self.remove_under_parked(target, new_top).map(Some)
            }
        }
    }

    /// Removes the stale layer a slide left on top of the new top (mount
    /// `new_id`), unless an earlier detach took it: a detach propagates to
    /// the same place on every peer of the detached mount's parent, so the
    /// first detach of a batch takes the stale layers of all the targets
    /// slid onto new tops with the same root, in one RCU grace period.
    /// Nothing else is mounted
    /// on the root of a peer of the source (the global mount, its copies in
    /// pods, their slaves in containers, whose mount paths Kubernetes keeps
    /// unique), and the kernel leaves a layer with mounts of its own on it
    /// (a copy a stack propagated there) for this function to detach.
    /// Returns whether it detached the layer itself.
    pub(super) fn detach_slid(&self, target: &TargetHeal, new_id: u32) -> Result<bool, HealError> {
        let (fd, top) = self.resolve_target(&target.path)?;
        if top == new_id {
            return Ok(false);
        }
        if top != target.top_mount_id {
            return Err(HealError::Changed { path: target.path.clone(), planned: target.top_mount_id, found: top });
        }
        // A layer no peer's detach reached: mounts on it keep the kernel
        // from taking it by propagation, and go with it now.
        super::warn_of_mounts_on_stale_layer(target, fd.as_fd());
        mount::detach_top(fd.as_fd()).map(|()| true).map_err(HealError::mount("remove stale layer", &target.path))
    }

    /// Detaches the stale top a cut-short slide left over the new source,
    /// unless a detach on a peer took it already (detaches propagate
    /// between layers slid onto peers' roots). Returns whether it detached
    /// it itself.
    pub(super) fn finish_slide(&self, target: &TargetHeal, source_dev: Dev) -> Result<bool, HealError> {
        let (fd, top) = self.resolve_target(&target.path)?;
        if top != target.top_mount_id {
            let found = resolve::device_of(fd.as_fd())
                .map_err(|source| HealError::Resolve { path: target.path.clone(), source })?;
            if found == (source_dev.major, source_dev.minor) {
                return Ok(false);
            }
            return Err(HealError::Changed { path: target.path.clone(), planned: target.top_mount_id, found: top });
        }
        // Private already if that heal made it so; made sure of here, so
        // that the detach reaches no container.
        mount::make_private(fd.as_fd()).map_err(HealError::mount("make stale layer private", &target.path))?;
        mount::detach_top(fd.as_fd()).map_err(HealError::mount("remove stale layer", &target.path))?;
        Ok(true)
    }
}
