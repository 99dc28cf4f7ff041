//! The part of a v1 `PodList` (what the kubelet's `GET /pods` returns) that
//! restart confirmation needs.
//!
//! Unknown fields are ignored and everything the API may omit or write as
//! `null` (Go encodes a nil slice or map as `null`) falls back to its default,
//! so a newer kubelet with more fields parses the same. A pod that still
//! cannot be read is skipped and named in [`PodList::skipped`]: one bad pod
//! must not hide the others, among them the owner of a restarted daemon.
use std::collections::BTreeMap;
use std::fmt;
use std::time::SystemTime;

use serde::{Deserialize, Deserializer};
use serde_json::Value;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// A JSON body that is not a `PodList` we can read.
#[derive(Debug, thiserror::Error)]
#[error("pod list is not valid at {path}")]
pub struct ParseError {
    /// Where in the document it went wrong, e.g. `items[3].status.containerStatuses[0].state.running.startedAt`.
    pub path: String,
    pub line: usize,
    pub column: usize,
    #[source]
    pub source: serde_json::Error,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodList {
    #[serde(default, deserialize_with = "nullable")]
    pub items: Vec<Pod>,
    /// The pods of the body that could not be read, left out of `items`.
    #[serde(skip)]
    pub skipped: Vec<SkippedPod>,
}

/// A pod of a `/pods` body that is not a pod we can read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedPod {
    /// Its place in the body's `items`.
    pub index: usize,
    /// Its metadata as far as it reads (a field that is not a string is
    /// shown as JSON; an absent one is empty).
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// Where in the pod it went wrong, e.g. `status.containerStatuses[0].state.running.startedAt`.
    pub field: String,
    /// What was wrong there.
    pub problem: String,
}

/// A `/pods` body read as far as its list: each pod is read on its own.
#[derive(Deserialize)]
struct PodValues {
    #[serde(default, deserialize_with = "nullable")]
    items: Vec<Value>,
}

impl PodList {
    /// Parses a `/pods` response body. A pod that cannot be read is left
    /// out and named in `skipped`; only a body that is not a list of pods
    /// at all is an error.
    pub fn from_slice(body: &[u8]) -> Result<Self, ParseError> {
        // The plain parse is the fast path; only a failure pays for reading
        // the pods one by one.
        serde_json::from_slice(body).or_else(|_| Self::pod_by_pod(body))
    }

    /// The list as JSON values, tracking where it breaks if it does, then
    /// each pod on its own.
    #[cold]
    fn pod_by_pod(body: &[u8]) -> Result<Self, ParseError> {
        let located = |path: String, source: serde_json::Error| ParseError {
            path,
            line: source.line(),
            column: source.column(),
            source,
        };
        let mut de = serde_json::Deserializer::from_slice(body);
        let values: PodValues = serde_path_to_error::deserialize(&mut de)
            .map_err(|err| located(err.path().to_string(), err.into_inner()))?;
        // Nothing but white space may follow the document.
        de.end().map_err(|source| located(".".into(), source))?;
        let mut list = PodList { items: Vec::with_capacity(values.items.len()), skipped: Vec::new() };
        for (index, value) in values.items.iter().enumerate() {
            match serde_path_to_error::deserialize::<_, Pod>(value) {
                Ok(pod) => list.items.push(pod),
                Err(err) => list.skipped.push(SkippedPod::new(index, value, &err)),
            }
        }
        Ok(list)
    }

    /// The pod with this UID.
    pub fn pod(&self, uid: &str) -> Option<&Pod> {
        self.items.iter().find(|pod| pod.metadata.uid == uid)
    }
}

