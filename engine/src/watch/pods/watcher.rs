//! The pod-directory watcher thread: inotify on every directory of the
//! model (see `walk`), decoded into [`PodChange`]s.
//!
//! Races with directories created before their watch: a directory is
//! listed only after its watch is in place, so whatever appears in it later
//! produces an event, and whatever was there before is in the listing
//! (entries found both ways are sent once or twice, which is harmless).
//! A directory whose watch turns out to exist already was walked before and
//! is skipped. Events lost to a queue overflow are recovered by a full
//! rescan on a fresh inotify instance, sent as [`PodChange::Resync`].
//!
//! A `vol_data.json` being written is watched itself until its
//! `IN_CLOSE_WRITE`. Entry events (create, delete, move) are queued on the
//! directory's own watch; a file's close reaches its directory's watch only
//! if the kernel flagged the file's dentry as having a watched parent, and
//! that can go wrong for a file created in a freshly watched directory while
//! the walk looks the same name up: on Linux 6.18, a few `IN_CLOSE_WRITE`s
//! in 10,000 never reached the directory's watch (one file was created
//! 85 us after `inotify_add_watch` returned; no queue overflow), which left
//! the volume without its data for good. So a CSI volume directory is also
//! watched for `IN_CREATE`, and a `vol_data.json` found there empty or cut
//! short gets a watch of its own, whose events come from the file's inode.
use std::ffi::{OsStr, OsString};
use std::io;
use std::ops::ControlFlow;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fuse_supervisor_sys::inotify::{Event, EventFlags, EventReader, Inotify, WatchFlags};
use fuse_supervisor_sys::ns;
use fuse_supervisor_sys::poll::{Poller, Waker};

use super::directory::PodDirectory;
use super::vol_data::VOL_DATA_FILE;
use super::walk::{self, CSI_PLUGIN_DIR, Dir, Strictness, Visit};
use super::watches::WatchTable;
use super::{LostEvents, PodChange, PodWatchError};
use crate::watch::thread::Watching;

const INOTIFY: u64 = 1;
const STOP: u64 = 2;

/// A running pod-directory watcher. Stops (and joins its thread) on
/// [`PodWatcher::stop`] or drop.
pub struct PodWatcher {
    watching: Watching,
}

impl PodWatcher {
    /// Starts watching `<kubelet_root>/pods` on a thread of its own, which
    /// first joins `mount_namespace` (the supervisor's; `None`: stay in the
    /// caller's). Returns once the initial scan is done and sent to `sink` as
    /// a [`PodChange::Resync`]; then every change is sent as it happens.
    /// No timer: the thread sleeps in `epoll_wait` while nothing changes.
    pub fn spawn(
        kubelet_root: &Path,
        mount_namespace: Option<&Path>,
        sink: impl FnMut(PodChange) + Send + 'static,
    ) -> Result<PodWatcher, PodWatchError> {
        const NAME: &str = "pod-watcher";
        let pods_dir = kubelet_root.join("pods");
        let namespace = mount_namespace.map(Path::to_path_buf);
        let stop = Watching::stop_waker(NAME)?;
        let thread_stop = stop.clone();
        let (watching, ()) = Watching::start_there(NAME, stop, move || {
            let mut watcher = Watcher::start(pods_dir, namespace.as_deref(), thread_stop, sink)?;
            let run = move || {
                if let Err(err) = watcher.run() {
                    (watcher.sink)(PodChange::Failed(err));
                }
            };
            Ok::<_, PodWatchError>(((), run))
        })?;
        Ok(PodWatcher { watching })
    }

    /// Stops the thread and waits for it.
    pub fn stop(self) -> Result<(), PodWatchError> {
        Ok(self.watching.stop()?)
    }
}

/// What the watcher knows of its watches.
struct Watches {
    pods_dir: PathBuf,
    table: WatchTable,
}

struct Watcher<S> {
    poller: Poller,
    _waker: Arc<Waker>,
    inotify: Inotify,
    reader: EventReader,
    watches: Watches,
    sink: S,
}

/// Events read in one go past this are a storm outrunning the reads: four
/// times the kernel's default queue (`fs.inotify.max_queued_events`).
const MOST_QUEUED: usize = 4 * 16384;

