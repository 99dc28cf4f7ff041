//! The cost of tracking the kubelet's pod directories: a tree of 5,000 pods
//! with 2 CSI volumes each (mount directory and `vol_data.json`), watched by
//! the pod watcher while a consumer applies its changes to a model, as the
//! supervisor does. Prints:
//!
//! - the time to the initial full scan (`PodWatcher::spawn` returns after it);
//! - memory attributable to tracking: anonymous RSS before and after (the
//!   watcher's watch tables plus the consumer's model), and the number of
//!   inotify watches with the kernel memory of their marks (not in RSS);
//! - CPU of the watcher thread and of the consumer while all 5,000 pods are
//!   removed and 5,000 new ones created, and the time until the model is
//!   exact again;
//! - wake-ups of the watcher thread over a quiet window (must be 0).
//!
//! A benchmark, not a test: it prints numbers.
//!
//! ```text
//! cargo bench --bench pods [-- --pods 5000 --volumes 2 --quiet-seconds 10]
//! ```
//!
//! Flags are also environment variables (`PODS_BENCH_PODS`, ...). Needs no
//! mounts and no root.
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use fuse_supervisor_engine::watch::pods::{PodChange, PodDirectory, PodWatcher};

#[allow(dead_code)]
mod common;

use common::Flags;

const KIB: f64 = 1024.0;

struct Options {
    pods: usize,
    volumes: usize,
    quiet: Duration,
}

impl Options {
    /// `--flag value`, else `PODS_BENCH_FLAG`, else the default. Unknown
    /// arguments (cargo passes `--bench`) are ignored.
    fn parse() -> Options {
        let flags = Flags::new("PODS_BENCH");
        Options {
            pods: flags.number("pods", "5000"),
            volumes: flags.number("volumes", "2"),
            quiet: Duration::from_secs(flags.number("quiet-seconds", "10")),
        }
    }
}

/// Lays out one pod the way the kubelet does for CSI volumes.
fn make_pod(pods_dir: &Path, generation: usize, n: usize, volumes: usize) {
    let uid = format!("{generation:08x}-{:04x}-4000-8000-{n:012x}", n >> 16);
    let pod = pods_dir.join(uid);
    fs::create_dir_all(pod.join("containers/app")).unwrap();
    for v in 0..volumes {
        let pv = format!("pvc-{generation:02}{n:06}-{v}-5f0c7a4e-2b1d-4c6e-9a3f");
        let volume = pod.join("volumes/kubernetes.io~csi").join(&pv);
        fs::create_dir_all(volume.join("mount")).unwrap();
        let mut file = fs::File::create(volume.join("vol_data.json")).unwrap();
        write!(
            file,
            r#"{{"attachmentID":"csi-1605e5ee2451c74f6f695711fecb5b63851a967642f9f184949110a3e9f86998","driverName":"csi.juicefs.com","nodeName":"ip-10-0-3-17.ec2.internal","specVolID":"{pv}","volumeHandle":"{pv}","volumeLifecycleMode":"Persistent"}}"#
        )
        .unwrap();
        writeln!(file).unwrap();
    }
}

fn status_kib(field: &str) -> u64 {
    let status = fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// `/proc/self/task/<tid>` of the thread named `name`.
fn thread_dir(name: &str) -> PathBuf {
    for task in fs::read_dir("/proc/self/task").unwrap() {
        let dir = task.unwrap().path();
        if fs::read_to_string(dir.join("comm")).unwrap_or_default().trim() == name {
            return dir;
        }
    }
    panic!("no thread named {name}");
}

/// On-CPU nanoseconds of a thread (`schedstat`).
fn cpu_ns(task: &Path) -> u64 {
    let schedstat = fs::read_to_string(task.join("schedstat")).unwrap();
    schedstat.split_whitespace().next().unwrap().parse().unwrap()
}

fn switches(task: &Path) -> (u64, u64) {
    let status = fs::read_to_string(task.join("status")).unwrap();
    let field = |name: &str| -> u64 {
        status.lines().find_map(|line| line.strip_prefix(name)).unwrap().trim().parse().unwrap()
    };
    (field("voluntary_ctxt_switches:"), field("nonvoluntary_ctxt_switches:"))
}

/// Watches held by this process's inotify instances (their fdinfo lines).
fn inotify_watches() -> usize {
    let mut watches = 0;
    for fd in fs::read_dir("/proc/self/fd").unwrap().flatten() {
        if fs::read_link(fd.path()).is_ok_and(|link| link == Path::new("anon_inode:inotify")) {
            let info = fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.file_name().to_string_lossy()));
            watches += info.unwrap_or_default().lines().filter(|line| line.starts_with("inotify wd:")).count();
        }
    }
    watches
}

/// Bytes of one inotify mark in the kernel's slab (`/sys/kernel/slab`).
/// The cache is usually merged with others, so its object count says
/// nothing about inotify: marks are counted from fdinfo instead.
fn inotify_mark_bytes() -> Option<u64> {
    fs::read_to_string("/sys/kernel/slab/inotify_inode_mark/slab_size").ok()?.trim().parse().ok()
}

/// Applies changes until the model equals a scan of the disk.
fn converge(changes: &Receiver<PodChange>, directory: &mut PodDirectory, pods_dir: &Path, counts: &mut Counts) {
    let expected = PodDirectory::scan(pods_dir).unwrap();
    let deadline = Instant::now() + Duration::from_secs(600);
    while *directory != expected {
        match changes.recv_timeout(Duration::from_millis(200)) {
            Ok(change) => {
                counts.note(&change);
                directory.apply(change);
            }
            Err(RecvTimeoutError::Timeout) => assert!(Instant::now() < deadline, "the model never converged"),
            Err(RecvTimeoutError::Disconnected) => panic!("watcher stopped"),
        }
    }
}

