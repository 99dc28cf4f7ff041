//! Waiting for the kubelet to confirm that a replaced source's owner
//! restarted, per source, with re-checks and a grace for a failing kubelet.
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::heal::Executor;
use crate::model::table::TargetKind;
use crate::plan::HealBatch;
use crate::plan::confirm::{self, Answer, Asker, Verdict};
use crate::report::Report;

use super::Supervisor;

/// A replaced source waiting for the kubelet to confirm its owner's restart.
#[derive(Debug)]
pub(super) struct Confirmation {
    /// The new source mount, and the one its targets are still on.
    pub(super) mount_id: u32,
    pub(super) stuck_on: u32,
    /// UIDs of the broken targets' pods: where a FUSE sidecar would be.
    pub(super) target_pods: Vec<String>,
    pub(super) waiting: Waiting,
    /// Answers so far: they space out the re-checks.
    pub(super) attempts: u32,
    /// When the kubelet began to fail for this source: the grace runs from here.
    pub(super) failing_since: Option<Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Waiting {
    /// A call is on its way.
    Asking,
    /// The owner shows no restart yet: ask again at the given time.
    NotYet { recheck_at: Instant },
    /// The kubelet fails: ask again at the given time, until the grace is over.
    Failing { retry_at: Instant },
    /// Confirmed, or decided without the kubelet: heal.
    Go,
}

impl Waiting {
    pub(super) fn due_at(&self) -> Option<Instant> {
        match *self {
            Waiting::NotYet { recheck_at } => Some(recheck_at),
            Waiting::Failing { retry_at } => Some(retry_at),
            Waiting::Asking | Waiting::Go => None,
        }
    }
}

/// Re-checks of a source whose owner shows no restart, and retries of a
/// failing kubelet: short at first, then capped.
pub(super) fn recheck_delay(attempts: u32) -> Duration {
    const FIRST: Duration = Duration::from_millis(100);
    const CAP: Duration = Duration::from_secs(2);
    FIRST.saturating_mul(1 << attempts.min(8)).min(CAP)
}

pub(super) struct Confirmer {
    pub(super) asker: Asker,
    pub(super) grace: Duration,
    /// Replaced sources by path.
    pub(super) waiting: BTreeMap<PathBuf, Confirmation>,
}

impl<E: Executor> Supervisor<E> {
    /// Whether a batch may be healed now. A source replaced under its
    /// targets needs the kubelet to confirm that its owner restarted; a
    /// dead target on a healthy source needs no confirmation.
    pub(super) fn confirmed(&mut self, batch: &HealBatch) -> bool {
        let Some(confirmer) = &mut self.confirmer else { return true };
        if batch.targets.iter().all(|target| self.dead_targets.contains(&target.path)) {
            return true;
        }
        let mount_id = batch.source.top().mount_id;
        let stuck_on = batch
            .targets
            .iter()
            .find_map(|target| self.journal.get(&target.path))
            .map_or(0, |mapping| mapping.source_mount_id);
        let source = &batch.source.path;
        let fresh = || Confirmation {
            mount_id,
            stuck_on,
            target_pods: batch
                .targets
                .iter()
                .filter(|target| target.kind != TargetKind::SourceBind)
                .map(|target| target.pod_uid.clone())
                .collect(),
            waiting: Waiting::Asking,
            attempts: 0,
            failing_since: None,
        };
        let confirmation = confirmer.waiting.entry(source.clone()).or_insert_with(fresh);
        if confirmation.mount_id != mount_id {
            *confirmation = fresh();
        }
        match confirmation.waiting {
            Waiting::Go => return true,
            Waiting::Asking if !confirmer.asker.in_flight() => {
                info!(source = %source.display(), "source replaced; asking the kubelet whether its owner restarted");
                confirmer.asker.ask();
            }
            waiting if waiting.due_at().is_some_and(|at| at <= Instant::now()) => {
                confirmation.waiting = Waiting::Asking;
                confirmer.asker.ask();
            }
            _ => {}
        }
        false
    }

