//! Root tests of the built-in FUSE filesystem (`fuse-supervisor internal
//! demofs`): each runs on its own thread in its own private mount namespace,
//! with the daemon as a real child process in that namespace.
//!
//! The namespace helper here is deliberately small and private; it belongs in
//! `fuse_supervisor::testbed::Sandbox` once that settles.
use std::collections::BTreeMap;
use std::fs;
use std::io::{self, BufRead, BufReader, ErrorKind};
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use fuse_supervisor_sys::mount::{self as sys_mount, Propagation};
use fuse_supervisor_sys::ns;
use fuse_supervisor_sys::process::{self as sys_process, Signal};

const NAME: &str = "demofs-test";

/// Runs `test` on a new thread in a new private mount namespace, with a fresh
/// tmpfs as scratch space, and hands back its result or its panic. The
/// namespace, and every mount in it, goes away with the thread.
fn in_private_namespace<T: Send + 'static>(test: impl FnOnce(&Path) -> T + Send + 'static) -> T {
    // Created on the host, so that it is removed (empty) after the namespace
    // whose tmpfs covered it is gone.
    let scratch = tempfile::tempdir().expect("create scratch directory");
    let scratch_path = scratch.path().to_path_buf();
    let result = std::thread::spawn(move || {
        ns::unshare_mount_namespace().expect("unshare the mount namespace: these tests must run as root");
        sys_mount::set_propagation(Path::new("/"), Propagation::Private, true).expect("make / recursively private");
        sys_mount::mount_tmpfs(&scratch_path).expect("mount the scratch tmpfs");
        test(&scratch_path)
    })
    .join();
    drop(scratch);
    match result {
        Ok(value) => value,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// A running `internal demofs` child; killed and reaped on drop.
struct Daemon {
    child: Child,
    exited: Option<ExitStatus>,
}

impl Daemon {
    /// Starts a daemon and returns once it has printed `ready`. Must be called
    /// on the namespace thread: the child lives in the caller's namespace and
    /// dies with the caller's thread.
    fn start(backing: &Path, mountpoint: &Path) -> Daemon {
        let mut command = Command::new(env!("CARGO_BIN_EXE_fuse-supervisor"));
        command
            .args(["internal", "demofs", "--name", NAME, "--backing"])
            .arg(backing)
            .arg("--mountpoint")
            .arg(mountpoint)
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        sys_process::kill_with_parent(&mut command);
        let mut child = command.spawn().expect("spawn the demofs daemon");
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut daemon = Daemon { child, exited: None };
        let first_line = read_line(stdout);
        if first_line != "ready" {
            let status = daemon.wait();
            panic!("demofs did not announce ready (said {first_line:?}), exited with {status}");
        }
        daemon
    }

    fn signal(&self, signal: Signal) {
        sys_process::signal(self.child.id(), signal).expect("signal the demofs daemon");
    }

    fn wait(&mut self) -> ExitStatus {
        let status = self.child.wait().expect("wait for the demofs daemon");
        self.exited = Some(status);
        status
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.exited.is_none() {
            // SIGKILL ends a stopped daemon too; errors mean it is gone already.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn read_line(stdout: ChildStdout) -> String {
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("read the daemon's stdout");
    line.trim_end().to_owned()
}

/// One mount as the calling thread's namespace lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MountLine {
    mount_point: PathBuf,
    fs_type: String,
    source: String,
}

/// The mounts at `mountpoint` in the calling thread's namespace, bottom first.
fn mounts_at(mountpoint: &Path) -> Vec<MountLine> {
    let table = fs::read_to_string("/proc/thread-self/mountinfo").expect("read mountinfo");
    table
        .lines()
        .filter_map(|line| {
            let (mount, filesystem) = line.split_once(" - ")?;
            let mount_point = mount.split(' ').nth(4)?;
            let mut filesystem = filesystem.split(' ');
            Some(MountLine {
                mount_point: PathBuf::from(unescape(mount_point)),
                fs_type: filesystem.next()?.to_owned(),
                source: unescape(filesystem.next()?),
            })
        })
        .filter(|mount| mount.mount_point == mountpoint)
        .collect()
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape(field: &str) -> String {
    let mut out = Vec::new();
    let bytes = field.as_bytes();
    let mut index = 0;
    while index < bytes.len() {
        let octal = bytes
            .get(index + 1..index + 4)
            .and_then(|digits| u8::from_str_radix(std::str::from_utf8(digits).ok()?, 8).ok());
        match (bytes[index], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                index += 4;
            }
            (byte, _) => {
                out.push(byte);
                index += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
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
/// a file larger than one FUSE read.
fn make_backing(scratch: &Path) -> PathBuf {
    let backing = scratch.join("backing");
    fs::create_dir_all(backing.join("sub dir/deeper")).unwrap();
    fs::write(backing.join("top.txt"), "top\n").unwrap();
    fs::write(backing.join("with spaces in name.txt"), "spaces\n").unwrap();
    fs::write(backing.join("sub dir/inner.txt"), "inner\n").unwrap();
    fs::write(backing.join("sub dir/deeper/empty"), "").unwrap();
    let large: Vec<u8> = (0..3_000_000u32).map(|n| (n % 251) as u8).collect();
    fs::write(backing.join("large.bin"), large).unwrap();
    symlink("sub dir/inner.txt", backing.join("link")).unwrap();
    backing
}

fn make_mountpoint(scratch: &Path) -> PathBuf {
    let mountpoint = scratch.join("mnt");
    fs::create_dir(&mountpoint).unwrap();
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
    in_private_namespace(|scratch| {
        let backing = make_backing(scratch);
        let mountpoint = make_mountpoint(scratch);
        let _daemon = Daemon::start(&backing, &mountpoint);

        assert_eq!(tree(&mountpoint), tree(&backing));
        assert_eq!(fs::read_to_string(mountpoint.join("link")).unwrap(), "inner\n");
        let through = fs::metadata(mountpoint.join("with spaces in name.txt")).unwrap();
        let direct = fs::metadata(backing.join("with spaces in name.txt")).unwrap();
        assert_eq!(through.len(), direct.len());
        assert_eq!(through.permissions(), direct.permissions());

        let mounts = mounts_at(&mountpoint);
        assert_eq!(mounts.len(), 1, "{mounts:?}");
        assert_eq!(mounts[0].fs_type, format!("fuse.{NAME}"));
        assert_eq!(Path::new(&mounts[0].source), backing);

        // A change in the backing directory shows through.
        fs::write(backing.join("later.txt"), "later\n").unwrap();
        assert_eq!(fs::read_to_string(mountpoint.join("later.txt")).unwrap(), "later\n");

        let write = fs::write(mountpoint.join("top.txt"), "changed");
        assert_eq!(write.unwrap_err().raw_os_error(), Some(30), "EROFS");
        let create = fs::write(mountpoint.join("new.txt"), "new");
        assert_eq!(create.unwrap_err().raw_os_error(), Some(30), "EROFS");
        assert_eq!(fs::read_to_string(backing.join("top.txt")).unwrap(), "top\n");
    });
}

#[test]
fn killed_daemon_leaves_a_dead_mount_that_a_new_daemon_stacks_on() {
    in_private_namespace(|scratch| {
        let backing = make_backing(scratch);
        let mountpoint = make_mountpoint(scratch);
        let mut first = Daemon::start(&backing, &mountpoint);
        assert_eq!(fs::read_to_string(mountpoint.join("top.txt")).unwrap(), "top\n");

        first.signal(Signal::Kill);
        first.wait();
        assert_not_connected(fs::read_to_string(mountpoint.join("top.txt")));
        assert_not_connected(fs::read_dir(&mountpoint));
        assert_eq!(mounts_at(&mountpoint).len(), 1, "the dead mount stays");

        // No detach first: the new mount goes on top of the dead one.
        let mut second = Daemon::start(&backing, &mountpoint);
        let mounts = mounts_at(&mountpoint);
        assert_eq!(mounts.len(), 2, "{mounts:?}");
        assert!(mounts.iter().all(|mount| mount.fs_type == format!("fuse.{NAME}")));
        assert_eq!(tree(&mountpoint), tree(&backing));

        // Stopping the new daemon removes its own mount only.
        second.signal(Signal::Term);
        assert!(second.wait().success());
        assert_eq!(mounts_at(&mountpoint).len(), 1);
        assert_not_connected(fs::read_to_string(mountpoint.join("top.txt")));
    });
}

#[test]
fn terminate_and_interrupt_unmount_cleanly() {
    in_private_namespace(|scratch| {
        let backing = make_backing(scratch);
        let mountpoint = make_mountpoint(scratch);
        fs::write(mountpoint.join("underneath"), "plain directory").unwrap();
        for signal in [Signal::Term, Signal::Int] {
            let mut daemon = Daemon::start(&backing, &mountpoint);
            assert!(mountpoint.join("top.txt").exists());
            daemon.signal(signal);
            let status = daemon.wait();
            assert!(status.success(), "{signal:?}: {status}");
            assert_eq!(mounts_at(&mountpoint), vec![], "{signal:?}");
            let names: Vec<_> = fs::read_dir(&mountpoint).unwrap().map(|entry| entry.unwrap().file_name()).collect();
            assert_eq!(names, ["underneath"], "{signal:?}");
        }
    });
}

#[test]
fn unmount_from_outside_ends_the_daemon() {
    in_private_namespace(|scratch| {
        let backing = make_backing(scratch);
        let mountpoint = make_mountpoint(scratch);
        let mut daemon = Daemon::start(&backing, &mountpoint);
        sys_mount::detach(&mountpoint).expect("detach the demofs mount");
        let status = daemon.wait();
        assert!(status.success(), "{status}");
    });
}

#[test]
fn terminate_leaves_a_mount_stacked_on_top_alone() {
    in_private_namespace(|scratch| {
        let backing = make_backing(scratch);
        let mountpoint = make_mountpoint(scratch);
        let mut lower = Daemon::start(&backing, &mountpoint);
        let _upper = Daemon::start(&backing, &mountpoint);
        assert_eq!(mounts_at(&mountpoint).len(), 2);

        lower.signal(Signal::Term);
        assert!(lower.wait().success());
        // The lower mount is covered, so it stays (dead); the upper one answers.
        assert_eq!(mounts_at(&mountpoint).len(), 2);
        assert_eq!(fs::read_to_string(mountpoint.join("top.txt")).unwrap(), "top\n");
    });
}

#[test]
fn stopped_daemon_makes_requests_hang_until_continued() {
    in_private_namespace(|scratch| {
        let backing = make_backing(scratch);
        let mountpoint = make_mountpoint(scratch);
        let daemon = Daemon::start(&backing, &mountpoint);
        daemon.signal(Signal::Stop);

        // Threads started here share the namespace. The file was never
        // looked up, so no cached entry can answer for the daemon.
        let (sender, answer) = mpsc::channel();
        let file = mountpoint.join("sub dir/inner.txt");
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

        daemon.signal(Signal::Cont);
        assert_eq!(answer.recv().unwrap(), Ok("inner\n".to_owned()));
        reader.join().unwrap();
    });
}

#[test]
fn mountinfo_escapes_are_undone() {
    assert_eq!(unescape(r"/a\040b\011c\134d"), "/a b\tc\\d");
    assert_eq!(unescape(r"plain\04"), r"plain\04");
}
