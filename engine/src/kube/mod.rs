//! The local kubelet's `/pods`: its response model, a blocking HTTPS client,
//! and [`Kubelet`], the one client a process shares between the restart
//! confirmation, the Job lifecycle and the Events' pod names.
mod asker;
pub mod cgroup;
mod client;
mod kubelet;
pub mod pods;
mod tls;

pub use asker::{Answer, Asker};
pub use client::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_PORT, DEFAULT_READ_TIMEOUT, DEFAULT_TOKEN_FILE, HttpProblem, KubeletAuthz,
    KubeletClient, KubeletConfig, KubeletError, KubeletTls, MAX_BODY, TimeoutPhase,
};
pub use kubelet::{Kubelet, Listed};
pub use pods::{
    BidirectionalHostPath, Container, ContainerState, ContainerStatus, CsiSource, HostPathSource, ParseError, Pod,
    PodList, PodMeta, PodSpec, PodStatus, PvcSource, Running, Terminated, Timestamp, Volume, VolumeMount, Waiting,
};
