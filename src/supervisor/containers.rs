//! The heal inside containers after a host heal (see
//! [`fuse_supervisor_engine::heal::containers`]), how each went, and the retries of those
//! that failed: a failed container heal stays in the work set, retried with
//! the targets' back-off, until it succeeds or its namespace is gone; one
//! the container refused by its own doing waits for its namespace's next
//! mount change instead, and one whose namespace missed the deadline for
//! its source's next heal.
use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::heal::Propagation;
use tracing::{debug, info, warn};

use fuse_supervisor_engine::errors::error_chain;
use fuse_supervisor_engine::heal::containers::{self, ContainerHealError, ForeignHealed, ForeignMount};
use fuse_supervisor_engine::heal::in_namespace::InNamespaceError;
use fuse_supervisor_engine::heal::namespaces::LateCopies;
use fuse_supervisor_engine::heal::probe::SourceHandles;
use fuse_supervisor_engine::heal::{ContainerOutcome, Executor};
use fuse_supervisor_engine::kube::cgroup::{PodContainer, container_of};
use fuse_supervisor_engine::model::state::retry_delay;
use fuse_supervisor_engine::model::table::{Dev, FuseMount};
use fuse_supervisor_engine::report::{ContainersHealed, Report};
use fuse_supervisor_engine::watch::namespace_changes::NamespaceChanges;

use super::{Event, Supervisor};

/// Heals in containers done, not reported yet.
#[must_use = "heals in containers are reported"]
pub(super) struct ContainerHeals {
    outcomes: Vec<ContainerOutcome>,
    source: PathBuf,
    took_us: u64,
    /// From the first sight of the new mount, µs.
    latency: Option<u64>,
}

/// A container heal that failed, waiting for its retry.
#[derive(Debug)]
pub(super) struct ContainerRetry {
    foreign: ForeignMount,
    /// The source whose current mount replaces the dead one.
    source: PathBuf,
    attempts: u32,
    pub(super) retry_at: Instant,
    /// Tried again after a heal given up on: its worker, left behind, may
    /// have replaced the mount since.
    after_given_up: bool,
}

/// Container heals the tenant refused (it changed or covered its mount),
/// waiting for its namespace's next mount change ([`NamespaceChanges`]);
/// without mount events (before Linux 6.15) they are retried with back-off
/// instead.
#[derive(Debug, Default)]
pub(super) struct Refusals {
    watch: Option<NamespaceChanges>,
    /// The kernel has no mount events for other namespaces: said once.
    unavailable: bool,
    /// The namespaces marked (by inode), each with a mount of it to find
    /// it again by, and the heals waiting in them.
    watched: BTreeMap<u64, ForeignMount>,
    waiting: Vec<ContainerRetry>,
}

impl<E: Executor> Supervisor<E> {
    /// The containers' mounts of the `dead` connections, after the host
    /// heal from `source` (its mount `top`), in parallel: by a batch, or by
    /// the kernel's propagation of a mount over the stale source.
    /// `live` are the handles the source's probe opened, if it was probed.
    pub(super) fn heal_containers(
        &mut self,
        dead: &BTreeSet<Dev>,
        source: &Path,
        top: &FuseMount,
        live: Option<&SourceHandles>,
    ) {
        let healed = self.heal_containers_unreported(dead, source, top, live);
        self.report_containers(healed);
    }

    /// [`Self::heal_containers`] without its reports, which
    /// [`Self::report_containers`] makes: the host's can come first, as
    /// the heals came, while the containers' readers wait for nothing.
    pub(super) fn heal_containers_unreported(
        &mut self,
        dead: &BTreeSet<Dev>,
        source: &Path,
        top: &FuseMount,
        live: Option<&SourceHandles>,
    ) -> ContainerHeals {
        // Called with no dead connection too: the executor lets go of what
        // it kept for the search after the heal.
        let started = Instant::now();
        let outcomes = self.executor.heal_containers(dead, top, live);
        let took_us = started.elapsed().as_micros() as u64;
        // From the first sight of the new mount to the last container of
        // the batch healed (they heal at once, and are reported together).
        let latency = self.source_seen_at(source, top.dev).map(|seen| seen.elapsed().as_micros() as u64);
        ContainerHeals { outcomes, source: source.to_path_buf(), took_us, latency }
    }

