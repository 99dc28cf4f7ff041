//! `webhook`: the mount-policy admission webhook's flags.
use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;
use fuse_supervisor::webhook::{self, Selection, WebhookConfig};

#[derive(Debug, Args)]
#[command(next_help_heading = "Webhook")]
pub(crate) struct WebhookArgs {
    /// CSI driver names whose volumes get HostToContainer (comma-separated
    /// or repeated): PVCs bound to their PVs, and inline CSI volumes.
    #[arg(long = "driver", value_name = "NAME", value_delimiter = ',', env = "FUSE_SUPERVISOR_WEBHOOK_DRIVERS")]
    pub(crate) drivers: Vec<String>,
    /// StorageClass names whose volumes get HostToContainer (comma-separated
    /// or repeated).
    #[arg(
        long = "storage-class",
        value_name = "NAME",
        value_delimiter = ',',
        env = "FUSE_SUPERVISOR_WEBHOOK_STORAGE_CLASSES"
    )]
    pub(crate) storage_classes: Vec<String>,
    /// A pod with this annotation set to "true" is admitted unchanged.
    #[arg(long, default_value = webhook::DEFAULT_OPT_OUT_ANNOTATION, env = "FUSE_SUPERVISOR_WEBHOOK_OPT_OUT_ANNOTATION")]
    pub(crate) opt_out_annotation: String,
    /// Where /mutate is served over HTTPS.
    #[arg(long, default_value = "0.0.0.0:8443", env = "FUSE_SUPERVISOR_WEBHOOK_LISTEN")]
    pub(crate) listen: SocketAddr,
    /// Where /metrics, /healthz and /readyz are served over plain HTTP.
    #[arg(long, default_value = "0.0.0.0:9810", env = "FUSE_SUPERVISOR_WEBHOOK_METRICS_ADDR")]
    pub(crate) metrics_addr: SocketAddr,
    /// The serving certificate chain (PEM), reloaded when it changes.
    #[arg(long, default_value = "/etc/fuse-supervisor/tls/tls.crt", env = "FUSE_SUPERVISOR_WEBHOOK_TLS_CERT_FILE")]
    pub(crate) tls_cert_file: PathBuf,
    /// Its private key (PEM), reloaded with it.
    #[arg(long, default_value = "/etc/fuse-supervisor/tls/tls.key", env = "FUSE_SUPERVISOR_WEBHOOK_TLS_KEY_FILE")]
    pub(crate) tls_key_file: PathBuf,
}

impl WebhookArgs {
    pub(crate) fn config(self) -> WebhookConfig {
        WebhookConfig {
            listen: self.listen,
            metrics_listen: self.metrics_addr,
            cert_file: self.tls_cert_file,
            key_file: self.tls_key_file,
            selection: Selection::new(self.drivers, self.storage_classes, self.opt_out_annotation),
        }
    }
}
