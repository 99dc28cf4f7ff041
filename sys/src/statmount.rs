//! `statmount(2)` (Linux 6.8): what one mount is, asked by its unique ID,
//! without reading the whole mount table. The layouts come from
//! `include/uapi/linux/mount.h` through linux-raw-sys; libc 0.2 has no
//! number for the call yet.
//!
//! Which kernel answers which field: the mount's IDs, device, propagation,
//! root, mount point and fs type from 6.8; the mount namespace's ID
//! (`STATMOUNT_MNT_NS_ID`) and asking about a mount of another namespace
//! (`mnt_id_req.mnt_ns_id`) from 6.11; the fs subtype and the source
//! (`STATMOUNT_FS_SUBTYPE`, `STATMOUNT_SB_SOURCE`) from 6.13. A field the
//! kernel does not know is left out of the answer's mask, never an error.
use std::ffi::{CStr, OsStr};
use std::io;
use std::mem::{offset_of, size_of};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use crate::bytes;

use linux_raw_sys::general::{
    MNT_ID_REQ_SIZE_VER0, MNT_ID_REQ_SIZE_VER1, MS_SHARED, MS_SLAVE, STATMOUNT_FS_SUBTYPE, STATMOUNT_FS_TYPE,
    STATMOUNT_MNT_BASIC, STATMOUNT_MNT_GIDMAP, STATMOUNT_MNT_NS_ID, STATMOUNT_MNT_POINT, STATMOUNT_MNT_ROOT,
    STATMOUNT_MNT_UIDMAP, STATMOUNT_SB_BASIC, STATMOUNT_SB_SOURCE, mnt_id_req, statmount,
};

/// `__NR_statmount`: 457 on every architecture (the numbers above 423 are
/// shared).
const SYS_STATMOUNT: libc::c_long = 457;

/// Which mount namespace a unique mount ID is looked up in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Namespace {
    /// The calling thread's (any kernel with the call).
    #[default]
    Current,
    /// The namespace with this ID ([`namespace_id`]; Linux 6.11+).
    Id(u64),
}

impl Namespace {
    /// The request for `mnt_id` with `param`, of the oldest version that
    /// says what is asked (version 0 is all 6.8 knows).
    pub(crate) fn request(self, mnt_id: u64, param: u64) -> mnt_id_req {
        let (size, mnt_ns_id) = match self {
            Namespace::Current => (MNT_ID_REQ_SIZE_VER0, 0),
            Namespace::Id(id) => (MNT_ID_REQ_SIZE_VER1, id),
        };
        mnt_id_req { size, spare: 0, mnt_id, param, mnt_ns_id }
    }
}

/// A mount as `statmount` describes it: what a mount table's line says,
/// plus the unique IDs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountStat {
    /// The 64-bit ID, never reused, in creation order.
    pub unique_id: u64,
    /// The mountinfo ID (`mnt_id_old`): reused once the mount is gone.
    pub mount_id: u32,
    pub parent_unique_id: u64,
    pub parent_id: u32,
    /// `(major, minor)` of the superblock: the FUSE connection.
    pub dev: (u32, u32),
    /// Path of the mount's root inside its filesystem (`/` for a whole mount).
    pub root: PathBuf,
    /// Relative to the calling thread's root.
    pub mount_point: PathBuf,
    /// As mountinfo shows it: `fuse.<subtype>` where the kernel reports the
    /// subtype (6.13+), else the bare type.
    pub fs_type: String,
    /// The mount's source (`sb_source`), None before 6.13.
    pub source: Option<String>,
    /// `shared:N`: the mount's peer group, when it is shared.
    pub peer_group: Option<u64>,
    /// `master:N`: the peer group it is a slave of, when it is one.
    pub master: Option<u64>,
}