    pub(super) fn report_containers(&mut self, healed: ContainerHeals) {
        let ContainerHeals { outcomes, source, took_us, latency } = healed;
        self.container_outcomes(outcomes, &source, took_us, latency, &[]);
    }

    /// Heals again the containers whose retry is due, from their source's
    /// current mount.
    pub(super) fn retry_containers(&mut self) {
        let now = Instant::now();
        let (due, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.container_retries).into_iter().partition(|retry| retry.retry_at <= now);
        self.container_retries = waiting;
        if due.is_empty() {
            return;
        }
        let Some(classified) = self.read_table() else {
            self.container_retries.extend(due.into_iter().map(ContainerRetry::again));
            return;
        };
        let mut by_source: BTreeMap<PathBuf, Vec<ContainerRetry>> = BTreeMap::new();
        for retry in due {
            by_source.entry(retry.source.clone()).or_default().push(retry);
        }
        for (source, retries) in by_source {
            // Still on a dead connection: the daemon is down again.
            let top = classified.sources.get(&source).map(|stack| stack.top().clone());
            let Some(top) = top.filter(|top| retries.iter().all(|retry| retry.foreign.mount.dev != top.dev)) else {
                self.container_retries.extend(retries.into_iter().map(ContainerRetry::again));
                continue;
            };
            let mounts: Vec<ForeignMount> = retries.iter().map(|retry| retry.foreign.clone()).collect();
            let late: Vec<&ForeignMount> =
                retries.iter().filter(|retry| retry.after_given_up).map(|retry| &retry.foreign).collect();
            let started = Instant::now();
            let mut outcomes = self.executor.retry_containers(&mounts, &top);
            // Found live after a heal given up on: that heal's worker ended
            // late, having replaced it (an isolated mount receives nothing
            // by propagation). Counted as the replacement it was, which the
            // give-up left unreported.
            for (foreign, outcome) in &mut outcomes {
                if matches!(outcome, Ok(ForeignHealed::AlreadyLive)) && late.contains(&&*foreign) {
                    *outcome = Ok(ForeignHealed::Replaced { not_carried: Vec::new() });
                }
            }
            let took_us = started.elapsed().as_micros() as u64;
            let attempts: Vec<_> = retries.into_iter().map(|retry| (retry.foreign, retry.attempts)).collect();
            self.container_outcomes(outcomes, &source, took_us, None, &attempts);
        }
    }

    /// Heals the copies of a connection a heal replaced that a namespace
    /// learnt after that heal holds, from their source's current mount: a
    /// retry due now, so a source down again waits as a retry does.
    pub(super) fn heal_late_copies(&mut self, late: LateCopies) {
        let LateCopies { source, mut mounts } = late;
        // A namespace learnt again may hand over mounts whose heal already
        // waits here (refused, given up, backing off). (The watched
        // namespace's never come: see `Namespaces::heal_as_host`.)
        mounts.retain(|foreign| !self.container_heal_waits(foreign));
        let Some(first) = mounts.first() else { return };
        info!(namespace = first.namespace, pid = first.pid, mounts = mounts.len(), source = %source.display(), "a namespace learnt after a heal holds mounts of the connection it replaced");
        let now = Instant::now();
        self.container_retries.extend(mounts.into_iter().map(|foreign| ContainerRetry {
            foreign,
            source: source.clone(),
            attempts: 0,
            retry_at: now,
            after_given_up: false,
        }));
        self.retry_containers();
    }

