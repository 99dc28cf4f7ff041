//! Mount-table watchers: they say "the table changed"; fanotify's also hand
//! the decoded mount events over ([`MountEventFeed`]) for the loop's kept
//! table. What to do about them is decided there, not here.
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::errors::chain;
pub use fuse_supervisor_sys::fanotify::MountEvent;
use fuse_supervisor_sys::fanotify::{MountEventReader, MountEvents};
use fuse_supervisor_sys::mountinfo_poll::priority_pending;
use fuse_supervisor_sys::poll::{Poller, Waker};
pub use fuse_supervisor_sys::statmount::MountSummary;

#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("cannot watch mount table {what}")]
    Setup {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("waiting for mount-table events failed")]
    Wait(#[source] io::Error),
    #[error("cannot read fanotify mount events")]
    Read(#[source] io::Error),
    #[error("cannot re-arm the mount-table watcher")]
    Rearm(#[source] io::Error),
    #[error("cannot stop watching the mount namespace for a heal")]
    Pause(#[source] io::Error),
    #[error("cannot watch the mount namespace again after a heal")]
    Resume(#[source] io::Error),
}

/// What a watcher woke up for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    TableChanged,
    Shutdown,
}

/// How the loop learns that the mount table may have changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchMode {
    /// Kernel notifications, from the given source: no timer at all.
    Events(TableEvents),
    /// A full scan every `period` ([`PollWatcher`]), as polling healers
    /// do: for comparison, and as a last resort where notifications fail.
    Poll { period: Duration },
}

impl std::fmt::Display for WatchMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WatchMode::Events(TableEvents::Auto) => f.write_str("event"),
            WatchMode::Events(events) => write!(f, "event ({events})"),
            WatchMode::Poll { period } => write!(f, "poll every {period:?}"),
        }
    }
}

/// Which kernel notification wakes event mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TableEvents {
    /// `EPOLLPRI` on mountinfo ([`MountinfoWatcher`]): any kernel.
    Mountinfo,
    /// fanotify mount events ([`FanotifyWatcher`]): Linux 6.15+.
    Fanotify,
    /// fanotify where the kernel offers it for the namespace, else mountinfo.
    #[default]
    Auto,
}

impl std::fmt::Display for TableEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TableEvents::Mountinfo => "mountinfo",
            TableEvents::Fanotify => "fanotify",
            TableEvents::Auto => "auto",
        })
    }
}

/// A source of mount-table change notifications: [`MountinfoWatcher`],
/// [`FanotifyWatcher`], or [`PollWatcher`]'s timer.
///
/// After reporting [`Wake::TableChanged`] a watcher reports no other change
/// until its [`Rearm`] handle is called: a heal makes hundreds of changes,
/// and a watcher thread woken for each would compete for the CPU with it.
pub trait MountWatcher: Send {
    /// Blocks until the table changed (and the watcher is armed) or shutdown
    /// was asked for.
    fn wait(&mut self) -> Result<Wake, WatchError>;

    /// The handle that arms the watcher again, for the thread that reads the table.
    fn rearm_handle(&self) -> Arc<dyn Rearm>;

    /// Unique IDs of mounts the last reported change attached or moved, where
    /// the backend names them (fanotify; at most [`MountBatch::KEPT`]): the
    /// loop can look at a new mount before it reads the whole table. Empty
    /// when unknown.
    fn attached(&self) -> Vec<u64> {
        Vec::new()
    }
}

/// Arms a watcher again after it reported a change.
pub trait Rearm: Send + Sync {
    /// Call after taking a change report and before reading the table: a
    /// change before this call is in that read; one after it is reported.
    fn rearm(&self) -> Result<(), WatchError>;

    /// The loop is about to change the table itself (a heal: hundreds of
    /// mounts moved and detached) and reads it afterwards: a backend that
    /// costs the kernel work per change stops listening until
    /// [`Rearm::resume`]. Changes in between are never reported; the
    /// caller reads the table after resuming. A no-op for the others.
    fn pause(&self) -> Result<(), WatchError> {
        Ok(())
    }

    fn resume(&self) -> Result<(), WatchError> {
        Ok(())
    }
}

/// What the mount `unique_id` (one [`MountWatcher::attached`] named) is,
/// asked of the kernel now: `ENOENT` once it is gone, `ENOSYS` before
/// Linux 6.8.
pub fn describe_attached(unique_id: u64) -> io::Result<MountSummary> {
    fuse_supervisor_sys::statmount::mount_summary(unique_id)
}

