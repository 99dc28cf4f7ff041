//! Kubernetes Events (events.k8s.io/v1) for what the supervisor does to
//! pods: FuseMountBroken, FuseMountHealed and FuseHealFailed on the
//! application pod, FuseDaemonRestarted on the FUSE daemon's pod.
//!
//! The [`EventReporter`] runs on the loop thread and only turns a report
//! into an owned occurrence and `try_send`s it on a bounded queue: when the
//! queue is full the occurrence is dropped and counted, so a slow or absent
//! API server never slows a heal. A publisher thread with a current-thread
//! tokio runtime takes occurrences off the queue, resolves application pod
//! UIDs through the local kubelet (`resolve`), limits and folds repeats
//! (`limiter`, `series`) and writes through the kube client.
//!
//! Not kube-runtime's `Recorder`: it folds repeats into a series as
//! `series` does, but limits no key's rate (client-go's spam filter, which
//! `limiter` is), keeps its series cache for a fixed time rather than
//! within a bound, counts no refused repeat, and its `publish` awaits the
//! API server, so the queue and thread here would be needed around it
//! anyway.
mod limiter;
mod occurrence;
mod publisher;
mod resolve;
mod series;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use tracing::{debug, info};

pub use limiter::{BURST, Limiter, REFILL_EVERY};
pub use occurrence::{Occurrence, PodRef, Reason, Regarding};
pub use resolve::{PodNames, Resolver};
pub use series::{CONTROLLER, Correlator, Observed, SERIES_WINDOW, SeriesKey, Write};

use fuse_supervisor_engine::kube::{Kubelet, KubeletError};
use fuse_supervisor_engine::report::{Report, Reporter};

