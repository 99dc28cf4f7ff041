//! Unmounting a dead source so that its new daemon can mount there,
//! without ever unmounting a mount made on it since.
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};

use fuse_supervisor_sys::{listmount, mount, resolve};
use tracing::debug;

use super::HealError;
use super::mounter::Mounter;
use crate::model::table::Dev;

/// Rounds of [`Mounter::expire_dead_source`] before a dead source that is
/// looked at between its two steps, or busy, each time is detached lazily
/// instead.
const EXPIRY_TRIES: usize = 3;

/// How an unmount of a dead source by expiry went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expiry {
    Unmounted,
    /// Something was mounted on it (a new daemon): left alone, and the new
    /// mount too.
    Covered,
    /// Unmounted by someone else meanwhile.
    Gone,
    /// Looked at between the two steps (which clears the mark): try again.
    Used,
    /// Open, or with mounts on it, or looked up at that instant (a path
    /// walk through it holds it for a moment: a fresh mount nobody had
    /// opened was found so under load): tried again, then detached lazily.
    Busy,
}

/// Unmounts the dead source on top at `source` if it is still the dead
/// connection `dead`'s; whether it did.
pub(super) fn detach(mounter: &Mounter, source: &Path, dead: Dev) -> Result<bool, HealError> {
    for _ in 0..EXPIRY_TRIES {
        let (top, _, dev) = mounter.resolve_mount(source)?;
        if dev != Some(dead) {
            return Ok(false);
        }
        let Ok(unique) = resolve::unique_mount_id_of(top.as_fd()) else { break };
        // Held, it could not be unmounted; closing it also clears any
        // expiry mark on it, so the first step below marks afresh.
        drop(top);
        match mounter.expire_dead_source(source, unique)? {
            Expiry::Unmounted => return Ok(true),
            Expiry::Covered | Expiry::Gone => return Ok(false),
            Expiry::Used | Expiry::Busy => continue,
        }
    }
    // In use, looked at between the steps every time, or a kernel before
    // 6.8 (no unique mount IDs): detached lazily. A detach acts on the top
    // mount there, and takes the mounts on the dead one with it, so
    // nothing may be mounted on it: checked the syscall before (a daemon
    // mounting over its stale mount does so with one `mount(2)`, at any
    // moment), with nothing in between, not even the log line.
    let (top, _, dev) = mounter.resolve_mount(source)?;
    if dev != Some(dead) {
        return Ok(false);
    }
    if let Ok(unique) = resolve::unique_mount_id_of(top.as_fd()) {
        match listmount::children(unique, 1) {
            Ok(children) if children.is_empty() => {}
            Ok(_) => return Ok(false),
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(err) => return Err(HealError::mount("look for mounts on the dead source", source)(err)),
        }
    }
    mount::detach_top(top.as_fd()).map_err(HealError::mount("detach the dead source", source))?;
    debug!(source = %source.display(), "the dead source is in use: detached lazily");
    Ok(true)
}

impl Mounter {
    /// Unmounts the dead source `dead` (its unique mount ID), on top at
    /// `source`, without ever unmounting a mount made on it since: a plain
    /// unmount by path acts on whatever is on top at that moment, and a new
    /// daemon may mount over the dead mount at any moment. The first
    /// `umount2(MNT_EXPIRE)` marks the top; `listmount` (which touches no
    /// mount: a lookup would clear the mark) then says whether anything is
    /// mounted on the dead mount, which was on top when it was checked just
    /// before; if not, the second unmounts the top if it is still the marked
    /// one. A mount made on top in between is unmarked, so it is never taken.
    fn expire_dead_source(&self, source: &Path, dead: u64) -> Result<Expiry, HealError> {
        let (Some(parent), Some(name)) = (source.parent(), source.file_name()) else {
            return Err(HealError::NotAbsolute { path: source.to_path_buf() });
        };
        // By a handle on the parent, resolved without symlinks, and the last
        // component, not followed if a symlink: the lookup ends on the top
        // mount at the source path without holding it.
        let (parent, _) = self.resolve_target(parent)?;
        let at = PathBuf::from(format!("/proc/thread-self/fd/{}", parent.as_raw_fd())).join(name);
        let failed = |step| HealError::mount(step, source);
        // Marks the top: the dead mount, checked just before, or a mount made
        // on it since, fresh and so unmarked.
        match mount::expire(&at) {
            // Marked already, and unused: only a mark made since the check
            // (closing its handle cleared any), by someone else's expiry.
            Ok(()) => return Ok(Expiry::Unmounted),
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
            Err(err) if err.kind() == io::ErrorKind::ResourceBusy => return Ok(Expiry::Busy),
            Err(err) => return Err(failed("mark the dead source expired")(err)),
        }
        match listmount::children(dead, 1) {
            Ok(children) if children.is_empty() => {}
            Ok(_) => return Ok(Expiry::Covered),
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Expiry::Gone),
            Err(err) => return Err(failed("look for mounts on the dead source")(err)),
        }
        match mount::expire(&at) {
            Ok(()) => Ok(Expiry::Unmounted),
            // Looked at since it was marked, or covered just now: look again.
            Err(err) if matches!(err.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::ResourceBusy) => {
                Ok(Expiry::Used)
            }
            Err(err) => Err(failed("detach the dead source")(err)),
        }
    }
}
