//! Healing inside the other mount namespaces of the node: the containers
//! (and any other namespace) that hold a mount of a dead FUSE connection.
//!
//! The host heal reaches a container only by propagation, and only one
//! whose volume is a slave of the target (`mountPropagation:
//! HostToContainer`); the dead copy then stays under the live one, out of
//! reach of any path, pinning the dead connection until the container
//! exits; a container whose volume is private (`None`, the default) is
//! never reached. So, in two steps:
//!
//! 1. **Isolate**, when the daemon's death is seen (before any new mount
//!    exists): find every other namespace holding a mount of the dead
//!    connection (among the node's namespaces kept by events,
//!    [`super::namespaces`], or by a walk of `/proc/*/ns/mnt` without
//!    them) and make each such mount private, so the host heal propagates
//!    nothing into it: no dead layer can end up covered. Right before the
//!    host heal, the namespaces learnt since are isolated too.
//! 2. **Replace**, after the host heal, one thread per namespace, in
//!    parallel: sidecar mode's in-namespace heal
//!    ([`super::in_namespace::heal_in_namespaces`]): clone the new source
//!    (its subdirectory for a subPath) in the watched namespace, give the
//!    clone the mount's old propagation (a slave of the new source for a
//!    slave, private for a private one), enter the container's namespace,
//!    resolve the mount point beneath its root with no symlinks, check it is
//!    still the recorded dead mount (ID and device), slide the clone beneath
//!    it and detach the dead one. The container goes from the dead mount to
//!    the live one in one step and keeps exactly one layer.
//!
//! A namespace whose mount was covered by a live one before it could be
//! isolated (the death was not seen before the new mount) is left to the
//! propagation, with its dead layer under the live one: reported, not hidden.
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use fuse_supervisor_sys::mount::{self, Propagation};
use fuse_supervisor_sys::ns;

use super::in_namespace::{self, HealNamespaces, InNamespaceError, InNamespaceHeal, InNamespaceHealed, LiveSource};
use super::namespaces::NamespaceRead;
use super::priority::HealPriority;
use crate::model::table::{Dev, FuseMount, root_within};

