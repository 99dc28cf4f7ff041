//! Walking the kubelet's pod directories, for a plain scan and for the
//! watcher, which adds a watch on each directory before listing it.
//!
//! Only the directories below are entered; nothing that may be a mount point
//! (a volume's `mount`, a non-CSI volume, a subPath entry) is ever stat'ed,
//! listed or watched, so a hung FUSE daemon cannot stall the walk:
//!
//! ```text
//! pods/                                            Pods
//!   <uid>/                                         Pod
//!     volumes/                                     Volumes
//!       <plugin>/                                  Plugin (entries: volumes)
//!         <volume>/          (kubernetes.io~csi)   CsiVolume (vol_data.json)
//!           vol_data.json    (while being written) VolDataFile
//!     volume-subpaths/                             SubPaths
//!       <volume>/                                  SubPathVolume
//!         <container>/                             SubPathContainer (entries: indexes)
//! ```
use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::vol_data::{self, VOL_DATA_FILE, VolData, VolDataError};
use super::{PodChange, PodWatchError};

/// The kubelet's directory name for the CSI volume plugin.
pub const CSI_PLUGIN_DIR: &str = "kubernetes.io~csi";

/// A directory of the tree and what it is to the pod model; or a CSI
/// volume's `vol_data.json`, watched itself while it is being written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Dir {
    Pods,
    Pod { uid: Arc<str> },
    Volumes { uid: Arc<str> },
    Plugin { uid: Arc<str>, plugin: Box<str> },
    CsiVolume { uid: Arc<str>, name: Box<str> },
    SubPaths { uid: Arc<str> },
    SubPathVolume { uid: Arc<str>, volume: Box<str> },
    SubPathContainer { uid: Arc<str>, volume: Box<str>, container: Box<str> },
    VolDataFile { uid: Arc<str>, name: Box<str> },
}

impl Dir {
    pub(crate) fn uid(&self) -> Option<&Arc<str>> {
        match self {
            Dir::Pods => None,
            Dir::Pod { uid }
            | Dir::Volumes { uid }
            | Dir::Plugin { uid, .. }
            | Dir::CsiVolume { uid, .. }
            | Dir::SubPaths { uid }
            | Dir::SubPathVolume { uid, .. }
            | Dir::SubPathContainer { uid, .. }
            | Dir::VolDataFile { uid, .. } => Some(uid),
        }
    }

    pub(crate) fn path(&self, pods_dir: &Path) -> PathBuf {
        let mut path = pods_dir.to_path_buf();
        match self {
            Dir::Pods => {}
            Dir::Pod { uid } => path.push(&**uid),
            Dir::Volumes { uid } => path.extend([&**uid, "volumes"]),
            Dir::Plugin { uid, plugin } => path.extend([&**uid, "volumes", plugin]),
            Dir::CsiVolume { uid, name } => path.extend([&**uid, "volumes", CSI_PLUGIN_DIR, name]),
            Dir::SubPaths { uid } => path.extend([&**uid, "volume-subpaths"]),
            Dir::SubPathVolume { uid, volume } => path.extend([&**uid, "volume-subpaths", volume]),
            Dir::SubPathContainer { uid, volume, container } => {
                path.extend([&**uid, "volume-subpaths", volume, container]);
            }
            Dir::VolDataFile { uid, name } => {
                path.extend([&**uid, "volumes", CSI_PLUGIN_DIR, name, VOL_DATA_FILE]);
            }
        }
        path
    }

    /// The directory an entry `name` of this one is, if the model has one
    /// there. Leaf entries (non-CSI volumes, subPath indexes) are not
    /// directories of the model.
    fn child(&self, name: &str) -> Option<Dir> {
        Some(match self {
            Dir::Pods => Dir::Pod { uid: name.into() },
            Dir::Pod { uid } => match name {
                "volumes" => Dir::Volumes { uid: uid.clone() },
                "volume-subpaths" => Dir::SubPaths { uid: uid.clone() },
                _ => return None,
            },
            Dir::Volumes { uid } => Dir::Plugin { uid: uid.clone(), plugin: name.into() },
            Dir::Plugin { uid, plugin } if &**plugin == CSI_PLUGIN_DIR => {
                Dir::CsiVolume { uid: uid.clone(), name: name.into() }
            }
            Dir::SubPaths { uid } => Dir::SubPathVolume { uid: uid.clone(), volume: name.into() },
            Dir::SubPathVolume { uid, volume } => {
                Dir::SubPathContainer { uid: uid.clone(), volume: volume.clone(), container: name.into() }
            }
            Dir::Plugin { .. } | Dir::CsiVolume { .. } | Dir::SubPathContainer { .. } | Dir::VolDataFile { .. } => {
                return None;
            }
        })
    }
}

