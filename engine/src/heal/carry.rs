//! What a replacement takes over from the dead mount it replaces, so that a
//! heal changes the connection and nothing else: the dead mount's own
//! attributes (read-only, nosuid, nodev, noexec, atime mode, nosymfollow),
//! and the mounts made on it (a configMap at `<volume>/config`).
//!
//! Both are read from the kernel's mount, never through the dead
//! filesystem: the attributes with `statmount` (Linux 6.8), or from the
//! per-mount options of the mount table where the kernel has no
//! `statmount`; the mounts on it with `listmount` (6.8). Handles on those
//! mounts must be taken while their mount points still resolve: a lookup
//! in a dead FUSE mount is answered from the dentry cache until the entry
//! timeout runs out, and fails with ENOTCONN after it. So they are taken
//! ahead, while the daemon is alive (see [`super::nested_copies`]), again
//! when the death is seen (see [`super::containers::isolate`]), and at the
//! heal for any made since.
use std::collections::BTreeSet;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use fuse_supervisor_sys::mount::{self, MountAttributes};
use fuse_supervisor_sys::statmount::{self, Idmapping, Namespace};
use fuse_supervisor_sys::{listmount, probe, resolve};
use tracing::{info, warn};

use crate::errors::chain;
use crate::heal::fuse_calls;
use crate::model::mountinfo::{CappedLine, CappedLines};

#[derive(Debug, thiserror::Error)]
pub enum CarryError {
    #[error("cannot read the attributes of mount {mount_id} (statmount, then the mount table)")]
    Attributes {
        mount_id: u32,
        #[source]
        source: io::Error,
    },
    #[error("mount {mount_id} is not in the mount table of this thread's namespace")]
    NotInTable { mount_id: u32 },
}

/// The attributes of the mount `fd` is on (its 32-bit ID `mount_id`, its
/// 64-bit one `unique_id` where known), in the calling thread's namespace.
/// `proc` is a `/proc` of the supervisor's, opened before the thread left
/// its own namespace (the mount table read where `statmount` cannot).
pub fn attributes_of(
    fd: BorrowedFd<'_>,
    mount_id: u32,
    unique_id: Option<u64>,
    proc: Option<BorrowedFd<'_>>,
) -> Result<MountAttributes, CarryError> {
    attributes_and_privacy_of(fd, mount_id, unique_id, proc).map(|(attributes, _)| attributes)
}

/// [`attributes_of`], and whether the mount is private where `statmount`
/// says so in the same answer (None where the table was read).
pub fn attributes_and_privacy_of(
    fd: BorrowedFd<'_>,
    mount_id: u32,
    unique_id: Option<u64>,
    proc: Option<BorrowedFd<'_>>,
) -> Result<(MountAttributes, Option<bool>), CarryError> {
    let unique = unique_id.map_or_else(|| resolve::unique_mount_id_of(fd), Ok);
    let stated = unique.and_then(|unique| statmount::mount_attributes_and_privacy(unique, Namespace::Current));
    match stated {
        Ok((attributes, private)) => Ok((attributes, Some(private))),
        Err(err) => {
            static SAID: AtomicBool = AtomicBool::new(false);
            if !SAID.swap(true, Ordering::Relaxed) {
                info!(err = %chain(&err), "statmount cannot say a mount's attributes (before Linux 6.8?): they are read from the mount table, which costs a read of it per heal");
            }
            attributes_from_table(mount_id, proc).map(|attributes| (attributes, None))
        }
    }
}

/// The per-mount options of mount `mount_id` in `<proc>/thread-self/mountinfo`
/// (the calling thread's namespace), read a line at a time: a tenant
/// decides how long its table is.
fn attributes_from_table(mount_id: u32, proc: Option<BorrowedFd<'_>>) -> Result<MountAttributes, CarryError> {
    let error = |source| CarryError::Attributes { mount_id, source };
    let table = match proc {
        Some(proc) => resolve::open_readable_in(proc, Path::new("thread-self/mountinfo")).map(std::fs::File::from),
        None => std::fs::File::open("/proc/thread-self/mountinfo"),
    }
    .map_err(error)?;
    let mut lines = CappedLines::new(table, 64 * 1024);
    let wanted = mount_id.to_string();
    while let Some(line) = lines.next_line().map_err(error)? {
        let CappedLine::Line(line) = line else { continue };
        let mut fields = line.split(|&byte| byte == b' ');
        if fields.next() != Some(wanted.as_bytes()) {
            continue;
        }
        let options = fields.nth(4).ok_or_else(|| error(io::Error::from(io::ErrorKind::InvalidData)))?;
        return Ok(attributes_of_options(&String::from_utf8_lossy(options)));
    }
    Err(CarryError::NotInTable { mount_id })
}

