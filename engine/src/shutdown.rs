//! The one request to stop, shared by the supervisor loop, its watchers and
//! the threads built like them: a flag for loops that look between steps,
//! and an eventfd for those asleep in epoll.
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tracing::error;

use crate::errors::chain;
use crate::watch::thread::Waker;

/// Asks a running supervisor to stop; cheap to clone.
#[derive(Clone)]
pub struct Shutdown {
    waker: Arc<Waker>,
    requested: Arc<AtomicBool>,
}

impl Shutdown {
    pub fn new() -> io::Result<Self> {
        Ok(Shutdown { waker: Arc::new(Waker::new()?), requested: Arc::new(AtomicBool::new(false)) })
    }

    pub fn request(&self) {
        self.requested.store(true, Ordering::SeqCst);
        if let Err(err) = self.waker.wake() {
            error!(err = %chain(&err), "cannot wake the watcher for shutdown");
        }
    }

    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    /// The eventfd a shutdown request sets, for loops that wait on their own epoll.
    pub fn waker(&self) -> Arc<Waker> {
        Arc::clone(&self.waker)
    }
}
