//! Consistent reads of a mountinfo file.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;

use fuse_supervisor_sys::mountinfo_poll::priority_pending;

/// Takes mountinfo's change flag (`POLLPRI` on an open mountinfo file):
/// whether the namespace's table changed since it was last taken.
pub fn take_change_flag(mountinfo: &std::fs::File) -> io::Result<bool> {
    priority_pending(mountinfo.as_fd())
}

/// How many times `read` reads again when the table changed during a read.
/// Each reread of a 10,000-mount table costs the kernel ~30 ms; a namespace
/// that changes faster than that forever would otherwise hold the reader.
const MAX_REREADS: usize = 3;

/// Reads a mountinfo file consistently into a buffer it reuses across reads.
///
/// The open file is also the change notifier: register it for `EPOLLPRI`
/// (through [`AsFd`]). `read` consumes its pending notification.
#[derive(Debug)]
pub struct MountInfoReader {
    file: File,
    buffer: Vec<u8>,
    last_read_count: usize,
    /// Length of the last read, to size a released buffer anew.
    last_len: usize,
    /// The table changed since the last read (a consumed notification said
    /// so); true before the first.
    changed: bool,
    /// The last read took in a change the one before it had not seen.
    took_in_change: bool,
}

/// A buffer up to this size is kept between reads; a larger one (a table
/// of a few thousand mounts) is given back by [`MountInfoReader::release_buffer`].
const KEPT_BUFFER: usize = 256 * 1024;

impl MountInfoReader {
    pub fn open(path: &Path) -> io::Result<Self> {
        File::open(path).map(Self::from_file)
    }

    pub fn from_file(file: File) -> Self {
        MountInfoReader {
            file,
            buffer: Vec::new(),
            last_read_count: 0,
            last_len: 0,
            changed: true,
            took_in_change: false,
        }
    }

    /// Reads from offset 0 to EOF; then, if the file reports POLLPRI again
    /// (the table changed during the read), reads again, at most
    /// `MAX_REREADS` times, then returns the last read. The kernel's reads
    /// of a large table are not atomic, so even a consistent-looking read may
    /// list a mount twice: `parse_table` keeps the last line.
    pub fn read(&mut self) -> io::Result<&[u8]> {
        // A change before this read is in the text this read gets; drop its
        // notification so that it does not cause a needless reread.
        let pending = priority_pending(self.file.as_fd())?;
        self.took_in_change = std::mem::take(&mut self.changed) | pending;
        self.last_read_count = 0;
        loop {
            self.read_once()?;
            self.last_read_count += 1;
            if self.last_read_count > MAX_REREADS || !priority_pending(self.file.as_fd())? {
                return Ok(&self.buffer);
            }
            self.took_in_change = true;
        }
    }

    /// Whether the last `read` took in a change since the one before it:
    /// told with the read itself, so a change made after a caller's
    /// [`Self::changed_since_read`] and before its read is not missed.
    pub fn last_read_took_in_change(&self) -> bool {
        self.took_in_change
    }

    /// Whether the table changed since the last `read` finished, without
    /// reading it: one zero-timeout poll. Stays true until the next `read`.
    pub fn changed_since_read(&mut self) -> io::Result<bool> {
        if !self.changed {
            self.changed = priority_pending(self.file.as_fd())?;
        }
        Ok(self.changed)
    }

    /// What the last `read` returned.
    pub fn buffer(&self) -> &[u8] {
        &self.buffer
    }

    /// How many passes the last `read` made (1 when nothing changed during it).
    pub fn last_read_count(&self) -> usize {
        self.last_read_count
    }

    /// Gives the buffer's memory back if it is large: between table changes
    /// a supervisor of a big node would otherwise keep megabytes for nothing.
    /// The next read sizes a new buffer from the last one's length, so it
    /// still takes one pass of reads.
    pub fn release_buffer(&mut self) {
        if self.buffer.capacity() > KEPT_BUFFER {
            self.buffer = Vec::new();
        }
    }

    fn read_once(&mut self) -> io::Result<()> {
        self.buffer.clear();
        // Room for the table as it was plus some growth: the kernel then
        // fills it in one or two reads instead of a doubling series.
        self.buffer.reserve(self.last_len + self.last_len / 8);
        let mut file = &self.file;
        file.seek(SeekFrom::Start(0))?;
        file.read_to_end(&mut self.buffer)?;
        self.last_len = self.buffer.len();
        Ok(())
    }
}

impl AsFd for MountInfoReader {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}
