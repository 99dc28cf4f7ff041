//! A hash map keyed by path whose keys hash as their bytes.
//!
//! Every scan looks up each target in the journal and the loop's records,
//! several times. `Path`'s own hash walks the path for its separators and
//! feeds the hasher one component at a time: at 1,000 targets that was a
//! third of a rescan's CPU, on the heal's path. The paths kept here are the
//! ones the kernel prints and the kubelet's directories joined from them
//! (absolute, without `.`, `..`, repeated or trailing slashes), for which
//! two paths are the same path exactly when their bytes are the same, so
//! one write of the bytes is hash enough. The hasher stays the standard
//! library's keyed one: a tenant chooses its volumes' names.
use std::collections::HashMap;
use std::collections::hash_map;
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::model::table::path_order;

/// A map from path to `V`, hashed on the path's bytes (see the module).
#[derive(Clone, PartialEq, Eq)]
pub struct PathMap<V> {
    map: HashMap<OsString, V>,
}

impl<V> Default for PathMap<V> {
    fn default() -> Self {
        PathMap { map: HashMap::new() }
    }
}

impl<V: fmt::Debug> fmt::Debug for PathMap<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<V> PathMap<V> {
    pub fn new() -> Self {
        PathMap::default()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn get(&self, path: &Path) -> Option<&V> {
        self.map.get(path.as_os_str())
    }

    pub fn get_mut(&mut self, path: &Path) -> Option<&mut V> {
        self.map.get_mut(path.as_os_str())
    }

    pub fn contains_key(&self, path: &Path) -> bool {
        self.map.contains_key(path.as_os_str())
    }

    /// Returns the value `path` had, if any.
    pub fn insert(&mut self, path: PathBuf, value: V) -> Option<V> {
        self.map.insert(path.into_os_string(), value)
    }

    pub fn remove(&mut self, path: &Path) -> Option<V> {
        self.map.remove(path.as_os_str())
    }

    /// The value at `path`, made by `make` if there is none; the path is
    /// copied only then.
    pub fn get_or_insert_with(&mut self, path: &Path, make: impl FnOnce() -> V) -> &mut V {
        // Looked up twice when absent: the entry API would copy the path
        // for every lookup, present or not.
        if !self.map.contains_key(path.as_os_str()) {
            self.map.insert(path.as_os_str().to_os_string(), make());
        }
        self.map.get_mut(path.as_os_str()).expect("inserted above")
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&Path, &V)> {
        self.into_iter()
    }

    /// Every path, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = &Path> {
        self.map.keys().map(Path::new)
    }

    /// Every value, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.map.values()
    }

    /// Keeps the entries `keep` says yes to.
    pub fn retain(&mut self, mut keep: impl FnMut(&Path, &mut V) -> bool) {
        self.map.retain(|path, value| keep(Path::new(path), value));
    }
}

impl<V> FromIterator<(PathBuf, V)> for PathMap<V> {
    fn from_iter<I: IntoIterator<Item = (PathBuf, V)>>(entries: I) -> Self {
        PathMap { map: entries.into_iter().map(|(path, value)| (path.into_os_string(), value)).collect() }
    }
}

impl<'a, V> IntoIterator for &'a PathMap<V> {
    type Item = (&'a Path, &'a V);
    type IntoIter = std::iter::Map<hash_map::Iter<'a, OsString, V>, fn((&'a OsString, &'a V)) -> (&'a Path, &'a V)>;

    fn into_iter(self) -> Self::IntoIter {
        self.map.iter().map(|(path, value)| (Path::new(path), value))
    }
}

impl<V> IntoIterator for PathMap<V> {
    type Item = (PathBuf, V);
    type IntoIter = std::iter::Map<hash_map::IntoIter<OsString, V>, fn((OsString, V)) -> (PathBuf, V)>;

    fn into_iter(self) -> Self::IntoIter {
        self.map.into_iter().map(|(path, value)| (PathBuf::from(path), value))
    }
}

/// Entries in path order ([`path_order`]), each found by its path through a
/// [`PathMap`] of positions: what a scan iterates in order and looks up by
/// path, where an ordered map compared paths component by component on
/// every lookup (a tenth of a rescan at 1,000 targets).
#[derive(Clone)]
pub struct SortedPathMap<V> {
    entries: Vec<(PathBuf, V)>,
    positions: PathMap<usize>,
}

impl<V> Default for SortedPathMap<V> {
    fn default() -> Self {
        SortedPathMap { entries: Vec::new(), positions: PathMap::new() }
    }
}

impl<V: fmt::Debug> fmt::Debug for SortedPathMap<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<V: PartialEq> PartialEq for SortedPathMap<V> {
    fn eq(&self, other: &Self) -> bool {
        self.entries == other.entries
    }
}

impl<V> SortedPathMap<V> {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn get(&self, path: &Path) -> Option<&V> {
        self.positions.get(path).map(|&at| &self.entries[at].1)
    }

    pub fn contains_key(&self, path: &Path) -> bool {
        self.positions.contains_key(path)
    }