    /// Whether a heal of `foreign` (the same mount of the same namespace)
    /// waits for its retry, for a change of its namespace, or for its worker.
    fn container_heal_waits(&self, foreign: &ForeignMount) -> bool {
        let same = |retry: &ContainerRetry| {
            retry.foreign.namespace == foreign.namespace && retry.foreign.mount.mount_id == foreign.mount.mount_id
        };
        self.container_retries.iter().chain(&self.refusals.waiting).any(same)
            || self
                .given_up
                .get(&foreign.namespace)
                .is_some_and(|given_up| given_up.contains_key(&foreign.mount.mount_id))
    }

    /// Logs, counts and reports each outcome. A failure is retried with
    /// back-off unless its namespace is gone or missed the deadline (given
    /// up: it waits for the next heal of its source); one the container's
    /// own doing refused (its mount changed or was covered, or lies below a
    /// mount whose server may never answer) is counted apart. Failures are
    /// logged once per namespace and reason, however many mounts the
    /// namespace holds, so the log grows with namespaces, not mounts.
    /// `attempts` are the failures so far of those that are retries.
    fn container_outcomes(
        &mut self,
        outcomes: Vec<ContainerOutcome>,
        source: &Path,
        took_us: u64,
        latency: Option<u64>,
        attempts: &[(ForeignMount, u32)],
    ) {
        // One instant for the batch: its retries stay one batch, and one
        // line per namespace.
        let now = Instant::now();
        let mut by_pod = BTreeMap::new();
        let mut owners: BTreeMap<u32, Option<PodContainer>> = BTreeMap::new();
        let mut failures: BTreeMap<(u64, Failure), Failures> = BTreeMap::new();
        for (foreign, outcome) in outcomes {
            let (namespace, pid, mount_point) = (foreign.namespace, foreign.pid, foreign.mount.mount_point.display());
            let propagation = match foreign.propagation {
                Propagation::Slave => "slave",
                _ => "private",
            };
            // A namespace's mounts share its process: its cgroup is read once.
            let owner = owners.entry(pid).or_insert_with(|| self.owner(pid)).clone();
            let pod = owner.as_ref().map(|owner| format!("{}/{}", owner.namespace, owner.pod));
            let (pod, container) = (pod.as_deref(), owner.as_ref().map(|owner| owner.container.as_str()));
            let failed_before = attempts.iter().find(|(retried, _)| *retried == foreign).map_or(0, |(_, n)| *n);
            if let Some(owner) = &owner {
                tally(&mut by_pod, owner, &outcome);
            }
            if let Ok(ForeignHealed::Replaced { not_carried } | ForeignHealed::Stacked { not_carried, .. }) = &outcome {
                for lost in not_carried {
                    warn!(pod, container, namespace, pid, mount_point = %lost.mount_point.display(), why = %lost.why, "not carried over to the container's new mount by its heal");
                }
            }
            let result = match &outcome {
                Ok(ForeignHealed::Replaced { .. }) => {
                    info!(pod, container, namespace, pid, mount_point = %mount_point, propagation, how = "replaced", took_us, latency_us = latency, attempts = failed_before, "container healed");
                    "replaced"
                }
                Ok(ForeignHealed::Stacked { why, .. }) => {
                    warn!(pod, container, namespace, pid, mount_point = %mount_point, propagation, how = "stacked", %why, "container healed, but its dead layer remains under the new one");
                    "stacked"
                }
                Ok(ForeignHealed::AlreadyLive) => {
                    debug!(pod, container, namespace, pid, mount_point = %mount_point, "container's mount already live (propagated); nothing to do");
                    "propagated"
                }
                Err(err) if namespace_gone(err) => {
                    info!(pod, container, namespace, pid, mount_point = %mount_point, "container gone before its heal; nothing left to heal");
                    continue;
                }
                Err(err) => {
                    let why = why_failed(err);
                    let failures = failures.entry((namespace, why)).or_insert_with(|| Failures {
                        pid,
                        pod: pod.map(str::to_owned),
                        container: container.map(str::to_owned),
                        first: format!("{}: {}", mount_point, error_chain(err)),
                        mounts: 0,
                        backs_off: false,
                        attempts: failed_before + 1,
                    });
                    failures.mounts += 1;
                    if why == Failure::GivenUp {
                        // Tried again once the namespace's worker ends
                        // (`retry_given_up`); never while one is there.
                        let retry = ContainerRetry {
                            foreign: foreign.clone(),
                            source: source.to_path_buf(),
                            attempts: failed_before + 1,
                            retry_at: now,
                            after_given_up: false,
                        };
                        self.given_up.entry(namespace).or_default().insert(foreign.mount.mount_id, retry);
                    } else {
                        let attempts = failed_before + 1;
                        let retry = ContainerRetry {
                            foreign: foreign.clone(),
                            source: source.to_path_buf(),
                            attempts,
                            retry_at: now + retry_delay(attempts),
                            after_given_up: false,
                        };
                        let backs_off = if why == Failure::Refused { self.wait_for_change(retry) } else { Some(retry) };
                        failures.backs_off |= backs_off.is_some();
                        self.container_retries.extend(backs_off);
                    }
                    why.label()
                }
            };
            self.reporters.report(&Report::ContainerHealed { source, result });
        }
        for ((namespace, why), failed) in failures {
            let Failures { pid, pod, container, first, mounts, attempts, backs_off } = failed;
            let (pod, container) = (pod.as_deref(), container.as_deref());
            let retry_in_ms = backs_off.then(|| retry_delay(attempts).as_millis() as u64);
            match why {
                Failure::Failed => {
                    warn!(pod, container, namespace, pid, mounts, first = %first, attempts, retry_in_ms, "container heal failed; retried");
                }
                Failure::GivenUp => {
                    warn!(pod, container, namespace, pid, mounts, first = %first, "container heal given up: its namespace did not answer in time; tried again once its worker is done")
                }
                Failure::Refused if backs_off => {
                    warn!(pod, container, namespace, pid, mounts, first = %first, attempts, retry_in_ms, "container heal refused: the container changed its mount; retried")
                }
                Failure::Refused => {
                    warn!(pod, container, namespace, pid, mounts, first = %first, attempts, "container heal refused: the container changed its mount; retried at its next mount change")
                }
            }
        }
        for heals in by_pod.values() {
            self.reporters.report(&Report::ContainersHealed { source, heals });
        }
    }

