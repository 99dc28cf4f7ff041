//! The netlink process connector (`NETLINK_CONNECTOR`, group `CN_IDX_PROC`):
//! the kernel's multicast of fork, exec and exit events for every process
//! of the machine.
//!
//! What the kernel does, as seen on Linux 6.18 (and read in
//! `drivers/connector/cn_proc.c`, `include/uapi/linux/cn_proc.h`):
//!
//! - Subscribing is a `PROC_CN_MCAST_LISTEN` message. The kernel answers with
//!   a `PROC_EVENT_NONE` "ack" carrying an errno and `ack = our ack + 1`; it
//!   overwrites the sequence number, so the ack field is what identifies our
//!   answer among other listeners' (acks are multicast to every listener).
//! - It answers only a sender in the initial pid **and** user namespaces;
//!   from anywhere else the message is silently dropped: no ack at all.
//! - The connector exists only in the initial network namespace: from
//!   another one, `send` fails with `ECONNREFUSED`.
//! - Before 6.6 listening needs `CAP_NET_ADMIN` (the ack carries `EPERM`).
//! - From 6.6 the listen message may carry a `proc_input` (8 bytes instead
//!   of 4) with an event-type mask: the kernel then drops every other event
//!   for this socket before queueing it. The ack (`PROC_EVENT_NONE`) goes
//!   through that filter too, so a filtered listen is never acknowledged.
//!   Older kernels drop an 8-byte listen silently.
//!   Hence [`ProcConnector::subscribe`] sends an 8-byte listen for *all*
//!   events (acknowledged only by a kernel with filters), then a classic
//!   4-byte listen (acknowledged by every kernel), waits for the second ack,
//!   and only then, if the first was acknowledged, narrows to the wanted
//!   events. The kernel handles each message synchronously in `send`, so
//!   the two acks arrive in order.
//! - Events for every listener share one multicast: a socket bound to the
//!   group receives what other listeners' subscriptions produce too, even
//!   without its own listen being accepted.
//! - When the socket's receive buffer is full the kernel drops the event
//!   and the next `recv` fails once with `ENOBUFS`: events were lost. Once
//!   per congestion: the socket stays congested, every later event dropped
//!   without another `ENOBUFS`, until a `recv` finds the queue empty. The
//!   `ENOBUFS` comes first, with the queue still full, so a loss is only
//!   reported ([`ReadOutcome::Lost`]) once the queue was read to its end:
//!   whatever was dropped before is covered by that report, whatever is
//!   dropped after raises `ENOBUFS` again.
//!
//! Messages are in native byte order, laid out as `nlmsghdr` (16 bytes),
//! `cn_msg` (20 bytes), then the payload (`proc_input` or `proc_event`).
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::net::netlink::SocketAddrNetlink;
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};

use crate::bytes::{u32_at, u64_at};
use crate::process::ExitStatus;

/// `CN_IDX_PROC` and `CN_VAL_PROC`: the connector id of process events, and
/// the multicast group they are sent to.
const CN_IDX_PROC: u32 = 1;
const CN_VAL_PROC: u32 = 1;
/// `NLMSG_DONE`: the type a connector message travels as.
const NLMSG_DONE: u16 = 3;

const PROC_CN_MCAST_LISTEN: u32 = 1;
const PROC_CN_MCAST_IGNORE: u32 = 2;

const PROC_EVENT_NONE: u32 = 0;
const PROC_EVENT_FORK: u32 = 0x0000_0001;
const PROC_EVENT_EXEC: u32 = 0x0000_0002;
const PROC_EVENT_EXIT: u32 = 0x8000_0000;
/// Every event type a 6.6+ kernel knows (`PROC_EVENT_ALL`): fork, exec,
/// uid, gid, sid, ptrace, comm, non-zero exit, coredump, exit.
const PROC_EVENT_ALL: u32 = 0x0000_0001
    | 0x0000_0002
    | 0x0000_0004
    | 0x0000_0040
    | 0x0000_0080
    | 0x0000_0100
    | 0x0000_0200
    | 0x2000_0000
    | 0x4000_0000
    | 0x8000_0000;

