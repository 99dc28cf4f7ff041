//! Staging a volume again through its CSI driver once the driver is back
//! and its global mount is not (`run --restage <driver>`); for a driver
//! without a staging step, publishing it again at the pod's target.
//!
//! The loop hands over "the source at this path died on this connection"
//! ([`Restager::source_dead`]) and hears of the outcome by a message; all
//! the waiting and every gRPC call run on this module's thread, a tokio
//! runtime of its own in the watched mount namespace (where the records,
//! the driver's socket and the staging path are the host's paths). A driver
//! that hangs holds one task of that runtime, never the loop, and dropping
//! the [`Restager`] ends the runtime with its tasks: the agent's exit never
//! waits for a driver.
//!
//! One task per staging path, so calls for one volume are serialized. It
//! finds the volume's stage record, then waits for the driver's socket to
//! answer `Probe` (woken by inotify on the socket's directory: a restarted
//! node plugin binds its socket again), gives the driver the grace to stage
//! by itself, and only then, if the record is still there (the kubelet did
//! not unstage meanwhile), a pod not deleted nor terminating still uses the
//! volume and nothing live is mounted at the staging path, detaches the
//! dead mount there (lazily, only while it is still the dead connection's)
//! and calls `NodeStageVolume` with the recorded request, bytes as the
//! kubelet sent them. A refused call is retried with back-off for as long
//! as a pod needs the volume. The new mount is then healed by the loop as
//! any new source is.
//!
//! A driver without `STAGE_UNSTAGE_VOLUME` mounts its FUSE filesystem at
//! each pod's target in `NodePublishVolume`: there is no global mount, and
//! the kubelet's request has no staging path. This thread tells the loop
//! those targets (from the records, watched by inotify), and the loop takes
//! each as a source of its own; a dead one is published again the same
//! way, with the recorded `NodePublishVolume`, while its pod runs.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::os::fd::{AsFd as _, AsRawFd, RawFd};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fuse_supervisor_sys::inotify::{EventFlags, EventReader, Inotify, WatchFlags};
use fuse_supervisor_sys::{mount, ns, resolve};
use prost::Message as _;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch};
use tracing::{Instrument as _, debug, info, warn};

use super::api;
use super::records::{self, Call, Record, RecordError, Request, Secrets};
use super::unary;
use crate::errors::chain;
use crate::kube::Kubelet;
use crate::model::table::Dev;

const PROBE: &str = "/csi.v1.Identity/Probe";
const NODE_STAGE_VOLUME: &str = "/csi.v1.Node/NodeStageVolume";
const NODE_PUBLISH_VOLUME: &str = "/csi.v1.Node/NodePublishVolume";

/// How long a `Probe` may take: a driver that is up answers at once.
const PROBE_DEADLINE: Duration = Duration::from_secs(5);
/// Quick tries after the socket's directory changed: a driver binds its
/// socket before it listens, and answers `Probe` not ready while it starts.
const PROBE_RETRIES: [Duration; 8] = [
    Duration::from_millis(5),
    Duration::from_millis(10),
    Duration::from_millis(20),
    Duration::from_millis(50),
    Duration::from_millis(100),
    Duration::from_millis(200),
    Duration::from_millis(500),
    Duration::from_secs(1),
];
/// Back-off of a refused or failed `NodeStageVolume`: doubled from the
/// first to the last, then the last for as long as a pod needs the volume.
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);

/// What `run --restage` was asked.
#[derive(Debug, Clone)]
pub struct RestageConfig {
    /// The drivers whose volumes are staged again (`--restage`).
    pub drivers: BTreeSet<String>,
    /// Where the proxies record (`--csi-records`), a host path: records in
    /// it and in each directory in it (one per driver's proxy).
    pub records: PathBuf,
    /// Each driver's own socket where `--csi-socket` names it; the others
    /// at `<kubelet root>/plugins/<driver>/csi.sock`.
    pub sockets: BTreeMap<String, PathBuf>,
    pub kubelet_root: PathBuf,
    /// How long a driver back on its socket has to stage by itself.
    pub grace: Duration,
    /// The deadline of one `NodeStageVolume`.
    pub call_deadline: Duration,
}

impl RestageConfig {
    /// The driver's own socket, a host path.
    pub fn socket_of(&self, driver: &str) -> PathBuf {
        self.sockets
            .get(driver)
            .cloned()
            .unwrap_or_else(|| self.kubelet_root.join("plugins").join(driver).join("csi.sock"))
    }

