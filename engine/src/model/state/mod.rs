//! What the supervisor knows about each target, and the state file that
//! keeps the learned target → source mapping across restarts.
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use tracing::warn;

use crate::errors::chain;
use crate::model::path_map::PathMap;
use crate::model::table::{Dev, TargetKind, path_order};

mod writer;

use writer::write_atomically;
pub use writer::{SaveOutcome, StateWriter};

const STATE_FILE: &str = "state.json";
const STATE_VERSION: u32 = 1;

/// Where a target's data comes from, learned while it was healthy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mapping {
    /// Path of the source (global) mount.
    pub source: PathBuf,
    /// Where the target's root lies inside the source: empty for a whole
    /// volume, the subdirectory for a subPath.
    pub root_in_source: PathBuf,
    /// The source mount the target was last seen healthy on.
    pub source_mount_id: u32,
    pub peer_group: Option<u32>,
    pub dev: Dev,
    pub pod_uid: String,
    pub kind: TargetKind,
}

/// What is known of one source (global) mount path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceRecord {
    /// The mount now at the path, and when it was first seen: a restart of
    /// its owner must be later than that.
    pub mount_id: u32,
    /// None when it was already there as the supervisor started.
    pub first_seen: Option<SystemTime>,
    /// The mount it replaced, kept until the replacement is confirmed.
    #[serde(default)]
    pub replaced: Option<Sighting>,
    /// The pod and container serving it, as last confirmed by the kubelet.
    #[serde(default)]
    pub owner: Option<Owner>,
    /// The daemon serving the mount now at the path died; kept until
    /// another mount replaces it (`status` shows the source Degraded).
    #[serde(default)]
    pub daemon_died: Option<DaemonDeath>,
}

/// A FUSE daemon's death, as the process watcher saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonDeath {
    /// 0 when the daemon died before any search found it.
    pub pid: u32,
    pub at: SystemTime,
    /// The connection it served: the source's device when it died.
    pub dev: Dev,
}

/// A mount seen at a source path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sighting {
    pub mount_id: u32,
    pub first_seen: Option<SystemTime>,
}

/// The container that serves a source, confirmed through the kubelet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    pub namespace: String,
    pub pod: String,
    pub pod_uid: String,
    pub container: String,
    pub container_id: Option<String>,
    /// When the container last started: the restart that was confirmed.
    pub started_at: Option<SystemTime>,
}

#[derive(Debug, Default, Deserialize)]
struct StateFile {
    version: u32,
    targets: HashMap<PathBuf, Mapping>,
    #[serde(default)]
    sources: BTreeMap<PathBuf, SourceRecord>,
}

/// The state file as written: borrows the journal's mappings, so a save
/// copies nothing (at 10,000 targets a copy and a whole-file buffer were
/// most of the supervisor's peak memory).
#[derive(Serialize)]
struct StateFileRef<'a> {
    version: u32,
    targets: SortedTargets<'a>,
    sources: &'a BTreeMap<PathBuf, SourceRecord>,
}

/// The mappings, written in path order so that the file reads and diffs
/// well ([`path_order`]: the loop serializes every save, and comparing
/// components costs several times more).
struct SortedTargets<'a>(&'a PathMap<Mapping>);

impl Serialize for SortedTargets<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut sorted: Vec<(&Path, &Mapping)> = self.0.iter().collect();
        sorted.sort_unstable_by(|a, b| path_order(a.0, b.0));
        serializer.collect_map(sorted)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot read state file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("state file {path} is not valid")]
    Invalid {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("state file {path} has version {found}, expected {STATE_VERSION}")]
    Version { path: PathBuf, found: u32 },
    #[error("cannot write state file {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl StateError {
    /// Line and column (1-based) of where a state file stops being valid JSON.
    pub fn position(&self) -> Option<(usize, usize)> {
        match self {
            StateError::Invalid { source, .. } => Some((source.line(), source.column())),
            _ => None,
        }
    }
}

/// The mapping of every known target, persisted under `--state-dir`.
///
/// A hash map on the paths' bytes ([`PathMap`]): every scan looks up every
/// target, and at 10,000 targets the component-by-component path
/// comparisons of an ordered map were a third of a rescan's CPU.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    mappings: PathMap<Mapping>,
    sources: BTreeMap<PathBuf, SourceRecord>,
}

