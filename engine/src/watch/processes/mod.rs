//! Process watchers: report the exit of the processes the caller names, as
//! typed events from a thread that sleeps in the kernel.
//!
//! A dead FUSE daemon changes nothing in the mount table, so its death is
//! seen here. Two backends behind one trait, [`ProcessWatcher`]:
//!
//! - [`ProcConnectorWatcher`]: the netlink process connector, node-wide, for
//!   the hostPID DaemonSet. One socket and one thread for the process
//!   ([`ProcessConnector`]), whatever the number of watchers and watched
//!   pids; the kernel filters to exit (and exec) events on 6.6+, each
//!   watcher to its own pids. Exit codes are exact, the death time is the
//!   kernel's.
//! - [`PidfdWatcher`]: one pidfd per watched process, in any pid namespace
//!   (a sidecar with `shareProcessNamespace`).
//!
//! Watchers are thin adapters: they decode and pass on, and decide nothing.
//! Both guard against pid reuse: the caller names a [`ProcessId`] (pid and
//! start time, as read when the process was identified), and a watch of a
//! pid that now belongs to another process is refused.
//!
//! [`fuse_server`] finds the processes serving a FUSE mount, to watch.
use std::io;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::watch::thread::ThreadError;

pub use fuse_supervisor_sys::process::ExitStatus;

mod connector;
pub mod fuse_server;
mod pidfd;

pub use connector::{
    ConnectorOptions, ExecReports, ProcConnectorWatcher, ProcessConnector, Subscription, host_network_namespace,
};
pub use pidfd::PidfdWatcher;

/// A process as identified at one moment: its pid, and its start time (in
/// clock ticks after boot, field 22 of `/proc/<pid>/stat`), which tells it
/// from a later process that reused the pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProcessId {
    pub pid: u32,
    pub start_time: u64,
}

impl ProcessId {
    /// The process that has `pid` now, as `<proc_root>/<pid>/stat` says.
    pub fn of(proc_root: &Path, pid: u32) -> Result<ProcessId, ProcessWatchError> {
        match read_stat(proc_root, pid)? {
            Some(stat) => Ok(ProcessId { pid, start_time: stat.start_time }),
            None => Err(ProcessWatchError::Gone { pid }),
        }
    }
}

/// How a watcher learnt of an exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detection {
    /// The kernel reported it; `at` is when the process died (the proc
    /// connector's timestamp) or when the pidfd became readable.
    Event,
    /// Found gone while re-checking after lost events; `at` is when it was
    /// found, the death was earlier.
    Resync,
}

/// What a watcher reports.
#[derive(Debug)]
pub enum ProcessEvent {
    /// A watched process exited (its thread-group leader did, for the proc
    /// connector). Reported once; the pid is no longer watched afterwards.
    /// `status` is `None` when unknown: after a resync, or from a pidfd
    /// before the parent reaped the process or before Linux 6.15.
    Exited { pid: u32, status: Option<ExitStatus>, at: Instant, detection: Detection },
    /// A process called `execve` (proc connector only: a watched one, or any
    /// with [`ExecReports::All`]).
    Exec { pid: u32, at: Instant },
    /// The kernel dropped events (`ENOBUFS`). Watched processes found gone
    /// were reported as `Exited` just before; anything else the caller
    /// derives from events must be re-read.
    Lost,
    /// The watcher stopped on an error; nothing follows.
    Failed(ProcessWatchError),
}

/// Receives every [`ProcessEvent`] on the watcher's thread; returning
/// `false` stops the watcher.
pub type EventSink = Box<dyn FnMut(ProcessEvent) -> bool + Send>;

/// Which kernel source reports exits: the one choice every process watcher
/// of the agent makes (the daemons', the Job lifecycle's), and what a
/// watcher says it is, for logs and status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The netlink process connector: node-wide (hostPID, hostNetwork,
    /// CAP_NET_ADMIN before 6.6), exact exit codes, execs too.
    ProcConnector,
    /// One pidfd per watched process: any pid namespace (a sidecar with
    /// `shareProcessNamespace`), wake-ups for the watched processes only.
    Pidfd,
}

