//! Confirming through the kubelet that a source's owner really restarted
//! before its targets are rebound onto the new mount.
//!
//! The owner of a global mount is the container that made it: the one on
//! this node whose hostPath volume contains the mount path with
//! Bidirectional propagation, or, for a FUSE sidecar, the container of the
//! target's own pod that mounts with Bidirectional propagation.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::kube::KubeletError;
use crate::kube::pods::{Container, ContainerStatus, Pod, PodList};
use crate::model::state::{Journal, Owner};

/// The sources replaced under their targets, each waiting for the kubelet
/// to confirm that its owner restarted before its targets are healed. Pure:
/// the loop gives it the time, the kubelet's answers and the journal, and
/// carries out what it decides (asking, logging, healing).
#[derive(Debug)]
pub struct Confirmations {
    /// How long a failing kubelet is waited for before healing on the
    /// mount evidence alone.
    grace: Duration,
    by_source: BTreeMap<PathBuf, Pending>,
}

/// One replaced source's wait.
#[derive(Debug)]
struct Pending {
    /// The new source mount, and the one its targets are still on.
    mount_id: u32,
    stuck_on: u32,
    /// UIDs of the broken targets' pods: where a FUSE sidecar would be.
    target_pods: Vec<String>,
    waiting: Waiting,
    /// Answers so far: they space out the re-checks.
    attempts: u32,
    /// When the kubelet began to fail for this source: the grace runs from here.
    failing_since: Option<Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// A call is wanted, or on its way.
    Asking,
    /// The owner shows no restart yet: ask again at the given time.
    NotYet { recheck_at: Instant },
    /// The kubelet fails: ask again at the given time, until the grace is over.
    Failing { retry_at: Instant },
    /// Confirmed, or decided without the kubelet: heal.
    Go,
}

impl Waiting {
    fn due_at(self) -> Option<Instant> {
        match self {
            Waiting::NotYet { recheck_at } => Some(recheck_at),
            Waiting::Failing { retry_at } => Some(retry_at),
            Waiting::Asking | Waiting::Go => None,
        }
    }
}

/// What the loop does for a replaced source now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Confirmed, or decided without the kubelet.
    Heal,
    /// Call the kubelet: for the first time for this mount, or again.
    Ask { first: bool },
    /// An answer or a re-check is due later.
    Wait,
}

/// What one kubelet answer decided for one waiting source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The owner restarted: heal.
    Restarted(Owner),
    /// No pod on this node owns the source (`unreadable_pods` could not be
    /// read and may hold it): heal on the mount evidence.
    NoOwner { unreadable_pods: usize },
    /// The kubelet refuses in a way that repeats until someone changes the
    /// configuration: waiting helps nobody, heal on the mount evidence.
    Refused,
    /// The kubelet failed for the whole grace: heal on the mount evidence.
    GraceOver { grace: Duration },
    /// The kubelet fails: ask again after `retry_in`.
    Failing { retry_in: Duration },
    /// The owner shows no restart yet (`first` answer for this mount): ask
    /// again after `recheck_in`.
    NotYet { owner: Owner, first: bool, recheck_in: Duration },
}

impl Decision {
    /// Whether the source's targets may be healed now.
    pub fn heals(&self) -> bool {
        matches!(
            self,
            Decision::Restarted(_) | Decision::NoOwner { .. } | Decision::Refused | Decision::GraceOver { .. }
        )
    }
}

/// Re-checks of a source whose owner shows no restart, and retries of a
/// failing kubelet: short at first, then capped.
fn recheck_delay(attempts: u32) -> Duration {
    const FIRST: Duration = Duration::from_millis(100);
    const CAP: Duration = Duration::from_secs(2);
    FIRST.saturating_mul(1 << attempts.min(8)).min(CAP)
}

impl Confirmations {
    pub fn new(grace: Duration) -> Self {
        Confirmations { grace, by_source: BTreeMap::new() }
    }

