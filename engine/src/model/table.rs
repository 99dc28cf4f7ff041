//! The FUSE part of a mount table, classified into sources and pod targets.
//!
//! A snapshot owns only what the heal logic needs (the FUSE mounts), so the
//! parser can stay zero-copy over its reused buffer.
use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::model::mountinfo::{self, ParseError};
use crate::model::path_map::SortedPathMap;

/// A `major:minor` device number; every FUSE connection has its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Dev {
    pub major: u32,
    pub minor: u32,
}

/// From `(major, minor)`, as `statx` and `statmount` give it.
impl From<(u32, u32)> for Dev {
    fn from((major, minor): (u32, u32)) -> Self {
        Dev { major, minor }
    }
}

impl fmt::Display for Dev {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Padded as a whole, for `status`'s columns.
        f.pad(&format!("{}:{}", self.major, self.minor))
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
    /// The mount's place in the table. The kernel lists a namespace's
    /// mounts in the order they were made (by unique mount ID, from Linux
    /// 6.8; by attachment before), so a bind comes after what it binds,
    /// which the 32-bit mount ID does not tell: it is reused.
    #[serde(default)]
    pub table_order: u32,
}

/// All FUSE mounts of one table, in table order, plus the table's size.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub fuse_mounts: Vec<FuseMount>,
    /// Every mount of the table, FUSE or not.
    pub total_mounts: usize,
}

impl Snapshot {
    /// Parses a mountinfo table, keeping the FUSE mounts; refuses a table
    /// with a malformed line.
    pub fn parse(table: &[u8]) -> Result<Self, ParseError> {
        let kept = mountinfo::parse_table_with(table, fuse_mount_of())?;
        Ok(Snapshot { fuse_mounts: kept.items, total_mounts: kept.total_mounts })
    }

    /// [`Snapshot::parse`], and whether any mount of the table, FUSE or not,
    /// receives mounts by propagation (a peer, `shared:`, or a slave,
    /// `master:`): only such a namespace can be given a mount it did not
    /// make itself.
    pub fn parse_receiving(table: &[u8]) -> Result<(Self, bool), ParseError> {
        let mut receives = false;
        let mut fuse_mount = fuse_mount_of();
        let kept = mountinfo::parse_table_with(table, |entry| {
            receives |= entry.propagation.shared.is_some() || entry.propagation.master.is_some();
            fuse_mount(entry)
        })?;
        Ok((Snapshot { fuse_mounts: kept.items, total_mounts: kept.total_mounts }, receives))
    }

    /// Parses a mountinfo table, keeping the FUSE mounts of every
    /// well-formed line; the malformed lines' errors come with it.
    pub fn parse_lenient(table: &[u8]) -> (Self, Vec<ParseError>) {
        let kept = mountinfo::parse_table_lenient_with(table, fuse_mount_of());
        (Snapshot { fuse_mounts: kept.items, total_mounts: kept.total_mounts }, kept.malformed)
    }
}

/// What a snapshot keeps of a line: a FUSE mount, numbered in table order
/// (the well-formed lines counted).
fn fuse_mount_of() -> impl FnMut(&mountinfo::MountInfo<'_>) -> Option<FuseMount> {
    let mut table_order = 0;
    move |entry| {
        table_order += 1;
        entry.is_fuse().then(|| FuseMount::of_line(entry, table_order))
    }
}

