//! The supervisor loop: wakes on kernel events, reads the table, plans,
//! probes sources off-thread and heals.
//!
//! The loop thread joins the watched mount namespace and does all mounting
//! itself; nothing it does touches a FUSE filesystem (O_PATH opens and mount
//! calls never reach the daemon). Probes, which do, run on worker threads.
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::time::{Duration, Instant};

use tracing::{debug, error, warn};

use crate::supervisor::daemons::{DaemonEvent, DaemonWatch, Daemons};
use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::heal::priority::{HealPriority, HealWindow};
use fuse_supervisor_engine::heal::probe::{ProbeReport, Prober};
use fuse_supervisor_engine::heal::{Executor, Prepared};
use fuse_supervisor_engine::health::{Health, Pong};
use fuse_supervisor_engine::kube::Answer;
use fuse_supervisor_engine::kube::Kubelet;
use fuse_supervisor_engine::model::path_map::PathMap;
use fuse_supervisor_engine::model::source::{TableRead, TableSource};
use fuse_supervisor_engine::model::state::{Journal, StateError, StateWriter, TargetState};
use fuse_supervisor_engine::model::table::{Classified, Layout};
use fuse_supervisor_engine::plan::flapping::Flapping;
use fuse_supervisor_engine::plan::layout::SourceLayouts;
use fuse_supervisor_engine::plan::locate::VolDataCache;
use fuse_supervisor_engine::plan::{self, scan};
use fuse_supervisor_engine::report::{Report, Reporters};
use fuse_supervisor_engine::watch::mount_table::{Rearm, WatchMode};
use fuse_supervisor_engine::watch::pods::PodChange;

mod confirmation;
mod containers;
pub mod daemons;
mod degraded;
mod healing;
mod once;
mod probes;
mod restaging;
mod sources;
mod start;
mod tables;
mod targets;
#[cfg(test)]
mod tests;

use sources::Probed;

use confirmation::Confirmer;
pub use once::{OnceSummary, heal_once};
pub use start::{run, start_job_lifecycle};

use fuse_supervisor_engine::shutdown::Shutdown;
use targets::TargetRecord;

/// How long the handles a heal takes on its targets' stale tops while its
/// probe waits for the new daemon's first answer are kept. A held mount
/// cannot be unmounted: the plain `umount(2)` of a pod deleted meanwhile
/// fails with EBUSY, and the kubelet retries it only 500 ms later. A daemon
/// that takes longer to answer gains nothing from handles taken ahead: its
/// heal takes them when it answers.
const PREPARED_HOLD: Duration = Duration::from_millis(100);

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
    /// Of the heal path's threads (see [`fuse_supervisor_engine::heal::priority`]).
    pub heal_priority: HealPriority,
    /// How the containers holding a dead connection's mounts are found.
    pub container_namespaces: ContainerNamespaces,
    /// How long an isolation or a heal waits for each container's
    /// namespace before it gives that namespace up for this heal.
    pub container_deadline: Duration,
    /// Stage again, through their CSI driver, the recorded volumes of
    /// `--restage` drivers whose global mount died; None: off.
    pub restage: Option<fuse_supervisor_engine::csi::restage::RestageConfig>,
}

/// How the mount namespaces of containers are known (see
/// [`fuse_supervisor_engine::heal::namespaces`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContainerNamespaces {
    /// Kept by the process connector's exec and exit events after one walk
    /// at start; walks of `/proc` where the connector cannot be had.
    Events,
    /// A walk of `/proc` whenever they are needed: at a daemon's death and
    /// after each heal.
    Walk,
}