impl Journal {
    /// Loads the state file, or starts empty when there is none yet.
    pub fn load(state_dir: &Path) -> Result<Self, StateError> {
        let path = state_dir.join(STATE_FILE);
        match fs::read(&path) {
            Ok(bytes) => Journal::parse(&bytes, &path),
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                Ok(Journal { path, mappings: PathMap::new(), sources: BTreeMap::new() })
            }
            Err(source) => Err(StateError::Read { path, source }),
        }
    }

    /// A state file's contents; `path` is where it is kept (and saved),
    /// named in errors.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, StateError> {
        let file: StateFile =
            serde_json::from_slice(bytes).map_err(|source| StateError::Invalid { path: path.to_path_buf(), source })?;
        if file.version != STATE_VERSION {
            return Err(StateError::Version { path: path.to_path_buf(), found: file.version });
        }
        Ok(Journal { path: path.to_path_buf(), mappings: file.targets.into_iter().collect(), sources: file.sources })
    }

    /// Loads the state file for `run`. One that cannot be used (unreadable,
    /// empty, not valid, another version) is renamed aside, to
    /// `state.json.corrupt-<UTC time>`, with one warning saying where it is
    /// bad, and the journal starts empty: the mount table and the layouts
    /// are enough to go on, where an error would stop the node agent and
    /// restart it into the same file until someone deleted it.
    pub fn load_or_set_aside(state_dir: &Path) -> Self {
        let err = match Journal::load(state_dir) {
            Ok(journal) => return journal,
            Err(err) => err,
        };
        let path = state_dir.join(STATE_FILE);
        let (line, column) = err.position().unzip();
        match set_aside(&path) {
            Ok(kept_as) => warn!(
                path = %path.display(),
                kept_as = %kept_as.display(),
                line,
                column,
                err = %chain(&err),
                "state file cannot be used; kept aside, starting from the mount table and the layouts"
            ),
            // Then the next save replaces it, if the directory lets it.
            Err(rename) => warn!(
                path = %path.display(),
                line,
                column,
                err = %chain(&err),
                ?rename,
                "state file cannot be used, nor renamed aside; starting from the mount table and the layouts"
            ),
        }
        Journal { path, mappings: PathMap::new(), sources: BTreeMap::new() }
    }

    /// A journal that never touches disk (offline `status`).
    pub fn in_memory() -> Self {
        Journal { path: PathBuf::new(), mappings: PathMap::new(), sources: BTreeMap::new() }
    }

    pub fn get(&self, target: &Path) -> Option<&Mapping> {
        self.mappings.get(target)
    }

    /// Every mapping, in no particular order.
    pub fn mappings(&self) -> &PathMap<Mapping> {
        &self.mappings
    }

    /// Records a mapping; returns whether anything changed.
    pub fn record(&mut self, target: &Path, mapping: Mapping) -> bool {
        if self.mappings.get(target) == Some(&mapping) {
            return false;
        }
        self.mappings.insert(target.to_path_buf(), mapping);
        true
    }

    pub fn source(&self, path: &Path) -> Option<&SourceRecord> {
        self.sources.get(path)
    }

    /// Notes the mount now at a source path; a new mount keeps the one it
    /// replaced (unless that was already replaced unconfirmed) and the
    /// owner. Returns whether anything changed.
    pub fn sight_source(&mut self, path: &Path, mount_id: u32, now: Option<SystemTime>) -> bool {
        match self.sources.get_mut(path) {
            Some(record) if record.mount_id == mount_id => false,
            Some(record) => {
                let previous = Sighting { mount_id: record.mount_id, first_seen: record.first_seen };
                record.replaced = Some(record.replaced.unwrap_or(previous));
                record.mount_id = mount_id;
                record.first_seen = now;
                true
            }
            None => {
                let record = SourceRecord { mount_id, first_seen: now, replaced: None, owner: None, daemon_died: None };
                self.sources.insert(path.to_path_buf(), record);
                true
            }
        }
    }

    /// When the given mount was first seen at a source path, if known.
    pub fn first_seen(&self, path: &Path, mount_id: u32) -> Option<SystemTime> {
        let record = self.sources.get(path)?;
        if record.mount_id == mount_id {
            return record.first_seen;
        }
        record.replaced.filter(|seen| seen.mount_id == mount_id).and_then(|seen| seen.first_seen)
    }

    /// Records the confirmed owner of a source; the replaced mount is
    /// settled. Returns whether anything changed.
    pub fn confirm_owner(&mut self, path: &Path, owner: Option<Owner>) -> bool {
        let Some(record) = self.sources.get_mut(path) else { return false };
        let changed = record.replaced.is_some() || (owner.is_some() && record.owner != owner);
        record.replaced = None;
        if owner.is_some() {
            record.owner = owner;
        }
        changed
    }

    /// Records that the daemon serving `path` died; returns whether
    /// anything changed.
    pub fn daemon_died(&mut self, path: &Path, death: DaemonDeath) -> bool {
        let Some(record) = self.sources.get_mut(path) else { return false };
        let changed = record.daemon_died != Some(death);
        record.daemon_died = Some(death);
        changed
    }

    /// Forgets a recorded death once the source path holds another
    /// connection (`current`: its device now, None if nothing is mounted
    /// there, which changes nothing). Returns whether anything changed.
    pub fn settle_death(&mut self, path: &Path, current: Option<Dev>) -> bool {
        let Some(record) = self.sources.get_mut(path) else { return false };
        match (record.daemon_died, current) {
            (Some(death), Some(dev)) if death.dev != dev => {
                record.daemon_died = None;
                true
            }
            _ => false,
        }
    }

    /// Forgets the recorded death of the connection `dev` at `path`: another
    /// process still served it. Returns whether anything changed.
    pub fn retract_death(&mut self, path: &Path, dev: Dev) -> bool {
        let Some(record) = self.sources.get_mut(path) else { return false };
        let matches = record.daemon_died.is_some_and(|death| death.dev == dev);
        if matches {
            record.daemon_died = None;
        }
        matches
    }

    /// Source paths with a recorded death.
    pub fn deaths(&self) -> impl Iterator<Item = (&Path, &DaemonDeath)> {
        self.sources.iter().filter_map(|(path, record)| Some((path.as_path(), record.daemon_died.as_ref()?)))
    }

    /// Forgets source paths that are neither mounted nor the source of a
    /// recorded target; returns whether any went. The mappings are searched
    /// only for paths not mounted, which are rare.
    pub fn forget_unused_sources(&mut self, mounted: impl Fn(&Path) -> bool) -> bool {
        let before = self.sources.len();
        let mappings = &self.mappings;
        self.sources.retain(|path, _| mounted(path) || mappings.values().any(|mapping| &mapping.source == path));
        before != self.sources.len()
    }

    /// Forgets targets for which `keep` says no; returns whether any went.
    pub fn retain(&mut self, mut keep: impl FnMut(&Path, &Mapping) -> bool) -> bool {
        let before = self.mappings.len();
        self.mappings.retain(|path, mapping| keep(path, mapping));
        before != self.mappings.len()
    }

    /// Writes the state file atomically: write, fsync, rename, fsync dir.
    pub fn save(&self) -> Result<(), StateError> {
        match self.contents()? {
            Some(contents) => write_atomically(&self.path, &contents),
            None => Ok(()),
        }
    }

    /// Hands the state file's contents to `writer`, which writes them on its
    /// own thread.
    pub fn save_with(&self, writer: &StateWriter) -> Result<(), StateError> {
        if let Some(contents) = self.contents()? {
            writer.submit(self.path.clone(), contents);
        }
        Ok(())
    }

    /// What the state file holds; None for an in-memory journal.
    fn contents(&self) -> Result<Option<Vec<u8>>, StateError> {
        if self.path.as_os_str().is_empty() {
            return Ok(None);
        }
        let file =
            StateFileRef { version: STATE_VERSION, targets: SortedTargets(&self.mappings), sources: &self.sources };
        let contents = serde_json::to_vec_pretty(&file)
            .map_err(|source| StateError::Write { path: self.path.clone(), source: io::Error::other(source) })?;
        Ok(Some(contents))
    }
}