    /// The driver a staging path is the kubelet's for
    /// (`plugins/kubernetes.io/csi/<driver>/<hash>/globalmount`).
    fn driver_of_staging_path(&self, path: &Path) -> Option<String> {
        let rest = path.strip_prefix(self.kubelet_root.join("plugins/kubernetes.io/csi")).ok()?;
        match rest.components().collect::<Vec<_>>().as_slice() {
            [Component::Normal(driver), Component::Normal(_), Component::Normal(last)] if *last == "globalmount" => {
                Some(driver.to_string_lossy().into_owned())
            }
            _ => None,
        }
    }
}

/// How one re-staging ended, or why it did not happen (yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestageResult {
    /// `NodeStageVolume` succeeded.
    Restaged,
    /// A live mount was at the staging path after the grace: the driver
    /// staged by itself; no call.
    ByDriver,
    /// The dead source is a `--restage` driver's staging path with no
    /// record: the proxy was not in front of the driver when it was staged.
    NoRecord,
    /// The kubelet unstaged the volume (its record went): no call.
    RecordRemoved,
    /// No pod uses the volume any more (deleted, or terminating): no call.
    NoPods,
    /// The driver refused the call; retried.
    Refused,
    /// The driver refused a request recorded without its secrets
    /// (`--record-secrets off`); retried, in case it needs none after all.
    NoSecrets,
    /// No answer (unreachable, or past the deadline); retried.
    Failed,
}

impl RestageResult {
    /// The `result` label of `restages_total`.
    pub fn label(self) -> &'static str {
        match self {
            RestageResult::Restaged => "restaged",
            RestageResult::ByDriver => "by_driver",
            RestageResult::NoRecord => "no_record",
            RestageResult::RecordRemoved => "record_removed",
            RestageResult::NoPods => "no_pods",
            RestageResult::Refused => "refused",
            RestageResult::NoSecrets => "no_secrets",
            RestageResult::Failed => "failed",
        }
    }

    /// Every label, for series exposed from the start.
    pub const LABELS: [&'static str; 8] =
        ["restaged", "by_driver", "no_record", "record_removed", "no_pods", "refused", "no_secrets", "failed"];

    /// Whether the pods are told with a Warning.
    pub fn is_warning(self) -> bool {
        matches!(
            self,
            RestageResult::NoRecord | RestageResult::Refused | RestageResult::NoSecrets | RestageResult::Failed
        )
    }
}

/// What the loop hears: the outcome of one re-staging (or one attempt).
/// Names the driver, volume and status code; never a request's content.
#[derive(Debug, Clone)]
pub struct RestageOutcome {
    pub driver: String,
    /// Empty when there was no record.
    pub volume_id: String,
    /// The call replayed: `NodeStageVolume` at a staging path, or, for a
    /// driver without a staging step, `NodePublishVolume` at a pod's target.
    pub call: Call,
    /// The staging path, or the target of a publish.
    pub path: PathBuf,
    /// The pods that use the volume, by UID.
    pub pods: Vec<String>,
    pub result: RestageResult,
    /// The call's duration, when one was made.
    pub took: Option<Duration>,
    /// The driver's status code of a refused call.
    pub code: Option<i32>,
    pub attempts: u32,
    /// When the next attempt comes, for a failed one.
    pub retry_in: Option<Duration>,
}

/// What the re-staging thread tells the loop.
#[derive(Debug, Clone)]
pub enum RestagerNews {
    /// How a re-staging (or an attempt) went.
    Outcome(RestageOutcome),
    /// The pod targets where `--restage` drivers without a staging step
    /// mount their FUSE filesystems themselves, as the records now say
    /// (sent at start and whenever it changes).
    DriverMounted(BTreeSet<PathBuf>),
}

/// A dead source handed over by the loop.
struct Dead {
    source: PathBuf,
    dev: Dev,
}

/// The loop's handle on the re-staging thread; dropping it ends the thread
/// and every call it was waiting on.
pub struct Restager {
    inbox: mpsc::UnboundedSender<Dead>,
}

