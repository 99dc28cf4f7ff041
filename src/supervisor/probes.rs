//! Probes of new sources and of targets on unknown connections, and what
//! their answers start.
use std::collections::BTreeSet;
use std::io;
use std::path::{Path, PathBuf};

use tracing::{debug, error, info, info_span, warn};

use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::heal::Executor;
use fuse_supervisor_engine::heal::probe::{MAX_SUPERSEDED_PER_PATH, ProbeOutcome, ProbeReport, open_mount_root};
use fuse_supervisor_engine::model::mountinfo::is_fuse_type;
use fuse_supervisor_engine::model::table::{Classified, Dev, Role};
use fuse_supervisor_engine::plan::{self, Assessment, HealBatch};
use fuse_supervisor_engine::watch::mount_table::describe_attached;

use super::{Event, Probed, Supervisor};

impl<E: Executor> Supervisor<E> {
    /// Whether a probe of the batch's source was started.
    pub(super) fn start_probe(&mut self, batch: &HealBatch) -> bool {
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
        if !self.make_way_for_probe(source) {
            return false;
        }
        let subdirs = batch
            .targets
            .iter()
            .filter(|t| !t.root_in_source.as_os_str().is_empty())
            .map(|t| t.root_in_source.clone())
            .collect();
        match self.launch_probe(source, expected, subdirs) {
            Ok(started) => started,
            // Out of descriptors or threads for a moment: nothing else may
            // wake the loop, so the targets wait their back-off and try again.
            Err(why) => {
                for target in &batch.targets {
                    let error = format!("cannot probe its source {}: {why}", source.display());
                    self.attempt_failed(&target.path, &target.pod_uid, source, error);
                }
                false
            }
        }
    }

    /// Whether a probe of `source`'s newest mount may start: none is in
    /// flight, or the one of an earlier mount, whose daemon has not
    /// answered, is left to it. A daemon stuck for good (stopped, or in
    /// the kernel) whose mount a restart script replaced held its
    /// successor's probe, and so its heal, for as long as it was stuck.
    fn make_way_for_probe(&mut self, source: &Path) -> bool {
        if !self.prober.in_flight(source) {
            if self.sources.get(source).is_some_and(|record| record.waiting_said) {
                self.sources.update(source, |record| record.waiting_said = false);
            }
            return true;
        }
        if !self.prober.supersede(source) {
            // Every scan asks again until one of them ends: said once.
            if !self.sources.update(source, |record| std::mem::replace(&mut record.waiting_said, true)) {
                warn!(
                    source = %source.display(),
                    waiting = MAX_SUPERSEDED_PER_PATH,
                    "not probing the newest mount: probes of as many earlier mounts wait on their daemons"
                );
            }
            return false;
        }
        info!(source = %source.display(), "a probe of an earlier mount is left waiting on its daemon; probing the newest");
        // What waited for the earlier probe is the earlier mount's.
        self.sources.update(source, |record| {
            record.probed = None;
            record.overdue_reported = false;
            record.probing_unheld = None;
            record.waiting_said = false;
        });
        true
    }

    /// Probes the mount `mount_id` at `source` if it is still the one there,
    /// opening `subdirs` below its root: whether it was started (not when
    /// another mount is there now), or why it could not be.
    pub(super) fn launch_probe(
        &mut self,
        source: &Path,
        mount_id: u32,
        subdirs: BTreeSet<PathBuf>,
    ) -> Result<bool, String> {
        let _span = info_span!("probe", source = %source.display(), mount_id).entered();
        let opened = open_mount_root(source);
        let root = match opened {
            Ok((id, fd)) if id == mount_id => fd,
            Ok((id, _)) => {
                debug!(source = %source.display(), id, expected = mount_id, "source changed since it was seen");
                return Ok(false);
            }
            Err(err) => {
                warn!(source = %source.display(), err = %chain(&err), "cannot open source");
                return Err(format!("cannot open it: {}", chain(&err)));
            }
        };
        debug!(source = %source.display(), mount_id, "probing source");
        self.heal_window.open();
        if let Err(err) =
            self.prober.start(source, mount_id, root, subdirs.into_iter().collect(), self.events.clone(), Event::Probed)
        {
            error!(source = %source.display(), err = %chain(&err), "cannot start probe");
            return Err(format!("cannot start the probe: {}", chain(&err)));
        }
        Ok(true)
    }

