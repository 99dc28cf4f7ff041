//! The kubelet's pod directories: which pods and volumes exist, and what the
//! kubelet recorded about each CSI volume, kept current with inotify.
//!
//! [`PodWatcher`] is a thin adapter: it decodes inotify events on
//! `<kubelet-root>/pods` into [`PodChange`]s and hands them to the caller,
//! who keeps a [`PodDirectory`] by [`PodDirectory::apply`]ing them.
use std::io;
use std::path::{Path, PathBuf};

use crate::watch::thread::ThreadError;

mod directory;
mod vol_data;
mod walk;
mod watcher;
mod watches;

pub use directory::{Pod, PodDirectory, SubPath, Volume};
pub use vol_data::{FieldProblem, LifecycleMode, VOL_DATA_FILE, VolData, VolDataError};
pub use walk::CSI_PLUGIN_DIR;
pub use watcher::PodWatcher;

/// One fact about the pod directories, read from disk when it was sent.
/// Applying the same fact twice changes nothing.
#[derive(Debug)]
pub enum PodChange {
    PodAdded {
        uid: String,
    },
    /// `volumes/<plugin>/<name>` exists; for a CSI volume, with its
    /// `vol_data.json` if that is written and valid (sent again when it is
    /// written later, and with `None` when it is removed).
    VolumeSeen {
        uid: String,
        plugin: String,
        name: String,
        vol_data: Option<VolData>,
    },
    VolumeRemoved {
        uid: String,
        plugin: String,
        name: String,
    },
    /// A CSI volume's `vol_data.json` is malformed. The volume itself was
    /// reported (without data) by the `VolumeSeen` just before.
    VolDataInvalid {
        uid: String,
        plugin: String,
        name: String,
        error: VolDataError,
    },
    SubPathSeen {
        uid: String,
        volume: String,
        container: String,
        index: String,
    },
    SubPathRemoved {
        uid: String,
        volume: String,
        container: String,
        index: String,
    },
    /// The pod's directory is gone: forget everything about the pod.
    PodRemoved {
        uid: String,
    },
    /// The whole tree as read by a full scan: the first message, and again
    /// after events were lost (inotify queue overflow). Replaces the model.
    Resync(PodDirectory),
    /// Events were lost, and a `Resync` follows (unless the rescan fails).
    EventsLost(LostEvents),
    /// The watcher stopped on this error; no change follows.
    Failed(PodWatchError),
}

/// Why the pod watcher lost events and rescans.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LostEvents {
    /// The kernel's inotify queue overflowed (`IN_Q_OVERFLOW`).
    Overflow,
    /// Events arrived faster than they were read: the watcher stopped
    /// reading them at its own limit.
    Backlog,
}

impl LostEvents {
    /// The `reason` label of `resyncs_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            LostEvents::Overflow => "overflow",
            LostEvents::Backlog => "backlog",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PodWatchError {
    #[error("cannot join mount namespace {path}")]
    Namespace {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot set up the pod watcher: {what}")]
    Setup {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("cannot watch {path}")]
    Watch {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot watch {path}: the inotify watch limit is reached (raise sysctl fs.inotify.max_user_watches)")]
    WatchLimit { path: PathBuf },
    #[error("cannot list {path}")]
    List {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("reading pod-directory events failed")]
    Read(#[source] io::Error),
    #[error("the pods directory {path} was removed or moved")]
    PodsDirGone { path: PathBuf },
    #[error(transparent)]
    Thread(#[from] ThreadError),
}

impl PodWatchError {
    fn watch(path: &Path, source: io::Error) -> Self {
        // ENOSPC from inotify_add_watch means the per-user watch limit.
        if source.kind() == io::ErrorKind::StorageFull {
            PodWatchError::WatchLimit { path: path.to_path_buf() }
        } else {
            PodWatchError::Watch { path: path.to_path_buf(), source }
        }
    }
}