impl Restager {
    /// Starts the thread, which joins `namespace` (the watched mount
    /// namespace) first. `kubelet`'s last `/pods` list, when there is
    /// one, tells terminating pods; `tell` hears every outcome and every
    /// change of the driver-mounted targets.
    pub fn spawn(
        config: RestageConfig,
        namespace: &Path,
        kubelet: Option<Kubelet>,
        tell: impl Fn(RestagerNews) + Send + Sync + 'static,
    ) -> io::Result<Restager> {
        let (inbox, deaths) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared { config, kubelet, tell: Box::new(tell) });
        let namespace = namespace.to_path_buf();
        std::thread::Builder::new()
            .name("restage".into())
            .spawn(move || {
                if let Err(err) = ns::join_mount_namespace(&namespace) {
                    warn!(namespace = %namespace.display(), err = %chain(&err), "cannot join the watched mount namespace; volumes are not staged again");
                    return;
                }
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(runtime) => runtime,
                    Err(err) => {
                        warn!(err = %chain(&err), "cannot start the re-staging runtime; volumes are not staged again");
                        return;
                    }
                };
                runtime.block_on(serve(shared, deaths));
                // Tasks still waiting on a driver are dropped with the runtime.
            })?;
        Ok(Restager { inbox })
    }

    /// The source at `source` died on connection `dev`: staged again if it
    /// is a `--restage` driver's recorded staging path. Returns at once.
    pub fn source_dead(&self, source: &Path, dev: Dev) {
        let _ = self.inbox.send(Dead { source: source.to_path_buf(), dev });
    }
}

struct Shared {
    config: RestageConfig,
    kubelet: Option<Kubelet>,
    tell: Box<dyn Fn(RestagerNews) + Send + Sync>,
}

impl Shared {
    fn outcome(&self, outcome: RestageOutcome) {
        (self.tell)(RestagerNews::Outcome(outcome));
    }
}

/// One task per staging path: a death while its task runs updates the
/// dead connection it looks for.
async fn serve(shared: Arc<Shared>, mut deaths: mpsc::UnboundedReceiver<Dead>) {
    let mut tasks: HashMap<PathBuf, watch::Sender<Dev>> = HashMap::new();
    tokio::spawn(watch_driver_mounted(Arc::clone(&shared)));
    // An agent started during an outage: a staging path (or a driver's own
    // target) whose dead mount was detached (by the agent before this one)
    // shows no source at all, so no death will be handed over for it. Its
    // record says it was mounted: with nothing there, it waits for its
    // driver too.
    for source in unmounted_at_start(&shared.config) {
        let (sender, dead) = watch::channel(NO_CONNECTION);
        tasks.insert(source.clone(), sender);
        tokio::spawn(restage(Arc::clone(&shared), source.clone(), dead).instrument(restage_span(&source)));
    }
    while let Some(Dead { source, dev }) = deaths.recv().await {
        tasks.retain(|_, task| !task.is_closed());
        // A task that ended since still has its sender here: a new one then.
        if tasks.get(&source).is_some_and(|task| task.send(dev).is_ok()) {
            continue;
        }
        let (sender, dead) = watch::channel(dev);
        tasks.insert(source.clone(), sender);
        tokio::spawn(restage(Arc::clone(&shared), source.clone(), dead).instrument(restage_span(&source)));
    }
}

/// The span of one staging path's re-stage: its lines read as one story.
fn restage_span(source: &Path) -> tracing::Span {
    tracing::info_span!("restage", path = %source.display())
}

/// The connection of a staging path found with nothing mounted: none is
/// dead there (no FUSE connection has device 0:0).
const NO_CONNECTION: Dev = Dev { major: 0, minor: 0 };

/// The recorded staging paths (and driver-mounted targets) of `--restage`
/// drivers with nothing mounted on them.
fn unmounted_at_start(config: &RestageConfig) -> Vec<PathBuf> {
    let read = match read_records(&config.records) {
        Ok(read) => read,
        Err(err) => {
            // No directory yet: no proxy has recorded anything.
            debug!(err = %chain(&err), "no CSI records at start");
            return Vec::new();
        }
    };
    read.iter()
        .filter(|record| record.request.mounts_at_path())
        .filter(|record| record.driver.as_ref().is_some_and(|driver| config.drivers.contains(driver)))
        .map(|record| PathBuf::from(record.request.path()))
        .filter(|path| matches!(at_path(path, NO_CONNECTION), Ok(AtPath::Unmounted)))
        .collect()
}

