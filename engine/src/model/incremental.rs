//! The mount table kept from mount events: only the mounts the loop can act
//! on, keyed by unique mount ID, updated one mount at a time.
//!
//! The loop needs the FUSE mounts of the namespace and nothing else: a
//! [`Snapshot`] holds only them, and classification, planning and healing
//! work from it (a non-FUSE mount is never a source, a target or a layer of
//! one). So each mount that appears is asked about once (`statmount`), kept
//! if it is FUSE and dropped for good otherwise: its unique ID is never
//! reused, so nothing about it can change into mattering later. A change
//! then costs the same whatever the table's size.
//!
//! What the events do not say, and how it is covered:
//! - a mount moved carries the mounts beneath it along, with one event for
//!   the moved mount alone: after a batch with a move every kept mount is
//!   asked about again (cost proportional to the FUSE mounts);
//! - a change of propagation (`--make-private`, `--make-slave`) or a
//!   remount makes no event at all: the loop's own (a heal's flatten) are
//!   followed by [`IncrementalTable::refresh`], which asks about every kept
//!   mount again; another process's are seen at the next refresh or
//!   resync. Kubelet and container runtimes set a mount's propagation as
//!   they make it, before its attach event is read, so this leaves out
//!   only an operator changing a FUSE mount's propagation by hand;
//! - lost events (`FAN_Q_OVERFLOW`): [`IncrementalTable::resync`] lists the
//!   namespace (`listmount`) and asks about every mount in it.
//!
//! The kernel lists a namespace's mounts by unique ID, which is the order
//! they were made in; a snapshot hands the kept mounts out in that order,
//! numbered as a mountinfo read numbers its lines ([`FuseMount::table_order`]).
use std::collections::{BTreeMap, BTreeSet};
use std::io;

use fuse_supervisor_sys::fanotify::MountEvent;
use fuse_supervisor_sys::listmount;
use fuse_supervisor_sys::statmount::{MountStat, Namespace, mount_stat};

use crate::model::mountinfo::{is_fuse_type, without_deleted_marker};
use crate::model::table::{Dev, FuseMount, Snapshot};

#[derive(Debug, thiserror::Error)]
pub enum IncrementalError {
    #[error("cannot list the mounts of the namespace (listmount)")]
    List(#[source] io::Error),
    #[error("cannot ask about mount {unique_id:#x} (statmount)")]
    Stat {
        unique_id: u64,
        #[source]
        source: io::Error,
    },
}

/// Where the table asks the kernel: `listmount` and `statmount` in the
/// watched namespace (the loop's), a fixture in unit tests.
pub trait MountQuery {
    /// Appends the unique IDs of all the namespace's mounts, ascending.
    fn list(&mut self, ids: &mut Vec<u64>) -> io::Result<()>;
    /// The mount with that unique ID; None once it is gone.
    fn stat(&mut self, unique_id: u64) -> io::Result<Option<MountStat>>;
}

/// What a batch of changes did to the kept table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Kept mounts added, removed or changed: a snapshot would differ.
    pub changed: bool,
    /// Mounts asked about (`statmount` calls).
    pub stats: usize,
    /// The batch held an overflow and the whole namespace was read again.
    pub resynced: bool,
}

/// The FUSE mounts of one namespace, kept from its mount events.
#[derive(Debug, Default)]
pub struct IncrementalTable {
    kept: BTreeMap<u64, FuseMount>,
    /// The unique ID of every mount of the namespace, FUSE or not: what a
    /// listing is compared with to find what is new. Not a high-water
    /// mark: a mount made with the new mount API (`fsmount`, `open_tree`)
    /// has its ID before `move_mount` attaches it, so it can appear below
    /// IDs already listed. About 12 bytes a mount.
    known: BTreeSet<u64>,
    /// Reused between listings.
    ids: Vec<u64>,
}

