//! The proc-connector backend: one netlink socket for the whole node.
use std::collections::HashMap;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use fuse_supervisor_sys::poll::Poller;
use fuse_supervisor_sys::proc_connector::{
    self as sys, EventTypes, ProcConnector, ProcEvent, ReadOutcome, SubscribeError, TimedEvent,
};
use tracing::warn;

use crate::errors::chain;
use crate::watch::thread::{ThreadError, Watching};

use super::{
    Backend, Detection, EventSink, ProcessEvent, ProcessId, ProcessWatchError, ProcessWatcher, check_running, sorted,
};

/// Which exec events to pass on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecReports {
    /// None: the kernel filter then asks for exit events only.
    Off,
    /// Execs of watched processes (a daemon that re-executes itself).
    Watched,
    /// Every exec on the node (to discover daemons as they start).
    All,
}

/// How to set up a [`ProcConnectorWatcher`].
#[derive(Debug, Clone)]
pub struct ConnectorOptions {
    /// Socket receive buffer asked for, in bytes (`None`: the system's
    /// default, `net.core.rmem_default`). Events beyond it are lost until
    /// the watcher reads: that is reported as [`ProcessEvent::Lost`].
    pub receive_buffer: Option<usize>,
    /// Ask the kernel to drop every event type but exit (and exec) before
    /// queueing (Linux 6.6+; ignored before).
    pub kernel_filter: bool,
    pub exec: ExecReports,
    /// How long the kernel may take to acknowledge the subscription.
    pub ack_timeout: Duration,
    /// Where the pids of the events are processes: the host's `/proc`
    /// (hostPID), since the connector speaks in host pids.
    pub proc_root: PathBuf,
    /// The network namespace to subscribe from, when it is not this
    /// process's: the connector answers only in the host's, so a pod
    /// without hostNetwork subscribes through `/proc/1/ns/net` (hostPID and
    /// CAP_SYS_ADMIN), on a thread that joins it for the subscription alone.
    pub network_namespace: Option<PathBuf>,
    /// After each batch, wait this long before reading again, so that a
    /// storm of events is read in batches of many (one wake-up each)
    /// rather than one by one; None reads each event as it comes, for
    /// whoever needs it at once (a daemon's death).
    pub batch_window: Option<Duration>,
}

impl Default for ConnectorOptions {
    fn default() -> Self {
        ConnectorOptions {
            // A few seconds of heavy churn (each queued event costs ~1 KiB
            // of buffer) without a loss.
            receive_buffer: Some(4 << 20),
            kernel_filter: true,
            exec: ExecReports::Watched,
            ack_timeout: Duration::from_secs(2),
            proc_root: PathBuf::from("/proc"),
            network_namespace: None,
            batch_window: None,
        }
    }
}

/// The network namespace to subscribe to the connector from: the host's
/// (`<proc_root>/1/ns/net`, with hostPID) when this process is elsewhere (a
/// pod without hostNetwork), else none.
pub fn host_network_namespace(proc_root: &Path) -> Option<PathBuf> {
    let host = proc_root.join("1/ns/net");
    let inode = |path: &Path| std::fs::metadata(path).map(|meta| meta.ino()).ok();
    let (own, host_inode) = (inode(Path::new("/proc/self/ns/net")), inode(&host));
    (host_inode.is_some() && own != host_inode).then_some(host)
}

/// The watched pids and what to pass on: shared by the caller's
/// [`ProcessWatcher`] calls and the watcher thread.
struct Shared {
    proc_root: PathBuf,
    exec: ExecReports,
    /// pid → start time.
    watched: Mutex<HashMap<u32, u64>>,
    /// Kernel events decoded so far, of any type and any process.
    decoded: AtomicU64,
}

impl Shared {
    fn watched(&self) -> std::sync::MutexGuard<'_, HashMap<u32, u64>> {
        self.watched.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The event to pass on for a kernel event, if any. An exit is passed on
    /// by whoever removes the pid from the set, so exactly once.
    fn translate(&self, timed: &TimedEvent) -> Option<ProcessEvent> {
        match timed.event {
            // A thread that is not the leader: the process lives on.
            ProcEvent::Exit { pid, tgid, .. } if pid != tgid => None,
            ProcEvent::Exit { tgid, status, .. } => self.watched().remove(&tgid).map(|_| ProcessEvent::Exited {
                pid: tgid,
                status: Some(status),
                at: timed.instant(),
                detection: Detection::Event,
            }),
            ProcEvent::Exec { tgid, .. } => {
                let report = match self.exec {
                    ExecReports::Off => false,
                    ExecReports::Watched => self.watched().contains_key(&tgid),
                    ExecReports::All => true,
                };
                report.then(|| ProcessEvent::Exec { pid: tgid, at: timed.instant() })
            }
            ProcEvent::Fork { .. } | ProcEvent::Other { .. } => None,
        }
    }

