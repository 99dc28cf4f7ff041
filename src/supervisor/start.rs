//! Start-up: the threads and watchers `run` wires together, and the
//! loop's own construction.
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{self, Sender};
use std::time::Instant;

use fuse_supervisor_sys::{mount, ns};
use tracing::{error, info, warn};

use crate::supervisor::daemons::Daemons;
use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::heal::namespaces::{NamespaceKeeper, Namespaces};
use fuse_supervisor_engine::heal::priority::{HealActivity, HealPriority, HealWindow};
use fuse_supervisor_engine::heal::probe::Prober;
use fuse_supervisor_engine::heal::{Executor, MountExecutor};
use fuse_supervisor_engine::kube::Asker;
use fuse_supervisor_engine::model::incremental::KernelMounts;
use fuse_supervisor_engine::model::mountinfo::MountInfoReader;
use fuse_supervisor_engine::model::path_map::PathMap;
use fuse_supervisor_engine::model::source::{TableSource, TextTable};
use fuse_supervisor_engine::model::state::{Journal, StateError, StateWriter};
use fuse_supervisor_engine::model::table::Layout;
use fuse_supervisor_engine::plan::confirm::Confirmations;
use fuse_supervisor_engine::plan::flapping::Flapping;
use fuse_supervisor_engine::plan::locate::VolDataCache;
use fuse_supervisor_engine::watch::mount_table::{
    self, FanotifyWatcher, MountWatcher, MountinfoWatcher, PollWatcher, Wake, WatchMode,
};
use fuse_supervisor_engine::watch::pods::PodWatcher;
use fuse_supervisor_engine::watch::processes::{Backend, ConnectorOptions, ProcessConnector, host_network_namespace};
use fuse_supervisor_engine::watch::thread::Watching;

use super::tables::{KeptTable, SettleError, SharedTable};
use super::{Config, Confirmer, ContainerNamespaces, Event, Supervisor, SupervisorError};
use fuse_supervisor_engine::shutdown::Shutdown;

