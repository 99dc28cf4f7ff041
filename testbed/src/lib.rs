//! The test world of fuse-supervisor: private mount namespaces and
//! container-model processes, shared by the integration tests, the demo and
//! the benches; its programs (the built-in FUSE filesystem [`demofs`], the
//! container model, the CSI node plugin, the [`demo`]) run as
//! `fuse-supervisor-testbed` ([`programs`]).
//!
//! A [`Sandbox`] is a mount namespace of its own with a node-like layout
//! (shared tmpfs, `kubelet/pods`, `runtime`); a [`ContainerReader`] is a
//! process made like a runc container (see [`container`]) that reads one
//! volume in a loop and reports what it sees. A [`kubelet::KubeletStandIn`]
//! answers `/pods` over HTTPS like a node's kubelet; an
//! [`apiserver::ApiServerStandIn`] takes Events like the API server. A
//! [`tenant::TenantFuse`] and [`tenant::cover_with_tmpfs`] are a hostile
//! tenant's mounts inside a container's namespace.
pub mod admission;
pub mod apiserver;
pub mod bomb;
pub mod cgroup;
pub mod container;
pub mod cri;
pub mod csi;
pub mod demo;
pub mod demofs;
pub mod fuzz;
pub mod kubelet;
mod logs;
pub mod node;
mod observe;
pub mod programs;
mod reader;
pub mod runc;
mod sandbox;
pub mod scenario;
pub mod storm;
pub mod subpath;
mod supervisor_process;
pub mod synthetic;
pub mod system;
pub mod tenant;
pub mod userns;

pub use logs::CapturedLogs;
pub use observe::{series_value, unix_socket_listens};
pub use reader::{ContainerReader, Observation, Outcome};
pub use sandbox::{Sandbox, SandboxChild};
pub use synthetic::synthetic_table;

use std::path::PathBuf;
use std::time::Duration;

/// What can go wrong building or observing the test world.
#[derive(Debug, thiserror::Error)]
pub enum TestbedError {
    #[error("cannot create sandbox directory {path}")]
    CreateRoot {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the sandbox thread")]
    StartThread(#[source] std::io::Error),
    #[error("sandbox setup failed: {step}")]
    Setup {
        step: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot spawn {program} in the sandbox")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot bind {source_path} onto {target}")]
    Bind {
        source_path: PathBuf,
        target: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("container reader {name} has no stdout pipe")]
    NoStdout { name: String },
    #[error("container reader {name} saw nothing matching within {waited:?}; history:\n{history}")]
    Timeout { name: String, waited: Duration, history: String },
    #[error("container reader {name} exited before anything matched; history:\n{history}")]
    ReaderExited { name: String, history: String },
}

/// The test world's own binary, `fuse-supervisor-testbed`, which runs its
/// programs (the built-in FUSE filesystem, the container model…): this
/// process when it is that binary, else the one Cargo builds beside the
/// test or bench that runs (`target/<profile>/`).
pub fn programs_binary() -> std::io::Result<PathBuf> {
    beside_this_program(PROGRAMS_BINARY)
}

const PROGRAMS_BINARY: &str = "fuse-supervisor-testbed";

/// `name`: this process's own binary if so named, else the binary of that
/// name in this one's directory or the one above it (tests and benches run
/// from `target/<profile>/deps/`).
pub(crate) fn beside_this_program(name: &str) -> std::io::Result<PathBuf> {
    let this = std::env::current_exe()?;
    if this.file_name().is_some_and(|own| own == name) {
        return Ok(this);
    }
    let dir = this.parent().unwrap_or(&this);
    let candidates = [dir.join(name), dir.parent().unwrap_or(dir).join(name)];
    candidates.iter().find(|path| path.is_file()).cloned().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no {name} beside {}: build it (cargo build --features testbed --bins)", this.display()),
        )
    })
}