/// An event read off the queue, owned until it is handled.
struct QueuedEvent {
    wd: i32,
    flags: EventFlags,
    name: Option<OsString>,
}

impl From<Event<'_>> for QueuedEvent {
    fn from(event: Event<'_>) -> Self {
        QueuedEvent { wd: event.wd, flags: event.flags, name: event.name.map(OsStr::to_os_string) }
    }
}

impl QueuedEvent {
    fn borrowed(&self) -> Event<'_> {
        Event { wd: self.wd, flags: self.flags, name: self.name.as_deref() }
    }
}

impl<S: FnMut(PodChange)> Watcher<S> {
    fn start(pods_dir: PathBuf, namespace: Option<&Path>, waker: Arc<Waker>, sink: S) -> Result<Self, PodWatchError> {
        if let Some(path) = namespace {
            ns::join_mount_namespace(path)
                .map_err(|source| PodWatchError::Namespace { path: path.to_path_buf(), source })?;
        }
        let setup = |what| move |source| PodWatchError::Setup { what, source };
        let poller = Poller::new().map_err(setup("epoll"))?;
        poller.add_readable(waker.as_fd(), STOP).map_err(setup("eventfd"))?;
        let inotify = Inotify::new().map_err(setup("inotify"))?;
        poller.add_readable(inotify.as_fd(), INOTIFY).map_err(setup("inotify"))?;
        let watches = Watches { pods_dir, table: WatchTable::default() };
        let mut watcher = Watcher { poller, _waker: waker, inotify, reader: EventReader::default(), watches, sink };
        watcher.scan()?;
        Ok(watcher)
    }

    fn run(&mut self) -> Result<(), PodWatchError> {
        let mut ready = Vec::with_capacity(2);
        loop {
            self.poller.wait(&mut ready, None).map_err(PodWatchError::Read)?;
            if ready.contains(&STOP) {
                return Ok(());
            }
            let Some(events) = self.read_queue()? else {
                self.rescan()?;
                continue;
            };
            let Watcher { inotify, watches, sink, .. } = self;
            let mut rescan = false;
            for event in &events {
                if watches.handle(inotify, event.borrowed(), &mut *sink)?.is_break() {
                    rescan = true;
                    break;
                }
            }
            if rescan {
                self.rescan()?;
            }
        }
    }

    /// Reads every queued event before any is handled: after an overflow
    /// the events before it are moot (the rescan reads the tree anew), and
    /// handling them first, a walk of each new pod, took longer than the
    /// rescan (10,000 pods: 0.3 s more before it). None when events were
    /// lost, or arrive faster than they are read: a rescan is due.
    fn read_queue(&mut self) -> Result<Option<Vec<QueuedEvent>>, PodWatchError> {
        let mut events = Vec::new();
        let mut lost = None;
        // Broken off only when `lost` says why.
        let _ = self
            .reader
            .drain(&self.inotify, |event| {
                if event.flags.contains(EventFlags::QUEUE_OVERFLOW) {
                    lost = Some((LostEvents::Overflow, "inotify queue overflowed; rescanning pod directories"));
                } else if events.len() >= MOST_QUEUED {
                    lost = Some((
                        LostEvents::Backlog,
                        "inotify events come faster than they are read; rescanning pod directories",
                    ));
                } else {
                    events.push(QueuedEvent::from(event));
                    return ControlFlow::Continue(());
                }
                ControlFlow::Break(())
            })
            .map_err(PodWatchError::Read)?;
        match lost {
            Some((reason, why)) => {
                tracing::warn!(pods = %self.watches.pods_dir.display(), "{why}");
                (self.sink)(PodChange::EventsLost(reason));
                Ok(None)
            }
            None => Ok(Some(events)),
        }
    }

    /// Drops every watch (by closing the instance) and scans afresh.
    fn rescan(&mut self) -> Result<(), PodWatchError> {
        let fresh = Inotify::new().map_err(|source| PodWatchError::Setup { what: "inotify", source })?;
        // Best effort: closing the old instance (below) deregisters it anyway.
        let _ = self.poller.remove(self.inotify.as_fd());
        self.poller
            .add_readable(fresh.as_fd(), INOTIFY)
            .map_err(|source| PodWatchError::Setup { what: "inotify", source })?;
        self.inotify = fresh;
        let started = std::time::Instant::now();
        let pods = self.scan()?;
        let took_us = started.elapsed().as_micros() as u64;
        tracing::info!(pods, took_us, "pod directories rescanned");
        Ok(())
    }

