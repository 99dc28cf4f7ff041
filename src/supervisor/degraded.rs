//! Daemon deaths in the loop: targets of a dead daemon's connection are
//! marked Degraded at once (the outage starts at the death, not when a new
//! mount appears), and the stale layer under each is held by an `O_PATH`
//! descriptor so that a new mount stacked over the stale source (which
//! covers it on every root-level target) does not leave it unreachable.
//! A death is retracted when the discovery that follows it finds another
//! process holding the connection: the targets are healthy again.
use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use tracing::{debug, error, info, info_span, warn};

use super::{Supervisor, TargetRecord};
use crate::supervisor::daemons::{Aborted, DaemonEvent, Daemons, Death, Retraction};
use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::heal::containers::{ContainerHealError, ForeignMount};
use fuse_supervisor_engine::heal::{Executor, Prepared};
use fuse_supervisor_engine::model::state::{DaemonDeath, TargetState};
use fuse_supervisor_engine::model::table::{Classified, Dev, path_order};
use fuse_supervisor_engine::plan::{self, Assessment, HealBatch, TargetHeal};
use fuse_supervisor_engine::report::{Report, TargetEvent};
use fuse_supervisor_engine::watch::processes::{Detection, ProcessEvent};

/// How long the stale layers of a dead daemon's targets are held. A held
/// layer cannot be unmounted (the kubelet's unmount of a deleted pod's
/// volume fails with EBUSY while it is held), so this bounds how long a
/// pod deletion can be held up; a daemon restarted by its pod comes back
/// well within it.
const HOLD_STALE_FOR: Duration = Duration::from_secs(30);

/// A handle on a target's stale top, taken when its daemon died.
#[derive(Debug)]
pub(super) struct Held {
    fd: OwnedFd,
    mount_id: u32,
    until: Instant,
}

/// `at` (a monotonic instant in the past) on the wall clock.
fn wall_clock(at: Instant) -> SystemTime {
    SystemTime::now().checked_sub(at.elapsed()).unwrap_or_else(SystemTime::now)
}

impl<E: Executor> Supervisor<E> {
    pub(super) fn on_daemon(&mut self, event: DaemonEvent) {
        let Some(daemons) = &mut self.daemons else { return };
        if let DaemonEvent::Process(process) = &event {
            let kind = match process {
                ProcessEvent::Exited { .. } => "exited",
                ProcessEvent::Exec { .. } => "exec",
                ProcessEvent::Lost => "lost",
                ProcessEvent::Failed(_) => "failed",
            };
            self.reporters.report(&Report::ProcessEvent { kind });
        }
        match event {
            DaemonEvent::Process(ProcessEvent::Exited { pid, status, at, detection }) => {
                let (deaths, partial) = daemons.exited(pid);
                for exit in &partial {
                    info!(
                        source = %exit.source.display(),
                        connection = %exit.dev,
                        pid,
                        ?status,
                        remaining = ?exit.remaining,
                        "a process serving the source exited; other processes still hold its connection"
                    );
                    if daemons.aborts() {
                        daemons.watch_orphan(exit, pid, at);
                    }
                }
                let detection = match detection {
                    Detection::Event => "event",
                    Detection::Resync => "resync",
                };
                for death in deaths {
                    self.daemon_died(&death.source, death.dev, pid, at, &format!("{status:?}"), detection);
                }
                if !partial.is_empty() {
                    self.on_degraded_deadline();
                }
            }
            DaemonEvent::Process(ProcessEvent::Exec { .. }) => daemons.exec_seen(),
            DaemonEvent::Process(ProcessEvent::Lost) => {
                warn!("process events were lost; looking for every daemon again");
                self.reporters.report(&Report::Resynced { watch: "processes", reason: "overflow" });
                daemons.rediscover_all();
            }
            DaemonEvent::Process(ProcessEvent::Failed(err)) => {
                error!(err = %chain(&err), "process watcher stopped; daemon deaths are now seen only when a new mount appears");
                self.daemons = None;
            }
            DaemonEvent::Discovered(found) => {
                let verdicts = daemons.discovered(found);
                for retraction in verdicts.retracted {
                    self.death_retracted(retraction);
                }
                for death in verdicts.confirmed {
                    self.death_confirmed(death);
                }
                for (source, dev) in verdicts.unheld {
                    self.probe_unheld(source, dev);
                }
            }
        }
    }