/// Renames a state file that cannot be used to `state.json.corrupt-<UTC
/// time>` beside it (with `-2`, `-3`… when taken), where it stays for
/// whoever looks into it and no save overwrites it.
fn set_aside(path: &Path) -> io::Result<PathBuf> {
    let now = OffsetDateTime::now_utc();
    let (year, month, day, hour, minute, second) =
        (now.year(), u8::from(now.month()), now.day(), now.hour(), now.minute(), now.second());
    let stamp = format!("{year:04}{month:02}{day:02}T{hour:02}{minute:02}{second:02}Z");
    for attempt in 1..=100 {
        let suffix = if attempt == 1 { String::new() } else { format!("-{attempt}") };
        let aside = path.with_file_name(format!("{STATE_FILE}.corrupt-{stamp}{suffix}"));
        match fs::symlink_metadata(&aside) {
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                fs::rename(path, &aside)?;
                return Ok(aside);
            }
            Err(err) => return Err(err),
            Ok(_) => continue,
        }
    }
    Err(io::Error::new(io::ErrorKind::AlreadyExists, format!("100 files named {STATE_FILE}.corrupt-{stamp}*")))
}

/// A target's place in its life cycle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetState {
    Healthy,
    /// Its daemon died at `since`: the target answers ENOTCONN until a new
    /// mount appears at its source and it is healed.
    Degraded {
        since: SystemTime,
    },
    /// Stale since `since`, waiting for a live source or a heal.
    Broken {
        since: SystemTime,
    },
    Healing,
    Healed {
        outage: Option<Duration>,
    },
    /// The last heal failed; retried at `retry_at`.
    Failed {
        attempts: u32,
        retry_at: Instant,
        error: String,
    },
}