#[derive(Debug, thiserror::Error)]
pub enum ContainerHealError {
    #[error("cannot list the namespaces of {proc_root}")]
    Walk {
        proc_root: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot open the mount namespace of process {pid}")]
    OpenNamespace {
        pid: u32,
        #[source]
        source: io::Error,
    },
    #[error("process {pid} is no longer in mount namespace {expected}")]
    NamespaceGone { pid: u32, expected: u64 },
    #[error("cannot start a thread for the mount namespace of process {pid}")]
    Thread {
        pid: u32,
        #[source]
        source: io::Error,
    },
    #[error("cannot make {path} private in the mount namespace of process {pid}")]
    Isolate {
        pid: u32,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} in the mount namespace of process {pid} is not under the new source {source_root}")]
    NotUnderSource { pid: u32, path: PathBuf, source_root: PathBuf },
    #[error(transparent)]
    InNamespace(#[from] InNamespaceError),
}

/// A mount of a dead connection in a namespace other than the watched one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForeignMount {
    /// The namespace's inode: its identity.
    pub namespace: u64,
    /// A process in it, through which it is entered.
    pub pid: u32,
    /// As its own table shows it (mount point inside the namespace).
    pub mount: FuseMount,
    /// What the mount's replacement gets: `Slave` if the mount received
    /// the host's mounts (a `HostToContainer` volume), else `Private`.
    pub propagation: Propagation,
}

/// How one foreign mount came out of a heal.
#[derive(Debug)]
pub enum ForeignHealed {
    /// The dead mount was replaced by a clone of the new source: one layer.
    Replaced,
    /// The clone was stacked on the dead mount, which stays under it.
    Stacked { why: io::Error },
}

/// The mounts of a connection in `dead` that `read` holds, to heal.
pub(super) fn foreign_mounts(read: &NamespaceRead, dead: &BTreeSet<Dev>) -> Vec<ForeignMount> {
    dead_tops(&read.fuse_mounts, dead)
        .into_iter()
        .map(|mount| ForeignMount {
            namespace: read.namespace,
            pid: read.anchor.pid,
            propagation: if mount.master.is_some() { Propagation::Slave } else { Propagation::Private },
            mount,
        })
        .collect()
}

/// The mounts of `dead` connections on top at their mount point (a mount
/// under another one at the same point is out of reach), and not inside
/// another dead one (its parent's replacement takes it along).
fn dead_tops(mounts: &[FuseMount], dead: &BTreeSet<Dev>) -> Vec<FuseMount> {
    let covered = |mount: &FuseMount| {
        mounts.iter().any(|other| other.parent_id == mount.mount_id && other.mount_point == mount.mount_point)
    };
    let in_dead =
        |mount: &FuseMount| mounts.iter().any(|other| other.mount_id == mount.parent_id && dead.contains(&other.dev));
    mounts.iter().filter(|mount| dead.contains(&mount.dev) && !covered(mount) && !in_dead(mount)).cloned().collect()
}

/// Makes every mount of `mounts` private, each namespace on a thread of its
/// own at `priority`, so that no heal on the host propagates onto them.
/// Returns the mounts that could not be isolated, with why.
pub fn isolate(mounts: &[ForeignMount], priority: HealPriority) -> Vec<(ForeignMount, ContainerHealError)> {
    let by_namespace = by_namespace(mounts);
    let isolate_all = |mounts: &[&ForeignMount]| -> Vec<(ForeignMount, ContainerHealError)> {
        let first = mounts[0];
        let entered = open_namespace(first.pid, first.namespace).and_then(|namespace| {
            ns::enter_mount_namespace(namespace.as_fd())
                .map_err(|source| ContainerHealError::OpenNamespace { pid: first.pid, source })
        });
        if let Err(err) = entered {
            let why = err.to_string();
            let err = |foreign: &ForeignMount| ContainerHealError::Isolate {
                pid: foreign.pid,
                path: foreign.mount.mount_point.clone(),
                source: io::Error::other(why.clone()),
            };
            return failed_all(mounts, err, |err| err);
        }
        let mut failed = Vec::new();
        for foreign in mounts {
            let made_private = in_namespace::open_recorded(foreign.pid, &foreign.mount)
                .map_err(ContainerHealError::from)
                .and_then(|stale| {
                    mount::make_private(stale.as_fd()).map_err(|source| ContainerHealError::Isolate {
                        pid: foreign.pid,
                        path: foreign.mount.mount_point.clone(),
                        source,
                    })
                });
            if let Err(err) = made_private {
                failed.push(((*foreign).clone(), err));
            }
        }
        failed
    };
    in_threads(&by_namespace, priority, isolate_all, |err| err).into_iter().flatten().collect()
}

/// Replaces every mount of `mounts` with a clone of `source` (a live FUSE
/// mount of the namespace `watched` is an fd of), of the subdirectory the
/// dead mount showed, each namespace on a thread of its own at `priority`,
/// all at once.
pub fn replace(
    watched: &OwnedFd,
    source: &FuseMount,
    dead_root: &Path,
    mounts: &[ForeignMount],
    priority: HealPriority,
) -> Vec<(ForeignMount, Result<ForeignHealed, ContainerHealError>)> {
    let by_namespace = by_namespace(mounts);
    let own_pid = std::process::id();
    let replace_all = |mounts: &[&ForeignMount]| -> Vec<(ForeignMount, Result<ForeignHealed, ContainerHealError>)> {
        // One thread per namespace: each heal enters the watched namespace
        // and then the container's, so a fresh pair of fds each time.
        mounts
            .iter()
            .map(|foreign| {
                let healed = replace_one(watched, own_pid, source, dead_root, foreign);
                ((*foreign).clone(), healed)
            })
            .collect()
    };
    in_threads(&by_namespace, priority, replace_all, Err).into_iter().flatten().collect()
}

fn replace_one(
    watched: &OwnedFd,
    own_pid: u32,
    source: &FuseMount,
    dead_root: &Path,
    foreign: &ForeignMount,
) -> Result<ForeignHealed, ContainerHealError> {
    let subdir = root_within(dead_root, &foreign.mount.root).ok_or_else(|| ContainerHealError::NotUnderSource {
        pid: foreign.pid,
        path: foreign.mount.mount_point.clone(),
        source_root: dead_root.to_path_buf(),
    })?;
    let heal = InNamespaceHeal {
        source: LiveSource { namespace: 0, pid: own_pid, mount: source.clone() },
        subdir,
        namespace: foreign.namespace,
        pid: foreign.pid,
        target: foreign.mount.clone(),
    };
    let source_namespace =
        watched.try_clone().map_err(|source| ContainerHealError::OpenNamespace { pid: own_pid, source })?;
    let namespaces = HealNamespaces::from_fds(source_namespace, open_namespace(foreign.pid, foreign.namespace)?);
    match in_namespace::heal_in_namespaces(&heal, &namespaces, Some(foreign.propagation))? {
        InNamespaceHealed::Replaced => Ok(ForeignHealed::Replaced),
        InNamespaceHealed::Stacked { why } => Ok(ForeignHealed::Stacked { why }),
    }
}

/// Mount namespace `expected`, through `/proc/<pid>/ns/mnt`, or, if `pid`
/// exited (the walk may have found the namespace through a short-lived
/// process) or is now elsewhere, through any other process still in it.
fn open_namespace(pid: u32, expected: u64) -> Result<OwnedFd, ContainerHealError> {
    let proc_root = Path::new("/proc");
    open_namespace_of(proc_root, pid, expected).or_else(|err| {
        let others = fs::read_dir(proc_root)
            .map_err(|source| ContainerHealError::Walk { proc_root: proc_root.to_path_buf(), source })?;
        others
            .flatten()
            .filter_map(|entry| entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()))
            .filter(|other| *other != pid)
            .find_map(|other| open_namespace_of(proc_root, other, expected).ok())
            .ok_or(err)
    })
}

