//! Carrying a live mount from one mount namespace (the FUSE container's, or
//! the watched one) onto a stale mount in another (an application
//! container's): sidecar mode's heal, and node mode's heal in containers.
//!
//! On a thread of its own (it moves between namespaces): join the FUSE
//! container's namespace, clone the live mount (or its subdirectory, for a
//! subPath target), join the application container's namespace, check that
//! the target is still the recorded dead mount, give the clone its
//! attributes, and slide the clone beneath it (`MOVE_MOUNT_BENEATH`), with
//! the mounts nested in the dead one attached onto it, before detaching the
//! dead layer, so the container is left with exactly one layer and all it
//! had (see [`super::carry`]). Where sliding beneath is refused, the clone
//! is stacked on top and the dead layer stays under it.
//!
//! Unlike a node heal there is nothing to propagate: the target is the
//! container's own mount, and its processes see the change at once.
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use fuse_supervisor_sys::mount::{self, Propagation};
use fuse_supervisor_sys::{ns, resolve, statmount};

use super::carry::{self, Nested, NestedMount, NotCarried};
use super::nested_copies::{self, NestedCopies};
use crate::errors::chain;
use crate::heal::fuse_calls;
use crate::model::table::{Dev, FuseMount};
use tracing::debug;

/// A live mount in the FUSE container's namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveSource {
    pub namespace: u64,
    pub pid: u32,
    pub mount: FuseMount,
}

