//! `listmount(2)` (Linux 6.8): the unique IDs of a mount namespace's
//! mounts, without the text of the mount table. The kernel lists them in
//! unique-ID order (creation order, since unique IDs are never reused) and
//! goes on after a given ID, so a long table is read in pages and "what was
//! made since ID n" is one call.
use std::io;

use linux_raw_sys::general::LSMT_ROOT;

use crate::statmount::Namespace;

/// `__NR_listmount`: 458 on every architecture.
const SYS_LISTMOUNT: libc::c_long = 458;

/// IDs asked for per call: 32 KiB of buffer.
const PAGE: usize = 4096;

/// Appends to `ids` the unique IDs of every mount of `namespace` whose ID
/// is above `after` (0: all), ascending. Mounts made or removed during the
/// listing may or may not be in it. `ENOSYS` before Linux 6.8; a
/// [`Namespace::Id`] needs 6.11.
pub fn mount_ids_after(namespace: Namespace, after: u64, ids: &mut Vec<u64>) -> io::Result<()> {
    let mut last = after;
    loop {
        let start = ids.len();
        ids.resize(start + PAGE, 0);
        let listed = mount_ids_page(namespace, last, &mut ids[start..]);
        let listed = match listed {
            Ok(listed) => listed,
            Err(err) => {
                ids.truncate(start);
                return Err(err);
            }
        };
        ids.truncate(start + listed);
        match ids.last() {
            Some(&id) if listed == PAGE => last = id,
            _ => return Ok(()),
        }
    }
}

/// One page of [`mount_ids_after`]: fills `page` with the unique IDs of the
/// mounts of `namespace` above `after`, ascending, and returns how many it
/// wrote; fewer than `page.len()` means the listing is done. For a reader
/// that holds one page at a time, whatever the namespace's size.
pub fn mount_ids_page(namespace: Namespace, after: u64, page: &mut [u64]) -> io::Result<usize> {
    // `LSMT_ROOT` (-1 as u64): the whole namespace, below its root.
    let request = namespace.request(LSMT_ROOT as u64, after);
    // SAFETY: `request` is a valid `mnt_id_req` whose `size` says which
    // version it is; `page` is writable for `page.len()` u64s, and the
    // kernel writes at most that many.
    let ret =
        unsafe { libc::syscall(SYS_LISTMOUNT, &raw const request, page.as_mut_ptr(), page.len(), 0 as libc::c_uint) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    // The count is at most the page's length (checked above: not negative).
    Ok((ret as usize).min(page.len()))
}

/// The unique IDs of the mounts mounted on the mount `unique_id` (of the
/// calling thread's namespace), up to `limit` of them: those on its root
/// cover it. `ENOENT` once it is gone.
pub fn children(unique_id: u64, limit: usize) -> io::Result<Vec<u64>> {
    let mut ids = vec![0u64; limit];
    let request = Namespace::Current.request(unique_id, 0);
    // SAFETY: `request` is a valid `mnt_id_req`; `ids` is writable for
    // `limit` u64s, and the kernel writes at most that many.
    let ret = unsafe { libc::syscall(SYS_LISTMOUNT, &raw const request, ids.as_mut_ptr(), limit, 0 as libc::c_uint) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    ids.truncate((ret as usize).min(limit));
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::statmount::{self, Namespace};

    /// The mounts listed are the mounts of mountinfo, in ascending order,
    /// and a listing after an ID leaves out that ID and those below it.
    #[test]
    fn lists_the_namespace_in_unique_id_order() {
        let mut ids = Vec::new();
        mount_ids_after(Namespace::Current, 0, &mut ids).expect("listmount");
        assert!(ids.windows(2).all(|pair| pair[0] < pair[1]), "not ascending: {ids:?}");
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let mut old_ids: Vec<u32> =
            ids.iter().map(|&id| statmount::mount_stat(id, Namespace::Current).expect("statmount").mount_id).collect();
        let mut listed: Vec<u32> = mountinfo.lines().filter_map(|line| line.split(' ').next()?.parse().ok()).collect();
        old_ids.sort_unstable();
        listed.sort_unstable();
        assert_eq!(old_ids, listed, "listmount and mountinfo disagree");
        let mut rest = Vec::new();
        mount_ids_after(Namespace::Current, ids[0], &mut rest).expect("listmount after the first");
        assert_eq!(rest, ids[1..]);
    }

    /// Another namespace named by its ID lists the same as the current one
    /// does from inside (it is the same here: the point is the request
    /// version 1 path).
    #[test]
    fn a_namespace_named_by_id_lists_the_same() {
        let mut ids = Vec::new();
        mount_ids_after(Namespace::Current, 0, &mut ids).expect("listmount");
        let namespace = statmount::namespace_id(ids[0]).expect("namespace ID (Linux 6.11+)");
        let mut by_id = Vec::new();
        mount_ids_after(Namespace::Id(namespace), 0, &mut by_id).expect("listmount by namespace ID");
        assert_eq!(by_id, ids);
    }
}
