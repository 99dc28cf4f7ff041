//! Root tests of the built-in FUSE filesystem (`fuse-supervisor internal
//! demofs`): each runs in a `testbed::Sandbox` (a private mount namespace),
//! with the daemon as a real child process in it. Files are made and read
//! from the test thread through `Sandbox::outside_path`.
use std::collections::BTreeMap;
use std::fs;
use std::io::{self, BufRead, BufReader, ErrorKind};
use std::os::fd::AsFd;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use fuse_supervisor::model::mountinfo::parse_table;
use fuse_supervisor::testbed::scenario::{self, DATA_FILE, FuseSource};
use fuse_supervisor::testbed::{Sandbox, SandboxChild};
use fuse_supervisor_sys::mount as sys_mount;
use fuse_supervisor_sys::process::Signal;
use fuse_supervisor_sys::resolve;

const NAME: &str = "demofs-test";

/// A running `internal demofs` child in a sandbox; killed and reaped on drop
/// (the sandbox would do it at its end anyway).
struct Daemon {
    child: SandboxChild,
}

impl Daemon {
    /// Starts a daemon serving `backing` on `mountpoint` (sandbox paths) and
    /// returns once it has printed `ready`.
    fn start(sandbox: &Sandbox, backing: &Path, mountpoint: &Path) -> Daemon {
        let mut command = Command::new(env!("CARGO_BIN_EXE_fuse-supervisor"));
        command
            .args(["internal", "demofs", "--name", NAME, "--backing"])
            .arg(backing)
            .arg("--mountpoint")
            .arg(mountpoint)
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        let mut child = sandbox.spawn(command).expect("spawn the demofs daemon");
        let stdout = child.take_stdout().expect("stdout is piped");
        let daemon = Daemon { child };
        let mut first_line = String::new();
        BufReader::new(stdout).read_line(&mut first_line).expect("read the daemon's stdout");
        if first_line.trim_end() != "ready" {
            let status = daemon.wait();
            panic!("demofs did not announce ready (said {first_line:?}), exited with {status}");
        }
        daemon
    }

    fn signal(&self, signal: Signal) {
        self.child.signal(signal).expect("signal the demofs daemon");
    }

    /// SIGSTOP, and waits until every thread has stopped: a thread busy when
    /// the signal came stops only on its way back to user space, and may
    /// answer one more request before it does.
    fn stop(&self) {
        self.signal(Signal::Stop);
        let tasks = format!("/proc/{}/task", self.child.pid());
        let all_stopped = || {
            fs::read_dir(&tasks).is_ok_and(|tasks| {
                tasks.filter_map(Result::ok).all(|task| {
                    let stat = fs::read_to_string(task.path().join("stat")).unwrap_or_default();
                    stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('T'))
                })
            })
        };
        scenario::wait_for("the daemon stopped", Duration::from_secs(10), all_stopped).expect("stopped");
    }

    fn wait(&self) -> ExitStatus {
        self.child.wait().expect("wait for the demofs daemon")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SIGKILL ends a stopped daemon too; an error means it is gone already.
        let _ = self.child.kill();
    }
}

/// One mount as the sandbox lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MountLine {
    fs_type: String,
    source: PathBuf,
}

/// The mounts at `mountpoint` in the sandbox, bottom first.
fn mounts_at(sandbox: &Sandbox, mountpoint: &Path) -> Vec<MountLine> {
    let table = sandbox.mountinfo();
    parse_table(table.as_bytes())
        .expect("the sandbox's table parses")
        .iter()
        .filter(|mount| mount.mount_point.to_path() == mountpoint)
        .map(|mount| MountLine { fs_type: mount.fs_type.to_owned(), source: mount.source.to_path().into_owned() })
        .collect()
}

#[derive(Debug, PartialEq, Eq)]
enum Node {
    Directory,
    File(Vec<u8>),
    Symlink(PathBuf),
}

/// Everything under `root`, read through ordinary file calls.
fn tree(root: &Path) -> BTreeMap<PathBuf, Node> {
    let mut nodes = BTreeMap::new();
    let mut pending = vec![PathBuf::new()];
    while let Some(relative) = pending.pop() {
        for entry in fs::read_dir(root.join(&relative)).expect("list a directory") {
            let entry = entry.expect("read a directory entry");
            let relative = relative.join(entry.file_name());
            let path = root.join(&relative);
            let node = match entry.file_type().expect("file type") {
                kind if kind.is_dir() => {
                    pending.push(relative.clone());
                    Node::Directory
                }
                kind if kind.is_symlink() => Node::Symlink(fs::read_link(&path).expect("readlink")),
                _ => Node::File(fs::read(&path).expect("read a file")),
            };
            nodes.insert(relative, node);
        }
    }
    nodes
}