/// Runs until `shutdown` is requested. Call from a thread of its own: it
/// moves that thread into the watched namespace.
pub fn run(config: &Config, shutdown: &Shutdown) -> Result<(), SupervisorError> {
    // Before any thread or mount: a seccomp profile that filters these
    // would otherwise let it start and fail every heal.
    refused_calls()?;
    let (events, inbox) = mpsc::channel();
    // Pings queue up until the loop serves, so a slow start reads as not alive.
    let pings = events.clone();
    config.health.attach(move |pong| pings.send(Event::Ping(pong)).is_ok());
    // The kubelet thread starts before this one leaves for the watched
    // namespace, so it keeps ours: the token and CA files are this
    // container's, not the host's.
    let asker = match &config.kubelet {
        Some(kubelet) => {
            kubelet.kubelet.load()?;
            let events = events.clone();
            let asker =
                Asker::spawn(kubelet.kubelet.clone(), move |answer| events.send(Event::Kubelet(answer)).is_ok())
                    .map_err(|source| SupervisorError::Thread { name: "kubelet", source })?;
            Some((asker, kubelet.grace))
        }
        None => {
            info!("kubelet confirmation is off: healing on mount evidence alone");
            None
        }
    };
    // One socket and thread for every process watcher of the agent.
    let connector = open_process_connector(config);
    // Like the kubelet thread, it stays in this namespace; in sidecar mode
    // the supervisor ends with its pod's FUSE container.
    let job = start_job_lifecycle(config.job.as_ref(), connector.as_ref(), shutdown)?;
    // The pod watcher joins the namespace itself; its first full scan is
    // sent before spawn returns, so it is the first event, and it is
    // applied before the first table scan is planned.
    let pod_events = events.clone();
    let pod_watcher = PodWatcher::spawn(&config.kubelet_root, Some(&config.mount_namespace), move |change| {
        let _ = pod_events.send(Event::Pods(change));
    })?;
    let first_pod_scan = match inbox.try_recv() {
        Ok(Event::Pods(change)) => Some(change),
        _ => None,
    };
    // Before leaving for the namespace: the discovery thread reads this
    // process's /proc.
    let daemon_events = events.clone();
    let heal_activity = Arc::new(HealActivity::default());
    let daemons = Daemons::start(&config.daemons, connector.as_ref(), Arc::clone(&heal_activity), move |event| {
        daemon_events.send(Event::Daemon(event)).is_ok()
    })?;
    // Like the discovery thread, it reads this process's /proc.
    let (namespaces, _namespace_keeper) = keep_namespaces(config, connector.as_ref(), &heal_activity, &events);
    let restager = start_restager(config, &events)?;
    ns::join_mount_namespace(&config.mount_namespace)
        .map_err(|source| SupervisorError::Namespace { path: config.mount_namespace.clone(), source })?;
    let open_mountinfo = || {
        File::open("/proc/thread-self/mountinfo")
            .map_err(|source| SupervisorError::Open { what: "/proc/thread-self/mountinfo".into(), source })
    };
    // Where the loop reads the table, by what wakes it: the mount events
    // themselves with fanotify; a listing of mount IDs where the kernel
    // has one (6.8+) with mountinfo's flag; the whole text otherwise.
    let mut feed = None;
    let (watcher, table_events): (Box<dyn MountWatcher>, _) = match config.watch {
        // In the watched namespace now: the fanotify mark goes on this thread's.
        WatchMode::Events(wanted) => {
            let (watcher, backend) = mount_table::event_watcher::<SupervisorError>(
                wanted,
                || {
                    let watcher = FanotifyWatcher::of_this_thread(shutdown.waker())?;
                    feed = Some(watcher.feed());
                    Ok(watcher)
                },
                || Ok(MountinfoWatcher::new(open_mountinfo()?, shutdown.waker())?),
            )?;
            (watcher, backend.to_string())
        }
        WatchMode::Poll { period } => (Box::new(PollWatcher::new(period, shutdown.waker())?), "timer".into()),
    };
    let mut shared = None;
    let (table, table_read): (Box<dyn TableSource>, _) = match (config.watch, feed) {
        (WatchMode::Events(_), Some(feed)) => {
            let table = SharedTable::new(KeptTable::from_events(feed));
            shared = Some(table.clone());
            (Box::new(table), "mount events")
        }
        (WatchMode::Events(_), None) if KernelMounts::listing_supported() => {
            (Box::new(KeptTable::from_listings(open_mountinfo()?)), "listmount")
        }
        _ => (Box::new(TextTable::new(MountInfoReader::from_file(open_mountinfo()?))), "mountinfo text"),
    };
    let table_watch = watcher.rearm_handle();
    let watching = spawn_watcher(watcher, shared, events.clone(), config.heal_priority, shutdown)?;
    let mut supervisor = Supervisor::new(config, table, events.clone(), heal_activity)?;
    supervisor.executor.use_namespaces(namespaces);
    supervisor.confirmer = asker.map(|(asker, grace)| Confirmer { asker, confirmations: Confirmations::new(grace) });
    supervisor.pods_watched = true;
    supervisor.daemons = daemons;
    supervisor.restager = restager;
    // From this thread: the writer sees the state directory as the loop does.
    let health = Arc::clone(&config.health);
    let report_save = move |err: Option<&StateError>| {
        health.set_state_problem(err.map(fuse_supervisor_engine::errors::error_chain));
    };
    supervisor.state_writer = Some(
        StateWriter::spawn(Box::new(report_save))
            .map_err(|source| SupervisorError::Thread { name: "state writer", source })?,
    );
    if let Some(change) = first_pod_scan {
        supervisor.on_pods(change);
    }
    supervisor.rescan();
    config.health.set_ready();
    info!(
        kubelet_root = %config.kubelet_root.display(),
        namespace = %config.mount_namespace.display(),
        mode = %config.watch,
        %table_events,
        table_read,
        "supervising"
    );
    supervisor.table_watch = Some(table_watch);
    supervisor.serve(&inbox, shutdown);
    // No heal follows: background work waiting for one to end (the search
    // for daemons, which dropping the supervisor joins) must not wait forever.
    supervisor.heal_window.close(false);
    // What changed last is written before the writer stops.
    supervisor.save_state();
    drop(supervisor);
    config.health.detach();
    shutdown.request();
    drop(job);
    if let Err(err) = pod_watcher.stop() {
        error!(err = %chain(&err), "pod-directory watcher failed");
    }
    if let Err(err) = watching.stop() {
        error!(err = %chain(&err), "mount-table watcher failed");
    }
    Ok(())
}