/// The attributes mountinfo's per-mount options (`ro,nosuid,nodev,relatime`)
/// name. No atime option is strictatime (the kernel prints relatime and
/// noatime, and nothing for strict).
pub fn attributes_of_options(options: &str) -> MountAttributes {
    let mut attributes = MountAttributes::STRICTATIME;
    for option in options.split(',') {
        let flag = match option {
            "ro" => MountAttributes::READ_ONLY,
            "nosuid" => MountAttributes::NOSUID,
            "nodev" => MountAttributes::NODEV,
            "noexec" => MountAttributes::NOEXEC,
            "nodiratime" => MountAttributes::NODIRATIME,
            "nosymfollow" => MountAttributes::NOSYMFOLLOW,
            "idmapped" => MountAttributes::IDMAP,
            "noatime" => {
                attributes = MountAttributes::from_bits(attributes.bits() & !MountAttributes::STRICTATIME.bits());
                MountAttributes::NOATIME
            }
            "relatime" => {
                attributes = MountAttributes::from_bits(attributes.bits() & !MountAttributes::STRICTATIME.bits());
                continue;
            }
            _ => continue,
        };
        attributes = attributes.union(flag);
    }
    attributes
}

/// Gives the detached `clone` the attributes of the dead mount it replaces
/// (and `propagation`, in the same call), before it is attached: nothing
/// ever sees it with its source's. Returns whether the dead mount was
/// idmapped, which takes another call ([`give_idmapping`]).
pub fn give_attributes(
    clone: BorrowedFd<'_>,
    attributes: MountAttributes,
    propagation: Option<mount::Propagation>,
) -> io::Result<bool> {
    mount::set_attributes_of(clone, attributes, propagation)?;
    Ok(attributes.contains(MountAttributes::IDMAP))
}

/// The user namespace a container's process is in, with its maps: what a
/// runtime idmaps a user-namespace pod's volumes with.
#[derive(Debug)]
pub struct ContainerUsers {
    namespace: OwnedFd,
    mapping: Idmapping,
}

impl ContainerUsers {
    /// Those of process `pid`, through `proc` (the agent's `/proc`, opened
    /// before the thread joined another mount namespace, whose own `/proc`
    /// may show another pid namespace); None where it is in this process's
    /// own user namespace (no pod of its kind idmaps), or gone. Asked only
    /// of a mount found idmapped: a lookup through `/proc` a container heal
    /// otherwise saves.
    pub fn of(proc: BorrowedFd<'_>, pid: u32) -> Option<ContainerUsers> {
        use std::io::Read;
        use std::os::unix::fs::MetadataExt;
        // This process's own user namespace never changes: read once.
        static OWN: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
        let open = |path: &str| resolve::open_readable_in(proc, Path::new(path)).ok().map(std::fs::File::from);
        let inode = |file: &std::fs::File| file.metadata().ok().map(|meta| meta.ino());
        let own = *OWN.get_or_init(|| open("self/ns/user").as_ref().and_then(inode));
        let theirs = open(&format!("{pid}/ns/user"))?;
        if inode(&theirs)? == own? {
            return None;
        }
        let map = |name: &str| {
            let mut text = Vec::new();
            open(&format!("{pid}/{name}"))?.read_to_end(&mut text).ok()?;
            Idmapping::parse_map(&text)
        };
        Some(ContainerUsers {
            namespace: theirs.into(),
            mapping: Idmapping { uid: map("uid_map")?, gid: map("gid_map")? },
        })
    }
}

