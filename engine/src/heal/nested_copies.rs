//! Copies of the mounts nested in containers' volumes (a configMap at
//! `<volume>/config`), taken before any death, for a heal to carry over.
//!
//! Once a dead FUSE mount's entry for a nested mount's mount point has
//! timed out, the first lookup of that path (an application re-reading its
//! configuration) makes the kernel invalidate the entry and detach the
//! mounts on it. That can happen in the milliseconds between the death and
//! the isolation that takes copies ([`super::containers::isolate`]): the
//! mount is then gone, and nothing would even say so. So copies are taken
//! ahead, each a detached tree of the nested mount (in no namespace; it
//! holds the mount's filesystem, not the mount, which its owner can still
//! unmount):
//! - when a namespace is learnt (a container's first exec: the runtime
//!   has made its mounts), of the mounts on each of its mounts of a watched
//!   connection; the lookups are the connection's server's, so the FUSE
//!   call helper makes them, on a namespace worker;
//! - when a connection becomes watched, in the known namespaces holding it;
//! - at each heal, of the mounts it carried onto the replacement, from the
//!   carried mounts themselves (no lookup).
//!
//! At the isolation a nested mount still there is copied afresh (mounts may
//! have been made below it since); the copy taken ahead stands in for one
//! that is gone, unless another mount is at its mount point by then. Copies
//! go with their namespace, and are at most [`MOST_COPIES`] on the node
//! (fewer under a low open-file limit).
use std::collections::{BTreeSet, HashMap};
use std::sync::{Mutex, OnceLock, PoisonError};

use fuse_supervisor_sys::fds;

use tracing::warn;

use super::carry::{Nested, NestedMount};
use crate::model::table::Dev;

/// The most copies held at once: a tenant decides how many mounts it nests.
/// Each holds a descriptor, so at most a quarter of the open-file limit
/// too: the heals need theirs.
pub const MOST_COPIES: usize = 4096;

fn most_copies() -> usize {
    static MOST: OnceLock<usize> = OnceLock::new();
    *MOST.get_or_init(|| {
        let quarter =
            fds::open_file_limit().map_or(usize::MAX, |limit| usize::try_from(limit / 4).unwrap_or(usize::MAX));
        MOST_COPIES.min(quarter)
    })
}

/// The copies, by the unique ID of the mount they were on.
#[derive(Debug, Default)]
pub struct NestedCopies {
    held: Mutex<Held>,
    /// The connections whose mounts' nested mounts are copied.
    watched: Mutex<BTreeSet<Dev>>,
}

#[derive(Debug, Default)]
struct Held {
    by_mount: HashMap<u64, Copies>,
    count: usize,
    /// Whether the cap was met since it was last said.
    said_full: bool,
}

#[derive(Debug)]
struct Copies {
    /// The namespace (inode) the mount they were on is in.
    namespace: u64,
    mounts: Vec<NestedMount>,
}

impl NestedCopies {
    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds `mounts`, the copies of those on mount `on` (its unique ID) in
    /// `namespace`, in place of any held for it; as many as fit the cap.
    pub fn put(&self, namespace: u64, on: u64, mut mounts: Vec<NestedMount>) {
        let mut held = self.held();
        if let Some(old) = held.by_mount.remove(&on) {
            held.count -= old.mounts.len();
        }
        let room = most_copies().saturating_sub(held.count);
        if mounts.len() > room {
            if !held.said_full {
                warn!(
                    most = most_copies(),
                    namespace,
                    "too many nested mounts to copy ahead: those left out are copied at their volume's death, if they still resolve then"
                );
                held.said_full = true;
            }
            mounts.truncate(room);
        }
        if mounts.is_empty() {
            return;
        }
        held.count += mounts.len();
        held.by_mount.insert(on, Copies { namespace, mounts });
    }

    /// Takes the copies of the mounts that were on mount `on`.
    pub fn take(&self, on: u64) -> Vec<NestedMount> {
        let mut held = self.held();
        let Some(copies) = held.by_mount.remove(&on) else { return Vec::new() };
        held.count -= copies.mounts.len();
        held.said_full = false;
        copies.mounts
    }

    /// Whether copies of the mounts on mount `on` are held.
    pub fn holds(&self, on: u64) -> bool {
        self.held().by_mount.contains_key(&on)
    }

