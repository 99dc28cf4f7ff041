//! The FUSE filesystem built into the project (owned by the demofs helper).
use std::path::PathBuf;

/// What `fuse-supervisor internal demofs` serves, and where.
#[derive(Debug, Clone)]
pub struct DemoFsOptions {
    /// Directory whose contents the filesystem serves.
    pub backing: PathBuf,
    /// Where to mount; whatever is mounted there already stays underneath.
    pub mountpoint: PathBuf,
    /// FUSE subtype: the mount shows as `fuse.<name>`.
    pub name: String,
}

#[derive(Debug, thiserror::Error)]
pub enum DemoFsError {
    #[error("demofs is not implemented yet")]
    NotImplemented,
}

/// Mounts and serves until the mount goes away or the process is killed.
pub fn serve(_options: &DemoFsOptions) -> Result<(), DemoFsError> {
    Err(DemoFsError::NotImplemented)
}