/// What a walk does at each directory and with what it finds.
pub(crate) trait Visit {
    /// Called before `dir` (at `path`) is listed. `Ok(false)`: already
    /// known, skip it. `NotFound` / `NotADirectory` errors skip it too (it
    /// went away, or is not a directory); any other error ends the walk.
    fn enter(&mut self, path: &Path, dir: &Dir) -> io::Result<bool>;
    fn change(&mut self, change: PodChange);
    /// Called when the `vol_data.json` of CSI volume `volume` is there but
    /// empty or cut short: the kubelet may be writing it. `Ok(true)`: it is
    /// watched now (it was not), read it again. Errors as for `enter`.
    fn writing(&mut self, _file: &Path, _volume: &Dir) -> io::Result<bool> {
        Ok(false)
    }
}

fn skippable(err: &io::Error) -> bool {
    matches!(err.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory)
}

/// Walks the whole tree below `pods_dir`, which must exist.
pub(crate) fn walk_all(pods_dir: &Path, visit: &mut impl Visit) -> Result<(), PodWatchError> {
    match visit.enter(pods_dir, &Dir::Pods) {
        Ok(true) => walk_contents(pods_dir, &Dir::Pods, visit),
        Ok(false) => Ok(()),
        Err(source) => Err(PodWatchError::watch(pods_dir, source)),
    }
}

/// Walks what the entry `name` of `parent` (at `parent_path`) holds,
/// reporting it: the walk for an entry that appeared in a watched directory.
pub(crate) fn walk_entry(
    parent_path: &Path,
    parent: &Dir,
    name: &OsStr,
    visit: &mut impl Visit,
) -> Result<(), PodWatchError> {
    // The kubelet names everything in UTF-8 (UIDs, DNS labels, indexes).
    let Some(name) = name.to_str() else { return Ok(()) };
    match (parent, parent.child(name)) {
        (Dir::Plugin { uid, plugin }, None) => {
            visit.change(PodChange::VolumeSeen {
                uid: uid.to_string(),
                plugin: plugin.to_string(),
                name: name.to_owned(),
                vol_data: None,
            });
            Ok(())
        }
        (Dir::SubPathContainer { uid, volume, container }, None) => {
            visit.change(PodChange::SubPathSeen {
                uid: uid.to_string(),
                volume: volume.to_string(),
                container: container.to_string(),
                index: name.to_owned(),
            });
            Ok(())
        }
        (_, Some(child)) => walk_dir(&parent_path.join(name), child, visit),
        (_, None) => Ok(()),
    }
}

fn walk_dir(path: &Path, dir: Dir, visit: &mut impl Visit) -> Result<(), PodWatchError> {
    match visit.enter(path, &dir) {
        Ok(true) => walk_contents(path, &dir, visit),
        Ok(false) => Ok(()),
        Err(err) if skippable(&err) => Ok(()),
        Err(source) => Err(PodWatchError::watch(path, source)),
    }
}

fn walk_contents(path: &Path, dir: &Dir, visit: &mut impl Visit) -> Result<(), PodWatchError> {
    match dir {
        Dir::Pod { uid } => {
            visit.change(PodChange::PodAdded { uid: uid.to_string() });
            // Only two entries matter: try them rather than list the pod.
            for name in ["volumes", "volume-subpaths"] {
                if let Some(child) = dir.child(name) {
                    walk_dir(&path.join(name), child, visit)?;
                }
            }
            Ok(())
        }
        Dir::CsiVolume { .. } => read_volume(path, dir, visit),
        _ => {
            let list_error = |source| PodWatchError::List { path: path.to_path_buf(), source };
            let entries = match std::fs::read_dir(path) {
                Ok(entries) => entries,
                Err(err) if skippable(&err) => return Ok(()),
                Err(source) => return Err(list_error(source)),
            };
            // Names only: `DirEntry::file_name` stats nothing.
            let mut names = Vec::new();
            for entry in entries {
                match entry {
                    Ok(entry) => names.push(entry.file_name()),
                    Err(err) if skippable(&err) => return Ok(()),
                    Err(source) => return Err(list_error(source)),
                }
            }
            for name in names {
                walk_entry(path, dir, &name, visit)?;
            }
            Ok(())
        }
    }
}

