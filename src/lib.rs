//! fuse-supervisor: heals the FUSE bind mounts of Kubernetes pods when the
//! FUSE daemon behind them restarts.
#![forbid(unsafe_code)]

pub mod demofs;
pub mod mountinfo;
pub mod testbed;
