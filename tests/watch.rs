//! Root tests of the mount-table watchers' contract, for both event
//! backends: a change of the watched namespace is reported, one of another
//! namespace is not, nothing is reported between a report and `rearm`, and
//! `rearm` takes in what changed while disarmed. Each test watches its own
//! [`Sandbox`] (a private mount namespace) from a thread outside it.
use std::fs::{self, File};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::Duration;

use fuse_supervisor_engine::watch::mount_table::{
    FanotifyWatcher, MountBatch, MountWatcher, MountinfoWatcher, Rearm, Unreported, Wake,
};
use fuse_supervisor_sys::fanotify::MountEvent;
use fuse_supervisor_sys::poll::Waker;
use fuse_supervisor_sys::{fuse, mount, ns};
use fuse_supervisor_testbed::Sandbox;

/// How long a report may take to arrive.
const REPORT: Duration = Duration::from_secs(10);
/// How long silence must last to count as "nothing reported".
const QUIET: Duration = Duration::from_millis(300);

#[derive(Debug, Clone, Copy)]
enum Backend {
    Mountinfo,
    Fanotify,
}

/// A watcher of one sandbox on a thread of its own, its reports on a
/// channel: what the supervisor's watcher thread does.
struct Watching {
    reports: Receiver<(Wake, Option<MountBatch>)>,
    rearm: Arc<dyn Rearm>,
    waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl Watching {
    fn start(backend: Backend, sandbox: &Sandbox) -> Watching {
        let waker = Arc::new(Waker::new().unwrap());
        match backend {
            Backend::Mountinfo => {
                let mountinfo = sandbox.run(|| File::open("/proc/thread-self/mountinfo")).unwrap();
                Self::spawn(MountinfoWatcher::new(mountinfo, waker.clone()).unwrap(), waker, |_| None)
            }
            Backend::Fanotify => {
                // The mark takes the namespace from the fd; this thread stays outside it.
                let namespace = sandbox.run(ns::open_thread_mount_namespace).unwrap();
                let watcher = FanotifyWatcher::new(namespace.as_fd(), waker.clone()).unwrap();
                Self::spawn(watcher, waker, |watcher| Some(watcher.last_batch()))
            }
        }
    }

    fn spawn<W: MountWatcher + 'static>(
        mut watcher: W,
        waker: Arc<Waker>,
        batch: fn(&W) -> Option<MountBatch>,
    ) -> Watching {
        let rearm = watcher.rearm_handle();
        let (send, reports) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            loop {
                let wake = watcher.wait().unwrap();
                if send.send((wake, batch(&watcher))).is_err() || wake == Wake::Shutdown {
                    return;
                }
            }
        });
        Watching { reports, rearm, waker, thread: Some(thread) }
    }

    /// The next report; fails the test if none comes.
    fn report(&self) -> Option<MountBatch> {
        let (wake, batch) = self.reports.recv_timeout(REPORT).expect("a change report");
        assert_eq!(wake, Wake::TableChanged);
        batch
    }

    fn assert_quiet(&self, why: &str) {
        match self.reports.recv_timeout(QUIET) {
            Err(RecvTimeoutError::Timeout) => {}
            other => panic!("{why}: got {other:?}"),
        }
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        self.waker.wake().unwrap();
        if let Some(thread) = self.thread.take() {
            let joined = thread.join();
            if !std::thread::panicking() {
                joined.unwrap();
            }
        }
    }
}

/// Mounts a tmpfs on a new directory `name` of the sandbox; its unique mount ID.
fn mount_tmpfs(sandbox: &Sandbox, name: &str) -> u64 {
    let dir = sandbox.root().join(name);
    sandbox.run(move || {
        fs::create_dir_all(&dir).unwrap();
        mount::mount_tmpfs(&dir).unwrap();
        fuse::top_mount_id(&dir).unwrap()
    })
}

fn unmount(sandbox: &Sandbox, name: &str) {
    let dir: PathBuf = sandbox.root().join(name);
    sandbox.run(move || mount::detach(Path::new(&dir)).unwrap());
}

fn reports_a_mount_and_an_unmount(backend: Backend) {
    let sandbox = Sandbox::new().unwrap();
    let watching = Watching::start(backend, &sandbox);
    watching.assert_quiet("nothing changed yet");

    let id = mount_tmpfs(&sandbox, "a");
    let batch = watching.report();
    watching.rearm.rearm().unwrap();
    unmount(&sandbox, "a");
    let after_unmount = watching.report();
    if let Backend::Fanotify = backend {
        let (batch, after_unmount) = (batch.unwrap(), after_unmount.unwrap());
        assert!(batch.events.contains(&MountEvent::Attached(id)), "{batch:?} lacks mount {id}");
        assert!(after_unmount.events.contains(&MountEvent::Detached(id)), "{after_unmount:?} lacks mount {id}");
    }
}

#[test]
fn fanotify_reports_a_mount_and_an_unmount_by_its_id() {
    reports_a_mount_and_an_unmount(Backend::Fanotify);
}

#[test]
fn mountinfo_reports_a_mount_and_an_unmount() {
    reports_a_mount_and_an_unmount(Backend::Mountinfo);
}

