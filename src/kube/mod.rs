//! The node's side of Kubernetes: the local kubelet, asked only to confirm
//! that a FUSE container restarted (its `/pods` response model and one
//! blocking HTTPS client for it), the Events the supervisor publishes, and
//! the Job lifecycle of a FUSE daemon run as a Kubernetes Job.
mod client;
pub mod events;
mod http;
pub mod job;
pub mod pods;
mod tls;

pub use client::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_PORT, DEFAULT_READ_TIMEOUT, DEFAULT_TOKEN_FILE, HttpProblem, KubeletAuthz,
    KubeletClient, KubeletConfig, KubeletError, KubeletTls, MAX_BODY, TimeoutPhase,
};
pub use pods::{
    BidirectionalHostPath, Container, ContainerState, ContainerStatus, CsiSource, HostPathSource, ParseError, Pod,
    PodList, PodMeta, PodSpec, PodStatus, PvcSource, Running, Terminated, Timestamp, Volume, VolumeMount, Waiting,
};
