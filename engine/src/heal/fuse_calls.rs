//! The calls that wait on a FUSE server, made in a helper process.
//!
//! A request a FUSE server has read waits for its answer uninterruptibly:
//! the thread making it ignores even SIGKILL, and a process with such a
//! thread cannot exit until the server answers, exits or is aborted. A
//! new source daemon that hangs during its probe would hold the agent's
//! exit with it. So the calls that ask a FUSE server something (a probe's
//! `statfs`, the lookups of subPath directories in a new source) are made
//! by `fuse-supervisor fuse-calls`, a child the agent starts once: the
//! agent hands it a descriptor on the filesystem and the paths to open
//! beneath it, and takes back the answer and the opened descriptors
//! (`SCM_RIGHTS` over a `SOCK_SEQPACKET` socket per call). The agent's
//! thread waits in `recvmsg`, which a signal ends; a server that never
//! answers holds one thread of the helper, and the helper ends with the
//! agent's end (its control socket reads end-of-file) once the server lets
//! that thread go.
//!
//! Without the helper (it could not be started, or another program uses
//! the library) the calls are made in this process, as before.
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use fuse_supervisor_sys::fd_messages::{self, MAX_FDS};
use fuse_supervisor_sys::probe as sys;
use tracing::{debug, info, warn};

use crate::errors::chain;
use crate::heal::priority::HealPriority;

/// The helper's subcommand.
pub const SUBCOMMAND: &str = "fuse-calls";

/// What a FUSE filesystem answered through a descriptor on it.
#[derive(Debug)]
pub enum Answer {
    /// `statfs` was asked first and failed (ENOTCONN for a dead daemon);
    /// nothing was opened.
    StatfsFailed(io::Error),
    /// Each path asked, opened beneath the descriptor (O_PATH, on its
    /// mount, no links) or why not, in the order asked.
    Opened(Vec<io::Result<OwnedFd>>),
}

/// Asks the filesystem `dir` is on for `statfs` (if `statfs_first`), then
/// opens each of `paths` beneath `dir`; through the helper when it runs.
/// Blocks for as long as the server takes: call it off the loop.
pub fn ask(dir: BorrowedFd<'_>, statfs_first: bool, paths: &[PathBuf]) -> Answer {
    ask_as(dir, Ask { statfs_first, reach: Reach::WithinMount }, paths)
}

/// Opens the mount on each of `paths` beneath `dir` (see
/// [`sys::open_mount_within`]): their parent directories' lookups are in
/// `dir`'s filesystem, so off the loop.
pub fn open_mounts_within(dir: BorrowedFd<'_>, paths: &[PathBuf]) -> Vec<io::Result<OwnedFd>> {
    match ask_as(dir, Ask { statfs_first: false, reach: Reach::OntoMount }, paths) {
        Answer::Opened(opened) if opened.len() == paths.len() => opened,
        Answer::Opened(_) | Answer::StatfsFailed(_) => {
            paths.iter().map(|_| Err(io::Error::other("the FUSE call helper answered out of turn"))).collect()
        }
    }
}

/// What one call asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ask {
    statfs_first: bool,
    reach: Reach,
}

/// Where a path's lookup may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// Within the descriptor's mount ([`sys::open_within_mount`]).
    WithinMount,
    /// Onto the mount on the path's last name ([`sys::open_mount_within`]).
    OntoMount,
}

fn ask_as(dir: BorrowedFd<'_>, ask: Ask, paths: &[PathBuf]) -> Answer {
    let Some(helper) = HELPER.get() else { return answer_here(dir, ask, paths) };
    if !paths.iter().any(|path| too_long(path)) {
        return ask_through(helper, dir, ask, paths);
    }
    // Refused before any lookup (ENAMETOOLONG): answered here, the rest by the helper.
    let fitting: Vec<PathBuf> = paths.iter().filter(|path| !too_long(path)).cloned().collect();
    let mut opened = match ask_through(helper, dir, ask, &fitting) {
        Answer::Opened(opened) => opened.into_iter(),
        failed => return failed,
    };
    let merged = paths
        .iter()
        .map(|path| match too_long(path) {
            true => Err(sys::name_too_long()),
            false => opened.next().unwrap_or_else(|| Err(ended_early())),
        })
        .collect();
    Answer::Opened(merged)
}

fn ask_through(helper: &Helper, dir: BorrowedFd<'_>, ask: Ask, paths: &[PathBuf]) -> Answer {
    match helper.ask(dir, ask, paths) {
        Ok(answer) => answer,
        Err(err) => {
            if !FELL_BACK.swap(true, Ordering::Relaxed) {
                warn!(err = %chain(&err), "the FUSE call helper does not answer; FUSE calls are made in the agent, whose exit a hung daemon can then hold");
            }
            answer_here(dir, ask, paths)
        }
    }
}

