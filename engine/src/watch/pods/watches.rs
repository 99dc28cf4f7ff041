//! The watcher's inotify watches and the directory each is on, kept small:
//! a node watches about four directories per pod.
//!
//! One vector sorted by watch descriptor, 24 bytes a watch: the kernel hands
//! descriptors out in increasing order, so a new watch is appended, and a
//! lookup is a binary search. A removed watch leaves a gap that later
//! removals sweep out, so a burst of removals does not move the whole vector
//! each time. The names are in one string, back to back: two small
//! allocations a watch, made while the initial scan allocates and frees far
//! more, would scatter over the heap and keep its freed pages resident.
use std::collections::HashMap;

use super::walk::Dir;

#[derive(Default)]
pub(crate) struct WatchTable {
    /// Sorted by `wd`; gaps (`Kind::Gone`) included.
    entries: Vec<Watch>,
    gaps: usize,
    /// Every name the watches hold. Those of removed watches stay until a
    /// sweep rewrites it.
    text: String,
    /// The last UID added, shared by the watches of its pod's directories
    /// (which the walk adds one after the other).
    last_uid: Span,
    /// Plugin directory names: a handful of values, repeated in every pod.
    plugins: Vec<Span>,
}

struct Watch {
    wd: i32,
    kind: Kind,
    /// Empty for the pods directory and gaps.
    uid: Span,
    /// The plugin, CSI volume (also for its `vol_data.json`) or subPath
    /// volume directory's name;
    /// `<volume>/<container>` for a subPath container directory (a name
    /// holds no `/`).
    name: Span,
}

/// A range of `WatchTable::text`. A name is at most 255 bytes (511 for
/// `<volume>/<container>`), and the text holds at most the names of the live
/// watches (the inotify limit bounds them) plus as much again before a
/// sweep: far below 4 GiB.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
struct Span {
    start: u32,
    len: u16,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Gone,
    Pods,
    Pod,
    Volumes,
    Plugin,
    CsiVolume,
    SubPaths,
    SubPathVolume,
    SubPathContainer,
    VolDataFile,
}

impl WatchTable {
    /// Forgets every watch (their inotify instance was closed).
    pub(crate) fn clear(&mut self) {
        *self = WatchTable::default();
    }

    /// Gives back what growing took: once the initial scan is done, the
    /// table holds nearly all it ever will.
    pub(crate) fn shrink_to_fit(&mut self) {
        self.sweep();
        self.entries.shrink_to_fit();
        self.text.shrink_to_fit();
    }

    /// The directory watched by `wd`.
    pub(crate) fn get(&self, wd: i32) -> Option<Dir> {
        let watch = &self.entries[self.find(wd).ok()?];
        let uid = || self.str(watch.uid).into();
        let name = || self.str(watch.name).into();
        Some(match watch.kind {
            Kind::Gone => return None,
            Kind::Pods => Dir::Pods,
            Kind::Pod => Dir::Pod { uid: uid() },
            Kind::Volumes => Dir::Volumes { uid: uid() },
            Kind::Plugin => Dir::Plugin { uid: uid(), plugin: name() },
            Kind::CsiVolume => Dir::CsiVolume { uid: uid(), name: name() },
            Kind::SubPaths => Dir::SubPaths { uid: uid() },
            Kind::SubPathVolume => Dir::SubPathVolume { uid: uid(), volume: name() },
            Kind::SubPathContainer => {
                let (volume, container) = self.str(watch.name).split_once('/')?;
                Dir::SubPathContainer { uid: uid(), volume: volume.into(), container: container.into() }
            }
            Kind::VolDataFile => Dir::VolDataFile { uid: uid(), name: name() },
        })
    }

    /// Records that `wd` watches `dir`; false if it was known already (the
    /// kernel returns the same descriptor for a directory watched twice).
    pub(crate) fn insert(&mut self, wd: i32, dir: &Dir) -> bool {
        let found = self.find(wd);
        if let Ok(at) = found
            && self.entries[at].kind != Kind::Gone
        {
            return false;
        }
        let watch = self.watch(wd, dir);
        match found {
            Ok(at) => {
                self.gaps -= 1;
                self.entries[at] = watch;
            }
            Err(at) => self.entries.insert(at, watch),
        }
        true
    }