const NLMSGHDR_LEN: usize = 16;
const CN_MSG_LEN: usize = 20;
/// Offset of the `proc_event` in a received message.
const EVENT_OFFSET: usize = NLMSGHDR_LEN + CN_MSG_LEN;
/// `proc_event` header (`what`, `cpu`, `timestamp_ns`) before its union.
const EVENT_HEADER_LEN: usize = 16;
/// A whole `proc_event`: header plus the largest union member.
const EVENT_LEN: usize = EVENT_HEADER_LEN + 24;

/// Datagrams read per [`ProcConnector::read_events`] call at most; the
/// caller's level-triggered poll brings it back for the rest.
const DATAGRAMS_PER_READ: usize = 256;

/// Which event types the kernel should deliver, when it can filter (6.6+).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EventTypes {
    pub fork: bool,
    pub exec: bool,
    pub exit: bool,
}

impl EventTypes {
    fn mask(self) -> u32 {
        let mut mask = 0;
        if self.fork {
            mask |= PROC_EVENT_FORK;
        }
        if self.exec {
            mask |= PROC_EVENT_EXEC;
        }
        if self.exit {
            mask |= PROC_EVENT_EXIT;
        }
        mask
    }
}

/// How to subscribe.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Receive buffer size asked for (the kernel doubles it for its own
    /// bookkeeping); `SO_RCVBUFFORCE` when allowed (CAP_NET_ADMIN), else
    /// `SO_RCVBUF`, which `net.core.rmem_max` caps. `None` keeps the default.
    pub receive_buffer: Option<usize>,
    /// Event types to ask the kernel to filter to; `None`: no kernel filter
    /// (every event type is delivered).
    pub filter: Option<EventTypes>,
    /// How long to wait for the kernel's acknowledgement of the listen.
    pub ack_timeout: Duration,
}

/// Why subscribing failed; which step tells what is missing.
#[derive(Debug)]
pub enum SubscribeError {
    /// `socket(AF_NETLINK, SOCK_DGRAM, NETLINK_CONNECTOR)` failed.
    Socket(io::Error),
    /// Setting the receive buffer failed.
    ReceiveBuffer(io::Error),
    /// Binding to the `CN_IDX_PROC` group failed (`EPERM` before 6.6
    /// without CAP_NET_ADMIN).
    Bind(io::Error),
    /// Sending the listen failed; `ECONNREFUSED` means this is not the host
    /// network namespace.
    Send(io::Error),
    /// Receiving (or waiting for) the acknowledgement failed.
    Receive(io::Error),
    /// No acknowledgement within the timeout: not in the host pid and user
    /// namespaces.
    NoAck { waited: Duration },
    /// The kernel acknowledged with an error (`EPERM`: no CAP_NET_ADMIN
    /// before 6.6).
    Refused { errno: i32 },
}

/// One decoded process event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcEvent {
    /// `child_tgid` (thread `child_pid`) was forked by `parent_tgid`.
    Fork { parent_tgid: u32, child_pid: u32, child_tgid: u32 },
    /// Thread `pid` of process `tgid` called `execve`.
    Exec { pid: u32, tgid: u32 },
    /// Thread `pid` of process `tgid` exited; the process is gone once its
    /// leader (`pid == tgid`) has.
    Exit { pid: u32, tgid: u32, status: ExitStatus },
    /// Another event type (uid, gid, sid, ptrace, comm, coredump) or an
    /// acknowledgement meant for another listener.
    Other { what: u32 },
}

/// A [`ProcEvent`] with the kernel's timestamp (`CLOCK_MONOTONIC`, ns).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimedEvent {
    pub event: ProcEvent,
    pub timestamp_ns: u64,
}