/// One stale mount in another namespace (an application container's) and
/// the live mount that replaces it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InNamespaceHeal {
    pub source: LiveSource,
    /// Where inside the source the target's root lies (empty for a whole
    /// volume, `sub` for a subPath of `sub`).
    pub subdir: PathBuf,
    pub namespace: u64,
    pub pid: u32,
    pub target: FuseMount,
    /// The target's 64-bit unique mount ID, where its read gave it.
    pub target_unique_id: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum InNamespaceError {
    #[error("cannot open mount namespace {path}")]
    OpenNamespace {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("process {pid} is no longer in mount namespace {expected} (now {found})")]
    NamespaceChanged { pid: u32, expected: u64, found: u64 },
    #[error("cannot enter the mount namespace of process {pid}")]
    Enter {
        pid: u32,
        #[source]
        source: io::Error,
    },
    #[error("cannot resolve {path} in the mount namespace of process {pid}")]
    Resolve {
        pid: u32,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "{path} in the mount namespace of process {pid} changed (mount {found} on {found_dev}, recorded {recorded})"
    )]
    Changed { pid: u32, path: PathBuf, recorded: u32, found: u32, found_dev: Dev },
    #[error(
        "{path} in the mount namespace of process {pid} lies below a {fs_type} mount at {below}, whose lookups its server may never answer; not walked"
    )]
    BelowStalling { pid: u32, path: PathBuf, below: PathBuf, fs_type: String },
    #[error("cannot read the attributes of {path} in the mount namespace of process {pid}")]
    Attributes {
        pid: u32,
        path: PathBuf,
        #[source]
        source: carry::CarryError,
    },
    #[error("{step} failed for {path} in the mount namespace of process {pid}")]
    Mount {
        step: &'static str,
        pid: u32,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// How a target was healed.
#[derive(Debug)]
pub enum InNamespaceHealed {
    /// The clone went beneath the dead mount, which was then detached: one
    /// layer. `not_carried`: what of the dead mount it could not take over.
    Replaced { not_carried: Vec<NotCarried> },
    /// The clone was stacked on the dead mount, which stays under it
    /// (`why`: sliding beneath or detaching was refused).
    Stacked { why: io::Error, not_carried: Vec<NotCarried> },
}

/// The namespaces one heal moves between, opened before the thread leaves
/// its own (paths under `/proc` mean another tree once it has).
pub struct HealNamespaces {
    source: OwnedFd,
    target: OwnedFd,
}

impl HealNamespaces {
    /// Opens `<proc_root>/<pid>/ns/mnt` of the source's and the target's
    /// process and checks each is still the namespace the plan recorded
    /// (a pid reused by a process elsewhere is refused).
    pub fn open(proc_root: &Path, heal: &InNamespaceHeal) -> Result<Self, InNamespaceError> {
        Ok(HealNamespaces {
            source: open_namespace(proc_root, heal.source.pid, heal.source.namespace)?,
            target: open_namespace(proc_root, heal.pid, heal.namespace)?,
        })
    }
}

impl HealNamespaces {
    /// Namespaces the caller already opened and checked: node mode's
    /// watched namespace and a container's.
    pub fn from_fds(source: OwnedFd, target: OwnedFd) -> Self {
        HealNamespaces { source, target }
    }
}

fn open_namespace(proc_root: &Path, pid: u32, expected: u64) -> Result<OwnedFd, InNamespaceError> {
    let path = proc_root.join(pid.to_string()).join("ns/mnt");
    let opened = File::open(&path).and_then(|file| Ok((file.metadata()?.ino(), file)));
    let (found, file) = opened.map_err(|source| InNamespaceError::OpenNamespace { path: path.clone(), source })?;
    if found != expected {
        return Err(InNamespaceError::NamespaceChanged { pid, expected, found });
    }
    Ok(file.into())
}

/// Heals one target. Call on a thread dedicated to it: the thread ends in
/// the application container's namespace. The clone gets the dead mount's
/// attributes before it is attached, and the mounts on the dead one are
/// moved onto it before the dead one goes (`nested`: handles on them taken
/// at the death; any others are looked for now). With `clone_propagation`,
/// the clone gets it too, in the same call: a clone comes back a peer of the
/// live mount, so mounts the container made under it would reach the
/// source's namespace; `Slave` keeps a `HostToContainer` volume receiving
/// the host's mounts, `Private` is a `None` volume's.
///
/// `live` is a handle on what to clone (the source's root, or the subPath's
/// directory in it) that the caller already holds, the probe's: then
/// nothing of the source is looked up again, so a new daemon that answered
/// its probe and hangs since holds no thread here. Without it the source is
/// opened through its mount point, and a subPath's directory in it by the
/// FUSE call helper ([`fuse_calls`]).
pub fn heal_in_namespaces(
    heal: &InNamespaceHeal,
    namespaces: &HealNamespaces,
    clone_propagation: Option<Propagation>,
    live: Option<BorrowedFd<'_>>,
    nested: Option<Nested>,
    copies: Option<&NestedCopies>,
) -> Result<InNamespaceHealed, InNamespaceError> {
    let source_pid = heal.source.pid;
    // The supervisor's /proc: the target namespace's may be another pid
    // namespace's, where this thread has no entry.
    let proc = resolve::open_dir(Path::new("/proc")).map_err(|source| InNamespaceError::Resolve {
        pid: source_pid,
        path: PathBuf::from("/proc"),
        source,
    })?;
    let pid = heal.pid;
    let target_path = &heal.target.mount_point;
    // The dead mount first: one the tenant changed or covered is refused
    // before anything is cloned. A clone let go unused is unmounted, and
    // each unmount waits for an expedited RCU grace period: a tenant's 200
    // covered binds cost 200 of them per attempt, which on two loaded CPUs
    // held the namespace's worker for 15 s.
    enter(namespaces.target.as_fd(), pid)?;
    let stale = open_recorded(pid, &heal.target, heal.target_unique_id)?;
    enter(namespaces.source.as_fd(), source_pid)?;
    let step = |step, pid, path: &Path| {
        let path = path.to_path_buf();
        move |source| InNamespaceError::Mount { step, pid, path, source }
    };
    let opened;
    let from = match live {
        Some(live) => live,
        None => {
            let live = open_recorded(source_pid, &heal.source.mount, None)?;
            opened =
                if heal.subdir.as_os_str().is_empty() {
                    live
                } else {
                    let path = heal.source.mount.mount_point.join(&heal.subdir);
                    fuse_calls::open_beneath(live.as_fd(), &heal.subdir)
                        .map_err(|source| InNamespaceError::Resolve { pid: source_pid, path, source })?
                };
            opened.as_fd()
        }
    };
    let clone = mount::clone_mount(from).map_err(step("clone the live mount", source_pid, &from_path(heal)))?;
    enter(namespaces.target.as_fd(), pid)?;
    // The dead mount's attributes, read from its mount (never its dead
    // filesystem), go onto the clone with its propagation while it is
    // detached: no process ever sees the replacement with the source's
    // (a readOnly volume stays read-only throughout).
    let (attributes, private) = carry::attributes_and_privacy_of(
        stale.as_fd(),
        heal.target.mount_id,
        heal.target_unique_id,
        Some(proc.as_fd()),
    )
    .map_err(|source| InNamespaceError::Attributes { pid, path: target_path.clone(), source })?;
    let idmapped = carry::give_attributes(clone.as_fd(), attributes, clone_propagation).map_err(step(
        "give the clone the dead mount's attributes and propagation",
        pid,
        target_path,
    ))?;
    let mut not_carried = Vec::new();
    let dead_unique = heal.target_unique_id.map_or_else(|| resolve::unique_mount_id_of(stale.as_fd()), Ok);
    if idmapped {
        let users = carry::ContainerUsers::of(proc.as_fd(), pid);
        let given = match &dead_unique {
            Ok(dead_unique) => carry::give_idmapping(clone.as_fd(), *dead_unique, users.as_ref()),
            Err(err) => Err(format!("it was idmapped, and its unique ID cannot be had to read its mapping ({err})")),
        };
        if let Err(why) = given {
            let why = format!("{why}: the new mount shows owners unmapped");
            not_carried.push(NotCarried { mount_point: target_path.clone(), why });
        }
    }
    // The mounts on the dead one: those held since its death, and any made
    // since (reached now if their mount points still resolve); where it was
    // not isolated, the copies taken ahead stand in for those that do not.
    let isolated = nested.is_some();
    let mut nested = nested.unwrap_or_default();
    match dead_unique {
        Ok(dead_unique) => {
            let held = nested.held.iter().map(|mount| mount.unique_id).collect();
            let mut found = carry::take_nested(stale.as_fd(), dead_unique, target_path, &held);
            let ahead = copies.map(|copies| copies.take(dead_unique)).unwrap_or_default();
            if !isolated {
                found = nested_copies::stand_in(found, ahead, target_path);
            }
            nested.held.extend(found.held);
            nested.missed.extend(found.missed);
        }
        Err(err) => nested.missed.push(NotCarried {
            mount_point: target_path.join("*"),
            why: format!("the dead mount's unique ID cannot be had to list the mounts on it: {err}"),
        }),
    }
    not_carried.extend(nested.missed);
    // Made private when its daemon died (`containers::isolate`), unless
    // found only now or the isolation failed: a call that takes the
    // namespace lock for writing, saved where the kernel says it is.
    let made_private = match private {
        Some(true) => Ok(()),
        _ => mount::make_private(stale.as_fd()),
    };
    let replaced = made_private.and_then(|()| mount::move_mount_beneath(clone.as_fd(), stale.as_fd()));
    match replaced {
        Ok(()) => {
            // Beneath the dead mount, out of sight: the nested mounts go onto
            // it before the dead one is detached (which would take them).
            let carried = carry::carry_nested(nested.held, clone.as_fd(), target_path, copies.is_some());
            not_carried.extend(carried.missed);
            copy_ahead(copies, heal.namespace, clone.as_fd(), carried.copies);
            // The dead mount is on top, and private: detaching it reaches no
            // other namespace.
            mount::detach_top_through(proc.as_fd(), stale.as_fd()).map_err(step(
                "detach the dead mount",
                pid,
                target_path,
            ))?;
            // Often the dead filesystem's last reference: its teardown must
            // not hold this heal (see `let_go`).
            super::let_go::let_go(stale);
            Ok(InNamespaceHealed::Replaced { not_carried })
        }
        Err(why) => {
            mount::move_mount(clone.as_fd(), stale.as_fd()).map_err(step(
                "stack onto the dead mount",
                pid,
                target_path,
            ))?;
            // On top already: the nested mounts show once moved onto it.
            let carried = carry::carry_nested(nested.held, clone.as_fd(), target_path, copies.is_some());
            not_carried.extend(carried.missed);
            copy_ahead(copies, heal.namespace, clone.as_fd(), carried.copies);
            Ok(InNamespaceHealed::Stacked { why, not_carried })
        }
    }
}

/// Holds `copied`, copies of the mounts carried onto `replacement` (in
/// `namespace`), for the next heal.
fn copy_ahead(copies: Option<&NestedCopies>, namespace: u64, replacement: BorrowedFd<'_>, copied: Vec<NestedMount>) {
    let Some(copies) = copies else { return };
    if copied.is_empty() {
        return;
    }
    match resolve::unique_mount_id_of(replacement) {
        Ok(unique) => copies.put(namespace, unique, copied),
        // Copied at its death instead, if the mounts still resolve then.
        Err(err) => {
            debug!(err = %chain(&err), namespace, "cannot name the replacement to hold copies of the mounts on it")
        }
    }
}

fn from_path(heal: &InNamespaceHeal) -> PathBuf {
    heal.source.mount.mount_point.join(&heal.subdir)
}

fn enter(namespace: BorrowedFd<'_>, pid: u32) -> Result<(), InNamespaceError> {
    ns::enter_mount_namespace(namespace).map_err(|source| InNamespaceError::Enter { pid, source })
}

/// Resolves `recorded.mount_point` beneath the root of the namespace the
/// thread is in (no symlinks, no magic links: the container's tree is not
/// trusted) and checks that the mount on top there is the recorded one.
///
/// Never a name looked up inside a mount whose lookups a tenant's or a
/// remote server answers (FUSE, network filesystems, an overlay that may
/// stack them; the namespace's root mount is the runtime's and is trusted):
/// a tenant that mounts its own FUSE filesystem above its copy of a volume
/// and stops answering would otherwise hold the walking thread in the
/// kernel for good. Crossing onto a mount asks its filesystem nothing; only
/// the lookup of a name inside it would, and that is refused. The mount
/// point itself may be FUSE: it is the recorded mount, checked without
/// asking its server. See [`open_parent`] for how the way there is walked.
///
/// With `unique_id` (the mount's 64-bit ID, never reused), the mount found
/// must have it too: a 32-bit mount ID comes back for the next mount once
/// the kernel freed it.
pub(crate) fn open_recorded(
    pid: u32,
    recorded: &FuseMount,
    unique_id: Option<u64>,
) -> Result<OwnedFd, InNamespaceError> {
    let path = &recorded.mount_point;
    let resolve_error = |source| InNamespaceError::Resolve { pid, path: path.clone(), source };
    let root = resolve::open_dir(Path::new("/")).map_err(resolve_error)?;
    let relative = path.strip_prefix("/").unwrap_or(path);
    let at = match (relative.parent(), relative.file_name()) {
        (Some(parent), Some(name)) => {
            let parent = open_parent(pid, path, root, parent)?;
            resolve::open_beneath(parent.as_fd(), Path::new(name)).map_err(resolve_error)?
        }
        // The namespace's root itself.
        _ => root,
    };
    let (found_mount, found_device) = resolve::mount_and_device_of(at.as_fd()).map_err(resolve_error)?;
    let found_dev = match found_device {
        Some(device) => Dev::from(device),
        None => Dev::from(resolve::device_of(at.as_fd()).map_err(resolve_error)?),
    };
    // Where the kernel cannot tell (a FUSE inode marked bad answers statx
    // with EIO), the 32-bit ID and the device decide alone.
    let another =
        unique_id.is_some_and(|recorded| resolve::unique_mount_id_of(at.as_fd()).is_ok_and(|found| found != recorded));
    if another || found_mount != recorded.mount_id || found_dev != recorded.dev {
        return Err(InNamespaceError::Changed {
            pid,
            path: path.clone(),
            recorded: recorded.mount_id,
            found: found_mount,
            found_dev,
        });
    }
    Ok(at)
}

/// The directory `parent` names beneath `root` (the mount point's parent,
/// relative), for [`open_recorded`]. As much of the way as lies within one
/// mount is looked up in one call that crosses no mount, so that it asks no
/// filesystem but that mount's; where a mount lies on the way, the walk
/// goes a component at a time up to it, refuses to look up anything inside
/// it if its lookups may stall, and goes on from there the same way. In a
/// container the way usually lies within its root (one call); a component
/// at a time it was an `openat2` and a `statx` per component, a third of
/// a container heal's CPU for a pod's target in the heal bench.
fn open_parent(pid: u32, path: &Path, root: OwnedFd, parent: &Path) -> Result<OwnedFd, InNamespaceError> {
    let resolve_error = |source| InNamespaceError::Resolve { pid, path: path.to_path_buf(), source };
    let components: Vec<&std::ffi::OsStr> = parent.components().map(|component| component.as_os_str()).collect();
    let mut at = root;
    let mut at_mount = None;
    let mut walked = PathBuf::from("/");
    let mut done = 0;
    while done < components.len() {
        let rest: PathBuf = components[done..].iter().collect();
        match resolve::open_beneath_within_mount(at.as_fd(), &rest) {
            Ok(opened) => return Ok(opened),
            Err(err) if err.kind() == io::ErrorKind::CrossesDevices => {}
            Err(err) => return Err(resolve_error(err)),
        }
        // A mount on the way: a component at a time until it is crossed.
        let mut mount = match at_mount {
            Some(mount) => mount,
            None => resolve::mount_and_device_of(at.as_fd()).map_err(resolve_error)?.0,
        };
        while done < components.len() {
            let next = resolve::open_beneath(at.as_fd(), Path::new(components[done])).map_err(resolve_error)?;
            walked.push(components[done]);
            done += 1;
            let (next_mount, _) = resolve::mount_and_device_of(next.as_fd()).map_err(resolve_error)?;
            let crossed = next_mount != mount;
            if crossed && let Some(fs_type) = stalling_fs_type(next.as_fd()) {
                return Err(InNamespaceError::BelowStalling { pid, path: path.to_path_buf(), below: walked, fs_type });
            }
            (at, mount) = (next, next_mount);
            if crossed {
                break;
            }
        }
        at_mount = Some(mount);
    }
    Ok(at)
}

/// The type of the mount `fd` is on, if a lookup inside it may wait on a
/// server that never answers. Asked of the kernel's mount (`statmount`),
/// never of the filesystem; a kernel without `statmount` (before 6.8)
/// cannot tell, and the walk goes on as it always did.
fn stalling_fs_type(fd: BorrowedFd<'_>) -> Option<String> {
    let unique = resolve::unique_mount_id_of(fd).ok()?;
    let fs_type = statmount::fs_type(unique).ok()?;
    lookups_may_stall(&fs_type).then_some(fs_type)
}

/// FUSE (a tenant's own server, or a hung daemon), the network
/// filesystems (a server away), and overlays, whose layers may be either.
fn lookups_may_stall(fs_type: &str) -> bool {
    fs_type.starts_with("fuse")
        || fs_type.starts_with("nfs")
        || matches!(
            fs_type,
            "overlay"
                | "cifs"
                | "smb3"
                | "smbfs"
                | "9p"
                | "ceph"
                | "glusterfs"
                | "afs"
                | "lustre"
                | "virtiofs"
                | "gfs2"
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mount found must carry the recorded unique ID: the 32-bit ID and
    /// the device alike are not enough.
    #[test]
    fn a_mount_with_the_recorded_id_and_device_but_another_unique_id_has_changed() {
        let root = resolve::open_dir(Path::new("/")).unwrap();
        let recorded = FuseMount {
            mount_id: resolve::mount_id_of(root.as_fd()).unwrap(),
            parent_id: 0,
            dev: Dev::from(resolve::device_of(root.as_fd()).unwrap()),
            root: "/".into(),
            mount_point: "/".into(),
            peer_group: None,
            master: None,
            fs_type: "ext4".into(),
            source: String::new(),
            table_order: 0,
        };
        let unique = resolve::unique_mount_id_of(root.as_fd()).expect("STATX_MNT_ID_UNIQUE (Linux 6.8+)");
        assert!(open_recorded(1, &recorded, None).is_ok());
        assert!(open_recorded(1, &recorded, Some(unique)).is_ok());
        let reused = open_recorded(1, &recorded, Some(unique + 1));
        assert!(matches!(reused, Err(InNamespaceError::Changed { .. })), "{reused:?}");
    }

    /// A mount of this process's table whose way from the root crosses
    /// another mount (`/sys/fs/cgroup` under `/sys`, `/dev/pts` under
    /// `/dev`): found, and found changed when another is recorded there.
    #[test]
    fn a_mount_point_whose_way_crosses_another_mount_is_found() {
        let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let mounts: Vec<(u32, Dev, PathBuf, String)> = table
            .lines()
            .filter_map(|line| {
                let (fields, after) = line.split_once(" - ")?;
                let fields: Vec<&str> = fields.split(' ').collect();
                let (major, minor) = fields.get(2)?.split_once(':')?;
                let dev = Dev { major: major.parse().ok()?, minor: minor.parse().ok()? };
                let fs_type = after.split(' ').next()?.to_string();
                Some((fields[0].parse().ok()?, dev, PathBuf::from(fields.get(4)?), fs_type))
            })
            .collect();
        let is_mount_point = |path: &Path| mounts.iter().any(|(_, _, point, _)| point == path);
        let (mount_id, dev, point, fs_type) = mounts
            .iter()
            .find(|(_, _, point, fs_type)| {
                let crossed = point.ancestors().skip(1).any(|above| above != Path::new("/") && is_mount_point(above));
                // Once in the table: not covered by a later mount there.
                let on_top = mounts.iter().filter(|(_, _, other, _)| other == point).count() == 1;
                crossed && on_top && !point.to_string_lossy().contains('\\') && !lookups_may_stall(fs_type)
            })
            .expect("this machine mounts something under another mount (/sys/fs/cgroup, /dev/pts)");
        let recorded = FuseMount {
            mount_id: *mount_id,
            parent_id: 0,
            dev: *dev,
            root: "/".into(),
            mount_point: point.clone(),
            peer_group: None,
            master: None,
            fs_type: fs_type.clone(),
            source: String::new(),
            table_order: 0,
        };
        let found = open_recorded(1, &recorded, None);
        assert!(found.is_ok(), "{}: {found:?}", point.display());
        let other = FuseMount { mount_id: mount_id + 100_000, ..recorded };
        let changed = open_recorded(1, &other, None);
        assert!(matches!(changed, Err(InNamespaceError::Changed { .. })), "{changed:?}");
    }

    #[test]
    fn fuse_network_and_overlay_mounts_may_stall_a_lookup() {
        for stalls in ["fuse", "fuse.bindfs", "fuseblk", "nfs", "nfs4", "cifs", "9p", "ceph", "overlay", "virtiofs"] {
            assert!(lookups_may_stall(stalls), "{stalls}");
        }
        for answers in ["ext4", "xfs", "tmpfs", "proc", "btrfs", "squashfs"] {
            assert!(!lookups_may_stall(answers), "{answers}");
        }
    }
}