/// Everything [`MountStat`] holds.
const FULL: u32 = STATMOUNT_SB_BASIC
    | STATMOUNT_MNT_BASIC
    | STATMOUNT_MNT_ROOT
    | STATMOUNT_MNT_POINT
    | STATMOUNT_FS_TYPE
    | STATMOUNT_FS_SUBTYPE
    | STATMOUNT_SB_SOURCE;
/// What every kernel with the call answers.
const REQUIRED: u32 =
    STATMOUNT_SB_BASIC | STATMOUNT_MNT_BASIC | STATMOUNT_MNT_ROOT | STATMOUNT_MNT_POINT | STATMOUNT_FS_TYPE;

/// `statmount` of the mount with unique ID `unique_id` in `namespace`:
/// `ENOENT` once it is gone (or if it is in another namespace), `ENOSYS`
/// before Linux 6.8.
pub fn mount_stat(unique_id: u64, namespace: Namespace) -> io::Result<MountStat> {
    mount_stat_within(unique_id, namespace, MOST_BUFFER)
}

/// [`mount_stat`] with an answer of at most `most_buffer` bytes (the fixed
/// part and the strings): `EOVERFLOW` for a mount whose paths are longer,
/// as a tenant can make them (a mount point tens of KB deep).
pub fn mount_stat_within(unique_id: u64, namespace: Namespace, most_buffer: usize) -> io::Result<MountStat> {
    let answer = query(namespace.request(unique_id, u64::from(FULL)), most_buffer)?;
    let answer = Answer::new(&answer, REQUIRED)?;
    let mask = answer.mask()?;
    let has = |field: u32| mask & u64::from(field) != 0;
    let mut fs_type = String::from_utf8_lossy(answer.string(offset_of!(statmount, fs_type))?).into_owned();
    if has(STATMOUNT_FS_SUBTYPE) {
        let subtype = answer.string(offset_of!(statmount, fs_subtype))?;
        if !subtype.is_empty() {
            fs_type.push('.');
            fs_type.push_str(&String::from_utf8_lossy(subtype));
        }
    }
    let source = if has(STATMOUNT_SB_SOURCE) {
        Some(String::from_utf8_lossy(answer.string(offset_of!(statmount, sb_source))?).into_owned())
    } else {
        None
    };
    let (peer_group, master) = answer.groups()?;
    Ok(MountStat {
        unique_id: answer.u64(offset_of!(statmount, mnt_id))?,
        mount_id: answer.u32(offset_of!(statmount, mnt_id_old))?,
        parent_unique_id: answer.u64(offset_of!(statmount, mnt_parent_id))?,
        parent_id: answer.u32(offset_of!(statmount, mnt_parent_id_old))?,
        dev: (answer.u32(offset_of!(statmount, sb_dev_major))?, answer.u32(offset_of!(statmount, sb_dev_minor))?),
        root: PathBuf::from(OsStr::from_bytes(answer.string(offset_of!(statmount, mnt_root))?)),
        mount_point: PathBuf::from(OsStr::from_bytes(answer.string(offset_of!(statmount, mnt_point))?)),
        fs_type,
        source,
        peer_group,
        master,
    })
}

/// What a mount is, without its paths: enough to tell a FUSE mount from
/// the rest, whether it receives mounts by propagation, and what it is
/// mounted on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountKind {
    pub unique_id: u64,
    pub parent_unique_id: u64,
    /// The bare type (`fuse`, `fuseblk`, `nfs4`…), without a subtype.
    pub fs_type: String,
    /// `shared:N`: the mount's peer group, when it is shared.
    pub peer_group: Option<u64>,
    /// `master:N`: the peer group it is a slave of, when it is one.
    pub master: Option<u64>,
}

/// Room for the fixed part and a filesystem type's name: the kernel's are
/// a few bytes, and a longer one is refused (`EOVERFLOW`), not grown into.
const KIND_BUFFER: usize = size_of::<statmount>() + 256;

