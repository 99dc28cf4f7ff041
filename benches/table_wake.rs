//! Wake-up latency of the mount-table watchers: from just before a
//! `mount(2)` (or `umount2`) in the watched namespace until the watcher
//! thread's `wait` returns, for the mountinfo and the fanotify backend, with
//! the sandbox's own small table and with ~10,000 mounts. Also what the
//! loop's `rearm` costs each. A benchmark, not a test: it prints numbers.
//!
//! The loop's table read after a wake is the same for both backends (it
//! reads mountinfo either way), so it is not measured here; see `parse`.
//!
//! ```text
//! cargo bench --bench table_wake [-- --changes 200 --large-mounts 10000 --backends mountinfo,fanotify]
//! ```
//!
//! Every flag is also an environment variable (`TABLE_WAKE_CHANGES`, ...).
//! Needs root and Linux 6.15+ for fanotify. Everything runs in a private
//! mount namespace that dies with the run.
use std::fs::File;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fuse_supervisor_engine::watch::mount_table::{FanotifyWatcher, MountWatcher, MountinfoWatcher, Rearm, Wake};
use fuse_supervisor_sys::poll::Waker;
use fuse_supervisor_sys::{mount, ns};
use fuse_supervisor_testbed::Sandbox;

#[allow(dead_code)]
mod common;

use common::{Flags, is_root};

/// No report this long after a change means the watcher missed it.
const REPORT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy)]
enum Backend {
    Mountinfo,
    Fanotify,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Mountinfo => "mountinfo",
            Backend::Fanotify => "fanotify",
        }
    }
}

/// A watcher thread of one sandbox that sends the instant each wait returned.
struct Watching {
    wakes: Receiver<Instant>,
    rearm: Arc<dyn Rearm>,
    waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl Watching {
    fn start(backend: Backend, sandbox: &Sandbox) -> Watching {
        let waker = Arc::new(Waker::new().expect("eventfd"));
        let watcher: Box<dyn MountWatcher> = match backend {
            Backend::Mountinfo => {
                let mountinfo = sandbox.run(|| File::open("/proc/thread-self/mountinfo")).expect("open mountinfo");
                Box::new(MountinfoWatcher::new(mountinfo, waker.clone()).expect("mountinfo watcher"))
            }
            Backend::Fanotify => {
                let namespace = sandbox.run(ns::open_thread_mount_namespace).expect("open the namespace");
                Box::new(FanotifyWatcher::new(namespace.as_fd(), waker.clone()).expect("fanotify watcher"))
            }
        };
        let rearm = watcher.rearm_handle();
        let (send, wakes) = mpsc::channel();
        let mut watcher = watcher;
        let thread = std::thread::spawn(move || {
            while let Ok(Wake::TableChanged) = watcher.wait() {
                if send.send(Instant::now()).is_err() {
                    return;
                }
            }
        });
        Watching { wakes, rearm, waker, thread: Some(thread) }
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        let _ = self.waker.wake();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[derive(Default)]
struct Samples {
    mount: Vec<Duration>,
    unmount: Vec<Duration>,
    rearm: Vec<Duration>,
}

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort_unstable();
    let rank = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[rank]
}

/// Times one change made by `change` (which returns the instant just
/// before its syscall) until the watcher woke, then re-arms as the loop does.
fn time_change(
    sandbox: &Sandbox,
    watching: &Watching,
    change: impl FnOnce() -> Instant + Send + 'static,
) -> (Duration, Duration) {
    let before = sandbox.run(change);
    let woke = watching.wakes.recv_timeout(REPORT).expect("the watcher missed a change");
    let rearm_started = Instant::now();
    watching.rearm.rearm().expect("rearm");
    (woke.saturating_duration_since(before), rearm_started.elapsed())
}

fn measure(backend: Backend, sandbox: &Sandbox, changes: usize) -> Samples {
    let watching = Watching::start(backend, sandbox);
    let dir = sandbox.root().join("wake").join(backend.name());
    let setup = dir.clone();
    sandbox.run(move || std::fs::create_dir_all(&setup)).expect("create the mount point");
    let mut samples = Samples::default();
    for _ in 0..changes {
        let target = dir.clone();
        let (wake, rearm) = time_change(sandbox, &watching, move || {
            let before = Instant::now();
            mount::mount_tmpfs(&target).expect("mount");
            before
        });
        samples.mount.push(wake);
        samples.rearm.push(rearm);
        let target = dir.clone();
        let (wake, rearm) = time_change(sandbox, &watching, move || {
            let before = Instant::now();
            mount::detach(&target).expect("unmount");
            before
        });
        samples.unmount.push(wake);
        samples.rearm.push(rearm);
    }
    samples
}

/// `count` tmpfs mounts outside anything the bench changes.
fn pad(sandbox: &Sandbox, count: usize) {
    let pads: Vec<PathBuf> = (0..count).map(|i| sandbox.root().join("padding").join(i.to_string())).collect();
    sandbox
        .run(move || -> std::io::Result<()> {
            for pad in &pads {
                std::fs::create_dir_all(pad)?;
                mount::mount_tmpfs(pad)?;
            }
            Ok(())
        })
        .expect("pad the sandbox's mount table");
}

fn main() {
    let flags = Flags::new("TABLE_WAKE");
    let changes: usize = flags.number("changes", "200");
    let large: usize = flags.number("large-mounts", "10000");
    let backends = flags.list("backends", "mountinfo,fanotify", |name| match name {
        "mountinfo" => Some(Backend::Mountinfo),
        "fanotify" => Some(Backend::Fanotify),
        _ => None,
    });
    assert!(is_root(), "table_wake mounts in a private namespace and needs root");
    println!(
        "{:>7} {:>10} {:>7} | {:>10} {:>10} | {:>10} {:>10} | {:>10} {:>10}",
        "mounts", "backend", "changes", "mount p50", "mount p99", "umount p50", "umount p99", "rearm p50", "rearm p99"
    );
    for padding in [0, large] {
        let sandbox = Sandbox::new().expect("sandbox");
        pad(&sandbox, padding);
        let mounts = sandbox.mountinfo().lines().count();
        for &backend in &backends {
            let mut samples = measure(backend, &sandbox, changes);
            println!(
                "{:>7} {:>10} {:>7} | {:>10.1?} {:>10.1?} | {:>10.1?} {:>10.1?} | {:>10.1?} {:>10.1?}",
                mounts,
                backend.name(),
                changes,
                percentile(&mut samples.mount, 0.5),
                percentile(&mut samples.mount, 0.99),
                percentile(&mut samples.unmount, 0.5),
                percentile(&mut samples.unmount, 0.99),
                percentile(&mut samples.rearm, 0.5),
                percentile(&mut samples.rearm, 0.99),
            );
        }
    }
}