fn too_long(path: &Path) -> bool {
    path.as_os_str().len() > PATH_MAX
}

/// Opens `path` beneath `dir`, on its mount: a lookup in `dir`'s
/// filesystem, so off the loop.
pub fn open_beneath(dir: BorrowedFd<'_>, path: &Path) -> io::Result<OwnedFd> {
    match ask(dir, false, &[path.to_path_buf()]) {
        Answer::Opened(mut opened) if opened.len() == 1 => opened.remove(0),
        Answer::Opened(_) | Answer::StatfsFailed(_) => {
            Err(io::Error::other("the FUSE call helper answered out of turn"))
        }
    }
}

/// `statfs` of the filesystem `fd` is on: answered by its server.
pub fn statfs(fd: BorrowedFd<'_>) -> io::Result<()> {
    match ask(fd, true, &[]) {
        Answer::Opened(_) => Ok(()),
        Answer::StatfsFailed(err) => Err(err),
    }
}

/// Starts the helper for every later call of this process: `command` runs
/// [`serve`] (this program's [`SUBCOMMAND`], with its log flags), given the
/// socket as its standard input and `--realtime-priority` for its call
/// threads, as the agent's probes have.
pub fn start_helper(command: Command, priority: HealPriority) -> io::Result<()> {
    let program = command.get_program().to_os_string();
    let args: Vec<OsString> = command.get_args().map(OsStr::to_os_string).collect();
    let running = Running::spawn(&program, &args, priority)?;
    info!(pid = running.child.id(), "FUSE calls are made by a helper process");
    let helper = Helper { program, args, priority, running: Mutex::new(running), idle: Mutex::new(Vec::new()) };
    HELPER.set(helper).map_err(|_| io::Error::new(io::ErrorKind::AlreadyExists, "the FUSE call helper runs already"))
}

/// Serves the agent's calls on `control` (the helper's standard input) until
/// the agent closes it: each connection comes as a socket of its own,
/// served on a thread of its own one call after another, so one server
/// that never answers holds one thread.
pub fn serve(control: OwnedFd, priority: HealPriority) -> io::Result<()> {
    let mut buf = [0u8; 1];
    loop {
        let received = fd_messages::recv(control.as_fd(), &mut buf)?;
        if received.len == 0 && received.fds.is_empty() {
            return Ok(());
        }
        for connection in received.fds {
            let spawned = std::thread::Builder::new().name("fuse-call".into()).spawn(move || {
                priority.raise();
                // Until the agent closes it.
                while let Some(call) = read_call(connection.as_fd()).transpose() {
                    if let Err(err) = call.and_then(|call| answer_call(connection.as_fd(), call)) {
                        // The agent sees the connection end and makes the call itself.
                        debug!(err = %chain(&err), "cannot serve a FUSE call");
                        return;
                    }
                }
            });
            if let Err(err) = spawned {
                warn!(err = %chain(&err), "cannot start a thread for a FUSE call; the agent makes it itself");
            }
        }
    }
}

static HELPER: OnceLock<Helper> = OnceLock::new();
/// Warned once: every later call would fall back the same way.
static FELL_BACK: AtomicBool = AtomicBool::new(false);

/// The most request bytes in one message; a call with more paths goes in
/// several. Far below a socket's buffer, and a path is at most 4 KiB.
const REQUEST_CHUNK: usize = 32 * 1024;
/// The longest path the kernel looks up (`PATH_MAX`, with its NUL); a
/// longer one is refused before any lookup.
const PATH_MAX: usize = 4096;
const REQUEST_BUFFER: usize = 1 + REQUEST_CHUNK + 4 + PATH_MAX;
/// First byte of a request message: `statfs` is asked first.
const STATFS: u8 = 1;
/// First byte of any message: more of the same call follow.
const MORE: u8 = 2;
/// First byte of a request message: each path's last name crosses onto the
/// mount there ([`Reach::OntoMount`]).
const ONTO_MOUNT: u8 = 4;

#[derive(Debug)]
struct Helper {
    program: OsString,
    args: Vec<OsString>,
    priority: HealPriority,
    running: Mutex<Running>,
    /// Connections whose last call was answered: each has a thread of the
    /// helper waiting on it, so a call costs two wake-ups, not a thread's
    /// start. A call held by its server keeps its connection.
    idle: Mutex<Vec<OwnedFd>>,
}