/// `statmount` of mount `unique_id` in `namespace` asking no path at all,
/// so that its cost does not depend on how deep the mount is.
pub fn mount_kind(unique_id: u64, namespace: Namespace) -> io::Result<MountKind> {
    let wanted = STATMOUNT_MNT_BASIC | STATMOUNT_FS_TYPE;
    let answer = query(namespace.request(unique_id, u64::from(wanted)), KIND_BUFFER)?;
    let answer = Answer::new(&answer, wanted)?;
    let (peer_group, master) = answer.groups()?;
    Ok(MountKind {
        unique_id: answer.u64(offset_of!(statmount, mnt_id))?,
        parent_unique_id: answer.u64(offset_of!(statmount, mnt_parent_id))?,
        fs_type: String::from_utf8_lossy(answer.string(offset_of!(statmount, fs_type))?).into_owned(),
        peer_group,
        master,
    })
}

/// The per-mount attributes (`mnt_attr`: read-only, nosuid, nodev, noexec,
/// atime mode, nosymfollow, idmapped) of mount `unique_id` in `namespace`,
/// asking no path: read from the kernel's mount, never from its
/// filesystem, so a dead FUSE mount answers as well as a live one.
pub fn mount_attributes(unique_id: u64, namespace: Namespace) -> io::Result<crate::mount::MountAttributes> {
    mount_attributes_and_privacy(unique_id, namespace).map(|(attributes, _)| attributes)
}

/// [`mount_attributes`], and whether the mount is private (neither shared
/// nor a slave), from the one answer.
pub fn mount_attributes_and_privacy(
    unique_id: u64,
    namespace: Namespace,
) -> io::Result<(crate::mount::MountAttributes, bool)> {
    let answer = query(namespace.request(unique_id, u64::from(STATMOUNT_MNT_BASIC)), KIND_BUFFER)?;
    let answer = Answer::new(&answer, STATMOUNT_MNT_BASIC)?;
    let attributes = crate::mount::MountAttributes::from_bits(answer.u64(offset_of!(statmount, mnt_attr))?);
    let propagation = answer.u64(offset_of!(statmount, mnt_propagation))?;
    Ok((attributes, propagation & u64::from(MS_SHARED | MS_SLAVE) == 0))
}

/// An idmapped mount's mapping, as `/proc/<pid>/uid_map` and `gid_map`
/// write a user namespace's: `(first id, first id mapped to, count)` per
/// extent, seen from the caller's user namespace.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Idmapping {
    pub uid: Vec<[u32; 3]>,
    pub gid: Vec<[u32; 3]>,
}

impl Idmapping {
    /// Parses one map's text, as a user namespace's `uid_map` holds it:
    /// three numbers an extent, one extent a line (or NUL-separated, as
    /// `statmount` gives them). None for malformed text.
    pub fn parse_map(text: &[u8]) -> Option<Vec<[u32; 3]>> {
        let mut extents = Vec::new();
        for line in text.split(|&byte| byte == b'\n' || byte == 0) {
            let line = std::str::from_utf8(line).ok()?;
            let numbers: Vec<u32> = line.split_whitespace().map(str::parse).collect::<Result<_, _>>().ok()?;
            match numbers[..] {
                [] => {}
                [first, to, count] => extents.push([first, to, count]),
                _ => return None,
            }
        }
        Some(extents)
    }
}

