//! Where the supervisor loop gets the mount table from: the FUSE mounts of
//! the watched namespace as a [`Snapshot`], from the mountinfo text (poll
//! mode, `heal --once`, kernels before 6.8), from a table kept by unique
//! mount ID (the loop's other sources), or from a table a unit test sets.
use std::io;

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

/// The loop's seam to the mount table.
pub trait TableSource {
    /// The FUSE mounts as they are now.
    fn snapshot(&mut self) -> Result<Snapshot, TableError>;
    /// Whether a snapshot now could differ from the last one, without
    /// making one (true when unsure).
    fn changed_since_read(&mut self) -> io::Result<bool>;
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
impl TableSource for MountInfoReader {
    fn snapshot(&mut self) -> Result<Snapshot, TableError> {
        let table = self.read().map_err(TableError::Read)?;
        Ok(Snapshot::parse(table)?)
    }

    fn changed_since_read(&mut self) -> io::Result<bool> {
        MountInfoReader::changed_since_read(self)
    }

    fn release_buffer(&mut self) {
        MountInfoReader::release_buffer(self);
    }
}
