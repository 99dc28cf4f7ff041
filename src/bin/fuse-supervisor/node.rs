//! Where the node agent works: the flags `run`, `status` and `heal` share.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use fuse_supervisor::supervisor::daemons::DaemonWatch;
use fuse_supervisor::supervisor::{Config, ContainerNamespaces};
use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::heal::priority::HealPriority;
use fuse_supervisor_engine::plan::layout::{self, SourceLayouts};
use fuse_supervisor_engine::report::Reporters;
use fuse_supervisor_engine::watch::mount_table::{TableEvents, WatchMode};

use crate::flags::parse_duration;

#[derive(Debug, Args)]
#[command(next_help_heading = "Node")]
pub(crate) struct NodeArgs {
    /// The kubelet's root directory; pod targets live under <root>/pods.
    #[arg(long, default_value = "/var/lib/kubelet", env = "FUSE_SUPERVISOR_KUBELET_ROOT")]
    pub(crate) kubelet_root: PathBuf,
    /// Where the learned target → source mapping is kept.
    #[arg(long, default_value = "/var/lib/fuse-supervisor", env = "FUSE_SUPERVISOR_STATE_DIR")]
    pub(crate) state_dir: PathBuf,
    /// The mount namespace to watch and heal (the host's by default).
    #[arg(long, default_value = "/proc/1/ns/mnt", env = "FUSE_SUPERVISOR_MOUNT_NAMESPACE")]
    pub(crate) mount_namespace: PathBuf,
    /// A directory in that namespace for a private staging tmpfs, where
    /// new mounts are parked while the stale layers under them are removed.
    #[arg(long, default_value = "/run/fuse-supervisor", env = "FUSE_SUPERVISOR_STAGING_DIR")]
    pub(crate) staging_dir: PathBuf,
    /// How long a FUSE source may take to answer a health probe.
    #[arg(long, default_value = "2s", value_parser = parse_duration, env = "FUSE_SUPERVISOR_PROBE_TIMEOUT")]
    pub(crate) probe_timeout: Duration,
    /// SCHED_FIFO priority of the threads that heal (the loop only while a
    /// heal is due), so that a busy node's containers do not slow the heal
    /// down; 0 runs them at the normal priority. Needs CAP_SYS_NICE.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=99), env = "FUSE_SUPERVISOR_REALTIME_PRIORITY")]
    pub(crate) realtime_priority: u8,
    /// Fluid's mount root: sources at <root>/<runtime>/<namespace>/<dataset>/<runtime>-fuse.
    #[arg(long, default_value = layout::DEFAULT_FLUID_MOUNT_ROOT, env = "FUSE_SUPERVISOR_FLUID_MOUNT_ROOT")]
    pub(crate) fluid_mount_root: PathBuf,
    /// Where the JuiceFS CSI driver's mount pods mount: <root>/<volumeHandle>-<suffix>.
    #[arg(long, default_value = layout::DEFAULT_JUICEFS_MOUNT_ROOT, env = "FUSE_SUPERVISOR_JUICEFS_MOUNT_ROOT")]
    pub(crate) juicefs_mount_root: PathBuf,
    /// A TOML file of source path templates per CSI driver, for drivers
    /// whose layout is not built in.
    #[arg(long, value_name = "FILE", env = "FUSE_SUPERVISOR_LAYOUT_CONFIG")]
    pub(crate) layout_config: Option<PathBuf>,
}

impl NodeArgs {
    /// The built-in layouts and the rules of `--layout-config`, which must
    /// read and parse.
    pub(crate) fn layouts(&self) -> anyhow::Result<SourceLayouts> {
        let layouts = SourceLayouts::new(&self.kubelet_root)
            .with_fluid_mount_root(&self.fluid_mount_root)
            .with_juicefs_mount_root(&self.juicefs_mount_root);
        match &self.layout_config {
            Some(rules) => Ok(layouts.with_rules_from(rules)?),
            None => Ok(layouts),
        }
    }

    pub(crate) fn config(&self) -> anyhow::Result<Config> {
        let layouts = self.layouts()?;
        Ok(Config {
            kubelet_root: self.kubelet_root.clone(),
            state_dir: self.state_dir.clone(),
            mount_namespace: self.mount_namespace.clone(),
            staging_dir: self.staging_dir.clone(),
            probe_timeout: self.probe_timeout,
            kubelet: None,
            layouts,
            reporters: Reporters::default(),
            pod_scope: None,
            job: None,
            daemons: DaemonWatch::default(),
            watch: WatchMode::Events(TableEvents::Auto),
            health: Arc::default(),
            heal_priority: HealPriority::realtime(self.realtime_priority),
            container_namespaces: ContainerNamespaces::Events,
            container_deadline: fuse_supervisor_engine::heal::containers::DEFAULT_DEADLINE,
            restage: None,
        })
    }
}

/// Descriptors the table is grown to hold before any thread starts: a heal
/// holds about three per target, so this covers batches of a thousand.
pub(crate) const DESCRIPTORS_RESERVED: u32 = 4096;

/// Readies the process for heals before any thread is started: raises the
/// open-file limit and grows the descriptor table ahead of the first heal
/// (sys::fds says why), and gives large scan buffers pages of their own,
/// returned when freed (sys::memory): with 10,000 targets this halves the
/// idle footprint.
pub(crate) fn prepare_process() {
    if !fuse_supervisor_sys::memory::set_mmap_threshold(128 * 1024) {
        tracing::debug!("allocator keeps its own mmap threshold");
    }
    match fuse_supervisor_sys::fds::raise_open_file_limit() {
        Ok(limit) => tracing::debug!(?limit, "open-file limit"),
        Err(err) => tracing::warn!(err = %chain(&err), "cannot raise the open-file limit"),
    }
    if let Err(err) = fuse_supervisor_sys::fds::reserve_descriptors(DESCRIPTORS_RESERVED) {
        tracing::warn!(err = %chain(&err), "cannot grow the descriptor table ahead; the first large heal will wait for it");
    }
}
