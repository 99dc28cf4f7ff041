//! The targets' states and bookkeeping beside the journal: transitions,
//! counts, what a pod's deletion or a pod-directory change does.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use tracing::{debug, error, info, warn};

use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::heal::{Executor, Healed};
use fuse_supervisor_engine::model::state::{Mapping, TargetState};
use fuse_supervisor_engine::model::table::{Classified, Dev, FuseMount, Target, TargetKind};
use fuse_supervisor_engine::plan::locate::Located;
use fuse_supervisor_engine::plan::scan;
use fuse_supervisor_engine::plan::{self, Assessment, TargetHeal};
use fuse_supervisor_engine::report::{HealReport, Report, ScanCounts, TargetEvent};
use fuse_supervisor_engine::watch::pods::PodChange;

use super::Supervisor;
use super::degraded::Held;

/// What the loop knows of one target beside the journal's mapping. A
/// healthy target that holds nothing else has no record: on a large node
/// nearly every target is healthy.
#[derive(Debug)]
pub(super) struct TargetRecord {
    pub(super) state: TargetState,
    pub(super) attempts: u32,
    /// When the current outage began; kept through healing and retries.
    pub(super) broken_since: Option<SystemTime>,
    /// On a connection no mapping records, a probe found it dead (ENOTCONN).
    pub(super) found_dead: bool,
    /// The handle on its stale top, taken when its daemon died.
    pub(super) held: Option<Held>,
}

impl TargetRecord {
    pub(super) fn new(state: TargetState) -> Self {
        TargetRecord { state, attempts: 0, broken_since: None, found_dead: false, held: None }
    }

    /// Healthy, and nothing else kept: the record can go.
    pub(super) fn holds_nothing(&self) -> bool {
        matches!(self.state, TargetState::Healthy) && !self.found_dead && self.held.is_none()
    }
}

/// A target healed by the kernel's propagation of its source's new mount.
struct Propagated<'a> {
    path: &'a Path,
    target: &'a Target,
    mapping: Mapping,
    /// The source's new mount.
    top: &'a FuseMount,
    /// When that mount was first seen.
    seen: Instant,
}

impl<E: Executor> Supervisor<E> {
    /// Whether a probe found `target`, on a connection no mapping records,
    /// dead.
    pub(super) fn found_dead(&self, target: &Path) -> bool {
        self.records.get(target).is_some_and(|record| record.found_dead)
    }

    /// Every target a probe found dead: the plan heals them.
    pub(super) fn found_dead_targets(&self) -> BTreeSet<PathBuf> {
        let dead = self.records.iter().filter(|(_, record)| record.found_dead);
        dead.map(|(path, _)| path.to_path_buf()).collect()
    }

    /// Changes the record of `target`, made healthy if there is none and
    /// dropped if `change` leaves it holding nothing.
    pub(super) fn update_record<T>(&mut self, target: &Path, change: impl FnOnce(&mut TargetRecord) -> T) -> T {
        let record = self.records.get_or_insert_with(target, || TargetRecord::new(TargetState::Healthy));
        let out = change(record);
        if record.holds_nothing() {
            self.records.remove(target);
        }
        out
    }

