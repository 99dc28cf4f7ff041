//! Root tests of the namespace, process and poll primitives. Every mount is
//! made by a thread that first unshared its mount namespace and made `/`
//! recursively private, so the machine's table is never touched.
use std::fs;
use std::os::fd::AsFd;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use fuse_supervisor_sys::fanotify::{MountEvent, MountEventReader, MountEvents};
use fuse_supervisor_sys::fuse;
use fuse_supervisor_sys::mount::{self, Propagation};
use fuse_supervisor_sys::ns;
use fuse_supervisor_sys::poll::Poller;
use fuse_supervisor_sys::process::{self, Signal};

fn require_root() {
    let status = fs::read_to_string("/proc/self/status").unwrap();
    let euid = status.lines().find_map(|line| line.strip_prefix("Uid:")).unwrap().split_whitespace().nth(1);
    assert_eq!(euid, Some("0"), "these tests mount in private namespaces and must run as root");
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fuse-supervisor-sys-{name}-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn private_namespace() {
    ns::unshare_mount_namespace().unwrap();
    mount::set_propagation("/".as_ref(), Propagation::Private, true).unwrap();
}

#[test]
fn mountinfo_priority_event_fires_once_per_change() {
    require_root();
    let dir = scratch_dir("poll");
    let target = dir.clone();
    std::thread::spawn(move || {
        private_namespace();
        let mountinfo = fs::File::open("/proc/thread-self/mountinfo").unwrap();
        let poller = Poller::new().unwrap();
        poller.add_priority(mountinfo.as_fd(), 42).unwrap();
        let mut events = Vec::new();
        poller.wait(&mut events, Some(Duration::ZERO)).unwrap();
        assert!(events.is_empty(), "no change yet");
        mount::mount_tmpfs(&target).unwrap();
        poller.wait(&mut events, Some(Duration::from_secs(10))).unwrap();
        assert_eq!(events, [42]);
        // The state resets once reported.
        poller.wait(&mut events, Some(Duration::ZERO)).unwrap();
        assert!(events.is_empty(), "reported twice for one change");
        mount::detach(&target).unwrap();
    })
    .join()
    .unwrap();
    fs::remove_dir(&dir).unwrap();
}

#[test]
fn fanotify_reports_mounts_of_the_marked_namespace_by_unique_id() {
    require_root();
    let dir = scratch_dir("fanotify");
    let target = dir.clone();
    std::thread::spawn(move || {
        private_namespace();
        let group = MountEvents::new().unwrap();
        let namespace = ns::open_thread_mount_namespace().unwrap();
        group.watch_namespace(namespace.as_fd()).unwrap();
        let mut reader = MountEventReader::default();
        let mut seen = Vec::new();
        assert_eq!(reader.drain(&group, |event| seen.push(event)).unwrap(), 0, "no change yet");
        mount::mount_tmpfs(&target).unwrap();
        let id = fuse::top_mount_id(&target).unwrap();
        // Unique IDs start above 2^31, clear of the reusable mountinfo IDs.
        assert!(id > 1 << 31, "{id} is not a unique mount ID");
        mount::detach(&target).unwrap();
        reader.drain(&group, |event| seen.push(event)).unwrap();
        assert_eq!(seen, [MountEvent::Attached(id), MountEvent::Detached(id)]);
    })
    .join()
    .unwrap();
    fs::remove_dir(&dir).unwrap();
}

#[test]
fn join_mount_namespace_moves_only_the_calling_thread() {
    require_root();
    let dir = scratch_dir("join");
    let (namespace_tx, namespace_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let target = dir.clone();
    let owner = std::thread::spawn(move || {
        private_namespace();
        mount::mount_tmpfs(&target).unwrap();
        fs::write(target.join("inside"), "").unwrap();
        namespace_tx.send(ns::current_thread_mount_namespace()).unwrap();
        // Keep the namespace alive until the joiner is done.
        let _ = done_rx.recv();
    });
    let namespace = namespace_rx.recv().unwrap();
    let probe = dir.join("inside");
    let seen_by_joiner = std::thread::spawn(move || {
        ns::join_mount_namespace(&namespace).unwrap();
        probe.exists()
    })
    .join()
    .unwrap();
    assert!(seen_by_joiner, "the joining thread must see the namespace's mounts");
    assert!(!dir.join("inside").exists(), "the rest of the process must stay where it was");
    drop(done_tx);
    owner.join().unwrap();
    fs::remove_dir(&dir).unwrap();
}

#[test]
fn a_namespace_fd_lets_another_thread_enter_after_its_owner_ended() {
    require_root();
    let dir = scratch_dir("enter");
    let target = dir.clone();
    let namespace = std::thread::spawn(move || {
        private_namespace();
        mount::mount_tmpfs(&target).unwrap();
        fs::write(target.join("inside"), "").unwrap();
        ns::open_thread_mount_namespace().unwrap()
    })
    .join()
    .unwrap();
    // The owner is gone; the fd keeps its namespace, and the tmpfs, alive.
    let inside = dir.clone();
    let seen = std::thread::spawn(move || {
        ns::enter_mount_namespace(namespace.as_fd()).unwrap();
        let seen = inside.join("inside").exists();
        mount::detach(&inside).unwrap();
        seen
    })
    .join()
    .unwrap();
    assert!(seen, "the entering thread must see the namespace's mounts");
    assert!(!dir.join("inside").exists(), "the rest of the process must stay where it was");
    fs::remove_dir(&dir).unwrap();
}

#[test]
fn kill_with_parent_kills_when_the_spawning_thread_ends() {
    let mut child = std::thread::spawn(|| {
        let mut command = Command::new("sleep");
        command.arg("1000");
        process::kill_with_parent(&mut command).spawn().unwrap()
    })
    .join()
    .unwrap();
    // The spawning thread has exited, the process lives on: the child got SIGKILL.
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
}

#[test]
fn signal_stops_continues_and_terminates() {
    let mut child = Command::new("sleep").arg("1000").spawn().unwrap();
    let state = |pid: u32| {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        stat.rsplit_once(") ").unwrap().1.chars().next().unwrap()
    };
    process::signal(child.id(), Signal::Stop).unwrap();
    while state(child.id()) != 'T' {
        std::thread::sleep(Duration::from_millis(1));
    }
    process::signal(child.id(), Signal::Cont).unwrap();
    while state(child.id()) == 'T' {
        std::thread::sleep(Duration::from_millis(1));
    }
    process::signal(child.id(), Signal::Term).unwrap();
    assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGTERM));
}

#[test]
fn move_mount_beneath_is_known_from_linux_6_5() {
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut numbers = release.split(|c: char| !c.is_ascii_digit()).map(|n| n.parse::<u32>().unwrap_or(0));
    let version = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
    // A backport may add it to an older kernel; none removes it from a newer.
    if version >= (6, 5) {
        assert!(mount::move_mount_beneath_supported(), "Linux {release}");
    }
}
