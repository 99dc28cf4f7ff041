//! Serving a connection that is already initialized, as a watchdog's
//! children do: the kernel sends `FUSE_INIT` once per connection, and the
//! FUSE library wants one before anything else. The library is given one end
//! of a message socket in place of the device, the connection's INIT request
//! first (the watchdog took it from the device at the mount), and every
//! later message is relayed between that socket and the device. Only the
//! first child passes the library's INIT answer on to the kernel; later ones
//! drop theirs, the kernel having had its answer.
//!
//! A message larger than the socket's buffer (about 200 KiB) cannot pass:
//! enough for the tests' files, which are a few bytes.
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use fuse_supervisor_sys::fuse as sys_fuse;

use super::request_gate::{RequestGate, send_message};

/// As large as the library's own read buffer: the kernel refuses a read
/// shorter than its largest request (fuser asks for 16 MiB writes).
const MESSAGE_BUFFER: usize = 16 * 1024 * 1024 + 4096;

/// What a watchdog's child needs to serve a connection the kernel has
/// already sent its INIT for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayedInit {
    /// The connection's INIT request, as the kernel sent it.
    pub request: Vec<u8>,
    /// Whether the kernel still waits for the answer (the first child).
    pub answer_kernel: bool,
}

/// Reads the request the kernel queued on `device` when it was mounted: its
/// INIT, which no one has answered yet.
pub(super) fn take_init_request(device: &OwnedFd) -> io::Result<Vec<u8>> {
    let mut buffer = vec![0; MESSAGE_BUFFER];
    let read = File::from(device.try_clone()?).read(&mut buffer)?;
    buffer.truncate(read);
    Ok(buffer)
}

/// Starts relaying between `device` and a new socket, handing the library's
/// end the INIT request first; returns that end.
pub(super) fn start(device: OwnedFd, init: &ReplayedInit) -> io::Result<OwnedFd> {
    let (library, relayed) = sys_fuse::message_pair()?;
    let relayed = File::from(relayed);
    send_message(&relayed, &init.request)?;
    let device = File::from(device);
    let (requests_from, requests_to, to) = (device.try_clone()?, relayed.try_clone()?, relayed.try_clone()?);
    std::thread::Builder::new()
        .name("demofs-requests".into())
        .spawn(move || relay_requests(requests_from, requests_to, |request| send_message(&to, request)))?;
    let answer_kernel = init.answer_kernel;
    std::thread::Builder::new()
        .name("demofs-replies".into())
        .spawn(move || relay_replies(relayed, device, answer_kernel))?;
    Ok(library)
}

/// Starts relaying between `device` (a connection whose INIT no one has
/// read) and a new socket, each request through the gate `gated` makes of
/// the relay's end; returns the library's end and the gate.
pub(super) fn start_gated(
    device: OwnedFd,
    gated: impl FnOnce(File) -> RequestGate,
) -> io::Result<(OwnedFd, Arc<RequestGate>)> {
    let (library, relayed) = sys_fuse::message_pair()?;
    let relayed = File::from(relayed);
    let gate = Arc::new(gated(relayed.try_clone()?));
    let device = File::from(device);
    let (requests_from, requests_to, offered) = (device.try_clone()?, relayed.try_clone()?, Arc::clone(&gate));
    std::thread::Builder::new()
        .name("demofs-requests".into())
        .spawn(move || relay_requests(requests_from, requests_to, |request| offered.offer(request)))?;
    std::thread::Builder::new().name("demofs-replies".into()).spawn(move || relay_replies(relayed, device, true))?;
    Ok((library, gate))
}

/// Kernel requests to the library through `pass` until the connection
/// ends, which the library then reads as the end of its channel (`socket`).
fn relay_requests(mut device: File, socket: File, mut pass: impl FnMut(&[u8]) -> io::Result<()>) {
    let mut buffer = vec![0; MESSAGE_BUFFER];
    loop {
        let read = match device.read(&mut buffer) {
            Ok(read) => read,
            // A request interrupted before it was read, or a signal.
            Err(err) if matches!(err.kind(), io::ErrorKind::NotFound | io::ErrorKind::Interrupted) => continue,
            Err(err) => {
                // ENODEV: unmounted or aborted, the usual end.
                tracing::debug!(%err, "the connection ended");
                break;
            }
        };
        if let Err(err) = pass(&buffer[..read]) {
            tracing::warn!(%err, "cannot pass a request to the library");
            break;
        }
    }
    if let Err(err) = sys_fuse::end_messages(socket.as_fd()) {
        tracing::warn!(%err, "cannot end the library's channel");
    }
}

/// The library's answers to the kernel, the first (to the replayed INIT)
/// only if the kernel waits for it.
fn relay_replies(mut socket: File, mut device: File, answer_kernel: bool) {
    let mut buffer = vec![0; MESSAGE_BUFFER];
    let mut init_answered = false;
    loop {
        let read = match socket.read(&mut buffer) {
            Ok(0) => return,
            Ok(read) => read,
            Err(err) => {
                tracing::warn!(%err, "cannot read the library's answer");
                return;
            }
        };
        if !std::mem::replace(&mut init_answered, true) && !answer_kernel {
            continue;
        }
        // ENOENT: the request was interrupted meanwhile; nobody waits for it.
        if let Err(err) = device.write(&buffer[..read]) {
            tracing::debug!(%err, "the kernel refused an answer");
        }
    }
}

/// `bytes` as lowercase hex: how the watchdog hands a child the INIT request.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The bytes `text` spells in hex; None unless it is an even run of hex digits.
pub fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.bytes().all(|byte| byte.is_ascii_hexdigit()) {
        return None;
    }
    (0..text.len()).step_by(2).map(|at| u8::from_str_radix(text.get(at..at + 2)?, 16).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_goes_both_ways_and_refuses_what_is_not_hex() {
        let bytes = [0x00, 0x1a, 0xff, 0x7e];
        assert_eq!(to_hex(&bytes), "001aff7e");
        assert_eq!(from_hex("001aff7e").unwrap(), bytes);
        assert_eq!(from_hex("001AFF7E").unwrap(), bytes);
        assert_eq!(from_hex("001"), None);
        assert_eq!(from_hex("0g"), None);
        assert_eq!(from_hex("+1"), None);
    }
}
