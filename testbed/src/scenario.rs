//! Node scenarios built on a [`Sandbox`]: FUSE sources served by a real
//! daemon that can crash and come back, pods bound to them, and the
//! supervisor as a separate process. Shared by the heal tests, the demo and
//! the latency harness.
use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use fuse_supervisor_sys::fuse as sys_fuse;
use fuse_supervisor_sys::mount;
use fuse_supervisor_sys::pidfd::PidFd;
use fuse_supervisor_sys::poll::Poller;
use fuse_supervisor_sys::process::{self, Signal};

pub use super::observe::ScenarioError;
use super::observe::{fuse_connections_in, io_step};
pub use super::observe::{fuse_mount_ids_at, http_get, layers_at, wait_for, wait_for_table};
pub use super::supervisor_process::SupervisorProcess;
use super::{Sandbox, SandboxChild};

mod daemonized;
mod holding;
pub use holding::LeftDaemon;

use holding::Holding;

/// The file every source serves at its root, and the subdirectory that
/// subPath targets bind.
pub const DATA_FILE: &str = "data.txt";
pub const SUBDIR: &str = "sub";
pub const SUBDIR_FILE: &str = "inner.txt";

const MOUNT_TIMEOUT: Duration = Duration::from_secs(10);

/// Which FUSE daemon serves a source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Daemon {
    /// The project's own filesystem (`fuse-supervisor-testbed demofs`).
    DemoFs,
    /// Debian's bindfs, a libfuse3 daemon.
    Bindfs,
    /// bindfs without `-f`: it mounts, forks, and the process that mounted
    /// exits once its child serves (libfuse's `fuse_daemonize`), leaving the
    /// connection to a process that is nobody's child.
    BindfsDaemonized,
    /// Debian's rclone, `rclone mount` of a local directory: a Go daemon
    /// (its own FUSE library) that mounts through `fusermount3`.
    Rclone,
    /// Debian's sshfs, a libfuse3 daemon, in passive mode: SFTP over a pipe
    /// to a local `sftp-server` (its helper process), no network. It alone
    /// of the three can mount over its stale mount: given a `/dev/fuse`
    /// already mounted there (`/dev/fd/N`, as a mount helper hands a daemon
    /// its connection), libfuse serves it without looking at the mount point.
    Sshfs,
}

impl Daemon {
    pub fn name(self) -> &'static str {
        match self {
            Daemon::DemoFs => "demofs",
            Daemon::Bindfs => "bindfs",
            Daemon::BindfsDaemonized => "bindfs-daemonized",
            Daemon::Rclone => "rclone",
            Daemon::Sshfs => "sshfs",
        }
    }

    /// Whether it can be restarted with [`Restart::MountOverStale`].
    pub fn mounts_over_stale(self) -> bool {
        matches!(self, Daemon::DemoFs | Daemon::Sshfs)
    }
}

/// How a crashed daemon comes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restart {
    /// The stale global mount is detached, then the daemon mounts afresh
    /// (what libfuse daemons must do).
    UnmountThenMount,
    /// The daemon mounts over the stale global mount (raw mount(2)); the
    /// kernel propagates the new mount to every target by itself.
    MountOverStale,
    /// The daemon starts again on its mount point as it finds it, as a FUSE
    /// pod restarted by its kubelet does: libfuse daemons stat the mount
    /// point first, and a dead mount there makes them exit (ENOTCONN).
    InPlace,
}

