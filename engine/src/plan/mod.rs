//! Decisions: the heal plan, a pure function of a classified table and the
//! journal; where each target's source is ([`layout`] rules and [`locate`],
//! which read the rules file and `vol_data.json`); and the wait for the
//! kubelet's confirmation with what its answers mean ([`confirm`], pure);
//! when a source's restarts are a crash loop ([`flapping`], pure).
pub mod confirm;
pub mod flapping;
pub mod layout;
pub mod locate;
pub mod scan;

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use tracing::info;

use crate::model::state::{Journal, Mapping};
use crate::model::table::{Classified, Dev, Layout, Stack, Target, TargetKind, path_order, root_within};

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

/// Tells the binds of a global mount outside the pods (a CSI staging
/// `globalmount`, a driver's second path) from the daemon's own mount, and
/// moves every known bind among the targets. A bind is learned while it is
/// healthy, as the source's peer; after a crash it stays on the dead
/// connection, so it is never anyone's source: it is healed like a whole
/// volume, from the source it was learned from. Forgets the binds that are
/// no longer mounted. Returns whether the journal changed.
pub fn separate_source_binds(classified: &mut Classified, layout: &Layout, journal: &mut Journal) -> bool {
    let is_bind = |journal: &Journal, path: &Path| journal.get(path).is_some_and(|m| m.kind == TargetKind::SourceBind);
    let mut groups: BTreeMap<u32, Vec<&Stack>> = BTreeMap::new();
    for (path, source) in &classified.sources {
        if let Some(group) = source.top().peer_group.filter(|_| !is_bind(journal, path)) {
            groups.entry(group).or_default().push(source);
        }
    }
    let mut learned = Vec::new();
    for sources in groups.values().filter(|sources| sources.len() > 1) {
        let Some(&primary) = sources.iter().min_by_key(|source| layout.source_precedence(source)) else { continue };
        for bind in sources.iter().filter(|bind| bind.path != primary.path) {
            let Some(root_in_source) = root_within(&primary.top().root, &bind.top().root) else { continue };
            let mapping = Mapping {
                source: primary.path.clone(),
                root_in_source,
                source_mount_id: primary.top().mount_id,
                peer_group: primary.top().peer_group,
                dev: primary.top().dev,
                pod_uid: String::new(),
                kind: TargetKind::SourceBind,
            };
            learned.push((bind.path.clone(), mapping));
        }
    }
    let mut changed = false;
    for (path, mapping) in learned {
        info!(bind = %path.display(), source = %mapping.source.display(), "a bind of a source outside the pods");
        changed |= journal.record(&path, mapping);
    }
    let binds: Vec<PathBuf> = classified.sources.keys().filter(|path| is_bind(journal, path)).cloned().collect();
    classified.move_to_targets(&binds);
    changed
        | journal
            .retain(|path, mapping| mapping.kind != TargetKind::SourceBind || classified.targets.contains_key(path))
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
    changed | learn_from_mapped_peers(classified, journal)
}

/// Learns the mapping of a target that shares its peer group and
/// connection with a mapped target but with no source: a pod published
/// while the daemon was dead (its own mount detached from the source path),
/// bound from the dead staging mount its mapped peers are binds of. It is
/// then healed with them.
fn learn_from_mapped_peers(classified: &Classified, journal: &mut Journal) -> bool {
    let unmapped: Vec<(&PathBuf, &Target)> =
        classified.targets.iter().filter(|(path, _)| journal.get(path).is_none()).collect();
    if unmapped.is_empty() {
        return false;
    }
    // A mapped target per (connection, peer group) of its top, with the
    // root of its source's mount on that connection.
    let mut mapped = BTreeMap::new();
    for (path, target) in &classified.targets {
        let (Some(mapping), top) = (journal.get(path), target.stack.top()) else { continue };
        if top.dev != mapping.dev || top.peer_group.is_none() {
            continue;
        }
        let Some(source_root) = strip_root(&top.root, &mapping.root_in_source) else { continue };
        mapped.entry((top.dev, top.peer_group)).or_insert_with(|| (mapping.clone(), source_root));
    }
    let mut changed = false;
    for (path, target) in unmapped {
        let top = target.stack.top();
        let Some((peer, source_root)) = mapped.get(&(top.dev, top.peer_group)) else { continue };
        let Some(root_in_source) = root_within(source_root, &top.root) else { continue };
        let mapping = Mapping { root_in_source, pod_uid: target.pod_uid.clone(), kind: target.kind, ..peer.clone() };
        info!(target = %path.display(), source = %mapping.source.display(), "target learned from its mapped peers");
        changed |= journal.record(path, mapping);
    }
    changed
}