/// The idmapping of mount `unique_id` in `namespace` (Linux 6.15+;
/// `Unsupported` before): None where the mount is not idmapped.
pub fn mount_idmapping(unique_id: u64, namespace: Namespace) -> io::Result<Option<Idmapping>> {
    let wanted = STATMOUNT_MNT_BASIC | STATMOUNT_MNT_UIDMAP | STATMOUNT_MNT_GIDMAP;
    let answer = query(namespace.request(unique_id, u64::from(wanted)), MOST_BUFFER)?;
    let answer = Answer::new(&answer, STATMOUNT_MNT_BASIC)?;
    let attributes = crate::mount::MountAttributes::from_bits(answer.u64(offset_of!(statmount, mnt_attr))?);
    if !attributes.contains(crate::mount::MountAttributes::IDMAP) {
        return Ok(None);
    }
    let map = |flag: u32, count: usize, at: usize| -> io::Result<Vec<[u32; 3]>> {
        if answer.mask()? & u64::from(flag) == 0 {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "statmount gives no idmapping (before Linux 6.15)"));
        }
        let count = answer.u32(count)? as usize;
        let text = answer.strings(at, count)?;
        Idmapping::parse_map(text).ok_or_else(truncated)
    };
    Ok(Some(Idmapping {
        uid: map(STATMOUNT_MNT_UIDMAP, offset_of!(statmount, mnt_uidmap_num), offset_of!(statmount, mnt_uidmap))?,
        gid: map(STATMOUNT_MNT_GIDMAP, offset_of!(statmount, mnt_gidmap_num), offset_of!(statmount, mnt_gidmap))?,
    }))
}

/// Whether `err` is [`mount_stat_within`]'s refusal of an answer longer
/// than its buffer (`EOVERFLOW`).
pub fn did_not_fit(err: &io::Error) -> bool {
    err.raw_os_error() == Some(libc::EOVERFLOW)
}

/// The ID of the mount namespace the mount `unique_id` belongs to (Linux
/// 6.11+; `Unsupported` before): what [`Namespace::Id`] takes.
pub fn namespace_id(unique_id: u64) -> io::Result<u64> {
    let answer = query(Namespace::Current.request(unique_id, u64::from(STATMOUNT_MNT_NS_ID)), MOST_BUFFER)?;
    Answer::new(&answer, STATMOUNT_MNT_NS_ID)?.u64(offset_of!(statmount, mnt_ns_id))
}

/// The raw answer to one request, in a buffer grown until it fits or
/// reaches `most` bytes (`EOVERFLOW` then).
fn query(request: mnt_id_req, most: usize) -> io::Result<Vec<u8>> {
    let mut len = FIRST_BUFFER.min(most);
    loop {
        let mut buffer = vec![0u8; len];
        // SAFETY: `request` is a valid `mnt_id_req` whose `size` says which
        // version it is; `buffer` is writable for `len` bytes, and the kernel
        // writes at most `len` bytes (copy_to_user: no alignment needed).
        let ret =
            unsafe { libc::syscall(SYS_STATMOUNT, &raw const request, buffer.as_mut_ptr(), len, 0 as libc::c_uint) };
        if ret < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EOVERFLOW) && len < most {
                len = (len * 4).min(most);
                continue;
            }
            return Err(err);
        }
        return Ok(buffer);
    }
}

/// A statmount answer, read field by field with bounds checked.
struct Answer<'a> {
    bytes: &'a [u8],
}

