//! fanotify mount events (Linux 6.15+): the kernel reports each mount
//! attached to or detached from a marked mount namespace, by unique mount ID.
//!
//! Neither rustix nor libc 0.2 names the mount-event flags yet: they are
//! defined here from `include/uapi/linux/fanotify.h` of Linux 6.15. The
//! record layouts come from libc's `fanotify_event_metadata` and
//! `fanotify_event_info_header`, and offsets are computed, not written down.
use std::io;
use std::mem::{offset_of, size_of};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr;

use crate::bytes::{u16_at, u32_at, u64_at};

/// `FAN_REPORT_MNT`: the group reports mount events, each with a
/// [`FAN_EVENT_INFO_TYPE_MNT`] record (init flag).
const FAN_REPORT_MNT: libc::c_uint = 0x0000_4000;
/// `FAN_MARK_MNTNS`: the object marked is a mount namespace, given as an
/// open `/proc/<pid>/ns/mnt` fd (mark flag; both bits of `FAN_MARK_MOUNT`
/// and `FAN_MARK_FILESYSTEM`, hence not a bit of its own).
const FAN_MARK_MNTNS: libc::c_uint = 0x0000_0110;
/// `FAN_MNT_ATTACH`: a mount was attached to the namespace (event).
const FAN_MNT_ATTACH: u64 = 0x0100_0000;
/// `FAN_MNT_DETACH`: a mount was detached from the namespace (event).
const FAN_MNT_DETACH: u64 = 0x0200_0000;
/// `FAN_EVENT_INFO_TYPE_MNT`: the info record holding the unique mount ID.
/// 7, not 6: 6 went to `FAN_EVENT_INFO_TYPE_RANGE` (Linux 6.14) before the
/// mount events were merged.
const FAN_EVENT_INFO_TYPE_MNT: u8 = 7;

/// `struct fanotify_event_info_mnt`, for its layout.
#[repr(C)]
struct InfoMnt {
    hdr: libc::fanotify_event_info_header,
    mnt_id: u64,
}

const METADATA_LEN: usize = size_of::<libc::fanotify_event_metadata>();
const INFO_HEADER_LEN: usize = size_of::<libc::fanotify_event_info_header>();

/// A fanotify group that reports mount events, non-blocking and
/// close-on-exec: mark namespaces with [`MountEvents::watch_namespace`],
/// register it with [`crate::poll::Poller::add_readable_oneshot`] (it is
/// readable while events are queued), read with a [`MountEventReader`].
#[derive(Debug)]
pub struct MountEvents {
    fd: OwnedFd,
}

