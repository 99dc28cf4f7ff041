//! The serverless Job lifecycle: ends the FUSE container of a pod whose
//! application containers have all finished, so that the pod (and its Job)
//! reaches Completed.
//!
//! A FUSE sidecar never exits by itself; a Job's pod with one stays
//! Running after its work is done. Fluid answers this with a controller
//! that list-watches every pod through the API server and `kubectl exec`s
//! `umount` into the sidecar. Here the node agent does it with what the
//! node already shows, on a thread of its own:
//!
//! - the kubelet's `/pods` (no API-server list or watch): which pods
//!   qualify (a label selector, or one pod in sidecar mode), their
//!   `restartPolicy`, containers, container IDs and exit codes;
//! - `/proc`: which processes are whose container (`containers`: the
//!   container ID in `/proc/<pid>/cgroup`), and which of them serve a FUSE
//!   connection (`watch::processes::fuse_server`): that container is the
//!   FUSE container, whatever its name;
//! - a process watcher on each running application container's first
//!   process, so the end of the work is seen when it happens, and the
//!   kubelet is asked once then to confirm it (its answer's terminated
//!   states and exit codes go to the log).
//!
//! Then the FUSE mounts of that connection are unmounted (`unmount`: each
//! resolved without links and detached through the descriptor checked),
//! which ends a FUSE daemon cleanly; if it has not exited after the grace period
//! it gets SIGTERM, and SIGKILL after another.
//!
//! Left alone: `restartPolicy: Always` (such a pod never completes);
//! `OnFailure` while a container's last exit was non-zero (the kubelet
//! restarts it); FUSE containers that are native sidecars (init containers
//! with `restartPolicy: Always`, which the kubelet stops by itself).
mod assess;
mod containers;
mod fuse_container;
mod lifecycle;
mod selector;
mod unmount;

use std::path::PathBuf;
use std::time::Duration;

pub use assess::{AppExit, Assessment, Exits, Running, assess};
pub use containers::{ContainerProcess, ContainerProcesses, ScanError};
pub use fuse_supervisor_engine::kube::pods::runtime_id;
pub use lifecycle::JobLifecycle;
pub use selector::{LabelSelector, SelectorError};
pub use unmount::{
    PointError, Recorded, RecordedMount, UnmountError, Unmounted, record_mounts, unmount_devices, unmount_recorded,
};

use fuse_supervisor_engine::kube::Kubelet;
use fuse_supervisor_engine::watch::processes::Backend;

/// Fluid's label for pods whose injected FUSE sidecar should end with them.
pub const DEFAULT_SELECTOR: &str = "done.sidecar.fluid.io/inject=true";

/// Which pods the lifecycle manages.
#[derive(Debug, Clone)]
pub enum JobScope {
    /// Every pod on the node whose labels match (the DaemonSet).
    Node(LabelSelector),
    /// Only this pod (sidecar mode); its own container is not an app.
    Pod { uid: String },
}

/// How the lifecycle is set up.
#[derive(Debug, Clone)]
pub struct JobConfig {
    pub kubelet: Kubelet,
    pub scope: JobScope,
    /// How long the FUSE daemon may take to exit after its unmount, and
    /// again after SIGTERM, before the next signal.
    pub grace: Duration,
    /// Which process watcher sees the application containers end.
    pub watcher: Backend,
    /// `/proc` of the pid namespace the pods' processes are in.
    pub proc_root: PathBuf,
    /// The supervisor's mount namespace: FUSE mounts of an ended container
    /// are unmounted there as well as in the daemon's own.
    pub mount_namespace: PathBuf,
    /// New directories under `<kubelet_root>/pods` (in `mount_namespace`)
    /// prompt a look at the kubelet: a new pod.
    pub kubelet_root: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error(transparent)]
    Kubelet(#[from] fuse_supervisor_engine::kube::KubeletError),
    #[error(transparent)]
    Watcher(#[from] fuse_supervisor_engine::watch::processes::ProcessWatchError),
    #[error("cannot set up the job lifecycle's {what}")]
    Setup {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Thread(#[from] fuse_supervisor_engine::watch::thread::ThreadError),
}
