//! The kubelet, asked only to confirm that a FUSE container restarted:
//! its `/pods` response model and a blocking HTTPS client for it.
mod client;
mod http;
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