/// What is at a staging path, against the dead connection.
#[derive(Debug, PartialEq, Eq)]
enum AtPath {
    /// A directory with nothing mounted on it.
    Unmounted,
    /// The dead connection's mount, on top.
    Dead,
    /// Another mount: a live one the driver made.
    Mounted,
}

/// What the log says of one replayed call.
struct Said {
    waiting: &'static str,
    done: &'static str,
    failed: &'static str,
    undone: &'static str,
    no_pods: &'static str,
    by_driver: &'static str,
}

const STAGE_SAID: Said = Said {
    waiting: "waiting for the driver to stage the volume again",
    done: "volume staged again",
    failed: "cannot stage the volume again; retrying",
    undone: "the volume was unstaged: not staged again",
    no_pods: "no running pod uses the volume: not staged again",
    by_driver: "the driver staged the volume by itself: no call",
};

const PUBLISH_SAID: Said = Said {
    waiting: "waiting for the driver to publish the volume again",
    done: "volume published again",
    failed: "cannot publish the volume again; retrying",
    undone: "the volume was unpublished: not published again",
    no_pods: "its pod is gone or terminating: not published again",
    by_driver: "the driver published the volume by itself: no call",
};

/// Mounts the volume whose staging path (or driver-mounted target) is
/// `source` again, for as long as it needs it.
async fn restage(shared: Arc<Shared>, source: PathBuf, mut dead: watch::Receiver<Dev>) {
    let config = &shared.config;
    let record = match record_at(&config.records, &source) {
        Ok(Some(record)) => record,
        Ok(None) => {
            // A `--restage` driver's staging path with no record: say so.
            if let Some(driver) =
                config.driver_of_staging_path(&source).filter(|driver| config.drivers.contains(driver))
            {
                warn!(driver, staging_path = %source.display(), "no record of this staging: the volume cannot be staged again (was the CSI proxy in front of the driver when it was staged?)");
                // The loop names the pods: the targets it knows on the source.
                let outcome = outcome(&driver, "", Call::NodeStageVolume, &source, Vec::new(), RestageResult::NoRecord);
                shared.outcome(outcome);
            }
            return;
        }
        Err(err) => {
            warn!(path = %source.display(), err = %chain(&err), "cannot read the CSI records");
            return;
        }
    };
    let Some(driver) = record.driver.clone().filter(|driver| config.drivers.contains(driver)) else {
        debug!(path = %source.display(), driver = ?record.driver, "not a --restage driver's volume");
        return;
    };
    let call = record.request.call();
    let (method, said) = match call {
        Call::NodeStageVolume => (NODE_STAGE_VOLUME, &STAGE_SAID),
        Call::NodePublishVolume => (NODE_PUBLISH_VOLUME, &PUBLISH_SAID),
    };
    let volume_id = record.request.volume_id().to_owned();
    let socket = config.socket_of(&driver);
    let told = |pods, result| outcome(&driver, &volume_id, call, &source, pods, result);
    let mut attempts = 0u32;
    let mut retry_in = RETRY_FIRST;
    loop {
        info!(driver, volume_id, path = %source.display(), socket = %socket.display(), "{}", said.waiting);
        wait_for_driver(&socket).await;
        info!(driver, volume_id, socket = %socket.display(), "the driver answers again");
        tokio::time::sleep(config.grace).await;
        // The kubelet may have unstaged (unpublished) the volume meanwhile.
        let record = match records::read_one(&record.file) {
            Ok(record) => record,
            Err(RecordError::Read { source: err, .. }) if err.kind() == io::ErrorKind::NotFound => {
                info!(driver, volume_id, path = %source.display(), "{}", said.undone);
                shared.outcome(told(Vec::new(), RestageResult::RecordRemoved));
                return;
            }
            Err(err) => {
                warn!(driver, volume_id, err = %chain(&err), "cannot read the record again");
                return;
            }
        };
        let pods = pods_of(&shared, &record);
        if pods.is_empty() {
            info!(driver, volume_id, path = %source.display(), "{}", said.no_pods);
            shared.outcome(told(pods, RestageResult::NoPods));
            return;
        }
        let dev = *dead.borrow_and_update();
        match at_path(&source, dev) {
            Ok(AtPath::Mounted) => {
                info!(driver, volume_id, path = %source.display(), "{}", said.by_driver);
                shared.outcome(told(pods, RestageResult::ByDriver));
                return;
            }
            Ok(AtPath::Dead) => match detach_dead(&source, dev) {
                Ok(detached) => debug!(path = %source.display(), detached, "dead mount detached"),
                Err(err) => warn!(path = %source.display(), err = %chain(&err), "cannot detach the dead mount"),
            },
            Ok(AtPath::Unmounted) => {}
            Err(err) => warn!(path = %source.display(), err = %chain(&err), "cannot look at the path"),
        }
        attempts += 1;
        let started = Instant::now();
        let called = unary::call(&socket, method, &record.request_bytes, config.call_deadline).await;
        let took = started.elapsed();
        let result = match &called {
            Ok(_) => RestageResult::Restaged,
            Err(err) if err.code().is_some() && record.secrets == Secrets::Omitted => RestageResult::NoSecrets,
            Err(err) if err.code().is_some() && !err.unreachable() => RestageResult::Refused,
            Err(_) => RestageResult::Failed,
        };
        let mut reported = told(pods, result);
        reported.took = Some(took);
        reported.attempts = attempts;
        match called {
            Ok(_) => {
                info!(driver, volume_id, path = %source.display(), took_us = took.as_micros() as u64, attempts, "{}", said.done);
                shared.outcome(reported);
                // The new mount's daemon died already (its death came to
                // this task): once more.
                if dead.has_changed().unwrap_or(false) {
                    continue;
                }
                return;
            }
            Err(err) => {
                reported.code = err.code();
                reported.retry_in = Some(retry_in);
                warn!(driver, volume_id, path = %source.display(), took_us = took.as_micros() as u64, attempts, err = %chain(&err), retry_in_ms = retry_in.as_millis() as u64, "{}", said.failed);
                shared.outcome(reported);
            }
        }
        tokio::time::sleep(retry_in).await;
        retry_in = (retry_in * 2).min(RETRY_MAX);
    }
}

