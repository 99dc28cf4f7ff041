//! fuse-supervisor, the node agent: heals the FUSE bind mounts of Kubernetes
//! pods when the FUSE daemon behind them restarts.
//!
//! The CLI (`src/bin/`) starts a [`supervisor`] (node mode) or a [`sidecar`];
//! their loops drive the `fuse-supervisor-engine` crate (the model, the plan,
//! kernel watches, heals, the kubelet client) and report through [`events`]
//! and [`metrics`]; [`job`] is the Job lifecycle of FUSE sidecars, [`status`]
//! the `status` command. Every system call is in the `fuse-supervisor-sys`
//! crate.
#![forbid(unsafe_code)]

pub mod events;
pub mod job;
pub mod metrics;
pub mod sidecar;
pub mod status;
pub mod supervisor;