    /// How many copies are held.
    pub fn len(&self) -> usize {
        self.held().count
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops the copies taken in `namespace`, which is gone.
    pub fn forget_namespace(&self, namespace: u64) {
        let mut held = self.held();
        let mut dropped = 0;
        held.by_mount.retain(|_, copies| {
            let keep = copies.namespace != namespace;
            if !keep {
                dropped += copies.mounts.len();
            }
            keep
        });
        held.count -= dropped;
    }

    /// The connections whose mounts' nested mounts are copied.
    pub fn watched(&self) -> BTreeSet<Dev> {
        self.watched.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Copies from now on the nested mounts of `connections`' mounts;
    /// returns those not watched before.
    pub fn watch(&self, connections: BTreeSet<Dev>) -> BTreeSet<Dev> {
        let mut watched = self.watched.lock().unwrap_or_else(PoisonError::into_inner);
        let new = connections.difference(&watched).copied().collect();
        *watched = connections;
        new
    }
}

/// What an isolation carries over: `fresh`, the copies it took of the
/// mounts on the dead mount at `point`, and in place of a mount it could
/// not copy (its mount point no longer resolved, or it was detached
/// already) the copy taken ahead, unless another mount is at its mount
/// point now.
pub fn stand_in(mut fresh: Nested, ahead: Vec<NestedMount>, point: &std::path::Path) -> Nested {
    for copy in ahead {
        let replaced =
            fresh.held.iter().any(|taken| taken.unique_id == copy.unique_id || taken.relative == copy.relative);
        if replaced {
            continue;
        }
        let mount_point = point.join(&copy.relative);
        fresh.missed.retain(|missed| missed.mount_point != mount_point);
        fresh.held.push(copy);
    }
    fresh
}

#[cfg(test)]
mod tests {
    use std::os::fd::OwnedFd;
    use std::path::PathBuf;

    use super::*;
    use crate::heal::carry::NotCarried;

    fn copy(unique_id: u64, relative: &str) -> NestedMount {
        let copy: OwnedFd = std::fs::File::open("/").unwrap().into();
        NestedMount { unique_id, relative: PathBuf::from(relative), copy }
    }

    #[test]
    fn a_copy_taken_ahead_stands_in_only_for_a_mount_not_copied_afresh() {
        let fresh = Nested {
            held: vec![copy(10, "config")],
            missed: vec![NotCarried { mount_point: "/data/secret".into(), why: "ENOTCONN".into() }],
        };
        let ahead = vec![copy(10, "config"), copy(11, "secret"), copy(12, "gone"), copy(13, "config")];

        let carried = stand_in(fresh, ahead, std::path::Path::new("/data"));

        let uniques: Vec<u64> = carried.held.iter().map(|mount| mount.unique_id).collect();
        assert_eq!(uniques, [10, 11, 12]);
        assert!(carried.missed.is_empty());
    }

    #[test]
    fn copies_go_with_their_namespace_and_never_exceed_the_cap() {
        let copies = NestedCopies::default();
        copies.put(1, 100, vec![copy(10, "a"), copy(11, "b")]);
        copies.put(2, 200, vec![copy(20, "a")]);
        assert_eq!(copies.len(), 3);

        copies.forget_namespace(1);
        assert!(!copies.holds(100));
        assert_eq!(copies.len(), 1);

        let cap = most_copies();
        assert!(cap > 1 && cap <= MOST_COPIES, "{cap}");
        let many = (0..cap as u64).map(|unique| copy(1000 + unique, "x")).collect();
        copies.put(3, 300, many);
        assert_eq!(copies.len(), cap);
        assert_eq!(copies.take(200).len(), 1);
        assert_eq!(copies.len(), cap - 1);
    }

    #[test]
    fn watching_names_only_the_connections_new_to_it() {
        let copies = NestedCopies::default();
        let dev = |minor| Dev { major: 0, minor };
        assert_eq!(copies.watch(BTreeSet::from([dev(1), dev(2)])), BTreeSet::from([dev(1), dev(2)]));
        assert_eq!(copies.watch(BTreeSet::from([dev(2), dev(3)])), BTreeSet::from([dev(3)]));
        assert_eq!(copies.watched(), BTreeSet::from([dev(2), dev(3)]));
    }
}
