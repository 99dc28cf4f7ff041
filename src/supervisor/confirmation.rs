//! The loop's side of confirming a restart with the kubelet: it asks when
//! [`Confirmations`] says so, and logs, reports and records what each answer
//! decided.
use std::time::Instant;

use tracing::{debug, info, warn};

use fuse_supervisor_engine::heal::Executor;
use fuse_supervisor_engine::kube::{Answer, Asker};
use fuse_supervisor_engine::model::table::TargetKind;
use fuse_supervisor_engine::plan::HealBatch;
use fuse_supervisor_engine::plan::confirm::{Confirmations, Decision, Gate};
use fuse_supervisor_engine::report::Report;

use super::Supervisor;

/// The kubelet thread and the sources waiting for its answers.
pub(super) struct Confirmer {
    pub(super) asker: Asker,
    pub(super) confirmations: Confirmations,
}

impl<E: Executor> Supervisor<E> {
    /// Whether a batch may be healed now. A source replaced under its
    /// targets needs the kubelet to confirm that its owner restarted; a
    /// dead target on a healthy source needs no confirmation.
    pub(super) fn confirmed(&mut self, batch: &HealBatch) -> bool {
        if batch.targets.iter().all(|target| self.found_dead(&target.path)) {
            return true;
        }
        let Some(confirmer) = &mut self.confirmer else { return true };
        let stuck_on = batch
            .targets
            .iter()
            .find_map(|target| self.journal.get(&target.path))
            .map_or(0, |mapping| mapping.source_mount_id);
        let source = &batch.source.path;
        let target_pods = || {
            // Binds of the source are no pod's: no sidecar to look for there.
            let pods = batch.targets.iter().filter(|target| target.kind != TargetKind::SourceBind);
            pods.map(|target| target.pod_uid.clone()).collect()
        };
        let gate = confirmer.confirmations.gate(
            source,
            batch.source.top().mount_id,
            stuck_on,
            target_pods,
            confirmer.asker.in_flight(),
            Instant::now(),
        );
        match gate {
            Gate::Heal => return true,
            Gate::Ask { first } => {
                if first {
                    info!(source = %source.display(), "source replaced; asking the kubelet whether its owner restarted");
                }
                confirmer.asker.ask();
            }
            Gate::Wait => {}
        }
        false
    }

    pub(super) fn on_kubelet(&mut self, answer: Answer) {
        let Some(confirmer) = &mut self.confirmer else { return };
        confirmer.asker.answered();
        self.reporters.report(&Report::KubeletAnswered { result: answer.pods.as_ref().map(|_| ()), took: answer.took });
        // Every source waiting heard the same failure, if any.
        let error = answer.pods.as_ref().err().map(ToString::to_string).unwrap_or_default();
        let mut confirmed = false;
        for (source, decision) in confirmer.confirmations.answered(&answer.pods, &self.journal, Instant::now()) {
            let source_path = source.display();
            match decision {
                Decision::Restarted(owner) => {
                    info!(
                        source = %source_path,
                        pod = %format_args!("{}/{}", owner.namespace, owner.pod),
                        container = %owner.container,
                        container_id = owner.container_id.as_deref().unwrap_or(""),
                        kubelet_us = answer.took.as_micros() as u64,
                        "kubelet confirms the owner restarted"
                    );
                    self.reporters.report(&Report::DaemonRestarted { source: &source, owner: &owner });
                    confirmed |= self.journal.confirm_owner(&source, Some(owner));
                }
                Decision::NoOwner { unreadable_pods } => {
                    // The owner may be among the pods that could not be read.
                    info!(source = %source_path, unreadable_pods, "no pod on this node owns the source; healing on mount evidence");
                    confirmed |= self.journal.confirm_owner(&source, None);
                }
                Decision::Refused => {
                    warn!(source = %source_path, err = %error, "kubelet cannot confirm; healing on mount evidence alone");
                    confirmed |= self.journal.confirm_owner(&source, None);
                }
                Decision::GraceOver { grace } => {
                    warn!(source = %source_path, err = %error, grace_ms = grace.as_millis() as u64, "kubelet failed for the whole grace; healing on mount evidence alone");
                    confirmed |= self.journal.confirm_owner(&source, None);
                }
                Decision::Failing { retry_in } => {
                    warn!(source = %source_path, err = %error, retry_in_ms = retry_in.as_millis() as u64, "kubelet cannot confirm the restart");
                }
                Decision::NotYet { owner, first: true, recheck_in } => {
                    info!(source = %source_path, pod = %format_args!("{}/{}", owner.namespace, owner.pod), container = %owner.container, recheck_in_ms = recheck_in.as_millis() as u64, "kubelet shows no restart of the owner yet; waiting");
                }
                Decision::NotYet { first: false, recheck_in, .. } => {
                    debug!(source = %source_path, recheck_in_ms = recheck_in.as_millis() as u64, "owner not restarted yet");
                }
            }
        }
        self.state_dirty |= confirmed;
        self.rescan();
    }
}