#[derive(Debug)]
struct Running {
    control: OwnedFd,
    child: Child,
}

impl Running {
    fn spawn(program: &OsStr, args: &[OsString], priority: HealPriority) -> io::Result<Running> {
        let (control, theirs) = fd_messages::pair()?;
        let mut command = Command::new(program);
        command.args(args).stdin(Stdio::from(theirs)).stdout(Stdio::null());
        if let Some(priority) = priority.value() {
            command.arg("--realtime-priority").arg(priority.to_string());
        }
        Ok(Running { control, child: command.spawn()? })
    }
}

impl Helper {
    /// One call through the helper, on an idle connection or a new one;
    /// an error means the helper did not answer. An idle connection that
    /// fails (its helper was killed since) is dropped and the call made
    /// again on a new one, which starts another helper if need be: both
    /// calls only look.
    fn ask(&self, dir: BorrowedFd<'_>, ask: Ask, paths: &[PathBuf]) -> io::Result<Answer> {
        let idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner).pop();
        if let Some(connection) = idle
            && let Ok(answer) = self.call(connection, dir, ask, paths)
        {
            return Ok(answer);
        }
        self.call(self.connect()?, dir, ask, paths)
    }

    /// The call on `connection`, which goes back to the idle ones once
    /// answered.
    fn call(&self, connection: OwnedFd, dir: BorrowedFd<'_>, ask: Ask, paths: &[PathBuf]) -> io::Result<Answer> {
        send_request(connection.as_fd(), dir, ask, paths)?;
        let answer = read_answer(connection.as_fd(), paths.len())?;
        self.idle.lock().unwrap_or_else(PoisonError::into_inner).push(connection);
        Ok(answer)
    }

    /// A new connection, served by a thread of the helper of its own.
    fn connect(&self) -> io::Result<OwnedFd> {
        let (ours, theirs) = fd_messages::pair()?;
        let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        if fd_messages::send(running.control.as_fd(), &[0], &[theirs.as_fd()]).is_ok() {
            return Ok(ours);
        }
        // Killed (the OOM killer, say): reap it and start another. The idle
        // connections were its own.
        let ended = running.child.try_wait();
        warn!(pid = running.child.id(), ?ended, "the FUSE call helper is gone; starting another");
        self.idle.lock().unwrap_or_else(PoisonError::into_inner).clear();
        *running = Running::spawn(&self.program, &self.args, self.priority)?;
        fd_messages::send(running.control.as_fd(), &[0], &[theirs.as_fd()])?;
        Ok(ours)
    }
}

fn send_request(call: BorrowedFd<'_>, dir: BorrowedFd<'_>, ask: Ask, paths: &[PathBuf]) -> io::Result<()> {
    let mut chunks = Vec::new();
    let mut chunk = Vec::new();
    for path in paths {
        let bytes = path.as_os_str().as_bytes();
        if too_long(path) {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        if !chunk.is_empty() && chunk.len() + 4 + bytes.len() > REQUEST_CHUNK {
            chunks.push(std::mem::take(&mut chunk));
        }
        chunk.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        chunk.extend_from_slice(bytes);
    }
    chunks.push(chunk);
    let count = chunks.len();
    for (index, chunk) in chunks.into_iter().enumerate() {
        let mut flags = if ask.statfs_first { STATFS } else { 0 };
        if ask.reach == Reach::OntoMount {
            flags |= ONTO_MOUNT;
        }
        if index + 1 < count {
            flags |= MORE;
        }
        let message = [&[flags][..], &chunk].concat();
        // The descriptor travels with the first message only.
        let fds = if index == 0 { vec![dir] } else { Vec::new() };
        fd_messages::send(call, &message, &fds)?;
    }
    Ok(())
}

fn read_answer(call: BorrowedFd<'_>, asked: usize) -> io::Result<Answer> {
    let mut opened = Vec::with_capacity(asked);
    let mut buf = vec![0u8; 5 + 4 * MAX_FDS];
    loop {
        let received = fd_messages::recv(call, &mut buf)?;
        let message = buf.get(..received.len).unwrap_or_default();
        let (&flags, rest) = message.split_first().ok_or_else(ended_early)?;
        let (statfs_errno, entries) = rest.split_at_checked(4).ok_or_else(ended_early)?;
        let statfs_errno = i32::from_le_bytes(statfs_errno.try_into().map_err(|_| ended_early())?);
        if statfs_errno != 0 {
            return Ok(Answer::StatfsFailed(io::Error::from_raw_os_error(statfs_errno)));
        }
        let mut fds = received.fds.into_iter();
        for errno in entries.chunks_exact(4) {
            let errno = i32::from_le_bytes(errno.try_into().map_err(|_| ended_early())?);
            opened.push(match errno {
                0 => Ok(fds.next().ok_or_else(ended_early)?),
                errno => Err(io::Error::from_raw_os_error(errno)),
            });
        }
        if flags & MORE == 0 {
            break;
        }
    }
    if opened.len() != asked {
        return Err(io::Error::other(format!("the FUSE call helper answered {} of {asked} paths", opened.len())));
    }
    Ok(Answer::Opened(opened))
}

fn ended_early() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "the FUSE call helper's answer ended early")
}