/// Maps a setup failure to [`WatchError::Setup`] naming what failed.
fn setup(what: &'static str) -> impl FnOnce(io::Error) -> WatchError {
    move |source| WatchError::Setup { what: what.to_owned(), source }
}

const TABLE: u64 = 1;
const SHUTDOWN: u64 = 2;

/// Sleeps until the table's registration or the waker fires; shutdown wins.
fn wait_for_table(poller: &Poller, events: &mut Vec<u64>) -> Result<Wake, WatchError> {
    poller.wait(events, None).map_err(WatchError::Wait)?;
    if events.contains(&SHUTDOWN) {
        // Leave the waker set: every other waiter must see it too.
        return Ok(Wake::Shutdown);
    }
    Ok(Wake::TableChanged)
}

/// `EPOLLPRI` on a mountinfo file: the kernel flags it once per change of
/// the namespace. No timer: the thread sleeps until the kernel wakes it.
/// Registered one-shot: disarmed from each report until [`Rearm::rearm`].
pub struct MountinfoWatcher {
    table: Arc<MountinfoArm>,
    // The registration lives as long as the eventfd.
    _waker: Arc<Waker>,
    events: Vec<u64>,
}

/// The mountinfo file and the epoll instance it is registered with, shared
/// by the watcher thread (which waits) and the loop (which re-arms).
struct MountinfoArm {
    poller: Poller,
    // Kept open: the registration lives as long as the file.
    mountinfo: File,
}

impl MountinfoWatcher {
    /// `mountinfo` must be opened in the watched namespace.
    pub fn new(mountinfo: File, waker: Arc<Waker>) -> Result<Self, WatchError> {
        let poller = Poller::new().map_err(setup("epoll"))?;
        poller.add_priority_oneshot(mountinfo.as_fd(), TABLE).map_err(setup("mountinfo"))?;
        poller.add_readable(waker.as_fd(), SHUTDOWN).map_err(setup("waker"))?;
        Ok(MountinfoWatcher {
            table: Arc::new(MountinfoArm { poller, mountinfo }),
            _waker: waker,
            events: Vec::with_capacity(2),
        })
    }
}

impl MountWatcher for MountinfoWatcher {
    fn wait(&mut self) -> Result<Wake, WatchError> {
        wait_for_table(&self.table.poller, &mut self.events)
    }

    fn rearm_handle(&self) -> Arc<dyn Rearm> {
        self.table.clone()
    }
}

impl Rearm for MountinfoArm {
    fn rearm(&self) -> Result<(), WatchError> {
        // The changes made while disarmed are in the read that follows:
        // consume their notification, or re-arming would report them at once.
        priority_pending(self.mountinfo.as_fd()).map_err(WatchError::Rearm)?;
        self.poller.rearm_priority(self.mountinfo.as_fd(), TABLE).map_err(WatchError::Rearm)
    }
}

/// fanotify mount events of one namespace (Linux 6.15+): the kernel queues
/// an event per mount attached or detached, and the group is readable while
/// any is queued. Registered one-shot like [`MountinfoWatcher`]; re-arming
/// discards what was queued while disarmed, since the loop's read that
/// follows sees those changes.
///
/// Unlike mountinfo's flag, the events name the mounts: every event read is
/// kept until the loop takes it through the watcher's [`MountEventFeed`],
/// to update the table it keeps; the last batch's counts are kept too
/// ([`FanotifyWatcher::last_batch`]), for the log and for tests.
pub struct FanotifyWatcher {
    arm: Arc<FanotifyArm>,
    // The registration lives as long as the eventfd.
    _waker: Arc<Waker>,
    events: Vec<u64>,
}

/// The group and the epoll instance it is registered with, shared by the
/// watcher thread (which reads the batch that woke it) and the loop (which
/// drains and re-arms).
struct FanotifyArm {
    poller: Poller,
    group: MountEvents,
    /// The namespace marked, kept to remove the mark for a heal and put it
    /// back after ([`Rearm::pause`]).
    namespace: OwnedFd,
    // One-shot keeps the two threads' reads apart in time (the watcher reads
    // only when armed, the loop only before arming); the lock says so to the
    // compiler and is never contended.
    read: Mutex<BatchReader>,
}

struct BatchReader {
    reader: MountEventReader,
    batch: MountBatch,
    /// Every event read and not yet taken by the feed, in order.
    pending: Vec<MountEvent>,
    /// Changes went unreported (the mark was off for a heal, or events
    /// could not be decoded): the table must be brought up to date without
    /// them.
    unreported: bool,
}