impl<'a> Answer<'a> {
    /// Refuses an answer that left out one of the `required` fields.
    fn new(bytes: &'a [u8], required: u32) -> io::Result<Self> {
        let answer = Answer { bytes };
        if answer.mask()? & u64::from(required) != u64::from(required) {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "statmount left out a field it was asked for"));
        }
        Ok(answer)
    }

    /// `(peer group, master)` from the propagation flags (`STATMOUNT_MNT_BASIC`).
    fn groups(&self) -> io::Result<(Option<u64>, Option<u64>)> {
        let propagation = self.u64(offset_of!(statmount, mnt_propagation))?;
        let group_if = |flag: u32, field: usize| -> io::Result<Option<u64>> {
            Ok(if propagation & u64::from(flag) != 0 { Some(self.u64(field)?).filter(|&id| id != 0) } else { None })
        };
        Ok((
            group_if(MS_SHARED, offset_of!(statmount, mnt_peer_group))?,
            group_if(MS_SLAVE, offset_of!(statmount, mnt_master))?,
        ))
    }

    fn mask(&self) -> io::Result<u64> {
        self.u64(offset_of!(statmount, mask))
    }

    fn u32(&self, offset: usize) -> io::Result<u32> {
        bytes::u32_at(self.bytes, offset).ok_or_else(truncated)
    }

    fn u64(&self, offset: usize) -> io::Result<u64> {
        bytes::u64_at(self.bytes, offset).ok_or_else(truncated)
    }

    /// `count` NUL-terminated strings one after another, the first at the
    /// offset into the string area that is the `u32` at `field`.
    fn strings(&self, field: usize, count: usize) -> io::Result<&'a [u8]> {
        let start = size_of::<statmount>() + self.u32(field)? as usize;
        let rest = self.bytes.get(start..).ok_or_else(truncated)?;
        let mut end = 0;
        for _ in 0..count {
            let len = rest.get(end..).and_then(|tail| tail.iter().position(|&byte| byte == 0)).ok_or_else(truncated)?;
            end += len + 1;
        }
        Ok(&rest[..end])
    }

    /// The string whose offset into the string area is the `u32` at `field`.
    fn string(&self, field: usize) -> io::Result<&'a [u8]> {
        let start = size_of::<statmount>() + self.u32(field)? as usize;
        let rest = self.bytes.get(start..).ok_or_else(truncated)?;
        Ok(CStr::from_bytes_until_nul(rest).map_err(|_| truncated())?.to_bytes())
    }
}

/// A mount as the mount table would list it, for recognising a new mount
/// before the table is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountSummary {
    /// The mountinfo ID (`mnt_id_old`), as mount tables and `statx` name it.
    pub mount_id: u32,
    /// The unique ID of the mount it is mounted on (its own, for the root).
    pub parent_unique_id: u64,
    /// `(major, minor)` of the superblock: the FUSE connection.
    pub dev: (u32, u32),
    /// The bare type (`fuse`, without the subtype mountinfo adds).
    pub fs_type: String,
    /// Relative to the calling thread's root, in its mount namespace.
    pub mount_point: PathBuf,
}

/// Room for the fixed part and a few strings of a mount point's length; a
/// longer answer (EOVERFLOW) is asked again with a larger buffer.
const FIRST_BUFFER: usize = 2048;
const MOST_BUFFER: usize = 64 * 1024;

/// `statmount` of the mount with unique ID `unique_id` in the calling
/// thread's mount namespace, asking only what recognising it needs:
/// `ENOENT` once it is gone (or if it is in another namespace), `ENOSYS`
/// before Linux 6.8.
pub fn mount_summary(unique_id: u64) -> io::Result<MountSummary> {
    let wanted = STATMOUNT_SB_BASIC | STATMOUNT_MNT_BASIC | STATMOUNT_MNT_POINT | STATMOUNT_FS_TYPE;
    let answer = query(Namespace::Current.request(unique_id, u64::from(wanted)), MOST_BUFFER)?;
    let answer = Answer::new(&answer, wanted)?;
    Ok(MountSummary {
        mount_id: answer.u32(offset_of!(statmount, mnt_id_old))?,
        parent_unique_id: answer.u64(offset_of!(statmount, mnt_parent_id))?,
        dev: (answer.u32(offset_of!(statmount, sb_dev_major))?, answer.u32(offset_of!(statmount, sb_dev_minor))?),
        fs_type: String::from_utf8_lossy(answer.string(offset_of!(statmount, fs_type))?).into_owned(),
        mount_point: PathBuf::from(OsStr::from_bytes(answer.string(offset_of!(statmount, mnt_point))?)),
    })
}

