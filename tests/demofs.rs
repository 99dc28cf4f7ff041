//! Root tests of the built-in FUSE filesystem (`fuse-supervisor-testbed
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

use fuse_supervisor_engine::model::mountinfo::parse_table;
use fuse_supervisor_sys::mount as sys_mount;
use fuse_supervisor_sys::process::Signal;
use fuse_supervisor_sys::resolve;
use fuse_supervisor_testbed::scenario::{self, DATA_FILE, FuseSource};
use fuse_supervisor_testbed::{Sandbox, SandboxChild};

/// The test world's programs (demofs, refuse-calls…).
const TESTBED: &str = env!("CARGO_BIN_EXE_fuse-supervisor-testbed");

const NAME: &str = "demofs-test";

/// A running `fuse-supervisor-testbed demofs` child in a sandbox; killed and reaped on drop
/// (the sandbox would do it at its end anyway).
struct Daemon {
    child: SandboxChild,
}

impl Daemon {
    /// Starts a daemon serving `backing` on `mountpoint` (sandbox paths) and
    /// returns once it has printed `ready`.
    fn start(sandbox: &Sandbox, backing: &Path, mountpoint: &Path) -> Daemon {
        Daemon::start_with(sandbox, backing, mountpoint, &[])
    }

    /// Like [`Daemon::start`], with more arguments.
    fn start_with(sandbox: &Sandbox, backing: &Path, mountpoint: &Path, args: &[&str]) -> Daemon {
        let mut command = Command::new(TESTBED);
        command
            .args(["demofs", "--name", NAME, "--backing"])
            .arg(backing)
            .arg("--mountpoint")
            .arg(mountpoint)
            .args(args)
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
    let mut source = FuseSource::start_watchdog(&sandbox, "watched").expect("start the watchdog");
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

/// Runs `call` on a thread of its own and returns what it answered, or
/// None if it has not answered within a short while: a held request never
/// answers, so any answer at all there would be wrong (not a timing
/// assertion). The receiver gets the late answer.
fn asked<T: Send + 'static>(call: impl FnOnce() -> T + Send + 'static) -> (Option<T>, mpsc::Receiver<T>) {
    let (sender, answer) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(call());
    });
    match answer.recv_timeout(Duration::from_millis(300)) {
        Ok(value) => (Some(value), answer),
        Err(_) => (None, answer),
    }
}

/// An answer that must come: a generous bound for a busy machine, as a hang
/// would never end.
fn answered<T>(answer: &mpsc::Receiver<T>, what: &str) -> T {
    answer.recv_timeout(Duration::from_secs(20)).unwrap_or_else(|_| panic!("{what} was not answered"))
}

/// `--hang-after-lookups 1`: a probe (statfs of the root, one lookup of a
/// subPath directory) is answered, and so is a statfs after it; the next
/// lookup and every request after it, a statfs too, wait until SIGUSR1,
/// which answers them all; the mount then goes as usual.
#[test]
fn hang_after_lookups_answers_a_probe_then_nothing_until_released() {
    use fuse_supervisor_sys::probe;
    let sandbox = Sandbox::new().expect("sandbox: these tests must run as root");
    let backing = make_backing(&sandbox);
    let mountpoint = make_mountpoint(&sandbox);
    let daemon = Daemon::start_with(&sandbox, &backing, &mountpoint, &["--hang-after-lookups", "1"]);
    let root = sandbox.outside_path(&mountpoint);

    let at = root.clone();
    let (probed, _) = asked(move || {
        let root = resolve::open_path(&at)?;
        probe::statfs(root.as_fd())?;
        probe::open_within_mount(root.as_fd(), Path::new("sub dir"))?;
        probe::statfs(root.as_fd())
    });
    assert!(matches!(probed, Some(Ok(()))), "the probe: {probed:?}");

    let file = root.join("top.txt");
    let (read, read_late) = asked(move || fs::read_to_string(file).map_err(|err| err.kind()));
    assert_eq!(read, None, "a lookup after the probe was answered");
    let at = root.clone();
    let (statfs, statfs_late) = asked(move || {
        let root = resolve::open_path(&at).map_err(|err| err.kind())?;
        probe::statfs(root.as_fd()).map_err(|err| err.kind())
    });
    assert_eq!(statfs, None, "a statfs after the held lookup was answered");

    daemon.signal(Signal::Usr1);
    assert_eq!(answered(&read_late, "the held lookup"), Ok("top\n".to_owned()));
    assert_eq!(answered(&statfs_late, "the held statfs"), Ok(()));
    ends_with_its_mount(&sandbox, &daemon, &mountpoint);
}

