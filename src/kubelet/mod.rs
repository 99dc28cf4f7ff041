//! The kubelet, asked only to confirm that a FUSE container restarted:
//! its `/pods` response model.
pub mod pods;

pub use pods::{
    BidirectionalHostPath, Container, ContainerState, ContainerStatus, CsiSource, HostPathSource, ParseError, Pod,
    PodList, PodMeta, PodSpec, PodStatus, PvcSource, Running, Terminated, Timestamp, Volume, VolumeMount, Waiting,
};
