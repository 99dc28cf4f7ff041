//! The floor: a minimal healer that is told the layout, timed on the same
//! sandbox, daemon and readers as the supervisor, in the same run, with the
//! supervisor not running.
//!
//! It makes only the mount calls a heal of that size must make to leave one
//! layer everywhere: on the host, the new source cloned and slid beneath
//! each target's dead layer, then one detach (the dead layers are peers, and
//! each now sits on a peer of the new source, so the detach propagates to the
//! others; a target it did not reach is detached on its own and counted);
//! in each container, on a thread of its own kept from cycle to cycle, the
//! source cloned, the namespace entered, the clone given the volume's
//! propagation and slid beneath the dead copy, and the dead copy detached.
//! Every thread waits at `SCHED_FIFO` (as the supervisor's heal does), and
//! the containers' threads are woken before the host's calls begin. No
//! probe, no plan, no checks: what is left is the kernel's own cost, and
//! the readers' wait for the new daemon.
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fuse_supervisor_engine::heal::priority::HealPriority;
use fuse_supervisor_engine::model::table::Dev;
use fuse_supervisor_sys::mount::{self, Propagation};
use fuse_supervisor_sys::poll::{Poller, Waker};
use fuse_supervisor_sys::{ns, resolve, statmount};
use fuse_supervisor_testbed::Sandbox;

/// A container's volume, as the floor heals it.
pub struct FloorContainer {
    /// A process in the container's mount namespace.
    pub pid: u32,
    /// The volume's mount point in that namespace.
    pub mount_point: PathBuf,
    pub propagation: Propagation,
}

/// What one floor heal took, from its own wake-up on the new mount.
#[derive(Debug, Default, Clone, Copy)]
pub struct FloorTimes {
    /// Every host target on the new mount, one layer.
    pub host_us: u64,
    /// Targets the one detach did not reach by propagation.
    pub detached_alone: usize,
    /// The last container's dead copy replaced.
    pub containers_us: Option<u64>,
}

struct Armed {
    old_dev: Dev,
    times: Option<Result<FloorTimes, String>>,
}

type Shared = Arc<(Mutex<Option<Armed>>, Condvar)>;

/// The floor healer: a thread that wakes on the sandbox's mount table, and
/// one kept thread per container.
pub struct FloorHealer {
    shared: Shared,
    stop: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

const TABLE: u64 = 1;
const STOP: u64 = 2;

/// A container thread's work: replace its dead copy from `source`.
struct Job {
    source: PathBuf,
    done: Sender<Result<Instant, String>>,
}

impl FloorHealer {
    pub fn start(sandbox: &Sandbox, source: &Path, targets: &[PathBuf], containers: Vec<FloorContainer>) -> Self {
        let home = || std::fs::File::open(sandbox.namespace_path()).expect("open the sandbox's mount namespace");
        let workers: Vec<Sender<Job>> =
            containers.into_iter().map(|container| spawn_container_thread(home(), container)).collect();
        let namespace = home();
        let stop = Arc::new(Waker::new().expect("eventfd"));
        let shared: Shared = Arc::default();
        let (source, targets) = (source.to_path_buf(), targets.to_vec());
        let (thread_shared, thread_stop) = (Arc::clone(&shared), Arc::clone(&stop));
        let (ready, started) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("floor-host".into())
            .spawn(move || {
                ns::enter_mount_namespace(namespace.as_fd()).expect("enter the sandbox's mount namespace");
                // Opened in the sandbox's namespace: its changes wake us.
                let table = std::fs::File::open("/proc/thread-self/mountinfo").expect("open the sandbox's mountinfo");
                let poller = Poller::new().expect("epoll");
                poller.add_priority(table.as_fd(), TABLE).expect("watch mountinfo");
                poller.add_readable(thread_stop.as_fd(), STOP).expect("watch the stop");
                if !HealPriority::realtime(1).raise() {
                    eprintln!("# the floor heals at the normal priority (no CAP_SYS_NICE?)");
                }
                let _ = ready.send(());
                let mut events = Vec::new();
                loop {
                    poller.wait(&mut events, None).expect("epoll");
                    let woke = Instant::now();
                    if events.contains(&STOP) {
                        return;
                    }
                    let old_dev = match &*thread_shared.0.lock().unwrap_or_else(PoisonError::into_inner) {
                        Some(Armed { old_dev, times: None }) => *old_dev,
                        _ => continue,
                    };
                    let Some(new_dev) = super::new_fuse_mount(&source, old_dev) else { continue };
                    let times = heal(&source, &targets, new_dev, &workers, woke);
                    let (lock, done) = &*thread_shared;
                    if let Some(armed) = lock.lock().unwrap_or_else(PoisonError::into_inner).as_mut() {
                        armed.times = Some(times);
                    }
                    done.notify_all();
                }
            })
            .expect("start the floor's thread");
        started.recv().expect("the floor's thread starts");
        FloorHealer { shared, stop, thread: Some(thread) }
    }

    /// Heals the next restart of the source, now dead on `old_dev`.
    pub fn arm(&self, old_dev: Dev) {
        *self.shared.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(Armed { old_dev, times: None });
    }

