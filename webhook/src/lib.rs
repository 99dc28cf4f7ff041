//! `fuse-supervisor-webhook`: a mutating admission webhook that gives the
//! volume mounts of FUSE volumes `mountPropagation: HostToContainer`, so
//! that a heal reaches running containers without users having to know.
//!
//! A Deployment, not the node agent. On Pod CREATE (and on the
//! `ephemeralcontainers` subresource, for `kubectl debug`), every mount of a
//! volume that is a PVC bound to a selected CSI driver or StorageClass, an
//! inline CSI volume of a selected driver, or a generic ephemeral volume of
//! a selected class gets the field when it has none. An explicit value is
//! never touched. PVC → PV → driver comes from [`cache::VolumeCache`], fed
//! by watches; an admission never calls the API server.
//!
//! Parts: [`policy`] (pure: pod → mounts to change), [`review`](mod@review)
//! (AdmissionReview in and out), [`cache`], [`tls`] (certificates reloaded
//! on change), [`server`] (HTTPS and metrics), [`metrics`].
pub mod cache;
pub mod metrics;
pub mod policy;
pub mod review;
pub mod selection;
pub mod server;
pub mod tls;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use fuse_supervisor_engine::errors::chain;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::Api;
use tokio::task::JoinHandle;

pub use cache::{Unresolved, Verdict, VolumeCache};
pub use metrics::Metrics;
pub use review::{Outcome, ReviewError, Reviewed, review};
pub use selection::{DEFAULT_OPT_OUT_ANNOTATION, Selection};
pub use server::{Limits, Server, ServerError, State};
pub use tls::{CertStore, TlsError};

#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("nothing to select: give at least one --driver or --storage-class")]
    EmptySelection,
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error("cannot configure the Kubernetes client (in-cluster service account, or KUBECONFIG)")]
    Client(#[source] kube::Error),
    #[error("cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
    #[error("cannot install the signal handlers")]
    Signals(#[source] std::io::Error),
}

/// What `fuse-supervisor-webhook` needs.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// Where `/mutate` is served over HTTPS.
    pub listen: SocketAddr,
    /// Where `/metrics`, `/healthz` and `/readyz` are served over plain HTTP.
    pub metrics_listen: SocketAddr,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub selection: Selection,
}

impl WebhookConfig {
    /// What `run` refuses before it starts anything.
    pub fn check(&self) -> Result<(), WebhookError> {
        if self.selection.is_empty() {
            return Err(WebhookError::EmptySelection);
        }
        Ok(())
    }
}

/// Starts the watches that keep `cache` current (PVCs, PVs, StorageClasses,
/// all cluster-wide). They run until aborted.
pub fn feed_cache(client: &kube::Client, cache: &Arc<VolumeCache>, metrics: &Arc<Metrics>) -> Vec<JoinHandle<()>> {
    let on_error = |metrics: &Arc<Metrics>| {
        let metrics = metrics.clone();
        move |kind| metrics.watch_failed(kind)
    };
    vec![
        tokio::spawn(cache::feed(Api::<PersistentVolumeClaim>::all(client.clone()), cache.clone(), on_error(metrics))),
        tokio::spawn(cache::feed(Api::<PersistentVolume>::all(client.clone()), cache.clone(), on_error(metrics))),
        tokio::spawn(cache::feed(Api::<StorageClass>::all(client.clone()), cache.clone(), on_error(metrics))),
    ]
}

/// How long the webhook keeps serving after SIGTERM, not ready (the
/// Deployment's grace period must be longer).
const UNREADY_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs the webhook until SIGTERM or SIGINT.
pub fn run(config: WebhookConfig) -> Result<(), WebhookError> {
    config.check()?;
    // Admission work is tens of microseconds per review: two workers are
    // plenty, and leave the node's other cores alone.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("webhook")
        .enable_all()
        .build()
        .map_err(WebhookError::Runtime)?;
    runtime.block_on(serve(config))
}

async fn serve(config: WebhookConfig) -> Result<(), WebhookError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate()).map_err(WebhookError::Signals)?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(WebhookError::Signals)?;

    let metrics = Arc::new(Metrics::new());
    let certs = CertStore::load(&config.cert_file, &config.key_file)?;
    let reload_metrics = metrics.clone();
    let watch = certs.watch(move |result| {
        reload_metrics.certificate_reloaded(result.is_ok());
        match result {
            Ok(true) => tracing::info!("serving certificate reloaded"),
            Ok(false) => tracing::debug!("certificate files touched; same certificate"),
            Err(err) => tracing::warn!(err = %chain(err), "certificate reload failed; keeping the old one"),
        }
    })?;

    let client = kube::Client::try_default().await.map_err(WebhookError::Client)?;
    let cache = Arc::new(VolumeCache::new());
    let feeds = feed_cache(&client, &cache, &metrics);

    let state = Arc::new(State::new(config.selection, cache, metrics));
    let server = Server::start(config.listen, config.metrics_listen, certs.server_config()?, state).await?;
    tokio::select! {
        _ = terminate.recv() => tracing::info!("SIGTERM; shutting down"),
        _ = interrupt.recv() => tracing::info!("SIGINT; shutting down"),
    }
    // Endpoints drop a terminating pod only after a moment: keep answering
    // meanwhile, or the API server would meet a closed port and admit pods
    // unchanged during every rollout.
    server.unready();
    tokio::time::sleep(UNREADY_GRACE).await;
    server.shutdown().await;
    drop(watch);
    for feed in feeds {
        feed.abort();
    }
    Ok(())
}
