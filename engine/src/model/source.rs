//! Where the supervisor loop gets the mount table from: the FUSE mounts of
//! the watched namespace as a [`Snapshot`], from the mountinfo text (poll
//! mode, `heal --once`, kernels before 6.8), from a table kept by unique
//! mount ID (the loop's other sources), or from a table a unit test sets.
use std::io;

use tracing::warn;

use crate::errors::chain;
use crate::model::incremental::IncrementalError;
use crate::model::mountinfo::{MountInfoReader, ParseError};
use crate::model::table::Snapshot;

#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error("cannot read the mount table")]
    Read(#[source] io::Error),
    #[error("mount table did not parse")]
    Parse(#[from] ParseError),
    #[error(transparent)]
    Incremental(#[from] IncrementalError),
    /// The mount events the table is kept from could not be taken.
    #[error("cannot take the mount events")]
    Events(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// A snapshot and whether it took in a change since the one before it.
#[derive(Debug)]
pub struct TableRead {
    pub snapshot: Snapshot,
    /// Told by the read itself: a change made after a caller's
    /// [`TableSource::changed_since_read`] and before its snapshot is in it,
    /// and a caller that reads outside a scan must scan it.
    pub changed: bool,
}

/// The loop's seam to the mount table.
pub trait TableSource {
    /// The FUSE mounts as they are now.
    fn snapshot(&mut self) -> Result<TableRead, TableError>;
    /// Whether a snapshot now could differ from the last one, without
    /// making one (true when unsure).
    fn changed_since_read(&mut self) -> io::Result<bool>;
    /// How many times since the last call the table was read again from
    /// scratch because mount events were lost.
    fn take_lost_resyncs(&mut self) -> u32 {
        0
    }
    /// Gives a large buffer's memory back between changes.
    fn release_buffer(&mut self) {}
    /// After a scan: drops its large buffer and hands the memory the scan
    /// freed back to the kernel, scattered as it is between long-lived
    /// allocations.
    fn release_memory(&mut self) {
        self.release_buffer();
        fuse_supervisor_sys::memory::release_free_memory();
    }
}

/// The whole text, read consistently and parsed at each snapshot; its
/// change flag is mountinfo's `POLLPRI`.
///
/// A malformed line (the kernel writes none; a filesystem printing what it
/// should have escaped could) leaves out that line's mount alone: every
/// well-formed line is used, so one odd mount does not stop the heals of
/// the whole node. Each malformed line is logged with its line number and
/// field when it first appears, and again whenever the set changes.
#[derive(Debug)]
pub struct TextTable {
    reader: MountInfoReader,
    /// The malformed lines of the last snapshot, as logged.
    malformed: Vec<ParseError>,
}

impl TextTable {
    pub fn new(reader: MountInfoReader) -> Self {
        TextTable { reader, malformed: Vec::new() }
    }
}

impl TableSource for TextTable {
    fn snapshot(&mut self) -> Result<TableRead, TableError> {
        self.reader.read().map_err(TableError::Read)?;
        let changed = self.reader.last_read_took_in_change();
        let (snapshot, malformed) = Snapshot::parse_lenient(self.reader.buffer());
        if malformed != self.malformed {
            for err in &malformed {
                warn!(err = %chain(&err), "malformed mount table line left out; the other lines are used");
            }
            self.malformed = malformed;
        }
        Ok(TableRead { snapshot, changed })
    }

    fn changed_since_read(&mut self) -> io::Result<bool> {
        self.reader.changed_since_read()
    }

    fn release_buffer(&mut self) {
        self.reader.release_buffer();
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use tracing::Level;

    use super::*;
    use fuse_supervisor_testbed::CapturedLogs;

    #[test]
    fn a_malformed_line_is_logged_once_and_the_others_are_used() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(b"91 90 0:46 / /g rw shared:2 - fuse.bindfs bindfs rw\n92 90 0:46 / /p\\9 rw - fuse.bindfs bindfs rw\n93 90 0:46 / /pods/a/mount rw shared:2 - fuse.bindfs bindfs rw\n").unwrap();
        let mut table = TextTable::new(MountInfoReader::open(file.path()).unwrap());
        let logs = CapturedLogs::default();
        let reads = logs.capture(Level::WARN, || [table.snapshot().unwrap(), table.snapshot().unwrap()]);
        assert_eq!(reads.each_ref().map(|read| read.changed), [true, false], "the first read takes the table in");
        for TableRead { snapshot, .. } in reads {
            let kept: Vec<u32> = snapshot.fuse_mounts.iter().map(|mount| mount.mount_id).collect();
            assert_eq!(kept, [91, 93]);
        }
        let text = logs.text();
        assert_eq!(text.matches("malformed mount table line left out").count(), 1, "{text}");
        assert!(text.contains("mountinfo line 2, column 14: field `mount point`: invalid escape"), "{text}");
    }
}
