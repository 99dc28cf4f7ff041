//! Which processes belong to which container, from `/proc/<pid>/cgroup`
//! (see [`fuse_supervisor_engine::kube::cgroup`]).
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use fuse_supervisor_engine::kube::cgroup::{MIN_ID_LEN, in_container};
use fuse_supervisor_engine::watch::processes::ProcessId;

/// A process of a container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContainerProcess {
    pub process: ProcessId,
    pub parent: u32,
}

/// The processes of some containers, by container ID, as one pass over
/// `/proc` found them.
#[derive(Debug, Default)]
pub struct ContainerProcesses {
    by_container: BTreeMap<String, Vec<ContainerProcess>>,
}

#[derive(Debug, thiserror::Error)]
#[error("cannot list processes in {path}")]
pub struct ScanError {
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

impl ContainerProcesses {
    /// Finds the processes of the containers `ids` (runtime IDs, without
    /// the `containerd://` prefix). Processes that vanish meanwhile are
    /// left out.
    pub fn scan(proc_root: &Path, ids: &BTreeSet<String>) -> Result<ContainerProcesses, ScanError> {
        let mut found = ContainerProcesses::default();
        let ids: Vec<&String> = ids.iter().filter(|id| id.len() >= MIN_ID_LEN).collect();
        if ids.is_empty() {
            return Ok(found);
        }
        let entries = fs::read_dir(proc_root).map_err(|source| ScanError { path: proc_root.to_path_buf(), source })?;
        for entry in entries.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
            let Ok(cgroups) = fs::read_to_string(entry.path().join("cgroup")) else { continue };
            let Some(id) = ids.iter().find(|id| in_container(&cgroups, id)) else { continue };
            let Some((start_time, parent)) = stat_of(proc_root, pid) else { continue };
            found
                .by_container
                .entry((*id).clone())
                .or_default()
                .push(ContainerProcess { process: ProcessId { pid, start_time }, parent });
        }
        Ok(found)
    }

    /// Every process of the container, by pid.
    pub fn of(&self, id: &str) -> &[ContainerProcess] {
        self.by_container.get(id).map_or(&[], Vec::as_slice)
    }

    /// The container's first process (pid 1 in its pid namespace): the one
    /// whose parent (the runtime's shim) is not in the container. When it
    /// exits the runtime ends the container.
    pub fn main_process(&self, id: &str) -> Option<ProcessId> {
        let processes = self.of(id);
        let mut roots = processes.iter().filter(|p| !processes.iter().any(|other| other.process.pid == p.parent));
        let first = roots.next()?;
        // Two roots: something entered the container (`kubectl exec`);
        // the older one is the container's own.
        Some(roots.fold(
            first.process,
            |oldest, p| {
                if p.process.start_time < oldest.start_time { p.process } else { oldest }
            },
        ))
    }

    /// The container, among `ids`, that `pid` is in.
    pub fn container_of(&self, pid: u32) -> Option<&str> {
        self.by_container
            .iter()
            .find(|(_, processes)| processes.iter().any(|p| p.process.pid == pid))
            .map(|(id, _)| id.as_str())
    }
}

/// Start time and parent pid from `/proc/<pid>/stat`.
fn stat_of(proc_root: &Path, pid: u32) -> Option<(u64, u32)> {
    let line = fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    let after_name = &line[line.rfind(')')? + 1..];
    let mut fields = after_name.split_ascii_whitespace();
    // Fields 3 (state) and 4 (ppid); start time is field 22.
    let parent = fields.nth(1)?.parse().ok()?;
    let start_time = fields.nth(17)?.parse().ok()?;
    Some((start_time, parent))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "4f1bd2c7e0a94b5f8c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b";

    #[test]
    fn own_process_by_stat_and_no_ids_no_scan() {
        let me = std::process::id();
        let (start_time, parent) = stat_of(Path::new("/proc"), me).unwrap();
        assert_eq!(ProcessId::of(Path::new("/proc"), me).unwrap().start_time, start_time);
        assert_eq!(parent, std::os::unix::process::parent_id());
        let none = ContainerProcesses::scan(Path::new("/nonexistent"), &BTreeSet::from(["short".to_owned()])).unwrap();
        assert!(none.of("short").is_empty());
    }

    #[test]
    fn main_process_is_the_root_of_the_tree() {
        let p = |pid, start_time, parent| ContainerProcess { process: ProcessId { pid, start_time }, parent };
        let mut found = ContainerProcesses::default();
        found.by_container.insert(ID.into(), vec![p(20, 5, 10), p(21, 6, 20), p(30, 9, 99), p(31, 9, 30)]);
        assert_eq!(found.main_process(ID), Some(ProcessId { pid: 20, start_time: 5 }));
        assert_eq!(found.container_of(31), Some(ID));
        assert_eq!(found.main_process("other"), None);
    }
}