impl FuseMount {
    /// What a FUSE mount's line says; `table_order` is its place.
    pub(crate) fn of_line(entry: &mountinfo::MountInfo<'_>, table_order: u32) -> FuseMount {
        FuseMount {
            mount_id: entry.mount_id,
            parent_id: entry.parent_id,
            dev: Dev { major: entry.major, minor: entry.minor },
            root: entry.root.to_path().into_owned(),
            mount_point: entry.mount_point.to_path().into_owned(),
            peer_group: entry.propagation.shared,
            master: entry.propagation.master,
            fs_type: entry.fs_type.to_owned(),
            source: String::from_utf8_lossy(&entry.source.unescaped()).into_owned(),
            table_order,
        }
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
    /// A bind of a global mount outside the pods directory: a CSI staging
    /// `globalmount`, a driver's second path, an operator's bind. It belongs
    /// to no pod; the kubelet binds new pods from it, so it is healed too.
    SourceBind,
}

impl TargetKind {
    pub fn name(self) -> &'static str {
        match self {
            TargetKind::Volume => "volume",
            TargetKind::Subpath => "subpath",
            TargetKind::SourceBind => "source-bind",
        }
    }
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
    /// Sidecar mode: only this pod's volumes are targets.
    only_pod: Option<String>,
    /// Pod volume paths where a CSI driver without a staging step mounts
    /// its FUSE filesystem itself (the CSI proxy's publish records): each
    /// is a source, whose daemon is watched and whose copies in containers
    /// are healed from its next mount, not a bind of one.
    driver_mounted: BTreeSet<PathBuf>,
}

impl Layout {
    pub fn new(kubelet_root: &Path) -> Self {
        Layout {
            kubelet_root: kubelet_root.to_path_buf(),
            pods_dir: kubelet_root.join("pods"),
            only_pod: None,
            driver_mounted: BTreeSet::new(),
        }
    }

    /// The pod volume paths a CSI driver mounts itself (see the field);
    /// returns whether the set changed.
    pub fn set_driver_mounted(&mut self, paths: BTreeSet<PathBuf>) -> bool {
        let changed = self.driver_mounted != paths;
        self.driver_mounted = paths;
        changed
    }

    /// Whether a CSI driver mounts its FUSE filesystem itself at `path`.
    pub fn is_driver_mounted(&self, path: &Path) -> bool {
        !self.driver_mounted.is_empty() && self.driver_mounted.contains(path)
    }

    /// With `Some(uid)`, other pods' volumes are not targets (they are
    /// [`Role::Other`]): nothing of theirs is planned or healed.
    pub fn with_pod_scope(mut self, uid: Option<&str>) -> Self {
        self.only_pod = uid.map(str::to_owned);
        self
    }

    pub fn pods_dir(&self) -> &Path {
        &self.pods_dir
    }

    /// Of several sources in one peer group, the lowest is the daemon's own
    /// mount and the others are binds of it: outside the kubelet tree comes
    /// first (a CSI staging bind is inside), then the oldest (a bind is made
    /// after what it binds).
    pub fn source_precedence(&self, source: &Stack) -> (bool, u32) {
        (source.path.starts_with(&self.kubelet_root), source.top().table_order)
    }

    pub fn role(&self, mount_point: &Path) -> Role {
        let Ok(rest) = mount_point.strip_prefix(&self.pods_dir) else {
            return Role::Source;
        };
        if self.is_driver_mounted(mount_point) {
            return Role::Source;
        }
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
        if self.only_pod.as_deref().is_some_and(|only| uid.to_str() != Some(only)) {
            return Role::Other;
        }
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
    /// In path order, found by path without comparing paths.
    pub targets: SortedPathMap<Target>,
    pub total_mounts: usize,
}

impl Classified {
    /// Classifies a snapshot's FUSE mounts (copied; see [`Classified::from_snapshot`]).
    pub fn new(snapshot: &Snapshot, layout: &Layout) -> Self {
        Self::from_mounts(snapshot.fuse_mounts.clone(), snapshot.total_mounts, layout)
    }

    /// Classifies a snapshot's FUSE mounts, moving them: what the loop does
    /// on every table change (a copy would double the peak memory).
    pub fn from_snapshot(snapshot: Snapshot, layout: &Layout) -> Self {
        Self::from_mounts(snapshot.fuse_mounts, snapshot.total_mounts, layout)
    }

