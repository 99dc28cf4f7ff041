//! fuse-supervisor: heals the FUSE bind mounts of Kubernetes pods when the
//! FUSE daemon behind them restarts.
#![forbid(unsafe_code)]

pub mod confirm;
pub mod daemons;
#[cfg(feature = "testbed")]
pub mod demo;
#[cfg(feature = "testbed")]
pub mod demofs;
pub mod events;
pub mod heal;
pub mod health;
pub mod job;
pub mod kubelet;
pub mod layout;
pub mod locate;
pub mod metrics;
pub mod mountinfo;
pub mod plan;
pub mod pods;
pub mod priority;
pub mod probe;
pub mod process_watch;
pub mod report;
pub mod sidecar;
pub mod state;
pub mod status;
pub mod supervisor;
pub mod table;
#[cfg(feature = "testbed")]
pub mod testbed;
pub mod watch;
pub mod webhook;
