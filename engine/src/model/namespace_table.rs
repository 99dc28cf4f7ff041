//! The FUSE mounts of another process's mount namespace, read within caps.
//!
//! A container's mount table is as big as its tenant makes it: 6,000
//! self-binds at 30 KB mount points are 170 MiB of mountinfo text, which
//! any container with CAP_SYS_ADMIN can make. The agent keeps only what it
//! needs of such a table (its FUSE mounts, and whether any mount receives
//! propagation), and reads it so
//! that its memory is bounded by caps, not by the table:
//!
//! - **listmount/statmount** (Linux 6.11+, probed once): the namespace is
//!   named by its 64-bit ID (`NS_GET_MNTNS_ID` on `/proc/<pid>/ns/mnt`),
//!   listed one page of mount IDs at a time, and each mount asked for its
//!   type and propagation only, no path; only a FUSE mount is asked for its
//!   paths, in a buffer of [`TableCaps::mount_text_bytes`]: a FUSE mount
//!   whose paths do not fit (EOVERFLOW) is skipped and counted. A tenant's
//!   6,000 tmpfs binds cost no path text at all.
//! - **mountinfo, streamed** (older kernels, or a namespace listmount
//!   cannot name): `/proc/<pid>/mountinfo` through one buffer of
//!   [`TableCaps::line_bytes`]; a longer line is skipped and counted.
//!
//! Either way at most [`TableCaps::fuse_mounts`] FUSE mounts and
//! [`TableCaps::kept_text_bytes`] of their text are kept; the rest are
//! counted in [`Overflow`], which the caller reports (once per namespace).
//! A FUSE volume in a container is never mounted at a path a cap refuses.
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use fuse_supervisor_sys::listmount;
use fuse_supervisor_sys::ns;
use fuse_supervisor_sys::statmount::{self, Namespace};

use super::mountinfo::{self, CappedLine, CappedLines};
use super::table::{Dev, FuseMount};

/// What one read of a namespace keeps, and what it left out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableCaps {
    /// The longest mountinfo line read (with its newline).
    pub line_bytes: usize,
    /// The most a FUSE mount's statmount answer may take: its fixed part
    /// and its root, mount point, type and source.
    pub mount_text_bytes: usize,
    /// FUSE mounts kept per namespace.
    pub fuse_mounts: usize,
    /// Bytes of path text (root, mount point, type, source) kept per
    /// namespace, over all its FUSE mounts.
    pub kept_text_bytes: usize,
}

impl TableCaps {
    /// A container's FUSE volume sits at a mount point of a few hundred
    /// bytes at most, below a handful of mounts; a node's container holds
    /// a few dozen FUSE mounts. The caps are far above that and keep one
    /// namespace's read under a MiB.
    pub const DEFAULT: TableCaps =
        TableCaps { line_bytes: 16 * 1024, mount_text_bytes: 8 * 1024, fuse_mounts: 512, kept_text_bytes: 512 * 1024 };
}

/// What a read left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overflow {
    /// Mounts skipped for their length: a mountinfo line over
    /// [`TableCaps::line_bytes`], or a FUSE mount whose statmount answer is
    /// over [`TableCaps::mount_text_bytes`].
    pub long_mounts: usize,
    /// FUSE mounts past [`TableCaps::fuse_mounts`] or
    /// [`TableCaps::kept_text_bytes`], left out.
    pub unkept_fuse_mounts: usize,
    /// Mountinfo lines that did not parse (the kernel never writes them).
    pub malformed_lines: usize,
}

impl Overflow {
    /// Whether the read left anything out.
    pub fn any(&self) -> bool {
        *self != Overflow::default()
    }
}

/// How a namespace was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadBy {
    Listmount,
    Mountinfo,
}

/// One read of a namespace's table, within the caps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceTable {
    /// In table order.
    pub fuse_mounts: Vec<FuseMount>,
    /// Each kept FUSE mount's 64-bit unique ID (never reused, unlike the
    /// mount ID), by mount ID: read by listmount only.
    pub unique_ids: BTreeMap<u32, u64>,
    /// Whether any of its mounts receives mounts by propagation.
    pub receives: bool,
    /// The kept FUSE mounts (by mount ID) that a mount listed after them is
    /// on (a configMap at `<volume>/config`). One listed before the mount
    /// it is on (moved there later) is not seen.
    pub with_mounts_on: BTreeSet<u32>,
    pub total_mounts: usize,
    pub overflow: Overflow,
    pub read_by: ReadBy,
}

/// How other namespaces' tables are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableReads {
    /// listmount/statmount where the kernel names namespaces (probed once),
    /// else mountinfo streamed.
    Auto,
    /// mountinfo streamed, always.
    Mountinfo,
}

static MOUNTINFO_ONLY: AtomicBool = AtomicBool::new(false);

/// Sets how tables are read from now on (the default is
/// [`TableReads::Auto`]): for the whole process, as the kernel's support is.
pub fn set_table_reads(reads: TableReads) {
    MOUNTINFO_ONLY.store(reads == TableReads::Mountinfo, Ordering::Relaxed);
}