impl IncrementalTable {
    /// Forgets everything and reads the namespace anew: every mount listed,
    /// each asked about once. At start-up and after lost events.
    pub fn resync(&mut self, query: &mut dyn MountQuery) -> Result<Applied, IncrementalError> {
        self.list(query)?;
        let before = std::mem::take(&mut self.kept);
        let mut applied = Applied { resynced: true, ..Applied::default() };
        let ids = std::mem::take(&mut self.ids);
        for &unique_id in &ids {
            self.learn(query, unique_id, &mut applied)?;
        }
        self.known = ids.iter().copied().collect();
        self.ids = ids;
        applied.changed = before != self.kept;
        self.release_listing();
        Ok(applied)
    }

    /// Applies a batch of mount events, in order. An overflow in it resyncs
    /// (the events before it are then moot).
    pub fn apply(&mut self, events: &[MountEvent], query: &mut dyn MountQuery) -> Result<Applied, IncrementalError> {
        if events.contains(&MountEvent::Overflow) {
            return self.resync(query);
        }
        let mut applied = Applied::default();
        let mut moved = false;
        for &event in events {
            match event {
                MountEvent::Attached(unique_id) => {
                    self.known.insert(unique_id);
                    self.learn(query, unique_id, &mut applied)?;
                }
                MountEvent::Detached(unique_id) => {
                    self.known.remove(&unique_id);
                    applied.changed |= self.kept.remove(&unique_id).is_some();
                }
                MountEvent::Moved(unique_id) => {
                    moved = true;
                    self.known.insert(unique_id);
                    self.learn(query, unique_id, &mut applied)?;
                }
                MountEvent::Overflow => {}
            }
        }
        if moved {
            // The moved mount's subtree moved with it, unreported.
            self.restat_kept(query, &mut applied)?;
        }
        Ok(applied)
    }

    /// Brings the table up to date without events: lists the namespace,
    /// asks about the mounts not listed before and about every kept one
    /// again, and drops the kept mounts that are gone. For a namespace
    /// watched without mount events (mountinfo's flag says only "changed"),
    /// and after the loop's own changes, made while events were off.
    pub fn refresh(&mut self, query: &mut dyn MountQuery) -> Result<Applied, IncrementalError> {
        self.list(query)?;
        let ids = std::mem::take(&mut self.ids);
        let mut applied = Applied::default();
        let before = self.kept.len();
        self.kept.retain(|unique_id, _| ids.binary_search(unique_id).is_ok());
        applied.changed |= self.kept.len() != before;
        self.restat_kept(query, &mut applied)?;
        for &unique_id in &ids {
            if !self.known.contains(&unique_id) {
                self.learn(query, unique_id, &mut applied)?;
            }
        }
        self.known = ids.iter().copied().collect();
        self.ids = ids;
        self.release_listing();
        Ok(applied)
    }

    /// The kept mounts as a mountinfo read would give them: in creation
    /// order, numbered from 1.
    pub fn snapshot(&self) -> Snapshot {
        let fuse_mounts = self
            .kept
            .values()
            .zip(1..)
            .map(|(mount, table_order)| FuseMount { table_order, ..mount.clone() })
            .collect();
        Snapshot { fuse_mounts, total_mounts: self.known.len() }
    }

    /// How many mounts the namespace holds, FUSE or not.
    pub fn mounts(&self) -> usize {
        self.known.len()
    }

    /// How many mounts are kept (FUSE mounts).
    pub fn kept(&self) -> usize {
        self.kept.len()
    }

    /// Asks about `unique_id` and keeps it if it matters, replacing what was
    /// known of it; drops it if it no longer exists or no longer matters.
    fn learn(
        &mut self,
        query: &mut dyn MountQuery,
        unique_id: u64,
        applied: &mut Applied,
    ) -> Result<(), IncrementalError> {
        applied.stats += 1;
        let stat = query.stat(unique_id).map_err(|source| IncrementalError::Stat { unique_id, source })?;
        match stat.filter(|stat| is_fuse_type(&stat.fs_type)).map(fuse_mount) {
            Some(mount) => {
                if self.kept.get(&unique_id) != Some(&mount) {
                    self.kept.insert(unique_id, mount);
                    applied.changed = true;
                }
            }
            None => applied.changed |= self.kept.remove(&unique_id).is_some(),
        }
        Ok(())
    }