/// A global FUSE mount under the sandbox's runtime tree and its daemon.
pub struct FuseSource {
    pub path: PathBuf,
    pub backing: PathBuf,
    daemon: Daemon,
    process: Option<SandboxChild>,
    /// A process the daemon needs beside it (sshfs's `sftp-server`),
    /// killed with it.
    helper: Option<SandboxChild>,
    generation: u32,
    /// How a demofs leaves its connection to another process, and the file
    /// where it writes that process's pid (as the sandbox sees it, and from
    /// outside); a hand-off's is gone once done.
    delegation: Option<(Delegation, PathBuf, PathBuf)>,
    /// The process a hand-off left serving, the watchdog's serving child,
    /// or a daemonized daemon: not a child of the sandbox, so killed here.
    successor: Option<u32>,
    /// What the next demofs launched holds back until `SIGUSR1`.
    next_holds: Option<Holding>,
    /// The running daemon holds lookups it has read: their callers cannot
    /// be killed until it answers or its connection ends.
    holds_lookups: bool,
}

/// A demofs whose connection is served by a process other than the one that
/// mounted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Delegation {
    /// `--hand-off-on-signal`: on SIGUSR1, to a successor, and exits.
    HandOff,
    /// `--watchdog`: to a child, and to the next one once it died.
    Watchdog,
}

impl FuseSource {
    /// Creates the backing directory (a data file and a subdirectory) and
    /// mounts `runtime/<name>` served by `daemon`.
    pub fn start(sandbox: &Sandbox, daemon: Daemon, name: &str) -> Result<Self, ScenarioError> {
        Self::start_at(sandbox, daemon, name, &sandbox.runtime_root().join(name).join("fuse"))
    }

    /// Like [`FuseSource::start`], mounted at `path` (a CSI staging
    /// directory, say) instead of under the runtime tree.
    pub fn start_at(sandbox: &Sandbox, daemon: Daemon, name: &str, path: &Path) -> Result<Self, ScenarioError> {
        Self::start_with(sandbox, daemon, name, path, None)
    }

    /// A demofs that mounts `runtime/<name>` but leaves it unanswered until
    /// [`FuseSource::hand_off`] makes it hand the connection to a
    /// successor process and exit: a daemon that daemonizes after it was
    /// seen holding its connection.
    pub fn start_handing_off(sandbox: &Sandbox, name: &str) -> Result<Self, ScenarioError> {
        let path = sandbox.runtime_root().join(name).join("fuse");
        Self::start_with(sandbox, Daemon::DemoFs, name, &path, Some(Delegation::HandOff))
    }

    /// A demofs watchdog that mounts `runtime/<name>` and keeps the
    /// connection while a child it starts serves it, like JuiceFS's mount
    /// process; [`FuseSource::crash_serving_child`] kills the child and
    /// [`FuseSource::restart_serving_child`] has the watchdog start the
    /// next one on the same connection. Returns once the first child serves.
    pub fn start_watchdog(sandbox: &Sandbox, name: &str) -> Result<Self, ScenarioError> {
        let path = sandbox.runtime_root().join(name).join("fuse");
        Self::start_with(sandbox, Daemon::DemoFs, name, &path, Some(Delegation::Watchdog))
    }

    fn start_with(
        sandbox: &Sandbox,
        daemon: Daemon,
        name: &str,
        path: &Path,
        delegation: Option<Delegation>,
    ) -> Result<Self, ScenarioError> {
        let backing = sandbox.root().join("backing").join(name);
        let path = path.to_path_buf();
        // Files are made from the sandbox thread: the sandbox's tmpfs hides
        // the host directory of the same name.
        let (dirs, inner, text) = (
            [backing.join(SUBDIR), path.clone()],
            backing.join(SUBDIR).join(SUBDIR_FILE),
            format!("inside {name}/{SUBDIR}"),
        );
        sandbox
            .run(move || {
                dirs.iter().try_for_each(fs::create_dir_all)?;
                fs::write(inner, text)
            })
            .map_err(io_step(format!("create backing directory {}", backing.display())))?;
        let delegation = delegation.map(|delegation| {
            let pid_file = sandbox.root().join(format!("{name}.successor.pid"));
            let outside = sandbox.outside_path(&pid_file);
            (delegation, pid_file, outside)
        });
        let mut source = FuseSource {
            path,
            backing,
            daemon,
            process: None,
            helper: None,
            generation: 0,
            delegation,
            successor: None,
            next_holds: None,
            holds_lookups: false,
        };
        source.write_generation(sandbox)?;
        source.launch(sandbox, false)?;
        Ok(source)
    }

