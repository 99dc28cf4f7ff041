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
mod tests;