/// A call as the helper reads it.
struct Call {
    dir: OwnedFd,
    ask: Ask,
    paths: Vec<PathBuf>,
}

/// Reads the next call on a connection; None at its end.
fn read_call(connection: BorrowedFd<'_>) -> io::Result<Option<Call>> {
    let mut buf = vec![0u8; REQUEST_BUFFER];
    let mut dir = None;
    let mut ask;
    let mut paths = Vec::new();
    loop {
        let received = fd_messages::recv(connection, &mut buf)?;
        if received.len == 0 && received.fds.is_empty() && dir.is_none() && paths.is_empty() {
            return Ok(None);
        }
        if dir.is_none() {
            dir = received.fds.into_iter().next();
        }
        let message = buf.get(..received.len).unwrap_or_default();
        let Some((&flags, mut entries)) = message.split_first() else { return Err(ended_early()) };
        let reach = if flags & ONTO_MOUNT != 0 { Reach::OntoMount } else { Reach::WithinMount };
        ask = Ask { statfs_first: flags & STATFS != 0, reach };
        while let Some((len, rest)) = entries.split_at_checked(4) {
            let len = u32::from_le_bytes(len.try_into().map_err(|_| ended_early())?) as usize;
            let (path, rest) = rest.split_at_checked(len).ok_or_else(ended_early)?;
            paths.push(PathBuf::from(OsStr::from_bytes(path)));
            entries = rest;
        }
        if flags & MORE == 0 {
            break;
        }
    }
    let dir = dir.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "a FUSE call without a descriptor"))?;
    Ok(Some(Call { dir, ask, paths }))
}

/// Makes a call and answers it.
fn answer_call(connection: BorrowedFd<'_>, call: Call) -> io::Result<()> {
    match answer_here(call.dir.as_fd(), call.ask, &call.paths) {
        Answer::StatfsFailed(err) => send_answer(connection, errno_of(&err), &[], false),
        Answer::Opened(opened) => {
            let chunks: Vec<_> = opened.chunks(MAX_FDS).collect();
            if chunks.is_empty() {
                return send_answer(connection, 0, &[], false);
            }
            let count = chunks.len();
            for (index, chunk) in chunks.into_iter().enumerate() {
                send_answer(connection, 0, chunk, index + 1 < count)?;
            }
            Ok(())
        }
    }
}

fn send_answer(call: BorrowedFd<'_>, statfs_errno: i32, opened: &[io::Result<OwnedFd>], more: bool) -> io::Result<()> {
    let mut message = vec![if more { MORE } else { 0 }];
    message.extend_from_slice(&statfs_errno.to_le_bytes());
    let mut fds = Vec::new();
    for result in opened {
        let errno = match result {
            Ok(fd) => {
                fds.push(fd.as_fd());
                0
            }
            Err(err) => errno_of(err),
        };
        message.extend_from_slice(&errno.to_le_bytes());
    }
    fd_messages::send(call, &message, &fds)
}

/// The errno an error is answered with; EIO for one without.
fn errno_of(err: &io::Error) -> i32 {
    err.raw_os_error().filter(|&errno| errno != 0).unwrap_or(sys::eio())
}