    pub(super) fn on_kubelet(&mut self, answer: Answer) {
        let Some(confirmer) = &mut self.confirmer else { return };
        confirmer.asker.answered();
        self.reporters.report(&Report::KubeletAnswered { result: answer.pods.as_ref().map(|_| ()), took: answer.took });
        let now = Instant::now();
        let mut confirmed = false;
        for (source, confirmation) in &mut confirmer.waiting {
            if confirmation.waiting != Waiting::Asking {
                continue;
            }
            confirmation.attempts += 1;
            let delay = recheck_delay(confirmation.attempts);
            let pods = match &answer.pods {
                Ok(pods) => pods,
                Err(err) if !err.is_retryable() => {
                    // A refusal or a TLS mismatch repeats until someone
                    // changes the configuration: waiting helps nobody.
                    warn!(source = %source.display(), %err, "kubelet cannot confirm; healing on mount evidence alone");
                    confirmation.waiting = Waiting::Go;
                    confirmed |= self.journal.confirm_owner(source, None);
                    continue;
                }
                Err(err) => {
                    let since = *confirmation.failing_since.get_or_insert(now);
                    if since.elapsed() >= confirmer.grace {
                        warn!(source = %source.display(), %err, grace_ms = confirmer.grace.as_millis() as u64, "kubelet failed for the whole grace; healing on mount evidence alone");
                        confirmation.waiting = Waiting::Go;
                        confirmed |= self.journal.confirm_owner(source, None);
                    } else {
                        warn!(source = %source.display(), %err, retry_in_ms = delay.as_millis() as u64, "kubelet cannot confirm the restart");
                        confirmation.waiting =
                            Waiting::Failing { retry_at: (now + delay).min(since + confirmer.grace) };
                    }
                    continue;
                }
            };
            confirmation.failing_since = None;
            let target_pods: Vec<&str> = confirmation.target_pods.iter().map(String::as_str).collect();
            let replaced_seen = self.journal.first_seen(source, confirmation.stuck_on);
            let known = self.journal.source(source).and_then(|record| record.owner.as_ref());
            match confirm::judge(pods, source, &target_pods, replaced_seen, known) {
                Verdict::Restarted(owner) => {
                    info!(
                        source = %source.display(),
                        pod = %format_args!("{}/{}", owner.namespace, owner.pod),
                        container = %owner.container,
                        container_id = owner.container_id.as_deref().unwrap_or(""),
                        kubelet_us = answer.took.as_micros() as u64,
                        "kubelet confirms the owner restarted"
                    );
                    confirmation.waiting = Waiting::Go;
                    self.reporters.report(&Report::DaemonRestarted { source, owner: &owner });
                    confirmed |= self.journal.confirm_owner(source, Some(owner));
                }
                Verdict::NoOwner => {
                    // The owner may be among the pods that could not be read.
                    info!(source = %source.display(), unreadable_pods = pods.skipped.len(), "no pod on this node owns the source; healing on mount evidence");
                    confirmation.waiting = Waiting::Go;
                    confirmed |= self.journal.confirm_owner(source, None);
                }
                Verdict::NotYet(owner) => {
                    let first = confirmation.attempts == 1;
                    if first {
                        info!(source = %source.display(), pod = %format_args!("{}/{}", owner.namespace, owner.pod), container = %owner.container, recheck_in_ms = delay.as_millis() as u64, "kubelet shows no restart of the owner yet; waiting");
                    } else {
                        debug!(source = %source.display(), recheck_in_ms = delay.as_millis() as u64, "owner not restarted yet");
                    }
                    confirmation.waiting = Waiting::NotYet { recheck_at: now + delay };
                }
            }
        }
        self.state_dirty |= confirmed;
        self.rescan();
    }
}
