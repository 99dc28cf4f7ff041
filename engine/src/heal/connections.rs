//! The FUSE connections of the node, as the control filesystem (`fusectl`)
//! lists them: a directory per live connection, named by its device
//! number, which the kernel makes afresh for every connection and removes
//! with its superblock. A device number alone does not name a connection
//! (a freed anonymous minor is the next connection's); with its
//! directory's inode it does.
//!
//! `fusectl` has one instance for the node. Where it is not mounted (in
//! the agent's own container, or on a host that never mounted it) a private
//! instance attached nowhere reads the same directories.
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, OnceLock};

use fuse_supervisor_sys::{mount, resolve};
use tracing::{debug, warn};

use crate::errors::chain;
use crate::model::table::Dev;
use crate::watch::processes::fuse_server::MountDevice;

/// Where hosts mount the FUSE control filesystem.
pub const FUSE_CONNECTIONS: &str = "/sys/fs/fuse/connections";

/// The directory listing the live connections; None where it cannot be
/// had (no `CAP_SYS_ADMIN`): a number then stands for its connection.
#[derive(Debug)]
pub struct FuseConnections {
    dir: Option<OwnedFd>,
}

/// The process's one [`FuseConnections`]: every instance of `fusectl`
/// lists the same connections, so one descriptor serves every user.
static SHARED: OnceLock<Arc<FuseConnections>> = OnceLock::new();

impl FuseConnections {
    /// The process's instance, opened at the first call (see
    /// [`FuseConnections::open`]; `mounted` of later calls is not looked at).
    pub fn shared(mounted: &Path) -> Arc<FuseConnections> {
        Arc::clone(SHARED.get_or_init(|| Arc::new(FuseConnections::open(mounted))))
    }

    /// `fusectl` where it is mounted at `mounted`, else a private instance.
    pub fn open(mounted: &Path) -> Self {
        let at_path = resolve::open_dir(mounted).ok().filter(|dir| mount::is_fusectl(dir.as_fd()).unwrap_or(false));
        if let Some(dir) = at_path {
            return FuseConnections { dir: Some(dir) };
        }
        match mount::detached_fusectl() {
            Ok(dir) => {
                debug!(mounted = %mounted.display(), "fusectl is not mounted there: a private instance lists the connections");
                FuseConnections { dir: Some(dir) }
            }
            Err(err) => {
                warn!(mounted = %mounted.display(), err = %chain(&err), "cannot read the FUSE connections (fusectl): a connection is told by its device number alone");
                FuseConnections { dir: None }
            }
        }
    }

    /// Any directory laid out like `fusectl` (tests).
    pub fn at(dir: &Path) -> Self {
        FuseConnections { dir: resolve::open_dir(dir).ok() }
    }

    /// None to read: a number stands for its connection.
    pub fn unavailable() -> Self {
        FuseConnections { dir: None }
    }

    /// The inode of the directory of the connection numbered `dev`; None
    /// where the connection is gone, or there is no directory to read.
    pub fn inode_of(&self, dev: Dev) -> Option<u64> {
        resolve::inode_at(self.dir.as_ref()?.as_fd(), &directory_name(dev)).ok()
    }

    /// Whether there is a directory to read.
    pub fn is_available(&self) -> bool {
        self.dir.is_some()
    }
}

/// The name of connection `dev`'s directory: its number as the kernel
/// writes it ([`MountDevice::connection`]).
pub(crate) fn directory_name(dev: Dev) -> String {
    MountDevice { major: dev.major, minor: dev.minor }.connection().to_string()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn the_directory_is_named_by_the_kernels_device_number() {
        let connections = tempfile::tempdir().unwrap();
        let dir = connections.path().join(((8u64 << 20) | 1).to_string());
        std::fs::create_dir(&dir).unwrap();
        let opened = FuseConnections::at(connections.path());
        assert_eq!(opened.inode_of(Dev { major: 8, minor: 1 }), Some(std::fs::metadata(&dir).unwrap().ino()));
        assert_eq!(opened.inode_of(Dev { major: 0, minor: 1 }), None);
        assert_eq!(FuseConnections::unavailable().inode_of(Dev { major: 8, minor: 1 }), None);
    }

    /// The tests run as root: where this machine has no `fusectl` mounted,
    /// the private instance lists the same connections as a mount of it.
    #[test]
    fn a_private_instance_lists_the_connections_of_the_node() {
        let connections = FuseConnections::open(Path::new("/nonexistent"));
        assert!(connections.is_available());
        let dir = connections.dir.as_ref().unwrap();
        assert!(mount::is_fusectl(dir.as_fd()).unwrap());
    }
}