/// Occurrences the queue holds before new ones are dropped.
pub const DEFAULT_QUEUE: usize = 1024;
/// Deadlines of the API server connection (the in-cluster default has no
/// read timeout).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const READ_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    #[error(
        "no in-cluster API server configuration (KUBERNETES_SERVICE_HOST/PORT and the service account token \
         and ca.crt under /var/run/secrets/kubernetes.io/serviceaccount)"
    )]
    InCluster(#[source] kube::config::InClusterError),
    #[error("cannot load the kubeconfig {path}")]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("cannot build the API server client")]
    Client(#[source] kube::Error),
    #[error("cannot build the kubelet client that resolves pod names for events")]
    Kubelet(#[source] KubeletError),
    #[error("cannot start the events runtime")]
    Runtime(#[source] std::io::Error),
    #[error("cannot start the events publisher thread")]
    Thread(#[source] std::io::Error),
}

/// Where the API server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiServer {
    /// The service account's in-cluster configuration.
    InCluster,
    /// A kubeconfig file (its current context): for a supervisor run
    /// outside the cluster, and for tests.
    Kubeconfig(PathBuf),
}

/// How events are published.
#[derive(Debug, Clone)]
pub struct EventsConfig {
    pub api_server: ApiServer,
    /// This node's name: the events' `reportingInstance` is
    /// `fuse-supervisor-<node>`.
    pub node_name: String,
    /// The kubelet that resolves application pod UIDs to names; without
    /// it only FuseDaemonRestarted (which names its pod) is published.
    pub kubelet: Option<Kubelet>,
    /// Queue length between the loop and the publisher.
    pub queue: usize,
}

impl EventsConfig {
    pub fn new(api_server: ApiServer, node_name: impl Into<String>) -> Self {
        EventsConfig { api_server, node_name: node_name.into(), kubelet: None, queue: DEFAULT_QUEUE }
    }
}

/// What became of occurrences, for metrics; all counts since start.
#[derive(Debug, Default)]
pub struct EventCounters {
    dropped: AtomicU64,
    limited: AtomicU64,
    unresolved: AtomicU64,
    written: AtomicU64,
    failed: AtomicU64,
}

impl EventCounters {
    /// Occurrences dropped because the queue was full (or the publisher gone).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Occurrences the limiter held back (counted into a series, or lost).
    pub fn limited(&self) -> u64 {
        self.limited.load(Ordering::Relaxed)
    }

    /// Occurrences about a pod the kubelet could not name.
    pub fn unresolved(&self) -> u64 {
        self.unresolved.load(Ordering::Relaxed)
    }

    /// API writes (creates and series patches) that succeeded.
    pub fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    /// API writes that failed.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }
}

enum Message {
    Occurrence(Occurrence),
    Stop,
}

/// The loop's side: never blocks.
pub struct EventReporter {
    queue: SyncSender<Message>,
    counters: Arc<EventCounters>,
}

impl Reporter for EventReporter {
    fn report(&self, report: &Report<'_>) {
        let Some(occurrence) = Occurrence::from_report(report, SystemTime::now()) else {
            return;
        };
        match self.queue.try_send(Message::Occurrence(occurrence)) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                let dropped = self.counters.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                debug!(dropped, "event queue full; event dropped");
            }
        }
    }
}

/// A running publisher. Dropping it (or [`Events::stop`]) writes the final
/// counts of open series and joins the thread.
pub struct Events {
    reporter: Arc<EventReporter>,
    thread: Option<JoinHandle<()>>,
}

impl Events {
    /// Loads the API server configuration and starts the publisher. Call
    /// before the calling thread changes namespaces: the publisher reads
    /// the service account files from the calling thread's view.
    pub fn start(config: &EventsConfig) -> Result<Events, EventsError> {
        let runtime = runtime()?;
        let mut client_config = match &config.api_server {
            ApiServer::InCluster => kube::Config::incluster().map_err(EventsError::InCluster)?,
            ApiServer::Kubeconfig(path) => load_kubeconfig(&runtime, path)?,
        };
        client_config.connect_timeout.get_or_insert(CONNECT_TIMEOUT);
        client_config.read_timeout.get_or_insert(READ_TIMEOUT);
        let names = match &config.kubelet {
            Some(kubelet) => {
                kubelet.load().map_err(EventsError::Kubelet)?;
                Some(Box::new(kubelet.clone()) as Box<dyn PodNames>)
            }
            None => {
                info!(
                    "no kubelet for events: only FuseDaemonRestarted is published (application pods are known by UID only)"
                );
                None
            }
        };
        let client = {
            // The client's buffer task is spawned on this runtime.
            let _entered = runtime.enter();
            kube::Client::try_from(client_config).map_err(EventsError::Client)?
        };
        Self::spawn(runtime, client, names, config)
    }

    /// Starts a publisher on a client of the caller's making (a mock
    /// service in tests); `make_client` runs inside the publisher's runtime.
    pub fn start_with_client(
        make_client: impl FnOnce() -> kube::Client,
        names: Option<Box<dyn PodNames>>,
        config: &EventsConfig,
    ) -> Result<Events, EventsError> {
        let runtime = runtime()?;
        let client = {
            let _entered = runtime.enter();
            make_client()
        };
        Self::spawn(runtime, client, names, config)
    }

    fn spawn(
        runtime: tokio::runtime::Runtime,
        client: kube::Client,
        names: Option<Box<dyn PodNames>>,
        config: &EventsConfig,
    ) -> Result<Events, EventsError> {
        let (queue, inbox) = mpsc::sync_channel(config.queue.max(1));
        let counters = Arc::new(EventCounters::default());
        let instance = format!("{CONTROLLER}-{}", config.node_name);
        let publisher = publisher::Publisher {
            inbox,
            correlator: Correlator::new(&instance, Limiter::default()),
            resolver: Resolver::new(names),
            runtime,
            client,
            counters: counters.clone(),
            failing: false,
        };
        let thread = std::thread::Builder::new()
            .name("events".into())
            .spawn(move || publisher.run())
            .map_err(EventsError::Thread)?;
        info!(instance, "publishing Kubernetes events");
        Ok(Events { reporter: Arc::new(EventReporter { queue, counters }), thread: Some(thread) })
    }

    /// The reporter to add to the supervisor's reporters.
    pub fn reporter(&self) -> Arc<EventReporter> {
        self.reporter.clone()
    }

    pub fn counters(&self) -> Arc<EventCounters> {
        self.reporter.counters.clone()
    }

    /// Writes the final counts of open series (within a few seconds) and
    /// joins the publisher.
    pub fn stop(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        if let Some(thread) = self.thread.take() {
            // Blocks only while the queue is full; the publisher is draining it.
            let _ = self.reporter.queue.send(Message::Stop);
            let _ = thread.join();
        }
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, EventsError> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(EventsError::Runtime)
}

fn load_kubeconfig(runtime: &tokio::runtime::Runtime, path: &Path) -> Result<kube::Config, EventsError> {
    let error = |source| EventsError::Kubeconfig { path: path.to_owned(), source };
    let kubeconfig = kube::config::Kubeconfig::read_from(path).map_err(error)?;
    runtime
        .block_on(kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default()))
        .map_err(error)
}