    pub fn daemon(&self) -> Daemon {
        self.daemon
    }

    /// What `data.txt` reads while the current daemon generation serves.
    pub fn expected_content(&self) -> String {
        format!("{} generation {}", self.path.display(), self.generation)
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(SandboxChild::pid).or(self.successor)
    }

    /// The process serving the connection for the one that mounted it: a
    /// hand-off's successor, the watchdog's current child, or a daemonized
    /// daemon's child.
    pub fn serving_child(&self) -> Option<u32> {
        self.successor
    }

    /// Makes a demofs started by [`FuseSource::start_handing_off`] hand its
    /// connection to a successor, and waits until the successor serves and
    /// the first process exited. Returns the successor's pid.
    pub fn hand_off(&mut self) -> Result<u32, ScenarioError> {
        let Some((Delegation::HandOff, _, pid_file)) = self.delegation.clone() else {
            return Err(ScenarioError::Io {
                step: "hand off".into(),
                source: io::Error::other("the daemon was not started to hand off"),
            });
        };
        let process = self.process.take().ok_or_else(|| ScenarioError::Io {
            step: "hand off".into(),
            source: io::Error::other("no daemon running"),
        })?;
        process.signal(Signal::Usr1).map_err(io_step("signal demofs to hand off"))?;
        let status = process.wait().map_err(io_step("wait for demofs to hand off"))?;
        let successor = read_pid(&pid_file).map_err(io_step(format!("read {}", pid_file.display())))?;
        self.successor = Some(successor);
        self.delegation = None;
        if !status.success() {
            return Err(ScenarioError::Io {
                step: "hand off".into(),
                source: io::Error::other(format!("demofs exited with {status}")),
            });
        }
        Ok(successor)
    }

    /// The watchdog's serving child: SIGKILLed, and gone when this returns
    /// (the watchdog keeps the connection). Returns its pid.
    pub fn crash_serving_child(&mut self) -> Result<u32, ScenarioError> {
        let child = self.successor.ok_or_else(|| ScenarioError::Io {
            step: "crash the serving child".into(),
            source: io::Error::other("no serving child"),
        })?;
        self.kill_successor()?;
        Ok(child)
    }

    /// Has the watchdog start its next serving child, after
    /// [`FuseSource::crash_serving_child`], and returns its pid once it serves.
    pub fn restart_serving_child(&mut self) -> Result<u32, ScenarioError> {
        let process = self.process.as_ref().ok_or_else(|| ScenarioError::Io {
            step: "restart the serving child".into(),
            source: io::Error::other("no watchdog running"),
        })?;
        let before = self.delegation.as_ref().and_then(|(_, _, pid_file)| read_pid(pid_file).ok());
        process.signal(Signal::Usr1).map_err(io_step("signal the watchdog to restart its child"))?;
        self.wait_for_serving_child(before)
    }

    /// Waits until the watchdog names a serving child other than `before`.
    fn wait_for_serving_child(&mut self, before: Option<u32>) -> Result<u32, ScenarioError> {
        let Some((Delegation::Watchdog, _, pid_file)) = self.delegation.clone() else {
            return Err(ScenarioError::Io {
                step: "wait for the serving child".into(),
                source: io::Error::other("the daemon is not a watchdog"),
            });
        };
        let mut child = None;
        wait_for("the watchdog's serving child", MOUNT_TIMEOUT, || {
            child = read_pid(&pid_file).ok().filter(|pid| Some(*pid) != before);
            child.is_some()
        })?;
        self.successor = child;
        child.ok_or_else(|| ScenarioError::Timeout {
            what: "the watchdog's serving child".into(),
            waited: MOUNT_TIMEOUT,
        })
    }

