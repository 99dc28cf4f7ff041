//! Every request held unanswered once a number of lookups were answered: a
//! daemon that passes a health probe (its `statfs`, the lookups of the
//! subdirectories it needs) and then never answers again.
//!
//! It sits between the device and the FUSE library (see `relay`), so it
//! holds requests of every kind, read from the device (their callers wait
//! in the kernel, unkillable) and never handed to the library, until
//! `SIGUSR1` hands them all over in the order they came.
use std::fs::File;
use std::io::{self, Write};
use std::sync::{Mutex, PoisonError};

/// `FUSE_LOOKUP`.
const LOOKUP: u32 = 1;

/// `FUSE_INIT`: never counted, never held (the mount needs it answered).
const INIT: u32 = 26;

/// Whether requests pass to the library, and the ones held until they do.
#[derive(Debug)]
pub(crate) struct RequestGate {
    /// The relay's end of the library's socket.
    library: File,
    state: Mutex<GateState>,
}

#[derive(Debug)]
struct GateState {
    /// Lookups still answered before the gate closes.
    lookups_left: u32,
    closed: bool,
    released: bool,
    held: Vec<Vec<u8>>,
}

impl RequestGate {
    /// A gate that passes every request until `answered_lookups` lookups
    /// have passed, and closes at the next lookup: that one and every
    /// request after it, of any kind, is held.
    /// Requests pass to `library`, the relay's end of the library's socket.
    pub(crate) fn closing_after_lookups(answered_lookups: u32, library: File) -> Self {
        let state = GateState { lookups_left: answered_lookups, closed: false, released: false, held: Vec::new() };
        RequestGate { library, state: Mutex::new(state) }
    }

    /// Passes `request` (one whole message from the device) to the library,
    /// or holds it. Under the lock, so a request never overtakes a held one.
    pub(crate) fn offer(&self, request: &[u8]) -> io::Result<()> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if !state.released && !state.closed && opcode(request) == Some(LOOKUP) {
            match state.lookups_left.checked_sub(1) {
                Some(left) => state.lookups_left = left,
                None => {
                    state.closed = true;
                    tracing::info!(unique = unique(request), "demofs stops answering");
                }
            }
        }
        if state.closed && opcode(request) != Some(INIT) {
            state.held.push(request.to_vec());
            return Ok(());
        }
        send_message(&self.library, request)
    }

    /// Opens the gate for good, passing every held request on. Returns how
    /// many were held.
    pub(crate) fn release(&self) -> usize {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.released = true;
        state.closed = false;
        let held = std::mem::take(&mut state.held);
        for request in &held {
            if let Err(err) = send_message(&self.library, request) {
                tracing::warn!(%err, unique = unique(request), "cannot pass a held request on");
            }
        }
        held.len()
    }
}

/// The opcode of a request (`fuse_in_header`: length, then opcode).
fn opcode(request: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(request.get(4..8)?.try_into().ok()?))
}

/// The request's unique number, for the log.
fn unique(request: &[u8]) -> u64 {
    request.get(8..16).and_then(|bytes| bytes.try_into().ok()).map_or(0, u64::from_ne_bytes)
}

/// One message to a `SOCK_SEQPACKET` socket, whole or not at all.
pub(super) fn send_message(mut socket: &File, message: &[u8]) -> io::Result<()> {
    let sent = socket.write(message)?;
    if sent != message.len() {
        return Err(io::Error::other(format!("sent {sent} of a {}-byte message", message.len())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    fn request(opcode: u32, unique: u64) -> Vec<u8> {
        let mut bytes = vec![0; 40];
        bytes[0..4].copy_from_slice(&40u32.to_ne_bytes());
        bytes[4..8].copy_from_slice(&opcode.to_ne_bytes());
        bytes[8..16].copy_from_slice(&unique.to_ne_bytes());
        bytes
    }

    /// The uniques of the messages waiting on `socket`.
    fn received(socket: &mut UnixStream) -> Vec<u64> {
        socket.set_nonblocking(true).unwrap();
        let mut uniques = Vec::new();
        let mut buffer = [0; 64];
        while let Ok(read) = socket.read(&mut buffer) {
            uniques.push(unique(&buffer[..read]));
        }
        uniques
    }

    #[test]
    fn passes_until_the_lookup_after_the_answered_ones_then_holds_everything_until_released() {
        const STATFS: u32 = 17;
        const GETATTR: u32 = 3;
        let (library, relayed) = fuse_supervisor_sys::fuse::message_pair().unwrap();
        let mut library = UnixStream::from(library);
        let gate = RequestGate::closing_after_lookups(1, File::from(relayed));
        for (opcode, unique) in [(INIT, 1), (STATFS, 2), (GETATTR, 3), (LOOKUP, 4), (STATFS, 5), (LOOKUP, 6)] {
            gate.offer(&request(opcode, unique)).unwrap();
        }
        gate.offer(&request(GETATTR, 7)).unwrap();
        gate.offer(&request(INIT, 8)).unwrap();
        assert_eq!(received(&mut library), [1, 2, 3, 4, 5, 8]);
        assert_eq!(gate.release(), 2);
        gate.offer(&request(LOOKUP, 9)).unwrap();
        assert_eq!(received(&mut library), [6, 7, 9]);
    }
}
