//! One pass over the pod's processes: their mount namespaces, the FUSE
//! mounts in each, and which of those a live daemon serves.
//!
//! Only `/proc` links and text files are read, never a FUSE path, so a
//! stopped daemon cannot make the scan hang. Confirming that a mount is dead
//! does touch it, and happens off the loop ([`confirm_dead`]).
use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use fuse_supervisor_sys::resolve;
use tracing::debug;

use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::heal::fuse_calls;

use super::SidecarError;
use super::plan::{NamespaceView, ObservedMount, Serving};
use fuse_supervisor_engine::heal::in_namespace::InNamespaceHeal;
use fuse_supervisor_engine::model::namespace_table::{self, TableCaps};
use fuse_supervisor_engine::watch::processes::ProcessId;
use fuse_supervisor_engine::watch::processes::fuse_server::{FuseServers, MountDevice};

/// What one scan saw.
#[derive(Debug, Default)]
pub struct PodScan {
    /// Every mount namespace of the pod but the supervisor's own.
    pub namespaces: Vec<NamespaceView>,
    /// The processes serving a live mount in their own namespace: the FUSE
    /// daemons whose deaths matter.
    pub daemons: Vec<ProcessId>,
}

/// The identity of the mount namespace at `<proc_root>/<pid>/ns/mnt` (or
/// any `ns/mnt` path): its inode.
pub fn namespace_id(ns_file: &Path) -> io::Result<u64> {
    Ok(fs::metadata(ns_file)?.ino())
}

/// Scans every process under `proc_root` (with `shareProcessNamespace`,
/// the pod's), leaving out the namespace `own_namespace`.
pub fn scan(proc_root: &Path, own_namespace: u64) -> Result<PodScan, SidecarError> {
    let entries =
        fs::read_dir(proc_root).map_err(|source| SidecarError::Proc { path: proc_root.to_path_buf(), source })?;
    let mut by_namespace: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    for pid in entries.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok()) {
        // Gone meanwhile, or not ours to see: not part of the scan.
        let Ok(id) = namespace_id(&proc_root.join(pid.to_string()).join("ns/mnt")) else { continue };
        if id != own_namespace {
            by_namespace.entry(id).or_default().push(pid);
        }
    }
    let servers = FuseServers::scan(proc_root)?;
    let mut scan = PodScan::default();
    for (id, mut pids) in by_namespace {
        pids.sort_unstable();
        // Any process of the namespace shows its table; the first readable
        // one, within the table caps (a tenant makes it as big as it likes).
        let Some((pid, table)) = pids.iter().find_map(|&pid| {
            let table = namespace_table::read(proc_root, pid, &TableCaps::DEFAULT).ok()??;
            Some((pid, table))
        }) else {
            continue;
        };
        if table.overflow.any() {
            debug!(pid, overflow = ?table.overflow, "a container's mount table is over a cap; its FUSE mounts past it are left out");
        }
        let mut mounts = Vec::with_capacity(table.fuse_mounts.len());
        for mount in table.fuse_mounts {
            let device = MountDevice { major: mount.dev.major, minor: mount.dev.minor };
            let serving = match servers.serving(device) {
                Ok(serving) if serving.processes.is_empty() => Serving::Nobody,
                Ok(serving) => {
                    let here: Vec<ProcessId> =
                        serving.processes.iter().copied().filter(|process| pids.contains(&process.pid)).collect();
                    if here.is_empty() {
                        Serving::FromElsewhere
                    } else {
                        scan.daemons.extend(here);
                        Serving::FromHere
                    }
                }
                // Undecidable on this kernel: left alone rather than guessed.
                Err(err) => {
                    debug!(pid, %device, err = %chain(&err), "cannot tell who serves a FUSE mount");
                    Serving::FromElsewhere
                }
            };
            mounts.push(ObservedMount { mount, serving });
        }
        scan.namespaces.push(NamespaceView { id, pid, mounts });
    }
    scan.daemons.sort_unstable();
    scan.daemons.dedup();
    Ok(scan)
}

/// Whether each target of `heals` is, right now, the recorded mount and
/// dead: it answers `statfs` with `ENOTCONN` (or `ECONNABORTED`, an aborted
/// connection). Probed on a thread through `<proc_root>/<pid>/root`; a
/// target that has not answered within `timeout` (a stopped daemon, say)
/// counts as not confirmed, and its probe is left behind.
pub fn confirm_dead(proc_root: &Path, heals: &[InNamespaceHeal], timeout: Duration) -> Vec<bool> {
    let targets: Vec<(PathBuf, u32)> = heals
        .iter()
        .map(|heal| {
            let inside = heal.target.mount_point.strip_prefix("/").unwrap_or(&heal.target.mount_point);
            (proc_root.join(heal.pid.to_string()).join("root").join(inside), heal.target.mount_id)
        })
        .collect();
    let (report, answers) = mpsc::channel();
    let spawned = std::thread::Builder::new().name("sidecar-probe".into()).spawn(move || {
        for (index, (path, mount_id)) in targets.into_iter().enumerate() {
            let dead = resolve::open_path(&path).is_ok_and(|fd| {
                resolve::mount_id_of(fd.as_fd()).is_ok_and(|id| id == mount_id)
                    && fuse_calls::statfs(fd.as_fd()).is_err_and(|err| {
                        matches!(err.kind(), io::ErrorKind::NotConnected | io::ErrorKind::ConnectionAborted)
                    })
            });
            // The loop stopped waiting: nobody to tell.
            if report.send((index, dead)).is_err() {
                return;
            }
        }
    });
    let mut dead = vec![false; heals.len()];
    if let Err(err) = spawned {
        debug!(err = %chain(&err), "cannot start a probe thread; nothing confirmed");
        return dead;
    }
    let deadline = Instant::now() + timeout;
    while let Ok((index, answer)) = answers.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        if let Some(slot) = dead.get_mut(index) {
            *slot = answer;
        }
    }
    dead
}
