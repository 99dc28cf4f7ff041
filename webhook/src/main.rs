//! `fuse-supervisor-webhook`: the mount-policy admission webhook, a
//! Deployment of its own.
use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, CommandFactory, Parser};
use fuse_supervisor_webhook::{self as webhook, Selection, WebhookConfig};

/// Gives the volume mounts of FUSE volumes `mountPropagation:
/// HostToContainer`, so that fuse-supervisor's heals reach running
/// containers.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(flatten)]
    webhook: WebhookArgs,
    #[arg(long, value_parser = ["json", "text"], default_value = "text", env = "FUSE_SUPERVISOR_LOG_FORMAT", help_heading = "Logging")]
    log_format: String,
    /// Filter in tracing's env-filter syntax.
    #[arg(long, default_value = "info", env = "FUSE_SUPERVISOR_LOG", help_heading = "Logging")]
    log: String,
    /// Print the configuration these flags and this environment give, as
    /// JSON, and exit; a FUSE_SUPERVISOR_* variable that no flag reads is
    /// an error (a manifest's variable for a renamed flag).
    #[arg(long)]
    check_config: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = if cli.check_config {
        check_config(cli.webhook.config())
    } else {
        fuse_supervisor_engine::logging::init(cli.log_format == "json", &cli.log);
        webhook::run(cli.webhook.config()).map_err(|err| fuse_supervisor_engine::errors::error_chain(&err))
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("fuse-supervisor-webhook: {err}");
            ExitCode::FAILURE
        }
    }
}

/// `--check-config`: the configuration as JSON, or what is wrong with it.
fn check_config(config: WebhookConfig) -> Result<(), String> {
    let command = Cli::command();
    let read: BTreeSet<&OsStr> = command.get_arguments().filter_map(|arg| arg.get_env()).collect();
    let unread = fuse_supervisor_engine::flag_env::unread(&read);
    if !unread.is_empty() {
        return Err(format!("no flag reads {}", unread.join(", ")));
    }
    config.check().map_err(|err| fuse_supervisor_engine::errors::error_chain(&err))?;
    let summary = serde_json::json!({
        "command": "webhook",
        "listen": config.listen,
        "metrics_addr": config.metrics_listen,
        "tls_files": [config.cert_file, config.key_file],
    });
    println!("{summary}");
    Ok(())
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Webhook")]
struct WebhookArgs {
    /// CSI driver names whose volumes get HostToContainer (comma-separated
    /// or repeated): PVCs bound to their PVs, and inline CSI volumes.
    #[arg(long = "driver", value_name = "NAME", value_delimiter = ',', env = "FUSE_SUPERVISOR_WEBHOOK_DRIVERS")]
    drivers: Vec<String>,
    /// StorageClass names whose volumes get HostToContainer (comma-separated
    /// or repeated).
    #[arg(
        long = "storage-class",
        value_name = "NAME",
        value_delimiter = ',',
        env = "FUSE_SUPERVISOR_WEBHOOK_STORAGE_CLASSES"
    )]
    storage_classes: Vec<String>,
    /// A pod with this annotation set to "true" is admitted unchanged.
    #[arg(long, default_value = webhook::DEFAULT_OPT_OUT_ANNOTATION, env = "FUSE_SUPERVISOR_WEBHOOK_OPT_OUT_ANNOTATION")]
    opt_out_annotation: String,
    /// Where /mutate is served over HTTPS.
    #[arg(long, default_value = "0.0.0.0:8443", env = "FUSE_SUPERVISOR_WEBHOOK_LISTEN")]
    listen: SocketAddr,
    /// Where /metrics, /healthz and /readyz are served over plain HTTP.
    #[arg(long, default_value = "0.0.0.0:9810", env = "FUSE_SUPERVISOR_WEBHOOK_METRICS_ADDR")]
    metrics_addr: SocketAddr,
    /// The serving certificate chain (PEM), reloaded when it changes.
    #[arg(long, default_value = "/etc/fuse-supervisor/tls/tls.crt", env = "FUSE_SUPERVISOR_WEBHOOK_TLS_CERT_FILE")]
    tls_cert_file: PathBuf,
    /// Its private key (PEM), reloaded with it.
    #[arg(long, default_value = "/etc/fuse-supervisor/tls/tls.key", env = "FUSE_SUPERVISOR_WEBHOOK_TLS_KEY_FILE")]
    tls_key_file: PathBuf,
}

impl WebhookArgs {
    fn config(self) -> WebhookConfig {
        WebhookConfig {
            listen: self.listen,
            metrics_listen: self.metrics_addr,
            cert_file: self.tls_cert_file,
            key_file: self.tls_key_file,
            selection: Selection::new(self.drivers, self.storage_classes, self.opt_out_annotation),
        }
    }
}
