//! The records of what the kubelet asked: one file per successful
//! `NodeStageVolume` or `NodePublishVolume` that was not undone since.
//!
//! # Format (version 1)
//!
//! A directory (mode 0700) of JSON files (mode 0600), each written to a
//! temporary file, flushed to disk and renamed into place, so a reader
//! sees a whole record or none. A file's name is `stage-<hash>.json` or
//! `publish-<hash>.json`, `<hash>` the SHA-256 (hex) of the volume ID and
//! the staging or target path, each after its length in bytes (8 bytes,
//! big-endian): no field of a request can make
//! a name that leaves the directory, and the same call for the same volume
//! and path replaces its record. Its content:
//!
//! ```json
//! {
//!   "format": 1,
//!   "call": "NodeStageVolume",
//!   "driver": "csi.example.com",
//!   "volume_id": "pv-handle",
//!   "path": "/var/lib/kubelet/plugins/kubernetes.io/csi/csi.example.com/<sha256>/globalmount",
//!   "secrets": "recorded",
//!   "recorded_at": "2026-11-27T12:00:00Z",
//!   "request": "<base64 of the request's protobuf encoding>"
//! }
//! ```
//!
//! `call` is `NodeStageVolume` or `NodePublishVolume`; `driver` the
//! driver's name from `GetPluginInfo` (null if it never answered);
//! `volume_id` and `path` copy the request's (its `staging_target_path`
//! or `target_path`), for readers that need not decode it; `secrets` says
//! whether the request's `secrets` are in it (`recorded`), were removed
//! (`omitted`, `--record-secrets off`) or there were none (`none`);
//! `request` is the CSI v1 request message, the bytes the kubelet sent
//! (with the secrets removed and the message encoded again when
//! `omitted`), fields this version does not know included. A reader
//! refuses a `format` it does not know.
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use prost::Message as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::api;

/// The version of the record format this code writes and reads.
pub const FORMAT: u32 = 1;

const DIR_MODE: u32 = 0o700;
const FILE_MODE: u32 = 0o600;

/// The recorded call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Call {
    NodeStageVolume,
    NodePublishVolume,
}

impl Call {
    fn file_prefix(self) -> &'static str {
        match self {
            Call::NodeStageVolume => "stage",
            Call::NodePublishVolume => "publish",
        }
    }
}

/// Whether a record holds the request's secrets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Secrets {
    Recorded,
    Omitted,
    None,
}

/// A recorded request, decoded.
#[derive(Clone, PartialEq)]
pub enum Request {
    Stage(api::NodeStageVolumeRequest),
    Publish(api::NodePublishVolumeRequest),
}

impl Request {
    pub fn call(&self) -> Call {
        match self {
            Request::Stage(_) => Call::NodeStageVolume,
            Request::Publish(_) => Call::NodePublishVolume,
        }
    }

    pub fn volume_id(&self) -> &str {
        match self {
            Request::Stage(request) => &request.volume_id,
            Request::Publish(request) => &request.volume_id,
        }
    }

    /// The staging path of a stage, the target path of a publish.
    pub fn path(&self) -> &str {
        match self {
            Request::Stage(request) => &request.staging_target_path,
            Request::Publish(request) => &request.target_path,
        }
    }

    /// Whether the call mounts the volume at its path: a stage, or a
    /// publish of a driver without a staging step.
    pub fn mounts_at_path(&self) -> bool {
        matches!(self, Request::Stage(_)) || self.driver_mounted_target().is_some()
    }

    /// The pod's target of a publish of a driver without a staging step
    /// (the kubelet sends a staging path exactly when the driver has one),
    /// which mounts its FUSE filesystem there itself.
    pub fn driver_mounted_target(&self) -> Option<&str> {
        match self {
            Request::Publish(request) if request.staging_target_path.is_empty() => Some(&request.target_path),
            _ => None,
        }
    }

    fn has_secrets(&self) -> bool {
        match self {
            Request::Stage(request) => !request.secrets.is_empty(),
            Request::Publish(request) => !request.secrets.is_empty(),
        }
    }

    fn without_secrets(mut self) -> Request {
        match &mut self {
            Request::Stage(request) => request.secrets.clear(),
            Request::Publish(request) => request.secrets.clear(),
        }
        self
    }

    fn encode(&self) -> Vec<u8> {
        match self {
            Request::Stage(request) => request.encode_to_vec(),
            Request::Publish(request) => request.encode_to_vec(),
        }
    }

    fn decode(call: Call, bytes: &[u8]) -> Result<Request, prost::DecodeError> {
        Ok(match call {
            Call::NodeStageVolume => Request::Stage(api::NodeStageVolumeRequest::decode(bytes)?),
            Call::NodePublishVolume => Request::Publish(api::NodePublishVolumeRequest::decode(bytes)?),
        })
    }
}

