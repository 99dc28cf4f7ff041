//! `fuse-supervisor csi-proxy`: the CSI proxy, a sidecar of a CSI driver's
//! node-plugin pod (see `fuse_supervisor_engine::csi`).
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use fuse_supervisor_engine::csi::proxy::{self, ProxyConfig};

use crate::flags::OnOff;

#[derive(Debug, Args)]
#[command(next_help_heading = "CSI proxy")]
pub(crate) struct CsiProxyArgs {
    /// The unix socket the kubelet dials: the node-driver-registrar's
    /// `--kubelet-registration-path` (its path as the kubelet sees it).
    #[arg(long, value_name = "SOCKET", env = "FUSE_SUPERVISOR_CSI_LISTEN")]
    pub(crate) listen: PathBuf,
    /// The driver's own unix socket, where every call is passed.
    #[arg(long, value_name = "SOCKET", env = "FUSE_SUPERVISOR_CSI_DRIVER_SOCKET")]
    pub(crate) driver_socket: PathBuf,
    /// Where the successful NodeStageVolume and NodePublishVolume requests
    /// are recorded (made 0700); a tmpfs of the host, under /run.
    #[arg(long, value_name = "DIR", env = "FUSE_SUPERVISOR_CSI_RECORD_DIR")]
    pub(crate) record_dir: PathBuf,
    /// Whether records keep the requests' secrets (a driver that needs
    /// none to stage can do without).
    #[arg(long, value_enum, default_value = "on", env = "FUSE_SUPERVISOR_CSI_RECORD_SECRETS")]
    pub(crate) record_secrets: OnOff,
}

impl CsiProxyArgs {
    pub(crate) fn config(self) -> ProxyConfig {
        ProxyConfig {
            listen: self.listen,
            driver_socket: self.driver_socket,
            record_dir: self.record_dir,
            record_secrets: self.record_secrets == OnOff::On,
        }
    }
}

/// Serves until SIGTERM or SIGINT.
pub(crate) fn command(args: CsiProxyArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the CSI proxy's runtime")?;
    runtime.block_on(async {
        let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("cannot watch SIGTERM")?;
        let shutdown = async move {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        };
        proxy::serve(args.config(), shutdown).await.map_err(anyhow::Error::from)
    })
}