/// `root` without its last components `within` (the root of the source's
/// mount that `root` is `within` of).
fn strip_root(root: &Path, within: &Path) -> Option<PathBuf> {
    let mut source_root = root.to_path_buf();
    for _ in within.components() {
        if !source_root.pop() {
            return None;
        }
    }
    source_root.join(within).eq(root).then_some(source_root)
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
    /// The device of that mount: the kernel reuses a freed mount's ID at
    /// once, so an ID alone could name a mount made since on a recreated
    /// directory.
    pub top_dev: Dev,
    /// Every FUSE layer at the path when planned, bottom first: what
    /// flattening may remove.
    pub layer_ids: Vec<u32>,
    /// The connection and root of the layer right under the top, if any: a
    /// heal cut short after it slid the new source beneath the stale top
    /// left the new source there.
    pub beneath_top: Option<(Dev, PathBuf)>,
}

impl TargetHeal {
    /// The target as the table shows it now, to be healed from `mapping`'s source.
    pub fn of(path: &Path, target: &Target, mapping: &Mapping) -> TargetHeal {
        TargetHeal {
            path: path.to_path_buf(),
            pod_uid: target.pod_uid.clone(),
            kind: target.kind,
            root_in_source: mapping.root_in_source.clone(),
            top_mount_id: target.stack.top().mount_id,
            top_dev: target.stack.top().dev,
            layer_ids: target.stack.layers.iter().map(|layer| layer.mount_id).collect(),
            beneath_top: target.stack.layers.iter().rev().nth(1).map(|layer| (layer.dev, layer.root.clone())),
        }
    }

