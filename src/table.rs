//! The FUSE part of a mount table, classified into sources and pod targets.
//!
//! A snapshot owns only what the heal logic needs (the FUSE mounts), so the
//! parser can stay zero-copy over its reused buffer.
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::mountinfo::{self, ParseError};

/// A `major:minor` device number; every FUSE connection has its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Dev {
    pub major: u32,
    pub minor: u32,
}

impl fmt::Display for Dev {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

/// One FUSE mount, owned.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FuseMount {
    pub mount_id: u32,
    pub parent_id: u32,
    pub dev: Dev,
    /// Path of the mount's root inside its filesystem (`/` for a whole mount).
    pub root: PathBuf,
    pub mount_point: PathBuf,
    pub peer_group: Option<u32>,
    pub master: Option<u32>,
    pub fs_type: String,
    pub source: String,
}

/// All FUSE mounts of one table, in table order, plus the table's size.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub fuse_mounts: Vec<FuseMount>,
    /// Every mount of the table, FUSE or not.
    pub total_mounts: usize,
}

impl Snapshot {
    /// Parses a mountinfo table, keeping the FUSE mounts.
    pub fn parse(table: &[u8]) -> Result<Self, ParseError> {
        let mut snapshot = Snapshot::default();
        let mut seen = std::collections::HashSet::new();
        for entry in mountinfo::parse_lines(table) {
            let entry = entry?;
            if !seen.insert(entry.mount_id) {
                // A non-atomic read can list a mount twice; keep the last one.
                snapshot.fuse_mounts.retain(|m| m.mount_id != entry.mount_id);
            } else {
                snapshot.total_mounts += 1;
            }
            if entry.is_fuse() {
                snapshot.fuse_mounts.push(FuseMount {
                    mount_id: entry.mount_id,
                    parent_id: entry.parent_id,
                    dev: Dev { major: entry.major, minor: entry.minor },
                    root: entry.root.to_path().into_owned(),
                    mount_point: entry.mount_point.to_path().into_owned(),
                    peer_group: entry.propagation.shared,
                    master: entry.propagation.master,
                    fs_type: entry.fs_type.to_owned(),
                    source: String::from_utf8_lossy(&entry.source.unescaped()).into_owned(),
                });
            }
        }
        Ok(snapshot)
    }
}

/// Where a pod target sits in the kubelet tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TargetKind {
    /// `pods/<uid>/volumes/**`: the whole volume.
    Volume,
    /// `pods/<uid>/volume-subpaths/**`: one subdirectory of a volume.
    Subpath,
}

/// What a mount point is to the supervisor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    Source,
    Target {
        pod_uid: String,
        kind: TargetKind,
    },
    /// Under the pods directory but not a volume of a pod.
    Other,
}

/// The kubelet tree's shape.
#[derive(Clone, Debug)]
pub struct Layout {
    kubelet_root: PathBuf,
    pods_dir: PathBuf,
}

impl Layout {
    pub fn new(kubelet_root: &Path) -> Self {
        Layout { kubelet_root: kubelet_root.to_path_buf(), pods_dir: kubelet_root.join("pods") }
    }

    pub fn pods_dir(&self) -> &Path {
        &self.pods_dir
    }

    pub fn role(&self, mount_point: &Path) -> Role {
        let Ok(rest) = mount_point.strip_prefix(&self.pods_dir) else {
            return Role::Source;
        };
        let mut parts = rest.components();
        let (Some(Component::Normal(uid)), Some(Component::Normal(dir)), Some(_)) =
            (parts.next(), parts.next(), parts.next())
        else {
            return Role::Other;
        };
        let kind = match dir.to_str() {
            Some("volumes") => TargetKind::Volume,
            Some("volume-subpaths") => TargetKind::Subpath,
            _ => return Role::Other,
        };
        Role::Target { pod_uid: uid.to_string_lossy().into_owned(), kind }
    }
}

/// The mounts stacked at one path, bottom first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stack {
    pub path: PathBuf,
    pub layers: Vec<FuseMount>,
}

impl Stack {
    pub fn top(&self) -> &FuseMount {
        // A stack is only built from at least one mount.
        &self.layers[self.layers.len() - 1]
    }

    /// Layers under the top that are on another connection than the top.
    pub fn stale_layers(&self) -> impl Iterator<Item = &FuseMount> {
        let top = self.top().dev;
        self.layers[..self.layers.len() - 1].iter().filter(move |m| m.dev != top)
    }
}

