//! The one shape of every thread that sleeps until the kernel has news:
//! the watchers of the mount table, of processes and of pod directories,
//! and the servers and loops built the same way (the metrics endpoint, the
//! webhook's certificate reload, the Job lifecycle). Each sleeps in its own
//! epoll on what it watches and on a stop eventfd, sends what it saw to a
//! sink, and is owned by a [`Watching`]: stopping or dropping that wakes the
//! thread through the eventfd and joins it. No timer anywhere: a thread
//! with nothing to report costs nothing.
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::errors::chain;
use fuse_supervisor_sys::poll::Poller;
/// The eventfd that stops a watching thread (or, shared, every waiter of a
/// shutdown): woken, never drained.
pub use fuse_supervisor_sys::poll::Waker;
use tracing::error;

/// The token of the stop eventfd in a [`Waiting`]'s epoll.
const STOP: u64 = u64::MAX;

/// What a watching thread sleeps on: its own epoll, holding the eventfd
/// that stops it and what it watches, each under a token of the caller's.
pub struct Waiting {
    poller: Poller,
    ready: Vec<u64>,
}

/// What woke a [`Waiting`].
#[derive(Debug, PartialEq, Eq)]
pub enum Woken<'a> {
    /// The stop eventfd: the thread ends.
    Stop,
    /// The tokens that are ready; none when the timeout passed.
    Ready(&'a [u64]),
}

impl Waiting {
    /// Its epoll holds `stop`'s eventfd, which must stay open as long (its
    /// owner, the [`Watching`] or the shutdown, keeps it).
    pub fn new(stop: &Waker) -> io::Result<Self> {
        let poller = Poller::new()?;
        poller.add_readable(stop.as_fd(), STOP)?;
        Ok(Waiting { poller, ready: Vec::with_capacity(4) })
    }

    /// Wakes for `fd` becoming readable, as `token` (any but `u64::MAX`).
    pub fn add_readable(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        debug_assert_ne!(token, STOP, "the stop eventfd's token");
        self.poller.add_readable(fd, token)
    }

    /// Wakes for `fd`'s `POLLPRI` (a mountinfo file's "the table changed"),
    /// as `token`.
    pub fn add_priority(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        debug_assert_ne!(token, STOP, "the stop eventfd's token");
        self.poller.add_priority(fd, token)
    }

    /// No longer wakes for `fd` (closing it does that too).
    pub fn remove(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        self.poller.remove(fd)
    }

