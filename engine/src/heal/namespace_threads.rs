//! The threads that go into containers' mount namespaces, kept between
//! heals.
//!
//! A thread made for each namespace of a heal cost more than the heal: 100
//! threads started at once each mapped a stack and a malloc arena and
//! unmapped them at exit, every one of those calls taking the process's one
//! mmap lock for writing, and the threads queued on it (about 25 ms each on
//! two CPUs among 100 busy containers, nine tenths of their time off the
//! CPU). Kept threads map nothing between heals.
//!
//! A thread takes the jobs in turn; it goes back to the agent's own mount
//! namespace after each, so that an idle thread holds no tenant's namespace.
//! A job may never end (a FUSE request its server never answers cannot be
//! interrupted): a thread whose job is older than the deadline no longer
//! counts, and another is made in its place, so a stuck tenant costs one
//! thread and holds up no other namespace past one deadline.
use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use fuse_supervisor_sys::ns;
use tracing::warn;

use super::priority::HealPriority;
use crate::errors::chain;

/// Threads that work at once on the namespaces of one heal (more are made
/// only in place of threads past the deadline). Each waits mostly in the
/// kernel (the namespace lock, an expedited RCU grace period per detach),
/// so a few per CPU keep the CPUs busy.
pub(super) const THREADS: usize = 8;

/// A job for a namespace thread.
pub(super) type Job = Box<dyn FnOnce() + Send>;

/// The queue and the threads that take from it.
pub(super) struct NamespaceThreads {
    priority: HealPriority,
    deadline: Duration,
    state: Mutex<State>,
    ready: Condvar,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    /// Threads waiting for a job.
    idle: usize,
    /// Threads made that have not taken their first look at the queue.
    starting: usize,
    /// When each busy thread (by its number) took its job.
    working: BTreeMap<u64, Instant>,
    made: u64,
}

impl NamespaceThreads {
    pub(super) fn new(priority: HealPriority, deadline: Duration) -> Arc<Self> {
        Arc::new(NamespaceThreads { priority, deadline, state: Mutex::default(), ready: Condvar::new() })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `job`, waking a waiting thread, or making one when fewer than
    /// [`THREADS`] are waiting, starting or within the deadline of their
    /// job. Fails only when a thread is needed and none can be made.
    pub(super) fn submit(self: &Arc<Self>, job: Job) -> io::Result<()> {
        let mut state = self.state();
        state.queue.push_back(job);
        if state.queue.len() <= state.idle {
            self.ready.notify_one();
            return Ok(());
        }
        if state.idle > 0 {
            self.ready.notify_one();
        }
        let on_time = state.working.values().filter(|took| took.elapsed() < self.deadline).count();
        if state.idle + state.starting + on_time >= THREADS {
            return Ok(());
        }
        let number = state.made;
        let home = match ns::open_thread_mount_namespace() {
            Ok(home) => home,
            Err(err) => {
                state.queue.pop_back();
                return Err(err);
            }
        };
        let threads = Arc::clone(self);
        let made = std::thread::Builder::new().name("container-heal".into()).spawn(move || threads.serve(number, home));
        match made {
            Ok(_) => {
                state.made += 1;
                state.starting += 1;
                Ok(())
            }
            Err(err) => {
                // Taken by a thread when one is free, if any is there.
                if state.idle + state.working.len() == 0 {
                    state.queue.pop_back();
                    return Err(err);
                }
                Ok(())
            }
        }
    }

    /// A thread's life: the jobs in turn, back home after each.
    fn serve(&self, number: u64, home: OwnedFd) {
        self.priority.raise();
        let mut state = self.state();
        state.starting -= 1;
        loop {
            let Some(job) = state.queue.pop_front() else {
                state.idle += 1;
                state = self.ready.wait(state).unwrap_or_else(PoisonError::into_inner);
                state.idle -= 1;
                continue;
            };
            state.working.insert(number, Instant::now());
            drop(state);
            // A job reports its own panics; one that escapes ends only it.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            let home_again = ns::enter_mount_namespace(home.as_fd());
            state = self.state();
            state.working.remove(&number);
            if let Err(err) = home_again {
                // Still in a tenant's namespace: it must take no more jobs.
                // Its place is taken at the next submit: a thread made here
                // would start in the tenant's namespace.
                warn!(err = %chain(&err), "a container-heal thread cannot go back to the agent's mount namespace; it ends");
                return;
            }
        }
    }

    #[cfg(test)]
    fn threads(&self) -> usize {
        let state = self.state();
        state.idle + state.starting + state.working.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < until, "{what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn jobs_reuse_the_threads_kept_and_a_stuck_one_is_replaced_after_the_deadline() {
        let threads = NamespaceThreads::new(HealPriority::OFF, Duration::from_millis(50));
        let (done, finished) = mpsc::channel();
        // More jobs than threads: at most THREADS are made for them.
        for job in 0..(THREADS * 4) {
            let done = done.clone();
            threads.submit(Box::new(move || done.send(job).unwrap())).unwrap();
        }
        let mut seen: Vec<usize> = (0..THREADS * 4).map(|_| finished.recv().unwrap()).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..THREADS * 4).collect::<Vec<_>>());
        assert!(threads.threads() <= THREADS, "{} threads", threads.threads());
        wait_until("every thread waiting again", || {
            let state = threads.state();
            state.idle == state.starting + state.idle + state.working.len()
        });
        let kept = threads.threads();
        // The next round makes none.
        for job in 0..kept {
            let done = done.clone();
            threads.submit(Box::new(move || done.send(job).unwrap())).unwrap();
        }
        for _ in 0..kept {
            finished.recv().unwrap();
        }
        assert_eq!(threads.state().made, kept as u64);
        // Every thread held (as by a FUSE request nobody answers): once
        // past the deadline, a job still gets a thread of its own.
        let (release, held) = mpsc::channel::<()>();
        let held = Arc::new(Mutex::new(held));
        for _ in 0..THREADS {
            let held = Arc::clone(&held);
            threads
                .submit(Box::new(move || {
                    let _ = held.lock().unwrap().recv();
                }))
                .unwrap();
        }
        wait_until("every thread busy", || threads.state().working.len() == THREADS);
        std::thread::sleep(Duration::from_millis(60));
        threads.submit(Box::new(move || done.send(99).unwrap())).unwrap();
        assert_eq!(finished.recv_timeout(Duration::from_secs(5)), Ok(99));
        drop(release);
    }
}