impl TimedEvent {
    /// The kernel's timestamp as an [`Instant`] (both are `CLOCK_MONOTONIC`).
    pub fn instant(&self) -> Instant {
        monotonic_instant(self.timestamp_ns)
    }
}

/// What one [`ProcConnector::read_events`] found besides events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Nothing more to read for now.
    Drained,
    /// More datagrams are queued; read again (the poll says so too).
    More,
    /// The kernel dropped events because the receive buffer was full
    /// (`ENOBUFS`), and the queue has been read to its end since: a drop
    /// from now on is told by another `ENOBUFS`. The events returned are
    /// still valid.
    Lost,
}

/// A subscribed process-connector socket.
#[derive(Debug)]
pub struct ProcConnector {
    socket: OwnedFd,
    /// Whether the kernel acknowledged our listen without an error: only
    /// then is there a listen to take back on drop.
    subscribed: bool,
    /// Whether the kernel accepted an 8-byte `proc_input` listen (6.6+).
    filters: bool,
    /// Whether the wanted filter was installed.
    filtered: bool,
    /// `ENOBUFS` was read and the queue not yet seen empty.
    loss_pending: AtomicBool,
}

impl ProcConnector {
    /// Opens a non-blocking connector socket, joins the process-event group
    /// and subscribes, waiting for the kernel's acknowledgement (see the
    /// module docs for the sequence). Events that other listeners' traffic
    /// brings in meanwhile are discarded.
    pub fn subscribe(options: Options) -> Result<ProcConnector, SubscribeError> {
        let socket = rustix::net::socket_with(
            AddressFamily::NETLINK,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            Some(rustix::net::netlink::CONNECTOR),
        )
        .map_err(|errno| SubscribeError::Socket(errno.into()))?;
        // Port 0: the kernel picks a free port id.
        rustix::net::bind(&socket, &SocketAddrNetlink::new(0, CN_IDX_PROC))
            .map_err(|errno| SubscribeError::Bind(errno.into()))?;
        let mut connector = ProcConnector {
            socket,
            subscribed: false,
            filters: false,
            filtered: false,
            loss_pending: AtomicBool::new(false),
        };

        let nonce = ack_nonce();
        let probe_ack = nonce;
        let listen_ack = nonce.wrapping_add(2);
        if options.filter.is_some() {
            connector.send_control(probe_ack, &proc_input(PROC_CN_MCAST_LISTEN, PROC_EVENT_ALL))?;
        }
        connector.send_control(listen_ack, &PROC_CN_MCAST_LISTEN.to_ne_bytes())?;
        let (probe_acked, errno) = connector.await_ack(probe_ack, listen_ack, options.ack_timeout)?;
        if errno != 0 {
            return Err(SubscribeError::Refused { errno: errno as i32 });
        }
        connector.subscribed = true;
        connector.filters = probe_acked;
        if let (Some(types), true) = (options.filter, probe_acked) {
            // Filtered out like every other PROC_EVENT_NONE: no ack to wait for.
            connector.send_control(nonce.wrapping_add(4), &proc_input(PROC_CN_MCAST_LISTEN, types.mask()))?;
            connector.filtered = true;
            // Events queued before the filter took effect are of every type:
            // the caller is promised only the asked ones from here on.
            connector.discard_queued().map_err(SubscribeError::Receive)?;
        }
        // Sized only now: until the filter is in place every event on the
        // machine arrives, and a small buffer would lose the acks among them.
        if let Some(bytes) = options.receive_buffer {
            set_receive_buffer(connector.socket.as_fd(), bytes).map_err(SubscribeError::ReceiveBuffer)?;
        }
        Ok(connector)
    }

    /// Whether the kernel filters events for this socket (6.6+, and a
    /// filter was asked for).
    pub fn kernel_filter(&self) -> bool {
        self.filtered
    }