impl SkippedPod {
    fn new(index: usize, pod: &Value, err: &serde_path_to_error::Error<serde_json::Error>) -> Self {
        let metadata = |key: &str| match pod.get("metadata").and_then(|metadata| metadata.get(key)) {
            Some(Value::String(text)) => text.clone(),
            Some(other) => other.to_string(),
            None => String::new(),
        };
        SkippedPod {
            index,
            namespace: metadata("namespace"),
            name: metadata("name"),
            uid: metadata("uid"),
            field: err.path().to_string(),
            problem: err.inner().to_string(),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Pod {
    #[serde(default)]
    pub metadata: PodMeta,
    #[serde(default)]
    pub spec: PodSpec,
    #[serde(default)]
    pub status: PodStatus,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodMeta {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub namespace: String,
    #[serde(default)]
    pub uid: String,
    #[serde(default, deserialize_with = "nullable")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, deserialize_with = "nullable")]
    pub annotations: BTreeMap<String, String>,
    /// Set once the pod is being deleted (terminating).
    #[serde(default)]
    pub deletion_timestamp: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    #[serde(default)]
    pub node_name: String,
    /// `Always`, `OnFailure` or `Never`; the API server defaults it to `Always`.
    #[serde(default)]
    pub restart_policy: Option<String>,
    #[serde(default, deserialize_with = "nullable")]
    pub volumes: Vec<Volume>,
    #[serde(default, deserialize_with = "nullable")]
    pub containers: Vec<Container>,
    #[serde(default, deserialize_with = "nullable")]
    pub init_containers: Vec<Container>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub host_path: Option<HostPathSource>,
    #[serde(default)]
    pub csi: Option<CsiSource>,
    #[serde(default)]
    pub persistent_volume_claim: Option<PvcSource>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostPathSource {
    #[serde(default)]
    pub path: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CsiSource {
    #[serde(default)]
    pub driver: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PvcSource {
    #[serde(default)]
    pub claim_name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Container {
    #[serde(default)]
    pub name: String,
    /// Only on init containers: `Always` makes it a native sidecar, which
    /// keeps running (and restarting) beside the app containers.
    #[serde(default)]
    pub restart_policy: Option<String>,
    #[serde(default, deserialize_with = "nullable")]
    pub volume_mounts: Vec<VolumeMount>,
}

impl Container {
    /// Whether this (init) container is a native sidecar.
    pub fn is_native_sidecar(&self) -> bool {
        self.restart_policy.as_deref() == Some("Always")
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeMount {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub mount_path: String,
    /// `None`, `HostToContainer` or `Bidirectional`; absent means `None`.
    #[serde(default)]
    pub mount_propagation: Option<String>,
    #[serde(default)]
    pub sub_path: Option<String>,
}

impl VolumeMount {
    pub fn is_bidirectional(&self) -> bool {
        self.mount_propagation.as_deref() == Some("Bidirectional")
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    /// `Pending`, `Running`, `Succeeded`, `Failed` or `Unknown`.
    #[serde(default)]
    pub phase: Option<String>,
    #[serde(default, deserialize_with = "nullable")]
    pub container_statuses: Vec<ContainerStatus>,
    /// Includes native sidecars, which run for the pod's whole life.
    #[serde(default, deserialize_with = "nullable")]
    pub init_container_statuses: Vec<ContainerStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerStatus {
    #[serde(default)]
    pub name: String,
    /// `<runtime>://<id>`, e.g. `containerd://<64 hex>`; absent until the
    /// container was created once. Changes on every restart.
    #[serde(default, rename = "containerID")]
    pub container_id: Option<String>,
    #[serde(default)]
    pub restart_count: u32,
    #[serde(default)]
    pub state: ContainerState,
    /// The previous instance, after a restart (its `terminated` says why).
    #[serde(default)]
    pub last_state: ContainerState,
}

impl ContainerStatus {
    /// When the current instance started: `state.running.startedAt`, or
    /// `state.terminated.startedAt` if it has already exited; `None` while
    /// it waits to (re)start.
    pub fn started_at(&self) -> Option<SystemTime> {
        let running = self.state.running.as_ref().and_then(|running| running.started_at);
        let terminated = self.state.terminated.as_ref().and_then(|terminated| terminated.started_at);
        running.or(terminated).map(SystemTime::from)
    }

    pub fn is_running(&self) -> bool {
        self.state.running.is_some()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerState {
    #[serde(default)]
    pub running: Option<Running>,
    #[serde(default)]
    pub terminated: Option<Terminated>,
    #[serde(default)]
    pub waiting: Option<Waiting>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Running {
    #[serde(default)]
    pub started_at: Option<Timestamp>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Terminated {
    #[serde(default)]
    pub exit_code: i32,
    /// E.g. `Completed`, `Error`, `OOMKilled`.
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub started_at: Option<Timestamp>,
    #[serde(default)]
    pub finished_at: Option<Timestamp>,
    #[serde(default, rename = "containerID")]
    pub container_id: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Waiting {
    /// E.g. `ContainerCreating`, `CrashLoopBackOff`.
    #[serde(default)]
    pub reason: Option<String>,
}

/// A `hostPath` volume that a container mounts with Bidirectional
/// propagation: how a FUSE daemon in a pod publishes its mount to the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BidirectionalHostPath<'a> {
    pub container: &'a str,
    /// The directory on the node.
    pub host_path: &'a str,
    /// Where the container sees it.
    pub mount_path: &'a str,
}

impl Pod {
    /// The status of the container with this name, app or init (native
    /// sidecars report in `initContainerStatuses`).
    pub fn container_status(&self, name: &str) -> Option<&ContainerStatus> {
        self.status.container_statuses.iter().chain(&self.status.init_container_statuses).find(|s| s.name == name)
    }

    /// The spec of the container with this name, app or init.
    pub fn container(&self, name: &str) -> Option<&Container> {
        self.spec.containers.iter().chain(&self.spec.init_containers).find(|c| c.name == name)
    }

    pub fn volume(&self, name: &str) -> Option<&Volume> {
        self.spec.volumes.iter().find(|volume| volume.name == name)
    }

    /// Every hostPath volume mounted with Bidirectional propagation, per
    /// container (init containers included).
    pub fn bidirectional_host_paths(&self) -> impl Iterator<Item = BidirectionalHostPath<'_>> {
        self.spec.containers.iter().chain(&self.spec.init_containers).flat_map(move |container| {
            container.volume_mounts.iter().filter(|mount| mount.is_bidirectional()).filter_map(move |mount| {
                let host = self.volume(&mount.name)?.host_path.as_ref()?;
                Some(BidirectionalHostPath {
                    container: &container.name,
                    host_path: &host.path,
                    mount_path: &mount.mount_path,
                })
            })
        })
    }
}

/// An RFC 3339 time as the API writes it (`2025-03-04T05:06:07Z`, second
/// precision); fractional seconds and offsets are accepted too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub SystemTime);

impl Timestamp {
    pub fn parse(text: &str) -> Result<Self, time::error::Parse> {
        OffsetDateTime::parse(text, &Rfc3339).map(|at| Self(at.into()))
    }
}

impl From<Timestamp> for SystemTime {
    fn from(at: Timestamp) -> Self {
        at.0
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Formatting a UTC time as RFC 3339 fails only for years past 9999,
        // which no SystemTime we parsed can hold.
        match OffsetDateTime::from(self.0).format(&Rfc3339) {
            Ok(text) => f.write_str(&text),
            Err(_) => write!(f, "{:?}", self.0),
        }
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = std::borrow::Cow::<str>::deserialize(deserializer)?;
        Self::parse(&text)
            .map_err(|err| serde::de::Error::custom(format!("invalid RFC 3339 timestamp {text:?}: {err}")))
    }
}

/// `null` → the default, for the lists and maps Go writes as `null` when nil.
fn nullable<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// The runtime's ID of a kubelet `containerID` (`containerd://<id>`).
pub fn runtime_id(container_id: &str) -> &str {
    container_id.split_once("://").map_or(container_id, |(_, id)| id)
}

#[cfg(test)]
mod tests;