    /// The daemon of connection `dev` at `source` died before any search
    /// found it (a crash right after the daemon, or the supervisor,
    /// started): nobody holds the connection and its mount answers
    /// ENOTCONN. Taken as its death now, as if it had been watched.
    pub(super) fn died_unseen(&mut self, source: &Path, dev: Dev) {
        if !self.daemons.as_mut().is_some_and(|daemons| daemons.unheld_died(dev)) {
            return;
        }
        // No pid: the process was gone before it was looked for.
        self.daemon_died(source, dev, 0, Instant::now(), "exited before it was found", "search");
        self.death_confirmed(Death { source: source.to_path_buf(), dev });
    }

    /// Undoes [`Supervisor::daemon_died`] for a connection that another
    /// process still holds: its Degraded targets are healthy (they never
    /// stopped answering), the recorded death goes, the stale-layer handles
    /// are let go.
    fn death_retracted(&mut self, Retraction { source, dev, pids }: Retraction) {
        let mut restored = 0;
        for path in &self.targets_on(&source, dev) {
            self.release_held(path);
            let Some(pod_uid) = self.journal.get(path).map(|mapping| mapping.pod_uid.clone()) else { continue };
            // Only this death made a target Degraded; one broken since
            // (a later scan saw it otherwise) stays in its outage.
            let Some(record) = self.records.get(path) else { continue };
            let TargetState::Degraded { since } = record.state else { continue };
            debug!(target = %path.display(), pod = %pod_uid, from = "degraded", to = "healthy", "target state");
            // Healthy targets have no record.
            self.records.remove(path);
            restored += 1;
            let event = TargetEvent { target: path, pod_uid: &pod_uid, source: &source, broken_since: Some(since) };
            self.reporters.report(&Report::DeathRetracted { target: &event, pids: &pids });
        }
        self.state_dirty |= self.journal.retract_death(&source, dev);
        info!(
            source = %source.display(),
            connection = %dev,
            ?pids,
            targets = restored,
            "connection still served by another process; death retracted"
        );
    }

    /// A death that stands: nobody holds the connection, so the kernel has
    /// aborted it and no process can ever serve it again. With
    /// `--detach-dead-sources`, the daemon's own mount at the source goes:
    /// the daemon's restart mounts on a directory (a dead mount there makes
    /// some fail, and a mount over it would cover every target's stale
    /// layer), so the targets' stale layers need no handle any more, and a
    /// deleted pod's unmount of its target is never held up by one.
    fn death_confirmed(&mut self, Death { source, dev }: Death) {
        if !self.daemons.as_ref().is_some_and(Daemons::detaches_dead_sources) {
            return;
        }
        // Only the death still recorded: a verdict that comes after the new
        // mount was seen is about a connection already replaced (and whose
        // device number a new connection may have taken since).
        let recorded = self.journal.source(&source).and_then(|record| record.daemon_died);
        if recorded.is_none_or(|death| death.dev != dev) {
            debug!(source = %source.display(), connection = %dev, "death settled before its verdict; nothing to detach");
            return;
        }
        match self.executor.detach_dead_source(&source, dev) {
            Ok(true) => {
                let targets = self.targets_on(&source, dev);
                for path in &targets {
                    self.release_held(path);
                }
                info!(
                    source = %source.display(),
                    connection = %dev,
                    targets = targets.len(),
                    "dead source detached: its daemon can mount there again; its targets' stale layers are let go"
                );
                let owner = self.journal.source(&source).and_then(|record| record.owner.as_ref());
                self.reporters.report(&Report::DeadSourceDetached { source: &source, owner });
            }
            Ok(false) => {
                debug!(source = %source.display(), connection = %dev, "source no longer on the dead connection");
            }
            Err(err) => {
                warn!(source = %source.display(), connection = %dev, err = %chain(&err), "cannot detach the dead source; its targets' stale layers stay held");
            }
        }
    }

    /// The targets recorded on connection `dev` of `source`, in path order.
    fn targets_on(&self, source: &Path, dev: Dev) -> Vec<PathBuf> {
        let mut targets: Vec<PathBuf> = self
            .journal
            .mappings()
            .iter()
            .filter(|(_, mapping)| mapping.source == source && mapping.dev == dev)
            .map(|(path, _)| path.to_path_buf())
            .collect();
        targets.sort_unstable_by(|a, b| path_order(a, b));
        targets
    }