fn outcome(
    driver: &str,
    volume_id: &str,
    call: Call,
    path: &Path,
    pods: Vec<String>,
    result: RestageResult,
) -> RestageOutcome {
    RestageOutcome {
        driver: driver.to_owned(),
        volume_id: volume_id.to_owned(),
        call,
        path: path.to_path_buf(),
        pods,
        result,
        took: None,
        code: None,
        attempts: 0,
        retry_in: None,
    }
}

/// The record whose replay mounts the volume at `source`, if any.
fn record_at(dir: &Path, source: &Path) -> Result<Option<Record>, RecordError> {
    Ok(read_records(dir)?
        .into_iter()
        .find(|record| record.request.mounts_at_path() && Path::new(record.request.path()) == source))
}

/// Tells the loop the driver-mounted targets at start and after every
/// change of the records: an inotify watch on the record directory and on
/// each directory in it (one per proxy), or on its nearest existing
/// ancestor until it is made. A record written or removed is read alone;
/// the whole directory only at start, when a directory comes or goes, or
/// after the queue overflowed. No timer runs.
async fn watch_driver_mounted(shared: Arc<Shared>) {
    let config = &shared.config;
    let watcher = Inotify::new().and_then(|inotify| {
        // See `watch_socket_dir`: the AsyncFd owns what it registers.
        #[allow(deprecated, reason = "the AsyncFd owns the descriptor it registers")]
        AsyncFd::new(Watcher(inotify))
    });
    let watcher = match watcher {
        Ok(watcher) => watcher,
        Err(err) => {
            warn!(records = %config.records.display(), err = %chain(&err), "cannot watch the CSI records; volumes of drivers without a staging step are not published again");
            return;
        }
    };
    let mut records = RecordWatch::default();
    let mut reader = EventReader::default();
    let mut known: Option<BTreeSet<PathBuf>> = None;
    let mut whole = true;
    loop {
        if std::mem::take(&mut whole) {
            records.read_whole(&watcher.get_ref().0, config);
        }
        let now: BTreeSet<PathBuf> = records.mounted.values().cloned().collect();
        if known.as_ref() != Some(&now) {
            debug!(targets = now.len(), "driver-mounted targets");
            (shared.tell)(RestagerNews::DriverMounted(now.clone()));
            known = Some(now);
        }
        let mut ready = match watcher.readable().await {
            Ok(ready) => ready,
            Err(err) => {
                warn!(records = %config.records.display(), err = %chain(&err), "cannot wait on the CSI records");
                return;
            }
        };
        let mut changed = Vec::new();
        let drained = reader.drain(&watcher.get_ref().0, |event| {
            match records.file_of(&event) {
                Some(file) => changed.push(file),
                None => whole = true,
            }
            std::ops::ControlFlow::Continue(())
        });
        ready.clear_ready();
        whole |= drained.is_err();
        if !whole {
            for file in changed {
                records.read_one(file, config);
            }
        }
    }
}

