//! The in-memory model of `<kubelet-root>/pods`: which pods exist, their
//! volumes (with `vol_data.json` for CSI ones) and their subPath entries.
use std::collections::{BTreeMap, HashSet};
use std::io;
use std::path::Path;
use std::sync::Arc;

use super::vol_data::VolData;
use super::walk::{self, Dir, Visit};
use super::{PodChange, PodWatchError};

/// Every pod directory and what the model tracks in it. Kept small: a node
/// agent holds thousands of these (see `benches/pods.rs`).
#[derive(Clone, Debug, Default)]
pub struct PodDirectory {
    pods: BTreeMap<Box<str>, Pod>,
    /// Plugin, driver and node names: a handful of values repeated in every
    /// volume, stored once.
    names: HashSet<Arc<str>>,
}

impl PartialEq for PodDirectory {
    fn eq(&self, other: &Self) -> bool {
        self.pods == other.pods
    }
}

impl Eq for PodDirectory {}

/// One pod's volumes and subPath entries, each sorted (so two models of the
/// same tree are equal whatever order they learned it in).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pod {
    pub volumes: Vec<Volume>,
    pub subpaths: Vec<SubPath>,
}

/// `volumes/<plugin>/<name>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Volume {
    /// The plugin directory, e.g. `kubernetes.io~csi`.
    pub plugin: Arc<str>,
    /// For a CSI PV the PV name; otherwise the pod's volume name.
    pub name: Box<str>,
    /// Parsed `vol_data.json` of a CSI volume, once written and valid.
    pub vol_data: Option<VolData>,
}

/// `volume-subpaths/<volume>/<container>/<index>`. `volume` is the pod
/// spec's volume name, which for a PVC differs from the PV-named directory
/// under `volumes/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubPath {
    pub volume: Box<str>,
    pub container: Box<str>,
    /// The volumeMount's index in the container spec.
    pub index: Box<str>,
}

impl PodDirectory {
    /// Reads the tree below `pods_dir` once, without watching it. Volumes
    /// whose `vol_data.json` is malformed are kept, without data.
    pub fn scan(pods_dir: &Path) -> Result<Self, PodWatchError> {
        struct Scan(PodDirectory);
        impl Visit for Scan {
            fn enter(&mut self, path: &Path, _: &Dir) -> io::Result<bool> {
                // Only model directories get here, never a mount point.
                if std::fs::symlink_metadata(path)?.is_dir() {
                    Ok(true)
                } else {
                    Err(io::ErrorKind::NotADirectory.into())
                }
            }
            fn change(&mut self, change: PodChange) {
                self.0.apply(change);
            }
        }
        let mut scan = Scan(PodDirectory::default());
        walk::walk_all(pods_dir, &mut scan)?;
        Ok(scan.0)
    }

    /// Applies one change; returns whether the model changed. Changes are
    /// facts read from disk, so applying one twice changes nothing.
    pub fn apply(&mut self, change: PodChange) -> bool {
        match change {
            PodChange::PodAdded { uid } => {
                if self.pods.contains_key(uid.as_str()) {
                    return false;
                }
                self.pods.insert(uid.into(), Pod::default());
                true
            }
            PodChange::PodRemoved { uid } => self.pods.remove(uid.as_str()).is_some(),
            PodChange::VolumeSeen { uid, plugin, name, mut vol_data } => {
                if let Some(data) = &mut vol_data {
                    data.driver_name = intern(&mut self.names, &data.driver_name);
                    data.node_name = data.node_name.as_ref().map(|node| intern(&mut self.names, node));
                }
                let plugin = intern(&mut self.names, &plugin);
                let pod = self.pods.entry(uid.into()).or_default();
                match pod.find_volume(&plugin, &name) {
                    Ok(at) if pod.volumes[at].vol_data == vol_data => false,
                    Ok(at) => {
                        pod.volumes[at].vol_data = vol_data;
                        true
                    }
                    Err(at) => {
                        // Exact capacity: most pods have a few volumes.
                        pod.volumes.reserve_exact(1);
                        pod.volumes.insert(at, Volume { plugin, name: name.into(), vol_data });
                        true
                    }
                }
            }
            PodChange::VolumeRemoved { uid, plugin, name } => {
                let Some(pod) = self.pods.get_mut(uid.as_str()) else { return false };
                let Ok(at) = pod.find_volume(&plugin, &name) else { return false };
                pod.volumes.remove(at);
                true
            }
            PodChange::SubPathSeen { uid, volume, container, index } => {
                let pod = self.pods.entry(uid.into()).or_default();
                let Err(at) = pod.find_subpath(&volume, &container, &index) else { return false };
                pod.subpaths.reserve_exact(1);
                pod.subpaths
                    .insert(at, SubPath { volume: volume.into(), container: container.into(), index: index.into() });
                true
            }
            PodChange::SubPathRemoved { uid, volume, container, index } => {
                let Some(pod) = self.pods.get_mut(uid.as_str()) else { return false };
                let Ok(at) = pod.find_subpath(&volume, &container, &index) else { return false };
                pod.subpaths.remove(at);
                true
            }
            PodChange::Resync(directory) => {
                let changed = *self != directory;
                *self = directory;
                changed
            }
            PodChange::VolDataInvalid { .. } | PodChange::EventsLost(_) | PodChange::Failed(_) => false,
        }
    }

    pub fn len(&self) -> usize {
        self.pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    pub fn pod(&self, uid: &str) -> Option<&Pod> {
        self.pods.get(uid)
    }

    /// Pods by UID, in UID order.
    pub fn pods(&self) -> impl Iterator<Item = (&str, &Pod)> {
        self.pods.iter().map(|(uid, pod)| (&**uid, pod))
    }

    /// `volumes/<plugin>/<name>` of pod `uid`.
    pub fn volume(&self, uid: &str, plugin: &str, name: &str) -> Option<&Volume> {
        let pod = self.pod(uid)?;
        pod.find_volume(plugin, name).ok().map(|at| &pod.volumes[at])
    }

    /// The parsed `vol_data.json` of CSI volume `name` of pod `uid`.
    pub fn vol_data(&self, uid: &str, name: &str) -> Option<&VolData> {
        self.volume(uid, walk::CSI_PLUGIN_DIR, name)?.vol_data.as_ref()
    }
}

fn intern(names: &mut HashSet<Arc<str>>, name: &str) -> Arc<str> {
    if let Some(known) = names.get(name) {
        return known.clone();
    }
    let name: Arc<str> = name.into();
    names.insert(name.clone());
    name
}

impl Pod {
    fn find_volume(&self, plugin: &str, name: &str) -> Result<usize, usize> {
        self.volumes.binary_search_by(|v| (&*v.plugin, &*v.name).cmp(&(plugin, name)))
    }

    fn find_subpath(&self, volume: &str, container: &str, index: &str) -> Result<usize, usize> {
        self.subpaths.binary_search_by(|s| (&*s.volume, &*s.container, &*s.index).cmp(&(volume, container, index)))
    }
}
