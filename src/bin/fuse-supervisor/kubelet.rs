//! The local kubelet (restart confirmation) and the API server (Events).
use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use fuse_supervisor::events::{ApiServer, Events, EventsConfig, EventsError};
use fuse_supervisor::supervisor::KubeletConfirmation;
use fuse_supervisor_engine::kube::{Kubelet, KubeletAuthz, KubeletConfig, KubeletTls};

use crate::flags::{OnOff, parse_duration};

#[derive(Debug, Args)]
#[command(next_help_heading = "Kubelet (restart confirmation)")]
pub(crate) struct KubeletArgs {
    /// The kubelet to confirm restarts with: `https://HOST[:PORT]`, or
    /// `none` to heal on mount evidence alone. Default: the node IP, port 10250.
    #[arg(long, value_name = "URL|none", env = "FUSE_SUPERVISOR_KUBELET")]
    pub(crate) kubelet: Option<String>,
    /// This node's IP (downward API `status.hostIP`).
    #[arg(long, env = "FUSE_SUPERVISOR_NODE_IP")]
    pub(crate) node_ip: Option<String>,
    /// This node's name (downward API `spec.nodeName`); used when no IP is given.
    #[arg(long, env = "FUSE_SUPERVISOR_NODE_NAME")]
    pub(crate) node_name: Option<String>,
    /// The bearer token, re-read before every call (it rotates).
    #[arg(long, default_value = SERVICE_ACCOUNT_TOKEN, env = "FUSE_SUPERVISOR_KUBELET_TOKEN_FILE")]
    pub(crate) kubelet_token_file: PathBuf,
    /// The CA that signed the kubelet's serving certificate.
    #[arg(long, default_value = SERVICE_ACCOUNT_CA, env = "FUSE_SUPERVISOR_KUBELET_CA_FILE")]
    pub(crate) kubelet_ca_file: PathBuf,
    /// Trust exactly this serving certificate (PEM) instead of a CA: for
    /// kubelets with self-signed certificates.
    #[arg(
        long,
        value_name = "FILE",
        env = "FUSE_SUPERVISOR_KUBELET_PINNED_CERT",
        conflicts_with = "kubelet_insecure_skip_tls_verify"
    )]
    pub(crate) kubelet_pinned_cert: Option<PathBuf>,
    /// Do not verify the kubelet's certificate (warned about at every start).
    #[arg(long, env = "FUSE_SUPERVISOR_KUBELET_INSECURE_SKIP_TLS_VERIFY")]
    pub(crate) kubelet_insecure_skip_tls_verify: bool,
    /// Which RBAC rule the service account has: `nodes-pods` (get
    /// nodes/pods), or `nodes-proxy` (an explicit opt-in: it also allows exec).
    #[arg(long, value_enum, default_value = "nodes-pods", env = "FUSE_SUPERVISOR_KUBELET_AUTHZ")]
    pub(crate) kubelet_authz: Authz,
    /// Connect and response deadlines of one kubelet call.
    #[arg(long, default_value = "3s", value_parser = parse_duration, env = "FUSE_SUPERVISOR_KUBELET_TIMEOUT")]
    pub(crate) kubelet_timeout: Duration,
    /// How long a failing kubelet may hold up a heal before it goes ahead
    /// on mount evidence alone.
    #[arg(long, default_value = "10s", value_parser = parse_duration, env = "FUSE_SUPERVISOR_KUBELET_GRACE")]
    pub(crate) kubelet_grace: Duration,
}

pub(crate) const SERVICE_ACCOUNT_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

pub(crate) const SERVICE_ACCOUNT_CA: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";

pub(crate) const KUBELET_PORT: u16 = 10250;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum Authz {
    NodesPods,
    NodesProxy,
}