    /// The receive buffer the kernel granted (`SO_RCVBUF`, already doubled).
    pub fn receive_buffer(&self) -> io::Result<usize> {
        Ok(rustix::net::sockopt::socket_recv_buffer_size(&self.socket)?)
    }

    /// Reads the queued datagrams (up to a batch) without blocking and
    /// appends their events to `events`. Datagrams not from the kernel are
    /// ignored. After an `ENOBUFS`, the batch that reaches the end of the
    /// queue ends with [`ReadOutcome::Lost`] (see the module's notes: a
    /// loss reported earlier would miss the events dropped while the
    /// queue is still full).
    pub fn read_events(&self, events: &mut Vec<TimedEvent>) -> io::Result<ReadOutcome> {
        let mut buffer = [0u8; 4096];
        let mut read = 0;
        while read < DATAGRAMS_PER_READ {
            match rustix::net::recvfrom(&self.socket, &mut buffer[..], RecvFlags::empty()) {
                Ok((_, length, sender)) => {
                    read += 1;
                    if from_kernel(sender) {
                        decode_datagram(&buffer[..length.min(buffer.len())], events);
                    }
                }
                Err(rustix::io::Errno::AGAIN) => {
                    let lost = self.loss_pending.swap(false, Ordering::Relaxed);
                    return Ok(if lost { ReadOutcome::Lost } else { ReadOutcome::Drained });
                }
                Err(rustix::io::Errno::NOBUFS) => self.loss_pending.store(true, Ordering::Relaxed),
                Err(rustix::io::Errno::INTR) => continue,
                Err(errno) => return Err(errno.into()),
            }
        }
        Ok(ReadOutcome::More)
    }

    /// Drops every datagram queued now, without blocking.
    fn discard_queued(&self) -> io::Result<()> {
        let mut buffer = [0u8; 4096];
        loop {
            match rustix::net::recvfrom(&self.socket, &mut buffer[..], RecvFlags::empty()) {
                Ok(_) | Err(rustix::io::Errno::INTR | rustix::io::Errno::NOBUFS) => {}
                Err(rustix::io::Errno::AGAIN) => return Ok(()),
                Err(errno) => return Err(errno.into()),
            }
        }
    }

    fn send_control(&self, ack: u32, payload: &[u8]) -> Result<(), SubscribeError> {
        let message = control_message(ack, payload);
        let kernel = SocketAddrNetlink::new(0, 0);
        rustix::net::sendto(&self.socket, &message, SendFlags::empty(), &kernel)
            .map(drop)
            .map_err(|errno| SubscribeError::Send(errno.into()))
    }

    /// Waits for the ack of `listen_ack`; returns whether the ack of
    /// `probe_ack` came first, and the listen ack's errno.
    fn await_ack(&self, probe_ack: u32, listen_ack: u32, timeout: Duration) -> Result<(bool, u32), SubscribeError> {
        let deadline = Instant::now() + timeout;
        let mut probe_acked = false;
        let mut buffer = [0u8; 4096];
        loop {
            loop {
                match rustix::net::recvfrom(&self.socket, &mut buffer[..], RecvFlags::empty()) {
                    Ok((_, length, sender)) => {
                        if !from_kernel(sender) {
                            continue;
                        }
                        match decode_ack(&buffer[..length.min(buffer.len())]) {
                            Some((ack, _)) if ack == probe_ack.wrapping_add(1) => probe_acked = true,
                            Some((ack, errno)) if ack == listen_ack.wrapping_add(1) => {
                                return Ok((probe_acked, errno));
                            }
                            _ => {}
                        }
                    }
                    Err(rustix::io::Errno::AGAIN) => break,
                    // Other listeners' events overflowed the buffer: our ack
                    // may be among the lost; the timeout decides.
                    Err(rustix::io::Errno::NOBUFS | rustix::io::Errno::INTR) => continue,
                    Err(errno) => return Err(SubscribeError::Receive(errno.into())),
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(SubscribeError::NoAck { waited: timeout });
            }
            let timespec = Timespec::try_from(left).map_err(|_| {
                SubscribeError::Receive(io::Error::new(io::ErrorKind::InvalidInput, "ack timeout out of range"))
            })?;
            let mut fds = [PollFd::new(&self.socket, PollFlags::IN)];
            match rustix::event::poll(&mut fds, Some(&timespec)) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(errno) => return Err(SubscribeError::Receive(errno.into())),
            }
        }
    }
}

