//! Where the source of a target without a mapping is, by its volume's
//! layout (a supervisor started after the crash, a lost state file), and the
//! `vol_data.json` of CSI volumes that some layouts need.
//!
//! The loop keeps no model of the pod directories: on a large node that copy
//! was a third of its idle memory, and only unmapped targets (after a
//! restart that lost the state file) ever look at a `vol_data.json`. A
//! volume's data is read from disk when first asked for, kept current from
//! the pod watcher's changes, and dropped once no unmapped target's pod needs
//! it, so that a target that stays unmapped does not cost a read per scan.
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;

use crate::model::state::{Journal, Mapping};
use crate::model::table::{Classified, Dev, Layout, Target, TargetKind};
use crate::plan::layout::{LayoutName, SourceLayouts, SourceMount, TargetInfo};
use crate::watch::pods::{CSI_PLUGIN_DIR, PodChange, VOL_DATA_FILE, VolData};

/// A target's source, as its volume's layout names it.
#[derive(Debug)]
pub struct Located {
    pub target: PathBuf,
    /// Carries no connection (device 0:0): a probe judges the target.
    pub mapping: Mapping,
    /// Which layout named the source.
    pub layout: LayoutName,
}

/// The sources of the targets `journal` has no mapping for, and the pods of
/// the targets no layout located. A layout may name a known bind of a source
/// (the CSI staging path): the target is then mapped to the source the bind
/// is of.
pub fn locate_unmapped(
    classified: &Classified,
    journal: &Journal,
    layouts: &SourceLayouts,
    layout: &Layout,
    vol_data: &mut VolDataCache,
) -> (Vec<Located>, BTreeSet<String>) {
    let binds = classified.targets.values().filter(|target| target.kind == TargetKind::SourceBind);
    let sources: Vec<SourceMount<'_>> =
        classified.sources.values().chain(binds.map(|bind| &bind.stack)).map(SourceMount::from).collect();
    let (mut located, mut unmapped_pods) = (Vec::new(), BTreeSet::new());
    for (path, target) in &classified.targets {
        if journal.get(path).is_some() {
            continue;
        }
        let Some(info) = TargetInfo::from_path(layout.pods_dir(), path, &target.stack.top().root) else { continue };
        let data = vol_data_of(vol_data, layout, classified, target, &info);
        let Some(found) = layouts.locate(&info.with_vol_data(data), &sources) else {
            unmapped_pods.insert(target.pod_uid.clone());
            continue;
        };
        let bind = journal.get(&found.path).filter(|bind| bind.kind == TargetKind::SourceBind);
        let (source, root_in_source) = match bind {
            Some(bind) => (bind.source.clone(), bind.root_in_source.join(&found.root_in_source)),
            None => (found.path, found.root_in_source),
        };
        let mapping = Mapping {
            source,
            root_in_source,
            source_mount_id: 0,
            peer_group: None,
            dev: Dev { major: 0, minor: 0 },
            pod_uid: target.pod_uid.clone(),
            kind: target.kind,
        };
        located.push(Located { target: path.clone(), mapping, layout: found.layout });
    }
    (located, unmapped_pods)
}

/// Known `vol_data.json`s by pod UID and CSI volume directory name; `None`:
/// none, or not valid.
#[derive(Debug)]
pub struct VolDataCache {
    pods_dir: PathBuf,
    pods: HashMap<Box<str>, HashMap<Box<str>, Option<VolData>>>,
}

impl VolDataCache {
    pub fn new(pods_dir: PathBuf) -> Self {
        VolDataCache { pods_dir, pods: HashMap::new() }
    }

    /// Reads the volume's data unless it is known already.
    pub fn load(&mut self, uid: &str, volume: &str) {
        let known = self.pods.entry(uid.into()).or_default();
        if !known.contains_key(volume) {
            let path = self.pods_dir.join(uid).join("volumes").join(CSI_PLUGIN_DIR).join(volume).join(VOL_DATA_FILE);
            // Missing, being written (empty) or malformed all mean no data; the
            // pod watcher reports a malformed file.
            known.insert(volume.into(), VolData::read(&path).ok());
        }
    }

    /// The volume's data, if [`VolDataCache::load`]ed and valid.
    pub fn get(&self, uid: &str, volume: &str) -> Option<&VolData> {
        self.pods.get(uid)?.get(volume)?.as_ref()
    }

    /// Follows a change reported by the pod watcher: what it read from disk
    /// replaces what is known of the volumes of the pods kept.
    pub fn apply(&mut self, change: &PodChange) {
        match change {
            PodChange::VolumeSeen { uid, plugin, name, vol_data } if plugin == CSI_PLUGIN_DIR => {
                if let Some(known) = self.pods.get_mut(uid.as_str()) {
                    known.insert(name.as_str().into(), vol_data.clone());
                }
            }
            PodChange::VolumeRemoved { uid, plugin, name } | PodChange::VolDataInvalid { uid, plugin, name, .. }
                if plugin == CSI_PLUGIN_DIR =>
            {
                if let Some(known) = self.pods.get_mut(uid.as_str()) {
                    known.insert(name.as_str().into(), None);
                }
            }
            PodChange::PodRemoved { uid } => {
                self.pods.remove(uid.as_str());
            }
            // Changes may have been lost: read afresh.
            PodChange::Resync(_) | PodChange::Failed(_) => self.clear(),
            _ => {}
        }
    }