impl TargetState {
    pub fn name(&self) -> &'static str {
        match self {
            TargetState::Healthy => "healthy",
            TargetState::Degraded { .. } => "degraded",
            TargetState::Broken { .. } => "broken",
            TargetState::Healing => "healing",
            TargetState::Healed { .. } => "healed",
            TargetState::Failed { .. } => "failed",
        }
    }
}

/// Capped exponential back-off for failed heals.
pub fn retry_delay(attempts: u32) -> Duration {
    const FIRST: Duration = Duration::from_millis(100);
    const CAP: Duration = Duration::from_secs(30);
    FIRST.saturating_mul(1 << attempts.saturating_sub(1).min(16)).min(CAP)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping() -> Mapping {
        Mapping {
            source: "/runtime/g".into(),
            root_in_source: PathBuf::new(),
            source_mount_id: 7,
            peer_group: Some(3),
            dev: Dev { major: 0, minor: 55 },
            pod_uid: "uid".into(),
            kind: TargetKind::Volume,
        }
    }

    #[test]
    fn journal_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = Journal::load(dir.path()).unwrap();
        assert!(journal.record(Path::new("/k/pods/uid/volumes/v/mount"), mapping()));
        assert!(!journal.record(Path::new("/k/pods/uid/volumes/v/mount"), mapping()));
        journal.save().unwrap();
        let reloaded = Journal::load(dir.path()).unwrap();
        assert_eq!(reloaded.get(Path::new("/k/pods/uid/volumes/v/mount")), Some(&mapping()));
    }

    #[test]
    fn the_writer_thread_writes_the_latest_state() {
        let dir = tempfile::tempdir().unwrap();
        let writer = StateWriter::spawn(Box::new(|_| {})).unwrap();
        let mut journal = Journal::load(dir.path()).unwrap();
        for pod in ["a", "b", "c"] {
            journal.record(&PathBuf::from(format!("/k/pods/{pod}/volumes/v/mount")), mapping());
            journal.save_with(&writer).unwrap();
        }
        writer.flush();
        assert_eq!(Journal::load(dir.path()).unwrap().mappings(), journal.mappings());
        // Dropping the writer writes what is still pending.
        journal.record(Path::new("/k/pods/d/volumes/v/mount"), mapping());
        journal.save_with(&writer).unwrap();
        drop(writer);
        assert_eq!(Journal::load(dir.path()).unwrap().mappings().len(), 4);
    }

    #[test]
    fn the_state_file_lists_targets_in_path_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = Journal::load(dir.path()).unwrap();
        let paths = ["/k/pods/c/volumes/v/mount", "/k/pods/a/volumes/v/mount", "/k/pods/b/volumes/v/mount"];
        for path in paths {
            journal.record(Path::new(path), mapping());
        }
        journal.save().unwrap();
        let text = fs::read_to_string(dir.path().join(STATE_FILE)).unwrap();
        let at = |path: &str| text.find(path).unwrap();
        assert!(at(paths[1]) < at(paths[2]) && at(paths[2]) < at(paths[0]), "{text}");
        assert_eq!(Journal::load(dir.path()).unwrap().mappings(), journal.mappings());
    }

    #[test]
    fn a_corrupt_state_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(STATE_FILE), b"{not json").unwrap();
        let err = Journal::load(dir.path()).unwrap_err();
        assert!(err.to_string().contains("state.json"), "{err}");
    }

    /// Every way a state file can be unusable: kept aside, one warning,
    /// an empty journal that saves again.
    #[test]
    fn an_unusable_state_file_is_kept_aside_and_the_journal_starts_empty() {
        // None: a directory where the file should be.
        let cases: [(&str, Option<&[u8]>); 4] = [
            ("empty", Some(b"")),
            ("garbage", Some(b"{\"version\": 1,\n\"targets\": [")),
            ("another version", Some(br#"{"version": 9, "targets": {}}"#)),
            ("a directory", None),
        ];
        for (what, contents) in cases {
            let dir = tempfile::tempdir().unwrap();
            let file = dir.path().join(STATE_FILE);
            match contents {
                Some(contents) => fs::write(&file, contents).unwrap(),
                None => fs::create_dir(&file).unwrap(),
            }
            let logs = fuse_supervisor_testbed::CapturedLogs::default();
            let mut journal = logs.capture(tracing::Level::INFO, || Journal::load_or_set_aside(dir.path()));
            let logs = logs.text();
            assert!(journal.mappings().is_empty(), "{what}");
            assert_eq!(logs.lines().count(), 1, "{what}: {logs}");
            assert!(logs.contains("WARN") && logs.contains("kept aside"), "{what}: {logs}");
            let kept: Vec<String> = fs::read_dir(dir.path())
                .unwrap()
                .map(|entry| entry.unwrap().file_name().into_string().unwrap())
                .collect();
            assert!(kept.len() == 1 && kept[0].starts_with("state.json.corrupt-"), "{what}: {kept:?}");
            assert!(logs.contains(&kept[0]), "{what}: {logs}");
            journal.record(Path::new("/k/pods/uid/volumes/v/mount"), mapping());
            journal.save().unwrap();
            assert_eq!(Journal::load(dir.path()).unwrap().mappings(), journal.mappings(), "{what}");
        }
    }

    #[test]
    fn a_state_file_that_is_not_json_says_where() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(STATE_FILE), b"{\"version\": 1,\n\"targets\": [").unwrap();
        let logs = fuse_supervisor_testbed::CapturedLogs::default();
        logs.capture(tracing::Level::INFO, || Journal::load_or_set_aside(dir.path()));
        let logs = logs.text();
        assert!(logs.contains("line=2 column=11"), "{logs}");
        // A second file set aside in the same second gets a name of its own.
        fs::write(dir.path().join(STATE_FILE), b"").unwrap();
        Journal::load_or_set_aside(dir.path());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn a_daemon_death_is_kept_until_another_connection_is_at_the_source() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = Journal::load(dir.path()).unwrap();
        let source = Path::new("/runtime/g");
        let dead = Dev { major: 0, minor: 55 };
        assert!(!journal.daemon_died(source, DaemonDeath { pid: 7, at: SystemTime::UNIX_EPOCH, dev: dead }));
        journal.sight_source(source, 10, None);
        let death = DaemonDeath { pid: 7, at: SystemTime::UNIX_EPOCH, dev: dead };
        assert!(journal.daemon_died(source, death));
        journal.save().unwrap();
        let mut journal = Journal::load(dir.path()).unwrap();
        assert_eq!(journal.deaths().collect::<Vec<_>>(), vec![(source, &death)]);
        assert!(!journal.settle_death(source, Some(dead)), "the dead mount is still there");
        assert!(!journal.settle_death(source, None), "nothing mounted: nothing replaced it");
        assert!(journal.settle_death(source, Some(Dev { major: 0, minor: 56 })));
        assert_eq!(journal.deaths().count(), 0);

        assert!(journal.daemon_died(source, death));
        assert!(!journal.retract_death(source, Dev { major: 0, minor: 56 }), "another connection's death");
        assert!(journal.retract_death(source, dead));
        assert_eq!(journal.deaths().count(), 0);
    }

    #[test]
    fn back_off_doubles_and_is_capped() {
        assert_eq!(retry_delay(1), Duration::from_millis(100));
        assert_eq!(retry_delay(2), Duration::from_millis(200));
        assert_eq!(retry_delay(5), Duration::from_millis(1600));
        assert_eq!(retry_delay(40), Duration::from_secs(30));
    }
}