/// Names the call, volume and path only: a request's secrets must never
/// reach a log line or an error message.
impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("call", &self.call())
            .field("volume_id", &self.volume_id())
            .field("path", &self.path())
            .finish_non_exhaustive()
    }
}

/// A record read back.
#[derive(Clone, PartialEq)]
pub struct Record {
    pub file: PathBuf,
    pub driver: Option<String>,
    pub secrets: Secrets,
    pub recorded_at: OffsetDateTime,
    pub request: Request,
    /// The request's bytes as recorded, to replay it exactly (fields this
    /// version does not know included).
    pub request_bytes: Vec<u8>,
}

/// Leaves out the request's bytes, which hold its secrets.
impl std::fmt::Debug for Record {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Record")
            .field("file", &self.file)
            .field("driver", &self.driver)
            .field("secrets", &self.secrets)
            .field("recorded_at", &self.recorded_at)
            .field("request", &self.request)
            .finish_non_exhaustive()
    }
}

/// The one field every version of the format has.
#[derive(Deserialize)]
struct Versioned {
    format: u32,
}

/// The file's JSON.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordFile {
    format: u32,
    call: Call,
    driver: Option<String>,
    volume_id: String,
    path: String,
    secrets: Secrets,
    recorded_at: String,
    request: String,
}