    /// SIGKILLs a successor left by a hand-off (or one started by a hand-off
    /// that did not finish), or a watchdog's serving child, and waits until
    /// it is gone.
    fn kill_successor(&mut self) -> Result<(), ScenarioError> {
        let pending = self.delegation.as_ref().and_then(|(_, _, pid_file)| read_pid(pid_file).ok());
        let Some(pid) = self.successor.take().or(pending) else { return Ok(()) };
        let Ok(process) = PidFd::open(pid) else { return Ok(()) };
        process.signal(Signal::Kill).map_err(io_step(format!("kill the successor {pid}")))?;
        // Not our child: it is gone once its pidfd is readable.
        let poller = Poller::new().map_err(io_step("poll the successor"))?;
        poller.add_readable(process.as_fd(), 0).map_err(io_step("poll the successor"))?;
        poller.wait(&mut Vec::new(), Some(MOUNT_TIMEOUT)).map_err(io_step("wait for the successor to exit"))?;
        Ok(())
    }

    fn write_generation(&self, sandbox: &Sandbox) -> Result<(), ScenarioError> {
        let (file, content) = (self.backing.join(DATA_FILE), self.expected_content());
        sandbox.run(move || fs::write(file, content)).map_err(io_step("write data file"))
    }

    /// Starts the daemon; with `over_stale`, on a connection mounted over
    /// whatever is at the path (sshfs only; demofs mounts over it itself).
    fn launch(&mut self, sandbox: &Sandbox, over_stale: bool) -> Result<(), ScenarioError> {
        // Connections, not mount IDs: the ID of a dead mount detached just
        // before (by the supervisor) is free for the new one at once.
        let before = fuse_connections_in(&sandbox.mountinfo(), &self.path);
        let watchdog_pid_file = match &self.delegation {
            Some((Delegation::Watchdog, _, pid_file)) => Some(pid_file.clone()),
            _ => None,
        };
        // The last generation's child must not pass for this one's.
        if let Some(pid_file) = &watchdog_pid_file
            && let Err(err) = fs::remove_file(pid_file)
            && err.kind() != io::ErrorKind::NotFound
        {
            return Err(io_step(format!("remove {}", pid_file.display()))(err));
        }
        let mut command = match self.daemon {
            Daemon::DemoFs => {
                let programs = crate::programs_binary().map_err(io_step("find the test world's programs"))?;
                let mut command = Command::new(programs);
                command.args(["demofs", "--backing"]).arg(&self.backing).arg("--mountpoint").arg(&self.path);
                match &self.delegation {
                    Some((Delegation::HandOff, pid_file, _)) => command.arg("--hand-off-on-signal").arg(pid_file),
                    Some((Delegation::Watchdog, pid_file, _)) => command.arg("--watchdog").arg(pid_file),
                    None => match self.next_holds {
                        Some(Holding::Everything) => command.arg("--answer-on-signal"),
                        Some(Holding::Lookups) => command.arg("--hold-lookups-until-signal"),
                        Some(Holding::AfterLookups(lookups)) => {
                            command.arg("--hang-after-lookups").arg(lookups.to_string())
                        }
                        None => &mut command,
                    },
                };
                command
            }
            Daemon::Bindfs | Daemon::BindfsDaemonized => {
                let mut command = Command::new(super::system::program("bindfs"));
                if self.daemon == Daemon::Bindfs {
                    command.arg("-f");
                }
                command.args(["-o", "allow_other"]).arg(&self.backing).arg(&self.path);
                command
            }
            Daemon::Rclone => {
                // An empty configuration: a local path needs no remote.
                let config = sandbox.root().join("rclone.conf");
                let written = config.clone();
                sandbox.run(move || fs::write(written, "")).map_err(io_step("write rclone's configuration"))?;
                let mut command = Command::new(super::system::program("rclone"));
                command.arg("mount").arg(&self.backing).arg(&self.path).arg("--config").arg(config);
                command.args(["--allow-other", "--log-level", "ERROR"]);
                command
            }
            Daemon::Sshfs => self.sshfs_command(sandbox, over_stale)?,
        };
        if self.daemon != Daemon::Sshfs {
            command.stdin(Stdio::null()).stdout(Stdio::null());
        }
        command.stderr(Stdio::inherit());
        let command_line = daemonized::command_line(&command);
        let process = sandbox.spawn(command).map_err(io_step(format!("start {}", self.daemon.name())))?;
        let path = self.path.clone();
        let exited = || process.try_wait().ok().flatten();
        wait_for_table(
            sandbox,
            &format!("{} mounted at {}", self.daemon.name(), path.display()),
            MOUNT_TIMEOUT,
            |table| fuse_connections_in(table, &path).difference(&before).next().is_some() || exited().is_some(),
        )?;
        if self.daemon == Daemon::BindfsDaemonized {
            self.successor = Some(daemonized::serving_child(&process, &command_line, self.daemon.name())?);
            return Ok(());
        }
        if let Some(status) = exited() {
            return Err(ScenarioError::DaemonExited { daemon: self.daemon.name(), status });
        }
        self.process = Some(process);
        self.holds_lookups = self.daemon == Daemon::DemoFs
            && matches!(self.next_holds, Some(Holding::Lookups | Holding::AfterLookups(_)));
        if watchdog_pid_file.is_some() {
            self.wait_for_serving_child(None)?;
        }
        Ok(())
    }