    /// Watches and reads the whole tree into a fresh model, sent as one
    /// `Resync` followed by the errors met on the way; how many pods it has.
    fn scan(&mut self) -> Result<usize, PodWatchError> {
        self.watches.table.clear();
        let mut directory = PodDirectory::default();
        let mut errors = Vec::new();
        let mut collect = |change| match change {
            PodChange::VolDataInvalid { .. } => errors.push(change),
            change => {
                directory.apply(change);
            }
        };
        let pods_dir = self.watches.pods_dir.clone();
        walk::walk_all(
            &pods_dir,
            &mut WatchVisit { inotify: &self.inotify, watches: &mut self.watches, out: &mut collect },
        )?;
        self.watches.table.shrink_to_fit();
        let pods = directory.len();
        (self.sink)(PodChange::Resync(directory));
        errors.into_iter().for_each(&mut self.sink);
        Ok(pods)
    }
}

/// The mask each directory is watched with.
fn mask(dir: &Dir) -> WatchFlags {
    let entries = WatchFlags::CREATE | WatchFlags::MOVED_TO | WatchFlags::MOVED_FROM;
    match dir {
        Dir::Pods => entries | WatchFlags::DELETE | WatchFlags::DELETE_SELF | WatchFlags::MOVE_SELF,
        Dir::Pod { .. } => entries | WatchFlags::DELETE_SELF,
        Dir::Volumes { .. } | Dir::SubPaths { .. } | Dir::SubPathVolume { .. } => entries,
        Dir::Plugin { .. } | Dir::SubPathContainer { .. } => entries | WatchFlags::DELETE,
        Dir::CsiVolume { .. } => WatchFlags::CLOSE_WRITE | entries | WatchFlags::DELETE,
        Dir::VolDataFile { .. } => WatchFlags::CLOSE_WRITE,
    }
}

struct WatchVisit<'a> {
    inotify: &'a Inotify,
    watches: &'a mut Watches,
    out: &'a mut dyn FnMut(PodChange),
}

impl Visit for WatchVisit<'_> {
    fn enter(&mut self, path: &Path, dir: &Dir) -> io::Result<bool> {
        let wd = self.inotify.watch_dir(path, mask(dir))?;
        Ok(self.watches.table.insert(wd, dir))
    }

    fn change(&mut self, change: PodChange) {
        (self.out)(change);
    }

    fn writing(&mut self, file: &Path, volume: &Dir) -> io::Result<bool> {
        let wd = self.inotify.watch_file(file, mask(volume))?;
        Ok(self.watches.table.insert(wd, volume))
    }
}

