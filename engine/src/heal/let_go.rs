//! The last handle on a detached dead mount, closed on a thread of its own.
//!
//! Closing the last reference to a mount whose filesystem nothing else
//! holds tears the superblock down in the closing thread, on its way back
//! from the syscall: for a dead FUSE connection that unregisters its
//! backing device, which waits for an RCU grace period and for its
//! writeback work to be flushed. Seen under CPU load to take 1 to 4 s (a
//! container heal's `took_us` of a second and more, the loop's liveness
//! check missed meanwhile); on the loop or a heal worker nothing may wait
//! on that.
use std::os::fd::OwnedFd;
use std::sync::mpsc::{self, Sender};
use std::sync::{Mutex, OnceLock, PoisonError};

use crate::errors::chain;
use tracing::debug;

/// Closes `mount` (a handle on a dead mount just detached) on the closer
/// thread, started at the first call; on the caller's thread if that
/// thread cannot be started.
pub fn let_go(mount: OwnedFd) {
    static CLOSER: OnceLock<Option<Mutex<Sender<OwnedFd>>>> = OnceLock::new();
    let closer = CLOSER.get_or_init(|| {
        let (send, receive) = mpsc::channel::<OwnedFd>();
        let started = std::thread::Builder::new().name("dead-mount-closer".into()).spawn(move || {
            // Each handle closes as the loop drops it.
            for _mount in receive {}
        });
        match started {
            Ok(_) => Some(Mutex::new(send)),
            Err(err) => {
                debug!(err = %chain(&err), "cannot start the thread that closes dead mounts; they close where they are let go");
                None
            }
        }
    });
    let refused = match closer {
        Some(closer) => {
            closer.lock().unwrap_or_else(PoisonError::into_inner).send(mount).err().map(|refused| refused.0)
        }
        None => Some(mount),
    };
    drop(refused);
}

/// Handles on dead mounts, let go when dropped: held by the loop, their
/// close took it 1.5 s under load, past its liveness check.
#[derive(Debug, Default)]
pub(super) struct LetGoOnDrop(pub(super) Vec<OwnedFd>);

impl Drop for LetGoOnDrop {
    fn drop(&mut self) {
        for handle in self.0.drain(..) {
            let_go(handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    #[test]
    fn a_handle_let_go_is_closed() {
        let (mut read, write) = std::io::pipe().unwrap();
        let_go(OwnedFd::from(write));
        // Once the closer dropped the only write end, the read sees the end.
        let mut byte = [0u8; 1];
        assert_eq!(read.read(&mut byte).unwrap(), 0);
    }
}
