//! What the loop knows of each source path beyond the table, one record a
//! path: the connection a scan first saw there and when, and the probe it
//! is in. A record goes as soon as it holds nothing.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use fuse_supervisor_engine::heal::Prepared;
use fuse_supervisor_engine::model::table::Dev;
use fuse_supervisor_engine::plan::HealBatch;

/// One source path's record.
#[derive(Debug, Default)]
pub(super) struct SourceRecord {
    /// The connection a scan first saw at the path, and when: the heal
    /// latency of targets left behind by a replacement starts there. By
    /// device, not mount ID: the kernel reuses a freed mount's ID at once.
    pub(super) seen: Option<(Dev, Instant)>,
    /// The batch its running probe was started for, and the table read it
    /// was planned from: healed as it is if the table has not moved on.
    /// With it, the handles its heal takes before the first stack, taken
    /// while the probe waits for the daemon.
    pub(super) probed: Option<Probed>,
    /// Its probe overran its time, and that was reported.
    pub(super) overdue_reported: bool,
    /// A probe runs of its connection, which no process was found holding:
    /// ENOTCONN says its daemon died before it was found.
    pub(super) probing_unheld: Option<Dev>,
    /// The newest mount waits for one of the probes of earlier mounts left
    /// to their daemons to end, and that was said (once, not every scan).
    pub(super) waiting_said: bool,
}

/// A planned heal waiting for its source's probe.
#[derive(Debug)]
pub(super) struct Probed {
    pub(super) read: u64,
    pub(super) batch: HealBatch,
    pub(super) prepared: Prepared,
}

impl SourceRecord {
    fn is_empty(&self) -> bool {
        self.seen.is_none()
            && self.probed.is_none()
            && !self.overdue_reported
            && self.probing_unheld.is_none()
            && !self.waiting_said
    }
}

/// Every source path's record.
#[derive(Debug, Default)]
pub(super) struct Sources(BTreeMap<PathBuf, SourceRecord>);

impl Sources {
    pub(super) fn get(&self, source: &Path) -> Option<&SourceRecord> {
        self.0.get(source)
    }

    /// Changes the record of `source`, made if there is none and dropped
    /// if `change` leaves it empty; returns what `change` does.
    pub(super) fn update<T>(&mut self, source: &Path, change: impl FnOnce(&mut SourceRecord) -> T) -> T {
        let record = self.0.entry(source.to_path_buf()).or_default();
        let out = change(record);
        if record.is_empty() {
            self.0.remove(source);
        }
        out
    }

    /// Each record, to change; the empty ones are dropped after.
    pub(super) fn update_all(&mut self, mut change: impl FnMut(&Path, &mut SourceRecord)) {
        self.0.retain(|source, record| {
            change(source, record);
            !record.is_empty()
        });
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&PathBuf, &SourceRecord)> {
        self.0.iter()
    }

    /// When a scan first saw the connection `dev` at `source`; None if
    /// none has yet.
    pub(super) fn seen_at(&self, source: &Path, dev: Dev) -> Option<Instant> {
        let (seen, at) = self.0.get(source)?.seen?;
        (seen == dev).then_some(at)
    }

    /// Whether its probe overran and that was reported.
    pub(super) fn overdue_reported(&self, source: &Path) -> bool {
        self.0.get(source).is_some_and(|record| record.overdue_reported)
    }
}
