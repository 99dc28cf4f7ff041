//! What the supervisor tells the outside world beside its logs: every
//! change worth a Kubernetes Event or a metric passes through one seam, so
//! publishers never reach into the loop and the loop never waits for them.
//!
//! A [`Reporter`] runs on the loop thread: it must return at once (count,
//! or hand the report to a queue of its own).
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::csi::restage::RestageOutcome;
use crate::heal::Healed;
use crate::kube::KubeletError;
use crate::model::state::Owner;

/// The heals in one pod's containers after a host heal.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainersHealed {
    pub namespace: String,
    pub pod: String,
    pub pod_uid: String,
    /// The containers healed, by name.
    pub containers: BTreeSet<String>,
    /// Mounts replaced by a live one: one live layer left.
    pub replaced: usize,
    /// Mounts live again with the live mount stacked on the dead one, which
    /// stays beneath (it could not be slid under it).
    pub stacked: usize,
    /// Mounts given up on for this heal: their namespace did not answer
    /// within the deadline (a tenant's server holding a lookup, say).
    pub given_up: usize,
    /// What the heals could not take over from the dead mounts they
    /// replaced (`<mount point> in <container>`): a mount nested in the
    /// volume no handle could be had on, an idmapping.
    pub not_carried: Vec<String>,
}

