//! The `fuse-supervisor` command line.
#[cfg(feature = "testbed")]
use std::collections::BTreeSet;
#[cfg(feature = "testbed")]
use std::ffi::OsStr;
use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand, ValueEnum};
#[cfg(feature = "testbed")]
use clap::{CommandFactory, FromArgMatches};
use fuse_supervisor::daemons::{DaemonWatch, ProcessWatch};
#[cfg(feature = "testbed")]
use fuse_supervisor::demo::DemoOptions;
#[cfg(feature = "testbed")]
use fuse_supervisor::demofs::{self, DemoFsOptions, DemoFsRole, ReplayedInit};
use fuse_supervisor::events::{ApiServer, Events, EventsConfig, EventsError};
use fuse_supervisor::job;
use fuse_supervisor::kubelet::{KubeletAuthz, KubeletConfig, KubeletTls};
use fuse_supervisor::layout::{self, SourceLayouts};
use fuse_supervisor::metrics::{Metrics, MetricsServer};
use fuse_supervisor::priority::HealPriority;
use fuse_supervisor::report::Reporters;
use fuse_supervisor::sidecar::{self, SidecarConfig};
use fuse_supervisor::state::Journal;
use fuse_supervisor::status::Status;
use fuse_supervisor::supervisor::{self, Config, KubeletConfirmation, Shutdown};
use fuse_supervisor::table::{Classified, Layout, Snapshot};
#[cfg(feature = "testbed")]
use fuse_supervisor::testbed::container::{self, ContainerOptions};
#[cfg(feature = "testbed")]
use fuse_supervisor::testbed::scenario::Daemon;
use fuse_supervisor::watch::{TableEvents, WatchMode};
use fuse_supervisor::webhook::{self, Selection, WebhookConfig};

/// Heals the FUSE bind mounts of Kubernetes pods when the FUSE daemon behind
/// them restarts, reaching containers that are still running.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start and matched once: the size of a variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Watch the node and heal broken FUSE mounts as they appear.
    Run {
        #[command(flatten)]
        node: NodeArgs,
        #[command(flatten)]
        kubelet: KubeletArgs,
        // Sidecar mode and the Job lifecycle; boxed, or every command
        // would be as large as this one.
        #[command(flatten)]
        job: Box<JobArgs>,
        #[command(flatten)]
        daemons: DaemonArgs,
        #[command(flatten)]
        watch: WatchArgs,
        #[command(flatten)]
        serve: ServeArgs,
        #[command(flatten)]
        events: EventsArgs,
        #[command(flatten)]
        log: LogArgs,
    },
    /// List every FUSE source and target with its state.
    Status {
        #[command(flatten)]
        node: NodeArgs,
        /// Print JSON instead of a table.
        #[arg(long, env = "FUSE_SUPERVISOR_JSON")]
        json: bool,
        /// Read a captured mountinfo table instead of the live namespace.
        #[arg(long, value_name = "FILE", env = "FUSE_SUPERVISOR_MOUNTINFO")]
        mountinfo: Option<PathBuf>,
    },
    /// Scan once, print the heal plan and carry it out.
    Heal {
        /// Heal once and exit (the only mode; `run` heals continuously).
        #[arg(long, required = true)]
        once: bool,
        /// Print the plan without mounting anything.
        #[arg(long, env = "FUSE_SUPERVISOR_DRY_RUN")]
        dry_run: bool,
        #[command(flatten)]
        node: NodeArgs,
        #[command(flatten)]
        log: LogArgs,
    },
    /// The mutating admission webhook (a Deployment, not the node agent):
    /// gives the volume mounts of selected FUSE volumes
    /// `mountPropagation: HostToContainer`, so heals reach running containers.
    Webhook {
        #[command(flatten)]
        webhook: WebhookArgs,
        #[command(flatten)]
        log: LogArgs,
    },
    /// A self-contained demo in a private mount namespace: a FUSE daemon
    /// crashes and restarts while the supervisor heals three pods (needs
    /// root and /dev/fuse; never touches the machine's own mounts).
    #[cfg(feature = "testbed")]
    Demo {
        /// Kill/restart cycles of the FUSE daemon.
        #[arg(long, default_value_t = 4)]
        cycles: usize,
        /// The FUSE daemon: the built-in demofs, or bindfs if installed.
        #[arg(long, value_enum, default_value = "demofs")]
        daemon: DemoDaemon,
        /// Restart only by unmount-then-mount (no final mount-over-stale).
        #[arg(long)]
        no_mount_over_stale: bool,
    },
    /// Building blocks of the demo and the tests; not for users.
    #[cfg(feature = "testbed")]
    #[command(hide = true, subcommand)]
    Internal(Internal),
}

