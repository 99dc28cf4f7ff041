//! The pidfd backend: one pidfd per watched process, in any pid namespace.
use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use fuse_supervisor_sys::pidfd::PidFd;
use fuse_supervisor_sys::poll::Poller;
use tracing::warn;

use crate::errors::chain;
use crate::watch::thread::Watching;

use super::{
    Backend, Detection, EventSink, ProcessEvent, ProcessId, ProcessWatchError, ProcessWatcher, check_running, sorted,
};

/// Epoll token of the waker; pids (at most 2^22) are the other tokens.
const SHUTDOWN: u64 = u64::MAX;

struct Watched {
    process: ProcessId,
    pidfd: PidFd,
}

struct Shared {
    proc_root: PathBuf,
    poller: Poller,
    watched: Mutex<HashMap<u32, Watched>>,
}

impl Shared {
    fn watched(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Watched>> {
        self.watched.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stops watching `pid`: out of the set and out of epoll (a pidfd stays
    /// readable forever once its process exited).
    fn forget(&self, pid: u32) -> Option<Watched> {
        let watched = self.watched().remove(&pid)?;
        if let Err(err) = self.poller.remove(watched.pidfd.as_fd()) {
            // Closing the pidfd (dropping it) unregisters it anyway.
            warn!(pid, err = %chain(&err), "cannot remove a pidfd from epoll");
        }
        Some(watched)
    }
}

/// Watches processes through pidfds: works in any pid namespace (pids are
/// the caller's), needs only permission to see the process in `/proc`.
/// Exit statuses are known only once the parent has reaped the process
/// (Linux 6.15+), so they are often `None`. No exec events.
pub struct PidfdWatcher {
    shared: Arc<Shared>,
    // Only its drop matters: it stops the thread.
    _thread: Watching,
}

impl PidfdWatcher {
    /// Starts the watcher thread; pids are those of `proc_root` (normally
    /// `/proc`, the caller's pid namespace).
    pub fn start(proc_root: PathBuf, sink: EventSink) -> Result<Self, ProcessWatchError> {
        let poller = Poller::new().map_err(ProcessWatchError::Poll)?;
        let waker = Watching::stop_waker("pidfdwatch")?;
        poller.add_readable(waker.as_fd(), SHUTDOWN).map_err(ProcessWatchError::Poll)?;
        let shared = Arc::new(Shared { proc_root, poller, watched: Mutex::default() });
        let thread_shared = Arc::clone(&shared);
        let thread = Watching::start("pidfdwatch", waker, move || run(&thread_shared, sink))?;
        Ok(PidfdWatcher { shared, _thread: thread })
    }
}

impl ProcessWatcher for PidfdWatcher {
    /// The pidfd is opened first and the start time checked after: if it
    /// still matches, the pidfd is on the identified process (a pid is not
    /// reused while its process exists, even as a zombie). An exited but
    /// unreaped process is accepted: its pidfd reports the exit at once.
    fn watch(&self, process: ProcessId) -> Result<(), ProcessWatchError> {
        let pid = process.pid;
        if self.shared.watched().get(&pid).is_some_and(|watched| watched.process == process) {
            return Ok(());
        }
        let pidfd = PidFd::open(pid).map_err(|source| match source.raw_os_error() {
            Some(super::ESRCH) => ProcessWatchError::Gone { pid },
            _ => ProcessWatchError::Pidfd { pid, source },
        })?;
        check_running(&self.shared.proc_root, process, true)?;
        // A pidfd for an older process with this pid goes first.
        self.shared.forget(pid);
        let mut watched = self.shared.watched();
        self.shared.poller.add_readable(pidfd.as_fd(), u64::from(pid)).map_err(ProcessWatchError::Poll)?;
        watched.insert(pid, Watched { process, pidfd });
        Ok(())
    }

    fn unwatch(&self, pid: u32) -> bool {
        self.shared.forget(pid).is_some()
    }

    fn watched(&self) -> Vec<ProcessId> {
        sorted(self.shared.watched().values().map(|watched| watched.process))
    }

    fn backend(&self) -> Backend {
        Backend::Pidfd
    }
}

fn run(shared: &Shared, mut sink: EventSink) {
    let mut ready = Vec::new();
    loop {
        if let Err(err) = shared.poller.wait(&mut ready, None) {
            sink(ProcessEvent::Failed(ProcessWatchError::Wait(err)));
            return;
        }
        if ready.contains(&SHUTDOWN) {
            return;
        }
        let at = Instant::now();
        for &token in &ready {
            // A pid unwatched since epoll reported it is simply gone.
            let Some(watched) = u32::try_from(token).ok().and_then(|pid| shared.forget(pid)) else { continue };
            let status = match watched.pidfd.exit_status() {
                Ok(status) => status,
                Err(err) => {
                    warn!(pid = watched.process.pid, err = %chain(&err), "cannot read the exit status from a pidfd");
                    None
                }
            };
            let event = ProcessEvent::Exited { pid: watched.process.pid, status, at, detection: Detection::Event };
            if !sink(event) {
                return;
            }
        }
    }
}
