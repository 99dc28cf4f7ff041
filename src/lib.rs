//! fuse-supervisor: heals the FUSE bind mounts of Kubernetes pods when the
//! FUSE daemon behind them restarts.
//!
//! The folders are the layers, each using only those listed after it:
//! the CLI (`src/bin/`) starts a [`supervisor`] (node mode) or a [`sidecar`],
//! whose loop takes kernel events from [`watch`], decides with [`plan`] over
//! the [`model`] of the mount table and the state file, carries the plan out
//! through [`heal`], confirms with the kubelet and reports through [`kube`]
//! (its API, Events, the Job lifecycle), [`metrics`] and [`report`]; [`csi`]
//! is the CSI proxy, a sidecar of a driver's node plugin. Every
//! system call is in the `fuse-supervisor-sys` crate.
#![forbid(unsafe_code)]

pub mod csi;
#[cfg(feature = "testbed")]
pub mod demo;
#[cfg(feature = "testbed")]
pub mod demofs;
pub mod errors;
pub mod heal;
pub mod health;
pub mod kube;
pub mod metrics;
pub mod model;
pub mod plan;
pub mod report;
pub mod shutdown;
pub mod sidecar;
pub mod status;
pub mod stop_point;
pub mod supervisor;
#[cfg(feature = "testbed")]
pub mod testbed;
pub mod watch;
pub mod webhook;