impl AsFd for ProcConnector {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

impl Drop for ProcConnector {
    /// Unsubscribes, so the kernel's listener count (which decides whether
    /// it builds events at all) goes back down. Best effort. Never without an
    /// accepted listen: before 6.6 the kernel does not track listens per
    /// socket, and a spurious `IGNORE` would cut events off for every other
    /// listener on the machine.
    fn drop(&mut self) {
        if !self.subscribed {
            return;
        }
        let message = if self.filters {
            control_message(0, &proc_input(PROC_CN_MCAST_IGNORE, PROC_EVENT_ALL))
        } else {
            control_message(0, &PROC_CN_MCAST_IGNORE.to_ne_bytes())
        };
        let _ = rustix::net::sendto(&self.socket, &message, SendFlags::empty(), &SocketAddrNetlink::new(0, 0));
    }
}

/// `SO_RCVBUFFORCE`, which ignores `rmem_max` but needs CAP_NET_ADMIN, else
/// `SO_RCVBUF`.
fn set_receive_buffer(socket: BorrowedFd<'_>, bytes: usize) -> io::Result<()> {
    match rustix::net::sockopt::set_socket_recv_buffer_size_force(socket, bytes) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::PERM) => Ok(rustix::net::sockopt::set_socket_recv_buffer_size(socket, bytes)?),
        Err(errno) => Err(errno.into()),
    }
}

fn from_kernel(sender: Option<rustix::net::SocketAddrAny>) -> bool {
    sender.and_then(|address| SocketAddrNetlink::try_from(address).ok()).is_some_and(|address| address.pid() == 0)
}

/// A value for the `cn_msg.ack` field that other listeners are unlikely to
/// use (they mostly send 0): the kernel echoes it + 1.
fn ack_nonce() -> u32 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let pid = rustix::process::getpid().as_raw_nonzero().get() as u32;
    // Odd multiplier: distinct pids give distinct values; the high bit keeps
    // it away from the small numbers others use.
    (pid.wrapping_mul(0x9E37_79B1) ^ nanos) | 0x8000_0000
}

/// `struct proc_input { mcast_op, event_type }`.
fn proc_input(op: u32, event_type: u32) -> [u8; 8] {
    let mut input = [0u8; 8];
    input[..4].copy_from_slice(&op.to_ne_bytes());
    input[4..].copy_from_slice(&event_type.to_ne_bytes());
    input
}

/// `nlmsghdr` + `cn_msg` for the process connector, then `payload`.
fn control_message(ack: u32, payload: &[u8]) -> Vec<u8> {
    let total = NLMSGHDR_LEN + CN_MSG_LEN + payload.len();
    let mut message = Vec::with_capacity(total);
    // nlmsghdr: len, type, flags, seq, pid (0: the kernel fills ours in).
    message.extend_from_slice(&(total as u32).to_ne_bytes());
    message.extend_from_slice(&NLMSG_DONE.to_ne_bytes());
    message.extend_from_slice(&0u16.to_ne_bytes());
    message.extend_from_slice(&0u32.to_ne_bytes());
    message.extend_from_slice(&0u32.to_ne_bytes());
    // cn_msg: id.idx, id.val, seq, ack, len, flags.
    message.extend_from_slice(&CN_IDX_PROC.to_ne_bytes());
    message.extend_from_slice(&CN_VAL_PROC.to_ne_bytes());
    message.extend_from_slice(&0u32.to_ne_bytes());
    message.extend_from_slice(&ack.to_ne_bytes());
    message.extend_from_slice(&(payload.len() as u16).to_ne_bytes());
    message.extend_from_slice(&0u16.to_ne_bytes());
    message.extend_from_slice(payload);
    message
}

