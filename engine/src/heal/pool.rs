//! The flatten helpers: threads started once in the watched namespace,
//! asleep on a queue between heals, that flatten the targets of large
//! batches beside the loop thread.
use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use fuse_supervisor_sys::ns;
use tracing::warn;

use super::HealError;
use super::mounter::Mounter;
use crate::errors::chain;
use crate::heal::priority::HealPriority;
use crate::plan::TargetHeal;

/// At most this many threads flatten one batch: the loop thread and a
/// pool of helpers. Each flatten waits in `umount2` for an expedited RCU
/// grace period (namespace_unlock), tens of microseconds idle, far more when
/// both CPUs are busy; concurrent requests queue on the grace-period
/// machinery and share what they can, while the mount calls themselves take
/// the namespace lock in turn. On the 2-CPU test VM 8 threads flattened 100
/// targets faster than 4, and 16 no faster than 8.
pub(super) const FLATTEN_THREADS: usize = 8;

/// Targets per flattening thread before another is worth waking.
pub(super) const TARGETS_PER_FLATTEN_THREAD: usize = 8;

/// One target to flatten: its place in the batch, the handle on its planned
/// top taken before the first stack (made private at the stack, and held
/// open until the flatten ends: a held mount cannot be freed, so its ID,
/// which the flatten looks for, is not handed to another), the handle on its
/// new top, and where the outcome goes.
pub(super) struct FlattenJob {
    pub(super) targets: Arc<[TargetHeal]>,
    pub(super) index: usize,
    pub(super) _stale: OwnedFd,
    pub(super) new_top: OwnedFd,
    pub(super) done: Sender<(usize, Result<usize, HealError>)>,
}

/// Flatten jobs waiting for a thread.
#[derive(Default)]
pub(super) struct FlattenQueue {
    pub(super) state: Mutex<QueueState>,
    pub(super) ready: Condvar,
}

#[derive(Default)]
pub(super) struct QueueState {
    pub(super) jobs: VecDeque<FlattenJob>,
    pub(super) closed: bool,
}

impl FlattenJob {
    /// Flattens on parking directory `park` and sends the outcome.
    pub(super) fn run(self, mounter: &Mounter, park: usize) {
        let result = match self.targets.get(self.index) {
            Some(target) => mounter.flatten(target, self.new_top.as_fd(), park),
            None => return,
        };
        // The heal waits for every job's outcome until all senders are gone.
        let _ = self.done.send((self.index, result));
    }
}

impl FlattenQueue {
    pub(super) fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The next job, waiting for one; None once the queue is closed.
    pub(super) fn next(&self) -> Option<FlattenJob> {
        let mut state = self.lock();
        loop {
            if let Some(job) = state.jobs.pop_front() {
                return Some(job);
            }
            if state.closed {
                return None;
            }
            state = self.ready.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }

    pub(super) fn try_next(&self) -> Option<FlattenJob> {
        self.lock().jobs.pop_front()
    }
}

/// Helper threads that flatten beside the loop thread, started once and
/// asleep on the queue in between: starting them for each heal cost the
/// loop a fraction of a millisecond before its first stack.
pub(super) struct FlattenPool {
    pub(super) queue: Arc<FlattenQueue>,
    pub(super) threads: Vec<JoinHandle<()>>,
}

impl FlattenPool {
    /// Helper `n` parks on parking directory `n` (the loop thread on 0).
    /// They start in the calling thread's mount namespace and enter
    /// `namespace` to be sure of it.
    pub(super) fn start(mounter: &Arc<Mounter>, namespace: &OwnedFd, priority: HealPriority) -> Self {
        let queue = Arc::new(FlattenQueue::default());
        let mut threads = Vec::with_capacity(FLATTEN_THREADS - 1);
        for park in 1..FLATTEN_THREADS {
            let (mounter, queue) = (Arc::clone(mounter), Arc::clone(&queue));
            let namespace = match namespace.try_clone() {
                Ok(namespace) => namespace,
                Err(err) => {
                    warn!(err = %chain(&err), "cannot start a flatten helper; flattening with fewer threads");
                    break;
                }
            };
            let helper = std::thread::Builder::new().name("flatten".into()).spawn(move || {
                if let Err(err) = ns::enter_mount_namespace(namespace.as_fd()) {
                    warn!(err = %chain(&err), "flatten helper cannot enter the mount namespace");
                    return;
                }
                drop(namespace);
                priority.raise();
                while let Some(job) = queue.next() {
                    job.run(&mounter, park);
                }
            });
            match helper {
                Ok(thread) => threads.push(thread),
                Err(err) => warn!(err = %chain(&err), "cannot start a flatten helper; flattening with fewer threads"),
            }
        }
        FlattenPool { queue, threads }
    }
}

impl Drop for FlattenPool {
    fn drop(&mut self) {
        self.queue.lock().closed = true;
        self.queue.ready.notify_all();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

impl std::fmt::Debug for FlattenPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlattenPool").field("helpers", &self.threads.len()).finish()
    }
}
