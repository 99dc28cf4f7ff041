//! A storm of pod-directory and mount changes, more than the kernel's
//! inotify and fanotify queues hold, made while the supervisor is frozen
//! (`SIGSTOP`: a node so busy it got no CPU), so that both queues really
//! overflow: the events past the limit are dropped and one overflow event
//! says so. The queues are overflowed by the size of the burst, never by
//! lowering the machine's global limits (`fs.inotify.max_queued_events`,
//! `fs.fanotify.max_queued_events`): other work on the machine shares them.
//! Shared by `tests/overflow.rs`, which asserts what the supervisor knows
//! afterwards, and `benches/overflow.rs`, which times its resyncs.
use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use fuse_supervisor_sys::mount;
use fuse_supervisor_sys::process::{Signal, signal};

use super::Sandbox;
use super::observe::io_step;
use super::scenario::{Daemon, FuseSource, ScenarioError, SupervisorProcess, wait_for};

/// How big the storm is.
#[derive(Clone, Copy, Debug)]
pub struct StormPlan {
    /// Pods with a target before the storm that it keeps.
    pub kept_pods: usize,
    /// Pods with a target before the storm that it deletes (target
    /// unmounted, directory removed, as NodeUnpublish and the kubelet do).
    pub deleted_pods: usize,
    /// Pod directories without volumes before the storm that it deletes.
    pub bare_pods_deleted: usize,
    /// Pod directories the storm creates.
    pub new_pods: usize,
    /// Of those, how many get a target (the source bound into a volume).
    pub new_targets: usize,
    /// Unrelated mount changes in the storm (a tmpfs outside the kubelet
    /// tree mounted and unmounted in turn: two changes each).
    pub mount_changes: usize,
}

impl StormPlan {
    /// 10,000 new pods (100 with a target), and enough deleted pods and
    /// mount changes to exceed this machine's queue limits by 1,000 events
    /// each, whatever the watchers' own share of the events.
    pub fn overflowing() -> io::Result<Self> {
        let inotify = queue_limit("/proc/sys/fs/inotify/max_queued_events")?;
        let fanotify = queue_limit("/proc/sys/fs/fanotify/max_queued_events")?;
        let new_pods = 10_000;
        Ok(StormPlan {
            kept_pods: 5,
            deleted_pods: 5,
            // Each creation and each deletion is one event on `pods/` alone.
            bare_pods_deleted: (inotify + 1000).saturating_sub(new_pods).max(1000),
            new_pods,
            new_targets: 100,
            mount_changes: fanotify + 1000,
        })
    }
}

/// The kernel's limit on one queue, from its sysctl file.
pub fn queue_limit(path: &str) -> io::Result<usize> {
    let text = fs::read_to_string(path)?;
    text.trim().parse().map_err(|_| io::Error::new(io::ErrorKind::InvalidData, format!("{path}: {text:?}")))
}

/// A node with a FUSE source (bindfs) bound into pods, supervised, ready
/// for a storm.
pub struct StormNode {
    // Declared first: it stops before the source and the sandbox go.
    pub supervisor: SupervisorProcess,
    pub source: FuseSource,
    pub plan: StormPlan,
    /// Every target the table should hold after the storm.
    pub targets: BTreeSet<PathBuf>,
    /// Targets whose pods the storm deletes.
    pub deleted_targets: BTreeSet<PathBuf>,
    /// The supervisor's state directory.
    pub state_dir: PathBuf,
    pub sandbox: Arc<Sandbox>,
}

/// Targets of the storm's new pods are in pods `storm-<n>`, the others in
/// `before-<n>`; bare pods are `bare-<n>`.
fn pod_uid(kind: &str, index: usize) -> String {
    format!("{index:08x}-{kind}-4000-8000-000000000000")
}