    /// Every target on the dead connection becomes Degraded, with the
    /// death as the start of its outage.
    fn daemon_died(&mut self, source: &Path, dev: Dev, pid: u32, at: Instant, status: &str, detection: &str) {
        let _span = info_span!("death", source = %source.display(), connection = %dev, pid).entered();
        self.heal_window.expect();
        let since = wall_clock(at);
        let targets = self.targets_on(source, dev);
        for path in &targets {
            let record = self.records.get_or_insert_with(path, || TargetRecord::new(TargetState::Healthy));
            // A target already broken, healing or failing is in an outage
            // that began earlier: it keeps its start.
            if !matches!(record.state, TargetState::Healthy | TargetState::Healed { .. }) {
                continue;
            }
            let Some(mapping) = self.journal.get(path) else { continue };
            debug!(target = %path.display(), pod = %mapping.pod_uid, from = record.state.name(), to = "degraded", "target state");
            record.state = TargetState::Degraded { since };
            record.broken_since = Some(since);
            self.reporters.report(&Report::TargetBroken(&TargetEvent {
                target: path,
                pod_uid: &mapping.pod_uid,
                source,
                broken_since: Some(since),
            }));
        }
        // First, before a new mount can cover them.
        self.hold_stale_layers(&targets, dev);
        // Then the containers' copies, before the host heal can propagate
        // onto them: copies of targets, so none without a target on the
        // connection, but for a pod's target a CSI driver mounts itself
        // (its containers' copies are of the source). A death with none
        // may even be another namespace's connection that got a number
        // this one had (a pod's own FUSE daemon, another sandbox in the
        // tests), whose live mounts in its containers must not be touched.
        if !targets.is_empty() || self.layout.is_driver_mounted(source) {
            self.isolate_containers(dev);
        }
        info!(
            source = %source.display(),
            connection = %dev,
            pid,
            status,
            detection,
            targets = targets.len(),
            marked_after_us = at.elapsed().as_micros() as u64,
            "daemon died; its targets are degraded"
        );
        self.reporters.report(&Report::DaemonDied { source, pid, at: since, targets: &targets });
        self.state_dirty |= self.journal.daemon_died(source, DaemonDeath { pid, at: since, dev });
        // A CSI driver's global mount: staged again once the driver is back.
        self.restage_if_recorded(source, dev);
    }

    /// Asks who serves each new source connection, once its targets are
    /// healed: the search reads every process's descriptors in /proc, and
    /// run beside a heal it doubled the heal's latency. A source still in
    /// `batches` keeps its previous connection's entry until then.
    pub(super) fn discover_daemons(&mut self, classified: &Classified, batches: &[HealBatch]) {
        let Some(daemons) = &mut self.daemons else { return };
        let healing = |path: &Path| batches.iter().any(|batch| batch.source.path == path);
        daemons.sources_seen(
            classified
                .sources
                .iter()
                .filter(|(path, _)| !healing(path))
                .map(|(path, stack)| (path.as_path(), stack.top().dev)),
            classified.targets.values().map(|target| target.stack.top().dev),
        );
    }

    /// What the executor can do for `batch` before its source answers, given
    /// the handles held on its targets that are still their planned tops (a
    /// held mount cannot be freed, so its ID is not reused while held): a
    /// heal after a seen death opens none of them again. They are handed
    /// over, not copied: a copy each would take a second descriptor per
    /// target, which a node's 10,000 targets can run out of. A heal that
    /// does not happen opens its targets again by path; no new mount covers
    /// a target a batch is planned for.
    pub(super) fn prepare_heal(&mut self, batch: &HealBatch) -> Prepared {
        let started = Instant::now();
        let held: Vec<Option<_>> = batch
            .targets
            .iter()
            .map(|target| {
                let record = self.records.get_mut(&target.path)?;
                if record.held.as_ref()?.mount_id != target.top_mount_id {
                    return None;
                }
                record.held.take().map(|held| held.fd)
            })
            .collect();
        let already = held.iter().flatten().count();
        let prepared = self.executor.prepare(batch, held);
        debug!(
            targets = batch.targets.len(),
            held = already,
            took_us = started.elapsed().as_micros() as u64,
            "stale layers opened for the heal"
        );
        prepared
    }