/// Gives `clone` (detached) the idmapping of the dead mount `dead_unique`
/// (in the calling thread's namespace): the kernel says what a mount's
/// mapping is (`statmount`, 6.15) but not through which user namespace, and
/// `mount_setattr` needs one. The container's (`users`) is the one its
/// runtime idmaps its volumes with; it is used once its maps are checked
/// to be the dead mount's. Returns why not otherwise.
pub fn give_idmapping(clone: BorrowedFd<'_>, dead_unique: u64, users: Option<&ContainerUsers>) -> Result<(), String> {
    let dead = match statmount::mount_idmapping(dead_unique, Namespace::Current) {
        Ok(Some(dead)) => dead,
        Ok(None) => return Ok(()),
        Err(err) => return Err(format!("its idmapping cannot be read ({err})")),
    };
    let Some(users) = users else {
        return Err("it was idmapped, and its container's processes are in the node's own user namespace".into());
    };
    if users.mapping != dead {
        return Err("it was idmapped, but not with its container's user namespace's maps".into());
    }
    mount::set_idmapping_of(clone, users.namespace.as_fd())
        .map_err(|err| format!("it was idmapped, and the new mount cannot be ({err})"))
}

/// A mount made on a dead mount, held by a detached copy of it and of
/// every mount below it.
#[derive(Debug)]
pub struct NestedMount {
    /// The original's: the order mounts were made in.
    pub unique_id: u64,
    /// Its mount point relative to the dead mount's root.
    pub relative: PathBuf,
    pub copy: OwnedFd,
}

/// A mount on a dead mount that no handle could be had on (or that could
/// not be carried over), and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotCarried {
    /// Where it was, in its namespace (or on the host).
    pub mount_point: PathBuf,
    pub why: String,
}

/// The mounts found on a dead mount: those held, and those missed.
#[derive(Debug, Default)]
pub struct Nested {
    pub held: Vec<NestedMount>,
    pub missed: Vec<NotCarried>,
}

/// How many mounts on one dead mount are looked for: a tenant decides how
/// many it makes.
const MOST_NESTED: usize = 4096;

/// Takes a copy of each mount made directly on the dead mount `dead`
/// (unique ID `dead_unique`, mounted at `dead_point` in the calling
/// thread's namespace), in creation order, except those in `held`. Found
/// by `listmount` of the namespace; each is reached from `dead` without
/// leaving the dead mount until its own mount point (`RESOLVE_NO_XDEV`):
/// the names looked up are the dead connection's, whose lookups are
/// answered from the dentry cache or fail at once, never a tenant's FUSE
/// server's. Each is checked to be the mount listed before it is copied.
pub fn take_nested(dead: BorrowedFd<'_>, dead_unique: u64, dead_point: &Path, held: &BTreeSet<u64>) -> Nested {
    let mut nested = Nested::default();
    let listed = mounts_on(dead_unique, dead_point, &mut nested.missed);
    for MountOn { unique, relative, .. } in listed.into_iter().filter(|on| !held.contains(&on.unique)) {
        match open_nested(dead, &relative, unique) {
            Ok(copy) => nested.held.push(NestedMount { unique_id: unique, relative, copy }),
            Err(err) => {
                nested.missed.push(NotCarried { mount_point: dead_point.join(&relative), why: err.to_string() })
            }
        }
    }
    nested
}

/// Takes a copy of each mount made directly on the live mount `live`
/// (unique ID `live_unique`, at `point` in the calling thread's namespace)
/// but FUSE ones, ahead of any death: a lookup of a mount point in a dead
/// mount whose entry timed out detaches the mounts on it before the death
/// is even seen (see [`super::nested_copies`]). The lookups are `live`'s
/// server's, so the FUSE call helper makes them. A FUSE mount on it is left
/// to the heal (a copy would keep its connection alive: a dead one's
/// mount would outlive its heal).
pub fn copy_nested_live(live: BorrowedFd<'_>, live_unique: u64, point: &Path) -> Nested {
    let mut nested = Nested::default();
    let listed: Vec<MountOn> =
        mounts_on(live_unique, point, &mut nested.missed).into_iter().filter(|on| !on.is_fuse).collect();
    let copied = copy_listed(live, listed, point);
    nested.held.extend(copied.held);
    nested.missed.extend(copied.missed);
    nested
}