    /// Waits for the next mount change in `retry`'s namespace to retry it;
    /// hands it back where that cannot be watched (it backs off then).
    fn wait_for_change(&mut self, retry: ContainerRetry) -> Option<ContainerRetry> {
        let refusals = &mut self.refusals;
        if refusals.unavailable {
            return Some(retry);
        }
        if refusals.watch.is_none() {
            let events = self.events.clone();
            match NamespaceChanges::start(move || {
                let _ = events.send(Event::NamespacesChanged);
            }) {
                Ok(watch) => refusals.watch = Some(watch),
                Err(err) => {
                    info!(err = %chain(&err), "refused container heals are retried with back-off");
                    refusals.unavailable = true;
                    return Some(retry);
                }
            }
        }
        let namespace = retry.foreign.namespace;
        if !refusals.watched.contains_key(&namespace) {
            let marked = containers::open_namespace(&retry.foreign).map_err(|err| err.to_string()).and_then(|fd| {
                refusals.watch.as_ref().map_or(Ok(()), |watch| watch.watch(fd.as_fd()).map_err(|err| err.to_string()))
            });
            if let Err(err) = marked {
                debug!(namespace, %err, "cannot watch a namespace for its next change; its refused heal backs off");
                return Some(retry);
            }
            refusals.watched.insert(namespace, retry.foreign.clone());
        }
        refusals.waiting.push(retry);
        None
    }

