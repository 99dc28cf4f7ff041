//! Sidecar mode without hostPID (`run --sidecar --sidecar-namespaces`): the
//! supervisor is a container of the pod, with `shareProcessNamespace`, and
//! sees the pod's processes but neither the node's mounts nor the kubelet
//! tree. Every container has a mount namespace of its own.
//!
//! - The live source is a FUSE mount served by a daemon in its own
//!   namespace (the FUSE container's).
//! - Targets are the FUSE mounts of the same filesystem (type and source)
//!   in the other containers' namespaces whose connection no process serves
//!   any more, confirmed dead by a probe off the loop: whole volumes and
//!   subPath binds alike (their mountinfo `root` says which subdirectory).
//! - A heal clones the live mount in the FUSE container's namespace and
//!   puts it in place of the dead one in the application container's
//!   ([`in_namespace`]).
//!
//! Event-driven: `EPOLLPRI` on every namespace's mountinfo (one epoll for
//! all of them, rather than a [`fuse_supervisor_engine::watch::mount_table::MountinfoWatcher`] thread per
//! container), daemon deaths from the pidfd watcher, and health pings. The
//! only timer runs while a target is dead with nothing to heal it from yet:
//! a FUSE container restarted with a new namespace mounts where no watched
//! table sees it, so the pod is rescanned on a backoff until it is back.
pub mod plan;
pub mod scan;

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant, SystemTime};

use tracing::{debug, info, warn};

use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::heal::Healed;
use fuse_supervisor_engine::heal::in_namespace::{
    self, HealNamespaces, InNamespaceError, InNamespaceHeal, InNamespaceHealed,
};
use fuse_supervisor_engine::health::{Health, Pong};
use fuse_supervisor_engine::report::{HealReport, Report, Reporters, TargetEvent};
use fuse_supervisor_engine::shutdown::Shutdown;
use fuse_supervisor_engine::watch::processes::fuse_server::FuseServerError;
use fuse_supervisor_engine::watch::processes::{PidfdWatcher, ProcessEvent, ProcessWatchError, ProcessWatcher};
use fuse_supervisor_engine::watch::thread::{Waiting, Waker, Woken};
use plan::SidecarPlan;