/// The process connector, when a process watcher of the agent is to use it
/// (the daemons', the namespace keeper's, the Job's); None when none is, or
/// when it cannot be had (said here, once: each user then does without).
fn open_process_connector(config: &Config) -> Option<ProcessConnector> {
    let wanted = config.daemons.backend == Some(Backend::ProcConnector)
        || config.container_namespaces != ContainerNamespaces::Walk
        || config.job.as_ref().is_some_and(|job| job.watcher == Backend::ProcConnector);
    if !wanted {
        return None;
    }
    let proc_root = &config.daemons.proc_root;
    let options = ConnectorOptions {
        proc_root: proc_root.clone(),
        network_namespace: host_network_namespace(proc_root),
        ..ConnectorOptions::default()
    };
    match ProcessConnector::open(options) {
        Ok(connector) => Some(connector),
        Err(err) => {
            warn!(err = %chain(&err), "the process connector is unavailable");
            None
        }
    }
}

/// The node's mount namespaces, where heals look for containers' mounts,
/// and what keeps them by events on `connector` (None: they are walked for).
fn keep_namespaces(
    config: &Config,
    connector: Option<&ProcessConnector>,
    heal_activity: &Arc<HealActivity>,
    events: &Sender<Event>,
) -> (Arc<Namespaces>, Option<NamespaceKeeper>) {
    let namespaces = Namespaces::new(Path::new("/proc"));
    let late = events.clone();
    namespaces.when_late_copies(Box::new(move |copies| {
        let _ = late.send(Event::LateCopies(copies));
    }));
    if config.container_namespaces == ContainerNamespaces::Walk {
        info!("containers' mount namespaces are walked for at each death and heal");
        return (namespaces, None);
    }
    let Some(connector) = connector else {
        warn!("without the process connector, containers are walked for at each death and heal");
        return (namespaces, None);
    };
    match namespaces.keep(connector, Arc::clone(heal_activity)) {
        Ok(keeper) => (namespaces, Some(keeper)),
        Err(err) => {
            warn!(err = %chain(&err), "cannot keep the mount namespaces by process events; containers are walked for at each death and heal");
            (namespaces, None)
        }
    }
}

/// The re-staging thread when `--restage` names a driver: it joins the
/// watched namespace itself and tells the loop each outcome.
fn start_restager(
    config: &Config,
    events: &Sender<Event>,
) -> Result<Option<fuse_supervisor_engine::csi::restage::Restager>, SupervisorError> {
    let Some(restage) = &config.restage else { return Ok(None) };
    let events = events.clone();
    let kubelet = config.kubelet.as_ref().map(|confirmation| confirmation.kubelet.clone());
    let restager = fuse_supervisor_engine::csi::restage::Restager::spawn(
        restage.clone(),
        &config.mount_namespace,
        kubelet,
        move |news| {
            let _ = events.send(Event::Restager(news));
        },
    )
    .map_err(|source| SupervisorError::Thread { name: "restage", source })?;
    info!(drivers = ?restage.drivers, records = %restage.records.display(), grace_ms = restage.grace.as_millis() as u64, "CSI re-staging on");
    Ok(Some(restager))
}

/// Starts the Job lifecycle when configured; the supervisor stops once it
/// has ended its pod's FUSE container (sidecar mode).
pub fn start_job_lifecycle(
    job: Option<&crate::job::JobConfig>,
    connector: Option<&ProcessConnector>,
    shutdown: &Shutdown,
) -> Result<Option<crate::job::JobLifecycle>, crate::job::JobError> {
    let Some(job) = job else { return Ok(None) };
    let done = shutdown.clone();
    crate::job::JobLifecycle::spawn(job.clone(), connector, move || done.request()).map(Some)
}