    /// Makes the dead connection's mounts in containers private (see
    /// [`fuse_supervisor_engine::heal::containers`]) and says how many there were.
    pub(super) fn isolate_containers(&mut self, dev: Dev) {
        let started = Instant::now();
        let Some(isolated) = self.executor.isolate_containers(dev) else { return };
        let took_us = started.elapsed().as_micros() as u64;
        // One line per namespace, however many mounts a tenant made there.
        let mut by_namespace: BTreeMap<u64, (&ForeignMount, &ContainerHealError, usize)> = BTreeMap::new();
        for (foreign, err) in &isolated.failed {
            by_namespace.entry(foreign.namespace).or_insert((foreign, err, 0)).2 += 1;
        }
        for (namespace, (foreign, err, mounts)) in by_namespace {
            warn!(connection = %dev, namespace, pid = foreign.pid, mounts, first = %foreign.mount.mount_point.display(), err = %chain(err), "cannot isolate a container's dead mounts; the host heal may stack onto them");
        }
        info!(
            connection = %dev,
            namespaces = isolated.namespaces,
            mounts = isolated.mounts,
            failed = isolated.failed.len(),
            namespaces_read = isolated.read,
            walked = isolated.walked,
            searched_us = isolated.searched_us,
            took_us,
            "containers' dead mounts isolated"
        );
    }

    /// Takes a handle on each target's top while it is still the dead
    /// connection's mount: a new mount over the stale source will cover it.
    fn hold_stale_layers(&mut self, targets: &[PathBuf], dev: Dev) {
        if targets.is_empty() {
            return;
        }
        let Some(classified) = self.read_table() else { return };
        let until = Instant::now() + HOLD_STALE_FOR;
        for path in targets {
            let Some(target) = classified.targets.get(path) else { continue };
            let top = target.stack.top();
            if top.dev != dev {
                debug!(target = %path.display(), "target no longer on the dead connection; not held");
                continue;
            }
            match self.executor.open_target(path) {
                Ok((fd, id)) if id == top.mount_id => {
                    self.update_record(path, |record| record.held = Some(Held { fd, mount_id: id, until }));
                }
                Ok(_) => debug!(target = %path.display(), "target covered before it could be held"),
                Err(err) => {
                    warn!(target = %path.display(), err = %chain(&err), "cannot hold the stale layer of a target")
                }
            }
        }
        debug!(held = self.records.values().filter(|record| record.held.is_some()).count(), "stale layers held");
    }

    /// After a scan: asks who serves new connections, forgets deaths of
    /// replaced sources, removes stale layers that a mount over the stale
    /// source covered, and lets go of handles no longer needed. Returns
    /// whether the journal changed.
    pub(super) fn track_daemons(&mut self, classified: &Classified) -> bool {
        let settled: Vec<(PathBuf, Dev)> = self
            .journal
            .deaths()
            .filter_map(|(path, _)| Some((path.to_path_buf(), classified.sources.get(path)?.top().dev)))
            .collect();
        let mut changed = false;
        for (path, dev) in settled {
            let died_on = self.journal.source(&path).and_then(|record| record.daemon_died).map(|death| death.dev);
            let settled = self.journal.settle_death(&path, Some(dev));
            changed |= settled;
            if let (true, Some(dead)) = (settled, died_on) {
                self.heal_driver_mounted(&path, dead, classified);
            }
        }
        self.flatten_covered(classified);
        let now = Instant::now();
        self.records.retain(|path, record| {
            let Some(held) = &record.held else { return true };
            let present = classified
                .targets
                .get(path)
                .is_some_and(|target| target.stack.layers.iter().any(|layer| layer.mount_id == held.mount_id));
            let outage = matches!(
                record.state,
                TargetState::Degraded { .. }
                    | TargetState::Broken { .. }
                    | TargetState::Healing
                    | TargetState::Failed { .. }
            );
            if !(present && outage && held.until > now) {
                record.held = None;
            }
            !record.holds_nothing()
        });
        changed
    }

    /// A pod's target that a CSI driver mounts itself is on a new
    /// connection after its daemon's death: the copies of it in containers,
    /// isolated at the death, are healed from the new mount. Where the host
    /// has binds of it (a subPath), their heal heals the containers.
    fn heal_driver_mounted(&mut self, source: &Path, dead: Dev, classified: &Classified) {
        if !self.layout.is_driver_mounted(source) || !self.targets_on(source, dead).is_empty() {
            return;
        }
        let Some(stack) = classified.sources.get(source) else { return };
        info!(source = %source.display(), connection = %stack.top().dev, dead = %dead, "a driver-mounted pod volume is back; healing its containers");
        self.heal_containers(&BTreeSet::from([dead]), source, stack.top(), None);
    }

