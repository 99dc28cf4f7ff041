//! `run`: the node agent (or a sidecar), with its watchers, the Job
//! lifecycle, the metrics server and Events.
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use fuse_supervisor::events::Events;
use fuse_supervisor::job;
use fuse_supervisor::metrics::{Metrics, MetricsServer};
use fuse_supervisor::sidecar::{self, SidecarConfig};
use fuse_supervisor::supervisor::daemons::DaemonWatch;
use fuse_supervisor::supervisor::{self, Config, ContainerNamespaces, KubeletConfirmation};
use fuse_supervisor_engine::csi::restage::RestageConfig;
use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::heal::fuse_calls;
use fuse_supervisor_engine::heal::priority::HealPriority;
use fuse_supervisor_engine::model::namespace_table::{TableReads, set_table_reads};
use fuse_supervisor_engine::plan::flapping::FlappingPolicy;
use fuse_supervisor_engine::report::Reporters;
use fuse_supervisor_engine::shutdown::Shutdown;
use fuse_supervisor_engine::watch::mount_table::{TableEvents, WatchMode};
use fuse_supervisor_engine::watch::processes::Backend;

use crate::flags::{Listen, LogArgs, OnOff, parse_duration, parse_listen, parse_period};
use crate::kubelet::{EventsArgs, KubeletArgs};
use crate::node::{NodeArgs, prepare_process};