/// The watcher's thread, stopped by the shutdown's eventfd (which the
/// watcher's poller holds). With a table kept from its events (`kept`),
/// it applies them itself and wakes the loop only when a kept mount changed.
fn spawn_watcher(
    mut watcher: Box<dyn MountWatcher>,
    kept: Option<SharedTable>,
    events: Sender<Event>,
    priority: HealPriority,
    shutdown: &Shutdown,
) -> Result<Watching, SupervisorError> {
    let rearm = watcher.rearm_handle();
    Ok(Watching::start("watcher", shutdown.waker(), move || {
        // One wake-up per burst of changes (see MountWatcher), little work each.
        priority.raise();
        loop {
            // A burst of changes becomes one rescan: the watcher stays
            // disarmed from its report until the loop reads the table.
            let event = match watcher.wait() {
                Ok(Wake::TableChanged) => match kept.as_ref().map(|kept| kept.settle(&*rearm)) {
                    Some(Ok(false)) => continue,
                    Some(Err(SettleError::Rearm(err))) => Event::WatchFailed(err),
                    Some(Err(SettleError::Table(err))) => {
                        warn!(err = %chain(&err), "cannot apply mount events; the loop looks");
                        Event::TableChanged(watcher.attached())
                    }
                    Some(Ok(true)) | None => Event::TableChanged(watcher.attached()),
                },
                Ok(Wake::Shutdown) => Event::Shutdown,
                Err(err) => Event::WatchFailed(err),
            };
            let last = !matches!(event, Event::TableChanged(_));
            if events.send(event).is_err() || last {
                return;
            }
        }
    })?)
}

/// Whether `setns` and the new mount API reach the kernel (see
/// [`mount::new_mount_api_refusal`]).
fn refused_calls() -> Result<(), SupervisorError> {
    if let Some(source) = ns::setns_refusal() {
        return Err(SupervisorError::Refused { call: "setns", source });
    }
    match mount::new_mount_api_refusal() {
        Some((call, source)) => Err(SupervisorError::Refused { call, source }),
        None => Ok(()),
    }
}

impl Supervisor<MountExecutor> {
    /// The loop with the executor that mounts, in the calling thread's
    /// namespace.
    pub(super) fn new(
        config: &Config,
        reader: Box<dyn TableSource>,
        events: Sender<Event>,
        heal_activity: Arc<HealActivity>,
    ) -> Result<Self, SupervisorError> {
        let executor = MountExecutor::new(&config.kubelet_root, &config.staging_dir, config.heal_priority)
            .map(|executor| executor.with_container_deadline(config.container_deadline))
            .map_err(|source| SupervisorError::Open {
                what: format!(
                    "kubelet root {} and staging mount {}",
                    config.kubelet_root.display(),
                    config.staging_dir.display()
                ),
                source,
            })?;
        Ok(Supervisor::with_executor(config, reader, executor, events, heal_activity))
    }
}

impl<E: Executor> Supervisor<E> {
    /// The loop, reading the table from `reader` and healing through
    /// `executor`: how the unit tests drive it without a kernel.
    pub(super) fn with_executor(
        config: &Config,
        reader: Box<dyn TableSource>,
        executor: E,
        events: Sender<Event>,
        heal_activity: Arc<HealActivity>,
    ) -> Self {
        let mut executor = executor;
        let freed = events.clone();
        executor.when_namespace_free(Box::new(move |namespace| {
            let _ = freed.send(Event::NamespaceFree(namespace));
        }));
        Supervisor {
            layout: Layout::new(&config.kubelet_root).with_pod_scope(config.pod_scope.as_deref()),
            journal: Journal::load_or_set_aside(&config.state_dir),
            records: PathMap::new(),
            reader,
            prober: Prober::new(config.probe_timeout, config.heal_priority),
            heal_window: HealWindow::new(config.heal_priority, heal_activity),
            executor,
            events,
            woke_at: Instant::now(),
            deadlines_handled_at: Instant::now(),
            scan_started: Instant::now(),
            unscanned: false,
            read_since_trim: false,
            sources: Default::default(),
            table_reads: 0,
            confirmer: None,
            kubelet: config.kubelet.as_ref().map(|confirmation| confirmation.kubelet.clone()),
            proc_root: std::path::PathBuf::from("/proc"),
            scanned_once: false,
            layouts: config.layouts.clone(),
            vol_data: VolDataCache::new(config.kubelet_root.join("pods")),
            pods_watched: false,
            unmapped_pods: BTreeSet::new(),
            reporters: config.reporters.clone(),
            polling: matches!(config.watch, WatchMode::Poll { .. }),
            daemons: None,
            container_retries: Vec::new(),
            given_up: BTreeMap::new(),
            refusals: Default::default(),
            flapping: Flapping::new(config.daemons.flapping),
            state_dirty: false,
            state_writer: None,
            table_watch: None,
            restager: None,
        }
    }
}
