//! The FUSE filesystem built into fuse-supervisor: a read-only passthrough of
//! a backing directory, served by this process, for the demo and the tests.
//!
//! It is a real FUSE daemon, so it fails like one: after a `SIGKILL` its mount
//! stays and answers `ENOTCONN`; after a `SIGSTOP` requests hang. It mounts
//! with a raw `mount(2)`, so a new daemon can be started *on top of* the stale
//! mount of a dead one (libfuse daemons refuse that), as well as on a plain
//! directory.
//!
//! `fuse-supervisor-testbed demofs --backing DIR --mountpoint MP [--name N]`:
//! - mounts `fuse.N` (default `demofs`) with source `DIR` on `MP`, then prints
//!   the line `ready` on stdout once the kernel handshake is done: from then
//!   on the mount answers. Callers wait for that line.
//! - serves until the mount goes away (an unmount from outside ends it with
//!   exit status 0),
//! - on `SIGTERM` or `SIGINT` lazily detaches its mount, if it is still the
//!   top one at `MP`, and exits 0; the kernel connection ends with the
//!   process, so any remaining copy of the mount answers `ENOTCONN`.
//!
//! `--hand-off-on-signal PIDFILE` makes it a daemon that daemonizes late: it
//! mounts, holds the connection without answering it (requests wait), and
//! on `SIGUSR1` hands the descriptor to a successor process that it starts
//! (`--device-on-stdin`: the successor serves the connection on its stdin),
//! writes the successor's pid to `PIDFILE` once it answers, and exits 0
//! leaving the mount in place. The connection is then served by a process
//! that did not hold it before, like a libfuse daemon's child after
//! `fuse_daemonize`.
//!
//! `--answer-on-signal` makes it a daemon slow to answer: it mounts and
//! answers nothing (requests, the kernel's INIT first, wait) until
//! `SIGUSR1`, then serves as usual. A probe of its mount blocks meanwhile,
//! so a test can act between a heal's plan and its stack.
//!
//! `--hold-lookups-until-signal` makes it a daemon that answers `statfs`
//! and every other request but holds each `lookup` unanswered until
//! `SIGUSR1` (see `lookup_gate`): a mount that looks alive to a `statfs`
//! probe while any path resolved beneath its root hangs.
//!
//! `--hang-after-lookups N` makes it a daemon that passes a probe and then
//! hangs: it answers every request (`statfs`, `getattr`, …) until it has
//! answered N lookups, and from the next lookup on answers no request of
//! any kind until `SIGUSR1` (see `request_gate`). N is the number of path
//! components a probe looks up: 0 for a source probed at its root (its
//! `statfs` answers, the first lookup hangs), 1 for one subPath directory
//! one level down, and so on.
//!
//! `--hang-lookup NAME` makes it a tenant's server whose walks cannot be
//! cached: every entry and attribute it sends is valid for no time, so
//! every path walk through it asks it again, and it holds every lookup of
//! NAME (in any directory) until `SIGUSR1`, after answering the first
//! `--hang-lookup-after M` of them (default 0). Everything else it answers.
//!
//! `--odd-replies` makes it answer at the extremes FUSE allows: see
//! `PassthroughFs::with_odd_replies`.
//!
//! `--watchdog PIDFILE` makes it a watchdog like JuiceFS's mount process: it
//! mounts, takes the connection's INIT request and keeps the descriptor
//! without reading it again, and a child it starts on a copy serves
//! (`--device-on-stdin --init-request …`: see `relay`); the child's pid goes
//! to `PIDFILE` once it answers. When the child dies the connection lives on
//! in the watchdog (requests wait), and on `SIGUSR1` it starts the next
//! child on the same connection, which keeps the inode numbers the kernel
//! was given (`--inode-journal`). JuiceFS restarts its child a second after
//! a crash; here the caller decides when.
use std::ffi::OsString;
use std::io::{self, BufRead, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use fuse_supervisor_sys::fuse as sys_fuse;
use fuse_supervisor_sys::mount as sys_mount;
use fuser::{Config, Session, SessionACL};
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
use signal_hook::iterator::Signals;

mod lookup_gate;
mod passthrough;
mod relay;
mod request_gate;

use lookup_gate::LookupGate;
use passthrough::PassthroughFs;
pub use relay::{ReplayedInit, from_hex as init_request_from_hex};

/// What `fuse-supervisor-testbed demofs` serves, and where.
#[derive(Debug, Clone)]
pub struct DemoFsOptions {
    /// Directory whose contents the filesystem serves.
    pub backing: PathBuf,
    /// Where to mount; whatever is mounted there already stays underneath.
    pub mountpoint: PathBuf,
    /// FUSE subtype: the mount shows as `fuse.<name>`.
    pub name: String,
    /// How the connection is opened and who serves it.
    pub role: DemoFsRole,
}

/// Who mounts and who serves.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum DemoFsRole {
    /// Mounts and serves.
    #[default]
    Serve,
    /// Mounts, then on `SIGUSR1` hands the connection to a successor
    /// process, writes its pid to the file, and exits.
    HandOffOnSignal { pid_file: PathBuf },
    /// Serves the connection already mounted at the mountpoint through
    /// the `/dev/fuse` descriptor on stdin (a hand-off's successor).
    DeviceOnStdin,
    /// Like [`DemoFsRole::DeviceOnStdin`], on a connection whose INIT
    /// request a watchdog took (a watchdog's child), with the inode numbers
    /// the children before it gave the kernel, from `inode_journal`.
    WatchdogChild { init: ReplayedInit, inode_journal: PathBuf },
    /// Mounts, answers nothing until `SIGUSR1`, then serves.
    AnswerOnSignal,
    /// Mounts and serves, but holds every lookup's answer until `SIGUSR1`.
    HoldLookupsUntilSignal,
    /// Mounts and serves until `answered` lookups were answered, then holds
    /// every request from the next lookup on until `SIGUSR1`. Its entries
    /// and attributes are valid for no time, so a second walk of a path the
    /// probe looked up asks the daemon again.
    HangAfterLookups { answered: u32 },
    /// Mounts and serves with entries and attributes valid for no time,
    /// holding every lookup of `name` after the first `answered_first` until
    /// `SIGUSR1`.
    HangLookup { name: OsString, answered_first: u32 },
    /// Mounts and serves with replies at the extremes FUSE accepts.
    OddReplies,
    /// Mounts, keeps the connection, and has a child process serve it,
    /// writing its pid to the file; after the child dies, starts another
    /// on `SIGUSR1`.
    Watchdog { pid_file: PathBuf },
}