/// The filesystem type of the mount with unique ID `unique_id` in the
/// calling thread's mount namespace, as mountinfo shows it (`fuse.<subtype>`
/// where the kernel reports the subtype, 6.13+), asking for nothing else:
/// no path, however long, is copied.
pub fn fs_type(unique_id: u64) -> io::Result<String> {
    let wanted = STATMOUNT_FS_TYPE | STATMOUNT_FS_SUBTYPE;
    let answer = query(Namespace::Current.request(unique_id, u64::from(wanted)), KIND_BUFFER)?;
    let answer = Answer::new(&answer, STATMOUNT_FS_TYPE)?;
    let mut fs_type = String::from_utf8_lossy(answer.string(offset_of!(statmount, fs_type))?).into_owned();
    if answer.mask()? & u64::from(STATMOUNT_FS_SUBTYPE) != 0 {
        let subtype = answer.string(offset_of!(statmount, fs_subtype))?;
        if !subtype.is_empty() {
            fs_type.push('.');
            fs_type.push_str(&String::from_utf8_lossy(subtype));
        }
    }
    Ok(fs_type)
}

fn truncated() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "statmount answer shorter than its fields say")
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn a_map_reads_the_same_from_a_user_namespace_and_from_statmount() {
        let proc_text = b"         0     100000      65536\n     65536          0          1\n";
        let statmount_text = b"0 100000 65536\x0065536 0 1\x00";
        let expected = vec![[0, 100_000, 65_536], [65_536, 0, 1]];
        assert_eq!(Idmapping::parse_map(proc_text), Some(expected.clone()));
        assert_eq!(Idmapping::parse_map(statmount_text), Some(expected));
        assert_eq!(Idmapping::parse_map(b"0 1\n"), None);
    }

    /// The root mount of this process's namespace, found by the unique ID
    /// `statx` reports for `/`, agrees with mountinfo.
    #[test]
    fn summarises_the_root_mount() {
        let unique = crate::fuse::top_mount_id(std::path::Path::new("/")).expect("statx of /");
        let summary = mount_summary(unique).expect("statmount of the root mount");
        assert_eq!(summary.mount_point, PathBuf::from("/"));
        let proc = crate::fuse::top_mount_id(std::path::Path::new("/proc")).expect("statx of /proc");
        let proc = mount_summary(proc).expect("statmount of /proc");
        assert_eq!(proc.parent_unique_id, unique, "/proc is mounted on the root mount");
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let id = summary.mount_id.to_string();
        let line = mountinfo
            .lines()
            .map(|line| line.split(' ').collect::<Vec<_>>())
            .find(|fields| fields.first() == Some(&id.as_str()))
            .unwrap_or_else(|| panic!("mount {id} is not in mountinfo"));
        assert_eq!(line.get(4), Some(&"/"), "mount {id} is not the root: {line:?}");
        assert_eq!(line.get(2), Some(&format!("{}:{}", summary.dev.0, summary.dev.1).as_str()));
        let dash = line.iter().position(|field| *field == "-").expect("separator");
        assert_eq!(line.get(dash + 1), Some(&summary.fs_type.as_str()));
    }

    #[test]
    fn the_fs_type_alone_is_the_full_stats() {
        let proc = crate::fuse::top_mount_id(std::path::Path::new("/proc")).expect("statx of /proc");
        assert_eq!(fs_type(proc).expect("statmount of /proc"), "proc");
        let root = crate::fuse::top_mount_id(std::path::Path::new("/")).expect("statx of /");
        let full = mount_stat(root, Namespace::Current).expect("statmount of /");
        assert_eq!(fs_type(root).expect("statmount of /"), full.fs_type);
    }

    /// Every mount of this namespace, listed and stat'd, says what its
    /// mountinfo line says (lines with escaped characters left out).
    #[test]
    fn a_full_stat_agrees_with_mountinfo() {
        let mut ids = Vec::new();
        crate::listmount::mount_ids_after(Namespace::Current, 0, &mut ids).expect("listmount");
        let stats: Vec<MountStat> = ids.iter().filter_map(|&id| mount_stat(id, Namespace::Current).ok()).collect();
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let mut compared = 0;
        for line in mountinfo.lines().filter(|line| !line.contains('\\')) {
            let fields: Vec<&str> = line.split(' ').collect();
            let id: u32 = fields[0].parse().expect("mount ID");
            let Some(stat) = stats.iter().find(|stat| stat.mount_id == id) else { continue };
            let dash = fields.iter().position(|field| *field == "-").expect("separator");
            let optional = &fields[6..dash];
            let group = |tag: &str| optional.iter().find_map(|field| field.strip_prefix(tag)?.parse::<u64>().ok());
            assert_eq!(fields[1].parse::<u32>().ok(), Some(stat.parent_id), "{line}");
            assert_eq!(fields[2], format!("{}:{}", stat.dev.0, stat.dev.1), "{line}");
            assert_eq!(Path::new(fields[3]), stat.root, "{line}");
            assert_eq!(Path::new(fields[4]), stat.mount_point, "{line}");
            assert_eq!(fields[dash + 1], stat.fs_type, "{line}");
            assert_eq!(Some(fields[dash + 2]), stat.source.as_deref(), "{line} (source needs Linux 6.13+)");
            assert_eq!(group("shared:"), stat.peer_group, "{line}");
            assert_eq!(group("master:"), stat.master, "{line}");
            compared += 1;
        }
        assert!(compared > 0, "no mount compared");
    }

    /// A mount is private by the attributes' answer exactly when its full
    /// stat shows neither a peer group nor a master; the attributes agree.
    #[test]
    fn privacy_agrees_with_the_full_stat() {
        let mut ids = Vec::new();
        crate::listmount::mount_ids_after(Namespace::Current, 0, &mut ids).expect("listmount");
        let mut compared = 0;
        for id in ids {
            let (Ok(full), Ok((attributes, private))) =
                (mount_stat(id, Namespace::Current), mount_attributes_and_privacy(id, Namespace::Current))
            else {
                continue;
            };
            assert_eq!(private, full.peer_group.is_none() && full.master.is_none(), "mount {id}");
            assert_eq!(attributes, mount_attributes(id, Namespace::Current).expect("statmount"), "mount {id}");
            compared += 1;
        }
        assert!(compared > 0, "no mount compared");
    }

    /// The kind of a mount is its full stat's, less the paths; an answer
    /// held to fewer bytes than its paths take is refused with EOVERFLOW.
    #[test]
    fn a_kind_asks_no_path_and_a_small_buffer_overflows() {
        let unique = crate::fuse::top_mount_id(Path::new("/proc")).expect("statx of /proc");
        let full = mount_stat(unique, Namespace::Current).expect("statmount of /proc");
        let kind = mount_kind(unique, Namespace::Current).expect("the kind of /proc");
        assert_eq!(
            (kind.unique_id, kind.parent_unique_id, kind.fs_type.as_str(), kind.peer_group, kind.master),
            (full.unique_id, full.parent_unique_id, full.fs_type.as_str(), full.peer_group, full.master)
        );
        let err = mount_stat_within(unique, Namespace::Current, size_of::<statmount>() + 4).expect_err("too small");
        assert_eq!(err.raw_os_error(), Some(libc::EOVERFLOW), "{err}");
    }

    /// The ID an nsfs descriptor gives is the one statmount reports.
    #[test]
    fn a_namespace_descriptor_gives_the_namespace_id() {
        let unique = crate::fuse::top_mount_id(Path::new("/")).expect("statx of /");
        let namespace = crate::ns::open_thread_mount_namespace().expect("this thread's namespace");
        let id = crate::ns::mount_namespace_id(std::os::fd::AsFd::as_fd(&namespace)).expect("NS_GET_MNTNS_ID");
        assert_eq!(id, namespace_id(unique).expect("statmount's namespace ID"));
    }

    #[test]
    fn a_gone_mount_is_not_found() {
        // Unique IDs start above 2^32 and are never reused; this one was
        // never handed out.
        let err = mount_summary(u64::MAX - 1).expect_err("no such mount");
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT), "{err}");
    }
}
