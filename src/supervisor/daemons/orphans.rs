//! Connections whose serving process exited while other processes still
//! hold them: checked until a holder reads the device, nobody holds them,
//! or requests wait unread and `--abort-dead-connections` aborts them.
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::discovery::lock;
use super::{Aborted, Daemons, PartialExit};
use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::model::table::Dev;
use fuse_supervisor_engine::watch::processes::fuse_server::MountDevice;

/// A connection with a serving process gone and others holding it.
#[derive(Debug)]
pub(super) struct Orphan {
    source: PathBuf,
    pid: u32,
    exited_at: Instant,
    attempts: u32,
    pub(super) check_at: Instant,
}

impl Daemons {
    /// Starts checking a partly exited connection for waiting requests
    /// that nobody reads.
    pub fn watch_orphan(&mut self, exit: &PartialExit, pid: u32, exited_at: Instant) {
        let orphan = Orphan { source: exit.source.clone(), pid, exited_at, attempts: 0, check_at: Instant::now() };
        self.orphans.insert(exit.dev, orphan);
    }

    /// One check of an orphaned connection; the entry goes once decided.
    pub(super) fn check_orphan(&mut self, dev: Dev, now: Instant) -> Option<Aborted> {
        let remaining: Vec<u32> = lock(&self.holders)
            .iter()
            .filter(|(_, holder)| holder.serves.iter().any(|(_, served)| *served == dev))
            .map(|(&pid, _)| pid)
            .collect();
        let orphan = self.orphans.get_mut(&dev)?;
        let source = orphan.source.clone();
        // Nobody left: the kernel aborted it, the death is reported as such.
        if remaining.is_empty() {
            self.orphans.remove(&dev);
            return None;
        }
        if let Some(reader) = remaining.iter().find(|&&pid| reads_fuse_device(&self.options.proc_root, pid)) {
            info!(source = %source.display(), connection = %dev, pid = reader, "connection is served by another process");
            self.orphans.remove(&dev);
            return None;
        }
        let control = connection_dir(&self.options.fuse_connections, dev);
        let waiting = match read_waiting(&control) {
            Ok(waiting) => waiting,
            Err(err) => {
                warn!(dir = %control.display(), err = %chain(&err), "cannot read the FUSE connection's waiting count; not aborting it");
                self.orphans.remove(&dev);
                return None;
            }
        };
        if waiting == 0 {
            orphan.attempts += 1;
            orphan.check_at = now + orphan_recheck_delay(orphan.attempts);
            return None;
        }
        let orphan = self.orphans.remove(&dev)?;
        if let Err(err) = fs::write(control.join("abort"), b"1") {
            warn!(dir = %control.display(), err = %chain(&err), "cannot abort the FUSE connection");
            return None;
        }
        Some(Aborted { source, dev, pid: orphan.pid, exited_at: orphan.exited_at, waiting })
    }
}

/// Checks of an orphaned connection: soon at first, then every 2 s while
/// it stays held and unread.
fn orphan_recheck_delay(attempts: u32) -> Duration {
    (Duration::from_millis(50) * (1 << attempts.min(6))).min(Duration::from_secs(2))
}

/// `<fusectl>/<connection>`: the control directory of a FUSE connection.
pub fn connection_dir(fuse_connections: &Path, dev: Dev) -> PathBuf {
    let device = MountDevice { major: dev.major, minor: dev.minor };
    fuse_connections.join(device.connection().to_string())
}

/// Requests of the connection not yet answered.
pub fn read_waiting(connection_dir: &Path) -> io::Result<u64> {
    let text = fs::read_to_string(connection_dir.join("waiting"))?;
    text.trim().parse().map_err(|_| io::Error::new(io::ErrorKind::InvalidData, format!("waiting: {text:?}")))
}

/// Whether a thread of `pid` sleeps reading a FUSE device (the kernel's
/// `fuse_dev_do_read`): the process serves requests.
pub(super) fn reads_fuse_device(proc_root: &Path, pid: u32) -> bool {
    let Ok(tasks) = fs::read_dir(proc_root.join(pid.to_string()).join("task")) else { return false };
    tasks
        .filter_map(Result::ok)
        .any(|task| fs::read_to_string(task.path().join("wchan")).is_ok_and(|wchan| wchan.trim() == "fuse_dev_do_read"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_directory_is_named_by_the_kernel_device_number() {
        let dir = connection_dir(Path::new("/sys/fs/fuse/connections"), Dev { major: 0, minor: 52 });
        assert_eq!(dir, Path::new("/sys/fs/fuse/connections/52"));
    }

    #[test]
    fn waiting_count_is_read_from_the_control_directory() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("waiting"), "3\n").unwrap();
        assert_eq!(read_waiting(dir.path()).unwrap(), 3);
        fs::write(dir.path().join("waiting"), "x\n").unwrap();
        assert!(read_waiting(dir.path()).is_err());
    }

    #[test]
    fn orphan_checks_space_out_to_two_seconds() {
        assert_eq!(orphan_recheck_delay(0), Duration::from_millis(50));
        assert_eq!(orphan_recheck_delay(1), Duration::from_millis(100));
        assert_eq!(orphan_recheck_delay(10), Duration::from_secs(2));
    }
}
