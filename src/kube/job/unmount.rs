//! Unmounting a finished pod's FUSE mounts, in the mount namespaces that
//! hold them: `umount2` of each mount on the connection's device, never
//! `mount(8)`.
//!
//! Each namespace gets a short-lived thread that joins it (the lifecycle
//! thread stays in the container's own namespace, where the kubelet token
//! and CA files are). Mounts are unmounted children first (reverse table
//! order), and only a mount whose ID is, at that moment, the top of its
//! mount point: nothing else is ever unmounted.
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use fuse_supervisor_sys::{mount, ns, resolve};
use tracing::{info, warn};

use crate::model::mountinfo::MountInfoReader;
use crate::model::table::{Dev, Snapshot};
use crate::watch::processes::fuse_server::MountDevice;

/// `EBUSY`, the same number on every Linux architecture.
const EBUSY: i32 = 16;

#[derive(Debug, thiserror::Error)]
pub enum UnmountError {
    #[error("cannot join mount namespace {path}")]
    Namespace {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the mount table of namespace {path}")]
    Table {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot start the unmount thread")]
    Thread(#[source] io::Error),
    #[error("the unmount thread panicked")]
    Panicked,
}

/// What happened in one namespace.
#[derive(Debug, Default)]
pub struct Unmounted {
    /// Mount points unmounted (lazily, if they were busy).
    pub unmounted: Vec<PathBuf>,
    /// Mount points that could not be unmounted, with why.
    pub failed: Vec<(PathBuf, io::Error)>,
}

/// Unmounts every mount on `devices` in the namespace at `namespace`
/// (`/proc/<pid>/ns/mnt`).
pub fn unmount_devices(namespace: &Path, devices: &[MountDevice]) -> Result<Unmounted, UnmountError> {
    let (namespace, devices) = (namespace.to_path_buf(), devices.to_vec());
    std::thread::Builder::new()
        .name("job-unmount".into())
        .spawn(move || {
            ns::join_mount_namespace(&namespace)
                .map_err(|source| UnmountError::Namespace { path: namespace.clone(), source })?;
            unmount_here(&namespace, &devices)
        })
        .map_err(UnmountError::Thread)?
        .join()
        .map_err(|_| UnmountError::Panicked)?
}

/// In the calling thread's namespace (which it joined).
fn unmount_here(namespace: &Path, devices: &[MountDevice]) -> Result<Unmounted, UnmountError> {
    let table_error = |source| UnmountError::Table { path: namespace.to_path_buf(), source };
    let file = File::open("/proc/thread-self/mountinfo").map_err(table_error)?;
    let mut reader = MountInfoReader::from_file(file);
    let table = reader.read().map_err(table_error)?;
    let snapshot =
        Snapshot::parse(table).map_err(|err| table_error(io::Error::new(io::ErrorKind::InvalidData, err)))?;
    let devs: Vec<Dev> = devices.iter().map(|d| Dev { major: d.major, minor: d.minor }).collect();
    let mut done = Unmounted::default();
    for fuse in snapshot.fuse_mounts.iter().rev().filter(|m| devs.contains(&m.dev)) {
        let path = &fuse.mount_point;
        let on_top = resolve::open_path(path).and_then(|fd| resolve::mount_id_of(fd.as_fd()));
        match on_top {
            Ok(id) if id == fuse.mount_id => {}
            Ok(id) => {
                // Covered by another mount, or gone with a parent already.
                info!(mount_point = %path.display(), expected = fuse.mount_id, found = id, "not the FUSE mount on top; left");
                continue;
            }
            Err(err) => {
                done.failed.push((path.clone(), err));
                continue;
            }
        }
        let result = match mount::unmount(path) {
            Err(err) if err.raw_os_error() == Some(EBUSY) => {
                warn!(mount_point = %path.display(), "busy; detaching lazily");
                mount::detach(path)
            }
            other => other,
        };
        match result {
            Ok(()) => done.unmounted.push(path.clone()),
            Err(err) => done.failed.push((path.clone(), err)),
        }
    }
    Ok(done)
}