/// How restarts are confirmed with the kubelet.
#[derive(Debug, Clone)]
pub struct KubeletConfirmation {
    pub kubelet: Kubelet,
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
    #[error(
        "{call} is refused: healing needs setns and the new mount API (open_tree, move_mount, mount_setattr; Linux 5.12); run the supervisor with CAP_SYS_ADMIN and a seccomp profile that allows them (securityContext.seccompProfile type Unconfined, as deploy/daemonset.yaml has); nothing was mounted"
    )]
    Refused {
        call: &'static str,
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
    Watch(#[from] fuse_supervisor_engine::watch::mount_table::WatchError),
    #[error(transparent)]
    Kubelet(#[from] fuse_supervisor_engine::kube::KubeletError),
    #[error(transparent)]
    Pods(#[from] fuse_supervisor_engine::watch::pods::PodWatchError),
    #[error(transparent)]
    Job(#[from] crate::job::JobError),
    #[error(transparent)]
    Daemons(#[from] crate::supervisor::daemons::DaemonError),
    #[error("cannot start thread {name}")]
    Thread {
        name: &'static str,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Watcher(#[from] fuse_supervisor_engine::watch::thread::ThreadError),
}

enum Event {
    /// With the unique IDs of the mounts the change attached, where the
    /// watcher names them.
    TableChanged(Vec<u64>),
    Probed(ProbeReport),
    /// A probe of a target on a connection no mapping records answered.
    TargetProbed(ProbeReport),
    Kubelet(Answer),
    Pods(PodChange),
    Daemon(DaemonEvent),
    WatchFailed(fuse_supervisor_engine::watch::mount_table::WatchError),
    /// A mount changed in a namespace where a container heal was refused.
    NamespacesChanged,
    /// The worker of a namespace whose container heal was given up on ended.
    NamespaceFree(u64),
    /// A namespace learnt after a heal holds mounts of a connection it replaced.
    LateCopies(fuse_supervisor_engine::heal::namespaces::LateCopies),
    /// A liveness check (`/healthz`): answered at once.
    Ping(Pong),
    /// How a re-staging through a CSI driver went, or which targets CSI
    /// drivers mount themselves now.
    Restager(fuse_supervisor_engine::csi::restage::RestagerNews),
    Shutdown,
}

struct Supervisor<E: Executor> {
    layout: Layout,
    journal: Journal,
    /// Hashed on the paths' bytes, like the journal: a heal looks up each
    /// of its targets several times, and an ordered map's
    /// component-by-component path comparisons were a fifth of the loop's
    /// CPU at 10,000 targets.
    records: PathMap<TargetRecord>,
    /// The mount table of the watched namespace.
    reader: Box<dyn TableSource>,
    prober: Prober,
    executor: E,
    events: Sender<Event>,
    /// When the loop last woke for a table change: the heal latency of a
    /// target found dead on an unchanged source starts here.
    woke_at: Instant,
    /// When the deadlines were last handled ([`Self::on_deadline`]): one
    /// that passed since, while other events kept the loop busy, is due.
    deadlines_handled_at: Instant,
    /// When the last table read began.
    scan_started: Instant,
    /// Whether a read since the last scan took in a change no scan has seen.
    unscanned: bool,
    /// A table read happened since memory was last given back.
    read_since_trim: bool,
    /// A record per source path: its connection and when it was first
    /// seen, the probe it is in and the heal that waits for it.
    sources: sources::Sources,
    /// Table reads so far; a batch planned at read N is current while no
    /// other read happened and the table did not change since.
    table_reads: u64,
    /// None when restarts are not confirmed with the kubelet.
    confirmer: Option<Confirmer>,
    /// Its last `/pods` list names the containers healed in their own
    /// namespace; None with `--kubelet none`.
    kubelet: Option<Kubelet>,
    /// Where a container's process's cgroup is read: `/proc` but in tests.
    proc_root: PathBuf,
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
    /// Container heals that failed, waiting for their retry.
    container_retries: Vec<containers::ContainerRetry>,
    /// Container heals given up on (their namespace's worker late, or one
    /// still there), by namespace and mount ID: tried again once it ends.
    given_up: BTreeMap<u64, BTreeMap<u32, containers::ContainerRetry>>,
    /// Container heals the tenant refused, waiting for its next change.
    refusals: containers::Refusals,
    /// Heals per source, to tell a crash loop.
    flapping: Flapping,
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
    /// Stages dead CSI global mounts again off the loop; None: off.
    restager: Option<fuse_supervisor_engine::csi::restage::Restager>,
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
                        self.heal_window.close(self.restart_expected());
                        self.prober.keep_spare();
                        self.save_state();
                        // A scan of a large table frees megabytes scattered
                        // between long-lived allocations: give them back.
                        // Only after one: a trim costs page faults and TLB
                        // flushes, more than a wake for an unrelated mount.
                        if std::mem::take(&mut self.read_since_trim) {
                            self.reader.release_memory();
                        }
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
                        error!(err = %chain(&err), "mount-table watcher stopped");
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
                Ok(Event::TargetProbed(report)) => self.on_target_probe(report),
                Ok(Event::Kubelet(answer)) => self.on_kubelet(answer),
                Ok(Event::Pods(change)) => self.on_pods(change),
                Ok(Event::Daemon(event)) => self.on_daemon(event),
                Ok(Event::Ping(pong)) => pong.answer(),
                Ok(Event::Restager(news)) => self.on_restager(news),
                Ok(Event::NamespacesChanged) => self.retry_refused(),
                Ok(Event::NamespaceFree(namespace)) => self.retry_given_up(namespace),
                Ok(Event::LateCopies(late)) => self.heal_late_copies(late),
                Ok(Event::WatchFailed(err)) => {
                    error!(err = %chain(&err), "mount-table watcher stopped");
                    return;
                }
                Ok(Event::Shutdown) | Err(RecvTimeoutError::Disconnected) => return,
                Err(RecvTimeoutError::Timeout) => self.on_deadline(),
            }
            self.scan_unscanned();
        }
    }

    /// Scans a change that a read outside a scan took in. Such a read (the
    /// hold of a dead daemon's stale layers) applies the mount events
    /// waiting in the kernel's queue, so no report of them follows: a new
    /// mount made right at the death was in the table but never scanned,
    /// and its targets stayed on the dead connection (seen under load in
    /// the runc tier).
    fn scan_unscanned(&mut self) {
        if self.unscanned && !self.polling {
            self.woke_at = Instant::now();
            self.rescan();
        }
    }

    /// Whether a probe started for a planned heal is still within its time:
    /// its answer starts the heal.
    fn heal_imminent(&self) -> bool {
        self.sources.iter().any(|(_, record)| record.probed.is_some() && !record.overdue_reported)
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
            error!(err = %chain(&err), "cannot save state");
        }
    }

    /// The earliest retry or probe deadline not handled yet (it may have
    /// passed while other events were handled: then it is due at once);
    /// none while idle.
    fn next_deadline(&self) -> Option<Instant> {
        let handled = self.deadlines_handled_at;
        let retries = self.records.values().filter_map(|record| match record.state {
            TargetState::Failed { retry_at, .. } => Some(retry_at),
            _ => None,
        });
        let probes =
            self.prober.deadlines().filter(|(source, _)| !self.sources.overdue_reported(source)).map(|(_, at)| at);
        let confirmations = self.confirmer.as_ref().and_then(|confirmer| confirmer.confirmations.next_deadline());
        let container_retries = self.container_retries.iter().map(|retry| retry.retry_at);
        let holds = self
            .sources
            .iter()
            .filter(|(_, record)| record.probed.as_ref().is_some_and(|probed| !probed.prepared.is_empty()))
            .filter_map(|(source, _)| self.prober.will_have_waited(source, PREPARED_HOLD));
        retries
            .chain(probes)
            .chain(confirmations)
            .chain(holds)
            .chain(self.degraded_deadline())
            .chain(container_retries)
            .filter(|at| *at > handled)
            .min()
    }

    /// Whether a heal of `source` planned now may take its handles ahead:
    /// not once its probe has waited [`PREPARED_HOLD`] or overran its time.
    fn prepares_ahead(&self, source: &std::path::Path) -> bool {
        !self.sources.overdue_reported(source) && !self.prober.waited(source, PREPARED_HOLD)
    }

    fn on_deadline(&mut self) {
        self.deadlines_handled_at = Instant::now();
        self.on_degraded_deadline();
        self.retry_containers();
        let prober = &self.prober;
        self.sources.update_all(|source, record| {
            let Some(probed) = &mut record.probed else { return };
            if !probed.prepared.is_empty() && prober.waited(source, PREPARED_HOLD) {
                probed.prepared = Prepared::default();
                debug!(source = %source.display(), "the new daemon is slow to answer: its targets' handles are let go until it does");
            }
        });
        for source in self.prober.overdue() {
            let newly = self.sources.update(&source, |record| {
                // Handles on its targets' stale layers would keep their pods'
                // volumes busy for as long as the daemon does not answer.
                if let Some(probed) = &mut record.probed {
                    probed.prepared = Prepared::default();
                }
                !std::mem::replace(&mut record.overdue_reported, true)
            });
            if newly {
                warn!(source = %source.display(), "source does not answer; its heal waits until it does");
            }
        }
        self.rescan();
    }

    /// Reads and classifies the table; returns None (state kept) when the
    /// table cannot be read or parsed.
    fn read_table(&mut self) -> Option<Classified> {
        self.table_reads += 1;
        self.read_since_trim = true;
        self.scan_started = Instant::now();
        let read = self.reader.snapshot();
        for _ in 0..self.reader.take_lost_resyncs() {
            self.reporters.report(&Report::Resynced { watch: "mounts", reason: "overflow" });
        }
        match read {
            Ok(TableRead { snapshot, changed }) => {
                // A read outside a scan (a daemon's death) may take in a
                // change whose report is still on its way: it must not look
                // already seen. Told by the read itself: a change made
                // between a check and the read was missed when it was told
                // by the check (the other daemon's new mount, at its death).
                self.unscanned |= changed;
                let (classified, changed) = scan::classify(snapshot, &self.layout, &mut self.journal);
                self.state_dirty |= changed;
                debug!(took_us = self.scan_started.elapsed().as_micros() as u64, "table read");
                Some(classified)
            }
            Err(err) => {
                error!(err = %chain(&err), "cannot read the mount table; keeping the last known state");
                None
            }
        }
    }

    fn rescan(&mut self) {
        let Some(classified) = self.read_table() else { return };
        self.unscanned = false;
        self.report_propagated_heals(&classified);
        let mut changed = self.learn_and_locate(&classified);
        changed |= self.sight_sources(&classified);
        if !self.pods_watched {
            changed |= self.forget_deleted_pods();
        }
        let batches = plan::plan(&classified, &self.journal, &self.found_dead_targets());
        if let Some(confirmer) = &mut self.confirmer {
            confirmer.confirmations.retain(|source| batches.iter().any(|batch| batch.source.path == source));
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
                let prepared = match self.prepares_ahead(&batch.source.path) {
                    true => self.prepare_heal(&batch),
                    false => Prepared::default(),
                };
                let (source, read) = (batch.source.path.clone(), self.table_reads);
                self.sources.update(&source, |record| record.probed = Some(Probed { read, batch, prepared }));
            }
        }
        self.reporters.report(&Report::Scanned(&self.counts(&classified)));
    }
}