    /// Puts `value` at `path` in its place in the order; returns the value
    /// `path` had, if any. The positions after it move: for the rare
    /// insertion after a classification, not for building one.
    pub fn insert(&mut self, path: PathBuf, value: V) -> Option<V> {
        if let Some(&at) = self.positions.get(&path) {
            return Some(std::mem::replace(&mut self.entries[at].1, value));
        }
        let at = self.entries.partition_point(|(other, _)| path_order(other, &path).is_lt());
        self.entries.insert(at, (path, value));
        for (position, (path, _)) in self.entries.iter().enumerate().skip(at) {
            self.positions.insert(path.clone(), position);
        }
        None
    }

    /// Every entry, in path order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&PathBuf, &V)> + ExactSizeIterator {
        self.entries.iter().map(|(path, value)| (path, value))
    }

    /// Every path, in order.
    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &PathBuf> + ExactSizeIterator {
        self.entries.iter().map(|(path, _)| path)
    }

    /// Every value, in its path's order.
    pub fn values(&self) -> impl DoubleEndedIterator<Item = &V> + ExactSizeIterator {
        self.entries.iter().map(|(_, value)| value)
    }
}

/// Panics if `path` is not in the map, as a map's index does.
impl<V, P: AsRef<Path> + ?Sized> std::ops::Index<&P> for SortedPathMap<V> {
    type Output = V;

    fn index(&self, path: &P) -> &V {
        let path = path.as_ref();
        self.get(path).unwrap_or_else(|| panic!("{} is not in the map", path.display()))
    }
}

impl<'a, V> IntoIterator for &'a SortedPathMap<V> {
    type Item = (&'a PathBuf, &'a V);
    type IntoIter = std::iter::Map<std::slice::Iter<'a, (PathBuf, V)>, fn(&'a (PathBuf, V)) -> (&'a PathBuf, &'a V)>;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter().map(|(path, value)| (path, value))
    }
}

/// In path order, whatever the entries' order; of a path given twice, the
/// last value stays (as in a map).
impl<V> FromIterator<(PathBuf, V)> for SortedPathMap<V> {
    fn from_iter<I: IntoIterator<Item = (PathBuf, V)>>(entries: I) -> Self {
        let mut entries: Vec<(PathBuf, V)> = entries.into_iter().collect();
        // Stable, and a single pass over entries already in order (a
        // classification's).
        entries.sort_by(|(a, _), (b, _)| path_order(a, b));
        let mut kept: Vec<(PathBuf, V)> = Vec::with_capacity(entries.len());
        for (path, value) in entries {
            match kept.last_mut() {
                Some(last) if last.0.as_os_str() == path.as_os_str() => last.1 = value,
                _ => kept.push((path, value)),
            }
        }
        let positions = kept.iter().enumerate().map(|(at, (path, _))| (path.clone(), at)).collect();
        SortedPathMap { entries: kept, positions }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_found_by_their_bytes_and_kept_once() {
        let mut map = PathMap::new();
        assert_eq!(map.insert(PathBuf::from("/var/lib/kubelet/pods/a/volumes/v"), 1), None);
        assert_eq!(map.insert(PathBuf::from("/var/lib/kubelet/pods/a/volumes/v"), 2), Some(1));
        assert_eq!(map.get(Path::new("/var/lib/kubelet/pods/a/volumes/v")), Some(&2));
        assert_eq!(map.get(Path::new("/var/lib/kubelet/pods/a/volumes")), None);
        *map.get_or_insert_with(Path::new("/b"), || 7) += 1;
        *map.get_or_insert_with(Path::new("/b"), || 100) += 1;
        assert_eq!(map.get(Path::new("/b")), Some(&9));
        map.retain(|path, _| path != Path::new("/b"));
        assert_eq!(map.len(), 1);
        let back: Vec<(PathBuf, i32)> = map.into_iter().collect();
        assert_eq!(back, vec![(PathBuf::from("/var/lib/kubelet/pods/a/volumes/v"), 2)]);
    }

    #[test]
    fn a_sorted_map_keeps_path_order_through_insertions_and_finds_every_path() {
        let paths = ["/p/a/v", "/p/a-b/v", "/p/a/v/sub", "/p/b", "/p/a/v"];
        let mut map: SortedPathMap<usize> =
            paths.iter().enumerate().map(|(at, path)| (PathBuf::from(path), at)).collect();
        // Path order: the separator sorts before every other byte, so
        // "/p/a/v/sub" comes before "/p/a-b/v"; the second "/p/a/v" wins.
        let order: Vec<&str> = map.keys().map(|path| path.to_str().unwrap()).collect();
        assert_eq!(order, ["/p/a/v", "/p/a/v/sub", "/p/a-b/v", "/p/b"]);
        assert_eq!(map.get(Path::new("/p/a/v")), Some(&4));
        assert_eq!(map.insert(PathBuf::from("/p/a/w"), 9), None);
        assert_eq!(map.insert(PathBuf::from("/p/b"), 10), Some(3));
        let order: Vec<&str> = map.keys().map(|path| path.to_str().unwrap()).collect();
        assert_eq!(order, ["/p/a/v", "/p/a/v/sub", "/p/a/w", "/p/a-b/v", "/p/b"]);
        let sorted: Vec<&PathBuf> = map.keys().collect();
        assert!(sorted.windows(2).all(|pair| pair[0] < pair[1]), "the same order as Path's own");
        for (path, value) in &map {
            assert_eq!(map.get(path), Some(value), "{}", path.display());
        }
        assert_eq!(map.len(), 5);
    }
}