/// The process-event messages of one datagram (normally exactly one).
fn messages(datagram: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = datagram;
    std::iter::from_fn(move || {
        let length = u32_at(rest, 0)? as usize;
        if length < NLMSGHDR_LEN || length > rest.len() {
            return None;
        }
        let message = &rest[..length];
        // NLMSG_ALIGN: messages are padded to 4 bytes.
        rest = rest.get((length + 3) & !3..).unwrap_or(&[]);
        let is_proc = u32_at(message, NLMSGHDR_LEN) == Some(CN_IDX_PROC)
            && u32_at(message, NLMSGHDR_LEN + 4) == Some(CN_VAL_PROC);
        Some(if is_proc { message } else { &[][..] })
    })
    .filter(|message| message.len() >= EVENT_OFFSET + EVENT_HEADER_LEN)
}

/// `(cn_msg.ack, errno)` of an acknowledgement in `datagram`, if it holds
/// one. Pure, like [`decode_datagram`].
pub fn decode_ack(datagram: &[u8]) -> Option<(u32, u32)> {
    messages(datagram).find_map(|message| {
        let what = u32_at(message, EVENT_OFFSET)?;
        (what == PROC_EVENT_NONE).then_some(())?;
        Some((u32_at(message, NLMSGHDR_LEN + 12)?, u32_at(message, EVENT_OFFSET + EVENT_HEADER_LEN)?))
    })
}

/// Appends the process events of one datagram (as received from the
/// kernel) to `events`. Messages that are not the process connector's, or
/// too short to hold an event, are skipped; a length that does not fit the
/// datagram ends it. Pure: touches nothing but its arguments.
pub fn decode_datagram(datagram: &[u8], events: &mut Vec<TimedEvent>) {
    events.extend(messages(datagram).filter_map(|message| decode_event(&message[EVENT_OFFSET..])));
}

/// One `proc_event`.
fn decode_event(event: &[u8]) -> Option<TimedEvent> {
    let what = u32_at(event, 0)?;
    let timestamp_ns = u64_at(event, 8)?;
    let data = event.get(EVENT_HEADER_LEN..EVENT_LEN.min(event.len()))?;
    let event = match what {
        PROC_EVENT_FORK => ProcEvent::Fork {
            parent_tgid: u32_at(data, 4)?,
            child_pid: u32_at(data, 8)?,
            child_tgid: u32_at(data, 12)?,
        },
        PROC_EVENT_EXEC => ProcEvent::Exec { pid: u32_at(data, 0)?, tgid: u32_at(data, 4)? },
        PROC_EVENT_EXIT => ProcEvent::Exit {
            pid: u32_at(data, 0)?,
            tgid: u32_at(data, 4)?,
            // `exit_code` is the task's wait status; `exit_signal` (at 12)
            // is only the signal its parent gets (SIGCHLD), not the cause.
            status: ExitStatus::from_wait_status(u32_at(data, 8)?),
        },
        other => ProcEvent::Other { what: other },
    };
    Some(TimedEvent { event, timestamp_ns })
}

/// The [`Instant`] of a `CLOCK_MONOTONIC` reading in nanoseconds (what
/// `Instant` measures on Linux), for kernel timestamps.
pub fn monotonic_instant(timestamp_ns: u64) -> Instant {
    let now = Instant::now();
    let clock = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let now_ns = (clock.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(clock.tv_nsec as u64);
    let age = Duration::from_nanos(now_ns.saturating_sub(timestamp_ns));
    now.checked_sub(age).unwrap_or(now)
}

#[cfg(test)]
mod tests;