    /// What the armed heal took, once it is done.
    pub fn wait(&self, timeout: Duration) -> Result<FloorTimes, String> {
        let (lock, done) = &*self.shared;
        let deadline = Instant::now() + timeout;
        let mut armed = lock.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(times) = armed.as_mut().and_then(|armed| armed.times.take()) {
                *armed = None;
                return times;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                *armed = None;
                return Err(format!("no heal within {timeout:?}"));
            }
            armed = done.wait_timeout(armed, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }
}

impl Drop for FloorHealer {
    fn drop(&mut self) {
        // Its threads hold the sandbox's namespace: the host's ends here,
        // and with it the containers' queues, which ends theirs.
        let _ = self.stop.wake();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn heal(
    source: &Path,
    targets: &[PathBuf],
    new_dev: Dev,
    workers: &[Sender<Job>],
    woke: Instant,
) -> Result<FloorTimes, String> {
    let (done, finished) = mpsc::channel();
    for worker in workers {
        worker
            .send(Job { source: source.to_path_buf(), done: done.clone() })
            .map_err(|_| "a container thread is gone".to_owned())?;
    }
    drop(done);
    let fail = |what: &str, path: &Path, err: std::io::Error| format!("{what} {}: {err}", path.display());
    let source_fd = resolve::open_path(source).map_err(|err| fail("open", source, err))?;
    for target in targets {
        let clone = mount::clone_mount(source_fd.as_fd()).map_err(|err| fail("clone the source for", target, err))?;
        let onto = resolve::open_path(target).map_err(|err| fail("open", target, err))?;
        mount::move_mount_beneath(clone.as_fd(), onto.as_fd()).map_err(|err| fail("slide beneath", target, err))?;
    }
    let mut detached_alone = 0;
    for (index, target) in targets.iter().enumerate() {
        let top = resolve::open_path(target).and_then(|fd| resolve::device_of(fd.as_fd())).map(Dev::from);
        if index == 0 || top.is_ok_and(|dev| dev != new_dev) {
            mount::detach(target).map_err(|err| fail("detach the dead layer of", target, err))?;
            detached_alone += usize::from(index > 0);
        }
    }
    let host_us = woke.elapsed().as_micros() as u64;
    let mut last = None;
    for replaced in finished.iter() {
        let at = replaced?;
        last = Some(last.map_or(at, |last: Instant| last.max(at)));
    }
    let containers_us = last.map(|at| at.duration_since(woke).as_micros() as u64);
    Ok(FloorTimes { host_us, detached_alone, containers_us })
}

/// A thread for one container, at home in the sandbox's namespace between
/// jobs, as the supervisor keeps its own.
fn spawn_container_thread(home: std::fs::File, container: FloorContainer) -> Sender<Job> {
    let namespace: OwnedFd = std::fs::File::open(format!("/proc/{}/ns/mnt", container.pid))
        .expect("open a container's mount namespace")
        .into();
    let (jobs, queue): (Sender<Job>, Receiver<Job>) = mpsc::channel();
    std::thread::Builder::new()
        .name("floor-container".into())
        .spawn(move || {
            ns::enter_mount_namespace(home.as_fd()).expect("enter the sandbox's mount namespace");
            HealPriority::realtime(1).raise();
            for job in queue {
                let replaced = replace(&job.source, namespace.as_fd(), &container);
                let back = ns::enter_mount_namespace(home.as_fd()).map_err(|err| format!("go home: {err}"));
                let _ = job.done.send(replaced.and(back).map(|()| Instant::now()));
            }
        })
        .expect("start a floor container thread");
    jobs
}

fn replace(source: &Path, namespace: std::os::fd::BorrowedFd<'_>, container: &FloorContainer) -> Result<(), String> {
    let at = &container.mount_point;
    let clone = resolve::open_path(source)
        .and_then(|fd| mount::clone_mount(fd.as_fd()))
        .map_err(|err| format!("clone {}: {err}", source.display()))?;
    mount::set_propagation_of(clone.as_fd(), container.propagation)
        .map_err(|err| format!("set the clone's propagation: {err}"))?;
    ns::enter_mount_namespace(namespace).map_err(|err| format!("enter the container's namespace: {err}"))?;
    let dead = resolve::open_path(at).map_err(|err| format!("open {}: {err}", at.display()))?;
    let dead_id = resolve::unique_mount_id_of(dead.as_fd()).map_err(|err| format!("the dead copy's ID: {err}"))?;
    mount::move_mount_beneath(clone.as_fd(), dead.as_fd())
        .map_err(|err| format!("slide beneath {}: {err}", at.display()))?;
    // A slave of the new source loses the dead copy on its root to the
    // host's detach of its own dead layers (which sit on the roots of the
    // source's peers, the slave's masters) when that comes first.
    match mount::detach_top(dead.as_fd()) {
        Err(_) if statmount::mount_summary(dead_id).is_err() => Ok(()),
        detached => detached.map_err(|err| format!("detach the dead copy at {}: {err}", at.display())),
    }
}