    /// How many watches it holds.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len() - self.gaps
    }

    /// Forgets `wd`.
    pub(crate) fn remove(&mut self, wd: i32) {
        if let Ok(at) = self.find(wd) {
            self.open_gap(at);
        }
        self.sweep_if_sparse();
    }

    /// Forgets every watch of pod `uid`, returning their descriptors; None
    /// if the pod had none.
    pub(crate) fn remove_pod(&mut self, uid: &str) -> Option<Vec<i32>> {
        let mut removed = Vec::new();
        for at in 0..self.entries.len() {
            let watch = &self.entries[at];
            if watch.kind != Kind::Gone && watch.kind != Kind::Pods && self.str(watch.uid) == uid {
                removed.push(watch.wd);
                self.open_gap(at);
            }
        }
        self.sweep_if_sparse();
        (!removed.is_empty()).then_some(removed)
    }

    fn find(&self, wd: i32) -> Result<usize, usize> {
        self.entries.binary_search_by_key(&wd, |watch| watch.wd)
    }

    fn str(&self, span: Span) -> &str {
        let start = span.start as usize;
        self.text.get(start..start + usize::from(span.len)).unwrap_or_default()
    }

    fn open_gap(&mut self, at: usize) {
        let watch = &mut self.entries[at];
        if watch.kind != Kind::Gone {
            watch.kind = Kind::Gone;
            self.gaps += 1;
        }
    }

    /// Sweeps the gaps out once they are a quarter of the vector: each
    /// removal costs a constant share of a sweep.
    fn sweep_if_sparse(&mut self) {
        if self.gaps * 4 > self.entries.len() {
            self.sweep();
        }
    }

    /// Drops the gaps, and rewrites the text with the live watches' names.
    fn sweep(&mut self) {
        let old = std::mem::take(self);
        self.entries.reserve_exact(old.entries.len() - old.gaps);
        let mut uids: HashMap<&str, Span> = HashMap::new();
        for watch in old.entries.iter().filter(|watch| watch.kind != Kind::Gone) {
            // The watches of a pod share one copy of its UID.
            let uid = old.str(watch.uid);
            let uid = match uids.get(uid) {
                Some(span) => *span,
                None => {
                    let span = self.add(uid);
                    uids.insert(uid, span);
                    span
                }
            };
            let name = if watch.kind == Kind::Plugin {
                self.add_plugin(old.str(watch.name))
            } else {
                self.add(old.str(watch.name))
            };
            self.entries.push(Watch { wd: watch.wd, kind: watch.kind, uid, name });
        }
    }

    fn watch(&mut self, wd: i32, dir: &Dir) -> Watch {
        let uid = dir.uid().map_or_else(Span::default, |uid| self.add_uid(uid));
        let (kind, name) = match dir {
            Dir::Pods => (Kind::Pods, Span::default()),
            Dir::Pod { .. } => (Kind::Pod, Span::default()),
            Dir::Volumes { .. } => (Kind::Volumes, Span::default()),
            Dir::Plugin { plugin, .. } => (Kind::Plugin, self.add_plugin(plugin)),
            Dir::CsiVolume { name, .. } => (Kind::CsiVolume, self.add(name)),
            Dir::SubPaths { .. } => (Kind::SubPaths, Span::default()),
            Dir::SubPathVolume { volume, .. } => (Kind::SubPathVolume, self.add(volume)),
            Dir::SubPathContainer { volume, container, .. } => {
                (Kind::SubPathContainer, self.add(&format!("{volume}/{container}")))
            }
            Dir::VolDataFile { name, .. } => (Kind::VolDataFile, self.add(name)),
        };
        Watch { wd, kind, uid, name }
    }

    fn add_uid(&mut self, uid: &str) -> Span {
        if self.str(self.last_uid) != uid || self.last_uid.len == 0 {
            self.last_uid = self.add(uid);
        }
        self.last_uid
    }

    fn add_plugin(&mut self, plugin: &str) -> Span {
        if let Some(known) = self.plugins.iter().find(|span| self.str(**span) == plugin) {
            return *known;
        }
        let span = self.add(plugin);
        self.plugins.push(span);
        span
    }

    fn add(&mut self, name: &str) -> Span {
        // See `Span`: neither conversion can fail.
        let span = Span { start: self.text.len() as u32, len: name.len() as u16 };
        self.text.push_str(name);
        span
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn dirs(uid: &str) -> Vec<Dir> {
        let uid: Arc<str> = uid.into();
        vec![
            Dir::Pod { uid: uid.clone() },
            Dir::Volumes { uid: uid.clone() },
            Dir::Plugin { uid: uid.clone(), plugin: "kubernetes.io~csi".into() },
            Dir::CsiVolume { uid: uid.clone(), name: "pv-1".into() },
            Dir::SubPaths { uid: uid.clone() },
            Dir::SubPathVolume { uid: uid.clone(), volume: "data".into() },
            Dir::SubPathContainer { uid, volume: "data".into(), container: "app".into() },
        ]
    }

    #[test]
    fn a_watch_is_small() {
        assert_eq!(std::mem::size_of::<Watch>(), 24);
    }

    #[test]
    fn gives_back_each_directory_by_its_descriptor() {
        let mut watches = WatchTable::default();
        assert!(watches.insert(1, &Dir::Pods));
        let (a, b) = (dirs("pod-a"), dirs("pod-b"));
        for (wd, dir) in (2..).zip(a.iter().chain(&b)) {
            assert!(watches.insert(wd, dir));
        }
        assert!(!watches.insert(3, &a[1]), "known already");
        assert_eq!(watches.get(1), Some(Dir::Pods));
        for (wd, dir) in (2..).zip(a.iter().chain(&b)) {
            assert_eq!(watches.get(wd).as_ref(), Some(dir));
        }
        assert_eq!(watches.get(99), None);
        // Plugin names and a pod's UID are stored once.
        assert_eq!(watches.text, "pod-akubernetes.io~csipv-1datadata/apppod-bpv-1datadata/app");
    }

    #[test]
    fn forgets_a_watch_and_a_whole_pod() {
        let mut watches = WatchTable::default();
        let (a, b) = (dirs("pod-a"), dirs("pod-b"));
        // Out of order, as after the descriptors wrap around.
        for (wd, dir) in [10, 12, 14, 16, 18, 20, 22].into_iter().zip(&a) {
            watches.insert(wd, dir);
        }
        for (wd, dir) in [11, 13, 15, 17, 19, 21, 23].into_iter().zip(&b) {
            watches.insert(wd, dir);
        }
        watches.remove(12);
        assert_eq!(watches.get(12), None);
        assert_eq!(watches.get(13).as_ref(), Some(&b[1]));
        assert_eq!(watches.remove_pod("pod-a"), Some(vec![10, 14, 16, 18, 20, 22]));
        assert_eq!(watches.remove_pod("pod-a"), None);
        assert!(watches.entries.len() < 14, "gaps swept");
        for (wd, dir) in [11, 13, 15, 17, 19, 21, 23].into_iter().zip(&b) {
            assert_eq!(watches.get(wd).as_ref(), Some(dir));
        }
        // A descriptor used again after its watch went.
        assert!(watches.insert(12, &a[0]));
        assert_eq!(watches.get(12).as_ref(), Some(&a[0]));
        watches.shrink_to_fit();
        assert_eq!(watches.gaps, 0);
        assert_eq!(watches.entries.len(), 8);
        assert_eq!(watches.text, "pod-bpod-akubernetes.io~csipv-1datadata/app", "rewritten");
        for (wd, dir) in [11, 13, 15, 17, 19, 21, 23].into_iter().zip(&b) {
            assert_eq!(watches.get(wd).as_ref(), Some(dir));
        }
    }
}
