//! `statmount(2)` (Linux 6.8): what one mount is, asked by its unique ID,
//! without reading the whole mount table. The layouts come from
//! `include/uapi/linux/mount.h` through linux-raw-sys; libc 0.2 has no
//! number for the call yet.
use std::ffi::{CStr, OsStr};
use std::io;
use std::mem::{offset_of, size_of};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use crate::bytes;

use linux_raw_sys::general::{
    MNT_ID_REQ_SIZE_VER0, STATMOUNT_FS_TYPE, STATMOUNT_MNT_BASIC, STATMOUNT_MNT_POINT, STATMOUNT_SB_BASIC, mnt_id_req,
    statmount,
};

/// `__NR_statmount`: 457 on every architecture (the numbers above 423 are
/// shared).
const SYS_STATMOUNT: libc::c_long = 457;

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
    /// `fuse`, or `fuse.<subtype>` as mountinfo shows it.
    pub fs_type: String,
    /// Relative to the calling thread's root, in its mount namespace.
    pub mount_point: PathBuf,
}

/// Room for the fixed part and two strings of a mount point's length; a
/// longer answer (EOVERFLOW) is asked again with a larger buffer.
const FIRST_BUFFER: usize = 2048;
const MOST_BUFFER: usize = 64 * 1024;

/// `statmount` of the mount with unique ID `unique_id` in the calling
/// thread's mount namespace: ENOENT once it is gone (or if it is in another
/// namespace), ENOSYS before Linux 6.8.
pub fn mount_summary(unique_id: u64) -> io::Result<MountSummary> {
    let request = mnt_id_req {
        size: MNT_ID_REQ_SIZE_VER0,
        spare: 0,
        mnt_id: unique_id,
        param: u64::from(STATMOUNT_SB_BASIC | STATMOUNT_MNT_BASIC | STATMOUNT_MNT_POINT | STATMOUNT_FS_TYPE),
        mnt_ns_id: 0,
    };
    let mut len = FIRST_BUFFER;
    loop {
        let mut buffer = vec![0u8; len];
        // SAFETY: `request` is a valid `mnt_id_req` whose `size` says which
        // version it is; `buffer` is writable for `len` bytes, and the kernel
        // writes at most `len` bytes (copy_to_user: no alignment needed).
        let ret =
            unsafe { libc::syscall(SYS_STATMOUNT, &raw const request, buffer.as_mut_ptr(), len, 0 as libc::c_uint) };
        if ret < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EOVERFLOW) && len < MOST_BUFFER {
                len *= 4;
                continue;
            }
            return Err(err);
        }
        return decode(&buffer);
    }
}

fn decode(bytes: &[u8]) -> io::Result<MountSummary> {
    let u32_at = |offset: usize| bytes::u32_at(bytes, offset).ok_or_else(truncated);
    let u64_at = |offset: usize| bytes::u64_at(bytes, offset).ok_or_else(truncated);
    let wanted = u64::from(STATMOUNT_SB_BASIC | STATMOUNT_MNT_BASIC | STATMOUNT_MNT_POINT | STATMOUNT_FS_TYPE);
    if u64_at(offset_of!(statmount, mask))? & wanted != wanted {
        return Err(io::Error::new(io::ErrorKind::Unsupported, "statmount left out a field it was asked for"));
    }
    let strings = size_of::<statmount>();
    let string_at = |field: usize| -> io::Result<&[u8]> {
        let start = strings + u32_at(field)? as usize;
        let rest = bytes.get(start..).ok_or_else(truncated)?;
        Ok(CStr::from_bytes_until_nul(rest).map_err(|_| truncated())?.to_bytes())
    };
    Ok(MountSummary {
        mount_id: u32_at(offset_of!(statmount, mnt_id_old))?,
        parent_unique_id: u64_at(offset_of!(statmount, mnt_parent_id))?,
        dev: (u32_at(offset_of!(statmount, sb_dev_major))?, u32_at(offset_of!(statmount, sb_dev_minor))?),
        fs_type: String::from_utf8_lossy(string_at(offset_of!(statmount, fs_type))?).into_owned(),
        mount_point: PathBuf::from(OsStr::from_bytes(string_at(offset_of!(statmount, mnt_point))?)),
    })
}

fn truncated() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "statmount answer shorter than its fields say")
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_gone_mount_is_not_found() {
        // Unique IDs start above 2^32 and are never reused; this one was
        // never handed out.
        let err = mount_summary(u64::MAX - 1).expect_err("no such mount");
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT), "{err}");
    }
}