/// The watched record directories and the driver-mounted targets their
/// records name.
#[derive(Default)]
struct RecordWatch {
    /// Each watched record directory by its watch.
    dirs: HashMap<i32, PathBuf>,
    /// The watch on an ancestor while the record directory is not there.
    ancestor: Option<i32>,
    /// Record file → the target its publish mounts at.
    mounted: BTreeMap<PathBuf, PathBuf>,
}

impl RecordWatch {
    const FLAGS: WatchFlags = WatchFlags::CREATE
        .union(WatchFlags::DELETE)
        .union(WatchFlags::MOVED_TO)
        .union(WatchFlags::MOVED_FROM)
        .union(WatchFlags::DELETE_SELF);

    /// Watches the record directory and each directory in it, and reads
    /// every record.
    fn read_whole(&mut self, inotify: &Inotify, config: &RestageConfig) {
        let dir = &config.records;
        self.dirs.clear();
        match inotify.watch_dir(dir, Self::FLAGS) {
            Ok(wd) => {
                self.dirs.insert(wd, dir.clone());
                if let Some(wd) = self.ancestor.take() {
                    let _ = inotify.unwatch(wd);
                }
                for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                    if entry.file_type().is_ok_and(|kind| kind.is_dir())
                        && let Ok(wd) = inotify.watch_dir(&entry.path(), Self::FLAGS)
                    {
                        self.dirs.insert(wd, entry.path());
                    }
                }
            }
            Err(_) if self.ancestor.is_none() => {
                self.ancestor =
                    dir.ancestors().skip(1).find_map(|above| inotify.watch_dir(above, WatchFlags::CREATE).ok());
            }
            Err(_) => {}
        }
        self.mounted = read_records(dir)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|record| Some((record.file.clone(), driver_mounted_target(&record, config)?)))
            .collect();
    }

    /// The record file an event is about; None when the whole directory
    /// must be read again (a directory came or went, the queue overflowed,
    /// the record directory itself may have been made).
    fn file_of(&self, event: &fuse_supervisor_sys::inotify::Event<'_>) -> Option<PathBuf> {
        let dir = self.dirs.get(&event.wd)?;
        if event.flags.intersects(EventFlags::ISDIR | EventFlags::DELETE_SELF | EventFlags::IGNORED) {
            return None;
        }
        Some(dir.join(event.name?))
    }

    /// Reads the record `file` again (gone, or a temporary file: no target).
    fn read_one(&mut self, file: PathBuf, config: &RestageConfig) {
        let target = match file.file_name().is_some_and(records::is_record_name) {
            true => records::read_one(&file).ok().and_then(|record| driver_mounted_target(&record, config)),
            false => None,
        };
        match target {
            Some(target) => self.mounted.insert(file, target),
            None => self.mounted.remove(&file),
        };
    }
}

/// The target a record's publish mounts at, for a `--restage` driver
/// without a staging step.
fn driver_mounted_target(record: &Record, config: &RestageConfig) -> Option<PathBuf> {
    let target = record.request.driver_mounted_target()?;
    config.drivers.contains(record.driver.as_ref()?).then(|| PathBuf::from(target))
}

/// Every record in `dir` and in the directories in it (`--csi-records`);
/// corrupt ones are logged and skipped.
pub fn read_records(dir: &Path) -> Result<Vec<Record>, RecordError> {
    let mut read = records::read_all(dir)?;
    let listing = std::fs::read_dir(dir).map_err(|source| RecordError::ReadDir { dir: dir.to_path_buf(), source })?;
    for entry in listing.flatten() {
        if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
            let inner = records::read_all(&entry.path())?;
            read.records.extend(inner.records);
            read.corrupt.extend(inner.corrupt);
        }
    }
    for err in &read.corrupt {
        warn!(err = %chain(err), "corrupt CSI record skipped");
    }
    Ok(read.records)
}

