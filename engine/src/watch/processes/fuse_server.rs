//! Which processes serve a FUSE mount: those holding a `/dev/fuse`
//! descriptor attached to the mount's connection.
//!
//! How a descriptor is tied to a connection:
//!
//! - **Exact** (verified on 6.18; the kernel change is from mid-2025, so
//!   6.16 or 6.17): the fdinfo of a `/dev/fuse`
//!   descriptor has `fuse_connection: <id>` once the descriptor serves a
//!   mount, where `<id>` is the connection's device number in the kernel's
//!   encoding (`major << 20 | minor`; for the anonymous `0:N` device of a
//!   `fuse` mount it is `N`), the name of its directory under
//!   `/sys/fs/fuse/connections/`. Every holder is found, e.g. a parent that
//!   keeps the descriptor to hand it to a restarted daemon as well as the
//!   daemon itself.
//! - **Fallback** (older kernels, where nothing in `/proc` or `/sys` ties a
//!   descriptor to a connection): among the processes holding `/dev/fuse`
//!   open, those whose mount namespace has a mount of the device; if that
//!   leaves several (daemons sharing a namespace), the one whose command line
//!   names the mount point as it sees it. Anything still ambiguous is an
//!   error rather than a guess: watching the wrong process would report a
//!   death that did not happen.
//!
//! Nothing here touches a FUSE file: only `/proc` links and text files are
//! read, so a stopped daemon cannot make the scan hang.
use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use tracing::debug;

use super::{ProcessId, read_stat};
use crate::errors::chain;
use crate::model::namespace_table::{self, NamespaceTable, TableCaps};

/// Kernel release from which every attached `/dev/fuse` descriptor surely
/// shows its connection in fdinfo (the later of the two it may have landed
/// in). A scan that sees the field at all knows the kernel has it, whatever
/// its version (6.16, backports); the version only matters when no
/// descriptor on the node shows one.
const FDINFO_CONNECTION_SINCE: (u32, u32) = (6, 17);

/// The device of a FUSE mount, as mountinfo shows it (`major:minor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MountDevice {
    pub major: u32,
    pub minor: u32,
}

impl MountDevice {
    /// The connection's number in fdinfo and `/sys/fs/fuse/connections/`:
    /// the kernel's `dev_t` (`MKDEV`: 20 minor bits), not the userspace one.
    pub fn connection(self) -> u32 {
        (self.major << 20) | self.minor
    }
}

impl fmt::Display for MountDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

/// How the serving processes were told apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatchedBy {
    /// Their descriptors' fdinfo names the connection: exact.
    Connection,
    /// The only `/dev/fuse` holders whose mount namespace has the mount.
    MountNamespace,
    /// As above, and the only one whose command line names the mount point.
    CommandLine,
}

/// The processes serving one mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Serving {
    /// By pid; empty when no process holds the connection (a dead daemon).
    pub processes: Vec<ProcessId>,
    pub matched_by: MatchedBy,
}

#[derive(Debug, thiserror::Error)]
pub enum FuseServerError {
    #[error("cannot list processes in {path}")]
    ListProcesses {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "cannot tell which of processes {pids:?} serves FUSE device {device}: this kernel does not show connections in /dev/fuse fdinfo and their namespaces and command lines do not decide"
    )]
    Ambiguous { device: MountDevice, pids: Vec<u32> },
}

/// One pass over `/proc`: every process holding `/dev/fuse`, by connection.
#[derive(Debug, Clone)]
pub struct FuseServers {
    proc_root: PathBuf,
    by_connection: BTreeMap<u32, Vec<ProcessId>>,
    /// Holders of a `/dev/fuse` descriptor whose fdinfo names no connection:
    /// not attached yet, or a kernel that does not show it.
    unattributed: Vec<ProcessId>,
    kernel_shows_connections: bool,
}

impl FuseServers {
    /// Scans `<proc_root>/*/fd`. Processes that vanish or change during the
    /// scan, or whose descriptors cannot be read, are left out.
    pub fn scan(proc_root: &Path) -> Result<FuseServers, FuseServerError> {
        Self::scan_between(proc_root, || {})
    }