impl Watches {
    /// Decodes one event. `Break`: it cannot be followed incrementally,
    /// rescan.
    fn handle(
        &mut self,
        inotify: &Inotify,
        event: Event<'_>,
        sink: &mut dyn FnMut(PodChange),
    ) -> Result<ControlFlow<()>, PodWatchError> {
        let Some(dir) = self.table.get(event.wd) else {
            // A watch already forgotten (its pod went first).
            return Ok(ControlFlow::Continue(()));
        };
        let gone = EventFlags::IGNORED | EventFlags::DELETE_SELF | EventFlags::MOVE_SELF;
        if event.flags.intersects(gone) {
            self.forget(event.wd, &dir, sink)?;
            return Ok(ControlFlow::Continue(()));
        }
        if let Dir::VolDataFile { .. } = &dir {
            if event.flags.contains(EventFlags::CLOSE_WRITE) {
                // Written: its directory's watch sees what follows (a
                // rewrite's close, a removal). EINVAL: already gone.
                let _ = inotify.unwatch(event.wd);
                self.table.remove(event.wd);
                self.volume_written(inotify, &dir, sink);
            }
            return Ok(ControlFlow::Continue(()));
        }
        let Some(name) = event.name else { return Ok(ControlFlow::Continue(())) };
        let removed = event.flags.intersects(EventFlags::DELETE | EventFlags::MOVED_FROM);
        let moved_away = event.flags.contains(EventFlags::MOVED_FROM);
        match &dir {
            Dir::CsiVolume { uid, name: volume } => {
                if name != VOL_DATA_FILE {
                    return Ok(ControlFlow::Continue(()));
                }
                let mut visit = WatchVisit { inotify, watches: self, out: sink };
                if removed {
                    walk::report_volume(&mut visit, uid, volume, None, None);
                } else if event.flags.contains(EventFlags::CREATE) {
                    // Most likely empty yet: watched itself until written.
                    let path = dir.path(&visit.watches.pods_dir);
                    walk::read_volume(&path, &dir, &mut visit)?;
                } else {
                    let file = Dir::VolDataFile { uid: uid.clone(), name: volume.clone() };
                    self.volume_written(inotify, &file, sink);
                }
            }
            Dir::Pods if removed => {
                if let Some(uid) = name.to_str() {
                    self.pod_removed(inotify, uid, moved_away, sink);
                }
            }
            Dir::Plugin { uid, plugin } if removed => {
                // A CSI volume directory moved away keeps its watch; only a
                // rescan can drop it. The kubelet never does this.
                if moved_away && &**plugin == CSI_PLUGIN_DIR {
                    return Ok(ControlFlow::Break(()));
                }
                if let Some(name) = name.to_str() {
                    sink(PodChange::VolumeRemoved {
                        uid: uid.to_string(),
                        plugin: plugin.to_string(),
                        name: name.into(),
                    });
                }
            }
            Dir::SubPathContainer { uid, volume, container } if removed => {
                if let Some(index) = name.to_str() {
                    sink(PodChange::SubPathRemoved {
                        uid: uid.to_string(),
                        volume: volume.to_string(),
                        container: container.to_string(),
                        index: index.into(),
                    });
                }
            }
            // A watched directory moved away within a pod: its watches go
            // with it. The kubelet never does this; a rescan sorts it out.
            _ if moved_away => return Ok(ControlFlow::Break(())),
            // Deleted directories were emptied first: their entries were
            // reported one by one, and their own watch ends with IN_IGNORED.
            _ if removed => {}
            _ => {
                let parent = dir.path(&self.pods_dir);
                walk::walk_entry(&parent, &dir, name, &mut WatchVisit { inotify, watches: self, out: sink })?;
            }
        }
        Ok(ControlFlow::Continue(()))
    }

    /// Reads a CSI volume's `vol_data.json` (`file`) that was closed after
    /// writing, or moved in, and reports the volume.
    fn volume_written(&mut self, inotify: &Inotify, file: &Dir, sink: &mut dyn FnMut(PodChange)) {
        let Dir::VolDataFile { uid, name } = file else { return };
        let read = walk::read_vol_data(&file.path(&self.pods_dir), Strictness::Complete);
        let mut visit = WatchVisit { inotify, watches: self, out: sink };
        walk::report_volume(&mut visit, uid, name, read.vol_data, read.error);
    }

    /// A watched directory is gone (deleted, moved, or its filesystem
    /// unmounted).
    fn forget(&mut self, wd: i32, dir: &Dir, sink: &mut dyn FnMut(PodChange)) -> Result<(), PodWatchError> {
        match dir {
            Dir::Pods => {
                self.table.remove(wd);
                Err(PodWatchError::PodsDirGone { path: self.pods_dir.clone() })
            }
            Dir::Pod { uid } => {
                if self.table.remove_pod(uid).is_some() {
                    sink(PodChange::PodRemoved { uid: uid.to_string() });
                }
                Ok(())
            }
            _ => {
                self.table.remove(wd);
                Ok(())
            }
        }
    }

