//! Messages carrying descriptors between processes: `SOCK_SEQPACKET` Unix
//! sockets, each write one message, with descriptors passed as
//! `SCM_RIGHTS`.
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags,
};

/// The most descriptors one message carries (the kernel's `SCM_MAX_FD` is
/// 253).
pub const MAX_FDS: usize = 250;

/// A connected pair of close-on-exec `SOCK_SEQPACKET` sockets.
pub fn pair() -> io::Result<(OwnedFd, OwnedFd)> {
    crate::fuse::message_pair()
}

/// Sends `bytes` and `fds` (at most [`MAX_FDS`]) as one message. A peer that
/// is gone is `EPIPE`, never a `SIGPIPE`.
pub fn send(socket: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{} descriptors in one message", fds.len())));
    }
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("the descriptors do not fit the control buffer"));
    }
    let sent = rustix::net::sendmsg(socket, &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL)?;
    if sent != bytes.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, format!("sent {sent} of {} bytes", bytes.len())));
    }
    Ok(())
}

/// One message read by [`recv`]: its length in the buffer and the
/// descriptors it carried, in the order they were sent. A length of 0 with
/// no descriptors is the peer's end.
#[derive(Debug)]
pub struct Received {
    pub len: usize,
    pub fds: Vec<OwnedFd>,
}

/// Reads one message into `buf`, its descriptors close-on-exec. A message
/// longer than `buf`, or with more descriptors than [`MAX_FDS`], is an
/// error (what did not fit is lost).
pub fn recv(socket: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Received> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let message = rustix::net::recvmsg(socket, &mut [IoSliceMut::new(buf)], &mut control, RecvFlags::CMSG_CLOEXEC)?;
    let mut fds = Vec::new();
    for ancillary in control.drain() {
        if let RecvAncillaryMessage::ScmRights(passed) = ancillary {
            fds.extend(passed);
        }
    }
    if message.flags.contains(ReturnFlags::TRUNC) || message.flags.contains(ReturnFlags::CTRUNC) {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "a message did not fit the buffer"));
    }
    Ok(Received { len: message.bytes, fds })
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;

    #[test]
    fn a_message_carries_its_bytes_and_descriptors_in_order() {
        let (left, right) = pair().unwrap();
        let (first, second) = pair().unwrap();
        send(left.as_fd(), b"two", &[first.as_fd(), second.as_fd()]).unwrap();
        let mut buf = [0u8; 16];
        let received = recv(right.as_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..received.len], b"two");
        assert_eq!(received.fds.len(), 2);
        // The first descriptor received is `first`: what is sent on it reaches `second`.
        send(received.fds[0].as_fd(), b"x", &[]).unwrap();
        assert_eq!(recv(second.as_fd(), &mut buf).unwrap().len, 1);

        drop(left);
        let end = recv(right.as_fd(), &mut buf).unwrap();
        assert!(end.len == 0 && end.fds.is_empty());
    }

    #[test]
    fn a_message_too_long_for_the_buffer_is_an_error() {
        let (left, right) = pair().unwrap();
        send(left.as_fd(), &[7; 32], &[]).unwrap();
        let err = recv(right.as_fd(), &mut [0u8; 8]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
}