#[cfg(feature = "testbed")]
#[derive(Debug, Clone, Copy, ValueEnum)]
enum DemoDaemon {
    Demofs,
    Bindfs,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Node")]
struct NodeArgs {
    /// The kubelet's root directory; pod targets live under <root>/pods.
    #[arg(long, default_value = "/var/lib/kubelet", env = "FUSE_SUPERVISOR_KUBELET_ROOT")]
    kubelet_root: PathBuf,
    /// Where the learned target → source mapping is kept.
    #[arg(long, default_value = "/var/lib/fuse-supervisor", env = "FUSE_SUPERVISOR_STATE_DIR")]
    state_dir: PathBuf,
    /// The mount namespace to watch and heal (the host's by default).
    #[arg(long, default_value = "/proc/1/ns/mnt", env = "FUSE_SUPERVISOR_MOUNT_NAMESPACE")]
    mount_namespace: PathBuf,
    /// A directory in that namespace for a private staging tmpfs, where
    /// new mounts are parked while the stale layers under them are removed.
    #[arg(long, default_value = "/run/fuse-supervisor", env = "FUSE_SUPERVISOR_STAGING_DIR")]
    staging_dir: PathBuf,
    /// How long a FUSE source may take to answer a health probe.
    #[arg(long, default_value = "2s", value_parser = parse_duration, env = "FUSE_SUPERVISOR_PROBE_TIMEOUT")]
    probe_timeout: Duration,
    /// SCHED_FIFO priority of the threads that heal (the loop only while a
    /// heal is due), so that a busy node's containers do not slow the heal
    /// down; 0 runs them at the normal priority. Needs CAP_SYS_NICE.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=99), env = "FUSE_SUPERVISOR_REALTIME_PRIORITY")]
    realtime_priority: u8,
    /// Fluid's mount root: sources at <root>/<runtime>/<namespace>/<dataset>/<runtime>-fuse.
    #[arg(long, default_value = layout::DEFAULT_FLUID_MOUNT_ROOT, env = "FUSE_SUPERVISOR_FLUID_MOUNT_ROOT")]
    fluid_mount_root: PathBuf,
    /// Where the JuiceFS CSI driver's mount pods mount: <root>/<volumeHandle>-<suffix>.
    #[arg(long, default_value = layout::DEFAULT_JUICEFS_MOUNT_ROOT, env = "FUSE_SUPERVISOR_JUICEFS_MOUNT_ROOT")]
    juicefs_mount_root: PathBuf,
    /// A TOML file of source path templates per CSI driver, for drivers
    /// whose layout is not built in.
    #[arg(long, value_name = "FILE", env = "FUSE_SUPERVISOR_LAYOUT_CONFIG")]
    layout_config: Option<PathBuf>,
}

impl NodeArgs {
    /// The built-in layouts and the rules of `--layout-config`, which must
    /// read and parse.
    fn layouts(&self) -> anyhow::Result<SourceLayouts> {
        let layouts = SourceLayouts::new(&self.kubelet_root)
            .with_fluid_mount_root(&self.fluid_mount_root)
            .with_juicefs_mount_root(&self.juicefs_mount_root);
        match &self.layout_config {
            Some(rules) => Ok(layouts.with_rules_from(rules)?),
            None => Ok(layouts),
        }
    }