#[derive(Debug, Args)]
#[command(next_help_heading = "Sidecar mode")]
pub(crate) struct SidecarArgs {
    /// Run as a container of the application's pod: heal only that pod's
    /// targets and end its FUSE container when its Job's work is done.
    #[arg(long, env = "FUSE_SUPERVISOR_SIDECAR", requires = "pod_uid")]
    pub(crate) sidecar: bool,
    /// This pod's UID (downward API `metadata.uid`).
    #[arg(long, env = "FUSE_SUPERVISOR_POD_UID")]
    pub(crate) pod_uid: Option<String>,
    /// Without hostPID: heal from the FUSE container's mount namespace into
    /// the application containers' (needs `shareProcessNamespace: true`;
    /// the kubelet tree and the node's mounts are not used).
    #[arg(long, env = "FUSE_SUPERVISOR_SIDECAR_NAMESPACES", requires = "sidecar")]
    pub(crate) sidecar_namespaces: bool,
    /// Where the pod's processes are listed (with --sidecar-namespaces).
    #[arg(long, default_value = "/proc", env = "FUSE_SUPERVISOR_PROC_ROOT")]
    pub(crate) proc_root: PathBuf,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Job lifecycle")]
pub(crate) struct JobArgs {
    /// End the FUSE container of a Job's pod once its application
    /// containers have finished (node-wide; always on in sidecar mode).
    #[arg(long, env = "FUSE_SUPERVISOR_JOB_LIFECYCLE")]
    pub(crate) job_lifecycle: bool,
    /// Which pods qualify (kubectl label selector syntax; node-wide only).
    #[arg(long, value_name = "SELECTOR", default_value = job::DEFAULT_SELECTOR, env = "FUSE_SUPERVISOR_JOB_SELECTOR")]
    pub(crate) job_selector: job::LabelSelector,
    /// How long the FUSE daemon may take to exit after its unmount, and again
    /// after SIGTERM, before SIGTERM and then SIGKILL.
    #[arg(long, default_value = "30s", value_parser = parse_duration, env = "FUSE_SUPERVISOR_JOB_GRACE")]
    pub(crate) job_grace: Duration,
    /// How application processes are watched: `pidfd` (any pid namespace),
    /// or `proc-connector` (needs hostPID and hostNetwork).
    #[arg(long, value_enum, default_value = "pidfd", env = "FUSE_SUPERVISOR_JOB_PROCESS_WATCHER")]
    pub(crate) job_process_watcher: JobWatcher,
    #[command(flatten)]
    pub(crate) sidecar: SidecarArgs,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum JobWatcher {
    Pidfd,
    ProcConnector,
}

impl JobArgs {
    /// The lifecycle's setup: node-wide with `--job-lifecycle`, for the one
    /// pod in sidecar mode; it needs the kubelet.
    pub(crate) fn config(
        &self,
        kubelet: Option<&KubeletConfirmation>,
        node: &Config,
    ) -> anyhow::Result<Option<job::JobConfig>> {
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
            (sidecar.proc_root.clone(), PathBuf::from("/proc/self/ns/mnt"), Backend::Pidfd)
        } else {
            let watcher = match self.job_process_watcher {
                JobWatcher::Pidfd => Backend::Pidfd,
                JobWatcher::ProcConnector => Backend::ProcConnector,
            };
            (PathBuf::from("/proc"), node.mount_namespace.clone(), watcher)
        };
        Ok(Some(job::JobConfig {
            kubelet: kubelet.kubelet.clone(),
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
#[command(next_help_heading = "FUSE daemons")]
pub(crate) struct DaemonArgs {
    /// How daemon deaths are seen: `pidfd` (wakes for the watched daemons
    /// only; any pid namespace), `connector` (netlink process connector:
    /// hostPID, hostNetwork, NET_ADMIN before Linux 6.6; for kernels before
    /// 5.3, or to look for a missing daemon at every exec; falls back to
    /// pidfd), or `off` (only when a new mount appears).
    #[arg(long, value_enum, default_value = "pidfd", env = "FUSE_SUPERVISOR_PROCESS_WATCH")]
    pub(crate) process_watch: ProcessWatchArg,
    /// When a serving process exits while another process keeps its FUSE
    /// connection open unread, abort the connection once requests wait on
    /// it, so readers get an error instead of hanging.
    #[arg(long, env = "FUSE_SUPERVISOR_ABORT_DEAD_CONNECTIONS")]
    pub(crate) abort_dead_connections: bool,
    /// Where the FUSE control filesystem (fusectl) is mounted in the
    /// watched namespace; where it is not, connections are told apart
    /// through a private instance, but orphans cannot be aborted.
    #[arg(long, default_value = "/sys/fs/fuse/connections", env = "FUSE_SUPERVISOR_FUSE_CONNECTIONS_DIR")]
    pub(crate) fuse_connections_dir: PathBuf,
    /// Once a dead daemon's connection is held by nobody, detach its own
    /// mount from the source path (never a pod's): its restart then mounts
    /// on a directory instead of failing on, or stacking over, a dead
    /// mount, and no stale layer of a target has to be held open (which
    /// would make a deleted pod's unmount fail with EBUSY).
    #[arg(long, value_enum, default_value = "on", env = "FUSE_SUPERVISOR_DETACH_DEAD_SOURCES")]
    pub(crate) detach_dead_sources: OnOff,
    /// A source healed more than this many times within --flapping-window
    /// has a daemon that keeps crashing: a warning, a `FuseDaemonFlapping`
    /// Event on its pod and `daemon_flapping_total`, once per window.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..), env = "FUSE_SUPERVISOR_FLAPPING_HEALS")]
    pub(crate) flapping_heals: u32,
    /// The sliding window of --flapping-heals.
    #[arg(long, default_value = "10m", value_parser = parse_period, env = "FUSE_SUPERVISOR_FLAPPING_WINDOW")]
    pub(crate) flapping_window: Duration,
    #[command(flatten)]
    pub(crate) restage: RestageArgs,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "CSI re-staging")]
pub(crate) struct RestageArgs {
    /// Stage again, through this CSI driver (its `GetPluginInfo` name), a
    /// recorded volume whose global mount died while a pod still uses it,
    /// once the driver's socket answers again (repeatable; env: comma-separated).
    #[arg(long = "restage", value_name = "DRIVER", env = "FUSE_SUPERVISOR_RESTAGE", value_delimiter = ',')]
    pub(crate) drivers: Vec<String>,
    /// Where the CSI proxies record, as the host sees it: records in DIR
    /// and in each directory in it (one per driver's proxy).
    #[arg(long, value_name = "DIR", default_value = "/run/fuse-supervisor-csi", env = "FUSE_SUPERVISOR_CSI_RECORDS")]
    pub(crate) csi_records: PathBuf,
    /// A driver's own socket, as the host sees it, where it is not
    /// `<kubelet root>/plugins/<driver>/csi.sock` (repeatable; env: comma-separated).
    #[arg(long = "csi-socket", value_name = "DRIVER=PATH", value_parser = parse_driver_socket, env = "FUSE_SUPERVISOR_CSI_SOCKET", value_delimiter = ',')]
    pub(crate) csi_sockets: Vec<(String, PathBuf)>,
    /// How long a driver back on its socket has to stage a volume by
    /// itself before the agent does.
    #[arg(long, default_value = "1500ms", value_parser = parse_duration, env = "FUSE_SUPERVISOR_RESTAGE_GRACE")]
    pub(crate) restage_grace: Duration,
    /// The deadline of one `NodeStageVolume` call (a driver may mount a
    /// remote filesystem in it).
    #[arg(long, default_value = "2m", value_parser = parse_duration, env = "FUSE_SUPERVISOR_RESTAGE_CALL_TIMEOUT")]
    pub(crate) restage_call_timeout: Duration,
}

fn parse_driver_socket(text: &str) -> Result<(String, PathBuf), String> {
    match text.split_once('=') {
        Some((driver, path)) if !driver.is_empty() && path.starts_with('/') => {
            Ok((driver.to_owned(), PathBuf::from(path)))
        }
        _ => Err(format!("{text:?} is not DRIVER=/absolute/path")),
    }
}

impl RestageArgs {
    /// None unless --restage names a driver.
    pub(crate) fn config(&self, kubelet_root: &std::path::Path) -> Option<RestageConfig> {
        if self.drivers.is_empty() {
            return None;
        }
        Some(RestageConfig {
            drivers: self.drivers.iter().cloned().collect(),
            records: self.csi_records.clone(),
            sockets: self.csi_sockets.iter().cloned().collect(),
            kubelet_root: kubelet_root.to_path_buf(),
            grace: self.restage_grace,
            call_deadline: self.restage_call_timeout,
        })
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum ProcessWatchArg {
    Connector,
    Pidfd,
    Off,
}

impl DaemonArgs {
    pub(crate) fn watch(&self) -> DaemonWatch {
        DaemonWatch {
            backend: match self.process_watch {
                ProcessWatchArg::Connector => Some(Backend::ProcConnector),
                ProcessWatchArg::Pidfd => Some(Backend::Pidfd),
                ProcessWatchArg::Off => None,
            },
            abort_dead_connections: self.abort_dead_connections,
            fuse_connections: self.fuse_connections_dir.clone(),
            detach_dead_sources: self.detach_dead_sources == OnOff::On,
            flapping: FlappingPolicy { heals: self.flapping_heals, window: self.flapping_window },
            ..DaemonWatch::default()
        }
    }
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Watching")]
pub(crate) struct WatchArgs {
    /// `event`: wake on the kernel's mount-table notifications (no timer).
    /// `poll`: scan the whole table every --poll-period, as polling healers
    /// do (for comparison, or where notifications do not work).
    #[arg(long, value_enum, default_value = "event", env = "FUSE_SUPERVISOR_MODE")]
    pub(crate) mode: Mode,
    /// How often poll mode scans.
    #[arg(long, default_value = "5s", value_parser = parse_period, env = "FUSE_SUPERVISOR_POLL_PERIOD")]
    pub(crate) poll_period: Duration,
    /// Which kernel notification wakes event mode: `fanotify` mount events
    /// (Linux 6.15+), `mountinfo` (EPOLLPRI on /proc/…/mountinfo, any
    /// kernel), or `auto`: fanotify where the kernel offers it for the
    /// namespace, else mountinfo.
    #[arg(long, value_enum, default_value = "auto", env = "FUSE_SUPERVISOR_TABLE_EVENTS")]
    pub(crate) table_events: TableEventsArg,
    /// How the containers holding a dead FUSE connection's mounts are
    /// found: `events` keeps the node's mount namespaces by the process
    /// connector's exec and exit events after one walk of /proc at start
    /// (through the host's network namespace: hostPID, CAP_SYS_ADMIN;
    /// walks where it cannot be had); `walk` walks /proc at each daemon
    /// death and after each heal.
    #[arg(long, value_enum, default_value = "events", env = "FUSE_SUPERVISOR_CONTAINER_NAMESPACES")]
    pub(crate) container_namespaces: ContainerNamespacesArg,
    /// How long a daemon's death or a heal waits for each container's mount
    /// namespace (making its dead mounts private, replacing them); a
    /// namespace not done by then is given up on for this heal, reported,
    /// and never holds up the other pods.
    #[arg(long, default_value = "1s", value_parser = parse_duration, env = "FUSE_SUPERVISOR_CONTAINER_DEADLINE")]
    pub(crate) container_deadline: Duration,
    /// How the tables of other mount namespaces (containers') are read:
    /// `auto` by listmount/statmount naming the namespace (Linux 6.11+),
    /// asking paths of FUSE mounts only, else mountinfo streamed;
    /// `mountinfo` streamed always. Either way within caps: see docs/containers.md.
    #[arg(long, value_enum, default_value = "auto", env = "FUSE_SUPERVISOR_NAMESPACE_TABLES")]
    pub(crate) namespace_tables: NamespaceTablesArg,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum NamespaceTablesArg {
    Auto,
    Mountinfo,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum ContainerNamespacesArg {
    Events,
    Walk,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum Mode {
    Event,
    Poll,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum TableEventsArg {
    Mountinfo,
    Fanotify,
    Auto,
}

impl WatchArgs {
    pub(crate) fn mode(&self) -> WatchMode {
        match self.mode {
            Mode::Event => WatchMode::Events(match self.table_events {
                TableEventsArg::Mountinfo => TableEvents::Mountinfo,
                TableEventsArg::Fanotify => TableEvents::Fanotify,
                TableEventsArg::Auto => TableEvents::Auto,
            }),
            Mode::Poll => WatchMode::Poll { period: self.poll_period },
        }
    }

    pub(crate) fn namespace_tables(&self) -> TableReads {
        match self.namespace_tables {
            NamespaceTablesArg::Auto => TableReads::Auto,
            NamespaceTablesArg::Mountinfo => TableReads::Mountinfo,
        }
    }

    pub(crate) fn container_namespaces(&self) -> ContainerNamespaces {
        match self.container_namespaces {
            ContainerNamespacesArg::Events => ContainerNamespaces::Events,
            ContainerNamespacesArg::Walk => ContainerNamespaces::Walk,
        }
    }
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Metrics and health")]
pub(crate) struct ServeArgs {
    /// Where to serve /metrics (Prometheus, OpenMetrics text), /healthz (the
    /// loop is alive) and /readyz (the first scan is done), or `off`.
    #[arg(long, value_name = "ADDR:PORT|off", default_value = "0.0.0.0:9809", value_parser = parse_listen, env = "FUSE_SUPERVISOR_METRICS_ADDR")]
    pub(crate) metrics_addr: Listen,
}

pub(crate) fn run(
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
pub(crate) fn run_sidecar(
    sidecar: SidecarConfig,
    job: Option<job::JobConfig>,
    shutdown: &Shutdown,
) -> anyhow::Result<()> {
    let lifecycle = supervisor::start_job_lifecycle(job.as_ref(), None, shutdown)?;
    let result = sidecar::run(&sidecar, shutdown);
    drop(lifecycle);
    result.map_err(Into::into)
}

/// `run`: the arguments are the command's groups of flags.
#[allow(clippy::too_many_arguments)]
pub(crate) fn command(
    node: NodeArgs,
    kubelet: KubeletArgs,
    job: JobArgs,
    daemons: DaemonArgs,
    watch: WatchArgs,
    serve: ServeArgs,
    events: EventsArgs,
    log: LogArgs,
) -> anyhow::Result<()> {
    log.init();
    prepare_process();
    start_fuse_call_helper(&log, node.realtime_priority);
    set_table_reads(watch.namespace_tables());
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
                container_namespaces: watch.container_namespaces(),
                container_deadline: watch.container_deadline,
                restage: daemons.restage.config(&config.kubelet_root),
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

/// Starts the helper that makes the calls waiting on FUSE servers
/// ([`fuse_calls`]); without it they are made here, as before.
fn start_fuse_call_helper(log: &LogArgs, realtime_priority: u8) {
    let mut helper = std::process::Command::new("/proc/self/exe");
    helper.arg(fuse_calls::SUBCOMMAND).args(log.flags());
    if let Err(err) = fuse_calls::start_helper(helper, HealPriority::realtime(realtime_priority)) {
        tracing::warn!(err = %chain(&err), "cannot start the FUSE call helper; the agent makes its FUSE calls itself");
    }
}

/// `fuse-calls`: serves the agent's FUSE calls on standard input, the
/// socket the agent started it with, until the agent ends.
pub(crate) fn serve_fuse_calls(realtime_priority: u8) -> anyhow::Result<()> {
    let control = std::io::stdin().as_fd().try_clone_to_owned().context("cannot take the agent's socket")?;
    fuse_calls::serve(control, HealPriority::realtime(realtime_priority)).context("cannot serve the agent's FUSE calls")
}