#[derive(Debug, thiserror::Error)]
pub enum DemoFsError {
    #[error("demofs backing directory {path} is not usable")]
    Backing {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("demofs backing {path} is not a directory")]
    BackingNotDirectory { path: PathBuf },
    #[error("demofs name {name:?} is not a valid fuse subtype")]
    InvalidName { name: String },
    #[error("cannot install the SIGTERM/SIGINT handlers")]
    Signals(#[source] io::Error),
    #[error("cannot open /dev/fuse")]
    OpenDevice(#[source] io::Error),
    #[error("cannot mount fuse.{name} on {mountpoint}")]
    Mount {
        mountpoint: PathBuf,
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("fuse handshake for {mountpoint} failed")]
    Handshake {
        mountpoint: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot start the {thread} thread for {mountpoint}")]
    SpawnThread {
        thread: &'static str,
        mountpoint: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("serving {mountpoint} failed")]
    Serve {
        mountpoint: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot detach the demofs mount on {mountpoint}")]
    Detach {
        mountpoint: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot use the inode journal {path} of the children before")]
    InodeJournal {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot relay the connection of {mountpoint} to the FUSE library")]
    Relay {
        mountpoint: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot take the /dev/fuse descriptor for {mountpoint} from stdin")]
    DeviceOnStdin {
        mountpoint: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot start a process to serve {mountpoint} ({step})")]
    ServingChild {
        mountpoint: PathBuf,
        step: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("cannot write the pid of the process serving {mountpoint} to {path}")]
    PidFile {
        mountpoint: PathBuf,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// What ends serving.
enum Stop {
    SessionEnded(io::Result<()>),
    Signal(i32),
}

/// Mounts and serves until the mount goes away or the process is killed.
pub fn serve(options: &DemoFsOptions) -> Result<(), DemoFsError> {
    // Before mounting: a signal that comes earlier kills the process while
    // there is no mount to leave behind yet.
    let delegates = matches!(
        options.role,
        DemoFsRole::HandOffOnSignal { .. }
            | DemoFsRole::Watchdog { .. }
            | DemoFsRole::AnswerOnSignal
            | DemoFsRole::HoldLookupsUntilSignal
            | DemoFsRole::HangAfterLookups { .. }
            | DemoFsRole::HangLookup { .. }
    );
    let signals = Signals::new(if delegates { &[SIGTERM, SIGINT, SIGUSR1][..] } else { &[SIGTERM, SIGINT][..] })
        .map_err(DemoFsError::Signals)?;

    if options.name.is_empty() || options.name.contains([',', '/', '\0']) {
        return Err(DemoFsError::InvalidName { name: options.name.clone() });
    }
    let backing = std::fs::canonicalize(&options.backing)
        .map_err(|source| DemoFsError::Backing { path: options.backing.clone(), source })?;
    let backing_metadata =
        std::fs::metadata(&backing).map_err(|source| DemoFsError::Backing { path: backing.clone(), source })?;
    if !backing_metadata.is_dir() {
        return Err(DemoFsError::BackingNotDirectory { path: backing });
    }
    let mountpoint = options.mountpoint.clone();

    if let DemoFsRole::DeviceOnStdin | DemoFsRole::WatchdogChild { .. } = &options.role {
        // A duplicate: the successor then holds the connection twice,
        // which changes nothing for the kernel.
        let device = io::stdin()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|source| DemoFsError::DeviceOnStdin { mountpoint: mountpoint.clone(), source })?;
        let served = match &options.role {
            DemoFsRole::WatchdogChild { init, .. } => relay::start(device, init)
                .map_err(|source| DemoFsError::Relay { mountpoint: mountpoint.clone(), source })?,
            _ => device,
        };
        return serve_device(options, backing, served, signals, None);
    }
    let device = sys_fuse::open_device().map_err(DemoFsError::OpenDevice)?;
    sys_fuse::mount(device.as_fd(), &mountpoint, &options.name, &backing.to_string_lossy())
        .map_err(|source| DemoFsError::Mount { mountpoint: mountpoint.clone(), name: options.name.clone(), source })?;
    match &options.role {
        DemoFsRole::HandOffOnSignal { pid_file } => hand_off_on_signal(options, pid_file, device, signals),
        DemoFsRole::Watchdog { pid_file } => watch_over_serving_children(options, pid_file, &device, signals),
        DemoFsRole::AnswerOnSignal => answer_on_signal(options, backing, device, signals),
        DemoFsRole::HangAfterLookups { answered } => {
            let answered = *answered;
            let (served, gate) = relay::start_gated(device, |library| {
                request_gate::RequestGate::closing_after_lookups(answered, library)
            })
            .map_err(|source| {
                detach_after(&mountpoint, DemoFsError::Relay { mountpoint: mountpoint.clone(), source })
            })?;
            serve_device(options, backing, served, signals, Some(Box::new(move || gate.release())))
        }
        DemoFsRole::Serve
        | DemoFsRole::DeviceOnStdin
        | DemoFsRole::WatchdogChild { .. }
        | DemoFsRole::HoldLookupsUntilSignal
        | DemoFsRole::HangLookup { .. }
        | DemoFsRole::OddReplies => serve_device(options, backing, device, signals, None),
    }
}

/// What `SIGUSR1` does to a daemon that holds requests: answers every one
/// held and lets the rest through; returns how many were held.
type Release = Box<dyn Fn() -> usize + Send>;

/// Serves the mounted connection on `device` until the mount goes away or
/// a signal ends it; `SIGUSR1` runs `release` (or opens the role's lookup
/// gate) instead.
fn serve_device(
    options: &DemoFsOptions,
    backing: PathBuf,
    device: OwnedFd,
    mut signals: Signals,
    release: Option<Release>,
) -> Result<(), DemoFsError> {
    let mountpoint = options.mountpoint.clone();

    // From here on the mount exists: any failure detaches it again rather
    // than leave a mount behind that no daemon will ever answer.
    let detach_on_error = |err: DemoFsError| {
        if let Err(detach_err) = sys_mount::detach(&mountpoint) {
            tracing::warn!(mountpoint = %mountpoint.display(), ?detach_err, "cannot detach after failure");
        }
        err
    };

    // fuser 0.18 reads the ACL from its own argument, not from the config;
    // set both so they cannot disagree.
    let mut config = Config::default();
    config.acl = SessionACL::All;
    let lookup_gate = match &options.role {
        DemoFsRole::HoldLookupsUntilSignal => Some(Arc::<LookupGate>::default()),
        DemoFsRole::HangLookup { name, answered_first } => {
            Some(Arc::new(LookupGate::for_name(name.clone(), *answered_first)))
        }
        _ => None,
    };
    let filesystem = match (&options.role, &lookup_gate) {
        (DemoFsRole::WatchdogChild { inode_journal, .. }, _) => {
            PassthroughFs::with_inode_journal(backing, inode_journal)
                .map_err(|source| DemoFsError::InodeJournal { path: inode_journal.clone(), source })?
        }
        (DemoFsRole::HangLookup { .. }, Some(gate)) => {
            PassthroughFs::new(backing).holding_lookups_at(Arc::clone(gate)).with_ttl(Duration::ZERO)
        }
        (_, Some(gate)) => PassthroughFs::new(backing).holding_lookups_at(Arc::clone(gate)),
        (DemoFsRole::HangAfterLookups { .. }, None) => PassthroughFs::new(backing).with_ttl(Duration::ZERO),
        (DemoFsRole::OddReplies, None) => PassthroughFs::new(backing).with_odd_replies(),
        _ => PassthroughFs::new(backing),
    };
    let release: Option<Release> = match (release, lookup_gate) {
        (Some(release), _) => Some(release),
        (None, Some(gate)) => Some(Box::new(move || gate.open())),
        (None, None) => None,
    };
    let session = Session::from_fd(filesystem, device, SessionACL::All, config)
        .map_err(|source| detach_on_error(DemoFsError::Handshake { mountpoint: mountpoint.clone(), source }))?;

    let (stop_sender, stop) = mpsc::channel();
    let session_stop = stop_sender.clone();
    std::thread::Builder::new()
        .name("demofs-session".into())
        .spawn(move || {
            // The receiver lives until serve() returns, and then nobody cares.
            let _ = session_stop.send(Stop::SessionEnded(session.run()));
        })
        .map_err(|source| {
            detach_on_error(DemoFsError::SpawnThread { thread: "session", mountpoint: mountpoint.clone(), source })
        })?;

    // Taken once requests are being answered: reading the mount ID asks the
    // daemon nothing, but if it ever did, it must not wait on ourselves.
    let own_mount = match sys_fuse::top_mount_id(&mountpoint) {
        Ok(id) => Some(id),
        Err(err) => {
            tracing::warn!(mountpoint = %mountpoint.display(), ?err, "cannot read own mount id");
            None
        }
    };

    std::thread::Builder::new()
        .name("demofs-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                match &release {
                    Some(release) if signal == SIGUSR1 => {
                        let held = release();
                        tracing::info!(held, "demofs answers what it held");
                    }
                    _ => {
                        let _ = stop_sender.send(Stop::Signal(signal));
                        break;
                    }
                }
            }
        })
        .map_err(|source| {
            detach_on_error(DemoFsError::SpawnThread { thread: "signal", mountpoint: mountpoint.clone(), source })
        })?;

    announce_ready();
    tracing::info!(mountpoint = %mountpoint.display(), name = %options.name, "demofs ready");

    // The session thread always sends before it ends, so recv() cannot fail
    // while the process lives; treat it as the session's end all the same.
    match stop.recv() {
        Ok(Stop::SessionEnded(Ok(()))) | Err(_) => Ok(()),
        Ok(Stop::SessionEnded(Err(source))) => Err(DemoFsError::Serve { mountpoint, source }),
        Ok(Stop::Signal(signal)) => {
            tracing::info!(mountpoint = %mountpoint.display(), signal, "demofs stopping");
            detach_own_mount(&mountpoint, own_mount)
        }
    }
    // Returning ends the process, which closes the device: the kernel aborts
    // the connection, and the session thread's blocked read ends with it.
}

/// Holds the mounted connection unanswered until `SIGUSR1`, then serves it.
fn answer_on_signal(
    options: &DemoFsOptions,
    backing: PathBuf,
    device: OwnedFd,
    mut signals: Signals,
) -> Result<(), DemoFsError> {
    let mountpoint = &options.mountpoint;
    tracing::info!(mountpoint = %mountpoint.display(), "demofs mounted; answering on SIGUSR1");
    match signals.forever().next() {
        Some(SIGUSR1) => serve_device(options, backing, device, signals, None),
        signal => {
            tracing::info!(mountpoint = %mountpoint.display(), ?signal, "demofs stopping before it answered");
            sys_mount::detach(mountpoint)
                .map_err(|source| DemoFsError::Detach { mountpoint: mountpoint.clone(), source })
        }
    }
}

/// Holds the mounted connection unserved until `SIGUSR1`, then starts a
/// successor serving it, writes the successor's pid to `pid_file` once it
/// answers, and returns (the process exits; the mount stays).
fn hand_off_on_signal(
    options: &DemoFsOptions,
    pid_file: &Path,
    device: OwnedFd,
    mut signals: Signals,
) -> Result<(), DemoFsError> {
    let mountpoint = &options.mountpoint;
    tracing::info!(mountpoint = %mountpoint.display(), "demofs mounted; handing off on SIGUSR1");
    match signals.forever().next() {
        Some(SIGUSR1) => {}
        signal => {
            tracing::info!(mountpoint = %mountpoint.display(), ?signal, "demofs stopping before the hand-off");
            return sys_mount::detach(mountpoint)
                .map_err(|source| DemoFsError::Detach { mountpoint: mountpoint.clone(), source });
        }
    }
    let successor = start_serving_child(options, device, None).map_err(|err| detach_after(mountpoint, err))?;
    write_pid_file(mountpoint, pid_file, successor.id()).map_err(|err| detach_after(mountpoint, err))?;
    tracing::info!(mountpoint = %mountpoint.display(), successor = successor.id(), "demofs handed off");
    Ok(())
}

/// Keeps the mounted connection while a child serves it, and starts the
/// next child on `SIGUSR1` once the last one has exited; any other signal
/// ends the child and detaches the mount.
fn watch_over_serving_children(
    options: &DemoFsOptions,
    pid_file: &Path,
    device: &OwnedFd,
    mut signals: Signals,
) -> Result<(), DemoFsError> {
    let mountpoint = &options.mountpoint;
    let copy = |device: &OwnedFd| {
        device.try_clone().map_err(|source| DemoFsError::ServingChild {
            mountpoint: mountpoint.clone(),
            step: "copy the descriptor",
            source,
        })
    };
    // Queued by the kernel at the mount; every child hands it to its library.
    let request = relay::take_init_request(device).map_err(|source| {
        detach_after(
            mountpoint,
            DemoFsError::ServingChild { mountpoint: mountpoint.clone(), step: "take the INIT request", source },
        )
    })?;
    let mut init = ReplayedInit { request, answer_kernel: true };
    // A new connection: the numbers of an earlier one mean nothing to it.
    let inode_journal = pid_file.with_extension("inodes");
    match std::fs::remove_file(&inode_journal) {
        Err(source) if source.kind() != io::ErrorKind::NotFound => {
            return Err(detach_after(mountpoint, DemoFsError::InodeJournal { path: inode_journal, source }));
        }
        _ => {}
    }
    let mut start_child = || {
        let watchdog = WatchdogHandOver { init: &init, inode_journal: &inode_journal };
        let child = copy(device).and_then(|copy| start_serving_child(options, copy, Some(watchdog)));
        // Once a child has served, the kernel has its answer.
        init.answer_kernel &= child.is_err();
        child
    };
    let mut child = start_child().map_err(|err| detach_after(mountpoint, err))?;
    loop {
        if let Err(err) = write_pid_file(mountpoint, pid_file, child.id()) {
            end_child(&mut child);
            return Err(detach_after(mountpoint, err));
        }
        tracing::info!(mountpoint = %mountpoint.display(), child = child.id(), "demofs child serves");
        match signals.forever().next() {
            Some(SIGUSR1) => {
                // The caller signals once the child has ended: this reaps it.
                if let Err(err) = child.wait() {
                    tracing::warn!(mountpoint = %mountpoint.display(), ?err, "cannot reap the serving child");
                }
                child = start_child().map_err(|err| detach_after(mountpoint, err))?;
            }
            signal => {
                tracing::info!(mountpoint = %mountpoint.display(), ?signal, "demofs watchdog stopping");
                end_child(&mut child);
                return sys_mount::detach(mountpoint)
                    .map_err(|source| DemoFsError::Detach { mountpoint: mountpoint.clone(), source });
            }
        }
    }
}

/// Kills and reaps a serving child (gone already if it crashed).
fn end_child(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// What a watchdog gives each child: the connection's INIT request and the
/// inode numbers the children before it handed out.
#[derive(Clone, Copy)]
struct WatchdogHandOver<'a> {
    init: &'a ReplayedInit,
    inode_journal: &'a Path,
}

/// Starts a process serving the connection mounted at the mountpoint through
/// `device` (its stdin), as a watchdog's child if `watchdog` says so, and
/// returns it once it answers.
fn start_serving_child(
    options: &DemoFsOptions,
    device: OwnedFd,
    watchdog: Option<WatchdogHandOver<'_>>,
) -> Result<Child, DemoFsError> {
    let failed = |step: &'static str| {
        move |source: io::Error| DemoFsError::ServingChild { mountpoint: options.mountpoint.clone(), step, source }
    };
    let exe = std::env::current_exe().map_err(failed("find this executable"))?;
    let mut command = Command::new(exe);
    command
        .args(["demofs", "--device-on-stdin", "--backing"])
        .arg(&options.backing)
        .arg("--mountpoint")
        .arg(&options.mountpoint)
        .arg("--name")
        .arg(&options.name);
    if let Some(WatchdogHandOver { init, inode_journal }) = watchdog {
        command.arg("--init-request").arg(relay::to_hex(&init.request));
        command.arg("--inode-journal").arg(inode_journal);
        if init.answer_kernel {
            command.arg("--answer-init");
        }
    }
    let mut child = command.stdin(Stdio::from(device)).stdout(Stdio::piped()).spawn().map_err(failed("spawn it"))?;
    let mut line = String::new();
    if let Some(stdout) = child.stdout.take() {
        io::BufReader::new(stdout).read_line(&mut line).map_err(failed("read its ready line"))?;
    }
    if line.trim() != "ready" {
        end_child(&mut child);
        return Err(failed("wait until it answers")(io::Error::other("it ended before it was ready")));
    }
    Ok(child)
}

/// Writes `pid` to `pid_file` whole: a reader polling it never sees part of it.
fn write_pid_file(mountpoint: &Path, pid_file: &Path, pid: u32) -> Result<(), DemoFsError> {
    let partial = pid_file.with_extension("partial");
    std::fs::write(&partial, pid.to_string()).and_then(|()| std::fs::rename(&partial, pid_file)).map_err(|source| {
        DemoFsError::PidFile { mountpoint: mountpoint.to_path_buf(), path: pid_file.to_path_buf(), source }
    })
}

/// Detaches the mount after `err`: a mount nobody will serve must not stay.
fn detach_after(mountpoint: &Path, err: DemoFsError) -> DemoFsError {
    if let Err(detach_err) = sys_mount::detach(mountpoint) {
        tracing::warn!(mountpoint = %mountpoint.display(), ?detach_err, "cannot detach after failure");
    }
    err
}

/// Detaches the top mount at `mountpoint` if it is ours. A mount stacked on
/// top of ours belongs to someone else and stays.
fn detach_own_mount(mountpoint: &Path, own_mount: Option<u64>) -> Result<(), DemoFsError> {
    match (own_mount, sys_fuse::top_mount_id(mountpoint)) {
        (Some(own), Ok(top)) if own != top => {
            tracing::info!(mountpoint = %mountpoint.display(), "another mount is on top of ours; leaving it");
            Ok(())
        }
        _ => sys_mount::detach(mountpoint)
            .map_err(|source| DemoFsError::Detach { mountpoint: mountpoint.to_path_buf(), source }),
    }
}

/// Tells the caller that the mount answers: one line `ready` on stdout.
fn announce_ready() {
    let mut stdout = io::stdout().lock();
    // A caller that does not read stdout does not wait for the line either.
    let _ = writeln!(stdout, "ready").and_then(|()| stdout.flush());
}