    /// Targets healed by propagation over a held stale layer: the layer is
    /// removed through its handle.
    fn flatten_covered(&mut self, classified: &Classified) {
        let mut covered: Vec<(TargetHeal, PathBuf)> = self
            .records
            .iter()
            .filter_map(|(path, record)| Some((path, record.held.as_ref()?)))
            .filter_map(|(path, held)| {
                let target = classified.targets.get(path)?;
                let mapping = self.journal.get(path)?;
                let covered = target.stack.top().mount_id != held.mount_id
                    && target.stack.layers.iter().any(|layer| layer.mount_id == held.mount_id);
                (covered && plan::assess(target, Some(mapping), classified) == Assessment::StaleLayers)
                    .then(|| (TargetHeal::of(path, target, mapping), mapping.source.clone()))
            })
            .collect();
        // In path order, as they are logged.
        covered.sort_unstable_by(|a, b| path_order(&a.0.path, &b.0.path));
        let mut containers_of = BTreeSet::new();
        for (heal, source) in covered {
            let Some(held) = self.update_record(&heal.path, |record| record.held.take()) else { continue };
            // The covered layer is the dead connection's (the mapping may
            // already name the new one).
            let covered = classified.targets.get(&heal.path).and_then(|target| {
                target.stack.layers.iter().find(|layer| layer.mount_id == held.mount_id).map(|layer| layer.dev)
            });
            if let Some(dead) = covered {
                containers_of.insert((source.clone(), dead));
            }
            let result = self.executor.flatten_covered(&heal, held.fd);
            let record = self.records.get_or_insert_with(&heal.path, || TargetRecord::new(TargetState::Healthy));
            let outage = record.broken_since.and_then(|since| since.elapsed().ok());
            let layers_removed = match result {
                Ok(removed) => {
                    info!(
                        target = %heal.path.display(),
                        pod = %heal.pod_uid,
                        layers_removed = removed,
                        outage_ms = outage.map(|outage| outage.as_millis() as u64),
                        "covered stale layer removed"
                    );
                    removed
                }
                Err(err) => {
                    warn!(target = %heal.path.display(), err = %chain(&err), "healed by propagation, but the covered stale layer remains");
                    0
                }
            };
            // The kernel healed it the instant the new mount appeared; this
            // is when the covered layer went.
            let latency = self
                .sources
                .get(&source)
                .and_then(|record| record.seen)
                .map_or_else(|| self.woke_at.elapsed(), |(_, at)| at.elapsed());
            self.report_propagated(&heal.path, &heal.pod_uid, &source, latency, layers_removed);
            if let Some(record) = self.records.get_mut(&heal.path) {
                record.broken_since = None;
            }
            if let Some(stack) = classified.sources.get(&source) {
                self.count_source_heal(&source, stack.top().dev);
            }
        }
        // The containers' copies were isolated at the death: nothing
        // propagated onto them.
        for (source, dead) in containers_of {
            let Some(stack) = classified.sources.get(&source) else { continue };
            self.heal_containers(&BTreeSet::from([dead]), &source, stack.top(), None);
        }
    }

    /// Discovery retries, orphan checks and the release of held layers.
    pub(super) fn degraded_deadline(&self) -> Option<Instant> {
        let daemons = self.daemons.as_ref().and_then(|daemons| daemons.next_deadline());
        let held = self.records.values().filter_map(|record| record.held.as_ref().map(|held| held.until));
        daemons.into_iter().chain(held).min()
    }

    pub(super) fn on_degraded_deadline(&mut self) {
        let Some(daemons) = &mut self.daemons else { return };
        for Aborted { source, dev, pid, exited_at, waiting } in daemons.on_deadline() {
            warn!(
                source = %source.display(),
                connection = %dev,
                pid,
                waiting,
                "connection held but not served, with requests waiting: aborted so that readers get an error"
            );
            self.daemon_died(&source, dev, pid, exited_at, "aborted", "abort");
            // Aborted: nothing will ever serve the connection again.
            self.death_confirmed(Death { source, dev });
        }
    }

    /// Whether a seen death's new mount is expected any moment: while its
    /// stale layers are held, or (let go when the dead source was detached)
    /// for as long as they would have been.
    pub(super) fn restart_expected(&self) -> bool {
        let recent = |death: &DaemonDeath| death.at.elapsed().is_ok_and(|age| age < HOLD_STALE_FOR);
        self.records.values().any(|record| record.held.is_some())
            || self.journal.deaths().any(|(_, death)| recent(death))
    }

    /// Drops the handle on a target (healed, or its pod gone).
    pub(super) fn release_held(&mut self, target: &Path) {
        if self.records.get(target).is_some_and(|record| record.held.is_some()) {
            self.update_record(target, |record| record.held = None);
        }
    }
}