/// Whether listmount and statmount name namespaces by ID here: this
/// thread's namespace is named and listed once.
fn listmount_names_namespaces() -> bool {
    static PROBED: OnceLock<bool> = OnceLock::new();
    if MOUNTINFO_ONLY.load(Ordering::Relaxed) {
        return false;
    }
    *PROBED.get_or_init(|| {
        let Ok(own) = ns::open_thread_mount_namespace() else { return false };
        let Ok(id) = ns::mount_namespace_id(own.as_fd()) else { return false };
        listmount::mount_ids_page(Namespace::Id(id), 0, &mut [0; 1]).is_ok()
    })
}

/// The table of `pid`'s namespace under `proc_root`, within `caps`: None
/// if the process is gone (or its table cannot be read, which is the same
/// to a caller). Fails only for want of descriptors, which a caller must
/// not take for a process gone.
pub fn read(proc_root: &Path, pid: u32, caps: &TableCaps) -> io::Result<Option<NamespaceTable>> {
    read_counted(proc_root, pid, caps, &mut |_| {})
}

/// [`read`], telling `listed` of the mounts as they are listed (their
/// number since the last call): a reader can change its pace as a table
/// turns out big, before it is read whole.
pub fn read_counted(
    proc_root: &Path,
    pid: u32,
    caps: &TableCaps,
    listed: &mut dyn FnMut(usize),
) -> io::Result<Option<NamespaceTable>> {
    let dir = proc_root.join(pid.to_string());
    if listmount_names_namespaces() {
        let namespace = match File::open(dir.join("ns/mnt")) {
            Ok(namespace) => Some(namespace),
            Err(err) if fuse_supervisor_sys::fds::out_of_descriptors(&err) => return Err(err),
            // Gone (its mountinfo is gone too), or not there to be named.
            Err(_) => None,
        };
        // Not an nsfs file (a test's fake /proc), or a namespace the
        // kernel does not let this process name: read as text.
        if let Some(id) = namespace.and_then(|namespace| ns::mount_namespace_id(namespace.as_fd()).ok()) {
            match by_listmount(id, caps, listed) {
                Ok(table) => return Ok(Some(table)),
                // Gone since it was named.
                Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(_) => {}
            }
        }
    }
    match File::open(dir.join("mountinfo")) {
        Ok(file) => match stream_counted(file, caps, listed) {
            Ok(table) => Ok(Some(table)),
            Err(err) => gone_unless_out_of_descriptors(err),
        },
        Err(err) => gone_unless_out_of_descriptors(err),
    }
}

fn gone_unless_out_of_descriptors(err: io::Error) -> io::Result<Option<NamespaceTable>> {
    if fuse_supervisor_sys::fds::out_of_descriptors(&err) { Err(err) } else { Ok(None) }
}

/// Mount IDs asked of listmount at a time: 4 KiB on the stack.
const LIST_PAGE: usize = 512;

/// What the FUSE mounts kept so far take, against the caps.
#[derive(Debug, Default)]
struct Kept {
    fuse_mounts: Vec<FuseMount>,
    text_bytes: usize,
    overflow: Overflow,
    with_mounts_on: BTreeSet<u32>,
}

impl Kept {
    /// Whether one more FUSE mount fits the count cap (else counted out),
    /// with `refused` more already asked for and found too long.
    fn has_room(&mut self, caps: &TableCaps, refused: usize) -> bool {
        let room = self.fuse_mounts.len() + refused < caps.fuse_mounts;
        if !room {
            self.overflow.unkept_fuse_mounts += 1;
        }
        room
    }

    fn into_table(
        self,
        unique_ids: BTreeMap<u32, u64>,
        receives: bool,
        total_mounts: usize,
        read_by: ReadBy,
    ) -> NamespaceTable {
        NamespaceTable {
            fuse_mounts: self.fuse_mounts,
            unique_ids,
            receives,
            with_mounts_on: self.with_mounts_on,
            total_mounts,
            overflow: self.overflow,
            read_by,
        }
    }

    /// Keeps `mount` if its text fits the text cap (else counted out); a
    /// mount listed again (a mountinfo read is not atomic) replaces itself.
    fn keep(&mut self, mount: FuseMount, caps: &TableCaps) -> bool {
        let text = mount.root.as_os_str().len()
            + mount.mount_point.as_os_str().len()
            + mount.fs_type.len()
            + mount.source.len();
        if self.text_bytes + text > caps.kept_text_bytes {
            self.overflow.unkept_fuse_mounts += 1;
            return false;
        }
        self.text_bytes += text;
        match self.fuse_mounts.iter_mut().find(|kept| kept.mount_id == mount.mount_id) {
            Some(again) => *again = mount,
            None => self.fuse_mounts.push(mount),
        }
        true
    }
}

