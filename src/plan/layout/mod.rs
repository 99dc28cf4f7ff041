//! Where a target's source (global mount) is when no healthy observation
//! taught it: a supervisor started after the crash knows a broken target
//! only by its path, its mountinfo root and its volume's `vol_data.json`.
//!
//! Layouts, tried in this order; the first that finds exactly one mounted
//! FUSE source wins:
//!
//! 1. user rules (`--layout-config`): a path template per CSI driver;
//! 2. CSI staging, kubelet >= 1.24:
//!    `<kubelet-root>/plugins/kubernetes.io/csi/<driver>/<hex sha256(volumeHandle)>/globalmount`
//!    (the kubelet's `makeDeviceMountPath`);
//! 3. CSI staging before 1.24:
//!    `<kubelet-root>/plugins/kubernetes.io/csi/pv/<PV name>/globalmount`;
//! 4. the JuiceFS CSI driver's mount pods, `<jfsMountDir>/<uniqueId>-<6 random
//!    characters>` (`<jfsMountDir>/<uniqueId>` before v0.21), with
//!    `jfsMountDir` = `/var/lib/juicefs/volume` by default and `uniqueId` the
//!    volumeHandle. Uncertain: with `STORAGE_CLASS_SHARE_MOUNT=true` the
//!    uniqueId of a dynamically provisioned PV is its StorageClass name,
//!    which the node cannot see: such volumes need a user rule or a learned
//!    mapping. The random suffix is only known from what is mounted;
//!    JuiceFS's own mount-point layout may change between releases;
//! 5. Fluid: `<mount-root>/<runtime>/<namespace>/<dataset>/<runtime…>-fuse`
//!    (e.g. `jindo/…/jindofs-fuse`) for PV `<namespace>-<dataset>`. Names
//!    may contain `-`, so the split is found among the mounted sources.
//!
//! Layouts only ever match sources that are mounted now (the caller passes
//! the FUSE sources of the table), so a computed path is never trusted on
//! its own, and two equally good matches give no answer rather than a guess.
use std::fmt;
use std::fs;
use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::model::table::{Stack, TargetKind, root_within};
use crate::watch::pods::{CSI_PLUGIN_DIR, LifecycleMode, VolData};

mod rules;

use rules::{UserRule, parse_rules};

pub const DEFAULT_FLUID_MOUNT_ROOT: &str = "/runtime-mnt";
pub const DEFAULT_JUICEFS_MOUNT_ROOT: &str = "/var/lib/juicefs/volume";
const JUICEFS_DRIVER: &str = "csi.juicefs.com";
const FLUID_DRIVER: &str = "fuse.csi.fluid.io";
/// The JuiceFS CSI driver appends `-` and 6 random characters of a pod name.
const JUICEFS_SUFFIX_LEN: usize = 6;

/// Which layout located a source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayoutName {
    UserRule { driver: String },
    CsiStaging,
    CsiStagingByPv,
    JuiceFs,
    Fluid,
}

impl fmt::Display for LayoutName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayoutName::UserRule { driver } => write!(f, "user rule for {driver}"),
            LayoutName::CsiStaging => f.write_str("csi-staging"),
            LayoutName::CsiStagingByPv => f.write_str("csi-staging-pv"),
            LayoutName::JuiceFs => f.write_str("juicefs"),
            LayoutName::Fluid => f.write_str("fluid"),
        }
    }
}

/// A mounted FUSE source: its path and its mountinfo root.
#[derive(Clone, Copy, Debug)]
pub struct SourceMount<'a> {
    pub path: &'a Path,
    pub root: &'a Path,
}

impl<'a> From<&'a Stack> for SourceMount<'a> {
    fn from(stack: &'a Stack) -> Self {
        SourceMount { path: &stack.path, root: &stack.top().root }
    }
}

/// What is known of a target without a learned mapping.
#[derive(Clone, Copy, Debug)]
pub struct TargetInfo<'a> {
    pub pod_uid: &'a str,
    /// `volumes/<plugin>/<volume>` (for a CSI PV: the PV name) or
    /// `volume-subpaths/<volume>/…` (the pod spec's volume name).
    pub volume: &'a str,
    pub kind: TargetKind,
    /// The volume plugin directory of a whole-volume target
    /// (`kubernetes.io~csi`, …); `None` for a subPath target.
    pub plugin: Option<&'a str>,
    /// The target's root in its filesystem (mountinfo field 4).
    pub root: &'a Path,
    /// The CSI volume's `vol_data.json`. For a subPath target the caller
    /// finds it through the pod's whole-volume target on the same device:
    /// subPath directories are named after the pod spec's volume, CSI ones
    /// after the PV.
    pub vol_data: Option<&'a VolData>,
}

