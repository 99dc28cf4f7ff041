//! Writing the state file: atomically (a temporary file, fsync, rename,
//! fsync of the directory), and off the loop, on a thread of its own.
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use tracing::{debug, error, info};

use super::StateError;
use crate::errors::chain;
/// Write, fsync, rename, fsync of the directory: a crash leaves the old
/// file or the new one, never a mix.
pub(super) fn write_atomically(path: &Path, contents: &[u8]) -> Result<(), StateError> {
    let write = || -> io::Result<()> {
        let dir = path.parent().unwrap_or(Path::new("."));
        fs::create_dir_all(dir)?;
        let temporary = path.with_extension("json.tmp");
        let mut file = fs::File::create(&temporary)?;
        file.write_all(contents)?;
        file.sync_all()?;
        crate::stop_point::reached(crate::stop_point::STATE_WRITTEN);
        fs::rename(&temporary, path)?;
        fs::File::open(dir)?.sync_all()
    };
    write().map_err(|source| StateError::Write { path: path.to_path_buf(), source })
}

/// Writes state files on a thread of its own. The two fsyncs of a save take
/// milliseconds on a node's disk; on the loop they would delay every heal
/// that follows a change of state (a new source connection is one).
/// Only the latest contents matter: one submitted while another waits
/// replaces it. A save that fails is logged once, when saves start failing,
/// and again when one works: healing does not need the file, and a log line
/// per save would bury everything else.
#[derive(Debug)]
pub struct StateWriter {
    shared: Arc<(Mutex<Pending>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Debug, Default)]
struct Pending {
    next: Option<(PathBuf, Vec<u8>)>,
    writing: bool,
    stop: bool,
}

/// Told when saves start failing (with the error) and when one works again
/// (None).
pub type SaveOutcome = Box<dyn Fn(Option<&StateError>) + Send>;

impl StateWriter {
    /// The thread inherits the caller's mount namespace: start it from the
    /// thread whose view of the state directory counts.
    pub fn spawn(on_change: SaveOutcome) -> io::Result<Self> {
        let shared: Arc<(Mutex<Pending>, Condvar)> = Arc::default();
        let writer = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("state-writer".into())
            .spawn(move || write_submitted(&writer, &on_change))?;
        Ok(StateWriter { shared, thread: Some(thread) })
    }

    pub fn submit(&self, path: PathBuf, contents: Vec<u8>) {
        let (pending, changed) = &*self.shared;
        pending.lock().unwrap_or_else(PoisonError::into_inner).next = Some((path, contents));
        changed.notify_all();
    }

    /// Waits until everything submitted so far is written.
    pub fn flush(&self) {
        let (pending, changed) = &*self.shared;
        let mut pending = pending.lock().unwrap_or_else(PoisonError::into_inner);
        while pending.next.is_some() || pending.writing {
            pending = changed.wait(pending).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl Drop for StateWriter {
    /// Writes what is still pending, then stops the thread.
    fn drop(&mut self) {
        let (pending, changed) = &*self.shared;
        pending.lock().unwrap_or_else(PoisonError::into_inner).stop = true;
        changed.notify_all();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            error!("state writer thread panicked");
        }
    }
}

fn write_submitted(shared: &(Mutex<Pending>, Condvar), on_change: &SaveOutcome) {
    let (pending, changed) = shared;
    let mut failing = false;
    let mut guard = pending.lock().unwrap_or_else(PoisonError::into_inner);
    loop {
        match guard.next.take() {
            Some((path, contents)) => {
                guard.writing = true;
                drop(guard);
                match (write_atomically(&path, &contents), failing) {
                    (Ok(()), false) => {}
                    // Told before it is logged: whoever reads the log
                    // line finds /readyz saying the same.
                    (Ok(()), true) => {
                        failing = false;
                        on_change(None);
                        info!(path = %path.display(), "state saved again");
                    }
                    (Err(err), false) => {
                        failing = true;
                        on_change(Some(&err));
                        error!(
                            path = %path.display(),
                            err = %chain(&err),
                            "cannot save state; healing goes on, but a restarted supervisor will not know what this one learned"
                        );
                    }
                    (Err(err), true) => {
                        debug!(path = %path.display(), err = %chain(&err), "state still cannot be saved")
                    }
                }
                drop(contents);
                guard = pending.lock().unwrap_or_else(PoisonError::into_inner);
                guard.writing = false;
                changed.notify_all();
            }
            None if guard.stop => return,
            None => guard = changed.wait(guard).unwrap_or_else(PoisonError::into_inner),
        }
    }
}
