//! The loop's side of re-staging through a CSI driver: a dead source is
//! handed to the re-staging thread, and its outcomes are reported (the
//! log line is the thread's, with the call's duration); the targets a
//! driver without a staging step mounts itself become sources.
use std::collections::BTreeSet;
use std::path::Path;

use fuse_supervisor_engine::csi::restage::{RestageOutcome, RestagerNews};
use fuse_supervisor_engine::heal::Executor;
use fuse_supervisor_engine::model::table::Dev;
use fuse_supervisor_engine::report::Report;
use tracing::info;

use super::Supervisor;

impl<E: Executor> Supervisor<E> {
    /// Hands the death of `source`'s connection `dev` to the re-staging
    /// thread, which decides whether it is a recorded CSI staging path.
    pub(super) fn restage_if_recorded(&self, source: &Path, dev: Dev) {
        if let Some(restager) = &self.restager {
            restager.source_dead(source, dev);
        }
    }

    pub(super) fn on_restager(&mut self, news: RestagerNews) {
        match news {
            RestagerNews::Outcome(outcome) => self.on_restaged(outcome),
            RestagerNews::DriverMounted(targets) => {
                let count = targets.len();
                if self.layout.set_driver_mounted(targets) {
                    info!(targets = count, "pod targets a CSI driver mounts itself, taken as sources");
                    self.rescan();
                }
            }
        }
    }

    fn on_restaged(&mut self, mut outcome: RestageOutcome) {
        if outcome.pods.is_empty() && outcome.result.is_warning() {
            // No record named them: the pods of the targets known on it.
            let pods: BTreeSet<String> = self
                .journal
                .mappings()
                .values()
                .filter(|mapping| mapping.source == outcome.path && !mapping.pod_uid.is_empty())
                .map(|mapping| mapping.pod_uid.clone())
                .collect();
            outcome.pods = pods.into_iter().collect();
        }
        self.reporters.report(&Report::Restage(&outcome));
        for pod_uid in &outcome.pods {
            self.reporters.report(&Report::VolumeRestage { outcome: &outcome, pod_uid });
        }
    }
}
