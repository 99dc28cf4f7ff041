//! `vol_data.json`: what the kubelet records about a CSI volume of a pod.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Map, Value};

/// The file's name inside `volumes/kubernetes.io~csi/<volume>/`.
pub const VOL_DATA_FILE: &str = "vol_data.json";

/// The kubelet writes a few hundred bytes; anything much larger is not its.
const MAX_VOL_DATA_BYTES: usize = 64 * 1024;

/// Whether a CSI volume comes from a PV or is inline in the pod spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LifecycleMode {
    Persistent,
    Ephemeral,
}

/// A CSI volume's `vol_data.json`. Strings are boxed: thousands are held;
/// the driver and node names, the same for many volumes, are shared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolData {
    /// The PV name, or the pod's volume name for an inline volume.
    pub spec_vol_id: Box<str>,
    pub volume_handle: Box<str>,
    pub driver_name: Arc<str>,
    pub node_name: Option<Arc<str>>,
    /// `Persistent` when absent: kubelets before 1.16 wrote no mode.
    pub lifecycle_mode: LifecycleMode,
    pub attachment_id: Option<Box<str>>,
    pub selinux_mount_context: Option<Box<str>>,
}

#[derive(Debug, thiserror::Error)]
pub enum VolDataError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a JSON object")]
    Syntax {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: field {field} {problem}")]
    Field { path: PathBuf, field: &'static str, problem: FieldProblem },
}

/// What is wrong with one field of a `vol_data.json`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FieldProblem {
    #[error("is missing")]
    Missing,
    #[error("is not a string")]
    NotAString,
    #[error("is empty")]
    Empty,
    #[error("has unknown value {0:?}")]
    UnknownValue(String),
}

impl VolData {
    /// Reads and parses `path`. Refuses symlinks and non-regular files.
    pub fn read(path: &Path) -> Result<Self, VolDataError> {
        Self::parse(&read_bytes(path)?, path)
    }

    /// Parses the file's bytes; `path` only names the file in errors.
    /// Keys other than the kubelet's are ignored.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, VolDataError> {
        let map: Map<String, Value> = serde_json::from_slice(bytes)
            .map_err(|source| VolDataError::Syntax { path: path.to_path_buf(), source })?;
        let field_error = |field, problem| VolDataError::Field { path: path.to_path_buf(), field, problem };
        let optional = |field: &'static str| -> Result<Option<Box<str>>, VolDataError> {
            match map.get(field) {
                None => Ok(None),
                Some(Value::String(value)) => Ok(Some(value.as_str().into())),
                Some(_) => Err(field_error(field, FieldProblem::NotAString)),
            }
        };
        let required = |field: &'static str| -> Result<Box<str>, VolDataError> {
            match optional(field)? {
                None => Err(field_error(field, FieldProblem::Missing)),
                Some(value) if value.is_empty() => Err(field_error(field, FieldProblem::Empty)),
                Some(value) => Ok(value),
            }
        };
        let lifecycle_mode = match optional("volumeLifecycleMode")?.as_deref() {
            None | Some("Persistent") => LifecycleMode::Persistent,
            Some("Ephemeral") => LifecycleMode::Ephemeral,
            Some(other) => {
                return Err(field_error("volumeLifecycleMode", FieldProblem::UnknownValue(other.to_owned())));
            }
        };
        Ok(VolData {
            spec_vol_id: required("specVolID")?,
            volume_handle: required("volumeHandle")?,
            driver_name: required("driverName")?.into(),
            node_name: optional("nodeName")?.map(Arc::from),
            lifecycle_mode,
            attachment_id: optional("attachmentID")?,
            selinux_mount_context: optional("seLinuxMountContext")?,
        })
    }
}

/// The file's bytes, read as [`VolData::read`] does.
pub(crate) fn read_bytes(path: &Path) -> Result<Vec<u8>, VolDataError> {
    fuse_supervisor_sys::resolve::read_small_file(path, MAX_VOL_DATA_BYTES)
        .map_err(|source| VolDataError::Read { path: path.to_path_buf(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/vol_data").join(name)
    }

    #[test]
    fn reads_every_well_formed_fixture() {
        let juicefs = VolData::read(&fixture("juicefs-persistent.json")).unwrap();
        assert_eq!(&*juicefs.driver_name, "csi.juicefs.com");
        assert_eq!(juicefs.spec_vol_id, juicefs.volume_handle);
        assert_eq!(juicefs.node_name.as_deref(), Some("ip-10-0-3-17.ec2.internal"));
        assert_eq!(juicefs.lifecycle_mode, LifecycleMode::Persistent);
        assert!(juicefs.attachment_id.as_deref().unwrap().starts_with("csi-"));
        assert_eq!(juicefs.selinux_mount_context, None);

        let s3 = VolData::read(&fixture("s3-persistent-selinux.json")).unwrap();
        assert_eq!(&*s3.spec_vol_id, "s3-pv");
        assert_eq!(&*s3.volume_handle, "s3-csi-driver-volume");
        assert_eq!(s3.selinux_mount_context.as_deref(), Some("system_u:object_r:container_file_t:s0:c10,c20"));

        let inline = VolData::read(&fixture("inline-ephemeral.json")).unwrap();
        assert_eq!(inline.lifecycle_mode, LifecycleMode::Ephemeral);
        assert_eq!(&*inline.spec_vol_id, "scratch");

        let legacy = VolData::read(&fixture("pre-1.16.json")).unwrap();
        assert_eq!(legacy.lifecycle_mode, LifecycleMode::Persistent);

        VolData::read(&fixture("fluid-persistent.json")).unwrap();
    }

    #[test]
    fn ignores_unknown_keys() {
        let data = br#"{"driverName":"d","specVolID":"s","volumeHandle":"h","futureKey":{"nested":1}}"#;
        let parsed = VolData::parse(data, Path::new("x/vol_data.json")).unwrap();
        assert_eq!(&*parsed.volume_handle, "h");
        assert_eq!(parsed.node_name, None);
    }

    #[test]
    fn malformed_files_name_the_file_and_the_field() {
        let cases = [
            ("malformed-missing-handle.json", "field volumeHandle is missing"),
            ("malformed-number.json", "field nodeName is not a string"),
            ("malformed-lifecycle.json", "field volumeLifecycleMode has unknown value \"Sometimes\""),
            ("malformed-truncated.json", "is not a JSON object"),
        ];
        for (name, expected) in cases {
            let path = fixture(name);
            let message = VolData::read(&path).unwrap_err().to_string();
            assert!(message.starts_with(&path.display().to_string()), "{message}");
            assert!(message.ends_with(expected), "{name}: {message}");
        }
    }

    #[test]
    fn refuses_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join(VOL_DATA_FILE);
        std::os::unix::fs::symlink(fixture("juicefs-persistent.json"), &link).unwrap();
        assert!(matches!(VolData::read(&link), Err(VolDataError::Read { .. })));
    }
}