    /// sshfs in passive mode, its SFTP session on a pair of pipes to a
    /// local `sftp-server`, which is started here as its helper. With
    /// `over_stale`, the connection is mounted here, over whatever is at
    /// the path, and sshfs gets it as `/dev/fd/N`.
    fn sshfs_command(&mut self, sandbox: &Sandbox, over_stale: bool) -> Result<Command, ScenarioError> {
        let (from_sshfs, to_server) = io::pipe().map_err(io_step("make sshfs's pipes"))?;
        let (from_server, to_sshfs) = io::pipe().map_err(io_step("make sshfs's pipes"))?;
        let mut server = Command::new(super::system::program("sftp-server"));
        server.stdin(from_sshfs).stdout(to_sshfs).stderr(Stdio::inherit());
        self.helper = Some(sandbox.spawn(server).map_err(io_step("start sftp-server"))?);
        let mut command = Command::new(super::system::program("sshfs"));
        command.args(["-f", "-o", "passive,allow_other"]).arg(format!("localhost:{}", self.backing.display()));
        if over_stale {
            let (path, source) = (self.path.clone(), format!("localhost:{}", self.backing.display()));
            let device = sandbox
                .run(move || {
                    let device = sys_fuse::open_device()?;
                    sys_fuse::mount(device.as_fd(), &path, "sshfs", &source).map(|()| device)
                })
                .map_err(io_step(format!("mount sshfs's connection over {}", self.path.display())))?;
            command.arg(format!("/dev/fd/{}", device.as_raw_fd()));
            process::inherit_fd(&mut command, device);
        } else {
            command.arg(&self.path);
        }
        command.stdin(from_server).stdout(to_server);
        Ok(command)
    }

    /// SIGKILL: the mount stays, every access answers ENOTCONN.
    pub fn crash(&mut self) -> Result<(), ScenarioError> {
        self.holds_lookups = false;
        if let Some(process) = self.process.take() {
            process.kill().map_err(io_step(format!("kill {}", self.daemon.name())))?;
        }
        // Its helper would end on the closed pipe; it is not left to.
        if let Some(helper) = self.helper.take() {
            helper.kill().map_err(io_step(format!("kill the helper of {}", self.daemon.name())))?;
        }
        self.kill_successor()
    }

    /// SIGSTOP: the mount stays and every access hangs until [`resume`](Self::resume).
    pub fn stop(&self) -> Result<(), ScenarioError> {
        self.signal(Signal::Stop)
    }

