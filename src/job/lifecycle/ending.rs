//! Ending a FUSE container whose pod's other containers all finished: its
//! mounts unmounted in every namespace that holds them, then SIGTERM and
//! SIGKILL to daemons that outlive the grace, each a grace apart.
use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Instant;

use fuse_supervisor_sys::pidfd::PidFd;
use fuse_supervisor_sys::process::Signal;
use tracing::{debug, info, warn};

use super::super::fuse_container::Fuse;
use super::super::unmount::unmount_devices;
use super::{Lifecycle, Phase, Step};
use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::watch::processes::{ProcessId, ProcessWatchError};

impl Lifecycle {
    /// Unmounts the FUSE container's mounts and starts the grace period.
    pub(super) fn end(&mut self, uid: &str, name: &str, fuse: &Fuse, now: Instant) {
        let mut namespaces = vec![self.config.mount_namespace.clone()];
        namespaces.extend(fuse.servers.iter().map(|p| self.config.proc_root.join(p.pid.to_string()).join("ns/mnt")));
        let mut seen = BTreeSet::new();
        // A namespace's thread held by a FUSE daemon that does not answer
        // must not hold the lifecycle: the grace bounds all of them.
        let deadline = Instant::now() + self.config.grace;
        for namespace in namespaces {
            // The same namespace through two paths is unmounted once.
            match std::fs::metadata(&namespace) {
                Ok(meta) if !seen.insert((meta.dev(), meta.ino())) => continue,
                Ok(_) => {}
                Err(err) => {
                    debug!(namespace = %namespace.display(), err = %chain(&err), "namespace gone");
                    continue;
                }
            }
            match unmount_devices(&namespace, &fuse.devices, deadline) {
                Ok(done) => {
                    for point in &done.unmounted {
                        info!(pod = %name, namespace = %namespace.display(), mount_point = %point.display(), "unmounted FUSE mount");
                    }
                    for err in &done.failed {
                        warn!(pod = %name, namespace = %namespace.display(), mount_point = %err.path().display(), err = %chain(&err), "cannot unmount FUSE mount");
                    }
                }
                Err(err) => warn!(pod = %name, err = %chain(&err), "cannot unmount the FUSE mounts"),
            }
        }
        let mut alive = BTreeSet::new();
        for &server in &fuse.servers {
            match self.watcher.watch(server) {
                Ok(()) => {
                    alive.insert(server);
                    self.by_pid.insert(server.pid, uid.to_owned());
                }
                Err(ProcessWatchError::Gone { .. } | ProcessWatchError::Reused { .. }) => {}
                Err(err) => {
                    // Cannot see it exit: count it alive, the grace decides.
                    warn!(pod = %name, pid = server.pid, err = %chain(&err), "cannot watch the FUSE daemon");
                    alive.insert(server);
                }
            }
        }
        let Some(tracked) = self.pods.get_mut(uid) else { return };
        tracked.recheck_at = None;
        tracked.phase = if alive.is_empty() {
            info!(pod = %name, ended_by = "unmount", "FUSE daemon exited");
            Phase::Done
        } else {
            Phase::Ending { step: Step::Unmounted, deadline: now + self.config.grace, alive }
        };
    }

    /// Signals daemons that outlived their grace.
    pub(super) fn escalate(&mut self, now: Instant) {
        let grace = self.config.grace;
        for pod in self.pods.values_mut() {
            let Phase::Ending { step, deadline, alive } = &mut pod.phase else { continue };
            if *deadline > now {
                continue;
            }
            let (next, signal) = match step {
                Step::Unmounted => (Step::Terminated, Signal::Term),
                Step::Terminated => (Step::Killed, Signal::Kill),
                Step::Killed => {
                    warn!(pod = %pod.name, pids = ?alive.iter().map(|p| p.pid).collect::<Vec<_>>(), "FUSE daemon still runs after SIGKILL; giving up");
                    pod.phase = Phase::Done;
                    continue;
                }
            };
            for process in alive.iter() {
                info!(pod = %pod.name, pid = process.pid, signal = ?signal, after_ms = grace.as_millis() as u64, "FUSE daemon has not exited; signalling");
                if let Err(err) = send(&self.config.proc_root, *process, signal) {
                    warn!(pod = %pod.name, pid = process.pid, err = %chain(&err), "cannot signal the FUSE daemon");
                }
            }
            *step = next;
            *deadline = now + grace;
        }
    }
}

/// Signals `process` through a pidfd, once its start time shows the pid is
/// still that process.
fn send(proc_root: &Path, process: ProcessId, signal: Signal) -> std::io::Result<()> {
    let pidfd = PidFd::open(process.pid)?;
    match ProcessId::of(proc_root, process.pid) {
        Ok(now) if now == process => pidfd.signal(signal),
        _ => Ok(()), // Gone, or the pid is another process's now.
    }
}