    pub(super) fn counts(&self, classified: &Classified) -> ScanCounts {
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
    pub(super) fn sight_sources(&mut self, classified: &Classified) -> bool {
        let now = self.scanned_once.then(SystemTime::now);
        self.scanned_once = true;
        let mut changed = false;
        let scan_started = self.scan_started;
        self.sources.update_all(|path, record| {
            if !classified.sources.contains_key(path) {
                record.seen = None;
            }
        });
        for (path, source) in &classified.sources {
            let dev = source.top().dev;
            self.sources.update(path, |record| {
                if record.seen.is_none_or(|(seen, _)| seen != dev) {
                    record.seen = Some((dev, scan_started));
                }
            });
            changed |= self.journal.sight_source(path, source.top().mount_id, now);
        }
        // New connections only are looked at: the same set again costs a
        // comparison.
        let connections = classified.sources.values().map(|source| source.top().dev).collect();
        self.executor.watch_connections(connections);
        // A driver-mounted target's death is kept while nothing is mounted
        // there: no target of its own would keep it.
        let layout = &self.layout;
        changed
            | self
                .journal
                .forget_unused_sources(|path| classified.sources.contains_key(path) || layout.is_driver_mounted(path))
    }

    /// A daemon that mounts over its stale mount heals root-level targets
    /// through the kernel's propagation, at the instant its mount appears:
    /// such a target is never seen broken, only on its source's new
    /// connection with the recorded one still underneath.
    pub(super) fn report_propagated_heals(&mut self, classified: &Classified) {
        let mut propagated = Vec::new();
        for (path, target) in &classified.targets {
            let Some(mapping) = self.journal.get(path) else { continue };
            let Some(source) = classified.sources.get(&mapping.source) else { continue };
            let top = target.stack.top();
            if top.dev != mapping.dev
                && top.dev == source.top().dev
                && target.stack.layers.iter().any(|layer| layer.dev == mapping.dev)
            {
                // This scan may be the first to see the source's new mount.
                let seen = self.source_seen_at(&mapping.source, source.top().dev).unwrap_or(self.scan_started);
                propagated.push(Propagated { path, target, mapping: mapping.clone(), top: source.top(), seen });
            }
        }
        // With a handle held on the covered layer, the report follows its
        // removal (flatten_covered), and so does its containers' heal.
        let (held, propagated): (Vec<_>, Vec<_>) = propagated
            .into_iter()
            .partition(|heal| self.records.get(heal.path).is_some_and(|record| record.held.is_some()));
        let mut healed_sources: Vec<_> =
            propagated.iter().map(|heal| (heal.mapping.source.clone(), heal.mapping.dev, heal.top)).collect();
        healed_sources.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        healed_sources.dedup_by(|a, b| a.0 == b.0 && a.1 == b.1);
        // A heal cut short after its stacks (the supervisor killed) left
        // private stale layers, which a flatten reaches without a handle; a
        // daemon's mount over its stale source left shared ones, out of
        // reach. Before the containers' isolation, as at any other time: a
        // layer removed while their copies are still its slaves goes from
        // theirs too.
        let removed: Vec<usize> = propagated
            .iter()
            .map(|heal| {
                let target = TargetHeal::of(heal.path, heal.target, &heal.mapping);
                self.executor.flatten_covered_unheld(&target).unwrap_or_else(|err| {
                    debug!(target = %heal.path.display(), err = %chain(&err), "the covered stale layers are out of reach");
                    0
                })
            })
            .collect();
        // The host's heal ends here (its reports say when, not when made).
        let flattened = Instant::now();
        // The containers before the host's reports, which still come
        // first: their readers wait for these heals, nobody for a report.
        let mut containers = Vec::new();
        for (source, dead, top) in &healed_sources {
            // Unless done at the death: the covered layers keep the dead
            // connection's device number from being reused meanwhile.
            self.isolate_containers(*dead);
            containers.push(self.heal_containers_unreported(&BTreeSet::from([*dead]), source, top, None));
        }
        let lowered = self.heal_window.lower_for_reports();
        for heal in held.iter().chain(&propagated) {
            info!(
                target = %heal.path.display(),
                pod = %heal.target.pod_uid,
                source = %heal.mapping.source.display(),
                stale_layers = heal.target.stack.stale_layers().count(),
                "healed by propagation"
            );
        }
        for (heal, removed) in propagated.iter().zip(removed) {
            let latency = flattened.saturating_duration_since(heal.seen);
            self.report_propagated(heal.path, &heal.target.pod_uid, &heal.mapping.source, latency, removed);
        }
        for (source, _, top) in &healed_sources {
            self.count_source_heal(source, top.dev);
        }
        for healed in containers {
            self.report_containers(healed);
        }
        self.heal_window.raise_after_reports(lowered);
    }

    /// Counts a heal of `source`'s targets onto its connection `dev`, and
    /// says so when its daemon keeps crashing.
    pub(super) fn count_source_heal(&mut self, source: &Path, dev: Dev) {
        let Some(heals) = self.flapping.healed(source, dev, Instant::now()) else { return };
        let window = self.flapping.policy().window;
        warn!(source = %source.display(), heals, window_s = window.as_secs(), "the FUSE daemon keeps crashing: its source was healed again and again");
        let owner = self.journal.source(source).and_then(|record| record.owner.as_ref());
        self.reporters.report(&Report::DaemonFlapping { source, heals, window, owner });
    }

    /// A target stays in the work set until healed or its pod is gone.
    pub(super) fn forget_deleted_pods(&mut self) -> bool {
        let pods = self.layout.pods_dir().to_path_buf();
        self.forget_targets(|uid| !pods.join(uid).exists())
    }

    pub(super) fn forget_targets(&mut self, gone: impl Fn(&str) -> bool) -> bool {
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

    pub(super) fn forget_held(&mut self) {
        let journal = &self.journal;
        let held = self.records.iter().filter(|(_, record)| record.held.is_some());
        let gone: Vec<PathBuf> =
            held.filter(|(path, _)| journal.get(path).is_none()).map(|(path, _)| path.to_path_buf()).collect();
        for path in gone {
            self.release_held(&path);
        }
    }

    pub(super) fn on_pods(&mut self, change: PodChange) {
        let forgot = match &change {
            PodChange::PodRemoved { uid } => self.forget_targets(|pod| pod == &**uid),
            PodChange::Resync(directory) => self.forget_targets(|pod| directory.pod(pod).is_none()),
            PodChange::VolDataInvalid { uid, name, error, .. } => {
                warn!(pod = %uid, volume = %name, err = %chain(&error), "vol_data.json unreadable; its layout cannot be used");
                false
            }
            PodChange::EventsLost(lost) => {
                self.reporters.report(&Report::Resynced { watch: "pods", reason: lost.as_str() });
                false
            }
            PodChange::Failed(err) => {
                error!(err = %chain(&err), "pod-directory watcher stopped; deleted pods are now found on each scan");
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

    /// Step 2 of the pipeline ([`scan`]): what the peer groups show, then
    /// the sources of the targets no healthy observation mapped (a
    /// supervisor started after the crash) located by their layouts. Such
    /// a target is judged by a probe: its mapping carries no connection of
    /// its own. Returns whether the journal changed.
    pub(super) fn learn_and_locate(&mut self, classified: &Classified) -> bool {
        if !self.pods_watched {
            // No changes arrive to keep what is known current.
            self.vol_data.clear();
        }
        let learnt =
            scan::learn_and_locate(classified, &self.layout, &self.layouts, &mut self.journal, &mut self.vol_data);
        for Located { target, mapping, layout } in &learnt.located {
            info!(
                target = %target.display(),
                pod = %mapping.pod_uid,
                source = %mapping.source.display(),
                %layout,
                "source located by layout"
            );
        }
        self.vol_data.retain(&learnt.unmapped_pods);
        self.unmapped_pods = learnt.unmapped_pods;
        learnt.changed
    }

    /// Healthy targets have no record: on a large node nearly every target
    /// is healthy, and a record each would be most of the idle footprint.
    pub(super) fn update_states(&mut self, classified: &Classified) {
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
                // What else it holds (a probe's word, a held layer) goes by
                // its own rules; its outage is over.
                if let Some(record) = self.records.get_mut(path) {
                    *record = TargetRecord {
                        found_dead: record.found_dead,
                        held: record.held.take(),
                        ..TargetRecord::new(next)
                    };
                    if record.holds_nothing() {
                        self.records.remove(path);
                    }
                }
                continue;
            }
            let record = self.records.get_or_insert_with(path, || TargetRecord::new(TargetState::Healthy));
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

    pub(super) fn in_back_off(&self, target: &Path) -> bool {
        matches!(self.records.get(target), Some(TargetRecord { state: TargetState::Failed { retry_at, .. }, .. }) if *retry_at > Instant::now())
    }

    /// Reports a target healed by the kernel's propagation of a mount over
    /// its stale source, after `layers_removed` covered layers went.
    pub(super) fn report_propagated(
        &self,
        target: &Path,
        pod_uid: &str,
        source: &Path,
        latency: Duration,
        layers_removed: usize,
    ) {
        let broken_since = self.records.get(target).and_then(|record| record.broken_since);
        let event = TargetEvent { target, pod_uid, source, broken_since };
        let outage = broken_since.and_then(|since| since.elapsed().ok());
        let heal = HealReport { how: Healed::Propagated, latency, source_wait: None, outage, layers_removed };
        self.reporters.report(&Report::TargetHealed { target: &event, heal: &heal });
    }
}
