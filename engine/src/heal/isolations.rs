//! The containers' mounts isolated per dead connection, kept from the
//! death until the heal.
//!
//! A device number alone does not name a connection: the kernel reuses an
//! anonymous minor once the old superblock is gone, so an entry whose heal
//! never came would make the next connection with that number look isolated
//! already, and its containers would never be searched. Each entry also
//! keeps the inode of the connection's `fusectl` directory (see
//! [`super::connections`]): an entry whose directory is gone or is another
//! one is of an earlier connection.
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::connections::FuseConnections;
use super::containers::ForeignMount;
use crate::model::table::Dev;

#[derive(Debug)]
pub struct Isolations {
    connections: Arc<FuseConnections>,
    by_dev: BTreeMap<Dev, Isolation>,
}

#[derive(Debug)]
struct Isolation {
    /// The inode of the connection's directory when it was isolated; None
    /// where `fusectl` cannot be read (then the number alone tells).
    connection: Option<u64>,
    /// Every mount found, isolated or not: all are replaced at the heal.
    mounts: Vec<ForeignMount>,
    /// Those that could not be made private (out of descriptors, say):
    /// tried again before the host heal.
    unisolated: Vec<ForeignMount>,
    /// The generation of the namespaces known when they were last searched
    /// (see [`crate::heal::namespaces::Namespaces::generation`]).
    searched_at: u64,
}

impl Isolations {
    pub fn new(connections: Arc<FuseConnections>) -> Self {
        Isolations { connections, by_dev: BTreeMap::new() }
    }

    /// Whether the connection now numbered `dev` was isolated already. Drops
    /// the entries of connections that are gone, this number's included.
    pub fn contains(&mut self, dev: Dev) -> bool {
        let connections = &self.connections;
        self.by_dev.retain(|dev, isolation| isolation.connection == connections.inode_of(*dev));
        self.by_dev.contains_key(&dev)
    }

    /// Records the `mounts` of the connection now numbered `dev`, found by
    /// a search of the namespaces known at `searched_at` (added to those
    /// found before, if any), and which of them are still `unisolated`.
    pub fn insert(&mut self, dev: Dev, mounts: Vec<ForeignMount>, unisolated: Vec<ForeignMount>, searched_at: u64) {
        let connection = self.connections.inode_of(dev);
        match self.by_dev.get_mut(&dev).filter(|isolation| isolation.connection == connection) {
            Some(isolation) => {
                let new = mounts.into_iter().filter(|mount| !isolation.mounts.contains(mount)).collect::<Vec<_>>();
                isolation.mounts.extend(new);
                isolation.unisolated = unisolated;
                isolation.searched_at = searched_at;
            }
            None => {
                self.by_dev.insert(dev, Isolation { connection, mounts, unisolated, searched_at });
            }
        }
    }

    /// The inode of the `fusectl` directory of the connection numbered
    /// `dev` now.
    pub fn connection_inode(&self, dev: Dev) -> Option<u64> {
        self.connections.inode_of(dev)
    }

    /// Takes the mounts of connection `dev` that could not be isolated, to
    /// try again.
    pub fn take_unisolated(&mut self, dev: Dev) -> Vec<ForeignMount> {
        self.by_dev.get_mut(&dev).map(|isolation| std::mem::take(&mut isolation.unisolated)).unwrap_or_default()
    }

    /// When the connection numbered `dev` was last searched for, and the
    /// namespaces of its isolated mounts; None if it was not.
    pub fn searched(&mut self, dev: Dev) -> Option<(u64, BTreeSet<u64>)> {
        if !self.contains(dev) {
            return None;
        }
        let isolation = self.by_dev.get(&dev)?;
        Some((isolation.searched_at, isolation.mounts.iter().map(|foreign| foreign.namespace).collect()))
    }

    /// Takes the isolated mounts of the connection numbered `dev`, and when
    /// they were last searched for, if they are still of the connection
    /// that now has that number.
    pub fn remove(&mut self, dev: Dev) -> Option<(u64, Vec<ForeignMount>)> {
        let isolation = self.by_dev.remove(&dev)?;
        (isolation.connection == self.connections.inode_of(dev)).then_some((isolation.searched_at, isolation.mounts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reused_device_number_does_not_match_an_earlier_connections_entry() {
        let connections = tempfile::tempdir().unwrap();
        let dir = connections.path().join("57");
        std::fs::create_dir(&dir).unwrap();
        let dev = Dev { major: 0, minor: 57 };
        let mut isolations = Isolations::new(Arc::new(FuseConnections::at(connections.path())));
        assert!(!isolations.contains(dev));
        isolations.insert(dev, Vec::new(), Vec::new(), 1);
        assert!(isolations.contains(dev), "the same connection is isolated already");

        // The connection goes and another gets its number: the old
        // directory is kept elsewhere so the new one cannot share its inode.
        std::fs::rename(&dir, connections.path().join("old")).unwrap();
        std::fs::create_dir(&dir).unwrap();
        assert!(!isolations.contains(dev), "a new connection with the number is searched again");
        isolations.insert(dev, Vec::new(), Vec::new(), 2);
        assert_eq!(isolations.remove(dev), Some((2, Vec::new())));

        // Gone before its heal: nothing is handed to the heal.
        isolations.insert(dev, Vec::new(), Vec::new(), 3);
        std::fs::remove_dir(&dir).unwrap();
        assert_eq!(isolations.remove(dev), None);
    }

    #[test]
    fn without_fusectl_the_number_alone_tells() {
        let mut isolations = Isolations::new(Arc::new(FuseConnections::unavailable()));
        let dev = Dev { major: 0, minor: 3 };
        isolations.insert(dev, Vec::new(), Vec::new(), 1);
        assert!(isolations.contains(dev));
        assert_eq!(isolations.searched(dev), Some((1, BTreeSet::new())));
        assert_eq!(isolations.remove(dev), Some((1, Vec::new())));
        assert!(!isolations.contains(dev));
    }
}