    /// After lost events: every watched process that is gone, removed from
    /// the set, as `Exited` with an unknown status.
    fn resync(&self) -> Vec<ProcessEvent> {
        let now = Instant::now();
        let mut watched = self.watched();
        let mut gone = Vec::new();
        watched.retain(|&pid, &mut start_time| {
            match check_running(&self.proc_root, ProcessId { pid, start_time }, false) {
                Ok(()) => true,
                Err(ProcessWatchError::Gone { .. } | ProcessWatchError::Reused { .. }) => {
                    gone.push(pid);
                    false
                }
                Err(err) => {
                    // Cannot tell: keep watching; the next loss re-checks.
                    warn!(pid, err = %chain(&err), "cannot re-check a watched process after lost events");
                    true
                }
            }
        });
        gone.sort_unstable();
        gone.into_iter()
            .map(|pid| ProcessEvent::Exited { pid, status: None, at: now, detection: Detection::Resync })
            .collect()
    }
}

const EVENTS: u64 = 1;
const SHUTDOWN: u64 = 2;

/// Watches processes through the netlink process connector (see
/// `fuse_supervisor_sys::proc_connector`). Needs the host's pid, user and
/// network namespaces (hostPID, hostNetwork), and CAP_NET_ADMIN before
/// Linux 6.6.
///
/// An exit is the exit of the thread-group leader: a process whose main
/// thread ends early while other threads go on is reported then.
pub struct ProcConnectorWatcher {
    shared: Arc<Shared>,
    // Only its drop matters: it stops the thread.
    _thread: Watching,
    kernel_filter: bool,
    receive_buffer: usize,
}

impl ProcConnectorWatcher {
    /// Subscribes (waiting for the kernel's acknowledgement, so a missing
    /// privilege fails here) and starts the watcher thread.
    pub fn start(options: ConnectorOptions, sink: EventSink) -> Result<Self, ProcessWatchError> {
        let types = EventTypes { exit: true, exec: options.exec != ExecReports::Off, fork: false };
        let subscribe = || {
            ProcConnector::subscribe(sys::Options {
                receive_buffer: options.receive_buffer,
                filter: options.kernel_filter.then_some(types),
                ack_timeout: options.ack_timeout,
            })
            .map_err(|err| subscribe_error(err, options.receive_buffer.unwrap_or(0)))
        };
        let connector = match &options.network_namespace {
            None => subscribe()?,
            Some(namespace) => std::thread::scope(|scope| {
                let subscribed = std::thread::Builder::new().name("procwatch-net".into()).spawn_scoped(scope, || {
                    fuse_supervisor_sys::ns::join_network_namespace(namespace)
                        .map_err(|source| ProcessWatchError::NetworkNamespace { path: namespace.clone(), source })?;
                    subscribe()
                });
                let thread_error =
                    |source| ProcessWatchError::Thread(ThreadError::Spawn { name: "procwatch-net", source });
                subscribed
                    .map_err(thread_error)?
                    .join()
                    .unwrap_or_else(|_| Err(thread_error(std::io::Error::other("the subscribing thread panicked"))))
            })?,
        };
        let kernel_filter = connector.kernel_filter();
        let receive_buffer = connector.receive_buffer().map_err(ProcessWatchError::Receive)?;
        let poller = Poller::new().map_err(ProcessWatchError::Poll)?;
        let waker = Watching::stop_waker("procwatch")?;
        poller.add_readable(connector.as_fd(), EVENTS).map_err(ProcessWatchError::Poll)?;
        poller.add_readable(waker.as_fd(), SHUTDOWN).map_err(ProcessWatchError::Poll)?;
        let shared = Arc::new(Shared {
            proc_root: options.proc_root,
            exec: options.exec,
            watched: Mutex::default(),
            decoded: AtomicU64::new(0),
        });
        // The pause between batches ends early only for the stop.
        let pause = match options.batch_window {
            Some(window) => {
                let pause = Poller::new().map_err(ProcessWatchError::Poll)?;
                pause.add_readable(waker.as_fd(), SHUTDOWN).map_err(ProcessWatchError::Poll)?;
                Some((pause, window))
            }
            None => None,
        };
        let thread_shared = Arc::clone(&shared);
        let thread = Watching::start("procwatch", waker, move || {
            run(&connector, &poller, pause.as_ref(), &thread_shared, sink)
        })?;
        Ok(ProcConnectorWatcher { shared, _thread: thread, kernel_filter, receive_buffer })
    }