    fn restat_kept(&mut self, query: &mut dyn MountQuery, applied: &mut Applied) -> Result<(), IncrementalError> {
        let kept: Vec<u64> = self.kept.keys().copied().collect();
        for unique_id in kept {
            self.learn(query, unique_id, applied)?;
        }
        Ok(())
    }

    fn list(&mut self, query: &mut dyn MountQuery) -> Result<(), IncrementalError> {
        self.ids.clear();
        query.list(&mut self.ids).map_err(IncrementalError::List)?;
        // Ascending, as the kernel lists; a query that did not would make
        // the binary searches above miss.
        self.ids.sort_unstable();
        self.ids.dedup();
        Ok(())
    }

    /// A listing of a large namespace is megabytes: not kept between changes.
    fn release_listing(&mut self) {
        const KEPT_IDS: usize = 16 * 1024;
        if self.ids.capacity() > KEPT_IDS {
            self.ids = Vec::new();
        }
    }
}

/// A FUSE mount as a mountinfo line would describe it.
fn fuse_mount(stat: MountStat) -> FuseMount {
    // mountinfo prints group IDs as ints: they fit.
    let group = |id: Option<u64>| id.and_then(|id| u32::try_from(id).ok());
    FuseMount {
        mount_id: stat.mount_id,
        parent_id: stat.parent_id,
        dev: Dev::from(stat.dev),
        root: without_deleted_marker(stat.root),
        mount_point: stat.mount_point,
        peer_group: group(stat.peer_group),
        master: group(stat.master),
        fs_type: stat.fs_type,
        source: stat.source.unwrap_or_default(),
        table_order: 0,
    }
}

/// The calling thread's mount namespace (the loop's, which is the watched
/// one), through the syscalls.
#[derive(Debug, Default)]
pub struct KernelMounts;

impl MountQuery for KernelMounts {
    fn list(&mut self, ids: &mut Vec<u64>) -> io::Result<()> {
        listmount::mount_ids_after(Namespace::Current, 0, ids)
    }

    fn stat(&mut self, unique_id: u64) -> io::Result<Option<MountStat>> {
        match mount_stat(unique_id, Namespace::Current) {
            Ok(stat) => Ok(Some(stat)),
            // ENOENT: gone since it was named.
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(err) => Err(err),
        }
    }
}