fn by_listmount(namespace_id: u64, caps: &TableCaps, listed_now: &mut dyn FnMut(usize)) -> io::Result<NamespaceTable> {
    let namespace = Namespace::Id(namespace_id);
    let mut page = [0u64; LIST_PAGE];
    let mut after = 0;
    let mut kept = Kept::default();
    let mut unique_ids = BTreeMap::new();
    let (mut receives, mut total_mounts) = (false, 0usize);
    // The kept FUSE mounts' IDs, by unique ID.
    let mut fuse_ids: HashMap<u64, u32> = HashMap::new();
    loop {
        let listed = listmount::mount_ids_page(namespace, after, &mut page)?;
        listed_now(listed);
        for &unique_id in &page[..listed] {
            total_mounts += 1;
            let kind = match statmount::mount_kind(unique_id, namespace) {
                Ok(kind) => kind,
                Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
                Err(err) => return Err(err),
            };
            receives |= kind.peer_group.is_some() || kind.master.is_some();
            if let Some(&parent) = fuse_ids.get(&kind.parent_unique_id) {
                kept.with_mounts_on.insert(parent);
            }
            // Those found too long count against the room as well: the
            // kernel writes out a path whole before it says it did not fit:
            // 6,000 FUSE binds at 29 KB paths took 420 ms a read, 136 ms so
            // (benches/table_read.rs, a debug build).
            if !mountinfo::is_fuse_type(&kind.fs_type) || !kept.has_room(caps, kept.overflow.long_mounts) {
                continue;
            }
            let stat = match statmount::mount_stat_within(unique_id, namespace, caps.mount_text_bytes) {
                Ok(stat) => stat,
                Err(err) if statmount::did_not_fit(&err) => {
                    kept.overflow.long_mounts += 1;
                    continue;
                }
                Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
                Err(err) => return Err(err),
            };
            // Outside the namespace's root: mountinfo lists no such mount.
            if stat.mount_point.as_os_str().is_empty() {
                continue;
            }
            let mount = FuseMount {
                mount_id: stat.mount_id,
                parent_id: stat.parent_id,
                dev: Dev { major: stat.dev.0, minor: stat.dev.1 },
                // As the mountinfo parser gives it: the root of a container's
                // subPath bind read after its dead connection failed a lookup
                // is `/sub//deleted`, which no heal could find again.
                root: mountinfo::without_deleted_marker(stat.root),
                mount_point: stat.mount_point,
                peer_group: stat.peer_group.and_then(|group| u32::try_from(group).ok()),
                master: stat.master.and_then(|group| u32::try_from(group).ok()),
                fs_type: stat.fs_type,
                source: stat.source.unwrap_or_default(),
                table_order: u32::try_from(total_mounts).unwrap_or(u32::MAX),
            };
            let mount_id = mount.mount_id;
            if kept.keep(mount, caps) {
                unique_ids.insert(mount_id, unique_id);
                fuse_ids.insert(unique_id, mount_id);
            }
        }
        match page[..listed].last() {
            Some(&last) if listed == LIST_PAGE => after = last,
            _ => break,
        }
    }
    Ok(kept.into_table(unique_ids, receives, total_mounts, ReadBy::Listmount))
}

/// A mountinfo text read from `source` line by line within `caps`.
pub fn stream(source: impl Read, caps: &TableCaps) -> io::Result<NamespaceTable> {
    stream_counted(source, caps, &mut |_| {})
}

/// [`stream`], telling `listed` of each line read, as a mount per KiB of
/// it begun: the kernel writes a line out whole, and a tenant decides how
/// long its lines are (a skipped one was over `caps.line_bytes`).
fn stream_counted(source: impl Read, caps: &TableCaps, listed: &mut dyn FnMut(usize)) -> io::Result<NamespaceTable> {
    let mut lines = CappedLines::new(source, caps.line_bytes);
    let mut kept = Kept::default();
    let mut fuse_ids: HashSet<u32> = HashSet::new();
    let (mut receives, mut total_mounts) = (false, 0usize);
    while let Some(line) = lines.next_line()? {
        total_mounts += 1;
        let line = match line {
            CappedLine::Line(line) => {
                listed(1 + line.len() / 1024);
                line
            }
            CappedLine::TooLong => {
                listed(1 + caps.line_bytes / 1024);
                kept.overflow.long_mounts += 1;
                continue;
            }
        };
        let Ok(entry) = mountinfo::parse_line(line, total_mounts) else {
            kept.overflow.malformed_lines += 1;
            continue;
        };
        receives |= entry.propagation.shared.is_some() || entry.propagation.master.is_some();
        if fuse_ids.contains(&entry.parent_id) {
            kept.with_mounts_on.insert(entry.parent_id);
        }
        if entry.is_fuse() && kept.has_room(caps, 0) {
            let table_order = u32::try_from(total_mounts).unwrap_or(u32::MAX);
            if kept.keep(FuseMount::of_line(&entry, table_order), caps) {
                fuse_ids.insert(entry.mount_id);
            }
        }
    }
    Ok(kept.into_table(BTreeMap::new(), receives, total_mounts, ReadBy::Mountinfo))
}

#[cfg(test)]
mod tests;
