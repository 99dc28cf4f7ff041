//! The proc-connector backend: one netlink socket for the whole node.
use std::collections::HashMap;
use std::io;
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
    /// None.
    Off,
    /// Execs of watched processes (a daemon that re-executes itself).
    Watched,
    /// Every exec on the node (to discover daemons as they start).
    All,
}

/// How to open the process connector.
#[derive(Debug, Clone)]
pub struct ConnectorOptions {
    /// Socket receive buffer asked for, in bytes (`None`: the system's
    /// default, `net.core.rmem_default`). Events beyond it are lost until
    /// the watcher reads: that is reported as [`ProcessEvent::Lost`].
    pub receive_buffer: Option<usize>,
    /// Ask the kernel to drop every event type but exit (and exec) before
    /// queueing (Linux 6.6+; ignored before).
    pub kernel_filter: bool,
    /// Whether exec events are received at all: without them, the kernel
    /// filter asks for exits only, and no watcher gets an exec.
    pub execs: bool,
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
}

impl Default for ConnectorOptions {
    fn default() -> Self {
        ConnectorOptions {
            // A few seconds of heavy churn (each queued event costs ~1 KiB
            // of buffer) without a loss.
            receive_buffer: Some(4 << 20),
            kernel_filter: true,
            execs: true,
            ack_timeout: Duration::from_secs(2),
            proc_root: PathBuf::from("/proc"),
            network_namespace: None,
        }
    }
}

/// What one watcher of the connector wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Subscription {
    pub exec: ExecReports,
    /// How late its events may come: after each batch the connector waits
    /// the shortest window of its watchers before it reads again, so that a
    /// storm of events is read many to a wake-up; None (the default) reads
    /// each event as it comes, for whoever needs it at once (a daemon's
    /// death).
    pub batch_window: Option<Duration>,
}