/// One thing that happened, borrowed from the loop for the call.
#[derive(Debug)]
pub enum Report<'a> {
    /// The mount table changed and the loop woke for it.
    TableChanged,
    /// A scan finished; the counts are of the whole table.
    Scanned(&'a ScanCounts),
    /// A target was found broken (first sighting of this outage).
    TargetBroken(&'a TargetEvent<'a>),
    /// A heal of one target succeeded.
    TargetHealed { target: &'a TargetEvent<'a>, heal: &'a HealReport },
    /// A heal of one target failed; it is retried after `retry_in`.
    HealFailed { target: &'a TargetEvent<'a>, error: &'a str, attempts: u32, retry_in: Duration },
    /// The kubelet confirmed that the owner of a replaced source restarted.
    DaemonRestarted { source: &'a Path, owner: &'a Owner },
    /// The FUSE daemon serving a source died (`at`: when, as the process
    /// watcher saw it); `targets` were on its connection and are Degraded
    /// until a new mount appears at the source and they are healed.
    DaemonDied { source: &'a Path, pid: u32, at: SystemTime, targets: &'a [PathBuf] },
    /// A target marked Degraded when the last known process serving its
    /// connection exited is healthy again: the discovery that followed
    /// found `pids` still holding the connection (a daemon that daemonized,
    /// or handed its descriptor on).
    DeathRetracted { target: &'a TargetEvent<'a>, pids: &'a [u32] },
    /// A dead daemon's own mount was detached from `source` once nobody
    /// held its connection, so that the daemon's next start mounts on a
    /// directory again; `owner` is the pod last confirmed to serve it.
    DeadSourceDetached { source: &'a Path, owner: Option<&'a Owner> },
    /// `source` was healed `heals` times within `window`: its daemon keeps
    /// crashing. `owner` is the pod last confirmed to serve it.
    DaemonFlapping { source: &'a Path, heals: usize, window: Duration, owner: Option<&'a Owner> },
    /// The process watcher reported an event of a watched daemon:
    /// `exited`, `exec` (a search for a missing daemon), `lost` (events
    /// dropped, all daemons searched again) or `failed`.
    ProcessEvent { kind: &'static str },
    /// A mount of a dead connection in another namespace (a container) was
    /// dealt with after the host heal of `source`: `result` is `replaced`
    /// (one live layer left), `stacked` (the dead one under it),
    /// `propagated` (live already), `failed` (retried), `refused` (the
    /// container changed its mount) or `given_up` (its namespace missed the
    /// deadline).
    ContainerHealed { source: &'a Path, result: &'static str },
    /// After the host heal from `source`, one pod's containers were healed
    /// in their own mount namespaces: published apart from the targets'
    /// heals, which it follows, so that it never delays them.
    ContainersHealed { source: &'a Path, heals: &'a ContainersHealed },
    /// A watcher lost events and its view was read again from scratch:
    /// `watch` is `pods` (the pod directories), `mounts` (the mount table)
    /// or `processes` (the FUSE daemons); `reason` why events were lost
    /// (`overflow`: the kernel's queue or buffer; `backlog`: events came
    /// faster than the watcher read them).
    Resynced { watch: &'static str, reason: &'static str },
    /// One kubelet `/pods` call ended.
    KubeletAnswered { result: Result<(), &'a KubeletError>, took: Duration },
    /// A re-staging through a CSI driver ended, or one of its attempts
    /// failed: counted once (`restages_total`).
    Restage(&'a RestageOutcome),
    /// The same, for one pod of the volume (its Event).
    VolumeRestage { outcome: &'a RestageOutcome, pod_uid: &'a str },
}

impl Report<'_> {
    /// The target a report is about, if it is about one.
    pub fn target(&self) -> Option<&TargetEvent<'_>> {
        match self {
            Report::TargetBroken(target)
            | Report::TargetHealed { target, .. }
            | Report::HealFailed { target, .. }
            | Report::DeathRetracted { target, .. } => Some(target),
            _ => None,
        }
    }
}

/// Targets by state and sources, after a scan.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ScanCounts {
    pub mounts: usize,
    pub sources: usize,
    pub healthy: usize,
    pub broken: usize,
    pub healing: usize,
    pub failed: usize,
}

/// The target a report is about, and the application pod it belongs to.
#[derive(Debug)]
pub struct TargetEvent<'a> {
    pub target: &'a Path,
    /// Empty for a source's bind outside the pods (a CSI staging path).
    pub pod_uid: &'a str,
    pub source: &'a Path,
    /// When the outage began: the target was first seen broken then.
    pub broken_since: Option<SystemTime>,
}

/// What a successful heal did.
#[derive(Debug, Clone)]
pub struct HealReport {
    pub how: Healed,
    /// From the wake-up on the new global mount to this target healed.
    pub latency: Duration,
    /// Of `latency`, the wait for the new source to answer its probe: the
    /// FUSE daemon's own start-up, which no heal can shorten. None when the
    /// heal needed no probe.
    pub source_wait: Option<Duration>,
    /// From the start of the outage to this target healed, when known.
    pub outage: Option<Duration>,
    pub layers_removed: usize,
}

/// Receives reports on the loop thread; must not block.
pub trait Reporter: Send + Sync {
    fn report(&self, report: &Report<'_>);
}

/// Every reporter the supervisor was given.
#[derive(Clone, Default)]
pub struct Reporters(Vec<Arc<dyn Reporter>>);

impl Reporters {
    pub fn new(reporters: Vec<Arc<dyn Reporter>>) -> Self {
        Reporters(reporters)
    }

    pub fn push(&mut self, reporter: Arc<dyn Reporter>) {
        self.0.push(reporter);
    }

    pub fn report(&self, report: &Report<'_>) {
        for reporter in &self.0 {
            reporter.report(report);
        }
    }
}

impl std::fmt::Debug for Reporters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reporters({})", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[derive(Default)]
    struct Recorder(Mutex<Vec<String>>);

    impl Reporter for Recorder {
        fn report(&self, report: &Report<'_>) {
            let line = match report {
                Report::TableChanged => "table".to_owned(),
                Report::Scanned(counts) => format!("scanned {}", counts.mounts),
                other => format!("{other:?}"),
            };
            self.0.lock().unwrap().push(line);
        }
    }

    #[test]
    fn every_reporter_receives_every_report_in_order() {
        let first = Arc::new(Recorder::default());
        let second = Arc::new(Recorder::default());
        let reporters = Reporters::new(vec![first.clone(), second.clone()]);
        reporters.report(&Report::TableChanged);
        reporters.report(&Report::Scanned(&ScanCounts { mounts: 7, ..ScanCounts::default() }));
        for recorder in [first, second] {
            assert_eq!(*recorder.0.lock().unwrap(), ["table", "scanned 7"]);
        }
    }
}