impl<'a> TargetInfo<'a> {
    /// Reads pod, volume and kind from a target path under `pods_dir`:
    /// `<uid>/volumes/<plugin>/<volume>[/mount]` or
    /// `<uid>/volume-subpaths/<volume>/<container>/<index>`.
    pub fn from_path(pods_dir: &Path, path: &'a Path, root: &'a Path) -> Option<Self> {
        let mut parts = path.strip_prefix(pods_dir).ok()?.components().map(|part| match part {
            Component::Normal(name) => name.to_str(),
            _ => None,
        });
        let pod_uid = parts.next()??;
        let (kind, volume, plugin) = match parts.next()?? {
            "volumes" => {
                let plugin = parts.next()??;
                let volume = parts.next()??;
                match (plugin, parts.next()) {
                    (_, None) => (TargetKind::Volume, volume, Some(plugin)),
                    (CSI_PLUGIN_DIR, Some(Some("mount"))) if parts.next().is_none() => {
                        (TargetKind::Volume, volume, Some(plugin))
                    }
                    _ => return None,
                }
            }
            "volume-subpaths" => {
                let volume = parts.next()??;
                let (_container, _index) = (parts.next()??, parts.next()??);
                if parts.next().is_some() {
                    return None;
                }
                (TargetKind::Subpath, volume, None)
            }
            _ => return None,
        };
        Some(TargetInfo { pod_uid, volume, kind, plugin, root, vol_data: None })
    }

    pub fn with_vol_data(self, vol_data: Option<&'a VolData>) -> Self {
        TargetInfo { vol_data, ..self }
    }

    /// The PV name, when the target is a CSI PV volume.
    fn pv_name(&self) -> Option<&'a str> {
        match self.vol_data {
            Some(data) if data.lifecycle_mode == LifecycleMode::Persistent => Some(&data.spec_vol_id),
            Some(_) => None,
            None => self.csi_volume_dir(),
        }
    }

    /// Without `vol_data.json`, the name of a CSI whole-volume directory:
    /// the PV name. A subPath directory is named after the pod's volume.
    fn csi_volume_dir(&self) -> Option<&'a str> {
        (self.plugin == Some(CSI_PLUGIN_DIR)).then_some(self.volume)
    }

    /// The driver's unique ID of the volume, when it is a CSI PV volume.
    fn volume_handle(&self) -> Option<&'a str> {
        match self.vol_data {
            Some(data) if data.lifecycle_mode == LifecycleMode::Persistent => Some(&data.volume_handle),
            Some(_) => None,
            // Dynamically provisioned PVs use the PV name as handle.
            None => self.csi_volume_dir(),
        }
    }

    /// Whether a driver-specific layout applies: the driver is `driver`, or
    /// is unknown (no `vol_data.json`).
    fn may_be_driver(&self, driver: &str) -> bool {
        self.vol_data.is_none_or(|data| &*data.driver_name == driver)
    }
}

/// A source found by a layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocatedSource {
    pub path: PathBuf,
    /// The target's root relative to the source's root, as in
    /// [`crate::model::state::Mapping::root_in_source`]: empty for a target bound
    /// from the source's root.
    ///
    /// This holds because every bind of a FUSE filesystem, the global mount
    /// as well as pod and subPath binds, shows in mountinfo the path of its
    /// root *within that one filesystem* (field 4). A global mount has root
    /// `/`; the CSI bind of a whole volume has `/` or the directory the
    /// driver exposes (JuiceFS: the PV's subdirectory); the kubelet's bind of
    /// a subPath has that volume path plus the subPath. So the part of the
    /// target's root below the source's root is the directory of the source
    /// to bind, for every kind of target, and it stays valid on the new
    /// connection: the daemon serves the same tree again.
    pub root_in_source: PathBuf,
    pub layout: LayoutName,
}

