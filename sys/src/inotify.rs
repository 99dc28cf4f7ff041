//! inotify on directories: a thin typed layer over rustix's safe calls.
//!
//! Watches are always added with `IN_DONT_FOLLOW` (and `IN_ONLYDIR` on
//! directories): the trees watched (the kubelet's pod directories) are
//! attacker-influenced, and a symlink put in place of a directory or file
//! must not move a watch elsewhere.
use std::ffi::OsStr;
use std::io;
use std::mem::MaybeUninit;
use std::ops::ControlFlow;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::inotify::{self, CreateFlags};

pub use rustix::fs::inotify::{ReadFlags as EventFlags, WatchFlags};

/// An inotify instance, non-blocking and close-on-exec: register it with
/// [`crate::poll::Poller::add_readable`] and drain it with an [`EventReader`].
#[derive(Debug)]
pub struct Inotify {
    fd: OwnedFd,
}

impl Inotify {
    /// `inotify_init1(IN_NONBLOCK|IN_CLOEXEC)`.
    pub fn new() -> io::Result<Self> {
        Ok(Inotify { fd: inotify::init(CreateFlags::NONBLOCK | CreateFlags::CLOEXEC)? })
    }

    /// `inotify_add_watch(path, mask|IN_ONLYDIR|IN_DONT_FOLLOW)`: the watch
    /// descriptor, the same one again if the directory is watched already.
    /// `ENOTDIR` if `path` is not a directory (or is a symlink), `ENOENT` if
    /// it is gone, `ENOSPC` when `fs.inotify.max_user_watches` is reached.
    pub fn watch_dir(&self, path: &Path, mask: WatchFlags) -> io::Result<i32> {
        Ok(inotify::add_watch(&self.fd, path, mask | WatchFlags::ONLYDIR | WatchFlags::DONT_FOLLOW)?)
    }

    /// `inotify_add_watch(path, mask|IN_DONT_FOLLOW)` on a file: events on
    /// the inode's own mark. A symlink is watched itself, never its target.
    pub fn watch_file(&self, path: &Path, mask: WatchFlags) -> io::Result<i32> {
        Ok(inotify::add_watch(&self.fd, path, mask | WatchFlags::DONT_FOLLOW)?)
    }

    /// `inotify_rm_watch`. `EINVAL` if the kernel dropped the watch already
    /// (its directory was deleted).
    pub fn unwatch(&self, wd: i32) -> io::Result<()> {
        Ok(inotify::remove_watch(&self.fd, wd)?)
    }
}

impl AsFd for Inotify {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// One decoded inotify event.
#[derive(Debug, Clone, Copy)]
pub struct Event<'a> {
    /// The watch it is about; `-1` for `IN_Q_OVERFLOW`.
    pub wd: i32,
    pub flags: EventFlags,
    /// The entry's name, for events about an entry of the watched directory.
    pub name: Option<&'a OsStr>,
}

/// A reusable buffer that reads events off an [`Inotify`].
pub struct EventReader {
    buf: Vec<MaybeUninit<u8>>,
}

/// Room for hundreds of events per `read`; an event is 16 bytes plus its name
/// padded, and the kernel never splits one across reads.
const READ_BUFFER: usize = 64 * 1024;

impl Default for EventReader {
    fn default() -> Self {
        EventReader { buf: vec![MaybeUninit::uninit(); READ_BUFFER] }
    }
}

impl EventReader {
    /// Hands every queued event to `handle`, in order, until the queue is
    /// empty (`EAGAIN`) or `handle` breaks. Returns whether it was broken off.
    pub fn drain(
        &mut self,
        inotify: &Inotify,
        mut handle: impl FnMut(Event<'_>) -> ControlFlow<()>,
    ) -> io::Result<ControlFlow<()>> {
        let mut reader = inotify::Reader::new(inotify.as_fd(), &mut self.buf);
        loop {
            let event = match reader.next() {
                Ok(event) => event,
                Err(rustix::io::Errno::AGAIN) => return Ok(ControlFlow::Continue(())),
                Err(rustix::io::Errno::INTR) => continue,
                Err(errno) => return Err(errno.into()),
            };
            let event = Event {
                wd: event.wd(),
                flags: event.events(),
                name: event.file_name().map(|name| OsStr::from_bytes(name.to_bytes())),
            };
            if handle(event).is_break() {
                return Ok(ControlFlow::Break(()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_created_entries_and_refuses_symlinks() {
        let dir = std::env::temp_dir().join(format!("inotify-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let inotify = Inotify::new().unwrap();
        let wd = inotify.watch_dir(&dir, WatchFlags::CREATE).unwrap();
        std::fs::create_dir(dir.join("a")).unwrap();
        std::os::unix::fs::symlink(dir.join("a"), dir.join("link")).unwrap();
        let err = inotify.watch_dir(&dir.join("link"), WatchFlags::CREATE).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOTDIR));

        let mut seen = Vec::new();
        let mut reader = EventReader::default();
        let flow = reader
            .drain(&inotify, |event| {
                assert_eq!(event.wd, wd);
                seen.push(event.name.unwrap().to_owned());
                ControlFlow::Continue(())
            })
            .unwrap();
        assert!(flow.is_continue());
        assert_eq!(seen, ["a", "link"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