    /// Whole-volume targets first: one stack on one of them propagates to
    /// every other root-level peer. Then in path order.
    fn heal_order(&self, other: &TargetHeal) -> Ordering {
        let key = |heal: &TargetHeal| (!heal.root_in_source.as_os_str().is_empty(), heal.kind == TargetKind::Subpath);
        key(self).cmp(&key(other)).then_with(|| path_order(&self.path, &other.path))
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
pub fn plan(classified: &Classified, journal: &Journal, confirmed_broken: &BTreeSet<PathBuf>) -> Vec<HealBatch> {
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
        let heal = TargetHeal::of(path, target, mapping);
        match batches.iter_mut().find(|batch| batch.source.path == source.path) {
            Some(batch) => batch.targets.push(heal),
            None => batches.push(HealBatch { source: source.clone(), targets: vec![heal] }),
        }
    }
    for batch in &mut batches {
        batch.targets.sort_unstable_by(|a, b| a.heal_order(b));
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::table::{Dev, Snapshot};

    const KUBELET: &str = "/var/lib/kubelet";
    const POD_A: &str = "/var/lib/kubelet/pods/aaaa/volumes/kubernetes.io~csi/data/mount";
    const POD_B: &str = "/var/lib/kubelet/pods/bbbb/volumes/kubernetes.io~csi/data/mount";
    const SUB: &str = "/var/lib/kubelet/pods/cccc/volume-subpaths/data/app/0";
    const GLOBAL: &str = "/runtime-mnt/juicefs/default/data/juicefs-fuse";

    fn fuse(id: u32, parent: u32, dev: u32, root: &str, point: &str, group: u32) -> String {
        format!(
            "{id} {parent} 0:{dev} {root} {point} rw,nosuid,nodev,relatime shared:{group} - fuse.juicefs JuiceFS:data rw,user_id=0,group_id=0,allow_other\n"
        )
    }

    fn base() -> String {
        "1 0 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n".to_owned()
    }

    fn classify(table: &str) -> Classified {
        Classified::new(&Snapshot::parse(table.as_bytes()).unwrap(), &Layout::new(Path::new(KUBELET)))
    }

    fn healthy() -> String {
        base()
            + &fuse(10, 1, 50, "/", GLOBAL, 7)
            + &fuse(11, 1, 50, "/", POD_A, 7)
            + &fuse(12, 1, 50, "/", POD_B, 7)
            + &fuse(13, 1, 50, "/sub", SUB, 7)
    }

    /// The daemon restarted: the old global is gone, a new one (device 51)
    /// is in its place, the pod binds are still on device 50.
    fn replaced() -> String {
        base()
            + &fuse(11, 1, 50, "/", POD_A, 7)
            + &fuse(12, 1, 50, "/", POD_B, 7)
            + &fuse(13, 1, 50, "/sub", SUB, 7)
            + &fuse(20, 1, 51, "/", GLOBAL, 9)
    }

    fn learned() -> Journal {
        let mut journal = Journal::in_memory();
        assert!(learn(&classify(&healthy()), &Layout::new(Path::new(KUBELET)), &mut journal));
        journal
    }

    #[test]
    fn a_target_published_while_the_source_is_gone_is_learned_from_its_mapped_peers() {
        const POD_D: &str = "/var/lib/kubelet/pods/dddd/volumes/kubernetes.io~csi/data/mount";
        const SUB_E: &str = "/var/lib/kubelet/pods/eeee/volume-subpaths/data/app/0";
        let mut journal = learned();
        // The dead source detached; two new binds of the dead connection.
        let outage = base()
            + &fuse(11, 1, 50, "/", POD_A, 7)
            + &fuse(13, 1, 50, "/sub", SUB, 7)
            + &fuse(14, 1, 50, "/", POD_D, 7)
            + &fuse(15, 1, 50, "/sub/deeper", SUB_E, 7);
        assert!(learn(&classify(&outage), &Layout::new(Path::new(KUBELET)), &mut journal));
        let pod_d = journal.get(Path::new(POD_D)).unwrap();
        assert_eq!((pod_d.source.as_path(), pod_d.root_in_source.as_path()), (Path::new(GLOBAL), Path::new("")));
        assert_eq!((pod_d.dev, pod_d.pod_uid.as_str()), (Dev { major: 0, minor: 50 }, "dddd"));
        let sub_e = journal.get(Path::new(SUB_E)).unwrap();
        assert_eq!(sub_e.root_in_source, Path::new("sub/deeper"));
        assert_eq!(sub_e.kind, TargetKind::Subpath);
        // Then healed with the others once the new mount is there.
        let back = outage + &fuse(20, 1, 51, "/", GLOBAL, 9);
        let batches = plan(&classify(&back), &journal, &BTreeSet::new());
        let planned: BTreeSet<&Path> = batches[0].targets.iter().map(|target| target.path.as_path()).collect();
        assert!(planned.contains(Path::new(POD_D)) && planned.contains(Path::new(SUB_E)), "{planned:?}");
    }

    #[test]
    fn learns_each_target_from_its_peer_group() {
        let journal = learned();
        let sub = journal.get(Path::new(SUB)).unwrap();
        assert_eq!(sub.source, Path::new(GLOBAL));
        assert_eq!(sub.root_in_source, Path::new("sub"));
        assert_eq!(sub.kind, TargetKind::Subpath);
        assert_eq!(journal.get(Path::new(POD_A)).unwrap().root_in_source, Path::new(""));
        assert!(plan(&classify(&healthy()), &journal, &BTreeSet::new()).is_empty());
    }

    #[test]
    fn a_replaced_source_plans_whole_volumes_before_subpaths() {
        let journal = learned();
        let classified = classify(&replaced());
        for target in classified.targets.values() {
            let mapping = journal.get(&target.stack.path);
            assert_eq!(assess(target, mapping, &classified), Assessment::Broken);
        }
        let batches = plan(&classified, &journal, &BTreeSet::new());
        assert_eq!(batches.len(), 1);
        assert_eq!(batches[0].source.top().mount_id, 20);
        let order: Vec<&Path> = batches[0].targets.iter().map(|t| t.path.as_path()).collect();
        assert_eq!(order, [Path::new(POD_A), Path::new(POD_B), Path::new(SUB)]);
        assert_eq!(batches[0].targets[2].root_in_source, Path::new("sub"));
    }

    #[test]
    fn nothing_is_planned_while_the_source_is_down() {
        let journal = learned();
        let down = base() + &fuse(11, 1, 50, "/", POD_A, 7);
        let classified = classify(&down);
        let target = &classified.targets[Path::new(POD_A)];
        assert_eq!(assess(target, journal.get(Path::new(POD_A)), &classified), Assessment::SourceDown);
        assert!(plan(&classified, &journal, &BTreeSet::new()).is_empty());
    }

    #[test]
    fn a_mount_over_the_stale_source_is_healthy_with_stale_layers() {
        let journal = learned();
        // The new global (51) was mounted over the old one; the kernel
        // stacked copies over the whole-volume targets, not the subPath.
        let table = healthy()
            + &fuse(20, 10, 51, "/", GLOBAL, 9)
            + &fuse(21, 11, 51, "/", POD_A, 9)
            + &fuse(22, 12, 51, "/", POD_B, 9);
        let classified = classify(&table);
        let assessment =
            |path: &str| assess(&classified.targets[Path::new(path)], journal.get(Path::new(path)), &classified);
        assert_eq!(assessment(POD_A), Assessment::StaleLayers);
        assert_eq!(assessment(SUB), Assessment::Broken);
        let batches = plan(&classified, &journal, &BTreeSet::new());
        assert_eq!(batches[0].targets.len(), 1);
        assert_eq!(batches[0].targets[0].path, Path::new(SUB));
    }

    const STAGING: &str = "/var/lib/kubelet/plugins/kubernetes.io/csi/csi.juicefs.com/0a1b/globalmount";
    const EXTRA: &str = "/var/lib/juicefs/volume/data";

    /// The daemon's mount, a CSI staging bind of it and a second path
    /// outside the kubelet tree (on a reused, lower mount ID: only its place
    /// in the table says it came later), then the pods (bound from the
    /// staging path).
    fn staged() -> String {
        base()
            + &fuse(10, 1, 50, "/", GLOBAL, 7)
            + &fuse(14, 1, 50, "/", STAGING, 7)
            + &fuse(5, 1, 50, "/", EXTRA, 7)
            + &fuse(11, 1, 50, "/", POD_A, 7)
            + &fuse(13, 1, 50, "/sub", SUB, 7)
    }

    fn classify_with(table: &str, journal: &mut Journal) -> Classified {
        let layout = Layout::new(Path::new(KUBELET));
        let mut classified = classify(table);
        separate_source_binds(&mut classified, &layout, journal);
        learn(&classified, &layout, journal);
        classified
    }

    #[test]
    fn binds_of_a_source_outside_the_pods_are_healed_with_its_targets_never_taken_for_it() {
        let mut journal = Journal::in_memory();
        let classified = classify_with(&staged(), &mut journal);
        assert_eq!(classified.sources.keys().collect::<Vec<_>>(), [Path::new(GLOBAL)]);
        for path in [STAGING, EXTRA, POD_A, SUB] {
            assert_eq!(journal.get(Path::new(path)).unwrap().source, Path::new(GLOBAL), "{path}");
        }
        assert_eq!(classified.targets[Path::new(STAGING)].kind, TargetKind::SourceBind);

        // The daemon unmounted its dead mount and mounted anew: the binds
        // stay on the dead connection, alone in its peer group.
        let crashed = staged().replace(&fuse(10, 1, 50, "/", GLOBAL, 7), "") + &fuse(20, 1, 51, "/", GLOBAL, 9);
        let classified = classify_with(&crashed, &mut journal);
        for path in [STAGING, EXTRA, POD_A, SUB] {
            let target = &classified.targets[Path::new(path)];
            assert_eq!(journal.get(Path::new(path)).unwrap().source, Path::new(GLOBAL), "{path}");
            assert_eq!(assess(target, journal.get(Path::new(path)), &classified), Assessment::Broken, "{path}");
        }
        let batches = plan(&classified, &journal, &BTreeSet::new());
        let order: Vec<&Path> = batches[0].targets.iter().map(|t| t.path.as_path()).collect();
        assert_eq!(order, [Path::new(EXTRA), Path::new(STAGING), Path::new(POD_A), Path::new(SUB)]);

        // A bind that is unmounted is forgotten.
        let unstaged = crashed.replace(&fuse(14, 1, 50, "/", STAGING, 7), "");
        classify_with(&unstaged, &mut journal);
        assert!(journal.get(Path::new(STAGING)).is_none());
        assert!(journal.get(Path::new(EXTRA)).is_some());
    }

    #[test]
    fn targets_never_seen_with_a_source_are_not_ours() {
        let table = base() + &fuse(11, 1, 50, "/", POD_A, 7);
        let classified = classify(&table);
        let target = &classified.targets[Path::new(POD_A)];
        assert_eq!(assess(target, None, &classified), Assessment::Unmanaged);
        assert!(plan(&classified, &Journal::in_memory(), &BTreeSet::new()).is_empty());
    }
}