    /// A namespace where heals were refused changed: they are tried again
    /// now, and namespaces none is left waiting in are no longer watched.
    pub(super) fn retry_refused(&mut self) {
        let now = Instant::now();
        let waiting = std::mem::take(&mut self.refusals.waiting);
        self.container_retries.extend(waiting.into_iter().map(|retry| ContainerRetry { retry_at: now, ..retry }));
        self.retry_containers();
        let still: BTreeSet<u64> = self.refusals.waiting.iter().map(|retry| retry.foreign.namespace).collect();
        let refusals = &mut self.refusals;
        let done: Vec<u64> = refusals.watched.keys().filter(|namespace| !still.contains(namespace)).copied().collect();
        for namespace in done {
            let Some(foreign) = refusals.watched.remove(&namespace) else { continue };
            // A namespace gone takes its mark with it.
            if let (Some(watch), Ok(fd)) = (&refusals.watch, containers::open_namespace(&foreign)) {
                let _ = watch.unwatch(fd.as_fd());
            }
        }
    }

    /// The worker of `namespace`, where heals were given up on, ended: they
    /// are tried again now.
    pub(super) fn retry_given_up(&mut self, namespace: u64) {
        let Some(due) = self.given_up.remove(&namespace) else { return };
        let now = Instant::now();
        self.container_retries.extend(due.into_values().map(|retry| ContainerRetry {
            retry_at: now,
            after_given_up: true,
            ..retry
        }));
        self.retry_containers();
    }

    /// The pod and container of a namespace's process, from its cgroup and
    /// the kubelet's last `/pods` list; None without a kubelet or a list
    /// (the log then names the process and namespace only), and for a
    /// namespace that is no pod's container.
    fn owner(&self, pid: u32) -> Option<PodContainer> {
        let listed = self.kubelet.as_ref()?.last_listed()?;
        let cgroups = std::fs::read_to_string(self.proc_root.join(pid.to_string()).join("cgroup")).ok()?;
        container_of(&cgroups, &listed.pods)
    }
}

impl ContainerRetry {
    /// Put back for later, as if it had failed once more.
    fn again(self) -> ContainerRetry {
        let attempts = self.attempts + 1;
        ContainerRetry { attempts, retry_at: Instant::now() + retry_delay(attempts), ..self }
    }
}

/// A namespace's failures of one kind in one heal, logged as one line.
struct Failures {
    pid: u32,
    pod: Option<String>,
    container: Option<String>,
    /// The first mount's, with its error.
    first: String,
    mounts: usize,
    attempts: u32,
    /// Retried on a timer; else at the namespace's next mount change.
    backs_off: bool,
}

/// Counts a container heal into its pod's, by pod UID.
fn tally(
    by_pod: &mut BTreeMap<String, ContainersHealed>,
    owner: &PodContainer,
    healed: &Result<ForeignHealed, ContainerHealError>,
) {
    let heals = by_pod.entry(owner.pod_uid.clone()).or_insert_with(|| ContainersHealed {
        namespace: owner.namespace.clone(),
        pod: owner.pod.clone(),
        pod_uid: owner.pod_uid.clone(),
        ..ContainersHealed::default()
    });
    if let Ok(ForeignHealed::Replaced { not_carried } | ForeignHealed::Stacked { not_carried, .. }) = healed {
        let lost = not_carried.iter().map(|lost| format!("{} in {}", lost.mount_point.display(), owner.container));
        heals.not_carried.extend(lost);
    }
    match healed {
        Ok(ForeignHealed::Replaced { .. }) => heals.replaced += 1,
        Ok(ForeignHealed::Stacked { .. }) => heals.stacked += 1,
        Err(err) if why_failed(err) == Failure::GivenUp => heals.given_up += 1,
        Ok(ForeignHealed::AlreadyLive) | Err(_) => return,
    }
    heals.containers.insert(owner.container.clone());
}