    fn config(&self) -> anyhow::Result<Config> {
        let layouts = self.layouts()?;
        Ok(Config {
            kubelet_root: self.kubelet_root.clone(),
            state_dir: self.state_dir.clone(),
            mount_namespace: self.mount_namespace.clone(),
            staging_dir: self.staging_dir.clone(),
            probe_timeout: self.probe_timeout,
            kubelet: None,
            layouts,
            reporters: Reporters::default(),
            pod_scope: None,
            job: None,
            daemons: DaemonWatch::default(),
            watch: WatchMode::Events(TableEvents::Auto),
            health: Arc::default(),
            heal_priority: HealPriority::realtime(self.realtime_priority),
        })
    }
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Sidecar mode")]
struct SidecarArgs {
    /// Run as a container of the application's pod: heal only that pod's
    /// targets and end its FUSE container when its Job's work is done.
    #[arg(long, env = "FUSE_SUPERVISOR_SIDECAR", requires = "pod_uid")]
    sidecar: bool,
    /// This pod's UID (downward API `metadata.uid`).
    #[arg(long, env = "FUSE_SUPERVISOR_POD_UID")]
    pod_uid: Option<String>,
    /// Without hostPID: heal from the FUSE container's mount namespace into
    /// the application containers' (needs `shareProcessNamespace: true`;
    /// the kubelet tree and the node's mounts are not used).
    #[arg(long, env = "FUSE_SUPERVISOR_SIDECAR_NAMESPACES", requires = "sidecar")]
    sidecar_namespaces: bool,
    /// Where the pod's processes are listed (with --sidecar-namespaces).
    #[arg(long, default_value = "/proc", env = "FUSE_SUPERVISOR_PROC_ROOT")]
    proc_root: PathBuf,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Job lifecycle")]
struct JobArgs {
    /// End the FUSE container of a Job's pod once its application
    /// containers have finished (node-wide; always on in sidecar mode).
    #[arg(long, env = "FUSE_SUPERVISOR_JOB_LIFECYCLE")]
    job_lifecycle: bool,
    /// Which pods qualify (kubectl label selector syntax; node-wide only).
    #[arg(long, value_name = "SELECTOR", default_value = job::DEFAULT_SELECTOR, env = "FUSE_SUPERVISOR_JOB_SELECTOR")]
    job_selector: job::LabelSelector,
    /// How long the FUSE daemon may take to exit after its unmount, and again
    /// after SIGTERM, before SIGTERM and then SIGKILL.
    #[arg(long, default_value = "30s", value_parser = parse_duration, env = "FUSE_SUPERVISOR_JOB_GRACE")]
    job_grace: Duration,
    /// How application processes are watched: `pidfd` (any pid namespace),
    /// or `proc-connector` (needs hostPID and hostNetwork).
    #[arg(long, value_enum, default_value = "pidfd", env = "FUSE_SUPERVISOR_JOB_PROCESS_WATCHER")]
    job_process_watcher: JobWatcher,
    #[command(flatten)]
    sidecar: SidecarArgs,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum JobWatcher {
    Pidfd,
    ProcConnector,
}

impl JobArgs {
    /// The lifecycle's setup: node-wide with `--job-lifecycle`, for the one
    /// pod in sidecar mode; it needs the kubelet.
    fn config(&self, kubelet: Option<&KubeletConfirmation>, node: &Config) -> anyhow::Result<Option<job::JobConfig>> {
        let sidecar = &self.sidecar;
        let scope = match (&sidecar.pod_uid, sidecar.sidecar) {
            (Some(uid), true) => job::JobScope::Pod { uid: uid.clone() },
            _ if self.job_lifecycle => job::JobScope::Node(self.job_selector.clone()),
            _ => return Ok(None),
        };
        let Some(kubelet) = kubelet else {
            anyhow::ensure!(
                !self.job_lifecycle,
                "--job-lifecycle needs the kubelet to confirm that a pod's work is done: drop --kubelet none"
            );
            tracing::info!("job lifecycle is off: it needs the kubelet (--kubelet none)");
            return Ok(None);
        };
        let (proc_root, mount_namespace, watcher) = if sidecar.sidecar_namespaces {
            anyhow::ensure!(
                matches!(self.job_process_watcher, JobWatcher::Pidfd),
                "--job-process-watcher proc-connector needs hostPID: use pidfd with --sidecar-namespaces"
            );
            // Without hostPID: the pod's processes, and this container's own
            // namespace (the FUSE container's is joined through its daemon).
            (sidecar.proc_root.clone(), PathBuf::from("/proc/self/ns/mnt"), job::WatcherKind::Pidfd)
        } else {
            let watcher = match self.job_process_watcher {
                JobWatcher::Pidfd => job::WatcherKind::Pidfd,
                JobWatcher::ProcConnector => job::WatcherKind::ProcConnector,
            };
            (PathBuf::from("/proc"), node.mount_namespace.clone(), watcher)
        };
        Ok(Some(job::JobConfig {
            kubelet: kubelet.client.clone(),
            scope,
            grace: self.job_grace,
            watcher,
            proc_root,
            mount_namespace,
            // Only read node-wide: one pod's scope watches no pod directories.
            kubelet_root: node.kubelet_root.clone(),
        }))
    }
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Kubelet (restart confirmation)")]
struct KubeletArgs {
    /// The kubelet to confirm restarts with: `https://HOST[:PORT]`, or
    /// `none` to heal on mount evidence alone. Default: the node IP, port 10250.
    #[arg(long, value_name = "URL|none", env = "FUSE_SUPERVISOR_KUBELET")]
    kubelet: Option<String>,
    /// This node's IP (downward API `status.hostIP`).
    #[arg(long, env = "FUSE_SUPERVISOR_NODE_IP")]
    node_ip: Option<String>,
    /// This node's name (downward API `spec.nodeName`); used when no IP is given.
    #[arg(long, env = "FUSE_SUPERVISOR_NODE_NAME")]
    node_name: Option<String>,
    /// The bearer token, re-read before every call (it rotates).
    #[arg(long, default_value = SERVICE_ACCOUNT_TOKEN, env = "FUSE_SUPERVISOR_KUBELET_TOKEN_FILE")]
    kubelet_token_file: PathBuf,
    /// The CA that signed the kubelet's serving certificate.
    #[arg(long, default_value = SERVICE_ACCOUNT_CA, env = "FUSE_SUPERVISOR_KUBELET_CA_FILE")]
    kubelet_ca_file: PathBuf,
    /// Trust exactly this serving certificate (PEM) instead of a CA: for
    /// kubelets with self-signed certificates.
    #[arg(
        long,
        value_name = "FILE",
        env = "FUSE_SUPERVISOR_KUBELET_PINNED_CERT",
        conflicts_with = "kubelet_insecure_skip_tls_verify"
    )]
    kubelet_pinned_cert: Option<PathBuf>,
    /// Do not verify the kubelet's certificate (warned about at every start).
    #[arg(long, env = "FUSE_SUPERVISOR_KUBELET_INSECURE_SKIP_TLS_VERIFY")]
    kubelet_insecure_skip_tls_verify: bool,
    /// Which RBAC rule the service account has: `nodes-pods` (get
    /// nodes/pods), or `nodes-proxy` (an explicit opt-in: it also allows exec).
    #[arg(long, value_enum, default_value = "nodes-pods", env = "FUSE_SUPERVISOR_KUBELET_AUTHZ")]
    kubelet_authz: Authz,
    /// Connect and response deadlines of one kubelet call.
    #[arg(long, default_value = "3s", value_parser = parse_duration, env = "FUSE_SUPERVISOR_KUBELET_TIMEOUT")]
    kubelet_timeout: Duration,
    /// How long a failing kubelet may hold up a heal before it goes ahead
    /// on mount evidence alone.
    #[arg(long, default_value = "10s", value_parser = parse_duration, env = "FUSE_SUPERVISOR_KUBELET_GRACE")]
    kubelet_grace: Duration,
}

const SERVICE_ACCOUNT_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";
const SERVICE_ACCOUNT_CA: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";
const KUBELET_PORT: u16 = 10250;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Authz {
    NodesPods,
    NodesProxy,
}

impl KubeletArgs {
    /// None for `--kubelet none`.
    fn confirmation(&self) -> anyhow::Result<Option<KubeletConfirmation>> {
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
        Ok(Some(KubeletConfirmation { client, grace: self.kubelet_grace }))
    }
}

/// `https://HOST[:PORT]` → (host, port); IPv6 hosts in brackets.
fn parse_kubelet_url(url: &str) -> anyhow::Result<(String, u16)> {
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
#[command(next_help_heading = "FUSE daemons")]
struct DaemonArgs {
    /// How daemon deaths are seen: `pidfd` (wakes for the watched daemons
    /// only; any pid namespace), `connector` (netlink process connector:
    /// hostPID, hostNetwork, NET_ADMIN before Linux 6.6; for kernels before
    /// 5.3, or to look for a missing daemon at every exec; falls back to
    /// pidfd), or `off` (only when a new mount appears).
    #[arg(long, value_enum, default_value = "pidfd", env = "FUSE_SUPERVISOR_PROCESS_WATCH")]
    process_watch: ProcessWatchArg,
    /// When a serving process exits while another process keeps its FUSE
    /// connection open unread, abort the connection once requests wait on
    /// it, so readers get an error instead of hanging.
    #[arg(long, env = "FUSE_SUPERVISOR_ABORT_DEAD_CONNECTIONS")]
    abort_dead_connections: bool,
    /// Where the FUSE control filesystem (fusectl) is mounted in the
    /// watched namespace.
    #[arg(long, default_value = "/sys/fs/fuse/connections", env = "FUSE_SUPERVISOR_FUSE_CONNECTIONS_DIR")]
    fuse_connections_dir: PathBuf,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ProcessWatchArg {
    Connector,
    Pidfd,
    Off,
}

impl DaemonArgs {
    fn watch(&self) -> DaemonWatch {
        DaemonWatch {
            mode: match self.process_watch {
                ProcessWatchArg::Connector => ProcessWatch::Connector,
                ProcessWatchArg::Pidfd => ProcessWatch::Pidfd,
                ProcessWatchArg::Off => ProcessWatch::Off,
            },
            abort_dead_connections: self.abort_dead_connections,
            fuse_connections: self.fuse_connections_dir.clone(),
            ..DaemonWatch::default()
        }
    }
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Watching")]
struct WatchArgs {
    /// `event`: wake on the kernel's mount-table notifications (no timer).
    /// `poll`: scan the whole table every --poll-period, as polling healers
    /// do (for comparison, or where notifications do not work).
    #[arg(long, value_enum, default_value = "event", env = "FUSE_SUPERVISOR_MODE")]
    mode: Mode,
    /// How often poll mode scans.
    #[arg(long, default_value = "5s", value_parser = parse_period, env = "FUSE_SUPERVISOR_POLL_PERIOD")]
    poll_period: Duration,
    /// Which kernel notification wakes event mode: `fanotify` mount events
    /// (Linux 6.15+), `mountinfo` (EPOLLPRI on /proc/…/mountinfo, any
    /// kernel), or `auto`: fanotify where the kernel offers it for the
    /// namespace, else mountinfo.
    #[arg(long, value_enum, default_value = "auto", env = "FUSE_SUPERVISOR_TABLE_EVENTS")]
    table_events: TableEventsArg,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Mode {
    Event,
    Poll,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum TableEventsArg {
    Mountinfo,
    Fanotify,
    Auto,
}

impl WatchArgs {
    fn mode(&self) -> WatchMode {
        match self.mode {
            Mode::Event => WatchMode::Events(match self.table_events {
                TableEventsArg::Mountinfo => TableEvents::Mountinfo,
                TableEventsArg::Fanotify => TableEvents::Fanotify,
                TableEventsArg::Auto => TableEvents::Auto,
            }),
            Mode::Poll => WatchMode::Poll { period: self.poll_period },
        }
    }
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Metrics and health")]
struct ServeArgs {
    /// Where to serve /metrics (Prometheus, OpenMetrics text), /healthz (the
    /// loop is alive) and /readyz (the first scan is done), or `off`.
    #[arg(long, value_name = "ADDR:PORT|off", default_value = "0.0.0.0:9809", value_parser = parse_listen, env = "FUSE_SUPERVISOR_METRICS_ADDR")]
    metrics_addr: Listen,
}

/// `--metrics-addr`: an address, or `off`.
#[derive(Debug, Clone, Copy)]
struct Listen(Option<SocketAddr>);

fn parse_listen(text: &str) -> Result<Listen, String> {
    if text == "off" {
        return Ok(Listen(None));
    }
    text.parse()
        .map(|addr| Listen(Some(addr)))
        .map_err(|_| format!("`{text}` is not ADDRESS:PORT (e.g. 0.0.0.0:9809, [::]:9809) or off"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Kubernetes events")]
struct EventsArgs {
    /// Publish events.k8s.io Events about broken, healed and unhealable
    /// mounts and confirmed daemon restarts; `off` for nodes without API
    /// server access.
    #[arg(long, value_enum, default_value = "on", env = "FUSE_SUPERVISOR_EVENTS")]
    events: OnOff,
    /// Reach the API server through this kubeconfig instead of the
    /// in-cluster service account configuration.
    #[arg(long, value_name = "FILE", env = "FUSE_SUPERVISOR_EVENTS_KUBECONFIG")]
    events_kubeconfig: Option<PathBuf>,
}

impl EventsArgs {
    /// The publisher, or None when events are off or cannot be published.
    /// Events are best effort and healing must not wait for the API server:
    /// a missing in-cluster configuration (a run outside a cluster, the
    /// demo) is a warning. A kubeconfig given explicitly that cannot be
    /// used is an error: the operator asked for exactly that.
    fn start(
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
            kubelet: confirmation.map(|confirmation| confirmation.client.clone()),
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

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Json,
    Text,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Logging")]
struct LogArgs {
    #[arg(long, value_enum, default_value = "text", env = "FUSE_SUPERVISOR_LOG_FORMAT")]
    log_format: LogFormat,
    /// Filter in tracing's env-filter syntax.
    #[arg(long, default_value = "info", env = "FUSE_SUPERVISOR_LOG")]
    log: String,
}

impl LogArgs {
    fn init(&self) {
        let filter = tracing_subscriber::EnvFilter::new(&self.log);
        let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
        match self.log_format {
            LogFormat::Json => builder.json().init(),
            LogFormat::Text => builder.init(),
        }
    }
}

#[cfg(feature = "testbed")]
#[derive(Debug, Subcommand)]
enum Internal {
    /// Serve the built-in FUSE filesystem.
    Demofs {
        #[arg(long)]
        backing: PathBuf,
        #[arg(long)]
        mountpoint: PathBuf,
        #[arg(long, default_value = "demofs")]
        name: String,
        /// Mount, then on SIGUSR1 hand the connection to a successor process
        /// and exit, writing the successor's pid to this file.
        #[arg(long, value_name = "PID_FILE", conflicts_with = "device_on_stdin")]
        hand_off_on_signal: Option<PathBuf>,
        /// Serve the connection already mounted at the mountpoint through the
        /// /dev/fuse descriptor on stdin.
        #[arg(long)]
        device_on_stdin: bool,
        /// With --device-on-stdin: the connection's INIT request (hex), taken
        /// by a watchdog, to hand the FUSE library first.
        #[arg(long, value_name = "HEX", requires_all = ["device_on_stdin", "inode_journal"], value_parser = parse_hex_request)]
        init_request: Option<HexRequest>,
        /// With --init-request: pass the library's answer to it on to the
        /// kernel (the watchdog's first child).
        #[arg(long, requires = "init_request")]
        answer_init: bool,
        /// With --init-request: where the watchdog's children record the
        /// inode numbers they give the kernel, for the next child.
        #[arg(long, value_name = "PATH", requires = "init_request")]
        inode_journal: Option<PathBuf>,
        /// Mount and keep the connection while a child process serves it,
        /// writing the child's pid to this file; after the child dies,
        /// start another on SIGUSR1.
        #[arg(long, value_name = "PID_FILE", conflicts_with_all = ["device_on_stdin", "hand_off_on_signal"])]
        watchdog: Option<PathBuf>,
    },
    /// Run a container-model reader.
    Container {
        #[arg(long)]
        volume: PathBuf,
        #[arg(long)]
        rootfs: PathBuf,
        #[arg(long)]
        hide: Vec<PathBuf>,
        #[arg(long)]
        read: PathBuf,
        #[arg(long, default_value_t = 2)]
        interval_ms: u64,
    },
    /// Parse `fuse-supervisor ARGS...` with this process's environment,
    /// check it as that command's start would, print what it would run as
    /// JSON, and exit without running it: tests/manifests.rs runs each
    /// manifest container's args and env through it.
    CheckArgs {
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// A FUSE request's bytes, given in hex: how a demofs watchdog hands its
/// connection's INIT to a child.
#[cfg(feature = "testbed")]
#[derive(Debug, Clone)]
struct HexRequest(Vec<u8>);

#[cfg(feature = "testbed")]
fn parse_hex_request(text: &str) -> Result<HexRequest, String> {
    demofs::init_request_from_hex(text).map(HexRequest).ok_or_else(|| format!("`{text}` is not hex"))
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let number: u64 = number.parse().map_err(|_| format!("`{text}` is not a duration like 500ms, 2s or 1m"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(number)),
        "s" | "" => Ok(Duration::from_secs(number)),
        "m" => Ok(Duration::from_secs(number * 60)),
        _ => Err(format!("`{text}`: unknown unit `{unit}` (use ms, s or m)")),
    }
}

/// A poll period: a duration above zero (zero would spin).
fn parse_period(text: &str) -> Result<Duration, String> {
    match parse_duration(text)? {
        Duration::ZERO => Err(format!("`{text}`: the poll period must be above zero")),
        period => Ok(period),
    }
}

/// Descriptors the table is grown to hold before any thread starts: a heal
/// holds about three per target, so this covers batches of a thousand.
const DESCRIPTORS_RESERVED: u32 = 4096;

/// Raises the open-file limit and grows the descriptor table ahead of the
/// first heal (sys::fds says why); must run before any thread is started.
fn prepare_descriptors() {
    match fuse_supervisor_sys::fds::raise_open_file_limit() {
        Ok(limit) => tracing::debug!(?limit, "open-file limit"),
        Err(err) => tracing::warn!(%err, "cannot raise the open-file limit"),
    }
    if let Err(err) = fuse_supervisor_sys::fds::reserve_descriptors(DESCRIPTORS_RESERVED) {
        tracing::warn!(%err, "cannot grow the descriptor table ahead; the first large heal will wait for it");
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run { node, kubelet, job, daemons, watch, serve, events, log } => {
            log.init();
            prepare_descriptors();
            let (sidecar_namespaces, proc_root) = (job.sidecar.sidecar_namespaces, job.sidecar.proc_root.clone());
            let pod_uid = job.sidecar.pod_uid.clone().unwrap_or_default();
            node.config()
                .and_then(|config| {
                    let confirmation = kubelet.confirmation()?;
                    let pod_scope = job.sidecar.sidecar.then(|| job.sidecar.pod_uid.clone()).flatten();
                    let job = job.config(confirmation.as_ref(), &config)?;
                    Ok(Config {
                        kubelet: confirmation,
                        pod_scope,
                        job,
                        daemons: daemons.watch(),
                        watch: watch.mode(),
                        ..config
                    })
                })
                .and_then(|config| {
                    // Its reporters are added in `run`.
                    let sidecar = sidecar_namespaces.then(|| SidecarConfig {
                        proc_root: proc_root.clone(),
                        probe_timeout: config.probe_timeout,
                        health: config.health.clone(),
                        pod_uid: pod_uid.clone(),
                        reporters: Reporters::default(),
                    });
                    // Started here, before any thread joins the host's mount
                    // namespace: it reads this container's service account files.
                    let events = events.start(&kubelet, config.kubelet.as_ref())?;
                    run(config, sidecar, serve.metrics_addr, events)
                })
        }
        Command::Status { node, json, mountinfo } => status(&node, json, mountinfo.as_deref()),
        Command::Heal { node, log, dry_run, .. } => {
            log.init();
            prepare_descriptors();
            node.config().and_then(|config| heal_once(&config, dry_run))
        }
        Command::Webhook { webhook, log } => {
            log.init();
            webhook::run(webhook.config()).map_err(Into::into)
        }
        #[cfg(feature = "testbed")]
        Command::Demo { cycles, daemon, no_mount_over_stale } => demo(cycles, daemon, !no_mount_over_stale),
        #[cfg(feature = "testbed")]
        Command::Internal(Internal::Demofs {
            backing,
            mountpoint,
            name,
            hand_off_on_signal,
            device_on_stdin,
            init_request,
            answer_init,
            inode_journal,
            watchdog,
        }) => {
            // Both or neither: clap requires the one with the other.
            let watchdog_child = init_request.zip(inode_journal);
            let role = match (hand_off_on_signal, watchdog, watchdog_child) {
                (Some(pid_file), _, _) => DemoFsRole::HandOffOnSignal { pid_file },
                (None, Some(pid_file), _) => DemoFsRole::Watchdog { pid_file },
                (None, None, Some((HexRequest(request), inode_journal))) => DemoFsRole::WatchdogChild {
                    init: ReplayedInit { request, answer_kernel: answer_init },
                    inode_journal,
                },
                (None, None, None) if device_on_stdin => DemoFsRole::DeviceOnStdin,
                (None, None, None) => DemoFsRole::Serve,
            };
            demofs::serve(&DemoFsOptions { backing, mountpoint, name, role }).map_err(Into::into)
        }
        #[cfg(feature = "testbed")]
        Command::Internal(Internal::Container { volume, rootfs, hide, read, interval_ms }) => {
            container::run(&ContainerOptions {
                volume,
                rootfs,
                hide,
                read,
                interval: Duration::from_millis(interval_ms),
            })
            .map_err(Into::into)
        }
        #[cfg(feature = "testbed")]
        Command::Internal(Internal::CheckArgs { args }) => check_args(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("fuse-supervisor: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Every flag's environment variable starts with this.
#[cfg(feature = "testbed")]
const ENV_PREFIX: &str = "FUSE_SUPERVISOR_";

/// `internal check-args`. clap silently ignores an environment variable that
/// no flag reads, so a manifest's variable whose flag was renamed would
/// fall back to the default unnoticed: here it is an error.
#[cfg(feature = "testbed")]
fn check_args(args: Vec<String>) -> anyhow::Result<()> {
    let argv = std::iter::once("fuse-supervisor".to_owned()).chain(args);
    let rendered = |err: clap::Error| anyhow::anyhow!("{}", err.render());
    let matches = Cli::command().try_get_matches_from(argv).map_err(rendered)?;
    let cli = Cli::from_arg_matches(&matches).map_err(rendered)?;
    let name = matches.subcommand_name().unwrap_or_default();
    let command = Cli::command();
    let read: BTreeSet<&OsStr> = command
        .find_subcommand(name)
        .into_iter()
        .flat_map(|sub| sub.get_arguments())
        .filter_map(|arg| arg.get_env())
        .collect();
    let ignored: Vec<String> = std::env::vars_os()
        .map(|(key, _)| key)
        .filter(|key| key.to_string_lossy().starts_with(ENV_PREFIX) && !read.contains(key.as_os_str()))
        .map(|key| key.to_string_lossy().into_owned())
        .collect();
    anyhow::ensure!(ignored.is_empty(), "`{name}` reads no {}", ignored.join(", "));
    let summary = match cli.command {
        Command::Run { node, kubelet, job, daemons, serve, events, .. } => {
            let config = node.config()?;
            let confirmation = kubelet.confirmation()?;
            let lifecycle = job.config(confirmation.as_ref(), &config)?;
            let mode = match (job.sidecar.sidecar, job.sidecar.sidecar_namespaces) {
                (true, true) => "sidecar-namespaces",
                (true, false) => "sidecar",
                (false, _) => "node",
            };
            let connector = matches!(daemons.process_watch, ProcessWatchArg::Connector)
                || lifecycle.as_ref().is_some_and(|job| matches!(job.watcher, job::WatcherKind::ProcConnector));
            let authz = kubelet.kubelet_authz.to_possible_value().map(|value| value.get_name().to_owned());
            serde_json::json!({
                "command": name,
                "mode": mode,
                "mount_namespace": config.mount_namespace,
                "kubelet_root": config.kubelet_root,
                "state_dir": config.state_dir,
                "realtime_priority": node.realtime_priority,
                "kubelet_authz": confirmation.is_some().then_some(authz),
                "events": events.events == OnOff::On,
                "job_lifecycle": lifecycle.is_some(),
                "process_connector": connector,
                "metrics_addr": serve.metrics_addr.0,
            })
        }
        Command::Webhook { webhook, .. } => {
            let config = webhook.config();
            config.check()?;
            serde_json::json!({
                "command": name,
                "listen": config.listen,
                "metrics_addr": config.metrics_listen,
                "tls_files": [config.cert_file, config.key_file],
            })
        }
        _ => serde_json::json!({ "command": name }),
    };
    println!("{summary}");
    Ok(())
}

#[cfg(feature = "testbed")]
fn demo(cycles: usize, daemon: DemoDaemon, mount_over_stale: bool) -> anyhow::Result<()> {
    let binary = std::env::current_exe().context("cannot find the fuse-supervisor binary")?;
    let daemon = match daemon {
        DemoDaemon::Demofs => Daemon::DemoFs,
        DemoDaemon::Bindfs => Daemon::Bindfs,
    };
    let options = DemoOptions { cycles, daemon, mount_over_stale, ..DemoOptions::new(binary) };
    fuse_supervisor::demo::run(&options, &mut std::io::stdout().lock())?;
    Ok(())
}

fn run(
    mut config: Config,
    sidecar: Option<SidecarConfig>,
    metrics_addr: Listen,
    events: Option<Events>,
) -> anyhow::Result<()> {
    if let Some(events) = &events {
        config.reporters.push(events.reporter());
    }
    // Started before the loop, so that probes get an answer (not alive, not
    // ready) rather than a refused connection while it starts.
    let server = match metrics_addr.0 {
        Some(addr) => {
            let metrics = Arc::new(Metrics::new());
            if let Some(events) = &events {
                let counters = events.counters();
                metrics.follow_kube_events_dropped(move || counters.dropped());
            }
            config.reporters.push(metrics.clone());
            let server = MetricsServer::start(addr, metrics, config.health.clone())?;
            tracing::info!(addr = %server.local_addr(), "serving metrics");
            Some(server)
        }
        None => {
            tracing::info!("metrics and health endpoints are off");
            None
        }
    };
    let shutdown = Shutdown::new().context("cannot create the shutdown eventfd")?;
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT])
        .context("cannot install signal handlers")?;
    let on_signal = shutdown.clone();
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        if signals.forever().next().is_some() {
            tracing::info!("signal received; shutting down");
            on_signal.request();
        }
    })?;
    // The loop thread moves into the watched namespace; main stays put.
    let supervisor = std::thread::Builder::new().name("supervisor".into()).spawn(move || match sidecar {
        Some(sidecar) => {
            run_sidecar(SidecarConfig { reporters: config.reporters.clone(), ..sidecar }, config.job, &shutdown)
        }
        None => supervisor::run(&config, &shutdown).map_err(anyhow::Error::from),
    })?;
    let result = supervisor.join().map_err(|_| anyhow::anyhow!("supervisor thread panicked"));
    if let Some(server) = server {
        server.stop();
    }
    if let Some(events) = events {
        events.stop();
    }
    result??;
    Ok(())
}

/// The sidecar loop, with the Job lifecycle of its pod beside it (as
/// `supervisor::run` starts it): when the lifecycle has ended the FUSE
/// container, the loop stops, so that the pod can complete.
fn run_sidecar(sidecar: SidecarConfig, job: Option<job::JobConfig>, shutdown: &Shutdown) -> anyhow::Result<()> {
    let lifecycle = supervisor::start_job_lifecycle(job.as_ref(), shutdown)?;
    let result = sidecar::run(&sidecar, shutdown);
    drop(lifecycle);
    result.map_err(Into::into)
}

fn heal_once(config: &Config, dry_run: bool) -> anyhow::Result<()> {
    let config = config.clone();
    let summary = std::thread::spawn(move || supervisor::heal_once(&config, dry_run, &mut std::io::stdout()))
        .join()
        .map_err(|_| anyhow::anyhow!("heal thread panicked"))??;
    anyhow::ensure!(summary.failed == 0, "{} of {} target(s) not healed", summary.failed, summary.planned);
    Ok(())
}

fn status(node: &NodeArgs, json: bool, mountinfo: Option<&Path>) -> anyhow::Result<()> {
    // Checked as `run` checks it, so that a broken file shows before it is
    // deployed; the report locates by them the sources of targets that no
    // peer group or state file maps.
    let layouts = node.layouts()?;
    let table = match mountinfo {
        Some(file) => fs::read(file).with_context(|| format!("cannot read {}", file.display()))?,
        None => read_namespace_table(&node.mount_namespace)?,
    };
    let snapshot = Snapshot::parse(&table).with_context(|| match mountinfo {
        Some(file) => format!("in {}", file.display()),
        None => "in the live mount table".to_owned(),
    })?;
    let layout = Layout::new(&node.kubelet_root);
    let mut classified = Classified::new(&snapshot, &layout);
    // The state file tells where stale targets came from (offline too, when
    // the report came with one); without it only peer groups can. A bad one
    // is only reported (with where it is bad): `status` changes nothing.
    let mut journal = match Journal::load(&node.state_dir) {
        Ok(journal) => journal,
        Err(err) => {
            eprintln!("fuse-supervisor: {:#}; going on without it", anyhow::Error::new(err));
            Journal::in_memory()
        }
    };
    let status = Status::new(&mut classified, &layout, &layouts, &mut journal);
    if json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", status.to_text());
    }
    Ok(())
}

/// Reads the mount table of a namespace from a thread that joined it.
fn read_namespace_table(namespace: &Path) -> anyhow::Result<Vec<u8>> {
    let namespace = namespace.to_path_buf();
    std::thread::spawn(move || -> anyhow::Result<Vec<u8>> {
        fuse_supervisor_sys::ns::join_mount_namespace(&namespace)
            .with_context(|| format!("cannot join mount namespace {}", namespace.display()))?;
        fs::read("/proc/thread-self/mountinfo").context("cannot read /proc/thread-self/mountinfo")
    })
    .join()
    .map_err(|_| anyhow::anyhow!("namespace reader panicked"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_addr_is_an_address_or_off() {
        assert_eq!(parse_listen("0.0.0.0:9809").unwrap().0, Some("0.0.0.0:9809".parse().unwrap()));
        assert_eq!(parse_listen("[::]:9809").unwrap().0, Some("[::]:9809".parse().unwrap()));
        assert_eq!(parse_listen("off").unwrap().0, None);
        assert!(parse_listen("9809").unwrap_err().contains("ADDRESS:PORT"));
    }

    #[test]
    fn sidecar_namespaces_needs_sidecar_mode_and_takes_a_proc_root() {
        let args =
            ["fuse-supervisor", "run", "--sidecar", "--pod-uid", "u", "--sidecar-namespaces", "--proc-root", "/p"];
        let cli = Cli::try_parse_from(args).unwrap();
        let Command::Run { job, .. } = cli.command else { panic!("not run") };
        assert!(job.sidecar.sidecar_namespaces);
        assert_eq!(job.sidecar.proc_root, Path::new("/p"));
        assert!(Cli::try_parse_from(["fuse-supervisor", "run", "--sidecar-namespaces"]).is_err());
    }

    #[test]
    fn run_takes_the_mode_and_a_poll_period_above_zero() {
        let cli = Cli::try_parse_from(["fuse-supervisor", "run", "--mode", "poll", "--poll-period", "200ms"]).unwrap();
        let Command::Run { watch, serve, .. } = cli.command else { panic!("not run") };
        assert_eq!(watch.mode(), WatchMode::Poll { period: Duration::from_millis(200) });
        assert_eq!(serve.metrics_addr.0, Some("0.0.0.0:9809".parse().unwrap()));
        let defaults = Cli::try_parse_from(["fuse-supervisor", "run"]).unwrap();
        let Command::Run { watch, .. } = defaults.command else { panic!("not run") };
        assert_eq!(watch.mode(), WatchMode::Events(TableEvents::Auto));
        let fanotify = Cli::try_parse_from(["fuse-supervisor", "run", "--table-events", "fanotify"]).unwrap();
        let Command::Run { watch, .. } = fanotify.command else { panic!("not run") };
        assert_eq!(watch.mode(), WatchMode::Events(TableEvents::Fanotify));
        assert!(Cli::try_parse_from(["fuse-supervisor", "run", "--table-events", "inotify"]).is_err());
        assert!(Cli::try_parse_from(["fuse-supervisor", "run", "--mode", "poll", "--poll-period", "0s"]).is_err());
    }
}