/// `<proc_root>/<pid>/ns/mnt`, refused if it is not namespace `expected`.
fn open_namespace_of(proc_root: &Path, pid: u32, expected: u64) -> Result<OwnedFd, ContainerHealError> {
    let path = proc_root.join(pid.to_string()).join("ns/mnt");
    let file = fs::File::open(&path).map_err(|source| ContainerHealError::OpenNamespace { pid, source })?;
    let found = file.metadata().map_err(|source| ContainerHealError::OpenNamespace { pid, source })?.ino();
    if found != expected {
        return Err(ContainerHealError::NamespaceGone { pid, expected });
    }
    Ok(file.into())
}

fn by_namespace(mounts: &[ForeignMount]) -> Vec<Vec<&ForeignMount>> {
    let mut grouped: BTreeMap<u64, Vec<&ForeignMount>> = BTreeMap::new();
    for foreign in mounts {
        grouped.entry(foreign.namespace).or_default().push(foreign);
    }
    grouped.into_values().collect()
}

/// Every mount of a group that failed as a whole, each with its own error.
fn failed_all<T>(
    mounts: &[&ForeignMount],
    err: impl Fn(&ForeignMount) -> ContainerHealError,
    wrap: impl Fn(ContainerHealError) -> T,
) -> Vec<(ForeignMount, T)> {
    mounts.iter().map(|foreign| ((*foreign).clone(), wrap(err(foreign)))).collect()
}

/// Runs `work` on each group on a scoped thread of its own (each enters a
/// namespace, so none is reused) at `priority`, and collects the results; a
/// group whose thread cannot start or panics is reported failed through
/// `wrap`. At the normal priority, among 100 busy containers on two CPUs,
/// each thread waited for a CPU behind the containers' shells: the heal of
/// 100 took tens of milliseconds of mostly waiting (README, Limits).
fn in_threads<T: Send, F>(
    groups: &[Vec<&ForeignMount>],
    priority: HealPriority,
    work: F,
    wrap: impl Fn(ContainerHealError) -> T,
) -> Vec<Vec<(ForeignMount, T)>>
where
    F: Fn(&[&ForeignMount]) -> Vec<(ForeignMount, T)> + Sync,
{
    std::thread::scope(|scope| {
        let work = &work;
        let handles: Vec<_> = groups
            .iter()
            .map(|group| {
                let spawned =
                    std::thread::Builder::new().name("container-heal".into()).spawn_scoped(scope, move || {
                        priority.raise();
                        work(group.as_slice())
                    });
                (group, spawned)
            })
            .collect();
        handles
            .into_iter()
            .map(|(group, spawned)| {
                let thread_error = |message: &str| {
                    let message = message.to_owned();
                    move |foreign: &ForeignMount| ContainerHealError::Thread {
                        pid: foreign.pid,
                        source: io::Error::other(message.clone()),
                    }
                };
                match spawned {
                    Ok(handle) => {
                        handle.join().unwrap_or_else(|_| failed_all(group, thread_error("the thread panicked"), &wrap))
                    }
                    Err(err) => failed_all(group, thread_error(&err.to_string()), &wrap),
                }
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::table::Snapshot;

    fn fuse(mount_id: u32, parent_id: u32, minor: u32, point: &str, root: &str) -> FuseMount {
        FuseMount {
            mount_id,
            parent_id,
            dev: Dev { major: 0, minor },
            root: root.into(),
            mount_point: point.into(),
            peer_group: None,
            master: None,
            fs_type: "fuse.bindfs".into(),
            source: "x".into(),
            table_order: mount_id,
        }
    }

    #[test]
    fn only_uncovered_dead_mounts_outside_other_dead_ones_are_healed() {
        let dead = BTreeSet::from([Dev { major: 0, minor: 50 }]);
        let snapshot = Snapshot {
            fuse_mounts: vec![
                fuse(10, 1, 50, "/volume", "/"),
                // Inside the dead /volume: goes with it.
                fuse(11, 10, 50, "/volume/sub", "/sub"),
                // Dead, covered by a live mount at the same point.
                fuse(12, 1, 50, "/other", "/"),
                fuse(13, 12, 60, "/other", "/"),
                // Live.
                fuse(14, 1, 60, "/live", "/"),
                fuse(15, 1, 50, "/subpath", "/sub"),
            ],
            total_mounts: 20,
        };
        let ids: Vec<u32> = dead_tops(&snapshot.fuse_mounts, &dead).iter().map(|mount| mount.mount_id).collect();
        assert_eq!(ids, [10, 15]);
    }
}