/// The container exited (no process is left in its namespace): nothing to
/// heal, and nothing to retry.
fn namespace_gone(err: &ContainerHealError) -> bool {
    match err {
        ContainerHealError::NamespaceGone { .. } => true,
        ContainerHealError::OpenNamespace { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
        _ => false,
    }
}

/// How a container heal failed, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Failure {
    /// Retried with back-off.
    Failed,
    /// The container changed or covered its mount, or put it below a mount
    /// whose server may never answer: retrying would fail the same way
    /// until it changes again.
    Refused,
    /// Its namespace missed the deadline, or still holds a worker of an
    /// earlier heal.
    GivenUp,
}

impl Failure {
    /// `container_heals_total`'s `result`.
    fn label(self) -> &'static str {
        match self {
            Failure::Failed => "failed",
            Failure::Refused => "refused",
            Failure::GivenUp => "given_up",
        }
    }
}

fn why_failed(err: &ContainerHealError) -> Failure {
    match err {
        ContainerHealError::Deadline { .. } | ContainerHealError::StillHeld { .. } => Failure::GivenUp,
        ContainerHealError::InNamespace(InNamespaceError::Changed { .. } | InNamespaceError::BelowStalling { .. }) => {
            Failure::Refused
        }
        // A symlink or a mount point gone: the container's own doing.
        ContainerHealError::InNamespace(InNamespaceError::Resolve { source, .. })
            if fuse_supervisor_sys::resolve::refused_by_tree(source) =>
        {
            Failure::Refused
        }
        _ => Failure::Failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_namespace_nobody_is_left_in_ends_the_retries() {
        let gone = ContainerHealError::NamespaceGone { pid: 7, expected: 4026531840 };
        assert!(namespace_gone(&gone));
        let exited = ContainerHealError::OpenNamespace { pid: 7, source: std::io::ErrorKind::NotFound.into() };
        assert!(namespace_gone(&exited));
        let refused = ContainerHealError::OpenNamespace { pid: 7, source: std::io::ErrorKind::PermissionDenied.into() };
        assert!(!namespace_gone(&refused));
        let busy = ContainerHealError::Thread { pid: 7, source: std::io::Error::other("no thread") };
        assert!(!namespace_gone(&busy));
    }

    #[test]
    fn container_heals_are_counted_per_pod_and_how() {
        let owner = |pod: &str, container: &str| PodContainer {
            namespace: "default".into(),
            pod: pod.into(),
            pod_uid: format!("uid-{pod}"),
            container: container.into(),
        };
        let mut by_pod = BTreeMap::new();
        let outcome = |healed| Ok(healed);
        tally(&mut by_pod, &owner("a", "app"), &outcome(ForeignHealed::Replaced { not_carried: Vec::new() }));
        tally(
            &mut by_pod,
            &owner("a", "sync"),
            &outcome(ForeignHealed::Stacked { why: std::io::Error::other("busy"), not_carried: Vec::new() }),
        );
        tally(&mut by_pod, &owner("a", "app"), &outcome(ForeignHealed::Replaced { not_carried: Vec::new() }));
        tally(&mut by_pod, &owner("b", "app"), &outcome(ForeignHealed::Replaced { not_carried: Vec::new() }));
        tally(
            &mut by_pod,
            &owner("b", "late"),
            &Err(ContainerHealError::Deadline { pid: 7, namespace: 9, deadline_ms: 1000 }),
        );
        tally(&mut by_pod, &owner("b", "done"), &outcome(ForeignHealed::AlreadyLive));
        let a = &by_pod["uid-a"];
        assert_eq!((a.pod.as_str(), a.replaced, a.stacked), ("a", 2, 1));
        assert_eq!(a.containers, ["app".to_owned(), "sync".to_owned()].into());
        let b = &by_pod["uid-b"];
        assert_eq!((b.replaced, b.stacked, b.given_up), (1, 0, 1));
        assert_eq!(b.containers, ["app".to_owned(), "late".to_owned()].into(), "one already live is no heal");
        assert_eq!(by_pod.len(), 2);
    }
}