impl KernelMounts {
    /// Whether this kernel can list and describe mounts (Linux 6.8+): one
    /// listing of the calling thread's namespace.
    pub fn listing_supported() -> bool {
        listmount::mount_ids_after(Namespace::Current, 0, &mut Vec::new()).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::PathBuf;

    use super::*;

    /// A namespace as the kernel would answer about it.
    #[derive(Default)]
    struct FakeKernel {
        mounts: BTreeMap<u64, MountStat>,
        stats: usize,
    }

    impl FakeKernel {
        fn mount(&mut self, unique_id: u64, fs_type: &str, point: &str) -> u64 {
            let old = (unique_id % 1000) as u32;
            self.mounts.insert(
                unique_id,
                MountStat {
                    unique_id,
                    mount_id: old,
                    parent_unique_id: 1,
                    parent_id: 1,
                    dev: (0, old),
                    root: PathBuf::from("/"),
                    mount_point: PathBuf::from(point),
                    fs_type: fs_type.into(),
                    source: Some("src".into()),
                    peer_group: Some(u64::from(old)),
                    master: None,
                },
            );
            unique_id
        }
    }

    impl MountQuery for FakeKernel {
        fn list(&mut self, ids: &mut Vec<u64>) -> io::Result<()> {
            ids.extend(self.mounts.keys().copied());
            Ok(())
        }

        fn stat(&mut self, unique_id: u64) -> io::Result<Option<MountStat>> {
            self.stats += 1;
            Ok(self.mounts.get(&unique_id).cloned())
        }
    }

    fn points(table: &IncrementalTable) -> Vec<String> {
        table.snapshot().fuse_mounts.iter().map(|m| m.mount_point.display().to_string()).collect()
    }

    #[test]
    fn keeps_fuse_mounts_in_creation_order_and_drops_the_rest_after_one_look() {
        let mut kernel = FakeKernel::default();
        kernel.mount(10, "ext4", "/");
        kernel.mount(20, "fuse.demofs", "/run/g");
        let mut table = IncrementalTable::default();
        let applied = table.resync(&mut kernel).unwrap();
        assert!(applied.changed && applied.resynced);
        assert_eq!(points(&table), ["/run/g"]);
        let tmpfs = kernel.mount(30, "tmpfs", "/x");
        let bind = kernel.mount(40, "fuse.demofs", "/k/pods/p/volumes/v/mount");
        kernel.stats = 0;
        let applied = table.apply(&[MountEvent::Attached(tmpfs), MountEvent::Attached(bind)], &mut kernel).unwrap();
        assert_eq!((applied.changed, kernel.stats), (true, 2), "one look per new mount");
        let snapshot = table.snapshot();
        assert_eq!(snapshot.total_mounts, 4);
        let order: Vec<(u32, u32)> = snapshot.fuse_mounts.iter().map(|m| (m.mount_id, m.table_order)).collect();
        assert_eq!(order, [(20, 1), (40, 2)]);
        // The tmpfs goes: nothing kept changes and nothing is asked.
        kernel.mounts.remove(&tmpfs);
        kernel.stats = 0;
        let applied = table.apply(&[MountEvent::Detached(tmpfs)], &mut kernel).unwrap();
        assert_eq!((applied.changed, kernel.stats, table.snapshot().total_mounts), (false, 0, 3));
        kernel.mounts.remove(&bind);
        assert!(table.apply(&[MountEvent::Detached(bind)], &mut kernel).unwrap().changed);
        assert_eq!(points(&table), ["/run/g"]);
    }

    #[test]
    fn a_mount_gone_before_it_was_asked_about_is_not_kept() {
        let mut kernel = FakeKernel::default();
        let mut table = IncrementalTable::default();
        table.resync(&mut kernel).unwrap();
        let applied = table.apply(&[MountEvent::Attached(50), MountEvent::Detached(50)], &mut kernel).unwrap();
        assert!(!applied.changed);
        assert_eq!(table.kept(), 0);
    }

    /// A mount made with the new mount API gets its ID when it is made, and
    /// may be attached after mounts with higher IDs were listed.
    #[test]
    fn a_refresh_finds_a_mount_attached_below_the_highest_id_listed() {
        let mut kernel = FakeKernel::default();
        kernel.mount(40, "tmpfs", "/t");
        let mut table = IncrementalTable::default();
        table.resync(&mut kernel).unwrap();
        kernel.mount(35, "fuse.demofs", "/k/pods/p/volumes/v/mount");
        assert!(table.refresh(&mut kernel).unwrap().changed);
        assert_eq!(points(&table), ["/k/pods/p/volumes/v/mount"]);
    }

    #[test]
    fn a_move_asks_about_every_kept_mount_again() {
        let mut kernel = FakeKernel::default();
        kernel.mount(20, "fuse.demofs", "/a/g");
        let parent = kernel.mount(30, "tmpfs", "/a");
        let mut table = IncrementalTable::default();
        table.resync(&mut kernel).unwrap();
        // /a moves to /b, carrying the FUSE mount beneath it along; the
        // event names /a's mount only.
        kernel.mounts.get_mut(&parent).unwrap().mount_point = PathBuf::from("/b");
        kernel.mounts.get_mut(&20).unwrap().mount_point = PathBuf::from("/b/g");
        assert!(table.apply(&[MountEvent::Moved(parent)], &mut kernel).unwrap().changed);
        assert_eq!(points(&table), ["/b/g"]);
    }

    #[test]
    fn an_overflow_resyncs_and_misses_nothing() {
        let mut kernel = FakeKernel::default();
        kernel.mount(20, "fuse.demofs", "/g");
        let mut table = IncrementalTable::default();
        table.resync(&mut kernel).unwrap();
        // Lost: /g went, two FUSE mounts and a tmpfs came.
        kernel.mounts.remove(&20);
        kernel.mount(21, "fuse.demofs", "/g");
        kernel.mount(22, "tmpfs", "/t");
        kernel.mount(23, "fuse.demofs", "/k/pods/p/volumes/v/mount");
        let applied = table.apply(&[MountEvent::Attached(21), MountEvent::Overflow], &mut kernel).unwrap();
        assert!(applied.resynced && applied.changed);
        let ids: BTreeSet<u32> = table.snapshot().fuse_mounts.iter().map(|m| m.mount_id).collect();
        assert_eq!(ids, BTreeSet::from([21, 23]));
        assert_eq!(table.snapshot().total_mounts, 3);
    }

    #[test]
    fn a_refresh_sees_new_gone_and_changed_mounts_without_events() {
        let mut kernel = FakeKernel::default();
        kernel.mount(20, "fuse.demofs", "/g");
        kernel.mount(21, "fuse.demofs", "/k/pods/p/volumes/v/mount");
        kernel.mount(22, "tmpfs", "/t");
        let mut table = IncrementalTable::default();
        table.resync(&mut kernel).unwrap();
        // Made private (no event), one gone, a new one and a new tmpfs.
        kernel.mounts.get_mut(&20).unwrap().peer_group = None;
        kernel.mounts.remove(&21);
        kernel.mount(30, "fuse.demofs", "/k/pods/q/volumes/v/mount");
        kernel.mount(31, "tmpfs", "/u");
        kernel.stats = 0;
        assert!(table.refresh(&mut kernel).unwrap().changed);
        // The kept /g again, and the two new mounts: the old tmpfs is not asked about.
        assert_eq!(kernel.stats, 3);
        let snapshot = table.snapshot();
        assert_eq!(snapshot.total_mounts, 4);
        let kept: Vec<(u32, Option<u32>)> = snapshot.fuse_mounts.iter().map(|m| (m.mount_id, m.peer_group)).collect();
        assert_eq!(kept, [(20, None), (30, Some(30))]);
        kernel.stats = 0;
        assert!(!table.refresh(&mut kernel).unwrap().changed, "nothing changed since");
        assert_eq!(kernel.stats, 2, "only the kept mounts are asked about again");
    }

    #[test]
    fn a_snapshot_is_what_parsing_the_same_table_gives() {
        let mut kernel = FakeKernel::default();
        kernel.mount(10, "ext4", "/");
        kernel.mount(20, "fuse.demofs", "/run/g");
        kernel.mount(30, "fuse.demofs", "/k/pods/p/volumes/v/mount");
        let mut table = IncrementalTable::default();
        table.resync(&mut kernel).unwrap();
        let text = "10 1 0:10 / / rw - ext4 src rw\n\
                    20 1 0:20 / /run/g rw shared:20 - fuse.demofs src rw\n\
                    30 1 0:30 / /k/pods/p/volumes/v/mount rw shared:30 - fuse.demofs src rw\n";
        let parsed = Snapshot::parse(text.as_bytes()).unwrap();
        let kept = table.snapshot();
        assert_eq!(kept.total_mounts, parsed.total_mounts);
        let orders = |s: &Snapshot| s.fuse_mounts.iter().map(|m| m.table_order).collect::<Vec<_>>();
        // The parser numbers every line, the table only what it keeps:
        // the order is the same, the numbers need not be.
        assert!(orders(&kept).windows(2).all(|w| w[0] < w[1]));
        let strip =
            |s: &Snapshot| s.fuse_mounts.iter().map(|m| FuseMount { table_order: 0, ..m.clone() }).collect::<Vec<_>>();
        assert_eq!(strip(&kept), strip(&parsed));
    }
}
