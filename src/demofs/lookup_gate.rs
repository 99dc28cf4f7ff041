//! Lookups held unanswered until a signal: a daemon that answers `statfs`
//! (and everything else) but hangs on every name it is asked to resolve.
//!
//! A held lookup is one the daemon has read, so its caller waits in the
//! kernel and cannot even be killed (a request userspace has read is waited
//! out, `request_wait_answer`) until the daemon answers or the connection
//! ends. Holding the reply rather than blocking a thread keeps the session
//! thread free for the other requests.
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use fuser::{Errno, FileAttr, Generation, ReplyEntry};

/// The answer a held lookup gets once the gate opens: what the backing
/// directory said when it was asked.
pub(crate) type LookupAnswer = Result<(Duration, FileAttr, Generation), Errno>;

/// Whether lookups are answered, and the ones held until they are. One
/// lock over both: a lookup that found the gate closed is held before the
/// gate can open, so none is left behind.
#[derive(Debug, Default)]
pub(crate) struct LookupGate {
    state: Mutex<GateState>,
}

#[derive(Debug, Default)]
struct GateState {
    open: bool,
    held: Vec<(ReplyEntry, LookupAnswer)>,
}

impl LookupGate {
    /// Answers `reply` now if the gate is open, else keeps it until it is.
    pub(crate) fn answer_or_hold(&self, reply: ReplyEntry, answer: LookupAnswer) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.open {
            drop(state);
            send(reply, answer);
        } else {
            state.held.push((reply, answer));
        }
    }

    /// Opens the gate for good and answers every held lookup. Returns how
    /// many were held.
    pub(crate) fn open(&self) -> usize {
        let held = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.open = true;
            std::mem::take(&mut state.held)
        };
        let count = held.len();
        for (reply, answer) in held {
            send(reply, answer);
        }
        count
    }
}

/// Sends `answer` as the reply to a lookup.
pub(crate) fn send(reply: ReplyEntry, answer: LookupAnswer) {
    match answer {
        Ok((ttl, attributes, generation)) => reply.entry(&ttl, &attributes, generation),
        Err(errno) => reply.error(errno),
    }
}
