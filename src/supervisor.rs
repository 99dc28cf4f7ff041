//! The supervisor loop: wakes on kernel events, reads the table, plans,
//! probes sources off-thread and heals.
//!
//! The loop thread joins the watched mount namespace and does all mounting
//! itself; nothing it does touches a FUSE filesystem (O_PATH opens and mount
//! calls never reach the daemon). Probes, which do, run on worker threads.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use fuse_supervisor_sys::{ns, poll::Waker, resolve, statmount};
use tracing::{debug, error, info, info_span, warn};

use crate::confirm::{self, Answer, Asker, Verdict};
use crate::daemons::{DaemonEvent, DaemonWatch, Daemons};
use crate::heal::{Executor, Healed, MountExecutor, Prepared};
use crate::health::{Health, Pong};
use crate::kubelet::{KubeletClient, KubeletConfig};
use crate::layout::SourceLayouts;
use crate::locate::{self, Located, VolDataCache};
use crate::mountinfo::{MountInfoReader, is_fuse_type};
use crate::plan::{self, Assessment, HealBatch};
use crate::pods::{PodChange, PodWatcher};
use crate::priority::{HealActivity, HealPriority, HealWindow};
use crate::probe::{ProbeOutcome, ProbeReport, Prober};
use crate::report::{HealReport, Report, Reporters, ScanCounts, TargetEvent};
use crate::state::{Journal, Mapping, StateError, StateWriter, TargetState, retry_delay};
use crate::table::{Classified, Dev, Layout, Role, Snapshot, TargetKind};
use crate::watch::{self, FanotifyWatcher, MountWatcher, MountinfoWatcher, PollWatcher, Rearm, Wake, WatchMode};
use crate::webhook::error_chain;

mod degraded;

/// How `run` is set up.
#[derive(Debug, Clone)]
pub struct Config {
    pub kubelet_root: PathBuf,
    pub state_dir: PathBuf,
    /// The mount namespace to heal in (`/proc/1/ns/mnt`: the host's).
    pub mount_namespace: PathBuf,
    /// A directory in that namespace where a private tmpfs parks new mounts
    /// while the stale layers under them are removed.
    pub staging_dir: PathBuf,
    /// How long a source may take to answer a probe before it is reported
    /// as not answering (the probe goes on waiting in the background).
    pub probe_timeout: Duration,
    /// Confirm restarts with the local kubelet before rebinding; None
    /// heals on mount evidence alone (`--kubelet none`).
    pub kubelet: Option<KubeletConfirmation>,
    /// Where sources are when no healthy observation taught it.
    pub layouts: SourceLayouts,
    /// Who hears about breaks, heals and kubelet calls (events, metrics).
    pub reporters: Reporters,
    /// Sidecar mode: only this pod's targets are healed.
    pub pod_scope: Option<String>,
    /// The serverless Job lifecycle, on its own thread, when enabled.
    pub job: Option<crate::job::JobConfig>,
    /// How the daemons serving the sources are watched for their death.
    pub daemons: DaemonWatch,
    /// Kernel notifications, or a full scan on a timer.
    pub watch: WatchMode,
    /// Answers liveness pings and says when the first scan is done.
    pub health: Arc<Health>,
    /// Of the heal path's threads (see [`crate::priority`]).
    pub heal_priority: HealPriority,
}