    /// Whether the kernel filters event types for this watcher (6.6+).
    pub fn kernel_filter(&self) -> bool {
        self.kernel_filter
    }

    /// The receive buffer the kernel granted, in bytes (its own accounting:
    /// twice what was asked, capped by `rmem_max` without CAP_NET_ADMIN).
    pub fn receive_buffer(&self) -> usize {
        self.receive_buffer
    }

    /// Kernel events decoded so far, of any type and any process: what the
    /// watcher's CPU time is spent on.
    pub fn events_decoded(&self) -> u64 {
        self.shared.decoded.load(Ordering::Relaxed)
    }
}

impl ProcessWatcher for ProcConnectorWatcher {
    fn watch(&self, process: ProcessId) -> Result<(), ProcessWatchError> {
        let ProcessId { pid, start_time } = process;
        if self.shared.watched().insert(pid, start_time) == Some(start_time) {
            return Ok(());
        }
        // Checked after inserting: an exit from now on is caught by the
        // thread; one before shows here. Whoever removes the pid reports.
        match check_running(&self.shared.proc_root, process, false) {
            Ok(()) => Ok(()),
            Err(err) if self.shared.watched().remove(&pid).is_some() => Err(err),
            // The thread saw the exit first and reported it.
            Err(_) => Ok(()),
        }
    }

    fn unwatch(&self, pid: u32) -> bool {
        self.shared.watched().remove(&pid).is_some()
    }

    fn watched(&self) -> Vec<ProcessId> {
        sorted(self.shared.watched().iter().map(|(&pid, &start_time)| ProcessId { pid, start_time }))
    }

    fn backend(&self) -> Backend {
        Backend::ProcConnector
    }
}

/// The watcher thread: sleeps in epoll until the socket or the waker is
/// readable.
fn run(
    connector: &ProcConnector,
    poller: &Poller,
    pause: Option<&(Poller, Duration)>,
    shared: &Shared,
    mut sink: EventSink,
) {
    let mut ready = Vec::with_capacity(2);
    let mut batch = Vec::with_capacity(64);
    loop {
        if let Err(err) = poller.wait(&mut ready, None) {
            sink(ProcessEvent::Failed(ProcessWatchError::Wait(err)));
            return;
        }
        if ready.contains(&SHUTDOWN) {
            return;
        }
        batch.clear();
        let outcome = match connector.read_events(&mut batch) {
            Ok(outcome) => outcome,
            Err(err) => {
                sink(ProcessEvent::Failed(ProcessWatchError::Receive(err)));
                return;
            }
        };
        shared.decoded.fetch_add(batch.len() as u64, Ordering::Relaxed);
        for event in batch.iter().filter_map(|timed| shared.translate(timed)) {
            if !sink(event) {
                return;
            }
        }
        if outcome == ReadOutcome::Lost {
            for event in shared.resync().into_iter().chain([ProcessEvent::Lost]) {
                if !sink(event) {
                    return;
                }
            }
        }
        if let Some((pause, window)) = pause {
            match pause.wait(&mut ready, Some(*window)) {
                Ok(()) if ready.contains(&SHUTDOWN) => return,
                Ok(()) => {}
                Err(err) => {
                    sink(ProcessEvent::Failed(ProcessWatchError::Wait(err)));
                    return;
                }
            }
        }
    }
}