impl StormNode {
    /// The pods and targets before the storm, then the supervisor (with
    /// fanotify mount events and `extra_args`), once it knows them all.
    pub fn prepare(binary: &Path, plan: StormPlan, extra_args: &[&str]) -> Result<Self, ScenarioError> {
        let sandbox =
            Arc::new(Sandbox::new().map_err(|err| ScenarioError::Io {
                step: "sandbox".into(),
                source: io::Error::other(err.to_string()),
            })?);
        let source = FuseSource::start(&sandbox, Daemon::Bindfs, "shared-data")?;
        let mut targets = BTreeSet::new();
        let mut deleted_targets = BTreeSet::new();
        for index in 0..plan.kept_pods + plan.deleted_pods {
            let target = source.bind_volume(&sandbox, &pod_uid("before", index), "data")?;
            if index < plan.kept_pods {
                targets.insert(target);
            } else {
                deleted_targets.insert(target);
            }
        }
        let pods = sandbox.kubelet_root().join("pods");
        let count = plan.bare_pods_deleted;
        sandbox
            .run(move || (0..count).try_for_each(|index| fs::create_dir_all(pods.join(pod_uid("bare", index)))))
            .map_err(io_step("create the bare pods"))?;
        let state_dir = sandbox.root().join("state");
        let args = ["--kubelet", "none", "--table-events", "fanotify"].iter().chain(extra_args);
        let supervisor = SupervisorProcess::start_with(&sandbox, binary, &state_dir, args)?;
        let node = StormNode { supervisor, source, plan, targets, deleted_targets, state_dir, sandbox };
        let before = plan.kept_pods + plan.deleted_pods;
        node.wait_for_healthy_targets(before, Duration::from_secs(60))?;
        Ok(node)
    }

    /// `fuse_supervisor_targets{state="healthy"}` reaches `count`.
    pub fn wait_for_healthy_targets(&self, count: usize, timeout: Duration) -> Result<(), ScenarioError> {
        let series = r#"fuse_supervisor_targets{state="healthy"}"#;
        let what = format!("{count} healthy targets in the metrics");
        wait_for(&what, timeout, || self.supervisor.metric(series).ok().flatten() == Some(count as f64))
    }

    /// Freezes the supervisor, makes the storm, and thaws it; how long the
    /// storm took, and when the thaw was (just before `SIGCONT`). The thaw
    /// happens even if the storm fails half-way.
    pub fn storm(&mut self) -> Result<(Duration, SystemTime), ScenarioError> {
        let plan = self.plan;
        let pods = self.sandbox.kubelet_root().join("pods");
        let new_targets: Vec<PathBuf> =
            (0..plan.new_targets).map(|index| self.sandbox.pod_volume_dir(&pod_uid("storm", index), "data")).collect();
        let deleted = self.deleted_targets.clone();
        let (source, flood) = (self.source.path.clone(), self.sandbox.root().join("flood"));
        let frozen = Frozen::stop(self.supervisor.pid())?;
        let started = Instant::now();
        let targets = new_targets.clone();
        self.sandbox
            .run(move || storm_in_namespace(&plan, &pods, &source, &targets, &deleted, &flood))
            .map_err(io_step("the storm"))?;
        let (took, thawed) = (started.elapsed(), SystemTime::now());
        drop(frozen);
        self.targets.extend(new_targets);
        Ok((took, thawed))
    }
}

/// The storm itself, on the sandbox's thread.
fn storm_in_namespace(
    plan: &StormPlan,
    pods: &Path,
    source: &Path,
    new_targets: &[PathBuf],
    deleted_targets: &BTreeSet<PathBuf>,
    flood: &Path,
) -> io::Result<()> {
    for index in 0..plan.new_pods {
        fs::create_dir(pods.join(pod_uid("storm", index)))?;
    }
    for target in new_targets {
        fs::create_dir_all(target)?;
        mount::bind(source, target)?;
    }
    for index in 0..plan.bare_pods_deleted {
        fs::remove_dir(pods.join(pod_uid("bare", index)))?;
    }
    for target in deleted_targets {
        mount::detach(target)?;
        let pod = target.strip_prefix(pods).ok().and_then(|rest| rest.components().next());
        let pod = pod.ok_or_else(|| io::Error::other(format!("{} is not in a pod", target.display())))?;
        fs::remove_dir_all(pods.join(pod))?;
    }
    fs::create_dir_all(flood)?;
    for _ in 0..plan.mount_changes.div_ceil(2) {
        mount::mount_tmpfs(flood)?;
        mount::detach(flood)?;
    }
    Ok(())
}

/// A stopped process, continued when dropped.
struct Frozen(u32);

impl Frozen {
    fn stop(pid: u32) -> Result<Self, ScenarioError> {
        signal(pid, Signal::Stop).map_err(io_step("stop the supervisor"))?;
        Ok(Frozen(pid))
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = signal(self.0, Signal::Cont);
    }
}