/// Watches a set of processes for their exit. Events go to the sink given
/// when the watcher was started; dropping the watcher stops its thread.
pub trait ProcessWatcher: Send + Sync {
    /// Starts watching `process`; its exit is reported once as
    /// [`ProcessEvent::Exited`]. Watching a watched pid again is a no-op.
    /// Refused with [`ProcessWatchError::Gone`] or
    /// [`ProcessWatchError::Reused`] if `process` is no longer running (it
    /// exited between being identified and now).
    fn watch(&self, process: ProcessId) -> Result<(), ProcessWatchError>;

    /// Stops watching `pid`; returns whether it was watched. An exit racing
    /// with this call may still be reported.
    fn unwatch(&self, pid: u32) -> bool;

    /// The watched processes, by pid.
    fn watched(&self) -> Vec<ProcessId>;

    fn backend(&self) -> Backend;
}

#[derive(Debug, thiserror::Error)]
pub enum ProcessWatchError {
    #[error("cannot open a netlink process connector socket")]
    Socket(#[source] io::Error),
    #[error("cannot set the process connector's receive buffer to {bytes} bytes")]
    ReceiveBuffer {
        bytes: usize,
        #[source]
        source: io::Error,
    },
    #[error(
        "cannot join the process connector's multicast group (kernels before 6.6 need CAP_NET_ADMIN: add it to the container's capabilities)"
    )]
    Join(#[source] io::Error),
    #[error(
        "the process connector is not reachable: it exists only in the host's network namespace (set hostNetwork: true)"
    )]
    NotHostNetwork(#[source] io::Error),
    #[error(
        "cannot join the network namespace {path} to subscribe to the process connector (needs hostPID and CAP_SYS_ADMIN)"
    )]
    NetworkNamespace {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot send the subscription to the process connector")]
    Send(#[source] io::Error),
    #[error(
        "no acknowledgement from the process connector within {waited:?}: the kernel answers only processes in the host's pid and user namespaces (set hostPID: true, and do not run in a user namespace)"
    )]
    NoAcknowledgement { waited: std::time::Duration },
    #[error(
        "the process connector refused the subscription with errno {errno} (kernels before 6.6 need CAP_NET_ADMIN: add it to the container's capabilities)"
    )]
    Refused { errno: i32 },
    #[error("cannot read the process connector's acknowledgement")]
    Acknowledgement(#[source] io::Error),
    #[error("cannot set up epoll for the process watcher")]
    Poll(#[source] io::Error),
    #[error(transparent)]
    Thread(#[from] ThreadError),
    #[error("waiting for process events failed")]
    Wait(#[source] io::Error),
    #[error("reading process connector events failed")]
    Receive(#[source] io::Error),
    #[error("cannot open a pidfd for process {pid}")]
    Pidfd {
        pid: u32,
        #[source]
        source: io::Error,
    },
    #[error("process {pid} is not running")]
    Gone { pid: u32 },
    #[error("pid {pid} now belongs to another process (started at tick {found}, expected {expected})")]
    Reused { pid: u32, expected: u64, found: u64 },
    #[error("cannot read {path}")]
    Proc {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// `processes` by pid.
fn sorted(processes: impl Iterator<Item = ProcessId>) -> Vec<ProcessId> {
    let mut processes: Vec<ProcessId> = processes.collect();
    processes.sort_unstable();
    processes
}

/// The fields of `/proc/<pid>/stat` the watchers need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stat {
    /// `R`, `S`, `D`, `Z` (zombie: exited, not reaped), `X` (dead)...
    pub state: char,
    /// The parent's pid (0 for the first process of a pid namespace's
    /// parent, as seen from its own).
    pub ppid: u32,
    pub start_time: u64,
}

impl Stat {
    /// Parses a stat line; the command name (field 2) may hold spaces and
    /// parentheses, so fields are counted from the last `)`.
    pub(crate) fn parse(line: &str) -> Option<Stat> {
        let after_name = &line[line.rfind(')')? + 1..];
        let mut fields = after_name.split_ascii_whitespace();
        // Field 3 is the state, 4 the parent; start time is field 22, 18
        // further on.
        let state = fields.next()?.chars().next()?;
        let ppid = fields.next()?.parse().ok()?;
        let start_time = fields.nth(17)?.parse().ok()?;
        Some(Stat { state, ppid, start_time })
    }

    pub(crate) fn exited(&self) -> bool {
        matches!(self.state, 'Z' | 'X')
    }
}

/// `<proc_root>/<pid>/stat`, or `None` if there is no such process.
pub(crate) fn read_stat(proc_root: &Path, pid: u32) -> Result<Option<Stat>, ProcessWatchError> {
    let path = proc_root.join(pid.to_string()).join("stat");
    match std::fs::read_to_string(&path) {
        Ok(line) => Ok(Stat::parse(&line)),
        // ESRCH: the process went away between open and read.
        Err(err) if err.kind() == io::ErrorKind::NotFound || err.raw_os_error() == Some(ESRCH) => Ok(None),
        Err(source) => Err(ProcessWatchError::Proc { path, source }),
    }
}

/// `ESRCH` ("no such process"), the same number on every Linux architecture.
const ESRCH: i32 = 3;

/// Whether `process` still runs: `Ok` if so, else the refusal to report.
/// With `zombie_ok`, an exited but unreaped process counts as running (a
/// pidfd on it reports the exit at once).
pub(crate) fn check_running(proc_root: &Path, process: ProcessId, zombie_ok: bool) -> Result<(), ProcessWatchError> {
    let ProcessId { pid, start_time: expected } = process;
    match read_stat(proc_root, pid)? {
        None => Err(ProcessWatchError::Gone { pid }),
        Some(stat) if stat.start_time != expected => {
            Err(ProcessWatchError::Reused { pid, expected, found: stat.start_time })
        }
        Some(stat) if stat.exited() && !zombie_ok => Err(ProcessWatchError::Gone { pid }),
        Some(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_line_with_awkward_command_name() {
        let line = "4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 200 \
                    18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";
        assert_eq!(Stat::parse(line), Some(Stat { state: 'S', ppid: 1, start_time: 987654 }));
        assert_eq!(Stat::parse("4242 (x) Z 1 2"), None);
    }

    #[test]
    fn own_process_is_running_and_a_changed_start_time_is_refused() {
        let proc_root = Path::new("/proc");
        let me = ProcessId::of(proc_root, std::process::id()).unwrap();
        check_running(proc_root, me, false).unwrap();
        let other = ProcessId { start_time: me.start_time + 1, ..me };
        let refused = check_running(proc_root, other, false).unwrap_err();
        assert!(matches!(refused, ProcessWatchError::Reused { .. }), "{refused:?}");
        assert!(refused.to_string().starts_with(&format!("pid {} now belongs to another process", me.pid)));
    }

    #[test]
    fn setup_errors_name_what_is_missing() {
        let no_ack = ProcessWatchError::NoAcknowledgement { waited: std::time::Duration::from_secs(2) };
        assert!(no_ack.to_string().contains("hostPID: true"), "{no_ack}");
        let netns = ProcessWatchError::NotHostNetwork(io::Error::from_raw_os_error(111));
        assert!(netns.to_string().contains("hostNetwork: true"), "{netns}");
        let refused = ProcessWatchError::Refused { errno: 1 };
        assert!(refused.to_string().contains("CAP_NET_ADMIN"), "{refused}");
        let join = ProcessWatchError::Join(io::Error::from_raw_os_error(1));
        assert!(join.to_string().contains("CAP_NET_ADMIN"), "{join}");
    }
}