/// How restarts are confirmed with the kubelet.
#[derive(Debug, Clone)]
pub struct KubeletConfirmation {
    pub client: KubeletConfig,
    /// How long an unreachable or failing kubelet may delay a heal before
    /// it goes ahead on mount evidence alone.
    pub grace: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("cannot join mount namespace {path}")]
    Namespace {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot open {what}")]
    Open {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Watch(#[from] crate::watch::WatchError),
    #[error(transparent)]
    Kubelet(#[from] crate::kubelet::KubeletError),
    #[error(transparent)]
    Pods(#[from] crate::pods::PodWatchError),
    #[error(transparent)]
    Job(#[from] crate::job::JobError),
    #[error(transparent)]
    Daemons(#[from] crate::daemons::DaemonError),
    #[error("cannot start thread {name}")]
    Thread {
        name: &'static str,
        #[source]
        source: io::Error,
    },
}

/// Asks a running supervisor to stop; cheap to clone.
#[derive(Clone)]
pub struct Shutdown {
    waker: Arc<Waker>,
    requested: Arc<AtomicBool>,
}

impl Shutdown {
    pub fn new() -> io::Result<Self> {
        Ok(Shutdown { waker: Arc::new(Waker::new()?), requested: Arc::new(AtomicBool::new(false)) })
    }

    pub fn request(&self) {
        self.requested.store(true, Ordering::SeqCst);
        if let Err(err) = self.waker.wake() {
            error!(?err, "cannot wake the watcher for shutdown");
        }
    }

    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    /// The eventfd a shutdown request sets, for loops that wait on their own epoll.
    pub fn waker(&self) -> Arc<Waker> {
        Arc::clone(&self.waker)
    }
}

enum Event {
    /// With the unique IDs of the mounts the change attached, where the
    /// watcher names them.
    TableChanged(Vec<u64>),
    Probed(ProbeReport),
    Kubelet(Answer),
    Pods(PodChange),
    Daemon(DaemonEvent),
    WatchFailed(crate::watch::WatchError),
    /// A liveness check (`/healthz`): answered at once.
    Ping(Pong),
    Shutdown,
}

/// A replaced source waiting for the kubelet to confirm its owner's restart.
#[derive(Debug)]
struct Confirmation {
    /// The new source mount, and the one its targets are still on.
    mount_id: u32,
    stuck_on: u32,
    /// UIDs of the broken targets' pods: where a FUSE sidecar would be.
    target_pods: Vec<String>,
    waiting: Waiting,
    /// Answers so far: they space out the re-checks.
    attempts: u32,
    /// When the kubelet began to fail for this source: the grace runs from here.
    failing_since: Option<Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// A call is on its way.
    Asking,
    /// The owner shows no restart yet: ask again at the given time.
    NotYet { recheck_at: Instant },
    /// The kubelet fails: ask again at the given time, until the grace is over.
    Failing { retry_at: Instant },
    /// Confirmed, or decided without the kubelet: heal.
    Go,
}

impl Waiting {
    fn due_at(&self) -> Option<Instant> {
        match *self {
            Waiting::NotYet { recheck_at } => Some(recheck_at),
            Waiting::Failing { retry_at } => Some(retry_at),
            Waiting::Asking | Waiting::Go => None,
        }
    }
}

/// Re-checks of a source whose owner shows no restart, and retries of a
/// failing kubelet: short at first, then capped.
fn recheck_delay(attempts: u32) -> Duration {
    const FIRST: Duration = Duration::from_millis(100);
    const CAP: Duration = Duration::from_secs(2);
    FIRST.saturating_mul(1 << attempts.min(8)).min(CAP)
}

/// Per-target bookkeeping beside the journal's mapping.
#[derive(Debug)]
struct TargetRecord {
    state: TargetState,
    attempts: u32,
    /// When the current outage began; kept through healing and retries.
    broken_since: Option<SystemTime>,
}

impl TargetRecord {
    fn new(state: TargetState) -> Self {
        TargetRecord { state, attempts: 0, broken_since: None }
    }
}

/// Runs until `shutdown` is requested. Call from a thread of its own: it
/// moves that thread into the watched namespace.
pub fn run(config: &Config, shutdown: &Shutdown) -> Result<(), SupervisorError> {
    // Large scan buffers get pages of their own, given back when freed
    // (sys::memory); with 10,000 targets this halves the idle footprint.
    if !fuse_supervisor_sys::memory::set_mmap_threshold(128 * 1024) {
        debug!("allocator keeps its own mmap threshold");
    }
    let (events, inbox) = mpsc::channel();
    // Pings queue up until the loop serves, so a slow start reads as not alive.
    let pings = events.clone();
    config.health.attach(move |pong| pings.send(Event::Ping(pong)).is_ok());
    // The kubelet thread starts before this one leaves for the watched
    // namespace, so it keeps ours: the token and CA files are this
    // container's, not the host's.
    let asker = match &config.kubelet {
        Some(kubelet) => {
            let client = KubeletClient::new(kubelet.client.clone())?;
            let events = events.clone();
            let asker = Asker::spawn(client, move |answer| events.send(Event::Kubelet(answer)).is_ok())
                .map_err(|source| SupervisorError::Thread { name: "kubelet", source })?;
            Some((asker, kubelet.grace))
        }
        None => {
            info!("kubelet confirmation is off: healing on mount evidence alone");
            None
        }
    };
    // Like the kubelet thread, it stays in this namespace; in sidecar mode
    // the supervisor ends with its pod's FUSE container.
    let job = start_job_lifecycle(config.job.as_ref(), shutdown)?;
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
    let daemons = Daemons::start(&config.daemons, Arc::clone(&heal_activity), move |event| {
        daemon_events.send(Event::Daemon(event)).is_ok()
    })?;
    ns::join_mount_namespace(&config.mount_namespace)
        .map_err(|source| SupervisorError::Namespace { path: config.mount_namespace.clone(), source })?;
    let open_mountinfo = || {
        File::open("/proc/thread-self/mountinfo")
            .map_err(|source| SupervisorError::Open { what: "/proc/thread-self/mountinfo".into(), source })
    };
    let (watcher, table_events): (Box<dyn MountWatcher>, _) = match config.watch {
        // In the watched namespace now: the fanotify mark goes on this thread's.
        WatchMode::Events(wanted) => {
            let (watcher, backend) = watch::event_watcher::<SupervisorError>(
                wanted,
                || {
                    let namespace = ns::open_thread_mount_namespace()
                        .map_err(|source| SupervisorError::Open { what: "/proc/thread-self/ns/mnt".into(), source })?;
                    Ok(FanotifyWatcher::new(namespace.as_fd(), shutdown.waker.clone())?)
                },
                || Ok(MountinfoWatcher::new(open_mountinfo()?, shutdown.waker.clone())?),
            )?;
            (watcher, backend.to_string())
        }
        WatchMode::Poll { period } => (Box::new(PollWatcher::new(period, shutdown.waker.clone())?), "timer".into()),
    };
    let table_watch = watcher.rearm_handle();
    let watcher_thread = spawn_watcher(watcher, events.clone(), config.heal_priority)?;
    let mut supervisor =
        Supervisor::new(config, MountInfoReader::from_file(open_mountinfo()?), events.clone(), heal_activity)?;
    supervisor.confirmer = asker.map(|(asker, grace)| Confirmer { asker, grace, waiting: BTreeMap::new() });
    supervisor.pods_watched = true;
    supervisor.daemons = daemons;
    // From this thread: the writer sees the state directory as the loop does.
    let health = Arc::clone(&config.health);
    let report_save = move |err: Option<&StateError>| {
        health.set_state_problem(err.map(|err| crate::webhook::error_chain(err)));
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
        "supervising"
    );
    supervisor.table_watch = Some(table_watch);
    supervisor.serve(&inbox, shutdown);
    // What changed last is written before the writer stops.
    supervisor.save_state();
    drop(supervisor);
    config.health.detach();
    shutdown.request();
    drop(job);
    if let Err(err) = pod_watcher.stop() {
        error!(%err, "pod-directory watcher failed");
    }
    if watcher_thread.join().is_err() {
        error!("watcher thread panicked");
    }
    Ok(())
}

/// Starts the Job lifecycle when configured; the supervisor stops once it
/// has ended its pod's FUSE container (sidecar mode).
pub fn start_job_lifecycle(
    job: Option<&crate::job::JobConfig>,
    shutdown: &Shutdown,
) -> Result<Option<crate::job::JobLifecycle>, crate::job::JobError> {
    let Some(job) = job else { return Ok(None) };
    let done = shutdown.clone();
    crate::job::JobLifecycle::spawn(job.clone(), move || done.request()).map(Some)
}

fn spawn_watcher(
    mut watcher: Box<dyn MountWatcher>,
    events: Sender<Event>,
    priority: HealPriority,
) -> Result<JoinHandle<()>, SupervisorError> {
    std::thread::Builder::new()
        .name("watcher".into())
        .spawn(move || {
            // One wake-up per burst of changes (see MountWatcher), little work each.
            priority.raise();
            loop {
                // A burst of changes becomes one rescan: the watcher stays
                // disarmed from its report until the loop reads the table.
                let event = match watcher.wait() {
                    Ok(Wake::TableChanged) => Event::TableChanged(watcher.attached()),
                    Ok(Wake::Shutdown) => Event::Shutdown,
                    Err(err) => Event::WatchFailed(err),
                };
                let last = !matches!(event, Event::TableChanged(_));
                if events.send(event).is_err() || last {
                    return;
                }
            }
        })
        .map_err(|source| SupervisorError::Thread { name: "watcher", source })
}

struct Supervisor<E: Executor> {
    layout: Layout,
    journal: Journal,
    records: BTreeMap<PathBuf, TargetRecord>,
    reader: MountInfoReader,
    prober: Prober,
    executor: E,
    events: Sender<Event>,
    /// When the loop last woke for a table change: the heal latency of a
    /// target found dead on an unchanged source starts here.
    woke_at: Instant,
    /// When the last table read began.
    scan_started: Instant,
    /// Whether a read since the last scan took in a change no scan has seen.
    unscanned: bool,
    /// Each source's current connection and when a scan first saw it: the
    /// heal latency of targets left behind by a replacement starts there.
    /// By device, not mount ID: the kernel reuses a freed mount's ID at once.
    sources_seen_at: HashMap<PathBuf, (Dev, Instant)>,
    /// Sources whose probe overran, already reported.
    reported_overdue: BTreeSet<PathBuf>,
    /// Targets on an unrecorded connection whose probe is running.
    probing_targets: BTreeSet<PathBuf>,
    /// Targets on an unrecorded connection that a probe found dead.
    dead_targets: BTreeSet<PathBuf>,
    /// Table reads so far; a batch planned at read N is current while no
    /// other read happened and the table did not change since.
    table_reads: u64,
    /// The batch each running source probe was started for, and the read it
    /// was planned from: healed as it is if the table has not moved on.
    /// With it, the handles its heal takes before the first stack, taken
    /// while the probe waits for the daemon.
    probed_batches: BTreeMap<PathBuf, (u64, HealBatch, Prepared)>,
    /// None when restarts are not confirmed with the kubelet.
    confirmer: Option<Confirmer>,
    /// Whether the first scan is done: mounts seen in it were there before
    /// the supervisor, so when they appeared is unknown.
    scanned_once: bool,
    layouts: SourceLayouts,
    /// The `vol_data.json`s unmapped targets need.
    vol_data: VolDataCache,
    /// Whether the pod watcher runs; without it deleted pods are found by
    /// looking at their directories on each scan.
    pods_watched: bool,
    /// Pods with targets that neither a healthy observation nor a layout
    /// mapped at the last scan: a new vol_data.json of theirs is worth one.
    unmapped_pods: BTreeSet<String>,
    reporters: Reporters,
    /// Poll mode: every wake-up is a full scan, changed table or not.
    polling: bool,
    /// None when daemons are not watched (`--process-watch off`, `heal --once`).
    daemons: Option<Daemons>,
    /// Handles on the stale tops of targets whose daemon died.
    held: BTreeMap<PathBuf, degraded::Held>,
    /// The journal changed since the state file was last written: written
    /// when the loop has nothing else to do, so never before a heal.
    state_dirty: bool,
    /// None: saved on the loop (`heal --once`).
    state_writer: Option<StateWriter>,
    /// Open from a heal's probe to its end.
    heal_window: HealWindow,
    /// The table watcher's handle: re-armed after each report, paused for
    /// a heal's own changes. None without a watcher (`heal --once`).
    table_watch: Option<Arc<dyn Rearm>>,
}

struct Confirmer {
    asker: Asker,
    grace: Duration,
    /// Replaced sources by path.
    waiting: BTreeMap<PathBuf, Confirmation>,
}

impl Supervisor<MountExecutor> {
    fn new(
        config: &Config,
        reader: MountInfoReader,
        events: Sender<Event>,
        heal_activity: Arc<HealActivity>,
    ) -> Result<Self, SupervisorError> {
        let executor =
            MountExecutor::new(&config.kubelet_root, &config.staging_dir, config.heal_priority).map_err(|source| {
                SupervisorError::Open {
                    what: format!(
                        "kubelet root {} and staging mount {}",
                        config.kubelet_root.display(),
                        config.staging_dir.display()
                    ),
                    source,
                }
            })?;
        Ok(Supervisor {
            layout: Layout::new(&config.kubelet_root).with_pod_scope(config.pod_scope.as_deref()),
            journal: Journal::load_or_set_aside(&config.state_dir),
            records: BTreeMap::new(),
            reader,
            prober: Prober::new(config.probe_timeout, config.heal_priority),
            heal_window: HealWindow::new(config.heal_priority, heal_activity),
            executor,
            events,
            woke_at: Instant::now(),
            scan_started: Instant::now(),
            unscanned: false,
            sources_seen_at: HashMap::new(),
            reported_overdue: BTreeSet::new(),
            probing_targets: BTreeSet::new(),
            dead_targets: BTreeSet::new(),
            table_reads: 0,
            probed_batches: BTreeMap::new(),
            confirmer: None,
            scanned_once: false,
            layouts: config.layouts.clone(),
            vol_data: VolDataCache::new(config.kubelet_root.join("pods")),
            pods_watched: false,
            unmapped_pods: BTreeSet::new(),
            reporters: config.reporters.clone(),
            polling: matches!(config.watch, WatchMode::Poll { .. }),
            daemons: None,
            held: BTreeMap::new(),
            state_dirty: false,
            state_writer: None,
            table_watch: None,
        })
    }
}

impl<E: Executor> Supervisor<E> {
    fn serve(&mut self, inbox: &Receiver<Event>, shutdown: &Shutdown) {
        while !shutdown.requested() {
            let event = match inbox.try_recv() {
                Ok(event) => Ok(event),
                Err(TryRecvError::Disconnected) => Err(RecvTimeoutError::Disconnected),
                Err(TryRecvError::Empty) => {
                    // Nothing to do: the time for chores that must not
                    // delay a heal, unless a probe's answer (and its heal)
                    // is due any moment.
                    if !self.heal_imminent() {
                        // A seen death's new mount is expected for as long
                        // as its stale layers are held.
                        self.heal_window.close(!self.held.is_empty());
                        self.prober.keep_spare();
                        self.save_state();
                        // A scan of a large table frees megabytes scattered
                        // between long-lived allocations: give them back.
                        self.reader.release_buffer();
                        fuse_supervisor_sys::memory::release_free_memory();
                    }
                    // Deadlines exist only while something is wrong: an idle
                    // supervisor blocks on the channel with no timeout.
                    match self.next_deadline() {
                        None => inbox.recv().map_err(|_| RecvTimeoutError::Disconnected),
                        Some(at) => inbox.recv_timeout(at.saturating_duration_since(Instant::now())),
                    }
                }
            };
            match event {
                Ok(Event::TableChanged(attached)) => {
                    if let Some(Err(err)) = self.table_watch.as_ref().map(|watch| watch.rearm()) {
                        error!(?err, "mount-table watcher stopped");
                        return;
                    }
                    self.reporters.report(&Report::TableChanged);
                    // A change the loop made itself (a heal) was read by the
                    // scan that followed it: nothing new to see then. A
                    // failed check rescans.
                    // Poll mode scans on every tick, as polling healers do.
                    if self.polling || self.unscanned || self.reader.changed_since_read().unwrap_or(true) {
                        self.woke_at = Instant::now();
                        self.probe_announced_sources(&attached);
                        self.rescan();
                    }
                }
                Ok(Event::Probed(report)) => self.on_probe(report),
                Ok(Event::Kubelet(answer)) => self.on_kubelet(answer),
                Ok(Event::Pods(change)) => self.on_pods(change),
                Ok(Event::Daemon(event)) => self.on_daemon(event),
                Ok(Event::Ping(pong)) => pong.answer(),
                Ok(Event::WatchFailed(err)) => {
                    error!(?err, "mount-table watcher stopped");
                    return;
                }
                Ok(Event::Shutdown) | Err(RecvTimeoutError::Disconnected) => return,
                Err(RecvTimeoutError::Timeout) => self.on_deadline(),
            }
        }
    }

    /// Whether a probe started for a planned heal is still within its time:
    /// its answer starts the heal.
    fn heal_imminent(&self) -> bool {
        self.probed_batches.keys().any(|source| !self.reported_overdue.contains(source))
    }

    /// Writes the state file if the journal changed, through the writer
    /// thread when there is one.
    fn save_state(&mut self) {
        if !std::mem::take(&mut self.state_dirty) {
            return;
        }
        let saved = match &self.state_writer {
            Some(writer) => self.journal.save_with(writer),
            None => self.journal.save(),
        };
        if let Err(err) = saved {
            error!(%err, "cannot save state");
        }
    }

    /// The earliest retry or probe deadline still ahead; none while idle.
    fn next_deadline(&self) -> Option<Instant> {
        let now = Instant::now();
        let retries = self.records.values().filter_map(|record| match record.state {
            TargetState::Failed { retry_at, .. } => Some(retry_at),
            _ => None,
        });
        let probes =
            self.prober.deadlines().filter(|(source, _)| !self.reported_overdue.contains(*source)).map(|(_, at)| at);
        let confirmations =
            self.confirmer.iter().flat_map(|confirmer| confirmer.waiting.values().filter_map(|c| c.waiting.due_at()));
        retries.chain(probes).chain(confirmations).chain(self.degraded_deadline()).filter(|at| *at > now).min()
    }

    fn on_deadline(&mut self) {
        self.on_degraded_deadline();
        for source in self.prober.overdue() {
            // Handles on its targets' stale layers would keep their pods'
            // volumes busy for as long as the daemon does not answer.
            if let Some((_, _, prepared)) = self.probed_batches.get_mut(&source) {
                *prepared = Prepared::default();
            }
            if self.reported_overdue.insert(source.clone()) {
                warn!(source = %source.display(), "source does not answer; its heal waits until it does");
            }
        }
        self.rescan();
    }

    /// Reads and classifies the table; returns None (state kept) when the
    /// table cannot be read or parsed.
    fn read_table(&mut self) -> Option<Classified> {
        self.table_reads += 1;
        self.scan_started = Instant::now();
        // A read outside a scan (a daemon's death) may take in a change
        // whose report is still on its way: it must not look already seen.
        self.unscanned |= self.reader.changed_since_read().unwrap_or(true);
        let table = match self.reader.read() {
            Ok(table) => table,
            Err(err) => {
                error!(?err, "cannot read the mount table");
                return None;
            }
        };
        match Snapshot::parse(table) {
            Ok(snapshot) => {
                let mut classified = Classified::from_snapshot(snapshot, &self.layout);
                self.state_dirty |= plan::separate_source_binds(&mut classified, &self.layout, &mut self.journal);
                debug!(took_us = self.scan_started.elapsed().as_micros() as u64, "table read");
                Some(classified)
            }
            Err(err) => {
                error!(%err, "mount table did not parse; keeping the last known state");
                None
            }
        }
    }

    fn rescan(&mut self) {
        let Some(classified) = self.read_table() else { return };
        self.unscanned = false;
        self.report_propagated_heals(&classified);
        let mut changed = plan::learn(&classified, &self.layout, &mut self.journal);
        changed |= self.locate_unmapped(&classified);
        changed |= self.sight_sources(&classified);
        if !self.pods_watched {
            changed |= self.forget_deleted_pods();
        }
        let batches = plan::plan(&classified, &self.journal, &self.dead_targets);
        if let Some(confirmer) = &mut self.confirmer {
            confirmer.waiting.retain(|source, _| batches.iter().any(|batch| &batch.source.path == source));
        }
        // Probes first: each waits for a FUSE daemon's answer, and the
        // bookkeeping below is done while it does.
        let probing: Vec<bool> = batches.iter().map(|batch| self.confirmed(batch) && self.start_probe(batch)).collect();
        self.update_states(&classified);
        changed |= self.track_daemons(&classified);
        self.state_dirty |= changed;
        self.probe_unknown_targets(&classified);
        self.discover_daemons(&classified, &batches);
        debug!(
            mounts = classified.total_mounts,
            targets = classified.targets.len(),
            batches = batches.len(),
            "scanned"
        );
        for (batch, probing) in batches.into_iter().zip(probing) {
            if probing {
                let prepared = self.prepare_heal(&batch);
                self.probed_batches.insert(batch.source.path.clone(), (self.table_reads, batch, prepared));
            }
        }
        self.reporters.report(&Report::Scanned(&self.counts(&classified)));
    }

    fn counts(&self, classified: &Classified) -> ScanCounts {
        let mut counts =
            ScanCounts { mounts: classified.total_mounts, sources: classified.sources.len(), ..ScanCounts::default() };
        for path in classified.targets.keys() {
            match self.records.get(path).map(|record| &record.state) {
                None | Some(TargetState::Healthy | TargetState::Healed { .. }) => counts.healthy += 1,
                // A dead daemon's target is out like a broken one.
                Some(TargetState::Broken { .. } | TargetState::Degraded { .. }) => counts.broken += 1,
                Some(TargetState::Healing) => counts.healing += 1,
                Some(TargetState::Failed { .. }) => counts.failed += 1,
            }
        }
        counts
    }

    /// Notes the mount at every source path, and when a new one appeared.
    fn sight_sources(&mut self, classified: &Classified) -> bool {
        let now = self.scanned_once.then(SystemTime::now);
        self.scanned_once = true;
        let mut changed = false;
        self.sources_seen_at.retain(|path, _| classified.sources.contains_key(path));
        for (path, source) in &classified.sources {
            let dev = source.top().dev;
            if self.sources_seen_at.get(path).is_none_or(|(seen, _)| *seen != dev) {
                self.sources_seen_at.insert(path.clone(), (dev, self.scan_started));
            }
            changed |= self.journal.sight_source(path, source.top().mount_id, now);
        }
        changed | self.journal.forget_unused_sources(|path| classified.sources.contains_key(path))
    }

    /// Whether a batch may be healed now. A source replaced under its
    /// targets needs the kubelet to confirm that its owner restarted; a
    /// dead target on a healthy source needs no confirmation.
    fn confirmed(&mut self, batch: &HealBatch) -> bool {
        let Some(confirmer) = &mut self.confirmer else { return true };
        if batch.targets.iter().all(|target| self.dead_targets.contains(&target.path)) {
            return true;
        }
        let mount_id = batch.source.top().mount_id;
        let stuck_on = batch
            .targets
            .iter()
            .find_map(|target| self.journal.get(&target.path))
            .map_or(0, |mapping| mapping.source_mount_id);
        let source = &batch.source.path;
        let fresh = || Confirmation {
            mount_id,
            stuck_on,
            target_pods: batch
                .targets
                .iter()
                .filter(|target| target.kind != TargetKind::SourceBind)
                .map(|target| target.pod_uid.clone())
                .collect(),
            waiting: Waiting::Asking,
            attempts: 0,
            failing_since: None,
        };
        let confirmation = confirmer.waiting.entry(source.clone()).or_insert_with(fresh);
        if confirmation.mount_id != mount_id {
            *confirmation = fresh();
        }
        match confirmation.waiting {
            Waiting::Go => return true,
            Waiting::Asking if !confirmer.asker.in_flight() => {
                info!(source = %source.display(), "source replaced; asking the kubelet whether its owner restarted");
                confirmer.asker.ask();
            }
            waiting if waiting.due_at().is_some_and(|at| at <= Instant::now()) => {
                confirmation.waiting = Waiting::Asking;
                confirmer.asker.ask();
            }
            _ => {}
        }
        false
    }

    fn on_kubelet(&mut self, answer: Answer) {
        let Some(confirmer) = &mut self.confirmer else { return };
        confirmer.asker.answered();
        self.reporters.report(&Report::KubeletAnswered { result: answer.pods.as_ref().map(|_| ()), took: answer.took });
        let now = Instant::now();
        let mut confirmed = false;
        for (source, confirmation) in &mut confirmer.waiting {
            if confirmation.waiting != Waiting::Asking {
                continue;
            }
            confirmation.attempts += 1;
            let delay = recheck_delay(confirmation.attempts);
            let pods = match &answer.pods {
                Ok(pods) => pods,
                Err(err) if !err.is_retryable() => {
                    // A refusal or a TLS mismatch repeats until someone
                    // changes the configuration: waiting helps nobody.
                    warn!(source = %source.display(), %err, "kubelet cannot confirm; healing on mount evidence alone");
                    confirmation.waiting = Waiting::Go;
                    confirmed |= self.journal.confirm_owner(source, None);
                    continue;
                }
                Err(err) => {
                    let since = *confirmation.failing_since.get_or_insert(now);
                    if since.elapsed() >= confirmer.grace {
                        warn!(source = %source.display(), %err, grace_ms = confirmer.grace.as_millis() as u64, "kubelet failed for the whole grace; healing on mount evidence alone");
                        confirmation.waiting = Waiting::Go;
                        confirmed |= self.journal.confirm_owner(source, None);
                    } else {
                        warn!(source = %source.display(), %err, retry_in_ms = delay.as_millis() as u64, "kubelet cannot confirm the restart");
                        confirmation.waiting =
                            Waiting::Failing { retry_at: (now + delay).min(since + confirmer.grace) };
                    }
                    continue;
                }
            };
            confirmation.failing_since = None;
            let target_pods: Vec<&str> = confirmation.target_pods.iter().map(String::as_str).collect();
            let replaced_seen = self.journal.first_seen(source, confirmation.stuck_on);
            let known = self.journal.source(source).and_then(|record| record.owner.as_ref());
            match confirm::judge(pods, source, &target_pods, replaced_seen, known) {
                Verdict::Restarted(owner) => {
                    info!(
                        source = %source.display(),
                        pod = %format_args!("{}/{}", owner.namespace, owner.pod),
                        container = %owner.container,
                        container_id = owner.container_id.as_deref().unwrap_or(""),
                        kubelet_us = answer.took.as_micros() as u64,
                        "kubelet confirms the owner restarted"
                    );
                    confirmation.waiting = Waiting::Go;
                    self.reporters.report(&Report::DaemonRestarted { source, owner: &owner });
                    confirmed |= self.journal.confirm_owner(source, Some(owner));
                }
                Verdict::NoOwner => {
                    // The owner may be among the pods that could not be read.
                    info!(source = %source.display(), unreadable_pods = pods.skipped.len(), "no pod on this node owns the source; healing on mount evidence");
                    confirmation.waiting = Waiting::Go;
                    confirmed |= self.journal.confirm_owner(source, None);
                }
                Verdict::NotYet(owner) => {
                    let first = confirmation.attempts == 1;
                    if first {
                        info!(source = %source.display(), pod = %format_args!("{}/{}", owner.namespace, owner.pod), container = %owner.container, recheck_in_ms = delay.as_millis() as u64, "kubelet shows no restart of the owner yet; waiting");
                    } else {
                        debug!(source = %source.display(), recheck_in_ms = delay.as_millis() as u64, "owner not restarted yet");
                    }
                    confirmation.waiting = Waiting::NotYet { recheck_at: now + delay };
                }
            }
        }
        self.state_dirty |= confirmed;
        self.rescan();
    }

    /// A daemon that mounts over its stale mount heals root-level targets
    /// through the kernel's propagation, at the instant its mount appears:
    /// such a target is never seen broken, only on its source's new
    /// connection with the recorded one still underneath.
    fn report_propagated_heals(&self, classified: &Classified) {
        for (path, target) in &classified.targets {
            let Some(mapping) = self.journal.get(path) else { continue };
            let Some(source) = classified.sources.get(&mapping.source) else { continue };
            let top = target.stack.top();
            if top.dev != mapping.dev
                && top.dev == source.top().dev
                && target.stack.layers.iter().any(|layer| layer.dev == mapping.dev)
            {
                info!(
                    target = %path.display(),
                    pod = %target.pod_uid,
                    source = %mapping.source.display(),
                    stale_layers = target.stack.stale_layers().count(),
                    "healed by propagation"
                );
                // With a handle held on the covered layer, the report
                // follows its removal (flatten_covered).
                if self.held.contains_key(path) {
                    continue;
                }
                // This scan may be the first to see the source's new mount.
                let latency =
                    self.source_seen_at(&mapping.source, source.top().dev).unwrap_or(self.scan_started).elapsed();
                self.report_propagated(path, &target.pod_uid, &mapping.source, latency, 0);
            }
        }
    }

    /// A target stays in the work set until healed or its pod is gone.
    fn forget_deleted_pods(&mut self) -> bool {
        let pods = self.layout.pods_dir().to_path_buf();
        self.forget_targets(|uid| !pods.join(uid).exists())
    }

    fn forget_targets(&mut self, gone: impl Fn(&str) -> bool) -> bool {
        let records = &mut self.records;
        self.journal.retain(|target, mapping| {
            // A source's bind has no pod: it goes when it is unmounted.
            let keep = mapping.kind == TargetKind::SourceBind || !gone(&mapping.pod_uid);
            if !keep {
                info!(target = %target.display(), pod = %mapping.pod_uid, "pod deleted; forgetting target");
                records.remove(target);
            }
            keep
        })
    }

    fn forget_held(&mut self) {
        let journal = &self.journal;
        let gone: Vec<PathBuf> = self.held.keys().filter(|path| journal.get(path).is_none()).cloned().collect();
        for path in gone {
            self.release_held(&path);
        }
    }

    fn on_pods(&mut self, change: PodChange) {
        let forgot = match &change {
            PodChange::PodRemoved { uid } => self.forget_targets(|pod| pod == &**uid),
            PodChange::Resync(directory) => self.forget_targets(|pod| directory.pod(pod).is_none()),
            PodChange::VolDataInvalid { uid, name, error, .. } => {
                warn!(pod = %uid, volume = %name, %error, "vol_data.json unreadable; its layout cannot be used");
                false
            }
            PodChange::Failed(err) => {
                error!(%err, "pod-directory watcher stopped; deleted pods are now found on each scan");
                self.pods_watched = false;
                return;
            }
            _ => false,
        };
        // A vol_data.json may be what an unmapped target's layout needed;
        // pods without one (most, during a burst of pod creations) need no scan.
        let may_locate = match &change {
            PodChange::VolumeSeen { uid, vol_data: Some(_), .. } => self.unmapped_pods.contains(&**uid),
            PodChange::Resync(_) => !self.unmapped_pods.is_empty(),
            _ => false,
        };
        self.vol_data.apply(&change);
        if forgot {
            self.forget_held();
        }
        self.state_dirty |= forgot;
        if may_locate && self.scanned_once {
            self.rescan();
        }
    }

    /// Maps targets that no healthy observation mapped (a supervisor started
    /// after the crash) to the source their layout names. Such a target is
    /// judged by a probe: the mapping carries no connection of its own.
    fn locate_unmapped(&mut self, classified: &Classified) -> bool {
        if !self.pods_watched {
            // No changes arrive to keep what is known current.
            self.vol_data.clear();
        }
        let (located, unmapped_pods) =
            locate::locate_unmapped(classified, &self.journal, &self.layouts, &self.layout, &mut self.vol_data);
        let mut changed = false;
        for Located { target, mapping, layout } in located {
            info!(
                target = %target.display(),
                pod = %mapping.pod_uid,
                source = %mapping.source.display(),
                %layout,
                "source located by layout"
            );
            changed |= self.journal.record(&target, mapping);
        }
        self.vol_data.retain(&unmapped_pods);
        self.unmapped_pods = unmapped_pods;
        changed
    }

    /// Healthy targets have no record: on a large node nearly every target
    /// is healthy, and a record each would be most of the idle footprint.
    fn update_states(&mut self, classified: &Classified) {
        const HEALTHY: TargetState = TargetState::Healthy;
        // One line per kind of change, not per target: a source's restart
        // changes hundreds at once, in the scan that starts their heal.
        let mut transitions: BTreeMap<(&str, &str), (usize, &Path)> = BTreeMap::new();
        for (path, target) in &classified.targets {
            let mapping = self.journal.get(path);
            let assessment = plan::assess(target, mapping, classified);
            let current = self.records.get(path).map_or(&HEALTHY, |record| &record.state);
            let next = match (current, &assessment) {
                (_, Assessment::Unmanaged) => continue,
                // The daemon is dead and nothing replaced its mount yet.
                (TargetState::Degraded { since }, Assessment::Healthy | Assessment::SourceDown) => {
                    TargetState::Degraded { since: *since }
                }
                // A mount over the stale source reached it by propagation.
                (TargetState::Degraded { since }, Assessment::StaleLayers) => {
                    TargetState::Healed { outage: since.elapsed().ok() }
                }
                (TargetState::Degraded { since }, _) => TargetState::Broken { since: *since },
                // Healthy again without a heal of ours (propagation is
                // reported by report_propagated_heals).
                (TargetState::Broken { since }, Assessment::Healthy | Assessment::StaleLayers) => {
                    TargetState::Healed { outage: since.elapsed().ok() }
                }
                (_, Assessment::Healthy | Assessment::StaleLayers) => TargetState::Healthy,
                (TargetState::Broken { since }, _) => TargetState::Broken { since: *since },
                (TargetState::Failed { .. } | TargetState::Healing, _) => current.clone(),
                (_, _) => TargetState::Broken { since: SystemTime::now() },
            };
            if std::mem::discriminant(&next) != std::mem::discriminant(current) {
                debug!(
                    target = %path.display(),
                    pod = %target.pod_uid,
                    from = current.name(),
                    to = next.name(),
                    assessment = assessment.name(),
                    "target state"
                );
                let (targets, _) = transitions.entry((current.name(), next.name())).or_insert((0, path));
                *targets += 1;
            }
            if matches!(next, TargetState::Healthy) {
                self.records.remove(path);
                continue;
            }
            let record = self.records.entry(path.clone()).or_insert_with(|| TargetRecord::new(TargetState::Healthy));
            if let TargetState::Broken { since } = next
                && record.broken_since.is_none()
            {
                record.broken_since = Some(since);
                if let Some(mapping) = mapping {
                    self.reporters.report(&Report::TargetBroken(&TargetEvent {
                        target: path,
                        pod_uid: &target.pod_uid,
                        source: &mapping.source,
                        broken_since: Some(since),
                    }));
                }
            }
            record.state = next;
        }
        for ((from, to), (targets, first)) in transitions {
            info!(from, to, targets, first = %first.display(), "targets changed state");
        }
    }

    fn in_back_off(&self, target: &Path) -> bool {
        matches!(self.records.get(target), Some(TargetRecord { state: TargetState::Failed { retry_at, .. }, .. }) if *retry_at > Instant::now())
    }

    /// Whether a probe of the batch's source was started.
    fn start_probe(&mut self, batch: &HealBatch) -> bool {
        let source = &batch.source.path;
        let expected = batch.source.top().mount_id;
        if batch.targets.iter().all(|t| self.in_back_off(&t.path)) {
            debug!(source = %source.display(), "not probing: every target is backing off");
            return false;
        }
        if self.prober.in_flight_on(source, expected) {
            // Started when the watcher announced the mount: its answer heals this batch.
            return true;
        }
        if self.prober.in_flight(source) {
            debug!(source = %source.display(), "not probing: a probe of an earlier mount is in flight");
            return false;
        }
        let subdirs = batch
            .targets
            .iter()
            .filter(|t| !t.root_in_source.as_os_str().is_empty())
            .map(|t| t.root_in_source.clone())
            .collect();
        self.launch_probe(source, expected, subdirs)
    }

    /// Probes the mount `mount_id` at `source` if it is still the one there,
    /// opening `subdirs` below its root.
    fn launch_probe(&mut self, source: &Path, mount_id: u32, subdirs: BTreeSet<PathBuf>) -> bool {
        let opened = resolve::open_path(source).and_then(|fd| Ok((resolve::mount_id_of(fd.as_fd())?, fd)));
        let root = match opened {
            Ok((id, fd)) if id == mount_id => fd,
            Ok((id, _)) => {
                debug!(source = %source.display(), id, expected = mount_id, "source changed since it was seen");
                return false;
            }
            Err(err) => {
                warn!(source = %source.display(), ?err, "cannot open source");
                return false;
            }
        };
        debug!(source = %source.display(), mount_id, "probing source");
        self.heal_window.open();
        if let Err(err) =
            self.prober.start(source, mount_id, root, subdirs.into_iter().collect(), self.events.clone(), Event::Probed)
        {
            error!(source = %source.display(), ?err, "cannot start probe");
            return false;
        }
        true
    }

    /// Probes a FUSE mount the watcher saw appear at the path of a source
    /// whose recorded targets are on another connection, before the table is
    /// read: the new daemon's first answer (its FUSE_INIT) takes longer than
    /// the read, and the scan that plans the heal finds the probe under way
    /// ([`Self::start_probe`]). Anything else waits for the scan.
    fn probe_announced_sources(&mut self, attached: &[u64]) {
        for &unique_id in attached {
            // Gone again, or a kernel without statmount: the scan decides.
            let Ok(mount) = statmount::mount_summary(unique_id) else { continue };
            let source = mount.mount_point;
            if !is_fuse_type(&mount.fs_type)
                || self.layout.role(&source) != Role::Source
                || self.prober.in_flight(&source)
            {
                continue;
            }
            let dev = Dev::from(mount.dev);
            let mut stranded = false;
            let mut subdirs = BTreeSet::new();
            for (target, mapping) in self.journal.mappings() {
                if mapping.source == source && mapping.dev != dev && !self.in_back_off(target) {
                    stranded = true;
                    if !mapping.root_in_source.as_os_str().is_empty() {
                        subdirs.insert(mapping.root_in_source.clone());
                    }
                }
            }
            if stranded && self.launch_probe(&source, mount.mount_id, subdirs) {
                // The heal's latency runs from this wake-up, not from the scan.
                self.sources_seen_at.insert(source, (dev, self.woke_at));
            }
        }
    }

    /// A target on neither its source's connection nor the recorded one
    /// (an old state file, a bind made while the supervisor was away) is
    /// broken only if it is unreachable: probe it off-thread.
    fn probe_unknown_targets(&mut self, classified: &Classified) {
        self.dead_targets.retain(|path| classified.targets.contains_key(path));
        for (path, target) in &classified.targets {
            let assessment = plan::assess(target, self.journal.get(path), classified);
            if assessment != Assessment::Unknown {
                self.dead_targets.remove(path);
                continue;
            }
            if self.dead_targets.contains(path) || self.prober.in_flight(path) {
                continue;
            }
            let top = target.stack.top().mount_id;
            match self.executor.open_target(path) {
                Ok((fd, id)) if id == top => {
                    self.probing_targets.insert(path.clone());
                    if let Err(err) = self.prober.start(path, id, fd, Vec::new(), self.events.clone(), Event::Probed) {
                        self.probing_targets.remove(path);
                        error!(target = %path.display(), ?err, "cannot start probe");
                    }
                }
                Ok(_) => {} // Changed since the table was read; the next scan sees it.
                Err(err) => warn!(target = %path.display(), %err, "cannot open target to probe it"),
            }
        }
    }

    fn on_probe(&mut self, report: ProbeReport) {
        if self.probing_targets.remove(&report.source) {
            self.prober.finished(&report.source);
            match report.outcome {
                // ENOTCONN: what every access to a FUSE mount with a dead daemon returns.
                ProbeOutcome::Failed(err) if err.kind() == io::ErrorKind::NotConnected => {
                    info!(target = %report.source.display(), "target on an unrecorded connection is dead");
                    self.dead_targets.insert(report.source);
                    self.rescan();
                }
                ProbeOutcome::Failed(err) => {
                    warn!(target = %report.source.display(), %err, "target on an unrecorded connection fails; leaving it")
                }
                ProbeOutcome::Live(_) => {
                    warn!(target = %report.source.display(), "target is on a live connection of its own; leaving it")
                }
            }
            return;
        }
        debug!(source = %report.source.display(), live = matches!(report.outcome, ProbeOutcome::Live(_)), "probed");
        self.prober.finished(&report.source);
        let planned = self.probed_batches.remove(&report.source);
        self.reported_overdue.remove(&report.source);
        let handles = match report.outcome {
            ProbeOutcome::Live(handles) => handles,
            ProbeOutcome::Failed(err) => {
                warn!(source = %report.source.display(), %err, "source is not serving; waiting for it to be replaced");
                return;
            }
        };
        let (mut batch, prepared) = match planned {
            // Nothing read or changed since the scan that planned it: a
            // re-read would plan the same (and costs most of a small heal).
            Some((read, batch, prepared))
                if read == self.table_reads
                    && batch.source.top().mount_id == report.mount_id
                    && !self.reader.changed_since_read().unwrap_or(true) =>
            {
                (batch, prepared)
            }
            // The table may have moved on while the probe ran: plan afresh.
            _ => {
                let Some(classified) = self.read_table() else { return };
                let Some(batch) = plan::plan(&classified, &self.journal, &self.dead_targets)
                    .into_iter()
                    .find(|batch| batch.source.path == report.source && batch.source.top().mount_id == report.mount_id)
                else {
                    return self.rescan();
                };
                // A probe started on the watcher's word alone runs before the
                // kubelet has confirmed anything; its answer alone heals nothing.
                if !self.confirmed(&batch) {
                    return;
                }
                let prepared = self.prepare_heal(&batch);
                (batch, prepared)
            }
        };
        // The pod of a target may have been deleted since it was planned
        // (the executor prepares again what no longer fits the batch).
        batch.targets.retain(|target| !self.in_back_off(&target.path) && self.journal.get(&target.path).is_some());
        self.heal(&batch, prepared, &handles, report.waited);
        self.rescan();
    }

    /// From the scan that first saw the source's current mount, for targets
    /// it left behind; from the wake-up, for targets found dead under a
    /// source that did not change.
    fn heal_latency(&self, batch: &HealBatch) -> Duration {
        let dead_target = batch.targets.iter().any(|target| self.dead_targets.contains(&target.path));
        let since = match self.source_seen_at(&batch.source.path, batch.source.top().dev) {
            Some(at) if !dead_target => at,
            _ => self.woke_at,
        };
        since.elapsed()
    }

    /// When a scan first saw the mount on connection `dev` at `source`;
    /// None if none has yet.
    fn source_seen_at(&self, source: &Path, dev: Dev) -> Option<Instant> {
        let (seen, at) = self.sources_seen_at.get(source)?;
        (*seen == dev).then_some(*at)
    }

    /// Reports a target healed by the kernel's propagation of a mount over
    /// its stale source, after `layers_removed` covered layers went.
    fn report_propagated(&self, target: &Path, pod_uid: &str, source: &Path, latency: Duration, layers_removed: usize) {
        let broken_since = self.records.get(target).and_then(|record| record.broken_since);
        let event = TargetEvent { target, pod_uid, source, broken_since };
        let outage = broken_since.and_then(|since| since.elapsed().ok());
        let heal = HealReport { how: Healed::Propagated, latency, source_wait: None, outage, layers_removed };
        self.reporters.report(&Report::TargetHealed { target: &event, heal: &heal });
    }

    /// Heals `batch` from the source whose probe waited `source_wait` for
    /// its answer.
    fn heal(
        &mut self,
        batch: &HealBatch,
        prepared: Prepared,
        handles: &crate::probe::SourceHandles,
        source_wait: Duration,
    ) {
        let span = info_span!("heal", source = %batch.source.path.display(), targets = batch.targets.len());
        let _entered = span.enter();
        for target in &batch.targets {
            if let Some(record) = self.records.get_mut(&target.path) {
                record.state = TargetState::Healing;
            }
        }
        // The heal's own changes need no report, and the rescan after it
        // reads what anyone else changed meanwhile.
        if let Some(Err(err)) = self.table_watch.as_ref().map(|watch| watch.pause()) {
            warn!(%err, "the heal's own mount changes will be reported");
        }
        let outcomes = self.executor.heal(batch, prepared, handles);
        if let Some(watch) = &self.table_watch {
            // Reported as one change, so that a rescan follows even if the
            // one after the heal cannot read the table.
            let resumed = watch.resume().map(|()| Event::TableChanged(Vec::new()));
            let _ = self.events.send(resumed.unwrap_or_else(Event::WatchFailed));
        }
        let latency = self.heal_latency(batch);
        // A probe started on the watcher's word may have begun before the
        // wake-up the latency runs from.
        let source_wait = source_wait.min(latency);
        let mut healed_any = false;
        for (target, outcome) in batch.targets.iter().zip(outcomes) {
            let record =
                self.records.entry(outcome.path.clone()).or_insert_with(|| TargetRecord::new(TargetState::Healing));
            let event = TargetEvent {
                target: &outcome.path,
                pod_uid: &target.pod_uid,
                source: &batch.source.path,
                broken_since: record.broken_since,
            };
            match outcome.result {
                Ok(how) => {
                    let outage = record.broken_since.and_then(|since| since.elapsed().ok());
                    info!(
                        target = %outcome.path.display(),
                        pod = %target.pod_uid,
                        how = match how { Healed::Stacked => "stacked", Healed::Propagated => "propagated" },
                        layers_removed = outcome.layers_removed,
                        latency_us = latency.as_micros() as u64,
                        source_wait_us = source_wait.as_micros() as u64,
                        outage_ms = outage.map(|outage| outage.as_millis() as u64),
                        "healed"
                    );
                    if let Some(err) = outcome.flatten_error {
                        warn!(target = %outcome.path.display(), err = %err, "healed, but stale layers remain");
                    }
                    let heal = HealReport {
                        how,
                        latency,
                        source_wait: Some(source_wait),
                        outage,
                        layers_removed: outcome.layers_removed,
                    };
                    self.reporters.report(&Report::TargetHealed { target: &event, heal: &heal });
                    record.state = TargetState::Healed { outage };
                    record.attempts = 0;
                    record.broken_since = None;
                    healed_any = true;
                    self.dead_targets.remove(&outcome.path);
                    self.held.remove(&outcome.path);
                    // The target is now on the source's current mount: record
                    // it at once, since the daemon may die again before the
                    // next scan could learn it from the peer groups.
                    if let Some(mapping) = self.journal.get(&outcome.path) {
                        let source = batch.source.top();
                        let healed = Mapping {
                            source_mount_id: source.mount_id,
                            peer_group: source.peer_group,
                            dev: source.dev,
                            ..mapping.clone()
                        };
                        self.journal.record(&outcome.path, healed);
                    }
                }
                Err(err) => {
                    record.attempts += 1;
                    let delay = retry_delay(record.attempts);
                    // With its cause: the pod's Event says why (a subdirectory
                    // that is a symlink, a mount call the kernel refused).
                    let error = error_chain(&err);
                    warn!(target = %outcome.path.display(), pod = %target.pod_uid, err = %error, attempts = record.attempts, retry_in_ms = delay.as_millis() as u64, "heal failed");
                    self.reporters.report(&Report::HealFailed {
                        target: &event,
                        error: &error,
                        attempts: record.attempts,
                        retry_in: delay,
                    });
                    record.state =
                        TargetState::Failed { attempts: record.attempts, retry_at: Instant::now() + delay, error };
                }
            }
        }
        self.state_dirty |= healed_any;
    }
}

/// What `heal --once` did.
#[derive(Debug, Default)]
pub struct OnceSummary {
    pub planned: usize,
    pub healed: usize,
    pub failed: usize,
}

/// One scan: prints the plan to `out` and, unless `dry_run`, carries it
/// out. Like `run`, it moves the calling thread into the namespace.
pub fn heal_once(config: &Config, dry_run: bool, out: &mut dyn io::Write) -> Result<OnceSummary, SupervisorError> {
    ns::join_mount_namespace(&config.mount_namespace)
        .map_err(|source| SupervisorError::Namespace { path: config.mount_namespace.clone(), source })?;
    let reader = MountInfoReader::open(Path::new("/proc/thread-self/mountinfo"))
        .map_err(|source| SupervisorError::Open { what: "/proc/thread-self/mountinfo".into(), source })?;
    let (events, inbox) = mpsc::channel();
    let mut supervisor = Supervisor::new(config, reader, events, Arc::default())?;
    let mut summary = OnceSummary::default();
    let Some(classified) = supervisor.read_table() else { return Ok(summary) };
    // The read may have learned binds of sources too.
    if plan::learn(&classified, &supervisor.layout, &mut supervisor.journal) | supervisor.state_dirty {
        supervisor.journal.save()?;
    }
    let batches = plan::plan(&classified, &supervisor.journal, &BTreeSet::new());
    let _ = writeln!(
        out,
        "{} broken target(s) in {} source(s)",
        batches.iter().map(|b| b.targets.len()).sum::<usize>(),
        batches.len()
    );
    for batch in &batches {
        for target in &batch.targets {
            summary.planned += 1;
            let owner = match target.kind {
                TargetKind::SourceBind => "a bind of the source".to_owned(),
                _ => format!("pod {}", target.pod_uid),
            };
            let _ = writeln!(
                out,
                "  {} ({owner}) <- {}{}{}",
                target.path.display(),
                batch.source.path.display(),
                if target.root_in_source.as_os_str().is_empty() { "" } else { "/" },
                target.root_in_source.display()
            );
        }
    }
    if dry_run {
        return Ok(summary);
    }
    for batch in &batches {
        supervisor.start_probe(batch);
        let report = match inbox.recv_timeout(config.probe_timeout) {
            Ok(Event::Probed(report)) => report,
            _ => {
                let _ = writeln!(
                    out,
                    "source {} did not answer within {:?}; not healed",
                    batch.source.path.display(),
                    config.probe_timeout
                );
                summary.failed += batch.targets.len();
                continue;
            }
        };
        let ProbeOutcome::Live(handles) = report.outcome else {
            let _ = writeln!(out, "source {} is not serving; not healed", batch.source.path.display());
            summary.failed += batch.targets.len();
            continue;
        };
        for outcome in supervisor.executor.heal(batch, Prepared::default(), &handles) {
            match outcome.result {
                Ok(_) => {
                    summary.healed += 1;
                    let _ = writeln!(
                        out,
                        "healed {} ({} stale layer(s) removed)",
                        outcome.path.display(),
                        outcome.layers_removed
                    );
                }
                Err(err) => {
                    summary.failed += 1;
                    let _ = writeln!(out, "failed {}: {}", outcome.path.display(), error_chain(&err));
                }
            }
        }
    }
    if let Some(classified) = supervisor.read_table()
        && (plan::learn(&classified, &supervisor.layout, &mut supervisor.journal) | supervisor.state_dirty)
    {
        supervisor.journal.save()?;
    }
    Ok(summary)
}