/// A backing directory with a subdirectory, a name with spaces, a symlink and
/// a file larger than one FUSE read; returns its path in the sandbox.
fn make_backing(sandbox: &Sandbox) -> PathBuf {
    let backing = sandbox.root().join("backing");
    let outside = sandbox.outside_path(&backing);
    fs::create_dir_all(outside.join("sub dir/deeper")).unwrap();
    fs::write(outside.join("top.txt"), "top\n").unwrap();
    fs::write(outside.join("with spaces in name.txt"), "spaces\n").unwrap();
    fs::write(outside.join("sub dir/inner.txt"), "inner\n").unwrap();
    fs::write(outside.join("sub dir/deeper/empty"), "").unwrap();
    let large: Vec<u8> = (0..3_000_000u32).map(|n| (n % 251) as u8).collect();
    fs::write(outside.join("large.bin"), large).unwrap();
    symlink("sub dir/inner.txt", outside.join("link")).unwrap();
    backing
}

/// An empty directory to mount on; returns its path in the sandbox.
fn make_mountpoint(sandbox: &Sandbox) -> PathBuf {
    let mountpoint = sandbox.root().join("mnt");
    fs::create_dir(sandbox.outside_path(&mountpoint)).unwrap();
    mountpoint
}

fn assert_not_connected(result: io::Result<impl std::fmt::Debug>) {
    match result {
        Err(err) => assert_eq!(err.kind(), ErrorKind::NotConnected, "expected ENOTCONN, got {err}"),
        Ok(value) => panic!("expected ENOTCONN, got {value:?}"),
    }
}

#[test]
fn serves_the_backing_directory_read_only() {
    let sandbox = Sandbox::new().expect("sandbox: these tests must run as root");
    let backing = make_backing(&sandbox);
    let mountpoint = make_mountpoint(&sandbox);
    let _daemon = Daemon::start(&sandbox, &backing, &mountpoint);
    let (through, direct) = (sandbox.outside_path(&mountpoint), sandbox.outside_path(&backing));

    assert_eq!(tree(&through), tree(&direct));
    assert_eq!(fs::read_to_string(through.join("link")).unwrap(), "inner\n");
    let served = fs::metadata(through.join("with spaces in name.txt")).unwrap();
    let original = fs::metadata(direct.join("with spaces in name.txt")).unwrap();
    assert_eq!(served.len(), original.len());
    assert_eq!(served.permissions(), original.permissions());

    let mounts = mounts_at(&sandbox, &mountpoint);
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    assert_eq!(mounts[0].fs_type, format!("fuse.{NAME}"));
    assert_eq!(mounts[0].source, backing);

    // A change in the backing directory shows through.
    fs::write(direct.join("later.txt"), "later\n").unwrap();
    assert_eq!(fs::read_to_string(through.join("later.txt")).unwrap(), "later\n");

    let write = fs::write(through.join("top.txt"), "changed");
    assert_eq!(write.unwrap_err().raw_os_error(), Some(30), "EROFS");
    let create = fs::write(through.join("new.txt"), "new");
    assert_eq!(create.unwrap_err().raw_os_error(), Some(30), "EROFS");
    assert_eq!(fs::read_to_string(direct.join("top.txt")).unwrap(), "top\n");
}

#[test]
fn killed_daemon_leaves_a_dead_mount_that_a_new_daemon_stacks_on() {
    let sandbox = Sandbox::new().expect("sandbox: these tests must run as root");
    let backing = make_backing(&sandbox);
    let mountpoint = make_mountpoint(&sandbox);
    let through = sandbox.outside_path(&mountpoint);
    let first = Daemon::start(&sandbox, &backing, &mountpoint);
    assert_eq!(fs::read_to_string(through.join("top.txt")).unwrap(), "top\n");

    first.signal(Signal::Kill);
    first.wait();
    assert_not_connected(fs::read_to_string(through.join("top.txt")));
    assert_not_connected(fs::read_dir(&through));
    assert_eq!(mounts_at(&sandbox, &mountpoint).len(), 1, "the dead mount stays");

    // No detach first: the new mount goes on top of the dead one.
    let second = Daemon::start(&sandbox, &backing, &mountpoint);
    let mounts = mounts_at(&sandbox, &mountpoint);
    assert_eq!(mounts.len(), 2, "{mounts:?}");
    assert!(mounts.iter().all(|mount| mount.fs_type == format!("fuse.{NAME}")));
    assert_eq!(tree(&through), tree(&sandbox.outside_path(&backing)));

    // Stopping the new daemon removes its own mount only.
    second.signal(Signal::Term);
    assert!(second.wait().success());
    assert_eq!(mounts_at(&sandbox, &mountpoint).len(), 1);
    assert_not_connected(fs::read_to_string(through.join("top.txt")));
}

#[test]
fn terminate_and_interrupt_unmount_cleanly() {
    let sandbox = Sandbox::new().expect("sandbox: these tests must run as root");
    let backing = make_backing(&sandbox);
    let mountpoint = make_mountpoint(&sandbox);
    let through = sandbox.outside_path(&mountpoint);
    fs::write(through.join("underneath"), "plain directory").unwrap();
    for signal in [Signal::Term, Signal::Int] {
        let daemon = Daemon::start(&sandbox, &backing, &mountpoint);
        assert!(through.join("top.txt").exists());
        daemon.signal(signal);
        let status = daemon.wait();
        assert!(status.success(), "{signal:?}: {status}");
        assert_eq!(mounts_at(&sandbox, &mountpoint), vec![], "{signal:?}");
        let names: Vec<_> = fs::read_dir(&through).unwrap().map(|entry| entry.unwrap().file_name()).collect();
        assert_eq!(names, ["underneath"], "{signal:?}");
    }
}