/// The pods that still use the volume of `record`: of a stage, each
/// recorded publish of it; of a publish, its own; each whose target is
/// still there, of a pod the kubelet's last `/pods` list (when there is
/// one) does not show terminating. The kubelet removes a target's
/// directory (`…/volumes/kubernetes.io~csi/<pv>`) with its pod.
fn pods_of(shared: &Shared, record: &Record) -> Vec<String> {
    let listed = shared.kubelet.as_ref().and_then(Kubelet::last_listed);
    let running = |publish: &api::NodePublishVolumeRequest| {
        let target = Path::new(&publish.target_path);
        let uid = pod_of_target(&shared.config.kubelet_root, target)?;
        // Its directory, not the target itself: a stat of a dead FUSE
        // mount fails with ENOTCONN.
        if !target.parent().is_some_and(Path::exists) {
            return None;
        }
        let terminating = listed
            .as_ref()
            .and_then(|listed| listed.pods.pod(&uid).map(|pod| pod.metadata.deletion_timestamp.is_some()))
            .unwrap_or(false);
        if terminating {
            debug!(pod = uid, volume_id = publish.volume_id, "pod terminating: it does not need the volume again");
            return None;
        }
        Some(uid)
    };
    let stage = match &record.request {
        Request::Publish(publish) => return running(publish).into_iter().collect(),
        Request::Stage(stage) => stage,
    };
    let Some(dir) = record.file.parent() else { return Vec::new() };
    let Ok(read) = records::read_all(dir) else { return Vec::new() };
    let pods: BTreeSet<String> = read
        .records
        .iter()
        .filter_map(|record| match &record.request {
            Request::Publish(publish)
                if publish.volume_id == stage.volume_id && publish.staging_target_path == stage.staging_target_path =>
            {
                running(publish)
            }
            _ => None,
        })
        .collect();
    pods.into_iter().collect()
}

/// `<kubelet root>/pods/<uid>/…` → `uid`.
fn pod_of_target(kubelet_root: &Path, target: &Path) -> Option<String> {
    match target.strip_prefix(kubelet_root.join("pods")).ok()?.components().next()? {
        Component::Normal(uid) => Some(uid.to_string_lossy().into_owned()),
        _ => None,
    }
}

/// What is mounted at `path`: compared with its parent's mount, and the
/// device of what is on top with the dead connection's.
fn at_path(path: &Path, dead: Dev) -> io::Result<AtPath> {
    let parent = path.parent().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no parent"))?;
    let parent = resolve::open_path(parent)?;
    let top = resolve::open_path(path)?;
    let (parent_mount, _) = resolve::mount_and_device_of(parent.as_fd())?;
    let (mount, device) = resolve::mount_and_device_of(top.as_fd())?;
    if mount == parent_mount {
        return Ok(AtPath::Unmounted);
    }
    Ok(match device.map(Dev::from) {
        Some(device) if device == dead => AtPath::Dead,
        _ => AtPath::Mounted,
    })
}

/// Detaches the top mount at `path` if it is still the dead connection's:
/// a driver mounting there at that moment keeps its mount, unless it
/// lands between the check and the detach (one syscall apart).
fn detach_dead(path: &Path, dead: Dev) -> io::Result<bool> {
    let top = resolve::open_path(path)?;
    let (_, device) = resolve::mount_and_device_of(top.as_fd())?;
    if device.map(Dev::from) != Some(dead) {
        return Ok(false);
    }
    mount::detach_top(top.as_fd())?;
    Ok(true)
}

/// The inotify descriptor as tokio needs it.
struct Watcher(Inotify);

