//! What the demo is asked to do and what it reports.
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use crate::TestbedError;
use crate::scenario::{Daemon, Restart, ScenarioError};

/// What to run.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// The `fuse-supervisor` binary: it serves demofs, runs the container
    /// model and the supervisor.
    pub binary: PathBuf,
    /// Kill/restart cycles of the FUSE daemon.
    pub cycles: usize,
    /// Which daemon serves the volume. bindfs (libfuse) cannot mount over
    /// its stale mount, so with it every restart unmounts first.
    pub daemon: Daemon,
    /// End with a mount-over-stale restart (demofs only). Off, every restart unmounts first and the node must
    /// end with exactly the mounts it started with.
    pub mount_over_stale: bool,
    /// How long a container may take to read again after a restart before
    /// the demo fails.
    pub recovery_timeout: Duration,
}

impl DemoReport {
    /// Some restart landed the new global mount on a stale one, whose
    /// covered layers no heal could remove: the node cannot end flat.
    pub fn stale_layers_expected(&self) -> bool {
        self.cycles.iter().any(|cycle| cycle.landed_on_stale)
    }
}

impl DemoOptions {
    /// Four cycles of demofs, both restart styles, ten seconds for each
    /// container to recover.
    pub fn new(binary: PathBuf) -> Self {
        DemoOptions {
            binary,
            cycles: 4,
            daemon: Daemon::DemoFs,
            mount_over_stale: true,
            recovery_timeout: Duration::from_secs(10),
        }
    }
}

/// Everything the demo measured. Only returned when every container read
/// again in every cycle.
#[derive(Debug, Clone)]
pub struct DemoReport {
    pub daemon: Daemon,
    /// Mounts under the sandbox once everything was set up.
    pub mounts_at_start: usize,
    pub mounts_at_end: usize,
    pub cycles: Vec<CycleReport>,
}

#[derive(Debug, Clone)]
pub struct CycleReport {
    /// 1-based.
    pub number: usize,
    pub style: Restart,
    /// The new global mount landed on a stale one, so the kernel healed
    /// the whole-volume targets and their stale layers stay underneath.
    pub landed_on_stale: bool,
    pub mounts_before: usize,
    pub mounts_after: usize,
    /// One per pod, in pod order.
    pub pods: Vec<PodRecovery>,
    /// What the supervisor logged, in log order.
    pub heals: Vec<HealRecord>,
    /// FUSE layers at each target (pod order) and at the global mount, after the cycle.
    pub layers: Vec<(String, usize)>,
}

/// What one container saw between the kill and reading again.
#[derive(Debug, Clone)]
pub struct PodRecovery {
    pub pod: String,
    /// Distinct errno names, in the order first seen.
    pub errors: Vec<String>,
    /// From the kill to the first correct read.
    pub outage: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealKind {
    /// The supervisor stacked the new mount on the target.
    Stacked,
    /// A stack on a peer reached this target.
    Propagated,
    /// The daemon's own mount over the stale one reached it; the
    /// supervisor only noticed.
    ByKernel,
}

#[derive(Debug, Clone)]
pub struct HealRecord {
    pub pod: String,
    pub kind: HealKind,
    pub layers_removed: u64,
    /// From the supervisor waking up to the heal being done.
    pub latency: Option<Duration>,
}

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("/dev/fuse does not exist; the demo needs the FUSE device")]
    NoFuseDevice,
    #[error("cannot build the sandbox (the demo needs root and /dev/fuse)")]
    Sandbox(#[source] TestbedError),
    #[error("cannot install SIGINT/SIGTERM handlers")]
    Signals(#[source] io::Error),
    #[error("cannot {step}")]
    Scenario {
        step: String,
        #[source]
        source: ScenarioError,
    },
    #[error("cannot start the container of {pod}")]
    StartReader {
        pod: String,
        #[source]
        source: TestbedError,
    },
    #[error("cycle {cycle}: {pod} never saw the daemon die")]
    NoFailureSeen {
        cycle: usize,
        pod: String,
        #[source]
        source: TestbedError,
    },
    #[error("cycle {cycle}: {pod} did not read its volume again within {waited:?} of the restart; NOT healed")]
    NotRecovered {
        cycle: usize,
        pod: String,
        waited: Duration,
        #[source]
        source: TestbedError,
    },
    #[error("cycle {cycle}: the subPath container {pod} sees {entries:?}, more than its subdirectory")]
    SubpathLeak { cycle: usize, pod: String, entries: Vec<String> },
    #[error("{end} mounts left under the sandbox at the end, {start} at the start: stale layers remain")]
    MountsLeftBehind { start: usize, end: usize },
    #[error("interrupted; the sandbox, its mounts and its processes are gone")]
    Interrupted,
    #[error("cannot write the demo output")]
    Output(#[source] io::Error),
}