/// Takes a copy of each of `listed`, mounts on the mount `on` (at `point`),
/// reached through the FUSE call helper: the lookups on the way are `on`'s
/// server's, which may be alive.
fn copy_listed(on: BorrowedFd<'_>, listed: Vec<MountOn>, point: &Path) -> Nested {
    let mut nested = Nested::default();
    let relatives: Vec<PathBuf> = listed.iter().map(|on| on.relative.clone()).collect();
    let opened = fuse_calls::open_mounts_within(on, &relatives);
    for (MountOn { unique, relative, .. }, opened) in listed.into_iter().zip(opened) {
        let copied = opened.and_then(|opened| copy_if_listed(opened.as_fd(), unique));
        match copied {
            Ok(copy) => nested.held.push(NestedMount { unique_id: unique, relative, copy }),
            Err(err) => nested.missed.push(NotCarried { mount_point: point.join(&relative), why: err.to_string() }),
        }
    }
    nested
}

/// A mount made on another.
struct MountOn {
    unique: u64,
    /// Its mount point relative to the other's.
    relative: PathBuf,
    is_fuse: bool,
}

/// The mounts made directly on mount `parent_unique` (at `point` in the
/// calling thread's namespace), in creation order; what cannot be listed
/// goes to `missed`.
fn mounts_on(parent_unique: u64, point: &Path, missed: &mut Vec<NotCarried>) -> Vec<MountOn> {
    let listed = match listmount::children(parent_unique, MOST_NESTED) {
        Ok(listed) => listed,
        Err(err) => {
            static SAID: AtomicBool = AtomicBool::new(false);
            if !SAID.swap(true, Ordering::Relaxed) {
                warn!(err = %chain(&err), "listmount cannot list the mounts on a mount (before Linux 6.8?): mounts nested in a volume are not carried over by its heal");
            }
            missed
                .push(NotCarried { mount_point: point.join("*"), why: format!("cannot list the mounts on it: {err}") });
            return Vec::new();
        }
    };
    if listed.len() == MOST_NESTED {
        missed.push(NotCarried { mount_point: point.join("*"), why: format!("more than {MOST_NESTED} mounts on it") });
    }
    let mut on = Vec::new();
    for unique in listed {
        // listmount lists every mount below (6.10+) or those on it (6.8):
        // only those on the mount itself are moved; the rest go with them.
        let stat = match statmount::mount_stat(unique, Namespace::Current) {
            Ok(stat) if stat.parent_unique_id == parent_unique => stat,
            Ok(_) => continue,
            // Gone since it was listed.
            Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
            Err(err) => {
                missed.push(NotCarried { mount_point: point.join("?"), why: err.to_string() });
                continue;
            }
        };
        match stat.mount_point.strip_prefix(point) {
            Ok(relative) if relative.file_name().is_some() => on.push(MountOn {
                unique,
                relative: relative.to_path_buf(),
                is_fuse: crate::model::mountinfo::is_fuse_type(&stat.fs_type),
            }),
            _ => missed.push(NotCarried {
                mount_point: stat.mount_point,
                why: "its mount point is not below the mount's".into(),
            }),
        }
    }
    on
}

/// Copies the mount `unique` at `relative` below the dead mount `dead`,
/// with the mounts below it: reached through the directory holding it
/// without crossing any mount, then the last name, which crosses onto it
/// (asking its filesystem nothing).
fn open_nested(dead: BorrowedFd<'_>, relative: &Path, unique: u64) -> io::Result<OwnedFd> {
    let (Some(parent), Some(name)) = (relative.parent(), relative.file_name()) else {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    };
    let within;
    let parent = if parent.as_os_str().is_empty() {
        dead
    } else {
        within = probe::open_within_mount(dead, parent)?;
        within.as_fd()
    };
    let opened = resolve::open_beneath(parent, Path::new(name))?;
    copy_if_listed(opened.as_fd(), unique)
}

/// A copy of the mount `opened` is on, with the mounts below it, if it is
/// the mount `unique`.
fn copy_if_listed(opened: BorrowedFd<'_>, unique: u64) -> io::Result<OwnedFd> {
    let found = resolve::unique_mount_id_of(opened)?;
    if found != unique {
        return Err(io::Error::other(format!("another mount ({found}) is there now")));
    }
    // A copy, not the mount itself: a lookup of its mount point in the
    // dead mount once the entry timed out (anybody's, during the outage)
    // makes the kernel invalidate that dentry and detach the mounts on it,
    // and a detached mount can be neither moved nor copied any more.
    mount::clone_tree(opened)
}