    pub fn resume(&self) -> Result<(), ScenarioError> {
        self.signal(Signal::Cont)
    }

    fn signal(&self, signal: Signal) -> Result<(), ScenarioError> {
        match (&self.process, self.successor) {
            (Some(process), _) => process.signal(signal).map_err(io_step(format!("signal {}", self.daemon.name()))),
            (None, Some(pid)) => process::signal(pid, signal).map_err(io_step(format!("signal the successor {pid}"))),
            (None, None) => Ok(()),
        }
    }

    /// Brings the daemon back with new content, in the given style.
    pub fn restart(&mut self, sandbox: &Sandbox, style: Restart) -> Result<(), ScenarioError> {
        self.crash()?;
        match style {
            Restart::UnmountThenMount => {
                // As restart scripts do (`umount -l … || true`): nothing to
                // detach (EINVAL) when the supervisor detached it already.
                let path = self.path.clone();
                let detached = sandbox.run(move || match mount::detach(&path) {
                    Err(err) if err.kind() == std::io::ErrorKind::InvalidInput => Ok(()),
                    other => other,
                });
                detached.map_err(io_step("detach the stale global mount"))?;
            }
            Restart::MountOverStale if !self.daemon.mounts_over_stale() => {
                return Err(ScenarioError::CannotMountOverStale { daemon: self.daemon.name() });
            }
            Restart::MountOverStale | Restart::InPlace => {}
        }
        self.generation += 1;
        self.write_generation(sandbox)?;
        self.launch(sandbox, style == Restart::MountOverStale && self.daemon == Daemon::Sshfs)
    }

    /// Like [`FuseSource::restart`], with `daemon` serving the same backing
    /// directory at the same path from now on (a FUSE pod whose image
    /// changed): a mix of daemons and restart styles on one node.
    pub fn restart_as(&mut self, sandbox: &Sandbox, daemon: Daemon, style: Restart) -> Result<(), ScenarioError> {
        if self.delegation.is_some() {
            return Err(ScenarioError::Io {
                step: format!("restart as {}", daemon.name()),
                source: io::Error::other("a delegating demofs cannot change its daemon"),
            });
        }
        self.crash()?;
        self.daemon = daemon;
        self.restart(sandbox, style)
    }

    /// Binds the source into a pod volume directory, as a CSI driver does.
    pub fn bind_volume(&self, sandbox: &Sandbox, pod_uid: &str, volume: &str) -> Result<PathBuf, ScenarioError> {
        let target = sandbox.pod_volume_dir(pod_uid, volume);
        sandbox.bind(&self.path, &target).map_err(|err| ScenarioError::Io {
            step: format!("bind {} onto {}: {err}", self.path.display(), target.display()),
            source: io::Error::other(err.to_string()),
        })?;
        Ok(target)
    }

    /// Binds the source's subdirectory into a pod's volume-subpaths, as the
    /// kubelet does for a subPath mount.
    pub fn bind_subpath(&self, sandbox: &Sandbox, pod_uid: &str, volume: &str) -> Result<PathBuf, ScenarioError> {
        let target = sandbox.subpath_dir(pod_uid, volume, "app", 0);
        let source = self.path.join(SUBDIR);
        sandbox.bind(&source, &target).map_err(|err| ScenarioError::Io {
            step: format!("bind {} onto {}: {err}", source.display(), target.display()),
            source: io::Error::other(err.to_string()),
        })?;
        Ok(target)
    }
}

impl Drop for FuseSource {
    fn drop(&mut self) {
        if let Err(err) = self.kill_successor() {
            eprintln!("cannot kill the successor of {}: {err}", self.path.display());
        }
    }
}

fn read_pid(path: &Path) -> io::Result<u32> {
    let text = fs::read_to_string(path)?;
    text.trim().parse().map_err(|_| io::Error::new(io::ErrorKind::InvalidData, format!("pid file: {text:?}")))
}