    fn from_mounts(mounts: Vec<FuseMount>, total_mounts: usize, layout: &Layout) -> Self {
        let mut sources = Vec::new();
        let mut targets = Vec::new();
        for stack in stacks(mounts) {
            match layout.role(&stack.path) {
                Role::Source => sources.push((stack.path.clone(), stack)),
                Role::Target { pod_uid, kind } => targets.push((stack.path.clone(), Target { stack, pod_uid, kind })),
                Role::Other => {}
            }
        }
        // Kubelet never mounts inside a volume, and a global mount is never
        // a subdirectory bind inside another: such mounts are copies that a
        // subPath heal's propagation left under covered stale layers.
        // In path order a mount's descendants follow it directly: one pass
        // finds them.
        let mut outermost: Option<PathBuf> = None;
        targets.retain(|(path, _)| match &outermost {
            Some(above) if is_beneath(path, above) => false,
            _ => {
                outermost = Some(path.clone());
                true
            }
        });
        let nested_sources: Vec<bool> = sources
            .iter()
            .map(|(path, stack)| {
                stack.top().root != Path::new("/")
                    && path
                        .ancestors()
                        .skip(1)
                        .any(|above| sources.binary_search_by(|(other, _)| path_order(other, above)).is_ok())
            })
            .collect();
        let mut nested = nested_sources.into_iter();
        sources.retain(|_| !nested.next().unwrap_or(false));
        // Both are in path order already: the maps are built without
        // comparing paths again, with full nodes.
        Classified { sources: sources.into_iter().collect(), targets: targets.into_iter().collect(), total_mounts }
    }

    /// The source a healthy target shares its peer group with: of several
    /// (binds of it outside the pods not yet known as such), the first by
    /// [`Layout::source_precedence`].
    pub fn source_of_peer(&self, target: &Target, layout: &Layout) -> Option<&Stack> {
        let group = target.stack.top().peer_group?;
        self.sources
            .values()
            .filter(|source| source.top().peer_group == Some(group))
            .min_by_key(|source| layout.source_precedence(source))
    }