#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("cannot read layout config {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("layout config {path} line {line}: {message}")]
    Syntax { path: PathBuf, line: usize, message: String },
    #[error("layout config {path} line {line}: rule for driver {driver}: {problem}")]
    Rule { path: PathBuf, line: usize, driver: String, problem: String },
}

/// All layouts of this node.
#[derive(Clone, Debug)]
pub struct SourceLayouts {
    kubelet_root: PathBuf,
    fluid_root: PathBuf,
    juicefs_root: PathBuf,
    rules: Vec<UserRule>,
}

impl SourceLayouts {
    /// The built-in layouts with their default roots, and no user rule.
    pub fn new(kubelet_root: &Path) -> Self {
        SourceLayouts {
            kubelet_root: kubelet_root.to_path_buf(),
            fluid_root: PathBuf::from(DEFAULT_FLUID_MOUNT_ROOT),
            juicefs_root: PathBuf::from(DEFAULT_JUICEFS_MOUNT_ROOT),
            rules: Vec::new(),
        }
    }

    pub fn with_fluid_mount_root(self, root: &Path) -> Self {
        SourceLayouts { fluid_root: root.to_path_buf(), ..self }
    }

    pub fn with_juicefs_mount_root(self, root: &Path) -> Self {
        SourceLayouts { juicefs_root: root.to_path_buf(), ..self }
    }

    /// Adds the rules of a TOML layout config (see `fixtures/layout-config/rules.toml`).
    pub fn with_rules_from(self, config: &Path) -> Result<Self, LayoutError> {
        let text =
            fs::read_to_string(config).map_err(|source| LayoutError::Read { path: config.to_path_buf(), source })?;
        self.with_rules(&text, config)
    }

    /// Adds the rules of a layout config's text; `config` names the file in
    /// errors.
    pub fn with_rules(self, text: &str, config: &Path) -> Result<Self, LayoutError> {
        Ok(SourceLayouts { rules: parse_rules(text, config)?, ..self })
    }