    /// [`FuseServers::scan`], calling `between` before each process: a walk
    /// of a large node's processes can pause there for something more
    /// urgent.
    pub fn scan_between(proc_root: &Path, mut between: impl FnMut()) -> Result<FuseServers, FuseServerError> {
        let entries = fs::read_dir(proc_root)
            .map_err(|source| FuseServerError::ListProcesses { path: proc_root.to_path_buf(), source })?;
        let mut servers = FuseServers {
            proc_root: proc_root.to_path_buf(),
            by_connection: BTreeMap::new(),
            unattributed: Vec::new(),
            kernel_shows_connections: kernel_release(proc_root)
                .is_some_and(|release| release >= FDINFO_CONNECTION_SINCE),
        };
        let mut pids: Vec<u32> =
            entries.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok()).collect();
        pids.sort_unstable();
        for pid in pids {
            between();
            let Ok(Some(before)) = read_stat(proc_root, pid) else { continue };
            let held = match fuse_descriptors(proc_root, pid) {
                Ok(held) => held,
                Err(err) => {
                    debug!(pid, err = %chain(&err), "cannot list the descriptors of a process");
                    continue;
                }
            };
            if held.is_empty() {
                continue;
            }
            // The same process from start to end of its listing, or nothing.
            let process = ProcessId { pid, start_time: before.start_time };
            match read_stat(proc_root, pid) {
                Ok(Some(after)) if after.start_time == before.start_time => {}
                _ => continue,
            }
            for connection in held {
                match connection {
                    Some(id) => {
                        servers.kernel_shows_connections = true;
                        let holders = servers.by_connection.entry(id).or_default();
                        if !holders.contains(&process) {
                            holders.push(process);
                        }
                    }
                    None if !servers.unattributed.contains(&process) => servers.unattributed.push(process),
                    None => {}
                }
            }
        }
        Ok(servers)
    }

    /// The processes serving the FUSE mount on `device`.
    pub fn serving(&self, device: MountDevice) -> Result<Serving, FuseServerError> {
        if let Some(processes) = self.by_connection.get(&device.connection()) {
            return Ok(Serving { processes: processes.clone(), matched_by: MatchedBy::Connection });
        }
        if self.kernel_shows_connections {
            // Nobody holds the connection: its daemon is gone.
            return Ok(Serving { processes: Vec::new(), matched_by: MatchedBy::Connection });
        }
        self.serving_by_namespace(device)
    }

    /// Every connection seen and its holders.
    pub fn connections(&self) -> impl Iterator<Item = (u32, &[ProcessId])> {
        self.by_connection.iter().map(|(&id, holders)| (id, holders.as_slice()))
    }

    /// The fallback for kernels that do not name the connection.
    fn serving_by_namespace(&self, device: MountDevice) -> Result<Serving, FuseServerError> {
        let in_namespace: Vec<(ProcessId, Vec<PathBuf>)> = self
            .unattributed
            .iter()
            .filter_map(|&process| {
                let table = namespace_table::read(&self.proc_root, process.pid, &TableCaps::DEFAULT).ok()??;
                let points = mount_points_of(&table, device);
                (!points.is_empty()).then_some((process, points))
            })
            .collect();
        if in_namespace.len() <= 1 {
            let processes = in_namespace.into_iter().map(|(process, _)| process).collect();
            return Ok(Serving { processes, matched_by: MatchedBy::MountNamespace });
        }
        let named: Vec<ProcessId> = in_namespace
            .iter()
            .filter(|(process, points)| {
                command_line(&self.proc_root, process.pid)
                    .is_some_and(|args| args.iter().any(|arg| points.iter().any(|point| same_path(arg, point))))
            })
            .map(|(process, _)| *process)
            .collect();
        if named.len() == 1 {
            return Ok(Serving { processes: named, matched_by: MatchedBy::CommandLine });
        }
        Err(FuseServerError::Ambiguous { device, pids: in_namespace.iter().map(|(process, _)| process.pid).collect() })
    }
}

/// The connections of every `/dev/fuse` descriptor of `pid` (`None`: the
/// fdinfo names none). Only links naming a `fuse` device are looked at.
fn fuse_descriptors(proc_root: &Path, pid: u32) -> io::Result<Vec<Option<u32>>> {
    let process = proc_root.join(pid.to_string());
    let mut held = Vec::new();
    for entry in fs::read_dir(process.join("fd"))? {
        let name = entry?.file_name();
        // Reading a link resolves nothing: no FUSE request is made.
        let Ok(target) = fs::read_link(process.join("fd").join(&name)) else { continue };
        if target.file_name().is_none_or(|file| file != "fuse") {
            continue;
        }
        let Ok(info) = fs::read_to_string(process.join("fdinfo").join(&name)) else { continue };
        match fdinfo_connection(&info) {
            Some(id) => held.push(Some(id)),
            // Without the field only the real device path is trusted.
            None if target == Path::new("/dev/fuse") => held.push(None),
            None => {}
        }
    }
    Ok(held)
}