/// Reads the `vol_data.json` of CSI volume `dir` (at `path`) as a walk or
/// its creation finds it, and reports the volume. If the file is there but
/// not complete, the kubelet is likely writing it: its `IN_CLOSE_WRITE` is
/// then awaited on a watch of the file itself (see `watcher`), and the file
/// is read again in case it was closed before that watch existed.
pub(crate) fn read_volume(path: &Path, dir: &Dir, visit: &mut impl Visit) -> Result<(), PodWatchError> {
    let Dir::CsiVolume { uid, name } = dir else { return Ok(()) };
    let file = path.join(VOL_DATA_FILE);
    let mut read = read_vol_data(&file, Strictness::Walk);
    if read.writing {
        let file_dir = Dir::VolDataFile { uid: uid.clone(), name: name.clone() };
        match visit.writing(&file, &file_dir) {
            Ok(true) => read = read_vol_data(&file, Strictness::Walk),
            Ok(false) => {}
            // Gone since: its removal is an event of the volume directory.
            Err(err) if skippable(&err) => {}
            Err(source) => return Err(PodWatchError::watch(&file, source)),
        }
    }
    report_volume(visit, uid, name, read.vol_data, read.error);
    Ok(())
}

/// Sends what is known of a CSI volume: seen (with its data if readable),
/// then the error if its `vol_data.json` is malformed. The volume is
/// reported either way, so nothing is lost.
pub(crate) fn report_volume(
    visit: &mut impl Visit,
    uid: &str,
    name: &str,
    vol_data: Option<VolData>,
    error: Option<VolDataError>,
) {
    visit.change(PodChange::VolumeSeen {
        uid: uid.to_owned(),
        plugin: CSI_PLUGIN_DIR.to_owned(),
        name: name.to_owned(),
        vol_data,
    });
    if let Some(error) = error {
        visit.change(PodChange::VolDataInvalid {
            uid: uid.to_owned(),
            plugin: CSI_PLUGIN_DIR.to_owned(),
            name: name.to_owned(),
            error,
        });
    }
}

/// How to take an empty or unparsable `vol_data.json`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Strictness {
    /// Read while walking or on `IN_CREATE`: such a file may be one the
    /// kubelet is writing (`os.Create`, then one `write`); its
    /// `IN_CLOSE_WRITE` follows.
    Walk,
    /// Read on `IN_CLOSE_WRITE` / `IN_MOVED_TO`: the file is complete.
    Complete,
}

/// What a read of a `vol_data.json` gave.
pub(crate) struct VolDataRead {
    pub(crate) vol_data: Option<VolData>,
    pub(crate) error: Option<VolDataError>,
    /// Read as a walk finds it, the file is there but empty or does not
    /// parse: it may be being written.
    pub(crate) writing: bool,
}

pub(crate) fn read_vol_data(path: &Path, strictness: Strictness) -> VolDataRead {
    let read = |vol_data, error, writing| VolDataRead { vol_data, error, writing };
    let bytes = match vol_data::read_bytes(path) {
        Ok(bytes) => bytes,
        Err(VolDataError::Read { source, .. }) if skippable(&source) => return read(None, None, false),
        Err(error) => return read(None, Some(error), false),
    };
    let walk = strictness == Strictness::Walk;
    if bytes.is_empty() && walk {
        return read(None, None, true);
    }
    match VolData::parse(&bytes, path) {
        Ok(vol_data) => read(Some(vol_data), None, false),
        Err(error) => {
            let cut_short = walk && matches!(error, VolDataError::Syntax { .. });
            read(None, Some(error), cut_short)
        }
    }
}
