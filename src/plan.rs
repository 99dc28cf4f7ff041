//! Heal planning: a pure function of a classified table and the journal.
use std::path::{Path, PathBuf};

use crate::state::{Journal, Mapping};
use crate::table::{Classified, Layout, Stack, Target, TargetKind, root_within};

/// What a target needs, judged from the table alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Assessment {
    /// On its source's connection, one layer.
    Healthy,
    /// On its source's connection, but stale layers remain underneath
    /// (healed by propagation, or an earlier heal that could not flatten).
    StaleLayers,
    /// Still on the connection its source had before it was replaced.
    Broken,
    /// On another connection than both its source and the one recorded:
    /// only a probe can tell whether it is dead.
    Unknown,
    /// Its source path has no FUSE mount: nothing to heal from yet.
    SourceDown,
    /// Never seen as a peer of any source: not ours to touch.
    Unmanaged,
}

impl Assessment {
    pub fn name(&self) -> &'static str {
        match self {
            Assessment::Healthy => "healthy",
            Assessment::StaleLayers => "stale-layers",
            Assessment::Broken => "broken",
            Assessment::Unknown => "unknown",
            Assessment::SourceDown => "source-down",
            Assessment::Unmanaged => "unmanaged",
        }
    }
}

/// Learns mappings from targets that share a peer group with a source.
/// Returns whether the journal changed.
pub fn learn(classified: &Classified, layout: &Layout, journal: &mut Journal) -> bool {
    let mut changed = false;
    for (path, target) in &classified.targets {
        let Some(source) = classified.source_of_peer(target, layout) else {
            continue;
        };
        let (top, source_top) = (target.stack.top(), source.top());
        let Some(root_in_source) = root_within(&source_top.root, &top.root) else {
            continue;
        };
        let mapping = Mapping {
            source: source.path.clone(),
            root_in_source,
            source_mount_id: source_top.mount_id,
            peer_group: source_top.peer_group,
            dev: source_top.dev,
            pod_uid: target.pod_uid.clone(),
            kind: target.kind,
        };
        if let Some(known) = journal.get(path).filter(|known| known.source != mapping.source) {
            tracing::warn!(
                target = %path.display(),
                recorded = %known.source.display(),
                learned = %mapping.source.display(),
                "source of target changed; using the learned one"
            );
        }
        changed |= journal.record(path, mapping);
    }
    changed
}

/// Judges one target against its recorded mapping.
pub fn assess(target: &Target, mapping: Option<&Mapping>, classified: &Classified) -> Assessment {
    let Some(mapping) = mapping else {
        return Assessment::Unmanaged;
    };
    let Some(source) = classified.sources.get(&mapping.source) else {
        return Assessment::SourceDown;
    };
    let top = target.stack.top();
    if top.dev == source.top().dev {
        if target.stack.stale_layers().next().is_some() { Assessment::StaleLayers } else { Assessment::Healthy }
    } else if top.dev == mapping.dev {
        Assessment::Broken
    } else {
        Assessment::Unknown
    }
}

/// One target of a heal batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetHeal {
    pub path: PathBuf,
    pub pod_uid: String,
    pub kind: TargetKind,
    pub root_in_source: PathBuf,
    /// The mount ID on top of the target when planned; the executor
    /// refuses to act if the path no longer resolves to it.
    pub top_mount_id: u32,
    /// Every FUSE layer at the path when planned, bottom first: what
    /// flattening may remove.
    pub layer_ids: Vec<u32>,
}

impl TargetHeal {
    /// Whole-volume targets first: one stack on one of them propagates to
    /// every other root-level peer.
    fn order_key(&self) -> (bool, bool, &Path) {
        (!self.root_in_source.as_os_str().is_empty(), self.kind == TargetKind::Subpath, &self.path)
    }
}

/// Everything to do for one source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealBatch {
    pub source: Stack,
    pub targets: Vec<TargetHeal>,
}

/// Heal batches for every source with broken or stale-layered targets.
/// `confirmed_broken` are targets judged `Unknown` that a probe found dead.
pub fn plan(classified: &Classified, journal: &Journal, confirmed_broken: &[PathBuf]) -> Vec<HealBatch> {
    let mut batches: Vec<HealBatch> = Vec::new();
    for (path, target) in &classified.targets {
        let mapping = journal.get(path);
        // Stale layers under a healthy top are left alone: they are covered,
        // so no fd can reach them to make them private, and removing the top
        // would propagate into containers. The next heal of the target
        // removes them along with its own stale layer.
        match assess(target, mapping, classified) {
            Assessment::Broken => {}
            Assessment::Unknown if confirmed_broken.contains(path) => {}
            _ => continue,
        }
        let Some(mapping) = mapping else { continue };
        let Some(source) = classified.sources.get(&mapping.source) else { continue };
        let heal = TargetHeal {
            path: path.clone(),
            pod_uid: target.pod_uid.clone(),
            kind: target.kind,
            root_in_source: mapping.root_in_source.clone(),
            top_mount_id: target.stack.top().mount_id,
            layer_ids: target.stack.layers.iter().map(|layer| layer.mount_id).collect(),
        };
        match batches.iter_mut().find(|batch| batch.source.path == source.path) {
            Some(batch) => batch.targets.push(heal),
            None => batches.push(HealBatch { source: source.clone(), targets: vec![heal] }),
        }
    }
    for batch in &mut batches {
        batch.targets.sort_by(|a, b| a.order_key().cmp(&b.order_key()));
    }
    batches
}
