//! Staging a volume again through its CSI driver once the driver is back
//! and its global mount is not (`run --restage <driver>`).
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
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::os::fd::{AsFd as _, AsRawFd, RawFd};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fuse_supervisor_sys::inotify::{EventReader, Inotify, WatchFlags};
use fuse_supervisor_sys::{mount, ns, resolve};
use prost::Message as _;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch};
use tracing::{Instrument as _, debug, info, warn};

use super::api;
use super::records::{self, Record, RecordError, Request, Secrets};
use super::unary;
use crate::errors::chain;
use crate::kube::Kubelet;
use crate::model::table::Dev;

const PROBE: &str = "/csi.v1.Identity/Probe";
const NODE_STAGE_VOLUME: &str = "/csi.v1.Node/NodeStageVolume";

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
    pub staging_path: PathBuf,
    /// The pods that use the volume, by UID.
    pub pods: Vec<String>,
    pub result: RestageResult,
    /// The `NodeStageVolume` call's duration, when one was made.
    pub took: Option<Duration>,
    /// The driver's status code of a refused call.
    pub code: Option<i32>,
    pub attempts: u32,
    /// When the next attempt comes, for a failed one.
    pub retry_in: Option<Duration>,
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
    /// one, tells terminating pods; `outcome` hears every outcome.
    pub fn spawn(
        config: RestageConfig,
        namespace: &Path,
        kubelet: Option<Kubelet>,
        outcome: impl Fn(RestageOutcome) + Send + Sync + 'static,
    ) -> io::Result<Restager> {
        let (inbox, deaths) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared { config, kubelet, outcome: Box::new(outcome) });
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
    outcome: Box<dyn Fn(RestageOutcome) + Send + Sync>,
}

/// One task per staging path: a death while its task runs updates the
/// dead connection it looks for.
async fn serve(shared: Arc<Shared>, mut deaths: mpsc::UnboundedReceiver<Dead>) {
    let mut tasks: HashMap<PathBuf, watch::Sender<Dev>> = HashMap::new();
    // An agent started during an outage: a staging path whose dead mount
    // was detached (by the agent before this one) shows no source at all,
    // so no death will be handed over for it. Its record says it was
    // staged: with nothing mounted there, it waits for its driver too.
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
    tracing::info_span!("restage", staging_path = %source.display())
}

/// The connection of a staging path found with nothing mounted: none is
/// dead there (no FUSE connection has device 0:0).
const NO_CONNECTION: Dev = Dev { major: 0, minor: 0 };

/// The recorded staging paths of `--restage` drivers with nothing mounted
/// on them.
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
        .filter(|record| matches!(record.request, Request::Stage(_)))
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

