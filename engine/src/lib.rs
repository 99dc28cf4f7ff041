//! The engine of fuse-supervisor: what its programs (the node agent, its
//! sidecar mode, the CSI proxy) know and do, below their command lines and
//! loops.
//!
//! The folders are the layers, each using only those listed after it:
//! [`heal`] carries a plan out (on the host and in every container's mount
//! namespace), [`csi`] records what the kubelet asked a CSI driver and asks
//! it again, [`report`] fans out what happened, [`plan`] decides from the
//! [`model`] of the mount table and the state file, [`watch`] turns kernel
//! events into that model's changes, [`kube`] asks the local kubelet;
//! [`health`], [`shutdown`], [`errors`] and [`stop_point`] are shared
//! plumbing. Every system call is in the `fuse-supervisor-sys` crate.
#![forbid(unsafe_code)]

pub mod csi;
pub mod errors;
pub mod flag_env;
pub mod heal;
pub mod health;
pub mod kube;
pub mod logging;
pub mod model;
pub mod plan;
pub mod report;
pub mod shutdown;
pub mod stop_point;
pub mod watch;