impl Default for Subscription {
    fn default() -> Self {
        Subscription { exec: ExecReports::Watched, batch_window: None }
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

/// One watcher's pids, what it passes on and where to: shared by its
/// [`ProcessWatcher`] calls and the connector's thread.
struct Subscriber {
    proc_root: PathBuf,
    subscription: Subscription,
    /// pid → start time.
    watched: Mutex<HashMap<u32, u64>>,
    sink: Mutex<EventSink>,
}

impl Subscriber {
    fn new(proc_root: PathBuf, subscription: Subscription, sink: EventSink) -> Self {
        Subscriber { proc_root, subscription, watched: Mutex::default(), sink: Mutex::new(sink) }
    }

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
                let report = match self.subscription.exec {
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

    /// Passes on what it wants of one read; false once its sink said stop.
    fn deliver(&self, batch: &[TimedEvent], lost: bool) -> bool {
        let mut sink = self.sink.lock().unwrap_or_else(PoisonError::into_inner);
        batch.iter().filter_map(|timed| self.translate(timed)).all(&mut *sink)
            && (!lost || self.resync().into_iter().chain([ProcessEvent::Lost]).all(&mut *sink))
    }

    fn fail(&self, err: ProcessWatchError) {
        (self.sink.lock().unwrap_or_else(PoisonError::into_inner))(ProcessEvent::Failed(err));
    }
}

const EVENTS: u64 = 1;
const SHUTDOWN: u64 = 2;

/// The netlink process connector (see `fuse_supervisor_sys::proc_connector`):
/// one socket and one thread for the whole process, shared by every
/// [`ProcConnectorWatcher`] made from it, so that each kernel event wakes
/// one thread and is decoded once however many parts of the agent watch
/// processes (the daemons, the namespaces, a Job). Needs the host's pid,
/// user and network namespaces (hostPID, hostNetwork), and CAP_NET_ADMIN
/// before Linux 6.6. Clones share it; it closes with its last clone and
/// watcher.
#[derive(Clone)]
pub struct ProcessConnector {
    hub: Arc<Hub>,
}

struct Hub {
    subscribers: Arc<Subscribers>,
    proc_root: PathBuf,
    kernel_filter: bool,
    receive_buffer: usize,
    // Only its drop matters: it stops the thread.
    _thread: Watching,
}

#[derive(Default)]
struct Subscribers {
    list: Mutex<Vec<Arc<Subscriber>>>,
    /// Kernel events decoded so far, of any type and any process.
    decoded: AtomicU64,
}

impl Subscribers {
    fn list(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Subscriber>>> {
        self.list.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn remove(&self, subscriber: &Arc<Subscriber>) {
        self.list().retain(|other| !Arc::ptr_eq(other, subscriber));
    }
}

impl ProcessConnector {
    /// Subscribes (waiting for the kernel's acknowledgement, so a missing
    /// privilege fails here) and starts the thread.
    pub fn open(options: ConnectorOptions) -> Result<Self, ProcessWatchError> {
        let types = EventTypes { exit: true, exec: options.execs, fork: false };
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
        // The pause between batches ends early only for the stop.
        let pause = Poller::new().map_err(ProcessWatchError::Poll)?;
        pause.add_readable(waker.as_fd(), SHUTDOWN).map_err(ProcessWatchError::Poll)?;
        let subscribers = Arc::new(Subscribers::default());
        let thread_subscribers = Arc::clone(&subscribers);
        let thread =
            Watching::start("procwatch", waker, move || run(&connector, &poller, &pause, &thread_subscribers))?;
        let hub = Hub { subscribers, proc_root: options.proc_root, kernel_filter, receive_buffer, _thread: thread };
        Ok(ProcessConnector { hub: Arc::new(hub) })
    }

    /// A watcher of its own pids, on this connector's socket and thread.
    /// Its events go to `sink`, on that thread.
    pub fn watcher(&self, subscription: Subscription, sink: EventSink) -> ProcConnectorWatcher {
        let subscriber = Arc::new(Subscriber::new(self.hub.proc_root.clone(), subscription, sink));
        self.hub.subscribers.list().push(Arc::clone(&subscriber));
        ProcConnectorWatcher { subscriber, connector: self.clone() }
    }

    /// Whether the kernel filters event types for this socket (6.6+).
    pub fn kernel_filter(&self) -> bool {
        self.hub.kernel_filter
    }

    /// The receive buffer the kernel granted, in bytes (its own accounting:
    /// twice what was asked, capped by `rmem_max` without CAP_NET_ADMIN).
    pub fn receive_buffer(&self) -> usize {
        self.hub.receive_buffer
    }

    /// Kernel events decoded so far, of any type and any process: what the
    /// thread's CPU time is spent on.
    pub fn events_decoded(&self) -> u64 {
        self.hub.subscribers.decoded.load(Ordering::Relaxed)
    }
}

/// Watches processes through the [`ProcessConnector`] it was made from.
///
/// An exit is the exit of the thread-group leader: a process whose main
/// thread ends early while other threads go on is reported then.
pub struct ProcConnectorWatcher {
    subscriber: Arc<Subscriber>,
    connector: ProcessConnector,
}

impl ProcConnectorWatcher {
    /// Opens a connector of its own: for a process with one watcher.
    pub fn start(
        options: ConnectorOptions,
        subscription: Subscription,
        sink: EventSink,
    ) -> Result<Self, ProcessWatchError> {
        Ok(ProcessConnector::open(options)?.watcher(subscription, sink))
    }

    /// The connector it shares.
    pub fn connector(&self) -> &ProcessConnector {
        &self.connector
    }
}

impl Drop for ProcConnectorWatcher {
    fn drop(&mut self) {
        self.connector.hub.subscribers.remove(&self.subscriber);
    }
}

impl ProcessWatcher for ProcConnectorWatcher {
    fn watch(&self, process: ProcessId) -> Result<(), ProcessWatchError> {
        let ProcessId { pid, start_time } = process;
        if self.subscriber.watched().insert(pid, start_time) == Some(start_time) {
            return Ok(());
        }
        // Checked after inserting: an exit from now on is caught by the
        // thread; one before shows here. Whoever removes the pid reports.
        match check_running(&self.subscriber.proc_root, process, false) {
            Ok(()) => Ok(()),
            Err(err) if self.subscriber.watched().remove(&pid).is_some() => Err(err),
            // The thread saw the exit first and reported it.
            Err(_) => Ok(()),
        }
    }

    fn unwatch(&self, pid: u32) -> bool {
        self.subscriber.watched().remove(&pid).is_some()
    }

    fn watched(&self) -> Vec<ProcessId> {
        sorted(self.subscriber.watched().iter().map(|(&pid, &start_time)| ProcessId { pid, start_time }))
    }

    fn backend(&self) -> Backend {
        Backend::ProcConnector
    }
}

/// The connector's thread: sleeps in epoll until the socket or the waker is
/// readable, and hands each read to every watcher.
fn run(connector: &ProcConnector, poller: &Poller, pause: &Poller, subscribers: &Subscribers) {
    let mut ready = Vec::with_capacity(2);
    let mut batch = Vec::with_capacity(64);
    // Every watcher is told why the thread stopped.
    let fail_all = |err: io::Error, wrap: fn(io::Error) -> ProcessWatchError| {
        for subscriber in subscribers.list().drain(..) {
            let copy = match err.raw_os_error() {
                Some(errno) => io::Error::from_raw_os_error(errno),
                None => io::Error::new(err.kind(), err.to_string()),
            };
            subscriber.fail(wrap(copy));
        }
    };
    loop {
        if let Err(err) = poller.wait(&mut ready, None) {
            fail_all(err, ProcessWatchError::Wait);
            return;
        }
        if ready.contains(&SHUTDOWN) {
            return;
        }
        batch.clear();
        let outcome = match connector.read_events(&mut batch) {
            Ok(outcome) => outcome,
            Err(err) => {
                fail_all(err, ProcessWatchError::Receive);
                return;
            }
        };
        subscribers.decoded.fetch_add(batch.len() as u64, Ordering::Relaxed);
        // Delivered outside the list's lock: a sink may make or drop a watcher.
        let current: Vec<Arc<Subscriber>> = subscribers.list().clone();
        for subscriber in &current {
            if !subscriber.deliver(&batch, outcome == ReadOutcome::Lost) {
                subscribers.remove(subscriber);
            }
        }
        let window = current.iter().map(|subscriber| subscriber.subscription.batch_window.unwrap_or_default()).min();
        if let Some(window) = window.filter(|window| !window.is_zero()) {
            match pause.wait(&mut ready, Some(window)) {
                Ok(()) if ready.contains(&SHUTDOWN) => return,
                Ok(()) => {}
                Err(err) => {
                    fail_all(err, ProcessWatchError::Wait);
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

    fn shared(exec: ExecReports, watched: &[(u32, u64)]) -> Subscriber {
        let subscriber =
            Subscriber::new(PathBuf::from("/proc"), Subscription { exec, batch_window: None }, Box::new(|_| true));
        subscriber.watched().extend(watched.iter().copied());
        subscriber
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