#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    #[error("cannot read {path}")]
    Proc {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot find the pod's FUSE daemons")]
    FuseServers(#[from] FuseServerError),
    #[error("cannot start the pidfd watcher for the pod's FUSE daemons")]
    ProcessWatch(#[source] ProcessWatchError),
    #[error("cannot set up epoll for the pod's mount tables")]
    Poll(#[source] io::Error),
    #[error("waiting for the pod's mount-table events failed")]
    Wait(#[source] io::Error),
}

/// What the sidecar loop needs.
#[derive(Debug, Clone)]
pub struct SidecarConfig {
    /// Where the pod's processes are: `/proc` of a container with
    /// `shareProcessNamespace`.
    pub proc_root: PathBuf,
    /// How long a dead-mount probe may take.
    pub probe_timeout: Duration,
    pub health: Arc<Health>,
    /// This pod's UID, which every report names.
    pub pod_uid: String,
    /// Metrics and Kubernetes Events. A target is named by its mount point
    /// in its container prefixed with the namespace (`mnt:[<inode>]/data`):
    /// the path alone means nothing outside that container.
    pub reporters: Reporters,
}

/// First and longest pause between rescans while a target waits for a
/// live mount (see the module docs).
const RESCAN_FIRST: Duration = Duration::from_millis(200);
const RESCAN_LONGEST: Duration = Duration::from_secs(5);

const INBOX: u64 = 1;

/// What other threads tell the loop.
enum Message {
    DaemonExited { pid: u32, at: Instant },
    WatchFailed(String),
    Ping(Pong),
}

/// The loop's view between scans.
struct Sidecar<'a> {
    config: &'a SidecarConfig,
    own_namespace: u64,
    waiting: Waiting,
    /// Open mountinfo of every namespace of the pod, registered under its id.
    tables: BTreeMap<u64, File>,
    daemons: PidfdWatcher,
    /// Each dead target's outage, by (namespace, mount ID).
    broken: BTreeMap<(u64, u32), Outage>,
    /// When each live source (namespace, mount ID) was first seen.
    sources_seen: BTreeMap<(u64, u32), Instant>,
    last_death: Option<Instant>,
    /// The next wait between rescans while something is left to heal.
    backoff: Duration,
}

/// One dead target, from its daemon's death (or its first sighting) on.
struct Outage {
    since: Instant,
    /// The same moment on the wall clock, for reports.
    since_wall: SystemTime,
    /// Whether TargetBroken went out (once the probe confirmed it dead).
    reported: bool,
    failed_attempts: u32,
}

/// Runs until `shutdown`. Mount work happens on short-lived threads; this
/// one never leaves its namespace.
pub fn run(config: &SidecarConfig, shutdown: &Shutdown) -> Result<(), SidecarError> {
    let own_path = Path::new("/proc/self/ns/mnt");
    let own_namespace =
        scan::namespace_id(own_path).map_err(|source| SidecarError::Proc { path: own_path.to_path_buf(), source })?;
    let waiting = Waiting::new(&shutdown.waker()).map_err(SidecarError::Poll)?;
    let inbox_waker = Arc::new(Waker::new().map_err(SidecarError::Poll)?);
    waiting.add_readable(inbox_waker.as_fd(), INBOX).map_err(SidecarError::Poll)?;
    let (send, inbox) = mpsc::channel();
    let (deaths, waker) = (send.clone(), Arc::clone(&inbox_waker));
    let daemons = PidfdWatcher::start(
        config.proc_root.clone(),
        Box::new(move |event| {
            let message = match event {
                ProcessEvent::Exited { pid, at, .. } => Message::DaemonExited { pid, at },
                ProcessEvent::Failed(err) => Message::WatchFailed(err.to_string()),
                ProcessEvent::Exec { .. } | ProcessEvent::Lost => return true,
            };
            // The loop is gone on shutdown; nothing to tell.
            let _ = deaths.send(message);
            let _ = waker.wake();
            true
        }),
    )
    .map_err(SidecarError::ProcessWatch)?;
    let waker = Arc::clone(&inbox_waker);
    config.health.attach(move |pong| {
        let sent = send.send(Message::Ping(pong)).is_ok();
        sent && waker.wake().is_ok()
    });
    let mut sidecar = Sidecar {
        config,
        own_namespace,
        waiting,
        tables: BTreeMap::new(),
        daemons,
        broken: BTreeMap::new(),
        sources_seen: BTreeMap::new(),
        last_death: None,
        backoff: RESCAN_FIRST,
    };
    let result = sidecar.serve(shutdown, &inbox, &inbox_waker);
    config.health.detach();
    result
}

impl Sidecar<'_> {
    fn serve(
        &mut self,
        shutdown: &Shutdown,
        inbox: &Receiver<Message>,
        inbox_waker: &Waker,
    ) -> Result<(), SidecarError> {
        let mut announced = false;
        let mut events = Vec::with_capacity(16);
        loop {
            let (settled, rescan_now) = self.rescan()?;
            if !announced {
                self.config.health.set_ready();
                info!(proc_root = %self.config.proc_root.display(), namespaces = self.tables.len(), "supervising");
                announced = true;
            }
            let timeout = match (rescan_now, settled) {
                (true, _) => Some(Duration::ZERO),
                (false, true) => {
                    self.backoff = RESCAN_FIRST;
                    None
                }
                (false, false) => {
                    let wait = self.backoff;
                    self.backoff = (self.backoff * 2).min(RESCAN_LONGEST);
                    Some(wait)
                }
            };
            events.clear();
            match self.waiting.wait(timeout).map_err(SidecarError::Wait)? {
                Woken::Stop => return Ok(()),
                Woken::Ready(ready) => events.extend_from_slice(ready),
            }
            if shutdown.requested() {
                return Ok(());
            }
            if events.contains(&INBOX) {
                // Drained before reading the channel: a message sent after
                // this wakes the next wait.
                if let Err(err) = inbox_waker.drain() {
                    warn!(err = %chain(&err), "cannot drain the sidecar inbox eventfd");
                }
                for message in inbox.try_iter() {
                    match message {
                        Message::Ping(pong) => pong.answer(),
                        Message::DaemonExited { pid, at } => {
                            info!(pid, "fuse daemon exited");
                            self.config.reporters.report(&Report::ProcessEvent { kind: "exited" });
                            self.last_death = Some(at);
                        }
                        Message::WatchFailed(err) => {
                            // Deaths are still found by the table events' rescans.
                            warn!(%err, "the fuse daemon watcher stopped");
                            self.config.reporters.report(&Report::ProcessEvent { kind: "failed" });
                        }
                    }
                }
            }
        }
    }

    /// Scans the pod, follows its namespaces and daemons, and heals what
    /// the scan calls for. Returns whether nothing is left waiting, and
    /// whether to scan again at once (a table registered after it was read).
    fn rescan(&mut self) -> Result<(bool, bool), SidecarError> {
        let scan = scan::scan(&self.config.proc_root, self.own_namespace)?;
        let registered = self.follow_tables(&scan.namespaces);
        for &daemon in &scan.daemons {
            match self.daemons.watch(daemon) {
                Ok(()) => {}
                // Exited since the scan: what it served is dead now, scan again.
                Err(ProcessWatchError::Gone { .. } | ProcessWatchError::Reused { .. }) => return Ok((false, true)),
                // Its death will not be seen as it happens; the heal still
                // follows the new daemon's mount.
                Err(err) => warn!(pid = daemon.pid, err = %chain(&err), "cannot watch a fuse daemon"),
            }
        }
        let plan = plan::plan(&scan.namespaces);
        self.note_broken(&plan);
        let settled = self.heal(&plan.heals) && plan.waiting.is_empty();
        Ok((settled, registered))
    }

    /// Watches the mount table of every namespace in `namespaces`, and no
    /// other. Returns whether one was added (its changes before the
    /// registration may be missing from the scan).
    fn follow_tables(&mut self, namespaces: &[plan::NamespaceView]) -> bool {
        let current: BTreeMap<u64, u32> = namespaces.iter().map(|namespace| (namespace.id, namespace.pid)).collect();
        self.tables.retain(|id, file| {
            let keep = current.contains_key(id);
            if !keep {
                // Closing the file unregisters it anyway.
                let _ = self.waiting.remove(file.as_fd());
            }
            keep
        });
        let mut added = false;
        for (&id, &pid) in &current {
            if self.tables.contains_key(&id) {
                continue;
            }
            let path = self.config.proc_root.join(pid.to_string()).join("mountinfo");
            let opened = File::open(&path).and_then(|file| self.waiting.add_priority(file.as_fd(), id).map(|()| file));
            match opened {
                Ok(file) => {
                    debug!(namespace = id, pid, "watching a container's mount table");
                    self.tables.insert(id, file);
                    added = true;
                }
                Err(err) => debug!(namespace = id, pid, err = %chain(&err), "cannot watch a container's mount table"),
            }
        }
        added
    }

    /// Records when each dead target was first seen, and logs it once;
    /// and when each live source was.
    fn note_broken(&mut self, plan: &SidecarPlan) {
        let now = Instant::now();
        let dead: Vec<(u64, &fuse_supervisor_engine::model::table::FuseMount)> = plan
            .heals
            .iter()
            .map(|heal| (heal.namespace, &heal.target))
            .chain(plan.waiting.iter().map(|(namespace, mount)| (*namespace, mount)))
            .collect();
        self.broken.retain(|key, _| dead.iter().any(|(namespace, mount)| *key == (*namespace, mount.mount_id)));
        for (namespace, mount) in dead {
            self.broken.entry((namespace, mount.mount_id)).or_insert_with(|| {
                warn!(namespace, target = %mount.mount_point.display(), dev = %mount.dev, "stale fuse mount in a container");
                let since = self.last_death.filter(|death| *death <= now).unwrap_or(now);
                let since_wall = SystemTime::now().checked_sub(now.duration_since(since)).unwrap_or_else(SystemTime::now);
                Outage { since, since_wall, reported: false, failed_attempts: 0 }
            });
        }
        let sources: Vec<(u64, u32)> =
            plan.heals.iter().map(|heal| (heal.source.namespace, heal.source.mount.mount_id)).collect();
        self.sources_seen.retain(|key, _| sources.contains(key));
        for source in sources {
            self.sources_seen.entry(source).or_insert(now);
        }
    }

    /// Confirms each planned target dead and heals it. Returns whether
    /// every one was healed.
    fn heal(&mut self, heals: &[InNamespaceHeal]) -> bool {
        if heals.is_empty() {
            return true;
        }
        let dead = scan::confirm_dead(&self.config.proc_root, heals, self.config.probe_timeout);
        let mut all = true;
        for (heal, dead) in heals.iter().zip(dead) {
            let target = heal.target.mount_point.display();
            if !dead {
                debug!(namespace = heal.namespace, %target, "not confirmed dead; retried later");
                all = false;
                continue;
            }
            let key = (heal.namespace, heal.target.mount_id);
            let (target_name, source_name) =
                (in_namespace(heal.namespace, &heal.target.mount_point), source_name(heal));
            let event = |outage: Option<&Outage>| TargetEvent {
                target: &target_name,
                pod_uid: &self.config.pod_uid,
                source: &source_name,
                broken_since: outage.map(|outage| outage.since_wall),
            };
            if let Some(outage) = self.broken.get_mut(&key).filter(|outage| !outage.reported) {
                outage.reported = true;
                self.config.reporters.report(&Report::TargetBroken(&event(Some(outage))));
            }
            let started = Instant::now();
            match self.heal_one(heal) {
                Ok(how) => {
                    let outage = self.broken.remove(&key);
                    let (how, kept, not_carried) = match how {
                        InNamespaceHealed::Replaced { not_carried } => ("replaced", None, not_carried),
                        InNamespaceHealed::Stacked { why, not_carried } => ("stacked", Some(why), not_carried),
                    };
                    for lost in &not_carried {
                        warn!(pid = heal.pid, namespace = heal.namespace, mount_point = %lost.mount_point.display(), why = %lost.why, "not carried over to the new mount by the heal");
                    }
                    info!(
                        pid = heal.pid,
                        namespace = heal.namespace,
                        %target,
                        source = %heal.source.mount.mount_point.display(),
                        subdir = %heal.subdir.display(),
                        how,
                        latency_us = started.elapsed().as_micros() as u64,
                        outage_ms = outage.as_ref().map(|outage| outage.since.elapsed().as_millis() as u64),
                        "healed"
                    );
                    // From when the heal became possible: the live source
                    // seen and the target seen dead, whichever came later.
                    let source_seen =
                        self.sources_seen.get(&(heal.source.namespace, heal.source.mount.mount_id)).copied();
                    let possible = source_seen
                        .into_iter()
                        .chain(outage.as_ref().map(|outage| outage.since))
                        .max()
                        .map_or(started, |at| at.min(started));
                    let report = HealReport {
                        how: Healed::Stacked,
                        latency: possible.elapsed(),
                        // No probe of the source preceded this heal.
                        source_wait: None,
                        outage: outage.as_ref().map(|outage| outage.since.elapsed()),
                        // Replaced: the dead layer was detached under the new one.
                        layers_removed: usize::from(kept.is_none()),
                    };
                    self.config
                        .reporters
                        .report(&Report::TargetHealed { target: &event(outage.as_ref()), heal: &report });
                    if let Some(err) = kept {
                        warn!(%target, err = %chain(&err), "healed, but the dead layer stays under the new mount");
                    }
                }
                Err(err) => {
                    warn!(pid = heal.pid, %target, err = %chain(&err), "heal failed; retried later");
                    let outage = self.broken.get_mut(&key);
                    let attempts = outage.map_or(1, |outage| {
                        outage.failed_attempts += 1;
                        outage.failed_attempts
                    });
                    let error = err.to_string();
                    let failed = Report::HealFailed {
                        target: &event(self.broken.get(&key)),
                        error: &error,
                        attempts,
                        retry_in: self.backoff,
                    };
                    self.config.reporters.report(&failed);
                    all = false;
                }
            }
        }
        all
    }

    /// One heal on a thread of its own, which moves between namespaces and
    /// then ends. It can block in a stopped FUSE daemon: given up after
    /// the probe timeout, and left behind.
    fn heal_one(&self, heal: &InNamespaceHeal) -> Result<InNamespaceHealed, InNamespaceError> {
        let namespaces = HealNamespaces::open(&self.config.proc_root, heal)?;
        let (reply, answer) = mpsc::sync_channel(1);
        let job = heal.clone();
        let spawned = std::thread::Builder::new().name("sidecar-heal".into()).spawn(move || {
            // The loop may have given up waiting.
            let _ = reply.send(in_namespace::heal_in_namespaces(&job, &namespaces, None, None, None, None));
        });
        let thread_error = |source| InNamespaceError::Mount {
            step: "run the heal thread",
            pid: heal.pid,
            path: heal.target.mount_point.clone(),
            source,
        };
        spawned.map_err(thread_error)?;
        answer
            .recv_timeout(self.config.probe_timeout)
            .map_err(|_| thread_error(io::Error::from(io::ErrorKind::TimedOut)))?
    }
}

/// A path as seen in the mount namespace `namespace`, for reports.
fn in_namespace(namespace: u64, path: &Path) -> PathBuf {
    PathBuf::from(format!("mnt:[{namespace}]{}", path.display()))
}

/// The live mount a heal clones, in the FUSE container's namespace.
fn source_name(heal: &InNamespaceHeal) -> PathBuf {
    in_namespace(heal.source.namespace, &heal.source.mount.mount_point.join(&heal.subdir))
}