/// What can go wrong writing or reading records. No variant carries a
/// request's content: its messages name files, never what they hold.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("cannot create the record directory {dir}")]
    CreateDir {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot list the record directory {dir}")]
    ReadDir {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot write the record {file}")]
    Write {
        file: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot remove the record {file}")]
    Remove {
        file: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the record {file}")]
    Read {
        file: PathBuf,
        #[source]
        source: io::Error,
    },
    // serde_json's own message may quote a value of the file: only where.
    #[error("corrupt record {file}: not a record's JSON ({category} at line {line}, column {column})")]
    Json { file: PathBuf, category: &'static str, line: usize, column: usize },
    #[error("record {file} has format {format}; this version reads format {FORMAT}")]
    Format { file: PathBuf, format: u32 },
    #[error("corrupt record {file}: its request is not base64")]
    Base64 { file: PathBuf },
    #[error("corrupt record {file}: its request is not a CSI {call:?} request")]
    Decode {
        file: PathBuf,
        call: Call,
        #[source]
        source: prost::DecodeError,
    },
    #[error("corrupt record {file}: {field} differs from the request's")]
    Mismatch { file: PathBuf, field: &'static str },
    #[error("corrupt record {file}: its time is not RFC 3339")]
    Time { file: PathBuf },
}

/// The record directory of one proxy.
#[derive(Debug, Clone)]
pub struct RecordDir {
    dir: PathBuf,
}

impl RecordDir {
    /// Creates `dir` (and its parents) if needed, and makes it 0700 in any
    /// case: records hold secrets.
    pub fn create(dir: &Path) -> Result<RecordDir, RecordError> {
        let created = fs::DirBuilder::new().recursive(true).mode(DIR_MODE).create(dir);
        created
            .and_then(|()| fs::set_permissions(dir, fs::Permissions::from_mode(DIR_MODE)))
            .map_err(|source| RecordError::CreateDir { dir: dir.to_path_buf(), source })?;
        Ok(RecordDir { dir: dir.to_path_buf() })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Where the record of `call` for `volume_id` at `path` is.
    pub fn file_of(&self, call: Call, volume_id: &str, path: &str) -> PathBuf {
        self.dir.join(file_name(call, volume_id, path))
    }

    /// Records `request`, the bytes the kubelet sent (`bytes`, its
    /// encoding), replacing the record of the same call, volume and path.
    /// Without `keep_secrets`, its secrets are removed first.
    pub fn write(
        &self,
        driver: Option<&str>,
        request: Request,
        bytes: &[u8],
        keep_secrets: bool,
    ) -> Result<PathBuf, RecordError> {
        let file = self.file_of(request.call(), request.volume_id(), request.path());
        let (secrets, bytes) = match (request.has_secrets(), keep_secrets) {
            (false, _) => (Secrets::None, bytes.to_vec()),
            (true, true) => (Secrets::Recorded, bytes.to_vec()),
            (true, false) => (Secrets::Omitted, request.clone().without_secrets().encode()),
        };
        let recorded_at = OffsetDateTime::now_utc().format(&Rfc3339).unwrap_or_default();
        let content = RecordFile {
            format: FORMAT,
            call: request.call(),
            driver: driver.map(str::to_owned),
            volume_id: request.volume_id().to_owned(),
            path: request.path().to_owned(),
            secrets,
            recorded_at,
            request: BASE64.encode(bytes),
        };
        let json = serde_json::to_vec_pretty(&content)
            .map_err(|err| RecordError::Write { file: file.clone(), source: io::Error::other(err.to_string()) })?;
        self.replace(&file, &json).map_err(|source| RecordError::Write { file: file.clone(), source })?;
        Ok(file)
    }

    /// Removes the record of `call` for `volume_id` at `path`; false if
    /// there was none.
    pub fn remove(&self, call: Call, volume_id: &str, path: &str) -> Result<bool, RecordError> {
        let file = self.file_of(call, volume_id, path);
        match fs::remove_file(&file) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(source) => return Err(RecordError::Remove { file, source }),
        }
        self.sync_dir().map_err(|source| RecordError::Remove { file, source })?;
        Ok(true)
    }

    /// Temp file (0600, created afresh), fsync, rename over `file`, fsync
    /// of the directory: a crash leaves the old record or the new one.
    fn replace(&self, file: &Path, content: &[u8]) -> io::Result<()> {
        let name = file.file_name().map(|name| name.to_string_lossy().into_owned()).unwrap_or_default();
        let temp = self.dir.join(format!(".{name}.{}.tmp", std::process::id()));
        let written = (|| {
            // A temp file left by a crash of this pid before is replaced.
            match fs::remove_file(&temp) {
                Err(err) if err.kind() != io::ErrorKind::NotFound => return Err(err),
                _ => {}
            }
            let mut out = OpenOptions::new().write(true).create_new(true).mode(FILE_MODE).open(&temp)?;
            out.write_all(content)?;
            out.sync_all()?;
            fs::rename(&temp, file)
        })();
        if written.is_err() {
            let _ = fs::remove_file(&temp);
        }
        written?;
        self.sync_dir()
    }

    fn sync_dir(&self) -> io::Result<()> {
        File::open(&self.dir)?.sync_all()
    }
}

fn file_name(call: Call, volume_id: &str, path: &str) -> String {
    // Each field after its length: a NUL, valid in a proto string, cannot
    // make two keys one.
    let mut hash = Sha256::new();
    for field in [volume_id, path] {
        hash.update((field.len() as u64).to_be_bytes());
        hash.update(field.as_bytes());
    }
    let hex: String = hash.finalize().iter().map(|byte| format!("{byte:02x}")).collect();
    format!("{}-{hex}.json", call.file_prefix())
}

/// Every record of a directory read back: the records, and an error
/// naming each file that is not one (a corrupt record never hides the
/// others).
#[derive(Debug, Default)]
pub struct ReadRecords {
    pub records: Vec<Record>,
    pub corrupt: Vec<RecordError>,
}

/// Whether a file of a record directory is a record: a temporary file
/// (`.<name>.<pid>.tmp`) is not.
pub fn is_record_name(name: &std::ffi::OsStr) -> bool {
    let name = name.as_encoded_bytes();
    !name.starts_with(b".") && name.ends_with(b".json")
}

/// Reads every record in `dir`, in file-name order. Fails only when the
/// directory cannot be listed; temporary files are skipped.
pub fn read_all(dir: &Path) -> Result<ReadRecords, RecordError> {
    let listing = fs::read_dir(dir).map_err(|source| RecordError::ReadDir { dir: dir.to_path_buf(), source })?;
    let mut files = Vec::new();
    for entry in listing {
        let entry = entry.map_err(|source| RecordError::ReadDir { dir: dir.to_path_buf(), source })?;
        if is_record_name(&entry.file_name()) {
            files.push(entry.path());
        }
    }
    files.sort();
    let mut read = ReadRecords::default();
    for file in files {
        match read_one(&file) {
            Ok(record) => read.records.push(record),
            Err(err) => read.corrupt.push(err),
        }
    }
    Ok(read)
}

/// Reads the record `file`.
pub fn read_one(file: &Path) -> Result<Record, RecordError> {
    let text = fs::read(file).map_err(|source| RecordError::Read { file: file.to_path_buf(), source })?;
    let json_error = |err: serde_json::Error| RecordError::Json {
        file: file.to_path_buf(),
        category: match err.classify() {
            serde_json::error::Category::Io => "read error",
            serde_json::error::Category::Syntax => "syntax error",
            serde_json::error::Category::Data => "wrong field",
            serde_json::error::Category::Eof => "truncated",
        },
        line: err.line(),
        column: err.column(),
    };
    let Versioned { format } = serde_json::from_slice(&text).map_err(json_error)?;
    if format != FORMAT {
        return Err(RecordError::Format { file: file.to_path_buf(), format });
    }
    let content: RecordFile = serde_json::from_slice(&text).map_err(json_error)?;
    let request_bytes =
        BASE64.decode(content.request.as_bytes()).map_err(|_| RecordError::Base64 { file: file.to_path_buf() })?;
    let request = Request::decode(content.call, &request_bytes).map_err(|source| RecordError::Decode {
        file: file.to_path_buf(),
        call: content.call,
        source,
    })?;
    let mismatch = |field| RecordError::Mismatch { file: file.to_path_buf(), field };
    if request.volume_id() != content.volume_id {
        return Err(mismatch("volume_id"));
    }
    if request.path() != content.path {
        return Err(mismatch("path"));
    }
    let recorded_at = OffsetDateTime::parse(&content.recorded_at, &Rfc3339)
        .map_err(|_| RecordError::Time { file: file.to_path_buf() })?;
    Ok(Record {
        file: file.to_path_buf(),
        driver: content.driver,
        secrets: content.secrets,
        recorded_at,
        request,
        request_bytes,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    const SECRET: &str = "s3cr3t-value";

    fn stage(volume: &str, path: &str) -> api::NodeStageVolumeRequest {
        api::NodeStageVolumeRequest {
            volume_id: volume.into(),
            staging_target_path: path.into(),
            secrets: HashMap::from([("password".into(), SECRET.into())]),
            volume_context: HashMap::from([("source".into(), "/backing".into())]),
            ..Default::default()
        }
    }

    #[test]
    fn a_record_reads_back_as_the_request_in_a_private_file() {
        let dir = tempfile::tempdir().unwrap();
        let records = RecordDir::create(&dir.path().join("records")).unwrap();
        let request = stage("vol-1", "/k/globalmount");
        let bytes = request.encode_to_vec();
        let file = records.write(Some("drv"), Request::Stage(request.clone()), &bytes, true).unwrap();
        assert_eq!(fs::metadata(records.path()).unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
        let read = read_all(records.path()).unwrap();
        assert!(read.corrupt.is_empty(), "{:?}", read.corrupt);
        let [record] = read.records.as_slice() else { panic!("{:?}", read.records) };
        assert_eq!(record.request, Request::Stage(request));
        assert_eq!(record.request_bytes, bytes);
        assert_eq!((record.driver.as_deref(), record.secrets), (Some("drv"), Secrets::Recorded));
        assert!(records.remove(Call::NodeStageVolume, "vol-1", "/k/globalmount").unwrap());
        assert!(!records.remove(Call::NodeStageVolume, "vol-1", "/k/globalmount").unwrap());
        assert!(read_all(records.path()).unwrap().records.is_empty());
    }

    #[test]
    fn secrets_off_leaves_no_secret_in_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let records = RecordDir::create(dir.path()).unwrap();
        let request = stage("vol-1", "/k/globalmount");
        let file = records.write(None, Request::Stage(request.clone()), &request.encode_to_vec(), false).unwrap();
        let text = fs::read(&file).unwrap();
        assert!(!String::from_utf8_lossy(&text).contains(SECRET));
        assert!(!BASE64.encode(&text).contains(&BASE64.encode(SECRET)));
        let record = read_one(&file).unwrap();
        assert_eq!(record.secrets, Secrets::Omitted);
        let Request::Stage(read) = record.request else { panic!("not a stage") };
        assert!(read.secrets.is_empty());
        assert_eq!(read.volume_context, request.volume_context);
    }

    #[test]
    fn names_stay_in_the_directory_whatever_the_request_says() {
        let name = file_name(Call::NodePublishVolume, "../../etc/passwd", "/../x\0y");
        assert!(name.starts_with("publish-") && name.ends_with(".json") && !name.contains('/'));
        assert_ne!(name, file_name(Call::NodePublishVolume, "../../etc/passwd\0/../x", "y"));
    }

    #[test]
    fn a_corrupt_record_is_named_and_the_others_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let records = RecordDir::create(dir.path()).unwrap();
        let request = stage("vol-1", "/k/a");
        records.write(Some("drv"), Request::Stage(request.clone()), &request.encode_to_vec(), true).unwrap();
        let broken = dir.path().join("stage-broken.json");
        fs::write(&broken, format!("{{\"format\": 1, \"call\": \"{SECRET}\"")).unwrap();
        let other_format = dir.path().join("stage-future.json");
        fs::write(&other_format, r#"{"format": 2}"#).unwrap();
        fs::write(dir.path().join(".stage-x.json.1.tmp"), "half").unwrap();
        let read = read_all(dir.path()).unwrap();
        assert_eq!(read.records.len(), 1);
        let messages: Vec<String> = read.corrupt.iter().map(ToString::to_string).collect();
        assert_eq!(messages.len(), 2, "{messages:?}");
        assert!(messages.iter().any(|message| message.contains("has format 2")), "{messages:?}");
        assert!(messages.iter().any(|message| message.contains(&*broken.to_string_lossy())));
        assert!(messages.iter().all(|message| !message.contains(SECRET)), "{messages:?}");
    }
}