    /// Whether `source`, whose new mount is `mount_id` while its targets are
    /// still on `stuck_on`, may be healed at `now`. A new mount at the
    /// source starts its wait afresh. `call_in_flight` says whether a
    /// kubelet call is already on its way (its answer will serve this
    /// source too).
    pub fn gate(
        &mut self,
        source: &Path,
        mount_id: u32,
        stuck_on: u32,
        target_pods: impl FnOnce() -> Vec<String>,
        call_in_flight: bool,
        now: Instant,
    ) -> Gate {
        let fresh = |target_pods: Vec<String>| Pending {
            mount_id,
            stuck_on,
            target_pods,
            waiting: Waiting::Asking,
            attempts: 0,
            failing_since: None,
        };
        let pending = match self.by_source.get_mut(source) {
            Some(pending) if pending.mount_id == mount_id => pending,
            Some(pending) => {
                *pending = fresh(target_pods());
                pending
            }
            None => self.by_source.entry(source.to_path_buf()).or_insert_with(|| fresh(target_pods())),
        };
        match pending.waiting {
            Waiting::Go => Gate::Heal,
            Waiting::Asking if !call_in_flight => Gate::Ask { first: pending.attempts == 0 },
            waiting if waiting.due_at().is_some_and(|at| at <= now) => {
                pending.waiting = Waiting::Asking;
                Gate::Ask { first: false }
            }
            _ => Gate::Wait,
        }
    }

    /// Applies one kubelet answer to every source that waits for one, with
    /// what the journal remembers of each (when the replaced mount was first
    /// seen, the owner last confirmed).
    pub fn answered(
        &mut self,
        pods: &Result<Arc<PodList>, KubeletError>,
        journal: &Journal,
        now: Instant,
    ) -> Vec<(PathBuf, Decision)> {
        let mut decided = Vec::new();
        for (source, pending) in &mut self.by_source {
            if pending.waiting != Waiting::Asking {
                continue;
            }
            pending.attempts += 1;
            let delay = recheck_delay(pending.attempts);
            let decision = match pods {
                Ok(pods) => {
                    pending.failing_since = None;
                    let target_pods: Vec<&str> = pending.target_pods.iter().map(String::as_str).collect();
                    let replaced_seen = journal.first_seen(source, pending.stuck_on);
                    let known = journal.source(source).and_then(|record| record.owner.as_ref());
                    match judge(pods, source, &target_pods, replaced_seen, known) {
                        Verdict::Restarted(owner) => Decision::Restarted(owner),
                        Verdict::NoOwner => Decision::NoOwner { unreadable_pods: pods.skipped.len() },
                        Verdict::NotYet(owner) => {
                            pending.waiting = Waiting::NotYet { recheck_at: now + delay };
                            Decision::NotYet { owner, first: pending.attempts == 1, recheck_in: delay }
                        }
                    }
                }
                Err(err) if !err.is_retryable() => Decision::Refused,
                Err(_) => {
                    let since = *pending.failing_since.get_or_insert(now);
                    if now.saturating_duration_since(since) >= self.grace {
                        Decision::GraceOver { grace: self.grace }
                    } else {
                        pending.waiting = Waiting::Failing { retry_at: (now + delay).min(since + self.grace) };
                        Decision::Failing { retry_in: delay }
                    }
                }
            };
            if decision.heals() {
                pending.waiting = Waiting::Go;
            }
            decided.push((source.clone(), decision));
        }
        decided
    }

    /// When the next re-check or retry is due.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.by_source.values().filter_map(|pending| pending.waiting.due_at()).min()
    }

    /// Forgets the sources `keep` rejects: healed, or no longer replaced.
    pub fn retain(&mut self, mut keep: impl FnMut(&Path) -> bool) {
        self.by_source.retain(|source, _| keep(source));
    }
}

/// What one `/pods` answer says about a replaced source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The owner's container started after the replaced mount appeared.
    Restarted(Owner),
    /// The owner is known but shows no restart yet (the kubelet's status
    /// lags the container by up to a relist period).
    NotYet(Owner),
    /// No pod on this node owns the source: a daemon outside Kubernetes,
    /// or a pod the kubelet no longer lists.
    NoOwner,
}

/// Finds the owner of `source` in `pods`; see [`owners_of`].
pub fn owner_of<'a>(pods: &'a PodList, source: &Path, target_pods: &[&str]) -> Option<(&'a Pod, &'a Container)> {
    owners_of(pods, source, target_pods).into_iter().next()
}

