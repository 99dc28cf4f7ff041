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
//! Each job gets a thread at once, as a thread of its own did: a waiting
//! one, or one made for it (a heal of 100 containers on two CPUs waits
//! mostly in the kernel, for the namespace lock and an expedited RCU grace
//! period per detach, and eight threads taking the namespaces in turn made
//! those waits add up past the deadline on a loaded node). A thread goes
//! back to the agent's own mount namespace after each job, so that an idle
//! one holds no tenant's namespace, and waits for the next; up to [`KEPT`]
//! wait, the others end. A job that never ends (a FUSE request its server
//! never answers cannot be interrupted) keeps its thread, and costs no other
//! job anything.
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use fuse_supervisor_sys::ns;
use tracing::warn;

use super::priority::HealPriority;
use crate::errors::chain;

/// Threads kept waiting between heals, at most: as many as the largest
/// heal's namespaces up to this, about 21 KiB resident each (the agent's
/// RSS 12.9 MiB with a thread per heal, 15.2 MiB with 100 kept).
pub(super) const KEPT: usize = 128;

/// A job for a namespace thread.
pub(super) type Job = Box<dyn FnOnce() + Send>;

/// The queue and the threads that take from it.
pub(super) struct NamespaceThreads {
    priority: HealPriority,
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
    /// Threads working on a job.
    working: usize,
    made: u64,
}

impl NamespaceThreads {
    pub(super) fn new(priority: HealPriority) -> Arc<Self> {
        Arc::new(NamespaceThreads { priority, state: Mutex::default(), ready: Condvar::new() })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `job` and wakes a waiting thread for it, or makes one when
    /// none waits for it. Fails only when a thread is needed, none can be
    /// made and none is there to take the job later.
    pub(super) fn submit(self: &Arc<Self>, job: Job) -> io::Result<()> {
        let mut state = self.state();
        state.queue.push_back(job);
        if state.idle > 0 {
            self.ready.notify_one();
        }
        if state.queue.len() <= state.idle + state.starting {
            return Ok(());
        }
        let made = ns::open_thread_mount_namespace().and_then(|home| {
            let threads = Arc::clone(self);
            std::thread::Builder::new().name("container-heal".into()).spawn(move || threads.serve(home))
        });
        match made {
            Ok(_) => {
                state.made += 1;
                state.starting += 1;
                Ok(())
            }
            // Taken by a thread when one is free, if any is there.
            Err(_) if state.idle + state.starting + state.working > 0 => Ok(()),
            Err(err) => {
                state.queue.pop_back();
                Err(err)
            }
        }
    }

    /// A thread's life: the jobs in turn, back home after each.
    fn serve(&self, home: OwnedFd) {
        self.priority.raise();
        let mut state = self.state();
        state.starting -= 1;
        loop {
            let Some(job) = state.queue.pop_front() else {
                if state.idle >= KEPT {
                    return;
                }
                state.idle += 1;
                state = self.ready.wait(state).unwrap_or_else(PoisonError::into_inner);
                state.idle -= 1;
                continue;
            };
            state.working += 1;
            drop(state);
            // A job reports its own panics; one that escapes ends only it.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            let home_again = ns::enter_mount_namespace(home.as_fd());
            state = self.state();
            state.working -= 1;
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
        state.idle + state.starting + state.working
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use super::*;

    fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < until, "{what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_heal_gets_a_thread_per_job_and_the_next_one_makes_none() {
        let threads = NamespaceThreads::new(HealPriority::OFF);
        let (done, finished) = mpsc::channel();
        // Every job held until all have started: each needs a thread.
        let jobs = 12;
        let all_started = Arc::new(std::sync::Barrier::new(jobs));
        for job in 0..jobs {
            let (done, all_started) = (done.clone(), Arc::clone(&all_started));
            threads
                .submit(Box::new(move || {
                    all_started.wait();
                    done.send(job).unwrap();
                }))
                .unwrap();
        }
        let mut seen: Vec<usize> = (0..jobs).map(|_| finished.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..jobs).collect::<Vec<_>>());
        wait_until("every thread waiting again", || threads.state().idle == jobs);
        // The next heal's jobs take the waiting threads.
        for job in 0..jobs {
            let done = done.clone();
            threads.submit(Box::new(move || done.send(job).unwrap())).unwrap();
        }
        for _ in 0..jobs {
            finished.recv_timeout(Duration::from_secs(10)).unwrap();
        }
        assert_eq!(threads.state().made, jobs as u64);
        assert_eq!(threads.threads(), jobs);
        // A thread held for good (a FUSE request nobody answers) holds up
        // no other job.
        let (release, held) = mpsc::channel::<()>();
        threads
            .submit(Box::new(move || {
                let _ = held.recv();
            }))
            .unwrap();
        for job in 0..(jobs * 2) {
            let done = done.clone();
            threads.submit(Box::new(move || done.send(job).unwrap())).unwrap();
        }
        for _ in 0..(jobs * 2) {
            finished.recv_timeout(Duration::from_secs(10)).unwrap();
        }
        drop(release);
    }
}