/// The error for a failed subscription, naming what the deployment lacks.
fn subscribe_error(err: SubscribeError, bytes: usize) -> ProcessWatchError {
    /// `ECONNREFUSED`: no connector socket in this network namespace.
    const ECONNREFUSED: i32 = 111;
    match err {
        SubscribeError::Socket(source) => ProcessWatchError::Socket(source),
        SubscribeError::ReceiveBuffer(source) => ProcessWatchError::ReceiveBuffer { bytes, source },
        SubscribeError::Bind(source) => ProcessWatchError::Join(source),
        SubscribeError::Send(source) if source.raw_os_error() == Some(ECONNREFUSED) => {
            ProcessWatchError::NotHostNetwork(source)
        }
        SubscribeError::Send(source) => ProcessWatchError::Send(source),
        SubscribeError::Receive(source) => ProcessWatchError::Acknowledgement(source),
        SubscribeError::NoAck { waited } => ProcessWatchError::NoAcknowledgement { waited },
        SubscribeError::Refused { errno } => ProcessWatchError::Refused { errno },
    }
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::*;

    #[test]
    fn subscription_failures_name_what_the_deployment_lacks() {
        let cases = [
            (SubscribeError::NoAck { waited: Duration::from_secs(2) }, "hostPID: true"),
            (SubscribeError::Send(io::Error::from_raw_os_error(111)), "hostNetwork: true"),
            (SubscribeError::Refused { errno: 1 }, "CAP_NET_ADMIN"),
            (SubscribeError::Bind(io::Error::from_raw_os_error(1)), "CAP_NET_ADMIN"),
        ];
        for (err, names) in cases {
            let message = subscribe_error(err, 0).to_string();
            assert!(message.contains(names), "{message:?} should name {names}");
        }
        let other_send = subscribe_error(SubscribeError::Send(io::Error::from_raw_os_error(105)), 0);
        assert!(matches!(other_send, ProcessWatchError::Send(_)), "{other_send:?}");
    }

    fn shared(exec: ExecReports, watched: &[(u32, u64)]) -> Shared {
        Shared {
            proc_root: PathBuf::from("/proc"),
            exec,
            watched: Mutex::new(watched.iter().copied().collect()),
            decoded: AtomicU64::new(0),
        }
    }

    fn timed(event: ProcEvent) -> TimedEvent {
        TimedEvent { event, timestamp_ns: 0 }
    }

    #[test]
    fn only_watched_leaders_exits_are_passed_on_once() {
        let shared = shared(ExecReports::Watched, &[(10, 1)]);
        let status = fuse_supervisor_sys::process::ExitStatus::Exited(0);
        assert!(shared.translate(&timed(ProcEvent::Exit { pid: 11, tgid: 10, status })).is_none());
        assert!(shared.translate(&timed(ProcEvent::Exit { pid: 12, tgid: 12, status })).is_none());
        let exited = shared.translate(&timed(ProcEvent::Exit { pid: 10, tgid: 10, status }));
        assert!(
            matches!(exited, Some(ProcessEvent::Exited { pid: 10, status: Some(_), detection: Detection::Event, .. })),
            "{exited:?}"
        );
        assert!(shared.translate(&timed(ProcEvent::Exit { pid: 10, tgid: 10, status })).is_none());
    }

    #[test]
    fn exec_reports_follow_the_option() {
        let exec = |tgid| timed(ProcEvent::Exec { pid: tgid, tgid });
        let watched = shared(ExecReports::Watched, &[(10, 1)]);
        assert!(matches!(watched.translate(&exec(10)), Some(ProcessEvent::Exec { pid: 10, .. })));
        assert!(watched.translate(&exec(11)).is_none());
        assert!(shared(ExecReports::All, &[]).translate(&exec(11)).is_some());
        assert!(shared(ExecReports::Off, &[(10, 1)]).translate(&exec(10)).is_none());
    }

    #[test]
    fn resync_reports_gone_and_reused_pids_and_keeps_running_ones() {
        let me = ProcessId::of(std::path::Path::new("/proc"), std::process::id()).unwrap();
        // pid_max is at most 2^22: this pid cannot exist.
        let absent = 1 << 23;
        let shared = shared(ExecReports::Off, &[(me.pid, me.start_time), (absent, 5), (1, u64::MAX)]);
        let gone: Vec<u32> = shared
            .resync()
            .into_iter()
            .map(|event| match event {
                ProcessEvent::Exited { pid, status: None, detection: Detection::Resync, .. } => pid,
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(gone, vec![1, absent]);
        assert_eq!(shared.watched().keys().copied().collect::<Vec<_>>(), vec![me.pid]);
    }
}