    /// Probes a FUSE mount the watcher saw appear at the path of a source
    /// whose recorded targets are on another connection, before the table is
    /// read: the new daemon's first answer (its FUSE_INIT) takes longer than
    /// the read, and the scan that plans the heal finds the probe under way
    /// ([`Self::start_probe`]). Anything else waits for the scan.
    pub(super) fn probe_announced_sources(&mut self, attached: &[u64]) {
        for &unique_id in attached {
            // Gone again, or a kernel without statmount: the scan decides.
            let Ok(mount) = describe_attached(unique_id) else { continue };
            let source = mount.mount_point;
            if !is_fuse_type(&mount.fs_type)
                || self.layout.role(&source) != Role::Source
                || self.prober.in_flight_on(&source, mount.mount_id)
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
            if stranded
                && self.make_way_for_probe(&source)
                && self.launch_probe(&source, mount.mount_id, subdirs) == Ok(true)
            {
                // The heal's latency runs from this wake-up, not from the scan.
                let woke_at = self.woke_at;
                self.sources.update(&source, |record| record.seen = Some((dev, woke_at)));
            }
        }
    }

    /// A target on neither its source's connection nor the recorded one
    /// (an old state file, a bind made while the supervisor was away) is
    /// broken only if it is unreachable: probe it off-thread.
    pub(super) fn probe_unknown_targets(&mut self, classified: &Classified) {
        // A probe's word holds while the target is still there, unknown.
        let journal = &self.journal;
        self.records.retain(|path, record| {
            if record.found_dead {
                let unknown = classified
                    .targets
                    .get(path)
                    .is_some_and(|target| plan::assess(target, journal.get(path), classified) == Assessment::Unknown);
                if !unknown {
                    record.found_dead = false;
                }
            }
            !record.holds_nothing()
        });
        for (path, target) in &classified.targets {
            let assessment = plan::assess(target, self.journal.get(path), classified);
            if assessment != Assessment::Unknown || self.found_dead(path) || self.prober.in_flight(path) {
                continue;
            }
            let top = target.stack.top().mount_id;
            match self.executor.open_target(path) {
                Ok((fd, id)) if id == top => {
                    // Its answer comes as a target's: `on_target_probe`.
                    let started = self.prober.start(path, id, fd, Vec::new(), self.events.clone(), Event::TargetProbed);
                    if let Err(err) = started {
                        error!(target = %path.display(), err = %chain(&err), "cannot start probe");
                    }
                }
                Ok(_) => {} // Changed since the table was read; the next scan sees it.
                Err(err) => warn!(target = %path.display(), err = %chain(&err), "cannot open target to probe it"),
            }
        }
    }

    /// Probes `source`'s mount on connection `dev`, which no process was
    /// found holding ([`Supervisor::died_unseen`] on ENOTCONN).
    pub(super) fn probe_unheld(&mut self, source: PathBuf, dev: Dev) {
        // A probe already under way (a new mount's) answers the same.
        if self.sources.get(&source).is_some_and(|record| record.probing_unheld.is_some())
            || self.prober.in_flight(&source)
        {
            return;
        }
        let Some(classified) = self.read_table() else { return };
        let Some(top) = classified.sources.get(&source).map(|stack| stack.top()).filter(|top| top.dev == dev) else {
            return;
        };
        if self.launch_probe(&source, top.mount_id, BTreeSet::new()) == Ok(true) {
            self.sources.update(&source, |record| record.probing_unheld = Some(dev));
        }
    }