    /// The one mounted source the first applicable layout finds for
    /// `target`, or `None`: no layout finds one, or the first that finds any
    /// finds several (see [`SourceLayouts::candidates`]).
    pub fn locate(&self, target: &TargetInfo<'_>, sources: &[SourceMount<'_>]) -> Option<LocatedSource> {
        for layout in self.layouts() {
            let mut found = self.matches(&layout, target, sources);
            match found.len() {
                0 => continue,
                1 => return found.pop(),
                _ => return None,
            }
        }
        None
    }

    /// Every source any layout matches, in layout order.
    pub fn candidates(&self, target: &TargetInfo<'_>, sources: &[SourceMount<'_>]) -> Vec<LocatedSource> {
        self.layouts().flat_map(|layout| self.matches(&layout, target, sources)).collect()
    }

    fn layouts(&self) -> impl Iterator<Item = Layout<'_>> {
        self.rules.iter().map(Layout::Rule).chain([Layout::CsiStaging, Layout::CsiPv, Layout::JuiceFs, Layout::Fluid])
    }

    fn matches(&self, layout: &Layout<'_>, target: &TargetInfo<'_>, sources: &[SourceMount<'_>]) -> Vec<LocatedSource> {
        let found = |name: LayoutName, source: &SourceMount<'_>| {
            Some(LocatedSource {
                path: source.path.to_path_buf(),
                root_in_source: root_within(source.root, target.root)?,
                layout: name,
            })
        };
        let at_exactly = |name: LayoutName, path: Option<PathBuf>| -> Vec<LocatedSource> {
            let Some(path) = path else { return Vec::new() };
            sources
                .iter()
                .filter(|source| source.path == path)
                .filter_map(|source| found(name.clone(), source))
                .collect()
        };
        match layout {
            Layout::Rule(rule) => at_exactly(rule.name(), rule.expand(target, &self.kubelet_root)),
            Layout::CsiStaging => at_exactly(LayoutName::CsiStaging, self.csi_staging(target)),
            Layout::CsiPv => at_exactly(LayoutName::CsiStagingByPv, self.csi_pv_staging(target)),
            Layout::JuiceFs => sources
                .iter()
                .filter(|source| self.is_juicefs_source(target, source.path))
                .filter_map(|source| found(LayoutName::JuiceFs, source))
                .collect(),
            Layout::Fluid => sources
                .iter()
                .filter(|source| self.is_fluid_source(target, source.path))
                .filter_map(|source| found(LayoutName::Fluid, source))
                .collect(),
        }
    }

    fn csi_plugin_dir(&self) -> PathBuf {
        self.kubelet_root.join("plugins/kubernetes.io/csi")
    }

    fn csi_staging(&self, target: &TargetInfo<'_>) -> Option<PathBuf> {
        let data = target.vol_data?;
        let handle = target.volume_handle()?;
        single_component(&data.driver_name)?;
        Some(self.csi_plugin_dir().join(&*data.driver_name).join(sha256_hex(handle)).join("globalmount"))
    }

    fn csi_pv_staging(&self, target: &TargetInfo<'_>) -> Option<PathBuf> {
        let pv = single_component(target.pv_name()?)?;
        Some(self.csi_plugin_dir().join("pv").join(pv).join("globalmount"))
    }

    fn is_juicefs_source(&self, target: &TargetInfo<'_>, path: &Path) -> bool {
        let Some(handle) = target.volume_handle().filter(|_| target.may_be_driver(JUICEFS_DRIVER)) else {
            return false;
        };
        let Some(name) = path.strip_prefix(&self.juicefs_root).ok().and_then(single_name) else {
            return false;
        };
        match name.strip_prefix(handle) {
            Some("") => true,
            Some(rest) => rest.strip_prefix('-').is_some_and(|suffix| {
                suffix.len() == JUICEFS_SUFFIX_LEN
                    && suffix.bytes().all(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit())
            }),
            None => false,
        }
    }

    fn is_fluid_source(&self, target: &TargetInfo<'_>, path: &Path) -> bool {
        let Some(pv) = target.pv_name().filter(|_| target.may_be_driver(FLUID_DRIVER)) else {
            return false;
        };
        let Ok(rest) = path.strip_prefix(&self.fluid_root) else { return false };
        let parts: Vec<&str> = rest
            .components()
            .map_while(|part| match part {
                Component::Normal(name) => name.to_str(),
                _ => None,
            })
            .collect();
        let [runtime, namespace, dataset, fuse_dir] = parts[..] else { return false };
        rest.components().count() == 4
            && fuse_dir.strip_suffix("-fuse").is_some_and(|stem| stem.starts_with(runtime))
            && pv.strip_prefix(namespace).and_then(|rest| rest.strip_prefix('-')) == Some(dataset)
    }
}

enum Layout<'a> {
    Rule(&'a UserRule),
    CsiStaging,
    CsiPv,
    JuiceFs,
    Fluid,
}

/// `name` if it is one plain path component (no `/`, not `.` or `..`).
fn single_component(name: &str) -> Option<&str> {
    let mut parts = Path::new(name).components();
    match (parts.next(), parts.next()) {
        (Some(Component::Normal(_)), None) if !name.contains('/') => Some(name),
        _ => None,
    }
}

/// The only component of `rest`, as UTF-8.
fn single_name(rest: &Path) -> Option<&str> {
    single_component(rest.to_str()?)
}