/// Re-stages the volume whose staging path is `source`, for as long as it
/// needs it.
async fn restage(shared: Arc<Shared>, source: PathBuf, mut dead: watch::Receiver<Dev>) {
    let config = &shared.config;
    let record = match stage_record(&config.records, &source) {
        Ok(Some(record)) => record,
        Ok(None) => {
            // A `--restage` driver's staging path with no record: say so.
            if let Some(driver) =
                config.driver_of_staging_path(&source).filter(|driver| config.drivers.contains(driver))
            {
                warn!(driver, staging_path = %source.display(), "no record of this staging: the volume cannot be staged again (was the CSI proxy in front of the driver when it was staged?)");
                // The loop names the pods: the targets it knows on the source.
                (shared.outcome)(outcome(&driver, "", &source, Vec::new(), RestageResult::NoRecord));
            }
            return;
        }
        Err(err) => {
            warn!(staging_path = %source.display(), err = %chain(&err), "cannot read the CSI records");
            return;
        }
    };
    let Some(driver) = record.driver.clone().filter(|driver| config.drivers.contains(driver)) else {
        debug!(staging_path = %source.display(), driver = ?record.driver, "not a --restage driver's volume");
        return;
    };
    let volume_id = record.request.volume_id().to_owned();
    let socket = config.socket_of(&driver);
    let mut attempts = 0u32;
    let mut retry_in = RETRY_FIRST;
    loop {
        info!(driver, volume_id, staging_path = %source.display(), socket = %socket.display(), "waiting for the driver to stage the volume again");
        wait_for_driver(&socket).await;
        info!(driver, volume_id, socket = %socket.display(), "the driver answers again");
        tokio::time::sleep(config.grace).await;
        // The kubelet may have unstaged the volume meanwhile.
        let record = match records::read_one(&record.file) {
            Ok(record) => record,
            Err(RecordError::Read { source: err, .. }) if err.kind() == io::ErrorKind::NotFound => {
                info!(driver, volume_id, staging_path = %source.display(), "the volume was unstaged: not staged again");
                let outcome = outcome(&driver, &volume_id, &source, Vec::new(), RestageResult::RecordRemoved);
                (shared.outcome)(outcome);
                return;
            }
            Err(err) => {
                warn!(driver, volume_id, err = %chain(&err), "cannot read the stage record again");
                return;
            }
        };
        let pods = pods_of(&shared, &record);
        if pods.is_empty() {
            info!(driver, volume_id, staging_path = %source.display(), "no running pod uses the volume: not staged again");
            (shared.outcome)(outcome(&driver, &volume_id, &source, pods, RestageResult::NoPods));
            return;
        }
        let dev = *dead.borrow_and_update();
        match at_path(&source, dev) {
            Ok(AtPath::Mounted) => {
                info!(driver, volume_id, staging_path = %source.display(), "the driver staged the volume by itself: no call");
                (shared.outcome)(outcome(&driver, &volume_id, &source, pods, RestageResult::ByDriver));
                return;
            }
            Ok(AtPath::Dead) => match detach_dead(&source, dev) {
                Ok(detached) => debug!(staging_path = %source.display(), detached, "dead staging mount detached"),
                Err(err) => {
                    warn!(staging_path = %source.display(), err = %chain(&err), "cannot detach the dead staging mount")
                }
            },
            Ok(AtPath::Unmounted) => {}
            Err(err) => warn!(staging_path = %source.display(), err = %chain(&err), "cannot look at the staging path"),
        }
        attempts += 1;
        let started = Instant::now();
        let called = unary::call(&socket, NODE_STAGE_VOLUME, &record.request_bytes, config.call_deadline).await;
        let took = started.elapsed();
        let result = match &called {
            Ok(_) => RestageResult::Restaged,
            Err(err) if err.code().is_some() && record.secrets == Secrets::Omitted => RestageResult::NoSecrets,
            Err(err) if err.code().is_some() && !err.unreachable() => RestageResult::Refused,
            Err(_) => RestageResult::Failed,
        };
        let mut told = outcome(&driver, &volume_id, &source, pods, result);
        told.took = Some(took);
        told.attempts = attempts;
        match called {
            Ok(_) => {
                info!(driver, volume_id, staging_path = %source.display(), took_us = took.as_micros() as u64, attempts, "volume staged again");
                (shared.outcome)(told);
                // The new mount's daemon died already (its death came to
                // this task): once more.
                if dead.has_changed().unwrap_or(false) {
                    continue;
                }
                return;
            }
            Err(err) => {
                told.code = err.code();
                told.retry_in = Some(retry_in);
                warn!(driver, volume_id, staging_path = %source.display(), took_us = took.as_micros() as u64, attempts, err = %chain(&err), retry_in_ms = retry_in.as_millis() as u64, "cannot stage the volume again; retrying");
                (shared.outcome)(told);
            }
        }
        tokio::time::sleep(retry_in).await;
        retry_in = (retry_in * 2).min(RETRY_MAX);
    }
}

fn outcome(driver: &str, volume_id: &str, source: &Path, pods: Vec<String>, result: RestageResult) -> RestageOutcome {
    RestageOutcome {
        driver: driver.to_owned(),
        volume_id: volume_id.to_owned(),
        staging_path: source.to_path_buf(),
        pods,
        result,
        took: None,
        code: None,
        attempts: 0,
        retry_in: None,
    }
}

/// The stage record whose staging path is `source`, if any.
fn stage_record(dir: &Path, source: &Path) -> Result<Option<Record>, RecordError> {
    Ok(read_records(dir)?
        .into_iter()
        .find(|record| matches!(&record.request, Request::Stage(_)) && Path::new(record.request.path()) == source))
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

/// The pods that still use the volume of `stage`: each recorded publish of
/// it whose target is still there, of a pod the kubelet's last `/pods`
/// list (when there is one) does not show terminating. The kubelet removes
/// a target's directory (`…/volumes/kubernetes.io~csi/<pv>`) with its pod.
fn pods_of(shared: &Shared, stage: &Record) -> Vec<String> {
    let config = &shared.config;
    let Some(dir) = stage.file.parent() else { return Vec::new() };
    let Ok(read) = records::read_all(dir) else { return Vec::new() };
    let listed = shared.kubelet.as_ref().and_then(Kubelet::last_listed);
    let mut pods = BTreeSet::new();
    for record in &read.records {
        let Request::Publish(publish) = &record.request else { continue };
        if publish.volume_id != stage.request.volume_id() || publish.staging_target_path != stage.request.path() {
            continue;
        }
        let target = Path::new(&publish.target_path);
        let Some(uid) = pod_of_target(&config.kubelet_root, target) else { continue };
        // Its directory, not the target itself: a stat of a dead FUSE
        // mount fails with ENOTCONN.
        if !target.parent().is_some_and(Path::exists) {
            continue;
        }
        let terminating = listed
            .as_ref()
            .and_then(|listed| listed.pods.pod(&uid).map(|pod| pod.metadata.deletion_timestamp.is_some()))
            .unwrap_or(false);
        if terminating {
            debug!(
                pod = uid,
                volume_id = publish.volume_id,
                "pod terminating: it does not need the volume staged again"
            );
            continue;
        }
        pods.insert(uid);
    }
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