/// The pods that may own `source`, equally likely, in list order. Pods
/// named in `target_pods` (the UIDs of the broken targets' pods) are
/// searched for a FUSE sidecar when no hostPath owner exists.
///
/// The deepest hostPath wins: a FUSE pod mounting /var/lib/juicefs/volume
/// owns its mounts over a CSI node plugin mounting all of /var/lib. At equal
/// depth (every JuiceFS mount pod, and the JuiceFS CSI node pod, mount
/// /var/lib/juicefs/volume), a pod whose name carries the directory the
/// source lies in below the hostPath wins: mount pods are named after it.
pub fn owners_of<'a>(pods: &'a PodList, source: &Path, target_pods: &[&str]) -> Vec<(&'a Pod, &'a Container)> {
    let live = || pods.items.iter().filter(|pod| !is_finished(pod));
    let mut ranked: Vec<((usize, bool), &Pod, &Container)> = live()
        .flat_map(|pod| {
            pod.bidirectional_host_paths().filter_map(move |mount| {
                let host = Path::new(mount.host_path);
                let below = source.strip_prefix(host).ok()?;
                let named = below
                    .components()
                    .next()
                    .and_then(|first| first.as_os_str().to_str())
                    .is_some_and(|first| pod.metadata.name.contains(first));
                Some(((host.components().count(), named), pod, pod.container(mount.container)?))
            })
        })
        .collect();
    if let Some(best) = ranked.iter().map(|(rank, _, _)| *rank).max() {
        ranked.retain(|(rank, _, _)| *rank == best);
        return ranked.into_iter().map(|(_, pod, container)| (pod, container)).collect();
    }
    live()
        .filter(|pod| target_pods.contains(&pod.metadata.uid.as_str()))
        .filter_map(|pod| {
            let mut containers = pod.spec.containers.iter().chain(&pod.spec.init_containers);
            Some((pod, containers.find(|c| c.volume_mounts.iter().any(|m| m.is_bidirectional()))?))
        })
        .collect()
}

fn is_finished(pod: &Pod) -> bool {
    matches!(pod.status.phase.as_deref(), Some("Succeeded" | "Failed"))
}

/// Judges whether the owner of `source` restarted after the replaced mount
/// was first seen (`replaced_seen`; None when the supervisor never saw it).
/// `known` is the owner recorded at the last confirmation.
pub fn judge(
    pods: &PodList,
    source: &Path,
    target_pods: &[&str],
    replaced_seen: Option<SystemTime>,
    known: Option<&Owner>,
) -> Verdict {
    let owners = owners_of(pods, source, target_pods);
    let verdicts = owners.iter().map(|(pod, container)| {
        let status = pod.container_status(&container.name);
        let owner = Owner {
            namespace: pod.metadata.namespace.clone(),
            pod: pod.metadata.name.clone(),
            pod_uid: pod.metadata.uid.clone(),
            container: container.name.clone(),
            container_id: status.and_then(|status| status.container_id.clone()),
            started_at: status.filter(|status| status.is_running()).and_then(ContainerStatus::started_at),
        };
        match status {
            Some(status) if restarted(status, &owner, replaced_seen, known) => Verdict::Restarted(owner),
            _ => Verdict::NotYet(owner),
        }
    });
    // Of owners equally likely, the one that restarted is the one that
    // mounted anew; none restarted: the first is reported as waited for.
    let mut first = None;
    for verdict in verdicts {
        if matches!(verdict, Verdict::Restarted(_)) {
            return verdict;
        }
        first.get_or_insert(verdict);
    }
    first.unwrap_or(Verdict::NoOwner)
}

/// A running container restarted if it is not the container last
/// confirmed, or if it started after the replaced mount appeared, or if its
/// previous run ended after that. Kubelet timestamps have one-second
/// precision: a start is compared strictly against the precise sighting
/// (the old container started before it mounted, so it never passes), an
/// end against the sighting's whole second.
fn restarted(
    status: &ContainerStatus,
    owner: &Owner,
    replaced_seen: Option<SystemTime>,
    known: Option<&Owner>,
) -> bool {
    if !status.is_running() {
        return false;
    }
    // Another pod (a replaced DaemonSet pod) is caught by its start time.
    if let Some(known) = known
        && known.pod_uid == owner.pod_uid
        && known.container == owner.container
        && known.container_id.is_some()
        && known.container_id != owner.container_id
    {
        return true;
    }
    let Some(seen) = replaced_seen else {
        // Never saw the old mount (started after the crash): any earlier
        // termination of this container is the best evidence there is.
        return status.last_state.terminated.is_some();
    };
    let started_later = owner.started_at.is_some_and(|started| started > seen);
    let ended_later = status
        .last_state
        .terminated
        .as_ref()
        .and_then(|terminated| terminated.finished_at)
        .is_some_and(|finished| finished.0 >= whole_second(seen));
    started_later || ended_later
}

fn whole_second(at: SystemTime) -> SystemTime {
    let since_epoch = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    UNIX_EPOCH + Duration::from_secs(since_epoch.as_secs())
}

#[cfg(test)]
mod tests;