impl MountEvents {
    /// `fanotify_init(FAN_CLASS_NOTIF|FAN_REPORT_MNT|FAN_NONBLOCK|FAN_CLOEXEC, O_RDONLY)`.
    ///
    /// `EINVAL` on kernels without mount events (before 6.15), `EPERM`
    /// without `CAP_SYS_ADMIN`, `EMFILE` past `fs.fanotify.max_user_groups`.
    pub fn new() -> io::Result<Self> {
        let flags = libc::FAN_CLASS_NOTIF | FAN_REPORT_MNT | libc::FAN_NONBLOCK | libc::FAN_CLOEXEC;
        // O_RDONLY is about the fds of file events; mount events carry none.
        let event_flags = libc::O_RDONLY as libc::c_uint;
        // SAFETY: plain integer arguments; the return value is checked
        // before it is taken as an fd.
        let fd = unsafe { libc::fanotify_init(flags, event_flags) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by fanotify_init, so it is open and
        // owned by nothing else.
        Ok(MountEvents { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// `fanotify_mark(group, FAN_MARK_ADD|FAN_MARK_MNTNS, FAN_MNT_ATTACH|FAN_MNT_DETACH, namespace, NULL)`.
    ///
    /// From now on every mount attached to or detached from that namespace
    /// (by the namespace's own processes or by propagation) is queued;
    /// mounts of other namespaces are not. `namespace` is an open
    /// `/proc/<pid>/ns/mnt`; the mark does not keep it open. `EINVAL` on
    /// kernels without mount events or for an fd that is not a mount
    /// namespace, `EPERM` without `CAP_SYS_ADMIN` over the namespace.
    pub fn watch_namespace(&self, namespace: BorrowedFd<'_>) -> io::Result<()> {
        self.mark(libc::FAN_MARK_ADD, namespace)
    }

    /// `fanotify_mark(group, FAN_MARK_REMOVE|FAN_MARK_MNTNS, ...)`: the
    /// namespace's changes are no longer queued, and with no mark left on it
    /// the kernel no longer builds an event for each. Events already queued
    /// stay. `ENOENT` if it was not watched.
    pub fn unwatch_namespace(&self, namespace: BorrowedFd<'_>) -> io::Result<()> {
        self.mark(libc::FAN_MARK_REMOVE, namespace)
    }

    fn mark(&self, action: libc::c_uint, namespace: BorrowedFd<'_>) -> io::Result<()> {
        // SAFETY: both fds are open for the duration of the call, and a null
        // path is what a mark on an fd (not a path beneath it) takes.
        let ret = unsafe {
            libc::fanotify_mark(
                self.fd.as_raw_fd(),
                action | FAN_MARK_MNTNS,
                FAN_MNT_ATTACH | FAN_MNT_DETACH,
                namespace.as_raw_fd(),
                ptr::null(),
            )
        };
        if ret < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
    }
}

impl AsFd for MountEvents {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// One decoded mount event. IDs are the 64-bit unique mount IDs that
/// statmount and `statx(STATX_MNT_ID_UNIQUE)` report, never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MountEvent {
    /// The mount appeared in the namespace.
    Attached(u64),
    /// The mount left the namespace.
    Detached(u64),
    /// The mount moved within the namespace (detach and attach in one event).
    Moved(u64),
    /// The group's queue overflowed: events were lost, the table must be
    /// read again to know it.
    Overflow,
}

impl MountEvent {
    /// The mount that appeared somewhere: attached, or moved to a new place.
    pub fn appeared(&self) -> Option<u64> {
        match *self {
            MountEvent::Attached(id) | MountEvent::Moved(id) => Some(id),
            MountEvent::Detached(_) | MountEvent::Overflow => None,
        }
    }
}

/// A reusable buffer that reads events off a [`MountEvents`] group: no
/// allocation after creation.
pub struct MountEventReader {
    buf: Vec<u8>,
}

/// About 400 mount events (40 bytes each) per `read`; the kernel never
/// splits an event across reads.
const READ_BUFFER: usize = 16 * 1024;

impl Default for MountEventReader {
    fn default() -> Self {
        MountEventReader { buf: vec![0; READ_BUFFER] }
    }
}

impl MountEventReader {
    /// Hands every queued event to `handle`, in order, until the queue is
    /// empty (`EAGAIN`). Returns how many there were. A record the kernel
    /// should never send (an unknown metadata version, a truncated event, a
    /// mount event without its mount ID) is an `InvalidData` error that says
    /// which and at which byte of the read; the events before it were
    /// handled.
    pub fn drain(&mut self, group: &MountEvents, mut handle: impl FnMut(MountEvent)) -> io::Result<usize> {
        let mut count = 0;
        loop {
            let len = match rustix::io::read(&group.fd, &mut self.buf[..]) {
                Ok(len) => len,
                Err(rustix::io::Errno::AGAIN) => return Ok(count),
                Err(rustix::io::Errno::INTR) => continue,
                Err(errno) => return Err(errno.into()),
            };
            if len == 0 {
                return Ok(count);
            }
            let close = |fd| {
                // Mount events carry no fd; should one come anyway, it is
                // ours to close.
                // SAFETY: `decode_events` reports only the fd of an event
                // whose header it checked whole: one the kernel installed in
                // our table for this event alone, which nothing else knows of.
                drop(unsafe { OwnedFd::from_raw_fd(fd) });
            };
            count += decode_events(&self.buf[..len], &mut handle, close)
                .map_err(|err| io::Error::new(io::ErrorKind::InvalidData, err))?;
        }
    }
}

/// A fanotify read that is not a sequence of mount events: where it stops
/// making sense, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    /// The byte of the read where the bad event starts.
    pub offset: usize,
    /// The read's length.
    pub len: usize,
    pub problem: String,
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "fanotify event at byte {} of a {}-byte read: {}", self.offset, self.len, self.problem)
    }
}

impl std::error::Error for DecodeError {}

/// Decodes what one `read` of a mount-event group returned: hands each event
/// to `handle`, in order, and each fd the kernel installed with one (mount
/// events carry none) to `installed`, which must close it. Returns how many
/// events there were; stops at the first record that does not decode, the
/// events before it handled. Pure: touches nothing but its arguments.
pub fn decode_events(
    read: &[u8],
    mut handle: impl FnMut(MountEvent),
    mut installed: impl FnMut(i32),
) -> Result<usize, DecodeError> {
    let mut offset = 0;
    let mut count = 0;
    while offset < read.len() {
        let at = |problem| DecodeError { offset, len: read.len(), problem };
        let (event, event_len, fd) = parse_event(&read[offset..]).map_err(at)?;
        if let Some(fd) = fd {
            installed(fd);
        }
        handle(event.map_err(at)?);
        count += 1;
        offset += event_len;
    }
    Ok(count)
}

/// An event whose header holds: what it says (or why its body does not
/// decode), its length, and the fd the kernel installed with it.
type Framed = (Result<MountEvent, String>, usize, Option<i32>);

/// Decodes the event at the start of `bytes` (what one `read` returned from
/// there on). Bounds are checked before each field is read. A header that
/// does not hold is an error; an event whose header holds but whose body
/// does not is the inner error, so that the length and fd are known.
fn parse_event(bytes: &[u8]) -> Result<Framed, String> {
    type Metadata = libc::fanotify_event_metadata;
    let short = || format!("{} bytes left, less than an event header", bytes.len());
    if bytes.len() < METADATA_LEN {
        return Err(short());
    }
    let event_len = u32_at(bytes, offset_of!(Metadata, event_len)).ok_or_else(short)? as usize;
    let version = bytes[offset_of!(Metadata, vers)];
    let metadata_len = usize::from(u16_at(bytes, offset_of!(Metadata, metadata_len)).ok_or_else(short)?);
    let mask = u64_at(bytes, offset_of!(Metadata, mask)).ok_or_else(short)?;
    let fd = u32_at(bytes, offset_of!(Metadata, fd)).ok_or_else(short)? as i32;
    if version != libc::FANOTIFY_METADATA_VERSION {
        return Err(format!("metadata version {version}, not {}", libc::FANOTIFY_METADATA_VERSION));
    }
    if event_len < METADATA_LEN || event_len > bytes.len() || metadata_len < METADATA_LEN || metadata_len > event_len {
        return Err(format!(
            "an event of {event_len} bytes (header {metadata_len}) does not fit the {} bytes left",
            bytes.len()
        ));
    }
    let fd = (fd >= 0).then_some(fd);
    if mask & libc::FAN_Q_OVERFLOW != 0 {
        return Ok((Ok(MountEvent::Overflow), event_len, fd));
    }
    let event = match mount_id(&bytes[metadata_len..event_len]) {
        None => Err(format!("a mount event (mask {mask:#x}) without a mount ID record")),
        Some(mount_id) => match (mask & FAN_MNT_ATTACH != 0, mask & FAN_MNT_DETACH != 0) {
            (true, true) => Ok(MountEvent::Moved(mount_id)),
            (true, false) => Ok(MountEvent::Attached(mount_id)),
            (false, true) => Ok(MountEvent::Detached(mount_id)),
            (false, false) => Err(format!("an event with mask {mask:#x}, not a mount event")),
        },
    };
    Ok((event, event_len, fd))
}

/// The mount ID in the info records that follow an event's metadata.
fn mount_id(mut records: &[u8]) -> Option<u64> {
    type Header = libc::fanotify_event_info_header;
    while records.len() >= INFO_HEADER_LEN {
        let info_type = records[offset_of!(Header, info_type)];
        let len = usize::from(u16_at(records, offset_of!(Header, len))?);
        if len < INFO_HEADER_LEN || len > records.len() {
            return None;
        }
        if info_type == FAN_EVENT_INFO_TYPE_MNT && len >= size_of::<InfoMnt>() {
            return u64_at(records, offset_of!(InfoMnt, mnt_id));
        }
        records = &records[len..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One event as the kernel lays it out: metadata, then a mount record.
    fn event(mask: u64, mount_id: u64) -> Vec<u8> {
        let mut bytes = vec![0u8; METADATA_LEN + size_of::<InfoMnt>()];
        let total = bytes.len() as u32;
        bytes[0..4].copy_from_slice(&total.to_ne_bytes());
        bytes[4] = libc::FANOTIFY_METADATA_VERSION;
        bytes[6..8].copy_from_slice(&(METADATA_LEN as u16).to_ne_bytes());
        bytes[8..16].copy_from_slice(&mask.to_ne_bytes());
        bytes[16..20].copy_from_slice(&(-1i32).to_ne_bytes());
        let record = &mut bytes[METADATA_LEN..];
        record[0] = FAN_EVENT_INFO_TYPE_MNT;
        record[2..4].copy_from_slice(&(size_of::<InfoMnt>() as u16).to_ne_bytes());
        record[8..16].copy_from_slice(&mount_id.to_ne_bytes());
        bytes
    }

    #[test]
    fn layouts_match_the_uapi_header() {
        assert_eq!(METADATA_LEN, 24);
        assert_eq!(INFO_HEADER_LEN, 4);
        assert_eq!(size_of::<InfoMnt>(), 16);
        assert_eq!(offset_of!(InfoMnt, mnt_id), 8);
    }

    /// Decodes one read; the fds it found with the events.
    fn decode(read: &[u8]) -> Result<(Vec<MountEvent>, Vec<i32>), DecodeError> {
        let (mut events, mut fds) = (Vec::new(), Vec::new());
        decode_events(read, |event| events.push(event), |fd| fds.push(fd))?;
        Ok((events, fds))
    }

    #[test]
    fn decodes_attach_detach_move_and_overflow() {
        let mut read = event(FAN_MNT_ATTACH, 0x1_0000_0042);
        read.extend(event(FAN_MNT_DETACH, 7));
        read.extend(event(FAN_MNT_ATTACH | FAN_MNT_DETACH, 8));
        let mut overflow = event(libc::FAN_Q_OVERFLOW, 0);
        overflow.truncate(METADATA_LEN);
        overflow[0..4].copy_from_slice(&(METADATA_LEN as u32).to_ne_bytes());
        read.extend(overflow);
        let expected = vec![
            MountEvent::Attached(0x1_0000_0042),
            MountEvent::Detached(7),
            MountEvent::Moved(8),
            MountEvent::Overflow,
        ];
        assert_eq!(decode(&read).unwrap(), (expected, vec![]));
    }

    #[test]
    fn refuses_truncated_and_foreign_records_naming_the_byte() {
        let whole = event(FAN_MNT_ATTACH, 1);
        let mut read = whole.clone();
        read.extend(&whole[..30]);
        let err = decode(&read).unwrap_err();
        assert_eq!(err.offset, 40);
        assert_eq!(
            err.to_string(),
            "fanotify event at byte 40 of a 70-byte read: an event of 40 bytes (header 24) does not fit the 30 bytes left"
        );
        let mut old = whole.clone();
        old[4] = 2;
        assert!(decode(&old).unwrap_err().to_string().contains("metadata version 2"));
        let mut no_id = whole.clone();
        no_id[METADATA_LEN] = 6;
        assert!(decode(&no_id).unwrap_err().to_string().contains("without a mount ID record"));
        let mut bad_len = whole.clone();
        bad_len[METADATA_LEN + 2..METADATA_LEN + 4].copy_from_slice(&2u16.to_ne_bytes());
        assert!(decode(&bad_len).is_err(), "a record shorter than its header must not loop");
        let mut with_fd = whole;
        with_fd[16..20].copy_from_slice(&5i32.to_ne_bytes());
        assert_eq!(decode(&with_fd).unwrap(), (vec![MountEvent::Attached(1)], vec![5]), "the fd is handed back");
    }
}