    /// The answer of a probe of a target on a connection no mapping records
    /// (`probe_unknown_targets`); `report.source` is the target.
    pub(super) fn on_target_probe(&mut self, report: ProbeReport) {
        if !self.prober.finished(&report.source, report.mount_id) {
            return;
        }
        match report.outcome {
            // ENOTCONN: what every access to a FUSE mount with a dead daemon returns.
            ProbeOutcome::Failed(err) if err.kind() == io::ErrorKind::NotConnected => {
                info!(target = %report.source.display(), "target on an unrecorded connection is dead");
                self.update_record(&report.source, |record| record.found_dead = true);
                self.rescan();
            }
            ProbeOutcome::Failed(err) => {
                warn!(target = %report.source.display(), err = %chain(&err), "target on an unrecorded connection fails; leaving it")
            }
            ProbeOutcome::Live(_) => {
                warn!(target = %report.source.display(), "target is on a live connection of its own; leaving it")
            }
        }
    }

    pub(super) fn on_probe(&mut self, report: ProbeReport) {
        if !self.prober.finished(&report.source, report.mount_id) {
            debug!(source = %report.source.display(), mount_id = report.mount_id, "an earlier mount's probe answered");
            // The newest mount's probe may have waited for this one to end:
            // for the last in flight, or for a place among the earlier ones
            // left waiting. Nothing else need come to start it (the stuck
            // daemon that ended was no longer a watched source's).
            let newest_waits = self.sources.get(&report.source).is_some_and(|record| record.waiting_said);
            if !self.prober.in_flight(&report.source) || newest_waits {
                self.rescan();
            }
            return;
        }
        if let Some(dev) = self.sources.update(&report.source, |record| record.probing_unheld.take()) {
            match report.outcome {
                ProbeOutcome::Failed(err) if err.kind() == io::ErrorKind::NotConnected => {
                    self.died_unseen(&report.source, dev);
                }
                // A descriptor that was on its way to the daemon, or a
                // daemon this /proc does not show: not dead.
                outcome => {
                    let live = matches!(outcome, ProbeOutcome::Live(_));
                    debug!(source = %report.source.display(), connection = %dev, live, "unheld connection is not dead");
                }
            }
            return;
        }
        debug!(source = %report.source.display(), live = matches!(report.outcome, ProbeOutcome::Live(_)), "probed");
        let planned = self.sources.update(&report.source, |record| {
            record.overdue_reported = false;
            record.probed.take()
        });
        let handles = match report.outcome {
            ProbeOutcome::Live(handles) => handles,
            ProbeOutcome::Failed(err) => {
                warn!(source = %report.source.display(), err = %chain(&err), "source is not serving; waiting for it to be replaced");
                return;
            }
        };
        let (mut batch, prepared) = match planned {
            // Nothing read or changed since the scan that planned it: a
            // re-read would plan the same (and costs most of a small heal).
            Some(Probed { read, batch, prepared })
                if read == self.table_reads
                    && batch.source.top().mount_id == report.mount_id
                    && !self.reader.changed_since_read().unwrap_or(true) =>
            {
                (batch, prepared)
            }
            // The table may have moved on while the probe ran: plan afresh.
            _ => {
                let Some(classified) = self.read_table() else { return };
                let Some(batch) = plan::plan(&classified, &self.journal, &self.found_dead_targets())
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
        // Not prepared ahead: the handles held since the death are handed
        // over here, so the executor opens only what no one holds.
        let holds = |path: &Path| self.records.get(path).is_some_and(|record| record.held.is_some());
        let prepared = match prepared.is_empty() && batch.targets.iter().any(|target| holds(&target.path)) {
            true => self.prepare_heal(&batch),
            false => prepared,
        };
        // The pod of a target may have been deleted since it was planned
        // (the executor prepares again what no longer fits the batch).
        batch.targets.retain(|target| !self.in_back_off(&target.path) && self.journal.get(&target.path).is_some());
        self.heal(&batch, prepared, &handles, report.waited);
        self.rescan();
    }
}