/// Attaches the copy of each held mount onto the same directory of
/// `replacement` (an attached mount of the calling thread's namespace), in
/// the order the originals were made, so that one that covered another
/// covers it again; each brings the mounts that were below its original.
/// `replacement` must be private or a slave: an attach onto a shared mount
/// would propagate a copy to its peers. The originals go with the dead
/// mount. With `copy_again`, takes a copy of each attached one for the next
/// heal (no lookup: from the attached mount itself).
pub fn carry_nested(
    held: Vec<NestedMount>,
    replacement: BorrowedFd<'_>,
    replacement_point: &Path,
    copy_again: bool,
) -> Carried {
    let mut held = held;
    held.sort_by_key(|mount| mount.unique_id);
    let mut carried = Carried::default();
    for mount in held {
        // A lookup in the new source, which may hang: made by the FUSE call
        // helper. Which step failed is said: both can answer ENOENT (a name
        // the new mount lacks; a mount point no longer attached).
        let moved = match fuse_calls::open_beneath(replacement, &mount.relative) {
            Ok(onto) => mount::move_mount(mount.copy.as_fd(), onto.as_fd())
                .map_err(|err| format!("cannot move it onto its mount point in the new mount: {err}")),
            Err(err) => Err(format!("its mount point cannot be looked up in the new mount: {err}")),
        };
        if let Err(why) = moved {
            carried.missed.push(NotCarried { mount_point: replacement_point.join(&mount.relative), why });
            continue;
        }
        if !copy_again {
            continue;
        }
        let again = resolve::unique_mount_id_of(mount.copy.as_fd())
            .and_then(|unique| Ok((unique, mount::clone_tree(mount.copy.as_fd())?)));
        if let Ok((unique_id, copy)) = again {
            carried.copies.push(NestedMount { unique_id, relative: mount.relative, copy });
        }
    }
    carried
}

/// What [`carry_nested`] did.
#[derive(Debug, Default)]
pub struct Carried {
    /// Those that could not be attached.
    pub missed: Vec<NotCarried>,
    /// Copies of those attached, when asked.
    pub copies: Vec<NestedMount>,
}

/// Handles on the mounts nested in a dead mount, taken when its death was
/// seen and used at its heal: shared by every copy of the record that
/// found it (the isolation's worker fills it, the heal's takes it).
#[derive(Debug, Clone, Default)]
pub struct NestedSlot(Arc<Mutex<Option<Nested>>>);

impl NestedSlot {
    pub fn put(&self, nested: Nested) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(nested);
    }

    pub fn take(&self) -> Option<Nested> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

/// A slot is what a mount's record carries, not what it is: two records of
/// the same mount are equal whatever their slots hold.
impl PartialEq for NestedSlot {
    fn eq(&self, _other: &Self) -> bool {
        true
    }
}

impl Eq for NestedSlot {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_options_name_the_attributes() {
        let read_only = attributes_of_options("ro,nosuid,nodev,noexec,relatime");
        assert_eq!(
            read_only,
            MountAttributes::READ_ONLY
                .union(MountAttributes::NOSUID)
                .union(MountAttributes::NODEV)
                .union(MountAttributes::NOEXEC)
        );
        assert_eq!(attributes_of_options("rw,noatime"), MountAttributes::NOATIME);
        assert_eq!(attributes_of_options("rw"), MountAttributes::STRICTATIME);
        assert_eq!(
            attributes_of_options("rw,relatime,nosymfollow,idmapped"),
            MountAttributes::NOSYMFOLLOW.union(MountAttributes::IDMAP)
        );
    }

    /// The table's options and statmount agree on every mount of this
    /// namespace.
    #[test]
    fn the_table_and_statmount_agree() {
        let mut ids = Vec::new();
        listmount::mount_ids_after(Namespace::Current, 0, &mut ids).expect("listmount (Linux 6.8+)");
        for unique in ids {
            let stat = statmount::mount_stat(unique, Namespace::Current).expect("statmount");
            let stated = statmount::mount_attributes(unique, Namespace::Current).expect("statmount's attributes");
            let table = attributes_from_table(stat.mount_id, None).expect("the table's options");
            assert_eq!(stated.carried(), table.carried(), "{}", stat.mount_point.display());
        }
    }
}