fn sha256_hex(text: &str) -> String {
    Sha256::digest(text.as_bytes()).iter().map(|byte| format!("{byte:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::table::{Classified, Layout as TableLayout, Snapshot};

    const KUBELET: &str = "/var/lib/kubelet";

    fn fixture(path: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(path)
    }

    fn vol_data(name: &str) -> VolData {
        VolData::read(&fixture(&format!("vol_data/{name}"))).unwrap()
    }

    fn table() -> Classified {
        let text = fs::read(fixture("mountinfo/layouts.txt")).unwrap();
        Classified::new(&Snapshot::parse(&text).unwrap(), &TableLayout::new(Path::new(KUBELET)))
    }

    fn layouts() -> SourceLayouts {
        SourceLayouts::new(Path::new(KUBELET)).with_rules_from(&fixture("layout-config/rules.toml")).unwrap()
    }

    /// Locates the source of the target at `path` in the fixture table.
    fn locate(
        layouts: &SourceLayouts,
        classified: &Classified,
        path: &str,
        data: Option<&VolData>,
    ) -> Option<LocatedSource> {
        let sources: Vec<SourceMount<'_>> = classified.sources.values().map(SourceMount::from).collect();
        let target = &classified.targets[Path::new(path)];
        let pods = Path::new(KUBELET).join("pods");
        let info =
            TargetInfo::from_path(&pods, &target.stack.path, &target.stack.top().root).unwrap().with_vol_data(data);
        layouts.locate(&info, &sources)
    }

    fn whole_volume<'a>(volume: &'a str, root: &'a Path, data: &'a VolData) -> TargetInfo<'a> {
        TargetInfo {
            pod_uid: "u",
            volume,
            kind: TargetKind::Volume,
            plugin: Some(CSI_PLUGIN_DIR),
            root,
            vol_data: Some(data),
        }
    }

    fn pod_volume(uid_suffix: u32, volume: &str) -> String {
        format!(
            "{KUBELET}/pods/1a2b3c4d-0000-4000-8000-00000000000{uid_suffix}/volumes/kubernetes.io~csi/{volume}/mount"
        )
    }

    #[test]
    fn csi_staging_by_volume_handle_hash() {
        let (layouts, table) = (layouts(), table());
        let data = vol_data("s3-persistent-selinux.json");
        let found = locate(&layouts, &table, &pod_volume(1, "s3-pv"), Some(&data)).unwrap();
        assert_eq!(found.layout, LayoutName::CsiStaging);
        let hash = sha256_hex("s3-csi-driver-volume");
        let staging = format!("plugins/kubernetes.io/csi/s3.csi.aws.com/{hash}/globalmount");
        assert_eq!(found.path, Path::new(KUBELET).join(staging));
        assert_eq!(found.root_in_source, Path::new(""));
        // The same hash is mounted under two drivers' directories: each
        // driver finds only its own, a third finds nothing.
        let mut other = data.clone();
        other.driver_name = "other.csi.example.com".into();
        let found = locate(&layouts, &table, &pod_volume(1, "s3-pv"), Some(&other)).unwrap();
        assert!(found.path.starts_with(Path::new(KUBELET).join("plugins/kubernetes.io/csi/other.csi.example.com")));
        other.driver_name = "missing.csi.example.com".into();
        assert_eq!(locate(&layouts, &table, &pod_volume(1, "s3-pv"), Some(&other)), None);
        // Without vol_data the handle is unknown.
        assert_eq!(locate(&layouts, &table, &pod_volume(1, "s3-pv"), None), None);
    }

    #[test]
    fn sha256_is_the_kubelets() {
        // sha256("abc"), the FIPS 180-2 test vector.
        assert_eq!(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn csi_staging_before_1_24_by_pv_name() {
        let (layouts, table) = (layouts(), table());
        let data = vol_data("pre-1.16.json");
        let found = locate(&layouts, &table, &pod_volume(2, "pv-legacy"), Some(&data)).unwrap();
        assert_eq!(found.layout, LayoutName::CsiStagingByPv);
        assert_eq!(found.path, Path::new(KUBELET).join("plugins/kubernetes.io/csi/pv/pv-legacy/globalmount"));
        // Without vol_data, the directory name is the PV name.
        assert_eq!(locate(&layouts, &table, &pod_volume(2, "pv-legacy"), None).unwrap().path, found.path);
        // Nor is a volume of another plugin that has the same name.
        let sources: Vec<SourceMount<'_>> = table.sources.values().map(SourceMount::from).collect();
        let empty_dir = TargetInfo {
            pod_uid: "u",
            volume: "pv-legacy",
            kind: TargetKind::Volume,
            plugin: Some("kubernetes.io~empty-dir"),
            root: Path::new("/"),
            vol_data: None,
        };
        assert_eq!(layouts.locate(&empty_dir, &sources), None);
        // An inline ephemeral volume is never staged.
        let mut inline = data.clone();
        inline.lifecycle_mode = LifecycleMode::Ephemeral;
        assert_eq!(locate(&layouts, &table, &pod_volume(2, "pv-legacy"), Some(&inline)), None);
    }

    #[test]
    fn juicefs_mount_pod_with_random_suffix() {
        let (layouts, table) = (layouts(), table());
        let data = vol_data("juicefs-persistent.json");
        let pv = "pvc-5f0c7a4e-2b1d-4c6e-9a3f-8d2e1b7c4a90";
        let found = locate(&layouts, &table, &pod_volume(3, pv), Some(&data)).unwrap();
        assert_eq!(found.layout, LayoutName::JuiceFs);
        assert_eq!(found.path, Path::new(&format!("/var/lib/juicefs/volume/{pv}-qxzvbt")));
        // The CSI driver binds the PV's subdirectory of the file system.
        assert_eq!(found.root_in_source, Path::new(pv));

        // A subPath of it: its root is the subdirectory within.
        let subpath = format!("{KUBELET}/pods/1a2b3c4d-0000-4000-8000-000000000003/volume-subpaths/data/app/0");
        let found = locate(&layouts, &table, &subpath, Some(&data)).unwrap();
        assert_eq!(found.root_in_source, Path::new(pv).join("logs"));
        // Without vol_data a subPath's volume name says nothing of the PV.
        assert_eq!(locate(&layouts, &table, &subpath, None), None);
    }

    #[test]
    fn juicefs_near_misses_do_not_match() {
        let layouts = layouts();
        let pv = "pvc-5f0c7a4e-2b1d-4c6e-9a3f-8d2e1b7c4a90";
        let data = vol_data("juicefs-persistent.json");
        let target = whole_volume(pv, Path::new("/"), &data);
        for near_miss in [
            format!("/var/lib/juicefs/volume/{pv}-0-abcdef"),
            format!("/var/lib/juicefs/volume/{pv}-abcdefg"),
            format!("/var/lib/juicefs/volume/{pv}-ABCDEF"),
            format!("/var/lib/juicefs/volume/{pv}x"),
            format!("/var/lib/juicefs/volume/{pv}-abcdef/sub"),
            format!("/var/lib/juicefs/other/{pv}-abcdef"),
        ] {
            let source = [SourceMount { path: Path::new(&near_miss), root: Path::new("/") }];
            assert_eq!(layouts.locate(&target, &source), None, "{near_miss}");
        }
        // Another driver's volume with the same handle is not JuiceFS's.
        let mut other = data.clone();
        other.driver_name = "other.csi.example.com".into();
        let source_path = format!("/var/lib/juicefs/volume/{pv}-abcdef");
        let source = [SourceMount { path: Path::new(&source_path), root: Path::new("/") }];
        assert!(layouts.locate(&target, &source).is_some());
        assert_eq!(layouts.locate(&TargetInfo { vol_data: Some(&other), ..target }, &source), None);
        // Before v0.21: no suffix.
        let source_path = format!("/var/lib/juicefs/volume/{pv}");
        let source = [SourceMount { path: Path::new(&source_path), root: Path::new("/") }];
        assert!(layouts.locate(&target, &source).is_some());
    }

    #[test]
    fn fluid_runtime_fuse_mount_by_namespace_and_dataset() {
        let (layouts, table) = (layouts(), table());
        let data = vol_data("fluid-persistent.json");
        let found = locate(&layouts, &table, &pod_volume(4, "default-shared-data"), Some(&data)).unwrap();
        assert_eq!(found.layout, LayoutName::Fluid);
        assert_eq!(found.path, Path::new("/runtime-mnt/jindo/default/shared-data/jindofs-fuse"));
        assert_eq!(found.root_in_source, Path::new(""));
        // `default/shared/data/jindofs-fuse` is one level too deep, and
        // `alluxio/default/shared-data2` another dataset: neither matched.
        let all = layouts.candidates(
            &TargetInfo::from_path(
                &Path::new(KUBELET).join("pods"),
                Path::new(&pod_volume(4, "default-shared-data")),
                Path::new("/"),
            )
            .unwrap()
            .with_vol_data(Some(&data)),
            &table.sources.values().map(SourceMount::from).collect::<Vec<_>>(),
        );
        assert_eq!(all, vec![found]);
    }

    #[test]
    fn fluid_names_with_dashes_that_split_two_ways_are_ambiguous() {
        let layouts = SourceLayouts::new(Path::new(KUBELET));
        let data = vol_data("fluid-persistent.json");
        let target = whole_volume("default-shared-data", Path::new("/"), &data);
        let one = Path::new("/runtime-mnt/jindo/default/shared-data/jindofs-fuse");
        let other = Path::new("/runtime-mnt/jindo/default-shared/data/jindofs-fuse");
        let root = Path::new("/");
        let both = [SourceMount { path: one, root }, SourceMount { path: other, root }];
        assert_eq!(layouts.locate(&target, &both[1..]).unwrap().path, other);
        assert_eq!(layouts.locate(&target, &both), None, "two datasets fit: no guess");
        assert_eq!(layouts.candidates(&target, &both).len(), 2);
        for near_miss in [
            "/runtime-mnt/jindo/default/shared-data/cache",
            "/runtime-mnt/jindo/default/shared-data/alluxio-fuse",
            "/runtime-mntx/jindo/default/shared-data/jindofs-fuse",
            "/runtime-mnt/jindo/default/shared-data2/jindofs-fuse",
        ] {
            let source = [SourceMount { path: Path::new(near_miss), root }];
            assert_eq!(layouts.locate(&target, &source), None, "{near_miss}");
        }
    }

    #[test]
    fn user_rule_for_a_driver() {
        let (layouts, table) = (layouts(), table());
        let data = vol_data("user-rule-persistent.json");
        let found = locate(&layouts, &table, &pod_volume(5, "pv-share-7"), Some(&data)).unwrap();
        assert_eq!(found.layout, LayoutName::UserRule { driver: "nfs-fuse.example.com".into() });
        assert_eq!(found.path, Path::new("/mnt/fuse/nfs-fuse.example.com").join(sha256_hex("share-7")));
        // Without the rule nothing knows this driver.
        let bare = SourceLayouts::new(Path::new(KUBELET));
        assert_eq!(locate(&bare, &table, &pod_volume(5, "pv-share-7"), Some(&data)), None);
    }

    #[test]
    fn a_source_whose_root_does_not_contain_the_targets_is_no_match() {
        let layouts = SourceLayouts::new(Path::new(KUBELET));
        let data = vol_data("fluid-persistent.json");
        let target = whole_volume("default-shared-data", Path::new("/other"), &data);
        let path = Path::new("/runtime-mnt/jindo/default/shared-data/jindofs-fuse");
        assert_eq!(layouts.locate(&target, &[SourceMount { path, root: Path::new("/data") }]), None);
        let found = layouts.locate(&target, &[SourceMount { path, root: Path::new("/") }]).unwrap();
        assert_eq!(found.root_in_source, Path::new("other"));
    }

    #[test]
    fn rule_values_cannot_climb_out_of_the_template() {
        let rules =
            parse_rules("[[rule]]\ndriver = \"d\"\nsource = \"/mnt/{volumeHandle}/x\"\n", Path::new("c.toml")).unwrap();
        let expand = |handle: &str| {
            let mut data = vol_data("user-rule-persistent.json");
            data.driver_name = "d".into();
            data.volume_handle = handle.into();
            let target = whole_volume("v", Path::new("/"), &data);
            rules[0].expand(&target, Path::new(KUBELET))
        };
        assert_eq!(expand("../../etc"), None);
        assert_eq!(expand("bucket/prefix"), Some(PathBuf::from("/mnt/bucket/prefix/x")));
    }

    #[test]
    fn target_paths_give_pod_volume_and_kind() {
        let pods = Path::new("/k/pods");
        let root = Path::new("/");
        let csi =
            TargetInfo::from_path(pods, Path::new("/k/pods/u1/volumes/kubernetes.io~csi/pv1/mount"), root).unwrap();
        assert_eq!((csi.pod_uid, csi.volume, csi.kind), ("u1", "pv1", TargetKind::Volume));
        let empty_dir =
            TargetInfo::from_path(pods, Path::new("/k/pods/u1/volumes/kubernetes.io~empty-dir/fuse"), root).unwrap();
        assert_eq!((empty_dir.volume, empty_dir.kind), ("fuse", TargetKind::Volume));
        let sub = TargetInfo::from_path(pods, Path::new("/k/pods/u1/volume-subpaths/data/app/0"), root).unwrap();
        assert_eq!((sub.volume, sub.kind), ("data", TargetKind::Subpath));
        for other in [
            "/k/pods/u1/volumes/kubernetes.io~csi/pv1/mount/deeper",
            "/k/pods/u1/volumes/kubernetes.io~csi",
            "/k/pods/u1/volume-subpaths/data/app",
            "/k/pods/u1/plugins/x/y",
            "/elsewhere/u1/volumes/p/v",
        ] {
            assert!(TargetInfo::from_path(pods, Path::new(other), root).is_none(), "{other}");
        }
    }
}
