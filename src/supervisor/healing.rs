//! Carrying out a probed batch and reporting each target's outcome.
use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use tracing::{info, info_span, warn};

use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::errors::error_chain;
use fuse_supervisor_engine::heal::{Executor, HealError, Healed, Prepared};
use fuse_supervisor_engine::model::state::{Mapping, TargetState, retry_delay};
use fuse_supervisor_engine::model::table::Dev;
use fuse_supervisor_engine::plan::HealBatch;
use fuse_supervisor_engine::report::{HealReport, Report, TargetEvent};

use super::{Event, Supervisor, TargetRecord};

impl<E: Executor> Supervisor<E> {
    /// From the scan that first saw the source's current mount, for targets
    /// it left behind; from the wake-up, for targets found dead under a
    /// source that did not change.
    pub(super) fn heal_latency(&self, batch: &HealBatch) -> Duration {
        let dead_target = batch.targets.iter().any(|target| self.found_dead(&target.path));
        let since = match self.source_seen_at(&batch.source.path, batch.source.top().dev) {
            Some(at) if !dead_target => at,
            _ => self.woke_at,
        };
        since.elapsed()
    }

    /// When a scan first saw the mount on connection `dev` at `source`;
    /// None if none has yet.
    pub(super) fn source_seen_at(&self, source: &Path, dev: Dev) -> Option<Instant> {
        self.sources.seen_at(source, dev)
    }

    /// Heals `batch` from the source whose probe waited `source_wait` for
    /// its answer.
    pub(super) fn heal(
        &mut self,
        batch: &HealBatch,
        prepared: Prepared,
        handles: &fuse_supervisor_engine::heal::probe::SourceHandles,
        source_wait: Duration,
    ) {
        let _span = info_span!(
            "heal",
            source = %batch.source.path.display(),
            connection = %batch.source.top().dev,
            targets = batch.targets.len()
        )
        .entered();
        for target in &batch.targets {
            if let Some(record) = self.records.get_mut(&target.path) {
                record.state = TargetState::Healing;
            }
        }
        // The heal's own changes need no report, and the rescan after it
        // reads what anyone else changed meanwhile.
        if let Some(Err(err)) = self.table_watch.as_ref().map(|watch| watch.pause()) {
            warn!(err = %chain(&err), "the heal's own mount changes will be reported");
        }
        // The connections the targets were on, before the loop below records
        // the new one: their mounts in containers are healed after the host's.
        let new_dev = batch.source.top().dev;
        let dead: BTreeSet<Dev> = batch
            .targets
            .iter()
            .filter_map(|target| self.journal.get(&target.path).map(|mapping| mapping.dev))
            .filter(|dev| *dev != new_dev)
            .collect();
        // Their mounts in containers are isolated when the daemon's death
        // is seen; a death not seen yet (the process event came after the
        // new mount, on a loaded node) is isolated now, before the host
        // heal stacks onto targets whose slaves they are.
        for dev in &dead {
            self.isolate_containers(*dev);
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
        // Put off whole for want of descriptors: nothing was mounted, and
        // the containers' isolated dead mounts wait for the retry too.
        let put_off = !outcomes.is_empty()
            && outcomes.iter().all(|outcome| matches!(outcome.result, Err(HealError::Descriptors { .. })));
        // The containers before the host's reports, which still come first:
        // the containers' readers wait for these heals, nobody waits for a
        // log line or an Event (reporting 100 heals took 1.0-1.4 ms).
        let containers = (!put_off)
            .then(|| self.heal_containers_unreported(&dead, &batch.source.path, batch.source.top(), Some(handles)));
        let lowered = self.heal_window.lower_for_reports();
        // No span per target: each line below names its target and pod, and
        // making, entering and printing one per line took a fifth of the
        // loop's time reporting 1,000 heals (15 ms of them, 12 ms without).
        for (target, outcome) in batch.targets.iter().zip(outcomes) {
            let record = self.records.get_or_insert_with(&outcome.path, || TargetRecord::new(TargetState::Healing));
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
                        warn!(target = %outcome.path.display(), err = %chain(&err), "healed, but stale layers remain");
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
                    record.found_dead = false;
                    record.held = None;
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
                // With its cause: the pod's Event says why (a subdirectory
                // that is a symlink, a mount call the kernel refused).
                Err(err) => self.attempt_failed(&outcome.path, &target.pod_uid, &batch.source.path, error_chain(&err)),
            }
        }
        self.state_dirty |= healed_any;
        if healed_any {
            self.count_source_heal(&batch.source.path, batch.source.top().dev);
        }
        if let Some(containers) = containers {
            self.report_containers(containers);
        }
        self.heal_window.raise_after_reports(lowered);
    }

    /// A heal attempt of `target` failed with `error`: it is retried after
    /// its back-off, and the pod is told.
    pub(super) fn attempt_failed(&mut self, target: &Path, pod_uid: &str, source: &Path, error: String) {
        let record = self.records.get_or_insert_with(target, || TargetRecord::new(TargetState::Healing));
        record.attempts += 1;
        let delay = retry_delay(record.attempts);
        warn!(target = %target.display(), pod = %pod_uid, err = %error, attempts = record.attempts, retry_in_ms = delay.as_millis() as u64, "heal failed");
        let event = TargetEvent { target, pod_uid, source, broken_since: record.broken_since };
        self.reporters.report(&Report::HealFailed {
            target: &event,
            error: &error,
            attempts: record.attempts,
            retry_in: delay,
        });
        record.state = TargetState::Failed { attempts: record.attempts, retry_at: Instant::now() + delay, error };
    }
}