/// `fuse_connection:\t<id>` of a `/dev/fuse` fdinfo.
fn fdinfo_connection(info: &str) -> Option<u32> {
    info.lines().find_map(|line| line.strip_prefix("fuse_connection:")?.trim().parse().ok())
}

/// `(major, minor)` of `<proc_root>/sys/kernel/osrelease` (`6.18.44-…`).
fn kernel_release(proc_root: &Path) -> Option<(u32, u32)> {
    let release = fs::read_to_string(proc_root.join("sys/kernel/osrelease")).ok()?;
    let mut numbers = release.trim().split(['.', '-']).map(str::parse::<u32>);
    Some((numbers.next()?.ok()?, numbers.next()?.ok()?))
}

/// Mount points of the FUSE mounts on device `wanted` in a namespace's
/// table (read within the caps: a line refused or over them names none).
fn mount_points_of(table: &NamespaceTable, wanted: MountDevice) -> Vec<PathBuf> {
    table
        .fuse_mounts
        .iter()
        .filter(|mount| (mount.dev.major, mount.dev.minor) == (wanted.major, wanted.minor))
        .map(|mount| mount.mount_point.clone())
        .collect()
}

fn command_line(proc_root: &Path, pid: u32) -> Option<Vec<String>> {
    let raw = fs::read(proc_root.join(pid.to_string()).join("cmdline")).ok()?;
    Some(
        raw.split(|&byte| byte == 0)
            .filter(|arg| !arg.is_empty())
            .map(|arg| String::from_utf8_lossy(arg).into())
            .collect(),
    )
}