    /// Sleeps until something is ready, the stop eventfd is woken (which
    /// wins), or `timeout` passed.
    pub fn wait(&mut self, timeout: Option<Duration>) -> io::Result<Woken<'_>> {
        self.poller.wait(&mut self.ready, timeout)?;
        if self.ready.contains(&STOP) {
            return Ok(Woken::Stop);
        }
        Ok(Woken::Ready(&self.ready))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ThreadError {
    #[error("cannot create the eventfd that stops the {name} thread")]
    Waker {
        name: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("cannot start the {name} thread")]
    Spawn {
        name: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("cannot wake the {name} thread to stop it")]
    Wake {
        name: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the {name} thread panicked")]
    Panicked { name: &'static str },
}

/// A running watcher's thread and the eventfd that stops it.
#[derive(Debug)]
pub struct Watching {
    name: &'static str,
    stop: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl Watching {
    /// A fresh eventfd to stop a thread named `name`: register it with the
    /// thread's poller, then pass it to [`Watching::start`].
    pub fn stop_waker(name: &'static str) -> Result<Arc<Waker>, ThreadError> {
        Waker::new().map(Arc::new).map_err(|source| ThreadError::Waker { name, source })
    }

    /// Runs `body` on a thread named `name`, set up by the caller; `stop`
    /// must end `body` when woken. A stop eventfd shared with other threads
    /// (a process-wide shutdown) is never drained, so each of them sees it.
    pub fn start(
        name: &'static str,
        stop: Arc<Waker>,
        body: impl FnOnce() + Send + 'static,
    ) -> Result<Self, ThreadError> {
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(body)
            .map_err(|source| ThreadError::Spawn { name, source })?;
        Ok(Watching { name, stop, thread: Some(thread) })
    }

    /// As [`Watching::start`], for a watcher that must set itself up on its
    /// own thread (one that joins another mount namespace): `set_up` runs
    /// there and returns what the caller gets back and the loop to run.
    /// Returns once `set_up` did; its error is the caller's.
    pub fn start_there<T, E, L>(
        name: &'static str,
        stop: Arc<Waker>,
        set_up: impl FnOnce() -> Result<(T, L), E> + Send + 'static,
    ) -> Result<(Self, T), E>
    where
        T: Send + 'static,
        E: From<ThreadError> + Send + 'static,
        L: FnOnce(),
    {
        let (ready, started) = mpsc::sync_channel(1);
        let mut watching = Watching::start(name, stop, move || match set_up() {
            Ok((value, run)) => {
                // The receiver only goes away if the caller panicked.
                if ready.send(Ok(value)).is_ok() {
                    run();
                }
            }
            Err(err) => {
                let _ = ready.send(Err(err));
            }
        })?;
        match started.recv() {
            Ok(Ok(value)) => Ok((watching, value)),
            Ok(Err(err)) => {
                watching.join()?;
                Err(err)
            }
            Err(mpsc::RecvError) => {
                watching.join()?;
                Err(ThreadError::Panicked { name }.into())
            }
        }
    }

    /// Wakes the thread and waits for it to end.
    pub fn stop(mut self) -> Result<(), ThreadError> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<(), ThreadError> {
        if self.thread.is_none() {
            return Ok(());
        }
        // Without the wake-up the thread would never end: leave it behind.
        self.stop.wake().map_err(|source| ThreadError::Wake { name: self.name, source })?;
        self.join()
    }

    fn join(&mut self) -> Result<(), ThreadError> {
        match self.thread.take().map(JoinHandle::join) {
            Some(Err(_)) => Err(ThreadError::Panicked { name: self.name }),
            _ => Ok(()),
        }
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        if let Err(err) = self.stop_and_join() {
            error!(err = %chain(&err), "watcher thread did not stop cleanly");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use fuse_supervisor_sys::poll::Poller;

    use super::*;

    /// A thread that sleeps on its stop eventfd alone, as every watcher does
    /// between events.
    fn sleeper(stop: &Arc<Waker>) -> impl FnOnce() + Send + 'static {
        let poller = Poller::new().unwrap();
        poller.add_readable(stop.as_fd(), 1).unwrap();
        move || {
            let mut ready = Vec::new();
            poller.wait(&mut ready, None).unwrap();
        }
    }

    #[test]
    fn stopping_wakes_the_sleeping_thread_and_joins_it() {
        let stop = Watching::stop_waker("sleeper").unwrap();
        let watching = Watching::start("sleeper", stop.clone(), sleeper(&stop)).unwrap();
        watching.stop().unwrap();
    }

    #[test]
    fn dropping_stops_it_too() {
        let stop = Watching::stop_waker("sleeper").unwrap();
        drop(Watching::start("sleeper", stop.clone(), sleeper(&stop)).unwrap());
    }

    #[derive(Debug, PartialEq)]
    enum SetUpError {
        Refused,
        Thread(String),
    }

    impl From<ThreadError> for SetUpError {
        fn from(err: ThreadError) -> Self {
            SetUpError::Thread(err.to_string())
        }
    }

    #[test]
    fn a_set_up_on_the_thread_hands_back_its_value_or_its_error() {
        let stop = Watching::stop_waker("sleeper").unwrap();
        let body = sleeper(&stop);
        let (watching, value) = Watching::start_there("sleeper", stop, move || Ok::<_, SetUpError>((7, body))).unwrap();
        assert_eq!(value, 7);
        watching.stop().unwrap();

        let stop = Watching::stop_waker("refused").unwrap();
        let refused = Watching::start_there("refused", stop, || Err::<((), fn()), _>(SetUpError::Refused));
        assert_eq!(refused.unwrap_err(), SetUpError::Refused);
    }

    #[test]
    fn a_set_up_that_panics_is_an_error_not_a_hang() {
        let stop = Watching::stop_waker("panics").unwrap();
        let panicked =
            Watching::start_there("panics", stop, || -> Result<((), fn()), SetUpError> { panic!("set-up failed") });
        assert_eq!(panicked.unwrap_err(), SetUpError::Thread("the panics thread panicked".into()));
    }
}