fn ignores_other_namespaces(backend: Backend) {
    let (watched, other) = (Sandbox::new().unwrap(), Sandbox::new().unwrap());
    let watching = Watching::start(backend, &watched);
    mount_tmpfs(&other, "elsewhere");
    watching.assert_quiet("a mount in another namespace was reported");
    // Still watching: a mount here is reported.
    mount_tmpfs(&watched, "here");
    watching.report();
}

#[test]
fn fanotify_ignores_mounts_of_other_namespaces() {
    ignores_other_namespaces(Backend::Fanotify);
}

#[test]
fn mountinfo_ignores_mounts_of_other_namespaces() {
    ignores_other_namespaces(Backend::Mountinfo);
}

/// One report per burst: silent from a report until `rearm`, and after
/// `rearm` silent about what changed before it (the loop reads that), but
/// reporting what changes after it.
fn one_shot_until_rearm(backend: Backend) {
    let sandbox = Sandbox::new().unwrap();
    let watching = Watching::start(backend, &sandbox);
    mount_tmpfs(&sandbox, "first");
    watching.report();

    mount_tmpfs(&sandbox, "while-disarmed");
    unmount(&sandbox, "first");
    watching.assert_quiet("reported while disarmed");

    watching.rearm.rearm().unwrap();
    watching.assert_quiet("changes made while disarmed were reported after rearm");

    let id = mount_tmpfs(&sandbox, "after-rearm");
    let batch = watching.report();
    if let Some(batch) = batch {
        assert_eq!(batch.events, [MountEvent::Attached(id)], "only the change after rearm is in the batch");
    }
}

#[test]
fn fanotify_is_silent_until_rearm_and_rearm_takes_in_earlier_changes() {
    one_shot_until_rearm(Backend::Fanotify);
}

#[test]
fn mountinfo_is_silent_until_rearm_and_rearm_takes_in_earlier_changes() {
    one_shot_until_rearm(Backend::Mountinfo);
}

/// Paused for a heal: the kernel queues nothing for changes made then, and
/// after `resume` changes are reported again.
#[test]
fn fanotify_paused_queues_nothing_until_resumed() {
    let sandbox = Sandbox::new().unwrap();
    let watching = Watching::start(Backend::Fanotify, &sandbox);
    watching.rearm.pause().unwrap();
    mount_tmpfs(&sandbox, "while-paused");
    unmount(&sandbox, "while-paused");
    watching.assert_quiet("reported while paused");
    watching.rearm.resume().unwrap();
    watching.assert_quiet("changes made while paused were queued");

    let id = mount_tmpfs(&sandbox, "after-resume");
    let batch = watching.report().unwrap();
    assert_eq!(batch.events, [MountEvent::Attached(id)], "only the change after resume is in the batch");
}

#[test]
fn fanotify_reports_a_queue_overflow_as_a_change() {
    let sandbox = Sandbox::new().unwrap();
    let waker = Arc::new(Waker::new().unwrap());
    let namespace = sandbox.run(ns::open_thread_mount_namespace).unwrap();
    let mut watcher = FanotifyWatcher::new(namespace.as_fd(), waker).unwrap();
    // Nobody reads while the kernel queues more events than it keeps.
    let limit: usize = fs::read_to_string("/proc/sys/fs/fanotify/max_queued_events").unwrap().trim().parse().unwrap();
    let dir = sandbox.root().join("churn");
    sandbox.run(move || {
        fs::create_dir(&dir).unwrap();
        for _ in 0..limit / 2 + 100 {
            mount::mount_tmpfs(&dir).unwrap();
            mount::detach(&dir).unwrap();
        }
    });
    assert_eq!(watcher.wait().unwrap(), Wake::TableChanged);
    let batch = watcher.last_batch();
    assert!(batch.overflowed, "{} attached, {} detached, no overflow", batch.attached, batch.detached);
    assert_eq!(batch.events.len(), MountBatch::KEPT, "the kept events are bounded");
}

/// The feed the loop keeps its table from hands over every event in order:
/// those read with a report and those `rearm` took in; after a pause it
/// says that changes went unreported.
#[test]
fn fanotify_feed_hands_over_every_event_and_says_when_some_went_unreported() {
    let sandbox = Sandbox::new().unwrap();
    let waker = Arc::new(Waker::new().unwrap());
    let namespace = sandbox.run(ns::open_thread_mount_namespace).unwrap();
    let watcher = FanotifyWatcher::new(namespace.as_fd(), waker.clone()).unwrap();
    let feed = watcher.feed();
    let watching = Watching::spawn(watcher, waker, |watcher| Some(watcher.last_batch()));
    let first = mount_tmpfs(&sandbox, "first");
    watching.report();
    let second = mount_tmpfs(&sandbox, "while-disarmed");
    unmount(&sandbox, "first");
    watching.rearm.rearm().unwrap();
    let mut events = Vec::new();
    assert_eq!(feed.take(&mut events).unwrap(), Unreported(false));
    assert_eq!(events, [MountEvent::Attached(first), MountEvent::Attached(second), MountEvent::Detached(first)]);

    watching.rearm.pause().unwrap();
    unmount(&sandbox, "while-disarmed");
    watching.rearm.resume().unwrap();
    events.clear();
    assert_eq!(feed.take(&mut events).unwrap(), Unreported(true), "the unmount while paused went unreported");
    assert_eq!(events, []);
    assert_eq!(feed.take(&mut events).unwrap(), Unreported(false), "said once");
}
