//! Which container of a pod is its FUSE container: the one whose processes
//! serve the FUSE mounts that the pod's running containers see, whatever
//! its name.
use std::collections::BTreeSet;
use std::path::Path;

use tracing::{debug, warn};

use super::containers::ContainerProcesses;
use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::kube::Pod;
use fuse_supervisor_engine::kube::pods::runtime_id;
use fuse_supervisor_engine::model::namespace_table::{self, TableCaps};
use fuse_supervisor_engine::watch::processes::ProcessId;
use fuse_supervisor_engine::watch::processes::fuse_server::{FuseServers, MountDevice};

/// The container whose processes serve the pod's FUSE connection(s).
#[derive(Debug, Clone)]
pub(super) struct Fuse {
    pub(super) container: String,
    pub(super) container_id: String,
    pub(super) servers: Vec<ProcessId>,
    pub(super) devices: Vec<MountDevice>,
}

/// The container of `pod` whose processes serve a FUSE mount, and those
/// mounts' devices: the FUSE mounts seen in each running container's mount
/// namespace, whose serving processes are in one container of the pod.
pub(super) fn identify_fuse(
    pod: &Pod,
    processes: &ContainerProcesses,
    servers: &mut Option<FuseServers>,
    proc_root: &Path,
) -> Option<Fuse> {
    let running: Vec<(&str, &str)> = pod
        .status
        .container_statuses
        .iter()
        .chain(&pod.status.init_container_statuses)
        .filter(|status| status.is_running())
        .filter_map(|status| Some((status.name.as_str(), runtime_id(status.container_id.as_deref()?))))
        .collect();
    let mut devices = BTreeSet::new();
    for (_, id) in &running {
        if let Some(main) = processes.main_process(id) {
            devices.extend(fuse_devices_seen_by(proc_root, main.pid));
        }
    }
    if devices.is_empty() {
        return None;
    }
    if servers.is_none() {
        match FuseServers::scan(proc_root) {
            Ok(scan) => *servers = Some(scan),
            Err(err) => {
                warn!(err = %chain(&err), "cannot find FUSE servers");
                return None;
            }
        }
    }
    let servers = servers.as_ref()?;
    let mut found: Option<Fuse> = None;
    for device in devices {
        let serving = match servers.serving(device) {
            Ok(serving) => serving,
            Err(err) => {
                debug!(%device, err = %chain(&err), "cannot tell who serves a FUSE mount");
                continue;
            }
        };
        for process in serving.processes {
            let Some(id) = processes.container_of(process.pid) else { continue };
            let Some(&(name, _)) = running.iter().find(|(_, running_id)| *running_id == id) else { continue };
            let fuse = found.get_or_insert_with(|| Fuse {
                container: name.to_owned(),
                container_id: id.to_owned(),
                servers: Vec::new(),
                devices: Vec::new(),
            });
            if fuse.container_id != id {
                // Two FUSE containers in one pod: the first one (in status
                // order) is ended; say so.
                warn!(pod = %pod.metadata.name, first = %fuse.container, other = %name, "several FUSE containers; handling the first");
                continue;
            }
            if !fuse.servers.contains(&process) {
                fuse.servers.push(process);
            }
            if !fuse.devices.contains(&device) {
                fuse.devices.push(device);
            }
        }
    }
    found
}

/// Devices of the FUSE mounts in the mount namespace of `pid`, read within
/// the table caps (a tenant makes its table as big as it likes).
fn fuse_devices_seen_by(proc_root: &Path, pid: u32) -> Vec<MountDevice> {
    let Ok(Some(table)) = namespace_table::read(proc_root, pid, &TableCaps::DEFAULT) else { return Vec::new() };
    if table.overflow.any() {
        debug!(pid, overflow = ?table.overflow, "a container's mount table is over a cap; its FUSE mounts past it are left out");
    }
    table.fuse_mounts.iter().map(|m| MountDevice { major: m.dev.major, minor: m.dev.minor }).collect()
}