impl AsRawFd for Watcher {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// Returns once the driver's socket answers `Probe` ready. Tries at once,
/// then after each change in the socket's directory (a few quick tries
/// each time: a socket is bound before it listens): no timer runs while
/// nothing changes there.
async fn wait_for_driver(socket: &Path) {
    let watcher = watch_socket_dir(socket);
    let mut reader = EventReader::default();
    loop {
        if probe_ready(socket).await {
            return;
        }
        let Some(watcher) = &watcher else {
            // No watch could be had (the directory is gone): a slow retry.
            tokio::time::sleep(RETRY_MAX).await;
            continue;
        };
        match watcher.readable().await {
            Ok(mut ready) => {
                let _ = reader.drain(&watcher.get_ref().0, |_| std::ops::ControlFlow::Continue(()));
                ready.clear_ready();
            }
            Err(err) => {
                warn!(socket = %socket.display(), err = %chain(&err), "cannot wait on the socket's directory");
                tokio::time::sleep(RETRY_MAX).await;
            }
        }
        for pause in PROBE_RETRIES {
            if probe_ready(socket).await {
                return;
            }
            tokio::time::sleep(pause).await;
        }
    }
}

/// An inotify watch on the socket's directory, or its nearest existing
/// ancestor (a directory made later is a change there).
fn watch_socket_dir(socket: &Path) -> Option<AsyncFd<Watcher>> {
    let inotify = Inotify::new().ok()?;
    let flags = WatchFlags::CREATE | WatchFlags::MOVED_TO | WatchFlags::ATTRIB | WatchFlags::CLOSE_WRITE;
    let mut dir = socket.parent();
    while let Some(at) = dir {
        if inotify.watch_dir(at, flags).is_ok() {
            // `register`, the replacement, is unsafe (forbidden outside
            // `sys/`) for the same reason `new` is deprecated: the fd must
            // outlive its registration. It does: the AsyncFd owns it.
            #[allow(deprecated, reason = "the AsyncFd owns the descriptor it registers")]
            return AsyncFd::new(Watcher(inotify)).ok();
        }
        dir = at.parent();
    }
    None
}

/// Whether the driver at `socket` answers `Probe` ready (a missing `ready`
/// is ready, as the CSI spec says).
async fn probe_ready(socket: &Path) -> bool {
    let request = api::ProbeRequest {}.encode_to_vec();
    match unary::call(socket, PROBE, &request, PROBE_DEADLINE).await {
        Ok(answer) => api::ProbeResponse::decode(answer).is_ok_and(|probe| probe.ready.unwrap_or(true)),
        Err(err) => {
            debug!(socket = %socket.display(), err = %chain(&err), "driver not answering yet");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> RestageConfig {
        RestageConfig {
            drivers: BTreeSet::from(["drv.example.com".to_owned()]),
            records: PathBuf::from("/run/records"),
            sockets: BTreeMap::from([("other".to_owned(), PathBuf::from("/plugins/other/driver.sock"))]),
            kubelet_root: PathBuf::from("/var/lib/kubelet"),
            grace: Duration::from_secs(1),
            call_deadline: Duration::from_secs(60),
        }
    }

    #[test]
    fn sockets_default_to_the_kubelet_plugin_directory() {
        let config = config();
        assert_eq!(config.socket_of("drv.example.com"), Path::new("/var/lib/kubelet/plugins/drv.example.com/csi.sock"));
        assert_eq!(config.socket_of("other"), Path::new("/plugins/other/driver.sock"));
    }

    #[test]
    fn a_staging_path_names_its_driver_and_a_target_its_pod() {
        let config = config();
        let staging = Path::new("/var/lib/kubelet/plugins/kubernetes.io/csi/drv.example.com/0a1b/globalmount");
        assert_eq!(config.driver_of_staging_path(staging).as_deref(), Some("drv.example.com"));
        assert_eq!(config.driver_of_staging_path(Path::new("/mnt/fuse")), None);
        assert_eq!(
            config.driver_of_staging_path(Path::new("/var/lib/kubelet/plugins/kubernetes.io/csi/drv/x/other")),
            None
        );
        let target = Path::new("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~csi/pv/mount");
        assert_eq!(pod_of_target(&config.kubelet_root, target).as_deref(), Some("uid-1"));
        assert_eq!(pod_of_target(&config.kubelet_root, Path::new("/elsewhere")), None);
    }

    #[test]
    fn results_have_distinct_labels_and_warnings_are_the_failures() {
        let results = [
            RestageResult::Restaged,
            RestageResult::ByDriver,
            RestageResult::NoRecord,
            RestageResult::RecordRemoved,
            RestageResult::NoPods,
            RestageResult::Refused,
            RestageResult::NoSecrets,
            RestageResult::Failed,
        ];
        let labels: Vec<&str> = results.iter().map(|result| result.label()).collect();
        assert_eq!(labels, RestageResult::LABELS);
        assert!(!RestageResult::Restaged.is_warning() && RestageResult::Refused.is_warning());
    }
}