/// Twice the kernel's default queue (`fs.fanotify.max_queued_events`).
const MOST_PENDING: usize = 2 * 16384;

impl BatchReader {
    /// Reads what the kernel has queued into `pending`.
    fn drain(&mut self, group: &MountEvents) -> io::Result<()> {
        let BatchReader { reader, pending, unreported, .. } = self;
        let drained = reader.drain(group, |event| pending.push(event));
        if undecodable(&drained) {
            *unreported = true;
        }
        // Nobody takes them (a watcher without a feed), or the loop is
        // stuck: past the kernel's own queue size they are worth no more
        // than a look at the table.
        if pending.len() > MOST_PENDING {
            pending.clear();
            *unreported = true;
        }
        tolerate_undecodable(drained).map(drop)
    }
}

/// The mount events that woke a [`FanotifyWatcher`] last.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountBatch {
    /// Mounts attached (moves count here and in `detached`).
    pub attached: usize,
    pub detached: usize,
    /// Events were lost to a full queue: the table must be read to know.
    pub overflowed: bool,
    /// The first [`MountBatch::KEPT`] events, in order.
    pub events: Vec<MountEvent>,
}

impl MountBatch {
    /// Events kept per batch: enough to name a single crash's mounts,
    /// bounded so a heal of thousands costs no memory.
    pub const KEPT: usize = 16;

    fn clear(&mut self) {
        self.attached = 0;
        self.detached = 0;
        self.overflowed = false;
        self.events.clear();
    }

    fn add(&mut self, event: MountEvent) {
        match event {
            MountEvent::Attached(_) => self.attached += 1,
            MountEvent::Detached(_) => self.detached += 1,
            MountEvent::Moved(_) => {
                self.attached += 1;
                self.detached += 1;
            }
            MountEvent::Overflow => self.overflowed = true,
        }
        if self.events.len() < Self::KEPT {
            self.events.push(event);
        }
    }
}

impl FanotifyWatcher {
    /// Watches the calling thread's mount namespace.
    pub fn of_this_thread(waker: Arc<Waker>) -> Result<Self, WatchError> {
        let namespace = fuse_supervisor_sys::ns::open_thread_mount_namespace()
            .map_err(setup("mount namespace (/proc/thread-self/ns/mnt)"))?;
        FanotifyWatcher::new(namespace.as_fd(), waker)
    }

    /// Watches the mount namespace `namespace` (an open `/proc/<pid>/ns/mnt`,
    /// duplicated and kept: the mark is taken off for each heal and put back
    /// after). Fails on kernels without mount
    /// events, saying which step failed.
    pub fn new(namespace: BorrowedFd<'_>, waker: Arc<Waker>) -> Result<Self, WatchError> {
        let group = MountEvents::new().map_err(setup("fanotify group (fanotify_init with FAN_REPORT_MNT)"))?;
        group.watch_namespace(namespace).map_err(setup("mount namespace (fanotify_mark with FAN_MARK_MNTNS)"))?;
        let namespace = namespace.try_clone_to_owned().map_err(setup("mount namespace (dup)"))?;
        let poller = Poller::new().map_err(setup("epoll"))?;
        poller.add_readable_oneshot(group.as_fd(), TABLE).map_err(setup("fanotify group"))?;
        poller.add_readable(waker.as_fd(), SHUTDOWN).map_err(setup("waker"))?;
        let batch = MountBatch { events: Vec::with_capacity(MountBatch::KEPT), ..MountBatch::default() };
        let read = Mutex::new(BatchReader {
            reader: MountEventReader::default(),
            batch,
            pending: Vec::new(),
            unreported: false,
        });
        Ok(FanotifyWatcher {
            arm: Arc::new(FanotifyArm { poller, group, namespace, read }),
            _waker: waker,
            events: Vec::with_capacity(2),
        })
    }

    /// The events read at the last [`Wake::TableChanged`].
    pub fn last_batch(&self) -> MountBatch {
        self.arm.read.lock().unwrap_or_else(PoisonError::into_inner).batch.clone()
    }

    /// Where the loop takes the events this watcher reads.
    pub fn feed(&self) -> MountEventFeed {
        MountEventFeed { arm: Arc::clone(&self.arm) }
    }
}