fn same_path(arg: &str, point: &Path) -> bool {
    let arg = arg.trim_end_matches('/');
    !arg.is_empty() && Path::new(arg) == point
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_number_is_the_kernel_dev_t() {
        assert_eq!(MountDevice { major: 0, minor: 39 }.connection(), 39);
        assert_eq!(MountDevice { major: 8, minor: 1 }.connection(), (8 << 20) | 1);
        assert_eq!(MountDevice { major: 0, minor: 39 }.to_string(), "0:39");
    }

    #[test]
    fn fdinfo_and_mountinfo_fields() {
        let info = "pos:\t0\nflags:\t0100002\nmnt_id:\t58\nino:\t90\nfuse_connection:\t39\n";
        assert_eq!(fdinfo_connection(info), Some(39));
        assert_eq!(fdinfo_connection("pos:\t0\nflags:\t0100002\n"), None);
        let table = "36 35 0:39 / /mnt/with\\040space rw - fuse.bindfs bindfs rw\n37 35 0:40 / /other rw - fuse x rw\n\
                     38 35 0:39 / /mnt/nul\\000 rw - fuse.bindfs bindfs rw\n39 35 0:39 / /mnt/\u{e9} rw - fuse x rw\n";
        let device = |minor| MountDevice { major: 0, minor };
        let points = [PathBuf::from("/mnt/with space"), PathBuf::from("/mnt/\u{e9}")];
        let table = namespace_table::stream(table.as_bytes(), &TableCaps::DEFAULT).unwrap();
        assert_eq!(mount_points_of(&table, device(39)), points, "the NUL line is refused");
        assert!(mount_points_of(&table, device(41)).is_empty());
    }

    /// A fake `/proc` for the cases a 6.18 kernel cannot produce.
    struct FakeProc {
        root: tempfile::TempDir,
    }

    impl FakeProc {
        fn new(release: &str) -> FakeProc {
            let root = tempfile::tempdir().unwrap();
            fs::create_dir_all(root.path().join("sys/kernel")).unwrap();
            fs::write(root.path().join("sys/kernel/osrelease"), release).unwrap();
            FakeProc { root }
        }

        /// A process holding `/dev/fuse` as fd 4 (with `connection` in its
        /// fdinfo if given), in a namespace whose table is `mountinfo`.
        fn process(&self, pid: u32, connection: Option<u32>, mountinfo: &str, cmdline: &[&str]) {
            let dir = self.root.path().join(pid.to_string());
            fs::create_dir_all(dir.join("fd")).unwrap();
            fs::create_dir_all(dir.join("fdinfo")).unwrap();
            let stat = format!("{pid} (daemon) S 1 {pid} {pid} 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {} 0 0\n", 1000 + pid);
            fs::write(dir.join("stat"), stat).unwrap();
            std::os::unix::fs::symlink("/dev/fuse", dir.join("fd/4")).unwrap();
            std::os::unix::fs::symlink("/tmp/some/file", dir.join("fd/5")).unwrap();
            let field = connection.map(|id| format!("fuse_connection:\t{id}\n")).unwrap_or_default();
            fs::write(dir.join("fdinfo/4"), format!("pos:\t0\nflags:\t0100002\n{field}")).unwrap();
            fs::write(dir.join("mountinfo"), mountinfo).unwrap();
            fs::write(dir.join("cmdline"), cmdline.join("\0") + "\0").unwrap();
        }

        fn scan(&self) -> FuseServers {
            FuseServers::scan(self.root.path()).unwrap()
        }
    }

    const SHARED_NS: &str = "30 1 0:39 / /mnt/a rw - fuse.a a rw\n31 1 0:40 / /mnt/b rw - fuse.b b rw\n";
    const DEVICE_A: MountDevice = MountDevice { major: 0, minor: 39 };

    #[test]
    fn exact_match_by_connection_and_nobody_for_a_dead_one() {
        let proc = FakeProc::new("6.18.44-fc\n");
        proc.process(100, Some(39), SHARED_NS, &["daemon-a", "/mnt/a"]);
        proc.process(101, Some(40), SHARED_NS, &["daemon-b", "/mnt/b"]);
        proc.process(102, Some(39), SHARED_NS, &["keeper"]);
        let servers = proc.scan();
        let serving = servers.serving(DEVICE_A).unwrap();
        assert_eq!(serving.matched_by, MatchedBy::Connection);
        assert_eq!(serving.processes.iter().map(|p| p.pid).collect::<Vec<_>>(), vec![100, 102]);
        assert_eq!(serving.processes[0].start_time, 1100);
        assert!(servers.serving(MountDevice { major: 0, minor: 41 }).unwrap().processes.is_empty());
    }

    #[test]
    fn fallback_by_namespace_then_command_line() {
        let proc = FakeProc::new("6.1.0-18-amd64\n");
        let other_ns = "30 1 0:50 / /elsewhere rw - fuse.c c rw\n";
        proc.process(200, None, SHARED_NS, &["daemon-a", "-f", "/mnt/a/"]);
        proc.process(201, None, SHARED_NS, &["daemon-b", "/mnt/b"]);
        proc.process(202, None, other_ns, &["daemon-c", "/mnt/a"]);
        let servers = proc.scan();
        let serving = servers.serving(DEVICE_A).unwrap();
        assert_eq!(serving.matched_by, MatchedBy::CommandLine);
        assert_eq!(serving.processes.iter().map(|p| p.pid).collect::<Vec<_>>(), vec![200]);
        let alone = servers.serving(MountDevice { major: 0, minor: 50 }).unwrap();
        assert_eq!(alone.matched_by, MatchedBy::MountNamespace);
        assert_eq!(alone.processes.iter().map(|p| p.pid).collect::<Vec<_>>(), vec![202]);
    }

    #[test]
    fn fallback_refuses_to_guess() {
        let proc = FakeProc::new("5.15.0\n");
        proc.process(300, None, SHARED_NS, &["daemon", "--config", "x"]);
        proc.process(301, None, SHARED_NS, &["daemon", "--config", "y"]);
        let err = proc.scan().serving(DEVICE_A).unwrap_err();
        assert!(matches!(&err, FuseServerError::Ambiguous { pids, .. } if *pids == vec![300, 301]), "{err:?}");
        assert!(err.to_string().contains("FUSE device 0:39"), "{err}");
    }

    #[test]
    fn the_walk_can_pause_before_each_process() {
        let proc = FakeProc::new("6.18.44-fc\n");
        proc.process(100, Some(39), SHARED_NS, &["daemon-a"]);
        proc.process(101, Some(40), SHARED_NS, &["daemon-b"]);
        let mut pauses = 0;
        let servers = FuseServers::scan_between(proc.root.path(), || pauses += 1).unwrap();
        assert_eq!(pauses, 2);
        assert_eq!(servers.serving(DEVICE_A).unwrap().processes.iter().map(|p| p.pid).collect::<Vec<_>>(), vec![100]);
    }

    #[test]
    fn a_connection_field_anywhere_disables_the_fallback() {
        // An old version number but the field present (a backport): an
        // unattached descriptor is not a server.
        let proc = FakeProc::new("5.14.0-rhel\n");
        proc.process(400, Some(40), SHARED_NS, &["daemon-b", "/mnt/b"]);
        proc.process(401, None, SHARED_NS, &["daemon-a", "/mnt/a"]);
        let serving = proc.scan().serving(DEVICE_A).unwrap();
        assert_eq!(serving, Serving { processes: Vec::new(), matched_by: MatchedBy::Connection });
    }
}
