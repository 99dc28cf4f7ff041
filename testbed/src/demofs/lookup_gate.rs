//! Lookups held unanswered until a signal: a daemon that answers `statfs`
//! (and everything else) but hangs on every name it is asked to resolve,
//! or only on one name (a tenant's server that stops answering the lookup
//! of the directory a copy of a volume is mounted on).
//!
//! A held lookup is one the daemon has read, so its caller waits in the
//! kernel and cannot even be killed (a request userspace has read is waited
//! out, `request_wait_answer`) until the daemon answers or the connection
//! ends. Holding the reply rather than blocking a thread keeps the session
//! thread free for the other requests.
use std::ffi::{OsStr, OsString};
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
    /// The one name held, and how many of its lookups are answered first;
    /// None holds every name.
    only: Option<(OsString, u32)>,
    held: Vec<(ReplyEntry, LookupAnswer)>,
}

impl LookupGate {
    /// A gate that holds only the lookups of `name` (in any directory),
    /// after answering the first `answered_first` of them.
    pub(crate) fn for_name(name: OsString, answered_first: u32) -> Self {
        let state = GateState { only: Some((name, answered_first)), ..GateState::default() };
        LookupGate { state: Mutex::new(state) }
    }

    /// Answers `reply` to the lookup of `name` now if the gate is open or
    /// does not hold that name, else keeps it until the gate opens.
    pub(crate) fn answer_or_hold(&self, name: &OsStr, reply: ReplyEntry, answer: LookupAnswer) {
        let mut guard = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let state = &mut *guard;
        let passes = state.open
            || match &mut state.only {
                None => false,
                Some((held, _)) if held.as_os_str() != name => true,
                Some((_, answered_first)) => answered_first.checked_sub(1).map(|left| *answered_first = left).is_some(),
            };
        if passes {
            drop(guard);
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