/// A pod target: its stack and where it sits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub stack: Stack,
    pub pod_uid: String,
    pub kind: TargetKind,
}

/// A snapshot split into sources and targets, each keyed by path.
#[derive(Clone, Debug, Default)]
pub struct Classified {
    pub sources: BTreeMap<PathBuf, Stack>,
    pub targets: BTreeMap<PathBuf, Target>,
    pub total_mounts: usize,
}

impl Classified {
    pub fn new(snapshot: &Snapshot, layout: &Layout) -> Self {
        let mut classified = Classified { total_mounts: snapshot.total_mounts, ..Default::default() };
        for (path, stack) in stacks(&snapshot.fuse_mounts) {
            match layout.role(&path) {
                Role::Source => {
                    classified.sources.insert(path, stack);
                }
                Role::Target { pod_uid, kind } => {
                    classified.targets.insert(path, Target { stack, pod_uid, kind });
                }
                Role::Other => {}
            }
        }
        // Kubelet never mounts inside a volume, and a global mount is never
        // a subdirectory bind inside another: such mounts are copies that a
        // subPath heal's propagation left under covered stale layers.
        // Paths sort component by component, so a mount's descendants
        // follow it directly: one pass finds them.
        let mut nested_targets = Vec::new();
        let mut outermost: Option<&Path> = None;
        for path in classified.targets.keys() {
            match outermost {
                Some(above) if path.starts_with(above) => nested_targets.push(path.clone()),
                _ => outermost = Some(path),
            }
        }
        for path in nested_targets {
            classified.targets.remove(&path);
        }
        let nested_sources: Vec<PathBuf> = classified
            .sources
            .iter()
            .filter(|(path, stack)| {
                stack.top().root != Path::new("/")
                    && path.ancestors().skip(1).any(|above| classified.sources.contains_key(above))
            })
            .map(|(path, _)| path.clone())
            .collect();
        for path in nested_sources {
            classified.sources.remove(&path);
        }
        classified
    }

    /// The source a healthy target shares its peer group with. When a
    /// group has several sources (a CSI staging bind of a runtime mount),
    /// the one outside the kubelet tree is the real global mount.
    pub fn source_of_peer(&self, target: &Target, layout: &Layout) -> Option<&Stack> {
        let group = target.stack.top().peer_group?;
        self.sources
            .values()
            .filter(|source| source.top().peer_group == Some(group))
            .min_by_key(|source| (source.path.starts_with(&layout.kubelet_root), source.top().mount_id))
    }
}

/// Groups mounts by mount point and orders each group bottom to top by
/// following parent IDs (a mount stacked on another has it as parent).
fn stacks(mounts: &[FuseMount]) -> BTreeMap<PathBuf, Stack> {
    let mut by_path: BTreeMap<&Path, Vec<&FuseMount>> = BTreeMap::new();
    for mount in mounts {
        by_path.entry(&mount.mount_point).or_default().push(mount);
    }
    by_path
        .into_iter()
        .map(|(path, group)| {
            let ids: std::collections::HashSet<u32> = group.iter().map(|m| m.mount_id).collect();
            let mut layers = Vec::with_capacity(group.len());
            let mut current = group.iter().find(|m| !ids.contains(&m.parent_id)).copied();
            while let Some(mount) = current {
                layers.push(mount.clone());
                current = group.iter().find(|m| m.parent_id == mount.mount_id).copied();
                if layers.len() > group.len() {
                    break; // IDs reused within one inconsistent read: never loop.
                }
            }
            // Whatever the chain did not reach (a non-FUSE mount between
            // layers) still belongs to the path: keep it, in table order.
            for mount in &group {
                if !layers.iter().any(|l| l.mount_id == mount.mount_id) {
                    layers.push((*mount).clone());
                }
            }
            (path.to_path_buf(), Stack { path: path.to_path_buf(), layers })
        })
        .collect()
}

/// `target_root` relative to `source_root`: where inside the source a
/// target's root lies (`sub` for a subPath of `sub`), if it lies inside.
pub fn root_within(source_root: &Path, target_root: &Path) -> Option<PathBuf> {
    target_root.strip_prefix(source_root).ok().map(Path::to_path_buf)
}