impl MountWatcher for FanotifyWatcher {
    fn wait(&mut self) -> Result<Wake, WatchError> {
        if wait_for_table(&self.arm.poller, &mut self.events)? == Wake::Shutdown {
            return Ok(Wake::Shutdown);
        }
        let mut read = self.arm.read.lock().unwrap_or_else(PoisonError::into_inner);
        let from = read.pending.len();
        read.drain(&self.arm.group).map_err(WatchError::Read)?;
        let BatchReader { batch, pending, .. } = &mut *read;
        batch.clear();
        pending[from..].iter().for_each(|&event| batch.add(event));
        tracing::debug!(
            attached = batch.attached,
            detached = batch.detached,
            overflowed = batch.overflowed,
            "mount events"
        );
        Ok(Wake::TableChanged)
    }

    fn rearm_handle(&self) -> Arc<dyn Rearm> {
        self.arm.clone()
    }

    fn attached(&self) -> Vec<u64> {
        let read = self.arm.read.lock().unwrap_or_else(PoisonError::into_inner);
        read.batch.events.iter().filter_map(MountEvent::appeared).collect()
    }
}

impl Rearm for FanotifyArm {
    fn rearm(&self) -> Result<(), WatchError> {
        // Events queued while disarmed go to the feed now, or re-arming
        // would report them at once. One queued after the drain is
        // reported by the re-arm itself.
        let mut read = self.read.lock().unwrap_or_else(PoisonError::into_inner);
        read.drain(&self.group).map_err(WatchError::Rearm)?;
        drop(read);
        self.poller.rearm_readable(self.group.as_fd(), TABLE).map_err(WatchError::Rearm)
    }

    /// Removes the mark: with none on the namespace the kernel builds no
    /// event for a change. The events of a heal of 100 targets (about five
    /// per target, built as each mount call releases the namespace lock)
    /// cost it 0.9 ms.
    fn pause(&self) -> Result<(), WatchError> {
        self.group.unwatch_namespace(self.namespace.as_fd()).map_err(WatchError::Pause)
    }

    fn resume(&self) -> Result<(), WatchError> {
        // What changed while the mark was off was never queued.
        self.read.lock().unwrap_or_else(PoisonError::into_inner).unreported = true;
        self.group.watch_namespace(self.namespace.as_fd()).map_err(WatchError::Resume)
    }
}

/// The events a [`FanotifyWatcher`] read, for the thread that keeps a table
/// from them (the loop). Cheap to clone.
#[derive(Clone)]
pub struct MountEventFeed {
    arm: Arc<FanotifyArm>,
}

/// What [`MountEventFeed::take`] handed over besides the events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unreported(pub bool);

impl MountEventFeed {
    /// Reads what the kernel has queued, then moves every event not yet
    /// taken into `events` (after what it holds), in order. True in the
    /// answer when changes went unreported since the last take (a heal's,
    /// made with the mark off; undecodable events): the caller must look at
    /// the table without events.
    pub fn take(&self, events: &mut Vec<MountEvent>) -> Result<Unreported, WatchError> {
        let mut read = self.arm.read.lock().unwrap_or_else(PoisonError::into_inner);
        read.drain(&self.arm.group).map_err(WatchError::Read)?;
        events.append(&mut read.pending);
        Ok(Unreported(std::mem::take(&mut read.unreported)))
    }
}

fn undecodable(drained: &io::Result<usize>) -> bool {
    matches!(drained, Err(err) if err.kind() == io::ErrorKind::InvalidData)
}

/// Events this build cannot decode (a later kernel's format) still say the
/// table changed, and mark the feed's changes unreported: only a failing
/// read stops the watcher.
fn tolerate_undecodable(drained: io::Result<usize>) -> io::Result<usize> {
    match drained {
        Err(err) if err.kind() == io::ErrorKind::InvalidData => {
            tracing::warn!(err = %chain(&err), "undecodable fanotify mount events; treated as a change");
            Ok(0)
        }
        other => other,
    }
}

/// The watcher event mode uses for `wanted`, and which backend it is.
/// `Auto` takes fanotify unless building it fails (a kernel before 6.15,
/// no `CAP_SYS_ADMIN` over the namespace), then mountinfo, logging why.
pub fn event_watcher<E: std::error::Error>(
    wanted: TableEvents,
    fanotify: impl FnOnce() -> Result<FanotifyWatcher, E>,
    mountinfo: impl FnOnce() -> Result<MountinfoWatcher, E>,
) -> Result<(Box<dyn MountWatcher>, TableEvents), E> {
    if wanted != TableEvents::Mountinfo {
        match fanotify() {
            Ok(watcher) => return Ok((Box::new(watcher), TableEvents::Fanotify)),
            Err(err) if wanted == TableEvents::Auto => {
                tracing::info!(err = %chain(&err), "no fanotify mount events for this namespace: watching mountinfo instead");
            }
            Err(err) => return Err(err),
        }
    }
    Ok((Box::new(mountinfo()?), TableEvents::Mountinfo))
}