fn answer_here(dir: BorrowedFd<'_>, ask: Ask, paths: &[PathBuf]) -> Answer {
    if ask.statfs_first
        && let Err(err) = sys::statfs(dir)
    {
        return Answer::StatfsFailed(err);
    }
    let open = match ask.reach {
        Reach::WithinMount => sys::open_within_mount,
        Reach::OntoMount => sys::open_mount_within,
    };
    Answer::Opened(paths.iter().map(|path| open(dir, path)).collect())
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;

    use super::*;

    /// A helper served by a thread of this process over a socket pair, as
    /// the child serves the agent.
    fn served() -> (OwnedFd, std::thread::JoinHandle<io::Result<()>>) {
        let (control, theirs) = fd_messages::pair().unwrap();
        let server = std::thread::spawn(move || serve(theirs, HealPriority::OFF));
        (control, server)
    }

    fn ask_through(control: &OwnedFd, dir: BorrowedFd<'_>, statfs_first: bool, paths: &[PathBuf]) -> Answer {
        let (ours, theirs) = fd_messages::pair().unwrap();
        fd_messages::send(control.as_fd(), &[0], &[theirs.as_fd()]).unwrap();
        send_request(ours.as_fd(), dir, Ask { statfs_first, reach: Reach::WithinMount }, paths).unwrap();
        read_answer(ours.as_fd(), paths.len()).unwrap()
    }

    #[test]
    fn many_paths_are_asked_and_answered_in_several_messages_in_order() {
        let dir = tempfile::tempdir().unwrap();
        // More answers than one message carries descriptors, more path bytes than one request chunk.
        let long = "d".repeat(200);
        let mut paths = Vec::new();
        for index in 0..2 * MAX_FDS + 10 {
            let name = format!("{long}{index}");
            if index % 3 == 0 {
                std::fs::create_dir(dir.path().join(&name)).unwrap();
            }
            paths.push(PathBuf::from(name));
        }
        let root = fuse_supervisor_sys::resolve::open_path(dir.path()).unwrap();
        let (control, server) = served();

        let Answer::Opened(opened) = ask_through(&control, root.as_fd(), true, &paths) else { panic!("statfs failed") };
        assert_eq!(opened.len(), paths.len());
        for (index, result) in opened.iter().enumerate() {
            match result {
                Ok(fd) => {
                    assert_eq!(index % 3, 0, "{index} opened");
                    let opened = std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
                    let expected = std::fs::metadata(dir.path().join(&paths[index])).unwrap();
                    assert_eq!(opened.ino(), expected.ino());
                }
                Err(err) => {
                    assert_ne!(index % 3, 0, "{index}: {err}");
                    assert_eq!(err.kind(), io::ErrorKind::NotFound);
                }
            }
        }
        drop(control);
        server.join().unwrap().unwrap();
    }

    #[test]
    fn a_link_is_refused_and_a_call_without_paths_answers_its_statfs() {
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/etc", dir.path().join("link")).unwrap();
        let root = fuse_supervisor_sys::resolve::open_path(dir.path()).unwrap();
        let (control, _server) = served();
        let Answer::Opened(opened) = ask_through(&control, root.as_fd(), false, &[PathBuf::from("link")]) else {
            panic!("statfs was not asked")
        };
        assert!(opened[0].is_err(), "a symlink was followed");
        assert!(matches!(ask_through(&control, root.as_fd(), true, &[]), Answer::Opened(ref none) if none.is_empty()));
    }

    #[test]
    fn a_connection_serves_one_call_after_another() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let root = fuse_supervisor_sys::resolve::open_path(dir.path()).unwrap();
        let (control, server) = served();
        let (connection, theirs) = fd_messages::pair().unwrap();
        fd_messages::send(control.as_fd(), &[0], &[theirs.as_fd()]).unwrap();
        drop(theirs);
        for _ in 0..3 {
            send_request(
                connection.as_fd(),
                root.as_fd(),
                Ask { statfs_first: true, reach: Reach::WithinMount },
                &[PathBuf::from("sub")],
            )
            .unwrap();
            let answer = read_answer(connection.as_fd(), 1).unwrap();
            assert!(matches!(answer, Answer::Opened(ref opened) if opened[0].is_ok()), "{answer:?}");
        }
        drop((connection, control));
        server.join().unwrap().unwrap();
    }

    #[test]
    fn a_failed_statfs_reaches_the_caller_with_its_errno() {
        let (ours, theirs) = fd_messages::pair().unwrap();
        send_answer(theirs.as_fd(), ENOTCONN, &[], false).unwrap();
        match read_answer(ours.as_fd(), 3).unwrap() {
            Answer::StatfsFailed(err) => assert_eq!(err.kind(), io::ErrorKind::NotConnected),
            answer => panic!("{answer:?}"),
        }
    }

    #[test]
    fn an_answer_cut_short_is_an_error_not_an_answer() {
        let (ours, theirs) = fd_messages::pair().unwrap();
        // One path answered as opened, but no descriptor came with it.
        fd_messages::send(theirs.as_fd(), &[0, 0, 0, 0, 0, 0, 0, 0, 0], &[]).unwrap();
        assert_eq!(read_answer(ours.as_fd(), 1).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        drop(theirs);
        assert!(read_answer(ours.as_fd(), 1).is_err(), "the helper's end is an answer");
    }

    /// Linux's ENOTCONN: a dead FUSE daemon's answer.
    const ENOTCONN: i32 = 107;
}