    /// Keeps only the data of these pods.
    pub fn retain(&mut self, pods: &BTreeSet<String>) {
        self.pods.retain(|uid, _| pods.contains(&**uid));
        if self.pods.is_empty() {
            // A burst of unmapped targets must not keep its table for good.
            self.pods = HashMap::new();
        }
    }

    /// Forgets everything: the next asks read from disk.
    pub fn clear(&mut self) {
        self.pods = HashMap::new();
    }
}

/// The `vol_data.json` behind a target. A subPath directory is named after
/// the pod spec's volume, a CSI volume directory after the PV, so a subPath
/// takes the one of its pod's whole-volume target on the same device.
fn vol_data_of<'a>(
    cache: &'a mut VolDataCache,
    layout: &Layout,
    classified: &Classified,
    target: &Target,
    info: &TargetInfo<'_>,
) -> Option<&'a VolData> {
    if target.kind == TargetKind::Volume {
        cache.load(info.pod_uid, info.volume);
        return cache.get(info.pod_uid, info.volume);
    }
    let dev = target.stack.top().dev;
    let volumes: Vec<(&str, &str)> = classified
        .targets
        .iter()
        .filter(|(_, volume)| {
            volume.kind == TargetKind::Volume && volume.pod_uid == target.pod_uid && volume.stack.top().dev == dev
        })
        .filter_map(|(path, volume)| {
            let info = TargetInfo::from_path(layout.pods_dir(), path, &volume.stack.top().root)?;
            Some((info.pod_uid, info.volume))
        })
        .collect();
    for (uid, volume) in &volumes {
        cache.load(uid, volume);
    }
    let cache = &*cache;
    volumes.into_iter().find_map(|(uid, volume)| cache.get(uid, volume))
}

#[cfg(test)]
mod tests {
    use super::*;

    const JSON: &str = r#"{"driverName":"d","specVolID":"pv-1","volumeHandle":"h"}"#;

    fn write(pods_dir: &std::path::Path, uid: &str, volume: &str, contents: &str) {
        let dir = pods_dir.join(uid).join("volumes").join(CSI_PLUGIN_DIR).join(volume);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(VOL_DATA_FILE), contents).unwrap();
    }

    #[test]
    fn reads_once_then_follows_the_watcher() {
        let dir = tempfile::tempdir().unwrap();
        let mut cache = VolDataCache::new(dir.path().to_path_buf());
        write(dir.path(), "pod-a", "pv-1", JSON);
        write(dir.path(), "pod-a", "pv-2", "{");
        cache.load("pod-a", "pv-1");
        cache.load("pod-a", "pv-2");
        cache.load("pod-a", "pv-3");
        assert_eq!(&*cache.get("pod-a", "pv-1").unwrap().spec_vol_id, "pv-1");
        assert_eq!(cache.get("pod-a", "pv-2"), None, "malformed");
        assert_eq!(cache.get("pod-a", "pv-3"), None, "missing");

        // Known: not read again, whatever the disk says now.
        write(dir.path(), "pod-a", "pv-3", JSON);
        cache.load("pod-a", "pv-3");
        assert_eq!(cache.get("pod-a", "pv-3"), None);
        // Until the watcher reports it.
        let data = VolData::parse(JSON.as_bytes(), std::path::Path::new("x")).unwrap();
        cache.apply(&PodChange::VolumeSeen {
            uid: "pod-a".into(),
            plugin: CSI_PLUGIN_DIR.into(),
            name: "pv-3".into(),
            vol_data: Some(data),
        });
        assert!(cache.get("pod-a", "pv-3").is_some());
        cache.apply(&PodChange::VolumeRemoved {
            uid: "pod-a".into(),
            plugin: CSI_PLUGIN_DIR.into(),
            name: "pv-1".into(),
        });
        assert_eq!(cache.get("pod-a", "pv-1"), None);

        // Pods not kept are not learned from changes.
        cache.apply(&PodChange::VolumeSeen {
            uid: "pod-b".into(),
            plugin: CSI_PLUGIN_DIR.into(),
            name: "pv-1".into(),
            vol_data: None,
        });
        assert!(!cache.pods.contains_key("pod-b"));

        cache.retain(&BTreeSet::new());
        assert!(cache.pods.is_empty());
        cache.load("pod-a", "pv-1");
        assert!(cache.get("pod-a", "pv-1").is_some(), "read afresh");
        cache.apply(&PodChange::PodRemoved { uid: "pod-a".into() });
        assert!(cache.pods.is_empty());
    }
}