impl KubeletArgs {
    /// None for `--kubelet none`.
    pub(crate) fn confirmation(&self) -> anyhow::Result<Option<KubeletConfirmation>> {
        let (host, port) = match self.kubelet.as_deref() {
            Some("none") => return Ok(None),
            Some(url) => parse_kubelet_url(url)?,
            None => {
                let host = self.node_ip.as_ref().or(self.node_name.as_ref()).context(
                    "restart confirmation needs the kubelet's address: set --node-ip (downward API status.hostIP) \
                     or --kubelet https://HOST:PORT, or turn it off with --kubelet none",
                )?;
                (host.clone(), KUBELET_PORT)
            }
        };
        let tls = if self.kubelet_insecure_skip_tls_verify {
            KubeletTls::InsecureSkipVerify
        } else if let Some(pinned) = &self.kubelet_pinned_cert {
            KubeletTls::PinnedCertFile(pinned.clone())
        } else {
            KubeletTls::CaFile(self.kubelet_ca_file.clone())
        };
        let client = KubeletConfig {
            host,
            port,
            token_file: Some(self.kubelet_token_file.clone()),
            tls,
            connect_timeout: self.kubelet_timeout,
            read_timeout: self.kubelet_timeout,
            authz: match self.kubelet_authz {
                Authz::NodesPods => KubeletAuthz::NodesPods,
                Authz::NodesProxy => KubeletAuthz::NodesProxy,
            },
        };
        let kubelet = Kubelet::new(client);
        Ok(Some(KubeletConfirmation { kubelet, grace: self.kubelet_grace }))
    }
}

/// `https://HOST[:PORT]` → (host, port); IPv6 hosts in brackets.
pub(crate) fn parse_kubelet_url(url: &str) -> anyhow::Result<(String, u16)> {
    let rest = url
        .strip_prefix("https://")
        .with_context(|| format!("--kubelet {url:?}: expected https://HOST[:PORT] or none"))?
        .trim_end_matches('/');
    let (host, port) = match rest.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => {
            (host, port.parse().with_context(|| format!("--kubelet {url:?}: port {port:?} is not a number"))?)
        }
        _ => (rest, KUBELET_PORT),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    anyhow::ensure!(!host.is_empty(), "--kubelet {url:?}: no host");
    Ok((host.to_owned(), port))
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Kubernetes events")]
pub(crate) struct EventsArgs {
    /// Publish events.k8s.io Events about broken, healed and unhealable
    /// mounts and confirmed daemon restarts; `off` for nodes without API
    /// server access.
    #[arg(long, value_enum, default_value = "on", env = "FUSE_SUPERVISOR_EVENTS")]
    pub(crate) events: OnOff,
    /// Reach the API server through this kubeconfig instead of the
    /// in-cluster service account configuration.
    #[arg(long, value_name = "FILE", env = "FUSE_SUPERVISOR_EVENTS_KUBECONFIG")]
    pub(crate) events_kubeconfig: Option<PathBuf>,
}

impl EventsArgs {
    /// The publisher, or None when events are off or cannot be published.
    /// Events are best effort and healing must not wait for the API server:
    /// a missing in-cluster configuration (a run outside a cluster, the
    /// demo) is a warning. A kubeconfig given explicitly that cannot be
    /// used is an error: the operator asked for exactly that.
    pub(crate) fn start(
        &self,
        kubelet: &KubeletArgs,
        confirmation: Option<&KubeletConfirmation>,
    ) -> anyhow::Result<Option<Events>> {
        if self.events == OnOff::Off {
            tracing::info!("Kubernetes events are off");
            return Ok(None);
        }
        let api_server = match &self.events_kubeconfig {
            Some(path) => ApiServer::Kubeconfig(path.clone()),
            None => ApiServer::InCluster,
        };
        let node_name = kubelet.node_name.clone().unwrap_or_else(|| {
            fs::read_to_string("/proc/sys/kernel/hostname").map(|name| name.trim().to_owned()).unwrap_or_default()
        });
        let config = EventsConfig {
            kubelet: confirmation.map(|confirmation| confirmation.kubelet.clone()),
            ..EventsConfig::new(api_server, node_name)
        };
        match Events::start(&config) {
            Ok(events) => Ok(Some(events)),
            Err(err @ EventsError::InCluster(_)) => {
                let err = format!("{:#}", anyhow::Error::from(err));
                tracing::warn!(err, "running without Kubernetes events (set --events off to silence this warning)");
                Ok(None)
            }
            Err(err) => Err(anyhow::Error::from(err).context("--events on")),
        }
    }
}
