//! The CSI tier of the test world: a CSI node plugin that speaks the real
//! CSI gRPC API and mounts third-party FUSE daemons ([`plugin`], run as
//! `fuse-supervisor internal csi-plugin`), a blocking CSI client playing
//! the kubelet ([`CsiClient`]), the paths the kubelet (1.24+) gives a
//! driver, and handles on the plugin and the CSI proxy as processes of a
//! [`Sandbox`](super::Sandbox) ([`CsiPluginProcess`], [`CsiProxyProcess`]).
mod client;
pub mod plugin;
mod processes;
mod serve;

pub use client::CsiClient;
pub use processes::{CsiPluginProcess, CsiProxyProcess, children_of};
pub use serve::serve_identity_and_node;

use std::io;
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

/// What can go wrong running the CSI tier.
#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    #[error("{step}")]
    Io {
        step: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot connect to the CSI socket {socket}")]
    Connect {
        socket: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("{what} did not happen within {waited:?}")]
    Timeout { what: String, waited: std::time::Duration },
}

pub(super) fn io_step(step: impl Into<String>) -> impl FnOnce(io::Error) -> CsiError {
    let step = step.into();
    move |source| CsiError::Io { step, source }
}

/// The staging path the kubelet (1.24+) gives a driver for a volume:
/// `plugins/kubernetes.io/csi/<driver>/<sha256 of the volume handle>/globalmount`.
pub fn staging_path(kubelet_root: &Path, driver: &str, volume_handle: &str) -> PathBuf {
    let hash: String = Sha256::digest(volume_handle.as_bytes()).iter().map(|byte| format!("{byte:02x}")).collect();
    kubelet_root.join("plugins/kubernetes.io/csi").join(driver).join(hash).join("globalmount")
}

/// The `vol_data.json` the kubelet writes beside a pod's CSI volume
/// `mount` directory (`pods/<uid>/volumes/kubernetes.io~csi/<pv>/`).
pub fn vol_data_json(driver: &str, volume_handle: &str, pv: &str, pod_uid: &str) -> String {
    serde_json::json!({
        "attachmentID": "",
        "driverName": driver,
        "nodeName": "node",
        "specVolID": pv,
        "volumeHandle": volume_handle,
        "volumeLifecycleMode": "Persistent",
        "podUID": pod_uid,
    })
    .to_string()
}