#[derive(Default)]
struct Counts {
    changes: u64,
    resyncs: u64,
}

impl Counts {
    fn note(&mut self, change: &PodChange) {
        self.changes += 1;
        match change {
            PodChange::Resync(_) => self.resyncs += 1,
            PodChange::Failed(err) => panic!("watcher failed: {err}"),
            _ => {}
        }
    }
}

fn main() {
    let options = Options::parse();
    let root = tempfile::tempdir().unwrap();
    let pods_dir = root.path().join("pods");
    fs::create_dir(&pods_dir).unwrap();
    println!("pod directories: {} pods x {} CSI volumes, on {}", options.pods, options.volumes, root.path().display());
    let started = Instant::now();
    for n in 0..options.pods {
        make_pod(&pods_dir, 0, n, options.volumes);
    }
    println!("  built the tree in {:.2} s", started.elapsed().as_secs_f64());

    // Memory and time of the initial scan.
    let anon_before = status_kib("RssAnon:");
    let (send, changes) = mpsc::channel();
    let started = Instant::now();
    let watcher = PodWatcher::spawn(root.path(), None, move |change| {
        let _ = send.send(change);
    })
    .unwrap();
    let scan_time = started.elapsed();
    let mut directory = PodDirectory::default();
    let mut counts = Counts::default();
    // The initial scan is sent before `spawn` returns: take it, then measure
    // (before the check below reads the disk into a second model).
    while let Ok(change) = changes.try_recv() {
        counts.note(&change);
        directory.apply(change);
    }
    let anon_after = status_kib("RssAnon:");
    let watches = inotify_watches();
    converge(&changes, &mut directory, &pods_dir, &mut counts);
    assert_eq!(directory.len(), options.pods);
    println!("initial scan");
    println!("  time to the initial full scan: {:.1} ms", scan_time.as_secs_f64() * 1e3);
    println!(
        "  anonymous RSS: {anon_before} KiB before, {anon_after} KiB after: {:.1} MiB for tracking ({:.0} bytes per pod)",
        (anon_after as f64 - anon_before as f64) / KIB,
        (anon_after as f64 - anon_before as f64) * KIB / options.pods as f64
    );
    match inotify_mark_bytes() {
        Some(mark) => println!(
            "  inotify watches: {watches} ({:.1} per pod); kernel memory for the marks {:.1} MiB ({mark} B each, \
             not in RSS; each watched directory's inode also stays cached)",
            watches as f64 / options.pods as f64,
            (watches as u64 * mark) as f64 / KIB / KIB
        ),
        None => println!("  inotify watches: {watches} ({:.1} per pod)", watches as f64 / options.pods as f64),
    }

    // CPU while every pod goes and as many new ones come.
    let watcher_task = thread_dir("pod-watcher");
    let consumer_task = PathBuf::from(format!("/proc/self/task/{}", current_tid()));
    let (watcher_cpu, consumer_cpu) = (cpu_ns(&watcher_task), cpu_ns(&consumer_task));
    let changes_before = counts.changes;
    let started = Instant::now();
    let churn_dir = pods_dir.clone();
    let (pods, volumes) = (options.pods, options.volumes);
    let churn = std::thread::spawn(move || {
        let mut old: Vec<PathBuf> = fs::read_dir(&churn_dir).unwrap().map(|entry| entry.unwrap().path()).collect();
        old.sort();
        for (n, pod) in old.iter().enumerate() {
            fs::remove_dir_all(pod).unwrap();
            make_pod(&churn_dir, 1, n, volumes);
        }
    });
    // The consumer applies as changes come while the churn runs.
    while !churn.is_finished() {
        if let Ok(change) = changes.recv_timeout(Duration::from_millis(50)) {
            counts.note(&change);
            directory.apply(change);
        }
    }
    churn.join().unwrap();
    let churn_time = started.elapsed();
    converge(&changes, &mut directory, &pods_dir, &mut counts);
    let converged = started.elapsed();
    let (watcher_cpu, consumer_cpu) = (cpu_ns(&watcher_task) - watcher_cpu, cpu_ns(&consumer_task) - consumer_cpu);
    println!("churn: {pods} pods removed and {pods} created");
    println!(
        "  disk work took {:.2} s; model exact {:.2} s after the start; {} changes, {} rescans (queue overflows)",
        churn_time.as_secs_f64(),
        converged.as_secs_f64(),
        counts.changes - changes_before,
        counts.resyncs - 1
    );
    println!(
        "  CPU: watcher thread {:.1} ms ({:.1} us per pod created or removed), consumer applying changes {:.1} ms",
        watcher_cpu as f64 / 1e6,
        watcher_cpu as f64 / 1e3 / (2 * pods) as f64,
        consumer_cpu as f64 / 1e6
    );
    println!("  anonymous RSS now {} KiB (with the freed verification scans of this bench)", status_kib("RssAnon:"));

    // Idle: the watcher must not wake at all.
    let (voluntary, involuntary) = switches(&watcher_task);
    let idle_cpu = cpu_ns(&watcher_task);
    std::thread::sleep(options.quiet);
    let (voluntary_after, involuntary_after) = switches(&watcher_task);
    println!("quiet {} s", options.quiet.as_secs());
    println!(
        "  watcher thread: {} voluntary, {} involuntary context switches, {:.3} ms CPU",
        voluntary_after - voluntary,
        involuntary_after - involuntary,
        (cpu_ns(&watcher_task) - idle_cpu) as f64 / 1e6
    );
    watcher.stop().unwrap();
}

/// The calling thread's id, from `/proc/thread-self`.
fn current_tid() -> String {
    let link = fs::read_link("/proc/thread-self").unwrap();
    link.file_name().unwrap().to_string_lossy().into_owned()
}