/// Wakes every `period` whatever happened, so that the loop scans the whole
/// table: polling, for comparison with [`MountinfoWatcher`] and as a last
/// resort. Only shutdown interrupts the wait.
pub struct PollWatcher {
    poller: Poller,
    // The registration lives as long as the eventfd.
    _waker: Arc<Waker>,
    period: Duration,
    events: Vec<u64>,
}

impl PollWatcher {
    pub fn new(period: Duration, waker: Arc<Waker>) -> Result<Self, WatchError> {
        let poller = Poller::new().map_err(setup("epoll"))?;
        poller.add_readable(waker.as_fd(), SHUTDOWN).map_err(setup("waker"))?;
        Ok(PollWatcher { poller, _waker: waker, period, events: Vec::with_capacity(1) })
    }
}

impl MountWatcher for PollWatcher {
    fn wait(&mut self) -> Result<Wake, WatchError> {
        self.poller.wait(&mut self.events, Some(self.period)).map_err(WatchError::Wait)?;
        if self.events.contains(&SHUTDOWN) {
            return Ok(Wake::Shutdown);
        }
        Ok(Wake::TableChanged)
    }

    fn rearm_handle(&self) -> Arc<dyn Rearm> {
        Arc::new(TimerArm)
    }
}

/// A timer needs no arming: it wakes every period regardless.
struct TimerArm;

impl Rearm for TimerArm {
    fn rearm(&self) -> Result<(), WatchError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_watcher_wakes_on_its_timer_until_shutdown() {
        let waker = Arc::new(Waker::new().unwrap());
        let mut watcher = PollWatcher::new(Duration::from_millis(10), waker.clone()).unwrap();
        // Nothing changes anywhere: the timer alone wakes it, each time.
        assert_eq!(watcher.wait().unwrap(), Wake::TableChanged);
        assert_eq!(watcher.wait().unwrap(), Wake::TableChanged);
        waker.wake().unwrap();
        assert_eq!(watcher.wait().unwrap(), Wake::Shutdown);
        assert_eq!(watcher.wait().unwrap(), Wake::Shutdown, "shutdown must stay visible");
    }

    fn mountinfo_watcher() -> Result<MountinfoWatcher, WatchError> {
        MountinfoWatcher::new(File::open("/proc/self/mountinfo").unwrap(), Arc::new(Waker::new().unwrap()))
    }

    fn no_fanotify() -> Result<FanotifyWatcher, WatchError> {
        let source = io::Error::from(io::ErrorKind::InvalidInput);
        Err(WatchError::Setup { what: "fanotify group".into(), source })
    }

    #[test]
    fn auto_takes_fanotify_where_the_kernel_has_it() {
        let fanotify = || {
            let namespace = fuse_supervisor_sys::ns::open_thread_mount_namespace().unwrap();
            FanotifyWatcher::new(namespace.as_fd(), Arc::new(Waker::new().unwrap()))
        };
        let (_, backend) = event_watcher(TableEvents::Auto, fanotify, mountinfo_watcher).unwrap();
        assert_eq!(backend, TableEvents::Fanotify, "this test needs root and Linux 6.15+");
    }

    #[test]
    fn auto_falls_back_to_mountinfo_and_an_explicit_choice_does_not() {
        let (_, backend) = event_watcher(TableEvents::Auto, no_fanotify, mountinfo_watcher).unwrap();
        assert_eq!(backend, TableEvents::Mountinfo);
        let err = event_watcher(TableEvents::Fanotify, no_fanotify, mountinfo_watcher).err().unwrap();
        assert!(matches!(err, WatchError::Setup { .. }), "{err:?}");
        let untried =
            || -> Result<FanotifyWatcher, WatchError> { panic!("fanotify tried for --table-events mountinfo") };
        let (_, backend) = event_watcher(TableEvents::Mountinfo, untried, mountinfo_watcher).unwrap();
        assert_eq!(backend, TableEvents::Mountinfo);
    }

    #[test]
    fn modes_name_themselves() {
        assert_eq!(WatchMode::Events(TableEvents::Auto).to_string(), "event");
        assert_eq!(WatchMode::Events(TableEvents::Fanotify).to_string(), "event (fanotify)");
        assert_eq!(WatchMode::Poll { period: Duration::from_millis(200) }.to_string(), "poll every 200ms");
    }
}
