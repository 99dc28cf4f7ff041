//! The container model of DESIGN.md (owned by the testbed helper).
use std::path::PathBuf;
use std::time::Duration;

/// A process that sets up its mount namespace the way runc does and then
/// reads one volume in a loop, reporting what it sees on stdout.
#[derive(Debug, Clone)]
pub struct ContainerOptions {
    /// Host path of the pod's volume (the target).
    pub volume: PathBuf,
    /// Directory that becomes the container's root filesystem.
    pub rootfs: PathBuf,
    /// Host directories the container must not see (kubelet and runtime roots).
    pub hide: Vec<PathBuf>,
    /// File to read, relative to the volume.
    pub read: PathBuf,
    /// Pause between reads.
    pub interval: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    #[error("container model is not implemented yet")]
    NotImplemented,
}

/// Never returns on success: reads until killed.
pub fn run(_options: &ContainerOptions) -> Result<(), ContainerError> {
    Err(ContainerError::NotImplemented)
}