#[test]
fn unmount_from_outside_ends_the_daemon() {
    let sandbox = Sandbox::new().expect("sandbox: these tests must run as root");
    let backing = make_backing(&sandbox);
    let mountpoint = make_mountpoint(&sandbox);
    let daemon = Daemon::start(&sandbox, &backing, &mountpoint);
    let target = mountpoint.clone();
    sandbox.run(move || sys_mount::detach(&target)).expect("detach the demofs mount");
    let status = daemon.wait();
    assert!(status.success(), "{status}");
}

#[test]
fn terminate_leaves_a_mount_stacked_on_top_alone() {
    let sandbox = Sandbox::new().expect("sandbox: these tests must run as root");
    let backing = make_backing(&sandbox);
    let mountpoint = make_mountpoint(&sandbox);
    let lower = Daemon::start(&sandbox, &backing, &mountpoint);
    let _upper = Daemon::start(&sandbox, &backing, &mountpoint);
    assert_eq!(mounts_at(&sandbox, &mountpoint).len(), 2);

    lower.signal(Signal::Term);
    assert!(lower.wait().success());
    // The lower mount is covered, so it stays (dead); the upper one answers.
    assert_eq!(mounts_at(&sandbox, &mountpoint).len(), 2);
    assert_eq!(fs::read_to_string(sandbox.outside_path(&mountpoint).join("top.txt")).unwrap(), "top\n");
}

#[test]
fn stopped_daemon_makes_requests_hang_until_continued() {
    let sandbox = Sandbox::new().expect("sandbox: these tests must run as root");
    let backing = make_backing(&sandbox);
    let mountpoint = make_mountpoint(&sandbox);
    let daemon = Daemon::start(&sandbox, &backing, &mountpoint);
    daemon.stop();

    // The file was never looked up, so no cached entry can answer for the
    // daemon.
    let (sender, answer) = mpsc::channel();
    let file = sandbox.outside_path(&mountpoint.join("sub dir/inner.txt"));
    let reader = std::thread::spawn(move || {
        let _ = sender.send(fs::read_to_string(file).map_err(|err| err.kind()));
    });
    // Not a timing assertion: a stopped daemon never answers, so any
    // answer at all here would be wrong.
    assert_eq!(
        answer.recv_timeout(Duration::from_millis(300)),
        Err(mpsc::RecvTimeoutError::Timeout),
        "a stopped daemon answered"
    );

    // What the supervisor asks of a FUSE mount without touching it: an
    // O_PATH handle and its mount ID (statx from the cache) answer at once.
    let (sender, mount_id) = mpsc::channel();
    let root = sandbox.outside_path(&mountpoint);
    let asker = std::thread::spawn(move || {
        let _ = sender.send(resolve::open_path(&root).and_then(|fd| resolve::mount_id_of(fd.as_fd())).ok());
    });
    let table = sandbox.mountinfo();
    let listed = parse_table(table.as_bytes())
        .unwrap()
        .iter()
        .rfind(|m| m.mount_point.to_path() == mountpoint)
        .unwrap()
        .mount_id;
    // A generous bound for a busy machine: a hang would never end.
    assert_eq!(
        mount_id.recv_timeout(Duration::from_secs(10)),
        Ok(Some(listed)),
        "mount ID of a stopped daemon's mount"
    );
    asker.join().unwrap();

    daemon.signal(Signal::Cont);
    assert_eq!(answer.recv().unwrap(), Ok("inner\n".to_owned()));
    reader.join().unwrap();
}

/// A watchdog keeps the connection while its child serves it; after the
/// child is killed, the next one serves the same connection (the kernel's
/// INIT, answered once, handed to each child's library again): the mount
/// neither dies nor is replaced.
#[test]
fn a_watchdogs_next_child_serves_the_same_connection() {
    let sandbox = Sandbox::new().expect("sandbox: these tests must run as root");
    let binary = Path::new(env!("CARGO_BIN_EXE_fuse-supervisor"));
    let mut source = FuseSource::start_watchdog(&sandbox, binary, "watched").expect("start the watchdog");
    let data = sandbox.outside_path(&source.path.join(DATA_FILE));
    assert_eq!(fs::read_to_string(&data).unwrap(), source.expected_content());
    let mounts = mounts_at(&sandbox, &source.path);
    assert_eq!(mounts.len(), 1, "{mounts:?}");

    let first = source.crash_serving_child().unwrap();
    let second = source.restart_serving_child().unwrap();
    assert_ne!(first, second);
    assert_eq!(fs::read_to_string(&data).unwrap(), source.expected_content());
    assert_eq!(fs::read_dir(sandbox.outside_path(&source.path)).unwrap().count(), 2, "data file and subdirectory");
    assert_eq!(mounts_at(&sandbox, &source.path), mounts, "the same mount");
}