    fn pod_removed(&mut self, inotify: &Inotify, uid: &str, moved_away: bool, sink: &mut dyn FnMut(PodChange)) {
        let Some(wds) = self.table.remove_pod(uid) else { return };
        for wd in wds {
            if moved_away {
                // Deleted directories lose their watches by themselves; a
                // moved one keeps them. EINVAL: already gone.
                let _ = inotify.unwatch(wd);
            }
        }
        sink(PodChange::PodRemoved { uid: uid.to_owned() });
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::io::Write;

    use super::*;

    const UID: &str = "7c1d2e3f-0000-4000-8000-000000000001";
    const PV: &str = "pvc-1";
    const VOL_DATA: &str = r#"{"driverName":"csi.juicefs.com","specVolID":"pvc-1","volumeHandle":"pvc-1"}"#;

    /// `Watches` driven by hand on a real inotify instance, dropping every
    /// `IN_CLOSE_WRITE` queued on a directory's watch: what the kernel did
    /// to a few `vol_data.json` files in 10,000 (see the module comment).
    struct Lossy {
        inotify: Inotify,
        reader: EventReader,
        watches: Watches,
        directory: PodDirectory,
    }

    impl Lossy {
        fn start(pods_dir: &Path) -> Self {
            let inotify = Inotify::new().unwrap();
            let mut watches = Watches { pods_dir: pods_dir.to_path_buf(), table: WatchTable::default() };
            let mut directory = PodDirectory::default();
            let mut out = |change| {
                directory.apply(change);
            };
            walk::walk_all(pods_dir, &mut WatchVisit { inotify: &inotify, watches: &mut watches, out: &mut out })
                .unwrap();
            Lossy { inotify, reader: EventReader::default(), watches, directory }
        }

        fn take_events(&mut self) {
            let Lossy { inotify, reader, watches, directory } = self;
            let mut out = |change| {
                directory.apply(change);
            };
            let flow = reader
                .drain(inotify, |event| {
                    let on_directory =
                        watches.table.get(event.wd).is_some_and(|dir| !matches!(dir, Dir::VolDataFile { .. }));
                    if on_directory && event.flags.contains(EventFlags::CLOSE_WRITE) {
                        return ControlFlow::Continue(());
                    }
                    watches.handle(inotify, event, &mut out).unwrap()
                })
                .unwrap();
            assert!(flow.is_continue(), "no rescan expected");
        }

        fn has_vol_data(&self) -> bool {
            self.directory.vol_data(UID, PV).is_some_and(|data| &*data.driver_name == "csi.juicefs.com")
        }
    }

    /// A pod with one CSI volume directory, as the kubelet lays it out
    /// before writing `vol_data.json`.
    fn volume_dir(root: &Path) -> PathBuf {
        let volume = root.join(UID).join("volumes").join(CSI_PLUGIN_DIR).join(PV);
        fs::create_dir_all(volume.join("mount")).unwrap();
        volume
    }

    #[test]
    fn vol_data_created_after_the_walk_is_read_on_its_own_close() {
        let root = tempfile::tempdir().unwrap();
        let volume = volume_dir(root.path());
        let mut lossy = Lossy::start(root.path());
        let watched = lossy.watches.table.len();
        assert!(lossy.directory.volume(UID, CSI_PLUGIN_DIR, PV).is_some());

        let mut file = fs::File::create(volume.join(VOL_DATA_FILE)).unwrap();
        lossy.take_events();
        assert!(!lossy.has_vol_data(), "empty yet");
        assert_eq!(lossy.watches.table.len(), watched + 1, "the file is watched while written");
        file.write_all(VOL_DATA.as_bytes()).unwrap();
        drop(file);
        lossy.take_events();
        assert!(lossy.has_vol_data(), "read on the file's own IN_CLOSE_WRITE");
        assert_eq!(lossy.watches.table.len(), watched, "the file's watch is dropped once written");
    }

    #[test]
    fn vol_data_found_empty_by_the_walk_is_read_on_its_own_close() {
        let root = tempfile::tempdir().unwrap();
        let volume = volume_dir(root.path());
        let mut file = fs::File::create(volume.join(VOL_DATA_FILE)).unwrap();
        let mut lossy = Lossy::start(root.path());
        assert!(!lossy.has_vol_data(), "empty yet");
        file.write_all(VOL_DATA.as_bytes()).unwrap();
        drop(file);
        lossy.take_events();
        assert!(lossy.has_vol_data(), "read on the file's own IN_CLOSE_WRITE");

        // A complete file needs no watch of its own.
        let mut again = Lossy::start(root.path());
        assert!(again.has_vol_data());
        let watched = again.watches.table.len();
        again.take_events();
        assert_eq!(again.watches.table.len(), watched);
    }
}