/// `--hang-lookup deeper --hang-lookup-after 1`: the first lookup of the
/// name is answered, with a zero entry timeout, so the next walk asks
/// again, and that lookup (of the name in any directory) waits while
/// others and statfs are answered; SIGUSR1 answers it.
#[test]
fn hang_lookup_holds_only_that_name_and_caches_nothing() {
    use fuse_supervisor_sys::probe;
    let sandbox = Sandbox::new().expect("sandbox: these tests must run as root");
    let backing = make_backing(&sandbox);
    let outside = sandbox.outside_path(&backing);
    fs::create_dir_all(outside.join("deeper")).unwrap();
    let mountpoint = make_mountpoint(&sandbox);
    let args = ["--hang-lookup", "deeper", "--hang-lookup-after", "1"];
    let daemon = Daemon::start_with(&sandbox, &backing, &mountpoint, &args);
    let root = sandbox.outside_path(&mountpoint);

    let first = root.join("deeper");
    let (walked, _) = asked(move || fs::metadata(first).map(|m| m.is_dir()).map_err(|err| err.kind()));
    assert_eq!(walked, Some(Ok(true)), "the first lookup of the name");

    let again = root.join("deeper");
    let (held, held_late) = asked(move || fs::metadata(again).map(|m| m.is_dir()).map_err(|err| err.kind()));
    assert_eq!(held, None, "a second walk was answered: from a cache, or the lookup was not held");
    let nested = root.join("sub dir/deeper/empty");
    let (nested, nested_late) = asked(move || fs::read(nested).map_err(|err| err.kind()));
    assert_eq!(nested, None, "the name in another directory was answered");

    let (others, _) = asked({
        let root = root.clone();
        move || {
            // Not in `sub dir`: the kernel serializes the lookups of one
            // directory (no FUSE_PARALLEL_DIROPS), so the held one there
            // holds every other lookup in it too.
            let read = fs::read_to_string(root.join("top.txt")).map_err(|err| err.kind());
            let fd = resolve::open_path(&root).map_err(|err| err.kind())?;
            probe::statfs(fd.as_fd()).map_err(|err| err.kind())?;
            read
        }
    });
    assert_eq!(others, Some(Ok("top\n".to_owned())), "other names and statfs");

    daemon.signal(Signal::Usr1);
    assert_eq!(answered(&held_late, "the held lookup"), Ok(true));
    assert_eq!(answered(&nested_late, "the nested lookup"), Ok(Vec::new()));
    ends_with_its_mount(&sandbox, &daemon, &mountpoint);
}

/// `--odd-replies`: the kernel takes a statfs of absurd figures, extreme
/// attributes and 100,000 made-up 255-byte names after a listing (that no
/// lookup finds), and the files still read.
#[test]
fn odd_replies_are_accepted_by_the_kernel() {
    use std::os::unix::fs::MetadataExt;
    let sandbox = Sandbox::new().expect("sandbox: these tests must run as root");
    let backing = make_backing(&sandbox);
    let mountpoint = make_mountpoint(&sandbox);
    let daemon = Daemon::start_with(&sandbox, &backing, &mountpoint, &["--odd-replies"]);
    let root = sandbox.outside_path(&mountpoint);

    let usage = fuse_supervisor_sys::fuse::fs_usage(&root).expect("statfs");
    assert_eq!((usage.blocks, usage.files, usage.blocks_available), (u64::MAX, u64::MAX, u64::MAX));
    assert_eq!(usage.block_size, u64::from(u32::MAX));

    let names: Vec<_> = fs::read_dir(&root).unwrap().map(|entry| entry.unwrap().file_name()).collect();
    let real = fs::read_dir(sandbox.outside_path(&backing)).unwrap().count();
    assert_eq!(names.len(), real + 100_000);
    let made_up: Vec<_> = names.iter().filter(|name| name.len() == 255).collect();
    assert_eq!(made_up.len(), 100_000);
    let missing = fs::metadata(root.join(made_up[0])).expect_err("a made-up name was found");
    assert_eq!(missing.kind(), ErrorKind::NotFound);

    let top = fs::metadata(root.join("top.txt")).unwrap();
    assert_eq!(top.nlink(), u64::from(u32::MAX));
    assert_eq!(top.blocks(), u64::MAX);
    assert_eq!(fs::read_to_string(root.join("top.txt")).unwrap(), "top\n");
    ends_with_its_mount(&sandbox, &daemon, &mountpoint);
}

/// SIGTERM ends `daemon` cleanly and takes its mount along.
fn ends_with_its_mount(sandbox: &Sandbox, daemon: &Daemon, mountpoint: &Path) {
    daemon.signal(Signal::Term);
    assert!(daemon.wait().success());
    assert_eq!(mounts_at(sandbox, mountpoint), []);
}