    /// Moves the source stacks at `binds` among the targets, as binds of
    /// no pod.
    pub fn move_to_targets(&mut self, binds: &[PathBuf]) {
        for path in binds {
            if let Some(stack) = self.sources.remove(path) {
                let bind = Target { stack, pod_uid: String::new(), kind: TargetKind::SourceBind };
                self.targets.insert(path.clone(), bind);
            }
        }
    }
}

/// The order of `Path` (component by component) for the paths the kernel
/// prints (absolute, without `.`, `..`, repeated or trailing slashes), found
/// from the bytes: the separator sorts before every other byte. Several
/// times faster than comparing components.
pub fn path_order(a: &Path, b: &Path) -> Ordering {
    let (a, b) = (a.as_os_str().as_bytes(), b.as_os_str().as_bytes());
    // Eight bytes at a time to the first difference: paths under the pods
    // directory share long prefixes.
    let words = a.chunks_exact(8).zip(b.chunks_exact(8)).take_while(|(x, y)| x == y).count() * 8;
    let common = words + a[words..].iter().zip(&b[words..]).take_while(|(x, y)| x == y).count();
    let rank = |byte: Option<&u8>| byte.map(|&byte| (byte != b'/', byte));
    rank(a.get(common)).cmp(&rank(b.get(common)))
}

/// `path` is `above` or lies beneath it; like `Path::starts_with` for the
/// paths the kernel prints, on the bytes.
fn is_beneath(path: &Path, above: &Path) -> bool {
    let (path, above) = (path.as_os_str().as_bytes(), above.as_os_str().as_bytes());
    path.strip_prefix(above).is_some_and(|rest| rest.is_empty() || rest[0] == b'/' || above.ends_with(b"/"))
}

/// Groups mounts by mount point, in path order, and orders each group
/// bottom to top by following parent IDs (a mount stacked on another has it
/// as parent).
fn stacks(mut mounts: Vec<FuseMount>) -> Vec<Stack> {
    // Stable: mounts at one path stay in table order.
    mounts.sort_by(|a, b| path_order(&a.mount_point, &b.mount_point));
    let mut stacks = Vec::new();
    let mut mounts = mounts.into_iter().peekable();
    while let Some(first) = mounts.next() {
        let path = first.mount_point.clone();
        let mut group = vec![first];
        // The kernel's paths: the same bytes exactly when the same path
        // (comparing components was a fifth of a table read).
        while let Some(next) = mounts.next_if(|mount| mount.mount_point.as_os_str() == path.as_os_str()) {
            group.push(next);
        }
        stacks.push(Stack { path, layers: chain(group) });
    }
    stacks
}

/// Orders the mounts at one path bottom to top.
fn chain(group: Vec<FuseMount>) -> Vec<FuseMount> {
    if group.len() == 1 {
        return group;
    }
    let mut order = Vec::with_capacity(group.len());
    let mut current = group.iter().position(|m| !group.iter().any(|other| other.mount_id == m.parent_id));
    while let Some(index) = current {
        order.push(index);
        if order.len() > group.len() {
            break; // IDs reused within one inconsistent read: never loop.
        }
        current = group.iter().position(|m| m.parent_id == group[index].mount_id);
    }
    order.truncate(group.len());
    // Whatever the chain did not reach (a non-FUSE mount between layers)
    // still belongs to the path: keep it, in table order.
    let mut placed = vec![false; group.len()];
    for &index in &order {
        placed[index] = true;
    }
    order.extend((0..group.len()).filter(|&index| !placed[index]));
    let mut slots: Vec<Option<FuseMount>> = group.into_iter().map(Some).collect();
    order.into_iter().filter_map(|index| slots[index].take()).collect()
}

/// `target_root` relative to `source_root`: where inside the source a
/// target's root lies (`sub` for a subPath of `sub`), if it lies inside.
pub fn root_within(source_root: &Path, target_root: &Path) -> Option<PathBuf> {
    target_root.strip_prefix(source_root).ok().map(Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_line_leaves_out_its_own_mount_only() {
        let table = b"91 90 0:46 / /g rw shared:2 - fuse.bindfs bindfs rw\n\
92 90 0:46 / /pods/a/mount rw shared:2 - fuse.bindfs bindfs rw\n\
93 90 0:46 / pods/b/mount rw shared:2 - fuse.bindfs bindfs rw\n\
94 90 0:46 / /pods/c/mount rw shared:2 - fuse.bindfs bindfs rw\n";
        let err = Snapshot::parse(table).unwrap_err();
        assert_eq!(
            err.to_string(),
            "mountinfo line 3, column 14: field `mount point`: relative path `pods/b/mount`, the kernel prints mount points from `/`"
        );
        let (snapshot, malformed) = Snapshot::parse_lenient(table);
        let kept: Vec<u32> = snapshot.fuse_mounts.iter().map(|mount| mount.mount_id).collect();
        assert_eq!((kept, snapshot.total_mounts), (vec![91, 92, 94], 3));
        assert_eq!(malformed, [err]);
    }

    const PATHS: &[&str] = &[
        "/",
        "/a",
        "/a/b",
        "/a-b",
        "/a b",
        "/a.b",
        "/a/b/c",
        "/a/bc",
        "/ab",
        "/a\n/b",
        "/var/lib/kubelet/pods/u/volumes/x/mount",
        "/var/lib/kubelet/pods/u/volumes/x/mount/inner",
        "/var/lib/kubelet/pods/u/volumes/x/mount-2",
        "/var/lib/kubelet/pods/u/volume-subpaths/x/app/0",
        "/\u{e9}",
    ];

    #[test]
    fn path_order_is_the_order_of_paths() {
        for a in PATHS {
            for b in PATHS {
                let (a, b) = (Path::new(a), Path::new(b));
                assert_eq!(path_order(a, b), a.cmp(b), "{a:?} {b:?}");
                assert_eq!(is_beneath(a, b), a.starts_with(b), "{a:?} beneath {b:?}");
            }
        }
    }

    fn fuse(id: u32, parent: u32, minor: u32, point: &str) -> FuseMount {
        FuseMount {
            mount_id: id,
            parent_id: parent,
            dev: Dev { major: 0, minor },
            root: PathBuf::from("/"),
            mount_point: PathBuf::from(point),
            peer_group: None,
            master: None,
            fs_type: "fuse.x".into(),
            source: "x".into(),
            table_order: id,
        }
    }

    #[test]
    fn stacks_group_by_path_and_order_bottom_to_top() {
        let mounts = vec![
            fuse(30, 20, 3, "/b"),
            fuse(10, 1, 1, "/b"),
            fuse(11, 1, 1, "/a"),
            fuse(20, 10, 2, "/b"),
            // Parent not at the path (a non-FUSE layer between): kept, last.
            fuse(40, 99, 4, "/a"),
        ];
        let stacks = stacks(mounts);
        let shape: Vec<(&Path, Vec<u32>)> =
            stacks.iter().map(|s| (s.path.as_path(), s.layers.iter().map(|m| m.mount_id).collect())).collect();
        assert_eq!(shape, [(Path::new("/a"), vec![11, 40]), (Path::new("/b"), vec![10, 20, 30])]);
    }

    #[test]
    fn a_parent_cycle_from_reused_ids_ends() {
        let layers = chain(vec![fuse(1, 2, 1, "/a"), fuse(2, 1, 2, "/a")]);
        assert_eq!(layers.len(), 2);
    }

    #[test]
    fn nested_targets_are_dropped_and_the_copy_matches_new() {
        let pod = "/k/pods/u/volumes/kubernetes.io~csi/v/mount";
        let snapshot = Snapshot {
            fuse_mounts: vec![fuse(10, 1, 1, "/g"), fuse(11, 1, 1, pod), fuse(12, 11, 1, &format!("{pod}/sub"))],
            total_mounts: 4,
        };
        let layout = Layout::new(Path::new("/k"));
        let classified = Classified::new(&snapshot, &layout);
        assert_eq!(classified.targets.keys().collect::<Vec<_>>(), [Path::new(pod)]);
        assert_eq!(classified.sources.keys().collect::<Vec<_>>(), [Path::new("/g")]);
        let moved = Classified::from_snapshot(snapshot, &layout);
        assert_eq!(moved.targets, classified.targets);
        assert_eq!(moved.sources, classified.sources);
        assert_eq!(moved.total_mounts, 4);
    }

    #[test]
    fn a_pod_scope_leaves_other_pods_volumes_alone() {
        let layout = Layout::new(Path::new("/k")).with_pod_scope(Some("mine"));
        let role = layout.role(Path::new("/k/pods/mine/volumes/kubernetes.io~csi/v/mount"));
        assert_eq!(role, Role::Target { pod_uid: "mine".into(), kind: TargetKind::Volume });
        assert_eq!(layout.role(Path::new("/k/pods/other/volumes/kubernetes.io~csi/v/mount")), Role::Other);
        assert_eq!(layout.role(Path::new("/k/pods/other/volume-subpaths/v/c/0")), Role::Other);
        assert_eq!(layout.role(Path::new("/runtime/x")), Role::Source);
    }

    #[test]
    fn a_target_the_driver_mounts_itself_is_a_source_and_its_subpath_binds_are_targets() {
        let pod = "/k/pods/u/volumes/kubernetes.io~csi/v/mount";
        let subpath = "/k/pods/u/volume-subpaths/v/app/0";
        let mut bind = fuse(12, 1, 1, subpath);
        bind.root = PathBuf::from("/sub");
        let snapshot = Snapshot { fuse_mounts: vec![fuse(11, 1, 1, pod), bind], total_mounts: 3 };
        let mut layout = Layout::new(Path::new("/k"));
        assert!(!layout.set_driver_mounted(BTreeSet::new()), "no change");
        assert_eq!(Classified::new(&snapshot, &layout).sources.len(), 0);
        assert!(layout.set_driver_mounted(BTreeSet::from([PathBuf::from(pod)])));
        assert!(layout.is_driver_mounted(Path::new(pod)) && !layout.is_driver_mounted(Path::new(subpath)));
        let classified = Classified::new(&snapshot, &layout);
        assert_eq!(classified.sources.keys().collect::<Vec<_>>(), [Path::new(pod)]);
        assert_eq!(classified.targets.keys().collect::<Vec<_>>(), [Path::new(subpath)]);
    }
}
